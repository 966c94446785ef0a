"""Run statistics, each number with one definition.

- acceptance = accepted / drafted (drafts the target agreed with, over drafts
  it verified);
- mean accepted per block = accepted / blocks that drafted anything;
- tokens per block = committed tokens / target forwards (blocks), where the
  committed tokens are the generated ones plus the end-of-sequence token when
  the run ended on one (the target's forward chose it; it is not emitted).
  Every forward commits at least one token, so this is never below 1;
- decode tok/s = generated / time spent inside the engine (display excluded);
- prompt tok/s = prompt tokens prefilled (those a prompt cache held are not)
  / prefill time (target and drafter), timed apart from decoding;
- warm-up = seconds spent running each shape once before decoding (kernel
  compilation), in neither prefill nor decode time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from .blocks import Block


@dataclass
class Stats:
    """Accumulates :class:`Block` results of one generation."""

    prompt_tokens: int = 0
    # Prompt tokens a prompt cache held (not prefilled).
    cached_tokens: int = 0
    # Of those, the tokens read from the prompt cache's disk tier (the rest were in memory).
    disk_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    generated: int = 0
    drafted: int = 0
    accepted: int = 0
    syncs: int = 0
    histogram: Counter = field(default_factory=Counter)
    position_drafted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    rollbacks: Counter = field(default_factory=Counter)
    # (drafted, accepted) of every block, in order.
    block_log: list = field(default_factory=list)
    timed_blocks: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    rollback_s: float = 0.0
    finish_reason: Optional[str] = None
    # The recurrent rollback strategy chosen and why (RollbackChoice.to_dict()).
    rollback_choice: Optional[dict] = None
    # Bytes held by the layer caches when generation ended: target, drafter.
    cache_bytes: dict = field(default_factory=dict)
    # The target's prefill chunk sizes (to reproduce its caches in a second run).
    prefill_chunks: tuple = ()
    warmup_s: float = 0.0
    # Row counts warmed (target, drafter) and whether the backend measured free.
    warmup_rows: tuple = ((), ())
    warmup_free: bool = False
    # Verify shapes: exact or bucketed (specdec_cli.core.shapes), and each verify forward's rows x positions, counted.
    shapes: str = "exact"
    verify_shapes: Counter = field(default_factory=Counter)
    # Blocks whose first row came from a forward queued ahead (Block.ahead: pipelined as plain decoding is).
    pipelined: int = 0
    # Every block, in order (what --compare-ar needs to recompute a position).
    trace: list = field(default_factory=list, repr=False)

    def note(self, event) -> None:
        """Take what a runner's ``Prefilled``, ``Warmed`` or ``Finished`` event reports."""
        if hasattr(event, "prompt_tokens"):
            self.prompt_tokens, self.prefill_s = event.prompt_tokens, event.seconds
            self.cached_tokens = getattr(event, "cached", 0)
            self.disk_tokens = getattr(event, "disk", 0)
            self.prefill_chunks = tuple(getattr(event, "chunks", ()))
            if getattr(event, "rollback", None) is not None:
                self.rollback_choice = event.rollback.to_dict()
            self.shapes = getattr(event, "shapes", self.shapes)
        if getattr(event, "what", None) is not None:
            self.warm(event)
        if getattr(event, "cache_bytes", None) is not None:
            self.cache_bytes = dict(event.cache_bytes)

    def warm(self, event) -> None:
        """Record a :class:`~specdec_cli.loop.events.Warmed` event."""
        self.warmup_s += event.seconds
        self.warmup_rows = (event.what.target_rows, event.what.drafter_rows)
        self.warmup_free = event.what.free

    def add(self, block: Block, seconds: float) -> None:
        """Count one block that took ``seconds`` inside the engine."""
        self.decode_s += seconds
        self.generated += len(block.tokens)
        self.syncs += block.syncs
        # The engine says "stop" for an EOS, as mlx-lm does; reports say "eos".
        reason = "eos" if block.finish_reason == "stop" else block.finish_reason
        self.finish_reason = reason or self.finish_reason
        self.block_log.append((block.drafted, block.accepted))
        self.trace.append(block)
        if block.ahead:
            self.pipelined += 1
            self.verify_shapes[(1, 1)] += 1  # the one-row forward queued ahead
        if block.verify_len:
            self.verify_shapes[(1, block.verify_len)] += 1
        if block.drafted:
            self.drafted += block.drafted
            self.accepted += block.accepted
            self.histogram[block.accepted] += 1
            grow = block.drafted - len(self.position_drafted)
            if grow > 0:
                self.position_drafted += [0] * grow
                self.position_accepted += [0] * grow
            for i in range(block.drafted):
                self.position_drafted[i] += 1
                self.position_accepted[i] += int(i < block.accepted)
        self.rollbacks[block.rollback] += 1
        if block.times is not None:
            self.timed_blocks += 1
            self.draft_s += block.times.draft_s
            self.verify_s += block.times.verify_s
            self.rollback_s += block.times.rollback_s

    @property
    def blocks(self) -> int:
        """Target forwards."""
        return len(self.block_log)

    @property
    def drafting_blocks(self) -> int:
        """Blocks that drafted at least one token."""
        return sum(self.histogram.values())

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_per_block(self) -> float:
        return self.accepted / self.drafting_blocks if self.drafting_blocks else 0.0

    # What the faces show: None where nothing was drafted, since 0/0 is no rate (0.0 reads as every draft rejected).
    @property
    def shown_acceptance(self) -> Optional[float]:
        return self.acceptance if self.drafted else None

    @property
    def shown_accepted_per_block(self) -> Optional[float]:
        return self.mean_accepted_per_block if self.drafted else None

    @property
    def committed(self) -> int:
        """Tokens the target's forwards committed: the generated ones, plus a final EOS."""
        # Only the run's last block can end on an EOS, so at most one is added.
        return self.generated + (self.finish_reason == "eos")

    @property
    def tokens_per_block(self) -> float:
        """Committed tokens per target forward; at least 1 once a block ran."""
        return self.committed / self.blocks if self.blocks else 0.0

    @property
    def decode_tps(self) -> float:
        return self.generated / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_finished(self) -> bool:
        """Whether the prefill reported its time: not when Ctrl-C stopped it (no prefill time, no prompt rate)."""
        return self.prefill_s > 0 or self.blocks > 0

    @property
    def prompt_tps(self) -> float:
        return (self.prompt_tokens - self.cached_tokens) / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Acceptance of the i-th draft of a block, given it was verified."""
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    @property
    def phase_ms(self) -> Optional[dict[str, float]]:
        """Mean draft / verify / rollback milliseconds per block, when timed."""
        if not self.timed_blocks:
            return None
        n = self.timed_blocks
        return {
            "draft_ms": 1000 * self.draft_s / n,
            "verify_ms": 1000 * self.verify_s / n,
            "rollback_ms": 1000 * self.rollback_s / n,
        }

    def to_dict(self) -> dict:
        """The numbers as plain JSON-ready values."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "disk_tokens": self.disk_tokens,
            "generated_tokens": self.generated,
            # null, not 0.0, for a prefill Ctrl-C stopped: it ran for seconds and measured nothing.
            "prefill_s": self.prefill_s if self.prefill_finished else None,
            "prompt_tps": self.prompt_tps if self.prefill_finished else None,
            "warmup_s": self.warmup_s,
            "warmup_shapes": len(self.warmup_rows[0]),
            "shapes": self.shapes,
            "verify_shapes": {f"{r}x{t}": n for (r, t), n in sorted(self.verify_shapes.items())},
            "decode_s": self.decode_s,
            "decode_tps": self.decode_tps,
            "blocks": self.blocks,
            "pipelined_blocks": self.pipelined,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": self.shown_acceptance,
            "mean_accepted_per_block": self.shown_accepted_per_block,
            "tokens_per_block": self.tokens_per_block,
            "accepted_histogram": {str(k): v for k, v in sorted(self.histogram.items())},
            "acceptance_by_position": self.acceptance_by_position,
            "rollbacks": dict(self.rollbacks),
            "rollback_choice": self.rollback_choice,
            "cache_bytes": self.cache_bytes,
            "rollback_s": self.rollback_s if self.timed_blocks else None,
            "phase_ms": self.phase_ms,
            "syncs_per_block": self.syncs / self.blocks if self.blocks else 0.0,
            "finish_reason": self.finish_reason,
        }


