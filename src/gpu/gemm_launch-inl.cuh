// Part of products.cu (included there, in order, inside namespace mxscope::gpu):
// the choice among the product kernels and their launches.

namespace {
bool wgmma_present() {
#if defined(MXSCOPE_CUDA_TENSOR_CORES) && !defined(MXSCOPE_GPU_SIMULATE)
  // An sm_90 device and a build whose code for it is sm_90a (the probe kernel says which).
  static const bool present = [] {
    const auto properties = current_device_properties();
    if (!properties || properties->major != 9 || properties->minor != 0) return false;
    device_buffer flag(sizeof(int));
    flag.fill_bytes(0);
    runtime::launch(wgmma_probe_kernel, 1, 1, 0, flag.as<int>());
    int value = 0;
    flag.download(&value, sizeof(int));
    return value == 1;
  }();
  return present;
#else
  return false;
#endif
}
}  // namespace

#include "native_gfx950_product.hpp"  // the gfx950 native product (kernels for __gfx950__, stubs elsewhere)

namespace {
// Whether tensor_core_scaled_kernel computes this product exactly (see there): both operands have
// its bf16 form, no NaN block, every nonzero block's bf16 elements normal (-125 <= e <= 125), and
// every block dot's scale 2^k with -124 <= k <= 117.
bool scaled_kernel_fits(const prepared_operand::storage& a, const prepared_operand::storage& b) {
  if (a.scaled.bytes() == 0 || b.scaled.bytes() == 0 || a.scaled_nan || b.scaled_nan) return false;
  const auto inside = [](const prepared_operand::storage& x) {
    return x.scaled_lowest > x.scaled_highest || (x.scaled_lowest >= -125 && x.scaled_highest <= 125);
  };
  if (!inside(a) || !inside(b)) return false;
  if (a.scaled_lowest > a.scaled_highest || b.scaled_lowest > b.scaled_highest) return true;  // a zero operand
  return a.scaled_lowest + b.scaled_lowest >= -124 && a.scaled_highest + b.scaled_highest <= 117;
}
// The same for its fp8 form: also no 128-row tile of either operand spans more than fp8_window
// exponents in a K-block (prepare_fp8_kernel).
[[maybe_unused]] bool fp8_kernel_fits(const prepared_operand::storage& a, const prepared_operand::storage& b) {
  return scaled_kernel_fits(a, b) && a.fp8_fits && b.fp8_fits;
}
}  // namespace

