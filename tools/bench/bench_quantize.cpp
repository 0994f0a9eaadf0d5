// Quantize throughput on the CPU next to memcpy bandwidth measured in the same run.
//
// Every benchmark reports bytes_per_second of fp32 input (rows * cols * 4 bytes per iteration), so
// a quantizer's figure divided by memcpy's figure for the same shape and thread count is its
// fraction of copy bandwidth (tools/bench/run prints that ratio). memcpy reads those bytes and
// writes as many; the quantizers read them and write codes and scales (and, where named, the
// dequantized fp32 tensor).
//
// Names: quantize/<path>/<rows>x<cols>/threads:<n>, with <path>
//   memcpy                      the baseline: copy the input buffer into another one
//   canonical_mxfp4_rne         quantize() on the canonical scalar path (double-based reference)
//   fast_mxfp4_rne_codes        the fast path, codes and scales only (quantize + pack)
//   fast_mxfp4_rne_dequantized  the fast path, also writing the dequantized fp32 tensor
//   api_mxfp4_rne               quantize() dispatching to the fast path (allocates its outputs)
//   fast_mxfp4_sr_codes         the fast path with stochastic rounding (a Philox word per element)
//   fast_mxfp4_rne_axis0_codes  the fast path along axis 0 (blocks run down the columns)
//   h16_rotate_then_fast_codes  rotate() of a copy along axis 1 (16-point Hadamard), then the fast path
//   h16_fused_codes             the fused rotation + quantize path (same bits, no rotated copy)
// All use MXFP4 (fp4 e2m1, block 32, e8m0 scales, scale rule floor) along axis 1 unless named.
#include <benchmark/benchmark.h>

#include <cstring>
#include <functional>
#include <map>
#include <utility>
#include <random>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "mxscope/quantize.hpp"
#include "mxscope/quantize_fast.hpp"

namespace {

using mxscope::matrix;
namespace core = mxscope::core;

int all_threads() {
#ifdef _OPENMP
  return omp_get_num_procs();
#else
  return 1;
#endif
}

void use_threads(int threads) {
#ifdef _OPENMP
  omp_set_num_threads(threads);
#else
  (void)threads;
#endif
}

// Activation-like data: normal values with a per-row scale and a few large outliers.
matrix make_input(std::int64_t rows, std::int64_t cols) {
  std::mt19937 generator(12345);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  matrix m(rows, cols);
  for (std::int64_t r = 0; r < rows; ++r) {
    const float row_scale = 0.01f + 4.0f * uniform(generator);
    for (std::int64_t c = 0; c < cols; ++c) {
      float v = normal(generator) * row_scale;
      if (uniform(generator) < 0.001f) v *= 100.0f;
      m(r, c) = v;
    }
  }
  return m;
}

mxscope::quantize_options mxfp4_options(core::rounding_mode mode, int axis = 1) {
  mxscope::quantize_options options;
  options.format = *mxscope::parse_format("mxfp4");
  options.block = 32;
  options.axis = axis;
  options.rounding = mode;
  options.rule = core::scale_rule::floor;
  options.stream = core::random_stream{42, 1, 2};
  return options;
}

mxscope::rotation_options h16() {
  mxscope::rotation_options rotation;
  rotation.size = 16;
  rotation.signs = mxscope::sign_policy::none;
  return rotation;
}

// Output buffers in quantize()'s layout for an MXFP4 tensor.
struct mxfp4_buffers {
  std::vector<std::uint8_t> codes;
  std::vector<std::uint8_t> scales;
  std::vector<float> dequantized;
  mxfp4_buffers(std::int64_t rows, std::int64_t cols, int axis, bool with_dequantized)
      : codes(static_cast<std::size_t>(rows * ((cols + 1) / 2))),
        scales(static_cast<std::size_t>(axis == 1 ? rows * ((cols + 31) / 32) : ((rows + 31) / 32) * cols)),
        dequantized(with_dequantized ? static_cast<std::size_t>(rows * cols) : 0U) {}
  mxscope::mx_destination destination() {
    return {codes.data(), scales.data(), dequantized.empty() ? nullptr : dequantized.data()};
  }
};

using body = std::function<void(benchmark::State&, const matrix&)>;

// Inputs are made once per shape: Google Benchmark calls a benchmark several times.
const matrix& input_for(std::int64_t rows, std::int64_t cols) {
  static std::map<std::pair<std::int64_t, std::int64_t>, matrix> inputs;
  auto found = inputs.find({rows, cols});
  if (found == inputs.end()) found = inputs.emplace(std::pair{rows, cols}, make_input(rows, cols)).first;
  return found->second;
}

void run_benchmark(benchmark::State& state, std::int64_t rows, std::int64_t cols, int threads, const body& work) {
  const matrix& input = input_for(rows, cols);
  use_threads(threads);
  work(state, input);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * rows * cols *
                          static_cast<std::int64_t>(sizeof(float)));
  state.counters["threads"] = threads;
}

