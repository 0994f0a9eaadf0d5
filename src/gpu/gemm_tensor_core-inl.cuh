// Part of products.cu (included there, in order, inside namespace mxscope::gpu):
// the int8 tensor-core path and its fast fp32-block kernel.
// -------------------------------------------------------------------------------------------
// Tensor-core path (CUDA, sm_80+): mma.sync m16n8k32 s8 x s8 -> s32 per 32-block gives each block
// dot D exactly (|D| <= 32 * 127^2 < 2^19, far inside s32). Two kernels: for fp32-block,
// tensor_core_block_kernel (below) runs the step acc = fl32(acc + D * 2^(ea + eb - fa - fb)) in
// ascending K per entry; for exact, tensor_core_exact_kernel sums the scaled dots in fp64 and
// leaves the entries it cannot prove exact to tensor_core_exact_fixup_kernel.
//
// The general fp32-block step (tensor_core_step): where 2^k (k = ea + eb - fa - fb) is a normal
// fp32 number and |D| 2^k < 2^128 (-126 <= k <= 100 here), float(D) * 2^k is exact in fp32 and
// one fp32 addition rounds the exact sum once: it IS fl32(acc + c). Elsewhere (and for NaN blocks)
// the step goes through add_exact_value in fp64.
//
// tensor_core_exact_kernel's tiling: a 128 x 64 tile of C per thread block of 8 warps (4 x 2),
// 32 x 32 per warp (2 x 4 mma tiles, 32 fp64 sums per thread: at most 128 registers, two thread
// blocks per multiprocessor); each stage holds one 32-byte K-block of 128 rows of A and 64 of B
// plus their exponents, three stages deep (cp.async).

#if defined(MXSCOPE_CUDA_TENSOR_CORES)

constexpr double biased_double_offset = 4503601774854144.0;  // c = 2^52 + 2^31

// c + x, exactly, for every int32 x, from its bits (high word 0x43300000, low word x ^ 2^31): an
// integer's double by one logic operation instead of a conversion (a quarter of the fp64 rate);
// biased_double(x) - c is x.
__device__ inline double biased_double(int x) {
  return core_ns::bits_double(0x4330000000000000ULL | (static_cast<std::uint32_t>(x) ^ 0x80000000U));
}

constexpr int tc_tile = 128;
constexpr int tc_exact_tile_n = 64;  // columns of tensor_core_exact_kernel's tile
constexpr int tc_stages = 3;
constexpr int tc_row_stride = 48;  // bytes per smem row: 32 data + 16 pad (conflict-free fragment loads)
constexpr int tc_fast_k_low = -126;
constexpr int tc_fast_k_high = 100;
// Exact: 2^k is a normal double and |D| 2^k stays far from overflow.
constexpr int tc_exact_k_low = -1000;
constexpr int tc_exact_k_high = 900;

struct alignas(16) tc_stage {
  std::uint8_t a[tc_tile * tc_row_stride];
  std::uint8_t b[tc_exact_tile_n * tc_row_stride];
  std::int32_t a_exponents[tc_tile];
  std::int32_t b_exponents[tc_exact_tile_n];
};

