// Part of products.cu (included there, in order, inside namespace mxscope::gpu):
// the tensor-core path's exact model on the sm_90a warpgroup MMA.
// -------------------------------------------------------------------------------------------
// exact_wgmma_kernel computes what tensor_core_exact_kernel computes (gemm_tensor_core-inl.cuh):
// the exact sum of the scaled block dots D 2^k of each entry, or a flag for
// tensor_core_exact_fixup_kernel where it leaves one, so its bits are that kernel's. In tiles
// whose rows' and columns' exponent spans fit the budget no partial sum leaves the doubles
// (see tensor_core_exact_kernel), and the entries keep the sum as a 64-bit integer in units of
// 2^L, L = lo_a + lo_b - f (the rows' smallest block exponents): one multiply-add per block,
// sum += D 2^(ea - lo_a) 2^(eb - lo_b), with the two powers from the records, while the spans
// add up to at most tew_shift_limit (the power stays a positive int32; the sum stays below 2^53
// by the budget, so it and its scaling by 2^L are exact doubles at the end). Tiles within the
// budget but beyond that limit keep a running fp64 sum, one FMA per block (no addition can round
// there); the others check every addition (add_product_rounds) and flag an entry where one
// rounded or k is out of range. The block dots come from one
// wgmma.mma_async m64n64k32 s8 per K-block and warpgroup, both operands in shared memory; the next
// K-block's MMA runs while this one's dots are stepped (two register sets, drained at the end of
// every two stages: an MMA in flight across a branch or the loop's back edge would be serialized).
//
// The pipeline is sliced_wgmma_kernel's (gemm_sliced_wgmma-inl.cuh: init_stage_barriers,
// copy_stage_records): 128 x 64 entries per thread block, two computing warpgroups of 64 rows (32
// entries a thread) and a producer warpgroup whose one thread moves each stage's two records with
// bulk copies completing on an mbarrier. A record (prepare_exact_records_kernel) holds, for a tile
// of rows (128 of A, 64 of B) and a stage of four K-blocks, the rows' int8 bytes in the 128-byte
// swizzle, their block exponents and the powers 2^(e - lo) (0 where e - lo > tew_shift_limit);
// K-blocks past the end are zero bytes with exponent 0 and power 0 (their dots are exact zeros,
// which change no sum), so every stage runs its four K-blocks unconditionally. Four stages. The
// same preparation takes each tile's largest row span (for the window tests) by an atomic maximum.

#if defined(MXSCOPE_CUDA_TENSOR_CORES)

constexpr int tew_tile_m = 128;  // rows of A per thread block (64 per warpgroup)
constexpr int tew_tile_n = 64;   // rows of B (columns) per thread block
constexpr int tew_threads = slw_threads;  // run_producer's warpgroups and register split
constexpr int tew_stage_blocks = 4;
constexpr int tew_stages = 4;
constexpr int tew_shift_limit = 30;  // the integer sums' largest shift: 2^30 is a positive int32
constexpr int tew_checked = 0, tew_window = 1, tew_integer = 2;  // the kernel's per-entry steps

// The record of `rows` rows and one stage: bytes [rows][128] (swizzled), exponents [4][rows],
// powers [4][rows].
constexpr std::int64_t tew_record_bytes(int rows) {
  return static_cast<std::int64_t>(rows) * (128 + 2 * tew_stage_blocks * 4);
}

struct alignas(1024) tew_stage {
  std::uint8_t a[tew_tile_m * 128];
  std::int32_t a_exponents[tew_stage_blocks][tew_tile_m];
  std::int32_t a_powers[tew_stage_blocks][tew_tile_m];
  std::uint8_t b[tew_tile_n * 128];
  std::int32_t b_exponents[tew_stage_blocks][tew_tile_n];
  std::int32_t b_powers[tew_stage_blocks][tew_tile_n];
};
using tew_shared = stage_ring<tew_stage, tew_stages>;
constexpr std::size_t tew_shared_bytes = sizeof(tew_shared) + 1024;  // + alignment slack
static_assert(stage_holds_records<tew_stage>(tew_record_bytes(tew_tile_m), tew_record_bytes(tew_tile_n)));

