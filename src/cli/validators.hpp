// Checks on flag text that CLI11's conversions let through.
#pragma once

#include <CLI/CLI.hpp>

#include <algorithm>
#include <string>

namespace mxscope::cli {

// A non-negative decimal integer written as digits only: CLI11 converts "-1" to an unsigned type
// as 2^64 - 1 (strtoull's rule), which would turn a typo into the largest value.
inline CLI::Validator digits_only() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const bool digits = !text.empty() && std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
        return digits ? std::string() : "'" + text + "' is not a non-negative integer";
      },
      "UINT", "digits_only");
}

}  // namespace mxscope::cli
