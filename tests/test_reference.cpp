// Reference GEMMs against a Boost.Multiprecision oracle written here: the exact sum of products as a
// fixed-point integer at the 2^-1074 scale (significands from frexp), rounded by nearest-neighbour
// search among the floats around an approximation (ties to the even significand).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <boost/multiprecision/cpp_int.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "support/bits.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/reference.hpp"

namespace {

using mxscope::testing::bits_of;
using mxscope::testing::hex;

using boost::multiprecision::cpp_int;
using mxscope::matrix;
using mxscope::matrix64;
using mxscope::reference_kind;
using mxscope::reference_result;

constexpr int finest_scale = 1074;  // every finite double is an integer times 2^-1074


// ------------------------------------------------------------------------------------------
// Oracle.

// An fp32 value as integer * 2^exponent via frexp (a different route from the library's bit fields).
void decompose(float x, std::int64_t& integer, int& exponent) {
  int e = 0;
  const double fraction = std::frexp(static_cast<double>(x), &e);  // x = fraction * 2^e, |fraction| in [0.5, 1)
  integer = static_cast<std::int64_t>(std::ldexp(fraction, 24));   // exact: fp32 has 24 significant bits
  exponent = e - 24;
}

// A finite double times 2^1074, exactly.
cpp_int fixed_of(double x) {
  if (x == 0.0) return 0;
  int e = 0;
  const double fraction = std::frexp(x, &e);
  const auto integer = static_cast<std::int64_t>(std::ldexp(fraction, 53));
  const int shift = e - 53 + finest_scale;
  cpp_int magnitude = cpp_int(integer < 0 ? -integer : integer);
  if (shift >= 0) magnitude <<= shift;
  else magnitude >>= -shift;  // subnormal: the dropped bits are zero
  return integer < 0 ? cpp_int(-magnitude) : magnitude;
}

// sum_k a_k b_k times 2^1074, exactly (all inputs finite).
cpp_int exact_dot(const float* a, const float* b, std::int64_t k_count) {
  cpp_int sum = 0;
  for (std::int64_t k = 0; k < k_count; ++k) {
    std::int64_t ia = 0;
    std::int64_t ib = 0;
    int ea = 0;
    int eb = 0;
    decompose(a[k], ia, ea);
    decompose(b[k], ib, eb);
    if (ia == 0 || ib == 0) continue;
    sum += cpp_int(ia * ib) << (ea + eb + finest_scale);  // ea + eb >= -298
  }
  return sum;
}

// A rough value of s * 2^-1074 (within a few ulps), to centre the search.
double approximate(const cpp_int& s) {
  if (s == 0) return 0.0;
  const cpp_int magnitude = s < 0 ? cpp_int(-s) : s;
  const int lead = static_cast<int>(boost::multiprecision::msb(magnitude));
  const int drop = std::max(0, lead - 62);
  const double top = static_cast<double>((magnitude >> drop).convert_to<std::uint64_t>());
  const double value = std::ldexp(top, drop - finest_scale);
  return s < 0 ? -value : value;
}

// The value of s * 2^-1074 rounded to nearest-even in F (double or float), by comparing the exact
// distance to every float within a window around the approximation. Infinity competes as 2^(emax+1).
template <class F>
F nearest(const cpp_int& s) {
  if (s == 0) return F(0);
  const bool negative = s < 0;
  const double rough = std::fabs(approximate(s));
  F center = static_cast<F>(rough);
  if (std::isinf(center)) center = std::numeric_limits<F>::max();
  std::vector<F> candidates{center};
  F down = center;
  F up = center;
  for (int step = 0; step < 6; ++step) {
    down = std::nextafter(down, F(0));
    up = std::nextafter(up, std::numeric_limits<F>::infinity());
    candidates.push_back(down);
    candidates.push_back(up);
  }
  const cpp_int target = negative ? cpp_int(-s) : s;
  const cpp_int overflow_value = cpp_int(1) << (std::numeric_limits<F>::max_exponent + finest_scale);
  F best = center;
  cpp_int best_distance = -1;
  bool best_even = false;
  for (const F candidate : candidates) {
    const cpp_int value = std::isinf(candidate) ? overflow_value : fixed_of(static_cast<double>(candidate));
    const cpp_int distance = value > target ? cpp_int(value - target) : cpp_int(target - value);
    bool even = true;
    if (!std::isinf(candidate)) {
      if constexpr (sizeof(F) == 8) even = (bits_of(static_cast<double>(candidate)) & 1U) == 0;
      else even = (bits_of(static_cast<float>(candidate)) & 1U) == 0;
    }
    if (best_distance < 0 || distance < best_distance || (distance == best_distance && even && !best_even)) {
      best = candidate;
      best_distance = distance;
      best_even = even;
    }
  }
  // The window must have contained the answer: its ends are farther unless they are 0 or infinity.
  EXPECT_TRUE((best != down || down == F(0)) && (best != up || std::isinf(up))) << "oracle window too small";
  return negative ? -best : best;
}

struct oracle_entry {
  cpp_int exact;
  double value64;
  float value32;
};

oracle_entry oracle(const matrix& a, const matrix& b, std::int64_t i, std::int64_t j) {
  oracle_entry entry;
  entry.exact = exact_dot(a.data() + i * a.cols, b.data() + j * b.cols, a.cols);
  entry.value64 = nearest<double>(entry.exact);
  entry.value32 = nearest<float>(entry.exact);
  return entry;
}

// ------------------------------------------------------------------------------------------
// Inputs.

matrix random_normal(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  matrix m(rows, cols);
  for (float& v : m.values) v = normal(rng);
  return m;
}

// Rounds to `bits` significant bits (RNE), as bf16 (8) or fp16 (11) values within their ranges.
float round_to_bits(float x, int bits) {
  if (x == 0.0f) return x;
  int e = 0;
  const double fraction = std::frexp(static_cast<double>(x), &e);
  return static_cast<float>(std::ldexp(std::nearbyint(std::ldexp(fraction, bits)), e - bits));
}

// Each element times 2^k, k uniform in [-100, 100].
void scale_binades(matrix& m, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> exponent(-100, 100);
  for (float& v : m.values) v = std::ldexp(v, exponent(rng));
}

std::string describe(const matrix& a, const matrix& b, std::int64_t i, std::int64_t j) {
  std::ostringstream out;
  out << "entry (" << i << ", " << j << "), K = " << a.cols << "; A row:";
  for (std::int64_t k = 0; k < std::min<std::int64_t>(a.cols, 8); ++k) out << " " << hex(a(i, k));
  out << " ...; B row:";
  for (std::int64_t k = 0; k < std::min<std::int64_t>(b.cols, 8); ++k) out << " " << hex(b(j, k));
  out << (a.cols > 8 ? " ..." : "");
  return out.str();
}

// Every entry of the exact reference equals the oracle's rounding, bit for bit.
void expect_exact_matches_oracle(const matrix& a, const matrix& b, const reference_result& result,
                                 const std::string& what) {
  ASSERT_EQ(result.fp64.rows, a.rows);
  ASSERT_EQ(result.fp64.cols, b.rows);
  int failures = 0;
  for (std::int64_t i = 0; i < a.rows; ++i) {
    for (std::int64_t j = 0; j < b.rows; ++j) {
      const oracle_entry expected = oracle(a, b, i, j);
      const double got64 = result.fp64(i, j);
      const float got32 = result.fp32(i, j);
      if (bits_of(got64) != bits_of(expected.value64) || bits_of(got32) != bits_of(expected.value32)) {
        if (++failures > 5) continue;
        ADD_FAILURE() << what << " (policy: exact reference, RNE): " << describe(a, b, i, j) << "\n  fp64 expected "
                      << hex(expected.value64) << " got " << hex(got64) << "\n  fp32 expected "
                      << hex(expected.value32) << " got " << hex(got32);
      }
    }
  }
  EXPECT_EQ(failures, 0) << what;
  const mxscope::reference_stats& stats = result.stats;
  EXPECT_EQ(stats.entries, a.rows * b.rows);
  EXPECT_EQ(stats.certified_entries + stats.fallback_entries + stats.nonfinite_entries, stats.entries);
  EXPECT_EQ(static_cast<std::int64_t>(stats.fallback_indices.size()), stats.fallback_entries);
  EXPECT_TRUE(std::is_sorted(stats.fallback_indices.begin(), stats.fallback_indices.end()));
}

// ------------------------------------------------------------------------------------------
// exact, once per fast-pass variant the processor can run (MXSCOPE_REFERENCE_KERNEL selects it)

struct kernel_variant {
  const char* name;
  int lanes;
};

void PrintTo(const kernel_variant& variant, std::ostream* out) { *out << variant.name; }

std::vector<kernel_variant> runnable_variants() {
  std::vector<kernel_variant> variants{{"generic", 2}};
#if defined(__x86_64__) && defined(__GNUC__)
  if (__builtin_cpu_supports("avx2")) variants.push_back({"avx2", 4});
  if (__builtin_cpu_supports("avx512f")) variants.push_back({"avx512", 8});
#endif
  return variants;
}

class ExactReference : public ::testing::TestWithParam<kernel_variant> {
 protected:
  void SetUp() override { setenv("MXSCOPE_REFERENCE_KERNEL", GetParam().name, 1); }
  void TearDown() override { unsetenv("MXSCOPE_REFERENCE_KERNEL"); }

