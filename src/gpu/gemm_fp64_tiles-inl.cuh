// Part of products.cu (included there, in order, inside namespace mxscope::gpu):
// the fp64 tensor-core tiles (plain operands, the exact reference per warp).
// -------------------------------------------------------------------------------------------
// Chunk dots of a 64 x 64 tile of C on the fp64 tensor cores (mma.sync m16n8k8 f64, DMMA), shared by
// the plain-operand kernel and the integer path below. The two operand tiles of a chunk (64 rows x
// 32 k) are staged in shared memory as doubles, [row][k] with a row stride of dot_stride doubles:
// the staging writes of a warp are 32 consecutive k of one row, and the fragment reads of a warp
// (8 rows x 4 k) touch every 8-byte bank pair exactly twice (stride = 4 mod 16), both the minimum.
//
// Thread layout: 8 warps as 2 (M) x 4 (N), 32 x 16 entries per warp, 4 x 4 per thread. Entry (r, c)
// of a thread is row dot_row(r) = 32 (warp / 4) + 8 r + lane / 4 and column dot_col(c) = 16 (warp % 4)
// + 8 (c / 2) + 2 (lane % 4) + c % 2 of the tile: element 2 (r % 2) + c % 2 of the accumulator
// fragment of the mma of row pair r / 2 and column group c / 2.
//
// Exactness in any order: the callers only use a chunk dot whose every partial sum, over any
// subset of its products, is a double (the plain kernel's spread budget; the integer path's
// integers below 2^53), so each of the mma's additions is exact and the dot is the same value in
// whatever order the tensor core adds. Without DMMA (HIP) the same entries are chains of FMAs.
constexpr int dot_stride = 36;
constexpr int dot_threads = 256;
// Thread blocks per multiprocessor the register allocation of the two kernels aims at (a build
// option for measuring: 2 halves their registers, with spills).
#if defined(MXSCOPE_DOT_MIN_BLOCKS)
constexpr int dot_min_blocks = MXSCOPE_DOT_MIN_BLOCKS;
#else
constexpr int dot_min_blocks = 1;
#endif

__device__ inline int dot_row(int r) {
  return 32 * (static_cast<int>(threadIdx.x) / 128) + 8 * r + (static_cast<int>(threadIdx.x) % 32) / 4;
}
__device__ inline int dot_col(int c) {
  return 16 * ((static_cast<int>(threadIdx.x) / 32) % 4) + 8 * (c / 2) + 2 * (static_cast<int>(threadIdx.x) % 4) +
         c % 2;
}

#if defined(MXSCOPE_GPU_SIMULATE)
inline void mma_f64(double& d0, double& d1, double& d2, double& d3, const double (&a)[4], const double (&b)[2]) {
  double d[4];
  const double c[4] = {d0, d1, d2, d3};
  simulation::mma_f64(d, a, b, c);
  d0 = d[0];
  d1 = d[1];
  d2 = d[2];
  d3 = d[3];
}
#elif defined(MXSCOPE_CUDA_TENSOR_CORES)
// D = A B + D on a 16 x 8 x 8 tile (m16n8k8 f64, sm_90: twice the rate of m8n8k4, which runs at
// half the fp64 tensor-core peak on the H200; tools/bench/dmma-shapes.cu), fragment layout as
// spelled out in simulation.hpp (mma_f64).
__device__ inline void mma_f64(double& d0, double& d1, double& d2, double& d3, const double (&a)[4],
                               const double (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+d"(d0), "+d"(d1), "+d"(d2), "+d"(d3)
      : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
}
#endif

// dots[r][c] += the chunk's 32 products of row dot_row(r) of a_tile and row dot_col(c) of b_tile.
template <class Tile, class Dot>
__device__ inline void tile_dots(const Tile* a_tile, const Tile* b_tile, Dot (&dots)[4][4]) {
#if defined(MXSCOPE_CUDA_TENSOR_CORES)
  constexpr bool tensor_cores = std::is_same_v<Tile, double> && std::is_same_v<Dot, double>;
#else
  constexpr bool tensor_cores = false;
#endif
  if constexpr (tensor_cores) {
#if defined(MXSCOPE_CUDA_TENSOR_CORES)
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int warp = static_cast<int>(threadIdx.x) / 32;
    const double* a_base = a_tile + (32 * (warp / 4) + lane / 4) * dot_stride + lane % 4;
    const double* b_base = b_tile + (16 * (warp % 4) + lane / 4) * dot_stride + lane % 4;
    // Per 8 k: B fragment q holds columns 8 q + lane / 4 (entries c = 2 q, 2 q + 1 of each row);
    // the A fragment of row pair p holds rows 16 p + lane / 4 and + 8 (entries r = 2 p, 2 p + 1).
#pragma unroll
    for (int kk = 0; kk < 32; kk += 8) {
      double bv[2][2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
#pragma unroll
        for (int v = 0; v < 2; ++v) bv[q][v] = b_base[8 * q * dot_stride + kk + 4 * v];
      }
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        double av[4];
#pragma unroll
        for (int v = 0; v < 4; ++v) av[v] = a_base[8 * (2 * p + v % 2) * dot_stride + kk + 4 * (v / 2)];
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          mma_f64(dots[2 * p][2 * q], dots[2 * p][2 * q + 1], dots[2 * p + 1][2 * q], dots[2 * p + 1][2 * q + 1], av,
                  bv[q]);
        }
      }
    }
#endif
  } else {
    int rows[4], cols[4];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      rows[s] = dot_row(s) * dot_stride;
      cols[s] = dot_col(s) * dot_stride;
    }
#pragma unroll 4
    for (int kk = 0; kk < 32; ++kk) {
      Dot av[4], bv[4];
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        av[s] = static_cast<Dot>(a_tile[rows[s] + kk]);
        bv[s] = static_cast<Dot>(b_tile[cols[s] + kk]);
      }
#pragma unroll
      for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          if constexpr (std::is_same_v<Dot, double>) {
            dots[r][c] = fma_exact(av[r], bv[c], dots[r][c]);
          } else {
            dots[r][c] += av[r] * bv[c];
          }
        }
      }
    }
  }
}

// The chunk staging of both kernels: the next chunk's values are loaded into registers (value e of
// a thread: row threadIdx.x / 32 + 8 e, k threadIdx.x % 32 of the two 64-row tiles; consecutive
// threads, consecutive k: coalesced) while the tensor cores work on the current one, then stored
// into the [row][k] tiles. Values past `length` or past the last row are zeros. The addresses are
// one pointer per operand stepped by 8 rows, the bounds one count per operand, and the tile
// offsets constants from one base: the loop's own arithmetic, not per-value 64-bit index maths.
constexpr int dot_loads = dot_tile * dot_chunk / dot_threads;
constexpr int dot_load_rows = dot_threads / dot_chunk;  // rows between a thread's values (8)

template <class T>
struct dot_chunk_values {
  T a[dot_loads];
  T b[dot_loads];

