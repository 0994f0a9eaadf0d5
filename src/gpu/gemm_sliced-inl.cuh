// Part of products.cu (included there, in order, inside namespace mxscope::gpu):
// the integer path's fp32-block and exact kernel on the int8 tensor cores, for element integers too
// wide for one int8 (fp8 e4m3, fp6 e3m2, and pairs of them with the narrower formats).
// -------------------------------------------------------------------------------------------
// Sliced block dots. Every element integer Q of the integer path (the element times 2^fraction
// bits, |Q| < 2^18 here: 229376 for e4m3) is cut into three signed slices of 7, 7 and 4 bits,
//   Q = P0 + 2^7 P1 + 2^14 P2,  Pi = sign(Q) * (bits 7i .. 7i + 6 of |Q|),  |P0|, |P1| <= 127, |P2| <= 15,
// so that the block dot of a K-block of 32 is
//   D = sum_k Qa Qb = S0 + 2^7 S1 + 2^14 S2 + 2^21 S3 + 2^28 S4,  S_l = sum_{i + j = l} Pa_i . Pb_j:
// nine mma.sync m16n8k32 s8 per K-block, the pairs of one level chained in one accumulator. With
// the slices' bounds, |S0| <= 32 127^2, |S1| <= 2 32 127^2, |S2| <= 32 (127^2 + 2 127 15),
// |S3| <= 2 32 127 15 and |S4| <= 32 15^2, so lo = S0 + 2^7 S1 < 2^27 and
// hi = S2 + 2^7 S3 + 2^14 S4 < 2^27 are exact in int32, and D = lo + 2^14 hi.
//
// The two integers become doubles from their bits alone: the double with high word 0x43300000
// and low word x ^ 2^31 is 2^52 + 2^31 + x for every int32 x. With c = 2^52 + 2^31,
//   D = (v(lo) - c) + fma(v(hi), 2^14, -c 2^14),
// where every operation's exact result is an integer below 2^53 in magnitude (|D| < 2^42): none
// rounds, and the double is D itself. The model's step fl32(acc + D 2^k) (2^k = the row's
// 2^(ea - fa - fb) times the column's 2^eb, exact) then goes through fp64 in round-to-odd
// (round_to_odd_step_by_sign), without a branch: ties, which quantized operands make common, cost
// nothing extra. Every entry thus gets fl32(acc + D 2^k) in ascending K-blocks: the integer
// kernel's bits. The exact model adds the scaled dots D 2^k to a running fp64 sum, as the integer
// kernel's exact mode does, a sum being exact where its round-down and round-up agree
// (add_product_rounds), and leaves the entries where an addition rounded to its fix-up kernel.
//
// Whole K: under `exact`, where every row of both operands has one block exponent along K (per-tensor
// scaling: the per-tensor fp8 strategies' products) and K <= slc_whole_depth_limit, the scale 2^k
// of an entry is the same in every K-block, so its exact sum is 2^k (S0 + 2^7 S1 + ... + 2^28 S4)
// with each level S_l summed over all of K. The mma chain those sums in int32 across the K-blocks
// (sliced_block_kernel<true, true>): |S_l| <= K 2 127^2 < 2^31 for K <= 2^16, and |sum_l 2^7l S_l|
// <= K max|Qa| max|Qb| < 2^16 2^36 = 2^52, so one fp64 Horner pass after the last K-block
// (sliced_levels_dot) is exact, and so is its scaling. No per-block step, no fix-up.
//
// Conditions (launch_sliced, on the host and in prepare_sliced_kernel): fp32-block or exact, blocks
// of 32, both formats' integers below 2^18 (fp8 e4m3, fp6, fp4, int8), no NaN block and every block
// exponent within [-400, 400] (the scales and every D 2^k normal, finite doubles; E8M0 exponents
// are within [-127, 127]).
//
// Tiling: 64 x 64 entries per thread block of 8 warps (2 x 4), 32 x 16 per warp (2 x 2 mma tiles,
// 16 accumulators per thread: 124 registers in fp32-block, 128 with 8 bytes spilled in exact; two
// thread blocks per multiprocessor). The Both forms, which hold an fp64 exact sum per entry as well,
// take 64 x 32 entries per thread block (4 x 2 warps of 16 x 16, 1 x 2 mma tiles: 104 and 106
// registers, none spilled, against 128 and spills at 32 x 16). A stage holds one K-block: the
// three slices of 64 rows of A and the block's rows of B, 32 bytes per row in tcb's swizzle, and
// the rows' scales; four stages (cp.async), thread blocks in tcb's grouped order. The prepared
// rows of B are padded to 64 for both tilings, so one prepared form serves every form.

