// GPU test suites: the exact reference GEMM, and the products of unscaled (fp32, bf16) operands,
// against the definitions.
#include "support.hpp"
#include "gemm_support.hpp"

namespace gpu_test {

// The device reference of A and B (outputs poisoned with 0xFF first) against the definition, entry
// by entry, and the host convenience function against the same.
std::string check_reference(const matrix& a, const matrix& b, const std::string& replay) {
  const std::int64_t m = a.rows, n = b.rows, k = a.cols;
  gpu::device_buffer left(a.values.size() * 4), right(b.values.size() * 4);
  left.upload(a.data(), left.bytes());
  right.upload(b.data(), right.bytes());
  gpu::device_buffer out64(static_cast<std::size_t>(m * n) * 8), out32(static_cast<std::size_t>(m * n) * 4);
  out64.fill_bytes(0xFF);
  out32.fill_bytes(0xFF);
  gpu::reference_on_device(left.as<const float>(), right.as<const float>(), m, n, k, out64.as<double>(),
                           out32.as<float>());
  gpu::synchronize();
  matrix64 got64(m, n);
  matrix got32(m, n);
  out64.download(got64.data(), out64.bytes());
  out32.download(got32.data(), out32.bytes());
  std::vector<host_reference::reference_value> expected(static_cast<std::size_t>(m * n));
  host_reference::parallel_for(m, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t i = first; i < last; ++i) {
      for (std::int64_t j = 0; j < n; ++j)
        expected[static_cast<std::size_t>(i * n + j)] = host_reference::reference_entry(a, b, i, j);
    }
  });
  for (std::int64_t e = 0; e < m * n; ++e) {
    const auto& want = expected[static_cast<std::size_t>(e)];
    if (!same(want.fp64, got64.values[static_cast<std::size_t>(e)]) ||
        !same(want.fp32, got32.values[static_cast<std::size_t>(e)])) {
      return "entry (" + std::to_string(e / n) + ", " + std::to_string(e % n) + "): expected fp64 " +
             show(want.fp64) + " fp32 " + show(want.fp32) + ", got fp64 " +
             show(got64.values[static_cast<std::size_t>(e)]) + " fp32 " +
             show(got32.values[static_cast<std::size_t>(e)]) + "; " + replay;
    }
  }
  const mxscope::reference_result api = gpu::reference_gemm(a, b);
  for (std::int64_t e = 0; e < m * n; ++e) {
    if (!same(expected[static_cast<std::size_t>(e)].fp64, api.fp64.values[static_cast<std::size_t>(e)]) ||
        !same(expected[static_cast<std::size_t>(e)].fp32, api.fp32.values[static_cast<std::size_t>(e)])) {
      return "gpu::reference_gemm entry " + std::to_string(e) + " differs; " + replay;
    }
  }
  // The bound the CPU reports for `exact`: the largest half ulp of a finite nonzero result.
  double bound = 0.0;
  for (const auto& entry : expected) {
    const double magnitude = std::fabs(entry.fp64);
    if (magnitude == 0.0 || !std::isfinite(magnitude)) continue;
    int exponent = 0;
    (void)std::frexp(magnitude, &exponent);  // magnitude in [2^(exponent-1), 2^exponent)
    bound = std::max(bound, magnitude < 0x1p-1021 ? 0x1p-1074 : std::ldexp(1.0, exponent - 1 - 53));
  }
  // The same result left in device memory.
  const mxscope::reference_result kept = gpu::reference_gemm(a, b, true);
  if (!kept.fp64.values.empty() || !kept.fp32.values.empty() || !kept.device_fp64 || !kept.device_fp32) {
    return "gpu::reference_gemm(keep_on_device): the result is not (only) in device memory; " + replay;
  }
  const matrix64 kept64 = kept.device_fp64->download64();
  const matrix kept32 = kept.device_fp32->download32();
  if (kept64.rows != m || kept64.cols != n || kept32.rows != m || kept32.cols != n) {
    return "gpu::reference_gemm(keep_on_device): wrong shape; " + replay;
  }
  for (std::int64_t e = 0; e < m * n; ++e) {
    if (!same(expected[static_cast<std::size_t>(e)].fp64, kept64.values[static_cast<std::size_t>(e)]) ||
        !same(expected[static_cast<std::size_t>(e)].fp32, kept32.values[static_cast<std::size_t>(e)])) {
      return "gpu::reference_gemm(keep_on_device) entry " + std::to_string(e) + " differs; " + replay;
    }
  }
  // Entries in a row of A or of B that holds inf or NaN are the non-finite ones.
  const auto bad_rows = [](const matrix& x) {
    std::int64_t count = 0;
    for (std::int64_t r = 0; r < x.rows; ++r) {
      bool bad = false;
      for (std::int64_t c = 0; c < x.cols; ++c) bad = bad || !std::isfinite(x(r, c));
      count += bad;
    }
    return count;
  };
  const std::int64_t bad_a = bad_rows(a), bad_b = bad_rows(b);
  const std::int64_t nonfinite = bad_a * n + bad_b * m - bad_a * bad_b;
  for (const auto& [what, got] : {std::pair{"", &api}, std::pair{" (keep_on_device)", &kept}}) {
    if (got->stats.entries != m * n || got->stats.nonfinite_entries != nonfinite ||
        got->stats.certified_entries != m * n - nonfinite) {
      return std::string("gpu::reference_gemm") + what + " stats: expected " + std::to_string(nonfinite) +
             " non-finite of " + std::to_string(m * n) + ", got " + std::to_string(got->stats.nonfinite_entries) +
             " of " + std::to_string(got->stats.entries) + "; " + replay;
    }
  }
  for (const auto& [what, got] : {std::pair{"", api.error_bound}, std::pair{" (keep_on_device)", kept.error_bound}}) {
    if (!same(bound, got)) {
      return std::string("gpu::reference_gemm") + what + " error_bound: expected " + show(bound) + " got " +
             show(got) + "; " + replay;
    }
  }
  return "";
}

// ---- The order of K in the tiled kernels (gpu::reference_token_order): the definition checked
// on keys, and the device reference on operands with a scale per position along K.

