"""``specdec serve``'s Anthropic Messages and OpenAI Responses endpoints, as their official clients see them.

Each is a translation over chat completions, so each answer is checked against
``/v1/chat/completions``' for the same conversation (greedy: the same text),
then the tools, thinking, errors and keys, and the bodies Claude Code and
Codex CLI send. One server per model for the module: a plain llama behind an
API key, a model that thinks, and one trained to call a tool.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from tokenizers import Tokenizer

from server import TOOL_QUESTION, WEATHER_TOOL, Server, tool_model_dir
from specdec_cli.serve import anthropic as messages_api
from specdec_cli.serve import responses as responses_api
from specdec_cli.serve.protocol import ApiError
from specdec_cli.session.reply import Piece
from specdec_cli.session.synthetic import CHAT_TEMPLATE, TINY_CONFIGS, VOCAB_SIZE, make_model_dir

KEY = "sesame"
N = 24
SYSTEM = "Answer briefly."
CONVERSATION = [{"role": "user", "content": "Tell me about the fox."},
                {"role": "assistant", "content": "The fox is quick."},
                {"role": "user", "content": "And the dog?"}]
WEATHER = WEATHER_TOOL["function"]
ANTHROPIC_TOOL = {"name": WEATHER["name"], "description": WEATHER["description"],
                  "input_schema": WEATHER["parameters"]}
RESPONSES_TOOL = {"type": "function", **WEATHER}
ANTHROPIC_ERROR_TYPES = {"invalid_request_error", "authentication_error", "not_found_error", "request_too_large",
                         "overloaded_error", "api_error"}


def thinking_model_dir(path: Path) -> Path:
    """A tiny llama whose template opens a ``<think>`` block for the answer: it reasons, closes it, answers."""
    make_model_dir(path, {**TINY_CONFIGS["llama"], "vocab_size": VOCAB_SIZE + 2}, seed=1)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(["<think>", "</think>"])
    tok.save(str(path / "tokenizer.json"))
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE.replace("assistant\n{% endif %}", "assistant\n<think>\n{% endif %}")
    cfg_file.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = Server("--model", make_model_dir(tmp_path_factory.mktemp("llama") / "m", "llama", seed=0),
                     "--api-key", KEY)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    started = Server("--model", thinking_model_dir(tmp_path_factory.mktemp("think") / "m"))
    yield started
    started.stop()


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory):
    started = Server("--model", tool_model_dir(tmp_path_factory.mktemp("tools") / "m"))
    yield started
    started.stop()


def claude(server: Server, **kw) -> anthropic.Anthropic:
    """The official client; a bearer token (Authorization), as Claude Code's ANTHROPIC_AUTH_TOKEN sends it."""
    if "api_key" not in kw and "auth_token" not in kw:
        kw["auth_token"] = KEY
    return anthropic.Anthropic(base_url=server.url, max_retries=0, timeout=120, **kw)


def chat(server: Server, messages, **kw):
    return server.client(api_key=KEY).chat.completions.create(model="default_model", messages=messages,
                                                              max_tokens=kw.pop("max_tokens", N), **kw)


def sse(server: Server, path: str, body: dict, headers: dict) -> list[tuple[str, dict]]:
    """A streamed answer's (event name, data) pairs; comment lines are skipped."""
    events, name = [], None
    with httpx.stream("POST", f"{server.url}{path}", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
                name = None
    return events


def check_anthropic_events(events: list[tuple[str, dict]]) -> dict:
    """Anthropic's event grammar: message_start, blocks (start, deltas, stop), message_delta, message_stop.

    Returns the message the events build.
    """
    assert all(name == data["type"] for name, data in events)
    kinds = [data["type"] for _, data in events if data["type"] != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    message = events[0][1]["message"]
    assert message["content"] == [] and message["stop_reason"] is None and message["role"] == "assistant"
    open_index = None
    for _, data in events[1:]:
        if data["type"] == "content_block_start":
            assert open_index is None and data["index"] == len(message["content"])
            open_index = data["index"]
            message["content"].append(dict(data["content_block"], _json=""))
        elif data["type"] == "content_block_delta":
            assert data["index"] == open_index
            block, delta = message["content"][open_index], data["delta"]
            field = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "_json",
                     "signature_delta": "signature"}[delta["type"]]
            block[field] += delta.get(field if field != "_json" else "partial_json")
        elif data["type"] == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        elif data["type"] == "message_delta":
            assert open_index is None
            message.update(data["delta"], usage=data["usage"], timings=data["timings"])
    for block in message["content"]:
        raw = block.pop("_json")
        if block["type"] == "tool_use":
            block["input"] = json.loads(raw)
    return message


def check_responses_events(events: list[tuple[str, dict]]) -> dict:
    """The Responses API's event grammar, numbered from 0. Returns the final response object."""
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    kinds = [data["type"] for _, data in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1][1]["response"]
    added = [data["item"]["id"] for _, data in events if data["type"] == "response.output_item.added"]
    done = [data["item"] for _, data in events if data["type"] == "response.output_item.done"]
    assert added == [item["id"] for item in done] == [item["id"] for item in final["output"]]
    assert done == final["output"]
    return final


# --- the Messages API ----------------------------------------------------------------------


def test_messages_answer_what_chat_completions_answers(server):
    client = claude(server)
    want = chat(server, [{"role": "system", "content": SYSTEM}, *CONVERSATION])
    text = want.choices[0].message.content
    out = client.messages.create(model="default_model", max_tokens=N, system=SYSTEM, messages=CONVERSATION)
    assert out.type == "message" and out.role == "assistant" and out.id.startswith("msg_")
    assert [b.type for b in out.content] == ["text"] and out.content[0].text == text
    assert out.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want.choices[0].finish_reason]
    u = out.usage
    assert u.output_tokens == want.usage.completion_tokens
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == want.usage.prompt_tokens
    assert out.model_extra["timings"]["predicted_n"] == u.output_tokens

    # The system prompt as text blocks (Claude Code's way) renders as the string does.
    blocks = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    with client.messages.stream(model="default_model", max_tokens=N, system=blocks, messages=CONVERSATION) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text and final.content[0].text == text and final.stop_reason == out.stop_reason
    assert final.usage.output_tokens == u.output_tokens

    events = list(client.messages.create(model="default_model", max_tokens=N, system=SYSTEM,
                                         messages=CONVERSATION, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text
    assert events[-2].model_extra["timings"]["predicted_n"] == events[-2].usage.output_tokens


def test_count_tokens_is_the_prompt_the_answer_reports(server):
    client = claude(server)
    counted = client.messages.count_tokens(model="default_model", system=SYSTEM, messages=CONVERSATION)
    out = client.messages.create(model="default_model", max_tokens=2, system=SYSTEM, messages=CONVERSATION)
    u = out.usage
    assert counted.input_tokens == u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert counted.input_tokens == chat(server, [{"role": "system", "content": SYSTEM}, *CONVERSATION],
                                        max_tokens=1).usage.prompt_tokens


def test_count_tokens_counts_a_conversation_that_ends_with_the_assistant(server):
    # Anthropic counts any conversation; one ending with the assistant's answer was refused here as a prefill,
    # which only generating needs.
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    client = claude(server)
    said = CONVERSATION[:2]
    counted = client.messages.count_tokens(model="default_model", system=SYSTEM, messages=said).input_tokens
    tok = load_tokenizer(Path(server.args[server.args.index("--model") + 1]))
    as_it_stands = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, *said], tokenize=False,
                                           add_generation_prompt=False)
    assert counted == len(tok.encode(as_it_stands, add_special_tokens=False))
    with pytest.raises(anthropic.BadRequestError):  # generating after it is still a prefill
        client.messages.create(model="default_model", max_tokens=2, system=SYSTEM, messages=said)


