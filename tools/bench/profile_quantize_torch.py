#!/usr/bin/env python3
"""Where the time of mxscope.torch goes on a GPU: (1) MXLinear's operand quantizer per operand
shape, axis, input dtype and rounding: device time per call (the calls queued behind a sleep) and
host time per call; (2) torch.profiler
over two training steps of the trainer's bench model under one recipe, the kernels by device time;
(3) before (2), the host's and the device's time per training step, each alone; (4) with
--host-split only, the host's time per step split over MXLinear's functions.

usage: profile_quantize_torch.py [--recipe mxfp4-fdw] [--d-model 1024] [--ffn 2816] [--heads 8] [--seq 1024] [--batch 8] [--steps-only] [--host-split]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import mxscope  # noqa: E402
from mxscope import _api  # noqa: E402


def time_quantize(t, axis, rounding, rotation, repeats=20):
    """Device ms per call (the calls queued behind a sleep, so that the host's pace does not enter)
    and host ms per call, through MXLinear's operand quantizer (codes to reused buffers, one bf16
    operand per call)."""
    import mxscope.torch as mt
    rows, cols, matrix_axis = _api.as_matrix_shape(t.shape, axis)
    options = _api.make_options("mxfp4", axis=matrix_axis, block=None, rounding=rounding, scale_rule="floor",
                                rotation=rotation, signs="none", seed=1, step=1, sr_bits=32, layer="l", role="x",
                                seed_policy="per-step")
    quantizer = mt._OperandQuantizer(("bench",), options, rows, cols, t.device)
    for _ in range(3):
        quantizer(t, 1, False)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SLEEP_CYCLES)
    start.record()
    host = time.perf_counter()
    for _ in range(repeats):
        quantizer(t, 1, False)
    host = (time.perf_counter() - host) / repeats
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / repeats, host * 1e3


SLEEP_CYCLES = int(1.5e8)  # about 75 ms at the H200's clock: longer than the host takes to queue a step


def training_step(args, recipe: str):
    """The trainer's bench model (4 layers) under `recipe` with AdamW: a function that runs
    training step i, after three warm-up steps."""
    sys.path.insert(0, os.path.join(HERE, "..", "capture"))
    import train_tiny_llama as trainer
    import mxscope.torch as mt
    import torch.nn.functional as F
    config = trainer.ModelConfig(d_model=args.d_model, layers=4, heads=args.heads, ffn=args.ffn, seq=args.seq)
    torch.manual_seed(0)
    model = trainer.TinyLlama(config).cuda()
    mt.convert(model, mt.LADDER[recipe], include=trainer.BLOCK_LINEARS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = torch.randint(0, 256, (args.batch, args.seq), device="cuda")

    def step(i):
        mt.set_step(model, i)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(inputs).float().reshape(-1, 256), inputs.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    return step


def host_split(args) -> int:
    """The host's time per training step (10 steps, no profiler) for bf16 and args.recipe, and
    within it the time of MXLinear's functions, each wrapped with a timer."""
    import collections
    import mxscope.torch as mt
    spent, calls = collections.defaultdict(float), collections.Counter()

    def timed(name, function):
        def wrapper(*arguments, **keywords):
            start = time.perf_counter()
            try:
                return function(*arguments, **keywords)
            finally:
                spent[name] += time.perf_counter() - start
                calls[name] += 1
        return wrapper

    mt._quantize_operand = timed("quantize_operand", mt._quantize_operand)
    mt._product = timed("product", mt._product)
    mt._MXLinearFunction.forward = staticmethod(timed("function.forward", mt._MXLinearFunction.forward))
    mt._MXLinearFunction.backward = staticmethod(timed("function.backward", mt._MXLinearFunction.backward))
    mt.MXLinear.forward = timed("MXLinear.forward", mt.MXLinear.forward)
    for recipe in ("bf16", args.recipe):
        step = training_step(args, recipe)
        spent.clear()
        calls.clear()
        steps = 10
        start = time.perf_counter()
        for i in range(steps):
            step(10 + i)
        host = (time.perf_counter() - start) / steps
        torch.cuda.synchronize()
        print(f"{recipe}: host {host * 1e3:.2f} ms per step")
        for name in spent:
            print(f"   {name:<20} {spent[name] / steps * 1e3:7.2f} ms per step {calls[name] // steps:4d} calls "
                  f"{spent[name] / calls[name] * 1e6:7.1f} us per call")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="mxfp4-fdw")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps-only", action="store_true", help="only the host and device time per step")
    parser.add_argument("--host-split", action="store_true",
                        help="only the host's time per step split over the layer's functions (bf16 and --recipe)")
    args = parser.parse_args()
    if args.host_split:
        return host_split(args)
    tokens = args.batch * args.seq
    copy_in = torch.randn(tokens, 4 * args.d_model, device="cuda", dtype=torch.bfloat16)
    copy_out = torch.empty_like(copy_in)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        copy_out.copy_(copy_in)
    start.record()
    for _ in range(20):
        copy_out.copy_(copy_in)
    stop.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(stop) / 20
    print(f"copy {copy_in.numel() * 2 / 1e6:.0f} MB: {ms:.3f} ms, {2 * copy_in.numel() * 2 / ms / 1e6:.0f} GB/s")
    print(f"{'operand':<28} {'axis':>4} {'round':>5} {'rot':>4} {'device ms':>10} {'host ms':>8} {'GB/s in+out':>11}")
    print("per call: device ms queued behind a sleep; host ms of MXLinear's operand quantizer")
    for name, shape, dtype in () if args.steps_only else (("x/dy [K, d] bf16", (tokens, args.d_model), torch.bfloat16),
                               ("h [K, ffn] bf16", (tokens, args.ffn), torch.bfloat16),
                               ("w [d, d] fp32", (args.d_model, args.d_model), torch.float32)):
        t = torch.randn(*shape, device="cuda", dtype=dtype)
        for axis in (1, 0):
            for rounding, rotation in (("rne", None), ("sr", None), ("sr", 16)):
                device_ms, host_ms = time_quantize(t, axis, rounding, rotation)
                moved = t.numel() * (t.element_size() + 2.5)  # input, bf16 operand, codes
                print(f"{name:<28} {axis:>4} {rounding:>5} {rotation or 0:>4} {device_ms:10.3f} {host_ms:8.3f} "
                      f"{moved / device_ms / 1e6:11.0f}")

    step = training_step(args, args.recipe)
    # Host and device time per step: the host queues a step behind a sleep (its time is the host's
    # alone), the events around the step give the device's alone.
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(3):
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        host = time.perf_counter()
        step(20 + i)
        host = (time.perf_counter() - host) * 1e3
        stop.record()
        torch.cuda.synchronize()
        print(f"step {args.recipe}: host {host:.2f} ms, device {start.elapsed_time(stop):.2f} ms")
    if args.steps_only:
        return 0
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(2):
            step(10 + i)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
