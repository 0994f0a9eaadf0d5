// mxscope quantize --device cpu|gpu, called in-process: a bad device name and a non-MX format on
// the GPU exit 2 with the flag named and no output file; on a machine with a usable GPU (and a build
// with the GPU backend) the GPU's output file is byte-identical to the CPU's for every MX format,
// rounding mode and rotation tried; elsewhere --device gpu exits 2 naming the flag.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>
#include <string>
#include <vector>

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

}  // namespace
