// The GPU backend's comparison sums, the host functions of gpu.hpp that combine the other units'
// kernels, and the replay's cross-step state on the device.
#include "common.cuh"

namespace mxscope::gpu {

#include "compare-inl.cuh"
#include "compare_api-inl.cuh"
#include "cross_step-inl.cuh"

}  // namespace mxscope::gpu
