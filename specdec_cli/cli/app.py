"""The ``specdec`` command line: a thin Typer layer over the runner.

Every option is checked here, at the boundary (Typer ranges and callbacks,
the range named in the error). All failures pass through one place: usage
errors in :class:`_Group`, everything else in :func:`error_boundary`. Either
way the user gets one line on stderr, a documented exit code, and no
traceback (``--debug`` shows it).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from contextlib import contextmanager
from enum import Enum
from typing import Iterator, List, Optional

import typer
from typer.core import TyperCommand, TyperGroup
from typing_extensions import Annotated

from .. import __version__
from ..defaults import AUTO_ROWS, DEFAULT_DECODE_CONCURRENCY, DEFAULT_KV_GROUP_SIZE, DISTILL, KNEE_GAIN, MAX_DISK_GB
from ..drafters.kinds import (DEFAULT_BLOCK_SIZE, DRAFTER_KINDS, MAX_ANY_BLOCK_SIZE, MAX_BLOCK_SIZE, MAX_NGRAM, NGRAM_MAX,
                              NGRAM_MIN)
from ..errors import EXIT_INTERRUPTED, SpecdecError, Terminated
from ..model.prompts import renderer_arguments
from . import spellings

# Exit codes (README "Limits and errors"); 3 and 130 are errors.py's, which the commands return themselves.
EXIT_USAGE = 2
EXIT_STDOUT_CLOSED = 141  # 128 + SIGPIPE, what a reader that went away leaves in shells


def _err(line: str) -> None:
    # One line, whatever the exception's message holds.
    sys.stderr.write(" ".join(str(line).split()) + "\n")
    sys.stderr.flush()


def _usage_error(line: str) -> None:
    """A usage error's one line; under mlx.launch, rank 0's alone when every rank made the same mistake.

    The ranks parse before they join, so each wrote the line (twice on screen), and the first to exit
    could have the launcher end rank 0 with -15 instead of 2. A rank other than 0 first waits to join:
    rank 0, with the same error, never comes and the launcher ends this rank silently; a rank 0 that
    parsed the command (the mistake was this rank's: its environment) joins, and this rank says it.
    """
    rank = os.environ.get("MLX_RANK", "")  # mlx.launch's, for the ring and JACCL backends
    if rank not in ("", "0"):
        try:
            import mlx.core as mx

            mx.distributed.init()
        except Exception:  # no rank 0 to join (MLX gives up after about 30 s): say it all the same
            pass
        line = line.replace("error: ", f"error: rank {rank}: ", 1)
    _err(line)


def _help_option(option, panel: Optional[str] = None):
    # -h/--help is a flag like the others (no <bool>).
    if option is not None:
        option.metavar = ""
        option.rich_help_panel = panel
    return option


def _no_range() -> None:
    return None


class _Command(TyperCommand):
    def get_help_option(self, ctx):
        return _help_option(super().get_help_option(ctx), "Output")

    def format_help(self, ctx, formatter):
        # Help shows each option's metavar without its range ([0<=x<=4294967295]): at 80 columns the
        # ranges widened the metavar column until option names were cut ("--rollback-memory…").
        # Every range is still enforced when parsing and named in the error (see _Group.main).
        hidden = [p for p in self.params if hasattr(p, "_get_number_range_help_str")]
        for param in hidden:
            param._get_number_range_help_str = _no_range
        try:
            return super().format_help(ctx, formatter)
        finally:
            for param in hidden:
                del param._get_number_range_help_str


class _Group(TyperGroup):
    """Typer's group, with usage errors on one line instead of a boxed panel."""

    def get_help_option(self, ctx):
        return _help_option(super().get_help_option(ctx))

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        given = list(sys.argv[1:] if args is None else args)
        wrong = spellings.mlx_lm_spelling(given)
        if wrong is not None:
            _usage_error(f"error: {wrong}")
            if standalone_mode:
                sys.exit(EXIT_USAGE)
            return EXIT_USAGE
        try:
            code = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                                standalone_mode=False, **extra)
        except Exception as e:
            # Typer's vendored Click raises its own usage errors; we never import Click,
            # so they are known by what they offer: a message and an exit code.
            if not callable(getattr(e, "format_message", None)):
                raise
            ctx = getattr(e, "ctx", None)
            if type(e).__name__ == "NoArgsIsHelpError":
                # Building this error rendered the help: Rich prints it to stdout as it formats,
                # leaving an empty message; plain Click formatting returns it as the message.
                # Echoing ctx.get_help() again printed it twice. Exit 2, as Typer's own
                # no_args_is_help does: no command is a usage error.
                help_text = e.format_message()
                if help_text.strip():
                    typer.echo(help_text)
                code = EXIT_USAGE
            else:
                message = e.format_message().rstrip(".")
                param = getattr(e, "param", None)
                ranged = getattr(param, "_get_number_range_help_str", None)
                span = ranged() if callable(ranged) else None
                if span and span not in message:
                    message += f" (range {span})"
                unported = spellings.MLX_LM_ONLY.get(getattr(e, "option_name", None) or "")
                if type(e).__name__ == "NoSuchOption" and unported:
                    message = f"{e.option_name} is mlx_lm's, not taken here: {unported}"
                extra_args = message.startswith("Got unexpected extra argument")
                # The extra word may be a prompt's (`chat "hello"`, `generate Write a poem`) or an option value's
                # (`--system-prompt Be brief`, `--block-sizes 2 4 8`): both are named.
                if extra_args and ctx is not None and ctx.info_name == "chat":
                    message += ("; chat takes no prompt (type the messages, or pipe them in: printf 'hello\\n' | "
                                "specdec chat), and an option's value of several words goes in quotes")
                elif extra_args and ctx is not None and ctx.info_name in ("generate", "sweep"):
                    message += ("; a prompt or an option's value of several words goes in quotes ('Write a poem'), "
                                "and a list of numbers is written with commas (--block-sizes 2,4,8)")
                where = f"; see '{ctx.command_path} -h'" if ctx is not None else ""
                _usage_error(f"error: {message}{where}")
                code = getattr(e, "exit_code", EXIT_USAGE)
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    cls=_Group,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Lossless speculative decoding for MLX / mlx-lm, hybrid and sliding-window models included.",
)


