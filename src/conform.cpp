#include "mxscope/conform.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <cmath>
#include <exception>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>

#include "mxscope/errors.hpp"
#include "mxscope/io/dump.hpp"
#include "mxscope/io/json_guard.hpp"
#include "mxscope/io/safetensors.hpp"
#include "mxscope/quantize_fast.hpp"
#include "backend/backend.hpp"
#include "mxscope/device.hpp"

namespace mxscope::conform {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

bool is_packed_4bit(const quantized_tensor& q) {
  return q.options.format.scheme == quant_scheme::mx && core::spec(q.options.format.element).bits == 4;
}

std::uint8_t code_at(const quantized_tensor& q, std::int64_t row, std::int64_t col) {
  if (is_packed_4bit(q)) {
    const std::uint8_t byte = q.codes[static_cast<std::size_t>(row * q.code_row_bytes() + col / 2)];
    return col % 2 == 0 ? static_cast<std::uint8_t>(byte & 0x0FU) : static_cast<std::uint8_t>(byte >> 4);
  }
  return q.codes[static_cast<std::size_t>(row * q.cols + col)];
}

std::uint8_t scale_at(const quantized_tensor& q, std::int64_t row, std::int64_t col) {
  if (q.options.axis == 1) return q.scales[static_cast<std::size_t>(row * q.scale_cols + col / q.block)];
  return q.scales[static_cast<std::size_t>((row / q.block) * q.scale_cols + col)];
}

std::string describe_options(const quantize_options& options, int block) {
  return fmt::format("{} block {} axis {} scale_rule {} rounding {}{}", format_name(options.format), block,
                     options.axis, scale_rule_name(options.rule), rounding_name(options.rounding),
                     options.rounding == core::rounding_mode::sr ? fmt::format(" sr_bits {}", options.sr_bits) : "");
}

// Whether no finite value of the format lies strictly between the two codes' values (and they differ).
bool neighbouring_codes(core::element_kind kind, std::uint8_t first, std::uint8_t second) {
  const double low = std::min(core::decode(kind, first), core::decode(kind, second));
  const double high = std::max(core::decode(kind, first), core::decode(kind, second));
  if (std::isnan(low) || std::isnan(high) || low == high) return false;
  const int codes = 1 << core::spec(kind).bits;
  for (int code = 0; code < codes; ++code) {
    const double value = core::decode(kind, static_cast<std::uint32_t>(code));
    if (!std::isnan(value) && value > low && value < high) return false;
  }
  return true;
}

mismatch_kind classify_element(core::element_kind kind, float input, int exponent, std::uint8_t hardware,
                               std::uint8_t recomputed) {
  if (!std::isfinite(input)) return mismatch_kind::element_nan;
  const double scaled = static_cast<double>(input) * core::pow2(-exponent);  // exact (NUMERICS.md 2)
  if (std::fabs(scaled) > core::max_normal(kind)) return mismatch_kind::element_saturation;
  if (core::encode(kind, scaled, core::rounding_mode::rne).code != core::encode(kind, scaled, core::rounding_mode::rna).code) {
    return mismatch_kind::element_tie;
  }
  if (neighbouring_codes(kind, hardware, recomputed)) return mismatch_kind::element_off_by_one;
  return mismatch_kind::element_other;
}

}  // namespace

std::string_view mismatch_kind_name(mismatch_kind kind) {
  switch (kind) {
    case mismatch_kind::scale_off_by_one: return "scale-off-by-one";
    case mismatch_kind::scale_other: return "scale-other";
    case mismatch_kind::scale_nan: return "scale-nan";
    case mismatch_kind::element_tie: return "element-tie";
    case mismatch_kind::element_saturation: return "element-saturation";
    case mismatch_kind::element_off_by_one: return "element-off-by-one";
    case mismatch_kind::element_nan: return "element-nan";
    case mismatch_kind::element_other: return "element-other";
    case mismatch_kind::element_in_bad_block: return "element-in-mismatched-block";
  }
  return "unknown";
}

quantizer_check check_quantizer(const matrix& rotated_input, const quantized_tensor& hardware,
                                const quantize_options& options, std::size_t max_listed) {
  if (hardware.options.format.scheme != quant_scheme::mx || options.format.scheme != quant_scheme::mx) {
    throw input_error("conform: quantizer conformance covers MX formats only");
  }
  if (rotated_input.rows != hardware.rows || rotated_input.cols != hardware.cols) {
    throw input_error(fmt::format("conform: the operand is [{}, {}] but its hardware codes describe [{}, {}]",
                                  rotated_input.rows, rotated_input.cols, hardware.rows, hardware.cols));
  }
  const quantized_tensor recomputed = quantize(rotated_input, options);
  if (recomputed.block != hardware.block || recomputed.options.axis != hardware.options.axis ||
      recomputed.options.format.element != hardware.options.format.element ||
      recomputed.scales.size() != hardware.scales.size() || recomputed.codes.size() != hardware.codes.size()) {
    throw input_error("conform: the replayed recipe and the hardware codes differ in format, block or axis");
  }
  const core::element_kind kind = options.format.element;
  quantizer_check check;
  check.recipe = describe_options(options, recomputed.block);
  check.elements = hardware.rows * hardware.cols;
  check.blocks = static_cast<std::int64_t>(hardware.scales.size());
  std::vector<quantizer_mismatch> scale_list;
  std::vector<quantizer_mismatch> element_list;

  // Scales, block by block.
  for (std::int64_t scale_row = 0; scale_row < hardware.scale_rows; ++scale_row) {
    for (std::int64_t scale_col = 0; scale_col < hardware.scale_cols; ++scale_col) {
      const auto index = static_cast<std::size_t>(scale_row * hardware.scale_cols + scale_col);
      const std::uint8_t mine = hardware.scales[index];
      const std::uint8_t theirs = recomputed.scales[index];
      if (mine == theirs) {
        ++check.matching_scales;
        continue;
      }
      mismatch_kind kind_found = mismatch_kind::scale_other;
      if (mine == core::scale_nan_code || theirs == core::scale_nan_code) {
        kind_found = mismatch_kind::scale_nan;
      } else if (std::abs(static_cast<int>(mine) - static_cast<int>(theirs)) == 1) {
        kind_found = mismatch_kind::scale_off_by_one;
      }
      ++check.counts[static_cast<int>(kind_found)];
      if (scale_list.size() < max_listed) {
        quantizer_mismatch listed;
        listed.kind = kind_found;
        listed.scale = true;
        listed.row = hardware.options.axis == 1 ? scale_row : scale_row * hardware.block;
        listed.col = hardware.options.axis == 1 ? scale_col * hardware.block : scale_col;
        float amax = 0.0f;
        for (std::int64_t i = 0; i < hardware.block; ++i) {
          const std::int64_t r = hardware.options.axis == 1 ? listed.row : listed.row + i;
          const std::int64_t c = hardware.options.axis == 1 ? listed.col + i : listed.col;
          if (r >= hardware.rows || c >= hardware.cols) break;
          const float v = std::fabs(rotated_input(r, c));
          if (!(v <= amax)) amax = v;  // NaN wins
        }
        listed.input_bits = core::float_bits(amax);
        listed.hardware_scale = mine;
        listed.recomputed_scale = theirs;
        scale_list.push_back(listed);
      }
    }
  }
  // Elements.
  for (std::int64_t row = 0; row < hardware.rows; ++row) {
    for (std::int64_t col = 0; col < hardware.cols; ++col) {
      const std::uint8_t hardware_scale = scale_at(hardware, row, col);
      const std::uint8_t recomputed_scale = scale_at(recomputed, row, col);
      const std::uint8_t mine = code_at(hardware, row, col);
      const std::uint8_t theirs = code_at(recomputed, row, col);
      // A block both sides mark NaN decodes to NaN whatever its element codes say.
      const bool both_nan_blocks = hardware_scale == core::scale_nan_code && recomputed_scale == core::scale_nan_code;
      if (mine == theirs || both_nan_blocks) {
        ++check.matching_elements;
        continue;
      }
      const float input = rotated_input(row, col);
      const mismatch_kind kind_found =
          hardware_scale != recomputed_scale
              ? mismatch_kind::element_in_bad_block
              : classify_element(kind, input, core::scale_exponent(hardware_scale), mine, theirs);
      ++check.counts[static_cast<int>(kind_found)];
      if (element_list.size() < max_listed) {
        quantizer_mismatch listed;
        listed.kind = kind_found;
        listed.row = row;
        listed.col = col;
        listed.input_bits = core::float_bits(input);
        listed.hardware_code = mine;
        listed.recomputed_code = theirs;
        listed.hardware_scale = hardware_scale;
        listed.recomputed_scale = recomputed_scale;
        element_list.push_back(listed);
      }
    }
  }
  check.listed = scale_list;
  for (const auto& listed : element_list) {
    if (check.listed.size() >= max_listed) break;
    check.listed.push_back(listed);
  }
  return check;
}