  reference_result run(const matrix& a, const matrix& b) {
    reference_result result = mxscope::reference_gemm(a, b, reference_kind::exact);
    EXPECT_EQ(result.stats.vector_lanes, GetParam().lanes) << "kernel " << GetParam().name;
    return result;
  }
};

INSTANTIATE_TEST_SUITE_P(FastPass, ExactReference, ::testing::ValuesIn(runnable_variants()),
                         [](const ::testing::TestParamInfo<kernel_variant>& info) { return std::string(info.param.name); });

TEST_P(ExactReference, RandomNormalMatchesOracleForAwkwardK) {
  for (const std::int64_t k : {1, 33, 100, 1000}) {
    const matrix a = random_normal(6, k, 11 + static_cast<std::uint64_t>(k));
    const matrix b = random_normal(5, k, 97 + static_cast<std::uint64_t>(k));
    const reference_result result = run(a, b);
    expect_exact_matches_oracle(a, b, result, "random normal K=" + std::to_string(k));
  }
}

TEST_P(ExactReference, Bf16AndFp16ValuedInputs) {
  for (const int bits : {8, 11}) {
    for (const std::int64_t k : {33, 1000}) {
      matrix a = random_normal(5, k, 5000 + static_cast<std::uint64_t>(bits * k));
      matrix b = random_normal(4, k, 6000 + static_cast<std::uint64_t>(bits * k));
      for (float& v : a.values) v = round_to_bits(v, bits);
      for (float& v : b.values) v = round_to_bits(v, bits);
      const reference_result result = run(a, b);
      expect_exact_matches_oracle(a, b, result, std::to_string(bits) + "-bit significands, K=" + std::to_string(k));
    }
  }
}

TEST_P(ExactReference, InputsSpanningTwoHundredBinades) {
  for (const std::int64_t k : {33, 100, 1000}) {
    matrix a = random_normal(5, k, 700 + static_cast<std::uint64_t>(k));
    matrix b = random_normal(4, k, 800 + static_cast<std::uint64_t>(k));
    scale_binades(a, 1);
    scale_binades(b, 2);
    const reference_result result = run(a, b);
    expect_exact_matches_oracle(a, b, result, "2^[-100,100] scaled, K=" + std::to_string(k));
  }
}

TEST_P(ExactReference, SubnormalInputs) {
  const std::int64_t k = 100;
  matrix a = random_normal(4, k, 31);
  matrix b = random_normal(4, k, 32);
  // Row 0 of A fully subnormal, row 1 mixed, rows of B at ordinary, large and subnormal scales.
  for (std::int64_t c = 0; c < k; ++c) {
    a(0, c) = std::ldexp(a(0, c), -135);
    if (c % 2 == 0) a(1, c) = std::ldexp(a(1, c), -140);
    b(1, c) = std::ldexp(b(1, c), 90);
    b(2, c) = std::ldexp(b(2, c), -138);
  }
  int subnormals = 0;
  for (const float v : a.values) subnormals += std::fpclassify(v) == FP_SUBNORMAL ? 1 : 0;
  ASSERT_GT(subnormals, 50);
  const reference_result result = run(a, b);
  expect_exact_matches_oracle(a, b, result, "subnormal inputs");
}

// Products that cancel in pairs (x and -x) leaving nothing, a tiny remainder, or a remainder near
// the bottom of the fp32 range.
TEST_P(ExactReference, HeavyCancellation) {
  const std::int64_t half = 50;
  const std::int64_t k = 2 * half + 1;
  std::mt19937_64 rng(1234);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-60, 60);
  std::vector<std::int64_t> permutation(static_cast<std::size_t>(k));
  std::iota(permutation.begin(), permutation.end(), 0);
  std::shuffle(permutation.begin(), permutation.end(), rng);
  const float tails[] = {0.0f, 0x1p-100f, -0x1p-126f, 0x1.8p-140f, 1.0f, -0x1p-60f};
  const std::int64_t rows = 6;
  matrix a(rows, k);
  matrix b(5, k);
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t h = 0; h < half; ++h) {
      const float x = std::ldexp(normal(rng), exponent(rng));
      a(i, permutation[static_cast<std::size_t>(h)]) = x;
      a(i, permutation[static_cast<std::size_t>(h + half)]) = -x;
    }
    a(i, permutation[static_cast<std::size_t>(2 * half)]) = tails[i];
  }
  for (std::int64_t j = 0; j < b.rows; ++j) {
    for (std::int64_t h = 0; h < half; ++h) {
      const float y = std::ldexp(normal(rng), exponent(rng));
      b(j, permutation[static_cast<std::size_t>(h)]) = y;
      b(j, permutation[static_cast<std::size_t>(h + half)]) = y;
    }
    b(j, permutation[static_cast<std::size_t>(2 * half)]) = j == 0 ? 1.0f : std::ldexp(normal(rng), exponent(rng));
  }
  const reference_result result = run(a, b);
  expect_exact_matches_oracle(a, b, result, "x/-x cancellation");
  // The exact zeros are +0 in both precisions.
  for (std::int64_t j = 0; j < b.rows; ++j) {
    EXPECT_EQ(bits_of(result.fp64(0, j)), 0U) << "row 0 cancels exactly, column " << j;
    EXPECT_EQ(bits_of(result.fp32(0, j)), 0U) << "row 0 cancels exactly, column " << j;
  }
  EXPECT_GT(result.stats.fallback_entries, 0) << "cancellation below the bound must take the fallback";
}

