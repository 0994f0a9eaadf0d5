// The smallest user of mxscope_gpu: links the backend (CUDA or HIP) into a plain C++ program, asks
// the runtime how many devices it sees and names each. On a machine without a GPU or driver it must
// report zero devices (not crash, not abort inside the runtime) and refuse to select device 0 with
// mxscope::gpu::gpu_error, which is what the CLI's "no usable GPU" error (exit 2) rests on.
// Exit code: 0 when the answers are consistent, 1 otherwise.
#include <cstdio>
#include <exception>

#include "mxscope/gpu.hpp"

int main() {
  namespace gpu = mxscope::gpu;
  const int count = gpu::device_count();
  std::printf("mxscope_gpu_probe: %d device(s)\n", count);
  if (count < 0) return 1;
  if (count == 0) {
    try {
      gpu::select_device(0);
    } catch (const gpu::gpu_error& error) {
      std::printf("mxscope_gpu_probe: no usable GPU; select_device(0): %s\n", error.what());
      return 0;
    }
    std::printf("mxscope_gpu_probe: select_device(0) succeeded with no device\n");
    return 1;
  }
  try {
    for (int index = 0; index < count; ++index) {
      gpu::select_device(index);
      const gpu::device_description device = gpu::describe_device();
      std::printf("mxscope_gpu_probe: device %d: %s (%d.%d, %d multiprocessors, %llu bytes)\n", index,
                  device.name.c_str(), device.major, device.minor, device.multiprocessors,
                  static_cast<unsigned long long>(device.global_memory_bytes));
    }
  } catch (const std::exception& error) {
    std::printf("mxscope_gpu_probe: %s\n", error.what());
    return 1;
  }
  return 0;
}
