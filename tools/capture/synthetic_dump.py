#!/usr/bin/env python3
"""Writes a synthetic mxscope dump (docs/dump-format.md) of one linear layer's Wgrad operands at any
shape, for benchmarks and scaling runs where the values only need to look like training tensors.

x [K, n_in] and dy [K, n_out] are bf16: Gaussian entries times a heavy-tailed per-token scale
(log-normal, sigma 1) and, for x, a few outlier channels (x8) as activations have; each step draws
fresh values from a generator seeded by (seed, step, layer index), so a dump is reproducible.

With --llama-layer the dump holds one whole Llama-3.1-8B decoder layer instead: its seven
projections (q 4096 -> 4096, k and v 4096 -> 1024, o 4096 -> 4096, gate and up 4096 -> 14336, down
14336 -> 4096) as layers.0.self_attn.{q,k,v,o}_proj and layers.0.mlp.{gate,up,down}_proj.

Usage: synthetic_dump.py OUT_DIR [--n-out 4096] [--n-in 14336] [--tokens 8192] [--steps 1-2]
                                 [--layers 1 | --llama-layer] [--seed 1] [--device cpu|cuda] [--weights]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_lite  # noqa: E402


def steps_of(text):
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


# Llama-3.1-8B's projections as (module, n_out, n_in).
LLAMA_8B_LAYER = [("self_attn.q_proj", 4096, 4096), ("self_attn.k_proj", 1024, 4096),
                  ("self_attn.v_proj", 1024, 4096), ("self_attn.o_proj", 4096, 4096),
                  ("mlp.gate_proj", 14336, 4096), ("mlp.up_proj", 14336, 4096), ("mlp.down_proj", 4096, 14336)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--n-out", type=int, default=4096)
    parser.add_argument("--n-in", type=int, default=14336)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", default="1-2")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--weights", action="store_true", help="also write w [n_out, n_in] (fp32)")
    parser.add_argument("--llama-layer", action="store_true",
                        help="the seven projections of one Llama-3.1-8B layer (overrides --n-out, --n-in, --layers)")
    args = parser.parse_args()
    if args.llama_layer:
        shapes = [(f"layers.0.{module}", n_out, n_in) for module, n_out, n_in in LLAMA_8B_LAYER]
    else:
        shapes = [(f"layers.{index}.mlp.down_proj", args.n_out, args.n_in) for index in range(args.layers)]

    os.makedirs(args.out, exist_ok=True)
    entries = []
    for layer_index, (layer, n_out, n_in) in enumerate(shapes):
        os.makedirs(os.path.join(args.out, layer), exist_ok=True)
        for step in steps_of(args.steps):
            generator = torch.Generator(device=args.device)
            generator.manual_seed((args.seed * 1_000_003 + step) * 1009 + layer_index)

            def draw(rows, cols, outliers):
                token_scale = torch.exp(torch.randn(rows, 1, generator=generator, device=args.device))
                values = torch.randn(rows, cols, generator=generator, device=args.device) * token_scale
                if outliers:
                    channels = torch.randint(0, cols, (max(1, cols // 512),), generator=generator, device=args.device)
                    values[:, channels] *= 8.0
                return values.to(torch.bfloat16).cpu()

            tensors = {"x": draw(args.tokens, n_in, True), "dy": draw(args.tokens, n_out, False) * 1e-3}
            if args.weights:
                tensors["w"] = (torch.randn(n_out, n_in, generator=generator, device=args.device) * 0.02).cpu()
            relative = f"{layer}/step_{step:08d}.safetensors"
            safetensors_lite.save_file(tensors, os.path.join(args.out, relative),
                                       {"layer": layer, "step": str(step), "calls": "1"})
            entries.append({"step": step, "layer": layer, "file": relative})
    manifest = {
        "format": "mxscope-dump",
        "version": 1,
        "source": {
            "hardware": "synthetic",
            "framework": f"PyTorch {torch.__version__}",
            "recipe": "synthetic bf16 operands (tools/capture/synthetic_dump.py)",
            "model": (f"one Llama-3.1-8B layer: its seven projections, K {args.tokens}" if args.llama_layer else
                      f"{len(shapes)} Llama-shaped Wgrad(s): n_out {args.n_out}, n_in {args.n_in}, K {args.tokens}"),
            "notes": "Gaussian values x log-normal per-token scale; x has outlier channels; not training data",
            "provenance": {"seed": args.seed, "layers": len(shapes), "steps": args.steps,
                           "llama_layer": args.llama_layer},
        },
        "entries": entries,
    }
    safetensors_lite.write_atomically(os.path.join(args.out, "manifest.json"),
                                      (json.dumps(manifest, indent=2) + "\n").encode())


if __name__ == "__main__":
    main()
