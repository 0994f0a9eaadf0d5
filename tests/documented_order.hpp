// The canonical summation order of docs/numerics.md written out independently of the library
// (include/mxscope/compare.hpp), for tests: chunks of 4096 terms summed from +0.0 in index order,
// then adjacent partials added level by level, an odd last partial moving up unchanged.
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace test_order {

inline double documented_order(const std::vector<double>& terms) {
  std::vector<double> partials;
  for (std::size_t begin = 0; begin < terms.size(); begin += 4096) {
    double chunk = 0.0;
    for (std::size_t i = begin; i < std::min(terms.size(), begin + 4096); ++i) chunk = chunk + terms[i];
    partials.push_back(chunk);
  }
  if (partials.empty()) return 0.0;
  while (partials.size() > 1) {
    std::vector<double> next;
    for (std::size_t i = 0; i + 1 < partials.size(); i += 2) next.push_back(partials[i] + partials[i + 1]);
    if (partials.size() % 2 == 1) next.push_back(partials.back());
    partials = std::move(next);
  }
  return partials[0];
}

}  // namespace test_order
