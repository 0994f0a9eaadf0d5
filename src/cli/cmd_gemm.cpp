// mxscope gemm: one emulated GEMM of a linear layer (fprop, dgrad or wgrad) from the operands in a
// safetensors file, compared with a reference GEMM of the unquantized operands. Writes "out" (the
// emulated result, fp32) and "ref" (the reference, fp64) with the full recipe in the metadata, and
// prints the comparison as a table or as JSON.
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>

#include "commands.hpp"
#include "mxscope/compare.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/io/atomic_file.hpp"
#include "mxscope/gemm.hpp"
#include "mxscope/io/safetensors.hpp"
#include "mxscope/device.hpp"
#include "mxscope/reference.hpp"

namespace mxscope::cli {

namespace {

struct gemm_command_options {
  std::string input;
  std::string output;
  std::string gemm;
  std::string accumulation;
  std::string reference = "exact";
  std::string output_rounding = "fp32";
  std::string format_a;
  std::string format_b;
  std::int64_t certify = 0;
  std::string device = "cpu";
  bool json = false;
  strategy_flags strategy;
};

// The quantization block of an operand (0 for formats without blocks).
int block_of(const quantize_options& options) {
  const quant_scheme scheme = options.format.scheme;
  if (scheme != quant_scheme::mx && scheme != quant_scheme::nvfp4) return 0;
  return options.block != 0 ? options.block : options.format.default_block;
}

std::vector<std::uint8_t> bytes_of(const matrix64& values) {
  std::vector<std::uint8_t> bytes(values.values.size() * sizeof(double));
  std::memcpy(bytes.data(), values.values.data(), bytes.size());
  return bytes;
}

// JSON has no inf or NaN: those become null.
nlohmann::ordered_json number(double value) {
  if (!std::isfinite(value)) return nullptr;
  return value;
}

nlohmann::ordered_json operand_json(const operand_summary& summary, const std::string& format) {
  nlohmann::ordered_json json;
  json["tensor"] = summary.name;
  json["format"] = format;
  json["axis"] = summary.axis;
  json["elements"] = summary.elements;
  json["nonzero"] = summary.nonzero_inputs;
  json["flushed"] = summary.flushed;
  json["saturated"] = summary.saturated;
  json["nonfinite"] = summary.nonfinite_inputs;
  json["underflow_frac"] = underflow_fraction(summary);
  json["saturate_frac"] = saturate_fraction(summary);  // over all inputs (docs/metrics.md)
  json["snr_db"] = number(snr_db(summary));
  return json;
}

// A warning on stderr for each operand holding NaN or infinity: the GEMM still runs (the user may
// want to see what the format does with them), but its metrics will be NaN.
void warn_nonfinite(const io::safetensors_reader& reader, std::string_view name, const matrix& values,
                    std::ostream& err) {
  std::int64_t nan = 0, infinite = 0;
  for (const float v : values.values) {
    nan += std::isnan(v);
    infinite += std::isinf(v);
  }
  if (nan == 0 && infinite == 0) return;
  err << fmt::format("mxscope gemm: warning: {}: tensor '{}' holds {} NaN and {} infinite values; the error metrics "
                     "will be NaN\n",
                     reader.label(), name, nan, infinite);
}

// One `mxscope gemm` run as the outputs see it: the flags, the operands' file, the result, its
// reference and comparison (what the output file, the JSON and the table are made from).
struct gemm_study {
  const gemm_command_options& options;
  gemm_kind kind;
  gemm_layout layout;
  const std::string& format_a;
  const std::string& format_b;
  const mxscope::strategy& chosen;
  const accumulation_model& model;
  output_rounding rounding;
  reference_kind reference_choice;
  const std::string& source_label;
  const gemm_result& result;
  const reference_result& reference;
  const comparison& metrics;
  const std::optional<certification>& certified;
  std::int64_t reduction;
};

// The output file: the emulated result, the reference and the recipe.
void write_gemm_file(const gemm_study& study) {
  const gemm_command_options& options = study.options;
  const gemm_result& result = study.result;
  const reference_result& reference = study.reference;
  const mxscope::strategy& chosen = study.chosen;
  io::safetensors_writer writer;
  writer.add_matrix("out", result.out);
  writer.add("ref", io::dtype::f64, {reference.fp64.rows, reference.fp64.cols}, bytes_of(reference.fp64));
  if (study.model.kind == accumulation_kind::exact) {
    writer.add("out_fp64", io::dtype::f64, {result.exact.rows, result.exact.cols}, bytes_of(result.exact));
  }
  writer.set_metadata("gemm", std::string(gemm_kind_name(study.kind)));
  writer.set_metadata("format_a", study.format_a);
  writer.set_metadata("format_b", study.format_b);
  writer.set_metadata("operand_a", std::string(study.layout.a_name));
  writer.set_metadata("operand_b", std::string(study.layout.b_name));
  writer.set_metadata("block_a", std::to_string(block_of(chosen.a.quantize)));
  writer.set_metadata("block_b", std::to_string(block_of(chosen.b.quantize)));
  writer.set_metadata("accum", accumulation_model_name(study.model));
  writer.set_metadata("output", std::string(output_rounding_name(study.rounding)));
  writer.set_metadata("reference", std::string(reference_kind_name(study.reference_choice)));
  writer.set_metadata("rounding", std::string(rounding_name(chosen.a.quantize.rounding)));
  writer.set_metadata("scale_rule", std::string(scale_rule_name(chosen.a.quantize.rule)));
  writer.set_metadata("rotation", options.strategy.rotation);
  writer.set_metadata("signs", std::string(sign_policy_name(chosen.rotation_signs)));
  writer.set_metadata("seed", std::to_string(options.strategy.seed));
  writer.set_metadata("step", std::to_string(options.strategy.step));
  writer.set_metadata("sr_bits", std::to_string(chosen.a.quantize.sr_bits));
  writer.set_metadata("layer", options.strategy.layer);
  writer.set_metadata("seed_policy", options.strategy.seed_policy);
  writer.set_metadata("mxscope_version", version_text());
  writer.set_metadata("source_file", study.source_label);
  writer.set_metadata("out_layout", fmt::format("{} [{}, {}] = A B^T with A = {} and B = {} in the orientation of "
                                                "docs/numerics.md (Accumulation models)",
                                                gemm_kind_name(study.kind), result.out.rows, result.out.cols,
                                                study.layout.a_name, study.layout.b_name));
  writer.write(options.output);
}

double exact_fraction_of(const comparison& metrics) {
  return metrics.ulp.compared > 0 ? static_cast<double>(metrics.ulp.histogram[0]) / static_cast<double>(metrics.ulp.compared)
                                  : 0.0;
}

// `--json`: the run, the recipe, the reference, the metrics, the operands and the certification.
void print_gemm_json(const gemm_study& study, std::ostream& out) {
  const gemm_command_options& options = study.options;
  const gemm_result& result = study.result;
  const reference_result& reference = study.reference;
  const comparison& metrics = study.metrics;
  const mxscope::strategy& chosen = study.chosen;
  nlohmann::ordered_json json;
  json["gemm"] = gemm_kind_name(study.kind);
  json["input"] = study.source_label;
  json["output"] = options.output;
  json["rows"] = result.out.rows;
  json["cols"] = result.out.cols;
  json["reduction"] = study.reduction;
  nlohmann::ordered_json recipe;
  recipe["format_a"] = study.format_a;
  recipe["format_b"] = study.format_b;
  recipe["rounding"] = rounding_name(chosen.a.quantize.rounding);
  recipe["scale_rule"] = scale_rule_name(chosen.a.quantize.rule);
  recipe["rotation"] = options.strategy.rotation;
  recipe["signs"] = sign_policy_name(chosen.rotation_signs);
  recipe["seed"] = options.strategy.seed;
  recipe["step"] = options.strategy.step;
  recipe["sr_bits"] = chosen.a.quantize.sr_bits;
  recipe["layer"] = options.strategy.layer;
  recipe["seed_policy"] = options.strategy.seed_policy;
  recipe["accum"] = accumulation_model_name(study.model);
  recipe["output"] = output_rounding_name(study.rounding);
  json["strategy"] = recipe;
  nlohmann::ordered_json reference_json;
  reference_json["kind"] = reference_kind_name(study.reference_choice);
  reference_json["error_bound"] = number(reference.error_bound);
  reference_json["certified_entries"] = reference.stats.certified_entries;
  reference_json["fallback_entries"] = reference.stats.fallback_entries;
  reference_json["nonfinite_entries"] = reference.stats.nonfinite_entries;
  json["reference"] = reference_json;
  nlohmann::ordered_json metrics_json;
  metrics_json["rel_err"] = number(metrics.rel_err);
  metrics_json["cosine"] = number(metrics.cosine);
  metrics_json["bias"] = number(metrics.bias);
  metrics_json["orth_err"] = number(metrics.orth_err);
  metrics_json["max_abs_err"] = number(metrics.max_abs_err);
  metrics_json["error_norm"] = number(metrics.error_norm);
  metrics_json["reference_norm"] = number(metrics.reference_norm);
  metrics_json["estimate_norm"] = number(metrics.estimate_norm);
  metrics_json["zero_reference"] = metrics.zero_reference;
  metrics_json["nonfinite_estimate"] = metrics.nonfinite_estimate;
  nlohmann::ordered_json ulp;
  ulp["max"] = metrics.ulp.max;
  ulp["mean"] = number(metrics.ulp.mean);
  ulp["exact_frac"] = exact_fraction_of(metrics);
  ulp["compared"] = metrics.ulp.compared;
  ulp["nan_pairs"] = metrics.ulp.nan_pairs;
  ulp["histogram"] = metrics.ulp.histogram;
  metrics_json["ulp"] = ulp;
  json["metrics"] = metrics_json;
  json["operands"] = {{"a", operand_json(result.a, study.format_a)}, {"b", operand_json(result.b, study.format_b)}};
  if (study.certified) {
    const certification& certified = *study.certified;
    nlohmann::ordered_json certification_json;
    certification_json["entries_checked"] = certified.entries_checked;
    certification_json["max_ulp_fp64"] = certified.max_ulp_fp64;
    certification_json["max_ulp_fp32"] = certified.max_ulp_fp32;
    certification_json["max_abs_error"] = number(certified.max_abs_error);
    certification_json["bound_violations"] = certified.bound_violations;
    certification_json["max_bound_ratio"] = number(certified.max_bound_ratio);
    certification_json["passed"] = certified.passed;
    json["certification"] = certification_json;
  }
  json["fast_path_fallback_entries"] = result.fallback_entries;
  out << json.dump(2) << '\n';
}

// The table: a header line, then one metric per row.
void print_gemm_table(const gemm_study& study, std::ostream& out) {
  const gemm_result& result = study.result;
  const comparison& metrics = study.metrics;
  out << fmt::format("gemm {} -> {}: [{}, {}] = {} ({}) x {} ({}), K = {}, accum {}, output {}, reference {}\n",
                     gemm_kind_name(study.kind), study.options.output, result.out.rows, result.out.cols,
                     study.layout.a_name, study.format_a, study.layout.b_name, study.format_b, study.reduction,
                     accumulation_model_name(study.model), output_rounding_name(study.rounding),
                     reference_kind_name(study.reference_choice));
  const auto row = [&out](std::string_view name, const std::string& value) { out << fmt::format("{:<20} {}\n", name, value); };
  const auto real = [](double value) { return fmt::format("{:.9g}", value); };
  row("metric", "value");
  row("rel_err", real(metrics.rel_err));
  row("cosine", real(metrics.cosine));
  row("bias", real(metrics.bias));
  row("orth_err", real(metrics.orth_err));
  row("max_abs_err", real(metrics.max_abs_err));
  row("ulp_max", std::to_string(metrics.ulp.max));
  row("ulp_mean", real(metrics.ulp.mean));
  row("ulp_exact_frac", real(exact_fraction_of(metrics)));
  row("nonfinite_out", std::to_string(metrics.nonfinite_estimate));
  for (const operand_summary* summary : {&result.a, &result.b}) {
    const std::string prefix = fmt::format("{}.", summary->name);
    row(prefix + "underflow_frac", real(underflow_fraction(*summary)));
    row(prefix + "saturate_frac", real(saturate_fraction(*summary)));
    row(prefix + "snr_db", fmt::format("{:.6f}", snr_db(*summary)));
  }
  row("reference_bound", real(study.reference.error_bound));
  if (study.certified) {
    row("certified_entries", std::to_string(study.certified->entries_checked));
    row("certify_ulp_fp64", std::to_string(study.certified->max_ulp_fp64));
    row("certify_ulp_fp32", std::to_string(study.certified->max_ulp_fp32));
    row("certify_passed", study.certified->passed ? "yes" : "no");
  }
}

int run_gemm_command(const gemm_command_options& options, std::ostream& out, std::ostream& err) {
  // Every flag is checked before any file is touched.
  const auto kind = parse_gemm_kind(options.gemm);
  if (!kind) throw input_error(fmt::format("--gemm: unknown GEMM '{}' (expected fprop, dgrad or wgrad)", options.gemm));
  const accumulation_model model = parse_accumulation_model(options.accumulation, "--accum");
  const auto reference_kind = parse_reference_kind(options.reference);
  if (!reference_kind) {
    throw input_error(fmt::format("--reference: unknown reference '{}' (expected exact or fp64)", options.reference));
  }
  const auto output_rounding = parse_output_rounding(options.output_rounding);
  if (!output_rounding) {
    throw input_error(fmt::format("--output: unknown output rounding '{}' (expected fp32 or bf16)", options.output_rounding));
  }
  if (options.certify < 0) throw input_error(fmt::format("--certify: must be >= 0, got {}", options.certify));
  const std::string format_a = !options.format_a.empty() ? options.format_a : options.strategy.format;
  const std::string format_b = !options.format_b.empty() ? options.format_b : options.strategy.format;
  if (format_a.empty() || format_b.empty()) {
    throw input_error("--format: required (or give both --format-a and --format-b)");
  }
  const std::string_view flag_a = options.format_a.empty() ? "--format" : "--format-a";
  const std::string_view flag_b = options.format_b.empty() ? "--format" : "--format-b";
  const mxscope::strategy chosen =
      resolve_gemm_strategy(options.strategy, format_a, format_b, model, *output_rounding, flag_a, flag_b);
  const gemm_context context{options.strategy.layer, options.strategy.step};

  io::refuse_output_over_input(options.output, options.input, "--in");
  // Operands: only the two the GEMM needs are read.
  const io::safetensors_reader reader(options.input);
  const gemm_layout layout = layout_of(*kind);
  std::optional<matrix> x, dy, w;
  for (const std::string_view name : {layout.a_name, layout.b_name}) {
    if (reader.find(name) == nullptr) {
      throw input_error(fmt::format("{}: tensor '{}' is missing ({} needs {} and {}; the file holds: {})", reader.label(),
                                    name, options.gemm, layout.a_name, layout.b_name, fmt::join(reader.names(), ", ")));
    }
    matrix values = reader.read_matrix(name);
    if (values.rows == 0 || values.cols == 0) {  // a GEMM over no elements has nothing to measure
      throw input_error(fmt::format("{}: tensor '{}': field 'shape': [{}, {}] has no elements", reader.label(), name,
                                    values.rows, values.cols));
    }
    warn_nonfinite(reader, name, values, err);
    if (name == "x") x = std::move(values);
    if (name == "dy") dy = std::move(values);
    if (name == "w") w = std::move(values);
  }
  const gemm_operands operands{x ? &*x : nullptr, dy ? &*dy : nullptr, w ? &*w : nullptr};
  const compute_device device = parse_compute_device(options.device);
  gemm_options compute;
  compute.device = device;
  const gemm_result result = [&] {
    try {
      return run_gemm(*kind, operands, chosen, context, compute);
    } catch (const input_error& error) {
      throw input_error(fmt::format("{}: {}", reader.label(), error.what()));  // name the file of the operands
    }
  }();

  const matrix& a_captured = *(layout.a_name == "x" ? operands.x : operands.dy);
  const matrix& b_captured = *(layout.b_name == "x" ? operands.x : operands.w);
  const canonical_pair canonical = canonical_operands(*kind, a_captured, b_captured);
  const reference_result reference = reference_on(device, canonical.a, canonical.b, *reference_kind);
  std::optional<certification> certified;
  if (options.certify > 0) certified = certify(canonical.a, canonical.b, reference, options.certify, chosen.seed);
  const comparison metrics = compare_on(device, result.out, reference.fp64, reference.fp32);

  const gemm_study study{options, *kind, layout, format_a, format_b, chosen, model, *output_rounding,
                         *reference_kind, reader.label(), result, reference, metrics, certified,
                         canonical.a.cols};
  write_gemm_file(study);
  if (options.json) {
    print_gemm_json(study, out);
  } else {
    print_gemm_table(study, out);
  }
  if (certified && !certified->passed) {
    throw check_failed(fmt::format("--certify: the {} reference disagrees with the exact recomputation of {} entries "
                                   "(max {} fp64 ulps, {} fp32 ulps, {} bound violations)",
                                   reference_kind_name(*reference_kind), certified->entries_checked,
                                   certified->max_ulp_fp64, certified->max_ulp_fp32, certified->bound_violations));
  }
  return 0;
}

}  // namespace

void add_gemm_command(CLI::App& app, command_list& commands) {
  auto options = std::make_shared<gemm_command_options>();
  CLI::App* sub = app.add_subcommand(
      "gemm", "Emulate one GEMM of a linear layer (fprop, dgrad, wgrad) under a strategy and compare it with a reference");
  sub->add_option("--gemm", options->gemm, "Which GEMM: fprop (y = x w^T), dgrad (dx = dy w), wgrad (dw = dy^T x)")
      ->required();
  sub->add_option("--in", options->input, "Input safetensors file holding x [K, n_in], dy [K, n_out], w [n_out, n_in]")
      ->required();
  add_strategy_flags(*sub, options->strategy, /*format_required=*/false);
  sub->add_option("--format-a", options->format_a,
                  "Format of the first operand (x for fprop, dy for dgrad and wgrad); overrides --format");
  sub->add_option("--format-b", options->format_b,
                  "Format of the second operand (w for fprop and dgrad, x for wgrad); overrides --format");
  sub->add_option("--accum", options->accumulation,
                  "Accumulation model: exact, fp32-block, fp32-group:G, trunc-align:n,G[,rtz|rne], "
                  "trunc-promote:n,k,w[,c], fp32-seq")
      ->required();
  sub->add_option("--reference", options->reference, "Reference GEMM of the unquantized operands: exact or fp64")
      ->capture_default_str();
  sub->add_option("--certify", options->certify,
                  "Recompute N random reference entries with Boost.Multiprecision and report the largest deviation")
      ->capture_default_str();
  sub->add_option("--output", options->output_rounding, "Output rounding: fp32 or bf16")->capture_default_str();
  sub->add_option("-o,--out", options->output, "Output safetensors file (written atomically): out (F32), ref (F64)")
      ->required();
  sub->add_option("--device", options->device,
                  "Where to compute: cpu or gpu (MX quantize, products and the exact reference on the GPU, the rest "
                  "on the CPU; the same bits)")
      ->capture_default_str();
  sub->add_flag("--json", options->json, "Print the comparison as JSON instead of a table");
  commands.push_back({sub, [options](std::ostream& out, std::ostream& err) { return run_gemm_command(*options, out, err); }});
}

}  // namespace mxscope::cli
