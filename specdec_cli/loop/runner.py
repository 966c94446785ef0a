"""One generation from prompt ids: prefill, warm-up, then the engine loop, timed.

Yields :class:`Prefilled` once, :class:`Warmed` once, then one :class:`Step`
per block, then :class:`Finished` when generation ends. Each step carries the
seconds spent inside the engine for that block, so the time the consumer
spends displaying is never counted as decode time.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence, Union

import mlx.nn as nn

from ..core.adaptive import DraftPolicy
from ..cache.caches import Checkpoint, ModelCache, make_cache
from ..drafters import Drafter
from ..core.blocks import Block
from .engine import speculative_generate_step, verify_rows
from .plain import Warmup, plain_generate_step, warm_up
from ..errors import OptionError
from ..cache.rollback import RollbackChoice, choose
from ..core.sampling import GREEDY, SamplingParams
from ..core.shapes import resolve as resolve_shapes
from ..core.stats import Stats
from ..model.taps import Hidden, HiddenTap

if TYPE_CHECKING:
    from ..model.distributed import Ranks


@dataclass(frozen=True)
class Prefilled:
    """The prompt is in the caches (target and drafter).

    Attributes:
        rollback: The recurrent rollback strategy chosen (speculative runs).
    """

    prompt_tokens: int
    seconds: float
    rollback: Optional[RollbackChoice] = None
    # The target's prefill chunk sizes: pass them back to reproduce its caches bit for bit.
    chunks: tuple[int, ...] = ()
    # Prompt tokens the target's caches already held (a prompt cache hit): not prefilled.
    cached: int = 0
    # The target's checkpoints at the ``marks`` run() was given, in order.
    marks: tuple[Checkpoint, ...] = ()
    # The verify shapes decoding runs with: exact or bucketed (see specdec_cli.core.shapes).
    shapes: str = "exact"
    # Of ``cached``, the tokens read from the prompt cache's disk tier (the rest were in memory).
    disk: int = 0


@dataclass(frozen=True)
class Finished:
    """Generation ended; what the caches hold then.

    Attributes:
        cache_bytes: Bytes held by the layer caches, ``target`` and (model drafters) ``drafter``.
    """

    cache_bytes: dict


@dataclass(frozen=True)
class Warmed:
    """Every shape the run can use has run once (kernels compiled), caches unchanged.

    Attributes:
        seconds: Wall time of the warm-up (not part of prefill or decode time).
        what: The row counts run, target and drafter.
    """

    seconds: float
    what: Warmup


@dataclass(frozen=True)
class Step:
    """One engine block and the seconds the engine spent on it."""

    block: Block
    seconds: float


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
    shapes: str = "auto",
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
        shapes: ``auto``, ``exact`` or ``bucketed`` (see :mod:`specdec_cli.core.shapes`):
            bucketed rounds verify widths up to powers of two; auto buckets on
            devices that compile per shape (on a recurrent target only with a
            recording rollback).

    Raises:
        OptionError: ``bucketed`` on a recurrent target whose rollback records nothing.
    """
    if seed is not None and not sampling.greedy:
        sampling = replace(sampling, seed=seed)
    if not prompt_ids:
        raise OptionError("the prompt is empty: give some text")
    if cache is None:
        cache = ModelCache(model, make_cache(model, kv_bits=kv_bits, kv_group_size=kv_group_size) if kv_bits else None)
    cached = cache.length
    if not 0 <= cached < len(prompt_ids):
        raise ValueError(f"the caches hold {cached} tokens of a {len(prompt_ids)}-token prompt")
    mode = resolve_shapes(shapes)
    if drafter is not None:
        # Refused here, before the prefill, if verify forwards cannot compute as one-token decoding does.
        cache.check_verify(max(verify_rows(_max_draft(policy, num_draft_tokens), cache.recurrent, "carry", mode)))
    # A drafter that reads the target's hidden states gets them from the
    # target's own forwards; the tap comes off the model when the run ends.
    specs = getattr(drafter, "taps", None)
    if specs is not None and cached and (hidden_prefix is None or hidden_prefix.length != cached):
        raise ValueError("a drafter that reads hidden states needs them for the cached prompt tokens")
    tap = HiddenTap(model, specs) if specs is not None else None
    gen = None
    agree = None if sync is None else sync.share_one
    watch = ExitStack()
    if sync is not None:
        watch.enter_context(sync.watching())
    try:
        start = time.perf_counter()
        parts = cache.prefill(prompt_ids[cached:-1], prefill_step_size, tap, seconds=prefill_seconds,
                              sizes=prefill_chunks, stops=[m - cached for m in marks], agree=agree,
                              cancelled=cancelled)
        # The drafter is smaller than the target: the target's largest timed
        # chunk bounds how long one of its chunks takes.
        step = min(prefill_step_size, max(cache.chunks, default=prefill_step_size))
        if tap is not None:
            drafter.prefill(prompt_ids[:-1], step, Hidden.concat([hidden_prefix or Hidden(), *parts]))
        elif drafter is not None:
            drafter.prefill(prompt_ids[:-1], step)
        prefill_s = time.perf_counter() - start
        last = prompt_ids[-1]
        if drafter is not None and choice is None:
            k_max = num_draft_tokens if policy is None else getattr(policy, "k_max", getattr(policy, "k", None))
            choice = choose(rollback, cache, (k_max or num_draft_tokens) + 1, rollback_memory_cap, agree=agree)
        elif drafter is None:
            choice = None
        strategy = None if choice is None else (choice.strategy if choice.strategy != "trim" else "carry")
        if mode == "bucketed" and cache.recurrent and drafter is not None and strategy not in ("capture", "tape"):
            if shapes == "bucketed":
                raise OptionError(f"--shapes bucketed on this recurrent model needs --rollback capture or tape "
                                  f"(it would {strategy}: {choice.reason}); or use --shapes exact")
            mode = "exact"  # auto: padding rows cannot be cut out of a recurrence that records nothing
        yield Prefilled(len(prompt_ids), prefill_s, choice, tuple(cache.chunks), cached, tuple(cache.marks), mode)
        if warmup:
            start = time.perf_counter()
            max_draft = 0 if drafter is None else _max_draft(policy, num_draft_tokens)
            what = warm_up(cache, drafter, max_draft=max_draft, sampling=sampling, rollback=strategy or "carry",
                           tap=tap, shapes=mode)
            yield Warmed(time.perf_counter() - start, what)
        if drafter is None:
            gen = plain_generate_step(last, cache, max_tokens=max_tokens, eos_ids=eos_ids, sampling=sampling,
                                      sync=sync, processors=processors, logprobs=logprobs)
        else:
            gen = speculative_generate_step(
                last, cache, drafter, num_draft_tokens=num_draft_tokens, policy=policy,
                max_tokens=max_tokens, eos_ids=eos_ids, sampling=sampling, rollback=strategy, timed=timed,
                tap=tap, sync=sync, processors=processors, logprobs=logprobs, shapes=mode,
            )
        while True:
            start = time.perf_counter()
            block = next(gen, None)
            if block is None:
                break
            yield Step(block, time.perf_counter() - start)
        gen.close()  # the engine's exit (a carry flushed) happens before the caches are measured
        yield Finished(cache_bytes(cache, drafter))
    finally:
        if gen is not None:
            gen.close()
        if tap is not None:
            tap.close()
        watch.close()


def cache_bytes(cache: ModelCache, drafter: Optional[Drafter]) -> dict:
    """Bytes held by the layer caches: ``target``, and ``drafter`` for drafters that hold caches."""
    sizes = {"target": cache.nbytes}
    held = getattr(drafter, "cache", None)
    if isinstance(held, ModelCache):
        sizes["drafter"] = held.nbytes
    elif isinstance(held, list) and held and all(hasattr(c, "nbytes") for c in held):
        sizes["drafter"] = sum(c.nbytes for c in held)  # a head's own KV caches (MTP)
    return sizes


def _max_draft(policy: Optional[DraftPolicy], num_draft_tokens: int) -> int:
    """The most drafts a block can have under ``policy``."""
    if policy is None:
        return num_draft_tokens
    return getattr(policy, "k_max", getattr(policy, "k", num_draft_tokens))


def collect(events) -> tuple[Stats, list[int]]:
    """Consume a :func:`run` stream into its statistics and generated tokens."""
    stats, tokens = Stats(), []
    for event in events:
        if isinstance(event, Step):
            stats.add(event.block, event.seconds)
            tokens += event.block.tokens
        else:
            stats.note(event)
    return stats, tokens
