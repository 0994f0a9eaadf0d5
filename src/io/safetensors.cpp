#include "mxscope/io/safetensors.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>
#include <thread>

#include "mxscope/core/formats.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/io/json_guard.hpp"
#include "mxscope/io/atomic_file.hpp"

namespace mxscope::io {

// The format is little-endian and so are all the machines this project targets; tensor bytes are
// reinterpreted in place below.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

namespace {

using json = nlohmann::json;

struct dtype_entry {
  dtype type;
  std::string_view name;
  int size;
  bool floating;
  bool to_matrix;
};

constexpr dtype_entry dtype_table[] = {
    {dtype::f64, "F64", 8, true, true},       {dtype::f32, "F32", 4, true, true},
    {dtype::f16, "F16", 2, true, true},       {dtype::bf16, "BF16", 2, true, true},
    {dtype::u8, "U8", 1, false, true},        {dtype::i8, "I8", 1, false, true},
    {dtype::f8_e4m3, "F8_E4M3", 1, true, true}, {dtype::f8_e5m2, "F8_E5M2", 1, true, true},
    {dtype::i16, "I16", 2, false, true},      {dtype::i32, "I32", 4, false, false},
    {dtype::i64, "I64", 8, false, false},     {dtype::u16, "U16", 2, false, true},
    {dtype::u32, "U32", 4, false, false},     {dtype::u64, "U64", 8, false, false},
    {dtype::boolean, "BOOL", 1, false, true},
};

const dtype_entry& entry_of(dtype type) {
  for (const auto& entry : dtype_table) {
    if (entry.type == type) return entry;
  }
  throw std::logic_error("unknown dtype enumerator");
}

std::string known_dtype_list() {
  std::string list;
  for (const auto& entry : dtype_table) {
    if (!list.empty()) list += ' ';
    list += entry.name;
  }
  return list;
}

// Loads a little-endian value of type T from possibly unaligned bytes.
template <typename T>
T load(const std::uint8_t* bytes) {
  T value;
  std::memcpy(&value, bytes, sizeof(T));
  return value;
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// Error helpers: every message starts with the file, then the tensor, then the field.
[[noreturn]] void fail_file(const std::string& label, std::string_view field, const std::string& message) {
  throw input_error(fmt::format("{}: field '{}': {}", label, field, message));
}

[[noreturn]] void fail_tensor(const std::string& label, std::string_view tensor, std::string_view field,
                              const std::string& message) {
  throw input_error(fmt::format("{}: tensor '{}': field '{}': {}", label, printable_name(tensor), field, message));
}

std::string json_type_name(const json& value) {
  if (value.is_number_unsigned() || value.is_number_integer()) return "integer";
  if (value.is_number_float()) return "floating-point number";
  return value.type_name();
}

// A non-negative JSON integer that fits in an int64 (shape dimensions, offsets).
std::uint64_t non_negative_integer(const json& value, const std::string& label, std::string_view tensor,
                                   std::string_view field, std::string_view what) {
  if (value.is_number_unsigned()) {
    const auto number = value.get<std::uint64_t>();
    if (number > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      fail_tensor(label, tensor, field, fmt::format("{} {} is too large", what, number));
    }
    return number;
  }
  if (value.is_number_integer()) {
    fail_tensor(label, tensor, field, fmt::format("{} {} is negative", what, value.get<std::int64_t>()));
  }
  if (value.is_number_float()) {
    // Integers beyond 2^64 also arrive here: nlohmann parses them as doubles.
    fail_tensor(label, tensor, field, fmt::format("{} {} is not an integer", what, value.dump()));
  }
  fail_tensor(label, tensor, field, fmt::format("{} must be a non-negative integer, got {}", what, json_type_name(value)));
}

constexpr std::size_t max_rank = 32;

}  // namespace

std::optional<dtype> parse_dtype(std::string_view name) {
  for (const auto& entry : dtype_table) {
    if (entry.name == name) return entry.type;
  }
  return std::nullopt;
}

std::string_view dtype_name(dtype type) { return entry_of(type).name; }
int dtype_size(dtype type) { return entry_of(type).size; }
bool is_floating(dtype type) { return entry_of(type).floating; }
bool converts_to_matrix(dtype type) { return entry_of(type).to_matrix; }

std::string printable_name(std::string_view name, std::size_t max_shown) {
  std::string out;
  std::size_t shown = 0;
  for (const char character : name) {
    if (shown == max_shown) {
      out += fmt::format("...({} bytes)", name.size());
      break;
    }
    const auto byte = static_cast<unsigned char>(character);
    if (byte < 0x20 || byte >= 0x7f) {
      out += fmt::format("\\x{:02x}", byte);
    } else if (character == '\\' || character == '\'') {
      out += '\\';
      out += character;
    } else {
      out += character;
    }
    ++shown;
  }
  return out;
}

// ------------------------------------------------------------------------------------------------
// Reader.

struct safetensors_reader::file_handle {
  int descriptor = -1;
  explicit file_handle(int opened) : descriptor(opened) {}
  file_handle(const file_handle&) = delete;
  file_handle& operator=(const file_handle&) = delete;
  ~file_handle() {
    if (descriptor >= 0) ::close(descriptor);
  }
};

safetensors_reader::safetensors_reader(safetensors_reader&&) noexcept = default;
safetensors_reader& safetensors_reader::operator=(safetensors_reader&&) noexcept = default;
safetensors_reader::~safetensors_reader() = default;

safetensors_reader::safetensors_reader(const std::filesystem::path& path) {
  label_ = path.string();
  std::error_code status_error;
  const auto status = std::filesystem::status(path, status_error);
  if (status_error || !std::filesystem::exists(status)) {
    throw input_error(fmt::format("{}: no such file", label_));
  }
  if (std::filesystem::is_directory(status)) {
    throw input_error(fmt::format("{}: is a directory, not a safetensors file", label_));
  }
  if (!std::filesystem::is_regular_file(status)) {
    throw input_error(fmt::format("{}: is not a regular file", label_));
  }
  const int descriptor = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (descriptor < 0) {
    throw input_error(fmt::format("{}: cannot open for reading: {}", label_, std::generic_category().message(errno)));
  }
  file_ = std::make_unique<file_handle>(descriptor);
  struct stat file_status {};
  if (::fstat(descriptor, &file_status) != 0 || file_status.st_size < 0) {
    throw input_error(fmt::format("{}: cannot determine the file size", label_));
  }
  file_size_ = static_cast<std::uint64_t>(file_status.st_size);

  if (file_size_ < 8) {
    fail_file(label_, "header length", fmt::format("the file has {} bytes, fewer than the 8-byte header length", file_size_));
  }
  std::uint8_t length_bytes[8];
  read_at(0, 8, length_bytes);
  const auto header_length = load<std::uint64_t>(length_bytes);
  if (header_length > max_header_bytes) {
    fail_file(label_, "header length", fmt::format("{} bytes exceeds the limit of {} bytes", header_length, max_header_bytes));
  }
  if (header_length > file_size_ - 8) {
    fail_file(label_, "header length",
              fmt::format("{} bytes runs past the end of the file ({} bytes after the length field)", header_length,
                          file_size_ - 8));
  }
  std::string header(static_cast<std::size_t>(header_length), '\0');
  read_at(8, header_length, reinterpret_cast<std::uint8_t*>(header.data()));
  data_start_ = 8 + header_length;
  data_size_ = file_size_ - data_start_;
  parse_header(header);
}

safetensors_reader safetensors_reader::from_bytes(std::string label, std::string bytes) {
  safetensors_reader reader;
  reader.label_ = std::move(label);
  reader.memory_ = std::move(bytes);
  reader.file_size_ = reader.memory_.size();
  const std::string& label_text = reader.label_;
  if (reader.file_size_ < 8) {
    fail_file(label_text, "header length",
              fmt::format("the file has {} bytes, fewer than the 8-byte header length", reader.file_size_));
  }
  const auto header_length = load<std::uint64_t>(reinterpret_cast<const std::uint8_t*>(reader.memory_.data()));
  if (header_length > max_header_bytes) {
    fail_file(label_text, "header length",
              fmt::format("{} bytes exceeds the limit of {} bytes", header_length, max_header_bytes));
  }
  if (header_length > reader.file_size_ - 8) {
    fail_file(label_text, "header length",
              fmt::format("{} bytes runs past the end of the file ({} bytes after the length field)", header_length,
                          reader.file_size_ - 8));
  }
  reader.data_start_ = 8 + header_length;
  reader.data_size_ = reader.file_size_ - reader.data_start_;
  reader.parse_header(reader.memory_.substr(8, static_cast<std::size_t>(header_length)));
  return reader;
}

void safetensors_reader::parse_header(const std::string& header_text) {
  // The format: the header begins with '{' and may be padded after its JSON with spaces (some
  // writers use other JSON whitespace). A byte-order mark, leading whitespace or NUL padding is a
  // file some other tool wrote wrongly or damaged; refused rather than guessed at.
  if (header_text.empty() || header_text.front() != '{') {
    fail_file(label_, "header",
              header_text.empty() ? std::string("is empty; it must be a JSON object beginning with '{'")
                                  : fmt::format("must begin with '{{' (no byte-order mark or leading whitespace); "
                                                "its first byte is 0x{:02x}",
                                                static_cast<unsigned>(static_cast<unsigned char>(header_text.front()))));
  }
  // Duplicate keys are rejected (nlohmann would silently keep the last one), and nesting is capped
  // so that no hostile header can exhaust the stack of anything that walks the tree.
  if (const auto issue = find_json_issue(header_text, max_json_depth)) {
    switch (issue->what) {
      case json_issue::kind::depth: fail_file(label_, "header", issue->message);
      case json_issue::kind::duplicate_key:
        fail_file(label_, "header", fmt::format("duplicate key '{}'", printable_name(issue->key)));
      case json_issue::kind::syntax:
        fail_file(label_, "header", fmt::format("not valid JSON: {}", printable_name(issue->message)));
    }
  }
  json root;
  try {
    root = json::parse(header_text);
  } catch (const json::exception& error) {
    fail_file(label_, "header", fmt::format("not valid JSON: {}", printable_name(error.what())));
  }
  if (!root.is_object()) fail_file(label_, "header", fmt::format("must be a JSON object, got {}", json_type_name(root)));
  const std::size_t end = header_text.find_last_not_of(" \t\n\r");
  if (end == std::string::npos || header_text[end] != '}') {
    fail_file(label_, "header",
              fmt::format("must end with '}}' followed only by space padding; byte {} is 0x{:02x}", end,
                          static_cast<unsigned>(static_cast<unsigned char>(header_text[end]))));
  }

  for (const auto& [name, value] : root.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) {
        fail_file(label_, "__metadata__", fmt::format("must be an object, got {}", json_type_name(value)));
      }
      for (const auto& [key, text] : value.items()) {
        if (!text.is_string()) {
          fail_file(label_, "__metadata__",
                    fmt::format("value of '{}' must be a string, got {}", printable_name(key), json_type_name(text)));
        }
        metadata_.emplace(key, text.get<std::string>());
      }
      continue;
    }
    if (name.empty()) fail_tensor(label_, name, "name", "tensor names must not be empty");
    if (!value.is_object()) {
      fail_tensor(label_, name, "entry", fmt::format("must be an object, got {}", json_type_name(value)));
    }
    for (const auto& [key, unused] : value.items()) {
      if (key != "dtype" && key != "shape" && key != "data_offsets") {
        fail_tensor(label_, name, key, "unexpected field (expected exactly dtype, shape, data_offsets)");
      }
    }
    for (const char* required : {"dtype", "shape", "data_offsets"}) {
      if (!value.contains(required)) fail_tensor(label_, name, required, "missing");
    }
    tensor_info tensor;
    tensor.name = name;

