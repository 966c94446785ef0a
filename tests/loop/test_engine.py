"""Invariants of the draft/verify/accept loop on tiny random models.

Tolerances. On the CPU with MLX's bundled BLAS, a batched verify and a
one-token decode give bit-identical results for every family here, the Mamba2
layers of nemotron_h included: mlx-lm computes T > 1 tokens with a chunked SSD
formula that differs from its one-token formula in the last bit, so specdec's
recurrent hooks (specdec_cli/model/recurrent.py) compute every token after the prompt
with the one-token formula. With an optimised BLAS (OpenBLAS) float32 matmul
results depend on the row count (~1e-6 on logits), so float32 comparisons
allow 1e-5; bfloat16 ones allow nothing. Token sequences must match exactly.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import (
    DTYPES,
    assert_alone_or_tie,
    assert_cache_built_by,
    assert_exact,
    cache_rel_diff,
    kernels_agree,
    FAMILIES,
    fed,
    GEN,
    Interrupting,
    PROMPT,
    noisy_drafter,
    plain,
    prefilled,
    speculative,
    target,
    tokens,
)
from mlx_lm.generate import generate_step

from specdec_cli.drafters import ModelDrafter
from specdec_cli.loop.engine import speculative_generate_step

FAMILY_DTYPES = [(f, d) for f in FAMILIES for d in DTYPES]
KS = range(1, 9)


def cache_tolerance(family: str, dtype: str) -> float:
    if not kernels_agree(dtype):
        # Batched and one-row kernels round apart (GPUs): a few ulps of the dtype.
        return 1e-3 if dtype == "float32" else 2**-4
    return 1e-5 if dtype == "float32" else 0.0


@pytest.mark.parametrize("family,dtype", FAMILY_DTYPES)
def test_plain_layout_matches_mlx_lm_stock_cache(family, dtype):
    # Our all-KVCache layout (sliding layers as KVCache + window mask) gives
    # the same greedy tokens as mlx-lm's generate_step with the model's own
    # caches, on a prompt longer than gemma3's 8-token window.
    model = target(family, dtype)
    stock = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=GEN)]
    ours, _ = plain(model)
    assert ours == stock


@pytest.mark.parametrize("family,dtype", FAMILY_DTYPES)
def test_speculative_equals_plain_with_partial_accepts(family, dtype):
    model, draft = target(family, dtype), noisy_drafter(family, dtype)
    ref, _ = plain(model)
    for k in KS:
        blocks, _, _ = speculative(model, draft, k)
        assert_exact(model, dtype, blocks, ref)
        assert sum(len(b.tokens) for b in blocks) == GEN
        partial = [b for b in blocks if 0 < b.drafted and b.accepted < b.drafted]
        assert partial, f"K={k}: the noisy drafter never got rejected"
        if k > 1:
            assert any(b.accepted > 0 for b in partial), f"K={k}: no accept-then-reject block"


@pytest.mark.parametrize("family,dtype", FAMILY_DTYPES)
def test_drafter_equal_to_target_accepts_everything(family, dtype):
    model = target(family, dtype)
    ref, _ = plain(model)
    for k in KS:
        blocks, _, _ = speculative(model, model, k)
        assert_exact(model, dtype, blocks, ref)
        if kernels_agree(dtype):  # else the one-row drafter and the T-row verify may round apart (and roll back)
            assert all(b.accepted == b.drafted for b in blocks), f"K={k}"
            assert all(b.rollback == "none" for b in blocks[:-1])
            # Every block but the truncated last one drafts K tokens.
            assert all(b.drafted == k for b in blocks[:-1])
        else:  # (after a rejection, the room left may cut the block before the last)
            assert all(0 < b.drafted <= k for b in blocks[:-1]) and blocks[0].drafted == k


@pytest.mark.parametrize("family,dtype", FAMILY_DTYPES)
def test_rolled_back_cache_equals_cache_built_directly(family, dtype):
    # After a partial accept, the target cache must be the cache plain
    # decoding leaves after emitting the same tokens.
    model, draft = target(family, dtype), noisy_drafter(family, dtype)
    tol = cache_tolerance(family, dtype)
    checked = 0
    for k in (2, 5):
        cache = prefilled(model)
        drafter = ModelDrafter(draft)
        drafter.prefill(PROMPT[:-1])
        out: list[int] = []
        # Re-forward leaves the cache exact after every block (carry, only at exit).
        gen = speculative_generate_step(PROMPT[-1], cache, drafter, num_draft_tokens=k, max_tokens=GEN,
                                        rollback="reforward")
        for block in gen:
            out += block.tokens
            if block.rollback == "none" or checked >= 6:
                continue
            assert_cache_built_by(model, PROMPT, out, cache, dtype, tol)
            # The drafter rolled back too: its cache equals one fed the same
            # committed tokens directly (minus any it has yet to see).
            assert drafter.cache.length + len(drafter._pending) == cache.length
            assert_cache_built_by(draft, PROMPT, out, drafter.cache, dtype, tol, drafter=True)
            checked += 1
    assert checked >= 4
    expected = "reforward" if family in ("qwen3_5", "nemotron_h") else "trim"
    blocks, _, _ = speculative(model, draft, 4)
    assert {b.rollback for b in blocks} <= {"none", expected}
    assert expected in {b.rollback for b in blocks}


# Where kernels round by shape (tests/gpu_like.py): a dense, a sliding-window and a hybrid family.
GPU_LIKE = [(f, d) for f in ("llama", "gemma3_text", "qwen3_5") for d in DTYPES]


@pytest.mark.parametrize("rollback", ["reforward", "capture"])
@pytest.mark.parametrize("family,dtype", GPU_LIKE)
def test_on_a_gpu_like_backend_speculation_is_plain_or_a_proven_tie_and_its_cache_the_direct_one(
        family, dtype, rollback, gpu_like):
    model, draft = target(family, dtype), noisy_drafter(family, dtype)
    ref, _ = plain(model)
    for k in (2, 5):
        blocks, cache, _ = speculative(model, draft, k, rollback=rollback)
        assert_exact(model, dtype, blocks, ref)  # the replay proves a tie: one row's own verify shapes
        out = tokens(blocks)
        # Its cache is the one its own tokens build directly, within rounding (they were fed in other shapes).
        direct = fed(model, PROMPT + out[:-1])
        assert cache_rel_diff(cache, direct) <= 2.0**-3


@pytest.mark.parametrize("family", FAMILIES)
def test_one_host_sync_per_block_unless_timed(family):
    model, draft = target(family, "float32"), noisy_drafter(family, "float32")
    blocks, _, _ = speculative(model, draft, 4)
    assert all(b.syncs == 1 and b.times is None for b in blocks)
    timed, _, _ = speculative(model, draft, 4, timed=True)
    assert tokens(timed) == tokens(blocks)
    assert all(b.syncs == 3 for b in timed)
    assert all(min(b.times.draft_s, b.times.verify_s, b.times.rollback_s) >= 0 for b in timed)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 7, 11])
def test_max_tokens_mid_block_truncates_and_leaves_consistent_caches(family, max_tokens):
    model = target(family, "bfloat16")
    ref, _ = plain(model, max_tokens=max_tokens)
    # Drafter == target: every block is a full accept of 5 drafts, so the
    # limit lands inside a block.
    blocks, cache, drafter = speculative(model, model, 5, max_tokens=max_tokens)
    assert_alone_or_tie(model, "bfloat16", tokens(blocks), ref, PROMPT)
    assert blocks[-1].finish_reason == "length"
    # Drafts the target agreed with past the limit were not kept: not counted as accepted.
    assert all(b.accepted <= len(b.tokens) for b in blocks) and sum(len(b.tokens) for b in blocks) == max_tokens
    assert_cache_built_by(model, PROMPT, tokens(blocks), cache, "bfloat16")
    assert drafter.cache.length + len(drafter._pending) == cache.length


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_5", "nemotron_h"])
def test_eos_inside_an_accepted_block_ends_output(family):
    model = target(family, "bfloat16")
    ref, _ = plain(model)
    # Use a token that first appears mid-output as the EOS.
    pos = next(i for i in range(5, GEN) if ref[i] not in ref[:i])
    eos = ref[pos]
    ref_eos, _ = plain(model, eos_ids=(eos,))
    assert ref_eos == ref[:pos]
    for k in (3, 6):
        blocks, cache, _ = speculative(model, model, k, eos_ids=(eos,))
        assert_alone_or_tie(model, "bfloat16", tokens(blocks), ref_eos, PROMPT, eos_ids=(eos,))
        if tokens(blocks) == ref_eos:  # (a text parted at a rounding tie may never meet that EOS)
            assert blocks[-1].finish_reason == "stop"
        # The EOS is kept (not emitted); drafts after it, agreed with or not, are not accepted ones.
        assert all(b.accepted <= len(b.tokens) + (b.finish_reason == "stop") for b in blocks)
        assert_cache_built_by(model, PROMPT, tokens(blocks), cache, "bfloat16", cache_tolerance(family, "bfloat16"),
                              stopped=blocks[-1].finish_reason == "stop")


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_early_close_leaves_caches_consistent(family):
    model, draft = target(family, "bfloat16"), noisy_drafter(family, "bfloat16")
    cache = prefilled(model)
    drafter = ModelDrafter(draft)
    drafter.prefill(PROMPT[:-1])
    gen = speculative_generate_step(PROMPT[-1], cache, drafter, num_draft_tokens=4, max_tokens=GEN)
    out = list(next(gen).tokens) + list(next(gen).tokens)
    gen.close()
    assert_cache_built_by(model, PROMPT, out, cache, "bfloat16")


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_5", "nemotron_h"])
@pytest.mark.parametrize("who", ["target", "drafter"])
def test_interrupt_mid_block_restores_caches_and_resumes_exactly(family, who):
    model, draft = target(family, "bfloat16"), noisy_drafter(family, "bfloat16")
    ref, _ = plain(model)
    # Prefill is one forward; interrupt a later one, mid-block.
    wrapped_target = Interrupting(model, at_call=6) if who == "target" else model
    wrapped_draft = Interrupting(draft, at_call=9) if who == "drafter" else draft
    cache = prefilled(wrapped_target)
    drafter = ModelDrafter(wrapped_draft)
    drafter.prefill(PROMPT[:-1])
    out: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        for block in speculative_generate_step(PROMPT[-1], cache, drafter, num_draft_tokens=3, max_tokens=GEN):
            out += block.tokens
    assert 0 < len(out) < GEN
    assert_cache_built_by(model, PROMPT, out, cache, "bfloat16", cache_tolerance(family, "bfloat16"))
    # Resume from the last emitted token with the same caches and drafter.
    rest = speculative_generate_step(out[-1], cache, drafter, num_draft_tokens=3, max_tokens=GEN - len(out))
    assert_alone_or_tie(model, "bfloat16", out + tokens(list(rest)), ref, PROMPT)


def test_zero_draft_tokens_is_plain_decoding():
    model = target("qwen3_5", "float32")
    ref, _ = plain(model)
    blocks, _, _ = speculative(model, model, 0)
    assert tokens(blocks) == ref
    assert all(b.drafted == 0 and len(b.tokens) == 1 for b in blocks)


# --- the carry strategy (recurrent targets) ---------------------------------------
# After a partial accept the recurrent state is restored and the accepted tokens
# lead the next verify forward. Between blocks the cache then lags the output;
# whenever the generator ends, it must hold what plain decoding leaves.

RECURRENT = [(f, d) for f in ("qwen3_5", "nemotron_h") for d in DTYPES]


@pytest.mark.parametrize("family,dtype", RECURRENT)
def test_carry_equals_plain_with_partial_accepts(family, dtype):
    model, draft = target(family, dtype), noisy_drafter(family, dtype)
    ref, _ = plain(model)
    for k in KS:
        blocks, cache, _ = speculative(model, draft, k, rollback="carry")
        assert_exact(model, dtype, blocks, ref)
        assert all(b.verify_len == b.carry + 1 + b.drafted and b.carry <= 8 for b in blocks)
        kinds = {b.rollback for b in blocks}
        assert "carry" in kinds and kinds <= {"none", "carry", "reforward"}, kinds
        assert_cache_built_by(model, PROMPT, tokens(blocks), cache, dtype, cache_tolerance(family, dtype))


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
@pytest.mark.parametrize("max_tokens", [1, 3, 7, 11])
def test_carry_max_tokens_and_eos_leave_consistent_caches(family, max_tokens):
    model, draft = target(family, "bfloat16"), noisy_drafter(family, "bfloat16")
    ref, _ = plain(model, max_tokens=max_tokens)
    blocks, cache, drafter = speculative(model, draft, 4, max_tokens=max_tokens, rollback="carry")
    assert_alone_or_tie(model, "bfloat16", tokens(blocks), ref, PROMPT)
    assert_cache_built_by(model, PROMPT, tokens(blocks), cache, "bfloat16", cache_tolerance(family, "bfloat16"))
    assert drafter.cache.length + len(drafter._pending) == cache.length
    full, _ = plain(model)
    eos = full[6]
    ref_eos, _ = plain(model, eos_ids=(eos,))
    blocks, cache, _ = speculative(model, draft, 4, eos_ids=(eos,), rollback="carry")
    assert_alone_or_tie(model, "bfloat16", tokens(blocks), ref_eos, PROMPT, eos_ids=(eos,))
    assert_cache_built_by(model, PROMPT, tokens(blocks), cache, "bfloat16", cache_tolerance(family, "bfloat16"),
                          stopped=blocks[-1].finish_reason == "stop")


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_carry_early_close_flushes_the_carry(family):
    model, draft = target(family, "bfloat16"), noisy_drafter(family, "bfloat16")
    closed_with_carry = 0
    for stop_after in range(1, 6):
        cache = prefilled(model)
        drafter = ModelDrafter(draft)
        drafter.prefill(PROMPT[:-1])
        gen = speculative_generate_step(PROMPT[-1], cache, drafter, num_draft_tokens=4, max_tokens=GEN,
                                        rollback="carry")
        out, kinds = [], []
        for _ in range(stop_after):
            block = next(gen)
            out += block.tokens
            kinds.append(block.rollback)
        gen.close()
        assert_cache_built_by(model, PROMPT, out, cache, "bfloat16", cache_tolerance(family, "bfloat16"))
        closed_with_carry += kinds[-1] == "carry"
    assert closed_with_carry, "no close happened with a carry pending"


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
@pytest.mark.parametrize("at_call", [4, 6, 9])
def test_carry_interrupt_mid_block_resumes_exactly(family, at_call):
    model, draft = target(family, "bfloat16"), noisy_drafter(family, "bfloat16")
    ref, _ = plain(model)
    cache = prefilled(Interrupting(model, at_call=at_call))
    drafter = ModelDrafter(draft)
    drafter.prefill(PROMPT[:-1])
    out: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        for block in speculative_generate_step(PROMPT[-1], cache, drafter, num_draft_tokens=3, max_tokens=GEN,
                                               rollback="carry"):
            out += block.tokens
    assert_cache_built_by(model, PROMPT, out, cache, "bfloat16", cache_tolerance(family, "bfloat16"))
    rest = speculative_generate_step(out[-1], cache, drafter, num_draft_tokens=3, max_tokens=GEN - len(out),
                                     rollback="carry")
    assert_alone_or_tie(model, "bfloat16", out + tokens(list(rest)), ref, PROMPT)


def test_carry_on_an_attention_model_is_a_trim():
    model, draft = target("llama", "float32"), noisy_drafter("llama", "float32")
    blocks, _, _ = speculative(model, draft, 4, rollback="carry")
    assert {b.rollback for b in blocks} <= {"none", "trim"}


def test_unknown_rollback_strategy_is_refused():
    model = target("llama", "float32")
    with pytest.raises(ValueError, match="rollback"):
        list(speculative_generate_step(PROMPT[-1], prefilled(model), ModelDrafter(model), num_draft_tokens=2,
                                       max_tokens=3, rollback="magic"))


@pytest.mark.parametrize("loop", ["speculative", "plain"])
def test_mlx_buffer_cache_is_emptied_every_256_tokens_as_mlx_lm_does(monkeypatch, loop):
    # A KV cache grows by reallocating, and MLX's buffer cache kept each smaller buffer it left: 32 MB after 600
    # tokens of the bundled model (mlx-lm's generate_step, which empties it every 256 tokens: 2 MB).
    from specdec_cli.loop.engine import CLEAR_EVERY
    from specdec_cli.loop.plain import plain_generate_step

    model, n = target("llama", "float32"), 2 * CLEAR_EVERY + 40
    cache = prefilled(model)
    drafter = ModelDrafter(noisy_drafter("llama", "float32"))
    drafter.prefill(PROMPT[:-1])
    clears = []
    monkeypatch.setattr(mx, "clear_cache", lambda: clears.append(sum(emitted)))
    emitted = []
    steps = (speculative_generate_step(PROMPT[-1], cache, drafter, num_draft_tokens=4, max_tokens=n)
             if loop == "speculative" else plain_generate_step(PROMPT[-1], cache, max_tokens=n))
    for block in steps:
        emitted.append(len(block.tokens))
    assert sum(emitted) == n
    # Each once the tokens since the last one reach CLEAR_EVERY (give or take a block of 5: the speculative loop
    # empties it before yielding the block that reached it, plain decoding after).
    assert len(clears) == 2 and all(abs(b - a - CLEAR_EVERY) <= 5 for a, b in zip([0, *clears], clears)), clears
