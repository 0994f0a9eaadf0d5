// The CPU GEMM's integer path: operands with integer elements (MX, NVFP4, per-tensor fp8) whose
// block dots are exact in fp32 or fp64 GEMMs, and the AVX2 int16 kernels for MX-style operands
// (x86-64, chosen at run time). The rest of the CPU GEMM is src/gemm.cpp.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include <optional>

#include "gemm_internal.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#define MXSCOPE_GEMM_X86 1
#endif

namespace mxscope::gemm_internal {

// The fast path for operands with integer elements (MX, NVFP4, per-tensor fp8).
//
// Block dot of entry (i, j) and K-block b, in integers: D = sum over the block of IA * IB where
// IA = qa * 2^fa and IB = qb * 2^fb are the elements' integer values. |D| < 2^bound_bits with
// bound_bits = bits(block) + bits(max IA) + bits(max IB). Every partial sum of such a dot is an
// integer below 2^bound_bits, so a floating-point GEMM computes D exactly in ANY summation order
// (Eigen's blocking and vectorization included) as long as bound_bits <= 24 in fp32 (fp4, fp6 and
// int8 pairs at block 32) or <= 53 in fp64 (fp8 e4m3 pairs).
// The scaled block dot is c = D * ma * mb * 2^(ea + eb - fa - fb) with integer scale mantissas
// (1 for MX, at most 4 bits for ue4m3): D * ma * mb < 2^53 is exact in a double and the power of
// two keeps it exact (the exponent stays within about +-300).

std::optional<fast_plan> plan_fast_path(const canonical_operand& a, const canonical_operand& b,
                                        const accumulation_model& model) {
  // fp32-seq and trunc-promote have no block-dot fast path: their steps see single products.
  if (model.kind == accumulation_kind::fp32_seq || model.kind == accumulation_kind::trunc_promote) return std::nullopt;
  if (!a.integer_elements || !b.integer_elements) return std::nullopt;
  fast_plan plan;
  plan.bound_bits = bits_of(a.block) + bits_of(a.integer_max) + bits_of(b.integer_max);
  if (plan.bound_bits > 53) return std::nullopt;
  if (plan.bound_bits + bits_of(a.scale_mantissa_max) + bits_of(b.scale_mantissa_max) > 53) return std::nullopt;
  plan.use_float = plan.bound_bits <= 24;
  plan.power_of_two_scales = plan.use_float && a.scale_mantissa_max <= 1 && b.scale_mantissa_max <= 1;
  plan.fraction_total = a.fraction_bits + b.fraction_bits;
  return plan;
}


namespace {

template <class T>
std::vector<T> integer_values(const canonical_operand& operand) {
  std::vector<T> values(operand.elements.size());
  const double scale = core_ns::pow2(operand.fraction_bits);
  // Exact: a power-of-two scaling of a value with a short significand.
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<T>(static_cast<double>(operand.elements[i]) * scale);
  return values;
}

// fp32-block with power-of-two scales and D exact in fp32: c = D * 2^k is exactly representable
// in fp32 whenever -126 <= k and |D| * 2^k < 2^128 (k <= 128 - bound_bits): D has at most 24 bits,
// and 2^k is a normal fp32 number, so the fp32 product D * 2^k is exact. The fp32 addition
// acc + c then rounds the exact sum once (RNE, the default mode): it IS fl32(acc + c). Rows of a
// tile whose exponents leave that range (or meet a NaN block) take the per-entry exact step.
std::int64_t fp32_block_tile_float(const fast_context& context, const float* a_values, const float* b_values,
                                   std::int64_t m0, std::int64_t rows, std::int64_t n0, std::int64_t cols,
                                   std::vector<float>& dots, std::vector<float>& accumulators) {
  const canonical_operand& a = *context.a;
  const canonical_operand& b = *context.b;
  const std::int64_t n = b.rows;
  const int fraction_total = context.plan.fraction_total;
  const int highest_k = 128 - context.plan.bound_bits;
  std::int64_t fallbacks = 0;
  std::fill(accumulators.begin(), accumulators.begin() + rows * cols, 0.0f);
  for (std::int64_t block = 0; block < a.blocks; ++block) {
    const std::int64_t k0 = block * a.block;
    const std::int64_t length = std::min<std::int64_t>(a.block, a.depth - k0);
    exact_block_products(a_values, b_values, a.depth, m0, rows, n0, cols, k0, length, dots.data());
    const std::int32_t* b_exponents = context.b_exponents.data() + block * n + n0;
    std::int32_t b_lowest = std::numeric_limits<std::int32_t>::max();
    std::int32_t b_highest = std::numeric_limits<std::int32_t>::min();
    for (std::int64_t j = 0; j < cols; ++j) {
      b_lowest = std::min(b_lowest, b_exponents[j]);
      b_highest = std::max(b_highest, b_exponents[j]);
    }
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int32_t a_exponent = a.scale_exponents[static_cast<std::size_t>((m0 + r) * a.blocks + block)];
      float* accumulator_row = accumulators.data() + r * cols;
      const float* dot_row = dots.data() + r * cols;
      const std::int64_t k_low = static_cast<std::int64_t>(a_exponent) + b_lowest - fraction_total;
      const std::int64_t k_high = static_cast<std::int64_t>(a_exponent) + b_highest - fraction_total;
      if (k_low >= -126 && k_high <= highest_k) {
        const std::int32_t biased = a_exponent - fraction_total + 127;
        for (std::int64_t j = 0; j < cols; ++j) {
          const float power = core_ns::bits_float(static_cast<std::uint32_t>(biased + b_exponents[j]) << 23);
          // dot + 0.0f maps a -0 dot to +0 (an exactly zero sum is +0).
          accumulator_row[j] = accumulator_row[j] + (dot_row[j] + 0.0f) * power;
        }
      } else {
        for (std::int64_t j = 0; j < cols; ++j) {
          const double contribution = scaled_block_dot(dot_row[j], a_exponent, 1, b_exponents[j], 1, fraction_total);
          accumulator_row[j] = add_exact_value(accumulator_row[j], contribution);
        }
        fallbacks += cols;
      }
    }
  }
  return fallbacks;
}

// The general tile: block dots in T, scaled block dots as exact doubles, then the model.
template <class T>
std::int64_t general_tile(const fast_context& context, const T* a_values, const T* b_values, std::int64_t m0,
                          std::int64_t rows, std::int64_t n0, std::int64_t cols, std::vector<T>& dots,
                          std::vector<double>& contributions, std::vector<float>& accumulators,
                          std::vector<core_ns::long_accumulator>& totals, std::vector<std::uint8_t>& nan_entries,
                          matrix& out, matrix64* exact) {
  const canonical_operand& a = *context.a;
  const canonical_operand& b = *context.b;
  const std::int64_t n = b.rows;
  const std::int64_t entries = rows * cols;
  const accumulation_model& model = context.model;
  const bool is_exact = model.kind == accumulation_kind::exact;
  const std::int64_t group = model.kind == accumulation_kind::fp32_group ? model.blocks_per_group : 1;
  std::int64_t fallbacks = 0;

  if (is_exact) {
    for (std::int64_t e = 0; e < entries; ++e) totals[static_cast<std::size_t>(e)].clear();
    std::fill(nan_entries.begin(), nan_entries.begin() + entries, std::uint8_t{0});
  } else {
    std::fill(accumulators.begin(), accumulators.begin() + entries, 0.0f);
  }

  for (std::int64_t group_begin = 0; group_begin < a.blocks; group_begin += group) {
    const std::int64_t group_end = std::min(a.blocks, group_begin + group);
    for (std::int64_t block = group_begin; block < group_end; ++block) {
      const std::int64_t k0 = block * a.block;
      const std::int64_t length = std::min<std::int64_t>(a.block, a.depth - k0);
      exact_block_products(a_values, b_values, a.depth, m0, rows, n0, cols, k0, length, dots.data());
      const std::int32_t* b_exponents = context.b_exponents.data() + block * n + n0;
      const std::int32_t* b_mantissas = context.b_mantissas.data() + block * n + n0;
      double* slot = contributions.data() + (block - group_begin) * entries;
      for (std::int64_t r = 0; r < rows; ++r) {
        const auto a_at = static_cast<std::size_t>((m0 + r) * a.blocks + block);
        const std::int32_t a_exponent = a.scale_exponents[a_at];
        const std::int32_t a_mantissa = a.scale_mantissas[a_at];
        for (std::int64_t j = 0; j < cols; ++j) {
          slot[r * cols + j] = scaled_block_dot(static_cast<double>(dots[static_cast<std::size_t>(r * cols + j)]),
                                                a_exponent, a_mantissa, b_exponents[j], b_mantissas[j],
                                                context.plan.fraction_total);
        }
      }
      if (is_exact) {
        for (std::int64_t e = 0; e < entries; ++e) {
          const double contribution = slot[e];
          if (std::isnan(contribution)) {
            nan_entries[static_cast<std::size_t>(e)] = 1;
          } else {
            add_scaled_exactly(totals[static_cast<std::size_t>(e)], contribution, context.scale);
          }
        }
      }
    }
    if (is_exact) continue;
    add_groups_exactly(accumulators.data(), contributions.data(), entries, group_end - group_begin, nullptr);
  }

  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < cols; ++j) {
      const auto e = static_cast<std::size_t>(r * cols + j);
      if (is_exact) {
        if (nan_entries[e] != 0) {
          out(m0 + r, n0 + j) = std::numeric_limits<float>::quiet_NaN();
          if (exact != nullptr) (*exact)(m0 + r, n0 + j) = std::numeric_limits<double>::quiet_NaN();
        } else {
          out(m0 + r, n0 + j) = totals[e].round_to_float();
          if (exact != nullptr) (*exact)(m0 + r, n0 + j) = totals[e].round_to_double();
        }
      } else {
        out(m0 + r, n0 + j) = epilogue(accumulators[e], context.alpha);
      }
    }
  }
  return fallbacks;
}

