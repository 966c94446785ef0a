"""Which recurrent rollback strategy a run uses, and why.

``auto`` measures, on the prefilled target itself, a verify forward of the
block size plus the rollback of a half-accepted block for ``capture`` and
``tape`` (interleaved, median of three, the cache restored afterwards), and
takes the cheaper one. Capture holds one recurrent state per verified token
and layer until the rollback; over ``memory_cap`` it is not chosen. A model
whose recurrent layers have no capture/tape hook falls back to ``carry``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import mlx.core as mx

from .caches import ModelCache

STRATEGIES = ("auto", "reforward", "carry", "capture", "tape")
_REPEATS = 3


@dataclass(frozen=True)
class RollbackChoice:
    """The strategy a run uses.

    Attributes:
        requested: What was asked for (``auto`` or a strategy).
        strategy: What runs: ``trim`` (no recurrent layers), ``reforward``,
            ``carry``, ``capture`` or ``tape``.
        reason: Why, in one sentence.
        capture_bytes: Extra bytes capture holds during one full-size verify.
        tape_bytes: Extra bytes tape holds during one full-size verify.
        measured_ms: ``auto``'s measured verify + rollback milliseconds per strategy.
        seconds: Time spent choosing (not counted as prefill or decode).
    """

    requested: str
    strategy: str
    reason: str
    capture_bytes: int = 0
    tape_bytes: int = 0
    measured_ms: Optional[dict] = None
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def measure(cache: ModelCache, block_size: int, repeats: int = _REPEATS) -> dict[str, float]:
    """Milliseconds of a ``block_size`` verify plus a half-accept rollback, per recorded strategy.

    The cache is left exactly as it was.
    """
    x = mx.zeros((block_size,), dtype=mx.uint32)
    keep = block_size // 2
    times: dict[str, list[float]] = {"capture": [], "tape": []}
    for i in range(repeats + 1):  # the first round warms up (compiles)
        for strategy in times:
            snap = cache.snapshot()
            try:
                t0 = time.perf_counter()
                logits = cache.feed(x, record=strategy)
                cache.rollback_recorded(snap, keep)
                mx.eval(logits, cache.state_arrays())
                if i:
                    times[strategy].append(1000 * (time.perf_counter() - t0))
            finally:
                cache.restore(snap)
    return {k: statistics.median(v) for k, v in times.items()}


def choose(requested: str, cache: ModelCache, block_size: int, memory_cap: Optional[int] = None,
           agree: Optional[Callable[[int], int]] = None) -> RollbackChoice:
    """Resolve ``requested`` for this target (prefilled) and block size.

    Args:
        requested: ``auto`` or one of the strategies.
        cache: The target's prefilled caches (``auto`` measures on them and restores them).
        block_size: Tokens of a full verify forward (drafts + 1).
        memory_cap: Most extra bytes capture may hold during a verify (None: no cap).
        agree: Maps this process's pick (an index into ``STRATEGIES``) to the
            one every rank of a sharded model runs (rank 0's measurement).
    """
    if requested not in STRATEGIES:
        raise ValueError(f"rollback must be one of {STRATEGIES}")
    start = time.perf_counter()
    if not cache.recurrent:
        return RollbackChoice(requested, "trim", "no recurrent layers: every layer trims in O(1)")
    sizes = cache.recording_bytes(block_size)
    kw = dict(capture_bytes=sizes["capture"], tape_bytes=sizes["tape"])
    if requested in ("carry", "reforward"):
        return RollbackChoice(requested, requested, "as asked", **kw)
    if not cache.can_record:
        return RollbackChoice(requested, "carry", f"capture/tape cannot run: {cache.record_problem}; carry instead",
                              **kw)
    over = memory_cap is not None and sizes["capture"] > memory_cap
    cap_note = (f"capture would hold {_mb(sizes['capture'])} per verify, over the {_mb(memory_cap)} cap"
                if over else "")
    if requested == "tape" or (requested == "capture" and not over):
        return RollbackChoice(requested, requested, "as asked", **kw)
    if requested == "capture":
        return RollbackChoice(requested, "tape", f"{cap_note}: tape instead", **kw)
    if over:
        return RollbackChoice(requested, "tape", f"{cap_note}: tape", **kw)
    ms = measure(cache, block_size)
    best = min(ms, key=ms.get)
    if agree is not None:
        best = STRATEGIES[agree(STRATEGIES.index(best))]
    reason = (f"measured at start, a {block_size}-token verify + rollback of {block_size // 2}: "
              f"capture {ms['capture']:.2f} ms, tape {ms['tape']:.2f} ms")
    return RollbackChoice(requested, best, reason, measured_ms=ms, seconds=time.perf_counter() - start, **kw)
