#include "mxscope/io/sha256.hpp"

#include <fmt/format.h>

#include <fstream>
#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif
#include <vector>

#include "mxscope/errors.hpp"

namespace mxscope::io {

namespace {

constexpr std::uint32_t round_constants[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

constexpr std::uint32_t rotate_right(std::uint32_t value, int bits) { return (value >> bits) | (value << (32 - bits)); }

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MXSCOPE_SHA_EXTENSIONS 1
// FIPS 180-4's compression on the x86 SHA extensions. The eight working variables live in two
// registers as the instructions want them: {A, B, E, F} and {C, D, G, H} (highest lane first).
// Each group of four rounds adds four schedule words and their constants, and sha256rnds2 runs
// two rounds at a time (the low two words, then the high two). The schedule is built four words at
// a time: W[t..t+3] = msg2(msg1(W[t-16..t-13], W[t-12..t-9]) + W[t-7..t-4], W[t-4..t-1]), i.e.
// W[t-16] + s0(W[t-15]) + W[t-7] + s1(W[t-2]).
__attribute__((target("sha,sse4.1,ssse3"))) void compress_with_extensions(std::uint32_t* state,
                                                                          const std::uint8_t* blocks,
                                                                          std::size_t count) {
  const __m128i byte_swap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
  __m128i dcba = _mm_loadu_si128(reinterpret_cast<const __m128i*>(state));
  __m128i hgfe = _mm_loadu_si128(reinterpret_cast<const __m128i*>(state + 4));
  const __m128i cdab = _mm_shuffle_epi32(dcba, 0xB1);
  const __m128i efgh = _mm_shuffle_epi32(hgfe, 0x1B);
  __m128i abef = _mm_alignr_epi8(cdab, efgh, 8);
  __m128i cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
  for (std::size_t block = 0; block < count; ++block) {
    const std::uint8_t* data = blocks + 64 * block;
    const __m128i abef_before = abef;
    const __m128i cdgh_before = cdgh;
    __m128i words[4];  // the last four groups of schedule words, group g in words[g % 4]
    for (int group = 0; group < 16; ++group) {
      __m128i w;
      if (group < 4) {
        w = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(data + 16 * group)), byte_swap);
      } else {
        const __m128i w16 = words[group % 4];        // W[t-16 .. t-13]
        const __m128i w12 = words[(group + 1) % 4];  // W[t-12 .. t-9]
        const __m128i w8 = words[(group + 2) % 4];   // W[t-8 .. t-5]
        const __m128i w4 = words[(group + 3) % 4];   // W[t-4 .. t-1]
        w = _mm_sha256msg1_epu32(w16, w12);
        w = _mm_add_epi32(w, _mm_alignr_epi8(w4, w8, 4));  // + W[t-7 .. t-4]
        w = _mm_sha256msg2_epu32(w, w4);
      }
      words[group % 4] = w;
      const __m128i message = _mm_add_epi32(
          w, _mm_loadu_si128(reinterpret_cast<const __m128i*>(round_constants + 4 * group)));
      cdgh = _mm_sha256rnds2_epu32(cdgh, abef, message);  // rounds 4g, 4g + 1: cdgh now holds abef
      abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(message, 0x0E));  // 4g + 2, 4g + 3
    }
    abef = _mm_add_epi32(abef, abef_before);
    cdgh = _mm_add_epi32(cdgh, cdgh_before);
  }
  const __m128i feba = _mm_shuffle_epi32(abef, 0x1B);
  const __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);
  dcba = _mm_blend_epi16(feba, dchg, 0xF0);
  hgfe = _mm_alignr_epi8(dchg, feba, 8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(state), dcba);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(state + 4), hgfe);
}
#endif

bool processor_has_sha_extensions() {
#if defined(MXSCOPE_SHA_EXTENSIONS)
  // CPUID directly: __builtin_cpu_supports("sha") is not known to clang before 15.
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(1, &a, &b, &c, &d) == 0) return false;
    const bool ssse3 = (c & bit_SSSE3) != 0;
    const bool sse41 = (c & bit_SSE4_1) != 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    const bool sha = (b & (1U << 29)) != 0;  // CPUID.(EAX=7, ECX=0):EBX bit 29
    return sha && sse41 && ssse3;
  }();
  return has;
#else
  return false;
#endif
}

}  // namespace

bool sha256_accelerated() { return processor_has_sha_extensions(); }

