// What every translation unit of the GPU backend shares (src/gpu/*.cu; docs/architecture.md): the
// headers, the tensor-core and shared-memory macros, launch geometry, canonical NaNs, the integer
// multiply-add and reduction helpers, and the declarations of the functions one unit defines for
// the others (the device memory pool, device properties).
//
// The GPU backend (include/mxscope/gpu.hpp): one source for CUDA (nvcc) and HIP (clang -x hip).
//
// Bit-exactness rests on three habits, each argued next to the code that relies on it:
// 1. every per-element decision is a call of the shared core functions (shared_exponent,
//    quantize_element, dequantize_element, random_stream, rotate_segment, add_to_float,
//    add_exactly_to_float, long_accumulator); the one re-derivation, the fused quantizer's
//    integer element encoder (fast_encode.hpp), is proven equal to the core's and tested against it;
// 2. where the CPU fixes an order (Hadamard stages, ascending K-blocks per accumulator, the
//    canonical chunked reduction of compare.hpp), one thread follows that order; parallelism only
//    splits independent work (entries, blocks, chunks, butterfly pairs of one stage);
// 3. the build never contracts a multiply and an add into an FMA (nvcc --fmad=false, clang
//    -ffp-contract=off), and fp32 arithmetic keeps subnormals (no flush to zero).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "fast_encode.hpp"
#include "mxscope/compare.hpp"
#include "mxscope/core/accumulate.hpp"
#include "mxscope/core/cross_step.hpp"
#include "mxscope/core/exact_sum.hpp"
#include "mxscope/core/hadamard.hpp"
#include "mxscope/core/mx.hpp"
#include "mxscope/core/nvfp4.hpp"
#include "mxscope/core/operand.hpp"
#include "mxscope/core/philox.hpp"
#include "mxscope/core/tensor_scale.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/gpu.hpp"
#include "native_gfx950.hpp"
#include "runtime.hpp"

#if defined(__HIP__)
#include "hip_shims.hpp"  // the device-library functions the HIP headers call (-nogpulib builds)
#endif

// The tensor-core path: CUDA's mma.sync (sm_80+), and its emulation in the CPU simulation.
#if (defined(__CUDACC__) && !defined(__HIP__)) || defined(MXSCOPE_GPU_SIMULATE)
#define MXSCOPE_CUDA_TENSOR_CORES 1
#endif

// Dynamic shared memory (the size is a launch parameter).
#if defined(MXSCOPE_GPU_SIMULATE)
#define MXSCOPE_DYNAMIC_SHARED(type, name) type* name = static_cast<type*>(runtime::simulation_shared_memory())
#else
#define MXSCOPE_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

