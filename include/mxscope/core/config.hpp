// Host/device annotation shared by every core header. The core is compiled by the host C++
// compiler, by nvcc for CUDA and by clang as HIP; this macro is the only thing that differs.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIP__)
#define MXSCOPE_HD __host__ __device__
#define MXSCOPE_DEVICE_COMPILER 1
#else
#define MXSCOPE_HD
#endif

#include <cstdint>
#include <cstring>

namespace mxscope::core {

// Bit casts usable on host and device (std::bit_cast is not constexpr-callable from device code
// in every toolchain we target, and memcpy of a trivially copyable value is what it lowers to).
MXSCOPE_HD constexpr std::uint32_t float_bits(float value) { return __builtin_bit_cast(std::uint32_t, value); }
MXSCOPE_HD constexpr float bits_float(std::uint32_t bits) { return __builtin_bit_cast(float, bits); }
MXSCOPE_HD constexpr std::uint64_t double_bits(double value) { return __builtin_bit_cast(std::uint64_t, value); }
MXSCOPE_HD constexpr double bits_double(std::uint64_t bits) { return __builtin_bit_cast(double, bits); }

}  // namespace mxscope::core
