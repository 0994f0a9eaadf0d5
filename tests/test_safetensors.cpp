// safetensors reader/writer and atomic output files. Files are built by hand in the tests (length
// prefix, JSON text, data bytes) and expected values come from the IEEE / OCP encodings typed here,
// so the reader is never checked against the writer alone.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include "support/temporary_directory.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/io/atomic_file.hpp"
#include "mxscope/io/safetensors.hpp"

namespace {

using mxscope::testing::temporary_directory;

namespace fs = std::filesystem;
using mxscope::input_error;
using mxscope::io::dtype;
using mxscope::io::safetensors_reader;
using mxscope::io::safetensors_writer;

// ---------------------------------------------------------------------------------------------
// Helpers that do not use the code under test.

std::string little_endian_u64(std::uint64_t value) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[static_cast<std::size_t>(i)] = static_cast<char>((value >> (8 * i)) & 0xFFU);
  return bytes;
}

std::string make_file(const std::string& header_json, const std::string& data) {
  return little_endian_u64(header_json.size()) + header_json + data;
}

template <typename T>
std::string bytes_of(std::initializer_list<T> values) {
  std::string bytes;
  for (const T value : values) {
    char raw[sizeof(T)];
    std::memcpy(raw, &value, sizeof(T));
    bytes.append(raw, sizeof(T));
  }
  return bytes;
}

std::string hex(const std::string& bytes, std::size_t limit = 64) {
  std::string out;
  for (std::size_t i = 0; i < bytes.size() && i < limit; ++i) out += fmt::format("{:02x}", static_cast<unsigned char>(bytes[i]));
  if (bytes.size() > limit) out += "...";
  return out;
}

std::uint32_t float_bits(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return bits;
}

