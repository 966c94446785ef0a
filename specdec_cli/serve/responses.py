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
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from pydantic import Field

from ..session.reply import Piece
from . import protocol
from .dialect import chat_request, check_text
from .protocol import ApiError, ChatRequest, NullableFlag, StrictModel

# Fields of ours (not OpenAI's) a request may add, passed on to the chat request as they are:
# sampling extensions and the chat API's logits processors.
EXTENSIONS = ("seed", "top_k", "min_p", "num_draft_tokens", "chat_template_kwargs", "logit_bias",
              "presence_penalty", "frequency_penalty", "repetition_penalty", "repetition_context_size",
              "presence_context_size", "frequency_context_size", "repeat_penalty", "repeat_last_n",
              "compare_alone")
# include item that asks for the output text's log-probabilities.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
TEXT_PARTS = ("input_text", "output_text", "text")
# The one argument a custom tool's call carries for the model: its free-form input.
CUSTOM_INPUT = "input"


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
    # A custom tool's call (its free-form input) and a namespaced function's namespace.
    input: Optional[str] = None
    namespace: Optional[str] = None
    output: Union[str, list[Part], None] = None


class Tool(StrictModel):
    """A tool as the Responses API writes it: flat (``type``, ``name``, ``description``, ``parameters``);
    a ``namespace`` holds function tools; a ``custom`` tool takes free text (``format``: a grammar)."""

    type: str
    name: Optional[str] = None
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    tools: Optional[list["Tool"]] = None
    format: Optional[dict[str, Any]] = None


class ResponsesRequest(StrictModel):
    model: Optional[str] = None
    input: Union[str, list[Item]]
    instructions: Optional[str] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: Optional[float] = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    stream: NullableFlag = False
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
        field = "text" if part.type in TEXT_PARTS else "refusal" if part.type == "refusal" else None
        if field is None:
            raise _refuse(f"{where}[{j}]", f"content of type {part.type!r} is not supported: this server runs a "
                          "text model")
        value = getattr(part, field)
        if value is None:  # refused, as on chat and Messages: read as "", the turn lost its words unsaid
            raise ApiError(400, f"{where}[{j}].{field}: a part of type {part.type!r} needs its {field}: add a "
                           f"\"{field}\" string", f"{where}[{j}].{field}", "invalid_value")
        out.append(value)
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


# Items of hosted tools' calls (run on OpenAI's side): nothing of them reaches a local model.
HOSTED_CALLS = ("web_search_call", "file_search_call", "computer_call", "computer_call_output",
                "code_interpreter_call", "image_generation_call", "mcp_list_tools", "mcp_approval_request",
                "mcp_approval_response", "tool_search_call", "tool_search_output")


def _messages(req: ResponsesRequest, offered: dict[tuple[Optional[str], str], str]) -> tuple[list[dict], list[str]]:
    """The input items as chat messages, and the client's field each came from (``offered``: :func:`_offered`)."""
    out: list[dict] = []
    origins: list[str] = []

    def add(message: dict, origin: str) -> None:
        out.append(message)
        origins.append(origin)

    def call(item_id: str, name: str, arguments: str, origin: str) -> None:
        entry = {"id": item_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        if out and out[-1]["role"] == "assistant":  # a call after the assistant's text, or a parallel call
            out[-1].setdefault("tool_calls", []).append(entry)
        else:
            add({"role": "assistant", "content": "", "tool_calls": [entry]}, origin)

    if req.instructions:
        add({"role": "system", "content": req.instructions}, "instructions")
    items = [Item(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    if not items:
        raise ApiError(400, "input is empty: send a string or at least one item", "input", "invalid_value")
    for i, item in enumerate(items):
        where = "input" if isinstance(req.input, str) else f"input[{i}]"
        kind = item.type or ("message" if item.role is not None else None)
        if kind == "message":
            if item.role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}.role must be user, assistant, system or developer",
                               f"{where}.role", "invalid_value")
            # Missing content or output is refused, as chat refuses a message without content: read as "",
            # the turn (or the tool's result) was lost unsaid.
            if item.content is None:
                raise ApiError(400, f"{where}.content: a message item needs its content", f"{where}.content",
                               "invalid_value")
            if item.content == [] and item.role != "assistant":  # read as "": the turn lost unsaid, as above
                raise ApiError(400, f"{where}.content: a {item.role} message's content is an empty list: send its "
                               "text (a string, or input_text parts)", f"{where}.content", "invalid_value")
            add({"role": item.role, "content": _text(item.content, f"{where}.content")}, where)
        elif kind in ("function_call", "custom_tool_call"):
            custom = kind == "custom_tool_call"
            value = item.input if custom else item.arguments
            if item.call_id is None or item.name is None or value is None:
                what = "input" if custom else "arguments"
                raise ApiError(400, f"{where}: a {kind} item needs call_id, name and {what}", where, "invalid_value")
            name = offered.get((item.namespace, item.name), item.name)
            call(item.call_id, name, json.dumps({CUSTOM_INPUT: value}, ensure_ascii=False) if custom else value,
                 where)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if item.call_id is None:
                raise ApiError(400, f"{where}: a {kind} item needs call_id", where, "invalid_value")
            if item.output is None:
                raise ApiError(400, f"{where}.output: a {kind} item needs its output", f"{where}.output",
                               "invalid_value")
            add({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, f"{where}.output")},
                where)
        elif kind == "reasoning" or kind in HOSTED_CALLS:
            continue  # earlier reasoning is left out, as thinking models' templates do; hosted calls ran elsewhere
        elif kind is None:
            raise ApiError(400, f"{where} needs a type (or, for a message, a role)", where, "invalid_value")
        elif kind == "item_reference":
            raise _refuse(where, "this server keeps no state: send the item itself, not a reference")
        else:
            raise _refuse(where, f"input items of type {kind!r} are not supported: messages, function_call, "
                          "function_call_output, custom_tool_call, custom_tool_call_output and reasoning are")
    return out, origins


