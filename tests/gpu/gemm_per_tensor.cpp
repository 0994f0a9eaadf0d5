// GPU test suite: per-tensor scaled operands (fp8 with tensor scales, NVFP4) in the products
// against the host definition.
#include "support.hpp"
#include "gemm_support.hpp"

namespace gpu_test {

// Per-tensor fp8 operands on the GPU: the element codes multiplied as MX operands with unit block
// scales and kept in device memory, then gpu::apply_tensor_scales. Expected: the same product
// brought to the host (checked against the host definition by the sweep above) with the tensor
// scales applied by the host compiler's build of the shared rounding (core/tensor_scale.hpp, which
// tests/test_gemm.cpp checks against Boost.Multiprecision).
namespace {

// Per-tensor fp8 products (unit block scales, the tensor-scale epilogue), and the unit-scaled
// e5m2 x e4m3 hybrid on the generic kernel.
void per_tensor_products(bool small) {
  const mxscope::accumulation_model models[] = {model_of(mxscope::accumulation_kind::exact),
                                                model_of(mxscope::accumulation_kind::fp32_block),
                                                model_of(mxscope::accumulation_kind::fp32_group, 4)};
  int index = 0;
  for (const auto& model : models) {
    for (const auto output : {mxscope::output_rounding::fp32, mxscope::output_rounding::bf16}) {
      for (const gemm_layout_case& layout : gemm_layouts) {
        ++index;
        if (small && index % 3 != 1) continue;
        const std::uint64_t seed = next_seed();
        auto [qa, qb] = make_operands(33 + index % 5, 21 + index % 7, 96 + 29 * (index % 3), 3, 3, 32, layout,
                                      value_kind::banded, seed);
        for (auto* q : {&qa, &qb}) std::fill(q->scales.begin(), q->scales.end(), std::uint8_t{127});  // 2^0
        std::mt19937_64 random(seed);
        const float sa = std::ldexp(static_cast<float>(0.5 + 0.5 * (random() % 1000003) / 1000003.0), -9 + index % 5);
        const float sb = std::ldexp(static_cast<float>(0.5 + 0.5 * (random() % 999983) / 999983.0), index % 3 - 13);
        const bool exact_model = model.kind == mxscope::accumulation_kind::exact;
        const std::string name = std::string("per-tensor scales on the device ") + model_name(model) +
                                 (output == mxscope::output_rounding::bf16 ? " bf16 out " : " ") + layout.name;
        run_case(name, [&]() -> std::string {
          const mxscope::product_result plain = gpu::emulate_product(qa, qb, model);
          const mxscope::product_result kept =
              gpu::emulate_product(qa, qb, model, mxscope::output_rounding::fp32, gpu::gemm_path::automatic, true);
          gpu::apply_tensor_scales(kept, sa, sb, exact_model, output);
          const matrix out = kept.device_out->download32();
          const matrix64 exact = exact_model ? kept.device_exact->download64() : matrix64();
          const float alpha = sa * sb;
          for (std::int64_t e = 0; e < out.size(); ++e) {
            const auto at = static_cast<std::size_t>(e);
            float want = 0.0f;
            double want64 = 0.0;
            if (exact_model) {
              const core::scaled_exact_value rounded = core::round_scaled_exact(plain.exact.values[at], sa, sb);
              want = rounded.fp32;
              want64 = rounded.fp64;
            } else {
              want = plain.out.values[at] * alpha;
            }
            if (output == mxscope::output_rounding::bf16) {
              want = core::bf16_to_float(core::float_to_bf16(want, core::rounding_mode::rne));
            }
            if (!same(want, out.values[at]) || (exact_model && !same(want64, exact.values[at]))) {
              return "entry " + std::to_string(e) + ": expected " + show(want) + " got " + show(out.values[at]) +
                     "; seed " + hex64(seed);
            }
          }
          return "";
        });
      }
    }
  }
  // Unit-scaled e5m2 x e4m3 (the per-tensor fp8 hybrid as the GPU multiplies it) under fp32-block
  // and fp32-group: only the generic kernel covers the pair, and gemm_path::automatic takes the
  // plain-operand kernel for unit block scales. Against the host definition, on MX-quantized codes
  // (wide ones: K-blocks whose dot is not exact in fp64 take the per-product fallback) and on random
  // codes of both formats (every binade, subnormals, inf and NaN codes).
  int hybrid = 0;
  for (const auto& model :
       {model_of(mxscope::accumulation_kind::fp32_block), model_of(mxscope::accumulation_kind::fp32_group, 3)}) {
    for (const gemm_layout_case& layout : gemm_layouts) {
      for (int kind = 0; kind <= test_inputs::value_kind_count; ++kind) {
        ++hybrid;
        if (small && hybrid % 4 != 1) continue;
        const std::uint64_t seed = next_seed();
        const int block = hybrid % 5 == 0 ? 16 : 32;
        const std::int64_t m = 41 + hybrid % 4, n = 67 + hybrid % 3, k = 64 * (1 + hybrid % 3) + 13 * (hybrid % 2);
        auto [qa, qb] = make_operands(m, n, k, 4, 3, block, layout,
                                      static_cast<value_kind>(kind % test_inputs::value_kind_count), seed);
        const bool random_codes = kind == test_inputs::value_kind_count;
        std::mt19937_64 random(seed ^ 0x9e3779b97f4a7c15ULL);
        for (auto* q : {&qa, &qb}) {
          std::fill(q->scales.begin(), q->scales.end(), std::uint8_t{127});  // 2^0
          if (random_codes) {
            for (auto& code : q->codes) code = static_cast<std::uint8_t>(random() % 1000 == 0 ? 0x7F : random() & 0xFF);
          }
        }
        const auto output = hybrid % 3 == 0 ? mxscope::output_rounding::bf16 : mxscope::output_rounding::fp32;
        const std::string name = std::string("per-tensor e5m2 x e4m3 on the plain kernel ") + model_name(model) + " " +
                                 layout.name + " " +
                                 (random_codes ? std::string("random codes")
                                               : std::string(test_inputs::value_kind_name(static_cast<value_kind>(kind)))) +
                                 " block " + std::to_string(block);
        run_case(name, [&]() -> std::string {
          const mxscope::product_result got = gpu::emulate_product(qa, qb, model, output);
          return check_product_entries(qa, qb, model, output, gemm_output{got.out, matrix64()}, {},
                                       name + ", seed " + hex64(seed));
        });
      }
    }
  }
}

// Parts of a per-tensor exact product beyond fp64 combined on the device.
void binade_part_checks() {
  // gpu::combine_binade_parts against the core's steps composed on the host (detail::
  // per_tensor_exact_by_parts's rounding): parts' sums whose sum is an fp64 value (including
  // midpoints after scaling) and ones many binades apart, which take the long accumulator.
  run_case("per-tensor binade parts: combine_binade_parts", []() -> std::string {
    std::mt19937_64 random(0xb1ade);
    const float sa = 0x1.34p-5f, sb = 0x1.9ap+3f;
    const core::tensor_scale_product scale = core::make_scale_product(sa, sb);
    for (const int count : {1, 2, 3, 16}) {
      const std::int64_t rows = 37, cols = 53;
      std::vector<std::shared_ptr<const gpu::device_matrix>> sums;
      std::vector<matrix64> host;
      for (int p = 0; p < count; ++p) {
        matrix64 part(rows, cols);
        for (auto& value : part.values) {
          const int choice = static_cast<int>(random() % 6);
          const double integer = static_cast<double>(random() >> (11 + random() % 40));
          // Parts of the hybrid hold sums of products of one window: nearby binades (an exact total)
          // or windows far apart (the long accumulator), zeros and negatives.
          const int exponent = choice == 0 ? 0 : (choice <= 3 ? -20 * p : 60 * p - 300 + static_cast<int>(random() % 9));
          value = choice == 5 ? 0.0 : std::ldexp(integer, exponent - 40);
          if (random() & 1) value = -value;
        }
        sums.push_back(std::make_shared<const gpu::device_matrix>(gpu::device_matrix::upload(part)));
        host.push_back(std::move(part));
      }
      for (const auto output : {mxscope::output_rounding::fp32, mxscope::output_rounding::bf16}) {
        const mxscope::product_result got = gpu::combine_binade_parts(sums, sa, sb, output, false);
        for (std::int64_t e = 0; e < rows * cols; ++e) {
          const auto at = static_cast<std::size_t>(e);
          double sum = 0.0;
          bool single = true;
          for (const matrix64& part : host) {
            const core::sum_and_error se = core::two_sum(sum, part.values[at]);
            sum = se.sum;
            single = single && se.error == 0.0;
          }
          core::scaled_exact_value want{};
          if (single) {
            want = core::round_scaled_exact(sum, sa, sb);
          } else {
            core::long_accumulator total;
            for (const matrix64& part : host) core::add_scaled_exactly(total, part.values[at], scale);
            want = {total.round_to_float(), total.round_to_double()};
          }
          float want32 = want.fp32;
          if (output == mxscope::output_rounding::bf16) {
            want32 = core::bf16_to_float(core::float_to_bf16(want32, core::rounding_mode::rne));
          }
          if (!same(want32, got.out.values[at]) || !same(want.fp64, got.exact.values[at])) {
            return std::to_string(count) + " parts, entry " + std::to_string(e) + ": expected " + show(want32) +
                   " / " + show(want.fp64) + ", got " + show(got.out.values[at]) + " / " + show(got.exact.values[at]);
          }
        }
      }
    }
    return "";
  });
}

// NVFP4 block-scaled values against the core's decoding.
void nvfp4_values() {
  // NVFP4 operands on the GPU (the replay's NVFP4 products): the block-scaled elements against the
  // core's decoding, for both axes, 1-D and 2-D scale tiles, odd shapes; a NaN scale is reported.
  run_case("nvfp4 block-scaled values", []() -> std::string {
    std::mt19937_64 random(0x4f4f);
    for (const int axis : {0, 1}) {
      for (const bool two_d : {false, true}) {
        for (const bool nan_scale : {false, true}) {
          mxscope::quantized_tensor q;
          q.options.format = {mxscope::quant_scheme::nvfp4, core::element_kind::fp4_e2m1, 16};
          q.options.axis = axis;
          q.options.nvfp4_2d = two_d;
          q.block = 16;
          q.rows = 37 + axis;
          q.cols = 45 + (two_d ? 2 : 0);
          const core::nvfp4_tile tile = core::nvfp4_tile_of(axis, two_d);
          q.scale_rows = (q.rows + tile.rows - 1) / tile.rows;
          q.scale_cols = (q.cols + tile.cols - 1) / tile.cols;
          const std::int64_t row_bytes = (q.cols + 1) / 2;  // packed fp4 codes per row
          q.codes.resize(static_cast<std::size_t>(row_bytes * q.rows));
          for (auto& byte : q.codes) byte = static_cast<std::uint8_t>(random());
          q.scales.resize(static_cast<std::size_t>(q.scale_rows * q.scale_cols));
          for (auto& code : q.scales) code = static_cast<std::uint8_t>(random() % 0x7F);  // finite ue4m3
          if (nan_scale) q.scales[q.scales.size() / 2] = 0x7F;
          q.tensor_scale = 0x1.8p-7f;
          bool finite = false;
          const gpu::device_matrix values = gpu::nvfp4_block_scaled_values(q, finite);
          const matrix got = values.download32();
          const std::int64_t rows = axis == 1 ? q.rows : q.cols, depth = axis == 1 ? q.cols : q.rows;
          if (got.rows != rows || got.cols != depth) return "shape";
          bool want_finite = true;
          for (std::int64_t row = 0; row < rows; ++row) {
            for (std::int64_t k = 0; k < depth; ++k) {
              const std::int64_t r = axis == 1 ? row : k, c = axis == 1 ? k : row;
              const std::uint8_t byte = q.codes[static_cast<std::size_t>(r * row_bytes + c / 2)];
              const auto code = static_cast<std::uint32_t>(c % 2 == 0 ? byte & 0x0F : byte >> 4);
              const std::uint8_t scale = q.scales[static_cast<std::size_t>((r / tile.rows) * q.scale_cols + c / tile.cols)];
              const float want = static_cast<float>(core::decode(core::element_kind::fp4_e2m1, code) *
                                                    core::decode(core::element_kind::ue4m3, scale));
              want_finite = want_finite && std::isfinite(want);
              if (!same(want, got(row, k))) {
                return "axis " + std::to_string(axis) + (two_d ? " 2-D" : "") + " (" + std::to_string(row) + ", " +
                       std::to_string(k) + "): expected " + show(want) + " got " + show(got(row, k));
              }
            }
          }
          if (finite != want_finite || finite == nan_scale) return "finite flag " + std::to_string(finite);
        }
      }
    }
    return "";
  });
}

// NVFP4 x NVFP4 on the integer path.
void nvfp4_products() {
  // NVFP4 x NVFP4 under fp32-block and fp32-group on the integer path (gpu::prepare_nvfp4), then
  // alpha on the device, against the definition on the host: each block's products of the values q d
  // added exactly to the accumulator (a group's blocks together) and rounded once, then times
  // fl32(sa sb), then the output rounding. Both axes, 2-D scale tiles, K not a multiple of 16.
  {
    int index = 0;
    for (const auto& model : {model_of(mxscope::accumulation_kind::fp32_block),
                              model_of(mxscope::accumulation_kind::fp32_group, 3)}) {
      for (const gemm_layout_case& layout : gemm_layouts) {
        ++index;
        run_case(std::string("nvfp4 on the integer path ") + model_name(model) + " " + layout.name,
                 [&, index]() -> std::string {
          std::mt19937_64 random(0x4f4f00 + index);
          const std::int64_t m = 37, n = 45, k = 100;
          const auto make = [&](std::int64_t rows, int axis, bool two_d) {
            mxscope::quantized_tensor q;
            q.options.format = {mxscope::quant_scheme::nvfp4, core::element_kind::fp4_e2m1, 16};
            q.options.axis = axis;
            q.options.nvfp4_2d = two_d;
            q.block = 16;
            q.rows = axis == 1 ? rows : k;
            q.cols = axis == 1 ? k : rows;
            const core::nvfp4_tile tile = core::nvfp4_tile_of(axis, two_d);
            q.scale_rows = (q.rows + tile.rows - 1) / tile.rows;
            q.scale_cols = (q.cols + tile.cols - 1) / tile.cols;
            q.codes.resize(static_cast<std::size_t>((q.cols + 1) / 2 * q.rows));
            for (auto& byte : q.codes) byte = static_cast<std::uint8_t>(random());
            q.scales.resize(static_cast<std::size_t>(q.scale_rows * q.scale_cols));
            // Finite ue4m3 scales, zero among them, over the whole range (wide blocks per entry).
            for (auto& code : q.scales) code = static_cast<std::uint8_t>(random() % 9 == 0 ? 0 : random() % 0x7F);
            q.tensor_scale = std::ldexp(static_cast<float>(1 + random() % 0xFFFFFF), -30);
            return q;
          };
          const mxscope::quantized_tensor qa = make(m, layout.a_axis, false);
          const mxscope::quantized_tensor qb = make(n, layout.b_axis, index % 2 == 0);
          const auto value = [](const mxscope::quantized_tensor& q, std::int64_t row, std::int64_t kk) {
            const std::int64_t r = q.options.axis == 1 ? row : kk, c = q.options.axis == 1 ? kk : row;
            const std::uint8_t byte = q.codes[static_cast<std::size_t>(r * ((q.cols + 1) / 2) + c / 2)];
            const core::nvfp4_tile tile = core::nvfp4_tile_of(q.options.axis, q.options.nvfp4_2d);
            const std::uint8_t scale = q.scales[static_cast<std::size_t>((r / tile.rows) * q.scale_cols + c / tile.cols)];
            return core::decode(core::element_kind::fp4_e2m1, static_cast<std::uint32_t>(c % 2 == 0 ? byte & 0x0F : byte >> 4)) *
                   core::decode(core::element_kind::ue4m3, scale);
          };
          bool finite_a = false, finite_b = false;
          const gpu::prepared_operand left = gpu::prepare_nvfp4(qa, finite_a);
          const gpu::prepared_operand right = gpu::prepare_nvfp4(qb, finite_b);
          if (!finite_a || !finite_b) return "finite scales reported non-finite";
          for (const auto output : {mxscope::output_rounding::fp32, mxscope::output_rounding::bf16}) {
            mxscope::product_result result;
            auto out = std::make_shared<gpu::device_matrix>(m, n, gpu::device_matrix::element::fp32);
            gpu::multiply_prepared(left, right, model, mxscope::output_rounding::fp32, out->fp32(), nullptr,
                                   gpu::gemm_path::integer);
            result.device_out = out;
            gpu::apply_tensor_scales(result, qa.tensor_scale, qb.tensor_scale, false, output);
            const matrix got = result.device_out->download32();
            const std::int64_t group = model.kind == mxscope::accumulation_kind::fp32_group ? model.blocks_per_group : 1;
            for (std::int64_t i = 0; i < m; ++i) {
              for (std::int64_t j = 0; j < n; ++j) {
                float accumulator = 0.0f;
                for (std::int64_t k0 = 0; k0 < k; k0 += 16 * group) {
                  core::long_accumulator total;
                  total.add(static_cast<double>(accumulator));
                  for (std::int64_t kk = k0; kk < std::min(k, k0 + 16 * group); ++kk) total.add(value(qa, i, kk) * value(qb, j, kk));
                  accumulator = total.round_to_float();
                }
                float want = accumulator * (qa.tensor_scale * qb.tensor_scale);
                if (output == mxscope::output_rounding::bf16) {
                  want = core::bf16_to_float(core::float_to_bf16(want, core::rounding_mode::rne));
                }
                if (!same(want, got(i, j))) {
                  return "entry (" + std::to_string(i) + ", " + std::to_string(j) + "): expected " + show(want) +
                         " got " + show(got(i, j));
                }
              }
            }
          }
          return "";
        });
      }
    }
  }
}

// The exact reference with tensor scales.
void scaled_reference_checks() {
  // The exact reference with tensor scales (NVFP4's exact model): every exact sum times sa sb,
  // rounded once, against the core's long accumulator on the host. Operands of a few binades (the
  // tiled kernel's window) and of a few hundred (its per-product fallback), K not a multiple of 32.
  for (const bool wide : {false, true}) {
    run_case(std::string("scaled exact reference, ") + (wide ? "wide rows (per-product kernel)" : "tiled kernel"),
             [wide]() -> std::string {
      std::mt19937_64 random(wide ? 0x5ca1ed : 0x5ca1e);
      const std::int64_t m = 67, n = 45, k = 301;
      matrix a(m, k), b(n, k);
      for (auto* x : {&a, &b}) {
        for (auto& value : x->values) {
          const int exponent = wide ? static_cast<int>(random() % 200) - 120 : static_cast<int>(random() % 12) - 6;
          value = random() % 7 == 0 ? 0.0f : std::ldexp(static_cast<float>(static_cast<int>(random() % 255) - 127), exponent);
        }
      }
      const float sa = 0x1.5p-9f, sb = 0x1.3f2p+4f;
      const core::tensor_scale_product scale = core::make_scale_product(sa, sb);
      const mxscope::reference_result got = gpu::scaled_reference_gemm(
          gpu::device_matrix::upload(a), gpu::device_matrix::upload(b), sa, sb, false);
      for (std::int64_t i = 0; i < m; ++i) {
        for (std::int64_t j = 0; j < n; ++j) {
          core::long_accumulator total;
          for (std::int64_t kk = 0; kk < k; ++kk) {
            core::add_scaled_exactly(total, static_cast<double>(a(i, kk)) * static_cast<double>(b(j, kk)), scale);
          }
          const double want64 = total.round_to_double();
          const float want32 = total.round_to_float();
          if (!same(want64, got.fp64(i, j)) || !same(want32, got.fp32(i, j))) {
            return "entry (" + std::to_string(i) + ", " + std::to_string(j) + "): expected " + show(want32) + " / " +
                   show(want64) + ", got " + show(got.fp32(i, j)) + " / " + show(got.fp64(i, j));
          }
        }
      }
      return "";
    });
  }
}

// NVFP4 operands: block-scaled values, the integer path's products and the exact reference with
// tensor scales.
void nvfp4_checks() {
  nvfp4_values();
  nvfp4_products();
  scaled_reference_checks();
}

// Tensor-scale helpers on the device: the finiteness of codes, the rounding of constructed sums.
void device_scale_checks() {
  // The finiteness check of per-tensor codes left in device memory.
  run_case("per-tensor codes: count_nonfinite_codes", []() -> std::string {
    std::mt19937_64 random(0xc0de5);
    for (const core::element_kind kind : {core::element_kind::fp8_e4m3, core::element_kind::fp8_e5m2}) {
      for (const std::int64_t count : {std::int64_t{0}, std::int64_t{1}, std::int64_t{777}, std::int64_t{100000}}) {
        std::vector<std::uint8_t> codes(static_cast<std::size_t>(count) + 3);
        for (auto& code : codes) code = static_cast<std::uint8_t>(random() % 200 == 0 ? 0xFF : random() % 0x78);
        std::int64_t want = 0;
        for (std::int64_t i = 0; i < count; ++i) want += !std::isfinite(core::decode(kind, codes[static_cast<std::size_t>(i)]));
        gpu::device_buffer buffer(codes.size());
        buffer.upload(codes.data(), codes.size());
        const std::int64_t got = gpu::count_nonfinite_codes(buffer, count, kind);
        if (got != want) {
          return std::string(core::spec(kind).name) + " count " + std::to_string(count) + ": expected " +
                 std::to_string(want) + " got " + std::to_string(got);
        }
      }
    }
    return "";
  });
  // The exact rounding on constructed sums: near fp32 midpoints after scaling, far below 1, near
  // overflow, and zeros.
  run_case("per-tensor scales on the device, constructed sums", []() -> std::string {
    std::mt19937_64 random(0x7e57c0de);
    const std::int64_t count = 20000;
    const float sa = 0x1.8p-3f, sb = 0x1.4p-6f;  // sa sb = 15 * 2^-11: three significant bits
    const double scale = static_cast<double>(sa) * static_cast<double>(sb);
    matrix64 sums(1, count);
    for (std::int64_t e = 0; e < count; ++e) {
      const int kind = static_cast<int>(e % 5);
      double sum = 0.0;
      if (kind <= 2) {
        // A midpoint between two fp32 values, divided by the scale, nudged by -1, 0 or +1 fp64 ulp.
        const float f = std::ldexp(static_cast<float>(1 + random() % 0xFFFFFF) / 0x1p24f, static_cast<int>(random() % 60) - 30);
        const double midpoint = static_cast<double>(f) + static_cast<double>(std::nextafter(f, 2.0f * f) - f) * 0.5;
        sum = midpoint / scale;
        if (kind == 1) sum = std::nextafter(sum, 0.0);
        if (kind == 2) sum = std::nextafter(sum, 2.0 * sum);
      } else if (kind == 3) {
        sum = std::ldexp(static_cast<double>(random() >> 11), static_cast<int>(random() % 200) - 1100);  // tiny
      } else {
        sum = e % 10 == 4 ? 0.0 : std::ldexp(static_cast<double>(random() >> 11), 81);  // near fp32 overflow
      }
      if (random() & 1) sum = -sum;
      sums.values[static_cast<std::size_t>(e)] = sum;
    }
    mxscope::product_result result;
    result.device_out = std::make_shared<gpu::device_matrix>(1, count, gpu::device_matrix::element::fp32);
    result.device_exact = std::make_shared<gpu::device_matrix>(gpu::device_matrix::upload(sums));
    gpu::apply_tensor_scales(result, sa, sb, true, mxscope::output_rounding::fp32);
    const matrix out = result.device_out->download32();
    const matrix64 exact = result.device_exact->download64();
    for (std::int64_t e = 0; e < count; ++e) {
      const auto at = static_cast<std::size_t>(e);
      const core::scaled_exact_value want = core::round_scaled_exact(sums.values[at], sa, sb);
      if (!same(want.fp32, out.values[at]) || !same(want.fp64, exact.values[at])) {
        return "sum " + show(sums.values[at]) + ": expected " + show(want.fp32) + " / " + show(want.fp64) + ", got " +
               show(out.values[at]) + " / " + show(exact.values[at]);
      }
    }
    return "";
  });
}

}  // namespace

void tensor_scale_checks(bool small) {
  per_tensor_products(small);
  binade_part_checks();
  nvfp4_checks();
  device_scale_checks();
}

}  // namespace gpu_test
