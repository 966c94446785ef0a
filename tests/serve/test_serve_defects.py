"""``specdec serve`` defects, each held by a test: a model's answer that stopped all generation, the API key's
reach, boolean JSON schemas, a cut forced tool call, the prompt cache's bytes, pydantic's prefixes, JSON bodies
sent as forms, whitespace between parallel tool calls.

Real server processes (tests/server.py) where the defect shows over HTTP; the scheduler, the text stream and the
prompt cache in this process where a fault must be injected or memory counted.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import weakref

import httpx
import mlx.core as mx
import pytest

from server import TOOL_ANSWER, TOOL_QUESTION, WEATHER_TOOL, Server, said_model_dir, tool_model_dir, tools_tokenizer
from specdec_cli.core.processors import Constraint, ConstraintError, Grammar, check_constraint, grammar_text
from specdec_cli.serve import anthropic as messages_api
from specdec_cli.serve import protocol
from specdec_cli.serve import responses as responses_api
from specdec_cli.serve.scheduler import Busy, Done, Failed, Job, Scheduler
from specdec_cli.session import ModelOptions, PromptCache, Request, Session, load_setup
from specdec_cli.session import prompt_cache as prompt_cache_module
from specdec_cli.session.reply import Reply, TextStream
from specdec_cli.session.synthetic import make_model_dir
from test_scheduler import refuses_one_past_the_bound

KEY = "sk-test-key"
ORIGIN = "http://localhost:3000"
# A tool call whose JSON is a number: mlx-lm's json_tools parser returns 42, not a call.
BAD_CALL = "<tool_call> 42 </tool_call>"
HELLO = [{"role": "user", "content": "Hello there"}]
# A hang guard only: an answer on a loaded machine comes in seconds.
ANSWER_S = 120


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("defects")


@pytest.fixture(scope="module")
def llama(root):
    return make_model_dir(root / "llama", "llama", seed=0)


@pytest.fixture(scope="module")
def bad_server(root):
    s = Server("--model", said_model_dir(root / "bad", BAD_CALL, steps=400))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tools_server(root):
    s = Server("--model", tool_model_dir(root / "tools"), "--prompt-cache-bytes", "300K")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def keyed(llama):
    s = Server("--model", llama, "--api-key", KEY, "--allow-origin", ORIGIN)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tok(root):
    return tools_tokenizer(root / "tok")


def post(server: Server, path: str, body, **kw) -> httpx.Response:
    r = server.post(path, body, **kw)
    if r.status_code >= 400:
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}, r.text
        assert "Traceback" not in r.text
    return r


def health(server: Server) -> httpx.Response:
    return httpx.get(f"{server.url}/health", timeout=30)


# --- 1. a tool call that is not a JSON object -----------------------------------------------------------

@pytest.mark.parametrize("inner", [" 42 ", ' "x" ', " null ", " [1] ", " [] ", " true ",
                                   '\n[{"name": "get_weather", "arguments": {}}, 3]\n',
                                   '\n{"arguments": {"city": "Paris"}}\n'])
def test_a_tool_call_that_is_not_an_object_is_returned_as_text(tok, inner):
    text = f"Sure. <tool_call>{inner}</tool_call> Done."
    for step in (1, 1000):
        stream, content, calls = TextStream(tok), "", []
        ids = tok.encode(text, add_special_tokens=False)
        for i in range(0, len(ids), step):
            piece = stream.add(ids[i: i + step])
            content, calls = content + piece.content, calls + piece.tool_calls
        piece = stream.finish()
        content, calls = content + piece.content, calls + piece.tool_calls
        assert content == text and calls == [] and not stream.made_tool_calls


def test_a_list_of_objects_is_still_several_calls(tok):
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    stream = TextStream(tok)
    piece = stream.add(tok.encode(f"<tool_call>\n[{call}, {call}]\n</tool_call>", add_special_tokens=False))
    piece.tool_calls += stream.finish().tool_calls
    assert [c["function"]["name"] for c in piece.tool_calls] == ["get_weather", "get_weather"]


def test_a_model_that_calls_with_a_number_is_answered_and_the_server_serves_on(bad_server):
    body = {"messages": TOOL_QUESTION, "tools": [WEATHER_TOOL], "max_tokens": 40}
    client = bad_server.client(timeout=ANSWER_S)
    for _ in range(2):  # the second request is served too: the generation thread lives
        out = client.chat.completions.create(model="default_model", **body)
        choice = out.choices[0]
        assert choice.message.content == BAD_CALL and not choice.message.tool_calls
        assert choice.finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="default_model", stream=True, **body))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == BAD_CALL
    assert health(bad_server).json()["status"] == "ok"
    assert client.chat.completions.create(model="default_model", messages=HELLO, max_tokens=5).choices


# --- 1a. a call whose arguments are not an object, on the Messages API ---------------------------------

# A call mlx-lm parses, with a string for arguments: OpenAI's arguments are a string anyway, Anthropic's
# input must be an object (it came back as the text "get_weather(Paris)", which the model never wrote).
STRING_CALL = '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>'
ANTHROPIC_WEATHER = {"name": "get_weather", "description": WEATHER_TOOL["function"]["description"],
                     "input_schema": WEATHER_TOOL["function"]["parameters"]}


def test_a_call_whose_arguments_are_not_an_object_is_the_models_text_where_they_must_be_one(tok):
    text = f"Sure. {STRING_CALL} Done."
    ids = tok.encode(text, add_special_tokens=False)
    for objects in (True, False):
        stream = TextStream(tok, tools=[WEATHER_TOOL], object_arguments=objects)
        pieces = [stream.add(ids), stream.finish()]
        content = "".join(p.content for p in pieces)
        calls = [c for p in pieces for c in p.tool_calls]
        if objects:
            assert content == text and not calls and not stream.made_tool_calls
        else:  # chat completions: a call whose arguments string is the model's
            assert content == "Sure.  Done." and [c["function"]["arguments"] for c in calls] == ["Paris"]


@pytest.fixture(scope="module")
def string_call_server(root):
    s = Server("--model", said_model_dir(root / "string-call", STRING_CALL, steps=400))
    yield s
    s.stop()


def test_the_messages_api_gives_back_the_models_own_text_for_a_call_it_cannot_use(string_call_server):
    import anthropic

    client = anthropic.Anthropic(base_url=string_call_server.url, api_key="none", max_retries=0, timeout=ANSWER_S)
    out = client.messages.create(model="default_model", max_tokens=120, messages=TOOL_QUESTION,
                                 tools=[ANTHROPIC_WEATHER])
    assert [(b.type, b.text) for b in out.content] == [("text", STRING_CALL)] and out.stop_reason == "end_turn"
    with client.messages.stream(model="default_model", max_tokens=120, messages=TOOL_QUESTION,
                                tools=[ANTHROPIC_WEATHER]) as s:
        final = s.get_final_message()
    assert [(b.type, b.text) for b in final.content] == [("text", STRING_CALL)]
    # Chat completions still answers it as a call (its arguments are a string there).
    chat = string_call_server.client().chat.completions.create(model="default_model", messages=TOOL_QUESTION,
                                                              tools=[WEATHER_TOOL], max_tokens=120)
    (call,) = chat.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == "Paris"


# --- 1b. the generation thread: one row's fault fails that row, nothing ends the thread ------------------

PROMPTS = [list(b"The quick brown fox jumps over the lazy dog."), list(b"abc abc abc abc abc abc"),
           list(b"Hello there, how are you?")]
N = 20


@pytest.fixture(scope="module")
def setup(llama):
    return load_setup(ModelOptions(model=str(llama), dtype="float32"), "lookup")


class _Broken(Reply):
    """A reply whose handling raises once its first text has come (what a bad tool call did)."""

    def take(self, event):
        piece = super().take(event)
        if self.tokens:
            raise ValueError("this row's text could not be handled")
        return piece


class _Fatal(BaseException):
    """Not an Exception: nothing in the thread may catch it, so the thread ends."""


def run_jobs(scheduler: Scheduler, makers: list, start: bool = True) -> list:
    """Submit a job per maker at once; returns what each ended with (Done or Failed)."""
    loop = asyncio.new_event_loop()

    async def go() -> list:
        jobs = [Job(make, loop) for make in makers]
        for job in jobs:
            scheduler.submit(job)

        async def end(job: Job):
            while True:
                item = await asyncio.wait_for(job.out.get(), ANSWER_S)
                if isinstance(item, (Done, Failed)):
                    return item

        return await asyncio.gather(*(end(j) for j in jobs))

    if start:
        scheduler.start()
    try:
        return loop.run_until_complete(go())
    finally:
        loop.close()


def maker(session: Session, prompt, kind=Reply):
    return lambda: kind(session, Request(prompt, N), TextStream(session.setup.tokenizer, chat=False))


def alone(setup, prompt) -> list[int]:
    reply = Reply(Session(setup, 8), Request(prompt, N), TextStream(setup.tokenizer, chat=False))
    list(reply)
    return reply.tokens


def test_a_burst_fills_the_free_rows_and_the_queue_before_any_request_is_turned_away(setup):
    # Requests arrive faster than the generation thread (busy with a block) takes them into rows: rows it has
    # not filled yet are room too. Before, the queue alone bounded a burst: 3 of 6 got a 503 with 8 rows free.
    session = Session(setup, 8)
    scheduler = Scheduler(session, max_rows=4, max_queue=2)
    loop = asyncio.new_event_loop()
    try:
        jobs = [Job(maker(session, PROMPTS[i % len(PROMPTS)]), loop) for i in range(6)]
        for job in jobs:  # the thread is not started: nothing has been taken yet
            scheduler.submit(job)
        with pytest.raises(Busy, match=r"6 requests are in hand, the most this server takes: 4 decoding together \(--decode-concurrency\) and 2 waiting \(--queue-size\)"):
            scheduler.submit(Job(maker(session, PROMPTS[0]), loop))
        assert scheduler.waiting == 6
        for job in jobs:
            job.cancel()  # skipped when taken
    finally:
        scheduler.stop()
        loop.close()
    # Once started, the ones decoding leave room for as many again: 4 rows + 2 waiting.
    scheduler = Scheduler(session, max_rows=4, max_queue=2)
    try:
        ends = run_jobs(scheduler, [maker(session, PROMPTS[i % len(PROMPTS)]) for i in range(6)])
        assert all(isinstance(e, Done) for e in ends)
    finally:
        scheduler.stop()


def test_a_request_being_opened_still_counts_against_the_bound(setup):
    # Taken from the queue and not yet a row (its prompt rendered, its memory checked, its cache looked up): it
    # counted nowhere, so one more than rows + queue got in.
    import threading

    session = Session(setup, 8)
    scheduler = Scheduler(session, max_rows=1, max_queue=1)
    taken, release = threading.Event(), threading.Event()
    make = maker(session, PROMPTS[0])

    def slow_make():
        taken.set()
        release.wait(ANSWER_S)
        return make()

    loop = asyncio.new_event_loop()
    jobs = [Job(slow_make, loop), Job(maker(session, PROMPTS[1]), loop)]
    try:
        refuses_one_past_the_bound(scheduler, jobs, Job(maker(session, PROMPTS[2]), loop), taken, release, ANSWER_S)
    finally:
        loop.close()


def test_a_request_just_opened_counts_once(setup):
    # In flight and still the one in hand until the thread takes the next: it counted as running and waiting,
    # so a request could be turned away one early.
    from specdec_cli.loop.flights import Flights
    from specdec_cli.serve.scheduler import _Ask

    session = Session(setup, 8)
    scheduler = Scheduler(session, max_rows=2, max_queue=0)
    loop = asyncio.new_event_loop()
    try:
        scheduler._rows = Flights(session)
        job = Job(maker(session, PROMPTS[0]), loop)
        scheduler._rows.open(Request(PROMPTS[0], N), _Ask(job, None))
        scheduler._in_hand = job
        assert (scheduler.running, scheduler.waiting) == (1, 0)
        scheduler.submit(Job(maker(session, PROMPTS[1]), loop))  # the second row is free
        scheduler._in_hand = Job(maker(session, PROMPTS[1]), loop)  # one not yet opened counts as waiting
        assert scheduler.waiting == 2
    finally:
        scheduler._rows.close()
        loop.close()


def test_a_fault_handling_one_rows_text_fails_that_row_alone(setup):
    session = Session(setup, 8)
    scheduler = Scheduler(session, max_rows=4)
    try:
        ends = run_jobs(scheduler, [maker(session, PROMPTS[0]), maker(session, PROMPTS[1], _Broken),
                                    maker(session, PROMPTS[2])])
        assert isinstance(ends[1], Failed) and "could not be handled" in str(ends[1].error)
        assert [e.reply.tokens for e in (ends[0], ends[2])] == [alone(setup, PROMPTS[0]), alone(setup, PROMPTS[2])]
        (again,) = run_jobs(scheduler, [maker(session, PROMPTS[1])], start=False)
        assert again.reply.tokens == alone(setup, PROMPTS[1]) and scheduler.fault is None
    finally:
        scheduler.stop()


def test_a_row_that_cannot_leave_the_engine_is_never_decoded_again_and_the_thread_serves_on(setup, monkeypatch):
    from specdec_cli.loop.engine import Engine

    remove, step = Engine.remove, Engine.step
    stuck, blocks = [], []

    def remove_once(self, row):
        if not stuck:
            stuck.append((row, len(blocks)))
            raise RuntimeError("the row could not leave")
        return remove(self, row)

    monkeypatch.setattr(Engine, "remove", remove_once)
    monkeypatch.setattr(Engine, "step", lambda self: blocks.append(list(self.rows)) or step(self))
    session = Session(setup, 8)
    scheduler = Scheduler(session, max_rows=4)
    short = lambda: Reply(session, Request(PROMPTS[0], 4), TextStream(setup.tokenizer, chat=False))  # noqa: E731
    try:
        ends = run_jobs(scheduler, [short, maker(session, PROMPTS[1])])
        assert isinstance(ends[0], Failed) and "could not leave" in str(ends[0].error)
        # The other request: decoded to its end before the first ended, or failed with the cause said.
        assert (isinstance(ends[1], Done) and ends[1].reply.tokens == alone(setup, PROMPTS[1])) or \
            "its request ended but could not leave" in str(ends[1].error), ends[1]
        (again,) = run_jobs(scheduler, [maker(session, PROMPTS[2])], start=False)
        assert again.reply.tokens == alone(setup, PROMPTS[2]) and scheduler.fault is None
    finally:
        scheduler.stop()
    ((row, failed),) = stuck
    assert any(row in rows for rows in blocks[:failed])
    assert not any(row in rows for rows in blocks[failed:])  # never decoded after it could not leave
    assert len(blocks) > failed  # the thread decoded on, in a fresh engine


def test_a_fault_outside_any_row_fails_the_rows_in_flight_and_the_thread_serves_on(setup, monkeypatch):
    session = Session(setup, 8)
    scheduler = Scheduler(session, max_rows=4)
    drop = scheduler._drop_cancelled
    faults = []

    def faulty():
        if scheduler.decoding and not faults:
            faults.append(1)
            raise RuntimeError("a fault between blocks")
        drop()

    monkeypatch.setattr(scheduler, "_drop_cancelled", faulty)
    try:
        ends = run_jobs(scheduler, [maker(session, p) for p in PROMPTS])
        assert faults and any(isinstance(e, Failed) for e in ends)
        assert all(isinstance(e, Done) or "between blocks" in str(e.error) for e in ends)
        (again,) = run_jobs(scheduler, [maker(session, PROMPTS[0])], start=False)
        assert isinstance(again, Done) and again.reply.tokens == alone(setup, PROMPTS[0])
        assert scheduler.fault is None
    finally:
        scheduler.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_generation_thread_that_ended_fails_its_requests_and_health_says_503(setup, monkeypatch):
    from specdec_cli.serve.app import create_app
    from specdec_cli.cli.serve_command import ServeOptions
    from specdec_cli.serve.service import Service

    session = Session(setup, 8, prompt_cache=PromptCache())
    service = Service(session, "tiny", ServeOptions(), max_rows=2)
    scheduler = service.scheduler
    step = scheduler._step

    def fatal():
        if scheduler.decoding:
            raise _Fatal("the thread's end")
        step()

    monkeypatch.setattr(scheduler, "_step", fatal)
    body = {"messages": HELLO, "max_tokens": 8}

    async def go():
        transport = httpx.ASGITransport(app=create_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            assert (await http.get("/health")).status_code == 200
            # In flight when the thread ended: answered, not left to hang.
            r = await asyncio.wait_for(http.post("/v1/chat/completions", json=body), ANSWER_S)
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            await asyncio.to_thread(scheduler._thread.join, ANSWER_S)
            assert scheduler.fault is not None
            r = await http.get("/health")
            assert r.status_code == 503 and "generation thread has stopped" in r.json()["error"]["message"]
            r = await asyncio.wait_for(http.post("/v1/chat/completions", json=body), ANSWER_S)
            assert r.status_code == 503 and "generation thread has stopped" in r.json()["error"]["message"]
        with pytest.raises(Busy):
            scheduler.submit(Job(maker(session, PROMPTS[0]), asyncio.get_running_loop()))

    scheduler.start()  # as the app's lifespan does (the transport runs none)
    try:
        asyncio.run(go())
    finally:
        scheduler.stop()


# --- 2. the API key guards every route but /health ------------------------------------------------------

PROTECTED = [("POST", "/v1/chat/completions"), ("POST", "/chat/completions"), ("POST", "/completions"),
             ("POST", "/v1/completions"), ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
             ("POST", "/v1/responses"), ("GET", "/v1/models"), ("GET", "/v1/models/default_model"),
             ("GET", "/"), ("HEAD", "/"), ("GET", "/nowhere"), ("HEAD", "/v1/nowhere"), ("GET", "/docs"),
             ("GET", "/openapi.json"), ("OPTIONS", "/chat/completions"), ("PUT", "/health/x"), ("GET", "/healthz")]
CHAT = {"messages": HELLO, "max_tokens": 3}


def test_every_route_but_health_needs_the_key(keyed):
    with httpx.Client(base_url=keyed.url, timeout=ANSWER_S) as http:
        for method, path in PROTECTED:
            body = json.dumps(CHAT if method == "POST" else {}) if method in ("POST", "PUT") else None
            r = http.request(method, path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 401, (method, path, r.status_code, r.text)
            if method != "HEAD":
                error = r.json()["error"]  # in Anthropic's shape on /v1/messages
                assert error.get("code", "invalid_api_key") == "invalid_api_key" and "API key" in error["message"]
                assert "/v1/" not in r.text  # nothing about what the server answers
        r = http.post("/chat/completions", json=CHAT, headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert http.get("/health").status_code == 200
        for path in ("/chat/completions", "/completions"):
            body = CHAT if path == "/chat/completions" else {"prompt": "Hello", "max_tokens": 3}
            assert http.post(path, json=body, headers={"authorization": f"Bearer {KEY}"}).status_code == 200
            assert http.post(path, json=body, headers={"x-api-key": KEY}).status_code == 200
        r = http.get("/nowhere", headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 404 and r.json()["error"]["message"]
        assert http.head("/nowhere", headers={"authorization": f"Bearer {KEY}"}).status_code in (404, 405)



def test_a_browser_page_from_an_allowed_origin_may_call_the_server(keyed):
    # --allow-origin: the preflight is answered before the key is asked for (a browser sends none with it), and
    # every answer, an error too, carries the header the page needs to read it. Other origins get no header.
    with httpx.Client(base_url=keyed.url, timeout=ANSWER_S) as http:
        pre = http.options("/v1/chat/completions", headers={
            "origin": ORIGIN, "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        denied = http.post("/v1/chat/completions", json=CHAT, headers={"origin": ORIGIN})
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN
        ok = http.post("/v1/chat/completions", json=CHAT,
                       headers={"origin": ORIGIN, "authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
        other = http.post("/v1/chat/completions", json=CHAT,
                          headers={"origin": "http://evil.example", "authorization": f"Bearer {KEY}"})
        assert "access-control-allow-origin" not in other.headers
        refused = http.options("/v1/chat/completions", headers={"origin": "http://evil.example",
                                                                 "access-control-request-method": "POST"})
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers

# --- 3. boolean JSON schemas -----------------------------------------------------------------------------

def accepts(grammar: Grammar, tokenizer, text: str) -> bool:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if grammar.matcher.validate_tokens(ids) != len(ids):
        return False
    grammar.matcher.consume_tokens(ids)
    try:
        return grammar.matcher.is_accepting()
    finally:
        grammar.matcher.rollback(len(ids))


def test_a_schema_of_true_is_any_json_value_and_false_is_refused(tok):
    for schema in (True, "true"):
        grammar = Grammar(tok, grammar_text(Constraint.json_schema(schema), tok))
        for text in ("42", '"x"', "null", "[1, 2]", '{"a": {"b": [true]}}'):
            assert accepts(grammar, tok, text), text
        for text in ("abc", "{a}", "[1,"):
            assert not accepts(grammar, tok, text), text
    with pytest.raises(ConstraintError, match="false"):
        grammar_text(Constraint.json_schema(False), tok)


def test_a_schema_that_compiles_but_cannot_be_decoded_is_refused_before_it_is_queued(tok):
    # {"$ref": "#"} compiles to a grammar, then fails at its first token (NoExtensionBias): a 500 mid-answer.
    with pytest.raises(ConstraintError, match="cannot be decoded.*NoExtensionBias"):
        check_constraint(Constraint.json_schema({"$ref": "#"}), tok)
    check_constraint(Constraint.json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}},
                                             "$defs": {"x": {"type": "integer"}}}), tok)  # a $ref that resolves


def test_an_undecodable_schema_is_a_400_naming_it_in_chat_and_in_the_responses_api(tools_server):
    r = post(tools_server, "/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format.json_schema.schema" and "cannot be decoded" in error["message"]
    r = post(tools_server, "/v1/responses", {"model": "default_model", "input": "hi", "max_output_tokens": 5,
                                             "text": {"format": {"type": "json_schema", "name": "x",
                                                                 "schema": {"$ref": "#"}}}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "text.format.schema" and "cannot be decoded" in error["message"]
    assert post(tools_server, "/v1/chat/completions", CHAT).status_code == 200  # and the server serves on


def test_a_schema_of_true_answers_and_false_is_a_400_naming_the_schema(tools_server):
    def ask(schema):
        return post(tools_server, "/v1/chat/completions", {**CHAT, "max_tokens": 30, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})

    r = ask(True)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        json.loads(choice["message"]["content"])
    r = ask(False)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format.json_schema.schema" and error["type"] == "invalid_request_error"
    assert "false" in error["message"]


# --- 4a. a forced tool call cut by max_tokens --------------------------------------------------------------

def test_a_tool_call_cut_or_unclosed_is_returned_as_the_model_wrote_it(tok):
    ids = tok.encode(TOOL_ANSWER, add_special_tokens=False)
    for n in range(1, len(ids)):
        written = tok.decode(ids[:n])
        for cut in (True, False):
            stream = TextStream(tok)
            content = stream.add(ids[:n]).content
            piece = stream.finish(cut=cut)
            if piece.tool_calls:  # ended (not cut) after a whole call, before its end marker: still a call
                assert not cut and not content + piece.content and written.rstrip().endswith("}"), n
            else:
                assert content + piece.content == written, (n, cut)
    # A stop string inside a call: what came before it is the answer, as text.
    stream = TextStream(tok, stop=["Paris"])
    content = stream.add(ids).content + stream.finish().content
    assert content == TOOL_ANSWER[: TOOL_ANSWER.index("Paris")] and stream.stopped


# Tokens of the call the server is asked for: its start marker and a little of its JSON.
CUT = 15


def test_a_forced_tool_call_cut_by_max_tokens_returns_what_the_model_wrote(tools_server):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        for stream in (False, True):
            body = {"messages": TOOL_QUESTION, "tools": [WEATHER_TOOL], "tool_choice": choice, "max_tokens": CUT,
                    "logprobs": True, "stream": stream}
            if not stream:
                out = post(tools_server, "/v1/chat/completions", body).json()["choices"][0]
                content, entries, calls = out["message"]["content"], out["logprobs"]["content"], \
                    out["message"].get("tool_calls")
                finish = out["finish_reason"]
            else:
                client = tools_server.client(timeout=ANSWER_S)
                chunks = [c.choices[0] for c in client.chat.completions.create(model="default_model", **body)
                          if c.choices]
                content = "".join(c.delta.content or "" for c in chunks)
                entries = [e.model_dump() for c in chunks if c.logprobs for e in c.logprobs.content]
                calls = [t for c in chunks for t in c.delta.tool_calls or []]
                finish = chunks[-1].finish_reason
            written = b"".join(bytes(e["bytes"]) for e in entries).decode()
            assert len(entries) == CUT and content == written and not calls and finish == "length", (content, written)
            assert written.startswith("<tool_call>") and "</tool_call>" not in content


# --- 5. the prompt cache is bounded by bytes, and what it drops is freed -----------------------------------

def test_the_default_byte_bound_comes_from_the_machines_memory():
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert prompt_cache_module.default_max_bytes() == min(8 * 2**30, total // 8)
    assert PromptCache().max_bytes == prompt_cache_module.default_max_bytes()


def test_the_prompt_cache_stays_within_its_bytes_and_frees_what_it_drops(setup, monkeypatch):
    cleared, inserting = [], []
    clear = mx.clear_cache
    # MLX's buffers cleared as the cache drops entries (a prefill clears them too: those are not counted).
    monkeypatch.setattr(mx, "clear_cache", lambda: (cleared.extend(inserting), clear()))
    prompts = [list(f"prompt {i}: ".encode()) + list(b"words and more words " * (1 + i % 3)) for i in range(8)]
    cache = PromptCache(max_entries=10, max_bytes=None)
    session = Session(setup, 8, prompt_cache=cache)
    list(Reply(session, Request(prompts[0], N), TextStream(setup.tokenizer, chat=False)))
    cache.max_bytes, cache_kept = int(2.5 * cache.nbytes), []
    cache.clear()
    insert = cache.insert

    def noted(entry):
        cache_kept.append(weakref.ref(entry))
        inserting.append(1)
        try:
            insert(entry)
        finally:
            inserting.clear()

    monkeypatch.setattr(cache, "insert", noted)
    scheduler = Scheduler(session, max_rows=2)
    gc.disable()  # what is dropped must go at once, not when the collector finds a cycle
    try:
        ends = run_jobs(scheduler, [maker(session, p) for p in prompts[:4]])
        for p in prompts[4:]:  # a prompt and its prefix: one resumes from the other's entry
            ends += run_jobs(scheduler, [maker(session, p), maker(session, p[:-3])], start=False)
            assert 0 < cache.nbytes <= cache.max_bytes
        scheduler.stop()
        assert all(isinstance(e, Done) for e in ends)
        del ends
        assert cache.nbytes == sum(e.nbytes for e in cache._entries.values())
        assert len(cache) < len(cache_kept) and cleared
        # Every entry it dropped is gone: no request, snapshot or checkpoint holds it on.
        held = {id(e) for e in cache._entries.values()}
        assert all(ref() is None or id(ref()) in held for ref in cache_kept)
    finally:
        gc.enable()
        scheduler.stop()


def test_health_reports_the_prompt_cache_bytes_and_its_bound(tools_server, keyed):
    for i in range(4):
        r = post(tools_server, "/v1/completions", {"prompt": f"{i} " + "to be or not to be " * (3 + 4 * i),
                                                   "max_tokens": 4})
        assert r.status_code == 200, r.text
        h = health(tools_server).json()
        assert h["prompt_cache_max_bytes"] == 300 * 2**10
        assert 0 < h["prompt_cache_bytes"] <= h["prompt_cache_max_bytes"]
    told = httpx.get(f"{keyed.url}/health", headers={"authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert told["prompt_cache_max_bytes"] == prompt_cache_module.default_max_bytes()


def test_with_a_key_health_tells_others_only_that_the_server_is_up(keyed):
    # The cache folder, its sizes and the load tell whether a prompt prefix was sent before: key holders only.
    for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
        r = httpx.get(f"{keyed.url}/health", headers=headers, timeout=30)
        assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text
    for headers in ({"authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        told = httpx.get(f"{keyed.url}/health", headers=headers, timeout=30).json()
        assert {"prompt_cache_dir", "prompt_cache_disk_bytes", "prompt_cache_bytes", "running"} <= set(told)


# --- 6a. pydantic's "Value error, " never reaches a client ------------------------------------------------

def test_a_validation_error_becomes_one_clean_line():
    from pydantic import ValidationError

    for body, param in (({"messages": HELLO, "seed": -1}, "seed"), ({"messages": HELLO, "x": "\ud800"}, None)):
        with pytest.raises(ValidationError) as e:
            protocol.ChatRequest.model_validate(body)
        err = protocol.validation_error(e.value)
        assert err.status == 400 and err.param == param and "Value error" not in err.message, err.message
        assert err.message.startswith(f"{param}: ") if param else "surrogate" in err.message


def test_no_client_message_carries_pydantics_prefix(tools_server):
    for path, body in (("/v1/chat/completions", {**CHAT, "seed": -1}),
                       ("/v1/completions", {"prompt": "\ud800", "max_tokens": 2}),
                       ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]})):
        r = post(tools_server, path, body)
        assert r.status_code == 400 and "Value error" not in r.text and "\n" not in r.json()["error"]["message"]


# --- 6d. a JSON body is JSON whatever its content-type says ----------------------------------------------

ROUTES = [("/v1/chat/completions", CHAT), ("/chat/completions", CHAT),
          ("/v1/completions", {"prompt": "Hello", "max_tokens": 3}),
          ("/completions", {"prompt": "Hi", "max_tokens": 3}),
          ("/v1/messages", {"model": "default_model", "max_tokens": 3, "messages": HELLO}),
          ("/v1/messages/count_tokens", {"model": "default_model", "messages": HELLO}),
          ("/v1/responses", {"input": "Hello", "max_output_tokens": 3})]


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", None, "text/plain"])
def test_a_json_body_is_read_as_json_whatever_its_content_type(tools_server, content_type):
    headers = {"content-type": content_type} if content_type else {}
    for path, body in ROUTES:
        r = httpx.post(f"{tools_server.url}{path}", content=json.dumps(body).encode(), headers=headers,
                       timeout=ANSWER_S)
        assert r.status_code == 200, (path, r.text)
    r = httpx.post(f"{tools_server.url}/v1/chat/completions", content=b"a=1&b=2", headers=headers, timeout=ANSWER_S)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text


# --- 7. whitespace that only separates tool calls is no content ------------------------------------------

# Qwen's and Hermes' parallel calls: a block each, a newline between. It came back as content "\n" beside the
# calls, as a text block between two tool_use blocks, and as a message item between two function_call items,
# which a Responses client sends back as two assistant turns (a prompt the model did not write).
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ROME = PARIS.replace("Paris", "Rome")
PARALLEL = f"{PARIS}\n{ROME}"
CITIES = ["Paris", "Rome"]
RESPONSES_WEATHER = {"type": "function", **WEATHER_TOOL["function"]}
# Tokens enough for both calls (160 with the test tokenizer).
BOTH = 200


def split(tok, text: str, step: int, **kw) -> list:
    """``text`` through a :class:`TextStream`, ``step`` tokens at a time: the pieces it gives."""
    stream = TextStream(tok, tools=[WEATHER_TOOL], **kw)
    ids = tok.encode(text, add_special_tokens=False)
    return [stream.add(ids[i: i + step]) for i in range(0, len(ids), step)] + [stream.finish()]


def written(pieces: list) -> list[tuple[str, str]]:
    """The pieces' text and calls in order, text that follows text joined: ``("content", text)`` or
    ``("call", city)``."""
    out: list[tuple[str, str]] = []
    for p in pieces:
        for kind, value in p.in_order():
            if kind == "call":
                out.append(("call", json.loads(value["function"]["arguments"])["city"]))
            elif out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + value)
            else:
                out.append((kind, value))
    return out


CALLS = [("call", "Paris"), ("call", "Rome")]


@pytest.mark.parametrize("text, want", [
    (PARALLEL, CALLS),
    (f"\n\n{PARIS}\n \n{ROME}\n", CALLS),
    (f"Let me check.\n{PARALLEL}", [("content", "Let me check.\n"), *CALLS]),
    (f"{PARIS}\nThen Rome:\n{ROME}\n\nDone.",
     [CALLS[0], ("content", "\nThen Rome:\n"), CALLS[1], ("content", "\n\nDone.")]),
    (f"{PARIS}\n{BAD_CALL}", [CALLS[0], ("content", f"\n{BAD_CALL}")]),
    ("\n\n", [("content", "\n\n")]),
])
def test_whitespace_that_only_separates_tool_calls_is_no_content(tok, text, want):
    for step in (1, 2, 1000):  # streamed a token at a time, or whole: the same
        assert written(split(tok, text, step)) == want, step


@pytest.fixture(scope="module")
def thinking_tok(root):
    """The tools tokenizer with thinking markers, as Qwen3's: it thinks, then calls."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from tokenizers import Tokenizer

    path = root / "thinking-tok"
    tools_tokenizer(path)
    hf = Tokenizer.from_file(str(path / "tokenizer.json"))
    hf.add_special_tokens(["<think>", "</think>"])
    hf.save(str(path / "tokenizer.json"))
    return load_tokenizer(path)


