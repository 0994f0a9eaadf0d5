// Block Walsh-Hadamard rotations (NUMERICS.md section 5): orthogonality of Q = H_b diag(s) / sqrt(b),
// the correctly rounded fp32 scale 1/sqrt(b), the fp32 FWHT against a dense Sylvester-Hadamard
// product in higher precision (with the rounding-error bound of a depth-log2(b) summation tree, and
// exactly for small integers), rotations of matrices along either axis with the three sign
// policies (signs from the test's own Philox), and the errors for invalid sizes.
//
// Error bounds: with u = 2^-24 and k = log2 b, every FWHT output is a sum of b inputs formed by a
// binary tree of depth k, so |fl(FWHT x)_i - (H x)_i| <= gamma_k * sum_j |x_j| with
// gamma_k = k u / (1 - k u) (Higham, Accuracy and Stability of Numerical Algorithms, 4.2).
#include <gtest/gtest.h>

#include <boost/multiprecision/cpp_bin_float.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "mxscope/core/hadamard.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/quantize.hpp"
#include "reference_formats.hpp"
#include "reference_random.hpp"

namespace {

namespace core = mxscope::core;
using reference::show;
using long_float = long double;

constexpr double unit_roundoff = 0x1p-24;

double gamma(int n) { return n * unit_roundoff / (1.0 - n * unit_roundoff); }

std::vector<int> rotation_sizes() {
  std::vector<int> sizes;
  for (int size = 2; size <= 4096; size *= 2) sizes.push_back(size);
  return sizes;
}

int log2_of(int size) { return std::countr_zero(static_cast<unsigned>(size)); }

// Entry (i, j) of the Sylvester-Hadamard matrix in natural order: (-1)^popcount(i & j).
int sylvester(int i, int j) { return (std::popcount(static_cast<unsigned>(i & j)) % 2 == 0) ? 1 : -1; }

std::vector<float> random_signs(int size, std::mt19937& generator) {
  std::vector<float> signs(static_cast<std::size_t>(size));
  for (auto& s : signs) s = (generator() & 1U) ? -1.0f : 1.0f;
  return signs;
}

// ---------------------------------------------------------------------------------------------

TEST(HadamardScale, IsTheCorrectlyRoundedReciprocalSquareRoot) {
  using big = boost::multiprecision::cpp_bin_float_100;
  EXPECT_EQ(core::hadamard_scale(16), 0.25f);
  for (const int size : rotation_sizes()) {
    const big exact = big(1) / boost::multiprecision::sqrt(big(size));
    // The nearest fp32 to the exact value among the three around a first guess; 1/sqrt(2^k) is a
    // power of two or irrational, so there is no tie to break.
    const float guess = static_cast<float>(1.0L / std::sqrt(static_cast<long double>(size)));
    float nearest = guess;
    for (const float candidate : {std::nextafter(guess, 0.0f), std::nextafter(guess, 1.0f)}) {
      if (boost::multiprecision::abs(big(candidate) - exact) < boost::multiprecision::abs(big(nearest) - exact)) {
        nearest = candidate;
      }
    }
    EXPECT_EQ(reference::bits_of(core::hadamard_scale(size)), reference::bits_of(nearest))
        << "b = " << size << ": expected " << show(nearest) << ", got " << show(core::hadamard_scale(size));
    if (log2_of(size) % 2 == 0) {
      EXPECT_EQ(core::hadamard_scale(size), std::ldexp(1.0f, -log2_of(size) / 2));
    }
  }
}

TEST(RotationSize, ValidSizesArePowersOfTwoFrom2To4096) {
  for (const int size : rotation_sizes()) EXPECT_TRUE(core::is_valid_rotation_size(size)) << size;
  for (const long long size : {-4LL, 0LL, 1LL, 3LL, 6LL, 12LL, 4095LL, 8192LL, 1LL << 40}) {
    EXPECT_FALSE(core::is_valid_rotation_size(size)) << size;
  }
}

// Q^T Q = I: for b <= 256 the whole Gram matrix of the columns Q e_i (in double, where the
// products are exact); for every b, Q^T (Q e_i) = e_i for every i. Columns of Q are +-fl32(1/sqrt b),
// so the off-diagonal sums cancel exactly and the diagonal is b * fl32(1/sqrt b)^2 = 1 within 2u.
TEST(Orthogonality, QTransposeQIsTheIdentity) {
  std::mt19937 generator(1);
  for (const int size : rotation_sizes()) {
    for (const bool with_signs : {false, true}) {
      const auto signs = random_signs(size, generator);
      const float* sign_data = with_signs ? signs.data() : nullptr;
      const std::string policy = fmt::format("b = {}, signs {}", size, with_signs ? "random" : "none");
      std::vector<std::vector<float>> columns;
      int failures = 0;
      for (int i = 0; i < size; ++i) {
        std::vector<float> column(static_cast<std::size_t>(size), 0.0f);
        column[static_cast<std::size_t>(i)] = 1.0f;
        core::rotate_segment(column.data(), size, sign_data);
        std::vector<float> back = column;
        core::unrotate_segment(back.data(), size, sign_data);
        for (int j = 0; j < size; ++j) {
          const float value = back[static_cast<std::size_t>(j)];
          const bool ok = i == j ? std::fabs(value - 1.0f) <= 2 * unit_roundoff : value == 0.0f;
          if (!ok && ++failures <= 5) {
            ADD_FAILURE() << policy << ": (Q^T Q e_" << i << ")_" << j << " = " << show(value);
          }
        }
        if (size <= 256) columns.push_back(std::move(column));
      }
      for (std::size_t i = 0; i < columns.size(); ++i) {
        for (std::size_t j = 0; j < columns.size(); ++j) {
          double dot = 0.0;
          for (int k = 0; k < size; ++k) {
            dot += static_cast<double>(columns[i][static_cast<std::size_t>(k)]) *
                   static_cast<double>(columns[j][static_cast<std::size_t>(k)]);
          }
          const bool ok = i == j ? std::fabs(dot - 1.0) <= 2 * unit_roundoff : dot == 0.0;
          if (!ok && ++failures <= 5) ADD_FAILURE() << policy << ": Gram (" << i << ", " << j << ") = " << dot;
        }
      }
      EXPECT_EQ(failures, 0) << policy;
    }
  }
}

// The fp32 FWHT against the dense product H x in long double.
TEST(Fwht, MatchesTheDenseSylvesterProductWithinTheSummationBound) {
  std::mt19937 generator(2);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const int size : rotation_sizes()) {
    const int vectors = size <= 512 ? 4 : 1;
    for (int trial = 0; trial < vectors; ++trial) {
      std::vector<float> x(static_cast<std::size_t>(size));
      for (auto& v : x) v = std::ldexp(normal(generator), static_cast<int>(generator() % 21) - 10);
      std::vector<float> transformed = x;
      core::fwht(transformed.data(), size);
      long_float absolute_sum = 0;
      for (const float v : x) absolute_sum += std::fabs(static_cast<long_float>(v));
      // The long double reference itself is off by at most b * 2^-64 * sum |x|.
      const long_float bound = static_cast<long_float>(gamma(log2_of(size))) * absolute_sum +
                               static_cast<long_float>(size) * 0x1p-63L * absolute_sum;
      int failures = 0;
      for (int i = 0; i < size; ++i) {
        long_float exact = 0;
        for (int j = 0; j < size; ++j) exact += sylvester(i, j) * static_cast<long_float>(x[static_cast<std::size_t>(j)]);
        const long_float error = std::fabs(static_cast<long_float>(transformed[static_cast<std::size_t>(i)]) - exact);
        if (error > bound && ++failures <= 5) {
          ADD_FAILURE() << "b = " << size << " output " << i << ": fwht " << show(transformed[static_cast<std::size_t>(i)])
                        << " vs exact " << static_cast<double>(exact) << ", error " << static_cast<double>(error)
                        << " > bound " << static_cast<double>(bound);
        }
      }
      EXPECT_EQ(failures, 0) << "b = " << size;
    }
  }
}

