#!/usr/bin/env python
"""The prompt cache's disk tier (issue 44): time to first token after a server restart.

Two models, each served by ``specdec serve --decode-concurrency 1`` on this
machine's CPU:

- ``smollm2``: the bundled SmolLM2-135M-Instruct in float32 (``mlx_lm convert
  -d --dtype float32``, as ``bench_serve.py``): attention only (30 layers);
- ``hybrid``: a random-weight Qwen3.5-style model of similar size
  (``synthetic.make_model_dir``: hidden 576, 24 layers, every 4th gated
  attention, the others GatedDeltaNet; byte-level tokenizer, so its answers
  are noise, but the same noise everywhere).

A two-turn chat on a document of ~2,700 tokens (the notice of
``bench_serve.py`` repeated, in the system message): turn 1 = the document +
a question, turn 2 = turn 1 + its answer + a follow-up (~2,900 prompt
tokens). Greedy, 32 tokens. Each repeat (a different conversation: a nonce
opens the document) runs, one after the other:

- warm: a server with the disk tier off (``--prompt-cache-disk-gb 0``) answers
  turn 1, then turn 2: turn 2's TTFT (memory tier hit);
- cold: a server with both tiers off (``--prompt-cache-size 0
  --prompt-cache-disk-gb 0``; an untimed "Hello" first) answers turn 2: the
  whole prefill;
- restart: a server on a fresh ``--prompt-cache-dir`` answers turn 1 and is
  stopped (SIGTERM flushes its writer); a new server on the same folder answers
  an untimed tiny request (process warm-up; nothing of the conversation in
  memory), then turn 2: its TTFT, ``usage.prompt_tokens_details.disk_tokens``
  and ``cached_tokens``. The folder's ``*.safetensors`` bytes after turn 1,
  after the warm-up and after turn 2 (the second server stopped) give the
  bytes turn 2 wrote, per new token (turn 2's prompt + answer less turn 1's),
  against the model's attention KV per token (attention layers x 2 x kv heads
  x head dim x 4 bytes).

Turn 2's text must be the same in the three (``texts_identical``), and turn
1's the same from the two servers that answer it. TTFTs are the client's
(streamed); ratios are of medians over the repeats.

Then, once per model (``--client-repeats``), 4 clients at once send the same
document as system prompt with 4 other questions: to a server restarted on the
last repeat's folder (it holds that conversation's two turns: the same system
prompt with another question) after an untimed warm-up, and to the cold
server (both tiers off). Mean TTFT of each, and each client's disk and cached
tokens.

Results (TTFT lists, medians, ratios, bytes, flags, the load average sampled
through the run, odd lines of the servers' logs) go to
``bench-results/prompt-disk.json``.

Usage: python scripts/bench_prompt_disk.py [--repeats 3] [--client-repeats 1] [--models smollm2,hybrid]
           [--clients 4] [--tokens 2800] [--out bench-results/prompt-disk.json] [--keep]
On 2 CPU cores a repeat takes ~3 min per model and the clients part ~4 (smollm2) and ~3 min (hybrid): the
cold prefills (~40 s each) dominate; ``--repeats 2`` took 19 min. ``--tokens 600 --repeats 1`` checks the
script in ~3 min.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_serve  # noqa: E402
from bench_serve import NOTICE, free_port, start, stop  # noqa: E402

from specdec_cli.model import bundled  # noqa: E402
from specdec_cli.session.synthetic import TINY_CONFIGS  # noqa: E402

TARGET_TOKENS = 2800  # turn 1's prompt (--tokens)
MAX_TOKENS = 32
QUESTION = "What is being repaired, and when does the work start?"
FOLLOW_UP = "Where should residents park their cars while the work goes on?"
CLIENT_QUESTIONS = ["How long will the work take?", "Which part of the street is closed to cars?",
                    "What should residents do the night before the work starts?",
                    "Whom should residents call if they have questions?"]
WARMUP = [{"role": "user", "content": "Hi! Say one word."}]

HYBRID = copy.deepcopy(TINY_CONFIGS["qwen3_5"])
HYBRID["text_config"].update(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=24, full_attention_interval=4,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, linear_num_value_heads=8, linear_num_key_heads=4,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
    rope_parameters={"type": "default", "mrope_section": [3, 3, 2], "rope_theta": 10000.0,
                     "partial_rotary_factor": 0.25})

LOADS: list[float] = []


def log(msg: str) -> None:
    LOADS.append(os.getloadavg()[0])
    print(f"[{time.strftime('%H:%M:%S')} load {LOADS[-1]:.2f}] {msg}", flush=True)


def ask(port: int, messages: list[dict], max_tokens: int = MAX_TOKENS) -> dict:
    """One streamed greedy chat request (``bench_serve.ask``), with the server's own prompt time."""
    out = bench_serve.ask(port, messages, max_tokens)
    return {**out, "server_prompt_ms": (out["timings"] or {}).get("prompt_ms")}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.safetensors"))


