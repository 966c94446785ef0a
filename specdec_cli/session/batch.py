"""Several requests decoded together as rows of one engine, for a face that has them all at once.

:func:`run_batch` is the loop behind ``specdec generate --prompts-file``: it
opens requests while fewer than ``max_rows`` decode, prefills each prompt
whole (short ones that fit one forward together, as the server does), admits
it to the :class:`~specdec_cli.loop.engine.Engine`, runs one block for every
row, and takes out the rows that ended; waiting requests join as rows leave.
It yields typed events and never prints. :func:`concurrency_sweep` runs it
over copies of one prompt for ``specdec sweep --concurrency``.

Unlike the server's scheduler (which prefills one chunk between blocks, so
rows already answering never stall), a prompt here is prefilled whole before
the next block: every prompt is known at the start, and what counts is the
batch's total time, not one row's time to its next token.

Time is counted on a clock that stops while the consumer holds an event
(printing text, redrawing a panel), so display never reads as decode time
or latency.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

from ..cache.batch_check import Rounding, check_batch
from ..defaults import AUTO_ROWS
from ..loop.batch_policy import WIDTHS, BatchPlanner, CostTable, knee
from ..loop.compare import IDENTICAL, explain
from .measure import Progress
from ..loop.events import Finished, Prefilled, Step, cache_bytes
from ..loop.events import collect
from ..loop.runner import run
from ..loop.flights import PREFILL_TOGETHER, Flights
from .generate import Session
from ..core.request import Request
from .setup import Setup

RowEventKind = Union[Prefilled, Step, Finished]


@dataclass(frozen=True)
class RowEvent:
    """Something that happened to one row.

    Attributes:
        index: The request's position in the list :func:`run_batch` was given.
        event: The row's ``Prefilled`` (it joined the batch), one ``Step`` per
            block it took part in (``seconds``: the whole block's, shared by
            every row in it), then ``Finished`` (it left).
        at: Seconds since the batch started (display time not counted).
    """

    index: int
    event: RowEventKind
    at: float


@dataclass
class BatchEnd:
    """Every row finished (or, passed to :func:`run_batch` as ``totals``, the batch so far).

    Attributes:
        decode_s: Seconds inside engine blocks (each block once, whatever its rows).
        prefill_s: Seconds prefilling prompts (between blocks).
        wall_s: Seconds from the start to the last row's end (display time not counted).
        blocks: Engine blocks run.
        most_rows: The most rows one block decoded.
        planner_s: Seconds measuring the planner's forward costs before the start (not in ``wall_s``).
    """

    decode_s: float = 0.0
    prefill_s: float = 0.0
    wall_s: float = 0.0
    blocks: int = 0
    most_rows: int = 0
    planner_s: float = 0.0


def batch_refusal(session: Session) -> Optional[str]:
    """Why this model's rows cannot share a batch (a layer cache with no row form, a forward past rounding of
    the row alone), or None; the backend's rounding it measured is kept as ``session.rounding``."""
    problem, session.rounding = check_batch(session.model, session.fresh_cache)
    return problem


def auto_concurrency(session: Session, rows: Sequence[int] = AUTO_ROWS) -> tuple[int, dict[int, float]]:
    """serve's ``--decode-concurrency`` default: :func:`~specdec_cli.loop.batch_policy.knee` of the target's
    one-token step measured at ``rows`` rows; returns it and the seconds by row count."""
    # Every row count is measured (one-token steps are quick); none is extrapolated.
    table = CostTable.measure(session.model, session.fresh_cache, rows, (1,), budget=float("inf"),
                              clock=_clock(session))
    costs = {b: table.cost(b, 1) for b in rows}
    return knee(costs), costs


def measure_costs(session: Session, max_rows: int) -> CostTable:
    """The target's verify forward cost by rows x width, for a :class:`~specdec_cli.loop.batch_policy.BatchPlanner`."""
    # Past 8 rows the table extrapolates: measuring 32 rows' wide forwards would take the whole budget.
    rows = sorted({1, 2, min(max_rows, 8)})
    widths = sorted({w for w in WIDTHS if w <= session.block_size} | {session.block_size})
    return CostTable.measure(session.model, session.fresh_cache, rows, widths, clock=_clock(session))


def _clock(session: Session):
    """Under ``mlx.launch``, rank 0's timings for every rank (they decide which forwards are measured)."""
    return None if session.ranks is None else session.ranks.clock


