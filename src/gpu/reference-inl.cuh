// Part of products.cu (included there, in order, inside namespace mxscope::gpu):
// the exact reference of fp32 operands.
// ================================================================================================
// Exact reference of fp32 operands (NUMERICS.md section 8): the exact sum of the products rounded
// once to fp64 and to fp32. plain_tile_kernel (exact mode) computes every entry whose rows fit its
// 128-bit window; reference_entry_kernel the others: one thread per entry adds every product (exact in
// fp64) to a long accumulator, or, where a row holds inf or NaN, forms the IEEE fp64 sum in
// ascending k, as src/reference.cpp defines.

namespace {

constexpr int reference_tile = 16;
constexpr int reference_chunk = 32;

__global__ void reference_entry_kernel(const float* a, const float* b, plain_rows_view a_rows, plain_rows_view b_rows,
                                 std::int64_t m, std::int64_t n, std::int64_t depth, int depth_bits, double* out64,
                                 float* out32, reference_scaling scaling) {
  __shared__ float a_tile[reference_tile][reference_chunk + 1];
  __shared__ float b_tile[reference_tile][reference_chunk + 1];
  __shared__ int tile_needed;
  const int tx = threadIdx.x % reference_tile;
  const int ty = threadIdx.x / reference_tile;
  const std::int64_t i0 = static_cast<std::int64_t>(blockIdx.y) * reference_tile;
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * reference_tile;
  const std::int64_t i = i0 + ty;
  const std::int64_t j = j0 + tx;
  const bool active =
      i < m && j < n && !plain_fits(a_rows.low[i], a_rows.high[i], b_rows.low[j], b_rows.high[j], depth_bits);
  // A tile without such entries leaves at once (the same decision for every thread of the block).
  if (threadIdx.x == 0) tile_needed = 0;
  __syncthreads();
  if (active) tile_needed = 1;
  __syncthreads();
  if (tile_needed == 0) return;
  const bool ieee = active && (a_rows.high[i] == plain_nonfinite_high || b_rows.high[j] == plain_nonfinite_high);
  core_ns::long_accumulator total;
  double sum = 0.0;
  for (std::int64_t k0 = 0; k0 < depth; k0 += reference_chunk) {
    const int chunk = depth - k0 < reference_chunk ? static_cast<int>(depth - k0) : reference_chunk;
    for (int t = threadIdx.x; t < reference_tile * reference_chunk; t += blockDim.x) {
      const int row = t / reference_chunk;
      const int kk = t % reference_chunk;
      const bool inside = kk < chunk;
      a_tile[row][kk] = (inside && i0 + row < m) ? a[(i0 + row) * depth + k0 + kk] : 0.0f;
      b_tile[row][kk] = (inside && j0 + row < n) ? b[(j0 + row) * depth + k0 + kk] : 0.0f;
    }
    __syncthreads();
    if (active) {
      for (int kk = 0; kk < chunk; ++kk) {
        const double product = static_cast<double>(a_tile[ty][kk]) * static_cast<double>(b_tile[tx][kk]);
        if (ieee) {
          sum += product;
        } else if (scaling.scaled) {
          core_ns::add_scaled_exactly(total, product, scaling.scale);
        } else {
          total.add(product);
        }
      }
    }
    __syncthreads();
  }
  if (!active) return;
  const std::int64_t entry = i * n + j;
  if (ieee) {
    if (out64 != nullptr) out64[entry] = canonical(sum);
    if (out32 != nullptr) out32[entry] = canonical(static_cast<float>(sum));
  } else {
    if (out64 != nullptr) out64[entry] = round_total_to_double(total);
    if (out32 != nullptr) out32[entry] = round_total_to_float(total);
  }
}

}  // namespace

