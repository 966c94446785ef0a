#!/usr/bin/env python
"""What an MTP draft step costs next to a target decode step, and what speedup that allows.

On the random-weight Qwen3.5-style hybrid of ``scripts/bench.py`` (12 layers:
9 GatedDeltaNet + 3 gated attention, hidden 1024, vocab 32000, tied
embeddings) with its MTP head built from the same config (one gated attention
layer + dense MLP; drafting also runs the target's 1024 x 32000 lm_head):

1. costs, measured side by side (128-token context; each cost is timed right
   after a target decode step c(1), and the model uses the median over rounds
   of that ratio, robust to a shared machine's drifting load): c(T) = a target forward of T
   tokens with the hidden-state tap on, d(T) = an MTP step over T pairs plus
   the logits of the last (the first step of a block feeds the n + 1 pairs the
   last verify committed; the chain steps feed one), and the lm_head alone;
2. the analytic speedup as a function of the per-token acceptance a
   (independent accepts, K drafts, carry rollback of the hybrid target: a
   partial accept of n lengthens the next verify by n + 1 tokens):
   E[tokens] = (1 - a^(K+1)) / (1 - a); block = E[d(first)] + (K-1) d(1) +
   c(K+1) + E[carry]; speedup = E[tokens] c(1) / block;
3. a measured check of that model: the real MTP drafter runs its full chain
   (same cost), but proposes the target's own greedy continuation corrupted
   with probability 1 - a, so acceptance is controlled; speculative and plain
   runs interleaved, median of repeats; one more run timed per phase.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python scripts/bench_mtp.py --rounds 15 --repeats 5 --out bench-results/mtp.json
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
from mlx.utils import tree_flatten

from specdec_cli.core.adaptive import FixedLength
from specdec_cli.cache.caches import ModelCache
from specdec_cli.drafters.base import Draft
from specdec_cli.drafters.mtp import MTPDrafter
from specdec_cli.drafters.mtp_head import MTPConfig, random_head
from specdec_cli.loop.events import collect
from specdec_cli.loop.runner import run
from specdec_cli.core.sampling import GREEDY
from specdec_cli.session.synthetic import build_model
from specdec_cli.model.taps import Hidden, HiddenTap, TapSpec, target_parts

_spec = importlib.util.spec_from_file_location("bench", Path(__file__).with_name("bench.py"))
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench"] = bench
_spec.loader.exec_module(bench)


class OracleMTP(MTPDrafter):
    """The real MTP chain (its cost), proposing the target's greedy text corrupted with probability 1 - a."""

    def __init__(self, head, parts, reference, prompt_len, a, vocab, seed=0):
        super().__init__(head, parts)
        self.reference, self.prompt_len, self.a, self.vocab = reference, prompt_len, a, vocab
        self.rng = random.Random(seed)
        self.consumed = 0

    def prefill(self, tokens, step_size=2048, hidden=None):
        super().prefill(tokens, step_size, hidden)
        self.consumed = len(tokens)

    def propose(self, last, k, params=GREEDY):
        draft = super().propose(last, k, params)
        self.consumed += 1
        if not draft.size:
            return draft
        pos = self.consumed - self.prompt_len
        want = [t if self.rng.random() < self.a else (t + 1) % self.vocab
                for t in self.reference[pos:pos + draft.size]]
        want += [0] * (draft.size - len(want))
        # Data-dependent on the head's drafts, so MLX computes the whole chain.
        tokens = mx.array(want, dtype=mx.uint32) + draft.tokens * 0
        self._drafts = [tokens[i:i + 1] for i in range(draft.size)]
        return Draft(tokens, None, draft.syncs)

    def accept(self, n, hidden=None):
        super().accept(n, hidden)
        self.consumed += n

    def cancel(self):
        super().cancel()
        self.consumed -= 1


