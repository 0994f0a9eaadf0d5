// libFuzzer target for analysis files: any bytes either parse into strategies whose values are in
// their documented ranges or are rejected with input_error. Anything else is a bug.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_support.hpp"
#include "mxscope/analysis.hpp"
#include "mxscope/errors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const mxscope::analysis parsed =
        mxscope::parse_analysis(std::string(reinterpret_cast<const char*>(data), size), "fuzz.toml");
    if (parsed.strategies.empty()) mxscope::fuzzing::broken("at least one strategy");
    if (!(parsed.optimizer.adamw_eps > 0.0) || !std::isfinite(parsed.optimizer.adamw_eps)) {
      mxscope::fuzzing::broken("adamw_eps positive and finite");
    }
    for (const auto& named : parsed.strategies) {
      for (mxscope::gemm_kind kind : {mxscope::gemm_kind::fprop, mxscope::gemm_kind::dgrad, mxscope::gemm_kind::wgrad}) {
        const mxscope::strategy& chosen = named.for_gemm(kind);
        for (const auto* operand : {&chosen.a, &chosen.b}) {
          const int block = operand->quantize.block;
          if (block < 0 || block > (1 << 20)) mxscope::fuzzing::broken("block in range");
          if (operand->quantize.format.scheme == mxscope::quant_scheme::nvfp4 && block != 0 && block != 16) {
            mxscope::fuzzing::broken("nvfp4 blocks of 16");
          }
        }
      }
    }
  } catch (const mxscope::input_error&) {
    // The expected outcome for a malformed analysis.
  }
  return 0;
}
