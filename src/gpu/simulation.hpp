// A CPU simulation of the small part of the CUDA programming model the backend uses, so that the
// kernels of src/gpu/*.cu compile as plain C++ (MXSCOPE_GPU_SIMULATE) and run on the host: every GPU
// thread of a thread block is an std::thread, __syncthreads() is a barrier of the block, thread
// blocks run one after another, "device memory" is host memory. The warp-level primitives of the
// tensor-core path (cp.async, ldmatrix x4, mma.sync m16n8k32 s8, mma.sync m16n8k8 f64) are emulated from their documented
// per-lane semantics, with a barrier per warp; the warpgroup MMA of s8 operands in shared memory
// (wgmma.mma_async m64nNk32) from its matrix descriptors, one thread at a time (tied to the
// hardware's layout because tensor_core_wgmma_kernel, which the GPU test also runs on the device,
// runs on it here); mbarriers and the bulk copies that complete on them, as atomic words. Registers
// are not modelled: setmaxnreg does nothing here (register_split_fits checks the splits when
// compiling).
//
// Purpose: tests of the kernels' logic (indexing, barriers, tails, the model steps) on machines
// without a GPU, with the same bit-exactness checks the GPU test makes. It says nothing about the
// GPU compilers or the hardware (tools/gpu-test is the real check), and it is slow: small shapes.
#pragma once

#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

// ------------------------------------------------------------------------------------------------
// The CUDA vocabulary, as host C++.

#define __global__
#define __device__
#define __host__
#define __noinline__ __attribute__((noinline))
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __shared__ static  // one simulated thread block runs at a time, so a static is its shared memory

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(16) int4 {
  int x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

namespace mxscope::gpu::simulation {

struct thread_state {
  std::barrier<>* block_barrier = nullptr;
  std::barrier<>* warp_barrier = nullptr;
  unsigned char* dynamic_shared = nullptr;
  void* warp_exchange = nullptr;
};
inline thread_local thread_state current;

}  // namespace mxscope::gpu::simulation

inline void __syncthreads() { mxscope::gpu::simulation::current.block_barrier->arrive_and_wait(); }
// A shared-memory address: here the offset into the block's dynamic shared memory (the only shared
// memory the kernels address this way), so that alignments and swizzles computed from it agree
// with the emulated MMA's reading of descriptors.
inline std::size_t __cvta_generic_to_shared(const void* pointer) {
  return static_cast<std::size_t>(static_cast<const unsigned char*>(pointer) -
                                  mxscope::gpu::simulation::current.dynamic_shared);
}

inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  return std::atomic_ref<unsigned long long>(*address).fetch_add(value);
}
inline unsigned long long atomicMax(unsigned long long* address, unsigned long long value) {
  std::atomic_ref<unsigned long long> target(*address);
  unsigned long long seen = target.load();
  while (seen < value && !target.compare_exchange_weak(seen, value)) {
  }
  return seen;
}
inline unsigned atomicMax(unsigned* address, unsigned value) {
  std::atomic_ref<unsigned> target(*address);
  unsigned seen = target.load();
  while (seen < value && !target.compare_exchange_weak(seen, value)) {
  }
  return seen;
}
inline unsigned long long atomicMin(unsigned long long* address, unsigned long long value) {
  std::atomic_ref<unsigned long long> target(*address);
  unsigned long long seen = target.load();
  while (seen > value && !target.compare_exchange_weak(seen, value)) {
  }
  return seen;
}
inline unsigned long long atomicOr(unsigned long long* address, unsigned long long value) {
  return std::atomic_ref<unsigned long long>(*address).fetch_or(value);
}

inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }

