#include "mxscope/replay.hpp"

#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <Eigen/Core>
#include <cerrno>
#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <regex>
#include <set>
#include <sstream>
#include <type_traits>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "mxscope/analysis.hpp"
#include "mxscope/core/growth.hpp"
#include "mxscope/core/nvfp4.hpp"
#include "mxscope/compare.hpp"
#include "mxscope/cross_step.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/gemm.hpp"
#include "mxscope/device.hpp"
#ifdef MXSCOPE_HAVE_CUDA
#include "mxscope/gpu.hpp"
#endif
#include "mxscope/io/atomic_file.hpp"
#include "mxscope/io/dump.hpp"
#include "mxscope/io/sha256.hpp"
#include "mxscope/parallel.hpp"
#include "mxscope/reference.hpp"
#include "mxscope/version.hpp"
#include "replay_rows.hpp"
#include "run_directory.hpp"

namespace mxscope {

namespace {

using json = nlohmann::ordered_json;
using clock_type = std::chrono::steady_clock;
using namespace replay_rows;  // the units' state and their rows (src/replay_rows.hpp)

using core::ratio;  // 0/0 = 0, x/0 = inf (core/growth.hpp)

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
#ifdef MXSCOPE_HAVE_CUDA
    if (!host_valid_) {
      if constexpr (std::is_same_v<Matrix, matrix>) {
        host_ = device_->download32();
      } else {
        host_ = device_->download64();
      }
      host_valid_ = true;
    }
#endif
    return host_;
  }
#ifdef MXSCOPE_HAVE_CUDA
  const gpu::device_matrix& device() {
    if (!device_) device_ = std::make_shared<const gpu::device_matrix>(gpu::device_matrix::upload(host_));
    return *device_;
  }
#endif

 private:
  Matrix host_;
  device_matrix_ptr device_;
  bool host_valid_ = true;
};

// The reference step of one (layer, GEMM): on the GPU where its state lives there, else on the host.
reference_step_norms cross_step_reference(gemm_state& state, located<matrix64>& g, const optimizer_settings& settings,
                                          placement_counts& placed, std::ostream& log) {
#ifdef MXSCOPE_HAVE_CUDA
  if (state.device_reference) {
    try {
      const reference_step_norms norms = state.device_reference->step(g.device(), settings);
      ++placed.cross_step_gpu;
      return norms;
    } catch (const gpu::gpu_error& error) {
      if (state.device_reference->steps() != 0) throw;  // only the first step's allocation may fall back
      log << "replay: the cross-step state of a " << gemm_kind_name(state.kind)
          << " reference stays on the host (GPU: " << error.what() << ")\n";
      state.device_reference.reset();
      for (auto& unit : state.units) unit.device_accumulators.reset();  // they read the reference's state
    }
  }
#else
  (void)log;
#endif
  ++placed.cross_step_cpu;
  return reference_step(state.reference, g.host(), settings);
}

// The step of one unit, where its state lives (see unit_state and gemm_state).
unit_step_norms cross_step_unit(gemm_state& state, unit_state& unit, located<matrix>& estimate,
                                located<matrix64>& exact, located<matrix64>& g, const optimizer_settings& settings,
                                placement_counts& placed, std::ostream& log) {
#ifdef MXSCOPE_HAVE_CUDA
  if (unit.device_accumulators) {
    try {
      const unit_step_norms norms =
          unit.device_accumulators->step(*state.device_reference, estimate.device(), exact.device(), settings);
      ++placed.cross_step_gpu;
      return norms;
    } catch (const gpu::gpu_error& error) {
      if (unit.device_accumulators->steps() != 0) throw;
      log << "replay: the cross-step state of a " << gemm_kind_name(state.kind) << " unit (" << unit.strategy_name
          << ") stays on the host (GPU: " << error.what() << ")\n";
      unit.device_accumulators.reset();
    }
  }
  if (state.device_reference && state.reference.steps != state.device_reference->steps()) {
    state.device_reference->download(state.reference);
  }
#else
  (void)log;
#endif
  ++placed.cross_step_cpu;
  return unit_step(unit.accumulators, state.reference, estimate.host(), exact.host(), g.host(), settings);
}

