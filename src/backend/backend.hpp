// The one boundary between the device-free library and the GPU backend (include/mxscope/gpu.hpp,
// src/gpu): every route that runs on a GPU when this build has one. Only src/backend includes
// gpu.hpp; everything else (GEMM products, the replay, conformance, the CLI, the C API) calls the
// functions here, which in a build without a GPU backend say so: the `*_available` and `prepares`
// questions answer false, and the routes that only a GPU can take throw std::logic_error (callers
// ask first). Public device choice (parse_compute_device, select_gpu, ...) is include/mxscope/device.hpp.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <optional>

#include "mxscope/compare.hpp"
#include "mxscope/cross_step.hpp"
#include "mxscope/gemm.hpp"
#include "mxscope/quantize.hpp"
#include "mxscope/reference.hpp"
#include "mxscope/tensor.hpp"
#include "mxscope/timeline.hpp"

namespace mxscope::backend {

// Device memory of a matrix (gpu.hpp; opaque here).
using device_matrix = gpu::device_matrix;

// Whether this build has a GPU backend (CUDA or HIP); whether it also sees a usable GPU is
// gpu_count() > 0 (device.hpp).
bool built_with_gpu();

// Whether `error` came from the GPU backend (an allocation or launch that failed there).
bool is_device_error(const std::exception& error);

// ---- device memory of results left there by a GPU route (gemm_options::keep_on_device)

device_matrix_ptr upload(const matrix& values);
device_matrix_ptr upload(const matrix64& values);
// The same on a stream of the calling thread's own, beside the default stream's work (a
// background thread uploads the next step while this one computes); complete on return.
device_matrix_ptr upload_beside(const matrix& values);
// The same in parts from any threads (gpu::allocate_beside, gpu::upload_beside): the first step's
// operands copied piece by piece as they are read.
std::shared_ptr<device_matrix> allocate_beside(std::int64_t rows, std::int64_t cols);
void upload_beside(device_matrix& values, const float* host, std::int64_t first, std::int64_t count);
// Makes the current GPU's pinned upload slots (gpu::prepare_staged_uploads) ahead of the first upload.
void prepare_uploads();
// Their host memory made ahead, without the GPU (gpu::reserve_staged_upload_memory), beside the
// context's creation.
void reserve_uploads();
void download(const device_matrix& values, matrix& out);
void download(const device_matrix& values, matrix64& out);

// ---- run_gemm and emulate_product (src/gemm.cpp)

// Whether run_gemm quantizes an operand of these options on the GPU: MX, NVFP4, bf16 and per-tensor fp8.
bool prepares(const quantize_options& options);

// An operand rotated and quantized on the GPU, with its signal and error energies (the fp64 sums of
// operand_summary, in the same canonical order).
struct prepared_operand {
  quantized_tensor quantized;
  double signal_energy = 0.0;
  double error_energy = 0.0;
};
// keep_dequantized: the dequantized values are downloaded too (fp32-seq's host product reads them).
// With options.keep_on_device the codes stay in device memory; options.resident_operands supplies
// an uploaded copy of `tensor` when the caller has one.
prepared_operand prepare(const matrix& tensor, const quantize_options& quantize_with, const rotation_options& rotation,
                         bool keep_dequantized, const gemm_options& options);

// What a GPU product keeps for the next product of the same quantized operands (run_gemm's
// strategy product, then its exact_too product): the operands prepared for the MX product kernels.
// make_product_cache gives null in a build without a GPU backend.
struct product_cache;
std::shared_ptr<product_cache> make_product_cache();

// The product of a and b under `model` on the GPU when one of its routes covers these operands
// (docs/gpu.md lists them; `block` is their common K-block), else nullopt: the CPU computes it.
// `cache`, when given, is read and filled by the MX route.
std::optional<product_result> product(const quantized_tensor& a, const quantized_tensor& b,
                                      const accumulation_model& model, output_rounding output,
                                      const gemm_options& options, int block, product_cache* cache = nullptr);

// Whether an operand quantized on the GPU left its values, or its codes, only in device memory; and
// the operand with them on the host (for the CPU's product paths).
bool values_only_on_device(const quantized_tensor& q);
quantized_tensor with_host_values(const quantized_tensor& q);

// The number of non-finite element codes of `q` counted where its codes are: nullopt when they are
// on the host.
std::optional<std::int64_t> nonfinite_codes_on_device(const quantized_tensor& q, core::element_kind kind);

// The exact reference of two operands in device memory, each oriented to [rows, depth] there (axis
// 0: transposed). With options.keep_on_device the results stay there, and options.known_exact
// records them with the oriented operands: a strategy whose unscaled operands have these bits (bf16
// on a bf16 capture) shares them (reset with the step's resident operands).
reference_result exact_reference(const device_matrix_ptr& a, int a_axis, const device_matrix_ptr& b, int b_axis,
                                 gemm_options& options);

// ---- comparison of results in device memory (compare.hpp's sums, in the same canonical order)

comparison compare(const device_matrix& estimate, const device_matrix& reference, const device_matrix& reference_fp32);

// ---- the replay's cross-step state in device memory (gpu::reference_cross_step, unit_cross_step)

struct device_reference_state;
struct device_unit_state;
std::shared_ptr<device_reference_state> make_device_reference_state();
std::shared_ptr<device_unit_state> make_device_unit_state();
std::int64_t steps(const device_reference_state& state);
std::int64_t steps(const device_unit_state& state);
reference_step_norms step(device_reference_state& state, const device_matrix& g, const optimizer_settings& settings);
unit_step_norms step(device_unit_state& state, const device_reference_state& reference, const device_matrix& estimate,
                     const device_matrix& exact, const optimizer_settings& settings);
// The reference state as reference_step would hold it (for a unit that runs on the host).
void download(const device_reference_state& state, reference_accumulators& out);

// ---- the device timeline (`replay --kernel-times`; gpu.hpp, include/mxscope/timeline.hpp)

void start_timeline();
// The operations since start_timeline, kernels under their short names (timeline::short_kernel_name);
// *not_recorded: those past the timeline's capacity (gpu.hpp).
std::vector<timeline::operation> finish_timeline(std::int64_t* not_recorded);
// Labels what the calling thread queues on the GPU while it lives (the label before is restored);
// nothing in a build without a GPU backend.
class timeline_label {
 public:
  explicit timeline_label(std::string label);
  ~timeline_label();
  timeline_label(const timeline_label&) = delete;
  timeline_label& operator=(const timeline_label&) = delete;

