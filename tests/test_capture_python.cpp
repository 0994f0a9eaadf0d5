// Bit identity of the PyTorch fake quantizer (tools/capture/mxfp_torch.py) with the C++ quantizer.
//
// The test builds inputs here (fp32, bf16 and fp16 storage, odd shapes, exact rounding ties and their
// fp32 neighbours, subnormals, values near FLT_MAX, NaN and Inf), writes them to a safetensors file,
// runs every recipe through the Python quantizer in one /usr/bin/python3 process, and compares the
// element codes, the e8m0 scale codes, the dequantized fp32 bits and (for rotated recipes) the
// rotated fp32 bits with mxscope::rotate + mxscope::quantize on the same inputs.
// PyTorch is a test requirement (tools/bootstrap installs python3-torch): without it the test fails.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "mxscope/core/philox.hpp"
#include "mxscope/io/safetensors.hpp"
#include "mxscope/quantize.hpp"
#include "python_runner.hpp"

namespace {

namespace fs = std::filesystem;
using mxscope::matrix;
using mxscope::io::dtype;

std::uint32_t bits_of(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return bits;
}

struct input_tensor {
  std::string name;
  dtype storage = dtype::f32;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::vector<std::uint8_t> bytes;
};

input_tensor fp32_input(const std::string& name, std::int64_t rows, std::int64_t cols, const std::vector<float>& values) {
  input_tensor t{name, dtype::f32, rows, cols, std::vector<std::uint8_t>(values.size() * 4)};
  std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
  return t;
}

input_tensor u16_input(const std::string& name, dtype storage, std::int64_t rows, std::int64_t cols,
                       const std::vector<std::uint16_t>& patterns) {
  input_tensor t{name, storage, rows, cols, std::vector<std::uint8_t>(patterns.size() * 2)};
  std::memcpy(t.bytes.data(), patterns.data(), t.bytes.size());
  return t;
}

// Gaussian values with a per-row power-of-two spread.
std::vector<float> gaussian(std::int64_t rows, std::int64_t cols, std::mt19937_64& random, double outlier_rate = 0.0) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::vector<float> values(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r) {
    const float spread = std::ldexp(1.0f, static_cast<int>(r % 9) - 4);
    for (std::int64_t c = 0; c < cols; ++c) {
      float v = normal(random) * spread;
      if (uniform(random) < outlier_rate) v *= 50.0f;
      values[static_cast<std::size_t>(r * cols + c)] = v;
    }
  }
  return values;
}

// Rows of blocks built around the fp4 grid: the block maximum 6 * 2^e fixes the scale exponent e,
// the other elements sit on the e2m1 midpoints (exact ties), one fp32 ulp either side of them,
// beyond the maximum (saturation), at -0 and at tiny magnitudes that flush.
std::vector<float> fp4_tie_rows(std::int64_t rows, std::int64_t cols) {
  const float midpoints[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  const int exponents[] = {0, -3, 7, -30, 31, -126, -140, 125, -149, 100, -60, 3};
  std::vector<float> values(static_cast<std::size_t>(rows * cols), 0.0f);
  for (std::int64_t r = 0; r < rows; ++r) {
    const int e = exponents[r % std::size(exponents)];
    for (std::int64_t c = 0; c < cols; ++c) {
      const std::int64_t k = c % 32;
      float v = 0.0f;
      if (k == 0) {
        v = std::ldexp(6.0f, e);
        if (e == 125 && r % 2 == 1) v = std::ldexp(7.99f, e);  // near FLT_MAX, clips under floor
        if (e == -149) v = std::ldexp(1.0f, -149);               // the smallest subnormal: scale clamps at -127
      } else if (k <= 21) {
        const float m = std::ldexp(midpoints[(k - 1) % 7], e);
        const int side = static_cast<int>((k - 1) / 7);          // 0: the tie, 1: just above, 2: just below
        v = side == 0 ? m : std::nextafter(m, side == 1 ? std::numeric_limits<float>::infinity() : 0.0f);
      } else if (k == 22) {
        v = -0.0f;
      } else if (k == 23) {
        v = std::ldexp(7.0f, e);  // above the maximum of the block's grid: saturates to 6 * 2^e
      } else if (k == 24) {
        v = std::numeric_limits<float>::denorm_min();
      } else {
        v = std::ldexp(static_cast<float>(k - 24), e - 3);
      }
      if ((r + c) % 3 == 1) v = -v;
      values[static_cast<std::size_t>(r * cols + c)] = v;
    }
  }
  return values;
}

std::vector<float> transposed_values(const std::vector<float>& values, std::int64_t rows, std::int64_t cols) {
  std::vector<float> out(values.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) out[static_cast<std::size_t>(c * rows + r)] = values[static_cast<std::size_t>(r * cols + c)];
  }
  return out;
}

