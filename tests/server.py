"""A real ``specdec serve`` process for the tests, and a tiny model that calls a tool.

:class:`Server` starts the CLI as a subprocess on a free port (``--port 0``;
the port is read from its start-up line), waits for ``/health``, keeps its
stderr, and is stopped with SIGTERM (then killed, as a hang guard).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import httpx
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import openai

from specdec_cli.session.synthetic import EOS_ID, TINY_CONFIGS, build_model, save_model_dir, write_tokenizer

ROOT = Path(__file__).resolve().parent.parent
READY = re.compile(r"serving the OpenAI API on (http://\S+)/v1")
# Hang guards only: a healthy start takes seconds, the bundled model ~20 s on a busy machine.
START_TIMEOUT_S = 180
# A folder that every process of one test session shares (set by tests/conftest.py).
SHARED_ENV = "SPECDEC_TEST_SESSION_DIR"
STOP_TIMEOUT_S = 30


def python_path(*first) -> str:
    """``first``, the checkout, then this process's PYTHONPATH: a lent GPU's MLX is installed on a path of
    its own (scripts/gpu_check.sh: /tmp/site), which a server started with the checkout alone could not import."""
    return os.pathsep.join(str(p) for p in (*first, ROOT, os.environ.get("PYTHONPATH")) if p)


def env(**extra: str) -> dict:
    out = dict(os.environ)
    # MLX's bundled BLAS, as in the tests' own process: a T-row forward then gives the bits of T one-row
    # ones, so served text and log-probabilities are held to plain decoding's bit for bit (with OpenBLAS,
    # which the CLI preloads, float32 matmuls round by row count).
    out.update({"HF_HUB_OFFLINE": "1", "PYTHONPATH": python_path(), "SPECDEC_NO_REEXEC": "1", **extra})
    return out


def _merged(base: dict, extra: Optional[dict], rank: int) -> dict:
    """``base`` with one rank's own variables (None: unset) and its ``MLX_RANK``."""
    out = {**base, **(extra or {}), "MLX_RANK": str(rank)}
    return {k: v for k, v in out.items() if v is not None}


class Server:
    """``specdec serve ARGS`` on a free port.

    Args:
        args: Command-line arguments after ``serve``.
        extra_env: Variables for every process.
        ranks: Processes started as ranks of MLX's ring backend (rank 0 serves HTTP).
        rank_env: Each rank's own variables (None unsets one).
    """

    def __init__(self, *args: str, extra_env: Optional[dict] = None, ranks: int = 1,
                 rank_env: Optional[dict[int, dict]] = None):
        self.args = [str(a) for a in args]
        cmd = [sys.executable, "-m", "specdec_cli", "serve", "--port", "0", *self.args]
        run_env = env(**(extra_env or {}))
        # Under ranks, MLX's ring backend as mlx.launch sets it up, each rank started here (so that one can be
        # killed or stopped): rank 0 is ``proc`` and serves HTTP, the others are ``others``.
        self.others: list[subprocess.Popen] = []
        self.other_lines: list[list[str]] = []
        if ranks > 1:
            hosts = Path(tempfile.mkdtemp(prefix="specdec-ranks-")) / "hosts.json"
            hosts.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(ranks)]))
            run_env["MLX_HOSTFILE"] = str(hosts)
            for rank in range(1, ranks):
                proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                        env=_merged(run_env, (rank_env or {}).get(rank), rank))
                lines: list[str] = []
                threading.Thread(target=lambda p=proc, out=lines: out.extend(x.rstrip("\n") for x in p.stderr),
                                 daemon=True).start()
                self.others.append(proc)
                self.other_lines.append(lines)
            run_env = _merged(run_env, (rank_env or {}).get(0), 0)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=run_env)
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url: Optional[str] = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(START_TIMEOUT_S) or self.url is None:
            self.stop()
            raise RuntimeError("the server did not start:\n" + self.log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not answer /health:\n" + self.log)
            time.sleep(0.05)

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            m = READY.search(line)
            if m:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                             timeout=kw.pop("timeout", 120), **kw)

    def post(self, path: str, body, **kw) -> httpx.Response:
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        headers = {"content-type": "application/json", **kw.pop("headers", {})}
        return httpx.post(f"{self.url}{path}", content=content, headers=headers, timeout=120, **kw)

    def stop(self, sig: int = signal.SIGTERM) -> Optional[int]:
        """Ask the server to stop; returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for proc in self.others:  # rank 0's end ends them (a hang guard beyond)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._reader.join(5)
        return self.proc.returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_bin() -> str:
    """MLX's ``mlx.launch``: beside this Python, else on the PATH."""
    found = Path(sys.executable).with_name("mlx.launch")
    return str(found) if found.exists() else shutil.which("mlx.launch")