namespace {

// The operands and the model checked against the path before anything is launched.
void check_prepared(const prepared_operand::storage& a, const prepared_operand::storage& b,
                    const accumulation_model& model, gemm_path path) {
  if (a.depth != b.depth) {
    throw input_error("gpu gemm: the reduction lengths differ: A has " + to_text(a.depth) + ", B has " +
                      to_text(b.depth));
  }
  if (a.block != b.block) {
    throw input_error("gpu gemm: field 'block': operands must have the same blocks along the reduction axis (" +
                      to_text(a.block) + " and " + to_text(b.block) + ")");
  }
  if (path == gemm_path::automatic) throw input_error("gpu gemm: multiply_prepared needs a concrete path");
  if (a.path != path || b.path != path) throw input_error("gpu gemm: operands were prepared for another path");
  if (path != gemm_path::generic && (!a.finite_elements || !b.finite_elements)) {
    // Inf or NaN element codes (possible in hardware-produced fp8 codes) need the per-product path.
    throw input_error("gpu gemm: an operand holds NaN or infinite element codes; only the generic path covers them");
  }
  if (!gemm_path_covers(path, a.element, b.element, a.block, model)) {
    throw input_error("gpu gemm: path " + std::string(gemm_path_name(path)) +
                      " does not cover these operands and model");
  }
  if (model.kind == accumulation_kind::fp32_group && model.blocks_per_group < 1) {
    throw input_error("gpu gemm: field 'accum': G must be positive");
  }
}

// The generic kernel in the mode of the model (exact, sequential, grouped).
void launch_generic(const prepared_operand::storage& a, const prepared_operand::storage& b,
                    const accumulation_model& model, output_rounding output, float* out, double* exact_out) {
  const std::int64_t m = a.rows;
  const std::int64_t n = b.rows;
  const unsigned grid = grid_for(m * n, 128);
  const auto* ae = a.elements.as<const float>();
  const auto* be = b.elements.as<const float>();
  const auto* ax = a.exponents.as<const std::int32_t>();
  const auto* bx = b.exponents.as<const std::int32_t>();
  switch (model.kind) {
    case accumulation_kind::exact:
      runtime::launch(generic_product_kernel<generic_mode::exact>, grid, 128, 0, ae, ax, be, bx, m, n, a.depth,
                      a.block, 1, output, out, exact_out, plain_rows_view{}, plain_rows_view{}, 0);
      break;
    case accumulation_kind::fp32_seq:
      runtime::launch(generic_product_kernel<generic_mode::sequential>, grid, 128, 0, ae, ax, be, bx, m, n, a.depth,
                      a.block, 1, output, out, exact_out, plain_rows_view{}, plain_rows_view{}, 0);
      break;
    case accumulation_kind::fp32_block:
    case accumulation_kind::fp32_group:
      runtime::launch(generic_product_kernel<generic_mode::grouped>, grid, 128, 0, ae, ax, be, bx, m, n, a.depth,
                      a.block, model.kind == accumulation_kind::fp32_group ? model.blocks_per_group : 1, output,
                      out, exact_out, plain_rows_view{}, plain_rows_view{}, 0);
      break;
    default:
      // trunc-align and trunc-promote have no device kernel (gemm_path_covers refuses them first).
      throw input_error("gpu gemm: the generic path covers exact, fp32-block, fp32-group:G and fp32-seq");
  }
}

// Whether the most recent integer-path product on a sliced kernel took its whole-K dot, and whether
// the most recent one-pass pair (multiply_prepared_both) summed its exact model unchecked.
std::atomic<bool> last_run_sliced_whole_k{false};
std::atomic<bool> last_run_sliced_unchecked{false};

#if defined(MXSCOPE_CUDA_TENSOR_CORES)
std::atomic<exact_product_kernel> chosen_exact_product_kernel{exact_product_kernel::automatic};
std::atomic<exact_product_kernel> last_run_exact_product_kernel{exact_product_kernel::automatic};

// exact_wgmma_kernel's launch: the operands' records and tiles' largest spans, then the kernel.
void run_exact_wgmma(const prepared_operand::storage& a, const prepared_operand::storage& b,
                     const exponent_span_data& a_spans, const exponent_span_data& b_spans, int span_budget,
                     output_rounding output, float* out, double* exact_out, std::uint8_t* flags, int fraction_total) {
  const std::int64_t m = a.rows;
  const std::int64_t n = b.rows;
  const std::int64_t tiles_m = (m + tew_tile_m - 1) / tew_tile_m;
  const std::int64_t tiles_n = (n + tew_tile_n - 1) / tew_tile_n;
  const std::int64_t stages = (a.blocks + tew_stage_blocks - 1) / tew_stage_blocks;
  scratch_buffer a_records(static_cast<std::size_t>(tiles_m * stages * tew_record_bytes(tew_tile_m)));
  scratch_buffer b_records(static_cast<std::size_t>(tiles_n * stages * tew_record_bytes(tew_tile_n)));
  scratch_buffer tile_spans(static_cast<std::size_t>(tiles_m + tiles_n) * sizeof(unsigned));
  tile_spans.fill_bytes(0);
  unsigned* const a_tile_spans = tile_spans.as<unsigned>();
  unsigned* const b_tile_spans = a_tile_spans + tiles_m;
  const auto prepare = [&](const prepared_operand::storage& x, const exponent_span_data& spans, std::int64_t tiles,
                           int tile_rows, const scratch_buffer& records, unsigned* tile_span) {
    const std::int64_t padded = tiles * tile_rows;
    runtime::launch(prepare_exact_records_kernel, grid_for(padded * stages * tew_stage_blocks), threads_per_block, 0,
                    x.bytes.as<const std::int8_t>(), x.exponents.as<const std::int32_t>(),
                    spans.spans.as<const std::int32_t>(), spans.lows.as<const std::int32_t>(), x.rows, padded,
                    x.byte_stride, x.blocks, stages, tile_rows,
                    records.as<std::uint8_t>(), tile_span);
  };
  prepare(a, a_spans, tiles_m, tew_tile_m, a_records, a_tile_spans);
  prepare(b, b_spans, tiles_n, tew_tile_n, b_records, b_tile_spans);
  runtime::allow_dynamic_shared(exact_wgmma_kernel, tew_shared_bytes);
  runtime::launch(exact_wgmma_kernel, static_cast<unsigned>(tiles_m * tiles_n), tew_threads, tew_shared_bytes,
                  a_records.as<const std::uint8_t>(), b_records.as<const std::uint8_t>(),
                  static_cast<const unsigned*>(a_tile_spans), static_cast<const unsigned*>(b_tile_spans),
                  a_spans.lows.as<const std::int32_t>(), b_spans.lows.as<const std::int32_t>(), m, n, stages,
                  tiles_m, tiles_n, fraction_total, span_budget, output, out, exact_out, flags);
  release_after_kernels();  // the scratch buffers go back to the pool when this returns
}

// The exact model on the tensor cores: the block dots exact in fp64 where the operands' exponent
// spans allow, flagged entries finished by the fix-up kernel; on the selected kernel.
void launch_tensor_core_exact(const prepared_operand::storage& a, const prepared_operand::storage& b,
                              output_rounding output, float* out, double* exact_out, int fraction_total) {
  const std::int64_t m = a.rows;
  const std::int64_t n = b.rows;
  device_buffer flagged(static_cast<std::size_t>(m * n));
  flagged.fill_bytes(0);
  const exponent_span_data a_spans = exponent_spans(a);
  const exponent_span_data b_spans = exponent_spans(b);
  const int dot_bits = bits_of(32 * tensor_core_integer_max(a.element) * tensor_core_integer_max(b.element));
  const int span_budget = 53 - dot_bits - bits_of(a.blocks);
  constexpr std::int64_t int_limit = std::numeric_limits<int>::max() / 2;
  const std::int64_t wgmma_tiles = ((m + tew_tile_m - 1) / tew_tile_m) * ((n + tew_tile_n - 1) / tew_tile_n);
  const exact_product_kernel chosen = chosen_exact_product_kernel.load();
  // automatic: wgmma where an sm_90a build runs on sm_90, as selected_tensor_core_kernel's choice
  // (the timings behind it: BENCHMARKS.md); mma_sync elsewhere.
  const bool warpgroup = chosen == exact_product_kernel::wgmma ||
                         (chosen == exact_product_kernel::automatic && wgmma_present());
  if (warpgroup && wgmma_tiles * tcb_group <= int_limit && a.blocks <= int_limit) {
    run_exact_wgmma(a, b, a_spans, b_spans, span_budget, output, out, exact_out, flagged.as<std::uint8_t>(),
                    fraction_total);
    last_run_exact_product_kernel.store(exact_product_kernel::wgmma);
  } else {
    const dim3 grid(static_cast<unsigned>((n + tc_exact_tile_n - 1) / tc_exact_tile_n),
                    static_cast<unsigned>((m + tc_tile - 1) / tc_tile));
    runtime::launch(tensor_core_exact_kernel, grid, 256, 0, a.bytes.as<const std::int8_t>(),
                    a.exponents.as<const std::int32_t>(), b.bytes.as<const std::int8_t>(),
                    b.exponents.as<const std::int32_t>(), m, n, a.byte_stride, a.blocks, fraction_total, output,
                    out, exact_out, flagged.as<std::uint8_t>(), a_spans.spans.as<const std::int32_t>(),
                    b_spans.spans.as<const std::int32_t>(), span_budget);
    last_run_exact_product_kernel.store(exact_product_kernel::mma_sync);
  }
  runtime::launch(tensor_core_exact_fixup_kernel, flag_scan_grid(m * n), threads_per_block, 0,
                  a.bytes.as<const std::int8_t>(), a.exponents.as<const std::int32_t>(),
                  b.bytes.as<const std::int8_t>(), b.exponents.as<const std::int32_t>(), m, n, a.byte_stride,
                  a.blocks, fraction_total, output, flagged.as<const std::uint8_t>(), out, exact_out);
  synchronize();  // the flag buffer must outlive both kernels
}

// fp32-block and fp32-group:G on the tensor cores: the selected kernel (wgmma_fp8, wgmma_bf16,
// mma_sync, wgmma), falling back to the next where the operands do not fit it.
void launch_tensor_core_block(const prepared_operand::storage& a, const prepared_operand::storage& b,
                              output_rounding output, float* out) {
  const std::int64_t m = a.rows;
  const std::int64_t n = b.rows;
          runtime::allow_dynamic_shared(tensor_core_block_kernel, tcb_shared_bytes);
          const std::int64_t tiles_m = (m + tcb_tile_m - 1) / tcb_tile_m;
          const std::int64_t tiles_n = (n + tcb_tile_n - 1) / tcb_tile_n;
          constexpr std::int64_t int_limit = std::numeric_limits<int>::max() / 2;
          if (tiles_m * tiles_n * tcb_group > int_limit || a.padded_rows * 4 > int_limit ||
              b.padded_rows * 4 > int_limit || a.blocks > int_limit) {
            throw input_error("gpu gemm: the product is too large for the tensor-core path (" + to_text(m) + " x " +
                              to_text(n) + " x " + to_text(a.depth) + ")");
          }
          tensor_core_kernel kernel = selected_tensor_core_kernel();
          if (kernel == tensor_core_kernel::wgmma_fp8 && !fp8_kernel_fits(a, b)) {
            kernel = tensor_core_kernel::wgmma_bf16;
          }
          if (kernel == tensor_core_kernel::wgmma_bf16 && !scaled_kernel_fits(a, b)) {
            kernel = tensor_core_kernel::mma_sync;
          }
          last_run_tensor_core_kernel.store(kernel);
          if (kernel == tensor_core_kernel::wgmma_fp8 || kernel == tensor_core_kernel::wgmma_bf16) {
  #if !defined(MXSCOPE_GPU_SIMULATE)
            const bool fp8 = kernel == tensor_core_kernel::wgmma_fp8;
            const auto entry = fp8 ? tensor_core_scaled_kernel<true> : tensor_core_scaled_kernel<false>;
            runtime::allow_dynamic_shared(entry, tcs_shared_bytes);
            // 128 x 256 tiles, as tensor_core_block_kernel's.
            const auto& a_tiles = fp8 ? a.fp8 : a.scaled;
            const auto& b_tiles = fp8 ? b.fp8 : b.scaled;
            // Persistent: one thread block per multiprocessor (its shared memory allows no second).
            const std::int64_t persistent = std::min<std::int64_t>(tiles_m * tiles_n, multiprocessor_count());
            runtime::launch(entry, static_cast<unsigned>(persistent), tcs_threads, tcs_shared_bytes,
                            a_tiles.as<const unsigned char>(), b_tiles.as<const unsigned char>(),
                            fp8 ? a.fp8_bases.as<const std::int32_t>() : nullptr,
                            fp8 ? b.fp8_bases.as<const std::int32_t>() : nullptr, m, n, a.blocks, tiles_m, tiles_n,
                            output, out);
  #endif
          } else if (kernel == tensor_core_kernel::mma_sync) {
            runtime::launch(tensor_core_block_kernel, static_cast<unsigned>(tiles_m * tiles_n), tcb_threads,
                            tcb_shared_bytes, a.bytes.as<const std::int8_t>(), a.scales.as<const std::uint32_t>(),
                            a.slow_tiles.as<const unsigned>(), b.bytes.as<const std::int8_t>(),
                            b.scales.as<const std::uint32_t>(), b.slow_tiles.as<const unsigned>(), m, n, a.byte_stride,
                            a.padded_rows, b.padded_rows, a.blocks, tiles_m, tiles_n, output, out);
          } else {
            // 128 x 128 tiles: twice tcb's count, still within the checked bound's factor tcb_group.
            runtime::allow_dynamic_shared(tensor_core_wgmma_kernel, tcw_shared_bytes);
            const std::int64_t wgmma_tiles_m = (m + tcw_tile - 1) / tcw_tile;
            const std::int64_t wgmma_tiles_n = (n + tcw_tile - 1) / tcw_tile;
            runtime::launch(tensor_core_wgmma_kernel, static_cast<unsigned>(wgmma_tiles_m * wgmma_tiles_n), tcw_threads,
                            tcw_shared_bytes, a.bytes.as<const std::int8_t>(), a.scales.as<const std::uint32_t>(),
                            a.slow_tiles.as<const unsigned>(), b.bytes.as<const std::int8_t>(),
                            b.scales.as<const std::uint32_t>(), b.slow_tiles.as<const unsigned>(), m, n, a.byte_stride,
                            a.padded_rows, b.padded_rows, a.blocks, wgmma_tiles_m, wgmma_tiles_n, output, out);
          }
}

// The operands in sliced_block_kernel's form, and that kernel's launch: false where a block
// exponent does not fit (nothing was launched after the preparation). With exact_out32 (and not
// `exact`) its Both form: fp32-block into `out`, the exact model into exact_out, exact_out32, flags.
bool run_sliced_block(const prepared_operand::storage& a, const prepared_operand::storage& b, bool exact,
                      output_rounding output, float* out, double* exact_out, std::uint8_t* flags, int fraction_total,
                      bool* whole_k, float* exact_out32 = nullptr) {
  const std::int64_t m = a.rows;
  const std::int64_t n = b.rows;
  const std::int64_t tiles_m = (m + slc_tile_m - 1) / slc_tile_m;
  const std::int64_t padded_m = (m + slc_row_pad - 1) / slc_row_pad * slc_row_pad;
  const std::int64_t padded_n = (n + slc_col_pad - 1) / slc_col_pad * slc_col_pad;
  // Each operand's sliced form, kept in its storage for the next product of that operand with the
  // same shift and padding (an operand on both sides needs two forms: neither is kept); the forms
  // made here share one download of their flags.
  using form = prepared_operand::storage::sliced_form;
  const bool keep = &a != &b;
  std::optional<std::scoped_lock<std::mutex, std::mutex>> locked;
  if (keep) locked.emplace(a.sliced_mutex, b.sliced_mutex);
  std::optional<form> a_local, b_local;
  std::optional<form>& a_slot = keep ? a.sliced : a_local;
  std::optional<form>& b_slot = keep ? b.sliced : b_local;
  const auto fits = [](const std::optional<form>& kept, std::int64_t padded, int shift) {
    return kept && kept->padded == padded && kept->shift == shift;
  };
  const bool make_a = !fits(a_slot, padded_m, -fraction_total);
  const bool make_b = !fits(b_slot, padded_n, 0);
  if (make_a || make_b) {
    scratch_buffer flags_made(4 * sizeof(unsigned));
    flags_made.fill_bytes(0);
    const auto make = [&](const prepared_operand::storage& x, std::optional<form>& slot, std::int64_t padded,
                          int shift, int index) {
      form& made = slot.emplace(shift, padded, static_cast<std::size_t>(padded * x.blocks * slc_row_block_bytes),
                                static_cast<std::size_t>(x.blocks * padded) * sizeof(double));
      runtime::launch(prepare_sliced_kernel, grid_for(padded * x.blocks), threads_per_block, 0,
                      x.integers.as<const std::int32_t>(), x.exponents.as<const std::int32_t>(), x.rows, padded,
                      x.depth, x.blocks, shift, made.slices.as<std::uint8_t>(), made.scales.as<double>(),
                      flags_made.as<unsigned>() + 2 * index);
    };
    if (make_a) make(a, a_slot, padded_m, -fraction_total, 0);
    if (make_b) make(b, b_slot, padded_n, 0, 1);
    unsigned host[4] = {0, 0, 0, 0};
    flags_made.download(host, sizeof(host));
    if (make_a) std::copy(host, host + 2, a_slot->flags);
    if (make_b) std::copy(host + 2, host + 4, b_slot->flags);
  }
  const form& a_form = *a_slot;
  const form& b_form = *b_slot;
  if (a_form.flags[0] != 0 || b_form.flags[0] != 0) return false;
  // Every row of both operands has one block exponent along K, and K is within the whole-K dot's
  // limit: each entry's scale 2^k is then the same in every K-block.
  const bool constant_scales = a_form.flags[1] == 0 && b_form.flags[1] == 0 && a.depth <= slc_whole_depth_limit;
  *whole_k = exact && constant_scales;
  // The kernel's form and its tiling (slc_tiling_of its Both).
  const auto run = [&](auto kernel, auto tiling) {
    constexpr int tile_n = decltype(tiling)::tile_n;
    constexpr std::size_t shared_bytes = slc_shared_bytes<tile_n>;
    const std::int64_t tiles_n = (n + tile_n - 1) / tile_n;
    runtime::allow_dynamic_shared(kernel, shared_bytes);
    runtime::launch(kernel, static_cast<unsigned>(tiles_m * tiles_n), slc_threads, shared_bytes,
                    a_form.slices.as<const std::uint8_t>(), a_form.scales.as<const double>(),
                    b_form.slices.as<const std::uint8_t>(), b_form.scales.as<const double>(), m, n, padded_m, padded_n,
                    a.blocks, tiles_m, tiles_n, output, out, exact_out, flags, exact_out32);
  };
  // The Both form's exact sums cannot round under constant scales: sliced_block_kernel's Unchecked.
  const bool unchecked = exact_out32 != nullptr && !exact && constant_scales;
  last_run_sliced_unchecked.store(unchecked);
  if (*whole_k) {
    run(sliced_block_kernel<true, true>, slc_tiling_of<false>{});
  } else if (exact) {
    run(sliced_block_kernel<true>, slc_tiling_of<false>{});
  } else if (unchecked) {
    run(sliced_block_kernel<false, false, true, true>, slc_tiling_of<true>{});
  } else if (exact_out32 != nullptr) {
    run(sliced_block_kernel<false, false, true>, slc_tiling_of<true>{});
  } else {
    run(sliced_block_kernel<false>, slc_tiling_of<false>{});
  }
  return true;
}

// The same on sliced_wgmma_kernel, from the operands' records (prepare_sliced_tiles_kernel).
bool run_sliced_wgmma(const prepared_operand::storage& a, const prepared_operand::storage& b, bool exact,
                      output_rounding output, float* out, double* exact_out, std::uint8_t* flags, int fraction_total) {
  const std::int64_t m = a.rows;
  const std::int64_t n = b.rows;
  const std::int64_t tiles_m = (m + slw_tile_m - 1) / slw_tile_m;
  const std::int64_t tiles_n = (n + slw_tile_n - 1) / slw_tile_n;
  const std::int64_t stages = (a.blocks + slw_stage_blocks - 1) / slw_stage_blocks;
  scratch_buffer a_records(static_cast<std::size_t>(tiles_m * stages * slw_record_bytes(slw_tile_m)));
  scratch_buffer b_records(static_cast<std::size_t>(tiles_n * stages * slw_record_bytes(slw_tile_n)));
  scratch_buffer unfit(2 * sizeof(unsigned));  // slice_row_block's two flags; this kernel reads the first
  unfit.fill_bytes(0);
  const auto prepare = [&](const prepared_operand::storage& x, std::int64_t tiles, int tile_rows, int shift,
                           const scratch_buffer& records) {
    const std::int64_t padded = tiles * tile_rows;
    runtime::launch(prepare_sliced_tiles_kernel, grid_for(padded * stages * slw_stage_blocks), threads_per_block, 0,
                    x.integers.as<const std::int32_t>(), x.exponents.as<const std::int32_t>(), x.rows, padded, x.depth,
                    x.blocks, stages, tile_rows, shift, records.as<std::uint8_t>(), unfit.as<unsigned>());
  };
  prepare(a, tiles_m, slw_tile_m, -fraction_total, a_records);
  prepare(b, tiles_n, slw_tile_n, 0, b_records);
  unsigned unfit_host = 0;
  unfit.download(&unfit_host, sizeof(unfit_host));
  if (unfit_host != 0) return false;
  const auto run = [&](auto kernel) {
    runtime::allow_dynamic_shared(kernel, slw_shared_bytes);
    runtime::launch(kernel, static_cast<unsigned>(tiles_m * tiles_n), slw_threads, slw_shared_bytes,
                    a_records.as<const std::uint8_t>(), b_records.as<const std::uint8_t>(), m, n, a.blocks, stages,
                    tiles_m, tiles_n, output, out, exact_out, flags);
  };
  if (exact) {
    run(sliced_wgmma_kernel<true>);
  } else {
    run(sliced_wgmma_kernel<false>);
  }
  return true;
}

// fp32-block or exact on sliced_block_kernel (gemm_sliced-inl.cuh), or with `warpgroup` on
// sliced_wgmma_kernel (gemm_sliced_wgmma-inl.cuh): true when it ran, false where its conditions do
// not hold (the integer kernel then takes the product).
// Whether the sliced kernels take these operands (before their block exponents are seen).
bool sliced_takes(const prepared_operand::storage& a, const prepared_operand::storage& b) {
  if (a.block != 32 || integer_max_of(a.element) >= slc_integer_limit ||
      integer_max_of(b.element) >= slc_integer_limit || !tensor_cores_present()) {
    return false;
  }
  const std::int64_t tiles =
      ((a.rows + slc_tile_m - 1) / slc_tile_m) * ((b.rows + slc_narrow::tile_n - 1) / slc_narrow::tile_n);
  constexpr std::int64_t int_limit = std::numeric_limits<int>::max() / 2;
  return tiles * tcb_group <= int_limit && a.blocks <= int_limit;  // tiles: the most of either kernel
}

// The exact model's fix-up of the entries whose running sum rounded (block dots <= 53 bits:
// gemm_path_covers, so the double chain is exact): out and exact_out there, by the per-entry definition.
void fix_flagged_exact(const prepared_operand::storage& a, const prepared_operand::storage& b, int fraction_total,
                       output_rounding output, const std::uint8_t* flags, float* out, double* exact_out) {
  const std::int64_t m = a.rows;
  const std::int64_t n = b.rows;
  runtime::launch(integer_fixup_kernel<double, integer_mode::exact>, flag_scan_grid(m * n), threads_per_block, 0,
                  a.integers.as<const std::int32_t>(), a.exponents.as<const std::int32_t>(),
                  b.integers.as<const std::int32_t>(), b.exponents.as<const std::int32_t>(), m, n, a.depth, a.block,
                  a.blocks, 1, fraction_total, output, flags, out, exact_out);
}

bool launch_sliced(const prepared_operand::storage& a, const prepared_operand::storage& b, bool exact, bool warpgroup,
                   output_rounding output, float* out, double* exact_out, int fraction_total) {
  if (!sliced_takes(a, b)) return false;
  const std::int64_t m = a.rows;
  const std::int64_t n = b.rows;
  std::optional<scratch_buffer> flagged;
  if (exact) {
    flagged.emplace(static_cast<std::size_t>(std::max<std::int64_t>(m * n, 1)));
    flagged->fill_bytes(0);
  }
  std::uint8_t* const flags = exact ? flagged->as<std::uint8_t>() : nullptr;
  bool whole_k = false;
  const bool ran = warpgroup ? run_sliced_wgmma(a, b, exact, output, out, exact_out, flags, fraction_total)
                             : run_sliced_block(a, b, exact, output, out, exact_out, flags, fraction_total, &whole_k);
  if (!ran) return false;
  last_run_sliced_whole_k.store(whole_k);
  if (exact && !whole_k) fix_flagged_exact(a, b, fraction_total, output, flags, out, exact_out);
  release_after_kernels();  // the scratch buffers go back to the pool when this returns
  return true;
}

// fp32-block into `out` (with `output`) and the exact model into exact_out and exact_out32 (output
// fp32) from one pass of sliced_block_kernel: false where it does not take the operands (nothing
// computed).
bool launch_sliced_both(const prepared_operand::storage& a, const prepared_operand::storage& b, output_rounding output,
                        float* out, double* exact_out, float* exact_out32, int fraction_total) {
  last_run_sliced_unchecked.store(false);
  if (!sliced_takes(a, b)) return false;
  scratch_buffer flagged(static_cast<std::size_t>(std::max<std::int64_t>(a.rows * b.rows, 1)));
  flagged.fill_bytes(0);
  bool whole_k = false;
  if (!run_sliced_block(a, b, false, output, out, exact_out, flagged.as<std::uint8_t>(), fraction_total, &whole_k,
                        exact_out32)) {
    return false;
  }
  last_run_sliced_whole_k.store(false);
  fix_flagged_exact(a, b, fraction_total, output_rounding::fp32, flagged.as<std::uint8_t>(), exact_out32, exact_out);
  release_after_kernels();
  return true;
}
#endif

std::atomic<integer_block_kernel> chosen_integer_block_kernel{integer_block_kernel::automatic};
std::atomic<integer_block_kernel> last_run_integer_block_kernel{integer_block_kernel::automatic};

// The integer path's fp32-block and exact products on the selected kernel (integer_block_kernel).
void launch_integer_sliced_or_simt(const prepared_operand::storage& a, const prepared_operand::storage& b,
                                   const accumulation_model& model, output_rounding output, float* out,
                                   double* exact_out, int fraction_total) {
#if defined(MXSCOPE_CUDA_TENSOR_CORES)
  const integer_block_kernel chosen = chosen_integer_block_kernel.load();
  const bool warpgroup = chosen == integer_block_kernel::sliced_wgmma;
  if (chosen != integer_block_kernel::simt &&
      launch_sliced(a, b, model.kind == accumulation_kind::exact, warpgroup, output, out, exact_out, fraction_total)) {
    last_run_integer_block_kernel.store(warpgroup ? integer_block_kernel::sliced_wgmma : integer_block_kernel::sliced);
    return;
  }
#endif
  last_run_integer_block_kernel.store(integer_block_kernel::simt);
  last_run_sliced_whole_k.store(false);
  if (block_dot_bits(a.element, b.element, a.block) <= 31) {
    launch_integer<std::int32_t>(a, b, model, output, out, exact_out, fraction_total);
  } else {
    launch_integer<double>(a, b, model, output, out, exact_out, fraction_total);  // <= 53 bits: gemm_path_covers
  }
}

}  // namespace

