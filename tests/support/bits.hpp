// Bit patterns of floating-point values, and their text in failure messages: the hexadecimal
// float and its bits (bitwise checks need both to be readable).
#pragma once

#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>

namespace mxscope::testing {

inline std::uint64_t bits_of(double v) {
  std::uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits;
}

inline std::uint32_t bits_of(float v) {
  std::uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits;
}

inline std::string hex(double v) {
  std::ostringstream out;
  out << std::hexfloat << v << " (0x" << std::hex << bits_of(v) << ")";
  return out.str();
}

inline std::string hex(float v) {
  std::ostringstream out;
  out << std::hexfloat << v << " (0x" << std::hex << bits_of(v) << ")";
  return out.str();
}

}  // namespace mxscope::testing