// The comparison of a step's estimate with the reference, on `device`: on the GPU from device memory.
comparison compare_located(compute_device device, located<matrix>& estimate, located<matrix64>& g,
                           located<matrix>& g32, placement_counts& placed) {
#ifdef MXSCOPE_HAVE_CUDA
  if (device == compute_device::gpu) {
    ++placed.compare_gpu;
    return gpu::compare(estimate.device(), g.device(), g32.device());
  }
#endif
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
#ifdef MXSCOPE_HAVE_CUDA
  if (device == compute_device::gpu && reference == reference_kind::exact) {
    const device_matrix_ptr a_device = compute.resident_copy(a);
    const device_matrix_ptr b_device = compute.resident_copy(b);
    if (a_device && b_device) {
      const auto oriented = [](const device_matrix_ptr& values, int axis) -> device_matrix_ptr {
        if (axis == 1) return values;
        return std::make_shared<const gpu::device_matrix>(gpu::transposed(*values));
      };
      const device_matrix_ptr left = oriented(a_device, layout.a_axis);
      const device_matrix_ptr right = oriented(b_device, layout.b_axis);
      ++placed.reference_gpu;
      reference_result result = gpu::reference_gemm(*left, *right, compute.keep_on_device);
      if (compute.keep_on_device) {
        // For a strategy whose unscaled operands have these bits (bf16 on a bf16 capture): its exact
        // product is this result (reset with the entry's resident operands).
        compute.known_exact = gemm_options::known_exact_product{left, right, result.device_fp64, result.device_fp32};
      }
      return result;
    }
  }
#endif
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

// ---------------------------------------------------------------------------------------------
// Run identity: what must match for --resume to reuse fragments.

// The key covers every input: the analysis text, the manifest and each selected entry file by its
// SHA-256, so that --resume never mixes results of edited inputs with fresh ones.
std::string run_key(const analysis& parsed, const io::dump_reader& dump, const replay_options& options,
                    bool attribute, const std::map<std::string, std::string>& input_sha256) {
  json key;
  key["analysis_sha256"] = io::sha256_hex(parsed.text);
  key["manifest_sha256"] = io::sha256_file(dump.directory() / "manifest.json");
  key["layers"] = options.layers.value_or("");
  key["steps"] = options.steps.value_or("");
  key["attribute"] = attribute;
  key["mxscope"] = version_string;
  key["input_sha256"] = input_sha256;
  return key.dump(2) + "\n";
}

std::string read_text(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  std::ostringstream text;
  text << file.rdbuf();
  return text.str();
}

std::string fragment_stem(std::size_t index, const std::string& layer) {
  std::string safe;
  for (char c : layer) safe += (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-') ? c : '_';
  if (safe.size() > 80) safe.resize(80);
  return fmt::format("{:05d}-{}", index, safe);
}

struct layer_plan {
  std::string name;
  std::vector<const io::dump_entry_info*> entries;
};

// The SHA-256 of every entry file of the plan, by its path relative to the dump, hashed on
// `threads` threads.
std::map<std::string, std::string> hash_inputs(const std::vector<layer_plan>& plan, int threads) {
  std::vector<const io::dump_entry_info*> entries;
  for (const auto& layer : plan) entries.insert(entries.end(), layer.entries.begin(), layer.entries.end());
  std::vector<std::string> hashes(entries.size());
  std::vector<std::future<void>> workers;
  std::atomic<std::size_t> next{0};
  for (int w = 0; w < std::max(threads, 1); ++w) {
    workers.push_back(std::async(std::launch::async, [&] {
      for (std::size_t i = next++; i < entries.size(); i = next++) hashes[i] = io::sha256_file(entries[i]->file);
    }));
  }
  for (auto& worker : workers) worker.get();
  std::map<std::string, std::string> out;
  for (std::size_t i = 0; i < entries.size(); ++i) out[entries[i]->relative_file] = hashes[i];
  return out;
}

}  // namespace

std::vector<std::int64_t> parse_step_list(const std::string& text, const std::string& what) {
  std::set<std::int64_t> steps;
  std::stringstream stream(text);
  std::string item;
  const auto parse_int = [&](const std::string& s) {
    std::size_t used = 0;
    std::int64_t value = -1;
    try {
      value = std::stoll(s, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != s.size() || s.empty() || value < 0) {
      throw input_error(fmt::format("{}: '{}' is not a step list such as '3,5-9,12'", what, text));
    }
    return value;
  };
  while (std::getline(stream, item, ',')) {
    const auto dash = item.find('-');
    if (dash == std::string::npos) {
      steps.insert(parse_int(item));
    } else {
      const std::int64_t first = parse_int(item.substr(0, dash));
      const std::int64_t last = parse_int(item.substr(dash + 1));
      if (last < first || last - first > 10'000'000) {
        throw input_error(fmt::format("{}: range '{}' is empty or too long", what, item));
      }
      for (std::int64_t s = first; s <= last; ++s) steps.insert(s);
    }
  }
  if (steps.empty()) throw input_error(fmt::format("{}: empty step list", what));
  return {steps.begin(), steps.end()};
}

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

namespace {

namespace fs = std::filesystem;

// std::regex compiles and matches by recursion: a pattern of tens of thousands of nested groups
// exhausts the stack. Layer filters are short; refuse long or deeply nested ones up front.
constexpr std::size_t max_layer_pattern = 1024;
constexpr int max_layer_pattern_depth = 32;
void check_layer_pattern(const std::string& pattern) {
  if (pattern.size() > max_layer_pattern) {
    throw input_error(fmt::format("--layers: the pattern has {} characters; at most {} are accepted", pattern.size(),
                                  max_layer_pattern));
  }
  int depth = 0;
  bool in_class = false;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\') {
      ++i;
    } else if (in_class) {
      in_class = c != ']';
    } else if (c == '[') {
      in_class = true;
    } else if (c == '(' && ++depth > max_layer_pattern_depth) {
      throw input_error(fmt::format("--layers: groups nested more than {} deep", max_layer_pattern_depth));
    } else if (c == ')' && depth > 0) {
      --depth;
    }
  }
}

// Relative cost of one operand's format in the CPU emulator, in quarters of an MXFP4 fp32-block
// product (measured on the sample Wgrad ablation, one thread: docs/scaling.md). Formats with an
// integer block kernel are cheap; e5m2 elements and per-tensor scales go through slower paths.
std::uint64_t operand_weight(const quantize_options& options) {
  const bool e5m2 = options.format.element == core::element_kind::fp8_e5m2;
  switch (options.format.scheme) {
    case quant_scheme::mx:
      if (e5m2) return 400;
      return core::spec(options.format.element).bits <= 6 ? 4 : 20;
    case quant_scheme::nvfp4: return 32;
    case quant_scheme::per_tensor: return e5m2 ? 76 : 32;  // e5m2: 19x (binade parts, short-float blocks)
    default: return 10;  // bf16 and fp32
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

// One (layer, gemm, strategy) unit, by its indices into the plan, the analysis's gemms and its
// strategies. Its canonical index is (layer * gemms + gemm) * strategies + strategy.
struct unit_index {
  std::size_t layer = 0;
  std::size_t gemm = 0;
  std::size_t strategy = 0;
};

std::string unit_fragment_name(const unit_index& unit, const std::string& layer, gemm_kind kind) {
  return fmt::format("{}.{}.{:03d}.unit", fragment_stem(unit.layer, layer), gemm_kind_name(kind), unit.strategy);
}

std::string this_host() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "unknown";
  return name;
}

// Runs `work` in every process. With one process this is a plain call. With several, when `work`
// throws anywhere every process stops: the lowest failing rank rethrows its exception (so the
// message is printed once) and the others throw reported_elsewhere. Returns every rank's text.
std::vector<std::string> together(process_group& world, const std::function<std::string()>& work) {
  if (world.size() == 1) return {work()};
  std::string text;
  std::exception_ptr failure;
  try {
    text = "ok\n" + work();
  } catch (...) {
    failure = std::current_exception();
    text = "failed\n";
  }
  std::vector<std::string> all = world.all_gather(text);
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r].starts_with("failed\n")) {
      if (static_cast<int>(r) == world.rank()) std::rethrow_exception(failure);
      throw reported_elsewhere(0);  // the reporting rank exits 2 (errors.hpp)
    }
  }
  for (auto& item : all) item.erase(0, 3);
  return all;
}

