"""Measurements taken side by side in one process: plain decoding vs speculative block sizes.

Every configuration runs on the same prompt token ids with fresh caches, in
an interleaved order (plain, B1, B2, ..., plain, B1, ...) so a machine that
drifts slows all of them alike; a speedup is the median over repeats of the
per-repeat ratio to that repeat's plain run. Speed comes from runs without
phase timing; a separate timed run gives the per-phase milliseconds (its
extra syncs would otherwise slow the speed runs). Besides the fixed block
sizes a sweep can measure ``generate``'s own default (adaptive, its default
block size), the setting a user would otherwise run without knowing its speed.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

import mlx.nn as nn

from ..core.adaptive import DraftPolicy, FixedLength
from ..loop.compare import IDENTICAL, explain
from ..drafters import Drafter
from ..loop.runner import collect, run
from ..core.sampling import GREEDY, SamplingParams
from ..core.stats import Stats


def measure(
    model: nn.Module,
    prompt_ids: Sequence[int],
    drafter: Optional[Drafter],
    block_size: int = 1,
    *,
    max_tokens: int,
    eos_ids: Sequence[int] = (),
    sampling: SamplingParams = GREEDY,
    rollback: str = "auto",
    rollback_memory_cap: Optional[int] = None,
    prefill_step_size: int = 2048,
    timed: bool = False,
    policy: Optional[DraftPolicy] = None,
    **run_options,
) -> tuple[Stats, list[int]]:
    """One generation (plain when ``drafter`` is None) with a fixed block size, or with ``policy``'s.

    ``run_options`` go to :func:`~specdec_cli.loop.runner.run` (prefill sizing, KV quantization).
    """
    return collect(run(
        model, prompt_ids, drafter=drafter, policy=policy if policy is not None else FixedLength(block_size - 1),
        max_tokens=max_tokens,
        eos_ids=eos_ids, sampling=sampling, rollback=rollback, rollback_memory_cap=rollback_memory_cap,
        prefill_step_size=prefill_step_size, timed=timed, **run_options,
    ))


@dataclass(frozen=True)
class SweepRow:
    """One block size, measured against plain decoding in the same run."""

    block_size: int
    decode_tps: float
    speedup: float
    acceptance: float
    mean_accepted_per_block: float
    draft_ms: float
    verify_ms: float
    rollback_ms: float
    syncs_per_block: float
    identical: bool
    verdict: str = "identical"
    warmup_s: float = 0.0
    adaptive: bool = False  # the draft length adapted (generate's default), up to block_size - 1

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class DefaultSetting:
    """What ``generate`` runs when no option says otherwise: its default block size, adaptive.

    Attributes:
        block_size: The drafter's default block size.
        policy: Makes a fresh adaptive policy for each run (a policy learns as it runs).
    """

    block_size: int
    policy: Callable[[], DraftPolicy]

    @property
    def label(self) -> str:
        return default_label(self.block_size)


def default_label(block_size: int) -> str:
    """How a sweep names generate's default setting."""
    return f"default (adaptive, block {block_size})"


@dataclass(frozen=True)
class SweepResult:
    """All rows, plain decoding's speed and the fastest block size."""

    ar_decode_tps: float
    rows: list[SweepRow]
    tokens: int
    # generate's own default, measured like the rows (None: not measured); never the "best block size",
    # which names a fixed size to pass as --block-size.
    default: Optional[SweepRow] = None

    @property
    def best_block_size(self) -> Optional[int]:
        return max(self.rows, key=lambda r: r.speedup).block_size if self.rows else None

    def to_dict(self) -> dict:
        default = None
        if self.default is not None:
            default = {"label": default_label(self.default.block_size), **self.default.to_dict()}
        return {
            "ar_decode_tps": self.ar_decode_tps,
            "best_block_size": self.best_block_size,
            "tokens": self.tokens,
            "rows": [r.to_dict() for r in self.rows],
            "default": default,
        }


@dataclass(frozen=True)
class Progress:
    """One measurement done (for a progress bar)."""

    done: int
    total: int
    label: str


