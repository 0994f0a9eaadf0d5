// safetensors files: a validating reader and a byte-reproducible writer.
//
// Layout: 8 bytes little-endian header length N, N bytes of JSON header, then the data section.
// The header maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative
// to the data section) plus an optional "__metadata__" object of string values.
//
// The reader trusts nothing in the file: every field is checked before it is used (docs/cli.md,
// "Input validation"), and every failure is an input_error whose message names the file, the tensor
// and the field. Tensor bytes stay on disk until read_tensor / read_matrix asks for them; the read
// functions may be called from several threads at once.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mxscope/tensor.hpp"

namespace mxscope::io {

enum class dtype : std::uint8_t {
  f64,
  f32,
  f16,
  bf16,
  u8,
  i8,
  f8_e4m3,  // OCP e4m3 "fn": no infinity, S.1111.111 is NaN (torch.float8_e4m3fn)
  f8_e5m2,  // IEEE-like (torch.float8_e5m2)
  i16,
  i32,
  i64,
  u16,
  u32,
  u64,
  boolean,
};

// "F32", "BF16", ... as the safetensors format spells them.
std::optional<dtype> parse_dtype(std::string_view name);
std::string_view dtype_name(dtype type);
int dtype_size(dtype type);
bool is_floating(dtype type);
// Whether read_matrix accepts the dtype: every dtype whose values are exact in fp32, plus F64
// (rounded to nearest, ties to even).
bool converts_to_matrix(dtype type);

struct tensor_info {
  std::string name;
  io::dtype type = dtype::f32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;  // byte offsets relative to the data section
  std::uint64_t end = 0;
  std::uint64_t element_count = 0;

  std::uint64_t byte_size() const { return end - begin; }
};

// Limits the reader enforces before trusting a header.
inline constexpr std::uint64_t max_header_bytes = 100'000'000;
inline constexpr int max_json_depth = 64;

// A printable rendering of a name taken from a file: control and non-ASCII bytes are escaped and
// long names are shortened, so an error message can never carry terminal escapes or megabytes.
std::string printable_name(std::string_view name, std::size_t max_shown = 120);

// NaN and Inf values of a tensor.
struct nonfinite_count {
  std::uint64_t nan = 0;
  std::uint64_t inf = 0;
  std::uint64_t total() const { return nan + inf; }
};

// Told of a matrix read's progress (safetensors_reader::pieces::listener) while it runs, so that
// a copy of the values (the GPU's upload) can start before the read ends: `started` once the
// destination has room for the tensor's rows x cols fp32 values at `values`, then `piece` for each
// range [first, first + count) of elements whose values are final there, every element exactly
// once and in no particular order. Called from the reading threads, several at a time: an
// implementation locks what it shares. A read that fails may have told of some pieces before it
// stopped; the caller learns of the failure from the read itself.
class read_listener {
 public:
  virtual ~read_listener() = default;
  virtual void started(std::string_view tensor, const float* values, std::int64_t rows, std::int64_t cols) = 0;
  virtual void piece(std::string_view tensor, std::uint64_t first, std::uint64_t count) = 0;
};

class safetensors_reader {
 public:
  // Opens and validates `path`; the tensor data stays on disk.
  explicit safetensors_reader(const std::filesystem::path& path);
  // Validates an in-memory image of a file; `label` stands for the file name in messages.
  static safetensors_reader from_bytes(std::string label, std::string bytes);

  safetensors_reader(safetensors_reader&&) noexcept;
  safetensors_reader& operator=(safetensors_reader&&) noexcept;
  ~safetensors_reader();

  const std::string& label() const { return label_; }
  // Sorted by name.
  const std::vector<tensor_info>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  std::uint64_t data_section_size() const { return data_size_; }

  const tensor_info* find(std::string_view name) const;
  // Like find, but throws input_error listing the available names when `name` is absent.
  const tensor_info& at(std::string_view name) const;
  std::vector<std::string> names() const;

  // The raw little-endian bytes of one tensor.
  std::vector<std::uint8_t> read_tensor(std::string_view name) const;
  // Reads `size` bytes starting `offset` bytes into the tensor (bounds-checked).
  void read_tensor_bytes(const tensor_info& tensor, std::uint64_t offset, std::uint64_t size,
                         std::uint8_t* destination) const;
  // Streams a tensor in chunks of whole elements (at most about chunk_bytes each).
  void for_each_chunk(const tensor_info& tensor, std::uint64_t chunk_bytes,
                      const std::function<void(const std::uint8_t* bytes, std::uint64_t element_count)>& visit) const;

