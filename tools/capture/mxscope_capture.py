"""Compatibility shim: the capture hook is mxscope.capture (python/mxscope/capture.py); this keeps
`from mxscope_capture import Capture` working for existing training scripts."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from mxscope.capture import *  # noqa: E402,F401,F403
from mxscope.capture import Capture, autocast_dtype, default_framework, default_hardware  # noqa: E402,F401
