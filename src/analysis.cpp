#include "mxscope/analysis.hpp"

#include <fmt/format.h>

#include <cctype>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <toml++/toml.h>

#include "mxscope/errors.hpp"

namespace mxscope {

namespace {

constexpr std::size_t max_analysis_bytes = 1 << 20;

// Keys that set how one operand is quantized; at strategy or GEMM level they apply to both.
const std::set<std::string, std::less<>> operand_keys = {"format", "block", "rounding", "scale_rule", "sr_bits",
                                                         "seed_policy"};
// Keys that set the GEMM as a whole.
const std::set<std::string, std::less<>> gemm_keys = {"rotation", "signs", "seed", "accumulation", "output"};

class located_error_factory {
 public:
  explicit located_error_factory(std::string path) : path_(std::move(path)) {}
  input_error at(const toml::node& node, const std::string& message) const {
    const auto& where = node.source().begin;
    return input_error(fmt::format("{}:{}:{}: {}", path_, where.line, where.column, message));
  }
  input_error at_file(const std::string& message) const { return input_error(fmt::format("{}: {}", path_, message)); }

 private:
  std::string path_;
};

std::string expect_string(const toml::node& node, std::string_view key, const located_error_factory& errors) {
  if (const auto* value = node.as_string()) return value->get();
  throw errors.at(node, fmt::format("key '{}' must be a string", key));
}

std::int64_t expect_integer(const toml::node& node, std::string_view key, const located_error_factory& errors) {
  if (const auto* value = node.as_integer()) return value->get();
  throw errors.at(node, fmt::format("key '{}' must be an integer", key));
}

double expect_number(const toml::node& node, std::string_view key, const located_error_factory& errors) {
  if (const auto* value = node.as_floating_point()) return value->get();
  if (const auto* value = node.as_integer()) return static_cast<double>(value->get());
  throw errors.at(node, fmt::format("key '{}' must be a number", key));
}

bool expect_bool(const toml::node& node, std::string_view key, const located_error_factory& errors) {
  if (const auto* value = node.as_boolean()) return value->get();
  throw errors.at(node, fmt::format("key '{}' must be true or false", key));
}

void apply_operand_key(std::string_view key, const toml::node& node, operand_strategy& operand,
                       const located_error_factory& errors) {
  if (key == "format") {
    const std::string text = expect_string(node, key, errors);
    const auto format = parse_format(text);
    if (!format) {
      throw errors.at(node, fmt::format("key 'format': unknown format '{}' (mxfp4 mxfp6_e2m3 mxfp6_e3m2 mxfp8_e4m3 "
                                        "mxfp8_e5m2 mxint8 nvfp4 fp8_e4m3 fp8_e5m2 bf16 fp32)",
                                        text));
    }
    operand.quantize.format = *format;
  } else if (key == "block") {
    const std::int64_t block = expect_integer(node, key, errors);
    if (block < 1 || block > (1 << 20)) throw errors.at(node, fmt::format("key 'block': {} is not in 1..{}", block, 1 << 20));
    operand.quantize.block = static_cast<int>(block);
  } else if (key == "rounding") {
    const std::string text = expect_string(node, key, errors);
    const auto mode = parse_rounding(text);
    if (!mode) throw errors.at(node, fmt::format("key 'rounding': unknown mode '{}' (rne rna rtz sr)", text));
    operand.quantize.rounding = *mode;
  } else if (key == "scale_rule") {
    const std::string text = expect_string(node, key, errors);
    const auto rule = parse_scale_rule(text);
    if (!rule) throw errors.at(node, fmt::format("key 'scale_rule': unknown rule '{}' (floor ceil even)", text));
    operand.quantize.rule = *rule;
  } else if (key == "sr_bits") {
    const std::int64_t bits = expect_integer(node, key, errors);
    if (bits < 1 || bits > 32) throw errors.at(node, fmt::format("key 'sr_bits': {} is not in 1..32", bits));
    operand.quantize.sr_bits = static_cast<int>(bits);
  } else if (key == "seed_policy") {
    const std::string text = expect_string(node, key, errors);
    if (text == "per-step") {
      operand.seeds = core::seed_policy::per_step;
    } else if (text == "fixed") {
      operand.seeds = core::seed_policy::fixed;
    } else {
      throw errors.at(node, fmt::format("key 'seed_policy': unknown policy '{}' (per-step fixed)", text));
    }
  }
}

void apply_gemm_key(std::string_view key, const toml::node& node, strategy& target,
                    const located_error_factory& errors) {
  if (key == "rotation") {
    const std::string text = expect_string(node, key, errors);
    if (text == "none") {
      target.rotation_size = 0;
      return;
    }
    constexpr std::string_view prefix = "hadamard:";
    // Digits only after the prefix: no sign, no spaces (std::stoi would take "hadamard: 16").
    int size = 0;
    if (text.rfind(prefix, 0) == 0) {
      const std::string_view digits = std::string_view(text).substr(prefix.size());
      const auto [end, status] = std::from_chars(digits.data(), digits.data() + digits.size(), size);
      if (digits.empty() || digits.front() < '0' || digits.front() > '9' || status != std::errc() ||
          end != digits.data() + digits.size()) {
        size = 0;
      }
    }
    if (!core::is_valid_rotation_size(size)) {
      throw errors.at(node, fmt::format("key 'rotation': '{}' is not 'none' or 'hadamard:B' with B a power of two in "
                                        "[2, 4096]",
                                        text));
    }
    target.rotation_size = size;
  } else if (key == "signs") {
    const std::string text = expect_string(node, key, errors);
    const auto policy = parse_sign_policy(text);
    if (!policy) throw errors.at(node, fmt::format("key 'signs': unknown policy '{}' (none fixed per-step)", text));
    target.rotation_signs = *policy;
  } else if (key == "seed") {
    const std::int64_t seed = expect_integer(node, key, errors);
    if (seed < 0) throw errors.at(node, fmt::format("key 'seed': {} is negative", seed));
    target.seed = static_cast<std::uint64_t>(seed);
  } else if (key == "accumulation") {
    const std::string text = expect_string(node, key, errors);
    try {
      target.accumulation = parse_accumulation_model(text, "accumulation");
    } catch (const input_error& error) {
      throw errors.at(node, error.what());
    }
  } else if (key == "output") {
    const std::string text = expect_string(node, key, errors);
    const auto output = parse_output_rounding(text);
    if (!output) throw errors.at(node, fmt::format("key 'output': unknown output rounding '{}' (fp32 bf16)", text));
    target.output = *output;
  }
}

enum class level { strategy_top, gemm, operand };

// Applies one settings table to `target`. Per-GEMM sub-tables are skipped here (the caller applies
// them afterwards, so they override the strategy's top level whatever their order in the file).
void apply_table(const toml::table& table, strategy& target, level where, const located_error_factory& errors,
                 bool allow_name) {
  for (const auto& [key_node, node] : table) {
    const std::string_view key = key_node.str();
    if (allow_name && (key == "name" || key == "description")) continue;
    if (operand_keys.contains(key)) {
      apply_operand_key(key, node, target.a, errors);
      apply_operand_key(key, node, target.b, errors);
      continue;
    }
    if (gemm_keys.contains(key)) {
      if (where == level::operand) {
        throw errors.at(node, fmt::format("key '{}' applies to the whole GEMM, not to one operand", key));
      }
      apply_gemm_key(key, node, target, errors);
      continue;
    }
    if (key == "a" || key == "b") {
      if (where == level::operand) throw errors.at(node, fmt::format("unknown key '{}' in an operand table", key));
      const auto* operand_table = node.as_table();
      if (operand_table == nullptr) throw errors.at(node, fmt::format("key '{}' must be a table", key));
      for (const auto& [operand_key, operand_node] : *operand_table) {
        const std::string_view name = operand_key.str();
        if (!operand_keys.contains(name)) {
          throw errors.at(operand_node, fmt::format("unknown key '{}' in operand table '{}' (allowed: format block "
                                                    "rounding scale_rule sr_bits seed_policy)",
                                                    name, key));
        }
        apply_operand_key(name, operand_node, key == "a" ? target.a : target.b, errors);
      }
      continue;
    }
    if (where == level::strategy_top && parse_gemm_kind(key)) {
      if (node.as_table() == nullptr) throw errors.at(node, fmt::format("key '{}' must be a table", key));
      continue;
    }
    throw errors.at(node, fmt::format("unknown key '{}'", key));
  }
}

strategy resolve(const toml::table* defaults, const toml::table& table, gemm_kind kind,
                 const located_error_factory& errors) {
  strategy resolved;
  resolved.a.quantize.format = *parse_format("fp32");
  resolved.b.quantize.format = *parse_format("fp32");
  resolved.accumulation = parse_accumulation_model("fp32-block");
  if (defaults != nullptr) apply_table(*defaults, resolved, level::strategy_top, errors, false);
  apply_table(table, resolved, level::strategy_top, errors, true);
  if (const auto* per_gemm = table[gemm_kind_name(kind)].as_table()) {
    apply_table(*per_gemm, resolved, level::gemm, errors, false);
  }
  return resolved;
}

// The "block" entry that decided operand `name` of `kind`: the most specific table that sets it.
const toml::node* block_node(const toml::table* defaults, const toml::table& table, gemm_kind kind,
                             std::string_view name) {
  const toml::table* per_gemm = table[gemm_kind_name(kind)].as_table();
  const toml::table* candidates[] = {per_gemm ? (*per_gemm)[name].as_table() : nullptr, per_gemm,
                                     table[name].as_table(), &table, defaults};
  for (const toml::table* candidate : candidates) {
    if (candidate == nullptr) continue;
    if (const toml::node* node = candidate->get("block")) return node;
  }
  return nullptr;
}

// NVFP4 has 16-element blocks by definition (its ue4m3 scale per 16 values): any other block size
// is refused here, at the line that sets it, rather than when the replay reaches the strategy.
void check_nvfp4_block(const strategy& resolved, const toml::table* defaults, const toml::table& table,
                       gemm_kind kind, const toml::node& item, const located_error_factory& errors) {
  for (const auto& [operand, name] : {std::pair{&resolved.a, "a"}, std::pair{&resolved.b, "b"}}) {
    const int block = operand->quantize.block;
    if (operand->quantize.format.scheme != quant_scheme::nvfp4 || block == 0 || block == 16) continue;
    const toml::node* node = block_node(defaults, table, kind, name);
    throw errors.at(node != nullptr ? *node : item,
                    fmt::format("key 'block': {} with format 'nvfp4' ({} operand of {}); nvfp4 uses blocks of 16",
                                block, name, gemm_kind_name(kind)));
  }
}

// Both operands of a GEMM are reduced block by block along the same axis, so two blocked formats
// must use the same block size (the GEMM refuses it otherwise, after the replay has started).
void check_common_block(const strategy& resolved, const toml::table* defaults, const toml::table& table,
                        gemm_kind kind, const toml::node& item, const located_error_factory& errors) {
  const auto block_of = [](const quantize_options& q) {
    if (q.format.scheme != quant_scheme::mx && q.format.scheme != quant_scheme::nvfp4) return 0;
    return q.block > 0 ? q.block : q.format.default_block;
  };
  const int a = block_of(resolved.a.quantize);
  const int b = block_of(resolved.b.quantize);
  if (a == 0 || b == 0 || a == b) return;
  const toml::node* node = block_node(defaults, table, kind, "b");
  if (node == nullptr) node = block_node(defaults, table, kind, "a");
  throw errors.at(node != nullptr ? *node : item,
                  fmt::format("strategy '{}' {}: operands a ({}, block {}) and b ({}, block {}) must have the same "
                              "block size along the reduction axis",
                              resolved.name, gemm_kind_name(kind), format_name(resolved.a.quantize.format), a,
                              format_name(resolved.b.quantize.format), b));
}

// toml++ bounds the nesting of arrays and inline tables but not the number of parts of a dotted
// key or table header, and a key of tens of thousands of parts exhausts the stack. No analysis key
// has more than a few parts: refuse, at its line, any run of more than max_key_parts.
constexpr int max_key_parts = 64;
void check_key_parts(const std::string& text, const std::string& path) {
  int line = 1, column = 0, parts = 1;
  bool in_comment = false, after_part = false;
  char quote = 0;  // the open string's quote character, 0 outside strings
  bool multiline = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    ++column;
    if (c == '\n') {
      ++line;
      column = 0;
      in_comment = false;
      if (!multiline) quote = 0;
      parts = 1;
      after_part = false;
      continue;
    }
    if (in_comment) continue;
    if (quote != 0) {
      if (c == '\\' && quote == '"') {
        ++i;
        ++column;
      } else if (c == quote && (!multiline || text.compare(i, 3, std::string(3, quote)) == 0)) {
        if (multiline) i += 2, column += 2;
        quote = 0;
        multiline = false;
        after_part = true;
      }
      continue;
    }
    if (c == '#') {
      in_comment = true;
    } else if (c == '"' || c == '\'') {
      quote = c;
      multiline = text.compare(i, 3, std::string(3, c)) == 0;
      if (multiline) i += 2, column += 2;
    } else if (c == '.') {
      if (after_part && ++parts > max_key_parts) {
        throw input_error(fmt::format("{}:{}:{}: a dotted key or table header with more than {} parts", path, line,
                                      column, max_key_parts));
      }
      after_part = false;
    } else if (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-') {
      after_part = true;
    } else if (c != ' ' && c != '\t') {
      parts = 1;
      after_part = false;
    }
  }
}

}  // namespace

