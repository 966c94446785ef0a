"""What the server does with a request, apart from HTTP: check it, render it, run it, shape the answer.

A :class:`Service` owns the session and the generation :class:`~.scheduler.Scheduler`.
``prepare_chat`` / ``prepare_completion`` turn a validated request into a
:class:`Prepared` job, raising :class:`~.protocol.ApiError` (a 4xx) for
anything that can be known before generation starts (a field it cannot
honour, an unknown model, a prompt over the context); the HTTP layer then
queues it and streams or collects what comes back.
"""

from __future__ import annotations

import asyncio
import codecs
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Optional

from ..errors import OptionError
from ..core.processors import Constraint, ConstraintError, check_constraint
from ..model.prompts import SERVED_ARGUMENTS, Rendered, encode_text, render_messages, renderer_arguments
from ..core.sampling import SamplingParams
from ..session import Request, RunOptions, Session
from ..session.reply import Piece, Reply, TextStream, token_bytes
from ..session.fit import fit_request
from ..session.setup import MemoryLimitError, PromptTooLongError
from . import protocol
from .anthropic import CLAUDE_PREFIX
from .protocol import ApiError, ChatRequest, CompletionRequest
from .scheduler import Job, Scheduler


# Drafts in a streamed reply's first block (see Request.first_draft).
FIRST_DRAFT_STREAMED = 0
# A request's top_p of 0, as OpenAI (and llama.cpp) read it: the smallest set of tokens reaching that mass, the
# likeliest alone. mlx-lm reads 0 as no filter; a top_p float32 cannot hold keeps the likeliest (top_p_filter).
TOP_P_LIKELIEST = 1e-46


@dataclass
class Prepared:
    """A checked request, ready to queue.

    Attributes:
        kind: ``chat`` or ``text``.
        request: The session request (prompt ids, limits, sampling).
        job: The job to queue.
        include_usage: Streamed: send a usage chunk before ``[DONE]``.
    """

    kind: str
    request: Request
    job: Job
    include_usage: bool = False
    id: str = field(default_factory=lambda: protocol.new_id("chatcmpl"))
    created: int = field(default_factory=protocol.now)
    # Tool calls streamed so far (each streamed call carries its index).
    calls: int = 0
    # Completions' logprobs: characters of the tokens already reported (their text_offset), and the decoder
    # holding the bytes of a character whose tokens have not all come.
    offset: int = 0
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))