#if defined(MXSCOPE_CUDA_TENSOR_CORES)

constexpr int slc_tile_m = 64;       // rows of A per thread block
constexpr int slc_warp_cols = 16;    // columns per warp
constexpr int slc_row_pad = 128;     // prepared rows of A padded to a multiple of this
constexpr int slc_col_pad = 64;      // prepared rows of B padded to a multiple of this
constexpr int slc_slices = 3;
constexpr int slc_stages = 4;
constexpr int slc_threads = 256;
constexpr int slc_row_block_bytes = slc_slices * 32;  // one row's K-block in the prepared form
constexpr std::int64_t slc_integer_limit = std::int64_t{1} << 18;
constexpr int slc_exponent_limit = 400;
constexpr std::int64_t slc_whole_depth_limit = std::int64_t{1} << 16;

// A thread block's tiling: 8 warps of WarpRows x slc_warp_cols entries, slc_tile_m rows in all.
template <int WarpRows>
struct slc_tiling {
  static constexpr int warp_rows = WarpRows;
  static constexpr int warps_m = slc_tile_m / WarpRows;
  static constexpr int warps_n = slc_threads / 32 / warps_m;
  static constexpr int tile_n = warps_n * slc_warp_cols;  // columns (rows of B) per thread block
};
// The kernel's forms' tilings (see "Tiling" above): warp rows 16 for the Both forms, 32 for the others.
using slc_wide = slc_tiling<32>;
using slc_narrow = slc_tiling<16>;
template <bool Both>
using slc_tiling_of = std::conditional_t<Both, slc_narrow, slc_wide>;

template <int TileN>
struct alignas(16) slc_stage {
  std::uint8_t a[slc_slices][slc_tile_m * 32];
  std::uint8_t b[slc_slices][TileN * 32];
  double a_scales[slc_tile_m];
  double b_scales[TileN];
};
template <int TileN>
constexpr std::size_t slc_shared_bytes = slc_stages * sizeof(slc_stage<TileN>);
static_assert(sizeof(slc_stage<slc_wide::tile_n>) % 16 == 0 && sizeof(slc_stage<slc_narrow::tile_n>) % 16 == 0 &&
              2 * (slc_tile_m + slc_wide::tile_n) == slc_threads && 2 * (slc_tile_m + slc_narrow::tile_n) <= slc_threads &&
              slc_row_pad % slc_tile_m == 0 && slc_col_pad % slc_wide::tile_n == 0 && slc_col_pad % slc_narrow::tile_n == 0);

// The element integer q (|q| < 2^18) at position k of a K-block, cut into its three signed slices:
// byte k of each slice's 32 in `words` (eight words a slice, four k a word, lowest byte first; the
// caller zeroes them).
__device__ inline void slice_integer(std::uint32_t (&words)[slc_slices][8], int k, std::int32_t q) {
  const std::uint32_t magnitude = static_cast<std::uint32_t>(q < 0 ? -q : q);
#pragma unroll
  for (int s = 0; s < slc_slices; ++s) {
    const std::int32_t digit = static_cast<std::int32_t>((magnitude >> (7 * s)) & 127U);
    const auto byte = static_cast<std::uint8_t>(static_cast<std::int8_t>(q < 0 ? -digit : digit));
    words[s][k / 4] |= static_cast<std::uint32_t>(byte) << (8 * (k % 4));
  }
}

