// GPU test suite: the fused row quantizer (codes, scales, values and bf16 operands in one pass)
// against the host definition.
#include "quantize_support.hpp"

namespace gpu_test {

// The fused one-pass quantizer (axis 1, block 32, rotation none / 16 / 32) on fp32 and bf16 inputs, and
// the generic path on the same inputs (bf16 widening and rotation through an fp32 copy).
// An sr case (mxfp4, blocks of 32 along rows, floor rule, 32 random bits) on the first of 64
// successive seeds whose input has what the case needs: build(options, input, state) fills `input`
// (from the seed's stream and the generator `state`) and returns the detail for the case's name,
// or std::nullopt where the seed fell short; check(options, input) is then the case. Where no seed
// does, the case fails saying `short_of`.
template <class Build, class Check>
void run_on_first_fitting_seed(const std::string& name, const std::string& short_of, std::int64_t rows,
                               std::int64_t cols, Build&& build, Check&& check) {
  std::uint64_t seed = next_seed();
  for (int attempt = 0; attempt < 64; ++attempt, ++seed) {
    const auto options = mx_options(0, 32, 1, core::rounding_mode::sr, core::scale_rule::floor, 32, seed + 1);
    matrix input(rows, cols);
    std::uint64_t state = seed + 3;
    const std::optional<std::string> detail = build(options, input, state);
    if (!detail) continue;
    run_case(name + " " + std::to_string(rows) + "x" + std::to_string(cols) + " (" + *detail + ")",
             [&] { return check(options, input); });
    return;
  }
  run_case(name, [&] { return short_of; });
}

namespace {

// Every format x rounding x scale rule on every input kind. `index` counts the cases of the whole
// suite (the small set keeps every n-th).
void fused_sweep(bool small, int& index) {
  for (int format = 0; format < 6; ++format) {
    for (int rounding = 0; rounding < 4; ++rounding) {
      for (const int rotation_size : {0, 16, 32}) {
        for (const bool bf16 : {false, true}) {
          ++index;
          if (small && index % 29 != 1) continue;
          const std::uint64_t seed = next_seed();
          const value_kind kind = static_cast<value_kind>(index % test_inputs::value_kind_count);
          const std::int64_t rows = 19 + index % 7, cols = 32 * (3 + index % 4);
          const matrix input = test_inputs::make_matrix(rows, cols, kind, seed);
          const auto options =
              mx_options(format, 32, 1, static_cast<core::rounding_mode>(rounding),
                         static_cast<core::scale_rule>(index % 3), rounding == 3 && index % 3 == 0 ? 9 : 32, seed + 1);
          mxscope::rotation_options rotation;
          rotation.size = rotation_size;
          rotation.signs = static_cast<mxscope::sign_policy>(index % 3);
          rotation.seed = seed + 2;
          rotation.step = 7;
          rotation.layer_hash = 0x1234567U;
          const std::string name = std::string("quantize fused ") + format_names[format] + " " +
                                   rounding_names[rounding] + " H" + std::to_string(rotation_size) + " signs " +
                                   sign_names[static_cast<int>(rotation.signs)] + (bf16 ? " bf16" : " fp32") + " " +
                                   std::to_string(rows) + "x" + std::to_string(cols) + " " +
                                   std::string(test_inputs::value_kind_name(kind));
          run_case(name, [&] { return check_quantize(input, bf16, options, rotation, gpu::quantize_path::fused); });
          run_case(name + " (generic path)",
                   [&] { return check_quantize(input, bf16, options, rotation, gpu::quantize_path::generic); });
        }
      }
    }
  }
}

// The fp4 encoders (rne halfword, unscaled, scaled) and the lean H16 + sr path on every input kind
// (in the small set too).
void fp4_encoder_checks(int& index) {
  // The fp4 rne and sr encoders, in the small set too: for rne the halfword one (bf16 without
  // rotation), for both the unscaled one (fp32, or after a rotation) and the scaled one (blocks
  // outside their exponent ranges, which the extreme inputs reach), on every input kind; odd row
  // counts, several tiles.
  for (const core::rounding_mode rounding : {core::rounding_mode::rne, core::rounding_mode::sr}) {
    for (int kind_index = 0; kind_index < test_inputs::value_kind_count; ++kind_index) {
      for (const int rotation_size : {0, 16}) {
        for (const bool bf16 : {true, false}) {
          ++index;
          const std::uint64_t seed = next_seed();
          const value_kind kind = static_cast<value_kind>(kind_index);
          const std::int64_t rows = 37, cols = 32 * (17 + index % 5);
          const matrix input = test_inputs::make_matrix(rows, cols, kind, seed);
          const auto options =
              mx_options(0, 32, 1, rounding, static_cast<core::scale_rule>(index % 3), 32, seed + 1);
          mxscope::rotation_options rotation;
          rotation.size = rotation_size;
          rotation.signs = rotation_size == 0 ? mxscope::sign_policy::none : mxscope::sign_policy::fixed;
          rotation.seed = seed + 2;
          const std::string name = std::string("quantize fused mxfp4 ") + rounding_names[static_cast<int>(rounding)] +
                                   " encoders H" + std::to_string(rotation_size) + (bf16 ? " bf16 " : " fp32 ") +
                                   std::to_string(rows) + "x" + std::to_string(cols) + " " +
                                   std::string(test_inputs::value_kind_name(kind));
          run_case(name, [&] { return check_quantize(input, bf16, options, rotation, gpu::quantize_path::fused); });
        }
      }
    }
  }
  // The lean path of folded H16 + sr (the floor rule, no rotation signs; check_quantize's run
  // without the dequantized output takes it, the others the general loop) on every input kind,
  // several tiles.
  for (int kind_index = 0; kind_index < test_inputs::value_kind_count; ++kind_index) {
    ++index;
    const std::uint64_t seed = next_seed();
    const value_kind kind = static_cast<value_kind>(kind_index);
    const std::int64_t rows = 37, cols = 32 * (17 + index % 5);
    const matrix input = test_inputs::make_matrix(rows, cols, kind, seed);
    const auto options = mx_options(0, 32, 1, core::rounding_mode::sr, core::scale_rule::floor, 32, seed + 1);
    mxscope::rotation_options rotation;
    rotation.size = 16;
    rotation.signs = mxscope::sign_policy::none;
    const std::string name = "quantize fused mxfp4 sr lean H16 bf16 " + std::to_string(rows) + "x" +
                             std::to_string(cols) + " " + std::string(test_inputs::value_kind_name(kind));
    run_case(name, [&] { return check_quantize(input, true, options, rotation, gpu::quantize_path::fused); });
  }
}

// Undecided sums on fp32 input.
void undecided_fp32(int& index) {
  // The sr encoder's undecided sums (fast_encode::fp4_stochastic_anchored_sum): fp32 blocks of exponent 0
  // (4.0 first, then 7.0, which saturates) where every element whose Philox word w has w >> 10 >= 2^22 - 2^13 (about 1 in
  // 512) is made (A 2^10 + B) 2^-33 with A = 2^22 - 1 - (w >> 10) and B in 1..1023: floor(F 2^22) =
  // A fills the sum's low 22 bits, and B + (w & 1023) >= 1024, which the fast sum cannot see,
  // decides. The kernel must take fp4_stochastic_unscaled for those blocks; both outcomes occur.
  {
    ++index;
    const std::uint64_t seed = next_seed();
    const std::int64_t rows = 16, cols = 32 * 96;
    auto options = mx_options(0, 32, 1, core::rounding_mode::sr, core::scale_rule::floor, 32, seed + 1);
    matrix input = test_inputs::make_matrix(rows, cols, value_kind::banded, seed);
    std::uint64_t state = seed + 3;
    int ups = 0, downs = 0;
    for (std::int64_t n = 0; n < input.size(); ++n) {
      float& v = input.values[static_cast<std::size_t>(n)];
      v = std::fmod(v, 4.0f);
      if (n % 32 < 2) {  // the grid's exponent 0 (the largest is in [4, 8)), and one saturated element
        v = n % 32 == 0 ? 4.0f : 7.0f;
        continue;
      }
      const std::uint32_t word = options.stream.word(static_cast<std::uint64_t>(n));
      if ((word >> 10) < 0x3fffffU - 0x1fffU) continue;
      const std::uint32_t a = 0x3fffffU - (word >> 10);
      const std::uint32_t b = 1U + static_cast<std::uint32_t>(split_mix(state) % 1023U);
      v = std::ldexp(static_cast<float>((a << 10) | b), -33) * (n % 2 == 0 ? 1.0f : -1.0f);
      (b + (word & 0x3ffU) >= 0x400U ? ups : downs) += 1;
    }
    mxscope::rotation_options none;
    run_case("quantize fused mxfp4 sr undecided sums fp32 " + std::to_string(rows) + "x" + std::to_string(cols),
             [&]() -> std::string {
               if (ups < 5 || downs < 5) {
                 return "the input has " + std::to_string(ups) + " undecided elements rounding up and " +
                        std::to_string(downs) + " rounding down, not 5 of each";
               }
               return check_quantize(input, false, options, none, gpu::quantize_path::fused);
             });
  }
}

// Undecided sums on bf16 input, beside blocks that skip the check.
void undecided_bf16(int& index) {
  // The same on bf16 input, where a block whose least magnitude is at least 2^(e - 16) skips the
  // undecided check (encode_fused_block). Blocks of exponent 0 (4.0 first, 7.0 second), the other
  // elements random bf16 in [2^-16, 4), and where an element's Philox word w allows (W = w >> 10):
  //   A: W = 2^22 - 1 - 2^15 t (t < 128): 0.5 + t / 256 (F 2^22 = 2^15 t fills the sum's low bits);
  //   B: W = 2^22 - 1 - m (128 <= m < 256): m 2^-23, at 2^-16 and above;
  //   C: W = 2^22 - 1 - u (64 <= u < 128): (2 u + 1) 2^-24, below 2^-16: F 2^32 = (2 u + 1) 2^9,
  //      so (w & 1023) >= 512 rounds it up, which the sum's carry cannot see.
  // A and B sit in blocks that skip the check and must round down; a C block must take the check.
  // The seed is advanced until each kind occurs (and C both ways).
  ++index;
  run_on_first_fitting_seed(
      "quantize fused mxfp4 sr undecided sums bf16", "no seed gave every kind of element in 64 attempts", 96,
      32 * 128,
      [&](const mxscope::quantize_options& options, matrix& input, std::uint64_t& state) -> std::optional<std::string> {
        int a_kind = 0, b_kind = 0, c_up = 0, c_down = 0;
        for (std::int64_t n = 0; n < input.size(); ++n) {
          float& v = input.values[static_cast<std::size_t>(n)];
          const std::uint64_t r = split_mix(state);
          const float sign = (r & 1) != 0 ? -1.0f : 1.0f;
          if (n % 32 < 2) {
            v = sign * (n % 32 == 0 ? 4.0f : 7.0f);
            continue;
          }
          const std::uint32_t word = options.stream.word(static_cast<std::uint64_t>(n));
          const std::uint32_t rest = 0x3fffffU - (word >> 10);
          if (rest % 0x8000U == 0) {
            v = 0.5f + static_cast<float>(rest >> 15) / 256.0f;
            ++a_kind;
          } else if (rest >= 128 && rest < 256) {
            v = std::ldexp(static_cast<float>(rest), -23);
            ++b_kind;
          } else if (rest >= 64 && rest < 128) {
            v = std::ldexp(static_cast<float>(2 * rest + 1), -24);
            ((word & 0x3ffU) >= 0x200U ? c_up : c_down) += 1;
          } else {  // 2^(k - 7) (128 + f), -16 <= k <= 1
            const int k = -16 + static_cast<int>((r >> 1) % 18);
            v = std::ldexp(static_cast<float>(128 + ((r >> 8) & 0x7f)), k - 7);
          }
          v *= sign;
        }
        if (a_kind < 2 || b_kind < 2 || c_up < 1 || c_down < 1) return std::nullopt;
        return std::to_string(a_kind) + " + " + std::to_string(b_kind) + " carry-decided, " + std::to_string(c_up) +
               " up and " + std::to_string(c_down) + " down below 2^(e - 16)";
      },
      [&](const mxscope::quantize_options& options, const matrix& input) {
        return check_quantize(input, true, options, mxscope::rotation_options{}, gpu::quantize_path::fused);
      });
}

// Undecided sums after H16 on bf16 input, one binade either side of the skip threshold.
void undecided_bf16_h16(int& index) {
  // H16 on bf16 (signs none): a block whose least input magnitude has an exponent field of at least
  // e + 113 skips the undecided check (every rotated value, 4x as the kernel keeps it, is then a
  // multiple of 2^(e + 2 - 23), so F 2^32 has no bits below 2^10). Each block: elements 0..15 all
  // 2.0 but for a pair 2 p, 2 p + 1 of -2.0 (p = g mod 8; outputs 24, -+8 and 0: grid exponent e = 0, the kernel's
  // grid 2^2 for 4x the rotation; one negative input in each bf16 half of the words as read, so
  // that the kernel's least input magnitude must drop the signs it meets), elements
  // 16..31 all t except one t' (outputs 15 t + t' and +-(t' - t)). With t = m 2^-22 (m odd, 129..255:
  // exponent field 112 = e + 112, one below the skip) and t' - t = D 2^-22, an output k of the
  // second half has F 2^22 = D / 2 on the grid's spacing 2: D = 2 n + 1 with
  // n = 2^22 - 1 - (W >> 10) for that output's word W fills the sum's low 22 bits, and F 2^32 ends in
  // 512, so (W & 1023) >= 512 rounds it up, which the sum's carry cannot see: those blocks must take
  // the check (a threshold one binade lower fails the case). The other blocks get t = m 2^-21
  // (field 113: they skip the check; t' - t a multiple of 2^-21, so the carry decides exactly).
  // Only a t' = t + D 2^-22 of 8 significant bits is a bf16 number: blocks are taken where some
  // output's word allows one. The host checks each built output against the rotation itself.
  ++index;
  {
    std::string construction_error;
    mxscope::rotation_options h16;
    h16.size = 16;
    h16.signs = mxscope::sign_policy::none;
    run_on_first_fitting_seed(
        "quantize fused mxfp4 sr undecided sums H16 bf16", "no seed gave 3 undecided sums each way in 64 attempts",
        16, 32 * 128,
        [&](const mxscope::quantize_options& options, matrix& input,
            std::uint64_t& state) -> std::optional<std::string> {
          int ups = 0, downs = 0, skipped = 0;
          construction_error.clear();
          for (std::int64_t g = 0; g < input.size() / 32; ++g) {
            float* block = input.values.data() + g * 32;
            for (int i = 0; i < 16; ++i) block[i] = i / 2 == g % 8 ? -2.0f : 2.0f;
            // An output k (1..15) of the second half and an odd m whose t' has 8 significant bits.
            int found_k = -1;
            std::uint32_t found_m = 0, found_d = 0;
            for (int k = 1; k < 16 && found_k < 0; ++k) {
              const std::uint32_t word = options.stream.word(static_cast<std::uint64_t>(g * 32 + 16 + k));
              const std::uint32_t d = 2U * (0x3fffffU - (word >> 10)) + 1U;
              for (std::uint32_t m = 129; m < 256; m += 2) {
                std::uint32_t sum = m + d;
                while (sum % 2 == 0) sum /= 2;
                if (sum < 256) {
                  found_k = k;
                  found_m = m;
                  found_d = d;
                  break;
                }
              }
            }
            const std::uint64_t r = split_mix(state);
            const int j = 1 + static_cast<int>(r % 15);  // where t' sits in the second half
            if (found_k >= 0) {
              const float t = std::ldexp(static_cast<float>(found_m), -22);
              for (int i = 16; i < 32; ++i) block[i] = t;
              block[16 + j] = std::ldexp(static_cast<float>(found_m + found_d), -22);
              // The rotation as the core does it: output found_k must be +-D 2^-22, 4x as the kernel
              // keeps it, and its sum undecided.
              float rotated[16];
              std::copy(block + 16, block + 32, rotated);
              core::rotate_segment(rotated, 16, nullptr);
              const double kept = std::fabs(4.0 * static_cast<double>(rotated[found_k]));
              const std::uint32_t word = options.stream.word(static_cast<std::uint64_t>(g * 32 + 16 + found_k));
              const double units = std::ldexp(kept, 22 - 1);  // F 2^22 on the grid spacing 2 (kept < 2)
              if (kept >= 2.0 || std::floor(units) + static_cast<double>(word >> 10) != 4194303.0 ||
                  units == std::floor(units)) {
                construction_error = "block " + std::to_string(g) + ": output " + std::to_string(found_k) +
                                     " is not an undecided sum";
              }
              ((word & 0x3ffU) >= 0x200U ? ups : downs) += 1;
            } else {
              const std::uint32_t m = 129U + 2U * static_cast<std::uint32_t>((r >> 8) % 64);
              const float t = std::ldexp(static_cast<float>(m), -21);
              for (int i = 16; i < 32; ++i) block[i] = t;
              const int binade = -21 + static_cast<int>((r >> 30) % 8);
              block[16 + j] = std::ldexp(static_cast<float>(128 + ((r >> 20) & 0x7f)), binade);
              ++skipped;
            }
            for (int i = 0; i < 32; ++i) {
              if (test_inputs::from_bf16_bits(test_inputs::to_bf16_bits(block[i])) != block[i]) {
                construction_error =
                    "block " + std::to_string(g) + " element " + std::to_string(i) + " is not a bf16 number";
              }
            }
          }
          if ((ups < 3 || downs < 3 || skipped < 16) && construction_error.empty()) return std::nullopt;
          return std::to_string(ups) + " up and " + std::to_string(downs) + " down one binade below the skip, " +
                 std::to_string(skipped) + " skipping blocks";
        },
        [&](const mxscope::quantize_options& options, const matrix& input) {
          if (!construction_error.empty()) return construction_error;
          return check_quantize(input, true, options, h16, gpu::quantize_path::fused);
        });
  }
}

// Undecided stochastic-rounding sums: blocks built so that the fast sum cannot decide and the
// kernel must take the exact check (fp32 and bf16 input, with and without H16).
void undecided_sum_checks(int& index) {
  undecided_fp32(index);
  undecided_bf16(index);
  undecided_bf16_h16(index);
}

// Blocks at the edges of the fast paths' ranges, and several tiles of the fused kernel.
void range_and_tile_checks(bool small, int& index) {
  // sr blocks on both sides of the fp32 saturation flags' range (grid exponent -105) and of the
  // anchored sum's (grid exponent 23; fast_encode::fp4_stochastic_anchored_covers): outside them
  // the kernel encodes the block through fused_block_again. Block b of a row holds values of about
  // 2^(top - b) (top -98, resp. 30), one of them 7/4 of the block's largest power of two (saturated
  // without rotation), one six 2^e and one an fp32 step above it (saturated in fp32), bf16 and fp32
  // input, without rotation and with H16 (whose grid exponent is the block's + 2).
  for (const int top_block : {-98, 30})
  for (const int rotation_size : {0, 16}) {
    for (const bool bf16 : {true, false}) {
      ++index;
      const std::uint64_t seed = next_seed();
      const std::int64_t rows = 4, cols = 32 * 16;
      matrix input(rows, cols);
      std::uint64_t state = seed + 3;
      for (std::int64_t n = 0; n < input.size(); ++n) {
        const int top = top_block - static_cast<int>((n % cols) / 32);
        const std::uint64_t r = split_mix(state);
        float v = std::ldexp(static_cast<float>(128 + (r & 0x7f)) / 128.0f, -static_cast<int>((r >> 8) % 12));
        if (n % 32 == 0) v = 7.0f;
        if (n % 32 == 1) v = 6.0f;                        // six itself: not saturated
        if (n % 32 == 2) v = std::nextafter(6.0f, 7.0f);  // one fp32 step above (bf16 rounds it to six)
        input.values[static_cast<std::size_t>(n)] = std::ldexp(v, top) * ((r >> 20) % 2 != 0 ? -1.0f : 1.0f);
      }
      const auto options = mx_options(0, 32, 1, core::rounding_mode::sr, core::scale_rule::floor, 32, seed + 1);
      mxscope::rotation_options rotation;
      rotation.size = rotation_size;
      run_case(std::string("quantize fused mxfp4 sr ") +
                   (top_block < 0 ? "saturation flags' exponent edge H" : "anchor's exponent edge H") +
                   std::to_string(rotation_size) +
                   (bf16 ? " bf16" : " fp32"),
               [&] { return check_quantize(input, bf16, options, rotation, gpu::quantize_path::fused); });
    }
  }
  // Several tiles: the fused kernel takes 256 MX blocks per thread block; 37 x 1824 has 2109 blocks,
  // 8 full tiles and a partial one. mxfp4 (its own encoders) and mxfp8, rne and sr.
  for (const int format : {0, 3}) {
    for (const int rounding : {0, 3}) {
      ++index;
      if (small && (format == 0) != (rounding == 0)) continue;  // small: mxfp4 rne, mxfp8 sr
      const std::uint64_t seed = next_seed();
      const value_kind kind = static_cast<value_kind>(index % test_inputs::value_kind_count);
      const matrix input = test_inputs::make_matrix(37, 1824, kind, seed);
      const auto options = mx_options(format, 32, 1, static_cast<core::rounding_mode>(rounding),
                                      static_cast<core::scale_rule>(index % 3), 32, seed + 1);
      mxscope::rotation_options rotation;
      rotation.size = format == 0 ? 16 : 0;
      rotation.signs = mxscope::sign_policy::per_step;
      rotation.seed = seed + 2;
      const std::string name = std::string("quantize fused ") + format_names[format] + " " + rounding_names[rounding] +
                               " H" + std::to_string(rotation.size) + " bf16 37x1824 (9 tiles) " +
                               std::string(test_inputs::value_kind_name(kind));
      run_case(name, [&] { return check_quantize(input, true, options, rotation, gpu::quantize_path::fused); });
    }
  }
}

}  // namespace

void quantize_fused(bool small) {
  int index = 0;
  fused_sweep(small, index);
  fp4_encoder_checks(index);
  undecided_sum_checks(index);
  range_and_tile_checks(small, index);
}

}  // namespace gpu_test
