"""Turns the test suite's GPU-like backend on in a process a test started (see tests/gpu_like.py)."""

import os
import sys
from pathlib import Path

if os.environ.get("SPECDEC_TEST_BACKEND") == "gpu-like":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import gpu_like

    gpu_like.install()
