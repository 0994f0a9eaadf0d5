#include "mxscope/cli/cli.hpp"

#include <ostream>

namespace mxscope::cli {
int run(int, const char* const*, std::ostream&, std::ostream& err) {
  err << "mxscope: no command\n";
  return 2;
}
}  // namespace mxscope::cli
