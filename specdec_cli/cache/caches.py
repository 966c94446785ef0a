"""Cache layout and the rollback protocol.

Every attention layer gets a plain ``KVCache``; a sliding-window layer gets a
:class:`WindowKVCache`, which applies its window in the mask and keeps only the
window plus a bounded reach for rollbacks, so a trim is always an O(1) offset
move and memory stays O(window). Recurrent layers keep mlx-lm's
``ArraysCache``; MLX arrays are immutable, so a snapshot of one is a list of
references and costs nothing.

The protocol is three calls on :class:`ModelCache`:
``snapshot()`` before a forward, ``rollback(snap, n_keep)`` after it, and
``restore(snap)`` to undo everything since the snapshot. A forward fed with
``record="capture"`` or ``"tape"`` can instead be cut back exactly with
``rollback_recorded(snap, n_keep)`` (recurrent layers included).
"""

from __future__ import annotations

import copy
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence, runtime_checkable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    create_attention_mask,
    make_prompt_cache,
)

from ..errors import Cancelled, UnsupportedModelError
from ..model.exact import is_exact
from ..model.recurrent import RecurrentSteps, StepRecord, recurrent_steps

# How far (in tokens) a restore may go below the offset at which the latest
# forward started, unless a user of the cache asks for more (ensure_reach).
# The engine's target needs 1 (plain decoding's queued step); a draft model
# needs its draft length + 2 and asks for it. Going further raises.
DEFAULT_REACH = 4


class WindowKVCache(KVCache):
    """A sliding-window layer's cache: its window plus a bounded reach, trimmable in O(1).

    Keys live in a buffer that starts at position ``start``. The window is
    applied by the mask (built for exactly the keys the buffer returns), so
    attention sees the same unmasked keys as a full cache. When the buffer
    fills, keys no later forward can need are dropped: those more than
    ``window - 1 + reach`` positions before the offset at which the current
    forward starts. A restore may therefore go back up to ``reach`` tokens
    below the start of the latest forward; going further raises (never a
    silently wrong mask). Memory stays under ``2 * (window + reach)`` plus the
    tokens of one forward.

    Args:
        window: The layer's sliding window.
        reach: How far a restore may go below the latest forward's start offset.
    """

    def __init__(self, window: int, reach: int = DEFAULT_REACH):
        super().__init__()
        self.window = window
        self.reach = reach
        self.start = 0
        # The widest window a mask was asked for (plamo3 masks window + 1).
        self._span = window

    def _first_needed(self, offset: int) -> int:
        return max(0, offset - (self._span - 1))

    def _check(self, offset: int) -> None:
        if self.start > self._first_needed(offset):
            raise RuntimeError(
                f"sliding-window cache: offset {offset} needs keys from position {self._first_needed(offset)}, "
                f"but keys before {self.start} were dropped (rolled back further than its reach of "
                f"{self.reach} tokens; raise it with ModelCache.ensure_reach)"
            )

    def _plan(self, n: int) -> int:
        """Where the buffer will start once ``n`` new keys are written (no state change)."""
        keep_from = max(self.start, self.offset - (self._span - 1) - self.reach)
        room = self._span + self.reach
        fits = self.keys is not None and self.offset + n - self.start <= self.keys.shape[2]
        return self.start if fits and keep_from - self.start < room else keep_from

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        window = window_size or self.window
        self._span = max(self._span, window)
        self._check(self.offset)
        first = self._plan(N)
        mask = create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=window)
        # Columns of the keys this forward's buffer holds (the rest are masked anyway).
        return mask[:, first:] if first else mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._check(self.offset)
        n = keys.shape[2]
        first = self._plan(n)
        used = self.offset - self.start
        if self.keys is None or first != self.start or self.offset + n - self.start > self.keys.shape[2]:
            B, H, _, Dk = keys.shape
            Dv = values.shape[3]
            live = self.offset - first
            cap = live + n + self._span + self.reach
            new_k = mx.zeros((B, H, cap, Dk), keys.dtype)
            new_v = mx.zeros((B, H, cap, Dv), values.dtype)
            if self.keys is not None and live > 0:
                lo = first - self.start
                new_k[..., :live, :] = self.keys[..., lo:used, :]
                new_v[..., :live, :] = self.values[..., lo:used, :]
            self.keys, self.values, self.start = new_k, new_v, first
            used = live
        self.keys[..., used : used + n, :] = keys
        self.values[..., used : used + n, :] = values
        self.offset += n
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        # What this forward's attention sees (layers sharing this cache read it here too).
        end = self.offset - self.start
        return self.keys[..., :end, :], self.values[..., :end, :]

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        self._check(self.offset)
        return n

    def ensure_reach(self, reach: int) -> None:
        self.reach = max(self.reach, reach)

    @property
    def needed_from(self) -> int:
        """The first position the next forward attends to."""
        return self._first_needed(self.offset)

    def live(self, lo: int) -> tuple[mx.array, mx.array]:
        """Keys and values of positions ``lo .. offset - 1`` (``lo >= start``)."""
        if lo < self.start:
            raise ValueError(f"positions before {self.start} were dropped")
        return (self.keys[..., lo - self.start : self.offset - self.start, :],
                self.values[..., lo - self.start : self.offset - self.start, :])


