// Part of quantize.cu (included there, in order, inside namespace mxscope::gpu):
// MX quantization (the generic, fused and column kernels) and the fast encoder's self-test.
// ================================================================================================
// MX quantization (NUMERICS.md sections 2-4).

namespace {

// One element against its block exponent: the code, the flags and the dequantized fp32 value.
// Kept out of line: the encoder is long (fp64 arithmetic, every rounding mode), and inlining it
// into unrolled loops multiplies code size and compile time without a measurable gain.
struct element_result {
  core_ns::encoded encoded;
  float dequantized;
};

template <int KindIndex>
__device__ __noinline__ element_result quantize_one(element_kind runtime_kind, float value, int exponent,
                                                    core_ns::rounding_mode rounding, std::uint32_t word, int sr_bits) {
  element_kind kind = runtime_kind;
  if constexpr (KindIndex >= 0) kind = static_cast<element_kind>(KindIndex);
  const core_ns::encoded result = core_ns::quantize_element(kind, value, exponent, rounding, word, sr_bits);
  return {result, static_cast<float>(core_ns::dequantize_element(kind, result.code, exponent))};
}

// Pass 1 of the generic path: one thread per block computes amax and the scale code. The thread
// index equals the scale's index in both layouts ([rows, blocks] for axis 1, [blocks, cols] for
// axis 0); for axis 0 consecutive threads read consecutive columns.
template <class Input>
__global__ void mx_scale_kernel(const Input* input, std::int64_t rows, std::int64_t cols, mx_plan plan,
                                std::uint8_t* scales) {
  const bool along_rows = plan.axis == 1;
  const std::int64_t lines = along_rows ? rows : cols;
  const std::int64_t length = along_rows ? cols : rows;
  const std::int64_t blocks_per_line = (length + plan.block - 1) / plan.block;
  MXSCOPE_GRID_LOOP(g, lines * blocks_per_line) {
    const std::int64_t line = along_rows ? g / blocks_per_line : g % lines;
    const std::int64_t b = along_rows ? g % blocks_per_line : g / lines;
    const std::int64_t begin = b * plan.block;
    const std::int64_t count = length - begin < plan.block ? length - begin : plan.block;
    float amax = 0.0f;
    bool nonfinite = false;
    for (std::int64_t i = 0; i < count; ++i) {
      const std::int64_t index = along_rows ? line * cols + begin + i : (begin + i) * cols + line;
      const float v = load_input(input, index);
      if (!is_finite(v)) {
        nonfinite = true;
      } else {
        const float magnitude = fabsf(v);
        if (amax < magnitude) amax = magnitude;  // std::max(amax, magnitude)
      }
    }
    scales[g] = nonfinite ? core_ns::scale_nan_code
                          : core_ns::scale_code(core_ns::shared_exponent(plan.element, plan.rule, amax));
  }
}

// Pass 2: one thread per code byte (two elements for fp4, one otherwise) reads its block's scale
// and encodes. NaN blocks get code 0 and NaN, as the CPU writes them.
template <class Input>
__global__ void mx_element_kernel(const Input* input, std::int64_t rows, std::int64_t cols, mx_plan plan,
                                  const std::uint8_t* scales, mx_device_output output) {
  const bool packed = core_ns::spec(plan.element).bits == 4;
  const bool stochastic = plan.rounding == core_ns::rounding_mode::sr;
  const std::int64_t row_bytes = packed ? (cols + 1) / 2 : cols;
  const std::int64_t blocks_along_row = (cols + plan.block - 1) / plan.block;
  unsigned long long counts[mx_counter_count] = {0, 0, 0, 0};
  MXSCOPE_GRID_LOOP(unit, rows * row_bytes) {
    const std::int64_t r = unit / row_bytes;
    const std::int64_t first_col = packed ? (unit % row_bytes) * 2 : unit % row_bytes;
    const int elements = packed ? 2 : 1;
    std::uint32_t byte = 0;
    core_ns::philox_block words{};
    std::uint64_t words_index = ~std::uint64_t{0};
    for (int e = 0; e < elements; ++e) {
      const std::int64_t c = first_col + e;
      if (c >= cols) break;  // the unused high nibble of an odd row stays 0
      const std::int64_t flat = r * cols + c;
      const float v = load_input(input, flat);
      counts[counter_nonzero] += v != 0.0f;
      counts[counter_nonfinite] += !is_finite(v);
      const std::uint8_t scale =
          plan.axis == 1 ? scales[r * blocks_along_row + c / plan.block] : scales[(r / plan.block) * cols + c];
      std::uint32_t code = 0;
      float dequantized = canonical_nan_float();
      if (scale != core_ns::scale_nan_code) {
        const int exponent = core_ns::scale_exponent(scale);
        std::uint32_t word = 0;
        if (stochastic) {
          const std::uint64_t block_index = static_cast<std::uint64_t>(flat) / 4;
          if (block_index != words_index) {
            words = plan.stream.block(block_index);
            words_index = block_index;
          }
          word = words.word[flat % 4];
        }
        const element_result result = quantize_one<-1>(plan.element, v, exponent, plan.rounding, word, plan.sr_bits);
        code = result.encoded.code;
        dequantized = result.dequantized;
        counts[counter_flushed] += result.encoded.flushed;
        counts[counter_saturated] += result.encoded.saturated;
      }
      byte |= packed ? (code & 0x0FU) << (4 * e) : code;
      if (output.dequantized != nullptr) output.dequantized[flat] = dequantized;
    }
    output.codes[unit] = static_cast<std::uint8_t>(byte);
  }
  if (output.counters != nullptr) add_counters(output.counters, counts);
}

#include "mx_columns-inl.cuh"
#include "operand-inl.cuh"

// MX codes' bf16 operand (mx_device_output::operand_bf16), where the quantizer did not write it.
void launch_mx_operand(const mx_plan& plan, std::int64_t rows, std::int64_t cols, const mx_device_output& output) {
  const bool along_rows = plan.axis == 1;
  const operand_layout layout{plan.element,
                              operand_scale::mx,
                              rows,
                              cols,
                              mx_code_row_bytes(plan, cols),
                              mx_scale_cols(plan, rows, cols),
                              along_rows ? 1 : plan.block,
                              along_rows ? plan.block : 1,
                              core_ns::spec(plan.element).bits == 4};
  launch_operand_bf16(output.codes, output.scales, layout, output.operand_bf16);
}

// The fused path (axis 1, block 32, cols a multiple of 32). MX block g then holds the input
// elements [32 g, 32 g + 32), its codes are the bytes [16 g, 16 g + 16) (fp4) or [32 g, 32 g + 32)
// and its scale is byte g. One thread takes one MX block at a time (consecutive threads,
// consecutive blocks, in a grid-stride loop): it loads the block's 64 or 128 bytes in 16-byte
// pieces straight into registers (the pieces a warp's load leaves in a sector, its next load
// finds in L1, so no staging through shared memory), rotates them there (Rotation = 16 or 32: whole rotation
// segments lie in the block) with core::rotate_segment, scans them and encodes; codes go out in
// 16-byte stores, and so does the bf16 GEMM operand where one is asked for. The element encoder is a template choice (fused_encoder); every one is the
// core's function (fast_encode.hpp). Counters are 32-bit per thread (a thread meets 32 elements
// per block and far fewer than 2^27 blocks) and are summed per thread block at the end.
constexpr int fused_block = 32;

enum class fused_encoder {
  fp4_nearest_even,  // fp4, rne: fast_encode::fp4_nearest_even
  fp4_stochastic,    // fp4, sr with 32 random bits: fast_encode::fp4_stochastic_unscaled
  fp4_by_carry,      // fp4, rna, rtz or sr with fewer bits: fast_encode::fp4_locate and fp4_round
  any_format,        // the other formats: fast_encode::quantize_finite (float formats) or the core (int8)
};

// The gfx950 native quantizer's loads (native_gfx950_quantize.hpp: one thread per block reading its
// own 64 or 128 bytes); only the HIP device code for gfx950 has that path.
#if defined(__HIP__) && !defined(MXSCOPE_GPU_SIMULATE) && defined(__gfx950__)
__device__ inline void load_block(const float* input, std::int64_t first, float (&v)[fused_block]) {
  const float4* source = reinterpret_cast<const float4*>(input + first);
#pragma unroll
  for (int q = 0; q < fused_block / 4; ++q) {
    const float4 chunk = source[q];
    v[4 * q] = chunk.x;
    v[4 * q + 1] = chunk.y;
    v[4 * q + 2] = chunk.z;
    v[4 * q + 3] = chunk.w;
  }
}

__device__ inline void load_block(const std::uint16_t* input, std::int64_t first, float (&v)[fused_block]) {
  const uint4* source = reinterpret_cast<const uint4*>(input + first);
#pragma unroll
  for (int q = 0; q < fused_block / 8; ++q) {
    const uint4 chunk = source[q];
    const std::uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      v[8 * q + 2 * w] = core_ns::bf16_to_float(static_cast<std::uint16_t>(words[w] & 0xFFFFU));
      v[8 * q + 2 * w + 1] = core_ns::bf16_to_float(static_cast<std::uint16_t>(words[w] >> 16));
    }
  }
}

