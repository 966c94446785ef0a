#!/usr/bin/env python
"""Which 4-bit / 8-bit quantized matmuls MLX's backend runs, each in its own process under a time box.

A first call that never returns (a kernel that compiles for minutes, or hangs) shows as a timeout
instead of stopping the check. One JSON line per configuration: activation dtype, group size, bits,
rows, and the first and second call's milliseconds.

Usage: python scripts/gpu_qprobe.py [--timeout 12]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=12)
    args = ap.parse_args()
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