float float_from_bits(std::uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// A fresh directory per test, removed afterwards.

void write_raw(const fs::path& path, const std::string& bytes) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_raw(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
}

// Runs `action`, expects an input_error whose message contains every fragment.
template <typename Action>
void expect_input_error(Action&& action, std::initializer_list<std::string> fragments, const std::string& input) {
  try {
    action();
  } catch (const input_error& error) {
    const std::string message = error.what();
    for (const auto& fragment : fragments) {
      EXPECT_NE(message.find(fragment), std::string::npos)
          << "message lacks '" << fragment << "'\n  message: " << message << "\n  input: " << input;
    }
    return;
  } catch (const std::exception& error) {
    ADD_FAILURE() << "expected input_error, got another exception: " << error.what() << "\n  input: " << input;
    return;
  }
  ADD_FAILURE() << "expected input_error, nothing was thrown\n  input: " << input;
}

// Parses `header` (+ data) from memory under the label "bad.safetensors" and expects a failure.
void expect_rejected(const std::string& header, const std::string& data, std::initializer_list<std::string> fragments) {
  const std::string image = make_file(header, data);
  expect_input_error([&] { safetensors_reader::from_bytes("bad.safetensors", image); }, fragments,
                     header + " + " + std::to_string(data.size()) + " data bytes");
}

// ---------------------------------------------------------------------------------------------
// Reading hand-built files: every dtype, values from the encodings' definitions.

struct decode_case {
  const char* dtype_name;
  std::string bytes;
  std::vector<std::uint32_t> expected_float_bits;  // fp32 bit patterns; NaN compared as "is NaN"
};

std::vector<decode_case> decode_cases() {
  const std::uint32_t nan = 0x7fc00000U, inf = 0x7f800000U, neg_inf = 0xff800000U;
  return {
      {"F32", bytes_of<std::uint32_t>({0x3fc00000U, 0xc0100000U, inf, nan, 0x00000001U}),
       {0x3fc00000U, 0xc0100000U, inf, nan, 0x00000001U}},
      // F64 rounds to nearest-even: 0.1 -> 0x3dcccccd; 1 + 2^-24 is a tie -> 1.0; 1 + 3*2^-24 is a
      // tie -> 1 + 2^-22 (even mantissa); 1e300 overflows to inf.
      {"F64", bytes_of<double>({0.1, 1.0 + std::ldexp(1.0, -24), 1.0 + 3 * std::ldexp(1.0, -24), 1e300, -2.5}),
       {0x3dcccccdU, 0x3f800000U, 0x3f800002U, inf, 0xc0200000U}},
      // IEEE binary16: 1, -2, smallest subnormal 2^-24, max 65504, inf, NaN, -0.
      {"F16", bytes_of<std::uint16_t>({0x3c00, 0xc000, 0x0001, 0x7bff, 0x7c00, 0x7e00, 0x8000}),
       {0x3f800000U, 0xc0000000U, 0x33800000U, 0x477fe000U, inf, nan, 0x80000000U}},
      // bf16 is the top half of fp32.
      {"BF16", bytes_of<std::uint16_t>({0x3f80, 0xc0a0, 0x0001, 0x7f80, 0xffc0}),
       {0x3f800000U, 0xc0a00000U, 0x00010000U, inf, nan}},
      // OCP e4m3 (bias 7): 0x38 = 1, 0xbc = -1.5, 0x7e = 448, 0x01 = 2^-9, 0x08 = 2^-6, 0x7f = NaN.
      {"F8_E4M3", bytes_of<std::uint8_t>({0x38, 0xbc, 0x7e, 0x01, 0x08, 0x7f}),
       {0x3f800000U, 0xbfc00000U, 0x43e00000U, 0x3b000000U, 0x3c800000U, nan}},
      // OCP e5m2 (bias 15): 0x3c = 1, 0x7b = 57344, 0x7c = inf, 0xfc = -inf, 0x01 = 2^-16, 0x7d = NaN.
      {"F8_E5M2", bytes_of<std::uint8_t>({0x3c, 0x7b, 0x7c, 0xfc, 0x01, 0x7d}),
       {0x3f800000U, 0x47600000U, inf, neg_inf, 0x37800000U, nan}},
      {"U8", bytes_of<std::uint8_t>({0, 1, 255}), {0x00000000U, 0x3f800000U, 0x437f0000U}},
      {"I8", bytes_of<std::int8_t>({-128, 127, -1}), {0xc3000000U, 0x42fe0000U, 0xbf800000U}},
      {"I16", bytes_of<std::int16_t>({-32768, 3}), {0xc7000000U, 0x40400000U}},
      {"U16", bytes_of<std::uint16_t>({65535, 2}), {0x477fff00U, 0x40000000U}},
      {"BOOL", bytes_of<std::uint8_t>({0, 1}), {0x00000000U, 0x3f800000U}},
  };
}

TEST(SafetensorsReader, DecodesEveryConvertibleDtypeFromHandBuiltFiles) {
  temporary_directory directory;
  for (const auto& test : decode_cases()) {
    const std::size_t count = test.expected_float_bits.size();
    // Padding tensor first so the tested one starts at an odd data offset (unaligned loads).
    const std::string header =
        fmt::format(R"({{"pad":{{"dtype":"U8","shape":[1],"data_offsets":[0,1]}},"t":{{"dtype":"{}","shape":[{}],"data_offsets":[1,{}]}}}})",
                    test.dtype_name, count, 1 + test.bytes.size());
    const std::string image = make_file(header, std::string(1, '\x7a') + test.bytes);
    const fs::path path = directory.path() / fmt::format("{}.safetensors", test.dtype_name);
    write_raw(path, image);
    for (int source = 0; source < 2; ++source) {
      const safetensors_reader reader = source == 0 ? safetensors_reader(path) : safetensors_reader::from_bytes("m", image);
      const auto* info = reader.find("t");
      ASSERT_NE(info, nullptr);
      EXPECT_EQ(mxscope::io::dtype_name(info->type), test.dtype_name);
      EXPECT_EQ(reader.read_tensor("t"), std::vector<std::uint8_t>(test.bytes.begin(), test.bytes.end()));
      const mxscope::matrix values = reader.read_matrix("t");
      ASSERT_EQ(values.rows, 1);
      ASSERT_EQ(values.cols, static_cast<std::int64_t>(count));
      // The counting read: the same values, and the NaN and Inf counts of the expected values.
      mxscope::io::nonfinite_count counted;
      const mxscope::matrix same = reader.read_matrix("t", counted);
      std::uint64_t nans = 0, infs = 0;
      for (const std::uint32_t bits : test.expected_float_bits) {
        nans += std::isnan(float_from_bits(bits));
        infs += std::isinf(float_from_bits(bits));
      }
      EXPECT_EQ(counted.nan, nans) << test.dtype_name;
      EXPECT_EQ(counted.inf, infs) << test.dtype_name;
      for (std::size_t i = 0; i < count; ++i) {
        EXPECT_EQ(float_bits(same.values[i]), float_bits(values.values[i])) << test.dtype_name << " element " << i;
      }
      for (std::size_t i = 0; i < count; ++i) {
        const float expected = float_from_bits(test.expected_float_bits[i]);
        const float actual = values.values[i];
        if (std::isnan(expected)) {
          EXPECT_TRUE(std::isnan(actual)) << test.dtype_name << " element " << i << " bytes " << hex(test.bytes)
                                          << ": expected NaN, got " << actual;
        } else {
          EXPECT_EQ(float_bits(actual), test.expected_float_bits[i])
              << test.dtype_name << " element " << i << " bytes " << hex(test.bytes) << ": expected " << expected
              << fmt::format(" (0x{:08x})", test.expected_float_bits[i]) << ", got " << actual
              << fmt::format(" (0x{:08x})", float_bits(actual));
        }
      }
    }
  }
}

// The counting read over several 4 MiB chunks and the threaded loop: BF16 and F32 tensors of 2.5 M
// elements with NaN (either sign, quiet and signalling payloads) and +-Inf at chosen places, one of
// them on the chunk boundary; counts against std::isnan / std::isinf of every value read.
TEST(SafetensorsReader, CountingReadMatchesAnIndependentCountAcrossChunks) {
  constexpr std::size_t n = 2'500'000;
  const std::vector<std::size_t> places = {0, 17, 2'097'151, 2'097'152, n - 1, 1'234'567};
  std::vector<std::uint16_t> bf16(n);
  std::vector<std::uint32_t> f32(n);
  std::uint64_t state = 12345;
  for (std::size_t i = 0; i < n; ++i) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    const auto r = static_cast<std::uint32_t>(state >> 33);
    bf16[i] = static_cast<std::uint16_t>(r & 0xFF7FU);  // exponent field never all ones: finite
    f32[i] = r & 0xFF7FFFFFU;
  }
  const std::uint16_t bf16_special[] = {0x7FC0U, 0xFFC1U, 0x7F81U, 0x7F80U, 0xFF80U, 0x7FFFU};
  const std::uint32_t f32_special[] = {0x7FC00000U, 0xFFC00001U, 0x7F800001U, 0x7F800000U, 0xFF800000U, 0x7FFFFFFFU};
  for (std::size_t k = 0; k < places.size(); ++k) {
    bf16[places[k]] = bf16_special[k];
    f32[places[k]] = f32_special[k];
  }
  safetensors_writer writer;
  std::vector<std::uint8_t> bf16_bytes(n * 2), f32_bytes(n * 4);
  std::memcpy(bf16_bytes.data(), bf16.data(), bf16_bytes.size());
  std::memcpy(f32_bytes.data(), f32.data(), f32_bytes.size());
  writer.add("b", mxscope::io::dtype::bf16, {static_cast<std::int64_t>(n)}, bf16_bytes);
  writer.add("f", mxscope::io::dtype::f32, {static_cast<std::int64_t>(n)}, f32_bytes);
  temporary_directory directory;
  const fs::path path = directory.path() / "big.safetensors";
  writer.write(path);
  const safetensors_reader reader(path);
  // The default split (one piece of bf16, two of f32) and pieces read by several threads: piece
  // sizes that are not a whole number of elements, more threads than pieces, one thread, and reads
  // into the memory of an earlier matrix (larger, and too small).
  using pieces = safetensors_reader::pieces;
  const std::vector<pieces> splits = {pieces{}, {65'538, 3}, {1'000'003, 8}, {4'000'000, 1}, {333'333, 0}};
  mxscope::matrix recycled;
  for (const pieces& split : splits) {
    for (const char* name : {"b", "f"}) {
      const std::string what = fmt::format("{} piece_bytes {} threads {}", name, split.piece_bytes, split.threads);
      mxscope::io::nonfinite_count counted;
      const mxscope::matrix values = reader.read_matrix(name, counted, std::move(recycled), split);
      ASSERT_EQ(values.values.size(), n) << what;
      std::uint64_t nans = 0, infs = 0, differ = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const float v = values.values[i];
        nans += std::isnan(v);
        infs += std::isinf(v);
        // The stored bits, widened independently (bf16: the upper half of an fp32 pattern).
        const std::uint32_t expected = name[0] == 'b' ? std::uint32_t{bf16[i]} << 16 : f32[i];
        differ += float_bits(v) != expected;
      }
      EXPECT_EQ(differ, 0U) << what;
      EXPECT_EQ(nans, 4U) << what;  // the test's own construction
      EXPECT_EQ(infs, 2U) << what;
      EXPECT_EQ(counted.nan, nans) << what;
      EXPECT_EQ(counted.inf, infs) << what;
      recycled = values;
      if (name[0] == 'f') recycled.values.resize(10);  // too small: the read allocates again
    }
  }
}

