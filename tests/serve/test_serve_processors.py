"""``specdec serve`` with log-probabilities, penalties, logit_bias and structured output, through the openai client.

The oracle on the server is the same request with ``num_draft_tokens: 0``
(one token per forward: plain decoding through the same engine and the same
processors); the engine-level tests (test_processors.py) hold plain decoding
itself against speculation.
"""

from __future__ import annotations

import codecs
import itertools
import json
from typing import Optional

import openai
import pytest
from pydantic import BaseModel, Field

from server import TOOL_QUESTION, WEATHER_TOOL, Server, tool_model_dir
from specdec_cli.session.synthetic import make_model_dir

COPY = [{"role": "user", "content": "Copy this: the quick brown fox jumps over the lazy dog, and the quick brown fox."}]
N = 40
PLAIN = {"num_draft_tokens": 0}
# The tool the tools model was trained on, its argument bounded (a forced call on another question ends).
BOUNDED_TOOL = {"type": "function", "function": {**WEATHER_TOOL["function"], "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = Server("--model", make_model_dir(tmp_path_factory.mktemp("m") / "llama", "llama", seed=0),
                     "--drafter", "lookup")
    yield started
    started.stop()


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    # A GatedDeltaNet hybrid, a draft model of its own kind (a noisy copy): partial accepts, every block.
    root = tmp_path_factory.mktemp("h")
    started = Server("--model", make_model_dir(root / "t", "qwen3_5", seed=0),
                     "--draft-model", make_model_dir(root / "d", "qwen3_5", seed=0, noise=0.05))
    yield started
    started.stop()


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory):
    started = Server("--model", tool_model_dir(tmp_path_factory.mktemp("tools") / "m"))
    yield started
    started.stop()


def chat(server: Server, extra: Optional[dict] = None, **kw):
    return server.client().chat.completions.create(model="default_model", messages=kw.pop("messages", COPY),
                                                   max_tokens=kw.pop("max_tokens", N), extra_body=extra, **kw)


def entries(out) -> list[tuple]:
    return [(c.token, c.logprob, tuple(c.bytes), tuple((t.token, t.logprob) for t in c.top_logprobs))
            for c in out.choices[0].logprobs.content]


@pytest.mark.parametrize("which", ["server", "hybrid"])
def test_chat_logprobs_are_plain_decodings(request, which):
    server = request.getfixturevalue(which)
    out = chat(server, logprobs=True, top_logprobs=3)
    ref = chat(server, PLAIN, logprobs=True, top_logprobs=3)
    assert out.choices[0].message.content == ref.choices[0].message.content
    got = entries(out)
    assert got == entries(ref) and len(got) == out.usage.completion_tokens
    for token, logprob, raw, top in got:
        assert logprob <= 0 and len(top) == 3 and top == tuple(sorted(top, key=lambda t: -t[1]))
        assert top[0][1] >= logprob and token.encode() == bytes(raw) or "\ufffd" in token
    assert out.model_extra["timings"]["draft_n"] > 0
    # The text is the tokens' bytes (a random model writes some that are not UTF-8: then it shows U+FFFD).
    content = out.choices[0].message.content
    if "\ufffd" not in content:
        assert b"".join(bytes(e[2]) for e in got) == content.encode()
    # Without top_logprobs: the chosen token's alone. Without logprobs: null.
    only = chat(server, logprobs=True)
    assert [(e[0], e[1]) for e in entries(only)] == [(e[0], e[1]) for e in got]
    assert all(not c.top_logprobs for c in only.choices[0].logprobs.content)
    assert chat(server).choices[0].logprobs is None


def test_streamed_chunks_carry_their_tokens_logprobs(server):
    whole = chat(server, logprobs=True, top_logprobs=2)
    stream = chat(server, logprobs=True, top_logprobs=2, stream=True)
    items, text = [], ""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            items += [(c.token, c.logprob) for c in chunk.choices[0].logprobs.content]
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    assert text == whole.choices[0].message.content
    assert items == [(e[0], e[1]) for e in entries(whole)]


