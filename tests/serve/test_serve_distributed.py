"""``specdec serve`` sharded over ranks (MLX's ring backend, as ``mlx.launch`` sets it up), and its faults.

Each sharded server is started rank by rank here (``tests/server.py``'s ``ranks``), so that one rank can be
killed; the last test starts one through ``mlx.launch`` itself, as README says. Its answers are held to a
one-process server's on the same model: several clients at once through the openai and anthropic clients
over a real socket. Timeouts are hang guards only.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from specdec_cli.session.synthetic import TINY_CONFIGS, dflash_config, make_model_dir, save_dflash_dir

from helpers import tied_qwen35
from mtp_fixtures import fitted_head, hf_checkpoint
from server import READY, Server, env, free_ports, launch_bin

HANG_GUARD_S = 300
PROMPTS = ["The quick brown fox jumps over the lazy dog, twice: the quick brown fox.", "abc abc abc abc abc",
           "Hello there, how are you", "one two three four five six seven eight"]
N = 32


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("sharded-serve")
    return {"llama": make_model_dir(tmp / "llama", "llama"),
            "llama-draft": make_model_dir(tmp / "llama-draft", "llama", noise=0.05),
            "qwen35": make_model_dir(tmp / "qwen35", tied_qwen35()),
            "qwen35-draft": make_model_dir(tmp / "qwen35-draft", tied_qwen35(), noise=0.3),
            # The same family with an MTP head (fitted to its own text), and a DFlash drafter for it.
            "qwen35-mtp": hf_checkpoint(tmp / "qwen35-mtp", "qwen3_5_tied", fitted_head("qwen3_5_tied")),
            "qwen35-dflash": save_dflash_dir(tmp / "qwen35-dflash", dflash_config(
                tied_qwen35(), layers=2, block_size=6, layer_types=["sliding_attention", "full_attention"],
                sliding_window=8), seed=3),
            # Six heads over three KV heads: shards over 3 ranks evenly, over 2 by whole KV heads (2 and 1).
            "llama6": make_model_dir(tmp / "llama6", {**TINY_CONFIGS["llama"], "hidden_size": 48,
                                                      "num_attention_heads": 6, "num_key_value_heads": 3,
                                                      "intermediate_size": 96})}


def _args(models: dict, name: str) -> list[str]:
    """Each served configuration: a family, a drafter kind, a way to shard."""
    return {"llama_lookup": ["--model", models["llama"]],
            "llama_draft": ["--model", models["llama"], "--draft-model", models["llama-draft"]],
            "qwen35_draft": ["--model", models["qwen35"], "--draft-model", models["qwen35-draft"]],
            "qwen35_pipeline_ngram": ["--model", models["qwen35"], "--drafter", "ngram", "--pipeline"],
            "qwen35_mtp": ["--model", models["qwen35-mtp"], "--drafter", "mtp"],
            "qwen35_dflash": ["--model", models["qwen35"], "--draft-model", models["qwen35-dflash"]],
            # 3 KV heads over 2 ranks (the bundled model's case): split unevenly by whole KV heads.
            "llama6_uneven": ["--model", models["llama6"]],
            }[name]


def _answers(url: str) -> list[str]:
    """Nine requests at once (chat and text completions, one streamed, anthropic messages), greedy."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)

    def chat(prompt: str, stream: bool = False) -> str:
        body = {"model": "default_model", "max_tokens": N, "temperature": 0,
                "messages": [{"role": "user", "content": prompt}]}
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                stream=True, **body) if c.choices)
        return client.chat.completions.create(**body).choices[0].message.content

    def text(prompt: str) -> str:
        return client.completions.create(model="default_model", prompt=prompt, max_tokens=N,
                                         temperature=0).choices[0].text

    def message(prompt: str) -> str:
        out = claude.messages.create(model="default_model", max_tokens=N,
                                     messages=[{"role": "user", "content": prompt}])
        return "".join(b.text for b in out.content if b.type == "text")

    # The last prompt's pass is larger than one collective carries whole (Ranks.broadcast's second).
    asks = [lambda p=p: text(p) for p in PROMPTS] + [lambda: chat(PROMPTS[0]), lambda: chat(PROMPTS[1], True),
                                                     lambda: message(PROMPTS[2]), lambda: message(PROMPTS[3]),
                                                     lambda: text(" ".join(PROMPTS * 6))]
    with ThreadPoolExecutor(len(asks)) as pool:
        return list(pool.map(lambda ask: ask(), asks))


@pytest.fixture(scope="module")
def sharded(models):
    """The dense lookup configuration sharded over 2 ranks (the fault tests' server)."""
    server = Server(*_args(models, "llama_lookup"), "--decode-concurrency", "4", ranks=2)
    yield server
    server.stop()


@pytest.mark.parametrize("name", ["llama_lookup", "llama_draft", "qwen35_draft", "qwen35_pipeline_ngram",
                                  "qwen35_mtp", "qwen35_dflash", "llama6_uneven"])