def settle(folder: Path, quiet_s: float = 1.5, limit_s: float = 120) -> int:
    """The folder's bytes once they stop changing (the background writer is done)."""
    last, since, deadline = -1, time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() < deadline:
        now = folder_bytes(folder)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
        time.sleep(0.25)
    return last


def kv_bytes_per_token(config: dict) -> int:
    """Attention layers x 2 x kv heads x head dim x 4 bytes (float32)."""
    c = config.get("text_config", config)
    layers = c["num_hidden_layers"]
    if "full_attention_interval" in c:
        layers = sum((i + 1) % c["full_attention_interval"] == 0 for i in range(layers))
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return layers * 2 * c["num_key_value_heads"] * head_dim * 4


def make_models(work: Path, names: list[str], env: dict) -> dict[str, Path]:
    out = {}
    if "smollm2" in names:
        out["smollm2"] = work / "smollm2-f32"
        subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(bundled.model_dir()), "-d",
                        "--dtype", "float32", "--mlx-path", str(out["smollm2"])], check=True, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if "hybrid" in names:
        from specdec_cli.session.synthetic import make_model_dir

        out["hybrid"] = make_model_dir(work / "hybrid", HYBRID)
    return out


class Conversation:
    """The document sized to ``TARGET_TOKENS`` for one tokenizer; a nonce per repeat opens it."""

    def __init__(self, model_dir: Path, target: int = TARGET_TOKENS):
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # the search below encodes texts longer than the byte tokenizer's 4096

        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        words = " ".join([NOTICE] * 40).split()
        lo, hi = 1, len(words)
        while lo < hi:  # the fewest words that reach the target
            mid = (lo + hi) // 2
            self.words = words[:mid]
            if self.count(self.turn1(0)) >= target:
                hi = mid
            else:
                lo = mid + 1
        self.words = words[:lo]

    def count(self, messages: list[dict]) -> int:
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return len(self.tok.encode(text, add_special_tokens=False))

    def system(self, nonce: int) -> dict:
        return {"role": "system", "content": f"Conversation {nonce}. Answer questions about this notice.\n\n"
                                             + " ".join(self.words)}

    def turn1(self, nonce: int) -> list[dict]:
        return [self.system(nonce), {"role": "user", "content": QUESTION}]

    def turn2(self, nonce: int, answer: str) -> list[dict]:
        return [*self.turn1(nonce), {"role": "assistant", "content": answer},
                {"role": "user", "content": FOLLOW_UP}]

    def client(self, nonce: int, question: str) -> list[dict]:
        return [self.system(nonce), {"role": "user", "content": question}]


