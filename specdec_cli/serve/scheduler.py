"""The generation thread: several requests decode together as rows of one engine, more wait in a bounded queue.

Each loop of the thread admits waiting requests while fewer than
``max_rows`` are in flight, prefills one chunk of the oldest request still
prefilling (so the rows already decoding never stall for a whole long
prompt), then runs one engine block for every decoding row and hands each
request its text. A row whose request ended (EOS, max tokens, a stop string)
or whose client went away leaves at the next block boundary, and its caches
go to the prompt cache. MLX work stays on this thread; each :class:`Job`
hands what it produces to the HTTP side through an asyncio queue of its own.
No HTTP here.

A fault while handling one request's text fails that request alone; any
other fault fails the requests in flight and the thread goes on serving. If
the thread ends anyway, :attr:`Scheduler.fault` says why, every request it
held is failed and :meth:`Scheduler.submit` refuses new ones.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..loop.batch_policy import BatchPlanner, CostTable
from ..loop.engine import Engine
from ..loop.events import Step
from ..session import Session
from ..session.alone import compare_alone
from ..session.batch import measure_costs
from ..loop.flights import Flight, Flights, State
from .lockstep import HEARTBEAT_S, Fresh, Leave, Lockstep, Open, fatal, follow
from ..session.setup import MemoryLimitError
from ..session.reply import Piece, Reply

log = logging.getLogger("specdec.serve")
# Seconds without a completed pass, under ranks, after which /health says the ranks stalled (past a prefill
# chunk's allowance, Watchdog.waited; an idle server passes every HEARTBEAT_S).
STALLED_S = 5.0


@dataclass
class Done:
    """The reply ran to its end (or was cut by a stop string)."""

    reply: Reply


@dataclass
class Failed:
    """The reply raised; ``error`` is what it raised."""

    error: BaseException


class Busy(Exception):
    """The queue is full, or the server is shutting down."""


@dataclass(eq=False)
class Job:
    """A reply to run, and the channel its pieces go back on.

    Args:
        make: Builds the :class:`Reply` on the generation thread.
        loop: The event loop of the HTTP side.
    """

    make: Callable[[], Reply]
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop this job at the next block boundary or prefill chunk (or skip it if it has not started)."""
        self.cancelled.set()

    def send(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is going away
            self.cancelled.set()


@dataclass(eq=False)
class _Ask:
    """The server's side of one request in flight: the client's job, the reply it is sent, its flight's id."""

    job: Job
    reply: Reply
    id: int = 0


class Scheduler:
    """The generation thread, its engine and its queue.

    Args:
        session: The loaded session (models, drafter kind, prompt cache).
        max_rows: Requests decoding together (``--decode-concurrency``).
        max_queue: Requests that may wait beyond those; past it :meth:`submit` raises :class:`Busy`.
    """

    def __init__(self, session: Session, max_rows: int = 4, max_queue: int = 16):
        if max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        self.session = session
        self.max_rows = max_rows
        # The batch planner's forward costs by rows x tokens, measured once (see prepare).
        self._costs: Optional[CostTable] = None
        self.max_queue = max_queue
        # Bounded by submit (rows not yet filled count as room), not by the queue: a burst arrives faster
        # than the generation thread, busy with a block, takes requests into free rows.
        self._jobs: queue.Queue[Optional[Job]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="specdec-generation", daemon=True)
        self._stopping = threading.Event()
        # The requests in flight and their engine (built on the generation thread); each flight's tag is an _Ask.
        self._rows: Optional[Flights] = None
        # A request taken from the queue that waits for memory (rows to finish) before it is opened.
        self._held: Optional[tuple[Job, Reply]] = None
        # A request taken from the queue and not yet opened, held or dropped (submit counts it as waiting).
        self._in_hand: Optional[Job] = None
        # Why the thread ended though nobody stopped it (None: it runs, or it was stopped).
        self.fault: Optional[BaseException] = None
        # Opens and leaves: done at once in one process, sent to every rank once per pass under mlx.launch.
        self._steps = Lockstep(session.ranks)
        # Under ranks: requests decided to open at the next pass, and flights decided to leave at it.
        self._asks: dict[int, _Ask] = {}
        self._leaving: set[Flight] = set()

    def start(self) -> None:
        self._thread.start()

    # -- what the HTTP side sees -------------------------------------------------------------------

    @property
    def _flights(self) -> list[Flight]:
        """The requests in flight (under ranks, not those decided to leave at the next pass)."""
        return [] if self._rows is None else [f for f in self._rows.flights if f not in self._leaving]

    @property
    def engine(self) -> Optional[Engine]:
        return None if self._rows is None else self._rows.engine

    @property
    def waiting(self) -> int:
        """Requests queued, not yet started (one held for memory, and one being opened, included)."""
        hand = self._in_hand
        # Once opened it is in flight (running) until the thread lets it go: never counted twice.
        opening = hand is not None and not any(f.tag.job is hand for f in self._flights)
        return self._jobs.qsize() + (self._held is not None) + opening

    @property
    def running(self) -> int:
        """Requests in flight (prefilling or decoding)."""
        return len(self._flights)

    @property
    def decoding(self) -> int:
        """Rows in the engine."""
        return len(self._rows.decoding) if self._rows is not None else 0

    def submit(self, job: Job) -> None:
        """Queue ``job``.

        Raises:
            Busy: The queue is full, or the server is shutting down.
        """
        if self.fault is not None:
            raise Busy(self.dead)
        stalled = self.stalled
        if stalled is not None:
            raise Busy(stalled)
        if self._stopping.is_set():
            raise Busy("the server is shutting down")
        held = self.running + len(self._asks) + self.waiting
        if held >= self.max_rows + self.max_queue:
            # The bound, not the queue alone: "N waiting" read past --queue-size while rows were still being filled.
            raise Busy(f"{held} requests are in hand, the most this server takes: {self.max_rows} decoding "
                       f"together (--decode-concurrency) and {self.max_queue} waiting (--queue-size)")
        self._jobs.put_nowait(job)
        if self.fault is not None:  # the thread ended while this was queued: nobody would take it
            self._drain(Busy(self.dead))

    @property
    def stalled(self) -> Optional[str]:
        """Under ranks, why no pass has completed for a while (a rank stopped answering; the watchdog ends the
        server at its deadline), else None."""
        ranks = self.session.ranks
        waited = 0.0 if ranks is None else ranks.watchdog.waited()
        if waited < STALLED_S:
            return None
        return (f"no answer from the other ranks for {waited:.0f} s (one of them stopped or lost its network): "
                f"the server ends at {ranks.watchdog.seconds:g} s")

    @property
    def dead(self) -> str:
        """What a client is told once the generation thread has ended."""
        if self.fault is not None and fatal(self.fault):
            return f"the server's ranks cannot go on together ({self.fault}): restart the server"
        return "the server's generation thread has stopped (its log says why): restart the server"

    def stop(self, timeout: float = 1.5) -> None:
        """Cancel every job (each gets a :class:`Busy` failure) and end the thread (waits up to ``timeout`` s)."""
        self._stopping.set()
        held, self._held = self._held, None
        if held is not None:
            held[0].cancel()
            held[0].send(Failed(Busy("the server is shutting down")))
        for flight in self._flights:
            flight.tag.job.cancel()
            flight.tag.job.send(Failed(Busy("the server is shutting down")))
        self._drain(Busy("the server is shutting down"))
        try:
            self._jobs.put_nowait(None)  # wakes the thread if it waits for work
        except queue.Full:
            pass
        self.wait(timeout)

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the generation thread to end (under ranks: it tells the others to stop)."""
        if self._thread.is_alive():
            self._thread.join(timeout)

    def follow(self) -> None:
        """A rank other than 0 under ``mlx.launch``: do rank 0's loop passes on this thread until it stops."""
        try:
            follow(Flights(self.session, planner=self._planner()), self.session.ranks, self.session.save_to_disk)
        finally:
            self.session.shutdown()  # this rank's disk writes, and the lookup corpus beside them

    # -- the thread ---------------------------------------------------------------------------------

    def _drain(self, error: BaseException) -> None:
        """Fail every queued job with ``error``."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.send(Failed(error))

    def _run(self) -> None:
        ended: BaseException = RuntimeError("it returned")
        ranks = self.session.ranks
        watch = ExitStack()
        try:
            if ranks is not None:
                watch.enter_context(ranks.watching())  # a rank that stops answering ends the server
            self._rows = Flights(self.session, planner=self._planner())
            while not self._stopping.is_set():
                try:
                    if not self._take_jobs():
                        break
                    self._drop_cancelled()
                    self._pass()
                    self._prefill_one()
                    if self._rows.engine.rows:
                        self._step()
                    self.session.save_to_disk()  # what finished requests left, once their answers are out
                except Exception as e:
                    self._recover(e)
        except BaseException as e:
            ended = e
            if not fatal(e):
                raise
            # Ranks lost or in disagreement: _end logs it and the server ends with its one error line, no traceback.
        finally:
            try:
                self._end(ended)
            finally:
                watch.close()

    def _pass(self) -> None:
        """Under ranks, the opens and leaves decided since the last pass: sent to every rank, then done here."""
        ops = self._steps.send()
        asks: dict[int, _Ask] = {}

        def tag(i: int) -> _Ask:
            # Taken from the asks as it is opened, and counted as waiting until it is a flight (submit's bound).
            asks[i] = self._asks.pop(i)
            self._in_hand = asks[i].job
            return asks[i]

        self._leaving.clear()
        try:
            failed = self._steps.apply(ops, self._rows, tag)
        except BaseException:
            # The ranks are lost (the thread ends): asks not yet in flight go back where _end fails them.
            flying = {id(f.tag) for f in self._rows.flights}
            self._asks.update({i: a for i, a in asks.items() if id(a) not in flying})
            raise
        finally:
            self._in_hand = None
        for op, error in failed:
            if isinstance(op, Open):
                asks[op.id].job.send(Failed(error))  # the HTTP side decides what the client sees
            else:
                log.error("%s failed: %s", type(op).__name__, error, exc_info=error)

    def _recover(self, error: Exception) -> None:
        """A fault outside any one request's handling: the requests in flight fail, the thread serves on
        (not when ranks lost or disagree with each other: the thread ends)."""
        if fatal(error):
            raise error
        log.error("generation failed between requests' blocks: %s", error, exc_info=error)
        self._fail(self._flights, error)
        if self._rows is not None:
            self._steps.add(Fresh(), self._rows)  # rows no request owns: start the engine afresh

    def _end(self, ended: BaseException) -> None:
        """The thread ends: whatever it held is failed (each stopped request was told so already)."""
        stopped = self._stopping.is_set()
        if not stopped:
            self.fault = ended
            log.critical("the generation thread stopped (%s: %s): requests fail until the server is restarted",
                         type(ended).__name__, ended)
        # Requests it held were accepted: their failure is the server's (a 500), not a busy server's.
        error = Busy("the server is shutting down") if stopped else RuntimeError(self.dead)
        held, self._held = self._held, None
        if held is not None:
            held[0].send(Failed(error))
        for flight in self._flights:
            try:
                self._leave(flight, keep=False)
            except Exception:
                pass  # it is out of flight already (Flights.leave takes it off first); the thread is ending
            if not stopped:
                flight.tag.job.send(Failed(error))
        for ask in self._asks.values():
            ask.job.send(Failed(error))
        self._asks.clear()
        self._drain(error)
        if self._rows is not None:
            try:
                if stopped:
                    # Under ranks every rank ends with this pass, once it has done the leaves still queued.
                    self._steps.apply(self._steps.send(stop=True), self._rows)
                    self.session.save_to_disk()
            finally:
                self._rows.close()

    def prepare(self) -> Optional[CostTable]:
        """Measure the batch planner's forward costs now, before the first request (start-up), so that
        no request's time pays for them; returns them (None: no planner runs here)."""
        if not self._plans():
            return None
        if self._costs is None:
            self._costs = measure_costs(self.session, self.max_rows)
        return self._costs

    def _plans(self) -> bool:
        """Whether rows share blocks with drafts to weigh (several rows, a drafter, drafts per block)."""
        session = self.session
        return self.max_rows > 1 and not session.plain and session.block_size > 1

    def _planner(self) -> Optional[BatchPlanner]:
        """Weighs a batch's drafts against its forward's cost (measured by :meth:`prepare`, else when rows
        first share a block)."""
        if not self._plans():
            return None

        def measure() -> CostTable:
            if self._costs is None:
                start = time.perf_counter()
                self.prepare()
                log.info("measured the model's forward for %d cells of rows x tokens in %.1f s",
                         len(self._costs.cells), time.perf_counter() - start)
            return self._costs

        return BatchPlanner(measure)

    def _take_jobs(self) -> bool:
        """Start waiting jobs while rows and memory are free; wait for one when nothing runs. False: stop."""
        try:
            return self._take()
        finally:
            self._in_hand = None

    def _take(self) -> bool:
        while len(self._flights) + len(self._asks) < self.max_rows:
            self._in_hand = None
            if self._held is not None:
                job, reply = self._held
                self._in_hand, self._held = job, None
            else:
                try:
                    # Under ranks an idle pass still goes out now and then: the ranks' heartbeat.
                    idle = not self._flights and not self._asks and not self._steps.queued
                    job = self._jobs.get(block=idle, timeout=HEARTBEAT_S if self.session.ranks else None)
                except queue.Empty:
                    return True
                if job is None or self._stopping.is_set():
                    return False
                self._in_hand = job
                reply = None
            if job.cancelled.is_set():
                log.info("skipped a queued request whose client went away")
                continue
            try:
                reply = reply or job.make()
            except Exception as e:  # the HTTP side decides what the client sees
                job.send(Failed(e))
                continue
            try:
                fits = self._fits(reply)
            except Exception as e:
                job.send(Failed(e))
                continue
            if not fits:
                self._held = (job, reply)  # its turn comes when rows have finished
                return True
            self._open(job, reply)
        return True

    def _fits(self, reply: Reply) -> bool:
        """Whether the rows in flight and this one fit the device's memory (each alone was checked when it came).

        A batch holds every row at the longest row's length, so the check is for that many tokens per row.
        """
        if not self._flights and not self._asks:
            return True
        requests = [f.request for f in self._flights] + [a.reply.request for a in self._asks.values()] \
            + [reply.request]
        longest = max(len(r.prompt_ids) + r.max_tokens for r in requests)
        try:
            self.session.setup.check_memory(longest * len(requests))
        except MemoryLimitError:
            return False
        return True

    def _open(self, job: Job, reply: Reply) -> None:
        """Open the request now (one process), or at the next pass (under ranks: on every rank alike)."""
        ask = _Ask(job, reply, self._steps.new_id())
        if self.session.ranks is not None:
            self._asks[ask.id] = ask
        try:
            failed = self._steps.add(Open(ask.id, reply.request), self._rows, lambda _: ask)
        except BaseException as e:
            job.send(Failed(e))
            raise
        for _, error in failed:  # the HTTP side decides what the client sees
            job.send(Failed(error))

    def _drop_cancelled(self) -> None:
        for flight in [f for f in self._flights if f.tag.job.cancelled.is_set()]:
            if flight.state is State.PREFILLING:
                log.info("request cancelled during prefill")
            else:
                log.info("cancelled after %d tokens", flight.tag.reply.stats.generated)
            self._leave(flight)

    def _prefill_one(self) -> None:
        """One prefill chunk of the oldest request still prefilling; admitted to the engine once done.

        Requests that arrived together with short prompts are prefilled in one forward of them all
        (``Flights.together``): a burst's first tokens come after one forward, not one per request.
        """
        group = self._rows.next_prefill()
        try:
            for flight in self._rows.prefill_step(group):
                flight.tag.reply.take(flight.opening.prefilled)
        except Exception as e:
            if fatal(e):
                raise
            self._fail([f for f in group if f.state is not State.FINISHED], e)

    def _step(self) -> None:
        try:
            self._rows.engine.prepare()  # a batch's first block measures forward costs: not the requests' time
            start = time.perf_counter()
            blocks = self._rows.step()
        except Exception as e:
            if fatal(e):
                raise
            # The engine restored every row to its state before the block; the requests cannot go on.
            self._fail([f for f in self._rows.decoding if f not in self._leaving], e)
            # Rows no request owns (one could not leave): start the engine afresh.
            self._steps.add(Fresh(), self._rows)
            return
        seconds = time.perf_counter() - start
        if log.isEnabledFor(logging.DEBUG):
            log.debug("block: %d rows x %d tokens in %.0f ms, %d committed", len(blocks),
                      max(b.verify_len for _, b in blocks), 1000 * seconds,
                      sum(len(b.tokens) for _, b in blocks))
        for flight, block in blocks:
            ask = flight.tag
            try:
                piece = ask.reply.take(Step(block, seconds))
                if piece:
                    ask.job.send(piece)
                if ask.reply.stopped or flight.ended:
                    self._finish(flight)
            except Exception as e:  # this request's text or its end: it fails alone, the others go on
                self._fail([flight], e)

    def _finish(self, flight: Flight) -> None:
        self._leave(flight)
        ask = flight.tag
        piece = ask.reply.end()
        if piece:
            ask.job.send(piece)
        if ask.reply.compare:
            self._compare(ask.reply)
        ask.job.send(Done(ask.reply))
        log.info(_line(ask.reply))

    def _compare(self, reply: Reply) -> None:
        """The answer against its request decoded alone (``compare_alone``): here, on this thread, while the
        other rows wait (a check asked for, not a way to serve)."""
        start = time.perf_counter()
        try:
            reply.comparison = compare_alone(self.session, reply.request, reply.tokens, reply.stats,
                                             batched=self.max_rows > 1, cut=reply.stop_string is not None)
        except ValueError as e:
            reply.compare_error = str(e)
            return
        log.info("compare_alone: %s (%d tokens, %.1f s)", reply.comparison.verdict, len(reply.tokens),
                 time.perf_counter() - start)

    def _fail(self, flights: list[Flight], error: Exception) -> None:
        for flight in flights:
            if flight in self._flights:  # it may have left already (a fault as it finished)
                try:
                    self._leave(flight, keep=False)
                except Exception as e:  # out of flight already; the next _step (or _recover) starts a fresh engine
                    log.error("a failed request's row could not leave the engine: %s", e, exc_info=e)
            flight.tag.job.send(Failed(error))

    def _leave(self, flight: Flight, keep: bool = True) -> None:
        """Take a request out of flight (under ranks: at the next pass, on every rank); its caches go to the prompt
        cache when they are consistent."""
        ask = flight.tag
        if self.session.ranks is not None:
            self._leaving.add(flight)  # until the next pass: it holds its hit's entry until then
        for _, error in self._steps.add(Leave(ask.id, keep, tuple(ask.reply.committed)), self._rows):
            raise error


def _line(reply: Reply) -> str:
    """One log line per request."""
    st = reply.stats
    drafted = f"acceptance {100 * st.acceptance:.0f}% ({st.accepted}/{st.drafted})" if st.drafted else "nothing drafted"
    disk = f", {st.disk_tokens} of them from disk" if st.disk_tokens else ""
    return (f"{st.prompt_tokens} prompt tokens ({st.cached_tokens} cached{disk}, {st.prompt_tps:.0f} tok/s), "
            f"{st.generated} generated at {st.decode_tps:.1f} tok/s, {drafted}, {st.tokens_per_block:.2f} "
            f"tokens/block, finish {reply.finish_reason}")


__all__ = ["Busy", "Done", "Failed", "Job", "Piece", "Scheduler"]
