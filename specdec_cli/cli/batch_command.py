"""``specdec generate --prompts-file`` and ``specdec sweep --concurrency``: validate, run the batch, report.

The batch itself runs in the session layer (:mod:`specdec_cli.session.batch`),
which yields typed events; this module checks the options, turns each line of
the file into a :class:`~specdec_cli.session.Request`, and shapes what the
terminal and ``--json`` show.
"""

from __future__ import annotations

import json
import sys
from contextlib import closing
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx

from ..loop.compare import Comparison, comparison_dict
from ..defaults import DEFAULT_DECODE_CONCURRENCY
from .display import (
    batch_lines,
    batch_view,
    comparison_lines,
    drafter_line,
    print_concurrency,
    print_loading,
    print_stderr,
    row_lines,
    sweep_progress,
)
from ..errors import EXIT_DIVERGED, EXIT_INTERRUPTED, OptionError, SpecdecError
from ..core.processors import ConstraintError, check_constraint
from ..model.prompts import FilePrompt, clean, encode_messages, encode_prompt, read_prompts_file
from ..loop.events import Finished, Prefilled, Step
from ..session import (
    Request,
    Session,
    Setup,
    check_model_options,
    load_setup,
    parse_int_list,
    processor_fields,
    resolve_block_size,
    sampling_params,
)
from ..session.alone import compare_alone
from ..session.fit import fit_request
from ..session.batch import BatchEnd, ConcurrencyResult, batch_refusal, concurrency_sweep, run_batch
from ..core.stats import BatchStats, Stats


@dataclass
class _Row:
    """One prompt of the file on its way through the batch."""

    prompt: FilePrompt
    ids: list[int]
    request: Request
    capped: bool  # the model's context cut --max-tokens
    stats: Stats = field(default_factory=Stats)
    tokens: list[int] = field(default_factory=list)
    latency: Optional[float] = None
    ended: bool = False
    comparison: Optional[Comparison] = None


def check_batch_options(opts, sharded: bool) -> None:
    """What ``--prompts-file`` and ``--decode-concurrency`` need, checked before anything is read or loaded."""
    if opts.prompts_file is None:
        raise OptionError("--decode-concurrency sets how many of --prompts-file's prompts decode together: add "
                          "--prompts-file FILE, or drop it")
    if opts.prompt_arg is not None or opts.prompt is not None:
        raise OptionError("give the prompts in --prompts-file or one prompt as PROMPT / --prompt, not both")
    if sharded:
        raise OptionError("--prompts-file decodes its prompts as rows of one batch in one process; under mlx.launch "
                          "give one prompt (PROMPT or --prompt)")
    if opts.decode_concurrency is not None and opts.decode_concurrency < 1:
        raise OptionError("--decode-concurrency must be >= 1")


def _encode(setup: Setup, prompt: FilePrompt, name: str, system: Optional[str], prefill: Optional[str]) -> list[int]:
    """A line's prompt as token ids, as ``generate`` encodes ``-p`` (a ``messages`` line through the template)."""
    opts = setup.options
    try:
        if prompt.messages is not None:
            return encode_messages(setup.tokenizer, prompt.messages, system, opts.ignore_chat_template,
                                   setup.template_kwargs, prefill)
        return encode_prompt(setup.tokenizer, prompt.text, system, opts.ignore_chat_template, setup.template_kwargs,
                             prefill)
    except OptionError as e:
        raise OptionError(f"--prompts-file {name} line {prompt.line}: {e}") from None


