// Element and scale formats (NUMERICS.md sections 1 and 3): every code decodes to the value the OCP
// specifications give it, and encode agrees with a brute-force nearest search for every
// representable value, every midpoint and the neighbours of both. bf16 / fp16 conversions are
// checked against independent oracles.
//
// Exhaustive sweep (opt-in): with the environment variable MXSCOPE_EXHAUSTIVE=1 (or the CMake option
// MXSCOPE_EXHAUSTIVE_TESTS=ON, which sets it for ctest) the test EncodeSweep.Fp32PatternsUnderRne
// encodes all 2^32 fp32 bit patterns into each of the six MX element formats and compares every code
// and flag with the binary-search oracle, spread over the OpenMP threads. Without it the same test
// runs a strided subset (every 65521st pattern) plus every pattern within 64 fp32 ulps of each value
// and midpoint of each format, in well under a second. The full sweep (6 * 2^32 patterns) took
// 582 s of CPU time in a Release build; it prints its wall and CPU time when it ends.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "mxscope/core/formats.hpp"
#include "reference_formats.hpp"

namespace {

namespace core = mxscope::core;
using reference::format_description;
using reference::show;

core::rounding_mode library_mode(reference::rounding mode) {
  switch (mode) {
    case reference::rounding::rne: return core::rounding_mode::rne;
    case reference::rounding::rna: return core::rounding_mode::rna;
    case reference::rounding::rtz: return core::rounding_mode::rtz;
  }
  return core::rounding_mode::rne;
}

constexpr reference::rounding all_modes[] = {reference::rounding::rne, reference::rounding::rna,
                                             reference::rounding::rtz};

// ---------------------------------------------------------------------------------------------
// Decoding.

TEST(Decode, Fp4E2M1MatchesTheOcpTable) {
  // OCP MX v1.0, table of FP4 E2M1 values: codes 0..7 are +0, 0.5, 1, 1.5, 2, 3, 4, 6; 8..15 the negatives.
  const double expected[16] = {0.0,  0.5,  1.0,  1.5,  2.0,  3.0,  4.0,  6.0,
                               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0};
  for (std::uint32_t code = 0; code < 16; ++code) {
    const double actual = core::decode(core::element_kind::fp4_e2m1, code);
    EXPECT_TRUE(reference::same_value(actual, expected[code]))
        << "fp4_e2m1 code " << fmt::format("{:#04x}", code) << ": expected " << show(expected[code]) << ", got "
        << show(actual);
  }
}

TEST(Decode, EveryCodeOfEveryFormatMatchesTheSpecFormula) {
  for (const auto& format : reference::all_formats()) {
    const std::uint32_t code_count = 1U << format.bits;
    for (std::uint32_t code = 0; code < code_count; ++code) {
      const double expected = reference::decode(format, code);
      const double actual = core::decode(format.kind, code);
      EXPECT_TRUE(reference::same_value(actual, expected))
          << format.name << " code " << fmt::format("{:#04x}", code) << ": expected " << show(expected) << ", got "
          << show(actual);
    }
  }
}

// The independent decoder itself is pinned to facts stated in the specifications, so that a shared
// misreading of the formula by the test and the library cannot go unnoticed.
TEST(Decode, SpecFactsOfTheReferenceDecoder) {
  const auto& e4m3 = reference::describe(core::element_kind::fp8_e4m3);
  EXPECT_EQ(reference::decode(e4m3, 0x7E), 448.0);
  EXPECT_EQ(reference::decode(e4m3, 0xFE), -448.0);
  EXPECT_TRUE(std::isnan(reference::decode(e4m3, 0x7F)));
  EXPECT_TRUE(std::isnan(reference::decode(e4m3, 0xFF)));
  EXPECT_EQ(reference::decode(e4m3, 0x01), 0x1p-9);  // smallest subnormal
  EXPECT_EQ(reference::decode(e4m3, 0x08), 0x1p-6);  // smallest normal
  EXPECT_EQ(reference::decode(e4m3, 0x78), 256.0);
  for (std::uint32_t code = 0; code < 256; ++code) {
    EXPECT_FALSE(std::isinf(reference::decode(e4m3, code))) << "e4m3 has no infinity, code " << code;
  }
  const auto& e5m2 = reference::describe(core::element_kind::fp8_e5m2);
  EXPECT_EQ(reference::decode(e5m2, 0x7B), 57344.0);
  EXPECT_EQ(reference::decode(e5m2, 0x7C), std::numeric_limits<double>::infinity());
  EXPECT_EQ(reference::decode(e5m2, 0xFC), -std::numeric_limits<double>::infinity());
  for (std::uint32_t code : {0x7DU, 0x7EU, 0x7FU, 0xFDU, 0xFEU, 0xFFU}) {
    EXPECT_TRUE(std::isnan(reference::decode(e5m2, code))) << "e5m2 code " << code;
  }
  EXPECT_EQ(reference::decode(e5m2, 0x01), 0x1p-16);
  EXPECT_EQ(reference::decode(e5m2, 0x04), 0x1p-14);
  const auto& e8m0 = reference::describe(core::element_kind::e8m0);
  EXPECT_EQ(reference::decode(e8m0, 0), 0x1p-127);
  EXPECT_EQ(reference::decode(e8m0, 127), 1.0);
  EXPECT_EQ(reference::decode(e8m0, 0xFE), 0x1p127);
  EXPECT_TRUE(std::isnan(reference::decode(e8m0, 0xFF)));
  const auto& ue4m3 = reference::describe(core::element_kind::ue4m3);
  for (std::uint32_t code = 0x80; code < 0x100; ++code) {
    EXPECT_TRUE(std::isnan(reference::decode(ue4m3, code))) << "ue4m3 sign-bit code " << code;
  }
  const auto& int8 = reference::describe(core::element_kind::int8);
  EXPECT_EQ(reference::decode(int8, 0x40), 1.0);
  EXPECT_EQ(reference::decode(int8, 0xC0), -1.0);
  EXPECT_EQ(reference::decode(int8, 0x7F), 127.0 / 64.0);
  EXPECT_EQ(reference::decode(int8, 0x81), -127.0 / 64.0);
  const auto& e3m2 = reference::describe(core::element_kind::fp6_e3m2);
  EXPECT_EQ(reference::decode(e3m2, 0x1F), 28.0);
  EXPECT_EQ(reference::decode(e3m2, 0x01), 0.0625);
  const auto& e2m3 = reference::describe(core::element_kind::fp6_e2m3);
  EXPECT_EQ(reference::decode(e2m3, 0x1F), 7.5);
  EXPECT_EQ(reference::decode(e2m3, 0x01), 0.125);
}

// The library's derived limits against the numbers typed from the specification tables.
TEST(Decode, DerivedLimitsMatchTheSpecTables) {
  for (const auto& format : reference::all_formats()) {
    SCOPED_TRACE(format.name);
    EXPECT_EQ(core::max_finite_code(format.kind), format.max_code);
    EXPECT_EQ(core::max_normal(format.kind), format.max_normal);
    EXPECT_EQ(core::decode(format.kind, format.max_code), format.max_normal);
    EXPECT_EQ(core::min_subnormal(format.kind), format.min_subnormal);
    if (format.kind != core::element_kind::e8m0 && format.kind != core::element_kind::ue4m3) {
      EXPECT_EQ(core::emax_elem(format.kind), format.emax_elem);
    }
    // The table's largest value is the specification's max normal.
    EXPECT_EQ(reference::magnitude_table(format).back().value, format.max_normal);
  }
  EXPECT_EQ(core::decode(core::element_kind::fp8_e4m3, 0x7E), 448.0);
  EXPECT_TRUE(std::isnan(core::decode(core::element_kind::fp8_e4m3, 0x7F)));
  EXPECT_EQ(core::decode(core::element_kind::fp8_e5m2, 0x7B), 57344.0);
  EXPECT_TRUE(std::isinf(core::decode(core::element_kind::fp8_e5m2, 0x7C)));
  for (int code = 0; code < 255; ++code) {
    EXPECT_EQ(core::decode(core::element_kind::e8m0, static_cast<std::uint32_t>(code)), std::ldexp(1.0, code - 127));
  }
  EXPECT_TRUE(std::isnan(core::decode(core::element_kind::e8m0, 0xFF)));
}

// ---------------------------------------------------------------------------------------------
// Encoding against the brute-force search.

// Formats that `encode` accepts as a destination: the element formats and the NVFP4 block scale.
std::vector<format_description> encodable_formats() {
  auto formats = reference::element_formats();
  formats.push_back(reference::describe(core::element_kind::ue4m3));
  return formats;
}

// Every representable value, every midpoint between neighbours, the double and float neighbours
// of both, values around and beyond the max normal, and extreme doubles. Non-negative; the tests
// add the negatives.
std::vector<double> probe_magnitudes(const std::vector<reference::table_entry>& table) {
  std::vector<double> anchors;
  for (std::size_t i = 0; i < table.size(); ++i) {
    anchors.push_back(table[i].value);
    if (i + 1 < table.size()) anchors.push_back((table[i].value + table[i + 1].value) / 2.0);
  }
  const double largest = table.back().value;
  const double top_gap = largest - table[table.size() - 2].value;
  anchors.push_back(largest + top_gap / 2.0);  // the midpoint to the next value the format would have
  anchors.push_back(largest + top_gap);
  anchors.push_back(2.0 * largest);
  anchors.push_back(4.0 * largest);
  std::vector<double> probes;
  const double infinity = std::numeric_limits<double>::infinity();
  for (double anchor : anchors) {
    probes.push_back(anchor);
    probes.push_back(std::nextafter(anchor, 0.0));
    probes.push_back(std::nextafter(anchor, infinity));
    const float as_float = static_cast<float>(anchor);  // exact: every anchor has at most 10 significant bits
    probes.push_back(static_cast<double>(std::nextafter(as_float, 0.0f)));
    probes.push_back(static_cast<double>(std::nextafter(as_float, std::numeric_limits<float>::infinity())));
  }
  for (double extreme : {0x1p-1074, 0x1p-149, 0x1p-126, 1e-30, 1e30, static_cast<double>(FLT_MAX), DBL_MAX, infinity}) {
    probes.push_back(extreme);
  }
  return probes;
}

TEST(Encode, EveryValueMidpointAndNeighbourMatchesTheBruteForceSearch) {
  for (const auto& format : encodable_formats()) {
    const auto table = reference::magnitude_table(format);
    const auto magnitudes = probe_magnitudes(table);
    for (const auto mode : all_modes) {
      int failures = 0;
      for (const double magnitude : magnitudes) {
        for (const double x : {magnitude, -magnitude}) {
          if (!format.is_signed && std::signbit(x)) continue;  // unsigned formats: see the next test
          const auto expected = reference::round_to_table(format, table, x, mode);
          const auto actual = core::encode(format.kind, x, library_mode(mode));
          const bool match = actual.code == expected.code && actual.saturated == expected.saturated &&
                             actual.flushed == expected.flushed;
          // The per-tensor quantizer's encoder with hoisted constants: the same function under rne.
          if (mode == reference::rounding::rne && core::nearest_even_encoder::covers(format.kind)) {
            const auto hoisted = core::nearest_even_encoder(format.kind)(x);
            EXPECT_TRUE(hoisted.code == expected.code && hoisted.saturated == expected.saturated &&
                        hoisted.flushed == expected.flushed)
                << format.name << " nearest_even_encoder: input " << show(x) << " got code "
                << fmt::format("{:#04x}", hoisted.code) << ", expected " << fmt::format("{:#04x}", expected.code);
          }
          if (!match && ++failures <= 20) {
            ADD_FAILURE() << format.name << " " << reference::rounding_label(mode) << ": input " << show(x)
                          << " expected code " << fmt::format("{:#04x}", expected.code) << " ("
                          << expected.value << ", saturated " << expected.saturated << ", flushed "
                          << expected.flushed << "), got " << fmt::format("{:#04x}", actual.code) << " ("
                          << core::decode(format.kind, actual.code) << ", saturated " << actual.saturated
                          << ", flushed " << actual.flushed << ")";
          }
        }
      }
      EXPECT_EQ(failures, 0) << format.name << " " << reference::rounding_label(mode);
    }
  }
}

TEST(Encode, NegativeZeroAndNegativeUnderflowKeepTheSignBit) {
  for (const auto& format : reference::element_formats()) {
    if (format.layout == reference::code_layout::twos_complement) continue;  // int8 has no negative zero
    const auto table = reference::magnitude_table(format);
    const double tiny = table[1].value / 4.0;  // rounds to zero under every nearest mode and rtz
    for (const auto mode : all_modes) {
      const auto minus_zero = core::encode(format.kind, -0.0, library_mode(mode));
      EXPECT_EQ(minus_zero.code, reference::sign_bit(format)) << format.name << " -0.0 " << reference::rounding_label(mode);
      EXPECT_FALSE(minus_zero.flushed) << format.name << " -0.0 is not a flushed nonzero";
      const auto minus_tiny = core::encode(format.kind, -tiny, library_mode(mode));
      EXPECT_EQ(minus_tiny.code, reference::sign_bit(format)) << format.name << " input " << show(-tiny);
      EXPECT_TRUE(minus_tiny.flushed) << format.name << " input " << show(-tiny);
      EXPECT_FALSE(minus_tiny.saturated);
    }
  }
  // int8: -0.0 and negative underflow give the single zero code.
  for (const auto mode : all_modes) {
    EXPECT_EQ(core::encode(core::element_kind::int8, -0.0, library_mode(mode)).code, 0U);
    EXPECT_EQ(core::encode(core::element_kind::int8, -1.0 / 512.0, library_mode(mode)).code, 0U);
    EXPECT_TRUE(core::encode(core::element_kind::int8, -1.0 / 512.0, library_mode(mode)).flushed);
  }
}

TEST(Encode, NanGivesTheNanCodeOrZero) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (const auto& format : encodable_formats()) {
    for (const auto mode : all_modes) {
      for (const double x : {nan, -nan}) {
        const auto actual = core::encode(format.kind, x, library_mode(mode));
        if (format.specials == reference::special_codes::none) {
          EXPECT_EQ(actual.code, 0U) << format.name << " NaN input, " << reference::rounding_label(mode);
        } else {
          EXPECT_TRUE(std::isnan(reference::decode(format, actual.code)))
              << format.name << " NaN input gave code " << fmt::format("{:#04x}", actual.code);
        }
        EXPECT_FALSE(actual.saturated);
        EXPECT_FALSE(actual.flushed);
      }
    }
  }
}