namespace {

#if defined(MXSCOPE_CUDA_TENSOR_CORES)
// The operand x [rows, depth] in chunk tiles (chunk_tiles_kernel), for reference_warp_kernel and
// block_warp_kernel.
scratch_buffer chunk_tiles(const float* x, std::int64_t rows, std::int64_t depth) {
  const std::int64_t chunks = (depth + plain_chunk - 1) / plain_chunk;
  const std::int64_t total = (rows + plain_tile - 1) / plain_tile * chunks * plain_tile * plain_chunk;
  scratch_buffer out(static_cast<std::size_t>(std::max<std::int64_t>(total, 1)) * sizeof(float));
  const dim3 grid(static_cast<unsigned>(chunks),
                  static_cast<unsigned>(std::min<std::int64_t>((rows + plain_tile - 1) / plain_tile, 65535)));
  if (total > 0) runtime::launch(chunk_tiles_kernel, grid, threads_per_block, 0, x, rows, depth, chunks, out.as<float>());
  return out;
}
#endif

// What the host needs of an operand's row descriptions: out[0] += the rows marked as holding inf
// or NaN, out[1] = max(out[1], the largest high - low over the rows + plain_span_offset). An entry
// (i, j) fits the tiled kernel's window exactly when span(i) + span(j) + 2 + depth_bits <=
// plain_window_bits (plain_fits), so the largest spans of the two operands say whether any entry is
// left to reference_entry_kernel. The offset keeps the spans of empty rows (high plain_empty_high, low 0)
// nonnegative; the nonfinite marker's span is the largest.
constexpr std::int64_t plain_span_offset = -plain_empty_high;

__global__ void row_summary_kernel(plain_rows_view view, std::int64_t rows, unsigned long long* out) {
  unsigned long long marked = 0;
  unsigned long long largest = 0;
  MXSCOPE_GRID_LOOP(r, rows) {
    marked += view.high[r] == plain_nonfinite_high;
    const std::int64_t span = static_cast<std::int64_t>(view.high[r]) - view.low[r] + plain_span_offset;
    const unsigned long long shifted = span > 0 ? static_cast<unsigned long long>(span) : 0ULL;
    largest = shifted > largest ? shifted : largest;
  }
  if (marked != 0) atomicAdd(out, marked);
  if (largest != 0) atomicMax(out + 1, largest);
}

// ---- The order of K for the tiled kernels. The exact sums do not depend on the order of the
// products, but how often an entry keeps its fp64 dot across a super-chunk does: the spread budget
// counts each row's exponent range over the super-chunk's K. Where the operands carry a scale per
// position along K (per token, in captured activations and gradients), K as captured mixes tokens
// of every scale into each chunk; sorted by the tokens' scales, a chunk holds tokens of like scale.
// A position's key is the largest leading exponent of its column + token_key_offset (0 where the
// column holds no nonzero finite value).
constexpr unsigned token_key_offset = 256;

__global__ void token_keys_kernel(const float* x, std::int64_t rows, std::int64_t depth, unsigned* keys) {
  const std::int64_t k = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= depth) return;
  unsigned key = 0;
  for (std::int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const std::uint32_t bits = core_ns::float_bits(x[r * depth + k]);
    const int field = static_cast<int>((bits >> 23) & 0xffU);
    const std::uint32_t fraction = bits & 0x7fffffU;
    if (field == 0xff || (field == 0 && fraction == 0)) continue;
    const int leading = field != 0 ? field - 127 : -149 + 31 - __builtin_clz(fraction);
    const unsigned candidate = static_cast<unsigned>(leading + static_cast<int>(token_key_offset));
    key = candidate > key ? candidate : key;
  }
  if (key != 0) atomicMax(keys + k, key);
}

std::vector<unsigned> token_keys(const float* x, std::int64_t rows, std::int64_t depth) {
  std::vector<unsigned> keys(static_cast<std::size_t>(depth), 0U);
  if (rows == 0 || depth == 0) return keys;
  scratch_buffer device_keys(keys.size() * sizeof(unsigned));
  device_keys.fill_bytes(0);
  const dim3 grid(static_cast<unsigned>((depth + threads_per_block - 1) / threads_per_block),
                  static_cast<unsigned>(std::min<std::int64_t>(rows, 64)));
  runtime::launch(token_keys_kernel, grid, threads_per_block, 0, x, rows, depth, device_keys.as<unsigned>());
  device_keys.download(keys.data(), keys.size() * sizeof(unsigned));
  return keys;
}

// out [rows, depth] = x with its columns in `order` (out(r, k) = x(r, order[k])): rows along y,
// positions along x, so that no thread divides by depth.
__global__ void permute_columns_kernel(const float* x, std::int64_t rows, std::int64_t depth,
                                       const std::int32_t* order, float* out) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    for (std::int64_t k = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < depth; k += stride) {
      out[r * depth + k] = x[r * depth + order[k]];
    }
  }
}

