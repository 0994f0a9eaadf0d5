#include "mxscope/io/dump.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <fstream>
#include <future>
#include <nlohmann/json.hpp>
#include <ostream>
#include <set>
#include <sstream>
#include <thread>

#include "mxscope/errors.hpp"
#include "mxscope/io/json_guard.hpp"

namespace mxscope::io {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* operand_names[] = {"dy", "w", "x"};  // the tensors that may carry codes + scales
constexpr const char* recipe_keys[] = {"format", "block", "axis",  "scale_rule", "rounding", "seed",
                                       "rotation", "signs", "layer", "step",       "sr_bits"};

std::string json_type_name(const json& value) {
  if (value.is_number_unsigned() || value.is_number_integer()) return "integer";
  if (value.is_number_float()) return "floating-point number";
  return value.type_name();
}

std::string shape_text(const std::vector<std::int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

// Error helpers: the file first, then where in it, then the field.
[[noreturn]] void fail(const std::string& file, const std::string& field, const std::string& message) {
  throw input_error(fmt::format("{}: field '{}': {}", file, field, message));
}

[[noreturn]] void fail_entry(const std::string& manifest, std::size_t index, const std::string& field,
                             const std::string& message) {
  throw input_error(fmt::format("{}: entries[{}]: field '{}': {}", manifest, index, field, message));
}

[[noreturn]] void fail_tensor(const std::string& file, const std::string& tensor, const std::string& field,
                              const std::string& message) {
  throw input_error(fmt::format("{}: tensor '{}': field '{}': {}", file, printable_name(tensor), field, message));
}

// A layer name goes unquoted into the rows of steps.csv and accumulation.csv and is matched by
// --layers: no comma, quote or control character, and a bounded length.
void check_layer_name(const std::string& layer, const std::string& manifest, std::size_t index) {
  if (layer.size() > max_layer_name_bytes) {
    fail_entry(manifest, index, "layer",
               fmt::format("'{}' is {} bytes long; at most {} are allowed", printable_name(layer), layer.size(),
                           max_layer_name_bytes));
  }
  const auto bad = std::find_if(layer.begin(), layer.end(), [](char c) {
    const auto byte = static_cast<unsigned char>(c);
    return c == ',' || c == '"' || byte < 0x20 || byte == 0x7F;
  });
  if (bad != layer.end()) {
    fail_entry(manifest, index, "layer",
               fmt::format("'{}' holds a comma, a double quote or a control character, which the CSV files of a "
                           "replay cannot carry",
                           printable_name(layer)));
  }
}

std::string read_manifest_text(const fs::path& manifest) {
  const std::string label = manifest.string();
  std::error_code error;
  const auto status = fs::status(manifest, error);
  if (error || !fs::exists(status)) {
    throw input_error(fmt::format("{}: no such file (a dump directory holds manifest.json)", label));
  }
  if (!fs::is_regular_file(status)) throw input_error(fmt::format("{}: is not a regular file", label));
  const auto size = fs::file_size(manifest, error);
  if (error) throw input_error(fmt::format("{}: cannot determine the file size", label));
  if (size > max_manifest_bytes) {
    throw input_error(fmt::format("{}: {} bytes exceeds the limit of {} bytes for a manifest", label, size,
                                  max_manifest_bytes));
  }
  std::ifstream in(manifest, std::ios::binary);
  if (!in) throw input_error(fmt::format("{}: cannot open for reading", label));
  std::string text(static_cast<std::size_t>(size), '\0');
  in.read(text.data(), static_cast<std::streamsize>(size));
  if (static_cast<std::uint64_t>(in.gcount()) != size) throw input_error(fmt::format("{}: short read", label));
  return text;
}

// Parses with the same guards as safetensors headers: nesting depth capped, duplicate keys rejected.
json parse_manifest(const std::string& text, const std::string& label) {
  if (const auto issue = find_json_issue(text, max_json_depth)) {
    switch (issue->what) {
      case json_issue::kind::depth: fail(label, "manifest", issue->message);
      case json_issue::kind::duplicate_key: fail(label, printable_name(issue->key), "duplicate key");
      case json_issue::kind::syntax:
        fail(label, "manifest", fmt::format("not valid JSON: {}", printable_name(issue->message, 300)));
    }
  }
  try {
    return json::parse(text);
  } catch (const json::exception& error) {
    fail(label, "manifest", fmt::format("not valid JSON: {}", printable_name(error.what(), 300)));
  }
}

const json& required_member(const json& object, const std::string& key, const std::string& label,
                            const std::string& field_prefix = "") {
  const auto found = object.find(key);
  if (found == object.end()) fail(label, field_prefix + key, "missing from the dump directory's manifest");
  return *found;
}

// A relative path inside the dump: no absolute paths, no empty or ".." components, no NUL.
void check_relative_file(const std::string& file, const std::string& manifest, std::size_t index) {
  if (file.empty()) fail_entry(manifest, index, "file", "must not be empty");
  if (file.find('\0') != std::string::npos) fail_entry(manifest, index, "file", "contains a NUL byte");
  if (file.front() == '/' || fs::path(file).is_absolute()) {
    fail_entry(manifest, index, "file", fmt::format("'{}' is absolute; paths are relative to the dump directory",
                                                    printable_name(file)));
  }
  std::size_t begin = 0;
  while (begin <= file.size()) {
    const std::size_t end = std::min(file.find('/', begin), file.size());
    const std::string component = file.substr(begin, end - begin);
    if (component.empty() || component == "..") {
      fail_entry(manifest, index, "file",
                 fmt::format("'{}' has an {} path component; paths stay inside the dump directory",
                             printable_name(file), component.empty() ? "empty" : "'..'"));
    }
    begin = end + 1;
  }
}

bool is_operand_dtype(dtype type) { return type == dtype::bf16 || type == dtype::f16 || type == dtype::f32; }

// Strict decimal parsing of metadata numbers: the whole string, no sign, no spaces.
template <typename T>
std::optional<T> parse_decimal(const std::string& text) {
  T value{};
  if (text.empty() || text.front() == '+' || text.front() == '-') return std::nullopt;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

quantized_operand_recipe parse_recipe(const std::string& tensor, const std::map<std::string, std::string>& metadata,
                                      const std::string& file, std::int64_t rows, std::int64_t cols) {
  auto value_of = [&](const char* key) -> const std::string& {
    const std::string full = fmt::format("{}.{}", tensor, key);
    const auto found = metadata.find(full);
    if (found == metadata.end()) {
      fail(file, "__metadata__." + full, fmt::format("missing: tensor '{}.codes' needs its recipe", tensor));
    }
    return found->second;
  };
  auto bad = [&](const char* key, const std::string& expectation) {
    fail(file, fmt::format("__metadata__.{}.{}", tensor, key),
         fmt::format("'{}': {}", printable_name(value_of(key)), expectation));
  };
  quantized_operand_recipe recipe;
  recipe.tensor = tensor;
  recipe.format_name = value_of("format");
  const auto format = parse_format(recipe.format_name);
  if (!format || format->scheme != quant_scheme::mx) {
    bad("format", "expected an MX format: mxfp4 mxfp6_e2m3 mxfp6_e3m2 mxfp8_e4m3 mxfp8_e5m2 mxint8");
  }
  recipe.format = *format;
  const auto block = parse_decimal<int>(value_of("block"));
  if (!block || *block < 1 || *block > (1 << 20)) bad("block", "expected an integer block size in 1..1048576");
  recipe.block = *block;
  const auto axis = parse_decimal<int>(value_of("axis"));
  if (!axis || *axis > 1) bad("axis", "expected 0 or 1");
  recipe.axis = *axis;
  const auto rule = parse_scale_rule(value_of("scale_rule"));
  if (!rule) bad("scale_rule", "expected floor, ceil or even");
  recipe.rule = *rule;
  const auto rounding = parse_rounding(value_of("rounding"));
  if (!rounding) bad("rounding", "expected rne, rna, rtz or sr");
  recipe.rounding = *rounding;
  const auto seed = parse_decimal<std::uint64_t>(value_of("seed"));
  if (!seed) bad("seed", "expected a decimal integer in 0..2^64-1");
  recipe.seed = *seed;
  const std::string& rotation = value_of("rotation");
  if (rotation != "none") {
    const std::string prefix = "hadamard:";
    const auto size = rotation.rfind(prefix, 0) == 0 ? parse_decimal<int>(rotation.substr(prefix.size())) : std::nullopt;
    if (!size || !core::is_valid_rotation_size(*size)) {
      bad("rotation", "expected none or hadamard:B with B a power of two in [2, 4096]");
    }
    const std::int64_t length = recipe.axis == 1 ? cols : rows;
    if (length % *size != 0) {
      bad("rotation", fmt::format("size {} does not divide the length {} of axis {} of '{}'", *size, length,
                                  recipe.axis, tensor));
    }
    recipe.rotation_size = *size;
  }
  const auto signs = parse_sign_policy(value_of("signs"));
  if (!signs) bad("signs", "expected none, fixed or per-step");
  recipe.signs = *signs;
  recipe.layer = value_of("layer");
  const auto step = parse_decimal<std::uint32_t>(value_of("step"));
  if (!step) bad("step", "expected a decimal integer in 0..2^32-1");
  recipe.step = *step;
  const auto sr_bits = parse_decimal<int>(value_of("sr_bits"));
  if (!sr_bits || *sr_bits < 1 || *sr_bits > 32) bad("sr_bits", "expected an integer in 1..32");
  recipe.sr_bits = *sr_bits;
  return recipe;
}

// The byte shapes codes and scales must have for a [rows, cols] operand under `recipe`.
std::vector<std::int64_t> expected_codes_shape(const quantized_operand_recipe& recipe, std::int64_t rows,
                                               std::int64_t cols) {
  const bool packed = core::spec(recipe.format.element).bits == 4;
  return {rows, packed ? (cols + 1) / 2 : cols};
}

std::vector<std::int64_t> expected_scales_shape(const quantized_operand_recipe& recipe, std::int64_t rows,
                                                std::int64_t cols) {
  const std::int64_t block = recipe.block;
  if (recipe.axis == 1) return {rows, (cols + block - 1) / block};
  return {(rows + block - 1) / block, cols};
}

const tensor_info& two_dimensional(const safetensors_reader& reader, const char* name) {
  const tensor_info* tensor = reader.find(name);
  if (tensor == nullptr) {
    throw input_error(fmt::format("{}: tensor '{}': missing (every entry holds x [K, n_in] and dy [K, n_out])",
                                  reader.label(), name));
  }
  if (tensor->shape.size() != 2) {
    fail_tensor(reader.label(), name, "shape", fmt::format("{} has rank {}; a 2-D matrix is needed",
                                                           shape_text(tensor->shape), tensor->shape.size()));
  }
  return *tensor;
}

// Validates one entry file's header against the format; fills the shape / dtype / recipe fields.
void validate_entry_file(dump_entry_info& info) {
  const safetensors_reader reader(info.file);
  const std::string& label = reader.label();

  std::set<std::string> allowed = {"x", "dy", "w", "dw"};
  for (const char* operand : operand_names) {
    allowed.insert(fmt::format("{}.codes", operand));
    allowed.insert(fmt::format("{}.scales", operand));
  }
  for (const auto& tensor : reader.tensors()) {
    if (allowed.count(tensor.name) == 0) {
      fail_tensor(label, tensor.name, "name",
                  "unexpected tensor (an entry holds x, dy, w, dw and <t>.codes / <t>.scales for t in x, dy, w)");
    }
  }

  const tensor_info& x = two_dimensional(reader, "x");
  const tensor_info& dy = two_dimensional(reader, "dy");
  for (const tensor_info* operand : {&x, &dy}) {
    if (!is_operand_dtype(operand->type)) {
      fail_tensor(label, operand->name, "dtype",
                  fmt::format("{} is not allowed (allowed: BF16, F16, F32)", dtype_name(operand->type)));
    }
  }
  if (x.shape[0] != dy.shape[0]) {
    fail_tensor(label, "dy", "shape",
                fmt::format("{} has K = {} rows but x {} has K = {}", shape_text(dy.shape), dy.shape[0],
                            shape_text(x.shape), x.shape[0]));
  }
  if (x.shape[0] < 1 || x.shape[1] < 1 || dy.shape[1] < 1) {
    fail_tensor(label, x.shape[1] < 1 || x.shape[0] < 1 ? "x" : "dy", "shape",
                fmt::format("x {} and dy {} must have at least one token and one feature", shape_text(x.shape),
                            shape_text(dy.shape)));
  }
  (void)matrix_shape(x, label);  // per-dimension extent limit
  (void)matrix_shape(dy, label);
  info.tokens = x.shape[0];
  info.in_features = x.shape[1];
  info.out_features = dy.shape[1];
  info.x_type = x.type;
  info.dy_type = dy.type;
  const std::vector<std::int64_t> weight_shape = {info.out_features, info.in_features};
  for (const char* name : {"w", "dw"}) {
    const tensor_info* tensor = reader.find(name);
    if (tensor == nullptr) continue;
    if (tensor->shape != weight_shape) {
      fail_tensor(label, name, "shape",
                  fmt::format("{} does not match [n_out, n_in] = {} given by dy {} and x {}", shape_text(tensor->shape),
                              shape_text(weight_shape), shape_text(dy.shape), shape_text(x.shape)));
    }
    const bool gradient = std::string(name) == "dw";
    if (gradient ? tensor->type != dtype::f32 : !is_operand_dtype(tensor->type)) {
      fail_tensor(label, name, "dtype",
                  fmt::format("{} is not allowed (allowed: {})", dtype_name(tensor->type), gradient ? "F32" : "BF16, F16, F32"));
    }
    if (gradient) {
      info.has_dw = true;
    } else {
      info.w_type = tensor->type;
    }
  }

  info.metadata = reader.metadata();
  for (const char* operand : operand_names) {
    const std::string codes_name = fmt::format("{}.codes", operand);
    const std::string scales_name = fmt::format("{}.scales", operand);
    const tensor_info* codes = reader.find(codes_name);
    const tensor_info* scales = reader.find(scales_name);
    if (codes == nullptr && scales == nullptr) continue;
    if (codes == nullptr || scales == nullptr) {
      throw input_error(fmt::format("{}: tensor '{}': missing: '{}' needs it (codes and scales come in pairs)", label,
                                    codes == nullptr ? codes_name : scales_name,
                                    codes == nullptr ? scales_name : codes_name));
    }
    const tensor_info* values = reader.find(operand);
    if (values == nullptr) {
      fail_tensor(label, codes_name, "name", fmt::format("quantized operand without its tensor '{}'", operand));
    }
    const std::int64_t rows = values->shape[0];
    const std::int64_t cols = values->shape[1];
    quantized_operand_recipe recipe = parse_recipe(operand, info.metadata, label, rows, cols);
    for (const tensor_info* stored : {codes, scales}) {
      if (stored->type != dtype::u8) {
        fail_tensor(label, stored->name, "dtype", fmt::format("{} is not allowed (allowed: U8)", dtype_name(stored->type)));
      }
    }
    const auto codes_shape = expected_codes_shape(recipe, rows, cols);
    if (codes->shape != codes_shape) {
      fail_tensor(label, codes_name, "shape",
                  fmt::format("{} but {} of {} {} needs {}", shape_text(codes->shape), recipe.format_name, operand,
                              shape_text(values->shape), shape_text(codes_shape)));
    }
    const auto scales_shape = expected_scales_shape(recipe, rows, cols);
    if (scales->shape != scales_shape) {
      fail_tensor(label, scales_name, "shape",
                  fmt::format("{} but blocks of {} along axis {} of {} {} need {}", shape_text(scales->shape),
                              recipe.block, recipe.axis, operand, shape_text(values->shape), shape_text(scales_shape)));
    }
    info.quantized.push_back(std::move(recipe));
  }
}

// Every entry file's header, on a few threads (a dump of a large model lists hundreds of thousands
// of files, and each check is an open, a read and a parse). The error reported is that of the
// first failing entry in manifest order, as a sequential check would report.
void validate_entry_files(std::vector<dump_entry_info>& entries) {
  const std::size_t workers = std::min<std::size_t>(8, std::max<std::size_t>(1, std::thread::hardware_concurrency()));
  std::vector<std::exception_ptr> failures(entries.size());
  std::atomic<std::size_t> next{0};
  std::atomic<std::size_t> first_failure{entries.size()};
  const auto work = [&] {
    for (std::size_t i = next++; i < entries.size() && i < first_failure.load(); i = next++) {
      try {
        validate_entry_file(entries[i]);
      } catch (...) {
        failures[i] = std::current_exception();
        for (std::size_t seen = first_failure.load(); i < seen && !first_failure.compare_exchange_weak(seen, i);) {
        }
      }
    }
  };
  std::vector<std::future<void>> running;
  for (std::size_t w = 1; w < workers; ++w) running.push_back(std::async(std::launch::async, work));
  work();
  for (auto& worker : running) worker.get();
  for (const auto& failure : failures) {
    if (failure) std::rethrow_exception(failure);
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------------

core::random_role quantized_operand_recipe::role() const {
  if (tensor == "dy") return core::random_role::dy;
  if (tensor == "x") return core::random_role::x;
  if (tensor == "w") return core::random_role::w;
  return core::random_role::none;
}

quantize_options quantized_operand_recipe::quantize() const {
  quantize_options options;
  options.format = format;
  options.block = block;
  options.axis = axis;
  options.rounding = rounding;
  options.rule = rule;
  options.sr_bits = sr_bits;
  options.stream = {seed, step, core::stream_tag(core::fnv1a32(layer.data(), layer.size()), role())};
  return options;
}

rotation_options quantized_operand_recipe::rotation() const {
  rotation_options options;
  options.size = rotation_size;
  options.signs = signs;
  options.seed = seed;
  options.step = step;
  options.layer_hash = core::fnv1a32(layer.data(), layer.size());
  return options;
}

std::string quantized_operand_recipe::describe() const {
  return fmt::format("{}: {} block {} axis {} scale_rule {} rounding {} sr_bits {} rotation {} signs {} seed {} "
                     "layer '{}' step {}",
                     tensor, format_name, block, axis, scale_rule_name(rule), rounding_name(rounding), sr_bits,
                     rotation_size == 0 ? std::string("none") : fmt::format("hadamard:{}", rotation_size),
                     sign_policy_name(signs), seed, printable_name(layer), step);
}

bool dump_entry::all_finite() const {
  return std::all_of(nonfinite.begin(), nonfinite.end(), [](const auto& item) { return item.second.total() == 0; });
}

std::string dump_entry::nonfinite_summary() const {
  std::string out;
  for (const auto& [name, count] : nonfinite) {
    if (count.total() == 0) continue;
    if (!out.empty()) out += "; ";
    out += fmt::format("{}: {} NaN, {} Inf", name, count.nan, count.inf);
  }
  return out;
}

bool is_dump_directory(const std::filesystem::path& directory) {
  std::error_code error;
  return fs::is_directory(directory, error) && fs::exists(directory / "manifest.json", error);
}

dump_reader::dump_reader(const std::filesystem::path& directory) : directory_(directory) {
  std::error_code error;
  if (!fs::is_directory(directory, error)) {
    throw input_error(fmt::format("{}: is not a directory (a dump is a directory holding manifest.json)",
                                  directory.string()));
  }
  const fs::path manifest_path = directory / "manifest.json";
  const std::string manifest = manifest_path.string();
  const json root = parse_manifest(read_manifest_text(manifest_path), manifest);
  if (!root.is_object()) fail(manifest, "manifest", fmt::format("must be a JSON object, got {}", json_type_name(root)));
  for (const auto& [key, unused] : root.items()) {
    if (key != "format" && key != "version" && key != "source" && key != "entries") {
      fail(manifest, printable_name(key), "unexpected field (expected format, version, source, entries)");
    }
  }

  const json& format = required_member(root, "format", manifest);
  if (!format.is_string() || format.get<std::string>() != dump_format_name) {
    fail(manifest, "format",
         fmt::format("expected \"{}\", got {}", dump_format_name,
                     format.is_string() ? "\"" + printable_name(format.get<std::string>()) + "\"" : json_type_name(format)));
  }
  const json& version = required_member(root, "version", manifest);
  if (!version.is_number_integer() || version.get<std::int64_t>() != dump_format_version) {
    fail(manifest, "version",
         fmt::format("this reader understands version {}, got {}", dump_format_version,
                     version.is_number() ? version.dump() : json_type_name(version)));
  }
  version_ = dump_format_version;

  const json& source = required_member(root, "source", manifest);
  if (!source.is_object()) fail(manifest, "source", fmt::format("must be an object, got {}", json_type_name(source)));
  json extra = json::object();
  std::string* fields[] = {&source_.hardware, &source_.framework, &source_.recipe, &source_.model, &source_.notes};
  const char* names[] = {"hardware", "framework", "recipe", "model", "notes"};
  for (std::size_t i = 0; i < std::size(names); ++i) {
    const json& value = required_member(source, names[i], manifest, "source.");
    if (!value.is_string()) {
      fail(manifest, fmt::format("source.{}", names[i]), fmt::format("must be a string, got {}", json_type_name(value)));
    }
    *fields[i] = value.get<std::string>();
  }
  for (const auto& [key, value] : source.items()) {
    if (std::find(std::begin(names), std::end(names), key) == std::end(names)) extra[key] = value;
  }
  source_.extra_json = extra.dump();

  const json& entries = required_member(root, "entries", manifest);
  if (!entries.is_array()) fail(manifest, "entries", fmt::format("must be an array, got {}", json_type_name(entries)));
  std::map<std::pair<std::string, std::int64_t>, std::size_t> seen;
  const fs::path resolved_directory = fs::weakly_canonical(directory, error);
  for (std::size_t index = 0; index < entries.size(); ++index) {
    const json& entry = entries[index];
    if (!entry.is_object()) fail_entry(manifest, index, "entry", fmt::format("must be an object, got {}", json_type_name(entry)));
    for (const auto& [key, unused] : entry.items()) {
      if (key != "step" && key != "layer" && key != "file") {
        fail_entry(manifest, index, printable_name(key), "unexpected field (expected step, layer, file)");
      }
    }
    for (const char* key : {"step", "layer", "file"}) {
      if (!entry.contains(key)) fail_entry(manifest, index, key, "missing");
    }
    dump_entry_info info;
    const json& step = entry.at("step");
    if (step.is_number_unsigned() && step.get<std::uint64_t>() <= static_cast<std::uint64_t>(INT64_MAX)) {
      info.step = static_cast<std::int64_t>(step.get<std::uint64_t>());
    } else {
      fail_entry(manifest, index, "step",
                 fmt::format("must be an integer >= 0, got {}",
                             step.is_number() ? step.dump() : json_type_name(step)));
    }
    const json& layer = entry.at("layer");
    if (!layer.is_string() || layer.get<std::string>().empty()) {
      fail_entry(manifest, index, "layer",
                 fmt::format("must be a non-empty string, got {}", layer.is_string() ? "\"\"" : json_type_name(layer)));
    }
    info.layer = layer.get<std::string>();
    check_layer_name(info.layer, manifest, index);
    const json& file = entry.at("file");
    if (!file.is_string()) fail_entry(manifest, index, "file", fmt::format("must be a string, got {}", json_type_name(file)));
    info.relative_file = file.get<std::string>();
    check_relative_file(info.relative_file, manifest, index);
    info.file = directory / info.relative_file;
    if (!fs::is_regular_file(info.file, error)) {
      fail_entry(manifest, index, "file",
                 fmt::format("'{}' does not exist or is not a regular file", printable_name(info.file.string())));
    }
    // A symbolic link may not lead out of the dump either.
    const fs::path resolved_file = fs::weakly_canonical(info.file, error);
    const auto mismatch = std::mismatch(resolved_directory.begin(), resolved_directory.end(), resolved_file.begin(),
                                        resolved_file.end());
    if (error || mismatch.first != resolved_directory.end()) {
      fail_entry(manifest, index, "file",
                 fmt::format("'{}' resolves to '{}', outside the dump directory", printable_name(info.relative_file),
                             printable_name(resolved_file.string())));
    }
    const auto [where, inserted] = seen.emplace(std::pair{info.layer, info.step}, index);
    if (!inserted) {
      fail_entry(manifest, index, "step",
                 fmt::format("duplicate (step {}, layer '{}'): entries[{}] has it already", info.step,
                             printable_name(info.layer), where->second));
    }
    entries_.push_back(std::move(info));
  }

  // Every entry file's header, before any work starts.
  validate_entry_files(entries_);
  std::sort(entries_.begin(), entries_.end(), [](const dump_entry_info& a, const dump_entry_info& b) {
    return a.layer != b.layer ? a.layer < b.layer : a.step < b.step;
  });
}

std::vector<std::string> dump_reader::layers() const {
  std::vector<std::string> names;
  for (const auto& entry : entries_) {
    if (names.empty() || names.back() != entry.layer) names.push_back(entry.layer);
  }
  return names;
}

dump_entry dump_reader::read(const dump_entry_info& info, const dump_read_options& options) const {
  return read(info, options, dump_entry{});
}

dump_entry dump_reader::read(const dump_entry_info& info, const dump_read_options& options, dump_entry recycled) const {
  // Validate again: the file may have changed since the dump was opened.
  dump_entry_info current = info;
  current.quantized.clear();
  validate_entry_file(current);
  if (current.tokens != info.tokens || current.in_features != info.in_features ||
      current.out_features != info.out_features) {
    throw input_error(fmt::format("{}: changed since the dump was opened (x/dy shapes differ)", info.file.string()));
  }
  const safetensors_reader reader(info.file);
  reader.start_reading({"x", "dy"});  // the disk reads ahead while the destinations are allocated
  dump_entry entry;
  entry.info = current;

  struct loaded {
    matrix values;
    nonfinite_count count;
  };
  const auto read_values = [&reader](const char* name, matrix storage, read_listener* listener) {
    safetensors_reader::pieces split;
    split.listener = listener;
    loaded out;
    out.values = reader.read_matrix(name, out.count, std::move(storage), split);
    return out;
  };
  const auto keep = [&](const char* name, loaded&& tensor) {
    entry.nonfinite[name] = tensor.count;
    if (options.reject_nonfinite && tensor.count.total() != 0) {
      throw input_error(fmt::format("{}: tensor '{}': field 'values': {} NaN and {} Inf values", reader.label(), name,
                                    tensor.count.nan, tensor.count.inf));
    }
    return std::move(tensor.values);
  };
  auto load = [&](const char* name) { return keep(name, read_values(name, matrix{}, nullptr)); };
  // dy on a second thread while x is read here (pread: the two reads share nothing); the checks
  // and their errors come in the order x, dy, as from one thread.
  auto dy_values = std::async(std::launch::async, read_values, "dy", std::move(recycled.dy), options.listener);
  loaded x_values = read_values("x", std::move(recycled.x), options.listener);
  loaded dy_read = dy_values.get();
  entry.x = keep("x", std::move(x_values));
  entry.dy = keep("dy", std::move(dy_read));
  if (options.read_weight && reader.find("w") != nullptr) entry.w = load("w");
  if (options.read_weight_gradient && reader.find("dw") != nullptr) entry.dw = load("dw");
  if (options.read_quantized) {
    for (const auto& recipe : current.quantized) {
      const matrix& values = recipe.tensor == "x" ? entry.x : recipe.tensor == "dy" ? entry.dy : *entry.w;
      quantized_operand operand;
      operand.recipe = recipe;
      quantized_tensor& tensor = operand.tensor;
      tensor.rows = values.rows;
      tensor.cols = values.cols;
      tensor.options = recipe.quantize();
      tensor.block = recipe.block;
      tensor.codes = reader.read_tensor(recipe.tensor + ".codes");
      tensor.scales = reader.read_tensor(recipe.tensor + ".scales");
      const auto scales_shape = expected_scales_shape(recipe, values.rows, values.cols);
      tensor.scale_rows = scales_shape[0];
      tensor.scale_cols = scales_shape[1];
      tensor.dequantized = dequantize(tensor);
      for (const float v : tensor.dequantized.values) {
        tensor.nonzero_inputs += v != 0.0f;
        tensor.nonfinite_inputs += !std::isfinite(v);
      }
      entry.quantized.push_back(std::move(operand));
    }
  }
  return entry;
}

void dump_reader::for_each(const std::function<void(const dump_entry&)>& visit, const dump_read_options& options) const {
  for (const auto& info : entries_) {
    const dump_entry entry = read(info, options);
    visit(entry);
  }
}

// ------------------------------------------------------------------------------------------------

void describe_dump(const std::filesystem::path& directory, std::ostream& out) {
  const dump_reader reader(directory);
  const auto& source = reader.source();
  out << fmt::format("dump {}\n", directory.string());
  out << fmt::format("format {} version {}\n", dump_format_name, reader.version());
  out << fmt::format("source.hardware  {}\n", printable_name(source.hardware, 500));
  out << fmt::format("source.framework {}\n", printable_name(source.framework, 500));
  out << fmt::format("source.recipe    {}\n", printable_name(source.recipe, 500));
  out << fmt::format("source.model     {}\n", printable_name(source.model, 500));
  out << fmt::format("source.notes     {}\n", printable_name(source.notes, 1000));
  const auto layers = reader.layers();
  out << fmt::format("entries {}  layers {}\n", reader.entries().size(), layers.size());

  std::vector<std::vector<std::string>> rows;
  rows.push_back({"step", "layer", "tensor", "dtype", "shape", "min", "max", "mean_abs", "nan", "inf"});
  std::vector<std::string> recipes;
  for (const auto& entry : reader.entries()) {
    const safetensors_reader file(entry.file);
    for (const auto& tensor : file.tensors()) {
      const tensor_statistics stats = compute_statistics(file, tensor);
      rows.push_back({std::to_string(entry.step), printable_name(entry.layer), printable_name(tensor.name),
                      std::string(dtype_name(tensor.type)), fmt::format("[{}]", fmt::join(tensor.shape, ",")),
                      fmt::format("{:.6g}", stats.min), fmt::format("{:.6g}", stats.max),
                      fmt::format("{:.6g}", stats.mean_abs), std::to_string(stats.nan_count),
                      std::to_string(stats.inf_count)});
    }
    for (const auto& recipe : entry.quantized) {
      recipes.push_back(fmt::format("  step {} layer {}: {}", entry.step, printable_name(entry.layer), recipe.describe()));
    }
  }
  std::vector<std::size_t> widths(rows.front().size(), 0);
  for (const auto& row : rows) {
    for (std::size_t column = 0; column < row.size(); ++column) widths[column] = std::max(widths[column], row[column].size());
  }
  for (const auto& row : rows) {
    std::string line;
    for (std::size_t column = 0; column < row.size(); ++column) {
      if (column > 0) line += "  ";
      line += fmt::format("{:<{}}", row[column], column + 1 == row.size() ? 0 : widths[column]);
    }
    out << line << '\n';
  }
  out << fmt::format("quantized operands {}\n", recipes.size());
  for (const auto& line : recipes) out << line << '\n';
}

}  // namespace mxscope::io