TEST(Encode, InfinitiesSaturateAtTheMaxNormal) {
  const double infinity = std::numeric_limits<double>::infinity();
  for (const auto& format : reference::element_formats()) {
    for (const auto mode : all_modes) {
      const auto plus = core::encode(format.kind, infinity, library_mode(mode));
      const auto minus = core::encode(format.kind, -infinity, library_mode(mode));
      EXPECT_EQ(reference::decode(format, plus.code), format.max_normal) << format.name;
      EXPECT_EQ(reference::decode(format, minus.code), -format.max_normal) << format.name;
      EXPECT_TRUE(plus.saturated && minus.saturated) << format.name;
    }
  }
}

// ue4m3 has no negative numbers: negative inputs (only possible by misuse; NVFP4 block scales are
// amax-derived) encode to +0, counted as flushed when nonzero.
TEST(Encode, Ue4m3NegativeInputsBecomeZero) {
  for (const auto mode : all_modes) {
    for (const double x : {-0.0, -0x1p-12, -1.0, -448.0, -1e9}) {
      const auto actual = core::encode(core::element_kind::ue4m3, x, library_mode(mode));
      EXPECT_EQ(actual.code, 0U) << "ue4m3 input " << show(x);
      EXPECT_EQ(actual.flushed, x != 0.0) << "ue4m3 input " << show(x);
    }
  }
}

