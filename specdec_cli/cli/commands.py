"""What the commands do, apart from option parsing: validate, load, run, report.

Options are validated before any model is loaded, so a bad combination fails
in milliseconds with a message that names the fix. Loading and running belong
to the session layer (:mod:`specdec_cli.session`), which ``chat`` and
``serve`` share; this module only shapes what ``generate`` and ``sweep`` print.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import closing
from dataclasses import dataclass, replace
from typing import Optional

import mlx.core as mx

from . import doctor
from .batch_command import check_batch_options, generate_batch, parse_concurrency, sweep_concurrency
from ..loop.compare import DIVERGED, compare_with_plain, comparison_dict

# Block-size and n-gram limits live with the drafter kinds, in a module without heavy imports: the CLI
# declares its option ranges with them before MLX is loaded.
from ..drafters.kinds import (  # noqa: F401  (re-exported: the limits are commands' to check)
    DEFAULT_BLOCK_SIZE,
    DRAFTER_KINDS,
    MAX_ANY_BLOCK_SIZE,
    MAX_BLOCK_SIZE,
    MAX_NGRAM,
    NGRAM_MAX,
    NGRAM_MIN,
)
from .display import (
    NoText,
    comparison_lines,
    mute,
    policy_lines,
    print_loading,
    print_stderr,
    print_sweep,
    summary_lines,
    sweep_progress,
    text_view,
)
from ..model.distributed import peer_errors
from ..errors import EXIT_DIVERGED, EXIT_INTERRUPTED, OptionError
from ..cache.limits import gb
from ..session.fit import fit_request
from ..session.measure import SweepResult, sweep
from ..core.processors import ConstraintError, check_constraint, make_processors
from ..model.prompts import clean, encode_prompt, read_prompt
from ..loop.events import Step
from ..session import (
    PREFILL_CHUNK_S,
    ModelOptions,
    RunOptions,
    Session,
    Setup,
    check_block_size,
    check_distributed_options,
    check_model_options,
    join_ranks,
    load_setup,
    make_policy,
    parse_int_list,
    processor_fields,
    resolve_block_size,
    sampling_params,
)
from ..core.stats import Stats


@dataclass
class GenerateOptions(RunOptions):
    """Everything ``specdec generate`` was asked to do."""

    seed: Optional[int] = None
    compare_ar: bool = False
    json_output: bool = False
    live: bool = True
    verbose: bool = False
    prompts_file: Optional[str] = None  # several prompts, decoded as rows of one batch
    decode_concurrency: Optional[int] = None  # None: every prompt, up to DEFAULT_DECODE_CONCURRENCY


@dataclass
class SweepOptions(ModelOptions):
    """Everything ``specdec sweep`` was asked to do."""

    block_sizes: str = "2,3,4,6,8,12,16"
    max_tokens: int = 128
    repeats: int = 1
    warmup: int = 1
    json_output: bool = False
    concurrency: str = "1"  # rows decoded together, a table by concurrency unless just 1


def prompt_ids(setup: Setup, text: str) -> list[int]:
    """The command line's prompt through the chat template, with its system prompt and prefill."""
    opts = setup.options
    return encode_prompt(setup.tokenizer, text, clean(opts.system_prompt, "--system-prompt"),
                         opts.ignore_chat_template, setup.template_kwargs,
                         clean(opts.prefill_response, "--prefill-response"))


def generate_command(opts: GenerateOptions) -> int:
    """Run ``specdec generate``; returns the exit code (under ``mlx.launch``, on every rank)."""
    with peer_errors():
        return _generate(opts)


def join(opts: ModelOptions):
    """The ranks under ``mlx.launch`` (None alone); ranks other than 0 show nothing from here on but errors."""
    ranks = join_ranks(opts)
    if ranks is not None and not ranks.primary:
        mute()
    return ranks


def _disk_note(opts: GenerateOptions) -> None:
    """The prompt cache's disk options name a tier this run does not use: say so (never silently ignored)."""
    # Given on the command line: a value from the environment (set once for every run) is no request of this run's.
    given = [f for f, v, env in (("--prompt-cache-dir", opts.prompt_cache_dir, "SPECDEC_PROMPT_CACHE_DIR"),
                                 ("--prompt-cache-disk-gb", opts.prompt_cache_disk_gb, "SPECDEC_PROMPT_CACHE_DISK_GB"))
             if v is not None and env not in os.environ]
    off = opts.prompt_cache_disk_gb == 0
    why = "--prompts-file" if opts.prompts_file is not None else "--compare-ar" if opts.compare_ar else None
    if given and why and not off:
        print_stderr([f"note: {' and '.join(given)} {'does' if len(given) == 1 else 'do'} nothing with {why}: "
                      "its prompts are prefilled whole, with no prompt cache on disk"])