// fn(k, row[k]) for the k < 32 of a K-block at row[0] (k0 + k < depth): where the block is whole,
// depth a multiple of 4 and the rows 16-byte aligned (device buffers are), by eight 16-byte loads.
template <class T, class Fn>
__device__ inline void for_each_in_block(const T* row, std::int64_t k0, std::int64_t depth, bool aligned, Fn&& fn) {
  using vector = std::conditional_t<std::is_same_v<T, float>, float4, int4>;
  if (aligned && depth % 4 == 0 && k0 + 32 <= depth) {
#pragma unroll
    for (int v = 0; v < 8; ++v) {
      const vector q = reinterpret_cast<const vector*>(row)[v];
      fn(4 * v, q.x);
      fn(4 * v + 1, q.y);
      fn(4 * v + 2, q.z);
      fn(4 * v + 3, q.w);
    }
  } else {
    for (int k = 0; k < 32 && k0 + k < depth; ++k) fn(k, row[k]);
  }
}

// The three slices' words of one row's K-block (slice_integer) stored at their place in the
// prepared form: [padded rows][blocks][3][32] bytes, `index` = row * blocks + block.
__device__ inline void store_sliced_block(std::uint8_t* slices, std::int64_t index,
                                          const std::uint32_t (&words)[slc_slices][8]) {
  auto* out = reinterpret_cast<uint4*>(slices + index * slc_row_block_bytes);
#pragma unroll
  for (int s = 0; s < slc_slices; ++s) {
    out[2 * s] = make_uint4(words[s][0], words[s][1], words[s][2], words[s][3]);
    out[2 * s + 1] = make_uint4(words[s][4], words[s][5], words[s][6], words[s][7]);
  }
}

// One row's K-block in the prepared form: its three slices' 32 bytes each into `words` (as
// slice_integer; the caller zeroes them) and its scale
// 2^(e + shift), returned; a row past the end (r >= rows) keeps zero slices and has scale 1. A
// block exponent that is NaN's marker or outside +-slc_exponent_limit sets flags[0] (unfit); one
// that differs from the row's first K-block's sets flags[1] (no whole-K dot).
__device__ inline double slice_row_block(const std::int32_t* integers, const std::int32_t* exponents,
                                         std::int64_t rows, std::int64_t depth, int shift, std::int64_t r,
                                         std::int64_t b, unsigned* flags, std::uint32_t (&words)[slc_slices][8]) {
  double scale = 1.0;
  if (r < rows) {
    const std::int32_t e = exponents[b * rows + r];
    if (b > 0 && e != exponents[r]) atomicMax(flags + 1, 1U);
    if (e == nan_block_exponent || e < -slc_exponent_limit || e > slc_exponent_limit) {
      atomicMax(flags, 1U);
    } else {
      scale = core_ns::pow2(e + shift);
    }
    const std::int64_t k0 = b * 32;
    for_each_in_block(integers + r * depth + k0, k0, depth, true,
                      [&](int k, std::int32_t q) { slice_integer(words, k, q); });
  }
  return scale;
}

// The prepared form of an integer-path operand for sliced_block_kernel: slices [padded rows]
// [blocks][3][32] (int8) and scales [blocks][padded rows] = 2^(e + shift) (double), as
// slice_row_block gives them, with its two flags.
__global__ void prepare_sliced_kernel(const std::int32_t* integers, const std::int32_t* exponents, std::int64_t rows,
                                      std::int64_t padded_rows, std::int64_t depth, std::int64_t blocks, int shift,
                                      std::uint8_t* slices, double* scales, unsigned* flags) {
  MXSCOPE_GRID_LOOP(index, padded_rows * blocks) {
    const std::int64_t r = index / blocks;
    const std::int64_t b = index % blocks;
    std::uint32_t words[slc_slices][8] = {};
    const double scale = slice_row_block(integers, exponents, rows, depth, shift, r, b, flags, words);
    store_sliced_block(slices, index, words);
    scales[b * padded_rows + r] = scale;
  }
}

