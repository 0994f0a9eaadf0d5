// The GPU backend's device memory, comparison, cross-step state and quantizer entry points
// (backend.hpp). Compiled in builds with a GPU backend (no_gpu.cpp otherwise).
#ifdef MXSCOPE_HAVE_CUDA

#include "backend.hpp"
#include "mxscope/gpu.hpp"

namespace mxscope::backend {

bool built_with_gpu() { return true; }

bool is_device_error(const std::exception& error) { return dynamic_cast<const gpu::gpu_error*>(&error) != nullptr; }

device_matrix_ptr upload(const matrix& values) {
  return std::make_shared<const gpu::device_matrix>(gpu::device_matrix::upload(values));
}
device_matrix_ptr upload(const matrix64& values) {
  return std::make_shared<const gpu::device_matrix>(gpu::device_matrix::upload(values));
}
device_matrix_ptr upload_beside(const matrix& values) {
  return std::make_shared<const gpu::device_matrix>(gpu::upload_beside(values));
}
std::shared_ptr<device_matrix> allocate_beside(std::int64_t rows, std::int64_t cols) {
  return std::make_shared<gpu::device_matrix>(gpu::allocate_beside(rows, cols));
}
void upload_beside(device_matrix& values, const float* host, std::int64_t first, std::int64_t count) {
  gpu::upload_beside(values, host, first, count);
}
void prepare_uploads() { gpu::prepare_staged_uploads(); }
void reserve_uploads() { gpu::reserve_staged_upload_memory(); }
void download(const device_matrix& values, matrix& out) { out = values.download32(); }
void download(const device_matrix& values, matrix64& out) { out = values.download64(); }

void start_timeline() { gpu::start_timeline(); }
std::vector<timeline::operation> finish_timeline(std::int64_t* not_recorded) {
  std::vector<timeline::operation> operations = gpu::finish_timeline(not_recorded);
  for (timeline::operation& operation : operations) operation.name = timeline::short_kernel_name(operation.name);
  return operations;
}
timeline_label::timeline_label(std::string label) : previous_(gpu::set_timeline_label(std::move(label))) {}
timeline_label::~timeline_label() { gpu::set_timeline_label(std::move(previous_)); }

comparison compare(const device_matrix& estimate, const device_matrix& reference, const device_matrix& reference_fp32) {
  return gpu::compare(estimate, reference, reference_fp32);
}

reference_result exact_reference(const device_matrix_ptr& a, int a_axis, const device_matrix_ptr& b, int b_axis,
                                 gemm_options& options) {
  const auto oriented = [](const device_matrix_ptr& values, int axis) -> device_matrix_ptr {
    if (axis == 1) return values;
    return std::make_shared<const gpu::device_matrix>(gpu::transposed(*values));
  };
  const device_matrix_ptr left = oriented(a, a_axis);
  const device_matrix_ptr right = oriented(b, b_axis);
  reference_result result = gpu::reference_gemm(*left, *right, options.keep_on_device);
  if (options.keep_on_device) {
    options.known_exact = gemm_options::known_exact_product{left, right, result.device_fp64, result.device_fp32};
  }
  return result;
}

struct device_reference_state {
  gpu::reference_cross_step state;
};
struct device_unit_state {
  gpu::unit_cross_step state;
};

std::shared_ptr<device_reference_state> make_device_reference_state() {
  return std::make_shared<device_reference_state>();
}
std::shared_ptr<device_unit_state> make_device_unit_state() { return std::make_shared<device_unit_state>(); }
std::int64_t steps(const device_reference_state& state) { return state.state.steps(); }
std::int64_t steps(const device_unit_state& state) { return state.state.steps(); }

reference_step_norms step(device_reference_state& state, const device_matrix& g, const optimizer_settings& settings) {
  return state.state.step(g, settings);
}

unit_step_norms step(device_unit_state& state, const device_reference_state& reference, const device_matrix& estimate,
                     const device_matrix& exact, const optimizer_settings& settings) {
  return state.state.step(reference.state, estimate, exact, settings);
}

void download(const device_reference_state& state, reference_accumulators& out) { state.state.download(out); }

bool quantizes_alone(const quantize_options& options) {
  return options.format.scheme == quant_scheme::mx || options.format.scheme == quant_scheme::nvfp4;
}

quantized_tensor rotate_and_quantize(matrix& values, int axis, const rotation_options& rotation,
                                     const quantize_options& options) {
  values = gpu::rotate(values, axis, rotation);
  return gpu::quantize(values, options);
}

quantized_tensor quantize(const matrix& input, const quantize_options& options, bool native) {
  if (!native) return gpu::quantize(input, options);
  return gpu::quantize(input, options, {}, gpu::quantize_path::native);
}

bool native_mx_available() { return gpu::native_mx_available(); }

product_result emulate(const quantized_tensor& a, const quantized_tensor& b, const accumulation_model& model,
                       bool native_mfma) {
  if (!native_mfma) return gpu::emulate_product(a, b, model);
  return gpu::emulate_product(a, b, model, output_rounding::fp32, gpu::gemm_path::native_mfma);
}

device_tensor_counts quantize_device_tensor(const void* input, bool bf16_input, std::int64_t rows, std::int64_t cols,
                                            void* stream, const quantize_options& options,
                                            const rotation_options& rotation, const device_tensor_output& output) {
  const gpu::stream_scope scope(stream);
  gpu::tensor_device_output on_device;
  on_device.codes = output.codes;
  on_device.scales = output.scales;
  on_device.dequantized = output.dequantized;
  on_device.operand_bf16 = output.operand_bf16;
  gpu::device_buffer counters;
  if (output.counters != nullptr) {
    on_device.counters = output.counters;
  } else {
    counters = gpu::device_buffer(gpu::mx_counter_count * sizeof(unsigned long long));
    counters.fill_bytes(0);
    on_device.counters = counters.as<unsigned long long>();
  }
  const gpu::input_format format = bf16_input ? gpu::input_format::bf16 : gpu::input_format::fp32;
  device_tensor_counts counts;
  counts.tensor_scale = gpu::quantize_tensor_on_device(input, format, rows, cols, options, rotation, on_device);
  if (output.counters == nullptr) {
    unsigned long long values[gpu::mx_counter_count] = {};
    counters.download(values, sizeof(values));
    counts.nonzero = static_cast<std::int64_t>(values[gpu::counter_nonzero]);
    counts.flushed = static_cast<std::int64_t>(values[gpu::counter_flushed]);
    counts.saturated = static_cast<std::int64_t>(values[gpu::counter_saturated]);
    counts.nonfinite = static_cast<std::int64_t>(values[gpu::counter_nonfinite]);
  }
  return counts;
}

}  // namespace mxscope::backend

#endif  // MXSCOPE_HAVE_CUDA
