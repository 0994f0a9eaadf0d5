"""mxscope.quantize, mxscope.gemm and mxscope.reference on torch tensors (docs/python.md)."""

from __future__ import annotations

import ctypes
import math
import threading
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import torch

from . import _lib

_DTYPES = {torch.float32: _lib.MXS_F32, torch.bfloat16: _lib.MXS_BF16, torch.float16: _lib.MXS_F16}
ROLES = ("x", "dy", "w")


def version() -> str:
    """The C library's version, 'X.Y.Z (git HASH)'."""
    return _lib.library().mxs_version().decode()


def cuda_device_count() -> int:
    """CUDA devices the library's GPU backend sees (0 in a build without it)."""
    return int(_lib.library().mxs_cuda_device_count())


def _rotation_size(rotation) -> int:
    """None / 0 / 'none' -> 0; B or 'hadamard:B' -> B (the library checks B)."""
    if rotation is None or rotation == 0 or rotation == "none":
        return 0
    if isinstance(rotation, bool):
        raise TypeError(f"rotation: expected None, an int or 'hadamard:B', got {rotation!r}")
    if isinstance(rotation, int):
        return rotation
    if isinstance(rotation, str) and rotation.startswith("hadamard:"):
        digits = rotation[len("hadamard:"):]
        if digits.isdigit():
            return int(digits)
        raise ValueError(f"rotation: '{rotation}': the size after 'hadamard:' must be an integer")
    raise ValueError(f"rotation: expected None, an int or 'hadamard:B', got {rotation!r}")


def _integer(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name}: must be in {low}..{high}, got {value}")
    return value


def make_options(format: str, *, axis: int, block: Optional[int], rounding: str, scale_rule: str, rotation,
                 signs: str, seed: int, step: int, sr_bits: int, layer: str, role: Optional[str],
                 seed_policy: str) -> _lib.QuantizeOptions:
    """The C library's options (every value checked there; types here)."""
    if not isinstance(format, str):
        raise TypeError(f"format: expected a str, got {type(format).__name__}")
    if role is not None and role not in ROLES:
        raise ValueError(f"role: must be one of {ROLES} or None, got {role!r}")
    block_value = 0 if block is None else _integer("block", block, 1, 1 << 20)
    return _lib.QuantizeOptions(
        format=_lib.text(format), axis=axis, block=block_value, rounding=_lib.text(rounding),
        scale_rule=_lib.text(scale_rule), rotation=_rotation_size(rotation), signs=_lib.text(signs),
        seed=_integer("seed", seed, 0, (1 << 64) - 1), step=_integer("step", step, 0, (1 << 32) - 1),
        layer=_lib.text(layer), role=_lib.text(role or ""), sr_bits=_integer("sr_bits", sr_bits, 1, 32),
        seed_policy=_lib.text(seed_policy))


def as_matrix_shape(shape: torch.Size, axis: int) -> Tuple[int, int, int]:
    """(rows, cols, axis of the [rows, cols] view) for a tensor quantized along `axis`: the last axis
    with every leading dimension folded into rows, or axis 0 with the trailing ones folded into cols."""
    ndim = len(shape)
    if ndim == 0:
        raise ValueError("tensor: a scalar has no axis to quantize along")
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"axis: expected an int, got {type(axis).__name__}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis: {axis} is out of range for a {ndim}-D tensor")
    axis %= ndim
    if ndim == 1:
        return 1, int(shape[0]), 1
    if axis == ndim - 1:
        return math.prod(shape[:-1]), int(shape[-1]), 1
    if axis == 0:
        return int(shape[0]), math.prod(shape[1:]), 0
    raise ValueError(f"axis: {axis} of a {ndim}-D tensor; quantize along the first or the last axis (or reshape)")


def check_tensor(t, name: str = "tensor") -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name}: dtype must be float32, bfloat16 or float16, got {t.dtype}")
    if t.device.type not in ("cpu", "cuda"):
        raise TypeError(f"{name}: device must be cpu or cuda, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (row-major); call .contiguous() first")


