"""The DFlash block drafter.

Fidelity: on random weights our block logits equal those of the publisher's
own MLX implementation (z-lab's ``dflash`` package, ``dflash.model_mlx``) and
of ``dflash-mlx`` (older schema only), for bidirectional, causal-sliding and
causal configs in both config schemas, step after step as the context grows.
Then: speculative == plain on a pure-attention and a hybrid target, the
drafter's context after a run equals one built directly, lossless sampling
(chi-square), p-min, cancel, and every refusal.
"""

from __future__ import annotations

import functools
import json

import mlx.core as mx
import pytest
from helpers import PROMPT

from specdec_cli.drafters.dflash import DFlashConfig, DFlashDrafter, check_target, default_target_layer_ids
from specdec_cli.errors import ModelLoadError, UnsupportedModelError
from specdec_cli.drafters.dflash_io import load_dflash
from specdec_cli.loop.events import collect
from specdec_cli.loop.runner import run
from specdec_cli.session.synthetic import TINY_CONFIGS, build_model, dflash_config, save_dflash_dir
from specdec_cli.model.taps import Hidden, HiddenTap, TapSpec, _backbone, target_parts

YARN = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32}
ATTENTION = {
    # All layers full attention: bidirectional within the block (the older checkpoints).
    "bidirectional": dict(layers=2),
    # Sliding layers causal within the block, their window on the context; full layers bidirectional.
    "causal-sliding": dict(layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           sliding_window=8),
}
# Context rows handed over before each block, and the drafts asked for (the first block follows the prompt).
STEPS = [(0, 7), (3, 7), (1, 7), (5, 4), (1, 7), (2, 7), (1, 3)]
PROMPT_ROWS = 13


@functools.cache
def tiny(family: str):
    return build_model(TINY_CONFIGS[family], seed=0)