// The start of a fused block of the native quantizer: load its 32 elements, rotate them in
// registers (signs first, as core::rotate_segment does), count nonzero and non-finite inputs and
// find the largest finite magnitude.
struct block_scan {
  float amax;
  bool nonfinite;
};
template <int Rotation, class Input>
__device__ inline block_scan load_and_scan_block(const Input* input, std::int64_t first, std::int64_t b,
                                                 const float* signs, float (&v)[fused_block],
                                                 unsigned long long (&counts)[mx_counter_count]) {
  load_block(input, first, v);
  if constexpr (Rotation > 0) {
    // The sign multiply is core::rotate_segment's first step, done here in registers (exact).
    if (signs != nullptr) {
#pragma unroll
      for (int i = 0; i < fused_block; ++i) v[i] = v[i] * signs[b * fused_block + i];
    }
#pragma unroll
    for (int s = 0; s < fused_block / Rotation; ++s) core_ns::rotate_segment(v + s * Rotation, Rotation, nullptr);
  }
  block_scan scan{0.0f, false};
#pragma unroll
  for (int i = 0; i < fused_block; ++i) {
    counts[counter_nonzero] += v[i] != 0.0f;
    if (!is_finite(v[i])) {
      scan.nonfinite = true;
      ++counts[counter_nonfinite];
    } else {
      const float magnitude = fabsf(v[i]);
      if (scan.amax < magnitude) scan.amax = magnitude;
    }
  }
  return scan;
}

#endif  // __HIP__ && !MXSCOPE_GPU_SIMULATE && __gfx950__

template <int Pieces>
__device__ inline void unpack_pieces(const uint4 (&pieces)[Pieces], float (&v)[fused_block]) {
  static_assert(Pieces == 4 || Pieces == 8);
#pragma unroll
  for (int j = 0; j < Pieces; ++j) {
    const std::uint32_t words[4] = {pieces[j].x, pieces[j].y, pieces[j].z, pieces[j].w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      if constexpr (Pieces == 4) {  // bf16: two elements per word, the first in the low half (exact widening)
        v[8 * j + 2 * w] = core_ns::bits_float(words[w] << 16);
        v[8 * j + 2 * w + 1] = core_ns::bits_float(words[w] & 0xFFFF0000U);
      } else {
        v[4 * j + w] = core_ns::bits_float(words[w]);
      }
    }
  }
}

// The dequantized block, stored from the branch that made it (a store shared after the branches
// would keep the inputs alive in registers through the encoder).
__device__ inline void store_dequantized(float* destination, const float (&v)[fused_block]) {
  float4* vectors = reinterpret_cast<float4*>(destination);
#pragma unroll
  for (int q = 0; q < fused_block / 4; ++q) vectors[q] = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
}

// One MX block's bf16 GEMM operand from its codes and scale (core::operand_bf16 of each code): for
// the float formats float_to_bf16 of fast_encode's fp32 value (the core's, checked by
// self_test_fast_encoder), for the others the core's own. Written in 16-byte vectors of eight.
__device__ inline void store_operand(std::uint16_t* destination, element_kind kind,
                                     const fast_encode::element_constants& constants, bool packed,
                                     const std::uint32_t (&words)[8], std::uint8_t scale) {
  const bool fast = fast_encode::covers(kind);
  const int exponent = core_ns::scale_exponent(scale);
  uint4* vectors = reinterpret_cast<uint4*>(destination);
#pragma unroll
  for (int q = 0; q < fused_block / 8; ++q) {
    std::uint32_t pairs[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      std::uint32_t halves[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = 8 * q + 2 * p + h;
        const std::uint32_t code = packed ? (words[i / 8] >> (4 * (i % 8))) & 0x0FU : (words[i / 4] >> (8 * (i % 4))) & 0xFFU;
        if (scale == core_ns::scale_nan_code) {
          halves[h] = core_ns::bf16_canonical_nan;
        } else if (fast) {
          halves[h] = core_ns::float_to_bf16(fast_encode::dequantize(constants, code, exponent), core_ns::rounding_mode::rne, 0U, 32);
        } else {
          halves[h] = core_ns::operand_bf16(kind, core_ns::operand_scaling::mx, code, scale);
        }
      }
      pairs[p] = halves[0] | (halves[1] << 16);
    }
    vectors[q] = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
  }
}

// The low bytes of four words, as the bytes of one word (byte k from the k-th).
__device__ inline std::uint32_t low_bytes(std::uint32_t a, std::uint32_t b, std::uint32_t c, std::uint32_t d) {
#if defined(__CUDA_ARCH__) && !defined(__HIP__)
  return __byte_perm(__byte_perm(a, b, 0x0040U), __byte_perm(c, d, 0x0040U), 0x5410U);
#else
  return (a & 0xFFU) | (b & 0xFFU) << 8 | (c & 0xFFU) << 16 | (d & 0xFFU) << 24;
#endif
}

// The sign bits of 8 fp32 values at bits 3, 7, ..., 31 (the sign bits of 8 fp4 codes). On CUDA the
// top bytes are gathered with their sign bit replicated (prmt's sign mode: byte k of `even` is 0xFF
// where value 2 k is negative, of `odd` where 2 k + 1 is), then one mask each: 8 instructions per 8
// values where gathering the plain top bytes and shifting took 9.
__device__ inline std::uint32_t nibble_signs(const float* v) {
  const auto b = [&](int i) { return core_ns::float_bits(v[i]); };
#if defined(__CUDA_ARCH__) && !defined(__HIP__)
  const auto sign_bytes = [](std::uint32_t x, std::uint32_t y) {
    std::uint32_t out = 0;  // byte 0: x's sign replicated, byte 1: y's (selectors 8 + 3 and 8 + 7)
    asm("prmt.b32 %0, %1, %2, 0x00FB;" : "=r"(out) : "r"(x), "r"(y));
    return out;
  };
  const std::uint32_t even = __byte_perm(sign_bytes(b(0), b(2)), sign_bytes(b(4), b(6)), 0x5410U);
  const std::uint32_t odd = __byte_perm(sign_bytes(b(1), b(3)), sign_bytes(b(5), b(7)), 0x5410U);
  return (even & 0x08080808U) | (odd & 0x80808080U);
#else
  const std::uint32_t even = (b(0) >> 24) | (b(2) >> 24) << 8 | (b(4) >> 24) << 16 | (b(6) >> 24) << 24;
  const std::uint32_t odd = (b(1) >> 24) | (b(3) >> 24) << 8 | (b(5) >> 24) << 16 | (b(7) >> 24) << 24;
  return ((even >> 4) & 0x08080808U) | (odd & 0x80808080U);
#endif
}

// Four words of 8 codes sum >> 22 (0..8, fp4_stochastic_anchored_sum) with the 8s made 7s
// (each minus its bit 3), the signs of v's 32 values inserted (nibble_signs) and the number of
// nonzero codes returned: a code c <= 7 is nonzero exactly when c + 7 has bit 3 set (no carry leaves
// its nibble), and the four words' flags go to bits 3, 2, 1 and 0 of the nibbles for one
// population count.
__device__ inline unsigned finish_anchored_codes(std::uint32_t* words, const float* v) {
  std::uint32_t flags = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const std::uint32_t capped = words[j] - ((words[j] >> 3) & 0x11111111U);
    flags += ((capped + 0x77777777U) & 0x88888888U) >> j;
    words[j] = capped | nibble_signs(v + 8 * j);
  }
#if defined(__CUDA_ARCH__) || defined(__HIP__)
  return static_cast<unsigned>(__popc(flags));
#else
  unsigned count = 0;
  for (; flags != 0; flags &= flags - 1) ++count;
  return count;
