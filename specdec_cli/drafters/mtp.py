"""Drafting with an MTP head (:mod:`specdec_cli.drafters.mtp_head`) from the target's own hidden states.

The head's files are read and written by :mod:`specdec_cli.drafters.mtp_io`;
rows sharing a batch draft together in :mod:`specdec_cli.drafters.mtp_batch`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

from ..core.sampling import GREEDY, SamplingParams, draw, keyed_pick, log_probs, top_probability
from ..model.taps import Hidden, TapSpec, TargetParts
from .base import Draft, Materials, as_tokens, no_draft
from .mtp_head import MTPHead


class MTPDrafter:
    """Drafting with an MTP head that reads the target's final hidden states.

    The engine hands over the target's final-normed rows of every committed
    position (prompt at prefill, ``[last, d1 .. dn]`` after each verify: no
    second target forward). Each row ``h_t`` waits for its next token
    ``x_{t+1}``; pairs are fed at position t. The first forward of a block
    feeds every pair committed since the last block (with the target's true
    states); the chain after it feeds the head's own outputs and is trimmed
    off at ``accept`` (O(1)), so the head's cache only ever holds pairs built
    from the target's states, as it would after a prefill of the whole text.

    The draft chain stays lazy and is evaluated with the verify forward in one
    host sync, unless ``p_min`` asks for early stopping (one sync per draft).

    Args:
        head: The MTP head.
        parts: The target's embedding and lm_head.
        p_min: Stop drafting when the head's top-1 probability is below this.
    """

    name = "mtp"
    taps = TapSpec(final=True)
    # Pending pairs fed without drafting once this many wait (adaptive plain stretches).
    MAX_PENDING = 32

    def __init__(self, head: MTPHead, parts: TargetParts, p_min: float = 0.0):
        self.head, self.parts, self.p_min = head, parts, p_min
        # A head with a reduced draft vocabulary computes only those rows of the lm_head.
        self._ids = head.draft_ids if head.config.draft_vocab_size else None
        self._logits = parts.sub_logits(self._ids) if self._ids is not None else parts.logits
        self.cache = head.make_cache()
        self._rows: list[mx.array] = []  # target rows h_t still waiting for x_{t+1}
        self._tokens: list[mx.array] = []  # their next tokens, in order
        self._skip_next = False  # a one-token prompt: its token follows no row
        self._exact = 0  # cache offset after the pairs built from target states
        self._drafts: list[mx.array] = []
        self._saved: Optional[tuple] = None
        # While its row shares a batch: the MTPBatch that drafts for it (its cache is a row there).
        self.batch = None

    @property
    def offset(self) -> int:
        return self.cache[0].offset if self.batch is None else self.batch.offset(self)

    def _trim_to(self, offset: int) -> None:
        if self.batch is not None:
            self.batch.trim(self, offset)
            return
        for c in self.cache:
            c.trim(c.offset - offset)

    def _feed(self, rows: mx.array, tokens: mx.array) -> mx.array:
        return self.head(self.parts.embed(tokens)[None], rows[None], self.cache)[0]

    def prefill(self, tokens: Sequence[int], step_size: int = 2048, hidden: Optional[Hidden] = None) -> None:
        """Feed the prompt's pairs: ``h_t`` with token ``t + 1`` (all but the prompt's last token)."""
        rows = hidden.final if hidden is not None else None
        if rows is None and len(tokens):
            raise ValueError("the MTP drafter needs the target's final hidden states of the prompt")
        if rows is None or rows.shape[0] == 0:
            self._skip_next = True
            return
        if rows.shape[0] != len(tokens):
            raise ValueError(f"{rows.shape[0]} hidden rows for {len(tokens)} prompt tokens")
        ids = mx.array(list(tokens[1:]), dtype=mx.uint32)
        for start in range(0, ids.shape[0], step_size):
            stop = min(start + step_size, ids.shape[0])
            self._feed(rows[start:stop], ids[start:stop])
            mx.eval([c.state for c in self.cache])
        self._rows = [rows[-1:]]
        self._exact = self.offset

    def propose(self, last: int | mx.array, k: int, params: SamplingParams = GREEDY) -> Draft:
        """Draft up to ``k`` tokens after ``last``."""
        if self.batch is not None:
            raise RuntimeError("this drafter drafts in its batch (MTPBatch.propose)")
        if not self._begin(last, k):
            return no_draft()
        rows, tokens = self._pairs()
        out = self._feed(rows, tokens)[-1:]
        self._exact = self.offset
        logprobs, syncs = [], 0
        for i in range(k):
            if i:
                out = self._feed(out, self._drafts[-1])
            logits = self._logits(out)
            x, lp = self._pick(logits, params, i)
            if self.p_min > 0:
                top = top_probability(logits, lp)
                syncs += 1
                if top.item() < self.p_min:
                    break
            self._drafts.append(x)
            if lp is not None:
                logprobs.append(lp)
        if not self._drafts:
            return Draft(mx.array([], dtype=mx.uint32), None, syncs)
        return Draft(mx.concatenate(self._drafts), mx.concatenate(logprobs) if logprobs else None, syncs)

    def _begin(self, last: int | mx.array, k: int) -> bool:
        """A block's bookkeeping before its forwards; False: nothing to draft (``last`` waits with the rest)."""
        self._saved = (self.offset, list(self._rows), list(self._tokens), self._skip_next)
        self._drafts = []
        if self._skip_next:
            self._skip_next = False
        else:
            self._tokens.append(as_tokens(last))
        return k > 0 and bool(self._tokens)

    def _pairs(self) -> tuple[mx.array, mx.array]:
        """Every pair waiting to be fed (hidden rows, their next tokens), taken out of the queue."""
        rows, tokens = mx.concatenate(self._rows), mx.concatenate(self._tokens)
        if rows.shape[0] != tokens.shape[0]:
            raise RuntimeError(f"MTP bookkeeping: {rows.shape[0]} hidden rows for {tokens.shape[0]} tokens")
        self._rows, self._tokens = [], []
        return rows, tokens

    def _pick(self, logits: mx.array, params: SamplingParams, i: int) -> tuple[mx.array, Optional[mx.array]]:
        """Draft ``i``'s token (a target id) and its log q over the target's vocabulary (None when greedy)."""
        if params.keyed and self._ids is not None:
            # Keyed draws read the noise by target token id: draw over the target's vocabulary.
            lp = self._full(log_probs(logits, params))
            return keyed_pick(lp, params, offset=i), lp
        x, lp = draw(logits, params, offset=i)
        if self._ids is not None:
            x, lp = self._to_target(x, lp)
        return x, lp

    def _to_target(self, x: mx.array, lp: Optional[mx.array]) -> tuple[mx.array, Optional[mx.array]]:
        """Draft-vocabulary indices -> target token ids; log q over the target's vocabulary (-inf elsewhere)."""
        tokens = self._ids[x].astype(mx.uint32)
        return tokens, None if lp is None else self._full(lp)

    def _full(self, lp: mx.array) -> mx.array:
        """Log q over the draft vocabulary -> over the target's (-inf outside the draft vocabulary)."""
        full = mx.full((*lp.shape[:-1], self.parts.vocab_size), -mx.inf, dtype=lp.dtype)
        index = mx.broadcast_to(self._ids, lp.shape)
        return mx.put_along_axis(full, index, lp, axis=-1)

    def accept(self, n: int, hidden: Optional[Hidden] = None) -> None:
        """The first ``n`` drafts were committed; ``hidden`` holds the target rows of ``[last, d1 .. dn]``."""
        # ``_saved`` stays until the next propose: a block interrupted after its hand-over is cancelled whole.
        # Drop the chain built from the head's own outputs.
        self._trim_to(self._exact)
        if hidden is None or hidden.final is None:
            raise ValueError("the MTP drafter needs the target's final hidden states with every accept")
        self._rows.append(hidden.final)
        self._tokens += self._drafts[:n]
        self._drafts = []
        if len(self._tokens) >= self.MAX_PENDING and self.batch is None:
            # A long stretch without drafting: feed what is known, keep the last row waiting
            # (in a batch, the next block's first forward feeds it).
            rows = mx.concatenate(self._rows)
            self._feed(rows[:-1], mx.concatenate(self._tokens))
            self._rows, self._tokens = [rows[-1:]], []
            self._exact = self.offset
            mx.async_eval([c.state for c in self.cache])

    def follow(self, tokens: mx.array) -> None:
        """This block's drafts came from another drafter: ``accept`` commits them (after a ``propose(last, 0)``)."""
        self._drafts = [tokens[i:i + 1] for i in range(tokens.shape[0])]

    def drafted(self, n: int) -> list[int]:
        """The first ``n`` tokens of this block's draft (a host read; call after the verify)."""
        return mx.concatenate(self._drafts[:n]).tolist() if n and self._drafts else []

    def cancel(self) -> None:
        """Undo the last ``propose`` (and an ``accept`` after it)."""
        if self._saved is not None:
            offset, self._rows, self._tokens, self._skip_next = self._saved
            self._trim_to(offset)
            self._exact = offset
            self._saved = None
        self._drafts = []


def build(m: Materials) -> MTPDrafter:
    """An MTP head's drafter (the ``mtp`` kind): the head and the target's parts it reads."""
    return MTPDrafter(m.head.head, m.head.parts, p_min=m.p_min)
