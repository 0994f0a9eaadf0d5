// libmxscope_c (include/mxscope/c_api.h): the library's quantizer, emulated GEMM and reference
// behind a C ABI. Options go through the CLI's own resolution (resolve_strategy), so a call gives
// the bits `mxscope quantize` / `mxscope gemm` give for the same flags.
#include "mxscope/c_api.h"

#include <fmt/format.h>

#include <cstring>
#include <exception>
#include <string>

#include "../cli/commands.hpp"
#include "mxscope/compare.hpp"
#include "mxscope/core/operand.hpp"
#include "mxscope/device.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/gemm.hpp"
#include "mxscope/quantize.hpp"
#include "mxscope/reference.hpp"
#include "../backend/backend.hpp"

#define MXS_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using namespace mxscope;

thread_local std::string last_error_text;

// A wrong dtype or device (Python: TypeError); input_error is a wrong value (ValueError).
class type_failure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <class Body>
int guarded(Body&& body) {
  try {
    body();
    return MXS_OK;
  } catch (const type_failure& error) {
    last_error_text = error.what();
    return MXS_TYPE_ERROR;
  } catch (const input_error& error) {
    last_error_text = error.what();
    return MXS_VALUE_ERROR;
  } catch (const std::exception& error) {
    last_error_text = error.what();
    return MXS_RUNTIME_ERROR;
  } catch (...) {
    last_error_text = "unknown error";
    return MXS_RUNTIME_ERROR;
  }
}

std::string text(const char* value, const char* fallback) {
  return value != nullptr && value[0] != '\0' ? std::string(value) : std::string(fallback);
}

void require(bool condition, const char* field) {
  if (!condition) throw input_error(fmt::format("field '{}': a required pointer is null", field));
}

cli::strategy_flags flags_of(const mxs_quantize_options& o) {
  cli::strategy_flags flags;
  flags.format = text(o.format, "");
  flags.block = o.block;
  flags.block_given = o.block != 0;
  flags.rounding = text(o.rounding, "rne");
  flags.scale_rule = text(o.scale_rule, "floor");
  flags.rotation = o.rotation == 0 ? std::string("none") : fmt::format("hadamard:{}", o.rotation);
  flags.signs = text(o.signs, "none");
  flags.seed = o.seed;
  flags.step = o.step;
  flags.sr_bits = o.sr_bits == 0 ? 32 : o.sr_bits;
  flags.layer = text(o.layer, "");
  flags.seed_policy = text(o.seed_policy, "per-step");
  return flags;
}

// The resolved quantizer of one call: options, rotation and the descriptive name used in errors.
struct resolved_quantizer {
  cli::strategy chosen;
  std::string what;
};

resolved_quantizer resolve(const mxs_quantize_options* options, std::int64_t rows, std::int64_t cols) {
  require(options != nullptr, "options");
  if (rows < 0 || cols < 0) throw input_error(fmt::format("field 'shape': [{}, {}] is negative", rows, cols));
  if (options->axis != 0 && options->axis != 1) {
    throw input_error(fmt::format("field 'axis': must be 0 or 1 of a [rows, cols] tensor, got {}", options->axis));
  }
  resolved_quantizer out{cli::resolve_strategy(flags_of(*options)), fmt::format("tensor [{}, {}]", rows, cols)};
  const std::string role = text(options->role, "");
  if (!role.empty() && role != "x" && role != "dy" && role != "w") {
    throw input_error(fmt::format("field 'role': must be x, dy, w or empty, got '{}'", role));
  }
  out.chosen.quantize.axis = options->axis;
  out.chosen.quantize.stream = out.chosen.stream_for(cli::role_for_tensor(role));
  cli::check_rotation_fits(out.chosen, options->axis, rows, cols, out.what);
  validate(out.chosen.quantize, rows, cols, out.what);
  return out;
}

// The storage sizes of quantized_tensor for these options.
mxs_layout storage_layout(const quantize_options& options, std::int64_t rows, std::int64_t cols) {
  mxs_layout layout{};
  quantized_tensor shape;
  shape.rows = rows;
  shape.cols = cols;
  shape.options = options;
  const quant_scheme scheme = options.format.scheme;
  const bool blocked = scheme == quant_scheme::mx || scheme == quant_scheme::nvfp4;
  shape.block = blocked ? (options.block != 0 ? options.block : options.format.default_block) : 0;
  layout.code_rows = rows;
  layout.code_cols = shape.code_row_bytes();
  layout.block = shape.block;
  layout.scale_kind = blocked ? MXS_BLOCK_SCALES : MXS_TENSOR_SCALE;
  if (blocked) {
    const std::int64_t b = shape.block;
    layout.scale_rows = options.axis == 1 ? rows : (rows + b - 1) / b;
    layout.scale_cols = options.axis == 1 ? (cols + b - 1) / b : cols;
  }
  return layout;
}