def test_max_tokens_0_warms_the_prompt_cache_and_answers_no_content(server):
    # Anthropic's cache pre-warming (max_tokens 0: the prompt is cached, nothing generated): it was a 400.
    client = claude(server)
    messages = [{"role": "user", "content": "Warm me: the quick brown fox jumps over the lazy dog."}]
    out = client.messages.create(model="default_model", max_tokens=0, system=SYSTEM, messages=messages)
    assert out.content == [] and out.stop_reason == "max_tokens" and out.stop_sequence is None
    prompt = client.messages.count_tokens(model="default_model", system=SYSTEM, messages=messages).input_tokens
    assert out.usage.output_tokens == 0 and out.usage.input_tokens + out.usage.cache_read_input_tokens == prompt
    with client.messages.stream(model="default_model", max_tokens=0, system=SYSTEM, messages=messages) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert "content_block_start" not in kinds and final.content == [] and final.usage.output_tokens == 0
    assert final.stop_reason == "max_tokens"
    after = client.messages.create(model="default_model", max_tokens=2, system=SYSTEM, messages=messages)
    assert after.usage.cache_read_input_tokens >= prompt - 1, after.usage  # the prompt was read before


def test_a_stop_sequence_ends_the_answer_and_is_named(server):
    client = claude(server)
    full = client.messages.create(model="default_model", max_tokens=N, messages=CONVERSATION).content[0].text
    stop = full[8:11]
    out = client.messages.create(model="default_model", max_tokens=N, messages=CONVERSATION,
                                 stop_sequences=["never-there", stop])
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert out.content[0].text == full[: full.index(stop)]
    # Sampling fields the 2.14 client only sends through extra_body.
    again = client.messages.create(model="default_model", max_tokens=N, messages=CONVERSATION,
                                   extra_body={"temperature": 0, "top_k": 5, "top_p": 0.5})
    assert again.content[0].text == full


def test_a_reply_the_context_ends_says_model_context_window_exceeded(server):
    # Anthropic's reason when the context, not max_tokens, ended the reply: max_tokens told the client its own
    # limit was met when the answer had only reached the context.
    client = claude(server)
    context = TINY_CONFIGS["llama"]["max_position_embeddings"]

    def ask(n: int) -> list[dict]:
        return [{"role": "user", "content": "x " * n}]

    one, two = (client.messages.count_tokens(model="default_model", messages=ask(n)).input_tokens for n in (10, 20))
    per = (two - one) // 10
    n = 10 + (context - 4 - one) // per
    room = context - client.messages.count_tokens(model="default_model", messages=ask(n)).input_tokens
    assert 0 < room <= 4 + per
    out = client.messages.create(model="default_model", max_tokens=100, messages=ask(n))
    assert out.usage.output_tokens == room and out.stop_reason == "model_context_window_exceeded", out
    with client.messages.stream(model="default_model", max_tokens=100, messages=ask(n)) as s:
        assert s.get_final_message().stop_reason == "model_context_window_exceeded"
    # A max_tokens the context holds is still what ended the reply.
    assert client.messages.create(model="default_model", max_tokens=room - 1 or 1,
                                  messages=ask(n)).stop_reason == "max_tokens"


def test_a_tool_use_round_trip(tools_server):
    client = claude(tools_server)
    out = client.messages.create(model="default_model", max_tokens=120, messages=TOOL_QUESTION,
                                 tools=[ANTHROPIC_TOOL])
    assert out.stop_reason == "tool_use"
    (use,) = [b for b in out.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id
    with client.messages.stream(model="default_model", max_tokens=120, messages=TOOL_QUESTION,
                                tools=[ANTHROPIC_TOOL]) as s:
        final = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content if b.type == "tool_use"] == \
        [("tool_use", "get_weather", {"city": "Paris"})] and final.stop_reason == "tool_use"
    # The call and its result go back as Anthropic clients send them.
    follow = TOOL_QUESTION + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in out.content]},
                              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                            "content": [{"type": "text", "text": "sunny"}]}]}]
    after = client.messages.create(model="default_model", max_tokens=8, messages=follow, tools=[ANTHROPIC_TOOL])
    assert after.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # It renders as the chat completions conversation with the call and a tool message.
    counted = client.messages.count_tokens(model="default_model", messages=follow, tools=[ANTHROPIC_TOOL])
    call = {"id": use.id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    same = tools_server.client().chat.completions.create(
        model="default_model", max_tokens=1, tools=[WEATHER_TOOL],
        messages=TOOL_QUESTION + [{"role": "assistant", "content": "", "tool_calls": [call]},
                                  {"role": "tool", "tool_call_id": use.id, "content": "sunny"}])
    assert counted.input_tokens == same.usage.prompt_tokens
    # tool_choice none leaves the tools out; any / tool force a call (a grammar over the call format).
    assert client.messages.count_tokens(model="default_model", messages=TOOL_QUESTION, tools=[ANTHROPIC_TOOL],
                                        tool_choice={"type": "none"}).input_tokens == \
        client.messages.count_tokens(model="default_model", messages=TOOL_QUESTION).input_tokens
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        out = client.messages.create(model="default_model", max_tokens=120, messages=TOOL_QUESTION,
                                     tools=[ANTHROPIC_TOOL], tool_choice=choice)
        assert out.stop_reason == "tool_use" and out.content[-1].type == "tool_use", out
        assert out.content[-1].name == "get_weather" and isinstance(out.content[-1].input.get("city"), str)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="default_model", max_tokens=8, messages=TOOL_QUESTION, tools=[ANTHROPIC_TOOL],
                               tool_choice={"type": "tool", "name": "nowhere"})
    assert e.value.body["error"]["message"].startswith("tool_choice:")