TEST_P(ExactReference, ZeroRowsAndSignedZeros) {
  const std::int64_t k = 40;
  matrix a = random_normal(4, k, 77);
  matrix b = random_normal(3, k, 78);
  for (std::int64_t c = 0; c < k; ++c) {
    a(1, c) = (c % 2 == 0) ? -0.0f : 0.0f;
    b(2, c) = -0.0f;
  }
  const reference_result result = run(a, b);
  expect_exact_matches_oracle(a, b, result, "zero rows");
  for (std::int64_t j = 0; j < 3; ++j) EXPECT_EQ(bits_of(result.fp64(1, j)), 0U) << "zero row of A gives +0";
  for (std::int64_t i = 0; i < 4; ++i) EXPECT_EQ(bits_of(result.fp32(i, 2)), 0U) << "zero row of B gives +0";
}

TEST_P(ExactReference, EmptyReductionGivesZeros) {
  const matrix a(3, 0);
  const matrix b(2, 0);
  const reference_result result = run(a, b);
  ASSERT_EQ(result.fp64.size(), 6);
  for (const double v : result.fp64.values) EXPECT_EQ(bits_of(v), 0U);
  for (const float v : result.fp32.values) EXPECT_EQ(bits_of(v), 0U);
}

// Ties and near-ties: an exact fp64 tie whose inputs span 53 binades (the low-part sum is provably
// exact, so the fast pass rounds the tie itself), a value 2^-110 above a tie (the low-part sum loses
// it; only the fallback can round it), and an fp32 tie plus 2^-100 (the double-rounding trap:
// fp32(fp64(S)) would round down; fallback again). Plain entries are settled by the fast pass.
TEST_P(ExactReference, FallbackSettlesTiesAndNearTies) {
  const std::int64_t k = 3;
  matrix a(7, k);
  const float rows[7][3] = {
      {1.0f, 0x1p-53f, 0.0f},          // S = 1 + 2^-53: fp64 tie -> 1 (even)
      {1.0f, 0x1p-53f, 0x1p-110f},     // just above the tie -> 1 + 2^-52
      {1.0f, 0x1p-24f, 0x1p-100f},     // fp64 1 + 2^-24; fp32 just above its tie -> 1 + 2^-23
      {1.0f, 2.0f, 3.0f},              // S = 6: certified
      {0x1p20f, 1.0f, -0x1p20f},       // S = 1 with no rounding anywhere: certified
      {1.0f, -1.0f, 0x1p-140f},        // cancellation to an fp32 subnormal
      {3.0f, -3.0f, 0.0f},             // exact zero
  };
  for (std::int64_t i = 0; i < 7; ++i) {
    for (std::int64_t c = 0; c < k; ++c) a(i, c) = rows[i][c];
  }
  const matrix b(1, k, 1.0f);
  const reference_result result = run(a, b);
  expect_exact_matches_oracle(a, b, result, "crafted ties");

  // Expected values typed from the arithmetic above.
  EXPECT_EQ(result.fp64(0, 0), 1.0);
  EXPECT_EQ(result.fp32(0, 0), 1.0f);
  EXPECT_EQ(result.fp64(1, 0), 1.0 + 0x1p-52);
  EXPECT_EQ(result.fp64(2, 0), 1.0 + 0x1p-24);
  EXPECT_EQ(result.fp32(2, 0), 1.0f + 0x1p-23f) << "fp32 must round the exact sum, not the fp64 value";
  EXPECT_EQ(result.fp64(3, 0), 6.0);
  EXPECT_EQ(result.fp64(4, 0), 1.0);
  EXPECT_EQ(result.fp64(5, 0), 0x1p-140);
  EXPECT_EQ(result.fp32(5, 0), 0x1p-140f);
  EXPECT_EQ(bits_of(result.fp64(6, 0)), 0U);

  const std::vector<std::int64_t>& fallback = result.stats.fallback_indices;
  const auto fell_back = [&](std::int64_t flat) { return std::find(fallback.begin(), fallback.end(), flat) != fallback.end(); };
  EXPECT_FALSE(fell_back(0)) << "3 binades: the low-part sum is provably exact, the tie is rounded by the hardware";
  EXPECT_TRUE(fell_back(1)) << "2^-110 above a tie is below the bound";
  EXPECT_TRUE(fell_back(2)) << "an fp32 near-tie must not be certified";
  EXPECT_FALSE(fell_back(3)) << "6 is far from any rounding boundary";
  EXPECT_FALSE(fell_back(4)) << "1 is far from any rounding boundary";
  EXPECT_GT(result.stats.fallback_fraction(), 0.0);
}

