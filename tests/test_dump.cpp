// Dump directories: dumps written by the real capture hook (tools/capture, run on CPU under
// /usr/bin/python3) are accepted by dump_reader and their gradients agree with their operands, and
// corrupt dumps built by hand are rejected with an input_error naming the file and the field.
//
// Gradient oracle: dw_ref = dy^T x computed here in fp64 (products of fp32 values are exact in fp64),
// compared element by element with the bound a GEMM of K terms can miss by: (K + 4) * 2^-24 times
// sum_k |dy_ki x_kj| for fp32 accumulation, plus 2^-8 of the same sum when the framework rounded the
// product to bf16.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "mxscope/cli/cli.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/io/dump.hpp"
#include "mxscope/io/safetensors.hpp"
#include "mxscope/quantize.hpp"
#include "python_runner.hpp"

namespace {

namespace fs = std::filesystem;
using mxscope::input_error;
using mxscope::matrix;
using mxscope::io::dtype;
using mxscope::io::dump_entry;
using mxscope::io::dump_reader;

constexpr double fp32_unit_roundoff = 0x1p-24;
constexpr double bf16_unit_roundoff = 0x1p-8;

std::uint32_t bits_of(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return bits;
}

// Checks dw against dy^T x (fp64) with a per-element bound of relative_bound * sum_k |dy_ki x_kj|;
// returns the relative Frobenius error ||dw - ref|| / ||ref||.
double check_gradient(const matrix& dw, const matrix& dy, const matrix& x, double relative_bound, const std::string& what) {
  EXPECT_EQ(dw.rows, dy.cols) << what;
  EXPECT_EQ(dw.cols, x.cols) << what;
  EXPECT_EQ(dy.rows, x.rows) << what;
  if (dw.rows != dy.cols || dw.cols != x.cols || dy.rows != x.rows) return std::numeric_limits<double>::infinity();
  double error_squared = 0.0, reference_squared = 0.0;
  int reported = 0;
  for (std::int64_t i = 0; i < dw.rows; ++i) {
    for (std::int64_t j = 0; j < dw.cols; ++j) {
      double reference = 0.0, magnitude = 0.0;
      for (std::int64_t k = 0; k < x.rows; ++k) {
        const double product = static_cast<double>(dy(k, i)) * static_cast<double>(x(k, j));
        reference += product;
        magnitude += std::fabs(product);
      }
      const double error = std::fabs(static_cast<double>(dw(i, j)) - reference);
      error_squared += error * error;
      reference_squared += reference * reference;
      if (error > relative_bound * magnitude + 1e-38 && reported < 5) {
        ++reported;
        ADD_FAILURE() << fmt::format("{}: dw({}, {}) = {} ({:#010x}) but dy^T x = {:.17g}; error {:.3g} exceeds "
                                     "{:.3g} x sum|products| = {:.3g}",
                                     what, i, j, dw(i, j), bits_of(dw(i, j)), reference, error, relative_bound,
                                     relative_bound * magnitude);
      }
    }
  }
  return std::sqrt(error_squared / reference_squared);
}

// ------------------------------------------------------------------------------------------------
// Dumps written by the capture hook.

using dump_locator = std::function<fs::path(const char*)>;

class DumpFromCapture : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    scratch_ = new python_runner::temporary_directory("dump-capture");
    failure_ = new std::string;
    const fs::path root = scratch_->path();
    if (const std::string problem = python_runner::torch_problem(root); !problem.empty()) {
      *failure_ = problem;
      return;
    }
    const auto result = python_runner::run_script(fs::path(MXSCOPE_SOURCE_DIR) / "tests/python/make_test_dumps.py",
                                                  {(root / "dumps").string()}, root / "python.log");
    if (result.exit_code != 0) {
      *failure_ = fmt::format("make_test_dumps.py failed (exit {}):\n{}", result.exit_code, result.output);
    }
  }
  static void TearDownTestSuite() {
    delete failure_;
    delete scratch_;
  }
  void SetUp() override { ASSERT_TRUE(failure_->empty()) << *failure_; }
  static fs::path dump(const char* name) { return scratch_->path() / "dumps" / name; }

  static python_runner::temporary_directory* scratch_;
  static std::string* failure_;
};

python_runner::temporary_directory* DumpFromCapture::scratch_ = nullptr;
std::string* DumpFromCapture::failure_ = nullptr;

void check_fp32_gradient_accumulation(const dump_locator& dump) {
  const dump_reader reader(dump("fp32_accumulation"));
  EXPECT_EQ(reader.source().recipe, "fp32 (no autocast, TF32 off)");
  EXPECT_NE(reader.source().extra_json.find("\"grad_accum\":2"), std::string::npos) << reader.source().extra_json;
  ASSERT_EQ(reader.entries().size(), 4U);
  EXPECT_EQ(reader.layers(), (std::vector<std::string>{"layers.0.attn.o_proj", "layers.1.mlp.down_proj"}));
  std::vector<std::pair<std::string, std::int64_t>> visited;
  reader.for_each([&](const dump_entry& entry) {
    const std::string what = fmt::format("{} step {}", entry.info.layer, entry.info.step);
    visited.emplace_back(entry.info.layer, entry.info.step);
    // 2 micro-batches x batch 2 x seq 32 tokens.
    EXPECT_EQ(entry.info.tokens, 128) << what;
    EXPECT_EQ(entry.info.x_type, dtype::f32) << what;
    EXPECT_EQ(entry.info.dy_type, dtype::f32) << what;
    ASSERT_TRUE(entry.w && entry.dw) << what;
    EXPECT_TRUE(entry.all_finite()) << entry.nonfinite_summary();
    EXPECT_TRUE(entry.quantized.empty()) << what;
    const double frobenius = check_gradient(*entry.dw, entry.dy, entry.x, (128 + 4) * fp32_unit_roundoff, what);
    EXPECT_LT(frobenius, 1e-5) << what;
  });
  EXPECT_EQ(visited, (std::vector<std::pair<std::string, std::int64_t>>{{"layers.0.attn.o_proj", 1},
                                                                        {"layers.0.attn.o_proj", 2},
                                                                        {"layers.1.mlp.down_proj", 1},
                                                                        {"layers.1.mlp.down_proj", 2}}));
}

