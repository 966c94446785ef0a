#!/usr/bin/env python
"""specdec serve against mlx_lm.server: the same requests, side by side in one run, the texts compared.

Both servers run the bundled SmolLM2-135M-Instruct in float32 from the same
files (``mlx_lm.convert -d --dtype float32`` writes them), greedy, each with its
own prompt cache, on the same BLAS (the system OpenBLAS is preloaded for both
when there is one).
specdec runs its default drafter (prompt lookup). Requests alternate between
the servers, each kind ``--repeats`` times after one untimed warm-up each:

- edit: a 150-word notice sent whole with one word to change (the answer copies it);
- summary: a paragraph to summarise;
- open: an open question (nothing to copy);
- chat: a three-turn conversation on a ~400-token document (time to first
  token of each turn: the later turns reuse the earlier ones' caches).

Per request: wall time, time to first token (TTFT), decode tok/s (completion
tokens after the first / the time between the first and the last), and
whether the two servers' texts are identical. Ratios are specdec / mlx_lm of
medians over the repeats. Results go to ``bench-results/serve.json``.

With ``--concurrency 1,2,4,8`` it measures several clients at once instead:
a workload of requests (open questions, a summary, an edit and a copy, twice
each) is sent by that many clients at once (each takes the next request when
its last one ends), to each server in turn; then a workload of open questions
alone. Per level and server: aggregate tokens per second (completion tokens of
the whole workload / its wall time), mean and worst request latency, mean
time to first token, and whether every text equals the same request served
alone (at concurrency 1). Results go to ``bench-results/serve-concurrency.json``.

With ``--dialects`` it runs ``specdec serve`` alone and sends the edit request
through the three APIs it speaks, alternating, non-streamed: chat completions,
Anthropic's ``/v1/messages`` and OpenAI's ``/v1/responses``. Per API: wall time
and decode tok/s (the server's own ``timings.predicted_per_second``), medians,
each against chat completions, and whether the three texts are identical.
Results go to ``bench-results/serve-dialects.json``.

With ``--conversation`` it runs only a longer conversation (six turns on the same document),
the two servers' turns alternating, and with ``--prompt-cache-bytes N`` both servers' prompt
caches are bounded to N bytes: set below what the conversation grows to, it shows what each
server resumes once the conversation no longer fits (per turn: TTFT and cached tokens). Results
go to ``bench-results/serve-conversation.json``.

Usage: python scripts/bench_serve.py [--repeats 3] [--out bench-results/serve.json]
       python scripts/bench_serve.py --conversation [--prompt-cache-bytes 30000000]
       python scripts/bench_serve.py --concurrency 1,2,4,8 [--decode-concurrency 8|default]
       python scripts/bench_serve.py --dialects [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec_cli.model import blas
from specdec_cli.model import bundled  # noqa: E402

NOTICE = (
    "Notice to all residents of Elm Street. The city will repair the water main under Elm Street starting on "
    "Tuesday, the third of June. Work will begin at seven in the morning and end at five in the afternoon "
    "each day. During this time the street will be closed to cars between Oak Avenue and Pine Road, but people "
    "on foot may still use the sidewalks on both sides. Water service to the houses on the street will be "
    "turned off for about four hours on the first day only. Please fill a few bottles with water the night "
    "before. Parking on the street will not be allowed while the work goes on, so please move your car to "
    "the lot behind the library on Maple Lane. The work should take about two weeks if the weather is good. "
    "If you have any questions, call the city office during business hours. Thank you for your patience."
)
# Worded so that this small model returns the notice edited rather than rewritten (tried: four wordings).
EDIT = (f"Fix the day in this notice: the work starts on Wednesday, not Tuesday. Return the corrected notice "
        f"in full.\n\n{NOTICE}")
SUMMARY = ("Summarize the following text in two sentences.\n\nThe city council met on Tuesday to discuss the new "
           "park. The park will have a playground, a small lake and walking paths. The council said the park will "
           "open next spring. Residents asked for more trees and benches, and the council agreed to add more trees "
           "and benches to the park.")
OPEN = "Explain in a short paragraph why the sky is blue."
DOCUMENT = " ".join([NOTICE] * 2)
TURNS = [f"Read this notice carefully.\n\n{DOCUMENT}\n\nWhat is being repaired?",
         "When does the work start?", "Where should residents park?"]
MORE_TURNS = ["How long will the work take?", "Who should residents call with questions?",
              "Will the water be turned off every day?"]
KINDS = {"edit": (EDIT, 256), "summary": (SUMMARY, 96), "open": (OPEN, 128)}
COPY = ("Copy this text exactly: The city council met on Tuesday to discuss the new park. The park will have a "
        "playground, a small lake and walking paths. The council said the park will open next spring.")
OPEN2 = "Write a short paragraph about why people enjoy gardening."
OPEN3 = "Explain in a few sentences how a bicycle works."
OPEN4 = "Describe a quiet morning in a small town."
# The workload several clients send at once (kind, prompt, max_tokens), and the open-questions one.
MIXED = [("open", OPEN, 128), ("summary", SUMMARY, 96), ("edit", EDIT, 256), ("copy", COPY, 96),
         ("open", OPEN2, 128), ("summary", SUMMARY.replace("Tuesday", "Monday"), 96),
         ("edit", EDIT.replace("Wednesday", "Thursday"), 256), ("copy", COPY.replace("spring", "summer"), 96)]
OPENS = [("open", q, 128) for q in (OPEN, OPEN2, OPEN3, OPEN4)] * 2


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare(work: Path, dtype: str = "float32") -> tuple[Path, dict, dict, Optional[Path]]:
    """The bundled model's files in ``dtype`` under ``work`` (``mlx_lm.convert``), and each server's environment.

    Both run offline with specdec's disk tier off (memory against memory: mlx_lm.server has none, and
    runs must not resume each other's caches); mlx_lm gets the system OpenBLAS preloaded, as specdec
    preloads it itself. Returns the model folder, specdec's and mlx_lm's environments, and the
    OpenBLAS (None: none here).
    """
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["HF_HUB_OFFLINE"] = "1"
    env["SPECDEC_PROMPT_CACHE_DISK_GB"] = "0"
    library = blas.find_system_openblas() if sys.platform == "linux" else None
    peer_env = dict(env)
    if library:
        peer_env["LD_PRELOAD"] = str(library)
    if dtype == "4bit":  # the bundled files as shipped (4-bit, group size 64)
        return bundled.model_dir(), env, peer_env, library
    folder = work / f"smollm2-{dtype}"
    subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(bundled.model_dir()), "-d",
                    "--dtype", dtype, "--mlx-path", str(folder)], check=True, env=peer_env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return folder, env, peer_env, library


def start(cmd: list[str], port: int, env: dict, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{cmd[0]} exited: see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{cmd[0]} did not start: see {log}")


def stop(proc: subprocess.Popen) -> float:
    """SIGTERM; returns the seconds until the process was gone."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return time.monotonic() - t0


