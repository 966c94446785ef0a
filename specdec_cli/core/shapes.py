"""Few shapes for backends that compile per shape: verify widths from powers of two.

A GPU backend builds kernels (and cuDNN attention graphs) per shape the first
time each runs in a process: measured on an H100 with MLX 0.32.4's CUDA
backend, the first 4-bit matmul of 8 rows took 46 s (a JIT compile), the next
row counts of the same kernel 0.1 ms. Speculative decoding meets a new verify
width nearly every block; ``bucketed`` rounds each width up to a power of two
(the positions added are ignored and dropped in O(1), as a rejected draft's
are) so a generation runs, and its warm-up compiles, at most log2(block size)+1
widths. ``exact`` feeds what was drafted. Output is the same either way.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

import mlx.core as mx

SHAPES = ("auto", "exact", "bucketed")


def compiles_per_shape() -> bool:
    """Whether MLX's default device compiles kernels per shape (GPUs), unlike its CPU backend.

    Measured on the CPU (SmolLM2-135M, float32, OpenBLAS; a Qwen3.5-style
    hybrid): a row count's first forward in a process is as fast as its
    second (48 / 48 ms at 2 rows, 74 / 73 ms at 4), so a warm-up there would
    only add forwards.
    """
    return mx.default_device() != mx.cpu


def bucket(width: int) -> int:
    """The smallest power of two >= ``width`` (>= 1)."""
    return 1 << max(0, int(width) - 1).bit_length()


def widths(max_width: int, shapes: str) -> list[int]:
    """Every forward width a verify of up to ``max_width`` rows runs under ``shapes``."""
    if shapes == "bucketed":
        top = bucket(max_width)
        return [1 << i for i in range(top.bit_length()) if 1 << i <= top]
    return list(range(1, max_width + 1))


def fed(width: int, shapes: str) -> int:
    """Rows a forward of ``width`` real rows runs with (padding rows are ignored and dropped)."""
    return bucket(width) if shapes == "bucketed" else width


# The row tiles of MLX 0.32.4's CUDA quantized matmul (its kernel cache names them ``qmm_..._m16_...``).
QUANTIZED_TILES = (16, 32, 64)


def ptx_cache_dir() -> Path:
    """Where MLX's CUDA backend keeps the kernels it compiled (``MLX_PTX_CACHE_DIR``, else under the temp dir)."""
    given = os.environ.get("MLX_PTX_CACHE_DIR")
    return Path(given) if given else Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"


def first_compile_note(weights: str, *, cuda: Optional[bool] = None, cache: Optional[Path] = None) -> Optional[str]:
    """A line for a model on CUDA whose kernels are not all compiled yet on this machine (None otherwise).

    Measured on H100s and an H200 (MLX 0.32.4): a fresh machine's first bfloat16 run waited over
    30 s before its first token, in the first forwards (the next process, none). Quantized
    matmuls compile per tile of rows: on the H200 1-4 rows took 15-17 s, 8-16 rows 132 s, 32 and
    64 rows 81-105 s more, and a 4-bit run stalled on a cache that held the smaller tiles only
    (its prompt's prefill needed the 64-row one). Later processes read the kernels back from
    :func:`ptx_cache_dir`; a quantized model is noted until the cache holds all three tiles
    (the file names are MLX's own, so a rename only makes the note speak more often).
    """
    if cuda is None:
        cuda = compiles_per_shape() and hasattr(mx, "cuda") and mx.cuda.is_available()
    if not cuda:
        return None
    cache = ptx_cache_dir() if cache is None else cache
    names = [p.name for p in cache.iterdir()] if cache.is_dir() else []
    if "quantized" not in weights:
        if names:
            return None
        return (f"note: MLX's CUDA backend compiles its kernels the first time they run on this machine "
                f"(over 30 s before the first token on an H100), then keeps them in {cache}")
    if all(any(n.startswith("qmm") and f"_m{rows}_" in n for n in names) for rows in QUANTIZED_TILES):
        return None
    return (f"note: MLX's CUDA backend compiles its quantized kernels the first time they run on this machine "
            f"(on an H200: 132 s for 8-16 rows, 81-105 s for 32-64; minutes in all), then keeps them in {cache}; "
            "--dtype bfloat16 starts without them")