  // The tensor as a 2-D fp32 matrix: [rows, cols] for rank 2, [1, n] for rank 1, [1, 1] for a
  // scalar; rank > 2 and dtypes without an fp32 conversion are input_errors naming the tensor.
  // Converts chunk by chunk, so no second full-size copy of the tensor is made.
  matrix read_matrix(std::string_view name) const;
  // The same, counting the NaN and Inf values in the same pass (from the stored bits for BF16 and
  // F32, the dtypes of captures; from the converted chunk otherwise).
  matrix read_matrix(std::string_view name, nonfinite_count& count) const;
  // The same into `storage`'s memory where it is large enough (a matrix of an earlier read: a
  // replay reads tensors of one shape step after step, and fresh memory costs page faults).
  // BF16 and F32 tensors of more than one piece are read by several threads at once, each piece
  // one pread of its own followed by its conversion, so that the disk sees several requests at a
  // time and the conversion runs beside the reads (docs/architecture.md, "Reading a capture").
  // `listener`, when given, is told of the read's progress (read_listener).
  struct pieces {
    std::uint64_t piece_bytes = std::uint64_t{8} << 20;
    int threads = 0;  // 0: min(8, hardware threads), at least 2
    read_listener* listener = nullptr;
  };
  matrix read_matrix(std::string_view name, nonfinite_count& count, matrix storage) const;
  matrix read_matrix(std::string_view name, nonfinite_count& count, matrix storage, const pieces& split) const;
  // Asks the kernel to start reading the named tensors' bytes into the page cache now (readahead
  // without waiting; a hint, nothing changes where it is not honoured or the reader has no file),
  // so that the disk works while the caller allocates and converts.
  void start_reading(std::initializer_list<std::string_view> names) const;

 private:
  safetensors_reader() = default;
  void parse_header(const std::string& header_text);
  void read_at(std::uint64_t file_offset, std::uint64_t size, std::uint8_t* destination) const;
  void read_pieces(const tensor_info& tensor, const pieces& split, float* destination, nonfinite_count& count) const;

  std::string label_;
  std::uint64_t file_size_ = 0;
  std::uint64_t data_start_ = 0;
  std::uint64_t data_size_ = 0;
  std::vector<tensor_info> tensors_;
  std::map<std::string, std::string> metadata_;
  // Exactly one source: an open file or an in-memory image. Files are read with pread, which keeps
  // no position, so concurrent reads through one reader are safe.
  struct file_handle;
  std::unique_ptr<file_handle> file_;
  std::string memory_;
};

// Converts raw tensor bytes (element_count whole elements of `type`) to fp32 into `destination`.
// Throws input_error (naming `what`) for dtypes without a conversion.
void convert_to_float(dtype type, const std::uint8_t* bytes, std::uint64_t element_count, float* destination,
                      const std::string& what);

// The 2-D shape a tensor is read as (see read_matrix); throws input_error naming the file and tensor.
std::pair<std::int64_t, std::int64_t> matrix_shape(const tensor_info& tensor, const std::string& file_label);

// Summary statistics of one tensor's values (inspect). min, max and mean_abs cover the finite
// values only (NaN when there is none); integers and booleans count as finite.
struct tensor_statistics {
  std::uint64_t elements = 0;
  std::uint64_t finite = 0;
  std::uint64_t nan_count = 0;
  std::uint64_t inf_count = 0;
  double min = 0.0;
  double max = 0.0;
  double mean_abs = 0.0;
};
tensor_statistics compute_statistics(const safetensors_reader& reader, const tensor_info& tensor);

// Builds a file in memory or on disk. Tensors are stored sorted by name and the header is
// padded with spaces to a multiple of 8 bytes, so equal contents give byte-identical files.
class safetensors_writer {
 public:
  // `bytes` must hold exactly product(shape) * dtype_size(type) little-endian bytes.
  void add(std::string name, dtype type, std::vector<std::int64_t> shape, std::vector<std::uint8_t> bytes);
  // An fp32 tensor of shape [rows, cols].
  void add_matrix(std::string name, const matrix& values);
  void add_floats(std::string name, std::vector<std::int64_t> shape, const std::vector<float>& values);
  void set_metadata(std::string key, std::string value);

  // The header (length prefix + JSON + padding).
  std::string header_bytes() const;
  // The complete file image.
  std::string serialize() const;
  // Writes the file through atomic_file.
  void write(const std::filesystem::path& path) const;

 private:
  struct entry {
    dtype type;
    std::vector<std::int64_t> shape;
    std::vector<std::uint8_t> bytes;
  };
  std::map<std::string, entry> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace mxscope::io