void check_bf16_autocast(const dump_locator& dump) {
  const dump_reader reader(dump("bf16_autocast"));
  ASSERT_EQ(reader.entries().size(), 4U);
  reader.for_each([&](const dump_entry& entry) {
    const std::string what = fmt::format("{} step {}", entry.info.layer, entry.info.step);
    EXPECT_EQ(entry.info.tokens, 64) << what;
    EXPECT_EQ(entry.info.x_type, dtype::bf16) << what;
    EXPECT_EQ(entry.info.dy_type, dtype::bf16) << what;
    ASSERT_TRUE(entry.info.w_type.has_value()) << what;
    EXPECT_EQ(*entry.info.w_type, dtype::f32) << what << ": w must be the fp32 master copy";
    ASSERT_TRUE(entry.dw) << what;
    // How PyTorch's bf16 GEMM accumulates on a CPU is not documented and differs between machines:
    // with fp32 accumulation and one final rounding the error is about one bf16 unit roundoff, but
    // torch 1.13 on an AVX2-only CPU gives about 5x that (relative Frobenius error 0.0098 on random
    // 64 x 32 x 48 operands, against 0.0017 for fp32 accumulation), i.e. it rounds partial sums. The
    // per-element bound is therefore that of summation with every partial sum in bf16 (K unit
    // roundoffs of sum|products|), and the Frobenius check, at 8 unit roundoffs (the worst seen is
    // 2.5), still tells the captured pairing of x and dy from a wrong one (an error of about 1).
    const double tokens = static_cast<double>(entry.x.rows);
    const double frobenius = check_gradient(*entry.dw, entry.dy, entry.x, tokens * bf16_unit_roundoff, what);
    EXPECT_LT(frobenius, 8 * bf16_unit_roundoff) << what;
  });
}

void check_quantized_wgrad_operands(const dump_locator& dump) {
  const dump_reader reader(dump("mxfp4_wgrad"));
  ASSERT_EQ(reader.entries().size(), 4U);
  reader.for_each([&](const dump_entry& entry) {
    const std::string what = fmt::format("{} step {}", entry.info.layer, entry.info.step);
    ASSERT_EQ(entry.quantized.size(), 2U) << what;
    const mxscope::io::quantized_operand* dy = nullptr;
    const mxscope::io::quantized_operand* x = nullptr;
    for (const auto& operand : entry.quantized) {
      const auto& recipe = operand.recipe;
      SCOPED_TRACE(what + ": " + recipe.describe());
      EXPECT_EQ(recipe.format_name, "mxfp4");
      EXPECT_EQ(recipe.block, 32);
      EXPECT_EQ(recipe.axis, 0);  // wgrad reduces over K
      EXPECT_EQ(recipe.rule, mxscope::core::scale_rule::floor);
      EXPECT_EQ(recipe.rounding, mxscope::core::rounding_mode::sr);
      EXPECT_EQ(recipe.rotation_size, 16);
      EXPECT_EQ(recipe.signs, mxscope::sign_policy::per_step);
      EXPECT_EQ(recipe.seed, 98765U);
      EXPECT_EQ(recipe.layer, entry.info.layer);
      EXPECT_EQ(static_cast<std::int64_t>(recipe.step), entry.info.step);
      EXPECT_EQ(recipe.sr_bits, 32);
      (recipe.tensor == "dy" ? dy : x) = &operand;

      // The stored codes are what mxscope computes from the stored operand under the stored recipe.
      matrix rotated = recipe.tensor == "dy" ? entry.dy : entry.x;
      mxscope::rotate(rotated, recipe.axis, recipe.rotation(), what);
      const auto expected = mxscope::quantize(rotated, recipe.quantize());
      EXPECT_EQ(operand.tensor.codes, expected.codes);
      EXPECT_EQ(operand.tensor.scales, expected.scales);
      for (std::size_t i = 0; i < expected.dequantized.values.size(); ++i) {
        ASSERT_EQ(bits_of(operand.tensor.dequantized.values[i]), bits_of(expected.dequantized.values[i])) << i;
      }
    }
    ASSERT_TRUE(dy && x) << what;
    ASSERT_TRUE(entry.dw) << what;
    // The recipe's wgrad multiplies the dequantized (rotated) operands in fp32.
    const double frobenius = check_gradient(*entry.dw, dy->tensor.dequantized, x->tensor.dequantized,
                                            (64 + 4) * fp32_unit_roundoff, what + " (quantized operands)");
    EXPECT_LT(frobenius, 1e-5) << what;
    // ...which differs visibly from the unquantized product: the quantization really happened.
    double error_squared = 0.0, reference_squared = 0.0;
    for (std::int64_t i = 0; i < entry.dw->rows; ++i) {
      for (std::int64_t j = 0; j < entry.dw->cols; ++j) {
        double reference = 0.0;
        for (std::int64_t k = 0; k < entry.x.rows; ++k) reference += static_cast<double>(entry.dy(k, i)) * entry.x(k, j);
        error_squared += (entry.dw->operator()(i, j) - reference) * (entry.dw->operator()(i, j) - reference);
        reference_squared += reference * reference;
      }
    }
    const double quantization_error = std::sqrt(error_squared / reference_squared);
    EXPECT_GT(quantization_error, 1e-3) << what;
    EXPECT_LT(quantization_error, 1.0) << what;
  });
}

