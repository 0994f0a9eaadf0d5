// Whether the int8 tensor-core MMA and fp64 arithmetic run side by side on one GPU, or take turns
// on one pipe. The sliced e4m3 kernels (src/gpu/gemm_sliced*.cuh) spend their time on both: nine
// int8 mma per K-block and an fp64 step per entry and block; whether the two add up or overlap
// sets how far any kernel of that form can go. Four runs with the same grid:
//   imma   every warp: `imma_chains` dependent chains of mma.sync m16n8k32 s8, `iterations` each;
//   dfma   every thread: `dfma_chains` dependent DFMA chains, `iterations` x `dfma_per_iteration`;
//   both   every warp does both in one loop (the imma run's and the dfma run's work together);
//   split  even warps twice the imma work, odd warps twice the dfma work (the same totals as
//          `both`, the two kinds of instruction in different warps, as a warp-specialized kernel
//          would issue them).
// A `both` or `split` time near imma + dfma says one pipe; near max(imma, dfma), two. Built as
// mxscope_pipe_share with the GPU tests (tests/gpu/CMakeLists.txt; tools/gpu-test runs it), or:
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o pipe-share tools/bench/pipe-share.cu && ./pipe-share
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "cuda_check.cuh"

constexpr int imma_chains = 4;
constexpr int dfma_chains = 8;
constexpr int dfma_per_iteration = 2;
constexpr int iterations = 8192;

enum class mode { imma, dfma, both, split };

__device__ inline void imma(int (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();
#endif
}

template <mode Mode>
__global__ void pipe_kernel(const unsigned* in, double* out) {
  unsigned a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = in[(threadIdx.x + i) % 64];
  for (int i = 0; i < 2; ++i) b[i] = in[(threadIdx.x + 4 + i) % 64];
  int d[imma_chains][4] = {};
  double x[dfma_chains];
  for (int c = 0; c < dfma_chains; ++c) x[c] = static_cast<double>(in[c % 64] & 7U) + c;
  const double multiplier = 0.9999999;  // |x| stays bounded: x -> x m + 1e-3 converges
  const double addend = 1e-3;
  const bool even_warp = (threadIdx.x / 32) % 2 == 0;
  const bool run_imma = Mode == mode::imma || Mode == mode::both || (Mode == mode::split && even_warp);
  const bool run_dfma = Mode == mode::dfma || Mode == mode::both || (Mode == mode::split && !even_warp);
  const int rounds = Mode == mode::split ? 2 * iterations : iterations;
  for (int it = 0; it < rounds; ++it) {
    if (run_imma) {
#pragma unroll
      for (int c = 0; c < imma_chains; ++c) imma(d[c], a, b);
    }
    if (run_dfma) {
#pragma unroll
      for (int r = 0; r < dfma_per_iteration; ++r) {
#pragma unroll
        for (int c = 0; c < dfma_chains; ++c) x[c] = fma(x[c], multiplier, addend);
      }
    }
  }
  double sum = 0.0;
  for (int c = 0; c < imma_chains; ++c)
    for (int i = 0; i < 4; ++i) sum += d[c][i];
  for (int c = 0; c < dfma_chains; ++c) sum += x[c];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

template <mode Mode>
float time_ms(int blocks, int threads, const unsigned* in, double* out) {
  pipe_kernel<Mode><<<blocks, threads>>>(in, out);  // warm-up
  CHECK(cudaGetLastError());
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  const int repeats = 5;
  CHECK(cudaEventRecord(start));
  for (int r = 0; r < repeats; ++r) pipe_kernel<Mode><<<blocks, threads>>>(in, out);
  CHECK(cudaEventRecord(stop));
  CHECK(cudaEventSynchronize(stop));
  float ms = 0.0f;
  CHECK(cudaEventElapsedTime(&ms, start, stop));
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  return ms / repeats;
}

int main() {
  cudaDeviceProp properties{};
  CHECK(cudaGetDeviceProperties(&properties, 0));
  std::printf("%s, %d multiprocessors\n", properties.name, properties.multiProcessorCount);
  unsigned* in = nullptr;
  double* out = nullptr;
  CHECK(cudaMalloc(&in, 64 * sizeof(unsigned)));
  CHECK(cudaMemset(in, 0x11, 64 * sizeof(unsigned)));
  const int sms = properties.multiProcessorCount;
  const int threads = 256;
  for (int per_sm : {2, 4}) {
    const int blocks = sms * per_sm;
    CHECK(cudaMalloc(&out, static_cast<size_t>(blocks) * threads * sizeof(double)));
    const float imma_ms = time_ms<mode::imma>(blocks, threads, in, out);
    const float dfma_ms = time_ms<mode::dfma>(blocks, threads, in, out);
    const float both_ms = time_ms<mode::both>(blocks, threads, in, out);
    const float split_ms = time_ms<mode::split>(blocks, threads, in, out);
    const double warps = blocks * threads / 32.0;
    const double imma_ops = 2.0 * 16 * 8 * 32 * imma_chains * static_cast<double>(iterations) * warps;
    const double dfmas = static_cast<double>(dfma_chains) * dfma_per_iteration * iterations * warps * 32;
    std::printf("%d blocks x %d threads: imma %.3f ms (%.0f TOPS), dfma %.3f ms (%.2f T DFMA/s)\n", blocks, threads,
                imma_ms, imma_ops / (imma_ms * 1e-3) / 1e12, dfma_ms, dfmas / (dfma_ms * 1e-3) / 1e12);
    const float sum = imma_ms + dfma_ms;
    const float larger = std::max(imma_ms, dfma_ms);
    std::printf("  both in every warp: %.3f ms = %.2f of imma + dfma, %.2f of the larger\n", both_ms, both_ms / sum,
                both_ms / larger);
    std::printf("  split by warp:      %.3f ms = %.2f of imma + dfma, %.2f of the larger\n", split_ms, split_ms / sum,
                split_ms / larger);
    CHECK(cudaFree(out));
  }
  CHECK(cudaFree(in));
  return 0;
}