@dataclass
class QuantizedTensor:
    """The result of mxscope.quantize, in the layout of docs/dump-format.md."""
    dequantized: Optional[torch.Tensor]  # fp32, the input's shape (in the rotated basis where rotated)
    codes: torch.Tensor                  # uint8 [rows, code_cols]
    scales: torch.Tensor                 # uint8 block scales [scale_rows, scale_cols], or fp32 [1] tensor scale
    tensor_scale: float                  # NVFP4 global decode scale, per-tensor fp8 scale, else 1.0
    format: str
    block: int
    axis: int                            # of the [rows, cols] view
    operand: Optional[torch.Tensor] = None  # bf16 GEMM operand (values without the tensor scale)
    _counts: Optional[torch.Tensor] = None  # int64 [4]: nonzero, flushed, saturated, nonfinite

    def _count(self, index: int) -> int:
        return int(self._counts[index].item())

    @property
    def nonzero(self) -> int:
        return self._count(0)

    @property
    def flushed(self) -> int:
        """Nonzero inputs quantized to zero."""
        return self._count(1)

    @property
    def saturated(self) -> int:
        """Inputs clipped at the format's largest normal."""
        return self._count(2)

    @property
    def nonfinite(self) -> int:
        return self._count(3)


_layouts: Dict[tuple, Tuple[_lib.QuantizeLayout, ]] = {}


def _layout(options: _lib.QuantizeOptions, rows: int, cols: int) -> _lib.QuantizeLayout:
    key = (options.format, options.axis, options.block, options.rounding, options.scale_rule, options.rotation,
           options.signs, options.seed, options.step, options.layer, options.role, options.sr_bits,
           options.seed_policy, rows, cols)
    found = _layouts.get(key)
    if found is None:
        found = _lib.QuantizeLayout()
        _lib.check(_lib.library().mxs_quantize_layout(ctypes.byref(options), rows, cols, ctypes.byref(found)))
        if len(_layouts) > 4096:
            _layouts.clear()
        _layouts[key] = found
    return found


_selected = threading.local()


def _selected_index() -> Optional[int]:
    """The CUDA device the library was last made current on, in this thread (None: not yet)."""
    return getattr(_selected, "index", None)


def _select(device: torch.device) -> None:
    """Makes the library's current CUDA device the tensor's (once per change, per thread)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if getattr(_selected, "index", None) != index:
        _lib.check(_lib.library().mxs_cuda_select(index))
        _selected.index = index


def quantize_matrix(t: torch.Tensor, rows: int, cols: int, options: _lib.QuantizeOptions, *,
                    dequantized: bool = True, operand: bool = False, counts_on_device: bool = False,
                    layout: Optional[_lib.QuantizeLayout] = None,
                    counters: Optional[torch.Tensor] = None) -> QuantizedTensor:
    """Quantizes contiguous `t` viewed as [rows, cols] (the library call behind quantize and
    MXLinear). layout: the storage sizes when the caller has them; counters: an int64 [4] device
    tensor the counts are added to (CUDA), instead of a new one."""
    if layout is None:
        layout = _layout(options, rows, cols)
    device = t.device
    codes = torch.empty((layout.code_rows, layout.code_cols), dtype=torch.uint8, device=device)
    blocked = layout.scale_kind == _lib.MXS_BLOCK_SCALES
    scales = torch.empty((layout.scale_rows, layout.scale_cols) if blocked else (1,),
                         dtype=torch.uint8 if blocked else torch.float32, device=device)
    values = torch.empty(t.shape, dtype=torch.float32, device=device) if dequantized else None
    bf16 = torch.empty(t.shape, dtype=torch.bfloat16, device=device) if operand else None
    result = _lib.QuantizeResult()
    result.codes = codes.data_ptr() if codes.numel() else None
    result.scales = scales.data_ptr() if blocked and scales.numel() else None
    result.dequantized = values.data_ptr() if values is not None and values.numel() else None
    result.operand_bf16 = bf16.data_ptr() if bf16 is not None and bf16.numel() else None
    stream = None
    cuda = device.type == "cuda"
    if cuda:
        _select(device)
        stream = torch.cuda.current_stream(device).cuda_stream
        if counters is None and counts_on_device:
            counters = torch.zeros(4, dtype=torch.int64, device=device)
        if counters is not None:
            result.device_counters = counters.data_ptr()
    _lib.check(_lib.library().mxs_quantize(t.data_ptr() if t.numel() else None, _DTYPES[t.dtype], rows, cols,
                                           _lib.MXS_CUDA if cuda else _lib.MXS_CPU, stream, ctypes.byref(options),
                                           ctypes.byref(result)))
    if not cuda or counters is None:
        counters = torch.tensor([result.nonzero, result.flushed, result.saturated, result.nonfinite],
                                dtype=torch.int64)
    if not blocked:
        scales.fill_(result.tensor_scale)
    return QuantizedTensor(dequantized=values, codes=codes, scales=scales, tensor_scale=float(result.tensor_scale),
                           format=options.format.decode(), block=layout.block, axis=options.axis, operand=bf16,
                           _counts=counters)


def quantize(t: torch.Tensor, format: str, *, axis: int = -1, block: Optional[int] = None, rounding: str = "rne",
             scale_rule: str = "floor", rotation: Union[None, int, str] = None, signs: str = "none", seed: int = 0,
             step: int = 0, sr_bits: int = 32, layer: str = "", role: Optional[str] = None,
             seed_policy: str = "per-step", operand: bool = False) -> QuantizedTensor:
    """Rotates (rotation: a Hadamard block size, or 'hadamard:B') and quantizes `t` along `axis` with
    the bits of `mxscope quantize` under the same flags. `t`: a contiguous float32, bfloat16 or
    float16 tensor on the CPU or a CUDA device (float16 on the CPU only); 1-D, 2-D, or N-D along the
    first or last axis (the other dimensions folded). block None: the format's default (32 for MX,
    16 for nvfp4). role ('x', 'dy', 'w' or None) and layer tag the random streams as the CLI's
    tensor name and --layer do. operand=True also returns the bf16 GEMM operand (docs/python.md).
    Every output lives on the input's device; on CUDA the work runs on the current stream."""
    check_tensor(t)
    rows, cols, matrix_axis = as_matrix_shape(t.shape, axis)
    options = make_options(format, axis=matrix_axis, block=block, rounding=rounding, scale_rule=scale_rule,
                           rotation=rotation, signs=signs, seed=seed, step=step, sr_bits=sr_bits, layer=layer,
                           role=role, seed_policy=seed_policy)
    return quantize_matrix(t, rows, cols, options, dequantized=True, operand=operand)