#if defined(MXSCOPE_GPU_SIMULATE)
inline void mma_s8(int (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
  simulation::mma_s8(d, a, b);
}
#else
// mma.sync m16n8k32 s8 x s8 + 0 -> s32 (the fragment layout is spelled out in simulation.hpp).
__device__ inline void mma_s8(int (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(0), "r"(0), "r"(0), "r"(0));
}
#endif

__device__ __noinline__ float tensor_core_slow_step(float accumulator, int dot, std::int32_t exponent_a,
                                                    std::int32_t exponent_b, int fraction_total) {
  return add_exact_value(accumulator,
                         scaled_block_dot(static_cast<double>(dot), exponent_a, exponent_b, fraction_total));
}

__device__ inline float tensor_core_step(float accumulator, int dot, std::int32_t exponent_a, std::int32_t exponent_b,
                                         int fraction_total) {
  const int k = exponent_a + exponent_b - fraction_total;  // NaN markers make k huge: slow path
  if (k >= tc_fast_k_low && k <= tc_fast_k_high) {
    const float power = core_ns::bits_float(static_cast<std::uint32_t>(k + 127) << 23);
    return __fadd_rn(accumulator, __fmul_rn(static_cast<float>(dot), power));
  }
  return tensor_core_slow_step(accumulator, dot, exponent_a, exponent_b, fraction_total);
}

// One thread's part of filling a stage with K-block after K-block (256 threads: one 16-byte chunk
// of an A row each, the first 128 also one of a B row, and the A rows' then the B rows'
// exponents), its sources computed once and stepped by a pointer addition per K-block: the 64-bit
// index arithmetic of a fresh address per call was a sixth of the kernel's instructions. A row
// past the end keeps a fixed in-bounds source and copies zeros.
struct tc_stage_loader {
  const std::int8_t* a_source;
  const std::int8_t* b_source;
  const std::int32_t* e_source;
  std::int64_t e_step;
  int data_offset;  // this thread's 16 bytes in stage.a and stage.b
  bool a_inside, b_inside, e_inside;

  __device__ tc_stage_loader(const std::int8_t* a, const std::int32_t* a_exponents, const std::int8_t* b,
                             const std::int32_t* b_exponents, std::int64_t m, std::int64_t n, std::int64_t stride,
                             std::int64_t i0, std::int64_t j0) {
    const int t = threadIdx.x;
    const int row = t / 2;
    const int half = t % 2;
    data_offset = row * tc_row_stride + half * 16;
    a_inside = i0 + row < m;
    a_source = a_inside ? a + (i0 + row) * stride + half * 16 : a;
    b_inside = row < tc_exact_tile_n && j0 + row < n;
    b_source = b_inside ? b + (j0 + row) * stride + half * 16 : b;
    const bool a_role = t < tc_tile;
    const std::int64_t first = a_role ? i0 + t : j0 + (t - tc_tile);
    e_inside = a_role ? first < m : t < tc_tile + tc_exact_tile_n && first < n;
    e_step = a_role ? m : n;
    e_source = a_role ? (e_inside ? a_exponents + first : a_exponents) : (e_inside ? b_exponents + first : b_exponents);
  }

  // Fills `stage` with the next K-block (the first call K-block 0).
  __device__ void load(tc_stage& stage) {
    const int t = threadIdx.x;
    copy_async_16(stage.a + data_offset, a_source, a_inside);
    if (t < 2 * tc_exact_tile_n) copy_async_16(stage.b + data_offset, b_source, b_inside);
    if (t < tc_tile) {
      copy_async_4(&stage.a_exponents[t], e_source, e_inside);
    } else if (t < tc_tile + tc_exact_tile_n) {
      copy_async_4(&stage.b_exponents[t - tc_tile], e_source, e_inside);
    }
    if (a_inside) a_source += 32;
    if (b_inside) b_source += 32;
    if (e_inside) e_source += e_step;
  }
};

// Each entry keeps a running fp64 sum of the scaled block dots D * 2^k (exact doubles: |D| < 2^20)
// and checks every addition (add_product_rounds); an entry whose sum ever rounded (or that meets a NaN
// block or an extreme k) is flagged in `flagged` and left to tensor_core_exact_fixup_kernel.
// Unflagged entries' running sums are the exact sums, written as the fp64 result and converted
// once (RNE) to fp32.
//
// Window tiles: every scaled dot of entry (i, j) is a multiple of 2^L, L = lo_a(i) + lo_b(j) - f
// (lo, hi: the smallest and largest block exponent of the row along K), and every partial sum is
// below blocks * 2^dot_bits * 2^H, H = hi_a(i) + hi_b(j) - f. When span_a(i) + span_b(j) (span =
// hi - lo) is at most span_budget = 53 - dot_bits - bits(blocks), every partial sum is a double:
// no addition rounds, and the step is one FMA, D * 2^k + running, with no check. A tile takes that
// path when its largest row span and largest column span add up to at most the budget (NaN
// blocks make a span of at least 2^20).
__global__ void __launch_bounds__(256, 2)
    tensor_core_exact_kernel(const std::int8_t* a, const std::int32_t* a_exponents, const std::int8_t* b,
                             const std::int32_t* b_exponents, std::int64_t m, std::int64_t n, std::int64_t stride,
                             std::int64_t blocks, int fraction_total, output_rounding output, float* out,
                             double* exact_out, std::uint8_t* flagged, const std::int32_t* a_spans,
                             const std::int32_t* b_spans, int span_budget) {
  __shared__ tc_stage stages[tc_stages];
  __shared__ int tile_spans[2][tc_tile];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group_id = lane / 4;         // row (A, C) or column (B, C) within an mma tile
  const int thread_in_group = lane % 4;  // k offset (A, B) or column pair (C)
  const int warp_m = warp / 2;           // 0..3: 32 rows each
  const int warp_n = warp % 2;           // 0..1: 32 columns each
  const std::int64_t i0 = static_cast<std::int64_t>(blockIdx.y) * tc_tile;
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * tc_exact_tile_n;

  double accumulators[2][4][4];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) accumulators[mi][ni][e] = 0;
  std::uint64_t flags = 0;  // bit mi * 16 + ni * 4 + e for a flagged entry

  // The tile's largest row and column spans (rows past the end, and past the tile's 64 columns, count 0).
  if (threadIdx.x < tc_tile) {
    const std::int64_t i = i0 + threadIdx.x;
    tile_spans[0][threadIdx.x] = i < m ? a_spans[i] : 0;
  } else {
    const int r = static_cast<int>(threadIdx.x) - tc_tile;
    const std::int64_t j = j0 + r;
    tile_spans[1][r] = r < tc_exact_tile_n && j < n ? b_spans[j] : 0;
  }
  __syncthreads();
  for (int width = tc_tile / 2; width > 0; width /= 2) {
    if (static_cast<int>(threadIdx.x) < 2 * width) {
      const int side = static_cast<int>(threadIdx.x) / width;
      const int t = static_cast<int>(threadIdx.x) % width;
      const int other = tile_spans[side][t + width];
      if (other > tile_spans[side][t]) tile_spans[side][t] = other;
    }
    __syncthreads();
  }
  const bool window = tile_spans[0][0] + tile_spans[1][0] <= span_budget;

  tc_stage_loader loader(a, a_exponents, b, b_exponents, m, n, stride, i0, j0);
#pragma unroll
  for (int s = 0; s < tc_stages - 1; ++s) {
    if (s < blocks) loader.load(stages[s]);
    copy_async_commit();
  }

  int current = 0;              // kb % tc_stages
  int refill = tc_stages - 1;   // (kb + tc_stages - 1) % tc_stages
  for (std::int64_t kb = 0; kb < blocks; ++kb) {
    copy_async_wait<tc_stages - 2>();
    __syncthreads();
    // Refill the stage everyone finished with in the previous iteration.
    if (kb + tc_stages - 1 < blocks) loader.load(stages[refill]);
    copy_async_commit();

    const tc_stage& stage = stages[current];
    current = current + 1 == tc_stages ? 0 : current + 1;
    refill = refill + 1 == tc_stages ? 0 : refill + 1;
    std::uint32_t a_fragments[2][4];
    std::uint32_t b_fragments[4][2];
    std::int32_t row_exponents[2][2];
    std::int32_t col_exponents[4][2];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
      const int row = warp_m * 32 + mi * 16 + group_id;
      const std::uint8_t* upper = stage.a + row * tc_row_stride + 4 * thread_in_group;
      const std::uint8_t* lower = upper + 8 * tc_row_stride;
      a_fragments[mi][0] = *reinterpret_cast<const std::uint32_t*>(upper);
      a_fragments[mi][1] = *reinterpret_cast<const std::uint32_t*>(lower);
      a_fragments[mi][2] = *reinterpret_cast<const std::uint32_t*>(upper + 16);
      a_fragments[mi][3] = *reinterpret_cast<const std::uint32_t*>(lower + 16);
      row_exponents[mi][0] = stage.a_exponents[row];
      row_exponents[mi][1] = stage.a_exponents[row + 8];
    }
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      const int col = warp_n * 32 + ni * 8 + group_id;
      const std::uint8_t* source = stage.b + col * tc_row_stride + 4 * thread_in_group;
      b_fragments[ni][0] = *reinterpret_cast<const std::uint32_t*>(source);
      b_fragments[ni][1] = *reinterpret_cast<const std::uint32_t*>(source + 16);
      const int c_col = warp_n * 32 + ni * 8 + 2 * thread_in_group;
      col_exponents[ni][0] = stage.b_exponents[c_col];
      col_exponents[ni][1] = stage.b_exponents[c_col + 1];
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        int d[4];
        mma_s8(d, a_fragments[mi], b_fragments[ni]);
        // d0, d1: row g, columns 2t, 2t+1; d2, d3: row g + 8, the same columns.
        if (window) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int k = row_exponents[mi][e / 2] + col_exponents[ni][e % 2] - fraction_total;
            const double power = core_ns::bits_double(static_cast<std::uint64_t>(k + 1023) << 52);
            const double dot = biased_double(d[e]) - biased_double_offset;
            accumulators[mi][ni][e] = fma_exact(dot, power, accumulators[mi][ni][e]);
          }
          continue;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int k = row_exponents[mi][e / 2] + col_exponents[ni][e % 2] - fraction_total;
          const std::uint64_t bit = std::uint64_t{1} << (mi * 16 + ni * 4 + e);
          if (k < tc_exact_k_low || k > tc_exact_k_high) {  // NaN markers make k huge
            flags |= bit;
            continue;
          }
          const double power = core_ns::bits_double(static_cast<std::uint64_t>(k + 1023) << 52);
          if (add_product_rounds(accumulators[mi][ni][e], biased_double(d[e]) - biased_double_offset, power)) {
            flags |= bit;
          }
        }
      }
    }
  }
  copy_async_wait<0>();

