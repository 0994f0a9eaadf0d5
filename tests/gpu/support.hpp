// What the GPU test's suites share (tests/gpu/test_gpu.cpp runs them): bookkeeping (one PASS or
// FAIL line per case), the case seeds, bit-exact comparison and display of values, and the
// quantizer policies the sweeps draw from.
#pragma once

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

namespace gpu_test {

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

inline tally results;

// Runs one case; an exception is a failure of that case, not of the run.
inline void run_case(const std::string& name, const std::function<std::string()>& body) {
  try {
    const std::string problem = body();
    results.record(problem.empty(), name, problem);
  } catch (const std::exception& error) {
    results.record(false, name, std::string("exception: ") + error.what());
  }
}

inline std::uint64_t split_mix(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

inline std::uint64_t case_seeds = 0;
inline std::uint64_t next_seed() { return split_mix(case_seeds); }

inline std::string hex32(std::uint32_t bits) {
  char text[16];
  std::snprintf(text, sizeof(text), "0x%08x", bits);
  return text;
}
inline std::string hex64(std::uint64_t bits) {
  char text[24];
  std::snprintf(text, sizeof(text), "0x%016" PRIx64, bits);
  return text;
}
inline std::string show(float value) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.9g (%s)", static_cast<double>(value), hex32(core::float_bits(value)).c_str());
  return text;
}
inline std::string show(double value) {
  char text[80];
  std::snprintf(text, sizeof(text), "%.17g (%s)", value, hex64(core::double_bits(value)).c_str());
  return text;
}

// NaN outputs of the GPU are exactly the positive quiet NaN; the CPU's NaN may carry another
// payload or sign (x86 arithmetic), so an expected NaN matches exactly that pattern and nothing else
// (in particular not the 0xFF poison).
inline bool same(float expected, float actual) {
  if (std::isnan(expected)) return core::float_bits(actual) == 0x7FC00000U;
  return core::float_bits(expected) == core::float_bits(actual);
}
inline bool same(double expected, double actual) {
  if (std::isnan(expected)) return core::double_bits(actual) == 0x7FF8000000000000ULL;
  return core::double_bits(expected) == core::double_bits(actual);
}

// ------------------------------------------------------------------------------------------------
// Policies.

inline constexpr const char* format_names[] = {"mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2", "mxint8"};
inline constexpr core::element_kind format_kinds[] = {core::element_kind::fp4_e2m1, core::element_kind::fp6_e2m3,
                                           core::element_kind::fp6_e3m2, core::element_kind::fp8_e4m3,
                                           core::element_kind::fp8_e5m2, core::element_kind::int8};
inline constexpr const char* rounding_names[] = {"rne", "rna", "rtz", "sr"};
inline constexpr const char* rule_names[] = {"floor", "ceil", "even"};
inline constexpr const char* sign_names[] = {"none", "fixed", "per-step"};

inline mxscope::quantize_options mx_options(int format, int block, int axis, core::rounding_mode rounding,
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

inline std::string describe(const mxscope::quantize_options& options, const mxscope::rotation_options& rotation) {
  std::ostringstream out;
  out << "format " << core::spec(options.format.element).name << " block " << options.block << " axis " << options.axis
      << " rounding " << rounding_names[static_cast<int>(options.rounding)] << " rule "
      << rule_names[static_cast<int>(options.rule)] << " sr_bits " << options.sr_bits << " stream seed "
      << hex64(options.stream.seed) << " step " << options.stream.step << " tag " << hex32(options.stream.tag)
      << " rotation " << rotation.size << " signs " << sign_names[static_cast<int>(rotation.signs)] << " sign seed "
      << hex64(rotation.seed) << " step " << rotation.step << " layer " << hex32(rotation.layer_hash);
  return out.str();
}

}  // namespace gpu_test
