// Part of products.cu (included there, in order, inside namespace mxscope::gpu):
// the integer path of the emulated products.
// -------------------------------------------------------------------------------------------
// Integer path: the block dot D of each K-block is an exact integer sum, then the model's steps
// run on exact doubles exactly as src/gemm.cpp's fast path does (add_exact_value,
// add_exactly_to_float, long_accumulator), per entry, in ascending K-blocks.
//
// One 64 x 64 tile of C per thread block of 256 threads, 4 x 4 entries per thread (the DMMA layout
// of tile_dots); each K-block's elements are staged in shared memory in chunks of 32 ([row][k],
// coalesced global reads of 32 consecutive int32 per warp), as doubles for the fp64 tensor cores
// (on HIP: as the type `Dot` the block dot is summed in, in FMA chains). Every partial sum of a
// block dot, in any order, is an integer below 2^block_dot_bits, a double, so the tensor core's
// additions are exact and its dot is D. `Dot` is:
// - int32 where block_dot_bits <= 31;
// - double where block_dot_bits <= 53 (fp8 e4m3: 6 + 18 + 18 = 42 bits for blocks of 32). Every
//   element integer has |x| <= integer_max_of(kind) < 2^bits_of(integer_max_of(kind)) (exact in a
//   double: below 2^31), so every product is an integer below 2^(bits_a + bits_b) and every partial
//   sum of at most `block` < 2^bits_of(block) products an integer below 2^block_dot_bits <= 2^53:
//   each of them is a double, so each FMA of the chain rounds a representable value, i.e. not at
//   all, and the chain's result is D exactly. (One DFMA per product instead of a 64-bit integer
//   multiply-add.)
// - int64 otherwise (no format of the path today: gemm_path_covers asks for <= 53 bits).
//
// Per entry state across K-blocks: fp32-block the fp32 accumulator (add_exact_value per block).
// fp32-group:G and exact keep a running fp64 sum of the scaled block dots and check every addition
// with TwoSum (Knuth): while no addition rounded, `running` is the exact sum of the group's (or of
// all) scaled dots, and the step is one correctly rounded operation on it: fl32(acc + running)
// (core add_to_float, which rounds acc + running once, as add_exactly_to_float rounds acc + the
// terms once; +0.0 for an exact zero, as there) for a group, the fp64 result and one RNE conversion
// to fp32 for exact. An entry where an addition rounded (block dots many binades apart) is flagged
// and left to integer_fixup_kernel, which redoes it from the operands with the per-entry
// definitions (the group's terms through add_exactly_to_float, a long accumulator for exact).

constexpr int integer_tile = dot_tile;           // entries per thread block along M and N
constexpr int integer_chunk = dot_chunk;         // K per shared-memory stage (within one K-block)
constexpr int integer_side = integer_tile / 16;  // entries per thread along M and N (tile_dots: 4)

// whole: `exact` where every row's block exponent is the same in all of its K-blocks (per-tensor
// scaling: unit block scales) and every partial sum over the whole of K is below 2^53: the dot of
// all of K is then one exact sum (the tensor cores add it exactly in any order), and the entry is
// that sum times the rows' scale, the value `exact` gets by adding the blocks' scaled dots, which
// are then all exact additions.
enum class integer_mode : int { block = 0, group = 1, exact = 2, whole = 3 };

// dot += x * y, exact (see above for double).
template <class Dot>
__device__ inline Dot multiply_add_exact(Dot x, Dot y, Dot dot) {
  if constexpr (std::is_same_v<Dot, double>) {
    return fma_exact(x, y, dot);
  } else {
    return dot + x * y;
  }
}

// add_exact_value, with the rounding inline (no call in the unrolled per-entry steps).
__device__ inline float add_exact_value_inline(float accumulator, double value) {
  if (!is_finite(accumulator) || !is_finite(value)) return nonfinite_step(accumulator, value);
  return core_ns::add_to_float(accumulator, value + 0.0);  // +0.0: an exactly zero sum is +0
}

