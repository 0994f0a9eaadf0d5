#include "step.hpp"

#include <fmt/format.h>

#include <Eigen/Core>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>

#include "../backend/backend.hpp"
#include "mxscope/core/growth.hpp"
#include "mxscope/core/nvfp4.hpp"
#include "mxscope/cross_step.hpp"
#include "mxscope/reference.hpp"

namespace mxscope::replay_internal {

namespace {

using namespace replay_rows;  // the units' state and their rows (rows.hpp)
using core::ratio;            // 0/0 = 0, x/0 = inf (core/growth.hpp)
using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point from) {
  return std::chrono::duration<double>(clock_type::now() - from).count();
}

// One result of a step where it lives: with --device gpu in device memory (left there by the GPU,
// or uploaded once when it was computed on the host), with a host copy made only when a stage on
// the host asks for it; on the CPU, the host matrix.
template <class Matrix>
class located {
 public:
  located(Matrix host, device_matrix_ptr device) : host_(std::move(host)), device_(std::move(device)) {
    host_valid_ = !device_;
  }
  const Matrix& host() {
    if (!host_valid_) {
      backend::download(*device_, host_);
      host_valid_ = true;
    }
    return host_;
  }
  const backend::device_matrix& device() {
    if (!device_) device_ = backend::upload(host_);
    return *device_;
  }