std::string quantizer_candidate::name() const {
  return fmt::format("{}/{}", scale_rule_name(rule), rounding_name(rounding));
}

std::vector<quantizer_candidate> quantizer_candidates() {
  std::vector<quantizer_candidate> candidates;
  for (const auto rule : {core::scale_rule::floor, core::scale_rule::ceil, core::scale_rule::even}) {
    for (const auto rounding : {core::rounding_mode::rne, core::rounding_mode::rna, core::rounding_mode::rtz,
                                core::rounding_mode::sr}) {
      candidates.push_back({rule, rounding});
    }
  }
  return candidates;
}

std::vector<quantizer_operand> load_quantizer_operands(const std::filesystem::path& dump) {
  const io::dump_reader reader(dump);
  std::vector<quantizer_operand> operands;
  for (const auto& info : reader.entries()) {
    if (info.quantized.empty()) continue;
    io::dump_read_options read_options;
    read_options.read_weight_gradient = false;
    const io::dump_entry entry = reader.read(info, read_options);
    for (const auto& stored : entry.quantized) {
      const std::string& tensor = stored.recipe.tensor;
      const matrix& values = tensor == "x" ? entry.x : tensor == "dy" ? entry.dy : *entry.w;
      quantizer_operand operand;
      operand.label = fmt::format("layer {} step {} tensor {}", io::printable_name(info.layer), info.step, tensor);
      operand.rotated_input = values;
      if (stored.recipe.rotation_size != 0) {
        rotate(operand.rotated_input, stored.recipe.axis, stored.recipe.rotation(), operand.label);
      }
      operand.hardware = stored.tensor;
      operand.recorded = stored.recipe.quantize();
      operands.push_back(std::move(operand));
    }
  }
  return operands;
}

std::vector<quantizer_fit_row> fit_quantizer(const std::vector<quantizer_operand>& operands) {
  std::vector<quantizer_fit_row> rows;
  for (const auto& candidate : quantizer_candidates()) {
    quantizer_fit_row row;
    row.candidate = candidate;
    for (const auto& operand : operands) {
      quantize_options options = operand.recorded;
      options.rule = candidate.rule;
      options.rounding = candidate.rounding;
      const quantizer_check check = check_quantizer(operand.rotated_input, operand.hardware, options, 0);
      row.mismatches += check.mismatches();
      row.compared += check.elements + check.blocks;
    }
    rows.push_back(row);
  }
  std::stable_sort(rows.begin(), rows.end(),
                   [](const quantizer_fit_row& a, const quantizer_fit_row& b) { return a.mismatches < b.mismatches; });
  return rows;
}

// ------------------------------------------------------------------------------------------------
// GEMM conformance.

