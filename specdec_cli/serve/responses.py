"""OpenAI's Responses API, stateless, as a thin translation over chat completions. No MLX, no HTTP.

``POST /v1/responses`` requests are pydantic models here; :func:`to_chat`
turns one into the internal :class:`~.protocol.ChatRequest` (``instructions``
and ``input`` items to chat messages, ``function_call`` /
``function_call_output`` items to tool calls and ``tool`` messages, flat
function tools to chat ones). Nothing is stored: a client sends the whole
conversation each time, and what needs stored state (``previous_response_id``,
``store: true``, conversations, background runs) is a 400 that says so, as is
anything else this server cannot honour. :class:`ResponseShape` turns what the
generation thread hands back into a ``response`` object or its event stream.
Errors keep OpenAI's shape.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Callable, Optional, Union

from pydantic import Field, ValidationError

from ..session.reply import Piece
from . import protocol
from .protocol import ApiError, ChatRequest, StrictModel

# Fields of ours (not OpenAI's) a request may add, passed on to the chat request as they are:
# sampling extensions and the chat API's logits processors.
EXTENSIONS = ("seed", "top_k", "min_p", "num_draft_tokens", "chat_template_kwargs", "logit_bias",
              "presence_penalty", "frequency_penalty", "repetition_penalty", "repetition_context_size",
              "presence_context_size", "frequency_context_size", "repeat_penalty", "repeat_last_n")
# include item that asks for the output text's log-probabilities.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
TEXT_PARTS = ("input_text", "output_text", "text")


class Part(StrictModel):
    """A content part: ``input_text``, ``output_text``, ``refusal``, ``input_image``, ..."""

    type: str
    text: Optional[str] = None
    refusal: Optional[str] = None


class Item(StrictModel):
    """An input item: a message (``role``, ``content``), ``function_call``, ``function_call_output``, ..."""

    type: Optional[str] = None
    role: Optional[str] = None
    content: Union[str, list[Part], None] = None
    call_id: Optional[str] = None
    name: Optional[str] = None
    arguments: Optional[str] = None
    output: Union[str, list[Part], None] = None


class Tool(StrictModel):
    """A tool as the Responses API writes it: flat (``type``, ``name``, ``description``, ``parameters``)."""

    type: str
    name: Optional[str] = None
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class ResponsesRequest(StrictModel):
    model: Optional[str] = None
    input: Union[str, list[Item]]
    instructions: Optional[str] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0, le=2)
    top_p: Optional[float] = Field(default=None, ge=0, le=1)
    stream: bool = False
    metadata: Optional[dict[str, Any]] = None
    # Accepted and not acted on: reasoning (the chat template decides), include (nothing more to include).
    reasoning: Optional[dict[str, Any]] = None
    include: Optional[list[str]] = None
    # Refused when set to what this server cannot do (see to_chat).
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    conversation: Union[str, dict[str, Any], None] = None
    background: Optional[bool] = None
    prompt: Optional[dict[str, Any]] = None
    text: Optional[dict[str, Any]] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=protocol.MAX_TOP_LOGPROBS)
    max_tool_calls: Optional[int] = None
    truncation: Optional[str] = None


# --- requests to chat ------------------------------------------------------------------


def _refuse(param: str, why: str) -> ApiError:
    return ApiError(400, why, param, "unsupported_parameter")


def _text(content: Union[str, list[Part], None], where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    out = []
    for j, part in enumerate(content):
        if part.type in TEXT_PARTS:
            out.append(part.text or "")
        elif part.type == "refusal":
            out.append(part.refusal or "")
        else:
            raise _refuse(f"{where}[{j}]", f"content of type {part.type!r} is not supported: this server runs a "
                          "text model")
    return "".join(out)


def _stateless(req: ResponsesRequest) -> None:
    """Refuse what needs stored state or what cannot be honoured."""
    checks = [
        ("previous_response_id", req.previous_response_id is not None,
         "this server keeps no state: send the whole conversation in input instead of previous_response_id"),
        ("store", req.store is True, "this server keeps no state: responses cannot be stored (set store to false)"),
        ("conversation", req.conversation is not None,
         "this server keeps no state: send the whole conversation in input instead of a conversation"),
        ("background", bool(req.background), "background responses need stored state, which this server keeps none of"),
        ("prompt", req.prompt is not None, "stored prompt templates are not supported: send instructions"),
        ("max_tool_calls", req.max_tool_calls is not None, "max_tool_calls is not supported: drop it"),
        ("truncation", req.truncation not in (None, "disabled"),
         "truncation 'auto' is not supported: a prompt over the context is refused"),
    ]
    for param, bad, why in checks:
        if bad:
            raise _refuse(param, why)


def _messages(req: ResponsesRequest) -> list[dict]:
    out: list[dict] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    items = [Item(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    if not items:
        raise ApiError(400, "input is empty: send a string or at least one item", "input", "invalid_value")
    for i, item in enumerate(items):
        kind = item.type or ("message" if item.role is not None else None)
        if kind == "message":
            if item.role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"input[{i}].role must be user, assistant, system or developer",
                               f"input[{i}].role", "invalid_value")
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _text(item.content, f"input[{i}].content")})
        elif kind == "function_call":
            if item.call_id is None or item.name is None or item.arguments is None:
                raise ApiError(400, f"input[{i}]: a function_call item needs call_id, name and arguments",
                               f"input[{i}]", "invalid_value")
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":  # a call after the assistant's text, or a parallel call
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if item.call_id is None:
                raise ApiError(400, f"input[{i}]: a function_call_output item needs call_id", f"input[{i}]",
                               "invalid_value")
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _text(item.output, f"input[{i}].output")})
        elif kind == "reasoning":
            continue  # earlier reasoning: left out, as the chat templates of thinking models do
        elif kind is None:
            raise ApiError(400, f"input[{i}] needs a type (or, for a message, a role)", f"input[{i}]",
                           "invalid_value")
        elif kind == "item_reference":
            raise _refuse(f"input[{i}]", "this server keeps no state: send the item itself, not a reference")
        else:
            raise _refuse(f"input[{i}]", f"input items of type {kind!r} are not supported: messages, "
                          "function_call, function_call_output and reasoning are")
    return out


def _tools(req: ResponsesRequest) -> Optional[list[dict]]:
    if not req.tools:
        return None
    out = []
    for i, t in enumerate(req.tools):
        if t.type != "function":
            raise _refuse(f"tools[{i}]", f"tools of type {t.type!r} are not run here: only function tools are")
        if t.name is None:
            raise ApiError(400, f"tools[{i}].name: Field required", f"tools[{i}].name", "invalid_value")
        fn: dict[str, Any] = {"name": t.name}
        if t.description is not None:
            fn["description"] = t.description
        fn["parameters"] = t.parameters if t.parameters is not None else {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


def _format(req: ResponsesRequest) -> Optional[dict]:
    """``text.format`` as chat's ``response_format``."""
    fmt = (req.text or {}).get("format") or {}
    kind = fmt.get("type", "text")
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise ApiError(400, f"text.format type {kind!r} is not one of text, json_object, json_schema",
                   "text.format.type", "invalid_value")


