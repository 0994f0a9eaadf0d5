#!/usr/bin/env python3
"""Same-run baselines for the GPU benchmark (tests/gpu/bench_gpu.cpp), measured with PyTorch on the
same GPU: device-to-device copy bandwidth, cuBLAS DGEMM (fp64 matmul) and fp8 torch._scaled_mm
(e4m3 x e4m3, unit scales, fp32 output), the GEMMs at the Llama-8B MLP Wgrad shape
(n_out 4096, n_in 14336, K 8192). Prints one line per baseline; timings are medians of CUDA-event
timed repeats after a warm-up. With --sustain S each baseline first runs back to back for S seconds,
so that it times the card's sustained rate (its clock held under the power limit) rather than a
burst's, as mxscope_gpu_bench --sustain=S does.

Usage: gpu-baselines.py [--m 4096] [--n 14336] [--k 8192] [--repeats 5] [--sustain 0]
"""
import argparse
import statistics
import time

import torch


def timed_ms(function, repeats, sustain=0.0):
    function()
    torch.cuda.synchronize()
    begin = time.monotonic()
    while time.monotonic() - begin < sustain:
        for _ in range(4):
            function()
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=4096)
    parser.add_argument("--n", type=int, default=14336)
    parser.add_argument("--k", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sustain", type=float, default=0.0, help="seconds back to back before each timing")
    args = parser.parse_args()
    if not 0.0 <= args.sustain <= 600.0:
        parser.error("--sustain wants seconds in [0, 600]")
    device = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}")

    source = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    ms = timed_ms(lambda: target.copy_(source), args.repeats, args.sustain)
    print(f"baseline copy 1 GiB device-to-device: {ms:.3f} ms, {2 * source.numel() / ms / 1e6:.0f} GB/s (read + write)")
    del source, target

    m, n, k = args.m, args.n, args.k
    flops = 2.0 * m * n * k
    a = torch.randn(m, k, dtype=torch.float64, device=device)
    b = torch.randn(n, k, dtype=torch.float64, device=device)
    ms = timed_ms(lambda: a @ b.t(), args.repeats, args.sustain)
    print(f"baseline DGEMM (torch fp64 matmul, cuBLAS) {m}x{n}x{k}: {ms:.2f} ms, {flops / ms / 1e9:.1f} TFLOP/s")
    del a, b

    a8 = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b8 = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32, device=device)
    ms = timed_ms(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32),
                  args.repeats, args.sustain)
    print(f"baseline fp8 torch._scaled_mm (e4m3, fp32 out) {m}x{n}x{k}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
