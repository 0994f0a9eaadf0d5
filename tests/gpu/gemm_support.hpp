// What the GPU test's GEMM suites share: model names, operands in device memory, the GPU product
// into poisoned buffers and its entry-by-entry check against the host definition.
#pragma once

#include "support.hpp"

namespace gpu_test {

inline std::string model_name(const mxscope::accumulation_model& model) {
  switch (model.kind) {
    case mxscope::accumulation_kind::exact:
      return "exact";
    case mxscope::accumulation_kind::fp32_block:
      return "fp32-block";
    case mxscope::accumulation_kind::fp32_group:
      return "fp32-group:" + std::to_string(model.blocks_per_group);
    case mxscope::accumulation_kind::fp32_seq:
      return "fp32-seq";
    default:
      return "?";
  }
}

inline mxscope::accumulation_model model_of(mxscope::accumulation_kind kind, int group = 1) {
  mxscope::accumulation_model model;
  model.kind = kind;
  model.blocks_per_group = group;
  return model;
}

struct device_operand {
  gpu::device_buffer codes;
  gpu::device_buffer scales;
  gpu::mx_operand_view view;
};

inline device_operand upload_operand(const mxscope::quantized_tensor& q) {
  device_operand out;
  out.codes = gpu::device_buffer(q.codes.size());
  out.codes.upload(q.codes.data(), q.codes.size());
  out.scales = gpu::device_buffer(q.scales.size());
  out.scales.upload(q.scales.data(), q.scales.size());
  out.view.codes = out.codes.as<const std::uint8_t>();
  out.view.scales = out.scales.as<const std::uint8_t>();
  out.view.element = q.options.format.element;
  out.view.block = q.block;
  out.view.axis = q.options.axis;
  out.view.rows = q.rows;
  out.view.cols = q.cols;
  return out;
}

struct gemm_output {
  matrix out;
  matrix64 exact;
};

// The GPU product into buffers poisoned with 0xFF.
inline gemm_output gpu_product(const mxscope::quantized_tensor& qa, const mxscope::quantized_tensor& qb,
                        const mxscope::accumulation_model& model, mxscope::output_rounding output,
                        gpu::gemm_path path) {
  const device_operand a = upload_operand(qa);
  const device_operand b = upload_operand(qb);
  const gpu::prepared_operand left = gpu::prepare_operand(a.view, path);
  const gpu::prepared_operand right = gpu::prepare_operand(b.view, path);
  const std::int64_t m = left.rows(), n = right.rows();
  gemm_output result{matrix(m, n), matrix64()};
  const bool exact = model.kind == mxscope::accumulation_kind::exact;
  gpu::device_buffer out(static_cast<std::size_t>(m * n) * 4);
  gpu::device_buffer exact_out(exact ? static_cast<std::size_t>(m * n) * 8 : 0);
  out.fill_bytes(0xFF);
  exact_out.fill_bytes(0xFF);
  gpu::multiply_prepared(left, right, model, output, out.as<float>(), exact ? exact_out.as<double>() : nullptr, path);
  gpu::synchronize();
  out.download(result.out.data(), out.bytes());
  if (exact) {
    result.exact = matrix64(m, n);
    exact_out.download(result.exact.data(), exact_out.bytes());
  }
  return result;
}

// Compares the listed entries (all when `entries` is empty) with the host definition.
inline std::string check_product_entries(const mxscope::quantized_tensor& qa, const mxscope::quantized_tensor& qb,
                                  const mxscope::accumulation_model& model, mxscope::output_rounding output,
                                  const gemm_output& got,
                                  const std::vector<std::pair<std::int64_t, std::int64_t>>& entries,
                                  const std::string& policy) {
  const host_reference::operand_reader a(qa), b(qb);
  std::vector<std::pair<std::int64_t, std::int64_t>> list = entries;
  if (list.empty()) {
    for (std::int64_t i = 0; i < a.rows; ++i) {
      for (std::int64_t j = 0; j < b.rows; ++j) list.emplace_back(i, j);
    }
  }
  std::vector<host_reference::entry_value> expected(list.size());
  host_reference::parallel_for(static_cast<std::int64_t>(list.size()), [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t e = first; e < last; ++e) {
      const auto [i, j] = list[static_cast<std::size_t>(e)];
      expected[static_cast<std::size_t>(e)] = host_reference::product_entry(a, b, i, j, model, output);
    }
  });
  const bool exact = model.kind == mxscope::accumulation_kind::exact;
  for (std::size_t e = 0; e < list.size(); ++e) {
    const auto [i, j] = list[e];
    const float value = got.out(i, j);
    if (!same(expected[e].value, value)) {
      return "entry (" + std::to_string(i) + ", " + std::to_string(j) + "): expected " + show(expected[e].value) +
             " got " + show(value) + "; " + policy;
    }
    if (exact && !same(expected[e].exact, got.exact(i, j))) {
      return "exact fp64 entry (" + std::to_string(i) + ", " + std::to_string(j) + "): expected " +
             show(expected[e].exact) + " got " + show(got.exact(i, j)) + "; " + policy;
    }
  }
  return "";
}

struct gemm_layout_case {
  const char* name;
  int a_axis;
  int b_axis;
};
const gemm_layout_case gemm_layouts[] = {{"fprop", 1, 1}, {"dgrad", 1, 0}, {"wgrad", 0, 0}};

// Quantizes A (reduction along a_axis) and B for C = A B^T: the stored shapes follow the axes.
inline std::pair<mxscope::quantized_tensor, mxscope::quantized_tensor> make_operands(
    std::int64_t m, std::int64_t n, std::int64_t k, int a_format, int b_format, int block,
    const gemm_layout_case& layout, value_kind kind, std::uint64_t seed,
    core::rounding_mode rounding = core::rounding_mode::rne) {
  const matrix a =
      layout.a_axis == 1 ? test_inputs::make_matrix(m, k, kind, seed) : test_inputs::make_matrix(k, m, kind, seed);
  const matrix b = layout.b_axis == 1 ? test_inputs::make_matrix(n, k, kind, seed + 1)
                                      : test_inputs::make_matrix(k, n, kind, seed + 1);
  const auto a_options = mx_options(a_format, block, layout.a_axis, rounding, core::scale_rule::floor, 32, seed + 2);
  const auto b_options = mx_options(b_format, block, layout.b_axis, rounding, core::scale_rule::floor, 32, seed + 3);
  return {host_reference::quantize_mx(a, a_options), host_reference::quantize_mx(b, b_options)};
}

}  // namespace gpu_test