    const json& dtype_value = value.at("dtype");
    if (!dtype_value.is_string()) {
      fail_tensor(label_, name, "dtype", fmt::format("must be a string, got {}", json_type_name(dtype_value)));
    }
    const auto parsed_type = parse_dtype(dtype_value.get<std::string>());
    if (!parsed_type) {
      fail_tensor(label_, name, "dtype",
                  fmt::format("unknown dtype '{}' (known: {})", printable_name(dtype_value.get<std::string>()),
                              known_dtype_list()));
    }
    tensor.type = *parsed_type;

    const json& shape_value = value.at("shape");
    if (!shape_value.is_array()) {
      fail_tensor(label_, name, "shape", fmt::format("must be an array, got {}", json_type_name(shape_value)));
    }
    if (shape_value.size() > max_rank) {
      fail_tensor(label_, name, "shape", fmt::format("rank {} exceeds the limit of {}", shape_value.size(), max_rank));
    }
    bool has_zero = false;
    for (const json& dimension : shape_value) {
      const std::uint64_t extent = non_negative_integer(dimension, label_, name, "shape", "dimension");
      tensor.shape.push_back(static_cast<std::int64_t>(extent));
      has_zero = has_zero || extent == 0;
    }
    // A zero extent makes the tensor empty whatever the other extents are; otherwise the product
    // must not overflow, and neither may its size in bytes.
    std::uint64_t count = 1;
    if (has_zero) {
      count = 0;
    } else {
      for (const std::int64_t extent : tensor.shape) {
        if (__builtin_mul_overflow(count, static_cast<std::uint64_t>(extent), &count)) {
          fail_tensor(label_, name, "shape", fmt::format("element count of {} overflows 64 bits", shape_text(tensor.shape)));
        }
      }
    }
    std::uint64_t expected_bytes = 0;
    if (__builtin_mul_overflow(count, static_cast<std::uint64_t>(dtype_size(tensor.type)), &expected_bytes)) {
      fail_tensor(label_, name, "shape",
                  fmt::format("size in bytes of {} x {} overflows 64 bits", shape_text(tensor.shape), dtype_name(tensor.type)));
    }
    tensor.element_count = count;