def _quiet_streams() -> None:
    # A reader is gone (of stdout, or of stderr: `2>&1 | head`): point both at /dev/null, so that
    # Python's own flush at exit does not fail a second time (on stderr that makes the exit 120).
    # Nothing is written after this: the boundary ends the run with 141.
    for stream in (sys.stdout, sys.stderr):
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass


def _unexpected(e: BaseException) -> str:
    """Words for an exception nobody expected, without its class name."""
    if isinstance(e, MemoryError):
        return "out of memory: lower --max-tokens, shorten the prompt or pick a smaller model"
    if isinstance(e, OSError) and e.strerror:
        where = f" ({e.filename})" if e.filename else ""
        return f"the system refused an operation: {e.strerror}{where}"
    text = str(e).strip() or "no details"
    return f"something went wrong inside specdec ({text}); run again with --debug for the traceback"


def _ranks(e: BaseException) -> tuple[str, bool]:
    """Under mlx.launch: who failed (``rank N: `` on ranks but 0), and whether rank 0 says it for every rank."""
    if "specdec_cli.model.distributed" not in sys.modules:
        return "", False  # never joined any ranks
    from ..model.distributed import error_prefix, silent

    return error_prefix(), silent(e)


@contextmanager
def error_boundary(debug: bool) -> Iterator[None]:
    """Turn exceptions into one stderr line and an exit code."""
    try:
        yield
    except typer.Exit:
        raise
    except SpecdecError as e:
        if debug:
            raise
        who, silent = _ranks(e)
        if silent:
            from ..model.distributed import leave_to_rank_0

            leave_to_rank_0()
        else:
            _err(f"error: {who}{e}")
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt as e:
        who, silent = _ranks(e)
        if not silent:
            _err(f"{who}interrupted")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except BrokenPipeError:
        # `specdec ... | head`: the reader has what it wanted.
        _quiet_streams()
        raise typer.Exit(EXIT_STDOUT_CLOSED) from None
    except Exception as e:  # the boundary: anything unexpected, still one line
        if debug:
            raise
        _err(f"error: {_ranks(e)[0]}{_unexpected(e)}")
        raise typer.Exit(1) from None


def _interrupt(signum, frame):
    raise Terminated


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM takes Ctrl-C's path: the text so far, the summary, exit 130."""
    try:
        previous = signal.signal(signal.SIGTERM, _interrupt)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(command, options_type, params: dict) -> None:
    """Run a command inside the error boundary; its parameters become its options."""
    debug = params.pop("debug")
    with _sigterm_as_interrupt(), error_boundary(debug):
        options = options_type(**{k: v.value if isinstance(v, Enum) else v for k, v in params.items()})
        code = command(options)
        if code:
            raise typer.Exit(code)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"specdec {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, metavar="", help="Show the version.")
    ] = False,
) -> None:
    """Lossless speculative decoding for MLX / mlx-lm."""
    from ..model.backend import backend_problem

    if ctx.invoked_subcommand == "doctor":
        return  # it runs whatever the install, and reports the problem among its notes (once, --json too)
    problem, fatal = backend_problem()
    if problem:
        _err(f"{'error' if fatal else 'warning'}: {problem}")
        if fatal:
            raise typer.Exit(1)


# --- checks at the boundary ---------------------------------------------------

def _finite(value: Optional[float]) -> Optional[float]:
    # Ranges let NaN through (every comparison with it is false).
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def _one_of(allowed: tuple[int, ...]):
    def check(value: Optional[int]) -> Optional[int]:
        if value is not None and value not in allowed:
            raise typer.BadParameter(f"{value} is not one of {', '.join(map(str, allowed))}")
        return value

    return check


def _json_object(value: Optional[str]) -> Optional[str]:
    if value is None:
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise typer.BadParameter("""takes a JSON object, like '{"enable_thinking": false}'""")
    # The renderer's own arguments (model/prompts.py): 'tokenize' failed with "got multiple values for keyword
    # argument 'tokenize'", a Python message naming no fix; others changed what the renderer returns.
    taken = renderer_arguments(parsed)
    if taken:
        one = len(taken) == 1
        hint = " (generate's --prefill-response continues a reply)" if \
            {"add_generation_prompt", "continue_final_message"} & set(taken) else ""
        what = "own argument, not a template variable: drop it" if one else \
            "own arguments, not template variables: drop them"
        raise typer.BadParameter(f"{', '.join(map(repr, taken))} {'is' if one else 'are'} the template renderer's "
                                 f"{what}{hint}")
    return value


# --- option declarations, grouped in help panels --------------------------------
#
# Help is read at 80 columns as often as at 200: each help string is a line or two there, the
# long story is in docs/GENERATE.md and docs/SERVER.md. Panels come in the order people reach
# for them (the prompt and model first, the rarely needed last, in Advanced); a command's
# panels follow the order of its parameters.

MODEL, PROMPT, DRAFTING, SAMPLING, OUTPUT, DIAGNOSTICS, ADVANCED, RECURRENT = (
    "Model", "Prompt", "Drafting", "Sampling", "Output", "Diagnostics", "Advanced", "Recurrent layers")
