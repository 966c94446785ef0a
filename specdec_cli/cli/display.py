"""Showing a generation: streamed text, a live stats panel, the summary.

Text goes to stdout; everything else to stderr. Under Rich ``Live`` raw
partial tokens must never be written straight to stdout (Live would turn each
flush into its own line), so the live view prints completed lines above the
panel and keeps only the line in progress inside it.
"""

from __future__ import annotations

import errno
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence, TextIO

from rich.console import Console as RichConsole, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ..loop.compare import Comparison
from ..session.measure import Progress, SweepResult, default_label
from ..core.stats import BatchStats, Stats

if TYPE_CHECKING:
    from ..session.batch import ConcurrencyResult

# Set on ranks other than 0 under mlx.launch: rank 0 alone shows the run.
_MUTED = False


def mute() -> None:
    """From now on, show nothing: no text, no panel, no summary, no progress (errors still go to stderr)."""
    global _MUTED
    _MUTED = True


class Console(RichConsole):
    """Rich's console, except that a reader gone away raises BrokenPipeError.

    Rich's own answer is ``SystemExit(1)``, which would skip the CLI's
    boundary, where a closed pipe ends quietly with exit 141.
    """

    def on_broken_pipe(self) -> None:
        self.quiet = True  # drop what Rich still holds
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")


def _stats_cells(stats: Stats) -> tuple[str, ...]:
    # Nothing drafted yet (or at all): "-", as in the summary.
    acceptance, per_block = stats.shown_acceptance, stats.shown_accepted_per_block
    return (
        f"[bold]{stats.decode_tps:7.1f}[/] tok/s",
        f"acceptance [bold]{'     -' if acceptance is None else f'{100 * acceptance:5.1f}%'}[/]",
        f"accepted/block [bold]{'   -' if per_block is None else f'{per_block:4.2f}'}[/]",
        f"tokens [bold]{stats.generated}[/]",
    )


def stats_panel(stats: Stats, drafter: str, width: Optional[int] = None) -> Panel:
    """The live panel: decode speed, acceptance, tokens so far."""
    grid = Table.grid(padding=(0, 2))
    grid.add_row(*_stats_cells(stats))
    return Panel(grid, title=f"specdec · {drafter}", title_align="left", border_style="dim", width=width)


def take_lines(buffer: str, width: int) -> tuple[list[str], str]:
    """Split off completed lines (and over-long ones, at a space if possible).

    What is left is the line in progress, shorter than ``width``, so the live
    region never grows taller than the screen.
    """
    done = []
    while "\n" in buffer or len(buffer) > width:
        cut = buffer.find("\n")
        if cut == -1 or cut > width:
            cut = buffer.rfind(" ", 0, width)
            cut = width if cut <= 0 else cut
            done.append(buffer[:cut])
            buffer = buffer[cut:].lstrip(" ")
        else:
            done.append(buffer[:cut])
            buffer = buffer[cut + 1 :]
    return done, buffer


class PlainText:
    """Streams text to a file as it comes (pipes, ``--no-live``)."""

    def __init__(self, out: TextIO):
        self.out = out
        self.wrote = False

    def write(self, text: str) -> None:
        if text:
            self.wrote = True  # first: a Ctrl-C during the write still gets the closing newline
            self.out.write(text)
            self.out.flush()

    def update(self, stats: Stats) -> None:
        pass

    def close(self) -> None:
        if self.wrote:
            self.out.write("\n")
            self.out.flush()


class LiveText:
    """A terminal view: text streams line by line above a live stats panel.

    The panel is transient, so once generation ends stdout holds only text.
    """

    def __init__(self, console: Console, drafter: str):
        self.console = console
        self.drafter = drafter
        self.line = ""
        self.stats = Stats()
        self.live = Live(self._render(), console=console, transient=True, auto_refresh=False)
        self.live.start()

    def _render(self) -> Group:
        # Narrower than the terminal: a panel that fills the last column leaves
        # the cursor pending a wrap, so the "^C" the terminal echoes on Ctrl-C
        # moves it down a line and the transient erase misses the text line,
        # which close() then prints a second time.
        width = max(20, self.console.width - 4)
        return Group(Text(self.line), stats_panel(self.stats, self.drafter, width))

    def write(self, text: str) -> None:
        done, self.line = take_lines(self.line + text, max(self.console.width, 20))
        for line in done:
            self.live.console.print(Text(line), soft_wrap=True)
        self.live.update(self._render(), refresh=True)

    def update(self, stats: Stats) -> None:
        self.stats = stats
        self.live.update(self._render(), refresh=True)

    def close(self) -> None:
        self.live.stop()
        self.console.print(Text(self.line), soft_wrap=True)


