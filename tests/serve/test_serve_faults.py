"""``specdec serve`` under faults (issue 33): a bad request cannot change another's answer, a client that
goes away stops its work wherever it is, a huge body costs little, slow connections are closed.

Real server processes on a free port, spoken to over real sockets.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest

from server import Server
from specdec_cli.session.synthetic import TINY_CONFIGS, VOCAB_SIZE, make_model_dir

# Every forward of the server's caches sleeps this long (a test-only sitecustomize, as tests/cli/test_interrupts.py
# slows its Ctrl-C children): a 100,000-token prefill in chunks of at most 2,048 tokens then lasts at
# least 49 x 3 s, whatever the machine's speed, so it is still running when the test drops its client.
SLOW_FORWARD_S = 3.0
SLOW_SITECUSTOMIZE = f"""
import importlib.abc, importlib.util, sys, time


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "specdec_cli.cache.caches":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            forward = module.ModelCache._forward

            def slow_forward(self, tokens, mode):
                out = forward(self, tokens, mode)
                time.sleep({SLOW_FORWARD_S})
                return out

            module.ModelCache._forward = slow_forward

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Patch())
"""
# Plain decoding past EOS on a tiny long-context model: no machine finishes it before a test has looked.
ENDLESS = {"max_tokens": 50_000, "num_draft_tokens": 0, "ignore_eos": True}
# A hang guard only: how long a freed server may take to say so.
FREED_S = 60


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    return {"llama": make_model_dir(root / "llama", "llama", seed=0),
            "long": make_model_dir(root / "long", {**TINY_CONFIGS["llama"], "max_position_embeddings": 1 << 17})}


@pytest.fixture(scope="module")
def server(dirs):
    s = Server("--model", dirs["long"])
    yield s
    s.stop()


def chat(server: Server, **body) -> dict:
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}],
                                             "max_tokens": 12, **body})
    assert r.status_code == 200, r.text
    return r.json()


def text(server: Server, **body) -> str:
    return chat(server, **body)["choices"][0]["message"]["content"]


def health(server: Server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=30).json()


def until(condition, what: str, timeout: float = FREED_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def raw_request(server: Server, body: dict) -> socket.socket:
    """A non-streamed chat request sent over a socket the test closes when it likes (a client going away)."""
    url = urlparse(server.url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def logged(server: Server, phrase: str) -> int:
    return sum(phrase in line for line in server.lines)


# --- 1. one request cannot break sampling for the others -----------------------------------------

def test_a_top_k_at_or_over_the_vocabulary_keeps_every_token_and_breaks_nothing(server):
    seeded = text(server, temperature=0.7, seed=5)
    for top_k in (VOCAB_SIZE, 10**12):
        # At or over the vocabulary size, top-k keeps every token: the same draws as no top-k.
        assert text(server, temperature=0.7, seed=5, top_k=top_k) == seeded
        chat(server, temperature=0.7, top_k=top_k)  # unseeded: drawn from the process's random state
    # The next requests are answered as before: seeded ones with the same text, unseeded ones at all.
    assert text(server, temperature=0.7, seed=5) == seeded
    chat(server, temperature=0.7)
    chat(server, temperature=0.7, top_k=3)


# --- 2. a non-streamed request whose client went away stops -----------------------------------------

def test_a_dropped_non_streamed_request_stops_while_it_decodes(server):
    before = logged(server, "cancelled after")
    sock = raw_request(server, {"messages": [{"role": "user", "content": "Go"}], **ENDLESS})
    until(lambda: health(server)["busy"], "the request never started")
    time.sleep(0.5)
    sock.close()
    until(lambda: not health(server)["busy"], "the generation ran on after its client left")
    until(lambda: logged(server, "cancelled after") > before, "no cancel was logged")
    line = [x for x in server.lines if "cancelled after" in x][-1]
    assert int(line.split("cancelled after ")[1].split()[0]) < ENDLESS["max_tokens"]


def test_a_dropped_request_stops_during_its_prefill_and_one_dropped_in_the_queue_never_runs(dirs, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SLOW_SITECUSTOMIZE)
    from server import python_path
    # One request decodes at a time, so the second one waits in the queue.
    slow = Server("--model", dirs["long"], "--decode-concurrency", "1",
                  extra_env={"PYTHONPATH": python_path(tmp_path)})
    try:
        long_prompt = {"messages": [{"role": "user", "content": "w" * 100_000}], "max_tokens": 5}
        first = raw_request(slow, long_prompt)
        until(lambda: health(slow)["busy"], "the request never started")
        queued = raw_request(slow, {"messages": [{"role": "user", "content": "Go"}], "max_tokens": 5})
        until(lambda: health(slow)["waiting"] == 1, "the second request never queued")
        queued.close()
        time.sleep(0.5)
        first.close()
        until(lambda: logged(slow, "request cancelled during prefill"), "the prefill ran on after its client left")
        until(lambda: logged(slow, "skipped a queued request whose client went away"),
              "the queued request whose client left was run")
        until(lambda: not health(slow)["busy"], "the server stayed busy")
        assert not logged(slow, "generated at"), slow.log  # neither request was answered
    finally:
        slow.stop()


# --- 4. a huge body is refused before it is tokenized, and its memory comes back -------------------

def rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) // 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the server's memory from /proc")
def test_a_prompt_of_millions_of_characters_is_refused_without_tokenizing_it(server):
    chat(server)  # the first request's allocations come before the baseline
    before = rss_mib(server.proc.pid)
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello world " * 2_600_000}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "31200000 characters" in error["message"] and "context is 131072 tokens" in error["message"]
    # Tokenizing 31 million characters held ~2 GB for good; reading the body holds a few of its sizes for a moment.
    assert rss_mib(server.proc.pid) - before < 300
    assert text(server)  # and the server serves on


# --- 8. shutting down: queued requests get a 503 with Retry-After -----------------------------------

def test_requests_queued_at_shutdown_get_a_503_with_retry_after(dirs):
    s = Server("--model", dirs["long"], "--decode-concurrency", "1")
    try:
        running = raw_request(s, {"messages": [{"role": "user", "content": "Go"}], **ENDLESS})
        until(lambda: health(s)["busy"], "the request never started")
        with httpx.Client(timeout=120) as http:
            import threading

            answers = []
            queued = threading.Thread(target=lambda: answers.append(http.post(
                f"{s.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})))
            queued.start()
            until(lambda: health(s)["waiting"] == 1, "the second request never queued")
            s.proc.send_signal(signal.SIGTERM)
            queued.join(60)
        assert answers and answers[0].status_code == 503, answers
        assert answers[0].headers["retry-after"] == "1" and answers[0].json()["error"]["code"] == "overloaded"
        running.close()
    finally:
        s.stop()


# --- 9. half-sent headers do not hold a connection open ----------------------------------------------

def test_a_connection_that_never_finishes_its_headers_is_closed(server):
    from specdec_cli.cli.serve_command import HEADERS_TIMEOUT_S

    url = urlparse(server.url)
    socks = []
    for partial in (b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"):
        sock = socket.create_connection((url.hostname, url.port))
        sock.sendall(partial)
        sock.settimeout(HEADERS_TIMEOUT_S + 30)
        socks.append(sock)
    start = time.monotonic()
    for sock in socks:
        assert sock.recv(1024) == b""  # closed by the server
        sock.close()
    assert time.monotonic() - start >= HEADERS_TIMEOUT_S - 1
    assert text(server)