def _generate(opts: GenerateOptions) -> int:
    ranks = join(opts)
    _disk_note(opts)
    if opts.prompts_file is not None or opts.decode_concurrency is not None:
        check_batch_options(opts, ranks is not None)
        return generate_batch(opts)
    kind = check_model_options(opts)
    check_distributed_options(opts, kind, ranks is not None)
    block_size = resolve_block_size(opts.block_size, opts.num_draft_tokens, kind)
    sampling = sampling_params(opts.temp, opts.top_p, opts.top_k, opts.min_p, opts.compare_ar, opts.seed)
    controls = processor_fields(opts)
    text = read_prompt(opts.prompt_arg, opts.prompt)
    print_loading(opts.model, opts.draft_model)
    setup = load_setup(opts, kind, ranks)
    try:
        check_constraint(controls.get("constraint"), setup.tokenizer)
    except ConstraintError as e:
        raise OptionError(f"--json-schema {opts.json_schema}: {e}") from None
    ids = prompt_ids(setup, text)
    setup.check_ranks(ids)
    print_stderr(setup.start_lines())
    kind, block_size = setup.kind, setup.run_block_size(block_size)
    target, tokenizer = setup.target, setup.tokenizer
    drafter_name = setup.drafter_name
    fitted = fit_request(setup, ids, opts.max_tokens, sampling=sampling, seed=opts.seed, timed=opts.verbose,
                         **controls)
    request, context, estimate = fitted.request, fitted.context, fitted.estimate
    max_tokens = request.max_tokens
    kv = dict(kv_bits=opts.kv_bits, kv_group_size=opts.kv_group)
    session = Session(setup, block_size, adaptive=opts.adaptive)
    if not opts.compare_ar:  # the comparison prefills the whole prompt again, in the run's own chunks
        warning = session.use_disk(opts.prompt_cache_dir, opts.prompt_cache_disk_gb)
        if warning:
            print_stderr([f"warning: {warning}"])

    stats = Stats(prompt_tokens=len(ids))
    tokens: list[int] = []
    detok = tokenizer.detokenizer
    detok.reset()
    interrupted = False
    policy = make_policy(opts.adaptive, block_size, kind)
    view = NoText()
    try:
        if opts.verbose:
            print_stderr([f"Prefill: {len(ids)} prompt tokens, context {context or 'unknown'}; memory "
                          f"estimate {gb(estimate.total)} (weights {gb(estimate.weights)}, caches "
                          f"{gb(estimate.cache)}, prefill scratch {gb(estimate.scratch)})"])
        mx.reset_peak_memory()
        view = text_view(opts.live, drafter_name, opts.json_output)
        events = session.generate(request, policy=policy)
        # closing(): whatever stops the loop, the run's own cleanup happens now.
        with closing(events):
            for event in events:
                if not isinstance(event, Step):
                    stats.note(event)
                    continue
                # The commit point: whatever ends the run, `tokens` is what was generated.
                tokens += event.block.tokens
                stats.add(event.block, event.seconds)
                for tok in event.block.tokens:
                    detok.add_token(tok)
                view.write(detok.last_segment)
                view.update(stats)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        # A Ctrl-C between the lines above: show and count exactly the committed tokens.
        for tok in tokens[len(detok.tokens):]:
            detok.add_token(tok)
        stats.generated = len(tokens)
        detok.finalize()
        view.write(detok.last_segment)
        view.close()
        session.shutdown()  # the run's caches reach the disk before the process ends
    peak_gb = mx.get_peak_memory() / 1e9
    primary = ranks is None or ranks.primary
    if setup.history is not None and primary:
        setup.history.add(tokens)
        try:
            setup.history.save()
        except OSError as e:
            print_stderr([f"warning: could not save the lookup history {setup.history.path} ({e.strerror})"])
    finish = finish_reason(stats, interrupted, max_tokens < opts.max_tokens)
    if finish == "context":
        print_stderr([f"Stopped at the model's context: {context} tokens (prompt {len(ids)} + "
                      f"{stats.generated} generated; --max-tokens asked for {opts.max_tokens})"])

    comparison = None
    compare_interrupted = False
    if opts.compare_ar and not interrupted:
        try:
            comparison = compare_with_plain(
                target.model, ids, tokens, stats.trace, max_tokens=max_tokens, eos_ids=setup.eos_ids,
                prefill_step_size=opts.prefill_step_size, prefill_chunks=stats.prefill_chunks, sync=ranks,
                sampling=replace(sampling, seed=opts.seed),
                processors=(lambda: make_processors(request, tokenizer, ids)) if controls else None, **kv,
            )
        except KeyboardInterrupt:
            compare_interrupted = True

    if opts.json_output and primary:
        report = {
            "text": detok.text,
            "model": target.name,
            "model_path": str(target.path),
            "dtype": target.dtype,
            "draft_model": opts.draft_model,
            "drafter": setup.kind,
            "block_size": block_size,
            "rollback": stats.rollback_choice["strategy"] if stats.rollback_choice else None,
            "sampling": {"temp": sampling.temp, "top_p": sampling.top_p, "top_k": sampling.top_k,
                         "min_p": sampling.min_p, "seed": opts.seed},
            "processors": {"repetition_penalty": opts.repetition_penalty,
                           "repetition_context_size": opts.repetition_context_size, "json_schema": opts.json_schema},
            "adaptive": policy.summary(),
            "peak_memory_gb": peak_gb,
            "memory_estimate_gb": estimate.total / 1e9,
            "context_length": context,
            "kv_bits": opts.kv_bits,
            "distributed": _distributed(ranks),
            **stats.to_dict(),
            "finish_reason": finish,
            "interrupted": interrupted or compare_interrupted,
        }
        if comparison is not None:
            report["compare"] = comparison_dict(comparison, stats, tokenizer)
        elif compare_interrupted:
            report["compare"] = None
        sys.stdout.write(json.dumps(report) + "\n")
        sys.stdout.flush()
    else:
        lines = [setup.model_line] + summary_lines(stats, drafter=drafter_name, block_size=block_size,
                                                   peak_gb=peak_gb, verbose=opts.verbose)
        lines += policy_lines(policy.summary())
        if ranks is not None:
            lines.append(ranks.line + _overridden(ranks))
        lines.append(f"Finish reason: {finish}" + (" (Ctrl-C or SIGTERM)" if interrupted else ""))
        if comparison is not None:
            lines += comparison_lines(comparison, stats, lambda t: tokenizer.decode([t]))
        if compare_interrupted:
            lines.append("Compare: interrupted (Ctrl-C or SIGTERM) during the plain run")
        print_stderr(lines)

    if interrupted or compare_interrupted:
        return EXIT_INTERRUPTED
    if comparison is not None and not comparison.ok:
        return EXIT_DIVERGED
    return 0


