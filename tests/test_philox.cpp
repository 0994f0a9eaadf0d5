// Philox4x32-10 and the canonical random stream (NUMERICS.md section 4): the Random123 known-answer
// vectors, the counter/key/tag mapping against an independent Philox written in the test, FNV-1a
// test vectors, and a rough uniformity check of the stream.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "mxscope/core/philox.hpp"
#include "reference_random.hpp"

namespace {

namespace core = mxscope::core;

struct known_answer {
  std::uint32_t counter[4];
  std::uint32_t key[2];
  std::uint32_t output[4];
};

// Random123 kat_vectors, "philox4x32 10" lines.
constexpr known_answer random123_vectors[] = {
    {{0x00000000, 0x00000000, 0x00000000, 0x00000000},
     {0x00000000, 0x00000000},
     {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
    {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
     {0xffffffff, 0xffffffff},
     {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
    {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
     {0xa4093822, 0x299f31d0},
     {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
};

std::string words_text(const std::uint32_t* words) {
  return fmt::format("{:08x} {:08x} {:08x} {:08x}", words[0], words[1], words[2], words[3]);
}

TEST(Philox, LibraryMatchesTheRandom123KnownAnswers) {
  for (const auto& vector : random123_vectors) {
    const core::philox_block counter{{vector.counter[0], vector.counter[1], vector.counter[2], vector.counter[3]}};
    const core::philox_block output = core::philox4x32(counter, vector.key[0], vector.key[1]);
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(output.word[i], vector.output[i])
          << "counter " << words_text(vector.counter) << " key " << fmt::format("{:08x} {:08x}", vector.key[0], vector.key[1])
          << ": expected " << words_text(vector.output) << ", got " << words_text(output.word);
    }
  }
}

TEST(Philox, TestReferenceMatchesTheRandom123KnownAnswers) {
  for (const auto& vector : random123_vectors) {
    const auto output = reference::philox4x32_10(
        {vector.counter[0], vector.counter[1], vector.counter[2], vector.counter[3]}, vector.key[0], vector.key[1]);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(output[i], vector.output[i]) << "word " << i;
  }
}

TEST(Philox, LibraryMatchesTheReferenceOnRandomCountersAndKeys) {
  std::uint64_t state = 0x0123456789ABCDEFULL;
  auto next = [&state]() {  // splitmix64: a generator unrelated to Philox for the inputs
    state += 0x9E3779B97F4A7C15ULL;
    std::uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  };
  for (int trial = 0; trial < 20000; ++trial) {
    const std::uint64_t a = next(), b = next(), c = next();
    const reference::philox_words counter = {static_cast<std::uint32_t>(a), static_cast<std::uint32_t>(a >> 32),
                                             static_cast<std::uint32_t>(b), static_cast<std::uint32_t>(b >> 32)};
    const auto expected = reference::philox4x32_10(counter, static_cast<std::uint32_t>(c),
                                                   static_cast<std::uint32_t>(c >> 32));
    const auto actual = core::philox4x32(core::philox_block{{counter[0], counter[1], counter[2], counter[3]}},
                                         static_cast<std::uint32_t>(c), static_cast<std::uint32_t>(c >> 32));
    for (int i = 0; i < 4; ++i) {
      ASSERT_EQ(actual.word[i], expected[i]) << "counter " << words_text(counter.data()) << " key "
                                             << fmt::format("{:016x}", c) << " word " << i;
    }
  }
}

TEST(Fnv1a, KnownTestVectors) {
  EXPECT_EQ(core::fnv1a32("", 0), 0x811c9dc5U);
  EXPECT_EQ(core::fnv1a32("a", 1), 0xe40c292cU);
  EXPECT_EQ(core::fnv1a32("foobar", 6), 0xbf9cf968U);
  // The test's own FNV-1a reproduces the same published vectors.
  EXPECT_EQ(reference::fnv1a32(""), 0x811c9dc5U);
  EXPECT_EQ(reference::fnv1a32("a"), 0xe40c292cU);
  EXPECT_EQ(reference::fnv1a32("foobar"), 0xbf9cf968U);
  for (const std::string name : {"model.layers.0.mlp.fc1", "model.layers.11.self_attn.q_proj", "lm_head", "é"}) {
    EXPECT_EQ(core::fnv1a32(name.data(), name.size()), reference::fnv1a32(name)) << "layer " << name;
  }
}

// NUMERICS.md section 4: element n uses word n % 4 of block j = n / 4, counter = (j lo, j hi, step,
// tag), key = (seed lo, seed hi), tag = fnv1a32(layer) ^ role.
TEST(RandomStream, CounterAndKeyMappingMatchesTheSpec) {
  const std::uint64_t seeds[] = {0, 1, 0x00000000FFFFFFFFULL, 0xFFFFFFFF00000000ULL, 0x243F6A8885A308D3ULL};
  const std::uint32_t steps[] = {0, 1, 3, 0x80000001U};
  const std::uint64_t element_starts[] = {0, 1, 2, 3, 4, 1000003, (std::uint64_t{1} << 34) - 3,
                                          (std::uint64_t{5} << 34) + 2, ~std::uint64_t{0} - 9};
  const std::string layers[] = {"", "model.layers.3.mlp.down_proj"};
  const std::uint32_t roles[] = {reference::role_dy, reference::role_x, reference::role_w, reference::role_signs};
  const core::random_role library_roles[] = {core::random_role::dy, core::random_role::x, core::random_role::w,
                                             core::random_role::signs};
  for (const std::uint64_t seed : seeds) {
    for (const std::uint32_t step : steps) {
      for (const auto& layer : layers) {
        for (int r = 0; r < 4; ++r) {
          const std::uint32_t expected_tag = reference::fnv1a32(layer) ^ roles[r];
          const std::uint32_t tag = core::stream_tag(core::fnv1a32(layer.data(), layer.size()), library_roles[r]);
          ASSERT_EQ(tag, expected_tag) << "layer '" << layer << "' role " << roles[r];
          const core::random_stream stream{seed, step, tag};
          for (const std::uint64_t start : element_starts) {
            for (std::uint64_t offset = 0; offset < 9 && start + offset >= start; ++offset) {
              const std::uint64_t element = start + offset;
              const std::uint32_t expected = reference::stream_word(seed, step, expected_tag, element);
              ASSERT_EQ(stream.word(element), expected)
                  << "seed " << fmt::format("{:#018x}", seed) << " step " << step << " layer '" << layer << "' role "
                  << roles[r] << " element " << element;
            }
          }
        }
      }
    }
  }
}

TEST(RandomStream, SeedPolicyMapsTheStep) {
  EXPECT_EQ(core::policy_step(core::seed_policy::fixed, 7), 0U);
  EXPECT_EQ(core::policy_step(core::seed_policy::fixed, 0), 0U);
  EXPECT_EQ(core::policy_step(core::seed_policy::per_step, 7), 7U);
}

// A rough check that the stream looks uniform: every bit is set about half the time and the top
// byte fills 256 bins evenly. The seed is fixed, so the outcome is deterministic; the bounds are
// six standard deviations wide so a correct generator passes with a wide margin.
TEST(RandomStream, RoughUniformity) {
  const core::random_stream stream{0x5EED5EED12345678ULL, 42, reference::fnv1a32("layer") ^ reference::role_x};
  constexpr int draws = 1 << 20;
  std::vector<std::int64_t> bit_counts(32, 0);
  std::vector<std::int64_t> bins(256, 0);
  double sum = 0.0;
  for (std::uint64_t n = 0; n < draws; ++n) {
    const std::uint32_t word = stream.word(n);
    for (int bit = 0; bit < 32; ++bit) bit_counts[static_cast<std::size_t>(bit)] += (word >> bit) & 1U;
    ++bins[word >> 24];
    sum += static_cast<double>(word) / 4294967296.0;
  }
  const double bit_sigma = std::sqrt(draws * 0.25);
  for (int bit = 0; bit < 32; ++bit) {
    EXPECT_LT(std::fabs(static_cast<double>(bit_counts[static_cast<std::size_t>(bit)]) - draws / 2.0), 6.0 * bit_sigma)
        << "bit " << bit;
  }
  const double expected_per_bin = draws / 256.0;
  double chi_square = 0.0;
  for (const auto count : bins) {
    chi_square += (static_cast<double>(count) - expected_per_bin) * (static_cast<double>(count) - expected_per_bin) /
                  expected_per_bin;
  }
  // 255 degrees of freedom: mean 255, standard deviation sqrt(2 * 255) ~ 22.6.
  EXPECT_LT(chi_square, 255.0 + 6.0 * std::sqrt(510.0));
  EXPECT_GT(chi_square, 255.0 - 6.0 * std::sqrt(510.0));
  // Mean of uniform [0, 1): 1/2 with standard deviation sqrt(1/12 / N).
  EXPECT_LT(std::fabs(sum / draws - 0.5), 6.0 * std::sqrt(1.0 / 12.0 / draws));
}

}  // namespace
