"""Prompt lookup, early-stopping model drafts (p-min) and the adaptive draft length."""

from __future__ import annotations

import random

import pytest
from helpers import GEN, PROMPT, assert_exact, noisy_drafter, plain, prefilled, target, tokens

from specdec_cli.core.adaptive import AdaptiveLength, FixedLength
from specdec_cli.drafters import LookupDrafter, ModelDrafter
from specdec_cli.loop.engine import speculative_generate_step


def lookup_after(history: list[int], last: int, k: int, **kw) -> list[int]:
    d = LookupDrafter(**kw)
    d.prefill(history)
    return d.propose(last, k).tokens.tolist()


# --- prompt lookup -----------------------------------------------------------

def test_lookup_continues_the_latest_earlier_occurrence():
    #            a  b  c  X  a  b  c  Y  a  b | c
    history = [1, 2, 3, 10, 1, 2, 3, 11, 1, 2]
    assert lookup_after(history, 3, 4) == [11, 1, 2, 3]  # latest "1 2 3" is followed by 11
    assert lookup_after(history, 3, 2) == [11, 1]


def test_lookup_prefers_the_longest_matching_suffix():
    # "5 6" matches at two places; the 3-gram "4 5 6" only at the first.
    history = [4, 5, 6, 20, 21, 9, 5, 6, 30, 31, 4, 5]
    assert lookup_after(history, 6, 2, max_ngram=3, min_ngram=2) == [20, 21]
    assert lookup_after(history, 6, 2, max_ngram=2, min_ngram=2) == [30, 31]


def test_lookup_proposes_nothing_without_repeats():
    history = list(range(100, 160))
    assert lookup_after(history, 7, 5, max_ngram=4, min_ngram=1) == []
    # min_ngram 2 ignores single-token coincidences.
    assert lookup_after([1, 2, 3, 4, 5], 3, 3, min_ngram=2) == []
    # The continuation may run into the current suffix itself: 4 5 3.
    assert lookup_after([1, 2, 3, 4, 5], 3, 3, min_ngram=1) == [4, 5, 3]


def test_lookup_accept_extends_history_and_cancel_restores_the_index():
    d = LookupDrafter(max_ngram=2, min_ngram=1)
    d.prefill([1, 2, 3, 1, 2])
    assert d.propose(3, 3).tokens.tolist() == [1, 2, 3]
    d.accept(2)                      # history: 1 2 3 1 2 3 1 2
    assert d.history == [1, 2, 3, 1, 2, 3, 1, 2]
    assert d.propose(9, 2).size == 0  # "2 9" never seen, "9" never seen
    d.cancel()                       # 9 was never committed
    assert d.history == [1, 2, 3, 1, 2, 3, 1, 2]
    assert d.lookup(2) == [3, 1]     # latest "1 2" continues with 3


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3_text"])
def test_lookup_drafting_equals_plain_output(family):
    model = target(family, "bfloat16")
    ref, _ = plain(model)
    for k in (2, 5):
        cache = prefilled(model)
        drafter = LookupDrafter(max_ngram=3, min_ngram=1)
        drafter.prefill(PROMPT[:-1])
        blocks = list(speculative_generate_step(PROMPT[-1], cache, drafter, num_draft_tokens=k, max_tokens=GEN))
        assert_exact(model, "bfloat16", blocks, ref)
        assert sum(b.drafted for b in blocks) > 0  # the repetitive prompt gets proposals


def test_lookup_without_repeats_costs_plain_steps():
    model = target("llama", "float32")
    prompt = list(range(40, 100))  # no repeats, and min_ngram 3 ignores short coincidences
    ref, _ = plain(model, max_tokens=12, prompt=prompt)
    cache = prefilled(model, prompt)
    drafter = LookupDrafter(max_ngram=4, min_ngram=3)
    drafter.prefill(prompt[:-1])
    blocks = list(speculative_generate_step(prompt[-1], cache, drafter, num_draft_tokens=4, max_tokens=12))
    assert tokens(blocks) == ref
    first = blocks[:5]
    assert all(b.drafted == 0 and len(b.tokens) == 1 for b in first)


@pytest.mark.parametrize("min_ngram,max_ngram", [(1, 3), (2, 4), (3, 3), (3, 5)])
def test_lookup_may_draft_exactly_when_some_next_token_would_draft(min_ngram, max_ngram):
    # The engine queues a forward ahead only when may_draft is False: then no token may draft (sound), and when
    # it is True some token drafts (it does not keep a drafter that would find nothing off the pipelined path).
    rng = random.Random(min_ngram * 10 + max_ngram)
    alphabet = list(range(6))
    d = LookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
    said = {True: 0, False: 0}
    for i in range(300):
        token = rng.choice(alphabet) if i % 40 < 32 else 100 + i  # stretches of new tokens end most matches
        before = (list(d.history), {n: dict(t) for n, t in d._index.items()})
        may = d.may_draft(4)
        assert (d.history, d._index) == before
        drafts = []
        for t in sorted(set(d.history)) + [99]:  # every token that could continue a match, and a new one
            d.propose(t, 4)
            drafts.append(bool(d._proposed))
            d.cancel()
        assert may == any(drafts), (i, d.history[-6:])
        fresh = LookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
        fresh.prefill(d.history)
        assert d._index == fresh._index  # every cancel restored the tables may_draft reads, as built from scratch
        said[may] += 1
        assert not d.may_draft(0)
        d.propose(token, 4)
        d.accept(0)
    assert said[True] > 20 and (said[False] > 20 or min_ngram == 1)  # (one token matches whatever came before)


# --- p-min ---------------------------------------------------------------------

