// Part of products.cu (included there, in order, inside namespace mxscope::gpu):
// the fp32-block product of unscaled operands on 32 x 32 entries per warp (CUDA tensor-core builds).
// -------------------------------------------------------------------------------------------
// plain_tile_kernel's block mode on reference_warp_kernel's layout: the same 64 x 64 tile of C,
// chunks of 32 (the K-block), chunk tiles staged as there (A by cp.async, B through registers) and
// 4 warps of 32 x 32 entries whose chunk dots come from the fp64 tensor cores (rw_tile_dots). Each
// entry keeps its fp32 accumulator in registers (32 per thread) and takes one step per chunk:
// - where the two rows' chunk spreads fit plain_chunk_budget, the chunk dot is exact in fp64 in any
//   order (see gemm_fp64_tiles-inl.cuh) and the step is fl32(acc + dot) by round_to_odd_step;
// - elsewhere (rare for bf16 values) the chunk's products are summed in fp64 with every addition
//   checked (chunk_products_exactly); where none rounded that sum is the exact dot and takes the
//   same step, else they are summed exactly in units of the rows' lowest exponents and added by
//   add_units_to_float, as plain_tile_kernel does.
// The per-product path walks its entries by their bits, with every accumulator of the thread parked
// in its own shared-memory slot meanwhile: an array of registers cannot be indexed by a variable,
// and unrolled over the 32 entries that path's calls spilled the kernel's registers.
// Entries whose rows do not fit plain_fits are left to the per-product kernel, as for
// plain_tile_kernel. Every computed entry is fl32(acc + exact chunk dot) in ascending chunks: the
// canonical fp32-block model's bits with blocks of 32 and scale 1.

#if defined(MXSCOPE_CUDA_TENSOR_CORES)

// The chunk tiles, the staged next chunk and the parked accumulators (below), one float per entry
// and thread: 60 KiB, past the 48 KiB default, so the launch opts in (runtime::allow_dynamic_shared).
constexpr std::size_t bw_parked_bytes = rw_rows * rw_cols * rw_threads * sizeof(float);
constexpr std::size_t bw_shared_bytes = rw_tiles_bytes + rw_stage_bytes + bw_parked_bytes;

// The index of the lowest set bit of a nonzero mask.
__device__ inline int lowest_set_bit(unsigned mask) {
#if defined(__CUDA_ARCH__) || defined(__HIP__)
  return __ffs(static_cast<int>(mask)) - 1;
#else
  return std::countr_zero(mask);
#endif
}

