#!/usr/bin/env python
"""What one shape's first run costs on this device: attention per key length, 4-bit matmul per row count.

Prints one JSON line per measurement as it goes. Shapes are SmolLM2-135M's (9 query heads, 3 KV heads,
head dim 64; 4-bit 576 x 1536 projections). For each attention variant it
times, per query width, the first call at each of several new key lengths
and a repeat of the same shape: a first call much slower than the repeat
means the backend builds something per key length. Run it twice to compare
``MLX_CUDA_USE_CUDNN_SDPA=0`` against the default.

Usage: python scripts/gpu_probe.py [--widths 1,4,16,64] [--lengths 8]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import mlx.core as mx


START = time.perf_counter()


def timed(fn) -> float:
    t = time.perf_counter()
    mx.eval(fn())
    return (time.perf_counter() - t) * 1000


def say(**fields) -> None:
    """One JSON line now (a run cut off by its time box still shows how far it got)."""
    print(json.dumps({"t_s": round(time.perf_counter() - START, 2), **fields}), flush=True)


def smoke() -> None:
    """The first run of a few basic kernels: what a cold process pays before anything of its own."""
    a = mx.ones((64, 64))
    say(step="first add", ms=round(timed(lambda: a + 1), 1))
    say(step="second add", ms=round(timed(lambda: a + 2), 1))
    say(step="first matmul f32", ms=round(timed(lambda: a @ a), 1))
    b = a.astype(mx.bfloat16)
    say(step="first matmul bf16", ms=round(timed(lambda: b @ b), 1))
    say(step="first softmax bf16", ms=round(timed(lambda: mx.softmax(b, axis=-1)), 1))


def attention(widths: list[int], lengths: int, dtype) -> dict:
    out = {}
    heads, kv, dim, base = 9, 3, 64, 300
    for variant in ("causal", "array", "none"):
        rows = {}
        for w in widths:
            first, again = [], []
            for i in range(lengths):
                n = base + 37 * i + w  # a new key length each time
                q = mx.random.normal((1, heads, w, dim)).astype(dtype)
                k = mx.random.normal((1, kv, n, dim)).astype(dtype)
                v = mx.random.normal((1, kv, n, dim)).astype(dtype)
                if variant == "causal":
                    mask = "causal"
                elif variant == "array":
                    mask = mx.arange(n)[None, :] <= (mx.arange(w)[:, None] + n - w)
                else:
                    mask = None
                if w == 1 and variant == "causal":
                    mask = None
                mx.eval(q, k, v)
                call = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=dim ** -0.5, mask=mask)
                first.append(timed(call))
                again.append(timed(call))
            rows[str(w)] = {"first_ms": [round(x, 2) for x in first], "again_ms": [round(x, 2) for x in again]}
            say(attention=variant, width=w, **rows[str(w)])
        out[variant] = rows
    return out


def quantized(rows: list[int]) -> dict:
    w = mx.random.normal((1536, 576)).astype(mx.bfloat16)
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    res = {}
    for r in rows:
        x = mx.random.normal((1, r, 576)).astype(mx.bfloat16)
        mx.eval(x)
        call = lambda: mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=4)
        res[str(r)] = [round(timed(call), 2), round(timed(call), 2)]
        say(quantized_rows=r, first_again_ms=res[str(r)])
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="1,4,16,64")
    ap.add_argument("--lengths", type=int, default=6)
    ap.add_argument("--smoke", action="store_true", help="Only the basic kernels' first runs")
    args = ap.parse_args()
    widths = [int(x) for x in args.widths.split(",")]
    say(device=str(mx.default_device()), mlx=mx.__version__, cudnn_sdpa_env=os.environ.get("MLX_CUDA_USE_CUDNN_SDPA"))
    smoke()
    if args.smoke:
        return
    quantized([1, 2, 3, 4, 8, 9, 16, 17, 64])
    attention(widths, args.lengths, mx.bfloat16)


if __name__ == "__main__":
    main()
