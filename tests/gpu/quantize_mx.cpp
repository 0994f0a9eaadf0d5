// GPU test suites: MX quantization against the host definition (both quantizer paths, every
// format, rounding, scale rule, rotation and sign policy), the fast encoder, the native gfx950
// conversions, a large tensor, and the rotations alone.
#include "quantize_support.hpp"

namespace gpu_test {

void quantize_sweep(bool small) {
  // Every format x rounding x scale rule x rotation/sign policy x axis, each on a fresh input.
  struct rotation_case {
    int size;
    mxscope::sign_policy signs;
  };
  const rotation_case rotations[] = {{0, mxscope::sign_policy::none},
                                     {16, mxscope::sign_policy::none},
                                     {16, mxscope::sign_policy::fixed},
                                     {16, mxscope::sign_policy::per_step},
                                     {64, mxscope::sign_policy::per_step}};
  const int blocks[] = {32, 32, 16, 7, 64, 1, 33};
  int index = 0;
  for (int format = 0; format < 6; ++format) {
    for (int rounding = 0; rounding < 4; ++rounding) {
      for (int rule = 0; rule < 3; ++rule) {
        for (const rotation_case& rot : rotations) {
          for (int axis = 0; axis < 2; ++axis) {
            ++index;
            if (small && index % 97 != 1) continue;
            const std::uint64_t seed = next_seed();
            const int block = blocks[index % 7];
            const int sr_bits = rounding == 3 ? (index % 5 == 0 ? 8 : (index % 11 == 0 ? 1 : 32)) : 32;
            const value_kind kind = static_cast<value_kind>(index % test_inputs::value_kind_count);
            // Shapes: short last blocks and odd fp4 rows without rotation; rotation sizes divide the axis.
            std::int64_t rows = 37 + index % 5, cols = 75 + index % 3;
            if (axis == 0 && index % 2 == 0) cols = 136;  // the staged column kernel's shapes (cols % 8 == 0)
            if (rot.size > 0) {
              if (axis == 1)
                cols = rot.size * (rot.size == 16 ? 5 : 2);
              else
                rows = rot.size * (rot.size == 16 ? 5 : 2);
            }
            const matrix input = test_inputs::make_matrix(rows, cols, kind, seed);
            const auto options = mx_options(format, block, axis, static_cast<core::rounding_mode>(rounding),
                                            static_cast<core::scale_rule>(rule), sr_bits, seed + 1);
            mxscope::rotation_options rotation;
            rotation.size = rot.size;
            rotation.signs = rot.signs;
            rotation.seed = seed + 2;
            rotation.step = static_cast<std::uint32_t>(seed % 1000);
            rotation.layer_hash = static_cast<std::uint32_t>(seed >> 32);
            const std::string name = std::string("quantize ") + format_names[format] + " " + rounding_names[rounding] +
                                     " " + rule_names[rule] + " H" + std::to_string(rot.size) + " signs " +
                                     sign_names[static_cast<int>(rot.signs)] + " axis " + std::to_string(axis) +
                                     " block " + std::to_string(block) + " " + std::to_string(rows) + "x" +
                                     std::to_string(cols) + " " + std::string(test_inputs::value_kind_name(kind));
            run_case(name + " generic",
                     [&] { return check_quantize(input, false, options, rotation, gpu::quantize_path::generic); });
            run_case(name + " automatic",
                     [&] { return check_quantize(input, false, options, rotation, gpu::quantize_path::automatic); });
          }
        }
      }
    }
  }
}

// The staged column kernel (axis 0, block 32, cols a multiple of 8; rotation none or 16 in the
// kernel) against the host reference, on fp32 and bf16 inputs, with full and partial column tiles
// and a short last block of rows; the small run takes fp4 and fp8 e4m3 only.
void staged_column_sweep(bool small) {
  const std::int64_t shapes[][2] = {{64, 136}, {45, 64}, {96, 256}};
  const mxscope::sign_policy policies[] = {mxscope::sign_policy::none, mxscope::sign_policy::none,
                                           mxscope::sign_policy::per_step};
  int index = 0;
  for (int format = 0; format < 6; ++format) {
    if (small && format != 0 && format != 3) continue;
    for (const core::rounding_mode rounding : {core::rounding_mode::rne, core::rounding_mode::sr}) {
      for (int policy = 0; policy < 3; ++policy) {
        const int size = policy == 0 ? 0 : 16;
        for (const auto& shape : shapes) {
          if (size > 0 && shape[0] % size != 0) continue;
          for (const bool bf16 : {false, true}) {
            ++index;
            const std::uint64_t seed = next_seed();
            const value_kind kind = static_cast<value_kind>(index % test_inputs::value_kind_count);
            const matrix input = test_inputs::make_matrix(shape[0], shape[1], kind, seed);
            const auto options = mx_options(format, 32, 0, rounding, static_cast<core::scale_rule>(index % 3),
                                             index % 4 == 0 ? 9 : 32, seed + 1);
            mxscope::rotation_options rotation;
            rotation.size = size;
            rotation.signs = policies[policy];
            rotation.seed = seed + 2;
            rotation.step = static_cast<std::uint32_t>(seed % 1000);
            const std::string name = std::string("staged columns ") + format_names[format] + " " +
                                     (rounding == core::rounding_mode::sr ? "sr" : "rne") + " H" + std::to_string(size) +
                                     " signs " + sign_names[static_cast<int>(rotation.signs)] + " " +
                                     std::to_string(shape[0]) + "x" + std::to_string(shape[1]) + (bf16 ? " bf16" : " fp32") +
                                     " " + std::string(test_inputs::value_kind_name(kind));
            run_case(name, [&] { return check_quantize(input, bf16, options, rotation, gpu::quantize_path::automatic); });
          }
        }
      }
    }
  }
}

// The gfx950 native quantizer (hardware MX conversions; runs only on an MI355X, where
// gpu::native_mx_available() is true): MXFP4, axis 1, block 32, rne and sr with 22, 9 and 1 random
// bits (the sr_bits it maps onto the hardware's seed), every scale rule, rotation none / 16 / 32,
// fp32 and bf16 inputs, against the host definition like every other path.
void quantize_native(bool small) {
  if (!gpu::native_mx_available()) {
    std::printf("quantize native: no gfx950 device, skipped\n");
    return;
  }
  int index = 0;
  for (const int sr_bits : {0, 22, 9, 1}) {  // 0: rne
    for (int rule = 0; rule < 3; ++rule) {
      for (const int rotation_size : {0, 16, 32}) {
        for (const bool bf16 : {false, true}) {
          ++index;
          if (small && index % 5 != 1) continue;
          const std::uint64_t seed = next_seed();
          const value_kind kind = static_cast<value_kind>(index % test_inputs::value_kind_count);
          const std::int64_t rows = 19 + index % 7, cols = 32 * (3 + index % 4);
          const matrix input = test_inputs::make_matrix(rows, cols, kind, seed);
          const auto rounding = sr_bits == 0 ? core::rounding_mode::rne : core::rounding_mode::sr;
          const auto options = mx_options(0, 32, 1, rounding, static_cast<core::scale_rule>(rule),
                                          sr_bits == 0 ? 32 : sr_bits, seed + 1);
          mxscope::rotation_options rotation;
          rotation.size = rotation_size;
          rotation.signs = static_cast<mxscope::sign_policy>(index % 3);
          rotation.seed = seed + 2;
          rotation.step = 7;
          rotation.layer_hash = 0x1234567U;
          const std::string name = std::string("quantize native mxfp4 ") +
                                   (sr_bits == 0 ? std::string("rne") : "sr" + std::to_string(sr_bits)) + " " +
                                   rule_names[rule] + " H" + std::to_string(rotation_size) + " signs " +
                                   sign_names[static_cast<int>(rotation.signs)] + (bf16 ? " bf16" : " fp32") + " " +
                                   std::to_string(rows) + "x" + std::to_string(cols) + " " +
                                   std::string(test_inputs::value_kind_name(kind));
          run_case(name, [&] { return check_quantize(input, bf16, options, rotation, gpu::quantize_path::native); });
        }
      }
    }
  }
}

// The fused quantizer's element encoder (src/gpu/fast_encode.hpp) against the core, on the device:
// 2^26 fp32 bit patterns spread over the whole pattern space at block exponent 0 and 2^21 at each
// of seven extreme and moderate exponents, for every float element format and rounding mode (sr
// with 32 and 9 bits): about 2 billion comparisons. (The core's fp64 conversions make a full 2^32
// sweep per case too slow for this test; tests/test_gpu_host_reference.cpp covers every binade,
// tie and exponent on the CPU.)
void fast_encoder_checks(bool small) {
  const core::element_kind kinds[] = {core::element_kind::fp4_e2m1, core::element_kind::fp6_e2m3,
                                      core::element_kind::fp6_e3m2, core::element_kind::fp8_e4m3,
                                      core::element_kind::fp8_e5m2};
  struct mode_case {
    core::rounding_mode mode;
    int sr_bits;
    const char* name;
  };
  const mode_case modes[] = {{core::rounding_mode::rne, 32, "rne"},
                             {core::rounding_mode::rna, 32, "rna"},
                             {core::rounding_mode::rtz, 32, "rtz"},
                             {core::rounding_mode::sr, 32, "sr"},
                             {core::rounding_mode::sr, 9, "sr9"}};
  for (const core::element_kind kind : kinds) {
    for (const mode_case& mode : modes) {
      for (const int exponent : {0, -127, -126, -100, -30, 30, 100, 127}) {
        if (small && exponent != 0 && exponent != -127) continue;
        // Odd strides walk the 2^32 patterns through every exponent field and low-bit mix.
        const std::uint64_t count =
            small ? (exponent == 0 ? 1u << 14 : 1u << 12) : (exponent == 0 ? 1u << 26 : 1u << 21);
        const std::uint64_t stride = small ? 262147 : (exponent == 0 ? 65 : 2053);
        const std::uint64_t first = next_seed() & 0xffffffffULL;
        const std::string name = std::string("fast encoder ") + core::spec(kind).name + " " + mode.name + " exponent " +
                                 std::to_string(exponent) + " (" + std::to_string(count) + " patterns)";
        run_case(name, [&]() -> std::string {
          const gpu::encoder_self_test result =
              gpu::self_test_fast_encoder(kind, mode.mode, mode.sr_bits, exponent, first, count, stride);
          if (result.checked == 0) return "nothing was checked";
          if (result.mismatches == 0) return "";
          const float value = core::bits_float(result.first_mismatch);
          return std::to_string(result.mismatches) + " of " + std::to_string(result.checked) +
                 " patterns differ from core::quantize_element; first " + show(value);
        });
      }
    }
  }
}

// Large tensors: 2048 x 4096 along both axes, rne and sr, with and without rotation.
void quantize_large() {
  const std::uint64_t seed = next_seed();
  const matrix input = test_inputs::make_matrix(2048, 4096, value_kind::banded, seed);
  struct large_case {
    int axis;
    core::rounding_mode rounding;
    int rotation;
    bool bf16;
  };
  const large_case cases[] = {{1, core::rounding_mode::rne, 0, true},
                              {1, core::rounding_mode::sr, 16, true},
                              {0, core::rounding_mode::rne, 0, false},
                              {0, core::rounding_mode::sr, 16, false}};
  for (const large_case& c : cases) {
    const auto options = mx_options(0, 32, c.axis, c.rounding, core::scale_rule::floor, 32, seed + 5);
    mxscope::rotation_options rotation;
    rotation.size = c.rotation;
    rotation.signs = c.rotation > 0 ? mxscope::sign_policy::per_step : mxscope::sign_policy::none;
    rotation.seed = seed + 6;
    rotation.step = 3;
    const std::string name = std::string("quantize large mxfp4 2048x4096 axis ") + std::to_string(c.axis) + " " +
                             rounding_names[static_cast<int>(c.rounding)] + " H" + std::to_string(c.rotation) +
                             (c.bf16 ? " bf16" : " fp32");
    run_case(name, [&] { return check_quantize(input, c.bf16, options, rotation, gpu::quantize_path::automatic); });
  }
}

// Standalone rotations (in place) against the host definition, every size class and both axes.
void rotation_checks(bool small) {
  int index = 0;
  for (const int size : {2, 16, 32, 128, 1024, 4096}) {  // 16 and 32: rotate_columns_kernel on axis 0
    for (int axis = 0; axis < 2; ++axis) {
      for (int signs = 0; signs < 3; ++signs) {
        ++index;
        if (small && index % 7 != 1) continue;
        const std::uint64_t seed = next_seed();
        const std::int64_t lines = size >= 1024 ? 5 : 67;
        const std::int64_t rows = axis == 1 ? lines : 2 * size;
        const std::int64_t cols = axis == 1 ? 2 * size : lines;
        const matrix input = test_inputs::make_matrix(rows, cols, static_cast<value_kind>(index % 3), seed);
        mxscope::rotation_options rotation;
        rotation.size = size;
        rotation.signs = static_cast<mxscope::sign_policy>(signs);
        rotation.seed = seed + 1;
        rotation.step = 11;
        rotation.layer_hash = 0xABCDEFU;
        const std::string name = "rotate H" + std::to_string(size) + " axis " + std::to_string(axis) + " signs " +
                                 sign_names[signs] + " " + std::to_string(rows) + "x" + std::to_string(cols);
        run_case(name, [&]() -> std::string {
          matrix expected = input;
          host_reference::rotate(expected, axis, rotation);
          gpu::device_buffer buffer(input.values.size() * 4);
          buffer.upload(input.data(), buffer.bytes());
          gpu::rotate_on_device(buffer.as<float>(), rows, cols, axis, gpu::make_rotation_plan(rotation));
          gpu::synchronize();
          matrix got(rows, cols);
          buffer.download(got.data(), buffer.bytes());
          for (std::int64_t i = 0; i < input.size(); ++i) {
            if (!same(expected.values[static_cast<std::size_t>(i)], got.values[static_cast<std::size_t>(i)])) {
              return "element " + std::to_string(i) + " input " + show(input.values[static_cast<std::size_t>(i)]) +
                     ": expected " + show(expected.values[static_cast<std::size_t>(i)]) + " got " +
                     show(got.values[static_cast<std::size_t>(i)]);
            }
          }
          // The host convenience function too.
          const matrix host_api = gpu::rotate(input, axis, rotation);
          for (std::int64_t i = 0; i < input.size(); ++i) {
            if (!same(expected.values[static_cast<std::size_t>(i)], host_api.values[static_cast<std::size_t>(i)])) {
              return "gpu::rotate element " + std::to_string(i) + ": expected " +
                     show(expected.values[static_cast<std::size_t>(i)]) + " got " +
                     show(host_api.values[static_cast<std::size_t>(i)]);
            }
          }
          return "";
        });
      }
    }
  }
}

}  // namespace gpu_test
