// The CPU GEMM's wide integer kernel: operands whose integer element values are too wide for the
// int16 kernels (src/gemm_integer.cpp) but whose block dots are exact in fp64, with power-of-two
// block scales: fp8 e4m3 pairs, MX (mxfp8) and per-tensor (the tensor scales applied as in the
// definition). AVX-512 or AVX2 + FMA, chosen at run time; the fp32-block and exact models, and both
// at once for the replay's exact_too.
//
// Exactness. An element's integer value IA = qa 2^fa is below 2^18 for e4m3 (448 * 2^9), so a
// product is an integer below 2^36 and every partial sum of a block dot D = sum IA IB is an integer
// below 2^bound_bits <= 2^53 (the plan's bound): fp64 FMAs compute D exactly in any order. The
// scaled block dot c = D 2^k (k = ea + eb - fa - fb, |k| < 300 for e8m0 scales) is an exact double.
// - fp32-block, acc = fl32(acc + c): s = acc + c in fp64 with TwoSum's error e; s rounded to odd
//   (where e != 0 and s is even, the neighbour of s towards acc + c) keeps 53 >= 24 + 2 bits, so
//   converting it to fp32 rounds acc + c once, to nearest even, as the definition does.
// - exact: the running fp64 sum with TwoSum; where no step was inexact it IS the exact sum (always
//   so for per-tensor e4m3 at K below 2^17), which core::round_scaled_exact rounds once with the
//   tensor scales; other entries are summed again in a long accumulator.
// A block whose scale is the NaN marker (k beyond +-1000) makes its entries NaN, as in the
// definition; its fp32-block step goes through the scalar add_exact_value.
//
// The certified kernel (certified_wide_product) runs fp32-block on finite float operands without
// block scales (bf16, fp32, per-tensor elements beyond the integer path) on the same tiles, where
// the fp64 FMA dots need not be exact: each step is kept where the dot's error bound cannot move
// the fp32 rounding (see certified_fp32_step), and taken exactly from its products elsewhere.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string_view>
#include <vector>

#include "gemm_internal.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#define MXSCOPE_WIDE_X86 1
#endif