class NoText:
    """``--json``: nothing is streamed."""

    def write(self, text: str) -> None:
        pass

    def update(self, stats: Stats) -> None:
        pass

    def close(self) -> None:
        pass


def text_view(live: bool, drafter: str, json_output: bool):
    """Pick the view: Live on a terminal, plain text otherwise, none for JSON (or when muted)."""
    if json_output or _MUTED:
        return NoText()
    if live and sys.stdout.isatty():
        return LiveText(Console(file=sys.stdout), drafter)
    return PlainText(sys.stdout)


class _RowTexts:
    """Rows' texts on stdout in prompt order, each under its heading, as soon as every earlier row's is out."""

    def __init__(self, headings: list[str]):
        self.headings = headings
        self.texts: dict[int, str] = {}
        self.next = 0

    def _print(self, heading: str, text: str) -> None:
        raise NotImplementedError

    def finished(self, index: int, text: str) -> None:
        """Row ``index`` ended with ``text``."""
        self.texts[index] = text
        while self.next in self.texts:
            self._print(self.headings[self.next], self.texts.pop(self.next))
            self.next += 1

    def flush(self, texts: dict[int, str]) -> None:
        """The batch ended (or was stopped): every row still unprinted that has ``texts``, in order."""
        for index in range(self.next, len(self.headings)):
            text = self.texts.get(index, texts.get(index))
            if text is not None:
                self._print(self.headings[index], text)
        self.next = len(self.headings)


class PlainBatch(_RowTexts):
    """``--prompts-file`` on a pipe (or ``--no-live``): each row's text under its heading, in order."""

    def __init__(self, headings: list[str], out: TextIO):
        super().__init__(headings)
        self.out = out
        self.wrote = False

    def _print(self, heading: str, text: str) -> None:
        self.out.write(("\n" if self.wrote else "") + f"{heading}\n{text}\n")
        self.out.flush()
        self.wrote = True

    def joined(self, index: int) -> None:
        pass

    def update(self, index: int, stats: Stats) -> None:
        pass

    def close(self, texts: dict[int, str]) -> None:
        self.flush(texts)


class LiveBatch(_RowTexts):
    """``--prompts-file`` on a terminal: texts in prompt order above a live panel of the rows decoding.

    The panel has one line per row in flight (the single-prompt panel's
    figures) and is transient: once the batch ends stdout holds only text.
    """

    def __init__(self, headings: list[str], console: Console, drafter: str):
        super().__init__(headings)
        self.console = console
        self.drafter = drafter
        self.stats: dict[int, Stats] = {}
        self.ended = 0
        self.wrote = False
        self.live = Live(self._render(), console=console, transient=True, auto_refresh=False)
        self.live.start()

    def _render(self) -> Panel:
        grid = Table.grid(padding=(0, 2))
        for index, stats in sorted(self.stats.items()):
            grid.add_row(Text(f"[{index + 1}/{len(self.headings)}]"), *_stats_cells(stats))
        waiting = len(self.headings) - self.ended - len(self.stats)
        title = f"specdec · {self.drafter} · {self.ended} done, {len(self.stats)} decoding, {waiting} waiting"
        # Narrower than the terminal, as LiveText's panel (a Ctrl-C echo must not wrap the last column).
        return Panel(grid, title=title, title_align="left", border_style="dim", width=max(20, self.console.width - 4))

    def _print(self, heading: str, text: str) -> None:
        if self.wrote:
            self.live.console.print()
        self.live.console.print(Text(heading, style="bold"), soft_wrap=True)
        self.live.console.print(Text(text), soft_wrap=True)
        self.wrote = True

    def joined(self, index: int) -> None:
        self.stats[index] = Stats()
        self.live.update(self._render(), refresh=True)

    def update(self, index: int, stats: Stats) -> None:
        self.stats[index] = stats
        self.live.update(self._render(), refresh=True)

    def finished(self, index: int, text: str) -> None:
        self.stats.pop(index, None)
        self.ended += 1
        super().finished(index, text)
        self.live.update(self._render(), refresh=True)

    def close(self, texts: dict[int, str]) -> None:
        self.live.stop()
        self.stats.clear()
        self.flush(texts)


