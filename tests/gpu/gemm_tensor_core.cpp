// GPU test suites: every tensor-core kernel of the fp32-block model (mma_sync, wgmma, wgmma_bf16,
// wgmma_fp8) selected in turn, its tiles and scaled operand forms against the host definition; a large Wgrad on
// every path.
#include "support.hpp"
#include "gemm_support.hpp"

namespace gpu_test {

// Runs body(suffix, kernel) once per tensor-core kernel of the fp32-block model that this build and
// device have (mma_sync everywhere the path exists; wgmma, wgmma_bf16 and wgmma_fp8 on sm_90 with
// an sm_90a build), with that kernel selected; the suffix names it. Leaves the automatic choice selected.
template <class Body>
void for_each_tensor_core_kernel(Body&& body) {
  for (const gpu::tensor_core_kernel kernel :
       {gpu::tensor_core_kernel::mma_sync, gpu::tensor_core_kernel::wgmma, gpu::tensor_core_kernel::wgmma_bf16,
        gpu::tensor_core_kernel::wgmma_fp8}) {
    if (!gpu::tensor_core_kernel_available(kernel)) continue;
    gpu::select_tensor_core_kernel(kernel);
    body(" [" + std::string(gpu::tensor_core_kernel_name(kernel)) + "]", kernel);
  }
  gpu::select_tensor_core_kernel(gpu::tensor_core_kernel::automatic);
}

// A 32-element block of an operand (canonical row, K-block b) as the scaled kernels' conditions see
// it: a NaN block, one holding a nonzero element, and its exponent.
struct block_facts {
  bool nan = false;
  bool nonzero = false;
  int exponent = 0;
};
block_facts facts_of(const host_reference::operand_reader& x, std::int64_t row, std::int64_t b) {
  block_facts facts;
  const std::uint8_t code = x.scale(row, 32 * b);
  facts.nan = code == core::scale_nan_code;
  facts.exponent = facts.nan ? 0 : core::scale_exponent(code);
  for (std::int64_t k = 32 * b; k < std::min<std::int64_t>(32 * b + 32, x.depth); ++k) {
    facts.nonzero = facts.nonzero || core::decode(x.q->options.format.element, x.code(row, k)) != 0.0;
  }
  return facts;
}

// Whether the wgmma_bf16 kernel should run a product of these operands (include/mxscope/gpu.hpp),
// from the host quantizer's codes and scales: MXFP4 on both sides, no NaN block, and over the
// blocks with a nonzero element, exponents in [-125, 125] whose lowest add up to at least -124 and
// highest to at most 117.
bool scaled_kernel_expected(const mxscope::quantized_tensor& qa, const mxscope::quantized_tensor& qb) {
  if (qa.options.format.element != core::element_kind::fp4_e2m1 ||
      qb.options.format.element != core::element_kind::fp4_e2m1) {
    return false;
  }
  struct span {
    int lowest = 1000, highest = -1000;
    bool nan = false;
  };
  const auto span_of = [](const mxscope::quantized_tensor& q) {
    const host_reference::operand_reader x(q);
    span out;
    for (std::int64_t row = 0; row < x.rows; ++row) {
      for (std::int64_t b = 0; 32 * b < x.depth; ++b) {
        const block_facts block = facts_of(x, row, b);
        out.nan = out.nan || block.nan;
        if (block.nan || !block.nonzero) continue;
        out.lowest = std::min(out.lowest, block.exponent);
        out.highest = std::max(out.highest, block.exponent);
      }
    }
    return out;
  };
  const span a = span_of(qa), b = span_of(qb);
  if (a.nan || b.nan) return false;
  for (const span& x : {a, b}) {
    if (x.lowest <= x.highest && (x.lowest < -125 || x.highest > 125)) return false;
  }
  if (a.lowest > a.highest || b.lowest > b.highest) return true;
  return a.lowest + b.lowest >= -124 && a.highest + b.highest <= 117;
}

// Whether no 128-row tile of the operand spans more than 28 exponents over its blocks with a nonzero
// element in any K-block (wgmma_fp8's condition on each operand, on top of wgmma_bf16's).
bool tiles_within_fp8_window(const mxscope::quantized_tensor& q) {
  const host_reference::operand_reader x(q);
  for (std::int64_t tile = 0; tile < x.rows; tile += 128) {
    for (std::int64_t b = 0; 32 * b < x.depth; ++b) {
      int lowest = 1000, highest = -1000;
      for (std::int64_t row = tile; row < std::min<std::int64_t>(tile + 128, x.rows); ++row) {
        const block_facts block = facts_of(x, row, b);
        if (block.nan || !block.nonzero) continue;
        lowest = std::min(lowest, block.exponent);
        highest = std::max(highest, block.exponent);
      }
      if (highest - lowest > 28) return false;
    }
  }
  return true;
}

// "" when the kernel that ran the last product is the one `selected` should have run for qa, qb.
std::string check_kernel_ran(gpu::tensor_core_kernel selected, const mxscope::quantized_tensor& qa,
                             const mxscope::quantized_tensor& qb) {
  gpu::tensor_core_kernel expected = selected;
  if (selected == gpu::tensor_core_kernel::wgmma_fp8 &&
      !(scaled_kernel_expected(qa, qb) && tiles_within_fp8_window(qa) && tiles_within_fp8_window(qb))) {
    expected = gpu::tensor_core_kernel::wgmma_bf16;
  }
  if (expected == gpu::tensor_core_kernel::wgmma_bf16 && !scaled_kernel_expected(qa, qb)) {
    expected = gpu::tensor_core_kernel::mma_sync;
  }
  const gpu::tensor_core_kernel ran = gpu::last_tensor_core_kernel();
  if (ran == expected) return "";
  return "kernel " + std::string(gpu::tensor_core_kernel_name(ran)) + " ran, expected " +
         std::string(gpu::tensor_core_kernel_name(expected));
}

// The tensor-core fp32-block kernels' tiles (mma_sync: 128 x 256 entries of C per thread block,
// wgmma: 128 x 128; both launched in groups of 8 row tiles; block scales checked per 128-row
// tile): partial tiles in M, N and K, a partial group, and operands whose tiles take the fast step
// in some K-blocks and the general step in others. In "mixed" operands some blocks have exponents outside the fast range (tiny and
// huge blocks) and one holds a NaN, each confined to one tile and one K-block; in "far" operands
// every block is in the fast range but the products overflow or fall into the fp32 subnormals.
// Every entry against the host definition.
void gemm_tensor_core_tiles(bool small) {
  struct tile_case {
    int a_format, b_format;
    std::int64_t m, n, k;
    int layout;
    bool in_small_set;
  };
  const tile_case cases[] = {{0, 0, 150, 270, 100, 0, true},
                             {1, 1, 129, 257, 64, 1, false},
                             {5, 5, 131, 300, 40, 2, false},
                             {0, 5, 260, 130, 130, 0, true},
                             {0, 0, 1030, 300, 40, 1, false},   // two groups of row tiles in the launch order
                             {0, 0, 140, 70, 32 * 18 + 5, 2, true}};  // 19 K-blocks: more stages than the pipelines hold
  const auto model = model_of(mxscope::accumulation_kind::fp32_block);
  const auto exact_model = model_of(mxscope::accumulation_kind::exact);
  for (const tile_case& c : cases) {
    if (small && !c.in_small_set) continue;
    if (!gpu::gemm_path_covers(gpu::gemm_path::tensor_core, format_kinds[c.a_format], format_kinds[c.b_format], 32,
                               model)) {
      continue;
    }
    const gemm_layout_case& layout = gemm_layouts[c.layout];
    for (const char* pattern :
         {"banded", "mixed", "far", "edges", "edges outside", "window", "window outside", "full blocks", "spans 30",
          "spans 31"}) {
      const bool mixed = std::string(pattern) == "mixed";
      const bool far = std::string(pattern) == "far";
      const bool edges = std::string(pattern).rfind("edges", 0) == 0;
      const bool window = std::string(pattern).rfind("window", 0) == 0;
      const bool full = std::string(pattern) == "full blocks";
      const bool spans = std::string(pattern).rfind("spans", 0) == 0;
      if ((edges || window || full || spans) && (c.a_format != 0 || c.b_format != 0)) continue;
      const std::uint64_t seed = next_seed();
      // Logical A [m, k] and B [n, k], then stored along their layout's axes.
      matrix a = test_inputs::make_matrix(c.m, c.k, value_kind::banded, seed);
      matrix b = test_inputs::make_matrix(c.n, c.k, value_kind::banded, seed + 1);
      if (mixed) {
        const auto scale_block = [](matrix& x, std::int64_t row, std::int64_t k_block, int exponent) {
          for (std::int64_t k = 32 * k_block; k < std::min<std::int64_t>(32 * (k_block + 1), x.cols); ++k) {
            x(row, k) = static_cast<float>(std::ldexp(static_cast<double>(x(row, k)), exponent));
          }
        };
        scale_block(a, c.m - 1, 0, -140);        // the last A tile, K-block 0: a tiny block
        scale_block(a, 5, (c.k - 1) / 32, 118);  // the first A tile, the last K-block: a huge block
        scale_block(b, c.n - 2, 1 % ((c.k + 31) / 32), -135);
        scale_block(b, std::min<std::int64_t>(c.n - 1, 130), 0, 121);  // the second half of the first B tile
        a(std::min<std::int64_t>(c.m - 1, 140), std::min<std::int64_t>(c.k - 1, 40)) =
            std::numeric_limits<float>::quiet_NaN();  // a NaN block
      }
      if (far) {
        // Every block inside the fast range, their products not: entries that overflow to inf
        // (2^95 * 2^40) and entries in the fp32 subnormal range (2^-95 * 2^-40).
        for (std::int64_t r = 0; r < a.rows; ++r) {
          const int exponent = r % 2 == 0 ? 95 : -95;
          for (std::int64_t q = 0; q < a.cols; ++q) a(r, q) = std::ldexp(a(r, q), exponent);
        }
        for (std::int64_t r = 0; r < b.rows; ++r) {
          const int exponent = r % 3 == 0 ? 40 : (r % 3 == 1 ? -40 : 0);
          for (std::int64_t q = 0; q < b.cols; ++q) b(r, q) = std::ldexp(b(r, q), exponent);
        }
      }
      const auto pin = [](matrix& x, int even_exponent, int odd_exponent) {
        for (std::int64_t r = 0; r < x.rows; ++r) {
          const int exponent = r % 2 == 0 ? even_exponent : odd_exponent;
          for (std::int64_t q = 0; q < x.cols; ++q) {
            const float v = q % 32 == 0 ? 6.0f : std::clamp(x(r, q), -5.9f, 5.9f);
            x(r, q) = std::ldexp(v, exponent);
          }
        }
      };
      if (window) {
        // The wgmma_fp8 kernel's window: rows alternating between two block exponents 28 apart
        // (A at -20 and 8, B at -5 and 23), so each tile's elements take every e5m2 exponent from
        // the least subnormal up; "window outside" puts A's 29 apart (wgmma_bf16 runs instead).
        pin(a, -20, std::string(pattern) == "window outside" ? 9 : 8);
        pin(b, -5, 23);
      }
      if (spans) {
        // Rows whose block exponents take two values along K, 16 apart in A and 14 or 15 in B (each
        // row's own base 0 to 2 lower), so that every tile's spans add up to 30 or 31: the exact
        // model's window tiles at the edge of its integer sums (exact_wgmma_kernel: 30 the
        // largest shift they take, 31 left to its fp64 sums).
        const int b_high = std::string(pattern) == "spans 30" ? 14 : 15;
        const auto spread = [](matrix& x, int high) {
          for (std::int64_t r = 0; r < x.rows; ++r) {
            for (std::int64_t q = 0; q < x.cols; ++q) {
              const int exponent = ((q / 32) % 2 == 1 ? high : 0) - static_cast<int>(r % 3);
              x(r, q) = std::ldexp(q % 32 == 0 ? 6.0f : std::clamp(x(r, q), -5.9f, 5.9f), exponent);
            }
          }
        };
        spread(a, 16);
        spread(b, b_high);
      }
      if (full) {
        // Block dots with the most significant bits: 31 products 6 x 6 and one 0.5 x 0.5 (1116.25,
        // thirteen bits), or two 0.5 x 6 where the 0.5 elements sit apart; B's odd rows negative.
        for (std::int64_t r = 0; r < a.rows; ++r) {
          for (std::int64_t q = 0; q < a.cols; ++q) a(r, q) = q % 32 == r % 32 ? 0.5f : 6.0f;
        }
        for (std::int64_t r = 0; r < b.rows; ++r) {
          for (std::int64_t q = 0; q < b.cols; ++q) b(r, q) = (q % 32 == r % 32 ? 0.5f : 6.0f) * (r % 2 == 0 ? 1 : -1);
        }
      }
      if (edges) {
        // The limits of the wgmma_bf16 kernel's range: every block's largest element 6 2^e, rows of
        // A at e = -125 and 60, rows of B at 1 and 57 (lowest sum -124, highest 117: inside, with
        // block dots from 2^-126 up to 1152 2^117 and entries that overflow), or, for "edges
        // outside", B at 0 and 57 (lowest sum -125: outside, so mma_sync runs instead).
        const bool outside = std::string(pattern) == "edges outside";
        pin(a, -125, 60);
        pin(b, outside ? 0 : 1, 57);
      }
      const auto transpose = [](const matrix& x) {
        matrix t(x.cols, x.rows);
        for (std::int64_t r = 0; r < x.rows; ++r) {
          for (std::int64_t q = 0; q < x.cols; ++q) t(q, r) = x(r, q);
        }
        return t;
      };
      const auto a_options =
          mx_options(c.a_format, 32, layout.a_axis, core::rounding_mode::rne, core::scale_rule::floor, 32, seed + 2);
      const auto b_options =
          mx_options(c.b_format, 32, layout.b_axis, core::rounding_mode::rne, core::scale_rule::floor, 32, seed + 3);
      const auto qa = host_reference::quantize_mx(layout.a_axis == 1 ? a : transpose(a), a_options);
      const auto qb = host_reference::quantize_mx(layout.b_axis == 1 ? b : transpose(b), b_options);
      const auto output = c.m % 2 == 1 ? mxscope::output_rounding::bf16 : mxscope::output_rounding::fp32;
      const std::string name = std::string("gemm tensor-core tiles ") + layout.name + " " + format_names[c.a_format] +
                               "x" + format_names[c.b_format] + " fp32-block M" + std::to_string(c.m) + " N" +
                               std::to_string(c.n) + " K" + std::to_string(c.k) + " " + pattern +
                               (output == mxscope::output_rounding::bf16 ? " bf16 output" : "");
      for_each_tensor_core_kernel([&](const std::string& kernel, gpu::tensor_core_kernel selected) {
        run_case(name + kernel, [&] {
          const gemm_output got = gpu_product(qa, qb, model, output, gpu::gemm_path::tensor_core);
          const std::string ran = check_kernel_ran(selected, qa, qb);
          if (!ran.empty()) return ran;
          return check_product_entries(qa, qb, model, output, got, {}, name + kernel + ", seed " + hex64(seed));
        });
      });
      // The exact model on the same operands, on each exact kernel available: tiles whose rows'
      // block exponents stay in a window take the check-free FMA step, the tiles holding the mixed
      // pattern's extreme and NaN blocks the checked one (and its fix-up).
      for (const gpu::exact_product_kernel kernel : {gpu::exact_product_kernel::mma_sync, gpu::exact_product_kernel::wgmma}) {
        if (!gpu::exact_product_kernel_available(kernel)) continue;  // wgmma: sm_90a builds on sm_90
        const std::string exact_name =
            name + " (exact model" + (kernel == gpu::exact_product_kernel::wgmma ? ", wgmma)" : ")");
        run_case(exact_name, [&]() -> std::string {
          gpu::select_exact_product_kernel(kernel);
          const gemm_output got = gpu_product(qa, qb, exact_model, output, gpu::gemm_path::tensor_core);
          gpu::select_exact_product_kernel(gpu::exact_product_kernel::automatic);
          if (gpu::last_exact_product_kernel() != kernel) {
            return "ran " + std::string(gpu::exact_product_kernel_name(gpu::last_exact_product_kernel()));
          }
          return check_product_entries(qa, qb, exact_model, output, got, {}, exact_name + ", seed " + hex64(seed));
        });
      }
    }
  }
}

// The scaled kernels' operand forms (gpu::scaled_forms) against the same tiles built here from the
// host quantizer's codes and scales: every element of both forms (padding included), every base
// exponent, and the range flags. Runs wherever the forms are made: on the GPU with the scaled
// kernels, and in the CPU simulation (so CI checks the layout, the e5m2 encoding and the bases).
void gemm_scaled_forms(bool small) {
  struct form_case {
    std::int64_t rows, k;
    int axis;
    const char* pattern;
    bool in_small_set;
  };
  const form_case cases[] = {{130, 200, 1, "banded", true},       {257, 100, 0, "window", true},
                             {70, 330, 1, "extreme", true},       {129, 64, 1, "nonfinite", false},
                             {3, 31, 0, "window outside", true},  {300, 450, 1, "window", false}};
  // e5m2 code of each exactly representable value (the finite codes; +0 for zero).
  std::map<double, std::uint8_t> e5m2_codes;
  for (int c = 0; c < 256; ++c) {
    const int biased = (c >> 2) & 31;
    if (biased == 31 || c == 0x80) continue;
    const double magnitude =
        biased == 0 ? (c & 3) * std::ldexp(1.0, -16) : (1.0 + (c & 3) / 4.0) * std::ldexp(1.0, biased - 15);
    e5m2_codes[(c & 0x80) != 0 ? -magnitude : magnitude] = static_cast<std::uint8_t>(c);
  }
  for (const form_case& c : cases) {
    if (small && !c.in_small_set) continue;
    const std::uint64_t seed = next_seed();
    const std::string pattern = c.pattern;
    const bool window = pattern.rfind("window", 0) == 0;
    matrix x = test_inputs::make_matrix(c.rows, c.k,
                                        pattern == "extreme"     ? value_kind::extreme
                                        : pattern == "nonfinite" ? value_kind::nonfinite
                                                                 : value_kind::banded,
                                        seed);
    if (window) {  // rows alternating between block exponents -20 and 8 (9 outside: 29 apart)
      for (std::int64_t r = 0; r < x.rows; ++r) {
        const int exponent = r % 2 == 0 ? -20 : (pattern == "window outside" ? 9 : 8);
        for (std::int64_t q = 0; q < x.cols; ++q) {
          x(r, q) = std::ldexp(q % 32 == 0 ? 6.0f : std::clamp(x(r, q), -5.9f, 5.9f), exponent);
        }
      }
    }
    matrix stored = x;
    if (c.axis == 0) {
      stored = matrix(x.cols, x.rows);
      for (std::int64_t r = 0; r < x.rows; ++r) {
        for (std::int64_t q = 0; q < x.cols; ++q) stored(q, r) = x(r, q);
      }
    }
    const auto options = mx_options(0, 32, c.axis, core::rounding_mode::rne, core::scale_rule::floor, 32, seed + 1);
    const auto quantized = host_reference::quantize_mx(stored, options);
    const std::string name = "gemm scaled operand forms mxfp4 " + pattern + " rows " + std::to_string(c.rows) + " K " +
                             std::to_string(c.k) + " axis " + std::to_string(c.axis);
    run_case(name, [&]() -> std::string {
      const device_operand operand = upload_operand(quantized);
      const gpu::prepared_operand prepared = gpu::prepare_operand(operand.view, gpu::gemm_path::tensor_core);
      const gpu::scaled_operand_forms forms = gpu::scaled_forms(prepared);
      if (!forms.made) return "the forms were not made";
      const host_reference::operand_reader reader(quantized);
      const std::int64_t rows = reader.rows, depth = reader.depth, blocks = (depth + 31) / 32;
      const std::int64_t tiles = (rows + 255) / 256 * 2, bf16_chunks = (blocks + 1) / 2, k_tiles = (blocks + 3) / 4;
      std::vector<std::uint16_t> bf16(static_cast<std::size_t>(tiles * bf16_chunks * 8192), 0);
      std::vector<std::uint8_t> fp8(static_cast<std::size_t>(tiles * k_tiles * 16384), 0);
      std::vector<std::int32_t> bases(static_cast<std::size_t>(tiles * k_tiles * 4), 0);
      int lowest = 1000, highest = -1000;
      bool nan_block = false, fits = true;
      // Per tile and K-block: the base.
      for (std::int64_t tile = 0; tile * 128 < rows; ++tile) {
        for (std::int64_t b = 0; b < blocks; ++b) {
          int lo = 1000, hi = -1000;
          for (std::int64_t row = 128 * tile; row < std::min(rows, 128 * tile + 128); ++row) {
            const block_facts block = facts_of(reader, row, b);
            if (block.nan) {
              nan_block = true;
              fits = false;
            } else if (block.nonzero) {
              lo = std::min(lo, block.exponent);
              hi = std::max(hi, block.exponent);
            }
          }
          if (lo <= hi) {
            fits = fits && hi - lo <= 28;
            bases[static_cast<std::size_t>((tile * k_tiles + b / 4) * 4 + b % 4)] =
                std::min(std::max(0, hi - 13), lo + 15);
            lowest = std::min(lowest, lo);
            highest = std::max(highest, hi);
          }
        }
      }
      for (std::int64_t row = 0; row < rows; ++row) {
        const std::int64_t tile = row / 128, r = row % 128;
        for (std::int64_t k = 0; k < depth; ++k) {
          const std::int64_t b = k / 32;
          const double v = core::decode(core::element_kind::fp4_e2m1, reader.code(row, k));
          const std::uint8_t scale = reader.scale(row, k);
          if (scale == core::scale_nan_code || v == 0.0) continue;
          const int e = core::scale_exponent(scale);
          if (e >= -125 && e <= 125) {
            const float value = static_cast<float>(std::ldexp(v, e));
            std::uint32_t bits;
            std::memcpy(&bits, &value, 4);
            const std::int64_t chunk = (k % 64) / 8;
            const std::int64_t byte = (tile * bf16_chunks + k / 64) * 16384 + r * 128 + ((chunk ^ (r & 7)) << 4);
            bf16[static_cast<std::size_t>(byte / 2 + k % 8)] = static_cast<std::uint16_t>(bits >> 16);
          }
          const int shift = e - bases[static_cast<std::size_t>((tile * k_tiles + b / 4) * 4 + b % 4)];
          if (shift >= -15 && shift <= 13) {
            const auto found = e5m2_codes.find(std::ldexp(v, shift));
            if (found == e5m2_codes.end()) {
              return "element (" + std::to_string(row) + ", " + std::to_string(k) + ") " +
                     show(std::ldexp(v, shift)) + " is no e5m2 number";
            }
            const std::int64_t chunk = (k % 128) / 16;
            const std::int64_t byte = (tile * k_tiles + k / 128) * 16384 + r * 128 + ((chunk ^ (r & 7)) << 4);
            fp8[static_cast<std::size_t>(byte + k % 16)] = found->second;
          }
        }
      }
      const std::string where = ", seed " + hex64(seed);
      if (forms.bf16.size() != bf16.size() || forms.fp8.size() != fp8.size() ||
          forms.fp8_bases.size() != bases.size()) {
        return "sizes differ: bf16 " + std::to_string(forms.bf16.size()) + " / " + std::to_string(bf16.size()) +
               ", fp8 " + std::to_string(forms.fp8.size()) + " / " + std::to_string(fp8.size()) + ", bases " +
               std::to_string(forms.fp8_bases.size()) + " / " + std::to_string(bases.size()) + where;
      }
      for (std::size_t i = 0; i < bf16.size(); ++i) {
        if (forms.bf16[i] != bf16[i]) {
          return "bf16 element " + std::to_string(i) + ": " + hex32(forms.bf16[i]) + ", expected " + hex32(bf16[i]) +
                 where;
        }
      }
      for (std::size_t i = 0; i < bases.size(); ++i) {
        if (forms.fp8_bases[i] != bases[i]) {
          return "base " + std::to_string(i) + ": " + std::to_string(forms.fp8_bases[i]) + ", expected " +
                 std::to_string(bases[i]) + where;
        }
      }
      for (std::size_t i = 0; i < fp8.size(); ++i) {
        if (forms.fp8[i] != fp8[i]) {
          return "fp8 byte " + std::to_string(i) + ": " + hex32(forms.fp8[i]) + ", expected " + hex32(fp8[i]) + where;
        }
      }
      if (forms.lowest != lowest || forms.highest != highest || forms.nan_block != nan_block ||
          forms.fp8_fits != fits) {
        return "flags: lowest " + std::to_string(forms.lowest) + " / " + std::to_string(lowest) + ", highest " +
               std::to_string(forms.highest) + " / " + std::to_string(highest) + ", NaN block " +
               std::to_string(forms.nan_block) + " / " + std::to_string(nan_block) + ", fp8 fits " +
               std::to_string(forms.fp8_fits) + " / " + std::to_string(fits) + where;
      }
      return "";
    });
  }
}

// 2048 x 2048 x 4096 wgrad (dy and x quantized along K on the GPU, checked against the host
// quantizer in full), then the products: tensor-core and integer paths equal in every entry, and
// sampled entries equal to the host definition.
void gemm_large() {
  const std::int64_t m = 2048, n = 2048, k = 4096;
  const std::uint64_t seed = next_seed();
  const matrix dy = test_inputs::make_matrix(k, m, value_kind::banded, seed);
  const matrix x = test_inputs::make_matrix(k, n, value_kind::banded, seed + 1);
  const auto dy_options = mx_options(0, 32, 0, core::rounding_mode::sr, core::scale_rule::floor, 32, seed + 2);
  const auto x_options = mx_options(0, 32, 0, core::rounding_mode::rne, core::scale_rule::floor, 32, seed + 3);
  mxscope::quantized_tensor qa, qb;
  bool quantized = true;
  run_case("gemm large: quantize dy [4096, 2048] mxfp4 sr axis 0 on the GPU", [&]() -> std::string {
    qa = gpu::quantize(dy, dy_options);
    const auto expected = host_reference::quantize_mx(dy, dy_options);
    if (qa.codes != expected.codes || qa.scales != expected.scales) {
      quantized = false;
      return "codes or scales differ from the host quantizer; " + describe(dy_options, {});
    }
    return "";
  });
  run_case("gemm large: quantize x [4096, 2048] mxfp4 rne axis 0 on the GPU", [&]() -> std::string {
    qb = gpu::quantize(x, x_options);
    const auto expected = host_reference::quantize_mx(x, x_options);
    if (qb.codes != expected.codes || qb.scales != expected.scales) {
      quantized = false;
      return "codes or scales differ from the host quantizer; " + describe(x_options, {});
    }
    return "";
  });
  if (!quantized) return;
  std::mt19937_64 random(seed + 4);
  std::vector<std::pair<std::int64_t, std::int64_t>> samples = {
      {0, 0}, {0, n - 1}, {m - 1, 0}, {m - 1, n - 1}, {127, 128}};
  for (int s = 0; s < 1000; ++s)
    samples.emplace_back(static_cast<std::int64_t>(random() % m), static_cast<std::int64_t>(random() % n));
  const auto block_model = model_of(mxscope::accumulation_kind::fp32_block);
  gemm_output integer_result;
  bool have_integer = false;
  run_case("gemm large wgrad mxfp4 fp32-block integer 2048x2048 K4096 (1005 sampled entries vs host)", [&] {
    integer_result = gpu_product(qa, qb, block_model, mxscope::output_rounding::fp32, gpu::gemm_path::integer);
    have_integer = true;
    return check_product_entries(qa, qb, block_model, mxscope::output_rounding::fp32, integer_result, samples,
                                 "seed " + hex64(seed));
  });
  if (gpu::gemm_path_covers(gpu::gemm_path::tensor_core, core::element_kind::fp4_e2m1, core::element_kind::fp4_e2m1, 32,
                            block_model)) {
    for_each_tensor_core_kernel([&](const std::string& kernel, gpu::tensor_core_kernel selected) {
      run_case(
          "gemm large wgrad mxfp4 fp32-block tensor_core 2048x2048 K4096 (every entry vs integer path, samples vs host)" +
              kernel,
          [&]() -> std::string {
            const gemm_output got =
                gpu_product(qa, qb, block_model, mxscope::output_rounding::fp32, gpu::gemm_path::tensor_core);
            const std::string ran = check_kernel_ran(selected, qa, qb);
            if (!ran.empty()) return ran;
            if (have_integer) {
              for (std::int64_t i = 0; i < m * n; ++i) {
                if (!same(integer_result.out.values[static_cast<std::size_t>(i)],
                          got.out.values[static_cast<std::size_t>(i)])) {
                  return "entry (" + std::to_string(i / n) + ", " + std::to_string(i % n) + "): integer path " +
                         show(integer_result.out.values[static_cast<std::size_t>(i)]) + ", tensor-core path " +
                         show(got.out.values[static_cast<std::size_t>(i)]);
                }
              }
            }
            return check_product_entries(qa, qb, block_model, mxscope::output_rounding::fp32, got, samples,
                                         "seed " + hex64(seed));
          });
    });
  }
  std::vector<std::pair<std::int64_t, std::int64_t>> few(samples.begin(), samples.begin() + 200);
  for (const auto& model :
       {model_of(mxscope::accumulation_kind::fp32_group, 4), model_of(mxscope::accumulation_kind::exact)}) {
    run_case(
        "gemm large wgrad mxfp4 " + model_name(model) + " integer 2048x2048 K4096 (200 sampled entries vs host)", [&] {
          const gemm_output got = gpu_product(qa, qb, model, mxscope::output_rounding::fp32, gpu::gemm_path::integer);
          return check_product_entries(qa, qb, model, mxscope::output_rounding::fp32, got, few, "seed " + hex64(seed));
        });
  }
}

}  // namespace gpu_test
