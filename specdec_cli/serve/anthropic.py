"""Anthropic's Messages API as a thin translation over chat completions. No MLX, no HTTP.

``POST /v1/messages`` (and ``/v1/messages/count_tokens``) requests are
pydantic models here; :func:`to_chat` turns one into the internal
:class:`~.protocol.ChatRequest` (system and content blocks to chat messages,
``tool_use`` / ``tool_result`` blocks to OpenAI tool calls and ``tool``
messages, Anthropic tools to function tools), refusing with a 400 naming the
field what this server cannot honour (images, documents, server tools,
prefill); a forced tool call (``tool_choice`` any or tool) is a grammar.
:class:`MessageShape` turns what the generation thread hands back into
Anthropic's answer: a ``message`` object, or its stream of events. Errors leave in Anthropic's shape (:func:`error_body`);
the HTTP layer converts the OpenAI-shaped ones the rest of the server makes
with :func:`from_openai_error`.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Callable, Literal, Optional, Union

from pydantic import Field, field_validator

from ..session.reply import Piece
from .dialect import chat_request, check_text
from .protocol import ApiError, ChatRequest, NullableFlag, StrictModel

# Anthropic's error type for each HTTP status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 504: "timeout_error",
               529: "overloaded_error"}
# Claude Code and its sub-agents ask for Anthropic's models by name (claude-sonnet-*, claude-opus-*,
# claude-haiku-*, its /model menu): one model is served, and it answers to all of them.
CLAUDE_PREFIX = "claude-"
# Claude Code's first system line (x-anthropic-billing-header: cc_version=...; cc_entrypoint=...; cch=...;)
# changes per version and, interactively, per request: kept, it would defeat the prompt cache.
BILLING_LINE = re.compile(r"^x-anthropic-billing-header:[^\n]*(\n|$)", re.MULTILINE)
# Fields of ours (not Anthropic's) a request may add, passed on to the chat request as they are.
EXTENSIONS = ("seed", "min_p", "num_draft_tokens", "chat_template_kwargs", "logit_bias", "presence_penalty",
              "frequency_penalty", "repetition_penalty", "repetition_context_size", "presence_context_size",
              "frequency_context_size", "repeat_penalty", "repeat_last_n", "compare_alone")


def error_body(status: int, message: str) -> dict:
    """Anthropic's error object for an HTTP status."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def from_openai_error(status: int, body: bytes) -> bytes:
    """An error answer in OpenAI's shape (``{"error": {"message", "param", ...}}``), in Anthropic's."""
    try:
        error = json.loads(body)["error"]
        message, param = str(error["message"]), error.get("param")
    except (ValueError, KeyError, TypeError):
        message, param = body.decode("utf-8", "replace").strip() or f"HTTP {status}", None
    if param and not message.startswith(f"{param}:"):
        message = f"{param}: {message}"
    return json.dumps(error_body(status, message), ensure_ascii=False).encode()


_CHAT_PARAMETERS = re.compile(r"tools\[(\d+)\]\.function\.parameters")


def client_error(e: ApiError) -> ApiError:
    """``e`` (from checking the chat request :func:`to_chat` made) naming this API's field: chat's tool
    ``parameters`` are a tool's ``input_schema`` here (chat's tools are these, in their order)."""
    m = _CHAT_PARAMETERS.match(e.param or "")
    if m:
        e.param = f"tools[{m.group(1)}].input_schema{e.param[m.end():]}"
    return e


# --- requests ------------------------------------------------------------------------


class Block(StrictModel):
    """A content block: ``text``, ``tool_use``, ``tool_result``, ``thinking``, ... (read by ``type``)."""

    type: str
    text: Optional[str] = None
    id: Optional[str] = None
    name: Optional[str] = None
    input: Optional[dict[str, Any]] = None
    tool_use_id: Optional[str] = None
    content: Union[str, list["Block"], None] = None
    is_error: Optional[bool] = None


