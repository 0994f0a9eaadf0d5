// mxscope gemm, called in-process through mxscope::cli::run. Operands are built so that the
// expected results are known independently: values on the fp4 grid with one power-of-two scale per
// column quantize losslessly along the reduction axis (and lossily along the other axis), so with
// the exact model "out" must be the exact product rounded once to fp32, computed here with
// Boost.Multiprecision; "ref" must be the same exact product rounded to fp64. Bad inputs exit 2
// with the flag or tensor named and write no output.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "support/temporary_directory.hpp"
#include "exact_oracle.hpp"
#include "cli_runner.hpp"
#include "mxscope/cli/cli.hpp"
#include "mxscope/io/safetensors.hpp"
#include "mxscope/tensor.hpp"

namespace {

using mxscope::testing::temporary_directory;

namespace fs = std::filesystem;
using mxscope::matrix;
using oracle::cpp_int;


using mxscope::testing::cli_result;
using mxscope::testing::joined;
using mxscope::testing::run_cli;

// Values of the fp4 e2m1 grid (OCP MX v1.0), each column scaled by its own power of two.
matrix fp4_grid_by_column(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  static constexpr double grid[] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
  std::mt19937_64 random(seed);
  matrix out(rows, cols);
  for (std::int64_t c = 0; c < cols; ++c) {
    const int exponent = static_cast<int>(random() % 24) - 12;
    for (std::int64_t r = 0; r < rows; ++r) {
      const double magnitude = grid[random() % 8];
      out(r, c) = static_cast<float>(std::ldexp((random() & 1U) != 0 ? -magnitude : magnitude, exponent));
    }
    out(static_cast<std::int64_t>(random() % rows), c) = static_cast<float>(std::ldexp(6.0, exponent));  // the block max
  }
  return out;
}

matrix random_matrix(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  std::mt19937_64 random(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  matrix out(rows, cols);
  for (float& value : out.values) value = static_cast<float>(normal(random));
  return out;
}

void write_operands(const std::string& path, const std::vector<std::pair<std::string, const matrix*>>& tensors) {
  mxscope::io::safetensors_writer writer;
  for (const auto& [name, values] : tensors) writer.add_matrix(name, *values);
  writer.write(path);
}

std::vector<double> read_f64(const mxscope::io::safetensors_reader& reader, const std::string& name) {
  const auto bytes = reader.read_tensor(name);
  std::vector<double> values(bytes.size() / sizeof(double));
  std::memcpy(values.data(), bytes.data(), bytes.size());
  return values;
}

// The exact value of sum_k left(i, k) * right(j, k) for accessors of the two operands.
template <class Left, class Right>
cpp_int exact_dot(Left left, Right right, std::int64_t depth, std::int64_t i, std::int64_t j) {
  cpp_int total = 0;
  for (std::int64_t k = 0; k < depth; ++k) total += oracle::product(left(i, k), right(j, k));
  return total;
}

// Checks "out" (the exact model: one rounding to fp32) and "ref" (the exact reference rounded to
// fp64) of an output file against the oracle, entry by entry.
template <class Left, class Right>
void check_exact_outputs(const std::string& path, std::int64_t rows, std::int64_t cols, std::int64_t depth, Left left,
                         Right right, std::string_view what) {
  const mxscope::io::safetensors_reader reader(path);
  const matrix out = reader.read_matrix("out");
  ASSERT_EQ(out.rows, rows) << what;
  ASSERT_EQ(out.cols, cols) << what;
  ASSERT_EQ(reader.at("out").type, mxscope::io::dtype::f32) << what;
  ASSERT_EQ(reader.at("ref").type, mxscope::io::dtype::f64) << what;
  ASSERT_EQ(reader.at("ref").shape, (std::vector<std::int64_t>{rows, cols})) << what;
  const std::vector<double> ref = read_f64(reader, "ref");
  int failures = 0;
  for (std::int64_t i = 0; i < rows && failures < 5; ++i) {
    for (std::int64_t j = 0; j < cols && failures < 5; ++j) {
      const cpp_int exact = exact_dot(left, right, depth, i, j);
      const float expected32 = oracle::round_to_float(exact);
      const double expected64 = oracle::round_to_double(exact);
      const double got64 = ref[static_cast<std::size_t>(i * cols + j)];
      if (!oracle::same(expected32, out(i, j)) || !oracle::same(expected64, got64)) {
        ++failures;
        ADD_FAILURE() << what << " entry (" << i << ", " << j << "): expected out " << oracle::show(expected32)
                      << " ref " << oracle::show(expected64) << ", got out " << oracle::show(out(i, j)) << " ref "
                      << oracle::show(got64);
      }
    }
  }
}

TEST(CliGemm, WgradOfLosslessMxfp4OperandsIsTheExactProduct) {
  // dy [K, n_out] and x [K, n_in] with one scale per column: blocks along K (axis 0) hold one scale
  // each, so MXFP4 quantization is lossless; blocks along the other axis would mix scales and lose.
  temporary_directory directory;
  const std::int64_t k = 96, n_in = 10, n_out = 7;
  const matrix x = fp4_grid_by_column(k, n_in, 1);
  const matrix dy = fp4_grid_by_column(k, n_out, 2);
  const matrix w = random_matrix(n_out, n_in, 3);
  write_operands(directory.file("in.safetensors"), {{"x", &x}, {"dy", &dy}, {"w", &w}});
  const std::vector<std::string> arguments{"gemm", "--gemm", "wgrad", "--in", directory.file("in.safetensors"), "--format",
                                           "mxfp4", "--accum", "exact", "--out", directory.file("out.safetensors"), "--json",
                                           "--certify", "9"};
  const cli_result result = run_cli(arguments);
  ASSERT_EQ(result.code, 0) << joined(arguments) << "\n" << result.err;
  // dw[o, i] = sum_t dy[t, o] x[t, i].
  check_exact_outputs(directory.file("out.safetensors"), n_out, n_in, k, [&](std::int64_t o, std::int64_t t) { return double(dy(t, o)); },
                      [&](std::int64_t i, std::int64_t t) { return double(x(t, i)); }, "wgrad mxfp4 exact");

  const auto json = nlohmann::json::parse(result.out);
  EXPECT_EQ(json["gemm"], "wgrad");
  EXPECT_EQ(json["rows"], n_out);
  EXPECT_EQ(json["cols"], n_in);
  EXPECT_EQ(json["reduction"], k);
  EXPECT_EQ(json["strategy"]["format_a"], "mxfp4");
  EXPECT_EQ(json["strategy"]["accum"], "exact");
  EXPECT_EQ(json["reference"]["kind"], "exact");
  // out is the exact product rounded to fp32, ref the same product in fp64: no ulp between them.
  const auto& metrics = json["metrics"];
  EXPECT_EQ(metrics["ulp"]["max"], 0);
  EXPECT_EQ(metrics["ulp"]["exact_frac"], 1.0);
  EXPECT_EQ(metrics["ulp"]["compared"], n_out * n_in);
  EXPECT_LE(metrics["rel_err"].get<double>(), std::ldexp(1.0, -24));
  EXPECT_GE(metrics["cosine"].get<double>(), 1.0 - 1e-12);
  EXPECT_LE(std::fabs(metrics["bias"].get<double>()), std::ldexp(1.0, -24));
  for (const char* field : {"orth_err", "max_abs_err", "error_norm", "reference_norm", "estimate_norm"}) {
    EXPECT_TRUE(metrics.contains(field)) << field;
  }
  // Lossless quantization: nothing flushed or saturated in either operand.
  EXPECT_EQ(json["operands"]["a"]["tensor"], "dy");
  EXPECT_EQ(json["operands"]["b"]["tensor"], "x");
  EXPECT_EQ(json["operands"]["a"]["flushed"], 0);
  EXPECT_EQ(json["operands"]["b"]["saturated"], 0);
  EXPECT_TRUE(json["operands"]["a"]["snr_db"].is_null());  // infinite: no quantization error
  EXPECT_EQ(json["certification"]["entries_checked"], 9);
  EXPECT_EQ(json["certification"]["passed"], true);

  // The same data blocked along the wrong axis would not be lossless: fp32-block along K still is.
  const std::vector<std::string> block_arguments{"gemm", "--gemm", "wgrad", "--in", directory.file("in.safetensors"),
                                                 "--format", "mxfp4", "--accum", "fp32-block", "--out",
                                                 directory.file("block.safetensors"), "--json"};
  const cli_result block = run_cli(block_arguments);
  ASSERT_EQ(block.code, 0) << block.err;
  EXPECT_EQ(nlohmann::json::parse(block.out)["operands"]["a"]["flushed"], 0);
}

TEST(CliGemm, FpropAndDgradOrientations) {
  temporary_directory directory;
  const std::int64_t k = 9, n_in = 40, n_out = 36;
  const matrix x = random_matrix(k, n_in, 4);
  const matrix dy = random_matrix(k, n_out, 5);
  const matrix w = random_matrix(n_out, n_in, 6);
  write_operands(directory.file("in.safetensors"), {{"x", &x}, {"dy", &dy}, {"w", &w}});
  // Unquantized operands (fp32) and exact accumulation: out is the correctly rounded product.
  for (const std::string gemm : {"fprop", "dgrad"}) {
    const std::string output = directory / (gemm + ".safetensors");
    const std::vector<std::string> arguments{"gemm", "--gemm", gemm, "--in", directory.file("in.safetensors"), "--format",
                                             "fp32", "--accum", "exact", "--out", output};
    const cli_result result = run_cli(arguments);
    ASSERT_EQ(result.code, 0) << joined(arguments) << "\n" << result.err;
    if (gemm == "fprop") {  // y[t, o] = sum_i x[t, i] w[o, i]
      check_exact_outputs(output, k, n_out, n_in, [&](std::int64_t t, std::int64_t i) { return double(x(t, i)); },
                          [&](std::int64_t o, std::int64_t i) { return double(w(o, i)); }, "fprop");
    } else {  // dx[t, i] = sum_o dy[t, o] w[o, i]
      check_exact_outputs(output, k, n_in, n_out, [&](std::int64_t t, std::int64_t o) { return double(dy(t, o)); },
                          [&](std::int64_t i, std::int64_t o) { return double(w(o, i)); }, "dgrad");
    }
    // The table has one row per metric.
    for (const char* row : {"rel_err ", "cosine ", "bias ", "orth_err ", "max_abs_err ", "ulp_max ", "ulp_mean "}) {
      EXPECT_NE(result.out.find(fmt::format("\n{}", row)), std::string::npos) << row << " missing in:\n" << result.out;
    }
  }
}

TEST(CliGemm, PerOperandFormatsAndBf16Output) {
  temporary_directory directory;
  const std::int64_t k = 64, n_in = 8, n_out = 6;
  const matrix x = fp4_grid_by_column(k, n_in, 7);
  const matrix dy = random_matrix(k, n_out, 8);
  write_operands(directory.file("in.safetensors"), {{"x", &x}, {"dy", &dy}});
  // dy stays fp32, x is MXFP4 (lossless here): the exact model gives the exact product of the inputs.
  const std::vector<std::string> arguments{"gemm", "--gemm", "wgrad", "--in", directory.file("in.safetensors"),
                                           "--format-a", "fp32", "--format-b", "mxfp4", "--accum", "exact", "--out",
                                           directory.file("out.safetensors"), "--json"};
  const cli_result result = run_cli(arguments);
  ASSERT_EQ(result.code, 0) << joined(arguments) << "\n" << result.err;
  check_exact_outputs(directory.file("out.safetensors"), n_out, n_in, k, [&](std::int64_t o, std::int64_t t) { return double(dy(t, o)); },
                      [&](std::int64_t i, std::int64_t t) { return double(x(t, i)); }, "wgrad fp32 x mxfp4");
  const auto json = nlohmann::json::parse(result.out);
  EXPECT_EQ(json["strategy"]["format_a"], "fp32");
  EXPECT_EQ(json["strategy"]["format_b"], "mxfp4");

  // --output bf16: every value of "out" is a bf16 number (the low 16 bits are zero), and it is the
  // fp32 result rounded to nearest-even.
  const std::vector<std::string> bf16_arguments{"gemm", "--gemm", "wgrad", "--in", directory.file("in.safetensors"),
                                                "--format-a", "fp32", "--format-b", "mxfp4", "--accum", "exact",
                                                "--output", "bf16", "--out", directory.file("bf16.safetensors")};
  ASSERT_EQ(run_cli(bf16_arguments).code, 0);
  const matrix fp32_out = mxscope::io::safetensors_reader(directory.file("out.safetensors")).read_matrix("out");
  const matrix bf16_out = mxscope::io::safetensors_reader(directory.file("bf16.safetensors")).read_matrix("out");
  for (std::int64_t i = 0; i < bf16_out.size(); ++i) {
    const std::uint32_t bits = oracle::bits_of(fp32_out.values[i]);
    // Round to nearest-even at bit 16 (finite values).
    const std::uint32_t rounded = (bits + 0x7FFFU + ((bits >> 16) & 1U)) & 0xFFFF0000U;
    EXPECT_EQ(oracle::bits_of(bf16_out.values[i]), rounded) << "entry " << i << " fp32 " << oracle::show(fp32_out.values[i]);
  }
}

TEST(CliGemm, BadInputsExitTwoAndWriteNothing) {
  temporary_directory directory;
  const matrix x = random_matrix(8, 32, 9);
  const matrix dy = random_matrix(8, 16, 10);
  const matrix w_wrong = random_matrix(16, 31, 11);
  write_operands(directory.file("no_w.safetensors"), {{"x", &x}, {"dy", &dy}});
  write_operands(directory.file("wrong.safetensors"), {{"x", &x}, {"dy", &dy}, {"w", &w_wrong}});
  const matrix x_empty = random_matrix(0, 32, 12);
  const matrix dy_empty = random_matrix(0, 16, 13);
  write_operands(directory.file("empty.safetensors"), {{"x", &x_empty}, {"dy", &dy_empty}});
  struct bad_case {
    std::vector<std::string> arguments;
    std::string needle;
  };
  const std::string out = directory.file("out.safetensors");
  const std::vector<bad_case> cases = {
      {{"gemm", "--gemm", "fprop", "--in", directory.file("no_w.safetensors"), "--format", "mxfp4", "--accum", "exact", "--out", out},
       "'w'"},
      {{"gemm", "--gemm", "fprop", "--in", directory.file("wrong.safetensors"), "--format", "mxfp4", "--accum", "exact", "--out", out},
       "n_in"},
      {{"gemm", "--gemm", "wgrad", "--in", directory.file("wrong.safetensors"), "--format", "mxfp4", "--accum", "fp32-blok", "--out", out},
       "--accum"},
      {{"gemm", "--gemm", "wgrad", "--in", directory.file("wrong.safetensors"), "--format", "mxfp4", "--accum", "trunc-align:5", "--out", out},
       "--accum"},
      {{"gemm", "--gemm", "forward", "--in", directory.file("wrong.safetensors"), "--format", "mxfp4", "--accum", "exact", "--out", out},
       "--gemm"},
      {{"gemm", "--gemm", "wgrad", "--in", directory.file("wrong.safetensors"), "--format", "mxfp3", "--accum", "exact", "--out", out},
       "--format"},
      {{"gemm", "--gemm", "wgrad", "--in", directory.file("wrong.safetensors"), "--format-a", "mxfp4", "--format-b", "nvfp4",
        "--accum", "exact", "--out", out},
       "block"},
      {{"gemm", "--gemm", "wgrad", "--in", directory.file("wrong.safetensors"), "--accum", "exact", "--out", out}, "--format"},
      {{"gemm", "--gemm", "wgrad", "--in", directory.file("wrong.safetensors"), "--format", "mxfp4", "--accum", "exact",
        "--reference", "fp16", "--out", out},
       "--reference"},
      {{"gemm", "--gemm", "wgrad", "--in", directory.file("wrong.safetensors"), "--format", "mxfp4", "--accum", "exact",
        "--rotation", "hadamard:16", "--out", out},
       "rotation"},  // K = 8 is not a multiple of 16
      {{"gemm", "--gemm", "wgrad", "--in", directory.file("missing.safetensors"), "--format", "mxfp4", "--accum", "exact", "--out", out},
       "missing.safetensors"},
      // zero tokens: it failed inside the quantizer with a message naming no tensor
      {{"gemm", "--gemm", "wgrad", "--in", directory.file("empty.safetensors"), "--format", "mxfp4", "--accum", "exact", "--out", out},
       "tensor 'dy': field 'shape': [0, 16] has no elements"},
  };
  for (const auto& [arguments, needle] : cases) {
    const cli_result result = run_cli(arguments);
    EXPECT_EQ(result.code, 2) << joined(arguments) << "\n" << result.out << result.err;
    EXPECT_NE(result.err.find(needle), std::string::npos)
        << joined(arguments) << ": message does not name '" << needle << "':\n" << result.err;
    EXPECT_FALSE(fs::exists(out)) << joined(arguments) << " wrote an output";
  }
}

}  // namespace