    const json& offsets_value = value.at("data_offsets");
    if (!offsets_value.is_array() || offsets_value.size() != 2) {
      fail_tensor(label_, name, "data_offsets",
                  fmt::format("must be an array of two integers [begin, end], got {}",
                              offsets_value.is_array() ? fmt::format("{} elements", offsets_value.size())
                                                       : json_type_name(offsets_value)));
    }
    tensor.begin = non_negative_integer(offsets_value[0], label_, name, "data_offsets", "begin");
    tensor.end = non_negative_integer(offsets_value[1], label_, name, "data_offsets", "end");
    if (tensor.begin > tensor.end) {
      fail_tensor(label_, name, "data_offsets", fmt::format("begin {} is after end {}", tensor.begin, tensor.end));
    }
    if (tensor.end > data_size_) {
      fail_tensor(label_, name, "data_offsets",
                  fmt::format("end {} beyond data section of {} bytes", tensor.end, data_size_));
    }
    if (tensor.end - tensor.begin != expected_bytes) {
      fail_tensor(label_, name, "data_offsets",
                  fmt::format("covers {} bytes but shape {} of {} needs {} bytes", tensor.end - tensor.begin,
                              shape_text(tensor.shape), dtype_name(tensor.type), expected_bytes));
    }
    tensors_.push_back(std::move(tensor));
  }