// The unit fragments of RUN/.partial merged back into the order of rows of one process (layer,
// step, gemm, strategy): their steps.csv and accumulation.csv lines go into the two files; their
// summaries and the seconds each strategy took (as measured by whichever rank ran the unit) come
// back. A fragment with the wrong number of lines, no summary or another unit's name is damaged:
// the assembly stops and names it.
struct merged_fragments {
  json units = json::array();
  std::vector<double> strategy_seconds;
  std::vector<json> strategy_stage_seconds;
};

template <class UnitAt, class FragmentName, class UnitText>
merged_fragments merge_fragments(const std::vector<layer_plan>& plan, std::size_t units_per_layer,
                                 std::size_t strategy_count, const fs::path& partial, const UnitAt& unit_at,
                                 const FragmentName& fragment_name, const UnitText& unit_text,
                                 io::atomic_file& steps_file, io::atomic_file& accumulation_file) {
  merged_fragments out;
  out.strategy_seconds.assign(strategy_count, 0.0);
  out.strategy_stage_seconds.assign(strategy_count, json::object());
  for (std::size_t layer_index = 0; layer_index < plan.size(); ++layer_index) {
    const std::size_t steps = plan[layer_index].entries.size();
    std::vector<json> fragments;
    std::vector<std::vector<std::string_view>> step_lines, accumulation_lines;
    fragments.reserve(units_per_layer);
    for (std::size_t u = 0; u < units_per_layer; ++u) {
      const std::size_t index = layer_index * units_per_layer + u;
      const fs::path path = partial / fragment_name(index);
      fragments.push_back(json::parse(read_text(path), nullptr, false));
      const json& fragment = fragments.back();
      const auto lines = [&](const char* field) {
        std::vector<std::string_view> found;
        if (!fragment.is_object() || !fragment.contains(field) || !fragment[field].is_string()) return found;
        const std::string& text = fragment[field].get_ref<const std::string&>();
        for (std::size_t begin = 0; begin < text.size();) {
          const std::size_t end = text.find('\n', begin);
          if (end == std::string::npos) break;
          found.emplace_back(text.data() + begin, end + 1 - begin);
          begin = end + 1;
        }
        return found;
      };
      step_lines.push_back(lines("steps"));
      accumulation_lines.push_back(lines("accumulation"));
      if (step_lines.back().size() != steps || accumulation_lines.back().size() != steps ||
          !fragment.contains("summary") || fragment.value("unit", "") != unit_text(index)) {
        throw std::runtime_error(fmt::format("{}: damaged fragment of unit {}; delete it and run again with --resume",
                                             path.string(), unit_text(index)));
      }
      out.units.push_back(fragment["summary"]);
      const std::size_t strategy = unit_at(index).strategy;
      out.strategy_seconds[strategy] += fragment.value("seconds", 0.0);
      if (fragment.contains("stage_seconds")) {
        for (const char* stage : {"gemm", "compare", "metrics", "gemm_quantize", "gemm_product", "gemm_exact_product"}) {
          out.strategy_stage_seconds[strategy][stage] =
              out.strategy_stage_seconds[strategy].value(stage, 0.0) + fragment["stage_seconds"].value(stage, 0.0);
        }
      }
    }
    for (std::size_t t = 0; t < steps; ++t) {
      for (std::size_t u = 0; u < units_per_layer; ++u) {
        steps_file.write(step_lines[u][t]);
        accumulation_file.write(accumulation_lines[u][t]);
      }
    }
  }
  return out;
}

// The entries the replay selects (--layers, --steps), grouped by layer in dump order, checked
// against the analysis before any work starts: the GEMMs other than Wgrad need w, and every
// strategy's rotation must divide every reduction length it is applied to.
std::vector<layer_plan> select_entries(const replay_options& options, const analysis& parsed,
                                       const io::dump_reader& dump) {
  std::vector<layer_plan> plan;
  std::optional<std::regex> layer_filter;
  if (options.layers) {
    check_layer_pattern(*options.layers);
    try {
      layer_filter.emplace(*options.layers, std::regex::ECMAScript);
    } catch (const std::regex_error& error) {
      throw input_error(
          fmt::format("--layers: '{}' is not a valid regular expression: {}", *options.layers, error.what()));
    }
  }
  std::optional<std::set<std::int64_t>> step_filter;
  if (options.steps) {
    const auto list = parse_step_list(*options.steps, "--steps");
    step_filter.emplace(list.begin(), list.end());
  }
  for (const auto& entry : dump.entries()) {
    if (layer_filter && !std::regex_match(entry.layer, *layer_filter)) continue;
    if (step_filter && !step_filter->contains(entry.step)) continue;
    if (plan.empty() || plan.back().name != entry.layer) plan.push_back({entry.layer, {}});
    plan.back().entries.push_back(&entry);
  }
  if (plan.empty()) {
    throw input_error(fmt::format("{}: no entries match --layers '{}' and --steps '{}'", options.dump.string(),
                                  options.layers.value_or(".*"), options.steps.value_or("all")));
  }
  for (gemm_kind kind : parsed.gemms) {
    if (kind == gemm_kind::wgrad) continue;
    for (const auto& layer : plan) {
      for (const auto* entry : layer.entries) {
        if (!entry->w_type) {
          throw input_error(fmt::format("{}: tensor 'w' is missing, but analysis {} asks for {} (which needs w)",
                                        entry->file.string(), parsed.path, gemm_kind_name(kind)));
        }
      }
    }
  }

  // Every strategy's rotation must divide every reduction length: checked before any work starts.
  for (gemm_kind kind : parsed.gemms) {
    for (const auto& s : parsed.strategies) {
      const strategy& chosen = s.for_gemm(kind);
      if (chosen.rotation_size == 0) continue;
      for (const auto& layer : plan) {
        for (const auto* entry : layer.entries) {
          const std::int64_t reduction = kind == gemm_kind::wgrad   ? entry->tokens
                                         : kind == gemm_kind::fprop ? entry->in_features
                                                                    : entry->out_features;
          if (reduction % chosen.rotation_size != 0) {
            throw input_error(fmt::format(
                "{}: strategy '{}': rotation hadamard:{} does not divide the {} reduction length {} of layer "
                "'{}' (entry {})",
                parsed.path, s.name, chosen.rotation_size, gemm_kind_name(kind), reduction, entry->layer,
                entry->file.string()));
          }
        }
      }
    }
  }
  return plan;
}