#endif
}

// nibble_signs of the 8 bf16 elements of a piece as read (element 2 w in the low half of word w,
// its sign at bit 15; element 2 w + 1 in the high half, sign at bit 31): byte 1 of each word in
// place of the even elements' byte 3.
__device__ inline std::uint32_t nibble_signs_bf16(const uint4& piece) {
#if defined(__CUDA_ARCH__) && !defined(__HIP__)
  const std::uint32_t even =
      __byte_perm(__byte_perm(piece.x, piece.y, 0x0051U), __byte_perm(piece.z, piece.w, 0x0051U), 0x5410U);
  const std::uint32_t odd =
      __byte_perm(__byte_perm(piece.x, piece.y, 0x0073U), __byte_perm(piece.z, piece.w, 0x0073U), 0x5410U);
#else
  const auto low = [](std::uint32_t x) { return (x >> 8) & 0xFFU; };
  const auto high = [](std::uint32_t x) { return x >> 24; };
  const std::uint32_t even = low(piece.x) | low(piece.y) << 8 | low(piece.z) << 16 | low(piece.w) << 24;
  const std::uint32_t odd = high(piece.x) | high(piece.y) << 8 | high(piece.z) << 16 | high(piece.w) << 24;
#endif
  return ((even >> 4) & 0x08080808U) | (odd & 0x80808080U);
}

// The largest and smallest magnitude of a bf16 block as read, as the bf16 bit patterns (two
// magnitudes per word, compared per halfword: the same order as their values).
struct bf16_extremes {
  std::uint32_t largest;
  std::uint32_t smallest;
};
template <int Pieces>
__device__ __forceinline__ bf16_extremes bf16_block_extremes(const uint4 (&pieces)[Pieces]) {
  std::uint32_t high = 0, low = 0xFFFFFFFFU;
#pragma unroll
  for (int j = 0; j < Pieces; ++j) {
    const std::uint32_t words4[4] = {pieces[j].x, pieces[j].y, pieces[j].z, pieces[j].w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      high = fast_encode::max_u16x2(high, words4[w] & 0x7FFF7FFFU);
      low = fast_encode::min_u16x2(low, words4[w] & 0x7FFF7FFFU);
    }
  }
  return {(high & 0xFFFFU) > (high >> 16) ? high & 0xFFFFU : high >> 16,
          (low & 0xFFFFU) < (low >> 16) ? low & 0xFFFFU : low >> 16};
}

// The least magnitude of a bf16 block as read, as a bf16 bit pattern. On sm_90 one bf16x2
// minimum of magnitudes per word (min.xorsign.abs: the minimum of |x| and |y| per half, its sign
// bit the halves' signs' xor, cleared at the end), 15 instructions where masking the signs off
// first takes 16 more; elsewhere bf16_block_extremes. NaN halves are passed over (those blocks are
// non-finite after the rotation and take no code from this encoder).
template <int Pieces>
__device__ __forceinline__ std::uint32_t bf16_least_magnitude(const uint4 (&pieces)[Pieces]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(__HIP__)
  std::uint32_t low = pieces[0].x;
#pragma unroll
  for (int j = 0; j < Pieces; ++j) {
    const std::uint32_t words4[4] = {pieces[j].x, pieces[j].y, pieces[j].z, pieces[j].w};
#pragma unroll
    for (int w = j == 0 ? 1 : 0; w < 4; ++w) asm("min.xorsign.abs.bf16x2 %0, %0, %1;" : "+r"(low) : "r"(words4[w]));
  }
  low &= 0x7FFF7FFFU;
  return (low & 0xFFFFU) < (low >> 16) ? low & 0xFFFFU : low >> 16;
#else
  return bf16_block_extremes(pieces).smallest;
#endif
}

// Nonzero magnitudes among the 32 fp4 codes of a block's 4 code words (bit 3 of each nibble is the
// sign): in each word, (nibble | 8) - 1 = 7 + magnitude has bit 3 set exactly when the magnitude is
// nonzero (no borrow leaves a nibble), the four words' flags are moved to bits 3, 2, 1 and 0 of the
// nibbles and counted by one population count.
__device__ inline unsigned nonzero_fp4_magnitudes(const std::uint32_t (&words)[8]) {
  std::uint32_t flags = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) flags |= (((words[j] | 0x88888888U) - 0x11111111U) & 0x88888888U) >> j;
#if defined(__CUDA_ARCH__) && !defined(__HIP__)
  return static_cast<unsigned>(__popc(flags));
#else
  unsigned count = 0;
  for (; flags != 0; flags &= flags - 1) ++count;
  return count;
#endif
}

// core::fwht on one segment of `Size` elements (the same additions in the same stages), which also
// folds what the block's encoder needs of its output from the last stage's pairs a, c (outputs
// a + c and a - c):
// - high: the largest pattern of s = fl(|a| + |c|), the larger output magnitude of the pair
//   (rounding is monotone and symmetric), one fp32 addition per pair and the comparisons on the bit
//   patterns, two pairs per instruction (a three-way unsigned maximum on sm_90; ptxas fuses the
//   two-way ones). s >= 0 orders as its pattern; a NaN s (a NaN input) is a positive NaN pattern,
//   above infinity's, and where a + c or a - c is inf - inf (NaN), s is inf. So high is the largest
//   output magnitude when below infinity's pattern, else the block holds a non-finite output.
// - equal: whether some pair has |a| = |c|, one compare-and-or per pair into a predicate. An output
//   a + c or a - c is zero exactly when |a| = |c| with both finite (fp32 addition is exact near
//   zero), so without such a pair no output is zero; with one (or with |a| = |c| = inf) an output
//   may be zero, and the encoder counts them.
__device__ __forceinline__ std::uint32_t max_u32(std::uint32_t a, std::uint32_t b) { return a > b ? a : b; }

