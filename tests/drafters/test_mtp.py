"""MTP heads as drafters (``specdec_cli/drafters/mtp.py``).

Targets are tiny random Qwen3.5 (dense, GatedDeltaNet hybrid) and Qwen3-Next
(sparse MoE, hybrid) models saved in the original Hugging Face layout with an
``mtp.*`` head (zero-centred norms), and the same heads as sidecars. Heads
that must be accepted are trained for a few seconds on the target's own greedy
text (``mtp_fixtures.fitted_head``).

Fidelity: mlx-vlm 0.7.10's ``qwen3_5_mtp`` drafter (a test-only dependency,
installed ``--no-deps``; only its drafter modules are imported) loads the same
``mtp.*`` tensors through its own ``sanitize`` (its +1 norm shift, its expert
stacking) and runs on the same post-norm target states: mlx-vlm's own
Qwen3.5 verify passes the final-normed state (``return_hidden`` appends the
output of ``self.norm``), as we do.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import types

import mlx.core as mx
import mlx.nn as nn
import pytest
from helpers import fed, max_cache_diff
from mtp_fixtures import (
    PROMPT,
    fitted_head,
    head_config,
    head_hf,
    hf_checkpoint,
    qwen3_5_mtp_sidecar,
    target,
    target_rows,
    text_config,
)
from typer.testing import CliRunner

from specdec_cli.cache.caches import ModelCache
from specdec_cli.cli.app import app
from specdec_cli.drafters.mtp import MTPDrafter
from specdec_cli.drafters.mtp_head import MTPConfig, random_head
from specdec_cli.drafters.mtp_io import build_head, hf_to_head, load_head, save_head
from specdec_cli.loop.engine import speculative_generate_step
from specdec_cli.errors import UnsupportedModelError
from specdec_cli.drafters.mtp_io import load_mtp
from specdec_cli.model.files import read_config
from specdec_cli.session.loading import load
from specdec_cli.loop.events import collect
from specdec_cli.loop.runner import run
from specdec_cli.model.taps import Hidden, HiddenTap, target_parts

FAMILIES = ["qwen3_5", "qwen3_next"]
GEN = 60


@functools.cache
def mlx_vlm_drafter():
    """mlx-vlm's Qwen3.5 MTP drafter classes, without importing its whole package.

    ``mlx_vlm/__init__`` pulls in its server, audio and vision stacks; the
    drafter itself needs only mlx, numpy and Pillow. The packages on the way
    are registered as bare namespaces so only the drafter's modules run.
    """
    spec = importlib.util.find_spec("mlx_vlm")
    if spec is None:
        pytest.skip("mlx-vlm is not installed (pip install --no-deps 'mlx-vlm==0.7.10' pillow)")
    root = os.path.dirname(spec.origin)
    for name in ["mlx_vlm", "mlx_vlm.speculative", "mlx_vlm.speculative.drafters", "mlx_vlm.models",
                 "mlx_vlm.models.qwen3_5", "mlx_vlm.models.qwen3_5_moe",
                 "mlx_vlm.speculative.drafters.qwen3_5_mtp"]:
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [os.path.join(root, *name.split(".")[1:])]
            sys.modules[name] = module
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.config import Qwen3_5MTPConfig
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.qwen3_5_mtp import Qwen3_5MTPDraftModel

    return Qwen3_5MTPConfig, Qwen3_5MTPDraftModel


def mlx_vlm_head(family: str, raw: dict):
    """mlx-vlm's drafter loaded from HF ``mtp.*`` tensors through its own sanitize."""
    config_cls, model_cls = mlx_vlm_drafter()
    tc = dict(text_config(family))
    if family == "qwen3_next":
        # What mlx-vlm's Qwen3NextMTPSplitter.read_text_config does for this family.
        rot = int(tc["head_dim"] * tc["partial_rotary_factor"])
        tc["rope_parameters"] = {"type": "default", "rope_theta": tc["rope_theta"],
                                 "partial_rotary_factor": tc["partial_rotary_factor"],
                                 "mrope_section": [rot // 2, 0, 0]}
        tc["mtp_num_hidden_layers"] = tc.pop("num_nextn_predict_layers")
    theirs = model_cls(config_cls.from_dict({"model_type": "qwen3_5_mtp", "text_config": tc}))
    theirs.load_weights(list(theirs.sanitize(dict(raw)).items()), strict=True)
    mx.eval(theirs.parameters())
    return theirs


@pytest.mark.parametrize("family", FAMILIES + ["qwen3_5_moe"])
def test_head_logits_equal_mlx_vlm_qwen3_5_mtp(family):
    model = target(family)
    parts = target_parts(model)
    head = random_head(head_config(family), seed=3)  # norms 1 + noise: a lost shift shows
    raw = head_hf(head, family)
    ours = build_head(head_config(family), hf_to_head(raw))
    theirs = mlx_vlm_head(family, raw)
    theirs.reset(model)
    rows = target_rows(model, PROMPT)
    n = len(PROMPT) - 1
    # Prefill: pairs (h_t, x_{t+1}) at positions 0 .. n-1, both sides.
    x = mx.array(PROMPT[1:], dtype=mx.uint32)[None]
    o_theirs = theirs._forward_tokens(x.astype(mx.int32), rows[None, :n], mx.int32)
    cache = ours.make_cache()
    o_ours = ours(parts.embed(x[0])[None], rows[None, :n], cache)
    worst = mx.abs(parts.logits(o_theirs) - parts.logits(o_ours)).max().item()
    scale = mx.abs(parts.logits(o_ours)).max().item()
    # Depth 2..4: each side feeds its own normed output back as h.
    a, b = o_theirs[:, -1:], o_ours[:, -1:]
    for _ in range(3):
        tok = mx.argmax(parts.logits(b), axis=-1).astype(mx.uint32)
        a = theirs._forward_tokens(tok.astype(mx.int32), a, mx.int32)
        b = ours(parts.embed(tok[0])[None], b, cache)
        worst = max(worst, mx.abs(parts.logits(a) - parts.logits(b)).max().item())
    assert scale > 1.0 and worst < 1e-5 * scale, (worst, scale)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_drafts_equal_mlx_vlm_draft_block(family):
    # Their public flow: prefill from the target states with the bonus token, then draft a block.
    model = target(family)
    parts = target_parts(model)
    head = fitted_head(family)
    theirs = mlx_vlm_head(family, head_hf(head, family))
    theirs.reset(model)
    rows = target_rows(model, PROMPT)
    ids = mx.array(PROMPT[:-1], dtype=mx.int32)[None]
    theirs.prefill_from_target_hidden(ids, rows[None], PROMPT[-1], None, greedy=True)
    want = theirs.draft_block(PROMPT[-1], rows[None, -1:], None, 4, None, greedy=True)[0].tolist()
    drafter = MTPDrafter(head, parts)
    drafter.prefill(PROMPT[:-1], hidden=Hidden(final=rows[:-1]))
    assert drafter.propose(PROMPT[-1], 3).tokens.tolist() == want


def test_norm_shift_follows_the_layout(tmp_path):
    # The same head read from the HF checkpoint (zero-centred mtp.* norms, shifted
    # on load), mlx-vlm's sidecar and ours (stored shifted, used as is) computes
    # the same logits as the head in memory. A dropped or doubled +1 moves every
    # norm by 1 and changes the output (checked below, so the test has teeth).
    family = "qwen3_5"
    model = target(family)
    parts = target_parts(model)
    head = random_head(head_config(family), seed=4)
    dirs = {
        "hf": hf_checkpoint(tmp_path / "hf", family, head),
        "hf-mtp-file": hf_checkpoint(tmp_path / "hf2", family, head, mtp_file=True),
        "qwen3_5_mtp": qwen3_5_mtp_sidecar(tmp_path / "vlm", family, head),
        "specdec_mtp": save_head(tmp_path / "ours", head),
    }
    rows = target_rows(model, PROMPT)
    x = parts.embed(mx.array(PROMPT[1:], dtype=mx.uint32))[None]

    def out(h):
        return parts.logits(h(x, rows[None, :-1], h.make_cache()))

    want = out(head)
    for name, path in dirs.items():
        loaded = load_head(path, read_config(path), name, parts)
        assert loaded.layout == ("hf" if name.startswith("hf") else "sidecar")
        assert mx.array_equal(out(loaded.head), want).item(), name
    raw = mx.load(str(dirs["hf"] / "model.safetensors"))
    assert abs(raw["mtp.norm.weight"].mean().item()) < 0.1  # stored zero-centred
    for delta in (-1.0, 1.0):  # shift dropped, shift doubled
        weights = hf_to_head({k: v for k, v in raw.items() if k.startswith("mtp.")})
        weights = {k: v + delta if k.endswith("norm.weight") else v for k, v in weights.items()}
        wrong = build_head(head_config(family), weights)
        assert mx.abs(out(wrong) - want).max().item() > 0.1


def run_spec(model, drafter, k, rollback, prompt=PROMPT, max_tokens=GEN, sampling=None):
    """Speculative decoding through the engine, leaving the caches to inspect."""
    cache = ModelCache(model)
    with HiddenTap(model, drafter.taps) as tap:
        parts = cache.prefill(prompt[:-1], 16, tap)
        drafter.prefill(prompt[:-1], 16, Hidden.concat(parts))
        kwargs = {} if sampling is None else {"sampling": sampling}
        blocks = list(speculative_generate_step(prompt[-1], cache, drafter, num_draft_tokens=k,
                                                max_tokens=max_tokens, rollback=rollback, tap=tap, **kwargs))
    return blocks, cache


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k,rollback", [(1, "carry"), (3, "carry"), (3, "reforward"), (6, "carry")])
def test_speculative_equals_plain_and_caches_roll_back_exactly(tmp_path, family, k, rollback):
    model = target(family)
    parts = target_parts(model)
    _, plain = collect(run(model, PROMPT, max_tokens=GEN))
    head = fitted_head(family)
    drafter = MTPDrafter(head, parts)
    blocks, cache = run_spec(model, drafter, k, rollback)
    out = [t for b in blocks for t in b.tokens]
    assert out == plain
    assert all(b.syncs == 1 for b in blocks)  # the draft chain is evaluated with the verify
    drafted, accepted = sum(b.drafted for b in blocks), sum(b.accepted for b in blocks)
    if k <= 3:
        assert any(b.accepted == b.drafted > 0 for b in blocks)  # full accepts (bonus bookkeeping)
    if k > 1:
        assert 0 < accepted < drafted  # and partial accepts
    # The hybrid target's caches equal those plain decoding builds from the same tokens.
    consumed = PROMPT + out[:-1]
    assert max_cache_diff(cache, fed(model, consumed)) < 1e-4
    # The head's cache holds exactly the pairs (h_t, x_{t+1}) built from the
    # target's own states, as one forward over the whole text gives them.
    rows = target_rows(model, consumed)
    n = drafter.offset
    assert len(consumed) - 1 - n <= k + 1  # only the last block's pairs may wait
    direct = head.make_cache()
    head(parts.embed(mx.array(consumed[1 : n + 1], dtype=mx.uint32))[None], rows[None, :n], direct)
    for a, b in zip(drafter.cache, direct):
        assert a.offset == b.offset == n
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert mx.abs(x[..., :n, :] - y[..., :n, :]).max().item() < 1e-4


def test_p_min_stops_drafting_early():
    model = target("qwen3_5")
    parts = target_parts(model)
    _, plain = collect(run(model, PROMPT, max_tokens=GEN))
    full, _ = run_spec(model, MTPDrafter(fitted_head("qwen3_5"), parts), 6, "carry")
    short, _ = run_spec(model, MTPDrafter(fitted_head("qwen3_5"), parts, p_min=0.9), 6, "carry")
    assert [t for b in short for t in b.tokens] == plain
    assert sum(b.drafted for b in short) < sum(b.drafted for b in full)
    assert all(b.syncs > 1 for b in short if b.drafted)


def test_one_token_prompt_and_cancel_keep_the_pairs_aligned():
    model = target("qwen3_5")
    parts = target_parts(model)
    prompt = PROMPT[:1]
    _, plain = collect(run(model, prompt, max_tokens=20))
    blocks, _ = run_spec(model, MTPDrafter(fitted_head("qwen3_5"), parts), 3, "carry", prompt=prompt, max_tokens=20)
    assert [t for b in blocks for t in b.tokens] == plain
    # An interrupted block (propose, then cancel) leaves the drafter as it was.
    drafter = MTPDrafter(fitted_head("qwen3_5"), parts)
    rows = target_rows(model, PROMPT)
    drafter.prefill(PROMPT[:-1], hidden=Hidden(final=rows[:-1]))
    first = drafter.propose(PROMPT[-1], 3).tokens.tolist()
    drafter.cancel()
    assert drafter.propose(PROMPT[-1], 3).tokens.tolist() == first
    # Interrupted after its accept (the engine hands a block over, then the interrupt lands): cancel undoes both,
    # as lookup's does.
    before = (drafter.offset, len(drafter._rows), len(drafter._tokens))
    drafter.accept(2, Hidden(final=mx.concatenate([rows[-1:]] * 3)))
    assert (drafter.offset, len(drafter._rows), len(drafter._tokens)) != before
    drafter.cancel()
    assert drafter.propose(PROMPT[-1], 3).tokens.tolist() == first


@pytest.mark.parametrize("draft_vocab", [0, 8])
def test_sampling_with_an_mtp_head_is_lossless(draft_vocab):
    # A plain attention + MLP head (no Qwen gate, no q/k norm, full RoPE) on the
    # 16-token llama of test_sampling: q is the head's own distribution, over
    # every token or (draft_vocab 8) over the even ones only, zero elsewhere.
    from test_sampling import PLAIN, POSITIONS, PROMPT as SPROMPT, VOCAB, chi_square, exact_marginals, models

    model, _ = models()
    parts = target_parts(model)
    config = MTPConfig(hidden_size=32, vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, intermediate_size=64, draft_vocab_size=draft_vocab)
    head = random_head(config, seed=2)
    cache = ModelCache(model)
    with HiddenTap(model, MTPDrafter.taps) as tap:
        rows = Hidden.concat(cache.prefill(SPROMPT[:-1], 64, tap))
        snap = cache.snapshot()
        mx.random.seed(0)
        counts = [[0] * VOCAB for _ in range(POSITIONS)]
        drafted = accepted = 0
        for _ in range(1200):
            cache.restore(snap)
            drafter = MTPDrafter(head, parts)
            drafter.prefill(SPROMPT[:-1], 64, rows)
            blocks = speculative_generate_step(SPROMPT[-1], cache, drafter, num_draft_tokens=3,
                                               max_tokens=POSITIONS, sampling=PLAIN, tap=tap)
            out = []
            for b in blocks:
                out += b.tokens
                drafted, accepted = drafted + b.drafted, accepted + b.accepted
            for i, tok in enumerate(out):
                counts[i][tok] += 1
    assert accepted >= 50 and drafted - accepted >= 50, (accepted, drafted)
    exact = exact_marginals(PLAIN)
    for pos in range(POSITIONS):
        stat, critical = chi_square(counts[pos], exact[pos])
        assert stat < critical, f"position {pos + 1}: chi2 {stat:.1f} >= {critical:.1f}"


# Refusals, before the first token


def test_target_without_a_head_is_refused(tmp_path):
    path = hf_checkpoint(tmp_path / "t", "qwen3_5", None)
    with pytest.raises(UnsupportedModelError, match="has no MTP head"):
        load_mtp(None, None, load(str(path)))


def test_head_for_another_model_is_refused(tmp_path):
    loaded = load(str(hf_checkpoint(tmp_path / "t", "qwen3_5", None)))
    narrow = MTPConfig(hidden_size=32, vocab_size=259, num_attention_heads=2, num_key_value_heads=2,
                       head_dim=16, intermediate_size=64)
    with pytest.raises(UnsupportedModelError, match="width 32, the target's are 64"):
        load_mtp(str(save_head(tmp_path / "narrow", random_head(narrow))), None, loaded)
    other_vocab = MTPConfig(**{**head_config("qwen3_5").to_dict(), "vocab_size": 1000})
    with pytest.raises(UnsupportedModelError, match="vocabulary of 1000 tokens, the target has 259"):
        load_mtp(str(save_head(tmp_path / "vocab", random_head(other_vocab))), None, loaded)


def test_several_mtp_layers_are_refused(tmp_path):
    path = hf_checkpoint(tmp_path / "t", "qwen3_5", random_head(head_config("qwen3_5")))
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 2
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="has 2 MTP layers"):
        load_mtp(None, None, load(str(path)))


def test_quantized_sidecar_loads_with_its_quantization(tmp_path):
    from mlx.utils import tree_flatten

    family = "qwen3_next"  # the MoE head: quantized experts too
    model = target(family)
    parts = target_parts(model)
    head = random_head(head_config(family), seed=5)
    nn.quantize(head, group_size=32, bits=8)
    path = save_head(tmp_path / "q", head)
    config = json.loads((path / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 8}
    (path / "config.json").write_text(json.dumps(config))
    loaded = load_head(path, config, "q", parts)
    assert isinstance(loaded.head.fc, nn.QuantizedLinear)
    assert {k for k, _ in tree_flatten(loaded.head.parameters())} == {k for k, _ in tree_flatten(head.parameters())}
    rows = target_rows(model, PROMPT)
    x = parts.embed(mx.array(PROMPT[1:], dtype=mx.uint32))[None]
    a = parts.logits(loaded.head(x, rows[None, :-1], loaded.head.make_cache()))
    b = parts.logits(head(x, rows[None, :-1], head.make_cache()))
    assert mx.array_equal(a, b).item()


# CLI


def _cli(*args):
    return CliRunner().invoke(app, ["generate", "-p", bytes(PROMPT).decode(), "--ignore-chat-template",
                                    "-m", "40", "--no-live", *args])


@pytest.mark.parametrize("source", ["target", "sidecar", "mtp-file"])
def test_cli_drafts_with_the_mtp_head(tmp_path, source):
    family = "qwen3_next" if source == "mtp-file" else "qwen3_5"
    head = fitted_head(family)
    path = hf_checkpoint(tmp_path / "t", family, None if source == "sidecar" else head,
                         mtp_file=source == "mtp-file")
    args = ["--model", str(path), "--compare-ar", "--json"]
    if source == "sidecar":
        args += ["--draft-model", str(save_head(tmp_path / "side", head))]  # no --drafter: detected
    else:
        args += ["--drafter", "mtp"]
    result = _cli(*args)
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["drafter"] == "mtp"
    assert report["compare"]["identical"]
    assert report["accepted"] > 0


def test_cli_refuses_mtp_without_a_head(tmp_path):
    path = hf_checkpoint(tmp_path / "t", "qwen3_5", None)
    result = _cli("--model", str(path), "--drafter", "mtp")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert "has no MTP head" in result.stderr and "Traceback" not in result.stderr
    result = _cli("--model", str(path), "--drafter", "lookup", "--draft-model", str(path))
    assert result.exit_code == 2 and "--drafter model, mtp or auto" in result.stderr


def test_cli_names_drafter_mtp_for_a_head_given_as_a_draft_model(tmp_path, monkeypatch):
    import specdec_cli.session.setup as session_setup

    path = hf_checkpoint(tmp_path / "t", "qwen3_5", None)
    side = save_head(tmp_path / "side", random_head(head_config("qwen3_5"), seed=3))
    # Refused from the head's config alone, before the target loads.
    monkeypatch.setattr(session_setup, "load_target", lambda opts: pytest.fail("the target was loaded"))
    result = _cli("--model", str(path), "--drafter", "model", "--draft-model", str(side))
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "is an MTP head, not a draft model: pass --drafter mtp" in result.stderr
    assert "upgrade mlx-lm" not in result.stderr
