// All-or-nothing output files. Every file mxscope writes goes through atomic_file: the bytes go to
// PATH.tmp.<pid> in the same directory, are flushed to disk (fsync), and only then renamed over
// PATH. A reader therefore sees either the old file or the complete new one, never a partial
// output, and a failure at any point (an exception, a full disk) leaves no new file behind.
#pragma once

#include <cstddef>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

namespace mxscope::io {

class atomic_file {
 public:
  // Creates (truncates) the temporary file. Throws input_error naming `path` when it cannot be
  // created (missing directory, no permission) or when `path` exists and is not a regular file (a
  // directory, device, FIFO, socket or symbolic link is never replaced).
  explicit atomic_file(std::filesystem::path path);
  atomic_file(const atomic_file&) = delete;
  atomic_file& operator=(const atomic_file&) = delete;
  // Removes the temporary file unless commit() succeeded.
  ~atomic_file();

  // Appends bytes; throws std::system_error (naming the path) on a write error.
  void write(const void* bytes, std::size_t size);
  void write(std::string_view bytes) { write(bytes.data(), bytes.size()); }

  // fsync, close, rename over the final path, then fsync the directory so the rename is durable.
  void commit();

  const std::filesystem::path& path() const { return path_; }
  const std::filesystem::path& temporary_path() const { return temporary_path_; }

 private:
  void discard() noexcept;

  std::filesystem::path path_;
  std::filesystem::path temporary_path_;
  int descriptor_ = -1;
  bool committed_ = false;
};

// Throws input_error when `output` names the same file as `input` (also through a link): writing it
// would destroy the input. `input_what` says what the input is ("--in", "RUN/steps.csv").
void refuse_output_over_input(const std::filesystem::path& output, const std::filesystem::path& input,
                              std::string_view input_what);

// The temporary name used for `path`: PATH.tmp.<pid>.
std::filesystem::path temporary_path_for(const std::filesystem::path& path);

// Writes `contents` to `path` atomically.
void write_file_atomically(const std::filesystem::path& path, std::string_view contents);

// Lets `producer` write through the file, then commits; if `producer` throws, nothing is left.
void write_file_atomically(const std::filesystem::path& path, const std::function<void(atomic_file&)>& producer);

}  // namespace mxscope::io