@dataclass(frozen=True)
class Route:
    """Where a call the model makes goes back to: a ``function`` (in a ``namespace`` or not) or a
    ``custom`` tool (its free-form input is the call's ``input`` argument)."""

    kind: str
    name: str
    namespace: Optional[str] = None


def routes(req: ResponsesRequest) -> dict[str, Route]:
    """The tools offered to the model, by the name it sees; tools the server does not run are left out.

    A plain tool keeps its name. A namespace's function is offered by its own name
    where no other offered tool has that name, else as ``namespace.function``, and
    where even that is taken (a plain tool named ``a.f`` beside namespace ``a``'s
    ``f``) as ``namespace.function_2``, ``_3``, ...: every tool has a name of its own.
    Hosted tools (``web_search``, ``file_search``, ``code_interpreter``, ...) run on
    OpenAI's side and are not offered here: a client that sends them gets answers without them.
    """
    flat: list[tuple[str, Route]] = []
    for t in req.tools or []:
        if t.type in ("function", "custom") and t.name is not None:
            flat.append((t.name, Route(t.type, t.name)))
        elif t.type == "namespace" and t.name is not None:
            flat += [(inner.name, Route("function", inner.name, t.name)) for inner in t.tools or []
                     if inner.type == "function" and inner.name is not None]
    counts: dict[str, int] = {}
    for name, _ in flat:
        counts[name] = counts.get(name, 0) + 1
    out: dict[str, Route] = {name: route for name, route in flat if route.namespace is None}
    for name, route in flat:
        if route.namespace is None:
            continue
        qualified = f"{route.namespace}.{name}"
        seen = name if counts[name] == 1 else qualified
        k = 1
        while seen in out:
            k += 1
            seen = f"{qualified}_{k}"
        out[seen] = route
    for name, route in flat:  # a model may write the qualified name anyway, where it names no other tool
        if route.namespace is not None:
            out.setdefault(f"{route.namespace}.{name}", route)
    return out


def _offered(req: ResponsesRequest) -> dict[tuple[Optional[str], str], str]:
    """(namespace, name) -> the name the model sees (see :func:`routes`)."""
    out: dict[tuple[Optional[str], str], str] = {}
    for seen, route in routes(req).items():
        out.setdefault((route.namespace, route.name), seen)
    return out


def _function(name: str, tool: Tool) -> dict:
    fn: dict[str, Any] = {"name": name}
    if tool.description is not None:
        fn["description"] = tool.description
    if tool.type == "custom":
        # Free text, as a string argument: the chat templates and tool parsers all speak JSON arguments.
        grammar = (tool.format or {}).get("definition") if (tool.format or {}).get("type") == "grammar" else None
        what = "The tool's input, free text" + (f" in this {(tool.format or {}).get('syntax', '')} grammar:\n"
                                                f"{grammar}" if grammar else "")
        fn["parameters"] = {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string", "description": what}},
                            "required": [CUSTOM_INPUT], "additionalProperties": False}
    else:
        fn["parameters"] = tool.parameters if tool.parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