namespace mxscope::gemm_internal {

namespace {

constexpr int wide_rows = 4;    // rows of a micro tile
constexpr int wide_width = 8;   // columns of a micro tile: a panel of B, two vectors of 4 doubles
constexpr int wide_entries = wide_rows * wide_width;
constexpr std::int32_t marker_beyond = 1000;  // |k| past this: a NaN block (nan_block_exponent)

struct wide_packed {
  std::int64_t padded_rows = 0;   // A rows rounded up to wide_rows
  std::int64_t panels = 0;        // B rows (output columns) in groups of wide_width
  std::int64_t padded_depth = 0;  // blocks * block, zeros past the depth
  std::int64_t blocks = 0;
  // Left uninitialized by the allocation and written once by the packing threads (a zero fill
  // first would write the 1.2 GB of a Llama-shaped product twice, on one thread).
  std::unique_ptr<double[]> a;            // [padded_rows, padded_depth] integer values
  std::unique_ptr<double[]> b;            // [panels, padded_depth, wide_width]
  std::vector<std::int32_t> a_exponents;  // [padded_rows, blocks]
  std::vector<std::int32_t> b_exponents;  // [panels, blocks, wide_width]
  // Float dots only (certified_wide_product): gamma ||A block|| of each (row, block) and ||B block||
  // of each (column, block), whose product bounds the fp64 FMA error of that entry's block dot.
  std::vector<double> a_bounds;  // [padded_rows, blocks]
  std::vector<double> b_bounds;  // [panels, blocks, wide_width]
  // The same norms in units of each block's lowest set bit: where their product stays below 2^53
  // every partial sum of the dot is an fp64 number, so the dot is exact and the bound is 0.
  std::vector<double> a_grid_norms;  // [padded_rows, blocks]
  std::vector<double> b_grid_norms;  // [panels, blocks, wide_width]
};

// integer_view: the elements times 2^fraction_bits (the integer kernels); else the values as they are.
wide_packed pack_wide(const canonical_operand& a, const canonical_operand& b, bool integer_view = true) {
  wide_packed packed;
  packed.padded_rows = (a.rows + wide_rows - 1) / wide_rows * wide_rows;
  packed.panels = (b.rows + wide_width - 1) / wide_width;
  packed.blocks = a.blocks;
  packed.padded_depth = a.blocks * a.block;
  const std::int64_t depth = packed.padded_depth;
  packed.a.reset(new double[static_cast<std::size_t>(packed.padded_rows * depth)]);
  packed.b.reset(new double[static_cast<std::size_t>(packed.panels * depth * wide_width)]);
  packed.a_exponents.assign(static_cast<std::size_t>(packed.padded_rows * a.blocks), 0);
  packed.b_exponents.assign(static_cast<std::size_t>(packed.panels * a.blocks * wide_width), 0);
  // Exact: a power-of-two scaling of a short significand; + 0.0 makes -0 elements +0.
  const double a_scale = integer_view ? core_ns::pow2(a.fraction_bits) : 1.0;
  const double b_scale = integer_view ? core_ns::pow2(b.fraction_bits) : 1.0;
#pragma omp parallel for schedule(static) if (a.rows * a.depth >= parallel_elements)
  for (std::int64_t row = 0; row < packed.padded_rows; ++row) {
    double* to = packed.a.get() + row * depth;
    if (row >= a.rows) {
      std::fill_n(to, depth, 0.0);
      continue;
    }
    const float* from = a.elements.data() + row * a.depth;
    for (std::int64_t k = 0; k < a.depth; ++k) to[k] = static_cast<double>(from[k]) * a_scale + 0.0;
    std::fill(to + a.depth, to + depth, 0.0);
    std::copy_n(a.scale_exponents.data() + row * a.blocks, a.blocks, packed.a_exponents.data() + row * a.blocks);
  }
#pragma omp parallel for schedule(static) if (b.rows * b.depth >= parallel_elements)
  for (std::int64_t panel = 0; panel < packed.panels; ++panel) {
    double* to = packed.b.get() + panel * depth * wide_width;
    const float* from[wide_width];
    for (int lane = 0; lane < wide_width; ++lane) {
      const std::int64_t column = panel * wide_width + lane;
      from[lane] = column < b.rows ? b.elements.data() + column * b.depth : nullptr;
      if (from[lane] == nullptr) continue;
      std::int32_t* exponents = packed.b_exponents.data() + panel * a.blocks * wide_width;
      for (std::int64_t block = 0; block < a.blocks; ++block) {
        exponents[block * wide_width + lane] = b.scale_exponents[static_cast<std::size_t>(column * b.blocks + block)];
      }
    }
    // K outer, the panel's eight columns inner: the writes run in order.
    for (std::int64_t k = 0; k < depth; ++k) {
      for (int lane = 0; lane < wide_width; ++lane) {
        to[k * wide_width + lane] =
            from[lane] != nullptr && k < b.depth ? static_cast<double>(from[lane][k]) * b_scale + 0.0 : 0.0;
      }
    }
  }
  return packed;
}

// The exponent of the lowest set bit of a nonzero finite float.
int lowest_bit_exponent(float value) {
  const std::uint32_t bits = core_ns::float_bits(value) & 0x7FFFFFFFU;
  const int field = static_cast<int>(bits >> 23);
  const std::uint32_t significand = (bits & 0x7FFFFFU) | (field != 0 ? 0x800000U : 0U);
  return (field != 0 ? field - 150 : -149) + __builtin_ctz(significand);
}

// Upper bounds of the 2-norm of each (row, block) of an operand, times `factor` (a power of two),
// and in units of the block's lowest set bit: the fp64 sum of the exact squares (at most 64 of
// them: relative error below 2^-46) and its square root, enlarged by 2^-40.
void block_norms(const canonical_operand& operand, double factor, std::vector<double>& norms,
                 std::vector<double>& grid_norms) {
  norms.assign(static_cast<std::size_t>(operand.rows * operand.blocks), 0.0);
  grid_norms.assign(norms.size(), 0.0);
#pragma omp parallel for schedule(static) if (operand.rows * operand.depth >= parallel_elements)
  for (std::int64_t row = 0; row < operand.rows; ++row) {
    for (std::int64_t block = 0; block < operand.blocks; ++block) {
      double squares = 0.0;
      int lowest = std::numeric_limits<int>::max();
      const std::int64_t end = std::min(operand.depth, (block + 1) * operand.block);
      for (std::int64_t k = block * operand.block; k < end; ++k) {
        const float value = operand.elements[static_cast<std::size_t>(row * operand.depth + k)];
        if (value == 0.0f) continue;
        squares += static_cast<double>(value) * value;
        lowest = std::min(lowest, lowest_bit_exponent(value));
      }
      const double norm = std::sqrt(squares) * (1.0 + 0x1p-40);
      const auto at = static_cast<std::size_t>(row * operand.blocks + block);
      norms[at] = norm * factor;
      grid_norms[at] = squares == 0.0 ? 0.0 : norm * core_ns::pow2(-lowest);
    }
  }
}

// The bounds of certified_wide_product. A block dot of n products by fp64 FMAs in ascending K
// (the first product exact, each later step rounded once) is within (n - 1) u (1 + u)^n sum |p|
// of the exact dot (u = 2^-53), and sum |p| <= ||A block|| ||B block|| (Cauchy-Schwarz). gamma is
// 2 (n - 1) u rounded up to a power of two: the factor 2 covers (1 + u)^n and the rounding of the
// bound's own product.
void pack_bounds(const canonical_operand& a, const canonical_operand& b, wide_packed& packed) {
  const auto steps = static_cast<core_ns::uint128>(std::max(1, 2 * (a.block - 1)));
  const double gamma = core_ns::pow2(core_ns::bit_length(steps) - 53);
  std::vector<double> a_norms, a_grid, b_norms, b_grid;
  block_norms(a, gamma, a_norms, a_grid);
  block_norms(b, 1.0, b_norms, b_grid);
  packed.a_bounds.assign(static_cast<std::size_t>(packed.padded_rows * a.blocks), 0.0);
  packed.a_grid_norms.assign(packed.a_bounds.size(), 0.0);
  std::copy(a_norms.begin(), a_norms.end(), packed.a_bounds.begin());
  std::copy(a_grid.begin(), a_grid.end(), packed.a_grid_norms.begin());
  packed.b_bounds.assign(static_cast<std::size_t>(packed.panels * a.blocks * wide_width), 0.0);
  packed.b_grid_norms.assign(packed.b_bounds.size(), 0.0);
  for (std::int64_t column = 0; column < b.rows; ++column) {
    const std::int64_t panel = column / wide_width;
    const std::int64_t lane = column % wide_width;
    for (std::int64_t block = 0; block < a.blocks; ++block) {
      const auto from = static_cast<std::size_t>(column * b.blocks + block);
      const auto to = static_cast<std::size_t>((panel * a.blocks + block) * wide_width + lane);
      packed.b_bounds[to] = b_norms[from];
      packed.b_grid_norms[to] = b_grid[from];
    }
  }
}

// fl32(accumulator + the exact block dot) of one lane from its products (each exact in fp64): the
// certified step's fallback.
float exact_lane_step(float accumulator, const double* a_block, std::int64_t depth, int r, const double* b_block,
                      int lane, int block) {
  if (!std::isfinite(accumulator)) return nonfinite_step(accumulator, 0.0);  // the operands are finite
  double products[64];
  for (int k = 0; k < block; ++k) products[k] = a_block[r * depth + k] * b_block[k * wide_width + lane];
  return core_ns::add_exactly_to_float(accumulator, products, block);
}

// The exact block dot of one packed entry (scalar): the recomputation of inexact exact sums.
double packed_wide_dot(const wide_packed& packed, std::int64_t row, std::int64_t column, std::int64_t block,
                       int block_length) {
  const double* a_row = packed.a.get() + row * packed.padded_depth;
  const double* b_panel = packed.b.get() + (column / wide_width) * packed.padded_depth * wide_width;
  const std::int64_t lane = column % wide_width;
  double dot = 0.0;  // exact: integers below 2^53 (the plan's bound)
  for (std::int64_t k = block * block_length; k < (block + 1) * block_length; ++k) {
    dot += a_row[k] * b_panel[k * wide_width + lane];
  }
  return dot;
}

// What a micro tile carries from one K chunk to the next.
struct wide_tile_state {
  alignas(32) float accumulators[wide_entries];  // fp32-block
  alignas(32) double sums[wide_entries];         // exact: the running fp64 sums
  alignas(32) double inexact[wide_entries];      // nonzero bits: some step of the sum was inexact
  alignas(32) std::int64_t nan_lanes[wide_entries];