def qwen_dflash_setup(tmp_path):
    """A tiny qwen3_5 target and a two-layer DFlash drafter for it (block 6, one sliding layer), loaded
    as a session loads them (the scheduler's and the disk tier's tests share it)."""
    from specdec_cli.session import ModelOptions, load_setup
    from specdec_cli.session.synthetic import make_model_dir

    target = make_model_dir(tmp_path / "qwen3_5", "qwen3_5", seed=0)
    cfg = dflash_config(TINY_CONFIGS["qwen3_5"], layers=2, block_size=6,
                        layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    draft = save_dflash_dir(tmp_path / "dflash", cfg, seed=3)
    return load_setup(ModelOptions(model=str(target), draft_model=str(draft), dtype="float32"), "dflash")


@functools.cache
def parts_of(family: str):
    return target_parts(tiny(family))


def features(n: int, width: int, seed: int = 7) -> mx.array:
    return mx.random.normal((n, width), key=mx.random.key(seed))


def rows(feats: mx.array, start: int, stop: int, layers: int) -> Hidden:
    h = feats.shape[1] // layers
    return Hidden(tuple(feats[start:stop, i * h:(i + 1) * h] for i in range(layers)))


def zlab_model(path, monkeypatch, target):
    """z-lab's own loader and model (its Hub download pointed at our directory)."""
    zlab = pytest.importorskip("dflash.model_mlx")
    monkeypatch.setattr(zlab, "snapshot_download", lambda *a, **k: str(path))
    return zlab.load_draft(str(path)).bind(target)


def dflash_mlx_model(cfg: dict, path):
    """dflash-mlx's model (older schema only), with the context cache that keeps every key."""
    ref = pytest.importorskip("dflash_mlx.model")
    model = ref.DFlashDraftModel(ref.DFlashDraftModelArgs.from_dict(cfg))
    model.load_weights(list(mx.load(str(path / "model.safetensors")).items()))
    return model, [ref.FullContextDraftKVCache() for _ in model.layers]


@pytest.mark.parametrize("schema", ["old", "new"])
@pytest.mark.parametrize("attention", list(ATTENTION))
def test_block_logits_equal_the_publishers_implementation(schema, attention, tmp_path, monkeypatch):
    target, parts = tiny("qwen3"), parts_of("qwen3")
    cfg = dflash_config(TINY_CONFIGS["qwen3"], schema=schema, block_size=8,
                        rope=YARN if schema == "new" else None, **ATTENTION[attention])
    path = save_dflash_dir(tmp_path / "d", cfg, seed=1, prefix="")
    ours = DFlashDrafter(load_dflash(str(path)).model, parts)
    zlab = zlab_model(path, monkeypatch, target)
    zcache = zlab.make_cache()
    second = dflash_mlx_model(cfg, path) if schema == "old" else None
    n_layers = len(cfg["dflash_config"]["target_layer_ids"])
    feats = features(64, n_layers * parts.hidden_size)
    sliding = "sliding_attention" in ours.config.layer_types

    ours.prefill(list(range(PROMPT_ROWS)), 5, rows(feats, 0, PROMPT_ROWS, n_layers))
    pos, new = PROMPT_ROWS, (0, PROMPT_ROWS)
    for step, (m, k) in enumerate(STEPS):
        if m:
            ours.accept(m - 1, rows(feats, pos, pos + m, n_layers))
            new, pos = (pos, pos + m), pos + m
        last = 11 + step
        block = mx.array([[last] + [cfg["dflash_config"]["mask_token_id"]] * k])
        got = ours.block_logits(last, k)
        assert got.shape == (k, parts.vocab_size)
        # z-lab, given the whole context at once.
        once = zlab(block, feats[None, :pos], zlab.make_cache(), logits_start=1)[0]
        assert mx.allclose(got, once, rtol=1e-4, atol=1e-4).item(), (step, mx.abs(got - once).max().item())
        # z-lab, fed the new rows only (its own generation loop). Its sliding layers keep a
        # RotatingKVCache, whose single-row updates leave keys in ring order while the window
        # mask assumes time order: after a one-row update its sliding layers differ from its
        # own whole-context result above, so those steps are not compared.
        inc = zlab(block, feats[None, new[0]:new[1]], zcache, logits_start=1)[0]
        if not (sliding and new[1] - new[0] == 1):
            assert mx.allclose(got, inc, rtol=1e-4, atol=1e-4).item(), (step, mx.abs(got - inc).max().item())
        if second is not None:
            model, caches = second
            emb = parts.embed(block[0])[None]
            h = model(noise_embedding=emb, target_hidden=feats[None, new[0]:new[1]], cache=caches)
            theirs = parts.logits(h[0, 1:])
            assert mx.allclose(got, theirs, rtol=1e-4, atol=1e-4).item(), (step, mx.abs(got - theirs).max().item())


def test_causal_flag_and_model_prefix(tmp_path, monkeypatch):
    # An all-full config made causal by the root is_causal flag (z-lab's reading), and the same
    # weights saved with a "model." prefix load to the same drafter.
    target, parts = tiny("qwen3"), parts_of("qwen3")
    cfg = dflash_config(TINY_CONFIGS["qwen3"], layers=2, block_size=6)
    cfg["is_causal"] = True
    plain_dir = save_dflash_dir(tmp_path / "a", cfg, seed=2, prefix="")
    prefixed_dir = save_dflash_dir(tmp_path / "b", cfg, seed=2, prefix="model.")
    a = DFlashDrafter(load_dflash(str(plain_dir)).model, parts)
    b = DFlashDrafter(load_dflash(str(prefixed_dir)).model, parts)
    assert a.config.is_causal(0) and a.config.is_causal(1)
    zlab = zlab_model(plain_dir, monkeypatch, target)
    feats = features(20, 2 * parts.hidden_size, seed=3)
    for d in (a, b):
        d.prefill(list(range(20)), 2048, rows(feats, 0, 20, 2))
    block = mx.array([[5] + [258] * 5])
    want = zlab(block, feats[None], zlab.make_cache(), logits_start=1)[0]
    got = a.block_logits(5, 5)
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item()
    assert mx.array_equal(got, b.block_logits(5, 5)).item()
    # Causal: slot i does not see later slots, so a shorter block gives the same first slots.
    a.cancel()
    assert mx.allclose(a.block_logits(5, 2), got[:2], rtol=1e-5, atol=1e-5).item()


def two_symbol(family: str):
    """A target whose greedy tokens are 'x' or 'y' by the sign of one residual coordinate.

    With the drafter's final norm reading the same coordinate through the
    target's lm_head, a random drafter agrees about half the time: blocks
    then end in accepts and rejects of every length.
    """
    model = build_model(TINY_CONFIGS[family], seed=0)
    stack, _, norm, _ = _backbone(model)
    parts = target_parts(model)
    e = mx.zeros((parts.hidden_size,)).at[0].add(1.0)
    stack[norm].weight = e
    head = mx.zeros_like(parts.lm_head.weight)
    head = head.at[ord("x")].add(10 * e).at[ord("y")].add(-10 * e)
    parts.lm_head.weight = head
    mx.eval(model.parameters())
    return model, target_parts(model)


@pytest.mark.parametrize("family,rollback", [("qwen3", "carry"), ("qwen3_5", "carry"), ("qwen3_5", "reforward"),
                                             ("qwen3_5", "capture"), ("qwen3_5", "tape")])
def test_speculative_equals_plain_and_the_context_is_the_one_built_directly(family, rollback, tmp_path):
    target, parts = two_symbol(family)
    cfg = dflash_config(TINY_CONFIGS[family], layers=2, block_size=8,
                        layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    model = load_dflash(str(save_dflash_dir(tmp_path / "d", cfg, seed=4))).model
    model.norm.weight = mx.zeros_like(model.norm.weight).at[0].add(1.0)
    _, plain = collect(run(target, PROMPT, max_tokens=37))
    for k in (2, 7):
        drafter = DFlashDrafter(model, parts)
        stats, out = collect(run(target, PROMPT, drafter=drafter, num_draft_tokens=k, max_tokens=37,
                                 rollback=rollback, prefill_step_size=16))
        assert out == plain
        assert 0 < stats.accepted < stats.drafted and stats.syncs == stats.blocks  # one sync per block
        # Every fed position's row is in the drafter's context, as a direct build has it.
        fed = PROMPT + out[:-1]
        direct = DFlashDrafter(model, parts)
        from specdec_cli.cache.caches import ModelCache

        with HiddenTap(target, drafter.taps) as tap:
            ModelCache(target).feed(mx.array(fed, dtype=mx.uint32))
            direct.prefill(fed, 2048, tap.take())
        got, want = drafter.block_logits(out[-1], 7), direct.block_logits(out[-1], 7)
        assert drafter.context_length == direct.context_length == len(fed)
        assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item()


@pytest.mark.parametrize("family,block_size", [("qwen3", 2), ("qwen3", 9), ("qwen3_5", 4), ("qwen3_5", 9),
                                               ("llama", 4), ("gemma3_text", 4), ("nemotron_h", 4)])
def test_random_drafter_on_unmodified_targets_is_exact(family, block_size, tmp_path):
    # gemma3_text: the target's embed scale and final softcap; nemotron_h: a Mamba hybrid.
    cfg = dflash_config(TINY_CONFIGS[family], schema="old", layers=1, block_size=9)
    model = load_dflash(str(save_dflash_dir(tmp_path / family, cfg, seed=5))).model
    _, plain = collect(run(tiny(family), PROMPT, max_tokens=24))
    stats, out = collect(run(tiny(family), PROMPT, drafter=DFlashDrafter(model, parts_of(family)),
                             num_draft_tokens=block_size - 1, max_tokens=24))
    assert out == plain and stats.drafted > 0


def test_p_min_cuts_on_the_device_with_one_extra_sync(tmp_path):
    cfg = dflash_config(TINY_CONFIGS["qwen3"], layers=1, block_size=8)
    model = load_dflash(str(save_dflash_dir(tmp_path / "d", cfg, seed=6))).model
    parts = parts_of("qwen3")
    feats = features(10, 2 * parts.hidden_size)
    full = DFlashDrafter(model, parts)
    full.prefill(list(range(10)), 2048, rows(feats, 0, 10, 2))
    logits = full.block_logits(3, 7)
    top = mx.softmax(logits, axis=-1).max(-1).tolist()
    threshold = sorted(top)[3]  # some slots pass, some fail
    keep = next((i for i, p in enumerate(top) if p < threshold), len(top))
    cut = DFlashDrafter(model, parts, p_min=threshold)
    cut.prefill(list(range(10)), 2048, rows(feats, 0, 10, 2))
    draft = cut.propose(3, 7)
    assert draft.syncs == 1 and draft.size == keep
    assert draft.tokens.tolist() == mx.argmax(logits, axis=-1).tolist()[:keep]
    # Through the engine: output unchanged; p_min = 1 drafts nothing, at two syncs per block.
    _, plain = collect(run(tiny("qwen3"), PROMPT, max_tokens=12))
    stats, out = collect(run(tiny("qwen3"), PROMPT, drafter=DFlashDrafter(model, parts, p_min=1.0),
                             num_draft_tokens=7, max_tokens=12))
    # (The last block has room for no draft: no drafter forward, no extra sync.)
    assert out == plain and stats.drafted == 0 and stats.syncs == 2 * stats.blocks - 1


def test_cancel_drops_the_context_its_propose_added(tmp_path):
    cfg = dflash_config(TINY_CONFIGS["qwen3"], layers=1, block_size=8)
    model = load_dflash(str(save_dflash_dir(tmp_path / "d", cfg, seed=6))).model
    parts = parts_of("qwen3")
    feats = features(16, 2 * parts.hidden_size)
    d = DFlashDrafter(model, parts)
    d.prefill(list(range(10)), 2048, rows(feats, 0, 10, 2))
    d.accept(2, rows(feats, 10, 13, 2))
    before = d.propose(4, 5).tokens.tolist()
    assert d.context_length == 13
    d.cancel()  # interrupted before the verify: back to 10 rows, the 3 handed over still pending
    assert d.context_length == 10
    assert d.propose(4, 5).tokens.tolist() == before and d.context_length == 13
    # Interrupted after the accept (the engine restores the target to before the verify): same.
    d.accept(1, rows(feats, 13, 15, 2))
    d.cancel()
    assert d.context_length == 10 and d.propose(4, 5).tokens.tolist() == before


def _draw(drafter_cls, tmp_path, samples=600):
    """First tokens of seeded speculative runs with a DFlash drafter on test_sampling's 16-token target."""
    from test_sampling import CONFIG, FILTERED, POSITIONS, PROMPT as P, VOCAB, models

    from specdec_cli.cache.caches import ModelCache
    from specdec_cli.loop.engine import speculative_generate_step

    target, _ = models()
    parts = target_parts(target)
    cfg = dflash_config(CONFIG, layers=1, block_size=4, heads=(2, 1), head_dim=16)
    model = load_dflash(str(save_dflash_dir(tmp_path / "d", cfg, seed=8))).model
    cache = ModelCache(target)
    counts, drafted, accepted = [[0] * VOCAB for _ in range(POSITIONS)], 0, 0
    with HiddenTap(target, TapSpec(layers=model.config.target_layer_ids)) as tap:
        prompt_rows = Hidden.concat(cache.prefill(P[:-1], 2048, tap))
        snap = cache.snapshot()
        mx.random.seed(0)
        for _ in range(samples):
            cache.restore(snap)
            drafter = drafter_cls(model, parts)
            drafter.prefill(P[:-1], 2048, prompt_rows)
            out = []
            for b in speculative_generate_step(P[-1], cache, drafter, num_draft_tokens=3,
                                               max_tokens=POSITIONS, sampling=FILTERED, tap=tap):
                out += b.tokens
                drafted, accepted = drafted + b.drafted, accepted + b.accepted
            for i, tok in enumerate(out):
                counts[i][tok] += 1
    return counts, accepted, drafted


def test_chi_square_sampling_is_lossless(tmp_path):
    # Measured (600 runs): chi2 2.2 / 9.9 / 11.0 against critical values 26.3 / 36.0 / 36.0.
    from test_sampling import FILTERED, POSITIONS, chi_square, exact_marginals

    counts, accepted, drafted = _draw(DFlashDrafter, tmp_path)
    assert accepted >= 50 and drafted - accepted >= 50, (accepted, drafted)
    exact = exact_marginals(FILTERED)
    for pos in range(POSITIONS):
        stat, critical = chi_square(counts[pos], exact[pos])
        assert stat < critical, f"position {pos + 1}: chi2 {stat:.1f} >= {critical:.1f}"


def test_a_q_without_the_targets_transforms_fails_the_same_check(tmp_path):
    # Drafts drawn with top-p/top-k but q reported without them: the check must see it
    # (measured: chi2 62.8 against 26.3 at the first position).
    from test_sampling import FILTERED, POSITIONS, chi_square, exact_marginals

    from specdec_cli.drafters.base import Draft
    from specdec_cli.core.sampling import SamplingParams, log_probs, sample

    class Unfiltered(DFlashDrafter):
        def propose(self, last, k, params):
            if k == 0:
                return super().propose(last, k, params)
            self._undo = (self.context_length, list(self._pending))
            logits = self.block_logits(last, k)
            return Draft(sample(log_probs(logits, params)), log_probs(logits, SamplingParams(temp=params.temp)))

    counts, _, _ = _draw(Unfiltered, tmp_path)
    exact = exact_marginals(FILTERED)
    scores = [chi_square(counts[p], exact[p]) for p in range(POSITIONS)]
    assert any(stat > 2 * critical for stat, critical in scores), scores


# --- refusals ---------------------------------------------------------------

def _cfg(**kw):
    return dflash_config(TINY_CONFIGS["qwen3"], layers=1, **kw)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(architectures=["DFlash2DraftModel"]), "DFlash2DraftModel"),
    (lambda c: c["dflash_config"].pop("mask_token_id"), "will not guess"),
    (lambda c: c["dflash_config"].update(conv_kernel_size=4), "conv_kernel_size"),
    (lambda c: c.update(attention_bias=True), "biases"),
    (lambda c: c.update(layer_types=["sliding_attention"], sliding_window=None), "no sliding_window"),
    (lambda c: c.update(layer_types=["chunked_attention"]), "layer types"),
    (lambda c: c.update(quantization={"bits": 4, "group_size": 64}), "quantized"),
    (lambda c: c["dflash_config"].update(draft_window_size=512), "draft_window_size"),
])
def test_config_refusals(edit, message):
    cfg = _cfg()
    edit(cfg)
    with pytest.raises(UnsupportedModelError, match=message):
        DFlashConfig.from_dict(cfg)