matrix widened(const void* input, int dtype, std::int64_t rows, std::int64_t cols) {
  matrix values(rows, cols);
  const std::size_t count = static_cast<std::size_t>(rows * cols);
  if (dtype == MXS_F32) {
    if (count > 0) std::memcpy(values.data(), input, count * sizeof(float));
  } else {
    const auto* halves = static_cast<const std::uint16_t*>(input);
    for (std::size_t i = 0; i < count; ++i) {
      values.values[i] = dtype == MXS_BF16 ? core::bf16_to_float(halves[i]) : core::half_to_float(halves[i]);
    }
  }
  return values;
}

// The bf16 GEMM operands of a host quantized tensor (core::operand_bf16 per element).
void operand_bf16_of(const quantized_tensor& q, std::uint16_t* out) {
  const quant_scheme scheme = q.options.format.scheme;
  if (scheme == quant_scheme::bf16) {
    std::memcpy(out, q.codes.data(), static_cast<std::size_t>(q.rows * q.cols) * sizeof(std::uint16_t));
    return;
  }
  const core::element_kind kind = q.options.format.element;
  const bool four_bit = core::spec(kind).bits == 4;
  const core::operand_scaling scaling = scheme == quant_scheme::mx      ? core::operand_scaling::mx
                                        : scheme == quant_scheme::nvfp4 ? core::operand_scaling::nvfp4
                                                                        : core::operand_scaling::none;
  const std::int64_t row_bytes = q.code_row_bytes();
  const bool tiles_2d = scheme == quant_scheme::nvfp4 && q.options.nvfp4_2d;
  const std::int64_t block_rows = tiles_2d ? 16 : (q.options.axis == 0 ? q.block : 1);
  const std::int64_t block_cols = tiles_2d ? 16 : (q.options.axis == 1 ? q.block : 1);
  for (std::int64_t r = 0; r < q.rows; ++r) {
    for (std::int64_t c = 0; c < q.cols; ++c) {
      const std::uint8_t byte = q.codes[static_cast<std::size_t>(r * row_bytes + (four_bit ? c / 2 : c))];
      const std::uint32_t code = four_bit ? (byte >> (4 * (c & 1))) & 0x0FU : byte;
      const std::uint8_t scale =
          scaling == core::operand_scaling::none
              ? 0
              : q.scales[static_cast<std::size_t>((r / block_rows) * q.scale_cols + c / block_cols)];
      out[r * q.cols + c] = core::operand_bf16(kind, scaling, code, scale);
    }
  }
}

void quantize_on_host(const void* input, int dtype, std::int64_t rows, std::int64_t cols,
                      const resolved_quantizer& quantizer, mxs_quantize_result& result) {
  matrix values = widened(input, dtype, rows, cols);
  rotate(values, quantizer.chosen.quantize.axis, quantizer.chosen.rotation, quantizer.what);
  const quantized_tensor q = quantize(values, quantizer.chosen.quantize);
  std::memcpy(result.codes, q.codes.data(), q.codes.size());
  if (result.scales != nullptr && !q.scales.empty()) std::memcpy(result.scales, q.scales.data(), q.scales.size());
  if (result.dequantized != nullptr && q.dequantized.size() > 0) {
    std::memcpy(result.dequantized, q.dequantized.data(), static_cast<std::size_t>(q.dequantized.size()) * sizeof(float));
  }
  if (result.operand_bf16 != nullptr) operand_bf16_of(q, result.operand_bf16);
  result.tensor_scale = q.tensor_scale;
  result.nonzero = q.nonzero_inputs;
  result.flushed = q.flushed;
  result.saturated = q.saturated;
  result.nonfinite = q.nonfinite_inputs;
}