#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const std::int64_t i = i0 + warp_m * 32 + mi * 16 + group_id + (e / 2) * 8;
        const std::int64_t j = j0 + warp_n * 32 + ni * 8 + 2 * thread_in_group + e % 2;
        if (i >= m || j >= n) continue;
        if ((flags >> (mi * 16 + ni * 4 + e)) & 1U) {
          flagged[i * n + j] = 1;
        } else {
          const double sum = accumulators[mi][ni][e] + 0.0;  // an exactly zero sum is +0
          out[i * n + j] = finish_output(static_cast<float>(sum), output);
          if (exact_out != nullptr) exact_out[i * n + j] = sum;
        }
      }
    }
  }
}

// The entries tensor_core_exact_kernel flagged, found by for_each_flagged: the block dots again from
// the same int8 operands, every scaled dot added to a long accumulator, rounded once (NaN blocks
// give the canonical NaN, as the integer path does).
__global__ void tensor_core_exact_fixup_kernel(const std::int8_t* a, const std::int32_t* a_exponents,
                                               const std::int8_t* b, const std::int32_t* b_exponents, std::int64_t m,
                                               std::int64_t n, std::int64_t stride, std::int64_t blocks,
                                               int fraction_total, output_rounding output,
                                               const std::uint8_t* flagged, float* out, double* exact_out) {
  for_each_flagged(flagged, m * n, [&](std::int64_t entry) {
    const std::int64_t i = entry / n;
    const std::int64_t j = entry % n;
    core_ns::long_accumulator total;
    bool nan_entry = false;
    for (std::int64_t block = 0; block < blocks; ++block) {
      const std::int8_t* a_block = a + i * stride + block * 32;
      const std::int8_t* b_block = b + j * stride + block * 32;
      int dot = 0;
      for (int t = 0; t < 32; ++t) dot += static_cast<int>(a_block[t]) * static_cast<int>(b_block[t]);
      const double contribution = scaled_block_dot(static_cast<double>(dot), a_exponents[block * m + i],
                                                   b_exponents[block * n + j], fraction_total);
      if (contribution != contribution) {
        nan_entry = true;
      } else {
        total.add(contribution);
      }
    }
    if (nan_entry) {
      out[entry] = finish_output(canonical_nan_float(), output);
      if (exact_out != nullptr) exact_out[entry] = canonical_nan_double();
    } else {
      out[entry] = finish_output(round_total_to_float(total), output);
      if (exact_out != nullptr) exact_out[entry] = round_total_to_double(total);
    }
  });
}

