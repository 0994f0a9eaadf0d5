// Part of products.cu (included there, in order, inside namespace mxscope::gpu):
// the sm_90a warpgroup-MMA fp32-block kernels.
#if defined(MXSCOPE_CUDA_TENSOR_CORES)  // as at the end of gemm_tensor_core-inl.cuh

// -------------------------------------------------------------------------------------------
// The sm_90a fp32-block kernel (tensor_core_wgmma_kernel): the block dots from the asynchronous
// warpgroup MMA (wgmma.mma_async m64n64k32 s8 x s8 -> s32, both operands read from shared memory
// through matrix descriptors) and the same two fmas per step as tensor_core_block_kernel. The mma
// starts from zero (scale-d 0); one integer addition per entry adds tcb_magic, so that the bits
// read as the fp32 number 1.5 * 2^23 + D.
//
// A thread block of two warpgroups computes 128 x 128 entries, each warpgroup 64 rows: 64 fp32
// accumulators per thread and two sets of 32 s32 dot registers, one per half of the 128 columns.
// Within a K-block, the mma of the second half runs while the first half is stepped. No mma stays
// in flight from one K-block to the next: ptxas serializes every mma of a loop whose flight
// crosses the back edge while registers of other mma are read (C7514), which costs more than the
// overlap gains. Stages hold four K-blocks, i.e. rows of 128 bytes in the 128-byte swizzle of the
// descriptors (16-byte chunk c of row r at 128 r + 16 (c ^ (r mod 8)), 1024-byte aligned); they are
// filled by cp.async, which writes through the generic proxy, so every thread fences the async
// proxy (fence.proxy.async) before the barrier that hands a stage to the mma.

// Whether a setmaxnreg split of a thread block of `threads` (one producer warpgroup at `producer`
// registers a thread, the rest at `consumer`) fits the registers the block is launched with:
// setmaxnreg.inc takes only registers that the block's own setmaxnreg.dec released and blocks
// until it has them, so a split over that total never proceeds. With a launch bound of
// `threads` and one block per multiprocessor a thread starts with its share of the 65536
// registers in steps of 8, the count a kernel that uses setmaxnreg is compiled to.
constexpr bool register_split_fits(int threads, int producer, int consumer) {
  return 128 * producer + (threads - 128) * consumer <= threads * (65536 / threads / 8 * 8);
}

constexpr int tcw_tile = 128;
constexpr int tcw_threads = 256;
constexpr int tcw_stage_blocks = 4;  // 4 x 32 bytes: a 128-byte row
constexpr int tcw_stages = 4;

struct alignas(1024) tcw_stage {
  std::uint8_t a[tcw_tile * 128];
  std::uint8_t b[tcw_tile * 128];
  std::uint32_t a_scales[tcw_stage_blocks][tcw_tile];
  std::uint32_t b_scales[tcw_stage_blocks][tcw_tile];
  unsigned slow[tcw_stage_blocks][4];  // per K-block: the A tile's flag, the B tile's, unused
};
constexpr std::size_t tcw_shared_bytes = tcw_stages * sizeof(tcw_stage) + 1024;  // + alignment slack
static_assert(tcw_tile == tc_flag_rows && tc_scale_row_pad % tcw_tile == 0);

#if !defined(MXSCOPE_GPU_SIMULATE)
__global__ void wgmma_probe_kernel(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *out = 1;
#else
  *out = 0;
#endif
}
#endif

#if defined(MXSCOPE_GPU_SIMULATE)
// The CPU simulation's forms of the primitives below: the MMA emulated from its descriptors
// (simulation::wgmma_s8), synchronously, so the fences and waits have nothing to order. It runs
// tensor_core_wgmma_kernel (which the GPU test also runs on the device, tying the emulated layout
// to the hardware's) as well as the newer kernels.
inline std::uint64_t tcw_descriptor(const void* shared) {
  const auto address = static_cast<std::uint64_t>(__cvta_generic_to_shared(shared));
  return ((address & 0x3FFFFULL) >> 4) | (1ULL << 16) | ((1024ULL >> 4) << 32) | (1ULL << 62);
}
inline void wgmma_fence() {}
inline void wgmma_commit() {}
template <int Pending>
inline void wgmma_wait() {}
inline void proxy_fence_shared() {}
inline void wgmma_s8_m64n64k32(int (&d)[32], std::uint64_t a_descriptor, std::uint64_t b_descriptor) {
  simulation::wgmma_s8(d, 64, a_descriptor, b_descriptor, false);
}
#define MXSCOPE_TCW_BODY 1
#elif defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MXSCOPE_TCW_BODY 1

// The shared-memory matrix descriptor of a K-major operand in the 128-byte swizzle: start address,
// leading byte offset unused (1), stride byte offset 1024 (8 rows of 128 bytes), swizzle mode 1.
__device__ inline std::uint64_t tcw_descriptor(const void* shared) {
  const auto address = static_cast<std::uint64_t>(__cvta_generic_to_shared(shared));
  return ((address & 0x3FFFFULL) >> 4) | (1ULL << 16) | ((1024ULL >> 4) << 32) | (1ULL << 62);
}

