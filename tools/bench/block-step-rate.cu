// The fp32-block step on the fp8 warpgroup MMA in isolation: what a K-block of a 128 x 256 tile
// costs a multiprocessor when every block dot starts from zero and is added to its fp32 sum by an
// fma (the MXFP4 kernel's form, tensor_core_scaled_kernel in src/gpu/gemm_sm90-inl.cuh), against
// the same mma accumulating in the tensor core (cuBLAS's form). No global loads, barriers or
// stores: two warpgroups per multiprocessor issue m64nNk32 e5m2 wgmma on tiles already in shared
// memory, four K-blocks per iteration.
//   chain n64, n128   every wgmma adds to its column piece's accumulators (scale-d 1);
//   fresh n64, S sets every wgmma starts from zero into one of S dot sets (a quarter goes into its
//                     set once the quarter S before is added), each dot then added by one fma,
//                     as in the MXFP4 kernel (two sets), the stream drained every B K-blocks
//                     (4 unless named; the kernel drains once per stage of 4); "add" adds each
//                     dot by an fadd instead (the bf16 form's step); "fma register" multiplies
//                     by a scale held in a register, "fma shared" by the K-block's two scales
//                     read from shared memory, as the kernel does.
// "random data" rows fill the tiles as MX operands would (fill::random), the others with ones.
// Prints TFLOP/s over the grid, cycles per 128 x 256 x 32 K-block of one multiprocessor (256 at
// the H100's dense fp8 peak) and the clock those imply (block 0's cycles over the kernel's time).
// Built as mxscope_block_step_rate with the GPU tests (tests/gpu/CMakeLists.txt; tools/gpu-test
// runs it), or:
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o block-step-rate tools/bench/block-step-rate.cu
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "cuda_check.cuh"

constexpr int threads = 256;      // two warpgroups
constexpr int tile_bytes = (128 + 256) * 128;  // A: 128 rows, B: 256 rows of 128 bytes (4 K-blocks)
constexpr int iterations = 2000;

// The shared-memory descriptor of a K-major tile in the 128-byte swizzle (src/gpu/gemm_sm90-inl.cuh).
__device__ inline std::uint64_t descriptor(const void* shared) {
  const auto address = static_cast<std::uint64_t>(__cvta_generic_to_shared(shared));
  return ((address & 0x3FFFFULL) >> 4) | (1ULL << 16) | ((1024ULL >> 4) << 32) | (1ULL << 62);
}
__device__ inline void fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ inline void commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int Pending>
__device__ inline void wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
#endif
}

// d (+)= A B^T, 64 x 64 fp32 from 64 x 32 e5m2 tiles of the descriptors; ScaleD 0 starts from zero.
template <int ScaleD>
__device__ inline void wgmma_n64(float (&d)[32], std::uint64_t a, std::uint64_t b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e5m2.e5m2 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "n"(ScaleD));
#else
  (void)d, (void)a, (void)b;
  __trap();
#endif
}

// d (+)= A B^T, 64 x 128 fp32 from 64 x 32 e5m2 tiles of the descriptors; ScaleD 0 starts from zero.
template <int ScaleD>
__device__ inline void wgmma_n128(float (&d)[64], std::uint64_t a, std::uint64_t b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e5m2.e5m2 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "n"(ScaleD));
#else
  (void)d, (void)a, (void)b;
  __trap();
#endif
}

// How the tiles are filled: e5m2 ones with every eighth word zero (few bits toggle), or random
// e5m2 numbers as MX operands give the kernel (random sign, exponent field 1..28, the low mantissa
// bit zero as for e2m1 codes, one byte in eight zero), which draw more power per mma.
enum class fill : int { ones, random };

// A 32-bit mix of i (the finaliser of MurmurHash3): the random fill's bytes.
__device__ inline unsigned mixed(unsigned i) {
  i ^= i >> 16;
  i *= 0x85EBCA6BU;
  i ^= i >> 13;
  i *= 0xC2B2AE35U;
  return i ^ (i >> 16);
}

// The 1024-byte aligned tiles in `raw`, filled by the block as `pattern` says.
__device__ inline unsigned char* filled_tiles(unsigned char* raw, fill pattern) {
  const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(raw));
  unsigned char* const tiles = raw + ((1024U - (base & 1023U)) & 1023U);
  for (int i = threadIdx.x; i < tile_bytes / 4; i += threads) {
    unsigned word = (i & 7) != 0 ? 0x3c3c3c3cU : 0U;
    if (pattern == fill::random) {
      word = 0;
      for (int byte = 0; byte < 4; ++byte) {
        const unsigned r = mixed(static_cast<unsigned>(4 * i + byte) * 2654435761U + blockIdx.x);
        const unsigned code = (r & 7) == 0 ? 0U : (r & 0x80U) | ((1U + (r >> 8) % 28U) << 2) | ((r >> 16) & 2U);
        word |= code << (8 * byte);
      }
    }
    reinterpret_cast<unsigned*>(tiles)[i] = word;
  }
  __syncthreads();
  return tiles;
}