def ask(port: int, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat request: text, TTFT, wall, decode tok/s, usage (and timings when given)."""
    body = {"model": "default_model", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    text, first, last, usage, timings = "", None, None, None, None
    t0 = time.perf_counter()
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("timings"):
                timings = chunk["timings"]
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text += piece
    wall = time.perf_counter() - t0
    n = (usage or {}).get("completion_tokens", 0)
    decode = (n - 1) / (last - first) if first and last and last > first and n > 1 else None
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"text": text, "wall_s": wall, "ttft_s": (first - t0) if first else None, "decode_tps": decode,
            "prompt_tokens": (usage or {}).get("prompt_tokens"), "completion_tokens": n,
            "cached_tokens": details.get("cached_tokens"), "disk_tokens": details.get("disk_tokens"),
            "timings": timings}


def workload(port: int, requests: list, clients: int) -> dict:
    """Send ``requests`` from ``clients`` threads at once (each takes the next when its last ends)."""
    import threading

    todo = list(enumerate(requests))
    lock = threading.Lock()
    answers: dict = {}

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i, (_, prompt, max_tokens) = todo.pop(0)
            answers[i] = ask(port, [{"role": "user", "content": prompt}], max_tokens)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    out = [answers[i] for i in range(len(requests))]
    tokens = sum(a["completion_tokens"] for a in out)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "mean_latency_s": statistics.mean(a["wall_s"] for a in out),
            "worst_latency_s": max(a["wall_s"] for a in out),
            "mean_ttft_s": statistics.mean(a["ttft_s"] for a in out if a["ttft_s"] is not None),
            "texts": [a["text"] for a in out]}


def concurrency(ports: dict, levels: list[int], workloads: list[str]) -> dict:
    """Each workload at each level, each server in turn; texts held against concurrency 1's."""
    results: dict = {}
    for name, requests in (("mixed", MIXED), ("open", OPENS)):
        if name not in workloads:
            continue
        alone: dict = {}
        for level in levels:
            row: dict = {}
            for server in ("mlx_lm", "specdec"):
                got = workload(ports[server], requests, level)
                alone.setdefault(server, got["texts"])
                got["same_as_alone"] = got["texts"] == alone[server]
                row[server] = got
            row["tok_s_ratio"] = row["specdec"]["tok_s"] / row["mlx_lm"]["tok_s"]
            row["latency_ratio"] = row["mlx_lm"]["mean_latency_s"] / row["specdec"]["mean_latency_s"]
            row["texts_equal_across_servers"] = row["mlx_lm"]["texts"] == row["specdec"]["texts"]
            results.setdefault(name, {})[level] = row
            print(f"{name:5s} x{level}: specdec {row['specdec']['tok_s']:6.1f} tok/s, mlx_lm "
                  f"{row['mlx_lm']['tok_s']:6.1f} tok/s ({row['tok_s_ratio']:.2f}x); mean latency "
                  f"{row['specdec']['mean_latency_s']:.2f}s vs {row['mlx_lm']['mean_latency_s']:.2f}s "
                  f"({row['latency_ratio']:.2f}x); worst {row['specdec']['worst_latency_s']:.2f}s vs "
                  f"{row['mlx_lm']['worst_latency_s']:.2f}s; TTFT {row['specdec']['mean_ttft_s']:.2f}s vs "
                  f"{row['mlx_lm']['mean_ttft_s']:.2f}s; same as alone: specdec "
                  f"{row['specdec']['same_as_alone']}, mlx_lm {row['mlx_lm']['same_as_alone']}; "
                  f"same across servers: {row['texts_equal_across_servers']}", flush=True)
    return results


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--concurrency", default=None, help="e.g. 1,2,4,8: clients sending a workload at once")
    ap.add_argument("--workloads", default="mixed,open", help="which workloads --concurrency sends")
    ap.add_argument("--dialects", action="store_true",
                    help="the edit request through chat completions, /v1/messages and /v1/responses (specdec only)")
    ap.add_argument("--dtype", default="float32",
                    help="The dtype both servers' copy of the bundled model is written in (bfloat16 on a GPU), "
                         "or 4bit: the bundled files as shipped")
    ap.add_argument("--decode-concurrency", default="8",
                    help="Both servers' --decode-concurrency in the --concurrency runs, or 'default': each server's "
                         "own (specdec's measured at start-up; mlx_lm.server's default "
                         "is 32; it only matters up to the number of clients)")
    ap.add_argument("--specdec-args", default="", help="More options for specdec serve, e.g. '--lookup-corpus 0' "
                    "(the workloads repeat their requests: with the corpus, a repeat copies the earlier answer)")
    ap.add_argument("--conversation", action="store_true",
                    help="only a six-turn conversation, the servers' turns alternating")
    ap.add_argument("--prompt-cache-bytes", type=int, default=None,
                    help="both servers' --prompt-cache-bytes (default: each server's own)")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")] if args.concurrency else None
    name = "serve-dialects.json" if args.dialects else "serve-concurrency.json" if levels else \
        "serve-conversation.json" if args.conversation else "serve.json"
    args.out = args.out or str(ROOT / "bench-results" / name)

    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    f32, env, peer_env, library = prepare(work, args.dtype)

    ports = {"mlx_lm": free_port(), "specdec": free_port()}
    batch = ["--decode-concurrency", args.decode_concurrency] if levels and args.decode_concurrency != "default" else []
    if args.prompt_cache_bytes is not None:
        batch += ["--prompt-cache-bytes", str(args.prompt_cache_bytes)]
    procs = {} if args.dialects else {
        "mlx_lm": start([sys.executable, "-m", "mlx_lm", "server", "--model", str(f32), "--port",
                         str(ports["mlx_lm"]), *batch], ports["mlx_lm"], peer_env, work / "mlx_lm.log"),
        # The same files for both: the bundled 4-bit weights dequantized in-process round differently
        # from mlx_lm.convert's, which changes near-tie tokens.
    }
    procs["specdec"] = start([sys.executable, "-m", "specdec_cli", "serve", "--model", str(f32), "--port",
                              str(ports["specdec"]), *batch, *args.specdec_args.split()], ports["specdec"], env,
                             work / "specdec.log")
    results: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()}",
                     "blas": str(library) if library else "bundled reference BLAS", "repeats": args.repeats,
                     "requests": {}}
    try:
        for name in procs:  # untimed warm-up of each server
            ask(ports[name], [{"role": "user", "content": "Hello"}], 8)
        if args.dialects:
            results["dialects"] = dialects(ports["specdec"], args.repeats)
        elif args.conversation:
            results["prompt_cache_bytes"] = args.prompt_cache_bytes
            results["conversation"] = conversation(ports, TURNS + MORE_TURNS)
        elif levels:
            results["decode_concurrency"] = args.decode_concurrency
            results["specdec_args"] = args.specdec_args
            # What specdec runs with (its default is chosen at start-up): its health endpoint says.
            results["specdec_decode_concurrency"] = httpx.get(
                f"http://127.0.0.1:{ports['specdec']}/health", timeout=10).json().get("decode_concurrency")
            results["workloads"] = concurrency(ports, levels, args.workloads.split(","))
        else:
            single(ports, results, args.repeats)
    finally:
        results["stop_s"] = {name: stop(p) for name, p in procs.items()}
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