__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ inline void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int Pending>
__device__ inline void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
}
__device__ inline void proxy_fence_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// d = A B^T for the 64 x 32 A and 64 x 32 B tiles of the descriptors (s8, s32; scale-d 0).
__device__ inline void wgmma_s8_m64n64k32(int (&d)[32], std::uint64_t a_descriptor, std::uint64_t b_descriptor) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p;\n}\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]), "=r"(d[4]), "=r"(d[5]), "=r"(d[6]), "=r"(d[7]), "=r"(d[8]), "=r"(d[9]), "=r"(d[10]), "=r"(d[11]), "=r"(d[12]), "=r"(d[13]), "=r"(d[14]), "=r"(d[15]), "=r"(d[16]), "=r"(d[17]), "=r"(d[18]), "=r"(d[19]), "=r"(d[20]), "=r"(d[21]), "=r"(d[22]), "=r"(d[23]), "=r"(d[24]), "=r"(d[25]), "=r"(d[26]), "=r"(d[27]), "=r"(d[28]), "=r"(d[29]), "=r"(d[30]), "=r"(d[31])
      : "l"(a_descriptor), "l"(b_descriptor));
}
#endif

// One body (about 180 lines): the asynchronous copies, warpgroup MMAs in flight and the per-K-block
// scale step share the pipeline's stage indices and the accumulators held in registers.
__global__ void __launch_bounds__(tcw_threads, 1)
    tensor_core_wgmma_kernel(const std::int8_t* a, const std::uint32_t* a_scales, const unsigned* a_slow,
                             const std::int8_t* b, const std::uint32_t* b_scales, const unsigned* b_slow,
                             std::int64_t m, std::int64_t n, std::int64_t stride, std::int64_t padded_m,
                             std::int64_t padded_n, std::int64_t blocks, std::int64_t tiles_m, std::int64_t tiles_n,
                             output_rounding output, float* out) {
#if defined(MXSCOPE_TCW_BODY)
#if defined(MXSCOPE_GPU_SIMULATE)
  MXSCOPE_DYNAMIC_SHARED(unsigned char, tcw_raw);
#else
  extern __shared__ __align__(1024) unsigned char tcw_raw[];
#endif
  // 1024-byte aligned by an offset into the array (not an integer cast), so that the compiler
  // still knows these are shared-memory addresses (LDS, not generic loads).
  const unsigned raw_address = static_cast<unsigned>(__cvta_generic_to_shared(tcw_raw));
  tcw_stage* const stages = reinterpret_cast<tcw_stage*>(tcw_raw + ((1024U - (raw_address & 1023U)) & 1023U));
  const int t = threadIdx.x;
  const int warpgroup = t / 128;
  const int warp = (t / 32) % 4;
  const int lane = t % 32;
  const tile_origin origin = grouped_tile_origin(static_cast<int>(blockIdx.x), static_cast<int>(tiles_m),
                                                 static_cast<int>(tiles_n), tcw_tile, tcw_tile);
  const int i0 = origin.i0;
  const int j0 = origin.j0;
  const int block_count = static_cast<int>(blocks);
  const int stage_count = (block_count + tcw_stage_blocks - 1) / tcw_stage_blocks;

  // The copies of one stage: four 16-byte chunks of A and of B (chunk q = t + 256 p: row q / 8,
  // chunk q % 8, i.e. K-block (q % 8) / 2), one 16-byte chunk of scales, and for 8 threads a flag.
  // Rows past the end copy the last row; K-blocks past the end are zero-filled.
  const auto load_stage = [&](int s) {
    tcw_stage& stage = stages[s % tcw_stages];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int q = t + 256 * p;
      const int row = q / 8;
      const int chunk = q % 8;
      const bool inside = 4 * s + chunk / 2 < block_count;
      const std::int64_t column = inside ? 128 * static_cast<std::int64_t>(s) + 16 * chunk : 0;
      copy_async_16(stage.a + swizzled_offset(row, chunk),
                    a + std::min<std::int64_t>(i0 + row, m - 1) * stride + column, inside);
      copy_async_16(stage.b + swizzled_offset(row, chunk),
                    b + std::min<std::int64_t>(j0 + row, n - 1) * stride + column, inside);
    }
    {
      const int u = (t % 128) / 32;
      const int chunk = t % 32;
      const bool inside = 4 * s + u < block_count;
      const std::int64_t block = inside ? 4 * s + u : 0;
      if (t < 128) {
        copy_async_16(&stage.a_scales[u][4 * chunk], a_scales + block * padded_m + i0 + 4 * chunk, inside);
      } else {
        copy_async_16(&stage.b_scales[u][4 * chunk], b_scales + block * padded_n + j0 + 4 * chunk, inside);
      }
    }
    if (t < 8) {
      const int u = t / 2;
      const bool inside = 4 * s + u < block_count;
      const std::int64_t block = inside ? 4 * s + u : 0;
      const unsigned* source = t % 2 == 0 ? a_slow + block * (padded_m / tcw_tile) + i0 / tcw_tile
                                          : b_slow + block * (padded_n / tcw_tile) + j0 / tcw_tile;
      copy_async_4(&stage.slow[u][t % 2], source, inside);
    }
  };

  float accumulators[64];
  int dots[2][32];  // the two column halves of a K-block: one is multiplied while the other is stepped
