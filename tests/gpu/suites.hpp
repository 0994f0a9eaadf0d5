// The GPU test's suites, one family of kernels per file, in the order test_gpu.cpp runs them.
// `small`: a few small cases of each (compute-sanitizer runs and the CPU simulation).
#pragma once

namespace gpu_test {

// quantize_mx.cpp
void rotation_checks(bool small);
void quantize_sweep(bool small);
void staged_column_sweep(bool small);
void fast_encoder_checks(bool small);
void quantize_native(bool small);
void quantize_large();
// quantize_fused.cpp
void quantize_fused(bool small);
// quantize_energies.cpp
void quantize_nvfp4_suite(bool small);
void quantize_energies(bool small);
void quantize_per_tensor_energies(bool small);
void quantize_bf16_energies(bool small);
// gemm_mx.cpp
void gemm_sweep(bool small);
void gemm_edges(bool small);
void gemm_integer_tiles(bool small);
void gemm_sliced_tiles(bool small);
// gemm_tensor_core.cpp
void gemm_tensor_core_tiles(bool small);
void gemm_scaled_forms(bool small);
void gemm_large();
// gemm_per_tensor.cpp
void tensor_scale_checks(bool small);
// reference_plain.cpp
void reference_checks(bool small);
void plain_checks(bool small);
// metrics.cpp
void compare_checks(bool small);
void cross_step_checks(bool small);
// timeline.cpp
void timeline_checks(bool small);
// uploads.cpp
void upload_checks(bool small);

}  // namespace gpu_test
