// Checks on flag text that CLI11's conversions let through.
#pragma once

#include <CLI/CLI.hpp>

#include <algorithm>
#include <string>

namespace mxscope::cli {

// A non-negative decimal integer written as digits only, at most 2^64 - 1: CLI11 converts "-1" to
// an unsigned type as 2^64 - 1 (strtoull's rule), an empty text to 0, "0x20" and "+32" to 32, and a
// value past 2^64 - 1 to 2^64 - 1, each of which would silently change what the user asked for.
inline CLI::Validator digits_only() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const bool digits = !text.empty() && std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
        if (!digits) return "'" + text + "' is not a non-negative integer";
        const std::string significant = text.substr(std::min(text.find_first_not_of('0'), text.size()));
        const std::string largest = "18446744073709551615";
        const bool fits = significant.size() < largest.size() || (significant.size() == largest.size() && significant <= largest);
        return fits ? std::string() : "'" + text + "' is larger than 2^64 - 1";
      },
      "UINT", "digits_only");
}

}  // namespace mxscope::cli
