"""A step queued ahead (the engine's ``ahead``): after a single row's block without drafts, the
forward of its next token is queued before that token is read back, as plain decoding queues its
next step; a following block with drafts verifies them in a forward of their own.

Invariants on tiny random models of every cache family: the output equals plain decoding's;
whatever ends a run (max tokens, EOS, closing the generator, an interrupt) leaves the caches as
plain decoding would; ``--compare-ar``'s replay recomputes such blocks as they ran.
"""

from __future__ import annotations

import pytest
from helpers import (
    DTYPES,
    FAMILIES,
    GEN,
    Interrupting,
    PROMPT,
    assert_exact,
    max_cache_diff,
    noisy_drafter,
    plain,
    prefilled,
    target,
    tokens,
)

from specdec_cli.core.adaptive import FixedLength
from specdec_cli.core.blocks import Block
from specdec_cli.core.stats import Stats
from specdec_cli.drafters import ModelDrafter
from specdec_cli.loop import engine
from specdec_cli.loop.compare import replay
from specdec_cli.loop.engine import Engine, Row, speculative_generate_step

RECURRENT = ("qwen3_5", "nemotron_h")


@pytest.fixture(autouse=True)
def queue_ahead(monkeypatch):
    """On for the engines these tests build without saying (off by default: see engine.QUEUE_AHEAD)."""
    monkeypatch.setattr(engine, "QUEUE_AHEAD", True)


class Gappy:
    """A draft model's drafter that drafts nothing in the blocks ``misses`` says, in turn (as prompt
    lookup misses)."""

    def __init__(self, draft_model, misses: tuple[bool, ...] = (True, True, False)):
        self.inner, self.misses, self.calls = ModelDrafter(draft_model), misses, 0

    def propose(self, last, k, params=None):
        miss = self.misses[self.calls % len(self.misses)]
        self.calls += 1
        args = (last, 0 if miss else k) + (() if params is None else (params,))
        return self.inner.propose(*args)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def run(model, draft, *, k=3, max_tokens=GEN, eos_ids=(), rollback="reforward", misses=(True, True, False),
        ahead=True, timed=False) -> tuple[list[Block], object]:
    cache = prefilled(model)
    drafter = Gappy(draft, misses)
    drafter.prefill(PROMPT[:-1])
    engine = Engine(model, rollback=rollback, ahead=ahead, timed=timed)
    row = engine.admit(Row(PROMPT[-1], drafter, FixedLength(k), eos=frozenset(eos_ids), max_tokens=max_tokens),
                       cache)
    blocks = []
    try:
        while row.finish is None and row.room > 0:
            ((_, block),) = engine.step()
            blocks.append(block)
    finally:
        engine.close()
    return blocks, cache


def rollbacks(family: str) -> list[str]:
    return ["reforward", "carry", "capture", "tape"] if family in RECURRENT else ["reforward"]


