"""Several processes, one target: MLX's distributed engine under ``mlx.launch``.

Every rank runs the same command. The target is sharded with mlx-lm's own
``shard()`` (tensor parallel, the default) or ``model.pipeline()`` (pipeline
parallel); every rank holds the whole drafter and runs the same engine loop.
Whatever a rank decides must therefore be what every rank decides:

- **each block**, one small collective rides the block's existing host sync:
  every rank's accepted length and next token, a checksum of the tokens it
  fed the target and where (:meth:`Ranks.propose`, then :meth:`Ranks.settle`).
  Rank 0's decision is committed by every rank; ranks that fed the target
  different tokens raise instead of going on with different text. How a
  token was drawn does not matter: the committed tokens themselves are agreed;
- **what a rank measures for itself** (the clock that steers the adaptive
  draft length, prefill chunk sizes, ``--rollback auto``'s pick, a seed drawn
  when none was given) is rank 0's, shared (:meth:`Ranks.clock`, :meth:`Ranks.share`);
- **at start-up** a handshake refuses ranks that run different options,
  versions, models, drafters or prompts (:meth:`Ranks.handshake`).

A peer that dies: MLX's ring backend, when a peer process exits (its sockets
close), prints about ten lines of its own (``[ring] Socket N was closed by the
peer``, or ``Sending to socket N failed with errno 32``, then ``Too many
send/recv errors``) and raises ``RuntimeError: [ring] connection to a peer was
lost`` within milliseconds (measured on localhost, SIGKILL and exit alike). A peer that stops answering without closing its
sockets (stopped, or a machine gone from the network) blocks the others in
the collective forever, while Python threads keep running. So: the known
noise lines are filtered from stderr, the error becomes one line
(:func:`peer_errors`), and a watchdog thread ends a rank with one line when
no agreement has completed for ``deadline`` seconds during a generation
(:class:`Watchdog`); every evaluation in between is kept short (prefill
chunks sized to ~0.5 s, one verify per block).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib
import io
import os
import pickle
import pkgutil
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..errors import OptionError, SpecdecError, UnsupportedModelError
from . import uneven

# Seconds without a completed agreement, during a generation, after which a
# rank gives up on the others (the bound is 30 s from a peer's death).
DEADLINE_S = 20.0
DEADLINE_ENV = "SPECDEC_DISTRIBUTED_TIMEOUT"
# A prefill chunk may take longer than the deadline (a long chunk of a large model): it is allowed this many
# times its expected time on top, from the slowest recent chunk's seconds per token. A process's first chunk
# is at most FIRST_CHUNK tokens, so that the rate is measured before a long one is allowed for.
CHUNK_MARGIN = 4.0
FIRST_CHUNK = 128
MODES = ("tensor", "pipeline")
# Config keys holding head counts that tensor parallelism splits over the ranks.
HEAD_KEYS = ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
             "n_heads", "n_kv_heads", "num_heads")
# What MLX's ring backend prints on its own when a peer's sockets close.
_NOISE = re.compile(rb"^\[ring\] (Socket \d+ was closed by the peer|(Receiving from|Sending to) socket \d+ failed "
                    rb"with errno \d+|Too many send/recv errors)")
_PEER_ERROR = re.compile(r"^\[(ring|jaccl|nccl|mpi)\]", re.IGNORECASE)
# Bytes of the one collective that carries a small broadcast whole (see Ranks.broadcast).
BROADCAST_HEAD = 1024
# Knuth's multiplicative constant: position weights of the token checksum.
_MIX = 2654435761


class DistributedError(SpecdecError):
    """Ranks that cannot go on together."""


class RanksDisagree(DistributedError):
    """Ranks run different things, or fed the target different tokens; every rank sees it at once."""

    every_rank = True


class PeerLost(DistributedError):
    """Another rank stopped: its connection closed."""


class ShardingRefused(UnsupportedModelError):
    """mlx-lm cannot shard this model the asked way over this many ranks."""


def deadline() -> float:
    """The watchdog's deadline: ``SPECDEC_DISTRIBUTED_TIMEOUT`` seconds, else 20."""
    try:
        value = float(os.environ.get(DEADLINE_ENV, DEADLINE_S))
    except ValueError:
        value = DEADLINE_S
    return value if value > 0 else DEADLINE_S


