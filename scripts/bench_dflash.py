#!/usr/bin/env python
"""What a DFlash block drafter costs, next to the target it drafts for.

With random weights a DFlash drafter's acceptance means nothing, so this
measures its cost instead, on a random-weight target and drafter of
realistic shape (default: a Qwen3-0.6B-like target cut to 24 layers, hidden
1024, vocab 151936, tied embeddings; a 5-layer drafter of the same width
reading 5 target layers), after a prompt of --context tokens:

  c(1)      one plain target decode step (no tap)
  c(T)      a verify forward of T = block size tokens, with the hidden-state tap on
  d(bs)     one drafter forward: the block of bs slots plus one new context row
            projected (what each block pays), drafts evaluated; and, apart, the
            target's lm_head on the bs-1 draft rows (part of d)

All are medians of interleaved repeats (min and max are printed: the machine
is shared). The analytic speedup of a block of size bs on a pure-attention
target (trim rollback is free) with L tokens committed per block (accepted
drafts + the target's own) is  L * c(1) / (d(bs) + c(bs)).

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
      python scripts/bench_dflash.py --out bench-results/dflash-cost.json
"""

from __future__ import annotations

import argparse
import json
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

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]  # bench.py; this checkout
from bench import provenance  # noqa: E402

from specdec_cli.cache.caches import ModelCache  # noqa: E402
from specdec_cli.drafters.dflash import DFlashConfig, DFlashDrafter, DFlashModel, default_target_layer_ids  # noqa: E402
from specdec_cli.session.synthetic import build_model, dflash_config  # noqa: E402
from specdec_cli.model.taps import Hidden, HiddenTap, TapSpec, target_parts  # noqa: E402


def target_config(family: str, hidden: int, layers: int, vocab: int) -> dict:
    common = {
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 3 * hidden,
        "num_attention_heads": hidden // 64, "num_key_value_heads": hidden // 128, "head_dim": 128,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "num_hidden_layers": layers,
    }
    if family == "qwen3":
        return {**common, "model_type": "qwen3"}
    if family == "qwen3_5":
        return {"model_type": "qwen3_5", "text_config": {
            **common, "model_type": "qwen3_5_text", "full_attention_interval": 4,
            "linear_num_value_heads": hidden // 64, "linear_num_key_heads": hidden // 128,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25},
        }}
    raise SystemExit(f"unknown family {family}")


