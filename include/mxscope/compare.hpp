// Comparison of a strategy result Ghat with a reference G: the per-step error metrics of METRICS.md.
//
// Everything is computed in fp64 (Ghat fp32 -> fp64 is exact; E = Ghat - G is rounded once to
// fp64), and every sum follows ONE canonical reduction order so that the metrics are bit-identical
// for any thread count and, later, on the GPU backend:
//
//   canonical order of a sum of n terms x_0 .. x_{n-1} (flat row-major order for a matrix):
//   1. split into chunks of canonical_chunk = 4096 consecutive terms (the last chunk may be short);
//   2. sum each chunk sequentially in fp64: acc = +0.0; acc = acc + x_i for i ascending;
//   3. combine the chunk partials p_0 .. p_{c-1} by a fixed pairwise tree, level by level:
//      q_i = p_{2i} + p_{2i+1}; an odd last partial moves up unchanged; repeat until one is left.
//   An empty sum is +0.0.
//
// Metrics (docs/numerics.md "Comparison metrics and reduction order"):
//   rel_err  = ||E|| / ||G||        cosine   = <Ghat, G> / (||Ghat|| ||G||)
//   bias     = <E, G> / ||G||^2     orth_err = ||E - bias G|| / ||G||
//   max_abs_err = max |E|, ulp statistics of Ghat (fp32) against G rounded to fp32, per-row and
//   per-column error norms.
// Zero norms: ||G|| = 0 gives rel_err = orth_err = 0 when ||E|| = 0 and +inf otherwise, bias = 0,
// and zero_reference = true; cosine is 1 when both norms are 0 and 0 when exactly one is.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "mxscope/core/config.hpp"
#include "mxscope/tensor.hpp"

namespace mxscope {

// ---------------------------------------------------------------------------------------------
// Canonical reduction order.

inline constexpr std::int64_t canonical_chunk = 4096;

// Combines chunk partials in place by the fixed pairwise tree and returns the total (+0.0 if empty).
inline double canonical_tree(std::span<double> partials) {
  std::size_t count = partials.size();
  if (count == 0) return 0.0;
  while (count > 1) {
    const std::size_t pairs = count / 2;
    for (std::size_t i = 0; i < pairs; ++i) partials[i] = partials[2 * i] + partials[2 * i + 1];
    if (count % 2 == 1) partials[pairs] = partials[count - 1];
    count = pairs + count % 2;
  }
  return partials[0];
}

// The canonical order with the chunk sums left to the caller: sum_chunk(begin, end, accumulators)
// must add the terms of [begin, end) to the `width` accumulators (each starting at +0.0), each
// sequentially in ascending index order; the partials are then combined by canonical_tree. One call
// per chunk, each chunk on one thread. `parallel` spreads the chunks over OpenMP threads (the result
// does not change); pass false inside an already parallel loop. A caller may split a chunk into
// several loops as long as each accumulator still sees its terms in index order.
template <std::size_t width, class SumChunk>
std::array<double, width> canonical_chunk_sums(std::int64_t count, SumChunk&& sum_chunk, bool parallel = true) {
  std::array<double, width> totals{};
  if (count <= 0) return totals;
  const std::int64_t chunk_count = (count + canonical_chunk - 1) / canonical_chunk;
  std::vector<double> partials(static_cast<std::size_t>(chunk_count * static_cast<std::int64_t>(width)));
  const auto one_chunk = [&](std::int64_t chunk) {
    std::array<double, width> accumulators{};
    const std::int64_t begin = chunk * canonical_chunk;
    const std::int64_t end = begin + canonical_chunk < count ? begin + canonical_chunk : count;
    sum_chunk(begin, end, accumulators);
    for (std::size_t w = 0; w < width; ++w) {
      partials[static_cast<std::size_t>(static_cast<std::int64_t>(w) * chunk_count + chunk)] = accumulators[w];
    }
  };
  if (parallel && chunk_count > 1) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (std::int64_t chunk = 0; chunk < chunk_count; ++chunk) one_chunk(chunk);
  } else {
    for (std::int64_t chunk = 0; chunk < chunk_count; ++chunk) one_chunk(chunk);
  }
  for (std::size_t w = 0; w < width; ++w) {
    totals[w] = canonical_tree(std::span<double>(partials.data() + w * static_cast<std::size_t>(chunk_count),
                                                 static_cast<std::size_t>(chunk_count)));
  }
  return totals;
}

