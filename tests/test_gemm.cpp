// Emulated GEMMs (src/gemm.cpp) against oracles written here: element codes are decoded with the
// tables of the OCP spec typed below, block dots are integer arithmetic on those codes, exact sums
// use the Boost.Multiprecision fixed point of exact_oracle.hpp, fp32 rounding steps are either
// plain fp32 additions of exactly representable values or the oracle's rounding. The library is
// used only to produce the quantized codes (mxscope::quantize, tested elsewhere) and the rotation
// signs, never to compute an expected value.
#include <gtest/gtest.h>
#include <omp.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "exact_oracle.hpp"
#include "mxscope/core/formats.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/gemm.hpp"
#include "mxscope/quantize.hpp"
#include "mxscope/reference.hpp"

namespace {

mxscope::gemm_options gemm_options_of(mxscope::accumulation_path path, bool vector_kernels = true) {
  mxscope::gemm_options options;
  options.path = path;
  options.vector_kernels = vector_kernels;
  return options;
}

// Runs the CPU's wide kernel (e4m3 products) on AVX2 while in scope (MXSCOPE_WIDE_KERNEL), so that
// a test covers both kernels on a machine with AVX-512.
struct wide_kernel_on {
  explicit wide_kernel_on(const char* isa) {
    if (isa != nullptr) setenv("MXSCOPE_WIDE_KERNEL", isa, 1);
  }
  ~wide_kernel_on() { unsetenv("MXSCOPE_WIDE_KERNEL"); }
};
constexpr const char* wide_kernels[] = {nullptr, "avx2"};  // the widest the CPU has, then AVX2

using mxscope::gemm_kind;
using mxscope::matrix;
using mxscope::quantized_tensor;
using oracle::cpp_int;

// ------------------------------------------------------------------------------------------------
// Test data.

// Gaussian entries; each (row, 16-column band) gets its own power-of-two magnitude drawn from
// [low_exponent, high_exponent], so block scales vary along both axes.
matrix random_matrix(std::int64_t rows, std::int64_t cols, std::uint64_t seed, int low_exponent = -3,
                     int high_exponent = 3) {
  std::mt19937_64 random(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_int_distribution<int> exponent(low_exponent, high_exponent);
  std::vector<int> band_exponents(static_cast<std::size_t>(rows * ((cols + 15) / 16)));
  for (int& e : band_exponents) e = exponent(random);
  matrix out(rows, cols);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      const int e = band_exponents[static_cast<std::size_t>(r * ((cols + 15) / 16) + c / 16)];
      out(r, c) = static_cast<float>(std::ldexp(normal(random), e));
    }
  }
  return out;
}

// Operand data with extreme block exponents (down to the fp32 subnormals and up to 2^120), zero
// blocks and zero rows.
matrix extreme_matrix(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  matrix out = random_matrix(rows, cols, seed, -140, 115);
  std::mt19937_64 random(seed + 1000);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      if ((r * 7 + c / 8) % 11 == 3) out(r, c) = 0.0f;  // zero stretches
    }
  }
  if (rows > 2) {
    for (std::int64_t c = 0; c < cols; ++c) out(1, c) = 0.0f;
  }
  return out;
}

mxscope::operand_strategy operand(std::string_view format, int block = 0,
                                  mxscope::core::rounding_mode rounding = mxscope::core::rounding_mode::rne) {
  mxscope::operand_strategy out;
  out.quantize.format = *mxscope::parse_format(format);
  out.quantize.block = block;
  out.quantize.rounding = rounding;
  return out;
}

mxscope::strategy make_strategy(std::string_view format_a, std::string_view format_b, std::string_view model,
                                int rotation = 0, mxscope::sign_policy signs = mxscope::sign_policy::none) {
  mxscope::strategy out;
  out.name = "test";
  out.a = operand(format_a);
  out.b = operand(format_b);
  out.seed = 12345;
  out.accumulation = mxscope::parse_accumulation_model(model);
  out.rotation_size = rotation;
  out.rotation_signs = signs;
  return out;
}

struct layer_tensors {
  matrix x;   // [K, n_in]
  matrix dy;  // [K, n_out]
  matrix w;   // [n_out, n_in]
  mxscope::gemm_operands operands() const { return {&x, &dy, &w}; }
};

layer_tensors random_layer(std::int64_t k, std::int64_t n_in, std::int64_t n_out, std::uint64_t seed,
                           bool extreme = false) {
  if (extreme) return {extreme_matrix(k, n_in, seed), extreme_matrix(k, n_out, seed + 1), extreme_matrix(n_out, n_in, seed + 2)};
  return {random_matrix(k, n_in, seed), random_matrix(k, n_out, seed + 1, -30, -20), random_matrix(n_out, n_in, seed + 2, -8, -4)};
}

const mxscope::gemm_context context{"layers.3.mlp.down_proj", 17};

// ------------------------------------------------------------------------------------------------
// Test-side decoding of quantized operands (OCP MX v1.0 tables, NUMERICS.md section 1 storage).

// FP4 E2M1 values times two, codes 0..7 (8..15 are the negatives).
constexpr int fp4_twice[8] = {0, 1, 2, 3, 4, 6, 8, 12};

double fp4_value(std::uint8_t code) {
  const double magnitude = fp4_twice[code & 7U] / 2.0;
  return (code & 8U) != 0 ? -magnitude : magnitude;
}

// FP8 E4M3 (OCP "fn") and UE4M3: S.EEEE.MMM, bias 7, subnormals at E = 0, S.1111.111 is NaN.
double e4m3_value(std::uint8_t code) {
  const unsigned magnitude = code & 0x7FU;
  if (magnitude == 0x7FU) return NAN;
  const unsigned exponent = magnitude >> 3;
  const unsigned mantissa = magnitude & 7U;
  const double value = exponent == 0 ? std::ldexp(mantissa, -9) : std::ldexp(8 + mantissa, static_cast<int>(exponent) - 10);
  return (code & 0x80U) != 0 ? -value : value;
}

// The reduction-major view of a quantized operand: value(row, k) along the reduction.
struct test_operand {
  std::int64_t rows = 0;
  std::int64_t depth = 0;
  int block = 32;
  std::function<double(std::int64_t, std::int64_t)> scaled;  // block-scaled element value, exact
  std::function<int(std::int64_t, std::int64_t)> twice;      // fp4: 2 q (an integer)
  std::function<int(std::int64_t, std::int64_t)> exponent;   // MX: the block's shared exponent
  double tensor_scale = 1.0;
};

std::uint8_t packed_fp4_code(const quantized_tensor& q, std::int64_t r, std::int64_t c) {
  const std::int64_t row_bytes = (q.cols + 1) / 2;
  const std::uint8_t byte = q.codes[static_cast<std::size_t>(r * row_bytes + c / 2)];
  return c % 2 == 0 ? (byte & 0x0FU) : static_cast<std::uint8_t>(byte >> 4);
}

// `axis` is the operand's quantization axis = its reduction axis (NUMERICS.md section 6).
test_operand view_of(const quantized_tensor& q, int axis, std::string_view format) {
  test_operand out;
  out.rows = axis == 1 ? q.rows : q.cols;
  out.depth = axis == 1 ? q.cols : q.rows;
  const auto at = [axis](std::int64_t row, std::int64_t k) { return axis == 1 ? std::pair{row, k} : std::pair{k, row}; };
  if (format == "mxfp4") {
    out.block = q.block;
    out.exponent = [&q, axis, at](std::int64_t row, std::int64_t k) {
      const auto [r, c] = at(row, k);
      const std::uint8_t code = axis == 1 ? q.scales[static_cast<std::size_t>(r * q.scale_cols + c / q.block)]
                                          : q.scales[static_cast<std::size_t>((r / q.block) * q.scale_cols + c)];
      return static_cast<int>(code) - 127;
    };
    out.twice = [&q, at](std::int64_t row, std::int64_t k) {
      const auto [r, c] = at(row, k);
      const std::uint8_t code = packed_fp4_code(q, r, c);
      return (code & 8U) != 0 ? -fp4_twice[code & 7U] : fp4_twice[code & 7U];
    };
    out.scaled = [twice = out.twice, exponent = out.exponent](std::int64_t row, std::int64_t k) {
      return std::ldexp(twice(row, k) / 2.0, exponent(row, k));
    };
  } else if (format == "nvfp4") {
    out.block = 16;
    out.tensor_scale = q.tensor_scale;
    out.scaled = [&q, axis, at](std::int64_t row, std::int64_t k) {
      const auto [r, c] = at(row, k);
      const std::uint8_t scale = axis == 1 ? q.scales[static_cast<std::size_t>(r * q.scale_cols + c / 16)]
                                           : q.scales[static_cast<std::size_t>((r / 16) * q.scale_cols + c)];
      return fp4_value(packed_fp4_code(q, r, c)) * e4m3_value(scale);
    };
  } else if (format == "fp8_e4m3") {
    out.tensor_scale = q.tensor_scale;
    out.scaled = [&q, at](std::int64_t row, std::int64_t k) {
      const auto [r, c] = at(row, k);
      return e4m3_value(q.codes[static_cast<std::size_t>(r * q.cols + c)]);
    };
  } else if (format == "bf16") {
    out.scaled = [&q, at](std::int64_t row, std::int64_t k) {
      const auto [r, c] = at(row, k);
      const auto byte = static_cast<std::size_t>(r * q.cols + c) * 2;
      const std::uint32_t bits = (static_cast<std::uint32_t>(q.codes[byte + 1]) << 24) | (static_cast<std::uint32_t>(q.codes[byte]) << 16);
      float value = 0.0f;
      std::memcpy(&value, &bits, sizeof value);
      return static_cast<double>(value);
    };
  } else {  // fp32: the input itself
    out.scaled = [&q, at](std::int64_t row, std::int64_t k) {
      const auto [r, c] = at(row, k);
      return static_cast<double>(q.dequantized(r, c));
    };
  }
  return out;
}

// The operands as run_gemm must quantize them: NUMERICS.md section 6 axes and roles, section 4
// streams. `rotated` replaces the captured tensors when the strategy rotates.
struct quantized_pair {
  quantized_tensor a;
  quantized_tensor b;
  int a_axis;
  int b_axis;
};

mxscope::quantize_options options_for(const mxscope::operand_strategy& chosen, int axis, std::uint64_t seed,
                                      mxscope::core::random_role role) {
  mxscope::quantize_options options = chosen.quantize;
  options.axis = axis;
  const std::uint32_t layer_hash = mxscope::core::fnv1a32(context.layer.data(), context.layer.size());
  options.stream = {seed, context.step, layer_hash ^ static_cast<std::uint32_t>(role)};
  return options;
}

