// Part of host.cu (included there, in order, inside namespace mxscope::gpu):
// the comparison sums in the canonical order.
// ================================================================================================
// Comparison sums in the canonical order of compare.hpp: one thread per chunk of 4096 terms sums
// sequentially in fp64; the chunk partials come back to the host, which combines them with
// mxscope::canonical_tree. Counts, maxima and the ulp histogram are order-free.

namespace {

constexpr int compare_sum_count = 6;  // ||E||^2 ||G||^2 ||Ghat||^2 <E,G> <Ghat,G> sum of ulp distances

struct compare_counters {
  unsigned long long histogram[ulp_bucket_count];
  unsigned long long max_ulp;
  unsigned long long compared;
  unsigned long long nan_pairs;
  unsigned long long nonfinite_estimate;
  unsigned long long max_abs_bits;  // bits of max |E| over non-NaN E (non-negative: bit order = value order)
  unsigned long long saw_nan;
};

__global__ void compare_chunks_kernel(const float* estimate, const double* reference, const float* reference32,
                                      std::int64_t count, std::int64_t chunk_count, double* partials,
                                      compare_counters* counters) {
  MXSCOPE_GRID_LOOP(chunk, chunk_count) {
    double sums[compare_sum_count] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    unsigned long long histogram[ulp_bucket_count] = {};
    unsigned long long max_ulp = 0, compared = 0, nan_pairs = 0, nonfinite = 0, max_abs_bits = 0, saw_nan = 0;
    const std::int64_t begin = chunk * canonical_chunk;
    const std::int64_t end = begin + canonical_chunk < count ? begin + canonical_chunk : count;
    for (std::int64_t i = begin; i < end; ++i) {
      const float hat32 = estimate[i];
      const double hat = static_cast<double>(hat32);
      const double g = reference[i];
      const double e = hat - g;
      sums[0] = sums[0] + e * e;
      sums[1] = sums[1] + g * g;
      sums[2] = sums[2] + hat * hat;
      sums[3] = sums[3] + e * g;
      sums[4] = sums[4] + hat * g;
      const float ref32 = reference32[i];
      double distance = 0.0;
      if (hat32 != hat32 || ref32 != ref32) {
        ++nan_pairs;
      } else {
        const std::uint64_t d = ulp_distance(hat32, ref32);
        distance = static_cast<double>(d);
        ++histogram[ulp_bucket(d)];
        ++compared;
        if (d > max_ulp) max_ulp = d;
      }
      sums[5] = sums[5] + distance;
      if (e != e) {
        saw_nan = 1;
      } else {
        const unsigned long long bits = core_ns::double_bits(fabs(e));
        if (bits > max_abs_bits) max_abs_bits = bits;
      }
      if (!is_finite(hat)) ++nonfinite;
    }
    for (int s = 0; s < compare_sum_count; ++s) partials[s * chunk_count + chunk] = sums[s];
    for (int b = 0; b < ulp_bucket_count; ++b) {
      if (histogram[b] != 0) atomicAdd(&counters->histogram[b], histogram[b]);
    }
    atomicMax(&counters->max_ulp, max_ulp);
    atomicAdd(&counters->compared, compared);
    atomicAdd(&counters->nan_pairs, nan_pairs);
    atomicAdd(&counters->nonfinite_estimate, nonfinite);
    atomicMax(&counters->max_abs_bits, max_abs_bits);
    if (saw_nan != 0) atomicOr(&counters->saw_nan, saw_nan);
  }
}

__global__ void orthogonal_chunks_kernel(const float* estimate, const double* reference, std::int64_t count,
                                         std::int64_t chunk_count, double bias, double* partials) {
  MXSCOPE_GRID_LOOP(chunk, chunk_count) {
    double sum = 0.0;
    const std::int64_t begin = chunk * canonical_chunk;
    const std::int64_t end = begin + canonical_chunk < count ? begin + canonical_chunk : count;
    for (std::int64_t i = begin; i < end; ++i) {
      const double g = reference[i];
      const double e = static_cast<double>(estimate[i]) - g;
      const double d = e - bias * g;
      sum = sum + d * d;
    }
    partials[chunk] = sum;
  }
}

// Row r's canonical sum over its columns: partial (r, chunk) = columns [chunk*4096, ...).
__global__ void row_chunks_kernel(const float* estimate, const double* reference, std::int64_t rows, std::int64_t cols,
                                  std::int64_t chunks_per_row, double* partials) {
  MXSCOPE_GRID_LOOP(t, rows * chunks_per_row) {
    const std::int64_t r = t / chunks_per_row;
    const std::int64_t chunk = t % chunks_per_row;
    const std::int64_t begin = chunk * canonical_chunk;
    const std::int64_t end = begin + canonical_chunk < cols ? begin + canonical_chunk : cols;
    double sum = 0.0;
    for (std::int64_t c = begin; c < end; ++c) {
      const double e = static_cast<double>(estimate[r * cols + c]) - reference[r * cols + c];
      sum = sum + e * e;
    }
    partials[t] = sum;
  }
}

// Column c's canonical sum down its rows: partial (chunk, c) = rows [chunk*4096, ...).
__global__ void column_chunks_kernel(const float* estimate, const double* reference, std::int64_t rows,
                                     std::int64_t cols, std::int64_t chunks_per_column, double* partials) {
  MXSCOPE_GRID_LOOP(t, chunks_per_column * cols) {
    const std::int64_t chunk = t / cols;
    const std::int64_t c = t % cols;
    const std::int64_t begin = chunk * canonical_chunk;
    const std::int64_t end = begin + canonical_chunk < rows ? begin + canonical_chunk : rows;
    double sum = 0.0;
    for (std::int64_t r = begin; r < end; ++r) {
      const double e = static_cast<double>(estimate[r * cols + c]) - reference[r * cols + c];
      sum = sum + e * e;
    }
    partials[t] = sum;
  }
}


}  // namespace

