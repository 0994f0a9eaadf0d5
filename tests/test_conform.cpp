// Hardware conformance (src/conform.cpp, mxscope conform) on synthetic hardware whose behaviour the
// test decides:
// - GEMM outputs produced by a known accumulation model (the library's generic per-entry
//   definition, proven against Boost.Multiprecision oracles in test_gemm) must be identified by the
//   fit: the fitted model reproduces 100% and the generating model is among the tied ones.
//   Outputs with a few corrupted bits must be reported as such, with exactly those entries listed.
// - Hardware codes produced with a flipped tie rule or the ceil scale rule must be identified by the
//   quantizer fit; the mismatch counts are checked against midpoints and block maxima the test
//   places itself, with the fp4 value table typed from the OCP spec.
// - The shipped H200 capture (data/conformance/h200) reproduces under its documented models.
#include <gtest/gtest.h>

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <tuple>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "mxscope/cli/cli.hpp"
#include "mxscope/conform.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/io/safetensors.hpp"
#include "python_runner.hpp"
#include "support/temporary_directory.hpp"

namespace {

namespace fs = std::filesystem;
using mxscope::matrix;
using mxscope::quantized_tensor;
namespace conform = mxscope::conform;

// The synthetic cases are tiny: one thread avoids the cost of waking a thread team for each of the
// few hundred products a fit runs (results do not depend on the thread count).
const bool single_thread = [] {
  omp_set_num_threads(1);
  return true;
}();

std::uint32_t bits_of(float value) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

float from_bits(std::uint32_t bits) {
  float value = 0.0f;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}


struct cli_result {
  int code = 0;
  std::string out;
  std::string err;
};

cli_result run_cli(std::vector<std::string> arguments) {
  arguments.insert(arguments.begin(), "mxscope");
  std::vector<const char*> argv;
  for (const auto& argument : arguments) argv.push_back(argument.c_str());
  std::ostringstream out;
  std::ostringstream err;
  cli_result result;
  result.code = mxscope::cli::run(static_cast<int>(argv.size()), argv.data(), out, err);
  result.out = out.str();
  result.err = err.str();
  return result;
}

// ------------------------------------------------------------------------------------------------
// Synthetic GEMM hardware.

// Gaussian values whose 32-element blocks have magnitudes 2^e with e drawn from [-12, 12], so the
// block contributions span many binades and the accumulation models disagree on many outputs.
matrix wide_range_matrix(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  std::mt19937_64 random(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_int_distribution<int> exponent(-12, 12);
  matrix out(rows, cols);
  for (std::int64_t r = 0; r < rows; ++r) {
    int e = 0;
    for (std::int64_t c = 0; c < cols; ++c) {
      if (c % 32 == 0) e = exponent(random);
      out(r, c) = static_cast<float>(std::ldexp(normal(random), e));
    }
  }
  return out;
}

quantized_tensor mx_operand(const matrix& values, const char* format) {
  mxscope::quantize_options options;
  options.format = *mxscope::parse_format(format);
  options.block = 32;
  options.axis = 1;
  return mxscope::quantize(values, options);
}

conform::gemm_case synthetic_case(const std::string& model_text, const char* format, std::uint64_t seed,
                                  std::int64_t m = 12, std::int64_t n = 10, std::int64_t k = 512) {
  conform::gemm_case one;
  one.name = model_text + " " + format;
  one.kind = "product";
  if (std::string(format) == "fp32") {
    one.a = conform::plain_operand(wide_range_matrix(m, k, seed));
    one.b = conform::plain_operand(wide_range_matrix(n, k, seed + 1));
  } else {
    one.a = mx_operand(wide_range_matrix(m, k, seed), format);
    one.b = mx_operand(wide_range_matrix(n, k, seed + 1), format);
  }
  mxscope::gemm_options generic;
  generic.path = mxscope::accumulation_path::generic;
  one.out = mxscope::emulate_product(one.a, one.b, mxscope::parse_accumulation_model(model_text),
                                     mxscope::output_rounding::fp32, generic)
                .out;
  return one;
}

class fit_identifies : public ::testing::TestWithParam<const char*> {};

TEST_P(fit_identifies, the_generating_model_with_every_output_matching) {
  const std::string truth = mxscope::accumulation_model_name(mxscope::parse_accumulation_model(GetParam()));
  // fp4 for every model; fp8 (24 products of 8 bits, wider block dots) for the first few.
  const bool with_fp8 = std::string(GetParam()).rfind("trunc-align:1", 0) == 0 ||
                        std::string(GetParam()).rfind("trunc-promote:", 0) == 0 || std::string(GetParam()) == "fp32-block";
  for (const char* format : {"mxfp4", "mxfp8_e4m3"}) {
    if (std::string(format) == "mxfp8_e4m3" && !with_fp8) continue;
    const std::vector<conform::gemm_case> cases = {synthetic_case(truth, format, 21, 12, 10, 256),
                                                   synthetic_case(truth, format, 77, 6, 9, 128)};
    const auto family = conform::fit_family();
    const conform::gemm_fit fit = conform::fit_gemm(cases, family);
    ASSERT_FALSE(fit.finalists.empty());
    const auto& best = fit.finalists.front();
    EXPECT_TRUE(best.exact()) << "truth " << truth << " format " << format << ": best " << best.name << " matches "
                              << best.matches << " of " << best.compared;
    EXPECT_EQ(best.compared, 12 * 10 + 6 * 9);
    EXPECT_NE(std::find(fit.tied.begin(), fit.tied.end(), truth), fit.tied.end())
        << "truth " << truth << " format " << format << " not among the tied models (best " << best.name << ")";
    // Every tied model really reproduces every output, and the data tell most of the family apart.
    for (const auto& name : fit.tied) {
      const auto agreement = conform::check_model(cases, mxscope::parse_accumulation_model(name));
      EXPECT_TRUE(agreement.exact()) << name << " listed as tied for " << truth;
    }
    EXPECT_LT(fit.tied.size(), family.size() / 4) << "synthetic data too weak to discriminate models for " << truth;
  }
}

INSTANTIATE_TEST_SUITE_P(models, fit_identifies,
                         ::testing::Values("exact", "fp32-block", "fp32-group:2", "fp32-group:4", "fp32-seq",
                                           "trunc-align:10,1,rtz", "trunc-align:14,1,rtz", "trunc-align:16,4,rne",
                                           "trunc-align:23,2,rtz", "trunc-align:25,8,rne",
                                           // the H200 fp8 and bf16 fits (docs/conformance.md) and a third setting
                                           "trunc-promote:13,32,14,128", "trunc-promote:25,16,24",
                                           "trunc-promote:14,16,16,64"));

TEST(gemm_conformance, plain_fp32_operands_are_fitted_too) {
  const std::vector<conform::gemm_case> cases = {synthetic_case("trunc-align:13,1,rtz", "fp32", 5)};
  const conform::gemm_fit fit = conform::fit_gemm(cases, conform::fit_family());
  ASSERT_TRUE(fit.exact()) << fit.finalists.front().name;
  EXPECT_NE(std::find(fit.tied.begin(), fit.tied.end(), "trunc-align:13,1,rtz"), fit.tied.end());
}

TEST(gemm_conformance, corrupted_outputs_are_reported_not_fitted) {
  std::vector<conform::gemm_case> cases = {synthetic_case("fp32-block", "mxfp4", 33)};
  // Flip the last significand bit of three outputs (the hardware "got them wrong").
  const std::vector<std::pair<std::int64_t, std::int64_t>> corrupted = {{0, 0}, {5, 7}, {11, 9}};
  for (const auto& [row, col] : corrupted) {
    float& value = cases[0].out(row, col);
    value = from_bits(bits_of(value) ^ 1U);
  }
  const conform::gemm_fit fit = conform::fit_gemm(cases, conform::fit_family());
  const auto& best = fit.finalists.front();
  EXPECT_FALSE(fit.exact()) << best.name << " claims every output";
  EXPECT_EQ(best.compared, 120);
  EXPECT_EQ(best.matches, 117) << best.name;
  // fp32-block itself misses exactly the corrupted entries, each by one ulp.
  const auto truth = conform::check_model(cases, mxscope::parse_accumulation_model("fp32-block"), 10);
  EXPECT_EQ(truth.matches, 117);
  EXPECT_EQ(truth.histogram[1], 3);
  EXPECT_EQ(truth.max_ulps, 1U);
  std::set<std::pair<std::int64_t, std::int64_t>> listed;
  for (const auto& entry : truth.worst) listed.insert({entry.row, entry.col});
  EXPECT_EQ(listed, (std::set<std::pair<std::int64_t, std::int64_t>>(corrupted.begin(), corrupted.end())));
}

TEST(gemm_conformance, corrupted_trunc_promote_outputs_are_reported_not_fitted) {
  // The H200 fp8 model on e4m3 operands, K = 256 (two promotions): one output one ulp off, one with
  // a low significand bit flipped, one with its sign flipped.
  const std::string truth = "trunc-promote:13,32,14,128";
  std::vector<conform::gemm_case> cases = {synthetic_case(truth, "mxfp8_e4m3", 35, 12, 10, 256)};
  const std::vector<std::pair<std::int64_t, std::int64_t>> corrupted = {{1, 2}, {6, 3}, {10, 9}};
  cases[0].out(1, 2) = std::nextafter(cases[0].out(1, 2), INFINITY);
  cases[0].out(6, 3) = from_bits(bits_of(cases[0].out(6, 3)) ^ 0x4U);
  cases[0].out(10, 9) = -cases[0].out(10, 9);
  ASSERT_NE(cases[0].out(10, 9), 0.0f);
  const conform::gemm_fit fit = conform::fit_gemm(cases, conform::fit_family());
  const auto& best = fit.finalists.front();
  EXPECT_FALSE(fit.exact()) << best.name << " claims every output";
  EXPECT_EQ(best.compared, 120);
  EXPECT_EQ(best.matches, 117) << best.name;
  EXPECT_EQ(best.name, truth) << "a wrong model explains the 117 untouched outputs as well";
  const auto agreement = conform::check_model(cases, mxscope::parse_accumulation_model(truth), 10);
  EXPECT_EQ(agreement.matches, 117);
  std::set<std::pair<std::int64_t, std::int64_t>> listed;
  for (const auto& entry : agreement.worst) listed.insert({entry.row, entry.col});
  EXPECT_EQ(listed, (std::set<std::pair<std::int64_t, std::int64_t>>(corrupted.begin(), corrupted.end())));
  ASSERT_EQ(agreement.per_case.size(), 1U);
  EXPECT_EQ(agreement.per_case[0].matches, 117);
  EXPECT_EQ(agreement.per_case[0].compared, 120);
}

// Writes cases as a conformance directory (docs/dump-format.md, "GEMM conformance cases").
void write_conformance_directory(const fs::path& directory, const std::vector<conform::gemm_case>& cases) {
  nlohmann::json manifest = {{"format", "mxscope-conformance"},
                             {"version", 1},
                             {"source", {{"hardware", "synthetic"}, {"notes", "test"}}},
                             {"cases", nlohmann::json::array()}};
  int index = 0;
  for (const auto& one : cases) {
    mxscope::io::safetensors_writer writer;
    const auto add_operand = [&](const std::string& name, const quantized_tensor& q) {
      if (q.options.format.scheme == mxscope::quant_scheme::none) {
        writer.add_matrix(name, q.dequantized);
        return;
      }
      writer.add(name + ".codes", mxscope::io::dtype::u8, {q.rows, q.code_row_bytes()}, q.codes);
      writer.add(name + ".scales", mxscope::io::dtype::u8, {q.scale_rows, q.scale_cols}, q.scales);
      writer.set_metadata(name + ".format", mxscope::format_name(q.options.format));
      writer.set_metadata(name + ".block", std::to_string(q.block));
    };
    add_operand("a", one.a);
    add_operand("b", one.b);
    writer.add_matrix("out", one.out);
    for (const auto& [key, value] : one.metadata) writer.set_metadata(key, value);
    writer.set_metadata("mxscope.case", "gemm");
    writer.set_metadata("out.kind", one.kind);
    const std::string file = "case" + std::to_string(index++) + ".safetensors";
    writer.write(directory / file);
    manifest["cases"].push_back({{"name", one.name}, {"file", file}});
  }
  std::ofstream(directory / "manifest.json") << manifest.dump(2);
}

TEST(gemm_conformance, cli_fit_expect_and_exit_codes) {
  const mxscope::testing::temporary_directory scratch("conform-gemm_cli");
  const fs::path& directory = scratch.path();
  std::vector<conform::gemm_case> cases = {synthetic_case("fp32-group:4", "mxfp4", 91),
                                           synthetic_case("fp32-group:4", "fp32", 92, 4, 4, 128)};
  write_conformance_directory(directory, cases);
  const cli_result fitted = run_cli({"conform", directory.string(), "--fit"});
  EXPECT_EQ(fitted.code, 0) << fitted.err;
  EXPECT_NE(fitted.out.find("reproduces every output bit"), std::string::npos) << fitted.out;
  EXPECT_NE(fitted.out.find("fp32-group:4"), std::string::npos) << fitted.out;
  EXPECT_EQ(run_cli({"conform", directory.string(), "--expect", "fp32-group:4"}).code, 0);
  // --cases keeps the cases named by a prefix; the per-case counts list exactly those.
  const cli_result one_case = run_cli({"conform", directory.string(), "--cases", "fp32-group:4 fp32", "--expect",
                                       "fp32-group:4"});
  EXPECT_EQ(one_case.code, 0) << one_case.err;
  EXPECT_NE(one_case.out.find(": 1 cases, 16 outputs"), std::string::npos) << one_case.out;
  EXPECT_NE(one_case.out.find("per case, fp32-group:4:"), std::string::npos) << one_case.out;
  EXPECT_EQ(one_case.out.find("case fp32-group:4 mxfp4"), std::string::npos) << one_case.out;
  const cli_result no_case = run_cli({"conform", directory.string(), "--cases", "bf16_"});
  EXPECT_EQ(no_case.code, 2);
  EXPECT_NE(no_case.err.find("--cases"), std::string::npos) << no_case.err;
  const cli_result wrong = run_cli({"conform", directory.string(), "--expect", "fp32-block"});
  EXPECT_EQ(wrong.code, 1) << wrong.out << wrong.err;
  EXPECT_NE(wrong.err.find("check failed"), std::string::npos) << wrong.err;

  // One corrupted output: the fit says so plainly and lists the entry.
  cases[0].out(3, 4) = from_bits(bits_of(cases[0].out(3, 4)) ^ 0x10U);
  write_conformance_directory(directory, cases);
  const cli_result corrupted = run_cli({"conform", directory.string(), "--fit"});
  EXPECT_EQ(corrupted.code, 0) << corrupted.err;
  EXPECT_NE(corrupted.out.find("no model of the family reproduces every output"), std::string::npos) << corrupted.out;
  EXPECT_EQ(run_cli({"conform", directory.string(), "--expect", "fp32-group:4"}).code, 1);

  // Bad input: out with the wrong shape is an input error (exit 2) naming the field.
  cases[0].out = matrix(3, 3);
  write_conformance_directory(directory, cases);
  const cli_result bad = run_cli({"conform", directory.string()});
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("out.shape"), std::string::npos) << bad.err;
}

// Two hardware paths in one directory (as the H200 capture holds fp8 and bf16 GEMMs): no single
// model reproduces both, and --fit fits each path on its own and names its exact model.
TEST(gemm_conformance, fit_is_one_per_hardware_path) {
  const mxscope::testing::temporary_directory scratch("conform-gemm_paths");
  const fs::path& directory = scratch.path();
  std::vector<conform::gemm_case> cases = {
      synthetic_case("fp32-group:4", "mxfp4", 71), synthetic_case("trunc-align:13,1,rtz", "mxfp4", 72),
      synthetic_case("fp32-group:4", "mxfp8_e4m3", 73), synthetic_case("trunc-align:13,1,rtz", "mxfp8_e4m3", 74)};
  for (auto& one : cases) {
    one.metadata["call"] = one.name.starts_with("fp32-group") ? "path_a(e4m3, e4m3)" : "path_b(bf16, bf16)";
  }
  EXPECT_EQ(conform::hardware_path(cases[0]), "path_a(e4m3, e4m3), out fp32");
  const auto groups = conform::cases_by_path(cases);
  ASSERT_EQ(groups.size(), 2U);
  EXPECT_EQ(groups[0].second.size(), 2U);
  EXPECT_EQ(groups[1].second[1].name, cases[3].name);
  EXPECT_FALSE(conform::fit_gemm(cases, conform::fit_family()).exact()) << "one model explains both paths";
  write_conformance_directory(directory, cases);
  const cli_result fitted = run_cli({"conform", directory.string(), "--fit"});
  EXPECT_EQ(fitted.code, 0) << fitted.err;
  EXPECT_NE(fitted.out.find("fit: 2 hardware paths"), std::string::npos) << fitted.out;
  EXPECT_NE(fitted.out.find("path 1: path_a(e4m3, e4m3), out fp32 (2 cases)"), std::string::npos) << fitted.out;
  for (const char* path : {"fit path 1: ", "fit path 2: "}) {
    const auto at = fitted.out.find(path);
    ASSERT_NE(at, std::string::npos) << fitted.out;
    const std::string line = fitted.out.substr(at, fitted.out.find('\n', at) - at);
    EXPECT_NE(line.find("reproduces every output bit"), std::string::npos) << line;
  }
  // Without a recorded call, the operands' formats name the path.
  for (auto& one : cases) one.metadata.clear();
  EXPECT_EQ(conform::cases_by_path(cases).size(), 2U);
  EXPECT_EQ(conform::hardware_path(cases[0]), "a mxfp4, b mxfp4, out fp32");
}

// trunc-promote aligns by exponent fields: a subnormal element counts as having its format's
// smallest normal exponent (e4m3: -6), as the H200's fp8 tensor core does (docs/conformance.md,
// the stress capture). Worked by hand with n = 2 (two bits below E) and one 32-product step:
// a = [256, 2^-9, 2^-9] (block scale 1: the last two are e4m3 subnormals), b = [0, 1, 0.75].
// The products 2^-9 and 1.5 * 2^-10 have field exponent sums -6 and -7, so E = -6, the unit is
// 2^-8 and both truncate to 0. By leading exponents (E = -9, unit 2^-11) they would be kept
// exactly: 7 * 2^-11, which is also the exact sum. Scaled by 2^4 the elements are normal and
// both rules give the exact 7 * 2^-7.
TEST(trunc_promote, aligns_a_subnormal_element_by_its_exponent_field) {
  const auto product = [](float scale) {
    matrix a(1, 3);
    matrix b(1, 3);
    const float a_values[3] = {256.0f, std::ldexp(1.0f, -9) * scale, std::ldexp(1.0f, -9) * scale};
    const float b_values[3] = {0.0f, 1.0f, 0.75f};
    for (int k = 0; k < 3; ++k) {
      a(0, k) = a_values[k];
      b(0, k) = b_values[k];
    }
    const quantized_tensor qa = mx_operand(a, "mxfp8_e4m3");
    const quantized_tensor qb = mx_operand(b, "mxfp8_e4m3");
    EXPECT_EQ(qa.dequantized(0, 1), a_values[1]) << "the operand must hold the value exactly";
    const auto run = [&](const char* model) {
      return mxscope::emulate_product(qa, qb, mxscope::parse_accumulation_model(model), mxscope::output_rounding::fp32)
          .out(0, 0);
    };
    return std::pair<float, float>{run("trunc-promote:2,32,24"), run("exact")};
  };
  const auto [subnormal, subnormal_exact] = product(1.0f);
  EXPECT_EQ(bits_of(subnormal), 0U);
  EXPECT_EQ(subnormal_exact, std::ldexp(7.0f, -11));
  const auto [normal, normal_exact] = product(16.0f);
  EXPECT_EQ(normal, std::ldexp(7.0f, -7));
  EXPECT_EQ(normal_exact, std::ldexp(7.0f, -7));
}

// Per-tensor scales in a case ("scale_a", "scale_b"): the operands become per-tensor fp8 and the
// model applies alpha = fl32(sa sb), out = fl32(acc alpha); a scale that is not a positive fp32
// value, a lone scale, or scales on operands that are not unit-scaled fp8 are input errors.
TEST(gemm_conformance, per_tensor_scales_are_the_epilogue) {
  const mxscope::testing::temporary_directory scratch("conform-scales");
  const fs::path& directory = scratch.path();
  conform::gemm_case one;
  one.name = "scaled_K64";
  one.kind = "product";
  matrix a = wide_range_matrix(6, 64, 31);
  matrix b = wide_range_matrix(5, 64, 32);
  // Values that are e4m3 numbers with unit block scales: clamp the exponents to e4m3's range.
  for (matrix* m : {&a, &b}) {
    for (auto& v : m->values) v = static_cast<float>(mxscope::core::decode(mxscope::core::element_kind::fp8_e4m3,
        mxscope::core::encode(mxscope::core::element_kind::fp8_e4m3, std::clamp(v, -448.0f, 448.0f)).code));
  }
  // MX e4m3 operands with every block scale 1 (code 127), as the capture writes fp8 operands.
  const auto unit_scaled = [](const matrix& values) {
    quantized_tensor q = mx_operand(values, "mxfp8_e4m3");
    for (std::int64_t i = 0; i < values.rows * values.cols; ++i) {
      q.codes[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(
          mxscope::core::encode(mxscope::core::element_kind::fp8_e4m3, values.values[static_cast<std::size_t>(i)]).code);
    }
    std::fill(q.scales.begin(), q.scales.end(), std::uint8_t{127});
    q.dequantized = values;
    return q;
  };
  const float sa = 0.375f;
  const float sb = 1.7f;
  const auto model = mxscope::parse_accumulation_model("trunc-promote:13,32,14,128");
  one.a = unit_scaled(a);
  one.b = unit_scaled(b);
  const matrix unscaled = mxscope::emulate_product(one.a, one.b, model, mxscope::output_rounding::fp32).out;
  one.out = matrix(6, 5);
  const float alpha = sa * sb;
  for (std::int64_t i = 0; i < 6; ++i) {
    for (std::int64_t j = 0; j < 5; ++j) {
      one.out(i, j) = static_cast<float>(static_cast<double>(unscaled(i, j)) * static_cast<double>(alpha));
    }
  }
  one.metadata = {{"scale_a", "0x1.8p-2"}, {"scale_b", fmt::format("{:a}", static_cast<double>(sb))}};
  write_conformance_directory(directory, {one});
  const conform::conformance_set set = conform::read_conformance_set(directory);
  ASSERT_EQ(set.cases.size(), 1U);
  EXPECT_EQ(set.cases[0].a.options.format.scheme, mxscope::quant_scheme::per_tensor);
  EXPECT_EQ(set.cases[0].b.tensor_scale, sb);
  EXPECT_TRUE(conform::check_model(set.cases, model, 3).exact());
  // The same outputs read without the scales do not match (the scales are applied, not ignored).
  conform::gemm_case unscaled_case = one;
  unscaled_case.metadata.clear();
  write_conformance_directory(directory, {unscaled_case});
  EXPECT_FALSE(conform::check_model(conform::read_conformance_set(directory).cases, model, 0).exact());

  const auto refused = [&](std::map<std::string, std::string> metadata, const std::string& fragment) {
    conform::gemm_case bad = one;
    bad.metadata = std::move(metadata);
    write_conformance_directory(directory, {bad});
    const cli_result result = run_cli({"conform", directory.string()});
    EXPECT_EQ(result.code, 2) << fragment;
    EXPECT_NE(result.err.find(fragment), std::string::npos) << result.err;
  };
  refused({{"scale_a", "abc"}, {"scale_b", "1"}}, "__metadata__.scale_a");
  refused({{"scale_a", "1"}, {"scale_b", "-2"}}, "__metadata__.scale_b");
  refused({{"scale_a", "0.1"}, {"scale_b", "1"}}, "positive finite fp32 value");  // 0.1 is no fp32 value
  refused({{"scale_a", "1"}}, "scale_a and scale_b come together");
  conform::gemm_case mxfp4 = synthetic_case("fp32-block", "mxfp4", 5, 2, 2, 64);
  mxfp4.metadata = {{"scale_a", "1"}, {"scale_b", "1"}};
  write_conformance_directory(directory, {mxfp4});
  const cli_result not_fp8 = run_cli({"conform", directory.string()});
  EXPECT_EQ(not_fp8.code, 2);
  EXPECT_NE(not_fp8.err.find("a.scales"), std::string::npos) << not_fp8.err;
}

// The fit's screening sample keeps each case's output rounding: a bf16-output case is fitted by
// the model that made it (the sample used to be compared as fp32 and screened the model out).
TEST(gemm_conformance, bf16_output_cases_are_fitted_with_their_rounding) {
  conform::gemm_case one;
  one.name = "bf16out";
  one.kind = "product";
  one.a = mx_operand(wide_range_matrix(16, 256, 41), "mxfp8_e4m3");
  one.b = mx_operand(wide_range_matrix(16, 256, 42), "mxfp8_e4m3");
  const auto truth = mxscope::parse_accumulation_model("trunc-promote:13,32,14,128");
  one.out = mxscope::emulate_product(one.a, one.b, truth, mxscope::output_rounding::bf16).out;
  one.metadata["out.rounding"] = "bf16";
  const conform::gemm_fit fit = conform::fit_gemm({one}, conform::fit_family());
  ASSERT_TRUE(fit.exact());
  EXPECT_NE(std::find(fit.tied.begin(), fit.tied.end(), mxscope::accumulation_model_name(truth)), fit.tied.end());
}

// Held-out splits: by K alternately over the sorted distinct K values, by operand class (the name
// without "_K<digits>") alternately in order of appearance; a model fitted on one half of
// synthetic trunc-promote cases predicts the other half bit for bit, and --holdout says so.
TEST(gemm_conformance, holdout_splits_by_k_and_by_class) {
  EXPECT_EQ(conform::operand_class("fp8_randn_K256"), "fp8_randn");
  EXPECT_EQ(conform::operand_class("fp8_randn_K"), "fp8_randn_K");
  EXPECT_EQ(conform::operand_class("bf16_Kx12"), "bf16_Kx12");
  EXPECT_EQ(conform::operand_class("plain"), "plain");
  std::vector<conform::gemm_case> cases;
  const char* truth = "trunc-promote:13,32,14,128";
  std::uint64_t seed = 100;
  for (const char* cls : {"wide", "narrow", "other"}) {
    for (const std::int64_t k : {64, 256, 512}) {
      conform::gemm_case one = synthetic_case(truth, "mxfp8_e4m3", seed++, 8, 8, k);
      one.name = fmt::format("{}_K{}", cls, k);
      cases.push_back(std::move(one));
    }
  }
  const auto splits = conform::holdout_splits(cases);
  ASSERT_EQ(splits.size(), 2U);
  EXPECT_EQ(splits[0].rule, "by K");
  EXPECT_EQ(splits[0].fitted_label, "K 64 512");
  EXPECT_EQ(splits[0].held_out_label, "K 256");
  EXPECT_EQ(splits[0].fitted.size(), 6U);
  EXPECT_EQ(splits[1].fitted_label, "wide other");
  EXPECT_EQ(splits[1].held_out.size(), 3U);
  for (const auto& one : splits[1].held_out) EXPECT_TRUE(one.name.starts_with("narrow_")) << one.name;
  const mxscope::testing::temporary_directory scratch("conform-holdout");
  write_conformance_directory(scratch.path(), cases);
  const cli_result result = run_cli({"conform", scratch.path().string(), "--fit", "--holdout"});
  EXPECT_EQ(result.code, 0) << result.out << result.err;
  EXPECT_NE(result.out.find(fmt::format("holdout by K: {} predicts the 3 held-out cases (K 256): 192 of 192 "
                                        "outputs (every bit)", truth)), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("holdout by operand class: "), std::string::npos) << result.out;
  // One corrupted held-out output: the prediction is reported as not exact and the exit code is 1.
  cases[1].out(0, 0) = from_bits(bits_of(cases[1].out(0, 0)) ^ 0x1U);  // wide_K256, held out by K
  write_conformance_directory(scratch.path(), cases);
  const cli_result corrupted = run_cli({"conform", scratch.path().string(), "--fit", "--holdout"});
  EXPECT_EQ(corrupted.code, 1) << corrupted.out;
  EXPECT_NE(corrupted.out.find("191 of 192 outputs (NOT exact)"), std::string::npos) << corrupted.out;
  EXPECT_EQ(run_cli({"conform", scratch.path().string(), "--holdout"}).code, 2);
}

// Hardware conversions: hand-made codes for values at the places the rules differ (ties, the
// subnormal edge, the overflow threshold, infinities, NaN, signed zero), as PTX cvt.rn.satfinite
// (saturate) and torch's float8_e4m3fn cast (NaN on overflow) write them.
TEST(convert_conformance, the_rule_that_wrote_the_codes_is_named) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float above_tie = from_bits(bits_of(464.0f) + 1);  // the first value past 448's rounding interval
  // value, e4m3 code under rne + saturate, under rne + NaN on overflow
  const std::vector<std::tuple<float, std::uint8_t, std::uint8_t>> e4m3 = {
      {448.0f, 0x7E, 0x7E}, {464.0f, 0x7E, 0x7E},  // the tie at the top goes to 448 (even)
      {above_tie, 0x7E, 0x7F}, {480.0f, 0x7E, 0x7F}, {-1.0e30f, 0xFE, 0x7F}, {inf, 0x7E, 0x7F}, {-inf, 0xFE, 0x7F},
      {nan, 0x7F, 0x7F}, {std::ldexp(1.0f, -10), 0x00, 0x00},  // half the smallest subnormal: tie to 0
      {3.0f * std::ldexp(1.0f, -10), 0x02, 0x02}, {-0.0f, 0x80, 0x80}, {1.0625f, 0x38, 0x38}, {1.1875f, 0x3A, 0x3A},
      {-2.0e-12f, 0x80, 0x80}};
  conform::convert_case saturating;
  saturating.name = "cvt_e4m3";
  saturating.kind = mxscope::core::element_kind::fp8_e4m3;
  conform::convert_case torch_like = saturating;
  torch_like.name = "torch_e4m3";
  for (const auto& [value, saturated, nan_on_overflow] : e4m3) {
    saturating.in.push_back(value);
    saturating.out.push_back(saturated);
    torch_like.in.push_back(value);
    torch_like.out.push_back(nan_on_overflow);
  }
  const auto exact_models = [](const conform::convert_case& one) {
    std::vector<std::string> names;
    for (const auto& row : conform::check_converts(one)) {
      if (row.exact()) names.push_back(row.name);
    }
    return names;
  };
  EXPECT_EQ(exact_models(saturating), std::vector<std::string>{"rne/saturate"});
  EXPECT_EQ(exact_models(torch_like), std::vector<std::string>{"rne/nan"});
  // e5m2's largest finite value 57344 has an odd significand: its upper tie 61440 rounds up, past it.
  EXPECT_EQ(conform::convert_code(mxscope::core::element_kind::fp8_e5m2, 61440.0f, {}), 0x7B);
  EXPECT_EQ(conform::convert_code(mxscope::core::element_kind::fp8_e5m2, 61440.0f,
                                  {mxscope::core::rounding_mode::rne, conform::overflow_rule::infinity}), 0x7C);
  EXPECT_EQ(conform::convert_code(mxscope::core::element_kind::fp8_e5m2, -61439.996f,
                                  {mxscope::core::rounding_mode::rne, conform::overflow_rule::infinity}), 0xFB);
  EXPECT_EQ(conform::convert_code(mxscope::core::element_kind::fp8_e4m3, 1.0e6f,
                                  {mxscope::core::rounding_mode::rtz, conform::overflow_rule::nan}), 0x7E);

  // Through a directory and the CLI; a case whose out is short is refused naming the field.
  const mxscope::testing::temporary_directory scratch("conform-convert");
  const fs::path& directory = scratch.path();
  nlohmann::json manifest = {{"format", "mxscope-conformance"}, {"version", 1}, {"cases", nlohmann::json::array()}};
  for (const auto* one : {&saturating, &torch_like}) {
    mxscope::io::safetensors_writer writer;
    std::vector<std::uint8_t> in_bytes(one->in.size() * sizeof(float));
    std::memcpy(in_bytes.data(), one->in.data(), in_bytes.size());
    writer.add("in", mxscope::io::dtype::f32, {static_cast<std::int64_t>(one->in.size())}, in_bytes);
    writer.add("out", mxscope::io::dtype::u8, {static_cast<std::int64_t>(one->out.size())}, one->out);
    writer.set_metadata("mxscope.case", "convert");
    writer.set_metadata("format", "fp8_e4m3");
    writer.set_metadata("call", one->name);
    writer.write(directory / (one->name + ".safetensors"));
    manifest["cases"].push_back({{"name", one->name}, {"file", one->name + ".safetensors"}});
  }
  std::ofstream(directory / "manifest.json") << manifest.dump(2);
  const cli_result result = run_cli({"conform", directory.string()});
  EXPECT_EQ(result.code, 0) << result.err;
  EXPECT_NE(result.out.find("convert cvt_e4m3: reproduced exactly by rne/saturate\n"), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("convert torch_e4m3: reproduced exactly by rne/nan\n"), std::string::npos) << result.out;
  const cli_result one = run_cli({"conform", directory.string(), "--cases", "torch"});
  EXPECT_EQ(one.out.find("cvt_e4m3"), std::string::npos) << one.out;
  mxscope::io::safetensors_writer broken;
  broken.add("in", mxscope::io::dtype::f32, {2}, std::vector<std::uint8_t>(8, 0));
  broken.add("out", mxscope::io::dtype::u8, {1}, std::vector<std::uint8_t>(1, 0));
  broken.set_metadata("mxscope.case", "convert");
  broken.set_metadata("format", "fp8_e4m3");
  broken.write(directory / "cvt_e4m3.safetensors");
  const cli_result refused = run_cli({"conform", directory.string()});
  EXPECT_EQ(refused.code, 2);
  EXPECT_NE(refused.err.find("out"), std::string::npos) << refused.err;
  EXPECT_NE(refused.err.find("cvt_e4m3.safetensors"), std::string::npos) << refused.err;
}

// Hostile manifests and case files are refused with exit 2 naming the file and field, without
// a signal, without reading outside the directory, and without taking numbers that are not.
TEST(gemm_conformance, hostile_manifests_and_cases_exit_two) {
  const mxscope::testing::temporary_directory scratch("conform-hostile");
  const fs::path& directory = scratch.path();
  const auto expect_refused = [&](const std::string& label, const std::vector<std::string>& fragments) {
    const cli_result result = run_cli({"conform", directory.string()});
    EXPECT_EQ(result.code, 2) << label << ": " << result.out << result.err;
    for (const auto& fragment : fragments) {
      EXPECT_NE(result.err.find(fragment), std::string::npos) << label << ": expected '" << fragment << "' in "
                                                              << result.err;
    }
    return result;
  };
  const std::string head = R"({"format":"mxscope-conformance","version":1,)";
  std::ofstream(directory / "manifest.json")
      << head << R"("source":{"x":)" << std::string(100000, '[') << std::string(100000, ']') << R"(},"cases":[]})";
  expect_refused("deep source", {"manifest.json", "nesting deeper than 64"});
  std::ofstream(directory / "manifest.json") << head << R"("version":1,"cases":[]})";
  expect_refused("duplicate key", {"manifest.json", "'version'", "duplicate key"});

  std::ofstream(directory / "manifest.json") << head << R"("cases":[{"name":"c","file":"link.safetensors"}]})";
  fs::create_symlink("/etc/passwd", directory / "link.safetensors");
  const cli_result outside = expect_refused("symlink out", {"cases[0]", "field 'file'", "outside the directory"});
  EXPECT_EQ(outside.err.find("header length"), std::string::npos) << outside.err;

  // Block sizes that are not exactly a decimal integer, an empty case and an extent that would
  // overflow the element count.
  std::vector<conform::gemm_case> cases = {synthetic_case("fp32-block", "mxfp4", 5, 2, 2, 64)};
  for (const char* block : {"32abc", " 32", "+32", "0x20"}) {
    write_conformance_directory(directory, cases);
    mxscope::io::safetensors_writer writer;
    writer.add("a.codes", mxscope::io::dtype::u8, {cases[0].a.rows, cases[0].a.code_row_bytes()}, cases[0].a.codes);
    writer.add("a.scales", mxscope::io::dtype::u8, {cases[0].a.scale_rows, cases[0].a.scale_cols}, cases[0].a.scales);
    writer.set_metadata("a.format", "mxfp4");
    writer.set_metadata("a.block", block);
    writer.add_matrix("b", cases[0].b.dequantized);
    writer.add_matrix("out", cases[0].out);
    writer.set_metadata("mxscope.case", "gemm");
    writer.set_metadata("out.kind", "product");
    writer.write(directory / "case0.safetensors");
    expect_refused(block, {"case0.safetensors", "field '__metadata__.a.block'"});
  }
  std::vector<conform::gemm_case> empty = {cases[0]};
  empty[0].a = conform::plain_operand(matrix(0, 64));
  empty[0].out = matrix(0, 2);
  write_conformance_directory(directory, empty);
  expect_refused("no outputs", {"case0.safetensors", "field 'out.shape'", "no outputs"});
  {
    mxscope::io::safetensors_writer writer;
    writer.add("a.codes", mxscope::io::dtype::u8, {0, (std::int64_t{1} << 62) + 1}, {});
    writer.add("a.scales", mxscope::io::dtype::u8, {0, 1}, {});
    writer.set_metadata("a.format", "mxfp4");
    writer.set_metadata("a.block", "32");
    writer.add_matrix("b", cases[0].b.dequantized);
    writer.add_matrix("out", matrix(0, 2));
    writer.set_metadata("mxscope.case", "gemm");
    writer.set_metadata("out.kind", "product");
    writer.write(directory / "case0.safetensors");
  }
  expect_refused("huge extent", {"case0.safetensors", "field 'a.codes.shape'", "below 2^31"});
  // The tensor of the wrong dtype or rank is the one named (an I8 a.scales was blamed on a.codes).
  for (const bool wrong_rank : {false, true}) {
    mxscope::io::safetensors_writer writer;
    writer.add("a.codes", mxscope::io::dtype::u8, {cases[0].a.rows, cases[0].a.code_row_bytes()}, cases[0].a.codes);
    if (wrong_rank) {
      writer.add("a.scales", mxscope::io::dtype::u8, {static_cast<std::int64_t>(cases[0].a.scales.size())},
                 cases[0].a.scales);
    } else {
      writer.add("a.scales", mxscope::io::dtype::i8, {cases[0].a.scale_rows, cases[0].a.scale_cols}, cases[0].a.scales);
    }
    writer.set_metadata("a.format", "mxfp4");
    writer.set_metadata("a.block", "32");
    writer.add_matrix("b", cases[0].b.dequantized);
    writer.add_matrix("out", cases[0].out);
    writer.set_metadata("mxscope.case", "gemm");
    writer.set_metadata("out.kind", "product");
    writer.write(directory / "case0.safetensors");
    if (wrong_rank) {
      expect_refused("1-D a.scales", {"case0.safetensors", "field 'a.scales.shape'", "2-D, got 1-D"});
    } else {
      expect_refused("I8 a.scales", {"case0.safetensors", "field 'a.scales.dtype'", "must be U8, got I8"});
    }
  }
  // An output rounding other than fp32 or bf16 was read as fp32.
  {
    mxscope::io::safetensors_writer writer;
    writer.add_matrix("a", cases[0].a.dequantized);
    writer.add_matrix("b", cases[0].b.dequantized);
    writer.add_matrix("out", cases[0].out);
    writer.set_metadata("mxscope.case", "gemm");
    writer.set_metadata("out.kind", "product");
    writer.set_metadata("out.rounding", "fp16");
    writer.write(directory / "case0.safetensors");
  }
  expect_refused("output rounding", {"case0.safetensors", "field '__metadata__.out.rounding'", "'fp16'"});
}

// ------------------------------------------------------------------------------------------------
// Synthetic quantizer hardware.

// fp4 e2m1 magnitudes by code (OCP MX v1.0, table of FP4 values).
constexpr float fp4_values[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

// Rows of 32-element blocks. Every block holds its exponent's largest value (6 * 2^e, or 7 * 2^e in
// a "wide" block, so floor and ceil disagree) and otherwise grid values and midpoints of the fp4 grid.
struct quantizer_data {
  matrix values;
  std::int64_t tie_differences = 0;  // midpoints where ties-to-even and ties-away differ (floor blocks)
  std::int64_t wide_blocks = 0;
};

quantizer_data quantizer_input(std::uint64_t seed) {
  // Midpoints of adjacent fp4 magnitudes; RNE and RNA disagree exactly where the lower neighbour
  // has the even code (codes 0, 2, 4, 6: 0.25, 1.25, 2.5, 5).
  const float midpoints[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  const bool differs[7] = {true, false, true, false, true, false, true};
  std::mt19937_64 random(seed);
  std::uniform_int_distribution<int> exponent(-6, 6);
  std::uniform_int_distribution<int> pick(0, 14);
  quantizer_data data;
  data.values = matrix(8, 128);
  for (std::int64_t r = 0; r < data.values.rows; ++r) {
    for (std::int64_t block = 0; block < 4; ++block) {
      const int e = exponent(random);
      const bool wide = (r + block) % 3 == 0;
      data.wide_blocks += wide;
      for (std::int64_t i = 0; i < 32; ++i) {
        float magnitude = 0.0f;
        if (i == 0) {
          magnitude = wide ? 7.0f : 6.0f;
        } else {
          const int choice = pick(random);
          if (choice < 7) {
            magnitude = midpoints[choice];
            if (!wide && differs[choice]) ++data.tie_differences;
          } else {
            magnitude = fp4_values[choice - 7];
          }
        }
        const float sign = (i % 2 == 0) ? 1.0f : -1.0f;
        data.values(r, block * 32 + i) = sign * std::ldexp(magnitude, e);
      }
    }
  }
  return data;
}

mxscope::quantize_options fp4_options(mxscope::core::scale_rule rule, mxscope::core::rounding_mode rounding) {
  mxscope::quantize_options options;
  options.format = *mxscope::parse_format("mxfp4");
  options.block = 32;
  options.axis = 1;
  options.rule = rule;
  options.rounding = rounding;
  options.stream = mxscope::core::random_stream{5, 1, 0x77U};
  return options;
}

std::vector<std::string> exact_candidates(const std::vector<conform::quantizer_fit_row>& rows) {
  std::vector<std::string> names;
  for (const auto& row : rows) {
    if (row.mismatches == 0) names.push_back(row.candidate.name());
  }
  return names;
}

TEST(quantizer_conformance, flipped_tie_rule_is_identified) {
  using mxscope::core::rounding_mode;
  using mxscope::core::scale_rule;
  const quantizer_data data = quantizer_input(3);
  conform::quantizer_operand operand;
  operand.label = "synthetic";
  operand.rotated_input = data.values;
  operand.hardware = mxscope::quantize(data.values, fp4_options(scale_rule::floor, rounding_mode::rna));
  operand.recorded = fp4_options(scale_rule::floor, rounding_mode::rne);

  const conform::quantizer_check check = conform::check_quantizer(operand.rotated_input, operand.hardware, operand.recorded, 5);
  EXPECT_EQ(check.matching_scales, check.blocks);
  // In wide blocks (floor exponent, amax 7 * 2^e) the midpoints are also midpoints, scaled: count
  // them from the input as the test placed them.
  std::int64_t expected_ties = 0;
  for (std::int64_t r = 0; r < data.values.rows; ++r) {
    for (std::int64_t c = 0; c < data.values.cols; ++c) {
      const float block_max = std::fabs(data.values(r, c - c % 32));
      const int e = static_cast<int>(std::floor(std::log2(block_max))) - 2;  // floor rule, emax 2 (exact: powers of two times 6 or 7)
      const float scaled = std::fabs(data.values(r, c)) / std::ldexp(1.0f, e);
      for (int code = 0; code < 6; code += 2) {  // lower neighbour with an even code
        if (scaled == 0.5f * (fp4_values[code] + fp4_values[code + 1])) ++expected_ties;
      }
      if (scaled == 5.0f) ++expected_ties;
    }
  }
  EXPECT_GE(expected_ties, data.tie_differences);
  EXPECT_EQ(check.counts[static_cast<int>(conform::mismatch_kind::element_tie)], expected_ties);
  EXPECT_EQ(check.mismatches(), expected_ties) << "every disagreement is a tie";
  ASSERT_FALSE(check.listed.empty());
  const auto& first = check.listed.front();
  EXPECT_EQ(first.kind, conform::mismatch_kind::element_tie);
  EXPECT_EQ(first.input_bits, bits_of(data.values(first.row, first.col)));

  const auto rows = conform::fit_quantizer({operand});
  const auto exact = exact_candidates(rows);
  EXPECT_NE(std::find(exact.begin(), exact.end(), "floor/rna"), exact.end());
  EXPECT_EQ(std::find(exact.begin(), exact.end(), "floor/rne"), exact.end());
  EXPECT_EQ(std::find(exact.begin(), exact.end(), "ceil/rna"), exact.end());
}

TEST(quantizer_conformance, ceil_scale_rule_is_identified) {
  using mxscope::core::rounding_mode;
  using mxscope::core::scale_rule;
  const quantizer_data data = quantizer_input(8);
  conform::quantizer_operand operand;
  operand.label = "synthetic";
  operand.rotated_input = data.values;
  operand.hardware = mxscope::quantize(data.values, fp4_options(scale_rule::ceil, rounding_mode::rne));
  operand.recorded = fp4_options(scale_rule::floor, rounding_mode::rne);
  const conform::quantizer_check check = conform::check_quantizer(operand.rotated_input, operand.hardware, operand.recorded, 3);
  // Exactly the wide blocks (amax 7 * 2^e: floor gives e - 2, ceil e - 1) have their scale one off.
  EXPECT_EQ(check.counts[static_cast<int>(conform::mismatch_kind::scale_off_by_one)], data.wide_blocks);
  EXPECT_EQ(check.blocks - check.matching_scales, data.wide_blocks);
  ASSERT_FALSE(check.listed.empty());
  EXPECT_TRUE(check.listed.front().scale);
  EXPECT_EQ(check.listed.front().hardware_scale, check.listed.front().recomputed_scale + 1);

  const auto exact = exact_candidates(conform::fit_quantizer({operand}));
  EXPECT_NE(std::find(exact.begin(), exact.end(), "ceil/rne"), exact.end());
  EXPECT_EQ(std::find(exact.begin(), exact.end(), "floor/rne"), exact.end());
}

TEST(quantizer_conformance, saturation_is_classified) {
  using mxscope::core::rounding_mode;
  using mxscope::core::scale_rule;
  // One block with amax 7: under floor the 7 saturates to 6 (code 7). Hardware that wrote code 6
  // (value 4) there disagrees by saturation.
  matrix values(1, 32, 1.0f);
  values(0, 0) = 7.0f;
  const auto options = fp4_options(scale_rule::floor, rounding_mode::rne);
  quantized_tensor hardware = mxscope::quantize(values, options);
  ASSERT_EQ(hardware.codes[0] & 0x0FU, 0x7U);
  hardware.codes[0] = static_cast<std::uint8_t>((hardware.codes[0] & 0xF0U) | 0x6U);
  const auto check = conform::check_quantizer(values, hardware, options, 10);
  EXPECT_EQ(check.counts[static_cast<int>(conform::mismatch_kind::element_saturation)], 1);
  EXPECT_EQ(check.mismatches(), 1);
  EXPECT_EQ(check.listed.front().input_bits, 0x40e00000U);  // 7.0f
}

TEST(quantizer_conformance, cli_on_a_dump_reports_and_fits) {
  using mxscope::core::rounding_mode;
  using mxscope::core::scale_rule;
  const mxscope::testing::temporary_directory scratch("conform-quantizer_cli");
  const fs::path& directory = scratch.path();
  const quantizer_data data = quantizer_input(12);
  // dy [K = 128, n_out = 8] blocked along K (axis 0), as wgrad operands are: store the transpose.
  const matrix dy = mxscope::transposed(data.values);
  mxscope::quantize_options hardware_options = fp4_options(scale_rule::floor, rounding_mode::rna);
  hardware_options.axis = 0;
  const quantized_tensor hardware = mxscope::quantize(dy, hardware_options);
  mxscope::io::safetensors_writer writer;
  writer.add_matrix("x", matrix(128, 4, 1.0f));
  writer.add_matrix("dy", dy);
  writer.add("dy.codes", mxscope::io::dtype::u8, {hardware.rows, hardware.code_row_bytes()}, hardware.codes);
  writer.add("dy.scales", mxscope::io::dtype::u8, {hardware.scale_rows, hardware.scale_cols}, hardware.scales);
  const std::map<std::string, std::string> recipe = {
      {"format", "mxfp4"}, {"block", "32"},  {"axis", "0"},     {"scale_rule", "floor"}, {"rounding", "rne"},
      {"seed", "0"},       {"rotation", "none"}, {"signs", "none"}, {"layer", "l0"},      {"step", "0"},
      {"sr_bits", "32"}};
  for (const auto& [key, value] : recipe) writer.set_metadata("dy." + key, value);
  writer.write(directory / "e0.safetensors");
  const nlohmann::json manifest = {
      {"format", "mxscope-dump"},
      {"version", 1},
      {"source", {{"hardware", "synthetic"}, {"framework", "test"}, {"recipe", "rna"}, {"model", "-"}, {"notes", ""}}},
      {"entries", {{{"step", 0}, {"layer", "l0"}, {"file", "e0.safetensors"}}}}};
  std::ofstream(directory / "manifest.json") << manifest.dump();

  const cli_result plain = run_cli({"conform", directory.string()});
  EXPECT_EQ(plain.code, 1) << plain.out << plain.err;
  EXPECT_NE(plain.out.find("MISMATCH"), std::string::npos) << plain.out;
  EXPECT_NE(plain.out.find("element-tie"), std::string::npos) << plain.out;
  const cli_result fitted = run_cli({"conform", directory.string(), "--fit"});
  EXPECT_NE(fitted.out.find("explained exactly by"), std::string::npos) << fitted.out;
  EXPECT_NE(fitted.out.find("floor/rna"), std::string::npos) << fitted.out;
}

// ------------------------------------------------------------------------------------------------
// Self-test.

TEST(self_test, cpu_fast_paths_are_bit_exact) {
  const auto rows = conform::self_test(conform::self_test_device::cpu, 3);
  ASSERT_GT(rows.size(), 20U);
  for (const auto& row : rows) {
    EXPECT_GT(row.compared, 0) << row.kernel;
    EXPECT_EQ(row.differing, 0) << row.kernel;
  }
}

TEST(self_test, gpu_without_backend_is_a_clear_input_error) {
  if (conform::gpu_backend_available()) {
    // With a backend, the device comparison itself must hold (run on a GPU machine).
    for (const auto& row : conform::self_test(conform::self_test_device::gpu, 3)) EXPECT_EQ(row.differing, 0) << row.kernel;
    return;
  }
  const cli_result result = run_cli({"conform", "--self-test", "--device", "gpu"});
  EXPECT_EQ(result.code, 2);
  const bool explained = result.err.find("without a GPU backend") != std::string::npos ||
                         result.err.find("no usable GPU") != std::string::npos;
  EXPECT_TRUE(explained) << result.err;
}

// ------------------------------------------------------------------------------------------------
// The H200 capture script's CPU parts: its --cpu-dry-run writes the real file layout with out = the
// fp64 product rounded to fp32. For the MXFP4-valued operands every product and partial sum is a
// short dyadic number (e2m1 times 2^-4 .. 2^3: at most 3 significant bits each, sums of 32 .. 128
// terms), so the fp64 product is exact and its fp32 rounding is by definition the `exact` model:
// any error in the script's code packing, nibble order, scale codes or layout breaks the match.

// Runs tools/capture/h200_conformance.py --cpu-dry-run with `arguments` into scratch/<name> and
// reads the directory back (the caller's ASSERTs stop on a failed run).
conform::conformance_set dry_run_capture(const python_runner::temporary_directory& scratch, const std::string& name,
                                         std::vector<std::string> arguments) {
  const std::string problem = python_runner::torch_problem(scratch.path());
  EXPECT_TRUE(problem.empty()) << problem;
  if (!problem.empty()) return {};
  const fs::path out = scratch.path() / name;
  arguments.insert(arguments.begin(), {"--out", out.string(), "--cpu-dry-run"});
  const auto result = python_runner::run_script(fs::path(MXSCOPE_SOURCE_DIR) / "tools/capture/h200_conformance.py",
                                                arguments, scratch.path() / "python.log");
  EXPECT_EQ(result.exit_code, 0) << result.output;
  if (result.exit_code != 0) return {};
  return conform::read_conformance_set(out);
}

TEST(capture_script, cpu_dry_run_reads_back_and_matches_the_exact_model) {
  const python_runner::temporary_directory scratch("h200-dry-run");
  const conform::conformance_set set = dry_run_capture(scratch, "h200", {"--sizes", "32,128"});
  ASSERT_EQ(set.cases.size(), 8U);
  std::vector<conform::gemm_case> mxfp4_cases;
  for (const auto& one : set.cases) {
    EXPECT_EQ(one.out.rows, 128);
    EXPECT_EQ(one.out.cols, 128);
    if (one.name.rfind("fp8_mxfp4_", 0) == 0) mxfp4_cases.push_back(one);
  }
  ASSERT_EQ(mxfp4_cases.size(), 2U);
  EXPECT_EQ(mxfp4_cases[0].a.options.format.element, mxscope::core::element_kind::fp4_e2m1);
  const auto agreement = conform::check_model(mxfp4_cases, mxscope::parse_accumulation_model("exact"), 3);
  EXPECT_TRUE(agreement.exact()) << agreement.matches << " of " << agreement.compared << "; first "
                                 << (agreement.worst.empty() ? std::string("-") : agreement.worst[0].case_name);
}

// --suite stress: every operand class reads back with the shapes, formats and scales it documents.
// The dry run's fp32 rounding of the fp64 product is not hardware; only the layout is checked here
// (the captured suite is checked against the model in shipped_h200_directory).
TEST(capture_script, stress_suite_dry_run_reads_back) {
  const python_runner::temporary_directory scratch("h200-stress-dry-run");
  const conform::conformance_set set = dry_run_capture(scratch, "stress", {"--suite", "stress"});
  ASSERT_EQ(set.cases.size(), 35U);
  std::map<std::string, const conform::gemm_case*> by_name;
  for (const auto& one : set.cases) by_name[one.name] = &one;
  ASSERT_EQ(by_name.count("fp8_tiles_K256"), 1U);
  EXPECT_EQ(by_name["fp8_tiles_K256"]->out.rows, 512);
  EXPECT_EQ(by_name["fp8_tiles_K256"]->out.cols, 384);
  EXPECT_EQ(by_name["fp8_randn_K1040"]->a.cols, 1040);
  EXPECT_EQ(by_name["fp8_scaled_K256"]->a.options.format.scheme, mxscope::quant_scheme::per_tensor);
  EXPECT_EQ(by_name["fp8_scaled_K256"]->a.tensor_scale, 0.375f);
  EXPECT_EQ(by_name["fp8_scaled_K256"]->b.tensor_scale, 1.7f);
  EXPECT_EQ(by_name["fp8_e5m2xe4m3_K256"]->a.options.format.element, mxscope::core::element_kind::fp8_e5m2);
  EXPECT_EQ(by_name["fp8_bf16out_K256"]->metadata.at("out.rounding"), "bf16");
  EXPECT_EQ(by_name["bf16_long_K16384"]->a.cols, 16384);
  // The cancellation rows: +0 and -0 rows of a, and pairs that cancel inside each step.
  const auto& cancel = *by_name["fp8_cancel_K64"];
  for (std::int64_t k = 0; k < 64; ++k) {
    EXPECT_EQ(bits_of(cancel.a.dequantized(24, k)), 0U);
    EXPECT_EQ(bits_of(cancel.a.dequantized(25, k)), 0x80000000U);
    if (k % 2 == 1) {
      EXPECT_EQ(cancel.a.dequantized(3, k), -cancel.a.dequantized(3, k - 1));
    }
  }
  // The subnormal class holds e4m3 values below 2^-6 only up to the two smallest binades.
  for (const float v : by_name["fp8_subnormal_K64"]->a.dequantized.values) EXPECT_LT(std::fabs(v), 0.0625f);
}

// ------------------------------------------------------------------------------------------------
// The shipped H200 capture (tools/capture/h200_conformance.py). data/conformance/h200/expected.json
// documents the model found by `mxscope conform data/conformance/h200 --fit` and its match counts
// (docs/conformance.md, "H200 results"); the test reproduces them from the hardware data.

// The H200's own fp8 conversions (tools/capture/h200_converters.py): PTX cvt.rn.satfinite is
// mxscope's encoder (rne, saturating) on every input, torch's casts are rne with NaN (e4m3fn) or
// infinity (e5m2) on overflow, and no other rounding x overflow model reproduces any of them.
TEST(shipped_h200, converters_are_reproduced_by_one_model_each) {
  const fs::path directory = fs::path(MXSCOPE_SOURCE_DIR) / "data/conformance/h200-converters";
  const conform::conformance_set set = conform::read_conformance_set(directory);
  const std::map<std::string, std::string> expected = {{"cvt_e4m3", "rne/saturate"}, {"cvt_e5m2", "rne/saturate"},
                                                       {"torch_e4m3", "rne/nan"}, {"torch_e5m2", "rne/infinity"}};
  ASSERT_EQ(set.converts.size(), expected.size());
  for (const auto& one : set.converts) {
    ASSERT_EQ(expected.count(one.name), 1U) << one.name;
    EXPECT_GT(one.in.size(), 9000U);
    std::vector<std::string> exact;
    for (const auto& row : conform::check_converts(one)) {
      if (row.exact()) exact.push_back(row.name);
    }
    EXPECT_EQ(exact, std::vector<std::string>{expected.at(one.name)}) << one.name;
  }
}

class shipped_h200_directory : public ::testing::TestWithParam<const char*> {};

TEST_P(shipped_h200_directory, reproduces_under_the_documented_model) {
  const fs::path directory = fs::path(MXSCOPE_SOURCE_DIR) / "data/conformance" / GetParam();
  const fs::path expected_path = directory / "expected.json";
  ASSERT_TRUE(fs::exists(expected_path))
      << expected_path << " must document the fitted model: {\"model\": ..., \"matches\": ..., \"compared\": ...}";
  nlohmann::json expected;
  std::ifstream(expected_path) >> expected;
  // One check, or a list of them (one per hardware path, told apart by the case names).
  const nlohmann::json checks = expected.is_array() ? expected : nlohmann::json::array({expected});
  ASSERT_FALSE(checks.empty());
  const conform::conformance_set set = conform::read_conformance_set(directory);
  for (const auto& check : checks) {
    const std::string only_prefix = check.value("cases_prefix", "");
    const auto cases = conform::cases_named(set.cases, only_prefix, "cases_prefix");
    const auto model = mxscope::parse_accumulation_model(check.at("model").get<std::string>());
    const auto agreement = conform::check_model(cases, model, 5);
    EXPECT_EQ(agreement.compared, check.at("compared").get<std::int64_t>()) << only_prefix;
    EXPECT_EQ(agreement.matches, check.at("matches").get<std::int64_t>())
        << agreement.name << " on the H200 cases " << only_prefix << "*: match rate " << agreement.match_rate();
    // A check that claims every output must say so on every case (every K) separately too.
    if (check.at("matches") == check.at("compared")) {
      for (const auto& one : agreement.per_case) EXPECT_EQ(one.matches, one.compared) << one.case_name;
    }
  }
}

// h200: the MXFP4-valued and random cases the model was found on; h200-stress: the operand classes
// that separate hypotheses (subnormals, cancellation, the alignment edge, odd K, many tiles,
// per-tensor scales, bf16 output, e5m2, long-K bf16), captured later with --suite stress;
// h200-probe: the split-K probes (--suite probe), whose outputs are 1 where the unit and the small
// product share an accumulation and 1 + 2^-23 where cuBLAS summed them in separate K chunks.
INSTANTIATE_TEST_SUITE_P(captures, shipped_h200_directory, ::testing::Values("h200", "h200-stress", "h200-probe"),
                         [](const auto& info) {
                           const std::string name = info.param;
                           return name == "h200" ? std::string("base") : name.substr(5);
                         });

}  // namespace
