#!/usr/bin/env python
"""What ``--exact`` costs: decode tokens per second with and without it, side by side, on the bundled model.

Per prompt kind (copy, open) and client count (1: ``specdec generate``; 8: ``generate --prompts-file`` with
eight prompts of that kind decoded together), the default and ``--exact`` run alternately, ``--repeats``
times each, fresh processes, greedy, the disk prompt cache off. Reported: the medians and the ratio
exact / default, and whether the two texts agree (they may part at a near-tie: the exact run computes in
other shapes). Results go to ``bench-results/exact.json``.

Usage: python scripts/bench_exact.py [--repeats 3] [--max-tokens 128] [--dtype float32] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPY = ("Copy this text exactly: The city council met on Tuesday to discuss the new park. The park will have a "
        "playground, a small lake and walking paths. The council said the park will open next spring.")
OPEN = "Explain why the sky is blue in a few sentences."
COPIES = [COPY.replace("Tuesday", day) for day in ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday",
                                                     "Saturday", "Sunday", "Easter")]
OPENS = [OPEN.replace("sky is blue", topic) for topic in ("sky is blue", "sea is salty", "grass is green",
                                                         "sun is hot", "ice floats", "iron rusts",
                                                         "leaves fall", "bread rises")]


def run(args: list[str]) -> dict:
    env = {**os.environ, "SPECDEC_PROMPT_CACHE_DISK_GB": "0"}
    out = subprocess.run([sys.executable, "-m", "specdec_cli", "generate", *args, "--json"], capture_output=True,
                         text=True, env=env, cwd=ROOT, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def one(kind: str, clients: int, exact: bool, opts) -> tuple[float, list[str]]:
    common = ["-m", str(opts.max_tokens), "--dtype", opts.dtype] + (["--exact"] if exact else [])
    if clients == 1:
        report = run([*common, "-p", COPY if kind == "copy" else OPEN])
        return report["decode_tps"], [report["text"]]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(COPIES if kind == "copy" else OPENS) + "\n")
    report = run([*common, "--prompts-file", f.name, "--decode-concurrency", str(clients)])
    os.unlink(f.name)
    return report["summary"]["aggregate_tps"], [r["text"] for r in report["rows"]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "exact.json"))
    opts = ap.parse_args()
    cells = []
    for kind in ("copy", "open"):
        for clients in (1, 8):
            tps = {False: [], True: []}
            texts = {}
            for r in range(opts.repeats):
                for exact in ((False, True) if r % 2 == 0 else (True, False)):  # alternate the order
                    value, texts[exact] = one(kind, clients, exact, opts)
                    tps[exact].append(value)
            default, exact = statistics.median(tps[False]), statistics.median(tps[True])
            cell = {"prompt": kind, "clients": clients, "default_tps": default, "exact_tps": exact,
                    "ratio": exact / default if default else None, "runs": {"default": tps[False],
                                                                             "exact": tps[True]},
                    "same_text": texts[False] == texts[True]}
            cells.append(cell)
            print(f"{kind:5} x{clients}: default {default:7.1f} tok/s, exact {exact:7.1f} tok/s, "
                  f"{cell['ratio']:.2f}x; texts {'equal' if cell['same_text'] else 'part at a near-tie'}",
                  flush=True)
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps({"dtype": opts.dtype, "max_tokens": opts.max_tokens,
                                          "repeats": opts.repeats, "cells": cells}, indent=1) + "\n")


if __name__ == "__main__":
    main()