def timer(fn, calls: int = 3, warm: bool = True) -> float:
    if warm:
        fn()
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def cost_functions(model, head, parts, ids, k_max):
    """Closures timing one target forward of T tokens, one MTP step over T pairs, the lm_head."""
    cache = ModelCache(model)
    tap = HiddenTap(model, TapSpec(final=True))
    rows = Hidden.concat(cache.prefill(ids[:-1], 2048, tap)).final
    snap = cache.snapshot()
    drafter = MTPDrafter(head, parts)
    drafter.prefill(ids[:-1], 2048, Hidden(final=rows))
    base = drafter.offset
    h = rows[-1:]

    def target_step(t):
        def go():
            cache.restore(snap)
            x = mx.array((ids[-1:] + list(range(1, t)))[:t], dtype=mx.uint32)
            logits = cache.feed(x)
            mx.eval(logits, tap.take().final)
        return go

    def mtp_step(t):
        hs, xs = mx.repeat(h, t, axis=0), mx.array(ids[-t:], dtype=mx.uint32)

        def go():
            drafter._trim_to(base)
            out = drafter._feed(hs, xs)[-1:]
            mx.eval(mx.argmax(parts.logits(out), axis=-1))
        return go

    def lm_head():
        mx.eval(mx.argmax(parts.logits(h), axis=-1))

    return target_step, mtp_step, lm_head, tap


