// The gfx950 (MI355X) native MX quantizer: kernel and host launcher (rules and hypotheses in
// native_gfx950.hpp). Included once by quantize.cu, inside namespace mxscope::gpu, after the fused
// quantizer's helpers (load_and_scan_block, add_counters, make_signs). The device code exists only in
// the HIP device pass for gfx950 (__gfx950__); nvcc, the CPU simulation and other AMD targets see
// host stubs, and native_gfx950::present() is false there, so nothing selects this path.
#pragma once

namespace native_gfx950 {  // in mxscope::gpu

#if defined(MXSCOPE_NATIVE_GFX950)

namespace {

typedef float float2_vector __attribute__((ext_vector_type(2)));

// ------------------------------------------------------------------------------------------------
// Quantizer: the fused path's layout (one thread per 32-element block of a row, rotation in
// registers, 16-byte code stores), with the element codes from the hardware conversion. Blocks
// whose exponent hardware_block() rejects, and non-finite blocks, take the software route of the
// fused path. Flags and dequantized values are computed from the codes in software (exact).

template <class Input, int Rotation>
__global__ void __launch_bounds__(256)
    native_quantize_kernel(const Input* input, std::int64_t rows, std::int64_t cols, mx_plan plan, const float* signs,
                           mx_device_output output) {
#if defined(__gfx950__)
  constexpr element_kind kind = element_kind::fp4_e2m1;
  const fast_encode::element_constants constants = fast_encode::constants_of(kind);
  const bool stochastic = plan.rounding == core_ns::rounding_mode::sr;
  const std::int64_t blocks_per_row = cols / fused_block;
  const std::int64_t row_bytes = cols / 2;
  unsigned long long counts[mx_counter_count] = {0, 0, 0, 0};
  MXSCOPE_GRID_LOOP(g, rows * blocks_per_row) {
    const std::int64_t r = g / blocks_per_row;
    const std::int64_t b = g % blocks_per_row;
    const std::int64_t first = r * cols + b * fused_block;
    float v[fused_block];
    const block_scan scan = load_and_scan_block<Rotation>(input, first, b, signs, v, counts);
    const float amax = scan.amax;
    const bool nonfinite = scan.nonfinite;
    std::uint32_t words[4] = {0, 0, 0, 0};  // 32 fp4 codes, element 2p in the low nibble of byte p
    if (nonfinite) {
      output.scales[g] = core_ns::scale_nan_code;
#pragma unroll
      for (int i = 0; i < fused_block; ++i) v[i] = canonical_nan_float();
    } else {
      const int exponent = core_ns::shared_exponent(kind, plan.rule, amax);
      output.scales[g] = core_ns::scale_code(exponent);
      if (hardware_block(exponent, plan.rounding)) {
        const float scale = core_ns::bits_float(static_cast<std::uint32_t>(exponent + 127) << 23);  // 2^e, normal
        if (!stochastic) {
#pragma unroll
          for (int w = 0; w < 4; ++w) {
            const float* x = v + 8 * w;
            std::uint32_t word = 0;
            word = __builtin_amdgcn_cvt_scalef32_pk_fp4_f32(word, x[0], x[1], scale, 0);
            word = __builtin_amdgcn_cvt_scalef32_pk_fp4_f32(word, x[2], x[3], scale, 1);
            word = __builtin_amdgcn_cvt_scalef32_pk_fp4_f32(word, x[4], x[5], scale, 2);
            word = __builtin_amdgcn_cvt_scalef32_pk_fp4_f32(word, x[6], x[7], scale, 3);
            words[w] = word;
          }
        } else {
#pragma unroll
          for (int q = 0; q < fused_block / 4; ++q) {
            const core_ns::philox_block random = plan.stream.block(static_cast<std::uint64_t>(first) / 4 + q);
#pragma unroll
            for (int w = 0; w < 4; ++w) {
              const int i = 4 * q + w;
              const float2_vector pair = {v[i], 0.0f};
              const std::uint32_t converted = __builtin_amdgcn_cvt_scalef32_sr_pk_fp4_f32(
                  0U, pair, sr_seed(random.word[w], plan.sr_bits), scale, 0);
              words[i / 8] |= (converted & 0x0FU) << (4 * (i % 8));
            }
          }
        }
        const double saturation = core_ns::max_normal(kind) * core_ns::pow2(exponent);
#pragma unroll
        for (int i = 0; i < fused_block; ++i) {
          const std::uint32_t code = (words[i / 8] >> (4 * (i % 8))) & 0x0FU;
          counts[counter_flushed] += (code & 0x07U) == 0 && v[i] != 0.0f;
          counts[counter_saturated] += static_cast<double>(fabsf(v[i])) > saturation;
          v[i] = fast_encode::dequantize(constants, code, exponent);
        }
      } else {
#pragma unroll
        for (int q = 0; q < fused_block / 4; ++q) {
          core_ns::philox_block random{};
          if (stochastic) random = plan.stream.block(static_cast<std::uint64_t>(first) / 4 + q);
#pragma unroll
          for (int w = 0; w < 4; ++w) {
            const int i = 4 * q + w;
            const core_ns::encoded encoded =
                fast_encode::quantize_finite(constants, v[i], exponent, plan.rounding, random.word[w], plan.sr_bits);
            counts[counter_flushed] += encoded.flushed;
            counts[counter_saturated] += encoded.saturated;
            words[i / 8] |= static_cast<std::uint32_t>(encoded.code & 0x0FU) << (4 * (i % 8));
            v[i] = fast_encode::dequantize(constants, encoded.code, exponent);
          }
        }
      }
    }
    uint4* codes = reinterpret_cast<uint4*>(output.codes + r * row_bytes + b * (fused_block / 2));
    codes[0] = make_uint4(words[0], words[1], words[2], words[3]);
    if (output.dequantized != nullptr) {
      float4* destination = reinterpret_cast<float4*>(output.dequantized + first);
#pragma unroll
      for (int q = 0; q < fused_block / 4; ++q)
        destination[q] = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
    }
  }
  if (output.counters != nullptr) add_counters(output.counters, counts);
#else
  (void)input, (void)rows, (void)cols, (void)plan, (void)signs, (void)output;
  __builtin_trap();  // launched only where present() saw a gfx950
#endif
}

template <class Input>
void launch_quantize(const Input* input, std::int64_t rows, std::int64_t cols, const mx_plan& plan, int rotation,
                     const float* signs, const mx_device_output& output) {
  const unsigned grid = grid_for(rows * (cols / fused_block));
  switch (rotation) {
    case 0:
      runtime::launch(native_quantize_kernel<Input, 0>, grid, threads_per_block, 0, input, rows, cols, plan, nullptr,
                      output);
      break;
    case 16:
      runtime::launch(native_quantize_kernel<Input, 16>, grid, threads_per_block, 0, input, rows, cols, plan, signs,
                      output);
      break;
    case 32:
      runtime::launch(native_quantize_kernel<Input, 32>, grid, threads_per_block, 0, input, rows, cols, plan, signs,
                      output);
      break;
    default:
      throw gpu_error("native quantizer: rotation size " + std::to_string(rotation) + " not compiled");
  }
}

}  // namespace

bool present() {
  static const bool allowed = [] {
    const char* setting = std::getenv("MXSCOPE_GPU_NATIVE");
    return setting == nullptr || (std::strcmp(setting, "off") != 0 && std::strcmp(setting, "0") != 0);
  }();
  if (!allowed) return false;
  int device = 0;
  if (runtime::get_device(&device) != runtime::success) {
    (void)runtime::last_error();
    return false;
  }
  constexpr int cached_devices = 64;
  static std::atomic<int> cache[cached_devices] = {};  // 0 unknown, 1 gfx950, -1 other
  if (device >= 0 && device < cached_devices && cache[device].load() != 0) return cache[device].load() > 0;
  runtime::device_properties properties{};
  if (runtime::properties(&properties, device) != runtime::success) {
    (void)runtime::last_error();
    return false;
  }
  const bool gfx950 = std::strncmp(properties.gcnArchName, "gfx950", 6) == 0;
  if (device >= 0 && device < cached_devices) cache[device].store(gfx950 ? 1 : -1);
  return gfx950;
}
void quantize(const void* input, input_format format, std::int64_t rows, std::int64_t cols, const mx_plan& plan,
              const rotation_plan& rotation, const mx_device_output& output) {
  const auto aligned = [](const void* pointer) { return reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0; };
  if (!quantize_plan_fits(plan, rotation.size, cols) || !aligned(input) || !aligned(output.codes) ||
      (output.dequantized != nullptr && !aligned(output.dequantized))) {
    throw input_error(
        "gpu quantize: the native gfx950 path needs mxfp4, block 32, axis 1, cols a multiple of 32, rne or sr with "
        "sr_bits <= 22, rotation 0, 16 or 32 and 16-byte aligned buffers");
  }
  if (!present()) throw input_error("gpu quantize: the native path needs a gfx950 device (MI355X)");
  const device_buffer signs = make_signs(rotation, cols);
  if (format == input_format::fp32) {
    launch_quantize(static_cast<const float*>(input), rows, cols, plan, rotation.size, signs.as<const float>(), output);
  } else {
    launch_quantize(static_cast<const std::uint16_t*>(input), rows, cols, plan, rotation.size,
                    signs.as<const float>(), output);
  }
  if (signs.get() != nullptr) synchronize();  // `signs` must outlive the kernel
}

#else  // no native code in this build (nvcc, the CPU simulation)

bool present() { return false; }

void quantize(const void*, input_format, std::int64_t, std::int64_t, const mx_plan&, const rotation_plan&,
              const mx_device_output&) {
  throw input_error("gpu quantize: the native path exists only in the HIP build for gfx950 (MI355X)");
}

#endif

}  // namespace native_gfx950

bool native_mx_available() { return native_gfx950::present(); }
