#!/usr/bin/env python3
"""Step time of the tiny-Llama trainer (tools/capture/train_tiny_llama.py) under several recipes,
measured in one process on one GPU, as ratios against the bf16 step of the same run.

Recipes: bf16 (autocast, the baseline); mxfp4-fdw (MXFP4 in fprop, dgrad and wgrad through
mxscope.torch); mxfp4-fdw-wgrad-sr-h16 (the same with stochastic rounding and a deterministic H16 on
Wgrad); mxfp4-fdw-torch (the first MXFP4 recipe through the pure-PyTorch quantizer mxfp_torch, the
path the trainer had before); mxfp4-fdw-unshared (mxfp4-fdw with every layer quantizing its own
input, no operand shared between q, k and v or gate and up). Each recipe trains its own copy of one
initialization; the recipes take turns (--rounds rounds of --steps steps each, after --warmup
steps), and each step is timed from a device synchronization to the next, optimizer step included.
The median step over all rounds is reported with the min and max. The pure-PyTorch recipe is warmed
up and timed only after the other recipes' rounds: its steps fill the caching allocator with large
temporaries, and measured among them they slowed every recipe after them (BENCHMARKS.md).

usage: bench_train.py [--d-model 1024] [--seq 1024] [--layers 4] [--batch 8] [--rounds 3] [--steps 5]
                      [--json OUT.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "capture"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import train_tiny_llama as trainer  # noqa: E402
import mxscope.torch as mt  # noqa: E402


def recipes():
    rne = mt.GemmRecipe()
    wgrad = mt.GemmRecipe(rounding="sr", rotation=16)
    quant = trainer.QuantRecipe(gemms=("fprop", "dgrad", "wgrad"), rounding="rne", seed=1,
                                rotations={"fprop": "none", "dgrad": "none", "wgrad": "none"})
    return [
        ("bf16", "mxscope", trainer.QuantRecipe(), mt.Recipe("bf16")),
        ("mxfp4-fdw", "mxscope", trainer.QuantRecipe(), mt.Recipe("mxfp4-fdw", rne, rne, rne, seed=1)),
        ("mxfp4-fdw-wgrad-sr-h16", "mxscope", trainer.QuantRecipe(),
         mt.Recipe("mxfp4-fdw-wgrad-sr-h16", rne, rne, wgrad, seed=1)),
        ("mxfp4-fdw-torch", "torch", quant, mt.Recipe("bf16")),
        # mxfp4-fdw with every layer quantizing its own input (mxscope.torch shares the operand of an
        # input several layers quantize alike: q, k, v; gate, up): what that sharing saves.
        ("mxfp4-fdw-unshared", "mxscope", trainer.QuantRecipe(), mt.Recipe("mxfp4-fdw", rne, rne, rne, seed=1)),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--torch-steps", type=int, default=2, help="timed steps per round of the pure-torch path")
    parser.add_argument("--only", default=None, help="comma-separated recipe names")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_train: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    config = trainer.ModelConfig(d_model=args.d_model, layers=args.layers, heads=args.heads, ffn=args.ffn,
                                 seq=args.seq)
    torch.manual_seed(0)
    base = trainer.TinyLlama(config)
    train_data, _, _ = trainer.load_corpus(None)
    generator = torch.Generator().manual_seed(0)
    batches = [tuple(t.to(device) for t in trainer.batch_from(train_data, args.batch, config.seq, generator))
               for _ in range(4)]

    runs = []
    chosen = set(args.only.split(",")) if args.only else None
    for name, quantizer, quant, recipe in recipes():
        if chosen and name not in chosen:
            continue
        model = copy.deepcopy(base).to(device)
        trainer.apply_quantization(model, quantizer, quant, recipe)
        if name.endswith("-unshared"):
            for module in mt.mx_linears(model).values():
                module._mxs_shared = mt._SharedInputs(size=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        runs.append({"name": name, "model": model, "optimizer": optimizer, "times": [], "step": 0,
                     "pure_torch": quantizer == "torch",
                     "steps": args.torch_steps if quantizer == "torch" else args.steps})

    def step(run):
        run["step"] += 1
        trainer.set_step(run["model"], run["step"])
        inputs, targets = batches[run["step"] % len(batches)]
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            logits = run["model"](inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, config.vocab), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(run["model"].parameters(), 1.0)
        run["optimizer"].step()
        run["optimizer"].zero_grad(set_to_none=True)
        return loss

    def measure(phase):
        for run in phase:
            for _ in range(args.warmup):
                step(run)
            torch.cuda.synchronize()
        for _ in range(args.rounds):
            for run in phase:
                for _ in range(run["steps"]):
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    loss = step(run)
                    torch.cuda.synchronize()
                    run["times"].append(time.perf_counter() - started)
                run["loss"] = float(loss)

    measure([run for run in runs if not run["pure_torch"]])
    measure([run for run in runs if run["pure_torch"]])

    tokens = args.batch * config.seq
    baseline = statistics.median(next(r for r in runs if r["name"] == "bf16")["times"]) if any(
        r["name"] == "bf16" for r in runs) else None
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "config": vars(args),
              "tokens_per_step": tokens, "parameters": sum(p.numel() for p in base.parameters()), "recipes": []}
    print(f"{'recipe':<26} {'median ms':>10} {'min':>8} {'max':>8} {'x bf16':>7} {'loss':>8}")
    for run in runs:
        median = statistics.median(run["times"])
        ratio = median / baseline if baseline else float("nan")
        report["recipes"].append({"name": run["name"], "median_s": median, "min_s": min(run["times"]),
                                  "max_s": max(run["times"]), "samples": len(run["times"]), "ratio_to_bf16": ratio,
                                  "last_loss": run["loss"]})
        print(f"{run['name']:<26} {median * 1e3:10.2f} {min(run['times']) * 1e3:8.2f} {max(run['times']) * 1e3:8.2f} "
              f"{ratio:7.3f} {run['loss']:8.4f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