@dataclass
class BatchStats:
    """A batch of rows decoded together (``generate --prompts-file``), each number with one definition.

    - aggregate tok/s = every row's generated tokens / decode seconds, the time
      inside engine blocks (a block counts once, however many rows it decoded);
    - a row's latency = seconds from the batch's start to the row's last token
      (waiting for a free row, its prefill and every block before included);
    - wall = seconds from the batch's start to the last row's end: prefill, decode
      and the bookkeeping between them (display not counted);
    - plain aggregate tok/s (``--compare-ar``) = plain decoding's tokens / its
      decode seconds, each prompt alone, one after another.
    """

    rows: int = 0
    concurrency: int = 0
    most_rows: int = 0
    blocks: int = 0
    generated: int = 0
    decode_s: float = 0.0
    prefill_s: float = 0.0
    wall_s: float = 0.0
    planner_s: float = 0.0
    # Each finished row's latency, in the order the rows finished.
    latencies: list = field(default_factory=list)
    # --compare-ar: each row's verdict counted, and plain decoding's totals.
    verdicts: Counter = field(default_factory=Counter)
    plain_generated: int = 0
    plain_decode_s: float = 0.0

    @property
    def aggregate_tps(self) -> float:
        return self.generated / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def mean_latency_s(self) -> Optional[float]:
        return sum(self.latencies) / len(self.latencies) if self.latencies else None

    @property
    def worst_latency_s(self) -> Optional[float]:
        return max(self.latencies) if self.latencies else None

    @property
    def plain_aggregate_tps(self) -> float:
        return self.plain_generated / self.plain_decode_s if self.plain_decode_s > 0 else 0.0

    @property
    def speedup(self) -> Optional[float]:
        """Aggregate tok/s over plain decoding's, one prompt after another (None: nothing to measure)."""
        if not (self.generated and self.plain_generated and self.aggregate_tps and self.plain_aggregate_tps):
            return None
        return self.aggregate_tps / self.plain_aggregate_tps

    def to_dict(self) -> dict:
        """The numbers as plain JSON-ready values."""
        compare = None
        if self.verdicts:
            compare = {
                "identical": self.verdicts["identical"],
                "rounding_tie": self.verdicts["rounding tie"],
                "diverged": self.verdicts["diverged"],
                "ar_generated_tokens": self.plain_generated,
                "ar_decode_s": self.plain_decode_s,
                "ar_aggregate_tps": self.plain_aggregate_tps,
                "speedup": self.speedup,
            }
        return {
            "rows": self.rows,
            "decode_concurrency": self.concurrency,
            "most_rows_together": self.most_rows,
            "blocks": self.blocks,
            "generated_tokens": self.generated,
            "decode_s": self.decode_s,
            "aggregate_tps": self.aggregate_tps,
            "prefill_s": self.prefill_s,
            "wall_s": self.wall_s,
            "planner_s": self.planner_s,
            "mean_latency_s": self.mean_latency_s,
            "worst_latency_s": self.worst_latency_s,
            "compare": compare,
        }