analysis parse_analysis(const std::string& text, const std::string& path) {
  const located_error_factory errors(path);
  check_key_parts(text, path);
  toml::table root;
  try {
    root = toml::parse(text, path);
  } catch (const toml::parse_error& error) {
    const auto& where = error.source().begin;
    throw input_error(fmt::format("{}:{}:{}: {}", path, where.line, where.column, error.description()));
  }
  analysis result;
  result.path = path;
  result.text = text;
  const toml::table* defaults = nullptr;
  const toml::array* strategies = nullptr;
  for (const auto& [key_node, node] : root) {
    const std::string_view key = key_node.str();
    if (key == "name") {
      result.name = expect_string(node, key, errors);
    } else if (key == "description") {
      result.description = expect_string(node, key, errors);
    } else if (key == "gemms") {
      const auto* list = node.as_array();
      if (list == nullptr || list->empty()) throw errors.at(node, "key 'gemms' must be a non-empty array of strings");
      result.gemms.clear();
      for (const auto& item : *list) {
        const std::string name = expect_string(item, "gemms", errors);
        const auto kind = parse_gemm_kind(name);
        if (!kind) throw errors.at(item, fmt::format("key 'gemms': unknown GEMM '{}' (fprop dgrad wgrad)", name));
        for (gemm_kind seen : result.gemms) {
          if (seen == *kind) throw errors.at(item, fmt::format("key 'gemms': '{}' listed twice", name));
        }
        result.gemms.push_back(*kind);
      }
    } else if (key == "reference") {
      const std::string name = expect_string(node, key, errors);
      const auto kind = parse_reference_kind(name);
      if (!kind) throw errors.at(node, fmt::format("key 'reference': unknown reference '{}' (exact fp64)", name));
      result.reference = *kind;
    } else if (key == "attribute") {
      result.attribute = expect_bool(node, key, errors);
    } else if (key == "optimizer") {
      const auto* table = node.as_table();
      if (table == nullptr) throw errors.at(node, "key 'optimizer' must be a table");
      for (const auto& [option_key, option_node] : *table) {
        const std::string_view option = option_key.str();
        const double value = expect_number(option_node, option, errors);
        const bool in_unit_interval = value >= 0.0 && value < 1.0;
        if (option == "sgd_momentum" && in_unit_interval) {
          result.optimizer.sgd_momentum = value;
        } else if (option == "adamw_beta1" && in_unit_interval) {
          result.optimizer.adamw_beta1 = value;
        } else if (option == "adamw_beta2" && in_unit_interval) {
          result.optimizer.adamw_beta2 = value;
        } else if (option == "adamw_eps" && value > 0.0 && std::isfinite(value)) {
          result.optimizer.adamw_eps = value;
        } else if (option == "sgd_momentum" || option == "adamw_beta1" || option == "adamw_beta2" ||
                   option == "adamw_eps") {
          throw errors.at(option_node, fmt::format("key '{}': value {} is out of range", option, value));
        } else {
          throw errors.at(option_node, fmt::format("unknown key '{}' in [optimizer] (sgd_momentum adamw_beta1 "
                                                   "adamw_beta2 adamw_eps)",
                                                   option));
        }
      }
    } else if (key == "defaults") {
      defaults = node.as_table();
      if (defaults == nullptr) throw errors.at(node, "key 'defaults' must be a table");
      for (const auto& [default_key, default_node] : *defaults) {
        if (parse_gemm_kind(default_key.str())) {
          throw errors.at(default_node, "per-GEMM tables belong in a [[strategy]], not in [defaults]");
        }
      }
    } else if (key == "strategy") {
      strategies = node.as_array();
      if (strategies == nullptr) throw errors.at(node, "key 'strategy' must be an array of tables ([[strategy]])");
    } else {
      throw errors.at(node, fmt::format("unknown key '{}' (name description gemms reference attribute optimizer "
                                        "defaults strategy)",
                                        key));
    }
  }
  if (strategies == nullptr || strategies->empty()) throw errors.at_file("no [[strategy]] tables");
  std::set<std::string> names;
  for (const auto& item : *strategies) {
    const auto* table = item.as_table();
    if (table == nullptr) throw errors.at(item, "each strategy must be a table ([[strategy]])");
    const auto* name_node = table->get("name");
    if (name_node == nullptr) throw errors.at(item, "strategy without a 'name'");
    analysis_strategy parsed;
    parsed.name = expect_string(*name_node, "name", errors);
    if (parsed.name.empty() || parsed.name.find_first_of(",\"\n\r") != std::string::npos) {
      throw errors.at(*name_node, fmt::format("key 'name': '{}' must be non-empty, without commas, quotes or newlines",
                                              parsed.name));
    }
    if (!names.insert(parsed.name).second) {
      throw errors.at(*name_node, fmt::format("key 'name': strategy '{}' is defined twice", parsed.name));
    }
    for (gemm_kind kind : {gemm_kind::fprop, gemm_kind::dgrad, gemm_kind::wgrad}) {
      strategy resolved = resolve(defaults, *table, kind, errors);
      resolved.name = parsed.name;
      check_nvfp4_block(resolved, defaults, *table, kind, item, errors);
      check_common_block(resolved, defaults, *table, kind, item, errors);
      if (resolved.rotation_size == 0 && resolved.rotation_signs != sign_policy::none) {
        throw errors.at(item, fmt::format("strategy '{}': 'signs' is set but there is no 'rotation'", parsed.name));
      }
      parsed.per_gemm[static_cast<int>(kind)] = resolved;
    }
    result.strategies.push_back(std::move(parsed));
  }
  return result;
}

analysis load_analysis(const std::string& path) {
  // A regular file of bounded size: a device such as /dev/zero would otherwise be read forever.
  std::error_code error;
  const auto status = std::filesystem::status(path, error);
  if (!error && std::filesystem::exists(status) && !std::filesystem::is_regular_file(status)) {
    throw input_error(fmt::format("{}: the analysis file is not a regular file", path));
  }
  std::ifstream file(path, std::ios::binary);
  if (!file) throw input_error(fmt::format("{}: cannot open the analysis file", path));
  std::string text(max_analysis_bytes + 1, '\0');
  file.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<std::size_t>(file.gcount()));
  if (text.size() > max_analysis_bytes) {
    throw input_error(fmt::format("{}: the analysis file is larger than {} bytes", path, max_analysis_bytes));
  }
  return parse_analysis(text, path);
}

}  // namespace mxscope