def ask_dialect(port: int, api: str, prompt: str, max_tokens: int) -> dict:
    """One non-streamed request through ``api``: its text, wall time and the server's timings."""
    if api == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                              "max_tokens": max_tokens}
    elif api == "messages":
        path, body = "/v1/messages", {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    else:
        path, body = "/v1/responses", {"input": prompt, "max_output_tokens": max_tokens}
    body.update(model="default_model", temperature=0.0)
    t0 = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=600)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    out = r.json()
    if api == "chat":
        text = out["choices"][0]["message"]["content"]
    elif api == "messages":
        text = "".join(b["text"] for b in out["content"] if b["type"] == "text")
    else:
        text = "".join(c["text"] for item in out["output"] if item["type"] == "message"
                       for c in item["content"] if c["type"] == "output_text")
    return {"text": text, "wall_s": wall, "decode_tps": out["timings"]["predicted_per_second"]}


def dialects(port: int, repeats: int) -> dict:
    """The edit request through each API, alternating: medians, ratios to chat completions, texts compared."""
    prompt, max_tokens = KINDS["edit"]
    apis = ("chat", "messages", "responses")
    runs = {api: [] for api in apis}
    for _ in range(repeats):
        for api in apis:
            runs[api].append(ask_dialect(port, api, prompt, max_tokens))
    out = {api: {"wall_s": median(r["wall_s"] for r in rs), "decode_tps": median(r["decode_tps"] for r in rs),
                 "runs": [{k: r[k] for k in ("wall_s", "decode_tps")} for r in rs]} for api, rs in runs.items()}
    texts = {r["text"] for rs in runs.values() for r in rs}
    out["identical"] = len(texts) == 1
    for api in apis:
        out[api]["decode_ratio_to_chat"] = out[api]["decode_tps"] / out["chat"]["decode_tps"]
        print(f"{api:9s} decode {out[api]['decode_tps']:6.1f} tok/s ({out[api]['decode_ratio_to_chat']:.2f}x chat "
              f"completions), wall {out[api]['wall_s']:.2f} s", flush=True)
    print(f"identical texts: {out['identical']}", flush=True)
    return out


