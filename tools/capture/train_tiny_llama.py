"""Train a small Llama-style decoder on byte-level text and capture real GEMM operands.

The model: token embedding (256 byte values), N blocks of [RMSNorm -> attention with RoPE (separate
q/k/v/o projections, causal) -> residual, RMSNorm -> SwiGLU MLP (gate/up/down) -> residual], a final
RMSNorm and an output head (tied to the embedding with --tie-embeddings). No biases. AdamW with
linear warmup and cosine decay.

The corpus is available offline wherever Python runs: the *.py files of the running interpreter's
standard library directory (os.path.dirname(os.__file__), not recursive), sorted by name, read as
bytes (tokens 0..255). Every 10th file (sorted index % 10 == 9) is the validation set. Batches are
drawn from a torch.Generator seeded with --seed, so a run is reproducible on the same machine.

Recipes (--recipe):
  fp32   no autocast, fp32 GEMMs (TF32 off).
  bf16   autocast to bf16 (the baseline).
  mxfp4  bf16 autocast plus MXFP4 quantization of the GEMMs listed in --quant (fprop, dgrad, wgrad)
         in every transformer block linear (q, k, v, o, gate, up, down; the output head stays bf16),
         with --rounding and the --fprop/--dgrad/--wgrad-rotation of each GEMM.
  --ladder NAME instead takes a recipe of mxscope.torch.LADDER (bf16, fp8, mxfp4-f ... nvfp4-te).
The block linears become mxscope.torch.MXLinear (python/mxscope/torch.py): each GEMM's operands are
quantized along its reduction axis (docs/numerics.md section 6) by the mxscope library, so they are
bit for bit what `mxscope quantize` and the replay compute; the weight is quantized from its fp32
master copy. --quantizer torch runs the same MXFP4 recipes through the pure-PyTorch quantizer of
mxfp_torch.py instead (an independent implementation, kept as a test oracle and speed baseline; its
GEMMs multiply the dequantized values in fp32 without TF32).
With a quantized Wgrad (MX formats), the dump stores the wgrad operands as the recipe used them:
"dy.codes" / "dy.scales" and "x.codes" / "x.scales" with the recipe in the entry's metadata.

usage (CPU smoke test):  train_tiny_llama.py --tiny --steps 3 --out /tmp/dump
usage (sample data):     see tools/capture/README.md
"""

from __future__ import annotations

import argparse
import csv
import glob
import hashlib
import json
import math
import os
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(_HERE, "..", "..", "python"))
import mxfp_torch  # noqa: E402
import mxscope.torch as mt  # noqa: E402
from mxscope.capture import Capture, autocast_dtype  # noqa: E402

GEMMS = ("fprop", "dgrad", "wgrad")
ROTATIONS = {
    "none": (0, "none"),
    "h16": (16, "none"),                        # deterministic block Hadamard (the study's H16)
    "h16-random-fixed": (16, "fixed"),          # random signs, the same at every step
    "h16-random-per-step": (16, "per-step"),    # randomized Hadamard, new signs every step
}


# ------------------------------------------------------------------------------------------------
# Configuration.


@dataclass
class ModelConfig:
    vocab: int = 256
    d_model: int = 128
    layers: int = 4
    heads: int = 4
    ffn: int = 352
    seq: int = 128
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    # "sdpa": F.scaled_dot_product_attention (PyTorch 2.0 and newer, fused kernels on the GPU);
    # "naive": softmax(q k^T / sqrt(d)) v written out; "auto": sdpa where PyTorch has it.
    attention: str = "auto"


@dataclass
class QuantRecipe:
    gemms: tuple = ()
    rounding: str = "rne"
    seed: int = 0
    rotations: Optional[Dict[str, str]] = None

    def operand_recipe(self, gemm: str) -> mxfp_torch.OperandRecipe:
        size, signs = ROTATIONS[(self.rotations or {}).get(gemm, "none")]
        return mxfp_torch.OperandRecipe(format="mxfp4", block=32, scale_rule="floor", rounding=self.rounding,
                                        sr_bits=32, seed=self.seed, rotation=size, signs=signs)

    def describe(self) -> str:
        if not self.gemms:
            return "none"
        parts = []
        for gemm in GEMMS:
            if gemm in self.gemms:
                rotation = (self.rotations or {}).get(gemm, "none")
                parts.append(f"{gemm}: mxfp4 block 32 floor {self.rounding} rotation {rotation}")
        return "; ".join(parts)


# ------------------------------------------------------------------------------------------------
# The pure-PyTorch MXFP4 linear layer (--quantizer torch).


