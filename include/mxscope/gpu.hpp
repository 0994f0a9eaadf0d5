// The GPU backend (CUDA on NVIDIA, HIP on AMD): rotations, MX quantization, emulated MX GEMMs, the
// exact reference GEMM and the comparison sums, computing the same bits as the CPU library.
//
// Every kernel calls the per-element functions of include/mxscope/core (shared_exponent,
// quantize_element, dequantize_element, random_stream::word, rotate_segment, add_to_float,
// add_exactly_to_float, long_accumulator) and keeps the CPU's order wherever an order matters
// (the Hadamard stages, the ascending K-block order of an accumulator, the canonical reduction
// order of compare.hpp), so a result differs from the CPU's in no bit. docs/gpu.md lists what runs
// where and how tools/gpu-test checks it.
//
// Two layers:
// - host convenience functions taking and returning host matrices (rotate, quantize,
//   emulate_product, reference_gemm, compare), for the CLI and the tests;
// - device functions on device pointers (the *_on_device functions and prepared operands) for
//   pipelines that keep data on the GPU and for benchmarks.
// This header is plain C++ (no CUDA or HIP types): any host compiler can include it; the
// definitions live in src/gpu/kernels.cu and exist only when the GPU backend is built
// (MXSCOPE_HAVE_CUDA).
//
// NaN outputs are written with one bit pattern, 0x7FC00000 (fp32) and 0x7FF8000000000000 (fp64):
// the positive quiet NaN, which is what the CPU writes for NaN blocks and NaN entries.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "mxscope/compare.hpp"
#include "mxscope/core/accumulate.hpp"
#include "mxscope/core/mx.hpp"
#include "mxscope/core/philox.hpp"
#include "mxscope/cross_step.hpp"
#include "mxscope/gemm.hpp"
#include "mxscope/quantize.hpp"
#include "mxscope/reference.hpp"
#include "mxscope/tensor.hpp"
#include "mxscope/timeline.hpp"

namespace mxscope::gpu {

// A failed GPU runtime call or kernel launch (the message names the call site and the error).
class gpu_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// ------------------------------------------------------------------------------------------------
// Devices and memory.

// Number of usable devices; 0 (never an exception) when there is no device or no driver.
int device_count();

// Makes device `index` (0-based, below device_count()) the current one of the calling thread; every
// later call of this thread runs there. Throws gpu_error for an index that does not exist.
void select_device(int index);

struct device_description {
  std::string name;
  int major = 0;  // compute capability (NVIDIA) or GCN architecture major (AMD)
  int minor = 0;
  int multiprocessors = 0;
  std::uint64_t global_memory_bytes = 0;
};
device_description describe_device();

// Owning device memory (move-only). Contents are uninitialized after allocation.
class device_buffer {
 public:
  device_buffer() = default;
  explicit device_buffer(std::size_t bytes);
  ~device_buffer();
  device_buffer(device_buffer&& other) noexcept;
  device_buffer& operator=(device_buffer&& other) noexcept;
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;

  void* get() const { return data_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  std::size_t bytes() const { return bytes_; }
  void upload(const void* host, std::size_t bytes, std::size_t offset = 0);
  void download(void* host, std::size_t bytes, std::size_t offset = 0) const;
  void fill_bytes(int value);  // every byte set to `value` (e.g. 0xFF to poison an output)

 private:
  void free_memory() noexcept;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  std::size_t capacity_ = 0;  // the allocation's size (at least bytes_: it may come from the buffer cache)
  int device_ = 0;
  bool ordered_ = false;   // allocated in stream order (inside a stream_scope that asks for it)
  void* stream_ = nullptr;  // the stream it was allocated on, where ordered_
};

// A row-major fp32 or fp64 matrix in device memory (move-only): a result that stays on the GPU
// between stages (product -> comparison -> cross-step state) and comes to the host only on request.
class device_matrix {
 public:
  enum class element : std::uint8_t { fp32, fp64 };
  device_matrix() = default;
  device_matrix(std::int64_t rows, std::int64_t cols, element kind);  // contents uninitialized
  static device_matrix upload(const matrix& values);
  static device_matrix upload(const matrix64& values);
  device_matrix(device_matrix&&) noexcept = default;
  device_matrix& operator=(device_matrix&&) noexcept = default;

  std::int64_t rows() const { return rows_; }
  std::int64_t cols() const { return cols_; }
  std::int64_t size() const { return rows_ * cols_; }
  element kind() const { return kind_; }
  // The device pointer; throws std::logic_error for the other element type.
  float* fp32() const;
  double* fp64() const;
  matrix download32() const;
  matrix64 download64() const;
  // Elements [first, first + count) of an fp32 matrix from `host` (device_buffer::upload's copy).
  void upload_part(const float* host, std::int64_t first, std::int64_t count);