// This rank's share of the units not finished at the start (done_at_start[i] == '1' for a finished
// unit i in canonical order: layer, gemm, strategy): each pending unit weighs the M N K of its
// layer's entries times its strategy's weight, and assign_units cuts the pending units into
// contiguous runs of nearly equal weight, one per rank.
struct unit_assignment {
  std::vector<bool> mine;           // by unit index: this rank computes it
  std::int64_t units_resumed = 0;   // units finished before this run
  std::int64_t layers_resumed = 0;  // layers whose units were all finished before this run
  std::int64_t entries = 0;         // entries this rank reads: those of the layers it owns a unit of
};

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

// When a rank dies (killed, out of memory, its node lost), the launcher terminates the others.
// The lowest rank still alive then names the ranks that are gone and the units they were on,
// from their state files (a process on another host is listed with what it was working on).
void report_termination(const fs::path& partial, int ranks, int rank, const std::string& host, std::size_t unit_count,
                        const std::function<std::string(std::size_t)>& fragment_name, std::ostream& log) {
  std::vector<json> states(static_cast<std::size_t>(ranks));
  const auto gone = [&](const json& state) {
    return state.is_object() && state.value("host", "") == host &&
           ::kill(static_cast<pid_t>(state.value("pid", std::int64_t{0})), 0) != 0 && errno == ESRCH;
  };
  for (int r = 0; r < ranks; ++r) {
    states[static_cast<std::size_t>(r)] =
        json::parse(read_text(partial / fmt::format("rank-{:05d}.json", r)), nullptr, false);
  }
  for (int r = 0; r < rank; ++r) {
    if (!gone(states[static_cast<std::size_t>(r)])) return;  // a lower rank reports
  }
  std::string message = "mxscope replay: error: the launcher stopped the run";
  std::size_t stopped_ranks = 0, stopped_units = 0;
  for (int r = 0; r < ranks; ++r) {
    const json& state = states[static_cast<std::size_t>(r)];
    if (!state.is_object()) continue;
    const bool working = state.value("state", "") == "working";
    if (r == rank || (!gone(state) && state.value("host", "") == host)) {
      // Alive: its units in progress are lost with it.
      if (working) ++stopped_ranks, stopped_units += state["units"].size();
      continue;
    }
    std::string units;
    for (const auto& unit : state["units"]) units += (units.empty() ? "" : ", ") + unit.get<std::string>();
    const std::string what = working ? fmt::format("working on {}", units)
                                     : fmt::format("in state '{}'", state.value("state", "?"));
    message += fmt::format("\nrank {} of {} (host {}, pid {}) {} {}", r, ranks, state.value("host", "?"),
                           state.value("pid", std::int64_t{0}), gone(state) ? "is gone; it was" : "was", what);
  }
  if (stopped_ranks > 0) {
    message += fmt::format("\n{} other ranks were stopped with {} units in progress", stopped_ranks, stopped_units);
  }
  std::size_t complete = 0;
  for (std::size_t index = 0; index < unit_count; ++index) complete += fs::exists(partial / fragment_name(index));
  message += fmt::format("\n{} of {} units are complete and kept in {}; finish the run with --resume (with any "
                         "number of ranks)\n",
                         complete, unit_count, partial.string());
  log << message << std::flush;
}

// summary.json's provenance: the tool, the analysis, the dump and its source, the inputs' hashes,
// the filters, the reference and whether attribution ran.
json summary_provenance(const replay_options& options, const analysis& parsed, const io::dump_reader& dump,
                        const std::map<std::string, std::string>& input_sha256, bool attribute) {
  json provenance;
  provenance["tool"] = "mxscope";
  provenance["version"] = version_string;
  provenance["git_hash"] = git_hash;
  provenance["analysis_file"] = parsed.path;
  provenance["analysis_text"] = parsed.text;
  provenance["dump"] = options.dump.string();
  json source;
  source["hardware"] = dump.source().hardware;
  source["framework"] = dump.source().framework;
  source["recipe"] = dump.source().recipe;
  source["model"] = dump.source().model;
  source["notes"] = dump.source().notes;
  provenance["dump_source"] = source;
  json inputs = json::object();
  inputs["manifest.json"] = io::sha256_file(dump.directory() / "manifest.json");
  for (const auto& [file, hash] : input_sha256) inputs[file] = hash;
  provenance["input_sha256"] = inputs;
  provenance["filters"] = {{"layers", options.layers.value_or("")}, {"steps", options.steps.value_or("")}};
  provenance["reference"] = reference_kind_name(parsed.reference);
  provenance["attribute"] = attribute;
  provenance["environment"] = "run.json (device, threads and wall times differ between runs and are kept there)";
  return provenance;
}

// The stage times of run.json's "seconds".
struct run_seconds {
  double total, read, setup, upload, hashing, reference, strategies;
};

// run.json: where each stage ran, threads and ranks, what was resumed, the stage times, the time
// of every strategy (and of its stages), and with several ranks each rank's share.
json run_record(const std::string& device_option, const std::string& gpu_name, const placement_counts& placed,
                int threads, const replay_outcome& outcome, const run_seconds& seconds, const merged_fragments& merged,
                const analysis& parsed, const std::vector<json>& per_rank) {
  json run;
  run["device"] = device_option;
  if (!gpu_name.empty()) run["gpu"] = gpu_name;
  run["placement"] = {{"quantize", {{"gpu", placed.quantize_gpu}, {"cpu", placed.quantize_cpu}}},
                      {"product", {{"gpu", placed.product_gpu}, {"cpu", placed.product_cpu}}},
                      {"reference", {{"gpu", placed.reference_gpu}, {"cpu", placed.reference_cpu}}},
                      {"compare", {{"gpu", placed.compare_gpu}, {"cpu", placed.compare_cpu}}},
                      {"cross_step", {{"gpu", placed.cross_step_gpu}, {"cpu", placed.cross_step_cpu}}}};
  run["threads"] = threads;
  run["ranks"] = per_rank.size();
  run["resumed_layers"] = outcome.layers_resumed;
  run["resumed_units"] = outcome.units_resumed;
  run["entries_replayed_in_last_process"] = outcome.entries;
  run["seconds"] = {{"total", seconds.total},
                    {"read", seconds.read},
                    {"setup", seconds.setup},
                    {"upload", seconds.upload},
                    {"hashing", seconds.hashing},
                    {"reference", seconds.reference},
                    {"strategies", seconds.strategies}};
  json per_strategy = json::object();
  json per_strategy_stage = json::object();
  for (std::size_t k = 0; k < parsed.strategies.size(); ++k) {
    per_strategy[parsed.strategies[k].name] = merged.strategy_seconds[k];
    per_strategy_stage[parsed.strategies[k].name] = merged.strategy_stage_seconds[k];
  }
  run["seconds_per_strategy"] = per_strategy;
  run["stage_seconds_per_strategy"] = per_strategy_stage;
  if (per_rank.size() > 1) {
    json ranks_json = json::array();
    for (std::size_t r = 0; r < per_rank.size(); ++r) {
      ranks_json.push_back({{"rank", r},
                            {"entries", per_rank[r]["entries"]},
                            {"units", per_rank[r]["units_done"]},
                            {"seconds", per_rank[r]["seconds"]}});
    }
    run["per_rank"] = ranks_json;
  }
  return run;
}

