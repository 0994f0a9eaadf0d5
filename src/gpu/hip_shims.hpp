// Device-library shims for the HIP build with -nogpulib (tools/build-hip): the HIP headers of
// Debian's libamdhip64-dev read threadIdx, blockIdx, blockDim and gridDim through four functions of
// ROCm's device library (ockl), and __syncthreads() fences through a fifth, and that library is not
// installed here. These definitions compute the same values from the hardware registers (work-item
// and work-group ids) and from the HSA kernel dispatch packet (work-group size and grid size, in
// work-items), and fence with the compiler's own fence builtin, so the code object links without it.
#pragma once

#if defined(__HIP__) && defined(__HIP_DEVICE_COMPILE__)

#include <cstddef>

namespace mxscope::gpu::hip_shims {

// hsa_kernel_dispatch_packet_t: uint16 workgroup_size_x/y/z at bytes 4/6/8, uint32 grid_size_x/y/z
// at bytes 12/16/20.
__device__ inline const unsigned char* dispatch_packet() {
  return (const unsigned char*)__builtin_amdgcn_dispatch_ptr();
}

}  // namespace mxscope::gpu::hip_shims

extern "C" __device__ __attribute__((const)) std::size_t __ockl_get_local_id(unsigned int dimension) {
  switch (dimension) {
    case 0:
      return __builtin_amdgcn_workitem_id_x();
    case 1:
      return __builtin_amdgcn_workitem_id_y();
    default:
      return __builtin_amdgcn_workitem_id_z();
  }
}

extern "C" __device__ __attribute__((const)) std::size_t __ockl_get_group_id(unsigned int dimension) {
  switch (dimension) {
    case 0:
      return __builtin_amdgcn_workgroup_id_x();
    case 1:
      return __builtin_amdgcn_workgroup_id_y();
    default:
      return __builtin_amdgcn_workgroup_id_z();
  }
}

extern "C" __device__ __attribute__((const)) std::size_t __ockl_get_local_size(unsigned int dimension) {
  const unsigned char* packet = mxscope::gpu::hip_shims::dispatch_packet();
  return *(const unsigned short*)(packet + 4 + 2 * (dimension < 3 ? dimension : 2));
}

extern "C" __device__ __attribute__((const)) std::size_t __ockl_get_num_groups(unsigned int dimension) {
  const unsigned char* packet = mxscope::gpu::hip_shims::dispatch_packet();
  const unsigned int axis = dimension < 3 ? dimension : 2;
  const unsigned int group = *(const unsigned short*)(packet + 4 + 2 * axis);
  const unsigned int grid = *(const unsigned int*)(packet + 12 + 4 * axis);
  return (grid + group - 1) / group;
}

// A fence at least as strong as the one asked for: sequentially consistent, at the asked scope.
extern "C" __device__ void __atomic_work_item_fence(__cl_mem_fence_flags, __memory_order, __memory_scope scope) {
  switch (scope) {
    case __memory_scope_work_item:
      break;
    case __memory_scope_sub_group:
    case __memory_scope_work_group:
      __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "workgroup");
      break;
    case __memory_scope_device:
      __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "agent");
      break;
    default:
      __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "");
      break;
  }
}

#endif
