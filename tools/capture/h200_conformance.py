#!/usr/bin/env python3
"""Records hardware GEMM outputs on an NVIDIA GPU (written for the H200) as mxscope conformance
cases (docs/dump-format.md, "GEMM conformance cases"; docs/conformance.md):

- fp8_mxfp4_K<k>: torch._scaled_mm on float8_e4m3fn operands with unit fp32 scales and fp32 output.
  The operands hold MXFP4 values: e2m1 values times a power-of-two scale per 32-element block along
  K, block exponents in [-4, 3], so every value is an exact e4m3 number and the fp8 GEMM multiplies
  exactly the MXFP4 operand. Stored as mxfp4 codes + e8m0 scales (what the GPU multiplied, bit for bit).
- fp8_e4m3_K<k>: the same GEMM on random finite e4m3 values (all exponents): stored as mxfp8_e4m3
  codes with unit block scales (e8m0 code 127).
- bf16_mxfp4_K<k>: a bf16 GEMM with fp32 output on the MXFP4-valued operands (exact in bf16).
- bf16_random_K<k> (K up to --bf16-random-max-k): a bf16 GEMM on random bf16 values, stored as BF16.

M = N = 128 and K in {32, 64, 128, 256, 512, 1024, 4096} by default (--suite base). --suite stress
writes operand classes chosen to separate hypotheses about the accumulator (M = N = 64 unless noted):

- fp8_randn_K<k>: randn x 2^r per row (r in -6..5), clamped to +-448 and rounded to e4m3: narrow
  spread inside a dot product, cancellation, subnormals in the rows scaled down (the issue's class).
- fp8_subnormal_K<k>: e4m3 codes with exponent fields 0..2 only (subnormals and the smallest normals).
- fp8_cancel_K<k>: rows whose products cancel exactly (pairs inside one 32-product step, and halves
  of K against each other), rows of +0 and of -0 (signed-zero results), the rest randn.
- fp8_edge_K<k>: in every 32-product step one large anchor product and the others 10..17 binades
  below its exponent sum: the alignment window's edge.
- fp8_randn_K<k> with k not a multiple of 32 (48, 80, 208, 1040) and fp8_tiles_K256 (M = 512,
  N = 384: many output tiles).
- fp8_scaled_K256 / fp8_pow2scaled_K256: non-unit per-tensor scales (scale_a, scale_b in the
  metadata as float.hex), fp8_bf16out_K256: bf16 output.
- fp8_e5m2xe4m3_K<k>, fp8_e4m3xe5m2_K<k>: one e5m2 operand (randn x 2^r, r in -16..8: e5m2
  subnormals included).
- bf16_long_K<k> (k in 2048..16384) and bf16_randn_K<k>: the bf16 GEMM at long K and on randn rows.

--suite probe maps how a GEMM splits K into separately accumulated segments (bf16 and fp8):
output (i, j) is 1 + 1.5 x 2^-24, a unit product at position P_j = s j + 1 and a small one at
Q_i = s i + s/2 + 1 (s = K / M): where both fall into one truncating accumulation the small term
is truncated away (out = 1), where they are summed in separate segments and added in fp32 with
round-to-nearest it survives (out = 1 + 2^-23). Cases bf16_probe_M<m>_K<k> and fp8_probe_M<m>_K<k>
(fp8: unit products 16, small ones 1.5 x 2^-12, below the 13-bit window: the same test).

The output directory holds
manifest.json (format "mxscope-conformance") and one safetensors file per case, with provenance
(torch and CUDA versions, device name, cuBLAS settings) in the manifest's source and each file's
metadata. Each case runs twice; metadata "out.repeat_identical" says whether both runs agreed.

Usage on the GPU machine (Python 3.12, torch with CUDA, safetensors optional):
    python3 tools/capture/h200_conformance.py --out data/conformance/h200
    python3 tools/capture/h200_conformance.py --suite stress --out data/conformance/h200-stress
The same command runs unchanged on ROCm PyTorch (an MI355X: --out data/conformance/mi355x); the
provenance then names the platform, the HIP version, the gfx architecture and hipBLASLt.
Then, where mxscope is built:
    mxscope conform data/conformance/h200 --fit

--cpu-dry-run writes the same files with "out" computed on the CPU in float64 and rounded to fp32
(NOT hardware; for testing the file layout on a machine without a GPU or without float8 dtypes).
Exit status: 0 when every fp8 case was recorded (bf16 failures are reported, not fatal), 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import traceback
from typing import Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_lite  # noqa: E402  (fallback writer, same directory)

try:  # the package is faster and is the reference; the fallback writes the same layout
    from safetensors.torch import save_file as _package_save_file
except ImportError:  # pragma: no cover - depends on the machine
    _package_save_file = None

# e2m1 magnitudes by 3-bit magnitude code (OCP MX v1.0).
E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
BLOCK = 32
DEFAULT_SIZES = [32, 64, 128, 256, 512, 1024, 4096]


def has_float8() -> bool:
    return hasattr(torch, "float8_e4m3fn")


def decode_e4m3(code: int) -> float:
    """OCP e4m3 'fn' value of a code (NaN for S.1111.111)."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent = (code >> 3) & 0xF
    mantissa = code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return float("nan")
    if exponent == 0:
        return sign * mantissa / 8.0 * 2.0 ** -6
    return sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)


