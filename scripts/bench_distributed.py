#!/usr/bin/env python
"""What distribution adds: a target sharded over ranks by MLX's own engine, with and without speculation.

Side by side in one run, repeat after repeat (each repeat: the whole model in
one process, then the ranks under ``mlx.launch``):

- plain decoding, whole vs sharded: what sharding costs here;
- speculative vs plain decoding, both sharded: prompt lookup on the copy and
  edit prompts of ``scripts/bench.py`` (the bundled SmolLM2, float32, tensor
  parallel: its 9 and 3 heads divide by 3, so with ``--ranks 2`` it is
  left out), and a draft model on a tiny random llama pair (a target and
  its noisy copy, 6 heads).

The sharded worker also counts the collectives of one target forward (and of
a speculative block: the forward's, plus the block's agreement and, with the
adaptive policy, rank 0's clock) and times one all_sum on this backend. From
them a model of the speedup, per workload::

    plain token  = f*c + C*l          (c: a whole plain step's compute, measured in one process)
    spec. block  = f*c_b + K*l        (c_b: a whole speculative block, drafting and rollback included)
    speedup(l)   = n * (f*c + C*l) / (f*c_b + K*l)      (n: tokens per block)

where C and K are the counted collectives, l the time of one, and f the
share of the whole compute a rank does (1 on this machine, whose ranks share
two cores; 1/2 for two machines splitting the heads). The model is checked
against what was measured here at the measured l, then evaluated at 30 us
(JACCL over Thunderbolt 5), 200 us and 1 ms (rings over Thunderbolt and
Ethernet). It counts latency only: a verify of T rows all-reduces T rows per
collective, which a slow link also pays in bandwidth.

Usage (one machine; takes minutes, most of it sharded plain decoding)::

    python scripts/bench_distributed.py --ranks 3 --repeats 2 --out bench-results/distributed.json
    python scripts/bench_distributed.py --ranks 2 --repeats 3 --max-tokens 64 --out bench-results/distributed-2.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and "--worker" not in sys.argv:
    # Before MLX loads: run again once with the system OpenBLAS preloaded, as the CLI does.
    from specdec_cli.model.blas import maybe_reexec

    maybe_reexec()

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
import bench  # noqa: E402  (this script's folder is first on sys.path)

from specdec_cli.model import distributed  # noqa: E402
from specdec_cli.loop.events import Finished, Step, Warmed  # noqa: E402
from specdec_cli.session import ModelOptions, Request, Session, load_setup  # noqa: E402
from specdec_cli.core.stats import Stats  # noqa: E402
from specdec_cli.session.synthetic import TINY_CONFIGS, make_model_dir  # noqa: E402

PROMPTS = ("verbatim_copy", "edit_type_hints")
LATENCIES_S = {"JACCL (Thunderbolt 5 RDMA)": 30e-6, "ring over Thunderbolt": 200e-6, "ring over Ethernet": 1e-3}
# The draft model workload: a tiny pair whose heads divide by 2, 3 and 6 ranks.
TINY = {**TINY_CONFIGS["llama"], "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 6,
        "intermediate_size": 192, "num_hidden_layers": 4}
# The draft is the target with this relative weight noise: about 60% of its drafts accepted.
DRAFT_NOISE = 0.04
_COLLECTIVES = ("all_sum", "all_gather", "send", "recv", "recv_like")


class Counter:
    """Counts the collectives built (each is evaluated once) by wrapping mx.distributed's functions."""

    def __init__(self):
        self.n = 0
        for name in _COLLECTIVES:
            real = getattr(mx.distributed, name)

            def wrapped(*args, _real=real, **kwargs):
                self.n += 1
                return _real(*args, **kwargs)

            setattr(mx.distributed, name, wrapped)


def decode(session: Session, ids: list[int], max_tokens: int, counter: Counter) -> dict:
    """One generation; its statistics, and the collectives of its decoding (after the warm-up)."""
    stats, tokens, start = Stats(), [], None
    for event in session.generate(Request(ids, max_tokens, seed=0)):
        if isinstance(event, Step):
            stats.add(event.block, event.seconds)
            tokens += event.block.tokens
        else:
            stats.note(event)
            if isinstance(event, Warmed):
                start = counter.n
            if isinstance(event, Finished):
                end = counter.n
    return {"tokens": tokens, "decode_tps": stats.decode_tps, "decode_s": stats.decode_s, "blocks": stats.blocks,
            "tokens_per_block": stats.tokens_per_block, "acceptance": stats.acceptance,
            "collectives": end - start}