  // Rows i0.. of a [m, depth] and j0.. of b [n, depth], columns k0 .. k0 + length - 1.
  __device__ void load(const T* a_rows, const T* b_rows, std::int64_t i0, std::int64_t j0, std::int64_t m,
                       std::int64_t n, std::int64_t depth, std::int64_t k0, std::int64_t length) {
    const int row = static_cast<int>(threadIdx.x) / dot_chunk;
    const int kk = static_cast<int>(threadIdx.x) % dot_chunk;
    // Rows of each operand at and after this thread's first one (0 outside the chunk's columns).
    const auto count = [&](std::int64_t rows_left) {
      return kk >= length || rows_left <= 0 ? 0 : rows_left >= dot_tile ? dot_tile : static_cast<int>(rows_left);
    };
    const int a_count = count(m - i0 - row);
    const int b_count = count(n - j0 - row);
    const std::int64_t step = dot_load_rows * depth;
    const T* a_next = a_rows + (i0 + row) * depth + k0 + kk;
    const T* b_next = b_rows + (j0 + row) * depth + k0 + kk;
#pragma unroll
    for (int e = 0; e < dot_loads; ++e) {
      a[e] = dot_load_rows * e < a_count ? *a_next : T{0};
      b[e] = dot_load_rows * e < b_count ? *b_next : T{0};
      a_next += step;
      b_next += step;
    }
  }

  template <class Tile>
  __device__ void store(Tile* a_tile, Tile* b_tile) const {
    const int base = (static_cast<int>(threadIdx.x) / dot_chunk) * dot_stride + static_cast<int>(threadIdx.x) % dot_chunk;
#pragma unroll
    for (int e = 0; e < dot_loads; ++e) {
      a_tile[base + dot_load_rows * dot_stride * e] = static_cast<Tile>(a[e]);
      b_tile[base + dot_load_rows * dot_stride * e] = static_cast<Tile>(b[e]);
    }
  }
};

// The type a chunk is staged in: doubles for DMMA where every block dot is below 2^53 (int32 and
// double dots), else the block dot's own type (FMA or integer chains).
#if defined(MXSCOPE_CUDA_TENSOR_CORES)
template <class Dot>
using dot_tile_t = std::conditional_t<std::is_same_v<Dot, long long>, long long, double>;
#else
template <class Dot>
using dot_tile_t = Dot;
#endif

// sum += value (a multiple of 2^base, inside the window) as an integer in units of 2^base.
__device__ inline void add_in_units(core_ns::int128& sum, double value, int base) {
  if (value == 0.0) return;
  const core_ns::double_parts parts = core_ns::decompose(value);
  const int shift = parts.exponent - base;  // below 0 only where the low significand bits are zero
  const core_ns::uint128 magnitude = shift >= 0 ? static_cast<core_ns::uint128>(parts.significand) << shift
                                                : static_cast<core_ns::uint128>(parts.significand >> -shift);
  sum += parts.negative ? -static_cast<core_ns::int128>(magnitude) : static_cast<core_ns::int128>(magnitude);
}

// add_in_units by exact fp64 steps instead of a 128-bit shift (reference_warp_kernel): the window
// keeps |value| 2^-base an integer below 2^127, and base (the sum of two fp32 lowest set-bit
// exponents) between -298 and 254, so the scaling by 2^-base (a normal double), the high half
// trunc(t 2^-64) and the low half t - high 2^64 (the bits of t below 2^64, at most 53 of them) are
// exact, and so are the conversions of the two halves to 64-bit integers. No branches. The same
// integer as add_in_units, which the other callers keep because this form made ptxas spill more
// there (BENCHMARKS.md, "Tuning notes").
__device__ inline void add_in_units_by_halves(core_ns::int128& sum, double value, int base) {
  const double scaled = fabs(value) * core_ns::bits_double(static_cast<std::uint64_t>(1023 - base) << 52);
  const double high = trunc(scaled * 0x1p-64);
  const double low = fma(-high, 0x1p64, scaled);
  // A negative value adds the magnitude's two's complement, (magnitude ^ all ones) + 1: the sign
  // bit spread over a word (all ones or zero) in place of a negation and a select per word.
  const std::uint64_t sign = static_cast<std::uint64_t>(static_cast<std::int64_t>(core_ns::double_bits(value)) >> 63);
  const core_ns::uint128 flipped =
      (static_cast<core_ns::uint128>(static_cast<std::uint64_t>(high) ^ sign) << 64) |
      (static_cast<std::uint64_t>(low) ^ sign);
  sum = static_cast<core_ns::int128>(static_cast<core_ns::uint128>(sum) + flipped + (sign & 1U));
}

// The exact sum of a chunk's products (column kk of both shared-memory tiles, `stride` apart), in
// units of 2^base: the per-product path of a chunk whose fp64 sum might round.
__device__ __noinline__ core_ns::int128 chunk_products_in_units(const double* a_column, const double* b_column,
                                                                int stride, int base) {
  core_ns::int128 sum = 0;
  for (int kk = 0; kk < plain_chunk; ++kk) add_in_units(sum, a_column[kk * stride] * b_column[kk * stride], base);
  return sum;
}

// chunk_products_in_units by add_in_units_by_halves, for the warp-tile kernels (reference_warp_kernel,
// block_warp_kernel), whose entries' windows it requires (plain_fits): no branches, no variable
// 128-bit shifts.
__device__ __noinline__ core_ns::int128 chunk_products_by_halves(const double* a_column, const double* b_column,
                                                                 int base) {
  core_ns::int128 sum = 0;
#pragma unroll 4
  for (int kk = 0; kk < plain_chunk; ++kk) add_in_units_by_halves(sum, a_column[kk] * b_column[kk], base);
  return sum;
}

// fl32(accumulator + sum * 2^base), exact sum rounded once: the sum goes to add_exactly_to_float
// as three doubles of 42 bits each (|sum| < 2^126), all exact.
__device__ __noinline__ float add_units_to_float(float accumulator, core_ns::int128 sum, int base) {
  if (!is_finite(accumulator)) return nonfinite_step(accumulator, 0.0);
  const bool negative = sum < 0;
  const core_ns::uint128 magnitude = negative ? -static_cast<core_ns::uint128>(sum) : static_cast<core_ns::uint128>(sum);
  constexpr std::uint64_t piece_mask = (std::uint64_t{1} << 42) - 1U;
  double terms[3];
  for (int t = 0; t < 3; ++t) {
    const auto piece = static_cast<std::uint64_t>(magnitude >> (42 * t)) & piece_mask;
    const double value = static_cast<double>(piece) * core_ns::pow2(base + 42 * t);
    terms[t] = negative ? -value : value;
  }
  return core_ns::add_exactly_to_float(accumulator, terms, 3);
}

// add_exact_value for a finite exact dot, inline: fl32(accumulator + dot) rounded once (core
// add_to_float), an exactly zero sum +0; an infinite accumulator stays (acc + dot).
__device__ inline float add_exact_dot(float accumulator, double dot) {
  if (!is_finite(accumulator)) return nonfinite_step(accumulator, dot);
  return core_ns::add_to_float(accumulator, dot + 0.0);
}

#if defined(MXSCOPE_CUDA_TENSOR_CORES)
// running += dot scale (an exact product); true when the addition rounded: its round-down and
// round-up differ exactly then (the simulation: TwoSum, add_rounds). Where it did not round,
// running is the exact sum (an exact zero may be -0: callers add +0.0 before using it); where it
// did, a neighbour of it that the callers discard.
__device__ inline bool add_product_rounds(double& running, double dot, double scale) {
#if defined(MXSCOPE_GPU_SIMULATE)
  return add_rounds(running, dot * scale);
#else
  // Where the two agree the addition is exact and either is the sum; where they differ the
  // caller discards the sum (flagged entries, the per-product fallback), so the round-down serves
  // as the running value and no third fma is needed.
  const double down = __fma_rd(dot, scale, running);
  const double up = __fma_ru(dot, scale, running);
  running = down;
  return down != up;
#endif
}

