#!/usr/bin/env python3
"""Records an NVIDIA GPU's own fp32 -> fp8 conversions as mxscope conformance cases ("mxscope.case":
"convert"; docs/conformance.md, "The hardware's converters"), for `mxscope conform DIR`:

- cvt_e4m3, cvt_e5m2: the PTX instructions cvt.rn.satfinite.e4m3x2.f32 / .e5m2x2.f32 (CUDA's
  __nv_cvt_float_to_fp8 with __NV_SATFINITE on sm_89 and later; a small program built here with nvcc,
  whose PTX is checked for the instruction and recorded in the case's metadata "ptx").
- torch_e4m3, torch_e5m2: PyTorch's casts `.to(torch.float8_e4m3fn)` / `.to(torch.float8_e5m2)` on
  the GPU.

The inputs of each format are chosen where conversion rules differ: every finite value of the format
with both signs; every midpoint between neighbouring values (ties) and the fp32 numbers on either side
of it; the subnormal range in quarter steps; values past the largest finite one up to and beyond the
overflow threshold, 2 max, 1e30, fp32's largest and +-infinity; NaNs with several payloads; signed
zeros; then 8192 random fp32 bit patterns with exponents across [-30, 20]. The format's value table
comes from PyTorch's fp8 -> fp32 conversion (exact), not from mxscope.

Usage on the GPU machine (torch with CUDA and float8 dtypes, nvcc on PATH or in /usr/local/cuda/bin):
    python3 tools/capture/h200_converters.py --out DIR
On ROCm PyTorch the same command records torch's two casts only (the cvt program is CUDA).
Then, where mxscope is built: mxscope conform DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_lite  # noqa: E402

PROGRAM = r"""
#include <cuda_fp8.h>
#include <cstdio>
#include <vector>
__global__ void convert(const float* in, unsigned char* out, int n, int e5m2) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __nv_cvt_float_to_fp8(in[i], __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3);
}
int main(int argc, char** argv) {  // convert IN OUT E5M2: fp32 values in, one code byte each out
  if (argc != 4) return 2;
  FILE* f = std::fopen(argv[1], "rb");
  if (!f) return 2;
  std::vector<float> in;
  float v;
  while (std::fread(&v, sizeof v, 1, f) == 1) in.push_back(v);
  std::fclose(f);
  const int n = static_cast<int>(in.size());
  float* d_in = nullptr;
  unsigned char* d_out = nullptr;
  if (cudaMalloc(&d_in, n * sizeof(float)) != cudaSuccess || cudaMalloc(&d_out, n) != cudaSuccess) return 1;
  cudaMemcpy(d_in, in.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  convert<<<(n + 255) / 256, 256>>>(d_in, d_out, n, argv[3][0] == '1');
  std::vector<unsigned char> out(n);
  if (cudaMemcpy(out.data(), d_out, n, cudaMemcpyDeviceToHost) != cudaSuccess) return 1;
  f = std::fopen(argv[2], "wb");
  if (!f || std::fwrite(out.data(), 1, n, f) != static_cast<size_t>(n)) return 1;
  std::fclose(f);
  return 0;
}
"""

FORMATS = {"fp8_e4m3": ("float8_e4m3fn", "e4m3x2"), "fp8_e5m2": ("float8_e5m2", "e5m2x2")}


def next_up(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, float("inf")))


def next_down(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, float("-inf")))


def inputs_for(dtype: torch.dtype, seed: int) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(dtype).float()
    finite = values[torch.isfinite(values)]
    magnitudes = torch.unique(finite.abs())  # sorted, 0 first
    largest = float(magnitudes[-1])
    spacing_top = float(magnitudes[-1] - magnitudes[-2])
    smallest = float(magnitudes[1])
    midpoints = (magnitudes[:-1] + magnitudes[1:]) / 2  # exact in fp32 (one more bit than fp8)
    above = torch.tensor([largest + spacing_top * k / 4 for k in range(1, 9)] +
                         [2 * largest, 1e30, 3.4028234663852886e38, float("inf")])
    subnormal = torch.tensor([smallest * k / 4 for k in range(1, 17)])
    parts = [magnitudes, midpoints, next_up(midpoints), next_down(midpoints), above, next_up(above[:-1]),
             next_down(above), subnormal]
    positive = torch.cat(parts)
    special = as_float(torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFC00000, 0x80000000, 0x00000000]))
    generator = torch.Generator().manual_seed(seed)
    mantissa = torch.randint(0, 1 << 23, (8192,), generator=generator, dtype=torch.int64)
    exponent = torch.randint(127 - 30, 127 + 21, (8192,), generator=generator, dtype=torch.int64)
    sign = torch.randint(0, 2, (8192,), generator=generator, dtype=torch.int64)
    random = as_float((sign << 31) | (exponent << 23) | mantissa)
    return torch.cat([positive, -positive, special, random]).contiguous()


def as_float(bits: torch.Tensor) -> torch.Tensor:
    """fp32 numbers from their bit patterns given as int64 values 0 .. 2^32 - 1."""
    signed = bits.to(torch.int64) - ((bits.to(torch.int64) >> 31) << 32)
    return signed.to(torch.int32).view(torch.float32)


def build_program(work: str) -> tuple:
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    capability = torch.cuda.get_device_capability()
    arch = f"sm_{capability[0]}{capability[1]}"
    source = os.path.join(work, "convert.cu")
    with open(source, "w", encoding="utf-8") as handle:
        handle.write(PROGRAM)
    binary = os.path.join(work, "convert")
    subprocess.run([nvcc, f"-arch={arch}", "-O2", source, "-o", binary], check=True)
    ptx = subprocess.run([nvcc, f"-arch={arch}", "-ptx", source, "-o", "-"], check=True, capture_output=True,
                         text=True).stdout
    lines = sorted({line.strip().strip("{}").strip() for line in ptx.splitlines() if "cvt." in line and "satfinite" in line})
    if not lines:
        print("h200_converters: cvt lines of the PTX:", [l.strip() for l in ptx.splitlines() if "cvt" in l][:20],
              file=sys.stderr)
    return binary, arch, subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1], lines


def run_cvt(binary: str, work: str, values: torch.Tensor, e5m2: bool) -> torch.Tensor:
    source, target = os.path.join(work, "in.bin"), os.path.join(work, "out.bin")
    with open(source, "wb") as handle:
        handle.write(bytes(values.contiguous().view(torch.uint8).tolist()))
    subprocess.run([binary, source, target, "1" if e5m2 else "0"], check=True)
    with open(target, "rb") as handle:
        return torch.frombuffer(bytearray(handle.read()), dtype=torch.uint8).clone()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=20261202)
    args = parser.parse_args()
    if not torch.cuda.is_available() or not hasattr(torch, "float8_e4m3fn"):
        print("h200_converters: needs a CUDA GPU and torch float8 dtypes", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    source = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": str(torch.version.cuda),
              "python": platform.python_version(), "script": "tools/capture/h200_converters.py",
              "captured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    rocm = getattr(torch.version, "hip", None) is not None
    if rocm:  # the cvt program is CUDA; on ROCm only torch's casts are recorded
        source.update({"platform": "rocm", "hip": str(torch.version.hip)})
    cases = []
    with tempfile.TemporaryDirectory() as work:
        if not rocm:
            binary, arch, nvcc_version, ptx_lines = build_program(work)
            source.update({"platform": "cuda", "arch": arch, "nvcc": nvcc_version})
        for format_name, (dtype_name, ptx_type) in FORMATS.items():
            dtype = getattr(torch, dtype_name)
            values = inputs_for(dtype, args.seed)
            outputs = {}
            if not rocm:
                cvt_lines = [line for line in ptx_lines if ptx_type in line]
                if not cvt_lines:
                    print(f"h200_converters: the PTX has no cvt ... satfinite.{ptx_type}: {ptx_lines}", file=sys.stderr)
                    return 1
                outputs[f"cvt_{format_name[4:]}"] = (
                    run_cvt(binary, work, values, format_name == "fp8_e5m2"),
                    f"PTX {cvt_lines[0].split()[0]} (__nv_cvt_float_to_fp8, __NV_SATFINITE)",
                    {"ptx": " | ".join(cvt_lines)})
            outputs[f"torch_{format_name[4:]}"] = (values.cuda().to(dtype).view(torch.uint8).cpu(),
                                                   f"torch .to(torch.{dtype_name}) on {'rocm' if rocm else 'cuda'}", {})
            for name, (codes, call, extra) in outputs.items():
                metadata = {"mxscope.case": "convert", "format": format_name, "call": call, "seed": str(args.seed),
                            **{f"source.{k}": v for k, v in source.items()}, **extra}
                safetensors_lite.save_file({"in": values, "out": codes}, os.path.join(args.out, f"{name}.safetensors"),
                                           metadata)
                cases.append({"name": name, "file": f"{name}.safetensors"})
                print(f"{name}: {values.numel()} values, {call}")
    manifest = {"format": "mxscope-conformance", "version": 1, "source": source, "cases": cases}
    path = os.path.join(args.out, "manifest.json")
    with open(f"{path}.tmp", "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1, sort_keys=True)
    os.replace(f"{path}.tmp", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
