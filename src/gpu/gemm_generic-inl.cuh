// Part of products.cu (included there, in order, inside namespace mxscope::gpu):
// the emulated products' generic path and the unscaled operands' rows.
// ================================================================================================
// Emulated products (NUMERICS.md section 7), mirroring src/gemm.cpp.

namespace {

// Out-of-line wrappers of the long rounding routines: one copy of each in the binary instead of one
// per call site (compile time; the calls are rare next to the arithmetic around them).
__device__ __noinline__ float round_total_to_float(const core_ns::long_accumulator& total) {
  return total.round_to_float();
}
__device__ __noinline__ double round_total_to_double(const core_ns::long_accumulator& total) {
  return total.round_to_double();
}
__device__ __noinline__ float add_group_to_float(float accumulator, const double* terms, int count) {
  return core_ns::add_exactly_to_float(accumulator, terms, count);
}
__device__ __noinline__ float add_value_to_float(float accumulator, double value) {
  return core_ns::add_to_float(accumulator, value);
}

// fl32(accumulator + value) for an exact double value (src/gemm.cpp add_exact_value).
__device__ inline float nonfinite_step(float accumulator, double nonfinite_sum) {
  return static_cast<float>(static_cast<double>(accumulator) + nonfinite_sum);
}

__device__ inline float add_exact_value(float accumulator, double value) {
  if (!is_finite(accumulator) || !is_finite(value)) return nonfinite_step(accumulator, value);
  return add_value_to_float(accumulator, value + 0.0);  // +0.0: an exactly zero sum is +0
}

__device__ inline float round_output(float value, output_rounding output) {
  if (output == output_rounding::fp32) return value;
  return core_ns::bf16_to_float(core_ns::float_to_bf16(value, core_ns::rounding_mode::rne));
}

__device__ inline float finish_output(float value, output_rounding output) {
  return canonical(round_output(canonical(value), output));
}

__device__ inline double block_scale(std::int32_t exponent) {
  return exponent == nan_block_exponent ? canonical_nan_double() : core_ns::pow2(exponent);
}

// The scaled block dot c = D * 2^(ea + eb - fraction_total), exact in a double (|D| < 2^53), or NaN
// for a NaN block (src/gemm.cpp scaled_block_dot with unit mantissas).
__device__ inline double scaled_block_dot(double dot, std::int32_t exponent_a, std::int32_t exponent_b,
                                          int fraction_total) {
  if (exponent_a == nan_block_exponent || exponent_b == nan_block_exponent) return canonical_nan_double();
  return (dot + 0.0) * 1.0 * core_ns::pow2(exponent_a + exponent_b - fraction_total);
}

// -------------------------------------------------------------------------------------------
// Generic path: one thread per entry, the definition of src/gemm.cpp generic_entry. Products of
// block-scaled elements are exact doubles; each group's exact sum (with the accumulator) is
// rounded once through a long accumulator, which equals core::add_exactly_to_float (both round
// the exact sum once to nearest-even binary32).

enum class generic_mode : int { grouped = 0, exact = 1, sequential = 2 };

// Unscaled operands (fp32 / bf16 values): the per-row exponent ranges that decide which entries the
// tiled kernel of the next section computes (plain_fits); the per-product kernels skip those.
// Operands with block scales pass none (null pointers): every entry is computed.
struct plain_rows_view {
  const std::int32_t* low = nullptr;   // [rows] lowest set-bit exponent of the row's values
  const std::int32_t* high = nullptr;  // [rows] largest leading exponent (or a marker, see below)
};

// Markers of plain_rows_view::high: a row without nonzero values, a row holding inf or NaN.
constexpr std::int32_t plain_empty_high = -4096;
constexpr std::int32_t plain_nonfinite_high = 1 << 20;
// An entry's exact sum is held as a 128-bit integer (the next section): it needs this many bits.
constexpr int plain_window_bits = 126;

__device__ inline bool plain_fits(std::int32_t low_a, std::int32_t high_a, std::int32_t low_b, std::int32_t high_b,
                                  int depth_bits) {
  return high_a + high_b + 2 + depth_bits - (low_a + low_b) <= plain_window_bits;
}

template <generic_mode Mode>
__global__ void generic_product_kernel(const float* a_elements, const std::int32_t* a_exponents,
                                       const float* b_elements, const std::int32_t* b_exponents, std::int64_t m,
                                       std::int64_t n, std::int64_t depth, int block, int blocks_per_group,
                                       output_rounding output, float* out, double* exact_out, plain_rows_view a_plain,
                                       plain_rows_view b_plain, int depth_bits) {
  MXSCOPE_GRID_LOOP(entry, m * n) {
    const std::int64_t i = entry / n;
    const std::int64_t j = entry % n;
    if (a_plain.low != nullptr &&
        plain_fits(a_plain.low[i], a_plain.high[i], b_plain.low[j], b_plain.high[j], depth_bits)) {
      continue;  // computed by plain_tile_kernel
    }
    const float* a_row = a_elements + i * depth;
    const float* b_row = b_elements + j * depth;
    const auto scaled_a = [&](std::int64_t k) {
      return static_cast<double>(a_row[k]) * block_scale(a_exponents[(k / block) * m + i]);
    };
    const auto scaled_b = [&](std::int64_t k) {
      return static_cast<double>(b_row[k]) * block_scale(b_exponents[(k / block) * n + j]);
    };
    if constexpr (Mode == generic_mode::sequential) {
      // fp32-seq: the fp32 dequantized values, one fused multiply-add per product in ascending K.
      float accumulator = 0.0f;
      for (std::int64_t k = 0; k < depth; ++k) {
        const float a = static_cast<float>(scaled_a(k));
        const float b = static_cast<float>(scaled_b(k));
        accumulator = __fmaf_rn(a, b, accumulator);
      }
      out[entry] = finish_output(accumulator, output);
    } else if constexpr (Mode == generic_mode::exact) {
      core_ns::long_accumulator total;
      double nonfinite_sum = 0.0;
      bool nonfinite = false;
      for (std::int64_t k = 0; k < depth; ++k) {
        const double product = scaled_a(k) * scaled_b(k);
        if (!is_finite(product)) {
          nonfinite = true;
          nonfinite_sum += product;
        } else {
          total.add(product);
        }
      }
      if (nonfinite) {
        const double ieee = nonfinite_sum * 1.0;  // tensor scales are 1 for MX operands
        out[entry] = finish_output(static_cast<float>(ieee), output);
        if (exact_out != nullptr) exact_out[entry] = canonical(ieee);
      } else {
        out[entry] = finish_output(round_total_to_float(total), output);
        if (exact_out != nullptr) exact_out[entry] = round_total_to_double(total);
      }
    } else {
      const std::int64_t group_length = static_cast<std::int64_t>(block) * blocks_per_group;
      float accumulator = 0.0f;
      core_ns::long_accumulator total;
      for (std::int64_t begin = 0; begin < depth; begin += group_length) {
        const std::int64_t end = depth - begin < group_length ? depth : begin + group_length;
        const bool finite_accumulator = is_finite(accumulator);
        total.clear();
        if (finite_accumulator) total.add(static_cast<double>(accumulator));
        double nonfinite_sum = 0.0;
        bool nonfinite = false;
        for (std::int64_t k = begin; k < end; ++k) {
          const double product = scaled_a(k) * scaled_b(k);
          if (!is_finite(product)) {
            nonfinite = true;
            nonfinite_sum += product;
          } else if (finite_accumulator) {
            total.add(product);
          }
        }
        if (nonfinite || !finite_accumulator) {
          accumulator = nonfinite_step(accumulator, nonfinite_sum);
          continue;
        }
        accumulator = round_total_to_float(total);
      }
      out[entry] = finish_output(accumulator * 1.0f, output);  // epilogue: alpha = 1 for MX operands
    }
  }
}

// -------------------------------------------------------------------------------------------
// Unscaled operands (fp32 or bf16 values, every block scale 1): the exact reference (section
// "Exact reference" below) and the fp32-block / fp32-group:G products, tiled, with the products
// of each K-chunk of 32 summed by plain fp64 FMAs wherever that sum is exact.
//
// Exactness. Over a chunk's nonzero finite values of one operand row, let hi be the largest
// leading exponent (|v| < 2^(hi + 1)) and lo the smallest exponent of a lowest set significand bit
// (every value is a multiple of 2^lo); spread = hi - lo. Every product of the chunk is then a
// multiple of 2^(lo_a + lo_b) below 2^(hi_a + hi_b + 2), and every partial sum of at most 32 of
// them, in any order, a multiple of 2^(lo_a + lo_b) below 2^(hi_a + hi_b + 7): an integer of at most
// spread_a + spread_b + 7 bits times a power of two between 2^-298 and 2^254. When that is at most
// 53 bits (spread_a + spread_b <= 46) every partial sum is a double, so each FMA of the chain rounds
// a representable value, i.e. not at all, and the chain's result d is the chunk's exact sum. A
// chunk of bf16 values (8 significant bits, spread 7 within one binade) passes unless its two
// operands span more than 39 binades together; fp32 values with full significands mostly fail and
// take the per-product path of their chunk.
//
// Across chunks, an entry's exact sum is a 128-bit integer in units of 2^base with base =
// lo_a + lo_b over the two whole rows: every product and chunk sum is a multiple of 2^base, and
// every partial sum is below depth * 2^(hi_a + hi_b + 2) (the rows' hi), an integer of at most
// hi_a + hi_b + 2 + bits(depth) - base bits (plain_fits: at most 126). The model steps then use
// the core's rounding functions on that exact value: add_exact_value with d for an fp32-block step
// of one chunk, core::add_exactly_to_float for a group (or a chunk that took the per-product
// path), core::round_scaled_integer for the reference. Entries whose rows do not fit, or hold inf
// or NaN, are left to the per-product kernels (generic_product_kernel, reference_entry_kernel), which
// skip every other entry.

// The tiles of the two fp64-tensor-core kernels (plain-operand, integer path; see tile_dots).
constexpr int dot_tile = 64;   // rows of A and of B per thread block
constexpr int dot_chunk = 32;  // K per shared-memory stage

constexpr int plain_tile = dot_tile;        // entries per thread block along M and N
constexpr int plain_chunk = dot_chunk;      // K per chunk (shared-memory stage)
constexpr int plain_side = plain_tile / 16;  // entries per thread along M and N (16 x 16 threads)
// A sum of n products of values with spreads (leading minus lowest set-bit exponent) s_a and s_b
// over one pair of rows is an integer below n 2^(s_a + s_b + 2) in units of its lowest product
// bit: a double, with every partial sum, where s_a + s_b <= 51 - ceil(log2 n).
constexpr int plain_spread_budget(int products) {
  int bits = 0;
  while ((1 << bits) < products) ++bits;
  return 51 - bits;
}
constexpr int plain_chunk_budget = plain_spread_budget(plain_chunk);  // 46
constexpr std::int8_t plain_empty_spread = -128;  // a chunk without nonzero finite values
// The exact mode's super-chunks: an entry whose two rows' spreads over plain_super_chunks
// consecutive chunks fit plain_super_budget keeps its tensor-core dot across them and takes one
// 128-bit step per super-chunk instead of one per chunk.
constexpr int plain_super_chunks = 8;
constexpr int plain_super_budget = plain_spread_budget(plain_super_chunks * plain_chunk);  // 43
// reference_warp_kernel's half super-chunks: an entry that does not fit its super-chunk keeps its
// dot across each half (4 chunks) whose two rows' spreads fit plain_half_budget.
constexpr int plain_half_chunks = plain_super_chunks / 2;
constexpr int plain_half_budget = plain_spread_budget(plain_half_chunks * plain_chunk);  // 44

enum class plain_mode : int { exact = 0, block = 1, group = 2 };

__device__ inline double fma_exact(double x, double y, double z) {
#if defined(MXSCOPE_GPU_SIMULATE)
  return std::fma(x, y, z);
#elif defined(__HIP__)
  return __builtin_fma(x, y, z);
#else
  return __fma_rn(x, y, z);
#endif
}

// running += contribution; true when the addition rounded (TwoSum: sum + error == running +
// contribution exactly for finite doubles, which these stay far below overflow).
__device__ inline bool add_rounds(double& running, double contribution) {
  const double sum = running + contribution;
  const double virtual_contribution = sum - running;
  const double virtual_running = sum - virtual_contribution;
  const double error = (running - virtual_running) + (contribution - virtual_contribution);
  running = sum;
  return error != 0.0;
}
