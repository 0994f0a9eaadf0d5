// libFuzzer target for the files of a run directory as report and notebook read them: the input is
// split at "\n--8<--\n" into steps.csv, accumulation.csv and summary.json; load_run either returns
// units whose series are non-empty, or throws input_error. The provenance is then taken as the
// report does. Anything else is a bug.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_support.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/report/run_data.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto& directory = mxscope::fuzzing::scratch_directory("fuzz_run_files");
  const auto parts = mxscope::fuzzing::split_parts(std::string_view(reinterpret_cast<const char*>(data), size), 3);
  mxscope::fuzzing::write_file(directory / "steps.csv", parts[0]);
  mxscope::fuzzing::write_file(directory / "accumulation.csv", parts[1]);
  mxscope::fuzzing::write_file(directory / "summary.json", parts[2]);
  try {
    const mxscope::report::run_data run = mxscope::report::load_run(directory);
    for (const auto& unit : run.units) {
      for (const auto& series : unit.strategies) {
        if (series.steps.empty() || series.accumulation.empty()) mxscope::fuzzing::broken("series non-empty");
      }
      (void)mxscope::report::rank_strategies(unit);
    }
    (void)mxscope::report::provenance_of(run.summary);
  } catch (const mxscope::input_error&) {
    // The expected outcome for malformed run files.
  }
  return 0;
}