 private:
  device_buffer buffer_;
  std::int64_t rows_ = 0;
  std::int64_t cols_ = 0;
  element kind_ = element::fp32;
};

// Waits for all queued device work; throws gpu_error if any of it failed.
void synchronize();

// Frees the device memory the backend keeps for reuse: the device buffers given back outside
// stream order (kept so that a free does not wait for the device, set-up buffers among them). For
// a caller about to hand the memory to other code (another library, a measurement of the free
// memory); the backend itself empties the cache where a cross-step state would not fit beside it
// and when an allocation fails.
void release_cached_memory();
// The bytes of device memory (all devices) the backend keeps for reuse now.
std::size_t cached_memory_bytes();

// For the scope of this object the calling thread queues its GPU work on `stream` (a cudaStream_t,
// e.g. PyTorch's current stream; null is the default stream), and with `stream_ordered` its
// temporary device buffers are allocated and freed in that stream's order (cudaMallocAsync), so a
// call returns without waiting for the device except where it must read a result on the host (the
// per-tensor amax of NVFP4 and fp8). Scopes nest; the HIP build ignores the stream.
class stream_scope {
 public:
  explicit stream_scope(void* stream, bool stream_ordered = true);
  ~stream_scope();
  stream_scope(const stream_scope&) = delete;
  stream_scope& operator=(const stream_scope&) = delete;

 private:
  void* previous_stream_;
  bool previous_ordered_;
};

// Uploads `values` on a stream of the calling thread's own that runs beside the default stream
// (no implicit synchronization with it: the default stream's kernels keep running), complete on
// return. The buffer is allocated and freed as device_matrix::upload's (cudaMalloc, cudaFree), so
// any thread may use and free it afterwards. The HIP build uploads on the default stream.
device_matrix upload_beside(const matrix& values);
// The same in parts, for values that arrive piece by piece (the first step's operands while they
// are read): an fp32 matrix of uninitialized contents allocated from the calling thread, then
// elements [first, first + count) of the row-major values copied in from `host` on the calling
// thread's own stream, complete on return; any threads may copy disjoint parts at once.
device_matrix allocate_beside(std::int64_t rows, std::int64_t cols);
void upload_beside(device_matrix& values, const float* host, std::int64_t first, std::int64_t count);

// Makes the current device's pinned upload slots now (device_buffer::upload takes large copies
// through them, making them at its first): a background start-up calls it so that the first step
// does not wait for them. Nothing where they do not apply (HIP, the simulation).
void prepare_staged_uploads();
// The slots' host memory (128 MiB of huge pages, faulted in) made now, without a device context, for
// the first device's slots to pin: a start-up calls it beside the context's creation.
void reserve_staged_upload_memory();

// Queues a device-to-device copy of `bytes` bytes on the default stream.
void copy_on_device(void* destination, const void* source, std::size_t bytes);

// Device-side timing with events on the default stream: start(), the work, stop(), then
// elapsed_ms() (waits for the stop event).
class device_timer {
 public:
  device_timer();
  ~device_timer();
  device_timer(const device_timer&) = delete;
  device_timer& operator=(const device_timer&) = delete;
  void start();
  void stop();
  double elapsed_ms();