def _tools(req: ResponsesRequest, seen: dict[tuple[Optional[str], str], str]) -> Optional[list[dict]]:
    out = []
    for i, t in enumerate(req.tools or []):
        if t.type in ("function", "custom", "namespace") and t.name is None:
            raise ApiError(400, f"tools[{i}].name: Field required", f"tools[{i}].name", "invalid_value")
        if t.type in ("function", "custom"):
            out.append(_function(t.name, t))
        elif t.type == "namespace":
            for j, inner in enumerate(t.tools or []):
                if inner.type != "function" or inner.name is None:
                    raise ApiError(400, f"tools[{i}].tools[{j}]: a namespace holds function tools with names",
                                   f"tools[{i}].tools[{j}]", "invalid_value")
                out.append(_function(seen[(t.name, inner.name)], inner))
        # Anything else is a hosted tool, run by OpenAI's servers: left out (see routes).
    return out or None


def _format(req: ResponsesRequest) -> Optional[dict]:
    """``text.format`` as chat's ``response_format``."""
    fmt = (req.text or {}).get("format") or {}
    if not isinstance(fmt, dict):
        raise ApiError(400, "text.format is an object: {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                       "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}", "text.format", "invalid_value")
    kind = fmt.get("type", "text")
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise ApiError(400, f"text.format type {kind!r} is not one of text, json_object, json_schema",
                   "text.format.type", "invalid_value")


def _tool_choice(req: ResponsesRequest, offered: dict[tuple[Optional[str], str], str]):
    """The Responses API's tool_choice as chat's: a named tool is ``{"type": "function" | "custom", "name"}``
    here (a namespaced function with its ``namespace``)."""
    choice = req.tool_choice
    if not isinstance(choice, dict):
        return choice
    kind = choice.get("type")
    if kind in ("function", "custom") and "function" not in choice:
        name = choice.get("name")
        if not isinstance(name, str):  # in this API's shape: chat's check would quote chat's
            raise ApiError(400, f"tool_choice names a tool as {{\"type\": \"{kind}\", \"name\": ...}}",
                           "tool_choice", "invalid_value")
        name = offered.get((choice.get("namespace"), name), name)
        return {"type": "function", "function": {"name": name}}
    if kind == "allowed_tools":
        raise _refuse("tool_choice", "tool_choice of type 'allowed_tools' is not supported: send only the tools "
                      "the model may call")
    if kind not in ("function", None):
        raise _refuse("tool_choice", f"tool_choice of type {kind!r} names a tool this server does not run: "
                      "'auto', 'none', 'required', a function or a custom tool are")
    return choice


def to_chat(req: ResponsesRequest) -> ChatRequest:
    """The chat request a Responses request amounts to.

    Raises:
        ApiError: A 400 naming the field this server cannot honour.
    """
    _stateless(req)
    check_text(req)
    offered = _offered(req)
    messages, origins = _messages(req, offered)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "tools": _tools(req, offered),
                            "tool_choice": _tool_choice(req, offered), "max_tokens": req.max_output_tokens,
                            "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
                            "response_format": _format(req), "parallel_tool_calls": req.parallel_tool_calls}
    if LOGPROBS_INCLUDE in (req.include or []) or req.top_logprobs:
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    extra = req.model_extra or {}
    body.update({k: extra[k] for k in EXTENSIONS if k in extra})
    return chat_request(body, origins)


# Chat's fields named in errors found past the translation, as the Responses API spells them.
_CHAT_FIELDS = (("response_format.json_schema.schema", "text.format.schema"),
                ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
                ("max_tokens", "max_output_tokens"))


def _tool_paths(req: ResponsesRequest) -> list[str]:
    """Where each of chat's tools (in :func:`_tools`' order) is in the request: ``tools[i]``, or
    ``tools[i].tools[j]`` inside a namespace."""
    out = []
    for i, t in enumerate(req.tools or []):
        if t.type in ("function", "custom"):
            out.append(f"tools[{i}]")
        elif t.type == "namespace":
            out += [f"tools[{i}].tools[{j}]" for j in range(len(t.tools or []))]
    return out