  void clear() {
    std::fill(std::begin(accumulators), std::end(accumulators), 0.0f);
    std::fill(std::begin(sums), std::end(sums), 0.0);
    std::fill(std::begin(inexact), std::end(inexact), 0.0);
    std::fill(std::begin(nan_lanes), std::end(nan_lanes), 0);
  }
};

// The fp32-block steps of a row's 8 lanes one by one (a NaN block among them): the exact
// add_exact_value of each scaled block dot. Returns the lanes so taken.
inline std::int64_t scalar_block_steps(float* accumulators, const double* block_dots, std::int32_t a_exponent,
                                       const std::int32_t* b_exponents, int fraction_total) {
  for (int j = 0; j < wide_width; ++j) {
    accumulators[j] =
        add_exact_value(accumulators[j], scaled_block_dot(block_dots[j], a_exponent, 1, b_exponents[j], 1, fraction_total));
  }
  return wide_width;
}

#if MXSCOPE_WIDE_X86
bool cpu_has_avx2_and_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  return has;
}

// Lanes of k beyond the exponent range: NaN blocks (the marker), as 8 int32 masks.
__attribute__((target("avx2"), always_inline)) inline __m256i outside_lanes(__m256i k) {
  return _mm256_or_si256(_mm256_cmpgt_epi32(k, _mm256_set1_epi32(marker_beyond)),
                         _mm256_cmpgt_epi32(_mm256_set1_epi32(-marker_beyond), k));
}

// 2^k for 4 lanes of int64 k (each within fp64's normal range).
__attribute__((target("avx2"), always_inline)) inline __m256d power_of_two(__m128i k4) {
  return _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_add_epi64(_mm256_cvtepi32_epi64(k4), _mm256_set1_epi64x(1023)), 52));
}

// fl32(acc + c) for 4 lanes: acc + c rounded to odd in fp64, then to fp32 (see the top of the file).
// Lanes whose sum is not finite keep fp64's sum: inf or NaN, as the definition gives them.
__attribute__((target("avx2"), always_inline)) inline __m128 fp32_step(__m128 accumulator, __m256d contribution) {
  const __m256d acc = _mm256_cvtps_pd(accumulator);
  const __m256d sum = _mm256_add_pd(acc, contribution);
  const __m256d contribution_part = _mm256_sub_pd(sum, acc);
  const __m256d error = _mm256_add_pd(_mm256_sub_pd(acc, _mm256_sub_pd(sum, contribution_part)),
                                      _mm256_sub_pd(contribution, contribution_part));
  const __m256d magnitude = _mm256_andnot_pd(_mm256_set1_pd(-0.0), sum);
  const __m256d inexact = _mm256_and_pd(_mm256_cmp_pd(error, _mm256_setzero_pd(), _CMP_NEQ_OQ),
                                        _mm256_cmp_pd(magnitude, _mm256_set1_pd(std::numeric_limits<double>::infinity()), _CMP_LT_OQ));
  const __m256i bits = _mm256_castpd_si256(sum);
  const __m256i one = _mm256_set1_epi64x(1);
  const __m256i even = _mm256_cmpeq_epi64(_mm256_and_si256(bits, one), _mm256_setzero_si256());
  // +1 (away from zero) where the error has the sign of the sum, else -1: the odd neighbour.
  const __m256i opposite = _mm256_cmpgt_epi64(_mm256_setzero_si256(), _mm256_xor_si256(bits, _mm256_castpd_si256(error)));
  const __m256i step = _mm256_and_si256(_mm256_or_si256(opposite, one),
                                        _mm256_and_si256(even, _mm256_castpd_si256(inexact)));
  return _mm256_cvtpd_ps(_mm256_castsi256_pd(_mm256_add_epi64(bits, step)));
}

// One block's steps for a micro-tile row: dots[2] are the row's 8 block dots (exact doubles),
// k its 8 lanes' scale exponents minus the fraction bits. Returns the lanes taken the scalar way.
template <bool Block, bool Exact>
__attribute__((target("avx2,fma"), always_inline)) inline std::int64_t wide_row_step(
    const __m256d* dots, __m256i k, std::int32_t a_exponent, const std::int32_t* b_exponents, int fraction_total, int r,
    wide_tile_state& state) {
  const __m256i outside = outside_lanes(k);
  const bool any_outside = !_mm256_testz_si256(outside, outside);
  const __m256i safe_k = _mm256_andnot_si256(outside, k);
  __m256d contributions[2];
  contributions[0] = _mm256_mul_pd(dots[0], power_of_two(_mm256_castsi256_si128(safe_k)));
  contributions[1] = _mm256_mul_pd(dots[1], power_of_two(_mm256_extracti128_si256(safe_k, 1)));
  float* accumulators = state.accumulators + r * wide_width;
  std::int64_t slow = 0;
  if constexpr (Block) {
    if (!any_outside) {
      _mm_store_ps(accumulators, fp32_step(_mm_load_ps(accumulators), contributions[0]));
      _mm_store_ps(accumulators + 4, fp32_step(_mm_load_ps(accumulators + 4), contributions[1]));
    } else {
      alignas(32) double block_dots[wide_width];
      _mm256_store_pd(block_dots, dots[0]);
      _mm256_store_pd(block_dots + 4, dots[1]);
      slow = scalar_block_steps(accumulators, block_dots, a_exponent, b_exponents, fraction_total);
    }
  }
  if constexpr (Exact) {
    const int at = r * wide_width;
    if (any_outside) {
      __m256i* nan_row = reinterpret_cast<__m256i*>(state.nan_lanes + at);
      nan_row[0] = _mm256_or_si256(nan_row[0], _mm256_cvtepi32_epi64(_mm256_castsi256_si128(outside)));
      nan_row[1] = _mm256_or_si256(nan_row[1], _mm256_cvtepi32_epi64(_mm256_extracti128_si256(outside, 1)));
    }
    for (int half = 0; half < 2; ++half) {
      // two_sum(sum, contribution): the error is zero exactly when the fp64 sum is exact.
      const __m256d sum = _mm256_load_pd(state.sums + at + 4 * half);
      const __m256d total = _mm256_add_pd(sum, contributions[half]);
      const __m256d part = _mm256_sub_pd(total, sum);
      const __m256d error = _mm256_add_pd(_mm256_sub_pd(sum, _mm256_sub_pd(total, part)),
                                          _mm256_sub_pd(contributions[half], part));
      _mm256_store_pd(state.sums + at + 4 * half, total);
      _mm256_store_pd(state.inexact + at + 4 * half,
                      _mm256_or_pd(_mm256_load_pd(state.inexact + at + 4 * half),
                                   _mm256_cmp_pd(error, _mm256_setzero_pd(), _CMP_NEQ_UQ)));
    }
  }
  return slow;
}