template <int Size>
__device__ inline void fwht_with_extremes(float* v, std::uint32_t& high, bool& equal) {
#pragma unroll
  for (int half = 1; half < Size / 2; half *= 2) {
#pragma unroll
    for (int start = 0; start < Size; start += 2 * half) {
#pragma unroll
      for (int j = start; j < start + half; ++j) {
        const float a = v[j];
        const float c = v[j + half];
        v[j] = a + c;
        v[j + half] = a - c;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < Size / 2; ++j) {
    const float a = v[j];
    const float c = v[j + Size / 2];
    high = max_u32(high, core_ns::float_bits(fabsf(a) + fabsf(c)));
    equal = equal | (fabsf(a) == fabsf(c));
    v[j] = a + c;
    v[j + Size / 2] = a - c;
  }
}

// Thread blocks per multiprocessor for the fp4 encoders on CUDA, so that enough loads are in flight
// to cover the memory latency: 4 (64 registers) for bf16 without rotation, 3 (80 registers) for the
// others, the most that ptxas fits without spilling on sm_90. sr on bf16 reads the next block ahead
// (16 more registers): 3 (80) without rotation and 2 (128) with H16 (the figures behind these
// choices: BENCHMARKS.md, "Tuning notes"). (HIP's second bound means something else; it keeps the
// plain bound.)
#if defined(__CUDACC__) && !defined(__HIP__)
#define MXSCOPE_FUSED_BOUNDS(min_blocks) __launch_bounds__(threads_per_block, min_blocks)
#else
#define MXSCOPE_FUSED_BOUNDS(min_blocks) __launch_bounds__(threads_per_block)
#endif

template <class Input, int Rotation, fused_encoder Encoder>
constexpr int fused_blocks_per_multiprocessor =
    Encoder == fused_encoder::any_format                               ? 1
    : Encoder == fused_encoder::fp4_stochastic && sizeof(Input) == 2 ? (Rotation == 0 ? 3 : 2)
    : Rotation == 0 && sizeof(Input) == 2                             ? 4
                                                                      : 3;

// Calls f(i, word) for the elements i = 0 .. 31 of MX block g in order, where element 4 q + w draws
// word w of Philox block 8 g + q of the plan's stream (NUMERICS.md section 4): the sr encoders' walk.
// (The scaled encoders' loops, which draw only for some rounding modes, keep their own form, under
// which ptxas schedules them as benchmarked.)
template <class F>
__device__ __forceinline__ void for_each_random_word(std::int64_t g, const mx_plan& plan,
                                                     const core_ns::philox_keys& keys, F&& f) {
#pragma unroll
  for (int q = 0; q < fused_block / 4; ++q) {
    const core_ns::philox_block random =
        plan.stream.block(static_cast<std::uint64_t>(g) * (fused_block / 4) + q, keys);
#pragma unroll
    for (int w = 0; w < 4; ++w) f(4 * q + w, random.word[w]);
  }
}

// fast_encode::fp4_stochastic_anchored_sum on the 32 magnitudes |v[i]| of MX block g (element i
// draws its word as for_each_random_word walks), the codes sum >> 22 packed into words[i / 8] at
// nibble i % 8 and the saturation flags (fast_encode::fp4_saturated) added to `saturated`. As
// multiply-adds by constant powers of two (multiply_add_low/high) the code and its packing go where
// ptxas puts them: the code's shift as LEA.HI on the integer pipe, the packing on the multiply-add
// pipe (IMAD); with ByShift the packing is written as a shift and an addition, which ptxas makes
// the same IMAD or an LEA as it sees fit (the lean path uses it). With Checked, (sum + 1) 2^10, zero exactly when the sum is undecided (low 22
// bits all ones), goes into the least of `margin`.
template <bool Checked, bool ByShift, int Words>
__device__ __forceinline__ void encode_anchored_block(const float (&v)[fused_block], std::int64_t g,
                                                      const mx_plan& plan, const core_ns::philox_keys& keys,
                                                      float anchor, fast_encode::fp4_saturation_flag flag,
                                                      std::uint32_t (&words)[Words], std::uint32_t& margin,
                                                      float& saturated) {
  for_each_random_word(g, plan, keys, [&](int i, std::uint32_t word) {
    const float magnitude = fabsf(v[i]);
    const std::uint32_t sum = fast_encode::fp4_stochastic_anchored_sum(magnitude, word, anchor);
    if constexpr (Checked) {
      const std::uint32_t distance = multiply_add_low(sum, 1U << 10, 1U << 10);
      margin = distance < margin ? distance : margin;
    }
    if constexpr (ByShift) {
      words[i / 8] += multiply_add_high(sum, 1U << 10, 0U) << (4 * (i % 8));
    } else {
      words[i / 8] = multiply_add_low(multiply_add_high(sum, 1U << 10, 0U), 1U << (4 * (i % 8)), words[i / 8]);
    }
    saturated += fast_encode::fp4_saturated(magnitude, flag);
  });
}

// One MX block g of the fused kernel, read from `input` and written to `output`, its counts added
// to `counts`. With Summed (fp4 sr) the codes come from fast_encode::fp4_stochastic_anchored_sum, and
// a block where one of its sums is undecided (about one block in 2^17 with random words), or whose
// grid exponent is outside that encoder's or the fp32 saturation flags' range (values under 2^-102
// or from 2^25 on), returns false with no codes or flags written and its counts taken back; the
// kernel then encodes it again through fused_block_again (fp4_stochastic_unscaled), a call of its
// own, so that the rare path's registers do not weigh on the hot loop's. With Lean (folded H16 + sr
// under the floor rule, without rotation signs or a dequantized output) only the common blocks are
// encoded here and every other one returns false before writing or counting anything.
// One body for every encoder (about 340 lines): the Encoder, Summed and Lean branches are resolved
// at compile time, and each instantiation keeps the block's 32 values, flags and counts in registers
// from the load to the stores.
template <class Input, int Rotation, fused_encoder Encoder, bool Summed, bool Lean = false>
__device__ __forceinline__ bool encode_fused_block(const Input* input, const uint4* loaded, std::int64_t g,
                                                   std::int64_t blocks_per_row,
                                                   const mx_plan& plan, const core_ns::philox_keys& keys,
                                                   const float* signs, const mx_device_output& output,
                                                   unsigned (&counts)[mx_counter_count], uint4* refill = nullptr,
                                                   std::int64_t refill_block = 0) {
  constexpr int pieces = fused_block * static_cast<int>(sizeof(Input)) / 16;
  constexpr bool fp4 = Encoder != fused_encoder::any_format;
  // bf16 input rotated by H16 (fp4 encoders): v keeps the Hadamard sums s, without the factor
  // hadamard_scale(16) = 1/4, and the block's grid is taken 4 times larger (exponent + 2). The
  // quarter is exact: every s is a multiple of 2^-133 (bf16's subnormal spacing; sums, differences
  // and their fp32 roundings keep that), so s / 4 needs no bit below 2^-135, and the codes, flags
  // and counts of s on the grid 2^(e + 2) are those of s / 4 on 2^e. One multiply per element less.
  constexpr int folded = fp4 && Rotation == 16 && sizeof(Input) == 2 ? 2 : 0;
  static_assert(core_ns::hadamard_scale(16) == 0.25f);
  const element_kind kind = fp4 ? element_kind::fp4_e2m1 : plan.element;
  const bool packed = core_ns::spec(kind).bits == 4;
  const bool fast = fast_encode::covers(kind);
  const fast_encode::element_constants constants = fast_encode::constants_of(kind);
  const bool stochastic = plan.rounding == core_ns::rounding_mode::sr;
  const std::uint32_t random_mask = stochastic ? fast_encode::fp4_random_mask(plan.sr_bits) : 0U;
  const uint4* source = reinterpret_cast<const uint4*>(input);
  uint4 mine[pieces];  // the block as read: from `loaded` where the caller read it ahead
#pragma unroll
  for (int j = 0; j < pieces; ++j) mine[j] = loaded != nullptr ? loaded[j] : source[g * pieces + j];
  float v[fused_block];
  unpack_pieces(mine, v);
  std::uint32_t pair_high = 0;  // folded: fwht_with_extremes
  bool pair_equal = false;
  // Folded sr: the least bf16 magnitude pattern among the block's inputs (the undecided check's skip;
  // the unused largest costs nothing).
  std::uint32_t least_input = 0;
  if constexpr (folded > 0 && Encoder == fused_encoder::fp4_stochastic && Summed) {
    least_input = bf16_least_magnitude(mine);
  }
  if constexpr (Rotation > 0) {
    // The caller's read-ahead: block refill_block goes into `refill` (where `loaded` came from) once
    // the words as read are no longer needed (rotated blocks take their signs from v). Always a
    // load, so that it can land in the registers the words came in.
    if (refill != nullptr) {
#pragma unroll
      for (int j = 0; j < pieces; ++j) refill[j] = source[refill_block * pieces + j];
    }
    // The sign multiply is core::rotate_segment's first step, done here in registers (exact). (The
    // lean path runs without signs.)
    if (!Lean && signs != nullptr) {
      const float4* block_signs = reinterpret_cast<const float4*>(signs + (g % blocks_per_row) * fused_block);
#pragma unroll
      for (int q = 0; q < fused_block / 4; ++q) {
        const float4 s = block_signs[q];
        v[4 * q] = v[4 * q] * s.x;
        v[4 * q + 1] = v[4 * q + 1] * s.y;
        v[4 * q + 2] = v[4 * q + 2] * s.z;
        v[4 * q + 3] = v[4 * q + 3] * s.w;
      }
    }
#pragma unroll
    for (int s = 0; s < fused_block / Rotation; ++s) {
      if constexpr (folded > 0) {
        fwht_with_extremes<Rotation>(v + s * Rotation, pair_high, pair_equal);  // v holds 4x the rotated values
      } else {
        core_ns::rotate_segment(v + s * Rotation, Rotation, nullptr);
      }
    }
  }
  // The largest magnitude as fp32 bits: the largest finite |v| when below the infinity pattern,
  // else the block holds a non-finite value. The smallest says whether there are zeros to count.
  std::uint32_t largest = 0;
  std::uint32_t smallest = 0xFFFFFFFFU;
  if constexpr (Rotation == 0 && sizeof(Input) == 2) {
    // bf16 as read (bf16 patterns order as the fp32 ones they widen to).
    const bf16_extremes extremes = bf16_block_extremes(mine);
    largest = extremes.largest << 16;
    smallest = extremes.smallest << 16;
  } else if constexpr (folded > 0) {
    largest = pair_high;
    smallest = pair_equal ? 0U : 0xFFFFFFFFU;  // 0 where an output may be zero: all that is asked of it
  } else {
    // As fp32 values: one instruction each per element (the absolute value is an operand
    // modifier); NaN propagates into the maximum, inf is the largest value anyway.
    float high = 0.0f, low = core_ns::bits_float(0x7F800000U);
#pragma unroll
    for (int i = 0; i < fused_block; ++i) {
      high = max_or_nan(high, fabsf(v[i]));
      low = fminf(low, fabsf(v[i]));
    }
    largest = core_ns::float_bits(high);
    smallest = core_ns::float_bits(low);
  }
  if constexpr (folded > 0) largest = core_ns::float_bits(core_ns::bits_float(largest) * 0.25f);  // exact
  if constexpr (Lean) {
    // The lean path of folded H16 + sr (mx_fused_kernel takes it): the floor rule, no signs, no
    // dequantized output. Every block that needs more than the anchored sums, one with an output
    // that may be zero (its nonzero count), outside the anchor's and the flags' exponents or with an
    // undecided sum, goes back to the caller whole (nothing written, nothing counted) for
    // fused_block_again.
    static_assert(folded > 0 && Encoder == fused_encoder::fp4_stochastic && Summed);
    const int exponent = fast_encode::floor_rule_exponent(core_ns::emax_elem(element_kind::fp4_e2m1), largest);
    // The grid exponent exponent + folded must suit the anchor (-127..23) and the flags (-105..102):
    // exponent in [lowest, highest], one unsigned comparison. A non-finite largest (pattern from
    // infinity's up) gives exponent >= 255 - 129 > highest; the floor rule keeps the largest below
    // 8 2^exponent, which the anchor also needs.
    constexpr int lowest = -105 - folded, highest = 23 - folded;
    static_assert(fast_encode::fp4_stochastic_anchored_covers(lowest + folded) &&
                  fast_encode::fp4_saturation_flag_covers(lowest + folded) &&
                  !fast_encode::fp4_saturation_flag_covers(lowest - 1 + folded) &&
                  fast_encode::fp4_stochastic_anchored_covers(highest + folded) &&
                  fast_encode::fp4_saturation_flag_covers(highest + folded) &&
                  !fast_encode::fp4_stochastic_anchored_covers(highest + 1 + folded));
    static_assert((0x7F800000U >> 23) - 127 - core_ns::emax_elem(element_kind::fp4_e2m1) > highest);
    if ((smallest == 0) | (static_cast<unsigned>(exponent - lowest) > static_cast<unsigned>(highest - lowest))) {
      return false;
    }
    const fast_encode::fp4_saturation_flag flag = fast_encode::fp4_saturation_flag_constants(exponent + folded);
    const float anchor = fast_encode::fp4_stochastic_anchor(exponent + folded);
    std::uint32_t words[4] = {0, 0, 0, 0};
    std::uint32_t margin = 0xffffffffU;
    float saturated = 0.0f;
    if (least_input >= static_cast<std::uint32_t>(exponent + 113) << 7) {  // as in the general path below
      encode_anchored_block<false, true>(v, g, plan, keys, anchor, flag, words, margin, saturated);
    } else {
      encode_anchored_block<true, true>(v, g, plan, keys, anchor, flag, words, margin, saturated);
    }
    if (margin == 0) return false;
    const unsigned nonzero_codes = finish_anchored_codes(words, v);
    counts[counter_nonzero] += fused_block;
    counts[counter_saturated] += static_cast<unsigned>(saturated);
    counts[counter_flushed] += fused_block - nonzero_codes;
    output.scales[g] = core_ns::scale_code(exponent);
    uint4* codes = reinterpret_cast<uint4*>(output.codes + g * (fused_block / 2));
    codes[0] = make_uint4(words[0], words[1], words[2], words[3]);
    if (output.operand_bf16 != nullptr) {
      const std::uint32_t all[8] = {words[0], words[1], words[2], words[3], 0, 0, 0, 0};
      store_operand(output.operand_bf16 + g * fused_block, kind, constants, true, all, core_ns::scale_code(exponent));
    }
    return true;
  }
  unsigned nonzero = fused_block;  // v != 0, NaN included
  if (smallest == 0) {
#pragma unroll
    for (int i = 0; i < fused_block; ++i) nonzero -= (core_ns::float_bits(v[i]) & 0x7FFFFFFFU) == 0 ? 1U : 0U;
  }
  counts[counter_nonzero] += nonzero;
  std::uint32_t words[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // the block's codes, little-endian bytes
  bool unscaled = false;  // rne or sr codes from an unscaled encoder
  std::uint8_t scale = core_ns::scale_nan_code;
  if (largest >= 0x7F800000U) {
#pragma unroll
    for (int i = 0; i < fused_block; ++i) counts[counter_nonfinite] += !is_finite(v[i]) ? 1U : 0U;
    output.scales[g] = core_ns::scale_nan_code;
    if (output.dequantized != nullptr) {
#pragma unroll
      for (int i = 0; i < fused_block; ++i) v[i] = canonical_nan_float();
      store_dequantized(output.dequantized + g * fused_block, v);
    }
  } else {
    const int exponent = plan.rule == core_ns::scale_rule::floor
                             ? fast_encode::floor_rule_exponent(core_ns::emax_elem(kind), largest)
                             : core_ns::shared_exponent(kind, plan.rule, core_ns::bits_float(largest));
    scale = core_ns::scale_code(exponent);
    output.scales[g] = scale;
    bool packed_bf16 = false;  // rne codes from the halfword encoder, two elements at a time
    if constexpr (Encoder == fused_encoder::fp4_nearest_even) {
      unscaled = fast_encode::fp4_unscaled_covers(exponent + folded);
      if constexpr (Rotation == 0 && sizeof(Input) == 2) packed_bf16 = fast_encode::fp4_unscaled_bf16x2_covers(exponent);
    }
    if constexpr (Encoder == fused_encoder::fp4_stochastic) unscaled = fast_encode::fp4_stochastic_covers(exponent + folded);
    if (packed_bf16) {
      // bf16 without rotation: fast_encode::fp4_nearest_even_bf16x2 on the words as read. Piece
      // j holds elements 8 j .. 8 j + 7, word w of it elements 8 j + 2 w (low half) and
      // 8 j + 2 w + 1, which become byte w of code word j: the two codes with their signs
      // (bits 15 and 31 of the word) moved to bits 3 and 19, folded into the low byte.
      const fast_encode::fp4_unscaled_bf16x2 grid = fast_encode::fp4_unscaled_bf16x2_constants(exponent);
      std::uint32_t saturated = 0;  // one count per half
#pragma unroll
      for (int j = 0; j < pieces; ++j) {
        const std::uint32_t words4[4] = {mine[j].x, mine[j].y, mine[j].z, mine[j].w};
        std::uint32_t bytes[4];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const std::uint32_t magnitudes = words4[w] & 0x7FFF7FFFU;
          saturated += fast_encode::fp4_saturated_bf16x2(magnitudes, grid);
          const std::uint32_t pair =
              fast_encode::fp4_nearest_even_bf16x2(magnitudes, grid) | ((words4[w] >> 12) & 0x00080008U);
          bytes[w] = pair | (pair >> 12);
        }
        words[j] = low_bytes(bytes[0], bytes[1], bytes[2], bytes[3]);
      }
      counts[counter_saturated] += (saturated & 0xFFFFU) + (saturated >> 16);
    } else if (unscaled) {
      // rne or sr on the unscaled magnitudes (fast_encode::fp4_nearest_even_unscaled,
      // fp4_stochastic_anchored_sum): no scaling multiply by 2^-e, no cap. The codes are packed by
      // additions, each word then gets its offsets once (rne: fast_encode::fp4_unscaled_word_offset;
      // the anchored sums have none), and the signs go in from v's bits.
      // For sr, element 4 q + w draws word w of Philox block 8 g + q.
      const fast_encode::fp4_unscaled grid = fast_encode::fp4_unscaled_constants(exponent + folded);
      std::uint32_t word_offset = fast_encode::fp4_unscaled_word_offset(grid);
      if constexpr (Encoder == fused_encoder::fp4_stochastic && Summed) {
        // fast_encode::fp4_stochastic_anchored_sum per element: one fp32 multiplication toward zero
        // (|v| an operand modifier), then as multiply-adds (multiply_add_low/high) the code sum >> 22
        // as the high word of sum 2^10, packed as code 16^k + word, and (sum + 1) 2^10, zero exactly
        // when the sum is undecided (low 22 bits all ones), into the least of the block's. Codes of 8
        // (above six) become 7 once per word (fp4_stochastic_anchored_saturate). The saturation count
        // adds fp32 flags (fast_encode::fp4_saturated: one fma on the fp32 pipes). Blocks outside the
        // anchor's exponents (-127..23) or the flags' (-105..102), or with a magnitude of 8 2^e or
        // more (no scale rule gives one), go to fused_block_again instead, as undecided blocks do.
        // For bf16 without rotation, a block whose least magnitude is at least 2^(e - 16) needs no
        // undecided check: there every element below one is m 2^(k - 7) with k >= e - 16, so
        // F 2^32 = m 2^(k - e + 26) has no bits below 2^10 and the carry of the sum alone decides;
        // from one on F 2^22 is an integer anyway. A block with a zero takes the check (its least
        // magnitude is 0). Folded H16 likewise where the least input's exponent field is at least
        // e + 113: v (4x the rotation) is then a multiple of 2^(field - 134) >= 2^(e + 2 - 23).
        // ptxas turns the multiply-adds by constant powers of two into LEA / LEA.HI (integer
        // pipe), leaving the multiply-add pipe to Philox's IMAD.WIDE, which fill it first.
        if (!fast_encode::fp4_stochastic_anchored_covers(exponent + folded) ||
            !fast_encode::fp4_saturation_flag_covers(exponent + folded) ||
            largest >= core_ns::float_bits(fast_encode::power_of_two(exponent + 3))) {
          counts[counter_nonzero] -= nonzero;
          return false;
        }
        const fast_encode::fp4_saturation_flag flag = fast_encode::fp4_saturation_flag_constants(exponent + folded);
        const float anchor = fast_encode::fp4_stochastic_anchor(exponent + folded);
        std::uint32_t margin = 0xffffffffU;
        float saturated = 0.0f;
        if ((Rotation == 0 && sizeof(Input) == 2 &&
             smallest >= core_ns::float_bits(fast_encode::power_of_two(exponent - 16))) ||
            (folded > 0 && least_input >= static_cast<std::uint32_t>(exponent + 113) << 7)) {
          encode_anchored_block<false, false>(v, g, plan, keys, anchor, flag, words, margin, saturated);
        } else {
          encode_anchored_block<true, false>(v, g, plan, keys, anchor, flag, words, margin, saturated);
        }
        if (margin == 0) {  // take back what this block counted
          counts[counter_nonzero] -= nonzero;
          return false;
        }
        counts[counter_saturated] += static_cast<unsigned>(saturated);
        if constexpr (folded > 0) {
          (void)finish_anchored_codes(words, v);  // the 8s made 7s and the signs in (the count comes later)
        } else {
#pragma unroll
          for (int j = 0; j < fused_block / 8; ++j) words[j] = fast_encode::fp4_stochastic_anchored_saturate(words[j]);
        }
        word_offset = 0;
      } else if constexpr (Encoder == fused_encoder::fp4_stochastic) {
        for_each_random_word(g, plan, keys, [&](int i, std::uint32_t word) {
          const float magnitude = fabsf(v[i]);
          words[i / 8] += fast_encode::fp4_stochastic_unscaled_biased(fminf(magnitude, grid.six), word, grid)
                          << (4 * (i % 8));
          count_above(counts[counter_saturated], magnitude, grid.six);
        });
      } else {
#pragma unroll
        for (int i = 0; i < fused_block; ++i) {
          const float magnitude = fabsf(v[i]);
          words[i / 8] += fast_encode::fp4_nearest_even_unscaled_biased(fminf(magnitude, grid.six), grid)
                          << (4 * (i % 8));
          count_above(counts[counter_saturated], magnitude, grid.six);
        }
      }
#pragma unroll
      for (int j = 0; j < fused_block / 8; ++j) words[j] += word_offset;
      // (folded sr: finish_anchored_codes put the signs in)
      if constexpr (!(folded > 0 && Encoder == fused_encoder::fp4_stochastic && Summed)) {
#pragma unroll
        for (int j = 0; j < fused_block / 8; ++j) {
          if constexpr (Rotation == 0 && sizeof(Input) == 2) {
            words[j] |= nibble_signs_bf16(mine[j]);
          } else {
            words[j] |= nibble_signs(v + 8 * j);
          }
        }
      }
    } else if constexpr (fp4) {
      const float inverse = fast_encode::power_of_two(-(exponent + folded));
#pragma unroll
      for (int q = 0; q < fused_block / 4; ++q) {
        core_ns::philox_block random{};
        if (Encoder != fused_encoder::fp4_nearest_even && stochastic)
          random = plan.stream.block(static_cast<std::uint64_t>(g) * (fused_block / 4) + q, keys);
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const int i = 4 * q + w;
          // v 2^-e keeps v's sign (the magnitude rounds as |v| 2^-e would): v is dead after this.
          const float scaled = v[i] * inverse;
          const float magnitude = fabsf(scaled);
          std::uint32_t code = 0;
          if constexpr (Encoder == fused_encoder::fp4_nearest_even) {
            code = fast_encode::fp4_nearest_even(magnitude);
          } else {
            const fast_encode::fp4_position position = fast_encode::fp4_locate(magnitude);
            code = fast_encode::fp4_round(position, fast_encode::fp4_round_addend(plan.rounding, position.floor_code,
                                                                                  random.word[w], random_mask));
          }
          count_above(counts[counter_saturated], magnitude, 6.0f);
          code |= (core_ns::float_bits(scaled) >> 31) << 3;
          words[i / 8] |= code << (4 * (i % 8));
        }
      }
    }
    if constexpr (fp4) {
      // Flushed: nonzero inputs with a zero code = nonzero inputs - nonzero codes.
      counts[counter_flushed] += nonzero - nonzero_fp4_magnitudes(words);
      if (output.dequantized != nullptr) {
        float decoded[fused_block];
#pragma unroll
        for (int i = 0; i < fused_block; ++i)
          decoded[i] = fast_encode::dequantize(constants, (words[i / 8] >> (4 * (i % 8))) & 0xFU, exponent);
        store_dequantized(output.dequantized + g * fused_block, decoded);
      }
    } else {
#pragma unroll
      for (int q = 0; q < fused_block / 4; ++q) {
        core_ns::philox_block random{};
        if (stochastic) random = plan.stream.block(static_cast<std::uint64_t>(g) * (fused_block / 4) + q, keys);
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const int i = 4 * q + w;
          element_result result;
          if (fast) {
            result.encoded =
                fast_encode::quantize_finite(constants, v[i], exponent, plan.rounding, random.word[w], plan.sr_bits);
            result.dequantized = fast_encode::dequantize(constants, result.encoded.code, exponent);
          } else {
            result = quantize_one<-1>(kind, v[i], exponent, plan.rounding, random.word[w], plan.sr_bits);
          }
          counts[counter_flushed] += result.encoded.flushed ? 1U : 0U;
          counts[counter_saturated] += result.encoded.saturated ? 1U : 0U;
          if (packed) {
            words[i / 8] |= static_cast<std::uint32_t>(result.encoded.code & 0x0FU) << (4 * (i % 8));
          } else {
            words[i / 4] |= static_cast<std::uint32_t>(result.encoded.code) << (8 * (i % 4));
          }
          v[i] = result.dequantized;
        }
      }
      if (output.dequantized != nullptr) store_dequantized(output.dequantized + g * fused_block, v);
    }
  }
  uint4* codes = reinterpret_cast<uint4*>(output.codes + g * (packed ? fused_block / 2 : fused_block));
  codes[0] = make_uint4(words[0], words[1], words[2], words[3]);
  if (!packed) codes[1] = make_uint4(words[4], words[5], words[6], words[7]);
  if (output.operand_bf16 != nullptr) store_operand(output.operand_bf16 + g * fused_block, kind, constants, packed, words, scale);
  return true;
}