std::string_view exact_product_kernel_name(exact_product_kernel kernel) {
  switch (kernel) {
    case exact_product_kernel::automatic:
      return "automatic";
    case exact_product_kernel::mma_sync:
      return "mma_sync";
    case exact_product_kernel::wgmma:
      return "wgmma";
  }
  return "?";
}

bool exact_product_kernel_available(exact_product_kernel kernel) {
#if defined(MXSCOPE_CUDA_TENSOR_CORES)
  if (kernel == exact_product_kernel::wgmma) return warpgroup_kernels_present();
  return kernel == exact_product_kernel::automatic || tensor_cores_present();
#else
  return kernel == exact_product_kernel::automatic;
#endif
}

void select_exact_product_kernel(exact_product_kernel kernel) {
  require_kernel_available(exact_product_kernel_available(kernel), "exact-model", exact_product_kernel_name(kernel));
#if defined(MXSCOPE_CUDA_TENSOR_CORES)
  chosen_exact_product_kernel.store(kernel);
#endif
}

exact_product_kernel last_exact_product_kernel() {
#if defined(MXSCOPE_CUDA_TENSOR_CORES)
  return last_run_exact_product_kernel.load();
#else
  return exact_product_kernel::automatic;
#endif
}

std::string_view integer_block_kernel_name(integer_block_kernel kernel) {
  switch (kernel) {
    case integer_block_kernel::automatic:
      return "automatic";
    case integer_block_kernel::simt:
      return "simt";
    case integer_block_kernel::sliced:
      return "sliced";
    case integer_block_kernel::sliced_wgmma:
      return "sliced_wgmma";
  }
  return "?";
}