 private:
  Matrix host_;
  device_matrix_ptr device_;
  bool host_valid_ = true;
};

// The reference step of one (layer, GEMM): on the GPU where its state lives there, else on the host.
reference_step_norms cross_step_reference(gemm_state& state, located<matrix64>& g, const optimizer_settings& settings,
                                          placement_counts& placed, std::ostream& log) {
  if (state.device_reference) {
    try {
      const reference_step_norms norms = backend::step(*state.device_reference, g.device(), settings);
      ++placed.cross_step_gpu;
      return norms;
    } catch (const std::exception& error) {
      // Only the first step's allocation may fall back.
      if (!backend::is_device_error(error) || backend::steps(*state.device_reference) != 0) throw;
      log << "replay: the cross-step state of a " << gemm_kind_name(state.kind)
          << " reference stays on the host (GPU: " << error.what() << ")\n";
      state.device_reference.reset();
      for (auto& unit : state.units) unit.device_accumulators.reset();  // they read the reference's state
    }
  }
  ++placed.cross_step_cpu;
  return reference_step(state.reference, g.host(), settings);
}

// The step of one unit, where its state lives (see unit_state and gemm_state).
unit_step_norms cross_step_unit(gemm_state& state, unit_state& unit, located<matrix>& estimate,
                                located<matrix64>& exact, located<matrix64>& g, const optimizer_settings& settings,
                                placement_counts& placed, std::ostream& log) {
  if (unit.device_accumulators) {
    try {
      const unit_step_norms norms = backend::step(*unit.device_accumulators, *state.device_reference,
                                                  estimate.device(), exact.device(), settings);
      ++placed.cross_step_gpu;
      return norms;
    } catch (const std::exception& error) {
      if (!backend::is_device_error(error) || backend::steps(*unit.device_accumulators) != 0) throw;
      log << "replay: the cross-step state of a " << gemm_kind_name(state.kind) << " unit (" << unit.strategy_name
          << ") stays on the host (GPU: " << error.what() << ")\n";
      unit.device_accumulators.reset();
    }
  }
  if (state.device_reference && state.reference.steps != backend::steps(*state.device_reference)) {
    backend::download(*state.device_reference, state.reference);
  }
  ++placed.cross_step_cpu;
  return unit_step(unit.accumulators, state.reference, estimate.host(), exact.host(), g.host(), settings);
}

// The comparison of a step's estimate with the reference, on `device`: on the GPU from device memory.
comparison compare_located(compute_device device, located<matrix>& estimate, located<matrix64>& g,
                           located<matrix>& g32, placement_counts& placed) {
  if (device == compute_device::gpu) {
    ++placed.compare_gpu;
    return backend::compare(estimate.device(), g.device(), g32.device());
  }
  return compare_on(device, estimate.host(), g.host(), g32.host(), &placed);
}

const matrix& captured(const io::dump_entry& entry, std::string_view name) {
  if (name == "x") return entry.x;
  if (name == "dy") return entry.dy;
  return *entry.w;
}

// The reference of one (layer, GEMM) at this entry. With --device gpu and the exact reference, from
// the entry's operands already in device memory (compute.resident_operands), oriented there, and
// left there (the host matrices of the result empty); otherwise oriented on the host.
reference_result reference_of(gemm_kind kind, const io::dump_entry& entry, reference_kind reference,
                              compute_device device, gemm_options& compute, placement_counts& placed) {
  compute.known_exact.reset();
  const gemm_layout layout = layout_of(kind);
  const matrix& a = captured(entry, layout.a_name);
  const matrix& b = captured(entry, layout.b_name);
  if (device == compute_device::gpu && reference == reference_kind::exact) {
    const device_matrix_ptr a_device = compute.resident_copy(a);
    const device_matrix_ptr b_device = compute.resident_copy(b);
    if (a_device && b_device) {
      ++placed.reference_gpu;
      return backend::exact_reference(a_device, layout.a_axis, b_device, layout.b_axis, compute);
    }
  }
  const canonical_pair canonical = canonical_operands(kind, a, b);
  return reference_on(device, canonical.a, canonical.b, reference, &placed, compute.keep_on_device);
}

// ---------------------------------------------------------------------------------------------
// Attribution (--attribute): split each operand's quantization error dv = deq(q(v)) - v into flush
// (nonzero input quantized to zero), clip (input beyond the largest value its block can hold) and
// round (the rest), and measure ||dA_kind B^T|| and ||A dB_kind^T|| relative to ||G||, in the
// rotated basis (a diagnostic, not an exact quantity): on the CPU with fp64 products (Eigen), on
// the GPU with the exact reference GEMM rounded to fp64, so the two devices agree to about 1e-15
// relative, not bit for bit.

struct error_split {
  matrix flush, clip, round;  // canonical orientation [rows, R]
};

error_split split_error(const matrix& rotated, const quantized_tensor& q, int axis) {
  // Largest magnitude representable in each element's block.
  const auto& options = q.options;
  const auto limit = [&](std::int64_t r, std::int64_t c) -> double {
    switch (options.format.scheme) {
      case quant_scheme::mx: {
        const std::uint8_t scale = axis == 1 ? q.scales[static_cast<std::size_t>(r * q.scale_cols + c / q.block)]
                                             : q.scales[static_cast<std::size_t>((r / q.block) * q.scale_cols + c)];
        if (scale == core::scale_nan_code) return std::numeric_limits<double>::infinity();
        return core::max_normal(options.format.element) * core::pow2(core::scale_exponent(scale));
      }
      case quant_scheme::nvfp4: {
        const core::nvfp4_tile tile = core::nvfp4_tile_of(axis, options.nvfp4_2d);
        const std::uint8_t scale = q.scales[static_cast<std::size_t>((r / tile.rows) * q.scale_cols + c / tile.cols)];
        return 6.0 * core::decode(core::element_kind::ue4m3, scale) * static_cast<double>(q.tensor_scale);
      }
      case quant_scheme::per_tensor:
        return core::max_normal(options.format.element) * static_cast<double>(q.tensor_scale);
      default: return std::numeric_limits<double>::infinity();
    }
  };
  matrix flush(rotated.rows, rotated.cols), clip(rotated.rows, rotated.cols), round(rotated.rows, rotated.cols);
  for (std::int64_t r = 0; r < rotated.rows; ++r) {
    for (std::int64_t c = 0; c < rotated.cols; ++c) {
      const float v = rotated(r, c);
      const float d = q.dequantized(r, c);
      const float delta = d - v;
      if (v != 0.0f && d == 0.0f) {
        flush(r, c) = delta;
      } else if (std::fabs(static_cast<double>(v)) > limit(r, c)) {
        clip(r, c) = delta;
      } else {
        round(r, c) = delta;
      }
    }
  }
  error_split out;
  out.flush = axis == 1 ? std::move(flush) : transposed(flush);
  out.clip = axis == 1 ? std::move(clip) : transposed(clip);
  out.round = axis == 1 ? std::move(round) : transposed(round);
  return out;
}

double product_norm(compute_device device, const matrix& left, const matrix& right) {
  if (device == compute_device::gpu) {
    const reference_result product = reference_on(device, left, right, reference_kind::exact, nullptr, false);
    return std::sqrt(squared_norm(product.fp64));
  }
  using dense = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const dense l = Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
                      left.data(), left.rows, left.cols)
                      .cast<double>();
  const dense r = Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
                      right.data(), right.rows, right.cols)
                      .cast<double>();
  const dense product = l * r.transpose();
  matrix64 wrapped(product.rows(), product.cols());
  std::copy(product.data(), product.data() + product.size(), wrapped.values.begin());
  return std::sqrt(squared_norm(wrapped));
}

std::array<double, 6> attribution(compute_device device, gemm_kind kind, const io::dump_entry& entry,
                                  const strategy& chosen, double reference_norm) {
  const gemm_layout layout = layout_of(kind);
  const gemm_context context{entry.info.layer, static_cast<std::uint32_t>(entry.info.step)};
  std::array<double, 6> out{};
  matrix rotated[2];
  error_split splits[2];
  const operand_strategy* operands[2] = {&chosen.a, &chosen.b};
  const std::string_view names[2] = {layout.a_name, layout.b_name};
  const int axes[2] = {layout.a_axis, layout.b_axis};
  const core::random_role roles[2] = {layout.a_role, layout.b_role};
  for (int side = 0; side < 2; ++side) {
    const matrix& tensor = captured(entry, names[side]);
    rotated[side] = rotated_operand(tensor, axes[side], chosen, context, std::string(names[side]));
    quantize_options options = operands[side]->quantize;
    options.axis = axes[side];
    options.stream = core::random_stream{
        chosen.seed, core::policy_step(operands[side]->seeds, context.step),
        core::stream_tag(core::fnv1a32(context.layer.data(), context.layer.size()), roles[side])};
    const quantized_tensor q = quantize(rotated[side], options);
    splits[side] = split_error(rotated[side], q, axes[side]);
    if (axes[side] == 0) rotated[side] = transposed(rotated[side]);
  }
  const matrix* parts_a[3] = {&splits[0].flush, &splits[0].clip, &splits[0].round};
  const matrix* parts_b[3] = {&splits[1].flush, &splits[1].clip, &splits[1].round};
  for (int k = 0; k < 3; ++k) {
    out[static_cast<std::size_t>(k)] = ratio(product_norm(device, *parts_a[k], rotated[1]), reference_norm);
    out[static_cast<std::size_t>(3 + k)] = ratio(product_norm(device, rotated[0], *parts_b[k]), reference_norm);
  }
  return out;
}

}  // namespace

