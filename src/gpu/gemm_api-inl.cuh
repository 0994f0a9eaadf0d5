// Part of products.cu (included there, after the product kernels, inside namespace mxscope::gpu):
// the host functions of include/mxscope/gpu.hpp for products and references.

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
bool same_view(const mx_operand_view& x, const mx_operand_view& y) {
  return x.codes == y.codes && x.scales == y.scales && x.element == y.element && x.block == y.block &&
         x.axis == y.axis && x.rows == y.rows && x.cols == y.cols;
}

// Whether `kept` holds the operands prepared from these codes and scales for the path `asked`
// (automatic: resolved to `requested`).
bool holds(const prepared_pair_cache& kept, const device_buffer_ptr (&codes)[2], const device_buffer_ptr (&scales)[2],
           const mx_operand_view (&views)[2], gemm_path asked, gemm_path requested) {
  if (!kept.filled || kept.asked != asked || kept.requested != requested) return false;
  for (int i = 0; i < 2; ++i) {
    if (kept.codes[i] != codes[i] || kept.scales[i] != scales[i] || !same_view(kept.views[i], views[i])) return false;
  }
  return true;
}

bool unit_scaled_plain_product(const prepared_operand& left, const prepared_operand& right,
                               const accumulation_model& model) {
  const auto& l = left.data();
  const auto& r = right.data();
  if (l.path != gemm_path::generic || r.path != gemm_path::generic) return false;
  if (model.kind != accumulation_kind::fp32_block && model.kind != accumulation_kind::fp32_group) return false;
  if (l.depth != r.depth || l.block != r.block || l.rows == 0 || r.rows == 0) return false;
  return all_zero_words(l.exponents, l.blocks * l.rows) && all_zero_words(r.exponents, r.blocks * r.rows);
}

mx_operand_view view_of(const quantized_tensor& q, const device_buffer& codes, const device_buffer& scales) {
  mx_operand_view view;
  view.codes = codes.as<const std::uint8_t>();
  view.scales = scales.as<const std::uint8_t>();
  view.element = q.options.format.element;
  view.block = q.block;
  view.axis = q.options.axis;
  view.rows = q.rows;
  view.cols = q.cols;
  return view;
}

// `pair` made to hold a and b prepared for `path` (automatic: the resolved path, or generic where
// an operand has a non-finite element), unless it already does. The device codes and scales stay
// held by `pair`, so its views stay valid (an uploaded copy included).
void prepare_pair(const quantized_tensor& a, const quantized_tensor& b, const accumulation_model& model,
                  gemm_path path, prepared_pair_cache& pair) {
  const device_buffer_ptr codes[2] = {resident_or_uploaded(a.device_codes, a.codes),
                                      resident_or_uploaded(b.device_codes, b.codes)};
  const device_buffer_ptr scales[2] = {resident_or_uploaded(a.device_scales, a.scales),
                                       resident_or_uploaded(b.device_scales, b.scales)};
  const mx_operand_view views[2] = {view_of(a, *codes[0], *scales[0]), view_of(b, *codes[1], *scales[1])};
  const gemm_path requested = path == gemm_path::automatic ? resolve_gemm_path(views[0], views[1], model) : path;
  if (holds(pair, codes, scales, views, path, requested)) return;
  pair.filled = false;
  pair.exact_out32.reset();  // an exact product of other operands
  pair.exact_out.reset();
  gemm_path chosen = requested;
  prepared_operand left = prepare_operand(views[0], chosen);
  prepared_operand right = prepare_operand(views[1], chosen);
  if (path == gemm_path::automatic && chosen != gemm_path::generic &&
      (!left.data().finite_elements || !right.data().finite_elements)) {
    chosen = gemm_path::generic;
    left = prepare_operand(views[0], chosen);
    right = prepare_operand(views[1], chosen);
  }
  for (int i = 0; i < 2; ++i) {
    pair.codes[i] = codes[i];
    pair.scales[i] = scales[i];
    pair.views[i] = views[i];
  }
  pair.asked = path;
  pair.requested = requested;
  pair.chosen = chosen;
  pair.operands[0] = std::move(left);
  pair.operands[1] = std::move(right);
  pair.filled = true;
}

