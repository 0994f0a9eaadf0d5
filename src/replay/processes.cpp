// Work every rank of a replay does together, and the report when the launcher stops the run
// (src/replay/internal.hpp).
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <exception>

#include "internal.hpp"
#include "mxscope/errors.hpp"

namespace mxscope::replay_internal {

std::string this_host() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "unknown";
  return name;
}

std::vector<std::string> together(process_group& world, const std::function<std::string()>& work) {
  if (world.size() == 1) return {work()};
  std::string text;
  std::exception_ptr failure;
  try {
    text = "ok\n" + work();
  } catch (...) {
    failure = std::current_exception();
    text = "failed\n";
  }
  std::vector<std::string> all = world.all_gather(text);
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r].starts_with("failed\n")) {
      if (static_cast<int>(r) == world.rank()) std::rethrow_exception(failure);
      throw reported_elsewhere(0);  // the reporting rank exits 2 (errors.hpp)
    }
  }
  for (auto& item : all) item.erase(0, 3);
  return all;
}

void report_termination(const fs::path& partial, int ranks, int rank, const std::string& host,
                        const unit_catalog& units, std::ostream& log) {
  const std::size_t unit_count = units.count();
  std::vector<json> states(static_cast<std::size_t>(ranks));
  const auto gone = [&](const json& state) {
    return state.is_object() && state.value("host", "") == host &&
           ::kill(static_cast<pid_t>(state.value("pid", std::int64_t{0})), 0) != 0 && errno == ESRCH;
  };
  for (int r = 0; r < ranks; ++r) {
    states[static_cast<std::size_t>(r)] =
        json::parse(read_text(partial / fmt::format("rank-{:05d}.json", r)), nullptr, false);
  }
  for (int r = 0; r < rank; ++r) {
    if (!gone(states[static_cast<std::size_t>(r)])) return;  // a lower rank reports
  }
  std::string message = "mxscope replay: error: the launcher stopped the run";
  std::size_t stopped_ranks = 0, stopped_units = 0;
  for (int r = 0; r < ranks; ++r) {
    const json& state = states[static_cast<std::size_t>(r)];
    if (!state.is_object()) continue;
    const bool working = state.value("state", "") == "working";
    if (r == rank || (!gone(state) && state.value("host", "") == host)) {
      // Alive: its units in progress are lost with it.
      if (working) ++stopped_ranks, stopped_units += state["units"].size();
      continue;
    }
    std::string units;
    for (const auto& unit : state["units"]) units += (units.empty() ? "" : ", ") + unit.get<std::string>();
    const std::string what = working ? fmt::format("working on {}", units)
                                     : fmt::format("in state '{}'", state.value("state", "?"));
    message += fmt::format("\nrank {} of {} (host {}, pid {}) {} {}", r, ranks, state.value("host", "?"),
                           state.value("pid", std::int64_t{0}), gone(state) ? "is gone; it was" : "was", what);
  }
  if (stopped_ranks > 0) {
    message += fmt::format("\n{} other ranks were stopped with {} units in progress", stopped_ranks, stopped_units);
  }
  std::size_t complete = 0;
  for (std::size_t index = 0; index < unit_count; ++index) complete += fs::exists(partial / units.fragment_name(index));
  message += fmt::format("\n{} of {} units are complete and kept in {}; finish the run with --resume (with any "
                         "number of ranks)\n",
                         complete, unit_count, partial.string());
  log << message << std::flush;
}

}  // namespace mxscope::replay_internal