namespace {

json read_json_file(const fs::path& path) {
  std::error_code error;
  if (!fs::is_regular_file(path, error)) {
    throw input_error(fmt::format("{}: no such file (a dump or conformance directory holds manifest.json)", path.string()));
  }
  const auto size = fs::file_size(path, error);
  if (error || size > io::max_manifest_bytes) {
    throw input_error(fmt::format("{}: unreadable or larger than {} bytes", path.string(), io::max_manifest_bytes));
  }
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (const auto issue = io::find_json_issue(text.str(), io::max_json_depth)) {
    const std::string field = issue->what == io::json_issue::kind::duplicate_key ? io::printable_name(issue->key)
                                                                                  : std::string("manifest");
    throw input_error(fmt::format("{}: field '{}': {}", path.string(), field, (issue->what == io::json_issue::kind::syntax ? "not valid JSON: " : "") +
                                      io::printable_name(issue->message, 300)));
  }
  try {
    return json::parse(text.str());
  } catch (const json::exception& parse_error) {
    throw input_error(fmt::format("{}: field 'manifest': not valid JSON: {}", path.string(),
                                  io::printable_name(parse_error.what(), 300)));
  }
}

constexpr std::int64_t max_case_extent = std::int64_t{1} << 31;

[[noreturn]] void fail(const std::string& where, const std::string& field, const std::string& message) {
  throw input_error(fmt::format("{}: field '{}': {}", where, field, message));
}

void check_relative(const std::string& file, const std::string& where) {
  if (file.empty() || file.front() == '/' || file.find('\0') != std::string::npos) {
    fail(where, "file", "must be a non-empty relative path");
  }
  std::size_t begin = 0;
  while (begin <= file.size()) {
    const std::size_t end = std::min(file.find('/', begin), file.size());
    const std::string component = file.substr(begin, end - begin);
    if (component.empty() || component == "..") fail(where, "file", "paths stay inside the directory");
    begin = end + 1;
  }
}

// A case file, symbolic links resolved, stays inside the directory (as a dump's entries do): a link
// to a file elsewhere is refused before any of its bytes are read.
void check_inside(const fs::path& directory, const std::string& file, const std::string& where) {
  std::error_code error;
  const fs::path resolved_directory = fs::weakly_canonical(directory, error);
  const fs::path resolved_file = fs::weakly_canonical(directory / file, error);
  const auto mismatch = std::mismatch(resolved_directory.begin(), resolved_directory.end(), resolved_file.begin(),
                                      resolved_file.end());
  if (error || mismatch.first != resolved_directory.end()) {
    fail(where, "file", fmt::format("'{}' resolves to a path outside the directory", io::printable_name(file)));
  }
}

// A decimal integer in [low, high], all of `text` (no sign, no spaces, no suffix).
std::optional<std::int64_t> strict_integer(const std::string& text, std::int64_t low, std::int64_t high) {
  if (text.empty() || text.front() < '0' || text.front() > '9') return std::nullopt;
  std::int64_t value = 0;
  const auto [end, status] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (status != std::errc() || end != text.data() + text.size() || value < low || value > high) return std::nullopt;
  return value;
}

std::string metadata_value(const std::map<std::string, std::string>& metadata, const std::string& key,
                           const std::string& where) {
  const auto found = metadata.find(key);
  if (found == metadata.end()) fail(where, "__metadata__." + key, "missing");
  return found->second;
}

// Operand `name` ("a" or "b") of a case: codes + scales when present (what the hardware multiplied),
// else the plain values.
quantized_tensor read_operand(const io::safetensors_reader& reader, const std::string& name) {
  const std::string& where = reader.label();
  const io::tensor_info* codes = reader.find(name + ".codes");
  const io::tensor_info* scales = reader.find(name + ".scales");
  if (codes == nullptr && scales == nullptr) {
    const io::tensor_info* plain = reader.find(name);
    if (plain == nullptr) fail(where, name, "missing: a case holds a and b (plain values or .codes + .scales)");
    if (plain->type != io::dtype::f32 && plain->type != io::dtype::bf16 && plain->type != io::dtype::f16) {
      fail(where, name + ".dtype", fmt::format("{} is not allowed (allowed: F32, BF16, F16)", io::dtype_name(plain->type)));
    }
    if (plain->shape.size() != 2) fail(where, name + ".shape", "must be 2-D");
    return plain_operand(reader.read_matrix(name));
  }
  if (codes == nullptr || scales == nullptr) fail(where, name + ".codes", "codes and scales come in pairs");
  for (const io::tensor_info* part : {codes, scales}) {
    if (part->type != io::dtype::u8) {
      fail(where, part->name + ".dtype", fmt::format("must be U8, got {}", io::dtype_name(part->type)));
    }
    if (part->shape.size() != 2) fail(where, part->name + ".shape", fmt::format("must be 2-D, got {}-D", part->shape.size()));
  }
  const std::string format_text = metadata_value(reader.metadata(), name + ".format", where);
  const auto format = parse_format(format_text);
  if (!format || format->scheme != quant_scheme::mx) {
    fail(where, "__metadata__." + name + ".format", fmt::format("'{}' is not an MX format", io::printable_name(format_text)));
  }
  const std::string block_text = metadata_value(reader.metadata(), name + ".block", where);
  const auto parsed_block = strict_integer(block_text, 1, 1 << 20);
  if (!parsed_block) {
    fail(where, "__metadata__." + name + ".block",
         fmt::format("'{}': expected an integer in 1..1048576", io::printable_name(block_text)));
  }
  const int block = static_cast<int>(*parsed_block);
  for (const std::int64_t extent : codes->shape) {
    if (extent >= max_case_extent) {
      fail(where, name + ".codes.shape", fmt::format("extent {} is not below 2^31", extent));
    }
  }
  quantized_tensor q;
  q.options.format = *format;
  q.options.axis = 1;
  q.options.block = block;
  q.block = block;
  q.rows = codes->shape[0];
  const bool packed = core::spec(format->element).bits == 4;
  q.cols = packed ? codes->shape[1] * 2 : codes->shape[1];
  q.scale_rows = q.rows;
  q.scale_cols = (q.cols + block - 1) / block;
  if (scales->shape != std::vector<std::int64_t>{q.scale_rows, q.scale_cols}) {
    fail(where, name + ".scales", fmt::format("shape must be [{}, {}] for {} codes of K = {} in blocks of {}",
                                              q.scale_rows, q.scale_cols, format_text, q.cols, block));
  }
  q.codes = reader.read_tensor(name + ".codes");
  q.scales = reader.read_tensor(name + ".scales");
  q.dequantized = dequantize(q);
  return q;
}

// "scale_a" and "scale_b" (optional, together): the fp32 per-tensor scales the GEMM applied to its
// accumulator (torch._scaled_mm's scale_a, scale_b; any strtod form, the capture writes float.hex).
// The operands are then per-tensor fp8 operands: their codes must be 8-bit fp8 codes with every
// block scale 1, and the model applies alpha = fl32(sa sb), out = fl32(acc alpha) (docs/numerics.md).
void read_tensor_scales(gemm_case& one, const std::string& label) {
  const auto a_entry = one.metadata.find("scale_a");
  const auto b_entry = one.metadata.find("scale_b");
  if (a_entry == one.metadata.end() && b_entry == one.metadata.end()) return;
  if (a_entry == one.metadata.end() || b_entry == one.metadata.end()) {
    fail(label, a_entry == one.metadata.end() ? "__metadata__.scale_a" : "__metadata__.scale_b",
         "missing: scale_a and scale_b come together");
  }
  const auto parse_scale = [&](const std::string& key, const std::string& text) {
    char* end = nullptr;
    const double value = std::strtod(text.c_str(), &end);
    if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(value) || value <= 0.0 ||
        static_cast<double>(static_cast<float>(value)) != value) {
      fail(label, "__metadata__." + key,
           fmt::format("'{}': expected a positive finite fp32 value", io::printable_name(text)));
    }
    return static_cast<float>(value);
  };
  const std::pair<quantized_tensor*, float> operands[] = {{&one.a, parse_scale("scale_a", a_entry->second)},
                                                          {&one.b, parse_scale("scale_b", b_entry->second)}};
  for (const auto& [q, scale] : operands) {
    const char* name = q == &one.a ? "a" : "b";
    const bool fp8 = q->options.format.scheme == quant_scheme::mx &&
                     (q->options.format.element == core::element_kind::fp8_e4m3 ||
                      q->options.format.element == core::element_kind::fp8_e5m2);
    const bool unit_scales = std::all_of(q->scales.begin(), q->scales.end(),
                                         [](std::uint8_t code) { return code == core::scale_code(0); });
    if (!fp8 || !unit_scales) {
      fail(label, fmt::format("{}.scales", name),
           "per-tensor scales need fp8 codes (mxfp8_e4m3 or mxfp8_e5m2) whose block scales are all 1");
    }
    q->options.format.scheme = quant_scheme::per_tensor;
    q->options.block = 0;
    q->block = 0;
    q->scales.clear();
    q->scale_rows = 0;
    q->scale_cols = 0;
    q->tensor_scale = scale;
    q->dequantized = dequantize(*q);
  }
}

quantized_tensor select_rows(const quantized_tensor& q, const std::vector<std::int64_t>& rows) {
  quantized_tensor out = q;
  out.rows = static_cast<std::int64_t>(rows.size());
  out.dequantized = matrix(out.rows, q.cols);
  const std::int64_t code_bytes = q.code_row_bytes();
  out.codes.assign(static_cast<std::size_t>(out.rows * code_bytes), 0);
  if (q.options.format.scheme == quant_scheme::mx) {
    out.scale_rows = out.rows;
    out.scales.assign(static_cast<std::size_t>(out.rows * q.scale_cols), 0);
  }
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const std::int64_t row = rows[i];
    const auto target = static_cast<std::int64_t>(i);
    std::copy_n(q.dequantized.values.begin() + row * q.cols, q.cols, out.dequantized.values.begin() + target * q.cols);
    std::copy_n(q.codes.begin() + row * code_bytes, code_bytes, out.codes.begin() + target * code_bytes);
    if (q.options.format.scheme == quant_scheme::mx) {
      std::copy_n(q.scales.begin() + row * q.scale_cols, q.scale_cols, out.scales.begin() + target * q.scale_cols);
    }
  }
  return out;
}

std::vector<std::int64_t> spread_rows(std::int64_t count, std::int64_t wanted) {
  const std::int64_t taken = std::min(count, wanted);
  std::vector<std::int64_t> rows;
  for (std::int64_t i = 0; i < taken; ++i) rows.push_back(i * count / taken);
  return rows;
}

}  // namespace