TEST(Fwht, SmallIntegersTransformExactly) {
  std::mt19937 generator(3);
  std::uniform_int_distribution<int> small(-8, 8);
  for (const int size : rotation_sizes()) {
    std::vector<float> x(static_cast<std::size_t>(size));
    std::vector<std::int64_t> integers(static_cast<std::size_t>(size));
    for (int j = 0; j < size; ++j) {
      integers[static_cast<std::size_t>(j)] = small(generator);
      x[static_cast<std::size_t>(j)] = static_cast<float>(integers[static_cast<std::size_t>(j)]);
    }
    core::fwht(x.data(), size);
    for (int i = 0; i < size; ++i) {
      std::int64_t exact = 0;  // |exact| <= 8 * 4096 = 2^15: every partial sum is exact in fp32
      for (int j = 0; j < size; ++j) exact += sylvester(i, j) * integers[static_cast<std::size_t>(j)];
      ASSERT_EQ(x[static_cast<std::size_t>(i)], static_cast<float>(exact)) << "b = " << size << " output " << i;
    }
  }
}

// NUMERICS.md section 5 fixes the operation order so that every backend produces the same bits:
// signs first (exact), then for h = 1, 2, 4, ..., b/2 and each pair (j, j + h) with j mod 2h < h:
// (a, c) -> (fl32(a + c), fl32(a - c)), then each element times fl32(1/sqrt b). Written here
// literally, in fp32, and compared bit for bit on inputs whose sums round (random fp32 values).
std::vector<float> canonical_rotation(std::vector<float> values, const float* signs, float scale) {
  const int size = static_cast<int>(values.size());
  if (signs != nullptr) {
    for (int i = 0; i < size; ++i) values[static_cast<std::size_t>(i)] = values[static_cast<std::size_t>(i)] * signs[i];
  }
  for (int h = 1; h < size; h *= 2) {
    for (int j = 0; j < size; ++j) {
      if (j % (2 * h) >= h) continue;
      const float a = values[static_cast<std::size_t>(j)];
      const float c = values[static_cast<std::size_t>(j + h)];
      const float sum = a + c;
      const float difference = a - c;
      values[static_cast<std::size_t>(j)] = sum;
      values[static_cast<std::size_t>(j + h)] = difference;
    }
  }
  for (auto& v : values) v = v * scale;
  return values;
}