// A few hand-checked roundings from the specification tables, independent of the search.
TEST(Encode, HandCheckedTies) {
  using core::element_kind;
  // fp4: 2.5 lies between 2 (code 4, mantissa 0) and 3 (code 5): RNE -> 2, RNA -> 3, RTZ -> 2.
  EXPECT_EQ(core::encode(element_kind::fp4_e2m1, 2.5, core::rounding_mode::rne).code, 0x4);
  EXPECT_EQ(core::encode(element_kind::fp4_e2m1, 2.5, core::rounding_mode::rna).code, 0x5);
  EXPECT_EQ(core::encode(element_kind::fp4_e2m1, -2.5, core::rounding_mode::rna).code, 0xD);
  // fp4: 5 lies between 4 (code 6, mantissa 0) and 6 (code 7): RNE -> 4.
  EXPECT_EQ(core::encode(element_kind::fp4_e2m1, 5.0, core::rounding_mode::rne).code, 0x6);
  EXPECT_EQ(core::encode(element_kind::fp4_e2m1, 5.0, core::rounding_mode::rna).code, 0x7);
  EXPECT_EQ(core::encode(element_kind::fp4_e2m1, 5.9, core::rounding_mode::rtz).code, 0x6);
  // e4m3: 464 is the midpoint of 448 (0x7E, odd mantissa) and 480 (not representable: 0x7F is NaN):
  // the nearest-even result would be 480, so it saturates to 448 instead of producing NaN.
  EXPECT_EQ(core::encode(element_kind::fp8_e4m3, 464.0, core::rounding_mode::rne).code, 0x7E);
  EXPECT_TRUE(core::encode(element_kind::fp8_e4m3, 464.0, core::rounding_mode::rne).saturated);
  // e5m2: 61440 is the midpoint of 57344 (0x7B) and 65536 (0x7C would be inf): saturate, never inf.
  EXPECT_EQ(core::encode(element_kind::fp8_e5m2, 61440.0, core::rounding_mode::rne).code, 0x7B);
  EXPECT_EQ(core::encode(element_kind::fp8_e5m2, -1e6, core::rounding_mode::rna).code, 0xFB);
  // int8: 1.5/64 is a tie between 1/64 and 2/64: RNE -> 2 (0x02), RNA -> 2, RTZ -> 1; -1.5/64 -> -2 = 0xFE.
  EXPECT_EQ(core::encode(element_kind::int8, 1.5 / 64.0, core::rounding_mode::rne).code, 0x02);
  EXPECT_EQ(core::encode(element_kind::int8, 2.5 / 64.0, core::rounding_mode::rne).code, 0x02);
  EXPECT_EQ(core::encode(element_kind::int8, 2.5 / 64.0, core::rounding_mode::rna).code, 0x03);
  EXPECT_EQ(core::encode(element_kind::int8, -1.5 / 64.0, core::rounding_mode::rne).code, 0xFE);
  EXPECT_EQ(core::encode(element_kind::int8, -2.0, core::rounding_mode::rne).code, 0x81);  // clamp at -127/64
}