scratch_buffer permuted_columns(const float* x, std::int64_t rows, std::int64_t depth, const scratch_buffer& order) {
  scratch_buffer out(static_cast<std::size_t>(std::max<std::int64_t>(rows * depth, 1)) * sizeof(float));
  if (rows * depth > 0) {
    const std::int64_t blocks = (depth + threads_per_block - 1) / threads_per_block;
    const dim3 grid(static_cast<unsigned>(std::min<std::int64_t>(blocks, 64)),
                    static_cast<unsigned>(std::min<std::int64_t>(rows, 65535)));
    runtime::launch(permute_columns_kernel, grid, threads_per_block, 0, x, rows, depth, order.as<const std::int32_t>(),
                    out.as<float>());
  }
  return out;
}

std::atomic<bool> last_reference_was_reordered{false};

// The exponents a candidate order's groups of `length` positions span: per group and operand the
// largest key less the smallest nonzero one (0 for a group without), summed.
std::int64_t spanned_exponents(const std::vector<std::int32_t>& order, const std::vector<unsigned>& keys,
                               std::size_t length) {
  std::int64_t total = 0;
  for (std::size_t first = 0; first < order.size(); first += length) {
    unsigned low = std::numeric_limits<unsigned>::max(), high = 0;
    for (std::size_t p = first; p < std::min(order.size(), first + length); ++p) {
      const unsigned key = keys[static_cast<std::size_t>(order[p])];
      if (key == 0) continue;
      low = std::min(low, key);
      high = std::max(high, key);
    }
    if (high != 0) total += static_cast<std::int64_t>(high - low);
  }
  return total;
}

// `order` stably sorted by keys[order[p]]: a least-significant-digit radix sort, one byte of the
// key a pass, where a pass whose byte is the same in every key is skipped (the keys of
// token_keys differ in their low two bytes only), so that the sort is linear in K.
void stable_sort_by_key(std::vector<std::int32_t>& order, const std::vector<unsigned>& keys) {
  std::vector<std::int32_t> sorted(order.size());
  for (int shift = 0; shift < 32; shift += 8) {
    std::array<std::size_t, 257> start{};
    for (const std::int32_t p : order) ++start[((keys[static_cast<std::size_t>(p)] >> shift) & 0xffU) + 1];
    if (std::find(start.begin(), start.end(), order.size()) != start.end()) continue;
    for (std::size_t digit = 1; digit < start.size(); ++digit) start[digit] += start[digit - 1];
    for (const std::int32_t p : order) sorted[start[(keys[static_cast<std::size_t>(p)] >> shift) & 0xffU]++] = p;
    order.swap(sorted);
  }
}

}  // namespace

std::vector<std::int32_t> reference_token_order(const std::vector<unsigned>& a_keys,
                                                const std::vector<unsigned>& b_keys) {
  if (a_keys.size() != b_keys.size()) {
    throw input_error("reference_token_order: A has " + std::to_string(a_keys.size()) + " keys, B " +
                      std::to_string(b_keys.size()));
  }
  if (a_keys.size() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) return {};
  const auto cost = [&](const std::vector<std::int32_t>& order) {
    std::int64_t total = 0;
    for (const std::size_t length :
         {std::size_t{plain_super_chunks * plain_chunk}, std::size_t{plain_half_chunks * plain_chunk}}) {
      total += spanned_exponents(order, a_keys, length) + spanned_exponents(order, b_keys, length);
    }
    return total;
  };
  std::vector<std::int32_t> identity(a_keys.size());
  for (std::size_t p = 0; p < identity.size(); ++p) identity[p] = static_cast<std::int32_t>(p);
  // A reordered K costs a copy of both operands; it is taken where it saves at least two
  // exponents a group (of 256 and of 128 positions) on average. No order saves more than K as it
  // is spans, so below that no sort is needed.
  const std::size_t groups = (identity.size() + 255) / 256 + (identity.size() + 127) / 128;
  const std::int64_t threshold = 2 * static_cast<std::int64_t>(groups);
  const std::int64_t identity_cost = cost(identity);
  if (identity_cost < threshold) return {};
  // Stable by (first, second): by the second key, then stably by the first.
  const auto sorted_by = [&](const std::vector<unsigned>& first, const std::vector<unsigned>& second) {
    std::vector<std::int32_t> order = identity;
    stable_sort_by_key(order, second);
    stable_sort_by_key(order, first);
    return order;
  };
  std::vector<std::int32_t> best = sorted_by(a_keys, b_keys);
  std::int64_t best_cost = cost(best);
  std::vector<std::int32_t> other = sorted_by(b_keys, a_keys);
  if (const std::int64_t other_cost = cost(other); other_cost < best_cost) {
    best = std::move(other);
    best_cost = other_cost;
  }
  if (identity_cost - best_cost < threshold) return {};
  return best;
}

