"""One generation thread: jobs wait in a bounded queue and run one at a time.

MLX work stays on this thread. Each :class:`Job` hands what it produces to the
HTTP side through an asyncio queue of its own (``loop.call_soon_threadsafe``);
a job whose client went away is cancelled with :meth:`Job.cancel`, and the
thread stops its reply at the next block boundary (or prefill chunk). No HTTP
here.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..errors import Cancelled
from ..session.reply import Piece, Reply

log = logging.getLogger("specdec.serve")


@dataclass
class Done:
    """The reply ran to its end (or was cut by a stop string)."""

    reply: Reply


@dataclass
class Failed:
    """The reply raised; ``error`` is what it raised."""

    error: BaseException


class Busy(Exception):
    """The queue is full."""


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
        """Stop this job at the next block boundary (or skip it if it has not started)."""
        self.cancelled.set()

    def send(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is going away
            self.cancelled.set()


class Worker:
    """The generation thread and its queue.

    Args:
        max_queue: Jobs that may wait while one runs; past it :meth:`submit` raises :class:`Busy`.
    """

    def __init__(self, max_queue: int = 16):
        self._jobs: queue.Queue[Optional[Job]] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="specdec-generation", daemon=True)
        self.current: Optional[Job] = None
        self._stopping = threading.Event()

    def start(self) -> None:
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    def submit(self, job: Job) -> None:
        """Queue ``job``.

        Raises:
            Busy: The queue is full.
        """
        if self._stopping.is_set():
            raise Busy("the server is shutting down")
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise Busy(f"{self._jobs.maxsize} requests are already waiting") from None

    def stop(self, timeout: float = 1.5) -> None:
        """Cancel every job and end the thread (waits up to ``timeout`` seconds)."""
        self._stopping.set()
        current = self.current
        if current is not None:
            current.cancel()
            current.send(Failed(Busy("the server is shutting down")))
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.send(Failed(Busy("the server is shutting down")))
        try:
            self._jobs.put_nowait(None)
        except queue.Full:
            pass
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stopping.is_set():
            job = self._jobs.get()
            if job is None:
                break
            if job.cancelled.is_set():
                log.info("skipped a queued request whose client went away")
                continue
            self.current = job
            try:
                self._serve(job)
            finally:
                self.current = None

    def _serve(self, job: Job) -> None:
        try:
            reply = job.make()
            pieces = iter(reply)
            try:
                for piece in pieces:
                    if job.cancelled.is_set():
                        break
                    job.send(piece)
            finally:
                pieces.close()  # a cancel lands here: the session keeps its caches consistent
            if job.cancelled.is_set():
                log.info("cancelled after %d tokens", reply.stats.generated)
                return
            job.send(Done(reply))
            log.info(_line(reply))
        except Cancelled:
            log.info("request cancelled during prefill")
        except BaseException as e:  # the HTTP side decides what the client sees
            job.send(Failed(e))
            if not isinstance(e, Exception):
                raise


def _line(reply: Reply) -> str:
    """One log line per request."""
    st = reply.stats
    return (f"{st.prompt_tokens} prompt tokens ({st.cached_tokens} cached, {st.prompt_tps:.0f} tok/s), "
            f"{st.generated} generated at {st.decode_tps:.1f} tok/s, "
            f"{f'acceptance {100 * st.acceptance:.0f}% ({st.accepted}/{st.drafted})' if st.drafted else 'nothing drafted'}, {st.tokens_per_block:.2f} tokens/block, finish {reply.finish_reason}")


__all__ = ["Busy", "Done", "Failed", "Job", "Piece", "Worker"]
