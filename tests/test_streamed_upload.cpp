// The replay's streamed upload of the first step's operands (src/replay/streamed_upload.hpp): x and
// dy read by several threads in small pieces, as the dump reader reads them (both at once), into a
// host-side target standing for the GPU. The oracle is the matrices the reads return: the target's
// copy must equal them bit for bit, every element copied exactly once, whenever the target became
// ready (before the read, during it, only at the end, never) and whatever copy failed.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <future>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "../src/replay/streamed_upload.hpp"
#include "mxscope/io/safetensors.hpp"
#include "support/temporary_directory.hpp"

namespace {

namespace fs = std::filesystem;
using mxscope::io::dtype;
using mxscope::io::safetensors_reader;
using mxscope::replay_internal::streamed_upload;
using mxscope::replay_internal::upload_target;

// A host copy of each operand, with a count of how often each element was written.
class host_target final : public upload_target {
 public:
  std::atomic<int> ready_after{0};  // ready() answers true from this call on (negative: never)
  std::atomic<int> fail_copy_of{-1};  // the operand whose copies throw
  std::atomic<int> fail_allocate_of{-1};
  std::atomic<bool> fail_ready{false};

  bool ready() override {
    if (fail_ready) throw std::runtime_error("no device");
    const int after = ready_after.load();
    return after >= 0 && calls_.fetch_add(1) >= after;
  }
  void allocate(int index, std::int64_t rows, std::int64_t cols) override {
    if (index == fail_allocate_of) throw std::runtime_error("no room");
    const std::lock_guard<std::mutex> lock(mutex_);
    values[index].assign(static_cast<std::size_t>(rows * cols), -1.0f);
    writes[index].assign(static_cast<std::size_t>(rows * cols), 0);
    ++allocations[index];
  }
  void copy(int index, const float* from, std::uint64_t first, std::uint64_t count) override {
    if (index == fail_copy_of) throw std::runtime_error("copy failed");
    std::memcpy(values[index].data() + first, from, count * sizeof(float));
    const std::lock_guard<std::mutex> lock(mutex_);
    for (std::uint64_t i = first; i < first + count; ++i) ++writes[index][i];
    ++copies[index];
    largest_copy = std::max(largest_copy, count);
  }

  std::vector<float> values[2];
  std::vector<int> writes[2];
  int allocations[2] = {0, 0};
  int copies[2] = {0, 0};
  std::uint64_t largest_copy = 0;  // elements

 private:
  std::atomic<int> calls_{0};
  std::mutex mutex_;
};

class StreamedUpload : public ::testing::Test {
 protected:
  void SetUp() override {
    mxscope::io::safetensors_writer writer;
    const auto add = [&](const char* name, std::int64_t rows, std::int64_t cols, float scale) {
      std::vector<float> values(static_cast<std::size_t>(rows * cols));
      for (std::size_t i = 0; i < values.size(); ++i) values[i] = scale * static_cast<float>((i * 7919) % 2047) - 1.0f;
      std::vector<std::uint8_t> bytes(values.size() * 4);
      std::memcpy(bytes.data(), values.data(), bytes.size());
      writer.add(name, dtype::f32, {rows, cols}, bytes);
    };
    add("x", 300, 257, 0.25f);  // 77100 elements: 38 pieces of 8 KiB
    add("dy", 300, 33, 0.5f);   // 9900: 5 pieces
    add("w", 33, 257, 0.125f);
    path_ = directory_.path() / "entry.safetensors";
    writer.write(path_);
  }

  // x and dy read at once, each by three threads in pieces of 8 KiB, telling `listener`; then w,
  // which the upload ignores.
  void read(mxscope::io::read_listener& listener) {
    const safetensors_reader reader(path_);
    const safetensors_reader::pieces split{8192, 3, &listener};
    mxscope::io::nonfinite_count counted_dy;
    auto dy = std::async(std::launch::async, [&] { return reader.read_matrix("dy", counted_dy, {}, split); });
    mxscope::io::nonfinite_count counted;
    x_ = reader.read_matrix("x", counted, {}, split);
    dy_ = dy.get();
    (void)reader.read_matrix("w", counted, {}, split);
  }

