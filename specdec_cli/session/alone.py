"""An answer held against its request alone: plain decoding of the same request, and the verdict.

What ``generate --prompts-file --compare-ar`` says of each row and what a served
answer reports when its request asks (``compare_alone``): the target's own text
for the request (fresh caches, one token per forward, as ``mlx_lm.generate``
decodes), compared token by token. A difference is a rounding tie when it is
one (see :mod:`specdec_cli.loop.compare`; a row that shared a batch, or resumed
a prompt cache, is held to the backend's measured rounding), else a bug.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from ..cache.batch_check import Rounding, measure_rounding
from ..core.processors import make_processors
from ..core.stats import Stats
from ..loop.compare import Comparison, compare_with_plain
from .generate import Session
from ..core.request import Request


def rounding(session: Session) -> Rounding:
    """The backend's rounding (``session.rounding``), measured now if the batch check has not."""
    if session.rounding is None:
        session.rounding = measure_rounding(session.model, session.fresh_cache)
    return session.rounding


def compare_alone(session: Session, request: Request, tokens: Sequence[int], stats: Stats, *,
                  batched: bool, cut: bool = False) -> Comparison:
    """Plain decoding of ``request`` alone, and the verdict on ``tokens`` (what the request was answered with).

    Args:
        session: The session that answered.
        request: The request.
        tokens: The answer's tokens.
        stats: Its statistics (its blocks, prefill chunks and cached tokens).
        batched: It shared forwards with other rows (a batch, prefills together) or resumed a prompt
            cache: its ties are held to the backend's rounding (:func:`rounding`).
        cut: A stop string ended it: plain decoding stops after as many tokens.

    Raises:
        ValueError: It was sampled without a seed (its draws cannot be drawn again).
    """
    setup = session.setup
    opts = setup.options
    sampling = request.sampling
    if not sampling.greedy:
        if request.seed is None:
            raise ValueError("sampled without a seed: its draws cannot be repeated (send a seed)")
        sampling = replace(sampling, seed=request.seed)
    resumed = stats.cached_tokens > 0
    held: Optional[Rounding] = rounding(session) if batched or resumed else None
    trace = _answer_blocks(stats.trace, len(tokens)) if cut else stats.trace
    return compare_with_plain(
        setup.target.model, request.prompt_ids, tokens, trace,
        max_tokens=len(tokens) if cut else request.max_tokens,
        eos_ids=() if request.ignore_eos else setup.eos_ids, prefill_step_size=opts.prefill_step_size,
        prefill_chunks=None if resumed else stats.prefill_chunks, sampling=sampling, kv_bits=opts.kv_bits,
        kv_group_size=opts.kv_group, processors=lambda: make_processors(request, setup.tokenizer, request.prompt_ids),
        rounding=held,
    )


def _answer_blocks(trace: Sequence, n: int) -> list:
    """The blocks that committed the answer's ``n`` tokens (a stop string cut it): the block that completed the stop
    as far as the answer goes (what it committed past, an EOS too, is not the answer's), none after it."""
    out, emitted = [], 0
    for block in trace:
        if emitted >= n:
            break
        if emitted + len(block.tokens) > n or (emitted + len(block.tokens) == n and block.finish_reason == "stop"):
            block = replace(block, tokens=block.tokens[: n - emitted], finish_reason=None)
        out.append(block)
        emitted += len(block.tokens)
    return out
