"""One reply as a client sees it: tokens -> text, stop strings cut, reasoning and tool calls split out.

:class:`TextStream` turns committed tokens into the text that may be shown
so far: a stop string is never emitted (text that could be the start of one is
held back until it cannot), and with a chat model's markers the text is split
into content, reasoning and tool calls by mlx-lm's own state machine and tool
parsers. :class:`Reply` drives one generation of a :class:`~.generate.Session`
through it; ``chat`` and ``serve`` both read replies this way.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Optional, Sequence

from mlx_lm.generate import TextStateMachine, make_text_state_machine
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

from ..model.prompts import byte_level_bytes
from ..loop.events import Step
from ..core.stats import Stats
from ..loop.compare import Comparison
from .generate import Session
from ..core.request import Request

log = logging.getLogger("specdec")


@dataclass
class Piece:
    """Text that became safe to show.

    Attributes:
        content: The answer's text.
        reasoning: Text inside the model's thinking markers.
        tool_calls: Tool calls completed in this piece, OpenAI-shaped.
        logprobs: With log-probabilities asked for: ``(token, logprob, ((token, logprob), ...))``
            for each token generated since the last piece (its text may still be held back).
    """

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    logprobs: list[tuple] = field(default_factory=list)
    # The same text and calls in the order the model wrote them: ("content" | "reasoning", text) or ("call", call).
    parts: list[tuple[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls or self.logprobs)

    def add(self, kind: str, value: Any) -> None:
        """Text of a kind (``content``, ``reasoning``) or a tool call (``call``), after what came before."""
        if not value:
            return
        if kind == "call":
            self.tool_calls.append(value)
        else:
            setattr(self, kind, getattr(self, kind) + value)
        if self.parts and self.parts[-1][0] == kind != "call":
            self.parts[-1] = (kind, self.parts[-1][1] + value)
        else:
            self.parts.append((kind, value))

    def in_order(self) -> list[tuple[str, Any]]:
        """Its text and calls in the order written (a piece made by hand: reasoning, content, then calls)."""
        if self.parts:
            return list(self.parts)
        return [(k, v) for k, v in (("reasoning", self.reasoning), ("content", self.content)) if v] + \
            [("call", c) for c in self.tool_calls]


def _held(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that starts some stop string (kept back until resolved)."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if s.startswith(text[-n:]):
                best = n
                break
    return best


class TextStream:
    """Tokens to client text: stop strings, then (chat) reasoning and tool calls.

    Args:
        tokenizer: mlx-lm's tokenizer wrapper.
        stop: Strings that end the reply; never emitted.
        tools: The request's tools (passed to the tool parser).
        chat: Split reasoning and tool calls out (chat replies); completions get the raw text.
        prompt: The prompt's ids (a prompt ending inside a thinking block starts in reasoning).
        object_arguments: A call's arguments must be a JSON object (Anthropic's ``tool_use.input``): a
            call block holding one whose arguments are not is the text the model wrote.
        lead: Keep the space the first token starts with (mlx-lm's detokenizers drop it): a text completion
            continues its prompt, so the prompt and the text together are what the model wrote.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), tools: Optional[list] = None, chat: bool = True,
                 prompt: Sequence[int] = (), object_arguments: bool = False, lead: bool = False):
        self.tokenizer = tokenizer
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.lead = lead
        if lead:
            _keep_first_space(self.detok)
        self.stops = [s for s in stop if s]
        self.tools = tools
        self.object_arguments = object_arguments
        self.stopped = False
        self.stop_string: Optional[str] = None  # the stop string that ended the reply
        self.through: Optional[int] = None  # a stop string ended it: the tokens up to the one that completed it
        self._tokens: list[int] = []  # every token taken (stop strings only: where one ended, in tokens)
        self.text = ""  # everything emitted, raw (before the split)
        self._held = ""
        self._machine = None
        self._tool_text = ""
        self._calls = 0
        self._state: Optional[str] = None  # the split's state after the last piece
        # Where calls may come, the content since the last call or reasoning while it is only whitespace, held
        # back (None: it holds real text, which goes out as it comes); _after_call: a call came last.
        self._calls_possible = chat and tokenizer.has_tool_calling
        self._space: Optional[str] = "" if self._calls_possible else None
        self._after_call = False
        if chat and (tokenizer.has_thinking or tokenizer.has_tool_calling):
            machine = make_text_state_machine(tokenizer)
            initial = "normal"
            if tokenizer.has_thinking and prompt:
                if tokenizer.rfind_think_start(list(prompt)) > tokenizer.rfind_think_end(list(prompt)):
                    initial = "reasoning"
            self._machine = machine.make_state(initial)

    def add(self, tokens: Sequence[int]) -> Piece:
        """Take committed tokens; returns the text that became safe to show."""
        if self.stopped:
            return Piece()
        if not self.stops:
            for t in tokens:
                self.detok.add_token(t)
            return self._raw(self.detok.last_segment, final=False)
        # A token at a time, as plain decoding meets them: the reply ends at the token that completed a stop string
        # (never a later one's match, whatever the block held), and says which token that was.
        segment = ""
        for t in tokens:
            self.detok.add_token(t)
            self._tokens.append(t)
            segment += self.detok.last_segment
            if any(stop in self._held + segment for stop in self.stops):
                break
        piece = self._raw(segment, final=False)
        if self.stopped:
            self.through = self._completed(self.text + self.stop_string)
        return piece

    def _completed(self, text: str) -> int:
        """How many of the tokens taken it takes to write ``text`` (the detokenizer may show a token's text
        only once the next one came)."""
        n = len(self._tokens)
        while n > 0 and self._decode(self._tokens[: n - 1]).startswith(text):
            n -= 1
        return n

    def _decode(self, tokens: Sequence[int]) -> str:
        detok = self.tokenizer.detokenizer
        detok.reset()
        kept = self.lead and _keep_first_space(detok)
        for t in tokens:
            detok.add_token(t)
        detok.finalize()
        return detok.text[1:] if kept else detok.text

    def finish(self, cut: bool = False) -> Piece:
        """The reply ended: flush what was held back (a stop string found now still cuts it).

        Args:
            cut: It ended at its token limit: a tool call still open is the model's unfinished text.
        """
        if self.stopped:
            piece = Piece()  # the text before the stop string went out; the split may still hold some
        else:
            self.detok.finalize()
            piece = self._raw(self.detok.last_segment, final=True)
        if self._machine is not None:
            self._machine, rest, state = TextStateMachine.flush(self._machine)
            self._route(piece, state, rest)
            if self._tool_text or state == "tool":
                # No end marker came: a cut call is shown as written; one ended by EOS may still parse.
                self._close_tool(piece, closed=False, parse=not (cut or self.stopped))
            if self._space and not self._after_call:  # whitespace that ends a reply with no call before it
                piece.add("content", self._space)
        return piece

    def _raw(self, segment: str, final: bool) -> Piece:
        text = self._held + segment
        cut = None
        for s in self.stops:
            i = text.find(s)
            if i >= 0 and (cut is None or i < cut):
                cut, self.stop_string = i, s
        if cut is not None:
            self.stopped = True
            out, self._held = text[:cut], ""
        else:
            keep = 0 if final else _held(text, self.stops)
            out, self._held = text[: len(text) - keep], text[len(text) - keep:]
        self.text += out
        return self._split(out)

    def _split(self, text: str) -> Piece:
        piece = Piece()
        if self._machine is None:
            piece.add("content", text)
            return piece
        self._machine, segments = TextStateMachine.split(self._machine, text)
        for state, part in segments:
            if self._state == "tool" and state != "tool":
                self._close_tool(piece)  # a call's end marker came (in this piece or the last)
            self._route(piece, state, part)
            self._state = state
        return piece

    def _route(self, piece: Piece, state: Optional[str], text: str) -> None:
        if state == "tool":
            self._tool_text += text
        else:
            self._part(piece, "reasoning" if state == "reasoning" else "content", text)

    def _part(self, piece: Piece, kind: str, value: Any) -> None:
        """Add text or a call to ``piece``; whitespace that only separates or surrounds calls is no content.

        A newline between Hermes-style call blocks, or after ``</think>`` before one, is held until what
        follows is known: real text takes it along, a call drops it (as does the reply's end after a call).
        """
        if not value:
            return
        if kind == "content" and self._space is not None:
            if value.isspace():
                self._space += value
                return
            value, self._space = self._space + value, None
        elif kind != "content" and self._calls_possible:
            if self._space and kind == "reasoning" and not self._after_call:
                piece.add("content", self._space)
            self._space, self._after_call = "", kind == "call"
        piece.add(kind, value)

    def _close_tool(self, piece: Piece, closed: bool = True, parse: bool = True) -> None:
        """A tool call's text ended: parse it with mlx-lm's parser for this model.

        ``closed``: its end marker came (it is part of what the model wrote); ``parse``: try it as a call.
        """
        text, self._tool_text = self._tool_text, ""
        end = (self.tokenizer.tool_call_end or "") if closed else ""
        # Never lose model output: a call that is not one is shown as the text the model wrote.
        written = f"{self.tokenizer.tool_call_start}{text}{end}"
        if not parse:
            self._part(piece, "content", written)
            return
        try:
            parsed = self.tokenizer.tool_parser(text, self.tools)
        except Exception as e:  # parsers raise what their format's library raises
            log.warning("a tool call did not parse (%s); it is returned as text", " ".join(str(e).split()))
            self._part(piece, "content", written)
            return
        calls = [_tool_call(c) for c in (parsed if isinstance(parsed, list) else [parsed])]
        if not calls or None in calls:
            log.warning("a tool call is not a JSON object with a name (%s); it is returned as text",
                        type(parsed).__name__)
            self._part(piece, "content", written)
            return
        if self.object_arguments and not all(_object(c["function"]["arguments"]) for c in calls):
            log.warning("a tool call's arguments are not a JSON object; it is returned as text")
            self._part(piece, "content", written)
            return
        for call in calls:
            self._part(piece, "call", call)
        self._calls += len(calls)

    @property
    def made_tool_calls(self) -> bool:
        return self._calls > 0


