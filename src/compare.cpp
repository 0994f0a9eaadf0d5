// Comparison metrics in the canonical reduction order (include/mxscope/compare.hpp).
#include "mxscope/compare.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "mxscope/errors.hpp"

namespace mxscope {

double canonical_sum(std::span<const double> values) {
  return canonical_sum(static_cast<std::int64_t>(values.size()),
                       [&](std::int64_t i) { return values[static_cast<std::size_t>(i)]; });
}

namespace {

void require_same_shape(std::int64_t estimate_rows, std::int64_t estimate_cols, const matrix64& reference,
                        const char* what) {
  if (estimate_rows != reference.rows || estimate_cols != reference.cols) {
    throw input_error(std::string("compare: ") + what + " is [" + std::to_string(estimate_rows) + ", " +
                      std::to_string(estimate_cols) + "] but the reference is [" + std::to_string(reference.rows) +
                      ", " + std::to_string(reference.cols) + "]");
  }
}

// The shared implementation: estimate_at(i) is Ghat in fp64 (exact from fp32), estimate32_at(i)
// the fp32 value the ulp statistics use, reference32_at(i) the fp32 reference. E is recomputed
// where it is needed instead of stored, so memory stays O(rows + cols) for any matrix size.
template <class Estimate, class Estimate32, class Reference32>
comparison compare_impl(std::int64_t rows, std::int64_t cols, const matrix64& reference, Estimate&& estimate_at,
                        Estimate32&& estimate32_at, Reference32&& reference32_at) {
  comparison out;
  out.rows = rows;
  out.cols = cols;
  const std::int64_t count = rows * cols;
  const double* g = reference.data();
  const auto error_at = [&](std::int64_t i) { return estimate_at(i) - g[i]; };

  // Pass 1: ||E||^2, ||G||^2, ||Ghat||^2, <E, G>, <Ghat, G>.
  const std::array<double, 5> sums = canonical_sums<5>(count, [&](std::int64_t i) {
    const double hat = estimate_at(i);
    const double gi = g[i];
    const double e = hat - gi;
    return std::array<double, 5>{e * e, gi * gi, hat * hat, e * gi, hat * gi};
  });
  if (finish_from_sums(out, sums.data())) {
    // Pass 2: ||E - bias G||^2 with the bias of pass 1.
    const double bias = out.bias;
    const double orthogonal = canonical_sum(count, [&](std::int64_t i) {
      const double d = error_at(i) - bias * g[i];
      return d * d;
    });
    finish_orthogonal(out, orthogonal);
  }

  // Order-free statistics: max |E| (NaN if any E is NaN), non-finite estimates, ulp histogram.
  bool saw_nan = false;
  double max_abs = 0.0;
  const auto distance_at = [&](std::int64_t i) -> double {
    const float hat32 = estimate32_at(i);
    const float ref32 = reference32_at(i);
    if (std::isnan(hat32) || std::isnan(ref32)) return 0.0;
    return static_cast<double>(ulp_distance(hat32, ref32));
  };
  for (std::int64_t i = 0; i < count; ++i) {
    const double e = error_at(i);
    if (std::isnan(e)) saw_nan = true;
    else if (std::fabs(e) > max_abs) max_abs = std::fabs(e);
    if (!std::isfinite(estimate_at(i))) ++out.nonfinite_estimate;
    const float hat32 = estimate32_at(i);
    const float ref32 = reference32_at(i);
    if (std::isnan(hat32) || std::isnan(ref32)) {
      ++out.ulp.nan_pairs;
      continue;
    }
    const std::uint64_t distance = ulp_distance(hat32, ref32);
    ++out.ulp.histogram[static_cast<std::size_t>(ulp_bucket(distance))];
    ++out.ulp.compared;
    if (distance > out.ulp.max) out.ulp.max = distance;
  }
  out.max_abs_err = saw_nan ? std::numeric_limits<double>::quiet_NaN() : max_abs;
  // The mean distance: canonical sum over all entries (NaN pairs contribute 0) / compared pairs.
  out.ulp.mean = out.ulp.compared == 0 ? 0.0 : canonical_sum(count, distance_at) / static_cast<double>(out.ulp.compared);

  // Row norms: each row is its own canonical sum over its columns.
  out.row_error_norms.assign(static_cast<std::size_t>(rows), 0.0);
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
  for (std::int64_t r = 0; r < rows; ++r) {
    const double squared = canonical_sum(
        cols,
        [&](std::int64_t c) {
          const double e = error_at(r * cols + c);
          return e * e;
        },
        false);
    out.row_error_norms[static_cast<std::size_t>(r)] = std::sqrt(squared);
  }

  // Column norms: each column is its own canonical sum down its rows (chunks of 4096 rows summed
  // sequentially, then the pairwise tree), computed for all columns at once to walk memory by rows.
  out.column_error_norms.assign(static_cast<std::size_t>(cols), 0.0);
  if (rows > 0 && cols > 0) {
    const std::int64_t chunk_count = (rows + canonical_chunk - 1) / canonical_chunk;
    constexpr std::int64_t column_block = 256;
    const std::int64_t column_blocks = (cols + column_block - 1) / column_block;
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (std::int64_t block = 0; block < column_blocks; ++block) {
      const std::int64_t c0 = block * column_block;
      const std::int64_t width = std::min(column_block, cols - c0);
      std::vector<double> partials(static_cast<std::size_t>(chunk_count * width), 0.0);  // [chunk][column]
      for (std::int64_t chunk = 0; chunk < chunk_count; ++chunk) {
        double* accumulators = partials.data() + chunk * width;
        const std::int64_t end = std::min(rows, (chunk + 1) * canonical_chunk);
        for (std::int64_t r = chunk * canonical_chunk; r < end; ++r) {
          for (std::int64_t c = 0; c < width; ++c) {
            const double e = error_at(r * cols + c0 + c);
            accumulators[c] = accumulators[c] + e * e;
          }
        }
      }
      std::vector<double> column_partials(static_cast<std::size_t>(chunk_count));
      for (std::int64_t c = 0; c < width; ++c) {
        for (std::int64_t chunk = 0; chunk < chunk_count; ++chunk) {
          column_partials[static_cast<std::size_t>(chunk)] = partials[static_cast<std::size_t>(chunk * width + c)];
        }
        out.column_error_norms[static_cast<std::size_t>(c0 + c)] = std::sqrt(canonical_tree(column_partials));
      }
    }
  }
  return out;
}

}  // namespace

comparison compare(const matrix& estimate, const matrix64& reference, const matrix& reference_fp32) {
  require_same_shape(estimate.rows, estimate.cols, reference, "the estimate");
  require_same_shape(reference_fp32.rows, reference_fp32.cols, reference, "the fp32 reference");
  const float* hat = estimate.data();
  const float* ref32 = reference_fp32.data();
  return compare_impl(
      estimate.rows, estimate.cols, reference, [&](std::int64_t i) { return static_cast<double>(hat[i]); },
      [&](std::int64_t i) { return hat[i]; }, [&](std::int64_t i) { return ref32[i]; });
}

comparison compare(const matrix& estimate, const matrix64& reference) {
  require_same_shape(estimate.rows, estimate.cols, reference, "the estimate");
  const float* hat = estimate.data();
  const double* g = reference.data();
  return compare_impl(
      estimate.rows, estimate.cols, reference, [&](std::int64_t i) { return static_cast<double>(hat[i]); },
      [&](std::int64_t i) { return hat[i]; }, [&](std::int64_t i) { return static_cast<float>(g[i]); });
}

comparison compare(const matrix64& estimate, const matrix64& reference) {
  require_same_shape(estimate.rows, estimate.cols, reference, "the estimate");
  const double* hat = estimate.data();
  const double* g = reference.data();
  return compare_impl(
      estimate.rows, estimate.cols, reference, [&](std::int64_t i) { return hat[i]; },
      [&](std::int64_t i) { return static_cast<float>(hat[i]); },
      [&](std::int64_t i) { return static_cast<float>(g[i]); });
}

}  // namespace mxscope