template <class T>
std::int64_t fast_product(fast_context& context, matrix& out, matrix64* exact) {
  const canonical_operand& a = *context.a;
  const canonical_operand& b = *context.b;
  const std::vector<T> a_values = integer_values<T>(a);
  const std::vector<T> b_values = integer_values<T>(b);
  const std::int64_t n = b.rows;
  context.b_exponents.assign(static_cast<std::size_t>(b.blocks * n), 0);
  context.b_mantissas.assign(static_cast<std::size_t>(b.blocks * n), 1);
  for (std::int64_t j = 0; j < n; ++j) {
    for (std::int64_t block = 0; block < b.blocks; ++block) {
      context.b_exponents[static_cast<std::size_t>(block * n + j)] =
          b.scale_exponents[static_cast<std::size_t>(j * b.blocks + block)];
      context.b_mantissas[static_cast<std::size_t>(block * n + j)] =
          b.scale_mantissas[static_cast<std::size_t>(j * b.blocks + block)];
    }
  }
  const bool is_exact = context.model.kind == accumulation_kind::exact;
  const bool float_block =
      std::is_same_v<T, float> && context.plan.power_of_two_scales && context.model.kind == accumulation_kind::fp32_block;
  const std::int64_t tile_rows = is_exact ? tile_rows_exact : tile_rows_block;
  const std::int64_t tile_cols = is_exact ? tile_cols_exact : tile_cols_block;
  const std::int64_t row_tiles = (a.rows + tile_rows - 1) / tile_rows;
  const std::int64_t col_tiles = (n + tile_cols - 1) / tile_cols;
  const std::int64_t group = context.model.kind == accumulation_kind::fp32_group ? context.model.blocks_per_group : 1;
  std::int64_t fallbacks = 0;

#pragma omp parallel reduction(+ : fallbacks) if (a.rows * n * a.depth >= parallel_products)
  {
    std::vector<T> dots(static_cast<std::size_t>(tile_rows * tile_cols));
    std::vector<float> accumulators(static_cast<std::size_t>(tile_rows * tile_cols));
    std::vector<double> contributions;
    std::vector<core_ns::long_accumulator> totals;
    std::vector<std::uint8_t> nan_entries;
    if (!float_block) {
      if (is_exact) {
        contributions.resize(static_cast<std::size_t>(tile_rows * tile_cols));
        totals.resize(static_cast<std::size_t>(tile_rows * tile_cols));
        nan_entries.resize(static_cast<std::size_t>(tile_rows * tile_cols));
      } else {
        contributions.resize(static_cast<std::size_t>(std::min(group, std::max<std::int64_t>(a.blocks, 1)) * tile_rows *
                                                      tile_cols));
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t tile = 0; tile < row_tiles * col_tiles; ++tile) {
      const std::int64_t m0 = (tile / col_tiles) * tile_rows;
      const std::int64_t n0 = (tile % col_tiles) * tile_cols;
      const std::int64_t rows = std::min(tile_rows, a.rows - m0);
      const std::int64_t cols = std::min(tile_cols, n - n0);
      if constexpr (std::is_same_v<T, float>) {
        if (float_block) {
          fallbacks += fp32_block_tile_float(context, a_values.data(), b_values.data(), m0, rows, n0, cols, dots,
                                             accumulators);
          for (std::int64_t r = 0; r < rows; ++r) {
            for (std::int64_t j = 0; j < cols; ++j) {
              out(m0 + r, n0 + j) = epilogue(accumulators[static_cast<std::size_t>(r * cols + j)], context.alpha);
            }
          }
          continue;
        }
      }
      fallbacks += general_tile<T>(context, a_values.data(), b_values.data(), m0, rows, n0, cols, dots, contributions,
                                   accumulators, totals, nan_entries, out, exact);
    }
  }
  return fallbacks;
}

// ------------------------------------------------------------------------------------------------
// fp32-block with an AVX2 integer kernel (x86-64 with AVX2, chosen at run time).
//
// Same arithmetic as fp32_block_tile_float, in registers: the integer element values fit int16
// (|2q| <= 12 for fp4, |8q| <= 60, |16q| <= 448, |64q| <= 127), vpmaddwd forms a0*b0 + a1*b1 in
// int32 exactly, and the int32 sums of a block stay below 2^bound_bits <= 2^24, so the block dot D
// is exact and its conversion to fp32 too. acc + D * 2^k is then the fp32 step proven above, with
// the same per-row range check and the same exact per-entry step outside it. A micro tile of
// 4 output rows x 8 columns keeps its accumulators in registers for the whole reduction, blocks in
// ascending order, so each entry sees exactly the sequence of roundings of the definition.

constexpr int micro_rows = 4;
constexpr int panel_width = 8;

struct packed_int16_operands {
  std::int64_t padded_rows = 0;   // A rows rounded up to micro_rows
  std::int64_t panels = 0;        // B columns in groups of panel_width
  std::int64_t padded_depth = 0;  // blocks * block
  std::vector<std::int16_t> a;    // [padded_rows, padded_depth]
  std::vector<std::int16_t> b;    // [panels, padded_depth / 2, panel_width, 2]: k-pairs interleaved
  std::vector<std::int32_t> a_exponents;  // [padded_rows, blocks]
  std::vector<std::int32_t> b_exponents;  // [panels, blocks, panel_width]
};

// The int16 kernels cover MX-style operands (power-of-two block scales, no tensor scales) whose
// integer element values fit int16, with block dots below 2^24 and blocks of even length.
constexpr int max_kernel_group = 16;

packed_int16_operands pack_int16(const canonical_operand& a, const canonical_operand& b) {
  packed_int16_operands packed;
  packed.padded_rows = (a.rows + micro_rows - 1) / micro_rows * micro_rows;
  packed.panels = (b.rows + panel_width - 1) / panel_width;
  packed.padded_depth = a.blocks * a.block;
  const std::int64_t pairs = packed.padded_depth / 2;
  packed.a.assign(static_cast<std::size_t>(packed.padded_rows * packed.padded_depth), 0);
  packed.b.assign(static_cast<std::size_t>(packed.panels * packed.padded_depth * panel_width), 0);
  packed.a_exponents.assign(static_cast<std::size_t>(packed.padded_rows * a.blocks), 0);
  packed.b_exponents.assign(static_cast<std::size_t>(packed.panels * a.blocks * panel_width), 0);
  const double a_scale = core_ns::pow2(a.fraction_bits);
  const double b_scale = core_ns::pow2(b.fraction_bits);
#pragma omp parallel for schedule(static) if (a.rows * a.depth >= parallel_elements)
  for (std::int64_t row = 0; row < a.rows; ++row) {
    for (std::int64_t k = 0; k < a.depth; ++k) {
      packed.a[static_cast<std::size_t>(row * packed.padded_depth + k)] =
          static_cast<std::int16_t>(static_cast<double>(a.elements[static_cast<std::size_t>(row * a.depth + k)]) * a_scale);
    }
    for (std::int64_t block = 0; block < a.blocks; ++block) {
      packed.a_exponents[static_cast<std::size_t>(row * a.blocks + block)] =
          a.scale_exponents[static_cast<std::size_t>(row * a.blocks + block)];
    }
  }
#pragma omp parallel for schedule(static) if (b.rows * b.depth >= parallel_elements)
  for (std::int64_t panel = 0; panel < packed.panels; ++panel) {
    for (int lane = 0; lane < panel_width; ++lane) {
      const std::int64_t column = panel * panel_width + lane;
      if (column >= b.rows) continue;
      for (std::int64_t k = 0; k < b.depth; ++k) {
        const auto at = static_cast<std::size_t>(((panel * pairs + k / 2) * panel_width + lane) * 2 + k % 2);
        packed.b[at] = static_cast<std::int16_t>(
            static_cast<double>(b.elements[static_cast<std::size_t>(column * b.depth + k)]) * b_scale);
      }
      for (std::int64_t block = 0; block < b.blocks; ++block) {
        packed.b_exponents[static_cast<std::size_t>((panel * a.blocks + block) * panel_width + lane)] =
            b.scale_exponents[static_cast<std::size_t>(column * b.blocks + block)];
      }
    }
  }
  return packed;
}

// The exact block dot of a packed entry (scalar): the slow step of the exact model's kernel.
std::int64_t packed_block_dot(const packed_int16_operands& packed, std::int64_t row, std::int64_t column, std::int64_t block,
                              int block_length) {
  const std::int64_t pairs = packed.padded_depth / 2;
  const std::int64_t panel = column / panel_width;
  const std::int64_t lane = column % panel_width;
  std::int64_t dot = 0;
  for (std::int64_t k = block * block_length; k < (block + 1) * block_length; ++k) {
    const std::int16_t a_value = packed.a[static_cast<std::size_t>(row * packed.padded_depth + k)];
    const std::int16_t b_value =
        packed.b[static_cast<std::size_t>(((panel * pairs + k / 2) * panel_width + lane) * 2 + k % 2)];
    dot += static_cast<std::int64_t>(a_value) * b_value;
  }
  return dot;
}

#if MXSCOPE_GEMM_X86
// The exact int32 block dots of a micro tile for one K-block (exact: see above).
__attribute__((target("avx2"), always_inline)) inline void micro_tile_block_dots(const std::int16_t* a_block,
                                                                                 std::int64_t padded_depth,
                                                                                 const std::int16_t* b_block, int pairs,
                                                                                 __m256i* dots) {
  for (int r = 0; r < micro_rows; ++r) dots[r] = _mm256_setzero_si256();
  for (int pair = 0; pair < pairs; ++pair) {
    const __m256i b_pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b_block + pair * 2 * panel_width));
#pragma GCC unroll 4
    for (int r = 0; r < micro_rows; ++r) {
      std::int32_t a_pair = 0;
      std::memcpy(&a_pair, a_block + r * padded_depth + 2 * pair, sizeof a_pair);
      dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(_mm256_set1_epi32(a_pair), b_pairs));
    }
  }
}

