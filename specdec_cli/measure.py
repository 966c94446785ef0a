"""Measurements taken side by side in one process: plain decoding vs speculative block sizes.

Every configuration runs on the same prompt token ids with fresh caches, in
an interleaved order (plain, B1, B2, ..., plain, B1, ...) so a machine that
drifts slows all of them alike; a speedup is the median over repeats of the
per-repeat ratio to that repeat's plain run. Speed comes from runs without
phase timing; a separate timed run gives the per-phase milliseconds (its
extra syncs would otherwise slow the speed runs).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

import mlx.nn as nn

from .adaptive import FixedLength
from .compare import IDENTICAL, explain
from .drafters import Drafter
from .runner import collect, run
from .sampling import GREEDY, SamplingParams
from .stats import Stats


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
    **run_options,
) -> tuple[Stats, list[int]]:
    """One generation (plain when ``drafter`` is None) with a fixed block size.

    ``run_options`` go to :func:`~specdec_cli.runner.run` (prefill sizing, KV quantization).
    """
    return collect(run(
        model, prompt_ids, drafter=drafter, policy=FixedLength(block_size - 1), max_tokens=max_tokens,
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

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class SweepResult:
    """All rows, plain decoding's speed and the fastest block size."""

    ar_decode_tps: float
    rows: list[SweepRow]
    tokens: int

    @property
    def best_block_size(self) -> Optional[int]:
        return max(self.rows, key=lambda r: r.speedup).block_size if self.rows else None

    def to_dict(self) -> dict:
        return {
            "ar_decode_tps": self.ar_decode_tps,
            "best_block_size": self.best_block_size,
            "tokens": self.tokens,
            "rows": [r.to_dict() for r in self.rows],
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
    make_drafter: Callable[[], Drafter],
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
) -> Iterator[Union[Progress, SweepResult]]:
    """Measure each block size against plain decoding; yields progress, then the result.

    Args:
        model: Target model.
        prompt_ids: Prompt token ids, shared by every run.
        make_drafter: Builds a fresh drafter for each run.
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
        sync: The ranks of a sharded target (see :mod:`specdec_cli.distributed`).
    """
    kw = dict(max_tokens=max_tokens, eos_ids=eos_ids, prefill_step_size=prefill_step_size,
              kv_bits=kv_bits, kv_group_size=kv_group_size, sync=sync)
    if prefill_seconds is not None:
        # One timed prefill fixes the chunk sizes for every run.
        first, _ = measure(model, prompt_ids, None, **dict(kw, max_tokens=1), prefill_seconds=prefill_seconds)
        kw["prefill_chunks"] = first.prefill_chunks
    spec_kw = dict(kw, rollback=rollback, rollback_memory_cap=rollback_memory_cap)
    total = 2 * warmup + repeats * (1 + len(block_sizes)) + len(block_sizes)
    done = 0

    def step(label: str) -> Progress:
        nonlocal done
        done += 1
        return Progress(done, total, label)

    for _ in range(warmup):
        measure(model, prompt_ids, None, **kw)
        yield step("warm-up: plain")
        measure(model, prompt_ids, make_drafter(), block_sizes[0], **spec_kw)
        yield step(f"warm-up: block {block_sizes[0]}")

    plain_tps: list[float] = []
    spec: dict[int, list[Stats]] = {b: [] for b in block_sizes}
    reference: list[int] = []
    verdict = {b: IDENTICAL for b in block_sizes}
    warm_s = {b: 0.0 for b in block_sizes}

    def judge(b: int, stats: Stats, out: list[int]) -> None:
        # The first difference per block size is explained (recomputed both ways).
        if out != reference and verdict[b] == IDENTICAL:
            d = explain(model, prompt_ids, out, reference, stats.trace, eos_ids=eos_ids,
                        prefill_step_size=prefill_step_size, prefill_chunks=kw.get("prefill_chunks"),
                        kv_bits=kv_bits, kv_group_size=kv_group_size, sync=sync)
            verdict[b] = d.verdict
        warm_s[b] += stats.warmup_s

    for _ in range(repeats):
        stats, reference = measure(model, prompt_ids, None, **kw)
        plain_tps.append(stats.decode_tps)
        yield step("plain")
        for b in block_sizes:
            stats, out = measure(model, prompt_ids, make_drafter(), b, **spec_kw)
            spec[b].append(stats)
            judge(b, stats, out)
            yield step(f"block {b}")

    rows = []
    for b in block_sizes:
        timed, out = measure(model, prompt_ids, make_drafter(), b, timed=True, **spec_kw)
        judge(b, timed, out)
        yield step(f"block {b} (phase timing)")
        runs = spec[b]
        ms = timed.phase_ms or {"draft_ms": 0.0, "verify_ms": 0.0, "rollback_ms": 0.0}
        rows.append(SweepRow(
            block_size=b,
            decode_tps=statistics.median(s.decode_tps for s in runs),
            # No ratio when nothing was generated (e.g. an EOS first): 0.0, shown as "-".
            speedup=statistics.median([s.decode_tps / p for s, p in zip(runs, plain_tps) if p > 0] or [0.0]),
            acceptance=runs[0].acceptance,
            mean_accepted_per_block=runs[0].mean_accepted_per_block,
            draft_ms=ms["draft_ms"],
            verify_ms=ms["verify_ms"],
            rollback_ms=ms["rollback_ms"],
            syncs_per_block=runs[0].syncs / max(runs[0].blocks, 1),
            identical=verdict[b] == IDENTICAL,
            verdict=verdict[b],
            warmup_s=warm_s[b],
        ))
    yield SweepResult(statistics.median(plain_tps), rows, len(reference))