// ---------------------------------------------------------------------------------------------
// bf16 and fp16.

// All finite non-negative bf16 values by the IEEE formula (8 exponent bits, bias 127, 7 mantissa
// bits), ascending, plus 2^128 standing for "overflow": the value that rounds to infinity.
struct bf16_oracle {
  std::vector<double> values;
  bf16_oracle() {
    for (std::uint32_t code = 0; code < 0x7F80; ++code) {
      const std::uint32_t exponent_field = code >> 7;
      const std::uint32_t mantissa_field = code & 0x7F;
      values.push_back(exponent_field == 0 ? std::ldexp(static_cast<double>(mantissa_field), -133)
                                           : std::ldexp(static_cast<double>(128 + mantissa_field),
                                                        static_cast<int>(exponent_field) - 134));
    }
    values.push_back(0x1p128);
  }

  // Expected bf16 bits of a non-NaN fp32 input.
  std::uint16_t round(float input, reference::rounding mode) const {
    const std::uint16_t sign = std::signbit(input) ? 0x8000 : 0;
    const double magnitude = std::fabs(static_cast<double>(input));
    if (std::isinf(magnitude)) return sign | 0x7F80;
    // values[code] is the value of code; the last finite code is 0x7F7F.
    const auto above = std::upper_bound(values.begin(), values.end() - 1, magnitude);
    const std::size_t below = static_cast<std::size_t>(above - values.begin()) - 1;
    std::size_t chosen = below;
    if (values[below] != magnitude && mode != reference::rounding::rtz) {
      const double midpoint = (values[below] + values[below + 1]) / 2.0;
      if (magnitude > midpoint || (magnitude == midpoint && (mode == reference::rounding::rna || (below & 1U) != 0))) {
        chosen = below + 1;
      }
    }
    return static_cast<std::uint16_t>(sign | chosen);
  }
};