// Certified fp32-block steps (float dots: the fp64 dot d is within `bound` of the block dot D).
// With s + e = acc + d exactly (TwoSum) and f its fp32 rounding (round to odd, then to fp32),
// every fp32 rounding boundary is at least half of f's spacing from f, a quarter where f is a power
// of two (its lower neighbour is closer), 2^-151 where f is 0 or subnormal (less than the
// boundaries' 2^-150). A bound of 0 means d = D: f is the definition's value, ties and overflow
// included. Else, when |s + e - f| + bound stays below that gap, acc + D rounds to f as well,
// except where f is 0 (its sign depends on D's) or not finite. Other lanes take exact_lane_step;
// `uncertain` gets their mask.
__attribute__((target("avx2"), always_inline)) inline __m128 certified_fp32_step(__m128 accumulator, __m256d dot,
                                                                                __m256d bound, int& uncertain) {
  const __m256d acc = _mm256_cvtps_pd(accumulator);
  const __m256d sum = _mm256_add_pd(acc, dot);
  const __m256d dot_part = _mm256_sub_pd(sum, acc);
  const __m256d error =
      _mm256_add_pd(_mm256_sub_pd(acc, _mm256_sub_pd(sum, dot_part)), _mm256_sub_pd(dot, dot_part));
  const __m128 rounded = fp32_step(accumulator, dot);
  const __m256d back = _mm256_cvtps_pd(rounded);
  const __m256d sign = _mm256_set1_pd(-0.0);
  const __m256d distance = _mm256_andnot_pd(sign, _mm256_add_pd(_mm256_sub_pd(sum, back), error));
  const __m256i bits = _mm256_castpd_si256(back);
  const __m256i exponent = _mm256_and_si256(bits, _mm256_set1_epi64x(0x7FF0000000000000LL));
  const __m256i power_of_two =
      _mm256_cmpeq_epi64(_mm256_and_si256(bits, _mm256_set1_epi64x(0x000FFFFFFFFFFFFFLL)), _mm256_setzero_si256());
  const __m256i below = _mm256_sub_epi64(exponent, _mm256_blendv_epi8(_mm256_set1_epi64x(std::int64_t{24} << 52),
                                                                      _mm256_set1_epi64x(std::int64_t{25} << 52),
                                                                      power_of_two));
  const __m256i smallest = _mm256_set1_epi64x(std::int64_t{1023 - 151} << 52);
  const __m256d gap = _mm256_castsi256_pd(_mm256_blendv_epi8(smallest, below, _mm256_cmpgt_epi64(below, smallest)));
  const __m256d magnitude = _mm256_andnot_pd(sign, back);
  const __m256d zero = _mm256_setzero_pd();
  const __m256d certain = _mm256_or_pd(
      _mm256_cmp_pd(bound, zero, _CMP_EQ_OQ),
      _mm256_and_pd(_mm256_and_pd(_mm256_cmp_pd(_mm256_add_pd(distance, bound), gap, _CMP_LT_OQ),
                                  _mm256_cmp_pd(magnitude, _mm256_set1_pd(std::numeric_limits<double>::infinity()), _CMP_LT_OQ)),
                    _mm256_cmp_pd(magnitude, zero, _CMP_GT_OQ)));
  uncertain = ~_mm256_movemask_pd(certain) & 0xF;
  return rounded;
}

// The certified steps of a micro-tile row's 8 lanes (bounds: gamma ||A block|| ||B block|| per lane).
__attribute__((target("avx2,fma"), always_inline)) inline std::int64_t certified_row_step(
    const __m256d* dots, const __m256d* bounds, const double* a_block, std::int64_t depth, int r,
    const double* b_block, int block, float* accumulators) {
  int uncertain[2];
  const __m128 old_low = _mm_load_ps(accumulators);
  const __m128 old_high = _mm_load_ps(accumulators + 4);
  _mm_store_ps(accumulators, certified_fp32_step(old_low, dots[0], bounds[0], uncertain[0]));
  _mm_store_ps(accumulators + 4, certified_fp32_step(old_high, dots[1], bounds[1], uncertain[1]));
  const int lanes = uncertain[0] | (uncertain[1] << 4);
  if (lanes == 0) return 0;
  alignas(16) float old[wide_width];
  _mm_store_ps(old, old_low);
  _mm_store_ps(old + 4, old_high);
  std::int64_t slow = 0;
  for (int j = 0; j < wide_width; ++j) {
    if ((lanes >> j & 1) == 0) continue;
    accumulators[j] = exact_lane_step(old[j], a_block, depth, r, b_block, j, block);
    ++slow;
  }
  return slow;
}

