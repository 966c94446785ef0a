"""``specdec serve`` as a client sees it: a real server process, the official openai client, a real socket."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from typer.testing import CliRunner

from server import TOOL_QUESTION, WEATHER_TOOL, Server, env, tool_model_dir
from specdec_cli.cli.app import app
from specdec_cli.session.synthetic import TINY_CONFIGS, make_model_dir

FAMILIES = ["llama", "qwen3_5", "gemma3_text"]
QUESTION = "Copy this: the quick brown fox jumps over the lazy dog, and the quick brown fox runs."
N = 40
ERROR_KEYS = {"message", "type", "param", "code"}


# Long generations (plain decoding, past EOS) that no machine finishes before the test has looked:
# 50,000 one-token forwards of a tiny model take a minute at the least.
LONG = {"max_tokens": 50_000, "stream": True}
LONG_EXTRA = {"num_draft_tokens": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    out = {f: make_model_dir(root / f, f, seed=0) for f in FAMILIES}
    out["long"] = make_model_dir(root / "long", {**TINY_CONFIGS["llama"], "max_position_embeddings": 1 << 17})
    return out


@pytest.fixture(scope="module")
def long_server(dirs):
    server = Server("--model", dirs["long"])
    yield server
    server.stop()


def long_stream(server: Server):
    """A streamed request that runs until it is cancelled, once its first token has come."""
    stream = server.client().chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": "Go"}], extra_body=LONG_EXTRA, **LONG)
    chunks = iter(stream)
    while not any(c.delta.content for c in next(chunks).choices):
        pass
    return stream


@pytest.fixture(scope="module")
def servers(dirs):
    started = {f: Server("--model", dirs[f]) for f in FAMILIES}
    yield started
    for s in started.values():
        s.stop()


def generate(*args) -> dict:
    """``specdec generate --json --compare-ar`` in this process: the text and the proof it is plain decoding's."""
    result = CliRunner().invoke(app, ["generate", "--json", "--compare-ar", "-m", str(N), *map(str, args)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["compare"]["identical"], report["compare"]
    return report


def chat_text(client, messages, **kw) -> tuple[str, object]:
    out = client.chat.completions.create(model=kw.pop("model", "default_model"), messages=messages,
                                         max_tokens=kw.pop("max_tokens", N), **kw)
    return out.choices[0].message.content, out


def streamed(client, kind: str, **kw) -> tuple[str, list]:
    """Text and chunks of a streamed request (chat or text completion)."""
    make = client.chat.completions.create if kind == "chat" else client.completions.create
    chunks = list(make(model="default_model", stream=True, **kw))
    if kind == "chat":
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = "".join(c.choices[0].text or "" for c in chunks if c.choices)
    return text, chunks


@pytest.mark.parametrize("family", FAMILIES)
def test_served_text_is_generates_and_so_plain_decodings(servers, dirs, family):
    server = servers[family]
    client = server.client()
    messages = [{"role": "user", "content": QUESTION}]
    want_chat = generate("--model", dirs[family], "-p", QUESTION)["text"]
    want_text = generate("--model", dirs[family], "--ignore-chat-template", "-p", QUESTION)["text"]

    text, out = chat_text(client, messages)
    assert text == want_chat
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    text, chunks = streamed(client, "chat", messages=messages, max_tokens=N,
                           stream_options={"include_usage": True})
    assert text == want_chat
    assert chunks[0].choices[0].delta.role == "assistant" and len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].model_extra["timings"]["predicted_n"] == chunks[-1].usage.completion_tokens

    done = client.completions.create(model="default_model", prompt=QUESTION, max_tokens=N)
    assert done.choices[0].text == want_text and done.object == "text_completion"
    text, _ = streamed(client, "text", prompt=QUESTION, max_tokens=N)
    assert text == want_text


def test_usage_and_timings_say_what_ran(servers):
    client = servers["llama"].client()
    _, out = chat_text(client, [{"role": "user", "content": QUESTION}], max_tokens=N)
    t = out.model_extra["timings"]
    assert out.usage.completion_tokens == t["predicted_n"] <= N
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert t["prompt_n"] == out.usage.prompt_tokens - out.usage.prompt_tokens_details.cached_tokens
    assert 0 <= t["draft_n_accepted"] <= t["draft_n"]
    if t["draft_n"]:
        assert t["acceptance"] == pytest.approx(t["draft_n_accepted"] / t["draft_n"])
    else:
        assert t["acceptance"] is None
    assert t["drafter"] == "lookup" and t["block_size"] == 64 and t["rollback"] == "trim"
    assert t["tokens_per_block"] >= 1 and t["predicted_per_second"] > 0
    # A request may verify fewer tokens per forward than the server, never more.
    _, out = chat_text(client, [{"role": "user", "content": QUESTION}], extra_body={"num_draft_tokens": 2})
    assert out.model_extra["timings"]["block_size"] == 3
    _, out = chat_text(client, [{"role": "user", "content": QUESTION}], extra_body={"num_draft_tokens": 500})
    assert out.model_extra["timings"]["block_size"] == 64
    # Nothing drafted: acceptance is no rate at all, not 0%.
    _, out = chat_text(client, [{"role": "user", "content": QUESTION}], extra_body={"num_draft_tokens": 0})
    t = out.model_extra["timings"]
    assert (t["block_size"], t["draft_n"], t["acceptance"], t["tokens_per_block"]) == (1, 0, None, 1.0)


def test_stop_strings_end_the_answer_and_are_never_sent(servers):
    client = servers["llama"].client()
    messages = [{"role": "user", "content": QUESTION}]
    full, _ = chat_text(client, messages)
    stop = full[12:15]
    cut, out = chat_text(client, messages, stop=[stop, "never-there"])
    assert cut == full[: full.index(stop)] and out.choices[0].finish_reason == "stop"
    text, chunks = streamed(client, "chat", messages=messages, max_tokens=N, stop=stop, logprobs=True,
                            stream_options={"include_usage": True})
    assert text == cut and stop not in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    # Usage and log-probabilities count up to the token that completed the stop string, as plain decoding does.
    _, plain = chat_text(client, messages, stop=[stop], extra_body={"num_draft_tokens": 0}, logprobs=True)
    listed = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert out.usage.completion_tokens == chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert len(listed) == len(plain.choices[0].logprobs.content) == plain.usage.completion_tokens


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_second_turn_reuses_the_cache_and_answers_as_a_cold_server(servers, dirs, family):
    client = servers[family].client()
    first = [{"role": "user", "content": "Tell me about the fox and the dog."}]
    answer, out1 = chat_text(client, first)
    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And the fox again?"}]
    text, out2 = chat_text(client, second)
    cached = out2.usage.prompt_tokens_details.cached_tokens
    # At least turn one's prompt is reused (a random model's bytes need not survive the trip through
    # text and back, so its answer may not be; the bundled model's test checks that part).
    assert cached >= out1.usage.prompt_tokens - 1
    assert out2.model_extra["timings"]["prompt_n"] == out2.usage.prompt_tokens - cached
    cold = Server("--model", dirs[family], "--prompt-cache-size", "0")
    try:
        again, out3 = chat_text(cold.client(), second)
    finally:
        cold.stop()
    assert again == text and out3.usage.prompt_tokens_details.cached_tokens == 0


def test_a_tool_call_comes_back_parsed(tmp_path):
    server = Server("--model", tool_model_dir(tmp_path / "tools"))
    try:
        client = server.client()
        out = client.chat.completions.create(model="default_model", messages=TOOL_QUESTION, tools=[WEATHER_TOOL],
                                             max_tokens=120)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"} and call.id
        chunks = list(client.chat.completions.create(model="default_model", messages=TOOL_QUESTION,
                                                     tools=[WEATHER_TOOL], max_tokens=120, stream=True))
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == \
            [(0, "get_weather", {"city": "Paris"})]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # chat_template_kwargs reach the template (this one adds a prefix to the reply when asked).
        plain = client.chat.completions.create(model="default_model", messages=TOOL_QUESTION, max_tokens=1)
        brief = client.chat.completions.create(model="default_model", messages=TOOL_QUESTION, max_tokens=1,
                                               extra_body={"chat_template_kwargs": {"brief": True}})
        assert brief.usage.prompt_tokens == plain.usage.prompt_tokens + len("Briefly: ")
        # The call and its result go back in the conversation, as a client sends them.
        follow = TOOL_QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                                  {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        out = client.chat.completions.create(model="default_model", messages=follow, tools=[WEATHER_TOOL],
                                             max_tokens=8)
        assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    finally:
        server.stop()


def test_a_client_that_goes_away_mid_stream_is_cancelled_and_the_next_request_served(long_server):
    long_stream(long_server).close()
    text, out = chat_text(long_server.client(), [{"role": "user", "content": QUESTION}])
    assert out.choices[0].finish_reason in ("stop", "length")
    cancelled = [int(m.group(1)) for m in re.finditer(r"cancelled after (\d+) tokens", long_server.log)]
    assert cancelled and cancelled[-1] < LONG["max_tokens"]


@pytest.mark.parametrize("family", FAMILIES)
def test_concurrent_clients_each_get_their_own_exact_text(servers, family):
    """Four openai clients at once: rows of one batch, each answer what the same request gets alone."""
    server = servers[family]
    client = server.client()
    requests = [
        {"messages": [{"role": "user", "content": QUESTION}]},  # a copy: drafts accepted
        {"messages": [{"role": "user", "content": "Question 1: where does the fox sleep?"}], "max_tokens": 17},
        {"messages": [{"role": "user", "content": "Question 2: where does the fox eat?"}], "stream": True},
        {"messages": [{"role": "user", "content": "Question 3: where does the fox hide?"}], "temperature": 0.8,
         "seed": 7},
    ]

    def answer(body: dict) -> str:
        body = {"model": "default_model", "max_tokens": N, **body}
        if body.get("stream"):
            return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**body)
                           if c.choices)
        return client.chat.completions.create(**body).choices[0].message.content

    alone = [answer(r) for r in requests]
    before = server.log.count("measured the model's forward")
    together: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, answer(requests[i])))
               for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [together.get(i) for i in range(len(requests))] == alone
    # The batch's forward costs were measured at start-up, once, never on a request's time (issue 43).
    assert before == 0 and server.log.count("measured the model's forward") == 0, server.log
    assert server.log.count("batch forward costs measured at start-up") == 1, server.log


