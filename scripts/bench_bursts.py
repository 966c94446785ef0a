#!/usr/bin/env python
"""Bursts of new requests: specdec serve against mlx_lm.server, both with their defaults, cold and warm.

What a user meets the first time several clients ask at once: for each
workload and each number of clients N, both servers are started afresh
(defaults on both: no ``--decode-concurrency``, specdec's default drafter,
lookup corpus and memory prompt cache; its disk tier off, as mlx_lm.server
has none), answer one untimed "Hello" each, and then get two bursts of N
requests sent at once: the first is the first batched work after start
(cold), the second comes after it (warm). Every request of every burst is
new to both servers (the prompts are built from templates with a counter: no
prompt is sent twice; edits and summaries share their instruction's words and
the notice's sentences, as a user's similar requests do), and both servers get
the same burst. Workloads (greedy, streamed, the bundled
model's float32 files, the same BLAS for both):

- ``mixed``: mostly open questions, with an edit of a notice, a summary and,
  from 8 clients, a copy (the cycle open, edit, summary, open, copy, open,
  summary, open);
- ``open``: open questions alone (nothing to copy).

Per burst and server: aggregate tokens per second (completion tokens / the
burst's wall time), mean and worst latency, mean time to first token, and
whether the two servers' texts are the same. Ratios are specdec / mlx_lm.
Results go to ``bench-results/serve-bursts.json``.

With ``--start once`` (a lent GPU, where a start costs 15-30 s) both servers
start once for the whole run: the first burst at each number of clients is
then the first time that many rows decode together on that server (new shapes,
compiled then), not the first work after start, and is printed ``first`` (the
second, ``later``; the JSON keeps the keys ``cold`` and ``warm``, and its ``start`` says which). ``--dtype`` picks the files (``bfloat16`` on a GPU, ``4bit``:
the bundled files as shipped).

Usage: python scripts/bench_bursts.py [--concurrency 1,2,4,8,16] [--workloads mixed,open] [--specdec-args '--block-size 1']
       python scripts/bench_bursts.py --start once --dtype bfloat16 --concurrency 1,4,8,16 --workloads mixed
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from bench_serve import NOTICE, ask, free_port, prepare, start, stop, workload  # noqa: E402

THINGS = ["a bicycle", "a refrigerator", "a compass", "a thermostat", "a lighthouse", "a windmill", "a camera",
          "a telescope", "a piano", "a kettle", "a sailboat", "a vaccine", "a battery", "a rainbow", "a volcano",
          "a submarine", "a parachute", "a microwave oven", "a solar panel", "a hot air balloon", "a clock",
          "a bridge", "a dam", "a beehive", "a library", "a printing press", "a lock and key", "a radio",
          "an elevator", "a guitar", "a candle", "a tide", "a snowflake", "a heart", "a tree", "a seed",
          "a glacier", "a river delta", "a spider web", "a thunderstorm"]
TOPICS = ["why people keep dogs", "why cities plant trees", "what makes a good teacher", "why sleep matters",
          "how to start running", "why people collect stamps", "what a farmer does in winter",
          "why museums matter", "how bread is made", "why people learn languages", "what makes a town friendly",
          "why rivers flood", "how to plan a picnic", "why birds migrate", "what a librarian does",
          "why people write letters", "how to care for a houseplant", "why recycling helps",
          "what a good breakfast is", "why people like the sea", "how to make a new friend",
          "why children play games", "what a carpenter builds", "why music helps people relax"]
OPEN_THING = ["Explain in a few sentences how {thing} works.", "Explain to a child what {thing} is for."]
OPEN_TOPIC = ["Write a short paragraph about {topic}.", "Write three sentences about {topic}."]
STREETS = ["Elm", "Oak", "Birch", "Cedar", "Willow", "Chestnut", "Spruce", "Maple", "Poplar", "Ash", "Linden",
           "Hazel", "Juniper", "Magnolia", "Sycamore", "Walnut"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]
PARK = ["a playground", "a small lake", "walking paths", "a dog run", "a picnic area", "a rose garden",
        "a skate park", "a pond with ducks", "a band stand", "tennis courts", "a climbing wall", "a fountain"]
CYCLE = ["open", "edit", "summary", "open", "copy", "open", "summary", "open"]


class Prompts:
    """New prompts, none repeated in a run: each kind's templates filled from a counter."""

    def __init__(self):
        things = [f.format(thing=t) for f in OPEN_THING for t in THINGS]
        topics = [f.format(topic=t) for f in OPEN_TOPIC for t in TOPICS]
        # The two kinds interleaved, so that a burst mixes them; 128 in all, none sent twice.
        self.opens = iter([x for pair in itertools.zip_longest(things, topics) for x in pair if x])
        self.n = itertools.count()

    def make(self, kind: str) -> tuple[str, str, int]:
        i = next(self.n)
        if kind == "open":
            return "open", next(self.opens), 128
        if kind == "edit":
            street, day, new = STREETS[i % len(STREETS)], DAYS[i % 5], DAYS[(i + 1) % 5]
            notice = NOTICE.replace("Elm", street).replace("Tuesday", day)
            return "edit", (f"Fix the day in this notice: the work starts on {new}, not {day}. Return the "
                            f"corrected notice in full.\n\n{notice}"), 256
        a, b, c = (PARK[(i + j * 5) % len(PARK)] for j in range(3))
        text = (f"The city council met on {DAYS[i % 5]} to discuss the new park on {STREETS[i % len(STREETS)]} "
                f"Street. The park will have {a}, {b} and {c}. The council said the park will open next spring.")
        if kind == "summary":
            return "summary", (f"Summarize the following text in two sentences.\n\n{text} Residents asked for "
                               f"more trees and benches, and the council agreed to add them."), 96
        return "copy", f"Copy this text exactly: {text}", 96

    def burst(self, workload: str, n: int) -> list[tuple[str, str, int]]:
        kinds = ["open"] * n if workload == "open" else [CYCLE[i % len(CYCLE)] for i in range(n)]
        return [self.make(k) for k in kinds]