class Message(StrictModel):
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[Block]]


class Tool(StrictModel):
    """A client tool (``name``, ``description``, ``input_schema``); server tools carry a versioned ``type``."""

    name: str
    type: Optional[str] = None
    description: Optional[str] = None
    input_schema: Optional[dict[str, Any]] = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class Thinking(StrictModel):
    # Anthropic's tags; another is a 400 there (a typo silently ignored would leave thinking as the template's default).
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = None


class CountTokensRequest(StrictModel):
    """``POST /v1/messages/count_tokens``: what the prompt is made of."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: Union[str, list[Block], None] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    # Refused when set (see to_chat); output_format is the structured-outputs beta's name for output_config.format.
    output_config: Optional[dict[str, Any]] = None
    output_format: Optional[Any] = None
    mcp_servers: Optional[list[Any]] = None
    container: Union[str, dict[str, Any], None] = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=0)  # 0: Anthropic's cache pre-warming (see MessageShape's warm)
    stop_sequences: Optional[list[str]] = None
    stream: NullableFlag = False
    temperature: Optional[float] = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    top_p: Optional[float] = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    top_k: Optional[int] = Field(default=None, ge=0)
    metadata: Optional[dict[str, Any]] = None

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty(cls, value: Optional[list[str]]) -> Optional[list[str]]:
        # Anthropic refuses an empty one (400, "each stop sequence must be non-empty"); here it was dropped unsaid.
        if value is not None and any(s == "" for s in value):
            raise ValueError("each stop sequence must be non-empty")
        return value


# --- requests to chat ------------------------------------------------------------------


def _refuse(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", param, "unsupported_parameter")


def _text(blocks: Union[str, list[Block], None], where: str) -> str:
    """Text blocks (or a string) as one string; any other block is refused."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    for j, b in enumerate(blocks):
        if b.type != "text":
            raise _refuse(f"{where}[{j}]", f"{b.type} blocks are not supported here: this server runs a text "
                          "model and reads text blocks only")
    return "\n".join(_block_text(b, f"{where}[{j}]") for j, b in enumerate(blocks))


def _block_text(block: Block, where: str) -> str:
    if block.text is None:
        raise ApiError(400, f"{where}.text: a text block needs its text: add a \"text\" string", f"{where}.text",
                       "invalid_value")
    return block.text


def _billing_dropped(system: Union[str, list[Block], None]) -> Union[str, list[Block], None]:
    """The system prompt without Claude Code's billing line (a block that held only it is left out)."""
    if isinstance(system, str):
        return BILLING_LINE.sub("", system)
    if not system:
        return system
    kept = []
    for b in system:
        if b.type == "text" and b.text and BILLING_LINE.search(b.text):
            text = BILLING_LINE.sub("", b.text)
            if not text.strip():
                continue
            b = b.model_copy(update={"text": text})
        kept.append(b)
    return kept