namespace mxscope::gpu::simulation {

// ------------------------------------------------------------------------------------------------
// Runtime calls.

enum error_t : int { success = 0, failure = 1 };
inline const char* error_string(error_t error) { return error == success ? "no error" : "simulation error"; }

struct device_properties {
  char name[256] = "CPU simulation of the GPU backend";
  int major = 0;
  int minor = 0;
  int multiProcessorCount = 1;
  std::size_t totalGlobalMem = 0;
};

inline error_t malloc(void** pointer, std::size_t bytes) {
  *pointer = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  return *pointer != nullptr ? success : failure;
}
inline error_t free(void* pointer) {
  std::free(pointer);
  return success;
}
// The simulation's memory is the host's: reported as plentiful, so allocations decide.
inline error_t memory_info(std::size_t* free_bytes, std::size_t* total_bytes) {
  *free_bytes = std::size_t{1} << 62;
  *total_bytes = std::size_t{1} << 62;
  return success;
}
inline error_t copy_to_device(void* to, const void* from, std::size_t bytes) {
  std::memcpy(to, from, bytes);
  return success;
}
inline error_t copy_to_host(void* to, const void* from, std::size_t bytes) {
  std::memcpy(to, from, bytes);
  return success;
}
inline error_t copy_on_device(void* to, const void* from, std::size_t bytes) {
  std::memcpy(to, from, bytes);
  return success;
}
inline error_t copy_on_device_async(void* to, const void* from, std::size_t bytes) {
  return copy_on_device(to, from, bytes);
}
inline error_t memset(void* pointer, int value, std::size_t bytes) {
  std::memset(pointer, value, bytes);
  return success;
}
inline error_t synchronize() { return success; }
// A kernel's dynamic shared memory: the default 48 KiB, or what func_set_max_dynamic_shared allowed
// it, up to a Hopper multiprocessor's opt-in 227 KiB; as on a device, a launch past its allowance
// fails (runtime::launch), so that a missing cudaFuncSetAttribute fails here too.
inline constexpr std::size_t default_dynamic_shared = 48 * 1024;
inline constexpr std::size_t most_dynamic_shared = 227 * 1024;
struct shared_allowances {
  std::mutex mutex;
  std::vector<std::pair<const void*, std::size_t>> kernels;
  static shared_allowances& instance() {
    static shared_allowances allowances;
    return allowances;
  }
};
inline error_t func_set_max_dynamic_shared(const void* kernel, std::size_t bytes) {
  if (bytes > most_dynamic_shared) return failure;
  auto& allowances = shared_allowances::instance();
  const std::lock_guard<std::mutex> lock(allowances.mutex);
  for (auto& [known, allowed] : allowances.kernels) {
    if (known == kernel) return allowed = bytes, success;
  }
  allowances.kernels.emplace_back(kernel, bytes);
  return success;
}
inline bool dynamic_shared_allowed(const void* kernel, std::size_t bytes) {
  if (bytes <= default_dynamic_shared) return true;
  auto& allowances = shared_allowances::instance();
  const std::lock_guard<std::mutex> lock(allowances.mutex);
  for (const auto& [known, allowed] : allowances.kernels) {
    if (known == kernel) return bytes <= allowed;
  }
  return false;
}
inline error_t last_error() { return success; }
inline error_t device_count(int* count) {
  *count = 1;
  return success;
}
inline error_t get_device(int* device) {
  *device = 0;
  return success;
}
inline error_t set_device(int device) { return device == 0 ? success : failure; }
inline error_t properties(device_properties* out, int) {
  *out = device_properties{};
  return success;
}

using clock = std::chrono::steady_clock;
using event_t = clock::time_point*;
inline error_t event_create(event_t* event) {
  *event = new clock::time_point();
  return success;
}
inline error_t event_destroy(event_t event) {
  delete event;
  return success;
}
inline error_t event_record(event_t event) {
  *event = clock::now();
  return success;
}
inline error_t event_synchronize(event_t) { return success; }
inline error_t event_elapsed_ms(float* milliseconds, event_t start, event_t stop) {
  *milliseconds = std::chrono::duration<float, std::milli>(*stop - *start).count();
  return success;
}

// ------------------------------------------------------------------------------------------------
// Launches: each thread of a block is one of a pool of std::threads (started once, reused by every
// launch); blocks run in order; a launch returns when the whole grid is done (launches are
// synchronous).

struct warp_fragments {
  std::uint32_t a[32][4];
  std::uint32_t b[32][2];
  int c[32][4];
  const void* rows[32];  // ldmatrix: each lane's row address
  double fa[32][4];      // mma m16n8k8 f64: each lane's A, B and C elements
  double fb[32][2];
  double fc[32][4];
};

class thread_pool {
 public:
  static constexpr unsigned max_threads = 512;  // the largest thread block the kernels launch