FLAG = dict(metavar="")  # a flag shows as --x (or --x/--no-x), not <bool>


def _default(text: str) -> dict:
    # Options whose default is None (decided later) say what that means; the
    # backslash keeps Rich from reading the brackets as markup.
    return dict(show_default=False, help_suffix=f" \\[default: {text}]")


# A default of None that means "not given" shows nothing: "[default: none]" on every row was noise.
UNSET = dict(show_default=False)


def _opt(*names: str, help: str, help_suffix: str = "", **kw) -> typer.models.OptionInfo:
    return typer.Option(*names, help=help + help_suffix, **kw)


def _choices(enum: type[Enum]) -> str:
    # A choice list as the help's first line, words apart: at 80 columns Typer's <a|b|c> metavar
    # was one long word, which Rich folded mid-word.
    return ", ".join(member.value for member in enum) + "\n\n"


# --drafter's choices, from the registry of drafter kinds (drafters.kinds.KINDS).
DrafterKind = Enum("DrafterKind", [(name, name) for name in DRAFTER_KINDS], type=str)


class Rollback(str, Enum):
    auto = "auto"
    reforward = "reforward"
    carry = "carry"
    capture = "capture"
    tape = "tape"


class Shapes(str, Enum):
    auto = "auto"
    exact = "exact"
    bucketed = "bucketed"