def test_p_min_stops_drafting_early_and_output_stays_identical():
    model, draft = target("qwen3_5", "float32"), noisy_drafter("qwen3_5", "float32")
    ref, _ = plain(model)
    runs = {}
    # Random weights give flat distributions: top-1 probabilities of this
    # drafter range over ~0.012-0.020, so 0.015 stops about half the drafts.
    for p_min in (0.0, 0.015, 1.01):
        cache = prefilled(model)
        drafter = ModelDrafter(draft, p_min=p_min)
        drafter.prefill(PROMPT[:-1])
        blocks = list(speculative_generate_step(PROMPT[-1], cache, drafter, num_draft_tokens=4, max_tokens=GEN))
        assert_exact(model, "float32", blocks, ref)
        runs[p_min] = blocks
    emitted = 0
    for b in runs[0.0]:
        assert b.drafted == min(4, GEN - emitted - 1)  # never stops early
        emitted += len(b.tokens)
    some = [b.drafted for b in runs[0.015]]
    assert any(d < 4 for d in some) and any(d > 0 for d in some)
    assert all(b.drafted == 0 for b in runs[1.01])  # no probability exceeds 1
    # Early stopping reads each draft's probability: one sync per draft step.
    assert all(b.syncs == 1 + min(b.drafted + 1, 4) for b in runs[0.015][:-1])


# --- adaptive draft length -------------------------------------------------------

def test_fixed_length_is_the_default_policy():
    assert FixedLength(3).next_k() == 3


def test_adaptive_length_grows_after_full_accepts_and_shrinks_after_rejections():
    p = AdaptiveLength(k_max=6, window=1000)
    seen = []
    # (drafted, accepted) per block: reject early, then accept everything.
    for drafted_accepted in [(6, 1), (2, 0), (1, 1), (2, 2), (3, 3), (4, 2), (3, 3)]:
        k = p.next_k()
        seen.append(k)
        assert drafted_accepted[0] == k
        p.observe(*drafted_accepted, emitted=drafted_accepted[1] + 1, seconds=0.01)
    assert seen == [6, 2, 1, 2, 3, 4, 3]
    assert p.next_k() == 4
    # Never above k_max.
    for _ in range(10):
        k = p.next_k()
        p.observe(k, k, k + 1, 0.01)
    assert p.next_k() == 6


def test_adaptive_switches_off_when_slower_than_plain_then_probes_again():
    p = AdaptiveLength(k_max=4, window=4, probe=3, cooldown=5, warmup=0)
    # Speculation: 2 tokens per 0.20 s = 10 tok/s.
    for _ in range(4):
        p.observe(p.next_k(), 1, 2, 0.20)
    assert p.mode == "measure"
    # Plain: 1 token per 0.05 s = 20 tok/s.
    for _ in range(3):
        assert p.next_k() == 0
        p.observe(0, 0, 1, 0.05)
    assert p.mode == "off" and p.switched_off == 1
    for _ in range(5):
        assert p.next_k() == 0
        p.observe(0, 0, 1, 0.05)
    assert p.mode == "speculate" and p.next_k() > 0   # probing again
    for _ in range(4):
        p.observe(p.next_k(), 1, 2, 0.20)
    assert p.mode == "off" and p.switched_off == 2
    assert p.cooldown == 20                             # 5 -> 10 (after 1st) -> 20 (after 2nd)
    for _ in range(10):
        p.observe(0, 0, 1, 0.05)
    # Now speculation wins (3 tokens per 0.06 s = 50 tok/s): it stays on.
    for _ in range(4):
        k = p.next_k()
        p.observe(k, k, k + 1, 0.06)
    assert p.mode == "speculate" and p.cooldown == 5
    summary = p.summary()
    assert summary["switched_off"] == 2 and summary["plain_blocks"] == 18


def test_adaptive_switches_off_after_half_a_window_without_accepts():
    # No draft accepted: each block yields one token, as a plain step does,
    # for more work. No plain-speed probe is needed to know it loses.
    p = AdaptiveLength(k_max=4, window=8, cooldown=5, warmup=0)
    for _ in range(3):
        p.observe(p.next_k(), 0, 1, 0.01)
    assert p.mode == "speculate" and p.next_k() == 1  # shrunk to one draft
    p.observe(p.next_k(), 0, 1, 0.01)
    assert p.mode == "off" and p.switched_off == 1 and p.plain_blocks == 0
    # One accept in the window is enough to wait for the speed comparison.
    q = AdaptiveLength(k_max=4, window=8, warmup=0)
    for accepted in (1, 0, 0, 0, 0, 0, 0):
        q.observe(q.next_k(), accepted, accepted + 1, 0.01)
    assert q.mode == "speculate"


def test_adaptive_warmup_blocks_are_not_timed():
    p = AdaptiveLength(k_max=3, window=2, warmup=2)
    for seconds in (5.0, 5.0, 0.01, 0.01):
        p.observe(p.next_k(), 3, 4, seconds)
    assert p.mode == "measure"
    assert p._spec == [(4, 0.01), (4, 0.01)]  # only the two timed blocks count


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_adaptive_run_is_identical_and_varies_its_block_size(family):
    model, draft = target(family, "bfloat16"), noisy_drafter(family, "bfloat16")
    ref, _ = plain(model)
    cache = prefilled(model)
    drafter = ModelDrafter(draft)
    drafter.prefill(PROMPT[:-1])
    policy = AdaptiveLength(k_max=6, window=10_000)
    blocks = list(speculative_generate_step(PROMPT[-1], cache, drafter, policy=policy, max_tokens=GEN))
    assert tokens(blocks) == ref
    sizes = [b.drafted for b in blocks[:-1]]
    assert len(set(sizes)) >= 3, sizes
    assert any(b < a for a, b in zip(sizes, sizes[1:]))   # shrank
    assert any(b > a for a, b in zip(sizes, sizes[1:]))   # grew