// Many entries a hair away from an fp64 or fp32 tie. The hair is a handful of tiny products, each
// below half an ulp of the 2^-53 (or 2^-24) tie term they are summed with, so the fp64 low-part sum
// rounds each of them away or up to a whole ulp, and the sign of its error is unrelated to the sign
// of their exact sum: an uncertified estimate rounds many of these entries the wrong way. The
// certification bound must send them to the fallback (or certify them correctly).
TEST_P(ExactReference, NearTiesMadeOfTinyProducts) {
  std::mt19937_64 rng(4242);
  std::uniform_int_distribution<std::uint32_t> mantissa(0x800000U, 0xffffffU);
  std::uniform_int_distribution<int> exponent(0, 3);
  std::uniform_int_distribution<int> coin(0, 1);
  const std::int64_t tiny_terms = 9;
  const std::int64_t k = 2 + tiny_terms;
  const std::int64_t rows = 400;
  matrix a(rows, k);
  for (std::int64_t i = 0; i < rows; ++i) {
    const bool fp32_tie = i % 4 == 3;
    // Half an ulp of the tie term 2^-53 is 2^-106 (2^-77 for 2^-24): tiny terms from 2^-106 down.
    const int tiny_scale = fp32_tie ? -23 - 77 : -23 - 106;
    a(i, 0) = std::ldexp(static_cast<float>(mantissa(rng)), -23);  // in [1, 2): its fp64 last bit is even
    a(i, 1) = fp32_tie ? 0x1p-24f : 0x1p-53f;                       // half an ulp of a(i, 0)
    for (std::int64_t t = 0; t < tiny_terms; ++t) {
      const float magnitude = std::ldexp(static_cast<float>(mantissa(rng)), tiny_scale - exponent(rng));
      a(i, 2 + t) = coin(rng) == 0 ? magnitude : -magnitude;
    }
  }
  const matrix b(2, k, 1.0f);
  const reference_result result = run(a, b);
  expect_exact_matches_oracle(a, b, result, "near ties");
  EXPECT_GT(result.stats.fallback_entries, 0);
}