// Blocks [first, last) of a micro tile: the block dots by fp64 FMAs (4 rows x 8 columns in eight
// registers, ascending K), then the models' steps.
template <bool Block, bool Exact, bool Certified = false>
__attribute__((target("avx2,fma"))) std::int64_t wide_micro_tile(const wide_packed& packed, std::int64_t row,
                                                                  std::int64_t panel, std::int64_t first,
                                                                  std::int64_t last, int block, int fraction_total,
                                                                  wide_tile_state& state) {
  const std::int64_t depth = packed.padded_depth;
  const double* a_rows = packed.a.get() + row * depth;
  const double* b_panel = packed.b.get() + panel * depth * wide_width;
  const std::int32_t* a_exponents = packed.a_exponents.data() + row * packed.blocks;
  const std::int32_t* b_exponents = packed.b_exponents.data() + panel * packed.blocks * wide_width;
  std::int64_t slow = 0;
  for (std::int64_t index = first; index < last; ++index) {
    __m256d dots[wide_rows][2];
    for (auto& row_dots : dots) row_dots[0] = row_dots[1] = _mm256_setzero_pd();
    const double* a_block = a_rows + index * block;
    const double* b_block = b_panel + index * block * wide_width;
    for (int k = 0; k < block; ++k) {
      const __m256d low = _mm256_loadu_pd(b_block + k * wide_width);
      const __m256d high = _mm256_loadu_pd(b_block + k * wide_width + 4);
#pragma GCC unroll 4
      for (int r = 0; r < wide_rows; ++r) {
        const __m256d value = _mm256_broadcast_sd(a_block + r * depth + k);
        dots[r][0] = _mm256_fmadd_pd(value, low, dots[r][0]);
        dots[r][1] = _mm256_fmadd_pd(value, high, dots[r][1]);
      }
    }
    if constexpr (Certified) {
      const auto b_at = static_cast<std::size_t>((panel * packed.blocks + index) * wide_width);
      const __m256d b_bounds[2] = {_mm256_loadu_pd(&packed.b_bounds[b_at]), _mm256_loadu_pd(&packed.b_bounds[b_at + 4])};
      const __m256d b_grid[2] = {_mm256_loadu_pd(&packed.b_grid_norms[b_at]),
                                 _mm256_loadu_pd(&packed.b_grid_norms[b_at + 4])};
#pragma GCC unroll 4
      for (int r = 0; r < wide_rows; ++r) {
        const auto a_at = static_cast<std::size_t>((row + r) * packed.blocks + index);
        const __m256d a_bound = _mm256_set1_pd(packed.a_bounds[a_at]);
        const __m256d a_grid = _mm256_set1_pd(packed.a_grid_norms[a_at]);
        __m256d bounds[2];
        for (int half = 0; half < 2; ++half) {
          const __m256d exact = _mm256_cmp_pd(_mm256_mul_pd(a_grid, b_grid[half]), _mm256_set1_pd(0x1p53), _CMP_LT_OQ);
          bounds[half] = _mm256_andnot_pd(exact, _mm256_mul_pd(a_bound, b_bounds[half]));
        }
        slow += certified_row_step(dots[r], bounds, a_block, depth, r, b_block, block,
                                   state.accumulators + r * wide_width);
      }
      continue;
    }
    const std::int32_t* block_b_exponents = b_exponents + index * wide_width;
    const __m256i b_exponent = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block_b_exponents));
#pragma GCC unroll 4
    for (int r = 0; r < wide_rows; ++r) {
      const std::int32_t a_exponent = a_exponents[r * packed.blocks + index];
      const __m256i k = _mm256_add_epi32(b_exponent, _mm256_set1_epi32(a_exponent - fraction_total));
      slow += wide_row_step<Block, Exact>(dots[r], k, a_exponent, block_b_exponents, fraction_total, r, state);
    }
  }
  return slow;
}

// ------------------------------------------------------------------------------------------------
// AVX-512: the same steps on 8 lanes at once, and a micro tile of 4 rows x 2 panels (16 columns:
// two B loads and four broadcasts feed eight 8-lane FMAs), each panel keeping its own tile state.

// 2^k for 8 lanes of int32 k (each within fp64's normal range).
__attribute__((target("avx512f"), always_inline)) inline __m512d power_of_two8(__m256i k8) {
  return _mm512_castsi512_pd(
      _mm512_maskz_slli_epi64(0xFF, _mm512_add_epi64(_mm512_maskz_cvtepi32_epi64(0xFF, k8), _mm512_set1_epi64(1023)), 52));
}

// fp32_step on 8 lanes.
__attribute__((target("avx512f,avx512dq"), always_inline)) inline __m256 fp32_step8(__m256 accumulator,
                                                                                   __m512d contribution) {
  const __m512d acc = _mm512_maskz_cvtps_pd(0xFF, accumulator);
  const __m512d sum = _mm512_add_pd(acc, contribution);
  const __m512d contribution_part = _mm512_sub_pd(sum, acc);
  const __m512d error = _mm512_add_pd(_mm512_sub_pd(acc, _mm512_sub_pd(sum, contribution_part)),
                                      _mm512_sub_pd(contribution, contribution_part));
  const __mmask8 inexact =
      _mm512_cmp_pd_mask(error, _mm512_setzero_pd(), _CMP_NEQ_OQ) &
      _mm512_cmp_pd_mask(_mm512_abs_pd(sum), _mm512_set1_pd(std::numeric_limits<double>::infinity()), _CMP_LT_OQ);
  const __m512i bits = _mm512_castpd_si512(sum);
  const __m512i one = _mm512_set1_epi64(1);
  const __mmask8 even = _mm512_testn_epi64_mask(bits, one);
  // +1 (away from zero) where the error has the sign of the sum, else -1: the odd neighbour.
  const __mmask8 opposite =
      _mm512_cmplt_epi64_mask(_mm512_xor_si512(bits, _mm512_castpd_si512(error)), _mm512_setzero_si512());
  const __m512i step = _mm512_mask_blend_epi64(opposite, one, _mm512_set1_epi64(-1));
  return _mm512_maskz_cvtpd_ps(0xFF, _mm512_castsi512_pd(_mm512_mask_add_epi64(bits, inexact & even, bits, step)));
}

// wide_row_step on one zmm of block dots.
template <bool Block, bool Exact>
__attribute__((target("avx2,avx512f,avx512dq"), always_inline)) inline std::int64_t wide_row_step8(
    __m512d dot, __m256i k, std::int32_t a_exponent, const std::int32_t* b_exponents, int fraction_total, int r,
    wide_tile_state& state) {
  const __m256i outside = outside_lanes(k);
  const bool any_outside = !_mm256_testz_si256(outside, outside);
  const __m512d contribution = _mm512_mul_pd(dot, power_of_two8(_mm256_andnot_si256(outside, k)));
  float* accumulators = state.accumulators + r * wide_width;
  std::int64_t slow = 0;
  if constexpr (Block) {
    if (!any_outside) {
      _mm256_store_ps(accumulators, fp32_step8(_mm256_load_ps(accumulators), contribution));
    } else {
      alignas(64) double block_dots[wide_width];
      _mm512_store_pd(block_dots, dot);
      slow = scalar_block_steps(accumulators, block_dots, a_exponent, b_exponents, fraction_total);
    }
  }
  if constexpr (Exact) {
    const int at = r * wide_width;
    if (any_outside) {
      __m512i* nan_row = reinterpret_cast<__m512i*>(state.nan_lanes + at);
      _mm512_storeu_si512(nan_row, _mm512_or_si512(_mm512_loadu_si512(nan_row), _mm512_maskz_cvtepi32_epi64(0xFF, outside)));
    }
    // two_sum(sum, contribution): the error is zero exactly when the fp64 sum is exact.
    const __m512d sum = _mm512_loadu_pd(state.sums + at);
    const __m512d total = _mm512_add_pd(sum, contribution);
    const __m512d part = _mm512_sub_pd(total, sum);
    const __m512d error =
        _mm512_add_pd(_mm512_sub_pd(sum, _mm512_sub_pd(total, part)), _mm512_sub_pd(contribution, part));
    _mm512_storeu_pd(state.sums + at, total);
    const __mmask8 inexact = _mm512_cmp_pd_mask(error, _mm512_setzero_pd(), _CMP_NEQ_UQ);
    __m512i* inexact_row = reinterpret_cast<__m512i*>(state.inexact + at);
    _mm512_storeu_si512(inexact_row, _mm512_mask_mov_epi64(_mm512_loadu_si512(inexact_row), inexact,
                                                           _mm512_set1_epi64(-1)));
  }
  return slow;
}