def _signs_for(recipe: mxfp_torch.OperandRecipe, length: int, layer: str, step: int, device):
    if not recipe.rotation:
        return None
    return mxfp_torch.rotation_signs(length, recipe.seed, step, layer, recipe.signs, device=device)


class MxLinearFunction(torch.autograd.Function):
    """y = x w^T with each GEMM of the step (fprop here, dgrad and wgrad in backward) optionally
    computed from MXFP4-quantized operands. x2d: [K, n_in] in the compute dtype; weight: fp32 master."""

    @staticmethod
    def forward(ctx, x2d, weight, module):
        ctx.module = module
        ctx.save_for_backward(x2d, weight)
        quant = module.quant
        if "fprop" in quant.gemms:
            recipe = quant.operand_recipe("fprop")
            signs = _signs_for(recipe, x2d.shape[1], module.layer_name, module.step, x2d.device)
            xq = mxfp_torch.quantize_operand(x2d, 1, recipe, module.layer_name, module.step, mxfp_torch.ROLE_X, signs)
            wq = mxfp_torch.quantize_operand(weight, 1, recipe, module.layer_name, module.step, mxfp_torch.ROLE_W, signs)
            return (xq.dequantized @ wq.dequantized.t()).to(x2d.dtype)
        return x2d @ weight.to(x2d.dtype).t()

    @staticmethod
    def backward(ctx, dy):
        x2d, weight = ctx.saved_tensors
        module = ctx.module
        quant = module.quant
        layer, step = module.layer_name, module.step
        dy = dy.contiguous()

        if "dgrad" in quant.gemms:
            recipe = quant.operand_recipe("dgrad")
            signs = _signs_for(recipe, dy.shape[1], layer, step, dy.device)
            dyq = mxfp_torch.quantize_operand(dy, 1, recipe, layer, step, mxfp_torch.ROLE_DY, signs)
            wq = mxfp_torch.quantize_operand(weight, 0, recipe, layer, step, mxfp_torch.ROLE_W, signs)
            dx = (dyq.dequantized @ wq.dequantized).to(x2d.dtype)
        else:
            dx = dy.to(x2d.dtype) @ weight.to(x2d.dtype)

        if "wgrad" in quant.gemms:
            recipe = quant.operand_recipe("wgrad")
            signs = _signs_for(recipe, dy.shape[0], layer, step, dy.device)
            dyq = mxfp_torch.quantize_operand(dy, 0, recipe, layer, step, mxfp_torch.ROLE_DY, signs)
            xq = mxfp_torch.quantize_operand(x2d, 0, recipe, layer, step, mxfp_torch.ROLE_X, signs)
            dw = dyq.dequantized.t() @ xq.dequantized
            if getattr(module, "mxscope_capture_quantized", False):
                module.mxscope_quantized_operands.append({
                    "dy": (dyq.codes, dyq.scales, mxfp_torch.recipe_metadata("dy", recipe, 0, layer, step)),
                    "x": (xq.codes, xq.scales, mxfp_torch.recipe_metadata("x", recipe, 0, layer, step)),
                })
        else:
            dw = (dy.t() @ x2d.to(dy.dtype)).float()
        return dx, dw.to(weight.dtype), None