// One fp32-block step of a micro-tile row's 8 lanes, acc = fl32(acc + D 2^k) with k = a_exponent +
// the lanes' B exponents - fraction_total: one fp32 multiply-add where every 2^k is a normal fp32
// and k <= highest_k (then D 2^k and the sum are exact or rounded once: D < 2^bound_bits), else
// lane by lane through add_exact_value. Returns the lanes taken the slow way.
__attribute__((target("avx2"), always_inline)) inline std::int64_t fp32_block_row_step(
    __m256& accumulator, __m256i dot, std::int32_t a_exponent, __m256i b_exponent, const std::int32_t* b_exponents,
    int fraction_total, int highest_k) {
  const __m256i k = _mm256_add_epi32(b_exponent, _mm256_set1_epi32(a_exponent - fraction_total));
  const __m256i outside =
      _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(-126), k), _mm256_cmpgt_epi32(k, _mm256_set1_epi32(highest_k)));
  if (_mm256_testz_si256(outside, outside)) {
    const __m256 power = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
    accumulator = _mm256_add_ps(accumulator, _mm256_mul_ps(_mm256_cvtepi32_ps(dot), power));
    return 0;
  }
  alignas(32) float values[panel_width];
  alignas(32) std::int32_t block_dots[panel_width];
  _mm256_store_ps(values, accumulator);
  _mm256_store_si256(reinterpret_cast<__m256i*>(block_dots), dot);
  for (int j = 0; j < panel_width; ++j) {
    values[j] = add_exact_value(values[j], scaled_block_dot(block_dots[j], a_exponent, 1, b_exponents[j], 1, fraction_total));
  }
  accumulator = _mm256_load_ps(values);
  return panel_width;
}

