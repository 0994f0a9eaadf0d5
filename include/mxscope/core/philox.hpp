// Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3", SC'11)
// and the project's canonical mapping from (seed, step, layer, role, element index) to a random word
// (NUMERICS.md section 4). The same function runs on the host and in GPU kernels, so stochastic
// rounding and random signs are bit-identical across backends.
#pragma once

#include "mxscope/core/config.hpp"

namespace mxscope::core {

struct philox_block {
  std::uint32_t word[4];
};

namespace detail {
inline constexpr std::uint32_t philox_m0 = 0xD2511F53U;
inline constexpr std::uint32_t philox_m1 = 0xCD9E8D57U;
inline constexpr std::uint32_t philox_w0 = 0x9E3779B9U;  // golden ratio
inline constexpr std::uint32_t philox_w1 = 0xBB67AE85U;  // sqrt(3) - 1
}  // namespace detail

// The 64-bit product of two 32-bit words as its two halves. In GPU device code this is one wide
// multiply: written as a 64-bit product, nvcc carried the round's words as 64-bit values and
// multiplied, shifted and xor-ed them in 64 bits, several times the instructions of the round.
// Constant evaluation (the known-answer checks below), the host and HIP take the portable product;
// both give the same halves.
struct wide_product {
  std::uint32_t lo;
  std::uint32_t hi;
};

MXSCOPE_HD constexpr wide_product multiply_wide(std::uint32_t a, std::uint32_t b) {
#if defined(__CUDA_ARCH__) && !defined(__HIP__)
  if (!__builtin_is_constant_evaluated()) return {a * b, __umulhi(a, b)};
#endif
  const std::uint64_t product = static_cast<std::uint64_t>(a) * b;
  return {static_cast<std::uint32_t>(product), static_cast<std::uint32_t>(product >> 32)};
}

// The round keys of Philox4x32-10 for a key: round r uses (key0 + r w0, key1 + r w1). A GPU kernel
// takes them as a parameter, so that its rounds read them as constant operands instead of
// recomputing (or keeping in registers) twenty words per thread.
struct philox_keys {
  std::uint32_t key0[10];
  std::uint32_t key1[10];
};

MXSCOPE_HD constexpr philox_keys philox_round_keys(std::uint32_t key0, std::uint32_t key1) {
  philox_keys keys{};
  for (int round = 0; round < 10; ++round) {
    keys.key0[round] = key0 + static_cast<std::uint32_t>(round) * detail::philox_w0;
    keys.key1[round] = key1 + static_cast<std::uint32_t>(round) * detail::philox_w1;
  }
  return keys;
}

// One Philox4x32-10 evaluation (10 rounds: the standard and the project's choice).
MXSCOPE_HD constexpr philox_block philox4x32(philox_block counter, const philox_keys& keys) {
  for (int round = 0; round < 10; ++round) {
    const wide_product product0 = multiply_wide(detail::philox_m0, counter.word[0]);
    const wide_product product1 = multiply_wide(detail::philox_m1, counter.word[2]);
    counter = philox_block{{product1.hi ^ counter.word[1] ^ keys.key0[round], product1.lo,
                            product0.hi ^ counter.word[3] ^ keys.key1[round], product0.lo}};
  }
  return counter;
}

MXSCOPE_HD constexpr philox_block philox4x32(philox_block counter, std::uint32_t key0, std::uint32_t key1) {
  return philox4x32(counter, philox_round_keys(key0, key1));
}

// FNV-1a, 32-bit, over a NUL-terminated or sized byte string: the layer-name part of the tag.
MXSCOPE_HD constexpr std::uint32_t fnv1a32(const char* text, std::uint64_t length) {
  std::uint32_t hash = 2166136261U;
  for (std::uint64_t i = 0; i < length; ++i) {
    hash ^= static_cast<std::uint8_t>(text[i]);
    hash *= 16777619U;
  }
  return hash;
}

// Roles of the random streams (NUMERICS.md section 4).
enum class random_role : std::uint32_t { none = 0, dy = 1, x = 2, w = 3, signs = 7 };

enum class seed_policy : std::uint8_t {
  per_step,  // the true training step enters the counter: a fresh pattern every step
  fixed,     // step 0 is used for every step: the same pattern every step
};

MXSCOPE_HD constexpr std::uint32_t policy_step(seed_policy policy, std::uint32_t step) {
  return policy == seed_policy::fixed ? 0U : step;
}

MXSCOPE_HD constexpr std::uint32_t stream_tag(std::uint32_t layer_hash, random_role role) {
  return layer_hash ^ static_cast<std::uint32_t>(role);
}

// A random stream: element n draws word n % 4 of philox(counter = (n/4 lo, n/4 hi, step, tag),
// key = (seed lo, seed hi)).
struct random_stream {
  std::uint64_t seed = 0;
  std::uint32_t step = 0;  // after the seed policy was applied
  std::uint32_t tag = 0;

  MXSCOPE_HD constexpr philox_keys round_keys() const {
    return philox_round_keys(static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32));
  }
  // Block `block_index` of the stream, with its round_keys() (a kernel passes them in, computed once).
  MXSCOPE_HD constexpr philox_block block(std::uint64_t block_index, const philox_keys& keys) const {
    return philox4x32(philox_block{{static_cast<std::uint32_t>(block_index),
                                    static_cast<std::uint32_t>(block_index >> 32), step, tag}},
                      keys);
  }
  MXSCOPE_HD constexpr philox_block block(std::uint64_t block_index) const { return block(block_index, round_keys()); }
  MXSCOPE_HD constexpr std::uint32_t word(std::uint64_t element_index) const {
    return block(element_index / 4).word[element_index % 4];
  }
};

// Random123 known-answer vectors (kat_vectors, philox4x32 10), pinned at compile time.
static_assert(philox4x32({{0, 0, 0, 0}}, 0, 0).word[0] == 0x6627e8d5U);
static_assert(philox4x32({{0, 0, 0, 0}}, 0, 0).word[3] == 0x9b00dbd8U);
static_assert(philox4x32({{0x243f6a88U, 0x85a308d3U, 0x13198a2eU, 0x03707344U}}, 0xa4093822U, 0x299f31d0U).word[0] ==
              0xd16cfe09U);

}  // namespace mxscope::core
