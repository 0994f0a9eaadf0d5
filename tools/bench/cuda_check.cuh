// CHECK(call): print the failing CUDA runtime call and its error, then exit 1. Shared by the
// standalone GPU microbenchmarks of tools/bench (dmma-shapes.cu, pipe-share.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK(call)                                                                       \
  do {                                                                                    \
    const cudaError_t status_ = (call);                                                   \
    if (status_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(status_));               \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)
