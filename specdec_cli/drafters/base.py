"""The drafter protocol and the draft it returns.

A drafter follows the committed sequence through three calls per block:
``propose(last, k, params)`` returns up to ``k`` tokens expected after
``last``; ``accept(n)`` says the first ``n`` of them were committed (the
target's own token follows them); ``cancel()`` undoes a ``propose`` that never
got verified.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

import mlx.core as mx

from ..core.sampling import GREEDY, SamplingParams, top_probability
from ..defaults import NGRAM_MAX, NGRAM_MIN
from ..model.taps import Hidden, TapSpec


@dataclass(frozen=True)
class Draft:
    """Proposed tokens.

    Attributes:
        tokens: uint32 array of shape [m], m <= k (may be lazy).
        logprobs: The drafter's log q for each token, [m, V]; None when the
            drafter is deterministic (q is one-hot at each token).
        syncs: Host syncs the drafter needed (early stopping reads probabilities).
        host: The same tokens as Python ints, when the drafter made them on the
            host (prompt lookup): a logits processor that reads drafts (a
            grammar) then costs no host sync.
    """

    tokens: mx.array
    logprobs: Optional[mx.array] = None
    syncs: int = 0
    host: Optional[tuple[int, ...]] = None

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


def no_draft() -> Draft:
    return Draft(mx.array([], dtype=mx.uint32))


def above_p_min(picks: Sequence[tuple[float, mx.array, Optional[mx.array]]]) -> tuple[list[bool], int]:
    """One batched draft step's p-min verdicts, as each row's drafter decides alone.

    Args:
        picks: Each row's ``(p_min, logits, log q)`` for the draft just drawn.

    Returns:
        Whether each draft is kept (its top-1 probability is at least its
        ``p_min``; always, for a ``p_min`` of 0), and the host syncs that took:
        every probability is read in one, for the whole batch.
    """
    asked = [i for i, (p_min, _, _) in enumerate(picks) if p_min > 0]
    keep = [True] * len(picks)
    if not asked:
        return keep, 0
    tops = mx.concatenate([top_probability(picks[i][1], picks[i][2]).reshape(-1) for i in asked]).tolist()
    for i, top in zip(asked, tops):
        keep[i] = not top < picks[i][0]  # as alone: `top < p_min` stops (a NaN does not)
    return keep, 1


class Drafter(Protocol):
    """What the engine needs from a drafter.

    A drafter that reads the target's hidden states names them in ``taps``;
    the engine then records them during the target's own forwards (no extra
    forward) and hands over the rows of the committed positions: the prompt's
    with ``prefill``, then ``[last, d1 .. dn]`` with each ``accept(n)``.
    Rejected positions never reach the drafter. Drafters whose ``taps`` is
    None are called without the ``hidden`` argument.

    Optionally, ``warm_up(k, params)`` runs each forward shape the drafter
    can use once, before anything is timed, and leaves its state exactly as
    it was (see ``ModelCache.warm``); it returns the row counts it ran.
    And ``may_draft(k)``, asked after a block that drafted nothing, says
    whether the next ``propose`` could draft anything (up to ``k`` tokens)
    whatever token it is given; False lets the engine queue the next forward
    ahead (see ``engine._quiet``). A drafter without it may always draft.
    """

    name: str
    taps: Optional[TapSpec]

    def prefill(self, tokens: Sequence[int], step_size: int, hidden: Optional[Hidden] = None) -> None: ...

    def propose(self, last: int, k: int, params: SamplingParams = GREEDY) -> Draft: ...

    def accept(self, n: int, hidden: Optional[Hidden] = None) -> None: ...

    def cancel(self) -> None: ...


def as_tokens(token: int | mx.array) -> mx.array:
    if isinstance(token, int):
        return mx.array([token], dtype=mx.uint32)
    return token.reshape(-1).astype(mx.uint32)


@dataclass(frozen=True)
class Materials:
    """What a generation's drafter is made from (each kind reads its own part).

    Attributes:
        policy: The row's draft-length policy (a lookup drafter sizes its drafts with ``MatchLength``'s).
        eos_ids: Stop ids (lookup drafts stop at one).
        earlier: Earlier outputs lookup also drafts from (``--lookup-history``, a server's recent answers).
        p_min: ``--draft-p-min`` (0: off).
        ngram: ``(--ngram-max, --ngram-min)``.
        draft_model: A draft model or a DFlash drafter's model.
        draft_cache: A draft model's caches to resume from (a prompt cache hit).
        vocab_size: The target's vocabulary (a draft model's larger one is cut to it).
        head: An MTP head as loaded (``mtp_io.LoadedHead``: the head and the target's parts it reads).
        parts: The target's embedding and output head (DFlash reuses them).
    """

    policy: Any = None
    eos_ids: Sequence[int] = ()
    earlier: Sequence[Sequence[int]] = field(default_factory=list)
    p_min: float = 0.0
    ngram: tuple[int, int] = (NGRAM_MAX, NGRAM_MIN)
    draft_model: Any = None
    draft_cache: Any = None
    vocab_size: Optional[int] = None
    head: Any = None
    parts: Any = None