TEST(Fwht, CanonicalOperationOrderBitForBit) {
  std::mt19937 generator(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const int size : rotation_sizes()) {
    const auto signs = random_signs(size, generator);
    std::vector<float> x(static_cast<std::size_t>(size));
    for (auto& v : x) v = std::ldexp(normal(generator), static_cast<int>(generator() % 41) - 20);
    // The reference uses the scale it checked above to be the correctly rounded 1/sqrt(b).
    const float scale = core::hadamard_scale(size);
    std::vector<float> transformed = x;
    core::fwht(transformed.data(), size);
    const auto expected_transform = canonical_rotation(x, nullptr, 1.0f);
    std::vector<float> rotated = x;
    core::rotate_segment(rotated.data(), size, signs.data());
    const auto expected_rotation = canonical_rotation(x, signs.data(), scale);
    for (int i = 0; i < size; ++i) {
      const auto at = static_cast<std::size_t>(i);
      ASSERT_EQ(reference::bits_of(transformed[at]), reference::bits_of(expected_transform[at]))
          << "fwht b = " << size << " output " << i << ": expected " << show(expected_transform[at]) << ", got "
          << show(transformed[at]);
      ASSERT_EQ(reference::bits_of(rotated[at]), reference::bits_of(expected_rotation[at]))
          << "rotate_segment b = " << size << " output " << i << ": expected " << show(expected_rotation[at])
          << ", got " << show(rotated[at]);
    }
  }
}