struct job {
  std::string input;
  std::string format = "mxfp4";
  int block = 32;
  int axis = 1;
  std::string rounding = "rne";
  std::string scale_rule = "floor";
  int sr_bits = 32;
  std::uint64_t seed = 0x9E3779B97F4A7C15ULL;  // above 2^63: both key words matter
  std::uint32_t step = 7;
  std::string layer = "layers.1.attn.o_proj";
  int role = 1;
  int rotation = 0;
  std::string signs = "none";

  std::string describe() const {
    return fmt::format("input={} format={} block={} axis={} rounding={} scale_rule={} sr_bits={} seed={:#x} step={} "
                       "layer={} role={} rotation={} signs={}",
                       input, format, block, axis, rounding, scale_rule, sr_bits, seed, step, layer, role, rotation,
                       signs);
  }
  nlohmann::json to_json() const {
    return {{"input", input},       {"format", format},   {"block", block}, {"axis", axis},
            {"rounding", rounding}, {"scale_rule", scale_rule}, {"sr_bits", sr_bits}, {"seed", seed},
            {"step", step},         {"layer", layer},     {"role", role},   {"rotation", rotation},
            {"signs", signs}};
  }
};

std::vector<input_tensor> make_inputs() {
  std::mt19937_64 random(20240611);
  std::vector<input_tensor> inputs;
  inputs.push_back(fp32_input("gaussian_f32", 37, 45, gaussian(37, 45, random)));
  const auto ties = fp4_tie_rows(24, 64);
  inputs.push_back(fp32_input("ties_f32", 24, 64, ties));
  inputs.push_back(fp32_input("ties_f32_t", 64, 24, transposed_values(ties, 24, 64)));

  // bf16: the top half of fp32 Gaussians (every pattern is a valid bf16).
  const auto wide = gaussian(48, 64, random, 0.02);
  std::vector<std::uint16_t> bf16(wide.size());
  for (std::size_t i = 0; i < wide.size(); ++i) bf16[i] = static_cast<std::uint16_t>(bits_of(wide[i]) >> 16);
  inputs.push_back(u16_input("gaussian_bf16", dtype::bf16, 48, 64, bf16));

  // fp16: random finite patterns of every magnitude (exponent field 0..30), subnormals included.
  std::uniform_int_distribution<int> pattern(0, 0xFFFF);
  std::vector<std::uint16_t> fp16(33 * 40);
  for (auto& p : fp16) {
    do {
      p = static_cast<std::uint16_t>(pattern(random));
    } while (((p >> 10) & 0x1F) == 0x1F);
  }
  inputs.push_back(u16_input("random_f16", dtype::f16, 33, 40, fp16));

  auto nonfinite = gaussian(6, 70, random);
  nonfinite[1 * 70 + 3] = std::numeric_limits<float>::quiet_NaN();
  nonfinite[2 * 70 + 40] = std::numeric_limits<float>::infinity();
  nonfinite[4 * 70 + 69] = -std::numeric_limits<float>::infinity();
  inputs.push_back(fp32_input("nonfinite_f32", 6, 70, nonfinite));

  inputs.push_back(fp32_input("rotation_f32", 48, 80, gaussian(48, 80, random, 0.02)));
  const auto rotation_wide = gaussian(64, 48, random, 0.05);
  std::vector<std::uint16_t> rotation_bf16(rotation_wide.size());
  for (std::size_t i = 0; i < rotation_wide.size(); ++i) {
    rotation_bf16[i] = static_cast<std::uint16_t>(bits_of(rotation_wide[i]) >> 16);
  }
  inputs.push_back(u16_input("rotation_bf16", dtype::bf16, 64, 48, rotation_bf16));
  return inputs;
}

