#!/usr/bin/env python3
"""An independent NumPy implementation of trunc-promote (docs/numerics.md) with switchable rules,
for asking a conformance directory which rule the hardware follows where the fit family has no
parameter: how a subnormal element's exponent enters the alignment, how terms and step results are
truncated, and whether the inner accumulator takes part in E. Prints, per variant, the outputs it
reproduces bit for bit over the cases with fp8 codes (unit block scales, no per-tensor scales,
fp32 output), the figures docs/conformance.md quotes for the stress capture.

Usage: trunc_promote_variants.py DIR [--cases PREFIX] [--model 13,32,14,128]
(needs numpy; reads the safetensors files directly)
"""
import argparse
import glob
import json
import os
import struct

import numpy as np


def read_safetensors(path):
    raw = open(path, "rb").read()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + size])
    metadata = header.pop("__metadata__", {})
    kinds = {"F32": np.float32, "U8": np.uint8, "BF16": np.uint16}
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        tensors[name] = np.frombuffer(raw[8 + size + begin:8 + size + end], dtype=kinds[info["dtype"]]).reshape(info["shape"])
    return tensors, metadata


def fp8_tables(fmt):
    """Values and exponent fields (a subnormal counts as the smallest normal exponent) of the 256 codes."""
    exponent_bits, bias = (4, 7) if fmt == "mxfp8_e4m3" else (5, 15)
    mantissa_bits = 7 - exponent_bits
    values, fields = np.zeros(256), np.zeros(256, dtype=np.int64)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e = (code >> mantissa_bits) & ((1 << exponent_bits) - 1)
        m = code & ((1 << mantissa_bits) - 1)
        special = e == (1 << exponent_bits) - 1 and (fmt == "mxfp8_e5m2" or m == (1 << mantissa_bits) - 1)
        values[code] = np.nan if special else sign * (m / 2 ** mantissa_bits + (e > 0)) * 2.0 ** (max(e, 1) - bias)
        fields[code] = max(e, 1) - bias
    return values, fields


def floor_log2(x):
    out = np.full(x.shape, -10**4, dtype=np.int64)
    nonzero = x != 0
    out[nonzero] = np.frexp(np.abs(x[nonzero]))[1] - 1
    return out


def truncate(values, mode):
    return {"rtz": np.trunc, "floor": np.floor, "rne": np.round}[mode](values)


def keep_bits(v, bits, mode):
    exponent = floor_log2(v)
    quantum = np.exp2(np.where(v == 0, 0, exponent - bits + 1))
    return np.where(v == 0, 0.0, truncate(v / quantum, mode) * quantum)


def model(a, b, ea, eb, n, k, w, c, term="rtz", step="rtz", accumulator_in_e=True):
    """trunc-promote:n,k,w,c on exact fp64 operand values a [M, K], b [N, K] with exponents ea, eb."""
    depth = a.shape[1]
    outer = np.zeros((a.shape[0], b.shape[0]), dtype=np.float32)
    inner = np.zeros(outer.shape)
    for begin in range(0, depth, k):
        end = min(depth, begin + k)
        products = a[:, None, begin:end] * b[None, :, begin:end]
        exponents = np.where(products == 0, -10**4, ea[:, None, begin:end] + eb[None, :, begin:end])
        top = exponents.max(axis=2)
        if accumulator_in_e:
            top = np.maximum(top, floor_log2(inner))
        unit = np.exp2(np.where(top < -5000, 0, top - n))
        total = truncate(inner / unit, term) + truncate(products / unit[:, :, None], term).sum(axis=2)
        inner = np.where(top < -5000, 0.0, keep_bits(total * unit, w, step))
        if end % c == 0 or end == depth:
            outer = (outer.astype(np.float64) + inner).astype(np.float32)
            inner = np.zeros(outer.shape)
    return outer


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--cases", default="fp8_")
    parser.add_argument("--model", default="13,32,14,128", help="n,k,w,c of trunc-promote")
    args = parser.parse_args()
    n, k, w, c = (int(v) for v in args.model.split(","))
    variants = {
        "exponent fields (the model)": {},
        "leading bits of subnormals": {"leading": True},
        "terms by floor": {"term": "floor"},
        "terms to nearest": {"term": "rne"},
        "step results by floor": {"step": "floor"},
        "step results to nearest": {"step": "rne"},
        "accumulator outside E": {"accumulator_in_e": False},
    }
    counts = {name: 0 for name in variants}
    compared = 0
    manifest = json.load(open(os.path.join(args.directory, "manifest.json")))
    for case in manifest["cases"]:
        if not case["name"].startswith(args.cases):
            continue
        tensors, meta = read_safetensors(os.path.join(args.directory, case["file"]))
        if "a.codes" not in tensors or "scale_a" in meta or meta.get("out.rounding", "fp32") != "fp32":
            continue
        if not meta["a.format"].startswith("mxfp8") or np.any(tensors["a.scales"] != 127) or np.any(tensors["b.scales"] != 127):
            continue
        operands = []
        for side in "ab":
            values, fields = fp8_tables(meta[f"{side}.format"])
            codes = tensors[f"{side}.codes"]
            operands.append((values[codes], fields[codes]))
        (a, fa), (b, fb) = operands
        hardware = tensors["out"].view(np.uint32)
        compared += hardware.size
        for name, options in variants.items():
            options = dict(options)
            leading = options.pop("leading", False)
            ea = floor_log2(a) if leading else fa
            eb = floor_log2(b) if leading else fb
            out = model(a, b, ea, eb, n, k, w, c, **options)
            counts[name] += int((out.view(np.uint32) == hardware).sum())
    for name, matches in counts.items():
        print(f"{name:<30} {matches:>8} of {compared}")


if __name__ == "__main__":
    main()