def generate_batch(opts) -> int:
    """Run ``specdec generate --prompts-file``; returns the exit code."""
    kind = check_model_options(opts)
    block_size = resolve_block_size(opts.block_size, opts.num_draft_tokens, kind)
    sampling = sampling_params(opts.temp, opts.top_p, opts.top_k, opts.min_p)
    controls = processor_fields(opts)
    name = "stdin" if opts.prompts_file == "-" else opts.prompts_file
    prompts = read_prompts_file(opts.prompts_file)
    if opts.compare_ar and not sampling.greedy and opts.seed is None:
        unseeded = next((p for p in prompts if p.seed is None), None)
        if unseeded is not None:
            raise OptionError(f"--compare-ar at --temp > 0 needs a seed for every prompt (--prompts-file {name} line "
                              f"{unseeded.line} has none): add --seed, or \"seed\" to each JSONL line, or use --temp 0")
    max_rows = min(opts.decode_concurrency or DEFAULT_DECODE_CONCURRENCY, len(prompts))
    print_loading(opts.model, opts.draft_model)
    setup = load_setup(opts, kind, None)
    try:
        check_constraint(controls.get("constraint"), setup.tokenizer)
    except ConstraintError as e:
        raise OptionError(f"--json-schema {opts.json_schema}: {e}") from None
    rows = []
    system = clean(opts.system_prompt, "--system-prompt")
    prefill = clean(opts.prefill_response, "--prefill-response")
    for prompt in prompts:
        ids = _encode(setup, prompt, name, system, prefill)
        seed = prompt.seed if prompt.seed is not None else opts.seed
        try:
            # The batch's memory is checked below, for its rows together.
            fitted = fit_request(setup, ids, prompt.max_tokens or opts.max_tokens, memory=False, sampling=sampling,
                                 seed=seed, **controls)
        except SpecdecError as e:
            raise type(e)(f"--prompts-file {name} line {prompt.line}: {e}") from None
        rows.append(_Row(prompt, ids, fitted.request, fitted.capped, Stats(prompt_tokens=len(ids))))
    print_stderr(setup.start_lines())
    block_size = setup.run_block_size(block_size)
    # A batch's caches are as long as its longest row, for every row decoding together.
    setup.check_memory(max_rows * max(len(r.ids) + r.request.max_tokens for r in rows))
    session = Session(setup, block_size, adaptive=opts.adaptive)
    if max_rows > 1:
        problem = batch_refusal(session)
        if problem is not None:
            raise OptionError(f"this model cannot decode several prompts together ({problem}): add "
                              "--decode-concurrency 1 to run them one after another")

    batch = BatchStats(rows=len(rows), concurrency=max_rows)
    total = len(rows)
    headings = [f"[{i + 1}/{total}] {r.prompt.label}" for i, r in enumerate(rows)]
    interrupted = False
    totals = BatchEnd()  # the batch's numbers, so far if Ctrl-C stops it
    mx.reset_peak_memory()
    view = batch_view(headings, opts.live, setup.drafter_name, opts.json_output)
    try:
        events = run_batch(session, [r.request for r in rows], max_rows=max_rows, timed=opts.verbose, totals=totals)
        with closing(events):
            for ev in events:
                if isinstance(ev, BatchEnd):
                    continue
                row = rows[ev.index]
                event = ev.event
                if isinstance(event, Step):
                    row.tokens += event.block.tokens
                    row.stats.add(event.block, event.seconds)
                    view.update(ev.index, row.stats)
                    continue
                row.stats.note(event)
                if isinstance(event, Prefilled):
                    view.joined(ev.index)
                elif isinstance(event, Finished):
                    row.ended, row.latency = True, ev.at
                    batch.latencies.append(ev.at)
                    view.finished(ev.index, _text(setup, row.tokens))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        batch.decode_s, batch.prefill_s, batch.wall_s = totals.decode_s, totals.prefill_s, totals.wall_s
        batch.blocks, batch.most_rows, batch.planner_s = totals.blocks, totals.most_rows, totals.planner_s
        for row in rows:
            row.stats.generated = len(row.tokens)
        view.close({i: _text(setup, r.tokens) for i, r in enumerate(rows) if r.tokens or r.ended})
    peak_gb = mx.get_peak_memory() / 1e9
    batch.generated = sum(len(r.tokens) for r in rows)
    if setup.history is not None:
        for row in rows:
            setup.history.add(row.tokens)
        try:
            setup.history.save()
        except OSError as e:
            print_stderr([f"warning: could not save the lookup history {setup.history.path} ({e.strerror})"])

    compare_interrupted = False
    plain_batch: Optional[tuple[int, float]] = None
    if opts.compare_ar and not interrupted:
        try:
            for row in rows:
                row.comparison = _compare(session, row, max_rows > 1)
                batch.verdicts[row.comparison.verdict] += 1
                batch.plain_generated += row.comparison.plain.generated
                batch.plain_decode_s += row.comparison.plain.decode_s
            plain_batch = _plain_batch(setup, rows, max_rows)
        except KeyboardInterrupt:
            compare_interrupted = True
    plain_batch_tps = plain_batch[0] / plain_batch[1] if plain_batch and plain_batch[1] > 0 else None

    def finish(row: _Row) -> Optional[str]:
        if not row.ended:
            return "interrupted"  # (a row that never started too: every row says how it ended)
        return "context" if row.stats.finish_reason == "length" and row.capped else row.stats.finish_reason

    tokenizer = setup.tokenizer
    if opts.json_output:

        report = {
            "model": setup.target.name,
            "model_path": str(setup.target.path),
            "dtype": setup.target.dtype,
            "draft_model": opts.draft_model,
            "drafter": setup.kind,
            "block_size": block_size,
            "sampling": {"temp": sampling.temp, "top_p": sampling.top_p, "top_k": sampling.top_k,
                         "min_p": sampling.min_p, "seed": opts.seed},
            "rows": [],
            "summary": {**batch.to_dict(), "peak_memory_gb": peak_gb},
            "interrupted": interrupted or compare_interrupted,
        }
        compare = report["summary"]["compare"]
        if compare is not None:
            # Beside the comparison with each prompt alone, the like-for-like one: the same batch, plain.
            compare.update(batched_ar_generated_tokens=plain_batch[0] if plain_batch else None,
                           batched_ar_decode_s=plain_batch[1] if plain_batch else None,
                           batched_ar_aggregate_tps=plain_batch_tps,
                           batched_speedup=_ratio(batch.aggregate_tps if batch.generated else 0.0, plain_batch_tps))
        for i, row in enumerate(rows):
            entry = {"index": i, "line": row.prompt.line, "prompt": row.prompt.text,
                     "text": _text(setup, row.tokens), "seed": row.request.seed, **row.stats.to_dict(),
                     "finish_reason": finish(row), "latency_s": row.latency}
            if row.comparison is not None:
                entry["compare"] = comparison_dict(row.comparison, row.stats, tokenizer)
            elif opts.compare_ar:
                entry["compare"] = None
            report["rows"].append(entry)
        sys.stdout.write(json.dumps(report) + "\n")
        sys.stdout.flush()
    else:
        lines = [setup.model_line, drafter_line(setup.drafter_name, block_size)]
        for i, row in enumerate(rows):
            heading = f"[{i + 1}/{total}] line {row.prompt.line}: {row.prompt.label}"
            lines += row_lines(heading, row.stats, latency=row.latency, finish=finish(row), verbose=opts.verbose)
            if row.comparison is not None:
                lines += ["  " + line for line in comparison_lines(row.comparison, row.stats,
                                                                    lambda t: tokenizer.decode([t]))]
        speedups = [_ratio(r.stats.decode_tps if r.stats.generated else 0.0,
                           r.comparison.plain.decode_tps if r.comparison.plain.generated else 0.0)
                    for r in rows if r.comparison is not None]
        lines += batch_lines(batch, peak_gb=peak_gb, plain_batch_tps=plain_batch_tps,
                             row_speedups=[x for x in speedups if x is not None])
        if interrupted:
            lines.append("Interrupted (Ctrl-C or SIGTERM): rows that had not finished show what they had")
        if compare_interrupted:
            lines.append("Compare: interrupted (Ctrl-C or SIGTERM) during the plain runs")
        print_stderr(lines)

    if interrupted or compare_interrupted:
        return EXIT_INTERRUPTED
    if any(r.comparison is not None and not r.comparison.ok for r in rows):
        return EXIT_DIVERGED
    return 0