sha256::sha256(bool portable)
    : state_{0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19},
      buffer_{} {
  accelerated_ = !portable && processor_has_sha_extensions();
}

void sha256::compress(const std::uint8_t* blocks, std::size_t count) {
#if defined(MXSCOPE_SHA_EXTENSIONS)
  if (accelerated_) {
    compress_with_extensions(state_, blocks, count);
    return;
  }
#endif
  for (std::size_t index = 0; index < count; ++index) {
  const std::uint8_t* block = blocks + 64 * index;
  std::uint32_t schedule[64];
  for (int i = 0; i < 16; ++i) {
    schedule[i] = (static_cast<std::uint32_t>(block[4 * i]) << 24) | (static_cast<std::uint32_t>(block[4 * i + 1]) << 16) |
                  (static_cast<std::uint32_t>(block[4 * i + 2]) << 8) | static_cast<std::uint32_t>(block[4 * i + 3]);
  }
  for (int i = 16; i < 64; ++i) {
    const std::uint32_t s0 = rotate_right(schedule[i - 15], 7) ^ rotate_right(schedule[i - 15], 18) ^ (schedule[i - 15] >> 3);
    const std::uint32_t s1 = rotate_right(schedule[i - 2], 17) ^ rotate_right(schedule[i - 2], 19) ^ (schedule[i - 2] >> 10);
    schedule[i] = schedule[i - 16] + s0 + schedule[i - 7] + s1;
  }
  std::uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3];
  std::uint32_t e = state_[4], f = state_[5], g = state_[6], h = state_[7];
  for (int i = 0; i < 64; ++i) {
    const std::uint32_t sum1 = rotate_right(e, 6) ^ rotate_right(e, 11) ^ rotate_right(e, 25);
    const std::uint32_t choice = (e & f) ^ (~e & g);
    const std::uint32_t t1 = h + sum1 + choice + round_constants[i] + schedule[i];
    const std::uint32_t sum0 = rotate_right(a, 2) ^ rotate_right(a, 13) ^ rotate_right(a, 22);
    const std::uint32_t majority = (a & b) ^ (a & c) ^ (b & c);
    const std::uint32_t t2 = sum0 + majority;
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  state_[0] += a;
  state_[1] += b;
  state_[2] += c;
  state_[3] += d;
  state_[4] += e;
  state_[5] += f;
  state_[6] += g;
  state_[7] += h;
  }
}

void sha256::update(const void* data, std::size_t size) {
  const auto* bytes = static_cast<const std::uint8_t*>(data);
  total_bytes_ += size;
  while (size > 0) {
    if (buffered_ == 0 && size >= 64) {  // whole blocks straight from the input
      const std::size_t blocks = size / 64;
      compress(bytes, blocks);
      bytes += 64 * blocks;
      size -= 64 * blocks;
      continue;
    }
    const std::size_t take = std::min<std::size_t>(64 - buffered_, size);
    std::copy(bytes, bytes + take, buffer_ + buffered_);
    buffered_ += take;
    bytes += take;
    size -= take;
    if (buffered_ == 64) {
      compress(buffer_, 1);
      buffered_ = 0;
    }
  }
}

std::string sha256::hex_digest() {
  const std::uint64_t bit_length = total_bytes_ * 8;
  const std::uint8_t pad_start = 0x80;
  update(&pad_start, 1);
  const std::uint8_t zero = 0;
  while (buffered_ != 56) update(&zero, 1);
  std::uint8_t length_bytes[8];
  for (int i = 0; i < 8; ++i) length_bytes[i] = static_cast<std::uint8_t>(bit_length >> (56 - 8 * i));
  update(length_bytes, 8);
  std::string hex;
  for (std::uint32_t word : state_) hex += fmt::format("{:08x}", word);
  return hex;
}

std::string sha256_hex(std::string_view bytes, bool portable) {
  sha256 hash(portable);
  hash.update(bytes.data(), bytes.size());
  return hash.hex_digest();
}

std::string sha256_file(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw input_error(fmt::format("{}: cannot open the file to hash it", path.string()));
  sha256 hash;
  std::vector<char> chunk(1 << 20);
  while (file) {
    file.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    hash.update(chunk.data(), static_cast<std::size_t>(file.gcount()));
  }
  if (file.bad()) throw input_error(fmt::format("{}: read error while hashing", path.string()));
  return hash.hex_digest();
}

}  // namespace mxscope::io