 private:
  void* start_ = nullptr;
  void* stop_ = nullptr;
};

// The device timeline (include/mxscope/timeline.hpp; `replay --kernel-times`). While it is on,
// every kernel this process launches, and on CUDA every copy and memset it queues, is recorded
// between two events on its own stream, with the label the queuing thread set. start_timeline()
// starts a fresh one; finish_timeline() waits for the device, ends it and returns the operations in
// the order they were queued (an operation still being queued when it ends is left out), kernels
// named by their demangled names. A timeline records at most `capacity` operations (two live
// events each until it ends; the default covers a few hundred Llama-shaped steps of the study's
// strategies); the ones after are counted in *not_recorded. set_timeline_label sets the calling
// thread's label and returns the one before.
void start_timeline(std::size_t capacity = 100000);
std::vector<timeline::operation> finish_timeline(std::int64_t* not_recorded = nullptr);
std::string set_timeline_label(std::string label);

// ------------------------------------------------------------------------------------------------
// Plans: the resolved parameters of a rotation and of an MX quantizer.

// Block Hadamard rotation along the quantization axis (NUMERICS.md section 5).
struct rotation_plan {
  int size = 0;               // 0: no rotation; else a power of two in [2, 4096]
  bool random_signs = false;  // false: signs = none (deterministic H)
  core::random_stream signs;  // the `signs` role stream after the seed policy
};
// Resolves rotation_options (signs stream of role `signs`, step after the policy). Size 0 -> none.
rotation_plan make_rotation_plan(const rotation_options& options);

struct mx_plan {
  core::element_kind element = core::element_kind::fp4_e2m1;
  int block = 32;
  int axis = 1;
  core::rounding_mode rounding = core::rounding_mode::rne;
  core::scale_rule rule = core::scale_rule::floor;
  int sr_bits = 32;
  core::random_stream stream;  // stochastic rounding only
};
// Resolves and checks quantize_options for an MX format; throws input_error (naming `what` and the
// field) for other schemes or invalid fields. Throws for a rotation that does not fit the shape.
mx_plan make_mx_plan(const quantize_options& options, const std::string& what = "gpu quantize");
void check_rotation(const rotation_plan& rotation, std::int64_t rows, std::int64_t cols, int axis,
                    const std::string& what = "gpu rotate");

// Storage sizes in the layout of quantized_tensor: codes [rows, ceil(cols/2)] for fp4 and
// [rows, cols] otherwise; scales [rows, ceil(cols/block)] (axis 1) or [ceil(rows/block), cols].
std::int64_t mx_code_row_bytes(const mx_plan& plan, std::int64_t cols);
std::int64_t mx_code_bytes(const mx_plan& plan, std::int64_t rows, std::int64_t cols);
std::int64_t mx_scale_rows(const mx_plan& plan, std::int64_t rows, std::int64_t cols);
std::int64_t mx_scale_cols(const mx_plan& plan, std::int64_t rows, std::int64_t cols);

// ------------------------------------------------------------------------------------------------
// Device functions (pointers to device memory; the work is queued on the default stream).

enum class input_format : std::uint8_t { fp32, bf16 };

// Rotates the row-major fp32 tensor values[rows x cols] in place along `axis`.
void rotate_on_device(float* values, std::int64_t rows, std::int64_t cols, int axis, const rotation_plan& rotation);

// The four counters of quantized_tensor, in this order, as device unsigned 64-bit integers.
enum mx_counter : int { counter_nonzero = 0, counter_flushed = 1, counter_saturated = 2, counter_nonfinite = 3 };
inline constexpr int mx_counter_count = 4;

struct mx_device_output {
  std::uint8_t* codes = nullptr;           // required
  std::uint8_t* scales = nullptr;          // required
  float* dequantized = nullptr;            // optional [rows, cols]
  unsigned long long* counters = nullptr;  // optional [4]: added to (zero them first)
  std::uint16_t* operand_bf16 = nullptr;   // optional [rows, cols]: the bf16 GEMM operand (core/operand.hpp)
};

// `generic`: two passes (block scales, then elements) for every option; along axis 0 `automatic`
// takes one pass instead, the same bits: for the float formats with blocks of 32, cols a multiple
// of 8 and 16-byte aligned buffers a staged kernel (a tile of 32 rows x 128 columns through shared
// memory, rotation none or 16 done there), else one thread per 4 columns of a block; `fused`: one pass, one
// thread per block, with the rotation applied in registers (axis 1, block 32, rotation none, 16 or
// 32, cols a multiple of 32); `native`: the fused layout with the element codes from gfx950's
// hardware MX conversions (MI355X only: MXFP4, rne or sr with sr_bits <= 22; docs/gpu.md lists the
// hardware behaviour it assumes); `automatic` takes `native` where it applies, else `fused` where
// it applies.
enum class quantize_path : std::uint8_t { automatic, generic, fused, native };

// Whether the current device runs the gfx950 native paths (quantize_path::native,
// gemm_path::native_mfma): a gfx950 GPU, a HIP build, and MXSCOPE_GPU_NATIVE not set to "off".
bool native_mx_available();
bool fused_path_covers(const mx_plan& plan, const rotation_plan& rotation, std::int64_t rows, std::int64_t cols);

// Rotates (if rotation.size > 0) and quantizes input[rows x cols] (row-major, fp32 or bf16) along
// plan.axis. The rotation runs along the same axis; outside the fused path it goes through an fp32
// copy, so `input` is never modified.
void quantize_on_device(const void* input, input_format format, std::int64_t rows, std::int64_t cols,
                        const mx_plan& plan, const rotation_plan& rotation, const mx_device_output& output,
                        quantize_path path = quantize_path::automatic);

// An MX operand on the device in the quantizer's storage layout.
struct mx_operand_view {
  const std::uint8_t* codes = nullptr;
  const std::uint8_t* scales = nullptr;
  core::element_kind element = core::element_kind::fp4_e2m1;
  int block = 32;
  int axis = 1;  // its reduction axis
  std::int64_t rows = 0;
  std::int64_t cols = 0;
};

// How the product is computed (every path gives the same bits where it applies):
// - generic: per entry, every product formed in fp64 and every rounding through a long accumulator
//   (the definition; slow);
// - integer: exact integer block dots (int32/int64 on element codes scaled to integers), then the
//   model's rounding steps; every MX element format except fp8 e5m2 (fp32-block and exact: see
//   integer_block_kernel);
// - tensor_core: int8 tensor-core block dots (mma m16n8k32 on 2q / 8q / 64q integers, a fresh
//   accumulator per 32-block) then the canonical fp32 scale-add (fp32-block) or an fp64 running
//   sum checked by TwoSum at every addition, with a long-accumulator pass over the entries where
//   one rounded (exact); block 32, fp4 / fp6 e2m3 / int8 elements on both sides, sm_80 or newer;
//   for MXFP4 x MXFP4 fp32-block on sm_90 (sm_90a build) the scaled wgmma kernels instead, whose
//   bf16 or e5m2 operands carry the block scales (tensor_core_kernel below);
// - native_mfma: gfx950's scaled MFMA (v_mfma_scale_f32_16x16x128_f8f6f4), one fp32 rounding per
//   128-k instruction; MXFP4 x MXFP4, block 32, and only the fp32-group:4 model, which that
//   instruction implements by hypothesis (unverified until measured on an MI355X: docs/gpu.md);
// - automatic: native_mfma, else tensor_core, else integer, else generic.
enum class gemm_path : std::uint8_t { automatic, generic, integer, tensor_core, native_mfma };
std::string_view gemm_path_name(gemm_path path);
bool gemm_path_covers(gemm_path path, core::element_kind a, core::element_kind b, int block,
                      const accumulation_model& model);

// The kernel behind the tensor-core path's fp32-block products (all give the same bits):
// - mma_sync: mma.sync m16n8k32 s8 (sm_80 or newer);
// - wgmma: the asynchronous warpgroup MMA (wgmma m64n64k32 s8) of an sm_90a build on an sm_90
//   device (H100, H200);
// - wgmma_bf16: MXFP4 x MXFP4 only, from the same builds and devices: the block scales inside
//   bf16 operands (q 2^e), each block dot with its scales from wgmma m64n64k16 bf16 into fresh
//   fp32 registers, one fp32 addition per entry and block. It runs where every block with a nonzero
//   element has -125 <= e <= 125, the two operands' lowest exponents add up to at least -124 and
//   their highest to at most 117, and no block is NaN (there every step is exact); other products
//   take mma_sync;
// - wgmma_fp8: the same with e5m2 operands q 2^(e - b), one base exponent b per 128-row tile and
//   K-block, wgmma m64n64k32 e5m2 and one fma with 2^(ba + bb) per entry and block; it runs where
//   wgmma_bf16 does and every tile's blocks with a nonzero element span at most 28 exponents in
//   each K-block, and hands the other products to wgmma_bf16 (then mma_sync).
// docs/gpu.md and BENCHMARKS.md say where each stands; automatic is the fastest available.
// The choice is process-wide (tests and benchmarks set it); the exact model keeps its own kernel.
enum class tensor_core_kernel : std::uint8_t { automatic, mma_sync, wgmma, wgmma_bf16, wgmma_fp8 };
std::string_view tensor_core_kernel_name(tensor_core_kernel kernel);
bool tensor_core_kernel_available(tensor_core_kernel kernel);
void select_tensor_core_kernel(tensor_core_kernel kernel);
tensor_core_kernel selected_tensor_core_kernel();  // never automatic: what products run now
// The kernel that ran the most recent fp32-block product of the tensor-core path (process-wide;
// automatic before the first): where a selected kernel hands a product on as said above, the one
// that took it.
tensor_core_kernel last_tensor_core_kernel();

// The kernel behind the tensor-core path's exact products (both give the same bits):
// - mma_sync: tensor_core_exact_kernel, the block dots from mma.sync m16n8k32 s8 (sm_80 or newer);
// - wgmma: the same steps on block dots from the asynchronous warpgroup MMA (wgmma m64n64k32 s8) of
//   an sm_90a build on an sm_90 device.
// automatic: wgmma where it runs (not in the CPU simulation), else mma_sync (the timings behind the
// choice: BENCHMARKS.md). Process-wide, as tensor_core_kernel.
enum class exact_product_kernel : std::uint8_t { automatic, mma_sync, wgmma };
std::string_view exact_product_kernel_name(exact_product_kernel kernel);
bool exact_product_kernel_available(exact_product_kernel kernel);
void select_exact_product_kernel(exact_product_kernel kernel);
// The kernel that ran the most recent exact product of the tensor-core path (automatic before the
// first).
exact_product_kernel last_exact_product_kernel();

// The kernel behind the integer path's fp32-block and exact products (both give the same bits):
// - simt: the integer path's own kernel (block dots on the fp64 tensor cores or in FMA chains);
// - sliced: each element integer cut into three 7-bit slices, the block dot from nine
//   mma.sync m16n8k32 s8 per K-block combined exactly (sm_80 or newer; docs/gpu.md). It takes the
//   products of 32-element blocks whose formats' integers stay below 2^18 (fp8 e4m3, fp6 e3m2 and
//   the narrower formats) and whose block exponents are finite (no NaN block) and within +-400; the
//   others take simt;
// - sliced_wgmma: the same slices and steps, the nine products per K-block from the asynchronous
//   warpgroup MMA (wgmma m64n32k32 s8) of an sm_90a build on an sm_90 device; it takes the same
//   products as sliced; automatic does not choose it (the timings behind the choice: BENCHMARKS.md).
// automatic: sliced where it applies. Process-wide, as tensor_core_kernel.
enum class integer_block_kernel : std::uint8_t { automatic, simt, sliced, sliced_wgmma };
std::string_view integer_block_kernel_name(integer_block_kernel kernel);
bool integer_block_kernel_available(integer_block_kernel kernel);
void select_integer_block_kernel(integer_block_kernel kernel);
// The kernel that ran the most recent fp32-block or exact product of the integer path (automatic
// before the first).
integer_block_kernel last_integer_block_kernel();
// Whether that product was an `exact` one that sliced took as one dot over the whole of K: every
// row of both operands with one block exponent (per-tensor scaling) and K <= 65536 (docs/gpu.md).
bool last_integer_product_whole_k();
// Whether the most recent multiply_prepared_both that ran summed its exact model without checking
// its additions: on sliced, every row of both operands with one block exponent and K <= 65536,
// where none can round (docs/gpu.md).
bool last_both_exact_unchecked();

// The kernel behind fp32-block products of unscaled operands with blocks of 32 (the bf16 and fp32
// baselines; plain_product_on_device), both on the fp64 tensor cores where a chunk's dot is exact
// and both giving the same bits:
// - tile: 32 x 16 entries per warp, operands staged from their rows (every build);
// - warp: 32 x 32 entries per warp from chunk tiles of both operands (one more fp32 copy of each,
//   padded to whole 64-row tiles, held while it runs), the exact reference's layout (CUDA builds
//   with the tensor cores, sm_80 or newer).
// automatic: warp where available. Process-wide, as tensor_core_kernel.
enum class plain_block_kernel : std::uint8_t { automatic, tile, warp };
std::string_view plain_block_kernel_name(plain_block_kernel kernel);
bool plain_block_kernel_available(plain_block_kernel kernel);
void select_plain_block_kernel(plain_block_kernel kernel);
// The kernel that ran the most recent such product (automatic before the first).
plain_block_kernel last_plain_block_kernel();

// An operand brought to the canonical form of the product ([rows, depth], the reduction
// contiguous) for one path; reusable across products. The integer path's sliced kernel also keeps
// the operand's sliced form in it (3 bytes an element and 8 a block, set-up buffers) for the
// next product with the same partner format: a product pays for the slicing once per operand.
class prepared_operand {
 public:
  prepared_operand();
  ~prepared_operand();
  prepared_operand(prepared_operand&&) noexcept;
  prepared_operand& operator=(prepared_operand&&) noexcept;
  std::int64_t rows() const;
  std::int64_t depth() const;
  struct storage;
  storage& data() const { return *storage_; }