__attribute__((target("avx2"))) std::int64_t fp32_block_micro_tile_avx2(
    const std::int16_t* a_rows, std::int64_t padded_depth, const std::int16_t* b_panel, const std::int32_t* a_exponents,
    const std::int32_t* b_exponents, std::int64_t blocks, int block, int fraction_total, int highest_k, float* out) {
  __m256 accumulators[micro_rows];
  for (int r = 0; r < micro_rows; ++r) accumulators[r] = _mm256_setzero_ps();
  std::int64_t fallbacks = 0;
  for (std::int64_t index = 0; index < blocks; ++index) {
    __m256i dots[micro_rows];
    micro_tile_block_dots(a_rows + index * block, padded_depth, b_panel + index * block * panel_width, block / 2, dots);
    const std::int32_t* block_b_exponents = b_exponents + index * panel_width;
    const __m256i b_exponent = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block_b_exponents));
#pragma GCC unroll 4
    for (int r = 0; r < micro_rows; ++r) {
      fallbacks += fp32_block_row_step(accumulators[r], dots[r], a_exponents[r * blocks + index], b_exponent,
                                       block_b_exponents, fraction_total, highest_k);
    }
  }
  for (int r = 0; r < micro_rows; ++r) _mm256_storeu_ps(out + r * panel_width, accumulators[r]);
  return fallbacks;
}

// fp32-group:G and exact on a micro tile. Each scaled block dot c = D * 2^k is formed exactly in
// a double (D < 2^24, |k| < 1000). Group sums (and, for exact, the whole sum) are accumulated in
// fp64 with two_sum: when every error term is zero the fp64 sum IS the exact sum, and then
// - fp32-group: acc + g is formed the same way; when exact, converting it to fp32 rounds the
//   exact value once (RNE): fl32(acc + g). Lanes where any step was inexact redo the group with
//   core::add_exactly_to_float on the stored terms.
// - exact: the fp64 sum is the exact result rounded to fp64 (it is exact), its fp32 conversion the
//   exact result rounded once to fp32. Inexact lanes are marked for an exact recomputation.
// Lanes whose block is a NaN block (its exponent is the far-away marker) end as NaN.
constexpr int tile_entries = micro_rows * panel_width;

// One exact-sum step of a micro-tile row's 8 lanes (row r of the tile's arrays): the scaled block
// dots c = D 2^k (k = a_exponent + the lanes' B exponents - fraction_total) added to the fp64
// sums by two_sum, lanes whose step was inexact marked, lanes of a NaN block (k beyond +-1000)
// marked in nan_lanes; with terms, each c stored there too (fp32-group's redo).
__attribute__((target("avx2"), always_inline)) inline void exact_row_step(__m256i dot, __m256i b_exponent,
                                                                          std::int32_t a_exponent, int fraction_total,
                                                                          int r, double* sums, double* inexact,
                                                                          std::int32_t* nan_lanes, double* terms) {
  const __m256i k = _mm256_add_epi32(b_exponent, _mm256_set1_epi32(a_exponent - fraction_total));
  const __m256i outside =
      _mm256_or_si256(_mm256_cmpgt_epi32(k, _mm256_set1_epi32(1000)), _mm256_cmpgt_epi32(_mm256_set1_epi32(-1000), k));
  __m256i* nan_row = reinterpret_cast<__m256i*>(nan_lanes + r * panel_width);
  _mm256_store_si256(nan_row, _mm256_or_si256(_mm256_load_si256(nan_row), outside));
  const __m256i safe_k = _mm256_andnot_si256(outside, k);
  for (int half = 0; half < 2; ++half) {
    const __m128i k4 = half == 0 ? _mm256_castsi256_si128(safe_k) : _mm256_extracti128_si256(safe_k, 1);
    const __m128i d4 = half == 0 ? _mm256_castsi256_si128(dot) : _mm256_extracti128_si256(dot, 1);
    const __m256d power = _mm256_castsi256_pd(
        _mm256_slli_epi64(_mm256_add_epi64(_mm256_cvtepi32_epi64(k4), _mm256_set1_epi64x(1023)), 52));
    const __m256d contribution = _mm256_mul_pd(_mm256_cvtepi32_pd(d4), power);
    const int at = r * panel_width + half * 4;
    if (terms != nullptr) _mm256_store_pd(terms + at, contribution);
    // two_sum(sum, contribution): the error term is zero exactly when the sum is exact.
    const __m256d sum = _mm256_load_pd(sums + at);
    const __m256d total = _mm256_add_pd(sum, contribution);
    const __m256d contribution_part = _mm256_sub_pd(total, sum);
    const __m256d error = _mm256_add_pd(_mm256_sub_pd(sum, _mm256_sub_pd(total, contribution_part)),
                                        _mm256_sub_pd(contribution, contribution_part));
    _mm256_store_pd(sums + at, total);
    _mm256_store_pd(inexact + at, _mm256_or_pd(_mm256_load_pd(inexact + at),
                                               _mm256_cmp_pd(error, _mm256_setzero_pd(), _CMP_NEQ_UQ)));
  }
}

