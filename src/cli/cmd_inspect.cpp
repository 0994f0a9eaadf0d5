// mxscope inspect PATH: what a safetensors file holds (tensors, dtypes, shapes, value ranges,
// non-finite counts, metadata), or the entries of a dump directory.
#include <fmt/format.h>

#include <filesystem>
#include <memory>
#include <ostream>

#include "commands.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/io/dump.hpp"
#include "mxscope/io/safetensors.hpp"

namespace mxscope::cli {

namespace {

struct inspect_options {
  std::string path;
};

std::string number_text(double value) { return fmt::format("{:.6g}", value); }

std::string shape_text(const std::vector<std::int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ",")); }

void inspect_safetensors(const std::filesystem::path& path, std::ostream& out) {
  const io::safetensors_reader reader(path);
  std::vector<std::vector<std::string>> rows;
  rows.push_back({"name", "dtype", "shape", "min", "max", "mean_abs", "nan", "inf"});
  for (const auto& tensor : reader.tensors()) {
    const io::tensor_statistics stats = io::compute_statistics(reader, tensor);
    rows.push_back({io::printable_name(tensor.name), std::string(io::dtype_name(tensor.type)), shape_text(tensor.shape),
                    number_text(stats.min), number_text(stats.max), number_text(stats.mean_abs),
                    std::to_string(stats.nan_count), std::to_string(stats.inf_count)});
  }
  std::vector<std::size_t> widths(rows.front().size(), 0);
  for (const auto& row : rows) {
    for (std::size_t column = 0; column < row.size(); ++column) widths[column] = std::max(widths[column], row[column].size());
  }

  out << fmt::format("file {}\n", reader.label());
  out << fmt::format("tensors {}  data_bytes {}\n", reader.tensors().size(), reader.data_section_size());
  for (const auto& row : rows) {
    std::string line;
    for (std::size_t column = 0; column < row.size(); ++column) {
      if (column > 0) line += "  ";
      line += fmt::format("{:<{}}", row[column], column + 1 == row.size() ? 0 : widths[column]);
    }
    out << line << '\n';
  }
  out << fmt::format("metadata {}\n", reader.metadata().size());
  for (const auto& [key, value] : reader.metadata()) {
    out << fmt::format("  {} = {}\n", io::printable_name(key), io::printable_name(value, 1000));
  }
}

int run_inspect(const inspect_options& options, std::ostream& out) {
  const std::filesystem::path path(options.path);
  std::error_code status_error;
  if (std::filesystem::is_directory(path, status_error)) {
    if (io::is_dump_directory(path)) {
      io::describe_dump(path, out);
      return 0;
    }
    throw input_error(fmt::format("{}: is a directory without manifest.json; expected a .safetensors file or a dump "
                                  "directory",
                                  options.path));
  }
  inspect_safetensors(path, out);
  return 0;
}

}  // namespace

void add_inspect_command(CLI::App& app, command_list& commands) {
  auto options = std::make_shared<inspect_options>();
  CLI::App* sub = app.add_subcommand("inspect", "List the tensors of a safetensors file or the entries of a dump "
                                                "directory: dtype, shape, range, non-finite counts, metadata");
  sub->add_option("path", options->path, "A .safetensors file or a dump directory (manifest.json)")->required();
  commands.push_back({sub, [options](std::ostream& out, std::ostream&) { return run_inspect(*options, out); }});
}

}  // namespace mxscope::cli
