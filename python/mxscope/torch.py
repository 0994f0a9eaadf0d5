"""Training with microscaling recipes: MXLinear, a drop-in nn.Linear whose three GEMMs follow a
recipe, and convert(model, recipe) (docs/python.md).

Each GEMM's operands are quantized along its reduction axis (docs/numerics.md section 6):
  fprop  y  = x w^T   x [K, n_in] and w [n_out, n_in] along n_in (axis 1)
  dgrad  dx = dy w    dy [K, n_out] along n_out (axis 1), w along n_out (axis 0)
  wgrad  dw = dy^T x  dy and x along K (axis 0)
with the libmxscope_c quantizer, so the codes are the ones `mxscope quantize` and the replay engine
compute for the same recipe, layer name and step. A rotation is applied to both operands of its
GEMM along the reduction axis. Gradients are straight-through: each GEMM multiplies the
quantized operands it was given, nothing else is changed.

The products: on CUDA the operands go to a bf16 tensor-core GEMM as their values without the tensor
scale (exact in bf16; mxscope.quantize's `operand`), accumulated in fp32, then times the tensor
scales; on the CPU the dequantized fp32 values are multiplied in fp32. fprop and dgrad outputs
have the input's dtype (bf16 under autocast), wgrad's is fp32 before it becomes weight.grad.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Dict, Optional

import torch as _torch
import torch.nn.functional as _F
from torch import nn as _nn

from . import _api
from .capture import autocast_dtype as _autocast_dtype

GEMMS = ("fprop", "dgrad", "wgrad")
# Each GEMM's operands: (role, axis of its [rows, cols] view, is the gradient operand).
_OPERANDS = {
    "fprop": (("x", 1, False), ("w", 1, False)),
    "dgrad": (("dy", 1, True), ("w", 0, False)),
    "wgrad": (("dy", 0, True), ("x", 0, False)),
}


@dataclass(frozen=True)
class GemmRecipe:
    """How one GEMM's two operands are quantized. grad_format / grad_rounding override format /
    rounding for the gradient operand dy (dgrad and wgrad), e.g. e4m3 forward and e5m2 gradients.
    rotation: 0 or a Hadamard block size, applied to both operands along the reduction axis, with
    signs 'none' (deterministic), 'fixed' (random, the same every step) or 'per-step'."""
    format: str = "mxfp4"
    grad_format: Optional[str] = None
    rounding: str = "rne"
    grad_rounding: Optional[str] = None
    scale_rule: str = "floor"
    rotation: int = 0
    signs: str = "none"
    seed_policy: str = "per-step"
    block: int = 0
    sr_bits: int = 32

    def operand_format(self, gradient: bool) -> str:
        return self.grad_format if gradient and self.grad_format else self.format

    def operand_rounding(self, gradient: bool) -> str:
        return self.grad_rounding if gradient and self.grad_rounding else self.rounding

    def analysis_keys(self, gemm: str) -> dict:
        """The strategy keys of an analysis file (analyses/README.md) that replay this GEMM."""
        keys = {"format": self.format, "rounding": self.rounding, "scale_rule": self.scale_rule,
                "seed_policy": self.seed_policy, "sr_bits": self.sr_bits,
                "rotation": f"hadamard:{self.rotation}" if self.rotation else "none", "signs": self.signs}
        if self.block:
            keys["block"] = self.block
        if gemm in ("dgrad", "wgrad") and (self.grad_format or self.grad_rounding):
            keys["a"] = {"format": self.operand_format(True), "rounding": self.operand_rounding(True)}
        return keys

    def gemm_fields(self) -> dict:
        """mxscope.gemm's strategy fields (both operands share format and rounding there)."""
        return {"format": self.format, "rounding": self.rounding, "scale_rule": self.scale_rule,
                "rotation": self.rotation, "signs": self.signs, "seed_policy": self.seed_policy,
                "sr_bits": self.sr_bits, **({"block": self.block} if self.block else {})}


