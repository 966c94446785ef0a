"""One DFlash drafter drafting for several rows: one block forward for all of them.

While the engine decodes rows together, their :class:`DFlashDrafter`-s that
share a drafter model join a :class:`DFlashBatch`: each layer's context K/V
become rows of a :class:`~specdec_cli.cache.batch_cache.RowsKVCache` (each row
at its own length, its own RoPE positions and mask). A block projects every
row's waiting target rows into its context in one forward, then runs every
row's query block ``[last, mask x k]`` in one more, each row seeing exactly
what it sees alone (its context and its own block, never another row's
padding). Each drafter keeps its own waiting rows and its undo point, so
``accept`` and ``cancel`` stay its own calls and move only its row (O(1): a
row's length). With ``--draft-p-min`` each row's cut is computed on the
device and the rows' cuts are read back together, in one host sync.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence

import mlx.core as mx

from ..core.sampling import SamplingParams, draw, top_probability
from ..model.taps import Hidden
from .base import Draft, as_tokens, no_draft
from .dflash import DFlashDrafter
from .rows_group import RowsGroup


# RoPE classes whose offset may be an array, one per row (mlx.nn.RoPE and mlx-lm's scaled kinds).
_ROWS_ROPE = ("RoPE", "Llama3RoPE", "YarnRoPE", "SuScaledRoPE")


class DFlashBatch(RowsGroup):
    """The rows of one DFlash drafter model's context caches, drafted together.

    Args:
        model: The ``DFlashModel`` its members share.
    """

    @staticmethod
    def fits(drafter: Any) -> bool:
        """Whether ``drafter`` can draft in a batch (a DFlash drafter not already in one)."""
        return type(drafter) is DFlashDrafter and drafter.batch is None

    @staticmethod
    def problem(drafter: DFlashDrafter) -> Optional[str]:
        """Why its rows cannot draft together (then each drafts alone), or None.

        The drafter's RoPE comes from mlx-lm's ``initialize_rope``: these kinds take each row's own
        offset; "dynamic" NTK scaling derives its base from one offset, which rows do not share.
        """
        rope = type(drafter.model.rope)
        if rope.__name__ not in _ROWS_ROPE:
            return f"its RoPE ({rope.__name__}) takes one position offset, not one per row"
        return None

    @staticmethod
    def key(drafter: DFlashDrafter) -> Any:
        """What its rows share: the drafter model."""
        return drafter.model

    def propose(self, asks: Sequence[tuple[DFlashDrafter, Any, int, SamplingParams]]) -> list[Draft]:
        """Draft for every member: ``asks`` is ``(drafter, last, k, params)`` each; returns their drafts in order.

        Each drafter ends as its own ``propose`` would leave it (lazy: the
        drafts are evaluated with the target's verify forward).
        """
        if sorted(map(id, (a[0] for a in asks))) != sorted(map(id, self.members)):
            raise ValueError("a batch drafts for all its members at once")
        start = list(self.cache[0].lengths)
        for d, _, _, _ in asks:
            d._undo = (self.offset(d), list(d._pending))
        try:
            return self._draft(asks)
        except BaseException:
            for d, _, _, _ in asks:
                d._pending = d._undo[1]
                d._undo = None
            for rows in self.cache:
                rows.set_lengths(start)
            raise

    def _draft(self, asks) -> list[Draft]:
        index = {id(d): b for b, d in enumerate(self.members)}
        B = len(self.members)
        drafting = {}
        for d, last, k, params in asks:
            k = min(k, d.config.block_size - 1)
            if k > 0:  # as alone: a row that drafts nothing keeps its rows waiting
                drafting[index[id(d)]] = (d, last, k, params)
        if not drafting:
            return [no_draft() for _ in asks]
        first = self.members[0]
        # Every drafting row's waiting target rows join its context: one projection for all.
        waiting = {b: Hidden.concat(d._pending) for b, (d, _, _, _) in drafting.items()}
        waiting = {b: h for b, h in waiting.items() if h.length}
        for b in waiting:
            drafting[b][0]._pending = []
        if waiting:
            width = max(h.length for h in waiting.values())
            joined = {b: mx.concatenate(list(h.layers), axis=-1) for b, h in waiting.items()}
            sample = next(iter(joined.values()))
            feats = mx.zeros((B, width, sample.shape[-1]), sample.dtype)
            widths = [0] * B
            for b, rows in joined.items():
                widths[b] = rows.shape[0]
                feats[b, : widths[b]] = rows
            self.model.add_context_rows(feats, widths, self.cache)
        # Every row's query block [last, mask x k] in one forward, padded to the longest.
        L = 1 + max(k for _, _, k, _ in drafting.values())
        mask_id = first.config.mask_token_id
        ids = mx.full((B, L), mask_id, dtype=mx.uint32)
        sizes = [0] * B
        for b, (_, last, k, _) in drafting.items():
            ids[b, :1] = as_tokens(last)[-1:]
            sizes[b] = k + 1
        h = self.model.rows(first.embed(ids), sizes, self.cache)
        out: dict[int, tuple] = {}
        cuts = []
        for b, (d, _, k, params) in drafting.items():
            logits = d.logits(h[b, 1 : 1 + k])
            tokens, lp = draw(logits, params)
            out[b] = (tokens, lp)
            if d.p_min > 0:
                top = top_probability(logits, lp)
                cuts.append((b, mx.cumprod((top >= d.p_min).astype(mx.int32)).sum()))
        keep = {}
        if cuts:
            # Each row's cut, as alone, read back for all rows in one host sync.
            for (b, _), m in zip(cuts, mx.stack([m for _, m in cuts]).tolist()):
                keep[b] = m
        drafts = []
        for d, _, _, _ in asks:
            b = index[id(d)]
            if b not in out:
                drafts.append(no_draft())
                continue
            tokens, lp = out[b]
            m = keep.get(b)
            if m is None:
                drafts.append(Draft(tokens, lp))
            elif m == 0:
                drafts.append(Draft(mx.array([], dtype=mx.uint32), None))
            else:
                drafts.append(Draft(tokens[:m], None if lp is None else lp[:m]))
        if cuts:
            drafts[0] = replace(drafts[0], syncs=1)  # the batch's read, once: the engine adds rows' counts
        return drafts
