"""The server under ``mlx.launch``: rank 0 decides, every rank does the same, in the same order.

Rank 0 owns HTTP, the queue, the memory checks and each reply's text; so it
alone decides which requests open, which leave (ended, stopped by a string,
cancelled, failed) and when the engine starts afresh. Those decisions are
:class:`Op`-s. Under ranks they are not done when decided: each loop pass of
rank 0's scheduler sends the pass's ops to every rank in one broadcast
(:meth:`~specdec_cli.model.distributed.Ranks.broadcast`), then every rank does
them, one prefill chunk and one engine block, in that order. Every rank then
holds the same flights, so the collectives inside their forwards (and the
block's agreement on tokens) line up; what a rank measures for itself is rank
0's (``Ranks.clock``). A rank other than 0 runs :func:`follow`: no HTTP, no
replies, only the passes. In one process the ops are done as they are decided.

An idle rank 0 sends an empty pass every ``HEARTBEAT_S``, so that a rank that
stops answering is found by the watchdog while nobody asks anything, and a
pass with ``stop`` ends every rank when the server stops.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..core.request import Request
from ..loop.flights import Flight, Flights
from ..model import distributed

log = logging.getLogger("specdec.serve")
# Seconds between passes that an idle rank 0 still sends (the ranks' heartbeat, well inside the watchdog's
# deadline).
HEARTBEAT_S = 1.0


@dataclass(frozen=True)
class Open:
    """Open a request (its prompt-cache hit, its prefill ready); ``id`` names its flight on every rank."""

    id: int
    request: Request


@dataclass(frozen=True)
class Leave:
    """A flight leaves; with ``keep`` its caches and ``tokens`` (its answer) go to the prompt cache."""

    id: int
    keep: bool
    tokens: Optional[tuple[int, ...]] = None


@dataclass(frozen=True)
class Fresh:
    """Start the engine afresh if rows no request owns are left in it (after a fault)."""


Op = Any  # Open | Leave | Fresh


@dataclass
class Pass:
    """One loop pass of rank 0's scheduler: its ops, then a prefill chunk and an engine block (``stop``: its ops,
    then the end)."""

    ops: list = field(default_factory=list)
    stop: bool = False


class Lockstep:
    """The ops of a server's flights: done at once in one process, broadcast once per pass under ranks.

    Args:
        ranks: The ranks of a sharded target (None: one process).
    """

    def __init__(self, ranks: Optional[distributed.Ranks] = None):
        self.ranks = ranks
        self.flights: dict[int, Flight] = {}
        self._queued: list[Op] = []
        self._next = 0

    @property
    def queued(self) -> bool:
        """Whether ops wait for the next pass."""
        return bool(self._queued)

    def new_id(self) -> int:
        self._next += 1
        return self._next

    def add(self, op: Op, rows: Flights, tags: Callable[[int], Any] = lambda i: i) -> list:
        """Do ``op`` now in one process (returns what :meth:`apply` returns), else queue it for the next pass."""
        if self.ranks is None:
            return self.apply([op], rows, tags)
        self._queued.append(op)
        return []

    def send(self, stop: bool = False) -> list[Op]:
        """Rank 0: the queued ops to every rank (a pass); returns them, to :meth:`apply` on rank 0 too."""
        if self.ranks is None:
            return []
        ops, self._queued = self._queued, []
        self.ranks.broadcast(Pass(ops, stop))
        return ops

    def apply(self, ops: list[Op], rows: Flights, tags: Callable[[int], Any] = lambda i: i) -> list:
        """Do ``ops`` on ``rows``; returns ``(op, error)`` for each that raised (it did nothing more).

        ``tags(id)`` is an opened flight's tag (rank 0's: its client's job and reply).
        """
        failed = []
        for op in ops:
            try:
                if isinstance(op, Open):
                    self.flights[op.id] = rows.open(op.request, tags(op.id))
                elif isinstance(op, Leave):
                    flight = self.flights.pop(op.id, None)
                    if flight is not None:
                        rows.leave(flight, op.keep, None if op.tokens is None else list(op.tokens))
                elif isinstance(op, Fresh):
                    if rows.engine.rows:
                        rows.new_engine()
            except Exception as e:
                if fatal(e):
                    raise
                failed.append((op, e))
        return failed


def fatal(error: BaseException) -> bool:
    """Whether ``error`` ends a server: ranks that lost or disagree with each other cannot serve on."""
    return isinstance(error, distributed.DistributedError) or distributed.is_peer_error(error)


def follow(rows: Flights, ranks: distributed.Ranks, after: Callable[[], None] = lambda: None) -> None:
    """A rank other than 0: do rank 0's passes until one says stop (or a peer is lost: that raises).

    Each pass: its ops, one prefill chunk of the oldest request prefilling, one block of the decoding rows, as
    rank 0's scheduler does them, then ``after()`` (this rank's own work, e.g. its disk writes). A fault in the
    prefill or the block is rank 0's too (the same work): it decides what leaves, and this rank does that in the
    next pass.
    """
    steps = Lockstep(ranks)
    try:
        with ranks.watching():
            while True:
                work: Pass = ranks.broadcast()
                for op, error in steps.apply(work.ops, rows):
                    log.error("rank %d: %s failed: %s", ranks.rank, type(op).__name__, error)
                if work.stop:
                    after()
                    return
                try:
                    rows.prefill_step(rows.next_prefill())
                    if rows.engine.rows:
                        rows.step()
                except Exception as e:
                    if fatal(e):
                        raise
                    log.error("rank %d: a pass failed: %s", ranks.rank, e)
                after()
    finally:
        rows.close()


__all__ = ["Fresh", "HEARTBEAT_S", "Leave", "Lockstep", "Open", "Pass", "fatal", "follow"]