// Sums `width` interleaved quantities term(i) -> std::array<double, width>, i in [0, count), each in
// the canonical order. Identical to `width` separate canonical sums. term(i) is called exactly once
// per i. `parallel` as for canonical_chunk_sums.
template <std::size_t width, class Terms>
std::array<double, width> canonical_sums(std::int64_t count, Terms&& terms, bool parallel = true) {
  return canonical_chunk_sums<width>(
      count,
      [&](std::int64_t begin, std::int64_t end, std::array<double, width>& accumulators) {
        for (std::int64_t i = begin; i < end; ++i) {
          const std::array<double, width> values = terms(i);
          for (std::size_t w = 0; w < width; ++w) accumulators[w] = accumulators[w] + values[w];
        }
      },
      parallel);
}

// The canonical sum of term(i), i in [0, count).
template <class Term>
double canonical_sum(std::int64_t count, Term&& term, bool parallel = true) {
  return canonical_sums<1>(
      count, [&](std::int64_t i) { return std::array<double, 1>{term(i)}; }, parallel)[0];
}

double canonical_sum(std::span<const double> values);

// ---------------------------------------------------------------------------------------------
// Ulp distances through the ordered-integer representation: the bit pattern of a non-negative
// value read as an integer, of a negative value the negated integer of its magnitude. +0 and -0
// both map to 0, adjacent floats differ by 1, the smallest subnormals of both signs by 2, and the
// largest finite value and infinity by 1. NaN has no ordered value (callers count NaN separately).

MXSCOPE_HD constexpr std::int64_t ordered_integer(float value) {
  const std::uint32_t bits = core::float_bits(value);
  const std::int64_t magnitude = static_cast<std::int64_t>(bits & 0x7fffffffU);
  return (bits >> 31) != 0 ? -magnitude : magnitude;
}

MXSCOPE_HD constexpr std::uint64_t ulp_distance(float a, float b) {
  const std::int64_t difference = ordered_integer(a) - ordered_integer(b);
  return static_cast<std::uint64_t>(difference < 0 ? -difference : difference);
}

// fp64: the magnitudes span 63 bits, so the distance is computed in unsigned arithmetic.
MXSCOPE_HD constexpr std::uint64_t ulp_distance(double a, double b) {
  const std::uint64_t bits_a = core::double_bits(a);
  const std::uint64_t bits_b = core::double_bits(b);
  const std::uint64_t magnitude_a = bits_a & 0x7fffffffffffffffULL;
  const std::uint64_t magnitude_b = bits_b & 0x7fffffffffffffffULL;
  const bool negative_a = (bits_a >> 63) != 0 && magnitude_a != 0;
  const bool negative_b = (bits_b >> 63) != 0 && magnitude_b != 0;
  if (negative_a == negative_b) return magnitude_a > magnitude_b ? magnitude_a - magnitude_b : magnitude_b - magnitude_a;
  return magnitude_a + magnitude_b;  // below 2^64: each magnitude of a finite or infinite value is < 2^63
}

// ---------------------------------------------------------------------------------------------
// Metrics.

// Histogram buckets of the ulp distance d: bucket 0 holds d = 0, bucket b (1..20) holds
// 2^(b-1) <= d < 2^b (1, 2-3, 4-7, ..., 2^19 .. 2^20 - 1), bucket 21 holds d >= 2^20.
inline constexpr int ulp_bucket_count = 22;

