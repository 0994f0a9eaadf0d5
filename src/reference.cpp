// Reference GEMMs (include/mxscope/reference.hpp): the certified exact reference, the plain fp64
// one with its a-priori bound, and their Boost.Multiprecision certification.
//
// ============================ Why the `exact` reference is exact ============================
// Notation: u = 2^-53 (unit roundoff of fp64), fl(.) = one fp64 operation rounded to nearest.
// Entry (i, j) is S = sum_k p_k with p_k = A[i,k] * B[j,k].
//
// (1) Products are exact. An fp32 value is m * 2^e with |m| < 2^24 and e >= -149, so p_k has a
//     significand below 2^48 (fits in 53 bits) and |p_k| is 0 or in [2^-298, 2^256): far inside the
//     normal fp64 range. So fl(A * B) = p_k and S is a multiple of 2^-298 below 2^320 in magnitude.
//
// (2) Error-free split on a running sum biased by a power of two. Let Kp be the padded length (K
//     rounded up to a multiple of 8; pad terms are 0) and sigma a power of two with
//     sum_k |p_k| <= sigma / 4: sigma = 4 * 2^(N_a + N_b) with ||A[i,:]||_2 <= 2^N_a and
//     ||B[j,:]||_2 <= 2^N_b (Cauchy-Schwarz), or 4 * 2^(E_a + E_b + ceil(log2 Kp)) with
//     max |A[i,:]| < 2^E_a and max |B[j,:]| < 2^E_b, whichever is smaller. (N comes from the fp64 sum
//     of the exact squares, enlarged by 1% to cover its rounding, K u <= 2^-10.) Each vector lane
//     keeps a running value tau, starting at sigma, and for each of its products computes
//         tau' = fl(tau + p_k),  q_k = fl(tau' - tau),  r_k = fl(p_k - q_k),  tau = tau'.
//     Claim: tau = sigma + (the q's so far) stays in [3 sigma / 4 - e, 5 sigma / 4 + e] with
//     e = Kp u sigma (induction, using |q_k| <= |p_k| + u sigma below). In that range fp64 spacing is
//     u sigma or 2 u sigma, so every tau is a multiple of u sigma; tau' and tau are within a factor
//     two, so tau' - tau is exact (Sterbenz): q_k is a multiple of u sigma. p_k - q_k =
//     (tau + p_k) - tau' is the rounding error of one addition, which is representable, so r_k is
//     exact, p_k = q_k + r_k, and |r_k| <= half the spacing at tau' <= u sigma.
//
// (3) The high parts are exact. At the end each lane gives tau - sigma = sum of its q's, exactly
//     (Sterbenz again). Every partial sum of these lane values is a multiple of u sigma of magnitude
//     <= sum |p_k| + Kp u sigma < sigma = 2^53 (u sigma), hence representable: H = sum_k q_k exactly.
//
// (4) The low parts sum with a known error. Each lane adds its r's sequentially into a vector
//     accumulator (depth Kp / W for W lanes), then the W lane sums are added sequentially, so L is
//     the fp64 sum of the r_k by a tree of depth d <= Kp / W + W + 1. An fp64 addition has relative
//     error at most u even in the subnormal range (a sum that lands there is exact), so
//         |L - sum r_k| <= gamma_d sum |r_k| <= 2 d u * Kp u sigma  (gamma_d = d u / (1 - d u)),
//     and the bound used is the power of two 2^(ceil(log2(2 d)) + ceil(log2(Kp)) - 106) sigma, at
//     least 2^-400: neither the bound nor sigma underflows.
//     Exact case: every product is a multiple of 2^(g_a + g_b), where 2^g_a is the lowest set bit
//     among the elements of A[i,:] (likewise g_b), and every q_k of u sigma; so every r_k and every
//     partial sum of them is a multiple of 2^g, g = min(g_a + g_b, log2(u sigma)), of magnitude at
//     most Kp u sigma. If Kp u sigma <= 2^(g + 53), every partial sum is representable, every
//     addition of L is exact, and the bound is 0 (typical for fp32 data of moderate dynamic range,
//     always for bf16/fp16-valued data at moderate K).
//
// (5) Certification. (hi, lo) = two_sum(H, L) is exact, so |S - (hi + lo)| <= bound. If the bound
//     is 0, hi + lo = S: hi = fl(H + L) is the correctly rounded fp64 value, and fp32 is the round-
//     to-odd value of hi + lo rounded to fp32, which equals S rounded to fp32 (53 >= 24 + 2, Boldo
//     and Melquiond), ties and exact zeros included. Otherwise hi = fl(hi + lo) is the candidate
//     fp64 result. With h_up = half the gap from |hi| to the next larger double
//     and h_down = half the gap to the next smaller one (h_down = h_up / 2 when |hi| is a power of
//     two), every real in the open interval (|hi| - h_down, |hi| + h_up) rounds to hi. In that
//     orientation (lo negated when hi < 0) we accept when
//         fl(lo + bound) < h_up (1 - 2^-50)   and   fl(bound - lo) < h_down (1 - 2^-50),
//     which imply the exact lo + bound < h_up and bound - lo < h_down (one rounding of relative error
//     <= u cannot cross the 2^-50 margin; a negative computed value means a negative exact one).
//     For fp32 we widen the bound to bound' = fl(bound + 2^-49 |hi|), which covers |lo| <= u |hi|
//     and the rounding of lower = fl(hi - bound') and upper = fl(hi + bound') (valid while
//     bound' <= |hi| / 2), so lower <= S <= upper. Rounding to nearest is monotone, so if
//     fp32(lower) and fp32(upper) have the same bits, every real in between (S included) rounds to
//     them. Entries with |hi| < 2^-900 (S = 0 or a cancellation below the bound) are never accepted.
//
// (6) Fallback. An entry that fails (5) is recomputed with core::long_accumulator, which adds each
//     exact product into a fixed-point register covering the whole double range and rounds once.
//     The accepted entries are the correctly rounded values by (1)-(5) and the rest by construction,
//     so the output does not depend on the vector width, the blocking or the thread count; only the
//     count of fallbacks may differ between instruction sets.
//
// The argument assumes IEEE binary64 arithmetic in round-to-nearest mode without flush-to-zero and
// without contraction into fused multiply-adds (the project compiles with -ffp-contract=off; a fused
// sigma + A * B would break (1) and (2)).
// =============================================================================================
#include "mxscope/reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include <Eigen/Core>
#include <boost/multiprecision/cpp_int.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "mxscope/compare.hpp"
#include "mxscope/core/exact_sum.hpp"
#include "mxscope/core/philox.hpp"
#include "mxscope/errors.hpp"