def _keep_first_space(detok) -> bool:
    """Make ``detok`` keep the space(s) the first tokens start with: mlx-lm's detokenizers drop one while their text
    is empty, so it starts with a character no reader sees (``last_segment`` starts past it). False where the text is
    computed (a detokenizer that drops nothing)."""
    try:
        detok.text, detok.offset = "\0", 1
    except AttributeError:
        return False
    return True


def token_bytes(tokenizer, token: int) -> bytes:
    """The bytes a token stands for (OpenAI's ``bytes`` of a log-probability entry).

    Byte-level BPE pieces map back through GPT-2's byte alphabet, SentencePiece
    byte tokens (``<0x0A>``) are their byte and ``\u2581`` a space; other
    tokens (special ones included) are their decoded text.
    """
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    piece = hf.convert_ids_to_tokens(int(token))
    detok = getattr(tokenizer, "_detokenizer", None)
    if isinstance(piece, str) and piece and not _is_special(hf, int(token)):
        if isinstance(detok, BPEStreamingDetokenizer):
            table = byte_level_bytes()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        elif isinstance(detok, SPMStreamingDetokenizer):
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            return piece.replace("\u2581", " ").encode("utf-8")
    return tokenizer.decode([int(token)]).encode("utf-8")


def _is_special(hf, token: int) -> bool:
    return token in set(getattr(hf, "all_special_ids", ()) or ()) or \
        token in getattr(hf, "added_tokens_decoder", {})