#pragma unroll
  for (int i = 0; i < 64; ++i) accumulators[i] = 0.0f;
  // This thread's rows (+ 8) and first column pair (+ 8 j, + 64 for the second half) in the tile.
  const int row0 = warpgroup * 64 + warp * 16 + lane / 4;
  const int col0 = 2 * (lane % 4);

  // Stage s is stepped while s + 1 .. s + 3 load; making stage s ready refills the slot of s - 1,
  // whose mma every thread has waited for before the barrier.
  constexpr int prefetch = tcw_stages - 1;
#pragma unroll
  for (int s = 0; s < prefetch; ++s) {
    if (s < stage_count) load_stage(s);
    copy_async_commit();
  }
  const auto make_ready = [&](int s) {
    copy_async_wait<prefetch - 1>();
    proxy_fence_shared();  // this thread's copies are read by the async proxy (wgmma)
    __syncthreads();
    if (s + prefetch < stage_count) load_stage(s + prefetch);
    copy_async_commit();
  };
  // The mma of column half h of K-block kb into its register set.
  const auto issue = [&](int (&d)[32], int kb, int h) {
    const tcw_stage& stage = stages[(kb / tcw_stage_blocks) % tcw_stages];
    const int u = kb % tcw_stage_blocks;
    wgmma_fence();
    wgmma_s8_m64n64k32(d, tcw_descriptor(stage.a + warpgroup * 64 * 128 + 32 * u),
                       tcw_descriptor(stage.b + h * 64 * 128 + 32 * u));
    wgmma_commit();
  };
  // A K-block's scale operands, read before its mma are waited for (they do not depend on them):
  // the tile flags, the two row scales and their offsets, and one half's column scale pairs.
  struct block_scales {
    bool fast;
    float rows[2];
    float offsets[2];
  };
  const auto read_scales = [&](int kb) {
    const tcw_stage& stage = stages[(kb / tcw_stage_blocks) % tcw_stages];
    const int u = kb % tcw_stage_blocks;
    block_scales scales;
    scales.fast = (stage.slow[u][0] | stage.slow[u][1]) == 0U;  // the same in every thread
    scales.rows[0] = core_ns::bits_float(stage.a_scales[u][row0]);
    scales.rows[1] = core_ns::bits_float(stage.a_scales[u][row0 + 8]);
    scales.offsets[0] = __fmul_rn(-tcb_magic_value, scales.rows[0]);
    scales.offsets[1] = __fmul_rn(-tcb_magic_value, scales.rows[1]);
    return scales;
  };
  const auto read_columns = [&](uint2 (&columns)[8], int kb, int h) {
    const tcw_stage& stage = stages[(kb / tcw_stage_blocks) % tcw_stages];
    const int u = kb % tcw_stage_blocks;
#pragma unroll
    for (int j = 0; j < 8; ++j) columns[j] = *reinterpret_cast<const uint2*>(&stage.b_scales[u][col0 + 64 * h + 8 * j]);
  };
  // The fp32-block steps of column half h of K-block kb from its register set: d[4 j + 2 r + e]
  // is the dot D of row row0 + 8 r, column col0 + 64 h + 8 j + e.
  const auto step = [&](const int (&d)[32], int kb, int h, const block_scales& scales, const uint2 (&columns)[8]) {
    float* const half_accumulators = accumulators + 32 * h;
    if (scales.fast) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float col_scales[2] = {core_ns::bits_float(columns[j].x), core_ns::bits_float(columns[j].y)};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int i = 4 * j + 2 * r + e;
            const float x = __fmaf_rn(core_ns::bits_float(static_cast<std::uint32_t>(d[i] + tcb_magic)),
                                      scales.rows[r], scales.offsets[r]);
            half_accumulators[i] = __fmaf_rn(x, col_scales[e], half_accumulators[i]);
          }
        }
      }
    } else {
      const tcw_stage& stage = stages[(kb / tcw_stage_blocks) % tcw_stages];
      const int u = kb % tcw_stage_blocks;
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int row = row0 + 8 * ((i / 2) % 2);
        const int col = col0 + 64 * h + 8 * (i / 4) + i % 2;
        half_accumulators[i] =
            tensor_core_step(half_accumulators[i], d[i], tc_scale_exponent(stage.a_scales[u][row]),
                             tc_scale_exponent(stage.b_scales[u][col]), 0);
      }
    }
  };

  for (int kb = 0; kb < block_count; ++kb) {
    if (kb % tcw_stage_blocks == 0) make_ready(kb / tcw_stage_blocks);
    const block_scales scales = read_scales(kb);
    uint2 columns[2][8];
    read_columns(columns[0], kb, 0);
    issue(dots[0], kb, 0);
    issue(dots[1], kb, 1);
    read_columns(columns[1], kb, 1);
    wgmma_wait<1>();  // half 0's mma is done; half 1's runs during the steps below
    step(dots[0], kb, 0, scales, columns[0]);
    wgmma_wait<0>();
    step(dots[1], kb, 1, scales, columns[1]);
  }
  copy_async_wait<0>();

