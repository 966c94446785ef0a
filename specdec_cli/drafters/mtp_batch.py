"""One MTP head drafting for several rows: one head forward per draft step for all of them.

While the engine decodes rows together, their :class:`MTPDrafter`-s that share
a head join an :class:`MTPBatch`: the head's attention caches become rows of
a :class:`~specdec_cli.cache.batch_cache.RowsKVCache` (each row at its own length,
its own RoPE positions and mask), and a block feeds every row's waiting pairs
(the target's hidden rows with their next tokens) in one forward, then
chains ``max(k) - 1`` forwards of every row on the head's own outputs. Each
drafter keeps its own queue of pairs and its own drafts; ``accept`` and
``cancel`` stay its own calls and move only its row back (O(1): a row's
length). A row with nothing to draft this block is padding whose keys are
never kept. With ``--draft-p-min`` a row stops at its first draft whose top-1
probability is below it, as it does alone; the rows' probabilities are read
back together, one host sync per draft step for the whole batch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import mlx.core as mx

from ..core.sampling import SamplingParams
from .base import Draft, above_p_min, no_draft
from .mtp import MTPDrafter
from .rows_group import RowsGroup


class MTPBatch(RowsGroup):
    """The rows of one MTP head's caches, drafted together.

    Args:
        head: The head its members share.
    """

    @staticmethod
    def fits(drafter: Any) -> bool:
        """Whether ``drafter`` can draft in a batch (an MTP head's own drafter, not one inside a hybrid)."""
        return type(drafter) is MTPDrafter and drafter.batch is None

    @staticmethod
    def key(drafter: MTPDrafter) -> Any:
        """What its rows share: the head."""
        return drafter.head

    def propose(self, asks: Sequence[tuple[MTPDrafter, Any, int, SamplingParams]]) -> list[Draft]:
        """Draft for every member: ``asks`` is ``(drafter, last, k, params)`` each; returns their drafts in order.

        Each drafter ends as its own ``propose`` would leave it, but for pairs
        that waited past ``MAX_PENDING``: they are fed here (the drafter alone
        feeds them at its ``accept``), the same pairs in the same order.
        """
        if sorted(map(id, (a[0] for a in asks))) != sorted(map(id, self.members)):
            raise ValueError("a batch drafts for all its members at once")
        start = list(self.cache[0].lengths)
        try:
            return self._draft(asks)
        except BaseException:
            for d, _, _, _ in asks:
                d.cancel()
            for rows in self.cache:
                rows.set_lengths(start)
            raise

    def _forward(self, embeds: mx.array, hidden: mx.array, keep: list[int]) -> mx.array:
        """One head forward of every row (``[B, T, H]`` inputs); row ``b`` keeps its first ``keep[b]`` positions."""
        before = list(self.cache[0].lengths)
        mask = self.cache[0].make_mask(embeds.shape[1])
        out = self.model(embeds, hidden, self.cache, mask)
        for rows in self.cache:
            rows.set_lengths([n + k for n, k in zip(before, keep)])
        return out

    def _draft(self, asks) -> list[Draft]:
        index = {id(d): b for b, d in enumerate(self.members)}
        rows_n = len(self.members)
        feeds = {}  # row -> (hidden rows, tokens) fed by the first forward
        drafting = {}
        for d, last, k, params in asks:
            b = index[id(d)]
            if d._begin(last, k):
                feeds[b] = d._pairs()
                drafting[b] = (d, k, params)
            elif len(d._tokens) >= d.MAX_PENDING:
                feeds[b] = d._pairs()  # a long stretch without drafting: feed what is known
        out = {}
        if feeds:
            parts = next(iter(self.members)).parts
            width = max(t.shape[0] for _, t in feeds.values())
            H = next(iter(feeds.values()))[0].shape[-1]
            dtype = next(iter(feeds.values()))[0].dtype
            hidden = mx.zeros((rows_n, width, H), dtype)
            tokens = mx.zeros((rows_n, width), dtype=mx.uint32)
            keep = [0] * rows_n
            for b, (h, t) in feeds.items():
                keep[b] = t.shape[0]
                hidden[b, : keep[b]] = h.astype(dtype)
                tokens[b, : keep[b]] = t
            o = self._forward(parts.embed(tokens), hidden, keep)
            for b in feeds:
                self.members[b]._exact = self.cache[0].lengths[b]
                out[b] = o[b, keep[b] - 1 : keep[b]]
        logprobs: dict[int, list] = {b: [] for b in drafting}
        stopped: set[int] = set()  # rows whose p-min ended their draft
        syncs = 0
        for i in range(max((k for _, k, _ in drafting.values()), default=0)):
            stepping = {b: v for b, v in drafting.items() if v[1] > i and b not in stopped}
            if not stepping:
                break
            if i:
                width_h = next(iter(out.values())).shape[-1]
                hidden = mx.zeros((rows_n, 1, width_h), next(iter(out.values())).dtype)
                tokens = mx.zeros((rows_n, 1), dtype=mx.uint32)
                keep = [0] * rows_n
                for b, (d, _, _) in stepping.items():
                    keep[b] = 1
                    hidden[b] = out[b]
                    tokens[b] = d._drafts[-1]
                o = self._forward(self.members[0].parts.embed(tokens), hidden, keep)
                for b in stepping:
                    out[b] = o[b]
            picks = []
            for b, (d, _, params) in stepping.items():
                logits = d._logits(out[b])
                x, lp = d._pick(logits, params, i)
                picks.append((b, d, x, lp, logits))
            kept, read = above_p_min([(d.p_min, logits, lp) for _, d, _, lp, logits in picks])
            syncs += read
            for (b, d, x, lp, _), ok in zip(picks, kept):
                if not ok:
                    stopped.add(b)
                    continue
                d._drafts.append(x)
                if lp is not None:
                    logprobs[b].append(lp)
        drafts = []
        for d, _, _, _ in asks:
            b = index[id(d)]
            if b not in drafting or not d._drafts:
                drafts.append(no_draft())
                continue
            lps = logprobs[b]
            drafts.append(Draft(mx.concatenate(d._drafts), mx.concatenate(lps) if lps else None))
        if syncs:
            drafts[0] = replace(drafts[0], syncs=syncs)  # the batch's reads, once: the engine adds rows' counts
        return drafts