def test_both_schemas_read_the_same_and_defaults():
    old, new = DFlashConfig.from_dict(_cfg(schema="old", block_size=6)), DFlashConfig.from_dict(_cfg(schema="new", block_size=6))
    assert old.block_size == new.block_size == 6 and old.mask_token_id == new.mask_token_id == 258
    assert old.rope_theta == new.rope_theta and old.target_layer_ids == new.target_layer_ids == (0, 1)
    cfg = _cfg(schema="old")
    cfg.pop("block_size")
    cfg["dflash_config"].pop("target_layer_ids")
    cfg["num_target_layers"] = 36
    parsed = DFlashConfig.from_dict(cfg)
    assert parsed.block_size == 16 and parsed.target_layer_ids == default_target_layer_ids(36, 1) == (18,)
    # mlx-vlm's default DFlash config pairs num_target_layers 32 with these ids.
    assert default_target_layer_ids(32, 5) == (1, 8, 15, 22, 29)
    cfg = _cfg(schema="old", block_size=8)
    cfg["mask_token_id"], cfg["dflash_config"] = 7, {"target_layer_ids": [1]}
    assert DFlashConfig.from_dict(cfg).mask_token_id == 7  # root mask_token_id, second choice
    cfg["dflash_config"]["runtime_block_size"] = 4
    assert DFlashConfig.from_dict(cfg).default_block_size == 4  # mlx-vlm's key: a smaller default