  // Overlap check in offset order; empty tensors occupy no bytes and cannot overlap anything.
  std::vector<const tensor_info*> by_offset;
  for (const auto& tensor : tensors_) {
    if (tensor.byte_size() > 0) by_offset.push_back(&tensor);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](const tensor_info* a, const tensor_info* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->name < b->name;
  });
  for (std::size_t i = 1; i < by_offset.size(); ++i) {
    const tensor_info& previous = *by_offset[i - 1];
    const tensor_info& current = *by_offset[i];
    if (current.begin < previous.end) {
      fail_tensor(label_, current.name, "data_offsets",
                  fmt::format("[{}, {}] overlaps tensor '{}' at [{}, {}]", current.begin, current.end,
                              printable_name(previous.name), previous.begin, previous.end));
    }
  }
  // root.items() walks the object in key order, so tensors_ is already sorted by name.
}

void safetensors_reader::read_at(std::uint64_t file_offset, std::uint64_t size, std::uint8_t* destination) const {
  std::uint64_t stop = 0;
  if (__builtin_add_overflow(file_offset, size, &stop) || stop > file_size_) {
    throw input_error(fmt::format("{}: read of {} bytes at offset {} runs past the end of the file ({} bytes)", label_,
                                  size, file_offset, file_size_));
  }
  if (size == 0) return;
  if (!file_) {
    std::memcpy(destination, memory_.data() + file_offset, static_cast<std::size_t>(size));
    return;
  }
  std::uint64_t done = 0;
  while (done < size) {
    const std::uint64_t chunk = std::min<std::uint64_t>(size - done, std::uint64_t{1} << 30);
    const ssize_t got = ::pread(file_->descriptor, destination + done, static_cast<std::size_t>(chunk),
                                static_cast<off_t>(file_offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      throw input_error(fmt::format("{}: read of {} bytes at offset {} failed: {}", label_, size, file_offset,
                                    std::generic_category().message(errno)));
    }
    if (got == 0) {
      throw input_error(fmt::format("{}: short read: {} of {} bytes at offset {} (was the file truncated?)", label_,
                                    done, size, file_offset));
    }
    done += static_cast<std::uint64_t>(got);
  }
}

void safetensors_reader::start_reading(std::initializer_list<std::string_view> names) const {
  if (!file_) return;
  for (const std::string_view name : names) {
    if (const tensor_info* tensor = find(name)) {
      (void)::posix_fadvise(file_->descriptor, static_cast<off_t>(data_start_ + tensor->begin),
                            static_cast<off_t>(tensor->byte_size()), POSIX_FADV_WILLNEED);
    }
  }
}

const tensor_info* safetensors_reader::find(std::string_view name) const {
  const auto found = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                                      [](const tensor_info& tensor, std::string_view key) { return tensor.name < key; });
  if (found == tensors_.end() || found->name != name) return nullptr;
  return &*found;
}

const tensor_info& safetensors_reader::at(std::string_view name) const {
  if (const tensor_info* tensor = find(name)) return *tensor;
  constexpr std::size_t max_listed = 50;
  std::string available;
  for (std::size_t i = 0; i < tensors_.size() && i < max_listed; ++i) {
    if (!available.empty()) available += ", ";
    available += printable_name(tensors_[i].name);
  }
  if (tensors_.size() > max_listed) available += fmt::format(", ... ({} in all)", tensors_.size());
  if (available.empty()) available = "none: the file holds no tensors";
  throw input_error(fmt::format("{}: no tensor named '{}' (available: {})", label_, printable_name(name), available));
}

std::vector<std::string> safetensors_reader::names() const {
  std::vector<std::string> result;
  result.reserve(tensors_.size());
  for (const auto& tensor : tensors_) result.push_back(tensor.name);
  return result;
}

void safetensors_reader::read_tensor_bytes(const tensor_info& tensor, std::uint64_t offset, std::uint64_t size,
                                           std::uint8_t* destination) const {
  std::uint64_t stop = 0;
  if (tensor.begin > tensor.end || __builtin_add_overflow(offset, size, &stop) || stop > tensor.byte_size()) {
    throw input_error(fmt::format("{}: tensor '{}': read of {} bytes at offset {} is outside its {} bytes", label_,
                                  printable_name(tensor.name), size, offset, tensor.byte_size()));
  }
  read_at(data_start_ + tensor.begin + offset, size, destination);
}

std::vector<std::uint8_t> safetensors_reader::read_tensor(std::string_view name) const {
  const tensor_info& tensor = at(name);
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(tensor.byte_size()));
  read_tensor_bytes(tensor, 0, tensor.byte_size(), bytes.data());
  return bytes;
}

