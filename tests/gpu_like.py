"""A CPU that rounds like a GPU (issue 56): a forward's numbers depend on its shape, by a GPU's amounts.

MLX's CPU backend gives a row in a batch the bits of the same row alone, so a
promise proven there ("a batched row is its request alone") can be false on a
GPU, where the kernel a matmul or an attention runs is chosen by its shape
(GEMV for one row, GEMM tiles of several sizes, attention split by key length)
and each rounds its own way. Here every matmul (``nn.Linear``, quantized
linears, a tied embedding read as the LM head) and every attention computes
in float32 and rounds its output by a rule picked by its shape:

- a matmul (tensor parallelism's sharded linears too) by the rows it computes, ``M`` (batch x positions), in classes
  1, 2-3, 4-7, 8-15, ...;
- an attention by its queries (batch x positions) and its key length (a new
  class each 64 keys, as a split-K kernel's split count grows);
- a batched ``mx.matmul`` by each matrix's rows and columns and by the number of matrices;

each class rounding to bfloat16 to nearest, truncating to bfloat16, or (float32
models only) keeping float32. The amounts are a GPU's (a bfloat16 ulp per op,
the few percent of the largest logit the issue measured on an H200 once they
add up); only rounding changes, so a wrong mask, position or cache row still
gives a wrong answer.

In a test process, :func:`installed` (the ``gpu_like`` fixture in
``tests/conftest.py``) turns it on and off. Processes a test starts (servers,
ranks, the CLI as a subprocess) get it from :func:`environment`:
``SPECDEC_TEST_BACKEND=gpu-like`` and ``tests/gpu_like_site`` on ``PYTHONPATH``,
whose ``sitecustomize`` installs it at start-up. Nothing of it is in the package.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
import mlx.nn.layers.distributed as _sharded

ENV = "SPECDEC_TEST_BACKEND"
NAME = "gpu-like"
SITE = Path(__file__).resolve().parent / "gpu_like_site"

_ORIGINAL: dict = {}


def active() -> bool:
    """Whether this process's forwards round like a GPU now."""
    return bool(_ORIGINAL)


def environment(env: dict | None = None) -> dict:
    """``env`` (default: this process's) with the backend turned on for a child process."""
    out = dict(os.environ if env is None else env)
    out[ENV] = NAME
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), out.get("PYTHONPATH", "")) if p)
    return out


# --- rounding --------------------------------------------------------------------------------------


def _cleared(y: mx.array, mask: int) -> mx.array:
    """float32 ``y`` with the bits outside ``mask`` cleared (toward zero). Gradients pass through as if nothing
    were rounded (MLX has no gradient for a view), and the value is exact: ``y`` and its truncation are within
    a factor of two, so their difference and the sum back are too (Sterbenz)."""
    t = mx.stop_gradient((y.view(mx.uint32) & mx.array(mask, dtype=mx.uint32)).view(mx.float32))
    return mx.where(mx.isfinite(y), y + mx.stop_gradient(t - y), t)


def _truncate_to_bf16(y: mx.array) -> mx.array:
    """float32 ``y`` with its low 16 bits cleared: bfloat16's grid, rounded toward zero."""
    return _cleared(y, 0xFFFF0000)


def _round(y: mx.array, out: mx.Dtype, cls: int) -> mx.array:
    """float32 ``y`` in ``out``, rounded by the rule of shape class ``cls``."""
    if out == mx.float32:
        rule = cls % 3
        if rule == 0:
            return y.astype(mx.bfloat16).astype(mx.float32)
        if rule == 1:
            return _truncate_to_bf16(y)
        return y
    if cls % 2 and out == mx.bfloat16:
        return _truncate_to_bf16(y).astype(out)  # exactly representable: no second rounding
    if cls % 2 and out == mx.float16:
        # float16 keeps 10 of float32's 23 fraction bits: clear the other 13 (toward zero).
        return _cleared(y, 0xFFFFE000).astype(out)
    return y.astype(out)


# Where set (small_shapes_shared): matmuls of fewer rows than "rows", and one row's attention over at most
# "queries" queries, share one kernel (class 1: toward zero), as a GPU's vector kernels serve a few rows alike.
_SHARED = {"rows": 0, "queries": 0}


def _rows_class(m: int) -> int:
    m = max(int(m), 1)
    return 1 if m < _SHARED["rows"] else m.bit_length() - 1


@contextmanager
def small_shapes_shared(rows: int = 6, queries: int = 8) -> Iterator[None]:
    """Inside: a matmul of fewer than ``rows`` rows, and one row's attention over at most ``queries`` queries,
    round alike whatever their count (MLX's quantized matmul serves fewer than 6 rows with one vector kernel on
    Apple's GPUs; on an H200 a 4-bit model's 1, 2 and 4 rows compiled as one family, 8 and 16 as another).
    There one token at a time and a few at once give the same bits, while a batch of rows does not."""
    before = dict(_SHARED)
    _SHARED.update(rows=rows, queries=queries)
    try:
        yield
    finally:
        _SHARED.update(before)