void check_killed_run(const dump_locator& dump) {
  const dump_reader reader(dump("interrupted"));
  ASSERT_EQ(reader.entries().size(), 4U);  // steps 1 and 2 of layers "0" and "2"; step 3 never ran
  for (const auto& entry : reader.entries()) EXPECT_LE(entry.step, 2) << entry.layer;
  reader.for_each([&](const dump_entry& entry) {
    const std::string what = fmt::format("layer {} step {}", entry.info.layer, entry.info.step);
    // Layer "2" runs twice per step on 3 x 5 tokens: K = 30, calls = 2.
    EXPECT_EQ(entry.info.tokens, entry.info.layer == "2" ? 30 : 15) << what;
    EXPECT_EQ(entry.info.metadata.at("calls"), entry.info.layer == "2" ? "2" : "1") << what;
    ASSERT_TRUE(entry.dw) << what;
    const double frobenius =
        check_gradient(*entry.dw, entry.dy, entry.x, (entry.info.tokens + 4) * fp32_unit_roundoff, what);
    EXPECT_LT(frobenius, 1e-5) << what;
  });
}

void check_inspect_lists_every_tensor(const dump_locator& dump) {
  const std::string path = dump("mxfp4_wgrad").string();
  const char* argv[] = {"mxscope", "inspect", path.c_str()};
  std::ostringstream out, err;
  ASSERT_EQ(mxscope::cli::run(3, argv, out, err), 0) << err.str();
  std::map<std::string, std::vector<std::string>> rows;  // "step layer tensor" -> columns
  std::istringstream lines(out.str());
  for (std::string line; std::getline(lines, line);) {
    std::istringstream words(line);
    std::vector<std::string> columns;
    for (std::string word; words >> word;) columns.push_back(word);
    if (columns.size() == 10) rows[columns[0] + " " + columns[1] + " " + columns[2]] = columns;
  }
  for (const char* step : {"1", "2"}) {
    for (const char* layer : {"layers.0.attn.o_proj", "layers.1.mlp.down_proj"}) {
      const bool mlp = std::string(layer).find("mlp") != std::string::npos;
      const std::string n_in = mlp ? "96" : "32";
      const std::map<std::string, std::pair<std::string, std::string>> expected = {
          {"x", {"BF16", "[64," + n_in + "]"}},     {"dy", {"BF16", "[64,32]"}},
          {"w", {"F32", "[32," + n_in + "]"}},      {"dw", {"F32", "[32," + n_in + "]"}},
          {"x.codes", {"U8", "[64," + std::to_string(std::stoi(n_in) / 2) + "]"}},
          {"x.scales", {"U8", "[2," + n_in + "]"}}, {"dy.codes", {"U8", "[64,16]"}},
          {"dy.scales", {"U8", "[2,32]"}}};
      for (const auto& [tensor, type_shape] : expected) {
        const std::string key = fmt::format("{} {} {}", step, layer, tensor);
        ASSERT_TRUE(rows.count(key)) << key << "\n" << out.str();
        const auto& row = rows[key];
        EXPECT_EQ(row[3], type_shape.first) << key;
        EXPECT_EQ(row[4], type_shape.second) << key;
        EXPECT_EQ(row[8], "0") << key << ": NaN count";
        EXPECT_EQ(row[9], "0") << key << ": Inf count";
        EXPECT_LE(std::stod(row[5]), std::stod(row[6])) << key << ": min <= max";
      }
    }
  }
  EXPECT_NE(out.str().find("quantized operands 8"), std::string::npos) << out.str();
}

// One test per Python run: ctest starts every test in its own process, and each process would
// otherwise run the capture again.
TEST_F(DumpFromCapture, CapturedDumpsAreValidAndTheirGradientsMatchTheirOperands) {
  const auto dump = [](const char* name) { return DumpFromCapture::dump(name); };
  {
    SCOPED_TRACE("fp32 recipe, 2 micro-batches concatenated along K: dw == dy^T x");
    check_fp32_gradient_accumulation(dump);
  }
  {
    SCOPED_TRACE("bf16 autocast: bf16 operands, fp32 master weight and gradient");
    check_bf16_autocast(dump);
  }
  {
    SCOPED_TRACE("MXFP4 wgrad: stored codes reproduce from the recipe and give dw");
    check_quantized_wgrad_operands(dump);
  }
  {
    SCOPED_TRACE("killed run: consistent manifest; a module called twice is paired call by call");
    check_killed_run(dump);
  }
  {
    SCOPED_TRACE("mxscope inspect lists every tensor of every entry");
    check_inspect_lists_every_tensor(dump);
  }
}