class TorchMxLinear(nn.Linear):
    """nn.Linear whose GEMMs follow a QuantRecipe through mxfp_torch (--quantizer torch)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.quant = QuantRecipe()
        self.layer_name = ""
        self.step = 0

    @classmethod
    def replacing(cls, linear: nn.Linear, quant: "QuantRecipe", name: str) -> "TorchMxLinear":
        out = cls(linear.in_features, linear.out_features)
        out.weight = linear.weight
        out.quant, out.layer_name = quant, name
        return out

    def forward(self, x):
        if not self.quant.gemms:
            return super().forward(x)
        leading = x.shape[:-1]
        x2d = x.reshape(-1, x.shape[-1])
        cast = autocast_dtype(x.device.type)
        if cast is not None:
            x2d = x2d.to(cast)  # what autocast would feed the matmul
        with torch.autocast(device_type=x.device.type, enabled=False):
            y = MxLinearFunction.apply(x2d, self.weight, self)
        return y.reshape(*leading, self.out_features)


# ------------------------------------------------------------------------------------------------
# The model.


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed * self.weight


def rope_tables(seq: int, head_dim: int, theta: float, device):
    inverse_frequency = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(seq, device=device).float(), inverse_frequency)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x, cos, sin):
    # x: [batch, heads, seq, head_dim]; rotate pairs (first half, second half).
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    cos = cos[: x.shape[-2]].to(x.dtype)
    sin = sin[: x.shape[-2]].to(x.dtype)
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.heads = config.heads
        self.head_dim = config.d_model // config.heads
        available = hasattr(F, "scaled_dot_product_attention")
        if config.attention == "sdpa" and not available:
            raise SystemExit("--attention sdpa: this PyTorch has no scaled_dot_product_attention")
        self.fused = config.attention == "sdpa" or (config.attention == "auto" and available)
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.k_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.v_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.o_proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x, cos, sin, mask):
        batch, seq, _ = x.shape

        def heads(t):
            return t.reshape(batch, seq, self.heads, self.head_dim).transpose(1, 2)

        q = apply_rope(heads(self.q_proj(x)), cos, sin)
        k = apply_rope(heads(self.k_proj(x)), cos, sin)
        v = heads(self.v_proj(x))
        if self.fused:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, seq, -1)
            return self.o_proj(out)
        scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(self.head_dim)
        scores = scores.masked_fill(mask[:seq, :seq], float("-inf"))
        attention = torch.softmax(scores, dim=-1).to(v.dtype)
        out = (attention @ v).transpose(1, 2).reshape(batch, seq, -1)
        return self.o_proj(out)


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.ffn, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.ffn, bias=False)
        self.down_proj = nn.Linear(config.ffn, config.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model)
        self.mlp = SwiGLU(config)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        head_dim = config.d_model // config.heads
        cos, sin = rope_tables(config.seq, head_dim, config.rope_theta, device=None)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("causal_mask", torch.triu(torch.ones(config.seq, config.seq, dtype=torch.bool), 1),
                             persistent=False)
        self._initialize()

    def _initialize(self):
        residual_scale = 1.0 / math.sqrt(2 * self.config.layers)
        for name, parameter in self.named_parameters():
            if parameter.dim() == 2:
                std = 0.02 * (residual_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
                nn.init.normal_(parameter, mean=0.0, std=std)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x, self.rope_cos, self.rope_sin, self.causal_mask)
        return self.lm_head(self.norm(x))


# ------------------------------------------------------------------------------------------------
# Data.


def load_corpus(max_bytes: Optional[int]):
    directory = os.path.dirname(os.__file__)
    files = sorted(glob.glob(os.path.join(directory, "*.py")))
    train, validation = bytearray(), bytearray()
    digest = hashlib.sha256()
    for index, path in enumerate(files):
        with open(path, "rb") as handle:
            data = handle.read()
        digest.update(os.path.basename(path).encode("utf-8") + b"\0" + data)
        (validation if index % 10 == 9 else train).extend(data)
    if max_bytes is not None:
        train, validation = train[:max_bytes], validation[: max(max_bytes // 10, 4096)]
    info = {"directory": directory, "files": len(files), "train_bytes": len(train),
            "validation_bytes": len(validation), "sha256": digest.hexdigest(),
            "split": "sorted *.py files; index % 10 == 9 is validation"}
    return (torch.frombuffer(bytearray(train), dtype=torch.uint8).long(),
            torch.frombuffer(bytearray(validation), dtype=torch.uint8).long(), info)


def batch_from(data: torch.Tensor, batch: int, seq: int, generator: torch.Generator):
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=generator)
    rows = torch.stack([data[s: s + seq + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


# ------------------------------------------------------------------------------------------------
# Training.


def parse_steps(text: str) -> List[int]:
    """"1,2,3,400-411" -> [1, 2, 3, 400, ..., 411]."""
    steps = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            first, last = (int(v) for v in part.split("-", 1))
            steps.extend(range(first, last + 1))
        else:
            steps.append(int(part))
    return steps


def learning_rate(step: int, total: int, peak: float, warmup: int, floor_fraction: float = 0.1) -> float:
    if step <= warmup:
        return peak * step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (floor_fraction + (1 - floor_fraction) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# The linears of the transformer blocks (the output head stays in the autocast dtype).
BLOCK_LINEARS = r"layers\.\d+\.(attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"


def quantization_of(args, quant_seed: int):
    """(QuantRecipe for --quantizer torch, mxscope.torch.Recipe) of the command line."""
    if args.ladder is not None:
        if args.quantizer == "torch":
            raise SystemExit("--ladder: the torch quantizer runs --recipe mxfp4 only")
        return QuantRecipe(), mt.LADDER[args.ladder].with_seed(quant_seed)
    if args.recipe != "mxfp4":
        return QuantRecipe(), mt.Recipe(args.recipe)
    gemms = tuple(g.strip() for g in args.quant.split(",") if g.strip())
    unknown = [g for g in gemms if g not in GEMMS]
    if unknown:
        raise SystemExit(f"--quant: unknown GEMM(s) {unknown}; expected a subset of {GEMMS}")
    rotations = {g: getattr(args, f"{g}_rotation") for g in GEMMS}
    quant = QuantRecipe(gemms=gemms, rounding=args.rounding, seed=quant_seed, rotations=rotations)
    per_gemm = {}
    for gemm in gemms:
        size, signs = ROTATIONS[rotations[gemm]]
        per_gemm[gemm] = mt.GemmRecipe(format="mxfp4", rounding=args.rounding, rotation=size, signs=signs)
    return quant, mt.Recipe("mxfp4-" + "".join(g[0] for g in gemms), seed=quant_seed, **per_gemm)


def apply_quantization(model: nn.Module, quantizer: str, quant: QuantRecipe, recipe) -> None:
    """Turns the block linears into MXLinear (mxscope) or TorchMxLinear (torch) modules."""
    if quantizer == "mxscope":
        if recipe.quantized:
            mt.convert(model, recipe, include=BLOCK_LINEARS)
        return
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and re.fullmatch(BLOCK_LINEARS, name):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, TorchMxLinear.replacing(module, quant, name))


def set_step(model: nn.Module, step: int) -> None:
    mt.set_step(model, step)
    for module in model.modules():
        if isinstance(module, TorchMxLinear):
            module.step = step


def describe_recipe(args, quant: QuantRecipe, recipe) -> str:
    if args.ladder is not None:
        return f"bf16 autocast + {recipe.name} (mxscope.torch.LADDER: {recipe})"
    if args.recipe != "mxfp4":
        return {"fp32": "fp32 (no autocast, TF32 off)", "bf16": "bf16 autocast"}[args.recipe]
    return f"bf16 autocast + MXFP4 quantization by {args.quantizer} ({quant.describe()})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="dump directory (created; must not hold a dump yet)")
    p.add_argument("--recipe", choices=("fp32", "bf16", "mxfp4"), default="bf16")
    p.add_argument("--ladder", choices=sorted(mt.LADDER), default=None,
                   help="a recipe of mxscope.torch.LADDER instead of --recipe/--quant/--rounding/--*-rotation")
    p.add_argument("--quantizer", choices=("mxscope", "torch"), default="mxscope",
                   help="mxscope: mxscope.torch.MXLinear (the library); torch: the pure-PyTorch mxfp_torch path")
    p.add_argument("--quant", default="fprop,dgrad,wgrad", help="GEMMs quantized by --recipe mxfp4")
    p.add_argument("--rounding", choices=("rne", "sr"), default="rne")
    for gemm in GEMMS:
        p.add_argument(f"--{gemm}-rotation", choices=sorted(ROTATIONS), default="none")
    p.add_argument("--quant-seed", type=int, default=None, help="Philox seed of SR and random signs (default --seed)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--tiny", action="store_true", help="CI-sized model and data (CPU smoke tests)")
    p.add_argument("--d-model", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--ffn", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--attention", choices=("auto", "sdpa", "naive"), default="auto")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--capture-layers", default=None, help="regex over module names (re.fullmatch)")
    p.add_argument("--capture-steps", default="1,2,3,400-411", help='e.g. "1,2,3,400-411"')
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--max-corpus-bytes", type=int, default=None)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    # Exact fp32 GEMMs for the quantized paths and the fp32 recipe: no TF32 anywhere.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(args.seed)

    tiny = args.tiny
    config = ModelConfig(d_model=args.d_model or (32 if tiny else 128), layers=args.layers or (2 if tiny else 4),
                         heads=args.heads or (2 if tiny else 4), ffn=args.ffn or (96 if tiny else 352),
                         seq=args.seq or (32 if tiny else 128), tie_embeddings=args.tie_embeddings,
                         attention=args.attention)
    batch = args.batch or (2 if tiny else 4)
    max_bytes = args.max_corpus_bytes or (400_000 if tiny else None)
    capture_layers = args.capture_layers or (r"layers\.0\.attn\.o_proj|layers\.1\.mlp\.down_proj" if tiny else
                                             r"layers\.1\.attn\.o_proj|layers\.2\.mlp\.down_proj")
    capture_steps = parse_steps(args.capture_steps)

    quant_seed = args.seed if args.quant_seed is None else args.quant_seed
    quant, recipe = quantization_of(args, quant_seed)
    use_autocast = args.recipe in ("bf16", "mxfp4") or args.ladder is not None
    model = TinyLlama(config).to(device)
    apply_quantization(model, args.quantizer, quant, recipe)

    train_data, validation_data, corpus = load_corpus(max_bytes)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    recipe_text = describe_recipe(args, quant, recipe)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})"
    provenance = {
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "device": device_name, "seed": args.seed, "quant_seed": quant_seed, "config": asdict(config),
        "batch": batch, "grad_accum": args.grad_accum, "tokens_per_step": batch * config.seq * args.grad_accum,
        "steps": args.steps, "lr": args.lr, "warmup": args.warmup, "weight_decay": args.weight_decay,
        "clip": args.clip, "corpus": corpus, "capture_layers": capture_layers, "capture_steps": capture_steps,
        "recipe": args.recipe, "ladder": args.ladder, "quantizer": args.quantizer, "quant": list(quant.gemms),
        "rounding": quant.rounding,
        "rotations": quant.rotations or {}, "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
    }
    source = {
        "hardware": device_name,
        "framework": f"PyTorch {torch.__version__}" + (f", CUDA {torch.version.cuda}" if torch.version.cuda else ""),
        "recipe": recipe_text,
        "model": (f"tiny Llama: d_model {config.d_model}, {config.layers} layers, {config.heads} heads, ffn "
                  f"{config.ffn} (SwiGLU), seq {config.seq}, RMSNorm, RoPE, no biases, "
                  f"{'tied' if config.tie_embeddings else 'untied'} embeddings, byte vocabulary"),
        "notes": (f"AdamW lr {args.lr} warmup {args.warmup} cosine, batch {batch} x seq {config.seq} x "
                  f"{args.grad_accum} micro-batch(es) = K {batch * config.seq * args.grad_accum}; corpus: Python "
                  f"{platform.python_version()} stdlib *.py ({corpus['files']} files, sha256 {corpus['sha256'][:16]}); "
                  f"x is the GEMM input in the autocast dtype, dy the output gradient, w the fp32 master weight, "
                  f"dw weight.grad; x and dy concatenate the micro-batches along K"),
        "provenance": provenance,
    }
    os.makedirs(args.out, exist_ok=True)
    capture = Capture(model, args.out, layers=capture_layers, steps=capture_steps, source=source)
    print(json.dumps({"device": device_name, "torch": torch.__version__, "recipe": recipe_text,
                      "captured_layers": sorted(capture.modules)}), flush=True)

    generator = torch.Generator().manual_seed(args.seed)
    loss_path = os.path.join(args.out, "loss.csv")
    started = time.time()
    with open(loss_path, "w", newline="") as loss_file:
        writer = csv.writer(loss_file)
        writer.writerow(["step", "train_loss", "val_loss", "lr", "grad_norm"])
        for step in range(1, args.steps + 1):
            lr = learning_rate(step, args.steps, args.lr, args.warmup)
            for group in optimizer.param_groups:
                group["lr"] = lr
            set_step(model, step)
            capture.begin_step(step)
            train_loss = 0.0
            for _ in range(args.grad_accum):
                inputs, targets = batch_from(train_data, batch, config.seq, generator)
                inputs, targets = inputs.to(device), targets.to(device)
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_autocast):
                    logits = model(inputs)
                loss = F.cross_entropy(logits.float().reshape(-1, config.vocab), targets.reshape(-1))
                (loss / args.grad_accum).backward()
                train_loss += loss.item() / args.grad_accum
            capture.after_backward(step)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            validation_loss = ""
            if step % args.eval_every == 0 or step == args.steps:
                validation_loss = f"{evaluate(model, validation_data, config, batch, args, device, use_autocast):.6f}"
            writer.writerow([step, f"{train_loss:.6f}", validation_loss, f"{lr:.6g}", f"{grad_norm:.6g}"])
            loss_file.flush()
            if step % max(1, args.steps // 20) == 0 or step <= 3 or validation_loss:
                print(f"step {step}/{args.steps} train {train_loss:.4f} val {validation_loss or '-'} lr {lr:.3g} "
                      f"{time.time() - started:.1f}s", flush=True)
    capture.close()
    print(f"done: {len(capture.entries)} entries in {args.out} after {time.time() - started:.1f}s", flush=True)
    return 0


@torch.no_grad()
def evaluate(model, data, config, batch, args, device, use_autocast) -> float:
    generator = torch.Generator().manual_seed(args.seed + 1)  # the same validation batches every time
    total = 0.0
    for _ in range(args.eval_batches):
        inputs, targets = batch_from(data, batch, config.seq, generator)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_autocast):
            logits = model(inputs.to(device))
        total += F.cross_entropy(logits.float().reshape(-1, config.vocab), targets.to(device).reshape(-1)).item()
    return total / args.eval_batches


if __name__ == "__main__":
    sys.exit(main())