#pragma unroll
  for (int i = 0; i < 64; ++i) {
    const int h = i / 32;
    const int k = i % 32;
    const std::int64_t row = i0 + row0 + 8 * ((k / 2) % 2);
    const std::int64_t col = j0 + col0 + 64 * h + 8 * (k / 4) + k % 2;
    if (row < m && col < n) out[row * n + col] = finish_output(accumulators[i] * 1.0f, output);
  }
#else
  // Built without sm_90a: wgmma_present() reports false and the host never launches this.
  (void)a, (void)a_scales, (void)a_slow, (void)b, (void)b_scales, (void)b_slow, (void)m, (void)n, (void)stride;
  (void)padded_m, (void)padded_n, (void)blocks, (void)tiles_m, (void)tiles_n, (void)output, (void)out;
#endif
}
#undef MXSCOPE_TCW_BODY

#if !defined(MXSCOPE_GPU_SIMULATE)

// -------------------------------------------------------------------------------------------
// The sm_90a fp32-block kernel of MXFP4 operands with the block scales inside them
// (tensor_core_scaled_kernel): A and B hold q 2^e as bf16 numbers (prepare_scaled_kernel), so the
// warpgroup MMA's fp32 result for one K-block, two wgmma.mma_async m64n64k16 bf16 (the first
// with scale-d 0, the second adding to it), is the scaled block dot D 2^(ea + eb) itself, and the
// step fl32(acc + D 2^k) is one fp32 addition. That value is exact wherever the kernel runs
// (scaled_kernel_fits): the products of two elements are 2qa 2qb 2^(k - 2) with |2q| <= 12, and
// every partial sum of a block's 32 is an integer multiple of 2^(k - 2) below 2^13 2^(k - 2), so
// with -124 <= k <= 117 they are all normal fp32 numbers (or zero) whatever the order of the
// additions; sm_90's bf16 tensor core aligns its 16-product steps 25 bits below the largest
// exponent sum (docs/conformance.md), far below these sums' last bit. A block dot of zero may
// come out as -0; acc starts at +0 and can never become -0 (an addition rounded to nearest gives
// -0 only from two negative zeros), so acc + (-0) = acc as acc + 0 does.
//
// The fp8 form (Fp8 = true; prepare_fp8_kernel) halves the tensor core's time per block: A and B
// hold q 2^(e - b) as e5m2 numbers with one base exponent b per 128-row tile and K-block, so one
// wgmma m64n64k32 e5m2 (scale-d 0) gives D 2^(da + db), da = ea - ba and db = eb - bb the same for
// all 32 products of an entry, and the step is fl32(acc + D 2^(da + db) 2^(ba + bb)), one fma with
// the tile pair's scale 2^(ba + bb) (a normal fp32 number: prepare_fp8_kernel). The products are
// 2qa 2qb 2^(da + db - 2) with -30 <= da + db <= 26, every partial sum a multiple of
// 2^(da + db - 2) below 2^13 2^(da + db - 2): at most 13 significant bits, all normal. The H200
// conformance captures (docs/conformance.md) measured sm_90's fp8 tensor core as 32-product steps
// aligned 13 bits below the largest exponent sum (here at most da + db + 4: 6 x 6 = 2.25 2^4), so
// it drops nothing above 2^(da + db - 9), and a result of 14 significant bits: exact here.
//
// A thread block computes 128 x 256 entries with three warpgroups. The first loads: one thread
// moves each stage (a 16 KiB tile of A and two of B, already in the shared-memory layout: two
// K-blocks of bf16 or four of fp8, and for fp8 the three tiles' bases) with bulk asynchronous
// copies that complete on the stage's "full" barrier, after the stage's "empty" barrier says both
// consumers are done with its previous contents (one arrival per consumer warp, by its first lane
// once the warp's mma on the stage have completed). Each of the other two computes 64 rows: 128
// fp32 accumulators per thread and two sets of 32 dot registers for the four column quarters of a
// K-block (the mma of one quarter runs while the previous one is added). The consumers wait on
// barriers, not on each other, so one adds while the other's mma run. setmaxnreg moves registers
// from the loader (24, the least it may keep) to them (240). Each consumer warp stores its entries
// through shared memory with bulk copies, so that the next tile's mma start while they are written.
constexpr int tcs_tile_m = 128;
constexpr int tcs_tile_n = 256;
constexpr int tcs_threads = 384;
constexpr int tcs_stages = 4;
constexpr int tcs_consumer_threads = 256;
constexpr int tcs_producer_registers = 24;   // setmaxnreg counts: the loader warpgroup,
constexpr int tcs_consumer_registers = 240;  // and the two that compute
static_assert(register_split_fits(tcs_threads, tcs_producer_registers, tcs_consumer_registers));

