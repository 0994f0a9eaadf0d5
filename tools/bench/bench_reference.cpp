// Reference GEMM speed on the wgrad-like shape A [1024, 4096], B [1024, 4096] (C = A B^T), single
// thread: Eigen's fp64 GEMM alone, the fp64 reference (GEMM + bound GEMM), the certified exact
// reference, and a naive Boost.Multiprecision reference on a sample of entries. Compare the
// `seconds_per_entry` counters. Random normal inputs.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>

#include <Eigen/Core>
#include <boost/multiprecision/cpp_bin_float.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "mxscope/reference.hpp"

namespace {

constexpr std::int64_t rows_a = 1024;
constexpr std::int64_t rows_b = 1024;
constexpr std::int64_t depth = 4096;
constexpr std::int64_t naive_sample = 32;

mxscope::matrix random_normal(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  mxscope::matrix m(rows, cols);
  for (float& v : m.values) v = normal(rng);
  return m;
}

const mxscope::matrix& operand_a() {
  static const mxscope::matrix a = random_normal(rows_a, depth, 1);
  return a;
}
const mxscope::matrix& operand_b() {
  static const mxscope::matrix b = random_normal(rows_b, depth, 2);
  return b;
}

void single_thread() {
#ifdef _OPENMP
  omp_set_num_threads(1);
#endif
  Eigen::setNbThreads(1);
}

void per_entry_counter(benchmark::State& state, std::int64_t entries_per_iteration) {
  state.counters["seconds_per_entry"] = benchmark::Counter(
      static_cast<double>(entries_per_iteration) * static_cast<double>(state.iterations()),
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

using row_major64 = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using row_major32 = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

void BM_EigenFp64Gemm(benchmark::State& state) {
  single_thread();
  const row_major64 a = Eigen::Map<const row_major32>(operand_a().data(), rows_a, depth).cast<double>();
  const row_major64 b = Eigen::Map<const row_major32>(operand_b().data(), rows_b, depth).cast<double>();
  row_major64 c(rows_a, rows_b);
  for (auto _ : state) {
    c.noalias() = a * b.transpose();
    benchmark::DoNotOptimize(c.data());
  }
  per_entry_counter(state, rows_a * rows_b);
}

void BM_Fp64Reference(benchmark::State& state) {
  single_thread();
  for (auto _ : state) {
    const mxscope::reference_result result = mxscope::reference_gemm(operand_a(), operand_b(), mxscope::reference_kind::fp64);
    benchmark::DoNotOptimize(result.fp64.data());
  }
  per_entry_counter(state, rows_a * rows_b);
}

void BM_ExactReference(benchmark::State& state) {
  single_thread();
  double fallback_fraction = 0.0;
  for (auto _ : state) {
    const mxscope::reference_result result = mxscope::reference_gemm(operand_a(), operand_b(), mxscope::reference_kind::exact);
    benchmark::DoNotOptimize(result.fp64.data());
    fallback_fraction = result.stats.fallback_fraction();
  }
  per_entry_counter(state, rows_a * rows_b);
  state.counters["fallback_fraction"] = fallback_fraction;
}

// One multiprecision number per product: convert, multiply, add, round once at the end. 640 bits
// hold every sum of fp32 products exactly (they are multiples of 2^-298 below 2^320).
void BM_NaiveMultiprecision(benchmark::State& state) {
  using wide = boost::multiprecision::number<boost::multiprecision::cpp_bin_float<640, boost::multiprecision::digit_base_2>>;
  single_thread();
  const mxscope::matrix& a = operand_a();
  const mxscope::matrix& b = operand_b();
  for (auto _ : state) {
    for (std::int64_t e = 0; e < naive_sample; ++e) {
      const std::int64_t i = (e * 37) % rows_a;
      const std::int64_t j = (e * 101) % rows_b;
      wide sum = 0;
      for (std::int64_t k = 0; k < depth; ++k) sum += wide(a(i, k)) * wide(b(j, k));
      benchmark::DoNotOptimize(sum.convert_to<double>());
    }
  }
  per_entry_counter(state, naive_sample);
}

BENCHMARK(BM_EigenFp64Gemm)->Unit(benchmark::kMillisecond)->MinTime(2.0);
BENCHMARK(BM_Fp64Reference)->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK(BM_ExactReference)->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK(BM_NaiveMultiprecision)->Unit(benchmark::kMillisecond)->Iterations(1);

}  // namespace

BENCHMARK_MAIN();
