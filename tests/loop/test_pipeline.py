"""Blocks without drafts pipelined (``Numerics.pipeline``): the next forward queued before the token is read back.

On by default where the device computes apart from the host (a GPU); these tests turn it on here. A single row's
block that drafted nothing feeds its own token to the target before reading it, as plain decoding (mlx-lm's
``generate_step``) does, when its drafter says the next block drafts nothing either; a drafter that says so wrongly
(``Gappy`` by default) has its drafts verified after that forward. Invariants: the text is plain decoding's, every
block decides as it does unpipelined (with a drafter that tells, in the same bits on every backend), and whatever
ends the run (EOS, max tokens, an interrupt, a row joining) leaves the caches plain decoding leaves.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import (
    FAMILIES,
    GEN,
    PROMPT,
    Interrupting,
    assert_alone_or_tie,
    assert_cache_built_by,
    assert_exact,
    kernels_agree,
    plain,
    prefilled,
    target,
    tokens,
)

from specdec_cli.core.adaptive import AdaptiveLength, FixedLength, MatchLength
from specdec_cli.core.numerics import Numerics
from specdec_cli.core.processors import Penalties
from specdec_cli.core.sampling import GREEDY, SamplingParams
from specdec_cli.drafters import Draft, NgramDrafter, no_draft
from specdec_cli.drafters.suffix import SuffixDrafter
from specdec_cli.loop import engine as engine_module
from specdec_cli.loop.compare import replay
from specdec_cli.loop.engine import Engine, Row, speculative_generate_step
from specdec_cli.loop.plain import plain_generate_step

RECURRENT = ("qwen3_5", "nemotron_h")
ON, OFF = Numerics(pipeline=True), Numerics(pipeline=False)


class Gappy:
    """A host drafter that knows the answer: in every other stretch of four tokens it drafts what comes next (one
    token of it wrong now and then, in every other stretch's first block too: partial accepts), in the others
    nothing (blocks whose next forward is queued ahead); drafting resumes a token after a queued forward, and stops
    a token after drafts.

    ``honest``: it says when its next block drafts (``may_draft``), so no forward is queued ahead of drafts;
    otherwise it always says it will not, and its drafts are verified after a queued forward (the path a drafter
    that cannot tell, or ``engine.PIPELINE_ALWAYS``, takes)."""

    name = "gappy"
    taps = None

    def __init__(self, answer: list[int], honest: bool = False):
        self.answer, self.emitted, self.honest = answer, 0, honest

    def may_draft(self, k: int) -> bool:
        e = self.emitted + 1  # the block asking drafted nothing: one token
        return self.honest and k > 0 and (e // 4) % 2 == 0 and e < len(self.answer)

    def prefill(self, tokens, step_size=512, hidden=None) -> None:
        pass

    def propose(self, last: int, k: int, params: SamplingParams = GREEDY) -> Draft:
        e = self.emitted
        drafts = list(self.answer[e:e + k]) if k and (e // 4) % 2 == 0 else []
        if drafts and (e % 3 == 0 or (e // 4) % 4 == 0):
            i = (e // 8) % len(drafts)
            drafts[i] = drafts[i] - 1 if drafts[i] else 1
        return Draft(mx.array(drafts, dtype=mx.uint32), host=tuple(drafts)) if drafts else no_draft()

    def accept(self, n: int, hidden=None) -> None:
        self.emitted += n + 1

    def cancel(self) -> None:
        pass


def gappy_run(model, ref, *, k=4, max_tokens=GEN, eos_ids=(), rollback="reforward", numerics=ON, drafter=None,
              **kw):
    """A run of ``drafter`` (a ``Gappy`` of ``ref`` unless given) on the prompt, with its blocks and caches; ``k``
    drafts a block unless a ``policy`` is given."""
    cache = prefilled(model)
    blocks = list(speculative_generate_step(PROMPT[-1], cache, drafter or Gappy(ref), num_draft_tokens=k,
                                            max_tokens=max_tokens, eos_ids=eos_ids, rollback=rollback,
                                            numerics=numerics, **kw))
    return blocks, cache


def tolerance(dtype: str) -> float:
    if not kernels_agree(dtype):
        return 1e-3 if dtype == "float32" else 2**-4
    return 1e-5 if dtype == "float32" else 0.0


CASES = [(f, d, r) for f in FAMILIES for d in ("float32", "bfloat16")
         for r in (("carry", "reforward", "capture") if f in RECURRENT else ("reforward",))]


@pytest.mark.parametrize("family,dtype,rollback", CASES)
def test_pipelined_blocks_give_plain_decodings_text_and_caches(family, dtype, rollback):
    model = target(family, dtype)
    ref, _ = plain(model)
    blocks, cache = gappy_run(model, ref, rollback=rollback)
    assert_exact(model, dtype, blocks, ref)
    assert any(b.ahead and not b.drafted for b in blocks)
    if tokens(blocks) == ref:  # (after a rounding tie the drafter's answer is another text's: few accepts)
        # Every transition happened: queued forwards with nothing drafted, drafts verified after a queued
        # forward (some rejected), and blocks after drafts with no forward queued.
        assert any(b.ahead and b.drafted and 0 < b.accepted < b.drafted for b in blocks)
        assert any(b.ahead and b.drafted and b.accepted == 0 for b in blocks)
        assert any(b.ahead and b.drafted and b.accepted == b.drafted for b in blocks)
        assert any(not b.ahead and b.drafted and b.accepted < b.drafted for b in blocks)
        assert any(not b.ahead for b in blocks[1:])
    assert_cache_built_by(model, PROMPT, tokens(blocks), cache, dtype, tolerance(dtype))


@pytest.mark.parametrize("family,rollback", [("llama", "reforward"), ("gemma3_text", "reforward"),
                                             ("qwen3_5", "carry"), ("nemotron_h", "capture")])
def test_every_block_decides_as_it_does_unpipelined(family, rollback):
    model = target(family, "float32")
    ref, _ = plain(model)
    on, _ = gappy_run(model, ref, rollback=rollback)
    off, _ = gappy_run(model, ref, rollback=rollback, numerics=OFF)
    assert not any(b.ahead for b in off) and any(b.ahead for b in on)
    if kernels_agree("float32"):
        assert [(b.tokens, b.drafted, b.accepted) for b in on] == [(b.tokens, b.drafted, b.accepted) for b in off]
    else:  # a queued one-token forward and a verify round apart: each is plain decoding's text up to a tie
        assert_exact(model, "float32", on, ref)
        assert_exact(model, "float32", off, ref)


@pytest.mark.parametrize("family,rollback", [("llama", "reforward"), ("gemma3_text", "reforward"),
                                             ("qwen3_5", "carry"), ("nemotron_h", "capture")])
def test_a_drafter_that_tells_queues_only_forwards_its_next_block_would_run_so_the_bits_are_unpipelineds(
        family, rollback):
    # Its next block drafts nothing whenever one is queued: the same forwards of the same widths as unpipelined,
    # so the same numbers on a backend that rounds by shape too (the gpu-like one here), not just up to a tie.
    model = target(family, "bfloat16")
    ref, _ = plain(model)
    (on, on_cache), (off, off_cache) = (gappy_run(model, ref, rollback=rollback, numerics=numerics,
                                                  drafter=Gappy(ref, honest=True)) for numerics in (ON, OFF))
    assert any(b.ahead for b in on) and not any(b.ahead and b.drafted for b in on)
    assert any(b.drafted for b in on)
    assert [(b.tokens, b.drafted, b.accepted) for b in on] == [(b.tokens, b.drafted, b.accepted) for b in off]
    assert_exact(model, "bfloat16", on, ref)
    assert on_cache.length == off_cache.length
    for a, b in zip(on_cache.state_arrays(), off_cache.state_arrays()):
        assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("max_tokens", range(GEN - 9, GEN + 1))
def test_a_drafter_that_tells_is_asked_for_what_the_next_block_may_draft_up_to_the_last_token(max_tokens):
    # Near the end the next block may draft fewer tokens than the policy allows, down to none: the drafter is asked
    # for that many, so a forward is queued ahead of the last blocks exactly when they draft nothing.
    model = target("llama", "float32")
    ref, _ = plain(model)
    blocks, _ = gappy_run(model, ref, max_tokens=max_tokens, drafter=Gappy(ref, honest=True))
    assert not any(b.ahead and b.drafted for b in blocks)
    assert blocks[-1].ahead or blocks[-1].drafted or len(blocks) < 2 or blocks[-2].drafted
    assert_exact(model, "float32", blocks, ref[:max_tokens])


class Wrong(Gappy):
    """Drafts every token wrong and cannot tell whether its next block drafts: only its policy, switched off, can."""

    may_draft = None

    def propose(self, last: int, k: int, params: SamplingParams = GREEDY) -> Draft:
        drafts = [t + 1 for t in self.answer[self.emitted:self.emitted + k]]
        return Draft(mx.array(drafts, dtype=mx.uint32), host=tuple(drafts)) if drafts else no_draft()


def test_a_policy_switched_off_queues_forwards_ahead_for_a_drafter_that_cannot_tell():
    # Nothing is accepted, so the policy switches speculation off for a while (by acceptance, not by the clock): its
    # plain blocks are queued ahead until the block before it drafts again, never ahead of that one.
    model = target("llama", "float32")
    ref, _ = plain(model, max_tokens=96)
    policy = AdaptiveLength(k_max=4, window=4, cooldown=8)
    blocks, _ = gappy_run(model, ref, max_tokens=96, drafter=Wrong(ref), policy=policy)
    assert policy.switched_off >= 2
    assert sum(b.ahead for b in blocks) >= 8 and not any(b.ahead and b.drafted for b in blocks)
    assert tokens(blocks) == ref


@pytest.mark.parametrize("kind", ["lookup", "ngram"])
def test_prompt_lookup_never_queues_a_forward_ahead_of_its_own_drafts(kind):
    # Prompt lookup says when its next block could draft (the default sized by its match-length policy, n-grams
    # by whether the last n-1 tokens occurred before): on a text that repeats now and then, blocks are queued
    # ahead and drafts verified, never one after the other.
    model = target("llama", "float32")
    ref, _ = plain(model, max_tokens=96)
    if kind == "lookup":
        policy = MatchLength(k_max=8)
        drafter = SuffixDrafter(policy.size, history=[ref[10:40], ref[60:80]])
        drafter.prefill(PROMPT[:-1])
    else:
        policy = None
        drafter = NgramDrafter(max_ngram=4, min_ngram=2)
        drafter.prefill(ref[10:40] + ref[60:80] + PROMPT[:-1])
    blocks, _ = gappy_run(model, ref, max_tokens=96, drafter=drafter, policy=policy)
    assert any(b.ahead for b in blocks) and any(b.drafted for b in blocks)
    assert not any(b.ahead and b.drafted for b in blocks)
    assert_exact(model, "float32", blocks, ref)


def test_the_device_decides_unless_a_benchmark_forces_it(monkeypatch):
    # A CPU is its own device: nothing to overlap, so no queued forwards by default; a GPU (CUDA too) queues them.
    assert Numerics.resolve("auto").pipeline is (mx.default_device() != mx.cpu)
    monkeypatch.setattr("specdec_cli.core.numerics.apart", lambda: True)
    assert Numerics.resolve("auto").pipeline is True
    model = target("llama", "float32")
    ref, _ = plain(model)
    auto, _ = gappy_run(model, ref, numerics=Numerics.resolve("exact", compiles=False))
    monkeypatch.setattr(engine_module, "PIPELINE", False)
    forced_off, _ = gappy_run(model, ref)
    monkeypatch.setattr(engine_module, "PIPELINE", True)
    forced_on, _ = gappy_run(model, ref, numerics=OFF)
    assert any(b.ahead for b in auto) and not any(b.ahead for b in forced_off) and any(b.ahead for b in forced_on)
    assert tokens(auto) == tokens(forced_off) == tokens(forced_on) == ref


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_between_blocks_the_queued_forward_leads_the_cache_by_the_last_token(family):
    model = target(family, "float32")
    ref, _ = plain(model)
    cache = prefilled(model)
    out, leads = [], []
    gen = speculative_generate_step(PROMPT[-1], cache, Gappy(ref), num_draft_tokens=4, max_tokens=GEN,
                                    rollback="reforward", numerics=ON)
    for block in gen:
        out += block.tokens
        if block.finish_reason is None:
            # Prompt + every emitted token but the last is plain decoding's cache; a queued forward holds the last.
            leads.append((block.drafted, cache.length - (len(PROMPT) + len(out) - 1)))
    assert {lead for drafted, lead in leads if drafted == 0} == {1}
    assert {lead for drafted, lead in leads if drafted} == {0}
    assert_cache_built_by(model, PROMPT, out, cache, "float32", 1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_5", "nemotron_h"])
def test_eos_and_max_tokens_right_after_a_queued_forward_leave_plain_decodings_cache(family):
    model = target(family, "bfloat16")
    ref, _ = plain(model)
    blocks, _ = gappy_run(model, ref)
    # Ends where the block before was one that queued a forward (nothing drafted).
    ends, at = [], 0
    for b in blocks:
        at += len(b.tokens)
        if not b.drafted and at < GEN - 1:
            ends.append(at + 1)
    assert ends
    for max_tokens in ends[:4]:
        out, cache = gappy_run(model, ref, max_tokens=max_tokens)
        assert_exact(model, "bfloat16", out, ref[:max_tokens])
        assert_cache_built_by(model, PROMPT, tokens(out), cache, "bfloat16", tolerance("bfloat16"))
    pos = next(i for i in ends if ref[i - 1] not in ref[: i - 1])
    eos = ref[pos - 1]
    out, cache = gappy_run(model, ref, eos_ids=(eos,))
    assert_exact(model, "bfloat16", out, ref[: pos - 1], eos_ids=(eos,))
    if tokens(out) == ref[: pos - 1]:  # (a text parted at a rounding tie may never meet that EOS)
        assert out[-1].finish_reason == "stop"
    assert_cache_built_by(model, PROMPT, tokens(out), cache, "bfloat16", tolerance("bfloat16"),
                          stopped=out[-1].finish_reason == "stop")


@pytest.mark.parametrize("family,rollback", [("llama", "reforward"), ("qwen3_5", "carry"),
                                             ("nemotron_h", "capture")])
@pytest.mark.parametrize("at_call", [5, 8, 11, 14, 17])
def test_an_interrupt_around_a_queued_forward_restores_the_caches_and_resumes_exactly(family, rollback, at_call):
    model = target(family, "bfloat16")
    ref, _ = plain(model)
    cache = prefilled(Interrupting(model, at_call=at_call))
    drafter = Gappy(ref)
    out: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        for block in speculative_generate_step(PROMPT[-1], cache, drafter, num_draft_tokens=4, max_tokens=GEN,
                                               rollback=rollback, numerics=ON):
            out += block.tokens
    assert 0 < len(out) < GEN and drafter.emitted == len(out)
    assert_cache_built_by(model, PROMPT, out, cache, "bfloat16", tolerance("bfloat16"))
    rest = speculative_generate_step(out[-1], cache, drafter, num_draft_tokens=4, max_tokens=GEN - len(out),
                                     rollback=rollback, numerics=ON)
    assert_alone_or_tie(model, "bfloat16", out + tokens(list(rest)), ref, PROMPT)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_row_joining_one_whose_forward_is_queued_decodes_both_as_alone(family):
    model = target(family, "float32")
    prompts = [PROMPT, PROMPT[5:] + PROMPT[:5]]
    refs = [plain(model, prompt=p)[0] for p in prompts]
    engine = Engine(model, rollback="capture", numerics=ON)
    rows = [engine.admit(Row(prompts[0][-1], Gappy(refs[0]), FixedLength(4), max_tokens=GEN, tag=0),
                         prefilled(model, prompts[0]))]
    out = {0: [], 1: []}
    while engine._ahead is None:  # a block that drafted nothing: its next forward is queued
        out[0] += engine.step()[0][1].tokens
    rows.append(engine.admit(Row(prompts[1][-1], Gappy(refs[1]), FixedLength(4), max_tokens=GEN, tag=1),
                             prefilled(model, prompts[1])))
    assert engine._ahead is None
    caches = {}
    while engine.rows:
        for row, block in engine.step():
            out[row.tag] += block.tokens
        for row in list(engine.rows):
            if row.finish is not None or row.room <= 0:
                caches[row.tag] = engine.remove(row)
    for i, p in enumerate(prompts):
        assert_alone_or_tie(model, "float32", out[i], refs[i], p)
        assert_cache_built_by(model, p, out[i], caches[i], "float32", 1e-5)


def test_seeded_sampling_logprobs_and_penalties_are_plain_decodings_through_queued_forwards():
    if not kernels_agree("float32"):
        pytest.skip("bit identity of sampled tokens and log-probabilities: where kernels agree (the replay cannot "
                    "prove a tie through a repetition penalty)")
    model = target("llama", "float32")
    sampling = SamplingParams(temp=0.9, top_k=20, seed=7)

    def procs():
        return (Penalties(PROMPT, repetition_penalty=1.3),)

    cache = prefilled(model)
    ref_blocks = list(plain_generate_step(PROMPT[-1], cache, max_tokens=GEN, sampling=sampling, processors=procs(),
                                          logprobs=2))
    ref = tokens(ref_blocks)
    cache = prefilled(model)
    blocks = list(speculative_generate_step(PROMPT[-1], cache, Gappy(ref), num_draft_tokens=4, max_tokens=GEN,
                                            sampling=sampling, processors=procs(), logprobs=2, numerics=ON))
    assert tokens(blocks) == ref and any(b.ahead for b in blocks)
    got = [e for b in blocks for e in b.logprobs]
    want = [e for b in ref_blocks for e in b.logprobs]
    assert len(got) == len(want) == GEN
    for (a, alts_a), (b, alts_b) in zip(got, want):
        assert abs(a - b) <= 1e-4 and [t for t, _ in alts_a] == [t for t, _ in alts_b]


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_the_replay_recomputes_blocks_whose_last_came_ahead_and_catches_a_wrong_token(family):
    model = target(family, "float32")
    ref, _ = plain(model)
    blocks, _ = gappy_run(model, ref, rollback="reforward")
    own = tokens(blocks)  # plain decoding's text, or (where kernels round by shape) parted from it at a tie
    if kernels_agree("float32"):
        assert own == ref
    assert any(b.ahead for b in blocks)
    assert replay(model, PROMPT, own, blocks, 3).mismatch is None
    # A token of a block whose first row came ahead, changed: the replay's forwards pick another.
    at, bad = 0, None
    for b in blocks:
        if b.ahead and bad is None and at > 0:
            bad = at
        at += len(b.tokens)
    wrong = list(own)
    wrong[bad] = own[bad] - 1 if own[bad] else 1
    assert replay(model, PROMPT, wrong, blocks, 3).mismatch == bad


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_on_the_gpu_like_backend_pipelined_text_is_plain_or_a_proven_tie(family, gpu_like):
    model = target(family, "bfloat16")
    ref, _ = plain(model)
    blocks, _ = gappy_run(model, ref, rollback="capture" if family in RECURRENT else "reforward")
    assert any(b.ahead and b.drafted for b in blocks)
    assert_exact(model, "bfloat16", blocks, ref)