class WindowQuantizedKVCache(QuantizedKVCache):
    """``--kv-bits`` for a sliding-window layer: every key kept (quantized), the window in the mask."""

    def __init__(self, window: int, group_size: int = 64, bits: int = 8):
        super().__init__(group_size=group_size, bits=bits)
        self.window = window

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        return create_attention_mask(
            N, offset=self.offset, return_array=return_array, window_size=window_size or self.window
        )


class ChunkKVCache(ChunkedKVCache):
    """mlx-lm's ``ChunkedKVCache`` (chunked attention, llama4) that keeps every key.

    The stock cache drops keys older than the chunk before each forward, so a
    drafter returning across several forwards would lose keys its chunk still
    needs. The model's chunk mask already restricts attention to the chunk:
    keeping the keys changes nothing but memory, and trims stay O(1).
    """

    def maybe_trim_front(self) -> None:
        pass


# Architectures whose multi-token forward mlx-lm computes differently from
# token-by-token decoding, so a verify forward cannot be exact.
_REFUSED = {
    "phi3small": "its block-sparse attention adds a boolean mask to the scores, so within a 32-token "
                 "block a token sees later tokens (mlx-lm phi3small.py)",
    "olmo": "its attention adds the string mask 'causal' to the scores, so any multi-token forward "
            "fails (mlx-lm olmo.py)",
}


def _to_layout(cache: Any, reach: int = DEFAULT_REACH, exact: bool = False) -> Any:
    """Replace caches that cannot trim in O(1) by equivalent plain KV caches (``exact``: a sliding window keeps
    every key, so a row's keys sit at their positions whatever holds them)."""
    if isinstance(cache, RotatingKVCache):
        if cache.keep:
            # Attention sinks + a ring: the mask alone cannot reproduce it.
            raise UnsupportedModelError(
                f"RotatingKVCache with keep={cache.keep} (attention sinks) cannot be rebuilt as a "
                "plain KVCache; run this model with mlx-lm's own generate"
            )
        return KVCache() if exact else WindowKVCache(cache.max_size, reach)
    if type(cache) is ChunkedKVCache:
        if exact:
            raise UnsupportedModelError("--exact does not cover chunked attention (llama4): run without --exact")
        return ChunkKVCache(cache.chunk_size)
    if type(cache) is ConcatenateKVCache:
        # Same contents as KVCache, but its trim leaves the tail in place.
        return KVCache()
    if isinstance(cache, CacheList):
        return CacheList(*[_to_layout(c, reach, exact) for c in cache.caches])
    return cache


# mx.quantize's supported settings (mlx-lm's --kv-bits / --kv-group-size).
KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)