def test_served_answers_equal_a_one_process_servers(models, sharded, name):
    args = [*_args(models, name), "--decode-concurrency", "4"]
    alone = Server(*[a for a in args if a != "--pipeline"])
    try:
        expected = _answers(alone.url)
        expected_again = _answers(alone.url)  # the second burst resumes from the prompt cache
    finally:
        alone.stop()
    server = sharded if name == "llama_lookup" else Server(*args, ranks=2)
    try:
        assert _answers(server.url) == expected
        assert _answers(server.url) == expected_again
        mode = "pipeline" if "pipeline" in name else "tensor"
        assert any(f"Distributed: 2 ranks, {mode} parallel, MLX ring backend" in line for line in server.lines)
        health = httpx.get(f"{server.url}/health", timeout=30).json()
        assert health["distributed"] == {"ranks": 2, "mode": mode, "backend": "ring"}
        assert "up to 4 requests decoded together" in server.log
        # The drafter drafted on the sharded target (llama.cpp's timings names).
        timings = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "prompt": PROMPTS[0], "max_tokens": N, "temperature": 0}).json()["timings"]
        assert timings["draft_n"] > 0, timings
        assert timings["drafter"].split(" (")[0] == {"llama_lookup": "lookup", "llama_draft": "model", "qwen35_draft": "model",
                                      "qwen35_pipeline_ngram": "ngram", "qwen35_mtp": "mtp",
                                      "qwen35_dflash": "dflash", "llama6_uneven": "lookup"}[name], timings
    finally:
        if server is not sharded:
            assert server.stop(signal.SIGINT) == 0, server.log
            assert [p.returncode for p in server.others] == [0], server.other_lines


