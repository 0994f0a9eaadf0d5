// One step of one (layer, GEMM) of the replay: the reference, each unit's product, its comparison
// with the reference, the cross-step state and the attribution, each where its data lives (on the
// GPU through src/backend, or on the host).
#pragma once

#include <array>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "../backend/backend.hpp"
#include "mxscope/analysis.hpp"
#include "mxscope/compare.hpp"
#include "mxscope/device.hpp"
#include "mxscope/gemm.hpp"
#include "mxscope/io/dump.hpp"
#include "rows.hpp"

namespace mxscope::replay_internal {

// What one step of one (layer, GEMM) reads: the entry, its operands (with their device copies in
// compute.resident_operands), where the work runs, the analysis and the step's position t (1-based).
struct step_inputs {
  const io::dump_entry& entry;
  const gemm_operands& operands;
  compute_device device;
  gemm_options& compute;
  placement_counts& placed;
  const analysis& parsed;
  bool attribute;
  std::int64_t t;
  std::ostream& log;
};

// Seconds spent in the reference (and its cross-step state) and in the strategies.
struct step_times {
  double reference = 0.0;
  double strategies = 0.0;
};

// Step t of one (layer, GEMM) for this rank's units there (unit_texts[u] names units[u]): the
// reference and its cross-step state, then each unit's product, comparison, cross-step state,
// attribution and rows. `doing` names the work in progress (for a failure message).
void replay_gemm_step(replay_rows::gemm_state& state, const std::vector<std::string>& unit_texts,
                      const step_inputs& in, std::string& doing, step_times& times);

}  // namespace mxscope::replay_internal