namespace {

// The exponents spanned by the groups of `length` positions of `order` (per group the largest key
// less the smallest nonzero one), as the header defines the choice.
std::int64_t spanned(const std::vector<std::int32_t>& order, const std::vector<unsigned>& keys, std::size_t length) {
  std::int64_t total = 0;
  for (std::size_t first = 0; first < order.size(); first += length) {
    std::vector<unsigned> present;
    for (std::size_t p = first; p < std::min(order.size(), first + length); ++p) {
      if (keys[static_cast<std::size_t>(order[p])] != 0) present.push_back(keys[static_cast<std::size_t>(order[p])]);
    }
    if (present.empty()) continue;
    total += *std::max_element(present.begin(), present.end()) - *std::min_element(present.begin(), present.end());
  }
  return total;
}

std::string check_token_order(const std::vector<unsigned>& a_keys, const std::vector<unsigned>& b_keys,
                              bool want_reordered, const std::string& what) {
  const std::vector<std::int32_t> order = gpu::reference_token_order(a_keys, b_keys);
  const std::size_t count = a_keys.size();
  std::vector<std::int32_t> identity(count);
  for (std::size_t p = 0; p < count; ++p) identity[p] = static_cast<std::int32_t>(p);
  const auto cost = [&](const std::vector<std::int32_t>& o) {
    return spanned(o, a_keys, 256) + spanned(o, b_keys, 256) + spanned(o, a_keys, 128) + spanned(o, b_keys, 128);
  };
  const auto groups = static_cast<std::int64_t>((count + 255) / 256 + (count + 127) / 128);
  if (order.empty()) {
    if (want_reordered) return what + ": K kept as it is";
    return "";
  }
  if (!want_reordered) return what + ": K reordered";
  if (order.size() != count) return what + ": the order has " + std::to_string(order.size()) + " positions";
  std::vector<std::int32_t> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  if (sorted != identity) return what + ": not a permutation";
  // Sorted stably by one of the two key pairs.
  const auto sorted_by = [&](const std::vector<unsigned>& first, const std::vector<unsigned>& second) {
    for (std::size_t p = 1; p < count; ++p) {
      const auto x = static_cast<std::size_t>(order[p - 1]), y = static_cast<std::size_t>(order[p]);
      if (std::tuple(first[x], second[x], x) >= std::tuple(first[y], second[y], y)) return false;
    }
    return true;
  };
  if (!sorted_by(a_keys, b_keys) && !sorted_by(b_keys, a_keys)) return what + ": not sorted by either key pair";
  if (cost(identity) - cost(order) < 2 * groups) {
    return what + ": reordered for a saving of " + std::to_string(cost(identity) - cost(order)) + " exponents";
  }
  return "";
}

// A [rows, k] of Gaussian values times scale[k], rounded to bf16.
matrix token_scaled(std::int64_t rows, const std::vector<double>& scale, std::mt19937_64& source) {
  std::normal_distribution<double> normal(0.0, 1.0);
  matrix out(rows, static_cast<std::int64_t>(scale.size()));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::size_t c = 0; c < scale.size(); ++c) {
      const auto value = static_cast<float>(normal(source) * scale[c]);
      out(r, static_cast<std::int64_t>(c)) = test_inputs::from_bf16_bits(test_inputs::to_bf16_bits(value));
    }
  }
  return out;
}

void reference_order_checks() {
  run_case("reference K order: the choice on keys", []() -> std::string {
    try {
      (void)gpu::reference_token_order({1, 2}, {1});
      return std::string("keys of different lengths accepted");
    } catch (const mxscope::input_error&) {
    }
    const std::uint64_t seed = next_seed();
    std::mt19937_64 source(seed);
    const std::string replay = "; seed " + hex64(seed);
    for (const std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{300}, std::size_t{2048}}) {
      const std::vector<unsigned> flat(count, 300U);
      const std::string what = "constant keys, K " + std::to_string(count);
      if (std::string r = check_token_order(flat, flat, false, what); !r.empty()) return r + replay;
    }
    // Keys that follow a per-token scale, one operand's wider than the other's; some columns empty.
    std::vector<unsigned> a_keys(2048), b_keys(2048);
    for (std::size_t k = 0; k < a_keys.size(); ++k) {
      a_keys[k] = 280U + static_cast<unsigned>(source() % 12);
      b_keys[k] = 250U + static_cast<unsigned>(source() % 5);
      if (k % 97 == 5) a_keys[k] = 0;
    }
    if (std::string r = check_token_order(a_keys, b_keys, true, "per-token keys"); !r.empty()) return r + replay;
    // One key apart at random, as values without a scale per token give: no reordering pays.
    for (std::size_t k = 0; k < a_keys.size(); ++k) {
      a_keys[k] = 280U + static_cast<unsigned>(source() % 2);
      b_keys[k] = 250U;
    }
    if (std::string r = check_token_order(a_keys, b_keys, false, "keys one apart"); !r.empty()) return r + replay;
    // 256 positions, 56 of them three exponents above the rest and spread over both halves: K as
    // it is spans 9 (the group of 256 and both of 128), sorted 6, a saving of 3 below the 6 asked.
    std::vector<unsigned> few(256, 300U);
    for (std::size_t k = 0; k < 56; ++k) few[k * 4 + 1] = 303U;
    const std::vector<unsigned> flat(256, 250U);
    if (std::string r = check_token_order(few, flat, false, "a saving below two a group"); !r.empty()) return r;
    // Every other position high: K as it is spans 9, sorted 3 (each half one key): a saving of 6.
    for (std::size_t k = 0; k < few.size(); ++k) few[k] = k % 2 == 1 ? 303U : 300U;
    if (std::string r = check_token_order(few, flat, true, "a saving of two a group"); !r.empty()) return r;
    return std::string();
  });
  // The device reference on operands with a scale per token: exp(N(0,1)) shared by A and B, or one
  // for each; in the second, a row of A with inf and a row of B beyond the 128-bit window take the
  // per-product kernel, which sums in K as it is.
  for (const bool shared : {true, false}) {
    const std::int64_t m = shared ? 70 : 64, n = shared ? 90 : 72, k = shared ? 1536 : 2048;
    run_case("reference K order: " + std::string(shared ? "one token scale" : "a token scale each") + " M" +
                 std::to_string(m) + " N" + std::to_string(n) + " K" + std::to_string(k),
             [&]() -> std::string {
               const std::uint64_t seed = next_seed();
               std::mt19937_64 source(seed);
               std::normal_distribution<double> normal(0.0, 1.0);
               std::vector<double> a_scale(static_cast<std::size_t>(k)), b_scale(static_cast<std::size_t>(k));
               for (std::size_t c = 0; c < a_scale.size(); ++c) {
                 a_scale[c] = std::exp(normal(source));
                 b_scale[c] = shared ? a_scale[c] : std::exp(normal(source));
               }
               matrix a = token_scaled(m, a_scale, source);
               matrix b = token_scaled(n, b_scale, source);
               if (!shared) {
                 a(3, 100) = std::numeric_limits<float>::infinity();
                 b(5, 7) = 0x1p100f;
                 b(5, 9) = 0x1p-100f;
               }
               const std::string result = check_reference(a, b, "seed " + hex64(seed));
               if (!result.empty()) return result;
               if (!gpu::last_reference_reordered()) return "K was not reordered; seed " + hex64(seed);
               return std::string();
             });
  }
  // Every column's largest value 1 (row 0): the keys are equal and K stays as it is.
  run_case("reference K order: equal keys M33 N40 K700", []() -> std::string {
    const std::uint64_t seed = next_seed();
    std::mt19937_64 source(seed);
    std::vector<double> scale(700);
    for (std::size_t c = 0; c < scale.size(); ++c) scale[c] = std::ldexp(0.25, -static_cast<int>(source() % 9));
    matrix a = token_scaled(33, scale, source);
    matrix b = token_scaled(40, scale, source);
    for (std::int64_t c = 0; c < 700; ++c) {
      for (std::int64_t r = 0; r < a.rows; ++r) a(r, c) = std::clamp(a(r, c), -0.9375f, 0.9375f);
      for (std::int64_t r = 0; r < b.rows; ++r) b(r, c) = std::clamp(b(r, c), -0.9375f, 0.9375f);
      a(0, c) = 1.0f;
      b(0, c) = -1.0f;
    }
    const std::string result = check_reference(a, b, "seed " + hex64(seed));
    if (!result.empty()) return result;
    if (gpu::last_reference_reordered()) return "K was reordered; seed " + hex64(seed);
    return std::string();
  });
}

