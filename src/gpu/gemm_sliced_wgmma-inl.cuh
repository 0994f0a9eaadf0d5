// Part of products.cu (included there, in order, inside namespace mxscope::gpu):
// the sliced block dots of gemm_sliced-inl.cuh on the sm_90a warpgroup MMA.
// -------------------------------------------------------------------------------------------
// sliced_wgmma_kernel computes what sliced_block_kernel computes, with the same slices (slice_row_block)
// and the same per-entry steps (sliced_dot, then round_to_odd_step_by_sign or add_product_rounds),
// so its bits are that kernel's; only where the block dots' levels come from differs. Each level
// S_l = sum_{i + j = l} Pa_i . Pb_j of a K-block is one to three wgmma.mma_async m64n32k32 s8 x s8
// -> s32 into one set of 16 registers (the first of a level with scale-d 0, the others adding to
// it), both operands read from shared memory through matrix descriptors: nine per K-block and
// 32 columns, five register sets. Levels 0 and 1 are committed first, so that lo = S0 + 2^7 S1 is
// formed while the other six run.
//
// A thread block computes 128 x 64 entries: two warpgroups of 64 rows, each stepping its 64
// columns in two halves of 32 (32 entries per thread), and a producer warpgroup. A warpgroup waits for
// its own MMA before its steps; the tensor core serves the other's meanwhile. The operands come
// in records (prepare_sliced_tiles_kernel): per tile of rows and stage of four K-blocks, the three
// slices as rows of 128 bytes in the 128-byte swizzle of tensor_core_wgmma_kernel (16-byte chunk c
// of row r at 128 r + 16 (c ^ (r mod 8)), K-block u in chunks 2u and 2u + 1), then the rows'
// scales. One thread of the producer copies a stage's two records (A's 128 rows, B's 64) with
// two bulk copies that complete on the stage's `full` barrier (the asynchronous proxy writes what
// the MMA reads; no proxy fence); the warpgroups arrive on its `empty` barrier when done with it.
// Two stages; one thread block per multiprocessor; tiles in tcb's grouped order. The host launches
// it on an sm_90 device from an sm_90a build (wgmma_present), and in the CPU simulation, which
// emulates the MMA from its descriptors and the barriers as atomic words.

#if defined(MXSCOPE_CUDA_TENSOR_CORES)

constexpr int slw_tile_m = 128;  // rows of A per thread block (64 per warpgroup)
constexpr int slw_tile_n = 64;   // rows of B (columns) per thread block, in two halves of 32
constexpr int slw_threads = 384;  // the producer warpgroup and two that compute
constexpr int slw_stage_blocks = 4;  // K-blocks per stage: rows of 128 bytes
constexpr int slw_stages = 2;

// The record of `rows` rows and one stage: slices [3][rows][128 bytes], scales [4][rows] (double).
constexpr std::int64_t slw_record_bytes(int rows) {
  return static_cast<std::int64_t>(rows) * (slc_slices * 128 + slw_stage_blocks * 8);
}

struct alignas(1024) slw_stage {
  std::uint8_t a[slc_slices][slw_tile_m * 128];
  double a_scales[slw_stage_blocks][slw_tile_m];
  std::uint8_t b[slc_slices][slw_tile_n * 128];
  double b_scales[slw_stage_blocks][slw_tile_n];
};
// The shared memory of the warpgroup kernels (this one and exact_wgmma_kernel): a ring of stages
// and their barriers.
template <class Stage, int Slots>
struct stage_ring {
  Stage stages[Slots];
  std::uint64_t full[Slots];
  std::uint64_t empty[Slots];
};
// Whether a stage is its A record then its B record as they lie in memory (one bulk copy each),
// with the tiles of B's 128-byte rows on 1024-byte boundaries.
template <class Stage>
constexpr bool stage_holds_records(std::int64_t a_record, std::int64_t b_record) {
  return offsetof(Stage, b) == a_record && sizeof(Stage) == a_record + b_record && offsetof(Stage, b) % 1024 == 0 &&
         sizeof(Stage) % 1024 == 0;
}
using slw_shared = stage_ring<slw_stage, slw_stages>;
constexpr std::size_t slw_shared_bytes = sizeof(slw_shared) + 1024;  // + alignment slack
static_assert(stage_holds_records<slw_stage>(slw_record_bytes(slw_tile_m), slw_record_bytes(slw_tile_n)));
// The prepared operands' padding (slc_row_pad rows of A, slc_col_pad of B) covers these tiles.
static_assert(slc_row_pad % slw_tile_m == 0 && slc_col_pad % slw_tile_n == 0);

