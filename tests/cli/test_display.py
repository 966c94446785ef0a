"""The display layer: line handling under Rich Live, summary lines."""

from __future__ import annotations

import io
import re

from rich.console import Console

from specdec_cli.cli.display import LiveText, summary_lines, take_lines
from specdec_cli.core.blocks import Block
from specdec_cli.core.stats import Stats


def test_take_lines_splits_on_newlines_and_wraps_long_lines():
    assert take_lines("abc", 10) == ([], "abc")
    assert take_lines("one\ntwo\nthr", 10) == (["one", "two"], "thr")
    assert take_lines("aaaa bbbb cccc dddd", 10) == (["aaaa bbbb"], "cccc dddd")
    assert take_lines("x" * 25, 10) == (["x" * 10, "x" * 10], "x" * 5)
    # Empty lines survive.
    assert take_lines("a\n\nb", 10) == (["a", ""], "b")


def test_live_view_prints_each_completed_line_once_above_the_panel():
    out = io.StringIO()
    view = LiveText(Console(file=out, force_terminal=True, width=40), "model")
    stats = Stats()
    for piece in ["Hello", " wor", "ld\nsecond", " line\n", "tail"]:
        view.write(piece)
        stats.add(Block((1,), 1, 1, "none", 1), 0.01)
        view.update(stats)
    view.close()
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    # Completed lines are printed once each (the in-progress line is redrawn
    # inside the live region, which is erased at the end).
    assert plain.count("Hello world\n") == 1
    assert plain.count("second line\n") == 1
    assert plain.rstrip().endswith("tail")


def test_summary_has_mlx_lm_lines_first():
    stats = Stats(prompt_tokens=10, prefill_s=0.5)
    stats.add(Block((1, 2, 3), 3, 2, "trim", 1), 0.1)
    stats.add(Block((4,), 3, 0, "trim", 1), 0.1)
    lines = summary_lines(stats, drafter="model", block_size=4, peak_gb=0.5)
    assert lines[0] == "Prompt: 10 tokens, 20.000 tokens-per-sec"
    assert lines[1] == "Generation: 4 tokens, 20.000 tokens-per-sec"
    assert lines[2] == "Peak memory: 0.500 GB"
    assert "Drafted: 6, accepted: 2, acceptance: 33.3% (accepted / drafted)" in lines
    assert "Blocks: 2, mean accepted per block: 1.00, tokens per block: 2.00" in lines
    assert "Accepted per block (histogram): 0:1  2:1" in lines
    assert "Acceptance by draft position: 50% 50% 0%" in lines


def test_blocks_that_drafted_nothing_claim_no_acceptance():
    # Prompt lookup with nothing to copy drafts nothing: "acceptance: 0.0%" and "acceptance 0%" read as
    # every draft rejected.
    from specdec_cli.cli.chat import turn_line

    stats = Stats(prompt_tokens=10, prefill_s=0.5)
    for tok in (1, 2):
        stats.add(Block((tok,), 0, 0, "none", 1), 0.1)
    lines = summary_lines(stats, drafter="lookup", block_size=64, peak_gb=0.5, verbose=True)
    assert "Drafted: 0, accepted: 0 (no block drafted)" in lines
    assert "Blocks: 2, tokens per block: 1.00" in lines
    assert not [x for x in lines if "acceptance:" in x or "mean accepted" in x or "Accepted per block" in x]
    line = turn_line(stats)
    assert "acceptance" not in line and "1.00 tokens per block" in line
    report = stats.to_dict()  # generate --json: null, as the server's timings say it
    assert report["acceptance"] is None and report["mean_accepted_per_block"] is None and report["drafted"] == 0
    one = Stats(prompt_tokens=1, prefill_s=0.5)
    one.add(Block((1,), 0, 0, "none", 1), 0.1)
    assert "prompt 1 token," in turn_line(one) and "| 1 token," in turn_line(one)


# --- the sweep table at any width --------------------------------------------------------

def _sweep_result():
    from specdec_cli.session.measure import SweepResult, SweepRow

    rows = [SweepRow(b, 20.0 + b, s, 0.612, 1.83, 12.3, 45.6, 1.2, 2.0, v == "identical", v)
            for b, s, v in ((2, 1.13, "identical"), (4, 1.52, "rounding tie"), (16, 0.87, "diverged"))]
    return SweepResult(18.25, rows, 64)


def _render_sweep(width: int) -> str:
    from specdec_cli.cli.display import print_sweep

    out = io.StringIO()
    print_sweep(_sweep_result(), "lookup", Console(file=out, width=width, highlight=False))
    text = out.getvalue()
    assert all(len(line) <= width for line in text.splitlines()), text
    return text


