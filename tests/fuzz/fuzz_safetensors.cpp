// libFuzzer target for the safetensors reader: any byte string either parses into tensors that can
// all be read, converted and summarized, or is rejected with input_error. Any other exception, a
// sanitizer report or a broken invariant below is a bug. Accepted files are also rewritten with the
// writer and must parse back to the same tensors and metadata.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "mxscope/errors.hpp"
#include "mxscope/io/safetensors.hpp"

namespace {

void require(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "invariant broken: %s\n", what);
    std::abort();
  }
}

void exercise(const std::string& bytes) {
  using namespace mxscope::io;
  const safetensors_reader reader = safetensors_reader::from_bytes("fuzz.safetensors", bytes);
  safetensors_writer writer;
  for (const tensor_info& tensor : reader.tensors()) {
    require(tensor.begin <= tensor.end && tensor.end <= reader.data_section_size(), "offsets inside the data section");
    require(tensor.byte_size() == tensor.element_count * static_cast<std::uint64_t>(dtype_size(tensor.type)),
            "size matches shape");
    std::vector<std::uint8_t> raw = reader.read_tensor(tensor.name);
    require(raw.size() == tensor.byte_size(), "read_tensor size");
    const tensor_statistics stats = compute_statistics(reader, tensor);
    require(stats.elements == tensor.element_count, "statistics count every element");
    require(stats.finite + stats.nan_count + stats.inf_count == stats.elements, "statistics partition");
    try {
      const mxscope::matrix values = reader.read_matrix(tensor.name);
      require(static_cast<std::uint64_t>(values.size()) == tensor.element_count, "matrix size");
    } catch (const mxscope::input_error&) {
      // rank > 2, integer dtypes without an fp32 conversion, oversized extents: rejected by design
    }
    writer.add(tensor.name, tensor.type, tensor.shape, std::move(raw));
  }
  for (const auto& [key, value] : reader.metadata()) writer.set_metadata(key, value);

  const safetensors_reader again = safetensors_reader::from_bytes("rewritten.safetensors", writer.serialize());
  require(again.tensors().size() == reader.tensors().size(), "round trip keeps every tensor");
  require(again.metadata() == reader.metadata(), "round trip keeps the metadata");
  for (std::size_t i = 0; i < reader.tensors().size(); ++i) {
    const tensor_info& before = reader.tensors()[i];
    const tensor_info& after = again.tensors()[i];
    require(before.name == after.name && before.type == after.type && before.shape == after.shape,
            "round trip keeps names, dtypes and shapes");
    require(reader.read_tensor(before.name) == again.read_tensor(after.name), "round trip keeps the bytes");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    exercise(std::string(reinterpret_cast<const char*>(data), size));
  } catch (const mxscope::input_error&) {
    // The expected outcome for malformed input.
  }
  return 0;
}