// The sum of a chunk's 32 products (column kk of both shared-memory tiles) in fp64, in ascending
// k, and whether it is exact: every addition is checked (add_product_rounds), so where none
// rounded `dot` is the chunk's exact dot. The warp-tile kernels' per-product path tries this
// first: the spread budget is a worst case, so a chunk over it may still sum exactly, in fewer
// instructions than the 128-bit walk (chunk_products_by_halves), which stays the fallback.
__device__ __noinline__ bool chunk_products_exactly(const double* a_column, const double* b_column, double& dot) {
  double sum = 0.0;
  bool rounded = false;
#pragma unroll 8
  for (int kk = 0; kk < plain_chunk; ++kk) rounded |= add_product_rounds(sum, a_column[kk], b_column[kk]);
  dot = sum + 0.0;  // an exactly zero sum is +0, as the tensor cores' dots
  return !rounded;
}

// fl32(acc + dot scale) for a finite dot whose product with `scale` is exact, without a branch
// (the block-warp kernel's step). The sum is taken to fp64 in round-to-odd: its round-down and
// round-up (two fmas of the exact dot scale + acc) give it by core::round_to_odd_from_neighbours
// (the odd one of the two: a bit test and a select). An exact zero sum is +0 (the round-up), as
// round to nearest gives for the callers' dots, which are never -0 (their sums start at +0).
// 53 >= 24 + 2 bits make the conversion to fp32 (round to nearest even) the correctly rounded sum
// (core::add_to_float's argument, Boldo & Melquiond), for ties, subnormal and overflowing sums
// alike; an infinite acc gives itself. Where core::add_to_float's midpoint test would take its
// slow path (exact fp32 ties, common with quantized operands) this costs the same. The
// simulation takes the two neighbours from the TwoSum of the sum.
__device__ inline float round_to_odd_step(float accumulator, double dot, double scale) {
#if defined(MXSCOPE_GPU_SIMULATE)
  if (!is_finite(accumulator)) return accumulator;  // what the fmas below give (two_sum needs finite values)
  // The two directed roundings from the round-to-nearest sum and the sign of its error.
  const core_ns::sum_and_error se = core_ns::two_sum(static_cast<double>(accumulator), dot * scale);
  const double infinity = std::numeric_limits<double>::infinity();
  const double down = se.error < 0.0 ? std::nextafter(se.sum, -infinity) : se.sum;
  const double up = se.error > 0.0 ? std::nextafter(se.sum, infinity) : se.sum;
  return static_cast<float>(core_ns::round_to_odd_from_neighbours(down, up));
#else
  const double down = __fma_rd(dot, scale, static_cast<double>(accumulator));
  const double up = __fma_ru(dot, scale, static_cast<double>(accumulator));
  return static_cast<float>(core_ns::round_to_odd_from_neighbours(down, up));
#endif
}

// round_to_odd_step's result with the odd neighbour found as the one of the two nearer zero, its
// last bit set where they differ (two fp64 compares and three selects against one bit test and
// two selects): the sliced kernel's step, where it runs faster than the bit test
// (BENCHMARKS.md, "The fp32-block step's odd neighbour").
__device__ inline float round_to_odd_step_by_sign(float accumulator, double dot, double scale) {
#if defined(MXSCOPE_GPU_SIMULATE)
  if (!is_finite(accumulator)) return accumulator;
  return static_cast<float>(core_ns::round_to_odd_sum(static_cast<double>(accumulator), dot * scale));
#else
  const double down = __fma_rd(dot, scale, static_cast<double>(accumulator));
  const double up = __fma_ru(dot, scale, static_cast<double>(accumulator));
  const std::uint64_t toward_zero = core_ns::double_bits(down > 0.0 ? down : up);
  return static_cast<float>(core_ns::bits_double(toward_zero | (down != up ? 1U : 0U)));
#endif
}
#endif  // MXSCOPE_CUDA_TENSOR_CORES

// What the exact reference multiplies its exact sums by before the one rounding: nothing (the
// reference of unscaled operands), or the tensor scales' exact product sa sb (core::
// add_scaled_exactly; the exact model of NVFP4 operands given as their block-scaled values, which
// must then be finite).
struct reference_scaling {
  bool scaled = false;
  core_ns::tensor_scale_product scale{};
};

// round_units of the sum times the tensor scales' exact product (reference_scaling): the sum in
// three pieces of 42 bits, each an exact double, times sa sb into one long accumulator, rounded once.
__device__ __noinline__ void round_units_scaled(core_ns::int128 sum, int base, const core_ns::tensor_scale_product& scale,
                                                double& out64, float& out32) {
  const bool negative = sum < 0;
  const core_ns::uint128 magnitude = negative ? -static_cast<core_ns::uint128>(sum) : static_cast<core_ns::uint128>(sum);
  core_ns::long_accumulator total;
  constexpr std::uint64_t piece_mask = (std::uint64_t{1} << 42) - 1U;
  for (int t = 0; t < 3; ++t) {
    const auto piece = static_cast<std::uint64_t>(magnitude >> (42 * t)) & piece_mask;
    if (piece == 0) continue;
    const double value = static_cast<double>(piece) * core_ns::pow2(base + 42 * t);
    core_ns::add_scaled_exactly(total, negative ? -value : value, scale);
  }
  out64 = round_total_to_double(total);
  out32 = round_total_to_float(total);
}

__device__ __noinline__ void round_units(core_ns::int128 sum, int base, double& out64, float& out32) {
  const bool negative = sum < 0;
  const core_ns::uint128 magnitude = negative ? -static_cast<core_ns::uint128>(sum) : static_cast<core_ns::uint128>(sum);
  out64 = core_ns::round_scaled_integer(magnitude, negative, base, core_ns::binary64, false);
  out32 = static_cast<float>(core_ns::round_scaled_integer(magnitude, negative, base, core_ns::binary32, false));
}

// The spread of values with lowest set-bit exponent `low` and leading exponent `high`, clamped to
// 127 (also for the nonfinite marker); plain_empty_spread for the empty marker.
__device__ inline std::int8_t plain_spread_of(int low, int high) {
  if (high == plain_empty_high) return plain_empty_spread;
  if (high == plain_nonfinite_high) return 127;
  return static_cast<std::int8_t>(high - low > 127 ? 127 : high - low);
}

// Per (chunk, row) of a canonical operand [rows, depth]: the spread of the chunk (clamped to 127;
// plain_empty_spread without nonzero finite values) and its lo and hi for the row pass.
__global__ void plain_chunks_kernel(const float* values, std::int64_t rows, std::int64_t depth, std::int64_t chunks,
                                    std::int8_t* spreads, std::int32_t* lows, std::int32_t* highs) {
  const bool vectors = depth % 4 == 0 && reinterpret_cast<std::uintptr_t>(values) % 16 == 0;
  MXSCOPE_GRID_LOOP(t, chunks * rows) {
    const std::int64_t chunk = t / rows;
    const std::int64_t row = t % rows;
    const std::int64_t k0 = chunk * plain_chunk;
    const std::int64_t end = depth - k0 < plain_chunk ? depth : k0 + plain_chunk;
    int low = std::numeric_limits<int>::max();
    int high = plain_empty_high;
    bool nonfinite = false;
    const auto visit = [&](float value) {
      const std::uint32_t bits = core_ns::float_bits(value);
      const int field = static_cast<int>((bits >> 23) & 0xffU);
      if (field == 0xff) {
        nonfinite = true;
        return;
      }
      const std::uint32_t significand = field == 0 ? (bits & 0x7fffffU) : ((bits & 0x7fffffU) | 0x800000U);
      if (significand == 0) return;
      const int unit = field == 0 ? -149 : field - 150;  // value = significand * 2^unit
      const int leading = unit + 31 - __builtin_clz(significand);
      const int lowest = unit + 31 - __builtin_clz(significand & (0U - significand));
      if (leading > high) high = leading;
      if (lowest < low) low = lowest;
    };
    if (vectors) {
      // Rows of a multiple of 4 values from a 16-byte aligned start: a chunk is (end - k0) / 4
      // float4 (one load each instead of four: the threads of a warp read 32 different rows).
      const float4* row_values = reinterpret_cast<const float4*>(values + row * depth + k0);
      for (std::int64_t q = 0; q < (end - k0) / 4; ++q) {
        const float4 v = row_values[q];
        visit(v.x);
        visit(v.y);
        visit(v.z);
        visit(v.w);
      }
    } else {
      for (std::int64_t k = k0; k < end; ++k) visit(values[row * depth + k]);
    }
    if (nonfinite) {
      low = 0;
      high = plain_nonfinite_high;
    }
    spreads[t] = plain_spread_of(low, high);
    lows[t] = low;
    highs[t] = high;
  }
}

