"""Each layer cache kind of the engine's layout as named arrays, and back (as mlx-lm's ``state`` / ``meta_state``).

What a stored cache is made of, in one place, for whatever stores it (the prompt
cache's disk tier today). Two families:

- *position rows*: attention layers that keep every key (plain, quantized,
  chunked): any span of positions can be taken out (:func:`position_rows`) and
  the first ``n`` put back from pieces (:func:`restore_rows`);
- *fixed state*: the layers that cannot go back to a shorter length (recurrent
  state, a sliding window that drops keys): their whole state at one length
  (:func:`fixed_state`, :func:`restore_fixed`).

:func:`signature` names a leaf's kind and settings, so arrays made for another
layout are never put into it. Array names are the leaf's own (``k0``, ``v0``,
``a1``, ``wk``); a store prefixes the leaf's index.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

from .caches import ChunkKVCache, WindowKVCache, WindowQuantizedKVCache, buffer_arrays, fixed_position, leaves

__all__ = ["check_fixed", "fixed_position", "fixed_state", "leaves", "position_rows", "restore_fixed",
           "restore_rows", "row_names", "signature"]


def signature(leaf: Any) -> str:
    """A leaf's type and settings (arrays of another layout are not put into it).

    Raises:
        TypeError: A layer kind outside the engine's layout.
    """
    t = type(leaf)
    if t in (QuantizedKVCache, WindowQuantizedKVCache):
        return f"{t.__name__}:{leaf.group_size}:{leaf.bits}"
    if t is WindowKVCache:
        return f"WindowKVCache:{leaf.window}"
    if t is ArraysCache:
        return f"ArraysCache:{len(leaf.cache)}"
    if t in (KVCache, ChunkKVCache):
        return t.__name__
    raise TypeError(f"a {t.__name__} layer cache has no stored form")


def row_names(leaf: Any) -> list[str]:
    """The names :func:`position_rows` gives a position-row leaf's arrays: keys then values, each part of a
    quantized one."""
    parts = 3 if isinstance(leaf, QuantizedKVCache) else 1
    return [f"{side}{e}" for side in ("k", "v") for e in range(parts)]


def position_rows(leaf: Any, lo: int, hi: int) -> dict[str, mx.array]:
    """Positions ``lo:hi`` of a position-row leaf's keys and values (each part of a quantized one)."""
    out = {}
    for side, x in (("k", leaf.keys), ("v", leaf.values)):
        for e, a in enumerate(buffer_arrays(x)):
            out[f"{side}{e}"] = a[..., lo:hi, :]
    return out


def restore_rows(leaf: Any, rows: dict[str, mx.array], n: int) -> None:
    """Put the first ``n`` positions (``rows``, named as :func:`row_names` says) into a fresh leaf.

    Raises:
        ValueError: The rows are not ``n`` positions long.
    """
    sides = {}
    for side in ("k", "v"):
        parts = [rows[name] for name in row_names(leaf) if name[0] == side]
        if any(p.shape[-2] != n for p in parts):
            raise ValueError(f"{len(parts[0].shape) and parts[0].shape[-2]} rows where {n} were expected")
        sides[side] = tuple(parts) if isinstance(leaf, QuantizedKVCache) else parts[0]
    leaf.keys, leaf.values, leaf.offset = sides["k"], sides["v"], n


def fixed_state(leaf: Any) -> tuple[dict[str, mx.array], dict]:
    """The whole state of a fixed-position leaf: its arrays, and what else restores it (JSON-able)."""
    if type(leaf) is ArraysCache:
        return ({f"a{e}": a for e, a in enumerate(leaf.cache) if a is not None},
                {"none": [e for e, a in enumerate(leaf.cache) if a is None]})
    # A sliding window: its buffer from ``start`` to its offset.
    stop = leaf.offset - leaf.start
    return ({"wk": leaf.keys[..., :stop, :], "wv": leaf.values[..., :stop, :]},
            {"start": leaf.start, "offset": leaf.offset, "span": leaf._span})


def check_fixed(leaf: Any, arrays: dict[str, mx.array], info: dict, n: int) -> None:
    """Refuse a fixed state that would not put ``leaf`` at ``n`` tokens (without changing ``leaf``).

    Raises:
        KeyError: An array is missing.
        ValueError: A window's rows do not match its offsets.
    """
    if type(leaf) is ArraysCache:
        for e in range(len(leaf.cache)):
            if e not in info["none"]:
                arrays[f"a{e}"]
        return
    k = arrays["wk"]
    arrays["wv"]
    if info["offset"] != n or k.shape[-2] != n - info["start"]:
        raise ValueError("a window's rows do not match its offsets")


def restore_fixed(leaf: Any, arrays: dict[str, mx.array], info: dict, n: int) -> None:
    """Put a fixed state (:func:`fixed_state`'s, at ``n`` tokens) into a fresh leaf (check it first:
    :func:`check_fixed`)."""
    if type(leaf) is ArraysCache:
        leaf.cache = [None if e in info["none"] else arrays[f"a{e}"] for e in range(len(leaf.cache))]
        return
    leaf.keys, leaf.values = arrays["wk"], arrays["wv"]
    leaf.start, leaf.offset = info["start"], n
    leaf._span = max(leaf._span, info["span"])