class Servers:
    """Starts ``specdec serve`` processes for one model; each gets its own log."""

    def __init__(self, model: Path, work: Path, env: dict, name: str):
        self.model, self.work, self.env, self.name, self.n = model, work, env, name, 0
        self.logs: list[Path] = []

    def start(self, *extra: str) -> tuple[subprocess.Popen, int]:
        port = free_port()
        self.n += 1
        path = self.work / f"{self.name}-{self.n}.log"
        self.logs.append(path)
        proc = start([sys.executable, "-m", "specdec_cli", "serve", "--model", str(self.model), "--port", str(port),
                      "--decode-concurrency", "1", *extra], port, self.env, path)
        return proc, port

    def odd_lines(self) -> list[str]:
        words = ("warn", "error", "traceback", "exception", "damaged", "fail", "removed")
        out = []
        for path in self.logs:
            for line in path.read_text(errors="replace").splitlines():
                if any(w in line.lower() for w in words):
                    out.append(f"{path.name}: {line}")
        return out


def at_once(port: int, prompts: list[list[dict]]) -> list[dict]:
    """Send ``prompts`` from as many clients at once."""
    answers: list = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def client(i: int) -> None:
        barrier.wait()
        answers[i] = ask(port, prompts[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def bench_model(name: str, model: Path, work: Path, env: dict, args) -> dict:
    conv = Conversation(model, args.tokens)
    servers = Servers(model, work, env, name)
    config = json.loads((model / "config.json").read_text())
    res: dict = {"model": str(model), "kv_bytes_per_token_f32": kv_bytes_per_token(config),
                 "turn1_prompt_tokens": conv.count(conv.turn1(0)),
                 "cold_ttft_s": [], "warm_ttft_s": [], "restart_ttft_s": [],
                 "restart_disk_tokens": [], "restart_cached_tokens": [], "warm_cached_tokens": [],
                 "turn2_prompt_tokens": [], "bytes": [], "texts_identical": [], "turn1_identical": [],
                 "restart_server_prompt_ms": [], "cold_server_prompt_ms": [], "warm_server_prompt_ms": [],
                 "restart_timings": []}
    if name == "hybrid":
        res["config"] = HYBRID
    log(f"{name}: turn 1 prompt {res['turn1_prompt_tokens']} tokens; starting the warm and cold servers")
    warm, warm_port = servers.start("--prompt-cache-disk-gb", "0")
    cold, cold_port = servers.start("--prompt-cache-size", "0", "--prompt-cache-disk-gb", "0")
    ask(warm_port, WARMUP, 8)
    ask(cold_port, WARMUP, 8)
    folder = None
    try:
        for r in range(args.repeats):
            nonce = 1000 * (r + 1) + len(name)
            # warm: turn 1 then turn 2 on the same server (memory tier).
            t1 = ask(warm_port, conv.turn1(nonce))
            turn2 = conv.turn2(nonce, t1["text"])
            w2 = ask(warm_port, turn2)
            log(f"{name} #{r + 1} warm: turn 2 TTFT {w2['ttft_s']:.2f} s ({w2['cached_tokens']} of "
                f"{w2['prompt_tokens']} cached)")
            # cold: turn 2 alone, both tiers off.
            c2 = ask(cold_port, turn2)
            log(f"{name} #{r + 1} cold: turn 2 TTFT {c2['ttft_s']:.2f} s")
            # restart: turn 1 on a fresh folder, SIGTERM, a new server on the folder, warm-up, turn 2.
            folder = work / f"{name}-disk-{r + 1}"
            a, a_port = servers.start("--prompt-cache-dir", str(folder))
            a1 = ask(a_port, conv.turn1(nonce))
            stop(a)
            after1 = folder_bytes(folder)
            b, b_port = servers.start("--prompt-cache-dir", str(folder))
            wu = ask(b_port, WARMUP, 8)
            after_warmup = settle(folder)
            r2 = ask(b_port, turn2)
            stop(b)
            after2 = folder_bytes(folder)
            log(f"{name} #{r + 1} restart: turn 2 TTFT {r2['ttft_s']:.2f} s ({r2['disk_tokens']} from disk, "
                f"{r2['cached_tokens']} cached, of {r2['prompt_tokens']}); warm-up TTFT {wu['ttft_s']:.2f} s")
            new_tokens = (r2["prompt_tokens"] + r2["completion_tokens"]) - (a1["prompt_tokens"] + a1["completion_tokens"])
            written = after2 - after_warmup
            res["bytes"].append({
                "after_turn1": after1, "after_warmup": after_warmup, "after_turn2": after2,
                "turn1_tokens": a1["prompt_tokens"] + a1["completion_tokens"],
                "turn1_bytes_per_token": after1 / (a1["prompt_tokens"] + a1["completion_tokens"]),
                "warmup_written": after_warmup - after1, "turn2_written": written,
                "turn2_new_tokens": new_tokens, "turn2_bytes_per_new_token": written / new_tokens if new_tokens else None,
                "files": len(list(folder.rglob("*.safetensors")))})
            res["cold_ttft_s"].append(c2["ttft_s"])
            res["warm_ttft_s"].append(w2["ttft_s"])
            res["restart_ttft_s"].append(r2["ttft_s"])
            res["restart_disk_tokens"].append(r2["disk_tokens"])
            res["restart_cached_tokens"].append(r2["cached_tokens"])
            res["warm_cached_tokens"].append(w2["cached_tokens"])
            res["turn2_prompt_tokens"].append(r2["prompt_tokens"])
            res["restart_server_prompt_ms"].append(r2["server_prompt_ms"])
            res["cold_server_prompt_ms"].append(c2["server_prompt_ms"])
            res["warm_server_prompt_ms"].append(w2["server_prompt_ms"])
            res["texts_identical"].append(c2["text"] == w2["text"] == r2["text"])
            res["turn1_identical"].append(t1["text"] == a1["text"])
            if not res["texts_identical"][-1]:
                res.setdefault("texts_differing", []).append({"cold": c2["text"], "warm": w2["text"],
                                                              "restart": r2["text"]})

        # Several clients sharing the system prompt: restarted on the last folder, then the cold server.
        res["clients"] = []
        for k in range(args.client_repeats if folder is not None else 0):
            prompts = [conv.client(nonce, q) for q in CLIENT_QUESTIONS[: args.clients]]
            b, b_port = servers.start("--prompt-cache-dir", str(folder))
            ask(b_port, WARMUP, 8)
            settle(folder)
            restarted = at_once(b_port, prompts)
            stop(b)
            cold_answers = at_once(cold_port, prompts)
            row = {"restart_ttft_s": [a["ttft_s"] for a in restarted],
                   "restart_disk_tokens": [a["disk_tokens"] for a in restarted],
                   "restart_cached_tokens": [a["cached_tokens"] for a in restarted],
                   "prompt_tokens": [a["prompt_tokens"] for a in restarted],
                   "cold_ttft_s": [a["ttft_s"] for a in cold_answers],
                   "texts_identical": [a["text"] == c["text"] for a, c in zip(restarted, cold_answers)]}
            row["restart_mean_ttft_s"] = statistics.mean(row["restart_ttft_s"])
            row["cold_mean_ttft_s"] = statistics.mean(row["cold_ttft_s"])
            row["ratio"] = row["restart_mean_ttft_s"] / row["cold_mean_ttft_s"]
            res["clients"].append(row)
            log(f"{name} {args.clients} clients #{k + 1}: mean TTFT restart {row['restart_mean_ttft_s']:.2f} s "
                f"(disk {row['restart_disk_tokens']}, cached {row['restart_cached_tokens']}), cold "
                f"{row['cold_mean_ttft_s']:.2f} s")
    finally:
        stop(warm)
        stop(cold)
    med_cold, med_warm, med_restart = med(res["cold_ttft_s"]), med(res["warm_ttft_s"]), med(res["restart_ttft_s"])
    res["medians"] = {"cold_ttft_s": med_cold, "warm_ttft_s": med_warm, "restart_ttft_s": med_restart}
    res["ratios"] = {"restart_over_cold": ratio(med_restart, med_cold),
                     "restart_over_warm": ratio(med_restart, med_warm),
                     "warm_over_cold": ratio(med_warm, med_cold)}
    res["all_texts_identical"] = all(res["texts_identical"]) and all(res["turn1_identical"])
    res["logs"] = [str(p) for p in servers.logs]
    res["log_odd_lines"] = servers.odd_lines()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--client-repeats", type=int, default=1, help="Repeats of the several-clients part (0: skip)")
    ap.add_argument("--clients", type=int, default=4, choices=range(1, len(CLIENT_QUESTIONS) + 1))
    ap.add_argument("--models", default="smollm2,hybrid")
    ap.add_argument("--tokens", type=int, default=TARGET_TOKENS, help="Turn 1's prompt tokens (a quick check: 600)")
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "prompt-disk.json"))
    ap.add_argument("--keep", action="store_true", help="Keep the work folder (models, disk folders, logs)")
    args = ap.parse_args()
    names = args.models.split(",")

    t0 = time.monotonic()
    LOADS.append(os.getloadavg()[0])
    load_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-prompt-disk-"))
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "SPECDEC_PROMPT_CACHE_DIR",
                                                            "SPECDEC_PROMPT_CACHE_DISK_GB")}
    env["HF_HUB_OFFLINE"] = "1"
    import mlx.core as mx
    import mlx_lm

    results: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
                     "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "repeats": args.repeats,
                     "client_repeats": args.client_repeats, "clients": args.clients,
                     "max_tokens": MAX_TOKENS, "turn1_target_tokens": args.tokens, "work": str(work), "models": {}}
    log(f"work folder {work}")
    models = make_models(work, names, env)
    try:
        for name in names:
            results["models"][name] = bench_model(name, models[name], work, env, args)
    finally:
        results["elapsed_s"] = time.monotonic() - t0
        results["load_average"] = {"start": load_start, "end": os.getloadavg(),
                                   "samples_1min": LOADS, "mean_1min": statistics.mean(LOADS),
                                   "max_1min": max(LOADS)}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")
        if not args.keep:
            for p in work.iterdir():  # the models and disk folders are big; the logs stay
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)

    print(f"\n{'model':8} {'cold':>7} {'warm':>7} {'restart':>8} {'rst/cold':>9} {'rst/warm':>9} {'disk tok':>9} "
          f"{'t2 bytes':>10} {'B/new tok':>10} {'KV B/tok':>9} {'same':>5}")
    for name, m in results["models"].items():
        md, ra, b = m["medians"], m["ratios"], m["bytes"]
        fmt = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
        print(f"{name:8} {fmt(md['cold_ttft_s']):>7} {fmt(md['warm_ttft_s']):>7} {fmt(md['restart_ttft_s']):>8} "
              f"{fmt(ra['restart_over_cold'], 3):>9} {fmt(ra['restart_over_warm'], 2):>9} "
              f"{str(med(m['restart_disk_tokens'])):>9} {str(med([x['turn2_written'] for x in b])):>10} "
              f"{fmt(med([x['turn2_bytes_per_new_token'] for x in b]), 0):>10} {m['kv_bytes_per_token_f32']:>9} "
              f"{str(m['all_texts_identical']):>5}")
        for row in m.get("clients", []):
            print(f"{'':8} {args.clients} clients: mean TTFT restart {row['restart_mean_ttft_s']:.2f} s, cold "
                  f"{row['cold_mean_ttft_s']:.2f} s, ratio {row['ratio']:.3f}; disk {row['restart_disk_tokens']}")
    print(f"\n{results['elapsed_s'] / 60:.1f} min, load average mean {results['load_average']['mean_1min']:.2f} "
          f"(max {results['load_average']['max_1min']:.2f}); wrote {args.out}; logs in {work}")


if __name__ == "__main__":
    main()
