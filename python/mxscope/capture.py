"""mxscope.capture: record the GEMM operands of nn.Linear layers during training into an mxscope
dump (docs/dump-format.md), for `mxscope replay`.

    from mxscope.capture import Capture
    capture = Capture(model, "dump", layers=r"layers\\.1\\.attn\\.o_proj", steps=[1, 2, 3])
    for step in range(1, steps + 1):
        capture.begin_step(step)                 # 1. before the step's first forward
        loss = model(batch).loss; loss.backward()
        capture.after_backward(step)             # 2. after the last backward, before clipping / optimizer
        optimizer.step(); optimizer.zero_grad()
    capture.close()                              # 3. removes the hooks, final manifest

What is recorded, per captured (step, layer) (docs/dump-format.md):
  x  [K, n_in]   the layer's input with all leading dimensions flattened into K (tokens), in the
                 dtype the GEMM used: under autocast the input is cast to the autocast dtype first,
                 exactly as autocast does (a round-to-nearest-even cast), so it is what the matmul saw.
  dy [K, n_out]  the gradient with respect to the layer's output, from a hook on the output tensor
                 (registered by the forward hook of that call, so each dy is paired with the x of
                 the same call even when a module is called several times per step).
  w  [n_out, n_in] the weight as stored (for mixed precision: the fp32 master copy), read in
                 after_backward, i.e. the weight the step's forward and backward used.
  dw [n_out, n_in] weight.grad as the framework computed it, read in after_backward (fp32).

Gradient accumulation: every forward/backward call of a captured layer during a captured step is
recorded, and x and dy are the concatenations along K over the calls (micro-batches) in forward
order. Then weight.grad == sum_m dy_m^T x_m == dy^T x, so dw stays consistent with the captured
operands. Call after_backward once per optimizer step, after the last micro-batch.

Hardware-quantized operands: a module may expose the operands its own quantized GEMMs used by
appending, during a captured step, dicts {name: (codes uint8, scales uint8, recipe metadata dict)}
to the list `module.mxscope_quantized_operands` (the Capture creates the list and sets
`module.mxscope_capture_quantized = True` while a step is captured). They are stored as
"<name>.codes" / "<name>.scales" with the recipe in __metadata__ when exactly one call (micro-batch)
produced them; with several calls they are left out and the entry's metadata says why.

The manifest is rewritten atomically (temporary file + fsync + rename) after every entry, so a run
killed at any point leaves a dump whose manifest lists only complete entry files.

Only modules that run through their own forward (module(x), which fires the hooks) can be captured.
A matched module that is called some other way (nn.MultiheadAttention computes out_proj with
F.multi_head_attention_forward from its weight) is
left out with a warning when the Capture is made, where that is known; any other matched module that
runs no forward in a captured step is named by after_backward, which still writes the step's other
layers first.
"""

from __future__ import annotations

import json
import os
import platform
import re
import warnings
from typing import Dict, Iterable, List, Optional

import torch
from torch import nn

from . import safetensors_lite

try:  # the reference implementation when it is installed; the built-in writer otherwise
    from safetensors.torch import save_file as _package_save_file
except ImportError:  # Debian 12 has no python3-safetensors
    _package_save_file = None

DUMP_FORMAT = "mxscope-dump"
DUMP_VERSION = 1
SOURCE_FIELDS = ("hardware", "framework", "recipe", "model", "notes")


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype active for `device_type` ("cuda" or "cpu"), or None when autocast is off.
    Works on torch 1.13 (per-device functions) and 2.x (torch.get_autocast_dtype)."""
    if hasattr(torch, "get_autocast_dtype"):
        try:
            if torch.is_autocast_enabled(device_type):
                return torch.get_autocast_dtype(device_type)
            return None
        except TypeError:
            pass
    if device_type == "cuda":
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
    if device_type == "cpu":
        return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
    return None


def default_hardware() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return f"CPU ({platform.machine()}, {platform.processor() or 'unknown processor'})"


def default_framework() -> str:
    cuda = f", CUDA {torch.version.cuda}" if torch.version.cuda else ""
    return f"PyTorch {torch.__version__}{cuda}, Python {platform.python_version()}"


def _save_tensors(tensors: Dict[str, torch.Tensor], path: str, metadata: Dict[str, str]) -> None:
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()}
    if _package_save_file is None:
        safetensors_lite.save_file(tensors, path, metadata)
        return
    temporary = f"{path}.tmp.{os.getpid()}"
    _package_save_file(tensors, temporary, metadata=metadata)
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _called_functionally(model: nn.Module, name: str, module: nn.Module) -> bool:
    """Whether `module` is an nn.MultiheadAttention's out_proj, which runs without its forward."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    return child == "out_proj" and isinstance(parent, nn.MultiheadAttention)