def _distributed(ranks) -> Optional[dict]:
    return None if ranks is None else {**ranks.describe(), "overridden_decisions": ranks.overridden}


def _overridden(ranks) -> str:
    # A rank whose own pick differed from rank 0's (rounding on other hardware) followed rank 0.
    return f"; {ranks.overridden} blocks followed rank 0 against another rank's own pick" if ranks.overridden else ""


def finish_reason(stats: Stats, interrupted: bool, capped: bool) -> Optional[str]:
    """``eos``, ``length``, ``context`` (the model's context ended it) or ``interrupted``."""
    if interrupted:
        return "interrupted"
    if stats.finish_reason == "length" and capped:
        return "context"
    return stats.finish_reason


def parse_block_sizes(text: str) -> list[int]:
    """``"2,3,4"`` -> ``[2, 3, 4]``: distinct block sizes >= 1, in the order given (limits: check_block_size)."""
    return parse_int_list(text, "--block-sizes", "2,4,8", "block size", "size")


# A block drafts at most the room left less one (the token it commits after its drafts), so at 1 token no
# block can draft: every row would time plain steps and call it a speedup.
MIN_SWEEP_TOKENS = 2


def _sweep_room(what: str) -> str:
    return (f"{what} leaves no room for a draft (a block commits its drafts and one token more), so a sweep "
            "measures nothing")


def sweep_command(opts: SweepOptions) -> int:
    """Run ``specdec sweep``; returns the exit code (under ``mlx.launch``, on every rank)."""
    with peer_errors():
        return _sweep(opts)