namespace mxscope {

std::optional<reference_kind> parse_reference_kind(std::string_view name) {
  if (name == "exact") return reference_kind::exact;
  if (name == "fp64") return reference_kind::fp64;
  return std::nullopt;
}

std::string_view reference_kind_name(reference_kind kind) {
  return kind == reference_kind::exact ? "exact" : "fp64";
}

namespace {

// Per row of an operand (step (2) of the argument): max_exponent E with max |x| < 2^E, norm_exponent
// N with ||x||_2 <= 2^N, finest_exponent g with every element a multiple of 2^g, whether the row is
// all zeros and whether it holds an inf or NaN.
struct row_profile {
  int max_exponent = 0;
  int norm_exponent = 0;
  int finest_exponent = 0;
  bool all_zero = true;
  bool nonfinite = false;
};

// The exponent of the lowest set bit of a finite nonzero fp32 value.
int lowest_bit_exponent(float value) {
  const std::uint32_t bits = core::float_bits(value);
  const int field = static_cast<int>((bits >> 23) & 0xffU);
  std::uint32_t mantissa = bits & 0x7fffffU;
  if (field == 0) return -149 + __builtin_ctz(mantissa);
  mantissa |= 0x800000U;
  return field - 150 + __builtin_ctz(mantissa);
}

std::vector<row_profile> profile_rows(const matrix& m) {
  std::vector<row_profile> profiles(static_cast<std::size_t>(m.rows));
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
  for (std::int64_t r = 0; r < m.rows; ++r) {
    const float* row = m.data() + r * m.cols;
    float largest = 0.0f;
    double squares = 0.0;  // each square is exact in fp64 (48 bits, no underflow)
    int finest = 1 << 20;
    row_profile profile;
    for (std::int64_t k = 0; k < m.cols; ++k) {
      const float value = row[k];
      if (!std::isfinite(value)) {
        profile.nonfinite = true;
        continue;
      }
      if (value == 0.0f) continue;
      largest = std::max(largest, std::fabs(value));
      squares += static_cast<double>(value) * static_cast<double>(value);
      finest = std::min(finest, lowest_bit_exponent(value));
    }
    if (largest > 0.0f) {
      profile.all_zero = false;
      profile.max_exponent = core::floor_log2(static_cast<double>(largest)) + 1;
      // The computed sum of K non-negative terms is at least (1 - gamma_K) times the exact one and
      // K u <= 2^-10, so 1.01 times it bounds ||x||^2 from above; t < 2^e gives ||x|| < 2^ceil(e/2).
      const int squares_exponent = core::floor_log2(squares * 1.01) + 1;
      profile.norm_exponent = (squares_exponent + 1) >> 1;  // ceil(e / 2), arithmetic shift
      profile.finest_exponent = finest;
    }
    profiles[static_cast<std::size_t>(r)] = profile;
  }
  return profiles;
}

int ceil_log2(std::int64_t n) {  // n >= 1
  int e = 0;
  while ((std::int64_t{1} << e) < n) ++e;
  return e;
}

void require_compatible(const matrix& a, const matrix& b) {
  if (a.cols != b.cols) {
    throw input_error("reference_gemm: A is [" + std::to_string(a.rows) + ", " + std::to_string(a.cols) + "] and B is [" +
                      std::to_string(b.rows) + ", " + std::to_string(b.cols) +
                      "]; both must hold the reduction axis as their columns (C = A B^T)");
  }
}

struct rounded_pair {
  double value64;
  float value32;
};

// Step (5) of the argument at the top of this file.
bool certify_rounding(double high, double low, double bound, rounded_pair& out) {
  const core::sum_and_error x = core::two_sum(high, low);
  const double magnitude = std::fabs(x.sum);
  if (!(magnitude >= 0x1p-900)) return false;
  const double lo = x.sum < 0.0 ? -x.error : x.error;  // orientation: away from zero is "up"
  const int exponent = core::floor_log2(magnitude);
  const double half_up = core::pow2(exponent - 53);
  const bool power_of_two = (core::double_bits(magnitude) & 0x000fffffffffffffULL) == 0;
  const double half_down = power_of_two ? core::pow2(exponent - 54) : half_up;
  constexpr double margin = 1.0 - 0x1p-50;
  if (!(lo + bound < half_up * margin)) return false;
  if (!(bound - lo < half_down * margin)) return false;

  const double widened = bound + magnitude * 0x1p-49;
  if (!(widened <= magnitude * 0.5)) return false;
  const float lower = static_cast<float>(x.sum - widened);
  const float upper = static_cast<float>(x.sum + widened);
  if (core::float_bits(lower) != core::float_bits(upper)) return false;
  out = {x.sum, lower};
  return true;
}

// Step (5) when the bound is 0: high + low is S itself. fp64 rounds it in the hardware addition;
// fp32 goes through round-to-odd so that it rounds S, not the fp64 value.
rounded_pair exact_rounding(double high, double low) {
  const core::sum_and_error x = core::two_sum(high, low);
  return {x.sum, static_cast<float>(core::round_to_odd_sum(x.sum, x.error))};
}

// Step (6): the long accumulator, exact for any finite inputs.
rounded_pair exact_entry(const float* a_row, const float* b_row, std::int64_t k_count) {
  core::long_accumulator accumulator;
  for (std::int64_t k = 0; k < k_count; ++k) accumulator.add_product(a_row[k], b_row[k]);
  return {accumulator.round_to_double(), accumulator.round_to_float()};
}

// IEEE fp64 sum in ascending k: the defined value of an entry that meets inf or NaN inputs.
double ieee_entry(const float* a_row, const float* b_row, std::int64_t k_count) {
  double sum = 0.0;
  for (std::int64_t k = 0; k < k_count; ++k) sum += static_cast<double>(a_row[k]) * static_cast<double>(b_row[k]);
  return sum;
}

// ---------------------------------------------------------------------------------------------
// The fast pass: steps (2)-(4) for a tile of `tile_rows` rows of A against one row of B, with
// `lanes` doubles per vector. Rows are zero-padded doubles of length padded_k (a multiple of lanes).

constexpr int tile_rows = 4;

typedef double double_x2 __attribute__((vector_size(16)));
typedef double double_x4 __attribute__((vector_size(32)));
typedef double double_x8 __attribute__((vector_size(64)));
template <int lanes>
struct vector_of;
template <>
struct vector_of<2> {
  using type = double_x2;
};
template <>
struct vector_of<4> {
  using type = double_x4;
};
template <>
struct vector_of<8> {
  using type = double_x8;
};

template <int lanes>
[[gnu::always_inline]] inline void split_dot_tile(const double* const* a_rows, const double* b_row,
                                                  std::int64_t padded_k, const double* sigma, double* high,
                                                  double* low) {
  using vector = typename vector_of<lanes>::type;
  vector running[tile_rows];  // sigma + the high parts so far, per lane
  vector low_v[tile_rows];
  for (int r = 0; r < tile_rows; ++r) {
    running[r] = vector{} + sigma[r];
    low_v[r] = vector{};
  }
  for (std::int64_t k = 0; k < padded_k; k += lanes) {
    vector b;
    std::memcpy(&b, b_row + k, sizeof b);
    for (int r = 0; r < tile_rows; ++r) {
      vector a;
      std::memcpy(&a, a_rows[r] + k, sizeof a);
      const vector product = a * b;                        // exact, step (1)
      const vector next = running[r] + product;            // rounds onto the u sigma grid
      const vector grid_part = next - running[r];          // q: exact (Sterbenz)
      running[r] = next;
      low_v[r] += product - grid_part;                     // r exact; the sum rounds, step (4)
    }
  }
  for (int r = 0; r < tile_rows; ++r) {
    double h = 0.0;
    double l = 0.0;
    for (int lane = 0; lane < lanes; ++lane) {
      h += running[r][lane] - sigma[r];  // exact (Sterbenz), and so is their sum, step (3)
      l += low_v[r][lane];
    }
    high[r] = h;
    low[r] = l;
  }
}

using tile_kernel = void (*)(const double* const*, const double*, std::int64_t, const double*, double*, double*);

// One instantiation per instruction set, chosen at run time. The accepted results are the correctly
// rounded values whatever the vector width (step (6)); only which entries need the fallback may differ.
void split_dot_tile_generic(const double* const* a_rows, const double* b_row, std::int64_t padded_k,
                            const double* sigma, double* high, double* low) {
  split_dot_tile<2>(a_rows, b_row, padded_k, sigma, high, low);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define MXSCOPE_REFERENCE_DISPATCH 1
[[gnu::target("avx2")]] void split_dot_tile_avx2(const double* const* a_rows, const double* b_row,
                                                  std::int64_t padded_k, const double* sigma, double* high,
                                                  double* low) {
  split_dot_tile<4>(a_rows, b_row, padded_k, sigma, high, low);
}

[[gnu::target("avx512f")]] void split_dot_tile_avx512(const double* const* a_rows, const double* b_row,
                                                       std::int64_t padded_k, const double* sigma, double* high,
                                                       double* low) {
  split_dot_tile<8>(a_rows, b_row, padded_k, sigma, high, low);
}
#endif

constexpr int padding_lanes = 8;  // K is padded to a multiple of the widest vector

struct kernel_choice {
  tile_kernel kernel;
  int lanes;  // enters the depth of the low-part sum, step (4)
};

// The widest the processor supports. MXSCOPE_REFERENCE_KERNEL=generic|avx2|avx512 asks for a
// narrower one (the tests run every variant the machine has); an unsupported request is ignored.
kernel_choice select_kernel() {
  const char* requested = std::getenv("MXSCOPE_REFERENCE_KERNEL");
  const std::string_view request = requested == nullptr ? std::string_view{} : std::string_view{requested};
#ifdef MXSCOPE_REFERENCE_DISPATCH
  const bool has_avx512 = __builtin_cpu_supports("avx512f");
  const bool has_avx2 = __builtin_cpu_supports("avx2");
  if (request == "generic") return {split_dot_tile_generic, 2};
  if (request == "avx2" && has_avx2) return {split_dot_tile_avx2, 4};
  if (has_avx512) return {split_dot_tile_avx512, 8};
  if (has_avx2) return {split_dot_tile_avx2, 4};
#endif
  return {split_dot_tile_generic, 2};
}

struct exact_setup {
  const matrix* a = nullptr;
  const matrix* b = nullptr;
  std::int64_t k_count = 0;
  std::int64_t padded_k = 0;
  std::vector<row_profile> a_rows;
  std::vector<row_profile> b_rows;
  int padded_k_exponent = 0;  // ceil(log2(Kp))
  int bound_shift = 0;        // bound = 2^bound_shift sigma, step (4)
  tile_kernel kernel = nullptr;
};

// log2 of sigma for entry (i, j), step (2): the smaller of the two upper bounds on 4 sum |p_k|,
// 4 ||a|| ||b|| (Cauchy-Schwarz) and 4 Kp max|a| max|b|.
int sigma_exponent(const exact_setup& setup, const row_profile& a, const row_profile& b) {
  return std::min(a.norm_exponent + b.norm_exponent + 2, a.max_exponent + b.max_exponent + setup.padded_k_exponent + 2);
}

// Step (4): 0 when the low-part sum is provably exact, else the a-priori bound.
double low_part_bound(const exact_setup& setup, const row_profile& a, const row_profile& b) {
  const int sigma = sigma_exponent(setup, a, b);
  // Every r_k and every partial sum of them is a multiple of 2^g, g = min(g_a + g_b, log2(u sigma)),
  // of magnitude <= Kp u sigma; when that is <= 2^(g + 53) every partial sum is representable.
  const int grid = std::min(a.finest_exponent + b.finest_exponent, sigma - 53);
  if (setup.padded_k_exponent + sigma - 53 <= grid + 53) return 0.0;
  return core::pow2(sigma + setup.bound_shift);
}

struct block_outcome {
  std::int64_t certified = 0;
  std::int64_t nonfinite = 0;
  std::vector<std::int64_t> fallback_indices;
};

void exact_block(const exact_setup& setup, std::int64_t i0, std::int64_t i1, reference_result& out,
                 block_outcome& outcome) {
  const matrix& a = *setup.a;
  const matrix& b = *setup.b;
  const std::int64_t n = b.rows;
  const std::int64_t k_count = setup.k_count;
  const std::int64_t padded_k = setup.padded_k;
  const std::int64_t block_rows = i1 - i0;
  const std::int64_t tiles = (block_rows + tile_rows - 1) / tile_rows;

  // Rows of A as zero-padded doubles; rows past i1 of the last tile read the zero row.
  std::vector<double> a_block(static_cast<std::size_t>(block_rows * padded_k), 0.0);
  for (std::int64_t r = 0; r < block_rows; ++r) {
    const float* source = a.data() + (i0 + r) * k_count;
    double* target = a_block.data() + r * padded_k;
    for (std::int64_t k = 0; k < k_count; ++k) target[k] = static_cast<double>(source[k]);
  }
  std::vector<double> zero_row(static_cast<std::size_t>(padded_k), 0.0);
  std::vector<double> b_row(static_cast<std::size_t>(padded_k), 0.0);

  for (std::int64_t j = 0; j < n; ++j) {
    const float* b_source = b.data() + j * k_count;
    const row_profile& b_profile = setup.b_rows[static_cast<std::size_t>(j)];
    for (std::int64_t k = 0; k < k_count; ++k) b_row[static_cast<std::size_t>(k)] = static_cast<double>(b_source[k]);
    for (std::int64_t tile = 0; tile < tiles; ++tile) {
      const double* rows[tile_rows];
      double sigma[tile_rows];
      double high[tile_rows];
      double low[tile_rows];
      for (int r = 0; r < tile_rows; ++r) {
        const std::int64_t local = tile * tile_rows + r;
        rows[r] = local < block_rows ? a_block.data() + local * padded_k : zero_row.data();
        sigma[r] = local < block_rows
                       ? core::pow2(sigma_exponent(setup, setup.a_rows[static_cast<std::size_t>(i0 + local)], b_profile))
                       : 1.0;
      }
      setup.kernel(rows, b_row.data(), padded_k, sigma, high, low);
      for (int r = 0; r < tile_rows; ++r) {
        const std::int64_t local = tile * tile_rows + r;
        if (local >= block_rows) break;
        const std::int64_t i = i0 + local;
        const row_profile& a_profile = setup.a_rows[static_cast<std::size_t>(i)];
        const std::int64_t flat = i * n + j;
        const float* a_source = a.data() + i * k_count;
        if (a_profile.nonfinite || b_profile.nonfinite) {
          const double value = ieee_entry(a_source, b_source, k_count);
          out.fp64.values[static_cast<std::size_t>(flat)] = value;
          out.fp32.values[static_cast<std::size_t>(flat)] = static_cast<float>(value);
          ++outcome.nonfinite;
          continue;
        }
        if (a_profile.all_zero || b_profile.all_zero) {  // every product is +-0: the exact sum is 0
          out.fp64.values[static_cast<std::size_t>(flat)] = 0.0;
          out.fp32.values[static_cast<std::size_t>(flat)] = 0.0f;
          ++outcome.certified;
          continue;
        }
        const double bound = low_part_bound(setup, a_profile, b_profile);
        rounded_pair rounded{};
        if (bound == 0.0) {
          rounded = exact_rounding(high[r], low[r]);
          ++outcome.certified;
        } else if (certify_rounding(high[r], low[r], bound, rounded)) {
          ++outcome.certified;
        } else {
          rounded = exact_entry(a_source, b_source, k_count);
          outcome.fallback_indices.push_back(flat);
        }
        out.fp64.values[static_cast<std::size_t>(flat)] = rounded.value64;
        out.fp32.values[static_cast<std::size_t>(flat)] = rounded.value32;
      }
    }
  }
  std::sort(outcome.fallback_indices.begin(), outcome.fallback_indices.end());
}

// Half an ulp of a finite fp64 value: the largest error of rounding a real to it (0 for 0).
double half_ulp(double value) {
  const double magnitude = std::fabs(value);
  if (magnitude == 0.0 || !std::isfinite(magnitude)) return 0.0;
  if (magnitude < 0x1p-1021) return core::pow2(-1074);  // 2^-1075 is not a double: round the bound up
  return core::pow2(core::floor_log2(magnitude) - 53);
}

void exact_reference(const matrix& a, const matrix& b, reference_result& out) {
  exact_setup setup;
  setup.a = &a;
  setup.b = &b;
  setup.k_count = a.cols;
  setup.padded_k = (a.cols + padding_lanes - 1) / padding_lanes * padding_lanes;
  setup.a_rows = profile_rows(a);
  setup.b_rows = profile_rows(b);
  setup.padded_k_exponent = ceil_log2(std::max<std::int64_t>(setup.padded_k, 1));
  const kernel_choice choice = select_kernel();
  setup.kernel = choice.kernel;
  out.stats.vector_lanes = choice.lanes;
  const std::int64_t depth = setup.padded_k / choice.lanes + choice.lanes + 1;
  setup.bound_shift = ceil_log2(2 * depth) + setup.padded_k_exponent - 106;

  const std::int64_t m = a.rows;
  // Rows per block: keep the block's padded doubles near 512 KiB (cache), a multiple of the tile.
  std::int64_t block_rows = setup.padded_k == 0 ? 64 : (std::int64_t{1} << 16) / std::max<std::int64_t>(setup.padded_k, 1);
  block_rows = std::clamp<std::int64_t>(block_rows / tile_rows * tile_rows, tile_rows, 64);
  const std::int64_t block_count = (m + block_rows - 1) / block_rows;
  std::vector<block_outcome> outcomes(static_cast<std::size_t>(block_count));
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1)
#endif
  for (std::int64_t block = 0; block < block_count; ++block) {
    const std::int64_t i0 = block * block_rows;
    exact_block(setup, i0, std::min(m, i0 + block_rows), out, outcomes[static_cast<std::size_t>(block)]);
  }
  for (const block_outcome& outcome : outcomes) {
    out.stats.certified_entries += outcome.certified;
    out.stats.nonfinite_entries += outcome.nonfinite;
    out.stats.fallback_indices.insert(out.stats.fallback_indices.end(), outcome.fallback_indices.begin(),
                                      outcome.fallback_indices.end());
  }
  out.stats.fallback_entries = static_cast<std::int64_t>(out.stats.fallback_indices.size());
  double largest = 0.0;
  for (const double value : out.fp64.values) largest = std::max(largest, half_ulp(value));
  out.error_bound = largest;
}

// ---------------------------------------------------------------------------------------------
// fp64: Eigen on fixed blocks of rows. Each block is one single-threaded Eigen product of fixed
// shape, so the summation order of every entry (Eigen's blocking for that shape on this machine)
// does not depend on the thread count.

using row_major64 = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using row_major32 = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

constexpr std::int64_t fp64_block_rows = 64;

template <class Body>
void for_each_row_block(std::int64_t m, Body&& body) {
  const std::int64_t block_count = (m + fp64_block_rows - 1) / fp64_block_rows;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1)
#endif
  for (std::int64_t block = 0; block < block_count; ++block) {
#ifdef _OPENMP
    omp_set_num_threads(1);  // this task's own setting: Eigen must not start a parallel product here
#endif
    const std::int64_t i0 = block * fp64_block_rows;
    body(i0, std::min(m, i0 + fp64_block_rows) - i0);
  }
}

void fp64_reference(const matrix& a, const matrix& b, reference_result& out) {
  const std::int64_t m = a.rows;
  const std::int64_t n = b.rows;
  const std::int64_t k_count = a.cols;
  const Eigen::Map<const row_major32> a_map(a.data(), m, k_count);
  const Eigen::Map<const row_major32> b_map(b.data(), n, k_count);
  row_major64 b64 = b_map.cast<double>();
  Eigen::Map<row_major64> c_map(out.fp64.data(), m, n);
  for_each_row_block(m, [&](std::int64_t i0, std::int64_t rows) {
    const row_major64 a64 = a_map.middleRows(i0, rows).cast<double>();
    c_map.middleRows(i0, rows).noalias() = a64 * b64.transpose();
  });

  // Per-entry bound: gamma_K * P with P = sum_k |A[i,k] B[j,k]|. Every product is exact and every
  // term of both Eigen sums passes through at most K roundings, so the computed Phat satisfies
  // P <= Phat / (1 - gamma_K) and |fp64 - S| <= gamma_K P <= K u / (1 - 2 K u) * Phat. The factor
  // carries a 2^-40 relative margin that covers the roundings of computing it and of the final
  // product (Phat >= 2^-298 or 0, so that product does not underflow).
  out.entry_error_bound = matrix64(m, n);
  Eigen::Map<row_major64> bound_map(out.entry_error_bound.data(), m, n);
  b64 = b64.cwiseAbs();
  for_each_row_block(m, [&](std::int64_t i0, std::int64_t rows) {
    const row_major64 a64 = a_map.middleRows(i0, rows).cast<double>().cwiseAbs();
    bound_map.middleRows(i0, rows).noalias() = a64 * b64.transpose();
  });
  const double k_u = static_cast<double>(k_count) * 0x1p-53;
  const double factor = k_u / (1.0 - 2.0 * k_u) * (1.0 + 0x1p-40);
  const std::vector<row_profile> a_rows = profile_rows(a);
  const std::vector<row_profile> b_rows = profile_rows(b);
  double largest = 0.0;
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      double& bound = out.entry_error_bound(i, j);
      if (a_rows[static_cast<std::size_t>(i)].nonfinite || b_rows[static_cast<std::size_t>(j)].nonfinite) {
        bound = std::numeric_limits<double>::infinity();
        ++out.stats.nonfinite_entries;
        continue;
      }
      bound = bound * factor;
      largest = std::max(largest, bound);
    }
  }
  out.error_bound = largest;
  for (std::int64_t flat = 0; flat < m * n; ++flat) {
    out.fp32.values[static_cast<std::size_t>(flat)] = static_cast<float>(out.fp64.values[static_cast<std::size_t>(flat)]);
  }
  out.stats.certified_entries = 0;
}

}  // namespace