@dataclass(frozen=True)
class Recipe:
    """A training recipe: one GemmRecipe per GEMM (None: that GEMM stays in the input's dtype, as
    nn.Linear computes it). seed keys stochastic rounding and random signs."""
    name: str = "custom"
    fprop: Optional[GemmRecipe] = None
    dgrad: Optional[GemmRecipe] = None
    wgrad: Optional[GemmRecipe] = None
    seed: int = 0

    def gemm(self, gemm: str) -> Optional[GemmRecipe]:
        return getattr(self, gemm)

    @property
    def quantized(self) -> bool:
        return any(self.gemm(g) is not None for g in GEMMS)

    def strategy_names(self) -> Dict[str, str]:
        """The names the replay's analysis (analysis_strategies) gives this recipe's GEMMs."""
        return {g: f"{self.name}-{g}" for g in GEMMS if self.gemm(g) is not None}

    def analysis_strategies(self) -> Dict[str, dict]:
        """gemm -> the analysis strategy (keys of analyses/README.md, seed included) of that GEMM."""
        return {g: {"name": f"{self.name}-{g}", "seed": self.seed, **self.gemm(g).analysis_keys(g)}
                for g in GEMMS if self.gemm(g) is not None}

    def with_seed(self, seed: int) -> "Recipe":
        return replace(self, seed=seed)


def _ladder() -> Dict[str, Recipe]:
    rne = GemmRecipe()
    sr = GemmRecipe(rounding="sr")
    fp8_forward = GemmRecipe(format="fp8_e4m3")
    fp8_backward = GemmRecipe(format="fp8_e4m3", grad_format="fp8_e5m2")
    nv = GemmRecipe(format="nvfp4")
    h16 = replace(rne, rotation=16)
    recipes = [
        Recipe("bf16"),
        Recipe("fp8", fp8_forward, fp8_backward, fp8_backward),
        Recipe("mxfp4-f", rne),
        Recipe("mxfp4-fd", rne, rne),
        Recipe("mxfp4-fdw", rne, rne, rne),
        Recipe("mxfp4-fdw-sr", rne, sr, sr),
        Recipe("mxfp4-fdw-rht", rne, rne, replace(rne, rotation=16, signs="per-step")),
        Recipe("mxfp4-fdw-h16", rne, rne, h16),
        Recipe("mxfp4-fdw-h16fixed", rne, rne, replace(rne, rotation=16, signs="fixed")),
        Recipe("mxfp4-fdw-sr-rht", rne, sr, replace(sr, rotation=16, signs="per-step")),
        Recipe("nvfp4-fdw", nv, nv, nv),
        # TransformerEngine's NVFP4 recipe: stochastic rounding of gradients, a random Hadamard (16)
        # on the Wgrad operands with one fixed sign vector.
        Recipe("nvfp4-te", nv, replace(nv, grad_rounding="sr"),
               replace(nv, grad_rounding="sr", rotation=16, signs="fixed")),
        Recipe("mxfp4-fdw-h16all", h16, h16, h16),
    ]
    return {recipe.name: recipe for recipe in recipes}


# The recipe ladder of the ablation (docs/validation.md): bf16, the FP8 baseline, MXFP4 in more and
# more GEMMs, then the Wgrad fixes the two published studies disagree on, and NVFP4.
LADDER: Dict[str, Recipe] = _ladder()


# ------------------------------------------------------------------------------------------------
# The layer.


_HAS_OUT_DTYPE = None


def _mm_fp32(a: _torch.Tensor, b: _torch.Tensor) -> _torch.Tensor:
    """a @ b of bf16 CUDA tensors with fp32 accumulation and an fp32 result."""
    global _HAS_OUT_DTYPE
    if _HAS_OUT_DTYPE is not False:
        try:
            out = _torch.mm(a, b, out_dtype=_torch.float32)
            _HAS_OUT_DTYPE = True
            return out
        except TypeError:
            _HAS_OUT_DTYPE = False
    return _torch.mm(a.float(), b.float())  # exact operands: the same products, fp32 sums