namespace mxscope::gpu {

namespace core_ns = mxscope::core;
using core_ns::element_kind;

namespace {

constexpr int threads_per_block = 256;

inline unsigned grid_for(std::int64_t work, int threads = threads_per_block) {
  const std::int64_t blocks = (work + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<std::int64_t>(blocks, 1, std::int64_t{1} << 20));
}

// The grid of a kernel whose threads each reduce many elements and end with an atomic: about two
// waves of threads_per_block-thread blocks on a large GPU, so that a large tensor does not make
// one atomic per element on the same address (which the hardware serializes).
inline unsigned reduction_grid(std::int64_t work) { return std::min(grid_for(work), 1024U); }

// Grid-stride loop over [0, count).
#define MXSCOPE_GRID_LOOP(index, count)                                                                        \
  for (std::int64_t index = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; index < (count); \
       index += static_cast<std::int64_t>(gridDim.x) * blockDim.x)

// The grid of a grid-stride kernel that does little per element: one thread per 16 elements, since
// thread blocks that each do little cost more to start than to run (BENCHMARKS.md has the figures).
inline unsigned strided_grid(std::int64_t count) { return grid_for((count + 15) / 16); }

// The fix-up kernels' scan of a flag byte per entry: 16 flags per thread and step, read as one
// 16-byte word where the flags are 16-byte aligned (device buffers are), and body(entry) for each
// set flag in ascending order, over flag_scan_grid(count).
inline unsigned flag_scan_grid(std::int64_t count) { return strided_grid(count); }

template <class Body>
__device__ inline void for_each_flagged(const std::uint8_t* flagged, std::int64_t count, Body&& body) {
  const bool aligned = reinterpret_cast<std::uintptr_t>(flagged) % 16 == 0;
  MXSCOPE_GRID_LOOP(word, (count + 15) / 16) {
    const std::int64_t first = word * 16;
    if (aligned && first + 16 <= count) {
      const uint4 bits = reinterpret_cast<const uint4*>(flagged)[word];
      if ((bits.x | bits.y | bits.z | bits.w) == 0U) continue;
    }
    for (std::int64_t entry = first; entry < first + 16 && entry < count; ++entry) {
      if (flagged[entry] != 0) body(entry);
    }
  }
}

// The NaN bit patterns every output uses (the CPU's std::numeric_limits<>::quiet_NaN()).
constexpr std::uint32_t float_nan_bits = 0x7FC00000U;
constexpr std::uint64_t double_nan_bits = 0x7FF8000000000000ULL;

__device__ inline float canonical_nan_float() { return core_ns::bits_float(float_nan_bits); }
__device__ inline double canonical_nan_double() { return core_ns::bits_double(double_nan_bits); }
__device__ inline float canonical(float value) { return value != value ? canonical_nan_float() : value; }
__device__ inline double canonical(double value) { return value != value ? canonical_nan_double() : value; }
__device__ inline bool is_finite(float value) { return (core_ns::float_bits(value) & 0x7f800000U) != 0x7f800000U; }

// Integer multiply-adds, a * b + c (low or high 32 bits of the product), kept as such on CUDA: the
// sr encoder spends them where it would otherwise shift or mask, because on sm_90 an IMAD runs on
// the fp32 multiply-add pipe, which that loop leaves mostly idle, while shifts, masks and compares
// share the integer pipe with Philox's xors.
__device__ inline std::uint32_t multiply_add_low(std::uint32_t a, std::uint32_t b, std::uint32_t c) {
#if defined(__CUDA_ARCH__) && !defined(__HIP__)
  std::uint32_t out = 0;
  asm("mad.lo.u32 %0, %1, %2, %3;" : "=r"(out) : "r"(a), "r"(b), "r"(c));
  return out;
#else
  return a * b + c;
#endif
}

__device__ inline std::uint32_t multiply_add_high(std::uint32_t a, std::uint32_t b, std::uint32_t c) {
#if defined(__CUDA_ARCH__) && !defined(__HIP__)
  std::uint32_t out = 0;
  asm("mad.hi.u32 %0, %1, %2, %3;" : "=r"(out) : "r"(a), "r"(b), "r"(c));
  return out;
#else
  return static_cast<std::uint32_t>((static_cast<std::uint64_t>(a) * b) >> 32) + c;
#endif
}

// count + (magnitude > limit): a compare and a predicated add on CUDA (nvcc made it three
// instructions, an add, a predicated move and the compare).
__device__ inline void count_above(unsigned& count, float magnitude, float limit) {
#if defined(__CUDA_ARCH__) && !defined(__HIP__)
  asm("{\n .reg .pred p;\n setp.gt.f32 p, %1, %2;\n @p add.u32 %0, %0, 1;\n}" : "+r"(count) : "f"(magnitude), "f"(limit));
#else
  count += magnitude > limit ? 1U : 0U;
#endif
}

// The larger of a and b, NaN if either is NaN (one instruction on sm_80 and later).
__device__ inline float max_or_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(__HIP__)
  float out;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(out) : "f"(a), "f"(b));
  return out;
#else
  return a != a || b != b ? canonical_nan_float() : (a > b ? a : b);
#endif
}
__device__ inline bool is_finite(double value) {
  return (core_ns::double_bits(value) & 0x7ff0000000000000ULL) != 0x7ff0000000000000ULL;
}

__device__ inline float load_input(const float* input, std::int64_t index) { return input[index]; }
__device__ inline float load_input(const std::uint16_t* input, std::int64_t index) {
  return core_ns::bf16_to_float(input[index]);  // exact widening
}

// values[c] summed (Max: maximized) over the thread block (threads_per_block threads, all of
// which call it); the result is in thread 0's values, which adds it to targets[index[c]] with one
// atomic each.
template <bool Max, int N>
__device__ inline void block_reduce_to(unsigned long long (&values)[N], unsigned long long* targets,
                                       const int (&index)[N]) {
  __shared__ unsigned long long partial[N][threads_per_block];
  const int t = static_cast<int>(threadIdx.x);
#pragma unroll
  for (int c = 0; c < N; ++c) partial[c][t] = values[c];
  __syncthreads();
  for (int width = threads_per_block / 2; width > 0; width /= 2) {
    if (t < width) {
#pragma unroll
      for (int c = 0; c < N; ++c) {
        const unsigned long long other = partial[c][t + width];
        partial[c][t] = Max ? (other > partial[c][t] ? other : partial[c][t]) : partial[c][t] + other;
      }
    }
    __syncthreads();
  }
  if (t != 0) return;
#pragma unroll
  for (int c = 0; c < N; ++c) {
    if (partial[c][0] == 0) continue;
    if constexpr (Max) {
      atomicMax(&targets[index[c]], partial[c][0]);
    } else {
      atomicAdd(&targets[index[c]], partial[c][0]);
    }
  }
}

// The quantizers' counters (flushed, saturated, nonzero, non-finite) of every thread of the block,
// added to global[0..3] with one atomic each. (Each thread adding its own to one shared slot was
// serialized: 1024 shared atomics per block, a large share of a quantizer's time with counters.)
// Integer sums do not depend on the order.
__device__ inline void add_counters(unsigned long long* global, const unsigned long long (&local)[mx_counter_count]) {
  unsigned long long values[mx_counter_count];
#pragma unroll
  for (int c = 0; c < mx_counter_count; ++c) values[c] = local[c];
  constexpr int slots[mx_counter_count] = {0, 1, 2, 3};
  block_reduce_to<false>(values, global, slots);
}

