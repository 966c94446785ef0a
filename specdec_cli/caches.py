"""Cache layout and the rollback protocol.

Every attention layer gets a plain ``KVCache`` (sliding-window layers too:
their window is applied by the mask, so a trim is always an O(1) offset move).
Recurrent layers keep mlx-lm's ``ArraysCache``; MLX arrays are immutable, so a
snapshot of one is a list of references and costs nothing.

The protocol is three calls on :class:`ModelCache`:
``snapshot()`` before a forward, ``rollback(snap, n_keep)`` after it, and
``restore(snap)`` to undo everything since the snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    RotatingKVCache,
    create_attention_mask,
    make_prompt_cache,
)

from .errors import UnsupportedModelError


class WindowKVCache(KVCache):
    """A plain ``KVCache`` for a sliding-window layer.

    It keeps every key (so a trim is an offset move even past the window) and
    applies the window in the mask, as mlx-lm's ``RotatingKVCache`` does when a
    model does not pass its window explicitly. Memory grows with the context
    instead of being capped at the window: the price of O(1) rollback.
    """

    def __init__(self, window: int):
        super().__init__()
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


def _to_layout(cache: Any) -> Any:
    """Replace caches that cannot trim in O(1) by equivalent plain KV caches."""
    if isinstance(cache, RotatingKVCache):
        if cache.keep:
            # Attention sinks + a ring: the mask alone cannot reproduce it.
            raise UnsupportedModelError(
                f"RotatingKVCache with keep={cache.keep} (attention sinks) cannot be rebuilt as a "
                "plain KVCache; run this model with mlx-lm's own generate"
            )
        return WindowKVCache(cache.max_size)
    if type(cache) is ChunkedKVCache:
        return ChunkKVCache(cache.chunk_size)
    if type(cache) is ConcatenateKVCache:
        # Same contents as KVCache, but its trim leaves the tail in place.
        return KVCache()
    if isinstance(cache, CacheList):
        return CacheList(*[_to_layout(c) for c in cache.caches])
    return cache


def make_cache(model: nn.Module) -> list[Any]:
    """Build the model's cache list in the all-KVCache layout.

    Raises:
        UnsupportedModelError: A layer's cache cannot be rolled back exactly.
    """
    arch = type(model).__module__.rsplit(".", 1)[-1]
    if type(model).__module__.startswith("mlx_lm.models.") and arch in _REFUSED:
        raise UnsupportedModelError(
            f"{arch} cannot be verified exactly: {_REFUSED[arch]}; run it with plain decoding (mlx_lm.generate)"
        )
    layout = [_to_layout(c) for c in make_prompt_cache(model)]
    for leaf in _leaves(layout):
        _kind(leaf)  # capability check: refuse before the first token
    return layout


def _leaves(caches: Sequence[Any]) -> list[Any]:
    out = []
    for c in caches:
        if isinstance(c, CacheList):
            out.extend(_leaves(c.caches))
        else:
            out.append(c)
    return out


_ATTENTION, _RECURRENT = "attention", "recurrent"


def _kind(leaf: Any) -> str:
    # Exact types (or our own subclass): a subclass of KVCache in some model
    # file could override update_and_fetch and break the offset contract.
    if type(leaf) in (KVCache, WindowKVCache, ChunkKVCache):
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
    for leaf in _leaves(make_cache(model)):
        counts[_kind(leaf)] += 1
    return counts


@dataclass(frozen=True)
class Snapshot:
    """The state of a :class:`ModelCache` at one point: offsets and references."""

    length: int
    offsets: tuple[int, ...]
    states: tuple[tuple[list, Any, Any], ...]


class ModelCache:
    """One model's layer caches plus the rollback protocol.

    Args:
        model: The mlx-lm model the caches belong to.
        layers: A cache list built by :func:`make_cache` (built here if omitted).
    """

    def __init__(self, model: nn.Module, layers: list[Any] | None = None):
        self.model = model
        self.layers = make_cache(model) if layers is None else layers
        leaves = _leaves(self.layers)
        self._attention = [c for c in leaves if _kind(c) == _ATTENTION]
        self._recurrent = [c for c in leaves if _kind(c) == _RECURRENT]
        # Tokens consumed; pure-recurrent models have no offset to read it from.
        self.length = 0

    @property
    def recurrent(self) -> bool:
        """True when some layer holds recurrent state (no O(1) trim)."""
        return bool(self._recurrent)

    def feed(self, tokens: mx.array) -> mx.array:
        """Run the model on ``tokens`` (1-D), updating the caches; returns lazy logits [T, V]."""
        logits = self.model(tokens[None], cache=self.layers)
        self.length += tokens.shape[0]
        return logits[0]

    def prefill(self, tokens: Sequence[int], step_size: int = 2048, tap: Any = None) -> list:
        """Feed ``tokens`` in chunks of ``step_size``, evaluating each chunk.

        Args:
            tokens: Token ids.
            step_size: Tokens per chunk.
            tap: A :class:`~specdec_cli.hooks.HiddenTap` on the model, or None.

        Returns:
            With a tap, the hidden states it recorded, one evaluated part per chunk.
        """
        if step_size < 1:
            raise ValueError("step_size must be >= 1")
        ids = mx.array(list(tokens), dtype=mx.uint32)
        parts = []
        for start in range(0, ids.shape[0], step_size):
            self.feed(ids[start : start + step_size])
            extra = []
            if tap is not None:
                parts.append(tap.take())
                extra = [*parts[-1].layers, *([] if parts[-1].final is None else [parts[-1].final])]
            mx.eval(self.state_arrays(), extra)
            # Free the chunk's intermediate buffers before the next one.
            mx.clear_cache()
        return parts

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

    def state_arrays(self) -> list[mx.array]:
        """Every array the caches hold (for ``mx.eval`` at a timing barrier)."""
        arrays = []
        for c in self._attention:
            if c.keys is not None:
                arrays += [c.keys, c.values]
        for c in self._recurrent:
            arrays += [a for a in c.cache if a is not None]
        return arrays
