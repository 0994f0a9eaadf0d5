// Analyses as files: a TOML description of which GEMMs to replay, against which reference, with
// which optimizer replay settings, under which named strategies (docs/analysis.md has the schema).
#pragma once

#include <string>
#include <vector>

#include "mxscope/gemm.hpp"
#include "mxscope/reference.hpp"

namespace mxscope {

struct optimizer_settings {
  double sgd_momentum = 0.9;
  double adamw_beta1 = 0.9;
  double adamw_beta2 = 0.95;
  double adamw_eps = 1e-8;
};

// One named strategy, resolved for every GEMM kind (per-GEMM overrides already applied).
struct analysis_strategy {
  std::string name;
  strategy per_gemm[3];  // indexed by static_cast<int>(gemm_kind)
  const strategy& for_gemm(gemm_kind kind) const { return per_gemm[static_cast<int>(kind)]; }
};

struct analysis {
  std::string path;  // where it was read from (for messages)
  std::string text;  // the file's text (for provenance)
  std::string name;
  std::string description;
  std::vector<gemm_kind> gemms{gemm_kind::wgrad};
  reference_kind reference = reference_kind::exact;
  bool attribute = false;
  optimizer_settings optimizer;
  std::vector<analysis_strategy> strategies;
};

// Parses and validates an analysis. Unknown keys, wrong types and bad values throw input_error
// with "file:line:column: ..." naming the key.
analysis parse_analysis(const std::string& text, const std::string& path);
analysis load_analysis(const std::string& path);

}  // namespace mxscope