void safetensors_reader::for_each_chunk(
    const tensor_info& tensor, std::uint64_t chunk_bytes,
    const std::function<void(const std::uint8_t* bytes, std::uint64_t element_count)>& visit) const {
  const auto element_size = static_cast<std::uint64_t>(dtype_size(tensor.type));
  const std::uint64_t per_chunk = std::max<std::uint64_t>(1, chunk_bytes / element_size);
  const std::uint64_t total = tensor.byte_size() / element_size;
  std::vector<std::uint8_t> buffer(static_cast<std::size_t>(std::min(per_chunk, total) * element_size));
  for (std::uint64_t first = 0; first < total; first += per_chunk) {
    const std::uint64_t count = std::min(per_chunk, total - first);
    read_tensor_bytes(tensor, first * element_size, count * element_size, buffer.data());
    visit(buffer.data(), count);
  }
}

std::pair<std::int64_t, std::int64_t> matrix_shape(const tensor_info& tensor, const std::string& file_label) {
  std::pair<std::int64_t, std::int64_t> shape{1, 1};
  switch (tensor.shape.size()) {
    case 0: break;
    case 1: shape = {1, tensor.shape[0]}; break;
    case 2: shape = {tensor.shape[0], tensor.shape[1]}; break;
    default:
      fail_tensor(file_label, tensor.name, "shape",
                  fmt::format("rank {} {}: a 2-D matrix (or a 1-D vector, read as one row) is needed",
                              tensor.shape.size(), shape_text(tensor.shape)));
  }
  // Real operands are far below this; the cap keeps degenerate empty shapes such as [0, 2^60]
  // from driving loops over an absurd extent.
  constexpr std::int64_t max_extent = std::numeric_limits<std::int32_t>::max();
  if (shape.first > max_extent || shape.second > max_extent) {
    fail_tensor(file_label, tensor.name, "shape",
                fmt::format("extent of {} exceeds the limit of {} per matrix dimension", shape_text(tensor.shape),
                            max_extent));
  }
  return shape;
}

// A BOOL element is one byte holding 0 or 1 (what NumPy and PyTorch write); anything else is a
// damaged file, not a truth value to widen.
void check_boolean_bytes(const std::uint8_t* bytes, std::uint64_t count, const std::string& what) {
  for (std::uint64_t i = 0; i < count; ++i) {
    if (bytes[i] > 1) {
      throw input_error(fmt::format("{}: field 'data': a BOOL element holds byte {}; BOOL elements are 0 or 1", what,
                                    static_cast<unsigned>(bytes[i])));
    }
  }
}

void convert_to_float(dtype type, const std::uint8_t* bytes, std::uint64_t element_count, float* destination,
                      const std::string& what) {
  using core::element_kind;
  switch (type) {
    case dtype::f32: std::memcpy(destination, bytes, static_cast<std::size_t>(element_count) * 4); return;
    case dtype::f64:
      // The one rounding conversion: fp64 -> fp32 rounds to nearest, ties to even (the default
      // floating-point environment), overflowing to +-inf.
      for (std::uint64_t i = 0; i < element_count; ++i) destination[i] = static_cast<float>(load<double>(bytes + 8 * i));
      return;
    case dtype::f16: {
      const auto count = static_cast<std::int64_t>(element_count);
#pragma omp parallel for schedule(static) if (count >= (std::int64_t{1} << 20))
      for (std::int64_t i = 0; i < count; ++i) destination[i] = core::half_to_float(load<std::uint16_t>(bytes + 2 * i));
      return;
    }
    case dtype::bf16: {
      // Exact widening, element by element: split over the threads for the large captures.
      const auto count = static_cast<std::int64_t>(element_count);
#pragma omp parallel for schedule(static) if (count >= (std::int64_t{1} << 20))
      for (std::int64_t i = 0; i < count; ++i) destination[i] = core::bf16_to_float(load<std::uint16_t>(bytes + 2 * i));
      return;
    }
    case dtype::f8_e4m3:
      for (std::uint64_t i = 0; i < element_count; ++i) {
        destination[i] = static_cast<float>(core::decode(element_kind::fp8_e4m3, bytes[i]));
      }
      return;
    case dtype::f8_e5m2:
      for (std::uint64_t i = 0; i < element_count; ++i) {
        destination[i] = static_cast<float>(core::decode(element_kind::fp8_e5m2, bytes[i]));
      }
      return;
    case dtype::boolean:
      check_boolean_bytes(bytes, element_count, what);
      [[fallthrough]];
    case dtype::u8:
      for (std::uint64_t i = 0; i < element_count; ++i) destination[i] = static_cast<float>(bytes[i]);
      return;
    case dtype::i8:
      for (std::uint64_t i = 0; i < element_count; ++i) destination[i] = static_cast<float>(static_cast<std::int8_t>(bytes[i]));
      return;
    case dtype::i16:
      for (std::uint64_t i = 0; i < element_count; ++i) destination[i] = static_cast<float>(load<std::int16_t>(bytes + 2 * i));
      return;
    case dtype::u16:
      for (std::uint64_t i = 0; i < element_count; ++i) destination[i] = static_cast<float>(load<std::uint16_t>(bytes + 2 * i));
      return;
    case dtype::i32:
    case dtype::i64:
    case dtype::u32:
    case dtype::u64: break;
  }
  throw input_error(fmt::format("{}: field 'dtype': {} has no exact conversion to fp32 (supported: F32 F16 BF16 "
                                "F8_E4M3 F8_E5M2 U8 I8 U16 I16 BOOL, and F64 rounded to nearest)",
                                what, dtype_name(type)));
}