def _quantize_operand(module: "MXLinear", t: _torch.Tensor, gemm: str, index: int, recipe: GemmRecipe):
    role, axis, gradient = _OPERANDS[gemm][index]
    t = t.contiguous()
    rows, cols = t.shape
    # The options and storage sizes of each operand, made once per module and shape: only the step
    # changes from call to call.
    key = (gemm, index, rows, cols, t.device)
    cached = module._mxs_operands.get(key)
    identity = (module.recipe, recipe, module.layer_name)
    if cached is None or cached[0] != identity:
        options = _api.make_options(recipe.operand_format(gradient), axis=axis, block=recipe.block or None,
                                    rounding=recipe.operand_rounding(gradient), scale_rule=recipe.scale_rule,
                                    rotation=recipe.rotation, signs=recipe.signs, seed=module.recipe.seed,
                                    step=module.step, sr_bits=recipe.sr_bits, layer=module.layer_name, role=role,
                                    seed_policy=recipe.seed_policy)
        counters = _torch.zeros(4, dtype=_torch.int64, device=t.device) if t.device.type == "cuda" else None
        cached = (identity, options, _api._layout(options, rows, cols), counters)
        module._mxs_operands[key] = cached
    _, options, layout, counters = cached
    options.step = module.step
    cuda = t.device.type == "cuda"
    # On CUDA the counts accumulate in the module's counter tensor (nothing waits for them).
    return _api.quantize_matrix(t, rows, cols, options, dequantized=not cuda, operand=cuda, layout=layout,
                                counters=counters)


def _product(a, b, transpose_a: bool, transpose_b: bool, out_dtype: _torch.dtype) -> _torch.Tensor:
    """The GEMM of two quantized operands (as [rows, cols] views, optionally transposed)."""
    if a.operand is not None:
        left = a.operand.t() if transpose_a else a.operand
        right = b.operand.t() if transpose_b else b.operand
        alpha = a.tensor_scale * b.tensor_scale
        if alpha == 1.0 and out_dtype == _torch.bfloat16:
            return _torch.mm(left, right)
        out = _mm_fp32(left, right)
        if alpha != 1.0:
            out = out * alpha
        return out.to(out_dtype)
    left = a.dequantized.t() if transpose_a else a.dequantized
    right = b.dequantized.t() if transpose_b else b.dequantized
    return _torch.mm(left, right).to(out_dtype)


def _metadata(prefix: str, module: "MXLinear", recipe: GemmRecipe, gradient: bool, axis: int) -> Dict[str, str]:
    """The dump's recipe keys of a hardware-quantized operand (docs/dump-format.md)."""
    fields = {"format": recipe.operand_format(gradient), "block": str(recipe.block or 32), "axis": str(axis),
              "scale_rule": recipe.scale_rule, "rounding": recipe.operand_rounding(gradient),
              "seed": str(module.recipe.seed), "rotation": f"hadamard:{recipe.rotation}" if recipe.rotation else "none",
              "signs": recipe.signs if recipe.rotation else "none", "layer": module.layer_name,
              "step": str(module.step if recipe.seed_policy == "per-step" else 0), "sr_bits": str(recipe.sr_bits)}
    return {f"{prefix}.{key}": value for key, value in fields.items()}


def _report_operands(module: "MXLinear", gemm: str, recipe: GemmRecipe, quantized) -> None:
    """Hands the operands of `gemm` to an active mxscope.capture.Capture (MX formats only: the dump
    stores MX codes and e8m0 scales)."""
    if not getattr(module, "mxscope_capture_quantized", False):
        return
    if not all(recipe.operand_format(operand[2]).startswith("mx") for operand in _OPERANDS[gemm]):
        return
    if recipe.rotation and recipe.signs != "none" and recipe.seed_policy != "per-step":
        return  # one step field cannot describe both streams
    entry = {}
    for (role, axis, gradient), q in zip(_OPERANDS[gemm], quantized):
        entry[role] = (q.codes, q.scales, _metadata(role, module, recipe, gradient, axis))
    module.mxscope_quantized_operands.append(entry)


