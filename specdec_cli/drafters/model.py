"""A draft model: a smaller model that shares the target's tokenizer."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn

from ..cache.caches import ModelCache, Snapshot
from ..core.sampling import GREEDY, SamplingParams, draw, greedy, log_probs, top_probability
from .base import Draft, Materials, as_tokens, no_draft


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
    taps = None

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
        # While its row shares a batch: the DraftBatch that drafts for it (its cache is a row there).
        self.batch = None

    def prefill(self, tokens: Sequence[int], step_size: int = 2048, hidden=None) -> None:
        """Feed the prompt (all but its last token); caches resumed from a prompt cache already hold a prefix."""
        self.cache.prefill(tokens[self.cache.length:], step_size)

    def warm_up(self, k: int, params: SamplingParams = GREEDY) -> tuple[int, ...]:
        """Run the drafter's forward shapes once (1 row, and 2 when a bonus draft is pending); state unchanged."""
        def head(logits: mx.array) -> mx.array:
            logits = logits[-1:, : self.vocab_size]
            return greedy(logits) if params.greedy else log_probs(logits, params)

        return self.cache.warm([1, 2], head)

    def propose(self, last: int | mx.array, k: int, params: SamplingParams = GREEDY) -> Draft:
        """Draft up to ``k`` tokens after ``last``."""
        if self.batch is not None:
            raise RuntimeError("this drafter drafts in its batch (DraftBatch.propose)")
        # Restores go back up to k - 1 drafts plus the pending tokens below the
        # last draft forward's start: sliding-window layers must keep that reach.
        self.cache.ensure_reach(k + len(self._pending) + 1)
        self._start = self.cache.snapshot()
        self._saved_pending = list(self._pending)
        self._pending.append(as_tokens(last))
        self._drafts, self._after = [], []
        if k == 0:
            return no_draft()
        x = mx.concatenate(self._pending)
        self._pending = []
        logprobs, syncs = [], 0
        for i in range(k):
            logits = self.cache.feed(x)[-1:, : self.vocab_size]
            self._after.append(self.cache.snapshot())
            x, lp = draw(logits, params, offset=i)
            if self.p_min > 0:
                top = top_probability(logits, lp)
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

    def accept(self, n: int, hidden=None) -> None:
        """The first ``n`` drafts were committed; rewind past the rest."""
        if not self._after:
            return  # nothing was fed: `last` is still pending
        if n < len(self._after):
            self._restore(self._after[n])
        else:
            # Bonus bookkeeping: the drafter never saw its last draft.
            self._pending = [self._drafts[n - 1]]

    def cancel(self) -> None:
        """Undo the last ``propose``."""
        if self._start is not None:
            self._restore(self._start)
            self._pending = self._saved_pending
            self._start = None
        self._drafts, self._after = [], []

    def _restore(self, snap) -> None:
        if self.batch is not None:
            self.batch.restore(self, snap)
        else:
            self.cache.restore(snap)


def build(m: Materials) -> ModelDrafter:
    """A draft model's drafter (the ``model`` kind), resuming its caches from a prompt-cache hit."""
    return ModelDrafter(m.draft_model, m.draft_cache, vocab_size=m.vocab_size, p_min=m.p_min)
