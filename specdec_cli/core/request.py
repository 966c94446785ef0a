"""What one request asks for: a :class:`Request`, the same to every face and layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .processors import Constraint
from .sampling import GREEDY, SamplingParams


@dataclass(frozen=True)
class Request:
    """One generation.

    Attributes:
        prompt_ids: The prompt's token ids.
        max_tokens: Most tokens to generate (already capped at the context).
        sampling: Greedy or sampling options.
        seed: Seed of the random draws (None: as they come).
        block_size: Most tokens verified per target forward (None: the session's).
        boundaries: Prompt lengths worth a resumable snapshot (chat segment ends).
        timed: Time each block's phases (adds host syncs).
        ignore_eos: Generate past end-of-sequence tokens (to ``max_tokens``).
        first_draft: Most drafts in the first block (None: the policy's):
            a streamed reply's first token comes sooner after a short verify.
        logit_bias, repetition_penalty, repetition_context_size, presence_penalty,
            presence_context_size, frequency_penalty, frequency_context_size:
            mlx-lm's logits processors (``make_logits_processors``; None or 0: off).
        constraint: The output must be JSON (of a schema) or tool calls (a grammar).
        logprobs: None: off; n >= 0: each token's log-probability and its n best alternatives.
    """

    prompt_ids: Sequence[int]
    max_tokens: int = 256
    sampling: SamplingParams = GREEDY
    seed: Optional[int] = None
    block_size: Optional[int] = None
    boundaries: tuple[int, ...] = ()
    timed: bool = False
    ignore_eos: bool = False
    first_draft: Optional[int] = None
    logit_bias: Optional[tuple[tuple[int, float], ...]] = None
    repetition_penalty: Optional[float] = None
    repetition_context_size: int = 20
    presence_penalty: Optional[float] = None
    presence_context_size: int = 20
    frequency_penalty: Optional[float] = None
    frequency_context_size: int = 20
    constraint: Optional[Constraint] = None
    logprobs: Optional[int] = None


__all__ = ["Request"]
