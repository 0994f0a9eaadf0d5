// The GPU runtime shim: the handful of runtime calls the backend needs, spelled once for CUDA
// (nvcc, __CUDACC__), once for HIP (clang -x hip, __HIP__) and once for a CPU simulation
// (MXSCOPE_GPU_SIMULATE: plain C++, every GPU thread an std::thread; see simulation.hpp). Kernels and
// host code use only these names, so one source compiles for NVIDIA, AMD and the host without a
// translation step. Kernels are launched with runtime::launch(kernel, grid, block, shared, args...)
// rather than the <<< >>> syntax, which only the GPU compilers understand.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "mxscope/gpu.hpp"  // gpu_error

#if defined(MXSCOPE_GPU_SIMULATE)
#include "simulation.hpp"
#elif defined(__HIP__)
#include <hip/hip_runtime.h>
#elif defined(__CUDACC__)
#include <cuda_runtime.h>
#else
#error "src/gpu is compiled by nvcc (CUDA), by clang -x hip (HIP) or as C++ with MXSCOPE_GPU_SIMULATE"
#endif

namespace mxscope::gpu::runtime {

// The stream the calling thread queues its work on (null: the default stream), and whether its
// temporary device buffers are allocated and freed in that stream's order (gpu::stream_scope sets
// both; see gpu.hpp).
inline thread_local void* current_stream = nullptr;
inline thread_local bool stream_ordered = false;

// The device timeline (gpu::start_timeline, timeline.cu): while it is on, each launch and each
// queued copy and memset is bracketed by a timed_operation, which records an event on the current
// stream before the operation is queued and one after. Off, a scope costs one relaxed load.
inline std::atomic<bool> timeline_on{false};
int timeline_begin(const void* kernel, const char* what, std::int64_t bytes);  // -1: not recorded
void timeline_end(int index);
class timed_operation {
 public:
  timed_operation(const void* kernel, const char* what, std::int64_t bytes)
      : index_(timeline_on.load(std::memory_order_relaxed) ? timeline_begin(kernel, what, bytes) : -1) {}
  ~timed_operation() {
    if (index_ >= 0) timeline_end(index_);
  }
  timed_operation(const timed_operation&) = delete;
  timed_operation& operator=(const timed_operation&) = delete;