struct grouped_tile_state {
  alignas(32) float accumulators[tile_entries];
  alignas(32) double sums[tile_entries];
  alignas(32) double inexact[tile_entries];  // nonzero bits: some step of the current sum was inexact
  alignas(32) std::int32_t nan_lanes[tile_entries];
  alignas(32) double terms[max_kernel_group][tile_entries];
};

__attribute__((target("avx2"))) void grouped_micro_tile_avx2(
    const std::int16_t* a_rows, std::int64_t padded_depth, const std::int16_t* b_panel, const std::int32_t* a_exponents,
    const std::int32_t* b_exponents, std::int64_t blocks, int block, int fraction_total, int group, float* out32,
    double* out64, std::uint8_t* redo) {
  grouped_tile_state state;
  for (int e = 0; e < tile_entries; ++e) {
    state.accumulators[e] = 0.0f;
    state.sums[e] = 0.0;
    state.inexact[e] = 0.0;
    state.nan_lanes[e] = 0;
  }
  const bool is_exact = group == 0;
  const __m256d zero = _mm256_setzero_pd();
  int in_group = 0;
  for (std::int64_t index = 0; index < blocks; ++index) {
    __m256i dots[micro_rows];
    micro_tile_block_dots(a_rows + index * block, padded_depth, b_panel + index * block * panel_width, block / 2, dots);
    const __m256i b_exponent = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b_exponents + index * panel_width));
    double* terms = state.terms[is_exact ? 0 : in_group];
    for (int r = 0; r < micro_rows; ++r) {
      exact_row_step(dots[r], b_exponent, a_exponents[r * blocks + index], fraction_total, r, state.sums, state.inexact,
                     state.nan_lanes, terms);
    }
    if (is_exact) continue;
    ++in_group;
    if (in_group < group && index + 1 < blocks) continue;
    // Close the group: acc = fl32(acc + g).
    for (int at = 0; at < tile_entries; at += 4) {
      const __m256d accumulator = _mm256_cvtps_pd(_mm_load_ps(state.accumulators + at));
      const __m256d group_sum = _mm256_load_pd(state.sums + at);
      const __m256d total = _mm256_add_pd(accumulator, group_sum);
      const __m256d group_part = _mm256_sub_pd(total, accumulator);
      const __m256d error = _mm256_add_pd(_mm256_sub_pd(accumulator, _mm256_sub_pd(total, group_part)),
                                          _mm256_sub_pd(group_sum, group_part));
      const __m256d inexact = _mm256_or_pd(_mm256_load_pd(state.inexact + at), _mm256_cmp_pd(error, zero, _CMP_NEQ_UQ));
      const float previous[4] = {state.accumulators[at], state.accumulators[at + 1], state.accumulators[at + 2],
                                 state.accumulators[at + 3]};
      _mm_store_ps(state.accumulators + at, _mm256_cvtpd_ps(total));
      const int slow_lanes = _mm256_movemask_pd(inexact);
      if (slow_lanes == 0) continue;
      for (int lane = 0; lane < 4; ++lane) {
        if ((slow_lanes & (1 << lane)) == 0) continue;
        const int entry = at + lane;
        const float old = previous[lane];
        if (!std::isfinite(old)) {
          state.accumulators[entry] = old;  // inf + finite terms stays inf (IEEE)
          continue;
        }
        double lane_terms[max_kernel_group];
        for (int g = 0; g < in_group; ++g) lane_terms[g] = state.terms[g][entry];
        state.accumulators[entry] = core_ns::add_exactly_to_float(old, lane_terms, in_group);
      }
    }
    for (int e = 0; e < tile_entries; ++e) {
      state.sums[e] = 0.0;
      state.inexact[e] = 0.0;
    }
    in_group = 0;
  }
  for (int e = 0; e < tile_entries; ++e) {
    const bool nan = state.nan_lanes[e] != 0;
    if (is_exact) {
      std::uint64_t inexact_bits = 0;
      std::memcpy(&inexact_bits, &state.inexact[e], sizeof inexact_bits);
      redo[e] = !nan && inexact_bits != 0;
      out64[e] = nan ? std::numeric_limits<double>::quiet_NaN() : state.sums[e];
      out32[e] = static_cast<float>(out64[e]);
    } else {
      out32[e] = nan ? std::numeric_limits<float>::quiet_NaN() : state.accumulators[e];
    }
  }
}

// fp32-block and, from the same block dots, exact (gemm_options::exact_too: the replay's exact
// product of the strategy's quantized operands): fp32_block_row_step into out32 and exact_row_step
// (inexact lanes marked in redo, NaN blocks as NaN) into out64, the block dots formed once.
__attribute__((target("avx2"))) std::int64_t block_and_exact_micro_tile_avx2(
    const std::int16_t* a_rows, std::int64_t padded_depth, const std::int16_t* b_panel, const std::int32_t* a_exponents,
    const std::int32_t* b_exponents, std::int64_t blocks, int block, int fraction_total, int highest_k, float* out32,
    double* out64, std::uint8_t* redo) {
  __m256 accumulators[micro_rows];
  for (int r = 0; r < micro_rows; ++r) accumulators[r] = _mm256_setzero_ps();
  alignas(32) double sums[tile_entries] = {};
  alignas(32) double inexact[tile_entries] = {};
  alignas(32) std::int32_t nan_lanes[tile_entries] = {};
  std::int64_t fallbacks = 0;
  for (std::int64_t index = 0; index < blocks; ++index) {
    __m256i dots[micro_rows];
    micro_tile_block_dots(a_rows + index * block, padded_depth, b_panel + index * block * panel_width, block / 2, dots);
    const std::int32_t* block_b_exponents = b_exponents + index * panel_width;
    const __m256i b_exponent = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block_b_exponents));
    for (int r = 0; r < micro_rows; ++r) {
      const std::int32_t a_exponent = a_exponents[r * blocks + index];
      fallbacks += fp32_block_row_step(accumulators[r], dots[r], a_exponent, b_exponent, block_b_exponents,
                                       fraction_total, highest_k);
      exact_row_step(dots[r], b_exponent, a_exponent, fraction_total, r, sums, inexact, nan_lanes, nullptr);
    }
  }
  for (int r = 0; r < micro_rows; ++r) _mm256_storeu_ps(out32 + r * panel_width, accumulators[r]);
  for (int e = 0; e < tile_entries; ++e) {
    std::uint64_t inexact_bits = 0;
    std::memcpy(&inexact_bits, &inexact[e], sizeof inexact_bits);
    redo[e] = nan_lanes[e] == 0 && inexact_bits != 0;
    out64[e] = nan_lanes[e] != 0 ? std::numeric_limits<double>::quiet_NaN() : sums[e];
  }
  return fallbacks;
}

