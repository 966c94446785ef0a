"""When a recurrent layer's several-token recurrence is not its one-token recurrence.

A layer is made to differ by monkeypatching the step function a model module
calls (as a future mlx-lm, or a backend whose batched kernel rounds otherwise,
would). Verify forwards must then still compute what plain decoding computes
(one token at a time), or speculation is refused before the first token;
where only the capture/tape records are broken, carry stays, on the
one-token path.
"""

from __future__ import annotations

import functools
import re

import mlx.core as mx
import mlx_lm.models.qwen3_5 as qwen3_5_module
import pytest
from helpers import PROMPT, max_cache_diff, noisy_drafter, plain, speculative, tokens

import specdec_cli.model.recurrent as recurrent
from specdec_cli.cache.caches import ModelCache
from specdec_cli.drafters import ModelDrafter
from specdec_cli.errors import UnsupportedModelError
from specdec_cli.cache.rollback import choose
from specdec_cli.loop.events import collect
from specdec_cli.loop.runner import run
from specdec_cli.session.synthetic import TINY_CONFIGS, build_model


def differing_gdn(monkeypatch, rows=lambda t: t > 1, factor=1.5):
    """qwen3_5's gated_delta_update, changed for several-token calls (``rows(T)``) only."""
    real = qwen3_5_module.gated_delta_update

    @functools.wraps(real)  # still mlx-lm's step function, as far as anyone can tell (name, module, signature)
    def gated_delta_update(q, *args, **kwargs):
        y, state = real(q, *args, **kwargs)
        if rows(q.shape[1]):
            return y * factor, state * factor
        return y, state

    monkeypatch.setattr(qwen3_5_module, "gated_delta_update", gated_delta_update)


def fresh(family="qwen3_5", dtype=mx.float32):
    return build_model(TINY_CONFIGS[family], seed=0, dtype=dtype)


def test_a_batched_recurrence_that_differs_is_verified_one_token_at_a_time(monkeypatch):
    differing_gdn(monkeypatch)
    m, draft = fresh(), noisy_drafter("qwen3_5", "float32")
    ref, ref_cache = plain(m, max_tokens=24)
    steps = ModelCache(m).steps
    assert steps.per_token and steps.inexact["GatedDeltaNet"][0] == 2 and steps.refusal is None
    for strategy in ("carry", "reforward", "capture", "tape"):
        blocks, cache, _ = speculative(m, draft, 3, max_tokens=24, rollback=strategy)
        assert tokens(blocks) == ref, strategy
        assert any(0 < b.accepted < b.drafted for b in blocks), strategy  # partial accepts were cut back
        assert max_cache_diff(cache, ref_cache) == 0.0, strategy


def test_the_check_covers_every_row_count_a_run_uses(monkeypatch):
    differing_gdn(monkeypatch, rows=lambda t: t == 20)  # only a 20-row verify differs
    short, long = ModelCache(fresh()), ModelCache(fresh())
    short.check_verify(12)  # a run whose verifies never reach 20 rows
    assert not short.steps.per_token and short.steps.inexact == {}
    long.check_verify(72)   # one that can (lookup: 64-token blocks plus carried tokens)
    assert long.steps.per_token and long.steps.inexact["GatedDeltaNet"][0] == 20


def test_speculation_is_refused_when_the_differing_layer_cannot_be_hooked(monkeypatch):
    differing_gdn(monkeypatch)

    def no_hook(self, mixer, adapter, calls):
        raise recurrent._Unsupported(f"its {type(mixer).__name__} has no conv1d where specdec reads the conv state")

    monkeypatch.setattr(recurrent.RecurrentSteps, "_install", no_hook)
    m, draft = fresh(), noisy_drafter("qwen3_5", "float32")
    with pytest.raises(UnsupportedModelError) as refused:
        list(run(m, PROMPT, drafter=ModelDrafter(draft), num_draft_tokens=3, max_tokens=8))
    message = str(refused.value)
    assert "\n" not in message and "GatedDeltaNet" in message and re.search(r"layers\.\d+\.linear_attn", message)
    assert "computed for 2 tokens at once differs from 2 one-token steps" in message
    assert "--block-size 1" in message
    ref, _ = plain(m, max_tokens=8)
    # Plain decoding, and speculation with one-token verifies (block size 1), still run, and agree.
    assert collect(run(m, PROMPT, max_tokens=8))[1] == ref
    assert collect(run(m, PROMPT, drafter=ModelDrafter(draft), num_draft_tokens=0, max_tokens=8))[1] == ref


def test_broken_records_leave_carry_on_the_one_token_path(monkeypatch):
    # Capture/tape records that do not reproduce mlx-lm's states: those two are off, but carry's
    # verify forwards still compute Mamba2 one token at a time (its chunked several-token formula
    # differs from the one-token one in the last bit, so mlx-lm's own forward would not do).
    monkeypatch.setattr(recurrent.StepRecord, "conv_state", lambda self, m: self.conv_input[:, m + 1:m + 1 + self.n_keep])
    m, draft = fresh("nemotron_h", mx.bfloat16), noisy_drafter("nemotron_h", "bfloat16")
    ref, ref_cache = plain(m, max_tokens=24)
    cache = ModelCache(m)
    assert not cache.can_record and "do not reproduce" in cache.record_problem
    assert cache.steps.stepping and cache.steps.refusal is None
    choice = choose("auto", cache, 4)
    assert choice.strategy == "carry" and "carry instead" in choice.reason
    blocks, after, _ = speculative(m, draft, 3, max_tokens=24, rollback="carry")
    assert tokens(blocks) == ref and any(b.rollback == "carry" for b in blocks)
    assert max_cache_diff(after, ref_cache) == 0.0