def _quantized(cache: Any, bits: int, group_size: int) -> Any:
    """The quantized twin of a layout cache: per-token quantization, so a trim stays an offset move."""
    if type(cache) is KVCache:
        return QuantizedKVCache(group_size=group_size, bits=bits)
    if type(cache) is WindowKVCache:
        return WindowQuantizedKVCache(cache.window, group_size=group_size, bits=bits)
    if type(cache) is ChunkKVCache:
        raise UnsupportedModelError(
            "chunked attention (llama4) has no quantized KV cache in mlx-lm: drop --kv-bits"
        )
    if isinstance(cache, CacheList):
        return CacheList(*[_quantized(c, bits, group_size) for c in cache.caches])
    return cache  # recurrent state is not a KV cache: it stays as it is


def make_cache(model: nn.Module, reach: int = DEFAULT_REACH, kv_bits: Optional[int] = None,
               kv_group_size: int = 64) -> list[Any]:
    """Build the model's cache list in the all-KVCache layout.

    Args:
        model: The mlx-lm model.
        reach: Tokens a restore may go below the latest forward's start (sliding-window layers).
        kv_bits: Quantize every attention layer's keys and values to this many
            bits (mlx-lm's ``QuantizedKVCache``); None keeps them as computed.
        kv_group_size: Quantization group size along the head dimension.

    Raises:
        UnsupportedModelError: A layer's cache cannot be rolled back exactly.
    """
    arch = type(model).__module__.rsplit(".", 1)[-1]
    if type(model).__module__.startswith("mlx_lm.models.") and arch in _REFUSED:
        raise UnsupportedModelError(
            f"{arch} cannot be verified exactly: {_REFUSED[arch]}; run it with plain decoding (mlx_lm.generate)"
        )
    layout = [_to_layout(c, reach, is_exact(model)) for c in make_prompt_cache(model)]
    if kv_bits is not None:
        layout = [_quantized(c, kv_bits, kv_group_size) for c in layout]
    for leaf in leaves(layout):
        _kind(leaf)  # capability check: refuse before the first token
    return layout


def check_kv_quantization(model: nn.Module, bits: int, group_size: int) -> None:
    """Refuse by name a model whose attention cannot read a quantized KV cache.

    mlx-lm's attention helper handles ``QuantizedKVCache``; a family with its
    own attention code may not. One two-token forward on fresh caches tells.

    Raises:
        UnsupportedModelError: Naming the family and what failed.
    """
    arch = type(model).__module__.rsplit(".", 1)[-1]
    layout = make_cache(model, kv_bits=bits, kv_group_size=group_size)
    try:
        logits = model(mx.array([[0, 0]], dtype=mx.uint32), cache=layout)
        mx.eval(logits)
    except Exception as e:  # model code raises whatever its ops raise
        detail = " ".join(str(e).split())[:200]
        raise UnsupportedModelError(
            f"{arch} cannot run with a quantized KV cache (--kv-bits {bits} --kv-group-size {group_size}): "
            f"{detail}; drop --kv-bits or try another --kv-group-size"
        ) from None


def rebuild(structure: Sequence[Any], leaves: Sequence[Any]) -> list[Any]:
    """``structure``'s layer list (its ``CacheList`` nesting) with its leaves replaced, in order, by ``leaves``."""
    it = iter(leaves)

    def one(c: Any) -> Any:
        if isinstance(c, CacheList):
            return CacheList(*[one(x) for x in c.caches])
        return next(it)

    return [one(c) for c in structure]


def leaves(caches: Sequence[Any]) -> list[Any]:
    """The layer caches of ``caches`` in layer order, a ``CacheList``'s parts in its place."""
    out = []
    for c in caches:
        if isinstance(c, CacheList):
            out.extend(leaves(c.caches))
        else:
            out.append(c)
    return out


_ATTENTION, _RECURRENT = "attention", "recurrent"
# A prefill sized by time starts with small chunks (quick on any backend) and
# never goes below the minimum, where one forward's fixed cost would dominate.
_FIRST_TIMED_CHUNK = 32
_MIN_TIMED_CHUNK = 16