def _call(block: Block, where: str) -> dict:
    if block.id is None or block.name is None or block.input is None:
        raise ApiError(400, f"{where}: a tool_use block needs id, name and input", where, "invalid_value")
    return {"id": block.id, "type": "function",
            "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}}


def _messages(req: CountTokensRequest) -> tuple[list[dict], list[str]]:
    """Anthropic's system and messages as chat messages, and the client's field each came from."""
    out: list[dict] = []
    origins: list[str] = []

    def add(message: dict, origin: str) -> None:
        # Anthropic joins consecutive assistant messages into one turn (fold_roles joins users'): strict templates
        # (Gemma's, Mistral's) refuse two assistant turns in a row.
        if message["role"] == "assistant" and out and out[-1]["role"] == "assistant":
            last = out[-1]
            last["content"] = "\n".join(t for t in (last["content"], message["content"]) if t)
            if message.get("tool_calls"):
                last["tool_calls"] = last.get("tool_calls", []) + message["tool_calls"]
            return
        out.append(message)
        origins.append(origin)

    system = _text(_billing_dropped(req.system), "system")
    if system:
        add({"role": "system", "content": system}, "system")
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str) or m.role == "system":
            add({"role": m.role, "content": _text(m.content, where)}, f"messages[{i}]")
            continue
        if m.role == "assistant":
            texts, calls = [], []
            for j, b in enumerate(m.content):
                if b.type == "text":
                    texts.append(_block_text(b, f"{where}[{j}]"))
                elif b.type == "tool_use":
                    calls.append(_call(b, f"{where}[{j}]"))
                elif b.type not in ("thinking", "redacted_thinking"):  # earlier thinking: left out, as templates do
                    raise _refuse(f"{where}[{j}]", f"{b.type} blocks are not supported in assistant messages: "
                                  "text, tool_use and thinking are")
            msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            add(msg, f"messages[{i}]")
            continue
        if not m.content:  # it would vanish, and a conversation of it alone be refused as "messages" empty
            raise ApiError(400, f"{where}: a user message needs at least one block", where, "invalid_value")
        texts = []
        for j, b in enumerate(m.content):
            if b.type == "tool_result":
                if b.tool_use_id is None:
                    raise ApiError(400, f"{where}[{j}]: a tool_result block needs tool_use_id", f"{where}[{j}]",
                                   "invalid_value")
                if texts:  # text before a result keeps its place in the conversation
                    add({"role": "user", "content": "\n".join(texts)}, f"messages[{i}]")
                    texts = []
                result = _text(b.content, f"{where}[{j}].content")
                if b.is_error:  # the model must know the call failed: templates have no field for it
                    result = f"Error: {result}" if result else "Error"
                add({"role": "tool", "tool_call_id": b.tool_use_id, "content": result}, f"{where}[{j}]")
            elif b.type == "text":
                texts.append(_block_text(b, f"{where}[{j}]"))
            elif b.type in ("tool_use", "thinking", "redacted_thinking"):  # supported, in the assistant's turns
                raise ApiError(400, f"{where}[{j}]: {b.type} blocks belong in assistant messages (the model's "
                               "turns); a user message holds text and tool_result blocks", f"{where}[{j}]",
                               "invalid_value")
            else:
                raise _refuse(f"{where}[{j}]", f"{b.type} blocks are not supported: this server runs a text model "
                              "and reads text and tool_result blocks")
        if texts:
            add({"role": "user", "content": "\n".join(texts)}, f"messages[{i}]")
    # Counting generates nothing: a conversation that ends with the assistant's turn is counted as it is.
    if req.messages[-1].role == "assistant" and isinstance(req, MessagesRequest):
        raise _refuse(f"messages[{len(req.messages) - 1}]", "the last message must be the user's: continuing an "
                      "assistant message (prefill) is not supported")
    return out, origins


def _tools(req: CountTokensRequest) -> Optional[list[dict]]:
    if not req.tools:
        return None
    out = []
    for i, t in enumerate(req.tools):
        if t.type not in (None, "custom"):
            raise _refuse(f"tools[{i}]", f"the server tool {t.type!r} is not run here: only client tools "
                          "(name, description, input_schema) are")
        if t.input_schema is None:
            raise ApiError(400, f"tools[{i}].input_schema: Field required", f"tools[{i}].input_schema",
                           "invalid_value")
        # Anthropic refuses these too: a call to a name two tools share could not say which was meant.
        if not t.name:
            raise ApiError(400, f"tools[{i}].name: a tool needs a name", f"tools[{i}].name", "invalid_value")
        if any(u.name == t.name for u in req.tools[:i]):
            raise ApiError(400, f"tools[{i}].name: tool names must be unique ({t.name!r} is taken)",
                           f"tools[{i}].name", "invalid_value")
        fn: dict[str, Any] = {"name": t.name}
        if t.description is not None:
            fn["description"] = t.description
        fn["parameters"] = t.input_schema
        out.append({"type": "function", "function": fn})
    return out