// A deterministic worst case for the low-part sum: in the same vector lane as the tie term 2^-53
// (positions 1 mod 8), ten products of 15/32 of an ulp of 2^-53 (2^-105) are each rounded away,
// then -4.5 ulps is added exactly. The fp64 sum says "4.5 ulps below the tie" (round down); the
// exact sum is 0.1875 ulps above it (round up). Only the bound stands between the two.
TEST_P(ExactReference, LowPartErrorsLargerThanTheMargin) {
  const std::int64_t k = 96;
  matrix a(2, k, 0.0f);
  for (std::int64_t row = 0; row < 2; ++row) {
    const float sign = row == 0 ? 1.0f : -1.0f;
    a(row, 0) = sign * 1.5f;
    a(row, 1) = sign * 0x1p-53f;
    for (std::int64_t t = 0; t < 10; ++t) a(row, 9 + 8 * t) = sign * 15.0f * 0x1p-110f;
    a(row, 89) = sign * -9.0f * 0x1p-106f;
  }
  const matrix b(1, k, 1.0f);
  const reference_result result = run(a, b);
  expect_exact_matches_oracle(a, b, result, "low-part errors");
  EXPECT_EQ(result.fp64(0, 0), 1.5 + 0x1p-52) << "typed: 1.5 + 2^-53 + 0.1875 * 2^-105 rounds up";
  EXPECT_EQ(result.fp64(1, 0), -(1.5 + 0x1p-52));
}