// -------------------------------------------------------------------------------------------
// fp32-block on the tensor cores, the fast kernel. The mma's accumulator input carries the
// constant C = 0x4B400000 (the bits of 1.5 * 2^23) into every entry, so that each int32 result
// C + D, read as the bits of a float, IS the float 1.5 * 2^23 + D exactly (|D| < 2^22 keeps the
// sum inside the binade [2^23, 2^24), whose ulp is 1): no int-to-float conversion. With the
// row scale r = 2^(ea - fa) and the column scale c = 2^(eb - fb) (prepare_tensor_core_scales_kernel:
// normal floats, -126 <= ea - fa, eb - fb <= 100), two fused multiply-adds per entry and block,
//   x   = fma(1.5 * 2^23 + D, r, -(1.5 * 2^23) r)  = D r                 (exact: D r is a float)
//   acc = fma(x, c, acc)                          = fl32(acc + D 2^k)    (one rounding of the exact sum)
// give the model's step for every k = ea + eb - fa - fb, subnormal and overflowing sums included
// (an fma rounds the exact x c + acc once; the core's add_to_float does the same). A 128-row tile
// whose block holds an exponent outside that range or a NaN block takes the general step
// (tensor_core_step) for the whole thread block in that block; the choice is uniform, per block.
//
// Tiling: 128 x 256 entries of C per thread block of 8 warps (2 x 4), 64 x 64 per warp (4 x 8 mma
// tiles, 128 fp32 accumulators per thread); each stage holds two K-blocks, each 32 bytes of 128
// rows of A and 256 rows of B with their scales and the three tile flags, four stages deep
// (cp.async, one barrier per stage); thread blocks are launched in groups of 8 row tiles. Rows
// are 32 bytes with the two 16-byte halves swapped on rows 4..7 of every 8 (row r, half h at
// 32 r + 16 (h ^ ((r >> 2) & 1))), so that the eight row addresses of each ldmatrix phase fall in
// eight distinct 16-byte bank groups.

