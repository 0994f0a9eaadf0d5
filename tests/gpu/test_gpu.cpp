// GPU vs CPU, bit for bit: rotations, MX quantization (every element format x rounding x scale rule
// x rotation x sign policy, both axes, several block sizes, fp32 and bf16 inputs, both quantizer
// paths), emulated GEMMs (exact, fp32-block, fp32-group:G, fp32-seq on every path that covers
// them), the exact reference GEMM and the comparison metrics, on fresh random inputs of many
// shapes. The CPU side is tests/gpu/host_reference.hpp (the library's definitions on the core
// headers; tests/test_gpu_host_reference.cpp ties it to the library) and, for the metrics, the
// library's own src/compare.cpp.
//
// Every GPU output buffer is poisoned before each run (0xFF bytes, and for byte outputs a second
// run with 0x00), so an element the GPU never writes cannot match. One line per case:
// "PASS <case>" or "FAIL <case>: <first mismatch with input, hex bits, expected, actual, policy>",
// then "<N> passed, <M> failed"; the exit code is 1 when anything failed.
//
// Usage: mxscope_gpu_test [--small | --full] [--seed S] [--only SUITE]
//   --small  a few small cases of every kernel (for compute-sanitizer runs)
//   --full   every sweep case also in the CPU simulation (which otherwise runs the small set)
//   --only   run the suites whose name contains SUITE (e.g. "gemm", "quantize", "reference")
//   --seed S replay a run (the seed is printed at the start; MXSCOPE_GPU_TEST_SEED works too)
#include <algorithm>
#include <optional>
#include <array>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "host_reference.hpp"
#include "mxscope/compare.hpp"
#include "mxscope/core/nvfp4.hpp"
#include "mxscope/core/operand.hpp"
#include "mxscope/core/tensor_scale.hpp"
#include "mxscope/cross_step.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/gpu.hpp"
#include "test_inputs.hpp"

namespace {

namespace core = mxscope::core;
namespace gpu = mxscope::gpu;
using mxscope::matrix;
using mxscope::matrix64;
using test_inputs::value_kind;

// ------------------------------------------------------------------------------------------------
// Bookkeeping.

struct tally {
  int passed = 0;
  int failed = 0;
  void record(bool ok, const std::string& name, const std::string& detail) {
    if (ok) {
      ++passed;
      std::printf("PASS %s\n", name.c_str());
    } else {
      ++failed;
      std::printf("FAIL %s: %s\n", name.c_str(), detail.c_str());
    }
    std::fflush(stdout);
  }
};

tally results;

// Runs one case; an exception is a failure of that case, not of the run.
void run_case(const std::string& name, const std::function<std::string()>& body) {
  try {
    const std::string problem = body();
    results.record(problem.empty(), name, problem);
  } catch (const std::exception& error) {
    results.record(false, name, std::string("exception: ") + error.what());
  }
}

std::uint64_t split_mix(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

std::uint64_t case_seeds = 0;
std::uint64_t next_seed() { return split_mix(case_seeds); }

std::string hex32(std::uint32_t bits) {
  char text[16];
  std::snprintf(text, sizeof(text), "0x%08x", bits);
  return text;
}
std::string hex64(std::uint64_t bits) {
  char text[24];
  std::snprintf(text, sizeof(text), "0x%016" PRIx64, bits);
  return text;
}
std::string show(float value) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.9g (%s)", static_cast<double>(value), hex32(core::float_bits(value)).c_str());
  return text;
}
std::string show(double value) {
  char text[80];
  std::snprintf(text, sizeof(text), "%.17g (%s)", value, hex64(core::double_bits(value)).c_str());
  return text;
}

// NaN outputs of the GPU are exactly the positive quiet NaN; the CPU's NaN may carry another
// payload or sign (x86 arithmetic), so an expected NaN matches exactly that pattern and nothing else
// (in particular not the 0xFF poison).
bool same(float expected, float actual) {
  if (std::isnan(expected)) return core::float_bits(actual) == 0x7FC00000U;
  return core::float_bits(expected) == core::float_bits(actual);
}
bool same(double expected, double actual) {
  if (std::isnan(expected)) return core::double_bits(actual) == 0x7FF8000000000000ULL;
  return core::double_bits(expected) == core::double_bits(actual);
}

// ------------------------------------------------------------------------------------------------
// Policies.

const char* format_names[] = {"mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2", "mxint8"};
const core::element_kind format_kinds[] = {core::element_kind::fp4_e2m1, core::element_kind::fp6_e2m3,
                                           core::element_kind::fp6_e3m2, core::element_kind::fp8_e4m3,
                                           core::element_kind::fp8_e5m2, core::element_kind::int8};
const char* rounding_names[] = {"rne", "rna", "rtz", "sr"};
const char* rule_names[] = {"floor", "ceil", "even"};
const char* sign_names[] = {"none", "fixed", "per-step"};

mxscope::quantize_options mx_options(int format, int block, int axis, core::rounding_mode rounding,
                                     core::scale_rule rule, int sr_bits, std::uint64_t seed) {
  mxscope::quantize_options options;
  options.format = {mxscope::quant_scheme::mx, format_kinds[format], 32};
  options.block = block;
  options.axis = axis;
  options.rounding = rounding;
  options.rule = rule;
  options.sr_bits = sr_bits;
  std::uint64_t state = seed;
  options.stream = core::random_stream{split_mix(state), static_cast<std::uint32_t>(split_mix(state) % 100000),
                                       static_cast<std::uint32_t>(split_mix(state))};
  return options;
}

std::string describe(const mxscope::quantize_options& options, const mxscope::rotation_options& rotation) {
  std::ostringstream out;
  out << "format " << core::spec(options.format.element).name << " block " << options.block << " axis " << options.axis
      << " rounding " << rounding_names[static_cast<int>(options.rounding)] << " rule "
      << rule_names[static_cast<int>(options.rule)] << " sr_bits " << options.sr_bits << " stream seed "
      << hex64(options.stream.seed) << " step " << options.stream.step << " tag " << hex32(options.stream.tag)
      << " rotation " << rotation.size << " signs " << sign_names[static_cast<int>(rotation.signs)] << " sign seed "
      << hex64(rotation.seed) << " step " << rotation.step << " layer " << hex32(rotation.layer_hash);
  return out.str();
}

// ------------------------------------------------------------------------------------------------
// Quantization.

// The GPU run of one quantization into poisoned buffers; returns the first mismatch or "". Without
// `with_dequantized` the kernels are asked for codes, scales and counters only (their leaner path).
std::string check_quantize_once(const matrix& input, bool bf16_input, const mxscope::quantize_options& options,
                                const mxscope::rotation_options& rotation, gpu::quantize_path path,
                                const mxscope::quantized_tensor& expected, int poison, bool with_dequantized) {
  const gpu::mx_plan plan = gpu::make_mx_plan(options);
  const gpu::rotation_plan rotation_plan = gpu::make_rotation_plan(rotation);
  const std::int64_t rows = input.rows, cols = input.cols;
  std::vector<std::uint16_t> bf16(static_cast<std::size_t>(input.size()));
  for (std::size_t i = 0; i < bf16.size(); ++i) bf16[i] = test_inputs::to_bf16_bits(input.values[i]);
  gpu::device_buffer source(bf16_input ? bf16.size() * 2 : input.values.size() * 4);
  source.upload(bf16_input ? static_cast<const void*>(bf16.data()) : static_cast<const void*>(input.data()),
                source.bytes());
  gpu::device_buffer codes(expected.codes.size()), scales(expected.scales.size());
  gpu::device_buffer dequantized(expected.dequantized.values.size() * 4), counters(4 * 8);
  codes.fill_bytes(poison);
  scales.fill_bytes(poison);
  dequantized.fill_bytes(poison);
  counters.fill_bytes(0);
  gpu::mx_device_output output{codes.as<std::uint8_t>(), scales.as<std::uint8_t>(),
                               with_dequantized ? dequantized.as<float>() : nullptr,
                               counters.as<unsigned long long>()};
  // The leaner request is the training layer's: codes, scales and the bf16 GEMM operand.
  gpu::device_buffer operand(with_dequantized ? 0 : static_cast<std::size_t>(rows * cols) * 2);
  if (!with_dequantized) {
    operand.fill_bytes(poison);
    output.operand_bf16 = operand.as<std::uint16_t>();
  }
  gpu::quantize_on_device(source.get(), bf16_input ? gpu::input_format::bf16 : gpu::input_format::fp32, rows, cols,
                          plan, rotation_plan, output, path);
  gpu::synchronize();
  std::vector<std::uint8_t> got_codes(expected.codes.size()), got_scales(expected.scales.size());
  matrix got_dequantized(rows, cols);
  unsigned long long got_counts[4] = {};
  codes.download(got_codes.data(), got_codes.size());
  scales.download(got_scales.data(), got_scales.size());
  dequantized.download(got_dequantized.data(), dequantized.bytes());
  counters.download(got_counts, sizeof(got_counts));

  const std::string policy = describe(options, rotation);
  const auto element_text = [&](std::int64_t r, std::int64_t c) {
    return "element (" + std::to_string(r) + ", " + std::to_string(c) + ") input " + show(input(r, c));
  };
  const std::int64_t row_bytes = gpu::mx_code_row_bytes(plan, cols);
  for (std::size_t i = 0; i < got_codes.size(); ++i) {
    if (got_codes[i] != expected.codes[i]) {
      const std::int64_t r = static_cast<std::int64_t>(i) / row_bytes;
      const std::int64_t byte = static_cast<std::int64_t>(i) % row_bytes;
      const std::int64_t c = row_bytes == cols ? byte : 2 * byte;
      return "code byte " + std::to_string(i) + " (" + element_text(r, c) + "): expected " + hex32(expected.codes[i]) +
             " got " + hex32(got_codes[i]) + " poison " + hex32(static_cast<std::uint32_t>(poison)) + "; " + policy;
    }
  }
  for (std::size_t i = 0; i < got_scales.size(); ++i) {
    if (got_scales[i] != expected.scales[i]) {
      return "scale " + std::to_string(i) + ": expected " + hex32(expected.scales[i]) + " got " + hex32(got_scales[i]) +
             " poison " + hex32(static_cast<std::uint32_t>(poison)) + "; " + policy;
    }
  }
  for (std::int64_t i = 0; with_dequantized && i < input.size(); ++i) {
    const float want = expected.dequantized.values[static_cast<std::size_t>(i)];
    const float got = got_dequantized.values[static_cast<std::size_t>(i)];
    if (!same(want, got)) {
      return "dequantized " + element_text(i / cols, i % cols) + ": expected " + show(want) + " got " + show(got) +
             " poison " + hex32(static_cast<std::uint32_t>(poison)) + "; " + policy;
    }
  }
  const std::int64_t want_counts[4] = {expected.nonzero_inputs, expected.flushed, expected.saturated,
                                       expected.nonfinite_inputs};
  const char* counter_names[4] = {"nonzero", "flushed", "saturated", "nonfinite"};
  for (int k = 0; k < 4; ++k) {
    if (static_cast<std::int64_t>(got_counts[k]) != want_counts[k]) {
      return std::string("counter ") + counter_names[k] + ": expected " + std::to_string(want_counts[k]) + " got " +
             std::to_string(got_counts[k]) + "; " + policy;
    }
  }
  if (!with_dequantized) {  // the operand: core::operand_bf16 of each expected code and its block's scale
    std::vector<std::uint16_t> got_operand(static_cast<std::size_t>(rows * cols));
    operand.download(got_operand.data(), operand.bytes());
    const bool packed = core::spec(plan.element).bits == 4;
    const std::int64_t scale_cols = gpu::mx_scale_cols(plan, rows, cols);
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = 0; c < cols; ++c) {
        const std::uint8_t byte = expected.codes[static_cast<std::size_t>(r * row_bytes + (packed ? c / 2 : c))];
        const std::uint32_t code = packed ? (byte >> (4 * (c & 1))) & 0x0FU : byte;
        const std::int64_t scale_index =
            plan.axis == 1 ? r * scale_cols + c / plan.block : (r / plan.block) * scale_cols + c;
        const std::uint16_t want = core::operand_bf16(plan.element, core::operand_scaling::mx, code,
                                                      expected.scales[static_cast<std::size_t>(scale_index)]);
        const std::uint16_t got = got_operand[static_cast<std::size_t>(r * cols + c)];
        if (got != want) {
          return "operand " + element_text(r, c) + ": expected " + hex32(want) + " got " + hex32(got) + " poison " +
                 hex32(static_cast<std::uint32_t>(poison)) + "; " + policy;
        }
      }
    }
  }
  return "";
}

std::string check_quantize(const matrix& input_in, bool bf16_input, const mxscope::quantize_options& options,
                           const mxscope::rotation_options& rotation, gpu::quantize_path path) {
  matrix input = input_in;
  if (bf16_input) {
    for (float& v : input.values) v = test_inputs::from_bf16_bits(test_inputs::to_bf16_bits(v));
  }
  matrix rotated = input;
  host_reference::rotate(rotated, options.axis, rotation);
  const mxscope::quantized_tensor expected = host_reference::quantize_mx(rotated, options);
  // Both poisons with the dequantized output, then the leaner request (codes, scales, counters).
  for (const auto& [poison, with_dequantized] :
       {std::pair{0xFF, true}, std::pair{0x00, true}, std::pair{0xFF, false}}) {
    const std::string problem =
        check_quantize_once(input, bf16_input, options, rotation, path, expected, poison, with_dequantized);
    if (!problem.empty()) return problem;
  }
  return "";
}

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
  const std::int64_t shapes[][2] = {{70, 130}, {3, 9000}, {1, 1}, {257, 33}};
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
                                   {core::element_kind::fp8_e4m3, core::rounding_mode::rtz, 32, 96, 5}};
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

// The fused one-pass quantizer (axis 1, block 32, rotation none / 16 / 32) on fp32 and bf16 inputs, and
// the generic path on the same inputs (bf16 widening and rotation through an fp32 copy).
// An sr case (mxfp4, blocks of 32 along rows, floor rule, 32 random bits) on the first of 64
// successive seeds whose input has what the case needs: build(options, input, state) fills `input`
// (from the seed's stream and the generator `state`) and returns the detail for the case's name,
// or std::nullopt where the seed fell short; check(options, input) is then the case. Where no seed
// does, the case fails saying `short_of`.
template <class Build, class Check>
void run_on_first_fitting_seed(const std::string& name, const std::string& short_of, std::int64_t rows,
                               std::int64_t cols, Build&& build, Check&& check) {
  std::uint64_t seed = next_seed();
  for (int attempt = 0; attempt < 64; ++attempt, ++seed) {
    const auto options = mx_options(0, 32, 1, core::rounding_mode::sr, core::scale_rule::floor, 32, seed + 1);
    matrix input(rows, cols);
    std::uint64_t state = seed + 3;
    const std::optional<std::string> detail = build(options, input, state);
    if (!detail) continue;
    run_case(name + " " + std::to_string(rows) + "x" + std::to_string(cols) + " (" + *detail + ")",
             [&] { return check(options, input); });
    return;
  }
  run_case(name, [&] { return short_of; });
}