// The shipped sample was captured on an H200 with PyTorch 2.x on CUDA: its stored Wgrad codes must be
// exactly what the C++ quantizer makes of the stored operands (the fake quantizer is bit-identical on
// the GPU too), and dw must be the fp32 product of the decoded operands.
TEST(ShippedSample, GpuQuantizedOperandsReproduceBitForBitAndGiveTheGradient) {
  const fs::path sample = fs::path(MXSCOPE_SOURCE_DIR) / "data/sample";
  const dump_reader reader(sample);
  ASSERT_GE(reader.entries().size(), 30U);
  EXPECT_EQ(reader.layers(), (std::vector<std::string>{"layers.1.attn.o_proj", "layers.2.mlp.down_proj"}));
  std::size_t operands = 0;
  reader.for_each([&](const dump_entry& entry) {
    const std::string what = fmt::format("{} step {}", entry.info.layer, entry.info.step);
    EXPECT_TRUE(entry.all_finite()) << what << ": " << entry.nonfinite_summary();
    ASSERT_EQ(entry.quantized.size(), 2U) << what;
    for (const auto& operand : entry.quantized) {
      SCOPED_TRACE(what + ": " + operand.recipe.describe());
      matrix rotated = operand.recipe.tensor == "dy" ? entry.dy : entry.x;
      mxscope::rotate(rotated, operand.recipe.axis, operand.recipe.rotation(), what);
      const auto expected = mxscope::quantize(rotated, operand.recipe.quantize());
      std::size_t differing_codes = 0, differing_scales = 0;
      for (std::size_t i = 0; i < expected.codes.size(); ++i) differing_codes += expected.codes[i] != operand.tensor.codes[i];
      for (std::size_t i = 0; i < expected.scales.size(); ++i) {
        differing_scales += expected.scales[i] != operand.tensor.scales[i];
      }
      EXPECT_EQ(differing_codes, 0U) << "of " << expected.codes.size() << " code bytes";
      EXPECT_EQ(differing_scales, 0U) << "of " << expected.scales.size() << " scales";
      ++operands;
    }
    const auto& dy = entry.quantized[0].recipe.tensor == "dy" ? entry.quantized[0] : entry.quantized[1];
    const auto& x = entry.quantized[0].recipe.tensor == "x" ? entry.quantized[0] : entry.quantized[1];
    ASSERT_TRUE(entry.dw) << what;
    const double frobenius = check_gradient(*entry.dw, dy.tensor.dequantized, x.tensor.dequantized,
                                            (static_cast<double>(entry.info.tokens) + 4) * fp32_unit_roundoff, what);
    EXPECT_LT(frobenius, 1e-5) << what;
  });
  EXPECT_EQ(operands, 2 * reader.entries().size());
}

// ------------------------------------------------------------------------------------------------
// Dumps built by hand.

std::vector<std::uint8_t> float_bytes(const std::vector<float>& values) {
  std::vector<std::uint8_t> bytes(values.size() * 4);
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

std::vector<float> ramp(std::int64_t count, float scale) {
  std::vector<float> values(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) values[static_cast<std::size_t>(i)] = scale * static_cast<float>((i * 37) % 23 - 11);
  return values;
}

struct entry_spec {
  std::int64_t tokens = 8, in_features = 6, out_features = 4;
  std::vector<std::int64_t> x_shape, dy_shape, w_shape, dw_shape;  // overrides when non-empty
  dtype x_type = dtype::f32, dy_type = dtype::f32, w_type = dtype::f32, dw_type = dtype::f32;
  bool with_dy = true, with_w = true, with_dw = true;
  std::map<std::string, std::string> metadata;
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> extra_u8;  // name, shape
  std::vector<float> x_values;  // overrides the ramp
  std::vector<float> dw_values;
};

std::int64_t count_of(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto extent : shape) n *= extent;
  return n;
}

std::vector<std::uint8_t> bytes_for(dtype type, const std::vector<float>& values) {
  if (type == dtype::f32) return float_bytes(values);
  const int size = mxscope::io::dtype_size(type);
  std::vector<std::uint8_t> bytes(values.size() * static_cast<std::size_t>(size));
  if (type == dtype::bf16) {  // truncation keeps the values exactly representable here (small integers)
    for (std::size_t i = 0; i < values.size(); ++i) {
      const std::uint32_t bits = bits_of(values[i]);
      bytes[2 * i] = static_cast<std::uint8_t>((bits >> 16) & 0xFF);
      bytes[2 * i + 1] = static_cast<std::uint8_t>(bits >> 24);
    }
  }
  return bytes;  // other dtypes: zeros of the right size
}