// A piece read that fails (the file cut after the reader opened it) is an input_error naming the
// file, whichever thread met it, and the other threads stop.
TEST(SafetensorsReader, PieceReadOfAShrunkFileGivesAClearError) {
  constexpr std::size_t n = 200'000;
  std::vector<std::uint8_t> bytes(n * 2, 0x3F);
  safetensors_writer writer;
  writer.add("b", mxscope::io::dtype::bf16, {static_cast<std::int64_t>(n)}, bytes);
  temporary_directory directory;
  const fs::path path = directory.path() / "shrinking.safetensors";
  writer.write(path);
  const safetensors_reader reader(path);
  fs::resize_file(path, fs::file_size(path) - 100'000);
  for (const int threads : {1, 4}) {
    mxscope::io::nonfinite_count counted;
    expect_input_error([&] { (void)reader.read_matrix("b", counted, mxscope::matrix{}, {16'384, threads}); },
                       {path.string(), "short read"}, "file cut after opening");
  }
}

// What a read_listener is told: `started` with the destination the read returns, before any
// piece; then pieces covering every element exactly once, each with its final values in place when
// told (checked against the stored bits inside the callback, while other pieces are still being
// read); for the threaded reads of many pieces and for the one-chunk read of a small tensor.
class recording_listener final : public mxscope::io::read_listener {
 public:
  explicit recording_listener(const std::vector<std::uint16_t>& stored) : stored_(stored) {}
  void started(std::string_view tensor, const float* values, std::int64_t rows, std::int64_t cols) override {
    const std::lock_guard<std::mutex> lock(mutex_);
    tensor_ = std::string(tensor);
    values_ = values;
    ++started_;
    told_.assign(static_cast<std::size_t>(rows * cols), 0);
  }
  void piece(std::string_view tensor, std::uint64_t first, std::uint64_t count) override {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (tensor != tensor_ || values_ == nullptr || first + count > told_.size()) {
      ++misplaced_;
      return;
    }
    ++pieces_;
    for (std::uint64_t i = first; i < first + count; ++i) {
      ++told_[i];
      wrong_ += float_bits(values_[i]) != std::uint32_t{stored_[i]} << 16;
    }
  }
  const std::vector<std::uint16_t>& stored_;
  std::mutex mutex_;
  std::string tensor_;
  const float* values_ = nullptr;
  int started_ = 0;
  int pieces_ = 0;
  int misplaced_ = 0;
  std::uint64_t wrong_ = 0;
  std::vector<int> told_;
};

TEST(SafetensorsReader, ListenerIsToldOfEveryPieceOnceWithItsFinalValues) {
  constexpr std::size_t n = 300'006;
  std::vector<std::uint16_t> stored(n);
  for (std::size_t i = 0; i < n; ++i) stored[i] = static_cast<std::uint16_t>((i * 2654435761U) >> 8) & 0x7F7FU;
  std::vector<std::uint8_t> bytes(n * 2);
  std::memcpy(bytes.data(), stored.data(), bytes.size());
  safetensors_writer writer;
  writer.add("b", dtype::bf16, {static_cast<std::int64_t>(n / 7), 7}, bytes);
  temporary_directory directory;
  const fs::path path = directory.path() / "told.safetensors";
  writer.write(path);
  const safetensors_reader reader(path);
  // Many pieces on several threads (pieces not a whole number of elements), one thread, one piece.
  for (const auto& [piece_bytes, threads, expected_pieces] :
       {std::tuple{4'097, 4, 147}, std::tuple{65'536, 1, 10}, std::tuple{8 << 20, 0, 1}}) {
    const std::string what = fmt::format("piece_bytes {} threads {}", piece_bytes, threads);
    recording_listener listener(stored);
    mxscope::io::nonfinite_count counted;
    const mxscope::matrix values = reader.read_matrix(
        "b", counted, mxscope::matrix{}, {static_cast<std::uint64_t>(piece_bytes), threads, &listener});
    EXPECT_EQ(listener.started_, 1) << what;
    EXPECT_EQ(listener.tensor_, "b") << what;
    EXPECT_EQ(listener.values_, values.data()) << what;
    EXPECT_EQ(listener.misplaced_, 0) << what;
    EXPECT_EQ(listener.pieces_, expected_pieces) << what;
    EXPECT_EQ(listener.wrong_, 0U) << what;
    EXPECT_EQ(std::count(listener.told_.begin(), listener.told_.end(), 1), static_cast<std::ptrdiff_t>(n)) << what;
  }
}

// A BOOL byte other than 0 or 1 is refused wherever the values are read, naming the tensor.
TEST(SafetensorsReader, BoolBytesOtherThanZeroOrOneAreRefused) {
  const std::string image =
      make_file(R"({"flags":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})", std::string("\x01\x07\x00", 3));
  const safetensors_reader reader = safetensors_reader::from_bytes("b.safetensors", image);
  expect_input_error([&] { (void)reader.read_matrix("flags"); },
                     {"b.safetensors", "tensor 'flags'", "field 'data'", "BOOL", "byte 7"}, "BOOL 1 7 0");
  expect_input_error([&] { (void)mxscope::io::compute_statistics(reader, reader.at("flags")); },
                     {"b.safetensors", "tensor 'flags'", "field 'data'", "byte 7"}, "BOOL 1 7 0 (statistics)");
}

TEST(SafetensorsReader, WideIntegersAreListedButNotConvertedToFloat) {
  for (const char* name : {"I32", "I64", "U32", "U64"}) {
    const int size = std::string(name).find("64") != std::string::npos ? 8 : 4;
    const std::string header =
        fmt::format(R"({{"ids":{{"dtype":"{}","shape":[2],"data_offsets":[0,{}]}}}})", name, 2 * size);
    const auto reader = safetensors_reader::from_bytes("ints.safetensors", make_file(header, std::string(2 * size, '\1')));
    EXPECT_EQ(reader.read_tensor("ids").size(), static_cast<std::size_t>(2 * size)) << name;
    expect_input_error([&] { (void)reader.read_matrix("ids"); }, {"ints.safetensors", "tensor 'ids'", "field 'dtype'", name},
                       header);
  }
}

TEST(SafetensorsReader, MatrixShapes) {
  const std::string data = bytes_of<float>({1, 2, 3, 4, 5, 6});
  const std::string header =
      R"({"m":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"s":{"dtype":"F32","shape":[],"data_offsets":[0,4]},)"
      R"("c":{"dtype":"F32","shape":[1,0,3],"data_offsets":[0,0]}})";
  // "c" is rank 3 but empty, so it does not overlap anything; "s" overlaps "m" (offsets 0..4).
  expect_rejected(header, data, {"bad.safetensors", "field 'data_offsets'", "overlaps"});

  const std::string good_header =
      R"({"m":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"s":{"dtype":"F32","shape":[],"data_offsets":[24,28]},)"
      R"("c":{"dtype":"F32","shape":[1,2,1],"data_offsets":[28,36]},"e":{"dtype":"F32","shape":[0,5],"data_offsets":[36,36]}})";
  const auto reader =
      safetensors_reader::from_bytes("shapes.safetensors", make_file(good_header, data + bytes_of<float>({7, 8, 9})));
  const auto m = reader.read_matrix("m");
  EXPECT_EQ(m.rows, 2);
  EXPECT_EQ(m.cols, 3);
  EXPECT_EQ(m(1, 0), 4.0f);
  const auto s = reader.read_matrix("s");
  EXPECT_EQ(s.rows, 1);
  EXPECT_EQ(s.cols, 1);
  EXPECT_EQ(s(0, 0), 7.0f);
  const auto e = reader.read_matrix("e");
  EXPECT_EQ(e.rows, 0);
  EXPECT_EQ(e.cols, 5);
  expect_input_error([&] { (void)reader.read_matrix("c"); },
                     {"shapes.safetensors", "tensor 'c'", "field 'shape'", "rank 3"}, good_header);
  expect_input_error([&] { (void)reader.read_matrix("nope"); }, {"shapes.safetensors", "'nope'", "available: c, e, m, s"},
                     good_header);
}

TEST(SafetensorsReader, MetadataAndUnaccountedTrailingBytes) {
  const std::string header =
      R"({"__metadata__":{"format":"pt","note":"a\u00e9"},"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})";
  // 6 data bytes of which only 2 belong to a tensor: allowed.
  const auto reader = safetensors_reader::from_bytes("meta.safetensors", make_file(header, "abcdef"));
  ASSERT_EQ(reader.metadata().size(), 2U);
  EXPECT_EQ(reader.metadata().at("format"), "pt");
  EXPECT_EQ(reader.metadata().at("note"), "a\xc3\xa9");
  EXPECT_EQ(reader.data_section_size(), 6U);
  EXPECT_EQ(reader.read_tensor("w"), (std::vector<std::uint8_t>{'a', 'b'}));
}

TEST(SafetensorsReader, ChunkedReadsConcatenateToTheTensor) {
  std::vector<float> values(1000);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i) * 0.5f - 7.0f;
  std::string data(values.size() * 4, '\0');
  std::memcpy(data.data(), values.data(), data.size());
  const std::string header = R"({"v":{"dtype":"F32","shape":[1000],"data_offsets":[0,4000]}})";
  temporary_directory directory;
  write_raw(directory.path() / "v.safetensors", make_file(header, data));
  const safetensors_reader reader(directory.path() / "v.safetensors");
  for (const std::uint64_t chunk_bytes : {1ULL, 4ULL, 12ULL, 4000ULL, 1ULL << 20}) {
    std::vector<float> collected;
    std::size_t calls = 0;
    reader.for_each_chunk(*reader.find("v"), chunk_bytes, [&](const std::uint8_t* bytes, std::uint64_t count) {
      const std::size_t before = collected.size();
      collected.resize(before + count);
      std::memcpy(collected.data() + before, bytes, count * 4);
      ++calls;
    });
    EXPECT_EQ(collected, values) << "chunk_bytes " << chunk_bytes;
    const std::uint64_t per_chunk = std::max<std::uint64_t>(1, chunk_bytes / 4);
    EXPECT_EQ(calls, (1000 + per_chunk - 1) / per_chunk) << "chunk_bytes " << chunk_bytes;
  }
}

TEST(SafetensorsReader, FileThatShrinksAfterOpeningGivesAClearError) {
  temporary_directory directory;
  const fs::path path = directory.path() / "shrinking.safetensors";
  const std::string header = R"({"v":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})";
  write_raw(path, make_file(header, std::string(16, '\2')));
  const safetensors_reader reader(path);
  fs::resize_file(path, 8 + header.size() + 6);
  expect_input_error([&] { (void)reader.read_tensor("v"); }, {path.string(), "short read"}, "file cut after opening");
}

TEST(SafetensorsReader, ConcurrentReadsThroughOneReaderAgree) {
  temporary_directory directory;
  std::string header = "{";
  std::string data;
  for (int t = 0; t < 8; ++t) {
    if (t > 0) header += ",";
    header += fmt::format(R"("t{}":{{"dtype":"U8","shape":[4096],"data_offsets":[{},{}]}})", t, data.size(), data.size() + 4096);
    data += std::string(4096, static_cast<char>('a' + t));
  }
  header += "}";
  write_raw(directory.path() / "many.safetensors", make_file(header, data));
  const safetensors_reader reader(directory.path() / "many.safetensors");
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int worker = 0; worker < 4; ++worker) {
    threads.emplace_back([&, worker] {
      for (int round = 0; round < 50; ++round) {
        const int t = (worker + round) % 8;
        const auto bytes = reader.read_tensor(fmt::format("t{}", t));
        if (bytes != std::vector<std::uint8_t>(4096, static_cast<std::uint8_t>('a' + t))) ++wrong;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(wrong.load(), 0);
}

TEST(SafetensorsReader, StatisticsCountNonFiniteAndSkipThemInRanges) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::string data = bytes_of<float>({-3.0f, 2.0f, std::nanf(""), inf, -inf, 0.5f}) +
                           bytes_of<std::uint16_t>({0x7e00, 0x3c00, 0xfc00});  // F16: NaN, 1, -inf
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[6],"data_offsets":[0,24]},"h":{"dtype":"F16","shape":[3],"data_offsets":[24,30]}})";
  const auto reader = safetensors_reader::from_bytes("stats.safetensors", make_file(header, data));
  const auto a = mxscope::io::compute_statistics(reader, *reader.find("a"));
  EXPECT_EQ(a.elements, 6U);
  EXPECT_EQ(a.nan_count, 1U);
  EXPECT_EQ(a.inf_count, 2U);
  EXPECT_EQ(a.min, -3.0);
  EXPECT_EQ(a.max, 2.0);
  EXPECT_EQ(a.mean_abs, (3.0 + 2.0 + 0.5) / 3.0);
  const auto h = mxscope::io::compute_statistics(reader, *reader.find("h"));
  EXPECT_EQ(h.nan_count, 1U);
  EXPECT_EQ(h.inf_count, 1U);
  EXPECT_EQ(h.min, 1.0);
  EXPECT_EQ(h.max, 1.0);
}