@pytest.mark.parametrize("extra, message", [
    ("embed_tokens.weight", "its own token embedding"),
    ("lm_head.weight", "its own lm_head"),
    ("d2t", "reduced draft vocabulary"),
    ("mask_embedding", "learned mask embedding"),
    ("layers.0.self_attn.rotary.inv_freq", "weights it does not expect"),
])
def test_extra_weights_are_refused_by_name(extra, message, tmp_path):
    path = save_dflash_dir(tmp_path / "d", _cfg(), prefix="model.")
    weights = mx.load(str(path / "model.safetensors"))
    weights["model." + extra] = mx.zeros((4,))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    with pytest.raises(UnsupportedModelError, match=message):
        load_dflash(str(path))


def test_missing_weights_are_named(tmp_path):
    path = save_dflash_dir(tmp_path / "d", _cfg())
    weights = mx.load(str(path / "model.safetensors"))
    weights.pop("model.fc.weight")
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    with pytest.raises(ModelLoadError, match="fc.weight"):
        load_dflash(str(path))


@pytest.mark.parametrize("edit, message", [
    (dict(num_target_layers=36), "36-layer target"),
    (dict(hidden_size=128), "hidden size is 128"),
    (dict(vocab_size=1000), "1000 tokens"),
    (dict(target_layer_ids=(0, 5)), r"reads target layers \[5\]"),
    (dict(mask_token_id=400), "mask token id 400"),
])
def test_a_drafter_for_another_target_is_refused(edit, message):
    from dataclasses import replace

    config = replace(DFlashConfig.from_dict(_cfg()), **edit)
    with pytest.raises(UnsupportedModelError, match=message):
        check_target(config, parts_of("qwen3"))


