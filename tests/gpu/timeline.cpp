// GPU test suite: the device timeline (gpu::start_timeline, finish_timeline; `replay --kernel-times`).
// What it must hold on any backend: every kernel queued while it is on is recorded once, with the
// label its thread set, in queue order; times start after the timeline's origin, and one stream's
// operations do not overlap (each stop event is queued before the next operation's start event).
// Nothing is recorded once it has ended.
#include "support.hpp"

namespace gpu_test {

namespace {

mxscope::matrix random_matrix(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  mxscope::matrix values(rows, cols);
  std::uint64_t state = seed;
  for (float& v : values.values) v = static_cast<float>(static_cast<std::int64_t>(split_mix(state) % 2001) - 1000) / 64;
  return values;
}

std::string check_operations(const std::vector<mxscope::timeline::operation>& operations) {
  if (operations.empty()) return "nothing recorded";
  for (std::size_t i = 0; i < operations.size(); ++i) {
    const auto& op = operations[i];
    const std::string where = "operation " + std::to_string(i) + " (" + op.name + ")";
    if (op.name.empty()) return where + ": no name";
    if (!(op.start_ms >= 0.0 && op.stop_ms >= op.start_ms)) {
      return where + ": times " + show(op.start_ms) + " .. " + show(op.stop_ms);
    }
    for (std::size_t j = i + 1; j < operations.size(); ++j) {
      if (operations[j].stream != op.stream) continue;
      if (operations[j].start_ms < op.stop_ms) {
        return where + " ends at " + show(op.stop_ms) + " ms, after the next on its stream starts (" +
               show(operations[j].start_ms) + " ms)";
      }
      break;
    }
  }
  return "";
}

}  // namespace

void timeline_checks(bool small) {
  const std::int64_t rows = small ? 64 : 512, cols = small ? 96 : 1024;
  const mxscope::matrix values = random_matrix(rows, cols, next_seed());
  const mxscope::quantize_options options =
      mx_options(0, 32, 1, core::rounding_mode::rne, core::scale_rule::floor, 32, next_seed());

  run_case("timeline records each kernel once, labelled, in queue order", [&]() -> std::string {
    // Operations per call, from a timeline of one call after a first one outside it (which may
    // set up what later calls reuse); every later call of the same shape queues the same.
    (void)gpu::quantize(values, options);
    gpu::start_timeline();
    const std::string before = gpu::set_timeline_label("one");
    (void)gpu::quantize(values, options);
    const auto one = gpu::finish_timeline();
    gpu::set_timeline_label(before);
    std::size_t kernels_one = 0;
    for (const auto& op : one) kernels_one += op.bytes == 0 && op.name.rfind("memset", 0) != 0 ? 1 : 0;
    if (kernels_one == 0) return "the quantizer's call recorded no kernel";

    gpu::start_timeline();
    gpu::set_timeline_label("first");
    (void)gpu::quantize(values, options);
    if (gpu::set_timeline_label("second") != "first") return "set_timeline_label did not return the label before";
    (void)gpu::quantize(values, options);
    gpu::set_timeline_label(before);
    const auto operations = gpu::finish_timeline();
    const std::string problem = check_operations(operations);
    if (!problem.empty()) return problem;
    if (operations.size() != 2 * one.size()) {
      return "two calls recorded " + std::to_string(operations.size()) + " operations, one call " +
             std::to_string(one.size());
    }
    for (std::size_t i = 0; i < operations.size(); ++i) {
      const std::string want = i < one.size() ? "first" : "second";
      if (operations[i].label != want) return "operation " + std::to_string(i) + " labelled '" + operations[i].label + "'";
      if (operations[i].name != one[i % one.size()].name) return "operation " + std::to_string(i) + " is not the call's";
    }
    return "";
  });

  run_case("timeline records up to its capacity and counts the rest", [&]() -> std::string {
    gpu::start_timeline();
    (void)gpu::quantize(values, options);
    (void)gpu::quantize(values, options);
    const std::size_t all = gpu::finish_timeline().size();
    if (all < 2) return "two calls recorded " + std::to_string(all) + " operations";
    gpu::start_timeline(all - 1);
    (void)gpu::quantize(values, options);
    (void)gpu::quantize(values, options);
    std::int64_t not_recorded = -1;
    const auto capped = gpu::finish_timeline(&not_recorded);
    if (capped.size() != all - 1 || not_recorded != 1) {
      return std::to_string(capped.size()) + " recorded and " + std::to_string(not_recorded) + " counted of " +
             std::to_string(all) + " with room for " + std::to_string(all - 1);
    }
    return "";
  });

  run_case("timeline records nothing after it ends", [&]() -> std::string {
    gpu::start_timeline();
    (void)gpu::quantize(values, options);
    (void)gpu::finish_timeline();
    (void)gpu::quantize(values, options);
    gpu::start_timeline();
    const auto empty = gpu::finish_timeline();
    return empty.empty() ? "" : std::to_string(empty.size()) + " operations recorded with the timeline off";
  });
}

}  // namespace gpu_test