  static thread_pool& instance() {
    static thread_pool pool;
    return pool;
  }

  template <class Body>
  void run(dim3 grid, dim3 block, std::size_t shared_bytes, Body& body) {
    const unsigned threads = block.x * block.y * block.z;
    if (threads == 0 || threads > max_threads) std::abort();
    const std::lock_guard<std::mutex> one_launch_at_a_time(launch_mutex_);
    const unsigned warps = (threads + 31) / 32;
    std::barrier<> block_barrier(static_cast<std::ptrdiff_t>(threads));
    std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
    for (unsigned w = 0; w < warps; ++w) {
      const unsigned members = threads - 32 * w < 32 ? threads - 32 * w : 32;
      warp_barriers.push_back(std::make_unique<std::barrier<>>(static_cast<std::ptrdiff_t>(members)));
    }
    std::vector<warp_fragments> exchanges(warps);
    std::vector<unsigned char> dynamic_shared(shared_bytes + 16);
    const auto work = [&](unsigned t) {
      threadIdx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
      blockDim = block;
      gridDim = grid;
      current.block_barrier = &block_barrier;
      current.warp_barrier = warp_barriers[t / 32].get();
      current.warp_exchange = &exchanges[t / 32];
      current.dynamic_shared = dynamic_shared.data();
      for (unsigned z = 0; z < grid.z; ++z) {
        for (unsigned y = 0; y < grid.y; ++y) {
          for (unsigned x = 0; x < grid.x; ++x) {
            blockIdx = dim3(x, y, z);
            body();
            block_barrier.arrive_and_wait();  // the block ends for every thread before the next starts
          }
        }
      }
    };
    {
      std::unique_lock<std::mutex> lock(mutex_);
      job_ = work;
      job_threads_ = threads;
      remaining_ = threads;
      ++generation_;
    }
    wake_.notify_all();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return remaining_ == 0; });
    job_ = nullptr;
  }

 private:
  thread_pool() {
    for (unsigned t = 0; t < max_threads; ++t) {
      workers_.emplace_back([this, t] { serve(t); });
    }
  }
  ~thread_pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      ++generation_;
    }
    wake_.notify_all();
    for (auto& worker : workers_) worker.join();
  }

  void serve(unsigned t) {
    std::uint64_t seen = 0;
    while (true) {
      std::function<void(unsigned)> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (stopping_) return;
        if (t >= job_threads_) continue;
        job = job_;
      }
      job(t);
      std::lock_guard<std::mutex> lock(mutex_);
      if (--remaining_ == 0) done_.notify_one();
    }
  }

  std::mutex launch_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::function<void(unsigned)> job_;
  unsigned job_threads_ = 0;
  unsigned remaining_ = 0;
  std::uint64_t generation_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

template <class Body>
void run(dim3 grid, dim3 block, std::size_t shared_bytes, Body&& body) {
  thread_pool::instance().run(grid, block, shared_bytes, body);
}

inline void* dynamic_shared_memory() { return current.dynamic_shared; }

// cp.async: the copy happens at once (16 or 4 bytes, or zeros when the source is outside).
inline void copy_async(void* destination, const void* source, int bytes, bool inside) {
  if (inside) {
    std::memcpy(destination, source, static_cast<std::size_t>(bytes));
  } else {
    std::memset(destination, 0, static_cast<std::size_t>(bytes));
  }
}

// mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32, D = A B + C, from the PTX ISA's fragment layout
// (groupID g = lane / 4, threadID_in_group t = lane % 4):
//   A 16x32: a0 = row g, k 4t..4t+3; a1 = row g+8, k 4t..; a2 = row g, k 16+4t..; a3 = row g+8, k 16+4t..
//   B 32x8:  b0 = k 4t..4t+3, column g; b1 = k 16+4t.., column g
//   C, D 16x8: c0/d0, c1/d1 = row g, columns 2t, 2t+1; c2/d2, c3/d3 = row g+8, the same columns.
// The bytes of a register are its four consecutive k, lowest byte first. The s32 additions wrap
// (no .satfinite); the callers stay far inside the range.
inline void mma_s8(int (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2], const int (&c)[4]) {
  auto& exchange = *static_cast<warp_fragments*>(current.warp_exchange);
  const unsigned lane = threadIdx.x % 32;
  for (int r = 0; r < 4; ++r) exchange.a[lane][r] = a[r];
  for (int r = 0; r < 2; ++r) exchange.b[lane][r] = b[r];
  for (int r = 0; r < 4; ++r) exchange.c[lane][r] = c[r];
  current.warp_barrier->arrive_and_wait();
  std::int8_t matrix_a[16][32];
  std::int8_t matrix_b[32][8];
  int matrix_c[16][8];
  for (unsigned l = 0; l < 32; ++l) {
    const unsigned g = l / 4, t = l % 4;
    for (unsigned j = 0; j < 4; ++j) {
      const auto byte = [](std::uint32_t word, unsigned index) {
        return static_cast<std::int8_t>(static_cast<std::uint8_t>(word >> (8 * index)));
      };
      matrix_a[g][4 * t + j] = byte(exchange.a[l][0], j);
      matrix_a[g + 8][4 * t + j] = byte(exchange.a[l][1], j);
      matrix_a[g][16 + 4 * t + j] = byte(exchange.a[l][2], j);
      matrix_a[g + 8][16 + 4 * t + j] = byte(exchange.a[l][3], j);
      matrix_b[4 * t + j][g] = byte(exchange.b[l][0], j);
      matrix_b[16 + 4 * t + j][g] = byte(exchange.b[l][1], j);
    }
    for (unsigned e = 0; e < 4; ++e) matrix_c[g + 8 * (e / 2)][2 * t + e % 2] = exchange.c[l][e];
  }
  current.warp_barrier->arrive_and_wait();  // everyone has read the exchange before it is reused
  const unsigned g = lane / 4, t = lane % 4;
  for (int e = 0; e < 4; ++e) {
    const unsigned row = g + 8 * (e / 2);
    const unsigned column = 2 * t + e % 2;
    std::uint32_t sum = static_cast<std::uint32_t>(matrix_c[row][column]);
    for (int k = 0; k < 32; ++k) {
      sum += static_cast<std::uint32_t>(static_cast<int>(matrix_a[row][k]) * static_cast<int>(matrix_b[k][column]));
    }
    d[e] = static_cast<int>(sum);
  }
}

