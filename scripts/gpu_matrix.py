#!/usr/bin/env python
"""The default command with ``--compare-ar`` over prompts and dtypes, each run time-boxed: what a user gets.

Each configuration is a fresh ``specdec generate PROMPT --compare-ar --json``
process (cold, as a user runs it) on the bundled model, with ``--dtype`` and
any extra options. A run that outlives its time box gets SIGUSR1 first (its
Python stacks go to the log: where it hung), then is killed. One JSON line per
run goes to ``--out``; a markdown table to stdout.

Usage: python scripts/gpu_matrix.py --out runs.jsonl [--dtypes auto,bfloat16]
           [--prompts copy,edit,summary,open] [--timeout 45] [--max-tokens 256] [--repeat N]
           [-- EXTRA...]
       python scripts/gpu_matrix.py --prefill --out prefill.jsonl [--repeat N]: the long prompt's prefill
           with cuDNN's attention on and off, alternating, 4 tokens each, bf16
       python scripts/gpu_matrix.py --pairs N --out pairs.jsonl [--dtypes ...] [--prompts ...] [-- EXTRA...]:
           speculative and plain decoding alternated in ONE process per dtype, N pairs per prompt (each pair
           is the default command with --compare-ar, run in-process: speculative, then plain, both warm);
           the median speedup and its spread (min..max) per prompt. Between processes plain decoding's own
           speed moved 2x on a lent H200; within one process a 5% difference shows.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COPY = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a tin can of oil and "
        "a cloth. He polished the great lens until it gleamed, trimmed the wick, and lit the lamp. Ships far "
        "out at sea saw the beam sweep across the water every ten seconds, and they knew the rocks were near. "
        "In winter the wind howled around the tower and ice formed on the railings, but the light never failed. "
        "When he retired after forty years, the village gave him a brass clock, and he kept it wound until "
        "the day he died.")
EDIT = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(valuez)\n\n"
        "def variance(values):\n    m = mean(values)\n    total = 0\n    for v in values:\n        total += (v - m) ** 2\n"
        "    return total / len(values)\n")
PROMPTS = {
    "copy": f"Copy the following text exactly, word for word:\n\n{COPY}",
    "edit": f"Fix the typo in this Python code and return the whole corrected file:\n\n{EDIT}",
    "summary": f"Summarize this story in three sentences:\n\n{COPY}",
    "open": "Explain how a refrigerator keeps food cold.",
    # More open questions, far from `specdec distill`'s seed topics: a head trained on those is scored on these.
    "why": "Explain why onions make people cry when they are cut.",
    "advice": "What are good ways to keep houseplants alive while I travel for two weeks?",
    "how": "How does a microwave oven heat food?",
    # Prefill only (``--prefill``): 1,962 tokens with the chat template, where attention's kernel choice shows.
    "long": "Summarize these notes:\n\n" + "\n\n".join(f"Note {i}: {COPY}" for i in range(16)),
}
# Stacks on SIGUSR1, then the CLI as `specdec` runs it.
# A watchdog thread dumps them too, ahead of the time box (it needs no signal delivered to a busy main thread).
LAUNCH = ("import faulthandler, os, signal, sys; faulthandler.register(signal.SIGUSR1, all_threads=True); "
          "faulthandler.dump_traceback_later(float(os.environ['WATCHDOG_S']), exit=False); "
          "sys.argv = ['specdec'] + sys.argv[1:]; from specdec_cli.cli.app import main; main()")


def where(pid: int) -> dict:
    """What a stuck process is doing, from outside: its state, kernel wait channel, threads and the GPU's load."""
    seen = {}
    for name in ("wchan", "stat"):
        try:
            seen[name] = Path(f"/proc/{pid}/{name}").read_text()[:300]
        except OSError as e:
            seen[name] = str(e)
    try:
        seen["threads"] = len(os.listdir(f"/proc/{pid}/task"))
        seen["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        seen["nvidia_smi"] = str(e)
    return seen


def run(prompt: str, dtype: str, extra: list[str], timeout: float, max_tokens: int) -> dict:
    cmd = [sys.executable, "-c", LAUNCH, "generate", PROMPTS[prompt], "--compare-ar", "--json",
           "-m", str(max_tokens), "--dtype", dtype, *extra]
    env = dict(os.environ, SPECDEC_NO_REEXEC="1", PYTHONUNBUFFERED="1", WATCHDOG_S=str(max(1.0, timeout - 6)))
    t0 = time.perf_counter()
    # stderr into a file, not a pipe: whatever the process wrote survives its kill.
    with tempfile.TemporaryFile("w+") as errf:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errf, text=True, env=env)
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            seen = where(p.pid)
            p.send_signal(signal.SIGUSR1)
            time.sleep(2)
            p.kill()
            p.communicate()
            errf.seek(0)
            return {"prompt": prompt, "dtype": dtype, "extra": extra, "timed_out": timeout, "process": seen,
                    "stacks": errf.read()[-8000:], "wall_s": round(time.perf_counter() - t0, 1)}
        errf.seek(0)
        err = errf.read()
    row = {"prompt": prompt, "dtype": dtype, "extra": extra, "rc": p.returncode,
           "wall_s": round(time.perf_counter() - t0, 1)}
    try:
        d = json.loads(out)
    except ValueError:
        row["stderr"] = err[-3000:]
        return row
    row["notes"] = err[-1500:]
    c = d.get("compare") or {}
    keep = ("dtype", "prompt_tokens", "generated_tokens", "prefill_s", "warmup_s", "decode_s", "decode_tps",
            "blocks", "acceptance", "tokens_per_block", "warmup_shapes", "verify_shapes", "shapes")
    row.update({k: d[k] for k in keep if k in d})
    row.update(ar_decode_tps=c.get("ar_decode_tps"), speedup=c.get("speedup"), verdict=c.get("verdict"),
               first_divergence=c.get("first_divergence"))
    return row