std::vector<job> make_jobs() {
  std::vector<job> jobs;
  int role = 0;
  auto next_role = [&role] { return 1 + (role++ % 3); };
  // Every input, both axes, round-to-nearest-even and stochastic rounding.
  for (const char* input : {"gaussian_f32", "ties_f32", "ties_f32_t", "gaussian_bf16", "random_f16", "nonfinite_f32"}) {
    for (int axis : {0, 1}) {
      for (const char* rounding : {"rne", "sr"}) {
        job j;
        j.input = input;
        j.axis = axis;
        j.rounding = rounding;
        j.role = next_role();
        jobs.push_back(j);
      }
    }
  }
  // The other rounding modes, scale rules, sr widths, block sizes and a fixed (step 0) stream.
  for (const char* input : {"gaussian_f32", "ties_f32"}) {
    for (int axis : {0, 1}) {
      for (const char* rounding : {"rna", "rtz"}) {
        job j;
        j.input = input;
        j.axis = axis;
        j.rounding = rounding;
        jobs.push_back(j);
      }
      for (const char* rule : {"ceil", "even"}) {
        for (const char* rounding : {"rne", "sr"}) {
          job j;
          j.input = input;
          j.axis = axis;
          j.scale_rule = rule;
          j.rounding = rounding;
          j.role = next_role();
          jobs.push_back(j);
        }
      }
      for (int bits : {1, 3, 16}) {
        job j;
        j.input = input;
        j.axis = axis;
        j.rounding = "sr";
        j.sr_bits = bits;
        jobs.push_back(j);
      }
      for (int block : {16, 7, 1}) {
        job j;
        j.input = input;
        j.axis = axis;
        j.block = block;
        j.rounding = block == 7 ? "sr" : "rne";
        jobs.push_back(j);
      }
      job fixed;
      fixed.input = input;
      fixed.axis = axis;
      fixed.rounding = "sr";
      fixed.step = 0;
      fixed.seed = 1;
      fixed.layer = "layers.2.mlp.down_proj";
      jobs.push_back(fixed);
    }
  }
  // The other MX element formats.
  for (const char* format : {"mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2"}) {
    for (const char* input : {"gaussian_f32", "ties_f32"}) {
      for (const char* rounding : {"rne", "sr"}) {
        job j;
        j.input = input;
        j.format = format;
        j.rounding = rounding;
        j.axis = input[0] == 'g' ? 0 : 1;
        jobs.push_back(j);
      }
    }
  }
  // Block Hadamard rotations: H16 with every sign policy, both axes, both rounding modes; plus the
  // sizes whose scale is not a power of two (log2 odd) and a rotation wider than the MX block.
  for (const char* input : {"rotation_f32", "rotation_bf16"}) {
    for (int axis : {0, 1}) {
      for (const char* signs : {"none", "fixed", "per-step"}) {
        for (const char* rounding : {"rne", "sr"}) {
          job j;
          j.input = input;
          j.axis = axis;
          j.rotation = 16;
          j.signs = signs;
          j.rounding = rounding;
          j.step = 11;
          j.role = next_role();
          jobs.push_back(j);
        }
      }
      for (int size : {2, 8, 32}) {
        const std::int64_t length = std::string(input) == "rotation_f32" ? (axis == 0 ? 48 : 80) : (axis == 0 ? 64 : 48);
        if (length % size != 0) continue;  // (the C++ rejects it; tested in the quantizer's own tests)
        job j;
        j.input = input;
        j.axis = axis;
        j.rotation = size;
        j.signs = "per-step";
        j.rounding = size == 8 ? "sr" : "rne";
        j.layer = "layers.0.mlp.up_proj";
        jobs.push_back(j);
      }
    }
  }
  return jobs;
}

struct python_outputs {
  std::string failure;  // empty when the Python side ran
  std::unique_ptr<mxscope::io::safetensors_reader> reader;
  std::unique_ptr<mxscope::io::safetensors_reader> inputs;
};

