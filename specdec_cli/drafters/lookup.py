"""N-gram prompt lookup (``--drafter ngram``): the continuation of the latest occurrence of the last n tokens.

The simple kind, kept for comparison; the default lookup is :mod:`.suffix`.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from ..core.sampling import GREEDY, SamplingParams
from .base import Draft, Materials, no_draft


class NgramDrafter:
    """N-gram prompt lookup: continue the latest earlier occurrence of the last n tokens.

    The history is the prompt plus everything generated. For n from
    ``max_ngram`` down to ``min_ngram``, if the last n tokens occurred before,
    the tokens that followed their most recent occurrence are proposed. No
    model runs; with no repeat nothing is proposed, so a block costs a plain
    decoding step. Indexing keeps each lookup O(max_ngram).

    Args:
        max_ngram: Longest suffix to match.
        min_ngram: Shortest suffix to match (>= 1).
    """

    name = "ngram"
    taps = None

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.history: list[int] = []
        # For each n: n-gram -> end index of its latest occurrence that has a
        # continuation (the token at that index). The (min_ngram - 1)-grams are
        # indexed too, for may_draft alone.
        self._index: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(max(1, min_ngram - 1), max_ngram + 1)
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

    def prefill(self, tokens: Sequence[int], step_size: int = 0, hidden=None) -> None:
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
            return no_draft()
        return Draft(mx.array(self._proposed, dtype=mx.uint32), host=tuple(self._proposed))

    def may_draft(self, k: int) -> bool:
        """Whether the next ``propose`` could draft anything (up to ``k`` tokens), whatever token it is given.

        The shortest n-gram it tries ends with that token; one that occurred before means the history's last
        ``min_ngram - 1`` tokens occurred before with a token after them, which their own index answers in O(1).
        """
        if k <= 0 or self._proposed:
            return k > 0
        if self.min_ngram == 1:
            return bool(self.history)  # the next token alone: anything already in the history
        n = self.min_ngram - 1
        return len(self.history) >= n and tuple(self.history[-n:]) in self._index[n]

    def accept(self, n: int, hidden=None) -> None:
        """Commit the first ``n`` proposals to the history."""
        for t in self._proposed[:n]:
            self._append(t)
        self._proposed = []

    def cancel(self) -> None:
        """Undo the last ``propose``."""
        self._pop()
        self._proposed = []


# The name this drafter had while it was the only lookup.
LookupDrafter = NgramDrafter


def build(m: Materials) -> NgramDrafter:
    """The n-gram drafter (the ``ngram`` kind), matching ``--ngram-max`` down to ``--ngram-min`` tokens."""
    return NgramDrafter(*m.ngram)
