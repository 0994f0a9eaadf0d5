// libFuzzer target for the dump manifest: any bytes as DIR/manifest.json (next to one valid entry
// file, entry.safetensors, that a manifest may list) either open as a dump whose invariants hold or
// are rejected with input_error. Anything else (another exception, a sanitizer report, a signal) is
// a bug.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_support.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/io/dump.hpp"
#include "mxscope/io/safetensors.hpp"

namespace {

const std::filesystem::path& dump_directory() {
  static const std::filesystem::path directory = [] {
    const auto& path = mxscope::fuzzing::scratch_directory("fuzz_dump_manifest");
    mxscope::io::safetensors_writer writer;
    mxscope::matrix x(4, 8), dy(4, 2);
    for (std::int64_t i = 0; i < x.size(); ++i) x.values[static_cast<std::size_t>(i)] = static_cast<float>(i % 7) - 3.0f;
    for (std::int64_t i = 0; i < dy.size(); ++i) dy.values[static_cast<std::size_t>(i)] = static_cast<float>(i % 3);
    writer.add_matrix("x", x);
    writer.add_matrix("dy", dy);
    writer.write(path / "entry.safetensors");
    return path;
  }();
  return directory;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto& directory = dump_directory();
  mxscope::fuzzing::write_file(directory / "manifest.json", std::string_view(reinterpret_cast<const char*>(data), size));
  try {
    const mxscope::io::dump_reader reader(directory);
    for (std::size_t i = 1; i < reader.entries().size(); ++i) {
      const auto& a = reader.entries()[i - 1];
      const auto& b = reader.entries()[i];
      if (a.layer > b.layer || (a.layer == b.layer && a.step >= b.step)) mxscope::fuzzing::broken("entries sorted");
    }
    for (const auto& entry : reader.entries()) {
      if (entry.layer.empty() || entry.layer.size() > mxscope::io::max_layer_name_bytes) {
        mxscope::fuzzing::broken("layer names checked");
      }
    }
  } catch (const mxscope::input_error&) {
    // The expected outcome for a malformed manifest.
  }
  return 0;
}
