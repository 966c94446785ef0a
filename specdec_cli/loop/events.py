"""What a generation reports as it runs: the events every face reads.

A request's generation yields :class:`Prefilled` once, :class:`Warmed` once
(when it warms shapes up), one :class:`Step` per engine block, then
:class:`Finished` when it ends. A step carries the seconds spent inside the
engine for its block, so the time a consumer spends displaying is never
counted as decode time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..cache.caches import Checkpoint, ModelCache
from ..cache.rollback import RollbackChoice
from ..core.blocks import Block
from ..core.stats import Stats
from ..drafters import Drafter
from .plain import Warmup


@dataclass(frozen=True)
class Prefilled:
    """The prompt is in the caches (target and drafter).

    Attributes:
        rollback: The recurrent rollback strategy chosen (speculative runs).
    """

    prompt_tokens: int
    seconds: float
    rollback: Optional[RollbackChoice] = None
    # The target's prefill chunk sizes: pass them back to reproduce its caches bit for bit.
    chunks: tuple[int, ...] = ()
    # Prompt tokens the target's caches already held (a prompt cache hit): not prefilled.
    cached: int = 0
    # The target's checkpoints at the ``marks`` run() was given, in order.
    marks: tuple[Checkpoint, ...] = ()
    # The verify shapes decoding runs with: exact or bucketed (see specdec_cli.core.shapes).
    shapes: str = "exact"
    # Of ``cached``, the tokens read from the prompt cache's disk tier (the rest were in memory).
    disk: int = 0


@dataclass(frozen=True)
class Finished:
    """Generation ended; what the caches hold then.

    Attributes:
        cache_bytes: Bytes held by the layer caches, ``target`` and (model drafters) ``drafter``.
    """

    cache_bytes: dict


@dataclass(frozen=True)
class Warmed:
    """Every shape the run can use has run once (kernels compiled), caches unchanged.

    Attributes:
        seconds: Wall time of the warm-up (not part of prefill or decode time).
        what: The row counts run, target and drafter.
    """

    seconds: float
    what: Warmup


@dataclass(frozen=True)
class Step:
    """One engine block and the seconds the engine spent on it."""

    block: Block
    seconds: float


def cache_bytes(cache: ModelCache, drafter: Optional[Drafter]) -> dict:
    """Bytes held by the layer caches: ``target``, and ``drafter`` for drafters that hold caches."""
    sizes = {"target": cache.nbytes}
    held = getattr(drafter, "cache", None)
    if isinstance(held, ModelCache):
        sizes["drafter"] = held.nbytes
    elif isinstance(held, list) and held and all(hasattr(c, "nbytes") for c in held):
        sizes["drafter"] = sum(c.nbytes for c in held)  # a head's own KV caches (MTP)
    return sizes


def collect(events) -> tuple[Stats, list[int]]:
    """Consume a stream of these events (:func:`~.runner.run`'s, a session's) into its statistics and generated tokens."""
    stats, tokens = Stats(), []
    for event in events:
        if isinstance(event, Step):
            stats.add(event.block, event.seconds)
            tokens += event.block.tokens
        else:
            stats.note(event)
    return stats, tokens


__all__ = ["Finished", "Prefilled", "Step", "Warmed", "cache_bytes", "collect"]