std::string manifest_format(const std::filesystem::path& directory) {
  const json root = read_json_file(directory / "manifest.json");
  if (!root.is_object() || !root.contains("format") || !root.at("format").is_string()) {
    fail((directory / "manifest.json").string(), "format", "missing or not a string");
  }
  return root.at("format").get<std::string>();
}

quantized_tensor plain_operand(const matrix& values) {
  quantized_tensor q;
  q.rows = values.rows;
  q.cols = values.cols;
  q.options.format = format_choice{quant_scheme::none, core::element_kind::fp4_e2m1, 0};
  q.options.axis = 1;
  q.dequantized = values;
  return q;
}

namespace {

// A convert case: "in" F32 [n] and "out" U8 [n] (n >= 1), "format" fp8_e4m3 or fp8_e5m2.
convert_case read_convert_case(const io::safetensors_reader& reader, const std::string& name) {
  const std::string& label = reader.label();
  convert_case one;
  one.name = name;
  one.metadata = reader.metadata();
  const std::string format = metadata_value(one.metadata, "format", label);
  if (format == "fp8_e4m3") {
    one.kind = core::element_kind::fp8_e4m3;
  } else if (format == "fp8_e5m2") {
    one.kind = core::element_kind::fp8_e5m2;
  } else {
    fail(label, "__metadata__.format", fmt::format("'{}': expected fp8_e4m3 or fp8_e5m2", io::printable_name(format)));
  }
  for (const auto& tensor : reader.tensors()) {
    if (tensor.name != "in" && tensor.name != "out") {
      fail(label, io::printable_name(tensor.name), "unexpected tensor (a convert case holds in and out)");
    }
  }
  const io::tensor_info* in = reader.find("in");
  const io::tensor_info* out = reader.find("out");
  if (in == nullptr || in->type != io::dtype::f32 || in->shape.size() != 1 || in->shape[0] < 1) {
    fail(label, "in", "must be a 1-D F32 tensor of at least one value");
  }
  if (out == nullptr || out->type != io::dtype::u8 || out->shape != in->shape) {
    fail(label, "out", fmt::format("must be a 1-D U8 tensor of in's length ({})", in->shape[0]));
  }
  const std::vector<std::uint8_t> bytes = reader.read_tensor("in");
  one.in.resize(static_cast<std::size_t>(in->shape[0]));
  std::memcpy(one.in.data(), bytes.data(), one.in.size() * sizeof(float));
  one.out = reader.read_tensor("out");
  return one;
}

}  // namespace

conformance_set read_conformance_set(const std::filesystem::path& directory) {
  const fs::path manifest_path = directory / "manifest.json";
  const std::string manifest = manifest_path.string();
  const json root = read_json_file(manifest_path);
  if (!root.is_object()) fail(manifest, "manifest", "must be a JSON object");
  for (const auto& [key, unused] : root.items()) {
    if (key != "format" && key != "version" && key != "source" && key != "cases") {
      fail(manifest, io::printable_name(key), "unexpected field (expected format, version, source, cases)");
    }
  }
  if (!root.contains("format") || root.at("format") != conformance_format_name) {
    fail(manifest, "format", fmt::format("expected \"{}\"", conformance_format_name));
  }
  if (!root.contains("version") || !root.at("version").is_number_integer() ||
      root.at("version").get<std::int64_t>() != conformance_format_version) {
    fail(manifest, "version", fmt::format("this reader understands version {}", conformance_format_version));
  }
  conformance_set set;
  if (root.contains("source")) {
    if (!root.at("source").is_object()) fail(manifest, "source", "must be an object");
    set.source_json = root.at("source").dump();
  }
  if (!root.contains("cases") || !root.at("cases").is_array()) fail(manifest, "cases", "missing or not an array");
  std::set<std::string> names;
  std::size_t index = 0;
  for (const json& listed : root.at("cases")) {
    const std::string where = fmt::format("{}: cases[{}]", manifest, index++);
    if (!listed.is_object() || !listed.contains("name") || !listed.at("name").is_string() || !listed.contains("file") ||
        !listed.at("file").is_string()) {
      fail(where, "case", "must be an object with string fields name and file");
    }
    gemm_case one;
    one.name = listed.at("name").get<std::string>();
    if (one.name.empty() || !names.insert(one.name).second) fail(where, "name", "empty or duplicate");
    const std::string file = listed.at("file").get<std::string>();
    check_relative(file, where);
    check_inside(directory, file, where);
    const io::safetensors_reader reader(directory / file);
    const std::string& label = reader.label();
    one.metadata = reader.metadata();
    const std::string case_kind = metadata_value(one.metadata, "mxscope.case", label);
    if (case_kind == "convert") {
      set.converts.push_back(read_convert_case(reader, one.name));
      continue;
    }
    if (case_kind != "gemm") fail(label, "__metadata__.mxscope.case", "expected \"gemm\" or \"convert\"");
    one.kind = metadata_value(one.metadata, "out.kind", label);
    if (one.kind != "fprop" && one.kind != "dgrad" && one.kind != "wgrad" && one.kind != "product") {
      fail(label, "__metadata__.out.kind", fmt::format("'{}': expected fprop, dgrad, wgrad or product",
                                                        io::printable_name(one.kind)));
    }
    // "out.rounding" says how the hardware rounded its fp32 accumulator: absent or "fp32", or "bf16".
    if (const auto rounding = one.metadata.find("out.rounding");
        rounding != one.metadata.end() && rounding->second != "fp32" && rounding->second != "bf16") {
      fail(label, "__metadata__.out.rounding",
           fmt::format("'{}': expected fp32 or bf16", io::printable_name(rounding->second)));
    }
    for (const auto& tensor : reader.tensors()) {
      static const std::set<std::string> allowed = {"a", "b", "out", "a.codes", "a.scales", "b.codes", "b.scales"};
      if (allowed.count(tensor.name) == 0) {
        fail(label, io::printable_name(tensor.name), "unexpected tensor (a case holds a, b, out, <a|b>.codes/.scales)");
      }
    }
    const io::tensor_info* out = reader.find("out");
    if (out == nullptr) fail(label, "out", "missing: the hardware output [M, N] fp32");
    if (out->type != io::dtype::f32 || out->shape.size() != 2) fail(label, "out", "must be a 2-D F32 tensor");
    one.a = read_operand(reader, "a");
    one.b = read_operand(reader, "b");
    if (one.a.cols != one.b.cols) {
      fail(label, "b.shape", fmt::format("a has K = {} but b has K = {} (both hold K along axis 1)", one.a.cols, one.b.cols));
    }
    if (one.a.block != 0 && one.b.block != 0 && one.a.block != one.b.block) {
      fail(label, "b.block", "a and b must use the same block size");
    }
    if (out->shape != std::vector<std::int64_t>{one.a.rows, one.b.rows}) {
      fail(label, "out.shape", fmt::format("must be [M, N] = [{}, {}]", one.a.rows, one.b.rows));
    }
    if (one.a.rows == 0 || one.b.rows == 0 || one.a.cols == 0) {
      fail(label, "out.shape", "holds no outputs (M, N and K must be at least 1)");
    }
    read_tensor_scales(one, label);
    one.out = reader.read_matrix("out");
    set.cases.push_back(std::move(one));
  }
  if (set.cases.empty() && set.converts.empty()) fail(manifest, "cases", "lists no case");
  return set;
}

