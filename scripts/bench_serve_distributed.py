#!/usr/bin/env python
"""Sharded serving: ``specdec serve`` against ``mlx_lm.server``, both under ``mlx.launch --backend ring -n R``.

Both servers are started under MLX's launcher on this one machine (R ranks,
ring backend over localhost; rank 0 serves HTTP), each tensor-parallel over
the R ranks, on the bundled SmolLM2-135M-Instruct in float32 from the same
files (``scripts/bench_serve.py``'s ``prepare``: ``mlx_lm.convert -d --dtype
float32``), greedy, defaults otherwise. specdec runs its default drafter
(prompt lookup, with its default corpus of recent answers); mlx_lm.server
refuses draft models when distributed, so it decodes plainly. Both get
``--decode-concurrency`` as ``bench_serve.py --concurrency`` gives them (8
by default), both run on the system OpenBLAS (specdec preloads it itself by
re-executing; mlx_lm's ranks get it in ``LD_PRELOAD``, as bench_serve gives
it) and both get ``OPENBLAS_NUM_THREADS`` = cores // R, the value specdec's
re-exec sets for ranks that share one machine's cores, so that mlx_lm's
ranks run no more BLAS threads than specdec's.

At each level of clients (``--concurrency``, e.g. 1,4,8) a workload is sent
by that many clients at once (``bench_serve.workload``: each client takes the
next request when its last one ends) to each server in turn, the server that
goes first alternating from level to level. By default each server is started
for its turn and stopped after it (each turn then starts from a fresh server:
its warm-up, an empty prompt cache and, for specdec, an empty answer corpus),
because an idle sharded server is not idle: its ranks poll each other (measured
here with 3 ranks: about 0.9 of the 2 cores for an idle mlx_lm.server, 0.6 for
an idle specdec serve), which would slow whichever server is measured.
``--together`` keeps both up for the whole run instead, as bench_serve does.

The workload is bench_serve.py's mixed one (open questions, a copy, a
summary and an edit, in an order whose every prefix mixes the kinds: open,
copy, summary, edit, then their variants) with every ``max_tokens`` set to
``--max-tokens``; a level sends ``max(--requests, clients)`` requests (request
i is the i-th of that order, cycled), so that every client has one. Per level
and server: aggregate tokens per second (completion tokens of the whole
workload / its wall time), mean and worst latency, mean time to first token,
the load average (``os.getloadavg``) before and after, whether the texts
equal the same requests' at the first level (same server), and how many of
specdec's texts equal mlx_lm's (reported, not asserted: greedy, but sharded
arithmetic can round a near-tie either way). specdec's own counts (tokens
drafted and accepted, blocks, from the ``timings`` of its streamed answers)
are summed per level; its log (start-up lines, one line per answer) and its
/health (corpus, prompt cache, ranks) are kept.

Every launcher is started in a session of its own and stopped with its whole
process group: SIGINT (Ctrl-C, as a terminal sends it to every rank), then
SIGKILL for anything still alive after ``--stop-timeout`` seconds; the JSON
says how each group ended and whether any process survived. ``mlx.launch``
exits 0 whatever its ranks return, so a rank's failure is read from its
``[WARN] Node with rank N ...`` lines, kept with every error line of the log.

A rank count that does not divide the model's heads (the bundled model has 9
attention and 3 KV heads: 2 ranks do not divide 9) is still tried on both
servers: what each does (a refusal at start-up, an error at the first
request) goes into the JSON and the comparison is skipped, with no numbers.

Usage (one machine; sharded decoding here runs at ~0.3-0.5 tok/s a row, so the
workload is small: the first command took 17 minutes here)::

    python scripts/bench_serve_distributed.py --ranks 3 --concurrency 1,4,8 --requests 4 --max-tokens 48 \\
        --out bench-results/serve-distributed-3.json
    python scripts/bench_serve_distributed.py --ranks 2 --out bench-results/serve-distributed-2.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve  # noqa: E402  (this script's folder is first on sys.path)
from bench_serve import ROOT, free_port, prepare, workload  # noqa: E402

LAUNCH = Path(sys.executable).with_name("mlx.launch")
SERVERS = ("mlx_lm", "specdec")
# What the launcher and the ranks write that says a rank failed or an error happened.
TROUBLE = re.compile(r"\[WARN\]|Traceback|^error|Error:|rank \d+:|\[ring\]", re.IGNORECASE)

# Each answer's specdec timings, gathered through bench_serve's own ask (workload calls it by name).
_ANSWERS: list[dict] = []
_ask = bench_serve.ask


def _recording_ask(port: int, messages: list[dict], max_tokens: int) -> dict:
    out = _ask(port, messages, max_tokens)
    _ANSWERS.append({"port": port, "timings": out.get("timings"), "completion_tokens": out["completion_tokens"]})
    return out


bench_serve.ask = _recording_ask


def group_alive(group: int) -> list[int]:
    """The live (not zombie) processes of process group ``group``, read from /proc."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def launched(cmd: list[str], ranks: int) -> list[str]:
    return [str(LAUNCH), "--backend", "ring", "-n", str(ranks), "--starting-port", str(free_port()), "--", *cmd]