class NoBatchText:
    """``--json``: nothing is shown while the batch runs."""

    def joined(self, index: int) -> None:
        pass

    def update(self, index: int, stats: Stats) -> None:
        pass

    def finished(self, index: int, text: str) -> None:
        pass

    def close(self, texts: dict[int, str]) -> None:
        pass


def batch_view(headings: list[str], live: bool, drafter: str, json_output: bool):
    """Pick the batch's view: a live panel on a terminal, texts in order otherwise, nothing for JSON."""
    if json_output or _MUTED:
        return NoBatchText()
    if live and sys.stdout.isatty():
        return LiveBatch(headings, Console(file=sys.stdout), drafter)
    return PlainBatch(headings, sys.stdout)


def _histogram(stats: Stats) -> str:
    return "  ".join(f"{k}:{v}" for k, v in sorted(stats.histogram.items())) or "-"


def _by_position(stats: Stats) -> str:
    """Each of the first 8 positions, then pooled ranges 9-16, 17-32, ... (long lookup blocks)."""
    drafted, accepted = stats.position_drafted, stats.position_accepted
    parts = [f"{100 * a:.0f}%" for a in stats.acceptance_by_position[:8]]
    lo = 8
    while lo < len(drafted):
        hi = min(2 * lo, len(drafted))
        d, a = sum(drafted[lo:hi]), sum(accepted[lo:hi])
        span = f"{lo + 1}-{hi}" if hi > lo + 1 else f"{hi}"
        parts.append(f"{span}:{100 * a / d:.0f}%" if d else f"{span}:-")
        lo = hi
    return " ".join(parts)


def speed_lines(stats: Stats) -> list[str]:
    """mlx-lm's ``Prompt:`` and ``Generation:`` lines."""
    prompt = f"Prompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.3f} tokens-per-sec"
    if stats.cached_tokens:
        disk = f", {stats.disk_tokens} of them from disk" if stats.disk_tokens else ""
        prompt += f" ({stats.cached_tokens} cached{disk})"
    if not stats.prefill_finished:
        prompt = f"Prompt: {stats.prompt_tokens} tokens, prefill not finished"
    return [prompt, f"Generation: {stats.generated} tokens, {stats.decode_tps:.3f} tokens-per-sec"]


def drafting_lines(stats: Stats) -> list[str]:
    """What was drafted and accepted, block by block and by draft position."""
    if not stats.blocks:  # stopped before its first block (Ctrl-C in the prefill): no mean of nothing
        return [f"Drafted: {stats.drafted}, accepted: {stats.accepted}", "Blocks: 0"]
    if not stats.drafted:  # blocks ran, none drafted: "acceptance: 0.0%" read as every draft rejected
        return ["Drafted: 0, accepted: 0 (no block drafted)",
                f"Blocks: {stats.blocks}, tokens per block: {stats.tokens_per_block:.2f}"]
    lines = [
        f"Drafted: {stats.drafted}, accepted: {stats.accepted}, "
        f"acceptance: {100 * stats.acceptance:.1f}% (accepted / drafted)",
        f"Blocks: {stats.blocks}, mean accepted per block: {stats.mean_accepted_per_block:.2f}, "
        f"tokens per block: {stats.tokens_per_block:.2f}",
        f"Accepted per block (histogram): {_histogram(stats)}",
    ]
    if stats.position_drafted:
        lines.append(f"Acceptance by draft position: {_by_position(stats)}")
    return lines


