"""The HTTP layer: FastAPI routes, server-sent events, errors in OpenAI's shape, authentication.

The only module that imports the web framework. Every failure a client can
cause answers a 4xx in OpenAI's error shape (one exception handler per kind,
here), or in Anthropic's on ``/v1/messages`` paths (converted on the way out);
generation runs on the service's own thread, so ``/health`` and ``/v1/models``
answer while a request is generated. The Anthropic Messages and OpenAI
Responses routes translate to chat requests (``anthropic``, ``responses``)
and answer through a shape object of their module.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import zlib
from contextlib import asynccontextmanager
from typing import AsyncIterator, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import SpecdecError
from . import anthropic, responses
from .protocol import ApiError, ChatRequest, CompletionRequest, error_body, validation_error
from .service import Prepared, Service
from .scheduler import Busy, Done, Failed

log = logging.getLogger("specdec.serve")

# A comment line keeps proxies and clients from timing out while a long prompt is prefilled.
KEEPALIVE_S = 10.0
MAX_BODY_BYTES = 32 * 2**20
# A request body must arrive whole within this long once its headers are in.
BODY_TIMEOUT_S = 60.0
# Where errors answer in Anthropic's shape (the Messages API's routes).
ANTHROPIC_PATHS = "/v1/messages"
# The one route open without the API key (load balancers and the tests' start-up wait poll it).
HEALTH_PATH = "/health"


def _error(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
           kind: Optional[str] = None, headers: Optional[dict] = None) -> JSONResponse:
    err = ApiError(status, message, param, code, kind, headers)
    return _answer_error(err)


def _answer_error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class _BodyLimit:
    """Read the whole body first, refusing one over ``limit`` bytes with a 413 (sent chunked or not).

    The app then reads the buffered body, and every later ``receive`` goes to
    the server's own, so a handler still sees the client's disconnect. A
    body is JSON whatever its content-type says (curl's ``-d`` says a form;
    mlx_lm.server reads JSON the same way).
    """

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = _error(413, f"the request body is over {self.limit // 2**20} MiB", code="request_too_large")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await too_big(scope, receive, send)
        parts, seen = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), BODY_TIMEOUT_S)
            except asyncio.TimeoutError:
                late = _error(408, f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s",
                              code="request_timeout")
                return await late(scope, receive, send)
            if message["type"] != "http.request":
                return  # the client left before its body was whole: nobody to answer
            parts.append(message.get("body", b""))
            seen += len(parts[-1])
            if seen > self.limit:
                return await too_big(scope, receive, send)
            if not message.get("more_body", False):
                break
        body: Optional[bytes] = b"".join(parts)
        if scope.get("method") == "POST":
            encoding = dict(scope.get("headers") or []).get(b"content-encoding", b"").strip().lower()
            if encoding not in (b"", b"identity"):
                body, refusal = _decoded(body, encoding, self.limit)
                if refusal is not None:
                    return await refusal(scope, receive, send)
            dropped = (b"content-type", b"content-encoding", b"content-length")
            headers = [(k, v) for k, v in scope.get("headers") or [] if k.lower() not in dropped]
            scope = {**scope, "headers": headers + [(b"content-type", b"application/json"),
                                                    (b"content-length", str(len(body)).encode())]}

        async def replay() -> Message:
            nonlocal body
            if body is None:
                return await receive()
            message, body = {"type": "http.request", "body": body, "more_body": False}, None
            return message

        await self.app(scope, replay, send)


def _decoded(body: bytes, encoding: bytes, limit: int) -> tuple[bytes, Optional[JSONResponse]]:
    """A ``Content-Encoding: gzip`` / ``deflate`` body inflated, at most ``limit`` bytes; else the refusal to send.

    Read as it came, a compressed body was refused as JSON 'nested too deeply' (its bytes are not UTF-8).
    """
    name = encoding.decode("latin-1")
    if encoding not in (b"gzip", b"x-gzip", b"deflate"):
        return body, _error(415, f"content-encoding {name!r} is not supported: send the body as it is, or gzip or "
                            "deflate it", "content-encoding", "unsupported_content_encoding")
    # wbits 47: a gzip or zlib header, found from the data; deflate sent raw (no header) as some clients do: -15.
    for wbits in (47, -15) if encoding == b"deflate" else (47,):
        inflate = zlib.decompressobj(wbits)
        try:
            out = inflate.decompress(body, limit + 1)
        except zlib.error:
            continue
        if len(out) > limit or inflate.unconsumed_tail:
            return body, _error(413, f"the request body is over {limit // 2**20} MiB once decompressed",
                                code="request_too_large")
        if inflate.eof:
            return out, None
    return body, _error(400, f"the request body is not valid {name} data (content-encoding: {name})",
                        "content-encoding", "invalid_body")


def _has_key(headers: list[tuple[bytes, bytes]], key: bytes) -> bool:
    """Whether ASGI ``headers`` carry ``key``: ``Authorization: Bearer KEY`` or ``x-api-key: KEY``.

    Either one holding it will do: a client may send both (the Anthropic clients, given a token and an API
    key: a token left at ``none`` and the key as API key was refused, the bearer alone being read).
    """
    found = dict(headers or [])
    bearer = found.get(b"authorization", b"")
    given = [bearer[7:]] if bearer[:7].lower() == b"bearer " else []
    if b"x-api-key" in found or not given:
        given.append(found.get(b"x-api-key", b""))
    return any([hmac.compare_digest(g.strip(), key) for g in given])


class _ApiKey:
    """With a key set, every request but ``GET /health`` needs it: ``Authorization: Bearer KEY`` or ``x-api-key: KEY``.

    Unknown paths too (a 401, not a 404 listing the routes), and the routes without
    ``/v1``. A plain ASGI middleware (Starlette's ``BaseHTTPMiddleware`` wraps ``receive``
    so that a handler never saw its client go away).
    """

    def __init__(self, app: ASGIApp, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") != HEALTH_PATH:
            if not _has_key(scope.get("headers"), self.key):
                refusal = _error(401, "a valid API key is needed: send Authorization: Bearer <key> "
                                 "(or x-api-key: <key>)", code="invalid_api_key")
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)


class _AnthropicErrors:
    """Errors answered on ``/v1/messages`` paths leave in Anthropic's shape, whoever made them."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(ANTHROPIC_PATHS):
            return await self.app(scope, receive, send)
        start: Optional[dict] = None
        chunks: list[bytes] = []

        async def shaped(message: dict) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = anthropic.from_openai_error(start["status"], b"".join(chunks))
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            await send({**start, "headers": headers + [(b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, shaped)


def _sse(body: dict, event: Optional[str] = None) -> str:
    named = f"event: {event}\n" if event else ""
    return f"{named}data: {json.dumps(body, ensure_ascii=False)}\n\n"


def create_app(service: Service, api_key: Optional[str] = None, max_body_bytes: int = MAX_BODY_BYTES,
               allow_origins: Sequence[str] = ()) -> FastAPI:
    """The ASGI application serving ``service``.

    Args:
        service: The session behind the API.
        api_key: When set, every request but ``GET /health`` needs ``Authorization: Bearer <api_key>``.
        max_body_bytes: Larger request bodies get a 413.
        allow_origins: Origins whose web pages may call the server from a browser (CORS; ``*``: any).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.scheduler.start()
        try:
            yield
        finally:
            service.scheduler.stop()

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return _answer_error(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            return _error(400, "the request body is not valid JSON", code="invalid_json")
        body_kind = first.get("type") if tuple(first.get("loc", ())) == ("body",) else None
        if body_kind in ("missing", "model_attributes_type", "model_type", "dict_type"):
            # The body as a whole is no object: pydantic's words would name no field.
            what = "empty" if body_kind == "missing" else "not a JSON object"
            return _error(400, f"the request body is {what}: send a JSON object of the route's fields",
                          code="invalid_json" if what == "empty" else "invalid_value")
        return _answer_error(validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        messages = {404: f"no route {request.url.path}: this server answers /v1/chat/completions, "
                         "/v1/completions, /v1/messages, /v1/messages/count_tokens, /v1/responses, "
                         "/v1/models[/ID] and /health",
                    405: f"{request.method} is not allowed on {request.url.path}"}
        if e.status_code == 400 and e.detail == "There was an error parsing the body":
            # FastAPI's answer to a body json cannot read other than by a decode error (bytes that are not
            # UTF-8 text, nesting past the recursion limit): not JSON this server can read, as any malformed body.
            return _error(400, "the request body is not valid JSON (not UTF-8 text, or nested too deeply to read)",
                          code="invalid_json")
        return _error(e.status_code, messages.get(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error")
        message = "the server failed on this request; its log says why"
        if request.url.path.startswith(ANTHROPIC_PATHS):  # answered outside the middleware that converts
            return JSONResponse(anthropic.error_body(500, message), status_code=500)
        return _error(500, message, kind="server_error")

    # The last added runs first: the key is checked before a body is read.
    app.add_middleware(_BodyLimit, limit=max_body_bytes)
    if api_key is not None:
        app.add_middleware(_ApiKey, key=api_key)
    app.add_middleware(_AnthropicErrors)  # it sees every error answer
    if allow_origins:
        # Outermost: a browser's preflight carries no key and no body, and every answer needs the headers.
        app.add_middleware(CORSMiddleware, allow_origins=list(allow_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"], max_age=600)

    # HEAD too: uptime monitors (and curl -I) ask with it, and got a 405 from a server that was up.
    @app.api_route(HEALTH_PATH, methods=["GET", "HEAD"])
    async def health(request: Request):
        # Anyone may ask whether the server is up; with a key set, only its holders see more (the
        # cache folder, sizes and load tell whether a prompt was sent before).
        told = api_key is None or _has_key(request.scope.get("headers"), api_key.encode())
        if service.scheduler.fault is not None:  # nothing would be generated: not healthy
            why = service.scheduler.dead if told else "the server cannot generate; its log says why"
            return _error(503, why, code="generation_stopped")
        stalled = service.scheduler.stalled
        if stalled is not None:  # ranks that stopped answering: nothing would be generated either
            return _error(503, stalled if told else "the server cannot generate; its log says why",
                          code="ranks_stalled")
        return service.health() if told else {"status": "ok"}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> dict:
        return service.models()

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str) -> dict:
        return service.model(model_id)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions", include_in_schema=False)
    async def chat(body: ChatRequest, request: Request):
        loop = asyncio.get_running_loop()
        prepared = await asyncio.to_thread(service.prepare_chat, body, loop)
        return await _answer(service, prepared, body.stream, request)

    @app.post("/v1/completions")
    @app.post("/completions", include_in_schema=False)
    async def completions(body: CompletionRequest, request: Request):
        loop = asyncio.get_running_loop()
        prepared = await asyncio.to_thread(service.prepare_completion, body, loop)
        return await _answer(service, prepared, body.stream, request)

    @app.post("/v1/messages")
    async def create_message(body: anthropic.MessagesRequest, request: Request):
        loop = asyncio.get_running_loop()
        try:
            prepared = await asyncio.to_thread(service.prepare_chat, anthropic.to_chat(body), loop, False, True)
        except ApiError as e:
            raise anthropic.client_error(e) from None
        shape = anthropic.MessageShape(service.model_id, len(prepared.request.prompt_ids),
                                       lambda reply: service.timings(prepared, reply),
                                       capped=prepared.request.max_tokens < body.max_tokens,
                                       warm=body.max_tokens == 0)
        return await _answer(service, prepared, body.stream, request, shape)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: anthropic.CountTokensRequest) -> dict:
        return {"input_tokens": await asyncio.to_thread(service.count_chat, anthropic.to_chat(body))}

    @app.post("/v1/responses")
    async def create_response(body: responses.ResponsesRequest, request: Request):
        loop = asyncio.get_running_loop()
        try:
            prepared = await asyncio.to_thread(service.prepare_chat, responses.to_chat(body), loop, True)
        except ApiError as e:
            raise responses.client_error(e, body) from None
        shape = responses.ResponseShape(body, service.model_id, lambda reply: service.timings(prepared, reply),
                                        service.chat_logprobs)
        return await _answer(service, prepared, body.stream, request, shape)

    return app


def _failure(e: BaseException) -> ApiError:
    """What a client is told about a failure during generation."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, SpecdecError):
        return ApiError(400, str(e))
    if isinstance(e, Busy):
        return ApiError(503, str(e), code="overloaded", headers={"Retry-After": "1"})
    # One never raised (the thread had ended: made, then sent) has no traceback; its type and text would repeat it.
    log.error("generation failed: %s", e, exc_info=(type(e), e, e.__traceback__) if e.__traceback__ else None)
    return ApiError(500, "generation failed on the server; its log says why", kind="server_error")


async def _answer(service: Service, prepared: Prepared, stream: bool, request: Request, shape=None):
    """Queue a prepared request and answer it: in OpenAI's chat or text shapes, or through ``shape``
    (a dialect's: ``start``/``piece``/``done``/``failed``/``keepalive`` events, or ``whole``)."""
    if service.scheduler.fault is not None:  # no thread would take it: refused now, not left to hang
        return _error(503, service.scheduler.dead, code="generation_stopped")
    try:
        service.scheduler.submit(prepared.job)
    except Busy as e:
        return _answer_error(_failure(Busy(f"the server is busy ({e}): try again shortly")))
    if stream:
        events = _events(service, prepared) if shape is None else _shaped_events(shape, prepared)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _collect(service, prepared, request, shape)


async def _collect(service: Service, prepared: Prepared, request: Request, shape=None):
    job, pieces = prepared.job, []
    # The body is read whole: the next message the server has for this request is its disconnect.
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while True:
            item = asyncio.ensure_future(job.out.get())
            await asyncio.wait({item, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not item.done():
                item.cancel()
                log.info("the client went away before its answer was ready")
                return None
            item = item.result()
            if isinstance(item, Done):
                if shape is not None:
                    return JSONResponse(shape.whole(pieces, item.reply))
                return JSONResponse(service.response(prepared, pieces, item.reply))
            if isinstance(item, Failed):
                return _answer_error(_failure(item.error))
            pieces.append(item)
    finally:
        gone.cancel()
        job.cancel()  # a no-op once done; stops the generation (or skips a queued job) otherwise


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed its connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(service: Service, prepared: Prepared) -> AsyncIterator[str]:
    job = prepared.job
    try:
        yield _sse(service.chunk(prepared, first=True)) if prepared.kind == "chat" else ": started\n\n"
        while True:
            try:
                item = await asyncio.wait_for(job.out.get(), KEEPALIVE_S)
            except asyncio.TimeoutError:
                yield ": keepalive\n\n"
                continue
            if isinstance(item, Done):
                yield _sse(service.final_chunk(prepared, item.reply))
                if prepared.include_usage:
                    yield _sse(service.usage_chunk(prepared, item.reply))
                break
            if isinstance(item, Failed):
                # The 200 is out already: the error goes in a frame of its own, then [DONE].
                yield _sse(_failure(item.error).body())
                break
            yield _sse(service.chunk(prepared, item))
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()  # the client went away (or we are done): stop at the next block


async def _shaped_events(shape, prepared: Prepared) -> AsyncIterator[str]:
    """A dialect's event stream: each event is named by its ``type``, as Anthropic and the Responses API do."""
    job = prepared.job
    try:
        for event in shape.start():
            yield _sse(event, event["type"])
        while True:
            try:
                item = await asyncio.wait_for(job.out.get(), KEEPALIVE_S)
            except asyncio.TimeoutError:
                ping = shape.keepalive()
                yield _sse(ping, ping["type"]) if ping else ": keepalive\n\n"
                continue
            if isinstance(item, Done):
                events = shape.done(item.reply)
            elif isinstance(item, Failed):
                events = shape.failed(_failure(item.error))  # the 200 is out already: an error event
            else:
                events = shape.piece(item)
            for event in events:
                yield _sse(event, event["type"])
            if isinstance(item, (Done, Failed)):
                break
    finally:
        job.cancel()  # the client went away (or we are done): stop at the next block


__all__ = ["create_app", "error_body"]