struct alignas(1024) tcs_stage {
  unsigned char a[tcs_tile_m * 128];  // 128 rows x 128 bytes, in prepare_scaled_kernel's or prepare_fp8_kernel's layout
  unsigned char b[tcs_tile_n * 128];  // two such tiles
};
// The epilogue's staging: per consumer 64 rows x 32 columns of fp32 entries (a chunk; a warp
// waits for the bulk copies' reads of its previous chunk before it writes the next), rows 40
// floats apart (160 bytes: 16-byte aligned for the bulk copies, and a warp's eight rows of a store
// fall in different banks but for pairs).
constexpr int tcs_staging_columns = 32;
constexpr int tcs_staging_stride = 40;
static_assert(tcs_staging_columns % 32 == 0 && tcs_tile_n % tcs_staging_columns == 0 && tcs_staging_stride % 4 == 0);
struct tcs_shared {
  tcs_stage stages[tcs_stages];
  float staging[2][64 * tcs_staging_stride];
  std::int32_t bases[tcs_stages][3][4];  // fp8: per stage the A tile's, then B's two tiles' bases
  std::uint64_t full[tcs_stages];
  std::uint64_t empty[tcs_stages];
};
constexpr std::size_t tcs_shared_bytes = sizeof(tcs_shared) + 1024;  // + alignment slack
static_assert(tcs_shared_bytes <= 227 * 1024, "the sm_90 limit of dynamic shared memory per block");
static_assert(scaled_tile_rows == 128 && tcs_tile_n % scaled_tile_rows == 0 && scaled_row_pad % tcs_tile_n == 0 &&
              scaled_row_pad % tcs_tile_m == 0);

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d (+)= A B^T for the 64 x 16 bf16 A and B tiles of the descriptors, fp32; Accumulate false: scale-d 0.
template <bool Accumulate>
__device__ inline void wgmma_bf16_m64n64k16(float (&d)[32], std::uint64_t a_descriptor, std::uint64_t b_descriptor) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a_descriptor), "l"(b_descriptor), "n"(Accumulate ? 1 : 0));
}

// d = A B^T for the 64 x 32 e5m2 A and B tiles of the descriptors, fp32 (scale-d 0: d is only
// written, so that the compiler does not keep the dots' values live from one tile to the next).
__device__ inline void wgmma_e5m2_m64n64k32(float (&d)[32], std::uint64_t a_descriptor, std::uint64_t b_descriptor) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e5m2.e5m2 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1;\n}\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31])
      : "l"(a_descriptor), "l"(b_descriptor));
}

__device__ inline void barrier_init(std::uint64_t* barrier, unsigned count) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(barrier));
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(address), "r"(count) : "memory");
}
__device__ inline void barrier_arrive(std::uint64_t* barrier) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(barrier));
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(address) : "memory");
}
__device__ inline void barrier_expect_bytes(std::uint64_t* barrier, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(
                   static_cast<unsigned>(__cvta_generic_to_shared(barrier))),
               "r"(bytes)
               : "memory");
}
// Returns once the phase of the given parity (0 for the first) has completed.
__device__ inline void barrier_wait(std::uint64_t* barrier, unsigned parity) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(barrier));
  unsigned done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(address), "r"(parity)
        : "memory");
  } while (done == 0);
}
// A bulk asynchronous copy of `bytes` (a multiple of 16, both ends 16-byte aligned) that completes
// on `barrier`.
__device__ inline void bulk_copy(void* shared_destination, const void* global_source, unsigned bytes,
                                 std::uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          static_cast<unsigned>(__cvta_generic_to_shared(shared_destination))),
      "l"(global_source), "r"(bytes), "r"(static_cast<unsigned>(__cvta_generic_to_shared(barrier)))
      : "memory");
}
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// A bulk asynchronous copy of `bytes` (a multiple of 16, both ends 16-byte aligned) from shared to
// global memory, in this thread's bulk group.
__device__ inline void bulk_store(void* global_destination, const void* shared_source, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(global_destination),
               "r"(static_cast<unsigned>(__cvta_generic_to_shared(shared_source))), "r"(bytes)
               : "memory");
}
__device__ inline void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Returns once this thread's bulk copies have read their sources (Read) or completed.
template <bool Read>
__device__ inline void bulk_wait_all() {
  if constexpr (Read) {
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
  } else {
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }
}
#endif

