// The GPU backend's emulated products and the exact reference: canonical operands, the generic,
// fp64-tile, integer, tensor-core and sliced kernels (the product kernels share one anonymous namespace,
// opened in gemm_generic-inl.cuh and closed in gemm_exact_wgmma-inl.cuh), which one runs, and the exact
// reference of fp32 operands.
#include "common.cuh"

namespace mxscope::gpu {

#include "transpose-inl.cuh"
#include "canonical_operands-inl.cuh"
#include "gemm_generic-inl.cuh"
#include "gemm_fp64_tiles-inl.cuh"
#include "gemm_block_warp-inl.cuh"
#include "gemm_integer-inl.cuh"
#include "gemm_tensor_core-inl.cuh"
#include "gemm_sliced-inl.cuh"
#include "gemm_sm90-inl.cuh"
#include "gemm_sliced_wgmma-inl.cuh"
#include "gemm_exact_wgmma-inl.cuh"
#include "gemm_launch-inl.cuh"
#include "reference-inl.cuh"
#include "gemm_api-inl.cuh"

}  // namespace mxscope::gpu
