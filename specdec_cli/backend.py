"""Which MLX backend is installed, checked without importing MLX.

On Linux, MLX's backend is a separate distribution (``mlx-cpu``,
``mlx-cuda-13`` or ``mlx-cuda-12``, chosen with an extra). Each installs the
same file, ``mlx/lib/libmlx.so``: with two installed, whichever was installed
last is the backend, and uninstalling either deletes the library under the
other.
"""

from __future__ import annotations

import sys
from importlib import metadata
from typing import Optional

BACKENDS = {"mlx-cpu": "cpu", "mlx-cuda-13": "cuda", "mlx-cuda-12": "cuda12"}
INSTALL = ("pip install 'specdec-cli[cpu]' for the CPU, 'specdec-cli[cuda]' for an NVIDIA GPU "
           "(CUDA 13), or 'specdec-cli[cuda12]' (CUDA 12)")


def installed_backends() -> list[str]:
    """The MLX backend distributions installed (Linux)."""
    found = []
    for name in BACKENDS:
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        found.append(name)
    return found


def backend_problem() -> tuple[Optional[str], bool]:
    """A one-line problem with the installed MLX backend, and whether it is fatal."""
    if sys.platform != "linux":
        return None, False
    found = installed_backends()
    if not found:
        return f"MLX has no backend installed: {INSTALL}", True
    if len(found) > 1:
        names = " ".join(found)
        return (f"{' and '.join(found)} are all installed and overwrite each other's mlx/lib/libmlx.so "
                f"(the last installed wins); keep one: pip uninstall -y {names}, then {INSTALL}"), False
    return None, False
