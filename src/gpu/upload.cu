// Large host-to-device copies through pinned memory (CUDA).
//
// A capture's operands live in pageable memory (std::vector, src/io/safetensors.cpp), and one
// cudaMemcpy from there runs at the driver's own staging rate, about 7 GB/s on the H100 and H200
// machines measured (BENCHMARKS.md, "The upload through pinned slots"): 0.08 s for the
// Llama-shaped step's 604 MB, in the step's path. Here staged_upload_threads host threads each own
// two pinned slots of staged_upload_piece bytes and a stream: a thread copies its pieces
// (piece t, t + threads, ...) into one slot while the other's copy to the device runs. The
// device bytes are the host's, whichever way they travel.
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>
#include <thread>
#include <vector>

#include "common.cuh"

namespace mxscope::gpu {

#if !defined(MXSCOPE_GPU_SIMULATE) && !defined(__HIP__)

namespace {

constexpr std::size_t staged_upload_piece = std::size_t{16} << 20;
constexpr int staged_upload_threads = 4;
constexpr std::size_t staged_upload_minimum = std::size_t{64} << 20;  // below: one plain copy

struct upload_lane {
  void* slots[2] = {nullptr, nullptr};
  cudaEvent_t slot_free[2] = {nullptr, nullptr};  // the last copy out of each slot
  cudaEvent_t done = nullptr;
  cudaStream_t stream = nullptr;
};

// The pinned slots, streams and events of one device, made once and kept for the process: they
// are never freed, since a destructor at exit would run after the CUDA runtime's own teardown
// (the driver releases pinned memory when the process ends).
class upload_stager {
 public:
  // Null where the pinned memory or a stream could not be had (the caller copies plainly).
  static upload_stager* of_current_device();

  // Copies `bytes` from `host` to `device` on the lanes, ordered after the work queued on the
  // calling thread's stream and complete on return. Returns the first failed call's status.
  runtime::error_t copy(void* device, const void* host, std::size_t bytes);

 private:
  explicit upload_stager(int device) : device_(device) {}
  bool make();
  runtime::error_t run_lane(int lane, unsigned char* device, const unsigned char* host, std::size_t bytes);