class Service:
    """The session behind the API, and the thread that runs it.

    Args:
        session: The loaded session (with its prompt cache).
        model_id: The name ``/v1/models`` lists and requests may use.
        defaults: The server's options: what a request gets for a field it leaves out
            (``max_tokens``, ``temp``, ``top_p``, ``top_k``, ``min_p``).
        max_queue: Requests that may wait beyond those running.
        max_rows: Requests decoding together (``--decode-concurrency``).
    """

    def __init__(self, session: Session, model_id: str, defaults: RunOptions, max_queue: int = 16,
                 max_rows: int = 4):
        self.session = session
        self.model_id = model_id
        self.defaults = defaults
        self.scheduler = Scheduler(session, max_rows, max_queue)
        self.names = {model_id, "default_model", str(session.setup.target.path), session.setup.target.name}

    @property
    def tokenizer(self):
        return self.session.setup.tokenizer

    # --- answers that need no model run ------------------------------------------

    def models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    def model(self, name: str) -> dict:
        """``GET /v1/models/{name}``: the served model under any name a request may use for it.

        Raises:
            ApiError: 404 for another name.
        """
        # /v1/messages serves every claude-* name (Claude Code's), so the anthropic client's models.retrieve of one
        # finds the model too.
        if not name.startswith(CLAUDE_PREFIX):
            self._served(name)
        return self._model_card()

    def _served(self, name: str) -> None:
        if name not in self.names:
            raise ApiError(404, f"the model {name!r} is not served here; this server runs {self.model_id!r} "
                           "(GET /v1/models)", "model", "model_not_found")

    def _model_card(self) -> dict:
        created = protocol.now()
        # OpenAI's fields, then Anthropic's (its client's models.list / retrieve read type, display_name, created_at).
        card = {"id": self.model_id, "object": "model", "created": created, "owned_by": "specdec", "type": "model",
                "display_name": self.model_id,
                "created_at": datetime.fromtimestamp(created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
        found = self.session.setup.context()
        if found is not None:  # what agents must be told (Claude Code's CLAUDE_CODE_MAX_CONTEXT_TOKENS, ...)
            card["context_length"] = found[0]
        return card

    def health(self) -> dict:
        cache = self.session.prompt_cache
        sched = self.scheduler
        return {"status": "ok", "model": self.model_id, "busy": sched.running > 0, "running": sched.running,
                "decoding": sched.decoding, "waiting": sched.waiting, "decode_concurrency": sched.max_rows,
                "prompt_cache_entries": len(cache) if cache is not None else 0,
                "prompt_cache_bytes": cache.nbytes if cache is not None else 0,
                "prompt_cache_max_bytes": cache.max_bytes if cache is not None else 0,
                "lookup_corpus_tokens": self.session.corpus.tokens if self.session.corpus is not None else 0,
                **self._disk(),
                **({"distributed": self.session.ranks.describe()} if self.session.ranks is not None else {})}

    def _disk(self) -> dict:
        """The disk tier's folder and sizes (zeros and null when there is none)."""
        disk = self.session.disk
        return {"prompt_cache_dir": str(disk.folder) if disk is not None else None,
                "prompt_cache_disk_bytes": disk.store.nbytes if disk is not None else 0,
                "prompt_cache_disk_max_bytes": disk.store.max_bytes if disk is not None else 0}

    # --- checking and rendering ----------------------------------------------------

    def _check(self, req) -> None:
        """A model served here, and no field this server cannot honour."""
        if req.model is not None:
            self._served(req.model)
        bad = protocol.unsupported(req)
        if bad is not None:
            raise bad
        # Fields kept as JSON (tools, response_format, extensions): pydantic checks only the typed ones.
        protocol.check_finite(req.model_dump(exclude_none=True))

    def _bound_chars(self, chars: int, param: str) -> None:
        """A text that cannot fit the context is refused before it is tokenized (a huge body costs nothing)."""
        try:
            self.session.setup.check_prompt_chars(chars)
        except PromptTooLongError as e:
            raise ApiError(400, str(e), param, "context_length_exceeded") from None


    def _sampling(self, req) -> SamplingParams:
        d = self.defaults
        temp = d.temp if req.temperature is None else req.temperature
        if temp == 0:
            return SamplingParams()  # filters change nothing when greedy
        return SamplingParams(temp, d.top_p if req.top_p is None else req.top_p or TOP_P_LIKELIEST,
                              d.top_k if req.top_k is None else req.top_k,
                              d.min_p if req.min_p is None else req.min_p)

    def _request(self, req, ids: list[int], boundaries: tuple[int, ...], max_tokens: Optional[int],
                 param: str, rest: bool = False) -> Request:
        """The request's :class:`Request`, fitted to the model (a prompt over the context or the device's memory
        is a 400). ``rest``: a request that sets no limit may use the rest of the context (as much of it as memory
        holds); otherwise it gets the server's ``--max-tokens``."""
        setup = self.session.setup
        unbounded = max_tokens is None and rest and setup.context() is not None
        try:
            fitted = fit_request(setup, ids, None if unbounded else
                                 max_tokens if max_tokens is not None else self.defaults.max_tokens)
        except PromptTooLongError as e:
            raise ApiError(400, str(e), param, "context_length_exceeded") from None
        except MemoryLimitError as e:
            raise ApiError(400, str(e), "max_tokens") from None
        sampling = self._sampling(req)
        if req.compare_alone and self.session.ranks is not None:
            raise ApiError(400, "compare_alone is not built for a server sharded under mlx.launch (the check decodes "
                           "the request again on the generation thread): ask a one-process server",
                           "compare_alone", "invalid_value")
        if req.compare_alone and not sampling.greedy and req.seed is None:
            raise ApiError(400, "compare_alone with sampling needs a seed (the answer's draws are drawn again): "
                           "send seed, or temperature 0", "compare_alone", "invalid_value")
        block = None if req.num_draft_tokens is None else req.num_draft_tokens + 1
        # Streamed, the first token comes from a one-row forward: a long first verify would hold it back.
        first = FIRST_DRAFT_STREAMED if req.stream else None
        return replace(fitted.request, sampling=sampling, seed=req.seed, block_size=block, boundaries=boundaries,
                       ignore_eos=req.ignore_eos, first_draft=first, **self._controls(req))

    def _controls(self, req) -> dict:
        """The request's logits processors and log-probabilities, checked against the model (a 400 otherwise)."""
        fields = protocol.controls(req)
        vocab = len(self.tokenizer)
        for token, _ in fields.get("logit_bias", ()):
            if token >= vocab:
                raise ApiError(400, f"logit_bias names token {token}; this model's tokens are 0 to {vocab - 1}",
                               "logit_bias", "invalid_value")
        spec = protocol.constraint(req) if isinstance(req, ChatRequest) else None
        if spec is not None:
            kind = spec[0]
            made = (Constraint("json_object") if kind == "json_object" else Constraint.json_schema(spec[1])
                    if kind == "json_schema" else Constraint.tool_call(spec[1], spec[2]))
            param = {"tool_call": "tool_choice", "json_schema": "response_format.json_schema.schema"}.get(
                kind, "response_format")
            try:
                check_constraint(made, self.tokenizer)
            except ConstraintError as e:
                what = "the forced tool call" if kind == "tool_call" else f"response_format {kind}"
                if e.tool is not None:  # that tool's schema is at fault, not the choice to force a call
                    i = next(i for i, t in enumerate(req.tools) if t is spec[1][e.tool])
                    param = f"tools[{i}].function.parameters"
                raise ApiError(400, f"{what} cannot be used: {e}", param, "invalid_value") from None
            fields["constraint"] = made
        return fields

    def prepare_chat(self, req: ChatRequest, loop: asyncio.AbstractEventLoop, rest: bool = False,
                     object_arguments: bool = False) -> Prepared:
        """Check a chat request and make its job.

        Args:
            req: The chat request.
            loop: The HTTP side's event loop.
            rest: Without a limit in the request, generate up to the rest of the context (the Responses
                API's reading: Codex sets none) instead of the server's ``--max-tokens``.
            object_arguments: A tool call's arguments must be a JSON object (Anthropic's): a call whose
                are not is answered as the text the model wrote.

        Raises:
            ApiError: A 4xx naming the field at fault.
        """
        rendered, tools = self.render_chat(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        request = self._request(req, rendered.ids, rendered.boundaries, max_tokens, "messages", rest)
        return self._prepared("chat", req, request, loop, tools, chat=True, object_arguments=object_arguments)

    def render_chat(self, req: ChatRequest, reply: bool = True) -> tuple[Rendered, Optional[list]]:
        """A checked chat request's prompt, and the tools it offers (None when ``tool_choice`` is none);
        ``reply`` False: the conversation as it stands, no reply opened (see :func:`render_messages`).

        Raises:
            ApiError: A 4xx naming the field at fault.
        """
        self._check(req)
        self._bound_chars(protocol.content_chars(req), "messages")
        tools = req.tools if req.tool_choice != "none" else None
        # The renderer's own arguments are not template variables: given here they failed as "messages" (a
        # second value for one), or replaced the model's template (chat_template) or the request's tools.
        taken = renderer_arguments(req.chat_template_kwargs, SERVED_ARGUMENTS)
        if taken:
            raise ApiError(400, f"{taken[0]!r} is set by the server (from the request's own fields and the model), "
                           "not a chat template variable: drop it", f"chat_template_kwargs.{taken[0]}", "invalid_value")
        kwargs = {**self.session.setup.template_kwargs, **(req.chat_template_kwargs or {})}
        try:
            rendered = render_messages(self.tokenizer, protocol.chat_messages(req), tools=tools,
                                       template_kwargs=kwargs, reply=reply)
        except OptionError as e:
            raise ApiError(400, str(e), "messages") from None
        return rendered, tools

    def count_chat(self, req: ChatRequest) -> int:
        """Prompt tokens of a chat request: the rendering its generation would use; a conversation that ends
        with the assistant's message is counted as it stands (nothing would be generated after it).

        Raises:
            ApiError: A 4xx naming the field at fault.
        """
        return len(self.render_chat(req, reply=req.messages[-1].role != "assistant")[0].ids)

    def prepare_completion(self, req: CompletionRequest, loop: asyncio.AbstractEventLoop) -> Prepared:
        """Check a text completion request and make its job.

        Raises:
            ApiError: A 4xx naming the field at fault.
        """
        self._check(req)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            self._bound_chars(len(prompt), "prompt")
            ids = encode_text(self.tokenizer, prompt)
        else:
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in prompt):
                raise ApiError(400, f"token ids must be within [0, {vocab})", "prompt", "invalid_value")
            ids = list(prompt)
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", "prompt", "invalid_value")
        request = self._request(req, ids, (), req.max_tokens, "prompt")
        prepared = self._prepared("text", req, request, loop, None, chat=False)
        prepared.id = protocol.new_id("cmpl")
        return prepared

    def _prepared(self, kind: str, req, request: Request, loop, tools, chat: bool,
                  object_arguments: bool = False) -> Prepared:
        stop = req.stop_strings
        tokenizer, session = self.tokenizer, self.session
        job: Job

        def make() -> Reply:
            stream = TextStream(tokenizer, stop, tools, chat=chat, prompt=request.prompt_ids,
                                object_arguments=object_arguments, lead=kind == "text")
            reply = Reply(session, request, stream, cancelled=job.cancelled.is_set)
            reply.compare = req.compare_alone
            return reply

        job = Job(make, loop)
        include = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        return Prepared(kind, request, job, include)

    # --- answers -------------------------------------------------------------------

    def block_size(self, request: Request) -> int:
        return min(request.block_size or self.session.block_size, self.session.block_size)

    def timings(self, prepared: Prepared, reply: Reply) -> dict:
        name = "plain" if self.session.plain else self.session.setup.drafter_name
        out = protocol.timings(reply.stats, name, self.block_size(prepared.request))
        if reply.compare:
            out["compare"] = protocol.compare_alone(reply.comparison, reply.compare_error)
        return out

    def response(self, prepared: Prepared, pieces: list[Piece], reply: Reply) -> dict:
        """The whole answer of a request that was not streamed."""
        content = "".join(p.content for p in pieces)
        body: dict[str, Any] = {"id": prepared.id, "created": prepared.created, "model": self.model_id}
        if prepared.kind == "chat":
            calls = [c for p in pieces for c in p.tool_calls]
            # Only calls: null content, as OpenAI answers them.
            message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
            reasoning = "".join(p.reasoning for p in pieces)
            if reasoning:
                message["reasoning"] = reasoning
            if calls:
                message["tool_calls"] = calls
            body.update(object="chat.completion",
                        choices=[{"index": 0, "message": message, "finish_reason": reply.finish_reason,
                                  "logprobs": self._logprobs(prepared, pieces)}])
        else:
            body.update(object="text_completion",
                        choices=[{"index": 0, "text": content, "finish_reason": reply.finish_reason,
                                  "logprobs": self._logprobs(prepared, pieces)}])
        body["usage"] = protocol.usage(reply.stats)
        body["timings"] = self.timings(prepared, reply)
        return body

    def chunk(self, prepared: Prepared, piece: Optional[Piece] = None, first: bool = False,
              finish: Optional[str] = None) -> dict:
        """One streamed chunk: the role first (chat), then text deltas, then the finish reason."""
        body: dict[str, Any] = {"id": prepared.id, "created": prepared.created, "model": self.model_id}
        if prepared.kind == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta = {"role": "assistant", "content": ""}
            if piece is not None:
                if piece.content:
                    delta["content"] = piece.content
                if piece.reasoning:
                    delta["reasoning"] = piece.reasoning
                if piece.tool_calls:
                    delta["tool_calls"] = [{"index": i, **c}
                                           for i, c in enumerate(piece.tool_calls, start=prepared.calls)]
                    prepared.calls += len(piece.tool_calls)
            body.update(object="chat.completion.chunk",
                        choices=[{"index": 0, "delta": delta, "finish_reason": finish,
                                  "logprobs": self._logprobs(prepared, [piece] if piece else [], chunk=True)}])
        else:
            body.update(object="text_completion",
                        choices=[{"index": 0, "text": piece.content if piece else "", "finish_reason": finish,
                                  "logprobs": self._logprobs(prepared, [piece] if piece else [], chunk=True)}])
        return body

    # --- log-probabilities ---------------------------------------------------------

    def _entry(self, token: int, logprob: float) -> dict:
        raw = token_bytes(self.tokenizer, token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}

    def chat_logprobs(self, entries: list[tuple]) -> list[dict]:
        """OpenAI's ``logprobs.content`` items: ``token``, ``logprob``, ``bytes``, ``top_logprobs``."""
        return [{**self._entry(t, lp), "top_logprobs": [self._entry(a, alp) for a, alp in top]}
                for t, lp, top in entries]

    def _legacy_token(self, token: int) -> str:
        """A token as the legacy shape names it: its text, or OpenAI's ``bytes:\\xNN...`` where its bytes are not
        whole UTF-8 characters (so the pieces of one character stay distinct keys of ``top_logprobs``)."""
        raw = token_bytes(self.tokenizer, token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _logprobs(self, prepared: Prepared, pieces: list, chunk: bool = False) -> Optional[dict]:
        """A choice's ``logprobs`` for these pieces' tokens (None when the request did not ask for them)."""
        if prepared.request.logprobs is None:
            return None
        entries = [e for p in pieces for e in p.logprobs]
        if chunk and not entries:
            return None
        if prepared.kind == "chat":
            return {"content": self.chat_logprobs(entries), "refusal": None}
        tokens, offsets, tops = [], [], []
        for t, lp, top in entries:
            tokens.append(self._legacy_token(t))
            # A token in the middle of a character starts where that character does.
            offsets.append(prepared.offset)
            prepared.offset += len(prepared.decoder.decode(token_bytes(self.tokenizer, t)))
            tops.append({self._legacy_token(a): alp for a, alp in top})
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": tops if prepared.request.logprobs else None, "text_offset": offsets}

    def final_chunk(self, prepared: Prepared, reply: Reply) -> dict:
        body = self.chunk(prepared, finish=reply.finish_reason)
        body["timings"] = self.timings(prepared, reply)
        return body

    def usage_chunk(self, prepared: Prepared, reply: Reply) -> dict:
        obj = "chat.completion.chunk" if prepared.kind == "chat" else "text_completion"
        return {"id": prepared.id, "object": obj, "created": prepared.created, "model": self.model_id,
                "choices": [], "usage": protocol.usage(reply.stats)}