_CHAT_TOOL = re.compile(r"tools\[(\d+)\]\.function\.")


def client_error(e: ApiError, req: Optional[ResponsesRequest] = None) -> ApiError:
    """``e`` (from checking the chat request :func:`to_chat` made) naming the Responses API's field."""
    if e.param == "messages":  # the whole prompt (over the context, or a chat template that failed on it)
        e.param = "input"
        return e
    m = _CHAT_TOOL.match(e.param or "")
    if m and req is not None:  # a tool's own field (its parameters): where that tool is here, flat
        paths = _tool_paths(req)
        if int(m.group(1)) < len(paths):
            e.param = f"{paths[int(m.group(1))]}.{e.param[m.end():]}"
        return e
    for chat, ours in _CHAT_FIELDS:
        if e.param and (e.param == chat or e.param.startswith(chat + ".")):
            e.param = ours + e.param[len(chat):]
            # Every chat spelling the message uses, longest first ("response_format of type json_schema needs
            # json_schema.schema" named fields a Responses client never sent).
            for name, spelled in (*_CHAT_FIELDS, ("json_schema.schema", "schema")):
                e.message = e.message.replace(name, spelled)
            break
    return e


# --- answers ---------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def usage(stats) -> dict:
    """The Responses API's usage (``cached_tokens``: prompt tokens the prompt cache held; ``disk_tokens``,
    ours: those of them read from its disk tier)."""
    return {"input_tokens": stats.prompt_tokens,
            "input_tokens_details": {"cached_tokens": stats.cached_tokens, "cache_write_tokens": 0,
                                     "disk_tokens": stats.disk_tokens},
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
        self._logprobs: list = []  # log-probabilities no message item has taken yet
        self._seq = 0
        self.routes = routes(req)

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
        # The API has no ping; clients (Codex) count only events against their idle timeout, not comment lines.
        return self._event("response.in_progress", response=self._response("in_progress"))

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
        parts = piece.in_order()  # items in the order the model wrote them
        if logprobs and not parts:
            if self._open and self.output[-1]["type"] == "message":
                parts = [("content", "")]  # tokens whose text is still held back: their log-probabilities go now
            else:
                # No message to carry them (a call's tokens, the whitespace between calls): they wait for the next
                # text, so that no empty message item splits parallel calls (none comes: they have no place).
                self._logprobs += logprobs
                return events
        for kind, value in parts:
            if kind == "reasoning":
                events += self._add("reasoning", value)
            elif kind == "content":
                events += self._add("message", value, self._logprobs + logprobs)
                logprobs, self._logprobs = [], []
            else:
                events += self._close()
                events += self._call(value)
        self._logprobs += logprobs  # a piece of calls or reasoning alone: the next text takes them
        return events

    def _call(self, call: dict) -> list[dict]:
        """A tool call as its tool's item: ``function_call`` (with its ``namespace``) or ``custom_tool_call``."""
        fn = call["function"]
        route = self.routes.get(fn["name"], Route("function", fn["name"]))
        if route.kind == "custom":
            try:
                value = json.loads(fn["arguments"]).get(CUSTOM_INPUT)
            except (ValueError, AttributeError):
                value = None
            text = value if isinstance(value, str) else fn["arguments"]
            item = {"id": _id("ctc"), "type": "custom_tool_call", "status": "in_progress", "call_id": call["id"],
                    "name": route.name, "input": ""}
            delta, done = "response.custom_tool_call_input.delta", "response.custom_tool_call_input.done"
            field, value = "input", text
        else:
            item = {"id": _id("fc"), "type": "function_call", "status": "in_progress", "call_id": call["id"],
                    "name": route.name, "arguments": ""}
            if route.namespace is not None:
                item["namespace"] = route.namespace
            delta, done = "response.function_call_arguments.delta", "response.function_call_arguments.done"
            field, value = "arguments", fn["arguments"]
        self.output.append(item)
        index = len(self.output) - 1
        events = [self._event("response.output_item.added", output_index=index, item=_copy(item))]
        item.update({field: value, "status": "completed"})
        return events + [self._event(delta, item_id=item["id"], output_index=index, delta=value),
                         self._event(done, item_id=item["id"], output_index=index, **{field: value}),
                         self._event("response.output_item.done", output_index=index, item=_copy(item))]

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