def backend_name(env=None) -> str:
    """Which MLX backend ``mlx.launch`` set up, read from the variables it exports."""
    env = os.environ if env is None else env
    if env.get("MLX_JACCL_COORDINATOR") or env.get("MLX_IBV_DEVICES"):
        return "jaccl"
    if env.get("NCCL_HOST_IP"):
        return "nccl"
    if env.get("OMPI_COMM_WORLD_SIZE") or env.get("PMI_SIZE"):
        return "mpi"
    if env.get("MLX_HOSTFILE"):
        return "ring"
    return "unknown"


def checksum(tokens: mx.array) -> mx.array:
    """A position-weighted hash of a token array, as a lazy int32 scalar (wraps mod 2**32)."""
    t = tokens.reshape(-1).astype(mx.uint32)
    weights = mx.arange(1, t.shape[0] + 1, dtype=mx.uint32) * mx.array(_MIX, dtype=mx.uint32)
    return (mx.sum((t + 1) * weights) % (1 << 31)).astype(mx.int32)


def _hash32(value: Any) -> int:
    data = value if isinstance(value, bytes) else repr(value).encode()
    return int.from_bytes(hashlib.sha256(data).digest()[:4], "little") & 0x7FFFFFFF


class Watchdog:
    """Ends the process with one line when, while armed, no agreement completes for ``deadline`` seconds.

    Python threads keep running while the main thread waits inside a
    collective, so a thread can see that it has waited too long; it writes
    straight to the process's real stderr and exits without unwinding (the
    main thread is stuck in MLX and cannot).
    """

    def __init__(self, rank: int, seconds: float, fd: int):
        self.rank, self.seconds, self.fd = rank, seconds, fd
        self._depth = 0
        self._last = time.monotonic()
        self._extra = 0.0  # the running chunk's allowance, until the next agreement
        self._chunk: Optional[tuple[float, int]] = None  # (start, tokens) of a chunk not yet timed
        self.rate: Optional[float] = None  # seconds per prefill token, the slowest recent chunk's
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def tick(self) -> None:
        """An agreement completed: the other ranks are there (and a chunk started before it has ended)."""
        now = time.monotonic()
        if self._chunk is not None:
            start, tokens = self._chunk
            # Falls by half at most per chunk timed: one slow chunk does not set the allowance for good.
            self.rate = max((now - start) / tokens, (self.rate or 0.0) / 2)
            self._chunk = None
        self._last, self._extra = now, 0.0

    def chunk(self, tokens: int) -> None:
        """A prefill chunk of ``tokens`` starts: allowed its expected time on top of the deadline, until the
        next agreement (which also times it)."""
        self._extra = CHUNK_MARGIN * tokens * self.rate if self.rate is not None else 0.0
        self._chunk = (time.monotonic(), tokens)

    def waited(self) -> float:
        """Seconds since the last agreement, beyond what a running chunk is allowed, while armed (0 when not
        armed)."""
        return max(0.0, time.monotonic() - self._last - self._extra) if self._depth else 0.0

    @contextmanager
    def armed(self) -> Iterator[None]:
        """Watch while inside (nests)."""
        with self._lock:
            if self._depth == 0:
                self._last = time.monotonic()
            self._depth += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="specdec-watchdog", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.seconds / 4))
            if self.waited() > self.seconds:
                line = (f"error: rank {self.rank}: no answer from the other ranks for {self.seconds:g} s (one of "
                        "them stopped or lost its network): giving up\n")
                try:
                    os.write(self.fd, line.encode())
                finally:
                    os._exit(1)


