// mxscope quantize --device cpu|gpu, called in-process: a bad device name and a non-MX format on
// the GPU exit 2 with the flag named and no output file; on a machine with a usable GPU (and a build
// with the GPU backend) the GPU's output file is byte-identical to the CPU's for every MX format,
// rounding mode and rotation tried; elsewhere --device gpu exits 2 naming the flag. The same for
// `gemm --device gpu` (output file and JSON report) and `replay --device gpu` on data/sample (the
// three result files); without a GPU both exit 2 and write nothing. `replay --kernel-times` needs
// --device gpu; on a GPU it leaves the result files as they are and writes a timeline that agrees
// with its summary in run.json.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_runner.hpp"
#include "mxscope/cli/cli.hpp"
#include "mxscope/io/safetensors.hpp"
#ifdef MXSCOPE_HAVE_CUDA
#include "mxscope/gpu.hpp"
#endif

namespace {

namespace fs = std::filesystem;

using mxscope::testing::cli_result;
using mxscope::testing::run_cli;

std::string file_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

bool gpu_usable() {
#ifdef MXSCOPE_HAVE_CUDA
  return mxscope::gpu::device_count() > 0;
#else
  return false;
#endif
}

class CliDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    directory_ = fs::temp_directory_path() / ("mxscope_cli_device_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
                                              ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(directory_);
    fs::create_directories(directory_);
    // A [48, 96] fp32 tensor of Gaussian values with varied magnitudes, and a few exact zeros.
    std::mt19937_64 random(7);
    std::normal_distribution<double> normal(0.0, 1.0);
    mxscope::matrix x(48, 96);
    for (std::int64_t i = 0; i < x.size(); ++i) {
      x.values[static_cast<std::size_t>(i)] = static_cast<float>(std::ldexp(normal(random), static_cast<int>(i / 16 % 7) - 3));
    }
    x(3, 5) = 0.0f;
    mxscope::io::safetensors_writer writer;
    writer.add_matrix("x", x);
    input_ = (directory_ / "input.safetensors").string();
    writer.write(input_);
  }
  void TearDown() override { fs::remove_all(directory_); }

  std::vector<std::string> quantize_arguments(const std::string& format, const std::string& device, const std::string& out,
                                              const std::vector<std::string>& extra = {}) const {
    std::vector<std::string> arguments = {"quantize", "--in", input_, "--tensor", "x", "--format", format, "--device",
                                          device,     "--out", out};
    arguments.insert(arguments.end(), extra.begin(), extra.end());
    return arguments;
  }

  fs::path directory_;
  std::string input_;
};

TEST_F(CliDevice, UnknownDeviceIsRefused) {
  const fs::path out = directory_ / "out.safetensors";
  const cli_result result = run_cli(quantize_arguments("mxfp4", "tpu", out.string()));
  EXPECT_EQ(result.code, 2) << result.err;
  EXPECT_NE(result.err.find("--device"), std::string::npos) << result.err;
  EXPECT_FALSE(fs::exists(out));
}

TEST_F(CliDevice, GpuRefusesNonMxFormatsOrMissingBackend) {
  const fs::path out = directory_ / "out.safetensors";
  const cli_result result = run_cli(quantize_arguments("nvfp4", "gpu", out.string()));
  EXPECT_EQ(result.code, 2) << result.err;
  EXPECT_NE(result.err.find("--device gpu"), std::string::npos) << result.err;
  EXPECT_FALSE(fs::exists(out));
}

