// Dump directories: the captured GEMM operands of a training run (docs/dump-format.md).
//
// DIR/manifest.json lists entries {step, layer, file}; each file is safetensors holding x [K, n_in],
// dy [K, n_out], optionally w and dw [n_out, n_in], and optionally hardware-quantized operands
// "<t>.codes" + "<t>.scales" whose recipe is in the file's __metadata__.
//
// dump_reader validates the whole dump when it is opened (the manifest, every entry, every entry
// file's header, shapes, dtypes and quantized-operand recipes), so a replay never fails halfway
// through on bad input. Tensor data stays on disk until an entry is read; entries are read one at a
// time in (layer, step) order. Non-finite values are counted per tensor on every read and handed to
// the caller (or rejected, on request), never silently used. Every error is an input_error that
// names the file and the field.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <iosfwd>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "mxscope/io/safetensors.hpp"
#include "mxscope/quantize.hpp"
#include "mxscope/tensor.hpp"

namespace mxscope::io {

inline constexpr const char* dump_format_name = "mxscope-dump";
inline constexpr int dump_format_version = 1;
inline constexpr std::uint64_t max_manifest_bytes = 64ULL << 20;
// Longest layer name a manifest may hold (names are matched by --layers and written to CSV rows).
inline constexpr std::size_t max_layer_name_bytes = 1024;

struct dump_source {
  std::string hardware;
  std::string framework;
  std::string recipe;
  std::string model;
  std::string notes;
  // Any further keys of "source" (provenance such as the training configuration), as JSON text of
  // an object; "{}" when there are none.
  std::string extra_json = "{}";
};

// The recipe of a hardware-quantized operand, parsed from the entry's metadata keys
// "<t>.format", "<t>.block", "<t>.axis", "<t>.scale_rule", "<t>.rounding", "<t>.seed",
// "<t>.rotation", "<t>.signs", "<t>.layer", "<t>.step", "<t>.sr_bits".
struct quantized_operand_recipe {
  std::string tensor;  // "x", "dy" or "w"
  std::string format_name;
  format_choice format;
  int block = 32;
  int axis = 0;
  core::scale_rule rule = core::scale_rule::floor;
  core::rounding_mode rounding = core::rounding_mode::rne;
  std::uint64_t seed = 0;
  int rotation_size = 0;  // 0: none, else the Hadamard block size
  sign_policy signs = sign_policy::none;
  std::string layer;       // the layer name that enters the Philox tag
  std::uint32_t step = 0;  // the true training step (stochastic rounding uses it as is)
  int sr_bits = 32;

  // The role of the operand's random stream (dy 1, x 2, w 3).
  core::random_role role() const;
  // Quantizer options that reproduce the operand (stream set for the role, the layer and the step).
  quantize_options quantize() const;
  // The rotation applied before quantization (size 0 for none).
  rotation_options rotation() const;
  std::string describe() const;
};

// What validation learned about one entry, without reading any tensor data.
struct dump_entry_info {
  std::int64_t step = 0;
  std::string layer;
  std::string relative_file;   // as the manifest lists it
  std::filesystem::path file;  // DIR / relative_file
  std::int64_t tokens = 0;        // K
  std::int64_t in_features = 0;   // n_in
  std::int64_t out_features = 0;  // n_out
  dtype x_type = dtype::f32;
  dtype dy_type = dtype::f32;
  std::optional<dtype> w_type;
  bool has_dw = false;
  std::vector<quantized_operand_recipe> quantized;  // sorted by tensor name
  std::map<std::string, std::string> metadata;
};

// A hardware-quantized operand as stored: codes, scales, the recipe, and the values they decode to.
struct quantized_operand {
  quantized_operand_recipe recipe;
  quantized_tensor tensor;  // codes, scales and dequantized (decoded from codes and scales)
};

// One entry's tensors in fp32 (bf16 / fp16 widen exactly).
struct dump_entry {
  dump_entry_info info;
  matrix x;
  matrix dy;
  std::optional<matrix> w;
  std::optional<matrix> dw;
  std::vector<quantized_operand> quantized;
  // NaN / Inf counts of every floating tensor read (x, dy, and w, dw when present).
  std::map<std::string, nonfinite_count> nonfinite;

  bool all_finite() const;
  // "x: 2 NaN, 0 Inf; dw: 0 NaN, 1 Inf" over the tensors that have any; empty when all are finite.
  std::string nonfinite_summary() const;
};

struct dump_read_options {
  // Throw an input_error (naming the file and tensor) when a tensor holds NaN or Inf, instead of
  // returning the counts in dump_entry::nonfinite.
  bool reject_nonfinite = false;
  bool read_weight = true;
  bool read_weight_gradient = true;
  bool read_quantized = true;
  // Told as x and dy are read (read_listener), for a copy of them that starts before the read ends.
  read_listener* listener = nullptr;
};

class dump_reader {
 public:
  // Opens DIR (a directory holding manifest.json) and validates the whole dump; throws input_error.
  explicit dump_reader(const std::filesystem::path& directory);

  const std::filesystem::path& directory() const { return directory_; }
  const dump_source& source() const { return source_; }
  int version() const { return version_; }
  // Sorted by (layer, step).
  const std::vector<dump_entry_info>& entries() const { return entries_; }
  // Distinct layer names, sorted.
  std::vector<std::string> layers() const;

  // Reads one entry's tensors (only this entry is in memory).
  dump_entry read(const dump_entry_info& entry, const dump_read_options& options = {}) const;
  // The same, reading x and dy into the memory of `recycled`'s (an entry the caller is done with;
  // the values read are the same either way).
  dump_entry read(const dump_entry_info& entry, const dump_read_options& options, dump_entry recycled) const;
  // Reads the entries one at a time in (layer, step) order and hands each to `visit`.
  void for_each(const std::function<void(const dump_entry&)>& visit, const dump_read_options& options = {}) const;

 private:
  std::filesystem::path directory_;
  dump_source source_;
  int version_ = 0;
  std::vector<dump_entry_info> entries_;
};

// The name DESIGN.md uses for the reader.
using DumpReader = dump_reader;

// Whether `directory` looks like a dump (holds a manifest.json); does not validate.
bool is_dump_directory(const std::filesystem::path& directory);

// `mxscope inspect DIR`: validates the dump, then lists the source and, per entry in (layer, step)
// order, the step, layer and each tensor's dtype, shape, value range and NaN / Inf counts, plus the
// quantized operands' recipes. Reads one entry file at a time.
void describe_dump(const std::filesystem::path& directory, std::ostream& out);

}  // namespace mxscope::io