constexpr int tcb_tile_m = 128;
constexpr int tcb_tile_n = 256;
constexpr int tcb_stages = 4;
constexpr int tcb_stage_blocks = 2;  // K-blocks per stage (one barrier per stage)
constexpr int tcb_group = 8;         // row tiles per group of the launch order
constexpr int tcb_threads = 256;
constexpr int tcb_magic = 0x4B400000;  // the bits of 1.5 * 2^23
constexpr float tcb_magic_value = 12582912.0f;

struct alignas(16) tcb_block {  // one K-block of a stage
  std::uint8_t a[tcb_tile_m * 32];
  std::uint8_t b[tcb_tile_n * 32];
  std::uint32_t a_scales[tcb_tile_m];  // prepare_tensor_core_scales_kernel's encoding
  std::uint32_t b_scales[tcb_tile_n];
  unsigned slow[4];  // the A tile's flag, the B tile's two (one per 128 rows), unused
};
constexpr std::size_t tcb_stage_bytes = tcb_stage_blocks * sizeof(tcb_block);
constexpr std::size_t tcb_shared_bytes = tcb_stages * tcb_stage_bytes;
static_assert(sizeof(tcb_block) % 16 == 0 && tcb_tile_n == 2 * tc_flag_rows && tcb_tile_m == tc_flag_rows &&
              tcb_tile_n == 2 * (tcb_threads / 2) && tcb_tile_m == tcb_threads / 2);

// The first entry (i0, j0) of thread block `tile` when thread blocks are launched in groups of
// tcb_group row tiles, column tile by column tile within a group: the blocks resident at one time
// share fewer A and B tiles (L2 reuse). Sizes fit an int here (multiply_prepared checks).
struct tile_origin {
  int i0, j0;
};
__device__ inline tile_origin grouped_tile_origin(int tile, int tiles_m, int tiles_n, int tile_m, int tile_n) {
  const int group_tiles = tcb_group * tiles_n;
  const int first_row_tile = tile / group_tiles * tcb_group;
  const int group_rows = min(tiles_m - first_row_tile, tcb_group);
  return {(first_row_tile + tile % group_tiles % group_rows) * tile_m, tile % group_tiles / group_rows * tile_n};
}

__device__ inline int tcb_offset(int row, int half) { return row * 32 + (((half ^ (row >> 2)) & 1) << 4); }

// The exponent e - fraction_bits (or nan_block_exponent) of prepare_tensor_core_scales_kernel's encoding.
__device__ inline std::int32_t tc_scale_exponent(std::uint32_t bits) {
  return (bits >> 31) != 0U ? static_cast<std::int32_t>(bits << 1) >> 1 : static_cast<std::int32_t>(bits >> 23) - 127;
}

#if defined(MXSCOPE_GPU_SIMULATE)
inline int tcb_opaque(int value) { return value; }
inline void load_matrix_x4(std::uint32_t (&r)[4], const void* row_address) {
  simulation::load_matrix_x4(r, row_address);
}
inline void mma_s8_offset(int (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2], int c) {
  const int accumulator[4] = {c, c, c, c};
  simulation::mma_s8(d, a, b, accumulator);
}
#else
// The value, through a register move the compiler cannot see into: per-thread offsets computed
// once stay in a register instead of being recomputed from the thread index in the loop.
__device__ inline int tcb_opaque(int value) {
  int out;
  asm("mov.b32 %0, %1;" : "=r"(out) : "r"(value));
  return out;
}