bool last_reference_reordered() { return last_reference_was_reordered.load(); }

// ---- The reference on int8 slices (reference_kernel::sliced): where every row of an operand is an
// integer below 2^18 times 2^(its lowest set bit), the operands are in the form of the sliced
// kernel's whole-K dot (gemm_sliced-inl.cuh, "Whole K"): one scale per row along K, element
// integers below 2^18. Its levels summed in int32 over K <= 2^16 and combined in fp64 give each
// entry's exact sum as an integer below 2^52 times 2^(low_i + low_j) >= 2^-298, a normal double:
// the fp64 result itself, and one rounding to fp32, as the definition asks.

namespace {

std::atomic<reference_kernel> chosen_reference_kernel{reference_kernel::automatic};
std::atomic<reference_kernel> last_run_reference_kernel{reference_kernel::automatic};

#if defined(MXSCOPE_CUDA_TENSOR_CORES)
constexpr std::int64_t sliced_reference_span = 17;  // leading less lowest exponent of a row: integers below 2^18

// prepare_sliced_kernel's form of an fp32 operand whose row r is an integer below 2^18 times
// 2^lows[r] (the row descriptions' lowest set-bit exponents, 0 for a row of zeros): slices
// [padded rows][blocks][3][32] and scales [blocks][padded rows] = 2^lows[r]; rows past the end
// zero with scale 1.
__global__ void prepare_sliced_plain_kernel(const float* values, const std::int32_t* lows, std::int64_t rows,
                                            std::int64_t padded_rows, std::int64_t depth, std::int64_t blocks,
                                            std::uint8_t* slices, double* scales) {
  MXSCOPE_GRID_LOOP(index, padded_rows * blocks) {
    const std::int64_t r = index / blocks;
    const std::int64_t b = index % blocks;
    std::uint32_t words[slc_slices][8] = {};
    double scale = 1.0;
    if (r < rows) {
      const int low = lows[r];
      scale = core_ns::pow2(low);
      const auto slice = [&](int k, float value) {
        const std::uint32_t bits = core_ns::float_bits(value);
        const int field = static_cast<int>((bits >> 23) & 0xffU);
        const std::uint32_t significand = field == 0 ? (bits & 0x7fffffU) : ((bits & 0x7fffffU) | 0x800000U);
        if (significand == 0) return;
        const int trailing = 31 - __builtin_clz(significand & (0U - significand));
        const int lowest = (field == 0 ? -149 : field - 150) + trailing;  // >= low, within 17 bits of it
        const auto magnitude = static_cast<std::int32_t>((significand >> trailing) << (lowest - low));
        slice_integer(words, k, (bits >> 31) != 0U ? -magnitude : magnitude);
      };
      const std::int64_t k0 = b * 32;
      for_each_in_block(values + r * depth + k0, k0, depth, reinterpret_cast<std::uintptr_t>(values) % 16 == 0, slice);
    }
    store_sliced_block(slices, index, words);
    scales[b * padded_rows + r] = scale;
  }
}

// The reference of A [m, k] and B [n, k] on sliced_block_kernel's whole-K dot, the operands meeting
// the conditions above (sliced_reference_applies). Returns when the kernels have run.
void reference_on_slices(const float* a, const float* b, const plain_rows_data& a_rows, const plain_rows_data& b_rows,
                         std::int64_t m, std::int64_t n, std::int64_t k, double* out64, float* out32) {
  using tiling = slc_tiling_of<false>;
  const std::int64_t blocks = (k + 31) / 32;
  const std::int64_t padded_m = (m + slc_row_pad - 1) / slc_row_pad * slc_row_pad;
  const std::int64_t padded_n = (n + slc_col_pad - 1) / slc_col_pad * slc_col_pad;
  const auto prepare = [&](const float* x, const plain_rows_data& rows, std::int64_t count, std::int64_t padded) {
    std::pair<scratch_buffer, scratch_buffer> form{
        scratch_buffer(static_cast<std::size_t>(padded * blocks * slc_row_block_bytes)),
        scratch_buffer(static_cast<std::size_t>(padded * blocks) * sizeof(double))};
    runtime::launch(prepare_sliced_plain_kernel, grid_for(padded * blocks), threads_per_block, 0, x,
                    rows.lows.as<const std::int32_t>(), count, padded, k, blocks, form.first.as<std::uint8_t>(),
                    form.second.as<double>());
    return form;
  };
  const auto a_form = prepare(a, a_rows, m, padded_m);
  const auto b_form = prepare(b, b_rows, n, padded_n);
  const std::int64_t tiles_m = (m + slc_tile_m - 1) / slc_tile_m;
  const std::int64_t tiles_n = (n + tiling::tile_n - 1) / tiling::tile_n;
  constexpr std::size_t shared_bytes = slc_shared_bytes<tiling::tile_n>;
  runtime::allow_dynamic_shared(sliced_block_kernel<true, true>, shared_bytes);
  runtime::launch(sliced_block_kernel<true, true>, static_cast<unsigned>(tiles_m * tiles_n), slc_threads, shared_bytes,
                  a_form.first.as<const std::uint8_t>(), a_form.second.as<const double>(),
                  b_form.first.as<const std::uint8_t>(), b_form.second.as<const double>(), m, n, padded_m, padded_n,
                  blocks, tiles_m, tiles_n, output_rounding::fp32, out32, out64, static_cast<std::uint8_t*>(nullptr),
                  static_cast<float*>(nullptr));
  synchronize();  // the prepared forms must outlive the kernel
}
#endif

// Whether the sliced reference takes these operands, from the row summaries (row_summary_kernel's
// pairs for A and B) and the shape.
bool sliced_reference_applies(const unsigned long long (&summary)[4], std::int64_t m, std::int64_t n, std::int64_t k,
                              const reference_scaling& scaling) {
  if (chosen_reference_kernel.load() == reference_kernel::tiles || !reference_kernel_available(reference_kernel::sliced)) {
    return false;
  }
#if defined(MXSCOPE_CUDA_TENSOR_CORES)
  const auto fits = [](unsigned long long largest) {
    return static_cast<std::int64_t>(largest) - plain_span_offset <= sliced_reference_span;
  };
  const std::int64_t tiles = ((m + slc_tile_m - 1) / slc_tile_m) * ((n + slc_wide::tile_n - 1) / slc_wide::tile_n);
  constexpr std::int64_t int_limit = std::numeric_limits<int>::max() / 2;
  return !scaling.scaled && summary[0] == 0 && summary[2] == 0 && fits(summary[1]) && fits(summary[3]) && k > 0 &&
         k <= slc_whole_depth_limit && tiles * tcb_group <= int_limit;
#else
  (void)summary, (void)m, (void)n, (void)k, (void)scaling;
  return false;
#endif
}

}  // namespace

