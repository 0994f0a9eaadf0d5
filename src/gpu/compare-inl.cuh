// Part of host.cu (included there, in order, inside namespace mxscope::gpu):
// the comparison sums in the canonical order.
// ================================================================================================
// Comparison sums in the canonical order of compare.hpp: one thread per chunk of 4096 terms sums
// sequentially in fp64; the chunk partials come back to the host, which combines them with
// mxscope::canonical_tree. Counts, maxima and the ulp histogram are order-free.

namespace {

// A thread's walk over the elements first, first + 1, ..., first + n - 1 (`at(i)` gives element i's
// operands), in groups of compare_group: the group's loads are issued before its elements are
// taken in index order, so each thread keeps that many loads in flight. A chunk's elements are
// spread over the memory of one thread (consecutive threads, chunks 4096 elements apart), so it
// is these loads in flight, not coalescing, that reach the memory's bandwidth; the additions
// happen in the same order as one element at a time.
constexpr int compare_group = 16;

template <class At, class Take>
__device__ inline void walk_in_order(std::int64_t n, const At& at, const Take& take) {
  using operands = decltype(at(std::int64_t{0}));
  std::int64_t i = 0;
  for (; i + compare_group <= n; i += compare_group) {
    operands group[compare_group];
#pragma unroll
    for (int u = 0; u < compare_group; ++u) group[u] = at(i + u);
#pragma unroll
    for (int u = 0; u < compare_group; ++u) take(group[u]);
  }
  for (; i < n; ++i) take(at(i));
}

struct compared_pair {
  float hat32;
  float ref32;
  double g;
};
struct error_pair {
  float hat32;
  double g;
};

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
    const auto at = [&](std::int64_t i) {
      return compared_pair{estimate[begin + i], reference32[begin + i], reference[begin + i]};
    };
    walk_in_order(end - begin, at, [&](const compared_pair& pair) {
      const float hat32 = pair.hat32;
      const double hat = static_cast<double>(hat32);
      const double g = pair.g;
      const double e = hat - g;
      sums[0] = sums[0] + e * e;
      sums[1] = sums[1] + g * g;
      sums[2] = sums[2] + hat * hat;
      sums[3] = sums[3] + e * g;
      sums[4] = sums[4] + hat * g;
      const float ref32 = pair.ref32;
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
    });
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
    const auto at = [&](std::int64_t i) { return error_pair{estimate[begin + i], reference[begin + i]}; };
    walk_in_order(end - begin, at, [&](const error_pair& pair) {
      const double e = static_cast<double>(pair.hat32) - pair.g;
      const double d = e - bias * pair.g;
      sum = sum + d * d;
    });
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
    const std::int64_t first = r * cols + begin;
    const auto at = [&](std::int64_t i) { return error_pair{estimate[first + i], reference[first + i]}; };
    walk_in_order(end - begin, at, [&](const error_pair& pair) {
      const double e = static_cast<double>(pair.hat32) - pair.g;
      sum = sum + e * e;
    });
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
    // Consecutive threads take consecutive columns: each row's loads are coalesced.
    const auto at = [&](std::int64_t i) {
      const std::int64_t index = (begin + i) * cols + c;
      return error_pair{estimate[index], reference[index]};
    };
    walk_in_order(end - begin, at, [&](const error_pair& pair) {
      const double e = static_cast<double>(pair.hat32) - pair.g;
      sum = sum + e * e;
    });
    partials[t] = sum;
  }
}


}  // namespace

