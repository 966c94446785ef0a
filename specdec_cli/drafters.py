"""Drafters: who proposes the tokens the target verifies.

A drafter follows the committed sequence through three calls per block:
``propose(last, k, params)`` returns up to ``k`` tokens expected after
``last``; ``accept(n)`` says the first ``n`` of them were committed (the
target's own token follows them); ``cancel()`` undoes a ``propose`` that never
got verified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import mlx.core as mx
import mlx.nn as nn

from .caches import ModelCache, Snapshot
from .sampling import GREEDY, SamplingParams, greedy, log_probs, sample


@dataclass(frozen=True)
class Draft:
    """Proposed tokens.

    Attributes:
        tokens: uint32 array of shape [m], m <= k (may be lazy).
        logprobs: The drafter's log q for each token, [m, V]; None when the
            drafter is deterministic (q is one-hot at each token).
        syncs: Host syncs the drafter needed (early stopping reads probabilities).
    """

    tokens: mx.array
    logprobs: Optional[mx.array] = None
    syncs: int = 0

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


def _no_draft() -> Draft:
    return Draft(mx.array([], dtype=mx.uint32))


class Drafter(Protocol):
    """What the engine needs from a drafter."""

    name: str

    def prefill(self, tokens: Sequence[int], step_size: int) -> None: ...

    def propose(self, last: int, k: int, params: SamplingParams = GREEDY) -> Draft: ...

    def accept(self, n: int) -> None: ...

    def cancel(self) -> None: ...


class ModelDrafter:
    """Drafting with a smaller model that shares the target's tokenizer.

    Greedy at temperature 0; at temperature > 0 it samples from its own
    distribution after the same transforms as the target (better acceptance
    than greedy drafting, and q is then known exactly).

    The draft chain stays lazy: the engine evaluates it together with the
    target's verify forward, in one host sync (unless ``p_min`` asks for early
    stopping, which reads each draft's probability). The drafter's recurrent
    state (if any) needs no re-forward: drafting feeds one token at a time, so
    the state after each draft is a free snapshot to return to.

    Args:
        model: The draft model (any family the cache layout supports).
        cache: Its caches; built in the all-KVCache layout when omitted.
        vocab_size: Only draft ids below this (the target's vocabulary), for
            drafters whose embedding is padded to a different size.
        p_min: Stop drafting when the drafter's top-1 probability falls below
            this (llama.cpp's ``--draft-p-min``); 0 never stops early.
    """

    name = "model"

    def __init__(self, model: nn.Module, cache: ModelCache | None = None,
                 vocab_size: int | None = None, p_min: float = 0.0):
        self.cache = cache if cache is not None else ModelCache(model)
        self.vocab_size = vocab_size
        self.p_min = p_min
        # Committed tokens the drafter has not been fed yet (lazy or known).
        self._pending: list[mx.array] = []
        self._saved_pending: list[mx.array] = []
        self._start: Snapshot | None = None
        # _after[i]: the state having consumed everything through draft i
        # (draft 0 being `last`); the last draft is fed only when drafting
        # stopped early, so it may be missing.
        self._after: list[Snapshot] = []
        self._drafts: list[mx.array] = []

    def prefill(self, tokens: Sequence[int], step_size: int = 2048) -> None:
        """Feed the prompt (all but its last token)."""
        self.cache.prefill(tokens, step_size)

    def propose(self, last: int | mx.array, k: int, params: SamplingParams = GREEDY) -> Draft:
        """Draft up to ``k`` tokens after ``last``."""
        self._start = self.cache.snapshot()
        self._saved_pending = list(self._pending)
        self._pending.append(_as_tokens(last))
        self._drafts, self._after = [], []
        if k == 0:
            return _no_draft()
        x = mx.concatenate(self._pending)
        self._pending = []
        logprobs, syncs = [], 0
        for _ in range(k):
            logits = self.cache.feed(x)[-1:, : self.vocab_size]
            self._after.append(self.cache.snapshot())
            if params.greedy:
                x, lp = greedy(logits), None
            else:
                lp = log_probs(logits, params)
                x = sample(lp)
            if self.p_min > 0:
                top = mx.softmax(logits.astype(mx.float32), axis=-1).max() if lp is None else mx.exp(lp.max())
                syncs += 1
                if top.item() < self.p_min:
                    break  # the state after the last kept draft is _after[-1]
            self._drafts.append(x)
            if lp is not None:
                logprobs.append(lp)
        # Without an early stop, k forwards fed `last`, d1 .. d(k-1): dk was
        # never fed, so a rejected last draft costs nothing to undo.
        if not self._drafts:
            return Draft(mx.array([], dtype=mx.uint32), None, syncs)
        tokens = mx.concatenate(self._drafts)
        return Draft(tokens, mx.concatenate(logprobs) if logprobs else None, syncs)

    def accept(self, n: int) -> None:
        """The first ``n`` drafts were committed; rewind past the rest."""
        if not self._after:
            return  # nothing was fed: `last` is still pending
        if n < len(self._after):
            self.cache.restore(self._after[n])
        else:
            # Bonus bookkeeping: the drafter never saw its last draft.
            self._pending = [self._drafts[n - 1]]

    def cancel(self) -> None:
        """Undo the last ``propose``."""
        if self._start is not None:
            self.cache.restore(self._start)
            self._pending = self._saved_pending
            self._start = None
        self._drafts, self._after = [], []


class LookupDrafter:
    """Prompt-lookup drafting: continue the latest earlier occurrence of the last n tokens.

    The history is the prompt plus everything generated. For n from
    ``max_ngram`` down to ``min_ngram``, if the last n tokens occurred before,
    the tokens that followed their most recent occurrence are proposed. No
    model runs; with no repeat nothing is proposed, so a block costs a plain
    decoding step. Indexing keeps each lookup O(max_ngram).

    Args:
        max_ngram: Longest suffix to match.
        min_ngram: Shortest suffix to match (>= 1).
    """

    name = "lookup"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.history: list[int] = []
        # For each n: n-gram -> end index of its latest occurrence that has a
        # continuation (the token at that index).
        self._index: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_ngram, max_ngram + 1)
        }
        self._proposed: list[int] = []

    def _append(self, token: int) -> None:
        h = self.history
        h.append(token)
        end = len(h) - 1  # the n-gram ending before `token` now has a continuation
        for n, table in self._index.items():
            if end >= n:
                table[tuple(h[end - n : end])] = end

    def _pop(self) -> None:
        # Only the last token is ever popped (cancel); rebuild its entries.
        self.history.pop()
        end = len(self.history)
        for n, table in self._index.items():
            if end >= n:
                key = tuple(self.history[end - n : end])
                if table.get(key) == end:
                    del table[key]
                    for start in range(end - n - 1, -1, -1):
                        if tuple(self.history[start : start + n]) == key:
                            table[key] = start + n
                            break

    def prefill(self, tokens: Sequence[int], step_size: int = 0) -> None:
        """Index the prompt (all but its last token)."""
        for t in tokens:
            self._append(int(t))

    def lookup(self, k: int) -> list[int]:
        """Up to ``k`` tokens continuing the current history (no state change)."""
        h = self.history
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(h) < n:
                continue
            end = self._index[n].get(tuple(h[-n:]))
            if end is not None:
                return h[end : end + k]
        return []

    def propose(self, last: int, k: int, params: SamplingParams = GREEDY) -> Draft:
        """Propose up to ``k`` tokens after ``last`` (deterministic: q one-hot)."""
        self._append(int(last))
        self._proposed = self.lookup(k) if k > 0 else []
        if not self._proposed:
            return _no_draft()
        return Draft(mx.array(self._proposed, dtype=mx.uint32))

    def accept(self, n: int) -> None:
        """Commit the first ``n`` proposals to the history."""
        for t in self._proposed[:n]:
            self._append(t)
        self._proposed = []

    def cancel(self) -> None:
        """Undo the last ``propose``."""
        self._pop()
        self._proposed = []


def _as_tokens(token: int | mx.array) -> mx.array:
    if isinstance(token, int):
        return mx.array([token], dtype=mx.uint32)
    return token.reshape(-1).astype(mx.uint32)