// The operand's records: record (tile, stage) of `tile_rows` rows at (tile stages + stage)
// tew_record_bytes(tile_rows); and tile_spans[tile] = the largest of the tile's rows' spans
// (exponent_spans, whose lows give the powers; tile_spans zeroed by the caller).
__global__ void prepare_exact_records_kernel(const std::int8_t* bytes, const std::int32_t* exponents,
                                             const std::int32_t* spans, const std::int32_t* lows, std::int64_t rows,
                                             std::int64_t padded_rows,
                                             std::int64_t stride, std::int64_t blocks, std::int64_t stages,
                                             int tile_rows, std::uint8_t* records, unsigned* tile_spans) {
  const std::int64_t padded_blocks = stages * tew_stage_blocks;
  MXSCOPE_GRID_LOOP(index, padded_rows * padded_blocks) {
    const std::int64_t r = index / padded_blocks;
    const std::int64_t b = index % padded_blocks;
    const bool inside = r < rows && b < blocks;
    uint4 halves[2] = {};
    if (inside) {
      const auto* source = reinterpret_cast<const uint4*>(bytes + r * stride + 32 * b);
      halves[0] = source[0];
      halves[1] = source[1];
    }
    const int row = static_cast<int>(r % tile_rows);
    const int u = static_cast<int>(b % tew_stage_blocks);
    std::uint8_t* const record =
        records + ((r / tile_rows) * stages + b / tew_stage_blocks) * tew_record_bytes(tile_rows);
    *reinterpret_cast<uint4*>(record + swizzled_offset(row, 2 * u)) = halves[0];
    *reinterpret_cast<uint4*>(record + swizzled_offset(row, 2 * u + 1)) = halves[1];
    const std::int32_t exponent = inside ? exponents[b * rows + r] : 0;
    // A NaN block's marker, or any shift past the limit: power 0 (such a row's span keeps its
    // tile off the integer sums).
    const std::int64_t shift = inside ? static_cast<std::int64_t>(exponent) - lows[r] : -1;
    auto* const record_exponents = reinterpret_cast<std::int32_t*>(record + 128 * tile_rows);
    record_exponents[u * tile_rows + row] = exponent;
    record_exponents[(tew_stage_blocks + u) * tile_rows + row] =
        shift >= 0 && shift <= tew_shift_limit ? std::int32_t{1} << shift : 0;
    if (b == 0 && r < rows) atomicMax(&tile_spans[r / tile_rows], static_cast<unsigned>(spans[r]));
  }
}

#if defined(MXSCOPE_GPU_SIMULATE)
inline void tew_registers_written(int (&)[32]) {}
#define MXSCOPE_EXACT_WGMMA 1
#elif defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ inline void tew_registers_written(int (&d)[32]) {  // as slw_registers_written
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+r"(d[i])::"memory");
}
#define MXSCOPE_EXACT_WGMMA 1
#endif

#if defined(MXSCOPE_EXACT_WGMMA)
// sum + x y with the product taken in 64 bits (one mad.wide.s32).
__device__ inline std::int64_t multiply_add_wide(int x, int y, std::int64_t sum) {
#if defined(MXSCOPE_GPU_SIMULATE)
  return sum + static_cast<std::int64_t>(x) * y;
#else
  std::int64_t result = 0;
  asm("mad.wide.s32 %0, %1, %2, %3;" : "=l"(result) : "r"(x), "r"(y), "l"(sum));
  return result;
#endif
}
#endif

