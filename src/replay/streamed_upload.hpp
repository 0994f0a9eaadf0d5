// The first step's x and dy copied to the GPU piece by piece while they are read: an
// io::read_listener given to that read (replay.cpp, start_first_read), so that the step's upload
// does not start only once the whole capture is in memory. Each reading thread copies the piece
// it has just converted, and up to two that were waiting for the device, from memory its read
// still holds; the step copies the rest when the read has returned. A copy that fails leaves its operand to the step's own upload, which reports the
// error.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string_view>
#include <utility>
#include <vector>

#include "../backend/backend.hpp"
#include "mxscope/io/safetensors.hpp"

namespace mxscope::replay_internal {

// Where the pieces go (the GPU in a replay; a host copy in the tests). Operand 0 is x, 1 is dy.
class upload_target {
 public:
  virtual ~upload_target() = default;
  // Whether copies may start now, without waiting; where it answers true the device is the
  // calling thread's current one.
  virtual bool ready() = 0;
  // Room for operand `index`; called once, before its copies.
  virtual void allocate(int index, std::int64_t rows, std::int64_t cols) = 0;
  // Elements [first, first + count) of operand `index` from `values` (the piece's own values,
  // element `first` of the tensor at values[0]); several threads copy disjoint pieces at once.
  virtual void copy(int index, const float* values, std::uint64_t first, std::uint64_t count) = 0;
};

class streamed_upload final : public io::read_listener {
 public:
  explicit streamed_upload(upload_target& target) : target_(target) {}

  void started(std::string_view tensor, const float* values, std::int64_t rows, std::int64_t cols) override;
  void piece(std::string_view tensor, std::uint64_t first, std::uint64_t count) override;

  // After the read returned its entry (whose memory the told pointers still address) and with
  // the target ready: copies the pieces still waiting. Per operand, whether every element of it
  // was copied exactly once; false where a copy failed or the target was not ready (the caller
  // uploads that operand itself).
  std::array<bool, 2> finish();

  // Elements of each operand copied by the reading threads, before finish (what the overlap
  // achieved; the tests read it).
  std::array<std::uint64_t, 2> copied_while_reading() const;

 private:
  using range = std::pair<std::uint64_t, std::uint64_t>;  // first, count
  struct operand {
    const float* values = nullptr;
    std::uint64_t size = 0;
    std::int64_t rows = 0;
    std::int64_t cols = 0;
    bool allocated = false;
    bool failed = false;
    std::vector<range> waiting;  // read, not yet copied
    std::uint64_t copied = 0;
    std::uint64_t copied_while_reading = 0;
  };

  // Under mutex_: at most `most` of the operand's waiting pieces (the newest and the oldest), as
  // ranges, handed to the caller to copy, its room made first where needed; empty where it failed
  // or the target is not ready.
  std::vector<range> take_waiting(operand& o, int index, std::size_t most);
  // Copies `ranges` of operand `index` (outside the lock) and counts them.
  void copy_ranges(int index, const std::vector<range>& ranges, bool reading);

  upload_target& target_;
  mutable std::mutex mutex_;
  std::array<operand, 2> operands_;
};

// The GPU as the target (backend::allocate_beside, backend::upload_beside); `ready` says whether
// its start-up is done, making it current where it is.
class device_upload_target final : public upload_target {
 public:
  explicit device_upload_target(std::function<bool()> ready) : ready_(std::move(ready)) {}
  bool ready() override { return ready_(); }
  void allocate(int index, std::int64_t rows, std::int64_t cols) override;
  void copy(int index, const float* values, std::uint64_t first, std::uint64_t count) override;
  // Operand `index`'s device matrix, for finish's whole operands; null once taken.
  device_matrix_ptr take(int index);

 private:
  std::function<bool()> ready_;
  std::array<std::shared_ptr<backend::device_matrix>, 2> matrices_;
};

}  // namespace mxscope::replay_internal
