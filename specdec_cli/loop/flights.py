"""The one row loop every road drives: requests in flight, each in a state.

A :class:`Flights` owns one :class:`~specdec_cli.loop.engine.Engine` and the
hidden-state tap its drafters read. Each request is a :class:`Flight` that goes
``prefilling`` (its :class:`~.opening.Opening` fed a chunk at a time, or the
whole prompt at once) -> ``decoding`` (a row of the engine) -> ``finished``
(its caches handed back to its :class:`Opener`, or dropped). The opener says how
a request is opened and where its caches go: a session (its plans and prompt
cache), or one sequence outside a session (:func:`~.runner.run`). Who waits and
who is told what stays with the driver: ``generate`` and ``chat`` run one
request as the loop's only row (:meth:`Flights.alone`), the batch command
yields events, the server's scheduler sends pieces to its clients; which
waiting requests start, and whether their prompts share a forward, is decided
here (:meth:`Flights.admit`).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Protocol, Sequence, Union

from ..cache.batch_cache import prefill_rows
from ..cache.caches import ModelCache
from ..core.blocks import Block
from ..core.numerics import Numerics
from ..core.request import Request
from ..errors import Cancelled
from ..model.taps import HiddenTap
from .batch_policy import BatchPlanner
from .engine import Engine, Row
from .events import Finished, Prefilled, Step, Warmed, cache_bytes
from .opening import Opening
from .plain import warm_up

if TYPE_CHECKING:
    from ..model.distributed import Ranks

Event = Union[Prefilled, Warmed, Step, Finished]
# Most tokens (prompts padded to the longest) that waiting requests prefill together in one forward. While
# rows decode they wait on it: 128, about half a second (as a timed chunk) on the project's 2-core CPU with the
# bundled model (2 x 64 tokens: 0.57 s; 4 x 32: 0.58 s). When none decode, only the requests in it wait, and
# each would wait longer prefilled alone (8 x 40 tokens: 1.2 s together, 2.4 s one at a time; 4 x 128: 2.0 s
# against 2.8 s).
PREFILL_TOGETHER = {"decoding": 128, "idle": 1024}
# Padded tokens of such a forward per prompt token, at most: one forward of rows prefills about twice the
# tokens per second of one row at a time there (8 x 40 above); padding past half the prompt tokens eats most
# of that gain.
PADDING_AT_MOST = 1.5


class Opener(Protocol):
    """How a :class:`Flights` opens requests and where their caches go: a session, or one run outside one.

    Attributes:
        model: The target model.
        ranks: The ranks of a sharded target (None: one process).
        numerics: The run's numerics (the engine's verify shapes).
    """

    model: Any
    ranks: Optional["Ranks"]
    numerics: Numerics

    def tap_spec(self) -> Any:
        """The hidden states its drafters read (a ``TapSpec``), or None."""

    def open(self, request: Request, tap: Optional[HiddenTap], policy: Any = None) -> Opening:
        """``request``'s :class:`~.opening.Opening`: its plan, its prompt-cache hit, its prefill ready to run."""

    def keep(self, opening: Opening, cache: Optional[ModelCache], tokens: Sequence[int]) -> None:
        """A request left (at a block boundary, or between prefill chunks): its caches, to keep or drop."""


class State(Enum):
    """Where a request is, as llama.cpp's slots say it."""

    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass(eq=False)
class Flight:
    """One request in flight.

    Attributes:
        request: What it generates.
        tag: The driver's own handle on it (an index, a client's job).
        opening: Its prefill, then the source of its drafter and prompt-cache hit.
        row: Its engine row once decoding.
        tokens: Every token its blocks committed.
        state: Where it is.
    """

    request: Request
    tag: Any
    opening: Opening
    row: Optional[Row] = None
    tokens: list = field(default_factory=list)
    state: State = State.PREFILLING

    @property
    def ended(self) -> bool:
        """Its row stopped (EOS, max tokens): it leaves at this block boundary."""
        return self.row is not None and (self.row.finish is not None or self.row.room <= 0)