def _out_dtype(*dtypes) -> mx.Dtype:
    floats = [d for d in dtypes if d in (mx.float32, mx.bfloat16, mx.float16)]
    return mx.float32 if mx.float32 in floats or not floats else floats[0]


def _matmul(x: mx.array, w: mx.array, bias=None) -> mx.array:
    out = _out_dtype(x.dtype, w.dtype)
    y = x.astype(mx.float32) @ w.astype(mx.float32).T
    if bias is not None:
        y = y + bias.astype(mx.float32)
    return _round(y, out, _rows_class(math.prod(x.shape[:-1])))


def _linear(self, x):
    return _matmul(x, self["weight"], self["bias"] if "bias" in self else None)


def _quantized(original: str):
    """A quantized layer's call, computed on float32 input and rounded by its row count."""
    def call(self, x):
        out = _out_dtype(x.dtype, self["scales"].dtype)
        y = _ORIGINAL[original](self, x.astype(mx.float32)).astype(mx.float32)
        return _round(y, out, _rows_class(math.prod(x.shape[:-1])))
    return call


def _to_sharded(self, x):  # mlx.nn.layers.distributed.AllToShardedLinear (tensor parallelism's first half)
    return _matmul(x, self["weight"], self["bias"] if "bias" in self else None)


def _from_sharded(self, x):  # ShardedToAllLinear: this rank's share, summed over the ranks, then the bias
    y = mx.distributed.all_sum(_matmul(x, self["weight"]), group=self.group)
    return y + self["bias"] if "bias" in self else y


def _as_linear(self, x):
    return _matmul(x, self.weight)


def _batched_matmul(a, b, *args, **kwargs):
    """``mx.matmul`` (batched matmuls, ``--exact``'s attention): by each matrix's rows and columns, and by how
    many matrices the call holds (an H200 rounded a row's exact attention apart in a batch of 2 and 4 rows:
    a GEMM's split over its inner dimension is chosen to fill the GPU, so by the batch's size too)."""
    out = _out_dtype(a.dtype, b.dtype)
    y = _ORIGINAL["matmul"](a.astype(mx.float32), b.astype(mx.float32), *args, **kwargs)
    return _round(y, out, _rows_class(a.shape[-2]) + b.shape[-1] // 64 + math.prod(y.shape[:-2]).bit_length())


def _attention(q, k, v, *args, **kwargs):
    out = q.dtype
    mask = kwargs.get("mask")
    if isinstance(mask, mx.array) and mask.dtype not in (mx.bool_,):
        kwargs["mask"] = mask.astype(mx.float32)
    sinks = kwargs.get("sinks")
    if isinstance(sinks, mx.array):
        kwargs["sinks"] = sinks.astype(mx.float32)
    y = _ORIGINAL["sdpa"](q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), *args, **kwargs)
    queries = q.shape[0] * q.shape[-2]
    cls = 1 if q.shape[0] == 1 and q.shape[-2] <= _SHARED["queries"] else _rows_class(queries)
    return _round(y, out, cls + k.shape[-2] // 64)


# --- switching it on and off -------------------------------------------------------------------------


def install() -> None:
    """Round like a GPU in this process from now on (idempotent)."""
    if _ORIGINAL:
        return
    _ORIGINAL.update(Linear=nn.Linear.__call__, QuantizedLinear=nn.QuantizedLinear.__call__,
                     as_linear=nn.Embedding.as_linear, QuantizedEmbedding=nn.QuantizedEmbedding.as_linear,
                     sdpa=mx.fast.scaled_dot_product_attention, to_sharded=_sharded.AllToShardedLinear.__call__,
                     from_sharded=_sharded.ShardedToAllLinear.__call__, matmul=mx.matmul)
    _sharded.AllToShardedLinear.__call__ = _to_sharded
    _sharded.ShardedToAllLinear.__call__ = _from_sharded
    mx.matmul = _batched_matmul
    nn.Linear.__call__ = _linear
    nn.QuantizedLinear.__call__ = _quantized("QuantizedLinear")
    nn.Embedding.as_linear = _as_linear
    nn.QuantizedEmbedding.as_linear = _quantized("QuantizedEmbedding")
    mx.fast.scaled_dot_product_attention = _attention


def uninstall() -> None:
    """Back to MLX's own CPU arithmetic."""
    if not _ORIGINAL:
        return
    nn.Linear.__call__ = _ORIGINAL["Linear"]
    nn.QuantizedLinear.__call__ = _ORIGINAL["QuantizedLinear"]
    nn.Embedding.as_linear = _ORIGINAL["as_linear"]
    nn.QuantizedEmbedding.as_linear = _ORIGINAL["QuantizedEmbedding"]
    mx.fast.scaled_dot_product_attention = _ORIGINAL["sdpa"]
    _sharded.AllToShardedLinear.__call__ = _ORIGINAL["to_sharded"]
    _sharded.ShardedToAllLinear.__call__ = _ORIGINAL["from_sharded"]
    mx.matmul = _ORIGINAL["matmul"]
    _ORIGINAL.clear()


@contextmanager
def installed() -> Iterator[None]:
    """The backend on for the ``with`` block (off again after, unless it was on before)."""
    was = active()
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()
