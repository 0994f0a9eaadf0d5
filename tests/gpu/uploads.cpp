// GPU test suite: uploads. Copies of 64 MiB and more go through pinned slots on CUDA (upload.cu;
// plain copies on HIP and in the CPU simulation); whichever way, the device must hold the host's
// bytes, on the default stream, after a stream-ordered allocation, and beside the default stream.
// Also the buffer cache of device_buffer (memory.cu): which allocations take a kept buffer.
#include <cstdint>
#include <cstring>

#include "support.hpp"

namespace gpu_test {

namespace {

// Distinct bit patterns in every word (NaN and Inf patterns included: a copy moves bits).
mxscope::matrix pattern(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  mxscope::matrix values(rows, cols);
  std::uint64_t state = seed;
  for (float& v : values.values) {
    const auto bits = static_cast<std::uint32_t>(split_mix(state));
    std::memcpy(&v, &bits, sizeof(bits));
  }
  return values;
}

std::string same_bits(const gpu::device_matrix& device, const mxscope::matrix& host) {
  const mxscope::matrix back = device.download32();
  if (back.rows != host.rows || back.cols != host.cols) return "the shape changed";
  const std::size_t bytes = host.values.size() * sizeof(float);
  if (std::memcmp(back.values.data(), host.values.data(), bytes) == 0) return "";
  for (std::size_t i = 0; i < host.values.size(); ++i) {
    if (std::memcmp(&back.values[i], &host.values[i], sizeof(float)) != 0) {
      return "word " + std::to_string(i) + " of " + std::to_string(host.values.size()) + " differs (byte " +
             std::to_string(i * sizeof(float)) + ")";
    }
  }
  return "differs";
}

}  // namespace

void upload_checks(bool small) {
  // Just below the staged minimum (64 MiB), at it, and an odd size of several pieces per lane
  // (16 MiB pieces, 4 lanes) whose last piece is short.
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {{4096, 4095}, {4096, 4096}};
  if (!small) shapes.push_back({8191, 3103 * 4 + 1});
  for (const auto& [rows, cols] : shapes) {
    const mxscope::matrix values = pattern(rows, cols, next_seed());
    const std::string shape = std::to_string(rows) + " x " + std::to_string(cols);
    run_case("upload " + shape + ": the device holds the host's bits", [&]() -> std::string {
      return same_bits(gpu::device_matrix::upload(values), values);
    });
    run_case("upload " + shape + " after a stream-ordered allocation", [&]() -> std::string {
      const gpu::stream_scope scope(nullptr, true);
      const gpu::device_matrix device = gpu::device_matrix::upload(values);
      return same_bits(device, values);
    });
    run_case("upload beside " + shape + ": the device holds the host's bits", [&]() -> std::string {
      return same_bits(gpu::upload_beside(values), values);
    });
  }
  run_case("device buffers kept for reuse on the default stream only", []() -> std::string {
    // Nothing kept from the cases before (a kept buffer a little larger than this one would be
    // taken first), then an odd size no other case allocates.
    gpu::release_cached_memory();
    constexpr std::size_t bytes = 1234567;
    void* first = nullptr;
    {
      gpu::device_buffer buffer(bytes);
      first = buffer.get();
    }
    {
      // Three times the size: the kept buffer is too small; a quarter: it is more than twice as large.
      const gpu::device_buffer larger(3 * bytes);
      const gpu::device_buffer smaller(bytes / 4);
      if (larger.get() == first || smaller.get() == first) return "a kept buffer of the wrong size was taken";
    }
    {
      // Another stream current (never used: the allocation is not stream-ordered, so the pointer is
      // only compared): the stream does not wait for the default stream's work, so no kept buffer.
      const gpu::stream_scope scope(reinterpret_cast<void*>(std::uintptr_t{16}), false);
      const gpu::device_buffer beside(bytes);
      if (beside.get() == first) return "an allocation beside the default stream took a kept buffer";
    }
    gpu::device_buffer again(bytes);
    if (again.get() != first) return "the buffer given back was not taken again on the default stream";
    if (again.bytes() != bytes) return "the buffer taken again reports " + std::to_string(again.bytes()) + " bytes";
    // The taken buffer holds what is written to it.
    const mxscope::matrix values = pattern(1, static_cast<std::int64_t>(bytes / sizeof(float)), next_seed());
    again.upload(values.data(), values.values.size() * sizeof(float));
    mxscope::matrix back(1, values.cols);
    again.download(back.data(), values.values.size() * sizeof(float));
    if (std::memcmp(back.data(), values.data(), values.values.size() * sizeof(float)) != 0) return "bytes differ";
    return "";
  });
  const bool simulated = gpu::describe_device().name.find("simulation") != std::string::npos;
  if (simulated) return;  // the simulation's timeline records kernels only
  run_case("a staged upload is one timed copy of its bytes", [&]() -> std::string {
    const mxscope::matrix values = pattern(4096, 4096 + 8, next_seed());
    gpu::start_timeline();
    const gpu::device_matrix device = gpu::device_matrix::upload(values);
    const auto operations = gpu::finish_timeline();
    const auto bytes = static_cast<std::int64_t>(values.values.size() * sizeof(float));
    int copies = 0;
    for (const auto& op : operations) {
      if (op.name != "copy host to device") continue;
      ++copies;
      if (op.bytes != bytes) return "a copy of " + std::to_string(op.bytes) + " bytes, not " + std::to_string(bytes);
      if (!(op.stop_ms > op.start_ms)) return "the copy took no time";
    }
    if (copies != 1) return std::to_string(copies) + " copies recorded, not 1";
    return same_bits(device, values);
  });
}

}  // namespace gpu_test
