// mxscope conform DUMP [--fit [--holdout]] [--expect MODEL] [--cases PREFIX] | --self-test [--device cpu|gpu]: does the hardware
// compute what the recorded recipe (quantizer) or an accumulation model (GEMM) says, bit for bit?
// docs/conformance.md describes the checks and the output.
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <filesystem>
#include <ostream>

#include "commands.hpp"
#include "validators.hpp"
#include "mxscope/conform.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/io/dump.hpp"

namespace mxscope::cli {

namespace {

struct conform_options {
  std::string directory;
  bool fit = false;
  bool holdout = false;
  std::string expect;
  bool self_test = false;
  std::string device = "cpu";
  std::size_t max_listed = 10;
  std::string cases;  // GEMM cases: only those whose names start with this
};

std::string hex_bits(std::uint32_t bits) { return fmt::format("0x{:08x}", bits); }

std::string histogram_text(const std::array<std::int64_t, ulp_bucket_count>& histogram) {
  std::string text;
  for (int bucket = 0; bucket < ulp_bucket_count; ++bucket) {
    const std::int64_t count = histogram[static_cast<std::size_t>(bucket)];
    if (count == 0) continue;
    std::string range;
    if (bucket == 0) {
      range = "0";
    } else if (bucket == 1) {
      range = "1";
    } else if (bucket == ulp_bucket_count - 1) {
      range = fmt::format(">={}", std::uint64_t{1} << (bucket - 1));
    } else {
      range = fmt::format("{}-{}", std::uint64_t{1} << (bucket - 1), (std::uint64_t{1} << bucket) - 1);
    }
    if (!text.empty()) text += ' ';
    text += fmt::format("{}:{}", range, count);
  }
  return text.empty() ? "-" : text;
}

void print_agreement_row(const conform::model_agreement& agreement, std::ostream& out) {
  out << fmt::format("{:<24} {:>9} {:>9} {:>11.6f} {:>5} {:>10}  {}\n", agreement.name, agreement.matches,
                     agreement.compared, agreement.match_rate(), agreement.nan_mismatches, agreement.max_ulps,
                     histogram_text(agreement.histogram));
}

// Matches case by case (the evidence per K of a capture).
void print_per_case(const conform::model_agreement& agreement, std::ostream& out) {
  out << fmt::format("per case, {}:\n", agreement.name);
  for (const auto& one : agreement.per_case) {
    const double rate = one.compared == 0 ? 1.0 : static_cast<double>(one.matches) / static_cast<double>(one.compared);
    out << fmt::format("  {:<24} {:>9} of {:>9}  {:.6f}\n", io::printable_name(one.case_name), one.matches,
                       one.compared, rate);
  }
}

void print_agreement_header(std::ostream& out) {
  out << fmt::format("{:<24} {:>9} {:>9} {:>11} {:>5} {:>10}  {}\n", "model", "matches", "compared", "match_rate",
                     "nan", "max_ulps", "ulp_histogram");
}

void print_worst(const conform::model_agreement& agreement, std::ostream& out) {
  if (agreement.worst.empty()) return;
  out << fmt::format("worst entries of {}:\n", agreement.name);
  out << fmt::format("  {:<20} {:>5} {:>5} {:>14} {:>10} {:>14} {:>10} {:>8}\n", "case", "row", "col", "hardware",
                     "bits", "model", "bits", "ulps");
  for (const auto& entry : agreement.worst) {
    out << fmt::format("  {:<20} {:>5} {:>5} {:>14.7g} {:>10} {:>14.7g} {:>10} {:>8}\n", io::printable_name(entry.case_name),
                       entry.row, entry.col, entry.hardware, hex_bits(core::float_bits(entry.hardware)), entry.model,
                       hex_bits(core::float_bits(entry.model)),
                       entry.ulps == std::numeric_limits<std::uint64_t>::max() ? std::string("nan") : std::to_string(entry.ulps));
  }
}

int run_quantizer_conformance(const conform_options& options, std::ostream& out) {
  const auto operands = conform::load_quantizer_operands(options.directory);
  out << fmt::format("conform quantizer {}: {} hardware-quantized operands\n", options.directory, operands.size());
  if (operands.empty()) {
    out << "no entry carries hardware-quantized operands (<t>.codes / <t>.scales): nothing to check\n";
    return 0;
  }
  std::size_t exact = 0;
  for (const auto& operand : operands) {
    const conform::quantizer_check check =
        conform::check_quantizer(operand.rotated_input, operand.hardware, operand.recorded, options.max_listed);
    exact += check.exact();
    out << fmt::format("operand {}: recipe {}: elements {}/{} match, scales {}/{} match: {}\n", operand.label,
                       check.recipe, check.matching_elements, check.elements, check.matching_scales, check.blocks,
                       check.exact() ? "reproduced" : "MISMATCH");
    if (check.exact()) continue;
    std::string counts;
    for (int kind = 0; kind < conform::mismatch_kind_count; ++kind) {
      if (check.counts[static_cast<std::size_t>(kind)] == 0) continue;
      counts += fmt::format(" {} {}", conform::mismatch_kind_name(static_cast<conform::mismatch_kind>(kind)),
                            check.counts[static_cast<std::size_t>(kind)]);
    }
    out << fmt::format("  mismatches by kind:{}\n", counts);
    out << fmt::format("  {:<28} {:>6} {:>6} {:>11} {:>9} {:>11} {:>15} {:>17}\n", "kind", "row", "col", "input_bits",
                       "hw_code", "recomputed", "hw_scale_code", "recomputed_scale");
    for (const auto& listed : check.listed) {
      out << fmt::format("  {:<28} {:>6} {:>6} {:>11} {:>9} {:>11} {:>15} {:>17}\n",
                         std::string(conform::mismatch_kind_name(listed.kind)) + (listed.scale ? " (scale)" : ""),
                         listed.row, listed.col, hex_bits(listed.input_bits),
                         listed.scale ? "-" : fmt::format("0x{:02x}", listed.hardware_code),
                         listed.scale ? "-" : fmt::format("0x{:02x}", listed.recomputed_code),
                         fmt::format("0x{:02x}", listed.hardware_scale), fmt::format("0x{:02x}", listed.recomputed_scale));
    }
  }
  out << fmt::format("summary: {} of {} operands reproduce exactly under their recorded recipes\n", exact, operands.size());
  if (options.fit) {
    const auto rows = conform::fit_quantizer(operands);
    out << "fit: scale rule x rounding mode over every operand (sr with the recorded seed, step and sr_bits)\n";
    out << fmt::format("{:<12} {:>12} {:>12}\n", "candidate", "mismatches", "compared");
    for (const auto& row : rows) out << fmt::format("{:<12} {:>12} {:>12}\n", row.candidate.name(), row.mismatches, row.compared);
    std::vector<std::string> explaining;
    for (const auto& row : rows) {
      if (row.mismatches == 0) explaining.push_back(row.candidate.name());
    }
    if (explaining.empty()) {
      out << fmt::format("fit: no scale rule x rounding mode explains the hardware exactly; closest: {} with {} "
                         "mismatches of {}\n",
                         rows.front().candidate.name(), rows.front().mismatches, rows.front().compared);
    } else {
      out << fmt::format("fit: explained exactly by {}\n", fmt::join(explaining, ", "));
    }
  }
  return exact == operands.size() ? 0 : 1;
}

// The fit of one set of cases (one hardware path): the finalists, the best model per case and the
// verdict, which it also returns ("MODEL reproduces every output bit" or "best MODEL ...").
std::string print_fit(const std::vector<conform::gemm_case>& cases, std::size_t max_listed, std::ostream& out) {
  std::int64_t outputs = 0;
  for (const auto& one : cases) outputs += one.out.size();
  const conform::gemm_fit fit = conform::fit_gemm(cases, conform::fit_family(), 8, 8, max_listed);
  out << fmt::format("fit: {} models screened on {} sampled outputs; finalists on all {} outputs:\n", fit.screened,
                     fit.sample_entries, outputs);
  print_agreement_header(out);
  for (const auto& finalist : fit.finalists) print_agreement_row(finalist, out);
  const auto& best = fit.finalists.front();
  print_per_case(best, out);
  const std::string verdict =
      best.exact() ? fmt::format("{} reproduces every output bit ({} of {})", best.name, best.matches, best.compared)
                   : fmt::format("no model of the family reproduces every output; best: {} with match rate {:.6f} "
                                 "({} of {})",
                                 best.name, best.match_rate(), best.matches, best.compared);
  out << "fit: " << verdict << "\n";
  if (!best.exact()) print_worst(best, out);
  if (fit.tied.size() > 1) out << fmt::format("fit: tied at the top: {}\n", fmt::join(fit.tied, ", "));
  return verdict;
}

// The held-out checks of one path (conform::holdout_splits): fit on one half, predict the other.
// Returns false when a fitted model (any of those tied at the top) misses a held-out output.
bool print_holdout(const std::vector<conform::gemm_case>& cases, std::ostream& out) {
  bool all_predicted = true;
  for (const auto& split : conform::holdout_splits(cases)) {
    const conform::gemm_fit fit = conform::fit_gemm(split.fitted, conform::fit_family(), 8, 8, 0);
    const auto& best = fit.finalists.front();
    out << fmt::format("holdout {}: fit on {} cases ({}): {} ({} of {} outputs)\n", split.rule, split.fitted.size(),
                       split.fitted_label, fmt::join(fit.tied, ", "), best.matches, best.compared);
    for (const auto& finalist : fit.finalists) {
      if (finalist.matches != best.matches) continue;
      const auto predicted = conform::check_model(split.held_out, finalist.model, 0);
      all_predicted = all_predicted && predicted.exact() && best.exact();
      out << fmt::format("holdout {}: {} predicts the {} held-out cases ({}): {} of {} outputs ({})\n", split.rule,
                         finalist.name, split.held_out.size(), split.held_out_label, predicted.matches,
                         predicted.compared, predicted.exact() ? "every bit" : "NOT exact");
    }
  }
  return all_predicted;
}

// The convert cases: every rounding x overflow model's matches; the models that reproduce every code.
void print_converts(const std::vector<conform::convert_case>& converts, std::size_t max_listed, std::ostream& out) {
  for (const auto& one : converts) {
    const auto call = one.metadata.find("call");
    out << fmt::format("convert case {}: {} values to {}{}\n", io::printable_name(one.name), one.in.size(),
                       core::spec(one.kind).name,
                       call != one.metadata.end() ? ", " + io::printable_name(call->second) : std::string());
    const auto rows = conform::check_converts(one, max_listed);
    std::vector<std::string> exact;
    for (const auto& row : rows) {
      out << fmt::format("  {:<16} {:>9} of {:>9}  {:.6f}\n", row.name, row.matches, row.compared,
                         static_cast<double>(row.matches) / static_cast<double>(row.compared));
      if (row.exact()) exact.push_back(row.name);
    }
    if (!exact.empty()) {
      out << fmt::format("convert {}: reproduced exactly by {}\n", io::printable_name(one.name), fmt::join(exact, ", "));
      continue;
    }
    const auto best = std::max_element(rows.begin(), rows.end(),
                                       [](const auto& a, const auto& b) { return a.matches < b.matches; });
    out << fmt::format("convert {}: no model reproduces every code; best {} ({} of {}); first differences:\n",
                       io::printable_name(one.name), best->name, best->matches, best->compared);
    for (const std::int64_t i : best->first_mismatches) {
      const float value = one.in[static_cast<std::size_t>(i)];
      out << fmt::format("  in[{}] = {:.9g} (0x{:08x}): hardware 0x{:02x}\n", i, value, std::bit_cast<std::uint32_t>(value),
                         one.out[static_cast<std::size_t>(i)]);
    }
  }
}

int run_gemm_conformance(const conform_options& options, std::ostream& out, std::ostream& err) {
  conform::conformance_set set = conform::read_conformance_set(options.directory);
  if (!options.cases.empty()) {
    const auto unnamed = [&](const auto& one) { return !one.name.starts_with(options.cases); };
    std::erase_if(set.converts, unnamed);
    if (set.converts.empty()) {
      set.cases = conform::cases_named(set.cases, options.cases, "--cases");  // throws when none is named
    } else {
      std::erase_if(set.cases, unnamed);
    }
  }
  print_converts(set.converts, options.max_listed, out);
  if (set.cases.empty()) return 0;
  std::int64_t outputs = 0;
  for (const auto& one : set.cases) outputs += one.out.size();
  out << fmt::format("conform gemm {}: {} cases, {} outputs\n", options.directory, set.cases.size(), outputs);
  out << fmt::format("source {}\n", set.source_json);
  for (const auto& one : set.cases) {
    out << fmt::format("case {}: {} [{} x {}] x [{} x {}]^T, a {}, b {}\n", io::printable_name(one.name), one.kind,
                       one.a.rows, one.a.cols, one.b.rows, one.b.cols, format_name(one.a.options.format),
                       format_name(one.b.options.format));
  }
  print_agreement_header(out);
  for (const auto& model : conform::standard_models()) {
    const auto agreement = conform::check_model(set.cases, model, options.max_listed);
    print_agreement_row(agreement, out);
  }
  int code = 0;
  if (options.fit) {
    // One fit per hardware path: cases captured through different calls accumulate differently.
    const auto groups = conform::cases_by_path(set.cases);
    if (groups.size() == 1) {
      print_fit(set.cases, options.max_listed, out);
      if (options.holdout && !print_holdout(set.cases, out)) code = 1;
    } else {
      out << fmt::format("fit: {} hardware paths (the cases' call and output rounding), one fit each\n",
                         groups.size());
      std::vector<std::string> verdicts;
      for (std::size_t i = 0; i < groups.size(); ++i) {
        const auto& [path, cases] = groups[i];
        out << fmt::format("path {}: {} ({} cases)\n", i + 1, io::printable_name(path), cases.size());
        verdicts.push_back(fmt::format("path {}: {}", i + 1, print_fit(cases, options.max_listed, out)));
        if (options.holdout && !print_holdout(cases, out)) code = 1;
      }
      for (const auto& verdict : verdicts) out << "fit " << verdict << "\n";
    }
    if (code != 0) err << "mxscope conform: check failed: a model fitted on half the cases mispredicts the other half\n";
  }
  if (!options.expect.empty()) {
    const accumulation_model model = parse_accumulation_model(options.expect, "expect");
    const auto agreement = conform::check_model(set.cases, model, options.max_listed);
    out << fmt::format("expect {}: {} of {} outputs match (rate {:.6f})\n", agreement.name, agreement.matches,
                       agreement.compared, agreement.match_rate());
    print_per_case(agreement, out);
    if (!agreement.exact()) {
      print_worst(agreement, out);
      err << fmt::format("mxscope conform: check failed: {} does not reproduce {} of {} outputs\n", agreement.name,
                         agreement.compared - agreement.matches, agreement.compared);
      code = 1;
    }
  }
  return code;
}

int run_self_test(const conform_options& options, std::ostream& out, std::ostream& err) {
  conform::self_test_device device = conform::self_test_device::cpu;
  if (options.device == "gpu") {
    device = conform::self_test_device::gpu;
  } else if (options.device != "cpu") {
    throw input_error(fmt::format("field '--device': '{}': expected cpu or gpu", options.device));
  }
  const auto rows = conform::self_test(device);
  std::size_t identical = 0;
  for (const auto& row : rows) {
    identical += row.identical();
    out << fmt::format("{:<70} {:>8} compared {:>6} differ  {}\n", row.kernel, row.compared, row.differing,
                       row.identical() ? "bit-exact" : "DIFFERS");
  }
  out << fmt::format("self-test ({}): {} of {} kernels bit-exact against the canonical paths\n", options.device,
                     identical, rows.size());
  if (identical != rows.size()) {
    err << "mxscope conform: check failed: a fast path differs from the canonical path\n";
    return 1;
  }
  return 0;
}

int run_conform(const conform_options& options, std::ostream& out, std::ostream& err) {
  if (options.holdout && !options.fit) throw input_error("field '--holdout': needs --fit");
  if (options.self_test) {
    if (!options.directory.empty() || options.fit || !options.expect.empty() || !options.cases.empty()) {
      throw input_error("field '--self-test': takes no DUMP, --fit, --expect or --cases");
    }
    return run_self_test(options, out, err);
  }
  if (options.directory.empty()) throw input_error("field 'DUMP': a dump or conformance directory is required");
  if (options.device != "cpu") throw input_error("field '--device': only --self-test runs on a device");
  const std::string format = conform::manifest_format(options.directory);
  if (format == io::dump_format_name) {
    if (!options.expect.empty()) throw input_error("field '--expect': applies to GEMM conformance cases only");
    if (!options.cases.empty()) throw input_error("field '--cases': applies to GEMM conformance cases only");
    if (options.holdout) throw input_error("field '--holdout': applies to GEMM conformance cases only");
    return run_quantizer_conformance(options, out);
  }
  if (format == conform::conformance_format_name) return run_gemm_conformance(options, out, err);
  throw input_error(fmt::format("{}/manifest.json: field 'format': '{}': expected \"{}\" or \"{}\"", options.directory,
                                io::printable_name(format), io::dump_format_name, conform::conformance_format_name));
}

}  // namespace

void add_conform_command(CLI::App& app, command_list& commands) {
  auto options = std::make_shared<conform_options>();
  CLI::App* command = app.add_subcommand(
      "conform", "Check hardware-quantized operands and hardware GEMM outputs against the recipes and models");
  command->add_option("DUMP", options->directory, "Dump directory (quantizer check) or conformance directory (GEMM)");
  command->add_flag("--fit", options->fit, "Search scale rules x roundings / accumulation models for an exact fit");
  command->add_flag("--holdout", options->holdout,
                    "With --fit on GEMM cases: also fit each path on half its cases (by K, by operand class) and "
                    "check the fitted model on the other half");
  command->add_option("--expect", options->expect, "GEMM cases: exit 1 unless MODEL reproduces every output bit");
  command->add_flag("--self-test", options->self_test, "Compare the fast paths with the canonical paths");
  command->add_option("--device", options->device, "Self-test device: cpu or gpu");
  command->add_option("--max-listed", options->max_listed, "Mismatches / worst entries listed (default 10)")
      ->check(digits_only());
  command->add_option("--cases", options->cases, "GEMM cases: check only the cases whose names start with PREFIX");
  commands.push_back({command, [options](std::ostream& out, std::ostream& err) { return run_conform(*options, out, err); }});
}

}  // namespace mxscope::cli