// ldmatrix .x4 (the per-lane semantics are spelled out in simulation.hpp).
__device__ inline void load_matrix_x4(std::uint32_t (&r)[4], const void* row_address) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(row_address));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// mma.sync m16n8k32 s8 x s8 + C -> s32 with C = c in every entry.
__device__ inline void mma_s8_offset(int (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2], int c) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(c));
}
#endif

// One thread's share of every K-block: one 16-byte chunk of A, two of B, and for 99 of the 256
// threads one more copy (16 bytes of scales or a 4-byte tile flag). Rows past the end of A or B
// copy the last row instead (their entries of C are never stored, and the scales of the padded
// rows are those of a fast tile), so that every source simply advances by a fixed step per K-block;
// the destinations are fixed offsets in a K-block of a stage: A's chunk at data_offset, B's at
// data_offset + b_shift and 4096 bytes (128 rows, the same swizzle) further.
struct tcb_loader {
  static constexpr int b_shift = static_cast<int>(offsetof(tcb_block, b) - offsetof(tcb_block, a));
  const std::int8_t* a_source;
  const std::int8_t* b_source[2];
  const unsigned char* extra_source;
  int data_offset, extra_offset, extra_step, extra_bytes;  // extra_bytes: 0, 4 or 16

  __device__ tcb_loader(const std::int8_t* a, const std::uint32_t* a_scales, const unsigned* a_slow,
                        const std::int8_t* b, const std::uint32_t* b_scales, const unsigned* b_slow, std::int64_t m,
                        std::int64_t n, std::int64_t stride, std::int64_t padded_m, std::int64_t padded_n,
                        std::int64_t i0, std::int64_t j0) {
    const int t = threadIdx.x;
    const int row = t / 2;
    const int half = t % 2;
    a_source = a + std::min(i0 + row, m - 1) * stride + half * 16;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      b_source[q] = b + std::min(j0 + row + q * (tcb_threads / 2), n - 1) * stride + half * 16;
    }
    data_offset = static_cast<int>(offsetof(tcb_block, a)) + tcb_offset(row, half);
    // Scales: the padded rows make every 16-byte chunk exist and aligned.
    constexpr int a_chunks = tcb_tile_m / 4, scale_chunks = (tcb_tile_m + tcb_tile_n) / 4;
    extra_bytes = 0;
    extra_source = nullptr;
    extra_step = 0;
    extra_offset = 0;
    if (t < a_chunks) {
      extra_bytes = 16;
      extra_source = reinterpret_cast<const unsigned char*>(a_scales + i0 + 4 * t);
      extra_step = static_cast<int>(padded_m * sizeof(std::uint32_t));
      extra_offset = static_cast<int>(offsetof(tcb_block, a_scales)) + 16 * t;
    } else if (t < scale_chunks) {
      extra_bytes = 16;
      extra_source = reinterpret_cast<const unsigned char*>(b_scales + j0 + 4 * (t - a_chunks));
      extra_step = static_cast<int>(padded_n * sizeof(std::uint32_t));
      extra_offset = static_cast<int>(offsetof(tcb_block, b_scales)) + 16 * (t - a_chunks);
    } else if (t == scale_chunks) {
      extra_bytes = 4;
      extra_source = reinterpret_cast<const unsigned char*>(a_slow + i0 / tc_flag_rows);
      extra_step = static_cast<int>(padded_m / tc_flag_rows * sizeof(unsigned));
      extra_offset = static_cast<int>(offsetof(tcb_block, slow));
    } else if (t <= scale_chunks + 2) {
      const int q = t - scale_chunks - 1;
      extra_bytes = 4;
      extra_source = reinterpret_cast<const unsigned char*>(b_slow + j0 / tc_flag_rows + q);
      extra_step = static_cast<int>(padded_n / tc_flag_rows * sizeof(unsigned));
      extra_offset = static_cast<int>(offsetof(tcb_block, slow)) + 4 * (1 + q);
    }
  }

  // Copies the next stage's K-blocks (those below `remaining`) into `stage` and advances.
  __device__ void load(unsigned char* stage, int remaining) {
#pragma unroll
    for (int u = 0; u < tcb_stage_blocks; ++u) {
      if (u >= remaining) break;
      unsigned char* const block = stage + u * sizeof(tcb_block);
      copy_async_16(block + data_offset, a_source + 32 * u, true);
      copy_async_16(block + data_offset + b_shift, b_source[0] + 32 * u, true);
      copy_async_16(block + data_offset + b_shift + 4096, b_source[1] + 32 * u, true);
      if (extra_bytes == 16) {
        copy_async_16(block + extra_offset, extra_source + u * extra_step, true);
      } else if (extra_bytes == 4) {
        copy_async_4(block + extra_offset, extra_source + u * extra_step, true);
      }
    }
    a_source += 32 * tcb_stage_blocks;
    b_source[0] += 32 * tcb_stage_blocks;
    b_source[1] += 32 * tcb_stage_blocks;
    extra_source += tcb_stage_blocks * extra_step;
  }
};