def single(ports: dict, results: dict, repeats: int) -> None:
    """One request at a time: each kind alternating between the servers, then a three-turn chat."""
    for kind, (prompt, max_tokens) in KINDS.items():
        runs = {"mlx_lm": [], "specdec": []}
        for _ in range(repeats):
            for name in ("mlx_lm", "specdec"):
                runs[name].append(ask(ports[name], [{"role": "user", "content": prompt}], max_tokens))
        row = {name: {"wall_s": median(r["wall_s"] for r in rs), "ttft_s": median(r["ttft_s"] for r in rs),
                      "decode_tps": median(r["decode_tps"] for r in rs),
                      "completion_tokens": rs[0]["completion_tokens"]} for name, rs in runs.items()}
        row["identical"] = all(a["text"] == b["text"] for a, b in zip(runs["mlx_lm"], runs["specdec"]))
        row["wall_ratio"] = row["mlx_lm"]["wall_s"] / row["specdec"]["wall_s"]
        row["decode_ratio"] = row["specdec"]["decode_tps"] / row["mlx_lm"]["decode_tps"]
        row["specdec_timings"] = runs["specdec"][-1]["timings"]
        row["texts"] = {name: runs[name][0]["text"] for name in runs}
        results["requests"][kind] = row
        print(f"{kind:8s} decode {row['specdec']['decode_tps']:7.1f} vs {row['mlx_lm']['decode_tps']:7.1f} "
              f"tok/s ({row['decode_ratio']:.2f}x), wall {row['wall_ratio']:.2f}x faster, "
              f"identical={row['identical']}", flush=True)
    convo = {}
    for name in ("mlx_lm", "specdec"):
        turns, messages = [], []
        for text in TURNS:
            messages.append({"role": "user", "content": text})
            out = ask(ports[name], messages, 64)
            messages.append({"role": "assistant", "content": out["text"]})
            turns.append({k: out[k] for k in ("ttft_s", "wall_s", "decode_tps", "cached_tokens")})
        convo[name] = turns
        ttft = [t["ttft_s"] for t in turns]
        print(f"chat     {name:8s} TTFT per turn " + ", ".join(f"{x:.3f}s" for x in ttft)
              + f" (later/first: {', '.join(f'{x / ttft[0]:.0%}' for x in ttft[1:])})", flush=True)
    results["conversation"] = convo


