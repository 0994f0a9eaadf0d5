// Block Walsh-Hadamard rotations (NUMERICS.md section 5): Q = H_b diag(s) / sqrt(b), applied to
// consecutive segments of b elements along the quantization axis, in fp32 with a fixed operation
// order so that every backend produces the same bits.
#pragma once

#include "mxscope/core/config.hpp"

namespace mxscope::core {

inline constexpr int rotation_size_min = 2;
inline constexpr int rotation_size_max = 4096;

MXSCOPE_HD constexpr bool is_valid_rotation_size(long long size) {
  return size >= rotation_size_min && size <= rotation_size_max && (size & (size - 1)) == 0;
}

// fl32(1 / sqrt(b)) for b = 2^k: exactly 2^(-k/2) when k is even, else 2^(-(k-1)/2) * fl32(1/sqrt 2)
// (scaling by a power of two is exact, so this is the correctly rounded value).
MXSCOPE_HD constexpr float hadamard_scale(int size) {
  int log2_size = 0;
  while ((1 << log2_size) < size) ++log2_size;
  const float power = bits_float(static_cast<std::uint32_t>(127 - log2_size / 2) << 23);
  return (log2_size % 2 == 0) ? power : power * bits_float(0x3F3504F3U);  // 0x3F3504F3 = fl32(1/sqrt(2))
}

// Unnormalized fast Walsh-Hadamard transform of v[0..size), canonical order:
// for h = 1, 2, 4, ..., size/2, for each pair (j, j + h) with j mod 2h < h: (a, c) -> (a + c, a - c).
MXSCOPE_HD inline void fwht(float* values, int size) {
  for (int half = 1; half < size; half *= 2) {
    for (int start = 0; start < size; start += 2 * half) {
      for (int j = start; j < start + half; ++j) {
        const float a = values[j];
        const float c = values[j + half];
        values[j] = a + c;
        values[j + half] = a - c;
      }
    }
  }
}

// Forward rotation of one segment: v <- H (s .* v) * fl32(1/sqrt(b)). `signs` holds +-1 (or is null).
MXSCOPE_HD inline void rotate_segment(float* values, int size, const float* signs) {
  if (signs != nullptr) {
    for (int i = 0; i < size; ++i) values[i] *= signs[i];
  }
  fwht(values, size);
  const float scale = hadamard_scale(size);
  for (int i = 0; i < size; ++i) values[i] *= scale;
}

// Inverse rotation (Q^T = diag(s) H / sqrt(b)): for tests and for undoing a rotation.
MXSCOPE_HD inline void unrotate_segment(float* values, int size, const float* signs) {
  fwht(values, size);
  const float scale = hadamard_scale(size);
  for (int i = 0; i < size; ++i) values[i] *= scale;
  if (signs != nullptr) {
    for (int i = 0; i < size; ++i) values[i] *= signs[i];
  }
}

// Sign for position k along the axis from bit 0 of its Philox word: bit set -> -1.
MXSCOPE_HD constexpr float sign_from_word(std::uint32_t word) { return (word & 1U) ? -1.0f : 1.0f; }

static_assert(hadamard_scale(16) == 0.25f && hadamard_scale(4) == 0.5f && hadamard_scale(4096) == 1.0f / 64.0f);

}  // namespace mxscope::core
