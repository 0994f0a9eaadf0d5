#include "mxscope/device.hpp"

#include <fmt/format.h>

#include "mxscope/errors.hpp"
#ifdef MXSCOPE_HAVE_CUDA
#include "mxscope/gpu.hpp"
#endif

namespace mxscope {

compute_device parse_compute_device(const std::string& name, const std::string& flag) {
  if (name == "cpu") return compute_device::cpu;
  if (name != "gpu") throw input_error(fmt::format("{}: must be cpu or gpu, got '{}'", flag, name));
#ifdef MXSCOPE_HAVE_CUDA
  if (gpu::device_count() == 0) {
    throw input_error(fmt::format("{} gpu: no usable GPU (no device or no driver) on this machine; use {} cpu", flag,
                                  flag));
  }
  return compute_device::gpu;
#else
  throw input_error(fmt::format(
      "{} gpu: this mxscope was built without the GPU backend (configure with MXSCOPE_ENABLE_CUDA=ON on a machine with "
      "nvcc, or MXSCOPE_ENABLE_HIP=ON for AMD GPUs, see docs/gpu.md); use {} cpu",
      flag, flag));
#endif
}

int gpu_count() {
#ifdef MXSCOPE_HAVE_CUDA
  return gpu::device_count();
#else
  return 0;
#endif
}

void select_gpu(compute_device device, int index, const std::string& flag) {
  if (device != compute_device::gpu) return;
#ifdef MXSCOPE_HAVE_CUDA
  const int count = gpu::device_count();
  if (index < 0 || index >= count) {
    throw input_error(fmt::format("{} gpu: GPU {} does not exist (this machine has {})", flag, index, count));
  }
  gpu::select_device(index);
#else
  (void)index;
  (void)flag;
#endif
}

std::string device_name(compute_device device) {
#ifdef MXSCOPE_HAVE_CUDA
  if (device == compute_device::gpu) return gpu::describe_device().name;
#else
  (void)device;
#endif
  return "";
}

void placement_counts::count(const gemm_result& result) {
  (result.a.quantized_on_gpu ? quantize_gpu : quantize_cpu) += 1;
  (result.b.quantized_on_gpu ? quantize_gpu : quantize_cpu) += 1;
  (result.product_on_gpu ? product_gpu : product_cpu) += 1;
  if (result.exact_of_quantized.size() != 0 || result.device_exact_of_quantized) {
    (result.exact_of_quantized_on_gpu ? product_gpu : product_cpu) += 1;
  }
}

reference_result reference_on(compute_device device, const matrix& a, const matrix& b, reference_kind kind,
                              placement_counts* placed, bool keep_on_device) {
#ifdef MXSCOPE_HAVE_CUDA
  if (device == compute_device::gpu && kind == reference_kind::exact) {
    if (placed != nullptr) ++placed->reference_gpu;
    return gpu::reference_gemm(a, b, keep_on_device);
  }
#else
  (void)device;
  (void)keep_on_device;
#endif
  if (placed != nullptr) ++placed->reference_cpu;
  return reference_gemm(a, b, kind);
}

comparison compare_on(compute_device device, const matrix& estimate, const matrix64& reference,
                      const matrix& reference_fp32, placement_counts* placed) {
#ifdef MXSCOPE_HAVE_CUDA
  if (device == compute_device::gpu) {
    if (placed != nullptr) ++placed->compare_gpu;
    return gpu::compare(estimate, reference, reference_fp32);
  }
#else
  (void)device;
#endif
  if (placed != nullptr) ++placed->compare_cpu;
  return compare(estimate, reference, reference_fp32);
}

}  // namespace mxscope
