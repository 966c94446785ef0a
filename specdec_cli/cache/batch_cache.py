"""The engine's caches with a row dimension: several sequences, each at its own length, in one forward.

A batch is built by merging one-row caches (:class:`~specdec_cli.cache.caches.ModelCache`,
prefilled alone, or resumed from the prompt cache), and a row leaves it as a
one-row cache again. In between, one forward of ``B x T`` tokens appends up to
``T`` positions to every row, and each row keeps its own accepted count:

- attention (and sliding-window) layers: :class:`RowsKVCache`. Row ``b``'s key
  for position ``p`` lives at column ``p`` of the buffer, so a forward writes
  row ``b``'s new keys at its own length onwards, and a row drops a rejected
  tail by moving its length back (O(1), no copy: the next forward overwrites
  the tail). RoPE positions are each row's own length, and the mask is each
  row's own (a key column up to the query's position, inside the window): no
  position holes after ragged accepts, no padding ever rolled into a row;
- recurrent layers (GatedDeltaNet, Mamba2, Mamba): mlx-lm's ``ArraysCache``
  with ``B`` rows. A verify forward records the state after every token
  (``capture``), and each row takes the one at its own kept count.

Rows shorter than the forward (fewer drafts than the longest) are padded at
the end; what the padding computes is never kept. The window of a
sliding-window layer is applied by the mask; a batch keeps every key of such
a layer (memory grows with the context, not the window, while rows share a
batch), and a row that leaves gets its window-sized cache back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache

from ..model.exact import is_exact
from .caches import DEFAULT_REACH, ModelCache, WindowKVCache, leaves, mark_exact, rebuild
from ..errors import UnsupportedModelError
from ..model.recurrent import StepRecord


class RowsKVCache:
    """One attention layer's keys and values for ``B`` rows of their own lengths.

    Args:
        window: The sliding window (applied by the mask), or None.
        span: The widest window a mask asked for (a row leaving as a
            :class:`WindowKVCache` keeps that many keys).
    """

    step = 256

    def __init__(self, window: Optional[int] = None, span: Optional[int] = None):
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.lengths: list[int] = []
        self.window = window
        self.span = span or window
        self._offset: Optional[mx.array] = None

    # -- what mlx-lm's attention reads ----------------------------------------------------------

    @property
    def offset(self) -> mx.array:
        """Each row's length, ``[B]``: the RoPE position of its next token."""
        if self._offset is None:
            self._offset = mx.array(self.lengths, dtype=mx.int32)
        return self._offset

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None) -> mx.array:
        """``[B, 1, N, S]``: row ``b``'s query ``t`` (position ``lengths[b] + t``) sees the key columns up to it."""
        window = window_size or self.window
        if window:
            self.span = max(self.span or window, window)
        queries = self.offset[:, None] + mx.arange(N, dtype=mx.int32)[None]
        keys = mx.arange(max(self.lengths) + N, dtype=mx.int32)
        mask = keys[None, None, :] <= queries[:, :, None]
        if window:
            mask = mask & (keys[None, None, :] > queries[:, :, None] - window)
        return mask[:, None]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        B, H, T, _ = keys.shape
        end = max(self.lengths) + T
        self._reserve(end, keys, values)
        first = self.lengths[0]
        if all(n == first for n in self.lengths):
            self.keys[..., first : first + T, :] = keys
            self.values[..., first : first + T, :] = values
        else:
            # Each row writes at its own length: column = position (put_along_axis: measured on this CPU
            # at 8 rows, 1.6x quicker than an advanced-index scatter).
            cols = self.offset[:, None, None, None] + mx.arange(T, dtype=mx.int32)[None, None, :, None]
            self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(cols, keys.shape), keys, axis=2)
            self.values = mx.put_along_axis(self.values, mx.broadcast_to(cols, values.shape), values, axis=2)
        self.set_lengths([n + T for n in self.lengths])
        return self.keys[..., :end, :], self.values[..., :end, :]

    def _reserve(self, end: int, keys: mx.array, values: mx.array) -> None:
        if self.keys is not None and end <= self.keys.shape[2]:
            return
        B, H, _, Dk = keys.shape
        cap = -(-end // self.step) * self.step
        new_k = mx.zeros((B, H, cap, Dk), keys.dtype)
        new_v = mx.zeros((B, H, cap, values.shape[3]), values.dtype)
        if self.keys is not None:
            have = self.keys.shape[2]
            new_k[..., :have, :] = self.keys
            new_v[..., :have, :] = self.values
        self.keys, self.values = new_k, new_v

    # -- rows -----------------------------------------------------------------------------------

    def set_lengths(self, lengths: Sequence[int]) -> None:
        self.lengths = list(lengths)
        self._offset = None

    def add(self, leaf: Any) -> None:
        """Append a one-row cache (``KVCache`` or ``WindowKVCache``) as the last row."""
        n = leaf.offset
        start = leaf.start if isinstance(leaf, WindowKVCache) else 0
        if isinstance(leaf, WindowKVCache):
            self.span = max(self.span or leaf.window, leaf._span)
        if leaf.keys is None:
            if self.keys is not None:
                self._grow_rows(None, None, 0, 0)
            self.lengths.append(n)
            self._offset = None
            return
        k = leaf.keys[..., : n - start, :]
        v = leaf.values[..., : n - start, :]
        if self.keys is None:
            cap = -(-max(n, 1) // self.step) * self.step
            B = len(self.lengths)
            self.keys = mx.zeros((B, k.shape[1], cap, k.shape[3]), k.dtype)
            self.values = mx.zeros((B, v.shape[1], cap, v.shape[3]), v.dtype)
        self._grow_rows(k, v, start, n)
        self.lengths.append(n)
        self._offset = None

    def _grow_rows(self, k: Optional[mx.array], v: Optional[mx.array], start: int, n: int) -> None:
        cap = max(self.keys.shape[2], -(-n // self.step) * self.step)
        row_k = mx.zeros((1, self.keys.shape[1], cap, self.keys.shape[3]), self.keys.dtype)
        row_v = mx.zeros((1, self.values.shape[1], cap, self.values.shape[3]), self.values.dtype)
        if k is not None:
            row_k[..., start:n, :] = k
            row_v[..., start:n, :] = v
        have = self.keys.shape[2]
        if cap > have:
            self.keys = mx.pad(self.keys, [(0, 0), (0, 0), (0, cap - have), (0, 0)])
            self.values = mx.pad(self.values, [(0, 0), (0, 0), (0, cap - have), (0, 0)])
        self.keys = mx.concatenate([self.keys, row_k])
        self.values = mx.concatenate([self.values, row_v])

    def row(self, b: int, reach: int = DEFAULT_REACH) -> Any:
        """Row ``b`` as a one-row cache: a ``KVCache``, or a ``WindowKVCache`` holding its window and reach."""
        n = self.lengths[b]
        if self.window is None:
            out = KVCache()
            start = 0
        else:
            out = WindowKVCache(self.window, reach)
            out._span = self.span or self.window
            start = max(0, n - (out._span - 1) - reach)
            out.start = start
        out.offset = n
        if self.keys is not None and n > 0:
            # Copies: the batch goes on writing its own buffer.
            out.keys = mx.array(self.keys[b : b + 1, :, start:n, :])
            out.values = mx.array(self.values[b : b + 1, :, start:n, :])
        return out

    def keep_rows(self, index: Sequence[int]) -> None:
        """Keep only the rows in ``index`` (in that order)."""
        if self.keys is not None:
            idx = mx.array(list(index), dtype=mx.int32)
            self.keys, self.values = self.keys[idx], self.values[idx]
        self.set_lengths([self.lengths[i] for i in index])

    def state_arrays(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]


def _rows_leaf(leaf: Any) -> Any:
    """An empty batch layer of the kind that holds ``leaf``'s rows."""
    if type(leaf) is KVCache:
        return RowsKVCache()
    if type(leaf) is WindowKVCache:
        return RowsKVCache(leaf.window, leaf._span)
    if type(leaf) is ArraysCache:
        return ArraysCache(len(leaf.cache))
    if "Quantized" in type(leaf).__name__:
        raise UnsupportedModelError("a quantized KV cache (--kv-bits) cannot hold several rows yet: drop --kv-bits "
                                    "to decode requests together")
    raise UnsupportedModelError(f"its {type(leaf).__name__} layer caches cannot hold several rows yet")


def _add_arrays(batch: ArraysCache, leaf: ArraysCache, rows: int) -> None:
    """Append ``leaf``'s row to a recurrent batch layer (zeros stand for a state not made yet)."""
    for i, (have, new) in enumerate(zip(batch.cache, leaf.cache)):
        if have is None and new is None:
            continue
        like = have if have is not None else new
        if have is None:
            have = mx.zeros((rows, *like.shape[1:]), like.dtype)
        if new is None:
            new = mx.zeros((1, *like.shape[1:]), like.dtype)
        batch.cache[i] = mx.concatenate([have, new])


def _with_row(now: Optional[mx.array], then: Optional[mx.array], pick: mx.array) -> Optional[mx.array]:
    """``now`` with the rows where ``pick`` is true taken from ``then`` (None stands for zeros)."""
    if now is None and then is None:
        return None
    like = now if now is not None else then
    now = mx.zeros_like(like) if now is None else now
    then = mx.zeros_like(like) if then is None else then
    return mx.where(pick.reshape(-1, *([1] * (like.ndim - 1))), then, now)


@dataclass(frozen=True)
class BatchSnapshot:
    """A batch's state at one point: each row's length, and the recurrent arrays (references)."""

    lengths: tuple[int, ...]
    states: tuple[tuple, ...]


class BatchCache:
    """A model's caches for several rows, with the engine's rollback protocol per row.

    Args:
        model: The mlx-lm model.
        first: A one-row cache (its layout gives the batch's); it becomes row 0.
    """

    def __init__(self, model: nn.Module, first: ModelCache):
        self.model = model
        self.structure = first.layers
        self._leaves = [_rows_leaf(c) for c in leaves(first.layers)]
        self.layers = rebuild(self.structure, self._leaves)
        self._attention = [c for c in self._leaves if isinstance(c, RowsKVCache)]
        self._recurrent = [c for c in self._leaves if isinstance(c, ArraysCache)]
        if is_exact(model):
            mark_exact(self._attention)
        self.steps = first.steps
        self.lengths: list[int] = []
        self._recorded: Optional[list[Optional[StepRecord]]] = None
        self.add(first)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def recurrent(self) -> bool:
        return bool(self._recurrent)

    @property
    def can_record(self) -> bool:
        return self.steps is not None and self.steps.covered

    # -- rows in and out ------------------------------------------------------------------------

    def add(self, cache: ModelCache) -> None:
        """Merge a one-row cache in as the last row (its arrays are copied)."""
        theirs = leaves(cache.layers)
        if len(theirs) != len(self._leaves) or any(type(_rows_leaf(a)) is not type(b)
                                                   for a, b in zip(theirs, self._leaves)):
            raise ValueError("a row's caches must have the batch's layout")
        for mine, leaf in zip(self._leaves, theirs):
            if isinstance(mine, RowsKVCache):
                mine.add(leaf)
            else:
                _add_arrays(mine, leaf, self.rows)
        self.lengths.append(cache.length)

    def row(self, b: int, reach: int = DEFAULT_REACH) -> ModelCache:
        """Row ``b`` as a one-row :class:`ModelCache` in the engine's layout (copied out)."""
        leaves = []
        for leaf in self._leaves:
            if isinstance(leaf, RowsKVCache):
                leaves.append(leaf.row(b, reach))
            else:
                out = ArraysCache(len(leaf.cache))
                out.cache = [None if a is None else mx.array(a[b : b + 1]) for a in leaf.cache]
                leaves.append(out)
        cache = ModelCache(self.model, rebuild(self.structure, leaves))
        cache.length = self.lengths[b]
        return cache

    def keep_rows(self, index: Sequence[int]) -> None:
        """Keep only the rows in ``index``, in that order (the others leave; their arrays are freed)."""
        index = list(index)
        for leaf in self._attention:
            leaf.keep_rows(index)
        if index:
            idx = mx.array(index, dtype=mx.int32)
            for leaf in self._recurrent:
                leaf.cache = [None if a is None else a[idx] for a in leaf.cache]
        self.lengths = [self.lengths[i] for i in index]

    # -- one forward ----------------------------------------------------------------------------

    def feed(self, tokens: mx.array, record: Optional[str] = None) -> mx.array:
        """Run the model on ``tokens`` ``[B, T]`` (rows padded at the end); returns lazy logits ``[B, T, V]``.

        Every row's length grows by ``T``; :meth:`settle` then keeps each row's own count.
        With ``record`` (``capture``), recurrent layers keep the state after every token.
        """
        self._recorded = None
        if record is not None and not self.can_record:
            raise ValueError(f"{record} needs recurrent-layer hooks this model lacks")
        if self.steps is None:
            logits = self.model(tokens, cache=self.layers)
        else:
            with self.steps.forward(record or "step"):
                logits = self.model(tokens, cache=self.layers)
                if record is not None:
                    self._recorded = self.steps.take(self._recurrent)
        T = tokens.shape[1]
        self.lengths = [n + T for n in self.lengths]
        return logits

    feed_rows = feed  # the RowCache form: its own

    def snapshot(self) -> BatchSnapshot:
        return BatchSnapshot(tuple(self.lengths), tuple(tuple(c.cache) for c in self._recurrent))

    def settle(self, snap: BatchSnapshot, keep: Sequence[int]) -> None:
        """Row ``b`` keeps the first ``keep[b]`` tokens it was fed since ``snap``; the rest are dropped.

        Attention rows move their length back (O(1)); recurrent rows take the
        state recorded after their own ``keep[b]``-th token (the forward since
        ``snap`` must have been fed with ``record="capture"``), or the
        snapshot's state when they keep nothing.
        """
        fed = [n - s for n, s in zip(self.lengths, snap.lengths)]
        if any(not 0 <= k <= f for k, f in zip(keep, fed)):
            raise ValueError(f"cannot keep {list(keep)} of {fed} tokens")
        lengths = [s + k for s, k in zip(snap.lengths, keep)]
        for leaf in self._attention:
            leaf.set_lengths(lengths)
        if self._recurrent and list(keep) != fed:
            records, self._recorded = self._recorded, None
            if records is None or any(r is None or not r.states for r in records):
                raise RuntimeError("settle needs the forward since the snapshot to be fed with record='capture'")
            for leaf, r, before in zip(self._recurrent, records, snap.states):
                # A state not made yet (None) stands for zeros, as when rows are merged.
                was = [mx.zeros_like(r.conv_state(1)) if before[0] is None else before[0],
                       mx.zeros_like(r.state(1)) if before[1] is None else before[1]]
                conv = [was[0][b : b + 1] if k == 0 else r.conv_state(k)[b : b + 1] for b, k in enumerate(keep)]
                state = [was[1][b : b + 1] if k == 0 else r.state(k)[b : b + 1] for b, k in enumerate(keep)]
                leaf.cache[0], leaf.cache[1] = mx.concatenate(conv), mx.concatenate(state)
        self._recorded = None
        self.lengths = lengths

    def restore(self, snap: BatchSnapshot) -> None:
        """Back to ``snap`` exactly (a forward interrupted before its tokens were committed)."""
        for leaf in self._attention:
            leaf.set_lengths(snap.lengths)
        for leaf, arrays in zip(self._recurrent, snap.states):
            leaf.cache = list(arrays)
        self.lengths = list(snap.lengths)
        self._recorded = None

    def restore_row(self, b: int, snap: BatchSnapshot) -> None:
        """Row ``b`` back to ``snap`` (taken since the rows last changed); the other rows stay as they are."""
        self.lengths[b] = snap.lengths[b]
        for leaf in self._attention:
            leaf.set_lengths(self.lengths)
        if self._recurrent:
            pick = mx.arange(self.rows) == b
            for leaf, arrays in zip(self._recurrent, snap.states):
                # New arrays (never in place): other snapshots hold references to these.
                leaf.cache = [_with_row(now, then, pick) for now, then in zip(leaf.cache, arrays)]
        self._recorded = None

    def state_arrays(self) -> list[mx.array]:
        arrays = [a for leaf in self._attention for a in leaf.state_arrays()]
        return arrays + [a for leaf in self._recurrent for a in leaf.cache if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state_arrays())


def prefill_rows(model: nn.Module, caches: Sequence[ModelCache], tokens: Sequence[Sequence[int]]) -> list[ModelCache]:
    """Feed each cache its own tokens in one forward of them all as rows; returns each row's caches.

    Rows are padded at the end and keep only their own tokens (attention layers trim in O(1)), so a
    row's caches hold what feeding it alone would, bit for bit where the backend's kernels compute a
    row alike in any batch (within rounding elsewhere: what :mod:`.batch_check` checks before rows
    decode together).

    Args:
        model: The model the caches belong to (no recurrent layers: their states would need recording).
        caches: One-row caches of one layout (each may already hold a prefix).
        tokens: What each is fed, at least one token each.
    """
    batch = BatchCache(model, caches[0])
    for cache in caches[1:]:
        batch.add(cache)
    if batch.recurrent:
        raise ValueError("rows with recurrent layers are prefilled one at a time")
    width = max(len(t) for t in tokens)
    xs = mx.array([list(t) + [0] * (width - len(t)) for t in tokens], dtype=mx.uint32)
    snap = batch.snapshot()
    batch.feed(xs)
    batch.settle(snap, [len(t) for t in tokens])
    mx.eval(batch.state_arrays())
    rows = [batch.row(b) for b in range(len(caches))]
    mx.eval([row.state_arrays() for row in rows])
    mx.clear_cache()  # the batch's buffers, before the rows decode
    return rows
