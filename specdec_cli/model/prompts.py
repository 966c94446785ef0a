"""Prompts to token ids: command-line text, and chat messages through the chat template.

``specdec generate`` renders its prompt as one user message (plus an optional
system message) with :func:`encode_prompt`; ``chat`` and ``serve`` render a
whole conversation with :func:`render_messages`. Both go through the same
template call, so the same messages give the same ids whichever face asked.
"""

from __future__ import annotations

import codecs
import json
import functools
import logging
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..errors import OptionError


@functools.lru_cache(maxsize=1)
def byte_level_chars() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode table (how byte-level BPE vocabularies write bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@functools.lru_cache(maxsize=1)
def byte_level_bytes() -> dict[str, int]:
    """The inverse of :func:`byte_level_chars`: a vocabulary's character -> the byte it writes."""
    return {c: b for b, c in byte_level_chars().items()}


def longest_token_chars(tokenizer) -> Optional[int]:
    """The most characters one token of ``tokenizer`` stands for (None: unknown).

    A token's entry in the vocabulary is at least as long as the text it
    decodes to (byte-level BPE writes one symbol per byte; SentencePiece one
    per character, a byte fallback as ``<0x..>``), so a text of ``n``
    characters encodes to at least ``n / longest`` tokens: a bound known
    without tokenizing it.
    """
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        vocab = inner.get_vocab()
    except Exception:  # a tokenizer without a readable vocabulary: no bound
        return None
    return max((len(piece) for piece in vocab), default=None) or None


def warn(line: str) -> None:
    """One warning line on stderr."""
    sys.stderr.write(f"warning: {line}\n")
    sys.stderr.flush()


def _decode(data: bytes, where: str) -> str:
    """UTF-8 text from any bytes: what is not UTF-8 becomes U+FFFD, with one warning."""
    # A leading byte-order mark (Notepad, PowerShell's Out-File) is no text: kept, it became the first
    # prompt's first token, and it hid a JSONL file's "{" so that every line was read as a plain prompt.
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        warn(f"{where} is not valid UTF-8: the bytes that are not became U+FFFD")
        return data.decode("utf-8", "replace")


def clean(text: Optional[str], where: str) -> Optional[str]:
    """Text from the command line as UTF-8 (argv bytes that were not arrive as surrogates)."""
    if text is None:
        return None
    try:
        data = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        data = text.encode("utf-8", "replace")
    return _decode(data, where)


def _stdin_bytes() -> bytes:
    if sys.stdin.isatty():  # `generate -` typed at a terminal waited without a word
        sys.stderr.write("reading stdin from the terminal: end it with Ctrl-D on a line of its own\n")
        sys.stderr.flush()
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is not None:
        return buffer.read()
    return sys.stdin.read().encode("utf-8", "surrogateescape")


def read_prompt(prompt_arg: Optional[str], prompt: Optional[str]) -> str:
    """The prompt text from the argument or ``-p``; ``-`` reads stdin.

    Any bytes are accepted: what is not UTF-8 is replaced (one warning line).

    Raises:
        OptionError: No prompt, two prompts, or an empty one.
    """
    if prompt_arg is not None and prompt is not None:
        raise OptionError("give the prompt once: as PROMPT or with --prompt/-p, not both")
    text = prompt if prompt is not None else prompt_arg
    if text is None:
        raise OptionError("no prompt: pass PROMPT, --prompt TEXT, or - to read stdin")
    if text == "-":
        text = _decode(_stdin_bytes(), "stdin")
        if not text.strip():
            raise OptionError("stdin was empty: pipe a prompt in, or pass it as PROMPT or --prompt TEXT")
        return text
    text = clean(text, "the prompt")
    if not text.strip():
        raise OptionError("the prompt is empty: give some text (PROMPT, --prompt TEXT, or - for stdin)")
    # As mlx-lm does: escaped newlines and tabs typed on a command line.
    return text.replace("\\n", "\n").replace("\\t", "\t")


# apply_chat_template's own parameters (transformers' and mlx-lm's): specdec passes them itself, so given as
# template variables they failed as "got multiple values" or changed what the renderer returns.
RENDERER_ARGUMENTS = frozenset({"messages", "conversation", "tokenize", "add_generation_prompt",
                                "continue_final_message", "padding", "truncation", "max_length", "return_tensors",
                                "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
# What a served request must not set besides: the model's template, and tools (the request's own field).
SERVED_ARGUMENTS = RENDERER_ARGUMENTS | {"chat_template", "tools"}


def renderer_arguments(template_kwargs: Optional[dict], refused: frozenset = RENDERER_ARGUMENTS) -> list[str]:
    """The keys of ``template_kwargs`` that are the renderer's own arguments, not template variables, sorted."""
    return sorted(set(template_kwargs or {}) & refused)


# What a JSONL line of --prompts-file may hold (anything else is refused: a typo must not be ignored).
PROMPT_FIELDS = ("prompt", "messages", "max_tokens", "seed")


@dataclass(frozen=True)
class FilePrompt:
    """One prompt of ``--prompts-file``, as read (not yet encoded).

    Attributes:
        line: Its line number in the file (1-based), for errors.
        text: A prompt, rendered through the chat template as ``-p`` is (None: ``messages``).
        messages: A chat conversation (JSONL ``"messages"``), or None.
        max_tokens: The line's own ``--max-tokens`` (None: the option's).
        seed: The line's own ``--seed`` (None: the option's).
    """

    line: int
    text: Optional[str] = None
    messages: Optional[tuple] = None
    max_tokens: Optional[int] = None
    seed: Optional[int] = None

    @property
    def label(self) -> str:
        """The prompt's start on one line (for headings)."""
        # A messages line: its last user message (the last message may be an earlier assistant turn).
        asked = [m for m in self.messages or () if m.get("role") == "user"] or list(self.messages or ())
        text = self.text if self.text is not None else str(asked[-1].get("content") or "")
        flat = " ".join(text.split())
        return flat if len(flat) <= 60 else flat[:57] + "..."


def read_prompts_file(path: str) -> list[FilePrompt]:
    """The prompts of ``--prompts-file``: one per non-empty line, or JSONL (``-`` reads stdin).

    The file is JSONL when its first non-empty line starts with ``{``: then
    every non-empty line is a JSON object with ``"prompt"`` (a string) or
    ``"messages"`` (a chat list), and optionally ``"max_tokens"`` and ``"seed"``.
    Otherwise each non-empty line is a prompt, as it stands.

    Raises:
        OptionError: The file cannot be read, holds no prompt, or a line is bad
            (naming the file, the line and what is wrong).
    """
    name = "stdin" if path == "-" else path
    if path == "-":
        data = _stdin_bytes()
    else:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise OptionError(f"cannot read --prompts-file {path} ({e.strerror}): give a file with one prompt "
                              "per line, or JSONL lines with \"prompt\"") from None
        except ValueError:  # a name the file system cannot take (a NUL)
            raise OptionError(f"cannot read --prompts-file {path!r}: give the path of a file with one prompt "
                              "per line") from None
    # Lines end at "\n", "\r\n" or "\r" only: splitlines() also broke at U+2028, U+0085 and form feeds, which
    # JSON strings may hold raw (a valid JSONL line was refused) and a plain prompt may too.
    text = _decode(data, f"--prompts-file {name}")
    lines = [(n, line) for n, line in enumerate(re.split(r"\r\n|\r|\n", text), 1) if line.strip()]
    if not lines:
        raise OptionError(f"--prompts-file {name} holds no prompt: write one prompt per line, or JSONL lines with "
                          "\"prompt\" or \"messages\"")
    if not lines[0][1].lstrip().startswith("{"):
        return [FilePrompt(n, text=line) for n, line in lines]
    return [_jsonl_prompt(name, n, line) for n, line in lines]


def _jsonl_prompt(name: str, n: int, line: str) -> FilePrompt:
    def bad(what: str) -> OptionError:
        return OptionError(f"--prompts-file {name} line {n}: {what}")

    try:
        obj = json.loads(line)
    except ValueError as e:
        raise bad(f"not valid JSON ({e}); a file whose first line starts with {{ is read as JSONL, one "
                  "object per line") from None
    if not isinstance(obj, dict):
        raise bad(f"a JSON {type(obj).__name__}, not an object like {{\"prompt\": \"...\"}}")
    unknown = sorted(set(obj) - set(PROMPT_FIELDS))
    if unknown:
        raise bad(f"unknown field {', '.join(map(repr, unknown))}: a line may hold {', '.join(PROMPT_FIELDS)}")
    if ("prompt" in obj) == ("messages" in obj):
        raise bad("give \"prompt\" (a string) or \"messages\" (a chat list), one of them")
    text = obj.get("prompt")
    if "prompt" in obj and not (isinstance(text, str) and text.strip()):
        raise bad("\"prompt\" must be a non-empty string")
    messages = obj.get("messages")
    if "messages" in obj:
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)):
            raise bad("\"messages\" must be a non-empty list of {\"role\": ..., \"content\": \"...\"} objects")
        roles = (*SYSTEM_ROLES, "user", "assistant", "tool")
        odd = next((m["role"] for m in messages if m["role"] not in roles), None)
        if odd is not None:
            raise bad(f"a message's role is {odd!r}: it is one of {', '.join(roles)}")
        messages = tuple(messages)
    limits = {"max_tokens": (1, None), "seed": (0, (1 << 32) - 1)}
    values = {}
    for key, (lo, hi) in limits.items():
        value = obj.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
            span = f">= {lo}" if hi is None else f"within [{lo}, {hi}]"
            raise bad(f"\"{key}\" must be an integer {span} (got {json.dumps(value)})")
        values[key] = value
    return FilePrompt(n, text, messages, values.get("max_tokens"), values.get("seed"))


@contextmanager
def _no_length_warning():
    # transformers warns when a text is longer than the tokenizer's
    # model_max_length; the context check says it better, in one line.
    logger = logging.getLogger("transformers.tokenization_utils_base")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of plain text, as mlx-lm encodes a prompt without a template (special tokens added)."""
    with _no_length_warning():
        return tokenizer.encode(text)


def _template(tokenizer, messages: Sequence[dict], *, tools=None, add_generation_prompt: bool = True,
              continue_final_message: bool = False, template_kwargs: Optional[dict] = None) -> list[int]:
    extra = dict(template_kwargs or {})
    if tools:
        extra["tools"] = tools
    try:
        templated = tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **extra,
        )
    except Exception as e:  # jinja and tokenizer libraries raise many types
        raise OptionError(f"the chat template failed on these messages and options ({' '.join(str(e).split())})") \
            from None
    with _no_length_warning():
        return tokenizer.encode(templated, add_special_tokens=False)


def encode_prompt(tokenizer, text: str, system_prompt: Optional[str], ignore_chat_template: bool,
                  template_kwargs: Optional[dict] = None, prefill_response: Optional[str] = None) -> list[int]:
    """Token ids of the prompt, through the chat template when there is one (as mlx-lm's generate)."""
    use_template = tokenizer.has_chat_template and not ignore_chat_template
    if not use_template:
        why = "--ignore-chat-template is set" if ignore_chat_template else "the tokenizer has no chat template"
        for name, value in (("--system-prompt", system_prompt), ("--prefill-response", prefill_response),
                            ("--chat-template-config", template_kwargs or None)):
            if value is not None:
                raise OptionError(f"{name} needs the chat template, but {why}: drop {name}")
        return encode_text(tokenizer, text)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    messages.append({"role": "user", "content": text})
    prefill = prefill_response is not None
    if prefill:
        messages.append({"role": "assistant", "content": prefill_response})
    # _folded, as chat and "messages" lines render: a template that takes no system message (Mistral v0.1)
    # gets --system-prompt in the user message; with -p it failed where chat answered.
    return _folded(tokenizer, messages, add_generation_prompt=not prefill, continue_final_message=prefill,
                   template_kwargs=template_kwargs)[0]


def encode_messages(tokenizer, messages: Sequence[dict], system_prompt: Optional[str], ignore_chat_template: bool,
                    template_kwargs: Optional[dict] = None, prefill_response: Optional[str] = None) -> list[int]:
    """Token ids of a chat list through the chat template, with ``--system-prompt`` before it and
    ``--prefill-response`` after it (as :func:`encode_prompt` treats one prompt).

    Raises:
        OptionError: There is no chat template to render messages with, or the
            system prompt would be a second one.
    """
    if ignore_chat_template or not tokenizer.has_chat_template:
        why = "--ignore-chat-template is set" if ignore_chat_template else "the tokenizer has no chat template"
        raise OptionError(f"\"messages\" need the chat template, but {why}: give \"prompt\" instead")
    messages = list(messages)
    if system_prompt is not None:
        if messages and messages[0].get("role") == "system":
            raise OptionError("--system-prompt adds a system message, and the line has its own: drop one")
        messages.insert(0, {"role": "system", "content": system_prompt})
    prefill = prefill_response is not None
    if prefill:
        messages.append({"role": "assistant", "content": prefill_response})
    return _folded(tokenizer, messages, add_generation_prompt=not prefill, continue_final_message=prefill,
                   template_kwargs=template_kwargs)[0]


# Roles a client may send for instructions; only a conversation's first messages stay system messages.
SYSTEM_ROLES = ("system", "developer")


def fold_roles(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation in a shape every chat template takes: one leading system message, never two
    user messages in a row.

    Clients send system and developer messages anywhere (Codex two developer
    messages first, Claude Code a system message after the first user one),
    and strict templates refuse them ("System message must be at the
    beginning", "Conversation roles must alternate"). One rule, whatever the
    template:

    1. System and developer messages before any other become one system
       message, their texts joined by a blank line.
    2. A later one is user text in its place: it joins the user message
       before it, or starts one (earlier turns' text never changes, so a
       prompt cache still matches them).
    3. Consecutive user messages become one, joined by a blank line.
    4. (At rendering, :func:`render_messages`) a template that takes no
       system message at all gets its text at the start of the first user
       message, as Gemma's templates place it themselves.

    Assistant and tool messages are kept as they are.
    """
    out: list[dict[str, Any]] = []
    leading = True
    for m in messages:
        role = m.get("role")
        if role in SYSTEM_ROLES and leading:
            if out:
                out[0] = {**out[0], "content": _joined(out[0].get("content"), m.get("content"))}
            else:
                out.append({**m, "role": "system"})
            continue
        leading = False
        if role in SYSTEM_ROLES or role == "user":
            if out and out[-1].get("role") == "user":
                out[-1] = {**out[-1], "content": _joined(out[-1].get("content"), m.get("content"))}
            else:
                out.append({**m} if role == "user" else {"role": "user", "content": m.get("content") or ""})
            continue
        out.append(dict(m))
    return out


def _joined(first: Any, second: Any) -> str:
    return "\n\n".join(str(p) for p in (first, second) if p)


def _system_into_user(messages: list[dict[str, Any]]) -> Optional[list[dict[str, Any]]]:
    """Rule 4 of :func:`fold_roles`: the leading system text moved into the first user message (None: no
    system message, or no user message to take it)."""
    if not messages or messages[0].get("role") != "system":
        return None
    rest = messages[1:]
    first = next((i for i, m in enumerate(rest) if m.get("role") == "user"), None)
    if first is None:
        return None
    rest[first] = {**rest[first], "content": _joined(messages[0].get("content"), rest[first].get("content"))}
    return rest


def _folded(tokenizer, messages: Sequence[dict[str, Any]], **kw) -> tuple[list[int], list[dict[str, Any]]]:
    """The ids of ``messages`` shaped by :func:`fold_roles` (rule 4 where the template needs it), and the
    messages as rendered."""
    messages = fold_roles(messages)
    try:
        return _template(tokenizer, messages, **kw), messages
    except OptionError:
        moved = _system_into_user(messages)
        if moved is None:
            raise
        return _template(tokenizer, moved, **kw), moved


@dataclass(frozen=True)
class Rendered:
    """A conversation as token ids.

    Attributes:
        ids: The whole prompt.
        boundaries: Positions where a later request is likely to branch off
            this one (the end of the system messages, the start of the last
            message): a prompt cache keeps a resumable state there.
    """

    ids: list[int]
    boundaries: tuple[int, ...] = ()


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def render_messages(tokenizer, messages: Sequence[dict[str, Any]], *, tools=None,
                    template_kwargs: Optional[dict] = None, reply: bool = True) -> Rendered:
    """Token ids of a chat conversation, ready for the assistant's reply (``reply``; False: the conversation
    as it stands, no reply opened).

    Without a chat template the messages' contents are joined by newlines.

    Raises:
        OptionError: The template failed on these messages.
    """
    if not tokenizer.has_chat_template:
        return Rendered(encode_text(tokenizer, "\n".join(str(m.get("content") or "") for m in messages)))
    ids, messages = _folded(tokenizer, messages, tools=tools, template_kwargs=template_kwargs,
                            add_generation_prompt=reply)
    cuts = set()
    n_system = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    # Where the system messages end and where the last message starts: rendering
    # the messages before it (no generation prompt) and taking what it shares
    # with the whole prompt finds the position without knowing the template.
    for upto in {n_system, len(messages) - 1}:
        if 0 < upto < len(messages):
            try:
                head = _template(tokenizer, messages[:upto], tools=tools, add_generation_prompt=False,
                                 template_kwargs=template_kwargs)
            except OptionError:  # some templates refuse a conversation that ends early
                continue
            cut = _shared(head, ids)
            if 0 < cut < len(ids):
                cuts.add(cut)
    return Rendered(ids, tuple(sorted(cuts)))


_PROBE_TOOL = [{"type": "function", "function": {"name": "probe", "description": "A probe.",
                                                  "parameters": {"type": "object", "properties": {}}}}]


def tools_note(tokenizer, template_kwargs: Optional[dict] = None) -> Optional[str]:
    """What a served request's ``tools`` do with this model, where not what a client expects; None otherwise.

    A template that renders no tools drops a request's tools unsaid (the bundled SmolLM2's), and a
    tokenizer mlx-lm reads no call format for returns the model's calls as text.
    """
    if not tokenizer.has_chat_template:
        return "this model has no chat template: a request's tools are not offered to it (its answers are text)"
    messages = [{"role": "user", "content": "hi"}]
    try:
        shown = _template(tokenizer, messages, tools=_PROBE_TOOL, template_kwargs=template_kwargs) != \
            _template(tokenizer, messages, template_kwargs=template_kwargs)
    except OptionError:
        shown = True  # a template that fails on tools fails the request that sends them, saying so
    if not shown:
        return "this model's chat template renders no tools: a request's tools are not offered to the model " \
               "(its answers are text)"
    if not getattr(tokenizer, "has_tool_calling", False):
        return "mlx-lm reads no tool-call format for this model's template: calls the model writes come back as text"
    return None
