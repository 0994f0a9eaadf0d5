// GPU test suite: uploads. Copies of 64 MiB and more go through pinned slots on CUDA (upload.cu;
// plain copies on HIP and in the CPU simulation); whichever way, the device must hold the host's
// bytes, on the default stream, after a stream-ordered allocation, and beside the default stream.
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
