// SHA-256 (FIPS 180-4) of files, for the provenance of every replay input.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace mxscope::io {

class sha256 {
 public:
  sha256();
  void update(const void* data, std::size_t size);
  std::string hex_digest();  // finishes the hash; call once

 private:
  void compress(const std::uint8_t* block);
  std::uint32_t state_[8];
  std::uint8_t buffer_[64];
  std::size_t buffered_ = 0;
  std::uint64_t total_bytes_ = 0;
};

std::string sha256_hex(std::string_view bytes);
// Streams the file; throws input_error naming it when it cannot be read.
std::string sha256_file(const std::filesystem::path& path);

}  // namespace mxscope::io