void memcpy_body(benchmark::State& state, const matrix& input) {
  std::vector<float> copy(input.values.size());
  const std::int64_t total = input.size();
  for (auto _ : state) {
#pragma omp parallel
    {
#ifdef _OPENMP
      const std::int64_t team = omp_get_num_threads();
      const std::int64_t member = omp_get_thread_num();
#else
      const std::int64_t team = 1, member = 0;
#endif
      const std::int64_t begin = total * member / team;
      const std::int64_t end = total * (member + 1) / team;
      std::memcpy(copy.data() + begin, input.data() + begin, static_cast<std::size_t>(end - begin) * sizeof(float));
    }
    benchmark::DoNotOptimize(copy.data());
    benchmark::ClobberMemory();
  }
}

void canonical_body(benchmark::State& state, const matrix& input) {
  mxscope::set_fast_quantize_enabled(false);
  const auto options = mxfp4_options(core::rounding_mode::rne);
  for (auto _ : state) benchmark::DoNotOptimize(mxscope::quantize(input, options));
  mxscope::set_fast_quantize_enabled(true);
}

void api_body(benchmark::State& state, const matrix& input) {
  const auto options = mxfp4_options(core::rounding_mode::rne);
  for (auto _ : state) benchmark::DoNotOptimize(mxscope::quantize(input, options));
}

body fast_body(core::rounding_mode mode, bool with_dequantized, int axis = 1) {
  return [=](benchmark::State& state, const matrix& input) {
    const auto options = mxfp4_options(mode, axis);
    mxfp4_buffers buffers(input.rows, input.cols, axis, with_dequantized);
    for (auto _ : state) {
      benchmark::DoNotOptimize(mxscope::quantize_mx_fast(input.data(), input.rows, input.cols, options,
                                                         buffers.destination()));
      benchmark::ClobberMemory();
    }
  };
}

void rotate_then_fast_body(benchmark::State& state, const matrix& input) {
  const auto options = mxfp4_options(core::rounding_mode::rne);
  mxfp4_buffers buffers(input.rows, input.cols, 1, false);
  matrix rotated;
  for (auto _ : state) {
    rotated = input;
    mxscope::rotate(rotated, 1, h16(), "benchmark");
    benchmark::DoNotOptimize(
        mxscope::quantize_mx_fast(rotated.data(), rotated.rows, rotated.cols, options, buffers.destination()));
    benchmark::ClobberMemory();
  }
}

void fused_body(benchmark::State& state, const matrix& input) {
  const auto options = mxfp4_options(core::rounding_mode::rne);
  mxfp4_buffers buffers(input.rows, input.cols, 1, false);
  for (auto _ : state) {
    benchmark::DoNotOptimize(mxscope::quantize_mx_rotated_fast(input.data(), input.rows, input.cols, options, h16(),
                                                               buffers.destination()));
    benchmark::ClobberMemory();
  }
}

struct shape {
  std::int64_t rows;
  std::int64_t cols;
};

void register_all() {
  // 4096 x 4096 fp32 (64 MiB: from DRAM) and 128 x 512 fp32 (256 KiB: fits in a core's L2).
  const shape shapes[] = {{4096, 4096}, {128, 512}};
  const struct {
    const char* name;
    body work;
  } paths[] = {
      {"memcpy", memcpy_body},
      {"canonical_mxfp4_rne", canonical_body},
      {"fast_mxfp4_rne_codes", fast_body(core::rounding_mode::rne, false)},
      {"fast_mxfp4_rne_dequantized", fast_body(core::rounding_mode::rne, true)},
      {"api_mxfp4_rne", api_body},
      {"fast_mxfp4_sr_codes", fast_body(core::rounding_mode::sr, false)},
      {"fast_mxfp4_rne_axis0_codes", fast_body(core::rounding_mode::rne, false, 0)},
      {"h16_rotate_then_fast_codes", rotate_then_fast_body},
      {"h16_fused_codes", fused_body},
  };
  std::vector<int> thread_counts{1};
  if (all_threads() > 1) thread_counts.push_back(all_threads());
  for (const auto& s : shapes) {
    for (const int threads : thread_counts) {
      for (const auto& path : paths) {
        const std::string name =
            "quantize/" + std::string(path.name) + "/" + std::to_string(s.rows) + "x" + std::to_string(s.cols) +
            "/threads:" + std::to_string(threads);
        benchmark::RegisterBenchmark(name.c_str(),
                                     [s, threads, work = path.work](benchmark::State& state) {
                                       run_benchmark(state, s.rows, s.cols, threads, work);
                                     })
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  register_all();
  benchmark::AddCustomContext("fast_quantize_target", mxscope::fast_quantize_target());
  benchmark::AddCustomContext("omp_threads_all", std::to_string(all_threads()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