def run_batch(session: Session, requests: Sequence[Request], *, max_rows: int, planner: bool = True,
              timed: bool = False, totals: Optional[BatchEnd] = None) -> Iterator[Union[RowEvent, BatchEnd]]:
    """Decode ``requests`` together, at most ``max_rows`` at a time; yields each row's events, then :class:`BatchEnd`.

    Each row's text is what its request gives alone: greedy, or sampled with
    draws keyed by (seed, position) (see :meth:`Session.plan`). Closing the
    generator stops every row at the block boundary.

    Args:
        session: The loaded session (its drafter kind, block size and adaptive policy apply to every row).
        requests: What to generate, in order; they start in this order.
        max_rows: The most rows decoding together; more wait and join as rows leave.
        planner: Cut a batch's drafts to the width worth its forward
            (:mod:`specdec_cli.loop.batch_policy`); its costs are measured before the clock starts.
        timed: Time each block's phases (adds host syncs).
        totals: Kept up to date as the batch runs and yielded at its end: a caller that stops it early
            (Ctrl-C) still has the batch's numbers so far.
    """
    if max_rows < 1:
        raise ValueError("max_rows must be >= 1")
    planner_s = 0.0
    plan = None
    rows_ever = min(max_rows, len(requests))
    if planner and rows_ever > 1 and not session.plain and session.block_size > 1:
        t = time.perf_counter()
        costs = measure_costs(session, rows_ever)
        plan = BatchPlanner(lambda: costs)
        planner_s = time.perf_counter() - t
    flights = Flights(session, planner=plan, timed=timed)
    waiting = deque(enumerate(requests))
    start = time.perf_counter()
    paused = 0.0  # seconds the consumer held an event

    def now() -> float:
        return time.perf_counter() - start - paused

    end = totals if totals is not None else BatchEnd()
    end.planner_s = planner_s
    try:
        while waiting or flights.flights:
            t = time.perf_counter()
            joined = _admit(flights, waiting, max_rows)
            end.prefill_s += time.perf_counter() - t
            end.wall_s = now()
            for flight in joined:
                t = time.perf_counter()
                yield RowEvent(flight.tag, flight.opening.prefilled, now())
                paused += time.perf_counter() - t
            t = time.perf_counter()
            out = flights.step()
            seconds = time.perf_counter() - t
            end.decode_s += seconds
            end.blocks += 1
            end.most_rows = max(end.most_rows, len(out))
            at = end.wall_s = now()
            for flight, block in out:
                t = time.perf_counter()
                yield RowEvent(flight.tag, Step(block, seconds), at)
                paused += time.perf_counter() - t
            for flight in [f for f, _ in out if f.ended]:
                cache = flights.leave(flight)
                t = time.perf_counter()
                yield RowEvent(flight.tag, Finished(cache_bytes(cache, flight.opening.drafter)), at)
                paused += time.perf_counter() - t
        end.wall_s = now()
        yield end
    finally:
        flights.close()


def _admit(flights: Flights, waiting: deque, max_rows: int) -> list:
    """Open waiting requests while fewer than ``max_rows`` are in flight and prefill each whole, as the loop
    decides (:meth:`Flights.next_prefill`, at its budget with no row decoding, since here no row's next token
    is waited for). Returns them, in the requests' order."""
    while waiting and len(flights.flights) < max_rows:
        index, request = waiting.popleft()
        flights.open(request, index)
    joined = []
    while group := flights.next_prefill(budget=PREFILL_TOGETHER["idle"]):
        joined += flights.prefill_step(group, whole=True)
    return sorted(joined, key=lambda f: f.tag)


# -- specdec sweep --concurrency ---------------------------------------------------------------------


@dataclass(frozen=True)
class ConcurrencyCell:
    """One block size (None: plain decoding) at one concurrency, measured against plain at the same concurrency.

    Attributes:
        block_size: Tokens verified per forward (None: plain decoding, no drafter).
        concurrency: Copies of the prompt decoded together.
        aggregate_tps: Every row's generated tokens / the batch's decode seconds (median of repeats).
        speedup: Over plain decoding at the same concurrency (median of the per-repeat ratios); plain: 1.
        acceptance: Accepted / drafted over every row (the first repeat); None where nothing was drafted.
        tokens: Tokens generated by all rows together (the first repeat).
        verdict: Every row against plain decoding of the prompt alone: ``identical``,
            ``rounding tie`` or ``diverged`` (the worst row's).
    """

    block_size: Optional[int]
    concurrency: int
    aggregate_tps: float
    speedup: float
    acceptance: Optional[float]
    tokens: int
    verdict: str = IDENTICAL

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class ConcurrencyResult:
    """Every cell, by block size and concurrency."""

    levels: tuple[int, ...]
    block_sizes: tuple[int, ...]
    cells: tuple[ConcurrencyCell, ...]

    def cell(self, block_size: Optional[int], level: int) -> ConcurrencyCell:
        return next(c for c in self.cells if c.block_size == block_size and c.concurrency == level)

    def best(self, level: int) -> Optional[int]:
        """The block size with the highest aggregate tok/s at ``level`` (None: no block sizes, or no tokens)."""
        cells = [c for c in self.cells if c.concurrency == level and c.block_size is not None and c.tokens]
        return max(cells, key=lambda c: c.aggregate_tps).block_size if cells else None

    def to_dict(self) -> dict:
        return {
            "concurrency": list(self.levels),
            "block_sizes": list(self.block_sizes),
            "best_block_size": {str(level): self.best(level) for level in self.levels},
            "cells": [c.to_dict() for c in self.cells],
        }