// The operand's records: record (tile, stage) of `tile_rows` rows at (tile stages + stage)
// slw_record_bytes(tile_rows); K-blocks past the end have zero slices and scale 1.
__global__ void prepare_sliced_tiles_kernel(const std::int32_t* integers, const std::int32_t* exponents,
                                            std::int64_t rows, std::int64_t padded_rows, std::int64_t depth,
                                            std::int64_t blocks, std::int64_t stages, int tile_rows, int shift,
                                            std::uint8_t* records, unsigned* unfit) {
  const std::int64_t padded_blocks = stages * slw_stage_blocks;
  MXSCOPE_GRID_LOOP(index, padded_rows * padded_blocks) {
    const std::int64_t r = index / padded_blocks;
    const std::int64_t b = index % padded_blocks;
    std::uint32_t words[slc_slices][8] = {};
    const double scale = b < blocks ? slice_row_block(integers, exponents, rows, depth, shift, r, b, unfit, words) : 1.0;
    const int row = static_cast<int>(r % tile_rows);
    const int u = static_cast<int>(b % slw_stage_blocks);
    std::uint8_t* const record =
        records + ((r / tile_rows) * stages + b / slw_stage_blocks) * slw_record_bytes(tile_rows);
#pragma unroll
    for (int s = 0; s < slc_slices; ++s) {
      const auto& w = words[s];
      std::uint8_t* const slice = record + static_cast<std::int64_t>(s) * tile_rows * 128;
      *reinterpret_cast<uint4*>(slice + swizzled_offset(row, 2 * u)) = make_uint4(w[0], w[1], w[2], w[3]);
      *reinterpret_cast<uint4*>(slice + swizzled_offset(row, 2 * u + 1)) = make_uint4(w[4], w[5], w[6], w[7]);
    }
    reinterpret_cast<double*>(record + slc_slices * tile_rows * 128)[u * tile_rows + row] = scale;
  }
}

// The register file split between the warpgroups: 56 a thread for the producer, 224 for the two
// that compute: all that 384 threads of 168 hold (register_split_fits).
constexpr int slw_producer_register_count = 56;
constexpr int slw_consumer_register_count = 224;
static_assert(register_split_fits(slw_threads, slw_producer_register_count, slw_consumer_register_count));

