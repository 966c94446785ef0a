"""``specdec chat``: a conversation in the terminal on the same session as ``serve``.

Each turn renders the whole conversation through the chat template and
generates on a :class:`~specdec_cli.session.Session` with a prompt cache, so a
turn prefills only what the last one did not (the new message). The answer
streams above the live stats line; a line of numbers follows it on stderr.
``/reset`` starts over, ``/quit`` or Ctrl-D leaves, Ctrl-C stops an answer
and keeps the chat; SIGTERM ends it (exit 130).
"""

from __future__ import annotations

import re
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Optional

from .display import print_loading, print_stderr, stderr_width, text_view
from ..errors import Cancelled, OptionError, Terminated
from ..model.prompts import clean, render_messages
from ..session import (
    MemoryLimitError,
    PromptCache,
    PromptTooLongError,
    Session,
    check_model_options,
    load_setup,
    resolve_block_size,
    processor_fields,
    sampling_params,
    single_process,
)
from ..session.fit import fit_request
from ..session.options import RunOptions
from ..session.reply import Reply, TextStream
from ..core.stats import Stats

HELP = "Type a message. /reset starts over, /quit (or Ctrl-D) leaves, /help shows this; Ctrl-C stops an answer."


@dataclass
class ChatOptions(RunOptions):
    """Everything ``specdec chat`` was asked to do."""

    max_tokens: int = 512
    seed: Optional[int] = None
    live: bool = True
    prompt_cache_size: int = 10


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def turn_line(stats: Stats, interrupted: bool = False, width: Optional[int] = None,
              cut: Optional[tuple[str, str]] = None) -> str:
    """The numbers of one answer, in one line no wider than ``width`` where it can be.

    A wrapped line breaks mid-word, so on a narrow terminal the words are shortened
    first, then the least useful numbers are left out: the prefill time, the prompt,
    tokens per block, acceptance. The tokens generated, tok/s and a Ctrl-C stop stay.

    Args:
        stats: The answer's statistics.
        interrupted: Whether Ctrl-C stopped the answer.
        width: Columns available; None (not a terminal) for the full line.
        cut: What cut the answer short, in full and short: the tokens allowed, or the model's context.

    Returns:
        The line, bracketed; the shortest form when even that is wider than ``width``.
    """
    cached = f" ({stats.cached_tokens} cached)" if stats.cached_tokens else ""
    accept, tpb = f"{100 * stats.acceptance:.0f}%", f"{stats.tokens_per_block:.2f}"
    # (group, full text, short text, drop rank): groups are joined by " | ", their
    # parts by ", "; the highest rank goes first, rank 0 never.
    # Ctrl-C in the prefill: no time was reported, and "0.00 s" would read as an instant prompt.
    prefill = f"{stats.prefill_s:.2f} s" if stats.prefill_finished else "prefill stopped"
    parts = [
        (0, f"prompt {_tokens(stats.prompt_tokens)}{cached}", f"prompt {stats.prompt_tokens}{cached}", 3),
        (0, prefill, prefill, 4),
        (1, _tokens(stats.generated), _tokens(stats.generated), 0),
        (1, f"{stats.decode_tps:.1f} tok/s", f"{stats.decode_tps:.1f} tok/s", 0),
    ]
    # No acceptance of no drafts, no tokens per block of no block (generate's summary leaves them out too).
    if stats.drafted:
        parts.append((2, f"acceptance {accept}", f"accept {accept}", 1))
    if stats.blocks:
        parts.append((2, f"{tpb} tokens per block", f"{tpb} tok/block", 2))

    def line(short: bool, keep: int) -> str:
        groups: dict[int, list[str]] = {}
        for group, full, brief, rank in parts:
            if rank <= keep:
                groups.setdefault(group, []).append(brief if short else full)
        end = ("; stopped" if short else "; stopped (Ctrl-C)") if interrupted else ""
        if cut is not None and not interrupted:
            end = "; " + (cut[1] if short else cut[0])
        return "[" + " | ".join(", ".join(g) for g in groups.values()) + end + "]"

    candidates = [line(False, 4)] + [line(True, keep) for keep in (4, 3, 2, 1, 0)]
    if width is None:
        return candidates[0]
    return next((c for c in candidates if len(c) <= width), candidates[-1])


def _interactive() -> bool:
    """Whether a person types the messages (a prompt is shown), rather than a pipe or a file."""
    return sys.stdin.isatty()


def _read(prompt: str) -> Optional[str]:
    """One line from the user; None at the end of input."""
    try:
        # A file with Windows line ends piped in: Python's stdin keeps the "\r", which went to the model.
        return input(prompt).removesuffix("\r")
    except EOFError:
        if prompt:
            # Ctrl-D leaves the cursor after the prompt: end that line, or the shell's prompt would follow it.
            sys.stdout.write("\n")
            sys.stdout.flush()
        return None


