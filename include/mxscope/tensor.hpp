// Owning row-major 2-D matrices: the in-memory form of every operand after it is read (fp32) and of
// reference results (fp64).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace mxscope {

namespace gpu {
// A matrix in GPU memory (include/mxscope/gpu.hpp). Results that stay on the GPU between the stages
// of a replay are held through std::shared_ptr<const gpu::device_matrix>, which any translation unit
// can hold and destroy without the GPU backend's headers.
class device_matrix;
class device_buffer;
}  // namespace gpu
using device_matrix_ptr = std::shared_ptr<const gpu::device_matrix>;
using device_buffer_ptr = std::shared_ptr<const gpu::device_buffer>;

template <class T>
struct basic_matrix {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::vector<T> values;

  basic_matrix() = default;
  basic_matrix(std::int64_t row_count, std::int64_t col_count, T fill = T{})
      : rows(row_count), cols(col_count), values(static_cast<std::size_t>(row_count * col_count), fill) {}

  T& operator()(std::int64_t row, std::int64_t col) { return values[static_cast<std::size_t>(row * cols + col)]; }
  T operator()(std::int64_t row, std::int64_t col) const { return values[static_cast<std::size_t>(row * cols + col)]; }
  std::int64_t size() const { return rows * cols; }
  T* data() { return values.data(); }
  const T* data() const { return values.data(); }
};

using matrix = basic_matrix<float>;
using matrix64 = basic_matrix<double>;

// Transposed copy, in 32 x 32 tiles (each tile reads and writes whole cache lines), tile rows
// spread over the OpenMP threads where the caller is compiled with OpenMP.
template <class T>
basic_matrix<T> transposed(const basic_matrix<T>& input) {
  basic_matrix<T> out(input.cols, input.rows);
  constexpr std::int64_t tile = 32;
  const std::int64_t row_tiles = (input.rows + tile - 1) / tile;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (input.size() >= (std::int64_t{1} << 18))
#endif
  for (std::int64_t row_tile = 0; row_tile < row_tiles; ++row_tile) {
    const std::int64_t r0 = row_tile * tile;
    const std::int64_t r1 = r0 + tile < input.rows ? r0 + tile : input.rows;
    for (std::int64_t c0 = 0; c0 < input.cols; c0 += tile) {
      const std::int64_t c1 = c0 + tile < input.cols ? c0 + tile : input.cols;
      for (std::int64_t c = c0; c < c1; ++c) {
        for (std::int64_t r = r0; r < r1; ++r) out(c, r) = input(r, c);
      }
    }
  }
  return out;
}

}  // namespace mxscope