def _object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def _tool_call(call) -> Optional[dict]:
    """One parsed call in OpenAI's shape (arguments as a JSON string); None when it is no call (not an object
    naming a function: ``42``, ``null``, ``[1]``)."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    given = call.get("id")
    return {"id": given if isinstance(given, str) and given else f"call_{uuid.uuid4().hex[:24]}",
            "type": "function", "function": {"name": call["name"], "arguments": arguments}}


class Reply:
    """One generation read as text: iterate it for :class:`Piece` objects, then read the totals.

    Closing the iterator (or breaking out of a ``for`` over it) cancels the
    generation at the next block; the session keeps its caches consistent.

    Args:
        session: The session that generates.
        request: What to generate.
        stream: How tokens become text (stop strings, reasoning, tools).
        cancelled: Asked between prefill chunks (see :meth:`Session.generate`).

    Attributes:
        stats: The generation's statistics (acceptance, timings), filled as it runs.
        finish_reason: ``stop`` (EOS or a stop string), ``length`` or
            ``tool_calls`` once it has run to its end; None if it was cancelled.
        tokens: The generated tokens (up to the one that completed a stop string, if one ended it).
        committed: Every token its blocks committed (the caches hold them all).
        compare: Hold the answer against the request alone when it ends (the face that finishes it
            fills ``comparison``, or ``compare_error`` where it could not).
    """

    def __init__(self, session: Session, request: Request, stream: TextStream,
                 cancelled: Optional[Callable[[], bool]] = None):
        self.session = session
        self.request = request
        self.stream = stream
        self.cancelled = cancelled
        self.stats = Stats(prompt_tokens=len(request.prompt_ids))
        self.tokens: list[int] = []
        self.committed: list[int] = []  # every token fed (past a stop string too): what its caches hold
        self.finish_reason: Optional[str] = None
        # Asked for: the answer held against the request alone once it ended (see session.alone).
        self.compare = False
        self.comparison: Optional[Comparison] = None
        self.compare_error: Optional[str] = None

    def __iter__(self) -> Iterator[Piece]:
        events = self.session.generate(self.request, cancelled=self.cancelled)
        try:
            for event in events:
                piece = self.take(event)
                if piece:
                    yield piece
                # A cancel asked is seen after every block, not only one that made text (text held back for
                # a stop string or half a character makes none).
                if self.stopped or (self.cancelled is not None and self.cancelled()):
                    break
        finally:
            events.close()
        piece = self.end()
        if piece:
            yield piece

    def take(self, event) -> Piece:
        """One event of the generation (a ``Step``'s block, or what prefill reported); the text it made safe."""
        if not isinstance(event, Step):
            self.stats.note(event)
            return Piece()
        block = event.block
        self.committed += block.tokens
        piece = self.stream.add(block.tokens)
        # The answer ends at the token that completed a stop string: the block's tokens after it (an EOS too) are not
        # its own, nor counted as generated or accepted.
        n = len(block.tokens) if self.stream.through is None else self.stream.through - len(self.tokens)
        kept = max(n, 0)
        if kept < len(block.tokens):
            block = replace(block, tokens=block.tokens[:kept], accepted=min(block.accepted, kept), finish_reason=None)
        self.stats.add(block, event.seconds)
        self.tokens += block.tokens
        if n < 0:  # completed by a token of an earlier block (its text came only with this one's)
            del self.tokens[n:]
            self.stats.generated += n
        if block.logprobs:
            piece.logprobs = [(t, lp, top) for t, (lp, top) in zip(block.tokens, block.logprobs)]
        return piece

    def end(self) -> Piece:
        """The generation ended: the text held back until now, and the finish reason set."""
        piece = self.stream.finish(cut=self.stats.finish_reason == "length")
        self.finish_reason = self._reason()
        return piece

    @property
    def stopped(self) -> bool:
        """A stop string ended the reply: generate no more."""
        return self.stream.stopped

    def _reason(self) -> str:
        if self.stream.stopped:
            return "stop"
        if self.stats.finish_reason == "length":
            return "length"
        return "tool_calls" if self.stream.made_tool_calls else "stop"

    @property
    def stop_string(self) -> Optional[str]:
        """The stop string that ended the reply (None: it ended otherwise)."""
        return self.stream.stop_string