TEST_F(CliDevice, GpuOutputIsByteIdenticalToCpuOrRefusedWithoutGpu) {
  if (!gpu_usable()) {
    const fs::path out = directory_ / "gpu.safetensors";
    const cli_result result = run_cli(quantize_arguments("mxfp4", "gpu", out.string()));
    EXPECT_EQ(result.code, 2) << result.err;
    EXPECT_NE(result.err.find("--device gpu"), std::string::npos) << result.err;
    EXPECT_FALSE(fs::exists(out));
    return;
  }
  int index = 0;
  for (const char* format : {"mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2", "mxint8"}) {
    for (const char* rounding : {"rne", "sr"}) {
      for (const std::vector<std::string>& extra :
           {std::vector<std::string>{}, std::vector<std::string>{"--rotation", "hadamard:16", "--signs", "per-step"},
            std::vector<std::string>{"--axis", "0", "--block", "16"}}) {
        ++index;
        std::vector<std::string> flags = extra;
        flags.insert(flags.end(), {"--rounding", rounding, "--seed", "42", "--step", "3"});
        const fs::path cpu_out = directory_ / ("cpu" + std::to_string(index) + ".safetensors");
        const fs::path gpu_out = directory_ / ("gpu" + std::to_string(index) + ".safetensors");
        const cli_result cpu = run_cli(quantize_arguments(format, "cpu", cpu_out.string(), flags));
        const cli_result gpu = run_cli(quantize_arguments(format, "gpu", gpu_out.string(), flags));
        ASSERT_EQ(cpu.code, 0) << cpu.err;
        ASSERT_EQ(gpu.code, 0) << gpu.err;
        EXPECT_EQ(file_bytes(cpu_out), file_bytes(gpu_out)) << format << " " << rounding << " case " << index;
        EXPECT_EQ(cpu.out.substr(cpu.out.find('\n')), gpu.out.substr(gpu.out.find('\n'))) << format << " " << rounding;
      }
    }
  }
}

TEST_F(CliDevice, GemmOnGpuMatchesCpuOrIsRefusedWithoutGpu) {
  // x [K 64, n_in 96] and dy [K 64, n_out 48] for a wgrad.
  std::mt19937_64 random(11);
  std::normal_distribution<double> normal(0.0, 1.0);
  mxscope::matrix x(64, 96), dy(64, 48);
  for (auto& v : x.values) v = static_cast<float>(normal(random));
  for (auto& v : dy.values) v = static_cast<float>(std::ldexp(normal(random), -9));
  mxscope::io::safetensors_writer writer;
  writer.add_matrix("x", x);
  writer.add_matrix("dy", dy);
  const std::string operands = (directory_ / "operands.safetensors").string();
  writer.write(operands);
  const auto arguments = [&](const std::string& device, const std::string& accum, const std::string& out) {
    return std::vector<std::string>{"gemm", "--in",     operands, "--gemm", "wgrad", "--format", "mxfp4",
                                    "--accum", accum,  "--device", device, "--json", "--out", out};
  };
  if (!gpu_usable()) {
    const fs::path out = directory_ / "gpu.safetensors";
    const cli_result result = run_cli(arguments("gpu", "fp32-block", out.string()));
    EXPECT_EQ(result.code, 2) << result.err;
    EXPECT_NE(result.err.find("--device gpu"), std::string::npos) << result.err;
    EXPECT_FALSE(fs::exists(out));
    return;
  }
  for (const char* accum : {"fp32-block", "exact", "fp32-group:4", "fp32-seq", "trunc-align:26,1"}) {
    fs::create_directories(directory_ / "cpu");
    fs::create_directories(directory_ / "gpu");
    const fs::path cpu_out = directory_ / "cpu" / "out.safetensors";
    const fs::path gpu_out = directory_ / "gpu" / "out.safetensors";
    const cli_result cpu = run_cli(arguments("cpu", accum, cpu_out.string()));
    const cli_result gpu = run_cli(arguments("gpu", accum, gpu_out.string()));
    ASSERT_EQ(cpu.code, 0) << cpu.err;
    ASSERT_EQ(gpu.code, 0) << gpu.err;
    EXPECT_EQ(file_bytes(cpu_out), file_bytes(gpu_out)) << accum;
  }
}

