// Part of products.cu (included there, in order, inside namespace mxscope::gpu): the transposition
// of a device matrix (canonical operands of axis 0) and the largest finite magnitude of a result
// (the reference's error bound).

namespace {

// out [cols, rows] = values [rows, cols] transposed, through 32 x 32 tiles in shared memory.
constexpr int transpose_tile = 32;
__global__ void transpose_kernel(const float* values, std::int64_t rows, std::int64_t cols, float* out) {
  __shared__ float tile[transpose_tile][transpose_tile + 1];
  const std::int64_t row0 = static_cast<std::int64_t>(blockIdx.y) * transpose_tile;
  const std::int64_t col0 = static_cast<std::int64_t>(blockIdx.x) * transpose_tile;
  const int tx = static_cast<int>(threadIdx.x);
  for (int ty = static_cast<int>(threadIdx.y); ty < transpose_tile; ty += static_cast<int>(blockDim.y)) {
    const std::int64_t r = row0 + ty, c = col0 + tx;
    if (r < rows && c < cols) tile[ty][tx] = values[r * cols + c];
  }
  __syncthreads();
  for (int ty = static_cast<int>(threadIdx.y); ty < transpose_tile; ty += static_cast<int>(blockDim.y)) {
    const std::int64_t c = col0 + ty, r = row0 + tx;  // out row c, out column r
    if (r < rows && c < cols) out[c * rows + r] = tile[tx][ty];
  }
}

// The bits of the largest finite magnitude among values[0, count) (0 when none is finite and
// nonzero): the bit patterns of non-negative doubles order as the values do.
__global__ void largest_finite_magnitude_kernel(const double* values, std::int64_t count, unsigned long long* bits) {
  unsigned long long largest = 0;
  MXSCOPE_GRID_LOOP(i, count) {
    const unsigned long long magnitude = core_ns::double_bits(values[i]) & 0x7FFFFFFFFFFFFFFFULL;
    if (magnitude < 0x7FF0000000000000ULL && largest < magnitude) largest = magnitude;
  }
  unsigned long long reduced[1] = {largest};
  constexpr int index[1] = {0};
  block_reduce_to<true>(reduced, bits, index);
}

}  // namespace