std::vector<gemm_case> cases_named(const std::vector<gemm_case>& cases, const std::string& prefix,
                                   std::string_view field) {
  std::vector<gemm_case> chosen;
  for (const auto& one : cases) {
    if (one.name.starts_with(prefix)) chosen.push_back(one);
  }
  if (chosen.empty()) {
    throw input_error(fmt::format("field '{}': no case name starts with '{}'", field, io::printable_name(prefix)));
  }
  return chosen;
}

std::string convert_model::name() const {
  static constexpr const char* overflow_names[] = {"saturate", "nan", "infinity"};
  return fmt::format("{}/{}", rounding_name(rounding), overflow_names[static_cast<int>(overflow)]);
}

std::uint8_t convert_code(core::element_kind kind, float value, const convert_model& model) {
  const double v = value;
  if (std::isnan(v)) return static_cast<std::uint8_t>(core::nan_code(kind));
  const double magnitude = std::fabs(v);
  const double maximum = core::max_normal(kind);
  // Overflow: the magnitude rounds beyond the largest finite value at its spacing (never under rtz,
  // which stops at the largest finite value), or is infinite.
  bool overflow = std::isinf(v);
  if (!overflow && magnitude > maximum && model.rounding != core::rounding_mode::rtz) {
    const int spacing = core::floor_log2(maximum) - core::spec(kind).mantissa_bits;
    overflow = magnitude >= 2.0 * maximum ||
               static_cast<double>(core::round_to_integer(magnitude * core::pow2(-spacing), model.rounding, 0, 32)) *
                       core::pow2(spacing) > maximum;
  }
  const std::uint32_t sign = std::signbit(v) ? core::sign_bit(kind) : 0U;
  if (overflow && model.overflow == overflow_rule::nan) return static_cast<std::uint8_t>(core::nan_code(kind));
  if (overflow && model.overflow == overflow_rule::infinity) {
    const auto& f = core::spec(kind);
    return static_cast<std::uint8_t>(sign | (((1U << f.exponent_bits) - 1U) << f.mantissa_bits));
  }
  return core::encode(kind, v, model.rounding).code;
}

std::vector<convert_agreement> check_converts(const convert_case& one, std::size_t max_listed) {
  std::vector<convert_agreement> rows;
  const bool has_infinity = core::spec(one.kind).specials == core::special_encoding::ieee;
  for (const auto rounding : {core::rounding_mode::rne, core::rounding_mode::rtz, core::rounding_mode::rna}) {
    for (const auto overflow : {overflow_rule::saturate, overflow_rule::nan, overflow_rule::infinity}) {
      if (overflow == overflow_rule::infinity && !has_infinity) continue;
      const convert_model model{rounding, overflow};
      convert_agreement row;
      row.name = model.name();
      for (std::size_t i = 0; i < one.in.size(); ++i) {
        const std::uint8_t expected = convert_code(one.kind, one.in[i], model);
        const bool both_nan = std::isnan(core::decode(one.kind, expected)) && std::isnan(core::decode(one.kind, one.out[i]));
        ++row.compared;
        if (expected == one.out[i] || both_nan) {
          ++row.matches;
        } else if (row.first_mismatches.size() < max_listed) {
          row.first_mismatches.push_back(static_cast<std::int64_t>(i));
        }
      }
      rows.push_back(std::move(row));
    }
  }
  return rows;
}

std::string hardware_path(const gemm_case& one) {
  const auto call = one.metadata.find("call");
  const auto rounding = one.metadata.find("out.rounding");
  const std::string operation = call != one.metadata.end()
                                    ? call->second
                                    : fmt::format("a {}, b {}", format_name(one.a.options.format),
                                                  format_name(one.b.options.format));
  return fmt::format("{}, out {}", operation, rounding != one.metadata.end() ? rounding->second : "fp32");
}

std::vector<std::pair<std::string, std::vector<gemm_case>>> cases_by_path(const std::vector<gemm_case>& cases) {
  std::vector<std::pair<std::string, std::vector<gemm_case>>> groups;
  for (const auto& one : cases) {
    const std::string path = hardware_path(one);
    auto group = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == path; });
    if (group == groups.end()) {
      groups.emplace_back(path, std::vector<gemm_case>{});
      group = std::prev(groups.end());
    }
    group->second.push_back(one);
  }
  return groups;
}

model_agreement check_model(const std::vector<gemm_case>& cases, const accumulation_model& model,
                            std::size_t max_listed, const gemm_options& options) {
  model_agreement agreement;
  agreement.model = model;
  agreement.name = accumulation_model_name(model);
  std::vector<worst_entry> disagreeing;
  for (const auto& one : cases) {
    // A case whose hardware rounded its fp32 accumulator to bf16 says so in "out.rounding".
    const auto rounding_entry = one.metadata.find("out.rounding");
    const output_rounding rounding = rounding_entry != one.metadata.end() && rounding_entry->second == "bf16"
                                         ? output_rounding::bf16
                                         : output_rounding::fp32;
    const product_result result = emulate_product(one.a, one.b, model, rounding, options);
    const std::int64_t matches_before = agreement.matches;
    const std::int64_t compared_before = agreement.compared;
    for (std::int64_t row = 0; row < one.out.rows; ++row) {
      for (std::int64_t col = 0; col < one.out.cols; ++col) {
        const float hardware = one.out(row, col);
        const float emulated = result.out(row, col);
        ++agreement.compared;
        const bool hardware_nan = std::isnan(hardware);
        const bool emulated_nan = std::isnan(emulated);
        std::uint64_t ulps = 0;
        if (hardware_nan && emulated_nan) {
          ++agreement.matches;
          continue;
        }
        if (hardware_nan != emulated_nan) {
          ++agreement.nan_mismatches;
          ulps = std::numeric_limits<std::uint64_t>::max();
        } else {
          ulps = ulp_distance(hardware, emulated);
          ++agreement.histogram[static_cast<std::size_t>(ulp_bucket(ulps))];
          agreement.max_ulps = std::max(agreement.max_ulps, ulps);
          if (core::float_bits(hardware) == core::float_bits(emulated)) {
            ++agreement.matches;
            continue;
          }
        }
        if (max_listed > 0) disagreeing.push_back({one.name, row, col, hardware, emulated, ulps});
      }
    }
    agreement.per_case.push_back(
        {one.name, agreement.compared - compared_before, agreement.matches - matches_before});
  }
  const std::size_t listed = std::min(max_listed, disagreeing.size());
  std::stable_sort(disagreeing.begin(), disagreeing.end(),
                   [](const worst_entry& a, const worst_entry& b) { return a.ulps > b.ulps; });
  agreement.worst.assign(disagreeing.begin(), disagreeing.begin() + static_cast<std::ptrdiff_t>(listed));
  return agreement;
}

std::vector<accumulation_model> standard_models() {
  std::vector<accumulation_model> models;
  models.push_back({accumulation_kind::exact, 1, 0, alignment_rounding::rtz});
  models.push_back({accumulation_kind::fp32_block, 1, 0, alignment_rounding::rtz});
  for (const int group : {2, 4, 8}) models.push_back({accumulation_kind::fp32_group, group, 0, alignment_rounding::rtz});
  models.push_back({accumulation_kind::fp32_seq, 1, 0, alignment_rounding::rtz});
  return models;
}