def start(cmd: list[str], port: int, env: dict, log: Path, timeout: float) -> tuple[Optional[subprocess.Popen], dict]:
    """``cmd`` (already under mlx.launch) in a session of its own, until rank 0's /health answers 200.

    As ``bench_serve.start``, but the launcher leads its own process group (so that every rank can be
    ended with it) and a failure is returned, not raised. Its stdin is a pipe nobody writes: the
    launcher copies its stdin to every rank, and on /dev/null its select loop would spin.
    Returns the launcher (None: it did not come up) and what happened.
    """
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    deadline = t0 + timeout
    status = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            stop(proc, 5)  # ranks the launcher left behind
            return None, {"started": False, "why": f"the launcher exited ({proc.returncode}) before /health "
                          f"answered 200", "log_tail": tail(log)}
        try:
            status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code
            if status == 200:
                return proc, {"started": True, "start_s": time.monotonic() - t0}
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stopped = stop(proc, 5)
    return None, {"started": False, "why": f"/health did not answer 200 within {timeout:.0f} s (last: {status})",
                  "stopped": stopped, "log_tail": tail(log)}


def stop(proc: subprocess.Popen, timeout: float) -> dict:
    """SIGINT to the launcher's whole group, then SIGKILL to whatever is left after ``timeout`` seconds."""
    t0 = time.monotonic()
    group = proc.pid
    out = {"signal": "SIGINT"}
    try:
        os.killpg(group, signal.SIGINT)
    except ProcessLookupError:
        pass
    deadline = t0 + timeout
    while group_alive(group) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = group_alive(group)
    if left:
        out.update(signal="SIGKILL", alive_after_sigint=len(left))
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass
    time.sleep(0.5)
    out.update(stop_s=time.monotonic() - t0, launcher_exit=proc.poll(), survivors=group_alive(group))
    return out


def tail(log: Path, n: int = 30) -> list[str]:
    try:
        return log.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def trouble(log: Path) -> list[str]:
    """The log's lines that say a rank failed or an error happened."""
    try:
        return [line for line in log.read_text(errors="replace").splitlines() if TROUBLE.search(line)]
    except OSError:
        return []


# bench_serve's mixed workload in an order whose every prefix mixes the kinds: open, copy, summary, edit, ...
ORDER = (0, 3, 1, 2, 4, 7, 5, 6)


def requests_for(clients: int, count: int, max_tokens: int) -> list:
    """``max(count, clients)`` requests of the mixed workload (in ``ORDER``, cycled), each with ``max_tokens``."""
    mixed = [bench_serve.MIXED[i] for i in ORDER]
    return [(kind, prompt, max_tokens) for kind, prompt, _ in
            (mixed[i % len(mixed)] for i in range(max(count, clients)))]