// Truncates 8 int32 products toward zero by per-lane shifts (right, then left: one of them is 0)
// and adds them to two int64 sums of 4 lanes each.
__attribute__((target("avx2"), always_inline)) inline void add_truncated_products(
    __m256i products, __m256i left_low, __m256i left_high, __m256i right_low, __m256i right_high, __m256i& sum_low,
    __m256i& sum_high) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i magnitude = _mm256_abs_epi32(products);
  const __m256i negative = _mm256_cmpgt_epi32(zero, products);
  const __m256i low_sign = _mm256_cvtepi32_epi64(_mm256_castsi256_si128(negative));
  const __m256i high_sign = _mm256_cvtepi32_epi64(_mm256_extracti128_si256(negative, 1));
  __m256i low = _mm256_cvtepu32_epi64(_mm256_castsi256_si128(magnitude));
  __m256i high = _mm256_cvtepu32_epi64(_mm256_extracti128_si256(magnitude, 1));
  low = _mm256_sllv_epi64(_mm256_srlv_epi64(low, right_low), left_low);
  high = _mm256_sllv_epi64(_mm256_srlv_epi64(high, right_high), left_high);
  // (v xor s) - s negates v where s is all ones.
  sum_low = _mm256_add_epi64(sum_low, _mm256_sub_epi64(_mm256_xor_si256(low, low_sign), low_sign));
  sum_high = _mm256_add_epi64(sum_high, _mm256_sub_epi64(_mm256_xor_si256(high, high_sign), high_sign));
}

