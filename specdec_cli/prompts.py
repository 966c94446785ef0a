"""Prompts to token ids: command-line text, and chat messages through the chat template.

``specdec generate`` renders its prompt as one user message (plus an optional
system message) with :func:`encode_prompt`; ``chat`` and ``serve`` render a
whole conversation with :func:`render_messages`. Both go through the same
template call, so the same messages give the same ids whichever face asked.
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .errors import OptionError


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
    return _template(tokenizer, messages, add_generation_prompt=not prefill, continue_final_message=prefill,
                     template_kwargs=template_kwargs)


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
                    template_kwargs: Optional[dict] = None) -> Rendered:
    """Token ids of a chat conversation, ready for the assistant's reply.

    Without a chat template the messages' contents are joined by newlines.

    Raises:
        OptionError: The template failed on these messages.
    """
    if not tokenizer.has_chat_template:
        return Rendered(encode_text(tokenizer, "\n".join(str(m.get("content") or "") for m in messages)))
    ids = _template(tokenizer, messages, tools=tools, template_kwargs=template_kwargs)
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