def _tool_choice(choice):
    """The Responses API's tool_choice as chat's: a named function is ``{"type": "function", "name"}`` here."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict) and choice.get("type") not in ("function", None):
        raise _refuse("tool_choice", f"tool_choice of type {choice.get('type')!r} is not supported: 'auto', "
                      "'none', 'required' or a function are")
    return choice


def to_chat(req: ResponsesRequest) -> ChatRequest:
    """The chat request a Responses request amounts to.

    Raises:
        ApiError: A 400 naming the field this server cannot honour.
    """
    _stateless(req)
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req), "tools": _tools(req),
                            "tool_choice": _tool_choice(req.tool_choice), "max_tokens": req.max_output_tokens,
                            "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
                            "response_format": _format(req),
                            "parallel_tool_calls": req.parallel_tool_calls}
    if LOGPROBS_INCLUDE in (req.include or []) or req.top_logprobs:
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    extra = req.model_extra or {}
    body.update({k: extra[k] for k in EXTENSIONS if k in extra})
    try:
        return ChatRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        raise ApiError(400, f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param,
                       "invalid_value") from None


# --- answers ---------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def usage(stats) -> dict:
    """The Responses API's usage (``cached_tokens``: prompt tokens the prompt cache held)."""
    return {"input_tokens": stats.prompt_tokens,
            "input_tokens_details": {"cached_tokens": stats.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": stats.generated, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": stats.prompt_tokens + stats.generated}


class ResponseShape:
    """One request's answer in the Responses API's shapes: the ``response`` object, or its events.

    The same fold of pieces into output items makes both: a ``reasoning``
    item for text inside the model's thinking markers, a ``message`` with one
    ``output_text`` part for the answer, a ``function_call`` item per call.

    Args:
        req: The request (the response object repeats some of its fields).
        model: The served model's id.
        timings: The ``timings`` object of a finished reply.
    """

    def __init__(self, req: ResponsesRequest, model: str, timings: Callable[[Any], dict],
                 logprobs: Optional[Callable[[list], list]] = None):
        self.req = req
        # Formats a piece's log-probabilities (chat's content items), when the request asked for them.
        self.logprobs = logprobs if (LOGPROBS_INCLUDE in (req.include or []) or req.top_logprobs) else None
        self.id = _id("resp")
        self.created_at = protocol.now()
        self.model = model
        self.timings = timings
        self.output: list[dict] = []
        self._open = False  # the last item is still streaming
        self._seq = 0

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _response(self, status: str, reply=None) -> dict:
        req = self.req
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": self.model, "output": list(self.output),
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": req.temperature, "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "top_p": req.top_p,
            "top_logprobs": req.top_logprobs or 0,
            "truncation": "disabled", "usage": None, "metadata": req.metadata or {},
        }
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if reply is not None:
            body["usage"] = usage(reply.stats)
            body["timings"] = self.timings(reply)
        return body

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self._response("in_progress")),
                self._event("response.in_progress", response=self._response("in_progress"))]

    def keepalive(self) -> Optional[dict]:
        return None  # the API has no such event: a comment line

    def _close(self, status: str = "completed") -> list[dict]:
        if not self._open:
            return []
        self._open = False
        index = len(self.output) - 1
        item = self.output[index]
        item["status"] = status
        part = item["content"][0]
        if item["type"] == "message":
            events = [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"], logprobs=list(part.get("logprobs", [])))]
        else:
            events = [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"])]
        return events + [self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=dict(part)),
                         self._event("response.output_item.done", output_index=index, item=_copy(item))]

    def _add(self, kind: str, text: str, logprobs: Optional[list] = None) -> list[dict]:
        """Answer text (``message``) or reasoning: into the open item of that kind, or a new one."""
        events = []
        if not (self._open and self.output[-1]["type"] == kind):
            events += self._close()
            if kind == "message":
                item = {"id": _id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                        "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                item = {"id": _id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
                part = {"type": "reasoning_text", "text": ""}
            self.output.append(item)
            self._open = True
            index = len(self.output) - 1
            events += [self._event("response.output_item.added", output_index=index, item=_copy(item)),
                       self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part=dict(part))]
            item["content"].append(part)
        item, index = self.output[-1], len(self.output) - 1
        item["content"][0]["text"] += text
        if kind == "message":
            item["content"][0]["logprobs"] += logprobs or []
            return events + [self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                                         content_index=0, delta=text, logprobs=logprobs or [])]
        return events + [self._event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                     content_index=0, delta=text)]

    def piece(self, piece: Piece) -> list[dict]:
        events = []
        logprobs = self.logprobs(piece.logprobs) if self.logprobs is not None and piece.logprobs else []
        if piece.reasoning:
            events += self._add("reasoning", piece.reasoning)
        if piece.content or (logprobs and not piece.reasoning and not piece.tool_calls):
            events += self._add("message", piece.content, logprobs)
        for call in piece.tool_calls:
            events += self._close()
            fn = call["function"]
            item = {"id": _id("fc"), "type": "function_call", "status": "in_progress", "call_id": call["id"],
                    "name": fn["name"], "arguments": ""}
            self.output.append(item)
            index = len(self.output) - 1
            events.append(self._event("response.output_item.added", output_index=index, item=_copy(item)))
            item.update(arguments=fn["arguments"], status="completed")
            events += [self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=index, delta=fn["arguments"]),
                       self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=index, arguments=fn["arguments"]),
                       self._event("response.output_item.done", output_index=index, item=_copy(item))]
        return events

    def _status(self, reply) -> str:
        return "incomplete" if reply.finish_reason == "length" else "completed"

    def done(self, reply) -> list[dict]:
        status = self._status(reply)
        events = self._close(status)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self._event(kind, response=self._response(status, reply))]

    def failed(self, error: ApiError) -> list[dict]:
        events = self._close("incomplete")
        body = self._response("failed")
        body["error"] = {"code": "server_error" if error.status >= 500 else "invalid_prompt",
                         "message": error.message}
        return events + [self._event("response.failed", response=body)]

    def whole(self, pieces: list[Piece], reply) -> dict:
        """The ``response`` object of a request that was not streamed."""
        for p in pieces:
            self.piece(p)
        status = self._status(reply)
        self._close(status)
        return self._response(status, reply)


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))