// The warpgroup MMA's fence, commit and wait, the async-proxy fence and the m64n64k32 MMA are
// gemm_sm90-inl.cuh's (the simulation's forms there too).
#if defined(MXSCOPE_GPU_SIMULATE)
inline void slw_barriers_initialized() {}
inline void slw_producer_registers() {}
inline void slw_consumer_registers() {}
using simulation::barrier_arrive;
using simulation::barrier_expect_bytes;
using simulation::barrier_init;
using simulation::barrier_wait;
using simulation::bulk_copy;
template <bool Accumulate>
inline void wgmma_s8_m64n32k32(int (&d)[16], std::uint64_t a_descriptor, std::uint64_t b_descriptor) {
  simulation::wgmma_s8(d, 32, a_descriptor, b_descriptor, Accumulate);
}
inline void slw_registers_written(int (&)[16]) {}
#define MXSCOPE_SLICED_WGMMA 1
#elif defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ inline void slw_barriers_initialized() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ inline void slw_producer_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(slw_producer_register_count) : "memory");
}
__device__ inline void slw_consumer_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(slw_consumer_register_count) : "memory");
}
// d (+)= A B^T for the 64 x 32 A and 32 x 32 B tiles of the descriptors (s8, s32); Accumulate false:
// scale-d 0, and d is only written.
template <bool Accumulate>
__device__ inline void wgmma_s8_m64n32k32(int (&d)[16], std::uint64_t a_descriptor, std::uint64_t b_descriptor) {
  if constexpr (Accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
          "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15])
        : "l"(a_descriptor), "l"(b_descriptor));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p;\n}\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]), "=r"(d[4]), "=r"(d[5]), "=r"(d[6]), "=r"(d[7]),
          "=r"(d[8]), "=r"(d[9]), "=r"(d[10]), "=r"(d[11]), "=r"(d[12]), "=r"(d[13]), "=r"(d[14]), "=r"(d[15])
        : "l"(a_descriptor), "l"(b_descriptor));
  }
}
// After a wait: the registers of an MMA that has now completed count as written here, so that
// the compiler does not move their reads above the wait (it does not know the wait writes them).
__device__ inline void slw_registers_written(int (&d)[16]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) asm volatile("" : "+r"(d[i])::"memory");
}
#define MXSCOPE_SLICED_WGMMA 1
#endif

#if defined(MXSCOPE_SLICED_WGMMA)
// The pipeline shared with exact_wgmma_kernel. The stages' barriers: `full` completes when the
// producer's copies of a stage have landed, `empty` when the 256 computing threads are done with it.
template <int Slots>
__device__ inline void init_stage_barriers(std::uint64_t (&full)[Slots], std::uint64_t (&empty)[Slots]) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < Slots; ++s) {
      barrier_init(&full[s], 1);
      barrier_init(&empty[s], 256);
    }
    slw_barriers_initialized();
  }
  __syncthreads();
}

// The producer's copies (one thread): stage s into slot s % Slots once the computing warpgroups
// have released the slot's previous stage, its A and B records by two bulk copies that complete on
// the slot's `full` barrier. A stage is the two records as they lie in memory (A's at 0, B's at
// a_bytes: stage_holds_records).
template <int Slots, class Stage>
__device__ inline void copy_stage_records(Stage (&stages)[Slots], std::uint64_t (&full)[Slots],
                                          std::uint64_t (&empty)[Slots], const std::uint8_t* a_source,
                                          const std::uint8_t* b_source, std::int64_t a_bytes, std::int64_t b_bytes,
                                          int stage_count) {
  for (int s = 0; s < stage_count; ++s) {
    const int slot = s % Slots;
    if (s >= Slots) barrier_wait(&empty[slot], static_cast<unsigned>(s / Slots - 1) & 1U);
    auto* const stage = reinterpret_cast<unsigned char*>(&stages[slot]);
    barrier_expect_bytes(&full[slot], static_cast<unsigned>(a_bytes + b_bytes));
    bulk_copy(stage, a_source + s * a_bytes, static_cast<unsigned>(a_bytes), &full[slot]);
    bulk_copy(stage + a_bytes, b_source + s * b_bytes, static_cast<unsigned>(b_bytes), &full[slot]);
  }
}

// The kernels' shared memory (a struct of stages and barriers) at its first 1024-byte boundary:
// the swizzle is of shared-memory addresses. The result is formed as an offset into `raw`, so the
// compiler still knows it addresses shared memory.
template <class Shared>
__device__ inline Shared& aligned_stage_memory(unsigned char* raw) {
  const auto raw_address = static_cast<unsigned>(__cvta_generic_to_shared(raw));
  return *reinterpret_cast<Shared*>(raw + ((1024U - (raw_address & 1023U)) & 1023U));
}