bool integer_block_kernel_available(integer_block_kernel kernel) {
  switch (kernel) {
    case integer_block_kernel::automatic:
    case integer_block_kernel::simt:
      return true;
    case integer_block_kernel::sliced:
      return tensor_cores_present();
    case integer_block_kernel::sliced_wgmma:
      return warpgroup_kernels_present();
  }
  return false;
}

void select_integer_block_kernel(integer_block_kernel kernel) {
  require_kernel_available(integer_block_kernel_available(kernel), "integer-path", integer_block_kernel_name(kernel));
  chosen_integer_block_kernel.store(kernel);
}

integer_block_kernel last_integer_block_kernel() { return last_run_integer_block_kernel.load(); }
bool last_integer_product_whole_k() { return last_run_sliced_whole_k.load(); }
bool last_both_exact_unchecked() { return last_run_sliced_unchecked.load(); }

bool multiply_prepared_both(const prepared_operand& a_operand, const prepared_operand& b_operand,
                            output_rounding output, float* out, double* exact_out, float* exact_out32) {
#if defined(MXSCOPE_CUDA_TENSOR_CORES)
  const auto& a = a_operand.data();
  const auto& b = b_operand.data();
  accumulation_model block_model;
  block_model.kind = accumulation_kind::fp32_block;
  if (a.path != gemm_path::integer || b.path != gemm_path::integer || a.rows == 0 || b.rows == 0) return false;
  check_prepared(a, b, block_model, gemm_path::integer);
  const integer_block_kernel chosen = chosen_integer_block_kernel.load();
  if (chosen != integer_block_kernel::automatic && chosen != integer_block_kernel::sliced) return false;
  const int fraction_total = fraction_bits_of(a.element) + fraction_bits_of(b.element);
  if (!launch_sliced_both(a, b, output, out, exact_out, exact_out32, fraction_total)) return false;
  last_run_integer_block_kernel.store(integer_block_kernel::sliced);
  return true;
#else
  (void)a_operand, (void)b_operand, (void)output, (void)out, (void)exact_out, (void)exact_out32;
  return false;
#endif
}