// One body (about 150 lines): the copy pipeline, the mma.sync block dots and the per-K-block scale
// step share the stage indices and the accumulators held in registers.
__global__ void __launch_bounds__(tcb_threads, 1)
    tensor_core_block_kernel(const std::int8_t* a, const std::uint32_t* a_scales, const unsigned* a_slow,
                             const std::int8_t* b, const std::uint32_t* b_scales, const unsigned* b_slow,
                             std::int64_t m, std::int64_t n, std::int64_t stride, std::int64_t padded_m,
                             std::int64_t padded_n, std::int64_t blocks, std::int64_t tiles_m, std::int64_t tiles_n,
                             output_rounding output, float* out) {
  MXSCOPE_DYNAMIC_SHARED(uint4, tcb_shared);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group_id = lane / 4;
  const int thread_in_group = lane % 4;
  const int warp_m = warp / 4;  // 0..1: 64 rows each
  const int warp_n = warp % 4;  // 0..3: 64 columns each
  const tile_origin origin =
      grouped_tile_origin(static_cast<int>(blockIdx.x), static_cast<int>(tiles_m), static_cast<int>(tiles_n),
                          tcb_tile_m, tcb_tile_n);
  const int i0 = origin.i0;
  const int j0 = origin.j0;
  const int block_count = static_cast<int>(blocks);
  // ldmatrix row addresses of this lane (matrix lane / 8, its row lane % 8): A matrices 0..3 are
  // (rows 0-7, k 0-15), (rows 8-15, k 0-15), (rows 0-7, k 16-31), (rows 8-15, k 16-31) of an m16
  // tile, i.e. a0..a3; B matrices are (n8 tile 2p, k 0-15), (2p, k 16-31), (2p+1, k 0-15),
  // (2p+1, k 16-31), i.e. b0, b1 of two n8 tiles.
  // Rows 16 apart keep the swizzle, so the tiles mi and p are 512 bytes further on.
  const int matrix = lane / 8;
  const int a_matrix_offset = tcb_opaque(static_cast<int>(offsetof(tcb_block, a)) +
                                         tcb_offset(warp_m * 64 + (matrix % 2) * 8 + lane % 8, matrix / 2));
  const int b_matrix_offset =
      static_cast<int>(offsetof(tcb_block, b)) + tcb_offset(warp_n * 64 + (matrix / 2) * 8 + lane % 8, matrix % 2);
  // This thread's first row of A (+ 16 mi, + 8) and first column pair of B (+ 8 ni) in C.
  const int row_base = warp_m * 64 + group_id;
  const int col_base = warp_n * 64 + 2 * thread_in_group;

  float accumulators[4][8][4];
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int ni = 0; ni < 8; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) accumulators[mi][ni][e] = 0.0f;

  tcb_loader loader(a, a_scales, a_slow, b, b_scales, b_slow, m, n, stride, padded_m, padded_n, i0, j0);
  unsigned char* const shared_bytes = reinterpret_cast<unsigned char*>(tcb_shared);
