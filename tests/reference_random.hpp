// Test-side Philox4x32-10 and FNV-1a, written from the published descriptions (Salmon et al., SC'11;
// Fowler-Noll-Vo) and the counter/key mapping of NUMERICS.md section 4. Nothing here calls mxscope
// code; the tests compare the library's random streams with these.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace reference {

using philox_words = std::array<std::uint32_t, 4>;

// Philox4x32 with R rounds. One round: the two 32x32->64 products of the multipliers with counter
// words 0 and 2 are split into high and low halves and mixed with the odd words and the key:
//   (c0, c1, c2, c3) -> (hi(M1*c2) ^ c1 ^ k0, lo(M1*c2), hi(M0*c0) ^ c3 ^ k1, lo(M0*c0));
// the key is bumped by the Weyl constants between rounds.
inline philox_words philox4x32_10(philox_words counter, std::uint32_t key_low, std::uint32_t key_high) {
  constexpr std::uint64_t multiplier_0 = 0xD2511F53ULL;
  constexpr std::uint64_t multiplier_1 = 0xCD9E8D57ULL;
  constexpr std::uint32_t weyl_0 = 0x9E3779B9U;
  constexpr std::uint32_t weyl_1 = 0xBB67AE85U;
  std::array<std::uint32_t, 2> key = {key_low, key_high};
  for (int round = 1; round <= 10; ++round) {
    const std::uint64_t product_a = multiplier_0 * counter[0];
    const std::uint64_t product_b = multiplier_1 * counter[2];
    counter = {static_cast<std::uint32_t>(product_b >> 32) ^ counter[1] ^ key[0],
               static_cast<std::uint32_t>(product_b & 0xFFFFFFFFULL),
               static_cast<std::uint32_t>(product_a >> 32) ^ counter[3] ^ key[1],
               static_cast<std::uint32_t>(product_a & 0xFFFFFFFFULL)};
    key[0] += weyl_0;
    key[1] += weyl_1;
  }
  return counter;
}

// FNV-1a, 32 bits: offset basis 2166136261, prime 16777619, xor then multiply per byte.
inline std::uint32_t fnv1a32(std::string_view text) {
  std::uint32_t hash = 0x811C9DC5U;
  for (const char character : text) {
    hash = (hash ^ static_cast<std::uint8_t>(character)) * 0x01000193U;
  }
  return hash;
}

// Role numbers of NUMERICS.md section 4.
inline constexpr std::uint32_t role_dy = 1;
inline constexpr std::uint32_t role_x = 2;
inline constexpr std::uint32_t role_w = 3;
inline constexpr std::uint32_t role_signs = 7;

// The random word of element n: word n % 4 of Philox(counter = (j lo, j hi, step, tag),
// key = (seed lo, seed hi)) with j = n / 4 and tag = fnv1a32(layer) ^ role.
inline std::uint32_t stream_word(std::uint64_t seed, std::uint32_t step, std::uint32_t tag, std::uint64_t element) {
  const std::uint64_t block = element / 4;
  const philox_words output = philox4x32_10(
      {static_cast<std::uint32_t>(block & 0xFFFFFFFFULL), static_cast<std::uint32_t>(block >> 32), step, tag},
      static_cast<std::uint32_t>(seed & 0xFFFFFFFFULL), static_cast<std::uint32_t>(seed >> 32));
  return output[element % 4];
}

}  // namespace reference