// Per (group, row): the spread over `group` consecutive chunks (plain_super_chunks or
// plain_half_chunks), from their lo and hi (as plain_chunks_kernel: 127 with inf or NaN,
// plain_empty_spread without nonzero values).
__global__ void plain_supers_kernel(const std::int32_t* chunk_lows, const std::int32_t* chunk_highs,
                                    std::int64_t rows, std::int64_t chunks, int group, std::int8_t* spreads) {
  const std::int64_t supers = (chunks + group - 1) / group;
  MXSCOPE_GRID_LOOP(t, supers * rows) {
    const std::int64_t super = t / rows;
    const std::int64_t row = t % rows;
    const std::int64_t first = super * group;
    const std::int64_t end = chunks - first < group ? chunks : first + group;
    int low = std::numeric_limits<int>::max();
    int high = plain_empty_high;
    for (std::int64_t c = first; c < end; ++c) {
      const int chunk_low = chunk_lows[c * rows + row];
      const int chunk_high = chunk_highs[c * rows + row];
      if (chunk_low < low) low = chunk_low;
      if (chunk_high > high) high = chunk_high;
    }
    spreads[t] = plain_spread_of(low, high);
  }
}

// Per row: lo and hi over its chunks (0 and plain_empty_high for a row of zeros; the nonfinite
// marker wins).
__global__ void plain_rows_kernel(const std::int32_t* chunk_lows, const std::int32_t* chunk_highs, std::int64_t rows,
                                  std::int64_t chunks, std::int32_t* lows, std::int32_t* highs) {
  MXSCOPE_GRID_LOOP(row, rows) {
    int low = std::numeric_limits<int>::max();
    int high = plain_empty_high;
    for (std::int64_t c = 0; c < chunks; ++c) {
      const int chunk_low = chunk_lows[c * rows + row];
      const int chunk_high = chunk_highs[c * rows + row];
      if (chunk_low < low) low = chunk_low;
      if (chunk_high > high) high = chunk_high;
    }
    lows[row] = high == plain_empty_high || high == plain_nonfinite_high ? 0 : low;
    highs[row] = high;
  }
}