TEST_F(CliDevice, ReplayOnGpuMatchesCpuOrIsRefusedWithoutGpu) {
  const std::string dump = std::string(MXSCOPE_SOURCE_DIR) + "/data/sample";
  const std::string analysis = std::string(MXSCOPE_SOURCE_DIR) + "/analyses/wgrad-ablation.toml";
  const auto arguments = [&](const std::string& device, const fs::path& out) {
    return std::vector<std::string>{"replay", dump,          "--analysis", analysis, "--steps", "400-401",
                                    "--out",  out.string(), "--device",   device};
  };
  const cli_result bad = run_cli(arguments("tpu", directory_ / "bad"));
  EXPECT_EQ(bad.code, 2) << bad.err;
  EXPECT_NE(bad.err.find("--device"), std::string::npos) << bad.err;
  EXPECT_FALSE(fs::exists(directory_ / "bad"));
  if (!gpu_usable()) {
    const cli_result result = run_cli(arguments("gpu", directory_ / "gpu"));
    EXPECT_EQ(result.code, 2) << result.err;
    EXPECT_NE(result.err.find("--device gpu"), std::string::npos) << result.err;
    EXPECT_FALSE(fs::exists(directory_ / "gpu"));
    return;
  }
  const cli_result cpu = run_cli(arguments("cpu", directory_ / "cpu"));
  const cli_result gpu = run_cli(arguments("gpu", directory_ / "gpu"));
  ASSERT_EQ(cpu.code, 0) << cpu.err;
  ASSERT_EQ(gpu.code, 0) << gpu.err;
  for (const char* name : {"steps.csv", "accumulation.csv", "summary.json"}) {
    EXPECT_EQ(file_bytes(directory_ / "cpu" / name), file_bytes(directory_ / "gpu" / name)) << name;
  }
}

TEST_F(CliDevice, KernelTimesNeedTheGpuAndLeaveTheResultsAlone) {
  const std::string dump = std::string(MXSCOPE_SOURCE_DIR) + "/data/sample";
  const std::string analysis = std::string(MXSCOPE_SOURCE_DIR) + "/analyses/wgrad-ablation.toml";
  const auto arguments = [&](const std::string& device, const fs::path& out, bool kernel_times) {
    std::vector<std::string> list{"replay", dump,          "--analysis", analysis, "--steps", "400-401",
                                  "--out",  out.string(), "--device",   device};
    if (kernel_times) list.push_back("--kernel-times");
    return list;
  };
  const cli_result on_cpu = run_cli(arguments("cpu", directory_ / "cpu", true));
  EXPECT_EQ(on_cpu.code, 2) << on_cpu.err;
  EXPECT_NE(on_cpu.err.find("--kernel-times"), std::string::npos) << on_cpu.err;
  EXPECT_NE(on_cpu.err.find("--device gpu"), std::string::npos) << on_cpu.err;
  EXPECT_FALSE(fs::exists(directory_ / "cpu"));
  if (!gpu_usable()) {
    const cli_result result = run_cli(arguments("gpu", directory_ / "gpu", true));
    EXPECT_EQ(result.code, 2) << result.err;
    EXPECT_FALSE(fs::exists(directory_ / "gpu"));
    return;
  }
  const cli_result plain = run_cli(arguments("gpu", directory_ / "plain", false));
  const cli_result timed = run_cli(arguments("gpu", directory_ / "timed", true));
  ASSERT_EQ(plain.code, 0) << plain.err;
  ASSERT_EQ(timed.code, 0) << timed.err;
  for (const char* name : {"steps.csv", "accumulation.csv", "summary.json"}) {
    EXPECT_EQ(file_bytes(directory_ / "plain" / name), file_bytes(directory_ / "timed" / name)) << name;
  }
  EXPECT_FALSE(fs::exists(directory_ / "plain" / "kernel_times.csv"));
  std::istringstream csv(file_bytes(directory_ / "timed" / "kernel_times.csv"));
  std::string line;
  std::getline(csv, line);
  EXPECT_EQ(line, "index,stream,label,name,bytes,start_ms,stop_ms");
  std::int64_t rows = 0;
  bool reference_labelled = false;
  while (std::getline(csv, line)) {
    ++rows;
    reference_labelled = reference_labelled || line.find(",reference,") != std::string::npos;
  }
  const auto run = nlohmann::json::parse(file_bytes(directory_ / "timed" / "run.json"));
  const auto& timeline = run.at("device_timeline");
  EXPECT_EQ(timeline.at("operations").get<std::int64_t>(), rows);
  EXPECT_GT(rows, 0);
  EXPECT_TRUE(reference_labelled);
  EXPECT_LE(timeline.at("busy_seconds").get<double>(), timeline.at("span_seconds").get<double>());
  EXPECT_GE(timeline.at("operation_seconds").get<double>(), timeline.at("busy_seconds").get<double>() - 1e-9);
}

}  // namespace
