// The header-only core alone (mxscope::core): OCP's shared exponent of a block whose largest
// magnitude is 6.0 is 0 for MXFP4 (emax_elem 2, floor(log2 6) = 2).
#include <cstdio>

#include "mxscope/core/mx.hpp"

int main() {
  namespace core = mxscope::core;
  const int e = core::shared_exponent(core::element_kind::fp4_e2m1, core::scale_rule::floor, 6.0f);
  std::printf("consumer_core: shared exponent %d\n", e);
  return e == 0 ? 0 : 1;
}