def mxfp4_operand(rows: int, k: int, generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random MXFP4 operand [rows, k]: returns (values fp32, packed codes u8 [rows, k/2], e8m0 scales
    u8 [rows, k/32]). Element 2i sits in the low nibble of byte i (float4_e2m1fn_x2 convention)."""
    if k % BLOCK != 0:
        raise ValueError(f"K = {k} must be a multiple of {BLOCK}")
    codes = torch.randint(0, 16, (rows, k), generator=generator, dtype=torch.int64)
    exponents = torch.randint(-4, 4, (rows, k // BLOCK), generator=generator, dtype=torch.int64)
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)[codes & 0x7]
    signs = torch.where((codes & 0x8) != 0, -1.0, 1.0).to(torch.float64)
    scales = torch.pow(2.0, exponents.repeat_interleave(BLOCK, dim=1).to(torch.float64))
    values = (signs * magnitudes * scales).to(torch.float32)  # exact: 3 significant bits, small exponents
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scale_codes = (exponents + 127).to(torch.uint8)
    return values, packed, scale_codes


def e4m3_operand(rows: int, k: int, generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random finite e4m3 values [rows, k] over every exponent: (values fp32, codes u8, unit scales)."""
    magnitude_codes = torch.randint(0, 0x7F, (rows, k), generator=generator, dtype=torch.int64)  # 0x7F is NaN
    sign = torch.randint(0, 2, (rows, k), generator=generator, dtype=torch.int64) << 7
    codes = magnitude_codes | sign
    table = torch.tensor([decode_e4m3(c) for c in range(256)], dtype=torch.float64)
    values = table[codes].to(torch.float32)
    scale_codes = torch.full((rows, k // BLOCK), 127, dtype=torch.uint8)
    return values, codes.to(torch.uint8), scale_codes


def decode_e5m2(code: int) -> float:
    """OCP e5m2 value of a code (inf for S.11111.00, NaN for S.11111.xx, xx != 0)."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent = (code >> 2) & 0x1F
    mantissa = code & 0x3
    if exponent == 0x1F:
        return sign * float("inf") if mantissa == 0 else float("nan")
    if exponent == 0:
        return sign * mantissa / 4.0 * 2.0 ** -14
    return sign * (1.0 + mantissa / 4.0) * 2.0 ** (exponent - 15)


FP8_DECODERS = {"e4m3": decode_e4m3, "e5m2": decode_e5m2}
FP8_MX_FORMATS = {"e4m3": "mxfp8_e4m3", "e5m2": "mxfp8_e5m2"}


def fp8_codes(values: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values -> fp8 codes (u8) by round-to-nearest, ties to the even code, saturating at the
    largest finite value (the clamp the stress classes apply anyway). Written out here rather than
    with torch's float8 casts so that --cpu-dry-run runs on a torch without float8 dtypes."""
    decode = FP8_DECODERS[fmt]
    magnitudes = [(decode(c), c) for c in range(0x80) if decode(c) == decode(c) and decode(c) != float("inf")]
    table = torch.tensor([m for m, _ in magnitudes], dtype=torch.float64)
    codes = torch.tensor([c for _, c in magnitudes], dtype=torch.int64)
    x = values.double().abs().clamp(max=float(table[-1]))
    upper = torch.searchsorted(table, x).clamp(max=len(table) - 1)
    lower = (upper - 1).clamp(min=0)
    below = x - table[lower]
    above = table[upper] - x
    pick_upper = (above < below) | ((above == below) & (codes[upper] % 2 == 0))
    index = torch.where(pick_upper, upper, lower)
    magnitude_codes = codes[index]
    sign = ((values < 0) | ((values == 0) & (torch.signbit(values) if hasattr(torch, "signbit") else values < 0)))
    return (magnitude_codes | (sign.to(torch.int64) << 7)).to(torch.uint8)


def fp8_values(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    decode = FP8_DECODERS[fmt]
    table = torch.tensor([decode(c) for c in range(256)], dtype=torch.float32)
    return table[codes.to(torch.int64)]


def randn_rows(rows: int, k: int, generator: torch.Generator, low: int, high: int, clamp: float) -> torch.Tensor:
    """randn x 2^r, r uniform in [low, high] per row, clamped to +-clamp (fp32)."""
    normal = torch.randn((rows, k), generator=generator, dtype=torch.float32)
    exponents = torch.randint(low, high + 1, (rows, 1), generator=generator).to(torch.float32)
    return (normal * torch.pow(2.0, exponents)).clamp(-clamp, clamp)


def bf16_random_operand(rows: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """Gaussian values with a power-of-two magnitude per 32-element block (2^-8 .. 2^8), in bf16."""
    normal = torch.randn((rows, k), generator=generator, dtype=torch.float32)
    exponents = torch.randint(-8, 9, (rows, k // BLOCK), generator=generator).repeat_interleave(BLOCK, dim=1)
    return (normal * torch.pow(2.0, exponents.to(torch.float32))).to(torch.bfloat16)


def cublas_settings() -> Dict[str, str]:
    settings: Dict[str, str] = {}
    matmul = torch.backends.cuda.matmul
    for name in ("allow_tf32", "allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction"):
        try:
            settings[f"torch.backends.cuda.matmul.{name}"] = str(getattr(matmul, name))
        except Exception as error:  # noqa: BLE001 - provenance is best effort
            settings[f"torch.backends.cuda.matmul.{name}"] = f"unreadable: {error}"
    try:
        settings["torch.get_float32_matmul_precision"] = torch.get_float32_matmul_precision()
    except Exception:  # noqa: BLE001
        pass
    try:
        settings["torch.backends.cuda.preferred_blas_library"] = str(torch.backends.cuda.preferred_blas_library())
    except Exception:  # noqa: BLE001
        pass
    settings.update(platform_settings())
    if not is_rocm():
        try:
            settings["cublas_version"] = str(torch._C._cuda_getCompiledVersion())  # CUDA runtime torch was built with
        except Exception:  # noqa: BLE001
            pass
    for key, value in sorted(os.environ.items()):
        if key.startswith(("CUBLAS", "CUBLASLT", "NVIDIA_TF32", "TORCH_BLAS", "CUDA_VISIBLE", "HIPBLASLT", "ROCBLAS",
                           "HIP_VISIBLE", "PYTORCH_ROCM", "TORCH_ROCM")):
            settings[f"env.{key}"] = value
    return settings


def is_rocm() -> bool:
    """ROCm PyTorch: the torch.cuda API runs on HIP devices, torch.version.hip is set."""
    return getattr(torch.version, "hip", None) is not None


def platform_settings() -> Dict[str, str]:
    """Which stack ran the GEMMs: on ROCm torch's _scaled_mm and bf16 mm go to hipBLASLt, on CUDA to
    cuBLASLt (the cases' calls are the same torch calls on both)."""
    if is_rocm():
        info = {"platform": "rocm", "hip": str(torch.version.hip), "blas": "hipBLASLt (torch on ROCm)"}
        try:
            info["gcn_arch"] = str(torch.cuda.get_device_properties(0).gcnArchName)
        except Exception:  # noqa: BLE001 - provenance is best effort
            pass
        return info
    return {"platform": "cuda", "blas": "cuBLASLt (torch on CUDA)"}


def provenance(device: str, dry_run: bool) -> Dict[str, str]:
    info = {
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "python": platform.python_version(),
        "host": platform.node(),
        "captured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "script": "tools/capture/h200_conformance.py",
    }
    if dry_run:
        info["device"] = "CPU dry run (fp64 product rounded to fp32): NOT hardware output"
    else:
        info["device"] = torch.cuda.get_device_name(torch.device(device))
        capability = torch.cuda.get_device_capability(torch.device(device))
        info["compute_capability"] = f"{capability[0]}.{capability[1]}"
        try:
            info["driver"] = str(torch._C._cuda_getDriverVersion())
        except Exception:  # noqa: BLE001
            pass
        info.update(cublas_settings())
    return info


def save_case(path: str, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> None:
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()}
    if _package_save_file is None:
        safetensors_lite.save_file(tensors, path, metadata)
        return
    temporary = f"{path}.tmp.{os.getpid()}"
    _package_save_file(tensors, temporary, metadata=metadata)
    os.replace(temporary, path)


def operand_tensors(prefix: str, codes: torch.Tensor, scales: torch.Tensor, format_name: str) -> Tuple[Dict, Dict]:
    return ({f"{prefix}.codes": codes, f"{prefix}.scales": scales},
            {f"{prefix}.format": format_name, f"{prefix}.block": str(BLOCK)})


def fp8_product(a: torch.Tensor, b: torch.Tensor, device: str, dry_run: bool) -> torch.Tensor:
    """a [M, K], b [N, K] fp32 holding exact e4m3 values -> out [M, N] fp32 from torch._scaled_mm."""
    if dry_run:
        return (a.double() @ b.double().t()).float()
    a8 = a.to(device).to(torch.float8_e4m3fn)
    b8 = b.to(device).to(torch.float8_e4m3fn)  # contiguous row-major [N, K]; b8.t() is column-major [K, N]
    if not torch.equal(a8.float().cpu(), a) or not torch.equal(b8.float().cpu(), b):
        raise RuntimeError("operand values are not exact e4m3 numbers")
    one = torch.tensor(1.0, device=device, dtype=torch.float32)
    out = torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    return out.float()


def fp8_codes_product(a_codes: torch.Tensor, a_fmt: str, b_codes: torch.Tensor, b_fmt: str, device: str,
                      dry_run: bool, scale_a: float = 1.0, scale_b: float = 1.0,
                      out_bf16: bool = False) -> Tuple[torch.Tensor, str, str]:
    """torch._scaled_mm on fp8 codes a [M, K] and b [N, K] (b passed column-major, as cuBLASLt wants):
    (out as fp32, out rounding, the call)."""
    call = (f"torch._scaled_mm({a_fmt}, {b_fmt}, scale_a={scale_a.hex()}, scale_b={scale_b.hex()}, "
            f"out_dtype={'bfloat16' if out_bf16 else 'float32'})")
    rounding = "bf16" if out_bf16 else "fp32"
    a = fp8_values(a_codes, a_fmt)
    b = fp8_values(b_codes, b_fmt)
    if dry_run:
        product = (a.double() @ b.double().t()).float() * (torch.tensor(scale_a) * torch.tensor(scale_b))
        return (product.to(torch.bfloat16).float() if out_bf16 else product), rounding, call
    dtypes = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    a8 = a_codes.to(device).view(dtypes[a_fmt])
    b8 = b_codes.to(device).view(dtypes[b_fmt])
    if not torch.equal(a8.float().cpu(), a) or not torch.equal(b8.float().cpu(), b):
        raise RuntimeError("torch decodes the fp8 codes differently from this script's tables")
    sa = torch.tensor(scale_a, device=device, dtype=torch.float32)
    sb = torch.tensor(scale_b, device=device, dtype=torch.float32)
    out = torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb,
                           out_dtype=torch.bfloat16 if out_bf16 else torch.float32)
    return out.float(), rounding, call


def bf16_product(a: torch.Tensor, b: torch.Tensor, device: str, dry_run: bool) -> Tuple[torch.Tensor, str, str]:
    """bf16 GEMM: (out fp32, out rounding 'fp32' | 'bf16', the call used)."""
    if dry_run:
        return (a.double() @ b.double().t()).float(), "fp32", "cpu fp64"
    a16 = a.to(device).to(torch.bfloat16)
    b16 = b.to(device).to(torch.bfloat16)
    try:
        out = torch.mm(a16, b16.t(), out_dtype=torch.float32)
        return out.float(), "fp32", "torch.mm(bf16, bf16, out_dtype=torch.float32)"
    except (TypeError, RuntimeError):
        out = torch.mm(a16, b16.t())  # bf16 output: the fp32 accumulator rounded to bf16
        return out.float(), "bf16", "torch.mm(bf16, bf16) -> bf16"


def fp8_operand_case(a_codes: torch.Tensor, a_fmt: str, b_codes: torch.Tensor, b_fmt: str) -> Tuple[Dict, Dict]:
    tensors_a, meta_a = operand_tensors("a", a_codes, torch.full((a_codes.shape[0], -(-a_codes.shape[1] // BLOCK)), 127,
                                                                 dtype=torch.uint8), FP8_MX_FORMATS[a_fmt])
    tensors_b, meta_b = operand_tensors("b", b_codes, torch.full((b_codes.shape[0], -(-b_codes.shape[1] // BLOCK)), 127,
                                                                 dtype=torch.uint8), FP8_MX_FORMATS[b_fmt])
    return dict(tensors_a, **tensors_b), dict(meta_a, **meta_b)


def randn_codes(rows: int, k: int, generator: torch.Generator, fmt: str = "e4m3") -> torch.Tensor:
    if fmt == "e4m3":
        return fp8_codes(randn_rows(rows, k, generator, -6, 5, 448.0), "e4m3")
    return fp8_codes(randn_rows(rows, k, generator, -16, 8, 57344.0), "e5m2")


def random_signs(codes: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    sign = torch.randint(0, 2, codes.shape, generator=generator, dtype=torch.int64) << 7
    return (codes.to(torch.int64) | sign).to(torch.uint8)


def subnormal_codes(rows: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """e4m3 codes with exponent field 0..2: subnormals (2^-9 .. 7 x 2^-9) and the two smallest binades."""
    return random_signs(torch.randint(0, 24, (rows, k), generator=generator, dtype=torch.int64), generator)


def cancel_codes(m: int, n: int, k: int, generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """Operands whose dot products cancel: b repeats each value twice (b[2i + 1] = b[2i]) and its second half
    of K repeats the first; a's rows 0..7 negate each pair (every 32-product step sums to exactly zero),
    rows 8..15 negate the first half in the second (steps cancel steps K/2 later), rows 16..23 do the same
    with one element changed (near-cancellation), row 24 is +0, row 25 is -0 (b's row 0 is positive, so
    out[25, 0] sums -0 products only); the other rows are randn."""
    half = k // 2
    b = randn_codes(n, k, generator).to(torch.int64)
    b[:, 1::2] = b[:, 0::2]
    b[:, half:] = b[:, :half]
    b[0] &= 0x7F
    a = randn_codes(m, k, generator).to(torch.int64)
    a[0:8, 1::2] = a[0:8, 0::2] ^ 0x80
    a[8:24, half:] = a[8:24, :half] ^ 0x80
    changed = torch.randint(half, k, (8,), generator=generator)
    for row in range(16, 24):
        column = int(changed[row - 16])
        code = int(a[row, column])
        a[row, column] = code - 1 if code & 0x7F == 0x7E else code ^ 0x01  # a neighbouring value, never NaN
    a[24] = 0x00
    a[25] = 0x80
    return a.to(torch.uint8), b.to(torch.uint8)


def edge_codes(m: int, n: int, k: int, generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """One anchor per 32-product step (the same position in a and b, e4m3 exponents 6..7 in both: product
    exponent sums 12..14) and the other values with exponents -2..1 (sums -4..2): every product lies
    10..18 binades below the step's largest exponent sum, across the alignment window's edge."""
    def operand(rows: int) -> torch.Tensor:
        mantissa = torch.randint(0, 8, (rows, k), generator=generator, dtype=torch.int64)
        exponent = torch.randint(-2, 2, (rows, k), generator=generator, dtype=torch.int64)
        return mantissa, exponent
    anchors = [begin + int(torch.randint(0, min(BLOCK, k - begin), (1,), generator=generator))
               for begin in range(0, k, BLOCK)]
    out = []
    for rows in (m, n):
        mantissa, exponent = operand(rows)
        for position in anchors:
            exponent[:, position] = torch.randint(6, 8, (rows,), generator=generator, dtype=torch.int64)
        codes = ((exponent + 7) << 3) | mantissa  # e4m3 bias 7, normal numbers only
        out.append(random_signs(codes, generator))
    return out[0], out[1]


def stress_suite(record, generator: torch.Generator, device: str, dry_run: bool) -> None:
    """The operand classes of --suite stress (module docstring). M = N = 64 unless noted."""
    m = n = 64

    def fp8_case(name: str, a_codes, a_fmt, b_codes, b_fmt, **options) -> None:
        tensors, metadata = fp8_operand_case(a_codes, a_fmt, b_codes, b_fmt)
        if "scale_a" in options:
            metadata.update({"scale_a": options["scale_a"].hex(), "scale_b": options["scale_b"].hex()})
        record(name, "", lambda: fp8_codes_product(a_codes, a_fmt, b_codes, b_fmt, device, dry_run, **options),
               tensors, metadata, (a_codes.shape[0], b_codes.shape[0]))

    for k in (32, 64, 128, 256, 1024, 4096, 48, 80, 208, 1040):
        fp8_case(f"fp8_randn_K{k}", randn_codes(m, k, generator), "e4m3", randn_codes(n, k, generator), "e4m3")
    for k in (64, 256, 1024):
        fp8_case(f"fp8_subnormal_K{k}", subnormal_codes(m, k, generator), "e4m3", subnormal_codes(n, k, generator),
                 "e4m3")
    for k in (64, 256, 1024):
        a_codes, b_codes = cancel_codes(m, n, k, generator)
        fp8_case(f"fp8_cancel_K{k}", a_codes, "e4m3", b_codes, "e4m3")
    for k in (64, 256, 1024, 4096):
        a_codes, b_codes = edge_codes(m, n, k, generator)
        fp8_case(f"fp8_edge_K{k}", a_codes, "e4m3", b_codes, "e4m3")
    fp8_case("fp8_tiles_K256", randn_codes(512, 256, generator), "e4m3", randn_codes(384, 256, generator), "e4m3")
    fp8_case("fp8_scaled_K256", randn_codes(m, 256, generator), "e4m3", randn_codes(n, 256, generator), "e4m3",
             scale_a=0.375, scale_b=float(torch.tensor(1.7, dtype=torch.float32)))
    fp8_case("fp8_pow2scaled_K256", randn_codes(m, 256, generator), "e4m3", randn_codes(n, 256, generator), "e4m3",
             scale_a=2.0 ** -3, scale_b=2.0 ** 5)
    fp8_case("fp8_bf16out_K256", randn_codes(m, 256, generator), "e4m3", randn_codes(n, 256, generator), "e4m3",
             out_bf16=True)
    for k in (64, 256, 1024):
        fp8_case(f"fp8_e5m2xe4m3_K{k}", randn_codes(m, k, generator, "e5m2"), "e5m2", randn_codes(n, k, generator),
                 "e4m3")
    fp8_case("fp8_e4m3xe5m2_K256", randn_codes(m, 256, generator), "e4m3", randn_codes(n, 256, generator, "e5m2"),
             "e5m2")

    def bf16_case(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        record(name, "bf16", lambda: bf16_product(a.float(), b.float(), device, dry_run), {"a": a, "b": b}, {},
               (a.shape[0], b.shape[0]))

    for k in (2048, 4096, 8192, 16384):
        bf16_case(f"bf16_long_K{k}", bf16_random_operand(m, k, generator), bf16_random_operand(n, k, generator))
    for k in (256, 1024, 4096):
        bf16_case(f"bf16_randn_K{k}", randn_rows(m, k, generator, -6, 5, 1e30).to(torch.bfloat16),
                  randn_rows(n, k, generator, -6, 5, 1e30).to(torch.bfloat16))


def probe_operands(m: int, k: int, small: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """The split probe of --suite probe (module docstring): a [m, k], b [m, k] as fp32 values."""
    spacing = k // m
    a = torch.zeros((m, k), dtype=torch.float32)
    b = torch.zeros((m, k), dtype=torch.float32)
    anchors = [spacing * j + 1 for j in range(m)]
    smalls = [spacing * i + spacing // 2 + 1 for i in range(m)]
    for j, position in enumerate(anchors):
        a[:, position] = 1.0
        b[j, position] = 1.0
    for i, position in enumerate(smalls):
        a[i, position] = small
        b[:, position] = 1.0
    return a, b


def probe_suite(record, device: str, dry_run: bool) -> None:
    for m, k in ((64, 2048), (64, 4096), (64, 8192), (128, 4096)):
        a, b = probe_operands(m, k, 1.5 * 2.0 ** -24)
        record(f"bf16_probe_M{m}_K{k}", "bf16", lambda a=a, b=b: bf16_product(a, b, device, dry_run),
               {"a": a.to(torch.bfloat16), "b": b.to(torch.bfloat16)}, {}, (m, m))
    for m, k in ((64, 4096), (64, 8192), (128, 4096)):
        # e4m3 codes: anchors 4 x 4 = 16 (0x48), small terms 1.5 x 2^-6 (0x0C) times 2^-6 (0x08) = 1.5 x 2^-12,
        # far below the 13-bit window under 16 but kept by an fp32 add of separate segments.
        a, b = probe_operands(m, k, 0.5)
        a_codes = torch.where(a == 1.0, 0x48, torch.where(a == 0.5, 0x0C, 0)).to(torch.uint8)
        anchor_columns = b.sum(dim=0) == 1.0
        b_codes = torch.where(b == 1.0, torch.where(anchor_columns, 0x48, 0x08), 0).to(torch.uint8)
        tensors, metadata = fp8_operand_case(a_codes, "e4m3", b_codes, "e4m3")
        record(f"fp8_probe_M{m}_K{k}", "",
               lambda a_codes=a_codes, b_codes=b_codes: fp8_codes_product(a_codes, "e4m3", b_codes, "e4m3", device,
                                                                          dry_run),
               tensors, metadata, (m, m))


def run_twice(compute):
    first = compute()
    second = compute()
    if isinstance(first, tuple):
        return first, torch.equal(first[0].cpu(), second[0].cpu())
    return first, torch.equal(first.cpu(), second.cpu())


def capture(args: argparse.Namespace) -> int:
    dry_run = args.cpu_dry_run
    device = args.device
    if not dry_run:
        if not torch.cuda.is_available():
            print("error: no CUDA device (use --cpu-dry-run to test the file layout)", file=sys.stderr)
            return 1
        if not has_float8():
            print(f"error: torch {torch.__version__} has no float8_e4m3fn", file=sys.stderr)
            return 1
    os.makedirs(args.out, exist_ok=True)
    source = provenance(device, dry_run)
    generator = torch.Generator().manual_seed(args.seed)
    cases: List[Dict[str, str]] = []
    failures: List[Tuple[str, str]] = []
    m = args.m
    n = args.n

    def record(name: str, kind_note: str, compute, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str],
               shape: Optional[Tuple[int, int]] = None) -> None:
        rows, cols = shape if shape is not None else (m, n)
        try:
            result, repeat_identical = run_twice(compute)
            if isinstance(result, tuple):
                out, rounding, call = result
            else:
                out, rounding, call = result, "fp32", kind_note
            if out.shape != (rows, cols):
                raise RuntimeError(f"output shape {tuple(out.shape)} != ({rows}, {cols})")
            file = f"{name}.safetensors"
            full = dict(metadata)
            full.update({"mxscope.case": "gemm", "out.kind": "product", "out.rounding": rounding, "call": call,
                         "out.repeat_identical": str(repeat_identical).lower(), "seed": str(args.seed)})
            full.update({f"source.{key}": value for key, value in source.items()})
            save_case(os.path.join(args.out, file), dict(tensors, out=out.cpu().float().contiguous()), full)
            cases.append({"name": name, "file": file})
            finite = bool(torch.isfinite(out).all())
            print(f"ok    {name:<22} out [{rows}, {cols}] {rounding}  repeat_identical={repeat_identical}  finite={finite}")
        except Exception as error:  # noqa: BLE001 - one failing case must not stop the others
            failures.append((name, f"{type(error).__name__}: {error}"))
            print(f"FAIL  {name:<22} {type(error).__name__}: {error}")
            if args.verbose:
                traceback.print_exc()

    if args.suite == "stress":
        stress_suite(record, generator, device, dry_run)
    if args.suite == "probe":
        probe_suite(record, device, dry_run)
    for k in (args.sizes if args.suite == "base" else []):
        a_values, a_codes, a_scales = mxfp4_operand(m, k, generator)
        b_values, b_codes, b_scales = mxfp4_operand(n, k, generator)
        tensors_a, meta_a = operand_tensors("a", a_codes, a_scales, "mxfp4")
        tensors_b, meta_b = operand_tensors("b", b_codes, b_scales, "mxfp4")
        tensors = dict(tensors_a, **tensors_b)
        metadata = dict(meta_a, **meta_b)
        record(f"fp8_mxfp4_K{k}", "torch._scaled_mm(e4m3, e4m3, unit scales, out_dtype=float32)",
               lambda: fp8_product(a_values, b_values, device, dry_run), tensors, metadata)
        record(f"bf16_mxfp4_K{k}", "bf16",
               lambda: bf16_product(a_values, b_values, device, dry_run), tensors, metadata)

        e_a_values, e_a_codes, e_a_scales = e4m3_operand(m, k, generator)
        e_b_values, e_b_codes, e_b_scales = e4m3_operand(n, k, generator)
        tensors_a, meta_a = operand_tensors("a", e_a_codes, e_a_scales, "mxfp8_e4m3")
        tensors_b, meta_b = operand_tensors("b", e_b_codes, e_b_scales, "mxfp8_e4m3")
        record(f"fp8_e4m3_K{k}", "torch._scaled_mm(e4m3, e4m3, unit scales, out_dtype=float32)",
               lambda: fp8_product(e_a_values, e_b_values, device, dry_run), dict(tensors_a, **tensors_b),
               dict(meta_a, **meta_b))

        if k <= args.bf16_random_max_k:
            r_a = bf16_random_operand(m, k, generator)
            r_b = bf16_random_operand(n, k, generator)
            record(f"bf16_random_K{k}", "bf16",
                   lambda: bf16_product(r_a.float(), r_b.float(), device, dry_run), {"a": r_a, "b": r_b}, {})

    manifest = {"format": "mxscope-conformance", "version": 1,
                "source": dict(source, hardware=source["device"],
                               notes=("M = N = %d; fp8: torch._scaled_mm with unit scales; bf16: fp32 output" % m
                                      if args.suite == "base" else
                                      f"{args.suite} suite of tools/capture/h200_conformance.py")),
                "cases": cases}
    manifest_path = os.path.join(args.out, "manifest.json")
    with open(f"{manifest_path}.tmp", "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1, sort_keys=True)
        handle.write("\n")
    os.replace(f"{manifest_path}.tmp", manifest_path)

    total_bytes = sum(os.path.getsize(os.path.join(args.out, case["file"])) for case in cases)
    print(f"\n{len(cases)} cases written to {args.out} ({total_bytes / 1e6:.2f} MB), {len(failures)} failed")
    for name, message in failures:
        print(f"  failed: {name}: {message}")
    fp8_failed = [name for name, _ in failures if name.startswith("fp8_")]
    print(f"device: {source['device']}; torch {source['torch']}, CUDA {source['cuda']}")
    print(f"next: mxscope conform {args.out} --fit")
    return 1 if fp8_failed or not any(case["name"].startswith("fp8_") for case in cases) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument("--suite", choices=("base", "stress", "probe"), default="base",
                        help="base: the MXFP4-valued and random cases; stress: the operand classes that separate "
                             "accumulator hypotheses (see above)")
    parser.add_argument("--sizes", type=lambda text: [int(v) for v in text.split(",")], default=DEFAULT_SIZES,
                        help="comma-separated K values, multiples of 32 (default %(default)s)")
    parser.add_argument("--m", type=int, default=128)
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--seed", type=int, default=20260101)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--bf16-random-max-k", type=int, default=1024,
                        help="largest K of the random-bf16 cases (they are stored as BF16, 2 bytes per value)")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="compute out on the CPU (fp64 rounded to fp32): tests the layout, records no hardware")
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of failed cases")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    for k in args.sizes:
        if k <= 0 or k % BLOCK != 0:
            print(f"error: --sizes: {k} is not a positive multiple of {BLOCK}", file=sys.stderr)
            return 2
    return capture(args)


if __name__ == "__main__":
    sys.exit(main())
