"""What the real coding agents need from a test server: a model that answers under a strict chat template,
and the agents themselves (Codex CLI and Claude Code, from npm, pinned).

:func:`hello_model_dir` writes a tiny llama with the bundled SmolLM2 tokenizer
(a real BPE: Claude Code's prompt is ~20k tokens of it, where the tests' byte
tokenizer would make 60k) under a published chat template from
``tests/templates/``. Its weights make a fixed chain of tokens: every layer's
output projection is zero, so the last hidden state is the current token's
embedding, and the output head maps the end of any generation prompt to
"Hello", "Hello" to "!" and "!" to end-of-sequence. Greedy decoding answers
"Hello!" whatever the prompt, in milliseconds per token, at any length.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import mlx.core as mx

from specdec_cli.model.bundled import model_dir as bundled_model_dir
from specdec_cli.session.synthetic import TINY_CONFIGS, build_model, save_model_dir

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = Path(__file__).resolve().parent / "templates"
# Where README's Development section (and `.ci/run`) installs the pinned agents with npm.
AGENTS_DIR = Path(os.environ.get("SPECDEC_AGENTS_DIR", ROOT / ".agents"))
ANSWER = "Hello!"
# Room for Claude Code's whole prompt (20.5k tokens under Qwen3.5's template with its tools).
CONTEXT = 32768


def template(name: str) -> str:
    """A published chat template kept in ``tests/templates`` (see its README)."""
    return (TEMPLATES / f"{name}.jinja").read_text()


def hello_model_dir(path: Path, template_name: str) -> Path:
    """A tiny model that answers ``ANSWER`` then ends, under the named chat template.

    Args:
        path: Where to write it (Hub layout).
        template_name: A template in ``tests/templates`` (``qwen3_5``, ``gemma3``, ...).
    """
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from specdec_cli.model.prompts import render_messages

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    source = bundled_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, path / name)
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = template(template_name)
    cfg["model_max_length"] = CONTEXT
    cfg_file.write_text(json.dumps(cfg, indent=2))
    tokenizer = load_tokenizer(path)
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id

    # Every way a generation prompt of this template can end (thinking on or off) starts the chain.
    starts = set()
    for kwargs in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
        ids = render_messages(tokenizer, [{"role": "user", "content": "Hi"}], template_kwargs=kwargs).ids
        starts.add(ids[-1])
    hello, bang = (tokenizer.encode(t, add_special_tokens=False) for t in ("Hello", "!"))
    assert len(hello) == 1 and len(bang) == 1, "the chain needs one-token words"
    chain = [(s, hello[0]) for s in starts] + [(hello[0], bang[0]), (bang[0], eos)]
    assert len({a for a, _ in chain}) == len(chain), "a token cannot lead to two others"

    config = {**TINY_CONFIGS["llama"], "vocab_size": vocab, "max_position_embeddings": CONTEXT,
              "eos_token_id": eos, "bos_token_id": tokenizer.bos_token_id}
    model = build_model(config, seed=7)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    model.model.norm.weight = mx.ones_like(model.model.norm.weight)
    embed = model.model.embed_tokens.weight
    unit = embed / mx.sqrt(mx.mean(embed * embed, axis=-1, keepdims=True))
    head = mx.zeros_like(model.lm_head.weight)
    for current, following in chain:
        head[following] = head[following] + 4.0 * unit[current] / unit.shape[-1]
    model.lm_head.weight = head
    mx.eval(model.parameters())
    save_model_dir(path, model, config, tokenizer=False)
    return path


def agent_bin(name: str) -> Optional[Path]:
    """The installed agent's executable (``codex`` or ``claude``), or None when it is not installed."""
    exe = AGENTS_DIR / "node_modules" / ".bin" / name
    return exe if exe.exists() else None

