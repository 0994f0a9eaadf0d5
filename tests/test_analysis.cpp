// Analysis files: the shipped analyses parse into the strategies they describe, and every kind of
// mistake is reported with file:line:column and the offending key.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "mxscope/analysis.hpp"
#include "mxscope/errors.hpp"

namespace {

using mxscope::gemm_kind;

std::string error_of(const std::string& text) {
  try {
    mxscope::parse_analysis(text, "bad.toml");
  } catch (const mxscope::input_error& error) {
    return error.what();
  }
  return "(no error)";
}

const mxscope::analysis_strategy& find(const mxscope::analysis& parsed, const std::string& name) {
  for (const auto& s : parsed.strategies) {
    if (s.name == name) return s;
  }
  throw std::runtime_error("no strategy " + name);
}

TEST(Analysis, ShippedWgradAblationHasTheStudysStrategies) {
  const auto parsed = mxscope::load_analysis(std::string(MXSCOPE_SOURCE_DIR) + "/analyses/wgrad-ablation.toml");
  ASSERT_EQ(parsed.gemms.size(), 1u);
  EXPECT_EQ(parsed.gemms[0], gemm_kind::wgrad);
  EXPECT_EQ(parsed.reference, mxscope::reference_kind::exact);
  for (const char* name : {"bf16", "fp8-e4m3-tensor", "mxfp8-e4m3", "mxfp4-rne", "mxfp4-sr", "mxfp4-rht16", "mxfp4-h16",
                           "mxfp4-rht16-fixed", "mxfp4-sr-fixed", "mxfp4-h32", "mxfp4-h64", "mxfp4-h128", "nvfp4",
                           "mxfp4-ceil", "mxfp4-even"}) {
    SCOPED_TRACE(name);
    EXPECT_NO_THROW(find(parsed, name));
  }
  const auto& h16 = find(parsed, "mxfp4-h16").for_gemm(gemm_kind::wgrad);
  EXPECT_EQ(h16.rotation_size, 16);
  EXPECT_EQ(h16.rotation_signs, mxscope::sign_policy::none);
  EXPECT_EQ(mxscope::format_name(h16.a.quantize.format), "mxfp4");
  EXPECT_EQ(mxscope::accumulation_model_name(h16.accumulation), "fp32-block");
  EXPECT_EQ(h16.seed, 20241129u);
  const auto& rht = find(parsed, "mxfp4-rht16").for_gemm(gemm_kind::wgrad);
  EXPECT_EQ(rht.rotation_signs, mxscope::sign_policy::per_step);
  const auto& sr_fixed = find(parsed, "mxfp4-sr-fixed").for_gemm(gemm_kind::wgrad);
  EXPECT_EQ(sr_fixed.a.quantize.rounding, mxscope::core::rounding_mode::sr);
  EXPECT_EQ(sr_fixed.a.seeds, mxscope::core::seed_policy::fixed);
  EXPECT_EQ(sr_fixed.b.seeds, mxscope::core::seed_policy::fixed);
  const auto& hybrid = find(parsed, "fp8-hybrid-tensor").for_gemm(gemm_kind::wgrad);
  EXPECT_EQ(mxscope::format_name(hybrid.a.quantize.format), "fp8_e5m2");
  EXPECT_EQ(mxscope::format_name(hybrid.b.quantize.format), "fp8_e4m3");
  EXPECT_EQ(find(parsed, "mxfp4-ceil").for_gemm(gemm_kind::wgrad).a.quantize.rule, mxscope::core::scale_rule::ceil);
}

TEST(Analysis, PerGemmTablesOverrideTheStrategyAndDefaults) {
  const auto parsed = mxscope::load_analysis(std::string(MXSCOPE_SOURCE_DIR) + "/analyses/gemm-progression.toml");
  ASSERT_EQ(parsed.gemms.size(), 3u);
  const auto& fprop_only = find(parsed, "mxfp4-fprop");
  EXPECT_EQ(mxscope::format_name(fprop_only.for_gemm(gemm_kind::fprop).a.quantize.format), "mxfp4");
  EXPECT_EQ(mxscope::format_name(fprop_only.for_gemm(gemm_kind::fprop).b.quantize.format), "mxfp4");
  EXPECT_EQ(mxscope::format_name(fprop_only.for_gemm(gemm_kind::dgrad).a.quantize.format), "bf16");
  EXPECT_EQ(mxscope::format_name(fprop_only.for_gemm(gemm_kind::wgrad).b.quantize.format), "bf16");
  const auto& final_recipe = find(parsed, "mxfp4-all-wgrad-h16");
  EXPECT_EQ(final_recipe.for_gemm(gemm_kind::wgrad).rotation_size, 16);
  EXPECT_EQ(final_recipe.for_gemm(gemm_kind::fprop).rotation_size, 0);
}

TEST(Analysis, ShippedAccumulationModelsCoverEveryModel) {
  const auto parsed = mxscope::load_analysis(std::string(MXSCOPE_SOURCE_DIR) + "/analyses/accumulation-models.toml");
  std::string models;
  for (const auto& s : parsed.strategies) models += mxscope::accumulation_model_name(s.for_gemm(gemm_kind::wgrad).accumulation) + " ";
  for (const char* model : {"exact", "fp32-block", "fp32-group:2", "fp32-group:4", "trunc-align:13,4,rtz", "fp32-seq"}) {
    EXPECT_NE(models.find(model), std::string::npos) << model << " missing from: " << models;
  }
}

struct bad_case {
  const char* text;
  const char* expected_location;  // "bad.toml:LINE:"
  const char* expected_words;     // what the message must name
};

TEST(Analysis, MistakesNameFileLineAndKey) {
  const bad_case cases[] = {
      {"[[strategy]]\nname = \"a\"\nformat = \"mxfp5\"\n", "bad.toml:3:", "mxfp5"},
      {"[[strategy]]\nname = \"a\"\nformat = \"mxfp4\"\ncolour = 1\n", "bad.toml:4:", "unknown key 'colour'"},
      {"gemms = [\"wgrad\", \"xgrad\"]\n[[strategy]]\nname = \"a\"\n", "bad.toml:1:", "xgrad"},
      {"[[strategy]]\nname = \"a\"\nrotation = \"hadamard:12\"\n", "bad.toml:3:", "hadamard:12"},
      {"[[strategy]]\nname = \"a\"\nrounding = \"nearest\"\n", "bad.toml:3:", "nearest"},
      {"[[strategy]]\nname = \"a\"\nblock = \"32\"\n", "bad.toml:3:", "'block' must be an integer"},
      {"[[strategy]]\nname = \"a\"\nsr_bits = 40\n", "bad.toml:3:", "sr_bits"},
      {"[[strategy]]\nname = \"a\"\naccumulation = \"fp32-group:0\"\n", "bad.toml:3:", "fp32-group:0"},
      {"[[strategy]]\nname = \"a\"\n[[strategy]]\nname = \"a\"\n", "bad.toml:4:", "defined twice"},
      {"[[strategy]]\nname = \"a\"\na = { rotation = \"hadamard:16\" }\n", "bad.toml:3:", "rotation"},
      {"[optimizer]\nadamw_beta2 = 1.5\n[[strategy]]\nname = \"a\"\n", "bad.toml:2:", "adamw_beta2"},
      {"reference = \"fp16\"\n[[strategy]]\nname = \"a\"\n", "bad.toml:1:", "fp16"},
      {"[[strategy]]\nname = \"a\"\nsigns = \"fixed\"\n", "bad.toml:1:", "no 'rotation'"},
      {"[[strategy]]\nname = \"a\"\nformat = \"mxfp4\"\nformat = \"bf16\"\n", "bad.toml:4:", ""},
      {"name = \"x\"\n", "bad.toml:", "no [[strategy]]"},
  };
  for (const auto& c : cases) {
    const std::string message = error_of(c.text);
    EXPECT_NE(message.find(c.expected_location), std::string::npos) << "input:\n" << c.text << "message: " << message;
    EXPECT_NE(message.find(c.expected_words), std::string::npos) << "input:\n" << c.text << "message: " << message;
  }
}

TEST(Analysis, MissingFileIsAnInputError) {
  EXPECT_THROW(mxscope::load_analysis("/nonexistent/analysis.toml"), mxscope::input_error);
}

// Mistakes that used to pass parsing and fail (or be taken) later: each names file:line:column.
TEST(Analysis, ValuesThatUsedToSlipThroughAreRefusedAtTheirLine) {
  const std::string head = "[[strategy]]\nname = \"s\"\n";
  EXPECT_NE(error_of(head + "format = \"nvfp4\"\nblock = 32\n").find("bad.toml:4:9: key 'block': 32 with format 'nvfp4'"),
            std::string::npos)
      << error_of(head + "format = \"nvfp4\"\nblock = 32\n");
  EXPECT_NE(error_of("[defaults]\nblock = 64\n" + head + "format = \"nvfp4\"\n").find("bad.toml:2:9: key 'block'"),
            std::string::npos);
  EXPECT_EQ(error_of(head + "format = \"nvfp4\"\nblock = 16\n"), "(no error)");
  EXPECT_EQ(error_of("[defaults]\nblock = 64\n" + head + "format = \"mxfp4\"\n"), "(no error)");
  // Operands of one GEMM with different blocks along the reduction axis (the GEMM refused them
  // after the replay had started, leaving a run directory only --resume would touch).
  EXPECT_NE(error_of(head + "format = \"mxfp4\"\nb = { block = 64 }\n")
                .find("bad.toml:4:15: strategy 's' fprop: operands a (mxfp4, block 32) and b (mxfp4, block 64)"),
            std::string::npos)
      << error_of(head + "format = \"mxfp4\"\nb = { block = 64 }\n");
  EXPECT_NE(error_of(head + "format = \"mxfp4\"\nwgrad = { a = { format = \"nvfp4\" } }\n")
                .find("wgrad: operands a (nvfp4, block 16) and b (mxfp4, block 32)"),
            std::string::npos);
  EXPECT_EQ(error_of(head + "format = \"mxfp4\"\nblock = 64\n"), "(no error)");
  // Dotted keys and table headers of more than 64 parts (40,000 overflowed the stack in the TOML
  // parser); quoted parts count, dots inside strings and numbers do not.
  const auto parts = [](int n, const char* separator) {
    std::string key = "a";
    for (int i = 1; i < n; ++i) key += std::string(separator) + "a";
    return key;
  };
  for (const int n : {65, 40000}) {
    EXPECT_NE(error_of("[" + parts(n, ".") + "]\n" + head + "format = \"mxfp4\"\n").find("bad.toml:1:"),
              std::string::npos);
    EXPECT_NE(error_of(head + "format = \"mxfp4\"\n" + parts(n, ". ") + " = 1\n").find("more than 64 parts"),
              std::string::npos);
  }
  EXPECT_NE(error_of(head + "format = \"mxfp4\"\n" + parts(65, ".\"q\".") + " = 1\n").find("more than 64 parts"),
            std::string::npos);
  const std::string dots_elsewhere = error_of("# " + parts(100, ".") + "\ntitle = \"" + parts(100, ".") +
                                              "\"\nadamw_eps = 1.5e-8\n" + head + "format = \"mxfp4\"\n");
  EXPECT_EQ(dots_elsewhere.find("parts"), std::string::npos) << dots_elsewhere;
  for (const char* rotation : {"hadamard: 16", "hadamard:+16", "hadamard:16 ", "hadamard:0x10", "hadamard:-16"}) {
    const std::string message = error_of(head + "format = \"mxfp4\"\nrotation = \"" + rotation + "\"\n");
    EXPECT_NE(message.find("bad.toml:4:12: key 'rotation'"), std::string::npos) << rotation << ": " << message;
  }
  for (const char* eps : {"inf", "nan", "-1.0", "0.0"}) {
    const std::string message = error_of(std::string("[optimizer]\nadamw_eps = ") + eps + "\n" + head +
                                         "format = \"mxfp4\"\n");
    EXPECT_NE(message.find("bad.toml:2:13: key 'adamw_eps'"), std::string::npos) << eps << ": " << message;
  }
}

TEST(Analysis, FilesThatAreNotRegularOrTooLargeAreRefused) {
  try {
    mxscope::load_analysis("/dev/zero");
    ADD_FAILURE() << "read /dev/zero as an analysis";
  } catch (const mxscope::input_error& error) {
    EXPECT_NE(std::string(error.what()).find("/dev/zero: the analysis file is not a regular file"), std::string::npos)
        << error.what();
  }
  const std::string large = ::testing::TempDir() + "mxscope-large-analysis.toml";
  std::ofstream(large) << std::string((1 << 20) + 1, '#');
  try {
    mxscope::load_analysis(large);
    ADD_FAILURE() << "read an analysis of more than 1 MiB";
  } catch (const mxscope::input_error& error) {
    EXPECT_NE(std::string(error.what()).find("larger than 1048576 bytes"), std::string::npos) << error.what();
  }
  std::remove(large.c_str());
}

TEST(Analysis, ShippedTransformerEngineLikeNvfp4Recipe) {
  const auto parsed = mxscope::load_analysis(std::string(MXSCOPE_SOURCE_DIR) + "/analyses/nvfp4-te.toml");
  const auto& te = find(parsed, "nvfp4-te").for_gemm(gemm_kind::wgrad);
  EXPECT_EQ(mxscope::format_name(te.a.quantize.format), "nvfp4");
  EXPECT_EQ(mxscope::format_name(te.b.quantize.format), "nvfp4");
  EXPECT_EQ(te.a.quantize.rounding, mxscope::core::rounding_mode::sr);   // dy, the gradient
  EXPECT_EQ(te.b.quantize.rounding, mxscope::core::rounding_mode::rne);  // x
  EXPECT_EQ(te.rotation_size, 16);
  EXPECT_EQ(te.rotation_signs, mxscope::sign_policy::fixed);
  const auto& bare = find(parsed, "nvfp4").for_gemm(gemm_kind::wgrad);
  EXPECT_EQ(bare.rotation_size, 0);
  EXPECT_EQ(bare.a.quantize.rounding, mxscope::core::rounding_mode::rne);
}

}  // namespace
