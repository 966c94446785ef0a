"""How many tokens to draft next: fixed, or adapted to what the run measures.

The engine asks ``next_k()`` before each block and reports the block with
``observe``. Neither policy changes what is generated, only how fast: any
draft length keeps greedy output identical and sampled output distributed as
the target's.
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_right
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Optional, Protocol


class DraftPolicy(Protocol):
    """Chooses the draft length of each block."""

    def next_k(self) -> int: ...

    def observe(self, drafted: int, accepted: int, emitted: int, seconds: float) -> None: ...


@dataclass
class FixedLength:
    """Always draft ``k`` tokens."""

    # Whether observe() reads the seconds it is given (ranks then share rank 0's clock).
    clocked = False
    k: int

    def next_k(self) -> int:
        return self.k

    def observe(self, drafted: int, accepted: int, emitted: int, seconds: float) -> None:
        pass

    def summary(self) -> dict:
        return {"policy": "fixed", "k": self.k}


class FirstBlock:
    """Another policy, with the first block capped at ``k`` drafts (the first token arrives sooner).

    A long first verify delays the first token a client sees; capping it
    costs at most one extra forward. Everything else is ``policy``'s.
    """

    def __init__(self, policy, k: int):
        self.policy, self.cap = policy, k
        self._first = True

    def next_k(self) -> int:
        k = self.policy.next_k()
        if self._first:
            self._first = False
            return min(k, self.cap)
        return k

    def observe(self, drafted: int, accepted: int, emitted: int, seconds: float) -> None:
        self.policy.observe(drafted, accepted, emitted, seconds)

    def __getattr__(self, name):
        return getattr(self.policy, name)


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

    clocked = True
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
    drafted_total: int = field(init=False, default=0)
    accepted_total: int = field(init=False, default=0)

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

    def drafts_next(self) -> bool:
        """Whether the block after the current one may draft (asked before the current block is observed).

        False only while switched off (or measuring plain steps) for more than the current block.
        """
        return self.mode == "speculate" or self._remaining <= 1

    @staticmethod
    def _rate(samples) -> float:
        seconds = sum(s for _, s in samples)
        return sum(t for t, _ in samples) / seconds if seconds > 0 else 0.0

    def expected(self, k: int) -> float:
        """Tokens a block drafting ``k`` is expected to commit (the target's own included).

        Each draft is taken as accepted with the run's acceptance so far (a Beta(1, 1) posterior mean).
        """
        rate = (self.accepted_total + 1) / (self.drafted_total + 2)
        return sum(rate ** i for i in range(k + 1))

    def observe(self, drafted: int, accepted: int, emitted: int, seconds: float) -> None:
        self._seen += 1
        timed = self._seen > self.warmup
        if self.mode == "speculate":
            self.drafted_total += drafted
            self.accepted_total += accepted
            self.lengths[drafted] += 1
            self._learn(drafted, accepted)
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

    def _learn(self, drafted: int, accepted: int) -> None:
        """The draft-model rule: one more after a full accept, one more than accepted after a rejection."""
        if drafted:
            if accepted == drafted == self.k:
                self.k = min(self.k + 1, self.k_max)
            elif accepted < drafted:
                self.k = max(self.k_min, accepted + 1)

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
            "length_rule": "+1/-1",
            "k_max": self.k_max,
            "draft_lengths": {str(k): n for k, n in sorted(self.lengths.items())},
            "mean_draft_length": mean,
            "switched_off": self.switched_off,
            "plain_blocks": self.plain_blocks,
        }


# Match-length buckets (lower bounds) whose acceptance MatchLength learns, and
# the per-token acceptance it assumes before measuring: measured over the
# benchmark's prompt categories on SmolLM2-135M (how often the token after a
# suffix matched over this many tokens was the model's own next token).
MATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
PRIOR_ACCEPTANCE = (0.2, 0.45, 0.6, 0.7, 0.8, 0.85, 0.85, 0.92, 0.95, 0.97, 0.99)


def match_bucket(length: int) -> int:
    """Index of the bucket of a match length (>= 1)."""
    return bisect_right(MATCH_BUCKETS, length) - 1


# Block sizes (drafts + 1) the match-length policy verifies: every size up to
# 8, then multiples of 16. Batched matmul kernels tile rows, so the verify cost
# is a sawtooth between those: on a 2-core x86 CPU (SmolLM2-135M, float32,
# OpenBLAS) verify(16) took 1.6 one-token steps and verify(12) 2.4, verify(32)
# 2.4 and verify(28) 3.2, verify(48) 3.1 and verify(52) 3.7. A draft that
# would end between two of them ends at the lower one.
BLOCK_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 48, 64)
# What a size halfway between two listed ones costs before it is timed, against
# the next listed size up (it runs only when the caller allows no more drafts).
SAWTOOTH = 1.4


def prior_cost(t: int) -> float:
    """A verify forward of ``t`` tokens (one of ``BLOCK_SIZES``) in one-token steps, before any is timed.

    What a 2-core x86 CPU measured at those sizes (SmolLM2-135M, float32,
    OpenBLAS): ~1.2 at 2, ~1.45 at 4, ~1.65 at 8 and as little at 16, then
    ~0.04 a token (2.3-2.4 at 32, ~3.1 at 48, 3.1-3.8 at 64). Only the
    sawtooth's low points are priced: the policy drafts no other sizes. The
    run rescales it by what it measures.
    """
    return 1.0 + 0.22 * math.log2(min(t, 8)) + 0.04 * max(0, t - 16)


@dataclass
class MatchLength(AdaptiveLength):
    """Draft length for lookup drafters, learned from acceptance by match length.

    The drafter asks ``size(match, k)`` with the length of the suffix it
    matched. Each drafted token i (1-based) continues a match of
    ``match + i - 1`` tokens; the acceptance of each bucket of such lengths is
    learned from the run (a Beta posterior around ``PRIOR_ACCEPTANCE``), and
    the draft length chosen maximises expected tokens per verify cost,
    ``(1 + sum_i P(first i accepted)) / cost(i + 1)``, with the cost curve
    ``prior_cost`` scaled to what the run's blocks took against plain steps.
    Short matches thus draft little or nothing, long ones up to ``k_max``;
    only the cheap verify sizes (``sizes``) are drafted, unless ``k`` itself
    is smaller than the next one.

    A block the sizing left without drafts is a plain step and is timed as
    one, so the speed comparison of :class:`AdaptiveLength` (switching off
    while speculation is slower than plain decoding) needs no extra probes.

    Args:
        k_max: Most drafts per block (block size - 1).
        prior_weight: Pseudo-observations the prior acceptance is worth.
        costs: Verify costs already known (tokens -> one-token steps, e.g.
            timed while warming up those shapes); they replace the prior
            curve until the run times those sizes itself.
        sizes: Verify sizes (drafts + 1) worth drafting (see ``BLOCK_SIZES``).
        min_match: Shortest match that may draft at all (one token guesses
            right ~1 time in 6: never worth a verify).
    """

    prior_weight: float = 4.0
    costs: Optional[dict] = None
    sizes: frozenset = frozenset(BLOCK_SIZES)
    min_match: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        self._hits = [0] * len(MATCH_BUCKETS)
        self._misses = [0] * len(MATCH_BUCKETS)
        self._expected_hits = 0.0  # under PRIOR_ACCEPTANCE, over the same draft tokens
        self._match = 0
        self._verify: deque[tuple[int, float]] = deque(maxlen=32)
        self.scale = 1.0
        # Verify sizes timed in this run: seconds in plain steps (the latest
        # blocks weigh most). Batched matmul kernels make the curve uneven
        # (on a 2-core x86 CPU 16 tokens cost what 8 do, 12 much more).
        self._measured: dict[int, float] = dict(self.costs or {})

    def acceptance(self) -> list[float]:
        """Per-token acceptance of each match bucket (posterior mean).

        A bucket's prior is its ``PRIOR_ACCEPTANCE``, its odds scaled by how
        much better or worse than those priors every draft of the run did
        (text that repeats, or does not, shows at every match length), or the
        shorter bucket's estimate if that is higher: a longer match is no
        worse evidence until its own blocks say otherwise.
        """
        hits, misses = sum(self._hits), sum(self._misses)
        odds = ((hits + 2) / (self._expected_hits + 2)) / ((misses + 2) / (hits + misses - self._expected_hits + 2))
        out, below = [], 0.0
        for prior, hit, miss in zip(PRIOR_ACCEPTANCE, self._hits, self._misses):
            prior = max(odds * prior / (1 - prior + odds * prior), below)
            below = (prior * self.prior_weight + hit) / (self.prior_weight + hit + miss)
            out.append(below)
        return out

    def cost(self, t: int) -> float:
        """A verify of ``t`` tokens in plain steps, as this run measured it (or the scaled prior)."""
        seen = self._measured.get(t)
        if seen is not None:
            return seen
        above = [n for n in self.sizes if n > t]
        below = [n for n in self.sizes if n < t]
        if t not in self.sizes and above and below:
            # Between two listed sizes the sawtooth climbs halfway, then falls
            # to the next one (12 rows cost 2.4 steps, 15 rows 1.8, 16 rows 1.6).
            hi, lo = min(above), max(below)
            f = (t - lo) / (hi - lo)
            return (1.0 + 2 * (SAWTOOTH - 1.0) * min(f, 1.0 - f)) * self.cost(hi)
        return 1.0 + self.scale * (prior_cost(t) - 1.0)

    def size(self, match: int, k: int) -> int:
        """Drafts for a suffix matched over ``match`` tokens, at most ``k``."""
        return self._lookup_plan(match, k)[0]

    def sizes_any(self, longest: int, k: int, guess: Optional[int] = None) -> bool:
        """Whether a match of up to ``longest`` tokens would be drafted for, at most ``k`` tokens.

        Asked between a block's draft and its observation, so it changes nothing; ``guess``: the match length of
        a guess the next draft scores first (:meth:`guessed`), right or wrong, either way.
        """
        k = min(k, self.k)
        if k <= 0 or longest < self.min_match:
            return False
        saved = list(self._hits), list(self._misses), self._expected_hits
        # Past the last bucket's lower bound every longer match plans alike.
        matches = range(self.min_match, min(longest, max(MATCH_BUCKETS[-1], self.min_match)) + 1)
        costs = self._costs(k)
        try:
            for hit in ((True, False) if guess else (None,)):
                if hit is not None:
                    self._hits, self._misses, self._expected_hits = list(saved[0]), list(saved[1]), saved[2]
                    self._tally(guess, hit)
                rates = self.acceptance()
                if any(self._plan(m, k, rates, costs)[0] for m in matches):
                    return True
            return False
        finally:
            self._hits, self._misses, self._expected_hits = saved

    def expected(self, k: int) -> float:
        """Tokens the last planned block would commit with ``k`` of its drafts (by its match's acceptance)."""
        rates = self.acceptance()
        out, survive = 1.0, 1.0
        for i in range(1, k + 1):
            survive *= rates[match_bucket(self._match + i - 1)] if self._match else 0.0
            out += survive
        return out

    def _lookup_plan(self, match: int, k: int) -> tuple[int, float]:
        """The best lookup draft length and its expected tokens per plain step (1.0: a plain step)."""
        self._match = match
        if k <= 0 or match < self.min_match:
            return 0, 1.0
        return self._plan(match, k, self.acceptance(), self._costs(k))

    def _costs(self, k: int) -> list[Optional[float]]:
        """The cost of a verify of ``i + 1`` tokens at index ``i`` (1 .. k), where a plan prices one."""
        return [None] + [self.cost(i + 1) if i + 1 in self.sizes or i == k else None for i in range(1, k + 1)]

    def _plan(self, match: int, k: int, rates: list[float], costs: list[Optional[float]]) -> tuple[int, float]:
        best, best_k, expected, survive = 1.0, 0, 1.0, 1.0
        for i in range(1, k + 1):
            survive *= rates[match_bucket(match + i - 1)]
            expected += survive
            if costs[i] is None:
                continue  # k itself is the most the caller allows: nothing cheaper lies above it
            value = expected / costs[i]
            if value > best:
                best, best_k = value, i
        return best_k, best

    def observe(self, drafted: int, accepted: int, emitted: int, seconds: float) -> None:
        if self.mode == "speculate" and drafted == 0:
            # Nothing drafted: a plain step, timed as one.
            self._seen += 1
            self.lengths[0] += 1
            if self._seen > self.warmup:
                self._plain.append((emitted, seconds))
            return
        if self.mode == "speculate" and self._seen >= self.warmup:
            self._rescale(drafted + 1, seconds)
        super().observe(drafted, accepted, emitted, seconds)

    def guessed(self, match: int, hit: bool) -> None:
        """Learn from a match the policy drafted nothing for: was its next token the target's?

        Free evidence (no verify was spent on it): in text that repeats
        nothing, short matches keep guessing wrong, and the estimates fall
        before the first draft is wasted.
        """
        self._tally(match, hit)

    def _learn(self, drafted: int, accepted: int) -> None:
        for i in range(min(accepted + 1, drafted)):
            self._tally(self._match + i, i < accepted)

    def _tally(self, match: int, hit: bool) -> None:
        """One token that followed a match of ``match`` tokens: the target's own (``hit``) or not."""
        b = match_bucket(match)
        self._expected_hits += PRIOR_ACCEPTANCE[b]
        if hit:
            self._hits[b] += 1
        else:
            self._misses[b] += 1

    def _rescale(self, t: int, seconds: float) -> None:
        """Note what a verify of ``t`` tokens took; rescale the prior curve by the sizes it prices."""
        if t in self.sizes and t > 1:
            # A size the policy never drafts (cut short by the end of the
            # output or of the source) would skew the curve's scale.
            self._verify.append((t, seconds))
        if not self._plain or not self._verify:
            return
        rate = self._rate(self._plain)  # plain tokens per second
        if rate <= 0:
            return
        ratios = [(s * rate - 1.0) / (prior_cost(n) - 1.0) for n, s in self._verify]
        self.scale = min(3.0, max(0.2, statistics.median(ratios)))
        seen = self._measured.get(t)
        self._measured[t] = seconds * rate if seen is None else 0.5 * (seen + seconds * rate)

    def summary(self) -> dict:
        out = super().summary()
        out.update(length_rule="match-length", verify_cost_scale=round(self.scale, 3),
                   acceptance_by_match={f"{b}+": round(a, 3) for b, a in zip(MATCH_BUCKETS, self.acceptance())})
        return out


@dataclass
class HybridLength(MatchLength):
    """Prompt lookup where the text repeats, a drafter head (MTP) where it does not.

    Each block the lookup's best draft (:class:`MatchLength`'s sizing) and the
    head's best draft of at most ``head_k`` tokens are compared by expected
    tokens per plain step; a head draft also pays ``head_step`` plain steps
    per token. The better one drafts (``source`` says which), or neither when
    a plain step is worth more. The head's acceptance per draft position is
    learned from its blocks around ``head_prior``, its step cost from what its
    blocks take beyond their verify.

    Args:
        head_k: Most head drafts per block.
        head_step: A head draft step in plain steps, before measuring.
        head_prior: Per-position acceptance assumed before measuring.
    """

    head_k: int = 3
    head_step: float = 0.1
    head_prior: float = 0.35

    def __post_init__(self) -> None:
        super().__post_init__()
        self._head_hits = [0] * self.head_k
        self._head_misses = [0] * self.head_k
        self._head_steps: deque[float] = deque(maxlen=16)
        self.source: Optional[str] = None  # "lookup" or "head": who drafts this block
        self.head_n = 0
        self.head_blocks = 0

    def head_acceptance(self) -> list[float]:
        """Acceptance of the head's i-th draft given the ones before it were accepted (posterior mean)."""
        w = self.prior_weight
        return [(self.head_prior * w + h) / (w + h + m) for h, m in zip(self._head_hits, self._head_misses)]

    def _head_plan(self, k: int) -> tuple[int, float]:
        rates = self.head_acceptance()
        best, best_j, expected, survive = 1.0, 0, 1.0, 1.0
        for j in range(1, min(k, self.head_k) + 1):
            survive *= rates[j - 1]
            expected += survive
            value = expected / (self.cost(j + 1) + j * self.head_step)
            if value > best:
                best, best_j = value, j
        return best_j, best

    def expected(self, k: int) -> float:
        if self.source != "head":
            return super().expected(k)
        out, survive = 1.0, 1.0
        for rate in self.head_acceptance()[:k]:
            survive *= rate
            out += survive
        return out

    def size(self, match: int, k: int) -> int:
        """Lookup drafts for this block (0 when the head, or nobody, should draft; see ``source``)."""
        n, value = self._lookup_plan(match, k)
        j, head_value = self._head_plan(k)
        if j and head_value > value:
            self.source, self.head_n = "head", j
            return 0
        self.source, self.head_n = "lookup", 0
        return n

    def observe(self, drafted: int, accepted: int, emitted: int, seconds: float) -> None:
        if self.source == "head" and self.mode == "speculate" and drafted:
            # Speed accounting as any speculative block; the verify-cost curve is the lookup's alone.
            self.head_blocks += 1
            rate = self._rate(self._plain) if self._plain else 0.0
            if rate > 0 and self._seen >= self.warmup:
                step = (seconds * rate - self.cost(drafted + 1)) / drafted
                self._head_steps.append(step)
                self.head_step = min(1.0, max(0.01, statistics.median(self._head_steps)))
            AdaptiveLength.observe(self, drafted, accepted, emitted, seconds)
            return
        super().observe(drafted, accepted, emitted, seconds)

    def _learn(self, drafted: int, accepted: int) -> None:
        if self.source != "head":
            super()._learn(drafted, accepted)
            return
        for i in range(min(accepted + 1, drafted)):
            if i < accepted:
                self._head_hits[i] += 1
            else:
                self._head_misses[i] += 1

    def summary(self) -> dict:
        out = super().summary()
        out.update(length_rule="match-length + head", head_blocks=self.head_blocks,
                   head_acceptance=[round(a, 3) for a in self.head_acceptance()],
                   head_step=round(self.head_step, 3))
        return out
