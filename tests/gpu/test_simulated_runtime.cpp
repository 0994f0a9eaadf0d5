// The simulated runtime's launch rules that a device enforces, so that code which breaks them fails
// in the CPU simulation (which CI runs) as it would on a GPU: a launch past the default 48 KiB of
// dynamic shared memory needs runtime::allow_dynamic_shared for that kernel, up to 227 KiB.
#define MXSCOPE_GPU_SIMULATE 1
#include "runtime.hpp"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>

namespace {

using mxscope::gpu::gpu_error;
namespace runtime = mxscope::gpu::runtime;

// Fills the block's dynamic shared memory, then thread 0 reports its last byte.
__global__ void fill_shared(std::size_t bytes, unsigned char* last) {
  auto* shared = static_cast<unsigned char*>(runtime::simulation_shared_memory());
  if (threadIdx.x == 0) std::memset(shared, 0x5a, bytes);
  __syncthreads();
  if (threadIdx.x == 0) *last = shared[bytes - 1];
}

__global__ void other_kernel(std::size_t bytes, unsigned char* last) { fill_shared(bytes, last); }

constexpr std::size_t kib = 1024;

TEST(SimulatedRuntime, DefaultDynamicSharedNeedsNoAllowance) {
  unsigned char last = 0;
  runtime::launch(fill_shared, 1, 32, 48 * kib, 48 * kib, &last);
  EXPECT_EQ(last, 0x5a);
}

TEST(SimulatedRuntime, PastTheDefaultOnlyWithinTheKernelsAllowance) {
  unsigned char last = 0;
  EXPECT_THROW(runtime::launch(other_kernel, 1, 32, 48 * kib + 16, 48 * kib + 16, &last), gpu_error);
  EXPECT_EQ(last, 0);  // refused before it ran
  runtime::allow_dynamic_shared(other_kernel, 64 * kib);
  runtime::launch(other_kernel, 1, 32, 64 * kib, 64 * kib, &last);
  EXPECT_EQ(last, 0x5a);
  EXPECT_THROW(runtime::launch(other_kernel, 1, 32, 64 * kib + 16, 64 * kib + 16, &last), gpu_error);
  // The allowance is the kernel's: another kernel still has the default.
  EXPECT_THROW(runtime::launch(fill_shared, 1, 32, 64 * kib, 64 * kib, &last), gpu_error);
}

TEST(SimulatedRuntime, NoAllowancePastTheMultiprocessorsShare) {
  EXPECT_NO_THROW(runtime::allow_dynamic_shared(other_kernel, 227 * kib));
  EXPECT_THROW(runtime::allow_dynamic_shared(other_kernel, 227 * kib + 1), gpu_error);
}

}  // namespace