// The start of both kernels: the barriers set up, then the producer warpgroup (threads 256..383)
// takes 56 registers and its first thread copies the records of row tile `tile_a` of A and
// `tile_b` of B, `stages` each (true: the caller returns), while the computing warpgroups take
// 224 (false). A stage's A record is its bytes up to `b`, B's the rest.
template <class Shared>
__device__ inline bool run_producer(Shared& shared, const std::uint8_t* a_records, const std::uint8_t* b_records,
                                   std::int64_t tile_a, std::int64_t tile_b, std::int64_t stages) {
  using stage_type = std::remove_reference_t<decltype(shared.stages[0])>;
  constexpr std::int64_t a_bytes = offsetof(stage_type, b);
  constexpr std::int64_t b_bytes = sizeof(stage_type) - a_bytes;
  init_stage_barriers(shared.full, shared.empty);
  if (threadIdx.x < 256) {
    slw_consumer_registers();
    return false;
  }
  slw_producer_registers();
  if (threadIdx.x == 256) {
    copy_stage_records(shared.stages, shared.full, shared.empty, a_records + tile_a * stages * a_bytes,
                       b_records + tile_b * stages * b_bytes, a_bytes, b_bytes, static_cast<int>(stages));
  }
  return true;
}

// An exact-model entry's result: flagged for the fix-up kernel, or its exact sum (an exactly zero
// sum written +0) as the fp64 result and rounded once to the output.
__device__ inline void store_exact_entry(bool flag, double sum, std::int64_t at, output_rounding output, float* out,
                                         double* exact_out, std::uint8_t* flagged) {
  if (flag) {
    flagged[at] = 1;
  } else {
    const double value = sum + 0.0;
    out[at] = finish_output(static_cast<float>(value), output);
    if (exact_out != nullptr) exact_out[at] = value;
  }
}
#endif

