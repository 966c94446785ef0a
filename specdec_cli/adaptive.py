"""How many tokens to draft next: fixed, or adapted to what the run measures.

The engine asks ``next_k()`` before each block and reports the block with
``observe``. Neither policy changes what is generated, only how fast: any
draft length keeps greedy output identical and sampled output distributed as
the target's.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Protocol


class DraftPolicy(Protocol):
    """Chooses the draft length of each block."""

    def next_k(self) -> int: ...

    def observe(self, drafted: int, accepted: int, emitted: int, seconds: float) -> None: ...


@dataclass
class FixedLength:
    """Always draft ``k`` tokens."""

    k: int

    def next_k(self) -> int:
        return self.k

    def observe(self, drafted: int, accepted: int, emitted: int, seconds: float) -> None:
        pass

    def summary(self) -> dict:
        return {"policy": "fixed", "k": self.k}


@dataclass
class AdaptiveLength:
    """Draft length that follows acceptance, and speculation that turns itself off when it loses.

    Length: after a block whose every draft was accepted, draft one more
    (up to ``k_max``); after a rejection, draft one more than were accepted
    (down to ``k_min``).

    Speed: every ``window`` speculative blocks, their tokens per second are
    compared with plain decoding's (measured on ``probe`` plain steps when
    unknown). If speculation is more than ``margin`` slower, it switches off
    for ``cooldown`` plain steps, then probes again; each consecutive loss
    doubles the cooldown (up to ``max_cooldown``), a win resets it. Half a
    window in which no draft was accepted switches off at once: each block
    then yields one token, as a plain step does, for more work. The first
    ``warmup`` blocks are not timed (first calls of new shapes are slow).

    Args:
        k_max: Most drafts per block (block size - 1).
        k_min: Fewest drafts per block while speculating.
    """

    k_max: int
    k_min: int = 1
    window: int = 8
    probe: int = 4
    cooldown: int = 16
    max_cooldown: int = 256
    margin: float = 0.05
    warmup: int = 2
    k: int = field(init=False)
    mode: str = field(init=False, default="speculate")
    switched_off: int = field(init=False, default=0)
    plain_blocks: int = field(init=False, default=0)
    lengths: Counter = field(init=False, default_factory=Counter)

    def __post_init__(self) -> None:
        if not 0 <= self.k_min <= self.k_max:
            raise ValueError("need 0 <= k_min <= k_max")
        self.k = self.k_max
        self._base_cooldown = self.cooldown
        self._remaining = 0
        self._seen = 0
        self._spec: list[tuple[int, float]] = []
        self._spec_accepted = 0
        self._plain: deque[tuple[int, float]] = deque(maxlen=16)

    def next_k(self) -> int:
        return self.k if self.mode == "speculate" else 0

    @staticmethod
    def _rate(samples) -> float:
        seconds = sum(s for _, s in samples)
        return sum(t for t, _ in samples) / seconds if seconds > 0 else 0.0

    def observe(self, drafted: int, accepted: int, emitted: int, seconds: float) -> None:
        self._seen += 1
        timed = self._seen > self.warmup
        if self.mode == "speculate":
            self.lengths[drafted] += 1
            if drafted:
                if accepted == drafted == self.k:
                    self.k = min(self.k + 1, self.k_max)
                elif accepted < drafted:
                    self.k = max(self.k_min, accepted + 1)
            if timed:
                self._spec.append((emitted, seconds))
                self._spec_accepted += accepted
            if len(self._spec) >= self.window // 2 and self._spec_accepted == 0:
                self._switch_off()
            elif len(self._spec) >= self.window:
                if self._plain:
                    self._decide()
                else:
                    self.mode, self._remaining = "measure", self.probe
            return
        self.plain_blocks += 1
        if timed:
            self._plain.append((emitted, seconds))
        self._remaining -= 1
        if self._remaining > 0:
            return
        if self.mode == "measure":
            self._decide()
        else:  # cooldown over: probe speculation again
            self.mode = "speculate"
            self._spec, self._spec_accepted = [], 0

    def _decide(self) -> None:
        spec, plain = self._rate(self._spec), self._rate(self._plain)
        if spec < plain * (1 - self.margin):
            self._switch_off()
        else:
            self.mode = "speculate"
            self._spec, self._spec_accepted = [], 0
            self.cooldown = self._base_cooldown

    def _switch_off(self) -> None:
        self.mode, self._remaining = "off", self.cooldown
        self._spec, self._spec_accepted = [], 0
        self.switched_off += 1
        self.cooldown = min(2 * self.cooldown, self.max_cooldown)

    def summary(self) -> dict:
        """What the policy did, for the stats."""
        spec_blocks = sum(self.lengths.values())
        mean = sum(k * n for k, n in self.lengths.items()) / spec_blocks if spec_blocks else 0.0
        return {
            "policy": "adaptive",
            "k_max": self.k_max,
            "draft_lengths": {str(k): n for k, n in sorted(self.lengths.items())},
            "mean_draft_length": mean,
            "switched_off": self.switched_off,
            "plain_blocks": self.plain_blocks,
        }
