"""The ``specdec`` command line: a thin Typer layer over the runner.

All expected failures pass through :func:`error_boundary`: one line on stderr,
a non-zero exit, no traceback (``--debug`` shows it).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from enum import Enum
from typing import Iterator, Optional

import typer
from typing_extensions import Annotated

from . import __version__
from .errors import SpecdecError

# Ctrl-C outside a run (while loading, say); commands define their own codes.
EXIT_INTERRUPTED = 130

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Lossless speculative decoding for MLX / mlx-lm, hybrid and sliding-window models included.",
)


class DrafterKind(str, Enum):
    model = "model"
    lookup = "lookup"
    ngram = "ngram"
    mtp = "mtp"


class Rollback(str, Enum):
    auto = "auto"
    reforward = "reforward"
    carry = "carry"
    capture = "capture"
    tape = "tape"


RollbackOpt = Annotated[
    Rollback,
    typer.Option("--rollback", help="Recurrent layers after a partial accept: keep the state of every verified "
                 "token (capture), replay the recurrence alone (tape), re-feed the accepted tokens at once "
                 "(reforward) or lead the next verify with them (carry); auto measures capture and tape at start."),
]
RollbackCapOpt = Annotated[
    Optional[float],
    typer.Option("--rollback-memory-cap", min=0.0, help="Most MiB of extra state capture may hold per verify; "
                 "over it, tape is used instead."),
]


class DType(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


def _err(line: str) -> None:
    # One line, whatever the exception's message holds.
    sys.stderr.write(" ".join(line.split()) + "\n")
    sys.stderr.flush()


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
        _err(f"error: {e}")
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        _err("interrupted")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Exception as e:  # the boundary: anything unexpected, still one line
        if debug:
            raise
        _err(f"error: {type(e).__name__}: {e} (run again with --debug for the traceback)")
        raise typer.Exit(1) from None


def _run(command, options_type, params: dict) -> None:
    """Run a command inside the error boundary; its parameters become its options."""
    debug = params.pop("debug")
    with error_boundary(debug):
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
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")
    ] = False,
) -> None:
    """Lossless speculative decoding for MLX / mlx-lm."""


ModelOpt = Annotated[
    Optional[str],
    typer.Option("--model", help="Target model: Hub repo id or local directory. "
                 "[default: the bundled SmolLM2-135M-Instruct, no network needed]", show_default=False),
]
DraftModelOpt = Annotated[
    Optional[str],
    typer.Option("--draft-model", help="Draft model (same tokenizer), an MTP head sidecar, or a DFlash block drafter for the target: Hub repo id or local directory."),
]
PromptArg = Annotated[
    Optional[str], typer.Argument(metavar="PROMPT", help="The prompt; '-' reads stdin.", show_default=False)
]
PromptOpt = Annotated[Optional[str], typer.Option("--prompt", "-p", help="The prompt; '-' reads stdin.")]
SystemOpt = Annotated[Optional[str], typer.Option("--system-prompt", help="System message for the chat template.")]
NoTemplateOpt = Annotated[
    bool, typer.Option("--ignore-chat-template", help="Use the prompt as is, without the chat template.")
]
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", "-m", min=1, help="Most tokens to generate.")]
TempOpt = Annotated[float, typer.Option("--temp", help="Sampling temperature (0 = greedy); > 0 samples losslessly.")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Random seed.")]
DTypeOpt = Annotated[
    DType,
    typer.Option("--dtype", help="Cast both models (dequantizing if needed). auto: float32 on MLX's CPU "
                 "backend, the checkpoint's own dtype (quantized stays quantized) on a GPU."),
]
PrefillOpt = Annotated[int, typer.Option("--prefill-step-size", min=1, help="Prompt tokens per prefill chunk.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks.")]
DrafterOpt = Annotated[
    Optional[DrafterKind],
    typer.Option("--drafter", help="Who drafts: 'model' (implied by --draft-model), prompt 'lookup' (longest match; "
                 "the default without one) 'ngram' (the simple n-gram lookup), or the target's own 'mtp' head (or the sidecar --draft-model names)."),
]
DraftPMinOpt = Annotated[
    Optional[float],
    typer.Option("--draft-p-min", help="Stop drafting when the draft model's (MTP head's, DFlash slot's) top-1 probability is below this."),
]
NgramMaxOpt = Annotated[Optional[int], typer.Option("--ngram-max", help="--drafter ngram: longest suffix matched. [default: 4]")]
NgramMinOpt = Annotated[Optional[int], typer.Option("--ngram-min", help="--drafter ngram: shortest suffix matched. [default: 2]")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout, nothing else.")]


@app.command(
    epilog="Exit codes: 0 done; 1 error; 2 bad option; 3 --compare-ar found a divergence; "
    "130 interrupted (Ctrl-C)."
)
def generate(
    prompt_arg: PromptArg = None,
    model: ModelOpt = None,
    draft_model: DraftModelOpt = None,
    drafter: DrafterOpt = None,
    block_size: Annotated[
        Optional[int],
        typer.Option("--block-size", min=1, help="Most tokens verified per target forward (drafts + 1). "
                     "Default: 64 for lookup (each draft sized by its match), a DFlash drafter's own block size, 4 otherwise."),
    ] = None,
    num_draft_tokens: Annotated[
        Optional[int], typer.Option("--num-draft-tokens", min=0, help="mlx-lm's spelling of block size - 1.")
    ] = None,
    prompt: PromptOpt = None,
    system_prompt: SystemOpt = None,
    ignore_chat_template: NoTemplateOpt = False,
    max_tokens: MaxTokensOpt = 256,
    temp: TempOpt = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass (0 = off).")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample among the k most likely tokens (0 = off).")] = 0,
    min_p: Annotated[float, typer.Option("--min-p", help="Drop tokens below min-p x the top probability (0 = off).")] = 0.0,
    seed: SeedOpt = None,
    draft_p_min: DraftPMinOpt = None,
    ngram_max: NgramMaxOpt = None,
    ngram_min: NgramMinOpt = None,
    lookup_history: Annotated[
        Optional[str],
        typer.Option("--lookup-history", metavar="FILE", help="Lookup: also draft from earlier runs' outputs kept in "
                     "FILE, and add this one (bounded; safe to delete; never changes the output)."),
    ] = None,
    adaptive: Annotated[
        bool,
        typer.Option("--adaptive/--no-adaptive", help="Adapt the draft length to acceptance, and stop speculating while it is slower than plain decoding."),
    ] = True,
    dtype: DTypeOpt = DType.auto,
    prefill_step_size: PrefillOpt = 2048,
    rollback: RollbackOpt = Rollback.auto,
    rollback_memory_cap: RollbackCapOpt = None,
    compare_ar: Annotated[
        bool,
        typer.Option("--compare-ar", help="Also run plain greedy decoding and prove the output identical (exit 3 if not)."),
    ] = False,
    json_output: JsonOpt = False,
    no_live: Annotated[bool, typer.Option("--no-live", help="Plain streamed text, no live panel.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", help="Time each phase (adds two host syncs per block).")] = False,
    debug: DebugOpt = False,
) -> None:
    """Generate text with speculative decoding."""
    params = dict(locals())
    from .commands import GenerateOptions, generate_command

    _run(generate_command, GenerateOptions, params)


@app.command(
    epilog="Exit codes: 0 done; 1 error; 2 bad option; 3 a speculative run was not identical to plain decoding."
)
def sweep(
    prompt_arg: PromptArg = None,
    model: ModelOpt = None,
    draft_model: DraftModelOpt = None,
    drafter: DrafterOpt = None,
    block_sizes: Annotated[
        str, typer.Option("--block-sizes", help="Comma-separated block sizes (tokens verified per forward).")
    ] = "2,3,4,6,8,12,16",
    prompt: PromptOpt = None,
    system_prompt: SystemOpt = None,
    ignore_chat_template: NoTemplateOpt = False,
    max_tokens: MaxTokensOpt = 128,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Speed runs per configuration (median).")] = 1,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Untimed warm-up runs first.")] = 1,
    draft_p_min: DraftPMinOpt = None,
    ngram_max: NgramMaxOpt = None,
    ngram_min: NgramMinOpt = None,
    dtype: DTypeOpt = DType.auto,
    prefill_step_size: PrefillOpt = 2048,
    rollback: RollbackOpt = Rollback.auto,
    rollback_memory_cap: RollbackCapOpt = None,
    json_output: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Measure speed and acceptance over several block sizes, against plain decoding."""
    params = dict(locals())
    from .commands import SweepOptions, sweep_command

    _run(sweep_command, SweepOptions, params)


@app.command()
def doctor(json_output: JsonOpt = False, debug: DebugOpt = False) -> None:
    """Show what a bug report needs: platform, MLX device, BLAS, versions, Hub, default model."""
    params = dict(locals())
    from .commands import DoctorOptions, doctor_command

    _run(doctor_command, DoctorOptions, params)


def main() -> None:
    """Console-script entry point."""
    from .blas import maybe_reexec

    # Before mlx is imported: the dynamic loader reads LD_PRELOAD only at start-up.
    maybe_reexec()
    app()

