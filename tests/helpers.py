"""Shared builders for the tests: tiny random models and run helpers."""

from __future__ import annotations

import functools

import mlx.core as mx

from specdec_cli.caches import ModelCache, WindowKVCache
from specdec_cli.drafters import ModelDrafter
from specdec_cli.engine import Block, plain_generate_step, speculative_generate_step
from specdec_cli.synthetic import TINY_CONFIGS, build_model, perturb

FAMILIES = ["llama", "qwen3", "gemma3_text", "qwen3_5", "nemotron_h"]
DTYPES = ["float32", "bfloat16"]
# Byte-level tokenizer: ids are bytes. Longer than gemma3's 8-token window.
PROMPT = list(b"The quick brown fox jumps over the lazy dog, twice: the quick brown fox.")
GEN = 40
# Relative weight noise that gives the drafter a mix of accepts and rejects.
NOISE = {"gemma3_text": 0.02}


@functools.cache
def target(family: str, dtype: str):
    return build_model(TINY_CONFIGS[family], seed=0, dtype=getattr(mx, dtype))


@functools.cache
def noisy_drafter(family: str, dtype: str):
    model = build_model(TINY_CONFIGS[family], seed=0, dtype=getattr(mx, dtype))
    perturb(model, NOISE.get(family, 0.05), seed=1000)
    return model


def prefilled(model, prompt=PROMPT) -> ModelCache:
    cache = ModelCache(model)
    cache.prefill(prompt[:-1])
    return cache


def fed(model, ids: list[int], prompt_len: int = len(PROMPT) - 1) -> ModelCache:
    """A cache built directly: the prompt prefilled, then one token at a time."""
    cache = ModelCache(model)
    cache.prefill(ids[:prompt_len])
    for t in ids[prompt_len:]:
        cache.feed(mx.array([t], dtype=mx.uint32))
    mx.eval(cache.state_arrays())
    return cache


def tokens(blocks: list[Block]) -> list[int]:
    return [t for b in blocks for t in b.tokens]


def plain(model, max_tokens=GEN, prompt=PROMPT, eos_ids=()) -> tuple[list[int], ModelCache]:
    """Plain greedy output and the cache it leaves behind."""
    cache = prefilled(model, prompt)
    out = tokens(list(plain_generate_step(prompt[-1], cache, max_tokens=max_tokens, eos_ids=eos_ids)))
    return out, cache


def speculative(model, draft_model, k, max_tokens=GEN, prompt=PROMPT, eos_ids=(), timed=False,
                rollback="reforward"):
    """Speculative blocks plus the target cache and the drafter, after the run."""
    cache = prefilled(model, prompt)
    drafter = ModelDrafter(draft_model)
    drafter.prefill(prompt[:-1])
    blocks = list(
        speculative_generate_step(
            prompt[-1], cache, drafter, num_draft_tokens=k, max_tokens=max_tokens,
            eos_ids=eos_ids, timed=timed, rollback=rollback,
        )
    )
    return blocks, cache, drafter


def cache_arrays(cache: ModelCache) -> list[mx.array]:
    """The meaningful contents of every layer cache, in layer order.

    KV caches contribute keys/values up to their offset (the buffer past it
    is scratch; a sliding-window cache, from the first position the next
    forward attends to); recurrent caches contribute every array they hold.
    """
    out = []
    for c in cache._attention:
        out.append(mx.array(c.offset))
        if isinstance(c, WindowKVCache):
            if c.keys is not None:
                out += list(c.live(c.needed_from))
        elif c.keys is not None:
            out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    for c in cache._recurrent:
        out += [a for a in c.cache if a is not None]
    return out


def max_cache_diff(a: ModelCache, b: ModelCache) -> float:
    """Largest absolute difference between two caches (offsets must match)."""
    xs, ys = cache_arrays(a), cache_arrays(b)
    assert len(xs) == len(ys)
    assert a.length == b.length
    worst = 0.0
    for x, y in zip(xs, ys):
        assert x.shape == y.shape, (x.shape, y.shape)
        if x.ndim == 0:
            assert x.item() == y.item(), "offsets differ"
            continue
        worst = max(worst, mx.abs(x.astype(mx.float32) - y.astype(mx.float32)).max().item())
    return worst
