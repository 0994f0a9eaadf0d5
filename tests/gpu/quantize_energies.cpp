// GPU test suites: quantization with the operand energies run_gemm uses (MX, per-tensor fp8, bf16)
// and NVFP4, against the host definition.
#include "support.hpp"

namespace gpu_test {

// quantize_with_energies (what run_gemm uses on the GPU): the rotation on the device, then the
// quantizer, and the operand energies in the canonical order instead of the dequantized values.
// Expected: the host reference's rotation and quantizer, and compare.hpp's canonical sums of x^2 and
// (x - dequantized)^2 over the finite pairs, as src/gemm.cpp's CPU summary computes them.
// The operand energies quantize_with_energies must return, summed in the canonical order on the
// host: sum v^2 and sum (v - q)^2 over the elements where v and its dequantized q are finite.
std::array<double, 2> expected_energies(const matrix& values, const matrix& dequantized) {
  return mxscope::canonical_sums<2>(values.size(), [&](std::int64_t i) {
    const double value = values.values[static_cast<std::size_t>(i)];
    const double rounded = dequantized.values[static_cast<std::size_t>(i)];
    if (!std::isfinite(value) || !std::isfinite(rounded)) return std::array<double, 2>{0.0, 0.0};
    return std::array<double, 2>{value * value, (value - rounded) * (value - rounded)};
  });
}

// "" when both energies have the expected bits, else what differs.
std::string energies_mismatch(const std::array<double, 2>& want, const gpu::operand_energies& got) {
  if (!same(want[0], got.signal)) return "signal energy: expected " + show(want[0]) + " got " + show(got.signal);
  if (!same(want[1], got.error)) return "error energy: expected " + show(want[1]) + " got " + show(got.error);
  return "";
}

void quantize_energies(bool small) {
  struct energy_case {
    int format;
    int axis;
    int rotation;
    mxscope::sign_policy signs;
    std::int64_t rows, cols;
  };
  const energy_case cases[] = {{0, 0, 0, mxscope::sign_policy::none, 96, 40},
                               {0, 0, 16, mxscope::sign_policy::none, 4160, 3},
                               {0, 1, 32, mxscope::sign_policy::per_step, 9, 512},
                               {3, 0, 16, mxscope::sign_policy::fixed, 64, 77},
                               {4, 1, 0, mxscope::sign_policy::none, 5, 8200},
                               {5, 0, 64, mxscope::sign_policy::per_step, 128, 33}};
  int index = 0;
  for (const energy_case& c : cases) {
    ++index;
    if (small && index % 2 == 0) continue;
    const std::uint64_t seed = next_seed();
    const value_kind kind = static_cast<value_kind>(index % test_inputs::value_kind_count);
    const matrix input = test_inputs::make_matrix(c.rows, c.cols, kind, seed);
    const auto options = mx_options(c.format, 32, c.axis, core::rounding_mode::rne, core::scale_rule::floor, 32, seed + 1);
    mxscope::rotation_options rotation;
    rotation.size = c.rotation;
    rotation.signs = c.signs;
    rotation.seed = seed + 2;
    rotation.step = 5;
    rotation.layer_hash = 0x1234U;
    const std::string name = std::string("quantize with energies ") + format_names[c.format] + " axis " +
                             std::to_string(c.axis) + " H" + std::to_string(c.rotation) + " signs " +
                             sign_names[static_cast<int>(c.signs)] + " " + std::to_string(c.rows) + "x" +
                             std::to_string(c.cols) + " " + std::string(test_inputs::value_kind_name(kind));
    run_case(name, [&]() -> std::string {
      matrix rotated = input;
      host_reference::rotate(rotated, c.axis, rotation);
      const mxscope::quantized_tensor expected = host_reference::quantize_mx(rotated, options);
      const auto want = expected_energies(rotated, expected.dequantized);
      for (const bool keep : {false, true}) {
        gpu::operand_energies energies;
        const mxscope::quantized_tensor got = gpu::quantize_with_energies(input, options, rotation, keep, energies);
        const std::string policy = describe(options, rotation) + (keep ? " (dequantized kept)" : "");
        if (got.codes != expected.codes) return "codes differ; " + policy;
        if (got.scales != expected.scales) return "scales differ; " + policy;
        // The codes and scales also stay in device memory; codes_on_device_only leaves only those.
        gpu::operand_energies again;
        const mxscope::quantized_tensor resident =
            gpu::quantize_with_energies(input, options, rotation, keep, again, nullptr, true);
        if (!resident.codes.empty() || !resident.scales.empty() || !resident.device_codes || !resident.device_scales) {
          return "codes_on_device_only: the codes are not (only) in device memory; " + policy;
        }
        std::vector<std::uint8_t> device_codes(resident.device_codes->bytes());
        std::vector<std::uint8_t> device_scales(resident.device_scales->bytes());
        resident.device_codes->download(device_codes.data(), device_codes.size());
        resident.device_scales->download(device_scales.data(), device_scales.size());
        if (device_codes != expected.codes || device_scales != expected.scales) {
          return "codes or scales in device memory differ; " + policy;
        }
        if (got.nonzero_inputs != expected.nonzero_inputs || got.flushed != expected.flushed ||
            got.saturated != expected.saturated || got.nonfinite_inputs != expected.nonfinite_inputs) {
          return "counters differ; " + policy;
        }
        if (const std::string wrong = energies_mismatch(want, energies); !wrong.empty()) return wrong + "; " + policy;
        if (keep != (got.dequantized.size() == input.size())) return "dequantized kept or dropped wrongly; " + policy;
        for (std::int64_t i = 0; keep && i < input.size(); ++i) {
          if (!same(expected.dequantized.values[static_cast<std::size_t>(i)], got.dequantized.values[static_cast<std::size_t>(i)])) {
            return "dequantized element " + std::to_string(i) + " differs; " + policy;
          }
        }
      }
      return "";
    });
  }
}

// NVFP4 on the GPU (gpu::quantize, and quantize_with_energies as run_gemm calls it) against the host
// reference (host_reference::quantize_nvfp4 after host_reference::rotate), which
// tests/test_gpu_host_reference.cpp checks against the library's quantize(). 1-D tiles along either axis
// and 2-D tiles, every rounding mode (sr with 32 and 9 bits), rotations, every input kind (with
// fp32 subnormals, zero rows, inf and NaN), shapes that are not multiples of 16. Compared: codes,
// scales, the tensor scale, dequantized values, counters and the operand energies.
void quantize_nvfp4_suite(bool small) {
  struct nvfp4_case {
    int axis;
    bool two_d;
    core::rounding_mode rounding;
    int sr_bits;
    int rotation;
    std::int64_t rows, cols;
  };
  const nvfp4_case cases[] = {{1, false, core::rounding_mode::rne, 32, 0, 37, 70},
                              {0, false, core::rounding_mode::rne, 32, 0, 70, 37},
                              {1, true, core::rounding_mode::rne, 32, 0, 50, 45},
                              {1, false, core::rounding_mode::sr, 32, 0, 33, 160},
                              {0, false, core::rounding_mode::sr, 9, 16, 64, 30},
                              {1, false, core::rounding_mode::rna, 32, 16, 20, 64},
                              {1, false, core::rounding_mode::rtz, 32, 0, 1, 1},
                              {0, true, core::rounding_mode::sr, 32, 0, 17, 17}};
  int index = 0;
  for (const nvfp4_case& c : cases) {
    for (int kind_index = 0; kind_index < test_inputs::value_kind_count; ++kind_index) {
      ++index;
      if (small && index % 3 != 1) continue;
      const std::uint64_t seed = next_seed();
      const value_kind kind = static_cast<value_kind>(kind_index);
      const matrix input = test_inputs::make_matrix(c.rows, c.cols, kind, seed);
      mxscope::quantize_options options = mx_options(0, 16, c.axis, c.rounding, core::scale_rule::floor, c.sr_bits, seed + 1);
      options.format = {mxscope::quant_scheme::nvfp4, core::element_kind::fp4_e2m1, 16};
      options.nvfp4_2d = c.two_d;
      mxscope::rotation_options rotation;
      rotation.size = c.rotation;
      rotation.signs = c.rotation == 0 ? mxscope::sign_policy::none : mxscope::sign_policy::per_step;
      rotation.seed = seed + 2;
      rotation.step = 3;
      const std::string name = std::string("quantize nvfp4 axis ") + std::to_string(c.axis) + (c.two_d ? " 2-D" : "") +
                               " " + rounding_names[static_cast<int>(c.rounding)] + " sr_bits " +
                               std::to_string(c.sr_bits) + " H" + std::to_string(c.rotation) + " " +
                               std::to_string(c.rows) + "x" + std::to_string(c.cols) + " " +
                               std::string(test_inputs::value_kind_name(kind));
      run_case(name, [&]() -> std::string {
        matrix rotated = input;
        if (c.rotation > 0) host_reference::rotate(rotated, c.axis, rotation);
        const mxscope::quantized_tensor expected = host_reference::quantize_nvfp4(rotated, options);
        const auto same_tensor = [&](const mxscope::quantized_tensor& got, bool dequantized) -> std::string {
          if (got.codes != expected.codes) return "codes differ";
          if (got.scales != expected.scales) return "scales differ";
          if (got.scale_rows != expected.scale_rows || got.scale_cols != expected.scale_cols || got.block != expected.block) {
            return "scale layout differs";
          }
          if (!same(expected.tensor_scale, got.tensor_scale)) {
            return "tensor scale: expected " + show(expected.tensor_scale) + " got " + show(got.tensor_scale);
          }
          if (got.nonzero_inputs != expected.nonzero_inputs || got.flushed != expected.flushed ||
              got.saturated != expected.saturated || got.nonfinite_inputs != expected.nonfinite_inputs) {
            return "counters differ";
          }
          for (std::int64_t i = 0; dequantized && i < input.size(); ++i) {
            if (!same(expected.dequantized.values[static_cast<std::size_t>(i)], got.dequantized.values[static_cast<std::size_t>(i)])) {
              return "dequantized element " + std::to_string(i) + " differs";
            }
          }
          return "";
        };
        if (const std::string wrong = same_tensor(gpu::quantize(input, options, rotation), true); !wrong.empty()) {
          return "gpu::quantize: " + wrong + "; " + describe(options, rotation);
        }
        gpu::operand_energies energies;
        const mxscope::quantized_tensor prepared = gpu::quantize_with_energies(input, options, rotation, false, energies);
        if (const std::string wrong = same_tensor(prepared, false); !wrong.empty()) {
          return "quantize_with_energies: " + wrong + "; " + describe(options, rotation);
        }
        if (const std::string wrong = energies_mismatch(expected_energies(rotated, expected.dequantized), energies);
            !wrong.empty()) {
          return wrong + "; " + describe(options, rotation);
        }
        return "";
      });
    }
  }
}

// Per-tensor fp8 through quantize_with_energies, against the definition of src/quantize.cpp written
// out here: scale = fl32(amax / max_normal) over the finite inputs (1 when there are none), codes
// encoded from the fp64 quotient v / scale (sr words from the stream at the flat index),
// dequantized fl32(decode * scale), NaN codes with the input's sign for non-finite inputs.
// bf16 operands as run_gemm prepares them on the GPU: codes, counters, energies, and the values
// left in device memory. Expected: the shared rounding (core::float_to_bf16) on the host, with
// the CPU's counters and the canonical energy sums. Inputs include overflow to inf, underflow to
// zero, inf and NaN.
void quantize_bf16_energies(bool small) {
  // 613 x 1733 is over four strides of the kernel's largest grid (1024 x 256 threads): every batch
  // position of batched_elements and a second round of it.
  const std::int64_t shapes[][2] = {{70, 130}, {3, 9000}, {1, 1}, {257, 33}, {613, 1733}};
  int index = 0;
  for (const auto& shape : shapes) {
    for (const core::rounding_mode rounding : {core::rounding_mode::rne, core::rounding_mode::sr, core::rounding_mode::rtz}) {
      ++index;
      if (small && index % 2 == 0) continue;
      const std::uint64_t seed = next_seed();
      const value_kind kind = static_cast<value_kind>(index % test_inputs::value_kind_count);
      matrix input = test_inputs::make_matrix(shape[0], shape[1], kind, seed);
      if (input.size() > 8) {
        input.values[0] = 0x1.ff8p127f;                             // rounds up to inf (rne)
        input.values[1] = 0x1p-140f;                               // stays a subnormal bf16
        input.values[2] = -0x1p-149f;                              // flushes under rtz, may under rne
        input.values[3] = std::numeric_limits<float>::infinity();  // non-finite input
        input.values[4] = std::numeric_limits<float>::quiet_NaN();
      }
      mxscope::quantize_options options;
      options.format = {mxscope::quant_scheme::bf16, core::element_kind::fp4_e2m1, 0};
      options.axis = index % 2;
      options.rounding = rounding;
      options.sr_bits = index % 3 == 0 ? 9 : 32;
      std::uint64_t state = seed + 1;
      options.stream = core::random_stream{split_mix(state), 3, static_cast<std::uint32_t>(split_mix(state))};
      const std::string name = std::string("quantize bf16 with energies ") + rounding_names[static_cast<int>(rounding)] +
                               " " + std::to_string(shape[0]) + "x" + std::to_string(shape[1]) + " " +
                               std::string(test_inputs::value_kind_name(kind));
      run_case(name, [&]() -> std::string {
        std::vector<std::uint8_t> codes(static_cast<std::size_t>(input.size()) * 2);
        matrix dequantized(input.rows, input.cols);
        std::int64_t counts[4] = {};
        for (std::size_t i = 0; i < dequantized.values.size(); ++i) {
          const float v = input.values[i];
          const std::uint32_t word =
              rounding == core::rounding_mode::sr ? options.stream.word(static_cast<std::uint64_t>(i)) : 0U;
          const std::uint16_t bits = core::float_to_bf16(v, rounding, word, options.sr_bits);
          codes[2 * i] = static_cast<std::uint8_t>(bits & 0xFFU);
          codes[2 * i + 1] = static_cast<std::uint8_t>(bits >> 8);
          std::uint32_t widened = static_cast<std::uint32_t>(bits) << 16;
          float rounded = 0.0f;
          std::memcpy(&rounded, &widened, sizeof(rounded));
          dequantized.values[i] = rounded;
          counts[0] += v != 0.0f;
          counts[1] += v != 0.0f && rounded == 0.0f;
          counts[2] += std::isfinite(v) && std::isinf(rounded);
          counts[3] += !std::isfinite(v);
        }
        const auto want = expected_energies(input, dequantized);
        gpu::operand_energies energies;
        const gpu::device_matrix resident = gpu::device_matrix::upload(input);
        const mxscope::quantized_tensor got =
            gpu::quantize_with_energies(input, options, {}, index % 2 == 0, energies, index % 3 == 1 ? &resident : nullptr);
        if (got.codes != codes) return std::string("codes differ");
        if (!got.device_dequantized) return std::string("the values were not left in device memory");
        const matrix on_device = got.device_dequantized->download32();
        for (std::size_t i = 0; i < dequantized.values.size(); ++i) {
          if (!same(dequantized.values[i], on_device.values[i])) return "dequantized element " + std::to_string(i);
          if (index % 2 == 0 && !same(dequantized.values[i], got.dequantized.values[i])) {
            return "host dequantized element " + std::to_string(i);
          }
        }
        if (got.nonzero_inputs != counts[0] || got.flushed != counts[1] || got.saturated != counts[2] ||
            got.nonfinite_inputs != counts[3]) {
          return "counters: expected " + std::to_string(counts[0]) + "/" + std::to_string(counts[1]) + "/" +
                 std::to_string(counts[2]) + "/" + std::to_string(counts[3]) + " got " +
                 std::to_string(got.nonzero_inputs) + "/" + std::to_string(got.flushed) + "/" +
                 std::to_string(got.saturated) + "/" + std::to_string(got.nonfinite_inputs);
        }
        if (const std::string wrong = energies_mismatch(want, energies); !wrong.empty()) return wrong;
        return "";
      });
    }
  }
}

void quantize_per_tensor_energies(bool small) {
  struct per_tensor_case {
    core::element_kind kind;
    core::rounding_mode rounding;
    int rotation;
    std::int64_t rows, cols;
  };
  const per_tensor_case cases[] = {{core::element_kind::fp8_e4m3, core::rounding_mode::rne, 0, 70, 130},
                                   {core::element_kind::fp8_e5m2, core::rounding_mode::rne, 16, 64, 33},
                                   {core::element_kind::fp8_e4m3, core::rounding_mode::sr, 0, 3, 9000},
                                   {core::element_kind::fp8_e4m3, core::rounding_mode::rtz, 32, 96, 5},
                                   // over four strides of the largest grid (see quantize_bf16_energies)
                                   {core::element_kind::fp8_e4m3, core::rounding_mode::rne, 0, 613, 1733}};
  int index = 0;
  for (const per_tensor_case& c : cases) {
    ++index;
    if (small && index % 2 == 0) continue;
    const std::uint64_t seed = next_seed();
    const value_kind kind = static_cast<value_kind>(index % test_inputs::value_kind_count);
    const matrix input = test_inputs::make_matrix(c.rows, c.cols, kind, seed);
    mxscope::quantize_options options;
    options.format = {mxscope::quant_scheme::per_tensor, c.kind, 0};
    options.axis = 0;
    options.rounding = c.rounding;
    std::uint64_t state = seed + 1;
    options.stream = core::random_stream{split_mix(state), 7, static_cast<std::uint32_t>(split_mix(state))};
    mxscope::rotation_options rotation;
    rotation.size = c.rotation;
    rotation.seed = seed + 2;
    const std::string name = std::string("quantize per-tensor with energies ") + core::spec(c.kind).name + " " +
                             rounding_names[static_cast<int>(c.rounding)] + " H" + std::to_string(c.rotation) + " " +
                             std::to_string(c.rows) + "x" + std::to_string(c.cols) + " " +
                             std::string(test_inputs::value_kind_name(kind));
    run_case(name, [&]() -> std::string {
      matrix rotated = input;
      host_reference::rotate(rotated, 0, rotation);
      float amax = 0.0f;
      for (const float v : rotated.values) {
        if (std::isfinite(v)) amax = std::max(amax, std::fabs(v));
      }
      const float scale = amax > 0.0f ? amax / static_cast<float>(core::max_normal(c.kind)) : 1.0f;
      std::vector<std::uint8_t> codes(rotated.values.size());
      matrix dequantized(c.rows, c.cols);
      std::int64_t counts[4] = {};
      for (std::size_t i = 0; i < codes.size(); ++i) {
        const float v = rotated.values[i];
        if (v != 0.0f) ++counts[0];
        if (!std::isfinite(v)) {
          ++counts[3];
          codes[i] = static_cast<std::uint8_t>(core::nan_code(c.kind) | (std::signbit(v) ? core::sign_bit(c.kind) : 0U));
          dequantized.values[i] = std::numeric_limits<float>::quiet_NaN();
          continue;
        }
        const std::uint32_t word =
            c.rounding == core::rounding_mode::sr ? options.stream.word(static_cast<std::uint64_t>(i)) : 0U;
        const auto encoded = core::encode(c.kind, static_cast<double>(v) / static_cast<double>(scale), c.rounding, word,
                                          options.sr_bits);
        codes[i] = static_cast<std::uint8_t>(encoded.code);
        dequantized.values[i] = static_cast<float>(core::decode(c.kind, encoded.code)) * scale;
        counts[1] += encoded.flushed;
        counts[2] += encoded.saturated;
      }
      const auto want = expected_energies(rotated, dequantized);
      gpu::operand_energies energies;
      const mxscope::quantized_tensor got = gpu::quantize_with_energies(input, options, rotation, true, energies);
      if (!same(scale, got.tensor_scale)) return "tensor scale: expected " + show(scale) + " got " + show(got.tensor_scale);
      if (got.codes != codes) return "codes differ";
      for (std::size_t i = 0; i < codes.size(); ++i) {
        if (!same(dequantized.values[i], got.dequantized.values[i])) return "dequantized element " + std::to_string(i);
      }
      if (got.nonzero_inputs != counts[0] || got.flushed != counts[1] || got.saturated != counts[2] ||
          got.nonfinite_inputs != counts[3]) {
        return "counters differ";
      }
      if (const std::string wrong = energies_mismatch(want, energies); !wrong.empty()) return wrong;
      return "";
    });
  }
}

}  // namespace gpu_test
