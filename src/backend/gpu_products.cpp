// The GPU's routes for emulate_product and run_gemm (backend.hpp): which operands and models the GPU
// multiplies, and how. Compiled in builds with a GPU backend (no_gpu.cpp otherwise).
#ifdef MXSCOPE_HAVE_CUDA

#include <cmath>
#include <optional>
#include <vector>

#include "../gemm_internal.hpp"
#include "backend.hpp"
#include "mxscope/core/mx.hpp"
#include "mxscope/gpu.hpp"

namespace mxscope::backend {

struct product_cache {
  gpu::prepared_pair_cache prepared;
  // Per-tensor operands as unit-scaled MX ones (unit_scaled_on_device), each with the device codes
  // and block it was made from: the second product of the same operands finds the same buffers, so
  // `prepared` holds for it too.
  struct unit_scaled_operand {
    device_buffer_ptr codes;
    int block = 0;
    std::optional<quantized_tensor> operand;
  };
  unit_scaled_operand unit_scaled[2];
};

namespace {

namespace core_ns = mxscope::core;
using gemm_internal::round_output;

// MX x MX under the models the GPU's product kernels implement.
bool mx_multiplies(const quantized_tensor& a, const quantized_tensor& b, const accumulation_model& model) {
  const bool models = model.kind == accumulation_kind::exact || model.kind == accumulation_kind::fp32_block ||
                      model.kind == accumulation_kind::fp32_group || model.kind == accumulation_kind::fp32_seq;
  return models && a.options.format.scheme == quant_scheme::mx && b.options.format.scheme == quant_scheme::mx;
}

// The exact model of two unscaled operands (fp32 or bf16, finite) with fp32 output: the GPU's exact
// reference kernel computes it.
bool reference_multiplies(const quantized_tensor& a, const quantized_tensor& b, const accumulation_model& model,
                          output_rounding output) {
  const auto plain = [](const quantized_tensor& q) {
    const quant_scheme scheme = q.options.format.scheme;
    if (scheme != quant_scheme::none && scheme != quant_scheme::bf16) return false;
    if (q.tensor_scale != 1.0f) return false;
    // bf16 values left on the GPU: non-finite exactly where the input was or the rounding overflowed.
    if (q.device_dequantized) return q.nonfinite_inputs == 0 && q.saturated == 0;
    const float* values = q.dequantized.data();
    const std::int64_t count = q.dequantized.size();
    std::int64_t nonfinite = 0;
#ifdef _OPENMP
#pragma omp parallel for reduction(+ : nonfinite) schedule(static) if (count >= (std::int64_t{1} << 20))
#endif
    for (std::int64_t i = 0; i < count; ++i) nonfinite += !std::isfinite(values[i]);
    return nonfinite == 0;
  };
  return model.kind == accumulation_kind::exact && output == output_rounding::fp32 && plain(a) && plain(b);
}

// fp32-block, fp32-group:G and fp32-seq of two unscaled operands (fp32 or bf16, finite) with fp32
// output: the GPU's generic kernel computes them with unit block scales.
bool plain_multiplies(const quantized_tensor& a, const quantized_tensor& b, const accumulation_model& model,
                      output_rounding output) {
  const bool models = model.kind == accumulation_kind::fp32_block || model.kind == accumulation_kind::fp32_group ||
                      model.kind == accumulation_kind::fp32_seq;
  accumulation_model exact_model;
  exact_model.kind = accumulation_kind::exact;
  return models && reference_multiplies(a, b, exact_model, output);
}

// An unscaled operand's values as [rows, depth] in device memory: its GPU copy (transposed there when
// it is blocked along axis 0), or its host values uploaded (then transposed there).
device_matrix_ptr canonical_on_device(const quantized_tensor& q) {
  device_matrix_ptr values = q.device_dequantized;
  if (!values) values = std::make_shared<const gpu::device_matrix>(gpu::device_matrix::upload(q.dequantized));
  if (q.options.axis == 1) return values;
  return std::make_shared<const gpu::device_matrix>(gpu::transposed(*values));
}

// detail::unit_scaled_mx with the codes in device memory (those of `q` when it has them there) and
// its unit block scales made there.
quantized_tensor unit_scaled_on_device(const quantized_tensor& q, int block) {
  quantized_tensor shape;  // what unit_scaled_mx reads besides the codes: the options and the shape
  shape.options = q.options;
  shape.rows = q.rows;
  shape.cols = q.cols;
  quantized_tensor out = detail::unit_scaled_mx(shape, block);
  out.scales.clear();
  auto scales = std::make_shared<gpu::device_buffer>(static_cast<std::size_t>(out.scale_rows * out.scale_cols));
  scales->fill_bytes(core_ns::scale_code(0));  // 2^0
  out.device_scales = std::move(scales);
  if (q.device_codes) {
    out.device_codes = q.device_codes;
  } else {
    auto codes = std::make_shared<gpu::device_buffer>(q.codes.size());
    codes->upload(q.codes.data(), q.codes.size());
    out.device_codes = std::move(codes);
  }
  return out;
}

// unit_scaled_on_device(q, block), kept in `kept` (when given) for the next call with the same
// device codes and block.
const quantized_tensor& unit_scaled_kept(const quantized_tensor& q, int block,
                                         product_cache::unit_scaled_operand* kept, std::optional<quantized_tensor>& local) {
  if (kept == nullptr || !q.device_codes) return local.emplace(unit_scaled_on_device(q, block));
  if (!kept->operand || kept->codes != q.device_codes || kept->block != block) {
    kept->operand = unit_scaled_on_device(q, block);
    kept->codes = q.device_codes;
    kept->block = block;
  }
  return *kept->operand;
}

product_result from_reference(reference_result reference) {
  product_result on_gpu;
  on_gpu.out = std::move(reference.fp32);
  on_gpu.exact = std::move(reference.fp64);
  on_gpu.device_out = std::move(reference.device_fp32);
  on_gpu.device_exact = std::move(reference.device_fp64);
  return on_gpu;
}

// NVFP4 x NVFP4 with finite block scales: each element times its block scale is an integer of at
// most 8 bits times the block's power of two, so fp32-block and fp32-group:G are the integer
// path's products of those operands (gpu::prepare_nvfp4) times alpha = fl32(sa sb)
// (gpu::apply_tensor_scales, as generic_product's epilogue); and those block-scaled values are
// exact fp32 numbers, so `exact` is their exact reference with every exact sum times sa sb before
// the one rounding (gpu::scaled_reference_gemm, as add_scaled_exactly in src/gemm.cpp).
std::optional<product_result> nvfp4_product(const quantized_tensor& a, const quantized_tensor& b,
                                            const accumulation_model& model, output_rounding output,
                                            const gemm_options& options) {
  bool finite_a = false, finite_b = false;
  if (model.kind == accumulation_kind::exact) {
    const gpu::device_matrix left = gpu::nvfp4_block_scaled_values(a, finite_a);
    const gpu::device_matrix right = gpu::nvfp4_block_scaled_values(b, finite_b);
    if (!finite_a || !finite_b) return std::nullopt;
    product_result on_gpu = from_reference(
        gpu::scaled_reference_gemm(left, right, a.tensor_scale, b.tensor_scale, options.keep_on_device));
    // bf16 output: the fp32 result rounded once more, as for the CPU's products (on the device,
    // times alpha = 1: finite operands give no NaN, and x 1 is exact).
    if (output == output_rounding::bf16) {
      if (on_gpu.device_out) {
        gpu::apply_tensor_scales(on_gpu, 1.0f, 1.0f, false, output);
      } else {
        for (float& value : on_gpu.out.values) value = round_output(value, output);
      }
    }
    return on_gpu;
  }
  const gpu::prepared_operand left = gpu::prepare_nvfp4(a, finite_a);
  const gpu::prepared_operand right = gpu::prepare_nvfp4(b, finite_b);
  if (!finite_a || !finite_b) return std::nullopt;
  product_result on_gpu;
  on_gpu.device_out = std::make_shared<gpu::device_matrix>(left.rows(), right.rows(), gpu::device_matrix::element::fp32);
  gpu::multiply_prepared(left, right, model, output_rounding::fp32, on_gpu.device_out->fp32(), nullptr,
                         gpu::gemm_path::integer);
  gpu::apply_tensor_scales(on_gpu, a.tensor_scale, b.tensor_scale, false, output);
  if (!options.keep_on_device) {
    on_gpu.out = on_gpu.device_out->download32();
    on_gpu.device_out.reset();
  }
  return on_gpu;
}

// Per-tensor exact beyond fp64 (an e5m2 operand): detail::per_tensor_exact_by_parts on the GPU, the
// MX exact products of the binade parts kept there and their scaled rounding there too
// (gpu::combine_binade_parts). The parts' codes are mapped on the host.
product_result per_tensor_parts_product(const quantized_tensor& a, const quantized_tensor& b,
                                        const accumulation_model& model, output_rounding output,
                                        const gemm_options& options, int block,
                                        const detail::per_tensor_parts_route& route) {
  const quantized_tensor& split = route.split_a ? a : b;
  const quantized_tensor split_host = values_only_on_device(split) ? with_host_values(split) : split;
  const quantized_tensor whole = unit_scaled_on_device(route.split_a ? b : a, block);
  std::vector<device_matrix_ptr> sums;
  for (const detail::binade_part& part : route.parts) {
    const quantized_tensor piece = detail::binade_part_operand(split_host, block, part);
    product_result partial = gpu::emulate_product(route.split_a ? piece : whole, route.split_a ? whole : piece, model,
                                                  output_rounding::fp32, gpu::gemm_path::automatic, true);
    sums.push_back(std::move(partial.device_exact));
  }
  return gpu::combine_binade_parts(sums, a.tensor_scale, b.tensor_scale, output, options.keep_on_device);
}

// Unscaled operands (fp32, bf16): the exact model is the exact sum of the dequantized values'
// products rounded once, which is what the reference kernel computes (tests/test_gemm.cpp,
// ExactModelOfPlainOperandsIsTheExactReference).
product_result plain_exact_product(const quantized_tensor& a, const quantized_tensor& b, const gemm_options& options) {
  const device_matrix_ptr left = canonical_on_device(a);
  const device_matrix_ptr right = canonical_on_device(b);
  const auto& known = options.known_exact;
  if (options.keep_on_device && known && known->a && known->b && known->fp64 && known->fp32 &&
      gpu::same_bits(*left, *known->a) && gpu::same_bits(*right, *known->b)) {
    // The same operands, bit for bit, as a product already computed by the same kernel.
    product_result on_gpu;
    on_gpu.device_out = known->fp32;
    on_gpu.device_exact = known->fp64;
    return on_gpu;
  }
  return from_reference(gpu::reference_gemm(*left, *right, options.keep_on_device));
}

// The routes in order; nullopt where none covers these operands.
std::optional<product_result> first_route(const quantized_tensor& a, const quantized_tensor& b,
                                          const accumulation_model& model, output_rounding output,
                                          const gemm_options& options, int block, product_cache* cache) {
  if (mx_multiplies(a, b, model)) {
    return gpu::emulate_product(a, b, model, output, gpu::gemm_path::automatic, options.keep_on_device,
                                cache != nullptr ? &cache->prepared : nullptr);
  }
  if (a.options.format.scheme == quant_scheme::nvfp4 && b.options.format.scheme == quant_scheme::nvfp4 &&
      (model.kind == accumulation_kind::fp32_block || model.kind == accumulation_kind::fp32_group ||
       model.kind == accumulation_kind::exact)) {
    if (auto on_gpu = nvfp4_product(a, b, model, output, options)) return on_gpu;
  }
  // Per-tensor fp8 (finite elements): the GPU multiplies the elements as MX operands with every
  // block scale 2^0 and applies the tensor scales to the product left there (keep_on_device), or
  // the host applies them (detail::per_tensor_by_unit_scales).
  if (detail::per_tensor_by_unit_scales_applies(a, b, model)) {
    if (options.keep_on_device) {
      std::optional<quantized_tensor> local[2];
      const quantized_tensor& ua = unit_scaled_kept(a, block, cache ? &cache->unit_scaled[0] : nullptr, local[0]);
      const quantized_tensor& ub = unit_scaled_kept(b, block, cache ? &cache->unit_scaled[1] : nullptr, local[1]);
      product_result on_gpu = gpu::emulate_product(ua, ub, model, output_rounding::fp32, gpu::gemm_path::automatic,
                                                   true, cache != nullptr ? &cache->prepared : nullptr);
      gpu::apply_tensor_scales(on_gpu, a.tensor_scale, b.tensor_scale, model.kind == accumulation_kind::exact, output);
      return on_gpu;
    }
    return detail::per_tensor_by_unit_scales(
        a, b, block, model, output,
        [&](const quantized_tensor& x, const quantized_tensor& y) { return gpu::emulate_product(x, y, model); });
  }
  if (const auto route = detail::per_tensor_exact_parts_route(a, b, model)) {
    return per_tensor_parts_product(a, b, model, output, options, block, *route);
  }
  if (reference_multiplies(a, b, model, output)) return plain_exact_product(a, b, options);
  // Unscaled operands (fp32, bf16): block scales and tensor scales are 1, so the GPU's generic
  // kernel on the dequantized values computes the model (block = the common K-block).
  if (plain_multiplies(a, b, model, output)) {
    return gpu::emulate_plain_product(*canonical_on_device(a), *canonical_on_device(b), block, model, output,
                                      options.keep_on_device);
  }
  return std::nullopt;
}

}  // namespace

bool prepares(const quantize_options& options) {
  const auto scheme = options.format.scheme;
  return scheme == quant_scheme::mx || scheme == quant_scheme::nvfp4 || scheme == quant_scheme::bf16 ||
         (scheme == quant_scheme::per_tensor && (options.format.element == core::element_kind::fp8_e4m3 ||
                                                 options.format.element == core::element_kind::fp8_e5m2));
}

prepared_operand prepare(const matrix& tensor, const quantize_options& quantize_with, const rotation_options& rotation,
                         bool keep_dequantized, const gemm_options& options) {
  gpu::operand_energies energies;
  const device_matrix_ptr resident = options.resident_copy(tensor);
  // The codes stay on the GPU for a product that runs there (a CPU product downloads them).
  const bool codes_on_device_only = options.keep_on_device;
  prepared_operand out;
  out.quantized = gpu::quantize_with_energies(tensor, quantize_with, rotation, keep_dequantized, energies,
                                              resident.get(), codes_on_device_only);
  out.signal_energy = energies.signal;
  out.error_energy = energies.error;
  return out;
}

std::shared_ptr<product_cache> make_product_cache() {
  auto cache = std::make_shared<product_cache>();
  cache->prepared.exact_follows = true;  // run_gemm makes one for its exact_too product
  return cache;
}

std::optional<product_result> product(const quantized_tensor& a, const quantized_tensor& b,
                                      const accumulation_model& model, output_rounding output,
                                      const gemm_options& options, int block, product_cache* cache) {
  if (options.device != compute_device::gpu) return std::nullopt;
  std::optional<product_result> on_gpu = first_route(a, b, model, output, options, block, cache);
  if (on_gpu) on_gpu->product_on_gpu = true;
  return on_gpu;
}

bool values_only_on_device(const quantized_tensor& q) {
  const bool values = q.device_dequantized && q.dequantized.size() != q.rows * q.cols;
  const bool codes = q.device_codes && q.codes.size() != q.device_codes->bytes();
  return values || codes;
}

quantized_tensor with_host_values(const quantized_tensor& q) {
  quantized_tensor out = q;
  if (q.device_dequantized && q.dequantized.size() != q.rows * q.cols) {
    out.dequantized = q.device_dequantized->download32();
  }
  if (q.device_codes && q.codes.size() != q.device_codes->bytes()) {
    out.codes.resize(q.device_codes->bytes());
    q.device_codes->download(out.codes.data(), out.codes.size());
    out.scales.resize(q.device_scales ? q.device_scales->bytes() : 0);
    if (!out.scales.empty()) q.device_scales->download(out.scales.data(), out.scales.size());
  }
  out.device_dequantized.reset();
  out.device_codes.reset();
  out.device_scales.reset();
  return out;
}

std::optional<std::int64_t> nonfinite_codes_on_device(const quantized_tensor& q, core::element_kind kind) {
  if (!q.device_codes || q.codes.size() == q.device_codes->bytes()) return std::nullopt;
  return gpu::count_nonfinite_codes(*q.device_codes, q.rows * q.cols, kind);
}

}  // namespace mxscope::backend

#endif  // MXSCOPE_HAVE_CUDA