def test_thinking_comes_back_in_thinking_blocks(thinker):
    client = claude(thinker)
    messages = [{"role": "user", "content": "Hi there"}]
    want = thinker.client().chat.completions.create(model="default_model", messages=messages, max_tokens=60)
    reasoning, text = want.choices[0].message.model_extra["reasoning"], want.choices[0].message.content
    assert reasoning and text  # this model thinks, then answers, within 60 tokens
    out = client.messages.create(model="default_model", max_tokens=60, messages=messages)
    assert [b.type for b in out.content] == ["thinking", "text"]
    assert out.content[0].thinking == reasoning and out.content[1].text == text
    events = sse(thinker, "/v1/messages", {"model": "default_model", "max_tokens": 60, "messages": messages,
                                           "stream": True}, {})
    streamed = check_anthropic_events(events)
    assert streamed["content"] == out.model_dump(exclude_none=True)["content"]
    # The thinking block goes back in the next turn, as Claude Code sends it; it is left out of the prompt.
    follow = messages + [{"role": "assistant", "content": streamed["content"]}, {"role": "user", "content": "Go on"}]
    plain = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on"}]
    assert client.messages.count_tokens(model="default_model", messages=follow).input_tokens == \
        client.messages.count_tokens(model="default_model", messages=plain).input_tokens

    response = thinker.client().responses.create(model="default_model", input="Hi there", max_output_tokens=60)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == reasoning and response.output_text == text
    final = check_responses_events(sse(thinker, "/v1/responses", {"input": "Hi there", "max_output_tokens": 60,
                                                                  "stream": True}, {}))
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"][0]["text"] == reasoning


BAD = [
    ("malformed JSON", "/v1/messages", b'{"messages": [', 400, "invalid_request_error", None),
    ("no max_tokens", "/v1/messages", {"model": "default_model", "messages": [{"role": "user", "content": "hi"}]},
     400, "invalid_request_error", "max_tokens"),
    ("max_tokens below 0", "/v1/messages", {"model": "default_model", "max_tokens": -1,
                                      "messages": [{"role": "user", "content": "hi"}]},
     400, "invalid_request_error", "max_tokens"),
    ("no messages", "/v1/messages", {"model": "default_model", "max_tokens": 5, "messages": []},
     400, "invalid_request_error", "messages"),
    ("an image", "/v1/messages", {"model": "default_model", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     400, "invalid_request_error", "messages[0].content[0]"),
    ("a document in a tool result", "/v1/messages", {"model": "default_model", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}]},
     400, "invalid_request_error", "messages[0].content[0].content[0]"),
    ("a text block without its text", "/v1/messages", {"model": "default_model", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "text"}]}]}, 400, "invalid_request_error", "messages[0].content[0].text"),
    ("a lone surrogate", "/v1/messages", b'{"model": "default_model", "max_tokens": 5, "messages": [{"role": "user", '
     b'"content": "a \\ud800 b"}]}', 400, "invalid_request_error", "messages[0].content"),
    ("a server tool", "/v1/messages", {"model": "default_model", "max_tokens": 5,
                                       "messages": [{"role": "user", "content": "hi"}],
                                       "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     400, "invalid_request_error", "tools[0]"),
    ("prefill", "/v1/messages", {"model": "default_model", "max_tokens": 5, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]},
     400, "invalid_request_error", "messages[1]"),
    ("temperature over 1", "/v1/messages", {"model": "default_model", "max_tokens": 5, "temperature": 1.5,
                                            "messages": [{"role": "user", "content": "hi"}]},
     400, "invalid_request_error", "temperature"),
    ("structured output", "/v1/messages", {"model": "default_model", "max_tokens": 5,
                                           "messages": [{"role": "user", "content": "hi"}],
                                           "output_config": {"format": {"type": "json_schema", "schema": {}}}},
     400, "invalid_request_error", "output_config.format"),
    ("structured output, the beta's field", "/v1/messages", {
        "model": "default_model", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
        "output_format": {"type": "json_schema", "schema": {"type": "object"}}},
     400, "invalid_request_error", "output_format"),
    ("an unknown thinking type", "/v1/messages", {"model": "default_model", "max_tokens": 5,
                                                  "messages": [{"role": "user", "content": "hi"}],
                                                  "thinking": {"type": "enable"}},
     400, "invalid_request_error", "thinking.type"),
    ("an empty stop sequence", "/v1/messages", {"model": "default_model", "max_tokens": 5, "stop_sequences": ["x", ""],
                                                "messages": [{"role": "user", "content": "hi"}]},
     400, "invalid_request_error", "stop_sequences"),
    ("a tool_use input that is no object", "/v1/messages", {"model": "default_model", "max_tokens": 5, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "f", "input": [1]}]}, {"role": "user", "content": "go"}]},
     400, "invalid_request_error", "messages[1].content[0].input"),
    ("two tools of one name", "/v1/messages", {"model": "default_model", "max_tokens": 5,
                                               "messages": [{"role": "user", "content": "hi"}],
                                               "tools": [ANTHROPIC_TOOL, {**ANTHROPIC_TOOL, "description": "x"}]},
     400, "invalid_request_error", "tools[1].name"),
    ("a tool without a name", "/v1/messages", {"model": "default_model", "max_tokens": 5,
                                               "messages": [{"role": "user", "content": "hi"}],
                                               "tools": [{**ANTHROPIC_TOOL, "name": ""}]},
     400, "invalid_request_error", "tools[0].name"),
    ("tool_choice any without tools", "/v1/messages", {"model": "default_model", "max_tokens": 5,
                                                       "messages": [{"role": "user", "content": "hi"}],
                                                       "tool_choice": {"type": "any"}},
     400, "invalid_request_error", "tool_choice: a tool_choice of type any"),
    ("unknown model", "/v1/messages", {"model": "gpt-4o", "max_tokens": 5,
                                       "messages": [{"role": "user", "content": "hi"}]},
     404, "not_found_error", "model"),
    ("count_tokens without messages", "/v1/messages/count_tokens", {"model": "default_model"},
     400, "invalid_request_error", "messages"),
    ("no such route", "/v1/messages/batches", {}, 404, "not_found_error", None),
    ("too large", "/v1/messages", b"x" * (33 * 2**20), 413, "request_too_large", None),
]