struct fused_counts {
  unsigned values[mx_counter_count];
};

template <class Input, int Rotation, fused_encoder Encoder>
__device__ __noinline__ fused_counts fused_block_again(const Input* input, std::int64_t g, std::int64_t blocks_per_row,
                                                       mx_plan plan, core_ns::philox_keys keys, const float* signs,
                                                       mx_device_output output) {
  fused_counts out{{0, 0, 0, 0}};
  encode_fused_block<Input, Rotation, Encoder, false>(input, nullptr, g, blocks_per_row, plan, keys, signs, output,
                                                      out.values);
  return out;
}

template <class Input, int Rotation, fused_encoder Encoder>
__global__ void MXSCOPE_FUSED_BOUNDS((fused_blocks_per_multiprocessor<Input, Rotation, Encoder>))
    mx_fused_kernel(const Input* input, std::int64_t rows, std::int64_t cols, mx_plan plan,
                    core_ns::philox_keys keys, const float* signs, mx_device_output output) {
  const std::int64_t blocks_per_row = cols / fused_block;
  const std::int64_t blocks = rows * blocks_per_row;
  unsigned counts[mx_counter_count] = {0, 0, 0, 0};
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * threads_per_block;
  if constexpr (Encoder == fused_encoder::fp4_stochastic && sizeof(Input) == 2) {
    // sr on bf16: the next block's input is read while this one is encoded (the encoder's work is long
    // enough to cover the load; without it, the first use of the input was the kernel's largest stall).
    constexpr int pieces = fused_block * static_cast<int>(sizeof(Input)) / 16;
    const uint4* source = reinterpret_cast<const uint4*>(input);
    std::int64_t g = static_cast<std::int64_t>(blockIdx.x) * threads_per_block + threadIdx.x;
    uint4 next[pieces];
#pragma unroll
    for (int j = 0; j < pieces; ++j) next[j] = g < blocks ? source[g * pieces + j] : uint4{};
    const auto encode_all = [&](auto lean) {
      for (; g < blocks; g += stride) {
        bool encoded = false;
        if constexpr (Rotation > 0) {
          // Rotated blocks refill `next` inside encode_fused_block, right after reading it: no copies
          // and no second buffer (the last block reads itself again).
          encoded = encode_fused_block<Input, Rotation, Encoder, true, decltype(lean)::value>(
              input, next, g, blocks_per_row, plan, keys, signs, output, counts, next,
              g + stride < blocks ? g + stride : g);
        } else {
          uint4 mine[pieces];
  #pragma unroll
          for (int j = 0; j < pieces; ++j) mine[j] = next[j];
          if (g + stride < blocks) {
  #pragma unroll
            for (int j = 0; j < pieces; ++j) next[j] = source[(g + stride) * pieces + j];
          }
          encoded = encode_fused_block<Input, Rotation, Encoder, true>(input, mine, g, blocks_per_row, plan, keys,
                                                                       signs, output, counts);
        }
        if (!encoded) {
          const fused_counts again =
              fused_block_again<Input, Rotation, Encoder>(input, g, blocks_per_row, plan, keys, signs, output);
  #pragma unroll
          for (int k = 0; k < mx_counter_count; ++k) counts[k] += again.values[k];
        }
      }
    };
    // The lean path (folded H16 only) where the plan and the request allow it, else the general one.
    if constexpr (Rotation == 16) {
      if (plan.rule == core_ns::scale_rule::floor && signs == nullptr && output.dequantized == nullptr) {
        encode_all(std::true_type{});
      } else {
        encode_all(std::false_type{});
      }
    } else {
      encode_all(std::false_type{});
    }
  } else {
    for (std::int64_t g = static_cast<std::int64_t>(blockIdx.x) * threads_per_block + threadIdx.x; g < blocks;
         g += stride) {
      if constexpr (Encoder == fused_encoder::fp4_stochastic) {
        if (!encode_fused_block<Input, Rotation, Encoder, true>(input, nullptr, g, blocks_per_row, plan, keys, signs,
                                                               output, counts)) {
          const fused_counts again =
              fused_block_again<Input, Rotation, Encoder>(input, g, blocks_per_row, plan, keys, signs, output);
#pragma unroll
          for (int k = 0; k < mx_counter_count; ++k) counts[k] += again.values[k];
        }
      } else {
        encode_fused_block<Input, Rotation, Encoder, false>(input, nullptr, g, blocks_per_row, plan, keys, signs,
                                                            output, counts);
      }
    }
  }
  if (output.counters != nullptr) {
    const unsigned long long wide[mx_counter_count] = {counts[0], counts[1], counts[2], counts[3]};
    add_counters(output.counters, wide);
  }
}