# ------------------------------------------------------------------------------------------------
# GEMMs and the reference (measurement functions: host memory inside the library).

_KINDS = {"fprop": ("x", "w"), "dgrad": ("dy", "w"), "wgrad": ("dy", "x")}


@dataclass
class GemmResult:
    """The emulated GEMM (fp32), its reference (fp64) and the metrics of `mxscope gemm --json`."""
    out: torch.Tensor
    reference: torch.Tensor
    metrics: Dict[str, float]
    operands: Dict[str, Dict[str, float]]


def _host_fp32(t: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor, got shape {list(t.shape)}")
    if t.dtype not in _DTYPES and t.dtype != torch.float64:
        raise TypeError(f"{name}: dtype must be float32, bfloat16 or float16, got {t.dtype}")
    if t.dtype == torch.float64:
        raise TypeError(f"{name}: float64 operands would be rounded; pass float32 (or bf16/fp16) values")
    return t.detach().to("cpu", torch.float32).contiguous()


def _strategy_fields(strategy) -> dict:
    if strategy is None:
        return {}
    if isinstance(strategy, str):
        return {"format": strategy}
    if isinstance(strategy, dict):
        return dict(strategy)
    fields = getattr(strategy, "gemm_fields", None)
    if callable(fields):
        return fields()
    raise TypeError(f"strategy: expected a format name, a dict or a GemmRecipe, got {type(strategy).__name__}")


def gemm(a: torch.Tensor, b: torch.Tensor, *, kind: str, strategy="mxfp4", accumulation: str = "fp32-block",
         output: str = "fp32", reference: str = "exact", device: Optional[str] = None) -> GemmResult:
    """One emulated GEMM of a linear layer, as `mxscope gemm`: kind 'fprop' (a = x [K, n_in],
    b = w [n_out, n_in], out = x w^T), 'dgrad' (a = dy [K, n_out], b = w, out = dy w) or 'wgrad'
    (a = dy, b = x, out = dy^T x). strategy: a format name, a dict of the gemm flags (format or
    format_a/format_b, rounding, scale_rule, rotation, signs, seed, step, sr_bits, layer, seed_policy,
    block) or a mxscope.torch.GemmRecipe. device: 'cpu' or 'cuda' (default: where `a` is)."""
    if kind not in _KINDS:
        raise ValueError(f"kind: unknown GEMM {kind!r} (expected fprop, dgrad or wgrad)")
    where = device if device is not None else (a.device.type if isinstance(a, torch.Tensor) else "cpu")
    if where not in ("cpu", "cuda"):
        raise TypeError(f"device: must be 'cpu' or 'cuda', got {where!r}")
    left, right = _host_fp32(a, "a"), _host_fp32(b, "b")
    fields = _strategy_fields(strategy)
    known = {"format", "format_a", "format_b", "rounding", "scale_rule", "rotation", "signs", "seed", "step",
             "sr_bits", "layer", "seed_policy", "block"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"strategy: unknown fields {unknown} (known: {sorted(known)})")
    format_a = fields.get("format_a", fields.get("format"))
    format_b = fields.get("format_b", fields.get("format"))
    if format_a is None or format_b is None:
        raise ValueError("strategy: give a format (or both format_a and format_b)")
    options = make_options("bf16", axis=1, block=fields.get("block"), rounding=fields.get("rounding", "rne"),
                           scale_rule=fields.get("scale_rule", "floor"), rotation=fields.get("rotation"),
                           signs=fields.get("signs", "none"), seed=fields.get("seed", 0), step=fields.get("step", 0),
                           sr_bits=fields.get("sr_bits", 32), layer=fields.get("layer", ""), role=None,
                           seed_policy=fields.get("seed_policy", "per-step"))
    request = _lib.GemmRequest(kind=_lib.text(kind), format_a=_lib.text(format_a), format_b=_lib.text(format_b),
                               strategy=options, accumulation=_lib.text(accumulation), output=_lib.text(output),
                               reference=_lib.text(reference),
                               device=_lib.MXS_CUDA if where == "cuda" else _lib.MXS_CPU)
    rows, cols = {"fprop": (left.shape[0], right.shape[0]), "dgrad": (left.shape[0], right.shape[1]),
                  "wgrad": (left.shape[1], right.shape[1])}[kind]
    out = torch.empty((rows, cols), dtype=torch.float32)
    ref = torch.empty((rows, cols), dtype=torch.float64)
    metrics = _lib.GemmMetrics()
    _lib.check(_lib.library().mxs_gemm(ctypes.byref(request), left.data_ptr(), left.shape[0], left.shape[1],
                                       right.data_ptr(), right.shape[0], right.shape[1], out.data_ptr(),
                                       ref.data_ptr(), ctypes.byref(metrics)))
    names = _KINDS[kind]
    operands = {}
    for i, name in enumerate(names):
        operands[name] = {"elements": metrics.elements[i], "nonzero": metrics.nonzero[i],
                          "flushed": metrics.flushed[i], "saturated": metrics.saturated[i],
                          "nonfinite": metrics.nonfinite[i], "signal_energy": metrics.signal_energy[i],
                          "error_energy": metrics.error_energy[i]}
    values = {key: getattr(metrics, key) for key in ("rel_err", "cosine", "bias", "orth_err", "max_abs_err",
                                                      "ulp_mean", "ulp_max", "nonfinite_out")}
    return GemmResult(out=out, reference=ref, metrics=values, operands=operands)


def reference(a: torch.Tensor, b: torch.Tensor, *, kind: Optional[str] = None, method: str = "exact",
              dtype: torch.dtype = torch.float64, device: Optional[str] = None) -> torch.Tensor:
    """The reference product of the unquantized operands, correctly rounded from the exact sum
    (method 'exact') or the certified fp64 sum ('fp64'): a @ b for a [M, K] and b [K, N] when kind
    is None, else the GEMM `kind` of mxscope.gemm with its operand convention. dtype float64 or
    float32 (each rounded once from the exact sum)."""
    if dtype not in (torch.float64, torch.float32):
        raise TypeError(f"dtype: float64 or float32, got {dtype}")
    where = device if device is not None else (a.device.type if isinstance(a, torch.Tensor) else "cpu")
    if where not in ("cpu", "cuda"):
        raise TypeError(f"device: must be 'cpu' or 'cuda', got {where!r}")
    left, right = _host_fp32(a, "a"), _host_fp32(b, "b")
    if kind is None:
        if left.shape[1] != right.shape[0]:
            raise ValueError(f"b: shape {list(right.shape)} does not follow a {list(left.shape)} (a @ b)")
        canonical_a, canonical_b = left, right.t().contiguous()
    elif kind == "fprop":
        canonical_a, canonical_b = left, right
    elif kind == "dgrad":
        canonical_a, canonical_b = left, right.t().contiguous()
    elif kind == "wgrad":
        canonical_a, canonical_b = left.t().contiguous(), right.t().contiguous()
    else:
        raise ValueError(f"kind: unknown GEMM {kind!r} (expected fprop, dgrad, wgrad or None)")
    if canonical_a.shape[1] != canonical_b.shape[1]:
        raise ValueError(f"b: reduction lengths differ ({canonical_a.shape[1]} and {canonical_b.shape[1]})")
    m, k = canonical_a.shape
    n = canonical_b.shape[0]
    out64 = torch.empty((m, n), dtype=torch.float64)
    out32 = torch.empty((m, n), dtype=torch.float32)
    _lib.check(_lib.library().mxs_reference(_lib.text(method), _lib.MXS_CUDA if where == "cuda" else _lib.MXS_CPU,
                                            canonical_a.data_ptr(), canonical_b.data_ptr(), m, n, k,
                                            out64.data_ptr(), out32.data_ptr()))
    return out64 if dtype == torch.float64 else out32