def _text(setup: Setup, tokens: list[int]) -> str:
    """A row's text as ``generate`` prints one prompt's (the streaming detokenizer, finalized)."""
    detok = setup.tokenizer.detokenizer
    for tok in tokens:
        detok.add_token(tok)
    detok.finalize()
    return detok.text


def _ratio(tps: float, plain_tps: Optional[float]) -> Optional[float]:
    """A speedup, or None where either side has nothing to measure (no tokens, no time)."""
    return tps / plain_tps if tps > 0 and plain_tps else None


def _plain_batch(setup: Setup, rows: list[_Row], max_rows: int) -> tuple[int, float]:
    """Plain decoding of the same prompts, batched as the speculative run was: tokens and decode seconds.

    What a user weighs speculation against: this batch without it. A row's own speedup
    (against its prompt alone) counts batching's cost in, the aggregate over one prompt
    after another batching's gain.
    """
    session = Session(setup, 1, adaptive=False, plain=True)
    tokens, decode_s = 0, 0.0
    events = run_batch(session, [r.request for r in rows], max_rows=max_rows, planner=False)
    with closing(events):
        for ev in events:
            if isinstance(ev, BatchEnd):
                decode_s = ev.decode_s
            elif isinstance(ev.event, Step):
                tokens += len(ev.event.block.tokens)
    return tokens, decode_s


