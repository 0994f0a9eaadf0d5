// SHA-256 against the FIPS 180-4 example vectors (the provenance hashes of replay inputs).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>

#include "mxscope/errors.hpp"
#include "mxscope/io/sha256.hpp"

// Both compressions: the SHA instructions (where this processor has them) and the plain one.
TEST(Sha256, FipsExamples) {
  for (const bool portable : {false, true}) {
    SCOPED_TRACE(portable ? "portable" : (mxscope::io::sha256_accelerated() ? "SHA instructions" : "portable (no SHA instructions here)"));
    EXPECT_EQ(mxscope::io::sha256_hex("", portable), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    EXPECT_EQ(mxscope::io::sha256_hex("abc", portable),
              "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    EXPECT_EQ(mxscope::io::sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq", portable),
              "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    EXPECT_EQ(mxscope::io::sha256_hex(std::string(1000000, 'a'), portable),
              "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  }
}

// Every length from 0 to 300 bytes (each padding case, split and whole blocks): the two
// compressions agree, fed whole and in uneven pieces.
TEST(Sha256, InstructionsAgreeWithThePlainCompression) {
  std::string bytes;
  for (int i = 0; i < 300; ++i) {
    const std::string plain = mxscope::io::sha256_hex(bytes, true);
    EXPECT_EQ(mxscope::io::sha256_hex(bytes), plain) << "length " << bytes.size();
    mxscope::io::sha256 pieces;
    for (std::size_t at = 0; at < bytes.size(); at += 1 + at % 70) {
      pieces.update(bytes.data() + at, std::min<std::size_t>(1 + at % 70, bytes.size() - at));
    }
    EXPECT_EQ(pieces.hex_digest(), plain) << "length " << bytes.size() << " in pieces";
    bytes += static_cast<char>(i * 37 % 256);
  }
}

TEST(Sha256, FilesHashLikeTheirBytes) {
  const auto path = std::filesystem::temp_directory_path() / ("mxscope-sha-" + std::to_string(::getpid()));
  std::string bytes;
  for (int i = 0; i < 3 * (1 << 20) + 17; ++i) bytes += static_cast<char>(i * 131 % 251);
  std::ofstream(path, std::ios::binary) << bytes;
  EXPECT_EQ(mxscope::io::sha256_file(path), mxscope::io::sha256_hex(bytes));
  std::filesystem::remove(path);
  EXPECT_THROW(mxscope::io::sha256_file(path), mxscope::input_error);
}
