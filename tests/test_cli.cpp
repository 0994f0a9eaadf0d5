// The CLI, called in-process through mxscope::cli::run: inspect rows, quantize outputs checked
// against decodes of codes + scales written here from the OCP tables, the recipe metadata, the error
// table, stochastic rounding against a test-side Philox, and every bad input (exit 2, a message
// naming the flag or field, and no output file).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <limits>
#include <tuple>
#include <sys/stat.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "support/temporary_directory.hpp"
#include "cli_runner.hpp"
#include "mxscope/cli/cli.hpp"
#include "mxscope/io/safetensors.hpp"
#include "mxscope/version.hpp"
#include "reference_random.hpp"

namespace {

using mxscope::testing::temporary_directory;

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------------
// Test-side format tables (OCP MX v1.0 and OCP 8-bit floating point).

// FP4 E2M1 magnitudes by the low three code bits; bit 3 is the sign.
constexpr double fp4_magnitudes[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};

double fp4_value(unsigned code) { return (code & 8U ? -1.0 : 1.0) * fp4_magnitudes[code & 7U]; }

// E8M0: 2^(code - 127); 0xFF is NaN.
double e8m0_value(unsigned code) { return code == 0xFF ? std::nan("") : std::ldexp(1.0, static_cast<int>(code) - 127); }

// E4M3 (bias 7, no infinities, S.1111.111 NaN).
double e4m3_value(unsigned code) {
  const double sign = code & 0x80U ? -1.0 : 1.0;
  const unsigned exponent = (code >> 3) & 0xFU;
  const unsigned mantissa = code & 7U;
  if (exponent == 15 && mantissa == 7) return std::nan("");
  if (exponent == 0) return sign * mantissa * std::ldexp(1.0, -9);
  return sign * (1.0 + mantissa / 8.0) * std::ldexp(1.0, static_cast<int>(exponent) - 7);
}

std::uint32_t bits_of(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return bits;
}

// ---------------------------------------------------------------------------------------------
// Files and the CLI.


using mxscope::testing::cli_result;
using mxscope::testing::joined;
using mxscope::testing::run_cli;

// A hand-built safetensors file (length prefix, JSON, data), independent of the writer.
struct raw_tensor {
  std::string name;
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::string bytes;
};

void write_safetensors_by_hand(const fs::path& path, const std::vector<raw_tensor>& tensors,
                               const std::string& metadata_json = "") {
  std::string header = "{";
  std::string data;
  if (!metadata_json.empty()) header += "\"__metadata__\":" + metadata_json;
  for (const auto& tensor : tensors) {
    if (header.size() > 1) header += ",";
    header += fmt::format(R"("{}":{{"dtype":"{}","shape":[{}],"data_offsets":[{},{}]}})", tensor.name, tensor.dtype,
                          fmt::join(tensor.shape, ","), data.size(), data.size() + tensor.bytes.size());
    data += tensor.bytes;
  }
  header += "}";
  std::string length(8, '\0');
  for (int i = 0; i < 8; ++i) length[static_cast<std::size_t>(i)] = static_cast<char>((header.size() >> (8 * i)) & 0xFF);
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  const std::string image = length + header + data;
  file.write(image.data(), static_cast<std::streamsize>(image.size()));
}

raw_tensor f32_tensor(std::string name, std::int64_t rows, std::int64_t cols, const std::vector<float>& values) {
  std::string bytes(values.size() * 4, '\0');
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return {std::move(name), "F32", {rows, cols}, bytes};
}

// Gaussian values whose scale changes from row to row and column to column (so blocks get
// different scales), with exact zeros and tiny values sprinkled in (flushes).
std::vector<float> test_values(std::int64_t rows, std::int64_t cols, unsigned seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      float v = normal(generator) * std::ldexp(1.0f, static_cast<int>((r * 7 + c / 16) % 9) - 4);
      if ((r + c) % 13 == 0) v = 0.0f;
      if ((r * 3 + c) % 17 == 0) v *= 1e-3f;
      values[static_cast<std::size_t>(r * cols + c)] = v;
    }
  }
  return values;
}

struct output_tensor {
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::vector<std::uint8_t> bytes;
  std::vector<float> floats() const {
    std::vector<float> values(bytes.size() / 4);
    std::memcpy(values.data(), bytes.data(), values.size() * 4);
    return values;
  }
};

struct output_file {
  std::map<std::string, output_tensor> tensors;
  std::map<std::string, std::string> metadata;
};

output_file read_output(const fs::path& path) {
  const mxscope::io::safetensors_reader reader(path);
  output_file file;
  for (const auto& tensor : reader.tensors()) {
    file.tensors[tensor.name] = {std::string(mxscope::io::dtype_name(tensor.type)), tensor.shape,
                                 reader.read_tensor(tensor.name)};
  }
  file.metadata = reader.metadata();
  return file;
}

// The value in the "metric value" table printed by quantize.
std::string metric(const std::string& out, const std::string& key) {
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream fields(line);
    std::string name, value;
    if (fields >> name >> value && name == key) return value;
  }
  return "<missing " + key + ">";
}

// fp64 error statistics of `approximation` against `reference`.
struct error_norms {
  double relative = 0.0;
  double max_abs = 0.0;
};
error_norms measure(const std::vector<float>& reference, const std::vector<float>& approximation) {
  double error_squared = 0.0, reference_squared = 0.0, max_abs = 0.0;
  for (std::size_t i = 0; i < reference.size(); ++i) {
    const double error = static_cast<double>(approximation[i]) - static_cast<double>(reference[i]);
    error_squared += error * error;
    reference_squared += static_cast<double>(reference[i]) * reference[i];
    max_abs = std::max(max_abs, std::fabs(error));
  }
  return {std::sqrt(error_squared / reference_squared), max_abs};
}

// ---------------------------------------------------------------------------------------------

