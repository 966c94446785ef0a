"""How wide a batch's verify forward is: each row's expected tokens against what its drafts cost everyone.

A verify of ``B`` rows x ``T`` positions costs more than one of ``B`` rows x 1,
and every row pays for the widest: on a 2-core x86 CPU (SmolLM2-135M,
float32, OpenBLAS) 4 rows at T = 8 cost 2.1x 4 rows at T = 1. So after each
row's own policy has drafted, the block's width ``W`` is chosen to maximise

    sum over rows of E_row(min(drafts_row, W - 1)) / E_row(drafts_row)  /  cost(B, W)

where ``E_row(j)`` is the tokens the row is expected to commit with ``j``
drafts (its policy's estimate: by match length for prompt lookup, by the
run's acceptance otherwise; the drafts it expects accepted are scaled by how
many of the row's earlier expected accepts came true). Each row counts the
share of its own best progress the block gives it, so a row that copies
(four tokens a block) gains a wider block only what a row making one token
a block, which needs a block per token whatever the width, loses by waiting
for it: widening pays when most rows gain, or when the forward grows little.
Counted in tokens instead, the copying rows widened every block and the
rows with nothing to copy ended last (measured: 8 mixed requests sent at once
took longer than without speculation). Drafts past ``W - 1`` are cut (a
prefix of a draft is a draft).
``cost`` is measured the first time rows share a block
(a forward of each row count by each width, on the model itself, within a
time budget: wide forwards past it are extrapolated) and follows what the
blocks take while running. When nothing is accepted every ``E`` falls to 1
and the widest worthwhile block is ``W = 1``: plain batched decoding.
"""

from __future__ import annotations

import math
import time
import weakref
from bisect import bisect_left
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx

from ..cache.batch_cache import BatchCache
from ..cache.caches import ModelCache
from ..defaults import KNEE_GAIN
from ..drafters import Draft

# Widths measured (up to the block size), and how many timed forwards each.
WIDTHS = (1, 2, 4, 8, 16, 32, 64)
_REPEATS = 3
# Measuring stops widening a row count once one forward takes this long, and stops altogether
# past the budget: what is not measured is extrapolated (a server's first batch waits for it).
_SLOW_FORWARD_S = 0.25
MEASURE_BUDGET_S = 3.0
# A slow row count still gets one wide forward measured, past the budget: its cost by width is then a line
# through two points, not a guess (priced as separate forwards, a sharded target's verify, which pays its
# collectives once whatever its width, would look 8x too dear and never draft).
SECOND_WIDTH = 8
# How much one block's time moves a cell of the table.
_LEARN = 0.2
# A wider block must promise this much more than a plain one (W = 1) to be chosen: near the
# boundary the estimates' noise decides, and plain batched decoding is the floor to keep.
MARGIN = 0.05


def knee(costs: dict[int, float], gain: float = KNEE_GAIN) -> int:
    """The most rows worth decoding together, from one-token steps' seconds by row count.

    A row count is taken when its tokens per second (rows / step seconds)
    beat the count taken so far by at least ``gain`` per doubling of the rows:
    past that, every row waits longer per token for little more throughput.
    A count that measured worse does not end the search: noise only adds
    time, so a larger count that measured well is real (a busy moment at 2
    rows once made a server decode one request at a time). The first count
    is always kept.
    """
    rows = sorted(costs)
    chosen = rows[0]
    for b in rows[1:]:
        doublings = math.log2(b / chosen)
        if b / costs[b] >= (1.0 + gain) ** doublings * chosen / costs[chosen]:
            chosen = b
    return chosen