// ---------------------------------------------------------------------------------------------
// Corrupt and hostile inputs: each is an input_error naming the file, the tensor and the field.

std::string valid_image() {
  const std::string header =
      R"({"__metadata__":{"k":"v"},"dy":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
      R"("x":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]}})";
  return make_file(header, std::string(22, '\x11'));
}

TEST(SafetensorsCorruption, EveryTruncationIsRejected) {
  const std::string image = valid_image();
  ASSERT_NO_THROW(safetensors_reader::from_bytes("whole.safetensors", image));
  temporary_directory directory;
  for (std::size_t length = 0; length < image.size(); ++length) {
    const std::string prefix = image.substr(0, length);
    expect_input_error([&] { safetensors_reader::from_bytes("cut.safetensors", prefix); }, {"cut.safetensors"},
                       fmt::format("prefix of {} bytes: {}", length, hex(prefix, 200)));
    // The file-backed path must agree.
    const fs::path path = directory.path() / "cut.safetensors";
    write_raw(path, prefix);
    expect_input_error([&] { safetensors_reader reader(path); }, {path.string()}, fmt::format("file prefix of {} bytes", length));
  }
  // The specific messages at the three stages of truncation.
  expect_input_error([&] { safetensors_reader::from_bytes("t.safetensors", image.substr(0, 5)); },
                     {"t.safetensors", "field 'header length'", "5 bytes"}, "5-byte file");
  expect_input_error([&] { safetensors_reader::from_bytes("t.safetensors", image.substr(0, 30)); },
                     {"t.safetensors", "field 'header length'", "past the end"}, "cut inside the header");
  expect_input_error([&] { safetensors_reader::from_bytes("t.safetensors", image.substr(0, image.size() - 1)); },
                     {"t.safetensors", "tensor 'x'", "field 'data_offsets'", "end 22 beyond data section of 21 bytes"},
                     "cut inside the data");
}