TEST(Cli, VersionAndHelp) {
  const auto version = run_cli({"--version"});
  EXPECT_EQ(version.code, 0) << version.err;
  EXPECT_NE(version.out.find(std::string("mxscope ") + mxscope::version_string), std::string::npos) << version.out;
  EXPECT_NE(version.out.find(mxscope::git_hash), std::string::npos) << version.out;

  const auto help = run_cli({"--help"});
  EXPECT_EQ(help.code, 0);
  EXPECT_NE(help.out.find("inspect"), std::string::npos) << help.out;
  EXPECT_NE(help.out.find("quantize"), std::string::npos) << help.out;
  const auto quantize_help = run_cli({"quantize", "--help"});
  EXPECT_EQ(quantize_help.code, 0);
  for (const char* flag : {"--in", "--tensor", "--format", "--axis", "--block", "--rounding", "--scale-rule", "--rotation",
                           "--signs", "--seed", "--step", "--sr-bits", "--layer", "--seed-policy", "--out"}) {
    EXPECT_NE(quantize_help.out.find(flag), std::string::npos) << flag << " missing from\n" << quantize_help.out;
  }
}

// Thread counts an OpenMP runtime cannot create (it crashed on 65535) are a usage error.
TEST(Cli, ReplayThreadCountIsBounded) {
  for (const char* threads : {"1025", "65535", "100000"}) {
    const auto result = run_cli({"replay", "dump", "--analysis", "a.toml", "--out", "run", "--threads", threads});
    EXPECT_EQ(result.code, 2) << threads << ": " << result.err;
    EXPECT_NE(result.err.find("--threads"), std::string::npos) << result.err;
  }
}

// Negative numbers for unsigned flags are refused (they used to wrap to 2^64 - 1), and an unknown
// command is named.
TEST(Cli, NegativeUnsignedFlagsAndUnknownCommandsAreRefused) {
  for (const std::vector<std::string>& arguments :
       {std::vector<std::string>{"quantize", "--in", "f", "--tensor", "x", "--format", "mxfp4", "--out", "o", "--seed", "-1"},
        std::vector<std::string>{"quantize", "--in", "f", "--tensor", "x", "--format", "mxfp4", "--out", "o", "--step", "-1"},
        std::vector<std::string>{"conform", "dir", "--max-listed", "-1"}}) {
    const auto result = run_cli(arguments);
    EXPECT_EQ(result.code, 2) << joined(arguments);
    EXPECT_NE(result.err.find("'-1' is not a non-negative integer"), std::string::npos) << result.err;
  }
  // Text CLI11 would convert to another number than the one written: past 2^64 - 1 (it clamped),
  // empty (it gave 0), hexadecimal or signed.
  const std::vector<std::string> quantize = {"quantize", "--in", "f", "--tensor", "x", "--format", "mxfp4", "--out", "o"};
  for (const auto& [flag, value, words] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"--seed", "18446744073709551616", "is larger than 2^64 - 1"},
           {"--seed", "99999999999999999999999", "is larger than 2^64 - 1"},
           {"--axis", "", "is not a non-negative integer"},
           {"--block", "0x20", "is not a non-negative integer"},
           {"--block", "+32", "is not a non-negative integer"},
           {"--sr-bits", "", "is not a non-negative integer"}}) {
    std::vector<std::string> arguments = quantize;
    arguments.insert(arguments.end(), {flag, value});
    const auto result = run_cli(arguments);
    EXPECT_EQ(result.code, 2) << joined(arguments);
    EXPECT_NE(result.err.find(flag + ": '" + value + "' " + words), std::string::npos) << result.err;
  }
  std::vector<std::string> largest = quantize;
  largest.insert(largest.end(), {"--seed", "18446744073709551615"});
  EXPECT_EQ(run_cli(largest).err.find("--seed"), std::string::npos) << run_cli(largest).err;  // fails on the input
  const auto unknown = run_cli({"frobnicate"});
  EXPECT_EQ(unknown.code, 2);
  EXPECT_NE(unknown.err.find("unknown command 'frobnicate'"), std::string::npos) << unknown.err;
  EXPECT_NE(unknown.err.find("replay"), std::string::npos) << unknown.err;
}

// A GEMM on operands holding NaN still runs, with a warning naming the file and tensor; a shape
// mismatch names the file.
TEST(CliGemm, NonFiniteOperandsWarnAndShapeErrorsNameTheFile) {
  temporary_directory directory;
  std::vector<float> x = test_values(8, 32, 6);
  x[3] = std::numeric_limits<float>::quiet_NaN();
  x[4] = std::numeric_limits<float>::infinity();
  write_safetensors_by_hand(directory / "in.safetensors",
                            {f32_tensor("x", 8, 32, x), f32_tensor("dy", 8, 16, test_values(8, 16, 7))});
  const auto result = run_cli({"gemm", "--in", (directory / "in.safetensors").string(), "--gemm", "wgrad", "--format",
                               "mxfp4", "--accum", "fp32-block", "--out", (directory / "out.safetensors").string()});
  EXPECT_EQ(result.code, 0) << result.err;
  EXPECT_NE(result.err.find("warning: " + (directory / "in.safetensors").string() + ": tensor 'x' holds 1 NaN and 1 "
                                                                                    "infinite values"),
            std::string::npos)
      << result.err;
  write_safetensors_by_hand(directory / "k.safetensors", {f32_tensor("x", 8, 32, test_values(8, 32, 6)),
                                                          f32_tensor("dy", 6, 16, test_values(6, 16, 7))});
  const auto mismatch = run_cli({"gemm", "--in", (directory / "k.safetensors").string(), "--gemm", "wgrad", "--format",
                                 "mxfp4", "--accum", "fp32-block", "--out", (directory / "k.out").string()});
  EXPECT_EQ(mismatch.code, 2);
  EXPECT_NE(mismatch.err.find((directory / "k.safetensors").string() + ": gemm wgrad: shapes disagree on K"),
            std::string::npos)
      << mismatch.err;
  EXPECT_FALSE(fs::exists(directory / "k.out"));
}

