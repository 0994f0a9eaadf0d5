// GPU vs CPU, bit for bit: rotations, MX quantization (every element format x rounding x scale rule
// x rotation x sign policy, both axes, several block sizes, fp32 and bf16 inputs, both quantizer
// paths), emulated GEMMs (exact, fp32-block, fp32-group:G, fp32-seq on every path that covers
// them), the exact reference GEMM and the comparison metrics, on fresh random inputs of many
// shapes. The CPU side is tests/gpu/host_reference.hpp (the library's definitions on the core
// headers; tests/test_gpu_host_reference.cpp ties it to the library) and, for the metrics, the
// library's own src/compare.cpp.
//
// Every GPU output buffer is poisoned before each run (0xFF bytes, and for byte outputs a second
// run with 0x00), so an element the GPU never writes cannot match. One line per case:
// "PASS <case>" or "FAIL <case>: <first mismatch with input, hex bits, expected, actual, policy>",
// then "<N> passed, <M> failed"; the exit code is 1 when anything failed.
//
// Usage: mxscope_gpu_test [--small | --full] [--seed S] [--only SUITE]
//   --small  a few small cases of every kernel (for compute-sanitizer runs)
//   --full   every sweep case also in the CPU simulation (which otherwise runs the small set)
//   --only   run the suites whose name contains SUITE (e.g. "gemm", "quantize", "reference")
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>

#include "mxscope/gpu.hpp"
#include "support.hpp"
#include "suites.hpp"

using namespace gpu_test;

int main(int argc, char** argv) {
  bool small = false;
  bool full = false;  // every case of the sweeps even in the CPU simulation (slow there)
  std::string only;   // run only the suites whose name contains this text
  std::uint64_t seed = 0;
  bool seed_given = false;
  if (const char* text = std::getenv("MXSCOPE_GPU_TEST_SEED")) {
    seed = std::strtoull(text, nullptr, 0);
    seed_given = true;
  }
  for (int i = 1; i < argc; ++i) {
    const std::string argument = argv[i];
    if (argument == "--small") {
      small = true;
    } else if (argument == "--full") {
      full = true;
    } else if (argument == "--only" && i + 1 < argc) {
      only = argv[++i];
    } else if (argument == "--seed" && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 0);
      seed_given = true;
    } else {
      std::fprintf(stderr, "usage: %s [--small | --full] [--seed S] [--only SUITE]\n", argv[0]);
      return 2;
    }
  }
  if (!seed_given) seed = (static_cast<std::uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  case_seeds = seed;
  if (gpu::device_count() == 0) {
    std::printf("FAIL no GPU device found\n0 passed, 1 failed\n");
    return 1;
  }
  const gpu::device_description device = gpu::describe_device();
  // The CPU simulation of the backend runs every GPU thread as a host thread: small cases only.
  const bool simulated = device.name.find("simulation") != std::string::npos;
  if (simulated && !full) small = true;
  std::printf("device: %s (compute capability %d.%d, %d multiprocessors, %.1f GiB)\n", device.name.c_str(),
              device.major, device.minor, device.multiprocessors,
              static_cast<double>(device.global_memory_bytes) / (1u << 30));
  std::printf("seed: 0x%016" PRIx64 " (replay with --seed 0x%016" PRIx64 ")%s\n", seed, seed, small ? " [small]" : "");
  std::fflush(stdout);

  const auto timed = [&](const char* suite, const std::function<void()>& body) {
    if (!only.empty() && std::string(suite).find(only) == std::string::npos) return;
    const auto begin = std::chrono::steady_clock::now();
    body();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    std::printf("-- %s: %.1f s\n", suite, seconds);
    std::fflush(stdout);
  };
  timed("rotations", [&] { rotation_checks(small); });
  timed("quantize sweep", [&] { quantize_sweep(small); });
  timed("staged column sweep", [&] { staged_column_sweep(small); });
  timed("fast encoder", [&] { fast_encoder_checks(small); });
  timed("quantize fused", [&] { quantize_fused(small); });
  timed("quantize nvfp4", [&] { quantize_nvfp4_suite(small); });
  timed("quantize with energies", [&] {
    quantize_energies(small);
    quantize_per_tensor_energies(small);
    quantize_bf16_energies(small);
  });
  timed("quantize native", [&] { quantize_native(small); });
  if (!small && !simulated) timed("quantize large", [&] { quantize_large(); });
  timed("gemm sweep", [&] { gemm_sweep(small); });
  timed("gemm edges", [&] { gemm_edges(small); });
  timed("gemm tensor-core tiles", [&] { gemm_tensor_core_tiles(small); });
  if (simulated || gpu::tensor_core_kernel_available(gpu::tensor_core_kernel::wgmma_fp8)) {
    timed("gemm scaled operand forms", [&] { gemm_scaled_forms(small); });
  }
  timed("gemm integer tiles", [&] { gemm_integer_tiles(small); });
  timed("gemm sliced tiles", [&] { gemm_sliced_tiles(small); });
  if (!small && !simulated) timed("gemm large", [&] { gemm_large(); });
  timed("per-tensor scales", [&] { tensor_scale_checks(small); });
  timed("reference", [&] { reference_checks(small); });
  timed("plain products", [&] { plain_checks(small); });
  timed("compare", [&] { compare_checks(small); });
  timed("cross-step", [&] { cross_step_checks(small); });
  timed("timeline", [&] { timeline_checks(small); });
  timed("uploads", [&] { upload_checks(small); });

  std::printf("%d passed, %d failed\n", results.passed, results.failed);
  return results.failed == 0 ? 0 : 1;
}