// ---- The reference on int8 slices (gpu::reference_kernel::sliced): taken where every row is an
// integer below 2^18 times a power of two, checked against the definition and against the tiles.

// A [rows, k]: row r holds integers below 2^bits (random signs, about one in eight zero) times
// 2^lows[r % lows.size()], its first value the largest, 2^bits - 1 (the row spans exactly `bits`).
matrix narrow_rows(std::int64_t rows, std::int64_t k, int bits, const std::vector<int>& lows, std::mt19937_64& source) {
  matrix out(rows, k);
  const std::uint64_t top = (std::uint64_t{1} << bits) - 1U;
  for (std::int64_t r = 0; r < rows; ++r) {
    const int low = lows[static_cast<std::size_t>(r) % lows.size()];
    for (std::int64_t c = 0; c < k; ++c) {
      const std::uint64_t draw = source();
      const std::uint64_t magnitude = c == 0 ? top : (draw % 8U == 0U ? 0U : (draw >> 8) % (top + 1U));
      const double value = std::ldexp(static_cast<double>(magnitude), low);
      out(r, c) = static_cast<float>((draw >> 4) % 2U == 0U ? value : -value);
    }
  }
  return out;
}

// The reference of A and B under `choice`: check_reference, and the kernel that took it.
std::string check_reference_on(const matrix& a, const matrix& b, gpu::reference_kernel choice,
                               gpu::reference_kernel expected, const std::string& replay) {
  gpu::select_reference_kernel(choice);
  std::string result = check_reference(a, b, replay);
  const gpu::reference_kernel took = gpu::last_reference_kernel();
  gpu::select_reference_kernel(gpu::reference_kernel::automatic);
  if (!result.empty()) return result;
  if (took != expected) {
    return "selected " + std::string(gpu::reference_kernel_name(choice)) + ": " +
           std::string(gpu::reference_kernel_name(took)) + " ran, expected " +
           std::string(gpu::reference_kernel_name(expected)) + "; " + replay;
  }
  return "";
}