def analytic(a: float, k: int, c, d) -> float:
    """Expected speedup with independent per-token acceptance a (see the module docstring)."""
    p = [a**n * (1 - a) for n in range(k)] + [a**k]  # accepted drafts n = 0..k
    tokens = sum((n + 1) * pn for n, pn in enumerate(p))
    first = sum(pn * d(n + 1) for n, pn in enumerate(p))  # pairs the next block's first step feeds
    carry = sum(pn * (c(k + 1 + n + 1) - c(k + 1)) for n, pn in enumerate(p[:k]))
    return tokens * c(1) / (first + (k - 1) * d(1) + c(k + 1) + carry)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15, help="rounds of cost measurements (each cost next to a c(1))")
    ap.add_argument("--repeats", type=int, default=3, help="end-to-end runs per acceptance (median)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3, help="drafts per block for the end-to-end check")
    ap.add_argument("--acceptances", default="0,0.5,0.8,1")
    ap.add_argument("--out", default="bench-results/mtp.json")
    args = ap.parse_args()
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731

    prov = bench.provenance("float32")
    log(f"BLAS: {prov['blas']}")
    config = bench.SYNTHETIC["qwen3_5"]
    model = build_model(config, seed=0, dtype=mx.float32)
    parts = target_parts(model)
    head_config = MTPConfig.from_qwen(config["text_config"], "qwen3_5")
    head = random_head(head_config, seed=1)
    n_target = sum(v.size for _, v in tree_flatten(model.parameters()))
    n_head = sum(v.size for _, v in tree_flatten(head.parameters()))
    log(f"target {n_target / 1e6:.0f}M parameters, MTP head {n_head / 1e6:.1f}M (+ the tied 32.8M lm_head)")
    rng = random.Random(0)
    ids = [rng.randrange(head_config.vocab_size) for _ in range(128)]

    K_MAX = 5
    target_step, mtp_step, lm_head, tap = cost_functions(model, head, parts, ids, K_MAX)
    keys = [("c", t) for t in range(1, 2 * K_MAX + 3)] + [("d", t) for t in range(1, K_MAX + 2)] + [("lm_head", 1)]
    fns = {key: target_step(key[1]) if key[0] == "c" else mtp_step(key[1]) if key[0] == "d" else lm_head
           for key in keys}
    for fn in fns.values():
        fn()  # warm
    # The machine is shared and its load drifts: each cost is timed right after
    # a target decode step c(1), and the median over rounds of that pair's
    # ratio is what the model uses.
    ratios: dict = {key: [] for key in keys}
    c1_ms = []
    for r in range(args.rounds):
        for key in keys:
            base = timer(fns["c", 1], calls=1, warm=False)
            ratios[key].append(timer(fns[key], calls=1, warm=False) / base)
            c1_ms.append(1e3 * base)
        log(f"  cost round {r + 1}/{args.rounds}")
    tap.close()
    rel = {key: statistics.median(v) for key, v in ratios.items()}
    q = lambda v: statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3  # noqa: E731
    spread = {f"{k}({t})": (q(v)[2] - q(v)[0]) / statistics.median(v) for (k, t), v in ratios.items()
              if (k, t) != ("c", 1)}
    c = lambda t: rel["c", t]  # noqa: E731
    d = lambda t: rel["d", t]  # noqa: E731

    costs = {
        "target_step_ms_median": statistics.median(c1_ms),
        "target_step_ms_quartiles": q(c1_ms),
        "target_forward_over_step": {t: c(t) for t in range(1, 2 * K_MAX + 3)},
        "mtp_step_over_target_step_by_pairs": {t: d(t) for t in range(1, K_MAX + 2)},
        "mtp_step_over_target_step": d(1),
        "lm_head_share_of_mtp_step": rel["lm_head", 1] / d(1),
        "ratio_interquartile_over_median": spread,
    }
    acc_grid = [0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    acceptances = [float(x) for x in args.acceptances.split(",") if x]
    table = {k: {a: analytic(a, k, c, d) for a in acc_grid} for k in range(1, K_MAX + 1)}

    # End-to-end check at controlled acceptance.
    _, reference = collect(run(model, ids, max_tokens=args.max_tokens))
    measured = []
    for a in acceptances:
        ratios, acc = [], []
        for rep in range(args.repeats):
            plain, _ = collect(run(model, ids, max_tokens=args.max_tokens))
            drafter = OracleMTP(head, parts, reference, len(ids), a, head_config.vocab_size, seed=rep)
            spec, out = collect(run(model, ids, drafter=drafter, policy=FixedLength(args.k),
                                    max_tokens=args.max_tokens))
            assert out == reference, "speculative output differs from plain decoding"
            ratios.append(spec.decode_tps / plain.decode_tps)
            acc.append(spec.acceptance)
        a_seen = statistics.median(acc)
        # One more run with a sync after each phase: where a block's time goes.
        timed, _ = collect(run(model, ids, drafter=OracleMTP(head, parts, reference, len(ids), a,
                                                             head_config.vocab_size), policy=FixedLength(args.k),
                               max_tokens=args.max_tokens, timed=True))
        measured.append({"oracle_a": a, "acceptance": a_seen, "speedup": statistics.median(ratios),
                         "speedup_min": min(ratios), "speedup_max": max(ratios),
                         "analytic": analytic(min(a, 0.999999), args.k, c, d),
                         "phase_ms": timed.phase_ms, "plain_ms_per_token": 1e3 / plain.decode_tps})
        log(f"  a={a}: speedup {statistics.median(ratios):.2f}x (acceptance {a_seen:.2f})")

    sp = costs["ratio_interquartile_over_median"]
    print(f"MTP draft step / target decode step: {d(1):.3f} (median of {args.rounds} rounds, interquartile "
          f"{100 * sp['d(1)']:.0f}%; c(1) {costs['target_step_ms_median']:.1f} ms; the lm_head is "
          f"{100 * costs['lm_head_share_of_mtp_step']:.0f}% of the MTP step)")
    print("first MTP step over n pairs / c(1): " + "  ".join(
        f"{t}:{v:.3f}" for t, v in costs["mtp_step_over_target_step_by_pairs"].items()))
    print("target forward of T tokens / c(1): " + "  ".join(
        f"{t}:{v:.2f}" for t, v in costs["target_forward_over_step"].items()))
    print(f"widest interquartile range of a ratio: {100 * max(sp.values()):.0f}% of its median")
    print("\nanalytic speedup (rows: drafts per block K; columns: per-token acceptance a)")
    print("K  " + " ".join(f"{a:>5.1f}" for a in acc_grid))
    for k, row in table.items():
        print(f"{k}  " + " ".join(f"{v:5.2f}" for v in row.values()))
    print(f"\nmeasured, K={args.k}, oracle tokens through the real MTP chain (median of {args.repeats}):")
    for m in measured:
        ph = m["phase_ms"] or {}
        print(f"  per-token a {m['oracle_a']:.1f} (acceptance {m['acceptance']:.2f}): {m['speedup']:.2f}x "
              f"(range {m['speedup_min']:.2f}-{m['speedup_max']:.2f}; analytic {m['analytic']:.2f}x); "
              f"timed block: draft {ph.get('draft_ms', 0):.1f} ms, verify {ph.get('verify_ms', 0):.1f} ms, "
              f"rollback {ph.get('rollback_ms', 0):.1f} ms; plain {m['plain_ms_per_token']:.1f} ms/token")
    report = {"provenance": prov, "settings": vars(args), "head_config": head_config.to_dict(),
              "parameters": {"target": n_target, "head": n_head}, "costs": costs,
              "analytic": {str(k): {str(a): v for a, v in row.items()} for k, row in table.items()},
              "measured": measured}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