def _kind(leaf: Any) -> str:
    # Exact types (or our own subclass): a subclass of KVCache in some model
    # file could override update_and_fetch and break the offset contract.
    if type(leaf) in (KVCache, WindowKVCache, ChunkKVCache, QuantizedKVCache, WindowQuantizedKVCache):
        return _ATTENTION
    if type(leaf) is ArraysCache:
        return _RECURRENT
    raise UnsupportedModelError(
        f"this model uses a {type(leaf).__name__} layer cache, which specdec cannot roll back "
        "exactly; run it with plain decoding (mlx_lm.generate)"
    )


def cache_kinds(model: nn.Module) -> dict[str, int]:
    """Count the layer caches of each kind (``attention`` / ``recurrent``) for ``model``."""
    counts = {_ATTENTION: 0, _RECURRENT: 0}
    for leaf in leaves(make_cache(model)):
        counts[_kind(leaf)] += 1
    return counts


# Row counts each model has already run in this process (MLX compiles a
# shape's kernels once per process). Keyed by id: modules are dicts, so
# unhashable; the weak reference drops the entry with the model.
_RAN: dict[int, tuple[Callable[[], Any], set]] = {}


def _ran_shapes(model: Any) -> set:
    key = id(model)
    entry = _RAN.get(key)
    if entry is None or entry[0]() is not model:
        try:
            ref = weakref.ref(model, lambda _, k=key: _RAN.pop(k, None))
        except TypeError:  # not weakly referenceable: keep it alive
            ref = lambda m=model: m  # noqa: E731
        entry = _RAN[key] = (ref, set())
    return entry[1]


def buffer_arrays(x: Any) -> list[mx.array]:
    """A key or value buffer's arrays (a quantized one is a tuple of three; None: none)."""
    if x is None:
        return []
    return list(x) if isinstance(x, (tuple, list)) else [x]


def _view(x: Any, stop: int) -> Any:
    """Rows ``:stop`` of a key or value buffer (a quantized one is a tuple), as new array objects."""
    if x is None:
        return None
    if isinstance(x, (tuple, list)):
        return tuple(a[..., :stop, :] for a in x)
    return x[..., :stop, :]


def clone_layer(c: Any, length: int) -> Any:
    """A copy of one layer cache cut to ``length`` tokens that shares no array object with ``c``.

    MLX arrays have value semantics, but a slice assignment (how KV caches
    write) rebinds the Python object it is made on: the copy holds views (new
    objects) of the keys up to ``length`` and the references of recurrent
    arrays (replaced, never written in place). Neither side's later writes
    reach the other; the first write after a copy allocates (MLX never
    donates a buffer something else still reads). Recurrent layers cannot be
    cut: their copy is their current state.
    """
    if isinstance(c, CacheList):
        return CacheList(*[clone_layer(x, length) for x in c.caches])
    out = copy.copy(c)
    if type(c) is ArraysCache:
        out.cache = list(c.cache)
        return out
    out.offset = min(c.offset, length)
    stop = out.offset - (c.start if isinstance(c, WindowKVCache) else 0)
    out.keys, out.values = _view(c.keys, stop), _view(c.values, stop)
    return out


def mark_exact(attention: Sequence[Any]) -> None:
    """Mark an ``--exact`` model's attention layer caches: its attention computes exactly for them."""
    for leaf in attention:
        leaf.exact = True


def fixed_position(leaf: Any) -> bool:
    """Whether a layer cache cannot go back to any shorter length (recurrent state, a window that drops keys)."""
    return type(leaf) is ArraysCache or type(leaf) is WindowKVCache


@dataclass(frozen=True)
class Snapshot:
    """The state of a :class:`ModelCache` at one point: offsets and references."""

    length: int
    offsets: tuple[int, ...]
    states: tuple[tuple[list, Any, Any], ...]


@dataclass(frozen=True)
class Checkpoint:
    """Copies, at ``length`` tokens, of the layer caches that cannot trim back to it (leaf order)."""

    length: int
    layers: tuple