void reference_sliced_checks(bool small) {
  run_case("reference sliced: the kernels' names and availability", []() -> std::string {
    for (const auto kernel : {gpu::reference_kernel::automatic, gpu::reference_kernel::tiles}) {
      if (!gpu::reference_kernel_available(kernel)) return std::string(gpu::reference_kernel_name(kernel)) + " unavailable";
    }
    if (gpu::reference_kernel_name(gpu::reference_kernel::sliced) != "sliced" ||
        gpu::reference_kernel_name(gpu::reference_kernel::tiles) != "tiles") {
      return std::string("names differ from the header's");
    }
    return std::string();
  });
  if (!gpu::reference_kernel_available(gpu::reference_kernel::sliced)) {
    run_case("reference sliced: unavailable here, selecting it throws", []() -> std::string {
      try {
        gpu::select_reference_kernel(gpu::reference_kernel::sliced);
      } catch (const mxscope::input_error&) {
        return std::string();
      }
      gpu::select_reference_kernel(gpu::reference_kernel::automatic);
      return std::string("no error");
    });
    return;
  }
  using gpu::reference_kernel;
  struct narrow_case {
    const char* what;
    std::int64_t m, n, k;
    int a_bits, b_bits;
    std::vector<int> a_lows, b_lows;
    reference_kernel automatic;  // the kernel automatic picks
  };
  const std::vector<narrow_case> cases = {
      // Tiles and K-blocks cut short, rows of like scale: the benchmark's kind of operands.
      {"18-bit rows M70 N90 K1000", 70, 90, 1000, 18, 18, {-20, -18, -25}, {-17, -30}, reference_kernel::sliced},
      // One operand narrow, rows of every scale: the fp32 results overflow to inf (2^109 2^109)
      // and underflow to zero and to subnormals, the fp64 ones stay exact.
      {"extreme exponents M33 N40 K100", 33, 40, 100, 12, 18, {-149, -140, 0, 60, 109}, {-149, -120, 2, 109},
       reference_kernel::sliced},
      // The last row of B spans 19 bits (below): the tiles take every entry.
      {"a 19-bit row M20 N24 K64", 20, 24, 64, 18, 18, {-10}, {-12}, reference_kernel::tiles},
  };
  for (const narrow_case& c : cases) {
    run_case("reference sliced: " + std::string(c.what), [&]() -> std::string {
      const std::uint64_t seed = next_seed();
      std::mt19937_64 source(seed);
      matrix a = narrow_rows(c.m, c.k, c.a_bits, c.a_lows, source);
      matrix b = narrow_rows(c.n, c.k, c.b_bits, c.b_lows, source);
      if (c.automatic == reference_kernel::tiles) b(c.n - 1, 0) = std::ldexp(static_cast<float>((1 << 19) - 1), -12);
      // A row of zeros, and entry (1, 1) an exact cancellation: +0 in both results.
      for (std::int64_t kk = 0; kk < c.k; ++kk) a(2, kk) = 0.0f;
      for (std::int64_t kk = 0; kk + 1 < c.k; kk += 2) {
        a(1, kk + 1) = a(1, kk);
        b(1, kk + 1) = -b(1, kk);
      }
      if (c.k % 2 == 1) a(1, c.k - 1) = 0.0f;
      const std::string replay = "seed " + hex64(seed);
      for (const reference_kernel choice : {reference_kernel::automatic, reference_kernel::sliced}) {
        if (std::string r = check_reference_on(a, b, choice, c.automatic, replay); !r.empty()) return r;
      }
      return check_reference_on(a, b, reference_kernel::tiles, reference_kernel::tiles, replay);
    });
  }
  // The int32 level sums at their limit: K = 2^16 products of (2^18 - 1)^2 of one sign, sum
  // 2^16 (2^18 - 1)^2 < 2^52; one more position and the tiles take the product.
  for (const std::int64_t k : {std::int64_t{65536}, std::int64_t{65537}}) {
    if (small) continue;
    run_case("reference sliced: the largest K, M3 N2 K" + std::to_string(k), [&]() -> std::string {
      const std::uint64_t seed = next_seed();
      std::mt19937_64 source(seed);
      matrix a(3, k), b(2, k);
      const float top = static_cast<float>((1 << 18) - 1);
      for (std::int64_t kk = 0; kk < k; ++kk) {
        for (std::int64_t r = 0; r < 3; ++r) a(r, kk) = r == 0 ? top : (source() % 2U == 0U ? top : -top);
        for (std::int64_t r = 0; r < 2; ++r) b(r, kk) = r == 0 ? -top : static_cast<float>(source() % (1U << 18));
      }
      const reference_kernel expected = k <= 65536 ? reference_kernel::sliced : reference_kernel::tiles;
      return check_reference_on(a, b, reference_kernel::automatic, expected, "seed " + hex64(seed));
    });
  }
}

}  // namespace