TEST(SafetensorsCorruption, HeaderLength) {
  expect_input_error([&] { safetensors_reader::from_bytes("h.safetensors", little_endian_u64(1000) + "{}"); },
                     {"h.safetensors", "field 'header length'", "1000"}, "length 1000, 2 bytes follow");
  expect_input_error([&] { safetensors_reader::from_bytes("h.safetensors", little_endian_u64(~0ULL) + "{}"); },
                     {"h.safetensors", "field 'header length'", "limit"}, "length 2^64-1");
  expect_input_error(
      [&] { safetensors_reader::from_bytes("h.safetensors", little_endian_u64(mxscope::io::max_header_bytes + 1)); },
      {"h.safetensors", "field 'header length'", "limit"}, "length just above the limit");
}

TEST(SafetensorsCorruption, HeaderIsNotAJsonObject) {
  expect_rejected("{not json", "", {"bad.safetensors", "field 'header'", "not valid JSON"});
  expect_rejected("", "", {"bad.safetensors", "field 'header'", "empty"});
  expect_rejected(std::string("{\"a\xff\":1}"), "", {"bad.safetensors", "field 'header'"});
  expect_rejected("[1,2]", "", {"bad.safetensors", "field 'header'", "begin with '{'", "0x5b"});
  expect_rejected("17", "", {"bad.safetensors", "field 'header'", "begin with '{'"});
  // The format's header starts with '{' and is padded with spaces: a byte-order mark, leading
  // whitespace and NUL padding are refused; space padding (and other JSON whitespace) is not.
  expect_rejected("\xef\xbb\xbf{}", "", {"bad.safetensors", "field 'header'", "byte-order mark", "0xef"});
  expect_rejected(" {}", "", {"bad.safetensors", "field 'header'", "0x20"});
  expect_rejected(std::string("{}\0\0\0", 5), "", {"bad.safetensors", "field 'header'", "end with '}'", "0x00"});
  expect_rejected(std::string("{}  \0", 5), "", {"bad.safetensors", "field 'header'", "end with '}'"});
  EXPECT_NO_THROW(safetensors_reader::from_bytes("ok.safetensors", make_file("{}      ", "")));
  EXPECT_NO_THROW(safetensors_reader::from_bytes("ok.safetensors", make_file("{}\n\t\r ", "")));
  expect_rejected(R"({"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]}})",
                  std::string(4, '\0'), {"bad.safetensors", "duplicate key 'a'"});
  std::string deep = R"({"__metadata__":)";
  for (int i = 0; i < 1000; ++i) deep += "[";
  for (int i = 0; i < 1000; ++i) deep += "]";
  deep += "}";
  expect_rejected(deep, "", {"bad.safetensors", "field 'header'", "nesting"});
}

