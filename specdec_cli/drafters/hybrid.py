"""Prompt lookup and an MTP head in one drafter: each block drafts from whichever is worth more.

Lookup wins where the text repeats (copies, edits, agent loops), the head
where it does not. Both follow every committed token: the one that did not
draft a block is told what was committed (the head gets the target's hidden
rows either way, so its cache stays what one pass over the text gives).
Which one drafts is the policy's call (:class:`~specdec_cli.core.adaptive.HybridLength`:
``size(match, k)`` sets its ``source`` and ``head_n``).
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..core.sampling import GREEDY, SamplingParams
from ..model.taps import Hidden
from .base import Draft, Materials, no_draft
from .mtp import MTPDrafter
from .suffix import SuffixDrafter


class HybridDrafter:
    """Longest-match lookup where it is worth a draft, an MTP head otherwise.

    Args:
        lookup: A lookup drafter whose ``size`` is ``policy.size``.
        head: The MTP head drafter.
        policy: Decides each block's source (``source``, ``head_n`` after ``size``).
    """

    name = "lookup+mtp"
    taps = MTPDrafter.taps

    def __init__(self, lookup: SuffixDrafter, head: MTPDrafter, policy):
        self.lookup, self.head, self.policy = lookup, head, policy
        self._source: Optional[str] = None

    def prefill(self, tokens: Sequence[int], step_size: int = 2048, hidden: Optional[Hidden] = None) -> None:
        self.lookup.prefill(tokens, step_size)
        self.head.prefill(tokens, step_size, hidden)

    def propose(self, last: int, k: int, params: SamplingParams = GREEDY) -> Draft:
        """Draft from the lookup or the head, as the policy decides for this block."""
        self.policy.source = None
        draft = self.lookup.propose(last, k, params)
        if draft.size:
            self._source = "lookup"
            self.head.propose(last, 0)
            self.head.follow(draft.tokens)
            return draft
        if k > 0 and self.policy.source is None:
            self.policy.size(0, k)  # no match at all: the lookup never asked
        if k > 0 and self.policy.source == "head":
            self._source = "head"
            return self.head.propose(last, self.policy.head_n, params)
        self._source = None
        self.head.propose(last, 0)
        return no_draft()

    def accept(self, n: int, hidden: Optional[Hidden] = None) -> None:
        if self._source == "head":
            self.lookup.accept(0)
            self.lookup.extend(self.head.drafted(n))
        else:
            self.lookup.accept(n)
        self.head.accept(n, hidden)
        self._source = None

    def cancel(self) -> None:
        self.lookup.cancel()
        self.head.cancel()
        self._source = None


def build(m: Materials) -> HybridDrafter:
    """Lookup where the text repeats, the head elsewhere (the ``lookup+mtp`` kind); the adaptive policy chooses
    per block."""
    head = MTPDrafter(m.head.head, m.head.parts, p_min=m.p_min)
    return HybridDrafter(SuffixDrafter(m.policy.size, stop_ids=m.eos_ids), head, m.policy)