quantized_pair quantize_like_the_spec(gemm_kind kind, const layer_tensors& layer, const mxscope::strategy& chosen) {
  using role = mxscope::core::random_role;
  switch (kind) {
    case gemm_kind::fprop:
      return {mxscope::quantize(layer.x, options_for(chosen.a, 1, chosen.seed, role::x)),
              mxscope::quantize(layer.w, options_for(chosen.b, 1, chosen.seed, role::w)), 1, 1};
    case gemm_kind::dgrad:
      return {mxscope::quantize(layer.dy, options_for(chosen.a, 1, chosen.seed, role::dy)),
              mxscope::quantize(layer.w, options_for(chosen.b, 0, chosen.seed, role::w)), 1, 0};
    case gemm_kind::wgrad:
      return {mxscope::quantize(layer.dy, options_for(chosen.a, 0, chosen.seed, role::dy)),
              mxscope::quantize(layer.x, options_for(chosen.b, 0, chosen.seed, role::x)), 0, 0};
  }
  throw std::logic_error("kind");
}

// ------------------------------------------------------------------------------------------------
// Oracles.

// fp32-block for MXFP4 x MXFP4, straight from NUMERICS.md section 7: acc = +0; for each K-block
// in ascending order, the integer block dot D of the 2q codes, v = D * 2^(ea + eb - 2) (exact), and
// acc = fl32(acc + v): a plain fp32 addition when v is an fp32 number (then the hardware addition
// rounds the exact sum once), the oracle's rounding of the exact sum otherwise.
float fp32_block_oracle(const test_operand& a, const test_operand& b, std::int64_t i, std::int64_t j) {
  float accumulator = 0.0f;
  for (std::int64_t begin = 0; begin < a.depth; begin += a.block) {
    const std::int64_t end = std::min(a.depth, begin + a.block);
    std::int64_t dot = 0;
    for (std::int64_t k = begin; k < end; ++k) dot += static_cast<std::int64_t>(a.twice(i, k)) * b.twice(j, k);
    const int exponent = a.exponent(i, begin) + b.exponent(j, begin) - 2;
    const double value = std::ldexp(static_cast<double>(dot), exponent);
    const float as_float = static_cast<float>(value);
    if (!std::isfinite(accumulator)) continue;  // inf + a finite value stays inf (IEEE)
    if (std::isfinite(as_float) && static_cast<double>(as_float) == value) {
      accumulator = accumulator + as_float;
    } else {
      accumulator = oracle::round_to_float(oracle::from_double(accumulator) + oracle::from_double(value));
    }
  }
  return accumulator;
}

// The exact sum of the products of the block-scaled values, times the tensor scales.
cpp_int exact_entry(const test_operand& a, const test_operand& b, std::int64_t i, std::int64_t j) {
  cpp_int total = 0;
  for (std::int64_t k = 0; k < a.depth; ++k) total += oracle::product(a.scaled(i, k), b.scaled(j, k));
  if (a.tensor_scale != 1.0 || b.tensor_scale != 1.0) {
    const cpp_int scale = oracle::product(a.tensor_scale, b.tensor_scale);
    const cpp_int unit = cpp_int(1) << oracle::fraction_bits;
    const cpp_int full = total * scale;
    EXPECT_EQ(full % unit, 0);
    total = full / unit;
  }
  return total;
}

std::string where(std::string_view what, std::int64_t i, std::int64_t j) {
  return fmt::format("{} entry ({}, {})", what, i, j);
}

