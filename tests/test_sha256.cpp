// SHA-256 against the FIPS 180-4 example vectors (the provenance hashes of replay inputs).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>

#include "mxscope/errors.hpp"
#include "mxscope/io/sha256.hpp"

TEST(Sha256, FipsExamples) {
  EXPECT_EQ(mxscope::io::sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(mxscope::io::sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(mxscope::io::sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(mxscope::io::sha256_hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
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