// trunc-align on a micro tile. Each product P * 2^k_b (P = IA * IB, the integer product of one
// pair of elements, k_b = ea + eb - fa - fb) is formed exactly: vpmaddwd of (a, 0) or (0, a)
// against the interleaved pairs of B gives a single product per int32 lane. Per group:
// 1. the leading exponent E of each lane is the largest of floor(log2 |acc|) and, per block,
//    floor(log2 max |P|) + k_b (one maximum per block replaces one logarithm per product);
// 2. every term is truncated toward zero to a multiple of 2^(E - n): in units of 2^(E - n) that is
//    |P| shifted right by E - n - k_b (or left by its negative) with the sign put back, done in
//    int64 lanes with per-lane shifts (a right shift of 64 or more gives 0, as truncation does);
//    every truncated term is below 2^(n + 1), so with n + 1 + bits(terms) <= 62 the int64 sum is exact;
// 3. the exact sum times 2^(E - n) is rounded to fp32 by core::round_scaled_integer (rtz or rne).
// This is core::trunc_align_sum term for term; lanes of a NaN block end as NaN, and a lane whose
// accumulator is no longer finite keeps it.
__attribute__((target("avx2"))) void trunc_align_micro_tile_avx2(
    const std::int16_t* a_rows, std::int64_t padded_depth, const std::int16_t* b_panel, const std::int32_t* a_exponents,
    const std::int32_t* b_exponents, std::int64_t blocks, int block, int fraction_total, int group, int fraction_bits,
    bool toward_zero, float* out) {
  constexpr int lanes = panel_width;
  constexpr int none = -100000;  // the leading exponent of a lane without nonzero terms
  float accumulators[micro_rows][lanes] = {};
  bool nan_lanes[micro_rows][lanes] = {};
  alignas(32) std::int32_t maxima[lanes];
  alignas(32) std::int64_t sums[lanes];
  std::vector<std::int32_t> leading_of_block(static_cast<std::size_t>(group) * micro_rows * lanes);
  std::vector<std::int32_t> k_of_block(static_cast<std::size_t>(group) * micro_rows * lanes);
  const int pairs = block / 2;
  const __m256i zero = _mm256_setzero_si256();
  for (std::int64_t group_begin = 0; group_begin < blocks; group_begin += group) {
    const std::int64_t group_end = std::min<std::int64_t>(blocks, group_begin + group);
    // Pass 1: per block and lane, floor(log2 max |P|) + k_b.
    for (std::int64_t index = group_begin; index < group_end; ++index) {
      const std::int16_t* a_block = a_rows + index * block;
      const std::int16_t* b_block = b_panel + index * block * lanes;
      for (int r = 0; r < micro_rows; ++r) {
        __m256i largest = zero;
        for (int pair = 0; pair < pairs; ++pair) {
          const __m256i b_pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b_block + pair * 2 * lanes));
          const auto first = static_cast<std::uint16_t>(a_block[r * padded_depth + 2 * pair]);
          const auto second = static_cast<std::uint16_t>(a_block[r * padded_depth + 2 * pair + 1]);
          const __m256i even = _mm256_madd_epi16(_mm256_set1_epi32(static_cast<std::int32_t>(first)), b_pairs);
          const __m256i odd = _mm256_madd_epi16(_mm256_set1_epi32(static_cast<std::int32_t>(std::uint32_t{second} << 16)), b_pairs);
          largest = _mm256_max_epi32(largest, _mm256_max_epi32(_mm256_abs_epi32(even), _mm256_abs_epi32(odd)));
        }
        _mm256_store_si256(reinterpret_cast<__m256i*>(maxima), largest);
        const std::int32_t a_exponent = a_exponents[r * blocks + index];
        for (int lane = 0; lane < lanes; ++lane) {
          const auto at = static_cast<std::size_t>(((index - group_begin) * micro_rows + r) * lanes + lane);
          const std::int32_t k = a_exponent + b_exponents[index * lanes + lane] - fraction_total;
          k_of_block[at] = k;
          if (k > 1000 || k < -1000) nan_lanes[r][lane] = true;  // a NaN block
          leading_of_block[at] = maxima[lane] == 0 ? none : 31 - __builtin_clz(static_cast<std::uint32_t>(maxima[lane])) + k;
        }
      }
    }
    for (int r = 0; r < micro_rows; ++r) {
      // The leading exponent and the unit of each lane, and the truncated accumulator.
      std::int32_t units[lanes];
      bool active[lanes];
      for (int lane = 0; lane < lanes; ++lane) {
        const float accumulator = accumulators[r][lane];
        active[lane] = !nan_lanes[r][lane] && std::isfinite(accumulator);
        int leading = accumulator != 0.0f ? core_ns::floor_log2(std::fabs(accumulator)) : none;
        for (std::int64_t index = group_begin; index < group_end; ++index) {
          leading = std::max(leading, leading_of_block[static_cast<std::size_t>(((index - group_begin) * micro_rows + r) * lanes + lane)]);
        }
        units[lane] = leading - fraction_bits;
        if (leading == none) {
          // Nothing nonzero in the group: the sum is exactly zero, +0.
          if (active[lane]) accumulators[r][lane] = 0.0f;
          active[lane] = false;
        }
        sums[lane] = 0;
        if (active[lane] && accumulator != 0.0f) {
          const auto parts = core_ns::decompose(static_cast<double>(accumulator));
          const int shift = parts.exponent - units[lane];
          const std::int64_t magnitude = shift >= 0 ? static_cast<std::int64_t>(parts.significand << shift)
                                                    : (-shift >= 64 ? 0 : static_cast<std::int64_t>(parts.significand >> -shift));
          sums[lane] = parts.negative ? -magnitude : magnitude;
        }
      }
      __m256i sum_low = _mm256_load_si256(reinterpret_cast<const __m256i*>(sums));
      __m256i sum_high = _mm256_load_si256(reinterpret_cast<const __m256i*>(sums + 4));
      const __m256i unit = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(units));
      // Pass 2: the truncated products, summed exactly.
      for (std::int64_t index = group_begin; index < group_end; ++index) {
        const std::int16_t* a_block = a_rows + index * block;
        const std::int16_t* b_block = b_panel + index * block * lanes;
        const __m256i k = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(k_of_block.data() + ((index - group_begin) * micro_rows + r) * lanes));
        const __m256i shift = _mm256_sub_epi32(k, unit);  // left when positive, right when negative
        const __m256i left = _mm256_max_epi32(shift, zero);
        const __m256i right = _mm256_max_epi32(_mm256_sub_epi32(zero, shift), zero);
        const __m256i left_low = _mm256_cvtepu32_epi64(_mm256_castsi256_si128(left));
        const __m256i left_high = _mm256_cvtepu32_epi64(_mm256_extracti128_si256(left, 1));
        const __m256i right_low = _mm256_cvtepu32_epi64(_mm256_castsi256_si128(right));
        const __m256i right_high = _mm256_cvtepu32_epi64(_mm256_extracti128_si256(right, 1));
        for (int pair = 0; pair < pairs; ++pair) {
          const __m256i b_pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b_block + pair * 2 * lanes));
          const auto first = static_cast<std::uint16_t>(a_block[r * padded_depth + 2 * pair]);
          const auto second = static_cast<std::uint16_t>(a_block[r * padded_depth + 2 * pair + 1]);
          add_truncated_products(_mm256_madd_epi16(_mm256_set1_epi32(static_cast<std::int32_t>(first)), b_pairs), left_low,
                                 left_high, right_low, right_high, sum_low, sum_high);
          add_truncated_products(
              _mm256_madd_epi16(_mm256_set1_epi32(static_cast<std::int32_t>(std::uint32_t{second} << 16)), b_pairs),
              left_low, left_high, right_low, right_high, sum_low, sum_high);
        }
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums), sum_low);
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums + 4), sum_high);
      for (int lane = 0; lane < lanes; ++lane) {
        if (!active[lane]) continue;
        const std::int64_t sum = sums[lane];
        const bool negative = sum < 0;
        const auto magnitude = static_cast<core_ns::uint128>(negative ? -static_cast<std::uint64_t>(sum) : static_cast<std::uint64_t>(sum));
        accumulators[r][lane] =
            static_cast<float>(core_ns::round_scaled_integer(magnitude, negative, units[lane], core_ns::binary32, toward_zero));
      }
    }
  }
  for (int r = 0; r < micro_rows; ++r) {
    for (int lane = 0; lane < lanes; ++lane) {
      out[r * lanes + lane] = nan_lanes[r][lane] ? std::numeric_limits<float>::quiet_NaN() : accumulators[r][lane];
    }
  }
}

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif

}  // namespace

std::int64_t integer_product(fast_context& context, matrix& out, matrix64* exact) {
  return context.plan.use_float ? fast_product<float>(context, out, exact) : fast_product<double>(context, out, exact);
}

bool int16_kernel_applies(const canonical_operand& a, const canonical_operand& b, const fast_plan& plan,
                          const accumulation_model& model) {
  const int trunc_align_terms_bits = bits_of(static_cast<std::int64_t>(a.block) * model.blocks_per_group + 1);
  const bool model_fits = model.kind == accumulation_kind::fp32_block || model.kind == accumulation_kind::exact ||
                          (model.kind == accumulation_kind::fp32_group && model.blocks_per_group <= max_kernel_group) ||
                          (model.kind == accumulation_kind::trunc_align &&
                           model.fraction_bits + 1 + trunc_align_terms_bits <= 62);
  return model_fits && plan.power_of_two_scales && a.block % 2 == 0 && a.integer_max <= 32767 &&
         b.integer_max <= 32767 && plan.bound_bits <= 24;
}

// A copy of the operand with each block scale's odd mantissa moved into its elements: the same
// values (element * mantissa * 2^exponent), power-of-two block scales, and integer elements up to
// integer_max * scale_mantissa_max.
canonical_operand with_folded_mantissas(const canonical_operand& operand) {
  canonical_operand folded = operand;
  folded.integer_max = operand.integer_max * operand.scale_mantissa_max;
  folded.scale_mantissa_max = 1;
#pragma omp parallel for schedule(static) if (operand.rows * operand.depth >= parallel_elements)
  for (std::int64_t row = 0; row < operand.rows; ++row) {
    for (std::int64_t block = 0; block < operand.blocks; ++block) {
      const auto at = static_cast<std::size_t>(row * operand.blocks + block);
      const std::int32_t mantissa = operand.scale_mantissas[at];
      if (mantissa == 1) continue;
      const float factor = static_cast<float>(mantissa);  // 0 for a zero scale
      const std::int64_t end = std::min(operand.depth, (block + 1) * operand.block);
      for (std::int64_t k = block * operand.block; k < end; ++k) {
        folded.elements[static_cast<std::size_t>(row * operand.depth + k)] *= factor;  // exact: a short integer product
      }
      folded.scale_mantissas[at] = 1;
      if (operand.scale_exponents[at] != nan_block_exponent) {
        folded.block_scales[at] = core_ns::pow2(operand.scale_exponents[at]);
      }
    }
  }
  return folded;
}