void expect_same_bits(const matrix& expected, const matrix& actual, std::string_view what) {
  ASSERT_EQ(expected.rows, actual.rows) << what;
  ASSERT_EQ(expected.cols, actual.cols) << what;
  int failures = 0;
  for (std::int64_t i = 0; i < expected.rows && failures < 5; ++i) {
    for (std::int64_t j = 0; j < expected.cols && failures < 5; ++j) {
      if (!oracle::same(expected(i, j), actual(i, j))) {
        ++failures;
        ADD_FAILURE() << where(what, i, j) << ": expected " << oracle::show(expected(i, j)) << ", got "
                      << oracle::show(actual(i, j));
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Names.

TEST(GemmNames, AccumulationModelsParseAndPrint) {
  for (const std::string_view text : {"exact", "fp32-block", "fp32-group:4", "fp32-group:1", "trunc-align:13,1,rtz",
                                      "trunc-align:200,4,rne", "fp32-seq", "trunc-promote:13,32,14,128",
                                      "trunc-promote:25,16,24", "trunc-promote:0,1,1,1"}) {
    EXPECT_EQ(mxscope::accumulation_model_name(mxscope::parse_accumulation_model(text)), text);
  }
  const auto model = mxscope::parse_accumulation_model("trunc-align:14,2");
  EXPECT_EQ(model.kind, mxscope::accumulation_kind::trunc_align);
  EXPECT_EQ(model.fraction_bits, 14);
  EXPECT_EQ(model.blocks_per_group, 2);
  EXPECT_EQ(model.rounding, mxscope::alignment_rounding::rtz);  // the default
  EXPECT_EQ(mxscope::parse_gemm_kind("wgrad"), gemm_kind::wgrad);
  EXPECT_EQ(mxscope::parse_gemm_kind("forward"), std::nullopt);
}

TEST(GemmNames, BadModelStringsNameTheField) {
  for (const std::string_view text : {"fp32-bloc", "", "fp32-group:", "fp32-group:0", "fp32-group:x", "trunc-align:5",
                                      "trunc-align:5,2,rtn", "trunc-align:-1,2", "trunc-align:5,2,rne,1", "exact ",
                                      "trunc-promote:13,32", "trunc-promote:13,32,25", "trunc-promote:13,0,14",
                                      "trunc-promote:13,32,14,100", "trunc-promote:13,32,14,0",
                                      "trunc-promote:13,32,14,128,1"}) {
    try {
      mxscope::parse_accumulation_model(text);
      ADD_FAILURE() << "'" << text << "' was accepted";
    } catch (const mxscope::input_error& error) {
      EXPECT_NE(std::string(error.what()).find("accum"), std::string::npos) << error.what();
      EXPECT_NE(std::string(error.what()).find(std::string(text)), std::string::npos) << error.what();
    }
  }
}

// ------------------------------------------------------------------------------------------------
// fp32-block against the scalar oracle, every GEMM kind, reduction lengths that are and are not
// multiples of 32.

void check_fp32_block_against_oracle(gemm_kind kind, std::int64_t k, std::int64_t n_in, std::int64_t n_out,
                                     std::uint64_t seed, bool extreme) {
  const layer_tensors layer = random_layer(k, n_in, n_out, seed, extreme);
  const mxscope::strategy chosen = make_strategy("mxfp4", "mxfp4", "fp32-block");
  const auto result = mxscope::run_gemm(kind, layer.operands(), chosen, context);
  const quantized_pair pair = quantize_like_the_spec(kind, layer, chosen);
  const test_operand a = view_of(pair.a, pair.a_axis, "mxfp4");
  const test_operand b = view_of(pair.b, pair.b_axis, "mxfp4");
  ASSERT_EQ(result.out.rows, a.rows);
  ASSERT_EQ(result.out.cols, b.rows);
  int failures = 0;
  for (std::int64_t i = 0; i < a.rows && failures < 5; ++i) {
    for (std::int64_t j = 0; j < b.rows && failures < 5; ++j) {
      const float expected = fp32_block_oracle(a, b, i, j);
      if (!oracle::same(expected, result.out(i, j))) {
        ++failures;
        ADD_FAILURE() << mxscope::gemm_kind_name(kind) << " K=" << k << " n_in=" << n_in << " n_out=" << n_out
                      << (extreme ? " (extreme exponents) " : " ") << where("fp32-block mxfp4", i, j) << ": expected "
                      << oracle::show(expected) << ", got " << oracle::show(result.out(i, j));
      }
    }
  }
}

TEST(Fp32Block, MatchesTheScalarOracleForEveryKind) {
  check_fp32_block_against_oracle(gemm_kind::wgrad, 256, 40, 24, 1, false);
  check_fp32_block_against_oracle(gemm_kind::fprop, 24, 128, 40, 2, false);
  check_fp32_block_against_oracle(gemm_kind::dgrad, 24, 40, 96, 3, false);
}

TEST(Fp32Block, ReductionLengthsThatAreNotMultiplesOf32) {
  for (const std::int64_t k : {100, 33, 1}) check_fp32_block_against_oracle(gemm_kind::wgrad, k, 20, 12, 10 + k, false);
  check_fp32_block_against_oracle(gemm_kind::fprop, 7, 100, 9, 20, false);
  check_fp32_block_against_oracle(gemm_kind::dgrad, 7, 9, 33, 21, false);
}

TEST(Fp32Block, ExtremeScaleExponents) {
  check_fp32_block_against_oracle(gemm_kind::wgrad, 160, 24, 20, 30, true);
  check_fp32_block_against_oracle(gemm_kind::fprop, 20, 96, 24, 31, true);
}

// ------------------------------------------------------------------------------------------------
// exact against Boost.Multiprecision, for MX, NVFP4 (tensor scales), per-tensor fp8, bf16, fp32.

void check_exact(gemm_kind kind, std::string_view format, std::int64_t k, std::int64_t n_in, std::int64_t n_out,
                 std::uint64_t seed) {
  const layer_tensors layer = random_layer(k, n_in, n_out, seed);
  const mxscope::strategy chosen = make_strategy(format, format, "exact");
  const auto result = mxscope::run_gemm(kind, layer.operands(), chosen, context);
  const quantized_pair pair = quantize_like_the_spec(kind, layer, chosen);
  const test_operand a = view_of(pair.a, pair.a_axis, format);
  const test_operand b = view_of(pair.b, pair.b_axis, format);
  ASSERT_EQ(result.exact.rows, a.rows);
  ASSERT_EQ(result.exact.cols, b.rows);
  int failures = 0;
  for (std::int64_t i = 0; i < a.rows && failures < 5; ++i) {
    for (std::int64_t j = 0; j < b.rows && failures < 5; ++j) {
      const cpp_int exact = exact_entry(a, b, i, j);
      const float expected32 = oracle::round_to_float(exact);
      const double expected64 = oracle::round_to_double(exact);
      if (!oracle::same(expected32, result.out(i, j)) || !oracle::same(expected64, result.exact(i, j))) {
        ++failures;
        ADD_FAILURE() << mxscope::gemm_kind_name(kind) << " " << format << " " << where("exact", i, j) << ": expected "
                      << oracle::show(expected32) << " / " << oracle::show(expected64) << ", got "
                      << oracle::show(result.out(i, j)) << " / " << oracle::show(result.exact(i, j));
      }
    }
  }
}

TEST(Exact, MatchesBoostMultiprecision) {
  check_exact(gemm_kind::wgrad, "mxfp4", 96, 12, 10, 40);
  check_exact(gemm_kind::fprop, "nvfp4", 10, 80, 12, 41);
  check_exact(gemm_kind::dgrad, "fp8_e4m3", 10, 12, 70, 42);
  check_exact(gemm_kind::wgrad, "bf16", 50, 9, 7, 43);
  check_exact(gemm_kind::fprop, "fp32", 6, 45, 8, 44);
}

// The exact model of unscaled operands (fp32, bf16) is the exact reference of their dequantized
// values: the exact sum of the products, rounded once to fp32 and to fp64, zero signs included. The
// GPU computes that model with its reference kernel (src/backend/gpu_products.cpp, reference_multiplies).
TEST(Exact, ExactModelOfPlainOperandsIsTheExactReference) {
  layer_tensors cancelling = random_layer(64, 9, 7, 51);
  for (std::int64_t k = 1; k < 64; k += 2) {  // token pairs that cancel exactly in dw = dy^T x
    for (std::int64_t c = 0; c < cancelling.x.cols; ++c) cancelling.x(k, c) = cancelling.x(k - 1, c);
    for (std::int64_t c = 0; c < cancelling.dy.cols; ++c) cancelling.dy(k, c) = -cancelling.dy(k - 1, c);
  }
  const std::vector<std::pair<std::string, layer_tensors>> layers = {
      {"random", random_layer(70, 12, 10, 52)},
      {"extreme", random_layer(96, 11, 13, 53, true)},
      {"cancelling", cancelling}};
  for (const auto& [label, layer] : layers) {
    for (const gemm_kind kind : {gemm_kind::wgrad, gemm_kind::fprop, gemm_kind::dgrad}) {
      for (const auto& [format_a, format_b] : std::vector<std::pair<std::string, std::string>>{
               {"bf16", "bf16"}, {"fp32", "fp32"}, {"bf16", "fp32"}}) {
        const std::string what = fmt::format("{} {} {} x {}", label, mxscope::gemm_kind_name(kind), format_a, format_b);
        const mxscope::strategy chosen = make_strategy(format_a, format_b, "exact");
        const auto model = mxscope::run_gemm(kind, layer.operands(), chosen, context);
        const mxscope::gemm_layout layout = mxscope::layout_of(kind);
        const auto canonical = [&](std::string_view name, const mxscope::operand_strategy& side, int axis) {
          const matrix& tensor = name == "x" ? layer.x : name == "dy" ? layer.dy : layer.w;
          mxscope::quantize_options options = side.quantize;
          options.axis = axis;
          const matrix values = mxscope::quantize(tensor, options).dequantized;
          return axis == 1 ? values : mxscope::transposed(values);
        };
        const auto reference =
            mxscope::reference_gemm(canonical(layout.a_name, chosen.a, layout.a_axis),
                                    canonical(layout.b_name, chosen.b, layout.b_axis), mxscope::reference_kind::exact);
        expect_same_bits(reference.fp32, model.out, what + " fp32");
        ASSERT_EQ(reference.fp64.values.size(), model.exact.values.size()) << what;
        for (std::size_t i = 0; i < model.exact.values.size(); ++i) {
          ASSERT_EQ(std::bit_cast<std::uint64_t>(reference.fp64.values[i]), std::bit_cast<std::uint64_t>(model.exact.values[i]))
              << what << " fp64 entry " << i;
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Relations between models.

void check_models_equal(std::string_view format, std::string_view left, std::string_view right, gemm_kind kind,
                        std::uint64_t seed) {
  const layer_tensors layer = random_layer(200, 24, 20, seed);
  const auto first = mxscope::run_gemm(kind, layer.operands(), make_strategy(format, format, left), context);
  const auto second = mxscope::run_gemm(kind, layer.operands(), make_strategy(format, format, right), context);
  expect_same_bits(first.out, second.out, fmt::format("{} {} vs {}", format, left, right));
}

TEST(Models, TruncAlignWithManyBitsIsFp32Group) {
  for (const std::string_view format : {"mxfp4", "mxfp8_e4m3", "nvfp4", "bf16"}) {
    check_models_equal(format, "trunc-align:200,1,rne", "fp32-block", gemm_kind::wgrad, 50);
    check_models_equal(format, "trunc-align:200,2,rne", "fp32-group:2", gemm_kind::fprop, 51);
    check_models_equal(format, "trunc-align:200,4,rne", "fp32-group:4", gemm_kind::dgrad, 52);
  }
}

TEST(Models, TruncAlignKernelWithoutTruncationIsFp32Group) {
  // n = 40 keeps every bit of these operands (their block exponents differ by far less than 40
  // within a group and an accumulator), and it is small enough for the integer trunc-align kernel:
  // two independent fast paths must agree.
  for (const std::string_view format : {"mxfp4", "mxfp6_e2m3", "mxint8"}) {
    check_models_equal(format, "trunc-align:40,1,rne", "fp32-block", gemm_kind::wgrad, 53);
    check_models_equal(format, "trunc-align:40,4,rne", "fp32-group:4", gemm_kind::fprop, 54);
  }
}

TEST(Models, Fp32GroupOfOneIsFp32Block) {
  for (const std::string_view format : {"mxfp4", "mxfp6_e3m2", "mxfp8_e4m3", "mxint8", "nvfp4", "fp8_e5m2", "fp32"}) {
    check_models_equal(format, "fp32-group:1", "fp32-block", gemm_kind::wgrad, 60);
  }
}

TEST(Models, TruncAlignWithFewBitsLosesAccuracy) {
  // Not an identity: keeping 4 bits below the leading exponent must change most entries.
  const layer_tensors layer = random_layer(128, 16, 16, 70);
  const auto coarse = mxscope::run_gemm(gemm_kind::wgrad, layer.operands(), make_strategy("mxfp4", "mxfp4", "trunc-align:4,1"), context);
  const auto exact = mxscope::run_gemm(gemm_kind::wgrad, layer.operands(), make_strategy("mxfp4", "mxfp4", "exact"), context);
  int differing = 0;
  for (std::int64_t i = 0; i < coarse.out.size(); ++i) differing += coarse.out.values[i] != exact.out.values[i];
  EXPECT_GT(differing, coarse.out.size() / 2);
}

TEST(TruncAlign, HandComputedGemm) {
  // fprop with unquantized operands: x [2, 33], w [1, 33], y = x w^T. Row 0 products: 1, 0.40625,
  // 0.0390625 in block 0 and 0.1875 (k = 32) in block 1; row 1 the same with 4 instead of 1.
  matrix x(2, 33, 0.0f);
  matrix w(1, 33, 0.0f);
  x(0, 0) = x(0, 1) = x(0, 2) = x(0, 32) = 1.0f;
  x(1, 0) = 4.0f;
  x(1, 1) = x(1, 2) = x(1, 32) = 1.0f;
  w(0, 0) = 1.0f;
  w(0, 1) = 0.40625f;
  w(0, 2) = 0.0390625f;
  w(0, 32) = 0.1875f;
  const mxscope::gemm_operands operands{&x, nullptr, &w};
  const auto run = [&](std::string_view model) {
    return mxscope::run_gemm(gemm_kind::fprop, operands, make_strategy("fp32", "fp32", model), context).out;
  };
  // n = 3, G = 1. Row 0, group 0: E = 0, keep multiples of 1/8: 1 + 0.375 + 0 = 1.375; group 1:
  // acc 1.375 (E = 0) and 0.1875 -> 0.125: 1.5. Row 1, group 0: E = 2, multiples of 1/2:
  // 4 + 0 + 0 = 4; group 1: 4 and 0.1875 -> 0: 4.
  const matrix coarse = run("trunc-align:3,1,rtz");
  EXPECT_EQ(coarse(0, 0), 1.5f);
  EXPECT_EQ(coarse(1, 0), 4.0f);
  // G = 2: one group of all products: row 0: 1 + 0.375 + 0 + 0.125 = 1.5; row 1: 4.
  const matrix grouped = run("trunc-align:3,2,rtz");
  EXPECT_EQ(grouped(0, 0), 1.5f);
  EXPECT_EQ(grouped(1, 0), 4.0f);
  // fp32-block keeps everything: 1.4453125 + 0.1875 and 4.4453125 + 0.1875.
  const matrix block = run("fp32-block");
  EXPECT_EQ(block(0, 0), 1.6328125f);
  EXPECT_EQ(block(1, 0), 4.6328125f);
}

// trunc-promote:n,k,w[,c] from docs/numerics.md with the oracle's integers: steps of k products in
// ascending K; a step aligns the inner accumulator and its products to E (the largest of the
// accumulator's leading exponent and the products' exponent sums ilogb(x) + ilogb(y)), truncates
// every term toward zero to a multiple of 2^(E - n), and truncates the exact sum to w significant
// bits; every c products and at the end of K the inner value is added to the outer fp32 accumulator
// with one rounding to nearest-even. Then the epilogue fl32(acc * fl32(sa * sb)).
float trunc_promote_oracle(const test_operand& a, const test_operand& b, std::int64_t i, std::int64_t j, int n, int k,
                           int w, int c) {
  const oracle::binary_format narrow{w, -149, 127};
  const std::int64_t interval = c == 0 ? a.depth : c;
  float outer = 0.0f;
  double inner = 0.0;
  for (std::int64_t begin = 0; begin < a.depth; begin += k) {
    const std::int64_t end = std::min(a.depth, begin + k);
    bool any = inner != 0.0;
    int leading = any ? std::ilogb(inner) : 0;
    std::vector<cpp_int> products;
    for (std::int64_t at = begin; at < end; ++at) {
      const double x = a.scaled(i, at);
      const double y = b.scaled(j, at);
      products.push_back(oracle::product(x, y));
      if (x == 0.0 || y == 0.0) continue;
      leading = any ? std::max(leading, std::ilogb(x) + std::ilogb(y)) : std::ilogb(x) + std::ilogb(y);
      any = true;
    }
    cpp_int total = oracle::truncate_toward_zero(oracle::from_double(inner), leading - n);
    for (const cpp_int& product : products) total += oracle::truncate_toward_zero(product, leading - n);
    inner = any ? oracle::round_to(total, narrow, true) : 0.0;
    if (end % interval == 0 || end == a.depth) {
      outer = oracle::round_to_float(oracle::from_double(outer) + oracle::from_double(inner));
      inner = 0.0;
    }
  }
  const float alpha = static_cast<float>(a.tensor_scale) * static_cast<float>(b.tensor_scale);
  return outer * alpha;
}

TEST(TruncPromote, MatchesTheOracle) {
  struct setting {
    const char* model;
    int n, k, w, c;
  };
  // The H200 fits (docs/conformance.md), a promotion interval that does not divide K, a step longer
  // than a block, coarse settings where truncation changes most entries.
  const setting settings[] = {{"trunc-promote:13,32,14,128", 13, 32, 14, 128},
                              {"trunc-promote:25,16,24", 25, 16, 24, 0},
                              {"trunc-promote:6,8,5,24", 6, 8, 5, 24},
                              {"trunc-promote:10,64,12,64", 10, 64, 12, 64}};
  for (const std::string_view format : {"mxfp4", "fp8_e4m3", "bf16", "fp32"}) {
    const layer_tensors layer = random_layer(200, 12, 10, 90);
    for (const auto& one : settings) {
      const mxscope::strategy chosen = make_strategy(format, format, one.model);
      const quantized_pair pair = quantize_like_the_spec(gemm_kind::wgrad, layer, chosen);
      const test_operand a = view_of(pair.a, pair.a_axis, format);
      const test_operand b = view_of(pair.b, pair.b_axis, format);
      const auto result = mxscope::run_gemm(gemm_kind::wgrad, layer.operands(), chosen, context);
      ASSERT_EQ(result.out.rows, a.rows);
      ASSERT_EQ(result.out.cols, b.rows);
      int failures = 0;
      for (std::int64_t i = 0; i < a.rows && failures < 5; ++i) {
        for (std::int64_t j = 0; j < b.rows && failures < 5; ++j) {
          const float expected = trunc_promote_oracle(a, b, i, j, one.n, one.k, one.w, one.c);
          if (!oracle::same(expected, result.out(i, j))) {
            ++failures;
            ADD_FAILURE() << format << " " << where(one.model, i, j) << ": expected " << oracle::show(expected)
                          << ", got " << oracle::show(result.out(i, j));
          }
        }
      }
    }
  }
}

TEST(TruncPromote, PromotionAndStepWidthMatter) {
  // Not identities: on K = 200 the promotion interval, the step width and the kept bits each change
  // entries (and c = K is the same as no promotion).
  const layer_tensors layer = random_layer(200, 16, 16, 91);
  const auto run = [&](std::string_view model) {
    return mxscope::run_gemm(gemm_kind::wgrad, layer.operands(), make_strategy("mxfp8_e4m3", "mxfp8_e4m3", model),
                             context)
        .out;
  };
  const auto differing = [](const matrix& x, const matrix& y) {
    int count = 0;
    for (std::int64_t i = 0; i < x.size(); ++i) count += x.values[i] != y.values[i];
    return count;
  };
  const matrix base = run("trunc-promote:13,32,14,64");
  EXPECT_GT(differing(base, run("trunc-promote:13,32,14")), 0);
  EXPECT_GT(differing(base, run("trunc-promote:13,16,14,64")), 0);
  EXPECT_GT(differing(base, run("trunc-promote:13,32,16,64")), 0);
  expect_same_bits(run("trunc-promote:13,32,14"), run("trunc-promote:13,32,14,224"), "c beyond K is no promotion");
}

TEST(Fp32Seq, IsSequentialFusedMultiplyAdd) {
  const layer_tensors layer = random_layer(150, 20, 18, 80);
  for (const gemm_kind kind : {gemm_kind::wgrad, gemm_kind::fprop, gemm_kind::dgrad}) {
    const mxscope::strategy chosen = make_strategy("mxfp4", "mxfp4", "fp32-seq");
    const auto result = mxscope::run_gemm(kind, layer.operands(), chosen, context);
    const auto portable = mxscope::run_gemm(kind, layer.operands(), chosen, context, gemm_options_of(mxscope::accumulation_path::automatic, false));
    const quantized_pair pair = quantize_like_the_spec(kind, layer, chosen);
    const test_operand a = view_of(pair.a, pair.a_axis, "mxfp4");
    const test_operand b = view_of(pair.b, pair.b_axis, "mxfp4");
    matrix expected(a.rows, b.rows);
    for (std::int64_t i = 0; i < a.rows; ++i) {
      for (std::int64_t j = 0; j < b.rows; ++j) {
        float accumulator = 0.0f;
        for (std::int64_t k = 0; k < a.depth; ++k) {
          // Dequantized to fp32 (exact for these magnitudes), then one fused multiply-add.
          accumulator = std::fma(static_cast<float>(a.scaled(i, k)), static_cast<float>(b.scaled(j, k)), accumulator);
        }
        expected(i, j) = accumulator;
      }
    }
    expect_same_bits(expected, result.out, fmt::format("fp32-seq {}", mxscope::gemm_kind_name(kind)));
    expect_same_bits(expected, portable.out, fmt::format("fp32-seq {} (portable kernels)", mxscope::gemm_kind_name(kind)));
  }
}

// ------------------------------------------------------------------------------------------------
// Shapes and axes of the three GEMMs against a naive fp64 GEMM of the dequantized operands.

TEST(Kinds, ShapesAndAxesAgreeWithANaiveGemm) {
  const std::int64_t k = 70, n_in = 50, n_out = 36;
  const layer_tensors layer = random_layer(k, n_in, n_out, 90);
  for (const gemm_kind kind : {gemm_kind::fprop, gemm_kind::dgrad, gemm_kind::wgrad}) {
    const mxscope::strategy chosen = make_strategy("mxfp8_e4m3", "mxfp6_e2m3", "fp32-block");
    const auto result = mxscope::run_gemm(kind, layer.operands(), chosen, context);
    // Dequantize the operands in their captured layouts, then multiply as the layer does.
    const quantized_pair pair = quantize_like_the_spec(kind, layer, chosen);
    const matrix& first = pair.a.dequantized;
    const matrix& second = pair.b.dequantized;
    std::int64_t rows = 0, cols = 0, depth = 0;
    std::function<double(std::int64_t, std::int64_t, std::int64_t)> term;
    switch (kind) {
      case gemm_kind::fprop:  // y[t, o] = sum_i x[t, i] w[o, i]
        rows = k, cols = n_out, depth = n_in;
        term = [&](std::int64_t t, std::int64_t o, std::int64_t i) { return double(first(t, i)) * second(o, i); };
        break;
      case gemm_kind::dgrad:  // dx[t, i] = sum_o dy[t, o] w[o, i]
        rows = k, cols = n_in, depth = n_out;
        term = [&](std::int64_t t, std::int64_t i, std::int64_t o) { return double(first(t, o)) * second(o, i); };
        break;
      case gemm_kind::wgrad:  // dw[o, i] = sum_t dy[t, o] x[t, i]
        rows = n_out, cols = n_in, depth = k;
        term = [&](std::int64_t o, std::int64_t i, std::int64_t t) { return double(first(t, o)) * second(t, i); };
        break;
    }
    ASSERT_EQ(result.out.rows, rows) << mxscope::gemm_kind_name(kind);
    ASSERT_EQ(result.out.cols, cols) << mxscope::gemm_kind_name(kind);
    // fp32-block rounds once per block: |error| <= gamma_(blocks) * sum |terms| (plus the fp64
    // reference's own, far smaller, error).
    const double blocks = std::ceil(depth / 32.0);
    const double gamma = blocks * std::ldexp(1.0, -24) / (1.0 - blocks * std::ldexp(1.0, -24));
    int failures = 0;
    for (std::int64_t r = 0; r < rows && failures < 5; ++r) {
      for (std::int64_t c = 0; c < cols && failures < 5; ++c) {
        double sum = 0.0, magnitude = 0.0;
        for (std::int64_t d = 0; d < depth; ++d) {
          sum += term(r, c, d);
          magnitude += std::fabs(term(r, c, d));
        }
        const double bound = gamma * magnitude * 1.001 + depth * std::ldexp(magnitude, -52);
        if (!(std::fabs(result.out(r, c) - sum) <= bound)) {
          ++failures;
          ADD_FAILURE() << mxscope::gemm_kind_name(kind) << " " << where("vs naive fp64", r, c) << ": naive " << sum
                        << ", got " << oracle::show(result.out(r, c)) << ", bound " << bound;
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Rotations.

// NUMERICS.md section 5 written out: signs, then the unnormalized FWHT in canonical order, then
// the fp32 scale fl32(1/sqrt(b)), all in fp32.
void rotate_like_the_spec(matrix& values, int axis, int size, const std::vector<float>& signs) {
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(size)));
  const std::int64_t lines = axis == 1 ? values.rows : values.cols;
  const std::int64_t length = axis == 1 ? values.cols : values.rows;
  for (std::int64_t line = 0; line < lines; ++line) {
    for (std::int64_t begin = 0; begin < length; begin += size) {
      std::vector<float> v(static_cast<std::size_t>(size));
      auto element = [&](std::int64_t i) -> float& { return axis == 1 ? values(line, begin + i) : values(begin + i, line); };
      for (int i = 0; i < size; ++i) v[i] = element(i) * signs[static_cast<std::size_t>(begin + i)];
      for (int half = 1; half < size; half *= 2) {
        for (int j = 0; j < size; ++j) {
          if (j % (2 * half) < half) {
            const float p = v[j], q = v[j + half];
            v[j] = p + q;
            v[j + half] = p - q;
          }
        }
      }
      for (int i = 0; i < size; ++i) element(i) = v[i] * scale;
    }
  }
}

std::vector<float> signs_for(std::int64_t length, const mxscope::strategy& chosen) {
  mxscope::rotation_options options;
  options.size = chosen.rotation_size;
  options.signs = chosen.rotation_signs;
  options.seed = chosen.seed;
  options.step = context.step;
  options.layer_hash = mxscope::core::fnv1a32(context.layer.data(), context.layer.size());
  return mxscope::rotation_signs(length, options);
}

TEST(Rotation, BothOperandsShareOneRotationAlongTheReduction) {
  // fp32-block of MXFP4 operands rotated by the spec's FWHT (the same signs for both) must equal
  // run_gemm with the rotation, bit for bit: rotation before quantization, along the reduction.
  const std::int64_t k = 128, n_in = 64, n_out = 32;
  const layer_tensors layer = random_layer(k, n_in, n_out, 100);
  for (const gemm_kind kind : {gemm_kind::wgrad, gemm_kind::fprop, gemm_kind::dgrad}) {
    const mxscope::strategy chosen =
        make_strategy("mxfp4", "mxfp4", "fp32-block", 32, mxscope::sign_policy::per_step);
    const auto result = mxscope::run_gemm(kind, layer.operands(), chosen, context);
    layer_tensors rotated = layer;
    switch (kind) {
      case gemm_kind::fprop:
        rotate_like_the_spec(rotated.x, 1, 32, signs_for(n_in, chosen));
        rotate_like_the_spec(rotated.w, 1, 32, signs_for(n_in, chosen));
        break;
      case gemm_kind::dgrad:
        rotate_like_the_spec(rotated.dy, 1, 32, signs_for(n_out, chosen));
        rotate_like_the_spec(rotated.w, 0, 32, signs_for(n_out, chosen));
        break;
      case gemm_kind::wgrad:
        rotate_like_the_spec(rotated.dy, 0, 32, signs_for(k, chosen));
        rotate_like_the_spec(rotated.x, 0, 32, signs_for(k, chosen));
        break;
    }
    const quantized_pair pair = quantize_like_the_spec(kind, rotated, chosen);
    const test_operand a = view_of(pair.a, pair.a_axis, "mxfp4");
    const test_operand b = view_of(pair.b, pair.b_axis, "mxfp4");
    matrix expected(a.rows, b.rows);
    for (std::int64_t i = 0; i < a.rows; ++i) {
      for (std::int64_t j = 0; j < b.rows; ++j) expected(i, j) = fp32_block_oracle(a, b, i, j);
    }
    expect_same_bits(expected, result.out, fmt::format("rotated {}", mxscope::gemm_kind_name(kind)));
  }
}

TEST(Rotation, ExactProductIsInvariantUpToTheRotationsRounding) {
  // With unquantized fp32 operands and exact accumulation, rotating both operands by the same Q
  // changes the result only through the fp32 rounding of the rotation itself. Each FWHT stage is
  // an exact sqrt(2)-scaled orthogonal map followed by one rounding per element (relative error
  // <= u), so after log2(b) stages and the scale multiply (whose constant fl32(1/sqrt b) carries
  // another u) the rotated vector q^ satisfies ||q^ - Q v|| <= gamma ||v||, gamma = (1+u)^(L+2) - 1.
  // Then |q^_a . q^_b - a . b| <= (2 gamma + gamma^2) ||a|| ||b|| per entry (Cauchy-Schwarz over
  // the segments), and each result is rounded once to fp32 (relative u).
  const layer_tensors layer = random_layer(256, 6, 5, 110);
  const double u = std::ldexp(1.0, -24);
  for (const int size : {16, 64, 256}) {
    const auto plain = mxscope::run_gemm(gemm_kind::wgrad, layer.operands(), make_strategy("fp32", "fp32", "exact"), context);
    const auto rotated = mxscope::run_gemm(gemm_kind::wgrad, layer.operands(),
                                           make_strategy("fp32", "fp32", "exact", size, mxscope::sign_policy::fixed), context);
    const int stages = static_cast<int>(std::log2(size));
    const double gamma = std::pow(1.0 + u, stages + 2) - 1.0;
    int differing = 0;
    for (std::int64_t o = 0; o < 5; ++o) {
      for (std::int64_t i = 0; i < 6; ++i) {
        double norm_dy = 0.0, norm_x = 0.0;
        for (std::int64_t t = 0; t < 256; ++t) {
          norm_dy += double(layer.dy(t, o)) * layer.dy(t, o);
          norm_x += double(layer.x(t, i)) * layer.x(t, i);
        }
        const double r1 = plain.out(o, i), r2 = rotated.out(o, i);
        const double bound = (2 * gamma + gamma * gamma) * std::sqrt(norm_dy) * std::sqrt(norm_x) + u * (std::fabs(r1) + std::fabs(r2));
        EXPECT_LE(std::fabs(r1 - r2), bound) << "hadamard:" << size << " " << where("dw", o, i);
        differing += r1 != r2;
      }
    }
    EXPECT_GT(differing, 0) << "hadamard:" << size << ": the rotation changed nothing; was it applied?";
  }
}

// ------------------------------------------------------------------------------------------------
// Fast path against the generic (definition) path, and thread counts.

TEST(FastPath, IsBitIdenticalToTheGenericPath) {
  struct pairing {
    std::string_view a, b;
  };
  const pairing pairings[] = {{"mxfp4", "mxfp4"},         {"mxfp6_e2m3", "mxfp6_e3m2"}, {"mxint8", "mxfp4"},
                              {"mxfp8_e4m3", "mxfp8_e4m3"}, {"mxfp8_e5m2", "mxfp4"},     {"nvfp4", "nvfp4"},
                              {"fp8_e4m3", "fp8_e4m3"},     {"fp8_e4m3", "mxfp4"},      {"bf16", "bf16"},
                              {"fp32", "bf16"},             {"fp8_e5m2", "fp8_e4m3"}};
  for (const bool extreme : {false, true}) {
    const layer_tensors layer = random_layer(100, 36, 28, extreme ? 120 : 121, extreme);
    for (const auto& [format_a, format_b] : pairings) {
      // trunc-align has a fast path only for operands whose integer values fit int16 (fp4, fp6, int8).
      const bool small_integers = format_a.substr(0, 2) == "mx" && format_a.substr(0, 5) != "mxfp8" &&
                                  format_b.substr(0, 2) == "mx" && format_b.substr(0, 5) != "mxfp8";
      for (const std::string_view model :
           {"fp32-block", "fp32-group:3", "exact", "trunc-align:14,1", "trunc-align:9,3,rne", "trunc-align:30,2"}) {
        if (model.starts_with("trunc-align") && !small_integers) continue;
        for (const gemm_kind kind : {gemm_kind::wgrad, gemm_kind::fprop}) {
          const mxscope::strategy chosen = make_strategy(format_a, format_b, model);
          const auto fast = mxscope::run_gemm(kind, layer.operands(), chosen, context);
          // The wide kernels (the e4m3 pairs; the certified float dots of unscaled and per-tensor
          // operands) also on AVX2 (where the first run took AVX-512).
          const bool e4m3 = format_a.ends_with("fp8_e4m3") && format_b.ends_with("fp8_e4m3");
          const bool wide = e4m3 || format_b == "bf16" || format_a == "fp8_e5m2";
          const auto fast_avx2 = [&] {
            const wide_kernel_on scope(wide ? "avx2" : nullptr);
            return mxscope::run_gemm(kind, layer.operands(), chosen, context);
          }();
          const auto portable = mxscope::run_gemm(kind, layer.operands(), chosen, context,
                                                  gemm_options_of(mxscope::accumulation_path::automatic, false));
          const auto generic = mxscope::run_gemm(kind, layer.operands(), chosen, context, gemm_options_of(mxscope::accumulation_path::generic));
          const std::string what = fmt::format("{} x {} {} {}{}", format_a, format_b, model, mxscope::gemm_kind_name(kind),
                                               extreme ? " extreme" : "");
          expect_same_bits(generic.out, fast.out, what);
          expect_same_bits(generic.out, fast_avx2.out, what + " (the wide kernel on AVX2)");
          expect_same_bits(generic.out, portable.out, what + " (portable kernels)");
          if (model == "exact") {
            for (std::int64_t i = 0; i < fast.exact.size(); ++i) {
              ASSERT_TRUE(oracle::same(generic.exact.values[i], fast.exact.values[i])) << what << " fp64 entry " << i;
              ASSERT_TRUE(oracle::same(generic.exact.values[i], fast_avx2.exact.values[i])) << what << " fp64 entry " << i;
            }
          }
        }
      }
    }
  }
  // The extreme data must have sent some MXFP4 entries through the exact per-entry step, in both
  // the SIMD and the portable kernel.
  const layer_tensors layer = random_layer(100, 40, 36, 120, true);
  for (const bool vector_kernels : {true, false}) {
    const auto fast = mxscope::run_gemm(gemm_kind::wgrad, layer.operands(), make_strategy("mxfp4", "mxfp4", "fp32-block"),
                                        context, gemm_options_of(mxscope::accumulation_path::automatic, vector_kernels));
    EXPECT_GT(fast.fallback_entries, 0) << "vector kernels " << vector_kernels;
  }
  // bf16 block steps that the certified kernel cannot decide from its bound are taken by the
  // definition: all of them in the extreme data (binades from -140 to 115 in one block, overflow),
  // few (here none) in ordinary data.
  const auto extreme_bf16 = mxscope::run_gemm(gemm_kind::wgrad, layer.operands(), make_strategy("bf16", "bf16", "fp32-block"), context);
  EXPECT_GT(extreme_bf16.fallback_entries, 0);
  const layer_tensors ordinary = random_layer(100, 36, 28, 121);
  const auto ordinary_bf16 = mxscope::run_gemm(gemm_kind::wgrad, ordinary.operands(), make_strategy("bf16", "bf16", "fp32-block"), context);
  EXPECT_LT(ordinary_bf16.fallback_entries, ordinary_bf16.out.size() / 4);
}

// Per-tensor operands that share the reduction axis: dy [K, n_out] and x [K, n_in] along K (axis 0),
// or their transposes along axis 1.
std::pair<quantized_tensor, quantized_tensor> per_tensor_operands(const layer_tensors& layer, std::string_view format_a,
                                                                  std::string_view format_b, int axis) {
  mxscope::quantize_options a_options;
  a_options.format = *mxscope::parse_format(format_a);
  a_options.axis = axis;
  mxscope::quantize_options b_options = a_options;
  b_options.format = *mxscope::parse_format(format_b);
  return {mxscope::quantize(axis == 0 ? layer.dy : mxscope::transposed(layer.dy), a_options),
          mxscope::quantize(axis == 0 ? layer.x : mxscope::transposed(layer.x), b_options)};
}

// Per-tensor fp8 operands as the GPU multiplies them (--device gpu): MX operands with the same
// element codes and every block scale 2^0, then the tensor scales applied on the host. Here the MX
// product runs on the CPU, so the test checks the reduction itself: it must give the bits of the
// direct per-tensor product for every model it claims, both output roundings and both axes.
TEST(PerTensor, UnitScaledMxProductWithTensorScalesIsTheDirectProduct) {
  struct pairing {
    std::string_view a, b;
  };
  for (const bool extreme : {false, true}) {
    const layer_tensors layer = random_layer(100, 36, 28, extreme ? 140 : 141, extreme);
    for (const auto& [format_a, format_b] : {pairing{"fp8_e4m3", "fp8_e4m3"}, pairing{"fp8_e5m2", "fp8_e4m3"}}) {
      const bool e5m2 = format_a == "fp8_e5m2";
      for (const int axis : {0, 1}) {
        const auto [a, b] = per_tensor_operands(layer, format_a, format_b, axis);
        ASSERT_NE(a.tensor_scale, 1.0f);
        for (const std::string_view name : {"fp32-block", "fp32-group:4", "exact"}) {
          const mxscope::accumulation_model model = mxscope::parse_accumulation_model(name);
          // e5m2 x e4m3: K * 57344 * 2^16 * 448 * 2^9 exceeds 2^53 from K = 8 on, so at K = 100 the
          // unscaled sum need not be an fp64 value and the exact model stays on the CPU's own path;
          // fp32-block and fp32-group apply for any K.
          const bool exact_model = model.kind == mxscope::accumulation_kind::exact;
          ASSERT_EQ(mxscope::detail::per_tensor_by_unit_scales_applies(a, b, model), !(e5m2 && exact_model)) << name;
          if (e5m2 && exact_model) continue;
          for (const auto output : {mxscope::output_rounding::fp32, mxscope::output_rounding::bf16}) {
            const auto direct = mxscope::emulate_product(a, b, model, output);
            const auto via = mxscope::detail::per_tensor_by_unit_scales(
                a, b, 32, model, output,
                [&](const quantized_tensor& x, const quantized_tensor& y) { return mxscope::emulate_product(x, y, model); });
            const std::string what = fmt::format("{} x {} axis {} {} {}{}", format_a, format_b, axis, name,
                                                 output == mxscope::output_rounding::bf16 ? "bf16" : "fp32",
                                                 extreme ? " extreme" : "");
            expect_same_bits(direct.out, via.out, what);
            if (model.kind == mxscope::accumulation_kind::exact) {
              ASSERT_EQ(direct.exact.size(), via.exact.size()) << what;
              for (std::int64_t i = 0; i < direct.exact.size(); ++i) {
                ASSERT_TRUE(oracle::same(direct.exact.values[i], via.exact.values[i])) << what << " fp64 entry " << i;
              }
            }
          }
        }
        // What the reduction does not claim: other models, other schemes.
        for (const std::string_view name : {"fp32-seq", "trunc-align:14,1", "trunc-promote:13,32,14,128"}) {
          EXPECT_FALSE(mxscope::detail::per_tensor_by_unit_scales_applies(a, b, mxscope::parse_accumulation_model(name)))
              << name;
        }
      }
    }
  }
  // A NaN element (from a NaN input) and an MX operand are left to the CPU's own paths.
  matrix with_nan = random_matrix(64, 8, 142);
  with_nan(5, 3) = std::numeric_limits<float>::quiet_NaN();
  mxscope::quantize_options options;
  options.format = *mxscope::parse_format("fp8_e4m3");
  options.axis = 0;
  const quantized_tensor finite = mxscope::quantize(random_matrix(64, 8, 143), options);
  const quantized_tensor nan = mxscope::quantize(with_nan, options);
  const auto block = mxscope::parse_accumulation_model("fp32-block");
  EXPECT_TRUE(mxscope::detail::per_tensor_by_unit_scales_applies(finite, finite, block));
  EXPECT_FALSE(mxscope::detail::per_tensor_by_unit_scales_applies(finite, nan, block));
  options.format = *mxscope::parse_format("mxfp8_e4m3");
  EXPECT_FALSE(mxscope::detail::per_tensor_by_unit_scales_applies(finite, mxscope::quantize(random_matrix(64, 8, 143), options), block));
}

// round_scaled_exact against the long accumulator on random sums and scales, and on sums built so
// that sum * scale rounds in fp64 to an exact fp32 midpoint with a nonzero remainder (where the
// sign of the remainder decides the fp32 result).
// The exact model of per-tensor operands whose unscaled sum need not be an fp64 value (an e5m2
// operand): binade parts multiplied as MX operands (e5m2 against e4m3: three windows carried as
// e4m3; e5m2 against e5m2: e5m2 parts), then one scaled rounding. Against the per-entry
// definition (accumulation_path::generic) bit for bit, on data that fills many binades, for every
// pairing with e5m2, both axes and both output roundings; and on a sum built to need the long
// accumulator (two parts whose exact total has 64 significant bits).
TEST(PerTensor, ExactByBinadePartsIsTheDefinition) {
  struct pairing {
    std::string_view a, b;
    std::size_t parts;  // at K = 100 (per_tensor_exact_parts)
    std::string_view carrier;  // the parts' element format
  };
  const mxscope::accumulation_model exact = mxscope::parse_accumulation_model("exact");
  mxscope::gemm_options generic;
  generic.path = mxscope::accumulation_path::generic;
  for (const bool extreme : {false, true}) {
    const layer_tensors layer = random_layer(100, 36, 28, extreme ? 150 : 151, extreme);
    for (const auto& [format_a, format_b, parts, carrier] :
         {pairing{"fp8_e5m2", "fp8_e4m3", 3, "fp8_e4m3"}, pairing{"fp8_e4m3", "fp8_e5m2", 3, "fp8_e4m3"},
          pairing{"fp8_e5m2", "fp8_e5m2", 3, "fp8_e5m2"}}) {
      for (const int axis : {0, 1}) {
        const auto [a, b] = per_tensor_operands(layer, format_a, format_b, axis);
        const auto route = mxscope::detail::per_tensor_exact_parts_route(a, b, exact);
        ASSERT_TRUE(route.has_value()) << format_a << " x " << format_b;
        ASSERT_EQ(route->parts.size(), parts) << format_a << " x " << format_b;
        for (const auto& part : route->parts) {
          EXPECT_EQ(part.kind, mxscope::parse_format(carrier)->element) << format_a << " x " << format_b;
        }
        EXPECT_EQ(route->split_a, format_a == "fp8_e5m2");
        for (const auto output : {mxscope::output_rounding::fp32, mxscope::output_rounding::bf16}) {
          const std::string what = fmt::format("{} x {} axis {} {}{}", format_a, format_b, axis,
                                               output == mxscope::output_rounding::bf16 ? "bf16" : "fp32",
                                               extreme ? " extreme" : "");
          const auto by_parts = mxscope::emulate_product(a, b, exact, output);
          const auto definition = mxscope::emulate_product(a, b, exact, output, generic);
          expect_same_bits(definition.out, by_parts.out, what);
          ASSERT_EQ(definition.exact.size(), by_parts.exact.size()) << what;
          for (std::int64_t i = 0; i < definition.exact.size(); ++i) {
            ASSERT_TRUE(oracle::same(definition.exact.values[i], by_parts.exact.values[i])) << what << " fp64 entry " << i;
          }
        }
      }
    }
  }
  // A sum the parts split at an fp32 midpoint: the high part's 32768^2 + 8^2 = 2^30 + 64 lies halfway
  // between the fp32 numbers 2^30 and 2^30 + 128, and the low part's 2^-9 2^-16 = 2^-25 decides it
  // upwards. Their total has 56 significant bits, so it reaches the long accumulator; a rounding of
  // the parts' fp64 sum, or one part reaching down to 2^-9 (beyond the fp64 bound at K = 5), would
  // give 2^30. The 57344s (each paired with a zero) make both tensor scales 1.
  matrix left(5, 1), right(5, 1);
  const float left_values[5] = {32768.0f, 8.0f, 0x1p-9f, 57344.0f, 0.0f};
  const float right_values[5] = {32768.0f, 8.0f, 0x1p-16f, 0.0f, 57344.0f};
  for (std::int64_t k = 0; k < 5; ++k) {
    left(k, 0) = left_values[k];
    right(k, 0) = right_values[k];
  }
  mxscope::quantize_options options;
  options.format = *mxscope::parse_format("fp8_e5m2");
  options.axis = 0;
  const quantized_tensor qa = mxscope::quantize(left, options);
  const quantized_tensor qb = mxscope::quantize(right, options);
  ASSERT_EQ(qa.tensor_scale, 1.0f);
  ASSERT_EQ(qb.tensor_scale, 1.0f);
  const auto route = mxscope::detail::per_tensor_exact_parts_route(qa, qb, exact);
  ASSERT_TRUE(route.has_value());
  ASSERT_EQ(route->parts.size(), 2U);
  const auto by_parts = mxscope::emulate_product(qa, qb, exact);
  const auto definition = mxscope::emulate_product(qa, qb, exact, mxscope::output_rounding::fp32, generic);
  expect_same_bits(definition.out, by_parts.out, "crafted e5m2 x e5m2 midpoint");
  EXPECT_EQ(by_parts.out.values[0], 0x1p30f + 128.0f);
  EXPECT_EQ(by_parts.exact.values[0], 0x1p30 + 64.0);
  EXPECT_TRUE(oracle::same(definition.exact.values[0], by_parts.exact.values[0]));
}

// fp32-block and fp32-group on per-tensor operands the integer fast path does not cover (an e5m2
// operand): the short-float product (fp64 block dots where the rows' exponent spreads allow, the
// per-entry definition elsewhere, then alpha) against the per-entry definition itself.
TEST(PerTensor, ShortFloatBlocksAreTheDefinition) {
  struct pairing {
    std::string_view a, b;
  };
  mxscope::gemm_options generic;
  generic.path = mxscope::accumulation_path::generic;
  for (const bool extreme : {false, true}) {
    const layer_tensors layer = random_layer(100, 36, 28, extreme ? 160 : 161, extreme);
    for (const auto& [format_a, format_b] : {pairing{"fp8_e5m2", "fp8_e4m3"}, pairing{"fp8_e4m3", "fp8_e5m2"},
                                             pairing{"fp8_e5m2", "fp8_e5m2"}}) {
      for (const int axis : {0, 1}) {
        const auto [a, b] = per_tensor_operands(layer, format_a, format_b, axis);
        ASSERT_NE(a.tensor_scale, 1.0f);
        for (const std::string_view name : {"fp32-block", "fp32-group:3"}) {
          const mxscope::accumulation_model model = mxscope::parse_accumulation_model(name);
          for (const auto output : {mxscope::output_rounding::fp32, mxscope::output_rounding::bf16}) {
            const std::string what = fmt::format("{} x {} axis {} {} {}{}", format_a, format_b, axis, name,
                                                 output == mxscope::output_rounding::bf16 ? "bf16" : "fp32",
                                                 extreme ? " extreme" : "");
            const auto fast = mxscope::emulate_product(a, b, model, output);
            const auto definition = mxscope::emulate_product(a, b, model, output, generic);
            expect_same_bits(definition.out, fast.out, what);
          }
        }
      }
    }
  }
  // One block whose exact dot needs 55 bits: thirty products 57344 x 448, one 32 x 1 and one
  // 2^-16 x 2^-9. The first 31 sum to 770703392, halfway between the fp32 numbers 770703360 and
  // 770703424, and 2^-25 decides it upwards; an fp64 sum of the block would round that 2^-25 away
  // and give 770703360 (ties to even). The rows' spreads (31 and 17 binades) exceed the budget, so
  // the entry is redone by the definition, which the fallback count shows.
  matrix left(32, 1), right(32, 1);
  for (std::int64_t k = 0; k < 30; ++k) {
    left(k, 0) = 57344.0f;
    right(k, 0) = 448.0f;
  }
  left(30, 0) = 32.0f;
  right(30, 0) = 1.0f;
  left(31, 0) = 0x1p-16f;
  right(31, 0) = 0x1p-9f;
  mxscope::quantize_options options;
  options.format = *mxscope::parse_format("fp8_e5m2");
  options.axis = 0;
  const quantized_tensor qa = mxscope::quantize(left, options);
  options.format = *mxscope::parse_format("fp8_e4m3");
  const quantized_tensor qb = mxscope::quantize(right, options);
  ASSERT_EQ(qa.tensor_scale, 1.0f);
  ASSERT_EQ(qb.tensor_scale, 1.0f);
  const mxscope::accumulation_model block = mxscope::parse_accumulation_model("fp32-block");
  const auto fast = mxscope::emulate_product(qa, qb, block);
  const auto definition = mxscope::emulate_product(qa, qb, block, mxscope::output_rounding::fp32, generic);
  EXPECT_EQ(definition.out.values[0], 770703424.0f);
  EXPECT_EQ(fast.out.values[0], 770703424.0f);
  EXPECT_EQ(fast.fallback_entries, 1);
}

TEST(PerTensor, RoundScaledExactIsCorrectlyRounded) {
  std::mt19937_64 generator(144);
  std::uniform_real_distribution<double> unit(0.5, 1.0);
  std::uniform_int_distribution<int> exponent(-60, 60);
  const auto oracle_of = [](double sum, float sa, float sb) {
    // sa * sb is exact in fp64; Boost's integers give the exact product and its roundings.
    const auto exact = oracle::product(sum, static_cast<double>(sa) * static_cast<double>(sb));
    return std::pair{oracle::round_to_float(exact), oracle::round_to_double(exact)};
  };
  int midpoints = 0;
  for (int trial = 0; trial < 100000; ++trial) {
    float sa = static_cast<float>(std::ldexp(unit(generator), exponent(generator)));
    float sb = static_cast<float>(std::ldexp(unit(generator), exponent(generator)));
    double sum = std::ldexp(unit(generator), exponent(generator)) * (trial % 2 == 0 ? 1 : -1);
    if (trial % 4 >= 2) {
      // A midpoint between two fp32 values (25 significant bits, the last one set), divided by the
      // scale: the product lands on or next to it.
      sb = 1.0f;
      sa = 3.0f;
      const double midpoint = std::ldexp(static_cast<double>((std::uint64_t{1} << 24) + 2 * (trial % 4096) + 1),
                                         exponent(generator) - 24);
      sum = midpoint / 3.0;
      const double high = sum * 3.0;
      if (high == midpoint && std::fma(sum, 3.0, -high) != 0.0) ++midpoints;
    }
    const auto [fp32, fp64] = oracle_of(sum, sa, sb);
    const auto rounded = mxscope::detail::round_scaled_exact(sum, sa, sb);
    ASSERT_TRUE(oracle::same(fp32, rounded.fp32)) << std::hexfloat << sum << " " << sa << " " << sb;
    ASSERT_TRUE(oracle::same(fp64, rounded.fp64)) << std::hexfloat << sum << " " << sa << " " << sb;
  }
  EXPECT_GT(midpoints, 1000);  // the hard case was exercised
}

TEST(FastPath, NanBlocksPropagate) {
  layer_tensors layer = random_layer(64, 8, 8, 130);
  layer.dy(5, 3) = NAN;  // wgrad: dy's block (tokens 0..31, column 3) becomes a NaN block
  const auto result = mxscope::run_gemm(gemm_kind::wgrad, layer.operands(), make_strategy("mxfp4", "mxfp4", "fp32-block"), context);
  for (std::int64_t i = 0; i < 8; ++i) {
    for (std::int64_t o = 0; o < 8; ++o) {
      EXPECT_EQ(std::isnan(result.out(o, i)), o == 3) << where("dw", o, i);
    }
  }
}

// gemm_options::exact_too: run_gemm's exact product of the quantized operands, which the int16
// kernels compute in the same pass as an fp32-block product (fp32-group of one block too), and a
// second product everywhere else. Both results against the per-entry definition bit for bit, on
// ordinary data, data over many binades (slow steps), data with a NaN block and data whose fp64
// running sum is inexact (dw entry (0, 0) = 1 + 2^-60 - 1 over three blocks, which only the exact
// recomputation gets right); and the fused pass must have run where it applies (no separate exact
// product time).
TEST(FastPath, ExactTooIsTheDefinitionOfBothModels) {
  struct pairing {
    std::string_view a, b;
    bool kernel;  // a fused kernel applies: int16 (element integers below 2^15, block dots below
                  // 2^24; NVFP4 with its scales' mantissas folded into the elements) or wide (e4m3
                  // pairs: block dots below 2^53 in fp64, power-of-two scales)
  };
  const pairing pairings[] = {{"mxfp4", "mxfp4", true},
                              {"mxfp6_e2m3", "mxfp6_e3m2", true},
                              {"mxint8", "mxfp4", true},
                              {"mxfp8_e4m3", "mxfp8_e4m3", true},
                              {"fp8_e4m3", "fp8_e4m3", true},
                              {"nvfp4", "nvfp4", true},
                              {"mxfp8_e5m2", "mxfp8_e4m3", false}};
  const mxscope::gemm_options generic = gemm_options_of(mxscope::accumulation_path::generic);
  for (const int data : {0, 1, 2, 3}) {
    layer_tensors layer = random_layer(100, 36, 28, 160 + data, data == 1);
    if (data == 2) layer.dy(40, 5) = NAN;  // wgrad: a NaN block in dy's column 5; fprop: in A's row
    if (data == 3) {
      for (std::int64_t k = 0; k < 100; ++k) layer.dy(k, 0) = layer.x(k, 0) = 0.0f;
      layer.dy(0, 0) = layer.x(0, 0) = 1.0f;
      layer.dy(32, 0) = layer.x(32, 0) = 0x1p-30f;
      layer.dy(64, 0) = -1.0f;
      layer.x(64, 0) = 1.0f;
    }
    for (const auto& [format_a, format_b, kernel] : pairings) {
      const bool e4m3 = format_a.ends_with("fp8_e4m3") && format_b.ends_with("fp8_e4m3");
      for (const char* isa : wide_kernels) {
        if (isa != nullptr && !e4m3) continue;  // the AVX2 pass is for the wide kernel
        const wide_kernel_on scope(isa);
        for (const std::string_view model : {"fp32-block", "fp32-group:1", "fp32-group:3"}) {
          for (const gemm_kind kind : {gemm_kind::wgrad, gemm_kind::fprop}) {
            const std::string what = fmt::format("{} x {} {} {} data {}{}", format_a, format_b, model,
                                                 mxscope::gemm_kind_name(kind), data, isa == nullptr ? "" : " avx2");
            mxscope::gemm_options options;
            options.exact_too = true;
            const auto both = mxscope::run_gemm(kind, layer.operands(), make_strategy(format_a, format_b, model), context, options);
            const auto definition =
                mxscope::run_gemm(kind, layer.operands(), make_strategy(format_a, format_b, model), context, generic);
            const auto exact_definition =
                mxscope::run_gemm(kind, layer.operands(), make_strategy(format_a, format_b, "exact"), context, generic);
            expect_same_bits(definition.out, both.out, what);
            ASSERT_EQ(both.exact_of_quantized.size(), exact_definition.exact.size()) << what;
            for (std::int64_t i = 0; i < both.exact_of_quantized.size(); ++i) {
              ASSERT_TRUE(oracle::same(exact_definition.exact.values[i], both.exact_of_quantized.values[i]))
                  << what << " fp64 entry " << i;
            }
            const bool per_tensor = format_a.starts_with("fp8");
            // (Per-tensor scaling flushes 2^-30 next to 1, and so do NVFP4's ue4m3 block scales.)
            if (data == 3 && kind == gemm_kind::wgrad && format_a.starts_with("mx")) {
              ASSERT_EQ(exact_definition.exact(0, 0), 0x1p-60) << what;
            }
            // A per-tensor operand with a NaN element (dy in wgrad) takes the generic path.
            const bool nan_element = per_tensor && data == 2 && kind == gemm_kind::wgrad;
            const bool fused = kernel && model != "fp32-group:3" && !nan_element &&
                               __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
            EXPECT_EQ(both.exact_product_seconds == 0.0, fused) << what;
          }
        }
      }
    }
  }
}

// The wide kernel's fp32-block step adds a block dot of up to 42 bits to the fp32 accumulator in
// fp64, where the sum can need more than 53 bits: rounded to nearest in fp64 it can land on an fp32
// midpoint that the exact sum is not on, and round again the wrong way. MXFP8 dw entries built for
// it, at c = 0 and c = 17 (20 columns: AVX-512 takes panels 0 and 1 together, panel 2 alone):
// (c, c) = 1 + (2^-24 + 2^-58), exactly above the midpoint 1 + 2^-24 (fl32: 1 + 2^-23; rounding
// twice gives 1); (c + 1, c + 1) = (1 + 2^-23) + (2^-24 - 2^-58), exactly below the midpoint
// 1 + 3 2^-24 (fl32: 1 + 2^-23; rounding twice gives 1 + 2^-22). Each block dot is an exact e4m3
// dot: the block of 2^-12 and 2^-29 has the scale 2^-20 and the elements 2^8 and 2^-9.
TEST(FastPath, WideKernelRoundsEachBlockStepOnce) {
  layer_tensors layer = random_layer(96, 20, 20, 170);
  for (const std::int64_t c : {0, 17}) {
    for (std::int64_t k = 0; k < 96; ++k) {
      for (std::int64_t d = c; d < c + 2; ++d) layer.dy(k, d) = layer.x(k, d) = 0.0f;
    }
    layer.dy(0, c) = layer.x(0, c) = 1.0f;
    layer.dy(32, c) = layer.x(32, c) = 0x1p-12f;
    layer.dy(33, c) = layer.x(33, c) = 0x1p-29f;
    layer.dy(0, c + 1) = layer.x(0, c + 1) = 1.0f;
    layer.dy(32, c + 1) = 0x1p-11f;
    layer.x(32, c + 1) = 0x1p-12f;
    layer.dy(64, c + 1) = layer.x(64, c + 1) = 0x1p-12f;
    layer.dy(65, c + 1) = -0x1p-29f;
    layer.x(65, c + 1) = 0x1p-29f;
  }
  const mxscope::strategy chosen = make_strategy("mxfp8_e4m3", "mxfp8_e4m3", "fp32-block");
  const auto definition =
      mxscope::run_gemm(gemm_kind::wgrad, layer.operands(), chosen, context, gemm_options_of(mxscope::accumulation_path::generic));
  const auto exact_definition = mxscope::run_gemm(gemm_kind::wgrad, layer.operands(),
                                                  make_strategy("mxfp8_e4m3", "mxfp8_e4m3", "exact"), context,
                                                  gemm_options_of(mxscope::accumulation_path::generic));
  for (const std::int64_t c : {0, 17}) {
    EXPECT_EQ(definition.out(c, c), 1.0f + 0x1p-23f);
    EXPECT_EQ(definition.out(c + 1, c + 1), 1.0f + 0x1p-23f);
  }
  for (const char* isa : wide_kernels) {
    const wide_kernel_on scope(isa);
    const std::string what = fmt::format("mxfp8 fp32-block, wide kernel {}", isa == nullptr ? "automatic" : isa);
    mxscope::gemm_options options;
    options.exact_too = true;
    const auto fast = mxscope::run_gemm(gemm_kind::wgrad, layer.operands(), chosen, context, options);
    expect_same_bits(definition.out, fast.out, what);
    ASSERT_EQ(fast.exact_of_quantized.size(), exact_definition.exact.size());
    for (std::int64_t i = 0; i < fast.exact_of_quantized.size(); ++i) {
      ASSERT_TRUE(oracle::same(exact_definition.exact.values[i], fast.exact_of_quantized.values[i]))
          << what << " fp64 entry " << i;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      EXPECT_EQ(fast.exact_product_seconds, 0.0) << what;  // the wide kernel's fused pass ran
    }
  }
}

// The certified kernel of float operands (bf16 here) on entries built for each of its rules, with
// their values computed by hand. Each designed entry (c, c) has its products in blocks of its own
// (K = 7 blocks of 32), so every other entry's block dots are exact zeros with a zero bound:
//   0 (block 0): 2^30 + 1 - 2^-25 - 2^-40 - 2^30; the FMAs lose the small products (d = 1) and
//      only the bound sends the step to the exact sum, which is below 1 - 2^-25: 1 - 2^-24.
//   6 (block 1): 1 - 2^-25 - 2^-80; d is the tie 1 - 2^-25, which rounds up to the power of two
//      1, whose lower rounding boundary is a quarter of its spacing away: 1 - 2^-24.
//   9 (blocks 2, 3): 1.5, then 3 2^-24 - 2^-80 whose d is 3 2^-24: 1.5 + 3 2^-24 is a tie (to
//      1.5 + 2^-22), the exact sum is below it: 1.5 + 2^-23.
//  12 (blocks 4, 5): 1.5, then exactly 3 2^-24 (its grid makes the bound 0): the tie goes to
//      even, 1.5 + 2^-22, without the exact step.
//   3 (block 6, the last): 2^-110 - 2^-200 - 2^-110 = -2^-200: d = +0 with a bound below 2^-151;
//      +0 + D rounds to -0.
TEST(FastPath, CertifiedFloatStepsAreTheDefinition) {
  layer_tensors layer{matrix(224, 15), matrix(224, 15), matrix(15, 15)};
  const auto pair = [&](std::int64_t c, std::int64_t k, float dy, float x) {
    layer.dy(k, c) = dy;
    layer.x(k, c) = x;
  };
  const float p15 = 0x1p15f;
  pair(0, 0, p15, p15);
  pair(0, 1, 1.0f, 1.0f);
  pair(0, 2, -0x1p-13f, 0x1p-12f);
  pair(0, 3, -0x1p-20f, 0x1p-20f);
  pair(0, 4, -p15, p15);
  pair(6, 32, 1.0f, 1.0f);
  pair(6, 33, -0x1p-13f, 0x1p-12f);
  pair(6, 34, -0x1p-40f, 0x1p-40f);
  pair(9, 64, 1.5f, 1.0f);
  pair(9, 96, 0x1.8p-23f, 1.0f);
  pair(9, 97, 0x1p-40f, -0x1p-40f);
  pair(12, 128, 1.5f, 1.0f);
  pair(12, 160, 0x1.8p-23f, 1.0f);
  pair(3, 192, 0x1p-55f, 0x1p-55f);
  pair(3, 193, 0x1p-100f, -0x1p-100f);
  pair(3, 194, -0x1p-55f, 0x1p-55f);
  const mxscope::strategy chosen = make_strategy("bf16", "bf16", "fp32-block");
  const auto definition =
      mxscope::run_gemm(gemm_kind::wgrad, layer.operands(), chosen, context, gemm_options_of(mxscope::accumulation_path::generic));
  matrix expected(15, 15);
  expected(0, 0) = 1.0f - 0x1p-24f;
  expected(3, 3) = -0.0f;
  expected(6, 6) = 1.0f - 0x1p-24f;
  expected(9, 9) = 1.5f + 0x1p-23f;
  expected(12, 12) = 1.5f + 0x1p-22f;
  expect_same_bits(expected, definition.out, "bf16 designed entries, the definition");
  for (const char* isa : wide_kernels) {
    const wide_kernel_on scope(isa);
    const std::string what = fmt::format("bf16 designed entries, wide kernel {}", isa == nullptr ? "automatic" : isa);
    const auto fast = mxscope::run_gemm(gemm_kind::wgrad, layer.operands(), chosen, context);
    expect_same_bits(expected, fast.out, what);
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      EXPECT_EQ(fast.fallback_entries, 4) << what << ": entries 0, 6, 9 and 3 take one exact step each";
    }
  }
}

// The certified kernel against the definition on bf16 data built to stress it: small-integer
// significands over four binades 10 apart (exact dots, fp32 ties), and in every other block a pair
// of 2^40-sized products that cancel exactly around the small ones (the FMAs lose those, so the
// bound decides, or the exact step). Both tiles, wgrad and fprop.
TEST(FastPath, CertifiedFloatStepsOnTiesAndCancellations) {
  std::mt19937_64 random(181);
  std::uniform_int_distribution<int> significand(1, 255);
  std::uniform_int_distribution<int> binade(0, 3);
  std::uniform_int_distribution<int> coin(0, 1);
  const auto value = [&] {
    const float magnitude = std::ldexp(static_cast<float>(significand(random)), 10 * binade(random) - 40);
    return coin(random) != 0 ? -magnitude : magnitude;
  };
  layer_tensors layer{matrix(256, 24), matrix(256, 20), matrix(20, 24)};
  for (matrix* m : {&layer.x, &layer.dy}) {
    for (float& v : m->values) v = value();
  }
  for (std::int64_t block = 0; block < 8; block += 2) {
    const std::int64_t k = block * 32 + 4;
    for (std::int64_t c = 0; c < 24; ++c) {
      layer.x(k, c) = std::ldexp(static_cast<float>(significand(random)), 32);
      layer.x(k + 2, c) = -layer.x(k, c);
    }
    for (std::int64_t c = 0; c < 20; ++c) layer.dy(k, c) = layer.dy(k + 2, c) = std::ldexp(static_cast<float>(significand(random)), 8);
  }
  for (const gemm_kind kind : {gemm_kind::wgrad, gemm_kind::fprop}) {
    const mxscope::strategy chosen = make_strategy("bf16", "bf16", "fp32-block");
    const auto definition =
        mxscope::run_gemm(kind, layer.operands(), chosen, context, gemm_options_of(mxscope::accumulation_path::generic));
    for (const char* isa : wide_kernels) {
      const wide_kernel_on scope(isa);
      const std::string what = fmt::format("bf16 stress {} {}", mxscope::gemm_kind_name(kind), isa == nullptr ? "automatic" : isa);
      const auto fast = mxscope::run_gemm(kind, layer.operands(), chosen, context);
      expect_same_bits(definition.out, fast.out, what);
      if (kind == gemm_kind::wgrad && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        EXPECT_GT(fast.fallback_entries, 0) << what << ": the cancelling blocks must take the exact step";
      }
    }
  }
}

// gemm_options::known_exact_host (the replay's exact reference of the captured tensors) stands in
// for exact_too's product only where both quantized operands are those tensors' values: a poisoned
// known product shows whether it was taken.
TEST(FastPath, KnownExactProductIsTakenOnlyForTheSameValues) {
  layer_tensors captured = random_layer(96, 12, 10, 175);
  for (matrix* m : {&captured.x, &captured.dy}) {
    for (float& v : m->values) v = mxscope::core::bf16_to_float(mxscope::core::float_to_bf16(v, mxscope::core::rounding_mode::rne));
  }
  const layer_tensors unrounded = random_layer(96, 12, 10, 175);
  mxscope::matrix64 poison(10, 12);
  std::fill(poison.values.begin(), poison.values.end(), 42.0);
  const auto run = [&](const layer_tensors& layer, std::string_view format, const matrix* known_a) {
    mxscope::gemm_options options;
    options.exact_too = true;
    options.known_exact_host = mxscope::gemm_options::known_exact_on_host{known_a, &layer.x, &poison};
    return mxscope::run_gemm(gemm_kind::wgrad, layer.operands(), make_strategy(format, format, "fp32-block"), context,
                             options);
  };
  const auto computed = [&](const layer_tensors& layer, std::string_view format) {
    return mxscope::run_gemm(gemm_kind::wgrad, layer.operands(), make_strategy(format, format, "exact"), context).exact;
  };
  const auto same = [](const mxscope::matrix64& x, const mxscope::matrix64& y) {
    return x.values.size() == y.values.size() &&
           std::equal(x.values.begin(), x.values.end(), y.values.begin(),
                      [](double p, double q) { return std::bit_cast<std::uint64_t>(p) == std::bit_cast<std::uint64_t>(q); });
  };
  // bf16 of a bf16-valued capture: the same values, the known product taken.
  EXPECT_TRUE(same(run(captured, "bf16", &captured.dy).exact_of_quantized, poison));
  // fp32 operands are the captured values too.
  EXPECT_TRUE(same(run(captured, "fp32", &captured.dy).exact_of_quantized, poison));
  // bf16 of fp32 values that bf16 rounds: other operands, the product computed.
  EXPECT_TRUE(same(run(unrounded, "bf16", &unrounded.dy).exact_of_quantized, computed(unrounded, "bf16")));
  // A quantized format, and a known product of other tensors: computed.
  EXPECT_TRUE(same(run(captured, "mxfp8_e4m3", &captured.dy).exact_of_quantized, computed(captured, "mxfp8_e4m3")));
  EXPECT_TRUE(same(run(captured, "bf16", &unrounded.dy).exact_of_quantized, computed(captured, "bf16")));
}

TEST(Threads, ResultsDoNotDependOnTheThreadCount) {
  // 260 x 130 x 132 = 4.46M products: above the size from which the GEMM runs on several threads
  // (2^22 products; smaller problems stay on one thread).
  const layer_tensors layer = random_layer(260, 130, 132, 140, true);
  const int saved = omp_get_max_threads();
  for (const std::string_view model : {"fp32-block", "fp32-group:4", "exact", "trunc-align:13,2", "fp32-seq"}) {
    for (const std::string_view format : {"mxfp4", "bf16"}) {
      const mxscope::strategy chosen = make_strategy(format, format, model);
      omp_set_num_threads(1);
      const auto one = mxscope::run_gemm(gemm_kind::wgrad, layer.operands(), chosen, context);
      omp_set_num_threads(2);
      const auto two = mxscope::run_gemm(gemm_kind::wgrad, layer.operands(), chosen, context);
      expect_same_bits(one.out, two.out, fmt::format("{} {} threads 1 vs 2", format, model));
    }
  }
  omp_set_num_threads(saved);
}

// ------------------------------------------------------------------------------------------------
// Bad inputs.

template <class Action>
void expect_input_error(Action&& action, std::string_view needle, std::string_view what) {
  try {
    action();
    ADD_FAILURE() << what << ": no error";
  } catch (const mxscope::input_error& error) {
    EXPECT_NE(std::string(error.what()).find(needle), std::string::npos)
        << what << ": message does not name '" << needle << "': " << error.what();
  }
}

TEST(BadInputs, AreInputErrorsNamingTheField) {
  const layer_tensors layer = random_layer(64, 16, 32, 150);
  // Blocks along K differ: MXFP4 (32) against NVFP4 (16).
  expect_input_error(
      [&] { mxscope::run_gemm(gemm_kind::wgrad, layer.operands(), make_strategy("mxfp4", "nvfp4", "fp32-block"), context); },
      "block", "block mismatch");
  // Shapes: x [K, n_in], dy [K, n_out], w [n_out, n_in].
  const matrix x(4, 8), w(3, 7), dy(5, 3), w_dgrad(6, 3);
  expect_input_error([&] { mxscope::run_gemm(gemm_kind::fprop, {&x, nullptr, &w}, make_strategy("mxfp4", "mxfp4", "exact"), context); },
                     "on n_in", "fprop shapes");
  expect_input_error([&] { mxscope::run_gemm(gemm_kind::wgrad, {&x, &dy, nullptr}, make_strategy("mxfp4", "mxfp4", "exact"), context); },
                     "on K", "wgrad shapes");
  expect_input_error(
      [&] { mxscope::run_gemm(gemm_kind::dgrad, {nullptr, &dy, &w_dgrad}, make_strategy("mxfp4", "mxfp4", "exact"), context); },
      "on n_out", "dgrad shapes");
  // Missing operand.
  expect_input_error([&] { mxscope::run_gemm(gemm_kind::fprop, {&x, &dy, nullptr}, make_strategy("mxfp4", "mxfp4", "exact"), context); },
                     "'w'", "missing w");
  // A rotation that does not divide the reduction length (K = 64 here, n_out = 32 for dgrad).
  expect_input_error(
      [&] {
        mxscope::run_gemm(gemm_kind::dgrad, layer.operands(), make_strategy("mxfp4", "mxfp4", "exact", 64, mxscope::sign_policy::none),
                          context);
      },
      "rotation", "rotation size");
  // Unknown model string.
  expect_input_error([] { mxscope::parse_accumulation_model("fp64-block"); }, "accum", "unknown model");
}

}  // namespace
