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

M = N = 128 and K in {32, 64, 128, 256, 512, 1024, 4096} by default. The output directory holds
manifest.json (format "mxscope-conformance") and one safetensors file per case, with provenance
(torch and CUDA versions, device name, cuBLAS settings) in the manifest's source and each file's
metadata. Each case runs twice; metadata "out.repeat_identical" says whether both runs agreed.

Usage on the GPU machine (Python 3.12, torch with CUDA, safetensors optional):
    python3 tools/capture/h200_conformance.py --out data/conformance/h200
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

    def record(name: str, kind_note: str, compute, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> None:
        try:
            result, repeat_identical = run_twice(compute)
            if isinstance(result, tuple):
                out, rounding, call = result
            else:
                out, rounding, call = result, "fp32", kind_note
            if out.shape != (m, n):
                raise RuntimeError(f"output shape {tuple(out.shape)} != ({m}, {n})")
            file = f"{name}.safetensors"
            full = dict(metadata)
            full.update({"mxscope.case": "gemm", "out.kind": "product", "out.rounding": rounding, "call": call,
                         "out.repeat_identical": str(repeat_identical).lower(), "seed": str(args.seed)})
            full.update({f"source.{key}": value for key, value in source.items()})
            save_case(os.path.join(args.out, file), dict(tensors, out=out.cpu().float().contiguous()), full)
            cases.append({"name": name, "file": file})
            finite = bool(torch.isfinite(out).all())
            print(f"ok    {name:<22} out [{m}, {n}] {rounding}  repeat_identical={repeat_identical}  finite={finite}")
        except Exception as error:  # noqa: BLE001 - one failing case must not stop the others
            failures.append((name, f"{type(error).__name__}: {error}"))
            print(f"FAIL  {name:<22} {type(error).__name__}: {error}")
            if args.verbose:
                traceback.print_exc()

    for k in args.sizes:
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
                               notes="M = N = %d; fp8: torch._scaled_mm with unit scales; bf16: fp32 output" % m),
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
