// Emulated GEMM against a plain Eigen fp32 GEMM on the Llama-like Wgrad shape scaled to one CPU
// core: dw [n_out, n_in] = dy^T x with n_out = n_in = 1024 and K = 4096 tokens, single-threaded.
//
//   bench_gemm                       all cases
//   bench_gemm --benchmark_filter=Emulated/fp32-block
//
// The emulation cases time emulate_product on operands quantized once beforehand (the
// accumulation model is what is measured; BM_RunGemm adds quantization of both operands,
// BM_RunGemmExactToo the exact product the replay also takes). The ratio to BM_EigenFp32 is the
// number to watch.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <Eigen/Core>
#include <random>

#include "mxscope/gemm.hpp"

namespace {

constexpr std::int64_t n_out = 1024;
constexpr std::int64_t n_in = 1024;
constexpr std::int64_t tokens = 4096;

mxscope::matrix random_matrix(std::int64_t rows, std::int64_t cols, std::uint64_t seed, double scale) {
  std::mt19937_64 random(seed);
  std::normal_distribution<float> normal(0.0f, static_cast<float>(scale));
  mxscope::matrix out(rows, cols);
  for (float& value : out.values) value = normal(random);
  return out;
}

struct wgrad_operands {
  mxscope::matrix dy = random_matrix(tokens, n_out, 1, 1e-6);
  mxscope::matrix x = random_matrix(tokens, n_in, 2, 1.0);
};

const wgrad_operands& operands() {
  static const wgrad_operands data;
  return data;
}

mxscope::quantize_options mxfp4_along_tokens() {
  mxscope::quantize_options options;
  options.format = *mxscope::parse_format("mxfp4");
  options.axis = 0;
  return options;
}

void BM_EigenFp32(benchmark::State& state) {
  using row_major = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const auto& data = operands();
  const Eigen::Map<const row_major> dy(data.dy.data(), tokens, n_out);
  const Eigen::Map<const row_major> x(data.x.data(), tokens, n_in);
  row_major dw(n_out, n_in);
  for (auto _ : state) {
    dw.noalias() = dy.transpose() * x;
    benchmark::DoNotOptimize(dw.data());
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * n_out * n_in * tokens, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_EigenFp32)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Emulated(benchmark::State& state, const char* model_text) {
  const auto& data = operands();
  const mxscope::quantized_tensor dy = mxscope::quantize(data.dy, mxfp4_along_tokens());
  const mxscope::quantized_tensor x = mxscope::quantize(data.x, mxfp4_along_tokens());
  const auto model = mxscope::parse_accumulation_model(model_text);
  std::int64_t fallbacks = 0;
  for (auto _ : state) {
    const auto result = mxscope::emulate_product(dy, x, model);
    fallbacks = result.fallback_entries;
    benchmark::DoNotOptimize(result.out.data());
  }
  state.counters["fallback_entries"] = static_cast<double>(fallbacks);
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * n_out * n_in * tokens, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK_CAPTURE(BM_Emulated, fp32-block, "fp32-block")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Emulated, fp32-group:4, "fp32-group:4")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Emulated, exact, "exact")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Emulated, fp32-seq, "fp32-seq")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Emulated, trunc-align:14:1, "trunc-align:14,1")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Emulated, trunc-align:14:4:rne, "trunc-align:14,4,rne")->Unit(benchmark::kMillisecond)->UseRealTime();

// run_gemm of a rotation-free strategy with `format` on both operands under fp32-block, on the
// Wgrad operands: quantize both, then the product (and, with options.exact_too, its exact product).
void time_run_gemm(benchmark::State& state, const char* format, const mxscope::gemm_options& options) {
  const auto& data = operands();
  mxscope::strategy chosen;
  chosen.a.quantize.format = *mxscope::parse_format(format);
  chosen.b.quantize.format = *mxscope::parse_format(format);
  chosen.accumulation = mxscope::parse_accumulation_model("fp32-block");
  const mxscope::gemm_operands tensors{&data.x, &data.dy, nullptr};
  for (auto _ : state) {
    const auto result =
        mxscope::run_gemm(mxscope::gemm_kind::wgrad, tensors, chosen, {"layers.0.mlp.down_proj", 1}, options);
    benchmark::DoNotOptimize(result.out.data());
    benchmark::DoNotOptimize(result.exact_of_quantized.data());
  }
}

// The MXFP4 strategy end to end.
void BM_RunGemm(benchmark::State& state) { time_run_gemm(state, "mxfp4", {}); }
BENCHMARK(BM_RunGemm)->Unit(benchmark::kMillisecond)->UseRealTime();

// The same for other formats without exact_too: bf16 (the certified float kernel) and NVFP4 (the
// int16 kernels with the ue4m3 scales' mantissas in the elements).
void BM_RunGemmOf(benchmark::State& state, const char* format) { time_run_gemm(state, format, {}); }
BENCHMARK_CAPTURE(BM_RunGemmOf, bf16, "bf16")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_RunGemmOf, nvfp4, "nvfp4")->Unit(benchmark::kMillisecond)->UseRealTime();

// A strategy's product with gemm_options::exact_too, as the replay runs it (the exact product of
// the same quantized operands beside the model's; one pass over the block dots on the int16 kernels
// for mxfp4 and nvfp4 and the wide fp64 kernel for the e4m3 formats, per-tensor fp8_e4m3 and
// mxfp8_e4m3). For mxfp4 it cost BM_RunGemm + BM_Emulated/exact while the exact product was a
// second pass.
void BM_RunGemmExactToo(benchmark::State& state, const char* format) {
  mxscope::gemm_options options;
  options.exact_too = true;
  time_run_gemm(state, format, options);
}
BENCHMARK_CAPTURE(BM_RunGemmExactToo, mxfp4, "mxfp4")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_RunGemmExactToo, fp8_e4m3, "fp8_e4m3")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_RunGemmExactToo, mxfp8_e4m3, "mxfp8_e4m3")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_RunGemmExactToo, nvfp4, "nvfp4")->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  // Single-threaded comparison: one core for Eigen and for the emulation.
  omp_set_num_threads(1);
  Eigen::setNbThreads(1);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
