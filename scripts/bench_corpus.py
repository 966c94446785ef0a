#!/usr/bin/env python
"""Answers that recur across requests: specdec serve with its lookup corpus, without it, and mlx_lm.server.

A second user asks what a first asked (another system message, the same
question): each of three open questions is sent twice, one request at a time,
to ``mlx_lm.server``, to ``specdec serve --lookup-corpus 0`` and to ``specdec
serve`` with its default corpus, each server alone on the machine in turn, all
three on the same float32 files of the bundled model, greedy, each with its
prompt cache as it defaults. Per request: decode tok/s as ``bench_serve.py``
measures every server (completion tokens after the first over the time from
the first streamed token to the last), and whether the three texts are identical. Results go to ``bench-results/corpus.json``.

Usage: python scripts/bench_corpus.py [--out bench-results/corpus.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_serve import OPEN, OPEN2, OPEN3, ask, free_port, prepare, start  # noqa: E402

QUESTIONS = [OPEN, OPEN2, OPEN3]
ASKERS = ["You answer a student.", "You answer a colleague."]
MAX_TOKENS = 128


def asked(port: int, system: str, question: str) -> tuple[str, float]:
    """One streamed request, measured as bench_serve.py measures both servers: its text and decode tok/s."""
    out = ask(port, [{"role": "system", "content": system}, {"role": "user", "content": question}], MAX_TOKENS)
    return out["text"], out["decode_tps"] or 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "corpus.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-corpus-"))
    f32, env, peer_env, _ = prepare(work)
    servers = {
        "mlx_lm": ([sys.executable, "-m", "mlx_lm", "server", "--model", str(f32)], peer_env),
        "specdec_no_corpus": ([sys.executable, "-m", "specdec_cli", "serve", "--model", str(f32),
                               "--lookup-corpus", "0"], env),
        "specdec": ([sys.executable, "-m", "specdec_cli", "serve", "--model", str(f32)], env),
    }
    results: dict[str, list] = {}
    for name, (cmd, cmd_env) in servers.items():
        port = free_port()
        proc = start([*cmd, "--port", str(port)], port, cmd_env, work / f"{name}.log")
        try:
            asked(port, "Warm-up.", "Say hello.")  # untimed: first-request costs out of the way
            results[name] = [(asker, q[:32], *asked(port, asker, q)) for asker in ASKERS for q in QUESTIONS]
        finally:
            proc.terminate()
            proc.wait(30)
    rows = []
    print("| asked | question | mlx_lm tok/s | specdec, no corpus | specdec | specdec / mlx_lm | identical |")
    print("|---|---|---|---|---|---|---|")
    for (asker, q, t0, s0), (_, _, t1, s1), (_, _, t2, s2) in zip(*(results[n] for n in servers)):
        turn = "first" if asker == ASKERS[0] else "again"
        same = t0 == t1 == t2
        rows.append({"asked": turn, "question": q, "mlx_lm_tps": s0, "specdec_no_corpus_tps": s1, "specdec_tps": s2,
                     "ratio": s2 / s0 if s0 else None, "identical": same})
        print(f"| {turn} | {q} | {s0:.1f} | {s1:.1f} | {s2:.1f} | {s2 / s0:.2f}x | {'yes' if same else 'NO'} |")
    Path(args.out).write_text(json.dumps({"rows": rows, "max_tokens": MAX_TOKENS}, indent=1) + "\n")


if __name__ == "__main__":
    main()