void reference_checks(bool small) {
  reference_order_checks();
  reference_sliced_checks(small);
  struct shape {
    std::int64_t m, n, k;
  };
  const shape shapes[] = {{1, 1, 1}, {3, 5, 2}, {37, 29, 70}, {96, 80, 1000}, {256, 192, 1500}};
  int index = 0;
  for (const shape& s : shapes) {
    for (int kind = 0; kind < test_inputs::value_kind_count; ++kind) {
      ++index;
      if (small && s.m > 40) continue;
      const std::uint64_t seed = next_seed();
      matrix a = test_inputs::make_matrix(s.m, s.k, static_cast<value_kind>(kind), seed);
      matrix b = test_inputs::make_matrix(s.n, s.k, static_cast<value_kind>(kind), seed + 1);
      if (static_cast<value_kind>(kind) == value_kind::ties && s.k >= 2 && s.m >= 1 && s.n >= 1) {
        // Exact ties: 1 + 2^-24 (fp32 tie), 1 + 2^-53 (fp64 tie), and a cancellation to 2^-149.
        a(0, 0) = 1.0f;
        a(0, 1) = 0x1p-24f;
        b(0, 0) = 1.0f;
        b(0, 1) = 1.0f;
        for (std::int64_t kk = 2; kk < s.k; ++kk) a(0, kk) = 0.0f;
      }
      const std::string name = "reference exact M" + std::to_string(s.m) + " N" + std::to_string(s.n) + " K" +
                               std::to_string(s.k) + " " +
                               std::string(test_inputs::value_kind_name(static_cast<value_kind>(kind)));
      run_case(name, [&] { return check_reference(a, b, "seed " + hex64(seed)); });
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Unscaled operands (fp32, bf16 values): the tiled kernels that sum each K-chunk of 32 products in
// fp64 where that is exact, and their fallbacks, against the definitions.

struct plain_input {
  std::string name;
  matrix a, b;
};

// Inputs for every branch: bf16 chunks whose products sum exactly in fp64 (narrow); chunks too wide
// for that (wide bf16, fp32 significands) in rows that still fit the 128-bit window of an entry;
// and, mixed into one product with narrow rows, a row that does not fit that window, a row of
// zeros, one wide chunk in a narrow row, NaN and infinity (the per-product kernels).
std::vector<plain_input> plain_inputs(std::int64_t m, std::int64_t n, std::int64_t k, std::uint64_t seed) {
  std::vector<plain_input> out;
  out.push_back({"bf16 narrow", test_inputs::make_bf16_matrix(m, k, 2, seed),
                 test_inputs::make_bf16_matrix(n, k, 2, seed + 1)});
  out.push_back({"bf16 wide", test_inputs::make_bf16_matrix(m, k, 24, seed + 2),
                 test_inputs::make_bf16_matrix(n, k, 24, seed + 3)});
  out.push_back({"fp32 banded", test_inputs::make_matrix(m, k, value_kind::banded, seed + 4),
                 test_inputs::make_matrix(n, k, value_kind::banded, seed + 5)});
  // As the Llama-shaped capture: Gaussian values times a log-normal scale per token (per k).
  {
    std::mt19937_64 random(seed + 10);
    std::normal_distribution<double> normal(0.0, 1.0);
    std::vector<double> token_scale(static_cast<std::size_t>(k));
    for (double& t : token_scale) t = std::exp(normal(random));
    plain_input tokens{"bf16 per-token scale", matrix(m, k), matrix(n, k)};
    for (matrix* x : {&tokens.a, &tokens.b}) {
      for (std::int64_t r = 0; r < x->rows; ++r) {
        for (std::int64_t c = 0; c < k; ++c) {
          (*x)(r, c) = test_inputs::from_bf16_bits(test_inputs::to_bf16_bits(
              static_cast<float>(normal(random) * token_scale[static_cast<std::size_t>(c)])));
        }
      }
    }
    out.push_back(std::move(tokens));
  }
  // fp32 ties: positive n 2^e (n < 256, e < 11) times m / 2 (m < 256): the accumulators pass 2^24
  // within a chunk or two and their exact sums are multiples of 1/2, so that about one step in
  // eight lands exactly between two fp32 values.
  {
    std::mt19937_64 random(seed + 11);
    plain_input ties{"bf16 ties", matrix(m, k), matrix(n, k)};
    for (float& v : ties.a.values) v = std::ldexp(static_cast<float>(1 + random() % 255), static_cast<int>(random() % 11));
    for (float& v : ties.b.values) v = static_cast<float>(1 + random() % 255) * 0.5f;
    out.push_back(std::move(ties));
  }
  plain_input mixed{"bf16 mixed rows", test_inputs::make_bf16_matrix(m, k, 3, seed + 6),
                    test_inputs::make_bf16_matrix(n, k, 3, seed + 7)};
  if (k >= 2) {
    mixed.a(0, 0) = 0x1p100f;  // row 0 of A spans 2^-120 .. 2^100: beyond the window
    mixed.a(0, k - 1) = 0x1p-120f;
  }
  if (m >= 3) {
    for (std::int64_t c = 0; c < k; ++c) mixed.a(1, c) = 0.0f;
    mixed.a(2, k / 2) *= 0x1p40f;  // one chunk of row 2 too wide for fp64, the row within the window
  }
  if (n >= 2) mixed.b(n - 1, k / 3) = std::numeric_limits<float>::quiet_NaN();
  if (n >= 3) mixed.b(n / 2, k - 1) = -std::numeric_limits<float>::infinity();
  out.push_back(std::move(mixed));
  out.push_back({"extreme", test_inputs::make_matrix(m, k, value_kind::extreme, seed + 8),
                 test_inputs::make_matrix(n, k, value_kind::extreme, seed + 9)});
  return out;
}

// plain_product_on_device into a poisoned buffer against host_reference::plain_product_entry.
std::string check_plain_product(const plain_input& in, int block, const mxscope::accumulation_model& model,
                                mxscope::output_rounding output, const std::string& replay) {
  const std::int64_t m = in.a.rows, n = in.b.rows, k = in.a.cols;
  gpu::device_buffer left(in.a.values.size() * 4), right(in.b.values.size() * 4);
  left.upload(in.a.data(), left.bytes());
  right.upload(in.b.data(), right.bytes());
  gpu::device_buffer out(static_cast<std::size_t>(m * n) * 4);
  out.fill_bytes(0xFF);
  gpu::plain_product_on_device(left.as<const float>(), right.as<const float>(), m, n, k, block, model, output,
                               out.as<float>());
  matrix got(m, n);
  out.download(got.data(), out.bytes());
  std::vector<float> expected(static_cast<std::size_t>(m * n));
  host_reference::parallel_for(m, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t i = first; i < last; ++i) {
      for (std::int64_t j = 0; j < n; ++j) {
        expected[static_cast<std::size_t>(i * n + j)] =
            host_reference::plain_product_entry(in.a, in.b, i, j, block, model, output);
      }
    }
  });
  for (std::int64_t e = 0; e < m * n; ++e) {
    if (!same(expected[static_cast<std::size_t>(e)], got.values[static_cast<std::size_t>(e)])) {
      return "entry (" + std::to_string(e / n) + ", " + std::to_string(e % n) + "): expected " +
             show(expected[static_cast<std::size_t>(e)]) + " got " + show(got.values[static_cast<std::size_t>(e)]) +
             "; " + replay;
    }
  }
  return "";
}

// The leading and lowest set-bit exponents of the nonzero values x(row, first .. first + length - 1)
// (finite, normal fp32), and their difference, the spread the reference's budgets read.
struct exponent_range {
  int high = -100000, low = 100000;
  int spread() const { return high - low; }
};

exponent_range row_exponents(const matrix& x, std::int64_t row, std::int64_t first, std::int64_t length) {
  exponent_range out;
  for (std::int64_t c = first; c < std::min(x.cols, first + length); ++c) {
    const float v = x(row, c);
    if (v == 0.0f) continue;
    int e = 0;
    std::frexp(v, &e);
    const auto significand = static_cast<std::uint32_t>(std::ldexp(std::fabs(v), 24 - e));  // 24 bits
    out.high = std::max(out.high, e - 1);
    out.low = std::min(out.low, e - 24 + __builtin_ctz(significand));
  }
  return out;
}

namespace {

// Every model on odd shapes, K around multiples of 32, tiles cut at both edges.
void plain_sweep(bool small) {
  struct shape {
    std::int64_t m, n, k;
  };
  // Odd sizes, K below, at and past multiples of 32, tiles of 64 x 64 cut at both edges.
  const shape shapes[] = {{1, 1, 1}, {3, 5, 31}, {37, 29, 70}, {67, 65, 97}, {130, 70, 300}, {200, 150, 1030}};
  struct model_case {
    const char* name;
    int block;
    mxscope::accumulation_model model;
  };
  const model_case models[] = {
      {"fp32-block", 32, model_of(mxscope::accumulation_kind::fp32_block)},
      {"fp32-group:2", 32, model_of(mxscope::accumulation_kind::fp32_group, 2)},
      {"fp32-group:3", 32, model_of(mxscope::accumulation_kind::fp32_group, 3)},
      {"fp32-block block 64", 64, model_of(mxscope::accumulation_kind::fp32_block)},
      {"fp32-block block 16", 16, model_of(mxscope::accumulation_kind::fp32_block)},
      {"fp32-seq", 32, model_of(mxscope::accumulation_kind::fp32_seq)},
  };
  int index = 0;
  for (const shape& s : shapes) {
    if (small && s.m > 70) continue;
    const std::uint64_t seed = next_seed();
    const std::vector<plain_input> inputs = plain_inputs(s.m, s.n, s.k, seed);
    const std::string dims = " M" + std::to_string(s.m) + " N" + std::to_string(s.n) + " K" + std::to_string(s.k);
    for (const plain_input& in : inputs) {
      run_case("plain reference" + dims + " " + in.name,
               [&] { return check_reference(in.a, in.b, "seed " + hex64(seed)); });
      for (const model_case& mc : models) {
        ++index;
        const auto output = index % 4 == 0 ? mxscope::output_rounding::bf16 : mxscope::output_rounding::fp32;
        const std::string name = "plain " + std::string(mc.name) + dims + " " + in.name +
                                 (output == mxscope::output_rounding::bf16 ? " bf16 out" : "");
        if (std::string(mc.name) != "fp32-block") {
          run_case(name, [&] { return check_plain_product(in, mc.block, mc.model, output, "seed " + hex64(seed)); });
          continue;
        }
        // Blocks of 32 under fp32-block: each kernel of plain_block_kernel this build has.
        for (const gpu::plain_block_kernel kernel : {gpu::plain_block_kernel::tile, gpu::plain_block_kernel::warp}) {
          if (!gpu::plain_block_kernel_available(kernel)) continue;
          run_case(name + " " + std::string(gpu::plain_block_kernel_name(kernel)), [&]() -> std::string {
            gpu::select_plain_block_kernel(kernel);
            const std::string result = check_plain_product(in, mc.block, mc.model, output, "seed " + hex64(seed));
            gpu::select_plain_block_kernel(gpu::plain_block_kernel::automatic);
            if (gpu::last_plain_block_kernel() != kernel) {
              return std::string("ran ") + std::string(gpu::plain_block_kernel_name(gpu::last_plain_block_kernel())) +
                     ", expected " + std::string(gpu::plain_block_kernel_name(kernel));
            }
            return result;
          });
        }
      }
    }
  }
}

// The exact reference's super-chunks and the edges of its 128-bit window.
void plain_reference_edges() {
  // The exact mode's super-chunks (8 chunks of 32) and their halves (4 chunks, CUDA): rows whose
  // spread over a super-chunk or a half is too wide for one fp64 dot of 256 or 128 products but
  // whose chunks are not, beside rows that fit, several super-chunks and a partial last one.
  run_case("plain reference super-chunks M70 N67 K600", []() -> std::string {
    const std::uint64_t seed = next_seed();
    const std::int64_t m = 70, n = 67, k = 600;
    plain_input in{"super-chunks", test_inputs::make_bf16_matrix(m, k, 1, seed),
                   test_inputs::make_bf16_matrix(n, k, 1, seed + 1)};
    // Random rows: one element 2^-12 smaller in chunk 8 s + 1 of odd rows of A, in chunk 8 s + 5 of
    // odd rows of B (which paths they take depends on the draw).
    for (std::int64_t chunk = 0; 32 * chunk < k; ++chunk) {
      for (std::int64_t i = 5; i < m && chunk % 8 == 1; i += 2) in.a(i, 32 * chunk + 5) *= 0x1p-12f;
      for (std::int64_t j = 5; j < n && chunk % 8 == 5 && 32 * chunk + 9 < k; j += 2) in.b(j, 32 * chunk + 9) *= 0x1p-12f;
    }
    // Rows 2 and 3 reach each path whatever the draw: 1.5 throughout (spread 1), so entry (2, 2)
    // is fused in every super-chunk; row 3 of A has one value 2^-30 smaller in chunk 8 s + 1
    // (spread 31) and row 3 of B one 2^-14 smaller in chunk 8 s + 2 (spread 15), so that in
    // super-chunks 0 and 1 entry (3, 3) steps per chunk in the first half (31 + 15 > 44 over it,
    // at most 31 + 1 in any chunk) and keeps its dot across the second (1 + 1).
    for (std::int64_t c = 0; c < k; ++c) in.a(2, c) = in.b(2, c) = in.a(3, c) = in.b(3, c) = 1.5f;
    for (std::int64_t chunk = 0; 32 * chunk < k; ++chunk) {
      if (chunk % 8 == 1) in.a(3, 32 * chunk + 7) = 0x1.8p-30f;
      if (chunk % 8 == 2 && 32 * chunk + 11 < k) in.b(3, 32 * chunk + 11) = 0x1.8p-14f;
    }
    // Rows where a budget one bit too large would round: B row 0 is 255/128 (8 significant bits,
    // spread 7) throughout. A row 0 holds 255/128 in super-chunk 1 (k 256-511) but one value 2^-30
    // smaller (k 300: spreads 37 + 7 = 44, one past 51 - 8; 255 products of 3.97 and one of
    // 2^-30 3.97 need 54 bits), and the same values negated in super-chunk 0 without the small one,
    // so that the exact entry is that one product. Row 1 likewise within chunks: chunk 2 (k 64-95)
    // with one value 2^-33 smaller (k 70: spreads 40 + 7 = 47, one past 51 - 5; 54 bits), chunk 0
    // negated without it.
    constexpr float full = 255.0f / 128.0f;
    for (std::int64_t c = 0; c < k; ++c) {
      in.b(0, c) = full;
      in.a(0, c) = c < 256 ? -full : c < 512 ? full : 0.0f;
      in.a(1, c) = c < 32 ? -full : c >= 64 && c < 96 ? full : 0.0f;
    }
    in.a(0, 300) = full * 0x1p-30f;
    in.a(0, 300 - 256) = 0.0f;
    in.a(1, 70) = full * 0x1p-33f;
    in.a(1, 70 - 64) = 0.0f;
    // And for the halves: A row 4 holds 255/128 in the second half of super-chunk 0 (k 128-255)
    // but one value 2^-31 smaller (k 172: spreads 38 + 7 = 45, one past 51 - 7; 127 products of
    // 3.97 and one of 2^-31 3.97 need 54 bits), the first half negated without the small one.
    for (std::int64_t c = 0; c < k; ++c) in.a(4, c) = c < 128 ? -full : c < 256 ? full : 0.0f;
    in.a(4, 172) = full * 0x1p-31f;
    in.a(4, 172 - 128) = 0.0f;
    // Rows 2 and 3 must reach the three paths: fused (spreads over 256 products within 51 - 8), per
    // chunk (not, nor over the half's 128 within 51 - 7, but every chunk within 51 - 5) and fused
    // over the half.
    const auto spread = [](const matrix& x, std::int64_t row, std::int64_t first, std::int64_t length) {
      return row_exponents(x, row, first, length).spread();
    };
    bool fused = true, per_chunk = true, half_fused = true;
    for (std::int64_t super = 0; 256 * super < k; ++super) {
      fused = fused && spread(in.a, 2, 256 * super, 256) + spread(in.b, 2, 256 * super, 256) <= 43;
      if (super >= 2) continue;
      per_chunk = per_chunk && spread(in.a, 3, 256 * super, 256) + spread(in.b, 3, 256 * super, 256) > 43 &&
                  spread(in.a, 3, 256 * super, 128) + spread(in.b, 3, 256 * super, 128) > 44;
      for (std::int64_t c = 256 * super; c < 256 * super + 128; c += 32) {
        per_chunk = per_chunk && spread(in.a, 3, c, 32) + spread(in.b, 3, c, 32) <= 46;
      }
      half_fused = half_fused && spread(in.a, 3, 256 * super + 128, 128) + spread(in.b, 3, 256 * super + 128, 128) <= 44;
    }
    if (!fused || !per_chunk || !half_fused) return std::string("the input does not reach the three super-chunk paths");
    if (spread(in.a, 0, 256, 256) + spread(in.b, 0, 256, 256) != 44 || spread(in.a, 1, 64, 32) + spread(in.b, 0, 64, 32) != 47 ||
        spread(in.a, 4, 128, 128) + spread(in.b, 0, 128, 128) != 45) {
      return std::string("the budget rows do not have the spreads they are built for");
    }
    return check_reference(in.a, in.b, "seed " + hex64(seed));
  });
  // The 128-bit sums at the edges of their window (the steps' conversion of a dot into units of
  // 2^(lo_a + lo_b), done by fp64 halves on CUDA): entries (0, 0) and (1, 1) use the whole window
  // (spans 60 + 54 + 2 + depth bits = 126) with fused dots of 2^120 units in super-chunk 0 that
  // chunk 16 (per-chunk steps: super-chunk 2 spans 60 binades) cancels exactly, so the result is
  // the small rest from the window's bottom; entries (2, 2) and (3, 3) have a fused dot whose bits
  // straddle 2^64 units (high and low halves both nonzero). Each pair once positive, once negative.
  run_case("plain reference window edges M70 N67 K600", []() -> std::string {
    const std::uint64_t seed = next_seed();
    const std::int64_t m = 70, n = 67, k = 600;
    plain_input in{"window edges", test_inputs::make_bf16_matrix(m, k, 1, seed),
                   test_inputs::make_bf16_matrix(n, k, 1, seed + 1)};
    for (std::int64_t r = 0; r < 4; ++r) {
      const float s = r % 2 == 0 ? 1.0f : -1.0f;
      for (std::int64_t c = 0; c < k; ++c) {
        if (r < 2) {
          in.a(r, c) = c < 256   ? -s * 0x1.8p60f
                       : c < 512 ? s * 0x1.8p5f
                       : c < 544 ? s * 0x1.8p63f
                       : c < 576 ? -s * 0x1.4p5f
                                 : 0.0f;
          in.b(r, c) = c < 256 ? 0x1.8p30f : c < 512 ? 0x1.8p-23f : c < 544 ? 0x1.8p30f : c < 576 ? 0x1.8p-23f : 0.0f;
        } else {
          in.a(r, c) = c < 256 ? s * 0x1.000002p40f : 0x1.8p20f;
          in.b(r, c) = c < 256 ? 0x1.8p30f : 0x1.8p-10f;
        }
      }
    }
    const auto whole = [&](const matrix& x, std::int64_t row) { return row_exponents(x, row, 0, k); };
    const int depth_bits = 10;  // bit length of K = 600
    for (std::int64_t r = 0; r < 2; ++r) {
      if (whole(in.a, r).spread() + whole(in.b, r).spread() + 2 + depth_bits != 126) {
        return std::string("rows 0 and 1 do not fill the 126-bit window");
      }
      for (std::int64_t super = 0; super < 2; ++super) {
        if (row_exponents(in.a, r, 256 * super, 256).spread() + row_exponents(in.b, r, 256 * super, 256).spread() > 43) {
          return std::string("rows 0 and 1 are not fused in super-chunks 0 and 1");
        }
      }
      if (row_exponents(in.a, r, 512, 88).spread() + row_exponents(in.b, r, 512, 88).spread() <= 43 ||
          row_exponents(in.a, r, 512, 32).spread() + row_exponents(in.b, r, 512, 32).spread() > 46 ||
          row_exponents(in.a, r, 544, 32).spread() + row_exponents(in.b, r, 544, 32).spread() > 46) {
        return std::string("rows 0 and 1 do not step per chunk in super-chunk 2");
      }
    }
    for (std::int64_t r = 2; r < 4; ++r) {
      // The super-chunk 0 dot, 256 (1 + 2^-23) 2^40 1.5 2^30, in units of 2^(lo_a + lo_b):
      // bits from 2^(78 + 1 - base) down to 2^(54 - base).
      const int base = whole(in.a, r).low + whole(in.b, r).low;
      if (row_exponents(in.a, r, 0, 256).spread() + row_exponents(in.b, r, 0, 256).spread() > 43 ||
          !(54 - base < 64 && 78 - base >= 64)) {
        return std::string("rows 2 and 3 do not straddle the sums' halves");
      }
    }
    return check_reference(in.a, in.b, "seed " + hex64(seed));
  });
}

// The host functions on the same device code: emulate_plain_product, same_bits, transposed.
void plain_host_functions() {
  // The host convenience function runs the same device code.
  const std::uint64_t seed = next_seed();
  const std::vector<plain_input> inputs = plain_inputs(21, 19, 45, seed);
  run_case("plain gpu::emulate_plain_product M21 N19 K45", [&]() -> std::string {
    const auto model = model_of(mxscope::accumulation_kind::fp32_block);
    for (const plain_input& in : inputs) {
      const mxscope::product_result got = gpu::emulate_plain_product(in.a, in.b, 32, model);
      // The same from device memory, B given transposed and turned back there, the result kept.
      matrix b_transposed(in.b.cols, in.b.rows);
      for (std::int64_t i = 0; i < in.b.rows; ++i) {
        for (std::int64_t k = 0; k < in.b.cols; ++k) b_transposed(k, i) = in.b(i, k);
      }
      const gpu::device_matrix b_back = gpu::transposed(gpu::device_matrix::upload(b_transposed));
      const mxscope::product_result kept =
          gpu::emulate_plain_product(gpu::device_matrix::upload(in.a), b_back, 32, model,
                                     mxscope::output_rounding::fp32, true);
      if (!kept.device_out || !kept.out.values.empty()) return in.name + ": the kept result is not in device memory";
      const matrix kept_out = kept.device_out->download32();
      for (std::int64_t i = 0; i < in.a.rows; ++i) {
        for (std::int64_t j = 0; j < in.b.rows; ++j) {
          const float want =
              host_reference::plain_product_entry(in.a, in.b, i, j, 32, model, mxscope::output_rounding::fp32);
          if (!same(want, got.out(i, j)) || !same(want, kept_out(i, j))) {
            return in.name + " entry (" + std::to_string(i) + ", " + std::to_string(j) + "): expected " + show(want) +
                   " got " + show(got.out(i, j)) + " and from device memory " + show(kept_out(i, j)) + "; seed " +
                   hex64(seed);
          }
        }
      }
    }
    return "";
  });
  // gpu::same_bits: equal bits, one flipped bit (also -0 against +0), other shapes and types.
  run_case("plain gpu::same_bits", []() -> std::string {
    matrix values(37, 41);
    for (std::int64_t i = 0; i < values.size(); ++i) values.values[static_cast<std::size_t>(i)] = 0.25f * static_cast<float>(i % 97) - 3.0f;
    const gpu::device_matrix x = gpu::device_matrix::upload(values);
    if (!gpu::same_bits(x, gpu::device_matrix::upload(values))) return std::string("equal matrices reported different");
    matrix changed = values;
    changed.values[1234] = std::nextafter(changed.values[1234], 100.0f);
    if (gpu::same_bits(x, gpu::device_matrix::upload(changed))) return std::string("one ulp apart reported equal");
    changed = values;
    changed.values[12] = -0.0f;
    values.values[12] = 0.0f;
    if (gpu::same_bits(gpu::device_matrix::upload(values), gpu::device_matrix::upload(changed))) {
      return std::string("-0 and +0 reported equal");
    }
    if (gpu::same_bits(x, gpu::device_matrix::upload(matrix(41, 37)))) return std::string("other shape reported equal");
    matrix64 wide(37, 41);
    if (gpu::same_bits(x, gpu::device_matrix::upload(wide))) return std::string("fp64 reported equal to fp32");
    return "";
  });
  // gpu::transposed on shapes around its 32 x 32 tile.
  run_case("plain gpu::transposed", []() -> std::string {
    for (const auto& [rows, cols] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {31, 33}, {64, 7}, {100, 257}, {0, 5}}) {
      matrix values(rows, cols);
      for (std::int64_t i = 0; i < values.size(); ++i) values.values[static_cast<std::size_t>(i)] = static_cast<float>(i) + 0.5f;
      const matrix got = gpu::transposed(gpu::device_matrix::upload(values)).download32();
      if (got.rows != cols || got.cols != rows) return "shape of the transpose of " + std::to_string(rows) + "x" + std::to_string(cols);
      for (std::int64_t r = 0; r < rows; ++r) {
        for (std::int64_t c = 0; c < cols; ++c) {
          if (!same(values(r, c), got(c, r))) {
            return std::to_string(rows) + "x" + std::to_string(cols) + " element (" + std::to_string(r) + ", " +
                   std::to_string(c) + ")";
          }
        }
      }
    }
    return "";
  });
}

}  // namespace

