// The cost of one replay step of a Llama-8B-shaped Wgrad, by stage: dw [n_out, n_in] = dy^T x
// with n_out 4096, n_in 14336 and K 8192 tokens (the MLP down projection of Llama 3.1-8B at
// batch x sequence = 8192), on synthetic bf16 operands written as a one-entry dump.
//
// The stages are those of one (layer, step) of `mxscope replay` (src/replay.cpp), done here with
// the same library calls in the same order, each timed on its own:
//   read        dump_reader::read of the entry (bf16 -> fp32) and the finiteness check
//   reference   the operands in the canonical orientation, reference_gemm(exact), and the
//               reference side of the cross-step state (sum, SGD and AdamW replays, their norms)
//   per strategy:
//     quantize      rotation (if any) and quantization of both operands, once
//     run_gemm      run_gemm under the strategy's model (quantize both + emulated GEMM), as replay
//     run_gemm_exact  the same under the `exact` model (replay's quant/accum split runs it too)
//     compare       compare(): the per-step metrics of the result against the reference
//     accumulate    quant/accum norms, the error sums, lag-1 product and the SGD and AdamW replays
//                   fed the estimate (the cross-step work of one unit at T >= 2)
// plus, measured in the same run as baselines: memcpy of x, and Eigen fp32 and fp64 GEMMs of the
// same shape (OpenMP threads as configured, like the replay's default of all cores).
//
// One iteration each (minutes of work); run it with MXSCOPE_BENCH_REPETITIONS=1. Memory: about
// 11 GiB at full size. MXSCOPE_BENCH_REPLAY_SCALE=k divides all three dimensions by k (a quick
// check of the harness itself; the figures to report are those at full size).
//
// Operand values: standard normal elements times a per-token scale exp(sigma z), z standard
// normal (log-normal, heavy-tailed: sigma 1 for x, 1.5 for dy), dy further scaled by 2^-20 like a
// gradient; rounded to bf16, the precision a capture stores.
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <Eigen/Core>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "mxscope/analysis.hpp"
#include "mxscope/compare.hpp"
#include "mxscope/gemm.hpp"
#include "mxscope/io/dump.hpp"
#include "mxscope/io/safetensors.hpp"
#include "mxscope/reference.hpp"

namespace {

namespace fs = std::filesystem;
using clock_type = std::chrono::steady_clock;

struct shape {
  std::int64_t n_out = 4096;
  std::int64_t n_in = 14336;
  std::int64_t tokens = 8192;
};

shape bench_shape() {
  shape s;
  if (const char* text = std::getenv("MXSCOPE_BENCH_REPLAY_SCALE")) {
    const long k = std::strtol(text, nullptr, 10);
    if (k > 1) {
      s.n_out /= k;
      s.n_in /= k;
      s.tokens /= k;
    }
  }
  return s;
}

double seconds_since(clock_type::time_point from) {
  return std::chrono::duration<double>(clock_type::now() - from).count();
}

std::uint16_t bf16_bits(float value) {  // round to nearest even (the inputs are finite)
  std::uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  bits += 0x7fffU + ((bits >> 16) & 1U);
  return static_cast<std::uint16_t>(bits >> 16);
}

// [tokens, cols] bf16 patterns: normal values times a log-normal per-token scale.
std::vector<std::uint16_t> synthetic_bf16(std::int64_t tokens, std::int64_t cols, std::uint64_t seed, double sigma,
                                          double scale) {
  std::mt19937_64 random(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<std::uint16_t> out(static_cast<std::size_t>(tokens * cols));
  for (std::int64_t k = 0; k < tokens; ++k) {
    const double token_scale = scale * std::exp(sigma * normal(random));
    for (std::int64_t c = 0; c < cols; ++c) {
      out[static_cast<std::size_t>(k * cols + c)] = bf16_bits(static_cast<float>(token_scale * normal(random)));
    }
  }
  return out;
}

std::vector<std::uint8_t> as_bytes(const std::vector<std::uint16_t>& values) {
  std::vector<std::uint8_t> bytes(values.size() * 2);
  for (std::size_t i = 0; i < values.size(); ++i) {
    bytes[2 * i] = static_cast<std::uint8_t>(values[i] & 0xffU);
    bytes[2 * i + 1] = static_cast<std::uint8_t>(values[i] >> 8);
  }
  return bytes;
}

const char* analysis_text = R"(
name = "bench-replay"
gemms = ["wgrad"]
reference = "exact"
[defaults]
accumulation = "fp32-block"
seed = 20241129
[[strategy]]
name = "mxfp4-rne"
format = "mxfp4"
rounding = "rne"
[[strategy]]
name = "mxfp4-h16"
format = "mxfp4"
rotation = "hadamard:16"
signs = "none"
[[strategy]]
name = "fp8-e4m3-tensor"
format = "fp8_e4m3"
)";

// The dump on disk and what the stages hand on to each other.
struct fixture {
  shape dims = bench_shape();
  fs::path directory;
  mxscope::analysis parsed = mxscope::parse_analysis(analysis_text, "bench-replay.toml");
  std::optional<mxscope::io::dump_reader> dump;
  std::optional<mxscope::io::dump_entry> entry;
  std::optional<mxscope::reference_result> reference;
  double reference_norm = 0.0;
  // The reference side of the cross-step state.
  mxscope::matrix64 reference_sum, sgd_momentum, sgd_displacement, adam_first, adam_second, adam_direction,
      adam_displacement;

