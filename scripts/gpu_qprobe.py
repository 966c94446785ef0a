#!/usr/bin/env python
"""Which 4-bit / 8-bit quantized matmuls MLX's backend runs, each in its own process under a time box.

A first call that never returns (a kernel that compiles for minutes, or hangs) shows as a timeout
instead of stopping the check. One JSON line per configuration: activation dtype, group size, bits,
rows, and the first and second call's milliseconds.

With ``--warm ROWS``, it instead forwards the bundled 4-bit model at each row count, one process
per count, all at once (compiling is one CPU core per process): a fresh machine compiles the
model's quantized kernels in parallel into MLX's PTX cache, so later runs measure decoding
rather than the first compile.

Usage: python scripts/gpu_qprobe.py [--timeout 12]
       python scripts/gpu_qprobe.py --warm 1,2,4,8,16,32,64,128,512 [--timeout 240]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CHILD = """
import sys, time, mlx.core as mx
dt, gs, bits, rows = getattr(mx, sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
w = mx.random.normal((1536, 576)).astype(dt)
wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
x = mx.random.normal((1, rows, 576)).astype(dt)
mx.eval(wq, s, b, x)
out = []
for _ in range(2):
    t = time.perf_counter()
    mx.eval(mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=gs, bits=bits))
    out.append(round((time.perf_counter() - t) * 1000, 1))
print(out)
"""

WARM = """
import sys, time, mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
rows = int(sys.argv[1])
model, _ = load("specdec_cli/models/smollm2-135m-instruct")
cache = make_prompt_cache(model)
out = []
for _ in range(2):  # the second forward meets a longer key length, as decoding does
    t = time.perf_counter()
    mx.eval(model(mx.zeros((1, rows), dtype=mx.int32), cache=cache))
    out.append(round((time.perf_counter() - t) * 1000, 1))
print(out)
"""


def warm(rows: list[int], timeout: float) -> None:
    t0 = time.perf_counter()
    procs = {r: subprocess.Popen([sys.executable, "-c", WARM, str(r)], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for r in rows}
    for r, p in procs.items():
        try:
            out, _ = p.communicate(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
            ms = out.strip()[-300:]
        except subprocess.TimeoutExpired:
            p.kill()
            ms = f"no result in {timeout:.0f} s"
        print(json.dumps({"warm_rows": r, "ms": ms, "wall_s": round(time.perf_counter() - t0, 1)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=12)
    ap.add_argument("--warm", help="Row counts to forward the bundled 4-bit model at, in parallel")
    args = ap.parse_args()
    if args.warm:
        warm([int(r) for r in args.warm.split(",")], args.timeout)
        return
    for dt, gs, bits, rows in [("float16", 32, 4, 1), ("bfloat16", 32, 4, 1), ("float16", 64, 4, 1),
                               ("bfloat16", 64, 4, 1), ("float16", 32, 8, 1), ("bfloat16", 32, 8, 1),
                               ("bfloat16", 32, 4, 8), ("bfloat16", 64, 4, 8)]:
        t = time.perf_counter()
        row = {"dtype": dt, "group_size": gs, "bits": bits, "rows": rows}
        try:
            p = subprocess.run([sys.executable, "-c", CHILD, dt, str(gs), str(bits), str(rows)],
                               capture_output=True, text=True, timeout=args.timeout)
            row["ms"] = p.stdout.strip() or p.stderr.strip()[-300:]
        except subprocess.TimeoutExpired:
            row["ms"] = f"no result in {args.timeout:.0f} s"
        row["wall_s"] = round(time.perf_counter() - t, 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