// certified_fp32_step on 8 lanes; returns the uncertain lanes' mask.
__attribute__((target("avx512f,avx512dq"), always_inline)) inline __m256 certified_fp32_step8(
    __m256 accumulator, __m512d dot, __m512d bound, __mmask8& uncertain) {
  const __m512d acc = _mm512_maskz_cvtps_pd(0xFF, accumulator);
  const __m512d sum = _mm512_add_pd(acc, dot);
  const __m512d dot_part = _mm512_sub_pd(sum, acc);
  const __m512d error = _mm512_add_pd(_mm512_sub_pd(acc, _mm512_sub_pd(sum, dot_part)), _mm512_sub_pd(dot, dot_part));
  const __m256 rounded = fp32_step8(accumulator, dot);
  const __m512d back = _mm512_maskz_cvtps_pd(0xFF, rounded);
  const __m512d distance = _mm512_abs_pd(_mm512_add_pd(_mm512_sub_pd(sum, back), error));
  const __m512i bits = _mm512_castpd_si512(back);
  const __m512i exponent = _mm512_and_si512(bits, _mm512_set1_epi64(0x7FF0000000000000LL));
  const __mmask8 power_of_two = _mm512_testn_epi64_mask(bits, _mm512_set1_epi64(0x000FFFFFFFFFFFFFLL));
  const __m512i below = _mm512_sub_epi64(
      exponent, _mm512_mask_blend_epi64(power_of_two, _mm512_set1_epi64(std::int64_t{24} << 52),
                                        _mm512_set1_epi64(std::int64_t{25} << 52)));
  const __m512d gap =
      _mm512_castsi512_pd(_mm512_maskz_max_epi64(0xFF, below, _mm512_set1_epi64(std::int64_t{1023 - 151} << 52)));
  const __m512d magnitude = _mm512_abs_pd(back);
  const __m512d zero = _mm512_setzero_pd();
  const __mmask8 certain =
      _mm512_cmp_pd_mask(bound, zero, _CMP_EQ_OQ) |
      (_mm512_cmp_pd_mask(_mm512_add_pd(distance, bound), gap, _CMP_LT_OQ) &
       _mm512_cmp_pd_mask(magnitude, _mm512_set1_pd(std::numeric_limits<double>::infinity()), _CMP_LT_OQ) &
       _mm512_cmp_pd_mask(magnitude, zero, _CMP_GT_OQ));
  uncertain = static_cast<__mmask8>(~certain);
  return rounded;
}

// certified_row_step on one zmm of block dots (a micro-tile row's panel `b_block`).
__attribute__((target("avx2,avx512f,avx512dq"), always_inline)) inline std::int64_t certified_row_step8(
    __m512d dot, __m512d bound, const double* a_block, std::int64_t depth, int r, const double* b_block, int block,
    float* accumulators) {
  __mmask8 uncertain = 0;
  const __m256 old = _mm256_load_ps(accumulators);
  _mm256_store_ps(accumulators, certified_fp32_step8(old, dot, bound, uncertain));
  if (uncertain == 0) return 0;
  alignas(32) float before[wide_width];
  _mm256_store_ps(before, old);
  std::int64_t slow = 0;
  for (int j = 0; j < wide_width; ++j) {
    if ((uncertain >> j & 1) == 0) continue;
    accumulators[j] = exact_lane_step(before[j], a_block, depth, r, b_block, j, block);
    ++slow;
  }
  return slow;
}

// wide_micro_tile on panels `panel` and `panel + 1` at once (states[0] and states[1]).
template <bool Block, bool Exact, bool Certified = false>
__attribute__((target("avx2,fma,avx512f,avx512dq"))) std::int64_t wide_micro_tile_avx512(
    const wide_packed& packed, std::int64_t row, std::int64_t panel, std::int64_t first, std::int64_t last, int block,
    int fraction_total, wide_tile_state* const states[2]) {
  const std::int64_t depth = packed.padded_depth;
  const double* a_rows = packed.a.get() + row * depth;
  const double* b_panels[2] = {packed.b.get() + panel * depth * wide_width,
                               packed.b.get() + (panel + 1) * depth * wide_width};
  const std::int32_t* a_exponents = packed.a_exponents.data() + row * packed.blocks;
  std::int64_t slow = 0;
  for (std::int64_t index = first; index < last; ++index) {
    __m512d dots[wide_rows][2];
    for (auto& row_dots : dots) row_dots[0] = row_dots[1] = _mm512_setzero_pd();
    const double* a_block = a_rows + index * block;
    const double* b_blocks[2] = {b_panels[0] + index * block * wide_width, b_panels[1] + index * block * wide_width};
    for (int k = 0; k < block; ++k) {
      const __m512d left = _mm512_loadu_pd(b_blocks[0] + k * wide_width);
      const __m512d right = _mm512_loadu_pd(b_blocks[1] + k * wide_width);
#pragma GCC unroll 4
      for (int r = 0; r < wide_rows; ++r) {
        const __m512d value = _mm512_set1_pd(a_block[r * depth + k]);
        dots[r][0] = _mm512_fmadd_pd(value, left, dots[r][0]);
        dots[r][1] = _mm512_fmadd_pd(value, right, dots[r][1]);
      }
    }
    if constexpr (Certified) {
      for (int side = 0; side < 2; ++side) {
        const auto b_at = static_cast<std::size_t>(((panel + side) * packed.blocks + index) * wide_width);
        const __m512d b_bound = _mm512_loadu_pd(&packed.b_bounds[b_at]);
        const __m512d b_grid = _mm512_loadu_pd(&packed.b_grid_norms[b_at]);
#pragma GCC unroll 4
        for (int r = 0; r < wide_rows; ++r) {
          const auto a_at = static_cast<std::size_t>((row + r) * packed.blocks + index);
          const __mmask8 exact = _mm512_cmp_pd_mask(_mm512_mul_pd(_mm512_set1_pd(packed.a_grid_norms[a_at]), b_grid),
                                                    _mm512_set1_pd(0x1p53), _CMP_LT_OQ);
          const __m512d bound =
              _mm512_maskz_mul_pd(static_cast<__mmask8>(~exact), _mm512_set1_pd(packed.a_bounds[a_at]), b_bound);
          slow += certified_row_step8(dots[r][side], bound, a_block, depth, r, b_blocks[side], block,
                                      states[side]->accumulators + r * wide_width);
        }
      }
      continue;
    }
    for (int side = 0; side < 2; ++side) {
      const std::int32_t* block_b_exponents =
          packed.b_exponents.data() + ((panel + side) * packed.blocks + index) * wide_width;
      const __m256i b_exponent = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block_b_exponents));
#pragma GCC unroll 4
      for (int r = 0; r < wide_rows; ++r) {
        const std::int32_t a_exponent = a_exponents[r * packed.blocks + index];
        const __m256i k = _mm256_add_epi32(b_exponent, _mm256_set1_epi32(a_exponent - fraction_total));
        slow += wide_row_step8<Block, Exact>(dots[r][side], k, a_exponent, block_b_exponents, fraction_total, r,
                                             *states[side]);
      }
    }
  }
  return slow;
}

