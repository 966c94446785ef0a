"""The hooks into mlx-lm model internals (``specdec_cli/model/taps.py``, ``specdec_cli/model/recurrent.py``).

These fail loudly when the pinned mlx-lm moves what the hooks rely on: where
the decoder layers, the final norm, the embedding and the lm_head live, and
that a decoder layer's output is the residual stream. And an installation
that fails midway leaves every instance with its own class.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import PROMPT, target

from specdec_cli.drafters import ModelDrafter
from specdec_cli.loop.events import collect
from specdec_cli.loop.runner import run
from specdec_cli.model.taps import Hidden, HiddenTap, TapSpec, target_parts

FAMILIES = ["llama", "qwen3", "gemma3_text", "qwen3_5", "nemotron_h"]


def tapped_forward(model, ids, spec):
    """One forward over ``ids`` with fresh caches, and what the tap recorded."""
    from specdec_cli.cache.caches import ModelCache

    cache = ModelCache(model)
    with HiddenTap(model, spec) as tap:
        logits = cache.feed(mx.array(ids, dtype=mx.uint32))
        return logits, tap.take()


@pytest.mark.parametrize("family", FAMILIES)
def test_final_state_through_the_lm_head_is_the_logits(family):
    model = target(family, "float32")
    parts = target_parts(model)
    logits, hidden = tapped_forward(model, PROMPT, TapSpec(final=True))
    assert hidden.final.shape == (len(PROMPT), parts.hidden_size)
    assert mx.array_equal(parts.logits(hidden.final[None])[0], logits).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_last_layer_output_is_the_residual_stream_before_the_final_norm(family):
    # norm(output of the last decoder layer) == the final-normed state: the
    # layer tap sits where Hugging Face's hidden_states[id + 1] does.
    from specdec_cli.model.taps import _backbone

    model = target(family, "float32")
    stack, layers, norm, _ = _backbone(model)
    last = len(layers) - 1
    _, hidden = tapped_forward(model, PROMPT, TapSpec(layers=(0, last), final=True))
    assert len(hidden.layers) == 2 and hidden.layers[0].shape == hidden.final.shape
    assert mx.array_equal(stack[norm](hidden.layers[1]), hidden.final).item()
    assert not mx.array_equal(hidden.layers[0], hidden.layers[1]).item()


def test_tap_is_per_instance_and_comes_off():
    model = target("llama", "float32")
    layer = model.model.layers[0]
    cls = type(layer)
    with HiddenTap(model, TapSpec(layers=(0,), final=True)):
        assert type(layer) is not cls and isinstance(layer, cls)
        assert type(model.model.layers[1]) is cls  # other instances untouched
        with pytest.raises(RuntimeError, match="already installed"):
            HiddenTap(model, TapSpec(layers=(0,)))
    assert type(layer) is cls
    assert type(model.model.norm).__name__ == "RMSNorm"


def test_bad_layer_id_is_refused():
    from specdec_cli.errors import UnsupportedModelError

    model = target("llama", "float32")
    with pytest.raises(UnsupportedModelError, match="layer 99"):
        HiddenTap(model, TapSpec(layers=(99,)))
    assert type(model.model.layers[0]).__name__ == "TransformerBlock"


def classes(model) -> list[type]:
    return [type(m) for m in model.modules()]


def test_a_tap_that_fails_midway_leaves_every_layer_its_own_class(monkeypatch):
    import specdec_cli.model.taps as taps

    model = target("llama", "float32")
    before = classes(model)
    real, installed = taps._tap, []

    def tap_then_fail(module, sink):
        if installed:
            raise RuntimeError("second tap failed")
        real(module, sink)
        installed.append(module)

    monkeypatch.setattr(taps, "_tap", tap_then_fail)
    with pytest.raises(RuntimeError, match="second tap failed"):
        HiddenTap(model, TapSpec(layers=(0, 1), final=True))
    assert installed and type(installed[0]) is not before[0]  # the first tap had gone in
    assert classes(model) == before


class RecordingDrafter(ModelDrafter):
    """A draft model that also collects the target rows the engine hands over."""

    taps = TapSpec(layers=(0, 1), final=True)

    def __init__(self, model):
        super().__init__(model)
        self.rows: list[Hidden] = []

    def prefill(self, tokens, step_size=2048, hidden=None):
        self.rows.append(hidden)
        super().prefill(tokens, step_size)

    def accept(self, n, hidden=None):
        assert hidden is not None and hidden.length == n + 1
        self.rows.append(hidden)
        super().accept(n)


@pytest.mark.parametrize("family,rollback", [("llama", "carry"), ("qwen3_5", "carry"), ("qwen3_5", "reforward")])
def test_engine_hands_over_the_committed_rows_of_its_own_forwards(family, rollback):
    from helpers import noisy_drafter

    model = target(family, "float32")
    drafter = RecordingDrafter(noisy_drafter(family, "float32"))
    stats, out = collect(run(model, PROMPT, drafter=drafter, num_draft_tokens=4, max_tokens=30,
                             rollback=rollback, prefill_step_size=16))
    assert 0 < stats.accepted < stats.drafted  # partial accepts happened
    got = Hidden.concat(drafter.rows)
    fed = PROMPT + out[:-1]  # every token the target consumed (the last is never fed)
    assert got.length == len(fed)
    _, want = tapped_forward(model, fed, RecordingDrafter.taps)
    for a, b in zip(got.layers + (got.final,), want.layers + (want.final,)):
        assert a.shape == b.shape
        assert mx.abs(a - b).max().item() < 1e-4
    # The tap is off the model once the run is over.
    assert "_specdec_base" not in type(model.model.layers[0]).__dict__


def test_embedding_is_what_the_first_layer_receives_gemma_scale_included():
    # gemma3_text rounds sqrt(hidden) through bfloat16 (sqrt(80) = 8.944 -> 8.9375); the
    # embedding drafters reuse must be exactly what its first layer gets.
    import copy

    from specdec_cli.session.synthetic import TINY_CONFIGS, build_model

    cfg = copy.deepcopy(TINY_CONFIGS["gemma3_text"])
    cfg.update(hidden_size=80, head_dim=20, query_pre_attn_scalar=20)
    model = build_model(cfg, seed=0)
    parts = target_parts(model)  # the probe compares against layer 0's input
    ids = mx.array(PROMPT[:6], dtype=mx.uint32)
    exact = parts.embed(ids)
    plain = parts.embed_tokens(ids) * (80**0.5)
    assert not mx.array_equal(exact, plain).item()


@pytest.mark.parametrize("family", ["granite", "minicpm"])
def test_a_transformed_embedding_is_refused(family):
    # These scale the embedding by a config multiplier before the first layer.
    from zoo_configs import ZOO

    from specdec_cli.errors import UnsupportedModelError
    from specdec_cli.session.synthetic import build_model

    model = build_model(ZOO[family], seed=0)
    with pytest.raises(UnsupportedModelError, match="first decoder layer receives"):
        target_parts(model)


# --- recurrent-layer hooks (capture / tape / one-token-formula verify): recurrent.py ------


def test_the_step_functions_keep_the_signatures_the_hooks_bind():
    # The wrappers re-slice these arguments per token and call mlx-lm's own
    # function with them: a renamed or reordered argument must fail here.
    import inspect

    from mlx_lm.models import gated_delta, mamba, ssm

    gdn = list(inspect.signature(gated_delta.gated_delta_update).parameters)
    assert gdn[:9] == ["q", "k", "v", "a", "b", "A_log", "dt_bias", "state", "mask"]
    ssm_params = list(inspect.signature(ssm.ssm_update).parameters)
    assert ssm_params == ["hidden_states", "A_log", "B", "C", "D", "dt", "dt_bias", "state", "time_step_limit",
                          "mask", "lengths"]
    assert list(inspect.signature(mamba.MambaBlock.ssm_step).parameters) == ["self", "x", "A", "state"]


@pytest.mark.parametrize("family,kind", [("qwen3_5", "GatedDeltaNet"), ("nemotron_h", "Mamba2")])
def test_recurrent_hooks_install_and_pass_their_probe(family, kind):
    from specdec_cli.model.recurrent import RecurrentSteps
    from specdec_cli.session.synthetic import TINY_CONFIGS, build_model

    model = build_model(TINY_CONFIGS[family], seed=3, dtype=mx.float32)
    steps = RecurrentSteps(model)
    try:
        assert steps.covered, steps.problem
        assert steps.kinds and set(steps.kinds) == {kind}
    finally:
        steps.close()
    assert not any("_specdec_steps_base" in vars(type(m)) for m in model.modules())


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
@pytest.mark.parametrize("where", ["install", "probe"])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_recurrent_hooks_that_fail_midway_leave_every_instance_its_own_class(monkeypatch, family, where, error):
    # Not one of the refusals the hooks expect (those fall back and say why): the error propagates,
    # after the mixers already hooked (the first of two, or all before the probe) got their classes back.
    import specdec_cli.model.recurrent as recurrent
    from specdec_cli.session.synthetic import TINY_CONFIGS, build_model

    model = build_model(TINY_CONFIGS[family], seed=3, dtype=mx.float32)
    before = classes(model)
    real_install, hooked = recurrent.RecurrentSteps._install, []

    def install(self, mixer, adapter, calls):
        if where == "install" and hooked:
            raise error("the second mixer failed")
        real_install(self, mixer, adapter, calls)
        hooked.append(mixer)

    def probe(self, model):
        raise error("the probe failed")

    monkeypatch.setattr(recurrent.RecurrentSteps, "_install", install)
    if where == "probe":
        monkeypatch.setattr(recurrent.RecurrentSteps, "_probe", probe)
    with pytest.raises(error, match="failed"):
        recurrent.recurrent_steps(model)
    assert len(hooked) == (1 if where == "install" else 2)
    assert classes(model) == before
    assert getattr(model, "_specdec_steps", None) is None