void write_entry(const fs::path& path, const entry_spec& spec) {
  mxscope::io::safetensors_writer writer;
  auto add = [&](const char* name, dtype type, std::vector<std::int64_t> shape, const std::vector<float>& given, float scale) {
    const auto values = given.empty() ? ramp(count_of(shape), scale) : given;
    writer.add(name, type, shape, bytes_for(type, values));
  };
  const auto x_shape = spec.x_shape.empty() ? std::vector<std::int64_t>{spec.tokens, spec.in_features} : spec.x_shape;
  const auto dy_shape = spec.dy_shape.empty() ? std::vector<std::int64_t>{spec.tokens, spec.out_features} : spec.dy_shape;
  const auto w_shape = spec.w_shape.empty() ? std::vector<std::int64_t>{spec.out_features, spec.in_features} : spec.w_shape;
  const auto dw_shape = spec.dw_shape.empty() ? w_shape : spec.dw_shape;
  add("x", spec.x_type, x_shape, spec.x_values, 0.25f);
  if (spec.with_dy) add("dy", spec.dy_type, dy_shape, {}, 0.5f);
  if (spec.with_w) add("w", spec.w_type, w_shape, {}, 0.125f);
  if (spec.with_dw) add("dw", spec.dw_type, dw_shape, spec.dw_values, 1.0f);
  for (const auto& [name, shape] : spec.extra_u8) {
    writer.add(name, dtype::u8, shape, std::vector<std::uint8_t>(static_cast<std::size_t>(count_of(shape)), 0x7F));
  }
  for (const auto& [key, value] : spec.metadata) writer.set_metadata(key, value);
  fs::create_directories(path.parent_path());
  writer.write(path);
}

nlohmann::json base_manifest() {
  return {{"format", "mxscope-dump"},
          {"version", 1},
          {"source",
           {{"hardware", "test"}, {"framework", "none"}, {"recipe", "bf16"}, {"model", "hand-built"}, {"notes", ""}}},
          {"entries", nlohmann::json::array()}};
}

// A dump with two layers x two steps, listed out of order.
class HandBuiltDump : public ::testing::Test {
 protected:
  void SetUp() override {
    manifest_ = base_manifest();
    add("b.layer", 2, {});
    add("a.layer", 2, {});
    add("b.layer", 1, {});
    add("a.layer", 1, {});
  }
  void add(const std::string& layer, std::int64_t step, const entry_spec& spec) {
    const std::string file = fmt::format("{}/step{}.safetensors", layer, step);
    write_entry(directory_.path() / file, spec);
    manifest_["entries"].push_back({{"step", step}, {"layer", layer}, {"file", file}});
  }
  // Rewrites the first listed entry's file (b.layer step 2) from `spec`.
  void replace_first_entry(const entry_spec& spec) { write_entry(directory_.path() / "b.layer/step2.safetensors", spec); }
  void write_manifest() const {
    python_runner::write_text(directory_.path() / "manifest.json", manifest_.dump(1));
  }
  fs::path manifest_path() const { return directory_.path() / "manifest.json"; }

  // Expects opening the dump to throw an input_error whose message holds every fragment.
  void expect_rejected(const std::vector<std::string>& fragments) const {
    write_manifest();
    try {
      const dump_reader reader(directory_.path());
      ADD_FAILURE() << "accepted a dump it should reject; manifest:\n" << manifest_.dump(1);
    } catch (const input_error& error) {
      const std::string message = error.what();
      for (const auto& fragment : fragments) {
        EXPECT_NE(message.find(fragment), std::string::npos) << "message lacks '" << fragment << "': " << message;
      }
    }
  }

  python_runner::temporary_directory directory_{"dump-hand"};
  nlohmann::json manifest_;
};

TEST_F(HandBuiltDump, ValidDumpIsReadInLayerThenStepOrder) {
  write_manifest();
  const dump_reader reader(directory_.path());
  EXPECT_EQ(reader.source().hardware, "test");
  EXPECT_EQ(reader.source().extra_json, "{}");
  std::vector<std::string> order;
  reader.for_each([&](const dump_entry& entry) {
    order.push_back(fmt::format("{}:{}", entry.info.layer, entry.info.step));
    EXPECT_EQ(entry.x.rows, 8);
    EXPECT_EQ(entry.x.cols, 6);
    EXPECT_EQ(entry.x(1, 2), 0.25f * static_cast<float>((8 * 37) % 23 - 11));  // element 8 of the ramp
    EXPECT_TRUE(entry.all_finite());
    EXPECT_EQ(entry.nonfinite_summary(), "");
  });
  EXPECT_EQ(order, (std::vector<std::string>{"a.layer:1", "a.layer:2", "b.layer:1", "b.layer:2"}));
}

TEST_F(HandBuiltDump, ManifestFieldsAreCheckedOneByOne) {
  const auto manifest = manifest_path().string();
  const auto original = manifest_;
  manifest_.erase("format");
  expect_rejected({manifest, "'format'", "missing"});
  manifest_ = original;
  manifest_["format"] = "other-dump";
  expect_rejected({manifest, "'format'", "other-dump"});
  manifest_ = original;
  manifest_["version"] = 2;
  expect_rejected({manifest, "'version'", "2"});
  manifest_ = original;
  manifest_["version"] = "1";
  expect_rejected({manifest, "'version'", "string"});
  manifest_ = original;
  manifest_["source"].erase("notes");
  expect_rejected({manifest, "'source.notes'", "missing"});
  manifest_ = original;
  manifest_["source"]["hardware"] = 3;
  expect_rejected({manifest, "'source.hardware'", "string"});
  manifest_ = original;
  manifest_["extra"] = true;
  expect_rejected({manifest, "'extra'", "unexpected"});
  manifest_ = original;
  manifest_["entries"] = nlohmann::json::object();
  expect_rejected({manifest, "'entries'", "array"});
  manifest_ = original;
  manifest_["entries"][1].erase("step");
  expect_rejected({manifest, "entries[1]", "'step'", "missing"});
  manifest_ = original;
  manifest_["entries"][1]["step"] = -1;
  expect_rejected({manifest, "entries[1]", "'step'", "-1"});
  manifest_ = original;
  manifest_["entries"][2]["step"] = 1.5;
  expect_rejected({manifest, "entries[2]", "'step'", "1.5"});
  manifest_ = original;
  manifest_["entries"][0]["step"] = true;
  expect_rejected({manifest, "entries[0]", "'step'", "boolean"});
  manifest_ = original;
  manifest_["entries"][3]["layer"] = "";
  expect_rejected({manifest, "entries[3]", "'layer'"});
  manifest_ = original;
  manifest_["entries"][3]["layer"] = 5;
  expect_rejected({manifest, "entries[3]", "'layer'", "integer"});
  manifest_ = original;
  manifest_["entries"][0]["checksum"] = "x";
  expect_rejected({manifest, "entries[0]", "'checksum'", "unexpected"});
}