// A task: 256 rows of A against 32 panels (256 columns) of B, K in chunks of 8 blocks: a chunk of
// the task's A (512 KiB at block 32) stays in L2 and a panel's (16 KiB) in L1 while the task's
// 2048 tile states (1.8 MiB) carry the sums from chunk to chunk. A and B are each read from memory
// once per 256 columns or rows of the other.
constexpr std::int64_t task_rows = 256;
constexpr std::int64_t task_panels = 32;
constexpr std::int64_t chunk_blocks = 8;

// What every task of one product shares.
struct wide_job {
  const fast_context* context;
  const wide_packed* packed;
  bool avx512;    // pairs of panels on the AVX-512 tile
  bool is_exact;  // the exact model (else fp32-block)
  bool fused;     // fp32-block with exact_too
  bool certified;  // fp32-block of float dots (certified_wide_product)
};

// The tiles of one task and their states.
struct wide_task {
  std::int64_t row_begin, row_end, panel_begin, panel_end;
  wide_tile_state* states;
  wide_tile_state& state(std::int64_t panel, std::int64_t row) const {
    const std::int64_t tile_rows = (row_end - row_begin) / wide_rows;
    return states[(panel - panel_begin) * tile_rows + (row - row_begin) / wide_rows];
  }
};

// Blocks [first, last) of every tile of a task: pairs of panels on AVX-512, the rest (or all) one
// panel at a time on AVX2. Returns the entries' scalar fp32-block steps.
std::int64_t run_chunk(const wide_job& job, const wide_task& tiles, std::int64_t first, std::int64_t last) {
  const wide_packed& packed = *job.packed;
  const int block = job.context->a->block;
  const int fraction_total = job.context->plan.fraction_total;
  std::int64_t slow = 0;
  for (std::int64_t panel = tiles.panel_begin; panel < tiles.panel_end; panel += job.avx512 ? 2 : 1) {
    const bool pair = job.avx512 && panel + 1 < tiles.panel_end;
    for (std::int64_t row = tiles.row_begin; row < tiles.row_end; row += wide_rows) {
      if (pair) {
        wide_tile_state* const states[2] = {&tiles.state(panel, row), &tiles.state(panel + 1, row)};
        if (job.certified) {
          slow += wide_micro_tile_avx512<true, false, true>(packed, row, panel, first, last, block, fraction_total, states);
        } else if (job.fused) {
          slow += wide_micro_tile_avx512<true, true>(packed, row, panel, first, last, block, fraction_total, states);
        } else if (job.is_exact) {
          wide_micro_tile_avx512<false, true>(packed, row, panel, first, last, block, fraction_total, states);
        } else {
          slow += wide_micro_tile_avx512<true, false>(packed, row, panel, first, last, block, fraction_total, states);
        }
        continue;
      }
      wide_tile_state& state = tiles.state(panel, row);
      if (job.certified) {
        slow += wide_micro_tile<true, false, true>(packed, row, panel, first, last, block, fraction_total, state);
      } else if (job.fused) {
        slow += wide_micro_tile<true, true>(packed, row, panel, first, last, block, fraction_total, state);
      } else if (job.is_exact) {
        wide_micro_tile<false, true>(packed, row, panel, first, last, block, fraction_total, state);
      } else {
        slow += wide_micro_tile<true, false>(packed, row, panel, first, last, block, fraction_total, state);
      }
    }
  }
  return slow;
}

// The exact model's value of entry (row, column) from its tile's state: NaN for a NaN block, the
// fp64 sum rounded once with the tensor scales where every step was exact, else the scaled block
// dots summed again in a long accumulator (`recomputed` set).
core_ns::scaled_exact_value exact_value(const wide_job& job, const wide_tile_state& state, int e, std::int64_t row,
                                        std::int64_t column, bool& recomputed) {
  const canonical_operand& a = *job.context->a;
  const canonical_operand& b = *job.context->b;
  const wide_packed& packed = *job.packed;
  std::uint64_t inexact_bits = 0;
  std::memcpy(&inexact_bits, &state.inexact[e], sizeof inexact_bits);
  recomputed = false;
  if (state.nan_lanes[e] != 0) return {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<double>::quiet_NaN()};
  if (inexact_bits == 0) return core_ns::round_scaled_exact(state.sums[e], a.tensor_scale, b.tensor_scale);
  recomputed = true;
  core_ns::long_accumulator total;
  const std::int64_t lane = column % wide_width;
  for (std::int64_t index = 0; index < packed.blocks; ++index) {
    const std::int32_t a_exponent = packed.a_exponents[static_cast<std::size_t>(row * packed.blocks + index)];
    const std::int32_t b_exponent =
        packed.b_exponents[static_cast<std::size_t>(((column / wide_width) * packed.blocks + index) * wide_width + lane)];
    const double dot = packed_wide_dot(packed, row, column, index, a.block);
    core_ns::add_scaled_exactly(total, scaled_block_dot(dot, a_exponent, 1, b_exponent, 1, job.context->plan.fraction_total),
                                job.context->scale);
  }
  return {total.round_to_float(), total.round_to_double()};
}

