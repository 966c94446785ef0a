"""Drafters: who proposes the tokens the target verifies.

A drafter follows the committed sequence through three calls per block:
``propose(last, k)`` returns up to ``k`` tokens expected after ``last``;
``accept(n)`` says the first ``n`` of them were committed (the target's own
token follows them); ``cancel()`` undoes a ``propose`` that never got verified.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import mlx.core as mx
import mlx.nn as nn

from .caches import ModelCache, Snapshot
from .sampling import greedy


class Drafter(Protocol):
    """What the engine needs from a drafter."""

    name: str

    def prefill(self, tokens: Sequence[int], step_size: int) -> None: ...

    def propose(self, last: int, k: int) -> mx.array: ...

    def accept(self, n: int) -> None: ...

    def cancel(self) -> None: ...


class ModelDrafter:
    """Greedy drafting with a smaller model that shares the target's tokenizer.

    The draft chain stays lazy: the engine evaluates it together with the
    target's verify forward, in one host sync. The drafter's recurrent state
    (if any) needs no re-forward: drafting feeds one token at a time, so the
    state after each draft is a free snapshot to return to.

    Args:
        model: The draft model (any family the cache layout supports).
        cache: Its caches; built in the all-KVCache layout when omitted.
        vocab_size: Only draft ids below this (the target's vocabulary), for
            drafters whose embedding is padded to a different size.
    """

    name = "model"

    def __init__(self, model: nn.Module, cache: ModelCache | None = None, vocab_size: int | None = None):
        self.cache = cache if cache is not None else ModelCache(model)
        self.vocab_size = vocab_size
        # Committed tokens the drafter has not been fed yet (lazy or known).
        self._pending: list[mx.array] = []
        self._saved_pending: list[mx.array] = []
        self._start: Snapshot | None = None
        self._after: list[Snapshot] = []
        self._drafts: list[mx.array] = []

    def prefill(self, tokens: Sequence[int], step_size: int = 2048) -> None:
        """Feed the prompt (all but its last token)."""
        self.cache.prefill(tokens, step_size)

    def propose(self, last: int | mx.array, k: int) -> mx.array:
        """Draft ``k`` tokens after ``last``; returns a lazy uint32 array of shape [k]."""
        self._start = self.cache.snapshot()
        self._saved_pending = list(self._pending)
        self._pending.append(_as_tokens(last))
        self._drafts, self._after = [], []
        if k == 0:
            return mx.array([], dtype=mx.uint32)
        x = mx.concatenate(self._pending)
        self._pending = []
        # k forwards: the pending tokens, then d1 .. d(k-1); dk is never fed,
        # so a rejected last draft costs nothing to undo.
        for _ in range(k):
            logits = self.cache.feed(x)
            x = greedy(logits[-1:, : self.vocab_size])
            self._drafts.append(x)
            # _after[i]: the state having consumed everything through draft i.
            self._after.append(self.cache.snapshot())
        return mx.concatenate(self._drafts)

    def accept(self, n: int) -> None:
        """The first ``n`` drafts were committed; rewind past the rest."""
        k = len(self._drafts)
        if k == 0:
            return
        if n == k:
            # Bonus bookkeeping: the drafter never saw its last draft.
            self._pending = [self._drafts[-1]]
        else:
            self.cache.restore(self._after[n])

    def cancel(self) -> None:
        """Undo the last ``propose``."""
        if self._start is not None:
            self.cache.restore(self._start)
            self._pending = self._saved_pending
            self._start = None
        self._drafts, self._after = [], []


def _as_tokens(token: int | mx.array) -> mx.array:
    if isinstance(token, int):
        return mx.array([token], dtype=mx.uint32)
    return token.reshape(-1).astype(mx.uint32)
