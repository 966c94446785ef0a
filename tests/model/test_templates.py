"""System and developer messages anywhere, rendered by every chat template README names.

The templates in ``tests/templates`` are the publishers' own (see its README):
Qwen3.5 refuses a system message that is not first, Gemma 3 and Mistral refuse
two user messages in a row, Mistral refuses any system message. The
conversations are the shapes the agents send: Codex's two developer messages
then two user messages, Claude Code's system message after the first user
message, and a system message in the middle of a conversation.
"""

from __future__ import annotations

import json
import shutil

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from agents import template
from specdec_cli.model.bundled import model_dir
from specdec_cli.errors import OptionError
from specdec_cli.model.prompts import _folded, _template, encode_messages, encode_prompt, fold_roles, render_messages

TEMPLATES = ["qwen3_5", "gemma3", "mistral", "llama3", "smollm2"]

CODEX = [{"role": "developer", "content": "You are Codex."}, {"role": "developer", "content": "Skills: none."},
         {"role": "user", "content": "AGENTS.md says hi."}, {"role": "user", "content": "Say hello."}]
CLAUDE_CODE = [{"role": "system", "content": "You are Claude Code."},
               {"role": "user", "content": "<system-reminder>ctx</system-reminder>\nSay hello."},
               {"role": "system", "content": "# Environment\ncwd: /tmp"}]
MIDDLE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello."}, {"role": "system", "content": "Now answer in French."},
          {"role": "user", "content": "How are you?"}]
SHAPES = {"codex": CODEX, "claude_code": CLAUDE_CODE, "middle": MIDDLE}


@pytest.fixture(scope="module", params=TEMPLATES)
def tokenizer(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir() / name, path / name)
    if request.param != "smollm2":  # the bundled model's own template
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template(request.param)
        (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(path)
    tok.name = request.param
    return tok


def texts(conversation: list[dict]) -> list[str]:
    return [m["content"] for m in conversation]


@pytest.mark.parametrize("shape", SHAPES)
def test_every_template_renders_every_shape_with_every_text_in_order(tokenizer, shape):
    conversation = SHAPES[shape]
    rendered = tokenizer.decode(render_messages(tokenizer, conversation).ids)
    where = [rendered.find(t.strip()) for t in texts(conversation)]
    assert all(i >= 0 for i in where), (tokenizer.name, shape, rendered)
    if shape != "claude_code":
        assert where == sorted(where), (tokenizer.name, shape, rendered)
    # The same rule for a file of prompts as for the server and chat.
    assert encode_messages(tokenizer, conversation, None, False) == render_messages(tokenizer, conversation).ids


def test_a_system_prompt_renders_for_generate_as_for_chat(tokenizer):
    # generate -p (and a file's "prompt" lines) with --system-prompt failed on Mistral's template, which
    # takes no system message, where chat and "messages" lines folded it into the user message.
    chat = render_messages(tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert encode_prompt(tokenizer, "Hi", "Be brief.", False) == chat.ids


# What the fold is for: the publishers' templates raise on these shapes as the agents send them.
REFUSED = [("qwen3_5", "codex"), ("qwen3_5", "claude_code"), ("qwen3_5", "middle"), ("gemma3", "codex"),
           ("gemma3", "middle"), ("mistral", "codex"), ("mistral", "claude_code"), ("mistral", "middle")]


@pytest.mark.parametrize("name,shape", REFUSED)
def test_strict_templates_refuse_these_shapes_unfolded(tmp_path, name, shape):
    path = tmp_path / name
    path.mkdir()
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir() / file, path / file)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template(name)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(OptionError):
        _template(load_tokenizer(path), [{**m, "role": "system" if m["role"] == "developer" else m["role"]}
                                         for m in SHAPES[shape]])


def test_the_rule():
    assert fold_roles(CODEX) == [{"role": "system", "content": "You are Codex.\n\nSkills: none."},
                                 {"role": "user", "content": "AGENTS.md says hi.\n\nSay hello."}]
    assert fold_roles(CLAUDE_CODE) == [
        {"role": "system", "content": "You are Claude Code."},
        {"role": "user", "content": "<system-reminder>ctx</system-reminder>\nSay hello.\n\n# Environment\ncwd: /tmp"}]
    assert fold_roles(MIDDLE)[2:] == [{"role": "assistant", "content": "Hello."},
                                      {"role": "user", "content": "Now answer in French.\n\nHow are you?"}]
    # Tool turns are kept; a system message after a tool result starts a user turn.
    tools = [{"role": "user", "content": "Go"}, {"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]},
             {"role": "tool", "tool_call_id": "c", "content": "42"}, {"role": "system", "content": "Hurry."}]
    assert fold_roles(tools)[1:] == [tools[1], tools[2], {"role": "user", "content": "Hurry."}]


def test_earlier_turns_render_the_same_when_a_system_message_comes_later(tokenizer):
    # The prompt cache reuses a conversation's earlier turns: folding must not rewrite them.
    # (Qwen3.5's template itself renders an assistant turn differently once it is not the last: compare the
    # turns before it.)
    # Text, not ids: this tokenizer does not know Llama's markers, and BPE merges across them.
    head = tokenizer.decode(_folded(tokenizer, MIDDLE[:2], add_generation_prompt=False)[0])
    for upto in (3, 5):
        assert tokenizer.decode(render_messages(tokenizer, MIDDLE[:upto]).ids).startswith(head), (tokenizer.name, upto)


def test_serve_says_where_a_requests_tools_do_not_reach_the_model(tokenizer):
    # SmolLM2's template renders no tools: a request's tools were dropped unsaid (Claude Code always sends them).
    from specdec_cli.model.prompts import tools_note

    note = tools_note(tokenizer)
    if tokenizer.name == "qwen3_5":  # renders tools, and mlx-lm parses its calls
        assert note is None
    else:  # these templates (tests/templates) render none
        assert note == "this model's chat template renders no tools: a request's tools are not offered to the " \
                       "model (its answers are text)"