namespace {

// Room for `count` values in `values`. A large fresh destination is backed by transparent huge
// pages where the kernel offers them on request (madvise; nothing changes where it does not): the
// zero-fill of resize() then faults the memory in 2 MiB pages instead of 4 KiB ones, which was
// most of the time of reading a large capture into fresh memory (BENCHMARKS.md, "Replay (CPU)").
void reserve_for_read(std::vector<float>& values, std::size_t count) {
  if (values.capacity() >= count) return;
  values.reserve(count);
  const std::size_t bytes = count * sizeof(float);
  constexpr std::uintptr_t huge_page = std::uintptr_t{2} << 20;
  if (bytes < 16 * huge_page) return;
#ifdef MADV_HUGEPAGE
  const auto begin = reinterpret_cast<std::uintptr_t>(values.data());
  const std::uintptr_t first = (begin + huge_page - 1) & ~(huge_page - 1);
  const std::uintptr_t last = (begin + bytes) & ~(huge_page - 1);
  if (last > first) (void)::madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#endif
}


// `count` BF16 or F32 elements from `bytes` into `destination` as fp32, counting NaN and Inf from
// the stored bits; one thread.
void convert_counting(dtype type, const std::uint8_t* bytes, std::uint64_t count, float* destination,
                      nonfinite_count& counts) {
  std::uint64_t nan = 0, inf = 0;
  if (type == dtype::bf16) {
    for (std::uint64_t i = 0; i < count; ++i) {
      const std::uint16_t bits = load<std::uint16_t>(bytes + 2 * i);
      destination[i] = core::bf16_to_float(bits);
      const unsigned magnitude = bits & 0x7FFFU;
      nan += magnitude > 0x7F80U;
      inf += magnitude == 0x7F80U;
    }
  } else {
    std::memcpy(destination, bytes, static_cast<std::size_t>(count) * 4);
    for (std::uint64_t i = 0; i < count; ++i) {
      const std::uint32_t magnitude = load<std::uint32_t>(bytes + 4 * i) & 0x7FFFFFFFU;
      nan += magnitude > 0x7F800000U;
      inf += magnitude == 0x7F800000U;
    }
  }
  counts.nan += nan;
  counts.inf += inf;
}

int piece_threads(const safetensors_reader::pieces& split, std::uint64_t piece_count) {
  int threads = split.threads;
  if (threads <= 0) threads = std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 2, 8);
  return static_cast<int>(std::min<std::uint64_t>(piece_count, static_cast<std::uint64_t>(threads)));
}

}  // namespace

matrix safetensors_reader::read_matrix(std::string_view name, nonfinite_count& count) const {
  return read_matrix(name, count, matrix{});
}

// The pieces are taken in file order from a shared counter, so the requests in flight stay close
// together on the disk. A failed read stops the others from taking more pieces; the error of the
// lowest failed piece is rethrown (the same message a one-thread read would give first).
void safetensors_reader::read_pieces(const tensor_info& tensor, const pieces& split, float* destination,
                                     nonfinite_count& count) const {
  const auto element_size = static_cast<std::uint64_t>(dtype_size(tensor.type));
  const std::uint64_t total = tensor.byte_size() / element_size;
  const std::uint64_t per_piece = std::max<std::uint64_t>(1, split.piece_bytes / element_size);
  const std::uint64_t piece_count = (total + per_piece - 1) / per_piece;
  const int threads = piece_threads(split, piece_count);
  std::atomic<std::uint64_t> next{0};
  std::atomic<bool> failed{false};
  std::vector<nonfinite_count> counts(static_cast<std::size_t>(threads));
  std::vector<std::pair<std::uint64_t, std::exception_ptr>> errors(static_cast<std::size_t>(threads));
  // Nothing escapes a thread: a failure (the read, or the buffer's allocation) is kept with its piece.
  const auto work = [&](int t) {
    std::uint64_t piece = piece_count;
    try {
      std::vector<std::uint8_t> buffer(static_cast<std::size_t>(std::min(per_piece, total) * element_size));
      for (piece = next++; piece < piece_count && !failed; piece = next++) {
        const std::uint64_t first = piece * per_piece;
        const std::uint64_t n = std::min(per_piece, total - first);
        read_tensor_bytes(tensor, first * element_size, n * element_size, buffer.data());
        convert_counting(tensor.type, buffer.data(), n, destination + first, counts[static_cast<std::size_t>(t)]);
        if (split.listener != nullptr) split.listener->piece(tensor.name, first, n);
      }
    } catch (...) {
      errors[static_cast<std::size_t>(t)] = {piece, std::current_exception()};
      failed = true;
    }
  };
  std::vector<std::thread> helpers;
  helpers.reserve(static_cast<std::size_t>(threads - 1));
  try {
    for (int t = 1; t < threads; ++t) helpers.emplace_back(work, t);
  } catch (const std::system_error&) {
    // No more threads to be had: the ones running (and this one) take the remaining pieces.
  }
  work(0);
  for (auto& helper : helpers) helper.join();
  const std::exception_ptr* first_error = nullptr;
  std::uint64_t first_piece = piece_count;
  for (const auto& [piece, error] : errors) {
    if (error && piece < first_piece) {
      first_piece = piece;
      first_error = &error;
    }
  }
  if (first_error != nullptr) std::rethrow_exception(*first_error);
  for (const auto& part : counts) {
    count.nan += part.nan;
    count.inf += part.inf;
  }
}