TEST_P(ExactReference, NonFiniteInputsFollowIeee) {
  const std::int64_t k = 5;
  matrix a = random_normal(3, k, 9);
  const matrix b = random_normal(2, k, 10);
  a(0, 2) = std::numeric_limits<float>::infinity();
  a(1, 1) = std::numeric_limits<float>::quiet_NaN();
  const reference_result result = run(a, b);
  EXPECT_EQ(result.stats.nonfinite_entries, 4);
  for (std::int64_t j = 0; j < 2; ++j) {
    const double expected_sign = b(j, 2) > 0 ? 1.0 : -1.0;
    EXPECT_EQ(result.fp64(0, j), expected_sign * std::numeric_limits<double>::infinity());
    EXPECT_TRUE(std::isinf(result.fp32(0, j)));
    EXPECT_TRUE(std::isnan(result.fp64(1, j)));
    EXPECT_TRUE(std::isnan(result.fp32(1, j)));
    const oracle_entry expected = oracle(a, b, 2, j);
    EXPECT_EQ(bits_of(result.fp64(2, j)), bits_of(expected.value64)) << "finite row next to non-finite ones";
  }
}

TEST(References, ShapeMismatchIsAnInputError) {
  EXPECT_THROW(mxscope::reference_gemm(matrix(2, 3), matrix(2, 4), reference_kind::exact), mxscope::input_error);
  EXPECT_THROW(mxscope::reference_gemm(matrix(2, 3), matrix(2, 4), reference_kind::fp64), mxscope::input_error);
}