class Capture:
    """Forward hooks (input x) and output-gradient hooks (dy) on the nn.Linear modules whose full
    names match `layers` (re.fullmatch), recording at the chosen steps.

    steps: an iterable of step numbers (list, range, set), or None with every=N (steps divisible by
    N), or both None for every step. source: the manifest's source fields (hardware, framework,
    recipe, model, notes; hardware and framework default to this machine) plus any provenance keys.
    """

    def __init__(self, model: nn.Module, out_dir: str, layers: str = r".*", steps: Optional[Iterable[int]] = None,
                 every: Optional[int] = None, source: Optional[dict] = None, store_weight: bool = True,
                 store_weight_gradient: bool = True):
        self.out_dir = out_dir
        self.pattern = re.compile(layers)
        self.steps = None if steps is None else set(int(s) for s in steps)
        self.every = every
        if every is not None and every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.store_weight = store_weight
        self.store_weight_gradient = store_weight_gradient
        self.modules: Dict[str, nn.Linear] = {}
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and self.pattern.fullmatch(name):
                self.modules[name] = module
        functional = sorted(name for name, module in self.modules.items() if _called_functionally(model, name, module))
        if functional:
            warnings.warn(f"mxscope.capture: not capturing {functional}: nn.MultiheadAttention computes out_proj "
                          f"functionally from its weight, so hooks on it never run", stacklevel=2)
            for name in functional:
                del self.modules[name]
        if not self.modules:
            linear_names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
            raise ValueError(f"no nn.Linear module name matches {layers!r}; the model's linear layers are: "
                             f"{linear_names}")
        self.source = {"hardware": default_hardware(), "framework": default_framework(), "recipe": "unspecified",
                       "model": type(model).__name__, "notes": ""}
        self.source.update(source or {})
        for field in SOURCE_FIELDS:
            if not isinstance(self.source[field], str):
                raise ValueError(f"source field {field!r} must be a string, got {self.source[field]!r}")

        os.makedirs(out_dir, exist_ok=True)
        if os.path.exists(os.path.join(out_dir, "manifest.json")):
            raise FileExistsError(f"{out_dir} already holds a dump (manifest.json); choose an empty directory")
        self.entries: List[dict] = []
        self.active_step: Optional[int] = None
        self.records: Dict[str, dict] = {}
        self.handles = [module.register_forward_hook(self._make_forward_hook(name))
                        for name, module in self.modules.items()]
        self._write_manifest()

    # -- step selection ----------------------------------------------------------------------------

    def wants(self, step: int) -> bool:
        if self.steps is not None and step not in self.steps:
            return False
        if self.every is not None and step % self.every != 0:
            return False
        return True

    def begin_step(self, step: int) -> None:
        """Arms the hooks when `step` is captured; call it before the step's first forward."""
        if step < 0:
            raise ValueError(f"steps are non-negative integers, got {step}")
        self.active_step = step if self.wants(step) else None
        self.records = {name: {"x": [], "dy": []} for name in self.modules}
        for module in self.modules.values():
            module.mxscope_capture_quantized = self.active_step is not None
            module.mxscope_quantized_operands = []

    # -- hooks -------------------------------------------------------------------------------------

    def _make_forward_hook(self, name: str):
        def forward_hook(module, inputs, output):
            if self.active_step is None or not torch.is_grad_enabled():
                return
            if not isinstance(output, torch.Tensor) or not output.requires_grad:
                return
            x = inputs[0].detach()
            cast = autocast_dtype(x.device.type)
            if cast is not None and x.is_floating_point() and x.dtype != cast:
                x = x.to(cast)  # what autocast feeds the matmul
            record = self.records[name]
            index = len(record["x"])
            record["x"].append(x.reshape(-1, x.shape[-1]).to("cpu", copy=True))
            record["dy"].append(None)

            def output_gradient_hook(gradient):
                record["dy"][index] = gradient.detach().reshape(-1, gradient.shape[-1]).to("cpu", copy=True)

            output.register_hook(output_gradient_hook)

        return forward_hook

    # -- writing -----------------------------------------------------------------------------------

    def after_backward(self, step: int) -> None:
        """Writes one entry per captured layer for `step` (call after the last backward of the
        step and before anything changes weight.grad: clipping, the optimizer, zero_grad)."""
        if self.active_step is None:
            return
        if step != self.active_step:
            raise ValueError(f"after_backward({step}) but begin_step armed step {self.active_step}")
        silent, unfinished = [], []
        for name, module in self.modules.items():
            record = self.records[name]
            if not record["x"]:
                silent.append(name)
                continue
            missing = [i for i, dy in enumerate(record["dy"]) if dy is None]
            if missing:
                unfinished.append(f"{name} (calls {missing})")
                continue
            self._write_entry(step, name, module, record)
        self.active_step = None
        self.records = {}
        for module in self.modules.values():
            module.mxscope_capture_quantized = False
            module.mxscope_quantized_operands = []
        if silent:
            raise RuntimeError(f"step {step}: the other layers were written, but {silent} ran no forward with "
                               f"gradients as modules (a parent that calls them functionally, or that does not call "
                               f"them at all); exclude them from the layers pattern")
        if unfinished:
            raise RuntimeError(f"step {step}: the other layers were written, but backward did not reach "
                               f"{unfinished}; call after_backward after every micro-batch's backward")

    def _write_entry(self, step: int, name: str, module: nn.Linear, record: dict) -> None:
        if any(entry["step"] == step and entry["layer"] == name for entry in self.entries):
            raise ValueError(f"step {step}, layer {name} was already captured")
        tensors = {"x": torch.cat(record["x"], dim=0), "dy": torch.cat(record["dy"], dim=0)}
        metadata = {"layer": name, "step": str(step), "calls": str(len(record["x"]))}
        if self.store_weight:
            tensors["w"] = module.weight.detach()
        if self.store_weight_gradient:
            if module.weight.grad is None:
                raise RuntimeError(f"layer {name}: weight.grad is None at step {step}")
            gradient = module.weight.grad.detach()
            if gradient.dtype != torch.float32:
                metadata["dw_source_dtype"] = str(gradient.dtype).replace("torch.", "")
            tensors["dw"] = gradient.float()

        quantized_calls = getattr(module, "mxscope_quantized_operands", [])
        if len(quantized_calls) == 1:
            for operand, (codes, scales, recipe) in quantized_calls[0].items():
                tensors[f"{operand}.codes"] = codes
                tensors[f"{operand}.scales"] = scales
                metadata.update(recipe)
        elif len(quantized_calls) > 1:
            metadata["quantized_operands"] = (f"omitted: {len(quantized_calls)} calls (micro-batches) were each "
                                              f"quantized on their own")

        relative = os.path.join(name, f"step_{step:08d}.safetensors")
        path = os.path.join(self.out_dir, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _save_tensors(tensors, path, metadata)
        self.entries.append({"step": step, "layer": name, "file": relative.replace(os.sep, "/")})
        self._write_manifest()

    def _write_manifest(self) -> None:
        manifest = {"format": DUMP_FORMAT, "version": DUMP_VERSION, "source": self.source, "entries": self.entries}
        text = json.dumps(manifest, indent=1, sort_keys=False) + "\n"
        safetensors_lite.write_atomically(os.path.join(self.out_dir, "manifest.json"), text.encode("utf-8"))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for module in self.modules.values():
            module.mxscope_capture_quantized = False
            module.mxscope_quantized_operands = []
        self._write_manifest()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False
