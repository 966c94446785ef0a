"""What one target forward produced: the typed results the engine and plain decoding yield."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class PhaseTimes:
    """Wall seconds of one block's phases, each closed by its own sync."""

    draft_s: float
    verify_s: float
    rollback_s: float


@dataclass(frozen=True)
class Block:
    """What one target forward produced.

    Attributes:
        tokens: Tokens committed and emitted by this block (an EOS is not emitted).
        drafted: Draft tokens the target verified.
        accepted: Drafts that matched the target (``accepted <= drafted``).
        rollback: ``none`` (full accept), ``trim`` (O(1) offset move),
            ``reforward`` (recurrent state restored and the kept tokens re-fed),
            ``carry`` (restored; the kept tokens lead the next verify),
            ``capture`` (the per-token state kept during the verify selected)
            or ``tape`` (the recurrence alone replayed over the kept tokens).
        syncs: Host syncs the block waited on.
        finish_reason: ``stop`` (EOS), ``length`` (max_tokens) or None.
        times: Phase timings, only when the generator was asked for them.
        verify_len: Rows of the target forward (carried tokens + last + drafts, and padding); without
            ``last`` when it came ``ahead`` (0: no forward of its own).
        carry: Carried tokens leading it; the row predicting this block's
            i-th token is ``carry + i``. Both let ``--compare-ar`` recompute a
            position exactly as the verify computed it.
        logprobs: With a row's ``logprobs`` on, one entry per emitted token:
            ``(logprob, ((token, logprob), ...))``, the target's (processed)
            log-probability of the token and its best alternatives, from the
            forward that verified it; None otherwise.
        ahead: Its first row (``last``) was fed alone by a forward queued before the previous block's token
            was read back, as plain decoding queues its next step; its drafts, if any, were fed after it.
    """

    tokens: tuple[int, ...]
    drafted: int
    accepted: int
    rollback: str
    syncs: int
    finish_reason: Optional[str] = None
    times: Optional[PhaseTimes] = None
    verify_len: int = 1
    carry: int = 0
    logprobs: Optional[tuple] = None
    ahead: bool = False

    @property
    def block_size(self) -> int:
        """Tokens the target's forward verified (drafts + the bonus position)."""
        return self.drafted + 1


def cut_committed(committed: list[int], eos_ids: frozenset[int], room: int) -> tuple[int, Optional[str]]:
    """How many committed tokens to keep, and why generation stops (if it does)."""
    for i, tok in enumerate(committed[:room]):
        if tok in eos_ids:
            return i + 1, "stop"
    if len(committed) >= room:
        return room, "length"
    return len(committed), None