def _row(text: str, block: str) -> str:
    return next(line for line in text.splitlines() if re.search(rf"(^|[│ ]){re.escape(block)}[ │]", line))


def test_the_live_panel_claims_no_acceptance_before_a_draft():
    # Prompt lookup with nothing to copy yet: "acceptance 0.0%" would read as every draft rejected.
    from specdec_cli.cli.display import stats_panel

    def panel(stats: Stats) -> str:
        out = io.StringIO()
        Console(file=out, width=120, highlight=False).print(stats_panel(stats, "lookup"))
        return out.getvalue()

    stats = Stats(prompt_tokens=10, prefill_s=0.5)
    stats.add(Block((1,), 0, 0, "none", 1), 0.1)
    text = panel(stats)
    assert re.search(r"acceptance\s+-\s", text) and re.search(r"accepted/block\s+-\s", text) and "0.0%" not in text
    stats.add(Block((2, 3), 2, 1, "trim", 3), 0.1)
    assert "acceptance  50.0%" in panel(stats) and "accepted/block 1.00" in panel(stats)


def test_sweep_table_at_120_columns_shows_everything():
    text = _render_sweep(120)
    header = next(line for line in text.splitlines() if "speedup" in line)
    for name in ("block", "tok/s", "accept", "acc/blk", "draft", "verify", "rollback", "syncs", "same"):
        assert name in header
    assert "█" in _row(text, "4*") and "too narrow" not in text
    assert "…" not in text


def test_sweep_table_at_80_columns_keeps_the_verdict_and_speedup_and_drops_the_bar_first():
    text = _render_sweep(80)
    for block, speedup, same in (("2", "1.13x", "yes"), ("4*", "1.52x", "tie"), ("16", "0.87x", "NO")):
        row = _row(text, block)
        assert speedup in row and re.search(rf"\b{same}\b", row), row
    assert "…" not in text and "█" not in text and "too narrow for" in text


def test_sweep_table_at_30_columns_still_shows_every_speedup_and_verdict():
    text = _render_sweep(30)
    for block, speedup, same in (("2", "1.13x", "yes"), ("4*", "1.52x", "tie"), ("16", "0.87x", "NO")):
        row = _row(text, block)
        assert speedup in row and re.search(rf"\b{same}\b", row), row
    assert "…" not in text


def test_sweep_at_20_columns_falls_back_to_lines():
    text = _render_sweep(20)
    assert "4* 1.52x same:tie" in text and "16 0.87x same:NO" in text


def test_a_run_of_no_tokens_claims_no_speedup():
    from specdec_cli.loop.compare import Comparison
    from specdec_cli.cli.display import comparison_lines

    def stats(generated, seconds):
        s = Stats()
        if generated:
            s.add(Block(tuple(range(generated)), 0, 0, "none", 1), seconds)
        return s

    none = comparison_lines(Comparison(True, 0, None, stats(0, 0.0)), stats(0, 0.0), str)[-1]
    assert "0.00x" not in none and "no speedup measurable (no tokens generated)" in none
    some = comparison_lines(Comparison(True, 8, None, stats(8, 2.0)), stats(8, 1.0), str)[-1]
    assert some == "Plain decoding: 4.000 tokens-per-sec; speedup 2.00x"


def test_a_sweep_of_no_tokens_shows_no_speedup(capsys):
    from specdec_cli.cli.display import print_sweep
    from specdec_cli.session.measure import SweepResult, SweepRow

    out = io.StringIO()
    rows = [SweepRow(b, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, True) for b in (2, 4)]
    result = SweepResult(0.0, rows, 0)
    print_sweep(result, "lookup", Console(file=out, width=120, highlight=False))
    text = out.getvalue()
    assert "0.00x" not in text and "no speedup measurable" in text
    # Every speedup is 0.0 (an end-of-sequence token first): none is the fastest.
    assert "*" not in text.replace("* fastest", "") and result.best_block_size is None
    assert "best block size: none (no tokens generated" in capsys.readouterr().err


def test_a_concurrency_sweep_of_no_tokens_shows_no_speedup():
    from specdec_cli.cli.display import print_concurrency
    from specdec_cli.session.batch import ConcurrencyCell, ConcurrencyResult

    cells = tuple(ConcurrencyCell(b, n, 0.0, 1.0 if b is None else 0.0, None, 0) for b in (None, 2, 4) for n in (1, 2))
    result = ConcurrencyResult((1, 2), (2, 4), cells)
    out = io.StringIO()
    print_concurrency(result, "lookup", Console(file=out, width=160, highlight=False))
    text = out.getvalue()
    flat = " ".join(text.split())  # the caption wraps at the table's width
    assert "0.00x" not in text and "0.00 (-)" in text and "no speedup measurable" in flat
    assert "*" not in flat.replace("* fastest", "") and result.to_dict()["best_block_size"] == {"1": None, "2": None}