class CapturePython : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    scratch_ = new python_runner::temporary_directory("capture-python");
    jobs_ = new std::vector<job>(make_jobs());
    outputs_ = new python_outputs;
    const fs::path dir = scratch_->path();
    if (const std::string problem = python_runner::torch_problem(dir); !problem.empty()) {
      outputs_->failure = problem;
      return;
    }
    mxscope::io::safetensors_writer writer;
    for (auto& input : make_inputs()) {
      writer.add(input.name, input.storage, {input.rows, input.cols}, std::move(input.bytes));
    }
    writer.write(dir / "inputs.safetensors");
    nlohmann::json list = nlohmann::json::array();
    for (const auto& j : *jobs_) list.push_back(j.to_json());
    python_runner::write_text(dir / "jobs.json", list.dump(1));
    const auto result = python_runner::run_script(fs::path(MXSCOPE_SOURCE_DIR) / "tests/python/mxfp_bit_identity.py",
                                                  {(dir / "jobs.json").string(), (dir / "inputs.safetensors").string(),
                                                   (dir / "outputs.safetensors").string()},
                                                  dir / "python.log");
    if (result.exit_code != 0) {
      outputs_->failure = fmt::format("the Python quantizer failed (exit {}):\n{}", result.exit_code, result.output);
      return;
    }
    outputs_->reader = std::make_unique<mxscope::io::safetensors_reader>(dir / "outputs.safetensors");
    outputs_->inputs = std::make_unique<mxscope::io::safetensors_reader>(dir / "inputs.safetensors");
  }
  static void TearDownTestSuite() {
    delete outputs_;
    delete jobs_;
    delete scratch_;
  }

  void SetUp() override { ASSERT_TRUE(outputs_->failure.empty()) << outputs_->failure; }

  // Compares job `index` with the C++ rotate + quantize of the same input.
  static void check_job(std::size_t index) {
    const job& j = (*jobs_)[index];
    SCOPED_TRACE(fmt::format("job {}: {}", index, j.describe()));
    const auto& python = *outputs_->reader;
    const matrix input = outputs_->inputs->read_matrix(j.input);
    matrix operand = input;
    const std::uint32_t layer_hash = mxscope::core::fnv1a32(j.layer.data(), j.layer.size());
    if (j.rotation != 0) {
      mxscope::rotation_options rotation;
      rotation.size = j.rotation;
      rotation.signs = *mxscope::parse_sign_policy(j.signs);
      rotation.seed = j.seed;
      rotation.step = j.step;
      rotation.layer_hash = layer_hash;
      mxscope::rotate(operand, j.axis, rotation, "expected");
      const matrix rotated = python.read_matrix(fmt::format("{}.rotated", index));
      ASSERT_EQ(rotated.rows, operand.rows);
      ASSERT_EQ(rotated.cols, operand.cols);
      int reported = 0;
      for (std::size_t i = 0; i < operand.values.size() && reported < 5; ++i) {
        if (bits_of(rotated.values[i]) != bits_of(operand.values[i])) {
          ++reported;
          ADD_FAILURE() << fmt::format("rotated element {} (row {}, col {}): input {} ({:#010x}) expected {} ({:#010x}) "
                                       "python {} ({:#010x})",
                                       i, i / operand.cols, i % operand.cols, input.values[i], bits_of(input.values[i]),
                                       operand.values[i], bits_of(operand.values[i]), rotated.values[i],
                                       bits_of(rotated.values[i]));
        }
      }
    }
    mxscope::quantize_options options;
    options.format = *mxscope::parse_format(j.format);
    options.block = j.block;
    options.axis = j.axis;
    options.rounding = *mxscope::parse_rounding(j.rounding);
    options.rule = *mxscope::parse_scale_rule(j.scale_rule);
    options.sr_bits = j.sr_bits;
    options.stream = {j.seed, j.step,
                      mxscope::core::stream_tag(layer_hash, static_cast<mxscope::core::random_role>(j.role))};
    const auto expected = mxscope::quantize(operand, options);

    const auto codes_name = fmt::format("{}.codes", index);
    const auto scales_name = fmt::format("{}.scales", index);
    const auto& codes_info = python.at(codes_name);
    const auto& scales_info = python.at(scales_name);
    ASSERT_EQ(codes_info.type, dtype::u8);
    ASSERT_EQ(scales_info.type, dtype::u8);
    ASSERT_EQ(codes_info.shape, (std::vector<std::int64_t>{expected.rows, expected.code_row_bytes()}));
    ASSERT_EQ(scales_info.shape, (std::vector<std::int64_t>{expected.scale_rows, expected.scale_cols}));
    const auto codes = python.read_tensor(codes_name);
    const auto scales = python.read_tensor(scales_name);
    const matrix dequantized = python.read_matrix(fmt::format("{}.dequantized", index));

    int reported = 0;
    for (std::size_t i = 0; i < scales.size() && reported < 5; ++i) {
      if (scales[i] != expected.scales[i]) {
        ++reported;
        ADD_FAILURE() << fmt::format("scale {} (scale row {}, col {}): expected {:#04x} python {:#04x}", i,
                                     static_cast<std::int64_t>(i) / expected.scale_cols,
                                     static_cast<std::int64_t>(i) % expected.scale_cols, expected.scales[i], scales[i]);
      }
    }
    reported = 0;
    for (std::size_t i = 0; i < codes.size() && reported < 5; ++i) {
      if (codes[i] != expected.codes[i]) {
        ++reported;
        const std::int64_t row = static_cast<std::int64_t>(i) / expected.code_row_bytes();
        const std::int64_t byte = static_cast<std::int64_t>(i) % expected.code_row_bytes();
        const std::int64_t col = expected.code_row_bytes() == expected.cols ? byte : 2 * byte;
        ADD_FAILURE() << fmt::format("code byte {} (row {}, first col {}): operand {} ({:#010x}) expected {:#04x} "
                                     "python {:#04x}",
                                     i, row, col, operand(row, col), bits_of(operand(row, col)), expected.codes[i],
                                     codes[i]);
      }
    }
    reported = 0;
    ASSERT_EQ(dequantized.values.size(), expected.dequantized.values.size());
    for (std::size_t i = 0; i < dequantized.values.size() && reported < 5; ++i) {
      if (bits_of(dequantized.values[i]) != bits_of(expected.dequantized.values[i])) {
        ++reported;
        ADD_FAILURE() << fmt::format("dequantized element {} (row {}, col {}): operand {} ({:#010x}) expected {} "
                                     "({:#010x}) python {} ({:#010x})",
                                     i, i / operand.cols, i % operand.cols, operand.values[i],
                                     bits_of(operand.values[i]), expected.dequantized.values[i],
                                     bits_of(expected.dequantized.values[i]), dequantized.values[i],
                                     bits_of(dequantized.values[i]));
      }
    }
  }

  static void check_jobs(const std::function<bool(const job&)>& selected, std::size_t minimum_count) {
    std::size_t count = 0;
    for (std::size_t i = 0; i < jobs_->size(); ++i) {
      if (!selected((*jobs_)[i])) continue;
      ++count;
      check_job(i);
    }
    EXPECT_GE(count, minimum_count) << "fewer jobs than this group is meant to cover";
  }

  static python_runner::temporary_directory* scratch_;
  static std::vector<job>* jobs_;
  static python_outputs* outputs_;
};

