"""Compatibility shim: the safetensors writer/reader now lives in the mxscope package
(python/mxscope/safetensors_lite.py); this keeps `import safetensors_lite` working for scripts in
tools/capture."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from mxscope.safetensors_lite import *  # noqa: E402,F401,F403
from mxscope.safetensors_lite import DTYPE_NAMES, load_file, save_file, write_atomically  # noqa: E402,F401