@dataclass
class Ranks:
    """This process's place among the ranks, and the agreements every rank makes.

    Attributes:
        group: MLX's distributed group (every rank).
        mode: ``tensor`` or ``pipeline``.
        backend: ``ring``, ``jaccl``, ``nccl``, ``mpi`` (or ``unknown``).
        overridden: Blocks where this rank's own decision differed from rank 0's
            (its logits differed: rounding on other hardware); rank 0's was committed.
    """

    group: Any
    mode: str = "tensor"
    backend: str = "unknown"
    overridden: int = 0
    watchdog: Optional[Watchdog] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.watchdog is None:
            self.watchdog = Watchdog(self.rank, deadline(), _real_stderr())

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def primary(self) -> bool:
        """Rank 0: the one that writes the text, the summary and the JSON."""
        return self.rank == 0

    def describe(self) -> dict:
        """For ``--json``."""
        return {"ranks": self.size, "mode": self.mode, "backend": self.backend}

    @property
    def line(self) -> str:
        """For the summary."""
        return (f"Distributed: {self.size} ranks, {self.mode} parallel, MLX {self.backend} backend (every block's "
                "tokens agreed by all ranks)")

    # -- agreements ------------------------------------------------------------------------

    def gather(self, row: mx.array) -> mx.array:
        """Every rank's int32 ``row``, as a lazy ``[ranks, len]`` table: one all_sum of rows zero but one's own."""
        row = row.reshape(1, -1).astype(mx.int32)
        m = row.shape[1]
        parts = [mx.zeros((self.rank, m), dtype=mx.int32), row,
                 mx.zeros((self.size - self.rank - 1, m), dtype=mx.int32)]
        return mx.distributed.all_sum(mx.concatenate([p for p in parts if p.shape[0]]), group=self.group)

    def propose(self, decision: mx.array, fed: mx.array, position: int) -> mx.array:
        """This rank's decision after a target forward, with what it fed the target, from every rank (lazy).

        Args:
            decision: Integers this rank decided (accepted length, next token).
            fed: The tokens it fed the target in that forward.
            position: Where it fed them (the target's cache length before the forward, or a row's tokens so far).
        """
        return self.propose_rows([(decision, fed, position)])

    def propose_rows(self, rows: Sequence[tuple[mx.array, mx.array, int]]) -> mx.array:
        """:meth:`propose` for several rows of one forward in one collective: each row's ``(decision, fed,
        position)``, every row's decision as long as the others'."""
        parts = [mx.concatenate([decision.reshape(-1).astype(mx.int32), checksum(fed).reshape(1),
                                 mx.array([position, fed.shape[0]], dtype=mx.int32)])
                 for decision, fed, position in rows]
        return self.gather(mx.concatenate(parts))

    def settle(self, table: mx.array) -> list[int]:
        """Rank 0's decision from a :meth:`propose` table (a host read).

        Raises:
            RanksDisagree: Some rank fed the target other tokens, or at
                another position (its drafts differed): every rank raises
                at the same block, none goes on with other text.
        """
        return self.settle_rows(table, 1)[0]

    def settle_rows(self, table: mx.array, n: int) -> list[list[int]]:
        """Rank 0's decision for each of the ``n`` rows of a :meth:`propose_rows` table (one host read).

        Raises:
            RanksDisagree: As :meth:`settle`, for any row.
        """
        ranks = table.tolist()
        self.watchdog.tick()
        width = len(ranks[0]) // n
        out = []
        for b in range(n):
            first = ranks[0][b * width:(b + 1) * width]
            for r, rank in enumerate(ranks[1:], 1):
                row = rank[b * width:(b + 1) * width]
                if row[-3:] != first[-3:]:
                    where = f" in row {b}" if n > 1 else ""
                    raise RanksDisagree(
                        f"rank {r} fed the target other tokens than rank 0{where} ({row[-1]} tokens at position "
                        f"{row[-2]} against {first[-1]} at {first[-2]}): their drafters disagree, so every rank "
                        "stops here instead of going on with different text"
                    )
                if row[:-3] != first[:-3]:
                    self.overridden += 1
            out.append(first[:-3])
        return out

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (others pass nothing); pickled, so only between ranks that trust rank 0.

        One collective of ``BROADCAST_HEAD`` bytes carries a small object whole (a server's loop pass); a
        larger one takes a second for the rest.
        """
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.primary else b""
        head = np.zeros(BROADCAST_HEAD, dtype=np.uint8)
        if self.primary:
            head[:4] = np.frombuffer(len(data).to_bytes(4, "little"), dtype=np.uint8)
            first = data[:BROADCAST_HEAD - 4]
            head[4:4 + len(first)] = np.frombuffer(first, dtype=np.uint8)
        got = np.array(mx.distributed.all_sum(mx.array(head), group=self.group))
        self.watchdog.tick()
        n = int.from_bytes(got[:4].tobytes(), "little")
        body = got[4:4 + min(n, BROADCAST_HEAD - 4)].tobytes()
        if n > len(body):
            rest = np.zeros(n - len(body), dtype=np.uint8)
            if self.primary:
                rest[:] = np.frombuffer(data[len(body):], dtype=np.uint8)
            body += np.array(mx.distributed.all_sum(mx.array(rest), group=self.group)).tobytes()
            self.watchdog.tick()
        return obj if self.primary else pickle.loads(body)

    def share(self, values: Sequence[int]) -> list[int]:
        """Rank 0's int32 ``values`` on every rank (each rank passes as many); a host sync."""
        x = mx.array(list(values), dtype=mx.int32)
        if not self.primary:
            x = mx.zeros_like(x)
        out = mx.distributed.all_sum(x, group=self.group).tolist()
        self.watchdog.tick()
        return out

    def same(self, value: int) -> bool:
        """Whether every rank passed the same int32 ``value`` (one collective)."""
        rows = self.gather(mx.array([value], dtype=mx.int32)).tolist()
        self.watchdog.tick()
        return all(row == rows[0] for row in rows)

    def flags(self, flag: bool) -> list[bool]:
        """Every rank's ``flag``, in rank order (one collective)."""
        rows = self.gather(mx.array([int(flag)], dtype=mx.int32)).tolist()
        self.watchdog.tick()
        return [bool(row[0]) for row in rows]

    def share_one(self, value: int) -> int:
        """Rank 0's ``value``."""
        return self.share([value])[0]

    def prefill_chunk(self, tokens: int) -> int:
        """Rank 0's size for the next prefill chunk (its first in this process at most ``FIRST_CHUNK``), which
        the watchdog then allows for: a long chunk is not a rank that stopped answering."""
        if self.primary and self.watchdog.rate is None:
            tokens = min(tokens, FIRST_CHUNK)
        tokens = self.share_one(tokens)
        self.watchdog.chunk(tokens)
        return tokens

    def clock(self, seconds: float) -> float:
        """Rank 0's measured ``seconds``, so that time-steered decisions are the same on every rank."""
        x = mx.array([seconds if self.primary else 0.0], dtype=mx.float32)
        out = mx.distributed.all_sum(x, group=self.group).item()
        self.watchdog.tick()
        return out

    def share_lists(self, lists: Sequence[Sequence[int]]) -> list[list[int]]:
        """Rank 0's lists of ints on every rank (a :meth:`broadcast`; what other ranks pass is ignored)."""
        return self.broadcast([[int(t) for t in x] for x in lists] if self.primary else None)

    def handshake(self, parts: dict[str, Any], details: Optional[dict[str, dict[str, Any]]] = None) -> None:
        """Refuse ranks that differ in any of ``parts`` (name -> value), naming what differs.

        ``details`` breaks a part into named items (the options, by flag): when the ranks differ
        only in such parts, a second gather names the items that differ ("the options (--model)").

        Raises:
            RanksDisagree: On every rank alike.
        """
        details = details or {}
        names = list(parts)
        # Each detailed part's item names too: a second gather needs rows of one length on every rank.
        keyed = [n for n in names if n in details]
        row = [_hash32(parts[n]) for n in names] + [_hash32(sorted(details[n])) for n in keyed]
        rows = self.gather(mx.array(row, dtype=mx.int32)).tolist()
        self.watchdog.tick()
        for r, other in enumerate(rows[1:], 1):
            differ = [n for n, a, b in zip(names, rows[0], other) if a != b]
            if not differ:
                continue
            # Every rank reads the same table, so every rank takes this second gather or none does.
            same_items = all(t[len(names):] == rows[0][len(names):] for t in rows)
            if same_items and all(n in details for n in differ):
                differ = self._name_items(r, differ, details)
            raise RanksDisagree(
                f"rank {r} and rank 0 disagree on the {' and '.join(differ)}: every rank must run the same "
                "command on the same files, with the same specdec, MLX and mlx-lm versions"
            )

    def _name_items(self, r: int, differ: list[str], details: dict[str, dict[str, Any]]) -> list[str]:
        """``differ``'s parts, each with the items in which rank ``r`` differs from rank 0 (one more gather)."""
        items = [(n, k) for n in differ for k in sorted(details[n])]
        rows = self.gather(mx.array([_hash32(details[n][k]) for n, k in items], dtype=mx.int32)).tolist()
        self.watchdog.tick()
        named = []
        for n in differ:
            keys = [k for (part, k), a, b in zip(items, rows[0], rows[r]) if part == n and a != b]
            named.append(f"{n} ({', '.join(keys)})" if keys else n)
        return named

    def tick(self) -> None:
        """Progress without an agreement (a long loop of local evaluations)."""
        self.watchdog.tick()

    def watching(self):
        """Arm the watchdog inside (see :class:`Watchdog`)."""
        return self.watchdog.armed()


# --- the process's ranks ----------------------------------------------------------------------

_WORLD: Any = None
_CURRENT: Optional[Ranks] = None
_STDERR_FD: Optional[int] = None
# Set on a rank but 0 that left its error for rank 0 to report: it exits after rank 0.
_LEFT_TO_RANK_0 = False


def world():
    """MLX's global group, initialised once per process (size 1 outside ``mlx.launch``)."""
    global _WORLD
    if _WORLD is None:
        try:
            _WORLD = mx.distributed.init()
        except RuntimeError as e:
            if "bind" not in str(e):
                raise
            raise DistributedError(f"MLX's distributed backend could not take its port ({e}): another process holds "
                                   "it; give mlx.launch another --starting-port, or another port in the hostfile") \
                from None
    return _WORLD


def join(pipeline: bool = False) -> Optional[Ranks]:
    """This process's :class:`Ranks`, or None when it runs alone.

    Raises:
        OptionError: ``--pipeline`` in a single process.
    """
    global _CURRENT
    group = world()
    if group.size() == 1:
        if pipeline:
            raise OptionError("--pipeline splits the target over several processes: start them with mlx.launch, "
                              "e.g. mlx.launch --backend ring -n 2 -- specdec generate --pipeline ...")
        _CURRENT = None
        return None
    backend = backend_name()
    if backend == "ring":
        _filter_ring_noise()
    _watch_parent()
    previous = _CURRENT
    ranks = Ranks(group, "pipeline" if pipeline else "tensor", backend,
                  watchdog=previous.watchdog if previous is not None else None)
    _CURRENT = ranks
    return ranks


_PARENT_WATCHED = False


def _watch_parent() -> None:
    """Take a Ctrl-C when the process that started this rank (mlx.launch, or ssh's shell) goes away.

    ``mlx.launch`` ended by SIGTERM (a supervisor, ``kill``, ``timeout``) leaves its ranks running:
    a server went on serving, orphaned, on its port. Ctrl-C's path is every command's tested way
    out under ranks (a server's rank 0 stops serving and its last pass stops the others).
    """
    global _PARENT_WATCHED
    parent = os.getppid()
    if _PARENT_WATCHED or parent == 1:  # started by init itself (a daemon): no launcher to outlive
        return
    _PARENT_WATCHED = True

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, name="specdec-parent", daemon=True).start()