std::optional<std::pair<canonical_operand, canonical_operand>> folded_for_int16(const canonical_operand& a,
                                                                                const canonical_operand& b) {
  const auto fits = [](const canonical_operand& x) {
    return x.integer_elements && x.integer_max * x.scale_mantissa_max <= 32767;
  };
  if (!fits(a) || !fits(b) || (a.scale_mantissa_max <= 1 && b.scale_mantissa_max <= 1)) return std::nullopt;
  return std::pair{with_folded_mantissas(a), with_folded_mantissas(b)};
}

// Runs the int16 kernels over all micro tiles; false when this CPU has no AVX2. With exact_too
// (fp32-block, or fp32-group of one block) also the exact model's fp64 product of the same
// operands, from the same block dots.
bool int16_kernel_product(const fast_context& context, matrix& out, matrix64* exact, std::int64_t& fallbacks,
                          matrix64* exact_too) {
#if MXSCOPE_GEMM_X86
  if (!cpu_has_avx2()) return false;
  const canonical_operand& a = *context.a;
  const canonical_operand& b = *context.b;
  const packed_int16_operands packed = pack_int16(a, b);
  const accumulation_model& model = context.model;
  const bool is_exact = model.kind == accumulation_kind::exact;
  const bool float_kernel = model.kind == accumulation_kind::fp32_block ||
                            (model.kind == accumulation_kind::fp32_group && model.blocks_per_group == 1);
  const bool trunc_align = model.kind == accumulation_kind::trunc_align;
  const int group = is_exact ? 0 : model.blocks_per_group;
  const bool fused = exact_too != nullptr && float_kernel;
  // A task: 64 rows of A (16 micro tiles, 512 KiB of int16 at K = 4096, kept in L2) against 8
  // panels of B; each panel is streamed once per micro tile.
  constexpr std::int64_t task_rows = 64;
  constexpr std::int64_t task_panels = 8;
  const std::int64_t row_tasks = (packed.padded_rows + task_rows - 1) / task_rows;
  const std::int64_t panel_tasks = (packed.panels + task_panels - 1) / task_panels;
  const int highest_k = 128 - context.plan.bound_bits;
  std::int64_t total = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : total) if (a.rows * b.rows * a.depth >= parallel_products)
  for (std::int64_t task = 0; task < row_tasks * panel_tasks; ++task) {
    const std::int64_t row_begin = (task / panel_tasks) * task_rows;
    const std::int64_t panel_begin = (task % panel_tasks) * task_panels;
    const std::int64_t row_end = std::min(packed.padded_rows, row_begin + task_rows);
    const std::int64_t panel_end = std::min(packed.panels, panel_begin + task_panels);
    alignas(32) float tile32[tile_entries];
    alignas(32) double tile64[tile_entries];
    std::uint8_t redo[tile_entries] = {};
    for (std::int64_t panel = panel_begin; panel < panel_end; ++panel) {
      for (std::int64_t row = row_begin; row < row_end; row += micro_rows) {
        const std::int16_t* a_rows = packed.a.data() + row * packed.padded_depth;
        const std::int16_t* b_panel = packed.b.data() + panel * packed.padded_depth * panel_width;
        const std::int32_t* a_exponents = packed.a_exponents.data() + row * a.blocks;
        const std::int32_t* b_exponents = packed.b_exponents.data() + panel * a.blocks * panel_width;
        if (fused) {
          total += block_and_exact_micro_tile_avx2(a_rows, packed.padded_depth, b_panel, a_exponents, b_exponents,
                                                   a.blocks, a.block, context.plan.fraction_total, highest_k, tile32,
                                                   tile64, redo);
        } else if (float_kernel) {
          total += fp32_block_micro_tile_avx2(a_rows, packed.padded_depth, b_panel, a_exponents, b_exponents, a.blocks,
                                              a.block, context.plan.fraction_total, highest_k, tile32);
        } else if (trunc_align) {
          trunc_align_micro_tile_avx2(a_rows, packed.padded_depth, b_panel, a_exponents, b_exponents, a.blocks, a.block,
                                      context.plan.fraction_total, model.blocks_per_group, model.fraction_bits,
                                      model.rounding == alignment_rounding::rtz, tile32);
        } else {
          grouped_micro_tile_avx2(a_rows, packed.padded_depth, b_panel, a_exponents, b_exponents, a.blocks, a.block,
                                  context.plan.fraction_total, group, tile32, tile64, redo);
        }
        for (int r = 0; r < micro_rows && row + r < a.rows; ++r) {
          for (int j = 0; j < panel_width && panel * panel_width + j < b.rows; ++j) {
            const int e = r * panel_width + j;
            const std::int64_t column = panel * panel_width + j;
            if (!is_exact) {
              out(row + r, column) = epilogue(tile32[e], context.alpha);
              if (!fused) continue;
            }
            if (redo[e] != 0) {
              // The fp64 sum was not exact for this entry: sum the scaled block dots exactly (times
              // the tensor scales).
              core_ns::long_accumulator exact_total;
              for (std::int64_t index = 0; index < a.blocks; ++index) {
                core_ns::add_scaled_exactly(
                    exact_total,
                    scaled_block_dot(static_cast<double>(packed_block_dot(packed, row + r, column, index, a.block)),
                                     a_exponents[r * a.blocks + index], 1, b_exponents[index * panel_width + j], 1,
                                     context.plan.fraction_total),
                    context.scale);
              }
              if (!fused) tile32[e] = exact_total.round_to_float();
              tile64[e] = exact_total.round_to_double();
              if (!fused) ++total;  // the model's fallbacks only
            } else if (!context.scale.is_one && !std::isnan(tile64[e])) {
              // The exact fp64 sum times the tensor scales (NVFP4), rounded once.
              const core_ns::scaled_exact_value value = core_ns::round_scaled_exact(tile64[e], a.tensor_scale, b.tensor_scale);
              if (!fused) tile32[e] = value.fp32;
              tile64[e] = value.fp64;
            }
            if (fused) {
              (*exact_too)(row + r, column) = tile64[e];
              continue;
            }
            out(row + r, column) = tile32[e];
            if (exact != nullptr) (*exact)(row + r, column) = tile64[e];
          }
        }
      }
    }
  }
  fallbacks += total;
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

}  // namespace mxscope::gemm_internal
