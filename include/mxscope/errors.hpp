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

// A failure of a multi-process run that another process of the run reports (docs/scaling.md): this
// process only exits with `code`, printing nothing, so the message appears once. The replay gives
// code 0 here: a launcher (mpirun, srun --kill-on-bad-exit) ends the whole job when any rank exits
// non-zero, which could kill the reporting rank before its message is out; that rank's own exit
// code (2) is the job's.
class reported_elsewhere : public std::runtime_error {
 public:
  explicit reported_elsewhere(int code) : std::runtime_error("reported by another process"), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

}  // namespace mxscope
