"""The OpenAI API's shapes as the server speaks them: requests, responses, errors. No MLX, no HTTP.

Requests are pydantic models (strict types, OpenAI's ranges). Fields of the
OpenAI API this server cannot honour exactly (``n`` > 1, images, ...) are
refused by name with a 400, never ignored; fields it does not know are ignored
(clients send their own extensions). :func:`controls` reads the logits
processors and log-probabilities a request asks for.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..core.stats import Stats
from ..loop.compare import Comparison


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

    Args:
        status: The HTTP status.
        message: What went wrong and how to fix it, in one line.
        param: The request field at fault, if one is.
        code: A machine-readable code (OpenAI's, where one exists).
        kind: OpenAI's error type.
        headers: HTTP headers the answer carries (``Retry-After`` on a 503).
    """

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or _KINDS.get(status, "invalid_request_error")

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


_KINDS = {401: "authentication_error", 404: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "server_error"}


def error_body(message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# What pydantic puts before the text of an error a validator raised; the client needs only the text.
_PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")


def validation_error(e: ValidationError, skip: tuple = ("body",),
                     rename: Optional[Callable[[str], str]] = None) -> ApiError:
    """A pydantic validation error as one 400 line naming its field (the first error; pydantic's prefix dropped).

    Args:
        e: The error (pydantic's, or FastAPI's ``RequestValidationError``: anything with ``errors()``).
        skip: Location parts that name no field (FastAPI's ``body``).
        rename: Maps the field's path to the name the client knows it by (a translated request's).
    """
    errors = e.errors()

    def path(error: dict) -> tuple:
        # Without pydantic's union branch names ("str", "list[Item]"): the fields the client wrote.
        return tuple(p for p in error.get("loc", ()) if p not in skip and not _union_branch(p))

    # The deepest field at fault (the first such): a list item's wrong field, not the union branch the list was tried
    # against first; several branches that fail at that field say what each wanted.
    paths = [path(er) for er in errors]
    at = max(paths, key=len, default=())
    same = [er for er, p in zip(errors, paths) if p == at] or [{}]
    # List indices in brackets (messages[1].content[0]), as the paths the server names by hand and OpenAI's params.
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in at).lstrip(".") or None
    if param and rename is not None:
        param = rename(param)
    messages = []
    for er in same:
        message = " ".join(str(er.get("msg", "invalid request")).split())
        for prefix in _PYDANTIC_PREFIXES:
            message = message.removeprefix(prefix)
        if message not in messages:
            messages.append(message)
    message = ", or ".join(messages)
    return ApiError(400, f"{param}: {message}" if param else message, param, "invalid_value")


def _union_branch(part: Any) -> bool:
    """A location part pydantic adds for the union member it tried (a type's name), never a field's."""
    return isinstance(part, str) and ("[" in part or "-" in part or part in _TYPE_NAMES)


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "bytes"})


# A flag the APIs let be null ("stream": null): null is its default, false.
NullableFlag = Annotated[bool, BeforeValidator(lambda value: False if value is None else value)]


class StrictModel(BaseModel):
    # Strict types (no "10" for 10, no true for 1); unknown fields are kept and looked at.
    model_config = ConfigDict(strict=True, extra="allow")


# OpenAI's seed is a 64-bit integer; draws are keyed by all 64 bits (see specdec_cli.core.sampling).
SEED_MAX = 2**64 - 1
# OpenAI's most alternatives per token (specdec_cli.core.processors.MAX_TOP_LOGPROBS).
MAX_TOP_LOGPROBS = 20
# OpenAI's logit_bias range.
BIAS_MAX = 100.0


def _first(value: Any, bad: Callable[[Any], bool], path: str) -> Optional[str]:
    """Where in a decoded JSON value the first value (or object key) that is ``bad`` lies, or None."""
    if bad(value):
        return path or "body"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        found = (where if isinstance(key, str) and bad(key) else None) or _first(item, bad, where)
        if found:
            return found
    return None