@pytest.mark.parametrize("text, want", [
    (f"<think>\nhm\n</think>\n\n{PARALLEL}", [("reasoning", "\nhm\n"), *CALLS]),
    ("<think>\nhm\n</think>\n\nHello", [("reasoning", "\nhm\n"), ("content", "\n\nHello")]),
    ("\n<think>hm</think>\n", [("content", "\n"), ("reasoning", "hm"), ("content", "\n")]),
])
def test_whitespace_between_thinking_and_a_call_is_no_content(thinking_tok, text, want):
    assert thinking_tok.has_thinking and thinking_tok.has_tool_calling
    for step in (1, 1000):
        assert written(split(thinking_tok, text, step)) == want, step


def test_the_messages_and_responses_shapes_keep_real_text_beside_calls_and_no_whitespace(tok):
    for text, texts in ((PARALLEL, []), (f"Let me check.\n{PARALLEL}", ["Let me check.\n"])):
        for step in (1, 1000):
            shape = messages_api.MessageShape("m", 1, lambda reply: {})
            for p in split(tok, text, step, object_arguments=True):
                shape.piece(p)
            assert [b.get("text", b.get("input")) for b in shape.blocks] == \
                [*texts, {"city": "Paris"}, {"city": "Rome"}], (text, step)
            out = responses_api.ResponseShape(responses_api.ResponsesRequest(input="hi"), "m", lambda reply: {})
            for p in split(tok, text, step):
                out.piece(p)
            assert [i["content"][0]["text"] if i["type"] == "message" else json.loads(i["arguments"])
                    for i in out.output] == [*texts, {"city": "Paris"}, {"city": "Rome"}], (text, step)