// -o is --out on every command that writes a file or directory.
TEST(Cli, ShortOutputFlagOnEveryCommand) {
  temporary_directory directory;
  write_safetensors_by_hand(directory / "in.safetensors", {f32_tensor("x", 4, 32, test_values(4, 32, 8)),
                                                           f32_tensor("dy", 4, 16, test_values(4, 16, 9))});
  const auto quantized = run_cli({"quantize", "--in", (directory / "in.safetensors").string(), "--tensor", "x",
                                  "--format", "mxfp4", "-o", (directory / "q.safetensors").string()});
  EXPECT_EQ(quantized.code, 0) << quantized.err;
  EXPECT_TRUE(fs::exists(directory / "q.safetensors"));
  const auto multiplied = run_cli({"gemm", "--in", (directory / "in.safetensors").string(), "--gemm", "wgrad",
                                   "--format", "mxfp4", "--accum", "fp32-block", "-o", (directory / "g.safetensors").string()});
  EXPECT_EQ(multiplied.code, 0) << multiplied.err;
  EXPECT_TRUE(fs::exists(directory / "g.safetensors"));
  const auto replayed = run_cli({"replay", (directory / "no-dump").string(), "--analysis", "a.toml", "-o",
                                 (directory / "run").string()});
  EXPECT_EQ(replayed.code, 2);
  EXPECT_EQ(replayed.err.find("--out is required"), std::string::npos) << replayed.err;
  EXPECT_NE(replayed.err.find("a.toml"), std::string::npos) << replayed.err;
}

TEST(Cli, UsageErrorsExitTwo) {
  for (const auto& arguments : std::vector<std::vector<std::string>>{
           {}, {"frobnicate"}, {"inspect"}, {"quantize", "--in", "a"}, {"inspect", "a", "--bogus"}}) {
    const auto result = run_cli(arguments);
    EXPECT_EQ(result.code, 2) << joined(arguments);
    EXPECT_FALSE(result.err.empty()) << joined(arguments);
  }
}

TEST(CliInspect, ListsTensorsWithRangesAndNonFiniteCounts) {
  temporary_directory directory;
  const float inf = std::numeric_limits<float>::infinity();
  std::string bf16_bytes;
  for (const std::uint16_t bits : {0x3f80, 0xc040, 0x7fc0, 0x0000}) {  // 1, -3, NaN, 0
    bf16_bytes.push_back(static_cast<char>(bits & 0xFF));
    bf16_bytes.push_back(static_cast<char>(bits >> 8));
  }
  const fs::path path = directory / "in.safetensors";
  write_safetensors_by_hand(path,
                            {f32_tensor("x", 2, 3, {1.0f, -2.0f, std::nanf(""), inf, 0.5f, -inf}),
                             {"dy", "BF16", {4}, bf16_bytes},
                             {"ids", "I64", {2}, std::string(16, '\0')}},
                            R"({"source":"unit test","step":"7"})");
  const auto result = run_cli({"inspect", path.string()});
  ASSERT_EQ(result.code, 0) << result.err;
  std::map<std::string, std::vector<std::string>> rows;
  std::istringstream lines(result.out);
  std::string line;
  std::vector<std::string> header;
  while (std::getline(lines, line)) {
    std::istringstream fields(line);
    std::vector<std::string> row;
    for (std::string field; fields >> field;) row.push_back(field);
    if (!row.empty() && row[0] == "name") header = row;
    if (row.size() == 8 && row[0] != "name") rows[row[0]] = row;
  }
  EXPECT_EQ(header, (std::vector<std::string>{"name", "dtype", "shape", "min", "max", "mean_abs", "nan", "inf"})) << result.out;
  // x: finite values 1, -2, 0.5 -> min -2, max 1, mean |.| 3.5 / 3.
  EXPECT_EQ(rows["x"], (std::vector<std::string>{"x", "F32", "[2,3]", "-2", "1", fmt::format("{:.6g}", 3.5 / 3.0), "1", "2"}))
      << result.out;
  EXPECT_EQ(rows["dy"], (std::vector<std::string>{"dy", "BF16", "[4]", "-3", "1", fmt::format("{:.6g}", 4.0 / 3.0), "1", "0"}))
      << result.out;
  EXPECT_EQ(rows["ids"], (std::vector<std::string>{"ids", "I64", "[2]", "0", "0", "0", "0", "0"})) << result.out;
  EXPECT_NE(result.out.find("  source = unit test\n"), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("  step = 7\n"), std::string::npos) << result.out;
}

TEST(CliInspect, BadPathsExitTwoWithTheirNames) {
  temporary_directory directory;
  const auto missing = run_cli({"inspect", (directory / "missing.safetensors").string()});
  EXPECT_EQ(missing.code, 2);
  EXPECT_NE(missing.err.find("missing.safetensors: no such file"), std::string::npos) << missing.err;

  const auto plain_directory = run_cli({"inspect", directory.path().string()});
  EXPECT_EQ(plain_directory.code, 2);
  EXPECT_NE(plain_directory.err.find("manifest.json"), std::string::npos) << plain_directory.err;

  std::ofstream(directory / "manifest.json") << "{}";
  const auto dump = run_cli({"inspect", directory.path().string()});
  EXPECT_EQ(dump.code, 2);
  EXPECT_NE(dump.err.find("dump directory"), std::string::npos) << dump.err;

  const fs::path corrupt = directory / "corrupt.safetensors";
  std::ofstream(corrupt, std::ios::binary) << std::string("\x10\0\0\0\0\0\0\0{\"a\":1}         ", 24);
  const auto bad = run_cli({"inspect", corrupt.string()});
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("corrupt.safetensors: tensor 'a': field 'entry'"), std::string::npos) << bad.err;
  EXPECT_TRUE(bad.out.empty()) << bad.out;
}

