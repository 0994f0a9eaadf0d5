#include "mxscope/io/atomic_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <system_error>

#include "mxscope/errors.hpp"

namespace mxscope::io {

namespace {

std::system_error os_error(int code, const std::string& what) {
  return std::system_error(code, std::generic_category(), what);
}

// Makes a completed rename durable: the directory entry lives in the directory's own data.
// Best effort: some file systems refuse fsync on directories, which is not an error of ours.
void sync_directory(const std::filesystem::path& directory) {
  const std::string name = directory.empty() ? std::string(".") : directory.string();
  const int descriptor = ::open(name.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (descriptor < 0) return;
  ::fsync(descriptor);
  ::close(descriptor);
}

}  // namespace

void refuse_output_over_input(const std::filesystem::path& output, const std::filesystem::path& input,
                              std::string_view input_what) {
  std::error_code error;
  if (!std::filesystem::exists(output, error) || !std::filesystem::exists(input, error)) return;
  if (std::filesystem::equivalent(output, input, error) && !error) {
    throw input_error(fmt::format("{}: the output is the input {} ({}); choose another output file", output.string(),
                                  input_what, input.string()));
  }
}

std::filesystem::path temporary_path_for(const std::filesystem::path& path) {
  std::filesystem::path temporary = path;
  temporary += fmt::format(".tmp.{}", static_cast<long long>(::getpid()));
  return temporary;
}

atomic_file::atomic_file(std::filesystem::path path)
    : path_(std::move(path)), temporary_path_(temporary_path_for(path_)) {
  if (path_.empty()) throw input_error("output path is empty");
  std::error_code status_error;
  const auto status = std::filesystem::symlink_status(path_, status_error);
  if (std::filesystem::is_directory(status)) {
    throw input_error(fmt::format("{}: cannot write the output: it is a directory", path_.string()));
  }
  if (std::filesystem::exists(status) && !std::filesystem::is_regular_file(status)) {
    throw input_error(fmt::format("{}: cannot write the output: it exists and is {}; only a regular file is replaced",
                                  path_.string(), std::filesystem::is_symlink(status) ? "a symbolic link"
                                                                                      : "not a regular file"));
  }
  descriptor_ = ::open(temporary_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (descriptor_ < 0) {
    const int code = errno;
    throw input_error(fmt::format("{}: cannot create the output file ({}): {}", path_.string(),
                                  temporary_path_.string(), std::generic_category().message(code)));
  }
}

atomic_file::~atomic_file() {
  if (!committed_) discard();
}

void atomic_file::discard() noexcept {
  if (descriptor_ >= 0) {
    ::close(descriptor_);
    descriptor_ = -1;
  }
  ::unlink(temporary_path_.c_str());
}

void atomic_file::write(const void* bytes, std::size_t size) {
  if (descriptor_ < 0) throw std::logic_error("atomic_file: write after commit");
  const auto* cursor = static_cast<const char*>(bytes);
  while (size > 0) {
    // Bounded chunks: some kernels cap a single write, and a short write is retried anyway.
    const std::size_t chunk = size < (std::size_t{1} << 30) ? size : (std::size_t{1} << 30);
    const ssize_t written = ::write(descriptor_, cursor, chunk);
    if (written < 0) {
      if (errno == EINTR) continue;
      throw os_error(errno, fmt::format("{}: write failed", temporary_path_.string()));
    }
    cursor += written;
    size -= static_cast<std::size_t>(written);
  }
}

void atomic_file::commit() {
  if (committed_) return;
  if (descriptor_ < 0) throw std::logic_error("atomic_file: commit without an open file");
  if (::fsync(descriptor_) != 0) throw os_error(errno, fmt::format("{}: fsync failed", temporary_path_.string()));
  const int descriptor = descriptor_;
  descriptor_ = -1;
  if (::close(descriptor) != 0) throw os_error(errno, fmt::format("{}: close failed", temporary_path_.string()));
  if (::rename(temporary_path_.c_str(), path_.c_str()) != 0) {
    throw os_error(errno, fmt::format("cannot rename {} to {}", temporary_path_.string(), path_.string()));
  }
  committed_ = true;
  sync_directory(path_.parent_path());
}

void write_file_atomically(const std::filesystem::path& path, std::string_view contents) {
  atomic_file file(path);
  file.write(contents);
  file.commit();
}

void write_file_atomically(const std::filesystem::path& path, const std::function<void(atomic_file&)>& producer) {
  atomic_file file(path);
  producer(file);
  file.commit();
}

}  // namespace mxscope::io
