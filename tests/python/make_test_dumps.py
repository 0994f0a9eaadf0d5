"""Writes the dumps tests/test_dump.cpp reads, with the real capture hook and trainer on CPU.

usage: make_test_dumps.py OUT_ROOT
  OUT_ROOT/fp32_accumulation  fp32 recipe, 2 micro-batches per step (x, dy concatenated along K)
  OUT_ROOT/bf16_autocast      bf16 autocast (x and dy in bf16, w and dw fp32)
  OUT_ROOT/mxfp4_wgrad        MXFP4 in all three GEMMs, stochastic rounding, randomized H16 on wgrad
  OUT_ROOT/interrupted        a run killed (os._exit) right after step 2's entries were written
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "capture"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import train_tiny_llama  # noqa: E402
from mxscope_capture import Capture  # noqa: E402

COMMON = ["--tiny", "--steps", "2", "--capture-steps", "1,2", "--device", "cpu", "--eval-every", "100",
          "--eval-batches", "1", "--max-corpus-bytes", "100000"]


def interrupted_run(out_dir: str) -> None:
    """A plain nn.Linear model, one module called twice per step; killed after step 2 is written."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(24, 40, bias=False), nn.ReLU(), nn.Linear(40, 16, bias=False))
    shared = model[2]
    capture = Capture(model, out_dir, layers=r"0|2", steps=[1, 2, 3],
                      source={"recipe": "fp32", "model": "two-layer MLP", "notes": "interrupted on purpose"})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (1, 2, 3):
        capture.begin_step(step)
        inputs = torch.randn(3, 5, 24)
        hidden = model[1](model[0](inputs))
        # The last layer is applied twice, so its dw sums two products: dy is paired call by call.
        loss = shared(hidden).pow(2).mean() + 0.5 * shared(hidden * 0.5).sum()
        loss.backward()
        capture.after_backward(step)
        if step == 2:
            os._exit(0)  # as if the process were killed: no close(), no final manifest write
        optimizer.step()
        optimizer.zero_grad()


def main() -> int:
    root = sys.argv[1]
    train_tiny_llama.main(COMMON + ["--out", os.path.join(root, "fp32_accumulation"), "--recipe", "fp32",
                                    "--grad-accum", "2"])
    train_tiny_llama.main(COMMON + ["--out", os.path.join(root, "bf16_autocast"), "--recipe", "bf16"])
    train_tiny_llama.main(COMMON + ["--out", os.path.join(root, "mxfp4_wgrad"), "--recipe", "mxfp4",
                                    "--quant", "fprop,dgrad,wgrad", "--rounding", "sr",
                                    "--wgrad-rotation", "h16-random-per-step", "--quant-seed", "98765"])
    interrupted_run(os.path.join(root, "interrupted"))
    return 1  # not reached: interrupted_run ends the process


if __name__ == "__main__":
    sys.exit(main())