def _sweep(opts: SweepOptions) -> int:
    ranks = join(opts)
    sizes = parse_block_sizes(opts.block_sizes)
    levels = parse_concurrency(opts.concurrency)
    if levels != [1] and ranks is not None:
        raise OptionError("--concurrency decodes rows together in one process; under mlx.launch drop it (or give 1)")
    if opts.repeats < 1 or opts.warmup < 0:
        raise OptionError("--repeats must be >= 1 and --warmup >= 0")
    if opts.max_tokens < MIN_SWEEP_TOKENS:
        raise OptionError(_sweep_room(f"--max-tokens {opts.max_tokens}") + f": give --max-tokens "
                          f"{MIN_SWEEP_TOKENS} or more; a few dozen measure something (the default is 128)")
    kind = check_model_options(opts)
    check_distributed_options(opts, kind, ranks is not None)
    for size in sizes:
        check_block_size(size, kind, "--block-sizes")
    text = read_prompt(opts.prompt_arg, opts.prompt)
    print_loading(opts.model, opts.draft_model)
    setup = load_setup(opts, kind, ranks)
    ids = prompt_ids(setup, text)
    setup.check_ranks(ids)
    print_stderr(setup.start_lines())
    if setup.history is not None and not setup.history.outputs():
        # A sweep never writes the file: a mistyped path measured the prompt alone without a word.
        print_stderr([f"note: --lookup-history {opts.lookup_history} holds no output of this model's tokenizer "
                      "(missing, empty or other models'): the sweep drafts from the prompt alone; generate "
                      "--lookup-history fills it"])
    for size in sizes:
        setup.block_size(size, size, "--block-sizes")
    max_tokens, context = setup.fit_context(len(ids), opts.max_tokens)
    if max_tokens < MIN_SWEEP_TOKENS:
        raise OptionError(_sweep_room(f"the prompt's {len(ids)} tokens in the model's context of {context} leave "
                                      f"room for {max_tokens}, which") + ": shorten the prompt")
    capped = [size for size in sizes if size > max_tokens]
    if capped:
        # A block drafts at most the room left less one: these rows would time the same blocks as a size of
        # max_tokens, under labels a user would then pass as --block-size.
        many = len(capped) > 1
        print_stderr([f"note: blocks of at most {max_tokens} tokens fit in the {max_tokens} to generate: block "
                      f"size{'s' if many else ''} {','.join(map(str, capped))} measure{'' if many else 's'} as "
                      f"{max_tokens}; raise --max-tokens to measure them"])
    if levels != [1]:
        return sweep_concurrency(opts, setup, ids, sizes, levels, max_tokens)
    setup.check_memory(len(ids) + max_tokens)
    # What generate runs with no --block-size and no --no-adaptive: measured too, as the row to
    # compare the fixed sizes with (a user runs it without knowing its speed otherwise).
    default_block = setup.block_size(None, resolve_block_size(None, None, kind))
    events = sweep(setup, ids, sizes, max_tokens=max_tokens, repeats=opts.repeats, warmup=opts.warmup,
                   default_block=default_block, prefill_seconds=PREFILL_CHUNK_S)
    result = None
    with sweep_progress() as advance, closing(events):
        for event in events:
            if isinstance(event, SweepResult):
                result = event
            else:
                advance(event)
    if opts.json_output and (ranks is None or ranks.primary):
        sys.stdout.write(json.dumps({"model": setup.target.name, "model_path": str(setup.target.path),
                                     "dtype": setup.target.dtype, "drafter": setup.drafter_name,
                                     "distributed": _distributed(ranks), **result.to_dict()}) + "\n")
    elif not opts.json_output:
        print_stderr([setup.model_line] + ([ranks.line + _overridden(ranks)] if ranks is not None else []))
        print_sweep(result, setup.drafter_name)
    if any(row.verdict == DIVERGED for row in [*result.rows, *([result.default] if result.default else [])]):
        print_stderr(["error: a speculative run diverged from plain decoding (see the 'same' column)"])
        return EXIT_DIVERGED
    return 0


@dataclass
class DoctorOptions:
    """What ``specdec doctor`` was asked to do."""

    json_output: bool = False


def doctor_command(opts: DoctorOptions) -> int:
    """Run ``specdec doctor``: the report on stdout; always exits 0."""
    report = doctor.collect()
    if opts.json_output:
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        sys.stdout.write("\n".join(doctor.lines(report)) + "\n")
    return 0