TEST(Bfloat16, RoundingMatchesTheOracleOnEdgesAndRandomInputs) {
  const bf16_oracle oracle;
  std::vector<std::uint32_t> patterns;
  // Ties, near-ties and exact values at every exponent, both signs, including subnormals and the
  // overflow boundary (0x7F7F8000 is the tie between the max bf16 and 2^128).
  for (std::uint32_t exponent_field = 0; exponent_field < 255; ++exponent_field) {
    for (std::uint32_t kept_low : {0U, 1U, 0x7EU, 0x7FU}) {
      for (std::uint32_t dropped : {0x0000U, 0x0001U, 0x7FFFU, 0x8000U, 0x8001U, 0xFFFFU}) {
        const std::uint32_t magnitude = (exponent_field << 23) | (kept_low << 16) | dropped;
        patterns.push_back(magnitude);
        patterns.push_back(magnitude | 0x80000000U);
      }
    }
  }
  patterns.push_back(0x7F800000U);  // inf
  patterns.push_back(0xFF800000U);
  patterns.push_back(0x7F7FFFFFU);  // FLT_MAX
  std::mt19937 generator(20240611);
  for (int i = 0; i < 1'000'000; ++i) patterns.push_back(generator());
  int failures = 0;
  for (const std::uint32_t bits : patterns) {
    const float input = reference::float_from_bits(bits);
    if (std::isnan(input)) continue;
    for (const auto mode : all_modes) {
      const std::uint16_t expected = oracle.round(input, mode);
      const std::uint16_t actual = core::float_to_bf16(input, library_mode(mode));
      if (expected != actual && ++failures <= 20) {
        ADD_FAILURE() << "float_to_bf16 " << reference::rounding_label(mode) << ": input " << show(input)
                      << " expected " << fmt::format("{:#06x}", expected) << ", got " << fmt::format("{:#06x}", actual);
      }
    }
  }
  EXPECT_EQ(failures, 0);
}

