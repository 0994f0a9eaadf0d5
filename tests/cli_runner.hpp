// The CLI entry run in-process for tests: arguments in, exit code and both streams out.
#pragma once

#include <sstream>
#include <string>
#include <vector>

#include "mxscope/cli/cli.hpp"

namespace mxscope::testing {

struct cli_result {
  int code = -1;
  std::string out;
  std::string err;
};

inline cli_result run_cli(const std::vector<std::string>& arguments) {
  std::vector<const char*> argv{"mxscope"};
  for (const auto& argument : arguments) argv.push_back(argument.c_str());
  std::ostringstream out, err;
  cli_result result;
  result.code = mxscope::cli::run(static_cast<int>(argv.size()), argv.data(), out, err);
  result.out = out.str();
  result.err = err.str();
  return result;
}

// "mxscope a b c": the command line of a failure message.
inline std::string joined(const std::vector<std::string>& arguments) {
  std::string text = "mxscope";
  for (const auto& argument : arguments) text += " " + argument;
  return text;
}

}  // namespace mxscope::testing
