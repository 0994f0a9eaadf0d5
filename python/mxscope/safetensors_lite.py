"""A small safetensors writer and reader for torch tensors, used when the `safetensors` package is
not installed (Debian 12 does not ship it) and by the tests.

File layout: 8-byte little-endian header length N, N bytes of UTF-8 JSON header
{"name": {"dtype", "shape", "data_offsets": [begin, end]}, ..., "__metadata__": {str: str}},
then the raw little-endian tensor bytes. Tensors are stored sorted by name and the header is padded
with spaces to a multiple of 8 bytes, as the reference implementation does.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from typing import Dict, Optional, Tuple

import torch

if sys.byteorder != "little":  # the raw data section is little-endian by definition
    raise RuntimeError("safetensors_lite writes native memory and needs a little-endian machine")

DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}
# Same-width integer dtypes used to reach the bytes of float tensors through numpy (which has no bf16).
_BIT_VIEWS = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.dtype in _BIT_VIEWS:
        tensor = tensor.view(_BIT_VIEWS[tensor.dtype])
    return tensor.numpy().tobytes()


def serialize(tensors: Dict[str, torch.Tensor], metadata: Optional[Dict[str, str]] = None) -> bytes:
    header = {}
    chunks = []
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name]
        if tensor.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} has no safetensors name here")
        data = tensor_bytes(tensor)
        header[name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    if metadata:
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ValueError(f"metadata {key!r}: keys and values must be strings")
        header["__metadata__"] = dict(sorted(metadata.items()))
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def write_atomically(path: str, contents: bytes) -> None:
    """Writes PATH.tmp.<pid>, fsyncs it and renames it over PATH: readers see all or nothing."""
    temporary = f"{path}.tmp.{os.getpid()}"
    with open(temporary, "wb") as handle:
        handle.write(contents)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def save_file(tensors: Dict[str, torch.Tensor], path: str, metadata: Optional[Dict[str, str]] = None) -> None:
    write_atomically(path, serialize(tensors, metadata))


def load_file(path: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """Reads every tensor (to CPU) and the metadata; for tests and small files."""
    with open(path, "rb") as handle:
        contents = handle.read()
    (header_length,) = struct.unpack("<Q", contents[:8])
    header = json.loads(contents[8:8 + header_length].decode("utf-8"))
    data = contents[8 + header_length:]
    metadata = header.pop("__metadata__", {}) or {}
    tensors = {}
    for name, info in header.items():
        dtype = DTYPES_BY_NAME[info["dtype"]]
        begin, end = info["data_offsets"]
        raw = bytearray(data[begin:end])
        storage_dtype = _BIT_VIEWS.get(dtype, dtype)
        if end > begin:
            flat = torch.frombuffer(raw, dtype=storage_dtype).clone()
        else:
            flat = torch.empty(0, dtype=storage_dtype)
        if storage_dtype != dtype:
            flat = flat.view(dtype)
        tensors[name] = flat.reshape(info["shape"])
    return tensors, metadata