// One 64 x 64 tile of C per thread block of 256 threads, 4 x 4 entries per thread (the DMMA
// layout above: dot_row, dot_col). Per chunk of 32 k the two operand tiles are staged in shared
// memory as doubles (the next chunk's values are loaded into registers while the tensor cores
// work on this one), tile_dots sums the 16 chunk dots, then every thread runs the model step of
// each of its entries.
template <plain_mode Mode, bool Scaled = false>
// One body (about 190 lines): the tile loads, the fp64 dots and the per-model step of every entry
// share the tile's fragments and accumulators held in registers.
__global__ void __launch_bounds__(dot_threads, dot_min_blocks)
    plain_tile_kernel(const float* a, const float* b, const std::int8_t* a_spreads, const std::int8_t* b_spreads,
                      const std::int8_t* a_super_spreads, const std::int8_t* b_super_spreads,
                      plain_rows_view a_rows, plain_rows_view b_rows, std::int64_t m, std::int64_t n,
                      std::int64_t depth, int depth_bits, std::int64_t chunks_per_group, output_rounding output,
                      float* out32, double* out64, core_ns::tensor_scale_product scale) {
  __shared__ double a_tile[plain_tile * dot_stride];
  __shared__ double b_tile[plain_tile * dot_stride];
  __shared__ int a_spread_tile[plain_tile];
  __shared__ int b_spread_tile[plain_tile];
  [[maybe_unused]] __shared__ int a_super_tile[plain_tile];
  [[maybe_unused]] __shared__ int b_super_tile[plain_tile];
  constexpr bool supers = Mode == plain_mode::exact;
  const std::int64_t i0 = static_cast<std::int64_t>(blockIdx.y) * plain_tile;
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * plain_tile;
  const std::int64_t chunks = (depth + plain_chunk - 1) / plain_chunk;

  int a_low[plain_side], a_high[plain_side], b_low[plain_side], b_high[plain_side];
#pragma unroll
  for (int s = 0; s < plain_side; ++s) {
    const std::int64_t i = i0 + dot_row(s);
    const std::int64_t j = j0 + dot_col(s);
    a_low[s] = i < m ? a_rows.low[i] : 0;
    a_high[s] = i < m ? a_rows.high[i] : plain_nonfinite_high;
    b_low[s] = j < n ? b_rows.low[j] : 0;
    b_high[s] = j < n ? b_rows.high[j] : plain_nonfinite_high;
  }
  bool active[plain_side][plain_side];
  unsigned active_bits = 0;  // bit r plain_side + c: entry (r, c) is computed here
  [[maybe_unused]] core_ns::int128 sums[plain_side][plain_side];
  [[maybe_unused]] float accumulators[plain_side][plain_side];
#pragma unroll
  for (int r = 0; r < plain_side; ++r) {
#pragma unroll
    for (int c = 0; c < plain_side; ++c) {
      active[r][c] = plain_fits(a_low[r], a_high[r], b_low[c], b_high[c], depth_bits);
      if (active[r][c]) active_bits |= 1U << (r * plain_side + c);
      sums[r][c] = 0;
      accumulators[r][c] = 0.0f;
    }
  }

  // Threads 0-63 fetch the chunk spreads of the tile's A rows, 64-127 those of its B rows; in exact
  // mode threads 128-255 likewise the super-chunk spreads at the first chunk of each super-chunk.
  dot_chunk_values<float> next;
  int spread_next = plain_empty_spread;
  const auto fetch = [&](std::int64_t chunk) {
    const std::int64_t k0 = chunk * plain_chunk;
    next.load(a, b, i0, j0, m, n, depth, k0, depth - k0 < plain_chunk ? depth - k0 : plain_chunk);
    const int role = static_cast<int>(threadIdx.x) / plain_tile;
    const int row = static_cast<int>(threadIdx.x) % plain_tile;
    const std::int64_t i = (role % 2 == 0 ? i0 : j0) + row;
    const std::int64_t rows = role % 2 == 0 ? m : n;
    if (role < 2) {
      spread_next = i < rows ? (role == 0 ? a_spreads : b_spreads)[chunk * rows + i] : plain_empty_spread;
    } else if (supers && chunk % plain_super_chunks == 0) {
      const std::int64_t super = chunk / plain_super_chunks;
      spread_next = i < rows ? (role == 2 ? a_super_spreads : b_super_spreads)[super * rows + i] : plain_empty_spread;
    }
  };
  if (chunks > 0) fetch(0);

  // The tensor-core dots: zero at every chunk; in exact mode zero at the start and reset by each
  // entry's step, after every chunk except for the entries in `fused`, which keep summing until
  // the end of their super-chunk. (Not by resetting all 16 at the first chunk of each super-chunk:
  // nvcc 13.0 for sm_90a miscompiled that form; BENCHMARKS.md, "Tuning notes".)
  double dots[plain_side][plain_side];
#pragma unroll
  for (int r = 0; r < plain_side; ++r) {
#pragma unroll
    for (int c = 0; c < plain_side; ++c) dots[r][c] = 0.0;
  }
  unsigned fused = 0;

  for (std::int64_t chunk = 0; chunk < chunks; ++chunk) {
    next.store(a_tile, b_tile);
    const int role = static_cast<int>(threadIdx.x) / plain_tile;
    if (role < 2 || (supers && chunk % plain_super_chunks == 0)) {
      int* const tile = role == 0 ? a_spread_tile : role == 1 ? b_spread_tile : role == 2 ? a_super_tile : b_super_tile;
      tile[threadIdx.x % plain_tile] = spread_next;
    }
    __syncthreads();
    if (chunk + 1 < chunks) fetch(chunk + 1);
    if (supers && chunk % plain_super_chunks == 0) {
      fused = 0;
#pragma unroll
      for (int r = 0; r < plain_side; ++r) {
#pragma unroll
        for (int c = 0; c < plain_side; ++c) {
          if (active[r][c] && a_super_tile[dot_row(r)] + b_super_tile[dot_col(c)] <= plain_super_budget) {
            fused |= 1U << (r * plain_side + c);
          }
        }
      }
    }
    const bool super_end = (chunk + 1) % plain_super_chunks == 0 || chunk + 1 == chunks;
    if (!supers) {
#pragma unroll
      for (int r = 0; r < plain_side; ++r) {
#pragma unroll
        for (int c = 0; c < plain_side; ++c) dots[r][c] = 0.0;
      }
    }
    tile_dots(a_tile, b_tile, dots);

    // The chunk's step for every entry whose fp64 dot is exact; the others (rare for bf16 values)
    // are marked and take the per-product path below, out of the hot loop. A fused entry steps
    // once, at the end of its super-chunk (in most chunks of exact mode nothing is left to do).
    if (!supers || super_end || (active_bits & ~fused) != 0) {
      unsigned per_product = 0;
#pragma unroll
      for (int r = 0; r < plain_side; ++r) {
#pragma unroll
        for (int c = 0; c < plain_side; ++c) {
          if (!active[r][c]) continue;
          if ((fused & (1U << (r * plain_side + c))) != 0) {
            if (super_end) {
              add_in_units(sums[r][c], dots[r][c], a_low[r] + b_low[c]);
              dots[r][c] = 0.0;
            }
            continue;
          }
          const double dot = dots[r][c];
          dots[r][c] = 0.0;
          if (a_spread_tile[dot_row(r)] + b_spread_tile[dot_col(c)] > plain_chunk_budget) {
            per_product |= 1U << (r * plain_side + c);
          } else if constexpr (Mode == plain_mode::block) {
            accumulators[r][c] = add_exact_dot(accumulators[r][c], dot);
          } else {
            add_in_units(sums[r][c], dot, a_low[r] + b_low[c]);
          }
        }
      }
      if (per_product != 0) {
#pragma unroll
        for (int r = 0; r < plain_side; ++r) {
#pragma unroll
          for (int c = 0; c < plain_side; ++c) {
            if ((per_product & (1U << (r * plain_side + c))) == 0) continue;
            const int base = a_low[r] + b_low[c];
            const core_ns::int128 products =
                chunk_products_in_units(a_tile + dot_row(r) * dot_stride, b_tile + dot_col(c) * dot_stride, 1, base);
            if constexpr (Mode == plain_mode::block) {
              accumulators[r][c] = add_units_to_float(accumulators[r][c], products, base);
            } else {
              sums[r][c] += products;
            }
          }
        }
      }
    }
    if (Mode == plain_mode::group && ((chunk + 1) % chunks_per_group == 0 || chunk + 1 == chunks)) {
#pragma unroll
      for (int r = 0; r < plain_side; ++r) {
#pragma unroll
        for (int c = 0; c < plain_side; ++c) {
          if (!active[r][c]) continue;
          accumulators[r][c] = add_units_to_float(accumulators[r][c], sums[r][c], a_low[r] + b_low[c]);
          sums[r][c] = 0;
        }
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < plain_side; ++r) {
#pragma unroll
    for (int c = 0; c < plain_side; ++c) {
      if (!active[r][c]) continue;
      const std::int64_t entry = (i0 + dot_row(r)) * n + j0 + dot_col(c);
      if constexpr (Mode == plain_mode::exact) {
        double value64 = 0.0;
        float value32 = 0.0f;
        if constexpr (Scaled) {
          round_units_scaled(sums[r][c], a_low[r] + b_low[c], scale, value64, value32);
        } else {
          round_units(sums[r][c], a_low[r] + b_low[c], value64, value32);
        }
        if (out64 != nullptr) out64[entry] = value64;
        if (out32 != nullptr) out32[entry] = value32;
      } else {
        out32[entry] = finish_output(accumulators[r][c] * 1.0f, output);  // epilogue: alpha = 1
      }
    }
  }
}

#if defined(MXSCOPE_CUDA_TENSOR_CORES)
// -------------------------------------------------------------------------------------------
// The exact reference on 32 x 32 entries per warp (CUDA tensor-core builds; HIP keeps
// plain_tile_kernel). The same 64 x 64 tile, chunks, spreads, super-chunks and steps as
// plain_tile_kernel's exact mode, but 4 warps of 32 x 32 entries (each A fragment feeds four mmas,
// each B fragment two: half the shared-memory bytes per product of the 32 x 16 warp tiles), and
// the entries' 128-bit sums and the rows' lowest exponents in shared memory (the sums change at
// most once per chunk, mostly once per super-chunk), so that the registers hold the 64 dots and
// two thread blocks fit a multiprocessor. The operands come in chunk tiles (chunk_tiles_kernel):
// a thread stages fixed float4 slots without bounds checks, A's through cp.async into shared
// memory. The steps convert a dot to the 128-bit sum by fp64 halves (add_in_units_by_halves).
// (How this layout compares with plain_tile_kernel's: BENCHMARKS.md, "Tuning notes".)
//
// Entry (r, c) of a thread (r < 4, c < 8): row rw_row(r) = 32 (warp / 2) + 8 r + lane / 4, column
// rw_col(c) = 32 (warp % 2) + 8 (c / 2) + 2 (lane % 4) + c % 2: element 2 (r % 2) + c % 2 of the
// accumulator fragment of the mma of row pair r / 2 and column group c / 2. Its sum lives at
// rw_sums[(r rw_cols + c) rw_threads + threadIdx.x] (a warp's 32 sums are 512 consecutive bytes).
constexpr int rw_threads = 128;
// Threads 0-63 fill the tile's shared A-row values (spreads, lows), 64-127 the B rows', at index
// threadIdx.x % plain_tile: in bounds, and every entry written once, only for this block size.
static_assert(rw_threads == 2 * plain_tile, "reference_warp_kernel: one thread per A row and per B row of the tile");
constexpr int rw_rows = 4;
constexpr int rw_cols = 8;
constexpr std::size_t rw_tiles_bytes = 2 * plain_tile * dot_stride * sizeof(double);
constexpr std::size_t rw_sums_bytes = rw_rows * rw_cols * rw_threads * sizeof(core_ns::int128);
constexpr std::size_t rw_stage_bytes = plain_tile * plain_chunk * sizeof(float);  // A's next chunk, as read
constexpr std::size_t rw_shared_bytes = rw_tiles_bytes + rw_sums_bytes + rw_stage_bytes;

// Asynchronous 16- and 4-byte copies from global to shared memory (cp.async; zeros where
// `inside` is false), and their commit and wait.
#if defined(MXSCOPE_GPU_SIMULATE)
inline void copy_async_16(void* shared_destination, const void* global_source, bool inside) {
  simulation::copy_async(shared_destination, global_source, 16, inside);
}
inline void copy_async_4(void* shared_destination, const void* global_source, bool inside) {
  simulation::copy_async(shared_destination, global_source, 4, inside);
}
inline void copy_async_commit() {}
template <int Pending>
inline void copy_async_wait() {}
#else
__device__ inline void copy_async_16(void* shared_destination, const void* global_source, bool inside) {
  const unsigned destination = static_cast<unsigned>(__cvta_generic_to_shared(shared_destination));
  const int source_bytes = inside ? 16 : 0;  // 0: fill the 16 bytes with zeros
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(destination), "l"(global_source),
               "r"(source_bytes));
}

__device__ inline void copy_async_4(void* shared_destination, const void* global_source, bool inside) {
  const unsigned destination = static_cast<unsigned>(__cvta_generic_to_shared(shared_destination));
  const int source_bytes = inside ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(destination), "l"(global_source),
               "r"(source_bytes));
}