// One body (about 235 lines): the persistent loop's bulk copies, barriers, warpgroup MMAs,
// scale-adds and the staged stores share the stage indices, barrier phases and the accumulators
// held in registers.
template <bool Fp8>
__global__ void __launch_bounds__(tcs_threads, 1)
    tensor_core_scaled_kernel(const unsigned char* a, const unsigned char* b, const std::int32_t* a_bases,
                              const std::int32_t* b_bases, std::int64_t m, std::int64_t n, std::int64_t blocks,
                              std::int64_t tiles_m, std::int64_t tiles_n, output_rounding output, float* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char tcs_raw[];
  const unsigned raw_address = static_cast<unsigned>(__cvta_generic_to_shared(tcs_raw));
  tcs_shared& shared = *reinterpret_cast<tcs_shared*>(tcs_raw + ((1024U - (raw_address & 1023U)) & 1023U));
  const int t = threadIdx.x;
  // The bf16 form takes its warpgroup and warp indices from lane 0, so that the compiler knows them
  // to be the same in all lanes and keeps the descriptors derived from them in uniform registers
  // (the fp8 form ran slower so: BENCHMARKS.md, "The MXFP4 GEMM's epilogue and indices").
  const auto warp_uniform = [](int value) { return Fp8 ? value : __shfl_sync(0xffffffffU, value, 0); };
  const int warpgroup = warp_uniform(t / 128);
  // Persistent: thread block p computes tiles p, p + grid, ... in the grouped order, so that the
  // loader fills the next tile's stages while the consumers store this one's entries. Both roles
  // count stages over all their tiles (use), which gives each barrier's slot and parity.
  const int tile_count = static_cast<int>(tiles_m * tiles_n);
  const auto origin_of = [&](int tile) {
    return grouped_tile_origin(tile, static_cast<int>(tiles_m), static_cast<int>(tiles_n), tcs_tile_m, tcs_tile_n);
  };
  const int block_count = static_cast<int>(blocks);
  constexpr int stage_blocks = Fp8 ? fp8_tile_k_blocks : 2;  // K-blocks per 128-byte row
  const int chunks = (block_count + stage_blocks - 1) / stage_blocks;  // stages
  if (t == 0) {
    for (int s = 0; s < tcs_stages; ++s) {
      barrier_init(&shared.full[s], 1);
      barrier_init(&shared.empty[s], tcs_consumer_threads / 32);  // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(tcs_producer_registers) : "memory");
    if (t == 0) {
      const std::int64_t b_second = static_cast<std::int64_t>(chunks) * scaled_tile_bytes;  // the next 128 rows
      int use = 0;
      for (int tile = static_cast<int>(blockIdx.x); tile < tile_count; tile += static_cast<int>(gridDim.x)) {
        const tile_origin origin = origin_of(tile);
        const unsigned char* a_source =
            a + static_cast<std::int64_t>(origin.i0 / scaled_tile_rows) * chunks * scaled_tile_bytes;
        const unsigned char* b_source =
            b + static_cast<std::int64_t>(origin.j0 / scaled_tile_rows) * chunks * scaled_tile_bytes;
        const std::int32_t* const a_base_source =
            Fp8 ? a_bases + static_cast<std::int64_t>(origin.i0 / scaled_tile_rows) * chunks * 4 : nullptr;
        const std::int32_t* const b_base_source =
            Fp8 ? b_bases + static_cast<std::int64_t>(origin.j0 / scaled_tile_rows) * chunks * 4 : nullptr;
        for (int s = 0; s < chunks; ++s, ++use) {
          const int slot = use % tcs_stages;
          if (use >= tcs_stages) barrier_wait(&shared.empty[slot], static_cast<unsigned>(use / tcs_stages - 1) & 1U);
          barrier_expect_bytes(&shared.full[slot], sizeof(tcs_stage) + (Fp8 ? 3 * 16 : 0));
          tcs_stage& stage = shared.stages[slot];
          const std::int64_t step = static_cast<std::int64_t>(s) * scaled_tile_bytes;
          bulk_copy(stage.a, a_source + step, scaled_tile_bytes, &shared.full[slot]);
          bulk_copy(stage.b, b_source + step, scaled_tile_bytes, &shared.full[slot]);
          bulk_copy(stage.b + scaled_tile_bytes, b_source + b_second + step, scaled_tile_bytes, &shared.full[slot]);
          if (Fp8) {
            bulk_copy(shared.bases[slot][0], a_base_source + 4 * s, 16, &shared.full[slot]);
            bulk_copy(shared.bases[slot][1], b_base_source + 4 * s, 16, &shared.full[slot]);
            bulk_copy(shared.bases[slot][2], b_base_source + 4 * (chunks + s), 16, &shared.full[slot]);
          }
        }
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(tcs_consumer_registers) : "memory");

  const int consumer = warpgroup - 1;  // rows 64 consumer ..
  const int warp = warp_uniform((t / 32) % 4);
  const int lane = t % 32;
  float accumulators[4][32];  // [column quarter][dot register]
  float dots[2][32];          // quarters 0, 2 and 1, 3
#pragma unroll
  for (int i = 0; i < 32; ++i) dots[0][i] = dots[1][i] = 0.0f;

  // Descriptors of stage 0's A rows of this consumer and B's first quarter; a stage is
  // sizeof(tcs_stage) further, K-block u of a stage 64 u bytes (bf16; its second k16 32 bytes) or
  // 32 u bytes (fp8), quarter q of B 64 q rows (8192 q bytes); descriptors count 16-byte units.
  // Held as their low words (the start address; the high word, stride and swizzle, is the same
  // constant for all), which saves the K loop registers.
  const auto a_descriptor = static_cast<std::uint32_t>(tcw_descriptor(shared.stages[0].a + consumer * 64 * 128));
  const auto b_descriptor = static_cast<std::uint32_t>(tcw_descriptor(shared.stages[0].b));
  constexpr std::uint64_t descriptor_high = ((1024ULL >> 4) << 32) | (1ULL << 62);
  const auto issue = [&](float (&d)[32], std::uint64_t a_at, std::uint64_t b_at, int quarter) {
    const std::uint64_t b_quarter = b_at + static_cast<std::uint64_t>(quarter * 8192 / 16);
    wgmma_fence();
    if constexpr (Fp8) {
      wgmma_e5m2_m64n64k32(d, a_at, b_quarter);
    } else {
      wgmma_bf16_m64n64k16<false>(d, a_at, b_quarter);
      wgmma_bf16_m64n64k16<true>(d, a_at + 2, b_quarter + 2);
    }
    wgmma_commit();
  };
  // The step of one quarter: fl32(acc + D 2^k), the scale (fp8: 2^(ba + bb)) applied exactly.
  const auto add = [&](float (&accumulator)[32], const float (&d)[32], float scale) {
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      accumulator[i] = Fp8 ? __fmaf_rn(d[i], scale, accumulator[i]) : __fadd_rn(accumulator[i], d[i]);
    }
  };
  // 2^(ba + bb) as an fp32 number; clamped for tile pairs where a tile has no nonzero block (D is
  // zero there; elsewhere prepare_fp8_kernel keeps the sum in range).
  const auto pair_scale = [](int exponent) {
    return core_ns::bits_float(static_cast<std::uint32_t>(min(max(exponent, -126), 127) + 127) << 23);
  };

  // Within a stage the quarters' mma form one stream, two in flight: quarter q of K-block u goes
  // into dot set q % 2 once quarter q - 2's dots are added, so K-block u + 1's first two start while
  // u's last two are added. The stream drains at the end of each stage: ptxas serializes every
  // wgmma (C7514) when one is in flight across a branch or the loop's back edge.
  const auto scales_of = [&](int slot, int u, float (&scales)[2]) {  // B's first and second 128 rows
    scales[0] = scales[1] = 1.0f;
    if constexpr (Fp8) {
      const int a_base = shared.bases[slot][0][u];
      scales[0] = pair_scale(a_base + shared.bases[slot][1][u]);
      scales[1] = pair_scale(a_base + shared.bases[slot][2][u]);
    }
  };
  const int full_stages = block_count / stage_blocks;
  int use = 0;
  for (int tile = static_cast<int>(blockIdx.x); tile < tile_count; tile += static_cast<int>(gridDim.x)) {
    const tile_origin origin = origin_of(tile);
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int i = 0; i < 32; ++i) accumulators[q][i] = 0.0f;
#pragma unroll 1
    for (int s = 0; s < full_stages; ++s, ++use) {
      const int slot = use % tcs_stages;
      barrier_wait(&shared.full[slot], static_cast<unsigned>(use / tcs_stages) & 1U);
      const auto stage_units = static_cast<std::uint32_t>(slot * (sizeof(tcs_stage) / 16));
      const auto at = [&](int u, std::uint32_t descriptor) {
        return descriptor_high | (descriptor + stage_units + static_cast<std::uint32_t>((Fp8 ? 2 : 4) * u));
      };
      issue(dots[0], at(0, a_descriptor), at(0, b_descriptor), 0);
      issue(dots[1], at(0, a_descriptor), at(0, b_descriptor), 1);
#pragma unroll
      for (int u = 0; u < stage_blocks; ++u) {
        float scales[2];
        scales_of(slot, u, scales);
        wgmma_wait<1>();
        add(accumulators[0], dots[0], scales[0]);
        issue(dots[0], at(u, a_descriptor), at(u, b_descriptor), 2);
        wgmma_wait<1>();
        add(accumulators[1], dots[1], scales[0]);
        issue(dots[1], at(u, a_descriptor), at(u, b_descriptor), 3);
        wgmma_wait<1>();
        add(accumulators[2], dots[0], scales[1]);
        if (u + 1 < stage_blocks) {
          issue(dots[0], at(u + 1, a_descriptor), at(u + 1, b_descriptor), 0);
          wgmma_wait<1>();
          add(accumulators[3], dots[1], scales[1]);
          issue(dots[1], at(u + 1, a_descriptor), at(u + 1, b_descriptor), 1);
        } else {
          wgmma_wait<0>();
          add(accumulators[3], dots[1], scales[1]);
        }
      }
      // The warp's mma on the stage have completed, and every lane has passed the warp-aligned
      // wgmma_wait after using its scale loads: one arrival stands for the warp.
      if (lane == 0) barrier_arrive(&shared.empty[slot]);
    }
    // The last stage when it holds fewer K-blocks: one K-block at a time.
    if (full_stages * stage_blocks < block_count) {
      const int s = full_stages;
      const int slot = use % tcs_stages;
      barrier_wait(&shared.full[slot], static_cast<unsigned>(use / tcs_stages) & 1U);
      const auto stage_units = static_cast<std::uint32_t>(slot * (sizeof(tcs_stage) / 16));
#pragma unroll 1
      for (int u = 0; stage_blocks * s + u < block_count; ++u) {
        float scales[2];
        scales_of(slot, u, scales);
        const auto block_units = stage_units + static_cast<std::uint32_t>((Fp8 ? 2 : 4) * u);
        const std::uint64_t a_at = descriptor_high | (a_descriptor + block_units);
        const std::uint64_t b_at = descriptor_high | (b_descriptor + block_units);
        issue(dots[0], a_at, b_at, 0);
        issue(dots[1], a_at, b_at, 1);
        wgmma_wait<1>();
        add(accumulators[0], dots[0], scales[0]);
        issue(dots[0], a_at, b_at, 2);
        wgmma_wait<1>();
        add(accumulators[1], dots[1], scales[0]);
        issue(dots[1], a_at, b_at, 3);
        wgmma_wait<1>();
        add(accumulators[2], dots[0], scales[1]);
        wgmma_wait<0>();
        add(accumulators[3], dots[1], scales[1]);
      }
      if (lane == 0) barrier_arrive(&shared.empty[slot]);
      ++use;
    }

    // The entries go out through shared memory, each warp's 16 rows x 32 columns at a time, each
    // row by a bulk copy of one of the warp's first 16 lanes, which the warp does not wait for: it
    // goes on to the next chunk and tile and waits only before it writes the staging again (a row
    // whose global address or length is not a multiple of 16 bytes is stored by that lane itself).
    // Entry d[4 j + 2 r + e] of quarter q: row 16 warp + lane / 4 + 8 r, column
    // 64 q + 8 j + 2 (lane % 4) + e. The tile's origin comes again from an index the compiler
    // cannot see through, so that none of this address arithmetic is hoisted above the K loop.
    int stored_tile = tile;
    asm volatile("" : "+r"(stored_tile));
    const tile_origin stored = origin_of(stored_tile);
    float* const staging = shared.staging[consumer] + warp * 16 * tcs_staging_stride;
    const std::int64_t copy_row = stored.i0 + consumer * 64 + warp * 16 + lane;  // lanes 0 .. 15
    constexpr int groups = tcs_staging_columns / 32;  // 32-column groups a chunk
#pragma unroll
    for (int h = 0; h < tcs_tile_n / tcs_staging_columns; ++h) {
      if (lane < 16) bulk_wait_all<true>();
      __syncwarp();  // the staging's previous rows have been read
      // 32-column group `group` of the tile: quarter group / 2, dots 16 (group % 2) .. + 15.
#pragma unroll
      for (int g = 0; g < groups; ++g) {
        const int group = h * groups + g;
#pragma unroll
        for (int i = 16 * (group % 2); i < 16 * (group % 2) + 16; i += 2) {
          const int column = 32 * g + 8 * ((i / 4) % 4) + 2 * (lane % 4);
          const int row = lane / 4 + 8 * ((i / 2) % 2);
          *reinterpret_cast<float2*>(staging + row * tcs_staging_stride + column) =
              make_float2(finish_output(accumulators[group / 2][i] * 1.0f, output),
                          finish_output(accumulators[group / 2][i + 1] * 1.0f, output));
        }
      }
      proxy_fence_shared();  // the generic-proxy writes, before the bulk copies read them
      __syncwarp();
      const std::int64_t col = stored.j0 + tcs_staging_columns * h;
      const std::int64_t columns = min(static_cast<std::int64_t>(tcs_staging_columns), n - col);
      if (lane < 16 && copy_row < m && columns > 0) {
        float* const destination = out + copy_row * n + col;
        const float* const source = staging + lane * tcs_staging_stride;
        const auto bytes = static_cast<unsigned>(columns * 4);
        if (bytes % 16 == 0 && reinterpret_cast<std::uintptr_t>(destination) % 16 == 0) {
          bulk_store(destination, source, bytes);
        } else {
          for (int c = 0; c < columns; ++c) destination[c] = source[c];
        }
      }
      if (lane < 16) bulk_commit();
    }
  }  // tiles
  if (lane < 16) bulk_wait_all<false>();  // the last tile's rows are written
#else
  // Built without sm_90a: wgmma_present() reports false and the host never launches this.
  (void)a, (void)b, (void)a_bases, (void)b_bases, (void)m, (void)n, (void)blocks, (void)tiles_m, (void)tiles_n;
  (void)output, (void)out;
#endif
}
#endif  // !MXSCOPE_GPU_SIMULATE

#endif  // MXSCOPE_CUDA_TENSOR_CORES