#pragma unroll
  for (int s = 0; s < tcb_stages - 1; ++s) {
    const int first = s * tcb_stage_blocks;
    if (first < block_count) loader.load(shared_bytes + s * tcb_stage_bytes, block_count - first);
    copy_async_commit();
  }

  int compute_stage = 0;
  int load_stage = tcb_stages - 1;
  for (int kb0 = 0; kb0 < block_count; kb0 += tcb_stage_blocks) {
    copy_async_wait<tcb_stages - 2>();
    __syncthreads();
    // Refill the stage everyone finished with in the previous iteration.
    const int next = kb0 + (tcb_stages - 1) * tcb_stage_blocks;
    if (next < block_count) loader.load(shared_bytes + load_stage * tcb_stage_bytes, block_count - next);
    copy_async_commit();
    load_stage = load_stage == tcb_stages - 1 ? 0 : load_stage + 1;
    const unsigned char* const stage_bytes = shared_bytes + compute_stage * tcb_stage_bytes;
    compute_stage = compute_stage == tcb_stages - 1 ? 0 : compute_stage + 1;

#pragma unroll 1
    for (int u = 0; u < tcb_stage_blocks; ++u) {
      if (kb0 + u >= block_count) break;
      const unsigned char* const block_bytes = stage_bytes + u * sizeof(tcb_block);
      const tcb_block& stage = *reinterpret_cast<const tcb_block*>(block_bytes);
      std::uint32_t b_fragments[8][2];
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        std::uint32_t r[4];
        load_matrix_x4(r, block_bytes + b_matrix_offset + 512 * p);
        b_fragments[2 * p][0] = r[0];
        b_fragments[2 * p][1] = r[1];
        b_fragments[2 * p + 1][0] = r[2];
        b_fragments[2 * p + 1][1] = r[3];
      }
      const bool fast = (stage.slow[0] | stage.slow[1] | stage.slow[2]) == 0U;  // the same in every thread
      if (fast) {
        float col_scales[8][2];
#pragma unroll
        for (int ni = 0; ni < 8; ++ni) {
          const uint2 pair = *reinterpret_cast<const uint2*>(&stage.b_scales[col_base + ni * 8]);
          col_scales[ni][0] = core_ns::bits_float(pair.x);
          col_scales[ni][1] = core_ns::bits_float(pair.y);
        }
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) {
          std::uint32_t a_fragment[4];
          load_matrix_x4(a_fragment, block_bytes + a_matrix_offset + 512 * mi);
          const int row = row_base + mi * 16;
          const float row_scales[2] = {core_ns::bits_float(stage.a_scales[row]),
                                       core_ns::bits_float(stage.a_scales[row + 8])};
          const float offsets[2] = {__fmul_rn(-tcb_magic_value, row_scales[0]),
                                    __fmul_rn(-tcb_magic_value, row_scales[1])};
          // Four independent mma at a time, then their 32 steps.
#pragma unroll
          for (int n4 = 0; n4 < 8; n4 += 4) {
            int d[4][4];
#pragma unroll
            for (int q = 0; q < 4; ++q) mma_s8_offset(d[q], a_fragment, b_fragments[n4 + q], tcb_magic);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const float x = __fmaf_rn(core_ns::bits_float(static_cast<std::uint32_t>(d[q][e])), row_scales[e / 2],
                                          offsets[e / 2]);
                float& accumulator = accumulators[mi][n4 + q][e];
                accumulator = __fmaf_rn(x, col_scales[n4 + q][e % 2], accumulator);
              }
            }
          }
        }
      } else {
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) {
          std::uint32_t a_fragment[4];
          load_matrix_x4(a_fragment, block_bytes + a_matrix_offset + 512 * mi);
#pragma unroll
          for (int ni = 0; ni < 8; ++ni) {
            int d[4];
            mma_s8_offset(d, a_fragment, b_fragments[ni], tcb_magic);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              // k = (ea - fa) + (eb - fb) - 0; NaN markers pass through. Rows past the end meet
              // padded scales (0: a finite, unused step).
              const int row = row_base + mi * 16 + (e / 2) * 8;
              const int col = col_base + ni * 8 + e % 2;
              accumulators[mi][ni][e] =
                  tensor_core_step(accumulators[mi][ni][e], d[e] - tcb_magic, tc_scale_exponent(stage.a_scales[row]),
                                   tc_scale_exponent(stage.b_scales[col]), 0);
            }
          }
        }
      }
    }
  }
  copy_async_wait<0>();

#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
    for (int ni = 0; ni < 8; ++ni) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const std::int64_t i = i0 + warp_m * 64 + mi * 16 + group_id + (e / 2) * 8;
        const std::int64_t j = j0 + warp_n * 64 + ni * 8 + 2 * thread_in_group + e % 2;
        if (i < m && j < n) out[i * n + j] = finish_output(accumulators[mi][ni][e] * 1.0f, output);
      }
    }
  }
}

#endif  // MXSCOPE_CUDA_TENSOR_CORES (gemm_sm90-inl.cuh opens it again)