// One body (about 150 lines): the producer's copies, the barriers' phases, the MMA in flight and
// the per-entry steps share the stage indices and the registers of the dots and running sums.
__global__ void __launch_bounds__(tew_threads, 1)
    exact_wgmma_kernel(const std::uint8_t* a_records, const std::uint8_t* b_records, const unsigned* a_tile_spans,
                       const unsigned* b_tile_spans, const std::int32_t* a_lows, const std::int32_t* b_lows,
                       std::int64_t m, std::int64_t n, std::int64_t stages,
                       std::int64_t tiles_m, std::int64_t tiles_n, int fraction_total, int span_budget,
                       output_rounding output, float* out, double* exact_out, std::uint8_t* flagged) {
#if defined(MXSCOPE_EXACT_WGMMA)
  MXSCOPE_DYNAMIC_SHARED(unsigned char, tew_raw);
  tew_shared& shared = aligned_stage_memory<tew_shared>(tew_raw);
  const int t = threadIdx.x;
  const tile_origin origin = grouped_tile_origin(static_cast<int>(blockIdx.x), static_cast<int>(tiles_m),
                                                 static_cast<int>(tiles_n), tew_tile_m, tew_tile_n);
  const int stage_count = static_cast<int>(stages);
  if (run_producer(shared, a_records, b_records, origin.i0 / tew_tile_m, origin.j0 / tew_tile_n, stages)) return;

  const int group = t / 128;
  const int warp = (t / 32) % 4;
  const int lane = t % 32;
  // Register i = 4 j + 2 r + e of a dot set holds the entry of row row0 + 8 r, column col0 + 8 j + e.
  const int row0 = group * 64 + warp * 16 + lane / 4;
  const int col0 = 2 * (lane % 4);
  const std::int64_t tile_span = static_cast<std::int64_t>(a_tile_spans[origin.i0 / tew_tile_m]) +
                                 static_cast<std::int64_t>(b_tile_spans[origin.j0 / tew_tile_n]);
  const bool window = tile_span <= span_budget;
  const bool integer_sums = window && tile_span <= tew_shift_limit;
  // Descriptors of stage 0 (this warpgroup's 64 rows of A; B's 64 rows); stage p and K-block u
  // lie p sizeof(tew_stage) and 32 u bytes further.
  const std::uint64_t a_descriptor = tcw_descriptor(shared.stages[0].a + group * 64 * 128);
  const std::uint64_t b_descriptor = tcw_descriptor(shared.stages[0].b);

  double accumulators[32];
  std::int64_t sums[32];  // the integer sums' tiles
  unsigned flags = 0;     // bit i for a flagged entry

  // The steps of K-block u of the stage from its dots: integer sums (mode tew_integer), a window
  // tile's fp64 sums (tew_window) or checked ones.
  const auto step = [&](const tew_stage& stage, int u, const int (&d)[32], auto mode_tag) {
    constexpr int mode = decltype(mode_tag)::value;
    if constexpr (mode == tew_integer) {
      const int rows[2] = {stage.a_powers[u][row0], stage.a_powers[u][row0 + 8]};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int columns[2] = {stage.b_powers[u][col0 + 8 * j], stage.b_powers[u][col0 + 8 * j + 1]};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int i = 4 * j + k;  // k = 2 r + e
          sums[i] = multiply_add_wide(d[i], rows[k / 2] * columns[k % 2], sums[i]);
        }
      }
      return;
    }
    const int rows[2] = {stage.a_exponents[u][row0] - fraction_total, stage.a_exponents[u][row0 + 8] - fraction_total};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int columns[2] = {stage.b_exponents[u][col0 + 8 * j], stage.b_exponents[u][col0 + 8 * j + 1]};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int i = 4 * j + k;  // k = 2 r + e
        const int exponent = rows[k / 2] + columns[k % 2];
        const double dot = biased_double(d[i]) - biased_double_offset;
        if constexpr (mode == tew_window) {
          const double power = core_ns::bits_double(static_cast<std::uint64_t>(exponent + 1023) << 52);
          accumulators[i] = fma_exact(dot, power, accumulators[i]);
        } else {
          // NaN markers make the exponent huge: flagged, the sum left as it is (the fix-up
          // recomputes the entry).
          const bool outside = exponent < tc_exact_k_low || exponent > tc_exact_k_high;
          const double power = core_ns::bits_double(static_cast<std::uint64_t>((outside ? 0 : exponent) + 1023) << 52);
          double sum = accumulators[i];
          const bool rounded = add_product_rounds(sum, dot, power);
          accumulators[i] = outside ? accumulators[i] : sum;
          flags |= (outside || rounded ? 1U : 0U) << i;
        }
      }
    }
  };
  // Stage s's K-block u: its MMA into d.
  const auto issue = [&](int (&d)[32], int s, int u) {
    const std::uint64_t units =
        static_cast<std::uint64_t>(s % tew_stages) * (sizeof(tew_stage) / 16) + static_cast<std::uint64_t>(2 * u);
    wgmma_fence();
    wgmma_s8_m64n64k32(d, a_descriptor + units, b_descriptor + units);
    wgmma_commit();
  };
  // Stages s .. s + Count - 1, all full first, as one run of K-blocks: the next K-block's MMA in
  // flight while this one's dots are stepped, across the stages of the run too (an MMA in flight
  // across the loop's back edge would be serialized, so each run starts with one MMA waited for
  // with nothing to step: once per two stages rather than once per stage).
  int dots[2][32];
  const auto run_stages = [&](int s, auto count_tag, auto mode_tag) {
    constexpr int count = decltype(count_tag)::value;
    constexpr int blocks = count * tew_stage_blocks;
#pragma unroll
    for (int c = 0; c < count; ++c) {
      barrier_wait(&shared.full[(s + c) % tew_stages], static_cast<unsigned>((s + c) / tew_stages) & 1U);
    }
    issue(dots[0], s, 0);
#pragma unroll
    for (int v = 0; v < blocks; ++v) {
      if (v + 1 < blocks) {
        issue(dots[(v + 1) % 2], s + (v + 1) / tew_stage_blocks, (v + 1) % tew_stage_blocks);
        wgmma_wait<1>();
      } else {
        wgmma_wait<0>();
      }
      tew_registers_written(dots[v % 2]);
      const int slot = (s + v / tew_stage_blocks) % tew_stages;
      step(shared.stages[slot], v % tew_stage_blocks, dots[v % 2], mode_tag);
      // This thread's MMAs and reads of the stage are done (the one in flight reads the next).
      if (v % tew_stage_blocks == tew_stage_blocks - 1) barrier_arrive(&shared.empty[slot]);
    }
  };
  const auto run = [&](auto mode_tag) {
    int s = 0;
    for (; s + 1 < stage_count; s += 2) run_stages(s, std::integral_constant<int, 2>{}, mode_tag);
    if (s < stage_count) run_stages(s, std::integral_constant<int, 1>{}, mode_tag);
  };
  const auto entry_row = [&](int i) { return origin.i0 + row0 + 8 * ((i / 2) % 2); };
  const auto entry_col = [&](int i) { return origin.j0 + col0 + 8 * (i / 4) + i % 2; };
  if (integer_sums) {
#pragma unroll
    for (int i = 0; i < 32; ++i) sums[i] = 0;
    run(std::integral_constant<int, tew_integer>{});
    // sum 2^L, exact: |sum| < 2^53 by the budget, and L within the normal exponents.
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const std::int64_t row = entry_row(i);
      const std::int64_t col = entry_col(i);
      if (row >= m || col >= n) continue;
      const int low = a_lows[row] + b_lows[col] - fraction_total;
      accumulators[i] = static_cast<double>(sums[i]) * core_ns::bits_double(static_cast<std::uint64_t>(low + 1023) << 52);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 32; ++i) accumulators[i] = 0;
    if (window) {
      run(std::integral_constant<int, tew_window>{});
    } else {
      run(std::integral_constant<int, tew_checked>{});
    }
  }

#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const std::int64_t row = entry_row(i);
    const std::int64_t col = entry_col(i);
    if (row >= m || col >= n) continue;
    store_exact_entry((flags >> i & 1U) != 0, accumulators[i], row * n + col, output, out, exact_out, flagged);
  }
#else
  // Built without sm_90a: the host never launches this (exact_product_kernel_available).
  (void)a_records, (void)b_records, (void)a_tile_spans, (void)b_tile_spans, (void)a_lows, (void)b_lows, (void)m, (void)n;
  (void)stages;
  (void)tiles_m, (void)tiles_n, (void)fraction_total, (void)span_budget, (void)output, (void)out, (void)exact_out;
  (void)flagged;
#endif
}

#undef MXSCOPE_EXACT_WGMMA
#endif  // MXSCOPE_CUDA_TENSOR_CORES

}  // namespace (opened in gemm_generic-inl.cuh)