reference_result reference_gemm(const matrix& a, const matrix& b, reference_kind kind) {
  require_compatible(a, b);
  if (a.cols > 0 && static_cast<double>(a.cols) * 0x1p-53 >= 0x1p-10) {
    throw input_error("reference_gemm: K = " + std::to_string(a.cols) + " is too large");
  }
  reference_result out;
  out.kind = kind;
  out.fp64 = matrix64(a.rows, b.rows);
  out.fp32 = matrix(a.rows, b.rows);
  out.stats.entries = a.rows * b.rows;
  if (kind == reference_kind::exact) exact_reference(a, b, out);
  else fp64_reference(a, b, out);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Certification with Boost.Multiprecision.

namespace {

using boost::multiprecision::cpp_int;

// Sums up to 2^46 products of magnitude below 2^554 (at the 2^-298 scale): 640 bits suffice.
using fixed_sum = boost::multiprecision::number<boost::multiprecision::cpp_int_backend<
    640, 640, boost::multiprecision::signed_magnitude, boost::multiprecision::unchecked, void>>;

constexpr int fixed_scale = -298;  // the sum is an integer times 2^-298

// An fp32 value as (signed integer significand, exponent): value = significand * 2^exponent.
void split_float(float value, std::int64_t& significand, int& exponent) {
  const std::uint32_t bits = core::float_bits(value);
  const std::int64_t field = (bits >> 23) & 0xff;
  std::int64_t mantissa = bits & 0x7fffff;
  if (field == 0) exponent = -149;
  else {
    mantissa |= 0x800000;
    exponent = static_cast<int>(field) - 150;
  }
  significand = (bits >> 31) != 0 ? -mantissa : mantissa;
}

// An fp64 value (finite) as an integer at the 2^-1074 scale.
cpp_int double_at_finest_scale(double value) {
  const std::uint64_t bits = core::double_bits(value);
  const int field = static_cast<int>((bits >> 52) & 0x7ff);
  std::uint64_t mantissa = bits & 0x000fffffffffffffULL;
  int exponent = -1074;
  if (field != 0) {
    mantissa |= 0x0010000000000000ULL;
    exponent = field - 1075;
  }
  cpp_int result = cpp_int(mantissa) << (exponent + 1074);
  return (bits >> 63) != 0 ? cpp_int(-result) : result;
}

// value * 2^scale rounded to nearest-even in a binary format with `precision` significand bits,
// smallest exponent min_exponent (of the last bit of a subnormal) and largest max_exponent.
double round_scaled(const cpp_int& value, int scale, int precision, int min_exponent, int max_exponent) {
  if (value == 0) return 0.0;
  const bool negative = value < 0;
  const cpp_int magnitude = negative ? cpp_int(-value) : value;
  const int leading = static_cast<int>(boost::multiprecision::msb(magnitude)) + scale;
  const int unit = std::max(leading - precision + 1, min_exponent);
  const int shift = unit - scale;  // bits below the kept part
  cpp_int kept;
  if (shift <= 0) {
    kept = magnitude << -shift;
  } else {
    kept = magnitude >> shift;
    const bool round_bit = boost::multiprecision::bit_test(magnitude, static_cast<unsigned>(shift - 1));
    const bool sticky = shift >= 2 && (magnitude & ((cpp_int(1) << (shift - 1)) - 1)) != 0;
    if (round_bit && (sticky || boost::multiprecision::bit_test(kept, 0))) ++kept;
  }
  double result = std::ldexp(kept.convert_to<double>(), unit);  // kept < 2^(precision + 1): exact
  if (leading > max_exponent || result >= std::ldexp(1.0, max_exponent + 1)) result = std::numeric_limits<double>::infinity();
  return negative ? -result : result;
}

}  // namespace

certification certify(const matrix& a, const matrix& b, const reference_result& result, std::int64_t entry_count,
                      std::uint64_t seed) {
  require_compatible(a, b);
  const std::int64_t m = a.rows;
  const std::int64_t n = b.rows;
  const std::int64_t k_count = a.cols;
  if (result.fp64.rows != m || result.fp64.cols != n || result.fp32.rows != m || result.fp32.cols != n) {
    throw input_error("certify: the result's shape does not match A [" + std::to_string(m) + ", K] B^T [K, " +
                      std::to_string(n) + "]");
  }
  certification report;
  const std::int64_t total = m * n;
  if (total == 0 || entry_count <= 0) return report;
  const bool every_entry = entry_count >= total;
  const std::int64_t draws = every_entry ? total : entry_count;
  const core::random_stream stream{seed, 0, 0x63657274U};  // tag "cert"
  std::uint64_t worst_ulp = 0;
  bool have_worst = false;

  for (std::int64_t draw = 0; draw < draws; ++draw) {
    std::int64_t flat = draw;
    if (!every_entry) {
      const std::uint64_t word = static_cast<std::uint64_t>(stream.word(2 * static_cast<std::uint64_t>(draw))) |
                                 (static_cast<std::uint64_t>(stream.word(2 * static_cast<std::uint64_t>(draw) + 1)) << 32);
      flat = static_cast<std::int64_t>(word % static_cast<std::uint64_t>(total));
    }
    const std::int64_t i = flat / n;
    const std::int64_t j = flat % n;
    const float* a_row = a.data() + i * k_count;
    const float* b_row = b.data() + j * k_count;

    fixed_sum sum = 0;
    bool finite = true;
    for (std::int64_t k = 0; k < k_count && finite; ++k) {
      if (!std::isfinite(a_row[k]) || !std::isfinite(b_row[k])) {
        finite = false;
        break;
      }
      std::int64_t significand_a = 0;
      std::int64_t significand_b = 0;
      int exponent_a = 0;
      int exponent_b = 0;
      split_float(a_row[k], significand_a, exponent_a);
      split_float(b_row[k], significand_b, exponent_b);
      fixed_sum term = significand_a * significand_b;  // below 2^48 in magnitude
      term <<= (exponent_a + exponent_b - fixed_scale);
      sum += term;
    }
    if (!finite) continue;
    ++report.entries_checked;

    const cpp_int exact(sum);
    const double exact64 = round_scaled(exact, fixed_scale, 53, -1074, 1023);
    const float exact32 = static_cast<float>(round_scaled(exact, fixed_scale, 24, -149, 127));
    const double got64 = result.fp64.values[static_cast<std::size_t>(flat)];
    const float got32 = result.fp32.values[static_cast<std::size_t>(flat)];
    const std::uint64_t ulp64 = std::isnan(got64) ? std::numeric_limits<std::uint64_t>::max() : ulp_distance(got64, exact64);
    const std::uint64_t ulp32 = std::isnan(got32) ? std::numeric_limits<std::uint64_t>::max() : ulp_distance(got32, exact32);
    report.max_ulp_fp32 = std::max(report.max_ulp_fp32, ulp32);
    if (!have_worst || ulp64 > worst_ulp) {
      worst_ulp = ulp64;
      have_worst = true;
      report.worst_row = i;
      report.worst_col = j;
    }
    report.max_ulp_fp64 = std::max(report.max_ulp_fp64, ulp64);

    // Absolute error |got - S| and the bound check, exactly at the 2^-1074 scale.
    double error = std::numeric_limits<double>::infinity();
    cpp_int difference;
    if (std::isfinite(got64)) {
      difference = double_at_finest_scale(got64) - (exact << (fixed_scale + 1074));
      if (difference < 0) difference = -difference;
      error = round_scaled(difference, -1074, 53, -1074, 1023);
    }
    report.max_abs_error = std::max(report.max_abs_error, error);
    if (result.kind == reference_kind::fp64 && result.entry_error_bound.size() == total) {
      const double bound = result.entry_error_bound.values[static_cast<std::size_t>(flat)];
      const bool violated = !std::isfinite(got64) || (std::isfinite(bound) && difference > double_at_finest_scale(bound));
      if (violated) ++report.bound_violations;
      if (error > 0.0) report.max_bound_ratio = std::max(report.max_bound_ratio, bound > 0.0 ? error / bound : std::numeric_limits<double>::infinity());
    }
  }
  report.passed = result.kind == reference_kind::exact ? (report.max_ulp_fp64 == 0 && report.max_ulp_fp32 == 0)
                                                       : report.bound_violations == 0;
  return report;
}

}  // namespace mxscope