def pair(prompt: str, dtype: str, extra: list[str], max_tokens: int) -> dict:
    """One pair, in this process: the default command with --compare-ar (speculative, then plain decoding)."""
    import contextlib
    import io

    import typer

    from specdec_cli.cli.app import app

    args = ["generate", PROMPTS[prompt], "--compare-ar", "--json", "-m", str(max_tokens), "--dtype", dtype, *extra]
    out = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out):
        try:
            code = typer.main.get_command(app).main(args=args, prog_name="specdec", standalone_mode=False)
        except SystemExit as e:
            code = e.code
    row = {"prompt": prompt, "dtype": dtype, "extra": extra, "rc": code or 0,
           "wall_s": round(time.perf_counter() - t0, 1)}
    try:
        d = json.loads(out.getvalue())
    except ValueError:
        row["stdout"] = out.getvalue()[-2000:]
        return row
    c = d.get("compare") or {}
    row.update({k: d.get(k) for k in ("dtype", "decode_tps", "blocks", "acceptance", "generated_tokens")})
    row.update(ar_decode_tps=c.get("ar_decode_tps"), speedup=c.get("speedup"), verdict=c.get("verdict"))
    return row


def driver(args, extra: list[str]) -> None:
    """``--pairs`` inside one process: every prompt's pairs in turn, one JSON line each as it ends; with several
    ``--pipeline`` variants, each pair runs them in turn (alternating their order from pair to pair)."""
    from specdec_cli.model.blas import maybe_reexec

    maybe_reexec()  # the BLAS the CLI itself runs on (a Linux CPU's OpenBLAS), before MLX loads
    from specdec_cli.loop import engine

    variants = args.pipeline.split(",")
    for prompt in args.prompts.split(","):
        for i in range(args.pairs):
            for v in variants if i % 2 == 0 else variants[::-1]:
                # Blocks without drafts queue the next forward or not; "auto": as the device's numerics say;
                # "always": ahead of blocks that may draft too (engine.PIPELINE_ALWAYS).
                engine.PIPELINE = {"on": True, "always": True, "off": False}.get(v)
                engine.PIPELINE_ALWAYS = v == "always"
                row = pair(prompt, args.dtypes, extra, args.max_tokens)
                print(json.dumps({**row, "pair": i, "pipeline": v}), flush=True)


def spread(rows: list[dict]) -> dict:
    """Median speedup and its spread over a prompt's pairs (ratios taken within each pair)."""
    import statistics

    ratios = sorted(r["speedup"] for r in rows if r.get("speedup"))
    spec = [r["decode_tps"] for r in rows if r.get("decode_tps")]
    plain = [r["ar_decode_tps"] for r in rows if r.get("ar_decode_tps")]
    if not ratios:
        return {"pairs": 0}
    return {"pairs": len(ratios), "median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1],
            "spec_tps": statistics.median(spec), "plain_tps": statistics.median(plain),
            "plain_min": min(plain), "plain_max": max(plain),
            "verdicts": sorted({r.get("verdict") for r in rows})}