 private:
  std::unique_ptr<storage> storage_;
};

// Throws input_error when the operand's format or block does not fit `path` (automatic resolves
// per pair in multiply_prepared: prepare with the path you will multiply with).
prepared_operand prepare_operand(const mx_operand_view& operand, gemm_path path);

// The scaled kernels' forms of an operand prepared for the tensor-core path (MXFP4; made where
// those kernels exist, and always in the CPU simulation, so that tests can check them there),
// copied to the host. Both are tiles of 128 rows x 128 bytes, rows padded to a multiple of 256,
// each row's 16-byte chunk c stored at chunk c ^ (row mod 8), tiles ordered by row tile, then k:
// bf16 holds q 2^e (64 k per tile), fp8 holds q 2^(e - b) as e5m2 (128 k per tile) with b in
// fp8_bases [row tiles][k tiles][4] (one per K-block); blocks outside a form's range hold zeros.
// lowest / highest: the least and largest block exponent over blocks with a nonzero element (1000
// and -1000 when there are none); nan_block: a NaN block is present; fp8_fits: every 128-row tile's
// blocks with a nonzero element span at most 28 exponents per K-block and no block is NaN.
struct scaled_operand_forms {
  bool made = false;
  std::vector<std::uint16_t> bf16;
  std::vector<std::uint8_t> fp8;
  std::vector<std::int32_t> fp8_bases;
  int lowest = 1000;
  int highest = -1000;
  bool nan_block = false;
  bool fp8_fits = false;
};
scaled_operand_forms scaled_forms(const prepared_operand& operand);

// out[M x N] (fp32, row-major) = the emulated A B^T; exact_out [M x N] (fp64) only for the exact
// model (may be null). Throws input_error for mismatched depths or blocks or an uncovered path.
void multiply_prepared(const prepared_operand& a, const prepared_operand& b, const accumulation_model& model,
                       output_rounding output, float* out, double* exact_out, gemm_path path);
// The fp32-block product into `out` (with `output`) and the exact model's product of the same
// operands into exact_out (fp64) and exact_out32 (fp32, output fp32) from one pass of the integer
// path's sliced kernel, which forms each block dot once for both; the bits are those of two
// multiply_prepared calls. False, with nothing computed, where that kernel does not take the
// operands (prepared for another path, not on its conditions, or another integer-path kernel
// selected): the caller multiplies twice.
bool multiply_prepared_both(const prepared_operand& a, const prepared_operand& b, output_rounding output, float* out,
                            double* exact_out, float* exact_out32);

// The path `automatic` resolves to for these operands.
gemm_path resolve_gemm_path(const mx_operand_view& a, const mx_operand_view& b, const accumulation_model& model);

// Exact reference C = A B^T of fp32 A [m x k] and B [n x k] (row-major, device): fp64 and fp32
// results correctly rounded from the exact sum; entries whose rows hold inf or NaN are the IEEE
// fp64 sum in ascending k (as the CPU reference). Either output may be null.
void reference_on_device(const float* a, const float* b, std::int64_t m, std::int64_t n, std::int64_t k, double* out64,
                         float* out32);

// The order of K in which the exact reference's tiled kernels take the products (the sums are
// exact, so the order changes no bit; it changes how many entries keep their fp64 dot across a
// super-chunk). keys[k]: the largest leading exponent of column k of the operand + 256, 0 for a
// column without nonzero finite values. The positions sorted stably by (A's key, B's key) or by
// (B's key, A's key), whichever spans fewer exponents over the groups of 256 and of 128
// positions (per group and operand the largest key less the smallest nonzero one), where that
// saves at least two exponents a group against K as it is; otherwise empty (K as it is).
// Keys of different lengths throw input_error.
std::vector<std::int32_t> reference_token_order(const std::vector<unsigned>& a_keys,
                                                const std::vector<unsigned>& b_keys);
// Whether the most recent exact reference of fp32 operands on the device took K reordered.
bool last_reference_reordered();

// The exact reference's kernels (the same bits from each). `tiles`: the fp64 tensor-core tiles, K
// in reference_token_order, and the per-product kernel for the entries beyond their window; any
// operands. `sliced`: int8 slices, where every row of A and of B is an integer below 2^18 times a
// power of two (at most 18 bits from its leading to its lowest set bit), no row holds inf or NaN,
// 0 < K <= 65536 and the sum is not scaled: each value's integer cut into three signed slices of
// 7, 7 and 4 bits, the nine slice pairs' dots summed exactly in int32 over the whole of K on the
// int8 tensor cores, then one exact fp64 step per entry; other operands take `tiles`. `automatic`
// is `sliced` (CUDA sm_80+ and the CPU simulation; else `tiles`). Selecting one the build or
// device lacks throws input_error.
enum class reference_kernel : std::uint8_t { automatic, tiles, sliced };
std::string_view reference_kernel_name(reference_kernel kernel);
bool reference_kernel_available(reference_kernel kernel);
void select_reference_kernel(reference_kernel kernel);
// Which kernel (tiles or sliced) took the most recent exact reference of fp32 operands.
reference_kernel last_reference_kernel();

// The product of unscaled fp32 A [m x k] and B [n x k] (row-major, device; bf16 operands as their
// fp32 values) under fp32-block, fp32-group:G or fp32-seq, cut into K-blocks of `block` with every
// block scale 1, into out [m x n]: the device part of emulate_plain_product. Returns when done.
void plain_product_on_device(const float* a, const float* b, std::int64_t m, std::int64_t n, std::int64_t k,
                             int block, const accumulation_model& model, output_rounding output, float* out);

// Self-test of the fused quantizer's element encoder (src/gpu/fast_encode.hpp) against the core, on
// the device: for the fp32 bit patterns first, first + stride, ... (count of them, modulo 2^32;
// non-finite patterns skipped) it compares codes, flags and dequantized values of one float element
// format, rounding mode (sr draws its word from the pattern), sr_bits and block exponent.
struct encoder_self_test {
  std::uint64_t checked = 0;
  std::uint64_t mismatches = 0;
  std::uint32_t first_mismatch = 0;  // the smallest mismatching pattern (when mismatches > 0)
};
encoder_self_test self_test_fast_encoder(core::element_kind kind, core::rounding_mode mode, int sr_bits, int exponent,
                                         std::uint64_t first, std::uint64_t count, std::uint64_t stride);

// ------------------------------------------------------------------------------------------------
// Whole tensors in device memory under any scheme (the Python package's CUDA path, src/capi).

// Device buffers in the layout of quantized_tensor. codes is required; scales where the scheme has
// block scales (MX, NVFP4); the rest are optional.
struct tensor_device_output {
  std::uint8_t* codes = nullptr;
  std::uint8_t* scales = nullptr;
  float* dequantized = nullptr;            // [rows, cols] fp32, as quantized_tensor::dequantized
  std::uint16_t* operand_bf16 = nullptr;   // [rows, cols] bf16: see quantize_tensor_on_device
  unsigned long long* counters = nullptr;  // [4] in mx_counter order, added to (zero them first)
};

// Rotates (rotation.size > 0, along options.axis) and quantizes input [rows x cols] (row-major,
// fp32 or bf16, device memory; never modified) with the bits of the host's rotate + quantize for
// every scheme: MX, NVFP4, per-tensor fp8 and bf16. Returns the tensor scale (NVFP4: the global
// decode scale; per-tensor fp8: its fp32 scale; otherwise 1).
// operand_bf16 receives each element's value without the tensor scale, as bf16 (RNE): MX q 2^e,
// NVFP4 q times its ue4m3 block scale, fp8 q, bf16 the rounded value; NaN blocks and codes give
// 0x7FC0. So a GEMM of two such operands times the two tensor scales is the product of the
// dequantized operands. These values have at most 8 significant bits and are exact in bf16, except
// MX blocks of fp8 elements with a scale below 2^-117 (e5m2) or 2^-124 (e4m3), whose smallest
// values lie under bf16's subnormal range.
// NVFP4 and per-tensor fp8 read the tensor's amax back to the host (one wait for the stream).
float quantize_tensor_on_device(const void* input, input_format format, std::int64_t rows, std::int64_t cols,
                                const quantize_options& options, const rotation_options& rotation,
                                const tensor_device_output& output);

// ------------------------------------------------------------------------------------------------
// Host convenience functions (host matrices in and out).

matrix rotate(const matrix& values, int axis, const rotation_options& options);

// MX formats and NVFP4 (1-D along either axis or 2-D tiles: the per-tensor amax, then a scale
// pass and an element pass on include/mxscope/core/nvfp4.hpp, as the CPU's quantizer); the rotation
// (size 0: none) is applied along options.axis first, as run_gemm does before quantizing.
quantized_tensor quantize(const matrix& input, const quantize_options& options, const rotation_options& rotation = {},
                          quantize_path path = quantize_path::automatic);

// quantize() as run_gemm needs it on the GPU: the rotation runs on the device (then the quantizer
// without one, which gives the same bits as the fused path), and the operand's energies (the sums
// of x^2 and of (x - dequantized)^2 over the rotated input's pairs where both are finite, in the
// canonical order of compare.hpp, as the CPU's operand summary) come back instead of the
// dequantized values: out.dequantized stays empty unless keep_dequantized. MX formats, NVFP4, per-tensor
// fp8 (e4m3, e5m2; the CPU's quantize_per_tensor: amax, scale = fl32(amax / max_normal), elements
// encoded from the fp64 quotient) and bf16 (the CPU's quantize_bf16), whose dequantized values also
// stay in device memory (out.device_dequantized) for the GPU's plain-operand products.
struct operand_energies {
  double signal = 0.0;
  double error = 0.0;
};
// `resident`, when given, holds the same values as `input` in device memory and is read instead of
// uploading `input` (it is not modified). The codes and block scales stay in device memory too
// (out.device_codes, out.device_scales); codes_on_device_only: the host vectors are left empty.
quantized_tensor quantize_with_energies(const matrix& input, const quantize_options& options,
                                        const rotation_options& rotation, bool keep_dequantized,
                                        operand_energies& energies, const device_matrix* resident = nullptr,
                                        bool codes_on_device_only = false);

// The transpose of a device matrix, in device memory.
device_matrix transposed(const device_matrix& values);

// Whether two device matrices have the same shape, element type and bits.
bool same_bits(const device_matrix& x, const device_matrix& y);

// The emulated product of two MX quantized tensors (as mxscope::emulate_product). Codes and scales
// in device memory (quantized_tensor::device_codes, device_scales) are read there, else uploaded. Models: exact,
// fp32-block, fp32-group:G, fp32-seq (generic path only for fp32-seq). Throws input_error otherwise.
// keep_on_device: the results stay in device memory (product_result::device_out, device_exact)
// and the host matrices empty. With gemm_path::automatic, operands that only the generic path
// covers and whose block scales are all 2^0 (per-tensor operands as unit-scaled MX ones: fp8
// e5m2 x e4m3) run fp32-block and fp32-group:G on the plain-operand kernel of
// emulate_plain_product, which computes the same definition with unit block scales.
// `kept`, when given, keeps the two prepared operands for the next call with the same device codes
// and scales, operand shapes and formats, and path: that call skips their preparation (the same
// kernels on the same codes make the same operands). A caller that multiplies the same quantized
// operands under two models (run_gemm: the strategy's model, then `exact`) passes the same one.
struct prepared_pair_cache {
  device_buffer_ptr codes[2];
  device_buffer_ptr scales[2];
  mx_operand_view views[2];
  gemm_path asked = gemm_path::automatic;      // the call's path argument
  gemm_path requested = gemm_path::automatic;  // that path resolved (before any fallback)
  gemm_path chosen = gemm_path::automatic;     // the path the operands were prepared for
  prepared_operand operands[2];
  bool filled = false;
  // An exact product of the same operands follows (run_gemm's exact_too): an fp32-block product
  // that can form both in one pass (multiply_prepared_both) leaves the exact one here for that call,
  // which takes it (fp32 and fp64 results; dropped where the pair is prepared again).
  bool exact_follows = false;
  std::shared_ptr<device_matrix> exact_out32;
  std::shared_ptr<device_matrix> exact_out;
};
product_result emulate_product(const quantized_tensor& a, const quantized_tensor& b, const accumulation_model& model,
                               output_rounding output = output_rounding::fp32, gemm_path path = gemm_path::automatic,
                               bool keep_on_device = false, prepared_pair_cache* kept = nullptr);

// The number of element codes among the first `count` bytes of `codes` (device memory, one code per
// byte: fp8 and the other 6- and 8-bit formats) that decode to inf or NaN.
std::int64_t count_nonfinite_codes(const device_buffer& codes, std::int64_t count, core::element_kind kind);

// The tensor scales of per-tensor operands applied in place to a product of their element codes as
// unit-scaled MX operands that was kept in device memory (detail::per_tensor_by_unit_scales, the
// same bits): with `exact_model` every entry of device_exact (the exact unscaled sum) times sa sb
// rounded once to fp64 (there) and to fp32 (into device_out, then the output rounding); otherwise
// device_out times fl32(sa sb), then the output rounding.
void apply_tensor_scales(const product_result& result, float sa, float sb, bool exact_model, output_rounding output);

// NVFP4 operand `q`'s block-scaled elements (each fp4 element times its ue4m3 block scale, exact in
// fp32; without the tensor scale) as [rows, depth] along its quantization axis, in device memory;
// `finite` says whether every value is finite (a NaN block scale makes its values NaN). Codes and
// scales are read where they are (device_codes, device_scales), else uploaded.
device_matrix nvfp4_block_scaled_values(const quantized_tensor& q, bool& finite);

// NVFP4 operand `q` (block 16) prepared for gemm_path::integer: each element times its ue4m3 block
// scale m 2^es (m odd) as the integer 2q m and the block exponent es - 1, carried as fp8 e4m3 (whose
// integer bound, 2^18, covers |2q m| <= 180), so that multiply_prepared's integer path computes
// fp32-block and fp32-group:G of NVFP4 x NVFP4 without the tensor scales (alpha is the caller's).
// `finite` is false where a block scale is NaN (those blocks' integers are then 0: do not use it).
prepared_operand prepare_nvfp4(const quantized_tensor& q, bool& finite);

// The exact reference of finite A [M, K] and B [N, K] (device) with every exact sum times sa sb
// (exactly) before its one rounding to fp64 and to fp32: the exact model of NVFP4 operands given
// as nvfp4_block_scaled_values, whose tensor scales are sa and sb.
reference_result scaled_reference_gemm(const device_matrix& a, const device_matrix& b, float sa, float sb,
                                       bool keep_on_device);

// The exact model of per-tensor operands from the exact unscaled sums of their binade parts' MX
// products (fp64 matrices of one shape in device memory, at most detail::max_binade_parts of them):
// per entry detail::per_tensor_exact_by_parts's rounding, the same bits (the parts' sums added by
// TwoSum; where no addition rounded, that sum times sa sb rounded once by core::round_scaled_exact,
// else every part times the scales into a long accumulator), fp32 with the output rounding and fp64.
// keep_on_device: the results stay in device memory (product_result::device_out, device_exact).
product_result combine_binade_parts(const std::vector<std::shared_ptr<const device_matrix>>& sums, float sa, float sb,
                                    output_rounding output, bool keep_on_device);

// The product of unscaled operands A [M, K] and B [N, K] (fp32 values; bf16 operands as their fp32
// values) under fp32-block, fp32-group:G or fp32-seq, cut into K-blocks of `block` with every block
// scale 1: what mxscope::emulate_product computes for fp32 and bf16 operands (generic path).
product_result emulate_plain_product(const matrix& a, const matrix& b, int block, const accumulation_model& model,
                                     output_rounding output = output_rounding::fp32, bool keep_on_device = false);
// The same on fp32 operands in device memory.
product_result emulate_plain_product(const device_matrix& a, const device_matrix& b, int block,
                                     const accumulation_model& model, output_rounding output, bool keep_on_device);

// The exact reference (reference_kind::exact) of A [M, K] and B [N, K]; stats count entries and
// non-finite entries (every entry is exact: there is no certification step on the GPU).
// keep_on_device: fp64 and fp32 stay in device memory (reference_result::device_fp64, device_fp32).
reference_result reference_gemm(const matrix& a, const matrix& b, bool keep_on_device = false);
// The same on fp32 operands in device memory.
reference_result reference_gemm(const device_matrix& a, const device_matrix& b, bool keep_on_device);

// The metrics of mxscope::compare with every sum in the canonical order, computed on the GPU.
comparison compare(const matrix& estimate, const matrix64& reference, const matrix& reference_fp32);
// The same on matrices in device memory (fp32 estimate, fp64 reference, fp32 reference).
comparison compare(const device_matrix& estimate, const device_matrix& reference, const device_matrix& reference_fp32);

// ------------------------------------------------------------------------------------------------
// The replay's cross-step state (include/mxscope/cross_step.hpp) kept in device memory: the same
// updates and norms as reference_step and unit_step, bit for bit. A step is one kernel launch, one
// thread per canonical chunk running the per-element functions of include/mxscope/core/cross_step.hpp
// in index order; the chunk partials are combined on the host by canonical_tree.
//
// The device memory (seven fp64 matrices of the output's shape per state, plus G_t in the reference
// state) is allocated and zeroed at the first step; when that allocation fails, or would leave less
// device memory free than the state's reserve, the step throws gpu_error and leaves the state
// unchanged (at step 0), so the caller can run that state on the host instead from the same step
// on. The unit step on host matrices uploads them into buffers of the reference state, allocated
// by the first such step (the overloads on device matrices need none).

// Device memory a state leaves free when it allocates, for the other GPU stages of a replay at the
// same output shape (operands, products, reference, comparison): fixed + per_element x the output's
// element count.
struct cross_step_reserve {
  std::uint64_t fixed = std::uint64_t{4} << 30;
  std::uint64_t per_element = 64;
};

// The reference side of one (layer, GEMM).
class reference_cross_step {
 public:
  explicit reference_cross_step(cross_step_reserve reserve = {});
  ~reference_cross_step();
  reference_cross_step(reference_cross_step&&) noexcept;
  reference_cross_step& operator=(reference_cross_step&&) noexcept;