// 400,000 objects in `source` are read in linear time (the extra keys are kept); `source` nested
// 100,000 deep is refused naming the manifest, without a signal.
TEST_F(HandBuiltDump, LargeAndDeepSourcesAreHandledInLinearTime) {
  manifest_["source"]["extra"] = nlohmann::json::array();
  for (int i = 0; i < 400000; ++i) manifest_["source"]["extra"].push_back(nlohmann::json::object());
  write_manifest();
  const auto started = std::chrono::steady_clock::now();
  const dump_reader reader(directory_.path());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  EXPECT_LT(seconds, 5.0);
  EXPECT_EQ(reader.entries().size(), 4U);
  std::string text = manifest_.dump();
  text.replace(text.find("[{}"), 3, std::string(100000, '[') + "{}" + std::string(99999, ']'));
  python_runner::write_text(manifest_path(), text);
  try {
    const dump_reader deep(directory_.path());
    ADD_FAILURE() << "accepted a manifest nested 100,000 deep";
  } catch (const input_error& error) {
    EXPECT_NE(std::string(error.what()).find("nesting deeper than 64"), std::string::npos) << error.what();
  }
}

TEST_F(HandBuiltDump, ManifestThatIsNotJsonIsRejected) {
  write_manifest();
  python_runner::write_text(manifest_path(), "{\"format\": \"mxscope-dump\", ");
  try {
    const dump_reader reader(directory_.path());
    ADD_FAILURE() << "accepted a truncated manifest";
  } catch (const input_error& error) {
    EXPECT_NE(std::string(error.what()).find(manifest_path().string()), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("not valid JSON"), std::string::npos) << error.what();
  }
  EXPECT_THROW(dump_reader(directory_.path() / "absent"), input_error);
}

TEST_F(HandBuiltDump, EntryFilesMustBeRelativeInsideAndPresent) {
  const auto manifest = manifest_path().string();
  const auto original = manifest_;
  manifest_["entries"][0]["file"] = "/etc/hostname";
  expect_rejected({manifest, "entries[0]", "'file'", "absolute"});
  manifest_ = original;
  manifest_["entries"][0]["file"] = "../outside.safetensors";
  expect_rejected({manifest, "entries[0]", "'file'", "'..'"});
  manifest_ = original;
  manifest_["entries"][0]["file"] = "a.layer//step1.safetensors";
  expect_rejected({manifest, "entries[0]", "'file'", "empty"});
  manifest_ = original;
  manifest_["entries"][2]["file"] = "b.layer/step9.safetensors";
  expect_rejected({manifest, "entries[2]", "'file'", "step9.safetensors", "does not exist"});
  manifest_ = original;
  manifest_["entries"][2]["file"] = "b.layer";
  expect_rejected({manifest, "entries[2]", "'file'", "not a regular file"});
  // A link inside the dump that leads to a file outside it.
  python_runner::temporary_directory outside("dump-outside");
  write_entry(outside.path() / "elsewhere.safetensors", entry_spec{});
  fs::create_symlink(outside.path() / "elsewhere.safetensors", directory_.path() / "link.safetensors");
  manifest_ = original;
  manifest_["entries"][1]["file"] = "link.safetensors";
  expect_rejected({manifest, "entries[1]", "'file'", "outside the dump directory"});
}

TEST_F(HandBuiltDump, DuplicateStepAndLayerIsRejected) {
  manifest_["entries"][3]["step"] = 2;  // a.layer step 1 becomes a second a.layer step 2
  expect_rejected({manifest_path().string(), "entries[3]", "duplicate (step 2, layer 'a.layer')", "entries[1]"});
}

TEST_F(HandBuiltDump, ShapeMismatchesBetweenOperandsNameTheFileAndTensor) {
  const std::string file = (directory_.path() / "b.layer/step2.safetensors").string();
  entry_spec spec;
  spec.dy_shape = {7, 4};
  replace_first_entry(spec);
  expect_rejected({file, "tensor 'dy'", "'shape'", "K = 7", "K = 8"});
  spec = {};
  spec.w_shape = {4, 5};
  replace_first_entry(spec);
  expect_rejected({file, "tensor 'w'", "'shape'", "[4, 5]", "[4, 6]"});
  spec = {};
  spec.dw_shape = {6, 4};
  replace_first_entry(spec);
  expect_rejected({file, "tensor 'dw'", "'shape'"});
  spec = {};
  spec.x_shape = {2, 4, 6};
  replace_first_entry(spec);
  expect_rejected({file, "tensor 'x'", "'shape'", "rank 3"});
  spec = {};
  spec.with_dy = false;
  replace_first_entry(spec);
  expect_rejected({file, "tensor 'dy'", "missing"});
}