def collective_time(ranks, hidden: int, rows: int, reps: int = 100) -> float:
    """Median seconds of one all_sum of ``rows`` x ``hidden`` float32, evaluated alone."""
    x = mx.zeros((rows, hidden))
    mx.eval(mx.distributed.all_sum(x, group=ranks.group))
    times = []
    for i in range(reps):
        y = x + i
        mx.eval(y)
        t = time.perf_counter()
        mx.eval(mx.distributed.all_sum(y, group=ranks.group))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def forward_collectives(setup, counter: Counter, rows: int) -> int:
    """Collectives one target forward of ``rows`` tokens builds."""
    cache = Session(setup, 1).fresh_cache()
    before = counter.n
    mx.eval(cache.feed(mx.zeros((rows,), dtype=mx.uint32)))
    return counter.n - before


def worker(args) -> None:
    counter = Counter()
    ranks = distributed.join()
    out: dict = {"ranks": ranks.size if ranks else 1, "workloads": {}}

    def encode(tokenizer, text: str) -> list[int]:
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                              add_generation_prompt=True), add_special_tokens=False)

    work = []
    bundled = None
    if bundled_shards(args.ranks):
        bundled = load_setup(ModelOptions(dtype="float32"), "lookup", ranks)
        work = [(f"lookup / {p}", bundled, encode(bundled.tokenizer, bench.CATEGORIES[p]), 64) for p in PROMPTS]
    pair = load_setup(ModelOptions(model=args.tiny, draft_model=args.tiny_draft, dtype="float32"), "model", ranks)
    work.append(("draft model / tiny pair", pair, encode(pair.tokenizer, "Tell me about the sea and the sky."), 4))
    for name, setup, ids, block in work:
        plain = decode(Session(setup, 1, plain=True), ids, args.max_tokens, counter)
        spec = decode(Session(setup, block), ids, args.max_tokens, counter)
        out["workloads"][name] = {"plain": plain, "spec": spec, "same": plain["tokens"] == spec["tokens"]}
        if ranks is None or ranks.primary:
            print(f"  {name}: plain {plain['decode_tps']:.2f} tok/s, speculative {spec['decode_tps']:.2f} tok/s "
                  f"({spec['tokens_per_block']:.2f} tokens/block), same text {plain['tokens'] == spec['tokens']}",
                  file=sys.stderr, flush=True)
    if ranks is not None:
        hidden = (bundled or pair).target.config["hidden_size"]
        out["forward_collectives"] = {"tiny pair, 1 row": forward_collectives(pair, counter, 1)}
        if bundled is not None:
            out["forward_collectives"].update({"bundled, 1 row": forward_collectives(bundled, counter, 1),
                                               "bundled, 16 rows": forward_collectives(bundled, counter, 16)})
        out["collective_s"] = {"1 row": collective_time(ranks, hidden, 1),
                               "16 rows": collective_time(ranks, hidden, 16),
                               "64 rows": collective_time(ranks, hidden, 64)}
    if ranks is None or ranks.primary:
        Path(args.out).write_text(json.dumps(out))


def bundled_shards(ranks: int) -> bool:
    """Whether the bundled model's heads divide over ``ranks`` (3 do; 2 do not)."""
    from specdec_cli.model import bundled

    config = json.loads((bundled.require() / "config.json").read_text())
    try:
        distributed.check_heads(config, ranks)
    except distributed.ShardingRefused:
        return False
    return True


def speedup(n: float, c: float, c_b: float, C: float, K: float, latency: float, f: float) -> float:
    return n * (f * c + C * latency) / (f * c_b + K * latency)