TEST_P(ExactReference, ErrorBoundIsTheLargestHalfUlp) {
  const matrix a = random_normal(4, 64, 55);
  const matrix b = random_normal(3, 64, 56);
  const reference_result result = run(a, b);
  double largest = 0.0;
  for (const double v : result.fp64.values) {
    if (v != 0.0) largest = std::max(largest, std::ldexp(1.0, std::ilogb(v) - 53));
  }
  EXPECT_EQ(result.error_bound, largest);
}

// ------------------------------------------------------------------------------------------
// fp64

TEST(Fp64Reference, WithinItsStatedBound) {
  for (const std::int64_t k : {1, 33, 1000}) {
    matrix a = random_normal(5, k, 300 + static_cast<std::uint64_t>(k));
    matrix b = random_normal(4, k, 400 + static_cast<std::uint64_t>(k));
    if (k == 1000) {
      scale_binades(a, 3);
      scale_binades(b, 4);
    }
    const reference_result result = mxscope::reference_gemm(a, b, reference_kind::fp64);
    ASSERT_EQ(result.entry_error_bound.size(), a.rows * b.rows);
    const double u = 0x1p-53;
    const double gamma = static_cast<double>(k) * u / (1.0 - static_cast<double>(k) * u);
    double largest = 0.0;
    for (std::int64_t i = 0; i < a.rows; ++i) {
      for (std::int64_t j = 0; j < b.rows; ++j) {
        const cpp_int exact = exact_dot(a.data() + i * k, b.data() + j * k, k);
        // P = sum |a b| exactly, via the same oracle on absolute values.
        std::vector<float> abs_a(static_cast<std::size_t>(k));
        std::vector<float> abs_b(static_cast<std::size_t>(k));
        for (std::int64_t c = 0; c < k; ++c) {
          abs_a[static_cast<std::size_t>(c)] = std::fabs(a(i, c));
          abs_b[static_cast<std::size_t>(c)] = std::fabs(b(j, c));
        }
        const cpp_int magnitude_sum = exact_dot(abs_a.data(), abs_b.data(), k);
        const double bound = result.entry_error_bound(i, j);
        const cpp_int error = boost::multiprecision::abs(fixed_of(result.fp64(i, j)) - exact);
        EXPECT_LE(error, fixed_of(bound)) << describe(a, b, i, j) << " fp64 " << hex(result.fp64(i, j)) << " bound "
                                          << hex(bound);
        // The stated bound is gamma_K * P, rounded upward, and not looser than 2^-30 relative.
        const double stated = gamma * nearest<double>(magnitude_sum);
        EXPECT_GE(bound, stated * (1.0 - 0x1p-50)) << describe(a, b, i, j);
        EXPECT_LE(bound, stated * (1.0 + 0x1p-30)) << describe(a, b, i, j);
        EXPECT_EQ(bits_of(result.fp32(i, j)), bits_of(static_cast<float>(result.fp64(i, j))));
        largest = std::max(largest, bound);
      }
    }
    EXPECT_EQ(result.error_bound, largest);
  }
}

// ------------------------------------------------------------------------------------------
// Determinism and certification.