inline std::string to_text(std::int64_t value) { return std::to_string(value); }

// Canonical chunk sums (compare.hpp: each chunk's terms added in index order to a partial that
// starts at +0) by the ordered_sum_lanes threads of a block, on consecutive elements. Work item w
// of `items` is the elements first, ..., first + length - 1 of `item(w)` = {first, length}. Per
// round, lane l computes the terms of elements base + 32 d + l, d < Depth (`terms(i, t)` fills
// t[0..Sums); consecutive lanes, consecutive elements: coalesced loads, Depth of them in flight
// per lane), they pass through shared memory, and lane k < Sums adds term k of the round's
// 32 Depth elements in index order: the additions of one thread walking the item, in the same
// order, hence the same partials. partials[k * items + w] receives sum k of item w. Launch with
// ordered_sum_lanes threads per block.
constexpr int ordered_sum_lanes = 32;

struct element_range {
  std::int64_t first;
  std::int64_t length;
};

template <int Sums, int Depth = 1, class Item, class Terms>
__device__ inline void ordered_chunk_sums(std::int64_t items, const Item& item, const Terms& terms, double* partials) {
  constexpr int round = ordered_sum_lanes * Depth;
  __shared__ double shared_terms[round][Sums + 1];
  const int lane = static_cast<int>(threadIdx.x);
  for (std::int64_t w = blockIdx.x; w < items; w += gridDim.x) {
    const element_range range = item(w);
    double partial = 0.0;  // lane k < Sums: sum k
    for (std::int64_t base = 0; base < range.length; base += round) {
      double t[Depth][Sums] = {};  // +0 where an element is past the end
#pragma unroll
      for (int d = 0; d < Depth; ++d) {
        const std::int64_t at = base + ordered_sum_lanes * d + lane;
        if (at < range.length) terms(range.first + at, t[d]);
      }
#pragma unroll
      for (int d = 0; d < Depth; ++d) {
#pragma unroll
        for (int k = 0; k < Sums; ++k) shared_terms[ordered_sum_lanes * d + lane][k] = t[d][k];
      }
      __syncthreads();
      // All `round` terms, those past the end +0 too: adding +0 changes no partial (one that
      // starts at +0 is never -0 under round to nearest), and a fixed count lets the loop unroll,
      // its shared loads issued ahead of the chain of additions.
      if (lane < Sums) {
#pragma unroll
        for (int l = 0; l < round; ++l) partial = partial + shared_terms[l][lane];
      }
      __syncthreads();
    }
    if (lane < Sums) partials[lane * items + w] = partial;
  }
}

// The canonical chunks of [0, count): chunk w is [4096 w, min(4096 (w + 1), count)).
struct canonical_chunks {
  std::int64_t count;
  __device__ element_range operator()(std::int64_t w) const {
    const std::int64_t first = w * canonical_chunk;
    return {first, count - first < canonical_chunk ? count - first : canonical_chunk};
  }
};

// The canonical tree sum (compare.hpp) of values[offset, offset + count): how the chunk partials of
// the comparison and of the operand energies are combined.
inline double tree_of(std::vector<double>& values, std::size_t offset, std::size_t count) {
  return canonical_tree(std::span<double>(values.data() + offset, count));
}

template <class T>
inline device_buffer upload_vector(const std::vector<T>& values) {
  device_buffer buffer(values.size() * sizeof(T));
  buffer.upload(values.data(), buffer.bytes());
  return buffer;
}

// An operand's codes or scales: read where they are in device memory, else uploaded.
inline device_buffer_ptr resident_or_uploaded(const device_buffer_ptr& resident, const std::vector<std::uint8_t>& host) {
  return resident ? resident : std::make_shared<const device_buffer>(upload_vector(host));
}

}  // namespace

// ---- Defined in memory.cu, used by the other units.

// The current device's properties, or nothing where no device answers (the error cleared): for
// the feature checks that report absence instead of throwing.
std::optional<runtime::device_properties> current_device_properties();
// Multiprocessors of the current device, queried once per device.
int multiprocessor_count();
// Called where temporary buffers must outlive the kernels just queued: waits for the device unless
// the buffers are freed in stream order (stream_scope), which already orders the free after them.
void release_after_kernels();
// Frees the device buffers kept for reuse (memory.cu): where a cross-step state would not fit
// beside them, and before an allocation is retried.
void release_kept_buffers();
// A large host-to-device copy through pinned slots (upload.cu), ordered after the calling thread's
// stream and complete on return; false, with nothing copied, where it does not apply (small, HIP,
// the simulation, no pinned memory): the caller then copies plainly.
bool staged_upload(void* device, const void* host, std::size_t bytes);

// A set-up buffer (a kernel's staging, the rows' descriptions): a device buffer like any other,
// kept for reuse by memory.cu's cache when it is given back, so that a kernel called once a stage
// does not allocate its staging from the driver each time.
using scratch_buffer = device_buffer;

}  // namespace mxscope::gpu