// The accumulators' sum (so that no mma is left out) and the block's cycle count.
template <int Pieces, int Registers>
__device__ inline void report(const float (&acc)[Pieces][Registers], long long elapsed, float* out, long long* cycles) {
  float sum = 0.0f;
  for (int p = 0; p < Pieces; ++p)
    for (int i = 0; i < Registers; ++i) sum += acc[p][i];
  out[blockIdx.x * threads + threadIdx.x] = sum;
  if (threadIdx.x == 0) cycles[blockIdx.x] = elapsed;
}

// Chain: every K-block of the 64 x 256 warpgroup tile as 256 / N wgmma adding to accumulators.
template <int N>
__global__ void __launch_bounds__(threads, 1) chain_kernel(float* out, long long* cycles, fill pattern) {
  extern __shared__ __align__(1024) unsigned char raw[];
  unsigned char* const tiles = filled_tiles(raw, pattern);
  const std::uint64_t a = descriptor(tiles + (threadIdx.x / 128) * 64 * 128);
  const std::uint64_t b = descriptor(tiles + 128 * 128);
  constexpr int pieces = 256 / N;
  float acc[pieces][N / 2] = {};
  const long long start = clock64();
  for (int it = 0; it < iterations; ++it) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
      for (int p = 0; p < pieces; ++p) {
        fence();
        if constexpr (N == 64) wgmma_n64<1>(acc[p], a + 2 * k, b + 2 * k + p * 64 * 128 / 16);
        if constexpr (N == 128) wgmma_n128<1>(acc[p], a + 2 * k, b + 2 * k + p * 128 * 128 / 16);
        commit();
      }
    }
  }
  wait<0>();
  report(acc, clock64() - start, out, cycles);
}

// Fresh dots: the 4 Blocks quarters (64 x 64) of Blocks K-blocks as one stream in Sets dot sets,
// each quarter's dot added to its accumulators as Step says: by an fma with the immediate 0.5, by
// an fadd, by an fma with a scale held in a register for the whole run, or by an fma with one of
// the K-block's two scales read from shared memory at each K-block (the MXFP4 kernel's form: one
// for B's first 128 rows, one for its second).
enum class step { fma_immediate, fadd, fma_register, fma_shared };

template <int Sets, int Blocks = 4, step Step = step::fma_immediate>
__global__ void __launch_bounds__(threads, 1) fresh_kernel(float* out, long long* cycles, fill pattern) {
  extern __shared__ __align__(1024) unsigned char raw[];
  __shared__ float scale_table[4][2];
  if (threadIdx.x < 8) scale_table[threadIdx.x / 2][threadIdx.x % 2] = 0.5f;
  unsigned char* const tiles = filled_tiles(raw, pattern);  // (its barrier also publishes the table)
  float held = scale_table[0][0];
  asm volatile("" : "+f"(held));  // not a constant to the compiler
  const std::uint64_t a = descriptor(tiles + (threadIdx.x / 128) * 64 * 128);
  const std::uint64_t b = descriptor(tiles + 128 * 128);
  float dots[Sets][32] = {};
  float acc[4][32] = {};
  constexpr int quarters = 4 * Blocks;
  const auto issue = [&](int q) {  // K-block q / 4 of the stream reads the tiles' K-block (q / 4) % 4
    fence();
    wgmma_n64<0>(dots[q % Sets], a + 2 * ((q / 4) % 4), b + 2 * ((q / 4) % 4) + (q % 4) * 64 * 128 / 16);
    commit();
  };
  const long long start = clock64();
  for (int it = 0; it < iterations * 4 / Blocks; ++it) {
#pragma unroll
    for (int q = 0; q < Sets - 1; ++q) issue(q);
    float scales[2] = {held, held};
#pragma unroll
    for (int q = 0; q < quarters; ++q) {
      if (Step == step::fma_shared && q % 4 == 0) {
        // volatile: read at every K-block, as the kernel reads each stage's bases
        scales[0] = *static_cast<volatile float*>(&scale_table[(q / 4) % 4][0]);
        scales[1] = *static_cast<volatile float*>(&scale_table[(q / 4) % 4][1]);
      }
      if (q + Sets - 1 < quarters) issue(q + Sets - 1);
      const int later = (q + Sets < quarters ? q + Sets : quarters) - q - 1;  // issued after q
      if (later >= 2) {
        wait<2>();
      } else if (later == 1) {
        wait<1>();
      } else {
        wait<0>();
      }
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        float& sum = acc[q % 4][i];
        const float dot = dots[q % Sets][i];
        if constexpr (Step == step::fma_immediate) sum = __fmaf_rn(dot, 0.5f, sum);
        if constexpr (Step == step::fadd) sum = __fadd_rn(sum, dot);
        if constexpr (Step == step::fma_register || Step == step::fma_shared) sum = __fmaf_rn(dot, scales[(q % 4) / 2], sum);
      }
    }
  }
  report(acc, clock64() - start, out, cycles);
}