// A 1.2 MB header of 400,000 empty objects is judged in time linear in its length (nlohmann's
// callback parser took minutes on it: it rescans the enclosing array at every closing brace).
TEST(SafetensorsCorruption, LongHeadersParseInLinearTime) {
  std::string header = R"({"__metadata__":{},"a":[)";
  for (int i = 0; i < 400000; ++i) header += i == 0 ? "{}" : ",{}";
  header += "]}";
  const auto started = std::chrono::steady_clock::now();
  expect_rejected(header, "", {"bad.safetensors", "tensor 'a'"});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  EXPECT_LT(seconds, 5.0) << "a 1.2 MB header took " << seconds << " s";
}

TEST(SafetensorsCorruption, Offsets) {
  const std::string data(16, '\0');
  expect_rejected(R"({"dy":{"dtype":"F32","shape":[1024],"data_offsets":[0,4096]}})", data,
                  {"bad.safetensors", "tensor 'dy'", "field 'data_offsets'", "end 4096 beyond data section of 16 bytes"});
  expect_rejected(R"({"dy":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", data,
                  {"tensor 'dy'", "field 'data_offsets'", "begin 8 is after end 4"});
  expect_rejected(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                  data, {"bad.safetensors", "tensor 'b'", "field 'data_offsets'", "overlaps tensor 'a'"});
  expect_rejected(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[2,6]},"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                  data, {"bad.safetensors", "tensor 'a'", "overlaps tensor 'b'"});
  expect_rejected(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
                  data, {"bad.safetensors", "field 'data_offsets'", "overlaps tensor 'a'"});
  expect_rejected(R"({"dy":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", data,
                  {"tensor 'dy'", "field 'data_offsets'", "negative"});
  expect_rejected(R"({"dy":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", data,
                  {"tensor 'dy'", "field 'data_offsets'", "two integers"});
  expect_rejected(R"({"dy":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}})", data,
                  {"tensor 'dy'", "field 'data_offsets'", "two integers"});
  expect_rejected(R"({"dy":{"dtype":"F32","shape":[1],"data_offsets":"0,4"}})", data,
                  {"tensor 'dy'", "field 'data_offsets'"});
  expect_rejected(R"({"dy":{"dtype":"F32","shape":[1],"data_offsets":[0.0,4.0]}})", data,
                  {"tensor 'dy'", "field 'data_offsets'", "not an integer"});
  expect_rejected(R"({"dy":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551615,4]}})", data,
                  {"tensor 'dy'", "field 'data_offsets'", "too large"});
  expect_rejected(R"({"dy":{"dtype":"F32","shape":[1],"data_offsets":[0,99999999999999999999999]}})", data,
                  {"tensor 'dy'", "field 'data_offsets'"});
  // Empty tensors at any offset inside the data never overlap.
  EXPECT_NO_THROW(safetensors_reader::from_bytes(
      "ok", make_file(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"z":{"dtype":"F32","shape":[0,3],"data_offsets":[4,4]}})",
                      data)));
}

TEST(SafetensorsCorruption, DtypeAndShape) {
  const std::string data(16, '\0');
  expect_rejected(R"({"w":{"dtype":"F7","shape":[1],"data_offsets":[0,1]}})", data,
                  {"bad.safetensors", "tensor 'w'", "field 'dtype'", "unknown dtype 'F7'"});
  expect_rejected(R"({"w":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}})", data, {"tensor 'w'", "field 'dtype'"});
  expect_rejected(R"({"w":{"dtype":5,"shape":[1],"data_offsets":[0,4]}})", data, {"tensor 'w'", "field 'dtype'", "string"});
  // Size mismatch: 3 floats need 12 bytes, offsets cover 16.
  expect_rejected(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", data,
                  {"bad.safetensors", "tensor 'w'", "field 'data_offsets'", "covers 16 bytes", "needs 12 bytes"});
  expect_rejected(R"({"w":{"dtype":"F32","shape":[-1,4],"data_offsets":[0,16]}})", data,
                  {"bad.safetensors", "tensor 'w'", "field 'shape'", "negative"});
  expect_rejected(R"({"w":{"dtype":"F32","shape":[4611686018427387904,4611686018427387904],"data_offsets":[0,16]}})", data,
                  {"bad.safetensors", "tensor 'w'", "field 'shape'", "overflows"});
  // The element count fits, its size in bytes does not.
  expect_rejected(R"({"w":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,16]}})", data,
                  {"tensor 'w'", "field 'shape'", "overflows"});
  expect_rejected(R"({"w":{"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,16]}})", data,
                  {"tensor 'w'", "field 'shape'", "too large"});
  expect_rejected(R"({"w":{"dtype":"F32","shape":[4.0],"data_offsets":[0,16]}})", data,
                  {"tensor 'w'", "field 'shape'", "not an integer"});
  expect_rejected(R"({"w":{"dtype":"F32","shape":"4","data_offsets":[0,16]}})", data,
                  {"tensor 'w'", "field 'shape'", "array"});
  expect_rejected(R"({"w":{"dtype":"F32","shape":[null],"data_offsets":[0,16]}})", data, {"tensor 'w'", "field 'shape'"});
  expect_rejected(R"({"w":{"dtype":"U8","shape":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1],"data_offsets":[0,1]}})",
                  data, {"tensor 'w'", "field 'shape'", "rank 33"});
  // A zero extent makes the tensor empty even when the other extents would overflow.
  EXPECT_NO_THROW(safetensors_reader::from_bytes(
      "ok", make_file(R"({"w":{"dtype":"F32","shape":[4611686018427387904,4611686018427387904,0],"data_offsets":[0,0]}})", data)));
}

TEST(SafetensorsCorruption, EntryStructure) {
  const std::string data(16, '\0');
  expect_rejected(R"({"w":[1,2]})", data, {"bad.safetensors", "tensor 'w'", "field 'entry'", "object"});
  expect_rejected(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":1}})", data,
                  {"bad.safetensors", "tensor 'w'", "field 'extra'", "unexpected"});
  expect_rejected(R"({"w":{"dtype":"U8","data_offsets":[0,1]}})", data, {"tensor 'w'", "field 'shape'", "missing"});
  expect_rejected(R"({"w":{"shape":[1],"data_offsets":[0,1]}})", data, {"tensor 'w'", "field 'dtype'", "missing"});
  expect_rejected(R"({"w":{"dtype":"U8","shape":[1]}})", data, {"tensor 'w'", "field 'data_offsets'", "missing"});
  expect_rejected(R"({"":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", data, {"bad.safetensors", "field 'name'"});
  expect_rejected(R"({"__metadata__":{"k":1}})", data, {"bad.safetensors", "field '__metadata__'", "'k'", "string"});
  expect_rejected(R"({"__metadata__":["k"]})", data, {"bad.safetensors", "field '__metadata__'", "object"});
  // Control characters in names are escaped in messages.
  expect_rejected("{\"a\\u001b[31m\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,99]}}", data,
                  {"tensor 'a\\x1b[31m'", "field 'data_offsets'"});
}