  fixture() {
    directory = fs::temp_directory_path() / ("mxscope-bench-replay-" + std::to_string(::getpid()));
    fs::remove_all(directory);
    fs::create_directories(directory / "layer");
    const std::string layer = "model.layers.0.mlp.down_proj";
    mxscope::io::safetensors_writer writer;
    writer.add("x", mxscope::io::dtype::bf16, {dims.tokens, dims.n_in},
               as_bytes(synthetic_bf16(dims.tokens, dims.n_in, 1, 1.0, 1.0)));
    writer.add("dy", mxscope::io::dtype::bf16, {dims.tokens, dims.n_out},
               as_bytes(synthetic_bf16(dims.tokens, dims.n_out, 2, 1.5, std::ldexp(1.0, -20))));
    writer.write(directory / "layer" / "step_00000002.safetensors");
    nlohmann::json manifest;
    manifest["format"] = "mxscope-dump";
    manifest["version"] = 1;
    manifest["source"] = {{"hardware", "synthetic"},
                          {"framework", "bench_replay"},
                          {"recipe", "none"},
                          {"model", "Llama-8B-shaped MLP down projection"},
                          {"notes", "normal values with a log-normal per-token scale, rounded to bf16"}};
    manifest["entries"] = {{{"step", 2}, {"layer", layer}, {"file", "layer/step_00000002.safetensors"}}};
    std::ofstream(directory / "manifest.json") << manifest.dump(2);
    dump.emplace(directory);
  }
  ~fixture() {
    std::error_code ignored;
    fs::remove_all(directory, ignored);
  }