// Bound on |rotate(x)_i - (Q x)_i| for the fp32 rotation with signs s:
//   u |r_i| + s_f gamma_k sum |x| + |s_f - 1/sqrt b| |(H s x)_i| with |s_f - 1/sqrt b| <= u / sqrt b.
struct rotation_reference {
  std::vector<long_float> exact;   // Q x
  std::vector<long_float> bounds;  // per element
};

rotation_reference rotation_with_bound(const std::vector<float>& x, const std::vector<float>& result, int size,
                                       const float* signs) {
  const long_float inverse_root = 1.0L / std::sqrt(static_cast<long_float>(size));
  const long_float scale = core::hadamard_scale(size);
  long_float absolute_sum = 0;
  for (const float v : x) absolute_sum += std::fabs(static_cast<long_float>(v));
  rotation_reference out;
  for (int i = 0; i < size; ++i) {
    long_float transformed = 0;
    for (int j = 0; j < size; ++j) {
      const long_float sign = signs == nullptr ? 1.0L : signs[j];
      transformed += sylvester(i, j) * sign * static_cast<long_float>(x[static_cast<std::size_t>(j)]);
    }
    out.exact.push_back(transformed * inverse_root);
    out.bounds.push_back(unit_roundoff * std::fabs(static_cast<long_float>(result[static_cast<std::size_t>(i)])) +
                         scale * static_cast<long_float>(gamma(log2_of(size))) * absolute_sum +
                         unit_roundoff * inverse_root * std::fabs(transformed) +
                         static_cast<long_float>(size) * 0x1p-62L * absolute_sum);
  }
  return out;
}