template <class Dot, integer_mode Mode>
// One body (about 170 lines): the tile loads, the exact integer block dots and the model's step of
// every entry share the tile's fragments and accumulators held in registers.
__global__ void __launch_bounds__(dot_threads, dot_min_blocks)
    integer_product_kernel(const std::int32_t* a_values, const std::int32_t* a_exponents,
                           const std::int32_t* b_values, const std::int32_t* b_exponents, std::int64_t m,
                           std::int64_t n, std::int64_t depth, int block, std::int64_t blocks, int blocks_per_group,
                           int fraction_total, output_rounding output, float* out, double* exact_out,
                           std::uint8_t* flagged) {
  using Tile = dot_tile_t<Dot>;
  using Acc = Tile;  // the chunk dots: doubles on the tensor cores (exact, see tile_dots), else Dot
  static_assert(Mode != integer_mode::whole || std::is_same_v<Acc, double>, "a whole-K dot needs 53 bits");
  __shared__ Tile a_tile[integer_tile * dot_stride];
  __shared__ Tile b_tile[integer_tile * dot_stride];
  const std::int64_t i0 = static_cast<std::int64_t>(blockIdx.y) * integer_tile;
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * integer_tile;

  bool row_inside[integer_side], column_inside[integer_side];
#pragma unroll
  for (int s = 0; s < integer_side; ++s) {
    row_inside[s] = i0 + dot_row(s) < m;
    column_inside[s] = j0 + dot_col(s) < n;
  }
  [[maybe_unused]] float accumulators[integer_side][integer_side];
  [[maybe_unused]] double running[integer_side][integer_side];
  [[maybe_unused]] unsigned nan_entries = 0;     // bit r * side + c: a NaN block (exact: ever; group: this group)
  [[maybe_unused]] unsigned rounded_entries = 0;  // bit r * side + c: an addition of `running` rounded
#pragma unroll
  for (int r = 0; r < integer_side; ++r) {
#pragma unroll
    for (int c = 0; c < integer_side; ++c) {
      accumulators[r][c] = 0.0f;
      running[r][c] = 0.0;
    }
  }
  const int group = Mode == integer_mode::group ? blocks_per_group : 1;
  std::int32_t exponent_a[integer_side], exponent_b[integer_side];
  Acc dots[integer_side][integer_side];

  // The chunks in order: K-block b, offset c0 within it (dot_chunk_values: the next one is loaded
  // while the tensor cores work on this one).
  dot_chunk_values<std::int32_t> next;
  const auto fetch = [&](std::int64_t b, std::int64_t c0) {
    const std::int64_t k0 = b * block + c0;
    const std::int64_t block_end = depth < (b + 1) * block ? depth : (b + 1) * block;
    next.load(a_values, b_values, i0, j0, m, n, depth, k0,
              block_end - k0 < integer_chunk ? block_end - k0 : integer_chunk);
  };
  if (blocks > 0) fetch(0, 0);

  for (std::int64_t group_begin = 0; group_begin < blocks; group_begin += group) {
    const std::int64_t group_end = blocks - group_begin < group ? blocks : group_begin + group;
    if constexpr (Mode == integer_mode::group) {
      nan_entries = 0;
#pragma unroll
      for (int r = 0; r < integer_side; ++r) {
#pragma unroll
        for (int c = 0; c < integer_side; ++c) running[r][c] = 0.0;
      }
    }
    for (std::int64_t b = group_begin; b < group_end; ++b) {
      const std::int64_t k0 = b * block;
      const std::int64_t length = depth - k0 < block ? depth - k0 : block;
      if (Mode != integer_mode::whole || b == 0) {
#pragma unroll
        for (int s = 0; s < integer_side; ++s) {
          exponent_a[s] = row_inside[s] ? a_exponents[b * m + i0 + dot_row(s)] : 0;
          exponent_b[s] = column_inside[s] ? b_exponents[b * n + j0 + dot_col(s)] : 0;
        }
#pragma unroll
        for (int r = 0; r < integer_side; ++r) {
#pragma unroll
          for (int c = 0; c < integer_side; ++c) dots[r][c] = 0;
        }
      }
      for (std::int64_t c0 = 0; c0 < length; c0 += integer_chunk) {
        next.store(a_tile, b_tile);
        __syncthreads();
        if (c0 + integer_chunk < length) {
          fetch(b, c0 + integer_chunk);
        } else if (b + 1 < blocks) {
          fetch(b + 1, 0);
        }
        tile_dots(a_tile, b_tile, dots);
        __syncthreads();
      }
      // The block's step for every entry of the thread (whole: one step after the last block).
      if (Mode == integer_mode::whole && b + 1 < blocks) continue;
#pragma unroll
      for (int r = 0; r < integer_side; ++r) {
#pragma unroll
        for (int c = 0; c < integer_side; ++c) {
          if (!row_inside[r] || !column_inside[c]) continue;
          if constexpr (Mode == integer_mode::block) {
            // The common step in full: the scaled dot D 2^k is a finite double (|D| < 2^53, k
            // within +-300), so scaled_block_dot's canonicalizations change nothing and
            // add_exact_value is fl32(acc + D 2^k). NaN blocks and an infinite accumulator take
            // the general step.
            float& accumulator = accumulators[r][c];
            if (exponent_a[r] != nan_block_exponent && exponent_b[c] != nan_block_exponent && is_finite(accumulator)) {
              accumulator = core_ns::add_to_float(
                  accumulator,
                  static_cast<double>(dots[r][c]) * core_ns::pow2(exponent_a[r] + exponent_b[c] - fraction_total));
            } else {
              accumulator = add_exact_value_inline(
                  accumulator,
                  scaled_block_dot(static_cast<double>(dots[r][c]), exponent_a[r], exponent_b[c], fraction_total));
            }
            continue;
          }
          const double contribution =
              scaled_block_dot(static_cast<double>(dots[r][c]), exponent_a[r], exponent_b[c], fraction_total);
          if (contribution != contribution) {
            nan_entries |= 1U << (r * integer_side + c);
          } else if (add_rounds(running[r][c], contribution)) {
            rounded_entries |= 1U << (r * integer_side + c);
          }
        }
      }
    }
    if constexpr (Mode == integer_mode::group) {
      // fl32(acc + the group's terms) for the entries whose `running` is their exact sum.
#pragma unroll
      for (int r = 0; r < integer_side; ++r) {
#pragma unroll
        for (int c = 0; c < integer_side; ++c) {
          const unsigned bit = 1U << (r * integer_side + c);
          if ((rounded_entries & bit) != 0) continue;
          float& accumulator = accumulators[r][c];
          if ((nan_entries & bit) != 0 || !is_finite(accumulator)) {
            accumulator = nonfinite_step(accumulator, (nan_entries & bit) != 0 ? canonical_nan_double() : 0.0);
          } else {
            accumulator = core_ns::add_to_float(accumulator, running[r][c] + 0.0);
          }
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < integer_side; ++r) {
#pragma unroll
    for (int c = 0; c < integer_side; ++c) {
      if (!row_inside[r] || !column_inside[c]) continue;
      const std::int64_t entry = (i0 + dot_row(r)) * n + j0 + dot_col(c);
      const unsigned bit = 1U << (r * integer_side + c);
      if constexpr (Mode == integer_mode::block) {
        out[entry] = finish_output(accumulators[r][c] * 1.0f, output);
      } else if constexpr (Mode == integer_mode::group) {
        if ((rounded_entries & bit) != 0) {
          flagged[entry] = 1;
        } else {
          out[entry] = finish_output(accumulators[r][c] * 1.0f, output);
        }
      } else {
        if ((nan_entries & bit) != 0) {
          out[entry] = finish_output(canonical_nan_float(), output);
          if (exact_out != nullptr) exact_out[entry] = canonical_nan_double();
        } else if ((rounded_entries & bit) != 0) {
          flagged[entry] = 1;
        } else {
          // `running` is the exact sum: the fp64 result itself, and one correctly rounded
          // conversion to fp32.
          out[entry] = finish_output(static_cast<float>(running[r][c]), output);
          if (exact_out != nullptr) exact_out[entry] = running[r][c];
        }
      }
    }
  }
}

// The entries integer_product_kernel flagged (fp32-group:G, exact), found by for_each_flagged, by the
// per-entry definitions: the block dots again from the operands; a group's scaled dots through
// add_exactly_to_float (one of them through add_exact_value), every scaled dot of an exact entry
// added to a long accumulator and rounded once (a NaN block gives the canonical NaN).
template <class Dot, integer_mode Mode>
__global__ void integer_fixup_kernel(const std::int32_t* a_values, const std::int32_t* a_exponents,
                                     const std::int32_t* b_values, const std::int32_t* b_exponents, std::int64_t m,
                                     std::int64_t n, std::int64_t depth, int block, std::int64_t blocks,
                                     int blocks_per_group, int fraction_total, output_rounding output,
                                     const std::uint8_t* flagged, float* out, double* exact_out) {
  for_each_flagged(flagged, m * n, [&](std::int64_t entry) {
    const std::int64_t i = entry / n;
    const std::int64_t j = entry % n;
    const auto scaled_dot = [&](std::int64_t b) {
      const std::int64_t k0 = b * block;
      const std::int64_t end = depth - k0 < block ? depth : k0 + block;
      Dot dot = 0;
      for (std::int64_t k = k0; k < end; ++k) {
        dot = multiply_add_exact(static_cast<Dot>(a_values[i * depth + k]), static_cast<Dot>(b_values[j * depth + k]),
                                 dot);
      }
      return scaled_block_dot(static_cast<double>(dot), a_exponents[b * m + i], b_exponents[b * n + j],
                              fraction_total);
    };
    if constexpr (Mode == integer_mode::exact) {
      core_ns::long_accumulator total;
      bool nan_entry = false;
      for (std::int64_t b = 0; b < blocks; ++b) {
        const double contribution = scaled_dot(b);
        if (contribution != contribution) {
          nan_entry = true;
        } else {
          total.add(contribution);
        }
      }
      if (nan_entry) {
        out[entry] = finish_output(canonical_nan_float(), output);
        if (exact_out != nullptr) exact_out[entry] = canonical_nan_double();
      } else {
        out[entry] = finish_output(round_total_to_float(total), output);
        if (exact_out != nullptr) exact_out[entry] = round_total_to_double(total);
      }
    } else {
      float accumulator = 0.0f;
      double terms[integer_max_group];
      for (std::int64_t group_begin = 0; group_begin < blocks; group_begin += blocks_per_group) {
        const std::int64_t group_end =
            blocks - group_begin < blocks_per_group ? blocks : group_begin + blocks_per_group;
        const int count = static_cast<int>(group_end - group_begin);
        for (int g = 0; g < count; ++g) terms[g] = scaled_dot(group_begin + g);
        if (count == 1) {
          accumulator = add_exact_value(accumulator, terms[0]);
          continue;
        }
        bool nan_term = false;
        for (int g = 0; g < count; ++g) nan_term = nan_term || terms[g] != terms[g];
        if (nan_term || !is_finite(accumulator)) {
          accumulator = nonfinite_step(accumulator, nan_term ? canonical_nan_double() : 0.0);
          continue;
        }
        accumulator = add_group_to_float(accumulator, terms, count);
      }
      out[entry] = finish_output(accumulator * 1.0f, output);
    }
  });
}

// Per row of an exponent array [blocks, rows]: the largest minus the smallest block exponent along
// K (1 << 20 with a NaN block), the smallest into lows, and the largest span over all rows in
// *largest. Span 0 in every row is integer_mode::whole's condition; the exact kernels' window tests
// read the spans, exact_wgmma_kernel's integer sums the lows.
__global__ void exponent_spans_kernel(const std::int32_t* exponents, std::int64_t rows, std::int64_t blocks,
                                      std::int32_t* spans, std::int32_t* lows, unsigned long long* largest) {
  unsigned long long local = 0;
  MXSCOPE_GRID_LOOP(r, rows) {
    std::int32_t low = exponents[r];
    std::int32_t high = low;
    bool nan_block = false;
    for (std::int64_t b = 0; b < blocks; ++b) {
      const std::int32_t e = exponents[b * rows + r];
      nan_block = nan_block || e == nan_block_exponent;
      low = e < low ? e : low;
      high = e > high ? e : high;
    }
    const std::int32_t span = nan_block || blocks == 0 ? (1 << 20) : high - low;
    spans[r] = span;
    lows[r] = low;
    local = static_cast<unsigned long long>(span) > local ? static_cast<unsigned long long>(span) : local;
  }
  unsigned long long reduced[1] = {local};
  constexpr int index[1] = {0};
  block_reduce_to<true>(reduced, largest, index);
}

struct exponent_span_data {
  device_buffer spans;       // int32 [rows]
  device_buffer lows;        // int32 [rows]: the row's smallest block exponent
  std::int64_t largest = 0;  // the largest span (0 without rows)
};

exponent_span_data exponent_spans(const prepared_operand::storage& operand) {
  exponent_span_data out;
  out.spans = device_buffer(static_cast<std::size_t>(std::max<std::int64_t>(operand.rows, 1)) * sizeof(std::int32_t));
  out.lows = device_buffer(static_cast<std::size_t>(std::max<std::int64_t>(operand.rows, 1)) * sizeof(std::int32_t));
  if (operand.rows == 0) return out;
  device_buffer largest(sizeof(unsigned long long));
  largest.fill_bytes(0);
  runtime::launch(exponent_spans_kernel, reduction_grid(operand.rows), threads_per_block, 0,
                  operand.exponents.as<const std::int32_t>(), operand.rows, operand.blocks, out.spans.as<std::int32_t>(),
                  out.lows.as<std::int32_t>(), largest.as<unsigned long long>());
  unsigned long long host = 0;
  largest.download(&host, sizeof(host));
  out.largest = static_cast<std::int64_t>(host);
  return out;
}

// True when every row of the operand has one block exponent along K, none a NaN block's
// (integer_mode::whole).
bool uniform_exponents(const prepared_operand::storage& operand) {
  if (operand.rows == 0 || operand.blocks == 0) return true;
  return exponent_spans(operand).largest == 0;
}

// The largest |integer element| of a tensor-core operand (tensor_core_element's codes).
[[maybe_unused]] std::int64_t tensor_core_integer_max(element_kind kind) {
  return kind == element_kind::fp4_e2m1 ? 12 : kind == element_kind::fp6_e2m3 ? 60 : 127;
}

template <class Dot>
void launch_integer(const prepared_operand::storage& a, const prepared_operand::storage& b,
                    const accumulation_model& model, output_rounding output, float* out, double* exact_out,
                    int fraction_total) {
  const dim3 grid(static_cast<unsigned>((b.rows + integer_tile - 1) / integer_tile),
                  static_cast<unsigned>((a.rows + integer_tile - 1) / integer_tile));
  const dim3 threads(256);
  const auto* av = a.integers.as<const std::int32_t>();
  const auto* ae = a.exponents.as<const std::int32_t>();
  const auto* bv = b.integers.as<const std::int32_t>();
  const auto* be = b.exponents.as<const std::int32_t>();
  const std::int64_t m = a.rows;
  const std::int64_t n = b.rows;
  if (model.kind == accumulation_kind::fp32_block) {
    runtime::launch(integer_product_kernel<Dot, integer_mode::block>, grid, threads, 0, av, ae, bv, be, m, n, a.depth,
                    a.block, a.blocks, 1, fraction_total, output, out, exact_out, nullptr);
    return;
  }
  if (model.kind != accumulation_kind::fp32_group && model.kind != accumulation_kind::exact) {
    throw input_error("gpu gemm: the integer path covers exact, fp32-block and fp32-group:G");
  }
  if (model.kind == accumulation_kind::exact &&
      bits_of(a.depth) + bits_of(integer_max_of(a.element)) + bits_of(integer_max_of(b.element)) <= 53 &&
      uniform_exponents(a) && uniform_exponents(b)) {
    runtime::launch(integer_product_kernel<double, integer_mode::whole>, grid, threads, 0, av, ae, bv, be, m, n,
                    a.depth, a.block, a.blocks, 1, fraction_total, output, out, exact_out, nullptr);
    return;
  }
  const int per_group = model.kind == accumulation_kind::fp32_group ? model.blocks_per_group : 1;
  device_buffer flagged(static_cast<std::size_t>(std::max<std::int64_t>(m * n, 1)));
  flagged.fill_bytes(0);
  if (model.kind == accumulation_kind::fp32_group) {
    runtime::launch(integer_product_kernel<Dot, integer_mode::group>, grid, threads, 0, av, ae, bv, be, m, n, a.depth,
                    a.block, a.blocks, per_group, fraction_total, output, out, exact_out, flagged.as<std::uint8_t>());
    runtime::launch(integer_fixup_kernel<Dot, integer_mode::group>, flag_scan_grid(m * n), threads_per_block, 0, av, ae,
                    bv, be, m, n, a.depth, a.block, a.blocks, per_group, fraction_total, output,
                    flagged.as<const std::uint8_t>(), out, exact_out);
  } else {
    runtime::launch(integer_product_kernel<Dot, integer_mode::exact>, grid, threads, 0, av, ae, bv, be, m, n, a.depth,
                    a.block, a.blocks, 1, fraction_total, output, out, exact_out, flagged.as<std::uint8_t>());
    runtime::launch(integer_fixup_kernel<Dot, integer_mode::exact>, flag_scan_grid(m * n), threads_per_block, 0, av, ae,
                    bv, be, m, n, a.depth, a.block, a.blocks, 1, fraction_total, output,
                    flagged.as<const std::uint8_t>(), out, exact_out);
  }
  synchronize();  // the flag buffer must outlive both kernels
}