  const mxscope::io::dump_entry& the_entry() {
    if (!entry) entry = read();
    return *entry;
  }
  mxscope::io::dump_entry read() const {
    mxscope::io::dump_read_options options;
    options.read_weight = false;
    options.read_weight_gradient = false;
    options.read_quantized = false;
    return dump->read(dump->entries().front(), options);
  }
};

fixture& data() {
  static fixture instance;
  return instance;
}

double squared_norm(const mxscope::matrix64& m) {
  return mxscope::canonical_sum(m.size(), [&](std::int64_t i) {
    const double v = m.values[static_cast<std::size_t>(i)];
    return v * v;
  });
}

double difference_norm(const mxscope::matrix64& a, const mxscope::matrix64& b) {
  return std::sqrt(mxscope::canonical_sum(a.size(), [&](std::int64_t i) {
    const double d = a.values[static_cast<std::size_t>(i)] - b.values[static_cast<std::size_t>(i)];
    return d * d;
  }));
}

double dot(const mxscope::matrix64& a, const mxscope::matrix64& b) {
  return mxscope::canonical_sum(a.size(), [&](std::int64_t i) {
    return a.values[static_cast<std::size_t>(i)] * b.values[static_cast<std::size_t>(i)];
  });
}

// The SGD and AdamW replay steps of src/replay.cpp (t = 2).
void sgd_step(mxscope::matrix64& momentum, mxscope::matrix64& displacement, const mxscope::matrix64& g, double beta) {
  for (std::size_t i = 0; i < g.values.size(); ++i) {
    momentum.values[i] = beta * momentum.values[i] + g.values[i];
    displacement.values[i] += momentum.values[i];
  }
}

void adamw_step(mxscope::matrix64& first, mxscope::matrix64& second, mxscope::matrix64& direction,
                mxscope::matrix64& displacement, const mxscope::matrix64& g, const mxscope::optimizer_settings& s) {
  const double correction1 = 1.0 - std::pow(s.adamw_beta1, 2.0);
  const double correction2 = 1.0 - std::pow(s.adamw_beta2, 2.0);
  for (std::size_t i = 0; i < g.values.size(); ++i) {
    const double v = g.values[i];
    first.values[i] = s.adamw_beta1 * first.values[i] + (1.0 - s.adamw_beta1) * v;
    second.values[i] = s.adamw_beta2 * second.values[i] + (1.0 - s.adamw_beta2) * v * v;
    direction.values[i] = (first.values[i] / correction1) / (std::sqrt(second.values[i] / correction2) + s.adamw_eps);
    displacement.values[i] += direction.values[i];
  }
}

void set_shape_counters(benchmark::State& state) {
  const shape& s = data().dims;
  state.counters["n_out"] = static_cast<double>(s.n_out);
  state.counters["n_in"] = static_cast<double>(s.n_in);
  state.counters["K"] = static_cast<double>(s.tokens);
#ifdef _OPENMP
  state.counters["threads"] = omp_get_max_threads();
#endif
}

// ---------------------------------------------------------------------------------------------
// Baselines.

void BM_Memcpy(benchmark::State& state) {
  const auto& x = data().the_entry().x;
  std::vector<float> copy(x.values.size());
  for (auto _ : state) {
    std::memcpy(copy.data(), x.values.data(), x.values.size() * sizeof(float));
    benchmark::DoNotOptimize(copy.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * x.values.size() * sizeof(float)));
}
BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(5);

template <class Scalar>
void BM_EigenGemm(benchmark::State& state) {
  using dense = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using floats = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const auto& entry = data().the_entry();
  const dense dy = Eigen::Map<const floats>(entry.dy.data(), entry.dy.rows, entry.dy.cols).template cast<Scalar>();
  const dense x = Eigen::Map<const floats>(entry.x.data(), entry.x.rows, entry.x.cols).template cast<Scalar>();
  dense dw(dy.cols(), x.cols());
  for (auto _ : state) {
    dw.noalias() = dy.transpose() * x;
    benchmark::DoNotOptimize(dw.data());
  }
  set_shape_counters(state);
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * static_cast<double>(dy.cols() * x.cols() * dy.rows()),
                                                 benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::kIs1000);
}
BENCHMARK_TEMPLATE(BM_EigenGemm, float)->Name("BM_EigenGemm/fp32")->Unit(benchmark::kSecond)->UseRealTime()->Iterations(1);
BENCHMARK_TEMPLATE(BM_EigenGemm, double)->Name("BM_EigenGemm/fp64")->Unit(benchmark::kSecond)->UseRealTime()->Iterations(1);

// ---------------------------------------------------------------------------------------------
// Replay stages.

void BM_Read(benchmark::State& state) {
  fixture& f = data();
  for (auto _ : state) {
    mxscope::io::dump_entry entry = f.read();
    if (!entry.all_finite()) state.SkipWithError("non-finite synthetic values");
    benchmark::DoNotOptimize(entry.x.data());
    f.entry = std::move(entry);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(fs::file_size(f.dump->entries().front().file)));
  set_shape_counters(state);
}
BENCHMARK(BM_Read)->Unit(benchmark::kSecond)->UseRealTime()->Iterations(1);