void multiply_prepared(const prepared_operand& a_operand, const prepared_operand& b_operand,
                       const accumulation_model& model, output_rounding output, float* out, double* exact_out,
                       gemm_path path) {
  const auto& a = a_operand.data();
  const auto& b = b_operand.data();
  check_prepared(a, b, model, path);
  if (a.rows == 0 || b.rows == 0) return;
  const int fraction_total = fraction_bits_of(a.element) + fraction_bits_of(b.element);
  switch (path) {
    case gemm_path::generic:
      launch_generic(a, b, model, output, out, exact_out);
      break;
    case gemm_path::integer:
      if (model.kind == accumulation_kind::fp32_block || model.kind == accumulation_kind::exact) {
        launch_integer_sliced_or_simt(a, b, model, output, out, exact_out, fraction_total);
      } else if (block_dot_bits(a.element, b.element, a.block) <= 31) {
        launch_integer<std::int32_t>(a, b, model, output, out, exact_out, fraction_total);
      } else if (block_dot_bits(a.element, b.element, a.block) <= 53) {
        launch_integer<double>(a, b, model, output, out, exact_out, fraction_total);  // exact: see the integer path
      } else {
        launch_integer<long long>(a, b, model, output, out, exact_out, fraction_total);
      }
      break;
    case gemm_path::tensor_core:
#if defined(MXSCOPE_CUDA_TENSOR_CORES)
      if (model.kind == accumulation_kind::exact) {
        launch_tensor_core_exact(a, b, output, out, exact_out, fraction_total);
      } else {
        launch_tensor_core_block(a, b, output, out);
      }
#else
      throw input_error("gpu gemm: no tensor-core path in this build");
#endif
      break;
    case gemm_path::native_mfma:
      native_gfx950::multiply(a, b, output, out);
      break;
    case gemm_path::automatic:
      break;
  }
}