// MXFP4 with the OCP floor rule and RNE: the output decodes back to itself from codes and scales,
// and the codes are what a brute-force nearest search over the fp4 table gives.
void check_mxfp4(int axis, std::int64_t rows, std::int64_t cols, int block) {
  SCOPED_TRACE(fmt::format("mxfp4 axis {} shape [{}, {}] block {}", axis, rows, cols, block));
  temporary_directory directory;
  const std::vector<float> input = test_values(rows, cols, 99 + static_cast<unsigned>(axis));
  write_safetensors_by_hand(directory / "in.safetensors", {f32_tensor("x", rows, cols, input)});
  const fs::path out_path = directory / "out.safetensors";
  const std::vector<std::string> arguments = {"quantize", "--in", (directory / "in.safetensors").string(), "--tensor", "x",
                                              "--format", "mxfp4", "--axis", std::to_string(axis), "--block",
                                              std::to_string(block), "--seed", "17", "--step", "3", "--layer", "blk.0",
                                              "--out", out_path.string()};
  const auto result = run_cli(arguments);
  ASSERT_EQ(result.code, 0) << joined(arguments) << "\n" << result.err;
  const output_file out = read_output(out_path);
  ASSERT_EQ(out.tensors.size(), 3U);
  const auto& values = out.tensors.at("x");
  const auto& codes = out.tensors.at("x.codes");
  const auto& scales = out.tensors.at("x.scales");
  const std::int64_t blocks = ((axis == 1 ? cols : rows) + block - 1) / block;
  EXPECT_EQ(values.dtype, "F32");
  EXPECT_EQ(values.shape, (std::vector<std::int64_t>{rows, cols}));
  EXPECT_EQ(codes.dtype, "U8");
  EXPECT_EQ(codes.shape, (std::vector<std::int64_t>{rows, (cols + 1) / 2}));
  EXPECT_EQ(scales.dtype, "U8");
  EXPECT_EQ(scales.shape, axis == 1 ? (std::vector<std::int64_t>{rows, blocks}) : (std::vector<std::int64_t>{blocks, cols}));

  const std::vector<float> dequantized = values.floats();
  const std::int64_t code_row_bytes = (cols + 1) / 2;
  std::int64_t flushed = 0, saturated = 0, nonzero = 0;
  int mismatches = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      const std::uint8_t byte = codes.bytes[static_cast<std::size_t>(r * code_row_bytes + c / 2)];
      const unsigned code = c % 2 == 0 ? (byte & 0x0FU) : (byte >> 4);
      const std::int64_t b = (axis == 1 ? c : r) / block;
      const unsigned scale = scales.bytes[static_cast<std::size_t>(axis == 1 ? r * blocks + b : b * cols + c)];
      const double decoded = fp4_value(code) * e8m0_value(scale);
      const float actual = dequantized[static_cast<std::size_t>(r * cols + c)];

      // Oracle: the block's amax, e = floor(log2 amax) - 2 (emax of e2m1), then the nearest fp4
      // magnitude of |v| / 2^e (ties to the even code), saturating at 6.
      double amax = 0.0;
      for (std::int64_t k = b * block; k < std::min<std::int64_t>((b + 1) * block, axis == 1 ? cols : rows); ++k) {
        amax = std::max(amax, std::fabs(static_cast<double>(axis == 1 ? input[static_cast<std::size_t>(r * cols + k)]
                                                                       : input[static_cast<std::size_t>(k * cols + c)])));
      }
      const double v = input[static_cast<std::size_t>(r * cols + c)];
      int exponent = -127;
      if (amax > 0) {
        int binade = 0;
        std::frexp(amax, &binade);  // amax = f * 2^binade, f in [0.5, 1)
        exponent = std::max(-127, binade - 1 - 2);
      }
      const double scaled = std::fabs(v) / std::ldexp(1.0, exponent);
      unsigned best = 0;
      for (unsigned candidate = 1; candidate < 8; ++candidate) {
        const double distance = std::fabs(fp4_magnitudes[candidate] - scaled);
        const double best_distance = std::fabs(fp4_magnitudes[best] - scaled);
        if (distance < best_distance || (distance == best_distance && candidate % 2 == 0)) best = candidate;
      }
      const double expected = (v < 0 ? -1.0 : 1.0) * fp4_magnitudes[best] * std::ldexp(1.0, exponent);
      nonzero += v != 0.0;
      flushed += v != 0.0 && best == 0;
      saturated += scaled > 6.0;
      if (bits_of(actual) != bits_of(static_cast<float>(decoded)) || static_cast<float>(expected) != actual ||
          unsigned(scale) != unsigned(exponent + 127)) {
        if (++mismatches <= 10) {
          ADD_FAILURE() << fmt::format(
              "element ({}, {}): input {} (0x{:08x}), code 0x{:x}, scale 0x{:02x} -> decoded {}, stored {} (0x{:08x}); "
              "oracle scale 0x{:02x}, value {}",
              r, c, v, bits_of(static_cast<float>(v)), code, scale, decoded, actual, bits_of(actual), exponent + 127,
              expected);
        }
      }
    }
  }
  EXPECT_EQ(mismatches, 0);

  // The statistics table, against the test's own fp64 computation.
  const error_norms norms = measure(input, dequantized);
  EXPECT_EQ(metric(result.out, "elements"), std::to_string(rows * cols)) << result.out;
  EXPECT_EQ(metric(result.out, "nonzero"), std::to_string(nonzero)) << result.out;
  EXPECT_EQ(metric(result.out, "flushed"), std::to_string(flushed)) << result.out;
  EXPECT_EQ(metric(result.out, "saturated"), std::to_string(saturated)) << result.out;
  EXPECT_EQ(metric(result.out, "nonfinite"), "0") << result.out;
  EXPECT_NEAR(std::stod(metric(result.out, "rel_err")), norms.relative, 1e-8 * norms.relative) << result.out;
  EXPECT_NEAR(std::stod(metric(result.out, "snr_db")), -20.0 * std::log10(norms.relative), 1e-5) << result.out;
  EXPECT_NEAR(std::stod(metric(result.out, "max_abs_err")), norms.max_abs, 1e-8 * norms.max_abs) << result.out;
  EXPECT_NEAR(std::stod(metric(result.out, "flushed_frac")), static_cast<double>(flushed) / nonzero, 1e-8) << result.out;

  // The recipe.
  const std::map<std::string, std::string> expected_metadata = {
      {"format", "mxfp4"}, {"block", std::to_string(block)}, {"axis", std::to_string(axis)}, {"rounding", "rne"},
      {"scale_rule", "floor"}, {"rotation", "none"}, {"signs", "none"}, {"seed", "17"}, {"step", "3"},
      {"sr_bits", "32"}, {"layer", "blk.0"}, {"seed_policy", "per-step"}, {"basis", "input"}};
  for (const auto& [key, value] : expected_metadata) {
    ASSERT_EQ(out.metadata.count(key), 1U) << key;
    EXPECT_EQ(out.metadata.at(key), value) << key;
  }
  EXPECT_NE(out.metadata.at("mxscope_version").find(mxscope::version_string), std::string::npos);
  EXPECT_NE(out.metadata.at("mxscope_version").find(mxscope::git_hash), std::string::npos);
  EXPECT_EQ(directory.listing(), (std::vector<std::string>{"in.safetensors", "out.safetensors"}));
}