std::vector<accumulation_model> fit_family() {
  std::vector<accumulation_model> models;
  for (int fraction_bits = 8; fraction_bits <= 30; ++fraction_bits) {
    for (const int group : {1, 2, 4, 8}) {
      for (const auto mode : {alignment_rounding::rtz, alignment_rounding::rne}) {
        models.push_back({accumulation_kind::trunc_align, group, fraction_bits, mode});
      }
    }
  }
  for (int fraction_bits = 8; fraction_bits <= 30; ++fraction_bits) {
    for (const int step : {8, 16, 32, 64}) {
      for (const int step_bits : {12, 13, 14, 15, 16, 24}) {
        for (const int steps_per_promotion : {0, 2, 4, 8}) {
          accumulation_model model{accumulation_kind::trunc_promote, 1, fraction_bits, alignment_rounding::rtz};
          model.products_per_step = step;
          model.step_bits = step_bits;
          model.promotion_interval = steps_per_promotion * step;
          models.push_back(model);
        }
      }
    }
  }
  // Split K: a GEMM that cuts K into chunks of c products, accumulates each chunk in the full-width
  // truncating adder and sums the chunks' fp32 results in order computes trunc-promote with
  // promotion interval c. Chunks are multiples of a K tile, so c runs over multiples of 128 (the
  // H200's cuBLAS bf16 GEMM splits K >= 4096 into chunks of 1408, docs/conformance.md).
  for (int fraction_bits = 24; fraction_bits <= 26; ++fraction_bits) {
    for (const int step : {16, 32}) {
      for (int chunk = 512; chunk <= 4096; chunk += 128) {
        accumulation_model model{accumulation_kind::trunc_promote, 1, fraction_bits, alignment_rounding::rtz};
        model.products_per_step = step;
        model.step_bits = 24;
        model.promotion_interval = chunk;
        models.push_back(model);
      }
    }
  }
  models.push_back({accumulation_kind::fp32_block, 1, 0, alignment_rounding::rtz});
  for (const int group : {2, 4, 8}) models.push_back({accumulation_kind::fp32_group, group, 0, alignment_rounding::rtz});
  models.push_back({accumulation_kind::fp32_seq, 1, 0, alignment_rounding::rtz});
  models.push_back({accumulation_kind::exact, 1, 0, alignment_rounding::rtz});
  return models;
}