def median_of(xs: list[float]) -> dict:
    return {"median_ms": 1e3 * statistics.median(xs), "min_ms": 1e3 * min(xs), "max_ms": 1e3 * max(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="qwen3", choices=["qwen3", "qwen3_5"])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--block-sizes", default="8,16")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sizes = [int(s) for s in args.block_sizes.split(",")]

    tcfg = target_config(args.family, args.hidden, args.layers, args.vocab)
    target = build_model(tcfg, seed=0)
    parts = target_parts(target)
    ids = default_target_layer_ids(args.layers, args.draft_layers)
    dcfg = dflash_config(tcfg, layers=args.draft_layers, block_size=max(sizes), target_layer_ids=list(ids),
                         heads=(args.hidden // 64, args.hidden // 128), head_dim=128,
                         intermediate_size=3 * args.hidden)
    model = DFlashModel(DFlashConfig.from_dict(dcfg))
    mx.eval(model.parameters())

    prompt = [int(t) for t in mx.random.randint(0, args.vocab, (args.context,), key=mx.random.key(1)).tolist()]
    cache = ModelCache(target)
    tap = HiddenTap(target, TapSpec(layers=ids))
    prompt_rows = Hidden.concat(cache.prefill(prompt[:-1], 2048, tap))
    drafter = DFlashDrafter(model, parts)
    drafter.prefill(prompt[:-1], 2048, prompt_rows)
    # One new context row per block, as a block with nothing accepted hands over.
    drafter.accept(0, prompt_rows.rows(0, 1))
    snap = cache.snapshot()
    last = prompt[-1]
    tap.close()

    def decode() -> None:
        cache.restore(snap)
        mx.eval(cache.feed(mx.array([last], dtype=mx.uint32)))

    def verify(t: int):
        def go() -> None:
            cache.restore(snap)
            with HiddenTap(target, TapSpec(layers=ids)) as vtap:
                logits = cache.feed(mx.array([last] + list(range(1, t)), dtype=mx.uint32))
                mx.eval(logits, vtap.take().layers)
        return go

    def draft(bs: int):
        def go() -> None:
            d = drafter.propose(last, bs - 1)
            mx.eval(d.tokens)
            drafter.cancel()
        return go

    def head(bs: int):
        # The target's lm_head on the bs-1 draft rows alone: the part of d(bs) the drafter
        # borrows from the target (a large vocabulary makes it most of it on a CPU).
        h = mx.random.normal((bs - 1, args.hidden), key=mx.random.key(2))
        mx.eval(h)

        def go() -> None:
            mx.eval(parts.head(h))
        return go

    jobs = {"decode": decode}
    for bs in sizes:
        jobs[f"verify{bs}"] = verify(bs)
        jobs[f"draft{bs}"] = draft(bs)
        jobs[f"head{bs}"] = head(bs)
    times: dict[str, list[float]] = {name: [] for name in jobs}
    for name, job in jobs.items():  # warm-up: first calls of new shapes compile
        job()
        job()
    for _ in range(args.repeats):
        for name, job in jobs.items():
            start = time.perf_counter()
            job()
            times[name].append(time.perf_counter() - start)

    # Ratios from medians (reported) and from minima (the least disturbed runs on a shared machine).
    c1, c1_min = statistics.median(times["decode"]), min(times["decode"])
    report = {"provenance": provenance("float32"), "args": vars(args), "target_layer_ids": list(ids),
              "params_target_M": sum(v.size for _, v in tree_flatten(target.parameters())) / 1e6,
              "params_drafter_M": sum(v.size for _, v in tree_flatten(model.parameters())) / 1e6,
              "times": {k: median_of(v) for k, v in times.items()}, "blocks": {}}
    print(f"target {args.family} hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}; drafter "
          f"{args.draft_layers} layers; context {args.context}; {args.repeats} repeats; {report['provenance']['blas']}")
    print(f"decode step c(1): {1e3 * c1:.1f} ms (min {1e3 * min(times['decode']):.1f}, max {1e3 * max(times['decode']):.1f})")
    for bs in sizes:
        v, d = statistics.median(times[f"verify{bs}"]), statistics.median(times[f"draft{bs}"])
        curve = {L: L * c1 / (d + v) for L in range(1, bs + 1)}
        v_min, d_min = min(times[f"verify{bs}"]), min(times[f"draft{bs}"])
        lm = statistics.median(times[f"head{bs}"])
        report["blocks"][bs] = {"verify_over_decode": v / c1, "draft_over_decode": d / c1,
                                "speedup_by_tokens_per_block": curve,
                                "break_even_tokens_per_block": (d + v) / c1,
                                "lm_head_over_decode": lm / c1,
                                "from_minima": {"verify_over_decode": v_min / c1_min,
                                                "draft_over_decode": d_min / c1_min,
                                                "break_even_tokens_per_block": (d_min + v_min) / c1_min}}
        print(f"bs={bs:2d}: drafter forward d = {d / c1:.2f} x c(1) ({1e3 * d:.1f} ms), verify c({bs}) = "
              f"{v / c1:.2f} x c(1); break-even at {(d + v) / c1:.2f} tokens per block; "
              f"of d, the target's lm_head on {bs - 1} rows: {lm / c1:.2f} x c(1)")
        print(f"       (from minima: d = {d_min / c1_min:.2f}, c({bs}) = {v_min / c1_min:.2f}, "
              f"break-even {(d_min + v_min) / c1_min:.2f})")
        print("       L (tokens/block): " + "  ".join(f"{L:>5d}" for L in curve))
        print("       analytic speedup: " + "  ".join(f"{s:5.2f}" for s in curve.values()))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