TEST(Rotation, ForwardAndInverseSegmentsWithinTheirBounds) {
  std::mt19937 generator(4);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const int size : rotation_sizes()) {
    for (const bool with_signs : {false, true}) {
      const auto signs = random_signs(size, generator);
      const float* sign_data = with_signs ? signs.data() : nullptr;
      std::vector<float> x(static_cast<std::size_t>(size));
      for (auto& v : x) v = normal(generator);
      std::vector<float> rotated = x;
      core::rotate_segment(rotated.data(), size, sign_data);
      const auto forward = rotation_with_bound(x, rotated, size, sign_data);
      long_float forward_error_sum = 0;  // sum of the forward bounds: Q^T spreads them by 1/sqrt(b) each
      for (int i = 0; i < size; ++i) {
        const long_float error = std::fabs(rotated[static_cast<std::size_t>(i)] - forward.exact[static_cast<std::size_t>(i)]);
        ASSERT_LE(error, forward.bounds[static_cast<std::size_t>(i)])
            << "b = " << size << " signs " << with_signs << " output " << i << " rotated " << show(rotated[static_cast<std::size_t>(i)]);
        forward_error_sum += forward.bounds[static_cast<std::size_t>(i)];
      }
      // Inverse: unrotate(z) = Q^T z + e2 and Q^T z - x = Q^T (z - Q x), so
      // |back_i - x_i| <= sum_j bound_j / sqrt(b) + (bound of the inverse rotation applied to z).
      std::vector<float> back = rotated;
      core::unrotate_segment(back.data(), size, sign_data);
      // Q^T = diag(s) H / sqrt(b): the same bound as a forward rotation of z without signs, since
      // multiplying by +-1 is exact.
      const auto inverse = rotation_with_bound(rotated, back, size, nullptr);
      const long_float spread = forward_error_sum / std::sqrt(static_cast<long_float>(size));
      for (int i = 0; i < size; ++i) {
        const long_float error = std::fabs(back[static_cast<std::size_t>(i)] - static_cast<long_float>(x[static_cast<std::size_t>(i)]));
        ASSERT_LE(error, spread + inverse.bounds[static_cast<std::size_t>(i)])
            << "b = " << size << " signs " << with_signs << " element " << i << ": x " << show(x[static_cast<std::size_t>(i)])
            << " round trip " << show(back[static_cast<std::size_t>(i)]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// mxscope::rotate on matrices.

// Expected sign of position k along the axis: bit 0 of the Philox word of element k of the stream
// with role `signs` (tag = layer hash ^ 7), step 0 for `fixed`, the true step for `per-step`.
std::vector<float> reference_signs(std::int64_t length, const mxscope::rotation_options& options) {
  std::vector<float> signs(static_cast<std::size_t>(length), 1.0f);
  if (options.signs == mxscope::sign_policy::none) return signs;
  const std::uint32_t step = options.signs == mxscope::sign_policy::fixed ? 0U : options.step;
  const std::uint32_t tag = options.layer_hash ^ reference::role_signs;
  for (std::int64_t k = 0; k < length; ++k) {
    signs[static_cast<std::size_t>(k)] =
        (reference::stream_word(options.seed, step, tag, static_cast<std::uint64_t>(k)) & 1U) ? -1.0f : 1.0f;
  }
  return signs;
}

mxscope::rotation_options rotation(int size, mxscope::sign_policy policy, std::uint32_t step) {
  mxscope::rotation_options options;
  options.size = size;
  options.signs = policy;
  options.seed = 0x0DDBA11CAFEF00DULL;
  options.step = step;
  options.layer_hash = reference::fnv1a32("model.layers.5.mlp.down_proj");
  return options;
}

const char* policy_label(mxscope::sign_policy policy) {
  switch (policy) {
    case mxscope::sign_policy::none: return "none";
    case mxscope::sign_policy::fixed: return "fixed";
    case mxscope::sign_policy::per_step: return "per-step";
  }
  return "?";
}

TEST(RotationSigns, MatchTheReferenceStreamAndThePolicies) {
  const std::int64_t length = 1000;
  for (const auto policy : {mxscope::sign_policy::none, mxscope::sign_policy::fixed, mxscope::sign_policy::per_step}) {
    for (const std::uint32_t step : {0U, 3U, 7U}) {
      const auto options = rotation(16, policy, step);
      EXPECT_EQ(mxscope::rotation_signs(length, options), reference_signs(length, options))
          << policy_label(policy) << " step " << step;
      EXPECT_EQ(mxscope::rotation_signs(length, options), mxscope::rotation_signs(length, options)) << "reproducible";
    }
  }
  const auto none = mxscope::rotation_signs(length, rotation(16, mxscope::sign_policy::none, 3));
  for (const float s : none) EXPECT_EQ(s, 1.0f);
  const auto fixed_3 = mxscope::rotation_signs(length, rotation(16, mxscope::sign_policy::fixed, 3));
  const auto fixed_7 = mxscope::rotation_signs(length, rotation(16, mxscope::sign_policy::fixed, 7));
  EXPECT_EQ(fixed_3, fixed_7) << "fixed: the same signs every step";
  const auto per_step_3 = mxscope::rotation_signs(length, rotation(16, mxscope::sign_policy::per_step, 3));
  const auto per_step_7 = mxscope::rotation_signs(length, rotation(16, mxscope::sign_policy::per_step, 7));
  int differences = 0, negatives = 0;
  for (std::int64_t k = 0; k < length; ++k) {
    differences += per_step_3[static_cast<std::size_t>(k)] != per_step_7[static_cast<std::size_t>(k)];
    negatives += per_step_3[static_cast<std::size_t>(k)] < 0.0f;
  }
  // Independent fair signs: about half differ / are negative (binomial, 6 sigma ~ 95 of 1000).
  EXPECT_GT(differences, 400) << "per-step: new signs each step";
  EXPECT_LT(differences, 600);
  EXPECT_GT(negatives, 400);
  EXPECT_LT(negatives, 600);
}

// Small integers and sizes with even log2 (scale exactly 2^-k/2): the rotated matrix equals the
// exact product, computed in integers, for every segment along the axis.
TEST(RotateMatrix, ExactForSmallIntegersAlongBothAxes) {
  std::mt19937 generator(6);
  std::uniform_int_distribution<int> small(-8, 8);
  for (const int axis : {0, 1}) {
    for (const int size : {4, 16, 64}) {
      for (const auto policy : {mxscope::sign_policy::none, mxscope::sign_policy::fixed, mxscope::sign_policy::per_step}) {
        const std::int64_t rows = axis == 0 ? 3 * size : 5;
        const std::int64_t cols = axis == 1 ? 3 * size : 7;
        mxscope::matrix values(rows, cols);
        for (auto& v : values.values) v = static_cast<float>(small(generator));
        const mxscope::matrix original = values;
        const auto options = rotation(size, policy, 11);
        mxscope::rotate(values, axis, options, "test");
        const std::int64_t length = axis == 1 ? cols : rows;
        const auto signs = reference_signs(length, options);
        const float scale = std::ldexp(1.0f, -log2_of(size) / 2);
        const std::string label = fmt::format("axis {} b {} signs {}", axis, size, policy_label(policy));
        for (std::int64_t line = 0; line < (axis == 1 ? rows : cols); ++line) {
          for (std::int64_t begin = 0; begin < length; begin += size) {
            for (int i = 0; i < size; ++i) {
              std::int64_t exact = 0;
              for (int j = 0; j < size; ++j) {
                const std::int64_t position = begin + j;
                const float input = axis == 1 ? original(line, position) : original(position, line);
                exact += sylvester(i, j) * static_cast<std::int64_t>(signs[static_cast<std::size_t>(position)] * input);
              }
              const float actual = axis == 1 ? values(line, begin + i) : values(begin + i, line);
              ASSERT_EQ(actual, static_cast<float>(exact) * scale) << label << " line " << line << " position " << begin + i;
            }
          }
        }
        // The inverse restores the integers exactly: H H = b I and scale^2 = 1/b are exact here.
        mxscope::rotate(values, axis, options, "test", /*inverse=*/true);
        for (std::size_t i = 0; i < values.values.size(); ++i) {
          ASSERT_EQ(values.values[i], original.values[i]) << label << " inverse, flat index " << i;
        }
      }
    }
  }
}

// Along axis 0 the rotation gathers several columns at a time; each column must still get exactly
// the bits that the same segment gets along axis 1 (random floats, so any change in the operation
// order shows; 37 columns leave a partial group).
TEST(RotateMatrix, AxisZeroIsAxisOneOfTheTransposeBitForBit) {
  std::mt19937 generator(8);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const int size : {2, 16, 128}) {
    for (const auto policy : {mxscope::sign_policy::none, mxscope::sign_policy::per_step}) {
      mxscope::matrix values(2 * size, 37);
      for (auto& v : values.values) v = normal(generator);
      mxscope::matrix transposed = mxscope::transposed(values);
      const auto options = rotation(size, policy, 12);
      for (const bool inverse : {false, true}) {
        mxscope::rotate(values, 0, options, "test", inverse);
        mxscope::rotate(transposed, 1, options, "test", inverse);
        const mxscope::matrix back = mxscope::transposed(transposed);
        for (std::size_t i = 0; i < values.values.size(); ++i) {
          ASSERT_EQ(std::bit_cast<std::uint32_t>(values.values[i]), std::bit_cast<std::uint32_t>(back.values[i]))
              << "b " << size << " signs " << policy_label(policy) << (inverse ? " inverse" : "") << " flat index " << i;
        }
      }
    }
  }
}

// Odd log2 sizes (the scale is a rounded fl32(1/sqrt b)): within the forward bound.
TEST(RotateMatrix, OddLog2SizesWithinBoundAlongBothAxes) {
  std::mt19937 generator(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const int axis : {0, 1}) {
    for (const int size : {2, 32, 128}) {
      const std::int64_t rows = axis == 0 ? 2 * size : 3;
      const std::int64_t cols = axis == 1 ? 2 * size : 3;
      mxscope::matrix values(rows, cols);
      for (auto& v : values.values) v = normal(generator);
      const mxscope::matrix original = values;
      const auto options = rotation(size, mxscope::sign_policy::per_step, 2);
      mxscope::rotate(values, axis, options, "test");
      const std::int64_t length = axis == 1 ? cols : rows;
      const auto signs = reference_signs(length, options);
      for (std::int64_t line = 0; line < (axis == 1 ? rows : cols); ++line) {
        for (std::int64_t begin = 0; begin < length; begin += size) {
          std::vector<float> segment_in, segment_out;
          for (int i = 0; i < size; ++i) {
            segment_in.push_back(axis == 1 ? original(line, begin + i) : original(begin + i, line));
            segment_out.push_back(axis == 1 ? values(line, begin + i) : values(begin + i, line));
          }
          const auto reference = rotation_with_bound(segment_in, segment_out, size, signs.data() + begin);
          for (int i = 0; i < size; ++i) {
            ASSERT_LE(std::fabs(segment_out[static_cast<std::size_t>(i)] - reference.exact[static_cast<std::size_t>(i)]),
                      reference.bounds[static_cast<std::size_t>(i)])
                << "axis " << axis << " b " << size << " line " << line << " position " << begin + i;
          }
        }
      }
    }
  }
}

TEST(RotateMatrix, FixedSignsRepeatAcrossStepsPerStepSignsDoNot) {
  std::mt19937 generator(8);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  mxscope::matrix input(8, 64);
  for (auto& v : input.values) v = normal(generator);
  auto rotated = [&](mxscope::sign_policy policy, std::uint32_t step) {
    mxscope::matrix copy = input;
    mxscope::rotate(copy, 1, rotation(16, policy, step), "test");
    return copy.values;
  };
  EXPECT_EQ(rotated(mxscope::sign_policy::fixed, 3), rotated(mxscope::sign_policy::fixed, 7));
  EXPECT_EQ(rotated(mxscope::sign_policy::per_step, 3), rotated(mxscope::sign_policy::per_step, 3));
  EXPECT_NE(rotated(mxscope::sign_policy::per_step, 3), rotated(mxscope::sign_policy::per_step, 7));
  EXPECT_EQ(rotated(mxscope::sign_policy::none, 3), rotated(mxscope::sign_policy::none, 7));
  EXPECT_NE(rotated(mxscope::sign_policy::none, 3), rotated(mxscope::sign_policy::fixed, 3));
}

TEST(RotateMatrix, InvalidSizesThrowAnInputErrorNamingTheRotation) {
  mxscope::matrix values(40, 64, 1.0f);
  auto expect_rejected = [&](int size, int axis) {
    mxscope::rotation_options options;
    options.size = size;
    try {
      mxscope::rotate(values, axis, options, "operand x");
      ADD_FAILURE() << "size " << size << " along axis " << axis << " was accepted";
    } catch (const mxscope::input_error& error) {
      EXPECT_NE(std::string(error.what()).find("rotation"), std::string::npos)
          << "size " << size << ": message '" << error.what() << "' does not name the rotation";
      EXPECT_NE(std::string(error.what()).find("operand x"), std::string::npos) << error.what();
    }
  };
  for (const int size : {3, 1, 6, 8192, -4}) expect_rejected(size, 1);
  expect_rejected(16, 0);   // 16 does not divide 40 rows
  expect_rejected(128, 1);  // 128 does not divide 64 columns
  // Size 0 means "no rotation": accepted, values unchanged.
  mxscope::rotation_options none;
  none.size = 0;
  EXPECT_NO_THROW(mxscope::rotate(values, 1, none, "operand x"));
  for (const float v : values.values) EXPECT_EQ(v, 1.0f);
  // Valid: 8 divides 40 along axis 0, 64 divides 64 along axis 1.
  mxscope::rotation_options valid;
  valid.size = 8;
  EXPECT_NO_THROW(mxscope::rotate(values, 0, valid, "operand x"));
  valid.size = 64;
  EXPECT_NO_THROW(mxscope::rotate(values, 1, valid, "operand x"));
}

}  // namespace
