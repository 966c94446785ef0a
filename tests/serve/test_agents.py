"""The real coding agents against ``specdec serve``: Codex CLI and Claude Code as they ship on npm.

Each agent runs non-interactively (``codex exec``, ``claude -p``) against a
server whose tiny model answers "Hello!" under a strict published chat
template (Qwen3.5's, Gemma 3's: see ``tests/agents.py``), behind an API key,
and must end with exit 0 and the answer. `.ci/run` installs the pinned agents
(and sets SPECDEC_REQUIRE_AGENTS, so a missing agent fails there); elsewhere
the tests are skipped when they are not installed (README's Development section
has the npm line that installs them into ``.agents/``). One server is sharded over 2 ranks.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import httpx
import pytest

from agents import ANSWER, CONTEXT, agent_bin, hello_model_dir
from server import Server

KEY = "agent-key"
# Hang guard only: an agent's run takes 10-30 s here.
RUN_TIMEOUT_S = 300
# Each template's server in one process; Qwen3.5's also sharded over 2 ranks (as mlx.launch starts them).
SERVERS = [("qwen3_5", 1), ("gemma3", 1), ("qwen3_5", 2)]


def _agent(name: str) -> Path:
    exe = agent_bin(name)
    if exe is None:
        if os.environ.get("SPECDEC_REQUIRE_AGENTS"):
            pytest.fail(f"{name} is not installed (.ci/run installs it with npm)")
        pytest.skip(f"{name} is not installed (README, Development: the npm line)")
    return exe


@pytest.fixture(scope="module", params=SERVERS, ids=lambda p: p[0] if p[1] == 1 else f"{p[0]}-{p[1]}-ranks")
def server(request, tmp_path_factory):
    template, ranks = request.param
    model = hello_model_dir(tmp_path_factory.mktemp(template) / "m", template)
    started = Server("--model", model, "--api-key", KEY, ranks=ranks)
    started.template = template
    yield started
    started.stop()


def _run(cmd: list, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    # No user's configuration, no terminal: what an agent does in a script or CI.
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_", "CODEX_", "CLAUDE_"))}
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env={**base, **env}, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=RUN_TIMEOUT_S)


def _context(server) -> int:
    # The served model's context, as README tells users to read it for the agents' settings.
    card = httpx.get(f"{server.url}/v1/models", headers={"authorization": f"Bearer {KEY}"}).json()["data"][0]
    assert card["context_length"] == CONTEXT
    return card["context_length"]


def test_codex_exec_ends_with_the_answer(server, tmp_path):
    codex = _agent("codex")
    home = tmp_path / "codex-home"
    home.mkdir()
    # README's provider; the key comes from the variable env_key names.
    (home / "config.toml").write_text(
        f'model = "default_model"\nmodel_provider = "specdec"\nmodel_context_window = {_context(server)}\n\n'
        '[model_providers.specdec]\nname = "specdec"\n'
        f'base_url = "{server.url}/v1"\nwire_api = "responses"\nenv_key = "SPECDEC_API_KEY"\n')
    work = tmp_path / "work"
    work.mkdir()
    done = _run([codex, "exec", "--skip-git-repo-check", "Say hello."], work,
                {"CODEX_HOME": str(home), "SPECDEC_API_KEY": KEY, "HOME": str(tmp_path)})
    assert done.returncode == 0, f"{server.template}\n{done.stdout}\n{done.stderr}\n{server.log[-3000:]}"
    assert ANSWER in done.stdout, done.stdout
    # Codex sends its tools (functions, a namespace of sub-agent functions, web_search), two developer
    # messages and no output limit: the one request it made was served.
    assert "finish stop" in server.log and not _http_400(done.stderr), done.stderr


def _http_400(text: str) -> list[str]:
    """Lines reporting an HTTP 400: a standalone 400 beside an error word (a session id such as
    ...-3a40086f6610 holds "400" too, and once failed a bare substring check)."""
    return [line for line in text.splitlines() if re.search(r"(?<![\w-])400(?![\w-])", line)
            and re.search(r"error|status|bad request", line, re.IGNORECASE)]


def test_claude_p_ends_with_the_answer(server, tmp_path):
    claude = _agent("claude")
    work = tmp_path / "work"
    work.mkdir()
    done = _run([claude, "-p", "Say hello."], work, {
        "HOME": str(tmp_path), "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_AUTH_TOKEN": KEY,
        # No ANTHROPIC_MODEL: Claude Code asks for claude-* models, and the server answers to those names.
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(_context(server)), "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"})
    assert done.returncode == 0, f"{server.template}\n{done.stdout}\n{done.stderr}\n{server.log[-3000:]}"
    assert ANSWER in done.stdout, done.stdout
    # Told the served model's context, it does not assume one of its own.
    assert "context window" not in done.stdout + done.stderr