def to_chat(req: CountTokensRequest) -> ChatRequest:
    """The chat request a Messages request (or a token count) amounts to.

    Raises:
        ApiError: A 400 naming the field this server cannot honour.
    """
    choice: Any = req.tool_choice.type if req.tool_choice is not None else None
    # A forced call (any tool, or the named one) is a grammar over the model's tool-call format.
    if choice in ("any", "tool") and not req.tools:  # in this API's words (chat's would say 'required')
        raise ApiError(400, f"tool_choice: a tool_choice of type {choice} needs tools", "tool_choice",
                       "invalid_value")
    if choice == "any":
        choice = "required"
    elif choice == "tool":
        if not req.tool_choice.name:
            raise ApiError(400, "a tool_choice of type tool needs the tool's name", "tool_choice.name",
                           "invalid_value")
        choice = {"type": "function", "function": {"name": req.tool_choice.name}}
    if (req.output_config or {}).get("format") is not None:
        raise _refuse("output_config.format", "structured output is not supported (plain text only)")
    if req.output_format is not None:  # ignored, the answer would not be the JSON asked for
        raise _refuse("output_format", "structured output is not supported (plain text only)")
    if req.mcp_servers:
        raise _refuse("mcp_servers", "this server connects to no MCP servers: give their tools as client tools")
    if req.container is not None:
        raise _refuse("container", "this server runs no containers")
    check_text(req)
    model = None if req.model.startswith(CLAUDE_PREFIX) else req.model
    messages, origins = _messages(req)
    body: dict[str, Any] = {"model": model, "messages": messages, "tools": _tools(req), "tool_choice": choice}
    if req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use:
        body["parallel_tool_calls"] = False
    kwargs: dict[str, Any] = {}
    if req.thinking is not None:
        kwargs["enable_thinking"] = req.thinking.type != "disabled"
    extra = req.model_extra or {}
    if isinstance(extra.get("chat_template_kwargs"), dict):
        kwargs.update(extra["chat_template_kwargs"])
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    body.update({k: extra[k] for k in EXTENSIONS if k in extra and k != "chat_template_kwargs"})
    if isinstance(req, MessagesRequest):
        # max_tokens 0 warms the prompt cache: one token is generated (the prompt is read and kept), none is sent.
        body.update(max_tokens=max(req.max_tokens, 1), stop=req.stop_sequences, stream=req.stream,
                    temperature=req.temperature, top_p=req.top_p, top_k=req.top_k)
    return chat_request(body, origins)


# --- answers ---------------------------------------------------------------------------


def stop_reason(finish_reason: Optional[str], stop_string: Optional[str], capped: bool = False) -> str:
    """Anthropic's ``stop_reason`` for a reply's finish reason; ``capped``: the model's context cut the
    request's ``max_tokens``, so a reply cut by length ended at the context, not at ``max_tokens``."""
    if stop_string is not None:
        return "stop_sequence"
    if finish_reason == "length" and capped:  # Anthropic's reason; max_tokens would say the client's limit was met
        return "model_context_window_exceeded"
    return {"length": "max_tokens", "tool_calls": "tool_use"}.get(finish_reason or "stop", "end_turn")