def conversation(ports: dict, turns: list[str]) -> dict:
    """One conversation per server, their turns alternating: TTFT and cached tokens per turn, texts compared."""
    messages = {name: [] for name in ports}
    out = {name: [] for name in ports}
    for i, text in enumerate(turns):
        for name in ports:
            messages[name].append({"role": "user", "content": text})
            r = ask(ports[name], messages[name], 48)
            messages[name].append({"role": "assistant", "content": r["text"]})
            out[name].append({k: r[k] for k in ("ttft_s", "prompt_tokens", "cached_tokens", "text")})
        a, b = out["mlx_lm"][-1], out["specdec"][-1]
        print(f"turn {i + 1}: prompt {b['prompt_tokens']:5d} tokens; TTFT mlx_lm {a['ttft_s']:.3f}s (cached "
              f"{a['cached_tokens']}), specdec {b['ttft_s']:.3f}s (cached {b['cached_tokens']}): "
              f"{a['ttft_s'] / b['ttft_s']:.2f}x; identical={a['text'] == b['text']}", flush=True)
    later = slice(1, None)
    ttft = {name: sum(t["ttft_s"] for t in out[name][later]) for name in ports}
    print(f"later turns' TTFT, summed: mlx_lm {ttft['mlx_lm']:.3f}s, specdec {ttft['specdec']:.3f}s "
          f"({ttft['mlx_lm'] / ttft['specdec']:.2f}x)", flush=True)
    return {"turns": out, "later_ttft_s": ttft}


if __name__ == "__main__":
    main()