def current() -> Optional[Ranks]:
    """The ranks the last :func:`join` set up (None: a single process)."""
    return _CURRENT


def error_prefix() -> str:
    """``rank N: `` on ranks other than 0, so that merged stderr says who failed."""
    return f"rank {_CURRENT.rank}: " if _CURRENT is not None and not _CURRENT.primary else ""


def silent(error: BaseException) -> bool:
    """Whether this rank leaves ``error`` to rank 0: every rank raised it alike (options, refusals)."""
    if _CURRENT is None or _CURRENT.primary:
        return False
    return isinstance(error, KeyboardInterrupt) or bool(getattr(error, "every_rank", False))


def leave_to_rank_0() -> None:
    """Say that this rank left its error for rank 0 to report: the process will outlast rank 0's.

    See :func:`outlast_rank_0`, which the console entry point calls on the way out.
    """
    global _LEFT_TO_RANK_0
    _LEFT_TO_RANK_0 = True


def outlast_rank_0(code: int) -> None:
    """On a rank that left its error to rank 0, return only once rank 0's process has gone.

    ``mlx.launch`` (MLX 0.32) terminates every rank as soon as one exits with a non-zero code,
    so a rank that left first could cut rank 0 off before it wrote the refusal's one line, or
    make its exit code a signal's. Rank 0 runs no collective after an error every rank raised
    alike, so a collective here ends only when rank 0 exits and its connections close (MLX
    then raises). Should rank 0 never go, the process ends with ``code`` after the watchdog's
    deadline.

    Args:
        code: The exit code this process is leaving with.
    """
    ranks = _CURRENT
    if not _LEFT_TO_RANK_0 or ranks is None or ranks.primary:
        return
    ended = threading.Event()

    def give_up() -> None:
        if not ended.wait(deadline()):
            os._exit(code)

    threading.Thread(target=give_up, name="specdec-outlast", daemon=True).start()
    try:
        mx.eval(mx.distributed.all_sum(mx.zeros((1,), dtype=mx.int32), group=ranks.group))
    except Exception:  # the connection to rank 0 lost: it has gone, as awaited
        pass
    finally:
        ended.set()


