// Owning row-major 2-D matrices: the in-memory form of every operand after it is read (fp32) and of
// reference results (fp64).
#pragma once

#include <cstdint>
#include <vector>

namespace mxscope {

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

// Transposed copy.
template <class T>
basic_matrix<T> transposed(const basic_matrix<T>& input) {
  basic_matrix<T> out(input.cols, input.rows);
  for (std::int64_t r = 0; r < input.rows; ++r) {
    for (std::int64_t c = 0; c < input.cols; ++c) out(c, r) = input(r, c);
  }
  return out;
}

}  // namespace mxscope
