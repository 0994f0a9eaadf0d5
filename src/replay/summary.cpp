// The end of a replay: the fragments merged into steps.csv and accumulation.csv, summary.json's
// provenance, run.json, and the final files committed together (src/replay/internal.hpp).
#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>
#include <string_view>
#include <system_error>

#include "internal.hpp"
#include "mxscope/io/atomic_file.hpp"
#include "mxscope/io/sha256.hpp"
#include "mxscope/reference.hpp"
#include "mxscope/version.hpp"

namespace mxscope::replay_internal {

merged_fragments merge_fragments(const std::vector<layer_plan>& plan, const unit_catalog& units,
                                 const fs::path& partial, io::atomic_file& steps_file,
                                 io::atomic_file& accumulation_file) {
  const std::size_t units_per_layer = units.per_layer();
  const std::size_t strategy_count = units.strategies();
  merged_fragments out;
  out.strategy_seconds.assign(strategy_count, 0.0);
  out.strategy_stage_seconds.assign(strategy_count, json::object());
  for (std::size_t layer_index = 0; layer_index < plan.size(); ++layer_index) {
    const std::size_t steps = plan[layer_index].entries.size();
    std::vector<json> fragments;
    std::vector<std::vector<std::string_view>> step_lines, accumulation_lines;
    fragments.reserve(units_per_layer);
    for (std::size_t u = 0; u < units_per_layer; ++u) {
      const std::size_t index = layer_index * units_per_layer + u;
      const fs::path path = partial / units.fragment_name(index);
      fragments.push_back(json::parse(read_text(path), nullptr, false));
      const json& fragment = fragments.back();
      const auto lines = [&](const char* field) {
        std::vector<std::string_view> found;
        if (!fragment.is_object() || !fragment.contains(field) || !fragment[field].is_string()) return found;
        const std::string& text = fragment[field].get_ref<const std::string&>();
        for (std::size_t begin = 0; begin < text.size();) {
          const std::size_t end = text.find('\n', begin);
          if (end == std::string::npos) break;
          found.emplace_back(text.data() + begin, end + 1 - begin);
          begin = end + 1;
        }
        return found;
      };
      step_lines.push_back(lines("steps"));
      accumulation_lines.push_back(lines("accumulation"));
      if (step_lines.back().size() != steps || accumulation_lines.back().size() != steps ||
          !fragment.contains("summary") || fragment.value("unit", "") != units.text(index)) {
        throw std::runtime_error(fmt::format("{}: damaged fragment of unit {}; delete it and run again with --resume",
                                             path.string(), units.text(index)));
      }
      out.units.push_back(fragment["summary"]);
      const std::size_t strategy = units.at(index).strategy;
      out.strategy_seconds[strategy] += fragment.value("seconds", 0.0);
      if (fragment.contains("stage_seconds")) {
        for (const char* stage : {"gemm", "compare", "metrics", "gemm_quantize", "gemm_product", "gemm_exact_product"}) {
          out.strategy_stage_seconds[strategy][stage] =
              out.strategy_stage_seconds[strategy].value(stage, 0.0) + fragment["stage_seconds"].value(stage, 0.0);
        }
      }
    }
    for (std::size_t t = 0; t < steps; ++t) {
      for (std::size_t u = 0; u < units_per_layer; ++u) {
        steps_file.write(step_lines[u][t]);
        accumulation_file.write(accumulation_lines[u][t]);
      }
    }
  }
  return out;
}

json summary_provenance(const replay_options& options, const analysis& parsed, const io::dump_reader& dump,
                        const std::map<std::string, std::string>& input_sha256, bool attribute) {
  json provenance;
  provenance["tool"] = "mxscope";
  provenance["version"] = version_string;
  provenance["git_hash"] = git_hash;
  provenance["analysis_file"] = parsed.path;
  provenance["analysis_text"] = parsed.text;
  provenance["dump"] = options.dump.string();
  json source;
  source["hardware"] = dump.source().hardware;
  source["framework"] = dump.source().framework;
  source["recipe"] = dump.source().recipe;
  source["model"] = dump.source().model;
  source["notes"] = dump.source().notes;
  provenance["dump_source"] = source;
  json inputs = json::object();
  inputs["manifest.json"] = io::sha256_file(dump.directory() / "manifest.json");
  for (const auto& [file, hash] : input_sha256) inputs[file] = hash;
  provenance["input_sha256"] = inputs;
  provenance["filters"] = {{"layers", options.layers.value_or("")}, {"steps", options.steps.value_or("")}};
  provenance["reference"] = reference_kind_name(parsed.reference);
  provenance["attribute"] = attribute;
  provenance["environment"] = "run.json (device, threads and wall times differ between runs and are kept there)";
  return provenance;
}

json run_record(const std::string& device_option, const std::string& gpu_name, const placement_counts& placed,
                int threads, const replay_outcome& outcome, const run_seconds& seconds, const merged_fragments& merged,
                const analysis& parsed, const std::vector<json>& per_rank) {
  json run;
  run["device"] = device_option;
  if (!gpu_name.empty()) run["gpu"] = gpu_name;
  run["placement"] = {{"quantize", {{"gpu", placed.quantize_gpu}, {"cpu", placed.quantize_cpu}}},
                      {"product", {{"gpu", placed.product_gpu}, {"cpu", placed.product_cpu}}},
                      {"reference", {{"gpu", placed.reference_gpu}, {"cpu", placed.reference_cpu}}},
                      {"compare", {{"gpu", placed.compare_gpu}, {"cpu", placed.compare_cpu}}},
                      {"cross_step", {{"gpu", placed.cross_step_gpu}, {"cpu", placed.cross_step_cpu}}}};
  run["threads"] = threads;
  run["ranks"] = per_rank.size();
  run["resumed_layers"] = outcome.layers_resumed;
  run["resumed_units"] = outcome.units_resumed;
  run["entries_replayed_in_last_process"] = outcome.entries;
  run["seconds"] = {{"total", seconds.total},
                    {"read", seconds.read},
                    {"setup", seconds.setup},
                    {"upload", seconds.upload},
                    {"hashing", seconds.hashing},
                    {"hashing_wait", seconds.hashing_wait},
                    {"reference", seconds.reference},
                    {"strategies", seconds.strategies}};
  run["seconds"]["first_read"] = seconds.first_read >= 0.0 ? json(seconds.first_read) : json(nullptr);
  run["seconds"]["gpu_context"] = seconds.gpu_context >= 0.0 ? json(seconds.gpu_context) : json(nullptr);
  run["seconds"]["gpu_ready"] = seconds.gpu_ready >= 0.0 ? json(seconds.gpu_ready) : json(nullptr);
  run["first_upload_during_read"] =
      seconds.first_upload_during_read >= 0.0 ? json(seconds.first_upload_during_read) : json(nullptr);
  json per_strategy = json::object();
  json per_strategy_stage = json::object();
  for (std::size_t k = 0; k < parsed.strategies.size(); ++k) {
    per_strategy[parsed.strategies[k].name] = merged.strategy_seconds[k];
    per_strategy_stage[parsed.strategies[k].name] = merged.strategy_stage_seconds[k];
  }
  run["seconds_per_strategy"] = per_strategy;
  run["stage_seconds_per_strategy"] = per_strategy_stage;
  if (per_rank.size() > 1) {
    json ranks_json = json::array();
    for (std::size_t r = 0; r < per_rank.size(); ++r) {
      ranks_json.push_back({{"rank", r},
                            {"entries", per_rank[r]["entries"]},
                            {"units", per_rank[r]["units_done"]},
                            {"seconds", per_rank[r]["seconds"]}});
    }
    run["per_rank"] = ranks_json;
  }
  return run;
}

json timeline_record(const timeline::summary& summary, std::size_t top) {
  json record;
  record["operations"] = summary.operations;
  record["span_seconds"] = summary.span_seconds;
  record["busy_seconds"] = summary.busy_seconds;
  record["idle_seconds"] = summary.idle_seconds;
  record["operation_seconds"] = summary.operation_seconds;
  json labels = json::array();
  for (const timeline::label_total& label : summary.labels) {
    labels.push_back({{"label", label.label},
                      {"operations", label.operations},
                      {"busy_seconds", label.busy_seconds},
                      {"span_seconds", label.span_seconds}});
  }
  record["labels"] = labels;
  json names = json::array();
  for (std::size_t i = 0; i < std::min(top, summary.names.size()); ++i) {
    const timeline::name_total& name = summary.names[i];
    names.push_back({{"name", name.name}, {"calls", name.calls}, {"seconds", name.seconds}});
  }
  record["names"] = names;
  record["names_left_out"] = summary.names.size() - std::min(top, summary.names.size());
  return record;
}

void commit_final_files(const fs::path& out, const fs::path& partial, io::atomic_file& steps_file,
                        io::atomic_file& accumulation_file, const json& summary, const json& run,
                        const std::optional<std::string>& kernel_times_csv) {
  std::error_code ignored;
  std::vector<fs::path> written;
  try {
    steps_file.commit();
    written.push_back(out / "steps.csv");
    accumulation_file.commit();
    written.push_back(out / "accumulation.csv");
    io::write_file_atomically(out / "summary.json", summary.dump(2) + "\n");
    written.push_back(out / "summary.json");
    if (kernel_times_csv) {
      io::write_file_atomically(out / "kernel_times.csv", *kernel_times_csv);
      written.push_back(out / "kernel_times.csv");
    }
    io::write_file_atomically(out / "run.json", run.dump(2) + "\n");
  } catch (const std::exception& error) {
    for (const fs::path& path : written) fs::remove(path, ignored);
    throw std::runtime_error(fmt::format("{}\nthe final files were not written; the finished units are kept in {}; "
                                         "finish the run with --resume",
                                         error.what(), partial.string()));
  }
  fs::remove(partial / "run-key.json", ignored);
  fs::remove_all(partial, ignored);
}

}  // namespace mxscope::replay_internal
