// Part of products.cu (included there, in order, inside namespace mxscope::gpu):
// the exact reference of fp32 operands.
// ================================================================================================
// Exact reference of fp32 operands (NUMERICS.md section 8): the exact sum of the products rounded
// once to fp64 and to fp32. plain_tile_kernel (exact mode) computes every entry whose rows fit its
// 128-bit window; reference_kernel the others: one thread per entry adds every product (exact in
// fp64) to a long accumulator, or, where a row holds inf or NaN, forms the IEEE fp64 sum in
// ascending k, as src/reference.cpp defines.

namespace {

constexpr int reference_tile = 16;
constexpr int reference_chunk = 32;

__global__ void reference_kernel(const float* a, const float* b, plain_rows_view a_rows, plain_rows_view b_rows,
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
// left to reference_kernel. The offset keeps the spans of empty rows (high plain_empty_high, low 0)
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

// reference_on_device, and where nonfinite_rows is given, the number of rows of A and of B that
// hold inf or NaN (from the row descriptions the kernels use) into nonfinite_rows[0] and [1].
void reference_on_device_counting(const float* a, const float* b, std::int64_t m, std::int64_t n, std::int64_t k,
                                  double* out64, float* out32, std::int64_t* nonfinite_rows,
                                  const reference_scaling& scaling = {}) {
  if (m == 0 || n == 0) return;
  const plain_rows_data a_rows = describe_plain_rows(a, m, k);
  const plain_rows_data b_rows = describe_plain_rows(b, n, k);
  // Per operand the nonfinite rows and the largest span: reference_kernel runs only where some
  // entry does not fit the tiled kernel's window (on the benchmark's operands none), so that it is
  // not launched, with every tile checking its entries, for nothing.
  unsigned long long summary[4] = {};
  {
    scratch_buffer counts(sizeof(summary));
    counts.fill_bytes(0);
    runtime::launch(row_summary_kernel, grid_for(m), threads_per_block, 0, a_rows.view(), m,
                    counts.as<unsigned long long>());
    runtime::launch(row_summary_kernel, grid_for(n), threads_per_block, 0, b_rows.view(), n,
                    counts.as<unsigned long long>() + 2);
    counts.download(summary, sizeof(summary));
  }
  if (nonfinite_rows != nullptr) {
    nonfinite_rows[0] = static_cast<std::int64_t>(summary[0]);
    nonfinite_rows[1] = static_cast<std::int64_t>(summary[2]);
  }
  const int depth_bits = depth_bits_of(k);
#if defined(MXSCOPE_CUDA_TENSOR_CORES)
  runtime::allow_dynamic_shared(reference_warp_kernel<false>, rw_shared_bytes);
  runtime::allow_dynamic_shared(reference_warp_kernel<true>, rw_shared_bytes);
  const scratch_buffer a_tiles = chunk_tiles(a, m, k);
  const scratch_buffer b_tiles = chunk_tiles(b, n, k);
  runtime::launch(scaling.scaled ? reference_warp_kernel<true> : reference_warp_kernel<false>, plain_grid(m, n),
                  rw_threads, rw_shared_bytes, a_tiles.as<const float>(), b_tiles.as<const float>(),
                  a_rows.spreads.as<const std::int8_t>(), b_rows.spreads.as<const std::int8_t>(),
                  a_rows.super_spreads.as<const std::int8_t>(), b_rows.super_spreads.as<const std::int8_t>(),
                  a_rows.half_spreads.as<const std::int8_t>(), b_rows.half_spreads.as<const std::int8_t>(), a_rows.view(),
                  b_rows.view(), m, n, k, depth_bits, out32, out64, scaling.scale);
#else
  runtime::launch(scaling.scaled ? plain_tile_kernel<plain_mode::exact, true> : plain_tile_kernel<plain_mode::exact, false>,
                  plain_grid(m, n), 256, 0, a, b,
                  a_rows.spreads.as<const std::int8_t>(), b_rows.spreads.as<const std::int8_t>(),
                  a_rows.super_spreads.as<const std::int8_t>(), b_rows.super_spreads.as<const std::int8_t>(), a_rows.view(),
                  b_rows.view(), m, n, k, depth_bits, std::int64_t{1}, output_rounding::fp32, out32, out64, scaling.scale);
#endif
  const std::int64_t widest = static_cast<std::int64_t>(summary[1]) + static_cast<std::int64_t>(summary[3]) -
                              2 * plain_span_offset + 2 + depth_bits;
  if (widest > plain_window_bits) {
    const dim3 grid(static_cast<unsigned>((n + reference_tile - 1) / reference_tile),
                    static_cast<unsigned>((m + reference_tile - 1) / reference_tile));
    runtime::launch(reference_kernel, grid, reference_tile * reference_tile, 0, a, b, a_rows.view(), b_rows.view(), m,
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