def free_ports(n: int) -> list[int]:
    """``n`` consecutive free ports below the kernel's ephemeral range (mlx.launch's --starting-port takes the
    ones after it): no client connection is handed one of them meanwhile, as one of 0's might be."""
    import random

    for _ in range(200):
        base = random.randrange(20000, 32000 - n)
        try:
            with contextlib.ExitStack() as held:
                for port in range(base, base + n):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return list(range(base, base + n))
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports")


# --- a tiny model that calls a tool --------------------------------------------------

# Qwen2.5's way of writing tools and calls, cut down: mlx-lm reads the json_tools parser from it.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou can call these tools:\n{% for tool in tools %}"
    "{{ tool | tojson }}\n{% endfor %}Call one as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n"
    "</tool_call><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}\n"
    "</tool_call>{%- endfor %}{%- else %}{{ message['content'] }}{%- endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if brief is defined and brief %}Briefly: "
    "{% endif %}{% endif %}"
)
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_ANSWER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def tool_model_dir(path: Path, steps: int = 300) -> Path:
    """A tiny llama trained (seconds) to answer ``TOOL_QUESTION`` with ``TOOL_ANSWER``, then EOS.

    Its chat template renders tools the way Qwen2.5's does, so mlx-lm infers
    its json_tools parser; greedy decoding reproduces the call exactly (checked).

    Trained once per test session (four server files use it; tests/conftest.py names the folder
    the session's processes share) and copied to ``path``: the same deterministic training, checked
    the same way, without repeating it in every file.
    """
    return _once_per_session(path, f"tool-model-{steps}", lambda p: said_model_dir(p, TOOL_ANSWER, steps))


def _once_per_session(path: Path, key: str, make) -> Path:
    """``make(path)``, or a copy of what it made earlier in this test session (under every xdist worker)."""
    import shutil

    from filelock import FileLock

    root = os.environ.get(SHARED_ENV)
    if not root:  # not under this suite's conftest: make it here
        return make(path)
    made = Path(root) / key
    with FileLock(str(made) + ".lock"):
        if not (made / ".complete").exists():
            shutil.rmtree(made, ignore_errors=True)
            make(made)
            (made / ".complete").touch()
    shutil.copytree(made, path, ignore=shutil.ignore_patterns(".complete"), dirs_exist_ok=True)
    return path


def said_model_dir(path: Path, answer: str, steps: int = 300) -> Path:
    """A tiny llama trained (seconds) to answer ``TOOL_QUESTION``, with the weather tool offered, with
    ``answer`` then EOS (greedy decoding reproduces it exactly: checked)."""
    from specdec_cli.model.prompts import render_messages

    config = TINY_CONFIGS["llama"]
    model = build_model(config, seed=3)
    save_model_dir(path, model, config)
    tokenizer = tools_tokenizer(path)
    prompt = render_messages(tokenizer, TOOL_QUESTION, tools=[WEATHER_TOOL]).ids
    target = tokenizer.encode(answer, add_special_tokens=False) + [EOS_ID]
    ids = mx.array(prompt + target[:-1], dtype=mx.uint32)[None]
    labels = mx.array(target, dtype=mx.uint32)
    n = len(target)

    def loss_fn(m):
        logits = m(ids)[0, -n:]
        return nn.losses.cross_entropy(logits, labels).mean()

    opt = optim.Adam(learning_rate=3e-3)
    grad = nn.value_and_grad(model, loss_fn)
    model.train()
    for step in range(steps):
        _, g = grad(model)
        opt.update(model, g)
        mx.eval(model.parameters(), opt.state)
        if step % 25 == 24 and _says(model, prompt, target):
            break
    model.eval()
    assert _says(model, prompt, target), f"the tiny model did not learn to say {answer!r}"
    save_model_dir(path, model, config, tokenizer=False)
    return path


def tools_tokenizer(path: Path):
    """The test tokenizer in ``path``, with the tools template; returns mlx-lm's wrapper of it."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    if not (path / "tokenizer.json").exists():
        write_tokenizer(path)
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = TOOLS_TEMPLATE
    cfg_file.write_text(json.dumps(cfg, indent=2))
    tokenizer = load_tokenizer(path)
    assert tokenizer.has_tool_calling, "mlx-lm should infer a tool parser from this template"
    return tokenizer


def _says(model, prompt: list[int], answer: list[int]) -> bool:
    """Greedy decoding of ``prompt`` gives ``answer`` (teacher-forced argmax, the same thing for one sequence)."""
    logits = model(mx.array(prompt + answer[:-1], dtype=mx.uint32)[None])[0, -len(answer):]
    return mx.argmax(logits, axis=-1).tolist() == answer
