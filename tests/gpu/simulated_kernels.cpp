// The GPU kernels of src/gpu/kernels.cu compiled as plain C++ against the CPU simulation of
// src/gpu/simulation.hpp: the same source, run on the host (see tests/gpu/CMakeLists.txt).
#ifndef MXSCOPE_GPU_SIMULATE
#define MXSCOPE_GPU_SIMULATE 1
#endif
#include "../../src/gpu/kernels.cu"