def rollback_line(stats: Stats) -> str:
    """How many blocks rolled back, and how (with its time when measured)."""
    counts = ", ".join(f"{v} {k}" for k, v in sorted(stats.rollbacks.items())) or "none"
    if stats.timed_blocks:
        return f"Rollback: {counts}; {1000 * stats.rollback_s:.1f} ms in total"
    return f"Rollback: {counts}; time not measured (--verbose times each phase)"


def phase_lines(stats: Stats) -> list[str]:
    """Each phase's mean time per block (``--verbose``), when measured."""
    if not stats.phase_ms:
        return []
    ms = stats.phase_ms
    return [f"Per block: draft {ms['draft_ms']:.2f} ms, verify {ms['verify_ms']:.2f} ms, "
            f"rollback {ms['rollback_ms']:.2f} ms; host syncs {stats.syncs / max(stats.blocks, 1):.2f}"]


def drafter_line(drafter: str, block_size: int) -> str:
    return f"Drafter: {drafter}, block size {block_size} ({block_size - 1} drafts)"


def summary_lines(stats: Stats, *, drafter: str, block_size: int, peak_gb: float,
                  verbose: bool = False) -> list[str]:
    """mlx-lm's three stats lines, then the speculative ones."""
    lines = speed_lines(stats) + [
        f"Peak memory: {peak_gb:.3f} GB",
        warmup_line(stats),
        drafter_line(drafter, block_size),
        shapes_line(stats),
    ] + drafting_lines(stats)
    lines.append(rollback_line(stats))
    choice = stats.rollback_choice
    if choice and choice["strategy"] != "trim":
        how = "as asked" if choice["reason"] == "as asked" else f"{choice['requested']}: {choice['reason']}"
        extra = ""
        if choice["strategy"] in ("capture", "tape"):
            held = choice[f"{choice['strategy']}_bytes"]
            extra = f"; holds {held / 2**20:.2f} MiB per full verify"
        lines.append(f"Rollback strategy: {choice['strategy']} ({how}){extra}")
    if stats.cache_bytes:
        lines.append("Cache: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in stats.cache_bytes.items()))
    if verbose:
        lines += phase_lines(stats)
    return lines


def _rows(rows: tuple) -> str:
    if not rows:
        return "none"
    lo, hi = min(rows), max(rows)
    return str(lo) if lo == hi else (f"{lo}-{hi}" if len(rows) == hi - lo + 1 else ",".join(map(str, rows)))


def warmup_line(stats: Stats) -> str:
    """How long the untimed warm-up took and what it ran."""
    target, drafter = stats.warmup_rows
    if stats.warmup_free:
        return "Warm-up: none needed (MLX's CPU backend compiles no kernels per shape)"
    if target or drafter:
        what = f"target rows {_rows(target)}" + (f", drafter rows {_rows(drafter)}" if drafter else "")
    elif not stats.blocks and not stats.warmup_s:
        return "Warm-up: not run (stopped before decoding)"
    else:
        what = "every shape had run already"
    return f"Warm-up: {stats.warmup_s:.3f} s before timing, not in tokens-per-sec ({what})"


def shapes_line(stats: Stats) -> str:
    """How many verify shapes the target ran, under which mode."""
    widths = sorted({t for _, t in stats.verify_shapes})
    if not widths:
        return "Verify shapes: none (no block ran)"
    how = "bucketed to powers of two" if stats.shapes == "bucketed" else "exact"
    return f"Verify shapes: {len(widths)} ({how}: {_rows(tuple(widths))} positions)"


def policy_lines(summary: dict) -> list[str]:
    """What the draft-length policy did."""
    if summary.get("policy") != "adaptive":
        return []
    if summary.get("length_rule", "").startswith("match-length"):
        lengths = summary["draft_lengths"]
        blocks = sum(lengths.values())
        drafting = blocks - lengths.get("0", 0)
        learned = "  ".join(f"{k}:{100 * a:.0f}%" for k, a in summary["acceptance_by_match"].items())
        line = (
            f"Adaptive: drafts sized by match length, {drafting} of {blocks} blocks drafted, mean draft "
            f"{summary['mean_draft_length']:.2f} (max {summary['k_max']}); acceptance by match length {learned}"
        )
        if "head_blocks" in summary:
            head = " ".join(f"{100 * a:.0f}%" for a in summary["head_acceptance"])
            line += (f"; {summary['head_blocks']} blocks drafted by the head (acceptance by position {head}, "
                     f"a draft step {summary['head_step']:.2f} plain steps)")
    else:
        lengths = "  ".join(f"{k}:{v}" for k, v in summary["draft_lengths"].items()) or "-"
        line = (
            f"Adaptive: draft lengths (length:blocks) {lengths}, mean {summary['mean_draft_length']:.2f} "
            f"(max {summary['k_max']})"
        )
    if summary["switched_off"]:
        line += (
            f"; speculation measured slower than plain and switched off {summary['switched_off']}x "
            f"({summary['plain_blocks']} plain steps)"
        )
    elif summary["plain_blocks"]:
        line += f"; {summary['plain_blocks']} plain steps to measure plain speed"
    return [line]


def comparison_lines(cmp: Comparison, specdec: Stats, decode) -> list[str]:
    """The ``--compare-ar`` verdict. ``decode`` turns a token id into text."""
    lines = []
    if cmp.identical:
        lines.append(f"Compare: identical ({cmp.tokens} tokens)")
    else:
        d = cmp.divergence

        def show(tok: Optional[int]) -> str:
            return "end of output" if tok is None else f"{tok} {decode(tok)!r}"

        tokens = f"at token {d.index}: specdec {show(d.specdec_token)}, plain {show(d.plain_token)}"
        difference = "nothing" if d.difference is None else f"{d.difference:.3g}"
        where = (f"{tokens}; recomputed at that position, the one-token and the {d.rows}-row verify path "
                 f"(row {d.row}) differ by {difference}")
        margin = "unknown" if d.margin is None else f"{d.margin:.3g}"
        if d.bound is not None:  # decoded in a batch: held to the backend's rounding
            within = "within" if d.verdict == "rounding tie" else "past"
            lines.append(
                f"Compare: {'rounding tie' if within == 'within' else 'DIVERGED'} {tokens}; decoded in a batch, "
                f"plain decoding's token leads by {margin}, {within} what this backend's rounding moves a logit by "
                f"({d.bound:.3g})" + (": not a bug" if within == "within" else ": a bug")
            )
        elif d.verdict == "rounding tie":
            lines.append(
                f"Compare: rounding tie {where}, at least the margin between the two tokens ({margin}; "
                f"top-2 logit margin {d.top2_margin:.3g}): plain decoding would itself flip with the "
                "batched kernel, not a bug"
            )
        else:
            if d.mismatch is not None:
                why = (f"; the speculative run's own verify forwards, replayed, pick another token at "
                       f"token {d.mismatch} than it emitted")
            else:
                why = "" if d.reproduced else "; a recomputed path does not reproduce its run's token"
            lines.append(
                f"Compare: DIVERGED {where}, less than the margin between the two tokens ({margin}; "
                f"top-2 logit margin {d.top2_margin:.6g}){why}: a bug"
            )
    lines.append(f"Plain decoding: {cmp.plain.decode_tps:.3f} tokens-per-sec; {speedup_words(specdec, cmp.plain)}")
    return lines


def row_lines(heading: str, stats: Stats, *, latency: Optional[float], finish: Optional[str],
              verbose: bool = False) -> list[str]:
    """One row of a batch: its heading, then the single prompt's stats lines that are the row's own (indented).

    ``--verbose`` adds the histogram, acceptance by position, rollbacks and phase times.
    """
    lines = speed_lines(stats) + (drafting_lines(stats) if verbose else drafting_lines(stats)[:2])
    if verbose:
        lines += [rollback_line(stats)] + phase_lines(stats)
    lines.append(f"Latency: {'-' if latency is None else f'{latency:.3f} s'}; finish reason: {finish}")
    return [heading] + ["  " + line for line in lines]


def batch_lines(batch: BatchStats, *, peak_gb: float, plain_batch_tps: Optional[float] = None,
                row_speedups: Sequence[float] = ()) -> list[str]:
    """The batch's summary: rows, tokens, aggregate speed, latency, time, and with ``--compare-ar`` the speedups.

    The speedups lead with the like-for-like one, over plain decoding of the same batch
    (``plain_batch_tps``, its aggregate); then each row's over its prompt alone (``row_speedups``,
    which count batching's cost) and the aggregate's over one prompt after another (batching's gain).
    """
    mean, worst = batch.mean_latency_s, batch.worst_latency_s
    latency = "no row finished" if mean is None else f"mean {mean:.3f} s, worst {worst:.3f} s"
    planner = f"; the planner's forward costs measured first in {batch.planner_s:.2f} s" if batch.planner_s else ""
    lines = [
        f"Batch: {batch.rows} prompts, at most {batch.concurrency} decoding together (--decode-concurrency), "
        f"{batch.blocks} blocks",
        f"Generation: {batch.generated} tokens in all, {batch.aggregate_tps:.3f} tokens-per-sec aggregate "
        f"({batch.decode_s:.3f} s decoding)",
        f"Latency: {latency} (start to a row's last token)",
        f"Wall: {batch.wall_s:.3f} s (prefill {batch.prefill_s:.3f} s, decode {batch.decode_s:.3f} s){planner}",
        f"Peak memory: {peak_gb:.3f} GB",
    ]
    if batch.verdicts:
        v = batch.verdicts
        lines.append(f"Compare: {v['identical']} identical, {v['rounding tie']} rounding ties, "
                     f"{v['diverged']} diverged")
        if plain_batch_tps is not None:
            ratio = (f"{batch.aggregate_tps / plain_batch_tps:.2f}x" if batch.generated and batch.aggregate_tps
                     and plain_batch_tps else "none measurable")
            lines.append(f"Speedup over plain decoding of the same batch: {ratio} ({batch.aggregate_tps:.3f} against "
                         f"{plain_batch_tps:.3f} tokens-per-sec aggregate, at most {batch.concurrency} rows together "
                         "both ways)")
        if row_speedups:
            low, high = f"{min(row_speedups):.2f}x", f"{max(row_speedups):.2f}x"
            span = low if low == high else f"{low} to {high}"
            lines.append(f"Speedup by row: {span} (a row's tokens-per-sec in the batch over plain decoding of its "
                         "prompt alone)")
        words = ("no speedup measurable" if batch.speedup is None
                 else f"the batch's aggregate is {batch.speedup:.2f}x that, batching's own gain included")
        lines.append(f"Plain decoding, one prompt after another: {batch.plain_generated} tokens, "
                     f"{batch.plain_aggregate_tps:.3f} tokens-per-sec aggregate; {words}")
    return lines


def _table_console(width: int) -> Console:
    """Stdout for a table: the terminal's width, or ``width`` columns when piped (Rich's 80 would cut it)."""
    console = Console(highlight=False)
    return console if console.is_terminal else Console(highlight=False, width=width)


_VERDICT_ORDER = {"identical": 0, "rounding tie": 1, "diverged": 2}


def print_concurrency(result: ConcurrencyResult, drafter: str, console: Optional[Console] = None) -> None:
    """The ``sweep --concurrency`` table on stdout: aggregate tok/s by block size (rows) and concurrency (columns)."""
    if _MUTED:
        return
    console = console if console is not None else _table_console(160)
    worst = {b: max((c.verdict for c in result.cells if c.block_size == b), key=lambda v: _VERDICT_ORDER[v])
             for b in (None, *result.block_sizes)}
    first = result.levels[0]
    tokens = result.cell(None, first).tokens // first  # plain decoding's, the same in every row
    caption = ("aggregate tok/s = all rows' tokens / the batch's decode seconds; (speedup over plain at the same "
               "concurrency); * fastest block size at that concurrency")
    if not tokens:
        caption += "; no tokens generated: no speedup measurable"
    table = Table(title=f"specdec sweep · {drafter} · {tokens} tokens per row · aggregate tok/s by concurrency",
                  title_justify="left", caption=caption, caption_justify="left")
    table.add_column("block", justify="right", no_wrap=True)
    for level in result.levels:
        table.add_column(f"x{level}", justify="right", no_wrap=True)
    table.add_column("same", justify="right", no_wrap=True)
    for b in (None, *result.block_sizes):
        cells = []
        for level in result.levels:
            c = result.cell(b, level)
            mark = "*" if b is not None and b == result.best(level) else " "
            ratio = "" if b is None else f" ({c.speedup:.2f}x)" if c.tokens else " (-)"
            cells.append(f"{c.aggregate_tps:.2f}{ratio}{mark}")
        table.add_row("plain" if b is None else str(b), *cells, _SAME[worst[b]])
    console.print(table)


def speedup_words(specdec: Stats, plain: Stats) -> str:
    """``speedup 1.52x``, or why there is none to measure (a side generated nothing, or took no time)."""
    if not specdec.generated or not plain.generated:
        return "no speedup measurable (no tokens generated)"
    if not (specdec.decode_tps and plain.decode_tps):
        return "no speedup measurable (no decode time)"
    return f"speedup {specdec.decode_tps / plain.decode_tps:.2f}x"


def print_stderr(lines: list[str]) -> None:
    """Write summary lines to stderr, without markup or colour on a pipe."""
    if _MUTED:
        return
    console = Console(stderr=True, highlight=False)
    for line in lines:
        console.print(line, markup=False, soft_wrap=True)


def loading_line(model: Optional[str], draft_model: Optional[str]) -> str:
    """What is about to load: ``--model`` (or the bundled model) and ``--draft-model``."""
    from ..model.bundled import DISPLAY_NAME

    drafter = f" with drafter {draft_model}" if draft_model else ""
    return f"Loading {model if model is not None else DISPLAY_NAME}{drafter} ..."


def print_loading(model: Optional[str], draft_model: Optional[str]) -> None:
    """Say what loads, on a terminal, before the seconds of loading (4-12 s of nothing on a slow machine).

    Not on a pipe or into a file: nobody is watching it wait, and there an error stays the one line
    on stderr that scripts and the tests read.
    """
    if _MUTED:
        return
    console = Console(stderr=True, highlight=False)
    if console.is_terminal:
        console.print(loading_line(model, draft_model), markup=False, soft_wrap=True)


def stderr_width() -> Optional[int]:
    """The terminal's width in columns when stderr is one; None on a pipe, where nothing wraps."""
    console = Console(stderr=True)
    return console.width if console.is_terminal else None


@contextmanager
def sweep_progress() -> Iterator[Callable[[Progress], None]]:
    """A progress bar on stderr while the sweep runs (hidden when not a terminal)."""
    console = Console(stderr=True)
    bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
              console=console, transient=True, disable=_MUTED or not console.is_terminal)
    with bar:
        task = bar.add_task("measuring", total=None)

        def advance(event: Progress) -> None:
            bar.update(task, total=event.total, completed=event.done, description=event.label)

        yield advance