// Orientation, reference GEMM and the reference side of the cross-step state.
void compute_reference(fixture& f, benchmark::State* state) {
  const auto& entry = f.the_entry();
  auto mark = clock_type::now();
  // Wgrad: A = dy^T [n_out, K], B = x^T [n_in, K], C = A B^T.
  const mxscope::matrix a = mxscope::transposed(entry.dy);
  const mxscope::matrix b = mxscope::transposed(entry.x);
  const double orient_s = seconds_since(mark);
  mark = clock_type::now();
  f.reference = mxscope::reference_gemm(a, b, f.parsed.reference);
  const double gemm_s = seconds_since(mark);
  const mxscope::matrix64& g = f.reference->fp64;
  const auto zeros = [&] { return mxscope::matrix64(g.rows, g.cols); };
  f.reference_sum = zeros();
  f.sgd_momentum = zeros();
  f.sgd_displacement = zeros();
  f.adam_first = zeros();
  f.adam_second = zeros();
  f.adam_direction = zeros();
  f.adam_displacement = zeros();
  mark = clock_type::now();
  f.reference_norm = std::sqrt(squared_norm(g));
  for (std::size_t i = 0; i < g.values.size(); ++i) f.reference_sum.values[i] += g.values[i];
  sgd_step(f.sgd_momentum, f.sgd_displacement, g, f.parsed.optimizer.sgd_momentum);
  adamw_step(f.adam_first, f.adam_second, f.adam_direction, f.adam_displacement, g, f.parsed.optimizer);
  double norms = 0.0;
  for (const auto* m : {&f.reference_sum, &f.sgd_momentum, &f.sgd_displacement, &f.adam_direction, &f.adam_displacement}) {
    norms += std::sqrt(squared_norm(*m));
  }
  benchmark::DoNotOptimize(norms);
  const double accumulate_s = seconds_since(mark);
  if (state != nullptr) {
    state->SetIterationTime(orient_s + gemm_s + accumulate_s);
    state->counters["orient_s"] = orient_s;
    state->counters["reference_gemm_s"] = gemm_s;
    state->counters["accumulate_s"] = accumulate_s;
  }
}

void BM_Reference(benchmark::State& state) {
  for (auto _ : state) compute_reference(data(), &state);
  set_shape_counters(state);
}
BENCHMARK(BM_Reference)->Unit(benchmark::kSecond)->UseManualTime()->Iterations(1);