def is_peer_error(error: BaseException) -> bool:
    """Whether ``error`` is a distributed backend's failure to reach a peer."""
    return _CURRENT is not None and isinstance(error, RuntimeError) and bool(_PEER_ERROR.match(str(error)))


@contextmanager
def peer_errors() -> Iterator[None]:
    """A backend's 'connection lost' becomes one line naming what happened."""
    try:
        yield
    except RuntimeError as e:
        if not is_peer_error(e):
            raise
        raise PeerLost(f"rank {_CURRENT.rank} lost its connection to the other ranks ({e}): another rank "
                       "stopped, and its own error says why") from None


def _real_stderr() -> int:
    return _STDERR_FD if _STDERR_FD is not None else sys.stderr.fileno()


def _filter_ring_noise() -> None:
    """Drop the ring backend's own lines about a closed peer from stderr (once per process).

    They are written by MLX's C++ code straight to file descriptor 2, so fd 2
    becomes a pipe that a thread copies to the real stderr, minus those lines.
    """
    global _STDERR_FD
    if _STDERR_FD is not None:
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
    except (OSError, ValueError, AttributeError):
        return
    _STDERR_FD = saved

    def pump() -> None:
        held = b""
        while True:
            try:
                data = os.read(read, 65536)
            except OSError:
                data = b""
            if not data:
                break
            held += data
            *lines, held = held.split(b"\n")
            out = b"".join(line + b"\n" for line in lines if not _NOISE.match(line))
            # A partial line that cannot be the noise goes on at once (progress bars).
            if held and not (b"[ring] ".startswith(held[:7]) and held.startswith(b"[")):
                out, held = out + held, b""
            if out:
                os.write(saved, out)
        if held and not _NOISE.match(held):
            os.write(saved, held)

    thread = threading.Thread(target=pump, name="specdec-stderr", daemon=True)
    thread.start()

    def restore() -> None:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(saved, 2)  # the pipe's last write end closes: the pump drains and ends
        thread.join(timeout=2)

    atexit.register(restore)