std::string_view reference_kernel_name(reference_kernel kernel) {
  switch (kernel) {
    case reference_kernel::automatic:
      return "automatic";
    case reference_kernel::tiles:
      return "tiles";
    case reference_kernel::sliced:
      return "sliced";
  }
  return "?";
}

bool reference_kernel_available(reference_kernel kernel) {
#if defined(MXSCOPE_CUDA_TENSOR_CORES)
  return kernel != reference_kernel::sliced || tensor_cores_present();
#else
  return kernel != reference_kernel::sliced;
#endif
}

void select_reference_kernel(reference_kernel kernel) {
  require_kernel_available(reference_kernel_available(kernel), "exact-reference", reference_kernel_name(kernel));
  chosen_reference_kernel.store(kernel);
}

reference_kernel last_reference_kernel() { return last_run_reference_kernel.load(); }

namespace {

// reference_on_device, and where nonfinite_rows is given, the number of rows of A and of B that
// hold inf or NaN (from the row descriptions the kernels use) into nonfinite_rows[0] and [1].
void reference_on_device_counting(const float* a, const float* b, std::int64_t m, std::int64_t n, std::int64_t k,
                                  double* out64, float* out32, std::int64_t* nonfinite_rows,
                                  const reference_scaling& scaling = {}) {
  if (m == 0 || n == 0) return;
  // Per operand the nonfinite rows and the largest span (the same in any order of K): whether the
  // sliced kernel takes the operands, and below whether reference_entry_kernel runs.
  std::optional<plain_rows_data> a_described(describe_plain_rows(a, m, k));
  std::optional<plain_rows_data> b_described(describe_plain_rows(b, n, k));
  unsigned long long summary[4] = {};
  {
    scratch_buffer counts(sizeof(summary));
    counts.fill_bytes(0);
    runtime::launch(row_summary_kernel, grid_for(m), threads_per_block, 0, a_described->view(), m,
                    counts.as<unsigned long long>());
    runtime::launch(row_summary_kernel, grid_for(n), threads_per_block, 0, b_described->view(), n,
                    counts.as<unsigned long long>() + 2);
    counts.download(summary, sizeof(summary));
  }
  if (nonfinite_rows != nullptr) {
    nonfinite_rows[0] = static_cast<std::int64_t>(summary[0]);
    nonfinite_rows[1] = static_cast<std::int64_t>(summary[2]);
  }
  if (sliced_reference_applies(summary, m, n, k, scaling)) {
#if defined(MXSCOPE_CUDA_TENSOR_CORES)
    last_run_reference_kernel.store(reference_kernel::sliced);
    last_reference_was_reordered.store(false);
    reference_on_slices(a, b, *a_described, *b_described, m, n, k, out64, out32);
    return;
#endif
  }
  last_run_reference_kernel.store(reference_kernel::tiles);
  // The tiled kernels take K in reference_token_order (a and b reordered into copies, their rows
  // described again: the chunks' spreads depend on the order), the per-product kernel below K as
  // it is: a and b themselves (the rows' lowest and leading exponents, all it reads of the row
  // descriptions, are the same in any order).
  const std::vector<std::int32_t> order = reference_token_order(token_keys(a, m, k), token_keys(b, n, k));
  last_reference_was_reordered.store(!order.empty());
  scratch_buffer a_reordered, b_reordered;
  const float* tiled_a = a;
  const float* tiled_b = b;
  if (!order.empty()) {
    scratch_buffer device_order(order.size() * sizeof(std::int32_t));
    device_order.upload(order.data(), device_order.bytes());
    a_reordered = permuted_columns(a, m, k, device_order);
    b_reordered = permuted_columns(b, n, k, device_order);
    tiled_a = a_reordered.as<const float>();
    tiled_b = b_reordered.as<const float>();
    synchronize();  // device_order must outlive the kernels, the rows' first descriptions the summary
    a_described.emplace(describe_plain_rows(tiled_a, m, k));
    b_described.emplace(describe_plain_rows(tiled_b, n, k));
  }
  const plain_rows_data& a_rows = *a_described;
  const plain_rows_data& b_rows = *b_described;
  const int depth_bits = depth_bits_of(k);
#if defined(MXSCOPE_CUDA_TENSOR_CORES)
  runtime::allow_dynamic_shared(reference_warp_kernel<false>, rw_shared_bytes);
  runtime::allow_dynamic_shared(reference_warp_kernel<true>, rw_shared_bytes);
  const scratch_buffer a_tiles = chunk_tiles(tiled_a, m, k);
  const scratch_buffer b_tiles = chunk_tiles(tiled_b, n, k);
  runtime::launch(scaling.scaled ? reference_warp_kernel<true> : reference_warp_kernel<false>, plain_grid(m, n),
                  rw_threads, rw_shared_bytes, a_tiles.as<const float>(), b_tiles.as<const float>(),
                  a_rows.spreads.as<const std::int8_t>(), b_rows.spreads.as<const std::int8_t>(),
                  a_rows.super_spreads.as<const std::int8_t>(), b_rows.super_spreads.as<const std::int8_t>(),
                  a_rows.half_spreads.as<const std::int8_t>(), b_rows.half_spreads.as<const std::int8_t>(), a_rows.view(),
                  b_rows.view(), m, n, k, depth_bits, out32, out64, scaling.scale);
#else
  runtime::launch(scaling.scaled ? plain_tile_kernel<plain_mode::exact, true> : plain_tile_kernel<plain_mode::exact, false>,
                  plain_grid(m, n), 256, 0, tiled_a, tiled_b,
                  a_rows.spreads.as<const std::int8_t>(), b_rows.spreads.as<const std::int8_t>(),
                  a_rows.super_spreads.as<const std::int8_t>(), b_rows.super_spreads.as<const std::int8_t>(), a_rows.view(),
                  b_rows.view(), m, n, k, depth_bits, std::int64_t{1}, output_rounding::fp32, out32, out64, scaling.scale);
#endif
  const std::int64_t widest = static_cast<std::int64_t>(summary[1]) + static_cast<std::int64_t>(summary[3]) -
                              2 * plain_span_offset + 2 + depth_bits;
  if (widest > plain_window_bits) {
    const dim3 grid(static_cast<unsigned>((n + reference_tile - 1) / reference_tile),
                    static_cast<unsigned>((m + reference_tile - 1) / reference_tile));
    runtime::launch(reference_entry_kernel, grid, reference_tile * reference_tile, 0, a, b, a_rows.view(), b_rows.view(), m,
                    n, k, depth_bits, out64, out32, scaling);
  }
  synchronize();  // the row metadata must outlive the kernels
}

}  // namespace