  // The target's copy of operand `index` is the read's, every element written once.
  void expect_whole_copy(const host_target& target, int index) const {
    const mxscope::matrix& read = index == 0 ? x_ : dy_;
    ASSERT_EQ(target.values[index].size(), read.values.size()) << index;
    EXPECT_EQ(std::memcmp(target.values[index].data(), read.values.data(), read.values.size() * 4), 0) << index;
    EXPECT_EQ(std::count(target.writes[index].begin(), target.writes[index].end(), 1),
              static_cast<std::ptrdiff_t>(read.values.size()))
        << index;
    EXPECT_EQ(target.allocations[index], 1) << index;
  }

  mxscope::testing::temporary_directory directory_;
  fs::path path_;
  mxscope::matrix x_, dy_;
};

TEST_F(StreamedUpload, ReadyFromTheStartCopiesEverythingWhileReading) {
  host_target target;
  streamed_upload upload(target);
  read(upload);
  EXPECT_EQ(upload.copied_while_reading()[0], x_.values.size());
  EXPECT_EQ(upload.copied_while_reading()[1], dy_.values.size());
  EXPECT_EQ(upload.finish(), (std::array<bool, 2>{true, true}));
  expect_whole_copy(target, 0);
  expect_whole_copy(target, 1);
}

TEST_F(StreamedUpload, ReadyOnlyAtTheEndCopiesEverythingThenInOneRange) {
  host_target target;
  target.ready_after = -1;
  streamed_upload upload(target);
  read(upload);
  EXPECT_EQ(upload.copied_while_reading()[0], 0U);
  EXPECT_EQ(upload.copied_while_reading()[1], 0U);
  target.ready_after = 0;
  EXPECT_EQ(upload.finish(), (std::array<bool, 2>{true, true}));
  expect_whole_copy(target, 0);
  expect_whole_copy(target, 1);
  // The waiting pieces, adjacent, went as one copy per operand (the pinned path's size).
  EXPECT_EQ(target.copies[0], 1);
  EXPECT_EQ(target.copies[1], 1);
}

// Ready from its 20th question on: some pieces wait, the reading threads copy them with later
// pieces, and finish has nothing or little left.
TEST_F(StreamedUpload, ReadyDuringTheReadCopiesWaitingPiecesOnce) {
  host_target target;
  target.ready_after = 20;
  streamed_upload upload(target);
  read(upload);
  const auto during = upload.copied_while_reading();
  EXPECT_GT(during[0], 0U);
  EXPECT_LE(during[0], x_.values.size());
  // A reading thread copies its piece and at most two that waited (pieces of 2048 elements).
  EXPECT_LE(target.largest_copy, 3U * 2048U);
  EXPECT_EQ(upload.finish(), (std::array<bool, 2>{true, true}));
  expect_whole_copy(target, 0);
  expect_whole_copy(target, 1);
}

TEST_F(StreamedUpload, AFailedCopyOrAllocationLeavesThatOperandToTheCaller) {
  for (const bool allocation : {false, true}) {
    host_target target;
    (allocation ? target.fail_allocate_of : target.fail_copy_of) = 0;
    streamed_upload upload(target);
    read(upload);
    EXPECT_EQ(upload.finish(), (std::array<bool, 2>{false, true})) << allocation;
    expect_whole_copy(target, 1);
  }
}

// What the target throws stays out of the read (which returns its values) and off both operands.
TEST_F(StreamedUpload, ATargetThatThrowsWhenAskedLeavesTheReadAlone) {
  host_target target;
  target.fail_ready = true;
  streamed_upload upload(target);
  read(upload);
  EXPECT_EQ(x_.values.size(), 300U * 257U);
  EXPECT_EQ(upload.finish(), (std::array<bool, 2>{false, false}));
}

TEST_F(StreamedUpload, NeverReadyCopiesNothing) {
  host_target target;
  target.ready_after = -1;
  streamed_upload upload(target);
  read(upload);
  EXPECT_EQ(upload.finish(), (std::array<bool, 2>{false, false}));
  EXPECT_EQ(target.allocations[0] + target.allocations[1], 0);
}

}  // namespace