class CostTable:
    """Seconds of one verify forward by rows x width: measured, interpolated between, learned while running.

    Args:
        cells: ``(rows, width) -> seconds`` at the measured points.
    """

    def __init__(self, cells: dict[tuple[int, int], float]):
        self.cells = dict(cells)
        self.rows = sorted({b for b, _ in cells})
        self._monotone()

    def _monotone(self) -> None:
        """More rows or a wider forward never cost less: a timing that says so is noise (a busy machine)."""
        for (b, w) in sorted(self.cells):
            below = [v for (bb, ww), v in self.cells.items() if bb <= b and ww <= w and (bb, ww) != (b, w)]
            if below:
                self.cells[(b, w)] = max(self.cells[(b, w)], max(below))

    @classmethod
    def measure(cls, model: Any, fresh: Callable[[], ModelCache], rows: Sequence[int],
                widths: Sequence[int] = WIDTHS, context: int = 64, repeats: int = _REPEATS,
                budget: float = MEASURE_BUDGET_S, clock: Optional[Callable[[float], float]] = None) -> "CostTable":
        """Time the model's forward for each row count and width over ``context`` tokens of cache.

        Widths grow while a forward stays under ``_SLOW_FORWARD_S`` and the
        whole measurement under ``budget`` seconds; each row count's first
        (narrowest) width is always measured, and so is its ``SECOND_WIDTH``
        (or the widest below it) once it was slow. Each cell is the fastest of
        ``repeats`` forwards, or one forward where that one took longer than
        ``_SLOW_FORWARD_S``. The caches are throwaway. Under ``mlx.launch``, ``clock`` (``Ranks.clock``)
        makes every timing rank 0's, so that every rank runs the same forwards and keeps the same table.
        """
        clock = clock or (lambda seconds: seconds)
        base = fresh()
        base.prefill([(7 * i) % 97 + 1 for i in range(context)])
        caches: dict[int, Any] = {}
        for b in sorted(set(rows)):
            caches[b] = base
            if b > 1:
                caches[b] = BatchCache(model, base)
                for _ in range(b - 1):
                    caches[b].add(base)
                # Built row by row, a batch is a lazy chain of concatenations: evaluated here, or every
                # timed forward evaluates it again (32 rows timed at 17 tokens/s instead of 167).
                mx.eval(caches[b].state_arrays())
        # The budget is for timing forwards: building the caches above is not (32 rows' took seconds).
        spent = 0.0
        cells: dict[tuple[int, int], float] = {}
        slow: set[int] = set()
        # Narrow widths of every row count first (what blocks use most), then wider ones while time remains.
        order = sorted(((b, w) for b in caches for w in set(widths)), key=lambda bw: (bw[1] > 8, bw[1], bw[0]))
        second = max([w for w in widths if w <= SECOND_WIDTH], default=min(widths))
        for b, w in order:
            if b in slow:
                if w != second or (b, w) in cells:
                    continue
            elif cells and spent > budget:
                continue
            cache = caches[b]
            x = mx.ones((b, w) if b > 1 else (w,), dtype=mx.uint32)
            times = []
            # On GPUs a shape's first run compiles kernels: not timed. MLX's CPU backend compiles none.
            compile_run = 0 if mx.default_device() == mx.cpu else 1
            for i in range(repeats + compile_run):
                snap = cache.snapshot()
                t0 = time.perf_counter()
                mx.eval(cache.feed(x))
                times.append(clock(time.perf_counter() - t0))
                spent += times[-1]
                cache.restore(snap)
                if i >= compile_run and times[-1] > _SLOW_FORWARD_S:
                    break  # a slow forward's noise is small beside it: one timing will do (start-up waits less)
            cells[(b, w)] = min(times[compile_run:])
            if cells[(b, w)] > _SLOW_FORWARD_S:
                slow.add(b)  # wider forwards of this row count cost more still: extrapolated
        return cls(cells)

    def cost(self, rows: int, width: int) -> float:
        """Seconds of a forward of ``rows`` x ``width``: measured, else interpolated (linear beyond the ends)."""
        cell = self.cells.get((rows, width))
        if cell is not None:
            return cell
        b0, b1, fb = _bracket(self.rows, rows)
        return max(1e-6, self._at(b0, width) + fb * (self._at(b1, width) - self._at(b0, width)))

    def _at(self, rows: int, width: int) -> float:
        """A measured row count's cost at ``width``.

        Along its own measured widths; past its widest, grown as the row count
        measured furthest grows from there (no reference: as costly as
        separate forwards).
        """
        last = self._widths(rows)[-1]
        if width > last:
            ref = max(self.rows, key=lambda b: (self._widths(b)[-1], -abs(b - rows)))
            if self._widths(ref)[-1] > last:
                return self.cells[(rows, last)] * self._along(ref, width) / self._along(ref, last)
            if len(self._widths(rows)) == 1:
                return self.cells[(rows, last)] * width
        return self._along(rows, width)

    def _widths(self, rows: int) -> list[int]:
        return sorted(w for b, w in self.cells if b == rows)

    def _along(self, rows: int, width: int) -> float:
        """Linear between a row count's measured widths, and beyond them."""
        w0, w1, fw = _bracket(self._widths(rows), width)
        return self.cells[(rows, w0)] + fw * (self.cells[(rows, w1)] - self.cells[(rows, w0)])

    def learn(self, rows: int, width: int, seconds: float) -> None:
        """A block of ``rows`` x ``width`` took ``seconds``: its cell moves towards it (or is set, if it was
        only estimated: an estimate that priced a block too cheap is corrected by the block itself)."""
        cell = self.cells.get((rows, width))
        self.cells[(rows, width)] = seconds if cell is None else cell + _LEARN * (seconds - cell)
        if cell is None and rows not in self.rows:
            self.rows = sorted({*self.rows, rows})
        self._monotone()