MXSCOPE_HD constexpr int ulp_bucket(std::uint64_t distance) {
  if (distance == 0) return 0;
  const int bit_length = 64 - __builtin_clzll(distance);  // d in [2^(L-1), 2^L)
  return bit_length > 20 ? 21 : bit_length;
}

struct ulp_statistics {
  std::array<std::int64_t, ulp_bucket_count> histogram{};
  std::uint64_t max = 0;
  double mean = 0.0;             // canonical sum of the distances / compared
  std::int64_t compared = 0;     // pairs where neither value is NaN
  std::int64_t nan_pairs = 0;    // pairs where either value is NaN (not in the histogram)
};

struct comparison {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  double rel_err = 0.0;
  double cosine = 0.0;
  double bias = 0.0;
  double orth_err = 0.0;
  double max_abs_err = 0.0;  // NaN when any E entry is NaN
  // The norms and inner products the ratios come from (canonical sums, then sqrt).
  double error_norm = 0.0;       // ||E||
  double reference_norm = 0.0;   // ||G||
  double estimate_norm = 0.0;    // ||Ghat||
  double error_dot_reference = 0.0;     // <E, G>
  double estimate_dot_reference = 0.0;  // <Ghat, G>
  bool zero_reference = false;          // ||G|| == 0 (see the zero-norm rules above)
  std::int64_t nonfinite_estimate = 0;  // inf or NaN entries of Ghat
  ulp_statistics ulp;
  std::vector<double> row_error_norms;     // [rows]: ||E[r, :]||, canonical sum over the row
  std::vector<double> column_error_norms;  // [cols]: ||E[:, c]||, canonical sum down the column
};

// The ratios of a comparison from its canonical sums ||E||^2, ||G||^2, ||Ghat||^2, <E, G>, <Ghat, G>
// (sums[0..4]), written once for the CPU (src/compare.cpp) and the GPU (src/gpu/compare_api-inl.cuh).
// Returns whether the second pass is needed: ||E - bias G||^2, which finish_orthogonal takes (with
// ||G|| = 0 the zero-norm rules above fill every ratio here).
inline bool finish_from_sums(comparison& out, const double* sums) {
  out.error_norm = std::sqrt(sums[0]);
  out.reference_norm = std::sqrt(sums[1]);
  out.estimate_norm = std::sqrt(sums[2]);
  out.error_dot_reference = sums[3];
  out.estimate_dot_reference = sums[4];
  if (out.reference_norm == 0.0) {
    out.zero_reference = true;
    out.rel_err = out.error_norm == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
    out.orth_err = out.rel_err;
    out.bias = 0.0;
    out.cosine = out.estimate_norm == 0.0 ? 1.0 : 0.0;
    return false;
  }
  out.rel_err = out.error_norm / out.reference_norm;
  out.bias = out.error_dot_reference / sums[1];
  return true;
}

// orth_err and cosine once the second pass has summed ||E - bias G||^2.
inline void finish_orthogonal(comparison& out, double orthogonal_sum) {
  out.orth_err = std::sqrt(orthogonal_sum) / out.reference_norm;
  out.cosine = out.estimate_norm == 0.0 ? 0.0 : out.estimate_dot_reference / (out.estimate_norm * out.reference_norm);
}

// Ghat fp32 against G fp64; the ulp statistics use reference_fp32 (the correctly rounded fp32
// reference, e.g. reference_result::fp32). Throws input_error on shape mismatch.
comparison compare(const matrix& estimate, const matrix64& reference, const matrix& reference_fp32);
// As above with reference_fp32 = G rounded to fp32 (RNE) entry by entry.
comparison compare(const matrix& estimate, const matrix64& reference);
// Ghat fp64: the norms use Ghat as is; the ulp statistics compare Ghat rounded to fp32 with G
// rounded to fp32.
comparison compare(const matrix64& estimate, const matrix64& reference);

}  // namespace mxscope