def test_config_json_round_trip_is_the_publishers_layout(tmp_path):
    path = save_dflash_dir(tmp_path / "d", _cfg(schema="new"))
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and "block_size" in cfg["dflash_config"]
    assert set(mx.load(str(path / "model.safetensors"))) >= {"model.fc.weight", "model.hidden_norm.weight", "model.norm.weight"}


# --- the command line -------------------------------------------------------

@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from specdec_cli.session.synthetic import make_model_dir

    root = tmp_path_factory.mktemp("dflash-cli")
    out = {f: make_model_dir(root / f, f, seed=0) for f in ("qwen3", "qwen3_5")}
    for f in ("qwen3", "qwen3_5"):
        cfg = dflash_config(TINY_CONFIGS[f], layers=2, block_size=6,
                            layer_types=["sliding_attention", "full_attention"], sliding_window=8)
        out[f"{f}-dflash"] = save_dflash_dir(root / f"{f}-dflash", cfg, seed=3)
    two = dflash_config(TINY_CONFIGS["qwen3"], layers=1)
    two["architectures"] = ["DFlash2DraftModel"]
    out["dflash2"] = save_dflash_dir(root / "dflash2", {**two, "architectures": ["DFlashDraftModel"]})
    (out["dflash2"] / "config.json").write_text(json.dumps(two))
    return out


