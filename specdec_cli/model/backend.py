"""Which MLX backend is installed, checked without importing MLX.

On Linux, MLX's backend is a separate distribution (``mlx-cpu``,
``mlx-cuda-13`` or ``mlx-cuda-12``). ``pip install .`` brings the CPU one; the
``cuda`` / ``cuda12`` extras add a GPU one. Each installs the same file,
``mlx/lib/libmlx.so``: with two installed, the one installed last is the
backend, which :func:`active_backend` reads from the file itself (its size
and hash against each distribution's install record).
"""

from __future__ import annotations

import hashlib
import os
import sys
from base64 import urlsafe_b64encode
from importlib import metadata
from typing import Optional

BACKENDS = {"mlx-cpu": "cpu", "mlx-cuda-13": "cuda", "mlx-cuda-12": "cuda12"}
INSTALL = ("pip install . (or 'specdec-cli') for the CPU; add the extra [cuda] for an NVIDIA GPU "
           "(CUDA 13) or [cuda12] (CUDA 12)")
_LIBRARY = "mlx/lib/libmlx.so"


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


def _record(name: str):
    for f in metadata.distribution(name).files or ():
        if f.as_posix() == _LIBRARY:
            return f
    return None


def active_backend(found: list[str]) -> Optional[str]:
    """Which of the installed backends owns the ``libmlx.so`` in place (None: unknown)."""
    records = {name: _record(name) for name in found}
    records = {n: r for n, r in records.items() if r is not None}
    if not records:
        return None
    path = next(iter(records.values())).locate()
    try:
        size = path.stat().st_size
    except OSError:
        return None
    same_size = [n for n, r in records.items() if r.size == size]
    if len(same_size) == 1:
        return same_size[0]
    digest = None
    for name in same_size:
        hash_ = records[name].hash
        if hash_ is None or hash_.mode != "sha256":
            continue
        if digest is None:
            digest = urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()
        if hash_.value == digest:
            return name
    return None


def backend_problem() -> tuple[Optional[str], bool]:
    """A one-line problem with the installed MLX backend, and whether it is fatal."""
    if sys.platform != "linux":
        return None, False
    found = installed_backends()
    if not found:
        return f"MLX has no backend installed: {INSTALL}", True
    gpus = [n for n in found if n != "mlx-cpu"]
    if len(gpus) > 1:
        return (f"{' and '.join(gpus)} are both installed and overwrite each other's {_LIBRARY}: "
                f"keep one (pip uninstall -y {' '.join(gpus)}, then pip install '.[cuda]' or '.[cuda12]')"), False
    if gpus and active_backend(found) == "mlx-cpu":
        # The CPU build was installed after the GPU one: its library is the one in place.
        return (f"{gpus[0]} is installed but the CPU build's {_LIBRARY} is in place (the last installed "
                f"wins), so MLX runs on the CPU: pip install --force-reinstall --no-deps {gpus[0]}"), False
    return None, False


# MLX's switch for cuDNN's attention on CUDA (read once, at the first attention call).
CUDNN_SDPA = "MLX_CUDA_USE_CUDNN_SDPA"


def decode_attention_default(environ=None, backend: Optional[str] = None) -> bool:
    """On MLX's CUDA backend, turn cuDNN's attention off unless the user set ``MLX_CUDA_USE_CUDNN_SDPA``.

    cuDNN's attention builds (and caches) a graph per query and key length; a
    verify forward meets a new key length every block, so every block paid a
    build. Measured on an H100 (MLX 0.32.4, bf16, the bundled model, long copy,
    bucketed shapes): 2.54x plain decoding with it off, 0.41x and 1.51x with it
    on; plain decoding itself ran 224 tok/s off against 102-176 on. Prefill
    then uses MLX's own attention too (not measured on long prompts); setting
    the variable to 1 keeps cuDNN. Returns whether it was set here.
    """
    environ = os.environ if environ is None else environ
    if CUDNN_SDPA in environ:
        return False
    if backend is None:
        if sys.platform != "linux":
            return False
        backend = BACKENDS.get(active_backend(installed_backends()) or "", "cpu")
    if not backend.startswith("cuda"):
        return False
    environ[CUDNN_SDPA] = "0"
    return True
