"""One generation from prompt ids outside a session: plain decoding (the oracle), or a drafter's run.

Yields the events of :mod:`.events`: :class:`Prefilled` once, :class:`Warmed`
once, then one :class:`Step` per block, then :class:`Finished`. Plain decoding
is the exactness oracle and baseline (``--compare-ar``'s other side, ``sweep``'s
reference): one token per forward, as ``mlx_lm.generate`` decodes. With a
drafter the run takes the same road as every session's request: its row opened
by :class:`~.opening.Opening` and decoded as the only row of :class:`~.flights.Flights`.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence, Union

import mlx.nn as nn

from ..cache.caches import ModelCache, make_cache
from ..cache.rollback import RollbackChoice
from ..core.adaptive import DraftPolicy, FixedLength
from ..core.numerics import Numerics
from ..core.request import Request
from ..core.sampling import GREEDY, SamplingParams
from ..drafters import Drafter
from ..errors import OptionError
from ..model.taps import Hidden, HiddenTap
from .events import Finished, Prefilled, Step, Warmed, cache_bytes
from .flights import Flights
from .opening import OpenSettings, Opening, RowPlan
from .plain import plain_generate_step, warm_up

if TYPE_CHECKING:
    from ..model.distributed import Ranks


def run(
    model: nn.Module,
    prompt_ids: Sequence[int],
    *,
    drafter: Optional[Drafter] = None,
    num_draft_tokens: int = 3,
    policy: Optional[DraftPolicy] = None,
    max_tokens: int = 256,
    eos_ids: Sequence[int] = (),
    sampling: SamplingParams = GREEDY,
    rollback: str = "auto",
    rollback_memory_cap: Optional[int] = None,
    prefill_step_size: int = 2048,
    prefill_seconds: Optional[float] = None,
    prefill_chunks: Optional[Sequence[int]] = None,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    timed: bool = False,
    warmup: bool = True,
    seed: Optional[int] = None,
    cache: Optional[ModelCache] = None,
    hidden_prefix: Optional[Hidden] = None,
    marks: Sequence[int] = (),
    choice: Optional[RollbackChoice] = None,
    cancelled: Optional[Callable[[], bool]] = None,
    sync: Optional[Ranks] = None,
    processors: tuple = (),
    logprobs: Optional[int] = None,
    numerics: Optional[Numerics] = None,
) -> Iterator[Union[Prefilled, Warmed, Step, Finished]]:
    """Prefill the caches with ``prompt_ids`` and generate.

    Args:
        model: The target model.
        prompt_ids: Prompt token ids (at least one).
        drafter: A fresh drafter, or None for plain decoding.
        num_draft_tokens: Drafts per block (speculative only, without a policy).
        policy: Chooses each block's draft length (overrides num_draft_tokens).
        max_tokens: Most tokens to emit.
        eos_ids: Ids that end generation.
        sampling: Greedy or sampling options.
        rollback: Recurrent rollback strategy: ``auto`` (chosen after the
            prefill, see :mod:`specdec_cli.cache.rollback`), ``reforward``, ``carry``,
            ``capture`` or ``tape``.
        rollback_memory_cap: Most extra bytes capture may hold per verify.
        prefill_step_size: Prompt chunk size (the most, when sized by time).
        prefill_seconds: Size prefill chunks to about this many seconds each,
            so that nothing waits long on one evaluation (a signal, say).
        prefill_chunks: Exact chunk sizes, from an earlier run's
            :class:`Prefilled` (same sizes, bit-identical caches).
        kv_bits: Quantize the target's KV cache to this many bits (None: off).
        kv_group_size: Group size of the KV quantization.
        timed: Ask the engine for per-phase timings (adds syncs).
        warmup: Run every shape once before decoding (see
            :func:`~specdec_cli.loop.plain.warm_up`), timed apart.
        seed: At temperature > 0, key every draw by (seed, position): the
            text is then the same whatever the draft lengths, and equal to
            plain decoding's with the same seed (see :mod:`specdec_cli.core.sampling`).
        cache: The target's caches holding a prefix of ``prompt_ids`` (a
            prompt cache hit), built fresh when None. The caller may keep
            them after the run: they then hold the prompt and every
            committed token but the last, as the engine leaves them.
        hidden_prefix: With ``cache``, the target's hidden states of the
            positions it holds, for a drafter that reads them.
        marks: Prompt lengths at which to checkpoint the target during
            prefill (reported in :class:`Prefilled`).
        choice: The rollback strategy, already chosen (skips ``auto``'s measurement).
        cancelled: Asked between prefill chunks; True stops the prefill with
            :class:`~specdec_cli.errors.Cancelled` (between blocks, close the generator).
        sync: The ranks of a sharded target: every rank then uses rank 0's
            prefill chunk sizes, rollback choice and decisions (see
            :mod:`specdec_cli.model.distributed`), and a watchdog ends a rank whose
            peers stop answering.
        processors: Logits processors built for this prompt
            (:func:`specdec_cli.core.processors.make_processors`), used by this run only.
        logprobs: None, or how many alternatives each emitted token's
            log-probability comes with (``Block.logprobs``).
        numerics: The run's numerics (default: :meth:`Numerics.resolve`'s ``auto``: bucketed verify
            widths on devices that compile per shape, on a recurrent target only with a recording
            rollback).

    Raises:
        OptionError: ``bucketed`` on a recurrent target whose rollback records nothing.
    """
    if seed is not None and not sampling.greedy:
        sampling = replace(sampling, seed=seed)
    if not prompt_ids:
        raise OptionError("the prompt is empty: give some text")
    if cache is None:
        cache = ModelCache(model, make_cache(model, kv_bits=kv_bits, kv_group_size=kv_group_size) if kv_bits else None)
    if drafter is None:
        yield from _plain(cache, prompt_ids, max_tokens=max_tokens, eos_ids=eos_ids, sampling=sampling,
                          prefill_step_size=prefill_step_size, prefill_seconds=prefill_seconds,
                          prefill_chunks=prefill_chunks, warmup=warmup, marks=marks, cancelled=cancelled, sync=sync,
                          processors=processors, logprobs=logprobs)
        return
    settings = OpenSettings(numerics or Numerics.resolve("auto"), prefill_step_size, prefill_seconds, prefill_chunks,
                            rollback, rollback_memory_cap, kv_bits is not None,
                            None if sync is None else sync.share_one, None if sync is None else sync.prefill_chunk)
    plan = RowPlan(policy if policy is not None else FixedLength(num_draft_tokens), None, drafter, sampling,
                   tuple(processors), frozenset(eos_ids))
    flights = Flights(_One(model, sync, plan, cache, settings, hidden_prefix, marks, choice), timed=timed)
    try:
        yield from flights.alone(Request(list(prompt_ids), max_tokens, logprobs=logprobs), cancelled=cancelled,
                                 warmup=warmup)
    finally:
        flights.close()


class _One:
    """The opener (:class:`~.flights.Opener`) of one sequence outside a session: what :func:`run` was given."""

    def __init__(self, model, ranks, plan: RowPlan, cache: ModelCache, settings: OpenSettings,
                 hidden: Optional[Hidden], marks: Sequence[int], choice: Optional[RollbackChoice]):
        self.model, self.ranks, self.numerics = model, ranks, settings.numerics
        self._plan, self._cache, self._settings = plan, cache, settings
        self._hidden, self._marks, self._choice = hidden, marks, choice

    def tap_spec(self):
        return getattr(self._plan.drafter, "taps", None)

    def open(self, request: Request, tap: Optional[HiddenTap], policy=None) -> Opening:
        return Opening(request, self._plan, self._cache, self._settings, hidden=self._hidden, marks=self._marks,
                       tap=tap, choice=self._choice)

    def keep(self, opening: Opening, cache: Optional[ModelCache], tokens: Sequence[int]) -> None:
        pass  # the caller holds the caches (``cache=``)


def _plain(cache: ModelCache, prompt_ids: Sequence[int], *, max_tokens: int, eos_ids: Sequence[int],
           sampling: SamplingParams, prefill_step_size: int, prefill_seconds: Optional[float],
           prefill_chunks: Optional[Sequence[int]], warmup: bool, marks: Sequence[int],
           cancelled: Optional[Callable[[], bool]], sync: Optional[Ranks], processors: tuple,
           logprobs: Optional[int]) -> Iterator[Union[Prefilled, Warmed, Step, Finished]]:
    """Plain decoding, the oracle: prefill, warm-up, then one token per block (mlx-lm's ``generate_step``'s way)."""
    cached = cache.length
    if not 0 <= cached < len(prompt_ids):
        raise ValueError(f"the caches hold {cached} tokens of a {len(prompt_ids)}-token prompt")
    gen = None
    watch = ExitStack()
    if sync is not None:
        watch.enter_context(sync.watching())
    try:
        start = time.perf_counter()
        cache.prefill(prompt_ids[cached:-1], prefill_step_size, None, seconds=prefill_seconds, sizes=prefill_chunks,
                      stops=[m - cached for m in marks], agree=None if sync is None else sync.prefill_chunk,
                      cancelled=cancelled)
        yield Prefilled(len(prompt_ids), time.perf_counter() - start, None, tuple(cache.chunks), cached,
                        tuple(cache.marks), "exact")
        if warmup:
            start = time.perf_counter()
            what = warm_up(cache, None, sampling=sampling)
            yield Warmed(time.perf_counter() - start, what)
        gen = plain_generate_step(prompt_ids[-1], cache, max_tokens=max_tokens, eos_ids=eos_ids, sampling=sampling,
                                  sync=sync, processors=processors, logprobs=logprobs)
        while True:
            start = time.perf_counter()
            block = next(gen, None)
            if block is None:
                break
            yield Step(block, time.perf_counter() - start)
        gen.close()
        yield Finished(cache_bytes(cache, None))
    finally:
        if gen is not None:
            gen.close()
        watch.close()


