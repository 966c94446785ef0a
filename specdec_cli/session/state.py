"""A model's caches saved at some length, apart from the live caches, and resumed later.

A saved state shares no array object with any live cache (see
:func:`~specdec_cli.cache.caches.clone_layer`), so neither side's writes reach the
other. Attention layers that keep every key resume at any shorter length (a
trim). The others can only resume where their state was kept: recurrent
layers, and sliding-window layers once their window has moved past the keys
that length needs. Their state is kept at the end of the saved caches and at
the checkpoints taken on the way (chat-segment ends, the end of the prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..cache.caches import Checkpoint, ModelCache, WindowKVCache, buffer_arrays, leaves, clone_layer, fixed_position, rebuild


def _holds_keys_for(leaf: Any, length: int) -> bool:
    """Whether a sliding-window cache still holds every key a forward at ``length`` attends to."""
    return isinstance(leaf, WindowKVCache) and leaf.start <= max(0, length - (leaf._span - 1))


@dataclass
class SavedCache:
    """One model's caches at ``length`` tokens, plus checkpoints at shorter lengths.

    Attributes:
        length: Tokens the saved layers hold.
        layers: The saved layer caches.
        checkpoints: length -> copies of the layers that cannot trim back to it (leaf order).
    """

    length: int
    layers: list
    checkpoints: dict[int, tuple] = field(default_factory=dict)
    # The fixed-position layers at ``length``, kept when the layers themselves were taken.
    end: Optional[tuple] = None

    @classmethod
    def of(cls, cache: ModelCache, own: bool = False) -> "SavedCache":
        """Save what ``cache`` holds now.

        Args:
            cache: The live caches.
            own: ``cache`` is not used again: keep its layers as they are (no
                copies; their buffers keep their spare room for the next writes).
                Otherwise ``cache`` may go on being used: nothing is shared.
        """
        layers = list(cache.layers) if own else [clone_layer(c, cache.length) for c in cache.layers]
        return cls(cache.length, layers)

    def take(self, model) -> ModelCache:
        """The saved layers themselves as a live cache (no copy): this state is not resumed again.

        Its own end stays available as a checkpoint (:meth:`checkpoint_at`) for a later state to inherit.
        """
        self.end = tuple(clone_layer(c, self.length) for c in self.fixed)
        cache = ModelCache(model, self.layers)
        cache.length = self.length
        self.layers = []
        return cache

    @property
    def fixed(self) -> list:
        """The saved leaves that cannot trim back to any length (leaf order)."""
        return [c for c in leaves(self.layers) if fixed_position(c)]

    def add(self, checkpoint: Checkpoint) -> None:
        """Keep a checkpoint taken at a shorter length on the way to this state."""
        if self.fixed and 0 < checkpoint.length < self.length:
            self.checkpoints[checkpoint.length] = checkpoint.layers

    def can_resume(self, length: int) -> bool:
        """Whether :meth:`resume` can give the state after the first ``length`` tokens."""
        if not 0 < length <= self.length:
            return False
        if length == self.length or length in self.checkpoints:
            return True
        return all(_holds_keys_for(c, length) for c in self.fixed)

    def best(self, limit: int) -> int:
        """The longest length up to ``limit`` this state can resume at (0: none)."""
        limit = min(limit, self.length)
        if limit <= 0 or self.can_resume(limit):
            return max(limit, 0)
        # Past the last checkpoint below it, nothing shorter resumes either.
        return max((n for n in self.checkpoints if n <= limit), default=0)

    def resume(self, model, length: int) -> ModelCache:
        """A live :class:`ModelCache` for ``model`` holding the first ``length`` tokens."""
        cache = ModelCache(model, rebuild(self.layers, self._cut(length)))
        cache.length = length
        return cache

    def _cut(self, length: int) -> list:
        """Each leaf at ``length`` tokens (leaf order), sharing no array object with this state's."""
        if not self.can_resume(length):
            raise ValueError(f"this saved cache cannot resume at {length} tokens")
        kept = iter(self.checkpoints[length]) if length < self.length and length in self.checkpoints else None
        return [clone_layer(next(kept) if kept is not None and fixed_position(c) else c, length)
                for c in leaves(self.layers)]

    def prefix(self, length: int, copy: bool = True) -> "SavedCache":
        """The state after the first ``length`` tokens as a saved state of its own, checkpoints below it kept.

        Args:
            length: Tokens to keep (:meth:`can_resume` must allow it).
            copy: Give the cut layers buffers of their own, so that this longer state's memory can be
                freed; False gives views, enough to count the bytes a copy would take.
        """
        cut = self._cut(length)
        if copy:
            for c in cut:
                if type(c) is not ArraysCache:  # recurrent arrays are replaced whole, never viewed
                    c.keys, c.values = _own(c.keys), _own(c.values)
            mx.eval([a for c in cut for a in _arrays(c)])
        out = SavedCache(length, rebuild(self.layers, cut))
        out.checkpoints = {n: kept for n, kept in self.checkpoints.items() if n < length}
        return out

    def checkpoint_at(self, length: int) -> tuple:
        """Copies of the fixed-position layers at ``length`` (the end, or a kept checkpoint)."""
        if length == self.length:
            return self.end if self.end is not None else tuple(clone_layer(c, length) for c in self.fixed)
        return self.checkpoints[length]

    def inherit(self, other: "SavedCache", upto: int) -> None:
        """Take ``other``'s checkpoints (and its end) up to ``upto``: the state this one was resumed from."""
        if not self.fixed:
            return
        for n in (*other.checkpoints, other.length):
            if 0 < n <= upto and n < self.length:
                self.checkpoints.setdefault(n, other.checkpoint_at(n))

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays held (each array object counted once, a view at its own size)."""
        held = leaves(self.layers) + [c for kept in self.checkpoints.values() for c in leaves(list(kept))]
        seen = {id(a): a.nbytes for c in held for a in _arrays(c)}
        return sum(seen.values())


def _arrays(leaf: Any) -> list:
    """The arrays one layer cache holds."""
    arrays = leaf.cache if type(leaf) is ArraysCache else buffer_arrays(leaf.keys) + buffer_arrays(leaf.values)
    return [a for a in arrays if a is not None]


def _own(x: Any) -> Any:
    """A key or value buffer (a quantized one is a tuple) copied into buffers of its own."""
    if x is None:
        return None
    return tuple(mx.array(a) for a in x) if isinstance(x, (tuple, list)) else mx.array(x)