TEST_F(HandBuiltDump, DisallowedDtypesAndUnknownTensorsAreRejected) {
  const std::string file = (directory_.path() / "b.layer/step2.safetensors").string();
  entry_spec spec;
  spec.dw_type = dtype::bf16;
  replace_first_entry(spec);
  expect_rejected({file, "tensor 'dw'", "'dtype'", "BF16"});
  spec = {};
  spec.x_type = dtype::i32;
  replace_first_entry(spec);
  expect_rejected({file, "tensor 'x'", "'dtype'", "I32"});
  spec = {};
  spec.w_type = dtype::f64;
  replace_first_entry(spec);
  expect_rejected({file, "tensor 'w'", "'dtype'", "F64"});
  spec = {};
  spec.extra_u8 = {{"y", {8, 4}}};
  replace_first_entry(spec);
  expect_rejected({file, "tensor 'y'", "unexpected"});
}

std::map<std::string, std::string> dy_recipe() {
  return {{"dy.format", "mxfp4"}, {"dy.block", "4"},       {"dy.axis", "0"},     {"dy.scale_rule", "floor"},
          {"dy.rounding", "rne"}, {"dy.seed", "5"},        {"dy.rotation", "hadamard:8"}, {"dy.signs", "fixed"},
          {"dy.layer", "b.layer"}, {"dy.step", "2"},       {"dy.sr_bits", "32"}};
}

TEST_F(HandBuiltDump, QuantizedOperandsNeedPairsRecipesAndConsistentShapes) {
  const std::string file = (directory_.path() / "b.layer/step2.safetensors").string();
  // dy is [8, 4]; mxfp4 along axis 0 in blocks of 4: codes [8, 2], scales [2, 4].
  entry_spec spec;
  spec.metadata = dy_recipe();
  spec.extra_u8 = {{"dy.codes", {8, 2}}, {"dy.scales", {2, 4}}};
  replace_first_entry(spec);
  write_manifest();
  {
    const dump_reader reader(directory_.path());
    const auto& entry = reader.entries().back();
    ASSERT_EQ(entry.quantized.size(), 1U);
    EXPECT_EQ(entry.quantized[0].rotation_size, 8);
    EXPECT_EQ(entry.quantized[0].signs, mxscope::sign_policy::fixed);
    // Code bytes 0x7F: the low nibble 0xF (fp4 -6.0) is element 2i, the high nibble 0x7 (6.0) is
    // element 2i+1; scale bytes 0x7F are e8m0 2^0.
    const dump_entry read = reader.read(entry);
    ASSERT_EQ(read.quantized.size(), 1U);
    const auto& values = read.quantized[0].tensor.dequantized;
    EXPECT_EQ(values(0, 0), -6.0f);
    EXPECT_EQ(values(0, 1), 6.0f);
    EXPECT_EQ(values(7, 2), -6.0f);
    EXPECT_EQ(values(7, 3), 6.0f);
  }
  auto with = [&](auto change) {
    entry_spec changed = spec;
    change(changed);
    replace_first_entry(changed);
  };
  with([](entry_spec& s) { s.extra_u8 = {{"dy.codes", {8, 2}}}; });
  expect_rejected({file, "tensor 'dy.scales'", "missing", "pairs"});
  with([](entry_spec& s) { s.metadata.erase("dy.rounding"); });
  expect_rejected({file, "'__metadata__.dy.rounding'", "missing"});
  with([](entry_spec& s) { s.metadata["dy.format"] = "nvfp4"; });
  expect_rejected({file, "'__metadata__.dy.format'", "nvfp4"});
  with([](entry_spec& s) { s.metadata["dy.block"] = "4x"; });
  expect_rejected({file, "'__metadata__.dy.block'", "4x"});
  with([](entry_spec& s) { s.metadata["dy.rotation"] = "hadamard:16"; });
  expect_rejected({file, "'__metadata__.dy.rotation'", "does not divide the length 8"});
  with([](entry_spec& s) { s.metadata["dy.sr_bits"] = "33"; });
  expect_rejected({file, "'__metadata__.dy.sr_bits'", "33"});
  with([](entry_spec& s) { s.extra_u8 = {{"dy.codes", {8, 4}}, {"dy.scales", {2, 4}}}; });
  expect_rejected({file, "tensor 'dy.codes'", "'shape'", "[8, 4]", "[8, 2]"});
  with([](entry_spec& s) { s.extra_u8 = {{"dy.codes", {8, 2}}, {"dy.scales", {8, 1}}}; });
  expect_rejected({file, "tensor 'dy.scales'", "'shape'", "[2, 4]"});
}

