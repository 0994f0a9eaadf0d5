"""transformers' LlamaForCausalLM through mxscope.torch on a GPU: convert its seven projections of
every layer to MXLinear, train a few steps on byte text, capture all seven projections of two
layers with mxscope.capture, and check with the CLI that `mxscope conform` reproduces every
hardware-quantized operand and that `mxscope replay` runs on the dump.

usage: hf_llama_capture.py --cli MXSCOPE --out DIR [--recipe mxfp4-fdw-sr] [--steps 4]
Exit 0 only when every check passes (tools/gpu-python-test runs it)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools", "capture"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import train_tiny_llama as trainer  # noqa: E402
import mxscope.torch as mt  # noqa: E402
from mxscope.capture import Capture  # noqa: E402

PROJECTIONS = r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cli", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--recipe", default="mxfp4-fdw-sr")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=704, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    model = LlamaForCausalLM(config).cuda()
    recipe = mt.LADDER[args.recipe].with_seed(11)
    mt.convert(model, recipe, include=PROJECTIONS)
    converted = sorted(mt.mx_linears(model))
    print(f"converted {len(converted)} projections to MXLinear ({recipe.name})")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dump = os.path.join(args.out, "dump")
    steps = list(range(2, args.steps + 1))
    capture = Capture(model, dump, layers=r"model\.layers\.(0|2)\.(self_attn|mlp)\.\w+_proj", steps=steps,
                      source={"recipe": recipe.name, "model": "transformers LlamaForCausalLM (3 layers, d 256)"})
    data, _, _ = trainer.load_corpus(2_000_000)
    generator = torch.Generator().manual_seed(0)
    for step in range(1, args.steps + 1):
        mt.set_step(model, step)
        capture.begin_step(step)
        inputs, targets = (t.cuda() for t in trainer.batch_from(data, 4, 128, generator))
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().reshape(-1, 256), targets.reshape(-1))
        loss.backward()
        capture.after_backward(step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step} loss {loss.item():.4f}")
    capture.close()
    expected = 14 * len(steps) * 2  # 14 layers x steps x (dy, x)
    done = subprocess.run([args.cli, "conform", dump], capture_output=True, text=True)
    print(done.stdout[-600:] + done.stderr[-600:])
    summary = re.search(r"summary: (\d+) of (\d+) operands reproduce exactly", done.stdout)
    ok = done.returncode == 0 and summary is not None and summary.group(1) == summary.group(2) == str(expected)
    print(f"{'PASS' if ok else 'FAIL'} conform: {summary.group(0) if summary else 'no summary'} (expected {expected})")
    analysis = os.path.join(args.out, "recipe.toml")
    with open(analysis, "w") as handle:
        handle.write('name = "hf-llama"\ngemms = ["wgrad"]\n')
        strategy = recipe.analysis_strategies()["wgrad"]
        handle.write("[[strategy]]\n" + "".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in strategy.items()
                                                if not isinstance(v, dict)))
    replay = subprocess.run([args.cli, "replay", dump, "--analysis", analysis, "--out", os.path.join(args.out, "run"),
                             "--device", "gpu"], capture_output=True, text=True)
    replay_ok = replay.returncode == 0
    print(f"{'PASS' if replay_ok else 'FAIL'} replay of the captured dump under the recipe's wgrad strategy"
          + ("" if replay_ok else ": " + replay.stderr[-800:]))
    return 0 if ok and replay_ok else 1


if __name__ == "__main__":
    sys.exit(main())