void replay_gemm_step(gemm_state& state, const std::vector<std::string>& unit_texts, const step_inputs& in,
                      std::string& doing, step_times& times) {
  const io::dump_entry& entry = in.entry;
  const std::string& layer_name = entry.info.layer;
  const gemm_layout layout = layout_of(state.kind);
  doing = fmt::format("the reference of ({}, {}) at step {}", layer_name, gemm_kind_name(state.kind), entry.info.step);
  auto mark = clock_type::now();
  std::optional<backend::timeline_label> label(std::in_place, "reference");
  reference_result reference = reference_of(state.kind, entry, in.parsed.reference, in.device, in.compute, in.placed);
  located<matrix64> g(std::move(reference.fp64), std::move(reference.device_fp64));
  located<matrix> g32(std::move(reference.fp32), std::move(reference.device_fp32));
  const reference_step_norms reference_norms = cross_step_reference(state, g, in.parsed.optimizer, in.placed, in.log);
  const double reference_norm = reference_norms.reference;
  state.reference_sum_norm = reference_norms.sum;
  times.reference += seconds_since(mark);

  mark = clock_type::now();
  const gemm_context context{entry.info.layer, static_cast<std::uint32_t>(entry.info.step)};
  // On the CPU the exact reference is also the exact product of a strategy whose quantized
  // operands are the captured values (bf16 on a bf16 capture): run_gemm's exact_too takes it.
  if (in.device == compute_device::cpu && in.parsed.reference == reference_kind::exact) {
    in.compute.known_exact_host = gemm_options::known_exact_on_host{&captured(entry, layout.a_name),
                                                                   &captured(entry, layout.b_name), &g.host()};
  }
  struct forget_known {
    gemm_options& options;
    ~forget_known() { options.known_exact_host.reset(); }
  } forget{in.compute};
  for (std::size_t u = 0; u < state.units.size(); ++u) {
    auto& unit = state.units[u];
    const auto unit_started = clock_type::now();
    doing = fmt::format("unit {} at step {}", unit_texts[u], entry.info.step);
    const strategy& chosen = *unit.chosen;
    label.emplace(unit.strategy_name + ": gemm");
    // The same quantized operands under the exact model separate quantization from accumulation.
    gemm_result result = run_gemm(state.kind, in.operands, chosen, context, in.compute);
    in.placed.count(result);
    const bool exact_model = chosen.accumulation.kind == accumulation_kind::exact;
    located<matrix> estimate(std::move(result.out), std::move(result.device_out));
    located<matrix64> exact_result(std::move(exact_model ? result.exact : result.exact_of_quantized),
                                   std::move(exact_model ? result.device_exact : result.device_exact_of_quantized));
    unit.stage_seconds[0] += seconds_since(unit_started);
    unit.stage_seconds[3] += result.quantize_seconds;
    unit.stage_seconds[4] += result.product_seconds;
    unit.stage_seconds[5] += result.exact_product_seconds;
    auto stage_mark = clock_type::now();
    label.emplace(unit.strategy_name + ": compare");
    const comparison metrics = compare_located(in.device, estimate, g, g32, in.placed);
    unit.stage_seconds[1] += seconds_since(stage_mark);
    stage_mark = clock_type::now();
    label.emplace(unit.strategy_name + ": metrics");
    // One pass over the output for every norm of this step and the cross-step state.
    const unit_step_norms norms =
        cross_step_unit(state, unit, estimate, exact_result, g, in.parsed.optimizer, in.placed, in.log);
    const double quant_err = ratio(norms.quantization, reference_norm);
    const double accum_err = ratio(norms.accumulation, reference_norm);
    std::array<double, 6> attributed;
    attributed.fill(std::numeric_limits<double>::quiet_NaN());
    if (in.attribute) attributed = attribution(in.device, state.kind, entry, chosen, reference_norm);

    add_step_row(unit, step_values(metrics, quant_err, accum_err, result, attributed), layer_name, state.kind,
                 entry.info.step, in.t, layout);
    add_cross_step_row(unit, norms, reference_norms, in.t, layer_name, state.kind, entry.info.step);
    unit.stage_seconds[2] += seconds_since(stage_mark);
    unit.seconds += seconds_since(unit_started);
  }
  times.strategies += seconds_since(mark);
}

}  // namespace mxscope::replay_internal