matrix safetensors_reader::read_matrix(std::string_view name, nonfinite_count& count, matrix storage) const {
  return read_matrix(name, count, std::move(storage), pieces{});
}

matrix safetensors_reader::read_matrix(std::string_view name, nonfinite_count& count, matrix storage,
                                       const pieces& split) const {
  const tensor_info& tensor = at(name);
  const std::string what = fmt::format("{}: tensor '{}'", label_, printable_name(tensor.name));
  if (!converts_to_matrix(tensor.type)) convert_to_float(tensor.type, nullptr, 0, nullptr, what);
  const auto [rows, cols] = matrix_shape(tensor, label_);
  matrix result = std::move(storage);
  result.rows = rows;
  result.cols = cols;
  reserve_for_read(result.values, static_cast<std::size_t>(rows * cols));
  result.values.resize(static_cast<std::size_t>(rows * cols));  // every element is written below
  count = {};
  if (split.listener != nullptr) split.listener->started(tensor.name, result.data(), rows, cols);
  if ((tensor.type == dtype::bf16 || tensor.type == dtype::f32) && tensor.byte_size() > split.piece_bytes) {
    read_pieces(tensor, split, result.data(), count);
    return result;
  }
  std::uint64_t filled = 0;
  for_each_chunk(tensor, std::uint64_t{4} << 20, [&](const std::uint8_t* bytes, std::uint64_t elements) {
    float* destination = result.data() + filled;
    const auto n = static_cast<std::int64_t>(elements);
    if (tensor.type == dtype::bf16 || tensor.type == dtype::f32) {
      convert_counting(tensor.type, bytes, elements, destination, count);
    } else {
      convert_to_float(tensor.type, bytes, elements, destination, what);
      for (std::int64_t i = 0; i < n; ++i) {
        count.nan += std::isnan(destination[i]);
        count.inf += std::isinf(destination[i]);
      }
    }
    filled += elements;
  });
  if (split.listener != nullptr) split.listener->piece(tensor.name, 0, filled);
  return result;
}

matrix safetensors_reader::read_matrix(std::string_view name) const {
  const tensor_info& tensor = at(name);
  const std::string what = fmt::format("{}: tensor '{}'", label_, printable_name(tensor.name));
  if (!converts_to_matrix(tensor.type)) convert_to_float(tensor.type, nullptr, 0, nullptr, what);
  const auto [rows, cols] = matrix_shape(tensor, label_);
  matrix result(rows, cols);
  std::uint64_t filled = 0;
  for_each_chunk(tensor, std::uint64_t{4} << 20, [&](const std::uint8_t* bytes, std::uint64_t count) {
    convert_to_float(tensor.type, bytes, count, result.data() + filled, what);
    filled += count;
  });
  return result;
}

// ------------------------------------------------------------------------------------------------
// Statistics.

namespace {

double element_value(dtype type, const std::uint8_t* bytes) {
  using core::element_kind;
  switch (type) {
    case dtype::f64: return load<double>(bytes);
    case dtype::f32: return load<float>(bytes);
    case dtype::f16: return core::half_to_float(load<std::uint16_t>(bytes));
    case dtype::bf16: return core::bf16_to_float(load<std::uint16_t>(bytes));
    case dtype::f8_e4m3: return core::decode(element_kind::fp8_e4m3, bytes[0]);
    case dtype::f8_e5m2: return core::decode(element_kind::fp8_e5m2, bytes[0]);
    case dtype::u8:
    case dtype::boolean: return bytes[0];
    case dtype::i8: return static_cast<std::int8_t>(bytes[0]);
    case dtype::i16: return load<std::int16_t>(bytes);
    case dtype::u16: return load<std::uint16_t>(bytes);
    case dtype::i32: return load<std::int32_t>(bytes);
    case dtype::u32: return load<std::uint32_t>(bytes);
    // 64-bit integers beyond 2^53 round to the nearest double: statistics only.
    case dtype::i64: return static_cast<double>(load<std::int64_t>(bytes));
    case dtype::u64: return static_cast<double>(load<std::uint64_t>(bytes));
  }
  return 0.0;
}

}  // namespace