@runtime_checkable
class RowCache(Protocol):
    """What the engine asks of a target's caches, one row (:class:`ModelCache`) or many
    (:class:`~specdec_cli.cache.batch_cache.BatchCache`): one protocol for both.

    ``feed_rows`` runs a forward of ``[B, T]`` tokens (a single row's cache takes B = 1) and
    returns its lazy logits ``[B, T, V]``; ``snapshot`` and ``restore`` go back exactly in O(1);
    ``settle(snap, keep)`` keeps row b's first ``keep[b]`` tokens fed since ``snap`` (attention
    trims; recurrent layers take the state a ``record``-ed forward kept). A single row's cache
    also rolls back without a record (:meth:`ModelCache.rollback`: the kept tokens fed again).
    """

    model: Any

    @property
    def recurrent(self) -> bool: ...

    @property
    def can_record(self) -> bool: ...

    def feed_rows(self, tokens: mx.array, record: Optional[str] = None) -> mx.array: ...

    def snapshot(self) -> Any: ...

    def restore(self, snap: Any) -> None: ...

    def settle(self, snap: Any, keep: Sequence[int]) -> None: ...

    def state_arrays(self) -> list[mx.array]: ...


class ModelCache:
    """One model's layer caches plus the rollback protocol.

    Args:
        model: The mlx-lm model the caches belong to.
        layers: A cache list built by :func:`make_cache` (built here if omitted).
    """

    def __init__(self, model: nn.Module, layers: list[Any] | None = None):
        self.model = model
        self.layers = make_cache(model) if layers is None else layers
        own = leaves(self.layers)
        self._attention = [c for c in own if _kind(c) == _ATTENTION]
        self._recurrent = [c for c in own if _kind(c) == _RECURRENT]
        # An --exact model's attention computes shape-invariantly for its caches (specdec_cli.model.exact),
        # and its recurrent layers take the one-token formula for the prompt too.
        self.exact = is_exact(model)
        if self.exact:
            mark_exact(self._attention)
        # Tokens consumed; pure-recurrent models have no offset to read it from.
        self.length = 0
        # Hooks on the recurrent mixers: several-token forwards after the
        # prompt use the one-token formula, and can record per-token states.
        self.steps: RecurrentSteps | None = recurrent_steps(model) if self._recurrent else None
        # The records of the last forward fed with record=..., and its length.
        self._recorded: list[StepRecord] | None = None
        # Chunk sizes of the last prefill, and the checkpoints it took at its stops.
        self.chunks: list[int] = []
        self.marks: list[Checkpoint] = []
        self._ran = _ran_shapes(model)

    @property
    def recurrent(self) -> bool:
        """True when some layer holds recurrent state (no O(1) trim)."""
        return bool(self._recurrent)

    @property
    def can_record(self) -> bool:
        """Capture and tape can roll back every recurrent layer of this model."""
        return self.steps is not None and self.steps.covered

    def ensure_reach(self, reach: int) -> None:
        """Let restores go up to ``reach`` tokens below the latest forward's start offset."""
        for c in self._attention:
            if isinstance(c, WindowKVCache):
                c.ensure_reach(reach)

    def _forward(self, tokens: mx.array, mode: str) -> mx.array:
        if self.steps is None:
            return self.model(tokens[None], cache=self.layers)
        with self.steps.forward(mode):
            logits = self.model(tokens[None], cache=self.layers)
            if mode in ("capture", "tape"):
                self._recorded = self.steps.take(self._recurrent)
        return logits

    def feed(self, tokens: mx.array, record: str | None = None) -> mx.array:
        """Run the model on ``tokens`` (1-D), updating the caches; returns lazy logits [T, V].

        Recurrent layers compute several tokens with the formula plain decoding
        uses for one (bit-identical states). With ``record`` (``capture`` or
        ``tape``) the forward can then be cut back by :meth:`rollback_recorded`.
        """
        self._recorded = None
        if record is not None and not self.can_record:
            raise ValueError(f"{record} needs recurrent-layer hooks this model lacks: {self.record_problem}")
        logits = self._forward(tokens, record or "step")
        self.length += tokens.shape[0]
        self._ran.add(tokens.shape[0])
        return logits[0]

    def feed_rows(self, tokens: mx.array, record: str | None = None) -> mx.array:
        """:meth:`feed` in the :class:`RowCache` form: ``tokens`` ``[1, T]``, logits ``[1, T, V]``."""
        if tokens.ndim != 2 or tokens.shape[0] != 1:
            raise ValueError(f"a single row's cache takes [1, T] tokens (got {tokens.shape})")
        return self.feed(tokens[0], record)[None]

    def check_verify(self, rows: int) -> None:
        """Make sure verify forwards of up to ``rows`` tokens compute what one-token decoding computes.

        The recurrent layers' several-token recurrence is checked against its
        one-token steps at every row count (see
        :meth:`~specdec_cli.model.recurrent.RecurrentSteps.check_rows`); where it differs
        the hooks compute it one token at a time.

        Raises:
            UnsupportedModelError: It differs and no hook can avoid it.
        """
        if self.steps is not None and rows > 1:
            why = self.steps.check_rows(rows)
            if why:
                raise UnsupportedModelError(why)

    @property
    def record_problem(self) -> str | None:
        """Why capture/tape cannot run here (None when they can)."""
        if not self._recurrent:
            return "the model has no recurrent layers"
        return None if self.steps is None else self.steps.problem

    def prefill(self, tokens: Sequence[int], step_size: int = 2048, tap: Any = None, *,
                seconds: Optional[float] = None, sizes: Optional[Sequence[int]] = None,
                stops: Sequence[int] = (), cancelled: Optional[Callable[[], bool]] = None,
                agree: Optional[Callable[[int], int]] = None) -> list:
        """Feed ``tokens`` in chunks, evaluating each chunk.

        Chunks are ``step_size`` tokens, unless ``seconds`` sizes them by time
        or ``sizes`` gives them. The sizes used are left in ``self.chunks``:
        the same sizes give bit-identical caches (matmul results depend on the
        row count), so a run compared with another one reuses them. A chunk
        also ends at each of ``stops`` (counts of ``tokens`` fed), where a
        :meth:`checkpoint` is left in ``self.marks`` (a prompt cache resumes
        recurrent and sliding-window layers there).

        The prompt goes through mlx-lm's own several-token path (as plain
        decoding's prefill does).

        Args:
            tokens: Token ids.
            step_size: Tokens per chunk (the most, when sized by time).
            tap: A :class:`~specdec_cli.model.taps.HiddenTap` on the model, or None.
            seconds: Aim each chunk's evaluation at about this long: the size
                adapts to the measured speed (which falls as the context
                grows), so no single evaluation keeps the host waiting long.
            sizes: Exact chunk sizes (a schedule from an earlier prefill).
            stops: Counts of ``tokens`` after which to take a :meth:`checkpoint`.
            agree: Maps this process's next chunk size to the one every rank
                uses (rank 0's), before each chunk: the ranks of a sharded
                model must run the same shapes, and time each differently.
            cancelled: Asked after each chunk; when it says True, prefill
                stops there (the caches hold the chunks fed) and raises.

        Raises:
            Cancelled: ``cancelled`` said so.

        Returns:
            With a tap, the hidden states it recorded, one evaluated part per chunk.
        """
        parts: list = []
        for _ in self.prefill_chunks(tokens, step_size, tap, parts, seconds=seconds, sizes=sizes, stops=stops,
                                     agree=agree):
            if cancelled is not None and cancelled():
                raise Cancelled(f"prefill cancelled after {sum(self.chunks)} of {len(tokens)} tokens")
        return parts

    def prefill_chunks(self, tokens: Sequence[int], step_size: int = 2048, tap: Any = None,
                       parts: Optional[list] = None, *, seconds: Optional[float] = None,
                       sizes: Optional[Sequence[int]] = None, stops: Sequence[int] = (),
                       agree: Optional[Callable[[int], int]] = None) -> Iterator[int]:
        """:meth:`prefill`, one chunk per step: yields the tokens fed so far after each chunk but the last.

        A caller can interleave other work between chunks (a server decoding
        other requests) or stop (close the generator): the caches then hold
        the chunks fed. With a tap, each chunk's hidden states go to ``parts``.
        """
        if step_size < 1:
            raise ValueError("step_size must be >= 1")
        ids = mx.array(list(tokens), dtype=mx.uint32)
        n = ids.shape[0]
        self.chunks = []
        self.marks = []
        pending = sorted({s for s in stops if 0 < s <= n})
        self._recorded = None
        size = min(step_size, _FIRST_TIMED_CHUNK) if seconds else step_size
        start = 0
        while start < n:
            if sizes is not None and len(self.chunks) < len(sizes):
                size = sizes[len(self.chunks)]
            size = max(1, min(size, n - start))
            # Rank 0's size for this chunk only (it may cap a first chunk); the schedule goes on from ``size``.
            this = size if agree is None else agree(size)
            # A stop ends this chunk early; the schedule goes on from there.
            cut = min(this, pending[0] - start) if pending else this
            t0 = time.perf_counter()
            if tap is not None:
                tap.clear()  # rows other forwards left (a server's blocks between chunks) are not this prompt's
            self._forward(ids[start : start + cut], "step" if self.exact else "off")
            self.length += cut
            extra = []
            if tap is not None:
                part = tap.take()
                if parts is not None:
                    parts.append(part)
                extra = [*part.layers, *([] if part.final is None else [part.final])]
            mx.eval(self.state_arrays(), extra)
            # Free the chunk's intermediate buffers before the next one.
            mx.clear_cache()
            elapsed = time.perf_counter() - t0
            self.chunks.append(cut)
            start += cut
            if pending and start == pending[0]:
                self.marks.append(self.checkpoint())
                pending.pop(0)
            if cut >= size and seconds and sizes is None:
                # The measured rate sets the next size, damped (x0.5 .. x2: one
                # slow chunk on a busy machine must not collapse the rest), and
                # never so small that each forward's fixed cost dominates. A
                # chunk cut short by a stop says little about the rate.
                want = size * seconds / max(elapsed, 1e-6)
                size = int(min(step_size, max(_MIN_TIMED_CHUNK, size / 2, min(want, 2 * size))))
            if start < n:
                yield start

    def checkpoint(self) -> "Checkpoint":
        """Copies of the layers that cannot go back to this length later (see :func:`fixed_position`).

        Attention layers that keep every key trim back to it anyway; the copies
        share no array object with the live caches (see :func:`clone_layer`).
        """
        return Checkpoint(self.length, tuple(clone_layer(c, self.length)
                                             for c in leaves(self.layers) if fixed_position(c)))

    def snapshot(self) -> Snapshot:
        """Record the current state in O(1) (offsets and array references)."""
        return Snapshot(
            self.length,
            tuple(c.offset for c in self._attention),
            tuple((list(c.cache), c.lengths, c.left_padding) for c in self._recurrent),
        )

    def restore(self, snap: Snapshot) -> None:
        """Return exactly to ``snap``, dropping everything fed since."""
        for c, offset in zip(self._attention, snap.offsets):
            c.trim(c.offset - offset)
            if c.offset != offset:
                raise RuntimeError(f"{type(c).__name__} could not trim back to offset {offset}")
        for c, (arrays, lengths, left_padding) in zip(self._recurrent, snap.states):
            c.cache, c.lengths, c.left_padding = list(arrays), lengths, left_padding
        self.length = snap.length
        self._recorded = None

    def rollback(self, snap: Snapshot, n_keep: int) -> bool:
        """Keep the first ``n_keep`` tokens fed since ``snap``, drop the rest.

        Attention layers trim in O(1). Recurrent state cannot be un-run: it is
        restored to ``snap`` and the caller must re-feed the kept tokens.

        Returns:
            True when the caches were restored to ``snap`` and the ``n_keep``
            tokens must be fed again; False when the cache is already exact.
        """
        fed = self.length - snap.length
        if not 0 <= n_keep <= fed:
            raise ValueError(f"cannot keep {n_keep} of {fed} tokens")
        if n_keep == fed:
            return False
        if self._recurrent:
            self.restore(snap)
            return n_keep > 0
        for c in self._attention:
            c.trim(fed - n_keep)
        self.length -= fed - n_keep
        return False

    def settle(self, snap: Snapshot, keep: Sequence[int]) -> None:
        """Keep the first ``keep[0]`` tokens fed since ``snap`` (the :class:`RowCache` form of one row).

        Attention layers trim; recurrent layers take the state the forward since ``snap``
        recorded (:meth:`rollback_recorded`), as a batch's rows do.

        Raises:
            RuntimeError: Recurrent layers, and the forward since ``snap`` was not recorded.
        """
        (n_keep,) = keep
        if self._recurrent and self.length - snap.length != n_keep:
            self.rollback_recorded(snap, n_keep)
        else:
            self.rollback(snap, n_keep)  # attention trims; a recurrent cache keeping everything has nothing to undo

    def rollback_recorded(self, snap: Snapshot, n_keep: int) -> None:
        """Keep the first ``n_keep`` tokens of the recorded forward fed since ``snap``.

        Attention layers trim; each recurrent layer takes the conv and
        recurrent state it had after token ``n_keep`` of that forward (the
        captured one, or replayed from the tape), as plain decoding would.

        Raises:
            RuntimeError: The last forward since ``snap`` was not recorded.
        """
        fed = self.length - snap.length
        if not 0 <= n_keep <= fed:
            raise ValueError(f"cannot keep {n_keep} of {fed} tokens")
        records, self._recorded = self._recorded, None
        if records is None or any(r is None or r.steps != fed for r in records):
            raise RuntimeError("rollback_recorded needs the forward since the snapshot to be fed with record=")
        if n_keep == fed:
            return
        for c in self._attention:
            c.trim(fed - n_keep)
        for c, r, (arrays, _, _) in zip(self._recurrent, records, snap.states):
            if n_keep == 0:
                c.cache = list(arrays)
            else:
                c[0], c[1] = r.conv_state(n_keep), r.state(n_keep)
        self.length = snap.length + n_keep

    def recording_bytes(self, tokens: int) -> dict[str, int]:
        """Extra bytes a recorded forward of ``tokens`` holds until its rollback, per strategy."""
        per = self.steps.bytes_per_step if self.can_record else {"capture": 0, "tape": 0}
        return {k: v * tokens for k, v in per.items()}

    @property
    def nbytes(self) -> int:
        """Bytes the layer caches hold (buffers included)."""
        return sum(a.nbytes for a in self.state_arrays())

    def warm(self, sizes: Sequence[int], head: Optional[Callable[[mx.array], Any]] = None) -> tuple[int, ...]:
        """Run each row count in ``sizes`` once on throwaway tokens, then restore.

        MLX compiles a shape's kernels the first time it runs in a process;
        this moves that cost out of whatever is timed next. The caches end
        exactly as they were (snapshot / restore). Row counts this model has
        already run in this process are skipped.

        Args:
            sizes: Row counts (forward lengths) to run.
            head: Applied to the logits inside the same evaluation (the
                token selection the real step runs after the forward).

        Returns:
            The row counts run (empty when all were warm already).
        """
        todo = sorted({t for t in sizes if t not in self._ran and t > 0}, reverse=True)
        if not todo:
            return ()
        snap = self.snapshot()
        for t in todo:
            try:
                logits = self.feed(mx.zeros((t,), dtype=mx.uint32))
                mx.eval(logits if head is None else head(logits), self.state_arrays())
            finally:
                self.restore(snap)
        return tuple(todo)

    def state_arrays(self) -> list[mx.array]:
        """Every array the caches hold (for ``mx.eval`` at a timing barrier)."""
        arrays = []
        for c in self._attention:
            if c.keys is not None:
                # A quantized cache holds (data, scales, biases) tuples.
                for x in (c.keys, c.values):
                    arrays += list(x) if isinstance(x, (tuple, list)) else [x]
        for c in self._recurrent:
            arrays += [a for a in c.cache if a is not None]
        return arrays
