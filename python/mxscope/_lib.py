"""Loading libmxscope_c (include/mxscope/c_api.h) with ctypes, and its C structures.

The library is looked up, in order: the file named by the environment variable MXSCOPE_LIBRARY; next
to this package (a bundle); the installed layout (PREFIX/lib/python3/dist-packages/mxscope ->
PREFIX/lib); the source tree's build folder (python/mxscope -> build). It is loaded on first use, so
`import mxscope` never fails for a missing library: the first call says where it looked.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import threading
from typing import Optional

_LIBRARY_NAME = "libmxscope_c.so"
_HERE = os.path.dirname(os.path.abspath(__file__))

MXS_OK, MXS_VALUE_ERROR, MXS_TYPE_ERROR, MXS_RUNTIME_ERROR = 0, 1, 2, 3
MXS_F32, MXS_BF16, MXS_F16 = 0, 1, 2
MXS_CPU, MXS_CUDA = 0, 1
MXS_BLOCK_SCALES, MXS_TENSOR_SCALE = 0, 1


class QuantizeOptions(ctypes.Structure):
    _fields_ = [
        ("format", ctypes.c_char_p), ("axis", ctypes.c_int), ("block", ctypes.c_int),
        ("rounding", ctypes.c_char_p), ("scale_rule", ctypes.c_char_p), ("rotation", ctypes.c_int),
        ("signs", ctypes.c_char_p), ("seed", ctypes.c_uint64), ("step", ctypes.c_uint32),
        ("layer", ctypes.c_char_p), ("role", ctypes.c_char_p), ("sr_bits", ctypes.c_int),
        ("seed_policy", ctypes.c_char_p),
    ]


class QuantizeLayout(ctypes.Structure):
    _fields_ = [
        ("code_rows", ctypes.c_int64), ("code_cols", ctypes.c_int64), ("scale_rows", ctypes.c_int64),
        ("scale_cols", ctypes.c_int64), ("scale_kind", ctypes.c_int), ("block", ctypes.c_int),
    ]


class QuantizeResult(ctypes.Structure):
    _fields_ = [
        ("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("dequantized", ctypes.c_void_p),
        ("operand_bf16", ctypes.c_void_p), ("device_counters", ctypes.c_void_p),
        ("tensor_scale", ctypes.c_float), ("nonzero", ctypes.c_int64), ("flushed", ctypes.c_int64),
        ("saturated", ctypes.c_int64), ("nonfinite", ctypes.c_int64),
    ]


class GemmRequest(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_char_p), ("format_a", ctypes.c_char_p), ("format_b", ctypes.c_char_p),
        ("strategy", QuantizeOptions), ("accumulation", ctypes.c_char_p), ("output", ctypes.c_char_p),
        ("reference", ctypes.c_char_p), ("device", ctypes.c_int),
    ]


class GemmMetrics(ctypes.Structure):
    _fields_ = [
        ("rel_err", ctypes.c_double), ("cosine", ctypes.c_double), ("bias", ctypes.c_double),
        ("orth_err", ctypes.c_double), ("max_abs_err", ctypes.c_double), ("ulp_mean", ctypes.c_double),
        ("ulp_max", ctypes.c_int64), ("nonfinite_out", ctypes.c_int64),
        ("elements", ctypes.c_int64 * 2), ("nonzero", ctypes.c_int64 * 2), ("flushed", ctypes.c_int64 * 2),
        ("saturated", ctypes.c_int64 * 2), ("nonfinite", ctypes.c_int64 * 2),
        ("signal_energy", ctypes.c_double * 2), ("error_energy", ctypes.c_double * 2),
    ]


def candidates() -> list:
    """Where the library is looked for, in order."""
    found = []
    named = os.environ.get("MXSCOPE_LIBRARY")
    if named:
        found.append(named)
    found.append(os.path.join(_HERE, _LIBRARY_NAME))
    found.append(os.path.normpath(os.path.join(_HERE, "..", "..", "..", _LIBRARY_NAME)))
    found.extend(sorted(glob.glob(os.path.join(_HERE, "..", "..", "..", "*", _LIBRARY_NAME))))  # multiarch libdir
    found.append(os.path.normpath(os.path.join(_HERE, "..", "..", "build", _LIBRARY_NAME)))
    return found


_lock = threading.Lock()
_library: Optional[ctypes.CDLL] = None


def _declare(library: ctypes.CDLL) -> None:
    p = ctypes.POINTER
    library.mxs_version.restype = ctypes.c_char_p
    library.mxs_last_error.restype = ctypes.c_char_p
    library.mxs_cuda_device_count.restype = ctypes.c_int
    library.mxs_cuda_select.argtypes = [ctypes.c_int]
    library.mxs_quantize_layout.argtypes = [p(QuantizeOptions), ctypes.c_int64, ctypes.c_int64, p(QuantizeLayout)]
    library.mxs_quantize.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                     ctypes.c_void_p, p(QuantizeOptions), p(QuantizeResult)]
    library.mxs_gemm.argtypes = [p(GemmRequest), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, p(GemmMetrics)]
    library.mxs_reference.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]


def library() -> ctypes.CDLL:
    """The loaded libmxscope_c (loaded once)."""
    global _library
    with _lock:
        if _library is not None:
            return _library
        tried = []
        for path in candidates():
            if not os.path.exists(path):
                tried.append(f"{path} (missing)")
                continue
            try:
                # Load after torch, so that both use the CUDA runtime torch brought (one runtime).
                import torch  # noqa: F401
                loaded = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
            except OSError as error:
                tried.append(f"{path} ({error})")
                continue
            _declare(loaded)
            _library = loaded
            return loaded
        raise ImportError("mxscope: libmxscope_c.so not found; build it (cmake --build build --target mxscope_c) "
                          "or set MXSCOPE_LIBRARY; looked at: " + "; ".join(tried))


# The C library names its fields as the CLI's flags do; the Python API names them as keywords.
_FLAG_NAMES = re.compile(r"--(format-a|format-b|format|block|rounding|scale-rule|rotation|signs|seed-policy|seed|"
                         r"step|sr-bits|layer|accum|output|reference)\b")


def check(status: int) -> None:
    """Raises ValueError, TypeError or RuntimeError for a failed call, with the library's message."""
    if status == MXS_OK:
        return
    message = (library().mxs_last_error() or b"").decode("utf-8", "replace")
    message = _FLAG_NAMES.sub(lambda m: m.group(1).replace("-", "_"), message)
    if status == MXS_VALUE_ERROR:
        raise ValueError(message)
    if status == MXS_TYPE_ERROR:
        raise TypeError(message)
    raise RuntimeError(message)


def text(value) -> Optional[bytes]:
    return None if value is None else str(value).encode("utf-8")
