#!/usr/bin/env python3
"""How much int8 tensor work an exact Ozaki-style reference would need on capture-like operands.

    ozaki-slices.py [--rows R] [--seed S]

An exact reference on int8 tensor cores cuts each element of a (row, K-chunk) into signed 7-bit
slices below the chunk's largest exponent, down to the lowest set bit of any element of that
chunk: ceil(bits / 7) slices, bits = top - low + 1. A 64-row tile of each operand needs the most
slices among its rows, and every slice pair of the two tiles is one int8 product of the chunk. So
the mean of (slices of the A tile) x (slices of the B tile) over tiles and chunks is the int8
work as a multiple of the GEMM's multiply-adds.

The operands are those of tools/capture/synthetic_dump.py's Llama-shaped Wgrad (dw = dy^T x, K =
8192 tokens): standard normal values times a log-normal per-token scale (sigma 1.5 for dy, scaled
by 2^-20; sigma 1 for x), rounded to bf16; R features of each (the GEMM's rows). This script
models the data only. It runs no kernel, and its figures are for planning, not measurements of
the GPU.
"""
import argparse

import torch

TOKENS = 8192
TILE = 64


def operand(generator, rows, sigma, scale):
    token_scale = torch.exp(sigma * torch.randn(TOKENS, 1, generator=generator))
    values = torch.randn(TOKENS, rows, generator=generator) * token_scale * scale
    return values.to(torch.bfloat16).float()


def leading_and_lowest(values):
    """Per element: the exponent of its leading bit and of its lowest set bit (zeros: none)."""
    bits = values.abs().view(torch.int32).long()
    field = (bits >> 23) & 0xFF
    significand = torch.where(field == 0, bits & 0x7FFFFF, (bits & 0x7FFFFF) | 0x800000)
    unit = torch.where(field == 0, torch.full_like(field, -149), field - 150)
    nonzero = significand != 0
    leading = unit + torch.floor(torch.log2(significand.clamp(min=1).double())).long()
    lowest = unit + torch.log2((significand & -significand).clamp(min=1).double()).round().long()
    none = torch.full_like(leading, 10**6)
    return torch.where(nonzero, leading, -none), torch.where(nonzero, lowest, none)


def slices(values, chunk):
    leading, lowest = leading_and_lowest(values)
    rows = values.shape[1]
    top = leading.reshape(TOKENS // chunk, chunk, rows).amax(1)
    bottom = lowest.reshape(TOKENS // chunk, chunk, rows).amin(1)
    per_row = torch.ceil((top - bottom + 1).clamp(min=1).double() / 7)
    per_tile = per_row.reshape(TOKENS // chunk, rows // TILE, TILE).amax(2)
    return per_row, per_tile


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=512, help="features of each operand (a multiple of 64)")
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    if args.rows <= 0 or args.rows % TILE != 0:
        parser.error(f"--rows must be a positive multiple of {TILE}")
    generator = torch.Generator()
    generator.manual_seed(args.seed)
    dy = operand(generator, args.rows, 1.5, 2.0**-20)
    x = operand(generator, args.rows, 1.0, 1.0)
    print("chunk  slices dy (mean, p99, max)  slices x (mean, p99, max)  int8 products per multiply-add")
    for chunk in (32, 64, 128, 256, TOKENS):
        rows_a, tiles_a = slices(dy, chunk)
        rows_b, tiles_b = slices(x, chunk)
        pairs = (tiles_a[:, :, None] * tiles_b[:, None, :]).mean().item()
        print(f"{chunk:5d}  {rows_a.mean():.2f} {rows_a.quantile(0.99):.0f} {rows_a.max():.0f}"
              f"                   {rows_b.mean():.2f} {rows_b.quantile(0.99):.0f} {rows_b.max():.0f}"
              f"                   {pairs:.1f}")


if __name__ == "__main__":
    main()
