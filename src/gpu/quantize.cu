// The GPU backend's quantizers: Hadamard rotations, MX quantization (the generic kernels, the fused
// row kernel, the column kernels and the bf16 GEMM operands), the other schemes (per-tensor fp8,
// bf16, NVFP4), the operand energies, and their host functions in gpu.hpp.
#include "common.cuh"

namespace mxscope::gpu {

#include "rotate-inl.cuh"
#include "quantize_mx-inl.cuh"
#include "quantize_schemes-inl.cuh"
#include "quantize_api-inl.cuh"
#include "native_gfx950_quantize.hpp"  // the gfx950 native quantizer (kernel for __gfx950__, stubs elsewhere)
#include "tensor_quantize-inl.cuh"

}  // namespace mxscope::gpu