@pytest.mark.parametrize("family,dtype", [(f, d) for f in FAMILIES for d in DTYPES])
def test_gaps_equal_plain_and_leave_plain_caches(family, dtype):
    model, draft = target(family, dtype), noisy_drafter(family, dtype)
    ref, ref_cache = plain(model)
    for rollback in rollbacks(family):
        blocks, cache = run(model, draft, rollback=rollback)
        assert_exact(model, dtype, blocks, ref)
        ahead = [b for b in blocks if b.ahead]
        # Blocks without drafts took their row from a step queued ahead; after a gap, drafts went in a
        # forward of their own, and some of them were cut back.
        assert any(not b.drafted for b in ahead)
        assert any(b.drafted and b.rollback != "none" for b in ahead), rollback
        assert all(b.verify_len >= 1 + b.drafted for b in ahead)
        if tokens(blocks) == ref:
            tol = 1e-5 if dtype == "float32" else 0.0
            assert max_cache_diff(cache, ref_cache) <= tol


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_5"])
def test_off_and_timed_queue_nothing_and_agree(family):
    model, draft = target(family, "bfloat16"), noisy_drafter(family, "bfloat16")
    on, _ = run(model, draft)
    off, _ = run(model, draft, ahead=False)
    timed, _ = run(model, draft, timed=True)
    assert tokens(on) == tokens(off) == tokens(timed)
    assert not any(b.ahead for b in off + timed)
    assert [b.drafted for b in on] == [b.drafted for b in off]


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_5", "nemotron_h"])
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 7])
def test_max_tokens_right_after_a_gap(family, max_tokens):
    model, draft = target(family, "bfloat16"), noisy_drafter(family, "bfloat16")
    ref, ref_cache = plain(model, max_tokens=max_tokens)
    # No drafts at all: every block after the first is a step queued ahead; the limit lands after one.
    blocks, cache = run(model, draft, max_tokens=max_tokens, misses=(True,))
    assert tokens(blocks) == ref
    assert blocks[-1].finish_reason == "length"
    assert max_cache_diff(cache, ref_cache) == 0.0


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_5", "nemotron_h"])
def test_eos_after_a_queued_step(family):
    model, draft = target(family, "bfloat16"), noisy_drafter(family, "bfloat16")
    ref, _ = plain(model)
    pos = next(i for i in range(5, GEN) if ref[i] not in ref[:i])
    ref_eos, ref_cache = plain(model, eos_ids=(ref[pos],))
    for misses in ((True,), (True, False), (True, True, False)):
        blocks, cache = run(model, draft, eos_ids=(ref[pos],), misses=misses)
        assert tokens(blocks) == ref_eos == ref[:pos]
        assert blocks[-1].finish_reason == "stop"
        assert max_cache_diff(cache, ref_cache) == 0.0


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_closing_after_a_queued_step_leaves_plain_caches(family):
    model, draft = target(family, "bfloat16"), noisy_drafter(family, "bfloat16")
    cache = prefilled(model)
    drafter = ModelDrafter(draft)
    drafter.prefill(PROMPT[:-1])
    gen = speculative_generate_step(PROMPT[-1], cache, drafter, num_draft_tokens=0, max_tokens=GEN)
    out = list(next(gen).tokens) + list(next(gen).tokens)
    gen.close()
    _, direct = plain(model, max_tokens=len(out))
    assert max_cache_diff(cache, direct) == 0.0


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_5", "nemotron_h"])
@pytest.mark.parametrize("at_call", [3, 4, 5, 6, 7])
def test_interrupt_around_a_queued_step_resumes_exactly(family, at_call):
    # Drafting every second block, forwards alternate: a block's own, the step queued ahead, the
    # drafts' own after it: interrupting each of them in turn.
    model, draft = target(family, "bfloat16"), noisy_drafter(family, "bfloat16")
    ref, _ = plain(model)
    cache = prefilled(Interrupting(model, at_call))
    drafter = Gappy(draft, (True, False))
    drafter.prefill(PROMPT[:-1])
    out: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        for block in speculative_generate_step(PROMPT[-1], cache, drafter, num_draft_tokens=3, max_tokens=GEN):
            out += block.tokens
    _, direct = plain(model, max_tokens=max(len(out), 1))
    if out:
        assert max_cache_diff(cache, direct) == 0.0
    rest = speculative_generate_step(out[-1] if out else PROMPT[-1], cache, drafter, num_draft_tokens=3,
                                     max_tokens=GEN - len(out))
    assert out + tokens(list(rest)) == ref


@pytest.mark.parametrize("family,rollback", [("llama", "reforward"), ("gemma3_text", "reforward"),
                                             ("qwen3_5", "carry"), ("qwen3_5", "capture"),
                                             ("nemotron_h", "tape"), ("nemotron_h", "reforward")])
def test_replay_recomputes_blocks_fed_ahead(family, rollback):
    model, draft = target(family, "bfloat16"), noisy_drafter(family, "bfloat16")
    blocks, _ = run(model, draft, rollback=rollback)
    out = tokens(blocks)
    assert any(b.ahead and b.drafted for b in blocks)
    assert replay(model, PROMPT, out, blocks, len(out) - 1).mismatch is None


def test_verify_shapes_count_each_forward():
    model, draft = target("llama", "float32"), noisy_drafter("llama", "float32")
    blocks, _ = run(model, draft, misses=(True, False))
    stats = Stats()
    for b in blocks:
        stats.add(b, 0.0)
    forwards = sum(1 + (b.ahead and b.verify_len > 1) for b in blocks)
    assert sum(stats.verify_shapes.values()) == forwards > len(blocks)
    assert stats.verify_shapes[(1, 1)] >= sum(1 for b in blocks if b.ahead)