@pytest.fixture(scope="module")
def parallel_model(root):
    return said_model_dir(root / "parallel", PARALLEL, steps=400)


@pytest.fixture(scope="module")
def parallel_server(parallel_model):
    s = Server("--model", parallel_model)
    yield s
    s.stop()


def test_parallel_calls_over_chat_completions_have_no_content(parallel_server):
    client = parallel_server.client(timeout=ANSWER_S)
    body = {"model": "default_model", "messages": TOOL_QUESTION, "tools": [WEATHER_TOOL], "max_tokens": BOTH}
    for choice in ({}, {"tool_choice": "required"},
                   {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}):
        out = client.chat.completions.create(**body, **choice)
        message = out.choices[0].message
        assert message.content is None and out.choices[0].finish_reason == "tool_calls", (choice, message)
        assert [json.loads(c.function.arguments)["city"] for c in message.tool_calls] == CITIES
        chunks = list(client.chat.completions.create(**body, **choice, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "", choice
        calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        assert [(c.index, json.loads(c.function.arguments)["city"]) for c in calls] == [(0, "Paris"), (1, "Rome")]


def test_parallel_calls_over_the_messages_api_are_tool_use_blocks_alone(parallel_server):
    import anthropic

    client = anthropic.Anthropic(base_url=parallel_server.url, api_key="none", max_retries=0, timeout=ANSWER_S)
    body = {"model": "default_model", "max_tokens": BOTH, "messages": TOOL_QUESTION, "tools": [ANTHROPIC_WEATHER]}
    for choice in ({}, {"tool_choice": {"type": "any"}}, {"tool_choice": {"type": "tool", "name": "get_weather"}}):
        out = client.messages.create(**body, **choice)
        with client.messages.stream(**body, **choice) as s:
            final = s.get_final_message()
        for message in (out, final):
            assert [(b.type, b.input["city"]) for b in message.content] == [("tool_use", c) for c in CITIES], \
                (choice, message.content)
            assert message.stop_reason == "tool_use"


def test_parallel_calls_over_responses_are_function_call_items_alone(parallel_server):
    client = parallel_server.client(timeout=ANSWER_S)
    body = {"model": "default_model", "input": TOOL_QUESTION, "tools": [RESPONSES_WEATHER], "max_output_tokens": BOTH}
    for choice in ({}, {"tool_choice": "required"}, {"tool_choice": {"type": "function", "name": "get_weather"}}):
        out = client.responses.create(**body, **choice)
        events = list(client.responses.create(**body, **choice, stream=True))
        for output in (out.output, events[-1].response.output):
            assert [(i.type, json.loads(i.arguments)["city"]) for i in output] == \
                [("function_call", c) for c in CITIES], (choice, output)
        assert not [e for e in events if e.type.startswith(("response.output_text", "response.content_part"))]


def test_parallel_calls_sent_back_over_responses_are_one_assistant_turn(parallel_server, parallel_model, tok):
    from specdec_cli.model.prompts import render_messages

    client = parallel_server.client(timeout=ANSWER_S)
    out = client.responses.create(model="default_model", input=TOOL_QUESTION, tools=[RESPONSES_WEATHER],
                                  max_output_tokens=BOTH)
    made = [i for i in out.output if i.type == "function_call"]
    results = [{"type": "function_call_output", "call_id": i.call_id, "output": f"sunny in {city}"}
               for i, city in zip(made, CITIES)]
    # Sent back as Codex sends it: every output item, then the calls' outputs.
    follow = TOOL_QUESTION + [i.model_dump(exclude_none=True) for i in out.output] + results
    # The same conversation as chat completions carries it: one assistant message with both calls.
    calls = [{"id": i.call_id, "type": "function", "function": {"name": i.name, "arguments": i.arguments}}
             for i in made]
    chat_follow = TOOL_QUESTION + [{"role": "assistant", "content": None, "tool_calls": calls}] + \
        [{"role": "tool", "tool_call_id": r["call_id"], "content": r["output"]} for r in results]

    def prompt(req: protocol.ChatRequest) -> list[int]:
        return render_messages(tok, protocol.chat_messages(req), tools=req.tools).ids

    request = responses_api.ResponsesRequest.model_validate_json(
        json.dumps({"input": follow, "tools": [RESPONSES_WEATHER]}))
    chat_request = protocol.ChatRequest.model_validate_json(json.dumps({"messages": chat_follow,
                                                                        "tools": [WEATHER_TOOL]}))
    assert prompt(responses_api.to_chat(request)) == prompt(chat_request)
    after = client.responses.create(model="default_model", input=follow, tools=[RESPONSES_WEATHER],
                                    max_output_tokens=1)
    # The chat route from the same start (a fresh server: its prompt cache holds what this one's held).
    fresh = Server("--model", parallel_model)
    try:
        chat = fresh.client(timeout=ANSWER_S).chat.completions
        chat.create(model="default_model", messages=TOOL_QUESTION, tools=[WEATHER_TOOL], max_tokens=BOTH)
        same = chat.create(model="default_model", messages=chat_follow, tools=[WEATHER_TOOL], max_tokens=1)
    finally:
        fresh.stop()
    assert (after.usage.input_tokens, after.usage.input_tokens_details.cached_tokens) == \
        (same.usage.prompt_tokens, same.usage.prompt_tokens_details.cached_tokens)
# --- 7a. a text.format that is not an object -------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_a_text_format_that_is_not_an_object_is_a_400_naming_it(tools_server, stream):
    for fmt in ("json_object", 5, ["json_object"]):
        r = post(tools_server, "/v1/responses", {"input": "hi", "max_output_tokens": 3, "stream": stream,
                                                 "text": {"format": fmt}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text
    assert "Traceback" not in tools_server.log


# --- 7b. integers a grammar cannot match exactly -----------------------------------------------------------

def test_a_schema_number_the_grammar_cannot_match_exactly_is_refused_by_its_place(tok):
    # llguidance's binding refuses integers beyond 64 bits (ValueError), reads a const or an enum as a float
    # (2**53 + 1 would be matched as 2**53) and crashes on one near -2**63.
    # A bound past 2**63 - 1 is capped there: 2**63 - 1 would be matched, 2**63 + 8 (in range) not.
    for schema, where in (({"type": "integer", "maximum": 2**64}, "at maximum"),
                          ({"type": "integer", "minimum": 2**63 + 5, "maximum": 2**63 + 10}, "at minimum"),
                          ({"type": "integer", "minimum": -(2**63) - 1}, "at minimum"),
                          ({"properties": {"a": {"enum": [1, -(2**63) + 1]}}}, "at properties.a.enum[1]"),
                          ({"const": 2**53 + 1}, "at const")):
        with pytest.raises(ConstraintError, match=re.escape(where)):
            grammar_text(Constraint.json_schema(schema), tok)
    tool = {"name": "f", "parameters": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 2**64}}}}
    with pytest.raises(ConstraintError, match=r"tool 'f' .* at parameters\.properties\.n\.maximum"):
        grammar_text(Constraint.tool_call([tool]), tok)
    for schema in ({"type": "integer", "maximum": 2**63 - 1, "minimum": -(2**63)}, {"const": 2**53}):
        grammar_text(Constraint.json_schema(schema), tok)  # within reach: taken as before


def test_an_integer_beyond_64_bits_in_a_schema_is_a_400_naming_the_field(tools_server):
    big = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 2**64}}}
    r = post(tools_server, "/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": big}}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format.json_schema.schema" and "properties.n.maximum" in error["message"]
    r = post(tools_server, "/v1/chat/completions", {**CHAT, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "get_weather", "parameters": big}}]})
    assert r.status_code == 400 and "parameters.properties.n.maximum" in r.json()["error"]["message"], r.text
    r = post(tools_server, "/v1/responses", {"input": "hi", "max_output_tokens": 3, "text": {
        "format": {"type": "json_schema", "name": "x", "schema": {"type": "integer", "minimum": -(2**63) - 1}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.schema", r.text
    assert "Traceback" not in tools_server.log


# --- 7c. "stream": null -------------------------------------------------------------------------------------

def test_a_null_stream_is_false_on_every_route(tools_server):
    for path, body in ROUTES:
        r = tools_server.post(path, {**body, "stream": None})
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/json"), (path, r.text)
    r = post(tools_server, "/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": None}})
    chunks = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert r.status_code == 200 and chunks and not any("usage" in c for c in chunks), r.text


# --- 7d. a prompt over the context names the route's own field ------------------------------------------------

def test_a_prompt_over_the_context_names_input_on_the_responses_api_and_messages_on_anthropics(tools_server):
    long = "x " * 5000
    r = post(tools_server, "/v1/responses", {"input": long, "max_output_tokens": 3})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == "input", r.text
    r = tools_server.post("/v1/messages", {"model": "default_model", "max_tokens": 3,
                                           "messages": [{"role": "user", "content": long}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages: "), r.text


# --- 7e. a number JSON cannot hold (1e999) --------------------------------------------------------------------

def test_a_number_out_of_floats_range_is_a_400_naming_it_before_generating_on_every_api(tools_server):
    schema = {"type": "object", "properties": {"a": {"type": "number", "maximum": 1e999}}}
    asks = [("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
                "name": "f", "parameters": schema}}]}, "tools[0].function.parameters.properties.a.maximum"),
            ("/v1/completions", {"prompt": "Hi", "max_tokens": 3, "x_ours": [float("nan")]}, "x_ours[0]"),
            ("/v1/responses", {"input": "hi", "max_output_tokens": 3, "tools": [
                {"type": "function", "name": "f", "parameters": schema}]}, "tools[0].parameters.properties.a.maximum"),
            ("/v1/messages", {"model": "default_model", "max_tokens": 3, "messages": HELLO, "tools": [
                {"name": "f", "input_schema": schema}]}, "tools[0].input_schema.properties.a.maximum")]
    for path, body, where in asks:
        before = len(tools_server.lines)
        r = tools_server.post(path, json.dumps(body).replace("Infinity", "1e999"))  # as a client writes it
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert error["message"].startswith(f"{where}: a number out of"), (path, r.text)
        assert error.get("param", where) == where
        assert not any("generated" in line for line in tools_server.lines[before:]), path  # refused before
    assert "Traceback" not in tools_server.log


# --- 7f. a forced call whose tool schema cannot be compiled names that schema ----------------------------------

def test_a_forced_call_whose_tool_schema_fails_names_that_tools_schema_not_tool_choice(tools_server):
    # The call's grammar holds every tool's parameters: the field at fault is the tool's schema (the choice to
    # force a call was fine), and the reason is that schema's, not the whole call grammar quoted back.
    good = {"type": "object", "properties": {"city": {"type": "string"}}}
    bad = {"type": "object", "properties": {"city": {"type": "nonsense"}}}
    chat_tools = [{"type": "function", "function": {"name": n, "parameters": p}}
                  for n, p in (("ok", good), ("get_weather", bad))]
    asks = [("/v1/chat/completions", {**CHAT, "tools": chat_tools, "tool_choice": "required"},
             "tools[1].function.parameters"),
            ("/v1/chat/completions", {**CHAT, "tools": chat_tools, "tool_choice": {
                "type": "function", "function": {"name": "get_weather"}}}, "tools[1].function.parameters"),
            ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
                "name": "f", "parameters": "an object"}}], "tool_choice": "required"}, "tools[0].function.parameters"),
            ("/v1/responses", {"input": "hi", "max_output_tokens": 3, "tool_choice": "required", "tools": [
                {"type": "function", "name": "ok", "parameters": good}, {"type": "web_search"},
                {"type": "namespace", "name": "ns", "tools": [
                    {"type": "function", "name": "ok2", "parameters": good},
                    {"type": "function", "name": "get_weather", "parameters": bad}]}]}, "tools[2].tools[1].parameters"),
            ("/v1/messages", {"model": "default_model", "max_tokens": 3, "messages": HELLO,
                              "tool_choice": {"type": "tool", "name": "get_weather"}, "tools": [
                {"name": "ok", "input_schema": good}, {"name": "get_weather", "input_schema": bad}]},
             "tools[1].input_schema")]
    for path, body, where in asks:
        r = tools_server.post(path, body) if path == "/v1/messages" else post(tools_server, path, body)
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert error.get("param", where) == where, (path, r.text)  # Anthropic's shape has no param: the message
        assert error["message"].startswith(f"{where}: ") or path != "/v1/messages", r.text
        assert "Invalid type: nonsense" in error["message"] or "a JSON schema object" in error["message"], r.text
        assert "%json" not in error["message"], (path, r.text)
    assert "Traceback" not in tools_server.log