void quantize_fused(bool small) {
  int index = 0;
  for (int format = 0; format < 6; ++format) {
    for (int rounding = 0; rounding < 4; ++rounding) {
      for (const int rotation_size : {0, 16, 32}) {
        for (const bool bf16 : {false, true}) {
          ++index;
          if (small && index % 29 != 1) continue;
          const std::uint64_t seed = next_seed();
          const value_kind kind = static_cast<value_kind>(index % test_inputs::value_kind_count);
          const std::int64_t rows = 19 + index % 7, cols = 32 * (3 + index % 4);
          const matrix input = test_inputs::make_matrix(rows, cols, kind, seed);
          const auto options =
              mx_options(format, 32, 1, static_cast<core::rounding_mode>(rounding),
                         static_cast<core::scale_rule>(index % 3), rounding == 3 && index % 3 == 0 ? 9 : 32, seed + 1);
          mxscope::rotation_options rotation;
          rotation.size = rotation_size;
          rotation.signs = static_cast<mxscope::sign_policy>(index % 3);
          rotation.seed = seed + 2;
          rotation.step = 7;
          rotation.layer_hash = 0x1234567U;
          const std::string name = std::string("quantize fused ") + format_names[format] + " " +
                                   rounding_names[rounding] + " H" + std::to_string(rotation_size) + " signs " +
                                   sign_names[static_cast<int>(rotation.signs)] + (bf16 ? " bf16" : " fp32") + " " +
                                   std::to_string(rows) + "x" + std::to_string(cols) + " " +
                                   std::string(test_inputs::value_kind_name(kind));
          run_case(name, [&] { return check_quantize(input, bf16, options, rotation, gpu::quantize_path::fused); });
          run_case(name + " (generic path)",
                   [&] { return check_quantize(input, bf16, options, rotation, gpu::quantize_path::generic); });
        }
      }
    }
  }
  // The fp4 rne and sr encoders, in the small set too: for rne the halfword one (bf16 without
  // rotation), for both the unscaled one (fp32, or after a rotation) and the scaled one (blocks
  // outside their exponent ranges, which the extreme inputs reach), on every input kind; odd row
  // counts, several tiles.
  for (const core::rounding_mode rounding : {core::rounding_mode::rne, core::rounding_mode::sr}) {
    for (int kind_index = 0; kind_index < test_inputs::value_kind_count; ++kind_index) {
      for (const int rotation_size : {0, 16}) {
        for (const bool bf16 : {true, false}) {
          ++index;
          const std::uint64_t seed = next_seed();
          const value_kind kind = static_cast<value_kind>(kind_index);
          const std::int64_t rows = 37, cols = 32 * (17 + index % 5);
          const matrix input = test_inputs::make_matrix(rows, cols, kind, seed);
          const auto options =
              mx_options(0, 32, 1, rounding, static_cast<core::scale_rule>(index % 3), 32, seed + 1);
          mxscope::rotation_options rotation;
          rotation.size = rotation_size;
          rotation.signs = rotation_size == 0 ? mxscope::sign_policy::none : mxscope::sign_policy::fixed;
          rotation.seed = seed + 2;
          const std::string name = std::string("quantize fused mxfp4 ") + rounding_names[static_cast<int>(rounding)] +
                                   " encoders H" + std::to_string(rotation_size) + (bf16 ? " bf16 " : " fp32 ") +
                                   std::to_string(rows) + "x" + std::to_string(cols) + " " +
                                   std::string(test_inputs::value_kind_name(kind));
          run_case(name, [&] { return check_quantize(input, bf16, options, rotation, gpu::quantize_path::fused); });
        }
      }
    }
  }
  // The lean path of folded H16 + sr (the floor rule, no rotation signs; check_quantize's run
  // without the dequantized output takes it, the others the general loop) on every input kind,
  // several tiles.
  for (int kind_index = 0; kind_index < test_inputs::value_kind_count; ++kind_index) {
    ++index;
    const std::uint64_t seed = next_seed();
    const value_kind kind = static_cast<value_kind>(kind_index);
    const std::int64_t rows = 37, cols = 32 * (17 + index % 5);
    const matrix input = test_inputs::make_matrix(rows, cols, kind, seed);
    const auto options = mx_options(0, 32, 1, core::rounding_mode::sr, core::scale_rule::floor, 32, seed + 1);
    mxscope::rotation_options rotation;
    rotation.size = 16;
    rotation.signs = mxscope::sign_policy::none;
    const std::string name = "quantize fused mxfp4 sr lean H16 bf16 " + std::to_string(rows) + "x" +
                             std::to_string(cols) + " " + std::string(test_inputs::value_kind_name(kind));
    run_case(name, [&] { return check_quantize(input, true, options, rotation, gpu::quantize_path::fused); });
  }
  // The sr encoder's undecided sums (fast_encode::fp4_stochastic_anchored_sum): fp32 blocks of exponent 0
  // (4.0 first, then 7.0, which saturates) where every element whose Philox word w has w >> 10 >= 2^22 - 2^13 (about 1 in
  // 512) is made (A 2^10 + B) 2^-33 with A = 2^22 - 1 - (w >> 10) and B in 1..1023: floor(F 2^22) =
  // A fills the sum's low 22 bits, and B + (w & 1023) >= 1024, which the fast sum cannot see,
  // decides. The kernel must take fp4_stochastic_unscaled for those blocks; both outcomes occur.
  {
    ++index;
    const std::uint64_t seed = next_seed();
    const std::int64_t rows = 16, cols = 32 * 96;
    auto options = mx_options(0, 32, 1, core::rounding_mode::sr, core::scale_rule::floor, 32, seed + 1);
    matrix input = test_inputs::make_matrix(rows, cols, value_kind::banded, seed);
    std::uint64_t state = seed + 3;
    int ups = 0, downs = 0;
    for (std::int64_t n = 0; n < input.size(); ++n) {
      float& v = input.values[static_cast<std::size_t>(n)];
      v = std::fmod(v, 4.0f);
      if (n % 32 < 2) {  // the grid's exponent 0 (the largest is in [4, 8)), and one saturated element
        v = n % 32 == 0 ? 4.0f : 7.0f;
        continue;
      }
      const std::uint32_t word = options.stream.word(static_cast<std::uint64_t>(n));
      if ((word >> 10) < 0x3fffffU - 0x1fffU) continue;
      const std::uint32_t a = 0x3fffffU - (word >> 10);
      const std::uint32_t b = 1U + static_cast<std::uint32_t>(split_mix(state) % 1023U);
      v = std::ldexp(static_cast<float>((a << 10) | b), -33) * (n % 2 == 0 ? 1.0f : -1.0f);
      (b + (word & 0x3ffU) >= 0x400U ? ups : downs) += 1;
    }
    mxscope::rotation_options none;
    run_case("quantize fused mxfp4 sr undecided sums fp32 " + std::to_string(rows) + "x" + std::to_string(cols),
             [&]() -> std::string {
               if (ups < 5 || downs < 5) {
                 return "the input has " + std::to_string(ups) + " undecided elements rounding up and " +
                        std::to_string(downs) + " rounding down, not 5 of each";
               }
               return check_quantize(input, false, options, none, gpu::quantize_path::fused);
             });
  }
  // The same on bf16 input, where a block whose least magnitude is at least 2^(e - 16) skips the
  // undecided check (encode_fused_block). Blocks of exponent 0 (4.0 first, 7.0 second), the other
  // elements random bf16 in [2^-16, 4), and where an element's Philox word w allows (W = w >> 10):
  //   A: W = 2^22 - 1 - 2^15 t (t < 128): 0.5 + t / 256 (F 2^22 = 2^15 t fills the sum's low bits);
  //   B: W = 2^22 - 1 - m (128 <= m < 256): m 2^-23, at 2^-16 and above;
  //   C: W = 2^22 - 1 - u (64 <= u < 128): (2 u + 1) 2^-24, below 2^-16: F 2^32 = (2 u + 1) 2^9,
  //      so (w & 1023) >= 512 rounds it up, which the sum's carry cannot see.
  // A and B sit in blocks that skip the check and must round down; a C block must take the check.
  // The seed is advanced until each kind occurs (and C both ways).
  ++index;
  run_on_first_fitting_seed(
      "quantize fused mxfp4 sr undecided sums bf16", "no seed gave every kind of element in 64 attempts", 96,
      32 * 128,
      [&](const mxscope::quantize_options& options, matrix& input, std::uint64_t& state) -> std::optional<std::string> {
        int a_kind = 0, b_kind = 0, c_up = 0, c_down = 0;
        for (std::int64_t n = 0; n < input.size(); ++n) {
          float& v = input.values[static_cast<std::size_t>(n)];
          const std::uint64_t r = split_mix(state);
          const float sign = (r & 1) != 0 ? -1.0f : 1.0f;
          if (n % 32 < 2) {
            v = sign * (n % 32 == 0 ? 4.0f : 7.0f);
            continue;
          }
          const std::uint32_t word = options.stream.word(static_cast<std::uint64_t>(n));
          const std::uint32_t rest = 0x3fffffU - (word >> 10);
          if (rest % 0x8000U == 0) {
            v = 0.5f + static_cast<float>(rest >> 15) / 256.0f;
            ++a_kind;
          } else if (rest >= 128 && rest < 256) {
            v = std::ldexp(static_cast<float>(rest), -23);
            ++b_kind;
          } else if (rest >= 64 && rest < 128) {
            v = std::ldexp(static_cast<float>(2 * rest + 1), -24);
            ((word & 0x3ffU) >= 0x200U ? c_up : c_down) += 1;
          } else {  // 2^(k - 7) (128 + f), -16 <= k <= 1
            const int k = -16 + static_cast<int>((r >> 1) % 18);
            v = std::ldexp(static_cast<float>(128 + ((r >> 8) & 0x7f)), k - 7);
          }
          v *= sign;
        }
        if (a_kind < 2 || b_kind < 2 || c_up < 1 || c_down < 1) return std::nullopt;
        return std::to_string(a_kind) + " + " + std::to_string(b_kind) + " carry-decided, " + std::to_string(c_up) +
               " up and " + std::to_string(c_down) + " down below 2^(e - 16)";
      },
      [&](const mxscope::quantize_options& options, const matrix& input) {
        return check_quantize(input, true, options, mxscope::rotation_options{}, gpu::quantize_path::fused);
      });
  // H16 on bf16 (signs none): a block whose least input magnitude has an exponent field of at least
  // e + 113 skips the undecided check (every rotated value, 4x as the kernel keeps it, is then a
  // multiple of 2^(e + 2 - 23), so F 2^32 has no bits below 2^10). Each block: elements 0..15 all
  // 2.0 but for a pair 2 p, 2 p + 1 of -2.0 (p = g mod 8; outputs 24, -+8 and 0: grid exponent e = 0, the kernel's
  // grid 2^2 for 4x the rotation; one negative input in each bf16 half of the words as read, so
  // that the kernel's least input magnitude must drop the signs it meets), elements
  // 16..31 all t except one t' (outputs 15 t + t' and +-(t' - t)). With t = m 2^-22 (m odd, 129..255:
  // exponent field 112 = e + 112, one below the skip) and t' - t = D 2^-22, an output k of the
  // second half has F 2^22 = D / 2 on the grid's spacing 2: D = 2 n + 1 with
  // n = 2^22 - 1 - (W >> 10) for that output's word W fills the sum's low 22 bits, and F 2^32 ends in
  // 512, so (W & 1023) >= 512 rounds it up, which the sum's carry cannot see: those blocks must take
  // the check (a threshold one binade lower fails the case). The other blocks get t = m 2^-21
  // (field 113: they skip the check; t' - t a multiple of 2^-21, so the carry decides exactly).
  // Only a t' = t + D 2^-22 of 8 significant bits is a bf16 number: blocks are taken where some
  // output's word allows one. The host checks each built output against the rotation itself.
  ++index;
  {
    std::string construction_error;
    mxscope::rotation_options h16;
    h16.size = 16;
    h16.signs = mxscope::sign_policy::none;
    run_on_first_fitting_seed(
        "quantize fused mxfp4 sr undecided sums H16 bf16", "no seed gave 3 undecided sums each way in 64 attempts",
        16, 32 * 128,
        [&](const mxscope::quantize_options& options, matrix& input,
            std::uint64_t& state) -> std::optional<std::string> {
          int ups = 0, downs = 0, skipped = 0;
          construction_error.clear();
          for (std::int64_t g = 0; g < input.size() / 32; ++g) {
            float* block = input.values.data() + g * 32;
            for (int i = 0; i < 16; ++i) block[i] = i / 2 == g % 8 ? -2.0f : 2.0f;
            // An output k (1..15) of the second half and an odd m whose t' has 8 significant bits.
            int found_k = -1;
            std::uint32_t found_m = 0, found_d = 0;
            for (int k = 1; k < 16 && found_k < 0; ++k) {
              const std::uint32_t word = options.stream.word(static_cast<std::uint64_t>(g * 32 + 16 + k));
              const std::uint32_t d = 2U * (0x3fffffU - (word >> 10)) + 1U;
              for (std::uint32_t m = 129; m < 256; m += 2) {
                std::uint32_t sum = m + d;
                while (sum % 2 == 0) sum /= 2;
                if (sum < 256) {
                  found_k = k;
                  found_m = m;
                  found_d = d;
                  break;
                }
              }
            }
            const std::uint64_t r = split_mix(state);
            const int j = 1 + static_cast<int>(r % 15);  // where t' sits in the second half
            if (found_k >= 0) {
              const float t = std::ldexp(static_cast<float>(found_m), -22);
              for (int i = 16; i < 32; ++i) block[i] = t;
              block[16 + j] = std::ldexp(static_cast<float>(found_m + found_d), -22);
              // The rotation as the core does it: output found_k must be +-D 2^-22, 4x as the kernel
              // keeps it, and its sum undecided.
              float rotated[16];
              std::copy(block + 16, block + 32, rotated);
              core::rotate_segment(rotated, 16, nullptr);
              const double kept = std::fabs(4.0 * static_cast<double>(rotated[found_k]));
              const std::uint32_t word = options.stream.word(static_cast<std::uint64_t>(g * 32 + 16 + found_k));
              const double units = std::ldexp(kept, 22 - 1);  // F 2^22 on the grid spacing 2 (kept < 2)
              if (kept >= 2.0 || std::floor(units) + static_cast<double>(word >> 10) != 4194303.0 ||
                  units == std::floor(units)) {
                construction_error = "block " + std::to_string(g) + ": output " + std::to_string(found_k) +
                                     " is not an undecided sum";
              }
              ((word & 0x3ffU) >= 0x200U ? ups : downs) += 1;
            } else {
              const std::uint32_t m = 129U + 2U * static_cast<std::uint32_t>((r >> 8) % 64);
              const float t = std::ldexp(static_cast<float>(m), -21);
              for (int i = 16; i < 32; ++i) block[i] = t;
              const int binade = -21 + static_cast<int>((r >> 30) % 8);
              block[16 + j] = std::ldexp(static_cast<float>(128 + ((r >> 20) & 0x7f)), binade);
              ++skipped;
            }
            for (int i = 0; i < 32; ++i) {
              if (test_inputs::from_bf16_bits(test_inputs::to_bf16_bits(block[i])) != block[i]) {
                construction_error =
                    "block " + std::to_string(g) + " element " + std::to_string(i) + " is not a bf16 number";
              }
            }
          }
          if ((ups < 3 || downs < 3 || skipped < 16) && construction_error.empty()) return std::nullopt;
          return std::to_string(ups) + " up and " + std::to_string(downs) + " down one binade below the skip, " +
                 std::to_string(skipped) + " skipping blocks";
        },
        [&](const mxscope::quantize_options& options, const matrix& input) {
          if (!construction_error.empty()) return construction_error;
          return check_quantize(input, true, options, h16, gpu::quantize_path::fused);
        });
  }
  // sr blocks on both sides of the fp32 saturation flags' range (grid exponent -105) and of the
  // anchored sum's (grid exponent 23; fast_encode::fp4_stochastic_anchored_covers): outside them
  // the kernel encodes the block through fused_block_again. Block b of a row holds values of about
  // 2^(top - b) (top -98, resp. 30), one of them 7/4 of the block's largest power of two (saturated
  // without rotation), one six 2^e and one an fp32 step above it (saturated in fp32), bf16 and fp32
  // input, without rotation and with H16 (whose grid exponent is the block's + 2).
  for (const int top_block : {-98, 30})
  for (const int rotation_size : {0, 16}) {
    for (const bool bf16 : {true, false}) {
      ++index;
      const std::uint64_t seed = next_seed();
      const std::int64_t rows = 4, cols = 32 * 16;
      matrix input(rows, cols);
      std::uint64_t state = seed + 3;
      for (std::int64_t n = 0; n < input.size(); ++n) {
        const int top = top_block - static_cast<int>((n % cols) / 32);
        const std::uint64_t r = split_mix(state);
        float v = std::ldexp(static_cast<float>(128 + (r & 0x7f)) / 128.0f, -static_cast<int>((r >> 8) % 12));
        if (n % 32 == 0) v = 7.0f;
        if (n % 32 == 1) v = 6.0f;                        // six itself: not saturated
        if (n % 32 == 2) v = std::nextafter(6.0f, 7.0f);  // one fp32 step above (bf16 rounds it to six)
        input.values[static_cast<std::size_t>(n)] = std::ldexp(v, top) * ((r >> 20) % 2 != 0 ? -1.0f : 1.0f);
      }
      const auto options = mx_options(0, 32, 1, core::rounding_mode::sr, core::scale_rule::floor, 32, seed + 1);
      mxscope::rotation_options rotation;
      rotation.size = rotation_size;
      run_case(std::string("quantize fused mxfp4 sr ") +
                   (top_block < 0 ? "saturation flags' exponent edge H" : "anchor's exponent edge H") +
                   std::to_string(rotation_size) +
                   (bf16 ? " bf16" : " fp32"),
               [&] { return check_quantize(input, bf16, options, rotation, gpu::quantize_path::fused); });
    }
  }
  // Several tiles: the fused kernel takes 256 MX blocks per thread block; 37 x 1824 has 2109 blocks,
  // 8 full tiles and a partial one. mxfp4 (its own encoders) and mxfp8, rne and sr.
  for (const int format : {0, 3}) {
    for (const int rounding : {0, 3}) {
      ++index;
      if (small && (format == 0) != (rounding == 0)) continue;  // small: mxfp4 rne, mxfp8 sr
      const std::uint64_t seed = next_seed();
      const value_kind kind = static_cast<value_kind>(index % test_inputs::value_kind_count);
      const matrix input = test_inputs::make_matrix(37, 1824, kind, seed);
      const auto options = mx_options(format, 32, 1, static_cast<core::rounding_mode>(rounding),
                                      static_cast<core::scale_rule>(index % 3), 32, seed + 1);
      mxscope::rotation_options rotation;
      rotation.size = format == 0 ? 16 : 0;
      rotation.signs = mxscope::sign_policy::per_step;
      rotation.seed = seed + 2;
      const std::string name = std::string("quantize fused ") + format_names[format] + " " + rounding_names[rounding] +
                               " H" + std::to_string(rotation.size) + " bf16 37x1824 (9 tiles) " +
                               std::string(test_inputs::value_kind_name(kind));
      run_case(name, [&] { return check_quantize(input, true, options, rotation, gpu::quantize_path::fused); });
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
  for (const int size : {2, 16, 128, 1024, 4096}) {
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

// ------------------------------------------------------------------------------------------------
// GEMMs.

std::string model_name(const mxscope::accumulation_model& model) {
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

mxscope::accumulation_model model_of(mxscope::accumulation_kind kind, int group = 1) {
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

device_operand upload_operand(const mxscope::quantized_tensor& q) {
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
gemm_output gpu_product(const mxscope::quantized_tensor& qa, const mxscope::quantized_tensor& qb,
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
std::string check_product_entries(const mxscope::quantized_tensor& qa, const mxscope::quantized_tensor& qb,
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
std::pair<mxscope::quantized_tensor, mxscope::quantized_tensor> make_operands(
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

void gemm_sweep(bool small) {
  struct format_pair {
    int a;
    int b;
  };
  // {4, 3}: e5m2 x e4m3, the per-tensor fp8 hybrid as the GPU multiplies it (unit block scales).
  const format_pair pairs[] = {{0, 0}, {1, 1}, {2, 2}, {3, 3}, {4, 4}, {5, 5}, {0, 3}, {1, 5}, {0, 5}, {4, 3}};
  const mxscope::accumulation_model models[] = {
      model_of(mxscope::accumulation_kind::fp32_block), model_of(mxscope::accumulation_kind::fp32_group, 2),
      model_of(mxscope::accumulation_kind::fp32_group, 5), model_of(mxscope::accumulation_kind::exact),
      model_of(mxscope::accumulation_kind::fp32_seq)};
  int index = 0;
  for (const format_pair& pair : pairs) {
    for (const auto& model : models) {
      for (const gemm_layout_case& layout : gemm_layouts) {
        ++index;
        if (small && index % 41 != 1) continue;
        const std::uint64_t seed = next_seed();
        const int block = index % 9 == 0 ? 16 : (index % 13 == 0 ? 64 : 32);
        const value_kind kind = static_cast<value_kind>(index % test_inputs::value_kind_count);
        const std::int64_t m = 37 + index % 3, n = 29 + index % 4, k = 70 + 32 * (index % 3);
        const auto output = index % 7 == 0 ? mxscope::output_rounding::bf16 : mxscope::output_rounding::fp32;
        const auto [qa, qb] = make_operands(m, n, k, pair.a, pair.b, block, layout, kind, seed,
                                            index % 4 == 0 ? core::rounding_mode::sr : core::rounding_mode::rne);
        for (const gpu::gemm_path path :
             {gpu::gemm_path::generic, gpu::gemm_path::integer, gpu::gemm_path::tensor_core,
              gpu::gemm_path::native_mfma}) {
          if (!gpu::gemm_path_covers(path, qa.options.format.element, qb.options.format.element, block, model))
            continue;
          const std::string policy = std::string("A ") + format_names[pair.a] + " axis " +
                                     std::to_string(layout.a_axis) + ", B " + format_names[pair.b] + " axis " +
                                     std::to_string(layout.b_axis) + ", block " + std::to_string(block) + ", model " +
                                     model_name(model) + ", output " +
                                     (output == mxscope::output_rounding::bf16 ? "bf16" : "fp32") + ", path " +
                                     std::string(gpu::gemm_path_name(path)) + ", seed " + hex64(seed);
          const std::string name = std::string("gemm ") + layout.name + " " + format_names[pair.a] + "x" +
                                   format_names[pair.b] + " " + model_name(model) + " " +
                                   std::string(gpu::gemm_path_name(path)) + " M" + std::to_string(m) + " N" +
                                   std::to_string(n) + " K" + std::to_string(k) + " block " + std::to_string(block) +
                                   " " + std::string(test_inputs::value_kind_name(kind));
          run_case(name, [&] {
            const gemm_output got = gpu_product(qa, qb, model, output, path);
            return check_product_entries(qa, qb, model, output, got, {}, policy);
          });
        }
      }
    }
  }
}

// Edge shapes: a single entry, K = 1, K below one block, M and N just past a tensor-core tile.
void gemm_edges(bool small) {
  struct edge {
    std::int64_t m, n, k;
    bool in_small_set;
  };
  const edge edges[] = {{1, 1, 1, true},       {1, 1, 33, true},   {3, 2, 31, true},
                        {130, 200, 96, false}, {129, 1, 64, true}, {17, 131, 250, false}};
  for (const edge& e : edges) {
    if (small && !e.in_small_set) continue;
    for (const auto& model :
         {model_of(mxscope::accumulation_kind::fp32_block), model_of(mxscope::accumulation_kind::exact),
          model_of(mxscope::accumulation_kind::fp32_group, 4)}) {
      const std::uint64_t seed = next_seed();
      const auto [qa, qb] = make_operands(e.m, e.n, e.k, 0, 0, 32, gemm_layouts[2], value_kind::banded, seed);
      for (const gpu::gemm_path path :
           {gpu::gemm_path::generic, gpu::gemm_path::integer, gpu::gemm_path::tensor_core,
            gpu::gemm_path::native_mfma}) {
        if (!gpu::gemm_path_covers(path, qa.options.format.element, qb.options.format.element, 32, model)) continue;
        const std::string name = "gemm edge wgrad mxfp4 " + model_name(model) + " " +
                                 std::string(gpu::gemm_path_name(path)) + " M" + std::to_string(e.m) + " N" +
                                 std::to_string(e.n) + " K" + std::to_string(e.k);
        run_case(name, [&] {
          const gemm_output got = gpu_product(qa, qb, model, mxscope::output_rounding::fp32, path);
          return check_product_entries(qa, qb, model, mxscope::output_rounding::fp32, got, {},
                                       name + ", seed " + hex64(seed));
        });
      }
    }
  }
  // The host convenience function on the automatic path.
  const std::uint64_t seed = next_seed();
  const auto [qa, qb] = make_operands(45, 38, 160, 0, 0, 32, gemm_layouts[0], value_kind::extreme, seed);
  run_case("gemm host api gpu::emulate_product mxfp4 fp32-block automatic", [&]() -> std::string {
    const auto model = model_of(mxscope::accumulation_kind::fp32_block);
    const mxscope::product_result result = gpu::emulate_product(qa, qb, model);
    gemm_output got{result.out, matrix64()};
    std::string problem =
        check_product_entries(qa, qb, model, mxscope::output_rounding::fp32, got, {}, "seed " + hex64(seed));
    if (!problem.empty()) return problem;
    // The same product left in device memory.
    const mxscope::product_result kept =
        gpu::emulate_product(qa, qb, model, mxscope::output_rounding::fp32, gpu::gemm_path::automatic, true);
    if (!kept.out.values.empty() || !kept.device_out || kept.device_exact) {
      return std::string("keep_on_device: the result is not (only) in device memory");
    }
    const gemm_output kept_out{kept.device_out->download32(), matrix64()};
    return check_product_entries(qa, qb, model, mxscope::output_rounding::fp32, kept_out, {},
                                 "keep_on_device, seed " + hex64(seed));
  });
  run_case("gemm host api gpu::emulate_product mxfp4 fp32-block from codes in device memory", [&]() -> std::string {
    const auto model = model_of(mxscope::accumulation_kind::fp32_block);
    // Device copies of the codes and scales, and host vectors emptied: the product must read them there.
    mxscope::quantized_tensor da = qa, db = qb;
    for (auto* q : {&da, &db}) {
      auto codes = std::make_shared<gpu::device_buffer>(q->codes.size());
      auto scales = std::make_shared<gpu::device_buffer>(q->scales.size());
      codes->upload(q->codes.data(), q->codes.size());
      scales->upload(q->scales.data(), q->scales.size());
      q->device_codes = codes;
      q->device_scales = scales;
      q->codes.clear();
      q->scales.clear();
    }
    const mxscope::product_result result = gpu::emulate_product(da, db, model);
    const gemm_output got{result.out, matrix64()};
    return check_product_entries(qa, qb, model, mxscope::output_rounding::fp32, got, {}, "seed " + hex64(seed));
  });
  run_case("gemm host api gpu::emulate_product mxfp4 exact automatic keep_on_device", [&]() -> std::string {
    const auto model = model_of(mxscope::accumulation_kind::exact);
    const mxscope::product_result kept =
        gpu::emulate_product(qa, qb, model, mxscope::output_rounding::fp32, gpu::gemm_path::automatic, true);
    if (!kept.out.values.empty() || !kept.exact.values.empty() || !kept.device_out || !kept.device_exact) {
      return std::string("keep_on_device: the result is not (only) in device memory");
    }
    const gemm_output got{kept.device_out->download32(), kept.device_exact->download64()};
    return check_product_entries(qa, qb, model, mxscope::output_rounding::fp32, got, {}, "seed " + hex64(seed));
  });
}

// The integer path over several of its 64 x 64 tiles with tails in M, N and K (K not a multiple of
// the block): fp8 e4m3 (block dots summed in fp64) and e3m2 x fp4 (in int32), each model, with
// extreme values (block dots many binades apart: the running sums of fp32-group and exact round, so
// those entries take the fix-up kernel) and NaN blocks.
void gemm_integer_tiles(bool small) {
  struct format_pair {
    int a;
    int b;
  };
  const format_pair pairs[] = {{3, 3}, {2, 0}};
  const mxscope::accumulation_model models[] = {model_of(mxscope::accumulation_kind::fp32_block),
                                                model_of(mxscope::accumulation_kind::fp32_group, 3),
                                                model_of(mxscope::accumulation_kind::exact)};
  const value_kind kinds[] = {value_kind::extreme, value_kind::nonfinite, value_kind::ties};
  int index = 0;
  for (const format_pair& pair : pairs) {
    for (const auto& model : models) {
      for (const value_kind kind : kinds) {
        ++index;
        if (small && pair.a != 3 && kind != value_kind::extreme) continue;
        const std::uint64_t seed = next_seed();
        const std::int64_t m = 70, n = 133, k = 100 + 3 * (index % 2);
        const auto output = index % 5 == 0 ? mxscope::output_rounding::bf16 : mxscope::output_rounding::fp32;
        const auto [qa, qb] = make_operands(m, n, k, pair.a, pair.b, 32, gemm_layouts[index % 3], kind, seed);
        if (!gpu::gemm_path_covers(gpu::gemm_path::integer, qa.options.format.element, qb.options.format.element, 32,
                                   model)) {
          run_case("gemm integer tiles: path coverage", [&] {
            return std::string("the integer path does not cover ") + format_names[pair.a] + " x " +
                   format_names[pair.b] + " " + model_name(model);
          });
          continue;
        }
        const std::string name = std::string("gemm integer tiles ") + format_names[pair.a] + "x" +
                                 format_names[pair.b] + " " + model_name(model) + " M" + std::to_string(m) + " N" +
                                 std::to_string(n) + " K" + std::to_string(k) + " " +
                                 std::string(test_inputs::value_kind_name(kind));
        run_case(name, [&] {
          const gemm_output got = gpu_product(qa, qb, model, output, gpu::gemm_path::integer);
          return check_product_entries(qa, qb, model, output, got, {}, name + ", seed " + hex64(seed));
        });
      }
    }
  }
  // Block scales constant along K in every row, different between rows (per-tensor scaling is the
  // case of one scale): `exact` takes the whole-K dot (integer_mode::whole); then the same with one
  // block's scale changed, which sends the product back to the per-block kernel. Both against the
  // host definition.
  for (const bool one_differs : {false, true}) {
    for (const auto& layout : gemm_layouts) {
      const std::uint64_t seed = next_seed();
      const std::int64_t m = 70, n = 133, k = 100 + (one_differs ? 28 : 0);
      auto [qa, qb] = make_operands(m, n, k, 3, 3, 32, layout, value_kind::banded, seed);
      for (auto* q : {&qa, &qb}) {
        const bool along_rows = q->options.axis == 1;
        const std::int64_t lines = along_rows ? q->rows : q->cols;
        const std::int64_t blocks = static_cast<std::int64_t>(q->scales.size()) / lines;
        for (std::int64_t line = 0; line < lines; ++line) {
          for (std::int64_t b = 0; b < blocks; ++b) {
            const std::int64_t at = along_rows ? line * blocks + b : b * lines + line;
            q->scales[at] = static_cast<std::uint8_t>(120 + (line * 7 + 3) % 15);
          }
        }
      }
      if (one_differs) qb.scales[qb.scales.size() / 2] = static_cast<std::uint8_t>(qb.scales[qb.scales.size() / 2] + 1);
      const auto model = model_of(mxscope::accumulation_kind::exact);
      const std::string name = std::string("gemm integer tiles e4m3 exact, scales constant along K") +
                               (one_differs ? " but one " : " ") + layout.name;
      run_case(name, [&] {
        const gemm_output got = gpu_product(qa, qb, model, mxscope::output_rounding::fp32, gpu::gemm_path::integer);
        return check_product_entries(qa, qb, model, mxscope::output_rounding::fp32, got, {},
                                     name + ", seed " + hex64(seed));
      });
    }
  }
}

// Per-tensor fp8 operands on the GPU: the element codes multiplied as MX operands with unit block
// scales and kept in device memory, then gpu::apply_tensor_scales. Expected: the same product
// brought to the host (checked against the host definition by the sweep above) with the tensor
// scales applied by the host compiler's build of the shared rounding (core/tensor_scale.hpp, which
// tests/test_gemm.cpp checks against Boost.Multiprecision).
void tensor_scale_checks(bool small) {
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

// Runs body(suffix, kernel) once per tensor-core kernel of the fp32-block model that this build and
// device have (mma_sync everywhere the path exists; wgmma, wgmma_bf16 and wgmma_fp8 on sm_90 with
// an sm_90a build), with that kernel selected; the suffix names it. Leaves the automatic choice selected.
template <class Body>
void for_each_tensor_core_kernel(Body&& body) {
  for (const gpu::tensor_core_kernel kernel :
       {gpu::tensor_core_kernel::mma_sync, gpu::tensor_core_kernel::wgmma, gpu::tensor_core_kernel::wgmma_bf16,
        gpu::tensor_core_kernel::wgmma_fp8}) {
    if (!gpu::tensor_core_kernel_available(kernel)) continue;
    gpu::select_tensor_core_kernel(kernel);
    body(" [" + std::string(gpu::tensor_core_kernel_name(kernel)) + "]", kernel);
  }
  gpu::select_tensor_core_kernel(gpu::tensor_core_kernel::automatic);
}

// A 32-element block of an operand (canonical row, K-block b) as the scaled kernels' conditions see
// it: a NaN block, one holding a nonzero element, and its exponent.
struct block_facts {
  bool nan = false;
  bool nonzero = false;
  int exponent = 0;
};
block_facts facts_of(const host_reference::operand_reader& x, std::int64_t row, std::int64_t b) {
  block_facts facts;
  const std::uint8_t code = x.scale(row, 32 * b);
  facts.nan = code == core::scale_nan_code;
  facts.exponent = facts.nan ? 0 : core::scale_exponent(code);
  for (std::int64_t k = 32 * b; k < std::min<std::int64_t>(32 * b + 32, x.depth); ++k) {
    facts.nonzero = facts.nonzero || core::decode(x.q->options.format.element, x.code(row, k)) != 0.0;
  }
  return facts;
}

// Whether the wgmma_bf16 kernel should run a product of these operands (include/mxscope/gpu.hpp),
// from the host quantizer's codes and scales: MXFP4 on both sides, no NaN block, and over the
// blocks with a nonzero element, exponents in [-125, 125] whose lowest add up to at least -124 and
// highest to at most 117.
bool scaled_kernel_expected(const mxscope::quantized_tensor& qa, const mxscope::quantized_tensor& qb) {
  if (qa.options.format.element != core::element_kind::fp4_e2m1 ||
      qb.options.format.element != core::element_kind::fp4_e2m1) {
    return false;
  }
  struct span {
    int lowest = 1000, highest = -1000;
    bool nan = false;
  };
  const auto span_of = [](const mxscope::quantized_tensor& q) {
    const host_reference::operand_reader x(q);
    span out;
    for (std::int64_t row = 0; row < x.rows; ++row) {
      for (std::int64_t b = 0; 32 * b < x.depth; ++b) {
        const block_facts block = facts_of(x, row, b);
        out.nan = out.nan || block.nan;
        if (block.nan || !block.nonzero) continue;
        out.lowest = std::min(out.lowest, block.exponent);
        out.highest = std::max(out.highest, block.exponent);
      }
    }
    return out;
  };
  const span a = span_of(qa), b = span_of(qb);
  if (a.nan || b.nan) return false;
  for (const span& x : {a, b}) {
    if (x.lowest <= x.highest && (x.lowest < -125 || x.highest > 125)) return false;
  }
  if (a.lowest > a.highest || b.lowest > b.highest) return true;
  return a.lowest + b.lowest >= -124 && a.highest + b.highest <= 117;
}

// Whether no 128-row tile of the operand spans more than 28 exponents over its blocks with a nonzero
// element in any K-block (wgmma_fp8's condition on each operand, on top of wgmma_bf16's).
bool tiles_within_fp8_window(const mxscope::quantized_tensor& q) {
  const host_reference::operand_reader x(q);
  for (std::int64_t tile = 0; tile < x.rows; tile += 128) {
    for (std::int64_t b = 0; 32 * b < x.depth; ++b) {
      int lowest = 1000, highest = -1000;
      for (std::int64_t row = tile; row < std::min<std::int64_t>(tile + 128, x.rows); ++row) {
        const block_facts block = facts_of(x, row, b);
        if (block.nan || !block.nonzero) continue;
        lowest = std::min(lowest, block.exponent);
        highest = std::max(highest, block.exponent);
      }
      if (highest - lowest > 28) return false;
    }
  }
  return true;
}

// "" when the kernel that ran the last product is the one `selected` should have run for qa, qb.
std::string check_kernel_ran(gpu::tensor_core_kernel selected, const mxscope::quantized_tensor& qa,
                             const mxscope::quantized_tensor& qb) {
  gpu::tensor_core_kernel expected = selected;
  if (selected == gpu::tensor_core_kernel::wgmma_fp8 &&
      !(scaled_kernel_expected(qa, qb) && tiles_within_fp8_window(qa) && tiles_within_fp8_window(qb))) {
    expected = gpu::tensor_core_kernel::wgmma_bf16;
  }
  if (expected == gpu::tensor_core_kernel::wgmma_bf16 && !scaled_kernel_expected(qa, qb)) {
    expected = gpu::tensor_core_kernel::mma_sync;
  }
  const gpu::tensor_core_kernel ran = gpu::last_tensor_core_kernel();
  if (ran == expected) return "";
  return "kernel " + std::string(gpu::tensor_core_kernel_name(ran)) + " ran, expected " +
         std::string(gpu::tensor_core_kernel_name(expected));
}

// The tensor-core fp32-block kernels' tiles (mma_sync: 128 x 256 entries of C per thread block,
// wgmma: 128 x 128; both launched in groups of 8 row tiles; block scales checked per 128-row
// tile): partial tiles in M, N and K, a partial group, and operands whose tiles take the fast step
// in some K-blocks and the general step in others. In "mixed" operands some blocks have exponents outside the fast range (tiny and
// huge blocks) and one holds a NaN, each confined to one tile and one K-block; in "far" operands
// every block is in the fast range but the products overflow or fall into the fp32 subnormals.
// Every entry against the host definition.
void gemm_tensor_core_tiles(bool small) {
  struct tile_case {
    int a_format, b_format;
    std::int64_t m, n, k;
    int layout;
    bool in_small_set;
  };
  const tile_case cases[] = {{0, 0, 150, 270, 100, 0, true},
                             {1, 1, 129, 257, 64, 1, false},
                             {5, 5, 131, 300, 40, 2, false},
                             {0, 5, 260, 130, 130, 0, true},
                             {0, 0, 1030, 300, 40, 1, false}};  // two groups of row tiles in the launch order
  const auto model = model_of(mxscope::accumulation_kind::fp32_block);
  const auto exact_model = model_of(mxscope::accumulation_kind::exact);
  for (const tile_case& c : cases) {
    if (small && !c.in_small_set) continue;
    if (!gpu::gemm_path_covers(gpu::gemm_path::tensor_core, format_kinds[c.a_format], format_kinds[c.b_format], 32,
                               model)) {
      continue;
    }
    const gemm_layout_case& layout = gemm_layouts[c.layout];
    for (const char* pattern :
         {"banded", "mixed", "far", "edges", "edges outside", "window", "window outside", "full blocks"}) {
      const bool mixed = std::string(pattern) == "mixed";
      const bool far = std::string(pattern) == "far";
      const bool edges = std::string(pattern).rfind("edges", 0) == 0;
      const bool window = std::string(pattern).rfind("window", 0) == 0;
      const bool full = std::string(pattern) == "full blocks";
      if ((edges || window || full) && (c.a_format != 0 || c.b_format != 0)) continue;
      const std::uint64_t seed = next_seed();
      // Logical A [m, k] and B [n, k], then stored along their layout's axes.
      matrix a = test_inputs::make_matrix(c.m, c.k, value_kind::banded, seed);
      matrix b = test_inputs::make_matrix(c.n, c.k, value_kind::banded, seed + 1);
      if (mixed) {
        const auto scale_block = [](matrix& x, std::int64_t row, std::int64_t k_block, int exponent) {
          for (std::int64_t k = 32 * k_block; k < std::min<std::int64_t>(32 * (k_block + 1), x.cols); ++k) {
            x(row, k) = static_cast<float>(std::ldexp(static_cast<double>(x(row, k)), exponent));
          }
        };
        scale_block(a, c.m - 1, 0, -140);        // the last A tile, K-block 0: a tiny block
        scale_block(a, 5, (c.k - 1) / 32, 118);  // the first A tile, the last K-block: a huge block
        scale_block(b, c.n - 2, 1 % ((c.k + 31) / 32), -135);
        scale_block(b, std::min<std::int64_t>(c.n - 1, 130), 0, 121);  // the second half of the first B tile
        a(std::min<std::int64_t>(c.m - 1, 140), std::min<std::int64_t>(c.k - 1, 40)) =
            std::numeric_limits<float>::quiet_NaN();  // a NaN block
      }
      if (far) {
        // Every block inside the fast range, their products not: entries that overflow to inf
        // (2^95 * 2^40) and entries in the fp32 subnormal range (2^-95 * 2^-40).
        for (std::int64_t r = 0; r < a.rows; ++r) {
          const int exponent = r % 2 == 0 ? 95 : -95;
          for (std::int64_t q = 0; q < a.cols; ++q) a(r, q) = std::ldexp(a(r, q), exponent);
        }
        for (std::int64_t r = 0; r < b.rows; ++r) {
          const int exponent = r % 3 == 0 ? 40 : (r % 3 == 1 ? -40 : 0);
          for (std::int64_t q = 0; q < b.cols; ++q) b(r, q) = std::ldexp(b(r, q), exponent);
        }
      }
      const auto pin = [](matrix& x, int even_exponent, int odd_exponent) {
        for (std::int64_t r = 0; r < x.rows; ++r) {
          const int exponent = r % 2 == 0 ? even_exponent : odd_exponent;
          for (std::int64_t q = 0; q < x.cols; ++q) {
            const float v = q % 32 == 0 ? 6.0f : std::clamp(x(r, q), -5.9f, 5.9f);
            x(r, q) = std::ldexp(v, exponent);
          }
        }
      };
      if (window) {
        // The wgmma_fp8 kernel's window: rows alternating between two block exponents 28 apart
        // (A at -20 and 8, B at -5 and 23), so each tile's elements take every e5m2 exponent from
        // the least subnormal up; "window outside" puts A's 29 apart (wgmma_bf16 runs instead).
        pin(a, -20, std::string(pattern) == "window outside" ? 9 : 8);
        pin(b, -5, 23);
      }
      if (full) {
        // Block dots with the most significant bits: 31 products 6 x 6 and one 0.5 x 0.5 (1116.25,
        // thirteen bits), or two 0.5 x 6 where the 0.5 elements sit apart; B's odd rows negative.
        for (std::int64_t r = 0; r < a.rows; ++r) {
          for (std::int64_t q = 0; q < a.cols; ++q) a(r, q) = q % 32 == r % 32 ? 0.5f : 6.0f;
        }
        for (std::int64_t r = 0; r < b.rows; ++r) {
          for (std::int64_t q = 0; q < b.cols; ++q) b(r, q) = (q % 32 == r % 32 ? 0.5f : 6.0f) * (r % 2 == 0 ? 1 : -1);
        }
      }
      if (edges) {
        // The limits of the wgmma_bf16 kernel's range: every block's largest element 6 2^e, rows of
        // A at e = -125 and 60, rows of B at 1 and 57 (lowest sum -124, highest 117: inside, with
        // block dots from 2^-126 up to 1152 2^117 and entries that overflow), or, for "edges
        // outside", B at 0 and 57 (lowest sum -125: outside, so mma_sync runs instead).
        const bool outside = std::string(pattern) == "edges outside";
        pin(a, -125, 60);
        pin(b, outside ? 0 : 1, 57);
      }
      const auto transpose = [](const matrix& x) {
        matrix t(x.cols, x.rows);
        for (std::int64_t r = 0; r < x.rows; ++r) {
          for (std::int64_t q = 0; q < x.cols; ++q) t(q, r) = x(r, q);
        }
        return t;
      };
      const auto a_options =
          mx_options(c.a_format, 32, layout.a_axis, core::rounding_mode::rne, core::scale_rule::floor, 32, seed + 2);
      const auto b_options =
          mx_options(c.b_format, 32, layout.b_axis, core::rounding_mode::rne, core::scale_rule::floor, 32, seed + 3);
      const auto qa = host_reference::quantize_mx(layout.a_axis == 1 ? a : transpose(a), a_options);
      const auto qb = host_reference::quantize_mx(layout.b_axis == 1 ? b : transpose(b), b_options);
      const auto output = c.m % 2 == 1 ? mxscope::output_rounding::bf16 : mxscope::output_rounding::fp32;
      const std::string name = std::string("gemm tensor-core tiles ") + layout.name + " " + format_names[c.a_format] +
                               "x" + format_names[c.b_format] + " fp32-block M" + std::to_string(c.m) + " N" +
                               std::to_string(c.n) + " K" + std::to_string(c.k) + " " + pattern +
                               (output == mxscope::output_rounding::bf16 ? " bf16 output" : "");
      for_each_tensor_core_kernel([&](const std::string& kernel, gpu::tensor_core_kernel selected) {
        run_case(name + kernel, [&] {
          const gemm_output got = gpu_product(qa, qb, model, output, gpu::gemm_path::tensor_core);
          const std::string ran = check_kernel_ran(selected, qa, qb);
          if (!ran.empty()) return ran;
          return check_product_entries(qa, qb, model, output, got, {}, name + kernel + ", seed " + hex64(seed));
        });
      });
      // The exact model on the same operands: tiles whose rows' block exponents stay in a window
      // take the check-free FMA step, the tiles holding the mixed pattern's extreme and NaN blocks
      // the checked one (and its fix-up).
      const std::string exact_name = name + " (exact model)";
      run_case(exact_name, [&] {
        const gemm_output got = gpu_product(qa, qb, exact_model, output, gpu::gemm_path::tensor_core);
        return check_product_entries(qa, qb, exact_model, output, got, {}, exact_name + ", seed " + hex64(seed));
      });
    }
  }
}

// The scaled kernels' operand forms (gpu::scaled_forms) against the same tiles built here from the
// host quantizer's codes and scales: every element of both forms (padding included), every base
// exponent, and the range flags. Runs wherever the forms are made: on the GPU with the scaled
// kernels, and in the CPU simulation (so CI checks the layout, the e5m2 encoding and the bases).
void gemm_scaled_forms(bool small) {
  struct form_case {
    std::int64_t rows, k;
    int axis;
    const char* pattern;
    bool in_small_set;
  };
  const form_case cases[] = {{130, 200, 1, "banded", true},       {257, 100, 0, "window", true},
                             {70, 330, 1, "extreme", true},       {129, 64, 1, "nonfinite", false},
                             {3, 31, 0, "window outside", true},  {300, 450, 1, "window", false}};
  // e5m2 code of each exactly representable value (the finite codes; +0 for zero).
  std::map<double, std::uint8_t> e5m2_codes;
  for (int c = 0; c < 256; ++c) {
    const int biased = (c >> 2) & 31;
    if (biased == 31 || c == 0x80) continue;
    const double magnitude =
        biased == 0 ? (c & 3) * std::ldexp(1.0, -16) : (1.0 + (c & 3) / 4.0) * std::ldexp(1.0, biased - 15);
    e5m2_codes[(c & 0x80) != 0 ? -magnitude : magnitude] = static_cast<std::uint8_t>(c);
  }
  for (const form_case& c : cases) {
    if (small && !c.in_small_set) continue;
    const std::uint64_t seed = next_seed();
    const std::string pattern = c.pattern;
    const bool window = pattern.rfind("window", 0) == 0;
    matrix x = test_inputs::make_matrix(c.rows, c.k,
                                        pattern == "extreme"     ? value_kind::extreme
                                        : pattern == "nonfinite" ? value_kind::nonfinite
                                                                 : value_kind::banded,
                                        seed);
    if (window) {  // rows alternating between block exponents -20 and 8 (9 outside: 29 apart)
      for (std::int64_t r = 0; r < x.rows; ++r) {
        const int exponent = r % 2 == 0 ? -20 : (pattern == "window outside" ? 9 : 8);
        for (std::int64_t q = 0; q < x.cols; ++q) {
          x(r, q) = std::ldexp(q % 32 == 0 ? 6.0f : std::clamp(x(r, q), -5.9f, 5.9f), exponent);
        }
      }
    }
    matrix stored = x;
    if (c.axis == 0) {
      stored = matrix(x.cols, x.rows);
      for (std::int64_t r = 0; r < x.rows; ++r) {
        for (std::int64_t q = 0; q < x.cols; ++q) stored(q, r) = x(r, q);
      }
    }
    const auto options = mx_options(0, 32, c.axis, core::rounding_mode::rne, core::scale_rule::floor, 32, seed + 1);
    const auto quantized = host_reference::quantize_mx(stored, options);
    const std::string name = "gemm scaled operand forms mxfp4 " + pattern + " rows " + std::to_string(c.rows) + " K " +
                             std::to_string(c.k) + " axis " + std::to_string(c.axis);
    run_case(name, [&]() -> std::string {
      const device_operand operand = upload_operand(quantized);
      const gpu::prepared_operand prepared = gpu::prepare_operand(operand.view, gpu::gemm_path::tensor_core);
      const gpu::scaled_operand_forms forms = gpu::scaled_forms(prepared);
      if (!forms.made) return "the forms were not made";
      const host_reference::operand_reader reader(quantized);
      const std::int64_t rows = reader.rows, depth = reader.depth, blocks = (depth + 31) / 32;
      const std::int64_t tiles = (rows + 255) / 256 * 2, bf16_chunks = (blocks + 1) / 2, k_tiles = (blocks + 3) / 4;
      std::vector<std::uint16_t> bf16(static_cast<std::size_t>(tiles * bf16_chunks * 8192), 0);
      std::vector<std::uint8_t> fp8(static_cast<std::size_t>(tiles * k_tiles * 16384), 0);
      std::vector<std::int32_t> bases(static_cast<std::size_t>(tiles * k_tiles * 4), 0);
      int lowest = 1000, highest = -1000;
      bool nan_block = false, fits = true;
      // Per tile and K-block: the base.
      for (std::int64_t tile = 0; tile * 128 < rows; ++tile) {
        for (std::int64_t b = 0; b < blocks; ++b) {
          int lo = 1000, hi = -1000;
          for (std::int64_t row = 128 * tile; row < std::min(rows, 128 * tile + 128); ++row) {
            const block_facts block = facts_of(reader, row, b);
            if (block.nan) {
              nan_block = true;
              fits = false;
            } else if (block.nonzero) {
              lo = std::min(lo, block.exponent);
              hi = std::max(hi, block.exponent);
            }
          }
          if (lo <= hi) {
            fits = fits && hi - lo <= 28;
            bases[static_cast<std::size_t>((tile * k_tiles + b / 4) * 4 + b % 4)] =
                std::min(std::max(0, hi - 13), lo + 15);
            lowest = std::min(lowest, lo);
            highest = std::max(highest, hi);
          }
        }
      }
      for (std::int64_t row = 0; row < rows; ++row) {
        const std::int64_t tile = row / 128, r = row % 128;
        for (std::int64_t k = 0; k < depth; ++k) {
          const std::int64_t b = k / 32;
          const double v = core::decode(core::element_kind::fp4_e2m1, reader.code(row, k));
          const std::uint8_t scale = reader.scale(row, k);
          if (scale == core::scale_nan_code || v == 0.0) continue;
          const int e = core::scale_exponent(scale);
          if (e >= -125 && e <= 125) {
            const float value = static_cast<float>(std::ldexp(v, e));
            std::uint32_t bits;
            std::memcpy(&bits, &value, 4);
            const std::int64_t chunk = (k % 64) / 8;
            const std::int64_t byte = (tile * bf16_chunks + k / 64) * 16384 + r * 128 + ((chunk ^ (r & 7)) << 4);
            bf16[static_cast<std::size_t>(byte / 2 + k % 8)] = static_cast<std::uint16_t>(bits >> 16);
          }
          const int shift = e - bases[static_cast<std::size_t>((tile * k_tiles + b / 4) * 4 + b % 4)];
          if (shift >= -15 && shift <= 13) {
            const auto found = e5m2_codes.find(std::ldexp(v, shift));
            if (found == e5m2_codes.end()) {
              return "element (" + std::to_string(row) + ", " + std::to_string(k) + ") " +
                     show(std::ldexp(v, shift)) + " is no e5m2 number";
            }
            const std::int64_t chunk = (k % 128) / 16;
            const std::int64_t byte = (tile * k_tiles + k / 128) * 16384 + r * 128 + ((chunk ^ (r & 7)) << 4);
            fp8[static_cast<std::size_t>(byte + k % 16)] = found->second;
          }
        }
      }
      const std::string where = ", seed " + hex64(seed);
      if (forms.bf16.size() != bf16.size() || forms.fp8.size() != fp8.size() ||
          forms.fp8_bases.size() != bases.size()) {
        return "sizes differ: bf16 " + std::to_string(forms.bf16.size()) + " / " + std::to_string(bf16.size()) +
               ", fp8 " + std::to_string(forms.fp8.size()) + " / " + std::to_string(fp8.size()) + ", bases " +
               std::to_string(forms.fp8_bases.size()) + " / " + std::to_string(bases.size()) + where;
      }
      for (std::size_t i = 0; i < bf16.size(); ++i) {
        if (forms.bf16[i] != bf16[i]) {
          return "bf16 element " + std::to_string(i) + ": " + hex32(forms.bf16[i]) + ", expected " + hex32(bf16[i]) +
                 where;
        }
      }
      for (std::size_t i = 0; i < bases.size(); ++i) {
        if (forms.fp8_bases[i] != bases[i]) {
          return "base " + std::to_string(i) + ": " + std::to_string(forms.fp8_bases[i]) + ", expected " +
                 std::to_string(bases[i]) + where;
        }
      }
      for (std::size_t i = 0; i < fp8.size(); ++i) {
        if (forms.fp8[i] != fp8[i]) {
          return "fp8 byte " + std::to_string(i) + ": " + hex32(forms.fp8[i]) + ", expected " + hex32(fp8[i]) + where;
        }
      }
      if (forms.lowest != lowest || forms.highest != highest || forms.nan_block != nan_block ||
          forms.fp8_fits != fits) {
        return "flags: lowest " + std::to_string(forms.lowest) + " / " + std::to_string(lowest) + ", highest " +
               std::to_string(forms.highest) + " / " + std::to_string(highest) + ", NaN block " +
               std::to_string(forms.nan_block) + " / " + std::to_string(nan_block) + ", fp8 fits " +
               std::to_string(forms.fp8_fits) + " / " + std::to_string(fits) + where;
      }
      return "";
    });
  }
}

// 2048 x 2048 x 4096 wgrad (dy and x quantized along K on the GPU, checked against the host
// quantizer in full), then the products: tensor-core and integer paths equal in every entry, and
// sampled entries equal to the host definition.
void gemm_large() {
  const std::int64_t m = 2048, n = 2048, k = 4096;
  const std::uint64_t seed = next_seed();
  const matrix dy = test_inputs::make_matrix(k, m, value_kind::banded, seed);
  const matrix x = test_inputs::make_matrix(k, n, value_kind::banded, seed + 1);
  const auto dy_options = mx_options(0, 32, 0, core::rounding_mode::sr, core::scale_rule::floor, 32, seed + 2);
  const auto x_options = mx_options(0, 32, 0, core::rounding_mode::rne, core::scale_rule::floor, 32, seed + 3);
  mxscope::quantized_tensor qa, qb;
  bool quantized = true;
  run_case("gemm large: quantize dy [4096, 2048] mxfp4 sr axis 0 on the GPU", [&]() -> std::string {
    qa = gpu::quantize(dy, dy_options);
    const auto expected = host_reference::quantize_mx(dy, dy_options);
    if (qa.codes != expected.codes || qa.scales != expected.scales) {
      quantized = false;
      return "codes or scales differ from the host quantizer; " + describe(dy_options, {});
    }
    return "";
  });
  run_case("gemm large: quantize x [4096, 2048] mxfp4 rne axis 0 on the GPU", [&]() -> std::string {
    qb = gpu::quantize(x, x_options);
    const auto expected = host_reference::quantize_mx(x, x_options);
    if (qb.codes != expected.codes || qb.scales != expected.scales) {
      quantized = false;
      return "codes or scales differ from the host quantizer; " + describe(x_options, {});
    }
    return "";
  });
  if (!quantized) return;
  std::mt19937_64 random(seed + 4);
  std::vector<std::pair<std::int64_t, std::int64_t>> samples = {
      {0, 0}, {0, n - 1}, {m - 1, 0}, {m - 1, n - 1}, {127, 128}};
  for (int s = 0; s < 1000; ++s)
    samples.emplace_back(static_cast<std::int64_t>(random() % m), static_cast<std::int64_t>(random() % n));
  const auto block_model = model_of(mxscope::accumulation_kind::fp32_block);
  gemm_output integer_result;
  bool have_integer = false;
  run_case("gemm large wgrad mxfp4 fp32-block integer 2048x2048 K4096 (1005 sampled entries vs host)", [&] {
    integer_result = gpu_product(qa, qb, block_model, mxscope::output_rounding::fp32, gpu::gemm_path::integer);
    have_integer = true;
    return check_product_entries(qa, qb, block_model, mxscope::output_rounding::fp32, integer_result, samples,
                                 "seed " + hex64(seed));
  });
  if (gpu::gemm_path_covers(gpu::gemm_path::tensor_core, core::element_kind::fp4_e2m1, core::element_kind::fp4_e2m1, 32,
                            block_model)) {
    for_each_tensor_core_kernel([&](const std::string& kernel, gpu::tensor_core_kernel selected) {
      run_case(
          "gemm large wgrad mxfp4 fp32-block tensor_core 2048x2048 K4096 (every entry vs integer path, samples vs host)" +
              kernel,
          [&]() -> std::string {
            const gemm_output got =
                gpu_product(qa, qb, block_model, mxscope::output_rounding::fp32, gpu::gemm_path::tensor_core);
            const std::string ran = check_kernel_ran(selected, qa, qb);
            if (!ran.empty()) return ran;
            if (have_integer) {
              for (std::int64_t i = 0; i < m * n; ++i) {
                if (!same(integer_result.out.values[static_cast<std::size_t>(i)],
                          got.out.values[static_cast<std::size_t>(i)])) {
                  return "entry (" + std::to_string(i / n) + ", " + std::to_string(i % n) + "): integer path " +
                         show(integer_result.out.values[static_cast<std::size_t>(i)]) + ", tensor-core path " +
                         show(got.out.values[static_cast<std::size_t>(i)]);
                }
              }
            }
            return check_product_entries(qa, qb, block_model, mxscope::output_rounding::fp32, got, samples,
                                         "seed " + hex64(seed));
          });
    });
  }
  std::vector<std::pair<std::int64_t, std::int64_t>> few(samples.begin(), samples.begin() + 200);
  for (const auto& model :
       {model_of(mxscope::accumulation_kind::fp32_group, 4), model_of(mxscope::accumulation_kind::exact)}) {
    run_case(
        "gemm large wgrad mxfp4 " + model_name(model) + " integer 2048x2048 K4096 (200 sampled entries vs host)", [&] {
          const gemm_output got = gpu_product(qa, qb, model, mxscope::output_rounding::fp32, gpu::gemm_path::integer);
          return check_product_entries(qa, qb, model, mxscope::output_rounding::fp32, got, few, "seed " + hex64(seed));
        });
  }
}

// ------------------------------------------------------------------------------------------------
// Reference GEMM and metrics.

// The device reference of A and B (outputs poisoned with 0xFF first) against the definition, entry
// by entry, and the host convenience function against the same.
std::string check_reference(const matrix& a, const matrix& b, const std::string& replay) {
  const std::int64_t m = a.rows, n = b.rows, k = a.cols;
  gpu::device_buffer left(a.values.size() * 4), right(b.values.size() * 4);
  left.upload(a.data(), left.bytes());
  right.upload(b.data(), right.bytes());
  gpu::device_buffer out64(static_cast<std::size_t>(m * n) * 8), out32(static_cast<std::size_t>(m * n) * 4);
  out64.fill_bytes(0xFF);
  out32.fill_bytes(0xFF);
  gpu::reference_on_device(left.as<const float>(), right.as<const float>(), m, n, k, out64.as<double>(),
                           out32.as<float>());
  gpu::synchronize();
  matrix64 got64(m, n);
  matrix got32(m, n);
  out64.download(got64.data(), out64.bytes());
  out32.download(got32.data(), out32.bytes());
  std::vector<host_reference::reference_value> expected(static_cast<std::size_t>(m * n));
  host_reference::parallel_for(m, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t i = first; i < last; ++i) {
      for (std::int64_t j = 0; j < n; ++j)
        expected[static_cast<std::size_t>(i * n + j)] = host_reference::reference_entry(a, b, i, j);
    }
  });
  for (std::int64_t e = 0; e < m * n; ++e) {
    const auto& want = expected[static_cast<std::size_t>(e)];
    if (!same(want.fp64, got64.values[static_cast<std::size_t>(e)]) ||
        !same(want.fp32, got32.values[static_cast<std::size_t>(e)])) {
      return "entry (" + std::to_string(e / n) + ", " + std::to_string(e % n) + "): expected fp64 " +
             show(want.fp64) + " fp32 " + show(want.fp32) + ", got fp64 " +
             show(got64.values[static_cast<std::size_t>(e)]) + " fp32 " +
             show(got32.values[static_cast<std::size_t>(e)]) + "; " + replay;
    }
  }
  const mxscope::reference_result api = gpu::reference_gemm(a, b);
  for (std::int64_t e = 0; e < m * n; ++e) {
    if (!same(expected[static_cast<std::size_t>(e)].fp64, api.fp64.values[static_cast<std::size_t>(e)]) ||
        !same(expected[static_cast<std::size_t>(e)].fp32, api.fp32.values[static_cast<std::size_t>(e)])) {
      return "gpu::reference_gemm entry " + std::to_string(e) + " differs; " + replay;
    }
  }
  // The bound the CPU reports for `exact`: the largest half ulp of a finite nonzero result.
  double bound = 0.0;
  for (const auto& entry : expected) {
    const double magnitude = std::fabs(entry.fp64);
    if (magnitude == 0.0 || !std::isfinite(magnitude)) continue;
    int exponent = 0;
    (void)std::frexp(magnitude, &exponent);  // magnitude in [2^(exponent-1), 2^exponent)
    bound = std::max(bound, magnitude < 0x1p-1021 ? 0x1p-1074 : std::ldexp(1.0, exponent - 1 - 53));
  }
  // The same result left in device memory.
  const mxscope::reference_result kept = gpu::reference_gemm(a, b, true);
  if (!kept.fp64.values.empty() || !kept.fp32.values.empty() || !kept.device_fp64 || !kept.device_fp32) {
    return "gpu::reference_gemm(keep_on_device): the result is not (only) in device memory; " + replay;
  }
  const matrix64 kept64 = kept.device_fp64->download64();
  const matrix kept32 = kept.device_fp32->download32();
  if (kept64.rows != m || kept64.cols != n || kept32.rows != m || kept32.cols != n) {
    return "gpu::reference_gemm(keep_on_device): wrong shape; " + replay;
  }
  for (std::int64_t e = 0; e < m * n; ++e) {
    if (!same(expected[static_cast<std::size_t>(e)].fp64, kept64.values[static_cast<std::size_t>(e)]) ||
        !same(expected[static_cast<std::size_t>(e)].fp32, kept32.values[static_cast<std::size_t>(e)])) {
      return "gpu::reference_gemm(keep_on_device) entry " + std::to_string(e) + " differs; " + replay;
    }
  }
  // Entries in a row of A or of B that holds inf or NaN are the non-finite ones.
  const auto bad_rows = [](const matrix& x) {
    std::int64_t count = 0;
    for (std::int64_t r = 0; r < x.rows; ++r) {
      bool bad = false;
      for (std::int64_t c = 0; c < x.cols; ++c) bad = bad || !std::isfinite(x(r, c));
      count += bad;
    }
    return count;
  };
  const std::int64_t bad_a = bad_rows(a), bad_b = bad_rows(b);
  const std::int64_t nonfinite = bad_a * n + bad_b * m - bad_a * bad_b;
  for (const auto& [what, got] : {std::pair{"", &api}, std::pair{" (keep_on_device)", &kept}}) {
    if (got->stats.entries != m * n || got->stats.nonfinite_entries != nonfinite ||
        got->stats.certified_entries != m * n - nonfinite) {
      return std::string("gpu::reference_gemm") + what + " stats: expected " + std::to_string(nonfinite) +
             " non-finite of " + std::to_string(m * n) + ", got " + std::to_string(got->stats.nonfinite_entries) +
             " of " + std::to_string(got->stats.entries) + "; " + replay;
    }
  }
  for (const auto& [what, got] : {std::pair{"", api.error_bound}, std::pair{" (keep_on_device)", kept.error_bound}}) {
    if (!same(bound, got)) {
      return std::string("gpu::reference_gemm") + what + " error_bound: expected " + show(bound) + " got " +
             show(got) + "; " + replay;
    }
  }
  return "";
}

void reference_checks(bool small) {
  struct shape {
    std::int64_t m, n, k;
  };
  const shape shapes[] = {{1, 1, 1}, {3, 5, 2}, {37, 29, 70}, {96, 80, 1000}, {256, 192, 1500}};
  int index = 0;
  for (const shape& s : shapes) {
    for (int kind = 0; kind < test_inputs::value_kind_count; ++kind) {
      ++index;
      if (small && s.m > 40) continue;
      const std::uint64_t seed = next_seed();
      matrix a = test_inputs::make_matrix(s.m, s.k, static_cast<value_kind>(kind), seed);
      matrix b = test_inputs::make_matrix(s.n, s.k, static_cast<value_kind>(kind), seed + 1);
      if (static_cast<value_kind>(kind) == value_kind::ties && s.k >= 2 && s.m >= 1 && s.n >= 1) {
        // Exact ties: 1 + 2^-24 (fp32 tie), 1 + 2^-53 (fp64 tie), and a cancellation to 2^-149.
        a(0, 0) = 1.0f;
        a(0, 1) = 0x1p-24f;
        b(0, 0) = 1.0f;
        b(0, 1) = 1.0f;
        for (std::int64_t kk = 2; kk < s.k; ++kk) a(0, kk) = 0.0f;
      }
      const std::string name = "reference exact M" + std::to_string(s.m) + " N" + std::to_string(s.n) + " K" +
                               std::to_string(s.k) + " " +
                               std::string(test_inputs::value_kind_name(static_cast<value_kind>(kind)));
      run_case(name, [&] { return check_reference(a, b, "seed " + hex64(seed)); });
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Unscaled operands (fp32, bf16 values): the tiled kernels that sum each K-chunk of 32 products in
// fp64 where that is exact, and their fallbacks, against the definitions.

struct plain_input {
  std::string name;
  matrix a, b;
};

// Inputs for every branch: bf16 chunks whose products sum exactly in fp64 (narrow); chunks too wide
// for that (wide bf16, fp32 significands) in rows that still fit the 128-bit window of an entry;
// and, mixed into one product with narrow rows, a row that does not fit that window, a row of
// zeros, one wide chunk in a narrow row, NaN and infinity (the per-product kernels).
std::vector<plain_input> plain_inputs(std::int64_t m, std::int64_t n, std::int64_t k, std::uint64_t seed) {
  std::vector<plain_input> out;
  out.push_back({"bf16 narrow", test_inputs::make_bf16_matrix(m, k, 2, seed),
                 test_inputs::make_bf16_matrix(n, k, 2, seed + 1)});
  out.push_back({"bf16 wide", test_inputs::make_bf16_matrix(m, k, 24, seed + 2),
                 test_inputs::make_bf16_matrix(n, k, 24, seed + 3)});
  out.push_back({"fp32 banded", test_inputs::make_matrix(m, k, value_kind::banded, seed + 4),
                 test_inputs::make_matrix(n, k, value_kind::banded, seed + 5)});
  plain_input mixed{"bf16 mixed rows", test_inputs::make_bf16_matrix(m, k, 3, seed + 6),
                    test_inputs::make_bf16_matrix(n, k, 3, seed + 7)};
  if (k >= 2) {
    mixed.a(0, 0) = 0x1p100f;  // row 0 of A spans 2^-120 .. 2^100: beyond the window
    mixed.a(0, k - 1) = 0x1p-120f;
  }
  if (m >= 3) {
    for (std::int64_t c = 0; c < k; ++c) mixed.a(1, c) = 0.0f;
    mixed.a(2, k / 2) *= 0x1p40f;  // one chunk of row 2 too wide for fp64, the row within the window
  }
  if (n >= 2) mixed.b(n - 1, k / 3) = std::numeric_limits<float>::quiet_NaN();
  if (n >= 3) mixed.b(n / 2, k - 1) = -std::numeric_limits<float>::infinity();
  out.push_back(std::move(mixed));
  out.push_back({"extreme", test_inputs::make_matrix(m, k, value_kind::extreme, seed + 8),
                 test_inputs::make_matrix(n, k, value_kind::extreme, seed + 9)});
  return out;
}

// plain_product_on_device into a poisoned buffer against host_reference::plain_product_entry.
std::string check_plain_product(const plain_input& in, int block, const mxscope::accumulation_model& model,
                                mxscope::output_rounding output, const std::string& replay) {
  const std::int64_t m = in.a.rows, n = in.b.rows, k = in.a.cols;
  gpu::device_buffer left(in.a.values.size() * 4), right(in.b.values.size() * 4);
  left.upload(in.a.data(), left.bytes());
  right.upload(in.b.data(), right.bytes());
  gpu::device_buffer out(static_cast<std::size_t>(m * n) * 4);
  out.fill_bytes(0xFF);
  gpu::plain_product_on_device(left.as<const float>(), right.as<const float>(), m, n, k, block, model, output,
                               out.as<float>());
  matrix got(m, n);
  out.download(got.data(), out.bytes());
  std::vector<float> expected(static_cast<std::size_t>(m * n));
  host_reference::parallel_for(m, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t i = first; i < last; ++i) {
      for (std::int64_t j = 0; j < n; ++j) {
        expected[static_cast<std::size_t>(i * n + j)] =
            host_reference::plain_product_entry(in.a, in.b, i, j, block, model, output);
      }
    }
  });
  for (std::int64_t e = 0; e < m * n; ++e) {
    if (!same(expected[static_cast<std::size_t>(e)], got.values[static_cast<std::size_t>(e)])) {
      return "entry (" + std::to_string(e / n) + ", " + std::to_string(e % n) + "): expected " +
             show(expected[static_cast<std::size_t>(e)]) + " got " + show(got.values[static_cast<std::size_t>(e)]) +
             "; " + replay;
    }
  }
  return "";
}

// The leading and lowest set-bit exponents of the nonzero values x(row, first .. first + length - 1)
// (finite, normal fp32), and their difference, the spread the reference's budgets read.
struct exponent_range {
  int high = -100000, low = 100000;
  int spread() const { return high - low; }
};

exponent_range row_exponents(const matrix& x, std::int64_t row, std::int64_t first, std::int64_t length) {
  exponent_range out;
  for (std::int64_t c = first; c < std::min(x.cols, first + length); ++c) {
    const float v = x(row, c);
    if (v == 0.0f) continue;
    int e = 0;
    std::frexp(v, &e);
    const auto significand = static_cast<std::uint32_t>(std::ldexp(std::fabs(v), 24 - e));  // 24 bits
    out.high = std::max(out.high, e - 1);
    out.low = std::min(out.low, e - 24 + __builtin_ctz(significand));
  }
  return out;
}

void plain_checks(bool small) {
  struct shape {
    std::int64_t m, n, k;
  };
  // Odd sizes, K below, at and past multiples of 32, tiles of 64 x 64 cut at both edges.
  const shape shapes[] = {{1, 1, 1}, {3, 5, 31}, {37, 29, 70}, {67, 65, 97}, {130, 70, 300}, {200, 150, 1030}};
  struct model_case {
    const char* name;
    int block;
    mxscope::accumulation_model model;
  };
  const model_case models[] = {
      {"fp32-block", 32, model_of(mxscope::accumulation_kind::fp32_block)},
      {"fp32-group:2", 32, model_of(mxscope::accumulation_kind::fp32_group, 2)},
      {"fp32-group:3", 32, model_of(mxscope::accumulation_kind::fp32_group, 3)},
      {"fp32-block block 64", 64, model_of(mxscope::accumulation_kind::fp32_block)},
      {"fp32-block block 16", 16, model_of(mxscope::accumulation_kind::fp32_block)},
      {"fp32-seq", 32, model_of(mxscope::accumulation_kind::fp32_seq)},
  };
  int index = 0;
  for (const shape& s : shapes) {
    if (small && s.m > 70) continue;
    const std::uint64_t seed = next_seed();
    const std::vector<plain_input> inputs = plain_inputs(s.m, s.n, s.k, seed);
    const std::string dims = " M" + std::to_string(s.m) + " N" + std::to_string(s.n) + " K" + std::to_string(s.k);
    for (const plain_input& in : inputs) {
      run_case("plain reference" + dims + " " + in.name,
               [&] { return check_reference(in.a, in.b, "seed " + hex64(seed)); });
      for (const model_case& mc : models) {
        ++index;
        const auto output = index % 4 == 0 ? mxscope::output_rounding::bf16 : mxscope::output_rounding::fp32;
        run_case("plain " + std::string(mc.name) + dims + " " + in.name +
                     (output == mxscope::output_rounding::bf16 ? " bf16 out" : ""),
                 [&] { return check_plain_product(in, mc.block, mc.model, output, "seed " + hex64(seed)); });
      }
    }
  }
  // The exact mode's super-chunks (8 chunks of 32): rows whose spread over a super-chunk is too wide
  // for one fp64 dot of 256 products but whose chunks are not, beside rows that fit, several
  // super-chunks and a partial last one.
  run_case("plain reference super-chunks M70 N67 K600", []() -> std::string {
    const std::uint64_t seed = next_seed();
    const std::int64_t m = 70, n = 67, k = 600;
    plain_input in{"super-chunks", test_inputs::make_bf16_matrix(m, k, 1, seed),
                   test_inputs::make_bf16_matrix(n, k, 1, seed + 1)};
    // Random rows: one element 2^-12 smaller in chunk 8 s + 1 of odd rows of A, in chunk 8 s + 5 of
    // odd rows of B (which paths they take depends on the draw).
    for (std::int64_t chunk = 0; 32 * chunk < k; ++chunk) {
      for (std::int64_t i = 5; i < m && chunk % 8 == 1; i += 2) in.a(i, 32 * chunk + 5) *= 0x1p-12f;
      for (std::int64_t j = 5; j < n && chunk % 8 == 5 && 32 * chunk + 9 < k; j += 2) in.b(j, 32 * chunk + 9) *= 0x1p-12f;
    }
    // Rows 2 and 3 reach each path whatever the draw: 1.5 throughout (spread 1), so entry (2, 2)
    // is fused in every super-chunk; row 3 of A has one value 2^-30 smaller in chunk 8 s + 1 and
    // row 3 of B in chunk 8 s + 5 (spreads 31), so entry (3, 3) steps per chunk in super-chunks 0
    // and 1 (31 + 31 > 43 over each, at most 31 + 1 in any chunk).
    for (std::int64_t c = 0; c < k; ++c) in.a(2, c) = in.b(2, c) = in.a(3, c) = in.b(3, c) = 1.5f;
    for (std::int64_t chunk = 0; 32 * chunk < k; ++chunk) {
      if (chunk % 8 == 1) in.a(3, 32 * chunk + 7) = 0x1.8p-30f;
      if (chunk % 8 == 5 && 32 * chunk + 11 < k) in.b(3, 32 * chunk + 11) = 0x1.8p-30f;
    }
    // Rows where a budget one bit too large would round: B row 0 is 255/128 (8 significant bits,
    // spread 7) throughout. A row 0 holds 255/128 in super-chunk 1 (k 256-511) but one value 2^-30
    // smaller (k 300: spreads 37 + 7 = 44, one past 51 - 8; 255 products of 3.97 and one of
    // 2^-30 3.97 need 54 bits), and the same values negated in super-chunk 0 without the small one,
    // so that the exact entry is that one product. Row 1 likewise within chunks: chunk 2 (k 64-95)
    // with one value 2^-33 smaller (k 70: spreads 40 + 7 = 47, one past 51 - 5; 54 bits), chunk 0
    // negated without it.
    constexpr float full = 255.0f / 128.0f;
    for (std::int64_t c = 0; c < k; ++c) {
      in.b(0, c) = full;
      in.a(0, c) = c < 256 ? -full : c < 512 ? full : 0.0f;
      in.a(1, c) = c < 32 ? -full : c >= 64 && c < 96 ? full : 0.0f;
    }
    in.a(0, 300) = full * 0x1p-30f;
    in.a(0, 300 - 256) = 0.0f;
    in.a(1, 70) = full * 0x1p-33f;
    in.a(1, 70 - 64) = 0.0f;
    // Rows 2 and 3 must reach both paths: fused (spreads over 256 products within 51 - 8) and per
    // chunk (not, but every chunk within 51 - 5).
    const auto spread = [](const matrix& x, std::int64_t row, std::int64_t first, std::int64_t length) {
      return row_exponents(x, row, first, length).spread();
    };
    bool fused = true, per_chunk = true;
    for (std::int64_t super = 0; 256 * super < k; ++super) {
      fused = fused && spread(in.a, 2, 256 * super, 256) + spread(in.b, 2, 256 * super, 256) <= 43;
      if (super >= 2) continue;
      per_chunk = per_chunk && spread(in.a, 3, 256 * super, 256) + spread(in.b, 3, 256 * super, 256) > 43;
      for (std::int64_t c = 256 * super; c < 256 * super + 256; c += 32) {
        per_chunk = per_chunk && spread(in.a, 3, c, 32) + spread(in.b, 3, c, 32) <= 46;
      }
    }
    if (!fused || !per_chunk) return std::string("the input does not reach both super-chunk paths");
    if (spread(in.a, 0, 256, 256) + spread(in.b, 0, 256, 256) != 44 || spread(in.a, 1, 64, 32) + spread(in.b, 0, 64, 32) != 47) {
      return std::string("the budget rows do not have the spreads they are built for");
    }
    return check_reference(in.a, in.b, "seed " + hex64(seed));
  });
  // The 128-bit sums at the edges of their window (the steps' conversion of a dot into units of
  // 2^(lo_a + lo_b), done by fp64 halves on CUDA): entries (0, 0) and (1, 1) use the whole window
  // (spans 60 + 54 + 2 + depth bits = 126) with fused dots of 2^120 units in super-chunk 0 that
  // chunk 16 (per-chunk steps: super-chunk 2 spans 60 binades) cancels exactly, so the result is
  // the small rest from the window's bottom; entries (2, 2) and (3, 3) have a fused dot whose bits
  // straddle 2^64 units (high and low halves both nonzero). Each pair once positive, once negative.
  run_case("plain reference window edges M70 N67 K600", []() -> std::string {
    const std::uint64_t seed = next_seed();
    const std::int64_t m = 70, n = 67, k = 600;
    plain_input in{"window edges", test_inputs::make_bf16_matrix(m, k, 1, seed),
                   test_inputs::make_bf16_matrix(n, k, 1, seed + 1)};
    for (std::int64_t r = 0; r < 4; ++r) {
      const float s = r % 2 == 0 ? 1.0f : -1.0f;
      for (std::int64_t c = 0; c < k; ++c) {
        if (r < 2) {
          in.a(r, c) = c < 256   ? -s * 0x1.8p60f
                       : c < 512 ? s * 0x1.8p5f
                       : c < 544 ? s * 0x1.8p63f
                       : c < 576 ? -s * 0x1.4p5f
                                 : 0.0f;
          in.b(r, c) = c < 256 ? 0x1.8p30f : c < 512 ? 0x1.8p-23f : c < 544 ? 0x1.8p30f : c < 576 ? 0x1.8p-23f : 0.0f;
        } else {
          in.a(r, c) = c < 256 ? s * 0x1.000002p40f : 0x1.8p20f;
          in.b(r, c) = c < 256 ? 0x1.8p30f : 0x1.8p-10f;
        }
      }
    }
    const auto whole = [&](const matrix& x, std::int64_t row) { return row_exponents(x, row, 0, k); };
    const int depth_bits = 10;  // bit length of K = 600
    for (std::int64_t r = 0; r < 2; ++r) {
      if (whole(in.a, r).spread() + whole(in.b, r).spread() + 2 + depth_bits != 126) {
        return std::string("rows 0 and 1 do not fill the 126-bit window");
      }
      for (std::int64_t super = 0; super < 2; ++super) {
        if (row_exponents(in.a, r, 256 * super, 256).spread() + row_exponents(in.b, r, 256 * super, 256).spread() > 43) {
          return std::string("rows 0 and 1 are not fused in super-chunks 0 and 1");
        }
      }
      if (row_exponents(in.a, r, 512, 88).spread() + row_exponents(in.b, r, 512, 88).spread() <= 43 ||
          row_exponents(in.a, r, 512, 32).spread() + row_exponents(in.b, r, 512, 32).spread() > 46 ||
          row_exponents(in.a, r, 544, 32).spread() + row_exponents(in.b, r, 544, 32).spread() > 46) {
        return std::string("rows 0 and 1 do not step per chunk in super-chunk 2");
      }
    }
    for (std::int64_t r = 2; r < 4; ++r) {
      // The super-chunk 0 dot, 256 (1 + 2^-23) 2^40 1.5 2^30, in units of 2^(lo_a + lo_b):
      // bits from 2^(78 + 1 - base) down to 2^(54 - base).
      const int base = whole(in.a, r).low + whole(in.b, r).low;
      if (row_exponents(in.a, r, 0, 256).spread() + row_exponents(in.b, r, 0, 256).spread() > 43 ||
          !(54 - base < 64 && 78 - base >= 64)) {
        return std::string("rows 2 and 3 do not straddle the sums' halves");
      }
    }
    return check_reference(in.a, in.b, "seed " + hex64(seed));
  });
  // The host convenience function runs the same device code.
  const std::uint64_t seed = next_seed();
  const std::vector<plain_input> inputs = plain_inputs(21, 19, 45, seed);
  run_case("plain gpu::emulate_plain_product M21 N19 K45", [&]() -> std::string {
    const auto model = model_of(mxscope::accumulation_kind::fp32_block);
    for (const plain_input& in : inputs) {
      const mxscope::product_result got = gpu::emulate_plain_product(in.a, in.b, 32, model);
      // The same from device memory, B given transposed and turned back there, the result kept.
      matrix b_transposed(in.b.cols, in.b.rows);
      for (std::int64_t i = 0; i < in.b.rows; ++i) {
        for (std::int64_t k = 0; k < in.b.cols; ++k) b_transposed(k, i) = in.b(i, k);
      }
      const gpu::device_matrix b_back = gpu::transposed(gpu::device_matrix::upload(b_transposed));
      const mxscope::product_result kept =
          gpu::emulate_plain_product(gpu::device_matrix::upload(in.a), b_back, 32, model,
                                     mxscope::output_rounding::fp32, true);
      if (!kept.device_out || !kept.out.values.empty()) return in.name + ": the kept result is not in device memory";
      const matrix kept_out = kept.device_out->download32();
      for (std::int64_t i = 0; i < in.a.rows; ++i) {
        for (std::int64_t j = 0; j < in.b.rows; ++j) {
          const float want =
              host_reference::plain_product_entry(in.a, in.b, i, j, 32, model, mxscope::output_rounding::fp32);
          if (!same(want, got.out(i, j)) || !same(want, kept_out(i, j))) {
            return in.name + " entry (" + std::to_string(i) + ", " + std::to_string(j) + "): expected " + show(want) +
                   " got " + show(got.out(i, j)) + " and from device memory " + show(kept_out(i, j)) + "; seed " +
                   hex64(seed);
          }
        }
      }
    }
    return "";
  });
  // gpu::same_bits: equal bits, one flipped bit (also -0 against +0), other shapes and types.
  run_case("plain gpu::same_bits", []() -> std::string {
    matrix values(37, 41);
    for (std::int64_t i = 0; i < values.size(); ++i) values.values[static_cast<std::size_t>(i)] = 0.25f * static_cast<float>(i % 97) - 3.0f;
    const gpu::device_matrix x = gpu::device_matrix::upload(values);
    if (!gpu::same_bits(x, gpu::device_matrix::upload(values))) return std::string("equal matrices reported different");
    matrix changed = values;
    changed.values[1234] = std::nextafter(changed.values[1234], 100.0f);
    if (gpu::same_bits(x, gpu::device_matrix::upload(changed))) return std::string("one ulp apart reported equal");
    changed = values;
    changed.values[12] = -0.0f;
    values.values[12] = 0.0f;
    if (gpu::same_bits(gpu::device_matrix::upload(values), gpu::device_matrix::upload(changed))) {
      return std::string("-0 and +0 reported equal");
    }
    if (gpu::same_bits(x, gpu::device_matrix::upload(matrix(41, 37)))) return std::string("other shape reported equal");
    matrix64 wide(37, 41);
    if (gpu::same_bits(x, gpu::device_matrix::upload(wide))) return std::string("fp64 reported equal to fp32");
    return "";
  });
  // gpu::transposed on shapes around its 32 x 32 tile.
  run_case("plain gpu::transposed", []() -> std::string {
    for (const auto& [rows, cols] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {31, 33}, {64, 7}, {100, 257}, {0, 5}}) {
      matrix values(rows, cols);
      for (std::int64_t i = 0; i < values.size(); ++i) values.values[static_cast<std::size_t>(i)] = static_cast<float>(i) + 0.5f;
      const matrix got = gpu::transposed(gpu::device_matrix::upload(values)).download32();
      if (got.rows != cols || got.cols != rows) return "shape of the transpose of " + std::to_string(rows) + "x" + std::to_string(cols);
      for (std::int64_t r = 0; r < rows; ++r) {
        for (std::int64_t c = 0; c < cols; ++c) {
          if (!same(values(r, c), got(c, r))) {
            return std::to_string(rows) + "x" + std::to_string(cols) + " element (" + std::to_string(r) + ", " +
                   std::to_string(c) + ")";
          }
        }
      }
    }
    return "";
  });
}

std::string compare_fields(const mxscope::comparison& want, const mxscope::comparison& got) {
  const auto check = [](const char* field, double expected, double actual) -> std::string {
    const bool ok =
        (std::isnan(expected) && std::isnan(actual)) || core::double_bits(expected) == core::double_bits(actual);
    return ok ? "" : std::string(field) + ": expected " + show(expected) + " got " + show(actual);
  };
  for (const auto& [field, expected, actual] :
       {std::tuple{"rel_err", want.rel_err, got.rel_err}, std::tuple{"cosine", want.cosine, got.cosine},
        std::tuple{"bias", want.bias, got.bias}, std::tuple{"orth_err", want.orth_err, got.orth_err},
        std::tuple{"max_abs_err", want.max_abs_err, got.max_abs_err},
        std::tuple{"error_norm", want.error_norm, got.error_norm},
        std::tuple{"reference_norm", want.reference_norm, got.reference_norm},
        std::tuple{"estimate_norm", want.estimate_norm, got.estimate_norm},
        std::tuple{"error_dot_reference", want.error_dot_reference, got.error_dot_reference},
        std::tuple{"estimate_dot_reference", want.estimate_dot_reference, got.estimate_dot_reference},
        std::tuple{"ulp.mean", want.ulp.mean, got.ulp.mean}}) {
    const std::string problem = check(field, expected, actual);
    if (!problem.empty()) return problem;
  }
  if (want.zero_reference != got.zero_reference) return "zero_reference differs";
  if (want.nonfinite_estimate != got.nonfinite_estimate) return "nonfinite_estimate differs";
  if (want.ulp.histogram != got.ulp.histogram) return "ulp histogram differs";
  if (want.ulp.max != got.ulp.max || want.ulp.compared != got.ulp.compared || want.ulp.nan_pairs != got.ulp.nan_pairs) {
    return "ulp max/compared/nan_pairs differ";
  }
  if (want.row_error_norms.size() != got.row_error_norms.size()) return "row norm count differs";
  for (std::size_t r = 0; r < want.row_error_norms.size(); ++r) {
    const std::string problem = check("row_error_norms", want.row_error_norms[r], got.row_error_norms[r]);
    if (!problem.empty()) return problem + " (row " + std::to_string(r) + ")";
  }
  if (want.column_error_norms.size() != got.column_error_norms.size()) return "column norm count differs";
  for (std::size_t c = 0; c < want.column_error_norms.size(); ++c) {
    const std::string problem = check("column_error_norms", want.column_error_norms[c], got.column_error_norms[c]);
    if (!problem.empty()) return problem + " (column " + std::to_string(c) + ")";
  }
  return "";
}

void compare_checks(bool small) {
  struct shape {
    std::int64_t rows, cols;
  };
  const shape shapes[] = {{1, 1}, {37, 29}, {300, 300}, {3, 9000}, {9000, 5}, {1024, 1500}};
  int index = 0;
  for (const shape& s : shapes) {
    for (int variant = 0; variant < 3; ++variant) {
      ++index;
      if (small && s.rows * s.cols > 100000) continue;
      const std::uint64_t seed = next_seed();
      std::mt19937_64 random(seed);
      std::normal_distribution<double> normal(0.0, 1.0);
      matrix64 reference(s.rows, s.cols);
      matrix estimate(s.rows, s.cols);
      matrix reference32(s.rows, s.cols);
      for (std::int64_t i = 0; i < s.rows * s.cols; ++i) {
        const double g = variant == 2 ? 0.0 : normal(random) * std::ldexp(1.0, static_cast<int>(random() % 9) - 4);
        reference.values[static_cast<std::size_t>(i)] = g;
        reference32.values[static_cast<std::size_t>(i)] = static_cast<float>(g);
        estimate.values[static_cast<std::size_t>(i)] = static_cast<float>(g * (1.0 + 0.01 * normal(random)));
      }
      if (variant == 1 && s.rows * s.cols > 3) {
        estimate.values[1] = std::numeric_limits<float>::quiet_NaN();
        estimate.values[2] = std::numeric_limits<float>::infinity();
      }
      const std::string name = "compare " + std::to_string(s.rows) + "x" + std::to_string(s.cols) +
                               (variant == 0   ? " finite"
                                : variant == 1 ? " with NaN and inf"
                                               : " zero reference");
      run_case(name, [&]() -> std::string {
        const mxscope::comparison want = mxscope::compare(estimate, reference, reference32);
        const mxscope::comparison got = gpu::compare(estimate, reference, reference32);
        std::string problem = compare_fields(want, got);
        if (!problem.empty()) return problem + "; seed " + hex64(seed);
        // The overload on matrices already in device memory.
        const mxscope::comparison resident =
            gpu::compare(gpu::device_matrix::upload(estimate), gpu::device_matrix::upload(reference),
                         gpu::device_matrix::upload(reference32));
        problem = compare_fields(want, resident);
        return problem.empty() ? "" : "device_matrix overload: " + problem + "; seed " + hex64(seed);
      });
    }
  }
}

// The replay's cross-step state: T steps of the reference and of two units fed the same inputs on
// the CPU (src/cross_step.cpp) and on the GPU; every returned norm and, after the last step, every
// state element must have the same bits.
std::string same_matrix(const char* what, const matrix64& want, const matrix64& got) {
  if (want.rows != got.rows || want.cols != got.cols) return std::string(what) + ": shapes differ";
  for (std::size_t i = 0; i < want.values.size(); ++i) {
    if (core::double_bits(want.values[i]) != core::double_bits(got.values[i])) {
      return std::string(what) + "[" + std::to_string(i) + "]: expected " + show(want.values[i]) + " got " +
             show(got.values[i]);
    }
  }
  return "";
}

std::string same_norms(const char* what, int step, std::initializer_list<std::tuple<const char*, double, double>> fields) {
  for (const auto& [field, expected, actual] : fields) {
    if (core::double_bits(expected) != core::double_bits(actual)) {
      return std::string(what) + " step " + std::to_string(step) + " " + field + ": expected " + show(expected) +
             " got " + show(actual);
    }
  }
  return "";
}

void cross_step_checks(bool small) {
  struct shape {
    std::int64_t rows, cols;
  };
  const shape shapes[] = {{1, 1}, {37, 300}, {5, 8200}, {3, 4096}, {300, 300}};
  constexpr int steps = 3;
  for (const shape& s : shapes) {
    for (int variant = 0; variant < 3; ++variant) {
      if (small && s.rows * s.cols > 50000 && variant != 0) continue;
      const std::uint64_t seed = next_seed();
      const std::string name = "cross-step " + std::to_string(s.rows) + "x" + std::to_string(s.cols) +
                               (variant == 0   ? " random"
                                : variant == 1 ? " zero reference and an exact unit"
                                               : " scales and zeros");
      run_case(name, [&]() -> std::string {
        std::mt19937_64 random(seed);
        std::normal_distribution<double> normal(0.0, 1.0);
        mxscope::optimizer_settings settings;
        if (variant == 2) {
          settings.sgd_momentum = 0.5;
          settings.adamw_beta1 = 0.8;
          settings.adamw_beta2 = 0.999;
          settings.adamw_eps = 1e-6;
        }
        mxscope::reference_accumulators cpu_reference;
        std::vector<mxscope::unit_accumulators> cpu_units(2);
        gpu::reference_cross_step gpu_reference;
        std::vector<gpu::unit_cross_step> gpu_units(2);
        const std::int64_t count = s.rows * s.cols;
        for (int t = 1; t <= steps; ++t) {
          matrix64 g(s.rows, s.cols);
          for (std::int64_t i = 0; i < count; ++i) {
            double value = normal(random) * std::ldexp(1.0, static_cast<int>(random() % 17) - 8);
            if (variant == 1) value = 0.0;
            if (variant == 2 && random() % 5 == 0) value = 0.0;
            g.values[static_cast<std::size_t>(i)] = value;
          }
          const mxscope::reference_step_norms want = mxscope::reference_step(cpu_reference, g, settings);
          // Even steps take G from device memory (the replay's way), odd ones from the host.
          const mxscope::reference_step_norms got =
              t % 2 == 0 ? gpu_reference.step(gpu::device_matrix::upload(g), settings) : gpu_reference.step(g, settings);
          std::string problem =
              same_norms("reference", t, {{"reference", want.reference, got.reference},
                                          {"sum", want.sum, got.sum},
                                          {"sgd_update", want.sgd_update, got.sgd_update},
                                          {"sgd_displacement", want.sgd_displacement, got.sgd_displacement},
                                          {"adamw_update", want.adamw_update, got.adamw_update},
                                          {"adamw_displacement", want.adamw_displacement, got.adamw_displacement}});
          if (!problem.empty()) return problem + "; seed " + hex64(seed);
          for (std::size_t u = 0; u < cpu_units.size(); ++u) {
            // Unit 0: Ghat and X near G; unit 1: Ghat = X = G rounded to fp32 (zero errors where exact).
            matrix estimate(s.rows, s.cols);
            matrix64 exact(s.rows, s.cols);
            for (std::int64_t i = 0; i < count; ++i) {
              const double value = g.values[static_cast<std::size_t>(i)];
              const double x = u == 0 ? value * (1.0 + 0x1p-20 * normal(random)) : value;
              exact.values[static_cast<std::size_t>(i)] = x;
              estimate.values[static_cast<std::size_t>(i)] =
                  static_cast<float>(u == 0 ? x * (1.0 + 0x1p-12 * normal(random)) : x);
            }
            const mxscope::unit_step_norms w =
                mxscope::unit_step(cpu_units[u], cpu_reference, estimate, exact, g, settings);
            // Unit 0 reads its inputs from device memory, unit 1 from the host.
            const mxscope::unit_step_norms h =
                u == 0 ? gpu_units[u].step(gpu_reference, gpu::device_matrix::upload(estimate),
                                           gpu::device_matrix::upload(exact), settings)
                       : gpu_units[u].step(gpu_reference, estimate, exact, settings);
            problem = same_norms(
                u == 0 ? "unit 0" : "unit 1", t,
                {{"quantization", w.quantization, h.quantization},
                 {"accumulation", w.accumulation, h.accumulation},
                 {"error_energy", w.error_energy, h.error_energy},
                 {"previous_error_energy", w.previous_error_energy, h.previous_error_energy},
                 {"lag1_dot", w.lag1_dot, h.lag1_dot},
                 {"error_sum", w.error_sum, h.error_sum},
                 {"sgd_update_difference", w.sgd_update_difference, h.sgd_update_difference},
                 {"sgd_displacement_difference", w.sgd_displacement_difference, h.sgd_displacement_difference},
                 {"adamw_update_difference", w.adamw_update_difference, h.adamw_update_difference},
                 {"adamw_displacement_difference", w.adamw_displacement_difference,
                  h.adamw_displacement_difference}});
            if (!problem.empty()) return problem + "; seed " + hex64(seed);
          }
        }
        // The states themselves (what a unit on the host would read from a device reference).
        mxscope::reference_accumulators downloaded;
        gpu_reference.download(downloaded);
        if (downloaded.steps != cpu_reference.steps) return "reference steps differ";
        for (const auto& [what, want, got] :
             {std::tuple{"sum", &cpu_reference.sum, &downloaded.sum},
              std::tuple{"sgd_momentum", &cpu_reference.sgd_momentum, &downloaded.sgd_momentum},
              std::tuple{"sgd_displacement", &cpu_reference.sgd_displacement, &downloaded.sgd_displacement},
              std::tuple{"adamw_first", &cpu_reference.adamw_first, &downloaded.adamw_first},
              std::tuple{"adamw_second", &cpu_reference.adamw_second, &downloaded.adamw_second},
              std::tuple{"adamw_direction", &cpu_reference.adamw_direction, &downloaded.adamw_direction},
              std::tuple{"adamw_displacement", &cpu_reference.adamw_displacement, &downloaded.adamw_displacement}}) {
          const std::string problem = same_matrix(what, *want, *got);
          if (!problem.empty()) return "reference state " + problem + "; seed " + hex64(seed);
        }
        for (std::size_t u = 0; u < cpu_units.size(); ++u) {
          mxscope::unit_accumulators unit;
          gpu_units[u].download(unit);
          const mxscope::unit_accumulators& want = cpu_units[u];
          if (unit.steps != want.steps) return "unit steps differ";
          for (const auto& [what, w, h] :
               {std::tuple{"error_sum", &want.error_sum, &unit.error_sum},
                std::tuple{"previous_error", &want.previous_error, &unit.previous_error},
                std::tuple{"sgd_momentum", &want.sgd_momentum, &unit.sgd_momentum},
                std::tuple{"sgd_displacement", &want.sgd_displacement, &unit.sgd_displacement},
                std::tuple{"adamw_first", &want.adamw_first, &unit.adamw_first},
                std::tuple{"adamw_second", &want.adamw_second, &unit.adamw_second},
                std::tuple{"adamw_displacement", &want.adamw_displacement, &unit.adamw_displacement}}) {
            const std::string problem = same_matrix(what, *w, *h);
            if (!problem.empty()) return "unit state " + problem + "; seed " + hex64(seed);
          }
        }
        return "";
      });
    }
  }
  // Misuse is refused as on the CPU: a unit ahead of its reference, a shape that changes.
  run_case("cross-step misuse", []() -> std::string {
    const mxscope::optimizer_settings settings;
    gpu::reference_cross_step reference;
    gpu::unit_cross_step unit;
    const matrix64 g(3, 5);
    reference.step(g, settings);
    bool refused = false;
    try {
      reference.step(matrix64(5, 3), settings);
    } catch (const mxscope::input_error&) {
      refused = true;
    }
    if (!refused || reference.steps() != 1) return "a G of another shape was accepted";
    unit.step(reference, matrix(3, 5), matrix64(3, 5), settings);
    refused = false;
    try {
      unit.step(reference, matrix(3, 5), matrix64(3, 5), settings);
    } catch (const std::logic_error&) {
      refused = true;
    }
    if (!refused || unit.steps() != 1) return "a unit step ahead of the reference was accepted";
    return "";
  });
  // A state that cannot keep its reserve free refuses its first step and stays at step 0, so the
  // replay can run it on the host; the other states are unaffected.
  run_case("cross-step reserve", []() -> std::string {
    const mxscope::optimizer_settings settings;
    const gpu::cross_step_reserve impossible{~std::uint64_t{0}, 0};
    matrix64 g(4, 6);
    for (std::size_t i = 0; i < g.values.size(); ++i) g.values[i] = static_cast<double>(i) - 7.5;
    gpu::reference_cross_step crowded(impossible);
    bool refused = false;
    try {
      crowded.step(g, settings);
    } catch (const gpu::gpu_error&) {
      refused = true;
    }
    if (!refused || crowded.steps() != 0) return "a reference state allocated beyond its reserve";
    gpu::reference_cross_step reference;
    const mxscope::reference_step_norms norms = reference.step(g, settings);
    mxscope::reference_accumulators host;
    const mxscope::reference_step_norms want = mxscope::reference_step(host, g, settings);
    if (core::double_bits(norms.adamw_displacement) != core::double_bits(want.adamw_displacement)) {
      return "the reference after a refused state differs";
    }
    gpu::unit_cross_step unit(impossible);
    refused = false;
    try {
      unit.step(reference, matrix(4, 6), matrix64(4, 6), settings);
    } catch (const gpu::gpu_error&) {
      refused = true;
    }
    if (!refused || unit.steps() != 0) return "a unit state allocated beyond its reserve";
    return "";
  });
}

}  // namespace

int main(int argc, char** argv) {
  bool small = false;
  bool full = false;  // every case of the sweeps even in the CPU simulation (slow there)
  std::string only;   // run only the suites whose name contains this text
  std::uint64_t seed = 0;
  bool seed_given = false;
  if (const char* text = std::getenv("MXSCOPE_GPU_TEST_SEED")) {
    seed = std::strtoull(text, nullptr, 0);
    seed_given = true;
  }
  for (int i = 1; i < argc; ++i) {
    const std::string argument = argv[i];
    if (argument == "--small") {
      small = true;
    } else if (argument == "--full") {
      full = true;
    } else if (argument == "--only" && i + 1 < argc) {
      only = argv[++i];
    } else if (argument == "--seed" && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 0);
      seed_given = true;
    } else {
      std::fprintf(stderr, "usage: %s [--small | --full] [--seed S] [--only SUITE]\n", argv[0]);
      return 2;
    }
  }
  if (!seed_given) seed = (static_cast<std::uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  case_seeds = seed;
  if (gpu::device_count() == 0) {
    std::printf("FAIL no GPU device found\n0 passed, 1 failed\n");
    return 1;
  }
  const gpu::device_description device = gpu::describe_device();
  // The CPU simulation of the backend runs every GPU thread as a host thread: small cases only.
  const bool simulated = device.name.find("simulation") != std::string::npos;
  if (simulated && !full) small = true;
  std::printf("device: %s (compute capability %d.%d, %d multiprocessors, %.1f GiB)\n", device.name.c_str(),
              device.major, device.minor, device.multiprocessors,
              static_cast<double>(device.global_memory_bytes) / (1u << 30));
  std::printf("seed: 0x%016" PRIx64 " (replay with --seed 0x%016" PRIx64 ")%s\n", seed, seed, small ? " [small]" : "");
  std::fflush(stdout);

  const auto timed = [&](const char* suite, const std::function<void()>& body) {
    if (!only.empty() && std::string(suite).find(only) == std::string::npos) return;
    const auto begin = std::chrono::steady_clock::now();
    body();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    std::printf("-- %s: %.1f s\n", suite, seconds);
    std::fflush(stdout);
  };
  timed("rotations", [&] { rotation_checks(small); });
  timed("quantize sweep", [&] { quantize_sweep(small); });
  timed("staged column sweep", [&] { staged_column_sweep(small); });
  timed("fast encoder", [&] { fast_encoder_checks(small); });
  timed("quantize fused", [&] { quantize_fused(small); });
  timed("quantize nvfp4", [&] { quantize_nvfp4_suite(small); });
  timed("quantize with energies", [&] {
    quantize_energies(small);
    quantize_per_tensor_energies(small);
    quantize_bf16_energies(small);
  });
  timed("quantize native", [&] { quantize_native(small); });
  if (!small && !simulated) timed("quantize large", [&] { quantize_large(); });
  timed("gemm sweep", [&] { gemm_sweep(small); });
  timed("gemm edges", [&] { gemm_edges(small); });
  timed("gemm tensor-core tiles", [&] { gemm_tensor_core_tiles(small); });
  if (simulated || gpu::tensor_core_kernel_available(gpu::tensor_core_kernel::wgmma_fp8)) {
    timed("gemm scaled operand forms", [&] { gemm_scaled_forms(small); });
  }
  timed("gemm integer tiles", [&] { gemm_integer_tiles(small); });
  if (!small && !simulated) timed("gemm large", [&] { gemm_large(); });
  timed("per-tensor scales", [&] { tensor_scale_checks(small); });
  timed("reference", [&] { reference_checks(small); });
  timed("plain products", [&] { plain_checks(small); });
  timed("compare", [&] { compare_checks(small); });
  timed("cross-step", [&] { cross_step_checks(small); });

  std::printf("%d passed, %d failed\n", results.passed, results.failed);
  return results.failed == 0 ? 0 : 1;
}
