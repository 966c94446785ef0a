"""Speculative sampling is lossless: emitted tokens follow the target's distribution.

A tiny model with a 16-token vocabulary lets us compute the target's exact
marginal distribution of each of the first three generated tokens (by
enumerating all 16 + 256 prefixes). Many seeded runs of speculative sampling
are then held against it with a chi-square goodness-of-fit test per position.

Tolerance: bins with expected count < 5 are pooled; the critical value is the
chi-square quantile at 1 - 1e-4 for the remaining degrees of freedom (so a
correct sampler fails a given check with probability 1e-4, whatever the number
of samples; the seeds are fixed, so the outcome is deterministic). The test has
teeth: a lossy shortcut that keeps every draft (what a sampler without the
residual correction tends to) scores chi-square ~140 against a critical value of
~45 on the same 1,000 draws (~185 on 1,500), and ~310 against ~26 with top-p/top-k.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import pytest

import specdec_cli.loop.engine as engine
from specdec_cli.cache.caches import ModelCache
from specdec_cli.drafters import LookupDrafter, ModelDrafter
from specdec_cli.loop.engine import speculative_generate_step
from specdec_cli.loop.plain import plain_generate_step
from specdec_cli.core.sampling import SamplingParams, log_probs
from specdec_cli.session.synthetic import TINY_CONFIGS, build_model, perturb

VOCAB = 16
CONFIG = {**TINY_CONFIGS["llama"], "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64}
# Repeats, so the lookup drafter proposes (suffix "2 3" continues with "4 1 2").
PROMPT = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
POSITIONS = 3
# Power: the lossy shortcut (test below) scores chi2 ~140 on 1,000 draws against a critical value of 44.6
# (noncentrality ~113: on any seed a miss is about as unlikely, ~1e-4, as a false alarm).
SAMPLES = 1000
PLAIN = SamplingParams(temp=1.0)
FILTERED = SamplingParams(temp=0.8, top_p=0.85, top_k=6)


@functools.cache
def models():
    target = build_model(CONFIG, seed=0)
    # Heavy noise: the drafter disagrees often, so the residual path runs.
    draft = build_model(CONFIG, seed=0)
    perturb(draft, 0.5, seed=5)
    return target, draft


def _prefilled(model) -> tuple[ModelCache, object]:
    cache = ModelCache(model)
    cache.prefill(PROMPT[:-1])
    return cache, cache.snapshot()


@functools.cache
def exact_marginals(params: SamplingParams) -> list[list[float]]:
    """P(token at position i = v) for i = 1..3, by enumerating prefixes."""
    target, _ = models()
    cache, snap = _prefilled(target)

    def dist(prefix: list[int]) -> list[float]:
        cache.restore(snap)
        ids = mx.array([PROMPT[-1], *prefix], dtype=mx.uint32)
        return mx.exp(log_probs(cache.feed(ids)[-1:], params))[0].tolist()

    marg = [[0.0] * VOCAB for _ in range(POSITIONS)]
    p1 = dist([])
    for a in range(VOCAB):
        marg[0][a] = p1[a]
        if p1[a] == 0:
            continue
        p2 = dist([a])
        for b in range(VOCAB):
            w = p1[a] * p2[b]
            marg[1][b] += w
            if w == 0:
                continue
            p3 = dist([a, b])
            for c in range(VOCAB):
                marg[2][c] += w * p3[c]
    return marg


def _blocks(kind: str, sampling: SamplingParams, k: int, target, draft):
    """One run from the prefilled caches: plain decoding, or speculative with a draft model or lookup.

    ``target`` is (cache, snapshot); ``draft`` is (model, cache, snapshot).
    """
    cache, snap = target
    cache.restore(snap)
    if kind == "plain":
        return plain_generate_step(PROMPT[-1], cache, max_tokens=POSITIONS, sampling=sampling)
    if kind == "model":
        model, dcache, dsnap = draft
        dcache.restore(dsnap)
        drafter = ModelDrafter(model, cache=dcache)
    else:
        drafter = LookupDrafter(max_ngram=3, min_ngram=1)
        drafter.prefill(PROMPT[:-1])
    return speculative_generate_step(PROMPT[-1], cache, drafter, num_draft_tokens=k, max_tokens=POSITIONS,
                                     sampling=sampling)


def draw(kind: str, params: SamplingParams, samples: int = SAMPLES, seed: int = 0):
    """First three tokens of ``samples`` seeded runs; also the acceptance seen."""
    target, draft = models()
    cache, snap = _prefilled(target)
    dcache, dsnap = _prefilled(draft)
    mx.random.seed(seed)
    counts = [[0] * VOCAB for _ in range(POSITIONS)]
    drafted = accepted = 0
    for _ in range(samples):
        blocks = _blocks(kind, params, 3, (cache, snap), (draft, dcache, dsnap))
        out = []
        for b in blocks:
            out += b.tokens
            drafted, accepted = drafted + b.drafted, accepted + b.accepted
        for i, tok in enumerate(out):
            counts[i][tok] += 1
    return counts, (accepted, drafted)


def chi_square(observed: list[int], expected_p: list[float]) -> tuple[float, float]:
    """Chi-square statistic and its 1 - 1e-4 critical value (pooling small bins)."""
    n = sum(observed)
    stat, pooled_o, pooled_e, bins = 0.0, 0, 0.0, 0
    for o, p in zip(observed, expected_p):
        e = n * p
        if e < 5:
            pooled_o, pooled_e = pooled_o + o, pooled_e + e
            continue
        stat += (o - e) ** 2 / e
        bins += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / max(pooled_e, 1e-12)
        bins += 1
    df = max(bins - 1, 1)
    z = 3.719  # standard normal quantile at 1 - 1e-4
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3  # Wilson-Hilferty
    return stat, critical


@pytest.mark.parametrize("kind", ["plain", "model", "lookup"])
@pytest.mark.parametrize("params", [PLAIN, FILTERED], ids=["temp1", "top_p+top_k"])
def test_sampled_tokens_follow_the_target_distribution(kind, params):
    counts, (accepted, drafted) = draw(kind, params)
    if kind != "plain":
        # Both branches of the rejection sampler ran, many times.
        assert accepted >= 50 and drafted - accepted >= 50, (accepted, drafted)
    exact = exact_marginals(params)
    for pos in range(POSITIONS):
        stat, critical = chi_square(counts[pos], exact[pos])
        assert stat < critical, f"position {pos + 1}: chi2 {stat:.1f} >= {critical:.1f}"


def test_a_lossy_shortcut_fails_the_same_check(monkeypatch):
    # Keep every draft and sample the bonus from the target: the output then
    # follows the drafter at the drafted positions. The check must see it.
    real = engine.accept_sampled

    def keep_everything(logits, drafts, draft_logprobs, params):
        _, bonus = real(logits[-1:], drafts[:0], None, params)
        return mx.array(drafts.shape[0]), bonus

    monkeypatch.setattr(engine, "accept_sampled", keep_everything)
    counts, _ = draw("model", PLAIN)
    exact = exact_marginals(PLAIN)
    scores = [chi_square(counts[p], exact[p]) for p in range(POSITIONS)]
    # Measured on SAMPLES = 1,000 draws: chi2 ~140 and ~92 against a critical value of ~45.
    assert any(stat > 2 * critical for stat, critical in scores), scores


def test_seed_makes_a_sampled_run_reproducible():
    a, _ = draw("model", FILTERED, samples=20, seed=7)
    b, _ = draw("model", FILTERED, samples=20, seed=7)
    c, _ = draw("model", FILTERED, samples=20, seed=8)
    assert a == b and a != c


def test_greedy_drafter_with_one_hot_q_is_lossless_too():
    # A deterministic model drafter at temp > 0: q one-hot at its greedy token.
    target, draft = models()
    cache, snap = _prefilled(target)
    dcache, dsnap = _prefilled(draft)

    class GreedyDrafter(ModelDrafter):
        def propose(self, last, k, params):
            d = super().propose(last, k, SamplingParams())
            return d  # logprobs None: the engine treats q as one-hot

    mx.random.seed(3)
    counts = [0] * VOCAB
    for _ in range(SAMPLES):
        cache.restore(snap)
        dcache.restore(dsnap)
        gen = speculative_generate_step(PROMPT[-1], cache, GreedyDrafter(draft, cache=dcache),
                                        num_draft_tokens=3, max_tokens=2, sampling=PLAIN)
        out = [t for b in gen for t in b.tokens]
        counts[out[1]] += 1
    stat, critical = chi_square(counts, exact_marginals(PLAIN)[1])
    assert stat < critical


# --- draws keyed by position (--seed) ------------------------------------------------------

def test_keyed_draws_follow_the_distribution():
    # Gumbel-max with the position noise: one draw per position, 20,000 positions, one seed.
    from specdec_cli.core.sampling import keyed_pick

    p = [0.4, 0.3, 0.15, 0.1, 0.04, 0.01, 0.0, 0.0]
    logp = mx.log(mx.array(p))[None, :]
    for seed in (0, 12345):
        n = 20000
        picks = keyed_pick(mx.broadcast_to(logp, (n, len(p))), SamplingParams(temp=1.0, seed=seed)).tolist()
        counts = [picks.count(v) for v in range(len(p))]
        assert counts[6] == counts[7] == 0  # zero probability: never drawn
        stat, critical = chi_square(counts, p)
        assert stat < critical, (seed, counts, stat, critical)


def draw_keyed(kind: str, params: SamplingParams, samples: int = SAMPLES, k: int = 3):
    """Like ``draw``, one seed per run (the runs are then independent samples)."""
    target, draft = models()
    cache, snap = _prefilled(target)
    dcache, dsnap = _prefilled(draft)
    counts = [[0] * VOCAB for _ in range(POSITIONS)]
    texts, drafted, accepted = [], 0, 0
    for seed in range(samples):
        seeded = SamplingParams(params.temp, params.top_p, params.top_k, params.min_p, seed=seed)
        blocks = _blocks(kind, seeded, k, (cache, snap), (draft, dcache, dsnap))
        out = []
        for b in blocks:
            out += b.tokens
            drafted, accepted = drafted + b.drafted, accepted + b.accepted
        texts.append(out)
        for i, tok in enumerate(out):
            counts[i][tok] += 1
    return counts, texts, (accepted, drafted)


def test_seeded_speculative_sampling_follows_the_target_distribution():
    # (Seeded plain decoding prints the same texts: the next test.)
    counts, _, (accepted, drafted) = draw_keyed("model", FILTERED)
    assert accepted >= 50 and drafted - accepted >= 50, (accepted, drafted)
    exact = exact_marginals(FILTERED)
    for pos in range(POSITIONS):
        stat, critical = chi_square(counts[pos], exact[pos])
        assert stat < critical, f"position {pos + 1}: chi2 {stat:.1f} >= {critical:.1f}"


def test_a_seed_gives_plain_decodings_text_whatever_the_drafter_and_draft_length():
    # Same seeds, three ways: each run's text is the same token for token.
    _, plain_texts, _ = draw_keyed("plain", PLAIN, samples=60)
    for kind, k in (("model", 1), ("model", 3), ("lookup", 2)):
        _, texts, (accepted, _) = draw_keyed(kind, PLAIN, samples=60, k=k)
        assert texts == plain_texts, (kind, k)
        assert accepted > 0, (kind, k)


# --- no request can leave the random state broken (issue 33, 1) ---------------------------------------

def test_a_top_k_at_or_over_the_vocabulary_keeps_every_token_and_the_random_state_works():
    logits = mx.random.normal((3, VOCAB), key=mx.random.key(0))
    unfiltered = log_probs(logits, SamplingParams(temp=0.7))
    for top_k in (VOCAB, VOCAB + 1, 10**12):
        assert mx.array_equal(log_probs(logits, SamplingParams(temp=0.7, top_k=top_k)), unfiltered).item()
    assert not mx.array_equal(log_probs(logits, SamplingParams(temp=0.7, top_k=3)), unfiltered).item()
    # mlx-lm compiles its filters with the random state as an input and output: one that raised
    # mid-trace (top_k == vocabulary) left a placeholder there, and every later draw failed.
    mx.eval(mx.random.uniform(shape=(2,)))


def test_no_filter_is_compiled_with_the_random_state():
    """The mechanism of issue 33, 1: nothing in specdec compiles a function over ``mx.random.state``."""
    import pathlib

    import specdec_cli

    root = pathlib.Path(specdec_cli.__file__).parent
    for path in root.rglob("*.py"):
        source = path.read_text()
        assert "mlx_lm.sample_utils import apply_" not in source, path
        assert "outputs=mx.random.state" not in source, path


@pytest.mark.parametrize("kind", ["plain", "model", "lookup"])
def test_a_top_p_below_float32s_smallest_value_keeps_the_likeliest_token(kind):
    # top_p * mass rounds to 0: without a floor every token was dropped and the draws were garbage. Only the
    # likeliest token is left, so plain decoding and verification both give greedy decoding's tokens.
    tiny = SamplingParams(temp=1.0, top_p=1e-46)
    x = log_probs(mx.array([[1.0, 3.0, 2.0, 0.5]]), tiny)
    assert x[0].tolist() == [-math.inf, 0.0, -math.inf, -math.inf]
    target, draft = models()
    cache, snap = _prefilled(target)
    dcache, dsnap = _prefilled(draft)

    def tokens(params: SamplingParams) -> list[int]:
        return [t for b in _blocks(kind, params, 3, (cache, snap), (draft, dcache, dsnap)) for t in b.tokens]

    expected = tokens(SamplingParams())
    for seed in (None, 1, 2):
        mx.random.seed(seed or 0)
        assert tokens(SamplingParams(temp=1.0, top_p=1e-46, seed=seed)) == expected, seed