__device__ inline void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int Pending>
__device__ inline void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}
#endif

// The staging: each operand goes to the kernel in chunk tiles (chunk_tiles_kernel), so that a
// thread's values are four float4 at fixed offsets from one address, without bounds checks.
// Slot v of a row (values 4 v .. 4 v + 3) goes to the shared tile as two 16-byte stores; slots 4-7
// hold their halves swapped (values 4 v + 2, 4 v + 3, 4 v, 4 v + 1), and their threads store the
// high half first, so that each store's eight threads of a quarter-warp meet eight different bank
// groups (the row stride, 36 doubles, moves the low halves of all slots by multiples of 32 bytes).
constexpr int rw_tile_slots = plain_tile * plain_chunk / 4;  // float4 per operand chunk tile (512)
constexpr int rw_loads = rw_tile_slots / rw_threads;         // float4 per thread and operand (4)

struct alignas(16) double_pair {
  double x, y;
};

__device__ inline void rw_store(const float4 (&values)[rw_loads], double* tile) {
  const int slot = static_cast<int>(threadIdx.x) % 8;
  const int swapped = slot / 4;
  double* const first = tile + (static_cast<int>(threadIdx.x) / 8) * dot_stride + 4 * slot + 2 * swapped;
  double* const second = tile + (static_cast<int>(threadIdx.x) / 8) * dot_stride + 4 * slot + 2 * (1 - swapped);
#pragma unroll
  for (int e = 0; e < rw_loads; ++e) {
    const float4 v = values[e];
    const double_pair low_half = {static_cast<double>(v.x), static_cast<double>(v.y)};
    const double_pair high_half = {static_cast<double>(v.z), static_cast<double>(v.w)};
    *reinterpret_cast<double_pair*>(first + 16 * dot_stride * e) = low_half;
    *reinterpret_cast<double_pair*>(second + 16 * dot_stride * e) = high_half;
  }
}

// The next chunk's values for the warp-tile kernels (reference_warp_kernel, block_warp_kernel):
// four float4 of each operand's chunk tile (chunk_tiles_kernel), elements threadIdx.x + 128 e of
// the tile's 512 (row threadIdx.x / 8 + 16 e, slot threadIdx.x % 8). A's go by cp.async to this
// thread's own slots of the stage, which only this thread reads back (so no barrier, and no
// registers held across the chunk's mmas); B's go to registers.
struct rw_chunk_loader {
  float4 next_b[rw_loads];
  float4* a_stage;
  const float4* a_source;
  const float4* b_source;

  __device__ rw_chunk_loader(double* stage, const float* a_tiles, const float* b_tiles, std::int64_t chunks)
      : a_stage(reinterpret_cast<float4*>(stage) + threadIdx.x),
        a_source(reinterpret_cast<const float4*>(a_tiles) + blockIdx.y * chunks * rw_tile_slots + threadIdx.x),
        b_source(reinterpret_cast<const float4*>(b_tiles) + blockIdx.x * chunks * rw_tile_slots + threadIdx.x) {}

  __device__ void fetch(std::int64_t chunk) {
#pragma unroll
    for (int e = 0; e < rw_loads; ++e) {
      copy_async_16(a_stage + rw_threads * e, a_source + chunk * rw_tile_slots + rw_threads * e, true);
      next_b[e] = b_source[chunk * rw_tile_slots + rw_threads * e];
    }
    copy_async_commit();
  }

  // The fetched chunk into the shared tiles (the caller's barrier follows).
  __device__ void store(double* a_tile, double* b_tile) {
    copy_async_wait<0>();
    float4 staged[rw_loads];
#pragma unroll
    for (int e = 0; e < rw_loads; ++e) staged[e] = a_stage[rw_threads * e];
    rw_store(staged, a_tile);
    rw_store(next_b, b_tile);
  }
};

// The operand x [rows, depth] as chunk tiles: tile t (rows 64 t .. 64 t + 63) and chunk c (columns
// 32 c .. 32 c + 31) are 2048 consecutive values from (t chunks + c) 2048, row by row, with the
// slots of each row ordered as rw_store reads them, and zeros past the last row and column.
__global__ void chunk_tiles_kernel(const float* x, std::int64_t rows, std::int64_t depth, std::int64_t chunks,
                                   float* out) {
  const std::int64_t chunk = blockIdx.x;
  const std::int64_t tiles = (rows + plain_tile - 1) / plain_tile;
  for (std::int64_t tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
    float* const tile_out = out + (tile * chunks + chunk) * (plain_tile * plain_chunk);
    for (int e = static_cast<int>(threadIdx.x); e < plain_tile * plain_chunk; e += static_cast<int>(blockDim.x)) {
      const int place = e % plain_chunk;
      const std::int64_t row = tile * plain_tile + e / plain_chunk;
      const std::int64_t k = chunk * plain_chunk + (place / 16 == 0 ? place : place ^ 2);  // slots 4-7: halves swapped
      tile_out[e] = row < rows && k < depth ? x[row * depth + k] : 0.0f;
    }
  }
}

__device__ inline int rw_row(int r) {
  return 32 * (static_cast<int>(threadIdx.x) / 64) + 8 * r + (static_cast<int>(threadIdx.x) % 32) / 4;
}
__device__ inline int rw_col(int c) {
  const int thread = static_cast<int>(threadIdx.x);
  return 32 * ((thread / 32) % 2) + 8 * (c / 2) + 2 * (thread % 4) + c % 2;
}

// dots[r][c] += the chunk's 32 products of row rw_row(r) of a_tile and row rw_col(c) of b_tile.
__device__ inline void rw_tile_dots(const double* a_tile, const double* b_tile, double (&dots)[rw_rows][rw_cols]) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const double* a_base = a_tile + (32 * (warp / 2) + lane / 4) * dot_stride + lane % 4;
  const double* b_base = b_tile + (32 * (warp % 2) + lane / 4) * dot_stride + lane % 4;
