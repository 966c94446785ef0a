"""Capture and tape rollback, the Mamba2 one-token-formula verify, and bounded sliding windows.

Every check here is bit-exact in bfloat16 on the CPU: a verify forward cut
back to any accepted length must leave each layer cache exactly as plain
decoding (prompt prefilled, then one token at a time) leaves it.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import pytest
from helpers import (
    PROMPT,
    cache_arrays,
    fed,
    max_cache_diff,
    noisy_drafter,
    plain,
    prefilled,
    speculative,
    target,
    tokens,
)
from zoo_configs import ZOO

from specdec_cli.cache.caches import ModelCache, WindowKVCache
from specdec_cli.drafters import ModelDrafter
from specdec_cli.loop.engine import speculative_generate_step
from specdec_cli.model.recurrent import RecurrentSteps
from specdec_cli.cache.rollback import choose
from specdec_cli.session.synthetic import TINY_CONFIGS, build_model, perturb

# Every family mlx-lm builds from a GatedDeltaNet, Mamba2 or Mamba mixer that
# runs in bfloat16 on the CPU (MoE layers made dense: GatherMM is float32-only there).
COVERED = {
    "qwen3_5": ("helpers", "GatedDeltaNet"),
    "qwen3_next": ({**ZOO["qwen3_next"], "mlp_only_layers": [0, 1]}, "GatedDeltaNet"),
    "nemotron_h": ("helpers", "Mamba2"),
    "mamba2": (ZOO["mamba2"], "Mamba2"),
    "falcon_h1": (ZOO["falcon_h1"], "Mamba2"),
    "plamo2": (ZOO["plamo2"], "Mamba2"),
    "granitemoehybrid": ({**ZOO["granitemoehybrid"], "num_local_experts": 0}, "Mamba2"),
    "mamba": (ZOO["mamba"], "Mamba"),
}
STRATEGIES = ("capture", "tape")


@functools.cache
def model(family: str, noise: float = 0.0):
    config, _ = COVERED[family]
    if config == "helpers":
        return noisy_drafter(family, "bfloat16") if noise else target(family, "bfloat16")
    m = build_model(config, seed=0, dtype=mx.bfloat16)
    if noise:
        perturb(m, noise, seed=1000)
    return m


def greedy(m, n: int) -> list[int]:
    out, _ = plain(m, max_tokens=n)
    return out


@pytest.mark.parametrize("family", sorted(COVERED))
def test_hooks_cover_the_family(family):
    steps = ModelCache(model(family)).steps
    assert steps is not None and steps.covered, steps.problem
    assert set(steps.kinds) == {COVERED[family][1]}
    assert steps.bytes_per_step["capture"] > steps.bytes_per_step["tape"] > 0


def snapshot_arrays(cache: ModelCache) -> list[mx.array]:
    arrays = cache_arrays(cache)
    mx.eval(arrays)
    return arrays


def assert_same(cache: ModelCache, want: list[mx.array], what) -> None:
    got = cache_arrays(cache)
    assert len(got) == len(want), what
    for a, b in zip(got, want):
        assert a.shape == b.shape and mx.array_equal(a, b).item(), what


@pytest.mark.parametrize("family", sorted(COVERED))
def test_cut_back_state_equals_plain_decoding_for_every_k_and_accepted_length(family):
    m = model(family)
    cont = greedy(m, 8)
    # Plain decoding's caches after the prompt and each next token, fed one at a time.
    plain_cache = prefilled(m)
    direct = [snapshot_arrays(plain_cache)]
    for t in [PROMPT[-1]] + cont:
        plain_cache.feed(mx.array([t], dtype=mx.uint32))
        direct.append(snapshot_arrays(plain_cache))
    cache = prefilled(m)
    snap = cache.snapshot()
    checked = 0
    for strategy in STRATEGIES:
        for k in range(1, 9):
            # The verify of [last, d1..dk]; accepted length a keeps a + 1 tokens
            # (the bonus position's input too); 0 kept is the snapshot itself.
            x = mx.array([PROMPT[-1]] + cont[:k], dtype=mx.uint32)
            for n_keep in range(0, k + 2):
                cache.feed(x, record=strategy)
                cache.rollback_recorded(snap, n_keep)
                assert_same(cache, direct[n_keep], (strategy, k, n_keep))
                cache.restore(snap)
                checked += 1
    assert checked == 2 * sum(k + 2 for k in range(1, 9))


@pytest.mark.parametrize("family", sorted(COVERED))
def test_every_strategy_generates_plain_greedy_output(family):
    m, draft = model(family), model(family, noise=0.05)
    ref, ref_cache = plain(m, max_tokens=24)
    for strategy, ks in (("capture", (2, 5)), ("tape", (2, 5)), ("carry", (3,)), ("reforward", (3,))):
        kinds = set()
        for k in ks:
            blocks, cache, _ = speculative(m, draft, k, max_tokens=24, rollback=strategy)
            assert tokens(blocks) == ref, (strategy, k)
            assert max_cache_diff(cache, ref_cache) == 0.0, (strategy, k)
            kinds |= {b.rollback for b in blocks}
        assert strategy in kinds, (strategy, kinds)  # partial accepts happened


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_k_1_to_8_with_partial_accepts(family):
    # Tokens only (the states are checked bit-exactly above): float32 runs faster here.
    m, draft = target(family, "float32"), noisy_drafter(family, "float32")
    ref, _ = plain(m, max_tokens=24)
    for strategy in STRATEGIES:
        kinds = set()
        for k in range(1, 9):
            blocks, _, _ = speculative(m, draft, k, max_tokens=24, rollback=strategy)
            assert tokens(blocks) == ref, (strategy, k)
            assert any(b.accepted < b.drafted for b in blocks), (strategy, k)  # a rejection
            kinds |= {(b.rollback, 0 < b.accepted < b.drafted) for b in blocks}
        assert (strategy, True) in kinds  # accepted some drafts, then cut the state back


def test_mamba2_verify_uses_the_one_token_formula():
    # mlx-lm's chunked formula for several tokens differs from its one-token
    # formula in the last bit; the hooked verify must not.
    m = model("nemotron_h")
    cont = greedy(m, 6)
    cache = prefilled(m)
    cache.feed(mx.array([PROMPT[-1]] + cont[:5], dtype=mx.uint32))
    assert max_cache_diff(cache, fed(m, PROMPT + cont[:5])) == 0.0
    with cache.steps.forward("off"):  # mlx-lm's own path, for contrast
        stock = prefilled(m)
        stock.model(mx.array([[PROMPT[-1]] + cont[:5]], dtype=mx.uint32), cache=stock.layers)
    stock.length += 6
    assert max_cache_diff(stock, fed(m, PROMPT + cont[:5])) > 0.0


def test_hooks_are_per_instance_and_come_off():
    m = model("qwen3_5")
    ModelCache(m)
    hooked = m.language_model.model.layers[0].linear_attn
    base = vars(type(hooked)).get("_specdec_steps_base")
    assert base is not None and base.__name__ == "GatedDeltaNet"
    assert "_specdec_steps_base" not in vars(base)  # mlx-lm's class itself is untouched
    fresh = build_model(TINY_CONFIGS["qwen3_5"], seed=1, dtype=mx.bfloat16)
    assert type(fresh.language_model.model.layers[0].linear_attn) is base
    steps = RecurrentSteps(fresh)
    assert type(fresh.language_model.model.layers[0].linear_attn) is not base
    steps.close()
    assert type(fresh.language_model.model.layers[0].linear_attn) is base
    assert type(fresh.language_model.model.layers[0].linear_attn.conv1d).__name__ == "Conv1d"


@pytest.mark.parametrize("family,dtype", [("rwkv7", mx.float32), ("lfm2", mx.float32), ("jamba", mx.float32)])
def test_other_recurrent_layers_fall_back_to_carry_and_say_so(family, dtype):
    m = build_model(ZOO[family], seed=0, dtype=dtype)
    cache = prefilled(m)
    assert not cache.can_record and cache.record_problem
    for requested in ("auto", "capture", "tape"):
        choice = choose(requested, cache, 4)
        assert choice.strategy == "carry" and "carry instead" in choice.reason, choice
    with pytest.raises(ValueError, match="cannot run"):
        list(speculative_generate_step(PROMPT[-1], cache, ModelDrafter(m), num_draft_tokens=2, max_tokens=2,
                                       rollback="capture"))


def test_auto_measures_and_the_memory_cap_falls_back_to_tape():
    cache = prefilled(model("qwen3_5"))
    before = cache.snapshot()
    auto = choose("auto", cache, 4)
    assert auto.strategy in STRATEGIES and set(auto.measured_ms) == set(STRATEGIES)
    assert "measured" in auto.reason and auto.capture_bytes == 4 * cache.steps.bytes_per_step["capture"]
    assert cache.length == before.length  # measuring left the cache as it was
    assert max_cache_diff(cache, prefilled(model("qwen3_5"))) == 0.0
    capped = choose("capture", cache, 4, memory_cap=auto.capture_bytes - 1)
    assert capped.strategy == "tape" and "cap" in capped.reason
    assert choose("auto", cache, 4, memory_cap=auto.capture_bytes - 1).strategy == "tape"
    assert choose("capture", cache, 4, memory_cap=auto.capture_bytes).strategy == "capture"
    assert choose("carry", cache, 4).strategy == "carry"
    assert choose("auto", prefilled(target("llama", "bfloat16")), 4).strategy == "trim"


# --- bounded sliding-window caches -------------------------------------------------


def window_caches(cache: ModelCache) -> list[WindowKVCache]:
    return [c for c in cache._attention if isinstance(c, WindowKVCache)]


def test_sliding_window_cache_stays_bounded_and_output_identical():
    # gemma3_text: window 8, sliding layers 0 and 2. Generate 4x the window
    # past a prompt of one window: memory must stay O(window), not O(context).
    m, draft = target("gemma3_text", "bfloat16"), noisy_drafter("gemma3_text", "bfloat16")
    prompt = PROMPT[:8]
    n = 4 * 8
    ref, ref_cache = plain(m, max_tokens=n, prompt=prompt)
    for k in (3, 7):
        cache = prefilled(m, prompt)
        drafter = ModelDrafter(draft)
        drafter.prefill(prompt[:-1])
        out, kinds = [], set()
        worst = {"target": 0, "drafter": 0}
        for block in speculative_generate_step(prompt[-1], cache, drafter, num_draft_tokens=k, max_tokens=n):
            out += block.tokens
            kinds.add(block.rollback)
            for who, c in [("target", c) for c in window_caches(cache)] + \
                          [("drafter", c) for c in window_caches(drafter.cache)]:
                # The bound depends on the window, the reach and the block, never on the context.
                assert c.keys.shape[2] <= 2 * (c.window + c.reach) + k + 1
                worst[who] = max(worst[who], c.keys.shape[2])
        assert out == ref, k
        assert "trim" in kinds  # partial accepts rolled the window caches back
        assert max_cache_diff(cache, ref_cache) == 0.0
        assert worst["target"] < len(prompt) + n  # less than one key per position of the context
        assert all(c.start > 0 for c in window_caches(cache) + window_caches(drafter.cache))  # old keys dropped


def test_sliding_window_rollback_past_its_reach_fails_loudly():
    m = target("gemma3_text", "bfloat16")
    cache = ModelCache(m)
    cache.prefill(PROMPT[:8])
    snaps = []
    for t in (PROMPT * 2)[8:80]:
        snaps.append(cache.snapshot())
        cache.feed(mx.array([t], dtype=mx.uint32))
    reach = window_caches(cache)[0].reach
    # The latest forward started at snaps[-1]: a restore up to `reach` below it is fine.
    cache.restore(snaps[-1 - reach])
    with pytest.raises(RuntimeError, match="reach"):
        cache.restore(snaps[0])  # 72 tokens back: the keys it needs were dropped


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_eos_max_tokens_and_interrupt_leave_exact_caches(family, strategy):
    from helpers import Interrupting

    m, draft = model(family), model(family, noise=0.05)
    ref, _ = plain(m)
    for max_tokens in (3, 7):
        _, ref_cache = plain(m, max_tokens=max_tokens)
        blocks, cache, _ = speculative(m, draft, 4, max_tokens=max_tokens, rollback=strategy)
        assert tokens(blocks) == ref[:max_tokens]
        assert max_cache_diff(cache, ref_cache) == 0.0
    eos = ref[6]
    ref_eos, eos_cache = plain(m, eos_ids=(eos,))
    blocks, cache, _ = speculative(m, draft, 4, eos_ids=(eos,), rollback=strategy)
    assert tokens(blocks) == ref_eos and max_cache_diff(cache, eos_cache) == 0.0
    # Interrupted inside a verify forward: back to the block's start, then resumed.
    cache = prefilled(Interrupting(m, at_call=6))
    drafter = ModelDrafter(draft)
    drafter.prefill(PROMPT[:-1])
    out: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        for block in speculative_generate_step(PROMPT[-1], cache, drafter, num_draft_tokens=3, max_tokens=24,
                                               rollback=strategy):
            out += block.tokens
    _, direct = plain(m, max_tokens=len(out))
    assert max_cache_diff(cache, direct) == 0.0
    rest = speculative_generate_step(out[-1], cache, drafter, num_draft_tokens=3, max_tokens=24 - len(out),
                                     rollback=strategy)
    assert out + tokens(list(rest)) == ref[:24]
