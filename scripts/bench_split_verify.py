#!/usr/bin/env python
"""Rows that draft nothing: pay for the widest draft (one padded verify), or a verify split in two?

When one row of a batch drafts and the others draft nothing, the engine runs one verify forward of
B rows x W positions (the others padded: ``cost(B, W)``). Split, it would run the drafting row
alone at width W and the others at width 1 (``cost(1, W) + cost(B - 1, 1)``). This times both
from the same measurement the batch planner uses (``CostTable.measure``: the fastest of three
forwards over 64 tokens of cache, evaluated caches), on the bundled SmolLM2-135M-Instruct in
float32 with the system OpenBLAS preloaded as ``specdec`` does, and prints the ratio split /
padded (below 1: splitting would be quicker).

Usage: python scripts/bench_split_verify.py [--rows 4,8] [--out bench-results/split-verify.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec_cli.model import blas  # noqa: E402

WIDTHS = (1, 2, 4, 8, 16, 32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="4,8")
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "split-verify.json"))
    args = ap.parse_args()
    blas.maybe_reexec()  # the system OpenBLAS, as specdec itself does

    from specdec_cli.cache.caches import ModelCache
    from specdec_cli.loop.batch_policy import CostTable
    from specdec_cli.model import bundled
    from specdec_cli.session.loading import load

    model = load(str(bundled.model_dir()), "float32").model
    results = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "model": bundled.NAME,
               "dtype": "float32", "rows": {}}
    for rows in (int(x) for x in args.rows.split(",")):
        table = CostTable.measure(model, lambda: ModelCache(model), (1, rows - 1, rows), WIDTHS, budget=float("inf"))
        out = []
        for width in WIDTHS[1:]:
            padded = table.cost(rows, width)
            split = table.cost(1, width) + table.cost(rows - 1, 1)
            out.append({"width": width, "padded_ms": 1000 * padded, "split_ms": 1000 * split,
                        "split_over_padded": split / padded})
            print(f"{rows} rows, one drafting to width {width}: padded {1000 * padded:.0f} ms, split "
                  f"{1000 * split:.0f} ms ({split / padded:.2f}x)", flush=True)
        results["rows"][rows] = out
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
