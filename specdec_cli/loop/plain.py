"""Plain decoding with the engine's interface (the exactness oracle and the baseline), and the warm-up.

:func:`plain_generate_step` yields one :class:`~specdec_cli.core.blocks.Block` per
token; :func:`warm_up` runs every shape a coming generation can use once, so
kernel compilation (GPUs) stays out of what is timed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import mlx.core as mx

from ..core.blocks import Block
from ..cache.caches import ModelCache
from ..drafters import Drafter
from . import engine
from .engine import verify_rows
from ..core.processors import logprob_arrays, logprob_entries
from ..core.sampling import GREEDY, SamplingParams, choose, greedy, log_probs
from ..core.numerics import Numerics
from ..core.shapes import compiles_per_shape
from ..model.taps import HiddenTap

if TYPE_CHECKING:
    from ..model.distributed import Ranks


@dataclass(frozen=True)
class Warmup:
    """What :func:`warm_up` ran.

    Attributes:
        target_rows: Row counts the target ran on throwaway tokens.
        drafter_rows: Row counts the drafter ran.
        free: Nothing was run: MLX's CPU backend compiles no kernels per shape.
    """

    target_rows: tuple[int, ...] = ()
    drafter_rows: tuple[int, ...] = ()
    free: bool = False


def warm_up(
    cache: ModelCache,
    drafter: Optional[Drafter] = None,
    *,
    max_draft: int = 0,
    sampling: SamplingParams = GREEDY,
    rollback: str = "carry",
    tap: Optional[HiddenTap] = None,
    force: bool = False,
    numerics: Numerics = Numerics(),
) -> Warmup:
    """Run every shape the coming generation can use once, leaving all state as it was.

    A shape's first run in a process compiles its kernels (on GPUs); doing it
    here keeps that out of tok/s, the adaptive policy's measurements and
    ``--compare-ar``'s ratio. Target and drafter caches are restored exactly;
    no random numbers are drawn. On MLX's CPU backend nothing is run (see
    :func:`compiles_per_shape`) unless ``force``.

    Args:
        cache: The target's prefilled caches.
        drafter: A prefilled drafter (warms its own shapes through ``warm_up``
            when it has one), or None for plain decoding.
        max_draft: Most drafts per block (0 for plain decoding).
        sampling: The token selection that follows each forward.
        rollback: Recurrent rollback strategy (carry lengthens verifies).
        tap: The target's hidden-state tap; cleared after.
        force: Run the shapes on any backend (tests).
        numerics: The run's: ``exact`` shapes warm every width 1 .. k+1, ``bucketed`` its powers of two.
    """
    if not (force or compiles_per_shape()):
        return Warmup(free=True)
    head = greedy if sampling.greedy else (lambda logits: log_probs(logits, sampling))
    try:
        rows = cache.warm(verify_rows(max_draft, cache.recurrent, rollback, numerics), head)
    finally:
        if tap is not None:
            tap.clear()
    drafted: tuple[int, ...] = ()
    hook = getattr(drafter, "warm_up", None)
    if hook is not None and max_draft > 0:
        drafted = tuple(hook(max_draft, sampling) or ())
    return Warmup(rows, drafted)


def plain_generate_step(
    last: int,
    cache: ModelCache,
    *,
    max_tokens: int,
    eos_ids: Sequence[int] = (),
    sampling: SamplingParams = GREEDY,
    sync: Optional[Ranks] = None,
    processors: tuple = (),
    logprobs: Optional[int] = None,
) -> Iterator[Block]:
    """Plain decoding, one token per :class:`Block`: the exactness oracle and the baseline.

    The next step is queued before the current token is yielded (as mlx-lm's
    ``generate_step`` does) so the host overlaps the device; the queued step
    is undone when generation ends early. A processor that reads tokens on the
    host (a grammar) needs each token before the next step: then nothing is
    queued ahead.

    Args:
        last: The last prompt token (not yet fed).
        cache: The target's prefilled caches.
        max_tokens: Stop after this many emitted tokens.
        eos_ids: Token ids that end generation (not emitted).
        sampling: Greedy (default) or sampling options.
        sync: The ranks of a sharded target: each token is rank 0's, agreed
            in a small collective inside the queued step (no extra sync).
        processors: Logits processors, fresh for this run (as the speculative loop takes them).
        logprobs: None, or how many alternatives each token's log-probability comes with.
    """
    eos = frozenset(eos_ids)
    ahead = all(getattr(p, "lazy", False) for p in processors)

    def step(token: mx.array, position: int, pending: bool) -> tuple[mx.array, Optional[mx.array], Optional[tuple]]:
        # pending: ``token`` is not committed to the processors yet (queued ahead): it is their one draft.
        fed_at = cache.length
        logits = cache.feed(token)[-1:]
        if processors:
            rows = mx.concatenate([logits, logits]) if pending else logits
            for proc in processors:
                rows = proc.apply(rows, token if pending else ())
            logits = rows[-1:]
        y = choose(logits, sampling.at(position))
        table = None
        if sync is not None:
            table = sync.propose(y, token, fed_at)
            # The token every rank feeds next is rank 0's, still lazy.
            y = table[0, :1].astype(mx.uint32)
        lp = logprob_arrays(logits, y, logprobs) if logprobs is not None else None
        return y, table, lp

    def queue(out: tuple) -> None:
        y, table, lp = out
        mx.async_eval(y, *([] if table is None else [table]), *[a for a in lp or () if a is not None])

    def read(y: mx.array, table: Optional[mx.array]) -> int:
        return y.item() if table is None else sync.settle(table)[0]

    # The state that matches what has been emitted: every committed token but
    # the last one fed. Restored on exit, which drops a queued step.
    safe = cache.snapshot()
    try:
        cur = step(mx.array([last], dtype=mx.uint32), 0, False)
        queue(cur)
        for i in range(max_tokens):
            y, table, lp = cur
            snap = cache.snapshot()
            nxt = None
            if ahead and i + 1 < max_tokens:
                nxt = step(y, i + 1, bool(processors))
                queue(nxt)
            tok = read(y, table)
            safe = snap
            for proc in processors:
                proc.commit([tok])
            entry = logprob_entries(lp, 1) if lp is not None else None
            if tok in eos:
                yield Block((), 0, 0, "none", 1, "stop", logprobs=() if lp is not None else None)
                return
            if i + 1 == max_tokens:
                yield Block((tok,), 0, 0, "none", 1, "length", logprobs=entry)
                return
            yield Block((tok,), 0, 0, "none", 1, logprobs=entry)
            if (i + 1) % engine.CLEAR_EVERY == 0:
                mx.clear_cache()  # as the speculative loop does (engine.CLEAR_EVERY, read now: benchmarks set it)
            if nxt is None:
                nxt = step(mx.array([tok], dtype=mx.uint32), i + 1, False)
                queue(nxt)
            cur = nxt
    finally:
        cache.restore(safe)