// Four waves of resident thread blocks (at most one block per threads_per_block MX blocks), each
// looping over MX blocks: a block ends with its counters' reduction and atomics, which a grid of
// one thread per MX block repeated tens of thousands of times on a large tensor (why four:
// BENCHMARKS.md, "Tuning notes").
template <class Input, int Rotation, fused_encoder Encoder>
void launch_fused_encoder(const Input* input, std::int64_t rows, std::int64_t cols, const mx_plan& plan,
                          const float* signs, const mx_device_output& output) {
  const unsigned tiles = grid_for(rows * (cols / fused_block));  // threads_per_block MX blocks each
  const unsigned waves = 4U * static_cast<unsigned>(multiprocessor_count()) *
                         static_cast<unsigned>(fused_blocks_per_multiprocessor<Input, Rotation, Encoder>);
  // The Philox round keys go in as a parameter: the rounds read them as constant operands.
  runtime::launch(mx_fused_kernel<Input, Rotation, Encoder>, std::min(tiles, waves), threads_per_block, 0, input, rows,
                  cols, plan, plan.stream.round_keys(), signs, output);
}

template <class Input, int Rotation>
void launch_fused_for_kind(const Input* input, std::int64_t rows, std::int64_t cols, const mx_plan& plan,
                           const float* signs, const mx_device_output& output) {
  if (plan.element != element_kind::fp4_e2m1) {
    launch_fused_encoder<Input, Rotation, fused_encoder::any_format>(input, rows, cols, plan, signs, output);
  } else if (plan.rounding == core_ns::rounding_mode::rne) {
    launch_fused_encoder<Input, Rotation, fused_encoder::fp4_nearest_even>(input, rows, cols, plan, signs, output);
  } else if (plan.rounding == core_ns::rounding_mode::sr && plan.sr_bits == 32) {
    launch_fused_encoder<Input, Rotation, fused_encoder::fp4_stochastic>(input, rows, cols, plan, signs, output);
  } else {
    launch_fused_encoder<Input, Rotation, fused_encoder::fp4_by_carry>(input, rows, cols, plan, signs, output);
  }
}

