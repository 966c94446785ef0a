"""The display layer: line handling under Rich Live, summary lines."""

from __future__ import annotations

import io
import re

from rich.console import Console

from specdec_cli.display import LiveText, summary_lines, take_lines
from specdec_cli.engine import Block
from specdec_cli.stats import Stats


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
