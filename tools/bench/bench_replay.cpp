// The cost of one replay step of a Llama-8B-shaped Wgrad, by stage: dw [n_out, n_in] = dy^T x
// with n_out 4096, n_in 14336 and K 8192 tokens (the MLP down projection of Llama 3.1-8B at
// batch x sequence = 8192), on synthetic bf16 operands written as a one-entry dump.
//
// The stages are those of one (layer, step) of `mxscope replay` (src/replay.cpp), done here with
// the same library calls in the same order, each timed on its own:
//   read        dump_reader::read of the entry (bf16 -> fp32) and the finiteness check; and the
//               same into the memory of an earlier entry (ReadRecycled, as the replay reads)
//   reference   the operands in the canonical orientation, reference_gemm(exact), and the
//               reference side of the cross-step state (sum, SGD and AdamW replays, their norms)
//   per strategy:
//     quantize      rotation (if any) and quantization of both operands, once (for the record:
//                   run_gemm quantizes again, inside its own time)
//     run_gemm      run_gemm under the strategy's model with gemm_options::exact_too (quantize
//                   both, the emulated GEMM and the `exact` model's product of the same operands
//                   for replay's quant/accum split), as replay; product_s and exact_product_s
//                   split it (exact_product_s is 0 where the exact product came with the model's)
//     compare       compare(): the per-step metrics of the result against the reference
//     accumulate    unit_step (include/mxscope/cross_step.hpp): quant/accum norms, the error sums,
//                   lag-1 product and the SGD and AdamW replays fed the estimate (the cross-step work
//                   of one unit at T >= 2, replay's "metrics" stage)
// plus, measured in the same run as baselines: memcpy of x, and Eigen fp32 and fp64 GEMMs of the
// same shape (OpenMP threads as configured, like the replay's default of all cores).
//
// The metrics cases (BM_Metrics*) time the cross-step state alone, at T >= 2, on synthetic fp64
// outputs of MXSCOPE_BENCH_METRICS_SHAPE (rows x cols, default 4096x4096) with 1 and 2 OpenMP
// threads: reference_step (per (layer, GEMM) and step) and unit_step (per unit and step), against
// memcpy of one fp64 output matrix in the same run, with the CPU seconds of the process as a
// counter (cpu_ms). They need no GEMM and take seconds; run them alone with
// MXSCOPE_BENCH_FILTER=BM_Metrics.
//
// One iteration each (minutes of work); run it with MXSCOPE_BENCH_REPETITIONS=1. Memory: about
// 11 GiB at full size. MXSCOPE_BENCH_REPLAY_SCALE=k divides all three dimensions by k (a quick
// check of the harness itself; the figures to report are those at full size).
//
// Operand values: standard normal elements times a per-token scale exp(sigma z), z standard
// normal (log-normal, heavy-tailed: sigma 1 for x, 1.5 for dy), dy further scaled by 2^-20 like a
// gradient; rounded to bf16, the precision a capture stores.
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <unistd.h>

#include <Eigen/Core>
#include <chrono>
#include <ctime>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
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
#include "mxscope/cross_step.hpp"
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
[[strategy]]
name = "mxfp8-e4m3"
format = "mxfp8_e4m3"
[[strategy]]
name = "bf16"
format = "bf16"
[[strategy]]
name = "nvfp4"
format = "nvfp4"
[[strategy]]
name = "mxfp4-sr"
format = "mxfp4"
rounding = "sr"
seed_policy = "per-step"
[[strategy]]
name = "mxfp4-rht16"
format = "mxfp4"
rotation = "hadamard:16"
signs = "per-step"
)";

// What the replay reads of a Wgrad entry: x and dy only.
mxscope::io::dump_read_options operands_only() {
  mxscope::io::dump_read_options options;
  options.read_weight = false;
  options.read_weight_gradient = false;
  options.read_quantized = false;
  return options;
}

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
  mxscope::reference_accumulators reference_state;

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
    const mxscope::io::dump_read_options options = operands_only();
    return dump->read(dump->entries().front(), options);
  }
};