// rtz never overflows a finite input: it saturates at the max bf16 (IEEE: round toward zero).
TEST(Bfloat16, OverflowBehaviourPerMode) {
  const float near_overflow = reference::float_from_bits(0x7F7FC000U);  // above the max bf16's upper midpoint
  EXPECT_EQ(core::float_to_bf16(near_overflow, core::rounding_mode::rne), 0x7F80);
  EXPECT_EQ(core::float_to_bf16(near_overflow, core::rounding_mode::rna), 0x7F80);
  EXPECT_EQ(core::float_to_bf16(near_overflow, core::rounding_mode::rtz), 0x7F7F);
  EXPECT_EQ(core::float_to_bf16(-near_overflow, core::rounding_mode::rtz), 0xFF7F);
}

TEST(Bfloat16, NanStaysNanAndWideningIsExact) {
  for (const std::uint32_t bits : {0x7FC00000U, 0xFFC00000U, 0x7F800001U, 0x7FBFFFFFU, 0xFF800001U, 0x7FFFFFFFU}) {
    const float input = reference::float_from_bits(bits);
    for (const auto mode : all_modes) {
      const std::uint16_t result = core::float_to_bf16(input, library_mode(mode));
      EXPECT_EQ(result & 0x7F80U, 0x7F80U) << "input " << show(input);
      EXPECT_NE(result & 0x007FU, 0U) << "NaN must not become inf: input " << show(input);
      EXPECT_EQ(result & 0x8000U, (bits >> 16) & 0x8000U) << "sign of NaN kept";
    }
  }
  for (std::uint32_t code = 0; code < 0x10000; ++code) {
    const float widened = core::bf16_to_float(static_cast<std::uint16_t>(code));
    EXPECT_EQ(reference::bits_of(widened), code << 16) << fmt::format("bf16 {:#06x}", code);
  }
}

// IEEE binary16 by the formula: 5 exponent bits, bias 15, 10 mantissa bits.
double half_value(std::uint32_t code) {
  const double sign = (code & 0x8000U) ? -1.0 : 1.0;
  const int exponent_field = static_cast<int>((code >> 10) & 0x1F);
  const int mantissa_field = static_cast<int>(code & 0x3FF);
  if (exponent_field == 31) {
    return mantissa_field == 0 ? sign * std::numeric_limits<double>::infinity()
                               : std::numeric_limits<double>::quiet_NaN();
  }
  if (exponent_field == 0) return sign * std::ldexp(static_cast<double>(mantissa_field), -24);
  return sign * std::ldexp(static_cast<double>(1024 + mantissa_field), exponent_field - 25);
}

TEST(Half, WideningEveryCodeMatchesTheFormula) {
  for (std::uint32_t code = 0; code < 0x10000; ++code) {
    const double expected = half_value(code);
    const float actual = core::half_to_float(static_cast<std::uint16_t>(code));
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(actual)) << fmt::format("half {:#06x}", code);
      EXPECT_EQ(std::signbit(actual), (code & 0x8000U) != 0) << fmt::format("half {:#06x}", code);
    } else {
      EXPECT_TRUE(reference::same_value(static_cast<double>(actual), expected))
          << fmt::format("half {:#06x}", code) << ": expected " << show(expected) << ", got " << show(actual);
    }
  }
}

