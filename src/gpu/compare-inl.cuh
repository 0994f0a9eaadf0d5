// Part of host.cu (included there, in order, inside namespace mxscope::gpu):
// the comparison sums in the canonical order.
// ================================================================================================
// Comparison sums in the canonical order of compare.hpp: each chunk of 4096 terms summed in index
// order in fp64 (a block of ordered_sum_lanes threads per chunk: ordered_chunk_sums, common.cuh;
// the column sums one thread per chunk, walk_in_order); the chunk partials come back to the host,
// which combines them with mxscope::canonical_tree. Counts, maxima and the ulp histogram are
// order-free.

namespace {

constexpr int compare_sum_count = 6;  // ||E||^2 ||G||^2 ||Ghat||^2 <E,G> <Ghat,G> sum of ulp distances
// Elements per lane and round of ordered_chunk_sums for the one-sum kernels; the six sums of
// compare_chunks_kernel keep 1 (at 4 its shared memory and registers cut the resident blocks and
// it ran slower, BENCHMARKS.md).
constexpr int compare_depth = 4;

struct compare_counters {
  unsigned long long histogram[ulp_bucket_count];
  unsigned long long max_ulp;
  unsigned long long compared;
  unsigned long long nan_pairs;
  unsigned long long nonfinite_estimate;
  unsigned long long max_abs_bits;  // bits of max |E| over non-NaN E (non-negative: bit order = value order)
  unsigned long long saw_nan;
};

// The six sums per chunk, and the order-free counts of the whole grid: each lane counts the
// elements it computed, the block's lanes are combined once at the end, and lane 0 adds them to
// the totals.
__global__ void compare_chunks_kernel(const float* estimate, const double* reference, const float* reference32,
                                      std::int64_t count, std::int64_t chunk_count, double* partials,
                                      compare_counters* counters) {
  unsigned long long histogram[ulp_bucket_count] = {};
  unsigned long long max_ulp = 0, compared = 0, nan_pairs = 0, nonfinite = 0, max_abs_bits = 0, saw_nan = 0;
  ordered_chunk_sums<compare_sum_count>(
      chunk_count, canonical_chunks{count},
      [&](std::int64_t i, double* t) {
        const float hat32 = estimate[i];
        const double hat = static_cast<double>(hat32);
        const double g = reference[i];
        const double e = hat - g;
        t[0] = e * e;
        t[1] = g * g;
        t[2] = hat * hat;
        t[3] = e * g;
        t[4] = hat * g;
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
        t[5] = distance;
        if (e != e) {
          saw_nan = 1;
        } else {
          const unsigned long long bits = core_ns::double_bits(fabs(e));
          if (bits > max_abs_bits) max_abs_bits = bits;
        }
        if (!is_finite(hat)) ++nonfinite;
      },
      partials);
  // The block's lanes' counts, combined by lane 0: slots 0 .. ulp_bucket_count - 1 the histogram,
  // then the three additive counts, then the three maxima.
  constexpr int slots = ulp_bucket_count + 6;
  __shared__ unsigned long long lane_counts[slots][ordered_sum_lanes];
  const int lane = static_cast<int>(threadIdx.x);
  for (int b = 0; b < ulp_bucket_count; ++b) lane_counts[b][lane] = histogram[b];
  const unsigned long long mine[6] = {compared, nan_pairs, nonfinite, max_ulp, max_abs_bits, saw_nan};
  for (int k = 0; k < 6; ++k) lane_counts[ulp_bucket_count + k][lane] = mine[k];
  __syncthreads();
  if (lane != 0) return;
  unsigned long long totals[slots] = {};
  for (int c = 0; c < slots; ++c) {
    for (int l = 0; l < ordered_sum_lanes; ++l) {
      const unsigned long long v = lane_counts[c][l];
      totals[c] = c < ulp_bucket_count + 3 ? totals[c] + v : (v > totals[c] ? v : totals[c]);
    }
  }
  for (int b = 0; b < ulp_bucket_count; ++b) {
    if (totals[b] != 0) atomicAdd(&counters->histogram[b], totals[b]);
  }
  const unsigned long long* const counts = totals + ulp_bucket_count;
  if (counts[0] != 0) atomicAdd(&counters->compared, counts[0]);
  if (counts[1] != 0) atomicAdd(&counters->nan_pairs, counts[1]);
  if (counts[2] != 0) atomicAdd(&counters->nonfinite_estimate, counts[2]);
  atomicMax(&counters->max_ulp, counts[3]);
  atomicMax(&counters->max_abs_bits, counts[4]);
  if (counts[5] != 0) atomicOr(&counters->saw_nan, counts[5]);
}

__global__ void orthogonal_chunks_kernel(const float* estimate, const double* reference, std::int64_t count,
                                         std::int64_t chunk_count, double bias, double* partials) {
  ordered_chunk_sums<1, compare_depth>(
      chunk_count, canonical_chunks{count},
      [&](std::int64_t i, double* t) {
        const double g = reference[i];
        const double e = static_cast<double>(estimate[i]) - g;
        const double d = e - bias * g;
        t[0] = d * d;
      },
      partials);
}

// Row r's canonical sum over its columns: partial (r, chunk) = columns [chunk*4096, ...).
__global__ void row_chunks_kernel(const float* estimate, const double* reference, std::int64_t rows, std::int64_t cols,
                                  std::int64_t chunks_per_row, double* partials) {
  const auto item = [=](std::int64_t w) {
    const std::int64_t r = w / chunks_per_row;
    const std::int64_t begin = (w % chunks_per_row) * canonical_chunk;
    return element_range{r * cols + begin, cols - begin < canonical_chunk ? cols - begin : canonical_chunk};
  };
  ordered_chunk_sums<1, compare_depth>(
      rows * chunks_per_row, item,
      [&](std::int64_t i, double* t) {
        const double e = static_cast<double>(estimate[i]) - reference[i];
        t[0] = e * e;
      },
      partials);
}

// A thread's walk over the elements first, first + 1, ..., first + n - 1 (`at(i)` gives element i's
// operands), in groups of compare_group: each group's loads are issued before the previous group's
// elements are taken, in index order, so each thread keeps one to two groups of loads in flight
// and its additions never wait for a whole group's latency; they happen in the same order as one
// element at a time.
constexpr int compare_group = 16;

template <class At, class Take>
__device__ inline void walk_in_order(std::int64_t n, const At& at, const Take& take) {
  using operands = decltype(at(std::int64_t{0}));
  std::int64_t i = 0;
  operands current[compare_group];
  if (n >= compare_group) {
#pragma unroll
    for (int u = 0; u < compare_group; ++u) current[u] = at(u);
  }
  for (; i + compare_group <= n; i += compare_group) {
    const bool more = i + 2 * compare_group <= n;
    operands next[compare_group];
    if (more) {
#pragma unroll
      for (int u = 0; u < compare_group; ++u) next[u] = at(i + compare_group + u);
    }
#pragma unroll
    for (int u = 0; u < compare_group; ++u) take(current[u]);
    if (more) {
#pragma unroll
      for (int u = 0; u < compare_group; ++u) current[u] = next[u];
    }
  }
  for (; i < n; ++i) take(at(i));
}

constexpr int column_chunk_threads = 64;

struct error_pair {
  float hat32;
  double g;
};

// Column c's canonical sum down its rows: partial (chunk, c) = rows [chunk*4096, ...). Consecutive
// threads take consecutive columns, so each row's loads are coalesced.
__global__ void column_chunks_kernel(const float* estimate, const double* reference, std::int64_t rows,
                                     std::int64_t cols, std::int64_t chunks_per_column, double* partials) {
  MXSCOPE_GRID_LOOP(t, chunks_per_column * cols) {
    const std::int64_t chunk = t / cols;
    const std::int64_t c = t % cols;
    const std::int64_t begin = chunk * canonical_chunk;
    const std::int64_t end = begin + canonical_chunk < rows ? begin + canonical_chunk : rows;
    double sum = 0.0;
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

