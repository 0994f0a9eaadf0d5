// The CLI entry as a library function, so tests run it in-process.
#pragma once

#include <iosfwd>

namespace mxscope::cli {

// Parses argv, runs the command and returns the exit code of the contract:
// 0 ok, 1 a check failed, 2 bad input or usage (message on `err` naming what and where).
int run(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

}  // namespace mxscope::cli