// One body (about 120 lines): the producer's copies, the barriers' phases, the nine MMA of each
// K-block and half and the per-entry steps share the stage indices and the registers of the levels
// and accumulators.
// Exact: the `exact` model, as sliced_block_kernel<true>: entries whose running sum rounded are
// marked in `flagged` for integer_fixup_kernel.
template <bool Exact>
__global__ void __launch_bounds__(slw_threads, 1)
    sliced_wgmma_kernel(const std::uint8_t* a_records, const std::uint8_t* b_records, std::int64_t m, std::int64_t n,
                        std::int64_t blocks, std::int64_t stages, std::int64_t tiles_m, std::int64_t tiles_n,
                        output_rounding output, float* out, double* exact_out, std::uint8_t* flagged) {
#if defined(MXSCOPE_SLICED_WGMMA)
  MXSCOPE_DYNAMIC_SHARED(unsigned char, slw_raw);
  slw_shared& shared = aligned_stage_memory<slw_shared>(slw_raw);
  const int t = threadIdx.x;
  const tile_origin origin = grouped_tile_origin(static_cast<int>(blockIdx.x), static_cast<int>(tiles_m),
                                                 static_cast<int>(tiles_n), slw_tile_m, slw_tile_n);
  const int block_count = static_cast<int>(blocks);
  const int stage_count = static_cast<int>(stages);
  if (run_producer(shared, a_records, b_records, origin.i0 / slw_tile_m, origin.j0 / slw_tile_n, stages)) return;

  const int group = t / 128;  // rows 64 group .. of the tile
  const int warp = (t / 32) % 4;
  const int lane = t % 32;
  // Register i = 4 j + 2 r + e of a level (half h) holds the entry of row row0 + 8 r, column
  // col0 + 32 h + 8 j + e.
  const int row0 = group * 64 + warp * 16 + lane / 4;
  const int col0 = 2 * (lane % 4);
  // Descriptors of stage 0's slice 0 (this warpgroup's 64 rows of A; B's first 32 rows); slice
  // s, half h, stage p and K-block u lie s 16384 (A) or 8192 (B), 4096 h, p sizeof(slw_stage)
  // and 32 u bytes further.
  const std::uint64_t a_descriptor = tcw_descriptor(shared.stages[0].a[0] + group * 64 * 128);
  const std::uint64_t b_descriptor = tcw_descriptor(shared.stages[0].b[0]);

  using accumulator_type = std::conditional_t<Exact, double, float>;
  accumulator_type accumulators[2][16];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 16; ++i) accumulators[h][i] = 0;
  [[maybe_unused]] unsigned rounded = 0;  // Exact: bit 16 h + i for accumulator [h][i]

  for (int s = 0; s < stage_count; ++s) {
    const int slot = s % slw_stages;
    barrier_wait(&shared.full[slot], static_cast<unsigned>(s / slw_stages) & 1U);
    const slw_stage& stage = shared.stages[slot];
    const std::uint64_t stage_units = static_cast<std::uint64_t>(slot) * (sizeof(slw_stage) / 16);
#pragma unroll 1
    for (int u = 0; u < slw_stage_blocks && slw_stage_blocks * s + u < block_count; ++u) {
      const double row_scales[2] = {stage.a_scales[u][row0], stage.a_scales[u][row0 + 8]};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const auto at_a = [&](int slice) { return a_descriptor + stage_units + slice * 1024 + 2 * u; };
        const auto at_b = [&](int slice) { return b_descriptor + stage_units + slice * 512 + h * 256 + 2 * u; };
        int level[5][16];
        wgmma_fence();
        wgmma_s8_m64n32k32<false>(level[0], at_a(0), at_b(0));
        wgmma_s8_m64n32k32<false>(level[1], at_a(0), at_b(1));
        wgmma_s8_m64n32k32<true>(level[1], at_a(1), at_b(0));
        wgmma_commit();
        wgmma_s8_m64n32k32<false>(level[2], at_a(0), at_b(2));
        wgmma_s8_m64n32k32<true>(level[2], at_a(1), at_b(1));
        wgmma_s8_m64n32k32<true>(level[2], at_a(2), at_b(0));
        wgmma_s8_m64n32k32<false>(level[3], at_a(1), at_b(2));
        wgmma_s8_m64n32k32<true>(level[3], at_a(2), at_b(1));
        wgmma_s8_m64n32k32<false>(level[4], at_a(2), at_b(2));
        wgmma_commit();
        wgmma_wait<1>();  // levels 0 and 1
        slw_registers_written(level[0]);
        slw_registers_written(level[1]);
        int low[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) low[i] = level[0][i] + 128 * level[1][i];
        wgmma_wait<0>();
        slw_registers_written(level[2]);
        slw_registers_written(level[3]);
        slw_registers_written(level[4]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const double* const columns = &stage.b_scales[u][col0 + 32 * h + 8 * j];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const int i = 4 * j + k;  // k = 2 r + e
            const double dot = sliced_dot(low[i], level[2][i] + 128 * level[3][i] + 16384 * level[4][i]);
            const double scale = row_scales[k / 2] * columns[k % 2];
            if constexpr (Exact) {
              if (add_product_rounds(accumulators[h][i], dot, scale)) rounded |= 1U << (16 * h + i);
            } else {
              accumulators[h][i] = round_to_odd_step_by_sign(accumulators[h][i], dot, scale);
            }
          }
        }
      }
    }
    barrier_arrive(&shared.empty[slot]);  // this thread's MMA and reads of the stage are done
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const std::int64_t row = origin.i0 + row0 + 8 * ((i / 2) % 2);
      const std::int64_t col = origin.j0 + col0 + 32 * h + 8 * (i / 4) + i % 2;
      if (row >= m || col >= n) continue;
      if constexpr (Exact) {
        store_exact_entry((rounded >> (16 * h + i) & 1U) != 0, accumulators[h][i], row * n + col, output, out,
                          exact_out, flagged);
      } else {
        out[row * n + col] = finish_output(accumulators[h][i] * 1.0f, output);
      }
    }
  }
#else
  // Built without sm_90a: the host never launches this (integer_block_kernel_available).
  (void)a_records, (void)b_records, (void)m, (void)n, (void)blocks, (void)stages, (void)tiles_m, (void)tiles_n;
  (void)output, (void)out, (void)exact_out, (void)flagged;
#endif
}

#undef MXSCOPE_SLICED_WGMMA
#endif  // MXSCOPE_CUDA_TENSOR_CORES