template <class Input>
void launch_fused(const Input* input, std::int64_t rows, std::int64_t cols, const mx_plan& plan, int rotation,
                  const float* signs, const mx_device_output& output) {
  switch (rotation) {
    case 0:
      launch_fused_for_kind<Input, 0>(input, rows, cols, plan, nullptr, output);
      break;
    case 16:
      launch_fused_for_kind<Input, 16>(input, rows, cols, plan, signs, output);
      break;
    case 32:
      launch_fused_for_kind<Input, 32>(input, rows, cols, plan, signs, output);
      break;
    default:
      throw gpu_error("fused quantizer: rotation size " + std::to_string(rotation) + " not compiled");
  }
}

// The two passes, or along axis 0 with `columns` the one-pass column kernel where it covers the
// format. Returns whether it wrote output.operand_bf16 (the column kernel does).
template <class Input>
bool launch_generic(const Input* input, std::int64_t rows, std::int64_t cols, const mx_plan& plan,
                    const mx_device_output& output, bool columns) {
  if (columns && column_path_covers(plan)) {
    launch_columns(input, rows, cols, plan, output);
    return true;
  }
  const std::int64_t scale_count = mx_scale_rows(plan, rows, cols) * mx_scale_cols(plan, rows, cols);
  runtime::launch(mx_scale_kernel<Input>, grid_for(scale_count), threads_per_block, 0, input, rows, cols, plan,
                  output.scales);
  const std::int64_t code_bytes = mx_code_bytes(plan, rows, cols);
  runtime::launch(mx_element_kernel<Input>, reduction_grid(code_bytes), threads_per_block, 0, input, rows, cols, plan,
                  output.scales, output);
  return false;
}

template <class Input>
__global__ void widen_kernel(const Input* input, float* output, std::int64_t count) {
  MXSCOPE_GRID_LOOP(i, count) { output[i] = load_input(input, i); }
}

}  // namespace

bool fused_path_covers(const mx_plan& plan, const rotation_plan& rotation, std::int64_t rows, std::int64_t cols) {
  (void)rows;
  return plan.axis == 1 && plan.block == fused_block && cols % fused_block == 0 &&
         (rotation.size == 0 || rotation.size == 16 || rotation.size == 32);
}