 private:
  std::string previous_;
};

// ---- quantization on the GPU (`mxscope quantize --device gpu`, the GPU self-test)

// Whether the GPU quantizes this scheme alone (`mxscope quantize`): MX and NVFP4.
bool quantizes_alone(const quantize_options& options);
// Rotates `values` in place along `axis` and quantizes them.
quantized_tensor rotate_and_quantize(matrix& values, int axis, const rotation_options& rotation,
                                     const quantize_options& options);
// gpu::quantize with its automatic kernel choice, or the gfx950 hardware conversions (`native`,
// where native_mx_available()).
quantized_tensor quantize(const matrix& input, const quantize_options& options, bool native = false);
bool native_mx_available();
// gpu::emulate_product with fp32 output: its automatic kernel choice, or the gfx950 scaled MFMA.
product_result emulate(const quantized_tensor& a, const quantized_tensor& b, const accumulation_model& model,
                       bool native_mfma = false);

// ---- the C API's quantizer on caller-owned device memory (mxs_quantize with MXS_CUDA)

struct device_tensor_output {
  std::uint8_t* codes = nullptr;
  std::uint8_t* scales = nullptr;
  float* dequantized = nullptr;
  std::uint16_t* operand_bf16 = nullptr;
  unsigned long long* counters = nullptr;  // the caller's [4] counters (added to), or null
};
struct device_tensor_counts {
  float tensor_scale = 1.0f;
  // -1 when output.counters was given (the caller reads them there).
  std::int64_t nonzero = -1, flushed = -1, saturated = -1, nonfinite = -1;
};
// Rotates and quantizes input [rows, cols] (fp32 or bf16, device memory) on `stream`.
device_tensor_counts quantize_device_tensor(const void* input, bool bf16_input, std::int64_t rows, std::int64_t cols,
                                            void* stream, const quantize_options& options,
                                            const rotation_options& rotation, const device_tensor_output& output);

}  // namespace mxscope::backend