__global__ void __launch_bounds__(rw_threads, 2)
    block_warp_kernel(const float* a_tiles, const float* b_tiles, const std::int8_t* a_spreads,
                      const std::int8_t* b_spreads, plain_rows_view a_rows, plain_rows_view b_rows, std::int64_t m,
                      std::int64_t n, std::int64_t depth, int depth_bits, output_rounding output, float* out) {
  MXSCOPE_DYNAMIC_SHARED(double, bw_shared);
  double* const a_tile = bw_shared;
  double* const b_tile = bw_shared + plain_tile * dot_stride;
  __shared__ int a_spread_tile[plain_tile];
  __shared__ int b_spread_tile[plain_tile];
  __shared__ int a_low_tile[plain_tile];
  __shared__ int b_low_tile[plain_tile];
  const std::int64_t i0 = static_cast<std::int64_t>(blockIdx.y) * plain_tile;
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * plain_tile;
  const std::int64_t chunks = (depth + plain_chunk - 1) / plain_chunk;

  // The rows' lowest exponents (the per-product path's units) in shared memory.
  {
    const bool a_role = threadIdx.x < plain_tile;
    const std::int64_t i = (a_role ? i0 : j0) + static_cast<int>(threadIdx.x) % plain_tile;
    const std::int32_t* lows = a_role ? a_rows.low : b_rows.low;
    (a_role ? a_low_tile : b_low_tile)[threadIdx.x % plain_tile] = i < (a_role ? m : n) ? lows[i] : 0;
  }
  unsigned active = 0;  // bit r rw_cols + c: entry (r, c) is computed here
#pragma unroll
  for (int r = 0; r < rw_rows; ++r) {
    const std::int64_t i = i0 + rw_row(r);
    const int a_low = i < m ? a_rows.low[i] : 0;
    const int a_high = i < m ? a_rows.high[i] : plain_nonfinite_high;
#pragma unroll
    for (int c = 0; c < rw_cols; ++c) {
      const std::int64_t j = j0 + rw_col(c);
      const int b_low = j < n ? b_rows.low[j] : 0;
      const int b_high = j < n ? b_rows.high[j] : plain_nonfinite_high;
      if (plain_fits(a_low, a_high, b_low, b_high, depth_bits)) active |= 1U << (r * rw_cols + c);
    }
  }

  // The next chunk, as reference_warp_kernel fetches it (rw_chunk_loader; threads 0-63 the A rows'
  // chunk spreads, 64-127 the B rows').
  rw_chunk_loader loader(bw_shared + rw_tiles_bytes / sizeof(double), a_tiles, b_tiles, chunks);
  int spread_next = plain_empty_spread;
  const auto fetch = [&](std::int64_t chunk) {
    loader.fetch(chunk);
    const bool a_role = threadIdx.x < plain_tile;
    const std::int64_t i = (a_role ? i0 : j0) + static_cast<int>(threadIdx.x) % plain_tile;
    spread_next = i < (a_role ? m : n) ? (a_role ? a_spreads : b_spreads)[chunk * (a_role ? m : n) + i]
                                       : plain_empty_spread;
  };
  if (chunks > 0) fetch(0);

  float accumulators[rw_rows][rw_cols];
#pragma unroll
  for (int r = 0; r < rw_rows; ++r) {
#pragma unroll
    for (int c = 0; c < rw_cols; ++c) accumulators[r][c] = 0.0f;
  }

  for (std::int64_t chunk = 0; chunk < chunks; ++chunk) {
    loader.store(a_tile, b_tile);
    (threadIdx.x < plain_tile ? a_spread_tile : b_spread_tile)[threadIdx.x % plain_tile] = spread_next;
    __syncthreads();
    if (chunk + 1 < chunks) fetch(chunk + 1);

    // Every chunk's dots start from +0 (so that an empty chunk's dot is +0, never -0).
    double dots[rw_rows][rw_cols];
#pragma unroll
    for (int r = 0; r < rw_rows; ++r) {
#pragma unroll
      for (int c = 0; c < rw_cols; ++c) dots[r][c] = 0.0;
    }
    rw_tile_dots(a_tile, b_tile, dots);

    int a_spread[rw_rows], b_spread[rw_cols];
#pragma unroll
    for (int r = 0; r < rw_rows; ++r) a_spread[r] = a_spread_tile[rw_row(r)];
#pragma unroll
    for (int c = 0; c < rw_cols; ++c) b_spread[c] = b_spread_tile[rw_col(c)];
    unsigned per_product = 0;
#pragma unroll
    for (int r = 0; r < rw_rows; ++r) {
#pragma unroll
      for (int c = 0; c < rw_cols; ++c) {
        // Both branches' work without a branch (the step is a few instructions; a wide chunk's
        // dot is not used).
        const bool wide = a_spread[r] + b_spread[c] > plain_chunk_budget;
        const float stepped = round_to_odd_step(accumulators[r][c], dots[r][c], 1.0);
        accumulators[r][c] = wide ? accumulators[r][c] : stepped;
        per_product |= wide ? 1U << (r * rw_cols + c) : 0U;
      }
    }
    per_product &= active;
    if (per_product != 0) {
      // Every accumulator is parked, none live across the calls (whose ABI would spill them): slot e
      // of this thread is parked[e rw_threads + threadIdx.x] (a warp's slots are consecutive).
      float* const parked = reinterpret_cast<float*>(bw_shared + (rw_tiles_bytes + rw_stage_bytes) / sizeof(double));
#pragma unroll
      for (int r = 0; r < rw_rows; ++r) {
#pragma unroll
        for (int c = 0; c < rw_cols; ++c) {
          const int e = r * rw_cols + c;
          parked[e * rw_threads + threadIdx.x] = accumulators[r][c];
        }
      }
      for (unsigned left = per_product; left != 0; left &= left - 1) {
        const int e = lowest_set_bit(left);
        const int r = e / rw_cols;
        const int c = e % rw_cols;
        float& accumulator = parked[e * rw_threads + threadIdx.x];
        const double* const a_column = a_tile + rw_row(r) * dot_stride;
        const double* const b_column = b_tile + rw_col(c) * dot_stride;
        double dot = 0.0;
        if (chunk_products_exactly(a_column, b_column, dot)) {
          accumulator = round_to_odd_step(accumulator, dot, 1.0);
        } else {
          const int base = a_low_tile[rw_row(r)] + b_low_tile[rw_col(c)];
          const core_ns::int128 products = chunk_products_by_halves(a_column, b_column, base);
          accumulator = add_units_to_float(accumulator, products, base);
        }
      }
#pragma unroll
      for (int r = 0; r < rw_rows; ++r) {
#pragma unroll
        for (int c = 0; c < rw_cols; ++c) {
          const int e = r * rw_cols + c;
          accumulators[r][c] = parked[e * rw_threads + threadIdx.x];
        }
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < rw_rows; ++r) {
#pragma unroll
    for (int c = 0; c < rw_cols; ++c) {
      if ((active & (1U << (r * rw_cols + c))) == 0) continue;
      out[(i0 + rw_row(r)) * n + j0 + rw_col(c)] = finish_output(accumulators[r][c] * 1.0f, output);
    }
  }
}

#endif  // MXSCOPE_CUDA_TENSOR_CORES