#pragma unroll
  for (int kk = 0; kk < 32; kk += 8) {
    double bv[rw_cols / 2][2];
#pragma unroll
    for (int q = 0; q < rw_cols / 2; ++q) {
#pragma unroll
      for (int v = 0; v < 2; ++v) bv[q][v] = b_base[8 * q * dot_stride + kk + 4 * v];
    }
#pragma unroll
    for (int p = 0; p < rw_rows / 2; ++p) {
      double av[4];
#pragma unroll
      for (int v = 0; v < 4; ++v) av[v] = a_base[8 * (2 * p + v % 2) * dot_stride + kk + 4 * (v / 2)];
#pragma unroll
      for (int q = 0; q < rw_cols / 2; ++q) {
        mma_f64(dots[2 * p][2 * q], dots[2 * p][2 * q + 1], dots[2 * p + 1][2 * q], dots[2 * p + 1][2 * q + 1], av,
                bv[q]);
      }
    }
  }
}

// One body (about 190 lines): each warp's fp64 tile dots, the super-chunk spread checks and the
// 128-bit sums share the warp's fragments and long accumulators held in registers.
template <bool Scaled>
__global__ void __launch_bounds__(rw_threads, 2)
    reference_warp_kernel(const float* a_tiles, const float* b_tiles, const std::int8_t* a_spreads,
                          const std::int8_t* b_spreads, const std::int8_t* a_super_spreads,
                          const std::int8_t* b_super_spreads, const std::int8_t* a_half_spreads,
                          const std::int8_t* b_half_spreads, plain_rows_view a_rows, plain_rows_view b_rows, std::int64_t m, std::int64_t n,
                          std::int64_t depth, int depth_bits, float* out32, double* out64,
                          core_ns::tensor_scale_product scale) {
  MXSCOPE_DYNAMIC_SHARED(double, rw_shared);
  double* const a_tile = rw_shared;
  double* const b_tile = rw_shared + plain_tile * dot_stride;
  core_ns::int128* const rw_sums = reinterpret_cast<core_ns::int128*>(rw_shared + 2 * plain_tile * dot_stride);
  __shared__ int a_spread_tile[plain_tile];
  __shared__ int b_spread_tile[plain_tile];
  __shared__ int a_super_tile[plain_tile];
  __shared__ int b_super_tile[plain_tile];
  __shared__ int a_half_tile[plain_tile];
  __shared__ int b_half_tile[plain_tile];
  const std::int64_t i0 = static_cast<std::int64_t>(blockIdx.y) * plain_tile;
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * plain_tile;
  const std::int64_t chunks = (depth + plain_chunk - 1) / plain_chunk;
  const auto sum_at = [&](int r, int c) -> core_ns::int128& {
    return rw_sums[(r * rw_cols + c) * rw_threads + static_cast<int>(threadIdx.x)];
  };

  // The rows' lowest exponents (the sums' units) in shared memory: read at the steps only.
  __shared__ int a_low_tile[plain_tile];
  __shared__ int b_low_tile[plain_tile];
  const auto base_of = [&](int r, int c) { return a_low_tile[rw_row(r)] + b_low_tile[rw_col(c)]; };
  unsigned active = 0;  // bit r rw_cols + c: entry (r, c) is computed here
  {
    const bool a_role = threadIdx.x < plain_tile;
    const std::int64_t i = (a_role ? i0 : j0) + static_cast<int>(threadIdx.x) % plain_tile;
    const std::int32_t* lows = a_role ? a_rows.low : b_rows.low;
    (a_role ? a_low_tile : b_low_tile)[threadIdx.x % plain_tile] = i < (a_role ? m : n) ? lows[i] : 0;
  }
  {
    int a_low[rw_rows], b_low[rw_cols];
    int a_high[rw_rows], b_high[rw_cols];
#pragma unroll
    for (int r = 0; r < rw_rows; ++r) {
      const std::int64_t i = i0 + rw_row(r);
      a_low[r] = i < m ? a_rows.low[i] : 0;
      a_high[r] = i < m ? a_rows.high[i] : plain_nonfinite_high;
    }
#pragma unroll
    for (int c = 0; c < rw_cols; ++c) {
      const std::int64_t j = j0 + rw_col(c);
      b_low[c] = j < n ? b_rows.low[j] : 0;
      b_high[c] = j < n ? b_rows.high[j] : plain_nonfinite_high;
    }
#pragma unroll
    for (int r = 0; r < rw_rows; ++r) {
#pragma unroll
      for (int c = 0; c < rw_cols; ++c) {
        if (plain_fits(a_low[r], a_high[r], b_low[c], b_high[c], depth_bits)) active |= 1U << (r * rw_cols + c);
        sum_at(r, c) = 0;
      }
    }
  }
  __syncthreads();  // the low tiles

  // The next chunk: its values (rw_chunk_loader) and its spreads: threads 0-63 fetch those of the
  // tile's A rows, 64-127 those of its B rows, the chunk's, and at the first chunk of a
  // super-chunk (of a half) also the super-chunk's (the half's).
  rw_chunk_loader loader(rw_shared + (rw_tiles_bytes + rw_sums_bytes) / sizeof(double), a_tiles, b_tiles, chunks);
  int spread_next = plain_empty_spread;
  int super_next = plain_empty_spread;
  int half_next = plain_empty_spread;
  const auto fetch = [&](std::int64_t chunk) {
    loader.fetch(chunk);
    const bool a_role = threadIdx.x < plain_tile;
    const std::int64_t i = (a_role ? i0 : j0) + static_cast<int>(threadIdx.x) % plain_tile;
    const std::int64_t rows = a_role ? m : n;
    spread_next = i < rows ? (a_role ? a_spreads : b_spreads)[chunk * rows + i] : plain_empty_spread;
    if (chunk % plain_super_chunks == 0) {
      const std::int64_t super = chunk / plain_super_chunks;
      super_next = i < rows ? (a_role ? a_super_spreads : b_super_spreads)[super * rows + i] : plain_empty_spread;
    }
    if (chunk % plain_half_chunks == 0) {
      const std::int64_t half = chunk / plain_half_chunks;
      half_next = i < rows ? (a_role ? a_half_spreads : b_half_spreads)[half * rows + i] : plain_empty_spread;
    }
  };
  if (chunks > 0) fetch(0);

  // The dots: zero at the start, reset by each entry's own step (see plain_tile_kernel for why not
  // all at once at a super-chunk's first chunk).
  double dots[rw_rows][rw_cols];
#pragma unroll
  for (int r = 0; r < rw_rows; ++r) {
#pragma unroll
    for (int c = 0; c < rw_cols; ++c) dots[r][c] = 0.0;
  }
  // Entries that keep their dot across the super-chunk (fused_super) or the half (the rest of
  // fused); the others step per chunk.
  unsigned fused_super = 0;
  unsigned fused = 0;

  for (std::int64_t chunk = 0; chunk < chunks; ++chunk) {
    loader.store(a_tile, b_tile);
    const bool super_start = chunk % plain_super_chunks == 0;
    const bool half_start = chunk % plain_half_chunks == 0;
    (threadIdx.x < plain_tile ? a_spread_tile : b_spread_tile)[threadIdx.x % plain_tile] = spread_next;
    if (super_start) (threadIdx.x < plain_tile ? a_super_tile : b_super_tile)[threadIdx.x % plain_tile] = super_next;
    if (half_start) (threadIdx.x < plain_tile ? a_half_tile : b_half_tile)[threadIdx.x % plain_tile] = half_next;
    __syncthreads();
    if (chunk + 1 < chunks) fetch(chunk + 1);
    if (super_start) {
      fused_super = 0;
#pragma unroll
      for (int r = 0; r < rw_rows; ++r) {
#pragma unroll
        for (int c = 0; c < rw_cols; ++c) {
          if (a_super_tile[rw_row(r)] + b_super_tile[rw_col(c)] <= plain_super_budget) fused_super |= 1U << (r * rw_cols + c);
        }
      }
      fused_super &= active;
    }
    // Where every entry keeps its dot across the super-chunk, the halves change nothing.
    if (half_start && fused_super != active) {
      fused = fused_super;
#pragma unroll
      for (int r = 0; r < rw_rows; ++r) {
#pragma unroll
        for (int c = 0; c < rw_cols; ++c) {
          if (a_half_tile[rw_row(r)] + b_half_tile[rw_col(c)] <= plain_half_budget) fused |= 1U << (r * rw_cols + c);
        }
      }
      fused &= active;
    } else if (half_start) {
      fused = fused_super;
    }
    const bool super_end = (chunk + 1) % plain_super_chunks == 0 || chunk + 1 == chunks;
    const bool half_end = (chunk + 1) % plain_half_chunks == 0 || chunk + 1 == chunks;
    rw_tile_dots(a_tile, b_tile, dots);

    // The steps (as plain_tile_kernel's exact mode), on the sums in shared memory: a fused entry at
    // the end of its super-chunk or half, the others per chunk (per product where the chunk's two
    // spreads exceed its budget). The entries due are found as masks first, so that an entry with
    // nothing to do costs one bit test.
    const unsigned ends = (super_end ? fused_super : 0U) | (half_end ? fused & ~fused_super : 0U);
    const unsigned per_chunk = active & ~fused;
    unsigned per_product = 0;
    if (per_chunk != 0) {
      int a_spread[rw_rows], b_spread[rw_cols];
      int a_widest = plain_empty_spread, b_widest = plain_empty_spread;
#pragma unroll
      for (int r = 0; r < rw_rows; ++r) {
        a_spread[r] = a_spread_tile[rw_row(r)];
        a_widest = max(a_widest, a_spread[r]);
      }
#pragma unroll
      for (int c = 0; c < rw_cols; ++c) {
        b_spread[c] = b_spread_tile[rw_col(c)];
        b_widest = max(b_widest, b_spread[c]);
      }
      if (a_widest + b_widest > plain_chunk_budget) {
#pragma unroll
        for (int r = 0; r < rw_rows; ++r) {
#pragma unroll
          for (int c = 0; c < rw_cols; ++c) {
            if (a_spread[r] + b_spread[c] > plain_chunk_budget) per_product |= 1U << (r * rw_cols + c);
          }
        }
        per_product &= per_chunk;
      }
    }
    const unsigned steps = ends | (per_chunk & ~per_product);
    if (steps != 0) {
#pragma unroll
      for (int r = 0; r < rw_rows; ++r) {
#pragma unroll
        for (int c = 0; c < rw_cols; ++c) {
          if ((steps & (1U << (r * rw_cols + c))) == 0) continue;
          add_in_units_by_halves(sum_at(r, c), dots[r][c], base_of(r, c));
          dots[r][c] = 0.0;
        }
      }
    }
    if (per_product != 0) {
#pragma unroll
      for (int r = 0; r < rw_rows; ++r) {
#pragma unroll
        for (int c = 0; c < rw_cols; ++c) {
          if ((per_product & (1U << (r * rw_cols + c))) == 0) continue;
          dots[r][c] = 0.0;
          const double* const a_column = a_tile + rw_row(r) * dot_stride;
          const double* const b_column = b_tile + rw_col(c) * dot_stride;
          double dot = 0.0;
          if (chunk_products_exactly(a_column, b_column, dot)) {
            add_in_units_by_halves(sum_at(r, c), dot, base_of(r, c));
          } else {
            sum_at(r, c) += chunk_products_by_halves(a_column, b_column, base_of(r, c));
          }
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
      const std::int64_t entry = (i0 + rw_row(r)) * n + j0 + rw_col(c);
      double value64 = 0.0;
      float value32 = 0.0f;
      if constexpr (Scaled) {
        round_units_scaled(sum_at(r, c), base_of(r, c), scale, value64, value32);
      } else {
        round_units(sum_at(r, c), base_of(r, c), value64, value32);
      }
      if (out64 != nullptr) out64[entry] = value64;
      if (out32 != nullptr) out32[entry] = value32;
    }
  }
}
#endif  // MXSCOPE_CUDA_TENSOR_CORES

// The row metadata of one unscaled operand on the device.
struct plain_rows_data {
  scratch_buffer spreads;        // int8 [chunks, rows]
  scratch_buffer super_spreads;  // int8 [super-chunks, rows]
  scratch_buffer half_spreads;   // int8 [half super-chunks, rows]
  scratch_buffer lows;     // int32 [rows]
  scratch_buffer highs;    // int32 [rows]
  plain_rows_view view() const { return {lows.as<const std::int32_t>(), highs.as<const std::int32_t>()}; }
};

plain_rows_data describe_plain_rows(const float* values, std::int64_t rows, std::int64_t depth) {
  const std::int64_t chunks = (depth + plain_chunk - 1) / plain_chunk;
  const std::int64_t supers = (chunks + plain_super_chunks - 1) / plain_super_chunks;
  const std::int64_t halves = (chunks + plain_half_chunks - 1) / plain_half_chunks;
  plain_rows_data out{scratch_buffer(static_cast<std::size_t>(std::max<std::int64_t>(chunks * rows, 1))),
                      scratch_buffer(static_cast<std::size_t>(std::max<std::int64_t>(supers * rows, 1))),
                      scratch_buffer(static_cast<std::size_t>(std::max<std::int64_t>(halves * rows, 1))),
                      scratch_buffer(static_cast<std::size_t>(std::max<std::int64_t>(rows, 1)) * sizeof(std::int32_t)),
                      scratch_buffer(static_cast<std::size_t>(std::max<std::int64_t>(rows, 1)) * sizeof(std::int32_t))};
  if (rows == 0) return out;
  const std::size_t chunk_bytes = static_cast<std::size_t>(std::max<std::int64_t>(chunks * rows, 1)) * sizeof(std::int32_t);
  scratch_buffer chunk_lows(chunk_bytes);
  scratch_buffer chunk_highs(chunk_bytes);
  if (chunks > 0) {
    runtime::launch(plain_chunks_kernel, grid_for(chunks * rows), threads_per_block, 0, values, rows, depth, chunks,
                    out.spreads.as<std::int8_t>(), chunk_lows.as<std::int32_t>(), chunk_highs.as<std::int32_t>());
    runtime::launch(plain_supers_kernel, grid_for(supers * rows), threads_per_block, 0,
                    chunk_lows.as<const std::int32_t>(), chunk_highs.as<const std::int32_t>(), rows, chunks,
                    plain_super_chunks, out.super_spreads.as<std::int8_t>());
    runtime::launch(plain_supers_kernel, grid_for(halves * rows), threads_per_block, 0,
                    chunk_lows.as<const std::int32_t>(), chunk_highs.as<const std::int32_t>(), rows, chunks,
                    plain_half_chunks, out.half_spreads.as<std::int8_t>());
  }
  runtime::launch(plain_rows_kernel, grid_for(rows), threads_per_block, 0, chunk_lows.as<const std::int32_t>(),
                  chunk_highs.as<const std::int32_t>(), rows, chunks, out.lows.as<std::int32_t>(),
                  out.highs.as<std::int32_t>());
  synchronize();  // the chunk buffers must outlive the kernels
  return out;
}

int depth_bits_of(std::int64_t depth) { return core_ns::bit_length(static_cast<core_ns::uint128>(depth)); }

dim3 plain_grid(std::int64_t m, std::int64_t n) {
  return dim3(static_cast<unsigned>((n + plain_tile - 1) / plain_tile),
              static_cast<unsigned>((m + plain_tile - 1) / plain_tile));
}