# --- what mlx-lm can shard ----------------------------------------------------------------------

@functools.cache
def shardable_families() -> dict[str, tuple[str, ...]]:
    """mlx-lm's model families by how they shard: ``tensor`` (``Model.shard``) and ``pipeline`` (``PipelineMixin``).

    Read from the installed mlx-lm by importing each model module (about a
    second; only when refusing).
    """
    import mlx_lm.models as models
    from mlx_lm.models.pipeline import PipelineMixin

    tensor, pipeline = [], []
    for info in pkgutil.iter_modules(models.__path__):
        try:
            with redirect_stdout(io.StringIO()):  # some modules print install hints
                module = importlib.import_module(f"mlx_lm.models.{info.name}")
        except BaseException:  # a module whose optional dependency is missing
            continue
        model = getattr(module, "Model", None)
        if model is None:
            continue
        if hasattr(model, "shard"):
            tensor.append(info.name)
        if any(isinstance(c, type) and issubclass(c, PipelineMixin) and c is not PipelineMixin
               for c in vars(module).values()):
            pipeline.append(info.name)
    return {"tensor": tuple(tensor), "pipeline": tuple(pipeline)}


def _family(config: dict) -> str:
    return str(config.get("model_type", "unknown"))


def check_heads(config: dict, size: int) -> None:
    """Refuse a rank count that does not divide the model's attention (and KV, linear-attention) heads.

    mlx-lm does not check: it divides the head counts with ``//`` and the
    first forward fails deep in attention (or, worse, runs on the wrong heads).

    Raises:
        ShardingRefused: Naming the counts and rank counts that divide them.
    """
    counts = {}
    for cfg in (config, config.get("text_config") or {}):
        for key in HEAD_KEYS:
            value = cfg.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                counts.setdefault(key, value)
    bad = {k: v for k, v in counts.items() if v % size}
    if not bad:
        return
    fits = [n for n in range(2, 17) if all(v % n == 0 for v in counts.values())]
    hint = f"use {' or '.join(map(str, fits))} ranks" if fits else "no rank count from 2 to 16 divides them all"
    have = ", ".join(f"{k} {v}" for k, v in counts.items())
    raise ShardingRefused(
        f"{size} ranks do not divide this model's heads ({have}), which tensor parallelism splits over the "
        f"ranks: {hint}" + ("" if _family(config) == "unknown" else f" ({_family(config)})")
    )