def pairs(args, extra: list[str]) -> None:
    """One time-boxed process per dtype running :func:`driver`; a table of medians and spreads."""
    print("| dtype | prompt | extra | pairs | speedup median | min..max | spec tok/s | plain tok/s (min..max) "
          "| verdicts |")
    print("|---|---|---|---|---|---|---|---|---|")
    label = " ".join(extra)
    n_prompts = len(args.prompts.split(","))
    for dtype in args.dtypes.split(","):
        cmd = [sys.executable, __file__, "--driver", "--pairs", str(args.pairs), "--dtypes", dtype,
               "--prompts", args.prompts, "--max-tokens", str(args.max_tokens), "--pipeline", args.pipeline,
               "--", *extra]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        box = args.timeout * args.pairs * n_prompts * len(args.pipeline.split(","))
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=box)
            out, err = p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = f"timed out after {box:.0f} s"
        rows = []
        for line in out.splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
            if not rows:
                f.write(json.dumps({"dtype": dtype, "error": err[-3000:]}) + "\n")
        cells = [(prompt, v) for prompt in args.prompts.split(",") for v in args.pipeline.split(",")]
        for prompt, v in cells:
            s = spread([r for r in rows if r["prompt"] == prompt and r.get("pipeline") == v])
            name = label if v == "auto" else f"{label} (pipeline {v})".strip()
            if not s["pairs"]:
                print(f"| {dtype} | {prompt} | {name} | 0 | no pair finished: {err[-200:]!r} | | | | |", flush=True)
                continue
            print(f"| {dtype} | {prompt} | {name} | {s['pairs']} | {s['median']:.2f}x | {s['min']:.2f}..{s['max']:.2f} "
                  f"| {s['spec_tps']:.1f} | {s['plain_tps']:.1f} ({s['plain_min']:.1f}..{s['plain_max']:.1f}) "
                  f"| {', '.join(map(str, s['verdicts']))} |", flush=True)

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--dtypes", default="auto,bfloat16")
    ap.add_argument("--prompts", default="copy,edit,summary,open")
    ap.add_argument("--timeout", type=float, default=45)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--print", metavar="PROMPT", help="Print that prompt's text and exit")
    ap.add_argument("--repeat", type=int, default=1, help="Run each configuration N times")
    ap.add_argument("--prefill", action="store_true", help="Time the long prompt's prefill, cuDNN on and off")
    ap.add_argument("--pairs", type=int, default=0,
                    help="Speculative and plain decoding alternated in one process, N pairs per prompt")
    ap.add_argument("--pipeline", default="auto", help="auto (the device's default), on, off, always, or several "
                    "(on,off): blocks without drafts pipelined (always: ahead of blocks that may draft too) or not, "
                    "each variant in every pair (alternating their order)")
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)  # --pairs' own process
    args, extra = ap.parse_known_args()
    extra = [x for x in extra if x != "--"]
    if args.print:
        print(PROMPTS[args.print])
        return
    if args.prefill:
        prefill(args)
        return
    if args.driver:
        driver(args, extra)
        return
    if args.pairs:
        pairs(args, extra)
        return
    print("| dtype | prompt | extra | spec tok/s | plain tok/s | speedup | verdict | warm-up s | blocks | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    label = " ".join(extra)
    with open(args.out, "a") as f:
        for dtype in args.dtypes.split(","):
            stalled = False
            for prompt in args.prompts.split(","):
                for _ in range(args.repeat):
                    if stalled:  # one stall in a dtype says enough; the time box is short
                        print(f"| {dtype} | {prompt} | {label} | skipped after a stall | | | | | | |", flush=True)
                        continue
                    r = run(prompt, dtype, extra, args.timeout, args.max_tokens)
                    stalled = "timed_out" in r
                    f.write(json.dumps(r) + "\n")
                    f.flush()
                    if "timed_out" in r:
                        print(f"| {dtype} | {prompt} | {label} | no output in {args.timeout:.0f} s "
                              f"| | | | | | {r['wall_s']} |", flush=True)
                        continue
                    fmt = lambda x, p=1: "?" if x is None else f"{x:.{p}f}"
                    print(f"| {r.get('dtype', dtype)} | {prompt} | {label} | {fmt(r.get('decode_tps'))} "
                          f"| {fmt(r.get('ar_decode_tps'))} | {fmt(r.get('speedup'), 2)}x | {r.get('verdict')} "
                          f"| {fmt(r.get('warmup_s'), 2)} | {r.get('blocks')} | {r['wall_s']} |", flush=True)

def prefill(args) -> None:
    """The long prompt's prefill, cuDNN's attention on then off, then off then on: a fresh process each."""
    print("| cuDNN attention | prompt tokens | prefill s | prefill tok/s | wall s |")
    print("|---|---|---|---|---|")
    with open(args.out, "a") as f:
        for r in range(args.repeat):
            for cudnn in ("1", "0") if r % 2 == 0 else ("0", "1"):
                cmd = [sys.executable, "-m", "specdec_cli", "generate", PROMPTS["long"], "-m", "4", "--json",
                       "--dtype", "bfloat16", "--prompt-cache-disk-gb", "0"]  # each process prefills it all
                env = dict(os.environ, SPECDEC_NO_REEXEC="1", MLX_CUDA_USE_CUDNN_SDPA=cudnn)
                t0 = time.perf_counter()
                try:
                    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
                    d = json.loads(p.stdout)
                except (subprocess.TimeoutExpired, ValueError) as e:
                    d = {"error": str(e)[-500:]}
                row = {"cudnn": cudnn, "wall_s": round(time.perf_counter() - t0, 1),
                       **{k: d.get(k) for k in ("prompt_tokens", "prefill_s", "prompt_tps", "error") if k in d}}
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(f"| {cudnn} | {row.get('prompt_tokens')} | {row.get('prefill_s')} | {row.get('prompt_tps')} "
                      f"| {row['wall_s']} |", flush=True)


if __name__ == "__main__":
    main()
