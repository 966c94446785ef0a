"""What a run can fit: the model's context length and an estimate of peak memory.

Both are checked before the first forward, so a prompt that cannot run is
refused in seconds instead of failing (or swapping) minutes into a prefill.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .caches import ModelCache, make_cache

# Config keys that hold a context length, most specific first (HF names, then
# older GPT-style ones).
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length",
                 "max_seq_len", "n_ctx")
# RoPE scalings whose extended context is factor x the original one.
_SCALED = {"linear", "dynamic", "yarn"}


def context_length(config: dict) -> Optional[tuple[int, str]]:
    """The most tokens the model takes, and where that number came from.

    ``max_position_embeddings`` (or the family's equivalent, also inside a
    ``text_config``), extended by a ``linear``, ``dynamic`` or ``yarn`` RoPE
    scaling (factor x ``original_max_position_embeddings``). Scalings such as
    ``llama3`` and ``longrope`` already state the extended length there.

    Returns:
        ``(tokens, source)``, or None when the config names no limit (a
        pure-recurrent model, say).
    """
    for cfg in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            value = cfg.get(key)
            if isinstance(value, int) and value > 0:
                return _scaled(cfg, value, key)
    return None


def _scaled(cfg: dict, length: int, key: str) -> tuple[int, str]:
    rope = cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type")
    factor = rope.get("factor")
    if kind in _SCALED and isinstance(factor, (int, float)) and factor > 1:
        base = rope.get("original_max_position_embeddings") or length
        extended = int(base * factor)
        if extended > length:
            return extended, f"{key} {length}, {kind} RoPE scaling x{factor:g}"
    return length, key


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak memory of a run, in bytes, by part.

    Attributes:
        weights: Parameters of the target and the draft model.
        cache: KV caches (growing per token) and recurrent state (fixed) of
            both models for the whole run.
        scratch: The largest prefill chunk's attention scores, the biggest
            transient buffer of a long prompt.
    """

    weights: int
    cache: int
    scratch: int

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.scratch


def _nbytes(tree) -> int:
    return sum(a.nbytes for _, a in tree_flatten(tree) if isinstance(a, mx.array))


@dataclass(frozen=True)
class CacheGrowth:
    """How a model's caches grow: bytes per token of each attention layer, and the fixed recurrent state."""

    per_token: tuple[float, ...]
    fixed: int

    def bytes(self, tokens: int) -> int:
        """Bytes the caches hold after ``tokens`` tokens."""
        return sum(int(p * tokens) for p in self.per_token) + self.fixed


def cache_growth(model: nn.Module, kv_bits: Optional[int] = None, kv_group_size: int = 64) -> CacheGrowth:
    """Measure how the model's caches grow (one token through fresh caches; run it once per model).

    Measured, not derived from the config: each attention layer's bytes per
    token (its buffer over the positions it allocated) and each recurrent
    layer's fixed state are read off, so every family's head layout, dtype and
    quantization is counted as the model itself stores it.
    """
    cache = ModelCache(model, make_cache(model, kv_bits=kv_bits, kv_group_size=kv_group_size) if kv_bits else None)
    cache.feed(mx.array([0], dtype=mx.uint32))
    mx.eval(cache.state_arrays())
    per_token = []
    for c in cache._attention:
        if c.keys is None:
            continue
        keys = c.keys[0] if isinstance(c.keys, (tuple, list)) else c.keys
        per_token.append(_nbytes([c.keys, c.values]) / keys.shape[-2])
    return CacheGrowth(tuple(per_token), sum(_nbytes(c.cache) for c in cache._recurrent))


def cache_bytes(model: nn.Module, tokens: int, kv_bits: Optional[int] = None, kv_group_size: int = 64) -> int:
    """Bytes the model's caches hold after ``tokens`` tokens (see :func:`cache_growth`)."""
    return cache_growth(model, kv_bits, kv_group_size).bytes(tokens)


@dataclass(frozen=True)
class MemoryModel:
    """What a run's peak memory depends on, measured once per loaded model (no MLX work per estimate)."""

    weights: int
    target: CacheGrowth
    draft: Optional[CacheGrowth]
    heads: int

    def estimate(self, tokens: int, chunk: int) -> MemoryEstimate:
        """The peak memory of a run over ``tokens`` of context with prefill chunks of at most ``chunk``."""
        cache = self.target.bytes(tokens) + (self.draft.bytes(tokens) if self.draft is not None else 0)
        # Scores of one chunk's queries against the whole context, float32, per
        # head: one layer's worth is alive at a time.
        return MemoryEstimate(self.weights, cache, self.heads * min(chunk, tokens) * tokens * 4)


def memory_model(target: nn.Module, target_config: dict, draft: Optional[nn.Module],
                 kv_bits: Optional[int] = None, kv_group_size: int = 64, draft_cache: bool = True) -> MemoryModel:
    """Measure what :meth:`MemoryModel.estimate` needs.

    Args:
        target: The target model (loaded, cast).
        target_config: Its config.
        draft: The draft model (or a drafter's own weights), or None.
        kv_bits: The target's KV quantization, if any.
        kv_group_size: Its group size.
        draft_cache: The draft is an mlx-lm model with layer caches of its own.
    """
    weights = _nbytes(target.parameters()) + (_nbytes(draft.parameters()) if draft is not None else 0)
    grows = cache_growth(draft) if draft is not None and draft_cache else None
    return MemoryModel(weights, cache_growth(target, kv_bits, kv_group_size), grows, _heads(target_config))


def _heads(config: dict) -> int:
    for cfg in (config, config.get("text_config") or {}):
        for key in ("num_attention_heads", "n_head", "n_heads"):
            if isinstance(cfg.get(key), int):
                return cfg[key]
    return 0


def total_memory() -> Optional[int]:
    """The machine's memory in bytes (unified memory on Apple silicon); None when unknown.

    Unlike :func:`device_memory` (what this process can use now), a fixed figure: a bound set from it
    does not move with the load.
    """
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def device_memory() -> Optional[tuple[int, str]]:
    """Bytes this process can use, and what the figure is; None when unknown.

    On Metal: MLX's recommended working set; on CUDA the GPU's memory as
    MLX reports it. On Linux otherwise: the RAM the kernel
    reports available plus what MLX already holds (the loaded weights).
    """
    try:
        if mx.metal.is_available():
            info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
            return int(info["max_recommended_working_set_size"]), "MLX's recommended working set"
        if hasattr(mx, "cuda") and mx.cuda.is_available():
            size = mx.device_info().get("memory_size")
            return (int(size), "the GPU's memory") if size else None
    except (AttributeError, KeyError, RuntimeError, TypeError, ValueError):
        pass
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        available = int(line.split()[1]) * 1024
                        return available + mx.get_active_memory(), "available RAM"
        except (OSError, ValueError, IndexError):
            return None
    return None


def wire_working_set() -> Optional[int]:
    """Wire MLX's recommended working set, as mlx-lm's generate, server and trainer do on Apple silicon.

    Wired memory keeps the weights resident between forwards (unwired, a model near the working set is
    paged out and decodes slower than mlx-lm). Set for the process, as mlx_lm.server does.

    Returns:
        The limit set in bytes, or None where the device recommends none (the CPU, CUDA): nothing changed.
    """
    try:
        size = (mx.device_info() or {}).get("max_recommended_working_set_size")
    except (AttributeError, RuntimeError):
        return None
    if not size:
        return None
    mx.set_wired_limit(int(size))
    return int(size)


def gb(n: int) -> str:
    """Bytes as GB with one decimal (0.01 under one GB)."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e9:.2f} GB"