@pytest.mark.parametrize("name,path,body,status,kind,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_4xx_in_anthropics_shape(server, name, path, body, status, kind, param):
    r = server.post(path, body, headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    error = r.json()
    assert set(error) == {"type", "error"} and error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == kind and error["error"]["message"]
    if param is not None:
        assert error["error"]["message"].startswith((f"{param}:", f"{param} ")), error
        assert "[" not in param or error["error"]["message"].count(param) == 1, error  # a path is named once
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_the_client_reads_errors_as_its_own_exceptions(server):
    client = claude(server)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="default_model", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert e.value.status_code == 400 and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="llama-3-70b", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    message = e.value.body["error"]["message"]
    assert e.value.body["error"]["type"] == "not_found_error" and "is not served here" in message
    assert message.startswith("model:") and "GET /v1/models" in message
    with pytest.raises(anthropic.AuthenticationError) as e:
        claude(server, auth_token="wrong").messages.create(model="default_model", max_tokens=5,
                                                           messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    # No key at all: a 401 in Anthropic's shape too.
    r = server.post("/v1/messages/count_tokens", {"model": "default_model",
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_the_clients_api_key_is_a_bearer_token(server):
    # anthropic 2.14 sends api_key as Authorization: Bearer, as it sends auth_token.
    out = claude(server, api_key=KEY).messages.create(model="default_model", max_tokens=2,
                                                       messages=[{"role": "user", "content": "hi"}])
    assert out.content[0].type == "text"


def test_x_api_key_is_accepted_as_well_as_a_bearer_token(server):
    # Claude Code sends ANTHROPIC_API_KEY this way, with no Authorization header.
    body = {"model": "default_model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    r = server.post("/v1/messages", body, headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["type"] == "text"
    wrong = server.post("/v1/messages", body, headers={"x-api-key": "sesam"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    # Both headers (an Anthropic client given a token, left at none, and the key as API key): either will do.
    both = server.post("/v1/messages", body, headers={"authorization": "Bearer none", "x-api-key": KEY})
    assert both.status_code == 200, both.text
    both = server.post("/v1/messages", body, headers={"authorization": f"Bearer {KEY}", "x-api-key": "none"})
    assert both.status_code == 200, both.text
    neither = server.post("/v1/messages", body, headers={"authorization": "Bearer none", "x-api-key": "sesam"})
    assert neither.status_code == 401


def test_a_claude_code_body_gets_well_formed_answers(server):
    body = {
        "model": "default_model", "max_tokens": 16, "temperature": 1,
        "system": [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                    "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "You are an interactive CLI tool that helps users with software "
                                            "engineering tasks.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>As you answer, use the context.</system-reminder>"},
            {"type": "text", "text": "list the files", "cache_control": {"type": "ephemeral"}}]}],
        "tools": [{"name": "Bash", "description": "Executes a bash command.",
                   "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                                    "required": ["command"], "additionalProperties": False,
                                    "$schema": "http://json-schema.org/draft-07/schema#"}},
                  {"name": "Read", "description": "Reads a file.", "cache_control": {"type": "ephemeral"},
                   "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}],
        "metadata": {"user_id": "user_0123_account__session_4567"},
        "thinking": {"type": "disabled"},
        "stream": True,
    }
    headers = {"authorization": f"Bearer {KEY}", "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14", "x-app": "cli"}
    events = sse(server, "/v1/messages?beta=true", body, headers)
    message = check_anthropic_events(events)
    assert events[1][1]["type"] == "ping"
    assert message["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    assert message["usage"]["output_tokens"] <= 16 and message["timings"]["predicted_n"] == \
        message["usage"]["output_tokens"]
    r = server.post("/v1/messages?beta=true", {**body, "stream": False}, headers=headers)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["type"] == "message" and out["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    assert set(out["usage"]) == {"input_tokens", "output_tokens", "cache_creation_input_tokens",
                                 "cache_read_input_tokens"}
    count = server.post("/v1/messages/count_tokens?beta=true",
                        {k: v for k, v in body.items() if k in ("model", "system", "messages", "tools", "thinking")},
                        headers=headers)
    assert count.json()["input_tokens"] == out["usage"]["input_tokens"] + out["usage"]["cache_read_input_tokens"]


def test_anthropic_blocks_become_chat_messages_in_order():
    req = messages_api.MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        "messages": [
            {"role": "user", "content": "Go"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "x"},
                                              {"type": "text", "text": "Calling."},
                                              {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                                              {"type": "tool_use", "id": "t2", "name": "g", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "one"},
                                         {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                                          "content": [{"type": "text", "text": "two"}]},
                                         {"type": "text", "text": "Thanks"}]}],
        "thinking": {"type": "disabled"}, "stop_sequences": ["END"], "some_client_field": {"x": 1}})
    chat = messages_api.to_chat(req)
    got = [(m.role, m.content, m.tool_call_id, [c.id for c in m.tool_calls or []]) for m in chat.messages]
    # A failed call is said in the tool's message: templates have no field for is_error.
    assert got == [("system", "A\nB", None, []), ("user", "Go", None, []), ("assistant", "Calling.", None, ["t1", "t2"]),
                   ("tool", "one", "t1", []), ("tool", "Error: two", "t2", []), ("user", "Thanks", None, [])]
    assert chat.messages[2].tool_calls[0].function.model_dump() == {"name": "f", "arguments": '{"a": 1}'}
    assert chat.chat_template_kwargs == {"enable_thinking": False} and chat.stop == ["END"]


# --- the Responses API ---------------------------------------------------------------------


def test_responses_answer_what_chat_completions_answers(server):
    client = server.client(api_key=KEY)
    want = chat(server, [{"role": "system", "content": SYSTEM}, *CONVERSATION])
    text = want.choices[0].message.content
    items = [{"role": m["role"], "content": m["content"]} for m in CONVERSATION]
    out = client.responses.create(model="default_model", instructions=SYSTEM, input=items, max_output_tokens=N)
    assert out.object == "response" and out.id.startswith("resp_") and out.output_text == text
    assert [item.type for item in out.output] == ["message"] and out.output[0].content[0].type == "output_text"
    if want.choices[0].finish_reason == "length":
        assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    else:
        assert out.status == "completed" and out.incomplete_details is None
    assert out.usage.input_tokens == want.usage.prompt_tokens
    assert out.usage.output_tokens == want.usage.completion_tokens
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    assert out.model_extra["timings"]["predicted_n"] == out.usage.output_tokens

    events = list(client.responses.create(model="default_model", instructions=SYSTEM, input=items,
                                          max_output_tokens=N, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if out.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].response.output[0].content[0].text == text
    # A string input is one user message.
    one = client.responses.create(model="default_model", input="Tell me about the fox.", max_output_tokens=N)
    assert one.output_text == chat(server, CONVERSATION[:1]).choices[0].message.content


def test_responses_function_call_round_trip(tools_server):
    client = tools_server.client()
    out = client.responses.create(model="default_model", input=TOOL_QUESTION, tools=[RESPONSES_TOOL],
                                  max_output_tokens=120)
    (call,) = out.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert json.loads(call.arguments) == {"city": "Paris"} and out.status == "completed"
    events = list(client.responses.create(model="default_model", input=TOOL_QUESTION, tools=[RESPONSES_TOOL],
                                          max_output_tokens=120, stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert json.loads(events[4].arguments) == {"city": "Paris"}
    # The call and its output go back in the next request (stateless: the whole conversation).
    follow = TOOL_QUESTION + [call.model_dump(exclude_none=True),
                              {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    after = client.responses.create(model="default_model", input=follow, tools=[RESPONSES_TOOL],
                                    max_output_tokens=8)
    assert after.status in ("completed", "incomplete")
    same = client.chat.completions.create(
        model="default_model", max_tokens=1, tools=[WEATHER_TOOL],
        messages=TOOL_QUESTION + [{"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}])
    assert after.usage.input_tokens == same.usage.prompt_tokens


REFUSED = [
    ("previous_response_id", {"input": "hi", "previous_response_id": "resp_123"}, "previous_response_id"),
    ("store", {"input": "hi", "store": True}, "store"),
    ("conversation", {"input": "hi", "conversation": "conv_1"}, "conversation"),
    ("an image", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "input[0].content[0]"),
    ("a text part without its text", {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "input[0].content[0].text"),
    ("a refusal part without its refusal", {"input": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "refusal"}]},
        {"role": "user", "content": "again"}]}, "input[1].content[0].refusal"),
    ("a message without content", {"input": [{"role": "user"}]}, "input[0].content"),
    ("a function_call_output without output", {"input": [
        {"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c"}]}, "input[2].output"),
    ("a tool_choice of a hosted tool", {"input": "hi", "tools": [RESPONSES_TOOL],
                                        "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ("an unknown text format", {"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ("an item reference", {"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ("no input", {"model": "default_model"}, "input"),
    ("an empty input", {"input": []}, "input"),
]


@pytest.mark.parametrize("name,body,param", REFUSED, ids=[r[0] for r in REFUSED])
def test_responses_refusals_are_400s_in_openais_shape(server, name, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        server.client(api_key=KEY).responses.create(**{"model": "default_model", **body})
    error = e.value.body
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    if name in ("previous_response_id", "store", "conversation"):
        assert "keeps no state" in error["message"]


def test_a_codex_body_gets_well_formed_answers(server):
    body = {
        "model": "default_model",
        "instructions": "You are Codex, based on GPT-5. You are running as a coding agent in the Codex CLI.",
        "input": [
            {"type": "message", "role": "developer", "content": [
                {"type": "input_text", "text": "<permissions instructions>sandbox: workspace-write</permissions "
                                               "instructions>"}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "<environment_context><cwd>/tmp</cwd></environment_context>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list the files"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": None, "encrypted_content": None},
            {"type": "function_call", "name": "shell", "arguments": '{"command":["ls"]}', "call_id": "call_1"},
            {"type": "function_call_output", "call_id": "call_1", "output": "README.md\nsrc"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Two entries."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "thanks"}]},
        ],
        "tools": [{"type": "function", "name": "shell", "description": "Runs a shell command.", "strict": False,
                   "parameters": {"type": "object", "properties": {"command": {"type": "array",
                                                                               "items": {"type": "string"}}},
                                  "required": ["command"], "additionalProperties": False}}],
        "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"}, "store": False, "stream": True,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0199-session",
        "text": {"verbosity": "medium"}, "max_output_tokens": 16,
    }
    headers = {"authorization": f"Bearer {KEY}", "originator": "codex_cli_rs", "session_id": "0199-session"}
    final = check_responses_events(sse(server, "/v1/responses", body, headers))
    assert final["status"] in ("completed", "incomplete") and final["usage"]["output_tokens"] <= 16
    assert final["store"] is False and final["parallel_tool_calls"] is False
    r = server.post("/v1/responses", {**body, "stream": False}, headers=headers)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "response" and out["status"] in ("completed", "incomplete")
    assert all(item["type"] in ("message", "function_call", "reasoning") for item in out["output"])
    assert set(out["usage"]) == {"input_tokens", "input_tokens_details", "output_tokens", "output_tokens_details",
                                 "total_tokens"}


def test_a_failure_after_the_answer_started_is_an_event_in_each_dialect():
    error = ApiError(503, "the server is shutting down")
    message = messages_api.MessageShape("m", 3, timings=lambda reply: {})
    message.start()
    message.piece(Piece(content="Hi"))
    assert message.failed(error) == [{"type": "error", "error": {"type": "overloaded_error",
                                                                  "message": "the server is shutting down"}}]
    shape = responses_api.ResponseShape(responses_api.ResponsesRequest.model_validate({"input": "hi"}), "m",
                                        timings=lambda reply: {})
    events = shape.start() + shape.piece(Piece(content="Hi")) + shape.failed(error)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    last = events[-1]
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
    assert last["response"]["error"] == {"code": "server_error", "message": "the server is shutting down"}
    assert last["response"]["output"][0]["status"] == "incomplete"


# --- what the real agents send (tests/serve/test_agents.py runs the agents themselves) -----------------


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK warns of retired Anthropic names
@pytest.mark.parametrize("name", ["claude-sonnet-4-5", "claude-opus-4-1-20250805", "claude-haiku-4-5"])
def test_claude_model_names_are_the_served_model(server, name):
    # Claude Code's sub-agents and /model ask for Anthropic's models by name: one model answers them all.
    out = claude(server).messages.create(model=name, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert out.content[0].type == "text"
    assert claude(server).messages.count_tokens(model=name, messages=[{"role": "user", "content": "hi"}]).input_tokens


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_anthropic_client_finds_a_claude_model_it_may_ask_for(server):
    # /v1/messages serves every claude-* name, so the model lookup of one must not be a 404.
    client = claude(server)
    found = client.models.retrieve("claude-sonnet-4-5")
    assert found.type == "model" and found.id == str(server.args[1]) and found.display_name and found.created_at
    listed = client.models.list().data
    assert [m.id for m in listed] == [found.id] and listed[0].type == "model"
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("gpt-9")


BILLING = "x-anthropic-billing-header: cc_version=2.1.328.b7f; cc_entrypoint=cli; cch={};"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_claude_codes_billing_line_never_reaches_the_prompt(server):
    client = claude(server)
    system = [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude. " * 8,
               "cache_control": {"type": "ephemeral"}}]
    messages = [{"role": "user", "content": "list the files"}]
    without = client.messages.count_tokens(model="claude-sonnet-4-5", system=system, messages=messages).input_tokens
    for cch in ("1a2b3", "9f8e7"):  # interactive use: a new value per request
        for line in ([{"type": "text", "text": BILLING.format(cch)}], [{"type": "text", "text": BILLING.format(cch)
                                                                        + "\n" + system[0]["text"]}]):
            shaped = line + system if len(line[0]["text"]) < 100 else line
            assert client.messages.count_tokens(model="claude-sonnet-4-5", system=shaped,
                                                messages=messages).input_tokens == without
    # Two requests that differ only in the line: the second's prompt comes from the prompt cache.
    first = client.messages.create(model="claude-sonnet-4-5", max_tokens=2, messages=messages,
                                   system=[{"type": "text", "text": BILLING.format("aaaaa")}] + system)
    second = client.messages.create(model="claude-sonnet-4-5", max_tokens=2, messages=messages,
                                    system=[{"type": "text", "text": BILLING.format("bbbbb")}] + system)
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == total == without
    assert second.usage.cache_read_input_tokens >= total - 8, second.usage


def test_a_claude_code_turn_with_its_later_system_message_and_adaptive_thinking(server):
    # Claude Code 2.1.328 as captured: a system message after the first user message, adaptive thinking,
    # context management, an effort; the last message is that system message.
    body = {"model": "claude-sonnet-4-5", "max_tokens": 32000, "stream": True,
            "system": [{"type": "text", "text": BILLING.format("0")},
                       {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "<system-reminder>x</system-reminder>"},
                                                      {"type": "text", "text": "Say hello."}]},
                         {"role": "system", "content": [{"type": "text", "text": "# Environment\ncwd: /tmp"}]}],
            "thinking": {"type": "adaptive", "display": "omitted"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"}, "metadata": {"user_id": "{\"session_id\": \"s\"}"}}
    headers = {"authorization": f"Bearer {KEY}", "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,context-management-2025-06-27,effort-2025-11-24"}
    message = check_anthropic_events(sse(server, "/v1/messages?beta=true", {**body, "max_tokens": 4}, headers))
    assert message["stop_reason"] in ("end_turn", "max_tokens")


def test_bursts_of_count_tokens_are_answered_while_an_answer_streams(server):
    # Claude Code counts tokens in bursts; counting renders the prompt off the generation thread.
    import concurrent.futures

    body = {"model": "default_model", "messages": [{"role": "user", "content": "Count me " * 50}]}
    headers = {"authorization": f"Bearer {KEY}"}
    want = server.post("/v1/messages/count_tokens", body, headers=headers).json()["input_tokens"]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        long = pool.submit(lambda: claude(server).messages.create(
            model="default_model", max_tokens=200, messages=[{"role": "user", "content": "Tell a long story."}]))
        counts = list(pool.map(lambda _: server.post("/v1/messages/count_tokens", body, headers=headers), range(40)))
        assert long.result().usage.output_tokens > 0
    assert [r.status_code for r in counts] == [200] * 40
    assert {r.json()["input_tokens"] for r in counts} == {want}


def test_errors_name_the_field_the_client_sent(server):
    headers = {"authorization": f"Bearer {KEY}"}
    r = server.post("/v1/messages", {"model": "default_model", "max_tokens": 2, "system": "bad \ud800 text",
                                     "messages": [{"role": "user", "content": "hi"}]}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("system:"), r.text
    r = server.post("/v1/messages", {"model": "default_model", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "x\udc00"}]}]}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages[2]"), r.text
    r = server.post("/v1/responses", {"model": "default_model", "input": [
        {"role": "user", "content": "hi"}, {"role": "user", "content": "x\ud800"}]}, headers=headers)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"].startswith("input[1]"), r.text
    for answer in (r.text,):
        assert "Value error" not in answer
    # A wrong type deep in the input: that field, never the union branch pydantic tried first ("input.str").
    for body, param in (({"input": [{"role": "user", "content": 5}]}, "input[0].content"), ({"input": 5}, "input"),
                        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]},
                         "input[0].arguments")):
        r = server.post("/v1/responses", {"model": "default_model", **body}, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "description": "Runs a command.", "strict": False,
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
    {"type": "namespace", "name": "weather", "description": "Weather tools.",
     "tools": [{"type": "function", "name": "get_weather", "description": WEATHER["description"], "strict": False,
                "parameters": WEATHER["parameters"]}]},
    {"type": "web_search", "external_web_access": False},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
]


def test_codex_tools_are_served_namespaced_and_hosted_ones_left_out():
    req = responses_api.ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": CODEX_TOOLS + [
        {"type": "custom", "name": "apply_patch", "description": "Edit files.",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: \"*** Begin Patch\" /(.|\\n)*/"}}]})
    chat_req = responses_api.to_chat(req)
    names = [t["function"]["name"] for t in chat_req.tools]
    assert names == ["exec_command", "get_weather", "apply_patch"]
    custom = chat_req.tools[2]["function"]["parameters"]
    assert custom["required"] == ["input"] and "*** Begin Patch" in custom["properties"]["input"]["description"]
    routes = responses_api.routes(req)
    assert routes["weather.get_weather"] == routes["get_weather"] == responses_api.Route("function", "get_weather",
                                                                                          "weather")
    assert routes["apply_patch"].kind == "custom"
    # Two namespaces with one function name: each is offered qualified.
    twice = responses_api.ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": [
        {"type": "namespace", "name": ns, "tools": [{"type": "function", "name": "close", "parameters": {}}]}
        for ns in ("a", "b")]})
    assert [t["function"]["name"] for t in responses_api.to_chat(twice).tools] == ["a.close", "b.close"]


CLASH = [{"type": "namespace", "name": "a", "tools": [{"type": "function", "name": "f", "parameters": {}}]},
         {"type": "function", "name": "f", "parameters": {}}, {"type": "function", "name": "a.f", "parameters": {}}]


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 0, 2)])
def test_a_namespaced_name_that_another_tool_has_is_made_unique(order):
    # Namespace a's f, a plain f and a plain a.f: the qualified name is taken too (it was a KeyError: a 500).
    tools = [CLASH[i] for i in order]
    req = responses_api.ResponsesRequest.model_validate({"model": "m", "input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "namespace": "a", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "a.f", "arguments": "{}"}], "tools": tools})
    chat_req = responses_api.to_chat(req)
    names = [t["function"]["name"] for t in chat_req.tools]
    assert sorted(names) == ["a.f", "a.f_2", "f"] and len(set(names)) == 3
    routes = responses_api.routes(req)
    assert routes["a.f_2"] == responses_api.Route("function", "f", "a")
    assert routes["a.f"] == responses_api.Route("function", "a.f") and routes["f"] == responses_api.Route("function", "f")
    # The calls sent back name what the model was shown for each.
    (calls,) = [m.tool_calls for m in chat_req.messages if m.tool_calls]
    assert [c.function.name for c in calls] == ["a.f_2", "a.f"]


def test_a_namespaced_call_goes_back_with_its_namespace(tools_server):
    # Offered by its own name (no other tool has it), called so: the answer names the namespace Codex routes by.
    client = tools_server.client()
    out = client.responses.create(model="default_model", input=TOOL_QUESTION, tools=CODEX_TOOLS[1:],
                                  max_output_tokens=120)
    (call,) = out.output
    assert call.type == "function_call" and call.name == "get_weather" and call.model_dump()["namespace"] == "weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and out.status == "completed"
    # Codex sends it back with its namespace: the same prompt as the bare call under a flat tool.
    follow = TOOL_QUESTION + [call.model_dump(exclude_none=True),
                              {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    after = client.responses.create(model="default_model", input=follow, tools=CODEX_TOOLS[1:], max_output_tokens=1)
    assert after.usage.input_tokens > out.usage.input_tokens
    # A namespaced name every other spelling of which another tool holds is served too (it was a 500).
    clash = client.responses.create(model="default_model", input="hi", tools=CLASH, max_output_tokens=1)
    assert clash.usage.input_tokens > 0


def test_a_custom_tool_call_is_answered_as_custom_tool_call():
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
    tool = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
            "format": {"type": "grammar", "syntax": "lark", "definition": "start: /(.|\\n)+/"}}
    req = responses_api.ResponsesRequest.model_validate({"model": "m", "input": "edit", "tools": [tool],
                                                         "stream": True})
    shape = responses_api.ResponseShape(req, "m", timings=lambda reply: {})
    call = {"id": "call_1", "type": "function",
            "function": {"name": "apply_patch", "arguments": json.dumps({"input": patch})}}
    events = shape.start() + shape.piece(Piece(content="Editing.", tool_calls=[call]))
    kinds = [e["type"] for e in events]
    assert kinds[-4:] == ["response.output_item.added", "response.custom_tool_call_input.delta",
                          "response.custom_tool_call_input.done", "response.output_item.done"]
    item = events[-1]["item"]
    assert item == {"id": item["id"], "type": "custom_tool_call", "status": "completed", "call_id": "call_1",
                    "name": "apply_patch", "input": patch}
    assert events[-2]["input"] == patch and events[-3]["delta"] == patch
    # Codex sends the call and its output back: the model sees the call it made, as a JSON argument.
    back = responses_api.ResponsesRequest.model_validate({"model": "m", "tools": [tool], "input": [
        {"role": "user", "content": "edit"}, item,
        {"type": "custom_tool_call_output", "call_id": "call_1", "output": "Done!"}]})
    messages = responses_api.to_chat(back).messages
    assert [m.role for m in messages] == ["user", "assistant", "tool"]
    assert messages[1].tool_calls[0].function.name == "apply_patch"
    assert json.loads(messages[1].tool_calls[0].function.arguments) == {"input": patch}
    assert messages[2].content == "Done!" and messages[2].tool_call_id == "call_1"


def test_without_max_output_tokens_a_response_runs_to_its_end(tmp_path):
    # Codex sets no limit: the answer runs to end-of-sequence (or the context), not the server's --max-tokens.
    from agents import ANSWER, hello_model_dir

    started = Server("--model", hello_model_dir(tmp_path / "m", "qwen3_5"), "--max-tokens", "1")
    try:
        client = started.client()
        out = client.responses.create(model="default_model", input="Say hello.")
        assert out.status == "completed" and out.output_text == ANSWER
        cut = client.chat.completions.create(model="default_model", messages=[{"role": "user", "content": "Hi"}])
        assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 1
    finally:
        started.stop()


def test_a_responses_stream_keeps_a_waiting_client_alive_with_events():
    # Codex's idle timeout counts events, not SSE comment lines: a long prefill sends response.in_progress.
    shape = responses_api.ResponseShape(responses_api.ResponsesRequest.model_validate({"input": "hi"}), "m",
                                        timings=lambda reply: {})
    events = shape.start() + [shape.keepalive(), shape.keepalive()] + shape.piece(Piece(content="Hi"))
    assert [e["type"] for e in events[:4]] == ["response.created"] + ["response.in_progress"] * 3
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[3]["response"]["status"] == "in_progress" and events[3]["response"]["id"] == shape.id


def test_text_between_two_calls_keeps_its_place(tmp_path):
    from server import tools_tokenizer
    from specdec_cli.session.reply import TextStream

    tokenizer = tools_tokenizer(tmp_path)
    written = ('First.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
               'Then.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    stream = TextStream(tokenizer, tools=[WEATHER_TOOL])
    piece = stream.add(tokenizer.encode(written, add_special_tokens=False))
    end = stream.finish()
    parts = piece.in_order() + end.in_order()
    assert [k for k, _ in parts] == ["content", "call", "content", "call"], parts
    # Anthropic: blocks in that order (once put every text before the calls).
    shape = messages_api.MessageShape("m", 3, timings=lambda reply: {})
    events = shape.piece(piece) + shape.piece(end)
    blocks = [(b["type"], b.get("text") or b.get("input", {}).get("city")) for b in shape.blocks]
    assert blocks == [("text", "First."), ("tool_use", "Paris"), ("text", "Then."), ("tool_use", "Rome")]
    assert [e["index"] for e in events if e["type"] == "content_block_start"] == [0, 1, 2, 3]
    # Responses: items in that order.
    shape = responses_api.ResponseShape(responses_api.ResponsesRequest.model_validate({"input": "hi"}), "m",
                                        timings=lambda reply: {})
    shape.piece(piece)
    shape.piece(end)
    assert [item["type"] for item in shape.output] == ["message", "function_call", "message", "function_call"]


def test_responses_logprobs_do_not_split_parallel_calls(tmp_path):
    """With log-probabilities asked for, a call's tokens and the newline between Hermes-style calls (no text) once
    opened an empty message item before each call: sent back, the calls rendered as separate assistant turns."""
    from server import tools_tokenizer
    from specdec_cli.session.reply import TextStream

    tokenizer = tools_tokenizer(tmp_path)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
    for written, items in [(call % "Paris" + "\n" + call % "Rome", ["function_call", "function_call"]),
                           ("Sure." + call % "Paris" + "\nDone.", ["message", "function_call", "message"])]:
        req = responses_api.ResponsesRequest.model_validate({"input": "hi",
                                                             "include": ["message.output_text.logprobs"]})
        shape = responses_api.ResponseShape(req, "m", timings=lambda reply: {}, logprobs=lambda got: [
            {"token": str(t), "logprob": lp, "bytes": [], "top_logprobs": []} for t, lp, _ in got])
        stream = TextStream(tokenizer, tools=[WEATHER_TOOL])
        ids = tokenizer.encode(written, add_special_tokens=False)
        for t in ids:  # one token a piece, as a stream meets them
            piece = stream.add([t])
            piece.logprobs = [(t, -1.0, ())]
            shape.piece(piece)
        shape.piece(stream.finish())
        assert [item["type"] for item in shape.output] == items, written
        # Every token's log-probability goes to the message that follows it, when one does.
        texts = [item["content"][0] for item in shape.output if item["type"] == "message"]
        if texts:
            assert sum(len(part["logprobs"]) for part in texts) == len(ids)


def test_consecutive_assistant_messages_are_one_turn(tmp_path):
    # Anthropic joins consecutive turns of one role; two assistant messages in a row went to the template as two
    # turns, and strict templates (Mistral's, Gemma's) refuse that: a 400 where Anthropic answers.
    from agents import template
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from specdec_cli.model.bundled import model_dir
    from specdec_cli.model.prompts import render_messages
    from specdec_cli.serve.protocol import chat_messages

    req = messages_api.MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "Go"}, {"role": "assistant", "content": "Looking."},
        {"role": "assistant", "content": [{"type": "text", "text": "Calling."},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "g", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "one"},
                                     {"type": "tool_result", "tool_use_id": "t2", "content": "two"}]},
        {"role": "assistant", "content": "Done."}, {"role": "assistant", "content": "Anything else?"},
        {"role": "user", "content": "No"}]})
    chat = messages_api.to_chat(req)
    got = [(m.role, m.content, [c.id for c in m.tool_calls or []]) for m in chat.messages]
    assert got == [("user", "Go", []), ("assistant", "Looking.\nCalling.", ["t1", "t2"]), ("tool", "one", []),
                   ("tool", "two", []), ("assistant", "Done.\nAnything else?", []), ("user", "No", [])]
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir() / f, tmp_path / f)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template("mistral")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    plain = messages_api.to_chat(messages_api.MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"},
                                                    *req.model_dump(exclude_none=True)["messages"][5:]]}))
    assert render_messages(load_tokenizer(tmp_path), chat_messages(plain)).ids  # Mistral's template takes it


