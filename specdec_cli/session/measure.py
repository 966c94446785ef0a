"""Measurements taken side by side in one process: plain decoding vs speculative block sizes.

Every configuration runs on the same prompt token ids with fresh caches, in
an interleaved order (plain, B1, B2, ..., plain, B1, ...) so a machine that
drifts slows all of them alike; a speedup is the median over repeats of the
per-repeat ratio to that repeat's plain run. Speed comes from runs without
phase timing; a separate timed run gives the per-phase milliseconds (its
extra syncs would otherwise slow the speed runs). Besides the fixed block
sizes a sweep can measure ``generate``'s own default (adaptive, its default
block size), the setting a user would otherwise run without knowing its speed.
Each speculative run is a request alone in the loop ``generate`` drives;
plain decoding is the oracle's.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import mlx.nn as nn

from ..core.stats import Stats
from ..loop.compare import IDENTICAL, explain
from ..loop.events import collect
from ..loop.runner import run
from .generate import Session
from ..core.request import Request
from .setup import Setup


def measure_plain(model: nn.Module, prompt_ids: Sequence[int], **run_options) -> tuple[Stats, list[int]]:
    """One plain decoding run: the baseline and the reference.

    Args:
        model: The target model.
        prompt_ids: Prompt token ids.
        **run_options: For :func:`~specdec_cli.loop.runner.run` (tokens, EOS, prefill sizing, KV quantization, ranks).
    """
    return collect(run(model, prompt_ids, **run_options))


@dataclass(frozen=True)
class SweepRow:
    """One block size, measured against plain decoding in the same run."""

    block_size: int
    decode_tps: float
    speedup: float
    acceptance: Optional[float]  # None where nothing was drafted (as generate's JSON): 0.0 reads as all rejected
    mean_accepted_per_block: Optional[float]
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
        # No tokens (an end-of-sequence first): every speedup is 0.0, and the first size would be named at random.
        return max(self.rows, key=lambda r: r.speedup).block_size if self.rows and self.tokens else None

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
    setup: Setup,
    prompt_ids: Sequence[int],
    block_sizes: Sequence[int],
    *,
    max_tokens: int,
    repeats: int = 1,
    warmup: int = 1,
    default_block: Optional[int] = None,
    prefill_seconds: Optional[float] = None,
) -> Iterator[Union[Progress, SweepResult]]:
    """Measure each block size against plain decoding; yields progress, then the result.

    Each speculative run is a request decoded as the only row of the loop every
    face drives (:meth:`Session.generate <.generate.Session.generate>`), with
    the options of ``setup`` (rollback, shapes, KV quantization, prefill step);
    plain decoding, the baseline and the reference, is the oracle
    (:func:`~specdec_cli.loop.runner.run` without a drafter).

    Args:
        setup: The loaded models and drafter kind.
        prompt_ids: Prompt token ids, shared by every run.
        block_sizes: Block sizes to measure (>= 1; 1 drafts nothing).
        max_tokens: Tokens per run.
        repeats: Speed runs per configuration (median reported).
        warmup: Untimed runs of plain and of the first block size before measuring
            (every run also warms the shapes it can use before its timing starts,
            so this is no longer needed for fair figures).
        default_block: Also measure ``generate``'s default setting, adaptive up to this
            block size, as one more configuration (its row is ``SweepResult.default``).
        prefill_seconds: Size the first run's prefill chunks by time; every
            other run reuses its sizes, so all of them start from identical caches.
    """
    opts = setup.options
    model = setup.target.model
    kw = dict(max_tokens=max_tokens, eos_ids=setup.eos_ids, prefill_step_size=opts.prefill_step_size,
              kv_bits=opts.kv_bits, kv_group_size=opts.kv_group, sync=setup.ranks)
    chunks = None
    if prefill_seconds is not None:
        # One timed prefill fixes the chunk sizes for every run.
        first, _ = measure_plain(model, prompt_ids, **dict(kw, max_tokens=1), prefill_seconds=prefill_seconds)
        chunks = kw["prefill_chunks"] = first.prefill_chunks
    # One session per configuration, none keeping caches: every run starts from the same fresh ones.
    sessions: dict[Union[int, str], Session] = {
        b: Session(setup, b, adaptive=False, prefill_seconds=None, prefill_chunks=chunks) for b in block_sizes}
    if default_block is not None:
        sessions["default"] = Session(setup, default_block, adaptive=True, prefill_seconds=None,
                                      prefill_chunks=chunks)
    configs = list(sessions)
    total = 2 * warmup + repeats * (1 + len(configs)) + len(configs)
    done = 0

    def step(label: str) -> Progress:
        nonlocal done
        done += 1
        return Progress(done, total, label)

    def name(c: Union[int, str]) -> str:
        return f"block {c}" if c != "default" else "default"

    def once(c: Union[int, str], timed: bool = False) -> tuple[Stats, list[int]]:
        return collect(sessions[c].generate(Request(list(prompt_ids), max_tokens, timed=timed)))

    for _ in range(warmup):
        measure_plain(model, prompt_ids, **kw)
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
            d = explain(model, prompt_ids, out, reference, stats.trace, eos_ids=setup.eos_ids,
                        prefill_step_size=opts.prefill_step_size, prefill_chunks=stats.prefill_chunks,
                        kv_bits=opts.kv_bits, kv_group_size=opts.kv_group, sync=setup.ranks)
            verdict[c] = d.verdict
        warm_s[c] += stats.warmup_s

    for _ in range(repeats):
        stats, reference = measure_plain(model, prompt_ids, **kw)
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
            block_size=default_block if c == "default" else c,
            decode_tps=statistics.median(s.decode_tps for s in runs),
            # No ratio when nothing was generated (e.g. an EOS first): 0.0, shown as "-".
            speedup=statistics.median([s.decode_tps / p for s, p in zip(runs, plain_tps) if p > 0] or [0.0]),
            acceptance=runs[0].shown_acceptance,
            mean_accepted_per_block=runs[0].shown_accepted_per_block,
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