def specdec_counts(answers: list[dict]) -> dict:
    """specdec's own counts over a level's answers (its streamed timings)."""
    timings = [a["timings"] for a in answers if a["timings"]]
    drafted = sum(t.get("draft_n") or 0 for t in timings)
    accepted = sum(t.get("draft_n_accepted") or 0 for t in timings)
    predicted = sum(t.get("predicted_n") or 0 for t in timings)
    blocks = [t["predicted_n"] / t["tokens_per_block"] for t in timings
              if t.get("tokens_per_block") and t.get("predicted_n")]
    return {"answers_with_timings": len(timings), "answers": len(answers), "predicted_n": predicted,
            "draft_n": drafted, "draft_n_accepted": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "tokens_per_block": predicted / sum(blocks) if blocks else None,
            "blocks": round(sum(blocks)) if blocks else None,
            "cache_n": sum(t.get("cache_n") or 0 for t in timings),
            "drafter": sorted({t.get("drafter") for t in timings if t.get("drafter")})}


class Servers:
    """Each server's command line under mlx.launch, started and stopped as its process group."""

    def __init__(self, args, model: Path, envs: dict, work: Path):
        self.args, self.model, self.envs, self.work = args, model, envs, work
        self.procs: dict = {}
        self.ports: dict = {}
        self.starts: list[dict] = []  # every start: server, tag, what happened, how it stopped, its log's trouble

    def command(self, name: str, port: int) -> list[str]:
        a = self.args
        batch = ["--decode-concurrency", a.decode_concurrency] if a.decode_concurrency != "default" else []
        if name == "mlx_lm":
            cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(self.model), "--port", str(port), *batch]
        else:
            cmd = [sys.executable, "-m", "specdec_cli", "serve", "--model", str(self.model), "--port", str(port),
                   *batch, *a.specdec_args.split()]
        return launched(cmd, a.ranks)

    def up(self, name: str, tag: str) -> bool:
        """Start ``name`` and send it the untimed warm-up (bench_serve's); False: it cannot serve."""
        port = free_port()
        log = self.work / f"{name}-{tag}.log"
        cmd = self.command(name, port)
        print(f"[{tag}] starting {name} under mlx.launch -n {self.args.ranks} (load {os.getloadavg()[0]:.1f}) ...",
              flush=True)
        proc, info = start(cmd, port, self.envs[name], log, self.args.start_timeout)
        info.update(server=name, tag=tag, command=cmd, log=log)
        self.starts.append(info)
        if proc is None:
            info["log_trouble"] = trouble(log)
            print(f"{name} did not start: {info['why']}\n  " + "\n  ".join(info["log_tail"][-8:]), flush=True)
            return False
        self.procs[name], self.ports[name] = proc, port
        print(f"{name} up in {info['start_s']:.0f} s", flush=True)
        try:
            t0 = time.monotonic()
            out = bench_serve.ask(port, [{"role": "user", "content": "Hello"}], 8)
            info["warmup_s"] = time.monotonic() - t0
            info["warmup_answer"] = {k: out[k] for k in ("text", "completion_tokens")}
            time.sleep(1)  # a rank's traceback reaches the launcher's stderr
            failed = [line for line in trouble(log) if "Traceback" not in line]
            if not out["completion_tokens"] or failed:
                # A stream can end with nothing in it and no HTTP error (mlx_lm: its generation thread died).
                raise RuntimeError(f"{out['completion_tokens']} tokens; the log says: {failed[-3:]}")
        except Exception as e:  # noqa: BLE001  (a sharding that fails at its first forward)
            info["warmup_error"] = f"{type(e).__name__}: {e}"
            print(f"{name}'s first request failed: {info['warmup_error']}", flush=True)
            self.down(name)
            return False
        if name == "specdec":
            info["health"] = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
        return True

    def down(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        info = next(s for s in reversed(self.starts) if s["server"] == name)
        if name == "specdec":  # what it holds now, and again once its last rows have left
            try:
                info["health_at_end"] = httpx.get(f"http://127.0.0.1:{self.ports[name]}/health", timeout=10).json()
                time.sleep(10)
                info["health_10s_later"] = httpx.get(f"http://127.0.0.1:{self.ports[name]}/health",
                                                     timeout=10).json()
            except httpx.HTTPError as e:
                info["health_error"] = f"{type(e).__name__}: {e}"
        info["stopped"] = stop(proc, self.args.stop_timeout)
        info["log_trouble"] = trouble(info["log"])
        if name == "specdec":  # its start-up lines and one line per answer
            info["log_lines"] = tail(info["log"], 1000)
        else:
            info["log_tail"] = tail(info["log"], 15)

    def down_all(self) -> None:
        for name in list(self.procs):
            self.down(name)


def measure(servers: Servers, server: str, requests: list, clients: int) -> dict:
    load_before = os.getloadavg()
    del _ANSWERS[:]
    got = workload(servers.ports[server], requests, clients)
    got["load_before"] = load_before
    got["load_after"] = os.getloadavg()
    # Each server's own usage count (in order of finishing): mlx_lm's appears to count a stop token, specdec's not.
    got["completion_tokens"] = [a["completion_tokens"] for a in _ANSWERS]
    if server == "specdec":
        got["specdec_counts"] = specdec_counts(list(_ANSWERS))
    return got


def compare(servers: Servers, levels: list[int], count: int, max_tokens: int, alone: bool) -> Optional[dict]:
    """Each level, each server in turn (who goes first alternates); texts held against each other.

    ``alone``: each server is started for its turn and stopped after it, so that the other's idle ranks
    (which poll each other) take no CPU from it. A server that cannot serve is left out from then on and
    the other is measured alone (``mlx_lm.server`` over ranks that do not divide the heads). None: neither
    could serve.
    """
    results: dict = {}
    first_texts: dict = {}
    out_of_it: set = set()
    for n, level in enumerate(levels):
        requests = requests_for(level, count, max_tokens)
        order = SERVERS if n % 2 == 0 else SERVERS[::-1]
        row: dict = {"requests": len(requests), "kinds": [r[0] for r in requests], "order": list(order)}
        for server in order:
            if server in out_of_it:
                continue
            if alone and not servers.up(server, f"x{level}"):
                out_of_it.add(server)
                continue
            got = measure(servers, server, requests, level)
            if alone:
                servers.down(server)
            earlier = first_texts.setdefault(server, got["texts"])
            common = min(len(earlier), len(got["texts"]))
            got["same_as_first_level"] = got["texts"][:common] == earlier[:common]
            row[server] = got
        if len(out_of_it) == len(SERVERS):
            return None
        row["load_avg_1min"] = {s: [row[s]["load_before"][0], row[s]["load_after"][0]] for s in order if s in row}
        results[level] = row
        if "specdec" in row and "mlx_lm" in row:
            row["tok_s_ratio"] = row["specdec"]["tok_s"] / row["mlx_lm"]["tok_s"]
            pairs = list(zip(row["specdec"]["texts"], row["mlx_lm"]["texts"]))
            row["texts_equal"] = sum(a == b for a, b in pairs)
            row["texts_compared"] = len(pairs)
            row["texts_equal_across_servers"] = row["texts_equal"] == len(pairs)
        for name in ("specdec", "mlx_lm"):
            if name not in row:
                continue
            extra = ""
            if name == "specdec":
                counts = row[name]["specdec_counts"]
                extra = (f"; tokens/block {counts['tokens_per_block']}, accepted {counts['draft_n_accepted']}/"
                         f"{counts['draft_n']}")
            print(f"x{level}: {name} {row[name]['tok_s']:.3f} tok/s, wall {row[name]['wall_s']:.0f}s, same as first "
                  f"level {row[name]['same_as_first_level']}{extra}", flush=True)
        if "tok_s_ratio" in row:
            print(f"x{level}: {row['tok_s_ratio']:.2f}x; texts equal {row['texts_equal']}/{row['texts_compared']}; "
                  f"load {row['load_avg_1min']}", flush=True)
    return results


def divisible(ranks: int, folder: Path) -> dict:
    """The model's head counts and whether ``ranks`` divides each (what tensor parallelism needs)."""
    config = json.loads((folder / "config.json").read_text())
    heads = {k: config.get(k) for k in ("num_attention_heads", "num_key_value_heads")}
    return {"heads": heads, "divides": all(v is None or v % ranks == 0 for v in heads.values())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--concurrency", default="1,4,8", help="clients sending the workload at once, per level")
    ap.add_argument("--requests", type=int, default=4,
                    help="requests in the workload at each level (at least as many as clients)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--together", action="store_true",
                    help="keep both servers up for the whole run (bench_serve.py's way) instead of starting each "
                         "for its turn: the idle one's ranks then poll each other on the same cores")
    ap.add_argument("--decode-concurrency", default="8",
                    help="both servers' --decode-concurrency, as bench_serve.py --concurrency gives it, or "
                         "'default': each server's own")
    ap.add_argument("--specdec-args", default="", help="more options for specdec serve, e.g. '--lookup-corpus 0'")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--start-timeout", type=float, default=900, help="seconds a server may take to answer /health")
    ap.add_argument("--stop-timeout", type=float, default=60, help="seconds after SIGINT before SIGKILL")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    args.out = args.out or str(ROOT / "bench-results" / f"serve-distributed-{args.ranks}.json")
    t_run = time.monotonic()

    work = Path(tempfile.mkdtemp(prefix="bench-serve-dist-"))
    model, env, peer_env, library = prepare(work, args.dtype)
    # As specdec's re-exec sets it for ranks sharing this machine's cores (model/blas.py rank_threads).
    threads = str(max(1, (os.cpu_count() or 1) // args.ranks))
    envs = {"mlx_lm": {**peer_env, "OPENBLAS_NUM_THREADS": threads},
            "specdec": {**env, "OPENBLAS_NUM_THREADS": threads}}
    servers = Servers(args, model, envs, work)
    results: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()}",
        "blas": str(library) if library else "bundled reference BLAS", "openblas_num_threads": threads,
        "settings": vars(args), "model": divisible(args.ranks, model),
        "env": {name: {k: e.get(k) for k in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS", "HF_HUB_OFFLINE",
                                             "SPECDEC_PROMPT_CACHE_DISK_GB", "SPECDEC_NO_REEXEC")}
                for name, e in envs.items()}}
    print(f"{args.ranks} ranks; heads {results['model']['heads']} "
          f"{'divide' if results['model']['divides'] else 'do NOT divide'} by {args.ranks}; "
          f"{'both servers up together' if args.together else 'each server up for its turn only'}", flush=True)
    try:
        levels_out = None
        if args.together:
            ok = [servers.up(name, "together") for name in SERVERS]
            if all(ok):
                levels_out = compare(servers, levels, args.requests, args.max_tokens, alone=False)
        else:
            levels_out = compare(servers, levels, args.requests, args.max_tokens, alone=True)
        failed = sorted({s["server"] for s in servers.starts if not s.get("started") or "warmup_error" in s})
        if failed:
            results["skipped"] = (f"not compared: {', '.join(failed)} could not serve the model over {args.ranks} "
                                  f"ranks (see starts)")
            print(results["skipped"], flush=True)
        if levels_out is not None:
            results["levels"] = levels_out
    finally:
        servers.down_all()
        for info in servers.starts:
            info.setdefault("log_trouble", trouble(info["log"]))
            info["log"] = str(info["log"])  # removed below with the model files
        results["starts"] = servers.starts
        results["wall_s"] = time.monotonic() - t_run
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {args.out} ({results['wall_s']:.0f} s)", flush=True)
    if "levels" in results:
        print("\n| clients | requests | specdec tok/s | mlx_lm tok/s | ratio | texts equal | load avg (1 min) |\n"
              "|---|---|---|---|---|---|---|")
        for level, row in results["levels"].items():
            load = "; ".join(f"{s} {a:.1f}->{b:.1f}" for s, (a, b) in row["load_avg_1min"].items())
            tok = {s: f"{row[s]['tok_s']:.3f}" if s in row else "cannot serve" for s in SERVERS}
            ratio = f"{row['tok_s_ratio']:.2f}x" if "tok_s_ratio" in row else "-"
            same = f"{row['texts_equal']}/{row['texts_compared']}" if "texts_equal" in row else "-"
            print(f"| {level} | {row['requests']} | {tok['specdec']} | {tok['mlx_lm']} | {ratio} | {same} | {load} |")


if __name__ == "__main__":
    main()