TEST(Half, NarrowingRoundTripsEveryFiniteHalfAndRoundsMidpointsToEven) {
  int failures = 0;
  auto check = [&failures](float input, std::uint16_t expected, const char* what) {
    const std::uint16_t actual = core::float_to_half(input);
    if (actual != expected && ++failures <= 20) {
      ADD_FAILURE() << "float_to_half (" << what << "): input " << show(input) << " expected "
                    << fmt::format("{:#06x}", expected) << ", got " << fmt::format("{:#06x}", actual);
    }
  };
  for (std::uint32_t code = 0; code < 0x10000; ++code) {
    const double value = half_value(code);
    if (std::isnan(value)) continue;
    check(static_cast<float>(value), static_cast<std::uint16_t>(code), "round trip");
    if ((code & 0x7FFFU) >= 0x7C00U) continue;  // no neighbour above infinity
    // The midpoint to the next half away from zero (for 0x7BFF: 65520, which overflows to inf).
    const double next = (code & 0x7FFFU) == 0x7BFFU ? std::copysign(65536.0, value) : half_value(code + 1);
    const float midpoint = static_cast<float>((value + next) / 2.0);  // exact: 12 significant bits
    const bool current_is_even = (code & 1U) == 0;
    const std::uint16_t toward_zero = static_cast<std::uint16_t>(code);
    const std::uint16_t away = static_cast<std::uint16_t>(code + 1);  // 0x7BFF + 1 = 0x7C00 = inf
    check(midpoint, current_is_even ? toward_zero : away, "midpoint");
    check(std::nextafter(midpoint, 0.0f), toward_zero, "below midpoint");
    check(std::nextafter(midpoint, std::copysign(INFINITY, midpoint)), away, "above midpoint");
  }
  check(0x1p-26f, 0x0000, "far below the smallest subnormal");
  check(-0x1p-26f, 0x8000, "negative underflow keeps the sign");
  check(1e6f, 0x7C00, "overflow");
  check(-1e6f, 0xFC00, "negative overflow");
  check(INFINITY, 0x7C00, "inf");
  EXPECT_EQ(failures, 0);
  const std::uint16_t nan_half = core::float_to_half(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan_half & 0x7C00U, 0x7C00U);
  EXPECT_NE(nan_half & 0x03FFU, 0U);
}

// ---------------------------------------------------------------------------------------------
// The fp32 sweep (see the comment at the top of the file for the opt-in).

struct sweep_format {
  format_description format;
  std::vector<reference::table_entry> table;
  std::vector<std::uint32_t> threshold_patterns;  // positive fp32 patterns of values and midpoints
};

bool exhaustive_requested() {
  const char* flag = std::getenv("MXSCOPE_EXHAUSTIVE");
  return flag != nullptr && std::string(flag) == "1";
}

// The failure message for one fp32 pattern, or nothing when the library agrees with the oracle.
std::optional<std::string> sweep_mismatch(const sweep_format& entry, std::uint32_t bits) {
  const float input = reference::float_from_bits(bits);
  const auto actual = core::encode(entry.format.kind, static_cast<double>(input), core::rounding_mode::rne);
  if (core::nearest_even_encoder::covers(entry.format.kind)) {
    // The per-tensor quantizer's encoder with hoisted constants must be the same function.
    const auto hoisted = core::nearest_even_encoder(entry.format.kind)(static_cast<double>(input));
    if (hoisted.code != actual.code || hoisted.saturated != actual.saturated || hoisted.flushed != actual.flushed) {
      return fmt::format("{} rne: input {}: nearest_even_encoder gave {:#04x} (saturated {}, flushed {}), encode {:#04x}",
                         entry.format.name, show(input), hoisted.code, hoisted.saturated, hoisted.flushed, actual.code);
    }
  }
  if (std::isnan(input)) {
    const bool ok = entry.format.specials == reference::special_codes::none
                        ? actual.code == 0
                        : std::isnan(reference::decode(entry.format, actual.code));
    if (ok) return std::nullopt;
    return fmt::format("{} rne: NaN input {} gave code {:#04x}", entry.format.name, show(input), actual.code);
  }
  const auto expected = reference::round_to_table(entry.format, entry.table, input, reference::rounding::rne);
  if (actual.code == expected.code && actual.saturated == expected.saturated && actual.flushed == expected.flushed) {
    return std::nullopt;
  }
  return fmt::format("{} rne: input {} expected code {:#04x} (saturated {}, flushed {}), got {:#04x} (saturated {}, flushed {})",
                     entry.format.name, show(input), expected.code, expected.saturated, expected.flushed, actual.code,
                     actual.saturated, actual.flushed);
}