#ifdef _OPENMP
TEST(References, IdenticalForOneAndTwoThreads) {
  matrix a = random_normal(70, 300, 901);
  matrix b = random_normal(9, 300, 902);
  scale_binades(a, 5);
  const int saved = omp_get_max_threads();
  for (const reference_kind kind : {reference_kind::exact, reference_kind::fp64}) {
    omp_set_num_threads(1);
    const reference_result one = mxscope::reference_gemm(a, b, kind);
    omp_set_num_threads(2);
    const reference_result two = mxscope::reference_gemm(a, b, kind);
    ASSERT_EQ(one.fp64.size(), two.fp64.size());
    for (std::int64_t e = 0; e < one.fp64.size(); ++e) {
      ASSERT_EQ(bits_of(one.fp64.values[static_cast<std::size_t>(e)]), bits_of(two.fp64.values[static_cast<std::size_t>(e)]))
          << mxscope::reference_kind_name(kind) << " entry " << e;
      ASSERT_EQ(bits_of(one.fp32.values[static_cast<std::size_t>(e)]), bits_of(two.fp32.values[static_cast<std::size_t>(e)]))
          << mxscope::reference_kind_name(kind) << " entry " << e;
    }
    EXPECT_EQ(one.stats.fallback_indices, two.stats.fallback_indices);
    EXPECT_EQ(one.error_bound, two.error_bound);
  }
  omp_set_num_threads(saved);
}
#endif

TEST(Certify, ExactReferenceIsZeroUlps) {
  matrix a = random_normal(20, 257, 1201);
  matrix b = random_normal(15, 257, 1202);
  scale_binades(b, 6);
  const reference_result result = mxscope::reference_gemm(a, b, reference_kind::exact);
  const mxscope::certification sampled = mxscope::certify(a, b, result, 50, 7);
  EXPECT_EQ(sampled.entries_checked, 50);
  EXPECT_EQ(sampled.max_ulp_fp64, 0U);
  EXPECT_EQ(sampled.max_ulp_fp32, 0U);
  EXPECT_TRUE(sampled.passed);
  const mxscope::certification all = mxscope::certify(a, b, result, 1 << 30, 7);
  EXPECT_EQ(all.entries_checked, a.rows * b.rows);
  EXPECT_TRUE(all.passed);
  EXPECT_EQ(all.max_ulp_fp64, 0U);
  // max_abs_error is at most the reported bound (half an ulp of the largest entry).
  EXPECT_LE(all.max_abs_error, result.error_bound);
}

TEST(Certify, DetectsACorruptedEntry) {
  const matrix a = random_normal(6, 50, 1301);
  const matrix b = random_normal(5, 50, 1302);
  reference_result result = mxscope::reference_gemm(a, b, reference_kind::exact);
  const std::int64_t victim = 17;  // row 3, column 2
  double& v64 = result.fp64.values[victim];
  v64 = std::nextafter(v64, std::numeric_limits<double>::infinity());
  float& v32 = result.fp32.values[victim];
  v32 = std::nextafter(std::nextafter(v32, -1e30f), -1e30f);
  const mxscope::certification report = mxscope::certify(a, b, result, 1 << 20, 1);
  EXPECT_FALSE(report.passed);
  EXPECT_EQ(report.max_ulp_fp64, 1U);
  EXPECT_EQ(report.max_ulp_fp32, 2U);
  EXPECT_EQ(report.worst_row, 3);
  EXPECT_EQ(report.worst_col, 2);
  EXPECT_GT(report.max_abs_error, 0.0);
}

TEST(Certify, Fp64ReferenceWithinBoundAndViolationDetected) {
  const matrix a = random_normal(8, 1000, 1401);
  const matrix b = random_normal(6, 1000, 1402);
  reference_result result = mxscope::reference_gemm(a, b, reference_kind::fp64);
  const mxscope::certification report = mxscope::certify(a, b, result, 1 << 20, 3);
  EXPECT_TRUE(report.passed);
  EXPECT_EQ(report.bound_violations, 0);
  EXPECT_LE(report.max_bound_ratio, 1.0);
  result.fp64.values[5] += 4.0 * result.entry_error_bound.values[5] + 1e-9;
  const mxscope::certification broken = mxscope::certify(a, b, result, 1 << 20, 3);
  EXPECT_FALSE(broken.passed);
  EXPECT_EQ(broken.bound_violations, 1);
  EXPECT_GT(broken.max_bound_ratio, 1.0);
}

}  // namespace