class _MXLinearFunction(_torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, module):
        ctx.module = module
        ctx.save_for_backward(x2d, weight)
        recipe = module.recipe.fprop
        if recipe is None:
            return x2d @ weight.to(x2d.dtype).t()
        xq = _quantize_operand(module, x2d, "fprop", 0, recipe)
        wq = _quantize_operand(module, weight, "fprop", 1, recipe)
        if module.recipe.wgrad is None:
            _report_operands(module, "fprop", recipe, (xq, wq))
        return _product(xq, wq, False, True, x2d.dtype)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight = ctx.saved_tensors
        module = ctx.module
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            recipe = module.recipe.dgrad
            if recipe is None:
                dx = dy.to(x2d.dtype) @ weight.to(x2d.dtype)
            else:
                dyq = _quantize_operand(module, dy, "dgrad", 0, recipe)
                wq = _quantize_operand(module, weight, "dgrad", 1, recipe)
                dx = _product(dyq, wq, False, False, x2d.dtype)
        if ctx.needs_input_grad[1]:
            recipe = module.recipe.wgrad
            if recipe is None:
                dw = (dy.t() @ x2d.to(dy.dtype)).float()
            else:
                dyq = _quantize_operand(module, dy, "wgrad", 0, recipe)
                xq = _quantize_operand(module, x2d, "wgrad", 1, recipe)
                _report_operands(module, "wgrad", recipe, (dyq, xq))
                dw = _product(dyq, xq, True, False, _torch.float32)
            dw = dw.to(weight.dtype)
        return dx, dw, None


class MXLinear(_nn.Linear):
    """nn.Linear whose fprop, dgrad and wgrad follow `recipe`. With no quantized GEMM it computes
    exactly what nn.Linear does. layer_name (set by convert to the module's qualified name) and
    step (set by set_step) enter the random streams, as the replay's layer and step do."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 recipe: Optional[Recipe] = None, layer_name: str = ""):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe if recipe is not None else Recipe()
        self.layer_name = layer_name
        self.step = 0
        self._mxs_operands = {}

    @classmethod
    def from_linear(cls, linear: _nn.Linear, recipe: Recipe, layer_name: str = "") -> "MXLinear":
        """An MXLinear sharing `linear`'s parameters (no copy)."""
        out = cls.__new__(cls)
        _nn.Module.__init__(out)
        out.in_features, out.out_features = linear.in_features, linear.out_features
        out.weight = linear.weight
        out.bias = linear.bias
        out.recipe, out.layer_name, out.step = recipe, layer_name, 0
        out._mxs_operands = {}
        return out

    def forward(self, x: _torch.Tensor) -> _torch.Tensor:
        if not self.recipe.quantized:
            return super().forward(x)
        leading = x.shape[:-1]
        x2d = x.reshape(-1, x.shape[-1])
        cast = _autocast_dtype(x.device.type)
        if cast is not None and x2d.dtype != cast:
            x2d = x2d.to(cast)  # what autocast would feed the matmul
        with _torch.autocast(device_type=x.device.type, enabled=False):
            y = _MXLinearFunction.apply(x2d, self.weight, self)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        return y.reshape(*leading, self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"


def convert(model: _nn.Module, recipe: Recipe, include: str = r".*", exclude: Optional[str] = None) -> _nn.Module:
    """Replaces, in place, every nn.Linear whose qualified name matches `include` (re.fullmatch)
    and not `exclude` by an MXLinear with `recipe` that shares its parameters; returns the model.
    Raises ValueError when nothing matches, so a typo in the pattern is not a silent bf16 run."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe: expected a mxscope.torch.Recipe, got {type(recipe).__name__}")
    pattern = re.compile(include)
    skip = re.compile(exclude) if exclude else None
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, _nn.Linear) and pattern.fullmatch(name) and not (skip and skip.fullmatch(name))]
    if not targets:
        names = [name for name, module in model.named_modules() if isinstance(module, _nn.Linear)]
        raise ValueError(f"include: no nn.Linear module name matches {include!r}; the linear layers are {names}")
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(module, MXLinear):
            module.recipe, module.layer_name = recipe, name
            module._mxs_operands = {}
            continue
        setattr(parent, child, MXLinear.from_linear(module, recipe, name))
    return model


def set_step(model: _nn.Module, step: int) -> None:
    """Sets the training step every MXLinear of `model` uses for its random streams (call it once
    per optimizer step, before the forward; stochastic rounding and per-step signs depend on it)."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2 ** 32:
        raise ValueError(f"step: an integer in 0..2^32-1, got {step!r}")
    for module in model.modules():
        if isinstance(module, MXLinear):
            module.step = step


def mx_linears(model: _nn.Module) -> Dict[str, MXLinear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, MXLinear)}


__all__ = ["GemmRecipe", "Recipe", "LADDER", "MXLinear", "convert", "set_step", "mx_linears", "GEMMS"]