def _lone_surrogate(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _unpaired_surrogate(value: Any, path: str) -> Optional[str]:
    """Where in a decoded JSON value a string holds a lone UTF-16 surrogate (``"\\ud800"``), or None.

    JSON may escape one; no tokenizer can encode it.
    """
    return _first(value, _lone_surrogate, path)


def _non_finite(value: Any, path: str) -> Optional[str]:
    """Where in a decoded JSON value a number is not finite (``1e999``, ``Infinity``, ``NaN``), or None.

    JSON has no value for one, so no answer that echoes it (or a grammar built from it) could be written.
    """
    return _first(value, lambda v: isinstance(v, float) and not math.isfinite(v), path)


NON_FINITE = ("a number out of a 64-bit float's range or not a number (1e999, Infinity, NaN), which no JSON "
              "answer can hold: send a finite number")


def check_finite(body: Any) -> None:
    """Refuse a number no JSON answer can hold, naming where it is.

    Raises:
        ApiError: A 400 naming the field.
    """
    where = _non_finite(body, "")
    if where:
        raise ApiError(400, f"{where}: {NON_FINITE}", where, "invalid_value")


def _finite(default=None, **bounds):
    """A float field that refuses NaN and infinities (JSON's ``NaN``, ``Infinity``, ``1e400``) by name."""
    return Field(default=default, allow_inf_nan=False, **bounds)


class TextPart(StrictModel):
    type: str
    text: Optional[str] = None
    # An assistant's refusal part ({"type": "refusal", "refusal": ...}), as a client sends an earlier answer back.
    refusal: Optional[str] = None

    @property
    def words(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


class FunctionCall(StrictModel):
    name: str
    # OpenAI sends the arguments as a JSON string; some clients send the object itself.
    arguments: Union[str, dict[str, Any]] = "{}"


class ToolCall(StrictModel):
    function: FunctionCall
    id: Optional[str] = None
    type: Optional[str] = "function"


class Message(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None


class StreamOptions(StrictModel):
    include_usage: NullableFlag = False


class _Common(StrictModel):
    """Fields chat and text completions share."""

    model: Optional[str] = None
    stream: NullableFlag = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = _finite(ge=0, le=2)
    top_p: Optional[float] = _finite(ge=0, le=1)
    # At or above the vocabulary size: every token is kept (no top-k).
    top_k: Optional[int] = Field(default=None, ge=0)
    min_p: Optional[float] = _finite(ge=0, le=1)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    num_draft_tokens: Optional[int] = Field(default=None, ge=0)
    # llama.cpp's and vLLM's extension: generate past end-of-sequence tokens (benchmarks).
    ignore_eos: bool = False
    # Ours: after the answer, decode the request alone (plain decoding, fresh caches) and say in
    # timings.compare whether the answer is its text (docs/EXACTNESS.md). It costs that decoding.
    compare_alone: bool = False
    # Accepted where it changes nothing (1); refused otherwise (see unsupported).
    n: Optional[int] = Field(default=None, ge=1)
    # Chat: a boolean (top_logprobs says how many alternatives); completions: the number of alternatives.
    logprobs: Union[bool, int, None] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # Logits processors, mlx-lm's (mlx_lm.sample_utils.make_logits_processors), lossless under speculation.
    frequency_penalty: Optional[float] = _finite(ge=-2, le=2)
    presence_penalty: Optional[float] = _finite(ge=-2, le=2)
    logit_bias: Optional[dict[str, Any]] = None
    repetition_penalty: Optional[float] = _finite(ge=0)
    repetition_context_size: Optional[int] = Field(default=None, ge=1)
    presence_context_size: Optional[int] = Field(default=None, ge=1)
    frequency_context_size: Optional[int] = Field(default=None, ge=1)
    # Ollama's and llama.cpp's names (Open WebUI sends them): the same penalty as repetition_penalty.
    repeat_penalty: Optional[float] = _finite(ge=0)
    repeat_last_n: Optional[int] = Field(default=None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, body: Any) -> Any:
        where = _unpaired_surrogate(body, "")
        if where:
            raise ValueError(f"{where} holds an unpaired UTF-16 surrogate (a lone \\ud800-\\udfff escape), which "
                             "no tokenizer can encode: send valid Unicode text")
        return body

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, seed: Optional[int]) -> Optional[int]:
        if seed is not None and not 0 <= seed <= SEED_MAX:
            raise ValueError("must be an integer within [0, 2^64 - 1]; leave it out for random draws")
        return seed

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    response_format: Optional[dict[str, Any]] = None
    modalities: Optional[list[str]] = None
    audio: Optional[dict[str, Any]] = None


class CompletionRequest(_Common):
    # A string or token ids, or a list of one of them (a batch of one, as the openai client may send it).
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None


# Sampling controls of other servers (llama.cpp, Ollama, Open WebUI) that no processor here
# covers: each would change the distribution, so any value but a neutral one is refused by name.
_NEUTRAL = {
    "mirostat": ((None, 0), "Mirostat sampling"),
    "mirostat_tau": ((None,), "Mirostat sampling"),
    "mirostat_eta": ((None,), "Mirostat sampling"),
    "typical_p": ((None, 1), "typical sampling"),
    "tfs_z": ((None, 1), "tail-free sampling"),
    "top_a": ((None, 0), "top-a sampling"),
    "xtc_probability": ((None, 0), "XTC sampling"),
    "dry_multiplier": ((None, 0), "DRY sampling"),
    "min_tokens": ((None, 0), "a minimum length (end-of-sequence tokens suppressed)"),
}


def unsupported(req: _Common) -> Optional[ApiError]:
    """The first field this server cannot honour exactly, as a 400 naming it (None: all fine)."""
    extra = req.model_extra or {}
    checks: list[tuple[str, bool, str]] = [
        (name, name in extra and extra[name] not in neutral,
         f"{what} is not supported (it would change the model's distribution): drop {name}")
        for name, (neutral, what) in _NEUTRAL.items()
    ]
    checks += [
        ("num_ctx", "num_ctx" in extra, "the context is the model's own, set when the server starts: drop num_ctx"),
        ("n", (req.n or 1) != 1, "only one choice per request is generated: drop n or set it to 1"),
        ("repeat_penalty", req.repeat_penalty not in (None, 0, 1) and req.repetition_penalty not in (None, 0, 1)
         and req.repeat_penalty != req.repetition_penalty,
         "repeat_penalty and repetition_penalty are the same penalty: give one of them"),
    ]
    if isinstance(req, ChatRequest):
        checks += [
            ("modalities", any(m != "text" for m in req.modalities or []), "only text output is generated"),
            ("audio", req.audio is not None, "audio output is not supported: drop audio"),
            ("top_logprobs", req.top_logprobs not in (None, 0) and req.logprobs is not True,
             "top_logprobs needs logprobs: true"),
            ("logprobs", req.logprobs is not None and not isinstance(req.logprobs, bool),
             "logprobs is true or false on chat completions (top_logprobs says how many alternatives)"),
        ]
        for i, t in enumerate(req.tools or []):
            if t.get("type", "function") != "function" or not isinstance(t.get("function"), dict) \
                    or not isinstance(t["function"].get("name"), str):
                checks.append((f"tools[{i}]", True, "a tool is {\"type\": \"function\", \"function\": {\"name\": ..., "
                                                   "\"parameters\": {...}}}"))
        # The legacy function-calling fields: answered as tools they would come back as tool_calls, which a client
        # reading message.function_call never sees; ignored, the model was never offered the functions.
        checks += [
            ("functions", bool(extra.get("functions")),
             "functions (the legacy form of tools) is not supported: send each as tools[i], {\"type\": \"function\", "
             "\"function\": {...}}, and function_call as tool_choice"),
            ("function_call", extra.get("function_call") not in (None, "none", "auto"),
             "function_call (the legacy form of tool_choice) is not supported: send tool_choice with tools"),
        ]
        for i, m in enumerate(req.messages):
            if m.content is None and m.role != "assistant":
                checks.append((f"messages[{i}].content", True, f"a {m.role} message needs its content"))
            # An empty part list read as "": the turn was lost unsaid (OpenAI refuses an empty array).
            if m.content == [] and m.role != "assistant":
                checks.append((f"messages[{i}].content", True, f"a {m.role} message's content is an empty list: "
                               "send its text (a string, or text parts)"))
            if (m.model_extra or {}).get("function_call") is not None:
                checks.append((f"messages[{i}].function_call", True, "an earlier call in the legacy form is not "
                               "supported: send it as tool_calls, and its result as a tool message"))
            for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                if part.type == "refusal" and m.role == "assistant":
                    if part.refusal is None:
                        checks.append((f"messages[{i}].content[{j}].refusal", True,
                                       "a part of type 'refusal' needs its refusal: add a \"refusal\" string"))
                elif part.type != "text":
                    checks.append((f"messages[{i}].content[{j}]", True,
                                   f"content of type {part.type!r} is not supported: this server runs a text model"))
                elif part.text is None:
                    checks.append((f"messages[{i}].content[{j}].text", True,
                                   "a part of type 'text' needs its text: add a \"text\" string"))
    else:
        checks += [
            ("echo", bool(req.echo), "echo is not supported: drop it"),
            ("suffix", req.suffix is not None, "suffix (insertion) is not supported: drop it"),
            ("best_of", (req.best_of or 1) != 1, "best_of is not supported: drop it or set it to 1"),
            # Chat's constraints: a text completion has no grammar, so the answer would silently not follow them.
            ("response_format", extra.get("response_format") not in (None, {"type": "text"}),
             "response_format is applied on chat completions only (a text completion is not constrained): send "
             "the request to /v1/chat/completions, or drop it"),
            ("tool_choice", extra.get("tool_choice") not in (None, "auto", "none"),
             "a forced tool call is made on chat completions only (a text completion has no tools): send the "
             "request to /v1/chat/completions, or drop it"),
            ("prompt", isinstance(req.prompt, list) and len(req.prompt) > 0 and isinstance(req.prompt[0], (str, list))
             and len(req.prompt) != 1, "one prompt per request: send a string or one list of token ids"),
            ("prompt", isinstance(req.prompt, (str, list)) and len(req.prompt) == 0, "the prompt is empty"),
            ("logprobs", isinstance(req.logprobs, int) and not isinstance(req.logprobs, bool)
             and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS,
             f"logprobs on completions is the number of alternatives per token, 0 to {MAX_TOP_LOGPROBS}"),
        ]
    for param, bad, why in checks:
        if bad:
            return ApiError(400, why, param, "unsupported_parameter" if param != "prompt" else "invalid_value")
    return None


def controls(req: _Common) -> dict:
    """The logits processors and log-probabilities a checked request asks for, as
    :class:`~specdec_cli.session.Request` fields (``constraint`` comes apart: :func:`constraint`).

    Raises:
        ApiError: A 400 naming the field at fault.
    """
    out: dict[str, Any] = {}
    if req.logit_bias:
        bias = []
        for key, value in req.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                token = -1
            if token < 0 or str(token) != key.strip():
                raise ApiError(400, f"logit_bias keys are token ids (got {key!r})", "logit_bias", "invalid_value")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -BIAS_MAX <= value <= BIAS_MAX:
                raise ApiError(400, f"logit_bias values are numbers within [-100, 100] (got {value!r} for {key})",
                               "logit_bias", "invalid_value")
            bias.append((token, float(value)))
        out["logit_bias"] = tuple(bias)
    penalty, size = req.repetition_penalty, req.repetition_context_size
    if penalty in (None, 0, 1) and req.repeat_penalty not in (None, 0, 1):
        penalty = req.repeat_penalty
        if size is None and req.repeat_last_n:
            size = req.repeat_last_n
        if req.repeat_last_n == 0:
            penalty = None  # llama.cpp's and Ollama's 0: no tokens looked at
    if penalty not in (None, 0, 1):
        out["repetition_penalty"] = float(penalty)
    for name, value in (("repetition_context_size", size), ("presence_context_size", req.presence_context_size),
                        ("frequency_context_size", req.frequency_context_size)):
        if value is not None:
            out[name] = value
    if req.presence_penalty:
        out["presence_penalty"] = float(req.presence_penalty)
    if req.frequency_penalty:
        out["frequency_penalty"] = float(req.frequency_penalty)
    if isinstance(req, ChatRequest):
        if req.logprobs is True:
            out["logprobs"] = req.top_logprobs or 0
    elif req.logprobs is not None and req.logprobs is not False:
        out["logprobs"] = 0 if req.logprobs is True else int(req.logprobs)
    return out


def constraint(req: ChatRequest) -> Optional[tuple]:
    """What the answer must be, from ``response_format`` and ``tool_choice``:
    ``("json_object",)``, ``("json_schema", schema)``, ``("tool_call", tools, parallel)`` or None.

    Raises:
        ApiError: A 400 naming the field at fault.
    """
    fmt = req.response_format or {}
    kind = fmt.get("type", "text")
    out: Optional[tuple] = None
    if kind == "json_object":
        out = ("json_object",)
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise ApiError(400, "response_format of type json_schema needs json_schema.schema, a JSON schema object",
                           "response_format.json_schema.schema", "invalid_value")
        if schema is False:
            raise ApiError(400, "the schema false matches no value, so no answer can meet it: give a schema object "
                           "(true: any JSON value)", "response_format.json_schema.schema", "invalid_value")
        out = ("json_schema", schema)
    elif kind != "text":
        raise ApiError(400, f"response_format type {kind!r} is not one of text, json_object, json_schema",
                       "response_format.type", "invalid_value")
    choice = req.tool_choice
    forced = None
    if isinstance(choice, dict):
        if choice.get("type") not in ("function", None):  # allowed_tools, custom: said so, not "names a function as"
            raise ApiError(400, f"tool_choice of type {choice.get('type')!r} is not supported: 'auto', 'none', "
                           "'required' or a named function are", "tool_choice", "unsupported_parameter")
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise ApiError(400, "tool_choice names a function as {\"type\": \"function\", \"function\": {\"name\": "
                           "...}}", "tool_choice", "invalid_value")
        tools = [t for t in req.tools or [] if (t.get("function") or {}).get("name") == name]
        if not tools:
            raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools", "tool_choice",
                           "invalid_value")
        forced = tools
    elif choice == "required":
        if not req.tools:
            raise ApiError(400, "tool_choice 'required' needs tools", "tool_choice", "invalid_value")
        forced = list(req.tools)
    elif choice not in (None, "auto", "none"):
        raise ApiError(400, "tool_choice is 'auto', 'none', 'required' or a named function", "tool_choice",
                       "invalid_value")
    if forced is not None:
        if out is not None:
            raise ApiError(400, "a forced tool call and a response_format cannot both constrain the answer: drop one",
                           "response_format", "unsupported_parameter")
        for i, t in enumerate(forced):
            if not isinstance(t, dict) or not isinstance((t.get("function") or {}).get("name"), str):
                raise ApiError(400, "tools are {\"type\": \"function\", \"function\": {\"name\", \"parameters\"}}",
                               "tools", "invalid_value")
        out = ("tool_call", forced, req.parallel_tool_calls is not False)
    if out is not None and req.ignore_eos:
        raise ApiError(400, "ignore_eos cannot be used with a constrained answer (the grammar ends it): drop it",
                       "ignore_eos", "unsupported_parameter")
    return out


def chat_messages(req: ChatRequest) -> list[dict]:
    """The request's messages as the chat template takes them (text parts joined, arguments as objects)."""
    out = []
    for m in req.messages:
        content = m.content
        if isinstance(content, list):
            content = "".join(p.words for p in content)
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = []
            for call in m.tool_calls:
                call = call.model_dump(exclude_none=True)  # a copy, with any fields the client added
                fn = call["function"]
                if isinstance(fn["arguments"], str):
                    try:
                        parsed = json.loads(fn["arguments"])
                    except (ValueError, RecursionError):
                        pass  # a template that wants the string gets it
                    else:
                        # Escapes that decode to no encodable text ("\ud800", which a model may write) stay the
                        # text as sent: the tokenizer cannot encode the decoded value (a 500 once).
                        if _unpaired_surrogate(parsed, "") is None:
                            fn["arguments"] = parsed
                calls.append(call)
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def content_chars(req: ChatRequest) -> int:
    """Characters of the messages' text (what the prompt holds at least)."""
    total = 0
    for m in req.messages:
        parts = m.content if isinstance(m.content, list) else [TextPart(type="text", text=m.content or "")]
        total += sum(len(p.words) for p in parts)
    return total


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(stats: Stats) -> dict:
    """OpenAI's usage object; ``cached_tokens`` are prompt tokens the prompt cache held, ``disk_tokens``
    (ours) those of them read from its disk tier."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated,
        "total_tokens": stats.prompt_tokens + stats.generated,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens, "disk_tokens": stats.disk_tokens},
    }


def compare_alone(comparison: Optional[Comparison], error: Optional[str] = None) -> dict:
    """``timings.compare``: the answer against its request decoded alone (plain decoding, fresh caches).

    ``verdict`` is ``identical``, ``rounding tie`` (it parts from the request's text where the target's two
    likeliest tokens are within rounding: ``margin`` <= ``bound``, in log-probability units) or ``diverged``
    (a bug); null with ``error`` where it could not be checked. ``tokens``: plain decoding's length.
    """
    if comparison is None:
        return {"verdict": None, "error": error or "not checked"}
    d = comparison.divergence
    return {"verdict": comparison.verdict, "tokens": comparison.tokens, "index": d.index if d else None,
            "margin": d.margin if d else None, "bound": d.bound if d else None}


def timings(stats: Stats, drafter: str, block_size: int) -> dict:
    """llama.cpp's ``timings`` names, then ours (acceptance = accepted / drafted)."""
    rollback = stats.rollback_choice["strategy"] if stats.rollback_choice else None
    return {
        "prompt_n": stats.prompt_tokens - stats.cached_tokens,
        "prompt_ms": 1000 * stats.prefill_s,
        "prompt_per_second": stats.prompt_tps,
        "predicted_n": stats.generated,
        "predicted_ms": 1000 * stats.decode_s,
        "predicted_per_second": stats.decode_tps,
        "draft_n": stats.drafted,
        "draft_n_accepted": stats.accepted,
        "cache_n": stats.cached_tokens,
        "cache_disk_n": stats.disk_tokens,
        "drafter": drafter,
        "block_size": block_size,
        "acceptance": stats.shown_acceptance,
        "tokens_per_block": stats.tokens_per_block,
        "rollback": rollback,
    }