class Flights:
    """Requests prefilled and decoded together as rows of one engine.

    Args:
        opener: Opens requests and keeps their caches (a :class:`~specdec_cli.session.generate.Session`).
        planner: Weighs a batch's drafts against its forward's cost (None: every row drafts its own).
        timed: Time each block's phases (adds host syncs).
    """

    def __init__(self, opener: Opener, *, planner: Optional[BatchPlanner] = None, timed: bool = False):
        self.opener = opener
        self._planner, self._timed = planner, timed
        spec = opener.tap_spec()
        self.tap = HiddenTap(opener.model, spec) if spec is not None else None
        self.flights: list[Flight] = []
        self._by_row: dict[int, Flight] = {}
        try:
            self.engine = self.new_engine()
        except BaseException:
            if self.tap is not None:
                self.tap.close()  # nothing is left installed on the model after an error
            raise

    def new_engine(self) -> Engine:
        """A fresh engine (the first, or after a fault left rows no request owns)."""
        self._by_row.clear()
        opener = self.opener
        # A sharded target's engine agrees each block with the other ranks (and takes one row).
        self.engine = Engine(opener.model, timed=self._timed, tap=self.tap, planner=self._planner,
                             sync=opener.ranks, numerics=opener.numerics)
        return self.engine

    @property
    def decoding(self) -> list[Flight]:
        return [f for f in self.flights if f.state is State.DECODING]

    def open(self, request: Request, tag: Any = None, policy: Any = None) -> Flight:
        """Start ``request``: its prompt-cache hit taken and its prefill ready to run (raises what
        :class:`~.opening.Opening` raises; nothing is then in flight for it).

        Args:
            request: What to generate.
            tag: The driver's handle on it.
            policy: Its draft-length policy (default: a fresh one of the session's kind).
        """
        flight = Flight(request, tag, self.opener.open(request, self.tap, policy))
        self.flights.append(flight)
        return flight

    def prefill(self, flight: Optional[Flight] = None, whole: bool = False) -> Optional[Flight]:
        """One prefill chunk of ``flight`` (default: the oldest still prefilling), or every chunk
        with ``whole``; returns the flight once it is admitted to the engine, else None."""
        if flight is None:
            flight = next((f for f in self.flights if f.state is State.PREFILLING), None)
            if flight is None:
                return None
        while not flight.opening.step():
            if not whole:
                return None
        flight.row = self.engine.admit(flight.opening.row, flight.opening.cache)
        self._by_row[id(flight.row)] = flight
        flight.state = State.DECODING
        return flight

    def together(self, waiting: list[Flight], budget: Optional[int] = None) -> list[Flight]:
        """The oldest of ``waiting`` whose prompts can be prefilled in one forward: each :attr:`Opening.joinable`,
        their prompts padded to the longest at most ``budget`` tokens in all (default: ``PREFILL_TOGETHER``'s,
        smaller while rows decode); empty when fewer than two."""
        if budget is None:
            budget = PREFILL_TOGETHER["decoding" if self.engine.rows else "idle"]
        group: list[Flight] = []
        width = real = 0
        for flight in waiting:
            opening = flight.opening
            if not opening.joinable:
                if not group:
                    return []  # the oldest goes on with chunks of its own
                continue
            n = len(opening.rest)
            padded = (len(group) + 1) * max(width, n)
            # A prompt much longer or shorter than the others waits for a forward of its own kind.
            if padded > budget or padded > PADDING_AT_MOST * (real + n):
                continue
            group.append(flight)
            width, real = max(width, n), real + n
        return group if len(group) > 1 else []

    def next_prefill(self, budget: Optional[int] = None) -> list[Flight]:
        """The requests the next prefill step feeds: those whose prompts share one forward (:meth:`together`,
        at ``budget``), else the oldest still prefilling alone; empty when none waits."""
        waiting = [f for f in self.flights if f.state is State.PREFILLING]
        return self.together(waiting, budget) or waiting[:1]

    def prefill_step(self, flights: list[Flight], whole: bool = False) -> list[Flight]:
        """Feed ``flights`` (from :meth:`next_prefill`): several in one forward, or one its next chunk (every
        chunk with ``whole``); returns those admitted to the engine by it."""
        if len(flights) > 1:
            return self.prefill_together(flights)
        admitted = self.prefill(flights[0], whole=whole) if flights else None
        return [admitted] if admitted is not None else []

    def prefill_together(self, flights: list[Flight]) -> list[Flight]:
        """Prefill the prompts of ``flights`` (from :meth:`together`) in one forward of them all as rows, then
        admit each to the engine; returns them. Each row's caches are what its own prefill would leave."""
        start = time.perf_counter()
        caches = prefill_rows(self.opener.model, [f.opening.cache for f in flights],
                              [f.opening.rest for f in flights])
        seconds = time.perf_counter() - start
        for flight, cache in zip(flights, caches):
            flight.opening.fed_together(cache, seconds)
        return [self.prefill(flight, whole=True) for flight in flights]

    def step(self) -> list[tuple[Flight, Block]]:
        """One engine block for every decoding row; each flight's tokens grow by its block's."""
        if any(id(row) not in self._by_row for row in self.engine.rows):
            # A row whose request ended but could not leave: refused before a block decodes it; the driver
            # starts a fresh engine.
            raise RuntimeError("a row in the engine belongs to no request (its request ended but could not leave)")
        out = [(self._by_row.get(id(row)), row, block) for row, block in self.engine.step()]
        if any(flight is None or flight.row is not row for flight, row, _ in out):
            raise RuntimeError("a row in the engine belongs to no request")
        for flight, _, block in out:
            flight.tokens += block.tokens
        return [(flight, block) for flight, _, block in out]

    def leave(self, flight: Flight, keep: bool = True, tokens: Optional[list] = None) -> Optional[ModelCache]:
        """Take ``flight`` out (at a block boundary); with ``keep`` its caches go to the prompt cache.

        A request still prefilling keeps the chunks fed: a prefix the next request may reuse.

        Args:
            flight: The request.
            keep: Hand its caches to its opener to keep (False: a failed request's are dropped).
            tokens: The tokens it generated (default: every token its blocks committed).

        Returns:
            Its target caches (None: they could not be taken out).
        """
        if flight in self.flights:
            self.flights.remove(flight)  # first: whatever fails below, it is no longer in flight
        cache = None
        if flight.state is State.DECODING:
            self._by_row.pop(id(flight.row), None)
            if flight.row in self.engine.rows:
                cache = self.engine.remove(flight.row)
        elif flight.state is State.PREFILLING:
            flight.opening.close()
            cache = flight.opening.cache
        flight.state = State.FINISHED
        if keep:
            self.opener.keep(flight.opening, cache, flight.tokens if tokens is None else tokens)
        return cache

    def alone(self, request: Request, *, policy: Any = None, cancelled: Optional[Callable[[], bool]] = None,
              warmup: bool = True) -> Iterator[Event]:
        """Decode ``request`` as this loop's only row: ``generate`` and ``chat``'s one sequence.

        Yields its ``Prefilled``, ``Warmed`` (when ``warmup``), one ``Step`` per
        block (the seconds inside the engine, so a consumer's display time is
        never decode time), then ``Finished``. Closing the generator stops it at
        a block boundary; whatever ended it, its caches leave the engine as
        plain decoding leaves them and go to the prompt cache (not after a
        failure inside a prefill chunk).

        Args:
            request: What to generate.
            policy: The draft-length policy (pass one to read its summary afterwards).
            cancelled: Asked between prefill chunks; True raises :class:`~specdec_cli.errors.Cancelled`.
            warmup: Run every shape decoding can use once first (see :func:`~specdec_cli.loop.plain.warm_up`).
        """
        ranks = self.opener.ranks
        watch = ExitStack()
        flight: Optional[Flight] = None
        keep = False  # whether the caches hold whole tokens: after the prefill, or between its chunks
        try:
            if ranks is not None:
                watch.enter_context(ranks.watching())  # a rank whose peers stop answering ends
            flight = self.open(request, policy=policy)
            opening = flight.opening
            while self.prefill(flight) is None:
                if cancelled is not None and cancelled():
                    keep = True
                    fed = sum(opening.cache.chunks)
                    raise Cancelled(f"prefill cancelled after {fed} of {len(opening.ids) - 1 - opening.cached} "
                                    f"tokens")
            keep = True
            yield opening.prefilled
            if warmup:
                start = time.perf_counter()
                what = warm_up(opening.cache, opening.drafter, max_draft=0 if opening.drafter is None else
                               opening.k_max, sampling=flight.row.sampling, rollback=flight.row.rollback or "carry",
                               tap=self.tap, numerics=opening.numerics)
                yield Warmed(time.perf_counter() - start, what)
            while not flight.ended:
                start = time.perf_counter()
                ((_, block),) = self.step()
                yield Step(block, time.perf_counter() - start)
            # The engine's exit first (a carry fed): then the caches are measured and kept.
            cache = self.leave(flight)
            yield Finished(cache_bytes(cache, opening.drafter))
        finally:
            try:
                if flight is not None and flight.state is not State.FINISHED:
                    self.leave(flight, keep=keep)
            finally:
                watch.close()

    def close(self) -> None:
        """Drop every flight's row (nothing kept), close the engine and take the tap off the model."""
        try:
            for flight in list(self.flights):
                self.leave(flight, keep=False)
            self.engine.close()
        finally:
            if self.tap is not None:
                self.tap.close()


__all__ = ["Flight", "Flights", "State"]
