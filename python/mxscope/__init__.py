"""mxscope for PyTorch: quantize tensors, emulate GEMMs and train with microscaling recipes,
computing the same bits as the `mxscope` CLI and replay engine (docs/python.md).

    import mxscope, torch
    q = mxscope.quantize(torch.randn(64, 64), "mxfp4")     # q.codes, q.scales, q.dequantized
    import mxscope.torch as mt
    mt.convert(model, mt.LADDER["mxfp4-fdw-h16"])          # nn.Linear -> MXLinear
    with mxscope.capture.Capture(model, "dump", layers=r".*\\.o_proj", steps=[10, 11]) as capture: ...

The numerical work runs in libmxscope_c (the project's C++/CUDA library, loaded with ctypes on
first use); torch tensors go in and out by pointer, on CPU or on the tensor's CUDA stream.
"""

from ._api import GemmResult, QuantizedTensor, cuda_device_count, gemm, quantize, reference, version

__all__ = ["quantize", "gemm", "reference", "QuantizedTensor", "GemmResult", "version", "cuda_device_count",
           "torch", "capture"]


def __getattr__(name):
    # mxscope.torch and mxscope.capture load on first use, so `import mxscope` stays light.
    if name in ("torch", "capture", "ablate"):
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'mxscope' has no attribute {name!r}")