TEST(EncodeSweep, Fp32PatternsUnderRne) {
  std::vector<sweep_format> formats;
  for (const auto& format : reference::element_formats()) {
    sweep_format entry{format, reference::magnitude_table(format), {}};
    for (std::size_t i = 0; i < entry.table.size(); ++i) {
      entry.threshold_patterns.push_back(reference::bits_of(static_cast<float>(entry.table[i].value)));
      const double next = i + 1 < entry.table.size()
                              ? entry.table[i + 1].value
                              : 2.0 * entry.table[i].value - entry.table[i - 1].value;  // beyond the max
      entry.threshold_patterns.push_back(reference::bits_of(static_cast<float>((entry.table[i].value + next) / 2.0)));
    }
    formats.push_back(std::move(entry));
  }

  // The patterns to check: all 2^32, or every 65521st plus the neighbourhoods of the thresholds.
  const bool exhaustive = exhaustive_requested();
  const std::uint64_t stride = exhaustive ? 1 : 65521;
  const std::uint64_t strided_count = ((std::uint64_t{1} << 32) + stride - 1) / stride;
  std::int64_t checked = 0;
  std::int64_t failures = 0;
  std::vector<std::string> messages;  // the first few failures, reported after the loops
  auto record = [&messages](const std::optional<std::string>& mismatch) {
    if (!mismatch) return 0;
#pragma omp critical(sweep_messages)
    if (messages.size() < 20) messages.push_back(*mismatch);
    return 1;
  };

  const auto wall_start = std::chrono::steady_clock::now();
  const std::clock_t cpu_start = std::clock();
  for (const auto& entry : formats) {
    // Chunks of 2^20 patterns, shared out among the threads (OpenMP builds) for the full sweep.
    const std::int64_t chunk = std::int64_t{1} << 20;
    const std::int64_t chunk_count = static_cast<std::int64_t>((strided_count + chunk - 1) / chunk);
#pragma omp parallel for schedule(dynamic) reduction(+ : checked, failures) if (exhaustive)
    for (std::int64_t c = 0; c < chunk_count; ++c) {
      const std::uint64_t first = static_cast<std::uint64_t>(c * chunk);
      const std::uint64_t last = std::min<std::uint64_t>(first + static_cast<std::uint64_t>(chunk), strided_count);
      for (std::uint64_t index = first; index < last; ++index) {
        failures += record(sweep_mismatch(entry, static_cast<std::uint32_t>(index * stride)));
        ++checked;
      }
    }
    if (!exhaustive) {
      // Every pattern within 64 fp32 ulps of each value and midpoint, both signs.
      for (const std::uint32_t center : entry.threshold_patterns) {
        for (std::int64_t offset = -64; offset <= 64; ++offset) {
          const std::int64_t pattern = static_cast<std::int64_t>(center) + offset;
          if (pattern < 0 || pattern > 0x7F800000) continue;
          failures += record(sweep_mismatch(entry, static_cast<std::uint32_t>(pattern)));
          failures += record(sweep_mismatch(entry, static_cast<std::uint32_t>(pattern) | 0x80000000U));
          checked += 2;
        }
      }
    }
  }
  const double wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  const double cpu_seconds = static_cast<double>(std::clock() - cpu_start) / CLOCKS_PER_SEC;
  for (const auto& message : messages) ADD_FAILURE() << message;
  EXPECT_EQ(failures, 0);
  if (exhaustive) {
    EXPECT_EQ(checked, static_cast<std::int64_t>(formats.size()) << 32);
  }
  std::printf("encode sweep (%s): %lld patterns checked, %.1f s wall, %.1f s CPU\n",
              exhaustive ? "all 2^32 patterns per format" : "strided subset", static_cast<long long>(checked),
              wall_seconds, cpu_seconds);
}

}  // namespace