def usage(stats) -> dict:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens the prompt cache did not hold."""
    return {"input_tokens": stats.prompt_tokens - stats.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": stats.cached_tokens, "output_tokens": stats.generated}


class MessageShape:
    """One request's answer in Anthropic's shapes: the ``message`` object, or its events.

    The same fold of pieces into content blocks makes both, so a streamed
    answer's blocks are the non-streamed one's.

    Args:
        model: The served model's id.
        prompt_tokens: The prompt's length (``message_start`` reports it before the prompt cache is read).
        timings: The ``timings`` object of a finished reply.
        capped: The model's context cut the request's ``max_tokens`` (see :func:`stop_reason`).
        warm: ``max_tokens`` 0 (Anthropic's cache pre-warming): the prompt is read into the prompt cache and
            the answer has no content, ``stop_reason`` max_tokens and no output tokens.
    """

    def __init__(self, model: str, prompt_tokens: int, timings: Callable[[Any], dict], capped: bool = False,
                 warm: bool = False):
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.capped = capped
        self.warm = warm
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.timings = timings
        self.blocks: list[dict] = []
        self._open = False  # the last block is still streaming

    def _message(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": self.prompt_tokens, "cache_creation_input_tokens": 0,
                          "cache_read_input_tokens": 0, "output_tokens": 0}}

    def start(self) -> list[dict]:
        return [{"type": "message_start", "message": self._message()}, {"type": "ping"}]

    def keepalive(self) -> dict:
        return {"type": "ping"}

    def _close(self) -> list[dict]:
        if not self._open:
            return []
        self._open = False
        index = len(self.blocks) - 1
        events = []
        if self.blocks[-1]["type"] == "thinking":
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "signature_delta", "signature": ""}})
        return events + [{"type": "content_block_stop", "index": index}]

    def _add(self, kind: str, text: str) -> list[dict]:
        """Text or thinking: into the open block of that kind, or a new one."""
        events = []
        if not (self._open and self.blocks[-1]["type"] == kind):
            events += self._close()
            block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "",
                                                                           "signature": ""}
            self.blocks.append(block)
            self._open = True
            events.append({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)})
        self.blocks[-1][kind] += text
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta",
                                                                             "thinking": text}
        return events + [{"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}]

    def piece(self, piece: Piece) -> list[dict]:
        if self.warm:  # the token generated to read the prompt is not the client's
            return []
        events = []
        for kind, value in piece.in_order():  # blocks in the order the model wrote them
            if kind == "reasoning":
                events += self._add("thinking", value)
            elif kind == "content":
                events += self._add("text", value)
            else:
                events += self._tool_use(value)
        return events

    def _tool_use(self, call: dict) -> list[dict]:
        """A call as a ``tool_use`` block (its arguments are an object: the stream made for this API
        returns any other call as the text the model wrote)."""
        fn = call["function"]
        arguments = json.loads(fn["arguments"])
        events = self._close()
        self.blocks.append({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": arguments})
        index = len(self.blocks) - 1
        return events + [
            {"type": "content_block_start", "index": index,
             "content_block": {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}}},
            {"type": "content_block_delta", "index": index,
             "delta": {"type": "input_json_delta", "partial_json": json.dumps(arguments, ensure_ascii=False)}},
            {"type": "content_block_stop", "index": index}]

    def _end(self, reply) -> tuple[dict, dict]:
        """The answer's ``stop_reason`` and ``stop_sequence``, and its usage."""
        if self.warm:
            return {"stop_reason": "max_tokens", "stop_sequence": None}, {**usage(reply.stats), "output_tokens": 0}
        return ({"stop_reason": stop_reason(reply.finish_reason, reply.stop_string, self.capped),
                 "stop_sequence": reply.stop_string}, usage(reply.stats))

    def done(self, reply) -> list[dict]:
        events = self._close()
        delta, used = self._end(reply)
        return events + [{"type": "message_delta", "delta": delta, "usage": used, "timings": self.timings(reply)},
                         {"type": "message_stop"}]

    def failed(self, error: ApiError) -> list[dict]:
        return [error_body(error.status, error.message)]

    def whole(self, pieces: list[Piece], reply) -> dict:
        """The ``message`` object of a request that was not streamed."""
        for p in pieces:
            self.piece(p)
        self._close()
        delta, used = self._end(reply)
        return {**self._message(), "content": self.blocks, **delta, "usage": used, "timings": self.timings(reply)}