def _bracket(points: list[int], x: int) -> tuple[int, int, float]:
    """The measured points around ``x`` and where ``x`` lies between them (beyond the ends: extrapolated)."""
    if len(points) == 1:
        return points[0], points[0], 0.0
    i = min(max(bisect_left(points, x), 1), len(points) - 1)
    lo, hi = points[i - 1], points[i]
    return lo, hi, (x - lo) / (hi - lo)


class BatchPlanner:
    """Cuts a batch's drafts to the width worth its forward (see the module docstring).

    Args:
        measure: Returns the model's :class:`CostTable`; called the first time rows share a block.
    """

    def __init__(self, measure: Callable[[], CostTable]):
        self._measure = measure
        self.costs: Optional[CostTable] = None
        # Per row: drafts its estimates expected accepted in the blocks it drafted, and drafts that were.
        self._record: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._planned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._width: Optional[int] = None  # the last block's

    def prepare(self) -> None:
        """Measure the forward costs if that is still to do (before a block is timed: it takes seconds)."""
        if self.costs is None:
            self.costs = self._measure()

    def trim(self, pending: Sequence[Any]) -> int:
        """Cut each row's draft (``pending[i].draft``) to the chosen width - 1; returns the width."""
        self.prepare()
        rows = len(pending)
        ks = [p.draft.size for p in pending]
        raw = [[_expected(p.row, j) for j in range(k + 1)] for p, k in zip(pending, ks)]
        trust = [self._trust(p.row) for p in pending]
        curves = [[1.0 + t * (e - 1.0) for e in c] for c, t in zip(raw, trust)]
        curves = [[e / c[-1] for e in c] for c in curves]  # the share of the row's best progress
        values = {w: sum(c[min(k, w - 1)] for c, k in zip(curves, ks)) / self.costs.cost(rows, w)
                  for w in range(1, max(ks, default=0) + 2)}
        best_w, best = 1, (1.0 + MARGIN) * values[1]
        for w in range(2, max(ks, default=0) + 2):
            if values[w] > best:
                best_w, best = w, values[w]
        # The last block's width stays while it is within the margin of the best: a row count that sits at a
        # threshold (a request joining and leaving) would otherwise flip it every block, and on a GPU each new
        # width is a new shape to compile.
        last = self._width
        if last is not None and last != best_w and last in values and values[last] * (1.0 + MARGIN) >= best:
            best_w = last
        self._width = best_w
        for p, k, c in zip(pending, ks, raw):
            if k > best_w - 1:
                p.draft = _cut(p.draft, best_w - 1)
            self._planned[p.row] = c[min(k, best_w - 1)] - 1.0
        return best_w

    def _trust(self, row: Any) -> float:
        """How many of a row's expected accepts came true so far (a smoothed ratio, at most 2)."""
        expected, accepted = self._record.get(row, (0.0, 0))
        return min(2.0, (accepted + 1.0) / (expected + 1.0))

    def observe(self, blocks: Sequence[tuple[Any, int, int]], width: int, seconds: float) -> None:
        """A block ran: ``(row, drafted, accepted)`` for each row, its width and its seconds."""
        if self.costs is not None:
            self.costs.learn(len(blocks), width, seconds)
        for row, drafted, accepted in blocks:
            if drafted:
                expected, got = self._record.get(row, (0.0, 0))
                self._record[row] = (expected + self._planned.get(row, 0.0), got + accepted)


def _expected(row: Any, k: int) -> float:
    """Tokens ``row`` is expected to commit with ``k`` drafts: its policy's estimate, else its acceptance so far."""
    estimate: Optional[Callable[[int], float]] = getattr(row.policy, "expected", None)
    if estimate is not None:
        return estimate(k)
    rate = (row.accepted + 1) / (row.drafted + 2)
    return sum(rate ** i for i in range(k + 1))


def _cut(draft: Draft, k: int) -> Draft:
    """The first ``k`` tokens of a draft (and of its log q): a cut that does not depend on what was drafted."""
    return Draft(draft.tokens[:k], None if draft.logprobs is None else draft.logprobs[:k], draft.syncs,
                 None if draft.host is None else draft.host[:k])
