// The units of a run in canonical order and their assignment to ranks (src/replay/internal.hpp).
#include <fmt/format.h>

#include <algorithm>
#include <cctype>

#include "internal.hpp"

namespace mxscope {

std::vector<int> assign_units(const std::vector<std::uint64_t>& costs, int ranks) {
  __extension__ using wide = unsigned __int128;  // N (2 P + c) needs more than 64 bits for big runs
  std::vector<int> owner(costs.size(), 0);
  if (ranks <= 1 || costs.empty()) return owner;
  wide total = 0;
  for (const std::uint64_t c : costs) total += c;
  wide prefix = 0;
  for (std::size_t i = 0; i < costs.size(); ++i) {
    wide position = 0;
    if (total == 0) {
      position = static_cast<wide>(i) * static_cast<wide>(ranks) / static_cast<wide>(costs.size());
    } else {
      position = (2 * prefix + costs[i]) * static_cast<wide>(ranks) / (2 * total);
    }
    owner[i] = static_cast<int>(std::min<wide>(position, static_cast<wide>(ranks - 1)));
    prefix += costs[i];
  }
  return owner;
}

namespace replay_internal {

namespace {

std::string fragment_stem(std::size_t index, const std::string& layer) {
  std::string safe;
  for (char c : layer) safe += (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-') ? c : '_';
  if (safe.size() > 80) safe.resize(80);
  return fmt::format("{:05d}-{}", index, safe);
}


// Relative cost of one operand's format in the CPU emulator, in quarters of an MXFP4 fp32-block
// product (measured on the sample Wgrad ablation, one thread: docs/scaling.md). Formats with an
// integer block kernel are cheap (fp4, fp6 and int8 on the int16 kernels, e4m3 on the wide fp64
// kernel, NVFP4 on the int16 ones with its scales' mantissas in the elements); bf16 / fp32 (the
// certified fp64 kernel and the exact reference's product shared or recomputed) and e5m2 (binade
// parts) cost more.
std::uint64_t operand_weight(const quantize_options& options) {
  const bool e5m2 = options.format.element == core::element_kind::fp8_e5m2;
  switch (options.format.scheme) {
    case quant_scheme::mx: return e5m2 ? 400 : (options.format.element == core::element_kind::fp8_e4m3 ? 5 : 4);
    case quant_scheme::nvfp4: return 13;
    case quant_scheme::per_tensor: return e5m2 ? 20 : 10;  // e5m2: binade parts, certified blocks
    default: return 6;  // bf16 and fp32
  }
}

// The weight of a strategy: its costlier operand, times the model's factor (the per-entry models
// trunc-align and trunc-promote cost about 3 to 4 times a block model).
std::uint64_t strategy_weight(const strategy& chosen) {
  const std::uint64_t operand = std::max(operand_weight(chosen.a.quantize), operand_weight(chosen.b.quantize));
  switch (chosen.accumulation.kind) {
    case accumulation_kind::trunc_align: return operand * 3;
    case accumulation_kind::trunc_promote: return operand * 4;
    default: return operand;
  }
}

}  // namespace

unit_catalog::unit_catalog(const std::vector<layer_plan>& plan, const analysis& parsed)
    : plan_(&plan), parsed_(&parsed), gemms_(parsed.gemms.size()), strategies_(parsed.strategies.size()) {}

unit_index unit_catalog::at(std::size_t index) const {
  return unit_index{index / (gemms_ * strategies_), (index / strategies_) % gemms_, index % strategies_};
}

std::string unit_catalog::fragment_name(std::size_t index) const {
  const unit_index unit = at(index);
  return fmt::format("{}.{}.{:03d}.unit", fragment_stem(unit.layer, (*plan_)[unit.layer].name),
                     gemm_kind_name(parsed_->gemms[unit.gemm]), unit.strategy);
}

std::string unit_catalog::text(std::size_t index) const {
  const unit_index unit = at(index);
  return fmt::format("({}, {}, {})", (*plan_)[unit.layer].name, gemm_kind_name(parsed_->gemms[unit.gemm]),
                     parsed_->strategies[unit.strategy].name);
}

unit_assignment assign_pending(const std::vector<layer_plan>& plan, const analysis& parsed,
                               const std::string& done_at_start, int ranks, int rank) {
  const std::size_t gemm_count = parsed.gemms.size();
  const std::size_t strategy_count = parsed.strategies.size();
  const std::size_t units_per_layer = gemm_count * strategy_count;
  const std::size_t unit_count = plan.size() * units_per_layer;
  unit_assignment out;
  std::vector<std::size_t> pending;
  std::vector<std::uint64_t> costs;
  for (std::size_t index = 0; index < unit_count; ++index) {
    if (done_at_start[index] == '1') {
      ++out.units_resumed;
      continue;
    }
    std::uint64_t cost = 0;
    for (const auto* entry : plan[index / units_per_layer].entries) {
      cost += static_cast<std::uint64_t>(entry->tokens) * static_cast<std::uint64_t>(entry->in_features) *
              static_cast<std::uint64_t>(entry->out_features);
    }
    const std::size_t gemm = (index / strategy_count) % gemm_count;
    cost *= strategy_weight(parsed.strategies[index % strategy_count].for_gemm(parsed.gemms[gemm]));
    pending.push_back(index);
    costs.push_back(cost);
  }
  const std::vector<int> owners = assign_units(costs, ranks);
  out.mine.assign(unit_count, false);
  for (std::size_t i = 0; i < pending.size(); ++i) out.mine[pending[i]] = owners[i] == rank;
  for (std::size_t layer_index = 0; layer_index < plan.size(); ++layer_index) {
    const auto first = done_at_start.begin() + static_cast<std::ptrdiff_t>(layer_index * units_per_layer);
    if (std::all_of(first, first + static_cast<std::ptrdiff_t>(units_per_layer), [](char c) { return c == '1'; })) {
      ++out.layers_resumed;
    }
    for (std::size_t u = 0; u < units_per_layer; ++u) {
      if (out.mine[layer_index * units_per_layer + u]) {
        out.entries += static_cast<std::int64_t>(plan[layer_index].entries.size());
        break;
      }
    }
  }
  return out;
}

}  // namespace replay_internal

}  // namespace mxscope