def cli(*args):
    from typer.testing import CliRunner

    from specdec_cli.cli.app import app

    return CliRunner().invoke(app, [*map(str, args)])


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_cli_detects_a_dflash_checkpoint_and_stays_exact(family, dirs):
    result = cli("generate", "--model", dirs[family], "--draft-model", dirs[f"{family}-dflash"], "Hello",
                 "-m", "20", "--json", "--compare-ar", "--no-adaptive")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["drafter"] == "dflash" and report["block_size"] == 6  # the drafter's own
    assert report["compare"]["identical"] and report["drafted"] > 0


def test_cli_text_stats_name_the_drafter_and_block_size_may_be_lowered(dirs):
    result = cli("generate", "--model", dirs["qwen3"], "--draft-model", dirs["qwen3-dflash"], "Hi",
                 "-m", "8", "--block-size", "3", "--draft-p-min", "0.5")
    assert result.exit_code == 0, result.output
    assert "dflash" in result.stderr


@pytest.mark.parametrize("args, code, message", [
    (["--model", "qwen3", "--draft-model", "qwen3-dflash", "--block-size", "9"], 2, "at most 6 tokens"),
    (["--model", "qwen3", "--draft-model", "qwen3_5-dflash"], 1, "trained on a 4-layer target"),
    (["--model", "qwen3", "--draft-model", "dflash2"], 1, "DFlash2DraftModel"),
    # Searched for an MTP head, it was refused as "no mtp.* tensors ... or use --drafter lookup".
    (["--model", "qwen3", "--draft-model", "qwen3-dflash", "--drafter", "mtp"], 2,
     "qwen3-dflash is a DFlash drafter, not an MTP head: drop --drafter mtp (a DFlash drafter is detected)"),
])
def test_cli_refusals_are_one_line_before_generating(dirs, args, code, message):
    result = cli("generate", *[dirs.get(a, a) for a in args], "Hi", "-m", "8")
    assert result.exit_code == code, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in result.output
    assert not result.stdout.strip()