TEST(CliQuantize, Mxfp4AlongRowsWithAShortLastBlock) { check_mxfp4(1, 6, 70, 32); }
TEST(CliQuantize, Mxfp4AlongColumnsWithAShortLastBlock) { check_mxfp4(0, 45, 5, 16); }
TEST(CliQuantize, Mxfp4OddColumnCountPacksTheLastNibble) { check_mxfp4(1, 3, 7, 4); }

TEST(CliQuantize, Nvfp4DecodesFromCodesBlockScalesAndTensorScale) {
  temporary_directory directory;
  const std::int64_t rows = 4, cols = 40;
  const std::vector<float> input = test_values(rows, cols, 5);
  write_safetensors_by_hand(directory / "in.safetensors", {f32_tensor("w", rows, cols, input)});
  const auto result = run_cli({"quantize", "--in", (directory / "in.safetensors").string(), "--tensor", "w", "--format",
                               "nvfp4", "--out", (directory / "out.safetensors").string()});
  ASSERT_EQ(result.code, 0) << result.err;
  const output_file out = read_output(directory / "out.safetensors");
  ASSERT_EQ(out.tensors.size(), 4U);
  const auto& codes = out.tensors.at("w.codes");
  const auto& scales = out.tensors.at("w.scales");
  const auto& tensor_scale = out.tensors.at("w.tensor_scale");
  EXPECT_EQ(codes.shape, (std::vector<std::int64_t>{rows, cols / 2}));
  EXPECT_EQ(scales.dtype, "U8");
  EXPECT_EQ(scales.shape, (std::vector<std::int64_t>{rows, 3}));
  EXPECT_EQ(tensor_scale.dtype, "F32");
  EXPECT_EQ(tensor_scale.shape, (std::vector<std::int64_t>{1}));
  EXPECT_EQ(out.metadata.at("block"), "16");
  // TransformerEngine's decode: (element * block scale) * tensor scale, each product in fp32.
  const float global = tensor_scale.floats()[0];
  double amax = 0;
  for (const float v : input) amax = std::max(amax, std::fabs(static_cast<double>(v)));
  EXPECT_EQ(global, static_cast<float>(1.0f / (448.0f * 6.0f / static_cast<float>(amax))));
  const std::vector<float> values = out.tensors.at("w").floats();
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      const std::uint8_t byte = codes.bytes[static_cast<std::size_t>(r * cols / 2 + c / 2)];
      const unsigned code = c % 2 == 0 ? (byte & 0x0FU) : (byte >> 4);
      const unsigned scale = scales.bytes[static_cast<std::size_t>(r * 3 + c / 16)];
      ASSERT_EQ(scale & 0x80U, 0U) << "ue4m3 scales have no sign";
      const float expected = (static_cast<float>(fp4_value(code)) * static_cast<float>(e4m3_value(scale))) * global;
      const float actual = values[static_cast<std::size_t>(r * cols + c)];
      EXPECT_EQ(bits_of(actual), bits_of(expected))
          << fmt::format("({}, {}) input {} code 0x{:x} scale 0x{:02x} tensor scale {}: expected {} got {}", r, c,
                         input[static_cast<std::size_t>(r * cols + c)], code, scale, global, expected, actual);
    }
  }
}