void BM_Strategy(benchmark::State& state, const char* name) {
  fixture& f = data();
  const auto& entry = f.the_entry();
  if (!f.reference) compute_reference(f, nullptr);
  const mxscope::strategy* found = nullptr;
  for (const auto& s : f.parsed.strategies) {
    if (s.name == name) found = &s.for_gemm(mxscope::gemm_kind::wgrad);
  }
  const mxscope::strategy& chosen = *found;
  const mxscope::gemm_kind kind = mxscope::gemm_kind::wgrad;
  const mxscope::gemm_layout layout = mxscope::layout_of(kind);
  const mxscope::gemm_context context{entry.info.layer, static_cast<std::uint32_t>(entry.info.step)};
  const mxscope::gemm_operands operands{&entry.x, &entry.dy, nullptr};
  const mxscope::matrix64& g = f.reference->fp64;

  for (auto _ : state) {
    // quantize: both operands as run_gemm prepares them.
    auto mark = clock_type::now();
    {
      const std::uint32_t hash = mxscope::core::fnv1a32(context.layer.data(), context.layer.size());
      const mxscope::operand_strategy* sides[2] = {&chosen.a, &chosen.b};
      const mxscope::matrix* tensors[2] = {&entry.dy, &entry.x};
      const int axes[2] = {layout.a_axis, layout.b_axis};
      const mxscope::core::random_role roles[2] = {layout.a_role, layout.b_role};
      for (int side = 0; side < 2; ++side) {
        mxscope::quantize_options options = sides[side]->quantize;
        options.axis = axes[side];
        options.stream = mxscope::core::random_stream{chosen.seed,
                                                      mxscope::core::policy_step(sides[side]->seeds, context.step),
                                                      mxscope::core::stream_tag(hash, roles[side])};
        const mxscope::matrix rotated = mxscope::rotated_operand(*tensors[side], axes[side], chosen, context, "bench");
        const mxscope::quantized_tensor q = mxscope::quantize(rotated, options);
        benchmark::DoNotOptimize(q.codes.data());
      }
    }
    const double quantize_s = seconds_since(mark);

    // run_gemm under the strategy's model, then under `exact` (replay's quant/accum split).
    mark = clock_type::now();
    const mxscope::gemm_result result = mxscope::run_gemm(kind, operands, chosen, context);
    const double run_gemm_s = seconds_since(mark);
    mark = clock_type::now();
    mxscope::strategy exact_strategy = chosen;
    exact_strategy.accumulation = mxscope::parse_accumulation_model("exact");
    exact_strategy.output = mxscope::output_rounding::fp32;
    const mxscope::matrix64 exact_result = mxscope::run_gemm(kind, operands, exact_strategy, context).exact;
    const double run_gemm_exact_s = seconds_since(mark);

    mark = clock_type::now();
    const mxscope::comparison metrics = mxscope::compare(result.out, g, f.reference->fp32);
    benchmark::DoNotOptimize(metrics.rel_err);
    const double compare_s = seconds_since(mark);

    // The unit's cross-step work at T >= 2 (state zero-filled beforehand, untimed: replay
    // allocates it at T = 1 only).
    mxscope::matrix64 error_sum(g.rows, g.cols), previous_error(g.rows, g.cols);
    mxscope::matrix64 momentum(g.rows, g.cols), sgd_displacement(g.rows, g.cols);
    mxscope::matrix64 first(g.rows, g.cols), second(g.rows, g.cols), direction(g.rows, g.cols),
        adam_displacement(g.rows, g.cols);
    mark = clock_type::now();
    {
      mxscope::matrix64 estimate(result.out.rows, result.out.cols);
      for (std::size_t i = 0; i < estimate.values.size(); ++i) estimate.values[i] = result.out.values[i];
      double sink = difference_norm(exact_result, g) / f.reference_norm;
      sink += difference_norm(estimate, exact_result) / f.reference_norm;
      mxscope::matrix64 error(g.rows, g.cols);
      for (std::size_t i = 0; i < g.values.size(); ++i) error.values[i] = estimate.values[i] - g.values[i];
      for (std::size_t i = 0; i < g.values.size(); ++i) error_sum.values[i] += error.values[i];
      const double error_energy = squared_norm(error);
      sink += dot(previous_error, error) / std::sqrt(squared_norm(previous_error) * error_energy + 1.0);
      sink += std::sqrt(squared_norm(error_sum));
      sgd_step(momentum, sgd_displacement, estimate, f.parsed.optimizer.sgd_momentum);
      adamw_step(first, second, direction, adam_displacement, estimate, f.parsed.optimizer);
      sink += difference_norm(momentum, f.sgd_momentum) + difference_norm(sgd_displacement, f.sgd_displacement) +
              difference_norm(direction, f.adam_direction) + difference_norm(adam_displacement, f.adam_displacement);
      benchmark::DoNotOptimize(sink);
      previous_error = std::move(error);
    }
    const double accumulate_s = seconds_since(mark);

    // What replay spends on the unit (it quantizes inside both run_gemm calls).
    state.SetIterationTime(run_gemm_s + run_gemm_exact_s + compare_s + accumulate_s);
    state.counters["quantize_s"] = quantize_s;
    state.counters["run_gemm_s"] = run_gemm_s;
    state.counters["run_gemm_exact_s"] = run_gemm_exact_s;
    state.counters["compare_s"] = compare_s;
    state.counters["accumulate_s"] = accumulate_s;
    state.counters["fallback_entries"] = static_cast<double>(result.fallback_entries);
    state.counters["rel_err"] = metrics.rel_err;
  }
  set_shape_counters(state);
}
BENCHMARK_CAPTURE(BM_Strategy, mxfp4-rne, "mxfp4-rne")->Unit(benchmark::kSecond)->UseManualTime()->Iterations(1);
BENCHMARK_CAPTURE(BM_Strategy, mxfp4-h16, "mxfp4-h16")->Unit(benchmark::kSecond)->UseManualTime()->Iterations(1);
BENCHMARK_CAPTURE(BM_Strategy, fp8-e4m3-tensor, "fp8-e4m3-tensor")
    ->Unit(benchmark::kSecond)
    ->UseManualTime()
    ->Iterations(1);

}  // namespace

BENCHMARK_MAIN();
