// Throughput of the fp64 tensor-core shapes of mma.sync on one GPU (sm_90 and later for the
// m16n8k* shapes): each warp runs `chains` independent accumulator sets through `iterations`
// mmas, enough thread blocks fill every multiprocessor, and the rate counts 2 M N K operations per
// mma. The plain-operand and integer kernels (src/gpu/products.cu) pick their DMMA shape by it, and
// tools/gpu-test runs it after the benchmark (the fp64 tensor-core peak of the same run). Built as
// mxscope_dmma_shapes with the GPU tests (tests/gpu/CMakeLists.txt), or alone:
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o dmma-shapes tools/bench/dmma-shapes.cu && ./dmma-shapes
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "cuda_check.cuh"

constexpr int chains = 4;

template <int K>
__device__ inline void step(double (&d)[4], const double (&a)[8], const double (&b)[4]);

template <>
__device__ inline void step<4>(double (&d)[4], const double (&a)[8], const double (&b)[4]) {
  // m8n8k4: two of them cover the 16 x 8 tile of the others
  asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};\n"
               : "+d"(d[0]), "+d"(d[1]) : "d"(a[0]), "d"(b[0]));
  asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};\n"
               : "+d"(d[2]), "+d"(d[3]) : "d"(a[1]), "d"(b[0]));
}
// The m16n8k* shapes exist from sm_90 on; older builds trap there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define MXSCOPE_NO_M16N8_F64 1
#endif

template <>
__device__ inline void step<8>(double (&d)[4], const double (&a)[8], const double (&b)[4]) {
#if defined(MXSCOPE_NO_M16N8_F64)
  __trap();
#else
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
               : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
#endif
}
template <>
__device__ inline void step<16>(double (&d)[4], const double (&a)[8], const double (&b)[4]) {
#if defined(MXSCOPE_NO_M16N8_F64)
  __trap();
#else
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, "
               "{%4, %5, %6, %7, %8, %9, %10, %11}, {%12, %13, %14, %15}, {%0, %1, %2, %3};\n"
               : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
               : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]),
                 "d"(b[0]), "d"(b[1]), "d"(b[2]), "d"(b[3]));
#endif
}

template <int K>
__global__ void shape_kernel(const double* in, double* out, int iterations) {
  double a[8], b[4], d[chains][4];
  for (int i = 0; i < 8; ++i) a[i] = in[(threadIdx.x + i) % 64];
  for (int i = 0; i < 4; ++i) b[i] = in[(threadIdx.x + 8 + i) % 64];
  for (int c = 0; c < chains; ++c)
    for (int i = 0; i < 4; ++i) d[c][i] = 0.0;
  for (int it = 0; it < iterations; ++it) {
#pragma unroll
    for (int c = 0; c < chains; ++c) step<K>(d[c], a, b);
  }
  double sum = 0.0;
  for (int c = 0; c < chains; ++c)
    for (int i = 0; i < 4; ++i) sum += d[c][i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

template <int K>
void measure(const char* name, int blocks, int threads, const double* in, double* out) {
  const int iterations = 4096 * 16 / K;  // the same operations for every shape
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  shape_kernel<K><<<blocks, threads>>>(in, out, iterations);  // warm-up
  CHECK(cudaGetLastError());
  CHECK(cudaEventRecord(start));
  const int repeats = 5;
  for (int r = 0; r < repeats; ++r) shape_kernel<K><<<blocks, threads>>>(in, out, iterations);
  CHECK(cudaEventRecord(stop));
  CHECK(cudaEventSynchronize(stop));
  float ms = 0.0f;
  CHECK(cudaEventElapsedTime(&ms, start, stop));
  const double operations = 2.0 * 16 * 8 * K * chains * static_cast<double>(iterations) * (blocks * threads / 32.0) * repeats;
  std::printf("%-10s %4d blocks x %4d threads: %8.2f TFLOP/s\n", name, blocks, threads, operations / (ms * 1e-3) / 1e12);
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
}

int main() {
  cudaDeviceProp properties{};
  CHECK(cudaGetDeviceProperties(&properties, 0));
  std::printf("%s, %d multiprocessors\n", properties.name, properties.multiProcessorCount);
  double* in = nullptr;
  double* out = nullptr;
  CHECK(cudaMalloc(&in, 64 * sizeof(double)));
  CHECK(cudaMemset(in, 0, 64 * sizeof(double)));
  const int sms = properties.multiProcessorCount;
  CHECK(cudaMalloc(&out, static_cast<size_t>(sms) * 8 * 1024 * sizeof(double)));
  for (int per_sm : {1, 2, 4}) {
    for (int threads : {128, 256}) {
      measure<4>("m8n8k4", sms * per_sm, threads, in, out);
      measure<8>("m16n8k8", sms * per_sm, threads, in, out);
      measure<16>("m16n8k16", sms * per_sm, threads, in, out);
    }
  }
  CHECK(cudaFree(in));
  CHECK(cudaFree(out));
  return 0;
}