TEST(CliQuantize, PerTensorFp8AndBf16) {
  temporary_directory directory;
  const std::int64_t rows = 3, cols = 10;
  const std::vector<float> input = test_values(rows, cols, 8);
  write_safetensors_by_hand(directory / "in.safetensors", {f32_tensor("x", rows, cols, input)});

  auto fp8 = run_cli({"quantize", "--in", (directory / "in.safetensors").string(), "--tensor", "x", "--format", "fp8_e4m3",
                      "--out", (directory / "fp8.safetensors").string()});
  ASSERT_EQ(fp8.code, 0) << fp8.err;
  const output_file fp8_out = read_output(directory / "fp8.safetensors");
  EXPECT_EQ(fp8_out.tensors.at("x.codes").shape, (std::vector<std::int64_t>{rows, cols}));
  EXPECT_EQ(fp8_out.tensors.at("x.scales").dtype, "F32");
  EXPECT_EQ(fp8_out.tensors.at("x.scales").shape, (std::vector<std::int64_t>{1}));
  double amax = 0;
  for (const float v : input) amax = std::max(amax, std::fabs(static_cast<double>(v)));
  const float scale = fp8_out.tensors.at("x.scales").floats()[0];
  EXPECT_EQ(scale, static_cast<float>(amax) / 448.0f);
  const auto fp8_values = fp8_out.tensors.at("x").floats();
  for (std::size_t i = 0; i < input.size(); ++i) {
    const unsigned code = fp8_out.tensors.at("x.codes").bytes[i];
    const float expected = static_cast<float>(e4m3_value(code)) * scale;
    EXPECT_EQ(bits_of(fp8_values[i]), bits_of(expected)) << fmt::format("element {} code 0x{:02x}", i, code);
  }
  EXPECT_EQ(fp8_out.metadata.at("block"), "0");

  auto bf16 = run_cli({"quantize", "--in", (directory / "in.safetensors").string(), "--tensor", "x", "--format", "bf16",
                       "--out", (directory / "bf16.safetensors").string()});
  ASSERT_EQ(bf16.code, 0) << bf16.err;
  const output_file bf16_out = read_output(directory / "bf16.safetensors");
  const auto& codes = bf16_out.tensors.at("x.codes");
  EXPECT_EQ(codes.dtype, "U8");
  EXPECT_EQ(codes.shape, (std::vector<std::int64_t>{rows, 2 * cols}));
  EXPECT_EQ(bf16_out.tensors.at("x.scales").floats(), std::vector<float>{1.0f});
  const auto bf16_values = bf16_out.tensors.at("x").floats();
  for (std::size_t i = 0; i < input.size(); ++i) {
    const std::uint32_t pattern = codes.bytes[2 * i] | (static_cast<std::uint32_t>(codes.bytes[2 * i + 1]) << 8);
    EXPECT_EQ(bits_of(bf16_values[i]), pattern << 16) << "element " << i;
    // RNE to bf16, computed from the fp32 bits.
    const std::uint32_t bits = bits_of(input[i]);
    const std::uint32_t rounded = (bits + 0x7FFFU + ((bits >> 16) & 1U)) >> 16;
    EXPECT_EQ(pattern, rounded) << fmt::format("element {} input 0x{:08x}", i, bits);
  }
}

// With a rotation the stored values live in the rotated basis and the statistics compare against
// the rotated input: here H_4 / 2 along rows, computed by hand (exact for these inputs).
TEST(CliQuantize, RotationStatisticsUseTheRotatedInput) {
  temporary_directory directory;
  const std::vector<float> input = {1, 2, 3, 4, -1, 0.5f, 0.25f, 8, 0, 0, 0, 1, 5, -5, 5, -5};
  write_safetensors_by_hand(directory / "in.safetensors", {f32_tensor("x", 2, 8, input)});
  const auto result = run_cli({"quantize", "--in", (directory / "in.safetensors").string(), "--tensor", "x", "--format",
                               "mxfp8_e4m3", "--block", "4", "--rotation", "hadamard:4", "--out",
                               (directory / "out.safetensors").string()});
  ASSERT_EQ(result.code, 0) << result.err;
  std::vector<float> rotated(input.size());
  for (std::size_t segment = 0; segment < input.size(); segment += 4) {
    const float a = input[segment], b = input[segment + 1], c = input[segment + 2], d = input[segment + 3];
    rotated[segment] = (a + b + c + d) / 2;
    rotated[segment + 1] = (a - b + c - d) / 2;
    rotated[segment + 2] = (a + b - c - d) / 2;
    rotated[segment + 3] = (a - b - c + d) / 2;
  }
  const output_file out = read_output(directory / "out.safetensors");
  const auto values = out.tensors.at("x").floats();
  const error_norms norms = measure(rotated, values);
  // A few quarter-steps of e4m3 apart at most: the stored values track the rotated input.
  for (std::size_t i = 0; i < rotated.size(); ++i) {
    EXPECT_NEAR(values[i], rotated[i], std::fabs(rotated[i]) / 16 + 1e-6) << "element " << i;
  }
  EXPECT_NEAR(std::stod(metric(result.out, "rel_err")), norms.relative, 1e-8 * norms.relative + 1e-15) << result.out;
  EXPECT_EQ(out.metadata.at("rotation"), "hadamard:4");
  EXPECT_EQ(out.metadata.at("basis").rfind("rotated", 0), 0U) << out.metadata.at("basis");
}

// Stochastic rounding: every code equals the test-side SR decision with the canonical stream
// (seed, step under the policy, fnv1a32(layer) ^ role) from a Philox written in the test.
void check_stochastic_mxfp4(const std::string& tensor, std::uint32_t role, const std::string& policy, std::uint32_t step) {
  SCOPED_TRACE(fmt::format("tensor {} policy {} step {}", tensor, policy, step));
  temporary_directory directory;
  const std::int64_t rows = 5, cols = 32;
  const std::vector<float> input = test_values(rows, cols, 31);
  write_safetensors_by_hand(directory / "in.safetensors", {f32_tensor(tensor, rows, cols, input)});
  const std::uint64_t seed = 0x123456789abcdefULL;
  const auto result = run_cli({"quantize", "--in", (directory / "in.safetensors").string(), "--tensor", tensor,
                               "--format", "mxfp4", "--rounding", "sr", "--seed", std::to_string(seed), "--step",
                               std::to_string(step), "--layer", "layers.3.mlp", "--seed-policy", policy, "--out",
                               (directory / "out.safetensors").string()});
  ASSERT_EQ(result.code, 0) << result.err;
  const output_file out = read_output(directory / "out.safetensors");
  const auto& codes = out.tensors.at(tensor + ".codes").bytes;
  const auto& scales = out.tensors.at(tensor + ".scales").bytes;
  const std::uint32_t tag = reference::fnv1a32("layers.3.mlp") ^ role;
  const std::uint32_t counter_step = policy == "fixed" ? 0 : step;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      const std::size_t n = static_cast<std::size_t>(r * cols + c);
      const double scaled = std::fabs(static_cast<double>(input[n])) / e8m0_value(scales[static_cast<std::size_t>(r)]);
      // fp4 spacing: 0.5 below 2, 1 in [2, 4), 2 from 4.
      const double ulp = scaled < 2 ? 0.5 : (scaled < 4 ? 1.0 : 2.0);
      const double steps = std::floor(scaled / ulp);
      const double fraction = scaled / ulp - steps;
      const std::uint64_t top = static_cast<std::uint64_t>(std::ldexp(fraction, 32));
      const std::uint32_t word = reference::stream_word(seed, counter_step, tag, n);
      const double magnitude = std::min(6.0, (steps + (top + word >= (1ULL << 32) ? 1 : 0)) * ulp);
      const std::uint8_t byte = codes[static_cast<std::size_t>(r * cols / 2 + c / 2)];
      const unsigned code = c % 2 == 0 ? (byte & 0x0FU) : (byte >> 4);
      ASSERT_EQ(fp4_magnitudes[code & 7U], magnitude)
          << fmt::format("element ({}, {}) input {} scaled {} word 0x{:08x} code 0x{:x}", r, c, input[n], scaled, word, code);
    }
  }
}