template <class Kernel>
void run(const char* name, Kernel kernel, int blocks, float* out, long long* cycles, fill pattern = fill::ones) {
  const int shared_bytes = tile_bytes + 1024;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes));
  kernel<<<blocks, threads, shared_bytes>>>(out, cycles, pattern);  // warm-up
  CHECK(cudaGetLastError());
  cudaEvent_t begin, end;
  CHECK(cudaEventCreate(&begin));
  CHECK(cudaEventCreate(&end));
  CHECK(cudaEventRecord(begin));
  kernel<<<blocks, threads, shared_bytes>>>(out, cycles, pattern);
  CHECK(cudaEventRecord(end));
  CHECK(cudaEventSynchronize(end));
  float ms = 0.0f;
  CHECK(cudaEventElapsedTime(&ms, begin, end));
  long long first = 0;
  CHECK(cudaMemcpy(&first, cycles, sizeof first, cudaMemcpyDeviceToHost));
  const double k_blocks = 4.0 * iterations;  // per multiprocessor, 128 x 256 x 32 each
  const double flops = 2.0 * 128 * 256 * 32 * k_blocks * blocks;
  std::printf("block-step rate %-40s %8.3f ms  %7.1f TFLOP/s  %6.1f cycles per 128 x 256 x 32 K-block, %.2f GHz\n",
              name, ms, flops / (ms * 1e-3) / 1e12, static_cast<double>(first) / k_blocks,
              static_cast<double>(first) / (ms * 1e6));
  CHECK(cudaEventDestroy(begin));
  CHECK(cudaEventDestroy(end));
}

int main() {
  cudaDeviceProp properties{};
  CHECK(cudaGetDeviceProperties(&properties, 0));
  if (properties.major != 9) {
    std::printf("block-step rate: needs an sm_90 device (this one is sm_%d%d); skipped\n", properties.major,
                properties.minor);
    return 0;
  }
  const int blocks = properties.multiProcessorCount;
  float* out = nullptr;
  long long* cycles = nullptr;
  CHECK(cudaMalloc(&out, sizeof(float) * blocks * threads));
  CHECK(cudaMalloc(&cycles, sizeof(long long) * blocks));
  std::printf("device: %s, %d multiprocessors\n", properties.name, blocks);
  run("chain n64", chain_kernel<64>, blocks, out, cycles);
  run("chain n128", chain_kernel<128>, blocks, out, cycles);
  run("fresh n64, 2 sets, fma", fresh_kernel<2>, blocks, out, cycles);
  run("fresh n64, 3 sets, fma", fresh_kernel<3>, blocks, out, cycles);
  run("fresh n64, 2 sets, B 8, fma", fresh_kernel<2, 8>, blocks, out, cycles);
  run("fresh n64, 2 sets, B 16, fma", fresh_kernel<2, 16>, blocks, out, cycles);
  run("fresh n64, 3 sets, B 16, fma", fresh_kernel<3, 16>, blocks, out, cycles);
  run("fresh n64, 2 sets, add", fresh_kernel<2, 4, step::fadd>, blocks, out, cycles);
  run("fresh n64, 2 sets, fma register", fresh_kernel<2, 4, step::fma_register>, blocks, out, cycles);
  run("fresh n64, 2 sets, fma shared", fresh_kernel<2, 4, step::fma_shared>, blocks, out, cycles);
  run("fresh n64, 3 sets, fma shared", fresh_kernel<3, 4, step::fma_shared>, blocks, out, cycles);
  run("chain n128, random data", chain_kernel<128>, blocks, out, cycles, fill::random);
  run("fresh n64, 2 sets, fma shared, random data", fresh_kernel<2, 4, step::fma_shared>, blocks, out, cycles,
      fill::random);
  run("fresh n64, 3 sets, B 16, fma, random data", fresh_kernel<3, 16>, blocks, out, cycles, fill::random);
  CHECK(cudaFree(out));
  CHECK(cudaFree(cycles));
  return 0;
}