fixture& data() {
  static fixture instance;
  return instance;
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

// The disk's sequential bandwidth, the baseline of the cold reads below: the entry file read
// once with O_DIRECT (no page cache) in 64 MiB requests into an aligned buffer.
void BM_DiskDirect(benchmark::State& state) {
  const fs::path file = data().dump->entries().front().file;
  constexpr std::size_t request = std::size_t{64} << 20;
  void* raw = nullptr;
  if (::posix_memalign(&raw, 4096, request) != 0) {
    state.SkipWithError("posix_memalign failed");
    return;
  }
  std::unique_ptr<void, decltype(&std::free)> buffer(raw, &std::free);
  for (auto _ : state) {
    const int descriptor = ::open(file.c_str(), O_RDONLY | O_DIRECT);
    if (descriptor < 0) {
      state.SkipWithError("open with O_DIRECT failed (the file system may not support it)");
      return;
    }
    off_t offset = 0;
    for (;;) {
      const ssize_t got = ::pread(descriptor, raw, request, offset);
      if (got <= 0) break;
      offset += got;
    }
    ::close(descriptor);
    benchmark::DoNotOptimize(raw);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(fs::file_size(file)));
}
BENCHMARK(BM_DiskDirect)->Unit(benchmark::kSecond)->UseRealTime()->Iterations(3);

// Drops the entry file's clean pages from the page cache (no privileges needed), so that the next
// read comes from the disk.
void drop_cached_pages(const fs::path& file) {
  const int descriptor = ::open(file.c_str(), O_RDONLY);
  if (descriptor < 0) return;
  (void)::posix_fadvise(descriptor, 0, 0, POSIX_FADV_DONTNEED);
  ::close(descriptor);
}

// The read of a first step from a cold file, into fresh memory (Arg 0) or, as the replay reads
// from the third step of a layer on, into the memory of an earlier entry (Arg 1).
void BM_ReadCold(benchmark::State& state) {
  fixture& f = data();
  const mxscope::io::dump_read_options options = operands_only();
  const auto& info = f.dump->entries().front();
  mxscope::io::dump_entry spare;
  if (state.range(0) == 1) spare = f.dump->read(info, options);
  for (auto _ : state) {
    state.PauseTiming();
    drop_cached_pages(info.file);
    state.ResumeTiming();
    mxscope::io::dump_entry entry = f.dump->read(info, options, std::move(spare));
    if (!entry.all_finite()) state.SkipWithError("non-finite synthetic values");
    benchmark::DoNotOptimize(entry.x.data());
    if (state.range(0) == 1) spare = std::move(entry);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(fs::file_size(info.file)));
  set_shape_counters(state);
}
BENCHMARK(BM_ReadCold)->Arg(0)->Arg(1)->Unit(benchmark::kSecond)->UseRealTime()->Iterations(3);

// The read as the replay does it from the third step of a layer on: into the memory of an earlier
// entry of the same shape (dump_reader::read with a recycled entry), after one warm-up read.
void BM_ReadRecycled(benchmark::State& state) {
  fixture& f = data();
  const mxscope::io::dump_read_options options = operands_only();
  const auto& info = f.dump->entries().front();
  mxscope::io::dump_entry spare = f.dump->read(info, options);
  for (auto _ : state) {
    mxscope::io::dump_entry entry = f.dump->read(info, options, std::move(spare));
    if (!entry.all_finite()) state.SkipWithError("non-finite synthetic values");
    benchmark::DoNotOptimize(entry.x.data());
    spare = std::move(entry);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(fs::file_size(info.file)));
  set_shape_counters(state);
}
BENCHMARK(BM_ReadRecycled)->Unit(benchmark::kSecond)->UseRealTime()->Iterations(5);

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
  // The reference side at T >= 2 (replay allocates the state at T = 1 only): one step untimed.
  f.reference_state = {};
  mxscope::reference_step(f.reference_state, g, f.parsed.optimizer);
  mark = clock_type::now();
  f.reference_norm = mxscope::reference_step(f.reference_state, g, f.parsed.optimizer).reference;
  benchmark::DoNotOptimize(f.reference_norm);
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

    // run_gemm as replay runs it: the strategy's model and, on the same quantized operands, the
    // `exact` model (gemm_options::exact_too, the quant/accum split).
    mark = clock_type::now();
    mxscope::gemm_options gemm_options;
    gemm_options.exact_too = true;
    // As replay passes it: the exact reference of the captured tensors (taken where the strategy's
    // quantized operands are those values, as bf16 of this bf16 capture).
    gemm_options.known_exact_host = mxscope::gemm_options::known_exact_on_host{&entry.dy, &entry.x, &g};
    const mxscope::gemm_result result = mxscope::run_gemm(kind, operands, chosen, context, gemm_options);
    const double run_gemm_s = seconds_since(mark);
    const mxscope::matrix64& exact_result = result.exact_of_quantized;

    mark = clock_type::now();
    const mxscope::comparison metrics = mxscope::compare(result.out, g, f.reference->fp32);
    benchmark::DoNotOptimize(metrics.rel_err);
    const double compare_s = seconds_since(mark);

    // The unit's cross-step work at T >= 2, as replay does it. Untimed: a reference state at
    // step 1, the unit's first step (replay allocates the state then) and the reference's step 2.
    mxscope::unit_accumulators unit;
    f.reference_state = {};
    mxscope::reference_step(f.reference_state, g, f.parsed.optimizer);
    mxscope::unit_step(unit, f.reference_state, result.out, exact_result, g, f.parsed.optimizer);
    mxscope::reference_step(f.reference_state, g, f.parsed.optimizer);
    mark = clock_type::now();
    {
      const mxscope::unit_step_norms norms =
          mxscope::unit_step(unit, f.reference_state, result.out, exact_result, g, f.parsed.optimizer);
      benchmark::DoNotOptimize(norms.error_sum);
    }
    const double accumulate_s = seconds_since(mark);

    // What replay spends on the unit (it quantizes inside run_gemm, once).
    state.SetIterationTime(run_gemm_s + compare_s + accumulate_s);
    state.counters["quantize_s"] = quantize_s;
    state.counters["run_gemm_s"] = run_gemm_s;
    state.counters["product_s"] = result.product_seconds;
    state.counters["exact_product_s"] = result.exact_product_seconds;  // 0 where computed with the product
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
BENCHMARK_CAPTURE(BM_Strategy, mxfp8-e4m3, "mxfp8-e4m3")->Unit(benchmark::kSecond)->UseManualTime()->Iterations(1);
BENCHMARK_CAPTURE(BM_Strategy, bf16, "bf16")->Unit(benchmark::kSecond)->UseManualTime()->Iterations(1);
BENCHMARK_CAPTURE(BM_Strategy, nvfp4, "nvfp4")->Unit(benchmark::kSecond)->UseManualTime()->Iterations(1);
BENCHMARK_CAPTURE(BM_Strategy, mxfp4-sr, "mxfp4-sr")->Unit(benchmark::kSecond)->UseManualTime()->Iterations(1);
BENCHMARK_CAPTURE(BM_Strategy, mxfp4-rht16, "mxfp4-rht16")->Unit(benchmark::kSecond)->UseManualTime()->Iterations(1);

// ---------------------------------------------------------------------------------------------
// The cross-step state alone ("metrics" stage), on synthetic outputs of one shape.

struct metrics_fixture {
  std::int64_t rows = 4096;
  std::int64_t cols = 4096;
  mxscope::matrix64 g, exact;  // G_t and X_t
  mxscope::matrix estimate;    // Ghat_t
  mxscope::optimizer_settings settings;

  metrics_fixture() {
    if (const char* text = std::getenv("MXSCOPE_BENCH_METRICS_SHAPE")) {
      char* end = nullptr;
      rows = std::strtol(text, &end, 10);
      cols = *end == 'x' ? std::strtol(end + 1, nullptr, 10) : rows;
    }
    g = mxscope::matrix64(rows, cols);
    exact = mxscope::matrix64(rows, cols);
    estimate = mxscope::matrix(rows, cols);
    std::mt19937_64 random(7);
    std::normal_distribution<double> normal(0.0, 1.0);
    for (std::size_t i = 0; i < g.values.size(); ++i) {
      g.values[i] = normal(random);
      exact.values[i] = g.values[i] + 1e-3 * normal(random);
      estimate.values[i] = static_cast<float>(exact.values[i] + 1e-3 * normal(random));
    }
  }
  std::int64_t bytes() const { return rows * cols * static_cast<std::int64_t>(sizeof(double)); }
};

metrics_fixture& metrics_data() {
  static metrics_fixture instance;
  return instance;
}

void set_metrics_counters(benchmark::State& state) {
  const metrics_fixture& m = metrics_data();
  state.counters["rows"] = static_cast<double>(m.rows);
  state.counters["cols"] = static_cast<double>(m.cols);
#ifdef _OPENMP
  state.counters["threads"] = omp_get_max_threads();
#endif
}

// Sets the OpenMP thread count for one benchmark and restores the previous one after it.
class thread_count {
 public:
  explicit thread_count(int threads) {
#ifdef _OPENMP
    previous_ = omp_get_max_threads();
    omp_set_num_threads(threads);
#else
    (void)threads;
#endif
  }
  ~thread_count() {
#ifdef _OPENMP
    omp_set_num_threads(previous_);
#endif
  }
  thread_count(const thread_count&) = delete;
  thread_count& operator=(const thread_count&) = delete;

 private:
  int previous_ = 1;
};

// Baseline: memcpy of one fp64 output matrix (on the calling thread).
void BM_MetricsMemcpy(benchmark::State& state) {
  const metrics_fixture& m = metrics_data();
  std::vector<double> copy(m.g.values.size());
  for (auto _ : state) {
    std::memcpy(copy.data(), m.g.values.data(), static_cast<std::size_t>(m.bytes()));
    benchmark::DoNotOptimize(copy.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * m.bytes());
  set_metrics_counters(state);
}
BENCHMARK(BM_MetricsMemcpy)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(10);

// reference_step at T >= 2 (the first, allocating step untimed).
// CPU seconds of the whole process (every OpenMP thread): on a shared machine the wall time also
// counts the waiting for a CPU. Run with OMP_WAIT_POLICY=PASSIVE so that idle threads do not spin.
double process_cpu_seconds() {
  timespec now{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

void set_cpu_counter(benchmark::State& state, double cpu_seconds) {
  state.counters["cpu_ms"] = benchmark::Counter(1e3 * cpu_seconds, benchmark::Counter::kAvgIterations);
}

void BM_MetricsReference(benchmark::State& state) {
  const thread_count threads(static_cast<int>(state.range(0)));
  const metrics_fixture& m = metrics_data();
  mxscope::reference_accumulators reference;
  mxscope::reference_step(reference, m.g, m.settings);
  double cpu = 0.0;
  for (auto _ : state) {
    const double cpu_mark = process_cpu_seconds();
    const mxscope::reference_step_norms norms = mxscope::reference_step(reference, m.g, m.settings);
    cpu += process_cpu_seconds() - cpu_mark;
    benchmark::DoNotOptimize(norms.sum);
  }
  state.SetBytesProcessed(state.iterations() * m.bytes());
  set_metrics_counters(state);
  set_cpu_counter(state, cpu);
}
BENCHMARK(BM_MetricsReference)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(8);

// unit_step at T >= 2 (untimed: the unit's first, allocating step and each step of the reference).
void BM_MetricsUnit(benchmark::State& state) {
  const thread_count threads(static_cast<int>(state.range(0)));
  const metrics_fixture& m = metrics_data();
  mxscope::reference_accumulators reference;
  mxscope::unit_accumulators unit;
  mxscope::reference_step(reference, m.g, m.settings);
  mxscope::unit_step(unit, reference, m.estimate, m.exact, m.g, m.settings);
  double cpu = 0.0;
  for (auto _ : state) {
    mxscope::reference_step(reference, m.g, m.settings);
    const auto mark = clock_type::now();
    const double cpu_mark = process_cpu_seconds();
    const mxscope::unit_step_norms norms = mxscope::unit_step(unit, reference, m.estimate, m.exact, m.g, m.settings);
    cpu += process_cpu_seconds() - cpu_mark;
    state.SetIterationTime(seconds_since(mark));
    benchmark::DoNotOptimize(norms.error_sum);
  }
  state.SetBytesProcessed(state.iterations() * m.bytes());
  set_metrics_counters(state);
  set_cpu_counter(state, cpu);
}
BENCHMARK(BM_MetricsUnit)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseManualTime()->Iterations(8);

}  // namespace

BENCHMARK_MAIN();
