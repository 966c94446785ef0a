#!/usr/bin/env python
"""Recurrent rollback strategies side by side: per-block costs and end-to-end speedups.

On the random-weight Qwen3.5-style hybrid of scripts/bench.py (9 GatedDeltaNet
+ 3 attention layers) and its pure-attention twin, all in one run:

1. Per block (block size B = K + 1, a 128-token context): the verify forward
   of each strategy (stock for reforward/carry; recorded for capture/tape) and
   each strategy's rollback for accepted lengths a = 0..K (a = K is a full
   accept: nothing to roll back). Carry pays later, as a longer next verify:
   its column is verify(B + a + 1) - verify(B). Medians over interleaved
   repeats (strategy order rotated each repeat).
2. End to end with the oracle drafter (acceptance a, zero drafting cost) at
   a = 0.5, 0.7, 0.9: speedup over mlx-lm's plain decoding for every strategy
   and for the attention twin, interleaved per repeat; each row's
   zero-rollback-cost bound (the same accept pattern, verify forwards timed
   apart, rollback free) and its efficiency; output identical to plain.

Run with OpenBLAS preloaded on Linux CPUs:
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
      python scripts/bench_rollback.py --out bench-results/rollback.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    # Before MLX loads (the dynamic loader reads LD_PRELOAD only at start-up): run again once with
    # the system OpenBLAS preloaded, as the CLI does (SPECDEC_NO_REEXEC=1 turns it off).
    from specdec_cli.model.blas import maybe_reexec

    maybe_reexec()

import mlx.core as mx

from specdec_cli.core.adaptive import FixedLength
from specdec_cli.cache.caches import ModelCache
from specdec_cli.loop.events import collect
from specdec_cli.loop.runner import run
from specdec_cli.session.synthetic import build_model

_spec = importlib.util.spec_from_file_location("bench", Path(__file__).parent / "bench.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench"] = bench
_spec.loader.exec_module(bench)

STRATEGIES = ("reforward", "carry", "capture", "tape")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - t0)


def per_block(model, ids: list[int], k: int, repeats: int) -> dict:
    """Verify and rollback milliseconds per strategy and accepted length (see the module docstring)."""
    cache = ModelCache(model)
    cache.prefill(ids[:-1])
    snap = cache.snapshot()
    b = k + 1
    x = mx.array(ids[-1:] + list(range(1, b + k + 1)), dtype=mx.uint32)
    verify: dict[str, list] = {s: [] for s in ("stock", "capture", "tape")}
    longer: dict[int, list] = {a: [] for a in range(k + 1)}  # verify(B + a + 1), for carry
    roll: dict[str, dict[int, list]] = {s: {a: [] for a in range(k + 1)} for s in STRATEGIES}

    def one_verify(record, tokens):
        logits = cache.feed(tokens, record=record)
        mx.eval(logits, cache.state_arrays())

    for rep in range(repeats + 1):  # round 0 warms up
        order = list(STRATEGIES)
        random.Random(rep).shuffle(order)
        for strategy in order:
            for a in range(k + 1):
                record = strategy if strategy in ("capture", "tape") else None
                cache.restore(snap)
                v = timed(lambda: one_verify(record, x[:b]))
                if strategy == "carry":
                    r = 0.0
                elif strategy == "reforward":
                    def reforward():
                        if cache.rollback(snap, a + 1):
                            cache.feed(x[: a + 1])
                        mx.eval(cache.state_arrays())
                    r = 0.0 if a == k else timed(reforward)
                else:
                    def cut():
                        cache.rollback_recorded(snap, a + 1)
                        mx.eval(cache.state_arrays())
                    r = timed(cut)
                if rep:
                    roll[strategy][a].append(r)
                    if a == 0:
                        verify["stock" if record is None else record].append(v)
        for a in range(k + 1):
            if a == k:
                continue
            cache.restore(snap)
            t = timed(lambda: one_verify(None, x[: b + a + 1]))
            if rep:
                longer[a].append(t)
    # The verify overhead of recording, as the median of per-round ratios
    # (the three verifies of a round run back to back, in rotating order).
    ratios: dict[str, list] = {"capture": [], "tape": []}
    for rep in range(2 * repeats + 1):
        order = ["stock", "capture", "tape"]
        random.Random(100 + rep).shuffle(order)
        t = {}
        for mode in order:
            cache.restore(snap)
            t[mode] = timed(lambda: one_verify(None if mode == "stock" else mode, x[:b]))
        if rep:
            for mode in ratios:
                ratios[mode].append(t[mode] / t["stock"])
    cache.restore(snap)
    med = statistics.median
    v_stock = med(verify["stock"])
    out = {"block_size": b, "verify_ms": {s: med(v) for s, v in verify.items()}, "rollback_ms": {}}
    for s in STRATEGIES:
        out["rollback_ms"][s] = {a: med(roll[s][a]) for a in range(k + 1)}
    out["rollback_ms"]["carry"] = {a: (med(longer[a]) - v_stock if a < k else 0.0) for a in range(k + 1)}
    spread = {s: (max(v) - min(v)) / med(v) for s, v in verify.items()}
    out["verify_spread"] = spread  # (max - min) / median over repeats: how noisy the machine was
    out["verify_ratio"] = {m: {"median": med(r), "quartiles": statistics.quantiles(r, n=4)} for m, r in ratios.items()}
    return out


def end_to_end(models: dict, ids: list[int], k: int, acceptances: list[float], max_tokens: int,
               repeats: int) -> list[dict]:
    """Oracle-drafter speedups, every strategy (and the attention twin) side by side."""
    vocab = bench._SHAPE["vocab_size"]
    refs = {name: bench.mlx_lm_plain(m, ids, max_tokens, set())[1] for name, m in models.items()}
    costs: dict[tuple[str, int], float] = {}

    def cost(name: str, t: int) -> float:
        if (name, t) not in costs:
            costs[name, t] = bench.forward_cost(models[name], ids, t)
        return costs[name, t]

    configs = [("hybrid", s) for s in (*STRATEGIES, "auto")] + [("attention", "trim")]
    rows = []
    for a in acceptances:
        plain_tps = {name: [] for name in models}
        runs: dict[tuple, list] = {c: [] for c in configs}
        for rep in range(repeats):
            for name, m in models.items():
                plain_tps[name].append(bench.mlx_lm_plain(m, ids, max_tokens, set())[0])
            order = list(configs)
            random.Random(rep).shuffle(order)
            for name, strategy in order:
                drafter = bench.OracleDrafter(refs[name], len(ids), a, vocab, seed=1)
                stats, out = collect(run(models[name], ids, drafter=drafter, policy=FixedLength(k),
                                         max_tokens=max_tokens, rollback=strategy if strategy != "trim" else "carry"))
                runs[name, strategy].append((stats, out, rep))
        for name, strategy in configs:
            rs = runs[name, strategy]
            speedups = [st.decode_tps / plain_tps[name][rep] for st, _, rep in rs]
            st, out, _ = rs[0]
            # Zero rollback cost: the verify forwards of the same blocks, nothing else.
            bound = bench.analytic_bound(st.block_log, lambda t, n=name: cost(n, t), 0.0)
            speedup = statistics.median(speedups)
            rows.append({
                "acceptance_target": a, "model": name, "strategy": strategy,
                "chosen": (st.rollback_choice or {}).get("strategy"),
                "acceptance": st.acceptance, "speedup": speedup, "speedups": speedups,
                "zero_rollback_bound": bound, "efficiency": speedup / bound if bound else None,
                "identical": out == refs[name], "rollbacks": dict(st.rollbacks),
            })
        log(f"  a={a}: done")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", default="3,7", help="draft lengths K for the per-block table")
    ap.add_argument("--block-size", type=int, default=4, help="end-to-end block size (K + 1)")
    ap.add_argument("--acceptances", default="0.5,0.7,0.9")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3, help="end-to-end repeats (median of per-repeat ratios)")
    ap.add_argument("--block-repeats", type=int, default=7, help="per-block repeats (medians)")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--out", default="bench-results/rollback.json")
    args = ap.parse_args()

    prov = bench.provenance("float32")
    log(f"BLAS: {prov['blas']}; mlx {prov['mlx']}, mlx-lm {prov['mlx_lm']}")
    models = {"hybrid": build_model(bench.SYNTHETIC["qwen3_5"], seed=0, dtype=mx.float32),
              "attention": build_model(bench.SYNTHETIC["qwen3"], seed=0, dtype=mx.float32)}
    rng = random.Random(0)
    ids = [rng.randrange(bench._SHAPE["vocab_size"]) for _ in range(128)]
    report = {"provenance": prov, "settings": vars(args), "per_block": {}, "end_to_end": []}
    for k in [int(s) for s in args.ks.split(",")]:
        log(f"per block, K={k} ...")
        report["per_block"][k] = per_block(models["hybrid"], ids, k, args.block_repeats)
        print_block(report["per_block"][k])
    if not args.skip_e2e:
        log("end to end ...")
        report["end_to_end"] = end_to_end(models, ids, args.block_size - 1,
                                          [float(a) for a in args.acceptances.split(",")],
                                          args.max_tokens, args.repeats)
        print_e2e(report["end_to_end"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    log(f"wrote {args.out}")


def print_block(r: dict) -> None:
    b, v = r["block_size"], r["verify_ms"]
    k = b - 1
    print(f"\nBlock size {b} (K={k}): verify ms stock {v['stock']:.1f}, capture {v['capture']:.1f} "
          f"({100 * (v['capture'] / v['stock'] - 1):+.1f}%), tape {v['tape']:.1f} "
          f"({100 * (v['tape'] / v['stock'] - 1):+.1f}%); spread over repeats "
          + ", ".join(f"{s} {100 * x:.0f}%" for s, x in r["verify_spread"].items()))
    print("verify / stock verify, median of back-to-back rounds (quartiles): " + ", ".join(
        f"{m} {q['median']:.3f} ({q['quartiles'][0]:.3f}-{q['quartiles'][2]:.3f})" for m, q in r["verify_ratio"].items()))
    print(f"{'accepted a':>10} " + " ".join(f"{s:>16}" for s in STRATEGIES))
    for a in range(k + 1):
        cells = []
        for s in STRATEGIES:
            ms = r["rollback_ms"][s][a]
            cells.append(f"{ms:7.2f} ({100 * ms / v['stock']:5.1f}%)")
        print(f"{a:>10} " + " ".join(f"{c:>16}" for c in cells))
    print("(rollback ms, and % of a stock verify; carry: the extra verify time it defers)")


def print_e2e(rows: list[dict]) -> None:
    print(f"\n{'a':>4} {'model':9} {'strategy':9} {'chosen':8} {'accept':>6} {'speedup':>7} {'bound':>6} "
          f"{'eff':>5} same")
    for r in rows:
        print(f"{r['acceptance_target']:>4} {r['model']:9} {r['strategy']:9} {str(r['chosen']):8} "
              f"{100 * r['acceptance']:5.0f}% {r['speedup']:6.2f}x {r['zero_rollback_bound']:6.2f} "
              f"{100 * r['efficiency']:4.0f}% {'yes' if r['identical'] else 'NO'}")
    for a in dict.fromkeys(r["acceptance_target"] for r in rows):
        att = next(r for r in rows if r["acceptance_target"] == a and r["model"] == "attention")
        best = max((r for r in rows if r["acceptance_target"] == a and r["model"] == "hybrid"),
                   key=lambda r: r["speedup"])
        print(f"a={a}: hybrid ({best['strategy']}) / attention = {best['speedup'] / att['speedup']:.2f} "
              f"({best['speedup']:.2f}x vs {att['speedup']:.2f}x)")


if __name__ == "__main__":
    main()