TEST(SafetensorsCorruption, FilesThatAreNotThere) {
  temporary_directory directory;
  const fs::path missing = directory.path() / "missing.safetensors";
  expect_input_error([&] { safetensors_reader reader(missing); }, {missing.string(), "no such file"}, "missing file");
  expect_input_error([&] { safetensors_reader reader(directory.path()); }, {directory.path().string(), "directory"},
                     "a directory");
}

// ---------------------------------------------------------------------------------------------
// Writer.

struct dtype_fixture {
  dtype type;
  const char* name;
  int size;
};

constexpr dtype_fixture all_dtypes[] = {
    {dtype::f64, "F64", 8},     {dtype::f32, "F32", 4},         {dtype::f16, "F16", 2},
    {dtype::bf16, "BF16", 2},   {dtype::u8, "U8", 1},           {dtype::i8, "I8", 1},
    {dtype::f8_e4m3, "F8_E4M3", 1}, {dtype::f8_e5m2, "F8_E5M2", 1}, {dtype::i16, "I16", 2},
    {dtype::i32, "I32", 4},     {dtype::i64, "I64", 8},         {dtype::u16, "U16", 2},
    {dtype::u32, "U32", 4},     {dtype::u64, "U64", 8},         {dtype::boolean, "BOOL", 1},
};

TEST(SafetensorsWriter, DtypeTableMatchesTheFormat) {
  for (const auto& fixture : all_dtypes) {
    EXPECT_EQ(mxscope::io::dtype_name(fixture.type), fixture.name);
    EXPECT_EQ(mxscope::io::dtype_size(fixture.type), fixture.size) << fixture.name;
    EXPECT_EQ(mxscope::io::parse_dtype(fixture.name), fixture.type) << fixture.name;
  }
  EXPECT_FALSE(mxscope::io::parse_dtype("F4").has_value());
}

TEST(SafetensorsWriter, RoundTripsEveryDtypeThroughAFile) {
  std::mt19937 generator(12345);
  safetensors_writer writer;
  std::map<std::string, std::pair<std::vector<std::int64_t>, std::vector<std::uint8_t>>> expected;
  for (const auto& fixture : all_dtypes) {
    const std::vector<std::int64_t> shape{3, 5};
    std::vector<std::uint8_t> bytes(static_cast<std::size_t>(15 * fixture.size));
    for (auto& byte : bytes) byte = static_cast<std::uint8_t>(generator());
    const std::string name = std::string("tensor_") + fixture.name;
    writer.add(name, fixture.type, shape, bytes);
    expected[name] = {shape, bytes};
  }
  writer.add("empty", dtype::f32, {0, 7}, {});
  writer.set_metadata("format", "mxfp4");
  writer.set_metadata("note", "spaces and \"quotes\"");
  temporary_directory directory;
  const fs::path path = directory.path() / "all.safetensors";
  writer.write(path);
  const safetensors_reader reader(path);
  EXPECT_EQ(reader.tensors().size(), std::size(all_dtypes) + 1);
  for (const auto& fixture : all_dtypes) {
    const std::string name = std::string("tensor_") + fixture.name;
    const auto* info = reader.find(name);
    ASSERT_NE(info, nullptr) << name;
    EXPECT_EQ(info->type, fixture.type) << name;
    EXPECT_EQ(info->shape, expected[name].first) << name;
    EXPECT_EQ(reader.read_tensor(name), expected[name].second) << name;
  }
  EXPECT_EQ(reader.find("empty")->shape, (std::vector<std::int64_t>{0, 7}));
  EXPECT_EQ(reader.metadata().at("format"), "mxfp4");
  EXPECT_EQ(reader.metadata().at("note"), "spaces and \"quotes\"");
  EXPECT_FALSE(fs::exists(mxscope::io::temporary_path_for(path)));
}

TEST(SafetensorsWriter, LayoutIsSortedPaddedAndByteReproducible) {
  const std::vector<std::pair<std::string, std::vector<std::uint8_t>>> tensors = {
      {"zeta", {1, 2, 3}}, {"alpha", {4}}, {"mid.codes", {5, 6}}, {"Beta", {7, 8, 9, 10, 11}}};
  safetensors_writer forward;
  safetensors_writer backward;
  for (const auto& [name, bytes] : tensors) forward.add(name, dtype::u8, {static_cast<std::int64_t>(bytes.size())}, bytes);
  for (auto it = tensors.rbegin(); it != tensors.rend(); ++it) {
    backward.add(it->first, dtype::u8, {static_cast<std::int64_t>(it->second.size())}, it->second);
  }
  forward.set_metadata("b", "2");
  forward.set_metadata("a", "1");
  backward.set_metadata("a", "1");
  backward.set_metadata("b", "2");
  const std::string image = forward.serialize();
  EXPECT_EQ(image, backward.serialize());

  // Independent parse of the layout.
  ASSERT_GE(image.size(), 8U);
  std::uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i) header_length = (header_length << 8) | static_cast<unsigned char>(image[static_cast<std::size_t>(i)]);
  EXPECT_EQ((8 + header_length) % 8, 0U) << "header length " << header_length;
  const std::string header = image.substr(8, header_length);
  const auto last_brace = header.rfind('}');
  ASSERT_NE(last_brace, std::string::npos);
  EXPECT_EQ(header.find_first_not_of(' ', last_brace + 1), std::string::npos) << "padding must be spaces: '" << header << "'";
  EXPECT_LT(header.size() - last_brace - 1, 8U);
  const auto root = nlohmann::json::parse(header);
  EXPECT_EQ(root.at("__metadata__"), (nlohmann::json{{"a", "1"}, {"b", "2"}}));
  // Data in name order (byte-wise: "Beta" < "alpha" < "mid.codes" < "zeta").
  std::uint64_t offset = 0;
  std::string expected_data;
  for (const char* name : {"Beta", "alpha", "mid.codes", "zeta"}) {
    const auto& entry = root.at(name);
    const auto& bytes = std::find_if(tensors.begin(), tensors.end(), [&](const auto& t) { return t.first == name; })->second;
    EXPECT_EQ(entry.at("dtype"), "U8");
    EXPECT_EQ(entry.at("data_offsets"), (nlohmann::json{offset, offset + bytes.size()})) << name;
    offset += bytes.size();
    expected_data.append(bytes.begin(), bytes.end());
  }
  EXPECT_EQ(image.substr(8 + header_length), expected_data);

  // The file on disk is the same image, every time.
  temporary_directory directory;
  forward.write(directory.path() / "a.safetensors");
  backward.write(directory.path() / "b.safetensors");
  EXPECT_EQ(read_raw(directory.path() / "a.safetensors"), image);
  EXPECT_EQ(read_raw(directory.path() / "b.safetensors"), image);
}

