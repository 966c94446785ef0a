"""Ctrl-C, SIGTERM and closed pipes: a run ends quickly, its text printed once, its exit code the shell's.
The Ctrl-C tests run the CLI as a subprocess whose every forward is slowed down."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from cli_fixtures import REPO, models  # noqa: F401 (models: a fixture)
from specdec_cli.session.loading import load
from specdec_cli.loop.events import collect
from specdec_cli.loop.runner import run

# A sitecustomize for the Ctrl-C children (test-only: nothing in specdec knows about it). Every forward
# of specdec's caches takes at least FORWARD_S longer, so whatever the machine's speed a run has far more
# work left than the test's own delays (a starved test process) before its signal lands: a 3000-token
# prefill in 1-token chunks lasts >= 150 s, 4000 tokens in 2-token blocks >= 100 s. With MARK set, the
# engine writes DECODING to stderr once its first block is committed (the consumer asked for the next
# one), for a --json run, which streams no text to wait for; with MARK_FORWARDS=N, once N forwards
# were slowed.
FORWARD_S = 0.05
DECODING = b"test-marker: decoding"
SITECUSTOMIZE = f"""
import importlib.abc, importlib.util, os, sys, time


def _caches(module):
    forward = module.ModelCache._forward

    def slow_forward(self, tokens, mode):
        out = forward(self, tokens, mode)
        # With SLOW_WHILE, only while that file exists (a test makes some turns slow, the others not).
        if not os.environ.get("SLOW_WHILE") or os.path.exists(os.environ["SLOW_WHILE"]):
            time.sleep({FORWARD_S})
            module._slowed = getattr(module, "_slowed", 0) + 1
            if os.environ.get("MARK_FORWARDS") == str(module._slowed):
                sys.stderr.write("{DECODING.decode()}\\n")
                sys.stderr.flush()
        return out

    module.ModelCache._forward = slow_forward


def _flights(module):
    alone = module.Flights.alone

    def marked(self, *args, **kwargs):
        events = alone(self, *args, **kwargs)
        steps = 0
        try:
            for event in events:
                yield event
                if isinstance(event, module.Step):
                    steps += 1
                    if steps == 1 and os.environ.get("MARK"):
                        sys.stderr.write("{DECODING.decode()}\\n")
                        sys.stderr.flush()
        finally:
            events.close()

    module.Flights.alone = marked
    step = module.Flights.step

    def marked_step(self):
        # After the second block: the first one's events have reached the command (its text is the row's).
        out = step(self)
        self._steps = getattr(self, "_steps", 0) + 1
        if os.environ.get("MARK_STEP") and self._steps == 2:
            sys.stderr.write("{DECODING.decode()}\\n")
            sys.stderr.flush()
        return out

    module.Flights.step = marked_step


