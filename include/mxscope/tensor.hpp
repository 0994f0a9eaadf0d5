// Owning row-major 2-D fp32 matrix: the in-memory form of every operand after it is read.
#pragma once

#include <cstdint>
#include <vector>

namespace mxscope {

struct matrix {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::vector<float> values;

  matrix() = default;
  matrix(std::int64_t row_count, std::int64_t col_count, float fill = 0.0f)
      : rows(row_count), cols(col_count), values(static_cast<std::size_t>(row_count * col_count), fill) {}

  float& operator()(std::int64_t row, std::int64_t col) { return values[static_cast<std::size_t>(row * cols + col)]; }
  float operator()(std::int64_t row, std::int64_t col) const {
    return values[static_cast<std::size_t>(row * cols + col)];
  }
  std::int64_t size() const { return rows * cols; }
  float* data() { return values.data(); }
  const float* data() const { return values.data(); }
};

}  // namespace mxscope
