// backend.hpp in a build without a GPU backend: no GPU route applies, and the routes only a GPU can
// take are never reached (their callers ask built_with_gpu(), gpu_count() or a `prepares` question
// first), so reaching one is a logic error.
#ifndef MXSCOPE_HAVE_CUDA

#include <stdexcept>

#include "backend.hpp"

namespace mxscope::backend {

namespace {
[[noreturn]] void unreachable(const char* what) {
  throw std::logic_error(std::string("backend::") + what + ": this build has no GPU backend");
}
}  // namespace

bool built_with_gpu() { return false; }
bool is_device_error(const std::exception&) { return false; }

device_matrix_ptr upload(const matrix&) { unreachable("upload"); }
device_matrix_ptr upload(const matrix64&) { unreachable("upload"); }
device_matrix_ptr upload_beside(const matrix&) { unreachable("upload_beside"); }
std::shared_ptr<device_matrix> allocate_beside(std::int64_t, std::int64_t) { unreachable("allocate_beside"); }
void upload_beside(device_matrix&, const float*, std::int64_t, std::int64_t) { unreachable("upload_beside"); }
void prepare_uploads() { unreachable("prepare_uploads"); }
void reserve_uploads() { unreachable("reserve_uploads"); }
void download(const device_matrix&, matrix&) { unreachable("download"); }
void download(const device_matrix&, matrix64&) { unreachable("download"); }

bool prepares(const quantize_options&) { return false; }
prepared_operand prepare(const matrix&, const quantize_options&, const rotation_options&, bool, const gemm_options&) {
  unreachable("prepare");
}
struct product_cache {};
std::shared_ptr<product_cache> make_product_cache() { return nullptr; }
std::optional<product_result> product(const quantized_tensor&, const quantized_tensor&, const accumulation_model&,
                                      output_rounding, const gemm_options&, int, product_cache*) {
  return std::nullopt;
}
bool values_only_on_device(const quantized_tensor&) { return false; }
quantized_tensor with_host_values(const quantized_tensor& q) { return q; }
std::optional<std::int64_t> nonfinite_codes_on_device(const quantized_tensor&, core::element_kind) {
  return std::nullopt;
}

reference_result exact_reference(const device_matrix_ptr&, int, const device_matrix_ptr&, int, gemm_options&) {
  unreachable("exact_reference");
}

comparison compare(const device_matrix&, const device_matrix&, const device_matrix&) { unreachable("compare"); }

struct device_reference_state {};
struct device_unit_state {};
std::shared_ptr<device_reference_state> make_device_reference_state() { unreachable("make_device_reference_state"); }
std::shared_ptr<device_unit_state> make_device_unit_state() { unreachable("make_device_unit_state"); }
std::int64_t steps(const device_reference_state&) { unreachable("steps"); }
std::int64_t steps(const device_unit_state&) { unreachable("steps"); }
reference_step_norms step(device_reference_state&, const device_matrix&, const optimizer_settings&) {
  unreachable("step");
}
unit_step_norms step(device_unit_state&, const device_reference_state&, const device_matrix&, const device_matrix&,
                     const optimizer_settings&) {
  unreachable("step");
}
void download(const device_reference_state&, reference_accumulators&) { unreachable("download"); }

void start_timeline() { unreachable("start_timeline"); }
std::vector<timeline::operation> finish_timeline(std::int64_t*) { unreachable("finish_timeline"); }
timeline_label::timeline_label(std::string) {}
timeline_label::~timeline_label() = default;

bool quantizes_alone(const quantize_options&) { return false; }
quantized_tensor rotate_and_quantize(matrix&, int, const rotation_options&, const quantize_options&) {
  unreachable("rotate_and_quantize");
}
quantized_tensor quantize(const matrix&, const quantize_options&, bool) { unreachable("quantize"); }
bool native_mx_available() { return false; }
product_result emulate(const quantized_tensor&, const quantized_tensor&, const accumulation_model&, bool) {
  unreachable("emulate");
}
device_tensor_counts quantize_device_tensor(const void*, bool, std::int64_t, std::int64_t, void*,
                                            const quantize_options&, const rotation_options&,
                                            const device_tensor_output&) {
  unreachable("quantize_device_tensor");
}

}  // namespace mxscope::backend

#endif  // !MXSCOPE_HAVE_CUDA