tensor_statistics compute_statistics(const safetensors_reader& reader, const tensor_info& tensor) {
  tensor_statistics stats;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  double minimum = std::numeric_limits<double>::infinity();
  double maximum = -std::numeric_limits<double>::infinity();
  double sum_abs = 0.0;
  const int element_size = dtype_size(tensor.type);
  reader.for_each_chunk(tensor, std::uint64_t{4} << 20, [&](const std::uint8_t* bytes, std::uint64_t count) {
    if (tensor.type == dtype::boolean) {
      check_boolean_bytes(bytes, count, fmt::format("{}: tensor '{}'", reader.label(), printable_name(tensor.name)));
    }
    for (std::uint64_t i = 0; i < count; ++i) {
      const double value = element_value(tensor.type, bytes + i * static_cast<std::uint64_t>(element_size));
      ++stats.elements;
      if (std::isnan(value)) {
        ++stats.nan_count;
      } else if (std::isinf(value)) {
        ++stats.inf_count;
      } else {
        ++stats.finite;
        minimum = std::min(minimum, value);
        maximum = std::max(maximum, value);
        sum_abs += std::fabs(value);
      }
    }
  });
  stats.min = stats.finite > 0 ? minimum : nan;
  stats.max = stats.finite > 0 ? maximum : nan;
  stats.mean_abs = stats.finite > 0 ? sum_abs / static_cast<double>(stats.finite) : nan;
  return stats;
}

// ------------------------------------------------------------------------------------------------
// Writer.

void safetensors_writer::add(std::string name, dtype type, std::vector<std::int64_t> shape,
                             std::vector<std::uint8_t> bytes) {
  const std::string what = fmt::format("safetensors writer: tensor '{}'", printable_name(name));
  if (name.empty()) throw input_error("safetensors writer: tensor names must not be empty");
  if (name == "__metadata__") throw input_error(fmt::format("{}: the name is reserved for metadata", what));
  if (tensors_.count(name) != 0) throw input_error(fmt::format("{}: added twice", what));
  bool has_zero = false;
  for (const std::int64_t extent : shape) {
    if (extent < 0) throw input_error(fmt::format("{}: field 'shape': negative extent in {}", what, shape_text(shape)));
    has_zero = has_zero || extent == 0;
  }
  // The reader's rule: a zero extent makes the tensor empty whatever the other extents are.
  std::uint64_t count = has_zero ? 0 : 1;
  for (std::size_t i = 0; !has_zero && i < shape.size(); ++i) {
    if (__builtin_mul_overflow(count, static_cast<std::uint64_t>(shape[i]), &count)) {
      throw input_error(fmt::format("{}: field 'shape': element count overflows", what));
    }
  }
  std::uint64_t expected = 0;
  if (__builtin_mul_overflow(count, static_cast<std::uint64_t>(dtype_size(type)), &expected) || expected != bytes.size()) {
    throw input_error(fmt::format("{}: {} bytes given, shape {} of {} needs {}", what, bytes.size(), shape_text(shape),
                                  dtype_name(type), expected));
  }
  tensors_.emplace(std::move(name), entry{type, std::move(shape), std::move(bytes)});
}

void safetensors_writer::add_floats(std::string name, std::vector<std::int64_t> shape, const std::vector<float>& values) {
  std::vector<std::uint8_t> bytes(values.size() * sizeof(float));
  if (!values.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  add(std::move(name), dtype::f32, std::move(shape), std::move(bytes));
}

void safetensors_writer::add_matrix(std::string name, const matrix& values) {
  add_floats(std::move(name), {values.rows, values.cols}, values.values);
}

void safetensors_writer::set_metadata(std::string key, std::string value) { metadata_[std::move(key)] = std::move(value); }

std::string safetensors_writer::header_bytes() const {
  json root = json::object();
  if (!metadata_.empty()) {
    json metadata = json::object();
    for (const auto& [key, value] : metadata_) metadata[key] = value;
    root["__metadata__"] = std::move(metadata);
  }
  std::uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors_) {
    const std::uint64_t end = offset + tensor.bytes.size();
    root[name] = {{"dtype", dtype_name(tensor.type)}, {"shape", tensor.shape}, {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string text;
  try {
    text = root.dump();
  } catch (const json::exception& error) {
    throw input_error(fmt::format("safetensors writer: a tensor name or metadata string is not valid UTF-8 ({})",
                                  error.what()));
  }
  // Spaces after the JSON are allowed by the format; they align the data section to 8 bytes.
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string header(8, '\0');
  const std::uint64_t length = text.size();
  std::memcpy(header.data(), &length, 8);
  return header + text;
}

std::string safetensors_writer::serialize() const {
  std::string image = header_bytes();
  for (const auto& [name, tensor] : tensors_) {
    image.append(reinterpret_cast<const char*>(tensor.bytes.data()), tensor.bytes.size());
  }
  return image;
}

void safetensors_writer::write(const std::filesystem::path& path) const {
  const std::string header = header_bytes();
  write_file_atomically(path, [&](atomic_file& file) {
    file.write(header);
    for (const auto& [name, tensor] : tensors_) file.write(tensor.bytes.data(), tensor.bytes.size());
  });
}

}  // namespace mxscope::io