 private:
  int index_;
};

#if defined(MXSCOPE_GPU_SIMULATE)
using error_t = simulation::error_t;
using event_t = simulation::event_t;
using device_properties = simulation::device_properties;
inline constexpr error_t success = simulation::success;
using simulation::copy_on_device;
using simulation::copy_on_device_async;
using simulation::copy_to_device;
using simulation::copy_to_host;
using simulation::device_count;
using simulation::error_string;
using simulation::event_create;
using simulation::event_destroy;
using simulation::event_elapsed_ms;
using simulation::event_record;
using simulation::event_synchronize;
using simulation::free;
using simulation::func_set_max_dynamic_shared;
using simulation::get_device;
using simulation::set_device;
using simulation::last_error;
using simulation::malloc;
using simulation::memory_info;
using simulation::memset;
using simulation::properties;
using simulation::synchronize;
inline void* simulation_shared_memory() { return simulation::dynamic_shared_memory(); }
inline error_t malloc_ordered(void** pointer, std::size_t bytes) { return simulation::malloc(pointer, bytes); }
inline error_t free_ordered(void* pointer, void*) { return simulation::free(pointer); }
inline constexpr bool has_ordered_allocation = false;
inline error_t stream_create_beside(void** stream) { return *stream = nullptr, success; }
inline error_t stream_destroy(void*) { return success; }
#elif defined(__HIP__)
using error_t = hipError_t;
using event_t = hipEvent_t;
using device_properties = hipDeviceProp_t;
inline constexpr error_t success = hipSuccess;
inline const char* error_string(error_t error) { return hipGetErrorString(error); }
inline error_t malloc(void** pointer, std::size_t bytes) { return hipMalloc(pointer, bytes); }
inline error_t free(void* pointer) { return hipFree(pointer); }
inline error_t func_set_max_dynamic_shared(const void* kernel, std::size_t bytes) {
  return hipFuncSetAttribute(kernel, hipFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}
inline error_t memory_info(std::size_t* free_bytes, std::size_t* total_bytes) {
  return hipMemGetInfo(free_bytes, total_bytes);
}
inline error_t copy_to_device(void* to, const void* from, std::size_t bytes) {
  return hipMemcpy(to, from, bytes, hipMemcpyHostToDevice);
}
inline error_t copy_to_host(void* to, const void* from, std::size_t bytes) {
  return hipMemcpy(to, from, bytes, hipMemcpyDeviceToHost);
}
inline error_t copy_on_device(void* to, const void* from, std::size_t bytes) {
  return hipMemcpy(to, from, bytes, hipMemcpyDeviceToDevice);
}
inline error_t copy_on_device_async(void* to, const void* from, std::size_t bytes) {
  return hipMemcpyAsync(to, from, bytes, hipMemcpyDeviceToDevice, nullptr);
}
inline error_t memset(void* pointer, int value, std::size_t bytes) { return hipMemset(pointer, value, bytes); }
inline error_t synchronize() { return hipDeviceSynchronize(); }
// Streams are not used by the HIP build: stream-ordered allocation is the plain one, and work
// "beside" the default stream goes to the default stream.
inline error_t stream_create_beside(void** stream) { return *stream = nullptr, hipSuccess; }
inline error_t stream_destroy(void*) { return hipSuccess; }
inline error_t malloc_ordered(void** pointer, std::size_t bytes) { return hipMalloc(pointer, bytes); }
inline error_t free_ordered(void* pointer, void*) { return hipFree(pointer); }
inline constexpr bool has_ordered_allocation = false;
inline error_t last_error() { return hipGetLastError(); }
inline error_t device_count(int* count) { return hipGetDeviceCount(count); }
inline error_t get_device(int* device) { return hipGetDevice(device); }
inline error_t set_device(int device) { return hipSetDevice(device); }
inline error_t properties(device_properties* out, int device) { return hipGetDeviceProperties(out, device); }
inline error_t event_create(event_t* event) { return hipEventCreate(event); }
inline error_t event_destroy(event_t event) { return hipEventDestroy(event); }
inline error_t event_record(event_t event) { return hipEventRecord(event, nullptr); }
inline error_t event_synchronize(event_t event) { return hipEventSynchronize(event); }
inline error_t event_elapsed_ms(float* milliseconds, event_t start, event_t stop) {
  return hipEventElapsedTime(milliseconds, start, stop);
}
inline error_t launch_kernel(const void* kernel, dim3 grid, dim3 block, void** arguments, std::size_t shared_bytes) {
  return hipLaunchKernel(kernel, grid, block, arguments, shared_bytes, nullptr);
}
#else
using error_t = cudaError_t;
using event_t = cudaEvent_t;
using device_properties = cudaDeviceProp;
inline constexpr error_t success = cudaSuccess;
inline const char* error_string(error_t error) { return cudaGetErrorString(error); }
inline error_t malloc(void** pointer, std::size_t bytes) { return cudaMalloc(pointer, bytes); }
inline error_t free(void* pointer) { return cudaFree(pointer); }
inline error_t func_set_max_dynamic_shared(const void* kernel, std::size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}
inline error_t memory_info(std::size_t* free_bytes, std::size_t* total_bytes) {
  return cudaMemGetInfo(free_bytes, total_bytes);
}
inline cudaStream_t stream() { return static_cast<cudaStream_t>(current_stream); }
// A blocking copy on the current stream: ordered after the work queued there, complete on return.
// (On the timeline its stop event is queued before the wait, so it marks the copy's end.)
inline error_t blocking_copy(void* to, const void* from, std::size_t bytes, cudaMemcpyKind kind, const char* what) {
  error_t queued = cudaSuccess;
  {
    const timed_operation timed(nullptr, what, static_cast<std::int64_t>(bytes));
    if (current_stream == nullptr) return cudaMemcpy(to, from, bytes, kind);
    queued = cudaMemcpyAsync(to, from, bytes, kind, stream());
  }
  return queued != cudaSuccess ? queued : cudaStreamSynchronize(stream());
}
inline error_t copy_to_device(void* to, const void* from, std::size_t bytes) {
  return blocking_copy(to, from, bytes, cudaMemcpyHostToDevice, "copy host to device");
}
inline error_t copy_to_host(void* to, const void* from, std::size_t bytes) {
  return blocking_copy(to, from, bytes, cudaMemcpyDeviceToHost, "copy device to host");
}
inline error_t copy_on_device(void* to, const void* from, std::size_t bytes) {
  return blocking_copy(to, from, bytes, cudaMemcpyDeviceToDevice, "copy on device");
}
inline error_t copy_on_device_async(void* to, const void* from, std::size_t bytes) {
  const timed_operation timed(nullptr, "copy on device", static_cast<std::int64_t>(bytes));
  return cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, stream());
}
inline error_t memset(void* pointer, int value, std::size_t bytes) {
  const timed_operation timed(nullptr, "memset", static_cast<std::int64_t>(bytes));
  return cudaMemsetAsync(pointer, value, bytes, stream());
}
// Stream-ordered allocation on the current stream (no implicit device synchronization).
inline error_t malloc_ordered(void** pointer, std::size_t bytes) { return cudaMallocAsync(pointer, bytes, stream()); }
inline error_t free_ordered(void* pointer, void* on_stream) {
  return cudaFreeAsync(pointer, static_cast<cudaStream_t>(on_stream));
}
inline constexpr bool has_ordered_allocation = true;
// A stream that does not synchronize implicitly with the default (legacy) stream.
inline error_t stream_create_beside(void** stream) {
  cudaStream_t created = nullptr;
  const error_t status = cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking);
  *stream = created;
  return status;
}
inline error_t stream_destroy(void* stream) { return cudaStreamDestroy(static_cast<cudaStream_t>(stream)); }
inline error_t synchronize() { return cudaDeviceSynchronize(); }
inline error_t last_error() { return cudaGetLastError(); }
inline error_t device_count(int* count) { return cudaGetDeviceCount(count); }
inline error_t get_device(int* device) { return cudaGetDevice(device); }
inline error_t set_device(int device) { return cudaSetDevice(device); }
inline error_t properties(device_properties* out, int device) { return cudaGetDeviceProperties(out, device); }
inline error_t event_create(event_t* event) { return cudaEventCreate(event); }
inline error_t event_destroy(event_t event) { return cudaEventDestroy(event); }
inline error_t event_record(event_t event) { return cudaEventRecord(event, stream()); }
inline error_t event_synchronize(event_t event) { return cudaEventSynchronize(event); }
inline error_t event_elapsed_ms(float* milliseconds, event_t start, event_t stop) {
  return cudaEventElapsedTime(milliseconds, start, stop);
}
inline error_t launch_kernel(const void* kernel, dim3 grid, dim3 block, void** arguments, std::size_t shared_bytes) {
  return cudaLaunchKernel(kernel, grid, block, arguments, shared_bytes, stream());
}
#endif