gemm_fit fit_gemm(const std::vector<gemm_case>& cases, const std::vector<accumulation_model>& family,
                  std::int64_t sample_rows, std::size_t finalists, std::size_t max_listed, const gemm_options& options) {
  gemm_fit fit;
  fit.screened = family.size();
  std::vector<gemm_case> sample;
  for (const auto& one : cases) {
    const auto a_rows = spread_rows(one.a.rows, sample_rows);
    const auto b_rows = spread_rows(one.b.rows, sample_rows);
    gemm_case small;
    small.name = one.name;
    small.kind = one.kind;
    small.metadata = one.metadata;  // "out.rounding" applies to the sample too
    small.a = select_rows(one.a, a_rows);
    small.b = select_rows(one.b, b_rows);
    small.out = matrix(static_cast<std::int64_t>(a_rows.size()), static_cast<std::int64_t>(b_rows.size()));
    for (std::size_t i = 0; i < a_rows.size(); ++i) {
      for (std::size_t j = 0; j < b_rows.size(); ++j) {
        small.out(static_cast<std::int64_t>(i), static_cast<std::int64_t>(j)) = one.out(a_rows[i], b_rows[j]);
      }
    }
    fit.sample_entries += small.out.size();
    sample.push_back(std::move(small));
  }
  // The models are independent: screen them in parallel (each result is the same on any thread).
  std::vector<std::pair<std::int64_t, std::size_t>> screened(family.size());  // (sample matches, family index)
  const auto count = static_cast<std::int64_t>(family.size());
  std::vector<std::exception_ptr> failures(family.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t i = 0; i < count; ++i) {
    const auto index = static_cast<std::size_t>(i);
    try {
      screened[index] = {check_model(sample, family[index], 0, options).matches, index};
    } catch (...) {
      failures[index] = std::current_exception();
    }
  }
  for (const auto& failure : failures) {
    if (failure) std::rethrow_exception(failure);  // the first in family order, as a serial loop would
  }
  std::stable_sort(screened.begin(), screened.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::size_t> chosen;
  for (const auto& [matches, index] : screened) {
    if (matches == screened.front().first || chosen.size() < finalists) chosen.push_back(index);
  }
  std::sort(chosen.begin(), chosen.end());  // family order among equals
  for (const std::size_t index : chosen) fit.finalists.push_back(check_model(cases, family[index], max_listed, options));
  std::stable_sort(fit.finalists.begin(), fit.finalists.end(),
                   [](const model_agreement& a, const model_agreement& b) { return a.matches > b.matches; });
  for (const auto& finalist : fit.finalists) {
    if (finalist.matches == fit.finalists.front().matches) fit.tied.push_back(finalist.name);
  }
  return fit;
}

std::string operand_class(const std::string& case_name) {
  const std::size_t marker = case_name.rfind("_K");
  if (marker == std::string::npos || marker + 2 == case_name.size()) return case_name;
  const bool digits = std::all_of(case_name.begin() + static_cast<std::ptrdiff_t>(marker + 2), case_name.end(),
                                  [](char c) { return c >= '0' && c <= '9'; });
  return digits ? case_name.substr(0, marker) : case_name;
}

namespace {

// The cases split by a key: the distinct keys, in the given order, go alternately to the fitted and
// the held-out half; every case follows its key.
template <class Key, class KeyOf>
holdout_split split_alternately(const std::vector<gemm_case>& cases, const std::vector<Key>& keys, KeyOf key_of,
                                std::string rule, std::string_view label_prefix) {
  holdout_split split;
  split.rule = std::move(rule);
  std::vector<Key> fitted_keys;
  std::vector<Key> held_keys;
  for (std::size_t i = 0; i < keys.size(); ++i) (i % 2 == 0 ? fitted_keys : held_keys).push_back(keys[i]);
  for (const auto& one : cases) {
    const bool fitted = std::find(fitted_keys.begin(), fitted_keys.end(), key_of(one)) != fitted_keys.end();
    (fitted ? split.fitted : split.held_out).push_back(one);
  }
  split.fitted_label = fmt::format("{}{}", label_prefix, fmt::join(fitted_keys, " "));
  split.held_out_label = fmt::format("{}{}", label_prefix, fmt::join(held_keys, " "));
  return split;
}

}  // namespace

std::vector<holdout_split> holdout_splits(const std::vector<gemm_case>& cases) {
  std::vector<holdout_split> splits;
  std::vector<std::int64_t> depths;
  for (const auto& one : cases) depths.push_back(one.a.cols);
  std::sort(depths.begin(), depths.end());
  depths.erase(std::unique(depths.begin(), depths.end()), depths.end());
  if (depths.size() >= 2) {
    splits.push_back(split_alternately(cases, depths, [](const gemm_case& one) { return one.a.cols; }, "by K", "K "));
  }
  std::vector<std::string> classes;
  for (const auto& one : cases) {
    const std::string name = operand_class(one.name);
    if (std::find(classes.begin(), classes.end(), name) == classes.end()) classes.push_back(name);
  }
  if (classes.size() >= 2) {
    splits.push_back(split_alternately(cases, classes, [](const gemm_case& one) { return operand_class(one.name); },
                                       "by operand class", ""));
  }
  return splits;
}

// ------------------------------------------------------------------------------------------------
// Self-test.

namespace {

// Inputs that exercise every branch of a quantizer: normal values over a wide range of block
// magnitudes, exact midpoints of the element grid, zeros, subnormals, values past the maximum after
// scaling and, in one block, a NaN.
matrix generated_input(std::int64_t rows, std::int64_t cols, std::uint64_t seed, bool with_nan) {
  std::mt19937_64 generator(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 20);
  std::uniform_int_distribution<int> kind(0, 15);
  std::uniform_int_distribution<int> small_integer(0, 15);
  matrix values(rows, cols);
  for (std::int64_t r = 0; r < rows; ++r) {
    const float row_scale = std::ldexp(1.0f, exponent(generator));
    for (std::int64_t c = 0; c < cols; ++c) {
      const int choice = kind(generator);
      float v = normal(generator) * row_scale;
      if (choice == 0) v = 0.0f;
      if (choice == 1 || choice == 2) v = (static_cast<float>(small_integer(generator)) + 0.5f) * row_scale * 0.25f;  // midpoints
      if (choice == 3) v = std::ldexp(normal(generator), -140);  // fp32 subnormals
      values(r, c) = v;
    }
  }
  if (with_nan && rows > 1 && cols > 3) values(1, 3) = std::numeric_limits<float>::quiet_NaN();
  return values;
}

std::int64_t differing_bytes(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b) {
  if (a.size() != b.size()) return static_cast<std::int64_t>(std::max(a.size(), b.size()));
  std::int64_t count = 0;
  for (std::size_t i = 0; i < a.size(); ++i) count += a[i] != b[i];
  return count;
}

std::int64_t differing_floats(const matrix& a, const matrix& b) {
  if (a.rows != b.rows || a.cols != b.cols) return std::max(a.size(), b.size());
  std::int64_t count = 0;
  for (std::size_t i = 0; i < a.values.size(); ++i) {
    const bool both_nan = std::isnan(a.values[i]) && std::isnan(b.values[i]);
    count += !both_nan && core::float_bits(a.values[i]) != core::float_bits(b.values[i]);
  }
  return count;
}

const char* const mx_format_names[] = {"mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2"};

quantize_options mx_options(const std::string& name, int axis, core::scale_rule rule, core::rounding_mode rounding) {
  quantize_options options;
  options.format = *parse_format(name);
  options.block = 32;
  options.axis = axis;
  options.rule = rule;
  options.rounding = rounding;
  options.stream = core::random_stream{7, 3, 0x1234U};
  return options;
}

// Restores the process-wide fast-quantize switch however the self-test leaves.
struct fast_quantize_guard {
  bool saved = fast_quantize_enabled();
  ~fast_quantize_guard() { set_fast_quantize_enabled(saved); }
};

quantized_tensor canonical_quantize(const matrix& input, const quantize_options& options) {
  set_fast_quantize_enabled(false);
  quantized_tensor out = quantize(input, options);
  set_fast_quantize_enabled(true);
  return out;
}

std::vector<std::pair<std::string, accumulation_model>> self_test_models() {
  std::vector<std::pair<std::string, accumulation_model>> models;
  for (const auto& model : standard_models()) models.emplace_back(accumulation_model_name(model), model);
  for (const char* text : {"trunc-align:14,1,rtz", "trunc-align:24,4,rne"}) {
    models.emplace_back(text, parse_accumulation_model(text));
  }
  return models;
}

std::vector<self_test_row> cpu_self_test(std::uint64_t seed) {
  std::vector<self_test_row> rows;
  const fast_quantize_guard guard;
  const matrix input = generated_input(64, 256, seed, true);
  for (const char* name : mx_format_names) {
    for (const int axis : {0, 1}) {
      self_test_row row;
      row.kernel = fmt::format("quantize {} axis {} (3 scale rules x rne/rna/rtz/sr)", name, axis);
      for (const auto rule : {core::scale_rule::floor, core::scale_rule::ceil, core::scale_rule::even}) {
        for (const auto rounding : {core::rounding_mode::rne, core::rounding_mode::rna, core::rounding_mode::rtz,
                                    core::rounding_mode::sr}) {
          const quantize_options options = mx_options(name, axis, rule, rounding);
          const quantized_tensor canonical = canonical_quantize(input, options);
          set_fast_quantize_enabled(true);
          const quantized_tensor fast = quantize(input, options);
          row.compared += static_cast<std::int64_t>(canonical.codes.size() + canonical.scales.size()) + canonical.dequantized.size();
          row.differing += differing_bytes(canonical.codes, fast.codes) + differing_bytes(canonical.scales, fast.scales) +
                           differing_floats(canonical.dequantized, fast.dequantized);
        }
      }
      rows.push_back(row);
    }
    // The rotation fused into the quantizer against rotate() + the canonical quantizer.
    self_test_row row;
    row.kernel = fmt::format("rotated quantize {} hadamard:32 axis 1 (rne, sr)", name);
    for (const auto rounding : {core::rounding_mode::rne, core::rounding_mode::sr}) {
      const quantize_options options = mx_options(name, 1, core::scale_rule::floor, rounding);
      rotation_options rotation;
      rotation.size = 32;
      rotation.signs = sign_policy::per_step;
      rotation.seed = 11;
      rotation.step = 2;
      rotation.layer_hash = 0x9e3779b9U;
      matrix rotated = input;
      rotate(rotated, 1, rotation, "self-test");
      const quantized_tensor canonical = canonical_quantize(rotated, options);
      quantized_tensor fast;
      fast.codes.assign(canonical.codes.size(), 0);
      fast.scales.assign(canonical.scales.size(), 0);
      fast.dequantized = matrix(input.rows, input.cols);
      quantize_mx_rotated_fast(input.data(), input.rows, input.cols, options, rotation,
                               mx_destination{fast.codes.data(), fast.scales.data(), fast.dequantized.data()});
      row.compared += static_cast<std::int64_t>(canonical.codes.size() + canonical.scales.size()) + canonical.dequantized.size();
      row.differing += differing_bytes(canonical.codes, fast.codes) + differing_bytes(canonical.scales, fast.scales) +
                       differing_floats(canonical.dequantized, fast.dequantized);
    }
    rows.push_back(row);
  }

  // GEMMs: the automatic path (integer block kernels, SIMD, tiling) against the generic definition.
  const matrix a_input = generated_input(24, 256, seed + 1, false);
  const matrix b_input = generated_input(20, 256, seed + 2, false);
  for (const char* name : {"mxfp4", "mxfp6_e2m3", "mxfp8_e4m3", "fp32"}) {
    quantized_tensor a;
    quantized_tensor b;
    if (std::string(name) == "fp32") {
      a = plain_operand(a_input);
      b = plain_operand(b_input);
    } else {
      a = canonical_quantize(a_input, mx_options(name, 1, core::scale_rule::floor, core::rounding_mode::rne));
      b = canonical_quantize(b_input, mx_options(name, 1, core::scale_rule::floor, core::rounding_mode::rne));
    }
    for (const auto& [model_name, model] : self_test_models()) {
      gemm_options generic;
      generic.path = accumulation_path::generic;
      generic.vector_kernels = false;
      const product_result reference = emulate_product(a, b, model, output_rounding::fp32, generic);
      for (const bool vector_kernels : {true, false}) {
        gemm_options fast;
        fast.vector_kernels = vector_kernels;
        const product_result result = emulate_product(a, b, model, output_rounding::fp32, fast);
        self_test_row row;
        row.kernel = fmt::format("gemm {} {} x {} ({} kernels)", model_name, name, name,
                                 vector_kernels ? "SIMD" : "portable");
        row.compared = reference.out.size();
        row.differing = differing_floats(reference.out, result.out);
        rows.push_back(row);
      }
    }
  }
  return rows;
}

// The GPU kernels (through src/backend) against the canonical CPU paths.
std::vector<self_test_row> gpu_self_test(std::uint64_t seed) {
  std::vector<self_test_row> rows;
  const fast_quantize_guard guard;
  const matrix input = generated_input(64, 256, seed, true);
  for (const char* name : mx_format_names) {
    for (const int axis : {0, 1}) {
      self_test_row row;
      row.kernel = fmt::format("gpu quantize {} axis {} (3 scale rules x rne/rna/rtz/sr)", name, axis);
      for (const auto rule : {core::scale_rule::floor, core::scale_rule::ceil, core::scale_rule::even}) {
        for (const auto rounding : {core::rounding_mode::rne, core::rounding_mode::rna, core::rounding_mode::rtz,
                                    core::rounding_mode::sr}) {
          const quantize_options options = mx_options(name, axis, rule, rounding);
          const quantized_tensor canonical = canonical_quantize(input, options);
          const quantized_tensor device = backend::quantize(input, options);
          row.compared += static_cast<std::int64_t>(canonical.codes.size() + canonical.scales.size());
          row.differing += differing_bytes(canonical.codes, device.codes) + differing_bytes(canonical.scales, device.scales);
        }
      }
      rows.push_back(row);
    }
  }
  // NVFP4: 1-D tiles along either axis and 2-D tiles, every rounding mode.
  for (int layout = 0; layout < 3; ++layout) {
    self_test_row row;
    row.kernel = fmt::format("gpu quantize nvfp4 {} (rne/rna/rtz/sr)",
                             layout == 2 ? std::string("2-D tiles") : fmt::format("axis {}", layout));
    for (const auto rounding : {core::rounding_mode::rne, core::rounding_mode::rna, core::rounding_mode::rtz,
                                core::rounding_mode::sr}) {
      quantize_options options = mx_options("nvfp4", layout == 2 ? 1 : layout, core::scale_rule::floor, rounding);
      options.block = 16;
      options.nvfp4_2d = layout == 2;
      const quantized_tensor canonical = quantize(input, options);
      const quantized_tensor device = backend::quantize(input, options);
      row.compared += static_cast<std::int64_t>(canonical.codes.size() + canonical.scales.size() + 1);
      row.differing += differing_bytes(canonical.codes, device.codes) + differing_bytes(canonical.scales, device.scales) +
                       (core::float_bits(canonical.tensor_scale) != core::float_bits(device.tensor_scale) ? 1 : 0);
    }
    rows.push_back(row);
  }
  const matrix a_input = generated_input(24, 256, seed + 1, false);
  const matrix b_input = generated_input(20, 256, seed + 2, false);
  for (const char* name : {"mxfp4", "mxfp8_e4m3"}) {
    const quantized_tensor a = canonical_quantize(a_input, mx_options(name, 1, core::scale_rule::floor, core::rounding_mode::rne));
    const quantized_tensor b = canonical_quantize(b_input, mx_options(name, 1, core::scale_rule::floor, core::rounding_mode::rne));
    for (const auto& model : standard_models()) {
      gemm_options generic;
      generic.path = accumulation_path::generic;
      const product_result reference = emulate_product(a, b, model, output_rounding::fp32, generic);
      const product_result device = backend::emulate(a, b, model);
      self_test_row row;
      row.kernel = fmt::format("gpu gemm {} {} x {}", accumulation_model_name(model), name, name);
      row.compared = reference.out.size();
      row.differing = differing_floats(reference.out, device.out);
      rows.push_back(row);
    }
  }
  if (backend::native_mx_available()) {
    // The gfx950 native path by name (the rows above take it too where it applies): the hardware
    // MX conversions (rne, and sr with the sr_bits it maps onto the seed) and the scaled MFMA as
    // fp32-group:4, on shapes that are not multiples of the instruction's tiles. Any difference here
    // refutes a hypothesis of docs/gpu.md about the MI355X.
    for (const auto rule : {core::scale_rule::floor, core::scale_rule::ceil, core::scale_rule::even}) {
      for (const int sr_bits : {0, 22, 9, 1}) {
        quantize_options options =
            mx_options("mxfp4", 1, rule, sr_bits == 0 ? core::rounding_mode::rne : core::rounding_mode::sr);
        if (sr_bits > 0) options.sr_bits = sr_bits;
        const quantized_tensor canonical = canonical_quantize(input, options);
        const quantized_tensor device = backend::quantize(input, options, true);
        self_test_row row;
        row.kernel = fmt::format("gpu quantize native gfx950 mxfp4 {} {}", scale_rule_name(rule),
                                 sr_bits == 0 ? std::string("rne") : fmt::format("sr sr_bits {}", sr_bits));
        row.compared = static_cast<std::int64_t>(canonical.codes.size() + canonical.scales.size() +
                                                 canonical.dequantized.values.size());
        row.differing = differing_bytes(canonical.codes, device.codes) +
                        differing_bytes(canonical.scales, device.scales) +
                        differing_floats(canonical.dequantized, device.dequantized);
        rows.push_back(row);
      }
    }
    const accumulation_model group4{accumulation_kind::fp32_group, 4, 0, alignment_rounding::rtz};
    const auto options = mx_options("mxfp4", 1, core::scale_rule::floor, core::rounding_mode::rne);
    const quantized_tensor a = canonical_quantize(generated_input(37, 200, seed + 3, false), options);
    const quantized_tensor b = canonical_quantize(generated_input(21, 200, seed + 4, false), options);
    gemm_options generic;
    generic.path = accumulation_path::generic;
    const product_result reference = emulate_product(a, b, group4, output_rounding::fp32, generic);
    const product_result device = backend::emulate(a, b, group4, true);
    self_test_row row;
    row.kernel = "gpu gemm native gfx950 scaled MFMA fp32-group:4 mxfp4 x mxfp4 (37 x 21, K 200)";
    row.compared = reference.out.size();
    row.differing = differing_floats(reference.out, device.out);
    rows.push_back(row);
  }
  return rows;
}

}  // namespace

bool gpu_backend_available() { return gpu_count() > 0; }

std::vector<self_test_row> self_test(self_test_device device, std::uint64_t seed) {
  if (device == self_test_device::cpu) return cpu_self_test(seed);
  if (!backend::built_with_gpu()) {
    throw input_error(
        "conform --self-test: field '--device': gpu: this mxscope was built without a GPU backend (configure with "
        "MXSCOPE_ENABLE_CUDA=ON on a machine with nvcc, or MXSCOPE_ENABLE_HIP=ON for AMD GPUs, see docs/gpu.md); the "
        "CPU self-test is --device cpu");
  }
  if (gpu_count() == 0) {
    throw input_error("conform --self-test: field '--device': gpu: no usable GPU (no device or no driver) on this "
                      "machine; the CPU self-test is --device cpu");
  }
  return gpu_self_test(seed);
}

}  // namespace mxscope::conform
