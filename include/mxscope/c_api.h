/* The C interface of libmxscope_c: the library's quantizers, emulated GEMMs and exact reference
 * on plain pointers, for bindings that load a shared library (the Python package mxscope does it
 * with ctypes, so it needs no Python headers and works with any Python and PyTorch version).
 *
 * Every function returns MXS_OK or an error code; mxs_last_error() then holds the message of the
 * calling thread's last failure (naming the field that is wrong). Inputs are read in place and
 * never modified; outputs go to buffers the caller allocated with the sizes mxs_quantize_layout
 * gives. Semantics: docs/numerics.md; layouts: docs/dump-format.md. */
#ifndef MXSCOPE_C_API_H
#define MXSCOPE_C_API_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MXS_C_API_VERSION 1

enum mxs_status { MXS_OK = 0, MXS_VALUE_ERROR = 1, MXS_TYPE_ERROR = 2, MXS_RUNTIME_ERROR = 3 };
enum mxs_dtype { MXS_F32 = 0, MXS_BF16 = 1, MXS_F16 = 2 };
enum mxs_device { MXS_CPU = 0, MXS_CUDA = 1 };
/* The scales output: per-block u8 codes (MX e8m0, NVFP4 ue4m3) or none (one fp32 tensor scale). */
enum mxs_scale_kind { MXS_BLOCK_SCALES = 0, MXS_TENSOR_SCALE = 1 };

/* One quantizer, as the flags of `mxscope quantize`. Strings are NUL-terminated; NULL takes the
 * default in brackets. */
typedef struct {
  const char* format;      /* mxfp4 mxfp6_e2m3 mxfp6_e3m2 mxfp8_e4m3 mxfp8_e5m2 mxint8 nvfp4 fp8_e4m3 fp8_e5m2 bf16 */
  int axis;                /* 0 or 1 of the [rows, cols] tensor */
  int block;               /* 0: the format's default (32 MX, 16 NVFP4) */
  const char* rounding;    /* rne rna rtz sr [rne] */
  const char* scale_rule;  /* floor ceil even [floor] */
  int rotation;            /* 0 (none) or the Hadamard block size */
  const char* signs;       /* none fixed per-step [none] */
  uint64_t seed;
  uint32_t step;
  const char* layer;       /* its FNV-1a hash tags the random streams [""] */
  const char* role;        /* x dy w, or NULL / "" for none: the stream's role */
  int sr_bits;             /* 1..32; 0 takes 32 */
  const char* seed_policy; /* per-step fixed [per-step] */
} mxs_quantize_options;

typedef struct {
  int64_t code_rows, code_cols;   /* u8 codes [code_rows, code_cols] */
  int64_t scale_rows, scale_cols; /* u8 block scales (MXS_BLOCK_SCALES), else 0 x 0 */
  int scale_kind;
  int block;                      /* the resolved block size (0 without blocks) */
} mxs_layout;

typedef struct {
  /* Buffers on the device of the call (host memory for MXS_CPU, CUDA memory for MXS_CUDA). */
  uint8_t* codes;             /* required */
  uint8_t* scales;            /* required with MXS_BLOCK_SCALES */
  float* dequantized;         /* optional fp32 [rows, cols] */
  uint16_t* operand_bf16;     /* optional bf16 [rows, cols]: values without the tensor scale */
  uint64_t* device_counters;  /* MXS_CUDA, optional: [4] added to on the device, no wait */
  /* Results (host). */
  float tensor_scale;         /* NVFP4 global decode scale, per-tensor fp8 scale, else 1 */
  int64_t nonzero, flushed, saturated, nonfinite; /* -1 where left on the device */
} mxs_quantize_result;

const char* mxs_version(void);
const char* mxs_last_error(void);
int mxs_cuda_device_count(void);
/* Makes CUDA device `index` current for the calling thread (as torch.cuda.set_device does). */
int mxs_cuda_select(int index);

int mxs_quantize_layout(const mxs_quantize_options* options, int64_t rows, int64_t cols, mxs_layout* out);

/* Rotates (options->rotation > 0) and quantizes input [rows, cols] (row-major) as `mxscope quantize`.
 * MXS_CUDA: every pointer is CUDA device memory and the work is queued on `stream` (a cudaStream_t;
 * NULL: the default stream); f16 input is MXS_CPU only. */
int mxs_quantize(const void* input, int dtype, int64_t rows, int64_t cols, int device, void* stream,
                 const mxs_quantize_options* options, mxs_quantize_result* result);

/* One emulated GEMM as `mxscope gemm` (host memory, fp32 operands): kind "fprop" (a = x [K, n_in],
 * b = w [n_out, n_in]), "dgrad" (a = dy [K, n_out], b = w) or "wgrad" (a = dy, b = x [K, n_in]). */
typedef struct {
  const char* kind;
  const char* format_a;  /* fp32 or a format of mxs_quantize_options */
  const char* format_b;
  mxs_quantize_options strategy; /* rounding, scale rule, rotation, signs, seed, step, layer,
                                    sr_bits, seed policy, block (format and axis, role unused) */
  const char* accumulation;      /* exact fp32-block fp32-group:G trunc-align:... trunc-promote:... fp32-seq */
  const char* output;            /* fp32 bf16 [fp32] */
  const char* reference;         /* exact fp64 [exact] */
  int device;                    /* MXS_CPU or MXS_CUDA (the GPU backend, on host buffers) */
} mxs_gemm_request;

typedef struct {
  double rel_err, cosine, bias, orth_err, max_abs_err, ulp_mean;
  int64_t ulp_max, nonfinite_out;
  /* Per operand (a, b): elements, nonzero, flushed, saturated, nonfinite, signal and error energy. */
  int64_t elements[2], nonzero[2], flushed[2], saturated[2], nonfinite[2];
  double signal_energy[2], error_energy[2];
} mxs_gemm_metrics;

/* out: fp32 [M, N]; reference: fp64 [M, N] or NULL. M, N as the kind gives them. */
int mxs_gemm(const mxs_gemm_request* request, const float* a, int64_t a_rows, int64_t a_cols, const float* b,
             int64_t b_rows, int64_t b_cols, float* out, double* reference, mxs_gemm_metrics* metrics);

/* The reference C = A B^T of fp32 A [m, k] and B [n, k] ("exact" or "fp64"): fp64 and fp32 results,
 * either may be NULL. */
int mxs_reference(const char* kind, int device, const float* a, const float* b, int64_t m, int64_t n, int64_t k,
                  double* out64, float* out32);

#ifdef __cplusplus
}
#endif

#endif /* MXSCOPE_C_API_H */