void quantize_on_gpu(const void* input, int dtype, std::int64_t rows, std::int64_t cols, void* stream,
                     const resolved_quantizer& quantizer, mxs_quantize_result& result) {
  if (dtype == MXS_F16) throw type_failure("input: CUDA tensors must be float32 or bfloat16 (float16: convert first)");
  if (gpu_count() == 0) throw type_failure("device: no usable CUDA device (no device or no driver)");
  backend::device_tensor_output output;
  output.codes = result.codes;
  output.scales = result.scales;
  output.dequantized = result.dequantized;
  output.operand_bf16 = result.operand_bf16;
  output.counters = reinterpret_cast<unsigned long long*>(result.device_counters);
  const backend::device_tensor_counts counts =
      backend::quantize_device_tensor(input, dtype == MXS_BF16, rows, cols, stream, quantizer.chosen.quantize,
                                      quantizer.chosen.rotation, output);
  result.tensor_scale = counts.tensor_scale;
  result.nonzero = counts.nonzero;
  result.flushed = counts.flushed;
  result.saturated = counts.saturated;
  result.nonfinite = counts.nonfinite;
}

compute_device device_of(int device) {
  if (device == MXS_CPU) return compute_device::cpu;
  if (device != MXS_CUDA) throw type_failure(fmt::format("device: must be MXS_CPU (0) or MXS_CUDA (1), got {}", device));
  if (!backend::built_with_gpu()) throw type_failure("device: this libmxscope_c was built without the CUDA backend");
  if (gpu_count() == 0) throw type_failure("device: no usable CUDA device (no device or no driver)");
  return compute_device::gpu;
}

void copy_metrics(const comparison& c, const gemm_result& result, mxs_gemm_metrics& m) {
  m.rel_err = c.rel_err;
  m.cosine = c.cosine;
  m.bias = c.bias;
  m.orth_err = c.orth_err;
  m.max_abs_err = c.max_abs_err;
  m.ulp_mean = c.ulp.mean;
  m.ulp_max = static_cast<std::int64_t>(c.ulp.max);
  m.nonfinite_out = c.nonfinite_estimate;
  const operand_summary* operands[2] = {&result.a, &result.b};
  for (int i = 0; i < 2; ++i) {
    m.elements[i] = operands[i]->elements;
    m.nonzero[i] = operands[i]->nonzero_inputs;
    m.flushed[i] = operands[i]->flushed;
    m.saturated[i] = operands[i]->saturated;
    m.nonfinite[i] = operands[i]->nonfinite_inputs;
    m.signal_energy[i] = operands[i]->signal_energy;
    m.error_energy[i] = operands[i]->error_energy;
  }
}

matrix host_matrix(const float* values, std::int64_t rows, std::int64_t cols, const char* field) {
  require(values != nullptr, field);
  if (rows < 0 || cols < 0) throw input_error(fmt::format("field '{}': shape [{}, {}] is negative", field, rows, cols));
  return widened(values, MXS_F32, rows, cols);
}

}  // namespace

MXS_EXPORT const char* mxs_version(void) {
  static const std::string version = cli::version_text();
  return version.c_str();
}

MXS_EXPORT const char* mxs_last_error(void) { return last_error_text.c_str(); }

MXS_EXPORT int mxs_cuda_device_count(void) { return gpu_count(); }

MXS_EXPORT int mxs_cuda_select(int index) {
  return guarded([&] {
    if (index < 0 || index >= gpu_count()) throw type_failure(fmt::format("device: no CUDA device {}", index));
    select_gpu(compute_device::gpu, index);
  });
}

MXS_EXPORT int mxs_quantize_layout(const mxs_quantize_options* options, int64_t rows, int64_t cols,
                                   mxs_layout* out) {
  return guarded([&] {
    require(out != nullptr, "layout");
    const resolved_quantizer quantizer = resolve(options, rows, cols);
    *out = storage_layout(quantizer.chosen.quantize, rows, cols);
  });
}