  int device_;
  std::mutex busy_;  // one staged copy at a time: the lanes already fill the bus
  upload_lane lanes_[staged_upload_threads];
};

// The slots' memory: one block of 2 x staged_upload_threads pieces.
constexpr std::size_t staged_block_bytes = 2 * staged_upload_threads * staged_upload_piece;

// The block's host memory, huge pages where the kernel offers them, faulted in (no device needed).
unsigned char* host_block() {
  constexpr std::size_t huge_page = std::size_t{2} << 20;
  static_assert(staged_block_bytes % huge_page == 0);
  void* block = std::aligned_alloc(huge_page, staged_block_bytes);
  if (block == nullptr) return nullptr;
#ifdef MADV_HUGEPAGE
  (void)::madvise(block, staged_block_bytes, MADV_HUGEPAGE);
#endif
  std::memset(block, 0, staged_block_bytes);
  return static_cast<unsigned char*>(block);
}

// A host block made ahead by reserve_staged_upload_memory, for the first stager to pin; the mutex
// is held while it is made, so that a stager made meanwhile waits for it instead of making another.
std::mutex spare_mutex;
unsigned char* spare_block = nullptr;

// The block pinned with cudaHostRegister: faster than cudaMallocHost's own pinning of the same
// bytes, whose wait a warm start-up cannot hide (BENCHMARKS.md, "The step's small kernels and the
// slots from huge pages"). Null where it cannot be had.
unsigned char* pinned_block() {
  unsigned char* block = nullptr;
  {
    const std::lock_guard<std::mutex> lock(spare_mutex);
    std::swap(block, spare_block);
  }
  if (block == nullptr) block = host_block();
  if (block == nullptr) return nullptr;
  if (cudaHostRegister(block, staged_block_bytes, cudaHostRegisterDefault) != cudaSuccess) {
    std::free(block);
    return nullptr;
  }
  return block;
}

bool upload_stager::make() {
  static_assert(staged_upload_piece % (std::size_t{2} << 20) == 0);
  unsigned char* block = pinned_block();
  if (block == nullptr) return false;
  for (int lane_index = 0; lane_index < staged_upload_threads; ++lane_index) {
    upload_lane& lane = lanes_[lane_index];
    if (cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreateWithFlags(&lane.done, cudaEventDisableTiming) != cudaSuccess) {
      return false;
    }
    for (int s = 0; s < 2; ++s) {
      lane.slots[s] = block + (2 * lane_index + s) * staged_upload_piece;
      if (cudaEventCreateWithFlags(&lane.slot_free[s], cudaEventDisableTiming) != cudaSuccess ||
          cudaEventRecord(lane.slot_free[s], lane.stream) != cudaSuccess) {
        return false;
      }
    }
  }
  return true;
}

upload_stager* upload_stager::of_current_device() {
  static std::mutex making;
  static std::vector<upload_stager*> made;  // by device index; null: not made, or failed
  static std::vector<bool> tried;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  const std::lock_guard<std::mutex> lock(making);
  const auto index = static_cast<std::size_t>(device);
  if (made.size() <= index) {
    made.resize(index + 1, nullptr);
    tried.resize(index + 1, false);
  }
  if (!tried[index]) {
    tried[index] = true;
    auto* stager = new upload_stager(device);
    if (stager->make()) {
      made[index] = stager;
    } else {
      (void)cudaGetLastError();  // what was made stays allocated; this device copies plainly
    }
  }
  return made[index];
}

runtime::error_t upload_stager::run_lane(int lane, unsigned char* device, const unsigned char* host,
                                         std::size_t bytes) {
  upload_lane& l = lanes_[lane];
  const std::size_t pieces = (bytes + staged_upload_piece - 1) / staged_upload_piece;
  int slot = 0;
  for (std::size_t p = static_cast<std::size_t>(lane); p < pieces; p += staged_upload_threads) {
    runtime::error_t status = cudaEventSynchronize(l.slot_free[slot]);
    if (status != cudaSuccess) return status;
    const std::size_t offset = p * staged_upload_piece;
    const std::size_t n = std::min(staged_upload_piece, bytes - offset);
    std::memcpy(l.slots[slot], host + offset, n);
    status = cudaMemcpyAsync(device + offset, l.slots[slot], n, cudaMemcpyHostToDevice, l.stream);
    if (status == cudaSuccess) status = cudaEventRecord(l.slot_free[slot], l.stream);
    if (status != cudaSuccess) return status;
    slot ^= 1;
  }
  return cudaEventRecord(l.done, l.stream);
}

runtime::error_t upload_stager::copy(void* device, const void* host, std::size_t bytes) {
  const std::lock_guard<std::mutex> lock(busy_);
  cudaStream_t caller = runtime::stream();
  runtime::error_t status = cudaSuccess;
  {
    const runtime::timed_operation timed(nullptr, "copy host to device", static_cast<std::int64_t>(bytes));
    // The destination may be a stream-ordered allocation of the caller's stream: the lanes start
    // after what is queued there.
    cudaEvent_t ready = nullptr;
    status = cudaEventCreateWithFlags(&ready, cudaEventDisableTiming);
    if (status == cudaSuccess) status = cudaEventRecord(ready, caller);
    for (upload_lane& lane : lanes_) {
      if (status == cudaSuccess) status = cudaStreamWaitEvent(lane.stream, ready, 0);
    }
    if (ready != nullptr) (void)cudaEventDestroy(ready);
    if (status != cudaSuccess) return status;
    auto* to = static_cast<unsigned char*>(device);
    const auto* from = static_cast<const unsigned char*>(host);
    std::vector<runtime::error_t> statuses(staged_upload_threads, cudaSuccess);
    std::vector<std::thread> helpers;
    for (int lane = 1; lane < staged_upload_threads; ++lane) {
      helpers.emplace_back([&, lane] {
        statuses[static_cast<std::size_t>(lane)] = cudaSetDevice(device_);
        if (statuses[static_cast<std::size_t>(lane)] == cudaSuccess) {
          statuses[static_cast<std::size_t>(lane)] = run_lane(lane, to, from, bytes);
        }
      });
    }
    statuses[0] = run_lane(0, to, from, bytes);
    for (std::thread& helper : helpers) helper.join();
    for (const runtime::error_t s : statuses) {
      if (status == cudaSuccess) status = s;
    }
    // The caller's stream (and the timeline's stop event on it) waits for every lane.
    for (upload_lane& lane : lanes_) {
      if (status == cudaSuccess) status = cudaStreamWaitEvent(caller, lane.done, 0);
    }
  }
  if (status != cudaSuccess) return status;
  return cudaStreamSynchronize(caller);
}

}  // namespace

bool staged_upload(void* device, const void* host, std::size_t bytes) {
  if (bytes < staged_upload_minimum) return false;
  upload_stager* stager = upload_stager::of_current_device();
  if (stager == nullptr) return false;
  MXSCOPE_GPU_CHECK(stager->copy(device, host, bytes));
  return true;
}

void prepare_staged_uploads() { (void)upload_stager::of_current_device(); }

void reserve_staged_upload_memory() {
  const std::lock_guard<std::mutex> lock(spare_mutex);
  if (spare_block == nullptr) spare_block = host_block();
}

#else

// HIP and the CPU simulation copy plainly.
bool staged_upload(void*, const void*, std::size_t) { return false; }
void prepare_staged_uploads() {}
void reserve_staged_upload_memory() {}

#endif

}  // namespace mxscope::gpu