[[noreturn]] inline void fail(error_t error, const char* call, const char* file, int line) {
  throw gpu_error(std::string(file) + ":" + std::to_string(line) + ": " + call + " failed: " + error_string(error));
}

}  // namespace mxscope::gpu::runtime

// Checks a runtime call; throws mxscope::gpu::gpu_error naming the file, line, call and error.
#define MXSCOPE_GPU_CHECK(call)                                                      \
  do {                                                                               \
    const ::mxscope::gpu::runtime::error_t mxscope_gpu_status_ = (call);             \
    if (mxscope_gpu_status_ != ::mxscope::gpu::runtime::success) {                   \
      ::mxscope::gpu::runtime::fail(mxscope_gpu_status_, #call, __FILE__, __LINE__); \
    }                                                                                \
  } while (false)

namespace mxscope::gpu::runtime {

// Launches `kernel` on the default stream with arguments converted to its exact parameter types
// (the runtime copies the parameter bytes, so the types must match the kernel's), and checks the
// launch.
template <class... Parameters, class... Arguments>
void launch(void (*kernel)(Parameters...), dim3 grid, dim3 block, std::size_t shared_bytes, Arguments&&... arguments) {
  static_assert(sizeof...(Parameters) == sizeof...(Arguments), "kernel argument count");
  std::tuple<std::decay_t<Parameters>...> values(std::forward<Arguments>(arguments)...);
#if defined(MXSCOPE_GPU_SIMULATE)
  if (!simulation::dynamic_shared_allowed(reinterpret_cast<const void*>(kernel), shared_bytes)) {
    throw gpu_error("launch: " + std::to_string(shared_bytes) +
                    " bytes of dynamic shared memory, past the default 48 KiB without allow_dynamic_shared "
                    "(a device fails such a launch with an invalid argument)");
  }
  const timed_operation timed(reinterpret_cast<const void*>(kernel), nullptr, 0);
  simulation::run(grid, block, shared_bytes, [&] { std::apply(kernel, values); });
#else
  const timed_operation timed(reinterpret_cast<const void*>(kernel), nullptr, 0);
  std::apply(
      [&](auto&... value) {
        void* pointers[] = {static_cast<void*>(&value)...};
        MXSCOPE_GPU_CHECK(launch_kernel(reinterpret_cast<const void*>(kernel), grid, block, pointers, shared_bytes));
      },
      values);
#endif
}

// Lets `kernel` take up to `bytes` of dynamic shared memory, past the default 48 KiB. Called before
// every such launch: the attribute belongs to the current device.
template <class... Parameters>
void allow_dynamic_shared(void (*kernel)(Parameters...), std::size_t bytes) {
  MXSCOPE_GPU_CHECK(func_set_max_dynamic_shared(reinterpret_cast<const void*>(kernel), bytes));
}

}  // namespace mxscope::gpu::runtime