TEST(SafetensorsWriter, RejectsInconsistentTensors) {
  safetensors_writer writer;
  expect_input_error([&] { writer.add("w", dtype::f32, {2}, std::vector<std::uint8_t>(7)); }, {"tensor 'w'", "7 bytes"}, "7 bytes for 2 floats");
  expect_input_error([&] { writer.add("w", dtype::f32, {-2}, {}); }, {"tensor 'w'", "shape"}, "negative shape");
  expect_input_error([&] { writer.add("", dtype::u8, {0}, {}); }, {"empty"}, "empty name");
  expect_input_error([&] { writer.add("__metadata__", dtype::u8, {0}, {}); }, {"reserved"}, "reserved name");
  writer.add("w", dtype::u8, {1}, {1});
  expect_input_error([&] { writer.add("w", dtype::u8, {1}, {1}); }, {"tensor 'w'", "twice"}, "duplicate");
  expect_input_error([&] { writer.add("big", dtype::u8, {std::int64_t{1} << 62, 8}, {}); }, {"tensor 'big'", "overflows"},
                     "2^62 x 8 elements");
}

// Whatever the reader accepts, the writer can write back: an empty tensor whose other extents would
// overflow when multiplied is empty for both.
TEST(SafetensorsWriter, EmptyTensorWithHugeExtentsRoundTrips) {
  const std::vector<std::int64_t> shape = {std::int64_t{1} << 62, std::int64_t{1} << 62, 0};
  safetensors_writer writer;
  writer.add("empty", dtype::f32, shape, {});
  const auto reader = safetensors_reader::from_bytes("empty.safetensors", writer.serialize());
  ASSERT_NE(reader.find("empty"), nullptr);
  EXPECT_EQ(reader.find("empty")->shape, shape);
  EXPECT_EQ(reader.find("empty")->element_count, 0U);
}

// ---------------------------------------------------------------------------------------------
// Atomic output files.

TEST(AtomicFile, WritesCompleteFileAndLeavesNoTemporary) {
  temporary_directory directory;
  const fs::path path = directory.path() / "out.bin";
  mxscope::io::write_file_atomically(path, std::string_view("hello"));
  EXPECT_EQ(read_raw(path), "hello");
  EXPECT_EQ(mxscope::io::temporary_path_for(path).string(), path.string() + ".tmp." + std::to_string(::getpid()));
  EXPECT_FALSE(fs::exists(mxscope::io::temporary_path_for(path)));
  // Replacing an existing file.
  mxscope::io::write_file_atomically(path, std::string_view("second"));
  EXPECT_EQ(read_raw(path), "second");
}

TEST(AtomicFile, FailureMidWriteLeavesNothingAndKeepsTheOldFile) {
  temporary_directory directory;
  const fs::path path = directory.path() / "out.bin";
  bool temporary_seen = false;
  EXPECT_THROW(mxscope::io::write_file_atomically(path,
                                                  [&](mxscope::io::atomic_file& file) {
                                                    file.write(std::string(100000, 'x'));
                                                    temporary_seen = fs::exists(mxscope::io::temporary_path_for(path));
                                                    throw std::runtime_error("producer failed halfway");
                                                  }),
               std::runtime_error);
  EXPECT_TRUE(temporary_seen) << "the bytes should go to " << mxscope::io::temporary_path_for(path);
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(mxscope::io::temporary_path_for(path)));
  EXPECT_TRUE(fs::is_empty(directory.path()));

  write_raw(path, "old contents");
  EXPECT_THROW(mxscope::io::write_file_atomically(path,
                                                  [&](mxscope::io::atomic_file& file) {
                                                    file.write(std::string_view("new"));
                                                    throw std::runtime_error("fail");
                                                  }),
               std::runtime_error);
  EXPECT_EQ(read_raw(path), "old contents");
  EXPECT_FALSE(fs::exists(mxscope::io::temporary_path_for(path)));
}

TEST(AtomicFile, UnwritableDestinationIsAnInputError) {
  temporary_directory directory;
  const fs::path path = directory.path() / "no-such-dir" / "out.bin";
  expect_input_error([&] { mxscope::io::write_file_atomically(path, std::string_view("x")); }, {path.string()},
                     path.string());
  expect_input_error([&] { mxscope::io::write_file_atomically(directory.path(), std::string_view("x")); },
                     {directory.path().string(), "directory"}, "directory as output");
  EXPECT_FALSE(fs::exists(path));
}

TEST(PrintableName, EscapesControlAndNonAsciiBytesAndShortensLongNames) {
  EXPECT_EQ(mxscope::io::printable_name("dy"), "dy");
  EXPECT_EQ(mxscope::io::printable_name(std::string("a\nb\x1b\xff", 5)), "a\\x0ab\\x1b\\xff");
  EXPECT_EQ(mxscope::io::printable_name("it's"), "it\\'s");
  const std::string long_name(1000, 'n');
  const std::string shown = mxscope::io::printable_name(long_name);
  EXPECT_LT(shown.size(), 200U);
  EXPECT_NE(shown.find("1000 bytes"), std::string::npos) << shown;
}

}  // namespace