inline void mma_s8(int (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
  const int zero[4] = {0, 0, 0, 0};
  mma_s8(d, a, b, zero);
}

// mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64, D = A B + C, from the PTX ISA's fragment
// layout (g = lane / 4, t = lane % 4): A 16x8: a[v] = row g + 8 (v % 2), k t + 4 (v / 2); B 8x8:
// b[v] = k t + 4 v, column g; C, D 16x8: c[v] = row g + 8 (v / 2), column 2t + v % 2. Each entry
// is the fused sum in ascending k; the kernels only give it inputs whose every partial sum is a
// double, where every order gives the same value.
inline void mma_f64(double (&d)[4], const double (&a)[4], const double (&b)[2], const double (&c)[4]) {
  auto& exchange = *static_cast<warp_fragments*>(current.warp_exchange);
  const unsigned lane = threadIdx.x % 32;
  for (unsigned v = 0; v < 4; ++v) {
    exchange.fa[lane][v] = a[v];
    exchange.fc[lane][v] = c[v];
  }
  exchange.fb[lane][0] = b[0];
  exchange.fb[lane][1] = b[1];
  current.warp_barrier->arrive_and_wait();
  double matrix_a[16][8];
  double matrix_b[8][8];
  double matrix_c[16][8];
  for (unsigned l = 0; l < 32; ++l) {
    const unsigned g = l / 4, t = l % 4;
    for (unsigned v = 0; v < 4; ++v) {
      matrix_a[g + 8 * (v % 2)][t + 4 * (v / 2)] = exchange.fa[l][v];
      matrix_c[g + 8 * (v / 2)][2 * t + v % 2] = exchange.fc[l][v];
    }
    for (unsigned v = 0; v < 2; ++v) matrix_b[t + 4 * v][g] = exchange.fb[l][v];
  }
  current.warp_barrier->arrive_and_wait();  // everyone has read the exchange before it is reused
  const unsigned g = lane / 4, t = lane % 4;
  for (unsigned v = 0; v < 4; ++v) {
    const unsigned row = g + 8 * (v / 2);
    const unsigned column = 2 * t + v % 2;
    double sum = matrix_c[row][column];
    for (unsigned k = 0; k < 8; ++k) sum = std::fma(matrix_a[row][k], matrix_b[k][column], sum);
    d[v] = sum;
  }
}

// wgmma.mma_async.sync.aligned.m64nNk32.s32.s8.s8 with both operands in shared memory, K-major in
// the 128-byte swizzle, from the PTX ISA: a descriptor holds the start address (bits 0-13, in
// 16-byte units), the stride byte offset between groups of eight rows (bits 32-45, the same
// units) and the swizzle mode (bits 62-63, 1 for 128 bytes; the others are not emulated and
// abort). Row r, byte k (k < 32) of a tile is at the address x = start + (r / 8) stride +
// 128 (r % 8) + k with bits 4-6 exclusive-ored with bits 7-9 of x (the swizzle acts on addresses,
// here offsets into the block's dynamic shared memory). The thread's registers (thread t of the
// warpgroup: warp w = t / 32, g = (t % 32) / 4, q = t % 4): d[4 j + 2 r + e] is the entry of row
// 16 w + g + 8 r and column 8 j + 2 q + e, for j < N / 8. Accumulate false is scale-d 0. Every
// thread computes its own registers from shared memory, so no exchange is needed; the additions
// wrap as the hardware's.
inline void wgmma_s8(int* d, int n, std::uint64_t a_descriptor, std::uint64_t b_descriptor, bool accumulate) {
  const auto element = [](std::uint64_t descriptor, unsigned row, unsigned k) -> int {
    if ((descriptor >> 62) != 1) std::abort();
    const std::uint64_t start = (descriptor & 0x3FFFU) << 4;
    const std::uint64_t stride = ((descriptor >> 32) & 0x3FFFU) << 4;
    const std::uint64_t logical = start + (row / 8) * stride + 128 * (row % 8) + k;
    const std::uint64_t physical = logical ^ (((logical >> 7) & 7U) << 4);
    return static_cast<std::int8_t>(current.dynamic_shared[physical]);
  };
  const unsigned t = threadIdx.x % 128;
  const unsigned w = t / 32, g = (t % 32) / 4, q = t % 4;
  for (unsigned j = 0; j < static_cast<unsigned>(n) / 8; ++j) {
    for (unsigned r = 0; r < 2; ++r) {
      for (unsigned e = 0; e < 2; ++e) {
        const unsigned i = 4 * j + 2 * r + e;
        const unsigned row = 16 * w + g + 8 * r;
        const unsigned column = 8 * j + 2 * q + e;
        std::uint32_t sum = accumulate ? static_cast<std::uint32_t>(d[i]) : 0U;
        for (unsigned k = 0; k < 32; ++k) {
          sum += static_cast<std::uint32_t>(element(a_descriptor, row, k) * element(b_descriptor, column, k));
        }
        d[i] = static_cast<int>(sum);
      }
    }
  }
}

// mbarrier objects in shared memory (init, arrive, arrive.expect_tx, try_wait.parity) and the bulk
// copy that completes on one (cp.async.bulk ... mbarrier::complete_tx::bytes), from the PTX ISA.
// The 64-bit object holds the pending arrivals (bits 0-19), the expected count (20-39), the
// pending transaction bytes (40-61) and the phase's parity (63); a phase completes when no
// arrival and no byte is pending, and the next begins with the expected count. The copy happens at
// once and then completes its bytes.
inline void barrier_update(std::uint64_t* barrier, unsigned arrivals, unsigned added_bytes, unsigned done_bytes) {
  std::atomic_ref<std::uint64_t> word(*barrier);
  std::uint64_t seen = word.load();
  while (true) {
    std::uint64_t pending = seen & 0xFFFFFU;
    const std::uint64_t expected = (seen >> 20) & 0xFFFFFU;
    std::uint64_t bytes = (seen >> 40) & 0x3FFFFFU;
    std::uint64_t phase = seen >> 63;
    if (pending < arrivals || bytes + added_bytes < done_bytes) std::abort();  // more than the phase expects
    pending -= arrivals;
    bytes = bytes + added_bytes - done_bytes;
    if (pending == 0 && bytes == 0) {
      pending = expected;
      phase ^= 1U;
    }
    const std::uint64_t next = pending | (expected << 20) | (bytes << 40) | (phase << 63);
    if (word.compare_exchange_weak(seen, next)) return;
  }
}
inline void barrier_init(std::uint64_t* barrier, unsigned count) {
  std::atomic_ref<std::uint64_t>(*barrier).store(static_cast<std::uint64_t>(count) |
                                                 (static_cast<std::uint64_t>(count) << 20));
}
inline void barrier_arrive(std::uint64_t* barrier) { barrier_update(barrier, 1, 0, 0); }
inline void barrier_expect_bytes(std::uint64_t* barrier, unsigned bytes) { barrier_update(barrier, 1, bytes, 0); }
// Returns once the phase of the given parity (0 for the first) has completed.
inline void barrier_wait(std::uint64_t* barrier, unsigned parity) {
  while ((std::atomic_ref<std::uint64_t>(*barrier).load() >> 63) == parity) std::this_thread::yield();
}
inline void bulk_copy(void* shared_destination, const void* global_source, unsigned bytes, std::uint64_t* barrier) {
  std::memcpy(shared_destination, global_source, bytes);
  barrier_update(barrier, 0, 0, bytes);
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16 (no .trans), from the PTX ISA: four 8x8 matrices of
// 16-bit elements, each row 16 contiguous bytes at a 16-byte-aligned shared address; lanes 8i ..
// 8i+7 give the addresses of rows 0..7 of matrix i. Register i of lane l receives the 32-bit word
// of matrix i at row l / 4, bytes 4 (l % 4) .. 4 (l % 4) + 3 (the element pair 2 (l % 4), +1).
inline void load_matrix_x4(std::uint32_t (&r)[4], const void* row_address) {
  auto& exchange = *static_cast<warp_fragments*>(current.warp_exchange);
  const unsigned lane = threadIdx.x % 32;
  if (reinterpret_cast<std::uintptr_t>(row_address) % 16 != 0) std::abort();  // the ISA's alignment rule
  exchange.rows[lane] = row_address;
  current.warp_barrier->arrive_and_wait();
  for (unsigned i = 0; i < 4; ++i) {
    const auto* row = static_cast<const unsigned char*>(exchange.rows[8 * i + lane / 4]);
    std::memcpy(&r[i], row + 4 * (lane % 4), 4);
  }
  current.warp_barrier->arrive_and_wait();
}

}  // namespace mxscope::gpu::simulation
