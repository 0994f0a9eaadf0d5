// Error types that carry the process exit code of the CLI contract.
#pragma once

#include <stdexcept>
#include <string>

namespace mxscope {

// Bad input or usage: the message names the file, the tensor and the field. Exit code 2.
class input_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A check the user asked for did not hold (conformance). Exit code 1.
class check_failed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace mxscope