def test_a_sweep_row_that_drafted_nothing_claims_no_acceptance():
    # Block size 1, or lookup with nothing to copy: "0.0%" and "0.00" would read as every draft rejected.
    from specdec_cli.cli.display import print_sweep
    from specdec_cli.session.measure import SweepResult, SweepRow

    out = io.StringIO()
    rows = [SweepRow(1, 10.0, 1.0, None, None, 0.0, 1.0, 0.0, 1.0, True),
            SweepRow(4, 12.0, 1.2, 0.5, 1.5, 0.1, 1.0, 0.1, 1.0, True)]
    print_sweep(SweepResult(10.0, rows, 8), "lookup", Console(file=out, width=120, highlight=False))
    text = out.getvalue()
    assert re.search(r"│\s+1\s+│.*│\s+-\s+│\s+-\s+│", _row(text, "1")) and "0.0%" not in _row(text, "1")
    assert "50.0%" in _row(text, "4*") and "1.50" in _row(text, "4*")


# --- the chat stats line at any width ----------------------------------------------------

def _chat_stats() -> Stats:
    # Wide numbers, as a long conversation on a slow machine has them.
    stats = Stats(prompt_tokens=12345, cached_tokens=12001, prefill_s=12.5)
    for _ in range(80):
        stats.add(Block((1, 2, 3, 4, 5), 8, 4, "trim", 1), 0.01)
    return stats


def test_chat_line_fits_the_terminal_and_drops_the_least_useful_numbers_first():
    from specdec_cli.cli.chat import turn_line

    stats = _chat_stats()
    full = turn_line(stats, interrupted=True)
    # Not a terminal: nothing wraps, so every number shows in full.
    assert full == ("[prompt 12345 tokens (12001 cached), 12.50 s | 400 tokens, 500.0 tok/s | "
                    "acceptance 50%, 5.00 tokens per block; stopped (Ctrl-C)]")
    assert turn_line(stats, True, 200) == full
    # Which pieces each width keeps, in the order they are dropped.
    pieces = ("12.50 s", "prompt 12345", "5.00 tok", "50%")
    shown = {}
    for width in (60, 80, 100, 200):
        line = turn_line(stats, True, width)
        assert len(line) <= width, (width, line)
        assert line.startswith("[") and line.endswith("]") and "  " not in line, line
        assert "400 tokens" in line and "500.0 tok/s" in line and "stopped" in line, line
        shown[width] = [p in line for p in pieces]
        # A piece dropped means every less useful one (earlier in `pieces`) is gone too.
        assert shown[width] == sorted(shown[width]), (width, line)
    assert shown[200] == [True] * 4 and not all(shown[60])
    # A wider terminal never shows less.
    assert [sum(shown[w]) for w in (60, 80, 100, 200)] == sorted(sum(shown[w]) for w in (60, 80, 100, 200))
    assert turn_line(stats, False, 100).endswith("tok/block]")


def test_chat_line_too_narrow_for_anything_keeps_the_essentials():
    from specdec_cli.cli.chat import turn_line

    assert turn_line(_chat_stats(), True, 10) == "[400 tokens, 500.0 tok/s; stopped]"
    cut = ("cut at the model's context (128 tokens): /reset starts over", "cut at the context")
    assert turn_line(_chat_stats(), False, 10, cut) == "[400 tokens, 500.0 tok/s; cut at the context]"
    assert turn_line(_chat_stats(), False, None, cut).endswith("tokens per block; " + cut[0] + "]")


def test_a_prefill_stopped_by_ctrl_c_shows_no_time_rate_or_acceptance():
    # No Prefilled event came (prefill_s stayed 0): "0.00 s", a 0 tok/s prompt rate and "acceptance 0%"
    # would each read as a measurement.
    from specdec_cli.cli.chat import turn_line
    from specdec_cli.cli.display import speed_lines

    stopped = Stats(prompt_tokens=3031)
    line = turn_line(stopped, interrupted=True)
    assert line == "[prompt 3031 tokens, prefill stopped | 0 tokens, 0.0 tok/s; stopped (Ctrl-C)]"
    assert speed_lines(stopped)[0] == "Prompt: 3031 tokens, prefill not finished"
    report = stopped.to_dict()
    assert report["prefill_s"] is None and report["prompt_tps"] is None
    done = Stats(prompt_tokens=8, prefill_s=2.0).to_dict()
    assert done["prefill_s"] == 2.0 and done["prompt_tps"] == 4.0
