"""One draft model drafting for several rows: one forward per draft step for all of them.

While the engine decodes rows together, their :class:`ModelDrafter`-s that
share a draft model join a :class:`DraftBatch`: their caches become rows of
one :class:`~specdec_cli.cache.batch_cache.BatchCache`, and a block drafts ``k``
tokens for every row in ``max(k)`` forwards of ``B`` rows instead of ``sum(k)``
forwards of one. With ``--draft-p-min`` a row stops at its first draft whose
top-1 probability is below it, as it does alone; the rows' probabilities are
read back together, one host sync per draft step for the whole batch. Each drafter keeps its own bookkeeping (tokens not yet fed,
the state after each draft, its drafts), so ``accept`` and ``cancel`` stay the
drafter's own calls: they move only that drafter's row back. A row that
drafts fewer tokens than the longest is padded, and what the padding computes
is dropped at once (recurrent draft models record the forward to do that).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence

import mlx.core as mx

from ..cache.batch_cache import BatchCache, BatchSnapshot
from ..cache.batch_check import batch_problem
from ..cache.caches import ModelCache
from ..core.sampling import SamplingParams, draw
from .base import Draft, above_p_min, as_tokens, no_draft
from .model import ModelDrafter


class DraftBatch:
    """The rows of one draft model's caches, drafted together.

    Args:
        model: The draft model its members share.
    """

    def __init__(self, model: Any):
        self.model = model
        self.members: list[ModelDrafter] = []
        self.cache: Optional[BatchCache] = None

    @staticmethod
    def fits(drafter: Any) -> bool:
        """Whether ``drafter`` can draft in a batch (a draft model whose cache rolls back per row)."""
        if not isinstance(drafter, ModelDrafter) or drafter.batch is not None:
            return False
        cache = drafter.cache
        return not cache.recurrent or cache.can_record

    @staticmethod
    def problem(drafter: ModelDrafter) -> Optional[str]:
        """Why the draft model cannot draft rows together (its caches or its forward), or None."""
        model = drafter.cache.model
        return batch_problem(model, lambda: ModelCache(model))

    @staticmethod
    def key(drafter: ModelDrafter) -> Any:
        return drafter.cache.model

    def join(self, drafter: ModelDrafter) -> None:
        """Move ``drafter``'s cache in as the last row (its state is unchanged)."""
        if self.cache is None:
            self.cache = BatchCache(self.model, drafter.cache)
        else:
            self.cache.add(drafter.cache)
        drafter.cache, drafter.batch = None, self
        self.members.append(drafter)

    def leave(self, drafter: ModelDrafter) -> None:
        """Give ``drafter`` its row back as a cache of its own (between blocks)."""
        b = self.members.index(drafter)
        drafter.cache, drafter.batch = self.cache.row(b), None
        drafter._start, drafter._after = None, []
        self.members.pop(b)
        if self.members:
            self.cache.keep_rows([i for i in range(len(self.members) + 1) if i != b])
        else:
            self.cache = None

    def restore(self, drafter: ModelDrafter, snap: BatchSnapshot) -> None:
        """``drafter``'s row back to ``snap``."""
        self.cache.restore_row(self.members.index(drafter), snap)

    def propose(self, asks: Sequence[tuple[ModelDrafter, Any, int, SamplingParams]]) -> list[Draft]:
        """Draft for every member: ``asks`` is ``(drafter, last, k, params)`` each; returns their drafts in order.

        Each drafter ends as its own ``propose`` would leave it (lazy: the
        drafts are evaluated with the target's verify forward).
        """
        if sorted(map(id, (a[0] for a in asks))) != sorted(map(id, self.members)):
            raise ValueError("a batch drafts for all its members at once")
        cache, rows = self.cache, len(self.members)
        start = cache.snapshot()
        for d, last, _, _ in asks:
            d._start, d._saved_pending = start, list(d._pending)
            d._pending.append(as_tokens(last))
            d._drafts, d._after = [], []
        try:
            return self._draft(asks, cache, rows)
        except BaseException:
            cache.restore(start)
            for d, _, _, _ in asks:
                d._pending, d._start, d._drafts, d._after = d._saved_pending, None, [], []
            raise

    def _draft(self, asks, cache: BatchCache, rows: int) -> list[Draft]:
        index = {id(d): b for b, d in enumerate(self.members)}
        x = {}  # row -> what it feeds next
        for d, _, k, _ in asks:
            if k > 0:
                x[index[id(d)]] = mx.concatenate(d._pending)
                d._pending = []
        logprobs: dict[int, list] = {b: [] for b in x}
        record = "capture" if cache.recurrent else None
        stopped: set[int] = set()  # rows whose p-min ended their draft
        syncs = 0
        for i in range(max((a[2] for a in asks), default=0)):
            stepping = [(index[id(d)], d, params) for d, _, k, params in asks if k > i
                        and index[id(d)] not in stopped]
            if not stepping:
                break
            width = max(x[b].shape[0] for b, _, _ in stepping)
            tokens = mx.zeros((rows, width), dtype=mx.uint32)
            keep = [0] * rows
            for b, _, _ in stepping:
                keep[b] = x[b].shape[0]
                tokens[b, : keep[b]] = x[b]
            before = cache.snapshot()
            logits = cache.feed(tokens, record=record)
            cache.settle(before, keep)  # rows that were only padding keep nothing
            after = cache.snapshot()
            picks = []
            for b, d, params in stepping:
                row_logits = logits[b, keep[b] - 1 : keep[b], : d.vocab_size]
                x[b], lp = draw(row_logits, params, offset=i)
                d._after.append(after)
                picks.append((b, d, x[b], lp, row_logits))
            kept, read = above_p_min([(d.p_min, row_logits, lp) for _, d, _, lp, row_logits in picks])
            syncs += read
            for (b, d, token, lp, _), ok in zip(picks, kept):
                if not ok:
                    stopped.add(b)
                    continue  # the state after its last kept draft is its _after[-1], as alone
                d._drafts.append(token)
                if lp is not None:
                    logprobs[b].append(lp)
        drafts = []
        for d, _, k, _ in asks:
            lps = logprobs.get(index[id(d)], [])
            drafts.append(Draft(mx.concatenate(d._drafts), mx.concatenate(lps) if lps else None)
                          if k > 0 and d._drafts else no_draft())
        if syncs:
            drafts[0] = replace(drafts[0], syncs=syncs)  # the batch's reads, once: the engine adds rows' counts
        return drafts
