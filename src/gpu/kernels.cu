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
#include <algorithm>
#include <array>
#include <atomic>
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

unsigned grid_for(std::int64_t work, int threads = threads_per_block) {
  const std::int64_t blocks = (work + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<std::int64_t>(blocks, 1, std::int64_t{1} << 20));
}

// The grid of a kernel whose threads each reduce many elements and end with an atomic: about two
// waves of threads_per_block-thread blocks on a large GPU, so that a large tensor does not make
// one atomic per element on the same address (which the hardware serializes).
unsigned reduction_grid(std::int64_t work) { return std::min(grid_for(work), 1024U); }

// Grid-stride loop over [0, count).
#define MXSCOPE_GRID_LOOP(index, count)                                                                        \
  for (std::int64_t index = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; index < (count); \
       index += static_cast<std::int64_t>(gridDim.x) * blockDim.x)

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

std::string to_text(std::int64_t value) { return std::to_string(value); }

}  // namespace

// ================================================================================================
// Devices and memory.

int device_count() {
  int count = 0;
  if (runtime::device_count(&count) != runtime::success) {
    (void)runtime::last_error();  // clear the sticky "no device" error
    return 0;
  }
  return count;
}

void select_device(int index) {
  const int count = device_count();
  if (index < 0 || index >= count) {
    throw gpu_error("gpu: device " + std::to_string(index) + " does not exist (this machine has " +
                    std::to_string(count) + ")");
  }
  MXSCOPE_GPU_CHECK(runtime::set_device(index));
}

device_description describe_device() {
  int device = 0;
  MXSCOPE_GPU_CHECK(runtime::get_device(&device));
  runtime::device_properties properties{};
  MXSCOPE_GPU_CHECK(runtime::properties(&properties, device));
  device_description out;
  out.name = properties.name;
  out.major = properties.major;
  out.minor = properties.minor;
  out.multiprocessors = properties.multiProcessorCount;
  out.global_memory_bytes = properties.totalGlobalMem;
  return out;
}

namespace {

// The current device's properties, or nothing where no device answers (the error cleared): for
// the feature checks that report absence instead of throwing.
[[maybe_unused]] std::optional<runtime::device_properties> current_device_properties() {
  int device = 0;
  runtime::device_properties properties{};
  if (runtime::get_device(&device) != runtime::success ||
      runtime::properties(&properties, device) != runtime::success) {
    (void)runtime::last_error();
    return std::nullopt;
  }
  return properties;
}

// Set-up buffers kept between calls. The exact reference's staging (its operands in chunk tiles,
// 0.6 GB at the benchmark's shape, and the rows' descriptions) was allocated and freed on every
// call: the benchmark's reference took 30.7 to 30.9 ms with this pool against 30.9 to 31.6 without
// (H200, alternating runs). A scratch_buffer takes the smallest pooled buffer of
// the current device that is large enough, else allocates one, and gives it back to the pool when
// it goes out of scope; the pool keeps the last scratch_pool_entries buffers given back, and only
// while they total at most 1/8 of the device's memory. Reuse is safe without waiting: every kernel
// runs on the default stream, so work queued on a buffer before it went back runs before work
// queued after it was taken again. The pool is emptied before a cross-step state measures the free
// memory (require_cross_step_room) and when an allocation fails (device_buffer's constructor), so
// what it holds never makes a stage run out of memory.
constexpr std::size_t scratch_pool_entries = 8;

struct scratch_pool {
  struct entry {
    int device;
    device_buffer buffer;
  };
  std::mutex mutex;
  std::vector<entry> entries;  // oldest first
};

scratch_pool& the_scratch_pool() {
  static scratch_pool* pool = new scratch_pool;  // never destroyed: no cudaFree after the runtime's teardown
  return *pool;
}

void release_scratch_pool() {
  std::vector<scratch_pool::entry> released;
  {
    scratch_pool& pool = the_scratch_pool();
    const std::lock_guard<std::mutex> lock(pool.mutex);
    released.swap(pool.entries);
  }
  // freed here, outside the lock
}

class scratch_buffer {
 public:
  explicit scratch_buffer(std::size_t bytes) {
    MXSCOPE_GPU_CHECK(runtime::get_device(&device_));
    if (bytes == 0) return;
    {
      scratch_pool& pool = the_scratch_pool();
      const std::lock_guard<std::mutex> lock(pool.mutex);
      auto best = pool.entries.end();
      for (auto it = pool.entries.begin(); it != pool.entries.end(); ++it) {
        if (it->device == device_ && it->buffer.bytes() >= bytes &&
            (best == pool.entries.end() || it->buffer.bytes() < best->buffer.bytes())) {
          best = it;
        }
      }
      if (best != pool.entries.end()) {
        buffer_ = std::move(best->buffer);
        pool.entries.erase(best);
        return;
      }
    }
    buffer_ = device_buffer(bytes);
  }
  ~scratch_buffer() {
    if (buffer_.get() == nullptr) return;
    std::size_t free_bytes = 0, total_bytes = 0;
    if (runtime::memory_info(&free_bytes, &total_bytes) != runtime::success) {
      (void)runtime::last_error();
      return;  // freed with buffer_
    }
    std::vector<scratch_pool::entry> dropped;
    scratch_pool& pool = the_scratch_pool();
    const std::lock_guard<std::mutex> lock(pool.mutex);
    pool.entries.push_back({device_, std::move(buffer_)});
    std::size_t kept = 0;
    for (const scratch_pool::entry& e : pool.entries) kept += e.buffer.bytes();
    while (!pool.entries.empty() && (pool.entries.size() > scratch_pool_entries || kept > total_bytes / 8)) {
      kept -= pool.entries.front().buffer.bytes();
      dropped.push_back(std::move(pool.entries.front()));
      pool.entries.erase(pool.entries.begin());
    }
  }
  scratch_buffer(scratch_buffer&&) noexcept = default;
  scratch_buffer& operator=(scratch_buffer&&) = delete;
  scratch_buffer(const scratch_buffer&) = delete;
  scratch_buffer& operator=(const scratch_buffer&) = delete;

  template <class T>
  T* as() const {
    return buffer_.as<T>();
  }
  void fill_bytes(int value) { buffer_.fill_bytes(value); }
  void download(void* host, std::size_t bytes) const { buffer_.download(host, bytes); }

 private:
  int device_ = 0;
  device_buffer buffer_;
};

// Multiprocessors of the current device, queried once per device.
int multiprocessor_count() {
  static std::mutex mutex;
  static std::vector<int> counts;
  int device = 0;
  MXSCOPE_GPU_CHECK(runtime::get_device(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  const auto index = static_cast<std::size_t>(device);
  if (counts.size() <= index) counts.resize(index + 1, 0);
  if (counts[index] == 0) {
    runtime::device_properties properties{};
    MXSCOPE_GPU_CHECK(runtime::properties(&properties, device));
    counts[index] = std::max(properties.multiProcessorCount, 1);
  }
  return counts[index];
}

}  // namespace

device_buffer::device_buffer(std::size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  if (runtime::stream_ordered) {
    ordered_ = true;
    stream_ = runtime::current_stream;
    MXSCOPE_GPU_CHECK(runtime::malloc_ordered(&data_, bytes));
    return;
  }
  if (runtime::malloc(&data_, bytes) != runtime::success) {
    // Out of memory, perhaps because of what the scratch pool keeps: once more without it.
    (void)runtime::last_error();
    data_ = nullptr;
    release_scratch_pool();
    MXSCOPE_GPU_CHECK(runtime::malloc(&data_, bytes));
  }
}

void device_buffer::free_memory() noexcept {
  if (data_ == nullptr) return;
  (void)(ordered_ ? runtime::free_ordered(data_, stream_) : runtime::free(data_));
  data_ = nullptr;
}

device_buffer::~device_buffer() { free_memory(); }

device_buffer::device_buffer(device_buffer&& other) noexcept
    : data_(other.data_), bytes_(other.bytes_), ordered_(other.ordered_), stream_(other.stream_) {
  other.data_ = nullptr;
  other.bytes_ = 0;
}

device_buffer& device_buffer::operator=(device_buffer&& other) noexcept {
  if (this != &other) {
    free_memory();
    data_ = other.data_;
    bytes_ = other.bytes_;
    ordered_ = other.ordered_;
    stream_ = other.stream_;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

stream_scope::stream_scope(void* stream, bool stream_ordered)
    : previous_stream_(runtime::current_stream), previous_ordered_(runtime::stream_ordered) {
  runtime::current_stream = stream;
  runtime::stream_ordered = stream_ordered;
}

stream_scope::~stream_scope() {
  runtime::current_stream = previous_stream_;
  runtime::stream_ordered = previous_ordered_;
}

void device_buffer::upload(const void* host, std::size_t bytes, std::size_t offset) {
  if (offset + bytes > bytes_) throw gpu_error("device_buffer::upload: " + std::to_string(bytes) + " bytes do not fit");
  if (bytes > 0) MXSCOPE_GPU_CHECK(runtime::copy_to_device(static_cast<char*>(data_) + offset, host, bytes));
}

void device_buffer::download(void* host, std::size_t bytes, std::size_t offset) const {
  if (offset + bytes > bytes_)
    throw gpu_error("device_buffer::download: " + std::to_string(bytes) + " bytes do not fit");
  if (bytes > 0) MXSCOPE_GPU_CHECK(runtime::copy_to_host(host, static_cast<const char*>(data_) + offset, bytes));
}

void device_buffer::fill_bytes(int value) {
  if (bytes_ > 0) MXSCOPE_GPU_CHECK(runtime::memset(data_, value, bytes_));
}

device_matrix::device_matrix(std::int64_t rows, std::int64_t cols, element kind)
    : buffer_(static_cast<std::size_t>(rows * cols) * (kind == element::fp32 ? sizeof(float) : sizeof(double))),
      rows_(rows),
      cols_(cols),
      kind_(kind) {}

device_matrix device_matrix::upload(const matrix& values) {
  device_matrix out(values.rows, values.cols, element::fp32);
  out.buffer_.upload(values.data(), out.buffer_.bytes());
  return out;
}

device_matrix device_matrix::upload(const matrix64& values) {
  device_matrix out(values.rows, values.cols, element::fp64);
  out.buffer_.upload(values.data(), out.buffer_.bytes());
  return out;
}

float* device_matrix::fp32() const {
  if (kind_ != element::fp32) throw std::logic_error("device_matrix: an fp64 matrix read as fp32");
  return buffer_.as<float>();
}

double* device_matrix::fp64() const {
  if (kind_ != element::fp64) throw std::logic_error("device_matrix: an fp32 matrix read as fp64");
  return buffer_.as<double>();
}

matrix device_matrix::download32() const {
  matrix out(rows_, cols_);
  buffer_.download(out.data(), static_cast<std::size_t>(size()) * sizeof(float));
  return out;
}

matrix64 device_matrix::download64() const {
  matrix64 out(rows_, cols_);
  buffer_.download(out.data(), static_cast<std::size_t>(size()) * sizeof(double));
  return out;
}

void synchronize() {
  MXSCOPE_GPU_CHECK(runtime::synchronize());
  MXSCOPE_GPU_CHECK(runtime::last_error());
}

namespace {

// Called where temporary buffers must outlive the kernels just queued: waits for the device unless
// the buffers are freed in stream order (stream_scope), which already orders the free after them.
void release_after_kernels() {
  if (!(runtime::has_ordered_allocation && runtime::stream_ordered)) synchronize();
}

}  // namespace

void copy_on_device(void* destination, const void* source, std::size_t bytes) {
  if (bytes > 0) MXSCOPE_GPU_CHECK(runtime::copy_on_device_async(destination, source, bytes));
}

device_timer::device_timer() {
  runtime::event_t start{}, stop{};
  MXSCOPE_GPU_CHECK(runtime::event_create(&start));
  MXSCOPE_GPU_CHECK(runtime::event_create(&stop));
  start_ = static_cast<void*>(start);
  stop_ = static_cast<void*>(stop);
}

device_timer::~device_timer() {
  (void)runtime::event_destroy(static_cast<runtime::event_t>(start_));
  (void)runtime::event_destroy(static_cast<runtime::event_t>(stop_));
}

void device_timer::start() { MXSCOPE_GPU_CHECK(runtime::event_record(static_cast<runtime::event_t>(start_))); }
void device_timer::stop() { MXSCOPE_GPU_CHECK(runtime::event_record(static_cast<runtime::event_t>(stop_))); }

double device_timer::elapsed_ms() {
  MXSCOPE_GPU_CHECK(runtime::event_synchronize(static_cast<runtime::event_t>(stop_)));
  float milliseconds = 0.0f;
  MXSCOPE_GPU_CHECK(runtime::event_elapsed_ms(&milliseconds, static_cast<runtime::event_t>(start_),
                                              static_cast<runtime::event_t>(stop_)));
  return milliseconds;
}

// ================================================================================================
// Plans.

rotation_plan make_rotation_plan(const rotation_options& options) {
  rotation_plan plan;
  plan.size = options.size;
  plan.random_signs = options.signs != sign_policy::none;
  plan.signs =
      core_ns::random_stream{options.seed,
                             core_ns::policy_step(options.signs == sign_policy::fixed ? core_ns::seed_policy::fixed
                                                                                      : core_ns::seed_policy::per_step,
                                                  options.step),
                             core_ns::stream_tag(options.layer_hash, core_ns::random_role::signs)};
  return plan;
}

void check_rotation(const rotation_plan& rotation, std::int64_t rows, std::int64_t cols, int axis,
                    const std::string& what) {
  if (rotation.size == 0) return;
  if (axis != 0 && axis != 1) throw input_error(what + ": rotation axis must be 0 or 1, got " + to_text(axis));
  if (!core_ns::is_valid_rotation_size(rotation.size)) {
    throw input_error(what + ": field 'rotation': size " + to_text(rotation.size) + " is not a power of two in [" +
                      to_text(core_ns::rotation_size_min) + ", " + to_text(core_ns::rotation_size_max) + "]");
  }
  const std::int64_t length = axis == 1 ? cols : rows;
  if (length % rotation.size != 0) {
    throw input_error(what + ": field 'rotation': size " + to_text(rotation.size) + " does not divide the length " +
                      to_text(length) + " of axis " + to_text(axis));
  }
}

mx_plan make_mx_plan(const quantize_options& options, const std::string& what) {
  if (options.format.scheme != quant_scheme::mx) {
    throw input_error(what + ": field 'format': the GPU backend quantizes MX formats only");
  }
  const element_kind kind = options.format.element;
  if (kind == element_kind::e8m0 || kind == element_kind::ue4m3) {
    throw input_error(what + ": field 'format': not an MX element format");
  }
  if (options.axis != 0 && options.axis != 1) {
    throw input_error(what + ": field 'axis' must be 0 or 1, got " + to_text(options.axis));
  }
  if (options.block < 0 || options.block > (1 << 20)) {
    throw input_error(what + ": field 'block' must be in 1.." + to_text(1 << 20) + ", got " + to_text(options.block));
  }
  if (options.sr_bits < 1 || options.sr_bits > 32) {
    throw input_error(what + ": field 'sr_bits' must be in 1..32, got " + to_text(options.sr_bits));
  }
  mx_plan plan;
  plan.element = kind;
  plan.block =
      options.block > 0 ? options.block : (options.format.default_block > 0 ? options.format.default_block : 32);
  plan.axis = options.axis;
  plan.rounding = options.rounding;
  plan.rule = options.rule;
  plan.sr_bits = options.sr_bits;
  plan.stream = options.stream;
  return plan;
}

std::int64_t mx_code_row_bytes(const mx_plan& plan, std::int64_t cols) {
  return core_ns::spec(plan.element).bits == 4 ? (cols + 1) / 2 : cols;
}
std::int64_t mx_code_bytes(const mx_plan& plan, std::int64_t rows, std::int64_t cols) {
  return rows * mx_code_row_bytes(plan, cols);
}
std::int64_t mx_scale_rows(const mx_plan& plan, std::int64_t rows, std::int64_t) {
  return plan.axis == 1 ? rows : (rows + plan.block - 1) / plan.block;
}
std::int64_t mx_scale_cols(const mx_plan& plan, std::int64_t, std::int64_t cols) {
  return plan.axis == 1 ? (cols + plan.block - 1) / plan.block : cols;
}

// ================================================================================================
// Rotations (NUMERICS.md section 5).
//
// One thread block holds `lines` segments of one rotation block in shared memory and runs the
// canonical stages h = 1, 2, ..., size/2 with a barrier between stages. Within a stage the
// butterflies touch disjoint pairs, so splitting them over threads changes no bit: each output is
// fl32(a + c) or fl32(a - c) of the same inputs as on the CPU. Signs multiply first (exact), the
// scale fl32(1/sqrt(b)) last, as core::rotate_segment does.

namespace {

__global__ void rotation_signs_kernel(float* signs, std::int64_t length, core_ns::random_stream stream) {
  MXSCOPE_GRID_LOOP(k, length) { signs[k] = core_ns::sign_from_word(stream.word(static_cast<std::uint64_t>(k))); }
}

constexpr int rotation_tile_elements = 2048;

__global__ void rotate_kernel(float* values, std::int64_t rows, std::int64_t cols, int axis, int size,
                              const float* signs) {
  MXSCOPE_DYNAMIC_SHARED(float, tile);  // [lines][size]
  const bool along_rows = axis == 1;
  const std::int64_t line_count = along_rows ? rows : cols;
  const std::int64_t length = along_rows ? cols : rows;
  const std::int64_t segments = length / size;
  const int lines = size >= rotation_tile_elements ? 1 : rotation_tile_elements / size;
  const std::int64_t line_groups = (line_count + lines - 1) / lines;
  const std::int64_t segment = static_cast<std::int64_t>(blockIdx.x) % segments;
  const std::int64_t first_line = (static_cast<std::int64_t>(blockIdx.x) / segments) * lines;
  if (first_line >= line_groups * lines) return;
  const int elements = lines * size;
  const std::int64_t begin = segment * size;

  // Load: for axis 1 consecutive threads walk along a row; for axis 0 across the lines (columns).
  for (int t = threadIdx.x; t < elements; t += blockDim.x) {
    const int line = along_rows ? t / size : t % lines;
    const int i = along_rows ? t % size : t / lines;
    const std::int64_t global_line = first_line + line;
    float value = 0.0f;
    if (global_line < line_count) {
      const std::int64_t index = along_rows ? global_line * cols + begin + i : (begin + i) * cols + global_line;
      value = values[index];
      if (signs != nullptr) value = value * signs[begin + i];
    }
    tile[line * size + i] = value;
  }
  const int half_size = size / 2;
  for (int half = 1; half < size; half *= 2) {
    __syncthreads();
    for (int p = threadIdx.x; p < lines * half_size; p += blockDim.x) {
      const int line = p / half_size;
      const int q = p % half_size;
      const int j = (q / half) * 2 * half + q % half;
      float* base = tile + line * size;
      const float a = base[j];
      const float c = base[j + half];
      base[j] = a + c;
      base[j + half] = a - c;
    }
  }
  __syncthreads();
  const float scale = core_ns::hadamard_scale(size);
  for (int t = threadIdx.x; t < elements; t += blockDim.x) {
    const int line = along_rows ? t / size : t % lines;
    const int i = along_rows ? t % size : t / lines;
    const std::int64_t global_line = first_line + line;
    if (global_line < line_count) {
      const std::int64_t index = along_rows ? global_line * cols + begin + i : (begin + i) * cols + global_line;
      values[index] = tile[line * size + i] * scale;
    }
  }
}

// The sign vector of a rotation along an axis of `length` positions, or an empty buffer for none.
device_buffer make_signs(const rotation_plan& rotation, std::int64_t length) {
  if (rotation.size == 0 || !rotation.random_signs || length == 0) return {};
  device_buffer signs(static_cast<std::size_t>(length) * sizeof(float));
  runtime::launch(rotation_signs_kernel, grid_for(length), threads_per_block, 0, signs.as<float>(), length,
                  rotation.signs);
  return signs;
}

void launch_rotate(float* values, std::int64_t rows, std::int64_t cols, int axis, int size, const float* signs) {
  const std::int64_t line_count = axis == 1 ? rows : cols;
  const std::int64_t length = axis == 1 ? cols : rows;
  if (line_count == 0 || length == 0) return;
  const int lines = size >= rotation_tile_elements ? 1 : rotation_tile_elements / size;
  const std::int64_t line_groups = (line_count + lines - 1) / lines;
  const std::int64_t grid = line_groups * (length / size);
  if (grid > 0x7fffffffLL) throw gpu_error("rotate: tensor too large for one launch");
  const std::size_t shared_bytes = static_cast<std::size_t>(lines) * size * sizeof(float);
  runtime::launch(rotate_kernel, static_cast<unsigned>(grid), threads_per_block, shared_bytes, values, rows, cols, axis,
                  size, signs);
}

}  // namespace

void rotate_on_device(float* values, std::int64_t rows, std::int64_t cols, int axis, const rotation_plan& rotation) {
  check_rotation(rotation, rows, cols, axis);
  if (rotation.size == 0) return;
  const std::int64_t length = axis == 1 ? cols : rows;
  const device_buffer signs = make_signs(rotation, length);
  launch_rotate(values, rows, cols, axis, rotation.size, signs.as<const float>());
  if (signs.get() != nullptr) release_after_kernels();  // `signs` must outlive the kernel
}

// ================================================================================================
// MX quantization (NUMERICS.md sections 2-4).

namespace {

// One element against its block exponent: the code, the flags and the dequantized fp32 value.
// Kept out of line: the encoder is long (fp64 arithmetic, every rounding mode), and inlining it
// into unrolled loops multiplies code size and compile time without a measurable gain.
struct element_result {
  core_ns::encoded encoded;
  float dequantized;
};

template <int KindIndex>
__device__ __noinline__ element_result quantize_one(element_kind runtime_kind, float value, int exponent,
                                                    core_ns::rounding_mode rounding, std::uint32_t word, int sr_bits) {
  element_kind kind = runtime_kind;
  if constexpr (KindIndex >= 0) kind = static_cast<element_kind>(KindIndex);
  const core_ns::encoded result = core_ns::quantize_element(kind, value, exponent, rounding, word, sr_bits);
  return {result, static_cast<float>(core_ns::dequantize_element(kind, result.code, exponent))};
}

// Pass 1 of the generic path: one thread per block computes amax and the scale code. The thread
// index equals the scale's index in both layouts ([rows, blocks] for axis 1, [blocks, cols] for
// axis 0); for axis 0 consecutive threads read consecutive columns.
template <class Input>
__global__ void mx_scale_kernel(const Input* input, std::int64_t rows, std::int64_t cols, mx_plan plan,
                                std::uint8_t* scales) {
  const bool along_rows = plan.axis == 1;
  const std::int64_t lines = along_rows ? rows : cols;
  const std::int64_t length = along_rows ? cols : rows;
  const std::int64_t blocks_per_line = (length + plan.block - 1) / plan.block;
  MXSCOPE_GRID_LOOP(g, lines * blocks_per_line) {
    const std::int64_t line = along_rows ? g / blocks_per_line : g % lines;
    const std::int64_t b = along_rows ? g % blocks_per_line : g / lines;
    const std::int64_t begin = b * plan.block;
    const std::int64_t count = length - begin < plan.block ? length - begin : plan.block;
    float amax = 0.0f;
    bool nonfinite = false;
    for (std::int64_t i = 0; i < count; ++i) {
      const std::int64_t index = along_rows ? line * cols + begin + i : (begin + i) * cols + line;
      const float v = load_input(input, index);
      if (!is_finite(v)) {
        nonfinite = true;
      } else {
        const float magnitude = fabsf(v);
        if (amax < magnitude) amax = magnitude;  // std::max(amax, magnitude)
      }
    }
    scales[g] = nonfinite ? core_ns::scale_nan_code
                          : core_ns::scale_code(core_ns::shared_exponent(plan.element, plan.rule, amax));
  }
}

// Pass 2: one thread per code byte (two elements for fp4, one otherwise) reads its block's scale
// and encodes. NaN blocks get code 0 and NaN, as the CPU writes them.
template <class Input>
__global__ void mx_element_kernel(const Input* input, std::int64_t rows, std::int64_t cols, mx_plan plan,
                                  const std::uint8_t* scales, mx_device_output output) {
  const bool packed = core_ns::spec(plan.element).bits == 4;
  const bool stochastic = plan.rounding == core_ns::rounding_mode::sr;
  const std::int64_t row_bytes = packed ? (cols + 1) / 2 : cols;
  const std::int64_t blocks_along_row = (cols + plan.block - 1) / plan.block;
  unsigned long long counts[mx_counter_count] = {0, 0, 0, 0};
  MXSCOPE_GRID_LOOP(unit, rows * row_bytes) {
    const std::int64_t r = unit / row_bytes;
    const std::int64_t first_col = packed ? (unit % row_bytes) * 2 : unit % row_bytes;
    const int elements = packed ? 2 : 1;
    std::uint32_t byte = 0;
    core_ns::philox_block words{};
    std::uint64_t words_index = ~std::uint64_t{0};
    for (int e = 0; e < elements; ++e) {
      const std::int64_t c = first_col + e;
      if (c >= cols) break;  // the unused high nibble of an odd row stays 0
      const std::int64_t flat = r * cols + c;
      const float v = load_input(input, flat);
      counts[counter_nonzero] += v != 0.0f;
      counts[counter_nonfinite] += !is_finite(v);
      const std::uint8_t scale =
          plan.axis == 1 ? scales[r * blocks_along_row + c / plan.block] : scales[(r / plan.block) * cols + c];
      std::uint32_t code = 0;
      float dequantized = canonical_nan_float();
      if (scale != core_ns::scale_nan_code) {
        const int exponent = core_ns::scale_exponent(scale);
        std::uint32_t word = 0;
        if (stochastic) {
          const std::uint64_t block_index = static_cast<std::uint64_t>(flat) / 4;
          if (block_index != words_index) {
            words = plan.stream.block(block_index);
            words_index = block_index;
          }
          word = words.word[flat % 4];
        }
        const element_result result = quantize_one<-1>(plan.element, v, exponent, plan.rounding, word, plan.sr_bits);
        code = result.encoded.code;
        dequantized = result.dequantized;
        counts[counter_flushed] += result.encoded.flushed;
        counts[counter_saturated] += result.encoded.saturated;
      }
      byte |= packed ? (code & 0x0FU) << (4 * e) : code;
      if (output.dequantized != nullptr) output.dequantized[flat] = dequantized;
    }
    output.codes[unit] = static_cast<std::uint8_t>(byte);
  }
  if (output.counters != nullptr) add_counters(output.counters, counts);
}

#include "mx_columns-inl.cuh"
#include "operand-inl.cuh"

// MX codes' bf16 operand (mx_device_output::operand_bf16), where the quantizer did not write it.
void launch_mx_operand(const mx_plan& plan, std::int64_t rows, std::int64_t cols, const mx_device_output& output) {
  const bool along_rows = plan.axis == 1;
  const operand_layout layout{plan.element,
                              operand_scale::mx,
                              rows,
                              cols,
                              mx_code_row_bytes(plan, cols),
                              mx_scale_cols(plan, rows, cols),
                              along_rows ? 1 : plan.block,
                              along_rows ? plan.block : 1,
                              core_ns::spec(plan.element).bits == 4};
  launch_operand_bf16(output.codes, output.scales, layout, output.operand_bf16);
}

// The fused path (axis 1, block 32, cols a multiple of 32). MX block g then holds the input
// elements [32 g, 32 g + 32), its codes are the bytes [16 g, 16 g + 16) (fp4) or [32 g, 32 g + 32)
// and its scale is byte g. One thread takes one MX block at a time (consecutive threads,
// consecutive blocks, in a grid-stride loop): it loads the block's 64 or 128 bytes in 16-byte
// pieces straight into registers (the pieces a warp's load leaves in a sector, its next load
// finds in L1; staging the tile through shared memory first, with two barriers per tile, was
// 12% slower at bf16 -> MXFP4 rne), rotates them there (Rotation = 16 or 32: whole rotation
// segments lie in the block) with core::rotate_segment, scans them and encodes; codes go out in
// 16-byte stores. The element encoder is a template choice (fused_encoder); every one is the
// core's function (fast_encode.hpp). Counters are 32-bit per thread (a thread meets 32 elements
// per block and far fewer than 2^27 blocks) and are summed per thread block at the end.
constexpr int fused_block = 32;

enum class fused_encoder {
  fp4_nearest_even,  // fp4, rne: fast_encode::fp4_nearest_even
  fp4_stochastic,    // fp4, sr with 32 random bits: fast_encode::fp4_stochastic_unscaled
  fp4_by_carry,      // fp4, rna, rtz or sr with fewer bits: fast_encode::fp4_locate and fp4_round
  any_format,        // the other formats: fast_encode::quantize_finite (float formats) or the core (int8)
};

// The gfx950 native quantizer's loads (native_gfx950_kernels.hpp: one thread per block reading its
// own 64 or 128 bytes); only the HIP device code for gfx950 has that path.
#if defined(__HIP__) && !defined(MXSCOPE_GPU_SIMULATE) && defined(__gfx950__)
__device__ inline void load_block(const float* input, std::int64_t first, float (&v)[fused_block]) {
  const float4* source = reinterpret_cast<const float4*>(input + first);
#pragma unroll
  for (int q = 0; q < fused_block / 4; ++q) {
    const float4 chunk = source[q];
    v[4 * q] = chunk.x;
    v[4 * q + 1] = chunk.y;
    v[4 * q + 2] = chunk.z;
    v[4 * q + 3] = chunk.w;
  }
}

__device__ inline void load_block(const std::uint16_t* input, std::int64_t first, float (&v)[fused_block]) {
  const uint4* source = reinterpret_cast<const uint4*>(input + first);
#pragma unroll
  for (int q = 0; q < fused_block / 8; ++q) {
    const uint4 chunk = source[q];
    const std::uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      v[8 * q + 2 * w] = core_ns::bf16_to_float(static_cast<std::uint16_t>(words[w] & 0xFFFFU));
      v[8 * q + 2 * w + 1] = core_ns::bf16_to_float(static_cast<std::uint16_t>(words[w] >> 16));
    }
  }
}

// The start of a fused block of the native quantizer: load its 32 elements, rotate them in
// registers (signs first, as core::rotate_segment does), count nonzero and non-finite inputs and
// find the largest finite magnitude.
struct block_scan {
  float amax;
  bool nonfinite;
};
template <int Rotation, class Input>
__device__ inline block_scan load_and_scan_block(const Input* input, std::int64_t first, std::int64_t b,
                                                 const float* signs, float (&v)[fused_block],
                                                 unsigned long long (&counts)[mx_counter_count]) {
  load_block(input, first, v);
  if constexpr (Rotation > 0) {
    // The sign multiply is core::rotate_segment's first step, done here in registers (exact).
    if (signs != nullptr) {
#pragma unroll
      for (int i = 0; i < fused_block; ++i) v[i] = v[i] * signs[b * fused_block + i];
    }
#pragma unroll
    for (int s = 0; s < fused_block / Rotation; ++s) core_ns::rotate_segment(v + s * Rotation, Rotation, nullptr);
  }
  block_scan scan{0.0f, false};
#pragma unroll
  for (int i = 0; i < fused_block; ++i) {
    counts[counter_nonzero] += v[i] != 0.0f;
    if (!is_finite(v[i])) {
      scan.nonfinite = true;
      ++counts[counter_nonfinite];
    } else {
      const float magnitude = fabsf(v[i]);
      if (scan.amax < magnitude) scan.amax = magnitude;
    }
  }
  return scan;
}

#endif  // __HIP__ && !MXSCOPE_GPU_SIMULATE && __gfx950__

template <int Pieces>
__device__ inline void unpack_pieces(const uint4 (&pieces)[Pieces], float (&v)[fused_block]) {
  static_assert(Pieces == 4 || Pieces == 8);
#pragma unroll
  for (int j = 0; j < Pieces; ++j) {
    const std::uint32_t words[4] = {pieces[j].x, pieces[j].y, pieces[j].z, pieces[j].w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      if constexpr (Pieces == 4) {  // bf16: two elements per word, the first in the low half (exact widening)
        v[8 * j + 2 * w] = core_ns::bits_float(words[w] << 16);
        v[8 * j + 2 * w + 1] = core_ns::bits_float(words[w] & 0xFFFF0000U);
      } else {
        v[4 * j + w] = core_ns::bits_float(words[w]);
      }
    }
  }
}

// The dequantized block, stored from the branch that made it (a store shared after the branches
// would keep the inputs alive in registers through the encoder).
__device__ inline void store_dequantized(float* destination, const float (&v)[fused_block]) {
  float4* vectors = reinterpret_cast<float4*>(destination);
#pragma unroll
  for (int q = 0; q < fused_block / 4; ++q) vectors[q] = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
}

// The low bytes of four words, as the bytes of one word (byte k from the k-th).
__device__ inline std::uint32_t low_bytes(std::uint32_t a, std::uint32_t b, std::uint32_t c, std::uint32_t d) {
#if defined(__CUDA_ARCH__) && !defined(__HIP__)
  return __byte_perm(__byte_perm(a, b, 0x0040U), __byte_perm(c, d, 0x0040U), 0x5410U);
#else
  return (a & 0xFFU) | (b & 0xFFU) << 8 | (c & 0xFFU) << 16 | (d & 0xFFU) << 24;
#endif
}

// The sign bits of 8 fp32 values at bits 3, 7, ..., 31 (the sign bits of 8 fp4 codes). On CUDA the
// top bytes are gathered with their sign bit replicated (prmt's sign mode: byte k of `even` is 0xFF
// where value 2 k is negative, of `odd` where 2 k + 1 is), then one mask each: 8 instructions per 8
// values where gathering the plain top bytes and shifting took 9.
__device__ inline std::uint32_t nibble_signs(const float* v) {
  const auto b = [&](int i) { return core_ns::float_bits(v[i]); };
#if defined(__CUDA_ARCH__) && !defined(__HIP__)
  const auto sign_bytes = [](std::uint32_t x, std::uint32_t y) {
    std::uint32_t out = 0;  // byte 0: x's sign replicated, byte 1: y's (selectors 8 + 3 and 8 + 7)
    asm("prmt.b32 %0, %1, %2, 0x00FB;" : "=r"(out) : "r"(x), "r"(y));
    return out;
  };
  const std::uint32_t even = __byte_perm(sign_bytes(b(0), b(2)), sign_bytes(b(4), b(6)), 0x5410U);
  const std::uint32_t odd = __byte_perm(sign_bytes(b(1), b(3)), sign_bytes(b(5), b(7)), 0x5410U);
  return (even & 0x08080808U) | (odd & 0x80808080U);
#else
  const std::uint32_t even = (b(0) >> 24) | (b(2) >> 24) << 8 | (b(4) >> 24) << 16 | (b(6) >> 24) << 24;
  const std::uint32_t odd = (b(1) >> 24) | (b(3) >> 24) << 8 | (b(5) >> 24) << 16 | (b(7) >> 24) << 24;
  return ((even >> 4) & 0x08080808U) | (odd & 0x80808080U);
#endif
}

// Four words of 8 codes sum >> 22 (0..8, fp4_stochastic_anchored_sum) with the 8s made 7s
// (each minus its bit 3), the signs of v's 32 values inserted (nibble_signs) and the number of
// nonzero codes returned: a code c <= 7 is nonzero exactly when c + 7 has bit 3 set (no carry leaves
// its nibble), and the four words' flags go to bits 3, 2, 1 and 0 of the nibbles for one
// population count.
__device__ inline unsigned finish_anchored_codes(std::uint32_t* words, const float* v) {
  std::uint32_t flags = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const std::uint32_t capped = words[j] - ((words[j] >> 3) & 0x11111111U);
    flags += ((capped + 0x77777777U) & 0x88888888U) >> j;
    words[j] = capped | nibble_signs(v + 8 * j);
  }
#if defined(__CUDA_ARCH__) || defined(__HIP__)
  return static_cast<unsigned>(__popc(flags));
#else
  unsigned count = 0;
  for (; flags != 0; flags &= flags - 1) ++count;
  return count;
#endif
}

// nibble_signs of the 8 bf16 elements of a piece as read (element 2 w in the low half of word w,
// its sign at bit 15; element 2 w + 1 in the high half, sign at bit 31): byte 1 of each word in
// place of the even elements' byte 3.
__device__ inline std::uint32_t nibble_signs_bf16(const uint4& piece) {
#if defined(__CUDA_ARCH__) && !defined(__HIP__)
  const std::uint32_t even =
      __byte_perm(__byte_perm(piece.x, piece.y, 0x0051U), __byte_perm(piece.z, piece.w, 0x0051U), 0x5410U);
  const std::uint32_t odd =
      __byte_perm(__byte_perm(piece.x, piece.y, 0x0073U), __byte_perm(piece.z, piece.w, 0x0073U), 0x5410U);
#else
  const auto low = [](std::uint32_t x) { return (x >> 8) & 0xFFU; };
  const auto high = [](std::uint32_t x) { return x >> 24; };
  const std::uint32_t even = low(piece.x) | low(piece.y) << 8 | low(piece.z) << 16 | low(piece.w) << 24;
  const std::uint32_t odd = high(piece.x) | high(piece.y) << 8 | high(piece.z) << 16 | high(piece.w) << 24;
#endif
  return ((even >> 4) & 0x08080808U) | (odd & 0x80808080U);
}

// The largest and smallest magnitude of a bf16 block as read, as the bf16 bit patterns (two
// magnitudes per word, compared per halfword: the same order as their values).
struct bf16_extremes {
  std::uint32_t largest;
  std::uint32_t smallest;
};
template <int Pieces>
__device__ __forceinline__ bf16_extremes bf16_block_extremes(const uint4 (&pieces)[Pieces]) {
  std::uint32_t high = 0, low = 0xFFFFFFFFU;
#pragma unroll
  for (int j = 0; j < Pieces; ++j) {
    const std::uint32_t words4[4] = {pieces[j].x, pieces[j].y, pieces[j].z, pieces[j].w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      high = fast_encode::max_u16x2(high, words4[w] & 0x7FFF7FFFU);
      low = fast_encode::min_u16x2(low, words4[w] & 0x7FFF7FFFU);
    }
  }
  return {(high & 0xFFFFU) > (high >> 16) ? high & 0xFFFFU : high >> 16,
          (low & 0xFFFFU) < (low >> 16) ? low & 0xFFFFU : low >> 16};
}

// The least magnitude of a bf16 block as read, as a bf16 bit pattern. On sm_90 one bf16x2
// minimum of magnitudes per word (min.xorsign.abs: the minimum of |x| and |y| per half, its sign
// bit the halves' signs' xor, cleared at the end), 15 instructions where masking the signs off
// first takes 16 more; elsewhere bf16_block_extremes. NaN halves are passed over (those blocks are
// non-finite after the rotation and take no code from this encoder).
template <int Pieces>
__device__ __forceinline__ std::uint32_t bf16_least_magnitude(const uint4 (&pieces)[Pieces]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(__HIP__)
  std::uint32_t low = pieces[0].x;
#pragma unroll
  for (int j = 0; j < Pieces; ++j) {
    const std::uint32_t words4[4] = {pieces[j].x, pieces[j].y, pieces[j].z, pieces[j].w};
#pragma unroll
    for (int w = j == 0 ? 1 : 0; w < 4; ++w) asm("min.xorsign.abs.bf16x2 %0, %0, %1;" : "+r"(low) : "r"(words4[w]));
  }
  low &= 0x7FFF7FFFU;
  return (low & 0xFFFFU) < (low >> 16) ? low & 0xFFFFU : low >> 16;
#else
  return bf16_block_extremes(pieces).smallest;
#endif
}

// Nonzero magnitudes among the 32 fp4 codes of a block's 4 code words (bit 3 of each nibble is the
// sign): in each word, (nibble | 8) - 1 = 7 + magnitude has bit 3 set exactly when the magnitude is
// nonzero (no borrow leaves a nibble), the four words' flags are moved to bits 3, 2, 1 and 0 of the
// nibbles and counted by one population count.
__device__ inline unsigned nonzero_fp4_magnitudes(const std::uint32_t (&words)[8]) {
  std::uint32_t flags = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) flags |= (((words[j] | 0x88888888U) - 0x11111111U) & 0x88888888U) >> j;
#if defined(__CUDA_ARCH__) && !defined(__HIP__)
  return static_cast<unsigned>(__popc(flags));
#else
  unsigned count = 0;
  for (; flags != 0; flags &= flags - 1) ++count;
  return count;
#endif
}

// core::fwht on one segment of `Size` elements (the same additions in the same stages), which also
// folds what the block's encoder needs of its output from the last stage's pairs a, c (outputs
// a + c and a - c):
// - high: the largest pattern of s = fl(|a| + |c|), the larger output magnitude of the pair
//   (rounding is monotone and symmetric), one fp32 addition per pair and the comparisons on the bit
//   patterns, two pairs per instruction (a three-way unsigned maximum on sm_90; ptxas fuses the
//   two-way ones). s >= 0 orders as its pattern; a NaN s (a NaN input) is a positive NaN pattern,
//   above infinity's, and where a + c or a - c is inf - inf (NaN), s is inf. So high is the largest
//   output magnitude when below infinity's pattern, else the block holds a non-finite output.
// - equal: whether some pair has |a| = |c|, one compare-and-or per pair into a predicate. An output
//   a + c or a - c is zero exactly when |a| = |c| with both finite (fp32 addition is exact near
//   zero), so without such a pair no output is zero; with one (or with |a| = |c| = inf) an output
//   may be zero, and the encoder counts them.
__device__ __forceinline__ std::uint32_t max_u32(std::uint32_t a, std::uint32_t b) { return a > b ? a : b; }

template <int Size>
__device__ inline void fwht_with_extremes(float* v, std::uint32_t& high, bool& equal) {
#pragma unroll
  for (int half = 1; half < Size / 2; half *= 2) {
#pragma unroll
    for (int start = 0; start < Size; start += 2 * half) {
#pragma unroll
      for (int j = start; j < start + half; ++j) {
        const float a = v[j];
        const float c = v[j + half];
        v[j] = a + c;
        v[j + half] = a - c;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < Size / 2; ++j) {
    const float a = v[j];
    const float c = v[j + Size / 2];
    high = max_u32(high, core_ns::float_bits(fabsf(a) + fabsf(c)));
    equal = equal | (fabsf(a) == fabsf(c));
    v[j] = a + c;
    v[j + Size / 2] = a - c;
  }
}

// Thread blocks per multiprocessor for the fp4 encoders on CUDA, so that enough loads are in flight
// to cover the memory latency: 4 (64 registers) for bf16 without rotation, 3 (80 registers) for the
// others, the most that ptxas fits without spilling (sm_90; H16 on bf16 at 4 spilled 80 bytes and
// took 0.250 ms against 0.238). sr on bf16 reads the next block ahead (16 more registers): 3 (80)
// without rotation, where 4 spilled 124 bytes and 3 and 4 ran alike before the read-ahead, and 2
// (128) with H16, which took 0.431 ms against 0.449 at 3 without it. (HIP's second bound means
// something else; it keeps the plain bound.)
#if defined(__CUDACC__) && !defined(__HIP__)
#define MXSCOPE_FUSED_BOUNDS(min_blocks) __launch_bounds__(threads_per_block, min_blocks)
#else
#define MXSCOPE_FUSED_BOUNDS(min_blocks) __launch_bounds__(threads_per_block)
#endif

template <class Input, int Rotation, fused_encoder Encoder>
constexpr int fused_blocks_per_multiprocessor =
    Encoder == fused_encoder::any_format                               ? 1
    : Encoder == fused_encoder::fp4_stochastic && sizeof(Input) == 2 ? (Rotation == 0 ? 3 : 2)
    : Rotation == 0 && sizeof(Input) == 2                             ? 4
                                                                      : 3;

// Calls f(i, word) for the elements i = 0 .. 31 of MX block g in order, where element 4 q + w draws
// word w of Philox block 8 g + q of the plan's stream (NUMERICS.md section 4): the sr encoders' walk.
// (The scaled encoders' loops, which draw only for some rounding modes, keep their own form: through
// this helper ptxas scheduled them differently, and those are the measured kernels.)
template <class F>
__device__ __forceinline__ void for_each_random_word(std::int64_t g, const mx_plan& plan,
                                                     const core_ns::philox_keys& keys, F&& f) {
#pragma unroll
  for (int q = 0; q < fused_block / 4; ++q) {
    const core_ns::philox_block random =
        plan.stream.block(static_cast<std::uint64_t>(g) * (fused_block / 4) + q, keys);
#pragma unroll
    for (int w = 0; w < 4; ++w) f(4 * q + w, random.word[w]);
  }
}

// fast_encode::fp4_stochastic_anchored_sum on the 32 magnitudes |v[i]| of MX block g (element i
// draws its word as for_each_random_word walks), the codes sum >> 22 packed into words[i / 8] at
// nibble i % 8 and the saturation flags (fast_encode::fp4_saturated) added to `saturated`. As
// multiply-adds by constant powers of two (multiply_add_low/high) the code and its packing go where
// ptxas puts them: the code's shift as LEA.HI on the integer pipe, the packing on the multiply-add
// pipe (IMAD); with ByShift the packing is written as a shift and an addition, which ptxas makes
// the same IMAD or an LEA as it sees fit (measured with the lean path, where it was as fast or a
// little faster). With Checked, (sum + 1) 2^10, zero exactly when the sum is undecided (low 22
// bits all ones), goes into the least of `margin`.
template <bool Checked, bool ByShift, int Words>
__device__ __forceinline__ void encode_anchored_block(const float (&v)[fused_block], std::int64_t g,
                                                      const mx_plan& plan, const core_ns::philox_keys& keys,
                                                      float anchor, fast_encode::fp4_saturation_flag flag,
                                                      std::uint32_t (&words)[Words], std::uint32_t& margin,
                                                      float& saturated) {
  for_each_random_word(g, plan, keys, [&](int i, std::uint32_t word) {
    const float magnitude = fabsf(v[i]);
    const std::uint32_t sum = fast_encode::fp4_stochastic_anchored_sum(magnitude, word, anchor);
    if constexpr (Checked) {
      const std::uint32_t distance = multiply_add_low(sum, 1U << 10, 1U << 10);
      margin = distance < margin ? distance : margin;
    }
    if constexpr (ByShift) {
      words[i / 8] += multiply_add_high(sum, 1U << 10, 0U) << (4 * (i % 8));
    } else {
      words[i / 8] = multiply_add_low(multiply_add_high(sum, 1U << 10, 0U), 1U << (4 * (i % 8)), words[i / 8]);
    }
    saturated += fast_encode::fp4_saturated(magnitude, flag);
  });
}

// One MX block g of the fused kernel, read from `input` and written to `output`, its counts added
// to `counts`. With Summed (fp4 sr) the codes come from fast_encode::fp4_stochastic_anchored_sum, and
// a block where one of its sums is undecided (about one block in 2^17 with random words), or whose
// grid exponent is outside that encoder's or the fp32 saturation flags' range (values under 2^-102
// or from 2^25 on), returns false with no codes or flags written and its counts taken back; the
// kernel then encodes it again through fused_block_again (fp4_stochastic_unscaled), a call of its
// own, so that the rare path's registers do not weigh on the hot loop's. With Lean (folded H16 + sr
// under the floor rule, without rotation signs or a dequantized output) only the common blocks are
// encoded here and every other one returns false before writing or counting anything.
template <class Input, int Rotation, fused_encoder Encoder, bool Summed, bool Lean = false>
__device__ __forceinline__ bool encode_fused_block(const Input* input, const uint4* loaded, std::int64_t g,
                                                   std::int64_t blocks_per_row,
                                                   const mx_plan& plan, const core_ns::philox_keys& keys,
                                                   const float* signs, const mx_device_output& output,
                                                   unsigned (&counts)[mx_counter_count], uint4* refill = nullptr,
                                                   std::int64_t refill_block = 0) {
  constexpr int pieces = fused_block * static_cast<int>(sizeof(Input)) / 16;
  constexpr bool fp4 = Encoder != fused_encoder::any_format;
  // bf16 input rotated by H16 (fp4 encoders): v keeps the Hadamard sums s, without the factor
  // hadamard_scale(16) = 1/4, and the block's grid is taken 4 times larger (exponent + 2). The
  // quarter is exact: every s is a multiple of 2^-133 (bf16's subnormal spacing; sums, differences
  // and their fp32 roundings keep that), so s / 4 needs no bit below 2^-135, and the codes, flags
  // and counts of s on the grid 2^(e + 2) are those of s / 4 on 2^e. One multiply per element less.
  constexpr int folded = fp4 && Rotation == 16 && sizeof(Input) == 2 ? 2 : 0;
  static_assert(core_ns::hadamard_scale(16) == 0.25f);
  const element_kind kind = fp4 ? element_kind::fp4_e2m1 : plan.element;
  const bool packed = core_ns::spec(kind).bits == 4;
  const bool fast = fast_encode::covers(kind);
  const fast_encode::element_constants constants = fast_encode::constants_of(kind);
  const bool stochastic = plan.rounding == core_ns::rounding_mode::sr;
  const std::uint32_t random_mask = stochastic ? fast_encode::fp4_random_mask(plan.sr_bits) : 0U;
  const uint4* source = reinterpret_cast<const uint4*>(input);
  uint4 mine[pieces];  // the block as read: from `loaded` where the caller read it ahead
#pragma unroll
  for (int j = 0; j < pieces; ++j) mine[j] = loaded != nullptr ? loaded[j] : source[g * pieces + j];
  float v[fused_block];
  unpack_pieces(mine, v);
  std::uint32_t pair_high = 0;  // folded: fwht_with_extremes
  bool pair_equal = false;
  // Folded sr: the least bf16 magnitude pattern among the block's inputs (the undecided check's skip;
  // the unused largest costs nothing).
  std::uint32_t least_input = 0;
  if constexpr (folded > 0 && Encoder == fused_encoder::fp4_stochastic && Summed) {
    least_input = bf16_least_magnitude(mine);
  }
  if constexpr (Rotation > 0) {
    // The caller's read-ahead: block refill_block goes into `refill` (where `loaded` came from) once
    // the words as read are no longer needed (rotated blocks take their signs from v). Always a
    // load, so that it can land in the registers the words came in.
    if (refill != nullptr) {
#pragma unroll
      for (int j = 0; j < pieces; ++j) refill[j] = source[refill_block * pieces + j];
    }
    // The sign multiply is core::rotate_segment's first step, done here in registers (exact). (The
    // lean path runs without signs.)
    if (!Lean && signs != nullptr) {
      const float4* block_signs = reinterpret_cast<const float4*>(signs + (g % blocks_per_row) * fused_block);
#pragma unroll
      for (int q = 0; q < fused_block / 4; ++q) {
        const float4 s = block_signs[q];
        v[4 * q] = v[4 * q] * s.x;
        v[4 * q + 1] = v[4 * q + 1] * s.y;
        v[4 * q + 2] = v[4 * q + 2] * s.z;
        v[4 * q + 3] = v[4 * q + 3] * s.w;
      }
    }
#pragma unroll
    for (int s = 0; s < fused_block / Rotation; ++s) {
      if constexpr (folded > 0) {
        fwht_with_extremes<Rotation>(v + s * Rotation, pair_high, pair_equal);  // v holds 4x the rotated values
      } else {
        core_ns::rotate_segment(v + s * Rotation, Rotation, nullptr);
      }
    }
  }
  // The largest magnitude as fp32 bits: the largest finite |v| when below the infinity pattern,
  // else the block holds a non-finite value. The smallest says whether there are zeros to count.
  std::uint32_t largest = 0;
  std::uint32_t smallest = 0xFFFFFFFFU;
  if constexpr (Rotation == 0 && sizeof(Input) == 2) {
    // bf16 as read (bf16 patterns order as the fp32 ones they widen to).
    const bf16_extremes extremes = bf16_block_extremes(mine);
    largest = extremes.largest << 16;
    smallest = extremes.smallest << 16;
  } else if constexpr (folded > 0) {
    largest = pair_high;
    smallest = pair_equal ? 0U : 0xFFFFFFFFU;  // 0 where an output may be zero: all that is asked of it
  } else {
    // As fp32 values: one instruction each per element (the absolute value is an operand
    // modifier); NaN propagates into the maximum, inf is the largest value anyway.
    float high = 0.0f, low = core_ns::bits_float(0x7F800000U);
#pragma unroll
    for (int i = 0; i < fused_block; ++i) {
      high = max_or_nan(high, fabsf(v[i]));
      low = fminf(low, fabsf(v[i]));
    }
    largest = core_ns::float_bits(high);
    smallest = core_ns::float_bits(low);
  }
  if constexpr (folded > 0) largest = core_ns::float_bits(core_ns::bits_float(largest) * 0.25f);  // exact
  if constexpr (Lean) {
    // The lean path of folded H16 + sr (mx_fused_kernel takes it): the floor rule, no signs, no
    // dequantized output. Every block that needs more than the anchored sums, one with an output
    // that may be zero (its nonzero count), outside the anchor's and the flags' exponents or with an
    // undecided sum, goes back to the caller whole (nothing written, nothing counted) for
    // fused_block_again.
    static_assert(folded > 0 && Encoder == fused_encoder::fp4_stochastic && Summed);
    const int exponent = fast_encode::floor_rule_exponent(core_ns::emax_elem(element_kind::fp4_e2m1), largest);
    // The grid exponent exponent + folded must suit the anchor (-127..23) and the flags (-105..102):
    // exponent in [lowest, highest], one unsigned comparison. A non-finite largest (pattern from
    // infinity's up) gives exponent >= 255 - 129 > highest; the floor rule keeps the largest below
    // 8 2^exponent, which the anchor also needs.
    constexpr int lowest = -105 - folded, highest = 23 - folded;
    static_assert(fast_encode::fp4_stochastic_anchored_covers(lowest + folded) &&
                  fast_encode::fp4_saturation_flag_covers(lowest + folded) &&
                  !fast_encode::fp4_saturation_flag_covers(lowest - 1 + folded) &&
                  fast_encode::fp4_stochastic_anchored_covers(highest + folded) &&
                  fast_encode::fp4_saturation_flag_covers(highest + folded) &&
                  !fast_encode::fp4_stochastic_anchored_covers(highest + 1 + folded));
    static_assert((0x7F800000U >> 23) - 127 - core_ns::emax_elem(element_kind::fp4_e2m1) > highest);
    if ((smallest == 0) | (static_cast<unsigned>(exponent - lowest) > static_cast<unsigned>(highest - lowest))) {
      return false;
    }
    const fast_encode::fp4_saturation_flag flag = fast_encode::fp4_saturation_flag_constants(exponent + folded);
    const float anchor = fast_encode::fp4_stochastic_anchor(exponent + folded);
    std::uint32_t words[4] = {0, 0, 0, 0};
    std::uint32_t margin = 0xffffffffU;
    float saturated = 0.0f;
    if (least_input >= static_cast<std::uint32_t>(exponent + 113) << 7) {  // as in the general path below
      encode_anchored_block<false, true>(v, g, plan, keys, anchor, flag, words, margin, saturated);
    } else {
      encode_anchored_block<true, true>(v, g, plan, keys, anchor, flag, words, margin, saturated);
    }
    if (margin == 0) return false;
    const unsigned nonzero_codes = finish_anchored_codes(words, v);
    counts[counter_nonzero] += fused_block;
    counts[counter_saturated] += static_cast<unsigned>(saturated);
    counts[counter_flushed] += fused_block - nonzero_codes;
    output.scales[g] = core_ns::scale_code(exponent);
    uint4* codes = reinterpret_cast<uint4*>(output.codes + g * (fused_block / 2));
    codes[0] = make_uint4(words[0], words[1], words[2], words[3]);
    return true;
  }
  unsigned nonzero = fused_block;  // v != 0, NaN included
  if (smallest == 0) {
#pragma unroll
    for (int i = 0; i < fused_block; ++i) nonzero -= (core_ns::float_bits(v[i]) & 0x7FFFFFFFU) == 0 ? 1U : 0U;
  }
  counts[counter_nonzero] += nonzero;
  std::uint32_t words[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // the block's codes, little-endian bytes
  bool unscaled = false;  // rne or sr codes from an unscaled encoder
  if (largest >= 0x7F800000U) {
#pragma unroll
    for (int i = 0; i < fused_block; ++i) counts[counter_nonfinite] += !is_finite(v[i]) ? 1U : 0U;
    output.scales[g] = core_ns::scale_nan_code;
    if (output.dequantized != nullptr) {
#pragma unroll
      for (int i = 0; i < fused_block; ++i) v[i] = canonical_nan_float();
      store_dequantized(output.dequantized + g * fused_block, v);
    }
  } else {
    const int exponent = plan.rule == core_ns::scale_rule::floor
                             ? fast_encode::floor_rule_exponent(core_ns::emax_elem(kind), largest)
                             : core_ns::shared_exponent(kind, plan.rule, core_ns::bits_float(largest));
    output.scales[g] = core_ns::scale_code(exponent);
    bool packed_bf16 = false;  // rne codes from the halfword encoder, two elements at a time
    if constexpr (Encoder == fused_encoder::fp4_nearest_even) {
      unscaled = fast_encode::fp4_unscaled_covers(exponent + folded);
      if constexpr (Rotation == 0 && sizeof(Input) == 2) packed_bf16 = fast_encode::fp4_unscaled_bf16x2_covers(exponent);
    }
    if constexpr (Encoder == fused_encoder::fp4_stochastic) unscaled = fast_encode::fp4_stochastic_covers(exponent + folded);
    if (packed_bf16) {
      // bf16 without rotation: fast_encode::fp4_nearest_even_bf16x2 on the words as read. Piece
      // j holds elements 8 j .. 8 j + 7, word w of it elements 8 j + 2 w (low half) and
      // 8 j + 2 w + 1, which become byte w of code word j: the two codes with their signs
      // (bits 15 and 31 of the word) moved to bits 3 and 19, folded into the low byte.
      const fast_encode::fp4_unscaled_bf16x2 grid = fast_encode::fp4_unscaled_bf16x2_constants(exponent);
      std::uint32_t saturated = 0;  // one count per half
#pragma unroll
      for (int j = 0; j < pieces; ++j) {
        const std::uint32_t words4[4] = {mine[j].x, mine[j].y, mine[j].z, mine[j].w};
        std::uint32_t bytes[4];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const std::uint32_t magnitudes = words4[w] & 0x7FFF7FFFU;
          saturated += fast_encode::fp4_saturated_bf16x2(magnitudes, grid);
          const std::uint32_t pair =
              fast_encode::fp4_nearest_even_bf16x2(magnitudes, grid) | ((words4[w] >> 12) & 0x00080008U);
          bytes[w] = pair | (pair >> 12);
        }
        words[j] = low_bytes(bytes[0], bytes[1], bytes[2], bytes[3]);
      }
      counts[counter_saturated] += (saturated & 0xFFFFU) + (saturated >> 16);
    } else if (unscaled) {
      // rne or sr on the unscaled magnitudes (fast_encode::fp4_nearest_even_unscaled,
      // fp4_stochastic_anchored_sum): no scaling multiply by 2^-e, no cap. The codes are packed by
      // additions, each word then gets its offsets once (rne: fast_encode::fp4_unscaled_word_offset;
      // the anchored sums have none), and the signs go in from v's bits.
      // For sr, element 4 q + w draws word w of Philox block 8 g + q.
      const fast_encode::fp4_unscaled grid = fast_encode::fp4_unscaled_constants(exponent + folded);
      std::uint32_t word_offset = fast_encode::fp4_unscaled_word_offset(grid);
      if constexpr (Encoder == fused_encoder::fp4_stochastic && Summed) {
        // fast_encode::fp4_stochastic_anchored_sum per element: one fp32 multiplication toward zero
        // (|v| an operand modifier), then as multiply-adds (multiply_add_low/high) the code sum >> 22
        // as the high word of sum 2^10, packed as code 16^k + word, and (sum + 1) 2^10, zero exactly
        // when the sum is undecided (low 22 bits all ones), into the least of the block's. Codes of 8
        // (above six) become 7 once per word (fp4_stochastic_anchored_saturate). The saturation count
        // adds fp32 flags (fast_encode::fp4_saturated: one fma on the fp32 pipes). Blocks outside the
        // anchor's exponents (-127..23) or the flags' (-105..102), or with a magnitude of 8 2^e or
        // more (no scale rule gives one), go to fused_block_again instead, as undecided blocks do.
        // For bf16 without rotation, a block whose least magnitude is at least 2^(e - 16) needs no
        // undecided check: there every element below one is m 2^(k - 7) with k >= e - 16, so
        // F 2^32 = m 2^(k - e + 26) has no bits below 2^10 and the carry of the sum alone decides;
        // from one on F 2^22 is an integer anyway. A block with a zero takes the check (its least
        // magnitude is 0). Folded H16 likewise where the least input's exponent field is at least
        // e + 113: v (4x the rotation) is then a multiple of 2^(field - 134) >= 2^(e + 2 - 23).
        // ptxas turns the multiply-adds by constant powers of two into LEA / LEA.HI (integer
        // pipe); keeping them on IMAD (constants it cannot see) was measured slower: the
        // multiply-add pipe's IMAD.WIDE (Philox) fill it first.
        if (!fast_encode::fp4_stochastic_anchored_covers(exponent + folded) ||
            !fast_encode::fp4_saturation_flag_covers(exponent + folded) ||
            largest >= core_ns::float_bits(fast_encode::power_of_two(exponent + 3))) {
          counts[counter_nonzero] -= nonzero;
          return false;
        }
        const fast_encode::fp4_saturation_flag flag = fast_encode::fp4_saturation_flag_constants(exponent + folded);
        const float anchor = fast_encode::fp4_stochastic_anchor(exponent + folded);
        std::uint32_t margin = 0xffffffffU;
        float saturated = 0.0f;
        if ((Rotation == 0 && sizeof(Input) == 2 &&
             smallest >= core_ns::float_bits(fast_encode::power_of_two(exponent - 16))) ||
            (folded > 0 && least_input >= static_cast<std::uint32_t>(exponent + 113) << 7)) {
          encode_anchored_block<false, false>(v, g, plan, keys, anchor, flag, words, margin, saturated);
        } else {
          encode_anchored_block<true, false>(v, g, plan, keys, anchor, flag, words, margin, saturated);
        }
        if (margin == 0) {  // take back what this block counted
          counts[counter_nonzero] -= nonzero;
          return false;
        }
        counts[counter_saturated] += static_cast<unsigned>(saturated);
        if constexpr (folded > 0) {
          (void)finish_anchored_codes(words, v);  // the 8s made 7s and the signs in (the count comes later)
        } else {
#pragma unroll
          for (int j = 0; j < fused_block / 8; ++j) words[j] = fast_encode::fp4_stochastic_anchored_saturate(words[j]);
        }
        word_offset = 0;
      } else if constexpr (Encoder == fused_encoder::fp4_stochastic) {
        for_each_random_word(g, plan, keys, [&](int i, std::uint32_t word) {
          const float magnitude = fabsf(v[i]);
          words[i / 8] += fast_encode::fp4_stochastic_unscaled_biased(fminf(magnitude, grid.six), word, grid)
                          << (4 * (i % 8));
          count_above(counts[counter_saturated], magnitude, grid.six);
        });
      } else {
#pragma unroll
        for (int i = 0; i < fused_block; ++i) {
          const float magnitude = fabsf(v[i]);
          words[i / 8] += fast_encode::fp4_nearest_even_unscaled_biased(fminf(magnitude, grid.six), grid)
                          << (4 * (i % 8));
          count_above(counts[counter_saturated], magnitude, grid.six);
        }
      }
#pragma unroll
      for (int j = 0; j < fused_block / 8; ++j) words[j] += word_offset;
      // (folded sr: finish_anchored_codes put the signs in)
      if constexpr (!(folded > 0 && Encoder == fused_encoder::fp4_stochastic && Summed)) {
#pragma unroll
        for (int j = 0; j < fused_block / 8; ++j) {
          if constexpr (Rotation == 0 && sizeof(Input) == 2) {
            words[j] |= nibble_signs_bf16(mine[j]);
          } else {
            words[j] |= nibble_signs(v + 8 * j);
          }
        }
      }
    } else if constexpr (fp4) {
      const float inverse = fast_encode::power_of_two(-(exponent + folded));
#pragma unroll
      for (int q = 0; q < fused_block / 4; ++q) {
        core_ns::philox_block random{};
        if (Encoder != fused_encoder::fp4_nearest_even && stochastic)
          random = plan.stream.block(static_cast<std::uint64_t>(g) * (fused_block / 4) + q, keys);
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const int i = 4 * q + w;
          // v 2^-e keeps v's sign (the magnitude rounds as |v| 2^-e would): v is dead after this.
          const float scaled = v[i] * inverse;
          const float magnitude = fabsf(scaled);
          std::uint32_t code = 0;
          if constexpr (Encoder == fused_encoder::fp4_nearest_even) {
            code = fast_encode::fp4_nearest_even(magnitude);
          } else {
            const fast_encode::fp4_position position = fast_encode::fp4_locate(magnitude);
            code = fast_encode::fp4_round(position, fast_encode::fp4_round_addend(plan.rounding, position.floor_code,
                                                                                  random.word[w], random_mask));
          }
          count_above(counts[counter_saturated], magnitude, 6.0f);
          code |= (core_ns::float_bits(scaled) >> 31) << 3;
          words[i / 8] |= code << (4 * (i % 8));
        }
      }
    }
    if constexpr (fp4) {
      // Flushed: nonzero inputs with a zero code = nonzero inputs - nonzero codes.
      counts[counter_flushed] += nonzero - nonzero_fp4_magnitudes(words);
      if (output.dequantized != nullptr) {
        float decoded[fused_block];
#pragma unroll
        for (int i = 0; i < fused_block; ++i)
          decoded[i] = fast_encode::dequantize(constants, (words[i / 8] >> (4 * (i % 8))) & 0xFU, exponent);
        store_dequantized(output.dequantized + g * fused_block, decoded);
      }
    } else {
#pragma unroll
      for (int q = 0; q < fused_block / 4; ++q) {
        core_ns::philox_block random{};
        if (stochastic) random = plan.stream.block(static_cast<std::uint64_t>(g) * (fused_block / 4) + q, keys);
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const int i = 4 * q + w;
          element_result result;
          if (fast) {
            result.encoded =
                fast_encode::quantize_finite(constants, v[i], exponent, plan.rounding, random.word[w], plan.sr_bits);
            result.dequantized = fast_encode::dequantize(constants, result.encoded.code, exponent);
          } else {
            result = quantize_one<-1>(kind, v[i], exponent, plan.rounding, random.word[w], plan.sr_bits);
          }
          counts[counter_flushed] += result.encoded.flushed ? 1U : 0U;
          counts[counter_saturated] += result.encoded.saturated ? 1U : 0U;
          if (packed) {
            words[i / 8] |= static_cast<std::uint32_t>(result.encoded.code & 0x0FU) << (4 * (i % 8));
          } else {
            words[i / 4] |= static_cast<std::uint32_t>(result.encoded.code) << (8 * (i % 4));
          }
          v[i] = result.dequantized;
        }
      }
      if (output.dequantized != nullptr) store_dequantized(output.dequantized + g * fused_block, v);
    }
  }
  uint4* codes = reinterpret_cast<uint4*>(output.codes + g * (packed ? fused_block / 2 : fused_block));
  codes[0] = make_uint4(words[0], words[1], words[2], words[3]);
  if (!packed) codes[1] = make_uint4(words[4], words[5], words[6], words[7]);
  return true;
}

struct fused_counts {
  unsigned values[mx_counter_count];
};

template <class Input, int Rotation, fused_encoder Encoder>
__device__ __noinline__ fused_counts fused_block_again(const Input* input, std::int64_t g, std::int64_t blocks_per_row,
                                                       mx_plan plan, core_ns::philox_keys keys, const float* signs,
                                                       mx_device_output output) {
  fused_counts out{{0, 0, 0, 0}};
  encode_fused_block<Input, Rotation, Encoder, false>(input, nullptr, g, blocks_per_row, plan, keys, signs, output,
                                                      out.values);
  return out;
}

template <class Input, int Rotation, fused_encoder Encoder>
__global__ void MXSCOPE_FUSED_BOUNDS((fused_blocks_per_multiprocessor<Input, Rotation, Encoder>))
    mx_fused_kernel(const Input* input, std::int64_t rows, std::int64_t cols, mx_plan plan,
                    core_ns::philox_keys keys, const float* signs, mx_device_output output) {
  const std::int64_t blocks_per_row = cols / fused_block;
  const std::int64_t blocks = rows * blocks_per_row;
  unsigned counts[mx_counter_count] = {0, 0, 0, 0};
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * threads_per_block;
  if constexpr (Encoder == fused_encoder::fp4_stochastic && sizeof(Input) == 2) {
    // sr on bf16: the next block's input is read while this one is encoded (the encoder's work is long
    // enough to cover the load; without it, the first use of the input was the kernel's largest stall).
    constexpr int pieces = fused_block * static_cast<int>(sizeof(Input)) / 16;
    const uint4* source = reinterpret_cast<const uint4*>(input);
    std::int64_t g = static_cast<std::int64_t>(blockIdx.x) * threads_per_block + threadIdx.x;
    uint4 next[pieces];
#pragma unroll
    for (int j = 0; j < pieces; ++j) next[j] = g < blocks ? source[g * pieces + j] : uint4{};
    const auto encode_all = [&](auto lean) {
      for (; g < blocks; g += stride) {
        bool encoded = false;
        if constexpr (Rotation > 0) {
          // Rotated blocks refill `next` inside encode_fused_block, right after reading it: no copies
          // and no second buffer (the last block reads itself again).
          encoded = encode_fused_block<Input, Rotation, Encoder, true, decltype(lean)::value>(
              input, next, g, blocks_per_row, plan, keys, signs, output, counts, next,
              g + stride < blocks ? g + stride : g);
        } else {
          uint4 mine[pieces];
  #pragma unroll
          for (int j = 0; j < pieces; ++j) mine[j] = next[j];
          if (g + stride < blocks) {
  #pragma unroll
            for (int j = 0; j < pieces; ++j) next[j] = source[(g + stride) * pieces + j];
          }
          encoded = encode_fused_block<Input, Rotation, Encoder, true>(input, mine, g, blocks_per_row, plan, keys,
                                                                       signs, output, counts);
        }
        if (!encoded) {
          const fused_counts again =
              fused_block_again<Input, Rotation, Encoder>(input, g, blocks_per_row, plan, keys, signs, output);
  #pragma unroll
          for (int k = 0; k < mx_counter_count; ++k) counts[k] += again.values[k];
        }
      }
    };
    // The lean path (folded H16 only) where the plan and the request allow it, else the general one.
    if constexpr (Rotation == 16) {
      if (plan.rule == core_ns::scale_rule::floor && signs == nullptr && output.dequantized == nullptr) {
        encode_all(std::true_type{});
      } else {
        encode_all(std::false_type{});
      }
    } else {
      encode_all(std::false_type{});
    }
  } else {
    for (std::int64_t g = static_cast<std::int64_t>(blockIdx.x) * threads_per_block + threadIdx.x; g < blocks;
         g += stride) {
      if constexpr (Encoder == fused_encoder::fp4_stochastic) {
        if (!encode_fused_block<Input, Rotation, Encoder, true>(input, nullptr, g, blocks_per_row, plan, keys, signs,
                                                               output, counts)) {
          const fused_counts again =
              fused_block_again<Input, Rotation, Encoder>(input, g, blocks_per_row, plan, keys, signs, output);
#pragma unroll
          for (int k = 0; k < mx_counter_count; ++k) counts[k] += again.values[k];
        }
      } else {
        encode_fused_block<Input, Rotation, Encoder, false>(input, nullptr, g, blocks_per_row, plan, keys, signs,
                                                            output, counts);
      }
    }
  }
  if (output.counters != nullptr) {
    const unsigned long long wide[mx_counter_count] = {counts[0], counts[1], counts[2], counts[3]};
    add_counters(output.counters, wide);
  }
}

// Four waves of resident thread blocks (at most one block per threads_per_block MX blocks), each
// looping over MX blocks: a block ends with its counters' reduction and atomics, which a grid of
// one thread per MX block repeated tens of thousands of times on a large tensor. Four waves were
// faster than one and than one block per 256 MX blocks (measured with the earlier shared-memory
// staging, bf16 -> MXFP4 rne on the H200: 0.207 ms against 0.227 and 0.215 ms).
template <class Input, int Rotation, fused_encoder Encoder>
void launch_fused_encoder(const Input* input, std::int64_t rows, std::int64_t cols, const mx_plan& plan,
                          const float* signs, const mx_device_output& output) {
  const unsigned tiles = grid_for(rows * (cols / fused_block));  // threads_per_block MX blocks each
  const unsigned waves = 4U * static_cast<unsigned>(multiprocessor_count()) *
                         static_cast<unsigned>(fused_blocks_per_multiprocessor<Input, Rotation, Encoder>);
  // The Philox round keys go in as a parameter: the rounds read them as constant operands.
  runtime::launch(mx_fused_kernel<Input, Rotation, Encoder>, std::min(tiles, waves), threads_per_block, 0, input, rows,
                  cols, plan, plan.stream.round_keys(), signs, output);
}

template <class Input, int Rotation>
void launch_fused_for_kind(const Input* input, std::int64_t rows, std::int64_t cols, const mx_plan& plan,
                           const float* signs, const mx_device_output& output) {
  if (plan.element != element_kind::fp4_e2m1) {
    launch_fused_encoder<Input, Rotation, fused_encoder::any_format>(input, rows, cols, plan, signs, output);
  } else if (plan.rounding == core_ns::rounding_mode::rne) {
    launch_fused_encoder<Input, Rotation, fused_encoder::fp4_nearest_even>(input, rows, cols, plan, signs, output);
  } else if (plan.rounding == core_ns::rounding_mode::sr && plan.sr_bits == 32) {
    launch_fused_encoder<Input, Rotation, fused_encoder::fp4_stochastic>(input, rows, cols, plan, signs, output);
  } else {
    launch_fused_encoder<Input, Rotation, fused_encoder::fp4_by_carry>(input, rows, cols, plan, signs, output);
  }
}

template <class Input>
void launch_fused(const Input* input, std::int64_t rows, std::int64_t cols, const mx_plan& plan, int rotation,
                  const float* signs, const mx_device_output& output) {
  switch (rotation) {
    case 0:
      launch_fused_for_kind<Input, 0>(input, rows, cols, plan, nullptr, output);
      break;
    case 16:
      launch_fused_for_kind<Input, 16>(input, rows, cols, plan, signs, output);
      break;
    case 32:
      launch_fused_for_kind<Input, 32>(input, rows, cols, plan, signs, output);
      break;
    default:
      throw gpu_error("fused quantizer: rotation size " + std::to_string(rotation) + " not compiled");
  }
}

// The two passes, or along axis 0 with `columns` the one-pass column kernel where it covers the
// format. Returns whether it wrote output.operand_bf16 (the column kernel does).
template <class Input>
bool launch_generic(const Input* input, std::int64_t rows, std::int64_t cols, const mx_plan& plan,
                    const mx_device_output& output, bool columns) {
  if (columns && column_path_covers(plan)) {
    launch_columns(input, rows, cols, plan, output, output.operand_bf16);
    return true;
  }
  const std::int64_t scale_count = mx_scale_rows(plan, rows, cols) * mx_scale_cols(plan, rows, cols);
  runtime::launch(mx_scale_kernel<Input>, grid_for(scale_count), threads_per_block, 0, input, rows, cols, plan,
                  output.scales);
  const std::int64_t code_bytes = mx_code_bytes(plan, rows, cols);
  runtime::launch(mx_element_kernel<Input>, reduction_grid(code_bytes), threads_per_block, 0, input, rows, cols, plan,
                  output.scales, output);
  return false;
}

template <class Input>
__global__ void widen_kernel(const Input* input, float* output, std::int64_t count) {
  MXSCOPE_GRID_LOOP(i, count) { output[i] = load_input(input, i); }
}

}  // namespace

bool fused_path_covers(const mx_plan& plan, const rotation_plan& rotation, std::int64_t rows, std::int64_t cols) {
  (void)rows;
  return plan.axis == 1 && plan.block == fused_block && cols % fused_block == 0 &&
         (rotation.size == 0 || rotation.size == 16 || rotation.size == 32);
}

void quantize_on_device(const void* input, input_format format, std::int64_t rows, std::int64_t cols,
                        const mx_plan& plan, const rotation_plan& rotation, const mx_device_output& output,
                        quantize_path path) {
  if (rows < 0 || cols < 0) throw input_error("gpu quantize: negative shape");
  if (output.codes == nullptr || output.scales == nullptr)
    throw input_error("gpu quantize: codes and scales are required");
  check_rotation(rotation, rows, cols, plan.axis, "gpu quantize");
  if (rows == 0 || cols == 0) return;
  // The fused path moves 16-byte vectors: every buffer must start on a 16-byte boundary (cudaMalloc
  // gives 256).
  const auto aligned = [](const void* pointer) { return reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0; };
  const bool vectors_fit =
      aligned(input) && aligned(output.codes) && (output.dequantized == nullptr || aligned(output.dequantized));
  // The bf16 operand, where the path taken did not write it.
  const auto finish = [&](bool operand_written) {
    if (output.operand_bf16 != nullptr && !operand_written) launch_mx_operand(plan, rows, cols, output);
  };
  if (path == quantize_path::native ||
      (path == quantize_path::automatic && vectors_fit &&
       native_gfx950::quantize_plan_fits(plan, rotation.size, cols) && native_gfx950::present())) {
    native_gfx950::quantize(input, format, rows, cols, plan, rotation, output);  // native_gfx950_kernels.hpp
    finish(false);
    return;
  }
  const bool fused = path != quantize_path::generic && vectors_fit && fused_path_covers(plan, rotation, rows, cols);
  if (path == quantize_path::fused && !fused) {
    throw input_error(
        "gpu quantize: the fused path needs axis 1, block 32, cols a multiple of 32, rotation 0, 16 or 32 and "
        "16-byte aligned buffers");
  }
  if (fused) {
    const device_buffer signs = make_signs(rotation, cols);
    if (format == input_format::fp32) {
      launch_fused(static_cast<const float*>(input), rows, cols, plan, rotation.size, signs.as<const float>(), output);
    } else {
      launch_fused(static_cast<const std::uint16_t*>(input), rows, cols, plan, rotation.size, signs.as<const float>(),
                   output);
    }
    finish(false);
    if (signs.get() != nullptr) release_after_kernels();  // `signs` must outlive the kernel
    return;
  }
  const bool columns = path == quantize_path::automatic;
  if (rotation.size == 0) {
    const bool written = format == input_format::fp32
                             ? launch_generic(static_cast<const float*>(input), rows, cols, plan, output, columns)
                             : launch_generic(static_cast<const std::uint16_t*>(input), rows, cols, plan, output, columns);
    finish(written);
    return;
  }
  // Rotation outside the fused path: rotate an fp32 copy, then quantize the copy.
  device_buffer rotated(static_cast<std::size_t>(rows * cols) * sizeof(float));
  if (format == input_format::fp32) {
    MXSCOPE_GPU_CHECK(runtime::copy_on_device(rotated.get(), input, rotated.bytes()));
  } else {
    runtime::launch(widen_kernel<std::uint16_t>, grid_for(rows * cols), threads_per_block, 0,
                    static_cast<const std::uint16_t*>(input), rotated.as<float>(), rows * cols);
  }
  rotate_on_device(rotated.as<float>(), rows, cols, plan.axis, rotation);
  finish(launch_generic(rotated.as<const float>(), rows, cols, plan, output, columns));
  release_after_kernels();  // `rotated` must outlive the kernels
}

// ================================================================================================
// Self-test of the fast element encoder against the core.

namespace {

struct encoder_test_counters {
  unsigned long long checked;
  unsigned long long mismatches;
  unsigned long long first_mismatch;
};

__global__ void encoder_self_test_kernel(element_kind kind, core_ns::rounding_mode mode, int sr_bits, int exponent,
                                         std::uint64_t first, std::uint64_t count, std::uint64_t stride,
                                         encoder_test_counters* counters) {
  const fast_encode::element_constants constants = fast_encode::constants_of(kind);
  unsigned long long checked = 0, mismatches = 0, first_mismatch = ~0ULL;
  MXSCOPE_GRID_LOOP(i, static_cast<std::int64_t>(count)) {
    const std::uint32_t pattern = static_cast<std::uint32_t>(first + static_cast<std::uint64_t>(i) * stride);
    if ((pattern & 0x7f800000U) == 0x7f800000U) continue;
    const float value = core_ns::bits_float(pattern);
    const std::uint32_t word = (pattern * 2654435761U) ^ (pattern >> 13) ^ 0x5bd1e995U;
    const core_ns::encoded want = core_ns::quantize_element(kind, value, exponent, mode, word, sr_bits);
    const core_ns::encoded got = fast_encode::quantize_finite(constants, value, exponent, mode, word, sr_bits);
    const float want_value = static_cast<float>(core_ns::dequantize_element(kind, want.code, exponent));
    const float got_value = fast_encode::dequantize(constants, got.code, exponent);
    // The fused kernel's fp4 sr encoders (32 bits) too, where they apply: their directed roundings
    // are the device's own instructions here. The sum's code counts where it says it decided.
    core_ns::encoded stochastic = want, summed = want;
    if (kind == element_kind::fp4_e2m1 && mode == core_ns::rounding_mode::sr && sr_bits == 32 &&
        fast_encode::fp4_stochastic_covers(exponent)) {
      stochastic = fast_encode::fp4_encode_unscaled(value, exponent, true, word);
    }
    if (kind == element_kind::fp4_e2m1 && mode == core_ns::rounding_mode::sr && sr_bits == 32 &&
        fast_encode::fp4_stochastic_anchored_covers(exponent) &&
        fabsf(value) < 8.0f * fast_encode::power_of_two(exponent)) {
      const fast_encode::sum_encoded sum = fast_encode::fp4_encode_stochastic_anchored(value, exponent, word);
      if (sum.decided) summed = sum.encoded;
    }
    ++checked;
    if (want.code != got.code || want.saturated != got.saturated || want.flushed != got.flushed ||
        core_ns::float_bits(want_value) != core_ns::float_bits(got_value) || want.code != stochastic.code ||
        want.saturated != stochastic.saturated || want.flushed != stochastic.flushed || want.code != summed.code ||
        want.saturated != summed.saturated || want.flushed != summed.flushed) {
      ++mismatches;
      if (pattern < first_mismatch) first_mismatch = pattern;
    }
  }
  if (checked != 0) atomicAdd(&counters->checked, checked);
  if (mismatches != 0) {
    atomicAdd(&counters->mismatches, mismatches);
    atomicMin(&counters->first_mismatch, first_mismatch);
  }
}

}  // namespace

encoder_self_test self_test_fast_encoder(element_kind kind, core_ns::rounding_mode mode, int sr_bits, int exponent,
                                         std::uint64_t first, std::uint64_t count, std::uint64_t stride) {
  if (!fast_encode::covers(kind)) throw input_error("self_test_fast_encoder: not a float element format");
  if (sr_bits < 1 || sr_bits > 32 || exponent < -127 || exponent > 127) {
    throw input_error("self_test_fast_encoder: sr_bits must be in 1..32 and the exponent in -127..127");
  }
  encoder_self_test out;
  if (count == 0) return out;
  device_buffer counters(sizeof(encoder_test_counters));
  const encoder_test_counters initial{0, 0, ~0ULL};
  counters.upload(&initial, sizeof(initial));
  runtime::launch(encoder_self_test_kernel, grid_for(static_cast<std::int64_t>(count)), threads_per_block, 0, kind,
                  mode, sr_bits, exponent, first, count, stride, counters.as<encoder_test_counters>());
  encoder_test_counters result{};
  counters.download(&result, sizeof(result));
  out.checked = result.checked;
  out.mismatches = result.mismatches;
  out.first_mismatch = static_cast<std::uint32_t>(result.first_mismatch);
  return out;
}

// ================================================================================================
// GEMM operands in canonical form.
//
// Canonical operand: [rows, depth] with the reduction contiguous (rows = the M or N side). Block
// scale exponents are stored block-major, [blocks][rows], so that neighbouring output entries read
// neighbouring exponents. A NaN block's exponent is nan_block_exponent (as in src/gemm.cpp).

namespace {

constexpr int nan_block_exponent = 1 << 20;

// Elements as integers: value * 2^fraction_bits, where 2^-fraction_bits is the format's subnormal
// spacing, so every finite element is an integer of magnitude <= max_normal * 2^fraction_bits.
int fraction_bits_of(element_kind kind) { return -core_ns::subnormal_ulp_exponent(kind); }
std::int64_t integer_max_of(element_kind kind) {
  return static_cast<std::int64_t>(core_ns::max_normal(kind) * core_ns::pow2(fraction_bits_of(kind)));
}
int bits_of(std::int64_t value) { return core_ns::bit_length(static_cast<core_ns::uint128>(value)); }

// Bits of the largest |integer block dot| (the CPU's fast-path bound).
int block_dot_bits(element_kind a, element_kind b, int block) {
  return bits_of(block) + bits_of(integer_max_of(a)) + bits_of(integer_max_of(b));
}

bool tensor_core_element(element_kind kind) {
  // The integer element fits a signed byte: fp4 (2q, |.| <= 12), fp6 e2m3 (8q, <= 60), int8 (64q, <= 127).
  return kind == element_kind::fp4_e2m1 || kind == element_kind::fp6_e2m3 || kind == element_kind::int8;
}

__device__ inline std::uint32_t load_code(const mx_operand_view& operand, bool packed, std::int64_t row_bytes,
                                          std::int64_t r, std::int64_t c) {
  if (packed) {
    const std::uint8_t byte = operand.codes[r * row_bytes + c / 2];
    return (c % 2 == 0) ? (byte & 0x0FU) : (byte >> 4);
  }
  return operand.codes[r * operand.cols + c];
}

// Elements of the canonical operand: decoded values (float, exact), integers (int32) and signed
// bytes padded to `stride` (a multiple of 32) for the tensor cores; each output may be null.
__global__ void prepare_elements_kernel(mx_operand_view operand, std::int64_t rows, std::int64_t depth,
                                        std::int64_t stride, int fraction_bits, float* elements, std::int32_t* integers,
                                        std::int8_t* bytes, int* nonfinite_flag) {
  const bool along_rows = operand.axis == 1;
  const bool packed = core_ns::spec(operand.element).bits == 4;
  const std::int64_t row_bytes = packed ? (operand.cols + 1) / 2 : operand.cols;
  MXSCOPE_GRID_LOOP(t, rows * stride) {
    const std::int64_t row = t / stride;
    const std::int64_t k = t % stride;
    if (k >= depth) {
      if (bytes != nullptr) bytes[t] = 0;
      continue;
    }
    const std::int64_t r = along_rows ? row : k;
    const std::int64_t c = along_rows ? k : row;
    const double value = core_ns::decode(operand.element, load_code(operand, packed, row_bytes, r, c));
    const std::int64_t at = row * depth + k;
    if (elements != nullptr) elements[at] = static_cast<float>(value);
    if (!is_finite(value)) {
      *nonfinite_flag = 1;
      if (integers != nullptr) integers[at] = 0;
      if (bytes != nullptr) bytes[t] = 0;
      continue;
    }
    const double scaled = value * core_ns::pow2(fraction_bits);  // an integer, exactly
    if (integers != nullptr) integers[at] = static_cast<std::int32_t>(scaled);
    if (bytes != nullptr) bytes[t] = static_cast<std::int8_t>(static_cast<int>(scaled));
  }
}

__global__ void prepare_exponents_kernel(mx_operand_view operand, std::int64_t rows, std::int64_t blocks,
                                         std::int32_t* exponents) {
  const bool along_rows = operand.axis == 1;
  MXSCOPE_GRID_LOOP(t, blocks * rows) {
    const std::int64_t b = t / rows;
    const std::int64_t row = t % rows;
    const std::uint8_t code = along_rows ? operand.scales[row * blocks + b] : operand.scales[b * operand.cols + row];
    exponents[t] = code == core_ns::scale_nan_code ? nan_block_exponent : core_ns::scale_exponent(code);
  }
}

// The tensor-core fp32-block kernel's view of the block exponents (tensor_core_block_kernel): per
// block and row, [blocks, padded rows], the bits of the fp32 scale 2^(e - fraction_bits) where
// -126 <= e - fraction_bits <= tc_scale_high (a normal float; 1.5 * 2^23 times it stays finite),
// and elsewhere the sign bit over the low 31 bits of e - fraction_bits (nan_block_exponent itself
// for a NaN block; tc_scale_exponent decodes both); padded rows hold 0. Per block and 128-row tile
// a flag, set where some row of the tile lies outside the range: the kernel then takes the general
// step (tensor_core_step) for the whole tile in that block.
constexpr int tc_scale_row_pad = 256;  // padded rows: a multiple of both kernel tiles (128, 256)
constexpr int tc_flag_rows = 128;
constexpr int tc_scale_low = -126;
constexpr int tc_scale_high = 100;

__global__ void prepare_tensor_core_scales_kernel(const std::int32_t* exponents, std::int64_t rows,
                                                  std::int64_t padded_rows, std::int64_t blocks, int fraction_bits,
                                                  std::uint32_t* scales, unsigned* slow_tiles) {
  MXSCOPE_GRID_LOOP(t, blocks * padded_rows) {
    const std::int64_t b = t / padded_rows;
    const std::int64_t row = t % padded_rows;
    std::uint32_t scale = 0;
    if (row < rows) {
      const std::int32_t exponent = exponents[b * rows + row];
      const std::int32_t power = exponent == nan_block_exponent ? nan_block_exponent : exponent - fraction_bits;
      if (exponent != nan_block_exponent && power >= tc_scale_low && power <= tc_scale_high) {
        scale = static_cast<std::uint32_t>(power + 127) << 23;
      } else {
        scale = 0x80000000U | (static_cast<std::uint32_t>(power) & 0x7FFFFFFFU);
        atomicMax(&slow_tiles[b * (padded_rows / tc_flag_rows) + row / tc_flag_rows], 1U);
      }
    }
    scales[t] = scale;
  }
}

// The 128-byte swizzle of the wgmma matrix descriptors, for rows of 128 bytes: 16-byte chunk c of
// row r sits at chunk c ^ (r mod 8). swizzled_chunk is its byte offset within the row.
__device__ inline int swizzled_chunk(int row, int chunk) { return (chunk ^ (row & 7)) << 4; }
__device__ inline int swizzled_offset(int row, int chunk) { return row * 128 + swizzled_chunk(row, chunk); }

// The operands of the scaled kernel (tensor_core_scaled_kernel; MXFP4 only): element (row, k) as
// the bf16 number q 2^e, i.e. the prepared byte 2q times 2^(e - 1). That is exact and normal for
// every nonzero element when -125 <= e <= 125 (|2q| <= 12 has at most two significant bits);
// blocks outside that range get zeros, and the operand then does not fit (scaled_kernel_fits).
// The layout is the kernel's shared-memory stage, so that one bulk copy moves a tile: rows padded
// to a multiple of 256 and k to a multiple of 64 (zeros), tiles of 128 rows x 64 k (16 KiB,
// row-tile major, then k), each row 128 bytes in the 128-byte swizzle (its 16-byte chunk c at
// c ^ (row mod 8)). range[0] and range[1] collect the lowest and highest exponent of a block with
// a nonzero element as maxima of 1000 - e and 1000 + e (0: no such block), range[2] whether a NaN
// block is present.
constexpr std::uint32_t scaled_range_offset = 1000;
constexpr int scaled_row_pad = 256;
constexpr int scaled_tile_rows = 128;
constexpr int scaled_tile_bytes = scaled_tile_rows * 128;

__global__ void prepare_scaled_kernel(const std::int8_t* bytes, const std::int32_t* exponents, std::int64_t rows,
                                      std::int64_t blocks, std::int64_t stride, unsigned char* scaled,
                                      unsigned* range) {
  const std::int64_t chunks = (blocks + 1) / 2;  // 64-element chunks per row
  unsigned lowest = 0, highest = 0, nan_block = 0;
  MXSCOPE_GRID_LOOP(t, rows * blocks) {
    const std::int64_t row = t / blocks;
    const std::int64_t b = t % blocks;
    const std::int32_t e = exponents[b * rows + row];
    const std::int8_t* const source = bytes + row * stride + 32 * b;
    const std::int64_t r = row % scaled_tile_rows;
    unsigned char* const tile_row =
        scaled + ((row / scaled_tile_rows) * chunks + b / 2) * scaled_tile_bytes + r * 128;
    const bool representable = e >= -125 && e <= 125;
    const float unit = core_ns::bits_float(static_cast<std::uint32_t>(representable ? e - 1 + 127 : 127) << 23);
    bool nonzero = false;
    for (int q = 0; q < 4; ++q) {  // the block's four 16-byte chunks: 4 (b mod 2) + q of the row
      std::uint32_t words[4];
      for (int w = 0; w < 4; ++w) {
        std::uint32_t pair = 0;
        for (int h = 0; h < 2; ++h) {
          const int value = source[8 * q + 2 * w + h];
          nonzero = nonzero || value != 0;
          const std::uint32_t half =
              representable ? core_ns::float_bits(__fmul_rn(static_cast<float>(value), unit)) >> 16 : 0U;
          pair |= half << (16 * h);
        }
        words[w] = pair;
      }
      const int chunk = static_cast<int>(4 * (b % 2)) + q;
      *reinterpret_cast<uint4*>(tile_row + swizzled_chunk(static_cast<int>(r), chunk)) =
          make_uint4(words[0], words[1], words[2], words[3]);
    }
    if (e == nan_block_exponent) {
      nan_block = 1;
    } else if (nonzero) {
      lowest = std::max(lowest, static_cast<unsigned>(static_cast<std::int32_t>(scaled_range_offset) - e));
      highest = std::max(highest, static_cast<unsigned>(static_cast<std::int32_t>(scaled_range_offset) + e));
    }
  }
  atomicMax(&range[0], lowest);
  atomicMax(&range[1], highest);
  atomicMax(&range[2], nan_block);
}

// The fp8 operands of the scaled kernel (tensor_core_scaled_kernel<true>; MXFP4 only). Per 128-row
// tile and K-block a base exponent b; element (row, k) is q 2^(e - b) as an fp8 e5m2 number, which
// is exact (|2q| <= 12 has at most two significant bits) while -15 <= e - b <= 13: from 0.5 2^-15,
// e5m2's least subnormal, to 6 2^13 = 49152. So b exists when the tile's blocks with a nonzero
// element span at most 28 exponents (lo .. hi): any b in [hi - 13, lo + 15]; the kernel takes the
// one nearest 0 (0 for a tile without such blocks), so that wherever scaled_kernel_fits holds the
// step's scale 2^(ba + bb) is a normal fp32 number (both bases negative: ba + bb = lo_a + lo_b + 30
// >= -94; both positive: hi_a + hi_b - 26 <= 91; else between -110 and 112). The layout is the
// kernel's stage: tiles of 128 rows x 128 k (16 KiB; four K-blocks of 32 bytes per 128-byte row,
// the same swizzle as the bf16 tiles), rows padded to 256 and k to 128; the bases as int32
// [row tiles][k tiles][4], 16 bytes per tile. fp8_tile_bases_kernel sets range[0] when some
// tile spans more than 28 exponents (or holds a NaN block), and the operand then does not fit.
constexpr int fp8_tile_k_blocks = 4;
constexpr int fp8_window = 28;

__global__ void fp8_tile_bases_kernel(const std::int8_t* bytes, const std::int32_t* exponents, std::int64_t rows,
                                      std::int64_t blocks, std::int64_t stride, std::int32_t* bases,
                                      unsigned* too_wide) {
  const std::int64_t tiles = (rows + scaled_tile_rows - 1) / scaled_tile_rows;
  const std::int64_t k_tiles = (blocks + fp8_tile_k_blocks - 1) / fp8_tile_k_blocks;
  MXSCOPE_GRID_LOOP(t, tiles * blocks) {
    const std::int64_t tile = t / blocks;
    const std::int64_t b = t % blocks;
    int lowest = 1 << 30, highest = -(1 << 30);
    bool wide = false;
    for (std::int64_t row = tile * scaled_tile_rows; row < std::min<std::int64_t>(rows, (tile + 1) * scaled_tile_rows);
         ++row) {
      const std::int32_t e = exponents[b * rows + row];
      const uint4* const source = reinterpret_cast<const uint4*>(bytes + row * stride + 32 * b);
      const uint4 x = source[0], y = source[1];
      const bool nonzero = (x.x | x.y | x.z | x.w | y.x | y.y | y.z | y.w) != 0U;
      if (e == nan_block_exponent) wide = true;
      if (!nonzero || e == nan_block_exponent) continue;
      lowest = std::min(lowest, static_cast<int>(e));
      highest = std::max(highest, static_cast<int>(e));
    }
    int base = 0;
    if (lowest <= highest) {
      wide = wide || highest - lowest > fp8_window;
      base = std::min(std::max(0, highest - 13), lowest + 15);
    }
    bases[(tile * k_tiles + b / fp8_tile_k_blocks) * 4 + b % fp8_tile_k_blocks] = base;
    if (wide) atomicMax(too_wide, 1U);
  }
}

// The e5m2 bits of an fp32 number that is an e5m2 number (magnitude zero or in [2^-16, 57344]).
__device__ inline std::uint32_t exact_e5m2_bits(float value) {
  const std::uint32_t bits = core_ns::float_bits(value);
  const std::uint32_t sign = (bits >> 24) & 0x80U;
  const std::uint32_t magnitude = bits & 0x7FFFFFFFU;
  if (magnitude == 0U) return sign;
  const int exponent = static_cast<int>(magnitude >> 23) - 127;
  if (exponent >= -14) return sign | (static_cast<std::uint32_t>(exponent + 15) << 2) | ((magnitude >> 21) & 3U);
  // A subnormal: an integer multiple of 2^-16 below 2^-14.
  return sign | static_cast<std::uint32_t>(__fmul_rn(core_ns::bits_float(magnitude), 65536.0f));
}

__global__ void prepare_fp8_kernel(const std::int8_t* bytes, const std::int32_t* exponents, const std::int32_t* bases,
                                   std::int64_t rows, std::int64_t blocks, std::int64_t stride,
                                   unsigned char* tiles) {
  const std::int64_t k_tiles = (blocks + fp8_tile_k_blocks - 1) / fp8_tile_k_blocks;
  MXSCOPE_GRID_LOOP(t, rows * blocks) {
    const std::int64_t row = t / blocks;
    const std::int64_t b = t % blocks;
    const std::int64_t tile = row / scaled_tile_rows;
    const std::int64_t r = row % scaled_tile_rows;
    const int shift =
        exponents[b * rows + row] - bases[(tile * k_tiles + b / fp8_tile_k_blocks) * 4 + b % fp8_tile_k_blocks];
    const bool inside = shift >= -15 && shift <= 13;
    const float unit = core_ns::bits_float(static_cast<std::uint32_t>(inside ? shift - 1 + 127 : 127) << 23);
    const std::int8_t* const source = bytes + row * stride + 32 * b;
    unsigned char* const tile_row = tiles + (tile * k_tiles + b / fp8_tile_k_blocks) * scaled_tile_bytes + r * 128;
    for (int q = 0; q < 2; ++q) {  // the block's two 16-byte chunks: 2 (b mod 4) + q of the row
      std::uint32_t words[4];
      for (int w = 0; w < 4; ++w) {
        std::uint32_t word = 0;
        for (int h = 0; h < 4; ++h) {
          const int value = source[16 * q + 4 * w + h];
          const std::uint32_t code = inside ? exact_e5m2_bits(__fmul_rn(static_cast<float>(value), unit)) : 0U;
          word |= code << (8 * h);
        }
        words[w] = word;
      }
      const int chunk = static_cast<int>(2 * (b % fp8_tile_k_blocks)) + q;
      *reinterpret_cast<uint4*>(tile_row + swizzled_chunk(static_cast<int>(r), chunk)) =
          make_uint4(words[0], words[1], words[2], words[3]);
    }
  }
}

}  // namespace

struct prepared_operand::storage {
  element_kind element = element_kind::fp4_e2m1;
  int block = 32;
  std::int64_t rows = 0;
  std::int64_t depth = 0;
  std::int64_t blocks = 0;
  std::int64_t byte_stride = 0;  // row stride of `bytes` (depth rounded up to 32)
  bool finite_elements = true;
  gemm_path path = gemm_path::generic;
  device_buffer elements;   // float [rows, depth] (generic)
  device_buffer integers;   // int32 [rows, depth] (integer)
  device_buffer bytes;      // int8 [rows, byte_stride] (tensor_core)
  device_buffer exponents;  // int32 [blocks, rows]
  std::int64_t padded_rows = 0;  // rows rounded up to tc_scale_row_pad (tensor_core)
  device_buffer scales;      // uint32 [blocks, padded_rows] (tensor_core; prepare_tensor_core_scales_kernel)
  device_buffer slow_tiles;  // unsigned [blocks, padded_rows / 128] (tensor_core)
  device_buffer scale_codes;  // uint8 e8m0 [padded rows, byte_stride / 16] (native_mfma; `bytes` holds fp4 codes)
  // The scaled kernel's bf16 operand (tensor_core, MXFP4, where that kernel exists) and the lowest
  // and highest block exponent over the blocks with a nonzero element (1000 and -1000: none).
  device_buffer scaled;  // bf16 in tiles (prepare_scaled_kernel)
  int scaled_lowest = 1000;
  int scaled_highest = -1000;
  bool scaled_nan = false;
  // The fp8 form (prepare_fp8_kernel), made with the bf16 one; fp8_fits: no tile spans more than
  // fp8_window exponents.
  device_buffer fp8;        // e5m2 in tiles
  device_buffer fp8_bases;  // int32 [row tiles][k tiles][4]
  bool fp8_fits = false;
};

prepared_operand::prepared_operand() : storage_(std::make_unique<storage>()) {}
prepared_operand::~prepared_operand() = default;
prepared_operand::prepared_operand(prepared_operand&&) noexcept = default;
prepared_operand& prepared_operand::operator=(prepared_operand&&) noexcept = default;
std::int64_t prepared_operand::rows() const { return storage_->rows; }
std::int64_t prepared_operand::depth() const { return storage_->depth; }

std::string_view gemm_path_name(gemm_path path) {
  switch (path) {
    case gemm_path::automatic:
      return "automatic";
    case gemm_path::generic:
      return "generic";
    case gemm_path::integer:
      return "integer";
    case gemm_path::tensor_core:
      return "tensor_core";
    case gemm_path::native_mfma:
      return "native_mfma";
  }
  return "?";
}

namespace {

constexpr int integer_max_group = 64;

bool integer_element(element_kind kind) {
  return kind != element_kind::e8m0 && kind != element_kind::ue4m3 && integer_max_of(kind) < (std::int64_t{1} << 31);
}

bool tensor_cores_present() {
#if defined(MXSCOPE_GPU_SIMULATE)
  return true;
#elif defined(MXSCOPE_CUDA_TENSOR_CORES)
  static const bool present = [] {
    const auto properties = current_device_properties();
    return properties && properties->major >= 8;
  }();
  return present;
#else
  return false;
#endif
}

bool wgmma_present();  // below, next to the kernels

std::atomic<tensor_core_kernel> chosen_tensor_core_kernel{tensor_core_kernel::automatic};
std::atomic<tensor_core_kernel> last_run_tensor_core_kernel{tensor_core_kernel::automatic};

}  // namespace

std::string_view tensor_core_kernel_name(tensor_core_kernel kernel) {
  switch (kernel) {
    case tensor_core_kernel::automatic:
      return "automatic";
    case tensor_core_kernel::mma_sync:
      return "mma_sync";
    case tensor_core_kernel::wgmma:
      return "wgmma";
    case tensor_core_kernel::wgmma_bf16:
      return "wgmma_bf16";
    case tensor_core_kernel::wgmma_fp8:
      return "wgmma_fp8";
  }
  return "?";
}

bool tensor_core_kernel_available(tensor_core_kernel kernel) {
  switch (kernel) {
    case tensor_core_kernel::automatic:
    case tensor_core_kernel::mma_sync:
      return tensor_cores_present();
    case tensor_core_kernel::wgmma:
    case tensor_core_kernel::wgmma_bf16:
    case tensor_core_kernel::wgmma_fp8:
      return wgmma_present();
  }
  return false;
}

void select_tensor_core_kernel(tensor_core_kernel kernel) {
  if (!tensor_core_kernel_available(kernel)) {
    throw input_error("gpu gemm: the tensor-core kernel " + std::string(tensor_core_kernel_name(kernel)) +
                      " is not available in this build on this device");
  }
  chosen_tensor_core_kernel.store(kernel);
}

tensor_core_kernel selected_tensor_core_kernel() {
  const tensor_core_kernel kernel = chosen_tensor_core_kernel.load();
  if (kernel != tensor_core_kernel::automatic) return kernel;
  // The fastest on the H200 (BENCHMARKS.md).
  return wgmma_present() ? tensor_core_kernel::wgmma_fp8 : tensor_core_kernel::mma_sync;
}

tensor_core_kernel last_tensor_core_kernel() { return last_run_tensor_core_kernel.load(); }

bool gemm_path_covers(gemm_path path, element_kind a, element_kind b, int block, const accumulation_model& model) {
  const auto kind = model.kind;
  switch (path) {
    case gemm_path::automatic:
      return gemm_path_covers(gemm_path::generic, a, b, block, model);
    case gemm_path::generic:
      return kind == accumulation_kind::exact || kind == accumulation_kind::fp32_block ||
             kind == accumulation_kind::fp32_group || kind == accumulation_kind::fp32_seq;
    case gemm_path::integer:
      if (kind != accumulation_kind::exact && kind != accumulation_kind::fp32_block &&
          kind != accumulation_kind::fp32_group) {
        return false;
      }
      if (kind == accumulation_kind::fp32_group && model.blocks_per_group > integer_max_group) return false;
      return integer_element(a) && integer_element(b) && block_dot_bits(a, b, block) <= 53;
    case gemm_path::tensor_core:
      return tensor_cores_present() && (kind == accumulation_kind::fp32_block || kind == accumulation_kind::exact) &&
             block == 32 && tensor_core_element(a) && tensor_core_element(b);
    case gemm_path::native_mfma:
      return native_gfx950::gemm_fits(a, b, block, model) && native_gfx950::present();
  }
  return false;
}

gemm_path resolve_gemm_path(const mx_operand_view& a, const mx_operand_view& b, const accumulation_model& model) {
  for (const gemm_path path :
       {gemm_path::native_mfma, gemm_path::tensor_core, gemm_path::integer, gemm_path::generic}) {
    if (gemm_path_covers(path, a.element, b.element, a.block, model)) return path;
  }
  return gemm_path::generic;
}

prepared_operand prepare_operand(const mx_operand_view& operand, gemm_path path) {
  if (path == gemm_path::automatic) {
    throw input_error("gpu gemm: prepare_operand needs a concrete path (resolve_gemm_path gives one)");
  }
  if (operand.axis != 0 && operand.axis != 1) throw input_error("gpu gemm: field 'axis' must be 0 or 1");
  if (operand.block < 1) throw input_error("gpu gemm: field 'block' must be positive");
  if (path == gemm_path::integer && !integer_element(operand.element)) {
    throw input_error("gpu gemm: the integer path does not cover this element format");
  }
  if (path == gemm_path::tensor_core && (!tensor_core_element(operand.element) || operand.block != 32)) {
    throw input_error("gpu gemm: the tensor-core path needs block 32 and fp4, fp6 e2m3 or int8 elements");
  }
  if (path == gemm_path::native_mfma && (operand.element != element_kind::fp4_e2m1 || operand.block != 32)) {
    throw input_error("gpu gemm: the native_mfma path needs block 32 and fp4 elements");
  }
  prepared_operand out;
  auto& s = out.data();
  s.element = operand.element;
  s.block = operand.block;
  s.path = path;
  s.rows = operand.axis == 1 ? operand.rows : operand.cols;
  s.depth = operand.axis == 1 ? operand.cols : operand.rows;
  s.blocks = (s.depth + operand.block - 1) / operand.block;
  s.byte_stride = (s.depth + 31) / 32 * 32;
  if (path == gemm_path::native_mfma) {
    native_gfx950::prepare(operand, s);  // native_gfx950_kernels.hpp
    return out;
  }
  const std::int64_t count = s.rows * s.depth;
  float* elements = nullptr;
  std::int32_t* integers = nullptr;
  std::int8_t* bytes = nullptr;
  if (path == gemm_path::generic) {
    s.elements = device_buffer(static_cast<std::size_t>(count) * sizeof(float));
    elements = s.elements.as<float>();
  } else if (path == gemm_path::integer) {
    s.integers = device_buffer(static_cast<std::size_t>(count) * sizeof(std::int32_t));
    integers = s.integers.as<std::int32_t>();
  } else {
    s.bytes = device_buffer(static_cast<std::size_t>(s.rows * s.byte_stride));
    bytes = s.bytes.as<std::int8_t>();
  }
  s.exponents = device_buffer(static_cast<std::size_t>(s.blocks * s.rows) * sizeof(std::int32_t));
  // The nonfinite-element flag, prepare_scaled_kernel's range and fp8_tile_bases_kernel's flag: one
  // download for all.
  device_buffer flag(5 * sizeof(unsigned));
  flag.fill_bytes(0);
  const std::int64_t stride = path == gemm_path::tensor_core ? s.byte_stride : s.depth;
  if (s.rows > 0 && stride > 0) {
    runtime::launch(prepare_elements_kernel, grid_for(s.rows * stride), threads_per_block, 0, operand, s.rows, s.depth,
                    stride, fraction_bits_of(operand.element), elements, integers, bytes, flag.as<int>());
  }
  if (s.rows > 0 && s.blocks > 0) {
    runtime::launch(prepare_exponents_kernel, grid_for(s.blocks * s.rows), threads_per_block, 0, operand, s.rows,
                    s.blocks, s.exponents.as<std::int32_t>());
  }
  if (path == gemm_path::tensor_core && s.rows > 0 && s.blocks > 0) {
    s.padded_rows = (s.rows + tc_scale_row_pad - 1) / tc_scale_row_pad * tc_scale_row_pad;
    s.scales = device_buffer(static_cast<std::size_t>(s.blocks * s.padded_rows) * sizeof(std::uint32_t));
    s.slow_tiles =
        device_buffer(static_cast<std::size_t>(s.blocks * (s.padded_rows / tc_flag_rows)) * sizeof(unsigned));
    s.slow_tiles.fill_bytes(0);
    runtime::launch(prepare_tensor_core_scales_kernel, grid_for(s.blocks * s.padded_rows), threads_per_block, 0,
                    s.exponents.as<const std::int32_t>(), s.rows, s.padded_rows, s.blocks,
                    fraction_bits_of(operand.element), s.scales.as<std::uint32_t>(), s.slow_tiles.as<unsigned>());
  }
#if defined(MXSCOPE_GPU_SIMULATE)
  constexpr bool scaled_kernels = true;  // no wgmma here, but the forms are made for tests to check
#else
  const bool scaled_kernels = wgmma_present();
#endif
  const bool scaled = path == gemm_path::tensor_core && s.element == element_kind::fp4_e2m1 && scaled_kernels &&
                      s.rows > 0 && s.blocks > 0;
  if (scaled) {
    // The bf16 form (rows of 64 k per tile), then the fp8 form (128 k) with its bases.
    const std::int64_t padded = (s.rows + scaled_row_pad - 1) / scaled_row_pad * scaled_row_pad;
    s.scaled = device_buffer(static_cast<std::size_t>(padded / scaled_tile_rows * ((s.blocks + 1) / 2)) *
                             scaled_tile_bytes);
    s.scaled.fill_bytes(0);
    runtime::launch(prepare_scaled_kernel, reduction_grid(s.rows * s.blocks), threads_per_block, 0,
                    s.bytes.as<const std::int8_t>(), s.exponents.as<const std::int32_t>(), s.rows, s.blocks,
                    s.byte_stride, s.scaled.as<unsigned char>(), flag.as<unsigned>() + 1);
    const std::int64_t k_tiles = (s.blocks + fp8_tile_k_blocks - 1) / fp8_tile_k_blocks;
    s.fp8 = device_buffer(static_cast<std::size_t>(padded / scaled_tile_rows * k_tiles) * scaled_tile_bytes);
    s.fp8.fill_bytes(0);
    s.fp8_bases =
        device_buffer(static_cast<std::size_t>(padded / scaled_tile_rows * k_tiles) * 4 * sizeof(std::int32_t));
    s.fp8_bases.fill_bytes(0);
    const std::int64_t tiles = (s.rows + scaled_tile_rows - 1) / scaled_tile_rows;
    runtime::launch(fp8_tile_bases_kernel, grid_for(tiles * s.blocks), threads_per_block, 0,
                    s.bytes.as<const std::int8_t>(), s.exponents.as<const std::int32_t>(), s.rows, s.blocks,
                    s.byte_stride, s.fp8_bases.as<std::int32_t>(), flag.as<unsigned>() + 4);
    runtime::launch(prepare_fp8_kernel, grid_for(s.rows * s.blocks), threads_per_block, 0,
                    s.bytes.as<const std::int8_t>(), s.exponents.as<const std::int32_t>(),
                    s.fp8_bases.as<const std::int32_t>(), s.rows, s.blocks, s.byte_stride, s.fp8.as<unsigned char>());
  }
  unsigned flags[5] = {};
  flag.download(flags, sizeof(flags));  // synchronizes
  s.finite_elements = flags[0] == 0;
  if (scaled) {
    s.scaled_lowest = flags[1] == 0 ? 1000 : static_cast<int>(scaled_range_offset) - static_cast<int>(flags[1]);
    s.scaled_highest = flags[2] == 0 ? -1000 : static_cast<int>(flags[2]) - static_cast<int>(scaled_range_offset);
    s.scaled_nan = flags[3] != 0;
    s.fp8_fits = flags[4] == 0;
  }
  return out;
}

scaled_operand_forms scaled_forms(const prepared_operand& operand) {
  const auto& s = operand.data();
  scaled_operand_forms forms;
  if (s.scaled.bytes() == 0) return forms;
  forms.made = true;
  forms.bf16.resize(s.scaled.bytes() / sizeof(std::uint16_t));
  s.scaled.download(forms.bf16.data(), s.scaled.bytes());
  forms.fp8.resize(s.fp8.bytes());
  s.fp8.download(forms.fp8.data(), s.fp8.bytes());
  forms.fp8_bases.resize(s.fp8_bases.bytes() / sizeof(std::int32_t));
  s.fp8_bases.download(forms.fp8_bases.data(), s.fp8_bases.bytes());
  forms.lowest = s.scaled_lowest;
  forms.highest = s.scaled_highest;
  forms.nan_block = s.scaled_nan;
  forms.fp8_fits = s.fp8_fits;
  return forms;
}

// ================================================================================================
// Emulated products (NUMERICS.md section 7), mirroring src/gemm.cpp.

namespace {

// Out-of-line wrappers of the long rounding routines: one copy of each in the binary instead of one
// per call site (compile time; the calls are rare next to the arithmetic around them).
__device__ __noinline__ float round_total_to_float(const core_ns::long_accumulator& total) {
  return total.round_to_float();
}
__device__ __noinline__ double round_total_to_double(const core_ns::long_accumulator& total) {
  return total.round_to_double();
}
__device__ __noinline__ float add_group_to_float(float accumulator, const double* terms, int count) {
  return core_ns::add_exactly_to_float(accumulator, terms, count);
}
__device__ __noinline__ float add_value_to_float(float accumulator, double value) {
  return core_ns::add_to_float(accumulator, value);
}

// fl32(accumulator + value) for an exact double value (src/gemm.cpp add_exact_value).
__device__ inline float nonfinite_step(float accumulator, double nonfinite_sum) {
  return static_cast<float>(static_cast<double>(accumulator) + nonfinite_sum);
}

__device__ inline float add_exact_value(float accumulator, double value) {
  if (!is_finite(accumulator) || !is_finite(value)) return nonfinite_step(accumulator, value);
  return add_value_to_float(accumulator, value + 0.0);  // +0.0: an exactly zero sum is +0
}

__device__ inline float round_output(float value, output_rounding output) {
  if (output == output_rounding::fp32) return value;
  return core_ns::bf16_to_float(core_ns::float_to_bf16(value, core_ns::rounding_mode::rne));
}

__device__ inline float finish_output(float value, output_rounding output) {
  return canonical(round_output(canonical(value), output));
}

__device__ inline double block_scale(std::int32_t exponent) {
  return exponent == nan_block_exponent ? canonical_nan_double() : core_ns::pow2(exponent);
}

// The scaled block dot c = D * 2^(ea + eb - fraction_total), exact in a double (|D| < 2^53), or NaN
// for a NaN block (src/gemm.cpp scaled_block_dot with unit mantissas).
__device__ inline double scaled_block_dot(double dot, std::int32_t exponent_a, std::int32_t exponent_b,
                                          int fraction_total) {
  if (exponent_a == nan_block_exponent || exponent_b == nan_block_exponent) return canonical_nan_double();
  return (dot + 0.0) * 1.0 * core_ns::pow2(exponent_a + exponent_b - fraction_total);
}

// -------------------------------------------------------------------------------------------
// Generic path: one thread per entry, the definition of src/gemm.cpp generic_entry. Products of
// block-scaled elements are exact doubles; each group's exact sum (with the accumulator) is
// rounded once through a long accumulator, which equals core::add_exactly_to_float (both round
// the exact sum once to nearest-even binary32).

enum class generic_mode : int { grouped = 0, exact = 1, sequential = 2 };

// Unscaled operands (fp32 / bf16 values): the per-row exponent ranges that decide which entries the
// tiled kernel of the next section computes (plain_fits); the per-product kernels skip those.
// Operands with block scales pass none (null pointers): every entry is computed.
struct plain_rows_view {
  const std::int32_t* low = nullptr;   // [rows] lowest set-bit exponent of the row's values
  const std::int32_t* high = nullptr;  // [rows] largest leading exponent (or a marker, see below)
};

// Markers of plain_rows_view::high: a row without nonzero values, a row holding inf or NaN.
constexpr std::int32_t plain_empty_high = -4096;
constexpr std::int32_t plain_nonfinite_high = 1 << 20;
// An entry's exact sum is held as a 128-bit integer (the next section): it needs this many bits.
constexpr int plain_window_bits = 126;

__device__ inline bool plain_fits(std::int32_t low_a, std::int32_t high_a, std::int32_t low_b, std::int32_t high_b,
                                  int depth_bits) {
  return high_a + high_b + 2 + depth_bits - (low_a + low_b) <= plain_window_bits;
}

template <generic_mode Mode>
__global__ void generic_product_kernel(const float* a_elements, const std::int32_t* a_exponents,
                                       const float* b_elements, const std::int32_t* b_exponents, std::int64_t m,
                                       std::int64_t n, std::int64_t depth, int block, int blocks_per_group,
                                       output_rounding output, float* out, double* exact_out, plain_rows_view a_plain,
                                       plain_rows_view b_plain, int depth_bits) {
  MXSCOPE_GRID_LOOP(entry, m * n) {
    const std::int64_t i = entry / n;
    const std::int64_t j = entry % n;
    if (a_plain.low != nullptr &&
        plain_fits(a_plain.low[i], a_plain.high[i], b_plain.low[j], b_plain.high[j], depth_bits)) {
      continue;  // computed by plain_tile_kernel
    }
    const float* a_row = a_elements + i * depth;
    const float* b_row = b_elements + j * depth;
    const auto scaled_a = [&](std::int64_t k) {
      return static_cast<double>(a_row[k]) * block_scale(a_exponents[(k / block) * m + i]);
    };
    const auto scaled_b = [&](std::int64_t k) {
      return static_cast<double>(b_row[k]) * block_scale(b_exponents[(k / block) * n + j]);
    };
    if constexpr (Mode == generic_mode::sequential) {
      // fp32-seq: the fp32 dequantized values, one fused multiply-add per product in ascending K.
      float accumulator = 0.0f;
      for (std::int64_t k = 0; k < depth; ++k) {
        const float a = static_cast<float>(scaled_a(k));
        const float b = static_cast<float>(scaled_b(k));
        accumulator = __fmaf_rn(a, b, accumulator);
      }
      out[entry] = finish_output(accumulator, output);
    } else if constexpr (Mode == generic_mode::exact) {
      core_ns::long_accumulator total;
      double nonfinite_sum = 0.0;
      bool nonfinite = false;
      for (std::int64_t k = 0; k < depth; ++k) {
        const double product = scaled_a(k) * scaled_b(k);
        if (!is_finite(product)) {
          nonfinite = true;
          nonfinite_sum += product;
        } else {
          total.add(product);
        }
      }
      if (nonfinite) {
        const double ieee = nonfinite_sum * 1.0;  // tensor scales are 1 for MX operands
        out[entry] = finish_output(static_cast<float>(ieee), output);
        if (exact_out != nullptr) exact_out[entry] = canonical(ieee);
      } else {
        out[entry] = finish_output(round_total_to_float(total), output);
        if (exact_out != nullptr) exact_out[entry] = round_total_to_double(total);
      }
    } else {
      const std::int64_t group_length = static_cast<std::int64_t>(block) * blocks_per_group;
      float accumulator = 0.0f;
      core_ns::long_accumulator total;
      for (std::int64_t begin = 0; begin < depth; begin += group_length) {
        const std::int64_t end = depth - begin < group_length ? depth : begin + group_length;
        const bool finite_accumulator = is_finite(accumulator);
        total.clear();
        if (finite_accumulator) total.add(static_cast<double>(accumulator));
        double nonfinite_sum = 0.0;
        bool nonfinite = false;
        for (std::int64_t k = begin; k < end; ++k) {
          const double product = scaled_a(k) * scaled_b(k);
          if (!is_finite(product)) {
            nonfinite = true;
            nonfinite_sum += product;
          } else if (finite_accumulator) {
            total.add(product);
          }
        }
        if (nonfinite || !finite_accumulator) {
          accumulator = nonfinite_step(accumulator, nonfinite_sum);
          continue;
        }
        accumulator = round_total_to_float(total);
      }
      out[entry] = finish_output(accumulator * 1.0f, output);  // epilogue: alpha = 1 for MX operands
    }
  }
}

// -------------------------------------------------------------------------------------------
// Unscaled operands (fp32 or bf16 values, every block scale 1): the exact reference (section
// "Exact reference" below) and the fp32-block / fp32-group:G products, tiled, with the products
// of each K-chunk of 32 summed by plain fp64 FMAs wherever that sum is exact.
//
// Exactness. Over a chunk's nonzero finite values of one operand row, let hi be the largest
// leading exponent (|v| < 2^(hi + 1)) and lo the smallest exponent of a lowest set significand bit
// (every value is a multiple of 2^lo); spread = hi - lo. Every product of the chunk is then a
// multiple of 2^(lo_a + lo_b) below 2^(hi_a + hi_b + 2), and every partial sum of at most 32 of
// them, in any order, a multiple of 2^(lo_a + lo_b) below 2^(hi_a + hi_b + 7): an integer of at most
// spread_a + spread_b + 7 bits times a power of two between 2^-298 and 2^254. When that is at most
// 53 bits (spread_a + spread_b <= 46) every partial sum is a double, so each FMA of the chain rounds
// a representable value, i.e. not at all, and the chain's result d is the chunk's exact sum. A
// chunk of bf16 values (8 significant bits, spread 7 within one binade) passes unless its two
// operands span more than 39 binades together; fp32 values with full significands mostly fail and
// take the per-product path of their chunk.
//
// Across chunks, an entry's exact sum is a 128-bit integer in units of 2^base with base =
// lo_a + lo_b over the two whole rows: every product and chunk sum is a multiple of 2^base, and
// every partial sum is below depth * 2^(hi_a + hi_b + 2) (the rows' hi), an integer of at most
// hi_a + hi_b + 2 + bits(depth) - base bits (plain_fits: at most 126). The model steps then use
// the core's rounding functions on that exact value: add_exact_value with d for an fp32-block step
// of one chunk, core::add_exactly_to_float for a group (or a chunk that took the per-product
// path), core::round_scaled_integer for the reference. Entries whose rows do not fit, or hold inf
// or NaN, are left to the per-product kernels (generic_product_kernel, reference_kernel), which
// skip every other entry.

// The tiles of the two fp64-tensor-core kernels (plain-operand, integer path; see tile_dots).
constexpr int dot_tile = 64;   // rows of A and of B per thread block
constexpr int dot_chunk = 32;  // K per shared-memory stage

constexpr int plain_tile = dot_tile;        // entries per thread block along M and N
constexpr int plain_chunk = dot_chunk;      // K per chunk (shared-memory stage)
constexpr int plain_side = plain_tile / 16;  // entries per thread along M and N (16 x 16 threads)
// A sum of n products of values with spreads (leading minus lowest set-bit exponent) s_a and s_b
// over one pair of rows is an integer below n 2^(s_a + s_b + 2) in units of its lowest product
// bit: a double, with every partial sum, where s_a + s_b <= 51 - ceil(log2 n).
constexpr int plain_spread_budget(int products) {
  int bits = 0;
  while ((1 << bits) < products) ++bits;
  return 51 - bits;
}
constexpr int plain_chunk_budget = plain_spread_budget(plain_chunk);  // 46
constexpr std::int8_t plain_empty_spread = -128;  // a chunk without nonzero finite values
// The exact mode's super-chunks: an entry whose two rows' spreads over plain_super_chunks
// consecutive chunks fit plain_super_budget keeps its tensor-core dot across them and takes one
// 128-bit step per super-chunk instead of one per chunk.
constexpr int plain_super_chunks = 8;
constexpr int plain_super_budget = plain_spread_budget(plain_super_chunks * plain_chunk);  // 43

enum class plain_mode : int { exact = 0, block = 1, group = 2 };

__device__ inline double fma_exact(double x, double y, double z) {
#if defined(MXSCOPE_GPU_SIMULATE)
  return std::fma(x, y, z);
#elif defined(__HIP__)
  return __builtin_fma(x, y, z);
#else
  return __fma_rn(x, y, z);
#endif
}

// -------------------------------------------------------------------------------------------
// Chunk dots of a 64 x 64 tile of C on the fp64 tensor cores (mma.sync m16n8k8 f64, DMMA), shared by
// the plain-operand kernel and the integer path below. The two operand tiles of a chunk (64 rows x
// 32 k) are staged in shared memory as doubles, [row][k] with a row stride of dot_stride doubles:
// the staging writes of a warp are 32 consecutive k of one row, and the fragment reads of a warp
// (8 rows x 4 k) touch every 8-byte bank pair exactly twice (stride = 4 mod 16), both the minimum.
//
// Thread layout: 8 warps as 2 (M) x 4 (N), 32 x 16 entries per warp, 4 x 4 per thread. Entry (r, c)
// of a thread is row dot_row(r) = 32 (warp / 4) + 8 r + lane / 4 and column dot_col(c) = 16 (warp % 4)
// + 8 (c / 2) + 2 (lane % 4) + c % 2 of the tile: element 2 (r % 2) + c % 2 of the accumulator
// fragment of the mma of row pair r / 2 and column group c / 2.
//
// Exactness in any order: the callers only use a chunk dot whose every partial sum, over any
// subset of its products, is a double (the plain kernel's spread budget; the integer path's
// integers below 2^53), so each of the mma's additions is exact and the dot is the same value in
// whatever order the tensor core adds. Without DMMA (HIP) the same entries are chains of FMAs.
constexpr int dot_stride = 36;
constexpr int dot_threads = 256;
// Thread blocks per multiprocessor the register allocation of the two kernels aims at (a build
// option for measuring: 2 halves their registers, with spills).
#if defined(MXSCOPE_DOT_MIN_BLOCKS)
constexpr int dot_min_blocks = MXSCOPE_DOT_MIN_BLOCKS;
#else
constexpr int dot_min_blocks = 1;
#endif

__device__ inline int dot_row(int r) {
  return 32 * (static_cast<int>(threadIdx.x) / 128) + 8 * r + (static_cast<int>(threadIdx.x) % 32) / 4;
}
__device__ inline int dot_col(int c) {
  return 16 * ((static_cast<int>(threadIdx.x) / 32) % 4) + 8 * (c / 2) + 2 * (static_cast<int>(threadIdx.x) % 4) +
         c % 2;
}

#if defined(MXSCOPE_GPU_SIMULATE)
inline void mma_f64(double& d0, double& d1, double& d2, double& d3, const double (&a)[4], const double (&b)[2]) {
  double d[4];
  const double c[4] = {d0, d1, d2, d3};
  simulation::mma_f64(d, a, b, c);
  d0 = d[0];
  d1 = d[1];
  d2 = d[2];
  d3 = d[3];
}
#elif defined(MXSCOPE_CUDA_TENSOR_CORES)
// D = A B + D on a 16 x 8 x 8 tile (m16n8k8 f64, sm_90: twice the rate of m8n8k4, which runs at
// half the fp64 tensor-core peak on the H200; tools/bench/dmma-shapes.cu), fragment layout as
// spelled out in simulation.hpp (mma_f64).
__device__ inline void mma_f64(double& d0, double& d1, double& d2, double& d3, const double (&a)[4],
                               const double (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+d"(d0), "+d"(d1), "+d"(d2), "+d"(d3)
      : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
}
#endif

// dots[r][c] += the chunk's 32 products of row dot_row(r) of a_tile and row dot_col(c) of b_tile.
template <class Tile, class Dot>
__device__ inline void tile_dots(const Tile* a_tile, const Tile* b_tile, Dot (&dots)[4][4]) {
#if defined(MXSCOPE_CUDA_TENSOR_CORES)
  constexpr bool tensor_cores = std::is_same_v<Tile, double> && std::is_same_v<Dot, double>;
#else
  constexpr bool tensor_cores = false;
#endif
  if constexpr (tensor_cores) {
#if defined(MXSCOPE_CUDA_TENSOR_CORES)
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int warp = static_cast<int>(threadIdx.x) / 32;
    const double* a_base = a_tile + (32 * (warp / 4) + lane / 4) * dot_stride + lane % 4;
    const double* b_base = b_tile + (16 * (warp % 4) + lane / 4) * dot_stride + lane % 4;
    // Per 8 k: B fragment q holds columns 8 q + lane / 4 (entries c = 2 q, 2 q + 1 of each row);
    // the A fragment of row pair p holds rows 16 p + lane / 4 and + 8 (entries r = 2 p, 2 p + 1).
#pragma unroll
    for (int kk = 0; kk < 32; kk += 8) {
      double bv[2][2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
#pragma unroll
        for (int v = 0; v < 2; ++v) bv[q][v] = b_base[8 * q * dot_stride + kk + 4 * v];
      }
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        double av[4];
#pragma unroll
        for (int v = 0; v < 4; ++v) av[v] = a_base[8 * (2 * p + v % 2) * dot_stride + kk + 4 * (v / 2)];
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          mma_f64(dots[2 * p][2 * q], dots[2 * p][2 * q + 1], dots[2 * p + 1][2 * q], dots[2 * p + 1][2 * q + 1], av,
                  bv[q]);
        }
      }
    }
#endif
  } else {
    int rows[4], cols[4];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      rows[s] = dot_row(s) * dot_stride;
      cols[s] = dot_col(s) * dot_stride;
    }
#pragma unroll 4
    for (int kk = 0; kk < 32; ++kk) {
      Dot av[4], bv[4];
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        av[s] = static_cast<Dot>(a_tile[rows[s] + kk]);
        bv[s] = static_cast<Dot>(b_tile[cols[s] + kk]);
      }
#pragma unroll
      for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          if constexpr (std::is_same_v<Dot, double>) {
            dots[r][c] = fma_exact(av[r], bv[c], dots[r][c]);
          } else {
            dots[r][c] += av[r] * bv[c];
          }
        }
      }
    }
  }
}

// The chunk staging of both kernels: the next chunk's values are loaded into registers (value e of
// a thread: row threadIdx.x / 32 + 8 e, k threadIdx.x % 32 of the two 64-row tiles; consecutive
// threads, consecutive k: coalesced) while the tensor cores work on the current one, then stored
// into the [row][k] tiles. Values past `length` or past the last row are zeros. The addresses are
// one pointer per operand stepped by 8 rows, the bounds one count per operand, and the tile
// offsets constants from one base: the loop's own arithmetic, not per-value 64-bit index maths.
constexpr int dot_loads = dot_tile * dot_chunk / dot_threads;
constexpr int dot_load_rows = dot_threads / dot_chunk;  // rows between a thread's values (8)

template <class T>
struct dot_chunk_values {
  T a[dot_loads];
  T b[dot_loads];

  // Rows i0.. of a [m, depth] and j0.. of b [n, depth], columns k0 .. k0 + length - 1.
  __device__ void load(const T* a_rows, const T* b_rows, std::int64_t i0, std::int64_t j0, std::int64_t m,
                       std::int64_t n, std::int64_t depth, std::int64_t k0, std::int64_t length) {
    const int row = static_cast<int>(threadIdx.x) / dot_chunk;
    const int kk = static_cast<int>(threadIdx.x) % dot_chunk;
    // Rows of each operand at and after this thread's first one (0 outside the chunk's columns).
    const auto count = [&](std::int64_t rows_left) {
      return kk >= length || rows_left <= 0 ? 0 : rows_left >= dot_tile ? dot_tile : static_cast<int>(rows_left);
    };
    const int a_count = count(m - i0 - row);
    const int b_count = count(n - j0 - row);
    const std::int64_t step = dot_load_rows * depth;
    const T* a_next = a_rows + (i0 + row) * depth + k0 + kk;
    const T* b_next = b_rows + (j0 + row) * depth + k0 + kk;
#pragma unroll
    for (int e = 0; e < dot_loads; ++e) {
      a[e] = dot_load_rows * e < a_count ? *a_next : T{0};
      b[e] = dot_load_rows * e < b_count ? *b_next : T{0};
      a_next += step;
      b_next += step;
    }
  }

  template <class Tile>
  __device__ void store(Tile* a_tile, Tile* b_tile) const {
    const int base = (static_cast<int>(threadIdx.x) / dot_chunk) * dot_stride + static_cast<int>(threadIdx.x) % dot_chunk;
#pragma unroll
    for (int e = 0; e < dot_loads; ++e) {
      a_tile[base + dot_load_rows * dot_stride * e] = static_cast<Tile>(a[e]);
      b_tile[base + dot_load_rows * dot_stride * e] = static_cast<Tile>(b[e]);
    }
  }
};

// The type a chunk is staged in: doubles for DMMA where every block dot is below 2^53 (int32 and
// double dots), else the block dot's own type (FMA or integer chains).
#if defined(MXSCOPE_CUDA_TENSOR_CORES)
template <class Dot>
using dot_tile_t = std::conditional_t<std::is_same_v<Dot, long long>, long long, double>;
#else
template <class Dot>
using dot_tile_t = Dot;
#endif

// sum += value (a multiple of 2^base, inside the window) as an integer in units of 2^base.
__device__ inline void add_in_units(core_ns::int128& sum, double value, int base) {
  if (value == 0.0) return;
  const core_ns::double_parts parts = core_ns::decompose(value);
  const int shift = parts.exponent - base;  // below 0 only where the low significand bits are zero
  const core_ns::uint128 magnitude = shift >= 0 ? static_cast<core_ns::uint128>(parts.significand) << shift
                                                : static_cast<core_ns::uint128>(parts.significand >> -shift);
  sum += parts.negative ? -static_cast<core_ns::int128>(magnitude) : static_cast<core_ns::int128>(magnitude);
}

// add_in_units by exact fp64 steps instead of a 128-bit shift (reference_warp_kernel): the window
// keeps |value| 2^-base an integer below 2^127, and base (the sum of two fp32 lowest set-bit
// exponents) between -298 and 254, so the scaling by 2^-base (a normal double), the high half
// trunc(t 2^-64) and the low half t - high 2^64 (the bits of t below 2^64, at most 53 of them) are
// exact, and so are the conversions of the two halves to 64-bit integers. No branches. The same
// integer as add_in_units, which the other callers keep: with this form in every caller, ptxas
// spilled more in plain_tile_kernel's group mode (408 bytes against 312), a kernel whose speed
// with it has not been measured; in reference_warp_kernel it was (BENCHMARKS.md).
__device__ inline void add_in_units_by_halves(core_ns::int128& sum, double value, int base) {
  const double scaled = fabs(value) * core_ns::bits_double(static_cast<std::uint64_t>(1023 - base) << 52);
  const double high = trunc(scaled * 0x1p-64);
  const double low = fma(-high, 0x1p64, scaled);
  const core_ns::uint128 magnitude = (static_cast<core_ns::uint128>(static_cast<std::uint64_t>(high)) << 64) |
                                     static_cast<std::uint64_t>(low);
  sum += value < 0.0 ? -static_cast<core_ns::int128>(magnitude) : static_cast<core_ns::int128>(magnitude);
}

// The exact sum of a chunk's products (column kk of both shared-memory tiles, `stride` apart), in
// units of 2^base: the per-product path of a chunk whose fp64 sum might round.
__device__ __noinline__ core_ns::int128 chunk_products_in_units(const double* a_column, const double* b_column,
                                                                int stride, int base) {
  core_ns::int128 sum = 0;
  for (int kk = 0; kk < plain_chunk; ++kk) add_in_units(sum, a_column[kk * stride] * b_column[kk * stride], base);
  return sum;
}

// fl32(accumulator + sum * 2^base), exact sum rounded once: the sum goes to add_exactly_to_float
// as three doubles of 42 bits each (|sum| < 2^126), all exact.
__device__ __noinline__ float add_units_to_float(float accumulator, core_ns::int128 sum, int base) {
  if (!is_finite(accumulator)) return nonfinite_step(accumulator, 0.0);
  const bool negative = sum < 0;
  const core_ns::uint128 magnitude = negative ? -static_cast<core_ns::uint128>(sum) : static_cast<core_ns::uint128>(sum);
  constexpr std::uint64_t piece_mask = (std::uint64_t{1} << 42) - 1U;
  double terms[3];
  for (int t = 0; t < 3; ++t) {
    const auto piece = static_cast<std::uint64_t>(magnitude >> (42 * t)) & piece_mask;
    const double value = static_cast<double>(piece) * core_ns::pow2(base + 42 * t);
    terms[t] = negative ? -value : value;
  }
  return core_ns::add_exactly_to_float(accumulator, terms, 3);
}

// add_exact_value for a finite exact dot, inline: fl32(accumulator + dot) rounded once (core
// add_to_float), an exactly zero sum +0; an infinite accumulator stays (acc + dot).
__device__ inline float add_exact_dot(float accumulator, double dot) {
  if (!is_finite(accumulator)) return nonfinite_step(accumulator, dot);
  return core_ns::add_to_float(accumulator, dot + 0.0);
}

// What the exact reference multiplies its exact sums by before the one rounding: nothing (the
// reference of unscaled operands), or the tensor scales' exact product sa sb (core::
// add_scaled_exactly; the exact model of NVFP4 operands given as their block-scaled values, which
// must then be finite).
struct reference_scaling {
  bool scaled = false;
  core_ns::tensor_scale_product scale{};
};

// round_units of the sum times the tensor scales' exact product (reference_scaling): the sum in
// three pieces of 42 bits, each an exact double, times sa sb into one long accumulator, rounded once.
__device__ __noinline__ void round_units_scaled(core_ns::int128 sum, int base, const core_ns::tensor_scale_product& scale,
                                                double& out64, float& out32) {
  const bool negative = sum < 0;
  const core_ns::uint128 magnitude = negative ? -static_cast<core_ns::uint128>(sum) : static_cast<core_ns::uint128>(sum);
  core_ns::long_accumulator total;
  constexpr std::uint64_t piece_mask = (std::uint64_t{1} << 42) - 1U;
  for (int t = 0; t < 3; ++t) {
    const auto piece = static_cast<std::uint64_t>(magnitude >> (42 * t)) & piece_mask;
    if (piece == 0) continue;
    const double value = static_cast<double>(piece) * core_ns::pow2(base + 42 * t);
    core_ns::add_scaled_exactly(total, negative ? -value : value, scale);
  }
  out64 = round_total_to_double(total);
  out32 = round_total_to_float(total);
}

__device__ __noinline__ void round_units(core_ns::int128 sum, int base, double& out64, float& out32) {
  const bool negative = sum < 0;
  const core_ns::uint128 magnitude = negative ? -static_cast<core_ns::uint128>(sum) : static_cast<core_ns::uint128>(sum);
  out64 = core_ns::round_scaled_integer(magnitude, negative, base, core_ns::binary64, false);
  out32 = static_cast<float>(core_ns::round_scaled_integer(magnitude, negative, base, core_ns::binary32, false));
}

// The spread of values with lowest set-bit exponent `low` and leading exponent `high`, clamped to
// 127 (also for the nonfinite marker); plain_empty_spread for the empty marker.
__device__ inline std::int8_t plain_spread_of(int low, int high) {
  if (high == plain_empty_high) return plain_empty_spread;
  if (high == plain_nonfinite_high) return 127;
  return static_cast<std::int8_t>(high - low > 127 ? 127 : high - low);
}

// Per (chunk, row) of a canonical operand [rows, depth]: the spread of the chunk (clamped to 127;
// plain_empty_spread without nonzero finite values) and its lo and hi for the row pass.
__global__ void plain_chunks_kernel(const float* values, std::int64_t rows, std::int64_t depth, std::int64_t chunks,
                                    std::int8_t* spreads, std::int32_t* lows, std::int32_t* highs) {
  const bool vectors = depth % 4 == 0 && reinterpret_cast<std::uintptr_t>(values) % 16 == 0;
  MXSCOPE_GRID_LOOP(t, chunks * rows) {
    const std::int64_t chunk = t / rows;
    const std::int64_t row = t % rows;
    const std::int64_t k0 = chunk * plain_chunk;
    const std::int64_t end = depth - k0 < plain_chunk ? depth : k0 + plain_chunk;
    int low = std::numeric_limits<int>::max();
    int high = plain_empty_high;
    bool nonfinite = false;
    const auto visit = [&](float value) {
      const std::uint32_t bits = core_ns::float_bits(value);
      const int field = static_cast<int>((bits >> 23) & 0xffU);
      if (field == 0xff) {
        nonfinite = true;
        return;
      }
      const std::uint32_t significand = field == 0 ? (bits & 0x7fffffU) : ((bits & 0x7fffffU) | 0x800000U);
      if (significand == 0) return;
      const int unit = field == 0 ? -149 : field - 150;  // value = significand * 2^unit
      const int leading = unit + 31 - __builtin_clz(significand);
      const int lowest = unit + 31 - __builtin_clz(significand & (0U - significand));
      if (leading > high) high = leading;
      if (lowest < low) low = lowest;
    };
    if (vectors) {
      // Rows of a multiple of 4 values from a 16-byte aligned start: a chunk is (end - k0) / 4
      // float4 (one load each instead of four: the threads of a warp read 32 different rows).
      const float4* row_values = reinterpret_cast<const float4*>(values + row * depth + k0);
      for (std::int64_t q = 0; q < (end - k0) / 4; ++q) {
        const float4 v = row_values[q];
        visit(v.x);
        visit(v.y);
        visit(v.z);
        visit(v.w);
      }
    } else {
      for (std::int64_t k = k0; k < end; ++k) visit(values[row * depth + k]);
    }
    if (nonfinite) {
      low = 0;
      high = plain_nonfinite_high;
    }
    spreads[t] = plain_spread_of(low, high);
    lows[t] = low;
    highs[t] = high;
  }
}

// Per (super-chunk, row): the spread over plain_super_chunks consecutive chunks, from their lo and
// hi (as plain_chunks_kernel: 127 with inf or NaN, plain_empty_spread without nonzero values).
__global__ void plain_supers_kernel(const std::int32_t* chunk_lows, const std::int32_t* chunk_highs,
                                    std::int64_t rows, std::int64_t chunks, std::int8_t* spreads) {
  const std::int64_t supers = (chunks + plain_super_chunks - 1) / plain_super_chunks;
  MXSCOPE_GRID_LOOP(t, supers * rows) {
    const std::int64_t super = t / rows;
    const std::int64_t row = t % rows;
    const std::int64_t first = super * plain_super_chunks;
    const std::int64_t end = chunks - first < plain_super_chunks ? chunks : first + plain_super_chunks;
    int low = std::numeric_limits<int>::max();
    int high = plain_empty_high;
    for (std::int64_t c = first; c < end; ++c) {
      const int chunk_low = chunk_lows[c * rows + row];
      const int chunk_high = chunk_highs[c * rows + row];
      if (chunk_low < low) low = chunk_low;
      if (chunk_high > high) high = chunk_high;
    }
    spreads[t] = plain_spread_of(low, high);
  }
}

// Per row: lo and hi over its chunks (0 and plain_empty_high for a row of zeros; the nonfinite
// marker wins).
__global__ void plain_rows_kernel(const std::int32_t* chunk_lows, const std::int32_t* chunk_highs, std::int64_t rows,
                                  std::int64_t chunks, std::int32_t* lows, std::int32_t* highs) {
  MXSCOPE_GRID_LOOP(row, rows) {
    int low = std::numeric_limits<int>::max();
    int high = plain_empty_high;
    for (std::int64_t c = 0; c < chunks; ++c) {
      const int chunk_low = chunk_lows[c * rows + row];
      const int chunk_high = chunk_highs[c * rows + row];
      if (chunk_low < low) low = chunk_low;
      if (chunk_high > high) high = chunk_high;
    }
    lows[row] = high == plain_empty_high || high == plain_nonfinite_high ? 0 : low;
    highs[row] = high;
  }
}

// One 64 x 64 tile of C per thread block of 256 threads, 4 x 4 entries per thread (the DMMA
// layout above: dot_row, dot_col). Per chunk of 32 k the two operand tiles are staged in shared
// memory as doubles (the next chunk's values are loaded into registers while the tensor cores
// work on this one), tile_dots sums the 16 chunk dots, then every thread runs the model step of
// each of its entries.
template <plain_mode Mode, bool Scaled = false>
__global__ void __launch_bounds__(dot_threads, dot_min_blocks)
    plain_tile_kernel(const float* a, const float* b, const std::int8_t* a_spreads, const std::int8_t* b_spreads,
                      const std::int8_t* a_super_spreads, const std::int8_t* b_super_spreads,
                      plain_rows_view a_rows, plain_rows_view b_rows, std::int64_t m, std::int64_t n,
                      std::int64_t depth, int depth_bits, std::int64_t chunks_per_group, output_rounding output,
                      float* out32, double* out64, core_ns::tensor_scale_product scale) {
  __shared__ double a_tile[plain_tile * dot_stride];
  __shared__ double b_tile[plain_tile * dot_stride];
  __shared__ int a_spread_tile[plain_tile];
  __shared__ int b_spread_tile[plain_tile];
  [[maybe_unused]] __shared__ int a_super_tile[plain_tile];
  [[maybe_unused]] __shared__ int b_super_tile[plain_tile];
  constexpr bool supers = Mode == plain_mode::exact;
  const std::int64_t i0 = static_cast<std::int64_t>(blockIdx.y) * plain_tile;
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * plain_tile;
  const std::int64_t chunks = (depth + plain_chunk - 1) / plain_chunk;

  int a_low[plain_side], a_high[plain_side], b_low[plain_side], b_high[plain_side];
#pragma unroll
  for (int s = 0; s < plain_side; ++s) {
    const std::int64_t i = i0 + dot_row(s);
    const std::int64_t j = j0 + dot_col(s);
    a_low[s] = i < m ? a_rows.low[i] : 0;
    a_high[s] = i < m ? a_rows.high[i] : plain_nonfinite_high;
    b_low[s] = j < n ? b_rows.low[j] : 0;
    b_high[s] = j < n ? b_rows.high[j] : plain_nonfinite_high;
  }
  bool active[plain_side][plain_side];
  unsigned active_bits = 0;  // bit r plain_side + c: entry (r, c) is computed here
  [[maybe_unused]] core_ns::int128 sums[plain_side][plain_side];
  [[maybe_unused]] float accumulators[plain_side][plain_side];
#pragma unroll
  for (int r = 0; r < plain_side; ++r) {
#pragma unroll
    for (int c = 0; c < plain_side; ++c) {
      active[r][c] = plain_fits(a_low[r], a_high[r], b_low[c], b_high[c], depth_bits);
      if (active[r][c]) active_bits |= 1U << (r * plain_side + c);
      sums[r][c] = 0;
      accumulators[r][c] = 0.0f;
    }
  }

  // Threads 0-63 fetch the chunk spreads of the tile's A rows, 64-127 those of its B rows; in exact
  // mode threads 128-255 likewise the super-chunk spreads at the first chunk of each super-chunk.
  dot_chunk_values<float> next;
  int spread_next = plain_empty_spread;
  const auto fetch = [&](std::int64_t chunk) {
    const std::int64_t k0 = chunk * plain_chunk;
    next.load(a, b, i0, j0, m, n, depth, k0, depth - k0 < plain_chunk ? depth - k0 : plain_chunk);
    const int role = static_cast<int>(threadIdx.x) / plain_tile;
    const int row = static_cast<int>(threadIdx.x) % plain_tile;
    const std::int64_t i = (role % 2 == 0 ? i0 : j0) + row;
    const std::int64_t rows = role % 2 == 0 ? m : n;
    if (role < 2) {
      spread_next = i < rows ? (role == 0 ? a_spreads : b_spreads)[chunk * rows + i] : plain_empty_spread;
    } else if (supers && chunk % plain_super_chunks == 0) {
      const std::int64_t super = chunk / plain_super_chunks;
      spread_next = i < rows ? (role == 2 ? a_super_spreads : b_super_spreads)[super * rows + i] : plain_empty_spread;
    }
  };
  if (chunks > 0) fetch(0);

  // The tensor-core dots: zero at every chunk; in exact mode zero at the start and reset by each
  // entry's step, after every chunk except for the entries in `fused`, which keep summing until
  // the end of their super-chunk. (Not by resetting all 16 at the first chunk of each super-chunk:
  // with that form, nvcc 13.0 for sm_90a gave the first DMMA of a chunk a uniform zero-accumulator
  // predicate, and rows 8-15 of every warp's tile came out wrong on the H200; this form passes.)
  double dots[plain_side][plain_side];
#pragma unroll
  for (int r = 0; r < plain_side; ++r) {
#pragma unroll
    for (int c = 0; c < plain_side; ++c) dots[r][c] = 0.0;
  }
  unsigned fused = 0;

  for (std::int64_t chunk = 0; chunk < chunks; ++chunk) {
    next.store(a_tile, b_tile);
    const int role = static_cast<int>(threadIdx.x) / plain_tile;
    if (role < 2 || (supers && chunk % plain_super_chunks == 0)) {
      int* const tile = role == 0 ? a_spread_tile : role == 1 ? b_spread_tile : role == 2 ? a_super_tile : b_super_tile;
      tile[threadIdx.x % plain_tile] = spread_next;
    }
    __syncthreads();
    if (chunk + 1 < chunks) fetch(chunk + 1);
    if (supers && chunk % plain_super_chunks == 0) {
      fused = 0;
#pragma unroll
      for (int r = 0; r < plain_side; ++r) {
#pragma unroll
        for (int c = 0; c < plain_side; ++c) {
          if (active[r][c] && a_super_tile[dot_row(r)] + b_super_tile[dot_col(c)] <= plain_super_budget) {
            fused |= 1U << (r * plain_side + c);
          }
        }
      }
    }
    const bool super_end = (chunk + 1) % plain_super_chunks == 0 || chunk + 1 == chunks;
    if (!supers) {
#pragma unroll
      for (int r = 0; r < plain_side; ++r) {
#pragma unroll
        for (int c = 0; c < plain_side; ++c) dots[r][c] = 0.0;
      }
    }
    tile_dots(a_tile, b_tile, dots);

    // The chunk's step for every entry whose fp64 dot is exact; the others (rare for bf16 values)
    // are marked and take the per-product path below, out of the hot loop. A fused entry steps
    // once, at the end of its super-chunk (in most chunks of exact mode nothing is left to do).
    if (!supers || super_end || (active_bits & ~fused) != 0) {
      unsigned per_product = 0;
#pragma unroll
      for (int r = 0; r < plain_side; ++r) {
#pragma unroll
        for (int c = 0; c < plain_side; ++c) {
          if (!active[r][c]) continue;
          if ((fused & (1U << (r * plain_side + c))) != 0) {
            if (super_end) {
              add_in_units(sums[r][c], dots[r][c], a_low[r] + b_low[c]);
              dots[r][c] = 0.0;
            }
            continue;
          }
          const double dot = dots[r][c];
          dots[r][c] = 0.0;
          if (a_spread_tile[dot_row(r)] + b_spread_tile[dot_col(c)] > plain_chunk_budget) {
            per_product |= 1U << (r * plain_side + c);
          } else if constexpr (Mode == plain_mode::block) {
            accumulators[r][c] = add_exact_dot(accumulators[r][c], dot);
          } else {
            add_in_units(sums[r][c], dot, a_low[r] + b_low[c]);
          }
        }
      }
      if (per_product != 0) {
#pragma unroll
        for (int r = 0; r < plain_side; ++r) {
#pragma unroll
          for (int c = 0; c < plain_side; ++c) {
            if ((per_product & (1U << (r * plain_side + c))) == 0) continue;
            const int base = a_low[r] + b_low[c];
            const core_ns::int128 products =
                chunk_products_in_units(a_tile + dot_row(r) * dot_stride, b_tile + dot_col(c) * dot_stride, 1, base);
            if constexpr (Mode == plain_mode::block) {
              accumulators[r][c] = add_units_to_float(accumulators[r][c], products, base);
            } else {
              sums[r][c] += products;
            }
          }
        }
      }
    }
    if (Mode == plain_mode::group && ((chunk + 1) % chunks_per_group == 0 || chunk + 1 == chunks)) {
#pragma unroll
      for (int r = 0; r < plain_side; ++r) {
#pragma unroll
        for (int c = 0; c < plain_side; ++c) {
          if (!active[r][c]) continue;
          accumulators[r][c] = add_units_to_float(accumulators[r][c], sums[r][c], a_low[r] + b_low[c]);
          sums[r][c] = 0;
        }
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < plain_side; ++r) {
#pragma unroll
    for (int c = 0; c < plain_side; ++c) {
      if (!active[r][c]) continue;
      const std::int64_t entry = (i0 + dot_row(r)) * n + j0 + dot_col(c);
      if constexpr (Mode == plain_mode::exact) {
        double value64 = 0.0;
        float value32 = 0.0f;
        if constexpr (Scaled) {
          round_units_scaled(sums[r][c], a_low[r] + b_low[c], scale, value64, value32);
        } else {
          round_units(sums[r][c], a_low[r] + b_low[c], value64, value32);
        }
        if (out64 != nullptr) out64[entry] = value64;
        if (out32 != nullptr) out32[entry] = value32;
      } else {
        out32[entry] = finish_output(accumulators[r][c] * 1.0f, output);  // epilogue: alpha = 1
      }
    }
  }
}

#if defined(MXSCOPE_CUDA_TENSOR_CORES)
// -------------------------------------------------------------------------------------------
// The exact reference on 32 x 32 entries per warp (CUDA tensor-core builds; HIP keeps
// plain_tile_kernel). The same 64 x 64 tile, chunks, spreads, super-chunks and steps as
// plain_tile_kernel's exact mode, but 4 warps of 32 x 32 entries (each A fragment feeds four mmas,
// each B fragment two: half the shared-memory bytes per product of the 32 x 16 warp tiles), and
// the entries' 128-bit sums and the rows' lowest exponents in shared memory (the sums change at
// most once per chunk, mostly once per super-chunk), so that the registers hold the 64 dots and
// two thread blocks fit a multiprocessor. The operands come in chunk tiles (chunk_tiles_kernel):
// a thread stages fixed float4 slots without bounds checks, A's through cp.async into shared
// memory. The steps convert a dot to the 128-bit sum by fp64 halves (add_in_units_by_halves).
// Measured on the H200 (BENCHMARKS.md): 23.5 TFLOP/s with the row-major staging of
// plain_tile_kernel and 255 registers with spills, 30.4 to 30.7 with the chunk tiles, A's cp.async
// and the lows in shared memory (no spills); the steps by halves cut the reference stage of the
// Llama-shaped replay, whose rows step per chunk, from 0.15 to 0.12 s.
//
// Entry (r, c) of a thread (r < 4, c < 8): row rw_row(r) = 32 (warp / 2) + 8 r + lane / 4, column
// rw_col(c) = 32 (warp % 2) + 8 (c / 2) + 2 (lane % 4) + c % 2: element 2 (r % 2) + c % 2 of the
// accumulator fragment of the mma of row pair r / 2 and column group c / 2. Its sum lives at
// rw_sums[(r rw_cols + c) rw_threads + threadIdx.x] (a warp's 32 sums are 512 consecutive bytes).
constexpr int rw_threads = 128;
// Threads 0-63 fill the tile's shared A-row values (spreads, lows), 64-127 the B rows', at index
// threadIdx.x % plain_tile: in bounds, and every entry written once, only for this block size.
static_assert(rw_threads == 2 * plain_tile, "reference_warp_kernel: one thread per A row and per B row of the tile");
constexpr int rw_rows = 4;
constexpr int rw_cols = 8;
constexpr std::size_t rw_tiles_bytes = 2 * plain_tile * dot_stride * sizeof(double);
constexpr std::size_t rw_sums_bytes = rw_rows * rw_cols * rw_threads * sizeof(core_ns::int128);
constexpr std::size_t rw_stage_bytes = plain_tile * plain_chunk * sizeof(float);  // A's next chunk, as read
constexpr std::size_t rw_shared_bytes = rw_tiles_bytes + rw_sums_bytes + rw_stage_bytes;

// Asynchronous 16- and 4-byte copies from global to shared memory (cp.async; zeros where
// `inside` is false), and their commit and wait.
#if defined(MXSCOPE_GPU_SIMULATE)
inline void copy_async_16(void* shared_destination, const void* global_source, bool inside) {
  simulation::copy_async(shared_destination, global_source, 16, inside);
}
inline void copy_async_4(void* shared_destination, const void* global_source, bool inside) {
  simulation::copy_async(shared_destination, global_source, 4, inside);
}
inline void copy_async_commit() {}
template <int Pending>
inline void copy_async_wait() {}
#else
__device__ inline void copy_async_16(void* shared_destination, const void* global_source, bool inside) {
  const unsigned destination = static_cast<unsigned>(__cvta_generic_to_shared(shared_destination));
  const int source_bytes = inside ? 16 : 0;  // 0: fill the 16 bytes with zeros
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(destination), "l"(global_source),
               "r"(source_bytes));
}

__device__ inline void copy_async_4(void* shared_destination, const void* global_source, bool inside) {
  const unsigned destination = static_cast<unsigned>(__cvta_generic_to_shared(shared_destination));
  const int source_bytes = inside ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(destination), "l"(global_source),
               "r"(source_bytes));
}

__device__ inline void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int Pending>
__device__ inline void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}
#endif

// The staging: each operand goes to the kernel in chunk tiles (chunk_tiles_kernel), so that a
// thread's values are four float4 at fixed offsets from one address, without bounds checks.
// Slot v of a row (values 4 v .. 4 v + 3) goes to the shared tile as two 16-byte stores; slots 4-7
// hold their halves swapped (values 4 v + 2, 4 v + 3, 4 v, 4 v + 1), and their threads store the
// high half first, so that each store's eight threads of a quarter-warp meet eight different bank
// groups (the row stride, 36 doubles, moves the low halves of all slots by multiples of 32 bytes).
constexpr int rw_tile_slots = plain_tile * plain_chunk / 4;  // float4 per operand chunk tile (512)
constexpr int rw_loads = rw_tile_slots / rw_threads;         // float4 per thread and operand (4)

struct alignas(16) double_pair {
  double x, y;
};

__device__ inline void rw_store(const float4 (&values)[rw_loads], double* tile) {
  const int slot = static_cast<int>(threadIdx.x) % 8;
  const int swapped = slot / 4;
  double* const first = tile + (static_cast<int>(threadIdx.x) / 8) * dot_stride + 4 * slot + 2 * swapped;
  double* const second = tile + (static_cast<int>(threadIdx.x) / 8) * dot_stride + 4 * slot + 2 * (1 - swapped);
#pragma unroll
  for (int e = 0; e < rw_loads; ++e) {
    const float4 v = values[e];
    const double_pair low_half = {static_cast<double>(v.x), static_cast<double>(v.y)};
    const double_pair high_half = {static_cast<double>(v.z), static_cast<double>(v.w)};
    *reinterpret_cast<double_pair*>(first + 16 * dot_stride * e) = low_half;
    *reinterpret_cast<double_pair*>(second + 16 * dot_stride * e) = high_half;
  }
}

// The operand x [rows, depth] as chunk tiles: tile t (rows 64 t .. 64 t + 63) and chunk c (columns
// 32 c .. 32 c + 31) are 2048 consecutive values from (t chunks + c) 2048, row by row, with the
// slots of each row ordered as rw_store reads them, and zeros past the last row and column.
__global__ void chunk_tiles_kernel(const float* x, std::int64_t rows, std::int64_t depth, std::int64_t chunks,
                                   float* out) {
  const std::int64_t chunk = blockIdx.x;
  const std::int64_t tiles = (rows + plain_tile - 1) / plain_tile;
  for (std::int64_t tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
    float* const tile_out = out + (tile * chunks + chunk) * (plain_tile * plain_chunk);
    for (int e = static_cast<int>(threadIdx.x); e < plain_tile * plain_chunk; e += static_cast<int>(blockDim.x)) {
      const int place = e % plain_chunk;
      const std::int64_t row = tile * plain_tile + e / plain_chunk;
      const std::int64_t k = chunk * plain_chunk + (place / 16 == 0 ? place : place ^ 2);  // slots 4-7: halves swapped
      tile_out[e] = row < rows && k < depth ? x[row * depth + k] : 0.0f;
    }
  }
}

__device__ inline int rw_row(int r) {
  return 32 * (static_cast<int>(threadIdx.x) / 64) + 8 * r + (static_cast<int>(threadIdx.x) % 32) / 4;
}
__device__ inline int rw_col(int c) {
  const int thread = static_cast<int>(threadIdx.x);
  return 32 * ((thread / 32) % 2) + 8 * (c / 2) + 2 * (thread % 4) + c % 2;
}

// dots[r][c] += the chunk's 32 products of row rw_row(r) of a_tile and row rw_col(c) of b_tile.
__device__ inline void rw_tile_dots(const double* a_tile, const double* b_tile, double (&dots)[rw_rows][rw_cols]) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const double* a_base = a_tile + (32 * (warp / 2) + lane / 4) * dot_stride + lane % 4;
  const double* b_base = b_tile + (32 * (warp % 2) + lane / 4) * dot_stride + lane % 4;
#pragma unroll
  for (int kk = 0; kk < 32; kk += 8) {
    double bv[rw_cols / 2][2];
#pragma unroll
    for (int q = 0; q < rw_cols / 2; ++q) {
#pragma unroll
      for (int v = 0; v < 2; ++v) bv[q][v] = b_base[8 * q * dot_stride + kk + 4 * v];
    }
#pragma unroll
    for (int p = 0; p < rw_rows / 2; ++p) {
      double av[4];
#pragma unroll
      for (int v = 0; v < 4; ++v) av[v] = a_base[8 * (2 * p + v % 2) * dot_stride + kk + 4 * (v / 2)];
#pragma unroll
      for (int q = 0; q < rw_cols / 2; ++q) {
        mma_f64(dots[2 * p][2 * q], dots[2 * p][2 * q + 1], dots[2 * p + 1][2 * q], dots[2 * p + 1][2 * q + 1], av,
                bv[q]);
      }
    }
  }
}

template <bool Scaled>
__global__ void __launch_bounds__(rw_threads, 2)
    reference_warp_kernel(const float* a_tiles, const float* b_tiles, const std::int8_t* a_spreads,
                          const std::int8_t* b_spreads, const std::int8_t* a_super_spreads,
                          const std::int8_t* b_super_spreads,
                          plain_rows_view a_rows, plain_rows_view b_rows, std::int64_t m, std::int64_t n,
                          std::int64_t depth, int depth_bits, float* out32, double* out64,
                          core_ns::tensor_scale_product scale) {
  MXSCOPE_DYNAMIC_SHARED(double, rw_shared);
  double* const a_tile = rw_shared;
  double* const b_tile = rw_shared + plain_tile * dot_stride;
  core_ns::int128* const rw_sums = reinterpret_cast<core_ns::int128*>(rw_shared + 2 * plain_tile * dot_stride);
  __shared__ int a_spread_tile[plain_tile];
  __shared__ int b_spread_tile[plain_tile];
  __shared__ int a_super_tile[plain_tile];
  __shared__ int b_super_tile[plain_tile];
  const std::int64_t i0 = static_cast<std::int64_t>(blockIdx.y) * plain_tile;
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * plain_tile;
  const std::int64_t chunks = (depth + plain_chunk - 1) / plain_chunk;
  const auto sum_at = [&](int r, int c) -> core_ns::int128& {
    return rw_sums[(r * rw_cols + c) * rw_threads + static_cast<int>(threadIdx.x)];
  };

  // The rows' lowest exponents (the sums' units) in shared memory: read at the steps only.
  __shared__ int a_low_tile[plain_tile];
  __shared__ int b_low_tile[plain_tile];
  const auto base_of = [&](int r, int c) { return a_low_tile[rw_row(r)] + b_low_tile[rw_col(c)]; };
  unsigned active = 0;  // bit r rw_cols + c: entry (r, c) is computed here
  {
    const bool a_role = threadIdx.x < plain_tile;
    const std::int64_t i = (a_role ? i0 : j0) + static_cast<int>(threadIdx.x) % plain_tile;
    const std::int32_t* lows = a_role ? a_rows.low : b_rows.low;
    (a_role ? a_low_tile : b_low_tile)[threadIdx.x % plain_tile] = i < (a_role ? m : n) ? lows[i] : 0;
  }
  {
    int a_low[rw_rows], b_low[rw_cols];
    int a_high[rw_rows], b_high[rw_cols];
#pragma unroll
    for (int r = 0; r < rw_rows; ++r) {
      const std::int64_t i = i0 + rw_row(r);
      a_low[r] = i < m ? a_rows.low[i] : 0;
      a_high[r] = i < m ? a_rows.high[i] : plain_nonfinite_high;
    }
#pragma unroll
    for (int c = 0; c < rw_cols; ++c) {
      const std::int64_t j = j0 + rw_col(c);
      b_low[c] = j < n ? b_rows.low[j] : 0;
      b_high[c] = j < n ? b_rows.high[j] : plain_nonfinite_high;
    }
#pragma unroll
    for (int r = 0; r < rw_rows; ++r) {
#pragma unroll
      for (int c = 0; c < rw_cols; ++c) {
        if (plain_fits(a_low[r], a_high[r], b_low[c], b_high[c], depth_bits)) active |= 1U << (r * rw_cols + c);
        sum_at(r, c) = 0;
      }
    }
  }
  __syncthreads();  // the low tiles

  // The next chunk. Its values: four float4 of each operand's chunk tile (chunk_tiles_kernel),
  // elements threadIdx.x + 128 e of the tile's 512 (row threadIdx.x / 8 + 16 e, slot
  // threadIdx.x % 8). A's go by cp.async to this thread's own slots of the stage, which only this
  // thread reads back (so no barrier, and no registers held across the chunk's mmas); B's go to
  // registers. Its spreads: threads 0-63 fetch those of the tile's A rows, 64-127 those of its B
  // rows, the chunk's, and at the first chunk of a super-chunk also the super-chunk's.
  float4 next_b[rw_loads];
  float4* const a_stage =
      reinterpret_cast<float4*>(rw_shared + (rw_tiles_bytes + rw_sums_bytes) / sizeof(double)) + threadIdx.x;
  int spread_next = plain_empty_spread;
  int super_next = plain_empty_spread;
  const float4* const a_source =
      reinterpret_cast<const float4*>(a_tiles) + blockIdx.y * chunks * rw_tile_slots + threadIdx.x;
  const float4* const b_source =
      reinterpret_cast<const float4*>(b_tiles) + blockIdx.x * chunks * rw_tile_slots + threadIdx.x;
  const auto fetch = [&](std::int64_t chunk) {
#pragma unroll
    for (int e = 0; e < rw_loads; ++e) {
      copy_async_16(a_stage + rw_threads * e, a_source + chunk * rw_tile_slots + rw_threads * e, true);
      next_b[e] = b_source[chunk * rw_tile_slots + rw_threads * e];
    }
    copy_async_commit();
    const bool a_role = threadIdx.x < plain_tile;
    const std::int64_t i = (a_role ? i0 : j0) + static_cast<int>(threadIdx.x) % plain_tile;
    const std::int64_t rows = a_role ? m : n;
    spread_next = i < rows ? (a_role ? a_spreads : b_spreads)[chunk * rows + i] : plain_empty_spread;
    if (chunk % plain_super_chunks == 0) {
      const std::int64_t super = chunk / plain_super_chunks;
      super_next = i < rows ? (a_role ? a_super_spreads : b_super_spreads)[super * rows + i] : plain_empty_spread;
    }
  };
  if (chunks > 0) fetch(0);

  // The dots: zero at the start, reset by each entry's own step (see plain_tile_kernel for why not
  // all at once at a super-chunk's first chunk).
  double dots[rw_rows][rw_cols];
#pragma unroll
  for (int r = 0; r < rw_rows; ++r) {
#pragma unroll
    for (int c = 0; c < rw_cols; ++c) dots[r][c] = 0.0;
  }
  unsigned fused = 0;

  for (std::int64_t chunk = 0; chunk < chunks; ++chunk) {
    copy_async_wait<0>();
    {
      float4 staged[rw_loads];
#pragma unroll
      for (int e = 0; e < rw_loads; ++e) staged[e] = a_stage[rw_threads * e];
      rw_store(staged, a_tile);
    }
    rw_store(next_b, b_tile);
    const bool super_start = chunk % plain_super_chunks == 0;
    (threadIdx.x < plain_tile ? a_spread_tile : b_spread_tile)[threadIdx.x % plain_tile] = spread_next;
    if (super_start) (threadIdx.x < plain_tile ? a_super_tile : b_super_tile)[threadIdx.x % plain_tile] = super_next;
    __syncthreads();
    if (chunk + 1 < chunks) fetch(chunk + 1);
    if (super_start) {
      fused = 0;
#pragma unroll
      for (int r = 0; r < rw_rows; ++r) {
#pragma unroll
        for (int c = 0; c < rw_cols; ++c) {
          if (a_super_tile[rw_row(r)] + b_super_tile[rw_col(c)] <= plain_super_budget) fused |= 1U << (r * rw_cols + c);
        }
      }
      fused &= active;
    }
    const bool super_end = (chunk + 1) % plain_super_chunks == 0 || chunk + 1 == chunks;
    rw_tile_dots(a_tile, b_tile, dots);

    // The steps (as plain_tile_kernel's exact mode), on the sums in shared memory.
    if (super_end || (active & ~fused) != 0) {
      unsigned per_product = 0;
#pragma unroll
      for (int r = 0; r < rw_rows; ++r) {
#pragma unroll
        for (int c = 0; c < rw_cols; ++c) {
          const unsigned bit = 1U << (r * rw_cols + c);
          if ((active & bit) == 0) continue;
          if ((fused & bit) != 0) {
            if (super_end) {
              add_in_units_by_halves(sum_at(r, c), dots[r][c], base_of(r, c));
              dots[r][c] = 0.0;
            }
            continue;
          }
          const double dot = dots[r][c];
          dots[r][c] = 0.0;
          if (a_spread_tile[rw_row(r)] + b_spread_tile[rw_col(c)] > plain_chunk_budget) {
            per_product |= bit;
          } else {
            add_in_units_by_halves(sum_at(r, c), dot, base_of(r, c));
          }
        }
      }
      if (per_product != 0) {
#pragma unroll
        for (int r = 0; r < rw_rows; ++r) {
#pragma unroll
          for (int c = 0; c < rw_cols; ++c) {
            if ((per_product & (1U << (r * rw_cols + c))) == 0) continue;
            const int base = base_of(r, c);
            sum_at(r, c) +=
                chunk_products_in_units(a_tile + rw_row(r) * dot_stride, b_tile + rw_col(c) * dot_stride, 1, base);
          }
        }
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < rw_rows; ++r) {
#pragma unroll
    for (int c = 0; c < rw_cols; ++c) {
      if ((active & (1U << (r * rw_cols + c))) == 0) continue;
      const std::int64_t entry = (i0 + rw_row(r)) * n + j0 + rw_col(c);
      double value64 = 0.0;
      float value32 = 0.0f;
      if constexpr (Scaled) {
        round_units_scaled(sum_at(r, c), base_of(r, c), scale, value64, value32);
      } else {
        round_units(sum_at(r, c), base_of(r, c), value64, value32);
      }
      if (out64 != nullptr) out64[entry] = value64;
      if (out32 != nullptr) out32[entry] = value32;
    }
  }
}
#endif  // MXSCOPE_CUDA_TENSOR_CORES

// The row metadata of one unscaled operand on the device.
struct plain_rows_data {
  scratch_buffer spreads;        // int8 [chunks, rows]
  scratch_buffer super_spreads;  // int8 [super-chunks, rows]
  scratch_buffer lows;     // int32 [rows]
  scratch_buffer highs;    // int32 [rows]
  plain_rows_view view() const { return {lows.as<const std::int32_t>(), highs.as<const std::int32_t>()}; }
};

plain_rows_data describe_plain_rows(const float* values, std::int64_t rows, std::int64_t depth) {
  const std::int64_t chunks = (depth + plain_chunk - 1) / plain_chunk;
  const std::int64_t supers = (chunks + plain_super_chunks - 1) / plain_super_chunks;
  plain_rows_data out{scratch_buffer(static_cast<std::size_t>(std::max<std::int64_t>(chunks * rows, 1))),
                      scratch_buffer(static_cast<std::size_t>(std::max<std::int64_t>(supers * rows, 1))),
                      scratch_buffer(static_cast<std::size_t>(std::max<std::int64_t>(rows, 1)) * sizeof(std::int32_t)),
                      scratch_buffer(static_cast<std::size_t>(std::max<std::int64_t>(rows, 1)) * sizeof(std::int32_t))};
  if (rows == 0) return out;
  const std::size_t chunk_bytes = static_cast<std::size_t>(std::max<std::int64_t>(chunks * rows, 1)) * sizeof(std::int32_t);
  scratch_buffer chunk_lows(chunk_bytes);
  scratch_buffer chunk_highs(chunk_bytes);
  if (chunks > 0) {
    runtime::launch(plain_chunks_kernel, grid_for(chunks * rows), threads_per_block, 0, values, rows, depth, chunks,
                    out.spreads.as<std::int8_t>(), chunk_lows.as<std::int32_t>(), chunk_highs.as<std::int32_t>());
    runtime::launch(plain_supers_kernel, grid_for(supers * rows), threads_per_block, 0,
                    chunk_lows.as<const std::int32_t>(), chunk_highs.as<const std::int32_t>(), rows, chunks,
                    out.super_spreads.as<std::int8_t>());
  }
  runtime::launch(plain_rows_kernel, grid_for(rows), threads_per_block, 0, chunk_lows.as<const std::int32_t>(),
                  chunk_highs.as<const std::int32_t>(), rows, chunks, out.lows.as<std::int32_t>(),
                  out.highs.as<std::int32_t>());
  synchronize();  // the chunk buffers must outlive the kernels
  return out;
}

int depth_bits_of(std::int64_t depth) { return core_ns::bit_length(static_cast<core_ns::uint128>(depth)); }

dim3 plain_grid(std::int64_t m, std::int64_t n) {
  return dim3(static_cast<unsigned>((n + plain_tile - 1) / plain_tile),
              static_cast<unsigned>((m + plain_tile - 1) / plain_tile));
}

// -------------------------------------------------------------------------------------------
// Integer path: the block dot D of each K-block is an exact integer sum, then the model's steps
// run on exact doubles exactly as src/gemm.cpp's fast path does (add_exact_value,
// add_exactly_to_float, long_accumulator), per entry, in ascending K-blocks.
//
// One 64 x 64 tile of C per thread block of 256 threads, 4 x 4 entries per thread (the DMMA layout
// of tile_dots); each K-block's elements are staged in shared memory in chunks of 32 ([row][k],
// coalesced global reads of 32 consecutive int32 per warp), as doubles for the fp64 tensor cores
// (on HIP: as the type `Dot` the block dot is summed in, in FMA chains). Every partial sum of a
// block dot, in any order, is an integer below 2^block_dot_bits, a double, so the tensor core's
// additions are exact and its dot is D. `Dot` is:
// - int32 where block_dot_bits <= 31;
// - double where block_dot_bits <= 53 (fp8 e4m3: 6 + 18 + 18 = 42 bits for blocks of 32). Every
//   element integer has |x| <= integer_max_of(kind) < 2^bits_of(integer_max_of(kind)) (exact in a
//   double: below 2^31), so every product is an integer below 2^(bits_a + bits_b) and every partial
//   sum of at most `block` < 2^bits_of(block) products an integer below 2^block_dot_bits <= 2^53:
//   each of them is a double, so each FMA of the chain rounds a representable value, i.e. not at
//   all, and the chain's result is D exactly. (One DFMA per product instead of a 64-bit integer
//   multiply-add.)
// - int64 otherwise (no format of the path today: gemm_path_covers asks for <= 53 bits).
//
// Per entry state across K-blocks: fp32-block the fp32 accumulator (add_exact_value per block).
// fp32-group:G and exact keep a running fp64 sum of the scaled block dots and check every addition
// with TwoSum (Knuth): while no addition rounded, `running` is the exact sum of the group's (or of
// all) scaled dots, and the step is one correctly rounded operation on it: fl32(acc + running)
// (core add_to_float, which rounds acc + running once, as add_exactly_to_float rounds acc + the
// terms once; +0.0 for an exact zero, as there) for a group, the fp64 result and one RNE conversion
// to fp32 for exact. An entry where an addition rounded (block dots many binades apart) is flagged
// and left to integer_fixup_kernel, which redoes it from the operands with the per-entry
// definitions (the group's terms through add_exactly_to_float, a long accumulator for exact).

constexpr int integer_tile = dot_tile;           // entries per thread block along M and N
constexpr int integer_chunk = dot_chunk;         // K per shared-memory stage (within one K-block)
constexpr int integer_side = integer_tile / 16;  // entries per thread along M and N (tile_dots: 4)

// whole: `exact` where every row's block exponent is the same in all of its K-blocks (per-tensor
// scaling: unit block scales) and every partial sum over the whole of K is below 2^53: the dot of
// all of K is then one exact sum (the tensor cores add it exactly in any order), and the entry is
// that sum times the rows' scale, the value `exact` gets by adding the blocks' scaled dots, which
// are then all exact additions.
enum class integer_mode : int { block = 0, group = 1, exact = 2, whole = 3 };

// dot += x * y, exact (see above for double).
template <class Dot>
__device__ inline Dot multiply_add_exact(Dot x, Dot y, Dot dot) {
  if constexpr (std::is_same_v<Dot, double>) {
    return fma_exact(x, y, dot);
  } else {
    return dot + x * y;
  }
}

// add_exact_value, with the rounding inline (no call in the unrolled per-entry steps).
__device__ inline float add_exact_value_inline(float accumulator, double value) {
  if (!is_finite(accumulator) || !is_finite(value)) return nonfinite_step(accumulator, value);
  return core_ns::add_to_float(accumulator, value + 0.0);  // +0.0: an exactly zero sum is +0
}

// running += contribution; true when the addition rounded (TwoSum: sum + error == running +
// contribution exactly for finite doubles, which these stay far below overflow).
__device__ inline bool add_rounds(double& running, double contribution) {
  const double sum = running + contribution;
  const double virtual_contribution = sum - running;
  const double virtual_running = sum - virtual_contribution;
  const double error = (running - virtual_running) + (contribution - virtual_contribution);
  running = sum;
  return error != 0.0;
}

template <class Dot, integer_mode Mode>
__global__ void __launch_bounds__(dot_threads, dot_min_blocks)
    integer_product_kernel(const std::int32_t* a_values, const std::int32_t* a_exponents,
                           const std::int32_t* b_values, const std::int32_t* b_exponents, std::int64_t m,
                           std::int64_t n, std::int64_t depth, int block, std::int64_t blocks, int blocks_per_group,
                           int fraction_total, output_rounding output, float* out, double* exact_out,
                           std::uint8_t* flagged) {
  using Tile = dot_tile_t<Dot>;
  using Acc = Tile;  // the chunk dots: doubles on the tensor cores (exact, see tile_dots), else Dot
  static_assert(Mode != integer_mode::whole || std::is_same_v<Acc, double>, "a whole-K dot needs 53 bits");
  __shared__ Tile a_tile[integer_tile * dot_stride];
  __shared__ Tile b_tile[integer_tile * dot_stride];
  const std::int64_t i0 = static_cast<std::int64_t>(blockIdx.y) * integer_tile;
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * integer_tile;

  bool row_inside[integer_side], column_inside[integer_side];
#pragma unroll
  for (int s = 0; s < integer_side; ++s) {
    row_inside[s] = i0 + dot_row(s) < m;
    column_inside[s] = j0 + dot_col(s) < n;
  }
  [[maybe_unused]] float accumulators[integer_side][integer_side];
  [[maybe_unused]] double running[integer_side][integer_side];
  [[maybe_unused]] unsigned nan_entries = 0;     // bit r * side + c: a NaN block (exact: ever; group: this group)
  [[maybe_unused]] unsigned rounded_entries = 0;  // bit r * side + c: an addition of `running` rounded
#pragma unroll
  for (int r = 0; r < integer_side; ++r) {
#pragma unroll
    for (int c = 0; c < integer_side; ++c) {
      accumulators[r][c] = 0.0f;
      running[r][c] = 0.0;
    }
  }
  const int group = Mode == integer_mode::group ? blocks_per_group : 1;
  std::int32_t exponent_a[integer_side], exponent_b[integer_side];
  Acc dots[integer_side][integer_side];

  // The chunks in order: K-block b, offset c0 within it (dot_chunk_values: the next one is loaded
  // while the tensor cores work on this one).
  dot_chunk_values<std::int32_t> next;
  const auto fetch = [&](std::int64_t b, std::int64_t c0) {
    const std::int64_t k0 = b * block + c0;
    const std::int64_t block_end = depth < (b + 1) * block ? depth : (b + 1) * block;
    next.load(a_values, b_values, i0, j0, m, n, depth, k0,
              block_end - k0 < integer_chunk ? block_end - k0 : integer_chunk);
  };
  if (blocks > 0) fetch(0, 0);

  for (std::int64_t group_begin = 0; group_begin < blocks; group_begin += group) {
    const std::int64_t group_end = blocks - group_begin < group ? blocks : group_begin + group;
    if constexpr (Mode == integer_mode::group) {
      nan_entries = 0;
#pragma unroll
      for (int r = 0; r < integer_side; ++r) {
#pragma unroll
        for (int c = 0; c < integer_side; ++c) running[r][c] = 0.0;
      }
    }
    for (std::int64_t b = group_begin; b < group_end; ++b) {
      const std::int64_t k0 = b * block;
      const std::int64_t length = depth - k0 < block ? depth - k0 : block;
      if (Mode != integer_mode::whole || b == 0) {
#pragma unroll
        for (int s = 0; s < integer_side; ++s) {
          exponent_a[s] = row_inside[s] ? a_exponents[b * m + i0 + dot_row(s)] : 0;
          exponent_b[s] = column_inside[s] ? b_exponents[b * n + j0 + dot_col(s)] : 0;
        }
#pragma unroll
        for (int r = 0; r < integer_side; ++r) {
#pragma unroll
          for (int c = 0; c < integer_side; ++c) dots[r][c] = 0;
        }
      }
      for (std::int64_t c0 = 0; c0 < length; c0 += integer_chunk) {
        next.store(a_tile, b_tile);
        __syncthreads();
        if (c0 + integer_chunk < length) {
          fetch(b, c0 + integer_chunk);
        } else if (b + 1 < blocks) {
          fetch(b + 1, 0);
        }
        tile_dots(a_tile, b_tile, dots);
        __syncthreads();
      }
      // The block's step for every entry of the thread (whole: one step after the last block).
      if (Mode == integer_mode::whole && b + 1 < blocks) continue;
#pragma unroll
      for (int r = 0; r < integer_side; ++r) {
#pragma unroll
        for (int c = 0; c < integer_side; ++c) {
          if (!row_inside[r] || !column_inside[c]) continue;
          if constexpr (Mode == integer_mode::block) {
            // The common step in full: the scaled dot D 2^k is a finite double (|D| < 2^53, k
            // within +-300), so scaled_block_dot's canonicalizations change nothing and
            // add_exact_value is fl32(acc + D 2^k). NaN blocks and an infinite accumulator take
            // the general step.
            float& accumulator = accumulators[r][c];
            if (exponent_a[r] != nan_block_exponent && exponent_b[c] != nan_block_exponent && is_finite(accumulator)) {
              accumulator = core_ns::add_to_float(
                  accumulator,
                  static_cast<double>(dots[r][c]) * core_ns::pow2(exponent_a[r] + exponent_b[c] - fraction_total));
            } else {
              accumulator = add_exact_value_inline(
                  accumulator,
                  scaled_block_dot(static_cast<double>(dots[r][c]), exponent_a[r], exponent_b[c], fraction_total));
            }
            continue;
          }
          const double contribution =
              scaled_block_dot(static_cast<double>(dots[r][c]), exponent_a[r], exponent_b[c], fraction_total);
          if (contribution != contribution) {
            nan_entries |= 1U << (r * integer_side + c);
          } else if (add_rounds(running[r][c], contribution)) {
            rounded_entries |= 1U << (r * integer_side + c);
          }
        }
      }
    }
    if constexpr (Mode == integer_mode::group) {
      // fl32(acc + the group's terms) for the entries whose `running` is their exact sum.
#pragma unroll
      for (int r = 0; r < integer_side; ++r) {
#pragma unroll
        for (int c = 0; c < integer_side; ++c) {
          const unsigned bit = 1U << (r * integer_side + c);
          if ((rounded_entries & bit) != 0) continue;
          float& accumulator = accumulators[r][c];
          if ((nan_entries & bit) != 0 || !is_finite(accumulator)) {
            accumulator = nonfinite_step(accumulator, (nan_entries & bit) != 0 ? canonical_nan_double() : 0.0);
          } else {
            accumulator = core_ns::add_to_float(accumulator, running[r][c] + 0.0);
          }
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < integer_side; ++r) {
#pragma unroll
    for (int c = 0; c < integer_side; ++c) {
      if (!row_inside[r] || !column_inside[c]) continue;
      const std::int64_t entry = (i0 + dot_row(r)) * n + j0 + dot_col(c);
      const unsigned bit = 1U << (r * integer_side + c);
      if constexpr (Mode == integer_mode::block) {
        out[entry] = finish_output(accumulators[r][c] * 1.0f, output);
      } else if constexpr (Mode == integer_mode::group) {
        if ((rounded_entries & bit) != 0) {
          flagged[entry] = 1;
        } else {
          out[entry] = finish_output(accumulators[r][c] * 1.0f, output);
        }
      } else {
        if ((nan_entries & bit) != 0) {
          out[entry] = finish_output(canonical_nan_float(), output);
          if (exact_out != nullptr) exact_out[entry] = canonical_nan_double();
        } else if ((rounded_entries & bit) != 0) {
          flagged[entry] = 1;
        } else {
          // `running` is the exact sum: the fp64 result itself, and one correctly rounded
          // conversion to fp32.
          out[entry] = finish_output(static_cast<float>(running[r][c]), output);
          if (exact_out != nullptr) exact_out[entry] = running[r][c];
        }
      }
    }
  }
}

// The entries integer_product_kernel flagged (fp32-group:G, exact), one thread each, by the
// per-entry definitions: the block dots again from the operands; a group's scaled dots through
// add_exactly_to_float (one of them through add_exact_value), every scaled dot of an exact entry
// added to a long accumulator and rounded once (a NaN block gives the canonical NaN).
template <class Dot, integer_mode Mode>
__global__ void integer_fixup_kernel(const std::int32_t* a_values, const std::int32_t* a_exponents,
                                     const std::int32_t* b_values, const std::int32_t* b_exponents, std::int64_t m,
                                     std::int64_t n, std::int64_t depth, int block, std::int64_t blocks,
                                     int blocks_per_group, int fraction_total, output_rounding output,
                                     const std::uint8_t* flagged, float* out, double* exact_out) {
  MXSCOPE_GRID_LOOP(entry, m * n) {
    if (flagged[entry] == 0) continue;
    const std::int64_t i = entry / n;
    const std::int64_t j = entry % n;
    const auto scaled_dot = [&](std::int64_t b) {
      const std::int64_t k0 = b * block;
      const std::int64_t end = depth - k0 < block ? depth : k0 + block;
      Dot dot = 0;
      for (std::int64_t k = k0; k < end; ++k) {
        dot = multiply_add_exact(static_cast<Dot>(a_values[i * depth + k]), static_cast<Dot>(b_values[j * depth + k]),
                                 dot);
      }
      return scaled_block_dot(static_cast<double>(dot), a_exponents[b * m + i], b_exponents[b * n + j],
                              fraction_total);
    };
    if constexpr (Mode == integer_mode::exact) {
      core_ns::long_accumulator total;
      bool nan_entry = false;
      for (std::int64_t b = 0; b < blocks; ++b) {
        const double contribution = scaled_dot(b);
        if (contribution != contribution) {
          nan_entry = true;
        } else {
          total.add(contribution);
        }
      }
      if (nan_entry) {
        out[entry] = finish_output(canonical_nan_float(), output);
        if (exact_out != nullptr) exact_out[entry] = canonical_nan_double();
      } else {
        out[entry] = finish_output(round_total_to_float(total), output);
        if (exact_out != nullptr) exact_out[entry] = round_total_to_double(total);
      }
    } else {
      float accumulator = 0.0f;
      double terms[integer_max_group];
      for (std::int64_t group_begin = 0; group_begin < blocks; group_begin += blocks_per_group) {
        const std::int64_t group_end =
            blocks - group_begin < blocks_per_group ? blocks : group_begin + blocks_per_group;
        const int count = static_cast<int>(group_end - group_begin);
        for (int g = 0; g < count; ++g) terms[g] = scaled_dot(group_begin + g);
        if (count == 1) {
          accumulator = add_exact_value(accumulator, terms[0]);
          continue;
        }
        bool nan_term = false;
        for (int g = 0; g < count; ++g) nan_term = nan_term || terms[g] != terms[g];
        if (nan_term || !is_finite(accumulator)) {
          accumulator = nonfinite_step(accumulator, nan_term ? canonical_nan_double() : 0.0);
          continue;
        }
        accumulator = add_group_to_float(accumulator, terms, count);
      }
      out[entry] = finish_output(accumulator * 1.0f, output);
    }
  }
}

// Per row of an exponent array [blocks, rows]: the largest minus the smallest block exponent along
// K (1 << 20 with a NaN block), and the largest of them over all rows in *largest. Span 0 in every
// row is integer_mode::whole's condition; tensor_core_exact_kernel's window test reads the spans.
__global__ void exponent_spans_kernel(const std::int32_t* exponents, std::int64_t rows, std::int64_t blocks,
                                      std::int32_t* spans, unsigned long long* largest) {
  unsigned long long local = 0;
  MXSCOPE_GRID_LOOP(r, rows) {
    std::int32_t low = exponents[r];
    std::int32_t high = low;
    bool nan_block = false;
    for (std::int64_t b = 0; b < blocks; ++b) {
      const std::int32_t e = exponents[b * rows + r];
      nan_block = nan_block || e == nan_block_exponent;
      low = e < low ? e : low;
      high = e > high ? e : high;
    }
    const std::int32_t span = nan_block || blocks == 0 ? (1 << 20) : high - low;
    spans[r] = span;
    local = static_cast<unsigned long long>(span) > local ? static_cast<unsigned long long>(span) : local;
  }
  unsigned long long reduced[1] = {local};
  constexpr int index[1] = {0};
  block_reduce_to<true>(reduced, largest, index);
}

struct exponent_span_data {
  device_buffer spans;      // int32 [rows]
  std::int64_t largest = 0;  // the largest span (0 without rows)
};

exponent_span_data exponent_spans(const prepared_operand::storage& operand) {
  exponent_span_data out;
  out.spans = device_buffer(static_cast<std::size_t>(std::max<std::int64_t>(operand.rows, 1)) * sizeof(std::int32_t));
  if (operand.rows == 0) return out;
  device_buffer largest(sizeof(unsigned long long));
  largest.fill_bytes(0);
  runtime::launch(exponent_spans_kernel, reduction_grid(operand.rows), threads_per_block, 0,
                  operand.exponents.as<const std::int32_t>(), operand.rows, operand.blocks, out.spans.as<std::int32_t>(),
                  largest.as<unsigned long long>());
  unsigned long long host = 0;
  largest.download(&host, sizeof(host));
  out.largest = static_cast<std::int64_t>(host);
  return out;
}

// True when every row of the operand has one block exponent along K, none a NaN block's
// (integer_mode::whole).
bool uniform_exponents(const prepared_operand::storage& operand) {
  if (operand.rows == 0 || operand.blocks == 0) return true;
  return exponent_spans(operand).largest == 0;
}

// The largest |integer element| of a tensor-core operand (tensor_core_element's codes).
std::int64_t tensor_core_integer_max(element_kind kind) {
  return kind == element_kind::fp4_e2m1 ? 12 : kind == element_kind::fp6_e2m3 ? 60 : 127;
}

template <class Dot>
void launch_integer(const prepared_operand::storage& a, const prepared_operand::storage& b,
                    const accumulation_model& model, output_rounding output, float* out, double* exact_out,
                    int fraction_total) {
  const dim3 grid(static_cast<unsigned>((b.rows + integer_tile - 1) / integer_tile),
                  static_cast<unsigned>((a.rows + integer_tile - 1) / integer_tile));
  const dim3 threads(256);
  const auto* av = a.integers.as<const std::int32_t>();
  const auto* ae = a.exponents.as<const std::int32_t>();
  const auto* bv = b.integers.as<const std::int32_t>();
  const auto* be = b.exponents.as<const std::int32_t>();
  const std::int64_t m = a.rows;
  const std::int64_t n = b.rows;
  if (model.kind == accumulation_kind::fp32_block) {
    runtime::launch(integer_product_kernel<Dot, integer_mode::block>, grid, threads, 0, av, ae, bv, be, m, n, a.depth,
                    a.block, a.blocks, 1, fraction_total, output, out, exact_out, nullptr);
    return;
  }
  if (model.kind != accumulation_kind::fp32_group && model.kind != accumulation_kind::exact) {
    throw input_error("gpu gemm: the integer path covers exact, fp32-block and fp32-group:G");
  }
  if (model.kind == accumulation_kind::exact &&
      bits_of(a.depth) + bits_of(integer_max_of(a.element)) + bits_of(integer_max_of(b.element)) <= 53 &&
      uniform_exponents(a) && uniform_exponents(b)) {
    runtime::launch(integer_product_kernel<double, integer_mode::whole>, grid, threads, 0, av, ae, bv, be, m, n,
                    a.depth, a.block, a.blocks, 1, fraction_total, output, out, exact_out, nullptr);
    return;
  }
  const int per_group = model.kind == accumulation_kind::fp32_group ? model.blocks_per_group : 1;
  device_buffer flagged(static_cast<std::size_t>(std::max<std::int64_t>(m * n, 1)));
  flagged.fill_bytes(0);
  if (model.kind == accumulation_kind::fp32_group) {
    runtime::launch(integer_product_kernel<Dot, integer_mode::group>, grid, threads, 0, av, ae, bv, be, m, n, a.depth,
                    a.block, a.blocks, per_group, fraction_total, output, out, exact_out, flagged.as<std::uint8_t>());
    runtime::launch(integer_fixup_kernel<Dot, integer_mode::group>, grid_for(m * n), threads_per_block, 0, av, ae, bv,
                    be, m, n, a.depth, a.block, a.blocks, per_group, fraction_total, output,
                    flagged.as<const std::uint8_t>(), out, exact_out);
  } else {
    runtime::launch(integer_product_kernel<Dot, integer_mode::exact>, grid, threads, 0, av, ae, bv, be, m, n, a.depth,
                    a.block, a.blocks, 1, fraction_total, output, out, exact_out, flagged.as<std::uint8_t>());
    runtime::launch(integer_fixup_kernel<Dot, integer_mode::exact>, grid_for(m * n), threads_per_block, 0, av, ae, bv,
                    be, m, n, a.depth, a.block, a.blocks, 1, fraction_total, output, flagged.as<const std::uint8_t>(),
                    out, exact_out);
  }
  synchronize();  // the flag buffer must outlive both kernels
}

// -------------------------------------------------------------------------------------------
// Tensor-core path (CUDA, sm_80+): mma.sync m16n8k32 s8 x s8 -> s32 per 32-block gives each block
// dot D exactly (|D| <= 32 * 127^2 < 2^19, far inside s32). Two kernels: for fp32-block,
// tensor_core_block_kernel (below) runs the step acc = fl32(acc + D * 2^(ea + eb - fa - fb)) in
// ascending K per entry; for exact, tensor_core_exact_kernel sums the scaled dots in fp64 and
// leaves the entries it cannot prove exact to tensor_core_exact_fixup_kernel.
//
// The general fp32-block step (tensor_core_step): where 2^k (k = ea + eb - fa - fb) is a normal
// fp32 number and |D| 2^k < 2^128 (-126 <= k <= 100 here), float(D) * 2^k is exact in fp32 and
// one fp32 addition rounds the exact sum once: it IS fl32(acc + c). Elsewhere (and for NaN blocks)
// the step goes through add_exact_value in fp64.
//
// tensor_core_exact_kernel's tiling: a 128 x 128 tile of C per thread block of 8 warps (2 x 4),
// 64 x 32 per warp (4 x 4 mma tiles); each stage holds one 32-byte K-block of 128 rows of A and B
// plus their exponents, three stages deep (cp.async).

#if defined(MXSCOPE_CUDA_TENSOR_CORES)

constexpr int tc_tile = 128;
constexpr int tc_stages = 3;
constexpr int tc_row_stride = 48;  // bytes per smem row: 32 data + 16 pad (conflict-free fragment loads)
constexpr int tc_fast_k_low = -126;
constexpr int tc_fast_k_high = 100;
// Exact: 2^k is a normal double and |D| 2^k stays far from overflow.
constexpr int tc_exact_k_low = -1000;
constexpr int tc_exact_k_high = 900;

struct alignas(16) tc_stage {
  std::uint8_t a[tc_tile * tc_row_stride];
  std::uint8_t b[tc_tile * tc_row_stride];
  std::int32_t a_exponents[tc_tile];
  std::int32_t b_exponents[tc_tile];
};

#if defined(MXSCOPE_GPU_SIMULATE)
inline void mma_s8(int (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
  simulation::mma_s8(d, a, b);
}
#else
// mma.sync m16n8k32 s8 x s8 + 0 -> s32 (the fragment layout is spelled out in simulation.hpp).
__device__ inline void mma_s8(int (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(0), "r"(0), "r"(0), "r"(0));
}
#endif

__device__ __noinline__ float tensor_core_slow_step(float accumulator, int dot, std::int32_t exponent_a,
                                                    std::int32_t exponent_b, int fraction_total) {
  return add_exact_value(accumulator,
                         scaled_block_dot(static_cast<double>(dot), exponent_a, exponent_b, fraction_total));
}

__device__ inline float tensor_core_step(float accumulator, int dot, std::int32_t exponent_a, std::int32_t exponent_b,
                                         int fraction_total) {
  const int k = exponent_a + exponent_b - fraction_total;  // NaN markers make k huge: slow path
  if (k >= tc_fast_k_low && k <= tc_fast_k_high) {
    const float power = core_ns::bits_float(static_cast<std::uint32_t>(k + 127) << 23);
    return __fadd_rn(accumulator, __fmul_rn(static_cast<float>(dot), power));
  }
  return tensor_core_slow_step(accumulator, dot, exponent_a, exponent_b, fraction_total);
}

__device__ inline void load_tc_stage(tc_stage& stage, const std::int8_t* a, const std::int32_t* a_exponents,
                                     const std::int8_t* b, const std::int32_t* b_exponents, std::int64_t m,
                                     std::int64_t n, std::int64_t stride, std::int64_t block_index, std::int64_t i0,
                                     std::int64_t j0) {
  const int t = threadIdx.x;  // 256 threads: one 16-byte chunk of A and one of B each
  const int row = t / 2;
  const int half = t % 2;
  const std::int64_t k_byte = block_index * 32 + half * 16;
  const bool a_inside = i0 + row < m;
  const bool b_inside = j0 + row < n;
  copy_async_16(stage.a + row * tc_row_stride + half * 16, a_inside ? a + (i0 + row) * stride + k_byte : a, a_inside);
  copy_async_16(stage.b + row * tc_row_stride + half * 16, b_inside ? b + (j0 + row) * stride + k_byte : b, b_inside);
  if (t < tc_tile) {
    const bool inside = i0 + t < m;
    copy_async_4(&stage.a_exponents[t], inside ? a_exponents + block_index * m + i0 + t : a_exponents, inside);
  } else {
    const int r = t - tc_tile;
    const bool inside = j0 + r < n;
    copy_async_4(&stage.b_exponents[r], inside ? b_exponents + block_index * n + j0 + r : b_exponents, inside);
  }
}

// Each entry keeps a running fp64 sum of the scaled block dots D * 2^k (exact doubles: |D| < 2^20)
// and checks every addition with TwoSum; an entry whose sum ever rounded (or that meets a NaN
// block or an extreme k) is flagged in `flagged` and left to tensor_core_exact_fixup_kernel.
// Unflagged entries' running sums are the exact sums, written as the fp64 result and converted
// once (RNE) to fp32.
//
// Window tiles: every scaled dot of entry (i, j) is a multiple of 2^L, L = lo_a(i) + lo_b(j) - f
// (lo, hi: the smallest and largest block exponent of the row along K), and every partial sum is
// below blocks * 2^dot_bits * 2^H, H = hi_a(i) + hi_b(j) - f. When span_a(i) + span_b(j) (span =
// hi - lo) is at most span_budget = 53 - dot_bits - bits(blocks), every partial sum is a double:
// no addition rounds, and the step is one FMA, D * 2^k + running, with no check. A tile takes that
// path when its largest row span and largest column span add up to at most the budget (NaN
// blocks make a span of at least 2^20).
__global__ void __launch_bounds__(256)
    tensor_core_exact_kernel(const std::int8_t* a, const std::int32_t* a_exponents, const std::int8_t* b,
                             const std::int32_t* b_exponents, std::int64_t m, std::int64_t n, std::int64_t stride,
                             std::int64_t blocks, int fraction_total, output_rounding output, float* out,
                             double* exact_out, std::uint8_t* flagged, const std::int32_t* a_spans,
                             const std::int32_t* b_spans, int span_budget) {
  __shared__ tc_stage stages[tc_stages];
  __shared__ int tile_spans[2][tc_tile];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group_id = lane / 4;         // row (A, C) or column (B, C) within an mma tile
  const int thread_in_group = lane % 4;  // k offset (A, B) or column pair (C)
  const int warp_m = warp / 4;           // 0..1: 64 rows each
  const int warp_n = warp % 4;           // 0..3: 32 columns each
  const std::int64_t i0 = static_cast<std::int64_t>(blockIdx.y) * tc_tile;
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * tc_tile;

  double accumulators[4][4][4];
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) accumulators[mi][ni][e] = 0;
  std::uint64_t flags = 0;  // bit mi * 16 + ni * 4 + e for a flagged entry

  // The tile's largest row and column spans (rows past the end count 0).
  if (threadIdx.x < tc_tile) {
    const std::int64_t i = i0 + threadIdx.x;
    tile_spans[0][threadIdx.x] = i < m ? a_spans[i] : 0;
  } else {
    const std::int64_t j = j0 + threadIdx.x - tc_tile;
    tile_spans[1][threadIdx.x - tc_tile] = j < n ? b_spans[j] : 0;
  }
  __syncthreads();
  for (int width = tc_tile / 2; width > 0; width /= 2) {
    if (static_cast<int>(threadIdx.x) < 2 * width) {
      const int side = static_cast<int>(threadIdx.x) / width;
      const int t = static_cast<int>(threadIdx.x) % width;
      const int other = tile_spans[side][t + width];
      if (other > tile_spans[side][t]) tile_spans[side][t] = other;
    }
    __syncthreads();
  }
  const bool window = tile_spans[0][0] + tile_spans[1][0] <= span_budget;

#pragma unroll
  for (int s = 0; s < tc_stages - 1; ++s) {
    if (s < blocks) load_tc_stage(stages[s], a, a_exponents, b, b_exponents, m, n, stride, s, i0, j0);
    copy_async_commit();
  }

  for (std::int64_t kb = 0; kb < blocks; ++kb) {
    copy_async_wait<tc_stages - 2>();
    __syncthreads();
    // Refill the stage everyone finished with in the previous iteration.
    const std::int64_t next = kb + tc_stages - 1;
    if (next < blocks) {
      load_tc_stage(stages[next % tc_stages], a, a_exponents, b, b_exponents, m, n, stride, next, i0, j0);
    }
    copy_async_commit();

    const tc_stage& stage = stages[kb % tc_stages];
    std::uint32_t a_fragments[4][4];
    std::uint32_t b_fragments[4][2];
    std::int32_t row_exponents[4][2];
    std::int32_t col_exponents[4][2];
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
      const int row = warp_m * 64 + mi * 16 + group_id;
      const std::uint8_t* upper = stage.a + row * tc_row_stride + 4 * thread_in_group;
      const std::uint8_t* lower = upper + 8 * tc_row_stride;
      a_fragments[mi][0] = *reinterpret_cast<const std::uint32_t*>(upper);
      a_fragments[mi][1] = *reinterpret_cast<const std::uint32_t*>(lower);
      a_fragments[mi][2] = *reinterpret_cast<const std::uint32_t*>(upper + 16);
      a_fragments[mi][3] = *reinterpret_cast<const std::uint32_t*>(lower + 16);
      row_exponents[mi][0] = stage.a_exponents[row];
      row_exponents[mi][1] = stage.a_exponents[row + 8];
    }
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      const int col = warp_n * 32 + ni * 8 + group_id;
      const std::uint8_t* source = stage.b + col * tc_row_stride + 4 * thread_in_group;
      b_fragments[ni][0] = *reinterpret_cast<const std::uint32_t*>(source);
      b_fragments[ni][1] = *reinterpret_cast<const std::uint32_t*>(source + 16);
      const int c_col = warp_n * 32 + ni * 8 + 2 * thread_in_group;
      col_exponents[ni][0] = stage.b_exponents[c_col];
      col_exponents[ni][1] = stage.b_exponents[c_col + 1];
    }
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        int d[4];
        mma_s8(d, a_fragments[mi], b_fragments[ni]);
        // d0, d1: row g, columns 2t, 2t+1; d2, d3: row g + 8, the same columns.
        if (window) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int k = row_exponents[mi][e / 2] + col_exponents[ni][e % 2] - fraction_total;
            const double power = core_ns::bits_double(static_cast<std::uint64_t>(k + 1023) << 52);
            accumulators[mi][ni][e] = fma_exact(static_cast<double>(d[e]), power, accumulators[mi][ni][e]);
          }
          continue;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int k = row_exponents[mi][e / 2] + col_exponents[ni][e % 2] - fraction_total;
          const std::uint64_t bit = std::uint64_t{1} << (mi * 16 + ni * 4 + e);
          if (k < tc_exact_k_low || k > tc_exact_k_high) {  // NaN markers make k huge
            flags |= bit;
            continue;
          }
          const double power = core_ns::bits_double(static_cast<std::uint64_t>(k + 1023) << 52);
          const double contribution = static_cast<double>(d[e]) * power;  // exact
          double& running = accumulators[mi][ni][e];
          const double sum = running + contribution;
          const double virtual_contribution = sum - running;
          const double virtual_running = sum - virtual_contribution;
          const double error = (running - virtual_running) + (contribution - virtual_contribution);
          running = sum;
          if (error != 0.0) flags |= bit;
        }
      }
    }
  }
  copy_async_wait<0>();

#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const std::int64_t i = i0 + warp_m * 64 + mi * 16 + group_id + (e / 2) * 8;
        const std::int64_t j = j0 + warp_n * 32 + ni * 8 + 2 * thread_in_group + e % 2;
        if (i >= m || j >= n) continue;
        if ((flags >> (mi * 16 + ni * 4 + e)) & 1U) {
          flagged[i * n + j] = 1;
        } else {
          const double sum = accumulators[mi][ni][e] + 0.0;  // an exactly zero sum is +0
          out[i * n + j] = finish_output(static_cast<float>(sum), output);
          if (exact_out != nullptr) exact_out[i * n + j] = sum;
        }
      }
    }
  }
}

// The entries tensor_core_exact_kernel flagged, one thread each: the block dots again from
// the same int8 operands, every scaled dot added to a long accumulator, rounded once (NaN blocks
// give the canonical NaN, as the integer path does).
__global__ void tensor_core_exact_fixup_kernel(const std::int8_t* a, const std::int32_t* a_exponents,
                                               const std::int8_t* b, const std::int32_t* b_exponents, std::int64_t m,
                                               std::int64_t n, std::int64_t stride, std::int64_t blocks,
                                               int fraction_total, output_rounding output,
                                               const std::uint8_t* flagged, float* out, double* exact_out) {
  MXSCOPE_GRID_LOOP(entry, m * n) {
    if (flagged[entry] == 0) continue;
    const std::int64_t i = entry / n;
    const std::int64_t j = entry % n;
    core_ns::long_accumulator total;
    bool nan_entry = false;
    for (std::int64_t block = 0; block < blocks; ++block) {
      const std::int8_t* a_block = a + i * stride + block * 32;
      const std::int8_t* b_block = b + j * stride + block * 32;
      int dot = 0;
      for (int t = 0; t < 32; ++t) dot += static_cast<int>(a_block[t]) * static_cast<int>(b_block[t]);
      const double contribution = scaled_block_dot(static_cast<double>(dot), a_exponents[block * m + i],
                                                   b_exponents[block * n + j], fraction_total);
      if (contribution != contribution) {
        nan_entry = true;
      } else {
        total.add(contribution);
      }
    }
    if (nan_entry) {
      out[entry] = finish_output(canonical_nan_float(), output);
      if (exact_out != nullptr) exact_out[entry] = canonical_nan_double();
    } else {
      out[entry] = finish_output(round_total_to_float(total), output);
      if (exact_out != nullptr) exact_out[entry] = round_total_to_double(total);
    }
  }
}

// -------------------------------------------------------------------------------------------
// fp32-block on the tensor cores, the fast kernel. The mma's accumulator input carries the
// constant C = 0x4B400000 (the bits of 1.5 * 2^23) into every entry, so that each int32 result
// C + D, read as the bits of a float, IS the float 1.5 * 2^23 + D exactly (|D| < 2^22 keeps the
// sum inside the binade [2^23, 2^24), whose ulp is 1): no int-to-float conversion. With the
// row scale r = 2^(ea - fa) and the column scale c = 2^(eb - fb) (prepare_tensor_core_scales_kernel:
// normal floats, -126 <= ea - fa, eb - fb <= 100), two fused multiply-adds per entry and block,
//   x   = fma(1.5 * 2^23 + D, r, -(1.5 * 2^23) r)  = D r                 (exact: D r is a float)
//   acc = fma(x, c, acc)                          = fl32(acc + D 2^k)    (one rounding of the exact sum)
// give the model's step for every k = ea + eb - fa - fb, subnormal and overflowing sums included
// (an fma rounds the exact x c + acc once; the core's add_to_float does the same). A 128-row tile
// whose block holds an exponent outside that range or a NaN block takes the general step
// (tensor_core_step) for the whole thread block in that block; the choice is uniform, per block.
//
// Tiling: 128 x 256 entries of C per thread block of 8 warps (2 x 4), 64 x 64 per warp (4 x 8 mma
// tiles, 128 fp32 accumulators per thread); each stage holds two K-blocks, each 32 bytes of 128
// rows of A and 256 rows of B with their scales and the three tile flags, four stages deep
// (cp.async, one barrier per stage); thread blocks are launched in groups of 8 row tiles. Rows
// are 32 bytes with the two 16-byte halves swapped on rows 4..7 of every 8 (row r, half h at
// 32 r + 16 (h ^ ((r >> 2) & 1))), so that the eight row addresses of each ldmatrix phase fall in
// eight distinct 16-byte bank groups.

constexpr int tcb_tile_m = 128;
constexpr int tcb_tile_n = 256;
constexpr int tcb_stages = 4;
constexpr int tcb_stage_blocks = 2;  // K-blocks per stage (one barrier per stage)
constexpr int tcb_group = 8;         // row tiles per group of the launch order
constexpr int tcb_threads = 256;
constexpr int tcb_magic = 0x4B400000;  // the bits of 1.5 * 2^23
constexpr float tcb_magic_value = 12582912.0f;

struct alignas(16) tcb_block {  // one K-block of a stage
  std::uint8_t a[tcb_tile_m * 32];
  std::uint8_t b[tcb_tile_n * 32];
  std::uint32_t a_scales[tcb_tile_m];  // prepare_tensor_core_scales_kernel's encoding
  std::uint32_t b_scales[tcb_tile_n];
  unsigned slow[4];  // the A tile's flag, the B tile's two (one per 128 rows), unused
};
constexpr std::size_t tcb_stage_bytes = tcb_stage_blocks * sizeof(tcb_block);
constexpr std::size_t tcb_shared_bytes = tcb_stages * tcb_stage_bytes;
static_assert(sizeof(tcb_block) % 16 == 0 && tcb_tile_n == 2 * tc_flag_rows && tcb_tile_m == tc_flag_rows &&
              tcb_tile_n == 2 * (tcb_threads / 2) && tcb_tile_m == tcb_threads / 2);

// The first entry (i0, j0) of thread block `tile` when thread blocks are launched in groups of
// tcb_group row tiles, column tile by column tile within a group: the blocks resident at one time
// share fewer A and B tiles (L2 reuse). Sizes fit an int here (multiply_prepared checks).
struct tile_origin {
  int i0, j0;
};
__device__ inline tile_origin grouped_tile_origin(int tile, int tiles_m, int tiles_n, int tile_m, int tile_n) {
  const int group_tiles = tcb_group * tiles_n;
  const int first_row_tile = tile / group_tiles * tcb_group;
  const int group_rows = min(tiles_m - first_row_tile, tcb_group);
  return {(first_row_tile + tile % group_tiles % group_rows) * tile_m, tile % group_tiles / group_rows * tile_n};
}

__device__ inline int tcb_offset(int row, int half) { return row * 32 + (((half ^ (row >> 2)) & 1) << 4); }

// The exponent e - fraction_bits (or nan_block_exponent) of prepare_tensor_core_scales_kernel's encoding.
__device__ inline std::int32_t tc_scale_exponent(std::uint32_t bits) {
  return (bits >> 31) != 0U ? static_cast<std::int32_t>(bits << 1) >> 1 : static_cast<std::int32_t>(bits >> 23) - 127;
}

#if defined(MXSCOPE_GPU_SIMULATE)
inline int tcb_opaque(int value) { return value; }
inline void load_matrix_x4(std::uint32_t (&r)[4], const void* row_address) {
  simulation::load_matrix_x4(r, row_address);
}
inline void mma_s8_offset(int (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2], int c) {
  const int accumulator[4] = {c, c, c, c};
  simulation::mma_s8(d, a, b, accumulator);
}
#else
// The value, through a register move the compiler cannot see into: per-thread offsets computed
// once stay in a register instead of being recomputed from the thread index in the loop.
__device__ inline int tcb_opaque(int value) {
  int out;
  asm("mov.b32 %0, %1;" : "=r"(out) : "r"(value));
  return out;
}

// ldmatrix .x4 (the per-lane semantics are spelled out in simulation.hpp).
__device__ inline void load_matrix_x4(std::uint32_t (&r)[4], const void* row_address) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(row_address));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// mma.sync m16n8k32 s8 x s8 + C -> s32 with C = c in every entry.
__device__ inline void mma_s8_offset(int (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2], int c) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(c));
}
#endif

// One thread's share of every K-block: one 16-byte chunk of A, two of B, and for 99 of the 256
// threads one more copy (16 bytes of scales or a 4-byte tile flag). Rows past the end of A or B
// copy the last row instead (their entries of C are never stored, and the scales of the padded
// rows are those of a fast tile), so that every source simply advances by a fixed step per K-block;
// the destinations are fixed offsets in a K-block of a stage: A's chunk at data_offset, B's at
// data_offset + b_shift and 4096 bytes (128 rows, the same swizzle) further.
struct tcb_loader {
  static constexpr int b_shift = static_cast<int>(offsetof(tcb_block, b) - offsetof(tcb_block, a));
  const std::int8_t* a_source;
  const std::int8_t* b_source[2];
  const unsigned char* extra_source;
  int data_offset, extra_offset, extra_step, extra_bytes;  // extra_bytes: 0, 4 or 16

  __device__ tcb_loader(const std::int8_t* a, const std::uint32_t* a_scales, const unsigned* a_slow,
                        const std::int8_t* b, const std::uint32_t* b_scales, const unsigned* b_slow, std::int64_t m,
                        std::int64_t n, std::int64_t stride, std::int64_t padded_m, std::int64_t padded_n,
                        std::int64_t i0, std::int64_t j0) {
    const int t = threadIdx.x;
    const int row = t / 2;
    const int half = t % 2;
    a_source = a + std::min(i0 + row, m - 1) * stride + half * 16;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      b_source[q] = b + std::min(j0 + row + q * (tcb_threads / 2), n - 1) * stride + half * 16;
    }
    data_offset = static_cast<int>(offsetof(tcb_block, a)) + tcb_offset(row, half);
    // Scales: the padded rows make every 16-byte chunk exist and aligned.
    constexpr int a_chunks = tcb_tile_m / 4, scale_chunks = (tcb_tile_m + tcb_tile_n) / 4;
    extra_bytes = 0;
    extra_source = nullptr;
    extra_step = 0;
    extra_offset = 0;
    if (t < a_chunks) {
      extra_bytes = 16;
      extra_source = reinterpret_cast<const unsigned char*>(a_scales + i0 + 4 * t);
      extra_step = static_cast<int>(padded_m * sizeof(std::uint32_t));
      extra_offset = static_cast<int>(offsetof(tcb_block, a_scales)) + 16 * t;
    } else if (t < scale_chunks) {
      extra_bytes = 16;
      extra_source = reinterpret_cast<const unsigned char*>(b_scales + j0 + 4 * (t - a_chunks));
      extra_step = static_cast<int>(padded_n * sizeof(std::uint32_t));
      extra_offset = static_cast<int>(offsetof(tcb_block, b_scales)) + 16 * (t - a_chunks);
    } else if (t == scale_chunks) {
      extra_bytes = 4;
      extra_source = reinterpret_cast<const unsigned char*>(a_slow + i0 / tc_flag_rows);
      extra_step = static_cast<int>(padded_m / tc_flag_rows * sizeof(unsigned));
      extra_offset = static_cast<int>(offsetof(tcb_block, slow));
    } else if (t <= scale_chunks + 2) {
      const int q = t - scale_chunks - 1;
      extra_bytes = 4;
      extra_source = reinterpret_cast<const unsigned char*>(b_slow + j0 / tc_flag_rows + q);
      extra_step = static_cast<int>(padded_n / tc_flag_rows * sizeof(unsigned));
      extra_offset = static_cast<int>(offsetof(tcb_block, slow)) + 4 * (1 + q);
    }
  }

  // Copies the next stage's K-blocks (those below `remaining`) into `stage` and advances.
  __device__ void load(unsigned char* stage, int remaining) {
#pragma unroll
    for (int u = 0; u < tcb_stage_blocks; ++u) {
      if (u >= remaining) break;
      unsigned char* const block = stage + u * sizeof(tcb_block);
      copy_async_16(block + data_offset, a_source + 32 * u, true);
      copy_async_16(block + data_offset + b_shift, b_source[0] + 32 * u, true);
      copy_async_16(block + data_offset + b_shift + 4096, b_source[1] + 32 * u, true);
      if (extra_bytes == 16) {
        copy_async_16(block + extra_offset, extra_source + u * extra_step, true);
      } else if (extra_bytes == 4) {
        copy_async_4(block + extra_offset, extra_source + u * extra_step, true);
      }
    }
    a_source += 32 * tcb_stage_blocks;
    b_source[0] += 32 * tcb_stage_blocks;
    b_source[1] += 32 * tcb_stage_blocks;
    extra_source += tcb_stage_blocks * extra_step;
  }
};

__global__ void __launch_bounds__(tcb_threads, 1)
    tensor_core_block_kernel(const std::int8_t* a, const std::uint32_t* a_scales, const unsigned* a_slow,
                             const std::int8_t* b, const std::uint32_t* b_scales, const unsigned* b_slow,
                             std::int64_t m, std::int64_t n, std::int64_t stride, std::int64_t padded_m,
                             std::int64_t padded_n, std::int64_t blocks, std::int64_t tiles_m, std::int64_t tiles_n,
                             output_rounding output, float* out) {
  MXSCOPE_DYNAMIC_SHARED(uint4, tcb_shared);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group_id = lane / 4;
  const int thread_in_group = lane % 4;
  const int warp_m = warp / 4;  // 0..1: 64 rows each
  const int warp_n = warp % 4;  // 0..3: 64 columns each
  const tile_origin origin =
      grouped_tile_origin(static_cast<int>(blockIdx.x), static_cast<int>(tiles_m), static_cast<int>(tiles_n),
                          tcb_tile_m, tcb_tile_n);
  const int i0 = origin.i0;
  const int j0 = origin.j0;
  const int block_count = static_cast<int>(blocks);
  // ldmatrix row addresses of this lane (matrix lane / 8, its row lane % 8): A matrices 0..3 are
  // (rows 0-7, k 0-15), (rows 8-15, k 0-15), (rows 0-7, k 16-31), (rows 8-15, k 16-31) of an m16
  // tile, i.e. a0..a3; B matrices are (n8 tile 2p, k 0-15), (2p, k 16-31), (2p+1, k 0-15),
  // (2p+1, k 16-31), i.e. b0, b1 of two n8 tiles.
  // Rows 16 apart keep the swizzle, so the tiles mi and p are 512 bytes further on.
  const int matrix = lane / 8;
  const int a_matrix_offset = tcb_opaque(static_cast<int>(offsetof(tcb_block, a)) +
                                         tcb_offset(warp_m * 64 + (matrix % 2) * 8 + lane % 8, matrix / 2));
  const int b_matrix_offset =
      static_cast<int>(offsetof(tcb_block, b)) + tcb_offset(warp_n * 64 + (matrix / 2) * 8 + lane % 8, matrix % 2);
  // This thread's first row of A (+ 16 mi, + 8) and first column pair of B (+ 8 ni) in C.
  const int row_base = warp_m * 64 + group_id;
  const int col_base = warp_n * 64 + 2 * thread_in_group;

  float accumulators[4][8][4];
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int ni = 0; ni < 8; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) accumulators[mi][ni][e] = 0.0f;

  tcb_loader loader(a, a_scales, a_slow, b, b_scales, b_slow, m, n, stride, padded_m, padded_n, i0, j0);
  unsigned char* const shared_bytes = reinterpret_cast<unsigned char*>(tcb_shared);
#pragma unroll
  for (int s = 0; s < tcb_stages - 1; ++s) {
    const int first = s * tcb_stage_blocks;
    if (first < block_count) loader.load(shared_bytes + s * tcb_stage_bytes, block_count - first);
    copy_async_commit();
  }

  int compute_stage = 0;
  int load_stage = tcb_stages - 1;
  for (int kb0 = 0; kb0 < block_count; kb0 += tcb_stage_blocks) {
    copy_async_wait<tcb_stages - 2>();
    __syncthreads();
    // Refill the stage everyone finished with in the previous iteration.
    const int next = kb0 + (tcb_stages - 1) * tcb_stage_blocks;
    if (next < block_count) loader.load(shared_bytes + load_stage * tcb_stage_bytes, block_count - next);
    copy_async_commit();
    load_stage = load_stage == tcb_stages - 1 ? 0 : load_stage + 1;
    const unsigned char* const stage_bytes = shared_bytes + compute_stage * tcb_stage_bytes;
    compute_stage = compute_stage == tcb_stages - 1 ? 0 : compute_stage + 1;

#pragma unroll 1
    for (int u = 0; u < tcb_stage_blocks; ++u) {
      if (kb0 + u >= block_count) break;
      const unsigned char* const block_bytes = stage_bytes + u * sizeof(tcb_block);
      const tcb_block& stage = *reinterpret_cast<const tcb_block*>(block_bytes);
      std::uint32_t b_fragments[8][2];
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        std::uint32_t r[4];
        load_matrix_x4(r, block_bytes + b_matrix_offset + 512 * p);
        b_fragments[2 * p][0] = r[0];
        b_fragments[2 * p][1] = r[1];
        b_fragments[2 * p + 1][0] = r[2];
        b_fragments[2 * p + 1][1] = r[3];
      }
      const bool fast = (stage.slow[0] | stage.slow[1] | stage.slow[2]) == 0U;  // the same in every thread
      if (fast) {
        float col_scales[8][2];
#pragma unroll
        for (int ni = 0; ni < 8; ++ni) {
          const uint2 pair = *reinterpret_cast<const uint2*>(&stage.b_scales[col_base + ni * 8]);
          col_scales[ni][0] = core_ns::bits_float(pair.x);
          col_scales[ni][1] = core_ns::bits_float(pair.y);
        }
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) {
          std::uint32_t a_fragment[4];
          load_matrix_x4(a_fragment, block_bytes + a_matrix_offset + 512 * mi);
          const int row = row_base + mi * 16;
          const float row_scales[2] = {core_ns::bits_float(stage.a_scales[row]),
                                       core_ns::bits_float(stage.a_scales[row + 8])};
          const float offsets[2] = {__fmul_rn(-tcb_magic_value, row_scales[0]),
                                    __fmul_rn(-tcb_magic_value, row_scales[1])};
          // Four independent mma at a time, then their 32 steps.
#pragma unroll
          for (int n4 = 0; n4 < 8; n4 += 4) {
            int d[4][4];
#pragma unroll
            for (int q = 0; q < 4; ++q) mma_s8_offset(d[q], a_fragment, b_fragments[n4 + q], tcb_magic);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const float x = __fmaf_rn(core_ns::bits_float(static_cast<std::uint32_t>(d[q][e])), row_scales[e / 2],
                                          offsets[e / 2]);
                float& accumulator = accumulators[mi][n4 + q][e];
                accumulator = __fmaf_rn(x, col_scales[n4 + q][e % 2], accumulator);
              }
            }
          }
        }
      } else {
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) {
          std::uint32_t a_fragment[4];
          load_matrix_x4(a_fragment, block_bytes + a_matrix_offset + 512 * mi);
#pragma unroll
          for (int ni = 0; ni < 8; ++ni) {
            int d[4];
            mma_s8_offset(d, a_fragment, b_fragments[ni], tcb_magic);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              // k = (ea - fa) + (eb - fb) - 0; NaN markers pass through. Rows past the end meet
              // padded scales (0: a finite, unused step).
              const int row = row_base + mi * 16 + (e / 2) * 8;
              const int col = col_base + ni * 8 + e % 2;
              accumulators[mi][ni][e] =
                  tensor_core_step(accumulators[mi][ni][e], d[e] - tcb_magic, tc_scale_exponent(stage.a_scales[row]),
                                   tc_scale_exponent(stage.b_scales[col]), 0);
            }
          }
        }
      }
    }
  }
  copy_async_wait<0>();

#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
    for (int ni = 0; ni < 8; ++ni) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const std::int64_t i = i0 + warp_m * 64 + mi * 16 + group_id + (e / 2) * 8;
        const std::int64_t j = j0 + warp_n * 64 + ni * 8 + 2 * thread_in_group + e % 2;
        if (i < m && j < n) out[i * n + j] = finish_output(accumulators[mi][ni][e] * 1.0f, output);
      }
    }
  }
}

#if !defined(MXSCOPE_GPU_SIMULATE)

// -------------------------------------------------------------------------------------------
// The sm_90a fp32-block kernel (tensor_core_wgmma_kernel): the block dots from the asynchronous
// warpgroup MMA (wgmma.mma_async m64n64k32 s8 x s8 -> s32, both operands read from shared memory
// through matrix descriptors) and the same two fmas per step as tensor_core_block_kernel. The mma
// starts from zero (scale-d 0); one integer addition per entry adds tcb_magic, so that the bits
// read as the fp32 number 1.5 * 2^23 + D.
//
// A thread block of two warpgroups computes 128 x 128 entries, each warpgroup 64 rows: 64 fp32
// accumulators per thread and two sets of 32 s32 dot registers, one per half of the 128 columns.
// Within a K-block, the mma of the second half runs while the first half is stepped. No mma stays
// in flight from one K-block to the next: ptxas serializes every mma of a loop whose flight
// crosses the back edge while registers of other mma are read (C7514), which costs more than the
// overlap gains. Stages hold four K-blocks, i.e. rows of 128 bytes in the 128-byte swizzle of the
// descriptors (16-byte chunk c of row r at 128 r + 16 (c ^ (r mod 8)), 1024-byte aligned); they are
// filled by cp.async, which writes through the generic proxy, so every thread fences the async
// proxy (fence.proxy.async) before the barrier that hands a stage to the mma.

constexpr int tcw_tile = 128;
constexpr int tcw_threads = 256;
constexpr int tcw_stage_blocks = 4;  // 4 x 32 bytes: a 128-byte row
constexpr int tcw_stages = 4;

struct alignas(1024) tcw_stage {
  std::uint8_t a[tcw_tile * 128];
  std::uint8_t b[tcw_tile * 128];
  std::uint32_t a_scales[tcw_stage_blocks][tcw_tile];
  std::uint32_t b_scales[tcw_stage_blocks][tcw_tile];
  unsigned slow[tcw_stage_blocks][4];  // per K-block: the A tile's flag, the B tile's, unused
};
constexpr std::size_t tcw_shared_bytes = tcw_stages * sizeof(tcw_stage) + 1024;  // + alignment slack
static_assert(tcw_tile == tc_flag_rows && tc_scale_row_pad % tcw_tile == 0);

__global__ void wgmma_probe_kernel(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *out = 1;
#else
  *out = 0;
#endif
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// The shared-memory matrix descriptor of a K-major operand in the 128-byte swizzle: start address,
// leading byte offset unused (1), stride byte offset 1024 (8 rows of 128 bytes), swizzle mode 1.
__device__ inline std::uint64_t tcw_descriptor(const void* shared) {
  const auto address = static_cast<std::uint64_t>(__cvta_generic_to_shared(shared));
  return ((address & 0x3FFFFULL) >> 4) | (1ULL << 16) | ((1024ULL >> 4) << 32) | (1ULL << 62);
}

__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ inline void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int Pending>
__device__ inline void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
}
__device__ inline void proxy_fence_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// d = A B^T for the 64 x 32 A and 64 x 32 B tiles of the descriptors (s8, s32; scale-d 0).
__device__ inline void wgmma_s8_m64n64k32(int (&d)[32], std::uint64_t a_descriptor, std::uint64_t b_descriptor) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p;\n}\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]), "=r"(d[4]), "=r"(d[5]), "=r"(d[6]), "=r"(d[7]), "=r"(d[8]), "=r"(d[9]), "=r"(d[10]), "=r"(d[11]), "=r"(d[12]), "=r"(d[13]), "=r"(d[14]), "=r"(d[15]), "=r"(d[16]), "=r"(d[17]), "=r"(d[18]), "=r"(d[19]), "=r"(d[20]), "=r"(d[21]), "=r"(d[22]), "=r"(d[23]), "=r"(d[24]), "=r"(d[25]), "=r"(d[26]), "=r"(d[27]), "=r"(d[28]), "=r"(d[29]), "=r"(d[30]), "=r"(d[31])
      : "l"(a_descriptor), "l"(b_descriptor));
}
#endif

__global__ void __launch_bounds__(tcw_threads, 1)
    tensor_core_wgmma_kernel(const std::int8_t* a, const std::uint32_t* a_scales, const unsigned* a_slow,
                             const std::int8_t* b, const std::uint32_t* b_scales, const unsigned* b_slow,
                             std::int64_t m, std::int64_t n, std::int64_t stride, std::int64_t padded_m,
                             std::int64_t padded_n, std::int64_t blocks, std::int64_t tiles_m, std::int64_t tiles_n,
                             output_rounding output, float* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char tcw_raw[];
  // 1024-byte aligned by an offset into the array (not an integer cast), so that the compiler
  // still knows these are shared-memory addresses (LDS, not generic loads).
  const unsigned raw_address = static_cast<unsigned>(__cvta_generic_to_shared(tcw_raw));
  tcw_stage* const stages = reinterpret_cast<tcw_stage*>(tcw_raw + ((1024U - (raw_address & 1023U)) & 1023U));
  const int t = threadIdx.x;
  const int warpgroup = t / 128;
  const int warp = (t / 32) % 4;
  const int lane = t % 32;
  const tile_origin origin = grouped_tile_origin(static_cast<int>(blockIdx.x), static_cast<int>(tiles_m),
                                                 static_cast<int>(tiles_n), tcw_tile, tcw_tile);
  const int i0 = origin.i0;
  const int j0 = origin.j0;
  const int block_count = static_cast<int>(blocks);
  const int stage_count = (block_count + tcw_stage_blocks - 1) / tcw_stage_blocks;

  // The copies of one stage: four 16-byte chunks of A and of B (chunk q = t + 256 p: row q / 8,
  // chunk q % 8, i.e. K-block (q % 8) / 2), one 16-byte chunk of scales, and for 8 threads a flag.
  // Rows past the end copy the last row; K-blocks past the end are zero-filled.
  const auto load_stage = [&](int s) {
    tcw_stage& stage = stages[s % tcw_stages];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int q = t + 256 * p;
      const int row = q / 8;
      const int chunk = q % 8;
      const bool inside = 4 * s + chunk / 2 < block_count;
      const std::int64_t column = inside ? 128 * static_cast<std::int64_t>(s) + 16 * chunk : 0;
      copy_async_16(stage.a + swizzled_offset(row, chunk),
                    a + std::min<std::int64_t>(i0 + row, m - 1) * stride + column, inside);
      copy_async_16(stage.b + swizzled_offset(row, chunk),
                    b + std::min<std::int64_t>(j0 + row, n - 1) * stride + column, inside);
    }
    {
      const int u = (t % 128) / 32;
      const int chunk = t % 32;
      const bool inside = 4 * s + u < block_count;
      const std::int64_t block = inside ? 4 * s + u : 0;
      if (t < 128) {
        copy_async_16(&stage.a_scales[u][4 * chunk], a_scales + block * padded_m + i0 + 4 * chunk, inside);
      } else {
        copy_async_16(&stage.b_scales[u][4 * chunk], b_scales + block * padded_n + j0 + 4 * chunk, inside);
      }
    }
    if (t < 8) {
      const int u = t / 2;
      const bool inside = 4 * s + u < block_count;
      const std::int64_t block = inside ? 4 * s + u : 0;
      const unsigned* source = t % 2 == 0 ? a_slow + block * (padded_m / tcw_tile) + i0 / tcw_tile
                                          : b_slow + block * (padded_n / tcw_tile) + j0 / tcw_tile;
      copy_async_4(&stage.slow[u][t % 2], source, inside);
    }
  };

  float accumulators[64];
  int dots[2][32];  // the two column halves of a K-block: one is multiplied while the other is stepped
#pragma unroll
  for (int i = 0; i < 64; ++i) accumulators[i] = 0.0f;
  // This thread's rows (+ 8) and first column pair (+ 8 j, + 64 for the second half) in the tile.
  const int row0 = warpgroup * 64 + warp * 16 + lane / 4;
  const int col0 = 2 * (lane % 4);

  // Stage s is stepped while s + 1 .. s + 3 load; making stage s ready refills the slot of s - 1,
  // whose mma every thread has waited for before the barrier.
  constexpr int prefetch = tcw_stages - 1;
#pragma unroll
  for (int s = 0; s < prefetch; ++s) {
    if (s < stage_count) load_stage(s);
    copy_async_commit();
  }
  const auto make_ready = [&](int s) {
    copy_async_wait<prefetch - 1>();
    proxy_fence_shared();  // this thread's copies are read by the async proxy (wgmma)
    __syncthreads();
    if (s + prefetch < stage_count) load_stage(s + prefetch);
    copy_async_commit();
  };
  // The mma of column half h of K-block kb into its register set.
  const auto issue = [&](int (&d)[32], int kb, int h) {
    const tcw_stage& stage = stages[(kb / tcw_stage_blocks) % tcw_stages];
    const int u = kb % tcw_stage_blocks;
    wgmma_fence();
    wgmma_s8_m64n64k32(d, tcw_descriptor(stage.a + warpgroup * 64 * 128 + 32 * u),
                       tcw_descriptor(stage.b + h * 64 * 128 + 32 * u));
    wgmma_commit();
  };
  // A K-block's scale operands, read before its mma are waited for (they do not depend on them):
  // the tile flags, the two row scales and their offsets, and one half's column scale pairs.
  struct block_scales {
    bool fast;
    float rows[2];
    float offsets[2];
  };
  const auto read_scales = [&](int kb) {
    const tcw_stage& stage = stages[(kb / tcw_stage_blocks) % tcw_stages];
    const int u = kb % tcw_stage_blocks;
    block_scales scales;
    scales.fast = (stage.slow[u][0] | stage.slow[u][1]) == 0U;  // the same in every thread
    scales.rows[0] = core_ns::bits_float(stage.a_scales[u][row0]);
    scales.rows[1] = core_ns::bits_float(stage.a_scales[u][row0 + 8]);
    scales.offsets[0] = __fmul_rn(-tcb_magic_value, scales.rows[0]);
    scales.offsets[1] = __fmul_rn(-tcb_magic_value, scales.rows[1]);
    return scales;
  };
  const auto read_columns = [&](uint2 (&columns)[8], int kb, int h) {
    const tcw_stage& stage = stages[(kb / tcw_stage_blocks) % tcw_stages];
    const int u = kb % tcw_stage_blocks;
#pragma unroll
    for (int j = 0; j < 8; ++j) columns[j] = *reinterpret_cast<const uint2*>(&stage.b_scales[u][col0 + 64 * h + 8 * j]);
  };
  // The fp32-block steps of column half h of K-block kb from its register set: d[4 j + 2 r + e]
  // is the dot D of row row0 + 8 r, column col0 + 64 h + 8 j + e.
  const auto step = [&](const int (&d)[32], int kb, int h, const block_scales& scales, const uint2 (&columns)[8]) {
    float* const half_accumulators = accumulators + 32 * h;
    if (scales.fast) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float col_scales[2] = {core_ns::bits_float(columns[j].x), core_ns::bits_float(columns[j].y)};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int i = 4 * j + 2 * r + e;
            const float x = __fmaf_rn(core_ns::bits_float(static_cast<std::uint32_t>(d[i] + tcb_magic)),
                                      scales.rows[r], scales.offsets[r]);
            half_accumulators[i] = __fmaf_rn(x, col_scales[e], half_accumulators[i]);
          }
        }
      }
    } else {
      const tcw_stage& stage = stages[(kb / tcw_stage_blocks) % tcw_stages];
      const int u = kb % tcw_stage_blocks;
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int row = row0 + 8 * ((i / 2) % 2);
        const int col = col0 + 64 * h + 8 * (i / 4) + i % 2;
        half_accumulators[i] =
            tensor_core_step(half_accumulators[i], d[i], tc_scale_exponent(stage.a_scales[u][row]),
                             tc_scale_exponent(stage.b_scales[u][col]), 0);
      }
    }
  };

  for (int kb = 0; kb < block_count; ++kb) {
    if (kb % tcw_stage_blocks == 0) make_ready(kb / tcw_stage_blocks);
    const block_scales scales = read_scales(kb);
    uint2 columns[2][8];
    read_columns(columns[0], kb, 0);
    issue(dots[0], kb, 0);
    issue(dots[1], kb, 1);
    read_columns(columns[1], kb, 1);
    wgmma_wait<1>();  // half 0's mma is done; half 1's runs during the steps below
    step(dots[0], kb, 0, scales, columns[0]);
    wgmma_wait<0>();
    step(dots[1], kb, 1, scales, columns[1]);
  }
  copy_async_wait<0>();

#pragma unroll
  for (int i = 0; i < 64; ++i) {
    const int h = i / 32;
    const int k = i % 32;
    const std::int64_t row = i0 + row0 + 8 * ((k / 2) % 2);
    const std::int64_t col = j0 + col0 + 64 * h + 8 * (k / 4) + k % 2;
    if (row < m && col < n) out[row * n + col] = finish_output(accumulators[i] * 1.0f, output);
  }
#else
  // Built without sm_90a: wgmma_present() reports false and the host never launches this.
  (void)a, (void)a_scales, (void)a_slow, (void)b, (void)b_scales, (void)b_slow, (void)m, (void)n, (void)stride;
  (void)padded_m, (void)padded_n, (void)blocks, (void)tiles_m, (void)tiles_n, (void)output, (void)out;
#endif
}

// -------------------------------------------------------------------------------------------
// The sm_90a fp32-block kernel of MXFP4 operands with the block scales inside them
// (tensor_core_scaled_kernel): A and B hold q 2^e as bf16 numbers (prepare_scaled_kernel), so the
// warpgroup MMA's fp32 result for one K-block, two wgmma.mma_async m64n64k16 bf16 (the first
// with scale-d 0, the second adding to it), is the scaled block dot D 2^(ea + eb) itself, and the
// step fl32(acc + D 2^k) is one fp32 addition. That value is exact wherever the kernel runs
// (scaled_kernel_fits): the products of two elements are 2qa 2qb 2^(k - 2) with |2q| <= 12, and
// every partial sum of a block's 32 is an integer multiple of 2^(k - 2) below 2^13 2^(k - 2), so
// with -124 <= k <= 117 they are all normal fp32 numbers (or zero) whatever the order of the
// additions; sm_90's bf16 tensor core aligns its 16-product steps 25 bits below the largest
// exponent sum (docs/conformance.md), far below these sums' last bit. A block dot of zero may
// come out as -0; acc starts at +0 and can never become -0 (an addition rounded to nearest gives
// -0 only from two negative zeros), so acc + (-0) = acc as acc + 0 does.
//
// The fp8 form (Fp8 = true; prepare_fp8_kernel) halves the tensor core's time per block: A and B
// hold q 2^(e - b) as e5m2 numbers with one base exponent b per 128-row tile and K-block, so one
// wgmma m64n64k32 e5m2 (scale-d 0) gives D 2^(da + db), da = ea - ba and db = eb - bb the same for
// all 32 products of an entry, and the step is fl32(acc + D 2^(da + db) 2^(ba + bb)), one fma with
// the tile pair's scale 2^(ba + bb) (a normal fp32 number: prepare_fp8_kernel). The products are
// 2qa 2qb 2^(da + db - 2) with -30 <= da + db <= 26, every partial sum a multiple of
// 2^(da + db - 2) below 2^13 2^(da + db - 2): at most 13 significant bits, all normal. The H200
// conformance captures (docs/conformance.md) measured sm_90's fp8 tensor core as 32-product steps
// aligned 13 bits below the largest exponent sum (here at most da + db + 4: 6 x 6 = 2.25 2^4), so
// it drops nothing above 2^(da + db - 9), and a result of 14 significant bits: exact here.
//
// A thread block computes 128 x 256 entries with three warpgroups. The first loads: one thread
// moves each stage (a 16 KiB tile of A and two of B, already in the shared-memory layout: two
// K-blocks of bf16 or four of fp8, and for fp8 the three tiles' bases) with bulk asynchronous
// copies that complete on the stage's "full" barrier, after the stage's "empty" barrier says both
// consumers are done with its previous contents. Each of the other two computes 64 rows: 128 fp32
// accumulators per thread and two sets of 32 dot registers for the four column quarters of a
// K-block (the mma of one quarter runs while the previous one is added). The consumers wait on
// barriers, not on each other, so one adds while the other's mma run. setmaxnreg moves registers
// from the loader to them.
constexpr int tcs_tile_m = 128;
constexpr int tcs_tile_n = 256;
constexpr int tcs_threads = 384;
constexpr int tcs_stages = 4;
constexpr int tcs_consumer_threads = 256;

struct alignas(1024) tcs_stage {
  unsigned char a[tcs_tile_m * 128];  // 128 rows x 128 bytes, in prepare_scaled_kernel's or prepare_fp8_kernel's layout
  unsigned char b[tcs_tile_n * 128];  // two such tiles
};
struct tcs_shared {
  tcs_stage stages[tcs_stages];
  std::int32_t bases[tcs_stages][3][4];  // fp8: per stage the A tile's, then B's two tiles' bases
  std::uint64_t full[tcs_stages];
  std::uint64_t empty[tcs_stages];
};
constexpr std::size_t tcs_shared_bytes = sizeof(tcs_shared) + 1024;  // + alignment slack
static_assert(scaled_tile_rows == 128 && tcs_tile_n % scaled_tile_rows == 0 && scaled_row_pad % tcs_tile_n == 0 &&
              scaled_row_pad % tcs_tile_m == 0);

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d (+)= A B^T for the 64 x 16 bf16 A and B tiles of the descriptors, fp32; Accumulate false: scale-d 0.
template <bool Accumulate>
__device__ inline void wgmma_bf16_m64n64k16(float (&d)[32], std::uint64_t a_descriptor, std::uint64_t b_descriptor) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a_descriptor), "l"(b_descriptor), "n"(Accumulate ? 1 : 0));
}

// d = A B^T for the 64 x 32 e5m2 A and B tiles of the descriptors, fp32 (scale-d 0).
__device__ inline void wgmma_e5m2_m64n64k32(float (&d)[32], std::uint64_t a_descriptor, std::uint64_t b_descriptor) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e5m2.e5m2 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a_descriptor), "l"(b_descriptor));
}

__device__ inline void barrier_init(std::uint64_t* barrier, unsigned count) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(barrier));
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(address), "r"(count) : "memory");
}
__device__ inline void barrier_arrive(std::uint64_t* barrier) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(barrier));
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(address) : "memory");
}
__device__ inline void barrier_expect_bytes(std::uint64_t* barrier, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(
                   static_cast<unsigned>(__cvta_generic_to_shared(barrier))),
               "r"(bytes)
               : "memory");
}
// Returns once the phase of the given parity (0 for the first) has completed.
__device__ inline void barrier_wait(std::uint64_t* barrier, unsigned parity) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(barrier));
  unsigned done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(address), "r"(parity)
        : "memory");
  } while (done == 0);
}
// A bulk asynchronous copy of `bytes` (a multiple of 16, both ends 16-byte aligned) that completes
// on `barrier`.
__device__ inline void bulk_copy(void* shared_destination, const void* global_source, unsigned bytes,
                                 std::uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          static_cast<unsigned>(__cvta_generic_to_shared(shared_destination))),
      "l"(global_source), "r"(bytes), "r"(static_cast<unsigned>(__cvta_generic_to_shared(barrier)))
      : "memory");
}
#endif

template <bool Fp8>
__global__ void __launch_bounds__(tcs_threads, 1)
    tensor_core_scaled_kernel(const unsigned char* a, const unsigned char* b, const std::int32_t* a_bases,
                              const std::int32_t* b_bases, std::int64_t m, std::int64_t n, std::int64_t blocks,
                              std::int64_t tiles_m, std::int64_t tiles_n, output_rounding output, float* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char tcs_raw[];
  const unsigned raw_address = static_cast<unsigned>(__cvta_generic_to_shared(tcs_raw));
  tcs_shared& shared = *reinterpret_cast<tcs_shared*>(tcs_raw + ((1024U - (raw_address & 1023U)) & 1023U));
  const int t = threadIdx.x;
  const int warpgroup = t / 128;
  // Persistent: thread block p computes tiles p, p + grid, ... in the grouped order, so that the
  // loader fills the next tile's stages while the consumers store this one's entries. Both roles
  // count stages over all their tiles (use), which gives each barrier's slot and parity.
  const int tile_count = static_cast<int>(tiles_m * tiles_n);
  const auto origin_of = [&](int tile) {
    return grouped_tile_origin(tile, static_cast<int>(tiles_m), static_cast<int>(tiles_n), tcs_tile_m, tcs_tile_n);
  };
  const int block_count = static_cast<int>(blocks);
  constexpr int stage_blocks = Fp8 ? fp8_tile_k_blocks : 2;  // K-blocks per 128-byte row
  const int chunks = (block_count + stage_blocks - 1) / stage_blocks;  // stages
  if (t == 0) {
    for (int s = 0; s < tcs_stages; ++s) {
      barrier_init(&shared.full[s], 1);
      barrier_init(&shared.empty[s], tcs_consumer_threads);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (t == 0) {
      const std::int64_t b_second = static_cast<std::int64_t>(chunks) * scaled_tile_bytes;  // the next 128 rows
      int use = 0;
      for (int tile = static_cast<int>(blockIdx.x); tile < tile_count; tile += static_cast<int>(gridDim.x)) {
        const tile_origin origin = origin_of(tile);
        const unsigned char* a_source =
            a + static_cast<std::int64_t>(origin.i0 / scaled_tile_rows) * chunks * scaled_tile_bytes;
        const unsigned char* b_source =
            b + static_cast<std::int64_t>(origin.j0 / scaled_tile_rows) * chunks * scaled_tile_bytes;
        const std::int32_t* const a_base_source =
            Fp8 ? a_bases + static_cast<std::int64_t>(origin.i0 / scaled_tile_rows) * chunks * 4 : nullptr;
        const std::int32_t* const b_base_source =
            Fp8 ? b_bases + static_cast<std::int64_t>(origin.j0 / scaled_tile_rows) * chunks * 4 : nullptr;
        for (int s = 0; s < chunks; ++s, ++use) {
          const int slot = use % tcs_stages;
          if (use >= tcs_stages) barrier_wait(&shared.empty[slot], static_cast<unsigned>(use / tcs_stages - 1) & 1U);
          barrier_expect_bytes(&shared.full[slot], sizeof(tcs_stage) + (Fp8 ? 3 * 16 : 0));
          tcs_stage& stage = shared.stages[slot];
          const std::int64_t step = static_cast<std::int64_t>(s) * scaled_tile_bytes;
          bulk_copy(stage.a, a_source + step, scaled_tile_bytes, &shared.full[slot]);
          bulk_copy(stage.b, b_source + step, scaled_tile_bytes, &shared.full[slot]);
          bulk_copy(stage.b + scaled_tile_bytes, b_source + b_second + step, scaled_tile_bytes, &shared.full[slot]);
          if (Fp8) {
            bulk_copy(shared.bases[slot][0], a_base_source + 4 * s, 16, &shared.full[slot]);
            bulk_copy(shared.bases[slot][1], b_base_source + 4 * s, 16, &shared.full[slot]);
            bulk_copy(shared.bases[slot][2], b_base_source + 4 * (chunks + s), 16, &shared.full[slot]);
          }
        }
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");

  const int consumer = warpgroup - 1;  // rows 64 consumer ..
  const int warp = (t / 32) % 4;
  const int lane = t % 32;
  float accumulators[4][32];  // [column quarter][dot register]
  float dots[2][32];          // quarters 0, 2 and 1, 3
#pragma unroll
  for (int i = 0; i < 32; ++i) dots[0][i] = dots[1][i] = 0.0f;

  // Descriptors of stage 0's A rows of this consumer and B's first quarter; a stage is
  // sizeof(tcs_stage) further, K-block u of a stage 64 u bytes (bf16; its second k16 32 bytes) or
  // 32 u bytes (fp8), quarter q of B 64 q rows (8192 q bytes); descriptors count 16-byte units.
  const std::uint64_t a_descriptor = tcw_descriptor(shared.stages[0].a + consumer * 64 * 128);
  const std::uint64_t b_descriptor = tcw_descriptor(shared.stages[0].b);
  const auto issue = [&](float (&d)[32], std::uint64_t a_at, std::uint64_t b_at, int quarter) {
    const std::uint64_t b_quarter = b_at + static_cast<std::uint64_t>(quarter * 8192 / 16);
    wgmma_fence();
    if constexpr (Fp8) {
      wgmma_e5m2_m64n64k32(d, a_at, b_quarter);
    } else {
      wgmma_bf16_m64n64k16<false>(d, a_at, b_quarter);
      wgmma_bf16_m64n64k16<true>(d, a_at + 2, b_quarter + 2);
    }
    wgmma_commit();
  };
  // The step of one quarter: fl32(acc + D 2^k), the scale (fp8: 2^(ba + bb)) applied exactly.
  const auto add = [&](float (&accumulator)[32], const float (&d)[32], float scale) {
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      accumulator[i] = Fp8 ? __fmaf_rn(d[i], scale, accumulator[i]) : __fadd_rn(accumulator[i], d[i]);
    }
  };
  // 2^(ba + bb) as an fp32 number; clamped for tile pairs where a tile has no nonzero block (D is
  // zero there; elsewhere prepare_fp8_kernel keeps the sum in range).
  const auto pair_scale = [](int exponent) {
    return core_ns::bits_float(static_cast<std::uint32_t>(min(max(exponent, -126), 127) + 127) << 23);
  };

  // Within a stage the quarters' mma form one stream, two in flight: quarter q of K-block u goes
  // into dot set q % 2 once quarter q - 2's dots are added, so K-block u + 1's first two start while
  // u's last two are added. The stream drains at the end of each stage: ptxas serializes every
  // wgmma (C7514) when one is in flight across a branch or the loop's back edge.
  const auto scales_of = [&](int slot, int u, float (&scales)[2]) {  // B's first and second 128 rows
    scales[0] = scales[1] = 1.0f;
    if constexpr (Fp8) {
      const int a_base = shared.bases[slot][0][u];
      scales[0] = pair_scale(a_base + shared.bases[slot][1][u]);
      scales[1] = pair_scale(a_base + shared.bases[slot][2][u]);
    }
  };
  const int full_stages = block_count / stage_blocks;
  int use = 0;
  for (int tile = static_cast<int>(blockIdx.x); tile < tile_count; tile += static_cast<int>(gridDim.x)) {
    const tile_origin origin = origin_of(tile);
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int i = 0; i < 32; ++i) accumulators[q][i] = 0.0f;
#pragma unroll 1
    for (int s = 0; s < full_stages; ++s, ++use) {
      const int slot = use % tcs_stages;
      barrier_wait(&shared.full[slot], static_cast<unsigned>(use / tcs_stages) & 1U);
      const std::uint64_t stage_units = static_cast<std::uint64_t>(slot) * (sizeof(tcs_stage) / 16);
      const auto at = [&](int u, std::uint64_t descriptor) {
        return descriptor + stage_units + static_cast<std::uint64_t>((Fp8 ? 2 : 4) * u);
      };
      issue(dots[0], at(0, a_descriptor), at(0, b_descriptor), 0);
      issue(dots[1], at(0, a_descriptor), at(0, b_descriptor), 1);
#pragma unroll
      for (int u = 0; u < stage_blocks; ++u) {
        float scales[2];
        scales_of(slot, u, scales);
        wgmma_wait<1>();
        add(accumulators[0], dots[0], scales[0]);
        issue(dots[0], at(u, a_descriptor), at(u, b_descriptor), 2);
        wgmma_wait<1>();
        add(accumulators[1], dots[1], scales[0]);
        issue(dots[1], at(u, a_descriptor), at(u, b_descriptor), 3);
        wgmma_wait<1>();
        add(accumulators[2], dots[0], scales[1]);
        if (u + 1 < stage_blocks) {
          issue(dots[0], at(u + 1, a_descriptor), at(u + 1, b_descriptor), 0);
          wgmma_wait<1>();
          add(accumulators[3], dots[1], scales[1]);
          issue(dots[1], at(u + 1, a_descriptor), at(u + 1, b_descriptor), 1);
        } else {
          wgmma_wait<0>();
          add(accumulators[3], dots[1], scales[1]);
        }
      }
      barrier_arrive(&shared.empty[slot]);  // every mma reading this stage has completed
    }
    // The last stage when it holds fewer K-blocks: one K-block at a time.
    if (full_stages * stage_blocks < block_count) {
      const int s = full_stages;
      const int slot = use % tcs_stages;
      barrier_wait(&shared.full[slot], static_cast<unsigned>(use / tcs_stages) & 1U);
      const std::uint64_t stage_units = static_cast<std::uint64_t>(slot) * (sizeof(tcs_stage) / 16);
#pragma unroll 1
      for (int u = 0; stage_blocks * s + u < block_count; ++u) {
        float scales[2];
        scales_of(slot, u, scales);
        const std::uint64_t block_units = stage_units + static_cast<std::uint64_t>((Fp8 ? 2 : 4) * u);
        const std::uint64_t a_at = a_descriptor + block_units;
        const std::uint64_t b_at = b_descriptor + block_units;
        issue(dots[0], a_at, b_at, 0);
        issue(dots[1], a_at, b_at, 1);
        wgmma_wait<1>();
        add(accumulators[0], dots[0], scales[0]);
        issue(dots[0], a_at, b_at, 2);
        wgmma_wait<1>();
        add(accumulators[1], dots[1], scales[0]);
        issue(dots[1], a_at, b_at, 3);
        wgmma_wait<1>();
        add(accumulators[2], dots[0], scales[1]);
        wgmma_wait<0>();
        add(accumulators[3], dots[1], scales[1]);
      }
      barrier_arrive(&shared.empty[slot]);
      ++use;
    }

    // d[4 j + 2 r + e] of quarter q: row 16 warp + lane / 4 + 8 r, column 64 q + 8 j + 2 (lane % 4) + e.
    const std::int64_t row0 = origin.i0 + consumer * 64 + warp * 16 + lane / 4;
    const std::int64_t col0 = origin.j0 + 2 * (lane % 4);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const std::int64_t row = row0 + 8 * ((i / 2) % 2);
        const std::int64_t col = col0 + 64 * q + 8 * (i / 4) + i % 2;
        if (row < m && col < n) out[row * n + col] = finish_output(accumulators[q][i] * 1.0f, output);
      }
    }
  }  // tiles
#else
  // Built without sm_90a: wgmma_present() reports false and the host never launches this.
  (void)a, (void)b, (void)a_bases, (void)b_bases, (void)m, (void)n, (void)blocks, (void)tiles_m, (void)tiles_n;
  (void)output, (void)out;
#endif
}
#endif  // !MXSCOPE_GPU_SIMULATE

#endif  // MXSCOPE_CUDA_TENSOR_CORES

}  // namespace

namespace {
bool wgmma_present() {
#if defined(MXSCOPE_CUDA_TENSOR_CORES) && !defined(MXSCOPE_GPU_SIMULATE)
  // An sm_90 device and a build whose code for it is sm_90a (the probe kernel says which).
  static const bool present = [] {
    const auto properties = current_device_properties();
    if (!properties || properties->major != 9 || properties->minor != 0) return false;
    device_buffer flag(sizeof(int));
    flag.fill_bytes(0);
    runtime::launch(wgmma_probe_kernel, 1, 1, 0, flag.as<int>());
    int value = 0;
    flag.download(&value, sizeof(int));
    return value == 1;
  }();
  return present;
#else
  return false;
#endif
}
}  // namespace

#include "native_gfx950_kernels.hpp"  // the gfx950 native path (kernels for __gfx950__, stubs elsewhere)

namespace {
// Whether tensor_core_scaled_kernel computes this product exactly (see there): both operands have
// its bf16 form, no NaN block, every nonzero block's bf16 elements normal (-125 <= e <= 125), and
// every block dot's scale 2^k with -124 <= k <= 117.
bool scaled_kernel_fits(const prepared_operand::storage& a, const prepared_operand::storage& b) {
  if (a.scaled.bytes() == 0 || b.scaled.bytes() == 0 || a.scaled_nan || b.scaled_nan) return false;
  const auto inside = [](const prepared_operand::storage& x) {
    return x.scaled_lowest > x.scaled_highest || (x.scaled_lowest >= -125 && x.scaled_highest <= 125);
  };
  if (!inside(a) || !inside(b)) return false;
  if (a.scaled_lowest > a.scaled_highest || b.scaled_lowest > b.scaled_highest) return true;  // a zero operand
  return a.scaled_lowest + b.scaled_lowest >= -124 && a.scaled_highest + b.scaled_highest <= 117;
}
// The same for its fp8 form: also no 128-row tile of either operand spans more than fp8_window
// exponents in a K-block (prepare_fp8_kernel).
bool fp8_kernel_fits(const prepared_operand::storage& a, const prepared_operand::storage& b) {
  return scaled_kernel_fits(a, b) && a.fp8_fits && b.fp8_fits;
}
}  // namespace

void multiply_prepared(const prepared_operand& a_operand, const prepared_operand& b_operand,
                       const accumulation_model& model, output_rounding output, float* out, double* exact_out,
                       gemm_path path) {
  const auto& a = a_operand.data();
  const auto& b = b_operand.data();
  if (a.depth != b.depth) {
    throw input_error("gpu gemm: the reduction lengths differ: A has " + to_text(a.depth) + ", B has " +
                      to_text(b.depth));
  }
  if (a.block != b.block) {
    throw input_error("gpu gemm: field 'block': operands must have the same blocks along the reduction axis (" +
                      to_text(a.block) + " and " + to_text(b.block) + ")");
  }
  if (path == gemm_path::automatic) throw input_error("gpu gemm: multiply_prepared needs a concrete path");
  if (a.path != path || b.path != path) throw input_error("gpu gemm: operands were prepared for another path");
  if (path != gemm_path::generic && (!a.finite_elements || !b.finite_elements)) {
    // Inf or NaN element codes (possible in hardware-produced fp8 codes) need the per-product path.
    throw input_error("gpu gemm: an operand holds NaN or infinite element codes; only the generic path covers them");
  }
  if (!gemm_path_covers(path, a.element, b.element, a.block, model)) {
    throw input_error("gpu gemm: path " + std::string(gemm_path_name(path)) +
                      " does not cover these operands and model");
  }
  if (model.kind == accumulation_kind::fp32_group && model.blocks_per_group < 1) {
    throw input_error("gpu gemm: field 'accum': G must be positive");
  }
  const std::int64_t m = a.rows;
  const std::int64_t n = b.rows;
  if (m == 0 || n == 0) return;
  const int fraction_total = fraction_bits_of(a.element) + fraction_bits_of(b.element);
  switch (path) {
    case gemm_path::generic: {
      const unsigned grid = grid_for(m * n, 128);
      const auto* ae = a.elements.as<const float>();
      const auto* be = b.elements.as<const float>();
      const auto* ax = a.exponents.as<const std::int32_t>();
      const auto* bx = b.exponents.as<const std::int32_t>();
      switch (model.kind) {
        case accumulation_kind::exact:
          runtime::launch(generic_product_kernel<generic_mode::exact>, grid, 128, 0, ae, ax, be, bx, m, n, a.depth,
                          a.block, 1, output, out, exact_out, plain_rows_view{}, plain_rows_view{}, 0);
          break;
        case accumulation_kind::fp32_seq:
          runtime::launch(generic_product_kernel<generic_mode::sequential>, grid, 128, 0, ae, ax, be, bx, m, n, a.depth,
                          a.block, 1, output, out, exact_out, plain_rows_view{}, plain_rows_view{}, 0);
          break;
        case accumulation_kind::fp32_block:
        case accumulation_kind::fp32_group:
          runtime::launch(generic_product_kernel<generic_mode::grouped>, grid, 128, 0, ae, ax, be, bx, m, n, a.depth,
                          a.block, model.kind == accumulation_kind::fp32_group ? model.blocks_per_group : 1, output,
                          out, exact_out, plain_rows_view{}, plain_rows_view{}, 0);
          break;
        default:
          // trunc-align and trunc-promote have no device kernel (gemm_path_covers refuses them first).
          throw input_error("gpu gemm: the generic path covers exact, fp32-block, fp32-group:G and fp32-seq");
      }

      break;
    }
    case gemm_path::integer:
      if (block_dot_bits(a.element, b.element, a.block) <= 31) {
        launch_integer<std::int32_t>(a, b, model, output, out, exact_out, fraction_total);
      } else if (block_dot_bits(a.element, b.element, a.block) <= 53) {
        launch_integer<double>(a, b, model, output, out, exact_out, fraction_total);  // exact: see the integer path
      } else {
        launch_integer<long long>(a, b, model, output, out, exact_out, fraction_total);
      }
      break;
    case gemm_path::tensor_core: {
#if defined(MXSCOPE_CUDA_TENSOR_CORES)
      const dim3 grid(static_cast<unsigned>((n + tc_tile - 1) / tc_tile),
                      static_cast<unsigned>((m + tc_tile - 1) / tc_tile));
      if (model.kind == accumulation_kind::exact) {
        device_buffer flagged(static_cast<std::size_t>(m * n));
        flagged.fill_bytes(0);
        const exponent_span_data a_spans = exponent_spans(a);
        const exponent_span_data b_spans = exponent_spans(b);
        const int dot_bits = bits_of(32 * tensor_core_integer_max(a.element) * tensor_core_integer_max(b.element));
        const int span_budget = 53 - dot_bits - bits_of(a.blocks);
        runtime::launch(tensor_core_exact_kernel, grid, 256, 0, a.bytes.as<const std::int8_t>(),
                        a.exponents.as<const std::int32_t>(), b.bytes.as<const std::int8_t>(),
                        b.exponents.as<const std::int32_t>(), m, n, a.byte_stride, a.blocks, fraction_total, output,
                        out, exact_out, flagged.as<std::uint8_t>(), a_spans.spans.as<const std::int32_t>(),
                        b_spans.spans.as<const std::int32_t>(), span_budget);
        runtime::launch(tensor_core_exact_fixup_kernel, grid_for(m * n), threads_per_block, 0,
                        a.bytes.as<const std::int8_t>(), a.exponents.as<const std::int32_t>(),
                        b.bytes.as<const std::int8_t>(), b.exponents.as<const std::int32_t>(), m, n, a.byte_stride,
                        a.blocks, fraction_total, output, flagged.as<const std::uint8_t>(), out, exact_out);
        synchronize();  // the flag buffer must outlive both kernels
      } else {
#if !defined(MXSCOPE_GPU_SIMULATE)
        // More than the default 48 KiB of dynamic shared memory (set on every call: the attribute
        // belongs to the current device).
        MXSCOPE_GPU_CHECK(cudaFuncSetAttribute(tensor_core_block_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(tcb_shared_bytes)));
#endif
        const std::int64_t tiles_m = (m + tcb_tile_m - 1) / tcb_tile_m;
        const std::int64_t tiles_n = (n + tcb_tile_n - 1) / tcb_tile_n;
        constexpr std::int64_t int_limit = std::numeric_limits<int>::max() / 2;
        if (tiles_m * tiles_n * tcb_group > int_limit || a.padded_rows * 4 > int_limit ||
            b.padded_rows * 4 > int_limit || a.blocks > int_limit) {
          throw input_error("gpu gemm: the product is too large for the tensor-core path (" + to_text(m) + " x " +
                            to_text(n) + " x " + to_text(a.depth) + ")");
        }
        tensor_core_kernel kernel = selected_tensor_core_kernel();
        if (kernel == tensor_core_kernel::wgmma_fp8 && !fp8_kernel_fits(a, b)) {
          kernel = tensor_core_kernel::wgmma_bf16;
        }
        if (kernel == tensor_core_kernel::wgmma_bf16 && !scaled_kernel_fits(a, b)) {
          kernel = tensor_core_kernel::mma_sync;
        }
        last_run_tensor_core_kernel.store(kernel);
        if (kernel == tensor_core_kernel::wgmma_fp8 || kernel == tensor_core_kernel::wgmma_bf16) {
#if !defined(MXSCOPE_GPU_SIMULATE)
          const bool fp8 = kernel == tensor_core_kernel::wgmma_fp8;
          const auto entry = fp8 ? tensor_core_scaled_kernel<true> : tensor_core_scaled_kernel<false>;
          MXSCOPE_GPU_CHECK(cudaFuncSetAttribute(entry, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(tcs_shared_bytes)));
          // 128 x 256 tiles, as tensor_core_block_kernel's.
          const auto& a_tiles = fp8 ? a.fp8 : a.scaled;
          const auto& b_tiles = fp8 ? b.fp8 : b.scaled;
          // Persistent: one thread block per multiprocessor (its shared memory allows no second).
          const std::int64_t persistent = std::min<std::int64_t>(tiles_m * tiles_n, multiprocessor_count());
          runtime::launch(entry, static_cast<unsigned>(persistent), tcs_threads, tcs_shared_bytes,
                          a_tiles.as<const unsigned char>(), b_tiles.as<const unsigned char>(),
                          fp8 ? a.fp8_bases.as<const std::int32_t>() : nullptr,
                          fp8 ? b.fp8_bases.as<const std::int32_t>() : nullptr, m, n, a.blocks, tiles_m, tiles_n,
                          output, out);
#endif
        } else if (kernel == tensor_core_kernel::mma_sync) {
          runtime::launch(tensor_core_block_kernel, static_cast<unsigned>(tiles_m * tiles_n), tcb_threads,
                          tcb_shared_bytes, a.bytes.as<const std::int8_t>(), a.scales.as<const std::uint32_t>(),
                          a.slow_tiles.as<const unsigned>(), b.bytes.as<const std::int8_t>(),
                          b.scales.as<const std::uint32_t>(), b.slow_tiles.as<const unsigned>(), m, n, a.byte_stride,
                          a.padded_rows, b.padded_rows, a.blocks, tiles_m, tiles_n, output, out);
        } else {
#if !defined(MXSCOPE_GPU_SIMULATE)
          // 128 x 128 tiles: twice tcb's count, still within the checked bound's factor tcb_group.
          MXSCOPE_GPU_CHECK(cudaFuncSetAttribute(tensor_core_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(tcw_shared_bytes)));
          const std::int64_t wgmma_tiles_m = (m + tcw_tile - 1) / tcw_tile;
          const std::int64_t wgmma_tiles_n = (n + tcw_tile - 1) / tcw_tile;
          runtime::launch(tensor_core_wgmma_kernel, static_cast<unsigned>(wgmma_tiles_m * wgmma_tiles_n), tcw_threads,
                          tcw_shared_bytes, a.bytes.as<const std::int8_t>(), a.scales.as<const std::uint32_t>(),
                          a.slow_tiles.as<const unsigned>(), b.bytes.as<const std::int8_t>(),
                          b.scales.as<const std::uint32_t>(), b.slow_tiles.as<const unsigned>(), m, n, a.byte_stride,
                          a.padded_rows, b.padded_rows, a.blocks, wgmma_tiles_m, wgmma_tiles_n, output, out);
#endif
        }
      }
#else
      throw input_error("gpu gemm: no tensor-core path in this build");
#endif
      break;
    }
    case gemm_path::native_mfma:
      native_gfx950::multiply(a, b, output, out);
      break;
    case gemm_path::automatic:
      break;
  }
}

// ================================================================================================
// Exact reference of fp32 operands (NUMERICS.md section 8): the exact sum of the products rounded
// once to fp64 and to fp32. plain_tile_kernel (exact mode) computes every entry whose rows fit its
// 128-bit window; reference_kernel the others: one thread per entry adds every product (exact in
// fp64) to a long accumulator, or, where a row holds inf or NaN, forms the IEEE fp64 sum in
// ascending k, as src/reference.cpp defines.

namespace {

constexpr int reference_tile = 16;
constexpr int reference_chunk = 32;

__global__ void reference_kernel(const float* a, const float* b, plain_rows_view a_rows, plain_rows_view b_rows,
                                 std::int64_t m, std::int64_t n, std::int64_t depth, int depth_bits, double* out64,
                                 float* out32, reference_scaling scaling) {
  __shared__ float a_tile[reference_tile][reference_chunk + 1];
  __shared__ float b_tile[reference_tile][reference_chunk + 1];
  __shared__ int tile_needed;
  const int tx = threadIdx.x % reference_tile;
  const int ty = threadIdx.x / reference_tile;
  const std::int64_t i0 = static_cast<std::int64_t>(blockIdx.y) * reference_tile;
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * reference_tile;
  const std::int64_t i = i0 + ty;
  const std::int64_t j = j0 + tx;
  const bool active =
      i < m && j < n && !plain_fits(a_rows.low[i], a_rows.high[i], b_rows.low[j], b_rows.high[j], depth_bits);
  // A tile without such entries leaves at once (the same decision for every thread of the block).
  if (threadIdx.x == 0) tile_needed = 0;
  __syncthreads();
  if (active) tile_needed = 1;
  __syncthreads();
  if (tile_needed == 0) return;
  const bool ieee = active && (a_rows.high[i] == plain_nonfinite_high || b_rows.high[j] == plain_nonfinite_high);
  core_ns::long_accumulator total;
  double sum = 0.0;
  for (std::int64_t k0 = 0; k0 < depth; k0 += reference_chunk) {
    const int chunk = depth - k0 < reference_chunk ? static_cast<int>(depth - k0) : reference_chunk;
    for (int t = threadIdx.x; t < reference_tile * reference_chunk; t += blockDim.x) {
      const int row = t / reference_chunk;
      const int kk = t % reference_chunk;
      const bool inside = kk < chunk;
      a_tile[row][kk] = (inside && i0 + row < m) ? a[(i0 + row) * depth + k0 + kk] : 0.0f;
      b_tile[row][kk] = (inside && j0 + row < n) ? b[(j0 + row) * depth + k0 + kk] : 0.0f;
    }
    __syncthreads();
    if (active) {
      for (int kk = 0; kk < chunk; ++kk) {
        const double product = static_cast<double>(a_tile[ty][kk]) * static_cast<double>(b_tile[tx][kk]);
        if (ieee) {
          sum += product;
        } else if (scaling.scaled) {
          core_ns::add_scaled_exactly(total, product, scaling.scale);
        } else {
          total.add(product);
        }
      }
    }
    __syncthreads();
  }
  if (!active) return;
  const std::int64_t entry = i * n + j;
  if (ieee) {
    if (out64 != nullptr) out64[entry] = canonical(sum);
    if (out32 != nullptr) out32[entry] = canonical(static_cast<float>(sum));
  } else {
    if (out64 != nullptr) out64[entry] = round_total_to_double(total);
    if (out32 != nullptr) out32[entry] = round_total_to_float(total);
  }
}

}  // namespace

namespace {

// What the host needs of an operand's row descriptions: out[0] += the rows marked as holding inf
// or NaN, out[1] = max(out[1], the largest high - low over the rows + plain_span_offset). An entry
// (i, j) fits the tiled kernel's window exactly when span(i) + span(j) + 2 + depth_bits <=
// plain_window_bits (plain_fits), so the largest spans of the two operands say whether any entry is
// left to reference_kernel. The offset keeps the spans of empty rows (high plain_empty_high, low 0)
// nonnegative; the nonfinite marker's span is the largest.
constexpr std::int64_t plain_span_offset = -plain_empty_high;

__global__ void row_summary_kernel(plain_rows_view view, std::int64_t rows, unsigned long long* out) {
  unsigned long long marked = 0;
  unsigned long long largest = 0;
  MXSCOPE_GRID_LOOP(r, rows) {
    marked += view.high[r] == plain_nonfinite_high;
    const std::int64_t span = static_cast<std::int64_t>(view.high[r]) - view.low[r] + plain_span_offset;
    const unsigned long long shifted = span > 0 ? static_cast<unsigned long long>(span) : 0ULL;
    largest = shifted > largest ? shifted : largest;
  }
  if (marked != 0) atomicAdd(out, marked);
  if (largest != 0) atomicMax(out + 1, largest);
}

// reference_on_device, and where nonfinite_rows is given, the number of rows of A and of B that
// hold inf or NaN (from the row descriptions the kernels use) into nonfinite_rows[0] and [1].
void reference_on_device_counting(const float* a, const float* b, std::int64_t m, std::int64_t n, std::int64_t k,
                                  double* out64, float* out32, std::int64_t* nonfinite_rows,
                                  const reference_scaling& scaling = {}) {
  if (m == 0 || n == 0) return;
  const plain_rows_data a_rows = describe_plain_rows(a, m, k);
  const plain_rows_data b_rows = describe_plain_rows(b, n, k);
  // Per operand the nonfinite rows and the largest span: reference_kernel runs only where some
  // entry does not fit the tiled kernel's window (on the benchmark's operands none: the kernel's
  // launch alone, every tile checking its entries, took 0.7 ms of the 32).
  unsigned long long summary[4] = {};
  {
    scratch_buffer counts(sizeof(summary));
    counts.fill_bytes(0);
    runtime::launch(row_summary_kernel, grid_for(m), threads_per_block, 0, a_rows.view(), m,
                    counts.as<unsigned long long>());
    runtime::launch(row_summary_kernel, grid_for(n), threads_per_block, 0, b_rows.view(), n,
                    counts.as<unsigned long long>() + 2);
    counts.download(summary, sizeof(summary));
  }
  if (nonfinite_rows != nullptr) {
    nonfinite_rows[0] = static_cast<std::int64_t>(summary[0]);
    nonfinite_rows[1] = static_cast<std::int64_t>(summary[2]);
  }
  const int depth_bits = depth_bits_of(k);
#if defined(MXSCOPE_CUDA_TENSOR_CORES)
#if !defined(MXSCOPE_GPU_SIMULATE)
  // More than the default 48 KiB of dynamic shared memory (set on every call: the attribute belongs
  // to the current device).
  MXSCOPE_GPU_CHECK(cudaFuncSetAttribute(reference_warp_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(rw_shared_bytes)));
  MXSCOPE_GPU_CHECK(cudaFuncSetAttribute(reference_warp_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(rw_shared_bytes)));
#endif
  const std::int64_t chunks = (k + plain_chunk - 1) / plain_chunk;
  const auto chunk_tiles = [&](const float* x, std::int64_t rows) {
    const std::int64_t total = (rows + plain_tile - 1) / plain_tile * chunks * plain_tile * plain_chunk;
    scratch_buffer out(static_cast<std::size_t>(std::max<std::int64_t>(total, 1)) * sizeof(float));
    const dim3 grid(static_cast<unsigned>(chunks),
                    static_cast<unsigned>(std::min<std::int64_t>((rows + plain_tile - 1) / plain_tile, 65535)));
    if (total > 0) runtime::launch(chunk_tiles_kernel, grid, threads_per_block, 0, x, rows, k, chunks, out.as<float>());
    return out;
  };
  const scratch_buffer a_tiles = chunk_tiles(a, m);
  const scratch_buffer b_tiles = chunk_tiles(b, n);
  runtime::launch(scaling.scaled ? reference_warp_kernel<true> : reference_warp_kernel<false>, plain_grid(m, n),
                  rw_threads, rw_shared_bytes, a_tiles.as<const float>(), b_tiles.as<const float>(),
                  a_rows.spreads.as<const std::int8_t>(), b_rows.spreads.as<const std::int8_t>(),
                  a_rows.super_spreads.as<const std::int8_t>(), b_rows.super_spreads.as<const std::int8_t>(), a_rows.view(),
                  b_rows.view(), m, n, k, depth_bits, out32, out64, scaling.scale);
#else
  runtime::launch(scaling.scaled ? plain_tile_kernel<plain_mode::exact, true> : plain_tile_kernel<plain_mode::exact, false>,
                  plain_grid(m, n), 256, 0, a, b,
                  a_rows.spreads.as<const std::int8_t>(), b_rows.spreads.as<const std::int8_t>(),
                  a_rows.super_spreads.as<const std::int8_t>(), b_rows.super_spreads.as<const std::int8_t>(), a_rows.view(),
                  b_rows.view(), m, n, k, depth_bits, std::int64_t{1}, output_rounding::fp32, out32, out64, scaling.scale);
#endif
  const std::int64_t widest = static_cast<std::int64_t>(summary[1]) + static_cast<std::int64_t>(summary[3]) -
                              2 * plain_span_offset + 2 + depth_bits;
  if (widest > plain_window_bits) {
    const dim3 grid(static_cast<unsigned>((n + reference_tile - 1) / reference_tile),
                    static_cast<unsigned>((m + reference_tile - 1) / reference_tile));
    runtime::launch(reference_kernel, grid, reference_tile * reference_tile, 0, a, b, a_rows.view(), b_rows.view(), m,
                    n, k, depth_bits, out64, out32, scaling);
  }
  synchronize();  // the row metadata must outlive the kernels
}

}  // namespace

void reference_on_device(const float* a, const float* b, std::int64_t m, std::int64_t n, std::int64_t k, double* out64,
                         float* out32) {
  reference_on_device_counting(a, b, m, n, k, out64, out32, nullptr);
}

void plain_product_on_device(const float* a, const float* b, std::int64_t m, std::int64_t n, std::int64_t depth,
                             int block, const accumulation_model& model, output_rounding output, float* out) {
  if (block < 1) throw input_error("gpu gemm: field 'block' must be positive");
  if (model.kind != accumulation_kind::fp32_block && model.kind != accumulation_kind::fp32_group &&
      model.kind != accumulation_kind::fp32_seq) {
    throw input_error("gpu gemm: unscaled operands run fp32-block, fp32-group:G and fp32-seq on the GPU");
  }
  if (model.kind == accumulation_kind::fp32_group && model.blocks_per_group < 1) {
    throw input_error("gpu gemm: field 'accum': G must be positive");
  }
  if (m == 0 || n == 0) return;
  const std::int64_t blocks = (depth + block - 1) / block;
  // Every block scale is 2^0: the exponent buffers [blocks, rows] of the per-product kernel are zero.
  device_buffer a_exponents(static_cast<std::size_t>(std::max<std::int64_t>(blocks * m, 1)) * sizeof(std::int32_t));
  device_buffer b_exponents(static_cast<std::size_t>(std::max<std::int64_t>(blocks * n, 1)) * sizeof(std::int32_t));
  a_exponents.fill_bytes(0);
  b_exponents.fill_bytes(0);
  const unsigned grid = grid_for(m * n, 128);
  const auto* ax = a_exponents.as<const std::int32_t>();
  const auto* bx = b_exponents.as<const std::int32_t>();
  const int group = model.kind == accumulation_kind::fp32_group ? model.blocks_per_group : 1;
  const std::int64_t group_length = static_cast<std::int64_t>(block) * group;
  if (model.kind == accumulation_kind::fp32_seq) {
    runtime::launch(generic_product_kernel<generic_mode::sequential>, grid, 128, 0, a, ax, b, bx, m, n, depth, block,
                    1, output, out, static_cast<double*>(nullptr), plain_rows_view{}, plain_rows_view{}, 0);
  } else if (group_length % plain_chunk != 0) {
    // Steps that end inside a chunk: the per-product kernel for every entry.
    runtime::launch(generic_product_kernel<generic_mode::grouped>, grid, 128, 0, a, ax, b, bx, m, n, depth, block,
                    group, output, out, static_cast<double*>(nullptr), plain_rows_view{}, plain_rows_view{}, 0);
  } else {
    // The tiled kernel for the entries whose rows fit its window, the per-product kernel for the rest.
    const plain_rows_data a_rows = describe_plain_rows(a, m, depth);
    const plain_rows_data b_rows = describe_plain_rows(b, n, depth);
    const int depth_bits = depth_bits_of(depth);
    const std::int64_t chunks_per_group = group_length / plain_chunk;
    const auto* a_spreads = a_rows.spreads.as<const std::int8_t>();
    const auto* b_spreads = b_rows.spreads.as<const std::int8_t>();
    const std::int8_t* const no_spreads = nullptr;  // super-chunks: exact mode only
    if (chunks_per_group == 1) {
      runtime::launch(plain_tile_kernel<plain_mode::block>, plain_grid(m, n), 256, 0, a, b, a_spreads, b_spreads,
                      no_spreads, no_spreads,
                      a_rows.view(), b_rows.view(), m, n, depth, depth_bits, chunks_per_group, output, out,
                      static_cast<double*>(nullptr), core_ns::tensor_scale_product{});
    } else {
      runtime::launch(plain_tile_kernel<plain_mode::group>, plain_grid(m, n), 256, 0, a, b, a_spreads, b_spreads,
                      no_spreads, no_spreads,
                      a_rows.view(), b_rows.view(), m, n, depth, depth_bits, chunks_per_group, output, out,
                      static_cast<double*>(nullptr), core_ns::tensor_scale_product{});
    }
    runtime::launch(generic_product_kernel<generic_mode::grouped>, grid, 128, 0, a, ax, b, bx, m, n, depth, block,
                    group, output, out, static_cast<double*>(nullptr), a_rows.view(), b_rows.view(), depth_bits);
  }
  synchronize();  // the buffers above must outlive the kernels
}

// ================================================================================================
// Comparison sums in the canonical order of compare.hpp: one thread per chunk of 4096 terms sums
// sequentially in fp64; the chunk partials come back to the host, which combines them with
// mxscope::canonical_tree. Counts, maxima and the ulp histogram are order-free.

namespace {

constexpr int compare_sum_count = 6;  // ||E||^2 ||G||^2 ||Ghat||^2 <E,G> <Ghat,G> sum of ulp distances

struct compare_counters {
  unsigned long long histogram[ulp_bucket_count];
  unsigned long long max_ulp;
  unsigned long long compared;
  unsigned long long nan_pairs;
  unsigned long long nonfinite_estimate;
  unsigned long long max_abs_bits;  // bits of max |E| over non-NaN E (non-negative: bit order = value order)
  unsigned long long saw_nan;
};

__global__ void compare_chunks_kernel(const float* estimate, const double* reference, const float* reference32,
                                      std::int64_t count, std::int64_t chunk_count, double* partials,
                                      compare_counters* counters) {
  MXSCOPE_GRID_LOOP(chunk, chunk_count) {
    double sums[compare_sum_count] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    unsigned long long histogram[ulp_bucket_count] = {};
    unsigned long long max_ulp = 0, compared = 0, nan_pairs = 0, nonfinite = 0, max_abs_bits = 0, saw_nan = 0;
    const std::int64_t begin = chunk * canonical_chunk;
    const std::int64_t end = begin + canonical_chunk < count ? begin + canonical_chunk : count;
    for (std::int64_t i = begin; i < end; ++i) {
      const float hat32 = estimate[i];
      const double hat = static_cast<double>(hat32);
      const double g = reference[i];
      const double e = hat - g;
      sums[0] = sums[0] + e * e;
      sums[1] = sums[1] + g * g;
      sums[2] = sums[2] + hat * hat;
      sums[3] = sums[3] + e * g;
      sums[4] = sums[4] + hat * g;
      const float ref32 = reference32[i];
      double distance = 0.0;
      if (hat32 != hat32 || ref32 != ref32) {
        ++nan_pairs;
      } else {
        const std::uint64_t d = ulp_distance(hat32, ref32);
        distance = static_cast<double>(d);
        ++histogram[ulp_bucket(d)];
        ++compared;
        if (d > max_ulp) max_ulp = d;
      }
      sums[5] = sums[5] + distance;
      if (e != e) {
        saw_nan = 1;
      } else {
        const unsigned long long bits = core_ns::double_bits(fabs(e));
        if (bits > max_abs_bits) max_abs_bits = bits;
      }
      if (!is_finite(hat)) ++nonfinite;
    }
    for (int s = 0; s < compare_sum_count; ++s) partials[s * chunk_count + chunk] = sums[s];
    for (int b = 0; b < ulp_bucket_count; ++b) {
      if (histogram[b] != 0) atomicAdd(&counters->histogram[b], histogram[b]);
    }
    atomicMax(&counters->max_ulp, max_ulp);
    atomicAdd(&counters->compared, compared);
    atomicAdd(&counters->nan_pairs, nan_pairs);
    atomicAdd(&counters->nonfinite_estimate, nonfinite);
    atomicMax(&counters->max_abs_bits, max_abs_bits);
    if (saw_nan != 0) atomicOr(&counters->saw_nan, saw_nan);
  }
}

__global__ void orthogonal_chunks_kernel(const float* estimate, const double* reference, std::int64_t count,
                                         std::int64_t chunk_count, double bias, double* partials) {
  MXSCOPE_GRID_LOOP(chunk, chunk_count) {
    double sum = 0.0;
    const std::int64_t begin = chunk * canonical_chunk;
    const std::int64_t end = begin + canonical_chunk < count ? begin + canonical_chunk : count;
    for (std::int64_t i = begin; i < end; ++i) {
      const double g = reference[i];
      const double e = static_cast<double>(estimate[i]) - g;
      const double d = e - bias * g;
      sum = sum + d * d;
    }
    partials[chunk] = sum;
  }
}

// Row r's canonical sum over its columns: partial (r, chunk) = columns [chunk*4096, ...).
__global__ void row_chunks_kernel(const float* estimate, const double* reference, std::int64_t rows, std::int64_t cols,
                                  std::int64_t chunks_per_row, double* partials) {
  MXSCOPE_GRID_LOOP(t, rows * chunks_per_row) {
    const std::int64_t r = t / chunks_per_row;
    const std::int64_t chunk = t % chunks_per_row;
    const std::int64_t begin = chunk * canonical_chunk;
    const std::int64_t end = begin + canonical_chunk < cols ? begin + canonical_chunk : cols;
    double sum = 0.0;
    for (std::int64_t c = begin; c < end; ++c) {
      const double e = static_cast<double>(estimate[r * cols + c]) - reference[r * cols + c];
      sum = sum + e * e;
    }
    partials[t] = sum;
  }
}

// Column c's canonical sum down its rows: partial (chunk, c) = rows [chunk*4096, ...).
__global__ void column_chunks_kernel(const float* estimate, const double* reference, std::int64_t rows,
                                     std::int64_t cols, std::int64_t chunks_per_column, double* partials) {
  MXSCOPE_GRID_LOOP(t, chunks_per_column * cols) {
    const std::int64_t chunk = t / cols;
    const std::int64_t c = t % cols;
    const std::int64_t begin = chunk * canonical_chunk;
    const std::int64_t end = begin + canonical_chunk < rows ? begin + canonical_chunk : rows;
    double sum = 0.0;
    for (std::int64_t r = begin; r < end; ++r) {
      const double e = static_cast<double>(estimate[r * cols + c]) - reference[r * cols + c];
      sum = sum + e * e;
    }
    partials[t] = sum;
  }
}

// Per-tensor fp8 (src/quantize.cpp quantize_per_tensor): amax over the finite inputs (a maximum:
// order-free, taken on the bits of |v|, whose order is the order of the values), then every element
// encoded from the fp64 quotient v / scale, dequantized as fl32(decode(code) * scale).
__global__ void per_tensor_amax_kernel(const float* input, std::int64_t count, unsigned* amax_bits) {
  unsigned local = 0;
  MXSCOPE_GRID_LOOP(i, count) {
    const float v = input[i];
    if (is_finite(v)) {
      const unsigned bits = core_ns::float_bits(v) & 0x7FFFFFFFU;
      local = bits > local ? bits : local;
    }
  }
  atomicMax(amax_bits, local);
}

// bf16 "quantization" as the CPU's quantize_bf16: each value rounded to bf16 (sr words from the
// element's flat index), the 16-bit pattern stored little-endian, and the same four counters.
__global__ void bf16_element_kernel(const float* input, std::int64_t count, core_ns::rounding_mode rounding,
                                    int sr_bits, core_ns::random_stream stream, std::uint8_t* codes,
                                    float* dequantized, unsigned long long* counters) {
  unsigned long long nonzero = 0, flushed = 0, saturated = 0, nonfinite = 0;
  const bool stochastic = rounding == core_ns::rounding_mode::sr;
  MXSCOPE_GRID_LOOP(i, count) {
    const float v = input[i];
    const std::uint32_t word = stochastic ? stream.word(static_cast<std::uint64_t>(i)) : 0U;
    const std::uint16_t bits = core_ns::float_to_bf16(v, rounding, word, sr_bits);
    codes[2 * i] = static_cast<std::uint8_t>(bits & 0xFFU);
    codes[2 * i + 1] = static_cast<std::uint8_t>(bits >> 8);
    const float rounded = core_ns::bf16_to_float(bits);
    dequantized[i] = rounded;
    const bool finite = is_finite(v);
    nonzero += v != 0.0f;
    nonfinite += !finite;
    flushed += v != 0.0f && rounded == 0.0f;
    saturated += finite && !is_finite(rounded) && rounded == rounded;  // finite in, inf out
  }
  unsigned long long reduced[4] = {nonzero, flushed, saturated, nonfinite};
  constexpr int index[4] = {counter_nonzero, counter_flushed, counter_saturated, counter_nonfinite};
  block_reduce_to<false>(reduced, counters, index);
}

// out [cols, rows] = values [rows, cols] transposed, through 32 x 32 tiles in shared memory.
constexpr int transpose_tile = 32;
__global__ void transpose_kernel(const float* values, std::int64_t rows, std::int64_t cols, float* out) {
  __shared__ float tile[transpose_tile][transpose_tile + 1];
  const std::int64_t row0 = static_cast<std::int64_t>(blockIdx.y) * transpose_tile;
  const std::int64_t col0 = static_cast<std::int64_t>(blockIdx.x) * transpose_tile;
  const int tx = static_cast<int>(threadIdx.x);
  for (int ty = static_cast<int>(threadIdx.y); ty < transpose_tile; ty += static_cast<int>(blockDim.y)) {
    const std::int64_t r = row0 + ty, c = col0 + tx;
    if (r < rows && c < cols) tile[ty][tx] = values[r * cols + c];
  }
  __syncthreads();
  for (int ty = static_cast<int>(threadIdx.y); ty < transpose_tile; ty += static_cast<int>(blockDim.y)) {
    const std::int64_t c = col0 + ty, r = row0 + tx;  // out row c, out column r
    if (r < rows && c < cols) out[c * rows + r] = tile[tx][ty];
  }
}

__global__ void per_tensor_element_kernel(const float* input, std::int64_t count, element_kind kind, float scale,
                                          core_ns::rounding_mode rounding, int sr_bits, core_ns::random_stream stream,
                                          std::uint8_t* codes, float* dequantized, unsigned long long* counters) {
  unsigned long long nonzero = 0, flushed = 0, saturated = 0, nonfinite = 0;
  const bool stochastic = rounding == core_ns::rounding_mode::sr;
  MXSCOPE_GRID_LOOP(i, count) {
    const float v = input[i];
    if (v != 0.0f) ++nonzero;
    if (!is_finite(v)) {
      ++nonfinite;
      codes[i] = static_cast<std::uint8_t>(core_ns::nan_code(kind) | (core_ns::float_bits(v) >> 31 != 0 ? core_ns::sign_bit(kind) : 0U));
      dequantized[i] = canonical_nan_float();
      continue;
    }
    const std::uint32_t word = stochastic ? stream.word(static_cast<std::uint64_t>(i)) : 0U;
    const auto encoded =
        core_ns::encode(kind, static_cast<double>(v) / static_cast<double>(scale), rounding, word, sr_bits);
    codes[i] = static_cast<std::uint8_t>(encoded.code);
    dequantized[i] = __fmul_rn(static_cast<float>(core_ns::decode(kind, encoded.code)), scale);
    flushed += encoded.flushed;
    saturated += encoded.saturated;
  }
  unsigned long long reduced[4] = {nonzero, flushed, saturated, nonfinite};
  constexpr int index[4] = {counter_nonzero, counter_flushed, counter_saturated, counter_nonfinite};
  block_reduce_to<false>(reduced, counters, index);
}

// NVFP4 (include/mxscope/core/nvfp4.hpp, as the CPU's quantize_nvfp4), in two passes like the
// generic MX quantizer. Tiles of tile_rows x tile_cols elements share a scale: 1 x 16 (axis 1),
// 16 x 1 (axis 0) or 16 x 16 (2-D). Pass 1: one thread per tile finds its largest finite magnitude
// and writes its ue4m3 scale code (the NaN code for a tile with a non-finite input), counting
// nonzero and non-finite inputs. Pass 2: one thread per code byte (two elements of a row) encodes
// from its tile's scale code, as the CPU does.
struct nvfp4_layout {
  std::int64_t rows, cols, tile_rows, tile_cols, grid_rows, grid_cols;
};

nvfp4_layout nvfp4_layout_of(const quantize_options& options, std::int64_t rows, std::int64_t cols) {
  const core_ns::nvfp4_tile tile = core_ns::nvfp4_tile_of(options.axis, options.nvfp4_2d);
  nvfp4_layout out{rows, cols, tile.rows, tile.cols, 0, 0};
  out.grid_rows = (rows + out.tile_rows - 1) / out.tile_rows;
  out.grid_cols = (cols + out.tile_cols - 1) / out.tile_cols;
  return out;
}

__global__ void nvfp4_scale_kernel(const float* input, nvfp4_layout layout, float global_encode, float global_decode,
                                   std::uint8_t* scales, unsigned long long* counters) {
  unsigned long long nonzero = 0, nonfinite = 0;
  MXSCOPE_GRID_LOOP(t, layout.grid_rows * layout.grid_cols) {
    const std::int64_t r0 = (t / layout.grid_cols) * layout.tile_rows;
    const std::int64_t c0 = (t % layout.grid_cols) * layout.tile_cols;
    const std::int64_t r1 = r0 + layout.tile_rows < layout.rows ? r0 + layout.tile_rows : layout.rows;
    const std::int64_t c1 = c0 + layout.tile_cols < layout.cols ? c0 + layout.tile_cols : layout.cols;
    float amax = 0.0f;
    bool finite = true;
    for (std::int64_t r = r0; r < r1; ++r) {
      for (std::int64_t c = c0; c < c1; ++c) {
        const float v = input[r * layout.cols + c];
        if (v != 0.0f) ++nonzero;
        if (!is_finite(v)) {
          finite = false;
          ++nonfinite;
        } else {
          amax = fabsf(v) > amax ? fabsf(v) : amax;
        }
      }
    }
    scales[t] = finite ? core_ns::nvfp4_block_of_amax(amax, global_encode, global_decode).scale
                       : static_cast<std::uint8_t>(core_ns::nan_code(element_kind::ue4m3));
  }
  unsigned long long reduced[2] = {nonzero, nonfinite};
  constexpr int index[2] = {counter_nonzero, counter_nonfinite};
  block_reduce_to<false>(reduced, counters, index);
}

__global__ void nvfp4_element_kernel(const float* input, nvfp4_layout layout, float global_decode,
                                     core_ns::rounding_mode rounding, int sr_bits, core_ns::random_stream stream,
                                     const std::uint8_t* scales, std::uint8_t* codes, float* dequantized,
                                     unsigned long long* counters) {
  unsigned long long flushed = 0, saturated = 0;
  const bool stochastic = rounding == core_ns::rounding_mode::sr;
  const std::uint8_t nan_scale = static_cast<std::uint8_t>(core_ns::nan_code(element_kind::ue4m3));
  const std::int64_t row_bytes = (layout.cols + 1) / 2;
  MXSCOPE_GRID_LOOP(unit, layout.rows * row_bytes) {
    const std::int64_t r = unit / row_bytes;
    std::uint32_t byte = 0;
    for (int e = 0; e < 2; ++e) {
      const std::int64_t c = (unit % row_bytes) * 2 + e;
      if (c >= layout.cols) break;
      const std::int64_t index = r * layout.cols + c;
      const std::uint8_t scale = scales[(r / layout.tile_rows) * layout.grid_cols + c / layout.tile_cols];
      std::uint32_t code = 0;
      if (scale == nan_scale) {
        dequantized[index] = canonical_nan_float();
      } else {
        const std::uint32_t word = stochastic ? stream.word(static_cast<std::uint64_t>(index)) : 0U;
        const core_ns::nvfp4_element element =
            core_ns::nvfp4_encode(input[index], core_ns::nvfp4_block_of_scale(scale, global_decode), global_decode,
                                  rounding, word, sr_bits);
        code = element.code.code;
        dequantized[index] = element.dequantized;
        flushed += element.flushed ? 1U : 0U;
        saturated += element.code.saturated ? 1U : 0U;
      }
      byte |= (code & 0x0FU) << (4 * e);
    }
    codes[unit] = static_cast<std::uint8_t>(byte);
  }
  unsigned long long reduced[2] = {flushed, saturated};
  constexpr int index[2] = {counter_flushed, counter_saturated};
  block_reduce_to<false>(reduced, counters, index);
}

// The largest finite magnitude of a device tensor (0 when it has none), as the per-tensor
// quantizers of the CPU take it.
float finite_amax(const float* input, std::int64_t count) {
  device_buffer amax(sizeof(unsigned));
  amax.fill_bytes(0);
  runtime::launch(per_tensor_amax_kernel, reduction_grid(count), threads_per_block, 0, input, count,
                  amax.as<unsigned>());
  unsigned amax_bits = 0;
  amax.download(&amax_bits, sizeof(amax_bits));
  return core_ns::bits_float(amax_bits);
}

// The two passes, on device buffers; returns the global decode scale (the tensor scale).
float quantize_nvfp4_on_device(const float* input, std::int64_t rows, std::int64_t cols,
                               const quantize_options& options, std::uint8_t* codes, std::uint8_t* scales,
                               float* dequantized, unsigned long long* counters) {
  const float global_encode = core_ns::nvfp4_global_encode_scale(finite_amax(input, rows * cols));
  const float global_decode = 1.0f / global_encode;
  const nvfp4_layout layout = nvfp4_layout_of(options, rows, cols);
  runtime::launch(nvfp4_scale_kernel, reduction_grid(layout.grid_rows * layout.grid_cols), threads_per_block, 0,
                  input, layout, global_encode, global_decode, scales, counters);
  runtime::launch(nvfp4_element_kernel, reduction_grid(rows * ((cols + 1) / 2)), threads_per_block, 0, input, layout,
                  global_decode, options.rounding, options.sr_bits, options.stream, scales, codes, dequantized,
                  counters);
  return global_decode;
}

// The operand energies of quantize_with_energies: one thread per canonical chunk, in fp64.
__global__ void energy_chunks_kernel(const float* input, const float* dequantized, std::int64_t count,
                                     std::int64_t chunk_count, double* partials) {
  MXSCOPE_GRID_LOOP(chunk, chunk_count) {
    double signal = 0.0;
    double error = 0.0;
    const std::int64_t begin = chunk * canonical_chunk;
    const std::int64_t end = begin + canonical_chunk < count ? begin + canonical_chunk : count;
    for (std::int64_t i = begin; i < end; ++i) {
      const double value = static_cast<double>(input[i]);
      const double rounded = static_cast<double>(dequantized[i]);
      if (!is_finite(value) || !is_finite(rounded)) {
        signal = signal + 0.0;
        error = error + 0.0;
        continue;
      }
      signal = signal + value * value;
      error = error + (value - rounded) * (value - rounded);
    }
    partials[chunk] = signal;
    partials[chunk_count + chunk] = error;
  }
}

// The bits of the largest finite magnitude among values[0, count) (0 when none is finite and
// nonzero): the bit patterns of non-negative doubles order as the values do.
__global__ void largest_finite_magnitude_kernel(const double* values, std::int64_t count, unsigned long long* bits) {
  unsigned long long largest = 0;
  MXSCOPE_GRID_LOOP(i, count) {
    const unsigned long long magnitude = core_ns::double_bits(values[i]) & 0x7FFFFFFFFFFFFFFFULL;
    if (magnitude < 0x7FF0000000000000ULL && largest < magnitude) largest = magnitude;
  }
  unsigned long long reduced[1] = {largest};
  constexpr int index[1] = {0};
  block_reduce_to<true>(reduced, bits, index);
}

double tree_of(std::vector<double>& values, std::size_t offset, std::size_t count) {
  return canonical_tree(std::span<double>(values.data() + offset, count));
}

}  // namespace

// ================================================================================================
// Host convenience functions.

namespace {

template <class T>
device_buffer upload_vector(const std::vector<T>& values) {
  device_buffer buffer(values.size() * sizeof(T));
  buffer.upload(values.data(), buffer.bytes());
  return buffer;
}

// An operand's codes or scales: read where they are in device memory, else uploaded.
device_buffer_ptr resident_or_uploaded(const device_buffer_ptr& resident, const std::vector<std::uint8_t>& host) {
  return resident ? resident : std::make_shared<const device_buffer>(upload_vector(host));
}

}  // namespace

matrix rotate(const matrix& values, int axis, const rotation_options& options) {
  const rotation_plan plan = make_rotation_plan(options);
  check_rotation(plan, values.rows, values.cols, axis, "gpu rotate");
  matrix out = values;
  if (plan.size == 0 || values.size() == 0) return out;
  device_buffer buffer = upload_vector(values.values);
  rotate_on_device(buffer.as<float>(), values.rows, values.cols, axis, plan);
  buffer.download(out.data(), buffer.bytes());
  return out;
}

namespace {

// The quantizer's four device counters into the host tensor.
void take_counters(const device_buffer& counters, quantized_tensor& out) {
  unsigned long long counts[mx_counter_count] = {};
  counters.download(counts, sizeof(counts));
  out.nonzero_inputs = static_cast<std::int64_t>(counts[counter_nonzero]);
  out.flushed = static_cast<std::int64_t>(counts[counter_flushed]);
  out.saturated = static_cast<std::int64_t>(counts[counter_saturated]);
  out.nonfinite_inputs = static_cast<std::int64_t>(counts[counter_nonfinite]);
}

}  // namespace

quantized_tensor quantize(const matrix& input, const quantize_options& options, const rotation_options& rotation,
                          quantize_path path) {
  if (options.format.scheme == quant_scheme::nvfp4) {
    // The NVFP4 kernels through quantize_with_energies (the energies are not wanted here).
    operand_energies unused;
    quantized_tensor out = quantize_with_energies(input, options, rotation, true, unused);
    out.device_codes.reset();
    out.device_scales.reset();
    return out;
  }
  const mx_plan plan = make_mx_plan(options);
  const rotation_plan rotation_resolved = make_rotation_plan(rotation);
  check_rotation(rotation_resolved, input.rows, input.cols, plan.axis, "gpu quantize");
  quantized_tensor out;
  out.rows = input.rows;
  out.cols = input.cols;
  out.options = options;
  out.block = plan.block;
  out.scale_rows = mx_scale_rows(plan, input.rows, input.cols);
  out.scale_cols = mx_scale_cols(plan, input.rows, input.cols);
  out.codes.assign(static_cast<std::size_t>(mx_code_bytes(plan, input.rows, input.cols)), 0);
  out.scales.assign(static_cast<std::size_t>(out.scale_rows * out.scale_cols), 0);
  out.dequantized = matrix(input.rows, input.cols);
  if (input.size() == 0) return out;
  const device_buffer source = upload_vector(input.values);
  device_buffer codes(out.codes.size());
  device_buffer scales(out.scales.size());
  device_buffer dequantized(out.dequantized.values.size() * sizeof(float));
  device_buffer counters(mx_counter_count * sizeof(unsigned long long));
  counters.fill_bytes(0);
  mx_device_output destination;
  destination.codes = codes.as<std::uint8_t>();
  destination.scales = scales.as<std::uint8_t>();
  destination.dequantized = dequantized.as<float>();
  destination.counters = counters.as<unsigned long long>();
  quantize_on_device(source.get(), input_format::fp32, input.rows, input.cols, plan, rotation_resolved, destination,
                     path);
  codes.download(out.codes.data(), out.codes.size());
  scales.download(out.scales.data(), out.scales.size());
  dequantized.download(out.dequantized.data(), dequantized.bytes());
  take_counters(counters, out);
  return out;
}

quantized_tensor quantize_with_energies(const matrix& input, const quantize_options& options,
                                        const rotation_options& rotation, bool keep_dequantized,
                                        operand_energies& energies, const device_matrix* resident,
                                        bool codes_on_device_only) {
  if (resident != nullptr && (resident->rows() != input.rows || resident->cols() != input.cols)) {
    throw std::logic_error("gpu quantize: the resident operand's shape differs from the host operand's");
  }
  const bool per_tensor = options.format.scheme == quant_scheme::per_tensor;
  const bool bf16 = options.format.scheme == quant_scheme::bf16;
  const bool nvfp4 = options.format.scheme == quant_scheme::nvfp4;
  const element_kind kind = options.format.element;
  if (per_tensor && kind != element_kind::fp8_e4m3 && kind != element_kind::fp8_e5m2) {
    throw input_error("gpu quantize: field 'format': per-tensor scaling takes fp8 e4m3 or e5m2 elements");
  }
  const std::optional<mx_plan> plan =
      per_tensor || bf16 || nvfp4 ? std::nullopt : std::optional<mx_plan>(make_mx_plan(options));
  const int axis = plan ? plan->axis : options.axis;
  const rotation_plan rotation_resolved = make_rotation_plan(rotation);
  check_rotation(rotation_resolved, input.rows, input.cols, axis, "gpu quantize");
  quantized_tensor out;
  out.rows = input.rows;
  out.cols = input.cols;
  out.options = options;
  std::size_t code_bytes = static_cast<std::size_t>(input.size());  // per-tensor fp8: one byte per element
  std::size_t scale_bytes = 0;
  if (plan) {
    out.block = plan->block;
    out.scale_rows = mx_scale_rows(*plan, input.rows, input.cols);
    out.scale_cols = mx_scale_cols(*plan, input.rows, input.cols);
    code_bytes = static_cast<std::size_t>(mx_code_bytes(*plan, input.rows, input.cols));
    scale_bytes = static_cast<std::size_t>(out.scale_rows * out.scale_cols);
  } else if (bf16) {
    out.block = options.block > 0 ? options.block : options.format.default_block;  // as quantize()
    code_bytes = static_cast<std::size_t>(input.size()) * 2;
  } else if (nvfp4) {
    const nvfp4_layout layout = nvfp4_layout_of(options, input.rows, input.cols);
    out.block = options.block > 0 ? options.block : options.format.default_block;  // as quantize()
    out.scale_rows = layout.grid_rows;
    out.scale_cols = layout.grid_cols;
    code_bytes = static_cast<std::size_t>(input.rows * ((input.cols + 1) / 2));
    scale_bytes = static_cast<std::size_t>(layout.grid_rows * layout.grid_cols);
  }
  if (!codes_on_device_only) {  // host vectors only where they are wanted (they are large)
    out.codes.resize(code_bytes);
    out.scales.resize(scale_bytes);
  }
  energies = {};
  if (keep_dequantized) out.dequantized = matrix(input.rows, input.cols);
  if (input.size() == 0) return out;
  // The operand on the device: the resident copy as it is, or a working copy the rotation changes.
  const std::int64_t count = input.size();
  device_buffer working;
  const float* operand = nullptr;
  if (resident != nullptr && rotation_resolved.size == 0) {
    operand = resident->fp32();
  } else {
    working = device_buffer(static_cast<std::size_t>(count) * sizeof(float));
    if (resident != nullptr) {
      copy_on_device(working.get(), resident->fp32(), working.bytes());
    } else {
      working.upload(input.data(), working.bytes());
    }
    if (rotation_resolved.size > 0) {
      rotate_on_device(working.as<float>(), input.rows, input.cols, axis, rotation_resolved);
    }
    operand = working.as<const float>();
  }
  auto codes_buffer = std::make_shared<device_buffer>(code_bytes);
  auto scales_buffer = std::make_shared<device_buffer>(scale_bytes);
  device_buffer& codes = *codes_buffer;
  device_buffer& scales = *scales_buffer;
  auto dequantized_matrix = std::make_shared<device_matrix>(input.rows, input.cols, device_matrix::element::fp32);
  float* const dequantized = dequantized_matrix->fp32();
  device_buffer counters(mx_counter_count * sizeof(unsigned long long));
  counters.fill_bytes(0);
  if (bf16) {
    runtime::launch(bf16_element_kernel, reduction_grid(count), threads_per_block, 0, operand, count, options.rounding,
                    options.sr_bits, options.stream, codes.as<std::uint8_t>(), dequantized,
                    counters.as<unsigned long long>());
  } else if (nvfp4) {
    out.tensor_scale = quantize_nvfp4_on_device(operand, input.rows, input.cols, options, codes.as<std::uint8_t>(),
                                                scales.as<std::uint8_t>(), dequantized,
                                                counters.as<unsigned long long>());
  } else if (plan) {
    mx_device_output destination;
    destination.codes = codes.as<std::uint8_t>();
    destination.scales = scales.as<std::uint8_t>();
    destination.dequantized = dequantized;
    destination.counters = counters.as<unsigned long long>();
    quantize_on_device(operand, input_format::fp32, input.rows, input.cols, *plan, rotation_plan{}, destination);
  } else {
    const float largest = finite_amax(operand, count);
    // As the CPU: scale = fl32(amax / max_normal), 1 for an all-zero (or all non-finite) tensor.
    out.tensor_scale = largest > 0.0f ? largest / static_cast<float>(core_ns::max_normal(kind)) : 1.0f;
    runtime::launch(per_tensor_element_kernel, reduction_grid(count), threads_per_block, 0, operand, count,
                    kind, out.tensor_scale, options.rounding, options.sr_bits, options.stream,
                    codes.as<std::uint8_t>(), dequantized, counters.as<unsigned long long>());
  }
  const std::int64_t chunk_count = (count + canonical_chunk - 1) / canonical_chunk;
  device_buffer partials(static_cast<std::size_t>(2 * chunk_count) * sizeof(double));
  runtime::launch(energy_chunks_kernel, grid_for(chunk_count), threads_per_block, 0, operand,
                  dequantized, count, chunk_count, partials.as<double>());
  std::vector<double> host_partials(static_cast<std::size_t>(2 * chunk_count));
  partials.download(host_partials.data(), partials.bytes());
  energies.signal = tree_of(host_partials, 0, static_cast<std::size_t>(chunk_count));
  energies.error = tree_of(host_partials, static_cast<std::size_t>(chunk_count), static_cast<std::size_t>(chunk_count));
  if (!codes_on_device_only) {
    codes.download(out.codes.data(), out.codes.size());
    if (!out.scales.empty()) scales.download(out.scales.data(), out.scales.size());
  }
  out.device_codes = std::move(codes_buffer);
  out.device_scales = std::move(scales_buffer);
  if (keep_dequantized) out.dequantized = dequantized_matrix->download32();
  if (bf16) out.device_dequantized = std::move(dequantized_matrix);  // for the GPU's plain products
  take_counters(counters, out);
  return out;
}

namespace {

__global__ void nonzero_words_kernel(const std::int32_t* words, std::int64_t count, unsigned long long* found) {
  unsigned long long local = 0;
  MXSCOPE_GRID_LOOP(i, count) { local += words[i] != 0 ? 1U : 0U; }
  unsigned long long reduced[1] = {local};
  constexpr int index[1] = {0};
  block_reduce_to<false>(reduced, found, index);
}

// Whether the first `count` int32 words of `words` (device memory) are all zero.
bool all_zero_words(const device_buffer& words, std::int64_t count) {
  if (count <= 0) return true;
  device_buffer found(sizeof(unsigned long long));
  found.fill_bytes(0);
  runtime::launch(nonzero_words_kernel, reduction_grid(count), threads_per_block, 0, words.as<const std::int32_t>(),
                  count, found.as<unsigned long long>());
  unsigned long long host = 0;
  found.download(&host, sizeof(host));
  return host == 0;
}

// Whether emulate_product takes plain_product_on_device for two operands prepared for the generic
// path: fp32-block or fp32-group:G, the same depth and block, and every block exponent 0 (the
// prepared exponents: a NaN block's marker is not 0).
bool unit_scaled_plain_product(const prepared_operand& left, const prepared_operand& right,
                               const accumulation_model& model) {
  const auto& l = left.data();
  const auto& r = right.data();
  if (l.path != gemm_path::generic || r.path != gemm_path::generic) return false;
  if (model.kind != accumulation_kind::fp32_block && model.kind != accumulation_kind::fp32_group) return false;
  if (l.depth != r.depth || l.block != r.block || l.rows == 0 || r.rows == 0) return false;
  return all_zero_words(l.exponents, l.blocks * l.rows) && all_zero_words(r.exponents, r.blocks * r.rows);
}

}  // namespace

product_result emulate_product(const quantized_tensor& a, const quantized_tensor& b, const accumulation_model& model,
                               output_rounding output, gemm_path path, bool keep_on_device) {
  for (const quantized_tensor* q : {&a, &b}) {
    if (q->options.format.scheme != quant_scheme::mx) {
      throw input_error("gpu gemm: field 'format': the GPU backend multiplies MX operands only");
    }
  }
  const auto view_of = [](const quantized_tensor& q, const device_buffer& codes, const device_buffer& scales) {
    mx_operand_view view;
    view.codes = codes.as<const std::uint8_t>();
    view.scales = scales.as<const std::uint8_t>();
    view.element = q.options.format.element;
    view.block = q.block;
    view.axis = q.options.axis;
    view.rows = q.rows;
    view.cols = q.cols;
    return view;
  };
  const device_buffer_ptr a_codes_held = resident_or_uploaded(a.device_codes, a.codes);
  const device_buffer_ptr a_scales_held = resident_or_uploaded(a.device_scales, a.scales);
  const device_buffer_ptr b_codes_held = resident_or_uploaded(b.device_codes, b.codes);
  const device_buffer_ptr b_scales_held = resident_or_uploaded(b.device_scales, b.scales);
  const device_buffer& a_codes = *a_codes_held;
  const device_buffer& a_scales = *a_scales_held;
  const device_buffer& b_codes = *b_codes_held;
  const device_buffer& b_scales = *b_scales_held;
  const mx_operand_view a_view = view_of(a, a_codes, a_scales);
  const mx_operand_view b_view = view_of(b, b_codes, b_scales);
  gemm_path chosen = path == gemm_path::automatic ? resolve_gemm_path(a_view, b_view, model) : path;
  prepared_operand left = prepare_operand(a_view, chosen);
  prepared_operand right = prepare_operand(b_view, chosen);
  if (path == gemm_path::automatic && chosen != gemm_path::generic &&
      (!left.data().finite_elements || !right.data().finite_elements)) {
    chosen = gemm_path::generic;
    left = prepare_operand(a_view, chosen);
    right = prepare_operand(b_view, chosen);
  }
  product_result result;
  const bool want_exact = model.kind == accumulation_kind::exact;
  auto out = std::make_shared<device_matrix>(left.rows(), right.rows(), device_matrix::element::fp32);
  auto exact = want_exact ? std::make_shared<device_matrix>(left.rows(), right.rows(), device_matrix::element::fp64)
                          : nullptr;
  if (path == gemm_path::automatic && unit_scaled_plain_product(left, right, model)) {
    // Every block scale 2^0 (per-tensor operands as unit-scaled MX ones) where only the per-entry
    // kernel covers the formats (fp8 e5m2 x e4m3: block dots of up to 55 bits): the elements are
    // plain fp32 operands and the model is the same definition with unit block scales, which the
    // tiled plain-operand kernel computes (fp64 tensor cores on the K-blocks whose dot is exact
    // there, the per-product kernel for the rest).
    const auto& l = left.data();
    plain_product_on_device(l.elements.as<const float>(), right.data().elements.as<const float>(), l.rows,
                            right.data().rows, l.depth, l.block, model, output, out->fp32());
  } else {
    multiply_prepared(left, right, model, output, out->fp32(), want_exact ? exact->fp64() : nullptr, chosen);
  }
  if (keep_on_device) {
    result.device_out = std::move(out);
    result.device_exact = std::move(exact);
  } else {
    result.out = out->download32();
    if (want_exact) result.exact = exact->download64();
  }
  return result;
}

namespace {

__global__ void tensor_scales_kernel(float* out, double* exact, std::int64_t count, float sa, float sb, float alpha,
                                     output_rounding output) {
  MXSCOPE_GRID_LOOP(i, count) {
    if (exact != nullptr) {
      const core_ns::scaled_exact_value rounded = core_ns::round_scaled_exact(exact[i], sa, sb);
      out[i] = round_output(rounded.fp32, output);
      exact[i] = rounded.fp64;
    } else {
      out[i] = round_output(out[i] * alpha, output);
    }
  }
}

}  // namespace

namespace {

__global__ void nonfinite_codes_kernel(const std::uint8_t* codes, std::int64_t count, element_kind kind,
                                       unsigned long long* found) {
  unsigned long long local = 0;
  MXSCOPE_GRID_LOOP(i, count) { local += is_finite(core_ns::decode(kind, codes[i])) ? 0U : 1U; }
  unsigned long long reduced[1] = {local};
  constexpr int index[1] = {0};
  block_reduce_to<false>(reduced, found, index);
}

}  // namespace

std::int64_t count_nonfinite_codes(const device_buffer& codes, std::int64_t count, element_kind kind) {
  if (count < 0 || static_cast<std::uint64_t>(count) > codes.bytes()) {
    throw std::logic_error("count_nonfinite_codes: more codes than bytes");
  }
  if (core_ns::spec(kind).bits < 6) throw std::logic_error("count_nonfinite_codes: one code per byte only");
  if (count == 0) return 0;
  device_buffer found(sizeof(unsigned long long));
  found.fill_bytes(0);
  runtime::launch(nonfinite_codes_kernel, reduction_grid(count), threads_per_block, 0, codes.as<const std::uint8_t>(), count,
                  kind, found.as<unsigned long long>());
  unsigned long long host = 0;
  found.download(&host, sizeof(host));
  return static_cast<std::int64_t>(host);
}

namespace {

struct binade_sums_view {
  const double* sums[mxscope::detail::max_binade_parts];
  int count;
};

// detail::per_tensor_exact_by_parts's rounding, per entry (the same steps on the same core functions).
__global__ void binade_parts_kernel(binade_sums_view parts, std::int64_t entries, float sa, float sb,
                                    core_ns::tensor_scale_product scale, output_rounding output, float* out,
                                    double* exact) {
  MXSCOPE_GRID_LOOP(e, entries) {
    double sum = 0.0;
    bool single = true;
    for (int p = 0; p < parts.count; ++p) {
      const core_ns::sum_and_error se = core_ns::two_sum(sum, parts.sums[p][e]);
      sum = se.sum;
      single = single && se.error == 0.0;
    }
    core_ns::scaled_exact_value rounded{};
    if (single) {
      rounded = core_ns::round_scaled_exact(sum, sa, sb);
    } else {
      core_ns::long_accumulator total;
      for (int p = 0; p < parts.count; ++p) core_ns::add_scaled_exactly(total, parts.sums[p][e], scale);
      rounded = {round_total_to_float(total), round_total_to_double(total)};
    }
    out[e] = round_output(rounded.fp32, output);
    exact[e] = rounded.fp64;
  }
}

}  // namespace

product_result combine_binade_parts(const std::vector<std::shared_ptr<const device_matrix>>& sums, float sa, float sb,
                                    output_rounding output, bool keep_on_device) {
  if (sums.empty() || sums.size() > mxscope::detail::max_binade_parts) {
    throw std::logic_error("combine_binade_parts: between 1 and max_binade_parts parts");
  }
  binade_sums_view view{};
  view.count = static_cast<int>(sums.size());
  for (std::size_t p = 0; p < sums.size(); ++p) {
    const device_matrix& part = *sums[p];
    if (part.kind() != device_matrix::element::fp64 || part.rows() != sums[0]->rows() ||
        part.cols() != sums[0]->cols()) {
      throw std::logic_error("combine_binade_parts: the parts' sums differ in shape or are not fp64");
    }
    view.sums[p] = part.fp64();
  }
  const std::int64_t rows = sums[0]->rows(), cols = sums[0]->cols();
  auto out = std::make_shared<device_matrix>(rows, cols, device_matrix::element::fp32);
  auto exact = std::make_shared<device_matrix>(rows, cols, device_matrix::element::fp64);
  if (rows * cols > 0) {
    runtime::launch(binade_parts_kernel, grid_for(rows * cols), threads_per_block, 0, view, rows * cols, sa, sb,
                    core_ns::make_scale_product(sa, sb), output, out->fp32(), exact->fp64());
  }
  product_result result;
  if (keep_on_device) {
    result.device_out = std::move(out);
    result.device_exact = std::move(exact);
  } else {
    result.out = out->download32();
    result.exact = exact->download64();
  }
  return result;
}

void apply_tensor_scales(const product_result& result, float sa, float sb, bool exact_model, output_rounding output) {
  if (!result.device_out || (exact_model && !result.device_exact)) {
    throw std::logic_error("apply_tensor_scales: the product is not in device memory");
  }
  const std::int64_t count = result.device_out->size();
  if (exact_model && result.device_exact->size() != count) {
    throw std::logic_error("apply_tensor_scales: the fp32 and fp64 results differ in size");
  }
  if (count == 0) return;
  const float alpha = sa * sb;  // as the CPU: fl32(sa sb)
  runtime::launch(tensor_scales_kernel, grid_for(count), threads_per_block, 0, result.device_out->fp32(),
                  exact_model ? result.device_exact->fp64() : static_cast<double*>(nullptr), count, sa, sb, alpha,
                  output);
}

namespace {

__global__ void differing_words_kernel(const std::uint32_t* x, const std::uint32_t* y, std::int64_t count,
                                       unsigned long long* differing) {
  unsigned long long local = 0;
  MXSCOPE_GRID_LOOP(i, count) { local += x[i] != y[i] ? 1U : 0U; }
  unsigned long long reduced[1] = {local};
  constexpr int index[1] = {0};
  block_reduce_to<false>(reduced, differing, index);
}

}  // namespace

bool same_bits(const device_matrix& x, const device_matrix& y) {
  if (x.rows() != y.rows() || x.cols() != y.cols() || x.kind() != y.kind()) return false;
  const std::int64_t words = x.size() * (x.kind() == device_matrix::element::fp32 ? 1 : 2);
  if (words == 0) return true;
  const auto* x_words = x.kind() == device_matrix::element::fp32 ? reinterpret_cast<const std::uint32_t*>(x.fp32())
                                                                 : reinterpret_cast<const std::uint32_t*>(x.fp64());
  const auto* y_words = y.kind() == device_matrix::element::fp32 ? reinterpret_cast<const std::uint32_t*>(y.fp32())
                                                                 : reinterpret_cast<const std::uint32_t*>(y.fp64());
  device_buffer differing(sizeof(unsigned long long));
  differing.fill_bytes(0);
  runtime::launch(differing_words_kernel, reduction_grid(words), threads_per_block, 0, x_words, y_words, words,
                  differing.as<unsigned long long>());
  unsigned long long host = 0;
  differing.download(&host, sizeof(host));
  return host == 0;
}

device_matrix transposed(const device_matrix& values) {
  device_matrix out(values.cols(), values.rows(), device_matrix::element::fp32);
  if (values.size() == 0) return out;
  const dim3 grid(static_cast<unsigned>((values.cols() + transpose_tile - 1) / transpose_tile),
                  static_cast<unsigned>((values.rows() + transpose_tile - 1) / transpose_tile));
  runtime::launch(transpose_kernel, grid, dim3(transpose_tile, 8), 0, static_cast<const float*>(values.fp32()),
                  values.rows(), values.cols(), out.fp32());
  return out;
}

product_result emulate_plain_product(const matrix& a, const matrix& b, int block, const accumulation_model& model,
                                     output_rounding output, bool keep_on_device) {
  if (a.cols != b.cols) {
    throw input_error("gpu gemm: A has " + to_text(a.cols) + " columns, B has " + to_text(b.cols));
  }
  return emulate_plain_product(device_matrix::upload(a), device_matrix::upload(b), block, model, output,
                               keep_on_device);
}

product_result emulate_plain_product(const device_matrix& a, const device_matrix& b, int block,
                                     const accumulation_model& model, output_rounding output, bool keep_on_device) {
  if (a.cols() != b.cols()) {
    throw input_error("gpu gemm: A has " + to_text(a.cols()) + " columns, B has " + to_text(b.cols()));
  }
  product_result result;
  auto out = std::make_shared<device_matrix>(a.rows(), b.rows(), device_matrix::element::fp32);
  plain_product_on_device(a.fp32(), b.fp32(), a.rows(), b.rows(), a.cols(), block, model, output, out->fp32());
  if (keep_on_device) {
    result.device_out = std::move(out);
  } else {
    result.out = out->download32();
  }
  return result;
}

reference_result reference_gemm(const matrix& a, const matrix& b, bool keep_on_device) {
  if (a.cols != b.cols) {
    throw input_error("gpu reference_gemm: A has " + to_text(a.cols) + " columns, B has " + to_text(b.cols));
  }
  return reference_gemm(device_matrix::upload(a), device_matrix::upload(b), keep_on_device);
}

namespace {

// NVFP4 operand codes (packed fp4) and ue4m3 block scales to their block-scaled elements along the
// quantization axis: out [rows, depth] row-major; *nonfinite set where a value is not finite.
__global__ void nvfp4_values_kernel(mx_operand_view codes, const std::uint8_t* scales, std::int64_t scale_cols,
                                    core_ns::nvfp4_tile tile, std::int64_t rows, std::int64_t depth, float* out,
                                    int* nonfinite) {
  const std::int64_t row_bytes = (codes.cols + 1) / 2;
  MXSCOPE_GRID_LOOP(t, rows * depth) {
    const std::int64_t row = t / depth;
    const std::int64_t k = t % depth;
    const std::int64_t r = codes.axis == 1 ? row : k;
    const std::int64_t c = codes.axis == 1 ? k : row;
    const double element = core_ns::decode(element_kind::fp4_e2m1, load_code(codes, true, row_bytes, r, c));
    const double scale = core_ns::decode(element_kind::ue4m3, scales[(r / tile.rows) * scale_cols + c / tile.cols]);
    const float value = static_cast<float>(element * scale);  // exact: 2 and 4 significant bits
    if (!is_finite(value)) *nonfinite = 1;
    out[t] = value;
  }
}

reference_result reference_gemm_with(const device_matrix& a, const device_matrix& b, bool keep_on_device,
                                     const reference_scaling& scaling);

// An NVFP4 operand in device memory for the kernels above: its packed codes as an mx_operand_view
// (load_code), its ue4m3 scales, their tile, and its shape along the quantization axis.
struct nvfp4_device_operand {
  device_buffer_ptr codes;
  device_buffer_ptr scales;
  mx_operand_view view;
  core_ns::nvfp4_tile tile{};
  std::int64_t rows = 0;   // along the other axis
  std::int64_t depth = 0;  // along the quantization axis
};

nvfp4_device_operand nvfp4_on_device(const quantized_tensor& q, const char* what) {
  if (q.options.format.scheme != quant_scheme::nvfp4 || q.options.format.element != element_kind::fp4_e2m1) {
    throw input_error(std::string(what) + ": field 'format': not an NVFP4 operand");
  }
  if (q.options.axis != 0 && q.options.axis != 1) throw input_error(std::string(what) + ": field 'axis' must be 0 or 1");
  nvfp4_device_operand out;
  out.rows = q.options.axis == 1 ? q.rows : q.cols;
  out.depth = q.options.axis == 1 ? q.cols : q.rows;
  out.tile = core_ns::nvfp4_tile_of(q.options.axis, q.options.nvfp4_2d);
  if (out.rows * out.depth == 0) return out;
  out.codes = resident_or_uploaded(q.device_codes, q.codes);
  out.scales = resident_or_uploaded(q.device_scales, q.scales);
  out.view.codes = out.codes->as<const std::uint8_t>();
  out.view.element = element_kind::fp4_e2m1;
  out.view.block = q.block;
  out.view.axis = q.options.axis;
  out.view.rows = q.rows;
  out.view.cols = q.cols;
  return out;
}

// Whether a kernel that raised `flag` (one int, device memory) found a non-finite value; synchronizes.
bool flag_raised(const device_buffer& flag) {
  int raised = 0;
  flag.download(&raised, sizeof(raised));
  return raised != 0;
}

}  // namespace

device_matrix nvfp4_block_scaled_values(const quantized_tensor& q, bool& finite) {
  const nvfp4_device_operand operand = nvfp4_on_device(q, "gpu nvfp4_block_scaled_values");
  device_matrix out(operand.rows, operand.depth, device_matrix::element::fp32);
  finite = true;
  if (operand.rows * operand.depth == 0) return out;
  device_buffer flag(sizeof(int));
  flag.fill_bytes(0);
  runtime::launch(nvfp4_values_kernel, grid_for(operand.rows * operand.depth), threads_per_block, 0, operand.view,
                  operand.scales->as<const std::uint8_t>(), q.scale_cols, operand.tile, operand.rows, operand.depth,
                  out.fp32(), flag.as<int>());
  finite = !flag_raised(flag);
  return out;
}

namespace {

// NVFP4 codes and block scales as the integer path's operand: each element fp4 q times its ue4m3
// block scale m 2^es (m odd) is (2q m) 2^(es - 1), an integer |2q m| <= 12 * 15 = 180 times a power
// of two that is the block's, stored as integers[row, k] = 2q m and exponents[block, row] = es + 8
// (the integer path scales by 2^(exponent - 9), e4m3's fraction bits, e4m3 being the carrier kind).
__global__ void nvfp4_integer_kernel(mx_operand_view codes, const std::uint8_t* scales, std::int64_t scale_cols,
                                     core_ns::nvfp4_tile tile, std::int64_t rows, std::int64_t depth, int block,
                                     std::int32_t* integers, std::int32_t* exponents, int* nonfinite) {
  const std::int64_t row_bytes = (codes.cols + 1) / 2;
  MXSCOPE_GRID_LOOP(t, rows * depth) {
    const std::int64_t row = t / depth;
    const std::int64_t k = t % depth;
    const std::int64_t r = codes.axis == 1 ? row : k;
    const std::int64_t c = codes.axis == 1 ? k : row;
    const std::uint8_t scale = scales[(r / tile.rows) * scale_cols + c / tile.cols];
    const double doubled = 2.0 * core_ns::decode(element_kind::fp4_e2m1, load_code(codes, true, row_bytes, r, c));
    int mantissa = 0, exponent = 0;
    if (!is_finite(core_ns::decode(element_kind::ue4m3, scale))) {
      *nonfinite = 1;
    } else {
      const int field = scale >> 3;  // ue4m3: 4 exponent bits (bias 7), 3 mantissa bits
      mantissa = field == 0 ? (scale & 7) : 8 + (scale & 7);
      exponent = (field == 0 ? 1 : field) - 10;
      while (mantissa != 0 && (mantissa & 1) == 0) {
        mantissa >>= 1;
        ++exponent;
      }
    }
    integers[t] = static_cast<std::int32_t>(doubled) * mantissa;
    if (k % block == 0) exponents[(k / block) * rows + row] = mantissa == 0 ? 0 : exponent + 8;
  }
}

}  // namespace

prepared_operand prepare_nvfp4(const quantized_tensor& q, bool& finite) {
  const nvfp4_device_operand operand = nvfp4_on_device(q, "gpu prepare_nvfp4");
  if (q.block != 16) throw input_error("gpu prepare_nvfp4: field 'block' must be 16");
  prepared_operand out;
  auto& s = out.data();
  s.element = element_kind::fp8_e4m3;  // the carrier: |2q m| <= 180, within e4m3's integer bound
  s.block = q.block;
  s.path = gemm_path::integer;
  s.rows = operand.rows;
  s.depth = operand.depth;
  s.blocks = (s.depth + s.block - 1) / s.block;
  s.byte_stride = (s.depth + 31) / 32 * 32;
  s.integers = device_buffer(static_cast<std::size_t>(std::max<std::int64_t>(s.rows * s.depth, 1)) * sizeof(std::int32_t));
  s.exponents = device_buffer(static_cast<std::size_t>(std::max<std::int64_t>(s.blocks * s.rows, 1)) * sizeof(std::int32_t));
  finite = true;
  if (s.rows * s.depth > 0) {
    device_buffer flag(sizeof(int));
    flag.fill_bytes(0);
    runtime::launch(nvfp4_integer_kernel, grid_for(s.rows * s.depth), threads_per_block, 0, operand.view,
                    operand.scales->as<const std::uint8_t>(), q.scale_cols, operand.tile, s.rows, s.depth, s.block,
                    s.integers.as<std::int32_t>(), s.exponents.as<std::int32_t>(), flag.as<int>());
    finite = !flag_raised(flag);
  }
  s.finite_elements = finite;
  return out;
}

reference_result scaled_reference_gemm(const device_matrix& a, const device_matrix& b, float sa, float sb,
                                       bool keep_on_device) {
  reference_scaling scaling;
  scaling.scaled = true;
  scaling.scale = core_ns::make_scale_product(sa, sb);
  return reference_gemm_with(a, b, keep_on_device, scaling);
}

reference_result reference_gemm(const device_matrix& a, const device_matrix& b, bool keep_on_device) {
  return reference_gemm_with(a, b, keep_on_device, reference_scaling{});
}

namespace {

reference_result reference_gemm_with(const device_matrix& a, const device_matrix& b, bool keep_on_device,
                                     const reference_scaling& scaling) {
  if (a.cols() != b.cols()) {
    throw input_error("gpu reference_gemm: A has " + to_text(a.cols()) + " columns, B has " + to_text(b.cols()));
  }
  const std::int64_t m = a.rows(), n = b.rows();
  reference_result out;
  out.kind = reference_kind::exact;
  out.stats.entries = m * n;
  auto out64 = std::make_shared<device_matrix>(m, n, device_matrix::element::fp64);
  auto out32 = std::make_shared<device_matrix>(m, n, device_matrix::element::fp32);
  // Statistics as the CPU reports them: rows with inf or NaN make their entries non-finite (counted
  // on the device from the kernels' row descriptions).
  std::int64_t bad_rows[2] = {0, 0};
  if (m > 0 && n > 0) {
    reference_on_device_counting(a.fp32(), b.fp32(), m, n, a.cols(), out64->fp64(), out32->fp32(), bad_rows, scaling);
  }
  const std::int64_t bad_a = bad_rows[0], bad_b = bad_rows[1];
  out.stats.nonfinite_entries = bad_a * n + bad_b * m - bad_a * bad_b;
  out.stats.certified_entries = out.stats.entries - out.stats.nonfinite_entries;
  // The largest half ulp of a finite nonzero result: that of the largest finite magnitude (the half
  // ulp grows with the magnitude), found on the device.
  double largest = 0.0;
  if (out64->size() > 0) {
    device_buffer bits(sizeof(unsigned long long));
    bits.fill_bytes(0);
    runtime::launch(largest_finite_magnitude_kernel, reduction_grid(out64->size()), threads_per_block, 0,
                    static_cast<const double*>(out64->fp64()), out64->size(), bits.as<unsigned long long>());
    unsigned long long host_bits = 0;
    bits.download(&host_bits, sizeof(host_bits));
    const double magnitude = core_ns::bits_double(host_bits);
    if (magnitude != 0.0) {
      largest = magnitude < 0x1p-1021 ? core_ns::pow2(-1074) : core_ns::pow2(core_ns::floor_log2(magnitude) - 53);
    }
  }
  out.error_bound = largest;
  if (keep_on_device) {
    out.device_fp64 = std::move(out64);
    out.device_fp32 = std::move(out32);
  } else {
    out.fp64 = out64->download64();
    out.fp32 = out32->download32();
  }
  return out;
}

}  // namespace

comparison compare(const matrix& estimate, const matrix64& reference, const matrix& reference_fp32) {
  for (const auto& [rows, cols, what] : {std::tuple{estimate.rows, estimate.cols, "the estimate"},
                                         std::tuple{reference_fp32.rows, reference_fp32.cols, "the fp32 reference"}}) {
    if (rows != reference.rows || cols != reference.cols) {
      throw input_error(std::string("compare: ") + what + " is [" + to_text(rows) + ", " + to_text(cols) +
                        "] but the reference is [" + to_text(reference.rows) + ", " + to_text(reference.cols) + "]");
    }
  }
  return compare(device_matrix::upload(estimate), device_matrix::upload(reference),
                 device_matrix::upload(reference_fp32));
}

comparison compare(const device_matrix& estimate, const device_matrix& reference, const device_matrix& reference_fp32) {
  for (const auto& [rows, cols, what] : {std::tuple{estimate.rows(), estimate.cols(), "the estimate"},
                                         std::tuple{reference_fp32.rows(), reference_fp32.cols(), "the fp32 reference"}}) {
    if (rows != reference.rows() || cols != reference.cols()) {
      throw input_error(std::string("compare: ") + what + " is [" + to_text(rows) + ", " + to_text(cols) +
                        "] but the reference is [" + to_text(reference.rows()) + ", " + to_text(reference.cols()) +
                        "]");
    }
  }
  comparison out;
  out.rows = estimate.rows();
  out.cols = estimate.cols();
  const std::int64_t rows = estimate.rows();
  const std::int64_t cols = estimate.cols();
  const std::int64_t count = rows * cols;
  out.row_error_norms.assign(static_cast<std::size_t>(rows), 0.0);
  out.column_error_norms.assign(static_cast<std::size_t>(cols), 0.0);
  if (count == 0) {
    out.zero_reference = true;
    out.rel_err = 0.0;
    out.orth_err = 0.0;
    out.cosine = 1.0;
    return out;
  }
  const float* hat = estimate.fp32();
  const double* g = reference.fp64();
  const float* g32 = reference_fp32.fp32();
  const std::int64_t chunk_count = (count + canonical_chunk - 1) / canonical_chunk;
  device_buffer partials(static_cast<std::size_t>(compare_sum_count * chunk_count) * sizeof(double));
  device_buffer counters(sizeof(compare_counters));
  counters.fill_bytes(0);
  runtime::launch(compare_chunks_kernel, grid_for(chunk_count, 64), 64, 0, hat, g,
                  g32, count, chunk_count, partials.as<double>(), counters.as<compare_counters>());
  std::vector<double> host_partials(static_cast<std::size_t>(compare_sum_count * chunk_count));
  partials.download(host_partials.data(), partials.bytes());
  compare_counters host_counters{};
  counters.download(&host_counters, sizeof(host_counters));
  double sums[compare_sum_count];
  for (int s = 0; s < compare_sum_count; ++s) {
    sums[s] = tree_of(host_partials, static_cast<std::size_t>(s * chunk_count), static_cast<std::size_t>(chunk_count));
  }

  // The formulas of compare_impl (src/compare.cpp), in the same operation order.
  out.error_norm = std::sqrt(sums[0]);
  out.reference_norm = std::sqrt(sums[1]);
  out.estimate_norm = std::sqrt(sums[2]);
  out.error_dot_reference = sums[3];
  out.estimate_dot_reference = sums[4];
  constexpr double infinity = std::numeric_limits<double>::infinity();
  if (out.reference_norm == 0.0) {
    out.zero_reference = true;
    out.rel_err = out.error_norm == 0.0 ? 0.0 : infinity;
    out.orth_err = out.rel_err;
    out.bias = 0.0;
    out.cosine = out.estimate_norm == 0.0 ? 1.0 : 0.0;
  } else {
    out.rel_err = out.error_norm / out.reference_norm;
    out.bias = out.error_dot_reference / sums[1];
    device_buffer orthogonal(static_cast<std::size_t>(chunk_count) * sizeof(double));
    runtime::launch(orthogonal_chunks_kernel, grid_for(chunk_count, 64), 64, 0, hat,
                    g, count, chunk_count, out.bias, orthogonal.as<double>());
    std::vector<double> orthogonal_partials(static_cast<std::size_t>(chunk_count));
    orthogonal.download(orthogonal_partials.data(), orthogonal.bytes());
    out.orth_err = std::sqrt(canonical_tree(orthogonal_partials)) / out.reference_norm;
    out.cosine = out.estimate_norm == 0.0 ? 0.0 : out.estimate_dot_reference / (out.estimate_norm * out.reference_norm);
  }
  for (int b = 0; b < ulp_bucket_count; ++b)
    out.ulp.histogram[static_cast<std::size_t>(b)] = static_cast<std::int64_t>(host_counters.histogram[b]);
  out.ulp.max = host_counters.max_ulp;
  out.ulp.compared = static_cast<std::int64_t>(host_counters.compared);
  out.ulp.nan_pairs = static_cast<std::int64_t>(host_counters.nan_pairs);
  out.nonfinite_estimate = static_cast<std::int64_t>(host_counters.nonfinite_estimate);
  out.max_abs_err = host_counters.saw_nan != 0 ? std::numeric_limits<double>::quiet_NaN()
                                               : core_ns::bits_double(host_counters.max_abs_bits);
  out.ulp.mean = out.ulp.compared == 0 ? 0.0 : sums[5] / static_cast<double>(out.ulp.compared);

  const std::int64_t chunks_per_row = (cols + canonical_chunk - 1) / canonical_chunk;
  device_buffer row_partials(static_cast<std::size_t>(rows * chunks_per_row) * sizeof(double));
  runtime::launch(row_chunks_kernel, grid_for(rows * chunks_per_row), threads_per_block, 0, hat,
                  g, rows, cols, chunks_per_row, row_partials.as<double>());
  std::vector<double> host_rows(static_cast<std::size_t>(rows * chunks_per_row));
  row_partials.download(host_rows.data(), row_partials.bytes());
  for (std::int64_t r = 0; r < rows; ++r) {
    out.row_error_norms[static_cast<std::size_t>(r)] = std::sqrt(
        tree_of(host_rows, static_cast<std::size_t>(r * chunks_per_row), static_cast<std::size_t>(chunks_per_row)));
  }
  const std::int64_t chunks_per_column = (rows + canonical_chunk - 1) / canonical_chunk;
  device_buffer column_partials(static_cast<std::size_t>(chunks_per_column * cols) * sizeof(double));
  runtime::launch(column_chunks_kernel, grid_for(chunks_per_column * cols), threads_per_block, 0, hat,
                  g, rows, cols, chunks_per_column, column_partials.as<double>());
  std::vector<double> host_columns(static_cast<std::size_t>(chunks_per_column * cols));
  column_partials.download(host_columns.data(), column_partials.bytes());
  std::vector<double> column(static_cast<std::size_t>(chunks_per_column));
  for (std::int64_t c = 0; c < cols; ++c) {
    for (std::int64_t chunk = 0; chunk < chunks_per_column; ++chunk) {
      column[static_cast<std::size_t>(chunk)] = host_columns[static_cast<std::size_t>(chunk * cols + c)];
    }
    out.column_error_norms[static_cast<std::size_t>(c)] = std::sqrt(canonical_tree(column));
  }
  return out;
}

// ================================================================================================
// The replay's cross-step state on the device: the shared per-element functions
// (include/mxscope/core/cross_step.hpp) run on every element, and each canonical chunk's partial
// sums are formed in index order (cross_step_chunks), so each state element and each chunk partial
// has the CPU's bits; the host combines the partials by canonical_tree and takes the square roots
// as src/cross_step.cpp does.

namespace {

constexpr int cross_step_matrices = 7;  // fp64 state matrices per reference or unit state

// One thread block of cross_step_lanes threads per canonical chunk. Every accumulator slot of the
// per-element functions is updated as acc = acc + t with t = fl(x y) (no contraction); thread l
// runs element begin + 32 j + l (consecutive threads, consecutive elements: coalesced) with its
// own slots set to +0, which leaves it t (0 + t = t; a -0 term becomes +0, which adds like -0 to a
// partial that is never -0 itself). The terms go through shared memory, and thread k < Sums adds
// slot k's terms of the 32 elements in index order: the same additions in the same order as one
// thread walking the chunk, hence the same partial sums.
constexpr int cross_step_lanes = 32;

template <int Sums, class Element>
__device__ inline void cross_step_chunks(std::int64_t count, std::int64_t chunk_count, double* partials,
                                         const Element& element) {
  __shared__ double terms[cross_step_lanes][Sums + 1];
  const int lane = static_cast<int>(threadIdx.x);
  for (std::int64_t chunk = blockIdx.x; chunk < chunk_count; chunk += gridDim.x) {
    double partial = 0.0;  // thread k < Sums: slot k
    const std::int64_t begin = chunk * canonical_chunk;
    const std::int64_t end = begin + canonical_chunk < count ? begin + canonical_chunk : count;
    for (std::int64_t base = begin; base < end; base += cross_step_lanes) {
      double local[Sums] = {};
      if (base + lane < end) element(base + lane, local);
#pragma unroll
      for (int k = 0; k < Sums; ++k) terms[lane][k] = local[k];
      __syncthreads();
      if (lane < Sums) {
        const int present = end - base < cross_step_lanes ? static_cast<int>(end - base) : cross_step_lanes;
        for (int l = 0; l < present; ++l) partial = partial + terms[l][lane];
      }
      __syncthreads();
    }
    if (lane < Sums) partials[lane * chunk_count + chunk] = partial;
  }
}

__global__ void reference_cross_step_kernel(core_ns::reference_state_view state, const double* g, double beta,
                                            core_ns::adamw_step_constants adamw, std::int64_t count,
                                            std::int64_t chunk_count, double* partials) {
  cross_step_chunks<core_ns::reference_sum_count>(count, chunk_count, partials, [&](std::int64_t i, double* acc) {
    core_ns::reference_element(state, beta, adamw, g[i], i, acc);
  });
}

__global__ void unit_cross_step_kernel(core_ns::unit_state_view state, core_ns::reference_optimizer_view reference,
                                       const float* estimate, const double* exact, const double* g, double beta,
                                       core_ns::adamw_step_constants adamw, std::int64_t count,
                                       std::int64_t chunk_count, double* partials) {
  cross_step_chunks<core_ns::unit_sum_count>(count, chunk_count, partials, [&](std::int64_t i, double* acc) {
    core_ns::unit_element(state, reference, beta, adamw, estimate[i], exact[i], g[i], i, acc);
  });
}


std::string shape_text(std::int64_t rows, std::int64_t cols) {
  std::string text = "[";  // appended piece by piece: "[" + std::string trips GCC 12's -Wrestrict
  text += to_text(rows);
  text += ", ";
  text += to_text(cols);
  text += "]";
  return text;
}

void require_cross_step_shape(std::int64_t rows, std::int64_t cols, std::int64_t want_rows, std::int64_t want_cols,
                              const char* what, const char* where) {
  if (rows != want_rows || cols != want_cols) {
    throw input_error(std::string(where) + ": " + what + " is " + shape_text(rows, cols) + ", expected " +
                      shape_text(want_rows, want_cols));
  }
}

// The canonical totals of `width` sums from their chunk partials on the device.
template <int width>
std::array<double, width> cross_step_totals(const device_buffer& partials, std::int64_t chunk_count) {
  std::vector<double> host(static_cast<std::size_t>(width * chunk_count));
  partials.download(host.data(), host.size() * sizeof(double));
  std::array<double, width> totals{};
  for (int s = 0; s < width; ++s) {
    totals[static_cast<std::size_t>(s)] =
        tree_of(host, static_cast<std::size_t>(s * chunk_count), static_cast<std::size_t>(chunk_count));
  }
  return totals;
}

core_ns::adamw_step_constants adamw_constants_of(const optimizer_settings& settings, std::int64_t t) {
  return core_ns::make_adamw_step_constants(settings.adamw_beta1, settings.adamw_beta2, settings.adamw_eps, t);
}

// Throws gpu_error when allocating `bytes` now would leave less than the reserve free.
void require_cross_step_room(std::size_t bytes, std::int64_t count, const cross_step_reserve& reserve,
                             const char* what) {
  release_scratch_pool();  // what the pool keeps is free memory to the other stages
  std::size_t free_bytes = 0, total_bytes = 0;
  MXSCOPE_GPU_CHECK(runtime::memory_info(&free_bytes, &total_bytes));
  const std::uint64_t keep = reserve.fixed + reserve.per_element * static_cast<std::uint64_t>(count);
  if (static_cast<std::uint64_t>(free_bytes) < keep || static_cast<std::uint64_t>(free_bytes) - keep < bytes) {
    throw gpu_error(std::string(what) + ": " + std::to_string(bytes) + " bytes of device memory would leave less than " +
                    std::to_string(keep) + " of the " + std::to_string(free_bytes) + " free");
  }
}

// Downloads matrix `index` of a state allocation of `count` elements per matrix.
void download_state_matrix(const device_buffer& state, int index, std::int64_t rows, std::int64_t cols,
                           matrix64& out) {
  out = matrix64(rows, cols);
  const std::size_t bytes = static_cast<std::size_t>(rows * cols) * sizeof(double);
  if (bytes > 0) state.download(out.data(), bytes, static_cast<std::size_t>(index) * bytes);
}

}  // namespace

struct reference_cross_step::storage {
  cross_step_reserve reserve;
  std::int64_t steps = 0;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  device_buffer state;     // sum, SGD momentum and displacement, AdamW first, second, direction, displacement
  device_buffer g;         // G_t of the last step
  device_buffer partials;  // reference_sum_count x chunks
  // Upload buffers of a unit's Ghat_t and X_t for unit steps given host matrices, shared by the
  // units of this (layer, GEMM) (one step at a time), allocated by the first such step (a replay
  // passes device matrices and never needs them).
  device_buffer estimate;
  device_buffer exact;

  std::int64_t count() const { return rows * cols; }
  double* matrix_at(int index) const { return state.as<double>() + static_cast<std::int64_t>(index) * count(); }
};

reference_cross_step::reference_cross_step(cross_step_reserve reserve) : storage_(std::make_unique<storage>()) {
  storage_->reserve = reserve;
}
reference_cross_step::~reference_cross_step() = default;
reference_cross_step::reference_cross_step(reference_cross_step&&) noexcept = default;
reference_cross_step& reference_cross_step::operator=(reference_cross_step&&) noexcept = default;
std::int64_t reference_cross_step::steps() const { return storage_->steps; }

namespace {

// The reference state's device memory, allocated and zeroed at its first step (everything first,
// then commit: a failed allocation leaves the state at step 0); then the shape check.
void prepare_reference_step(reference_cross_step::storage& s, std::int64_t rows, std::int64_t cols);

// The step itself, once G_t is in s.g.
reference_step_norms run_reference_step(reference_cross_step::storage& s, const optimizer_settings& settings);

}  // namespace

reference_step_norms reference_cross_step::step(const matrix64& g, const optimizer_settings& settings) {
  storage& s = *storage_;
  prepare_reference_step(s, g.rows, g.cols);
  s.g.upload(g.data(), static_cast<std::size_t>(s.count()) * sizeof(double));
  return run_reference_step(s, settings);
}

reference_step_norms reference_cross_step::step(const device_matrix& g, const optimizer_settings& settings) {
  storage& s = *storage_;
  prepare_reference_step(s, g.rows(), g.cols());
  copy_on_device(s.g.get(), g.fp64(), static_cast<std::size_t>(s.count()) * sizeof(double));
  return run_reference_step(s, settings);
}

namespace {

void prepare_reference_step(reference_cross_step::storage& s, std::int64_t rows, std::int64_t cols) {
  if (s.steps == 0) {
    const std::int64_t count = rows * cols;
    const std::int64_t chunk_count = (count + canonical_chunk - 1) / canonical_chunk;
    const std::size_t bytes = static_cast<std::size_t>(count) * sizeof(double);
    const std::size_t partial_bytes =
        static_cast<std::size_t>(core_ns::reference_sum_count * chunk_count) * sizeof(double);
    require_cross_step_room((cross_step_matrices + 1) * bytes + partial_bytes, count, s.reserve,
                            "reference_cross_step");
    device_buffer state(cross_step_matrices * bytes);
    device_buffer gradient(bytes);
    device_buffer partials(partial_bytes);
    state.fill_bytes(0);  // +0.0, as a fresh matrix64
    s.state = std::move(state);
    s.g = std::move(gradient);
    s.partials = std::move(partials);
    s.rows = rows;
    s.cols = cols;
  }
  require_cross_step_shape(rows, cols, s.rows, s.cols, "G", "reference_step");
}

reference_step_norms run_reference_step(reference_cross_step::storage& s, const optimizer_settings& settings) {
  const std::int64_t t = s.steps + 1;
  const std::int64_t count = s.count();
  const std::int64_t chunk_count = (count + canonical_chunk - 1) / canonical_chunk;
  std::array<double, core_ns::reference_sum_count> sums{};
  if (count > 0) {
    const core_ns::reference_state_view view{s.matrix_at(0), s.matrix_at(1), s.matrix_at(2), s.matrix_at(3),
                                             s.matrix_at(4), s.matrix_at(5), s.matrix_at(6)};
    runtime::launch(reference_cross_step_kernel, grid_for(chunk_count, 1), cross_step_lanes, 0, view,
                    s.g.as<const double>(),
                    settings.sgd_momentum, adamw_constants_of(settings, t), count, chunk_count,
                    s.partials.as<double>());
    sums = cross_step_totals<core_ns::reference_sum_count>(s.partials, chunk_count);
  }
  s.steps = t;
  return reference_norms(sums);
}

}  // namespace

void reference_cross_step::download(reference_accumulators& out) const {
  const storage& s = *storage_;
  out.steps = s.steps;
  matrix64* matrices[cross_step_matrices] = {&out.sum,         &out.sgd_momentum, &out.sgd_displacement,
                                             &out.adamw_first, &out.adamw_second, &out.adamw_direction,
                                             &out.adamw_displacement};
  for (int m = 0; m < cross_step_matrices; ++m) {
    if (s.steps == 0) {
      *matrices[m] = matrix64();
    } else {
      download_state_matrix(s.state, m, s.rows, s.cols, *matrices[m]);
    }
  }
}

struct unit_cross_step::storage {
  cross_step_reserve reserve;
  std::int64_t steps = 0;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  double previous_error_energy = 0.0;
  device_buffer state;  // error sum, previous error, SGD momentum and displacement, AdamW first, second, displacement
  device_buffer partials;

  std::int64_t count() const { return rows * cols; }
  double* matrix_at(int index) const { return state.as<double>() + static_cast<std::int64_t>(index) * count(); }
};

unit_cross_step::unit_cross_step(cross_step_reserve reserve) : storage_(std::make_unique<storage>()) {
  storage_->reserve = reserve;
}
unit_cross_step::~unit_cross_step() = default;
unit_cross_step::unit_cross_step(unit_cross_step&&) noexcept = default;
unit_cross_step& unit_cross_step::operator=(unit_cross_step&&) noexcept = default;
std::int64_t unit_cross_step::steps() const { return storage_->steps; }

unit_step_norms unit_cross_step::step(const reference_cross_step& reference, const matrix& estimate,
                                      const matrix64& exact, const optimizer_settings& settings) {
  reference_cross_step::storage& r = reference.data();  // its upload buffers are the unit's
  require_cross_step_shape(exact.rows, exact.cols, r.rows, r.cols, "the exact product X", "unit_step");
  require_cross_step_shape(estimate.rows, estimate.cols, r.rows, r.cols, "the estimate Ghat", "unit_step");
  const std::int64_t count = r.count();
  if (count > 0) {
    const std::size_t estimate_bytes = static_cast<std::size_t>(count) * sizeof(float);
    const std::size_t exact_bytes = static_cast<std::size_t>(count) * sizeof(double);
    if (r.estimate.bytes() != estimate_bytes) r.estimate = device_buffer(estimate_bytes);
    if (r.exact.bytes() != exact_bytes) r.exact = device_buffer(exact_bytes);
    r.estimate.upload(estimate.data(), estimate_bytes);
    r.exact.upload(exact.data(), exact_bytes);
  }
  return step_on_device(reference, r.estimate.as<const float>(), r.exact.as<const double>(), settings);
}

unit_step_norms unit_cross_step::step(const reference_cross_step& reference, const device_matrix& estimate,
                                      const device_matrix& exact, const optimizer_settings& settings) {
  const reference_cross_step::storage& r = reference.data();
  require_cross_step_shape(exact.rows(), exact.cols(), r.rows, r.cols, "the exact product X", "unit_step");
  require_cross_step_shape(estimate.rows(), estimate.cols(), r.rows, r.cols, "the estimate Ghat", "unit_step");
  return step_on_device(reference, estimate.fp32(), exact.fp64(), settings);
}

unit_step_norms unit_cross_step::step_on_device(const reference_cross_step& reference, const float* estimate,
                                                const double* exact, const optimizer_settings& settings) {
  storage& s = *storage_;
  const reference_cross_step::storage& r = reference.data();
  if (r.steps != s.steps + 1) {
    throw std::logic_error("unit_step: step " + to_text(s.steps + 1) +
                           " of a unit needs the reference at that step, not at step " + to_text(r.steps));
  }
  const std::int64_t count = r.count();
  const std::int64_t chunk_count = (count + canonical_chunk - 1) / canonical_chunk;
  if (s.steps == 0) {
    const std::size_t state_bytes = cross_step_matrices * static_cast<std::size_t>(count) * sizeof(double);
    const std::size_t partial_bytes = static_cast<std::size_t>(core_ns::unit_sum_count * chunk_count) * sizeof(double);
    require_cross_step_room(state_bytes + partial_bytes, count, s.reserve, "unit_cross_step");
    device_buffer state(state_bytes);
    device_buffer partials(partial_bytes);
    state.fill_bytes(0);
    s.state = std::move(state);
    s.partials = std::move(partials);
    s.rows = r.rows;
    s.cols = r.cols;
  }
  require_cross_step_shape(s.rows, s.cols, r.rows, r.cols, "the unit state", "unit_step");
  const std::int64_t t = s.steps + 1;
  std::array<double, core_ns::unit_sum_count> sums{};
  if (count > 0) {
    const core_ns::unit_state_view view{s.matrix_at(0), s.matrix_at(1), s.matrix_at(2), s.matrix_at(3),
                                        s.matrix_at(4), s.matrix_at(5), s.matrix_at(6)};
    const core_ns::reference_optimizer_view reference_view{r.matrix_at(1), r.matrix_at(2), r.matrix_at(5),
                                                           r.matrix_at(6)};
    runtime::launch(unit_cross_step_kernel, grid_for(chunk_count, 1), cross_step_lanes, 0, view, reference_view,
                    estimate, exact,
                    r.g.as<const double>(), settings.sgd_momentum, adamw_constants_of(settings, t), count,
                    chunk_count, s.partials.as<double>());
    sums = cross_step_totals<core_ns::unit_sum_count>(s.partials, chunk_count);
  }
  s.steps = t;
  const unit_step_norms out = unit_norms(sums, t, s.previous_error_energy);  // as src/cross_step.cpp
  s.previous_error_energy = out.error_energy;
  return out;
}

void unit_cross_step::download(unit_accumulators& out) const {
  const storage& s = *storage_;
  out.steps = s.steps;
  out.previous_error_energy = s.previous_error_energy;
  matrix64* matrices[cross_step_matrices] = {&out.error_sum,   &out.previous_error, &out.sgd_momentum,
                                             &out.sgd_displacement, &out.adamw_first, &out.adamw_second,
                                             &out.adamw_displacement};
  for (int m = 0; m < cross_step_matrices; ++m) {
    if (s.steps == 0) {
      *matrices[m] = matrix64();
    } else {
      download_state_matrix(s.state, m, s.rows, s.cols, *matrices[m]);
    }
  }
}

// Whole tensors in device memory under every scheme, and their bf16 GEMM operands.
#include "tensor_quantize-inl.cuh"

}  // namespace mxscope::gpu
