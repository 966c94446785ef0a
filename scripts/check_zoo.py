#!/usr/bin/env python
"""Run every zoo architecture (tests/zoo_configs.py) through specdec.

For each entry, in float32: build a random target and a perturbed copy as the
drafter, list the stock cache types (``make_prompt_cache``), then either

* ``refused: <message>``: ``ModelCache`` raised ``UnsupportedModelError``, or
* for accepted models: our plain decoding vs mlx-lm's stock ``generate_step``
  (identical tokens?), speculative == plain for K in (1, 3, 8), the
  acceptance rate, and any exception (type and message). Diagnostics:

  - ``plain==full``: plain's tokens are the greedy tokens of ONE forward of
    prompt + plain (fresh stock cache): an oracle free of incremental state;
  - ``dlog``: max |logit difference| / max |logit| against that one-shot
    forward, teacher-forcing 30 random tokens, for ``ours`` (verify-like
    blocks of 4 keeping 2: trim or restore + re-feed) and ``stock`` (stock
    caches, one token per step);
  - drafter exactness (K=8 with a 53-token prompt, K=12): every proposal
    must be the draft model's own greedy continuation of the committed
    context (a drafter-cache bug only lowers acceptance, so the output
    checks cannot see it);
  - ``self-acc``: with a drafter identical to the target, every draft must
    be accepted (K=3, 8).

Random tied-embedding models tend to repeat one token; when plain decoding
gives fewer than 8 distinct tokens, every non-embedding matrix of target and
drafter is scaled up (``gain``) and the most varied run is kept.

Entries run in a worker subprocess, one after another; a crash or a timeout
kills only the current entry (the worker is restarted for the rest).

Usage:
    python scripts/check_zoo.py [NAME ...] [--timeout S] [--max-tokens N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from zoo_check import _err, check_one  # noqa: E402  (after the sys.path insert)


# --------------------------------------------------------------------------- worker


def worker(names: list[str], max_tokens: int) -> None:
    from zoo_configs import install_import_stubs

    install_import_stubs()
    for name in names:
        print("START " + name, flush=True)
        try:
            res = check_one(name, max_tokens)
        except BaseException as e:  # noqa: BLE001
            res = {"name": name, "status": "error", "error": _err(e)}
        print("RESULT " + json.dumps(res), flush=True)


# --------------------------------------------------------------------------- parent


def run_all(names: list[str], timeout: float, max_tokens: int) -> list[dict]:
    results: dict[str, dict] = {}
    pending = list(names)
    while pending:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", "--max-tokens", str(max_tokens), *pending],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        current = None
        started = time.monotonic()
        stderr_tail: list[str] = []
        while True:
            left = timeout - (time.monotonic() - started) if current else 60.0
            ready, _, _ = select.select([proc.stdout, proc.stderr], [], [], max(left, 0.01))
            if not ready:
                if current is None:
                    continue
                proc.kill()
                proc.wait()
                results[current] = {
                    "name": current,
                    "status": "timeout",
                    "error": f"no result within {timeout:.0f}s",
                }
                print(f"  {current:24s} TIMEOUT", file=sys.stderr, flush=True)
                break
            if proc.stderr in ready:
                line = proc.stderr.readline()
                if line:
                    stderr_tail = (stderr_tail + [line.rstrip()])[-5:]
            if proc.stdout in ready:
                line = proc.stdout.readline()
                if not line:  # worker exited
                    proc.wait()
                    if current is not None and current not in results:
                        tail = " | ".join(stderr_tail)[-300:]
                        results[current] = {
                            "name": current,
                            "status": "crash",
                            "error": f"worker died (rc={proc.returncode}): {tail}",
                        }
                        print(f"  {current:24s} CRASH", file=sys.stderr, flush=True)
                    break
                if line.startswith("START "):
                    current = line[6:].strip()
                    started = time.monotonic()
                elif line.startswith("RESULT "):
                    res = json.loads(line[7:])
                    results[res["name"]] = res
                    print(f"  {res['name']:24s} {res['status']} ({res.get('secs', '?')}s)", file=sys.stderr, flush=True)
                    current = None
        pending = [n for n in pending if n not in results]
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return [results[n] for n in names]


def _outcome(r: dict) -> str:
    st = r["status"]
    if st == "refused":
        return "refused: " + r["refused"]
    if st in ("build-error", "error", "timeout", "crash"):
        return f"{st.upper()}: {r.get('error')}"
    parts = []
    pes = r.get("plain_eq_stock")
    parts.append("plain==stock" if pes else ("plain!=stock" + (f"@{r.get('stock_first_diff')}" if pes is False else "")) if pes is not None else "plain==stock n/a")
    pef = r.get("plain_eq_full")
    if pef is not None:
        parts.append("plain==full" if pef else f"plain!=full@{r.get('full_first_diff')}")
    if "dlogit_ours" in r:
        parts.append(f"dlog ours={r['dlogit_ours']:.0e} stock={r['dlogit_stock']:.0e}")
    if r.get("distinct") is not None:
        parts.append(f"distinct={r['distinct']}" + (f"(gain {r['gain']:g})" if r.get("gain") else ""))
    spec = r.get("spec_eq_plain", {})
    sp = " ".join(
        f"K{k}:" + ("ok" if v is True else ("DIFF@" + str(r.get("spec_first_diff", {}).get(str(k), r.get("spec_first_diff", {}).get(k))) if v is False else str(v)))
        for k, v in spec.items()
    )
    parts.append("spec " + sp)
    if r.get("acceptance") is not None:
        parts.append(f"acc={r['acceptance']:.2f}")
    sa = r.get("self_acceptance")
    if sa:
        vals = list(sa.values())
        parts.append("self-acc=1" if all(v == 1.0 for v in vals) else "SELF-ACC " + " ".join(f"K{k}:{v}" for k, v in sa.items()))
    for e in r.get("errors", []):
        parts.append("ERR " + e)
    return ("OK  " if st == "ok" else "FAIL ") + "; ".join(parts)


def print_table(results: list[dict]) -> None:
    w = max(len(r["name"]) for r in results)
    print()
    print(f"{'architecture':{w}s} | {'stock caches':40s} | outcome")
    print("-" * (w + 3) + "+" + "-" * 42 + "+" + "-" * 60)
    for r in results:
        caches = r.get("stock_caches", "")
        print(f"{r['name']:{w}s} | {caches:40s} | {_outcome(r)}")
    counts: dict[str, int] = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print()
    print("summary: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="zoo entries to check (default: all)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per entry")
    ap.add_argument("--max-tokens", type=int, default=30)
    ap.add_argument("--json", help="also write the results as JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        worker(args.names, args.max_tokens)
        return

    from zoo_configs import UNBUILDABLE, ZOO

    names = args.names or list(ZOO)
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        sys.exit(f"unknown zoo entries: {unknown} (unbuildable: {sorted(UNBUILDABLE)})")
    t0 = time.perf_counter()
    results = run_all(names, args.timeout, args.max_tokens)
    print_table(results)
    if not args.names and UNBUILDABLE:
        print("unbuildable: " + "; ".join(f"{k} ({v})" for k, v in UNBUILDABLE.items()))
    print(f"wall time: {time.perf_counter() - t0:.1f}s for {len(names)} entries")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