def chat_command(opts: ChatOptions) -> int:
    """Run ``specdec chat``; returns the exit code."""
    single_process(opts, "chat")
    kind = check_model_options(opts)
    block_size = resolve_block_size(opts.block_size, opts.num_draft_tokens, kind)
    sampling = sampling_params(opts.temp, opts.top_p, opts.top_k, opts.min_p)
    controls = processor_fields(opts)
    if opts.prompt_cache_size < 0:
        raise OptionError("--prompt-cache-size must be >= 0")
    print_loading(opts.model, opts.draft_model)
    setup = load_setup(opts, kind)
    if not setup.tokenizer.has_chat_template:
        # generate takes such a model's prompt as it stands: no option to add there.
        raise OptionError("this model's tokenizer has no chat template, so it has no conversation to hold: use "
                          "specdec generate (it feeds the prompt as it stands), or a chat model")
    block_size = setup.run_block_size(block_size)
    cache = PromptCache(opts.prompt_cache_size) if opts.prompt_cache_size else None
    session = Session(setup, block_size, adaptive=opts.adaptive, prompt_cache=cache)
    warning = session.use_disk(opts.prompt_cache_dir, opts.prompt_cache_disk_gb)
    if warning:
        print_stderr([f"warning: {warning}"])
    try:
        return _turns(opts, setup, session, sampling, controls, block_size)
    finally:
        session.shutdown()


def _turns(opts: ChatOptions, setup, session: Session, sampling, controls: dict, block_size: int) -> int:
    """Read and answer messages until /quit or the end of input."""
    system = clean(opts.system_prompt, "--system-prompt")
    start = [{"role": "system", "content": system}] if system is not None else []
    messages = list(start)
    print_stderr(setup.start_lines()
                 + [f"{setup.model_line}; drafter {setup.drafter_name}, block size {block_size}", HELP])
    interactive = _interactive()
    while True:
        try:
            line = _read("> " if interactive else "")
        except Terminated:
            raise
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            continue
        if line is None or line.strip() in ("/quit", "/exit"):
            break
        if line.strip() == "/reset":
            messages = list(start)
            print_stderr(["(the conversation starts over)"])
            continue
        if re.fullmatch(r"/[A-Za-z?]+", line.rstrip()):  # a command, never a message (a typo of /reset would stay)
            word = line.rstrip()
            print_stderr([HELP if word in ("/help", "/?") else
                          f"unknown command {word}: /reset starts over, /quit leaves (a message starting with / "
                          "needs a space before it)"])
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": clean(line, "the message")})
        try:
            rendered = render_messages(setup.tokenizer, messages, template_kwargs=setup.template_kwargs)
            fitted = fit_request(setup, rendered.ids, opts.max_tokens, sampling=sampling, seed=opts.seed,
                                 boundaries=rendered.boundaries, **controls)
            request = fitted.request
        except (OptionError, PromptTooLongError, MemoryLimitError) as e:
            messages.pop()
            print_stderr([f"error: {e}" + ("" if isinstance(e, OptionError) else
                                           "; the message was not sent (/reset starts the conversation over)")])
            continue
        with _CtrlC() as ctrl_c:
            reply = Reply(session, request, TextStream(setup.tokenizer, chat=False), cancelled=ctrl_c.asked)
            answer, interrupted = _stream(reply, opts.live, setup.drafter_name, ctrl_c)
        messages.append({"role": "assistant", "content": answer})
        cut = None
        if reply.stats.finish_reason == "length":  # never silent: the answer did not end by itself
            cut = (f"cut at the model's context ({fitted.context} tokens): /reset starts over", "cut at the context") \
                if fitted.capped else (f"cut at --max-tokens {opts.max_tokens}", "cut at -m")
        print_stderr([turn_line(reply.stats, interrupted, stderr_width(), cut)])
    return 0


class _CtrlC:
    """Ctrl-C during a turn: the first stops it where its caches hold whole tokens, a second at once.

    A Ctrl-C raised inside a prefill chunk would leave the caches half written, and the
    conversation's cached prefix (handed to this turn, not copied) would be lost with them:
    stopped between chunks, what was fed is kept, and the next turn resumes it.
    """

    def __init__(self):
        self.stop = False
        # Set while the turn's generator is closed (its caches leave the engine): a press then is not a second one.
        self.closing = False
        self._before = None

    def asked(self) -> bool:
        return self.stop

    def _handle(self, signum, frame) -> None:
        if self.stop and not self.closing:
            raise KeyboardInterrupt
        self.stop = True

    def __enter__(self) -> "_CtrlC":
        if threading.current_thread() is threading.main_thread():  # only there can a handler be set
            self._before = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._before is not None:
            signal.signal(signal.SIGINT, self._before)


def _stream(reply: Reply, live: bool, drafter: str, ctrl_c: Optional[_CtrlC] = None) -> tuple[str, bool]:
    """Show one answer as it comes; returns its text and whether Ctrl-C stopped it."""
    view = text_view(live, drafter, False)
    answer, interrupted = "", False
    pieces = iter(reply)
    try:
        for piece in pieces:
            answer += piece.content
            view.write(piece.content)
            view.update(reply.stats)
            if ctrl_c is not None and ctrl_c.stop:
                interrupted = True
                break
        # The reply stopped for the Ctrl-C after a block that made no text (or only its last text came).
        interrupted = interrupted or (ctrl_c is not None and ctrl_c.stop)
    except Terminated:
        raise  # SIGTERM ends the chat, not the answer alone
    except (KeyboardInterrupt, Cancelled):
        interrupted = True
    finally:
        if ctrl_c is not None:
            ctrl_c.closing = True
        pieces.close()  # the session keeps its caches, as after any answer
        view.close()
    return answer, interrupted