void reference_on_device(const float* a, const float* b, std::int64_t m, std::int64_t n, std::int64_t k, double* out64,
                         float* out32) {
  reference_on_device_counting(a, b, m, n, k, out64, out32, nullptr);
}

namespace {

std::atomic<plain_block_kernel> chosen_plain_block_kernel{plain_block_kernel::automatic};
std::atomic<plain_block_kernel> last_run_plain_block_kernel{plain_block_kernel::automatic};

// The fp32-block product on block_warp_kernel unless the tile kernel is selected (or the build has
// none); false when it did not run.
bool launch_block_warp(const float* a, const float* b, const plain_rows_data& a_rows, const plain_rows_data& b_rows,
                       std::int64_t m, std::int64_t n, std::int64_t depth, int depth_bits, output_rounding output,
                       float* out) {
#if defined(MXSCOPE_CUDA_TENSOR_CORES)
  if (chosen_plain_block_kernel.load() == plain_block_kernel::tile || !tensor_cores_present()) return false;
  const scratch_buffer a_tiles = chunk_tiles(a, m, depth);
  const scratch_buffer b_tiles = chunk_tiles(b, n, depth);
  runtime::allow_dynamic_shared(block_warp_kernel, bw_shared_bytes);
  runtime::launch(block_warp_kernel, plain_grid(m, n), rw_threads, bw_shared_bytes, a_tiles.as<const float>(),
                  b_tiles.as<const float>(), a_rows.spreads.as<const std::int8_t>(),
                  b_rows.spreads.as<const std::int8_t>(), a_rows.view(), b_rows.view(), m, n, depth, depth_bits, output,
                  out);
  synchronize();  // the chunk tiles must outlive the kernel
  return true;
#else
  (void)a, (void)b, (void)a_rows, (void)b_rows, (void)m, (void)n, (void)depth, (void)depth_bits, (void)output, (void)out;
  return false;
#endif
}

}  // namespace