class _Patch(importlib.abc.MetaPathFinder):
    patches = {{"specdec_cli.cache.caches": _caches, "specdec_cli.loop.flights": _flights}}

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run, patch = spec.loader.exec_module, self.patches[name]

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Patch())
"""


@pytest.fixture(scope="module")
def slow(tmp_path_factory) -> dict:
    """The environment of a child whose every forward is slowed down (see SITECUSTOMIZE)."""
    folder = tmp_path_factory.mktemp("slow-forwards")
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _sigint_at_default() -> None:
    # Started from a script's background job (`pytest ... &` without job control), the test process has
    # SIGINT ignored and a child inherits that: Python then never raises KeyboardInterrupt and the run goes
    # on to its end (exit 0). A foreground job on a terminal has it at default, as the child gets here.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _spawn(args, **kw):
    # Unbuffered: what the test reads before communicate() must not sit in a reader's buffer.
    return subprocess.Popen([sys.executable, "-m", "specdec_cli", "generate", *map(str, args)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
                            preexec_fn=_sigint_at_default, **kw)


def _wait_for(stream, marker: bytes, limit: float = 120.0) -> bytes:
    """Read ``stream`` until ``marker`` shows up (one byte at a time: no read blocks past it)."""
    seen, start = b"", time.monotonic()
    while marker not in seen:
        byte = stream.read(1)
        assert byte and time.monotonic() - start < limit, f"no {marker!r} in {seen[-300:]!r}"
        seen += byte
    return seen


def _interrupt(proc, sig=signal.SIGINT) -> tuple[bytes, bytes, float]:
    proc.send_signal(sig)
    start = time.monotonic()
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()  # a child the signal did not stop must not outlive the test
            proc.communicate()
    return out, err, time.monotonic() - start


@pytest.fixture(scope="module")
def looping(models):
    """A prompt for a long run (greedy, the tiny model loops without EOS), and plain decoding of it."""
    loaded = load(str(models["llama"]))
    prompt = "ab" * 20

    def reference(n: int) -> str:
        _, tokens = collect(run(loaded.model, loaded.tokenizer.encode(prompt), max_tokens=n))
        return loaded.tokenizer.decode(tokens)

    return prompt, reference


def test_ctrl_c_during_prefill_exits_130_quickly(models, slow):
    proc = _spawn(["--model", models["llama"], "p" * 3000, "--ignore-chat-template", "--verbose",
                   "--prefill-step-size", "1", "-m", "4"], env=slow)
    # Printed just before the prefill starts; the prefill then lasts minutes (3000 slowed forwards).
    _wait_for(proc.stderr, b"Prefill: 3000 prompt tokens")
    out, err, took = _interrupt(proc)
    assert proc.returncode == 130, err
    assert took < 5, took  # the issue asks for 2 s; a loaded CI machine gets slack
    assert out == b""
    assert b"prefill not finished" in err and b"Finish reason: interrupted" in err
    # No block ran: no mean over none, no shapes, no warm-up claimed.
    assert b"\nBlocks: 0\n" in err and b"Verify shapes: none" in err and b"tokens per block" not in err
    assert b"every shape had run already" not in err
    assert b"Traceback" not in err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_during_decoding_prints_the_text_once(models, looping, slow, sig):
    prompt, reference = looping
    proc = _spawn(["--model", models["llama"], prompt, "--ignore-chat-template", "-m", "4000",
                   "--no-adaptive", "--block-size", "2"], env=slow)
    head = proc.stdout.read(1)  # text is streaming: decoding is under way (and lasts minutes)
    out, err, took = _interrupt(proc, sig)
    assert proc.returncode == 130, err
    assert took < 5, took
    text = (head + out).decode()
    generated = int(re.search(rb"^Generation: (\d+) tokens", err, re.M).group(1))
    assert 0 < generated < 4000
    # Exactly what was generated, once: plain decoding's first tokens, then the closing newline.
    assert text == reference(generated) + "\n"
    assert b"Finish reason: interrupted" in err and b"Traceback" not in err


def test_ctrl_c_with_json_gives_one_object(models, looping, slow):
    prompt, reference = looping
    proc = _spawn(["--model", models["llama"], prompt, "--ignore-chat-template", "-m", "4000", "--json",
                   "--no-adaptive", "--block-size", "2"], env={**slow, "MARK": "1"})
    _wait_for(proc.stderr, DECODING)  # the first block is committed, the second one is under way
    out, err, _ = _interrupt(proc)
    assert proc.returncode == 130, err
    report = json.loads(out)  # all of stdout is one object
    assert report["finish_reason"] == "interrupted" and report["interrupted"] is True
    assert 0 < report["generated_tokens"] < 4000
    assert report["text"] == reference(report["generated_tokens"])


def test_ctrl_c_in_a_prompts_file_reports_the_batch_so_far(models, looping, slow, tmp_path):
    prompt, _ = looping
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{prompt}\n{prompt} again\n{prompt} and again\n")
    proc = _spawn(["--model", models["llama"], "--prompts-file", prompts, "--ignore-chat-template", "-m", "4000",
                   "--json", "--decode-concurrency", "1", "--no-adaptive", "--block-size", "2"],
                  env={**slow, "MARK_STEP": "1"})
    _wait_for(proc.stderr, DECODING)  # the first row's first block is in its text; the other rows wait their turn
    out, err, _ = _interrupt(proc)
    assert proc.returncode == 130, err
    report = json.loads(out)
    summary, rows = report["summary"], report["rows"]
    assert summary["blocks"] > 0 and summary["decode_s"] > 0 and summary["wall_s"] >= summary["decode_s"]
    assert summary["most_rows_together"] == 1 and summary["aggregate_tps"] > 0
    assert [r["finish_reason"] for r in rows] == ["interrupted"] * 3
    assert rows[0]["generated_tokens"] > 0 and rows[1]["generated_tokens"] == rows[2]["generated_tokens"] == 0


def test_ctrl_c_in_a_chat_turns_prefill_keeps_the_conversations_cache(models, slow, tmp_path):
    # The turn's prompt extends the cached conversation, whose caches are handed to it: a Ctrl-C raised
    # inside a prefill chunk lost them all, and the next turn prefilled the whole conversation again.
    flag = tmp_path / "slow"
    proc = subprocess.Popen([sys.executable, "-m", "specdec_cli", "chat", "--model", str(models["llama"]), "--no-live",
                             "-m", "4", "--prefill-step-size", "1", "--prompt-cache-disk-gb", "0"], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
                            preexec_fn=_sigint_at_default, env={**slow, "SLOW_WHILE": str(flag), "MARK_FORWARDS": "40"})
    try:
        proc.stdin.write(b"Hello there\n")
        first = _wait_for(proc.stderr, b"]\n")  # turn one's line of numbers: it is over
        flag.touch()  # turn two's prefill: 1-token chunks, each slowed, for as long as the flag is there
        long = " ".join(["the quick brown fox jumps over the lazy dog"] * 30)
        proc.stdin.write(long.encode() + b"\n")
        _wait_for(proc.stderr, DECODING)
        proc.send_signal(signal.SIGINT)
        second = _wait_for(proc.stderr, b"]\n")
        flag.unlink()
        proc.stdin.write(long.encode() + b" Again.\n/quit\n")
        out, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, rest
    err = (first + second + rest).decode()
    lines = re.findall(r"^\[prompt (\d+) tokens(?: \((\d+) cached\))?.*\]$", err, re.M)
    assert len(lines) == 3, err
    assert "stopped (Ctrl-C)" in second.decode().splitlines()[-1] and "stopped" not in first.decode()
    (p1, _), (p2, _), (p3, c3) = [(int(p), int(c or 0)) for p, c in lines]
    # Turn two (resuming turn one) was stopped between its chunks, after 40 of them, and kept what it had fed:
    # turn three resumes turn one's conversation and those tokens (before, it resumed nothing).
    assert p1 + 40 <= c3 < p2 < p3, err
    assert "Traceback" not in err


@pytest.mark.parametrize("when", ["answering", "waiting"])
def test_sigterm_ends_a_chat(models, slow, when):
    # SIGTERM takes Ctrl-C's path, and chat goes on after a Ctrl-C: `kill PID` only stopped the answer, and at
    # the prompt did nothing at all.
    proc = subprocess.Popen([sys.executable, "-m", "specdec_cli", "chat", "--model", str(models["llama"]), "--no-live",
                             "-m", "4000" if when == "answering" else "4", "--no-adaptive", "--block-size", "2",
                             "--prompt-cache-disk-gb", "0"], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, bufsize=0, preexec_fn=_sigint_at_default,
                            env={**slow, "MARK": "1"})
    try:
        proc.stdin.write(b"ab ab ab ab ab ab\n")
        _wait_for(proc.stderr, DECODING if when == "answering" else b"]\n")
        out, err, took = _interrupt(proc, signal.SIGTERM)
    finally:
        proc.stdin.close()
    assert proc.returncode == 130, err
    assert took < 30, took
    assert b"interrupted" in err and b"Traceback" not in err


def test_a_ctrl_c_while_a_stopped_chat_turn_cleans_up_is_not_a_second_press():
    # The first Ctrl-C stops the turn after its next piece; closing the turn then takes the caches out of the
    # engine and keeps them. A press during that used to raise out of the chat (exit 130, the conversation lost).
    from specdec_cli.cli.chat import _CtrlC, _stream
    from specdec_cli.core.stats import Stats
    from specdec_cli.session.reply import Piece

    class Turn:
        stats = Stats()

        def __iter__(self):
            try:
                yield Piece(content="a")
                os.kill(os.getpid(), signal.SIGINT)  # the first press, while the next block runs
                yield Piece(content="b")
                yield Piece(content="c")
            finally:
                os.kill(os.getpid(), signal.SIGINT)  # another, while the turn cleans up
                time.sleep(0.01)

    before = signal.getsignal(signal.SIGINT)
    with _CtrlC() as ctrl_c:
        assert _stream(Turn(), False, "lookup", ctrl_c) == ("ab", True)
    assert signal.getsignal(signal.SIGINT) is before
    with _CtrlC() as ctrl_c, pytest.raises(KeyboardInterrupt):  # two presses while it runs: at once
        ctrl_c._handle(signal.SIGINT, None)
        ctrl_c._handle(signal.SIGINT, None)


def test_ctrl_c_while_the_command_line_loads_exits_130_quietly(tmp_path):
    # Ctrl-C lands while the CLI's modules are imported (the first second of a run): a test-only
    # sitecustomize raises it at the import of the app, as the signal would.
    (tmp_path / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        "class _Interrupt(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'specdec_cli.cli.app':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, _Interrupt())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)}
    for command in ([sys.executable, "-m", "specdec_cli"], [os.path.join(os.path.dirname(sys.executable), "specdec")]):
        result = subprocess.run([*command, "generate", "-p", "hi"], cwd=REPO, env=env, capture_output=True,
                                timeout=120, preexec_fn=_sigint_at_default)
        assert (result.returncode, result.stdout, result.stderr) == (130, b"", b""), result


def test_a_closed_stdout_ends_quietly(models, looping, slow):
    prompt, _ = looping
    proc = _spawn(["--model", models["llama"], prompt, "--ignore-chat-template", "-m", "4000"], env=slow)
    proc.stdout.read(5)
    proc.stdout.close()  # `| head -c 5`
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141
    assert err == b"", err


@pytest.mark.parametrize("merged", [False, True])
def test_a_closed_stderr_ends_quietly_with_141(models, merged):
    # `specdec generate ... 2>&1 | head -2` once the text is out: the summary meets a closed pipe. Rich
    # answered that with its own exit 1. The reader here is gone before the child writes anything, so what
    # the child writes first is what finds the pipe closed: the summary (stdout to /dev/null), or the text.
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "specdec_cli", "generate", "--model", str(models["llama"]),
                                 "Hi", "-m", "8", "--no-live"], cwd=REPO, stdin=subprocess.DEVNULL,
                                stdout=write if merged else subprocess.DEVNULL, stderr=write)
    finally:
        os.close(write)
    assert proc.wait(timeout=120) == 141




@pytest.mark.parametrize("closed", [0, 1])
def test_a_standard_stream_closed_by_the_caller_is_no_error(models, closed):
    # `specdec ... <&-`: the weights file took fd 0, which MLX will not read ("cannot read the weights ...
    # download again"). `>&-`: sys.stdout was None, a traceback before anything ran.
    def close():
        _sigint_at_default()
        os.close(closed)

    result = subprocess.run([sys.executable, "-m", "specdec_cli", "generate", "--model", str(models["llama"]), "Hi",
                             "-m", "2", "--no-live", "--prompt-cache-disk-gb", "0"], cwd=REPO,
                            stdout=subprocess.PIPE if closed != 1 else None, stderr=subprocess.PIPE, timeout=120,
                            preexec_fn=close)
    assert result.returncode == 0, result.stderr
    assert b"Traceback" not in result.stderr and b"Finish reason: length" in result.stderr


def test_the_live_panel_leaves_room_for_the_echoed_ctrl_c():
    # A panel as wide as the terminal leaves the cursor pending a wrap: the "^C" the
    # terminal echoes then moves it a line down, the transient erase misses the text
    # line and it was printed twice. The panel stays narrower than the terminal.
    import io

    from rich.console import Console

    from specdec_cli.cli.display import LiveText
    from specdec_cli.core.stats import Stats

    console = Console(file=io.StringIO(), width=80, force_terminal=True)
    view = LiveText(console, "lookup")
    view.update(Stats())
    lines = console.render_lines(view._render(), console.options, pad=False)
    view.live.stop()
    widths = [len("".join(seg.text for seg in line).rstrip()) for line in lines]
    assert max(widths) <= 80 - 2 and len(widths) == 4  # the text line, then the 3-line panel