def summarize(whole: list[dict], sharded: list[dict], ranks: int) -> dict:
    """Medians over repeats of the side-by-side ratios, and the model."""
    med = statistics.median
    latency = med(s["collective_s"]["1 row"] for s in sharded)
    out = {"collective_s": {k: med(s["collective_s"][k] for s in sharded) for k in sharded[0]["collective_s"]},
           "forward_collectives": sharded[0]["forward_collectives"], "workloads": {}}
    for name in whole[0]["workloads"]:
        w = [r["workloads"][name] for r in whole]
        s = [r["workloads"][name] for r in sharded]
        c = med(1 / x["plain"]["decode_tps"] for x in w)
        c_b = med(x["spec"]["decode_s"] / x["spec"]["blocks"] for x in w)
        n = med(x["spec"]["tokens_per_block"] for x in s)
        C = med(x["plain"]["collectives"] / max(len(x["plain"]["tokens"]), 1) for x in s)
        K = med(x["spec"]["collectives"] / max(x["spec"]["blocks"], 1) for x in s)
        row = {
            "sharded_plain_vs_whole_plain": med(b["plain"]["decode_tps"] / a["plain"]["decode_tps"]
                                                for a, b in zip(w, s)),
            "speculative_vs_plain_sharded": med(x["spec"]["decode_tps"] / x["plain"]["decode_tps"] for x in s),
            "speculative_vs_plain_whole": med(x["spec"]["decode_tps"] / x["plain"]["decode_tps"] for x in w),
            "plain_tps": {"whole": med(x["plain"]["decode_tps"] for x in w),
                          "sharded": med(x["plain"]["decode_tps"] for x in s)},
            "spec_tps": {"whole": med(x["spec"]["decode_tps"] for x in w),
                         "sharded": med(x["spec"]["decode_tps"] for x in s)},
            "same_text": all(x["same"] for x in w + s),
            "tokens_per_block": n, "collectives_per_plain_token": C, "collectives_per_spec_block": K,
            "whole_plain_step_s": c, "whole_spec_block_s": c_b,
            "model_here": speedup(n, c, c_b, C, K, latency, 1.0),
            # The collective time a sharded plain step implies, (step - c) / C: inside forwards,
            # a collective waits for the slowest rank's compute too.
            "latency_in_forwards_s": max(0.0, (1 / med(x["plain"]["decode_tps"] for x in s) - c) / C),
            "model_here_fitted": None,
            "model_two_machines": {k: speedup(n, c, c_b, C, K, v, 0.5) for k, v in LATENCIES_S.items()},
            "limit_collective_bound": n * C / K,
            "limit_compute_bound": n * c / c_b,
        }
        row["model_here_fitted"] = speedup(n, c, c_b, C, K, row["latency_in_forwards_s"], 1.0)
        out["workloads"][name] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default="bench-results/distributed.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tiny", help=argparse.SUPPRESS)
    ap.add_argument("--tiny-draft", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    prov = bench.provenance("float32")
    log(f"BLAS: {prov['blas']}; mlx {prov['mlx']}, mlx-lm {prov['mlx_lm']}; {args.ranks} ranks, ring on localhost")
    tmp = Path(tempfile.mkdtemp(prefix="specdec-bench-dist-"))
    tiny = make_model_dir(tmp / "tiny", TINY)
    tiny_draft = make_model_dir(tmp / "tiny-draft", TINY, noise=DRAFT_NOISE)
    launch = str(Path(sys.executable).with_name("mlx.launch"))
    env = dict(os.environ)  # the OpenBLAS preload travels to the workers
    whole, sharded, loads = [], [], []
    for r in range(args.repeats):
        for kind in ("whole", "sharded"):
            out = tmp / f"{kind}-{r}.json"
            cmd = [sys.executable, __file__, "--worker", "--out", str(out), "--tiny", str(tiny),
                   "--tiny-draft", str(tiny_draft), "--max-tokens", str(args.max_tokens), "--ranks", str(args.ranks)]
            run_env = env
            if kind == "sharded":
                cmd = [launch, "--backend", "ring", "-n", str(args.ranks), "--", *cmd]
                # As the CLI's re-exec sets it for ranks that share this machine's cores.
                run_env = {**env, "OPENBLAS_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.ranks))}
            log(f"repeat {r + 1}/{args.repeats}: {kind} (load average {os.getloadavg()[0]:.1f})")
            loads.append(os.getloadavg()[0])
            subprocess.run(cmd, check=True, env=run_env)
            (whole if kind == "whole" else sharded).append(json.loads(out.read_text()))
    summary = summarize(whole, sharded, args.ranks)
    report = {"provenance": prov, "settings": vars(args), "load_average": loads, "summary": summary,
              "whole": whole, "sharded": sharded}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print_summary(summary, args.ranks)
    log(f"wrote {args.out}")


def print_summary(summary: dict, ranks: int) -> None:
    us = {k: 1e6 * v for k, v in summary["collective_s"].items()}
    print(f"one all_sum here ({ranks} ranks): " + ", ".join(f"{k} {v:.0f} us" for k, v in us.items()))
    print(f"collectives per target forward: {summary['forward_collectives']}")
    for name, row in summary["workloads"].items():
        print(f"\n{name}: tokens/block {row['tokens_per_block']:.2f}, collectives per plain token "
              f"{row['collectives_per_plain_token']:.1f}, per speculative block {row['collectives_per_spec_block']:.1f}")
        print(f"  sharded plain / whole plain: {row['sharded_plain_vs_whole_plain']:.3f}x "
              f"({row['plain_tps']['sharded']:.2f} vs {row['plain_tps']['whole']:.2f} tok/s)")
        print(f"  speculative / plain, sharded: {row['speculative_vs_plain_sharded']:.2f}x (model here: "
              f"{row['model_here']:.2f}x at the all_sum timed alone, {row['model_here_fitted']:.2f}x at the "
              f"{1e3 * row['latency_in_forwards_s']:.1f} ms a plain step implies); "
              f"whole: {row['speculative_vs_plain_whole']:.2f}x")
        print("  model, two machines (compute halved): " + ", ".join(
            f"{k} {v:.2f}x" for k, v in row["model_two_machines"].items())
            + f"; limits {row['limit_compute_bound']:.2f}x (no network) .. {row['limit_collective_bound']:.2f}x")


if __name__ == "__main__":
    main()