def _compare(session: Session, row: _Row, batched: bool) -> Comparison:
    """Plain decoding of the row's prompt alone, and the verdict on the row's tokens (``batched``: the row
    shared its forwards with others)."""
    return compare_alone(session, row.request, row.tokens, row.stats, batched=batched)


# -- specdec sweep --concurrency ---------------------------------------------------------------------


def parse_concurrency(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``: distinct concurrencies >= 1, in the order given."""
    levels = parse_int_list(text, "--concurrency", "1,2,4,8", "level", "level")
    if max(levels) > 256:
        raise OptionError(f"--concurrency is at most 256 rows (got {max(levels)})")
    return levels


def sweep_concurrency(opts, setup: Setup, ids: list[int], sizes: list[int], levels: list[int],
                      max_tokens: int) -> int:
    """The ``sweep --concurrency`` run and report, once the sweep's options are checked and the models loaded."""
    rounding = None
    if max(levels) > 1:
        checked = Session(setup, max(sizes), adaptive=False)
        problem = batch_refusal(checked)
        rounding = checked.rounding
        if problem is not None:
            raise OptionError(f"this model cannot decode several rows together ({problem}): --concurrency 1 only")
    setup.check_memory(max(levels) * (len(ids) + max_tokens))
    events = concurrency_sweep(setup, ids, sizes, levels, max_tokens=max_tokens, repeats=opts.repeats,
                               warmup=opts.warmup, rounding=rounding)
    result: Optional[ConcurrencyResult] = None
    with sweep_progress() as advance, closing(events):
        for event in events:
            if isinstance(event, ConcurrencyResult):
                result = event
            else:
                advance(event)
    if opts.json_output:
        sys.stdout.write(json.dumps({"model": setup.target.name, "model_path": str(setup.target.path),
                                     "dtype": setup.target.dtype, "drafter": setup.drafter_name,
                                     "max_tokens": max_tokens, **result.to_dict()}) + "\n")
    else:
        print_stderr([setup.model_line])
        print_concurrency(result, setup.drafter_name)
    if any(c.verdict == "diverged" for c in result.cells):
        print_stderr(["error: a row diverged from plain decoding of its prompt alone (see the 'same' column)"])
        return EXIT_DIVERGED
    return 0