MXS_EXPORT int mxs_quantize(const void* input, int dtype, int64_t rows, int64_t cols, int device, void* stream,
                            const mxs_quantize_options* options, mxs_quantize_result* result) {
  return guarded([&] {
    require(result != nullptr, "result");
    if (dtype != MXS_F32 && dtype != MXS_BF16 && dtype != MXS_F16) {
      throw type_failure(fmt::format("input: dtype must be float32, bfloat16 or float16 (code {})", dtype));
    }
    const resolved_quantizer quantizer = resolve(options, rows, cols);
    const mxs_layout layout = storage_layout(quantizer.chosen.quantize, rows, cols);
    require(rows * cols == 0 || input != nullptr, "input");
    require(result->codes != nullptr || layout.code_rows * layout.code_cols == 0, "codes");
    if (layout.scale_kind == MXS_BLOCK_SCALES) {
      require(result->scales != nullptr || layout.scale_rows * layout.scale_cols == 0, "scales");
    }
    const compute_device where = device_of(device);
    if (where == compute_device::cpu) {
      quantize_on_host(input, dtype, rows, cols, quantizer, *result);
      return;
    }
    quantize_on_gpu(input, dtype, rows, cols, stream, quantizer, *result);
  });
}

MXS_EXPORT int mxs_gemm(const mxs_gemm_request* request, const float* a, int64_t a_rows, int64_t a_cols,
                        const float* b, int64_t b_rows, int64_t b_cols, float* out, double* reference,
                        mxs_gemm_metrics* metrics) {
  return guarded([&] {
    require(request != nullptr, "request");
    require(out != nullptr, "out");
    const std::string kind_text = text(request->kind, "");
    const auto kind = parse_gemm_kind(kind_text);
    if (!kind) throw input_error(fmt::format("field 'kind': unknown GEMM '{}' (expected fprop, dgrad or wgrad)", kind_text));
    const accumulation_model model = parse_accumulation_model(text(request->accumulation, ""), "accumulation");
    const std::string output_text = text(request->output, "fp32");
    const auto output = parse_output_rounding(output_text);
    if (!output) throw input_error(fmt::format("field 'output': unknown output rounding '{}' (fp32 or bf16)", output_text));
    const std::string reference_text = text(request->reference, "exact");
    const auto reference_kind = parse_reference_kind(reference_text);
    if (!reference_kind) throw input_error(fmt::format("field 'reference': unknown reference '{}' (exact or fp64)", reference_text));
    const compute_device device = device_of(request->device);

    const mxscope::strategy chosen =
        cli::resolve_gemm_strategy(flags_of(request->strategy), text(request->format_a, ""),
                                   text(request->format_b, ""), model, *output, "format_a", "format_b");
    const matrix left = host_matrix(a, a_rows, a_cols, "a");
    const matrix right = host_matrix(b, b_rows, b_cols, "b");
    const gemm_layout layout = layout_of(*kind);
    gemm_operands operands;
    const auto place = [&](std::string_view name, const matrix* values) {
      if (name == "x") operands.x = values;
      if (name == "dy") operands.dy = values;
      if (name == "w") operands.w = values;
    };
    place(layout.a_name, &left);
    place(layout.b_name, &right);
    gemm_options compute;
    compute.device = device;
    const gemm_context context{text(request->strategy.layer, ""), request->strategy.step};
    const gemm_result result = run_gemm(*kind, operands, chosen, context, compute);
    const canonical_pair canonical = canonical_operands(*kind, left, right);
    const reference_result exact = reference_on(device, canonical.a, canonical.b, *reference_kind);
    std::memcpy(out, result.out.data(), static_cast<std::size_t>(result.out.size()) * sizeof(float));
    if (reference != nullptr) {
      std::memcpy(reference, exact.fp64.data(), static_cast<std::size_t>(exact.fp64.size()) * sizeof(double));
    }
    if (metrics != nullptr) copy_metrics(compare_on(device, result.out, exact.fp64, exact.fp32), result, *metrics);
  });
}

MXS_EXPORT int mxs_reference(const char* kind, int device, const float* a, const float* b, int64_t m, int64_t n,
                             int64_t k, double* out64, float* out32) {
  return guarded([&] {
    const std::string kind_text = text(kind, "exact");
    const auto reference_kind = parse_reference_kind(kind_text);
    if (!reference_kind) throw input_error(fmt::format("field 'kind': unknown reference '{}' (exact or fp64)", kind_text));
    const compute_device where = device_of(device);
    const reference_result result =
        reference_on(where, host_matrix(a, m, k, "a"), host_matrix(b, n, k, "b"), *reference_kind);
    if (out64 != nullptr) std::memcpy(out64, result.fp64.data(), static_cast<std::size_t>(m * n) * sizeof(double));
    if (out32 != nullptr) std::memcpy(out32, result.fp32.data(), static_cast<std::size_t>(m * n) * sizeof(float));
  });
}