_WORSE = {IDENTICAL: 0, "rounding tie": 1, "diverged": 2}


def concurrency_sweep(setup: Setup, prompt_ids: Sequence[int], block_sizes: Sequence[int],
                      levels: Sequence[int], *, max_tokens: int, repeats: int = 1,
                      warmup: int = 1, rounding: Optional[Rounding] = None
                      ) -> Iterator[Union[Progress, ConcurrencyResult]]:
    """Aggregate decode speed of each block size at each concurrency: ``level`` copies of the prompt together.

    Every cell runs through :func:`run_batch` (level 1 too, so the columns
    compare like with like), greedy, with a fixed draft length (no adaptive
    policy) and without the batch planner: each cell is its block size as
    such. Within a level the runs interleave (plain, B1, B2, ..., plain, ...);
    each row's text is checked against plain decoding of the prompt alone.

    Args:
        setup: The loaded models and drafter kind.
        prompt_ids: The prompt, copied into every row.
        block_sizes: Block sizes to measure.
        levels: Concurrencies to measure.
        max_tokens: Tokens per row.
        repeats: Timed runs per cell (median).
        warmup: Untimed runs of plain and the first block size at each level first.
        rounding: The backend's rounding (the batch check's): a batched row's tie is held to it.
    """
    opts = setup.options
    kv = dict(kv_bits=opts.kv_bits, kv_group_size=opts.kv_group)
    # The reference every row is held to: plain decoding of the prompt alone.
    _, reference = collect(run(setup.target.model, prompt_ids, max_tokens=max_tokens,
                                         eos_ids=setup.eos_ids, prefill_step_size=opts.prefill_step_size, **kv))
    sessions: dict[Optional[int], Session] = {None: Session(setup, 1, adaptive=False, plain=True)}
    for b in block_sizes:
        sessions[b] = Session(setup, b, adaptive=False)
    request = Request(list(prompt_ids), max_tokens)
    total = len(levels) * (2 * warmup + repeats * (1 + len(block_sizes)))
    done = 0
    verdict: dict[tuple, str] = {}

    def once(b: Optional[int], level: int) -> tuple[float, Optional[float], int]:
        """One batch: aggregate tok/s, acceptance, tokens; each row's text judged."""
        out: dict[int, list[int]] = {i: [] for i in range(level)}
        trace: dict[int, list] = {i: [] for i in range(level)}
        chunks: dict[int, tuple] = {}
        drafted = accepted = 0
        end = None
        for ev in run_batch(sessions[b], [request] * level, max_rows=level, planner=False):
            if isinstance(ev, BatchEnd):
                end = ev
            elif isinstance(ev.event, Step):
                block = ev.event.block
                out[ev.index] += block.tokens
                trace[ev.index].append(block)
                drafted, accepted = drafted + block.drafted, accepted + block.accepted
            elif isinstance(ev.event, Prefilled):
                chunks[ev.index] = ev.event.chunks
        tokens = sum(len(t) for t in out.values())
        key = (b, level)
        for i, toks in out.items():
            if toks != reference and _WORSE[verdict.get(key, IDENTICAL)] < 2:
                d = explain(setup.target.model, prompt_ids, toks, reference, trace[i], eos_ids=setup.eos_ids,
                            prefill_step_size=opts.prefill_step_size, prefill_chunks=chunks[i],
                            rounding=rounding if level > 1 else None, **kv)
                if d is not None and _WORSE[d.verdict] > _WORSE[verdict.get(key, IDENTICAL)]:
                    verdict[key] = d.verdict
        tps = tokens / end.decode_s if end.decode_s > 0 else 0.0
        return tps, accepted / drafted if drafted else None, tokens

    cells = []
    for level in levels:
        for _ in range(warmup):
            for b in (None, block_sizes[0]):
                once(b, level)
                done += 1
                yield Progress(done, total, f"x{level} warm-up: {'plain' if b is None else f'block {b}'}")
        runs: dict[Optional[int], list[tuple[float, Optional[float], int]]] = {b: [] for b in sessions}
        for _ in range(repeats):
            for b in sessions:
                runs[b].append(once(b, level))
                done += 1
                yield Progress(done, total, f"x{level}: {'plain' if b is None else f'block {b}'}")
        plain_tps = [r[0] for r in runs[None]]
        for b in sessions:
            ratios = [r[0] / p for r, p in zip(runs[b], plain_tps) if p > 0]
            cells.append(ConcurrencyCell(
                block_size=b, concurrency=level,
                aggregate_tps=statistics.median(r[0] for r in runs[b]),
                speedup=statistics.median(ratios or [0.0]),
                acceptance=runs[b][0][1], tokens=runs[b][0][2],
                verdict=verdict.get((b, level), IDENTICAL),
            ))
    yield ConcurrencyResult(tuple(levels), tuple(block_sizes), tuple(cells))