#if defined(MXSCOPE_GPU_SIMULATE)
inline void mma_s8_add(int (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
  const int accumulator[4] = {d[0], d[1], d[2], d[3]};
  simulation::mma_s8(d, a, b, accumulator);
}
#else
// mma.sync m16n8k32 s8 x s8 + d -> d.
__device__ inline void mma_s8_add(int (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// D = low + 2^14 high from the levels' integers (see above).
__device__ inline double sliced_dot(int low, int high) {
  return (biased_double(low) - biased_double_offset) +
         fma_exact(biased_double(high), 16384.0, -biased_double_offset * 16384.0);
}

// sum_l 2^7l S_l from the five levels summed over the whole of K, by Horner's rule in fp64: every
// partial result is an integer below 2^52 (see "Whole K" above), so none rounds.
__device__ inline double sliced_levels_dot(const int (&levels)[5]) {
  double dot = static_cast<double>(levels[4]);
#pragma unroll
  for (int l = 3; l >= 0; --l) dot = fma_exact(dot, 128.0, static_cast<double>(levels[l]));
  return dot;
}

// The nine int8 products of one K-block's slices, a_s b_t into level s + t. Chain: added to the
// levels as they are (the whole-K dot's running sums); else each level starts at its first product.
template <bool Chain>
__device__ inline void slice_products(int (&level)[5][4], const std::uint32_t (&a)[slc_slices][4],
                                      const std::uint32_t (&b0)[2], const std::uint32_t (&b1)[2],
                                      const std::uint32_t (&b2)[2]) {
  const auto first = [](int (&d)[4], const std::uint32_t (&x)[4], const std::uint32_t (&y)[2]) {
    if constexpr (Chain) {
      mma_s8_add(d, x, y);
    } else {
      mma_s8(d, x, y);
    }
  };
  first(level[0], a[0], b0);
  first(level[1], a[0], b1);
  mma_s8_add(level[1], a[1], b0);
  first(level[2], a[0], b2);
  mma_s8_add(level[2], a[1], b1);
  mma_s8_add(level[2], a[2], b0);
  first(level[3], a[1], b2);
  mma_s8_add(level[3], a[2], b1);
  first(level[4], a[2], b2);
}

// One thread's copies of a K-block. Chunk t of a slice (16 bytes) is half t % 2 of row t / 2 of A
// for t < 2 slc_tile_m, else of row t / 2 - slc_tile_m of B: thread t copies chunk t of each slice
// where there is one (2 (slc_tile_m + TileN) chunks), and thread u two scales for u < slc_tile_m / 2 +
// TileN / 2, A's, then B's: u = t where the chunks take every thread, else t less the chunks' count.
template <int TileN>
struct slc_loader {
  using stage_type = slc_stage<TileN>;
  static constexpr int chunks = 2 * (slc_tile_m + TileN);
  const std::uint8_t* source;
  int offset;      // within a stage, slice 0
  int slice_step;  // bytes between slices in the stage
  const double* scale_source;
  int scale_offset;
  std::int64_t scale_step;

  __device__ slc_loader(const std::uint8_t* a, const double* a_scales, const std::uint8_t* b, const double* b_scales,
                        std::int64_t blocks, std::int64_t padded_m, std::int64_t padded_n, std::int64_t i0,
                        std::int64_t j0) {
    const int t = threadIdx.x;
    if (t < 2 * slc_tile_m) {
      source = a + (i0 + t / 2) * blocks * slc_row_block_bytes + (t % 2) * 16;
      offset = static_cast<int>(offsetof(stage_type, a)) + tcb_offset(t / 2, t % 2);
      slice_step = slc_tile_m * 32;
    } else if (chunks == slc_threads || t < chunks) {
      const int row = t / 2 - slc_tile_m;
      source = b + (j0 + row) * blocks * slc_row_block_bytes + (t % 2) * 16;
      offset = static_cast<int>(offsetof(stage_type, b)) + tcb_offset(row, t % 2);
      slice_step = TileN * 32;
    } else {  // no chunk: load() copies none
      source = a;
      offset = 0;
      slice_step = 0;
    }
    scale_source = nullptr;
    scale_offset = 0;
    scale_step = 0;
    const int u = chunks == slc_threads ? t : (t >= chunks ? t - chunks : slc_threads);
    if (u < slc_tile_m / 2) {
      scale_source = a_scales + i0 + 2 * u;
      scale_offset = static_cast<int>(offsetof(stage_type, a_scales)) + 16 * u;
      scale_step = padded_m;
    } else if (u < slc_tile_m / 2 + TileN / 2) {
      scale_source = b_scales + j0 + 2 * (u - slc_tile_m / 2);
      scale_offset = static_cast<int>(offsetof(stage_type, b_scales)) + 16 * (u - slc_tile_m / 2);
      scale_step = padded_n;
    }
  }

  __device__ void load(unsigned char* stage) {
    if (chunks == slc_threads || static_cast<int>(threadIdx.x) < chunks) {
#pragma unroll
      for (int s = 0; s < slc_slices; ++s) copy_async_16(stage + offset + s * slice_step, source + 32 * s, true);
      source += slc_row_block_bytes;
    }
    if (scale_source != nullptr) {
      copy_async_16(stage + scale_offset, scale_source, true);
      scale_source += scale_step;
    }
  }
};

// Every element of a register array (of any rank) set to zero, by fully unrolled loops.
template <class T>
__device__ inline void set_zero(T& value) {
  value = T(0);
}
template <class T, int N>
__device__ inline void set_zero(T (&values)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) set_zero(values[i]);
}

// One body (about 150 lines): the copy pipeline, the nine mma of each tile and K-block and the
// per-entry step share the stage indices and the accumulators held in registers.
// Exact: the `exact` model instead, as the integer kernel's exact mode: a running fp64 sum of the
// scaled block dots per entry, every addition checked (add_product_rounds); an entry whose sum rounded is
// marked in `flagged` for integer_fixup_kernel, the others' sums are exact (the fp64 result, and
// one rounding to fp32). WholeK (with Exact): the levels summed over all of K instead, and one
// exact step per entry at the end ("Whole K" above); nothing is flagged, and either output may be
// null (the exact reference of fp32 operands, reference-inl.cuh, may ask for one). Both (without Exact):
// fp32-block into `out` and, from the same block dots and scales, the exact model's sums as Exact
// leaves them, into exact_out, exact_out32 (rounded once to fp32) and `flagged` (the replay's
// exact_too product of the same operands, without a second pass). Unchecked (with Both): every row
// of both operands has one block exponent along K and K <= slc_whole_depth_limit, so each entry's
// scale 2^k is the same in every K-block and its running exact sum is 2^k times an integer below
// K / 32 * 32 2^18 2^18 <= 2^52: no addition can round, and each is one fma, unchecked.
template <bool Exact, bool WholeK = false, bool Both = false, bool Unchecked = false>
__global__ void __launch_bounds__(slc_threads, 2)
    sliced_block_kernel(const std::uint8_t* a, const double* a_scales, const std::uint8_t* b, const double* b_scales,
                        std::int64_t m, std::int64_t n, std::int64_t padded_m, std::int64_t padded_n,
                        std::int64_t blocks, std::int64_t tiles_m, std::int64_t tiles_n, output_rounding output,
                        float* out, double* exact_out, std::uint8_t* flagged, float* exact_out32) {
  using tiling = slc_tiling_of<Both>;
  constexpr int col_tiles = slc_warp_cols / 8;
  constexpr int row_tiles = tiling::warp_rows / 16;  // m16 tiles per warp
  using stage_type = slc_stage<tiling::tile_n>;
  MXSCOPE_DYNAMIC_SHARED(uint4, slc_shared);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group_id = lane / 4;
  const int thread_in_group = lane % 4;
  const int warp_m = warp / tiling::warps_n;  // tiling::warp_rows rows each
  const int warp_n = warp % tiling::warps_n;  // slc_warp_cols columns each
  const tile_origin origin = grouped_tile_origin(static_cast<int>(blockIdx.x), static_cast<int>(tiles_m),
                                                 static_cast<int>(tiles_n), slc_tile_m, tiling::tile_n);
  const int block_count = static_cast<int>(blocks);
  // ldmatrix row addresses as in tensor_core_block_kernel, within one slice.
  const int matrix = lane / 8;
  const int a_matrix_offset = tcb_opaque(tcb_offset(warp_m * tiling::warp_rows + (matrix % 2) * 8 + lane % 8, matrix / 2));
  const int b_matrix_offset = tcb_opaque(tcb_offset(warp_n * slc_warp_cols + (matrix / 2) * 8 + lane % 8, matrix % 2));
  const int row_base = warp_m * tiling::warp_rows + group_id;
  const int col_base = warp_n * slc_warp_cols + 2 * thread_in_group;

  static_assert(row_tiles * col_tiles * 4 <= 64, "one flag bit per entry of the thread");
  using accumulator_type = std::conditional_t<Exact, double, float>;
  accumulator_type accumulators[row_tiles][col_tiles][4];
  set_zero(accumulators);
  [[maybe_unused]] std::uint64_t rounded = 0;  // Exact, Both: bit (mi col_tiles + ni) 4 + e
  static_assert(!WholeK || Exact);
  static_assert(!(Both && Exact));
  static_assert(!Unchecked || Both);
  [[maybe_unused]] double exact_sums[Both ? row_tiles : 1][Both ? col_tiles : 1][4];  // Both
  if constexpr (Both) set_zero(exact_sums);
  [[maybe_unused]] int whole_levels[row_tiles][col_tiles][5][4];  // WholeK: each level over all of K
  if constexpr (WholeK) set_zero(whole_levels);

  slc_loader<tiling::tile_n> loader(a, a_scales, b, b_scales, blocks, padded_m, padded_n, origin.i0, origin.j0);
  unsigned char* const shared_bytes = reinterpret_cast<unsigned char*>(slc_shared);
#pragma unroll
  for (int s = 0; s < slc_stages - 1; ++s) {
    if (s < block_count) loader.load(shared_bytes + s * sizeof(stage_type));
    copy_async_commit();
  }
  int compute_stage = 0;
  int load_stage = slc_stages - 1;
  for (int kb = 0; kb < block_count; ++kb) {
    copy_async_wait<slc_stages - 2>();
    __syncthreads();
    if (kb + slc_stages - 1 < block_count) loader.load(shared_bytes + load_stage * sizeof(stage_type));
    copy_async_commit();
    load_stage = load_stage == slc_stages - 1 ? 0 : load_stage + 1;
    const stage_type& stage = *reinterpret_cast<const stage_type*>(shared_bytes + compute_stage * sizeof(stage_type));
    compute_stage = compute_stage == slc_stages - 1 ? 0 : compute_stage + 1;

    std::uint32_t b_fragments[slc_slices][col_tiles][2];
#pragma unroll
    for (int s = 0; s < slc_slices; ++s) {
#pragma unroll
      for (int p = 0; p < col_tiles / 2; ++p) {
        std::uint32_t r[4];
        load_matrix_x4(r, stage.b[s] + b_matrix_offset + 512 * p);
        b_fragments[s][2 * p][0] = r[0];
        b_fragments[s][2 * p][1] = r[1];
        b_fragments[s][2 * p + 1][0] = r[2];
        b_fragments[s][2 * p + 1][1] = r[3];
      }
    }
    [[maybe_unused]] double col_scales[col_tiles][2];
    if constexpr (!WholeK) {
#pragma unroll
      for (int ni = 0; ni < col_tiles; ++ni) {
        col_scales[ni][0] = stage.b_scales[col_base + ni * 8];
        col_scales[ni][1] = stage.b_scales[col_base + ni * 8 + 1];
      }
    }
#pragma unroll
    for (int mi = 0; mi < row_tiles; ++mi) {
      std::uint32_t a_fragments[slc_slices][4];
#pragma unroll
      for (int s = 0; s < slc_slices; ++s) load_matrix_x4(a_fragments[s], stage.a[s] + a_matrix_offset + 512 * mi);
      const auto& bf = b_fragments;
      if constexpr (WholeK) {
#pragma unroll
        for (int ni = 0; ni < col_tiles; ++ni) {
          slice_products<true>(whole_levels[mi][ni], a_fragments, bf[0][ni], bf[1][ni], bf[2][ni]);
        }
        continue;
      }
      const double row_scales[2] = {stage.a_scales[row_base + mi * 16], stage.a_scales[row_base + mi * 16 + 8]};
#pragma unroll
      for (int ni = 0; ni < col_tiles; ++ni) {
        int level[5][4];
        slice_products<false>(level, a_fragments, bf[0][ni], bf[1][ni], bf[2][ni]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const double dot = sliced_dot(level[0][e] + 128 * level[1][e],
                                        level[2][e] + 128 * level[3][e] + 16384 * level[4][e]);
          const double scale = row_scales[e / 2] * col_scales[ni][e % 2];
          if constexpr (Exact) {
            if (add_product_rounds(accumulators[mi][ni][e], dot, scale)) {
              rounded |= std::uint64_t{1} << ((mi * col_tiles + ni) * 4 + e);
            }
          } else {
            accumulators[mi][ni][e] = round_to_odd_step_by_sign(accumulators[mi][ni][e], dot, scale);
            if constexpr (Unchecked) {
              exact_sums[mi][ni][e] = fma_exact(dot, scale, exact_sums[mi][ni][e]);
            } else if constexpr (Both) {
              if (add_product_rounds(exact_sums[mi][ni][e], dot, scale)) {
                rounded |= std::uint64_t{1} << ((mi * col_tiles + ni) * 4 + e);
              }
            }
          }
        }
      }
    }
  }
  copy_async_wait<0>();

#pragma unroll
  for (int mi = 0; mi < row_tiles; ++mi) {
#pragma unroll
    for (int ni = 0; ni < col_tiles; ++ni) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const std::int64_t i = origin.i0 + row_base + mi * 16 + (e / 2) * 8;
        const std::int64_t j = origin.j0 + col_base + ni * 8 + e % 2;
        if (i >= m || j >= n) continue;
        if constexpr (WholeK) {
          const int levels[5] = {whole_levels[mi][ni][0][e], whole_levels[mi][ni][1][e], whole_levels[mi][ni][2][e],
                                 whole_levels[mi][ni][3][e], whole_levels[mi][ni][4][e]};
          // Every K-block's scale is the first one's (prepare_sliced_kernel's flags[1]).
          const double sum = sliced_levels_dot(levels) * (a_scales[i] * b_scales[j]) + 0.0;
          if (out != nullptr) out[i * n + j] = finish_output(static_cast<float>(sum), output);
          if (exact_out != nullptr) exact_out[i * n + j] = sum;
        } else if constexpr (Exact) {
          if ((rounded >> ((mi * col_tiles + ni) * 4 + e) & 1U) != 0) {
            flagged[i * n + j] = 1;
          } else {
            const double sum = accumulators[mi][ni][e] + 0.0;  // an exactly zero sum is +0
            out[i * n + j] = finish_output(static_cast<float>(sum), output);
            if (exact_out != nullptr) exact_out[i * n + j] = sum;
          }
        } else {
          out[i * n + j] = finish_output(accumulators[mi][ni][e] * 1.0f, output);
          if constexpr (Both) {
            if ((rounded >> ((mi * col_tiles + ni) * 4 + e) & 1U) != 0) {
              flagged[i * n + j] = 1;
            } else {
              const double sum = exact_sums[mi][ni][e] + 0.0;
              exact_out[i * n + j] = sum;
              exact_out32[i * n + j] = finish_output(static_cast<float>(sum), output_rounding::fp32);
            }
          }
        }
      }
    }
  }
}

#endif  // MXSCOPE_CUDA_TENSOR_CORES
