// libFuzzer target for the conformance reader: the input is split at "\n--8<--\n" into
// DIR/manifest.json and DIR/case.safetensors, and read_conformance_set(DIR) either returns cases
// whose shapes agree or throws input_error. Anything else is a bug.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_support.hpp"
#include "mxscope/conform.hpp"
#include "mxscope/errors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto& directory = mxscope::fuzzing::scratch_directory("fuzz_conform_manifest");
  const auto parts = mxscope::fuzzing::split_parts(std::string_view(reinterpret_cast<const char*>(data), size), 2);
  mxscope::fuzzing::write_file(directory / "manifest.json", parts[0]);
  mxscope::fuzzing::write_file(directory / "case.safetensors", parts[1]);
  try {
    const mxscope::conform::conformance_set set = mxscope::conform::read_conformance_set(directory);
    for (const auto& one : set.cases) {
      if (one.a.cols != one.b.cols || one.out.rows != one.a.rows || one.out.cols != one.b.rows) {
        mxscope::fuzzing::broken("case shapes agree");
      }
      if (one.out.rows < 1 || one.out.cols < 1 || one.a.cols < 1) mxscope::fuzzing::broken("cases have outputs");
    }
  } catch (const mxscope::input_error&) {
    // The expected outcome for a malformed set.
  }
  return 0;
}