BAD = [
    ("malformed JSON", "/v1/chat/completions", b'{"messages": [', 400, None),
    ("not an object", "/v1/chat/completions", [1, 2], 400, None),
    ("no messages", "/v1/chat/completions", {"model": "default_model"}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("a string for a number", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "10"}, 400, "max_tokens"),
    ("out of range", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, None),
    ("a tool without its function", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools[0]"),
    ("a user message without content", "/v1/chat/completions", {"messages": [{"role": "user"}]}, 400,
     "messages[0].content"),
    ("n > 1", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400, "top_logprobs"),
    ("top_logprobs over 20", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("an image", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400, "messages[0].content[0]"),
    ("penalty out of range", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("logit_bias key not a token id", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("logit_bias past the vocabulary", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("logit_bias over 100", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("an unknown response_format", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, 400,
     "response_format.type"),
    ("a json_schema without its schema", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema.schema"),
    ("a schema the grammar cannot compile", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}}, 400, "response_format.json_schema.schema"),
    ("tool_choice required without tools", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400, "tool_choice"),
    ("a grammar with ignore_eos", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"},
      "ignore_eos": True}, 400, "ignore_eos"),
    ("two repetition penalties", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 1.2, "repeat_penalty": 1.1}, 400,
     "repeat_penalty"),
    ("unknown model", "/v1/chat/completions",
     {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("no prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("token id out of the vocabulary", "/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("echo", "/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo"),
    # Issue 33, 3: each of these was a 500.
    ("a tool call whose function is a string", "/v1/chat/completions", {"messages": [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "a", "type": "function", "function": "f"}]},
        {"role": "user", "content": "hi"}]}, 400, "messages[0].tool_calls[0].function"),
    ("a lone surrogate", "/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "hi \\ud800 there"}]}', 400, None),
    ("a lone surrogate in a prompt", "/v1/completions", '{"prompt": "\\udfff"}', 400, None),
    # 5: controls other servers honour are refused by name, never ignored.
    *[(name, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], name: value}, 400, name)
      for name, value in (("num_ctx", 4096), ("mirostat", 2), ("typical_p", 0.9), ("dry_multiplier", 0.8))],
    # 6: what is wrong, said plainly.
    *[(f"temperature {v}", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], '
       f'"temperature": {v}}}', 400, "temperature") for v in ("NaN", "Infinity", "1e400")],
    ("a text part without text", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages[0].content[0].text"),
    # 7: seeds outside [0, 2^64 - 1] are refused, not reduced.
    *[(f"seed {v}", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": v}, 400,
       "seed") for v in (2**64, 2**200, -1)],
]

# What each of those answers says, where the wording is the point (issue 33, 6 and 7).
SAYS = {"temperature NaN": "finite", "temperature 1e400": "finite", "a text part without text": "needs its text",
        "seed -1": "[0, 2^64 - 1]", "a lone surrogate": "unpaired UTF-16 surrogate",
        "mirostat": "drop mirostat", "num_ctx": "drop num_ctx", "a schema the grammar cannot compile": "grammar",
        "two repetition penalties": "give one of them"}


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_4xx_in_openais_shape_and_the_server_keeps_serving(servers, name, path, body, status,
                                                                           param):
    server = servers["llama"]
    r = server.post(path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == ERROR_KEYS and error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    assert SAYS.get(name, "") in error["message"] and not error["message"].startswith("Value error")
    assert chat_text(server.client(), [{"role": "user", "content": "hi"}], max_tokens=3)[1].choices


def test_a_prompt_over_the_context_names_both_numbers(servers):
    server = servers["llama"]
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model="default_model", max_tokens=3,
                                                messages=[{"role": "user", "content": "x" * 5000}])
    error = e.value.body
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert re.search(r"the prompt is 50\d\d tokens but the model's context is 4096 tokens", error["message"])


def test_routes_methods_and_size_limits_answer_in_the_error_shape(servers):
    server = servers["llama"]
    for r, status in ((httpx.get(f"{server.url}/v1/nothing"), 404),
                      (httpx.get(f"{server.url}/v1/chat/completions"), 405),
                      (server.post("/v1/completions", b"x" * (33 * 2**20)), 413)):
        assert r.status_code == status and set(r.json()["error"]) == ERROR_KEYS
    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == str(server.args[1])
    # The openai client's models.retrieve (issue 33, 10), under any name a request may use.
    client = server.client()
    assert client.models.retrieve("default_model").id == str(server.args[1])
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    # A body sent chunked (no Content-Length) gets the same 413 (issue 33, 6).
    chunked = httpx.post(f"{server.url}/v1/completions", content=iter([b"x" * 2**20] * 33),
                         headers={"content-type": "application/json"}, timeout=120)
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"


def test_health_and_models_answer_while_a_generation_runs(long_server):
    stream = long_stream(long_server)
    try:
        health = httpx.get(f"{long_server.url}/health", timeout=30).json()
        assert health["status"] == "ok" and health["busy"] is True
        assert httpx.get(f"{long_server.url}/v1/models", timeout=30).status_code == 200
    finally:
        stream.close()


def test_a_full_queue_answers_503_with_retry_after(dirs):
    # Two requests decode together, one more may wait: the fourth is turned away.
    server = Server("--model", dirs["long"], "--decode-concurrency", "2", "--queue-size", "1")
    try:
        body = {"messages": [{"role": "user", "content": "Go"}], **LONG, **LONG_EXTRA}
        with httpx.Client(timeout=120) as http, contextlib.ExitStack() as streams:
            for _ in range(2):
                running = streams.enter_context(http.stream("POST", f"{server.url}/v1/chat/completions", json=body))
                lines = running.iter_lines()  # kept: a closed iterator closes the response
                while '"content": "' not in (line := next(lines)) or '"content": ""' in line:
                    pass  # until a token shows that it is being generated
                streams.callback(lines.close)
            health = httpx.get(f"{server.url}/health").json()
            assert health["decoding"] == 2 and health["decode_concurrency"] == 2, health
            with http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as waiting:
                assert waiting.status_code == 200  # queued
                over = server.post("/v1/chat/completions", body)
                assert over.status_code == 503 and over.headers["retry-after"] == "1"
                assert over.json()["error"]["code"] == "overloaded"
    finally:
        server.stop()


def test_a_model_whose_rows_cannot_batch_is_served_one_request_at_a_time(tmp_path):
    # A quantized KV cache has no row form: the start-up says so, and two clients at once still get their texts.
    model = make_model_dir(tmp_path / "kv-llama", {**TINY_CONFIGS["llama"], "head_dim": 32}, seed=0)
    server = Server("--model", model, "--kv-bits", "4", "--kv-group-size", "32")
    try:
        assert "note: requests are decoded one at a time:" in server.log
        assert "up to 1 requests decoded together" in server.log
        client = server.client()
        asks = [[{"role": "user", "content": f"Say {w}."}] for w in ("yes", "no")]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            together = list(pool.map(lambda m: chat_text(client, m, max_tokens=8)[0], asks))
        assert together == [chat_text(client, m, max_tokens=8)[0] for m in asks]
    finally:
        server.stop()


def test_an_api_key_is_required_when_given(dirs):
    server = Server("--model", dirs["llama"], "--api-key", "sesame")
    try:
        messages = [{"role": "user", "content": "hi"}]
        for key in ("none", "sesam"):
            with pytest.raises(openai.AuthenticationError) as e:
                server.client(api_key=key).chat.completions.create(model="default_model", messages=messages)
            assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        assert server.post("/v1/models", {}).status_code == 401
        assert server.client(api_key="sesame").chat.completions.create(
            model="default_model", messages=messages, max_tokens=2).choices
        # Anthropic's clients send x-api-key.
        body = {"messages": messages, "max_tokens": 2}
        assert server.post("/v1/chat/completions", body, headers={"x-api-key": "sesame"}).status_code == 200
        assert server.post("/v1/chat/completions", body, headers={"x-api-key": "sesam"}).status_code == 401
        assert httpx.get(f"{server.url}/health").status_code == 200  # health checks need no key
    finally:
        server.stop()


def test_binding_beyond_loopback_needs_a_decision_about_keys(dirs):
    result = CliRunner().invoke(app, ["serve", "--model", str(dirs["llama"]), "--host", "0.0.0.0"])
    assert result.exit_code == 2
    assert "--api-key KEY" in result.stderr and "--no-api-key" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    server = Server("--model", dirs["llama"], "--host", "0.0.0.0", "--no-api-key")
    try:
        assert any("without an API key: anyone who can reach port" in line for line in server.lines)
    finally:
        server.stop()


@pytest.mark.parametrize("origin", ["localhost:3000", "http://localhost:3000/", "http://a.example/chat", "*.example"])
def test_an_origin_that_is_not_one_is_refused_before_the_model_loads(dirs, origin):
    result = CliRunner().invoke(app, ["serve", "--model", str(dirs["llama"]), "--allow-origin", "*",
                                      "--allow-origin", origin])
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"error: --allow-origin takes an origin like http://localhost:3000 (scheme, "
                                     f"host and port, no path), or * for any (got {origin!r})")


def test_a_port_in_use_is_one_line(servers, dirs):
    port = servers["llama"].url.rsplit(":", 1)[1]
    result = CliRunner().invoke(app, ["serve", "--model", str(dirs["llama"]), "--port", port])
    assert result.exit_code == 2 and f"127.0.0.1:{port} is in use: pass another --port" in result.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_ctrl_c_stop_the_server_mid_generation(dirs, sig):
    server = Server("--model", dirs["long"])
    stream = long_stream(server)
    start = time.monotonic()
    code = server.stop(sig)
    took = time.monotonic() - start
    assert code == 0, server.log
    assert took < 30  # a hang guard; scripts/bench_serve.py measures the real time
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for _ in stream:  # ended with an error frame ("shutting down"), or the connection closed
            pass
    assert "Traceback" not in server.log


def test_the_bundled_model_serves_with_no_options():
    prompt = "Copy this text exactly: The city council met on Tuesday to discuss the new park."
    # As a user runs it: the CLI preloads OpenBLAS (re-executing itself), which the other servers here
    # leave out to match in-process references; generate below runs the same way.
    users = {"SPECDEC_NO_REEXEC": ""}
    server = Server(extra_env=users)
    try:
        client = server.client()
        assert client.models.list().data[0].id == "smollm2-135m-instruct"
        first = [{"role": "user", "content": prompt}]
        text, out = chat_text(client, first, model="smollm2-135m-instruct")
        # The next turn reuses the whole first one: its prompt and its answer.
        _, out2 = chat_text(client, first + [{"role": "assistant", "content": text},
                                             {"role": "user", "content": "Now in fewer words."}], max_tokens=4)
        assert out2.usage.prompt_tokens_details.cached_tokens >= out.usage.total_tokens - 1
        # A text completion continues its prompt: its first token's leading space is its text's (a real BPE
        # tokenizer's, which mlx-lm's detokenizer drops), so a stop string that starts with it matches.
        done = client.completions.create(model="default_model", prompt="The capital of France is", max_tokens=4,
                                         logprobs=0)
        lp = done.choices[0].logprobs
        assert lp.tokens[0].startswith(" ") and done.choices[0].text == "".join(lp.tokens)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        cut = client.completions.create(model="default_model", prompt="The capital of France is", max_tokens=4,
                                        stop=[lp.tokens[0]])
        assert (cut.choices[0].text, cut.choices[0].finish_reason, cut.usage.completion_tokens) == ("", "stop", 1)
        legacy_logprobs_of_split_characters(client)
    finally:
        server.stop()
    assert "decode concurrency" in server.log and "batch forward costs measured at start-up" in server.log
    result = subprocess.run([sys.executable, "-m", "specdec_cli", "generate", "--json", "-m", str(N), "-p", prompt],
                            env=env(**users), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert text == json.loads(result.stdout)["text"]
    assert out.model_extra["timings"]["drafter"] == "lookup"


def legacy_logprobs_of_split_characters(client) -> None:
    """Emoji the bundled model writes a byte or two per token: each such token is named by its bytes (distinct
    keys, the chosen one's own log-probability) and starts where its character does, streamed or not."""
    ask = {"model": "default_model", "prompt": "Emoji list: \U0001F600\U0001F389", "max_tokens": 4, "logprobs": 5}
    done = client.completions.create(**ask)
    text, lp = done.choices[0].text, done.choices[0].logprobs
    assert any(t.startswith("bytes:") for t in lp.tokens), lp.tokens  # the case is met
    starts, at, pending = [], 0, b""
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        raw = bytes.fromhex(token[len("bytes:"):].replace("\\x", "")) if token.startswith("bytes:") else token.encode()
        if token.startswith("bytes:"):
            with pytest.raises(UnicodeDecodeError):
                raw.decode()
        assert len(top) == 5 and top[token] == logprob
        starts.append(at)
        pending += raw
        try:
            at, pending = at + len(pending.decode()), b""
        except UnicodeDecodeError:
            pass
    assert lp.text_offset == starts and all(0 <= o < len(text) for o in lp.text_offset), (text, lp.text_offset)
    chunks = list(client.completions.create(**ask, stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [o for p in parts for o in p.text_offset] == lp.text_offset
    assert [t for p in parts for t in p.tokens] == lp.tokens


def test_chat_in_the_terminal_reuses_the_last_turn(dirs):
    lines = "Tell me about the fox.\nAnd the dog?\n/reset\nTell me about the fox.\n/quit\n"
    result = CliRunner().invoke(app, ["chat", "--model", str(dirs["qwen3_5"]), "--no-live", "-m", "12"],
                                input=lines)
    assert result.exit_code == 0, result.output
    turns = [line for line in result.stderr.splitlines() if line.startswith("[prompt ")]
    assert len(turns) == 3
    cached = [int(m.group(1)) if (m := re.search(r"\((\d+) cached\)", t)) else 0 for t in turns]
    # Turn two resumes turn one; after /reset, the first message again resumes its own checkpoint.
    assert cached[1] > 0 and cached[2] > 0
    answers = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(answers) >= 2 and answers[0] == answers[-1]