class DType(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


# Model
ModelOpt = Annotated[Optional[str], _opt(
    "--model", metavar="ID|DIR", help="Target model: Hub repo id or local folder.", rich_help_panel=MODEL,
    **_default("the bundled SmolLM2-135M-Instruct"))]
DraftModelOpt = Annotated[Optional[str], _opt(
    "--draft-model", metavar="ID|DIR", help="A draft model (same tokenizer), MTP head or DFlash drafter.",
    rich_help_panel=MODEL, **UNSET)]
DTypeOpt = Annotated[DType, _opt(
    "--dtype", metavar="DTYPE", help=_choices(DType) + "Cast both models; auto: float32 on a CPU, the "
    "checkpoint's own on a GPU.", rich_help_panel=MODEL)]

# Prompt
PromptArg = Annotated[Optional[str], typer.Argument(
    metavar="PROMPT", help="The prompt; '-' reads stdin.", show_default=False)]
PromptOpt = Annotated[Optional[str], _opt(
    "--prompt", "-p", metavar="TEXT", help="The prompt; '-' reads stdin.", rich_help_panel=PROMPT, **UNSET)]
PromptsFileOpt = Annotated[Optional[str], _opt(
    "--prompts-file", metavar="FILE", help="Several prompts decoded together: one a line, or JSONL; '-' "
    "reads stdin.", rich_help_panel=PROMPT, **UNSET)]
SystemOpt = Annotated[Optional[str], _opt(
    "--system-prompt", metavar="TEXT", help="System message for the chat template.", rich_help_panel=PROMPT,
    **UNSET)]

# Drafting
DrafterOpt = Annotated[Optional[DrafterKind], _opt(
    "--drafter", metavar="KIND", help=_choices(DrafterKind) + "Who drafts; auto: the best available (says "
    "which).", rich_help_panel=DRAFTING, **_default("model with --draft-model, else lookup"))]
# auto runs the default of the kind it picks (lookup's 64 with no drafter at hand), not a size of its own.
_BLOCK_DEFAULTS = (", ".join(f"{k} {v}" for k, v in DEFAULT_BLOCK_SIZE.items() if k != "auto")
                   + ", auto: that of the drafter it picks, a DFlash drafter's own")
_LIMITS = ", ".join(f"{k} {v}" for k, v in MAX_BLOCK_SIZE.items())
BlockSizeOpt = Annotated[Optional[int], _opt(
    "--block-size", metavar="N", min=1, max=MAX_ANY_BLOCK_SIZE,
    help="Most tokens verified per target forward (drafts + 1).",
    rich_help_panel=DRAFTING, **_default(_BLOCK_DEFAULTS))]
AdaptiveOpt = Annotated[bool, _opt(
    "--adaptive/--no-adaptive", help="Fit the draft length to acceptance; stop speculating while slower.",
    rich_help_panel=DRAFTING, **FLAG)]
LookupHistoryOpt = Annotated[Optional[str], _opt(
    "--lookup-history", metavar="FILE", help="Lookup: also draft from earlier runs' outputs in FILE, and add "
    "this one.", rich_help_panel=DRAFTING, **UNSET)]
# A sweep only reads the history: adding its output would hand every later sweep of the same prompt that
# very text to draft from, so two runs of one sweep would no longer measure the same thing.
SweepHistoryOpt = Annotated[Optional[str], _opt(
    "--lookup-history", metavar="FILE", help="Lookup: also draft from earlier runs' outputs in FILE (read "
    "only: a sweep does not add its own output).", rich_help_panel=DRAFTING, **UNSET)]

# Sampling
MaxTokensOpt = Annotated[int, _opt(
    "--max-tokens", "-m", metavar="N", min=1, help="Most tokens to generate.", rich_help_panel=SAMPLING)]
TempOpt = Annotated[float, _opt(
    "--temp", metavar="X", min=0.0, callback=_finite, help="Temperature; 0: greedy, > 0 samples losslessly.",
    rich_help_panel=SAMPLING)]
TopPOpt = Annotated[float, _opt(
    "--top-p", metavar="X", min=0.0, max=1.0, callback=_finite, help="Nucleus sampling mass (0: off).",
    rich_help_panel=SAMPLING)]
TopKOpt = Annotated[int, _opt(
    "--top-k", metavar="N", min=0, max=1 << 24, help="Sample among the k likeliest tokens (0: off).",
    rich_help_panel=SAMPLING)]
MinPOpt = Annotated[float, _opt(
    "--min-p", metavar="X", min=0.0, max=1.0, callback=_finite, help="Drop tokens below min-p x the top one "
    "(0: off).", rich_help_panel=SAMPLING)]
SeedOpt = Annotated[Optional[int], _opt(
    "--seed", metavar="N", min=0, max=(1 << 32) - 1, help="Random seed.", rich_help_panel=SAMPLING,
    **_default("random"))]

# Output
JsonOpt = Annotated[bool, _opt(
    "--json", help="One JSON object on stdout, nothing else.", rich_help_panel=OUTPUT, **FLAG)]
LiveOpt = Annotated[bool, _opt(
    "--live/--no-live", help="Live stats under the text (on a terminal).", rich_help_panel=OUTPUT, **FLAG)]
VerboseOpt = Annotated[bool, _opt(
    "--verbose", help="Time each phase (two syncs a block); show the memory estimate.", rich_help_panel=OUTPUT,
    **FLAG)]

# Diagnostics
CompareOpt = Annotated[bool, _opt(
    "--compare-ar", help="Also run plain decoding; exit 3 unless the output is identical.",
    rich_help_panel=DIAGNOSTICS, **FLAG)]
MemoryCheckOpt = Annotated[bool, _opt(
    "--memory-check/--no-memory-check", help="Refuse a run estimated to need more memory than there is.",
    rich_help_panel=DIAGNOSTICS, **FLAG)]
DebugOpt = Annotated[bool, _opt("--debug", help="Show tracebacks.", rich_help_panel=DIAGNOSTICS, **FLAG)]

# Advanced: needed now and then; every one is in docs/GENERATE.md
AdapterOpt = Annotated[Optional[str], _opt(
    "--adapter-path", metavar="DIR", help="LoRA adapters for the target (mlx_lm.lora's).",
    rich_help_panel=ADVANCED, **UNSET)]
TrustOpt = Annotated[bool, _opt(
    "--trust-remote-code", help="Allow the model's own Python files.", rich_help_panel=ADVANCED, **FLAG)]
ForceDownloadOpt = Annotated[bool, _opt(
    "--force-download", help="Download a Hub model's files again.", rich_help_panel=ADVANCED, **FLAG)]
KvBitsOpt = Annotated[Optional[int], _opt(
    "--kv-bits", metavar="BITS", callback=_one_of((2, 3, 4, 5, 6, 8)),
    help="Quantize the target's KV cache: 2, 3, 4, 5, 6 or 8.", rich_help_panel=ADVANCED, **UNSET)]
KvGroupOpt = Annotated[Optional[int], _opt(
    "--kv-group-size", metavar="N", callback=_one_of((32, 64, 128)), help="Group size of --kv-bits: 32, 64 "
    "or 128.", rich_help_panel=ADVANCED, **_default(str(DEFAULT_KV_GROUP_SIZE)))]
PrefillOpt = Annotated[int, _opt(
    "--prefill-step-size", metavar="N", min=1, max=1 << 20, help="Most prompt tokens per prefill chunk.",
    rich_help_panel=ADVANCED)]
PipelineOpt = Annotated[bool, _opt(
    "--pipeline", help="Under mlx.launch: shard the target by layers, not heads.", rich_help_panel=ADVANCED,
    **FLAG)]
BatchConcurrencyOpt = Annotated[Optional[int], _opt(
    "--decode-concurrency", metavar="N", min=1, max=256, help="With --prompts-file: most prompts decoding "
    "together.", rich_help_panel=ADVANCED, **_default(f"all, at most {DEFAULT_DECODE_CONCURRENCY}"))]
NoTemplateOpt = Annotated[bool, _opt(
    "--ignore-chat-template", help="Use the prompt as is, without the chat template.",
    rich_help_panel=ADVANCED, **FLAG)]
TemplateConfigOpt = Annotated[Optional[str], _opt(
    "--chat-template-config", metavar="JSON", callback=_json_object,
    help="""Chat template arguments, e.g. '{"enable_thinking": false}'.""", rich_help_panel=ADVANCED, **UNSET)]
PrefillResponseOpt = Annotated[Optional[str], _opt(
    "--prefill-response", metavar="TEXT", help="The reply's start, which generation continues.",
    rich_help_panel=ADVANCED, **UNSET)]
NumDraftOpt = Annotated[Optional[int], _opt(
    "--num-draft-tokens", metavar="N", min=0, max=MAX_ANY_BLOCK_SIZE - 1, help="mlx-lm's name for block "
    "size - 1.", rich_help_panel=ADVANCED, **UNSET)]
DraftPMinOpt = Annotated[Optional[float], _opt(
    "--draft-p-min", metavar="X", min=0.0, max=1.0, callback=_finite,
    help="Stop drafting below this top-1 probability.", rich_help_panel=ADVANCED,
    **_default("0, never stop early"))]
NgramMaxOpt = Annotated[Optional[int], _opt(
    "--ngram-max", metavar="N", min=1, max=MAX_NGRAM, help="ngram: longest suffix matched.",
    rich_help_panel=ADVANCED, **_default(str(NGRAM_MAX)))]
NgramMinOpt = Annotated[Optional[int], _opt(
    "--ngram-min", metavar="N", min=1, max=MAX_NGRAM, help="ngram: shortest suffix matched.",
    rich_help_panel=ADVANCED, **_default(str(NGRAM_MIN)))]
RollbackOpt = Annotated[Rollback, _opt(
    "--rollback", metavar="MODE", help=_choices(Rollback) + "How they roll back a partial accept; auto "
    "measures.", rich_help_panel=RECURRENT)]
ShapesOpt = Annotated[Shapes, _opt(
    "--shapes", metavar="MODE", help=_choices(Shapes) + "Verify widths; bucketed: powers of two (padded), so a "
    "GPU compiles few shapes; auto: bucketed on a GPU. Output is the same.", rich_help_panel=ADVANCED)]
ExactOpt = Annotated[bool, _opt(
    "--exact", help="One text whatever shares a forward (slower; probed at load, refused where it cannot hold).",
    rich_help_panel=ADVANCED, **FLAG)]
RollbackCapOpt = Annotated[Optional[float], _opt(
    "--rollback-memory-cap", metavar="MIB", min=0.0, callback=_finite,
    help="Most MiB capture may hold per verify (else tape).", rich_help_panel=RECURRENT, **_default("no cap"))]
RepetitionPenaltyOpt = Annotated[Optional[float], _opt(
    "--repetition-penalty", metavar="X", min=0.0, callback=_finite,
    help="mlx-lm's repetition penalty; output stays exact.", rich_help_panel=ADVANCED, **_default("off"))]
RepetitionContextOpt = Annotated[int, _opt(
    "--repetition-context-size", metavar="N", min=1, max=1 << 20,
    help="Tokens the penalty looks back over.", rich_help_panel=ADVANCED)]
JsonSchemaOpt = Annotated[Optional[str], _opt(
    "--json-schema", metavar="FILE", help="Constrain the output to JSON valid against FILE's schema.",
    rich_help_panel=ADVANCED, **UNSET)]
ExtraEosOpt = Annotated[Optional[List[str]], _opt(
    "--extra-eos-token", metavar="TOKEN", help="Another token that ends generation (repeatable).",
    rich_help_panel=ADVANCED, **UNSET)]

REFERENCE = "Every option in detail: {doc}."
EXIT_CODES = ("Exit codes: 0 done; 1 error; 2 bad option or input; {three}; "
              "130 interrupted (Ctrl-C, SIGTERM); 141 stdout closed.")


@app.command(
    cls=_Command,
    epilog=EXIT_CODES.format(three="3 --compare-ar found a divergence") + "\n\n"
    + REFERENCE.format(doc="docs/GENERATE.md") + "\n\n"
    "Example: specdec generate --model mlx-community/Qwen3-0.6B-bf16 "
    "-p 'Summarise this: ...' --max-tokens 200 --compare-ar"
)
def generate(
    # The order of the parameters is the order of the panels in -h.
    prompt_arg: PromptArg = None,
    prompt: PromptOpt = None,
    prompts_file: PromptsFileOpt = None,
    system_prompt: SystemOpt = None,
    model: ModelOpt = None,
    draft_model: DraftModelOpt = None,
    dtype: DTypeOpt = DType.auto,
    drafter: DrafterOpt = None,
    block_size: BlockSizeOpt = None,
    adaptive: AdaptiveOpt = True,
    lookup_history: LookupHistoryOpt = None,
    max_tokens: MaxTokensOpt = 256,
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 0.0,
    top_k: TopKOpt = 0,
    min_p: MinPOpt = 0.0,
    seed: SeedOpt = None,
    json_output: JsonOpt = False,
    live: LiveOpt = True,
    verbose: VerboseOpt = False,
    compare_ar: CompareOpt = False,
    memory_check: MemoryCheckOpt = True,
    debug: DebugOpt = False,
    decode_concurrency: BatchConcurrencyOpt = None,
    prompt_cache_dir: PromptCacheDirOpt = None,
    prompt_cache_disk_gb: PromptCacheDiskOpt = None,
    ignore_chat_template: NoTemplateOpt = False,
    chat_template_config: TemplateConfigOpt = None,
    prefill_response: PrefillResponseOpt = None,
    num_draft_tokens: NumDraftOpt = None,
    draft_p_min: DraftPMinOpt = None,
    ngram_max: NgramMaxOpt = None,
    ngram_min: NgramMinOpt = None,
    repetition_penalty: RepetitionPenaltyOpt = None,
    repetition_context_size: RepetitionContextOpt = 20,
    json_schema: JsonSchemaOpt = None,
    extra_eos_token: ExtraEosOpt = None,
    adapter_path: AdapterOpt = None,
    trust_remote_code: TrustOpt = False,
    force_download: ForceDownloadOpt = False,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupOpt = None,
    prefill_step_size: PrefillOpt = 2048,
    pipeline: PipelineOpt = False,
    rollback: RollbackOpt = Rollback.auto,
    rollback_memory_cap: RollbackCapOpt = None,
    shapes: ShapesOpt = Shapes.auto,
    exact: ExactOpt = False,
) -> None:
    """Generate text with speculative decoding."""
    params = dict(locals())
    from .commands import GenerateOptions, generate_command

    _run(generate_command, GenerateOptions, params)


@app.command(
    cls=_Command,
    epilog=EXIT_CODES.format(three="3 a speculative run was not identical to plain decoding") + "\n\n"
    + REFERENCE.format(doc="docs/GENERATE.md") + "\n\n"
    "Example: specdec sweep --model mlx-community/Qwen3-0.6B-bf16 "
    "-p 'Summarise this: ...' --block-sizes 2,4,8 --repeats 3"
)
def sweep(
    prompt_arg: PromptArg = None,
    prompt: PromptOpt = None,
    system_prompt: SystemOpt = None,
    model: ModelOpt = None,
    draft_model: DraftModelOpt = None,
    dtype: DTypeOpt = DType.auto,
    drafter: DrafterOpt = None,
    block_sizes: Annotated[str, typer.Option(
        "--block-sizes", metavar="LIST", help="Block sizes to measure, comma-separated.",
        rich_help_panel=DRAFTING)] = "2,3,4,6,8,12,16",
    concurrency: Annotated[str, typer.Option(
        "--concurrency", metavar="LIST", help="Batch sizes, comma-separated: a table of aggregate tok/s by "
        "block and batch size.", rich_help_panel=DRAFTING)] = "1",
    lookup_history: SweepHistoryOpt = None,
    max_tokens: MaxTokensOpt = 128,
    json_output: JsonOpt = False,
    repeats: Annotated[int, typer.Option(
        "--repeats", metavar="N", min=1, max=1000, help="Speed runs per configuration (median).",
        rich_help_panel=DIAGNOSTICS)] = 1,
    warmup: Annotated[int, typer.Option(
        "--warmup", metavar="N", min=0, max=100, help="Untimed warm-up runs first.",
        rich_help_panel=DIAGNOSTICS)] = 1,
    memory_check: MemoryCheckOpt = True,
    debug: DebugOpt = False,
    ignore_chat_template: NoTemplateOpt = False,
    chat_template_config: TemplateConfigOpt = None,
    prefill_response: PrefillResponseOpt = None,
    draft_p_min: DraftPMinOpt = None,
    ngram_max: NgramMaxOpt = None,
    ngram_min: NgramMinOpt = None,
    extra_eos_token: ExtraEosOpt = None,
    adapter_path: AdapterOpt = None,
    trust_remote_code: TrustOpt = False,
    force_download: ForceDownloadOpt = False,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupOpt = None,
    prefill_step_size: PrefillOpt = 2048,
    pipeline: PipelineOpt = False,
    rollback: RollbackOpt = Rollback.auto,
    rollback_memory_cap: RollbackCapOpt = None,
    shapes: ShapesOpt = Shapes.auto,
    exact: ExactOpt = False,
) -> None:
    """Measure speed and acceptance over several block sizes, against plain decoding."""
    params = dict(locals())
    from .commands import SweepOptions, sweep_command

    _run(sweep_command, SweepOptions, params)


SERVER, LIMITS = "Server", "Limits"


def _size(value: Optional[str]) -> Optional[int]:
    # Bytes, or with a unit: 512M, 8GB, 2GiB (as mlx_lm.server takes it).
    if value is None:
        return None
    text = value.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(text[-1:], 1)
    digits = text[:-1] if scale > 1 else text
    try:
        n = float(digits)
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not a size: give bytes, or a number with K, M or G") from None
    if not math.isfinite(n) or n < 0:
        raise typer.BadParameter(f"{value!r} is not a size >= 0")
    return int(n * scale)


HostOpt = Annotated[str, _opt("--host", metavar="ADDR", help="Address to listen on; not loopback: needs "
                              "--api-key or --no-api-key.", rich_help_panel=SERVER)]
PortOpt = Annotated[int, _opt("--port", metavar="PORT", min=0, max=65535, help="Port to listen on (0: any free "
                              "one, printed at start).", rich_help_panel=SERVER)]
ApiKeyOpt = Annotated[Optional[str], _opt(
    "--api-key", metavar="KEY", envvar="SPECDEC_API_KEY", help="Require this key (a bearer token) on every request "
    "but /health.", rich_help_panel=SERVER, **UNSET)]
NoApiKeyOpt = Annotated[bool, _opt(
    "--no-api-key", help="Serve a non-loopback --host to anyone, without a key.", rich_help_panel=SERVER, **FLAG)]
AllowOriginOpt = Annotated[Optional[List[str]], _opt(
    "--allow-origin", metavar="ORIGIN", help="Let web pages from ORIGIN (e.g. http://localhost:3000; * for any) "
    "call the server from a browser (CORS; repeatable).", rich_help_panel=SERVER, **UNSET)]
PromptCacheSizeOpt = Annotated[int, _opt(
    "--prompt-cache-size", metavar="N", min=0, max=1 << 16, help="Most prompt caches kept (0: none).",
    rich_help_panel=LIMITS)]
PromptCacheBytesOpt = Annotated[Optional[str], _opt(
    "--prompt-cache-bytes", callback=_size, metavar="SIZE", help="Most bytes they may hold (e.g. 4G; 0: none).",
    rich_help_panel=LIMITS, **_default("min(8G, RAM/8)"))]
PromptCacheDirOpt = Annotated[Optional[str], _opt(
    "--prompt-cache-dir", metavar="DIR", envvar="SPECDEC_PROMPT_CACHE_DIR", help="Where the prompt cache's disk "
    "tier keeps caches across runs and restarts (servers may share it).", rich_help_panel=LIMITS,
    **_default("$XDG_CACHE_HOME or ~/.cache, then specdec/prompt-cache"))]
PromptCacheDiskOpt = Annotated[Optional[float], _opt(
    "--prompt-cache-disk-gb", metavar="GB", min=0.0, max=float(MAX_DISK_GB), callback=_finite, envvar="SPECDEC_PROMPT_CACHE_DISK_GB",
    help="Most gigabytes the disk tier may hold (0: no disk tier).", rich_help_panel=LIMITS,
    **_default("min(20, a quarter of the free space)"))]
QueueOpt = Annotated[int, _opt(
    "--queue-size", metavar="N", min=1, max=1 << 16, help="Requests that may wait; more get 503.",
    rich_help_panel=LIMITS)]
DecodeConcurrencyOpt = Annotated[Optional[int], _opt(
    "--decode-concurrency", "--parallel", metavar="N", min=1, max=256, help="Requests decoded together (as "
    "mlx_lm.server's and llama-server's).", rich_help_panel=LIMITS,
    **_default(f"measured at start-up: the most rows, up to {AUTO_ROWS[-1]}, whose step's tokens/s gain "
               f"{KNEE_GAIN:.0%} a doubling"))]


LookupCorpusOpt = Annotated[int, _opt(
    "--lookup-corpus", metavar="N", min=0, max=1 << 20, help="Lookup also drafts from the server's "
    "recent answers, up to N tokens (0: off).", rich_help_panel=DRAFTING)]


class LogLevel(str, Enum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


@app.command(
    cls=_Command,
    epilog="Exit codes: 0 stopped (Ctrl-C, SIGTERM); 1 error; 2 bad option.\n\n"
    + REFERENCE.format(doc="docs/SERVER.md") + "\n\n"
    "Example: specdec serve --port 8080, then point any OpenAI client at http://127.0.0.1:8080/v1"
)
def serve(
    # Where it listens and who may use it first: what every start needs.
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8080,
    api_key: ApiKeyOpt = None,
    no_api_key: NoApiKeyOpt = False,
    allow_origin: AllowOriginOpt = None,
    model: ModelOpt = None,
    draft_model: DraftModelOpt = None,
    dtype: DTypeOpt = DType.auto,
    drafter: DrafterOpt = None,
    block_size: BlockSizeOpt = None,
    adaptive: AdaptiveOpt = True,
    max_tokens: Annotated[int, _opt(
        "--max-tokens", "-m", metavar="N", min=1, help="Most tokens per answer when a request does not say.",
        rich_help_panel=SAMPLING)] = 512,
    temp: Annotated[float, _opt("--temp", metavar="X", min=0.0, callback=_finite, help="Temperature when a "
                                "request does not say (0: greedy).", rich_help_panel=SAMPLING)] = 0.0,
    top_p: TopPOpt = 0.0,
    top_k: TopKOpt = 0,
    min_p: MinPOpt = 0.0,
    decode_concurrency: DecodeConcurrencyOpt = None,
    queue_size: QueueOpt = 16,
    prompt_cache_size: PromptCacheSizeOpt = 10,
    prompt_cache_bytes: PromptCacheBytesOpt = None,
    prompt_cache_dir: PromptCacheDirOpt = None,
    prompt_cache_disk_gb: PromptCacheDiskOpt = None,
    lookup_corpus: LookupCorpusOpt = 8192,
    log_level: Annotated[LogLevel, _opt(
        "--log-level", metavar="LEVEL", help=_choices(LogLevel) + "What the server logs on stderr.",
        rich_help_panel=OUTPUT)] = LogLevel.info,
    memory_check: MemoryCheckOpt = True,
    debug: DebugOpt = False,
    chat_template_config: TemplateConfigOpt = None,
    num_draft_tokens: NumDraftOpt = None,
    draft_p_min: DraftPMinOpt = None,
    ngram_max: NgramMaxOpt = None,
    ngram_min: NgramMinOpt = None,
    extra_eos_token: ExtraEosOpt = None,
    adapter_path: AdapterOpt = None,
    trust_remote_code: TrustOpt = False,
    force_download: ForceDownloadOpt = False,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupOpt = None,
    prefill_step_size: PrefillOpt = 2048,
    pipeline: PipelineOpt = False,
    rollback: RollbackOpt = Rollback.auto,
    rollback_memory_cap: RollbackCapOpt = None,
    shapes: ShapesOpt = Shapes.auto,
    exact: ExactOpt = False,
) -> None:
    """Serve the OpenAI API (chat and text completions) with exact speculative decoding."""
    params = dict(locals())
    from .serve_command import ServeOptions, serve_command

    _run(serve_command, ServeOptions, params)


@app.command(cls=_Command, epilog="Exit codes: 0 done; 1 error; 2 bad option.\n\n"
             + REFERENCE.format(doc="docs/SERVER.md") + "\n\n"
             "Example: specdec chat --system-prompt 'Answer briefly.'")
def chat(
    model: ModelOpt = None,
    draft_model: DraftModelOpt = None,
    dtype: DTypeOpt = DType.auto,
    system_prompt: SystemOpt = None,
    drafter: DrafterOpt = None,
    block_size: BlockSizeOpt = None,
    adaptive: AdaptiveOpt = True,
    max_tokens: Annotated[int, _opt("--max-tokens", "-m", metavar="N", min=1, help="Most tokens per answer.",
                                    rich_help_panel=SAMPLING)] = 512,
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 0.0,
    top_k: TopKOpt = 0,
    min_p: MinPOpt = 0.0,
    seed: SeedOpt = None,
    live: LiveOpt = True,
    memory_check: MemoryCheckOpt = True,
    debug: DebugOpt = False,
    prompt_cache_size: Annotated[int, _opt(
        "--prompt-cache-size", metavar="N", min=0, max=1 << 16, help="Most prompt caches kept (0: none).",
        rich_help_panel=ADVANCED)] = 10,
    prompt_cache_dir: PromptCacheDirOpt = None,
    prompt_cache_disk_gb: PromptCacheDiskOpt = None,
    chat_template_config: TemplateConfigOpt = None,
    num_draft_tokens: NumDraftOpt = None,
    draft_p_min: DraftPMinOpt = None,
    ngram_max: NgramMaxOpt = None,
    ngram_min: NgramMinOpt = None,
    repetition_penalty: RepetitionPenaltyOpt = None,
    repetition_context_size: RepetitionContextOpt = 20,
    extra_eos_token: ExtraEosOpt = None,
    adapter_path: AdapterOpt = None,
    trust_remote_code: TrustOpt = False,
    force_download: ForceDownloadOpt = False,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupOpt = None,
    prefill_step_size: PrefillOpt = 2048,
    rollback: RollbackOpt = Rollback.auto,
    rollback_memory_cap: RollbackCapOpt = None,
    shapes: ShapesOpt = Shapes.auto,
    exact: ExactOpt = False,
) -> None:
    """Chat in the terminal; each turn reuses the last one's caches."""
    params = dict(locals())
    from .chat import ChatOptions, chat_command

    _run(chat_command, ChatOptions, params)


TRAINING = "Training"


@app.command(
    cls=_Command,
    epilog="Exit codes: 0 done; 1 error; 2 bad option or input; 130 interrupted (the best head so far is "
    "written).\n\nExample: specdec distill --out my-head --steps 400, then specdec generate --draft-model my-head -p '...'"
)
def distill(
    out: Annotated[Optional[str], typer.Option(
        "--out", metavar="DIR", help="Folder for the head: new, empty, or an earlier head's (replaced).",
        rich_help_panel=MODEL, show_default=False)] = None,
    model: ModelOpt = None,
    dtype: DTypeOpt = DType.auto,
    data: Annotated[Optional[str], _opt(
        "--data", metavar="PATH", help="Training text: text files, a directory of them, or JSONL lines with "
        "\"prompt\" or \"messages\" (the model answers them) or \"text\".", rich_help_panel=TRAINING,
        **_default("the model's own answers to built-in seed prompts"))] = None,
    data_tokens: Annotated[int, typer.Option(
        "--data-tokens", metavar="N", min=256, max=10_000_000, help="Corpus size in tokens.",
        rich_help_panel=TRAINING)] = DISTILL["data_tokens"],
    steps: Annotated[int, typer.Option("--steps", metavar="N", min=1, max=1_000_000, help="Optimizer steps.",
                                       rich_help_panel=TRAINING)] = DISTILL["steps"],
    batch_size: Annotated[int, typer.Option("--batch-size", metavar="N", min=1, max=1024, help="Windows per step.",
                                            rich_help_panel=TRAINING)] = DISTILL["batch_size"],
    seq_len: Annotated[int, typer.Option("--seq-len", metavar="N", min=8, max=8192, help="Positions per window.",
                                         rich_help_panel=TRAINING)] = DISTILL["seq_len"],
    lr: Annotated[float, typer.Option("--lr", metavar="X", min=1e-7, max=1.0, callback=_finite,
                                      help="Peak learning rate (AdamW, warm-up then cosine decay).",
                                      rich_help_panel=TRAINING)] = DISTILL["lr"],
    seed: Annotated[int, typer.Option("--seed", metavar="N", min=0, help="Seed of the data, the initialisation "
                                      "and the window order.", rich_help_panel=TRAINING)] = DISTILL["seed"],
    depth: Annotated[int, typer.Option("--depth", metavar="N", min=1, max=8, help="Chained draft positions trained "
                                       "(drafting feeds the head its own outputs).",
                                       rich_help_panel=TRAINING)] = DISTILL["depth"],
    draft_vocab: Annotated[int, typer.Option(
        "--draft-vocab", metavar="N", min=0, max=1 << 22, help="Draft among the N most frequent tokens of the "
        "training text (the head's lm_head costs N/V as much); 0: the whole vocabulary.",
        rich_help_panel=TRAINING)] = DISTILL["draft_vocab"],
    time_limit: Annotated[Optional[float], typer.Option(
        "--time-limit", metavar="SECONDS", min=1.0, callback=_finite, help="Stop after about this many seconds once "
        "the model is loaded: answers are generated for at most half of them, training runs to the limit and the best "
        "head so far is written (the measurement after it is extra: --no-measure skips it).", rich_help_panel=TRAINING, show_default=False)] = None,
    measure: Annotated[bool, typer.Option(
        "--measure/--no-measure", metavar="", help="Measure the head's acceptance on held-out prompts after "
        "training.", rich_help_panel=DIAGNOSTICS)] = True,
    debug: DebugOpt = False,
    trust_remote_code: TrustOpt = False,
    force_download: ForceDownloadOpt = False,
) -> None:
    """Train a drafter head for a model by self-distillation (the model's own distributions are the labels)."""
    params = dict(locals())
    from .distill_command import DistillCommandOptions, distill_command

    _run(distill_command, DistillCommandOptions, params)


@app.command(cls=_Command)
def doctor(json_output: JsonOpt = False, debug: DebugOpt = False) -> None:
    """Show what a bug report needs: platform, MLX device, BLAS, versions, Hub, default model."""
    params = dict(locals())
    from .commands import DoctorOptions, doctor_command

    _run(doctor_command, DoctorOptions, params)


def main() -> None:
    """Console-script entry point."""
    from ..model.blas import maybe_reexec

    # Before mlx is imported: the dynamic loader reads LD_PRELOAD only at start-up.
    maybe_reexec()
    from ..model.backend import decode_attention_default

    decode_attention_default()
    try:
        app()
    except KeyboardInterrupt:  # a Ctrl-C after the command's own boundary (parsing, exiting)
        sys.exit(EXIT_INTERRUPTED)
    except SystemExit as e:
        # Under mlx.launch a rank that left its error to rank 0 must not exit first: the launcher
        # would end rank 0 before it says why.
        if "specdec_cli.model.distributed" in sys.modules:
            from ..model.distributed import outlast_rank_0

            outlast_rank_0(e.code if isinstance(e.code, int) else 1)
        raise