// The four final files, all or none: when one cannot be written (a full disk), those already
// renamed are removed again and .partial stays, so --resume assembles them once there is room.
// Then .partial goes (its run key first: without it the directory is a finished run).
void commit_final_files(const fs::path& out, const fs::path& partial, io::atomic_file& steps_file,
                        io::atomic_file& accumulation_file, const json& summary, const json& run) {
  std::error_code ignored;
  std::vector<fs::path> written;
  try {
    steps_file.commit();
    written.push_back(out / "steps.csv");
    accumulation_file.commit();
    written.push_back(out / "accumulation.csv");
    io::write_file_atomically(out / "summary.json", summary.dump(2) + "\n");
    written.push_back(out / "summary.json");
    io::write_file_atomically(out / "run.json", run.dump(2) + "\n");
  } catch (const std::exception& error) {
    for (const fs::path& path : written) fs::remove(path, ignored);
    throw std::runtime_error(fmt::format("{}\nthe final files were not written; the finished units are kept in {}; "
                                         "finish the run with --resume",
                                         error.what(), partial.string()));
  }
  fs::remove(partial / "run-key.json", ignored);
  fs::remove_all(partial, ignored);
}

}  // namespace

replay_outcome run_replay(const replay_options& options, std::ostream& log) {
  const auto started = clock_type::now();
  process_group alone;
  process_group& world = options.processes ? *options.processes : alone;
  const int rank = world.rank();
  const int ranks = world.size();
#ifdef _OPENMP
  const int threads = options.threads > 0 ? options.threads : omp_get_max_threads();
#else
  const int threads = 1;
#endif

  // Everything below up to the work is the same in every process; a bad input stops all of them.
  compute_device device = compute_device::cpu;
  gemm_options compute;
  placement_counts placed;
  std::optional<analysis> parsed_holder;
  std::optional<io::dump_reader> dump_holder;
  int gpu_index = 0;
  std::future<void> gpu_starting;
  // The GPU made current on this thread, once its background start-up is done (its error, if
  // any, is thrown here).
  const auto ready_gpu = [&] {
    if (!gpu_starting.valid()) return;
    gpu_starting.get();
    select_gpu(device, gpu_index);
  };
  std::vector<layer_plan> plan;
  bool attribute = false;
  together(world, [&] {
    device = parse_compute_device(options.device);
    // Under MPI each rank takes the GPU of its node-local rank, modulo the GPUs it sees. The
    // index is checked here; the GPU's context (a few hundred ms) is made on a background thread
    // while the analysis is parsed and the first step read (ready_gpu joins it).
    if (device == compute_device::gpu) {
      gpu_index = options.device_index % gpu_count();
      if (gpu_index < 0) select_gpu(device, gpu_index);  // the error "GPU -1 does not exist"
      gpu_starting = std::async(std::launch::async, [device, index = gpu_index] { select_gpu(device, index); });
    }
    compute.device = device;
    compute.exact_too = true;  // quant_err needs the exact product of the same quantized operands
    // The GPU's products stay in device memory for the comparison and the cross-step state.
    compute.keep_on_device = device == compute_device::gpu;
#ifdef _OPENMP
    if (options.threads > 0) omp_set_num_threads(options.threads);
#endif
    parsed_holder.emplace(load_analysis(options.analysis_path.string()));
    const analysis& parsed = *parsed_holder;
    attribute = parsed.attribute || options.attribute;
    dump_holder.emplace(options.dump);
    const io::dump_reader& dump = *dump_holder;

    plan = select_entries(options, parsed, dump);
    return std::string();
  });
  const analysis& parsed = *parsed_holder;
  const io::dump_reader& dump = *dump_holder;

  // The units, in canonical order.
  const std::size_t gemm_count = parsed.gemms.size();
  const std::size_t strategy_count = parsed.strategies.size();
  const std::size_t unit_count = plan.size() * gemm_count * strategy_count;
  const auto unit_at = [&](std::size_t index) {
    return unit_index{index / (gemm_count * strategy_count), (index / strategy_count) % gemm_count,
                      index % strategy_count};
  };
  const auto fragment_name = [&](std::size_t index) {
    const unit_index unit = unit_at(index);
    return unit_fragment_name(unit, plan[unit.layer].name, parsed.gemms[unit.gemm]);
  };
  const auto unit_text = [&](std::size_t index) {
    const unit_index unit = unit_at(index);
    return fmt::format("({}, {}, {})", plan[unit.layer].name, gemm_kind_name(parsed.gemms[unit.gemm]),
                       parsed.strategies[unit.strategy].name);
  };

  // The run directory and its identity (rank 0 alone touches it before the work starts, and holds
  // its lock until the end). The key does not hold the number of processes: any number of them
  // may resume a run.
  const fs::path partial = options.out / ".partial";
  const fs::path stop_file = partial / "stop";
  std::optional<run_directory::directory_lock> lock;
  std::map<std::string, std::string> input_sha256;
  double seconds_hashing = 0.0;
  const std::vector<std::string> setup = together(world, [&]() -> std::string {
    if (rank != 0) return "";
    run_directory::claim(options.out, dump.directory());
    lock.emplace(options.out);
    const auto hashing_started = clock_type::now();
    input_sha256 = hash_inputs(plan, std::min(threads, 8));
    seconds_hashing = std::chrono::duration<double>(clock_type::now() - hashing_started).count();
    const std::string key = run_key(parsed, dump, options, attribute, input_sha256);
    const fs::path marker = options.out / run_directory::marker_name;
    switch (run_directory::state_of(options.out)) {
      case run_directory::run_state::finished:
        if (!options.resume) {
          throw input_error(fmt::format("{}: the run directory already holds a finished run; use --resume or another "
                                        "--out",
                                        options.out.string()));
        }
        if (read_text(marker) != key) {
          throw input_error(fmt::format("{}: --resume: the finished run used another analysis, dump, filter or "
                                        "input files (see {}); use another --out",
                                        options.out.string(), marker.string()));
        }
        return "finished";
      case run_directory::run_state::interrupted:
        if (!options.resume) {
          throw input_error(fmt::format("{}: an interrupted run is in this directory; finish it with --resume or "
                                        "use another --out",
                                        options.out.string()));
        }
        if (read_text(partial / "run-key.json") != key) {
          throw input_error(fmt::format("{}: --resume: the interrupted run used another analysis, dump, filter or "
                                        "input files (see {})",
                                        options.out.string(), (partial / "run-key.json").string()));
        }
        break;
      case run_directory::run_state::empty: break;
    }
    std::error_code ignored;
    fs::create_directories(partial, ignored);
    if (!fs::is_directory(partial)) {
      throw input_error(fmt::format("{}: cannot create the run directory", options.out.string()));
    }
    // Temporary files of a process that was killed while writing (PATH.tmp.<pid>) are garbage, and
    // so are the state files of the processes of an earlier launch.
    run_directory::remove_stale_files(options.out);
    if (read_text(marker) != key) io::write_file_atomically(marker, key);
    if (!fs::exists(partial / "run-key.json")) io::write_file_atomically(partial / "run-key.json", key);
    // Which units are finished, as one '0' or '1' per unit.
    std::string done(unit_count, '0');
    for (std::size_t index = 0; index < unit_count; ++index) {
      if (fs::exists(partial / fragment_name(index))) done[index] = '1';
    }
    return done;
  });
  if (setup[0] == "finished") {
    replay_outcome finished;
    finished.complete = true;
    finished.already_finished = true;
    if (rank == 0) {
      log << "replay: " << options.out.string() << " already holds a finished run; nothing to resume\n";
    }
    return finished;
  }
  const std::string& done_at_start = setup[0];

  // The static assignment of the units still to do (assign_units).
  replay_outcome outcome;
  outcome.units_total = static_cast<std::int64_t>(unit_count);
  const unit_assignment assigned = assign_pending(plan, parsed, done_at_start, ranks, rank);
  outcome.units_resumed = assigned.units_resumed;
  outcome.layers_resumed = assigned.layers_resumed;
  const std::vector<bool>& mine = assigned.mine;
  const std::size_t units_per_layer = gemm_count * strategy_count;
  const std::int64_t total_entries = assigned.entries;
  std::int64_t entries_seen = 0;
  double seconds_reference = 0.0, seconds_strategies = 0.0, seconds_read = 0.0;
  double seconds_setup = -1.0;  // from the start to the first read (parsing, planning, resuming)
  double seconds_upload = 0.0;  // operands to the GPU, including the wait for its start-up
  struct stage_time {
    double gemm = 0.0, compare = 0.0, metrics = 0.0;  // rotate + quantize + products; comparison; the rest
  };
  std::map<std::string, stage_time> strategy_times;
  const auto seconds_since = [](clock_type::time_point from) {
    return std::chrono::duration<double>(clock_type::now() - from).count();
  };

  // With several processes, each keeps RUN/.partial/rank-<r>.json saying what it works on (for the
  // report of a rank that dies, and for operators); a failing rank creates RUN/.partial/stop, which
  // the others look for before every step.
  const std::string host = this_host();
  const auto write_state = [&](const std::string& state, const std::vector<std::string>& units) {
    if (ranks == 1) return;
    json record;
    record["rank"] = rank;
    record["ranks"] = ranks;
    record["host"] = host;
    record["pid"] = static_cast<std::int64_t>(::getpid());
    record["state"] = state;
    record["units"] = units;
    try {
      io::write_file_atomically(partial / fmt::format("rank-{:05d}.json", rank), record.dump(2) + "\n");
    } catch (const std::exception&) {
      // Informational only; a rank that cannot write it still takes part in the final report.
    }
  };
  // Progress: on a terminal one line rewritten after every entry; in a log (Slurm, CI) a full line
  // at most every progress_log_seconds, from rank 0.
  auto last_logged = clock_type::now();
  const auto report_progress = [&](std::int64_t done, std::int64_t total) {
    const bool to_log = options.progress_log_seconds > 0.0 && rank == 0 &&
                        (seconds_since(last_logged) >= options.progress_log_seconds || done == total);
    if (!options.progress && !to_log) return;
    const double elapsed = seconds_since(started);
    const double rate = static_cast<double>(outcome.entries) / std::max(elapsed, 1e-9);
    const double remaining = static_cast<double>(total - done) / std::max(rate, 1e-9);
    const std::string line = fmt::format("replay: {}/{} entries, {} units done, {:.2f} entries/s, ETA {:.0f} s", done,
                                         total, outcome.units_resumed + outcome.units_done, rate, remaining);
    if (options.progress) {
      log << '\r' << line << "   " << std::flush;
    } else {
      log << line << '\n' << std::flush;
      last_logged = clock_type::now();
    }
  };
  std::string failure;           // this rank's failure, with the rank and unit named
  std::string failure_kind;      // "input" or "other"
  bool stopped_by_other = false;
  write_state("started", {});

  const auto termination_report = [&] {
    report_termination(partial, ranks, rank, host, unit_count, fragment_name, log);
  };
  struct report_guard {
    process_group& world;
    ~report_guard() { world.on_termination({}); }
  } guard{world};
  if (ranks > 1) world.on_termination(termination_report);

  for (std::size_t layer_index = 0; layer_index < plan.size() && failure.empty() && !stopped_by_other;
       ++layer_index) {
    const auto& layer = plan[layer_index];
    std::vector<std::size_t> owned;
    for (std::size_t u = 0; u < units_per_layer; ++u) {
      if (mine[layer_index * units_per_layer + u]) owned.push_back(layer_index * units_per_layer + u);
    }
    if (owned.empty()) continue;
    if (options.stop_after_layers > 0 && outcome.layers_done >= options.stop_after_layers) break;

    std::vector<std::string> owned_text;
    for (const std::size_t index : owned) owned_text.push_back(unit_text(index));
    write_state("working", owned_text);
    std::string doing;  // what this rank is doing, for its failure message
    try {
      std::vector<gemm_state> gemms;
      std::vector<std::vector<std::size_t>> unit_indices;  // per gemm state, per unit: canonical index
      for (std::size_t gi = 0; gi < gemm_count; ++gi) {
        const gemm_kind kind = parsed.gemms[gi];
        gemm_state state{};
        state.kind = kind;
        std::vector<std::size_t> indices;
        for (const std::size_t index : owned) {
          const unit_index unit = unit_at(index);
          if (unit.gemm != gi) continue;
          const auto& s = parsed.strategies[unit.strategy];
          unit_state unit_data;
          unit_data.strategy_name = s.name;
          unit_data.chosen = &s.for_gemm(kind);
          state.units.push_back(std::move(unit_data));
          indices.push_back(index);
        }
        if (state.units.empty()) continue;
#ifdef MXSCOPE_HAVE_CUDA
        if (device == compute_device::gpu) {
          state.device_reference.emplace();
          for (auto& unit : state.units) unit.device_accumulators.emplace();
        }
#endif
        gemms.push_back(std::move(state));
        unit_indices.push_back(std::move(indices));
      }
      io::dump_read_options read_options;
      read_options.read_weight = std::any_of(parsed.gemms.begin(), parsed.gemms.end(),
                                             [](gemm_kind k) { return k != gemm_kind::wgrad; });
      read_options.read_weight_gradient = false;
      read_options.read_quantized = false;

      std::int64_t t = 0;
      // The next step of the layer is read on a background thread while this one is worked on
      // (its errors surface when its turn comes, as they would without the overlap); `read`
      // then times only the wait for it.
      // The entry before the current one is handed to that read, which fills its memory again
      // (same shapes step after step: no fresh pages to fault in).
      std::future<io::dump_entry> next_entry;
      io::dump_entry spare;
      const auto read_in_background = [&](std::size_t e) {
        if (e >= layer.entries.size()) return;
        next_entry = std::async(std::launch::async,
                                [&dump, &read_options, info = layer.entries[e], recycled = std::move(spare)]() mutable {
                                  return dump.read(*info, read_options, std::move(recycled));
                                });
        spare = io::dump_entry{};
      };
      for (std::size_t e = 0; e < layer.entries.size(); ++e) {
        const auto* info = layer.entries[e];
        if (ranks > 1 && fs::exists(stop_file)) {
          stopped_by_other = true;
          break;
        }
        ++t;
        doing = fmt::format("reading step {} of layer {}", info->step, layer.name);
        auto mark = clock_type::now();
        if (seconds_setup < 0.0) seconds_setup = seconds_since(started);
        io::dump_entry entry = next_entry.valid() ? next_entry.get() : dump.read(*info, read_options);
        read_in_background(e + 1);
        if (!entry.all_finite()) {
          throw input_error(fmt::format("{}: non-finite values in the captured tensors ({}); replay refuses to use them",
                                        info->file.string(), entry.nonfinite_summary()));
        }
        seconds_read += seconds_since(mark);
        const gemm_operands operands{&entry.x, &entry.dy, entry.w ? &*entry.w : nullptr};
#ifdef MXSCOPE_HAVE_CUDA
        // The step's operands go to the GPU once, for every strategy's quantizer.
        compute.resident_operands.clear();
        if (device == compute_device::gpu) {
          mark = clock_type::now();
          ready_gpu();
          for (const matrix* operand : {operands.x, operands.dy, operands.w}) {
            if (operand != nullptr) {
              compute.resident_operands.emplace_back(
                  operand, std::make_shared<const gpu::device_matrix>(gpu::device_matrix::upload(*operand)));
            }
          }
          seconds_upload += seconds_since(mark);
        }
#endif
        const gemm_context context{entry.info.layer, static_cast<std::uint32_t>(entry.info.step)};
        for (std::size_t gi = 0; gi < gemms.size(); ++gi) {
          auto& state = gemms[gi];
          const gemm_layout layout = layout_of(state.kind);
          doing = fmt::format("the reference of ({}, {}) at step {}", layer.name, gemm_kind_name(state.kind),
                              info->step);
          mark = clock_type::now();
          reference_result reference = reference_of(state.kind, entry, parsed.reference, device, compute, placed);
          located<matrix64> g(std::move(reference.fp64), std::move(reference.device_fp64));
          located<matrix> g32(std::move(reference.fp32), std::move(reference.device_fp32));
          const reference_step_norms reference_norms = cross_step_reference(state, g, parsed.optimizer, placed, log);
          const double reference_norm = reference_norms.reference;
          state.reference_sum_norm = reference_norms.sum;
          seconds_reference += seconds_since(mark);

          mark = clock_type::now();
          for (std::size_t u = 0; u < state.units.size(); ++u) {
            auto& unit = state.units[u];
            const auto unit_started = clock_type::now();
            doing = fmt::format("unit {} at step {}", unit_text(unit_indices[gi][u]), info->step);
            const strategy& chosen = *unit.chosen;
            // The same quantized operands under the exact model separate quantization from accumulation.
            gemm_result result = run_gemm(state.kind, operands, chosen, context, compute);
            placed.count(result);
            const bool exact_model = chosen.accumulation.kind == accumulation_kind::exact;
            located<matrix> estimate(std::move(result.out), std::move(result.device_out));
            located<matrix64> exact_result(
                std::move(exact_model ? result.exact : result.exact_of_quantized),
                std::move(exact_model ? result.device_exact : result.device_exact_of_quantized));
            unit.stage_seconds[0] += seconds_since(unit_started);
            unit.stage_seconds[3] += result.quantize_seconds;
            unit.stage_seconds[4] += result.product_seconds;
            unit.stage_seconds[5] += result.exact_product_seconds;
            auto stage_mark = clock_type::now();
            const comparison metrics = compare_located(device, estimate, g, g32, placed);
            unit.stage_seconds[1] += seconds_since(stage_mark);
            stage_mark = clock_type::now();
            // One pass over the output for every norm of this step and the cross-step state.
            const unit_step_norms norms =
                cross_step_unit(state, unit, estimate, exact_result, g, parsed.optimizer, placed, log);
            const double quant_err = ratio(norms.quantization, reference_norm);
            const double accum_err = ratio(norms.accumulation, reference_norm);
            std::array<double, 6> attributed;
            attributed.fill(std::numeric_limits<double>::quiet_NaN());
            if (attribute) attributed = attribution(device, state.kind, entry, chosen, reference_norm);

            add_step_row(unit, step_values(metrics, quant_err, accum_err, result, attributed), layer.name, state.kind,
                         entry.info.step, t, layout);

            add_cross_step_row(unit, norms, reference_norms, t, layer.name, state.kind, entry.info.step);
            unit.stage_seconds[2] += seconds_since(stage_mark);
            unit.seconds += seconds_since(unit_started);
          }
          seconds_strategies += seconds_since(mark);
        }
        compute.known_exact.reset();
        compute.resident_operands.clear();  // they copy this entry's operands
        spare = std::move(entry);
        ++entries_seen;
        ++outcome.entries;
        report_progress(entries_seen, total_entries);
      }
      if (stopped_by_other) break;

      // One fragment per unit: its steps and accumulation rows and its summary record (mean and
      // last of each per-step metric and the final cross-step values).
      doing = fmt::format("writing the fragments of layer {}", layer.name);
      bool consecutive = true;
      for (std::size_t i = 1; i < layer.entries.size(); ++i) {
        consecutive = consecutive && layer.entries[i]->step == layer.entries[i - 1]->step + 1;
      }
      for (std::size_t gi = 0; gi < gemms.size(); ++gi) {
        const auto& state = gemms[gi];
        for (std::size_t u = 0; u < state.units.size(); ++u) {
          const json fragment = unit_fragment(unit_text(unit_indices[gi][u]), layer.name, state, state.units[u],
                                              consecutive);
          io::write_file_atomically(partial / fragment_name(unit_indices[gi][u]), fragment.dump() + "\n");
          ++outcome.units_done;
        }
      }
      ++outcome.layers_done;
    } catch (const std::exception& error) {
      if (ranks == 1) throw;
      failure_kind = dynamic_cast<const input_error*>(&error) != nullptr ? "input" : "other";
      failure = fmt::format("rank {} of {} (host {}, pid {}) failed on {}: {}", rank, ranks, host, ::getpid(),
                            doing.empty() ? fmt::format("layer {}", layer.name) : doing, error.what());
      try {
        io::write_file_atomically(stop_file, failure + "\n");
      } catch (const std::exception&) {
        // The others then stop at the end of their work instead; the message still reaches rank 0.
      }
    }
  }
  if (options.progress) log << "\n";
  write_state(!failure.empty() ? "failed" : stopped_by_other ? "stopped" : "finished", {});

  // Every rank reports; rank 0 names every failed rank, then assembles when every unit is done.
  json report;
  report["failure"] = failure;
  report["failure_kind"] = failure_kind;
  report["entries"] = outcome.entries;
  report["units_done"] = outcome.units_done;
  report["seconds"] = {{"total", seconds_since(started)},
                       {"read", seconds_read},
                       {"setup", std::max(seconds_setup, 0.0)},
                       {"upload", seconds_upload},
                       {"reference", seconds_reference},
                       {"strategies", seconds_strategies}};
  const std::vector<std::string> reports = world.all_gather(report.dump());
  std::vector<json> per_rank;
  for (const auto& text : reports) per_rank.push_back(json::parse(text));
  std::string failures;
  bool all_input = true;
  std::int64_t units_done_now = 0;
  for (const auto& item : per_rank) {
    units_done_now += item["units_done"].get<std::int64_t>();
    const std::string text = item["failure"].get<std::string>();
    if (text.empty()) continue;
    failures += (failures.empty() ? "" : "\n") + text;
    all_input = all_input && item["failure_kind"] == "input";
  }
  if (!failures.empty()) {
    if (rank != 0) throw reported_elsewhere(0);  // the reporting rank exits 2 (errors.hpp)
    const std::string message = fmt::format(
        "{}\n{} of {} units are complete and kept in {}; finish the run with --resume (with any number of ranks)",
        failures, outcome.units_resumed + units_done_now, unit_count, partial.string());
    if (all_input) throw input_error(message);
    throw std::runtime_error(message);
  }
  if (rank != 0) {
    outcome.complete = outcome.units_resumed + units_done_now == static_cast<std::int64_t>(unit_count);
    return outcome;
  }

  // Every unit done? Then assemble the final files, interleaving the unit fragments back into the
  // order of rows of one process: layer, step, gemm, strategy.
  for (std::size_t index = 0; index < unit_count; ++index) {
    if (!fs::exists(partial / fragment_name(index))) return outcome;
  }
  io::atomic_file steps_file(options.out / "steps.csv");
  io::atomic_file accumulation_file(options.out / "accumulation.csv");
  steps_file.write(steps_header);
  accumulation_file.write(accumulation_header);
  const merged_fragments merged = merge_fragments(plan, units_per_layer, strategy_count, partial, unit_at, fragment_name,
                                                  unit_text, steps_file, accumulation_file);
  json summary;
  summary["provenance"] = summary_provenance(options, parsed, dump, input_sha256, attribute);
  summary["units"] = merged.units;

  std::string gpu_name;
  if (device == compute_device::gpu) {
    ready_gpu();
    gpu_name = device_name(device);
  }
  const run_seconds seconds{seconds_since(started), seconds_read,    std::max(seconds_setup, 0.0), seconds_upload,
                            seconds_hashing,        seconds_reference, seconds_strategies};
  const json run = run_record(options.device, gpu_name, placed, threads, outcome, seconds, merged, parsed, per_rank);
  commit_final_files(options.out, partial, steps_file, accumulation_file, summary, run);
  outcome.complete = true;
  return outcome;
}

}  // namespace mxscope