// A tile's entries into the outputs: fp32-block's accumulators through the epilogue, the exact
// model's values into out and exact, or (fused) the exact values into exact_too. Returns the exact
// model's recomputed entries.
std::int64_t write_tile(const wide_job& job, const wide_tile_state& state, std::int64_t row, std::int64_t panel,
                        matrix& out, matrix64* exact, matrix64* exact_too) {
  std::int64_t recomputed_entries = 0;
  for (int r = 0; r < wide_rows && row + r < job.context->a->rows; ++r) {
    for (int j = 0; j < wide_width && panel * wide_width + j < job.context->b->rows; ++j) {
      const int e = r * wide_width + j;
      const std::int64_t column = panel * wide_width + j;
      if (!job.is_exact) out(row + r, column) = epilogue(state.accumulators[e], job.context->alpha);
      if (!job.is_exact && !job.fused) continue;
      bool recomputed = false;
      const core_ns::scaled_exact_value value = exact_value(job, state, e, row + r, column, recomputed);
      if (job.fused) {
        (*exact_too)(row + r, column) = value.fp64;
        continue;
      }
      recomputed_entries += recomputed ? 1 : 0;
      out(row + r, column) = value.fp32;
      if (exact != nullptr) (*exact)(row + r, column) = value.fp64;
    }
  }
  return recomputed_entries;
}
// MXSCOPE_WIDE_KERNEL=avx2 keeps the kernels on AVX2 where AVX-512 is there too (the tests run both).
bool avx512_requested() {
  const char* requested = std::getenv("MXSCOPE_WIDE_KERNEL");
  return cpu_has_avx512() && (requested == nullptr || std::string_view(requested) != "avx2");
}

// Every task of a job: its tiles' states cleared, K chunk by chunk, then its outputs. Returns the
// entries' (or entry-blocks') slow steps.
std::int64_t run_job(const wide_job& job, matrix& out, matrix64* exact, matrix64* exact_too) {
  const wide_packed& packed = *job.packed;
  const std::int64_t row_tasks = (packed.padded_rows + task_rows - 1) / task_rows;
  const std::int64_t panel_tasks = (packed.panels + task_panels - 1) / task_panels;
  const fast_context& context = *job.context;
  std::int64_t total = 0;
#pragma omp parallel reduction(+ : total) if (context.a->rows * context.b->rows * context.a->depth >= parallel_products)
  {
    std::vector<wide_tile_state> states(static_cast<std::size_t>(task_rows / wide_rows * task_panels));
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < row_tasks * panel_tasks; ++task) {
      const std::int64_t row_begin = (task / panel_tasks) * task_rows;
      const std::int64_t panel_begin = (task % panel_tasks) * task_panels;
      const wide_task tiles{row_begin, std::min(packed.padded_rows, row_begin + task_rows), panel_begin,
                            std::min(packed.panels, panel_begin + task_panels), states.data()};
      for (std::int64_t panel = tiles.panel_begin; panel < tiles.panel_end; ++panel) {
        for (std::int64_t row = tiles.row_begin; row < tiles.row_end; row += wide_rows) tiles.state(panel, row).clear();
      }
      for (std::int64_t first = 0; first < packed.blocks; first += chunk_blocks) {
        total += run_chunk(job, tiles, first, std::min(packed.blocks, first + chunk_blocks));
      }
      for (std::int64_t panel = tiles.panel_begin; panel < tiles.panel_end; ++panel) {
        for (std::int64_t row = tiles.row_begin; row < tiles.row_end; row += wide_rows) {
          total += write_tile(job, tiles.state(panel, row), row, panel, out, exact, exact_too);
        }
      }
    }
  }
  return total;
}
#endif

}  // namespace

bool wide_kernel_applies(const canonical_operand& a, const canonical_operand& b, const fast_plan& plan,
                         const accumulation_model& model) {
  const bool model_fits = model.kind == accumulation_kind::fp32_block || model.kind == accumulation_kind::exact ||
                          (model.kind == accumulation_kind::fp32_group && model.blocks_per_group == 1);
  return model_fits && !plan.use_float && plan.bound_bits <= 53 && a.scale_mantissa_max <= 1 &&
         b.scale_mantissa_max <= 1 && a.block == b.block;
}

bool wide_kernel_product(const fast_context& context, matrix& out, matrix64* exact, std::int64_t& fallbacks,
                         matrix64* exact_too) {
#if MXSCOPE_WIDE_X86
  if (!cpu_has_avx2_and_fma()) return false;
  const wide_packed packed = pack_wide(*context.a, *context.b);
  const wide_job job{&context,
                     &packed,
                     avx512_requested(),
                     context.model.kind == accumulation_kind::exact,
                     exact_too != nullptr && context.model.kind != accumulation_kind::exact,
                     false};
  fallbacks += run_job(job, out, exact, exact_too);
  return true;
#else
  (void)context;
  (void)out;
  (void)exact;
  (void)fallbacks;
  (void)exact_too;
  return false;
#endif
}

bool certified_wide_applies(const canonical_operand& a, const canonical_operand& b) {
  return a.block == b.block && a.block >= 1 && a.block <= 64 && a.finite && b.finite;
}

bool certified_wide_product(const canonical_operand& a, const canonical_operand& b, matrix& out,
                            std::int64_t& fallbacks) {
#if MXSCOPE_WIDE_X86
  if (!cpu_has_avx2_and_fma()) return false;
  accumulation_model model;
  model.kind = accumulation_kind::fp32_block;
  const fast_context context{&a, &b, fast_plan{}, model, 1.0f, core_ns::make_scale_product(1.0f, 1.0f), {}, {}, true};
  wide_packed packed = pack_wide(a, b, false);
  pack_bounds(a, b, packed);
  const wide_job job{&context, &packed, avx512_requested(), false, false, true};
  fallbacks += run_job(job, out, nullptr, nullptr);
  return true;
#else
  (void)a;
  (void)b;
  (void)out;
  (void)fallbacks;
  return false;
#endif
}

}  // namespace mxscope::gemm_internal