std::string_view plain_block_kernel_name(plain_block_kernel kernel) {
  switch (kernel) {
    case plain_block_kernel::automatic:
      return "automatic";
    case plain_block_kernel::tile:
      return "tile";
    case plain_block_kernel::warp:
      return "warp";
  }
  return "?";
}

bool plain_block_kernel_available(plain_block_kernel kernel) {
#if defined(MXSCOPE_CUDA_TENSOR_CORES)
  return kernel != plain_block_kernel::warp || tensor_cores_present();
#else
  return kernel != plain_block_kernel::warp;
#endif
}

void select_plain_block_kernel(plain_block_kernel kernel) {
  require_kernel_available(plain_block_kernel_available(kernel), "plain-operand", plain_block_kernel_name(kernel));
  chosen_plain_block_kernel.store(kernel);
}

plain_block_kernel last_plain_block_kernel() { return last_run_plain_block_kernel.load(); }

void plain_product_on_device(const float* a, const float* b, std::int64_t m, std::int64_t n, std::int64_t depth,
                             int block, const accumulation_model& model, output_rounding output, float* out) {
  if (block < 1) throw input_error("gpu gemm: field 'block' must be positive");
  if (model.kind != accumulation_kind::fp32_block && model.kind != accumulation_kind::fp32_group &&
      model.kind != accumulation_kind::fp32_seq) {
    throw input_error("gpu gemm: unscaled operands run fp32-block, fp32-group:G and fp32-seq on the GPU");
  }
  if (model.kind == accumulation_kind::fp32_group && model.blocks_per_group < 1) {
    throw input_error("gpu gemm: field 'accum': G must be positive");
  }
  if (m == 0 || n == 0) return;
  const std::int64_t blocks = (depth + block - 1) / block;
  // Every block scale is 2^0: the exponent buffers [blocks, rows] of the per-product kernel are zero.
  device_buffer a_exponents(static_cast<std::size_t>(std::max<std::int64_t>(blocks * m, 1)) * sizeof(std::int32_t));
  device_buffer b_exponents(static_cast<std::size_t>(std::max<std::int64_t>(blocks * n, 1)) * sizeof(std::int32_t));
  a_exponents.fill_bytes(0);
  b_exponents.fill_bytes(0);
  const unsigned grid = grid_for(m * n, 128);
  const auto* ax = a_exponents.as<const std::int32_t>();
  const auto* bx = b_exponents.as<const std::int32_t>();
  const int group = model.kind == accumulation_kind::fp32_group ? model.blocks_per_group : 1;
  const std::int64_t group_length = static_cast<std::int64_t>(block) * group;
  if (model.kind == accumulation_kind::fp32_seq) {
    runtime::launch(generic_product_kernel<generic_mode::sequential>, grid, 128, 0, a, ax, b, bx, m, n, depth, block,
                    1, output, out, static_cast<double*>(nullptr), plain_rows_view{}, plain_rows_view{}, 0);
  } else if (group_length % plain_chunk != 0) {
    // Steps that end inside a chunk: the per-product kernel for every entry.
    runtime::launch(generic_product_kernel<generic_mode::grouped>, grid, 128, 0, a, ax, b, bx, m, n, depth, block,
                    group, output, out, static_cast<double*>(nullptr), plain_rows_view{}, plain_rows_view{}, 0);
  } else {
    // The tiled kernel for the entries whose rows fit its window, the per-product kernel for the rest.
    const plain_rows_data a_rows = describe_plain_rows(a, m, depth);
    const plain_rows_data b_rows = describe_plain_rows(b, n, depth);
    const int depth_bits = depth_bits_of(depth);
    const std::int64_t chunks_per_group = group_length / plain_chunk;
    const auto* a_spreads = a_rows.spreads.as<const std::int8_t>();
    const auto* b_spreads = b_rows.spreads.as<const std::int8_t>();
    const std::int8_t* const no_spreads = nullptr;  // super-chunks: exact mode only
    if (chunks_per_group == 1 && launch_block_warp(a, b, a_rows, b_rows, m, n, depth, depth_bits, output, out)) {
      last_run_plain_block_kernel.store(plain_block_kernel::warp);
    } else if (chunks_per_group == 1) {
      last_run_plain_block_kernel.store(plain_block_kernel::tile);
      runtime::launch(plain_tile_kernel<plain_mode::block>, plain_grid(m, n), 256, 0, a, b, a_spreads, b_spreads,
                      no_spreads, no_spreads,
                      a_rows.view(), b_rows.view(), m, n, depth, depth_bits, chunks_per_group, output, out,
                      static_cast<double*>(nullptr), core_ns::tensor_scale_product{});
    } else {
      runtime::launch(plain_tile_kernel<plain_mode::group>, plain_grid(m, n), 256, 0, a, b, a_spreads, b_spreads,
                      no_spreads, no_spreads,
                      a_rows.view(), b_rows.view(), m, n, depth, depth_bits, chunks_per_group, output, out,
                      static_cast<double*>(nullptr), core_ns::tensor_scale_product{});
    }
    runtime::launch(generic_product_kernel<generic_mode::grouped>, grid, 128, 0, a, ax, b, bx, m, n, depth, block,
                    group, output, out, static_cast<double*>(nullptr), a_rows.view(), b_rows.view(), depth_bits);
  }
  synchronize();  // the buffers above must outlive the kernels
}

