"""``--compare-ar``: plain greedy decoding on the same prompt ids, side by side."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from .caches import ModelCache, make_cache
from .runner import collect, run
from .stats import Stats


@dataclass(frozen=True)
class Divergence:
    """Where speculative and plain output first differ.

    Attributes:
        index: Position in the generated tokens.
        specdec_token: Token speculative decoding produced there (None: it ended).
        plain_token: Token plain decoding produced there (None: it ended).
        top2_margin: Target's top-1 minus top-2 logit at that position (one-token decode).
    """

    index: int
    specdec_token: Optional[int]
    plain_token: Optional[int]
    top2_margin: Optional[float]


@dataclass(frozen=True)
class Comparison:
    """The verdict and the plain run's own statistics."""

    identical: bool
    tokens: int
    divergence: Optional[Divergence]
    plain: Stats


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first difference between two token lists (None if equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_margin(model: nn.Module, ids: Sequence[int], kv_bits: Optional[int] = None,
                kv_group_size: int = 64) -> float:
    """Top-1 minus top-2 logit of the target's next-token prediction after ``ids``."""
    cache = ModelCache(model, make_cache(model, kv_bits=kv_bits, kv_group_size=kv_group_size) if kv_bits else None)
    cache.prefill(ids[:-1])
    logits = cache.feed(mx.array(ids[-1:], dtype=mx.uint32))[-1].astype(mx.float32)
    top = mx.topk(logits, 2)
    return (top.max() - top.min()).item()


def compare_with_plain(
    model: nn.Module,
    prompt_ids: Sequence[int],
    specdec_tokens: Sequence[int],
    *,
    max_tokens: int,
    eos_ids: Sequence[int] = (),
    prefill_step_size: int = 2048,
    prefill_chunks: Optional[Sequence[int]] = None,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
) -> Comparison:
    """Run plain greedy decoding with fresh caches and compare token by token.

    ``prefill_chunks`` (the speculative run's) makes both prefills identical;
    ``kv_bits`` gives plain decoding the same quantized KV cache.
    """
    kv = dict(kv_bits=kv_bits, kv_group_size=kv_group_size)
    stats, plain = collect(run(model, prompt_ids, max_tokens=max_tokens, eos_ids=eos_ids,
                               prefill_step_size=prefill_step_size, prefill_chunks=prefill_chunks, **kv))
    index = first_divergence(specdec_tokens, plain)
    divergence = None
    if index is not None:
        at = lambda seq: seq[index] if index < len(seq) else None  # noqa: E731
        divergence = Divergence(
            index, at(specdec_tokens), at(plain),
            top2_margin(model, list(prompt_ids) + plain[:index], **kv),
        )
    return Comparison(index is None, len(plain), divergence, stats)