def sweep(
    model: nn.Module,
    prompt_ids: Sequence[int],
    make_drafter: Callable[..., Drafter],
    block_sizes: Sequence[int],
    *,
    max_tokens: int,
    eos_ids: Sequence[int] = (),
    repeats: int = 1,
    warmup: int = 1,
    rollback: str = "auto",
    rollback_memory_cap: Optional[int] = None,
    prefill_step_size: int = 2048,
    prefill_seconds: Optional[float] = None,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    sync=None,
    default: Optional[DefaultSetting] = None,
    shapes: str = "auto",
) -> Iterator[Union[Progress, SweepResult]]:
    """Measure each block size against plain decoding; yields progress, then the result.

    Args:
        model: Target model.
        prompt_ids: Prompt token ids, shared by every run.
        make_drafter: Builds a fresh drafter for each run; for ``default``'s runs it is
            handed the run's policy (a lookup drafter sizes its drafts with it).
        block_sizes: Block sizes to measure (>= 1; 1 drafts nothing).
        max_tokens: Tokens per run.
        eos_ids: Ids that end a run.
        repeats: Speed runs per configuration (median reported).
        warmup: Untimed runs of plain and of the first block size before measuring
            (every run also warms the shapes it can use before its timing starts,
            so this is no longer needed for fair figures).
        rollback: Recurrent rollback strategy (``auto`` chooses per block size).
        rollback_memory_cap: Most extra bytes capture may hold per verify.
        prefill_step_size: Prompt chunk size.
        prefill_seconds: Size the first run's prefill chunks by time; every
            other run reuses its sizes, so all of them start from identical caches.
        kv_bits: Quantized KV cache for the target (None: off).
        kv_group_size: Its group size.
        sync: The ranks of a sharded target (see :mod:`specdec_cli.model.distributed`).
        default: Also measure ``generate``'s default setting, as one more configuration
            (its row is ``SweepResult.default``).
        shapes: Verify widths, ``auto``, ``exact`` or ``bucketed`` (see :mod:`specdec_cli.core.shapes`).
    """
    kw = dict(max_tokens=max_tokens, eos_ids=eos_ids, prefill_step_size=prefill_step_size,
              kv_bits=kv_bits, kv_group_size=kv_group_size, sync=sync)
    if prefill_seconds is not None:
        # One timed prefill fixes the chunk sizes for every run.
        first, _ = measure(model, prompt_ids, None, **dict(kw, max_tokens=1), prefill_seconds=prefill_seconds)
        kw["prefill_chunks"] = first.prefill_chunks
    spec_kw = dict(kw, rollback=rollback, rollback_memory_cap=rollback_memory_cap, shapes=shapes)
    # Every configuration: a fixed block size, or "default" (generate's own setting).
    configs: list[Union[int, str]] = [*block_sizes, *(["default"] if default is not None else [])]
    total = 2 * warmup + repeats * (1 + len(configs)) + len(configs)
    done = 0

    def step(label: str) -> Progress:
        nonlocal done
        done += 1
        return Progress(done, total, label)

    def name(c: Union[int, str]) -> str:
        return f"block {c}" if c != "default" else "default"

    def once(c: Union[int, str], timed: bool = False) -> tuple[Stats, list[int]]:
        if c == "default":
            policy = default.policy()
            return measure(model, prompt_ids, make_drafter(policy), default.block_size, policy=policy,
                           timed=timed, **spec_kw)
        return measure(model, prompt_ids, make_drafter(), c, timed=timed, **spec_kw)

    for _ in range(warmup):
        measure(model, prompt_ids, None, **kw)
        yield step("warm-up: plain")
        once(configs[0])
        yield step(f"warm-up: {name(configs[0])}")

    plain_tps: list[float] = []
    spec: dict[Union[int, str], list[Stats]] = {c: [] for c in configs}
    reference: list[int] = []
    verdict = {c: IDENTICAL for c in configs}
    warm_s = {c: 0.0 for c in configs}

    def judge(c: Union[int, str], stats: Stats, out: list[int]) -> None:
        # The first difference per configuration is explained (recomputed both ways).
        if out != reference and verdict[c] == IDENTICAL:
            d = explain(model, prompt_ids, out, reference, stats.trace, eos_ids=eos_ids,
                        prefill_step_size=prefill_step_size, prefill_chunks=kw.get("prefill_chunks"),
                        kv_bits=kv_bits, kv_group_size=kv_group_size, sync=sync)
            verdict[c] = d.verdict
        warm_s[c] += stats.warmup_s

    for _ in range(repeats):
        stats, reference = measure(model, prompt_ids, None, **kw)
        plain_tps.append(stats.decode_tps)
        yield step("plain")
        for c in configs:
            stats, out = once(c)
            spec[c].append(stats)
            judge(c, stats, out)
            yield step(name(c))

    rows: dict[Union[int, str], SweepRow] = {}
    for c in configs:
        timed, out = once(c, timed=True)
        judge(c, timed, out)
        yield step(f"{name(c)} (phase timing)")
        runs = spec[c]
        ms = timed.phase_ms or {"draft_ms": 0.0, "verify_ms": 0.0, "rollback_ms": 0.0}
        rows[c] = SweepRow(
            block_size=default.block_size if c == "default" else c,
            decode_tps=statistics.median(s.decode_tps for s in runs),
            # No ratio when nothing was generated (e.g. an EOS first): 0.0, shown as "-".
            speedup=statistics.median([s.decode_tps / p for s, p in zip(runs, plain_tps) if p > 0] or [0.0]),
            acceptance=runs[0].acceptance,
            mean_accepted_per_block=runs[0].mean_accepted_per_block,
            draft_ms=ms["draft_ms"],
            verify_ms=ms["verify_ms"],
            rollback_ms=ms["rollback_ms"],
            syncs_per_block=runs[0].syncs / max(runs[0].blocks, 1),
            identical=verdict[c] == IDENTICAL,
            verdict=verdict[c],
            warmup_s=warm_s[c],
            adaptive=c == "default",
        )
    yield SweepResult(statistics.median(plain_tps), [rows[b] for b in block_sizes], len(reference),
                      rows.get("default"))
