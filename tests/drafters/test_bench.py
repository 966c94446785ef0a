"""The benchmark's own pieces: the controlled-acceptance drafter and the analytic bound."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from helpers import GEN, PROMPT, assert_exact, kernels_agree, plain, prefilled, target, tokens

from specdec_cli.loop.engine import speculative_generate_step

_spec = importlib.util.spec_from_file_location("bench", Path(__file__).resolve().parents[2] / "scripts" / "bench.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench"] = bench  # dataclasses look their module up there
_spec.loader.exec_module(bench)


def oracle_run(family: str, a: float, k: int = 4):
    model = target(family, "float32")
    ref, _ = plain(model)
    cache = prefilled(model)
    drafter = bench.OracleDrafter(ref, len(PROMPT), a, vocab=259, seed=3)
    drafter.prefill(PROMPT[:-1])
    blocks = list(speculative_generate_step(PROMPT[-1], cache, drafter, num_draft_tokens=k, max_tokens=GEN))
    return blocks, ref


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_oracle_drafter_controls_acceptance_and_keeps_output_exact(family):
    model = target(family, "float32")
    full, ref = oracle_run(family, 1.0)
    assert_exact(model, "float32", full, ref)
    none, _ = oracle_run(family, 0.0)
    assert_exact(model, "float32", none, ref)
    half, _ = oracle_run(family, 0.6)
    assert_exact(model, "float32", half, ref)
    assert 0 < sum(b.accepted for b in half) < sum(b.drafted for b in half)
    if kernels_agree("float32"):  # else a rounding tie may leave the oracle's script
        assert all(b.accepted == b.drafted for b in full)
        assert sum(b.accepted for b in none) == 0


def test_analytic_bound():
    cost = {1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6}.__getitem__
    # Two full accepts of 3 drafts, free drafting: 8 tokens in 2 x 1.6.
    assert bench.analytic_bound([(3, 3), (3, 3)], cost, 0.0) == pytest.approx(8 / 3.2)
    # Drafting cost counts per draft; a re-forward counts on partial accepts only.
    assert bench.analytic_bound([(3, 1)], cost, 0.1) == pytest.approx(2 / (0.3 + 1.6))
    assert bench.analytic_bound([(3, 1)], cost, 0.1, reforward=lambda t: 0.5 * t) == pytest.approx(
        2 / (0.3 + 1.6 + 1.0))
    assert bench.analytic_bound([(3, 3)], cost, 0.1, reforward=lambda t: 9.0) == pytest.approx(4 / (0.3 + 1.6))


def test_analytic_bound_with_carry():
    cost = {1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6, 5: 1.7, 6: 1.8, 7: 1.9}.__getitem__
    reforward = lambda t: 0.5 * t  # noqa: E731
    # Partial (2 tokens carried), then a full accept that verifies carry + 4.
    blocks = [(3, 1), (3, 3)]
    assert bench.analytic_bound(blocks, cost, 0.0, reforward, carry=True) == pytest.approx(6 / (1.6 + 1.8))
    assert bench.analytic_bound(blocks, cost, 0.0, reforward) == pytest.approx(6 / (1.6 + 1.0 + 1.6))
    # A partial last block re-feeds its carry at the end.
    assert bench.analytic_bound([(3, 0)], cost, 0.0, reforward, carry=True) == pytest.approx(1 / (1.6 + 0.5))