def test_a_text_completion_with_logprobs(server):
    client = server.client()
    out = client.completions.create(model="default_model", prompt="the quick brown fox jumps over the", max_tokens=12,
                                    logprobs=2)
    ref = client.completions.create(model="default_model", prompt="the quick brown fox jumps over the", max_tokens=12,
                                    logprobs=2, extra_body=PLAIN)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    # The tiny model's byte tokens: one that is part of a character is named by its bytes (bytes:\\xNN) and starts
    # where its character does.
    raw = [bytes.fromhex(t[len("bytes:"):].replace("\\x", "")) if t.startswith("bytes:") else t.encode()
           for t in lp.tokens]
    assert b"".join(raw).decode("utf-8", "replace") == out.choices[0].text
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    assert lp.text_offset == list(itertools.accumulate((len(decoder.decode(r)) for r in raw[:-1]), initial=0))
    assert all(len(top) <= 2 and max(top.values()) >= v for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert (lp.tokens, lp.token_logprobs) == (ref.choices[0].logprobs.tokens, ref.choices[0].logprobs.token_logprobs)
    assert client.completions.create(model="default_model", prompt="hi", max_tokens=3).choices[0].logprobs is None


@pytest.mark.parametrize("which", ["server", "hybrid"])
def test_penalties_and_logit_bias_are_lossless(request, which):
    server = request.getfixturevalue(which)
    controls = {"presence_penalty": 0.6, "frequency_penalty": 0.4, "logit_bias": {"101": 2.0, "32": -1.0}}
    extra = {"repetition_penalty": 1.2, "repetition_context_size": 16}
    out = chat(server, extra, **controls)
    ref = chat(server, {**extra, **PLAIN}, **controls)
    plain = chat(server)
    assert out.choices[0].message.content == ref.choices[0].message.content
    assert out.choices[0].message.content != plain.choices[0].message.content  # they did something
    # Ollama's name for the same penalty gives the same text.
    ollama = chat(server, {"repeat_penalty": 1.2, "repeat_last_n": 16}, **controls)
    assert ollama.choices[0].message.content == out.choices[0].message.content
    # A strong bias makes a token the answer; nothing a request sets reaches the next one.
    x = chat(server, max_tokens=5, logit_bias={"120": 100})
    assert x.choices[0].message.content == "xxxxx"
    assert chat(server).choices[0].message.content == plain.choices[0].message.content


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=99)
    member: bool


@pytest.mark.parametrize("which", ["server", "hybrid"])
def test_a_json_schema_answer_parses_and_validates(request, which):
    server = request.getfixturevalue(which)
    client = server.client()
    out = client.chat.completions.parse(model="default_model", messages=COPY, max_tokens=120, response_format=Person)
    ref = client.chat.completions.parse(model="default_model", messages=COPY, max_tokens=120, response_format=Person,
                                        extra_body=PLAIN)
    assert out.choices[0].finish_reason == "stop"
    person = out.choices[0].message.parsed
    assert isinstance(person, Person), out.choices[0].message.content
    assert out.choices[0].message.content == ref.choices[0].message.content
    # Sampled, seeded: each answer parses and validates too.
    for seed in range(4):
        sampled = client.chat.completions.parse(model="default_model", messages=COPY, max_tokens=120, seed=seed,
                                                temperature=1.0, response_format=Person)
        assert isinstance(sampled.choices[0].message.parsed, Person)
    # json_object: any JSON object.
    obj = chat(server, max_tokens=200, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_the_responses_api_takes_a_text_format_and_returns_logprobs(server):
    client = server.client()
    schema = {**Person.model_json_schema(), "additionalProperties": False}
    out = client.responses.create(model="default_model", input=COPY[0]["content"], max_output_tokens=120,
                                  text={"format": {"type": "json_schema", "name": "person", "schema": schema}},
                                  include=["message.output_text.logprobs"], top_logprobs=2)
    Person.model_validate_json(out.output_text)
    part = out.output[0].content[0]
    # Where the grammar leaves one token, it is the only alternative and certain.
    assert len(part.logprobs) > 0 and all(1 <= len(lp.top_logprobs) <= 2 for lp in part.logprobs)
    assert part.logprobs[0].token == "{" and part.logprobs[0].logprob == 0.0
    assert "".join(lp.token for lp in part.logprobs) == out.output_text


def test_a_forced_tool_call(tools_server):
    client = tools_server.client()
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        out = client.chat.completions.create(model="default_model", messages=[{"role": "user", "content": "Hello"}],
                                             tools=[BOUNDED_TOOL], tool_choice=choice, max_tokens=120)
        assert out.choices[0].finish_reason == "tool_calls", out.choices[0].message
        (call,) = out.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    # The model's own answer to the question is that call: forcing it changes nothing there.
    free = client.chat.completions.create(model="default_model", messages=TOOL_QUESTION, tools=[WEATHER_TOOL],
                                          max_tokens=120)
    forced = client.chat.completions.create(model="default_model", messages=TOOL_QUESTION, tools=[WEATHER_TOOL],
                                            tool_choice="required", max_tokens=120)
    assert forced.choices[0].message.tool_calls[0].function.arguments == \
        free.choices[0].message.tool_calls[0].function.arguments
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default_model", messages=TOOL_QUESTION, tools=[WEATHER_TOOL],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"


def test_a_forced_call_on_a_model_without_a_tool_format_is_a_400(server):
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, tools=[WEATHER_TOOL], tool_choice="required")
    assert e.value.body["param"] == "tool_choice" and "tool-call format" in e.value.body["message"]
