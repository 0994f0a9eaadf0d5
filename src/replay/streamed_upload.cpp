// streamed_upload (streamed_upload.hpp).
#include "streamed_upload.hpp"

#include <algorithm>
#include <exception>
#include <limits>

namespace mxscope::replay_internal {

namespace {
int operand_index(std::string_view tensor) { return tensor == "x" ? 0 : tensor == "dy" ? 1 : -1; }

// What a reading thread copies when told of a piece: that piece and at most two of those that
// waited for the device, so that a backlog (the pieces read before the GPU's context existed, most
// of a cold read on an H100) is shared by the reading threads instead of stalling the first one.
constexpr std::size_t pieces_per_copy = 3;
}  // namespace

void streamed_upload::started(std::string_view tensor, const float* values, std::int64_t rows, std::int64_t cols) {
  const int index = operand_index(tensor);
  if (index < 0) return;
  const std::lock_guard<std::mutex> lock(mutex_);
  operand& o = operands_[static_cast<std::size_t>(index)];
  o.values = values;
  o.rows = rows;
  o.cols = cols;
  o.size = static_cast<std::uint64_t>(rows * cols);
}

// Nothing the target throws reaches the read: a failure is the operand's, which the caller then
// uploads itself.
std::vector<streamed_upload::range> streamed_upload::take_waiting(operand& o, int index, std::size_t most) {
  if (o.failed || o.values == nullptr) return {};
  try {
    if (!target_.ready()) return {};
    if (!o.allocated) {
      target_.allocate(index, o.rows, o.cols);
      o.allocated = true;
    }
  } catch (const std::exception&) {
    o.failed = true;
    return {};
  }
  // The newest piece (the caller's own) and the oldest waiting ones, `most` in all.
  std::vector<range> pieces;
  if (o.waiting.size() <= most) {
    pieces.swap(o.waiting);
  } else {
    pieces.assign(o.waiting.begin(), o.waiting.begin() + static_cast<std::ptrdiff_t>(most - 1));
    pieces.push_back(o.waiting.back());
    o.waiting.erase(o.waiting.begin(), o.waiting.begin() + static_cast<std::ptrdiff_t>(most - 1));
    o.waiting.pop_back();
  }
  // Adjacent pieces as one range: a large copy takes the pinned path (device_buffer::upload),
  // which a copy of every piece alone would miss where the device was ready only at the end.
  std::sort(pieces.begin(), pieces.end());
  std::vector<range> taken;
  for (const range& r : pieces) {
    if (!taken.empty() && taken.back().first + taken.back().second == r.first) {
      taken.back().second += r.second;
    } else {
      taken.push_back(r);
    }
  }
  return taken;
}

void streamed_upload::copy_ranges(int index, const std::vector<range>& ranges, bool reading) {
  operand& o = operands_[static_cast<std::size_t>(index)];
  std::uint64_t done = 0;
  try {
    for (const auto& [first, count] : ranges) {
      target_.copy(index, o.values + first, first, count);
      done += count;
    }
  } catch (const std::exception&) {
    const std::lock_guard<std::mutex> lock(mutex_);
    o.failed = true;
    return;
  }
  const std::lock_guard<std::mutex> lock(mutex_);
  o.copied += done;
  if (reading) o.copied_while_reading += done;
}

// The piece's memory, and that of the pieces waiting, is the read's until read_matrix returns,
// which is after this call: the copies run here, on the reading thread.
void streamed_upload::piece(std::string_view tensor, std::uint64_t first, std::uint64_t count) {
  const int index = operand_index(tensor);
  if (index < 0 || count == 0) return;
  std::vector<range> ranges;
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    operand& o = operands_[static_cast<std::size_t>(index)];
    o.waiting.emplace_back(first, count);
    ranges = take_waiting(o, index, pieces_per_copy);
  }
  copy_ranges(index, ranges, true);
}

std::array<bool, 2> streamed_upload::finish() {
  std::array<bool, 2> whole{};
  for (int index = 0; index < 2; ++index) {
    std::vector<range> ranges;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      ranges = take_waiting(operands_[static_cast<std::size_t>(index)], index, std::numeric_limits<std::size_t>::max());
    }
    copy_ranges(index, ranges, false);
    const std::lock_guard<std::mutex> lock(mutex_);
    const operand& o = operands_[static_cast<std::size_t>(index)];
    whole[static_cast<std::size_t>(index)] = o.allocated && !o.failed && o.waiting.empty() && o.copied == o.size;
  }
  return whole;
}

std::array<std::uint64_t, 2> streamed_upload::copied_while_reading() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return {operands_[0].copied_while_reading, operands_[1].copied_while_reading};
}

void device_upload_target::allocate(int index, std::int64_t rows, std::int64_t cols) {
  matrices_[static_cast<std::size_t>(index)] = backend::allocate_beside(rows, cols);
}

void device_upload_target::copy(int index, const float* values, std::uint64_t first, std::uint64_t count) {
  backend::upload_beside(*matrices_[static_cast<std::size_t>(index)], values, static_cast<std::int64_t>(first),
                         static_cast<std::int64_t>(count));
}

device_matrix_ptr device_upload_target::take(int index) { return std::move(matrices_[static_cast<std::size_t>(index)]); }

}  // namespace mxscope::replay_internal