def burst(port: int, requests: list) -> dict:
    """Send every request at once, one client each (bench_serve's workload with as many clients as requests)."""
    return workload(port, requests, len(requests))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--workloads", default="mixed,open")
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "serve-bursts.json"))
    ap.add_argument("--specdec-args", default="", help="more options for specdec serve (default: none, its defaults)")
    ap.add_argument("--dtype", default="float32", help="the files both servers load (bench_serve's --dtype)")
    ap.add_argument("--start", choices=("per-level", "once"), default="per-level",
                    help="start both servers afresh for each number of clients (cold bursts), or once for the run")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]

    work = Path(tempfile.mkdtemp(prefix="bench-bursts-"))
    f32, env, peer_env, library = prepare(work, args.dtype)
    prompts = Prompts()
    results: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores",
                     "blas": str(library) if library else "bundled reference BLAS", "dtype": args.dtype,
                     "start": args.start, "specdec_args": args.specdec_args, "workloads": {}}
    running: dict = {}

    def server_port(server: str) -> int:
        """The server's port: started now (and its untimed "Hello" answered), or still running under --start once."""
        if server in running:
            return running[server][1]
        port = free_port()
        cmd = ([sys.executable, "-m", "mlx_lm", "server"] if server == "mlx_lm" else
               [sys.executable, "-m", "specdec_cli", "serve"])
        extra = shlex.split(args.specdec_args) if server == "specdec" else []
        proc = start([*cmd, "--model", str(f32), "--port", str(port), *extra], port,
                     peer_env if server == "mlx_lm" else env, work / f"{server}.log")
        running[server] = (proc, port)
        ask(port, [{"role": "user", "content": "Hello"}], 8)  # untimed, one request alone
        return port

    try:
        for kind in args.workloads.split(","):
            for level in levels:
                cold, warm = prompts.burst(kind, level), prompts.burst(kind, level)
                row: dict = {"load_before": os.getloadavg()}
                for server in ("mlx_lm", "specdec"):
                    try:
                        port = server_port(server)
                        row[server] = {"cold": burst(port, cold), "warm": burst(port, warm)}
                    finally:
                        if args.start == "per-level" and server in running:
                            stop(running.pop(server)[0])
                for phase in ("cold", "warm"):
                    s, m = row["specdec"][phase], row["mlx_lm"][phase]
                    row[f"{phase}_ratio"] = s["tok_s"] / m["tok_s"]
                    row[f"{phase}_same_text"] = sum(a == b for a, b in zip(s["texts"], m["texts"]))
                    label = phase if args.start == "per-level" else {"cold": "first", "warm": "later"}[phase]
                    print(f"{kind:5s} x{level:<2d} {label}: specdec {s['tok_s']:6.1f} tok/s, mlx_lm "
                          f"{m['tok_s']:6.1f} ({row[f'{phase}_ratio']:.2f}x); mean latency "
                          f"{s['mean_latency_s']:.1f} / {m['mean_latency_s']:.1f} s; TTFT {s['mean_ttft_s']:.2f} / "
                          f"{m['mean_ttft_s']:.2f} s; same text {row[f'{phase}_same_text']}/{level}", flush=True)
                row["requests"] = {"cold": [k for k, _, _ in cold], "warm": [k for k, _, _ in warm]}
                results["workloads"].setdefault(kind, {})[level] = row
                Path(args.out).write_text(json.dumps(results, indent=2))  # what is measured so far survives
    finally:
        for proc, _ in running.values():
            stop(proc)
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
