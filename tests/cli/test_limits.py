"""The model's context and the device's memory: refused before the prefill, or stopped at, with both figures."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cli_fixtures import generate, models, one_line  # noqa: F401 (models: a fixture)
import specdec_cli.cli.commands as commands
import specdec_cli.session.setup as session_setup
from specdec_cli.cli.app import app
from specdec_cli.cache.caches import ModelCache, make_cache
from specdec_cli.cache.limits import cache_bytes, context_length
from specdec_cli.session.loading import load


def test_context_length_from_the_config():
    assert context_length({"max_position_embeddings": 8192}) == (8192, "max_position_embeddings")
    yarn = {"max_position_embeddings": 32768,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert context_length(yarn)[0] == 131072
    # llama3 scaling states the extended length in max_position_embeddings already.
    llama3 = {"max_position_embeddings": 131072,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}}
    assert context_length(llama3)[0] == 131072
    assert context_length({"text_config": {"max_position_embeddings": 2048}})[0] == 2048
    assert context_length({"n_positions": 1024})[0] == 1024
    assert context_length({"model_type": "mamba"}) is None


def test_a_prompt_longer_than_the_context_is_refused_before_prefill(models, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("prefill ran")

    monkeypatch.setattr(ModelCache, "prefill", never)
    result = generate("--model", models["small-context"], "x" * 100, "--ignore-chat-template")
    assert result.exit_code == 1
    line = one_line(result)
    assert "100 tokens" in line and "context is 64 tokens" in line and "max_position_embeddings" in line


def test_generation_stops_at_the_context(models):
    result = generate("--model", models["small-context"], "y" * 40, "--ignore-chat-template", "-m", "500",
                      "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    if report["finish_reason"] != "eos":  # random weights may end earlier
        assert report["finish_reason"] == "context" and report["generated_tokens"] == 64 - 40
        assert report["context_length"] == 64
        assert result.stderr.count("Stopped at the model's context: 64 tokens") == 1


def test_the_memory_estimate_counts_the_cache_as_built(models):
    model = load(str(models["kv-llama"])).model
    for kv in (None, 4):
        cache = ModelCache(model, make_cache(model, kv_bits=kv, kv_group_size=32) if kv else None)
        cache.prefill(list(range(256)), 64)  # a whole 256-slot buffer: nothing allocated unused
        built = sum(a.nbytes for a in cache.state_arrays())
        assert cache_bytes(model, 256, kv, 32) == built


def test_a_run_over_the_device_memory_is_refused_with_both_figures(models, monkeypatch):
    monkeypatch.setattr(session_setup, "device_memory", lambda: (1000, "available RAM"))
    result = generate("--model", models["llama"], "Hi", "-m", "8")
    assert result.exit_code == 1
    line = one_line(result)
    assert "needs about" in line and "0.00 GB (available RAM)" in line and "--no-memory-check" in line
    assert generate("--model", models["llama"], "Hi", "-m", "8", "--no-memory-check").exit_code == 0


def test_a_sweep_whose_prompt_leaves_no_room_to_draft_is_refused(models, monkeypatch):
    # -m 128 asked, but the context caps generation at 1 token: no block could draft.
    monkeypatch.setattr(commands, "sweep", lambda *a, **k: pytest.fail("the sweep ran"))
    result = CliRunner().invoke(app, ["sweep", "--model", str(models["small-context"]), "x" * 63,
                                      "--ignore-chat-template", "--block-sizes", "2"])
    assert result.exit_code == 2
    line = one_line(result)
    assert "63 tokens in the model's context of 64 leave room for 1" in line and "shorten the prompt" in line


@pytest.mark.parametrize("recommended", [None, 96 << 30])
def test_the_recommended_working_set_is_wired_where_the_device_names_one(models, monkeypatch, recommended):
    # mlx-lm's generate, server and trainer wire it on Apple silicon (Metal reports the figure; this CPU
    # does not): unwired, a large model's weights are paged out between forwards.
    import mlx.core as mx

    info = mx.device_info()
    wired = []
    monkeypatch.setattr(mx, "device_info", lambda: {**info, "max_recommended_working_set_size": recommended})
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: wired.append(n) or 0)
    result = generate("--model", models["llama"], "Hi", "-m", "2")
    assert result.exit_code == 0, result.output
    assert wired == ([recommended] if recommended else [])