// The product of the pair under `model` into out (and exact, for the exact model); an fp32-block
// product whose exact one follows (pair.exact_follows) leaves that in the pair where one pass forms both.
void multiply_pair(prepared_pair_cache& pair, const accumulation_model& model, output_rounding output,
                   device_matrix& out, device_matrix* exact, gemm_path path) {
  const prepared_operand& left = pair.operands[0];
  const prepared_operand& right = pair.operands[1];
  const gemm_path chosen = pair.chosen;
  if (path == gemm_path::automatic && unit_scaled_plain_product(left, right, model)) {
    // Every block scale 2^0 (per-tensor operands as unit-scaled MX ones) where only the per-entry
    // kernel covers the formats (fp8 e5m2 x e4m3: block dots of up to 55 bits): the elements are
    // plain fp32 operands and the model is the same definition with unit block scales, which the
    // tiled plain-operand kernel computes (fp64 tensor cores on the K-blocks whose dot is exact
    // there, the per-product kernel for the rest).
    const auto& l = left.data();
    plain_product_on_device(l.elements.as<const float>(), right.data().elements.as<const float>(), l.rows,
                            right.data().rows, l.depth, l.block, model, output, out.fp32());
    return;
  }
  if (pair.exact_follows && model.kind == accumulation_kind::fp32_block && chosen == gemm_path::integer) {
    auto exact32 = std::make_shared<device_matrix>(left.rows(), right.rows(), device_matrix::element::fp32);
    auto exact64 = std::make_shared<device_matrix>(left.rows(), right.rows(), device_matrix::element::fp64);
    if (multiply_prepared_both(left, right, output, out.fp32(), exact64->fp64(), exact32->fp32())) {
      pair.exact_out32 = std::move(exact32);
      pair.exact_out = std::move(exact64);
      return;
    }
  }
  multiply_prepared(left, right, model, output, out.fp32(), exact != nullptr ? exact->fp64() : nullptr, chosen);
}

}  // namespace

product_result emulate_product(const quantized_tensor& a, const quantized_tensor& b, const accumulation_model& model,
                               output_rounding output, gemm_path path, bool keep_on_device, prepared_pair_cache* kept) {
  for (const quantized_tensor* q : {&a, &b}) {
    if (q->options.format.scheme != quant_scheme::mx) {
      throw input_error("gpu gemm: field 'format': the GPU backend multiplies MX operands only");
    }
  }
  prepared_pair_cache local;
  prepared_pair_cache& pair = kept != nullptr ? *kept : local;
  prepare_pair(a, b, model, path, pair);
  product_result result;
  const bool want_exact = model.kind == accumulation_kind::exact;
  std::shared_ptr<device_matrix> out, exact;
  if (want_exact && pair.exact_out && output == output_rounding::fp32) {
    // Left by the fp32-block product of these operands (multiply_prepared_both).
    out = std::move(pair.exact_out32);  // the pair no longer holds them
    exact = std::move(pair.exact_out);
  } else {
    const std::int64_t rows = pair.operands[0].rows();
    const std::int64_t cols = pair.operands[1].rows();
    out = std::make_shared<device_matrix>(rows, cols, device_matrix::element::fp32);
    if (want_exact) exact = std::make_shared<device_matrix>(rows, cols, device_matrix::element::fp64);
    multiply_pair(pair, model, output, *out, exact.get(), path);
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

// Whether each of the 256 byte codes decodes to a non-finite value, made once per thread block:
// each element is then one table lookup (decoding it from its bits made the kernel compute-bound).
__global__ void nonfinite_codes_kernel(const std::uint8_t* codes, std::int64_t count, element_kind kind,
                                       unsigned long long* found) {
  __shared__ std::uint8_t nonfinite[256];
  for (int c = static_cast<int>(threadIdx.x); c < 256; c += static_cast<int>(blockDim.x)) {
    nonfinite[c] = is_finite(core_ns::decode(kind, static_cast<std::uint32_t>(c))) ? 0 : 1;
  }
  __syncthreads();
  unsigned long long local = 0;
  MXSCOPE_GRID_LOOP(i, count) { local += nonfinite[codes[i]]; }
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
  runtime::launch(tensor_scales_kernel, strided_grid(count), threads_per_block, 0, result.device_out->fp32(),
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
