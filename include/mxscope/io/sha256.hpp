// SHA-256 (FIPS 180-4) of files, for the provenance of every replay input.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace mxscope::io {

class sha256 {
 public:
  // With `portable`, the plain C++ compression only (the tests compare it with the SHA
  // instructions of x86 processors, which are used where the processor has them).
  explicit sha256(bool portable = false);
  void update(const void* data, std::size_t size);
  std::string hex_digest();  // finishes the hash; call once

 private:
  void compress(const std::uint8_t* blocks, std::size_t count);
  bool accelerated_;
  std::uint32_t state_[8];
  std::uint8_t buffer_[64];
  std::size_t buffered_ = 0;
  std::uint64_t total_bytes_ = 0;
};

std::string sha256_hex(std::string_view bytes, bool portable = false);
// Whether this processor's SHA instructions (x86 SHA extensions) do the hashing.
bool sha256_accelerated();
// Streams the file; throws input_error naming it when it cannot be read.
std::string sha256_file(const std::filesystem::path& path);

}  // namespace mxscope::io