python_runner::temporary_directory* CapturePython::scratch_ = nullptr;
std::vector<job>* CapturePython::jobs_ = nullptr;
python_outputs* CapturePython::outputs_ = nullptr;

// One test per Python run: ctest starts every test in its own process, and each process would
// otherwise run the interpreter again.
TEST_F(CapturePython, PythonQuantizerMatchesTheCppQuantizerBitForBit) {
  {
    SCOPED_TRACE("Mxfp4RoundToNearestEvenMatchesBitForBit");
    check_jobs([](const job& j) { return j.format == "mxfp4" && j.rotation == 0 && j.rounding == "rne" &&
                                         j.scale_rule == "floor" && j.block == 32; },
               12);
  }
  {
    SCOPED_TRACE("Mxfp4StochasticRoundingUsesTheSamePhiloxStream");
    check_jobs([](const job& j) { return j.format == "mxfp4" && j.rotation == 0 && j.rounding == "sr"; }, 20);
  }
  {
    SCOPED_TRACE("OtherRoundingModesScaleRulesAndBlockSizesMatch");
    check_jobs([](const job& j) { return j.format == "mxfp4" && j.rotation == 0 &&
                                         (j.rounding == "rna" || j.rounding == "rtz" || j.scale_rule != "floor" ||
                                          j.block != 32); },
               24);
  }
  {
    SCOPED_TRACE("OtherMxElementFormatsMatch");
    check_jobs([](const job& j) { return j.format != "mxfp4"; }, 16);
  }
  {
    SCOPED_TRACE("HadamardRotationsMatchForEverySignPolicy");
    check_jobs([](const job& j) { return j.rotation != 0; }, 33);
  }
  // The comparisons above are only meaningful if stochastic rounding really draws random words: on the
  // tie inputs it must round some ties up and some down, unlike round-to-nearest-even.
  SCOPED_TRACE("StochasticRoundingDiffersFromNearestOnTies");
  const auto& jobs = *jobs_;
  std::size_t nearest = jobs.size(), stochastic = jobs.size();
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    const job& j = jobs[i];
    if (j.input != "ties_f32" || j.axis != 1 || j.format != "mxfp4" || j.block != 32 || j.scale_rule != "floor" ||
        j.rotation != 0 || j.sr_bits != 32 || j.step != 7) {
      continue;
    }
    if (j.rounding == "rne") nearest = i;
    if (j.rounding == "sr") stochastic = i;
  }
  ASSERT_LT(nearest, jobs.size());
  ASSERT_LT(stochastic, jobs.size());
  const auto a = outputs_->reader->read_tensor(fmt::format("{}.codes", nearest));
  const auto b = outputs_->reader->read_tensor(fmt::format("{}.codes", stochastic));
  std::size_t differing = 0;
  for (std::size_t i = 0; i < a.size(); ++i) differing += a[i] != b[i];
  EXPECT_GT(differing, a.size() / 20) << "sr and rne codes are almost identical on exact ties";
}

}  // namespace
