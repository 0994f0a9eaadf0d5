// Input generators for the GPU bit-exactness test and its CPU companion. Plain C++ (no test
// framework, no third-party headers). Every generator is deterministic in its seed; the callers
// draw fresh seeds per run and print them so that a failure can be replayed.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <string_view>

#include "mxscope/quantize.hpp"
#include "mxscope/tensor.hpp"

namespace test_inputs {

using mxscope::matrix;

// What kind of values a test tensor holds.
enum class value_kind : int {
  banded,     // Gaussian entries, each (row, 16-column band) with its own power of two in [-3, 3]
  extreme,    // bands from 2^-140 (fp32 subnormals) to 2^115, zero stretches and a zero row
  ties,       // small multiples of 1/8 times a band power of two: many exact rounding ties
  nonfinite,  // banded, with a few NaN, +inf and -inf entries (their blocks become NaN blocks)
};
inline constexpr int value_kind_count = 4;

inline std::string_view value_kind_name(value_kind kind) {
  switch (kind) {
    case value_kind::banded:
      return "banded";
    case value_kind::extreme:
      return "extreme";
    case value_kind::ties:
      return "ties";
    case value_kind::nonfinite:
      return "nonfinite";
  }
  return "?";
}

inline matrix make_matrix(std::int64_t rows, std::int64_t cols, value_kind kind, std::uint64_t seed) {
  std::mt19937_64 random(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  const int low = kind == value_kind::extreme ? -140 : -3;
  const int high = kind == value_kind::extreme ? 115 : 3;
  std::uniform_int_distribution<int> band_exponent(low, high);
  std::uniform_int_distribution<int> small_integer(-48, 48);
  matrix out(rows, cols);
  for (std::int64_t r = 0; r < rows; ++r) {
    int exponent = 0;
    for (std::int64_t c = 0; c < cols; ++c) {
      if (c % 16 == 0) exponent = band_exponent(random);
      double value = 0.0;
      if (kind == value_kind::ties) {
        value = std::ldexp(static_cast<double>(small_integer(random)) / 8.0, exponent);
      } else {
        value = std::ldexp(normal(random), exponent);
      }
      out(r, c) = static_cast<float>(value);
    }
  }
  if (kind == value_kind::extreme) {
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = 0; c < cols; ++c) {
        if ((r * 7 + c / 8) % 11 == 3) out(r, c) = 0.0f;
      }
    }
    if (rows > 2) {
      for (std::int64_t c = 0; c < cols; ++c) out(1, c) = 0.0f;
    }
  }
  if (kind == value_kind::nonfinite && rows * cols > 0) {
    std::uniform_int_distribution<std::int64_t> position(0, rows * cols - 1);
    const float specials[3] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity()};
    const std::int64_t count = 1 + rows * cols / 500;
    for (std::int64_t i = 0; i < count; ++i) out.values[static_cast<std::size_t>(position(random))] = specials[i % 3];
  }
  return out;
}

// bf16 values (exact in fp32): Gaussian entries times 2^e, e drawn per element from
// [-binades, binades]. A 32-value chunk then spans about 2 * binades + 8 bits of significance:
// small `binades` give chunks whose products sum exactly in fp64, large ones chunks that do not.
inline matrix make_bf16_matrix(std::int64_t rows, std::int64_t cols, int binades, std::uint64_t seed);

// fp32 -> bf16 bit patterns (round to nearest even), and the exact fp32 values of those patterns:
// the bf16 input of the quantizer benchmark and of the bf16 input tests.
inline std::uint16_t to_bf16_bits(float value) {
  std::uint32_t bits = 0;
  static_assert(sizeof(bits) == sizeof(value));
  __builtin_memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffU) > 0x7f800000U) return static_cast<std::uint16_t>((bits >> 16) | 0x0040U);
  const std::uint32_t rounding = 0x7fffU + ((bits >> 16) & 1U);
  return static_cast<std::uint16_t>((bits + rounding) >> 16);
}

inline float from_bf16_bits(std::uint16_t bits) {
  const std::uint32_t wide = static_cast<std::uint32_t>(bits) << 16;
  float value = 0.0f;
  __builtin_memcpy(&value, &wide, sizeof(value));
  return value;
}

inline matrix make_bf16_matrix(std::int64_t rows, std::int64_t cols, int binades, std::uint64_t seed) {
  std::mt19937_64 random(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_int_distribution<int> exponent(-binades, binades);
  matrix out(rows, cols);
  for (float& value : out.values) {
    value = from_bf16_bits(to_bf16_bits(static_cast<float>(std::ldexp(normal(random), exponent(random)))));
  }
  return out;
}

}  // namespace test_inputs
