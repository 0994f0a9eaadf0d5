// Choosing where the heavy stages of a GEMM study run: `cpu` (the default) or `gpu` (the GPU
// backend of include/mxscope/gpu.hpp, when this build has it). Every stage gives the same bits on
// either device; the GPU takes the stages it has kernels for and leaves the rest to the CPU:
// - quantize: MX formats on the GPU, and within gemm/replay per-tensor fp8 and bf16 too; NVFP4
//   and fp32 on the CPU;
// - product: MX x MX under exact, fp32-block, fp32-group:G, fp32-seq on the GPU, and finite
//   bf16/fp32 operands (fp32 output) under the same models (exact through the reference kernel),
//   and per-tensor fp8 operands with finite elements under exact, fp32-block, fp32-group:G (the
//   codes as MX operands with unit block scales, the tensor scales applied on the host);
//   trunc-align, trunc-promote, NVFP4 and the remaining per-tensor fp8 cases on the CPU;
// - reference: `exact` on the GPU; `fp64` (with its per-entry bounds) on the CPU;
// - comparison sums: on the GPU, in the canonical order of compare.hpp.
#pragma once

#include <cstdint>
#include <string>

#include "mxscope/compare.hpp"
#include "mxscope/gemm.hpp"
#include "mxscope/reference.hpp"
#include "mxscope/tensor.hpp"

namespace mxscope {

// "cpu" or "gpu". Throws input_error (naming `flag`) for another name, for gpu in a build without
// the GPU backend, and for gpu on a machine without a usable GPU.
compute_device parse_compute_device(const std::string& name, const std::string& flag = "--device");

// The number of usable GPUs (0 in a build without the GPU backend or on a machine without one).
int gpu_count();

// Makes GPU `index` current for this thread (with --device gpu; ignored for cpu). Throws input_error
// naming `flag` when the machine has no such GPU.
void select_gpu(compute_device device, int index, const std::string& flag = "--device");

// The name of the current GPU, or "" for cpu.
std::string device_name(compute_device device);

// How many times each stage ran on each device (for run.json and reports).
struct placement_counts {
  std::int64_t quantize_gpu = 0, quantize_cpu = 0;
  std::int64_t product_gpu = 0, product_cpu = 0;
  std::int64_t reference_gpu = 0, reference_cpu = 0;
  std::int64_t compare_gpu = 0, compare_cpu = 0;
  std::int64_t cross_step_gpu = 0, cross_step_cpu = 0;  // replay's cross-step state updates (reference and unit steps)
  void count(const gemm_result& result);  // its two quantizations and its products (exact_too's included)
};

// reference_gemm on `device` (see the list above). keep_on_device: a reference computed on the GPU
// stays in device memory (reference_result::device_fp64, device_fp32; the host matrices empty).
reference_result reference_on(compute_device device, const matrix& a, const matrix& b, reference_kind kind,
                              placement_counts* placed = nullptr, bool keep_on_device = false);

// compare on `device`.
comparison compare_on(compute_device device, const matrix& estimate, const matrix64& reference,
                      const matrix& reference_fp32, placement_counts* placed = nullptr);

}  // namespace mxscope