def shard(model, config: dict, ranks: Ranks) -> None:
    """Shard a lazily loaded ``model`` the way ``ranks`` ask, as mlx-lm's ``sharded_load`` does (weights unread).

    Raises:
        ShardingRefused: mlx-lm cannot shard the family that way, or not
            over this many ranks; names the families that can.
    """
    family = _family(config)
    if ranks.mode == "tensor":
        if not hasattr(model, "shard"):
            raise ShardingRefused(
                f"mlx-lm cannot shard {family} tensor-parallel (its model has no shard()); families that can: "
                f"{', '.join(shardable_families()['tensor'])}" + _other_way(family, "pipeline")
            )
        try:
            check_heads(config, ranks.size)
        except ShardingRefused as refused:
            # Whole KV heads per rank, unevenly, where the family allows it (the bundled model on 2 ranks).
            why = uneven.problem(model, config, ranks.size)
            if why is not None:
                raise ShardingRefused(f"{refused}; nor can they be split unevenly: {why}") from None
            try:
                uneven.shard(model, ranks.group)
            except (AssertionError, ValueError) as e:
                raise ShardingRefused(f"{refused}; nor can they be split unevenly ({e})") from None
            return
        try:
            model.shard(ranks.group)
        except (AssertionError, ValueError) as e:
            raise ShardingRefused(f"mlx-lm cannot shard {family} over {ranks.size} ranks ({e})") from None
        return
    if not (hasattr(model, "model") and hasattr(model.model, "pipeline")):
        raise ShardingRefused(
            f"mlx-lm cannot pipeline {family} (its model has no PipelineMixin); families that can: "
            f"{', '.join(shardable_families()['pipeline'])}" + _other_way(family, "tensor")
        )
    try:
        model.model.pipeline(ranks.group)
    except ValueError as e:
        raise ShardingRefused(f"mlx-lm cannot pipeline {family} over {ranks.size} ranks ({e})") from None


def _other_way(family: str, mode: str) -> str:
    if family in shardable_families()[mode]:
        return "; drop --pipeline for tensor parallelism" if mode == "tensor" else "; --pipeline shards it by layers"
    return ""


