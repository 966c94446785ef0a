"""Whether rows may share a batch here: a row's logits in a batch against the same row alone, held to the
backend's own rounding.

On MLX's CPU backend a row in a batch gets the bits of the row alone. A GPU
picks its kernels by shape (GEMV or GEMM tiles, attention split by key length)
and each rounds its own way, so there a batched row differs from itself alone
by rounding: on an H200 in bfloat16, by up to 3.8% of the largest logit. A fixed
tolerance cannot tell that from a wrong mask, position or cache row (1e-2 sat
below bfloat16's own rounding there), so the check first measures the backend's
rounding on the same rows: each row fed one token at a time, and within a forward
of as many rows as the batch's, against all at once: computations that differ in
nothing but their shape. The batched difference
is held to :data:`FACTOR` times that (or times the dtype's own precision, where
the two agree bit for bit).

Measured (issue 56): on an H200 the batched difference was up to 1.5 times the
yardstick (row by row up to 2.7: bfloat16, float32 with and without TF32); on the test suite's GPU-like
CPU 0.6-1.0 times. A planted wrong mask, position or cache row moved the tiny test
models' logits by 7-100% of the largest, 5.2-714 times their yardstick. An H200 in 4-bit
(float16) gave one token at a time and three at once the same bits, a batch of two rows 0.018
of the largest logit apart: hence the yardstick's forward as wide as the batch's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError
from ..model.exact import QUERIES, ROWS
from .batch_cache import BatchCache
from .caches import ModelCache

#: How many times the backend's own rounding a batched row may differ from itself alone.
FACTOR = 4.0
# The dtype's unit roundoff: the floor of the yardstick where shapes change no bit.
_EPS = {"float32": 2.0**-23, "bfloat16": 2.0**-8, "float16": 2.0**-11}

# The probe: two rows of different lengths (so per-row positions and masks matter), verified together.
_PROMPTS = (5, 2)
_FED = (3, 2)
# Rows the probe's batch computes in one forward (a row fed alone that wide rounds as the batch may).
_WIDE = len(_FED) * max(_FED)


def _prompt(n: int) -> list[int]:
    return [(3 * i) % 11 + 1 for i in range(n)]


@dataclass(frozen=True)
class Rounding:
    """How far this backend's arithmetic moves a row's logits when only the shape around it changes.

    Each figure is the largest over the probe's rows and positions of the
    largest difference in a position's logits, over that position's largest
    logit (the logits in float32).

    Attributes:
        dtype: The logits' dtype.
        yardstick: One token at a time, and within one forward as wide as the batch's, against all at once:
            rounding alone.
        batched: A row verified in a batch against the same row alone.
        tolerance: What rounding may move a logit by here, as a share of the position's largest:
            :data:`FACTOR` times the yardstick, or times the dtype's precision where that is larger.
    """

    dtype: str
    yardstick: float
    batched: float
    tolerance: float

    @property
    def ok(self) -> bool:
        """A batched row is within rounding of the row alone."""
        return self.batched <= self.tolerance

    def bound(self, logits: mx.array) -> float:
        """The most rounding may move one of ``logits`` (one position's) by: ``tolerance`` of the largest."""
        return self.tolerance * mx.abs(logits.astype(mx.float32)).max().item()

    def line(self) -> str:
        """The figures in words."""
        return (f"a row in a batch differs from itself alone by {self.batched:.2g} of the largest logit, this "
                f"backend's own rounding ({self.dtype}, one token at a time against all at once) by "
                f"{self.yardstick:.2g}; rounding is held to {self.tolerance:.2g}")


def relative(got: mx.array, want: mx.array) -> float:
    """The largest over positions (rows of ``want``) of max |got - want| / max |want|."""
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    scale = mx.maximum(mx.abs(want).max(axis=-1), 1e-6)
    return (mx.abs(got - want).max(axis=-1) / scale).max().item()


def _probe_rows(model: nn.Module, fresh: Callable[[], ModelCache]) -> tuple[list, mx.array, mx.array]:
    """The probe's rows prefilled alone, the tokens each is fed, and their logits verified together."""
    rows = []
    for n in _PROMPTS:
        cache = fresh()
        cache.prefill(_prompt(n))
        rows.append(cache)
    batch = BatchCache(model, rows[0])
    for cache in rows[1:]:
        batch.add(cache)
    width = max(_FED)
    x = mx.array([[(5 * b + 2 * t) % 13 + 1 if t < fed else 0 for t in range(width)]
                  for b, fed in enumerate(_FED)], dtype=mx.uint32)
    together = batch.feed(x, record="capture" if batch.recurrent and batch.can_record else None)
    return rows, x, together


def measure_rounding(model: nn.Module, fresh: Callable[[], ModelCache]) -> Rounding:
    """Measure :class:`Rounding` on two probe rows (a few forwards of a handful of tokens; caches thrown away).

    Args:
        model: The target.
        fresh: Empty target caches in the engine's layout (``--kv-bits`` applied).

    Raises:
        UnsupportedModelError: Its caches have no batch layout.
        Exception: Whatever the model's own forward raises on per-row positions or masks.
    """
    rows, x, together = _probe_rows(model, fresh)
    yardstick = batched = 0.0
    dtype = str(together.dtype).removeprefix("mlx.core.")
    for b, (cache, fed) in enumerate(zip(rows, _FED)):
        snap = cache.snapshot()
        alone = cache.feed(x[b, :fed])
        cache.restore(snap)
        ones = mx.concatenate([cache.feed(x[b, t : t + 1]) for t in range(fed)])
        # And in one forward of at least as many rows as the batch's: a GPU may serve a few rows with one
        # kernel (one token at a time and three at once then agree bit for bit, as a 4-bit model's did on an
        # H200) and a batch's rows with another.
        # (Tokens after the row's own change none of its logits: attention is causal, recurrences run forward.)
        cache.restore(snap)
        after = mx.array([(7 * t) % 13 + 1 for t in range(_WIDE - fed)], dtype=mx.uint32)
        wide = cache.feed(mx.concatenate([x[b, :fed], after]))[:fed]
        yardstick = max(yardstick, relative(ones, alone), relative(wide, alone))
        batched = max(batched, relative(together[b, :fed], alone))
    tolerance = FACTOR * max(yardstick, _EPS.get(dtype, 2.0**-23))
    return Rounding(dtype, yardstick, batched, tolerance)


def check_batch(model: nn.Module, fresh: Callable[[], ModelCache]) -> tuple[Optional[str], Optional[Rounding]]:
    """Why ``model`` cannot decode several rows together here (None: it can), found before any request, and
    the backend's rounding as measured on the way (None where the forward could not run).

    Its caches must have a batch layout, and its own forward must honour
    per-row positions and masks (a model that reads ``cache.offset`` as an
    int would not): two rows of different lengths are verified together and
    each held against its forward alone, within the backend's own rounding
    (:func:`measure_rounding`).

    Args:
        model: The target.
        fresh: Empty target caches in the engine's layout (``--kv-bits`` applied).
    """
    try:
        rounding = measure_rounding(model, fresh)
    except UnsupportedModelError as e:
        return str(e), None
    except Exception as e:  # the model's own code, meeting per-row positions or masks
        return (f"its forward fails on rows of different lengths ({type(e).__name__}: "
                f"{' '.join(str(e).split())[:120]})"), None
    if not rounding.ok:
        return (f"its forward gives a row in a batch other numbers than the same row alone, past rounding "
                f"({rounding.line()})"), rounding
    return None, rounding


def batch_problem(model: nn.Module, fresh: Callable[[], ModelCache]) -> Optional[str]:
    """:func:`check_batch`'s verdict alone."""
    return check_batch(model, fresh)[0]


def exact_problem(model: nn.Module, fresh: Callable[[], ModelCache]) -> Optional[str]:
    """What differs between shapes in an ``--exact`` model's forward (None: nothing, bit for bit).

    The probe rows of :func:`measure_rounding`: two rows of different lengths verified together against
    each alone, and each row's tokens all at once against one at a time; then one row's ``max(ROWS, QUERIES)``
    tokens at once against one at a time (a row at every place one of ``--exact``'s calls holds). Every logit
    must be equal.
    """
    rows, x, together = _probe_rows(model, fresh)
    for b, (cache, fed) in enumerate(zip(rows, _FED)):
        snap = cache.snapshot()
        alone = cache.feed(x[b, :fed])
        cache.restore(snap)
        ones = mx.concatenate([cache.feed(x[b, t : t + 1]) for t in range(fed)])
        if not mx.array_equal(together[b, :fed], alone).item():
            return "a row in a batch gives other logits than the same row alone"
        if not mx.array_equal(ones, alone).item():
            return "a row's tokens fed all at once give other logits than one at a time"
    # A row at every place one of --exact's calls holds (a CPU BLAS rounded rows 6-15 of a 16-row product with a
    # short inner dimension apart from row 0, which the probe's rows above never reach).
    cache = fresh()
    cache.prefill(_prompt(_PROMPTS[0]))
    start = cache.snapshot()
    wide = mx.array([(7 * t) % 13 + 1 for t in range(max(ROWS, QUERIES))], dtype=mx.uint32)
    at_once = cache.feed(wide)
    cache.restore(start)
    if not mx.array_equal(at_once, mx.concatenate([cache.feed(wide[t : t + 1]) for t in range(wide.size)])).item():
        return (f"a row's {wide.size} tokens fed all at once give other logits than one at a time (this backend "
                "rounds a row by its place in a matrix)")
    return None