  std::int64_t steps() const;
  // Step t = steps() + 1 of reference_step: uploads G_t (kept for the units of this step) and
  // updates the state. Throws input_error when G's shape differs from that of the earlier steps.
  reference_step_norms step(const matrix64& g, const optimizer_settings& settings);
  // The same with G_t in device memory (fp64; copied into the state).
  reference_step_norms step(const device_matrix& g, const optimizer_settings& settings);
  // The state as reference_step would hold it (for a unit that runs on the host).
  void download(reference_accumulators& out) const;

  struct storage;
  storage& data() const { return *storage_; }

 private:
  std::unique_ptr<storage> storage_;
};

// One (layer, GEMM, strategy) unit.
class unit_cross_step {
 public:
  explicit unit_cross_step(cross_step_reserve reserve = {});
  ~unit_cross_step();
  unit_cross_step(unit_cross_step&&) noexcept;
  unit_cross_step& operator=(unit_cross_step&&) noexcept;

  std::int64_t steps() const;
  // Step t = steps() + 1 of unit_step, with G_t the one of `reference`'s last step: `estimate` is
  // Ghat_t, `exact` X_t. Throws input_error on a shape mismatch and std::logic_error when
  // `reference` is not at step t.
  unit_step_norms step(const reference_cross_step& reference, const matrix& estimate, const matrix64& exact,
                       const optimizer_settings& settings);
  // The same with Ghat_t (fp32) and X_t (fp64) in device memory.
  unit_step_norms step(const reference_cross_step& reference, const device_matrix& estimate,
                       const device_matrix& exact, const optimizer_settings& settings);
  // The state as unit_step would hold it.
  void download(unit_accumulators& out) const;

  struct storage;
  storage& data() const { return *storage_; }

 private:
  unit_step_norms step_on_device(const reference_cross_step& reference, const float* estimate, const double* exact,
                                 const optimizer_settings& settings);
  std::unique_ptr<storage> storage_;
};

}  // namespace mxscope::gpu
