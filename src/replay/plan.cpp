// Which entries a replay reads (--layers, --steps, checked against the analysis) and the run's
// identity for --resume (src/replay/internal.hpp).
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <future>
#include <optional>
#include <regex>
#include <set>
#include <sstream>

#include "internal.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/io/sha256.hpp"
#include "mxscope/version.hpp"

namespace mxscope {

std::vector<std::int64_t> parse_step_list(const std::string& text, const std::string& what) {
  std::set<std::int64_t> steps;
  std::stringstream stream(text);
  std::string item;
  const auto parse_int = [&](const std::string& s) {
    std::size_t used = 0;
    std::int64_t value = -1;
    try {
      value = std::stoll(s, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != s.size() || s.empty() || value < 0) {
      throw input_error(fmt::format("{}: '{}' is not a step list such as '3,5-9,12'", what, text));
    }
    return value;
  };
  while (std::getline(stream, item, ',')) {
    const auto dash = item.find('-');
    if (dash == std::string::npos) {
      steps.insert(parse_int(item));
    } else {
      const std::int64_t first = parse_int(item.substr(0, dash));
      const std::int64_t last = parse_int(item.substr(dash + 1));
      if (last < first || last - first > 10'000'000) {
        throw input_error(fmt::format("{}: range '{}' is empty or too long", what, item));
      }
      for (std::int64_t s = first; s <= last; ++s) steps.insert(s);
    }
  }
  if (steps.empty()) throw input_error(fmt::format("{}: empty step list", what));
  return {steps.begin(), steps.end()};
}

namespace replay_internal {

namespace {

// std::regex compiles and matches by recursion: a pattern of tens of thousands of nested groups
// exhausts the stack. Layer filters are short; refuse long or deeply nested ones up front.
constexpr std::size_t max_layer_pattern = 1024;
constexpr int max_layer_pattern_depth = 32;
void check_layer_pattern(const std::string& pattern) {
  if (pattern.size() > max_layer_pattern) {
    throw input_error(fmt::format("--layers: the pattern has {} characters; at most {} are accepted", pattern.size(),
                                  max_layer_pattern));
  }
  int depth = 0;
  bool in_class = false;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\') {
      ++i;
    } else if (in_class) {
      in_class = c != ']';
    } else if (c == '[') {
      in_class = true;
    } else if (c == '(' && ++depth > max_layer_pattern_depth) {
      throw input_error(fmt::format("--layers: groups nested more than {} deep", max_layer_pattern_depth));
    } else if (c == ')' && depth > 0) {
      --depth;
    }
  }
}

}  // namespace

std::vector<layer_plan> select_entries(const replay_options& options, const analysis& parsed,
                                       const io::dump_reader& dump) {
  std::vector<layer_plan> plan;
  std::optional<std::regex> layer_filter;
  if (options.layers) {
    check_layer_pattern(*options.layers);
    try {
      layer_filter.emplace(*options.layers, std::regex::ECMAScript);
    } catch (const std::regex_error& error) {
      throw input_error(
          fmt::format("--layers: '{}' is not a valid regular expression: {}", *options.layers, error.what()));
    }
  }
  std::optional<std::set<std::int64_t>> step_filter;
  if (options.steps) {
    const auto list = parse_step_list(*options.steps, "--steps");
    step_filter.emplace(list.begin(), list.end());
  }
  for (const auto& entry : dump.entries()) {
    if (layer_filter && !std::regex_match(entry.layer, *layer_filter)) continue;
    if (step_filter && !step_filter->contains(entry.step)) continue;
    if (plan.empty() || plan.back().name != entry.layer) plan.push_back({entry.layer, {}});
    plan.back().entries.push_back(&entry);
  }
  if (plan.empty()) {
    throw input_error(fmt::format("{}: no entries match --layers '{}' and --steps '{}'", options.dump.string(),
                                  options.layers.value_or(".*"), options.steps.value_or("all")));
  }
  for (gemm_kind kind : parsed.gemms) {
    if (kind == gemm_kind::wgrad) continue;
    for (const auto& layer : plan) {
      for (const auto* entry : layer.entries) {
        if (!entry->w_type) {
          throw input_error(fmt::format("{}: tensor 'w' is missing, but analysis {} asks for {} (which needs w)",
                                        entry->file.string(), parsed.path, gemm_kind_name(kind)));
        }
      }
    }
  }

  // Every strategy's rotation must divide every reduction length: checked before any work starts.
  for (gemm_kind kind : parsed.gemms) {
    for (const auto& s : parsed.strategies) {
      const strategy& chosen = s.for_gemm(kind);
      if (chosen.rotation_size == 0) continue;
      for (const auto& layer : plan) {
        for (const auto* entry : layer.entries) {
          const std::int64_t reduction = kind == gemm_kind::wgrad   ? entry->tokens
                                         : kind == gemm_kind::fprop ? entry->in_features
                                                                    : entry->out_features;
          if (reduction % chosen.rotation_size != 0) {
            throw input_error(fmt::format(
                "{}: strategy '{}': rotation hadamard:{} does not divide the {} reduction length {} of layer "
                "'{}' (entry {})",
                parsed.path, s.name, chosen.rotation_size, gemm_kind_name(kind), reduction, entry->layer,
                entry->file.string()));
          }
        }
      }
    }
  }
  return plan;
}

std::map<std::string, std::string> hash_inputs(const std::vector<layer_plan>& plan, int threads) {
  std::vector<const io::dump_entry_info*> entries;
  for (const auto& layer : plan) entries.insert(entries.end(), layer.entries.begin(), layer.entries.end());
  std::vector<std::string> hashes(entries.size());
  std::vector<std::future<void>> workers;
  std::atomic<std::size_t> next{0};
  for (int w = 0; w < std::max(threads, 1); ++w) {
    workers.push_back(std::async(std::launch::async, [&] {
      for (std::size_t i = next++; i < entries.size(); i = next++) hashes[i] = io::sha256_file(entries[i]->file);
    }));
  }
  for (auto& worker : workers) worker.get();
  std::map<std::string, std::string> out;
  for (std::size_t i = 0; i < entries.size(); ++i) out[entries[i]->relative_file] = hashes[i];
  return out;
}


// The key covers every input, so that --resume never mixes results of edited inputs with fresh ones.
std::string run_key(const analysis& parsed, const io::dump_reader& dump, const replay_options& options,
                    bool attribute, const std::map<std::string, std::string>& input_sha256) {
  json key;
  key["analysis_sha256"] = io::sha256_hex(parsed.text);
  key["manifest_sha256"] = io::sha256_file(dump.directory() / "manifest.json");
  key["layers"] = options.layers.value_or("");
  key["steps"] = options.steps.value_or("");
  key["attribute"] = attribute;
  key["mxscope"] = version_string;
  key["input_sha256"] = input_sha256;
  return key.dump(2) + "\n";
}

std::string read_text(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  std::ostringstream text;
  text << file.rdbuf();
  return text.str();
}

}  // namespace replay_internal

}  // namespace mxscope