def test_cli_sweep_and_hub_ids(dirs, monkeypatch):
    import specdec_cli.model.files as files

    known = {"z-lab/tiny-DFlash": dirs["qwen3-dflash"], "org/tiny-qwen3": dirs["qwen3"]}
    monkeypatch.setattr(files.huggingface_hub, "snapshot_download", lambda repo_id, **kw: str(known[repo_id]))
    result = cli("sweep", "--model", "org/tiny-qwen3", "--draft-model", "z-lab/tiny-DFlash", "Hi",
                 "-m", "8", "--block-sizes", "2,6", "--warmup", "0", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["drafter"] == "dflash (z-lab/tiny-DFlash)"
    assert all(row["identical"] for row in report["rows"])


# --drafter auto picks a DFlash --draft-model and must load it (issue 28: it crashed reading its config).

@pytest.mark.parametrize("command, json_output", [("generate", False), ("generate", True), ("sweep", True)])
def test_cli_auto_loads_and_runs_the_dflash_drafter_it_picks(dirs, command, json_output):
    args = [command, "--model", dirs["qwen3"], "--draft-model", dirs["qwen3-dflash"], "--drafter", "auto", "Hi",
            "-m", "8"]
    args += ["--json"] if json_output else []
    args += ["--block-sizes", "2,6", "--warmup", "0"] if command == "sweep" else ["--compare-ar"]
    result = cli(*args)
    assert result.exit_code == 0, result.output
    assert "drafter: auto -> dflash" in result.stderr and "Traceback" not in result.output
    if command == "sweep":
        report = json.loads(result.stdout)
        assert report["drafter"].startswith("dflash") and all(row["identical"] for row in report["rows"])
    elif json_output:
        report = json.loads(result.stdout)
        assert report["drafter"] == "dflash" and report["block_size"] == 6  # the drafter's own
        assert report["compare"]["identical"] and report["drafted"] > 0
    else:
        assert "Drafter: dflash" in result.stderr and "block size 6" in result.stderr


def test_cli_sweep_names_its_own_option_past_the_dflash_block_size(dirs):
    result = cli("sweep", "--model", dirs["qwen3"], "--draft-model", dirs["qwen3-dflash"], "Hi", "-m", "8",
                 "--block-sizes", "2,9", "--warmup", "0")
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "give --block-sizes <= 6" in errors[0]