def _speed_bar(speedup: float, best: float, width: int = 12) -> str:
    return "█" * max(1, round(width * speedup / best)) if best > 0 else ""


_SAME = {"identical": "yes", "rounding tie": "tie", "diverged": "NO"}
# The sweep's columns in table order ("" is the speed bar).
_SWEEP_COLUMNS = ("block", "tok/s", "speedup", "", "accept", "acc/blk", "draft", "verify", "rollback", "syncs",
                  "same")
# Always shown: the verdict and the speedup. The others join while they fit, in this order; the bar
# takes what width is left (up to 12 cells) and is the first to go.
_SWEEP_ESSENTIAL = ("block", "speedup", "same")
_SWEEP_OPTIONAL = ("tok/s", "accept", "acc/blk", "verify", "draft", "rollback", "syncs")
_BAR_WIDTH = 12


def _table_width(widths: list[int]) -> int:
    # Rich's default box: one padding cell each side of a column, one rule between and around them.
    return sum(widths) + 3 * len(widths) + 1


def print_sweep(result: SweepResult, drafter: str, console: Optional[Console] = None) -> None:
    """The sweep table on stdout: one row per block size, the best one marked.

    On a narrow terminal columns are left out (the bar first, then the phase
    times, ...) rather than truncated: the speedup and the ``same`` verdict
    always show in full.
    """
    if _MUTED:
        return
    console = console if console is not None else _table_console(120)
    # generate's default setting goes last, under a rule: compared with every fixed size, never the "best".
    rows = result.rows + ([result.default] if result.default is not None else [])
    best = max((r.speedup for r in rows), default=0.0)

    def block(r) -> str:
        if r.adaptive:
            return default_label(r.block_size) + " "
        return f"{r.block_size}{'*' if r.block_size == result.best_block_size else ' '}"

    # A row that drafted nothing has no acceptance: "0.0%" would read as every draft rejected.
    cells = [{
        "block": block(r),
        "tok/s": f"{r.decode_tps:.2f}", "speedup": f"{r.speedup:.2f}x" if result.tokens else "-",
        "accept": "-" if r.acceptance is None else f"{100 * r.acceptance:.1f}%",
        "acc/blk": "-" if r.mean_accepted_per_block is None else f"{r.mean_accepted_per_block:.2f}",
        "draft": f"{r.draft_ms:.1f}", "verify": f"{r.verify_ms:.1f}",
        "rollback": f"{r.rollback_ms:.1f}", "syncs": f"{r.syncs_per_block:.2f}", "same": _SAME[r.verdict],
    } for r in rows]

    def width(name: str) -> int:
        return max([len(name)] + [len(c[name]) for c in cells])

    default = ""
    if result.default is not None:
        default = "; default: what generate runs without --block-size or --no-adaptive"
        if _table_width([width(n) for n in _SWEEP_ESSENTIAL]) > console.width:
            # Too narrow for the whole label beside the speedup and verdict: the caption says the rest.
            cells[-1]["block"] = "default "
            default = f"; default: adaptive, block {result.default.block_size}, what generate runs without options"
    shown = list(_SWEEP_ESSENTIAL)
    for name in _SWEEP_OPTIONAL:
        if _table_width([width(n) for n in shown + [name]]) <= console.width:
            shown.append(name)
    bar = min(_BAR_WIDTH, console.width - _table_width([width(n) for n in shown]) - 3)
    if bar >= 3:
        shown.append("")
    title = f"specdec sweep · {drafter} · {result.tokens} tokens · plain {result.ar_decode_tps:.2f} tok/s"
    hidden = [n for n in _SWEEP_COLUMNS if n and n not in shown]
    caption = "phase times in ms per block; * fastest" if {"draft", "verify", "rollback"} & set(shown) else "* fastest"
    caption += default
    if not result.tokens:
        caption += "; no tokens generated: no speedup measurable"
    if hidden:
        caption += f"; too narrow for {', '.join(hidden)} (--json has every column)"
    if _table_width([width(n) for n in _SWEEP_ESSENTIAL]) > console.width:
        # Narrower than the smallest table: one line per block size.
        console.print(title, markup=False)
        for c in cells:
            console.print(f"{c['block'].strip()} {c['speedup']} same:{c['same']}", markup=False)
        console.print(caption, markup=False)
    else:
        table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
        columns = [n for n in _SWEEP_COLUMNS if n in shown]
        for name in columns:
            table.add_column(name, justify="left" if name == "" else "right", no_wrap=True)
        for i, (r, c) in enumerate(zip(rows, cells)):
            table.add_row(*(_speed_bar(r.speedup, best, bar) if n == "" else c[n] for n in columns),
                          end_section=i == len(result.rows) - 1)
        console.print(table)
    if result.best_block_size is None:
        print_stderr(["best block size: none (no tokens generated: no speedup measurable)"])
        return
    print_stderr([f"best block size: {result.best_block_size} (speedup = decode tok/s over plain decoding's, "
                  "same prompt ids, median of repeats)"])
