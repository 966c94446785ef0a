"""Longest-match prompt lookup: a suffix automaton over earlier outputs, the prompt and the generated text.

The drafter keeps an online suffix automaton (Blumer et al.) of everything it
has seen. After each committed token the state of the longest suffix that
occurred before is one suffix link away from the whole text's state, so
finding the longest match costs amortised O(1) per token, whatever the
history's length. A draft then walks the automaton's transitions from that
state, at each step taking the continuation seen most often (the most recent
one on a tie). After a rejected draft token, the next draft resumes the
source past it when the target's own token matches nothing longer: a
one-token substitution costs no extra block, and otherwise the source is
found again as soon as one of its tokens follows the change.

Every change to the automaton since the last ``propose`` is logged, and
``cancel`` undoes them in reverse: cheap, and exact.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

import mlx.core as mx

from ..core.sampling import GREEDY, SamplingParams
from .base import Draft, Materials, no_draft
from ..core.adaptive import MatchLength

# Counts and recency are updated along the suffix-link path of each new token,
# at most this deep: the path is short unless the text loops (a period-p loop
# makes it ~n/p long), and only the counts of short, already frequent
# contexts are then left behind. It bounds the work per token.
COUNT_DEPTH = 64


def default_size(match: int, k: int) -> int:
    """Draft length without a learned policy: as many tokens as the match is long (vLLM's rule)."""
    return min(k, match)


class SuffixDrafter:
    """Prompt lookup by the longest matching suffix, continuations chosen by frequency.

    The text is earlier runs' outputs (``history``, each ended by a separator
    no match crosses), then the prompt, then every committed token. Each
    ``propose`` finds the longest suffix of the text that occurred before and
    drafts its continuation; ``size(match, k)`` decides how many of the ``k``
    allowed tokens to draft for a match of that length (an adaptive policy's
    ``size``, which learns it from acceptance, or :func:`default_size`).

    Args:
        size: ``(match_length, k) -> draft length``; see above.
        history: Token sequences of earlier outputs to draft from as well.
        stop_ids: End-of-sequence ids: a draft ends with the first one.
    """

    name = "lookup"
    taps = None

    def __init__(self, size: Optional[Callable[[int, int], int]] = None,
                 history: Iterable[Sequence[int]] = (), stop_ids: Iterable[int] = ()):
        self.size = size or default_size
        # A policy that learns from matches it drafted nothing for (see
        # MatchLength.guessed) is told whether their next token came.
        self._guessed = getattr(getattr(size, "__self__", None), "guessed", None)
        self._guess: Optional[tuple[int, int]] = None  # (match, its next token)
        self.stop_ids = frozenset(stop_ids)
        # State arrays: transitions, suffix link, longest length, occurrence
        # count and most recent end position. State 0 is the root.
        self._next: list[dict[int, int]] = [{}]
        self._link = [-1]
        self._len = [0]
        self._count = [0]
        self._recent = [-1]
        self._last = 0
        self.text: list[int] = []
        self.match = 0  # longest matched suffix at the last propose
        # Rounds a draft length up to the rows its verify forward runs with anyway (bucketed shapes):
        # the tokens that fill them are free to draft and may be accepted. None: drafts as sized.
        self.fill: Optional[Callable[[int], int]] = None
        self._log: list[tuple] = []
        self._logging = False  # only what a cancel may undo is logged
        self._proposed: list[int] = []
        self._states: list[int] = []
        # After a rejected draft token: the state past it in its source, to
        # resume from when the target's token starts no useful match (a
        # one-token substitution then costs no further block).
        self._resume: Optional[int] = None
        self._resumed = False
        sep = -1
        for seq in history:
            for t in seq:
                self._append(int(t))
            # A separator is never repeated, so no match spans two entries.
            self._append(sep)
            sep -= 1

    # --- the automaton ---------------------------------------------------------

    def _new_state(self, length: int, link: int, nxt: dict, count: int, recent: int) -> int:
        self._next.append(nxt)
        self._link.append(link)
        self._len.append(length)
        self._count.append(count)
        self._recent.append(recent)
        if self._logging:
            self._log.append(("state",))
        return len(self._len) - 1

    def _set_next(self, state: int, token: int, target: int) -> None:
        if self._logging:
            self._log.append(("next", state, token, self._next[state].get(token)))
        self._next[state][token] = target

    def _set_link(self, state: int, target: int) -> None:
        if self._logging:
            self._log.append(("link", state, self._link[state]))
        self._link[state] = target

    def _append(self, token: int) -> None:
        """Extend the automaton by one token (amortised O(1))."""
        pos = len(self.text)
        self.text.append(token)
        last = self._last
        cur = self._new_state(self._len[last] + 1, -1, {}, 0, pos)
        p = last
        while p != -1 and token not in self._next[p]:
            self._set_next(p, token, cur)
            p = self._link[p]
        if p == -1:
            self._set_link(cur, 0)
        else:
            q = self._next[p][token]
            if self._len[p] + 1 == self._len[q]:
                self._set_link(cur, q)
            else:
                clone = self._new_state(self._len[p] + 1, self._link[q], dict(self._next[q]),
                                        self._count[q], self._recent[q])
                while p != -1 and self._next[p].get(token) == q:
                    self._set_next(p, token, clone)
                    p = self._link[p]
                self._set_link(q, clone)
                self._set_link(cur, clone)
        # Every suffix of the text now also ends here: count it, note the position.
        bumped = []
        s, depth = cur, 0
        while s > 0 and depth < COUNT_DEPTH:
            if self._logging:
                bumped.append((s, self._recent[s]))
            self._count[s] += 1
            self._recent[s] = pos
            s = self._link[s]
            depth += 1
        if self._logging:
            self._log.append(("append", last, bumped))
        self._last = cur

    def _undo(self) -> None:
        """Undo every change logged since the last ``propose``, newest first."""
        for entry in reversed(self._log):
            kind = entry[0]
            if kind == "append":
                _, last, bumped = entry
                for s, recent in bumped:
                    self._count[s] -= 1
                    self._recent[s] = recent
                self._last = last
                self.text.pop()
            elif kind == "next":
                _, state, token, old = entry
                if old is None:
                    del self._next[state][token]
                else:
                    self._next[state][token] = old
            elif kind == "link":
                self._link[entry[1]] = entry[2]
            else:  # a state created last is removed first
                for arr in (self._next, self._link, self._len, self._count, self._recent):
                    arr.pop()
        self._log.clear()

    # --- drafting ----------------------------------------------------------------

    def longest_match(self) -> tuple[int, int]:
        """The state and length of the longest suffix of the text that occurred before."""
        state = self._link[self._last]
        return (state, self._len[state]) if state > 0 else (0, 0)

    def continuation(self, state: int, k: int) -> tuple[list[int], list[int]]:
        """Up to ``k`` tokens after ``state``, at each step the continuation seen most often; and the states after each."""
        out: list[int] = []
        states: list[int] = []
        while len(out) < k:
            nxt = self._next[state]
            if not nxt:
                break
            if len(nxt) == 1:
                token, state = next(iter(nxt.items()))
            else:
                token, state = max(nxt.items(), key=lambda kv: (self._count[kv[1]], self._recent[kv[1]]))
            if token < 0:
                break  # the end of an earlier output
            out.append(token)
            states.append(state)
            if token in self.stop_ids:
                break  # generation would end here if it is accepted
        return out, states

    def prefill(self, tokens: Sequence[int], step_size: int = 0, hidden=None) -> None:
        """Index the prompt (all but its last token)."""
        self._logging = False
        for t in tokens:
            self._append(int(t))

    def propose(self, last: int, k: int, params: SamplingParams = GREEDY) -> Draft:
        """Draft the continuation of the longest earlier match (deterministic: q one-hot)."""
        self._log.clear()
        self._logging = True
        if self._guess is not None:
            self._guessed(self._guess[0], self._guess[1] == int(last))
            self._guess = None
        self._append(int(last))
        state, self.match = self.longest_match()
        resume, self._resume = self._resume, None
        self._resumed = self.match <= 1 and resume is not None and bool(self._next[resume])
        if self._resumed:
            # Weak evidence either way: sized as a one-token match.
            state, self.match = resume, 1
        n = self.size(self.match, k) if k > 0 and self.match > 0 else 0
        want = min(k, self.fill(n)) if self.fill is not None and n > 0 else n
        self._proposed, self._states = self.continuation(state, want) if want > 0 else ([], [])
        if 0 < len(self._proposed) < n:
            # The source ends sooner: size again for what there is (a policy
            # may prefer a shorter draft whose verify costs less).
            n = self.size(self.match, len(self._proposed))
            self._proposed, self._states = self._proposed[:n], self._states[:n]
        if not self._proposed:
            guess = self.continuation(state, 1)[0] if n == 0 and self._guessed and self.match > 0 else []
            if guess:
                self._guess = (self.match, guess[0])
            return no_draft()
        return Draft(mx.array(self._proposed, dtype=mx.uint32), host=tuple(self._proposed))

    def may_draft(self, k: int) -> bool:
        """Whether the next ``propose`` could draft anything (up to ``k`` tokens), whatever token it is given.

        Asked after a block that drafted nothing, before its token is read: the next match is at most one token
        longer than this one. False lets the engine queue the next forward ahead (a plain step's). The policy
        that sizes the drafts (a :class:`~specdec_cli.core.adaptive.MatchLength` answers for every match at
        once) is taken to be the row's, which the engine asks whether it drafts at all.
        """
        if k <= 0 or self._proposed or self._resume is not None:
            return k > 0
        longest = self.longest_match()[1] + 1
        sizes_any = getattr(getattr(self.size, "__self__", None), "sizes_any", None)
        if sizes_any is not None:
            return sizes_any(longest, k, self._guess[0] if self._guess is not None else None)
        return any(self.size(m, k) for m in range(1, longest + 1))

    def accept(self, n: int, hidden=None) -> None:
        """Commit the first ``n`` proposals to the text."""
        for t in self._proposed[:n]:
            self._append(t)
        # Resume once: a resumed draft rejected in turn was no substitution.
        rejected = n < len(self._proposed) and not self._resumed
        self._resume = self._states[n] if rejected else None
        self._proposed, self._states = [], []

    def extend(self, tokens: Sequence[int]) -> None:
        """Commit tokens another drafter proposed in this block (after ``accept(0)``).

        A guess left by the ``propose`` is checked against the first of them.
        """
        if self._guess is not None and len(tokens):
            self._guessed(self._guess[0], self._guess[1] == int(tokens[0]))
            self._guess = None
        for t in tokens:
            self._append(int(t))

    def cancel(self) -> None:
        """Undo the last ``propose`` (and an ``accept`` after it)."""
        self._undo()
        self._proposed, self._states, self._resume, self._guess = [], [], None, None


def build(m: Materials) -> SuffixDrafter:
    """Prompt lookup (the ``lookup`` kind): sized by the policy's match rule when it has one, drafting from
    earlier outputs too, stopping at an end of sequence."""
    size = m.policy.size if isinstance(m.policy, MatchLength) else None
    return SuffixDrafter(size, m.earlier, m.eos_ids)