// fp32-block's chunk budget: a chunk whose two rows' spreads add up to one past plain_chunk_budget
// (47) whose exact dot needs 54 bits, and the fp32 step it feeds sits on a tie that only the
// lowest bit breaks. Row 0 of A: 1024 at k 0 (so the accumulator is 1024 after chunk 0), then in
// chunk 1 thirty-one 255/128 and 2^-40 last (spread 40); row 0 of B: 1 at k 0, then thirty-one
// 255/128 and -2^-7 last (spread 7). The chunk's dot is M - 2^-47 with 1024 + M an fp32 midpoint
// (M = 31 (255/128)^2, 25 bits with 1024) whose even neighbour is the upper one, so the exact sum
// rounds down, while an fp64 dot of the chunk (M - 2^-47 needs 54 bits) ties to M and the step up. Row 1 of A
// is row 0 negated, row 2 has 2^-41 (spread 48, two past the budget) in place of 2^-40.
void plain_block_budget() {
  run_case("plain fp32-block chunk budget M3 N1 K64", []() -> std::string {
    const std::int64_t m = 3, n = 1, k = 64;
    constexpr float full = 255.0f / 128.0f;
    plain_input in{"budget", matrix(m, k), matrix(n, k)};
    for (std::int64_t r = 0; r < m; ++r) {
      const float sign = r == 1 ? -1.0f : 1.0f;
      in.a(r, 0) = sign * 1024.0f;
      for (std::int64_t c = 32; c < 63; ++c) in.a(r, c) = sign * full;
      in.a(r, 63) = sign * (r == 2 ? 0x1p-41f : 0x1p-40f);
    }
    in.b(0, 0) = 1.0f;
    for (std::int64_t c = 32; c < 63; ++c) in.b(0, c) = full;
    in.b(0, 63) = -0x1p-7f;
    if (row_exponents(in.a, 0, 32, 32).spread() + row_exponents(in.b, 0, 32, 32).spread() != 47) {
      return std::string("row 0 is not one past the chunk budget");
    }
    // The case is what it claims: rounding the chunk's dot to fp64 first changes the result.
    const mxscope::accumulation_model model = model_of(mxscope::accumulation_kind::fp32_block);
    const double main_part = 31.0 * static_cast<double>(full) * static_cast<double>(full);
    const float rounded_first = static_cast<float>(1024.0 + main_part);
    const float want = host_reference::plain_product_entry(in.a, in.b, 0, 0, 32, model, mxscope::output_rounding::fp32);
    if (same(want, rounded_first)) return std::string("the fp64 dot of chunk 1 would not change the result");
    for (const gpu::plain_block_kernel kernel : {gpu::plain_block_kernel::tile, gpu::plain_block_kernel::warp}) {
      if (!gpu::plain_block_kernel_available(kernel)) continue;
      gpu::select_plain_block_kernel(kernel);
      const std::string result = check_plain_product(in, 32, model, mxscope::output_rounding::fp32, "budget case");
      gpu::select_plain_block_kernel(gpu::plain_block_kernel::automatic);
      if (!result.empty()) return std::string(gpu::plain_block_kernel_name(kernel)) + ": " + result;
    }
    return std::string();
  });
}

void plain_checks(bool small) {
  plain_sweep(small);
  plain_reference_edges();
  plain_block_budget();
  plain_host_functions();
}

}  // namespace gpu_test