TEST(CliQuantize, StochasticRoundingFollowsTheCanonicalStream) {
  check_stochastic_mxfp4("dy", reference::role_dy, "per-step", 11);
  check_stochastic_mxfp4("x", reference::role_x, "per-step", 11);
  check_stochastic_mxfp4("w", reference::role_w, "fixed", 11);
  check_stochastic_mxfp4("other", 0, "per-step", 2);
}

TEST(CliQuantize, OutputIsByteReproducible) {
  temporary_directory directory;
  write_safetensors_by_hand(directory / "in.safetensors", {f32_tensor("dy", 4, 64, test_values(4, 64, 3))});
  auto run_to = [&](const std::string& name) {
    const auto result = run_cli({"quantize", "--in", (directory / "in.safetensors").string(), "--tensor", "dy",
                                 "--format", "mxfp6_e2m3", "--rounding", "sr", "--seed", "9", "--rotation", "hadamard:16",
                                 "--signs", "per-step", "--step", "4", "--out", (directory / name).string()});
    EXPECT_EQ(result.code, 0) << result.err;
    std::ifstream file(directory / name, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
  };
  const std::string first = run_to("a.safetensors");
  EXPECT_FALSE(first.empty());
  EXPECT_EQ(first, run_to("b.safetensors"));
}

// ---------------------------------------------------------------------------------------------
// Bad inputs: exit 2, the message names the flag (or file, tensor, field) and the value, and the
// output path does not exist afterwards.

struct bad_case {
  std::vector<std::string> extra;  // replaces or adds flags
  std::vector<std::string> fragments;
  std::string tensor = "x";
  std::string format = "mxfp4";
};

TEST(CliQuantize, BadInputsExitTwoNameTheProblemAndWriteNothing) {
  temporary_directory directory;
  const fs::path input = directory / "in.safetensors";
  write_safetensors_by_hand(input, {f32_tensor("x", 4, 24, test_values(4, 24, 1)),
                                    {"cube", "F32", {2, 2, 2}, std::string(32, '\0')},
                                    {"ids", "I32", {4}, std::string(16, '\0')},
                                    {"empty", "F32", {0, 8}, ""}});
  const fs::path out = directory / "out.safetensors";
  const std::vector<bad_case> cases = {
      {{}, {"--format", "mxfp5"}, "x", "mxfp5"},
      {{}, {"--format", "'fp32'"}, "x", "fp32"},
      {{"--rounding", "rnx"}, {"--rounding", "rnx"}},
      {{"--scale-rule", "round"}, {"--scale-rule", "round"}},
      {{"--axis", "2"}, {"--axis", "2"}},
      {{"--axis", "-1"}, {"--axis", "-1"}},
      {{"--block", "0"}, {"--block", "0"}},
      {{"--block", "-8"}, {"--block", "-8"}},
      {{"--block", "32"}, {"--block", "nvfp4", "32"}, "x", "nvfp4"},
      {{"--block", "abc"}, {"--block", "abc"}},
      {{"--rotation", "hadamard:12"}, {"--rotation", "hadamard:12", "power of two"}},
      {{"--rotation", "hadamard:8192"}, {"--rotation", "8192"}},
      {{"--rotation", "hadamard:"}, {"--rotation", "integer"}},
      {{"--rotation", "hadamard:16"}, {"--rotation", "hadamard:16", "does not divide", "24", "tensor 'x'"}},
      {{"--rotation", "hadamard:8", "--axis", "0"}, {"--rotation", "hadamard:8", "does not divide", "4"}},
      {{"--rotation", "givens"}, {"--rotation", "givens"}},
      {{"--signs", "fixed"}, {"--signs", "fixed", "--rotation"}},
      {{"--signs", "sometimes", "--rotation", "hadamard:4"}, {"--signs", "sometimes"}},
      {{"--sr-bits", "0"}, {"--sr-bits", "0"}},
      {{"--sr-bits", "33"}, {"--sr-bits", "33"}},
      {{"--seed-policy", "daily"}, {"--seed-policy", "daily"}},
      {{"--seed", "x1"}, {"--seed", "x1"}},
      {{}, {"in.safetensors", "no tensor named 'nope'", "available: cube, empty, ids, x"}, "nope"},
      {{}, {"tensor 'cube'", "field 'shape'", "rank 3"}, "cube"},
      {{}, {"tensor 'ids'", "field 'dtype'", "I32"}, "ids"},
      {{}, {"tensor 'empty'", "field 'shape'", "no elements"}, "empty"},
  };
  for (const auto& test : cases) {
    std::vector<std::string> arguments = {"quantize", "--in", input.string(), "--tensor", test.tensor, "--format",
                                          test.format, "--out", out.string()};
    arguments.insert(arguments.end(), test.extra.begin(), test.extra.end());
    const auto result = run_cli(arguments);
    EXPECT_EQ(result.code, 2) << joined(arguments) << "\n" << result.out << result.err;
    for (const auto& fragment : test.fragments) {
      EXPECT_NE(result.err.find(fragment), std::string::npos)
          << joined(arguments) << "\n  message lacks '" << fragment << "': " << result.err;
    }
    EXPECT_FALSE(fs::exists(out)) << joined(arguments);
    EXPECT_EQ(directory.listing(), std::vector<std::string>{"in.safetensors"}) << joined(arguments);
  }

  // Input files that are missing or corrupt.
  const auto missing = run_cli({"quantize", "--in", (directory / "gone.safetensors").string(), "--tensor", "x",
                                "--format", "mxfp4", "--out", out.string()});
  EXPECT_EQ(missing.code, 2);
  EXPECT_NE(missing.err.find("gone.safetensors: no such file"), std::string::npos) << missing.err;
  EXPECT_FALSE(fs::exists(out));

  // An output path in a directory that does not exist.
  const fs::path nowhere = directory / "no-such-dir" / "out.safetensors";
  const auto unwritable =
      run_cli({"quantize", "--in", input.string(), "--tensor", "x", "--format", "mxfp4", "--out", nowhere.string()});
  EXPECT_EQ(unwritable.code, 2);
  EXPECT_NE(unwritable.err.find(nowhere.string()), std::string::npos) << unwritable.err;
  EXPECT_FALSE(fs::exists(nowhere));

  // A failed run leaves an existing output untouched.
  std::ofstream(out) << "previous result";
  const auto failed = run_cli({"quantize", "--in", input.string(), "--tensor", "x", "--format", "mxfp4", "--axis", "7",
                               "--out", out.string()});
  EXPECT_EQ(failed.code, 2);
  std::ifstream kept(out);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(kept), std::istreambuf_iterator<char>()), "previous result");
}