// dump_read_options::listener hears of x and dy, each started once and every element told once,
// with the read's own destination; never of w or dw, which the entry holds too.
TEST_F(HandBuiltDump, ReadListenerHearsOfXAndDyOnly) {
  write_manifest();
  const dump_reader reader(directory_.path());
  struct names_listener final : mxscope::io::read_listener {
    std::mutex mutex;
    std::map<std::string, const float*> started_at;
    std::map<std::string, std::uint64_t> told;
    void started(std::string_view tensor, const float* values, std::int64_t, std::int64_t) override {
      const std::lock_guard<std::mutex> lock(mutex);
      started_at[std::string(tensor)] = values;
    }
    void piece(std::string_view tensor, std::uint64_t, std::uint64_t count) override {
      const std::lock_guard<std::mutex> lock(mutex);
      told[std::string(tensor)] += count;
    }
  } listener;
  mxscope::io::dump_read_options options;
  options.listener = &listener;
  const dump_entry entry = reader.read(reader.entries().front(), options);
  ASSERT_TRUE(entry.w.has_value());
  ASSERT_TRUE(entry.dw.has_value());
  EXPECT_EQ(listener.started_at, (std::map<std::string, const float*>{{"dy", entry.dy.data()}, {"x", entry.x.data()}}));
  EXPECT_EQ(listener.told, (std::map<std::string, std::uint64_t>{{"dy", entry.dy.values.size()}, {"x", entry.x.values.size()}}));
}

TEST_F(HandBuiltDump, NonFiniteValuesAreCountedPerTensorAndCanBeRejected) {
  entry_spec spec;
  spec.x_values = ramp(8 * 6, 0.25f);
  spec.x_values[5] = std::numeric_limits<float>::quiet_NaN();
  spec.x_values[17] = std::numeric_limits<float>::quiet_NaN();
  spec.x_values[40] = -std::numeric_limits<float>::infinity();
  spec.dw_values = ramp(4 * 6, 1.0f);
  spec.dw_values[3] = std::numeric_limits<float>::infinity();
  replace_first_entry(spec);
  write_manifest();
  const dump_reader reader(directory_.path());  // values are not a validation matter
  const auto& info = reader.entries().back();
  ASSERT_EQ(info.layer, "b.layer");
  ASSERT_EQ(info.step, 2);
  const dump_entry entry = reader.read(info);
  EXPECT_FALSE(entry.all_finite());
  EXPECT_EQ(entry.nonfinite.at("x").nan, 2U);
  EXPECT_EQ(entry.nonfinite.at("x").inf, 1U);
  EXPECT_EQ(entry.nonfinite.at("dw").nan, 0U);
  EXPECT_EQ(entry.nonfinite.at("dw").inf, 1U);
  EXPECT_EQ(entry.nonfinite.at("dy").total(), 0U);
  EXPECT_EQ(entry.nonfinite_summary(), "dw: 0 NaN, 1 Inf; x: 2 NaN, 1 Inf");

  // Reading into the memory of an earlier entry (a larger one holding other values, a smaller one,
  // an empty one, this entry's own read) gives the same values, shapes and counts as a fresh read.
  std::vector<dump_entry> earlier(4);
  earlier[0].x = mxscope::matrix(64, 64, 7.0f);
  earlier[0].dy = mxscope::matrix(32, 32, -3.0f);
  earlier[1].x = mxscope::matrix(1, 2, 7.0f);
  earlier[1].dy = mxscope::matrix(1, 1, 7.0f);
  earlier[3] = reader.read(info);
  for (auto& recycled : earlier) {
    const dump_entry again = reader.read(info, {}, std::move(recycled));
    EXPECT_EQ(again.x.rows, entry.x.rows);
    EXPECT_EQ(again.x.cols, entry.x.cols);
    EXPECT_EQ(again.dy.rows, entry.dy.rows);
    EXPECT_EQ(again.dy.cols, entry.dy.cols);
    ASSERT_EQ(again.x.values.size(), entry.x.values.size());
    EXPECT_EQ(std::memcmp(again.x.values.data(), entry.x.values.data(), entry.x.values.size() * 4), 0);
    ASSERT_EQ(again.dy.values.size(), entry.dy.values.size());
    EXPECT_EQ(std::memcmp(again.dy.values.data(), entry.dy.values.data(), entry.dy.values.size() * 4), 0);
    EXPECT_EQ(again.nonfinite_summary(), entry.nonfinite_summary());
  }

  mxscope::io::dump_read_options strict;
  strict.reject_nonfinite = true;
  try {
    (void)reader.read(info, strict);
    ADD_FAILURE() << "read non-finite values under reject_nonfinite";
  } catch (const input_error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("b.layer/step2.safetensors"), std::string::npos) << message;
    EXPECT_NE(message.find("tensor 'x'"), std::string::npos) << message;
    EXPECT_NE(message.find("2 NaN and 1 Inf"), std::string::npos) << message;
  }

  // inspect reports the counts too.
  const std::string path = directory_.path().string();
  const char* argv[] = {"mxscope", "inspect", path.c_str()};
  std::ostringstream out, err;
  ASSERT_EQ(mxscope::cli::run(3, argv, out, err), 0) << err.str();
  bool found = false;
  std::istringstream lines(out.str());
  for (std::string line; std::getline(lines, line);) {
    std::istringstream words(line);
    std::vector<std::string> columns;
    for (std::string word; words >> word;) columns.push_back(word);
    if (columns.size() == 10 && columns[0] == "2" && columns[1] == "b.layer" && columns[2] == "x") {
      found = true;
      EXPECT_EQ(columns[8], "2") << line;
      EXPECT_EQ(columns[9], "1") << line;
    }
  }
  EXPECT_TRUE(found) << out.str();
}

}  // namespace
