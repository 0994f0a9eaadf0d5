// Reference GEMMs of unquantized operands (NUMERICS.md section 8) and their certification.
//
// Orientation: A [M, K] and B [N, K] row-major (the reduction axis contiguous in both), C = A B^T,
// C[i, j] = sum over k of A[i, k] * B[j, k].
//
// - reference_kind::exact: every entry is the correctly rounded (round-to-nearest-even) fp64 and
//   fp32 value of the exact sum of the products of the stored fp32 inputs. A fast compensated pass
//   (error-free splitting of each product against a per-entry power of two, see src/reference.cpp
//   and docs/numerics.md "Exact reference") computes each entry with a rigorous error bound and
//   certifies the rounding; the rare entries it cannot certify are recomputed exactly with
//   core::long_accumulator. The result does not depend on the thread count.
// - reference_kind::fp64: a plain fp64 GEMM (Eigen) with its a-priori bound
//   |fp64 - exact| <= gamma_K * sum_k |A[i,k] B[j,k]|, gamma_K = K u / (1 - K u), u = 2^-53, stated
//   per entry and as a maximum. Its fp32 output is the fp64 result rounded once more to fp32.
//
// Non-finite inputs: an entry whose row of A or row of B holds an inf or NaN is the IEEE fp64 sum of
// the products in ascending k (inf or NaN); such entries are counted in stats.nonfinite_entries and
// have an infinite error bound.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "mxscope/tensor.hpp"

namespace mxscope {

enum class reference_kind : std::uint8_t { exact, fp64 };

std::optional<reference_kind> parse_reference_kind(std::string_view name);  // "exact" | "fp64"
std::string_view reference_kind_name(reference_kind kind);

struct reference_stats {
  std::int64_t entries = 0;
  // exact: entries whose rounding the fast pass certified, and entries recomputed with the long
  // accumulator because the certification failed (ties or near-ties, heavy cancellation).
  std::int64_t certified_entries = 0;
  std::int64_t fallback_entries = 0;
  // Entries that met inf or NaN inputs (both kinds).
  std::int64_t nonfinite_entries = 0;
  // exact: flat row-major indices (i * N + j) of the fallback entries, ascending.
  std::vector<std::int64_t> fallback_indices;
  // exact: doubles per vector in the fast pass (2 SSE2, 4 AVX2, 8 AVX-512; chosen at run time).
  int vector_lanes = 0;

  double fallback_fraction() const {
    return entries == 0 ? 0.0 : static_cast<double>(fallback_entries) / static_cast<double>(entries);
  }
};

struct reference_result {
  reference_kind kind = reference_kind::exact;
  matrix64 fp64;  // [M, N]
  matrix fp32;    // [M, N]
  // A bound on |fp64[i,j] - exact sum| over all finite entries: for `exact` the largest half ulp of
  // a result (the fp64 rounding itself), for `fp64` the largest per-entry a-priori bound.
  double error_bound = 0.0;
  // fp64 only: the per-entry a-priori bound gamma_K * sum_k |A[i,k] B[j,k]| (rounded upward).
  // Empty for `exact`.
  matrix64 entry_error_bound;
  reference_stats stats;
  // Computed on the GPU for a caller that keeps it there (reference_on with keep_on_device): fp64
  // and fp32 in device memory, and the host matrices above empty.
  device_matrix_ptr device_fp64;
  device_matrix_ptr device_fp32;
};

// Throws input_error when a.cols != b.cols or K >= 2^43 (the bounds assume K u <= 2^-10).
reference_result reference_gemm(const matrix& a, const matrix& b, reference_kind kind);

// The result of recomputing sampled entries with Boost.Multiprecision (an exact fixed-point integer
// sum of the products, rounded to nearest-even from that integer).
struct certification {
  std::int64_t entries_checked = 0;
  // Ordered-integer distance between result.fp64 and the exact sum rounded to fp64, and between
  // result.fp32 and the exact sum rounded to fp32 (0: bit-identical to the correctly rounded value).
  std::uint64_t max_ulp_fp64 = 0;
  std::uint64_t max_ulp_fp32 = 0;
  // max |result.fp64 - exact sum| (the difference rounded to fp64).
  double max_abs_error = 0.0;
  // fp64 kind: entries with |result.fp64 - exact sum| above entry_error_bound, and the largest
  // ratio error / bound (0 when every error is 0).
  std::int64_t bound_violations = 0;
  double max_bound_ratio = 0.0;
  // The entry with the largest fp64 ulp distance (-1 when none was checked).
  std::int64_t worst_row = -1;
  std::int64_t worst_col = -1;
  // exact: every sampled entry bit-identical in fp64 and fp32; fp64: no bound violation.
  bool passed = true;
};

// Recomputes `entry_count` output entries chosen with the canonical Philox stream keyed by `seed`
// (all entries when entry_count >= M * N, each once) and compares them with `result`. Entries with
// non-finite inputs are skipped.
certification certify(const matrix& a, const matrix& b, const reference_result& result,
                      std::int64_t entry_count, std::uint64_t seed);

}  // namespace mxscope