// A write that fails halfway (the file size limit stops it) leaves neither the output nor the
// temporary file: the CLI's outputs are all-or-nothing.
TEST(CliQuantize, WriteFailureMidFileLeavesNoOutput) {
  temporary_directory directory;
  write_safetensors_by_hand(directory / "in.safetensors", {f32_tensor("x", 64, 64, test_values(64, 64, 2))});
  const fs::path out = directory / "out.safetensors";
  rlimit original{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &original), 0);
  const auto previous_handler = signal(SIGXFSZ, SIG_IGN);  // get EFBIG instead of a signal
  rlimit limited = original;
  limited.rlim_cur = 4096;  // the output is about 20 KB
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &limited), 0);
  const auto result = run_cli({"quantize", "--in", (directory / "in.safetensors").string(), "--tensor", "x", "--format",
                               "mxfp4", "--out", out.string()});
  setrlimit(RLIMIT_FSIZE, &original);
  signal(SIGXFSZ, previous_handler);
  EXPECT_EQ(result.code, 2) << result.out;
  EXPECT_NE(result.err.find("write failed"), std::string::npos) << result.err;
  EXPECT_FALSE(fs::exists(out));
  EXPECT_EQ(directory.listing(), std::vector<std::string>{"in.safetensors"});
}

// An output that is the input (also through a hard link) or a special file is refused before
// anything is written, and the input keeps its bytes.
TEST(CliQuantize, OutputsNeverReplaceTheInputOrASpecialFile) {
  temporary_directory directory;
  const fs::path input = directory / "in.safetensors";
  write_safetensors_by_hand(input, {f32_tensor("x", 8, 32, test_values(8, 32, 3)),
                                    f32_tensor("dy", 8, 16, test_values(8, 16, 4)),
                                    f32_tensor("w", 16, 32, test_values(16, 32, 5))});
  fs::create_hard_link(input, directory / "link.safetensors");
  fs::create_symlink(directory / "elsewhere", directory / "symlink.safetensors");
  ASSERT_EQ(::mkfifo((directory / "fifo").c_str(), 0600), 0);
  std::ifstream original_stream(input, std::ios::binary);
  const std::string original((std::istreambuf_iterator<char>(original_stream)), std::istreambuf_iterator<char>());
  struct output_case {
    std::string out;
    std::string fragment;
  };
  const std::vector<output_case> outputs = {{input.string(), "is the input --in"},
                                            {(directory / "link.safetensors").string(), "is the input --in"},
                                            {(directory / "symlink.safetensors").string(), "symbolic link"},
                                            {(directory / "fifo").string(), "not a regular file"},
                                            {"/dev/null", "not a regular file"}};
  for (const auto& output : outputs) {
    for (const std::vector<std::string>& command :
         {std::vector<std::string>{"quantize", "--tensor", "x", "--format", "mxfp4"},
          std::vector<std::string>{"gemm", "--gemm", "wgrad", "--format", "mxfp4", "--accum", "fp32-block"}}) {
      std::vector<std::string> arguments = command;
      arguments.insert(arguments.end(), {"--in", input.string(), "--out", output.out});
      const auto result = run_cli(arguments);
      EXPECT_EQ(result.code, 2) << joined(arguments) << "\n" << result.err;
      EXPECT_NE(result.err.find(output.fragment), std::string::npos) << joined(arguments) << "\n" << result.err;
    }
  }
  std::ifstream after_stream(input, std::ios::binary);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(after_stream)), std::istreambuf_iterator<char>()), original);
  EXPECT_TRUE(fs::is_symlink(directory / "symlink.safetensors"));
  EXPECT_FALSE(fs::exists(directory / "elsewhere"));
  EXPECT_TRUE(fs::is_fifo(directory / "fifo"));
  EXPECT_TRUE(fs::is_character_file("/dev/null"));
}

}  // namespace