def test_anthropic_errors_name_the_block_list_at_fault_once():
    """A user message with no blocks vanished in translation (alone, it was refused as an empty "messages"), and a
    named tool_choice without its name said its field twice ("tool_choice.name: tool_choice: ...")."""
    def refused(body: dict) -> str:
        req = messages_api.MessagesRequest.model_validate({"model": "m", "max_tokens": 5, **body})
        with pytest.raises(ApiError) as e:
            messages_api.to_chat(req)
        answer = json.dumps({"error": {"message": e.value.message, "param": e.value.param}}).encode()
        return json.loads(messages_api.from_openai_error(400, answer))["error"]["message"]

    hello = [{"role": "user", "content": "Hi"}]
    assert refused({"messages": [{"role": "user", "content": []}]}).startswith("messages[0].content: ")
    assert refused({"messages": [*hello, {"role": "assistant", "content": "Yes"},
                                 {"role": "user", "content": []}]}).startswith("messages[2].content: ")
    message = refused({"messages": hello, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                       "tool_choice": {"type": "tool"}})
    assert message.startswith("tool_choice.name: ") and message.count("tool_choice") == 2, message  # its own words
    # A tool_use block in a user message is in the wrong turn: it was said to be unsupported by this server.
    message = refused({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                                  "input": {}}]}]})
    assert message.startswith("messages[0].content[0]: tool_use blocks belong in assistant messages"), message


def test_responses_errors_about_text_format_name_no_chat_field():
    # Checked as chat's response_format, the messages named it (and json_schema.schema) to a client that sent
    # text.format: the param was translated, the words were not.
    for message, param in (("response_format of type json_schema needs json_schema.schema, a JSON schema object",
                            "response_format.json_schema.schema"),
                           ("response_format json_schema cannot be used: it cannot be compiled to a grammar (x)",
                            "response_format.json_schema.schema"),
                           ("a forced tool call and a response_format cannot both constrain the answer: drop one",
                            "response_format")):
        e = responses_api.client_error(ApiError(400, message, param))
        assert "response_format" not in e.message and "json_schema.schema" not in e.message, e.message
        assert e.param.startswith("text.format") and "text.format" in e.message, e.message