# --- 7g. an earlier call's arguments that decode to no encodable text ------------------------------------------

def test_earlier_call_arguments_that_decode_badly_are_rendered_as_sent_not_a_500(tools_server):
    # A call's arguments are decoded for the template; a "\ud800" escape (a model may write one) decoded to a lone
    # surrogate the tokenizer cannot encode, and nesting past Python's recursion limit raised RecursionError:
    # both were a 500. They stay the text the client sent, as arguments that are not JSON do.
    for arguments in ('{"city": "\\ud800"}', '{"a": ' + "[" * 1200 + "]" * 1200 + "}"):
        call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        messages = [*TOOL_QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
        r = post(tools_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 3})
        assert r.status_code == 200, r.text
        items = [{"role": "user", "content": TOOL_QUESTION[0]["content"]},
                 {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": arguments},
                 {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
        r = post(tools_server, "/v1/responses", {"input": items, "max_output_tokens": 3})
        assert r.status_code == 200, r.text
    assert "Traceback" not in tools_server.log


# --- 7h. chat_template_kwargs that are the renderer's own arguments -------------------------------------------

def test_chat_template_kwargs_that_are_the_renderers_arguments_are_refused_by_name(tools_server):
    # They failed as "messages" (a second value for tokenize, add_generation_prompt, ...), or silently replaced
    # the model's template with the client's (chat_template), so the prompt was no longer the model's.
    for kwargs in ({"chat_template": "{{ messages[0]['content'] }}"}, {"tokenize": True}, {"messages": []},
                   {"add_generation_prompt": False}, {"tools": 5}):
        r = post(tools_server, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": kwargs})
        (key,) = kwargs
        assert r.status_code == 400 and r.json()["error"]["param"] == f"chat_template_kwargs.{key}", r.text
    r = post(tools_server, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text  # a template variable: taken as before
    r = tools_server.post("/v1/messages", {"model": "default_model", "max_tokens": 3, "messages": HELLO,
                                           "chat_template_kwargs": {"chat_template": "x"}})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("chat_template_kwargs.chat_template: ")


# --- 7i. chat's constraints sent to text completions ----------------------------------------------------------

def test_a_constraint_sent_to_text_completions_is_refused_not_ignored(tools_server):
    # A text completion has no grammar: the answer came back unconstrained, free text where JSON was asked for.
    for field, value in (("response_format", {"type": "json_object"}),
                         ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
                         ("tool_choice", "required")):
        r = post(tools_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    for field, value in (("response_format", {"type": "text"}), ("tool_choice", "none")):  # they change nothing
        assert post(tools_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, field: value}).status_code == 200


# --- 7j. a body nested past the recursion limit ----------------------------------------------------------------

def test_a_body_nested_too_deeply_is_invalid_json_on_every_route(tools_server):
    # FastAPI answered it "There was an error parsing the body" with no code, unlike any other unreadable body.
    deep = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "x": ' + "[" * 5000 + "]" * 5000 + "}"
    for path, _ in ROUTES:
        r = tools_server.post(path, deep)
        assert r.status_code == 400, (path, r.text)
        if "/messages" in path:  # Anthropic's shape: no code
            assert r.json()["error"]["message"].startswith("the request body is not valid JSON"), r.text
        else:
            assert r.json()["error"]["code"] == "invalid_json", (path, r.text)


# --- 7k. a forced call's parameters with local references ($defs) ----------------------------------------------

def test_a_forced_call_whose_parameters_use_defs_is_made_not_refused(tools_server):
    # pydantic (the openai client's pydantic_function_tool) writes nested models as {"$ref": "#/$defs/X"}: inside the
    # call's grammar, "#" was the call's root, where no $defs are, and every such forced call was a 400.
    city = {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"],
            "$defs": {"City": {"type": "string", "enum": ["Paris", "Rome"]}}}
    where = {"type": "object", "properties": {"where": {"$ref": "#/definitions/Loc"}}, "required": ["where"],
             "definitions": {"Loc": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]}}}
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in (("get_weather", city),
                                                                                         ("locate", where))]
    for offered, choice in ((tools[:1], "required"), (tools, "required"),
                            (tools, {"type": "function", "function": {"name": "locate"}})):
        r = post(tools_server, "/v1/chat/completions", {"messages": TOOL_QUESTION, "max_tokens": 200, "tools": offered,
                                                       "tool_choice": choice, "parallel_tool_calls": False})
        assert r.status_code == 200, r.text
        (call,) = r.json()["choices"][0]["message"]["tool_calls"]
        arguments = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_weather":
            assert arguments["city"] in ("Paris", "Rome")
        else:
            assert isinstance(arguments["where"]["lat"], (int, float))


# --- 7l. a compressed body ------------------------------------------------------------------------------------

def test_a_gzip_or_deflate_body_is_read_and_other_encodings_are_refused_by_name(tools_server):
    # A gzipped body was read as it came and refused as JSON 'nested too deeply' (its bytes are not UTF-8).
    import gzip
    import zlib

    raw = json.dumps({"messages": HELLO, "max_tokens": 2}).encode()
    for encoding, body in (("gzip", gzip.compress(raw)), ("deflate", zlib.compress(raw)),
                           ("deflate", zlib.compress(raw)[2:-4]), ("identity", raw)):
        r = httpx.post(f"{tools_server.url}/v1/chat/completions", content=body, timeout=ANSWER_S,
                       headers={"content-type": "application/json", "content-encoding": encoding})
        assert r.status_code == 200, (encoding, r.text)
    for encoding, body, status in (("br", raw, 415), ("gzip", raw, 400), ("gzip", gzip.compress(raw)[:-9], 400),
                                   ("gzip", gzip.compress(b" " * (33 * 2**20) + raw), 413)):
        for path in ("/v1/chat/completions", "/v1/messages"):
            r = httpx.post(f"{tools_server.url}{path}", content=body, timeout=ANSWER_S,
                           headers={"content-type": "application/json", "content-encoding": encoding})
            assert r.status_code == status, (encoding, path, r.text)
            error = r.json()["error"]
            if status != 413:
                assert error["message"].startswith(("content-encoding", "the request body is not valid gzip")), r.text
                assert path == "/v1/messages" or error["param"] == "content-encoding", r.text
    assert health(tools_server).status_code == 200


def test_a_body_that_is_empty_not_an_object_or_not_utf8_is_refused_saying_so(tools_server):
    # These said 'Field required' / 'Input should be a valid dictionary ...' naming nothing, or called latin-1
    # bytes JSON 'nested too deeply to read'.
    for body, says in ((b"", "the request body is empty"), (b"[1, 2]", "the request body is not a JSON object"),
                       (b'"hi"', "the request body is not a JSON object"),
                       ('{"messages": "caf\xe9"}'.encode("latin-1"), "the request body is not valid JSON (not UTF-8")):
        for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
            r = httpx.post(f"{tools_server.url}{path}", content=body, timeout=ANSWER_S)
            assert r.status_code == 400 and r.json()["error"]["message"].startswith(says), (path, body, r.text)


def test_head_is_answered_where_get_is(tools_server):
    # Uptime monitors and curl -I ask with HEAD: a 405 read as a server that is down.
    for path in ("/health", "/v1/models", "/v1/models/default_model"):
        r = httpx.head(f"{tools_server.url}{path}", timeout=ANSWER_S)
        assert r.status_code == 200 and r.content == b"", (path, r.status_code, r.content)
    assert httpx.head(f"{tools_server.url}/v1/models/gpt-9", timeout=ANSWER_S).status_code == 404


# --- 7m. the legacy function-calling fields ---------------------------------------------------------------------

def test_the_legacy_function_fields_are_refused_by_name_not_ignored():
    # functions / function_call (the API's form before tools) were ignored: the model was never offered the
    # functions, and a forced function_call came back as free text.
    fn = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    called = {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": "{}"}}
    for extra, param in (({"functions": [fn]}, "functions"), ({"functions": [fn], "function_call": "auto"}, "functions"),
                         ({"function_call": {"name": "get_weather"}}, "function_call"),
                         ({"messages": [*HELLO, called, *HELLO]}, "messages[1].function_call")):
        err = protocol.unsupported(protocol.ChatRequest.model_validate({"messages": HELLO, **extra}))
        assert err is not None and err.status == 400 and err.param == param, (extra, err and err.message)
    for extra in ({"functions": []}, {"function_call": "none"}, {"function_call": "auto"}):  # they change nothing
        assert protocol.unsupported(protocol.ChatRequest.model_validate({"messages": HELLO, **extra})) is None


# --- 7n. a message whose content is an empty list -----------------------------------------------------------------

def test_a_message_with_an_empty_content_list_is_refused_not_read_as_empty_text():
    # Read as "": the user's turn (a system message, a tool's result) vanished unsaid and the model answered nothing
    # it was asked; the Messages API already refused it.
    for messages, param in (([{"role": "user", "content": []}], "messages[0].content"),
                            ([*HELLO, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": []}],
                             "messages[2].content"),
                            ([{"role": "system", "content": []}, *HELLO], "messages[0].content")):
        err = protocol.unsupported(protocol.ChatRequest.model_validate({"messages": messages}))
        assert err is not None and err.status == 400 and err.param == param, (messages, err and err.message)
    for items, param in (([{"role": "user", "content": []}], "input[0].content"),
                         ([{"type": "message", "role": "developer", "content": []}, {"role": "user", "content": "Hi"}],
                          "input[0].content")):
        with pytest.raises(protocol.ApiError) as e:
            responses_api.to_chat(responses_api.ResponsesRequest.model_validate({"input": items}))
        assert e.value.status == 400 and e.value.param == param, e.value.message
    # An assistant turn with only calls may carry no text.
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    body = {"messages": [*HELLO, {"role": "assistant", "content": [], "tool_calls": calls},
                         {"role": "tool", "tool_call_id": "c", "content": "ok"}]}
    assert protocol.unsupported(protocol.ChatRequest.model_validate(body)) is None


# --- 7o. a text completion's prompt as a batch of one list of token ids -------------------------------------------

def test_a_prompt_of_one_list_of_token_ids_is_that_prompt(tools_server):
    # The openai client types prompt as a list of token lists too; a batch of one (as ["text"] is taken) was
    # refused as "prompt[0]: Input should be a valid string, or Input should be a valid integer".
    body = {"max_tokens": 4, "temperature": 0}
    alone = post(tools_server, "/v1/completions", {**body, "prompt": [5, 6, 7]})
    batch = post(tools_server, "/v1/completions", {**body, "prompt": [[5, 6, 7]]})
    assert alone.status_code == batch.status_code == 200, batch.text
    assert batch.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    assert batch.json()["usage"]["prompt_tokens"] == alone.json()["usage"]["prompt_tokens"]
    r = post(tools_server, "/v1/completions", {**body, "prompt": [[5, 6], [7]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "one prompt per request" in r.json()["error"]["message"]


# --- 7p. top_p 0 ------------------------------------------------------------------------------------------------

def test_a_top_p_of_0_samples_the_likeliest_token_as_openai_reads_it(tools_server):
    # mlx-lm reads top_p 0 as no filter: a client asking OpenAI's "the smallest set reaching no mass" (the likeliest
    # token) got draws from the whole vocabulary, while top_p 1e-9 gave the greedy text.
    body = {"messages": HELLO, "max_tokens": 8}
    greedy = post(tools_server, "/v1/chat/completions", {**body, "temperature": 0}).json()
    for seed in (1, 2):
        r = post(tools_server, "/v1/chat/completions", {**body, "temperature": 1.0, "top_p": 0, "seed": seed})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"] == greedy["choices"][0]["message"], seed
        r = post(tools_server, "/v1/responses", {"input": HELLO[0]["content"], "max_output_tokens": 8,
                                                 "temperature": 1.0, "top_p": 0, "seed": seed})
        assert r.json()["output"][0]["content"][0]["text"] == greedy["choices"][0]["message"]["content"], r.text


# --- 7q. an assistant's refusal part sent back ---------------------------------------------------------------------

def test_an_assistant_refusal_part_sent_back_is_its_text():
    # The openai client types an assistant's content parts as text or refusal ({"type": "refusal", "refusal": ...}):
    # a conversation sent back with one was refused as "not supported: this server runs a text model".
    refused = {"role": "assistant", "content": [{"type": "text", "text": "No. "}, {"type": "refusal",
                                                                                   "refusal": "I cannot help."}]}
    req = protocol.ChatRequest.model_validate({"messages": [*HELLO, refused, *HELLO]})
    assert protocol.unsupported(req) is None
    assert protocol.chat_messages(req)[1] == {"role": "assistant", "content": "No. I cannot help."}
    assert protocol.content_chars(req) == 2 * len(HELLO[0]["content"]) + len("No. I cannot help.")
    bare = {"role": "assistant", "content": [{"type": "refusal"}]}
    err = protocol.unsupported(protocol.ChatRequest.model_validate({"messages": [*HELLO, bare, *HELLO]}))
    assert err is not None and err.param == "messages[1].content[0].refusal", err and err.message


# --- 7r. a tool_choice of another type on chat -----------------------------------------------------------------

def test_a_chat_tool_choice_of_another_type_is_named_as_unsupported():
    # allowed_tools and custom (the openai client's newer shapes) were told "tool_choice names a function as ...",
    # as though the function's name were missing.
    tools = [{"type": "function", "function": {"name": "f"}}]
    for choice in ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": tools}},
                   {"type": "custom", "custom": {"name": "f"}}):
        req = protocol.ChatRequest.model_validate({"messages": HELLO, "tools": tools, "tool_choice": choice})
        with pytest.raises(protocol.ApiError) as e:
            protocol.constraint(req)
        assert e.value.param == "tool_choice" and repr(choice["type"]) in e.value.message, e.value.message
    named = protocol.ChatRequest.model_validate({"messages": HELLO, "tools": tools,
                                                 "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert protocol.constraint(named)[0] == "tool_call"


def test_a_responses_tool_choice_without_its_name_is_told_in_that_apis_shape():
    # Checked as chat's, it was told to name a function as {"type": "function", "function": {"name": ...}}: a shape
    # the Responses API does not take.
    tools = [{"type": "function", "name": "f"}]
    for choice in ({"type": "function"}, {"type": "function", "name": 5}, {"type": "custom"}):
        req = responses_api.ResponsesRequest.model_validate({"input": "hi", "tools": tools, "tool_choice": choice})
        with pytest.raises(protocol.ApiError) as e:
            protocol.constraint(responses_api.to_chat(req))
        assert e.value.param == "tool_choice", e.value.message
        assert f'{{"type": "{choice["type"]}", "name": ...}}' in e.value.message and '"function": {' not in \
            e.value.message, e.value.message


def test_a_non_finite_temperature_or_top_p_is_called_so_on_the_responses_and_messages_apis():
    # Chat says "finite"; these said "Input should be less than or equal to 2" for NaN, which is no such thing.
    from pydantic import ValidationError

    for model, body in ((responses_api.ResponsesRequest, {"input": "hi"}),
                        (messages_api.MessagesRequest, {"model": "m", "max_tokens": 2, "messages": HELLO})):
        for field in ("temperature", "top_p"):
            for value in (float("nan"), float("inf")):
                with pytest.raises(ValidationError) as e:
                    model.model_validate({**body, field: value})
                err = protocol.validation_error(e.value)
                assert err.param == field and "finite" in err.message, err.message


def test_a_failure_made_not_raised_is_logged_in_its_one_line(caplog):
    # A request failed because the generation thread had ended (a rank lost) logged its error twice: the line,
    # then a one-line "traceback" repeating it (RuntimeError: ...), for an exception that was never raised.
    from specdec_cli.serve.app import _failure

    with caplog.at_level("ERROR", logger="specdec"):
        assert _failure(RuntimeError("the server's ranks cannot go on together")).status == 500
    assert [r.exc_info for r in caplog.records] == [None]