void quantize_on_device(const void* input, input_format format, std::int64_t rows, std::int64_t cols,
                        const mx_plan& plan, const rotation_plan& rotation, const mx_device_output& output,
                        quantize_path path) {
  if (rows < 0 || cols < 0) throw input_error("gpu quantize: negative shape");
  if (output.codes == nullptr || output.scales == nullptr)
    throw input_error("gpu quantize: codes and scales are required");
  check_rotation(rotation, rows, cols, plan.axis, "gpu quantize");
  if (rows == 0 || cols == 0) return;
  // The fused path moves 16-byte vectors: every buffer must start on a 16-byte boundary (cudaMalloc
  // gives 256).
  const auto aligned = [](const void* pointer) { return reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0; };
  const bool vectors_fit = aligned(input) && aligned(output.codes) &&
                           (output.dequantized == nullptr || aligned(output.dequantized)) &&
                           (output.operand_bf16 == nullptr || aligned(output.operand_bf16));
  // The bf16 operand, where the path taken did not write it.
  const auto finish = [&](bool operand_written) {
    if (output.operand_bf16 != nullptr && !operand_written) launch_mx_operand(plan, rows, cols, output);
  };
  if (path == quantize_path::native ||
      (path == quantize_path::automatic && vectors_fit &&
       native_gfx950::quantize_plan_fits(plan, rotation.size, cols) && native_gfx950::present())) {
    native_gfx950::quantize(input, format, rows, cols, plan, rotation, output);  // native_gfx950_quantize.hpp
    finish(false);
    return;
  }
  const bool fused = path != quantize_path::generic && vectors_fit && fused_path_covers(plan, rotation, rows, cols);
  if (path == quantize_path::fused && !fused) {
    throw input_error(
        "gpu quantize: the fused path needs axis 1, block 32, cols a multiple of 32, rotation 0, 16 or 32 and "
        "16-byte aligned buffers");
  }
  if (fused) {
    const device_buffer signs = make_signs(rotation, cols);
    if (format == input_format::fp32) {
      launch_fused(static_cast<const float*>(input), rows, cols, plan, rotation.size, signs.as<const float>(), output);
    } else {
      launch_fused(static_cast<const std::uint16_t*>(input), rows, cols, plan, rotation.size, signs.as<const float>(),
                   output);
    }
    finish(true);  // the fused kernel writes the operand
    if (signs.get() != nullptr) release_after_kernels();  // `signs` must outlive the kernel
    return;
  }
  const bool columns = path == quantize_path::automatic;
  if (columns && rotation.size > 0 && staged_columns_fit(input, cols, plan, output, rotation.size)) {
    // Rotated along axis 0 inside the staged column kernel (no fp32 working copy).
    const device_buffer signs = make_signs(rotation, rows);
    if (format == input_format::fp32) {
      launch_staged_columns(static_cast<const float*>(input), rows, cols, plan, output, rotation.size,
                            signs.as<const float>());
    } else {
      launch_staged_columns(static_cast<const std::uint16_t*>(input), rows, cols, plan, output, rotation.size,
                            signs.as<const float>());
    }
    finish(true);
    if (signs.get() != nullptr) release_after_kernels();  // `signs` must outlive the kernel
    return;
  }
  if (rotation.size == 0) {
    const bool written = format == input_format::fp32
                             ? launch_generic(static_cast<const float*>(input), rows, cols, plan, output, columns)
                             : launch_generic(static_cast<const std::uint16_t*>(input), rows, cols, plan, output, columns);
    finish(written);
    return;
  }
  // Rotation outside the fused path: rotate an fp32 copy, then quantize the copy.
  device_buffer rotated(static_cast<std::size_t>(rows * cols) * sizeof(float));
  if (format == input_format::fp32) {
    MXSCOPE_GPU_CHECK(runtime::copy_on_device(rotated.get(), input, rotated.bytes()));
  } else {
    runtime::launch(widen_kernel<std::uint16_t>, grid_for(rows * cols), threads_per_block, 0,
                    static_cast<const std::uint16_t*>(input), rotated.as<float>(), rows * cols);
  }
  rotate_on_device(rotated.as<float>(), rows, cols, plan.axis, rotation);
  finish(launch_generic(rotated.as<const float>(), rows, cols, plan, output, columns));
  release_after_kernels();  // `rotated` must outlive the kernels
}

// ================================================================================================
// Self-test of the fast element encoder against the core.

namespace {

struct encoder_test_counters {
  unsigned long long checked;
  unsigned long long mismatches;
  unsigned long long first_mismatch;
};

__global__ void encoder_self_test_kernel(element_kind kind, core_ns::rounding_mode mode, int sr_bits, int exponent,
                                         std::uint64_t first, std::uint64_t count, std::uint64_t stride,
                                         encoder_test_counters* counters) {
  const fast_encode::element_constants constants = fast_encode::constants_of(kind);
  unsigned long long checked = 0, mismatches = 0, first_mismatch = ~0ULL;
  MXSCOPE_GRID_LOOP(i, static_cast<std::int64_t>(count)) {
    const std::uint32_t pattern = static_cast<std::uint32_t>(first + static_cast<std::uint64_t>(i) * stride);
    if ((pattern & 0x7f800000U) == 0x7f800000U) continue;
    const float value = core_ns::bits_float(pattern);
    const std::uint32_t word = (pattern * 2654435761U) ^ (pattern >> 13) ^ 0x5bd1e995U;
    const core_ns::encoded want = core_ns::quantize_element(kind, value, exponent, mode, word, sr_bits);
    const core_ns::encoded got = fast_encode::quantize_finite(constants, value, exponent, mode, word, sr_bits);
    const float want_value = static_cast<float>(core_ns::dequantize_element(kind, want.code, exponent));
    const float got_value = fast_encode::dequantize(constants, got.code, exponent);
    // The fused kernel's fp4 sr encoders (32 bits) too, where they apply: their directed roundings
    // are the device's own instructions here. The sum's code counts where it says it decided.
    core_ns::encoded stochastic = want, summed = want;
    if (kind == element_kind::fp4_e2m1 && mode == core_ns::rounding_mode::sr && sr_bits == 32 &&
        fast_encode::fp4_stochastic_covers(exponent)) {
      stochastic = fast_encode::fp4_encode_unscaled(value, exponent, true, word);
    }
    if (kind == element_kind::fp4_e2m1 && mode == core_ns::rounding_mode::sr && sr_bits == 32 &&
        fast_encode::fp4_stochastic_anchored_covers(exponent) &&
        fabsf(value) < 8.0f * fast_encode::power_of_two(exponent)) {
      const fast_encode::sum_encoded sum = fast_encode::fp4_encode_stochastic_anchored(value, exponent, word);
      if (sum.decided) summed = sum.encoded;
    }
    ++checked;
    if (want.code != got.code || want.saturated != got.saturated || want.flushed != got.flushed ||
        core_ns::float_bits(want_value) != core_ns::float_bits(got_value) || want.code != stochastic.code ||
        want.saturated != stochastic.saturated || want.flushed != stochastic.flushed || want.code != summed.code ||
        want.saturated != summed.saturated || want.flushed != summed.flushed) {
      ++mismatches;
      if (pattern < first_mismatch) first_mismatch = pattern;
    }
  }
  if (checked != 0) atomicAdd(&counters->checked, checked);
  if (mismatches != 0) {
    atomicAdd(&counters->mismatches, mismatches);
    atomicMin(&counters->first_mismatch, first_mismatch);
  }
}

}  // namespace

encoder_self_test self_test_fast_encoder(element_kind kind, core_ns::rounding_mode mode, int sr_bits, int exponent,
                                         std::uint64_t first, std::uint64_t count, std::uint64_t stride) {
  if (!fast_encode::covers(kind)) throw input_error("self_test_fast_encoder: not a float element format");
  if (sr_bits < 1 || sr_bits > 32 || exponent < -127 || exponent > 127) {
    throw input_error("self_test_fast_encoder: sr_bits must be in 1..32 and the exponent in -127..127");
  }
  encoder_self_test out;
  if (count == 0) return out;
  device_buffer counters(sizeof(encoder_test_counters));
  const encoder_test_counters initial{0, 0, ~0ULL};
  counters.upload(&initial, sizeof(initial));
  runtime::launch(encoder_self_test_kernel, grid_for(static_cast<std::int64_t>(count)), threads_per_block, 0, kind,
                  mode, sr_bits, exponent, first, count, stride, counters.as<encoder_test_counters>());
  encoder_test_counters result{};
  counters.download(&result, sizeof(result));
  out.checked = result.checked;
  out.mismatches = result.mismatches;
  out.first_mismatch = static_cast<std::uint32_t>(result.first_mismatch);
  return out;
}

