// Quantizes a small matrix with the installed library and checks it against the header-only core:
// every dequantized value is decode(code) * 2^e of its block, as docs/numerics.md section 2 says.
#include <cstdio>

#include "mxscope/core/mx.hpp"
#include "mxscope/quantize.hpp"

int main() {
  mxscope::matrix values(2, 64);
  for (std::int64_t i = 0; i < values.size(); ++i) values.values[i] = static_cast<float>((i % 13) - 6) * 0.37f;
  mxscope::quantize_options options;
  options.format = *mxscope::parse_format("mxfp4");
  const mxscope::quantized_tensor q = mxscope::quantize(values, options);
  int wrong = 0;
  for (std::int64_t r = 0; r < 2; ++r) {
    for (std::int64_t c = 0; c < 64; ++c) {
      const int exponent = mxscope::core::scale_exponent(q.scales[r * q.scale_cols + c / 32]);
      const std::uint32_t code = (q.codes[r * 32 + c / 2] >> (4 * (c % 2))) & 0xFU;
      const double expected = mxscope::core::dequantize_element(mxscope::core::element_kind::fp4_e2m1, code, exponent);
      if (static_cast<float>(expected) != q.dequantized.values[r * 64 + c]) ++wrong;
    }
  }
  std::printf("consumer: %d of 128 values differ from the core's decoding\n", wrong);
  return wrong == 0 && q.scales.size() == 4 ? 0 : 1;
}
