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

import ctypes as _ctypes
import re
from dataclasses import dataclass, replace
from typing import Dict, Optional

import torch as _torch
import torch.nn.functional as _F
from torch import nn as _nn

from . import _api, _lib
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


_raw_stream = getattr(_torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(index: int) -> int:
    """The current CUDA stream of device `index` as a pointer (torch's raw accessor where it has one:
    no Stream object per call)."""
    if _raw_stream is not None:
        return _raw_stream(index)
    return _torch.cuda.current_stream(index).cuda_stream


class _OperandQuantizer:
    """One operand of one MXLinear GEMM, for one shape and device. The library's options, storage
    sizes, result block and counters are made once; per call only the step, the input and the bf16
    operand change. On CUDA the codes and scales go to buffers kept here and overwritten by the next
    call (the layer multiplies only the operand) unless a capture keeps them."""

    __slots__ = ("identity", "options", "layout", "rows", "cols", "device", "counters", "result", "codes",
                 "scales", "function", "format", "by_reference")

    def __init__(self, identity, options, rows: int, cols: int, device: _torch.device):
        self.identity, self.options, self.rows, self.cols, self.device = identity, options, rows, cols, device
        self.layout = _api._layout(options, rows, cols)
        self.format = options.format.decode()
        self.counters = self.result = self.codes = self.scales = self.function = self.by_reference = None
        # The CUDA fast path: block-scaled formats (the per-tensor ones need the host's scale) on a
        # non-empty tensor.
        if device.type == "cuda" and self.layout.scale_kind == _lib.MXS_BLOCK_SCALES and rows * cols > 0:
            self.counters = _torch.zeros(4, dtype=_torch.int64, device=device)
            self.codes, self.scales = self._storage()
            self.result = _lib.QuantizeResult()
            self.result.device_counters = self.counters.data_ptr()
            self.function = _lib.library().mxs_quantize
            self.by_reference = (_ctypes.byref(options), _ctypes.byref(self.result))
        elif device.type == "cuda":
            self.counters = _torch.zeros(4, dtype=_torch.int64, device=device)

    def _storage(self):
        layout = self.layout
        return (_torch.empty((layout.code_rows, layout.code_cols), dtype=_torch.uint8, device=self.device),
                _torch.empty((layout.scale_rows, layout.scale_cols), dtype=_torch.uint8, device=self.device))

    def __call__(self, t: _torch.Tensor, step: int, keep_codes: bool) -> _api.QuantizedTensor:
        options = self.options
        options.step = step
        if self.function is None:  # the CPU, per-tensor formats, empty tensors
            cuda = t.device.type == "cuda"
            return _api.quantize_matrix(t, self.rows, self.cols, options, dequantized=not cuda, operand=cuda,
                                        layout=self.layout, counters=self.counters)
        codes, scales = self._storage() if keep_codes else (self.codes, self.scales)
        operand = _torch.empty_like(t, dtype=_torch.bfloat16)
        result = self.result
        result.codes = codes.data_ptr()
        result.scales = scales.data_ptr()
        result.operand_bf16 = operand.data_ptr()
        index = self.device.index
        if _api._selected_index() != index:
            _api._select(self.device)
        _lib.check(self.function(t.data_ptr(), _api._DTYPES[t.dtype], self.rows, self.cols, _lib.MXS_CUDA,
                                 _current_stream(index), *self.by_reference))
        return _api.QuantizedTensor(None, codes, scales, result.tensor_scale, self.format, self.layout.block,
                                    options.axis, operand, self.counters)


class _SharedInput:
    """One input several layers read, as found by _SharedInputs: the x operands quantized from it so
    far, by (recipe, axis, dtype of the layer's input after autocast's cast). The layers that found
    it keep it on their autograd context, so that in the backward they share wgrad's x operand too."""

    __slots__ = ("source", "operands")

    def __init__(self, source: _torch.Tensor):
        self.source = source  # held while the entry is in _SharedInputs: its memory is not reused
        self.operands = {}


class _SharedInputs:
    """Operands of one input that several MXLinears quantize alike (q, k and v of one hidden state;
    gate and up of a SwiGLU block): where a recipe's bits depend on neither the layer nor the step
    (no stochastic rounding, no random signs), the first layer's operand serves the others, in the
    forward (fprop's x) and in the backward (wgrad's x), with the bits each layer would compute.
    An input is found by its memory, shape, dtype and version counter, before any autocast cast
    (each layer casts its input itself): an entry holds its source, so that the memory is not reused
    while the entry lives, and an in-place write through the input or a view of it changes the
    version. convert() gives the layers it converts one of these; set_step empties it."""

    __slots__ = ("entries", "size")
    default_size = 4  # the inputs of one block's forward in flight at a time

    def __init__(self, size: Optional[int] = None):
        self.entries = []
        self.size = self.default_size if size is None else size  # 0: nothing is shared

    def find(self, t: _torch.Tensor) -> Optional[_SharedInput]:
        """The entry of input t (a layer's input as it arrives), made if there is none."""
        if self.size == 0:
            return None
        key = (t.data_ptr(), t.shape, t.dtype, t.device, t._version)
        for entry_key, entry in self.entries:
            if entry_key == key:
                return entry
        entry = _SharedInput(t)
        self.entries.insert(0, (key, entry))
        for _, old in self.entries[self.size:]:
            old.source = None
            old.operands.clear()  # forward operands; a backward starts a new set
        del self.entries[self.size:]
        return entry

    def clear(self) -> None:
        for _, entry in self.entries:
            entry.source = None
        self.entries.clear()

    def __reduce__(self):
        # copy.deepcopy(model) and torch.save(model) get an empty cache: the entries hold activations
        # (non-leaf tensors, which deepcopy refuses) and are worth nothing in a copy.
        return (_SharedInputs, (self.size,))


def _shareable(recipe: GemmRecipe) -> bool:
    """Whether the x operand's bits under `recipe` depend on neither the layer nor the step."""
    return recipe.rounding != "sr" and not (recipe.rotation and recipe.signs != "none")


class _PreparedOperands(dict):
    """A layer's _OperandQuantizers by (gemm, operand, shape, device). Copies and pickles of the layer
    start empty: the quantizers hold ctypes pointers and device buffers, and are remade on first use."""

    def __reduce__(self):
        return (_PreparedOperands, ())


def _quantize_operand(module: "MXLinear", t: _torch.Tensor, gemm: str, index: int, recipe: GemmRecipe,
                      shared: Optional[_SharedInput] = None):
    """The operand of `gemm` at `index`, or, for x with a shared input under a shareable recipe,
    the one another layer quantized from the same input (made and kept there if none has)."""
    t = t.contiguous()
    role, axis, _ = _OPERANDS[gemm][index]
    if shared is None or role != "x" or module.mxscope_capture_quantized or not _shareable(recipe):
        return _quantize_new(module, t, gemm, index, recipe)
    key = (recipe, axis, t.dtype)
    found = shared.operands.get(key)
    if found is None:
        found = _quantize_new(module, t, gemm, index, recipe)
        if gemm == "wgrad":
            shared.operands.clear()  # the forward is over: its operands are not needed again
        shared.operands[key] = found
    return found


def _quantize_new(module: "MXLinear", t: _torch.Tensor, gemm: str, index: int, recipe: GemmRecipe):
    rows, cols = t.shape
    key = (gemm, index, rows, cols, t.get_device())
    quantizer = module._mxs_operands.get(key)
    if (quantizer is None or quantizer.identity[0] is not module.recipe or quantizer.identity[1] is not recipe
            or quantizer.identity[2] is not module.layer_name):
        role, axis, gradient = _OPERANDS[gemm][index]
        options = _api.make_options(recipe.operand_format(gradient), axis=axis, block=recipe.block or None,
                                    rounding=recipe.operand_rounding(gradient), scale_rule=recipe.scale_rule,
                                    rotation=recipe.rotation, signs=recipe.signs, seed=module.recipe.seed,
                                    step=module.step, sr_bits=recipe.sr_bits, layer=module.layer_name, role=role,
                                    seed_policy=recipe.seed_policy)
        quantizer = _OperandQuantizer((module.recipe, recipe, module.layer_name), options, rows, cols, t.device)
        module._mxs_operands[key] = quantizer
    return quantizer(t, module.step, module.mxscope_capture_quantized)


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
    if not module.mxscope_capture_quantized:
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
    def forward(ctx, x2d, weight, module, shared):
        ctx.module, ctx.shared = module, shared
        ctx.save_for_backward(x2d, weight)
        recipe = module.recipe.fprop
        if recipe is None:
            return x2d @ weight.to(x2d.dtype).t()
        xq = _quantize_operand(module, x2d, "fprop", 0, recipe, shared)
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
                xq = _quantize_operand(module, x2d, "wgrad", 1, recipe, ctx.shared)
                _report_operands(module, "wgrad", recipe, (dyq, xq))
                dw = _product(dyq, xq, True, False, _torch.float32)
            dw = dw.to(weight.dtype)
        return dx, dw, None, None


class MXLinear(_nn.Linear):
    """nn.Linear whose fprop, dgrad and wgrad follow `recipe`. With no quantized GEMM it computes
    exactly what nn.Linear does. layer_name (set by convert to the module's qualified name) and
    step (set by set_step) enter the random streams, as the replay's layer and step do."""

    # Set by an active mxscope.capture.Capture while a step is captured (a class default, so that
    # reading it is a plain attribute lookup).
    mxscope_capture_quantized = False

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 recipe: Optional[Recipe] = None, layer_name: str = ""):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe if recipe is not None else Recipe()
        self.layer_name = layer_name
        self.step = 0
        self._mxs_operands = _PreparedOperands()
        self._mxs_shared = _SharedInputs()

    @classmethod
    def from_linear(cls, linear: _nn.Linear, recipe: Recipe, layer_name: str = "") -> "MXLinear":
        """An MXLinear sharing `linear`'s parameters (no copy)."""
        out = cls.__new__(cls)
        _nn.Module.__init__(out)
        out.in_features, out.out_features = linear.in_features, linear.out_features
        out.weight = linear.weight
        out.bias = linear.bias
        out.recipe, out.layer_name, out.step = recipe, layer_name, 0
        out._mxs_operands = _PreparedOperands()
        out._mxs_shared = _SharedInputs()
        return out

    def forward(self, x: _torch.Tensor) -> _torch.Tensor:
        if not self.recipe.quantized:
            return super().forward(x)
        leading = x.shape[:-1]
        x2d = x.reshape(-1, x.shape[-1])
        shared = self._mxs_shared.find(x2d)  # before the cast, which makes a new tensor per layer
        cast = _autocast_dtype(x.device.type)
        if cast is not None and x2d.dtype != cast:
            x2d = x2d.to(cast)  # what autocast would feed the matmul
        with _torch.autocast(device_type=x.device.type, enabled=False):
            y = _MXLinearFunction.apply(x2d, self.weight, self, shared)
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
    shared = _SharedInputs()
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if not isinstance(module, MXLinear):
            module = MXLinear.from_linear(module, recipe, name)
            setattr(parent, child, module)
        module.recipe, module.layer_name = recipe, name
        module._mxs_operands = _PreparedOperands()
        module._mxs_shared = shared
    return model


def set_step(model: _nn.Module, step: int) -> None:
    """Sets the training step every MXLinear of `model` uses for its random streams (call it once
    per optimizer step, before the forward; stochastic rounding and per-step signs depend on it)."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2 ** 32:
        raise ValueError(f"step: an integer in 0..2^32-1, got {step!r}")
    for module in model.modules():
        if isinstance(module, MXLinear):
            module.step = step
            module._mxs_shared.clear()


def mx_linears(model: _nn.Module) -> Dict[str, MXLinear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, MXLinear)}


__all__ = ["GemmRecipe", "Recipe", "LADDER", "MXLinear", "convert", "set_step", "mx_linears", "GEMMS"]