def test_a_client_that_goes_away_mid_stream_leaves_the_ranks_serving(models, sharded):
    with httpx.stream("POST", f"{sharded.url}/v1/completions", timeout=120,
                      json={"prompt": PROMPTS[2], "max_tokens": 2000, "stream": True, "ignore_eos": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break  # the connection closes with the stream mid-way
    deadline = time.monotonic() + HANG_GUARD_S
    while "cancelled after" not in sharded.log and time.monotonic() < deadline:
        time.sleep(0.1)
    assert re.search(r"cancelled after (\d+) tokens", sharded.log), sharded.log
    # Every rank dropped the row alike: the next burst is answered, as a fresh one-process server answers it.
    alone = Server(*_args(models, "llama_lookup"), "--decode-concurrency", "4")
    try:
        alone.post("/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 5}).raise_for_status()
        text = sharded.client().completions.create(model="default_model", prompt=PROMPTS[3], max_tokens=N,
                                                   temperature=0).choices[0].text
        assert text == alone.client().completions.create(model="default_model", prompt=PROMPTS[3], max_tokens=N,
                                                         temperature=0).choices[0].text
    finally:
        alone.stop()


def test_each_rank_keeps_its_shard_on_disk_and_a_restarted_server_resumes_from_it(models, sharded, tmp_path):
    folder = tmp_path / "prompt-cache"
    body = {"prompt": PROMPTS[0] * 3, "max_tokens": N, "temperature": 0}
    expected = sharded.post("/v1/completions", body).json()["choices"][0]["text"]
    for run in range(2):
        server = Server(*_args(models, "llama_lookup"), "--prompt-cache-dir", folder, "--prompt-cache-disk-gb", "1",
                        ranks=2)
        try:
            out = server.post("/v1/completions", body).json()
        finally:
            assert server.stop(signal.SIGINT) == 0, server.log
            assert [p.returncode for p in server.others] == [0], server.other_lines
        assert out["choices"][0]["text"] == expected
        disk = out["usage"]["prompt_tokens_details"]["disk_tokens"]
        assert (disk > 0) == (run == 1), out["usage"]
    # One key folder per rank: each holds its own shard's files and the same lookup corpus.
    keys = [d for d in folder.iterdir() if d.is_dir()]
    assert len(keys) == 2
    corpora = [json.loads((d / "lookup-corpus.json").read_text()) for d in keys]
    assert corpora[0] == corpora[1] and corpora[0]["outputs"]


def test_what_a_sharded_server_cannot_do_is_a_400(sharded):
    r = sharded.post("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "compare_alone": True})
    assert r.status_code == 400
    assert "compare_alone is not built for a server sharded under mlx.launch" in r.json()["error"]["message"]
    # A prompt over the context is refused on rank 0 before it is queued: the ranks never see it, serve on.
    with pytest.raises(openai.BadRequestError) as e:
        sharded.client().chat.completions.create(model="default_model", max_tokens=3,
                                                 messages=[{"role": "user", "content": "x" * 5000}])
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "messages"
    assert sharded.client().completions.create(model="default_model", prompt=PROMPTS[1], max_tokens=4,
                                               temperature=0).choices[0].text


def test_a_disk_tier_one_rank_could_not_open_is_off_on_every_rank(models, tmp_path):
    # Rank 1's cache folder cannot be made (a path only one machine has): the ranks used to look up different
    # tiers, part ways in their collectives and hang on the first request until the watchdog ended them.
    shared = {"SPECDEC_PROMPT_CACHE_DIR": None, "SPECDEC_PROMPT_CACHE_DISK_GB": "1",
              "SPECDEC_DISTRIBUTED_TIMEOUT": "30"}
    server = Server(*_args(models, "llama_lookup"), "--decode-concurrency", "1", ranks=2, extra_env=shared,
                    rank_env={0: {"XDG_CACHE_HOME": str(tmp_path)}, 1: {"XDG_CACHE_HOME": "/proc/no-such-folder"}})
    try:
        body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
        first = server.post("/v1/completions", body)
        assert first.status_code == 200, first.text
        again = server.post("/v1/completions", body)  # resumed from memory on both ranks alike
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        assert "the disk prompt cache is off on every rank: rank 1 could not open its folder" in server.log
    finally:
        server.stop()
    assert not any(p.poll() not in (0, None) for p in server.others), server.other_lines


def test_a_killed_rank_ends_the_server_with_one_line_and_no_hung_process(models):
    server = Server(*_args(models, "llama_lookup"), "--decode-concurrency", "4", ranks=2,
                    extra_env={"SPECDEC_DISTRIBUTED_TIMEOUT": "5"})
    try:
        got: list = []

        def stream() -> None:
            try:
                with httpx.stream("POST", f"{server.url}/v1/completions", timeout=HANG_GUARD_S,
                                  json={"prompt": PROMPTS[0], "max_tokens": 100000, "stream": True,
                                        "ignore_eos": True}) as r:
                    for line in r.iter_lines():
                        got.append(line)
            except httpx.HTTPError as e:
                got.append(repr(e))

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        deadline = time.monotonic() + HANG_GUARD_S
        while len(got) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        server.others[0].kill()  # mid-request
        code = server.proc.wait(HANG_GUARD_S)
        reader.join(HANG_GUARD_S)
    finally:
        server.stop()
    assert code == 1, server.log
    errors = [line for line in server.lines if line.startswith("error")]
    assert len(errors) == 1, server.log
    assert ("lost its connection to the other ranks" in errors[0]
            or "no answer from the other ranks for 5 s" in errors[0]), errors
    # The client's stream did not end as an answer: an error frame (then [DONE], as in one process), or cut.
    errored = any(line.startswith("data: {") and '"error": {' in line for line in got)
    assert got and (errored or not any("[DONE]" in line for line in got)), got[-3:]
    assert not any('"finish_reason": "length"' in line for line in got), got[-3:]


def _group_alive(group: int) -> list[int]:
    """The processes still in process group ``group`` (read from /proc)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def test_the_readme_command_serves_three_ranks_under_mlx_launch_and_ctrl_c_ends_them_all(models, tmp_path):
    args = ["--model", str(models["llama6"]), "--decode-concurrency", "4"]
    alone = Server(*args)
    try:
        expected = _answers(alone.url)
    finally:
        alone.stop()
    # A session of its own, as a terminal's foreground job: Ctrl-C there reaches the launcher and every rank.
    proc = subprocess.Popen([launch_bin(), "--backend", "ring", "-n", "3", "--starting-port", str(free_ports(3)[0]), "--",
                             sys.executable, "-m", "specdec_cli", "serve", "--port", "0", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env(), cwd=tmp_path,
                            start_new_session=True, stdin=subprocess.PIPE)  # on /dev/null its copy loop spins
    lines: list[str] = []
    try:
        found = None
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            found = READY.search(line)
            if found:
                break
        assert found, "\n".join(lines)
        assert _answers(found.group(1)) == expected
        assert any("Distributed: 3 ranks, tensor parallel" in line for line in lines)
        assert len(_group_alive(proc.pid)) >= 4  # the launcher and its three ranks
        os.killpg(proc.pid, signal.SIGINT)
        deadline = time.monotonic() + HANG_GUARD_S
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _group_alive(proc.pid), "a rank outlived Ctrl-C"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # a hang guard: nothing may outlive the test
        except ProcessLookupError:
            pass
        proc.wait()


def test_ranks_whose_launcher_is_terminated_stop_serving(models, tmp_path):
    # SIGTERM to mlx.launch alone (a supervisor, kill, timeout) ended the launcher only: its ranks went on
    # serving, orphaned, on the port.
    proc = subprocess.Popen([launch_bin(), "--backend", "ring", "-n", "2", "--starting-port", str(free_ports(2)[0]),
                             "--", sys.executable, "-m", "specdec_cli", "serve", "--port", "0",
                             "--model", str(models["llama"]), "--decode-concurrency", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env(), cwd=tmp_path,
                            start_new_session=True, stdin=subprocess.PIPE)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            if READY.search(line):
                break
        assert READY.search(lines[-1]), "\n".join(lines)
        assert len(_group_alive(proc.pid)) == 3  # the launcher and its two ranks
        proc.terminate()
        proc.wait(HANG_GUARD_S)
        deadline = time.monotonic() + HANG_GUARD_S  # a hang guard, not a timing
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _group_alive(proc.pid), "a rank outlived its launcher"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
