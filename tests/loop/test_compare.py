"""Warm-up before timing, and --compare-ar's verdicts: identical, a proven rounding tie, or diverged.

A rounding tie is made on the CPU, whose kernels are exact, with a target whose
multi-row forwards run slightly perturbed weights (``TwoPathModel``): the
stand-in for a GPU whose batched kernels round differently from its one-row
ones. A real bug is a speculative run whose rollback keeps one row too many.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from helpers import (
    GEN,
    PROMPT,
    TwoPathModel,
    cache_arrays,
    fed,
    kernels_agree,
    max_cache_diff,
    noisy_drafter,
    plain,
    prefilled,
    target,
    tokens,
    two_path,
)
from typer.testing import CliRunner

import specdec_cli.session.setup as session_setup
import specdec_cli.loop.plain as plain_module
from specdec_cli.cli.app import app
from specdec_cli.loop.compare import DIVERGED, IDENTICAL, TIE, explain, recompute
from specdec_cli.drafters import ModelDrafter
from specdec_cli.loop.engine import Engine, speculative_generate_step, verify_rows
from specdec_cli.loop.plain import warm_up
from specdec_cli.model.files import Loaded
from specdec_cli.session.measure import sweep
from specdec_cli.session.options import ModelOptions
from specdec_cli.session.setup import Setup
from specdec_cli.loop.events import collect
from specdec_cli.loop.runner import run
from specdec_cli.core.sampling import SamplingParams
from specdec_cli.session.synthetic import TINY_CONFIGS, build_model, make_model_dir, perturb


def fresh(family: str, dtype: str = "bfloat16", noise: float = 0.0):
    # A model no other test has run: every shape is new to it in this process.
    model = build_model(TINY_CONFIGS[family], seed=0, dtype=getattr(mx, dtype))
    if noise:
        perturb(model, noise, seed=1000)
    return model


# --- warm-up ---------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_5", "nemotron_h"])
def test_warm_up_runs_every_shape_and_leaves_caches_and_drafter_as_they_were(family):
    model, draft = fresh(family), fresh(family, noise=0.05)
    cache = prefilled(model)
    drafter = ModelDrafter(draft)
    drafter.prefill(PROMPT[:-1])
    before = [mx.array(a) for a in cache_arrays(cache)]
    what = warm_up(cache, drafter, max_draft=4, rollback="carry", force=True)
    # Every verify length, carried tokens included on recurrent targets.
    assert sorted(what.target_rows) == verify_rows(4, cache.recurrent)
    assert max(what.target_rows) == (13 if family in ("qwen3_5", "nemotron_h") else 5)
    assert sorted(what.drafter_rows) == [1, 2]
    after = cache_arrays(cache)
    assert len(after) == len(before) and all(mx.array_equal(a, b).item() for a, b in zip(after, before))
    assert max_cache_diff(cache, fed(model, PROMPT[:-1])) == 0.0
    assert max_cache_diff(drafter.cache, fed(draft, PROMPT[:-1])) == 0.0
    assert drafter._pending == [] and drafter.cache.length == len(PROMPT) - 1
    # Run twice in one process, nothing is left to warm.
    assert warm_up(cache, drafter, max_draft=4, force=True).target_rows == ()
    # The generation that follows is the one without a warm-up, block for block.
    warmed = list(speculative_generate_step(PROMPT[-1], cache, drafter, num_draft_tokens=4, max_tokens=GEN))
    cold_cache = prefilled(model)
    cold_drafter = ModelDrafter(draft)
    cold_drafter.prefill(PROMPT[:-1])
    cold = list(speculative_generate_step(PROMPT[-1], cold_cache, cold_drafter, num_draft_tokens=4, max_tokens=GEN))
    assert [(b.tokens, b.drafted, b.accepted, b.rollback) for b in warmed] == \
           [(b.tokens, b.drafted, b.accepted, b.rollback) for b in cold]
    assert max_cache_diff(cache, cold_cache) == 0.0


def test_runner_reports_the_warm_up_apart_and_output_is_unchanged(monkeypatch):
    model, draft = fresh("qwen3_5", "float32"), fresh("qwen3_5", "float32", noise=0.05)
    # MLX's CPU backend compiles nothing per shape: nothing to warm there.
    cpu = collect(run(model, PROMPT, drafter=ModelDrafter(draft), num_draft_tokens=3, max_tokens=GEN))[0]
    assert cpu.warmup_free == (mx.default_device() == mx.cpu)
    # As on a GPU: every shape runs first, timed apart, and nothing else changes.
    monkeypatch.setattr(plain_module, "compiles_per_shape", lambda: True)
    model, draft = fresh("qwen3_5", "float32"), fresh("qwen3_5", "float32", noise=0.05)
    events = list(run(model, PROMPT, drafter=ModelDrafter(draft), num_draft_tokens=3, max_tokens=GEN,
                      rollback="carry"))
    assert [type(e).__name__ for e in events[:2]] == ["Prefilled", "Warmed"]
    warmed, out = collect(iter(events))
    assert warmed.warmup_s > 0 and warmed.to_dict()["warmup_s"] == warmed.warmup_s and not warmed.warmup_free
    target_rows, drafter_rows = warmed.warmup_rows
    assert sorted(target_rows) == verify_rows(3, True) and sorted(drafter_rows) == [1, 2]
    assert [(b.tokens, b.drafted, b.accepted) for b in warmed.trace] == \
           [(b.tokens, b.drafted, b.accepted) for b in cpu.trace]
    plain_stats, plain = collect(run(model, PROMPT, max_tokens=GEN, warmup=False))
    assert out == plain and plain_stats.warmup_s == 0.0
    # Sampling: the warm-up draws no random numbers.
    params = SamplingParams(temp=0.8)
    outs = []
    for warm in (True, False):
        mx.random.seed(5)
        outs.append(collect(run(fresh("llama"), PROMPT, drafter=ModelDrafter(fresh("llama", noise=0.05)),
                                num_draft_tokens=3, max_tokens=24, sampling=params, warmup=warm))[1])
    assert outs[0] == outs[1]


# --- verdicts ----------------------------------------------------------------------------

def spec_and_plain(model, draft_model, k=3, rollback="carry"):
    stats, out = collect(run(model, PROMPT, drafter=ModelDrafter(draft_model), num_draft_tokens=k,
                             max_tokens=GEN, rollback=rollback))
    _, ref = collect(run(model, PROMPT, max_tokens=GEN))
    return stats, out, ref


@pytest.mark.parametrize("family,dtype,scale", [("llama", "bfloat16", 1e-3), ("qwen3_5", "float32", 3e-3)])
def test_a_rounding_tie_is_proven(family, dtype, scale):
    model = two_path(family, dtype, scale)
    stats, out, ref = spec_and_plain(model, noisy_drafter(family, dtype), k=4)
    assert out != ref  # the batched path rounds differently and flips a near-tie
    d = explain(model, PROMPT, out, ref, stats.trace)
    assert d.verdict == TIE and d.reproduced
    assert 0 < d.difference and d.margin <= d.difference
    assert d.specdec_token == out[d.index] == d.verify_token and d.plain_token == ref[d.index]
    # The recomputed position is the verify row the run used: a multi-row forward.
    assert d.rows > 1 and 0 <= d.row < d.rows
    # Each path recomputed alone reproduces its own run exactly.
    rec, mismatch = recompute(model, PROMPT, out, stats.trace, d.index)
    assert mismatch is None
    assert mx.argmax(rec.one_row).item() == ref[d.index] and mx.argmax(rec.verify).item() == out[d.index]


@pytest.mark.parametrize("dtype,rollback", [("float32", "carry"), ("bfloat16", "carry"), ("bfloat16", "capture"),
                                           ("bfloat16", "tape"), ("bfloat16", "reforward")])
def test_exact_kernels_give_identical_paths(dtype, rollback):
    # Where the probe says the kernels agree, the recomputed verify row has the one-token bits;
    # the replay follows every rollback strategy.
    if not kernels_agree(dtype):
        pytest.skip(f"this backend's batched {dtype} kernels round differently")
    model = target("qwen3_5", dtype)
    stats, out, ref = spec_and_plain(model, noisy_drafter("qwen3_5", dtype), k=4, rollback=rollback)
    assert out == ref and rollback in {b.rollback for b in stats.trace}
    multi = [i for i, b in enumerate(stats.trace) if b.verify_len > 2 and len(b.tokens) > 1][:2]
    assert multi
    for i in multi:
        index = sum(len(b.tokens) for b in stats.trace[:i]) + 1
        rec, mismatch = recompute(model, PROMPT, out, stats.trace, index)
        assert mismatch is None and rec.rows == stats.trace[i].verify_len
        assert mx.array_equal(rec.one_row, rec.verify).item()


def test_the_probe_agrees_where_the_cpu_is_exact():
    if mx.default_device() != mx.cpu or os.environ.get("LD_PRELOAD"):
        pytest.skip("MLX's CPU backend with its bundled BLAS only")
    assert kernels_agree("float32") and kernels_agree("bfloat16")


def broken_rollback(monkeypatch):
    """Every speculative run's rollback keeps one rejected row too many (a bookkeeping bug).

    Patched where each run's target caches join the engine (one row or many, from any face); the plain
    side of a comparison never goes through it.
    """
    real = Engine.admit

    def buggy(self, row, cache):
        rollback = cache.rollback

        def keep_one_more(snap, n_keep):
            return rollback(snap, min(n_keep + 1, cache.length - snap.length))

        cache.rollback = keep_one_more  # this run's cache only
        return real(self, row, cache)

    monkeypatch.setattr(Engine, "admit", buggy)


@pytest.mark.parametrize("model_of", [lambda: target("llama", "float32"), lambda: two_path("llama", "bfloat16", 1e-3)])
def test_a_bug_is_diverged_even_where_ties_happen(monkeypatch, model_of):
    broken_rollback(monkeypatch)
    model = model_of()
    stats, out, ref = spec_and_plain(model, noisy_drafter("llama", "float32"), k=3)
    d = explain(model, PROMPT, out, ref, stats.trace)
    # The replay of the run's own forwards finds the first token the bug changed.
    assert d.verdict == DIVERGED and not d.reproduced and d.mismatch is not None


def setup_of(model, draft, eos=()) -> Setup:
    """Models built in memory, loaded as a sweep gets them (a draft model; ``eos`` its end tokens)."""
    tokenizer = SimpleNamespace(eos_token_ids=set(eos))
    return Setup(ModelOptions(), "model", Loaded("target", Path("."), model, tokenizer, {}),
                 Loaded("draft", Path("."), draft, None, {}))


def test_sweep_marks_ties_and_keeps_the_exit_code(capsys):
    setup = setup_of(two_path("llama", "bfloat16", 1e-3), noisy_drafter("llama", "bfloat16"))
    result = list(sweep(setup, PROMPT, [2, 4], max_tokens=GEN, warmup=0))[-1]
    assert [r.verdict for r in result.rows] == [TIE, TIE]
    assert not any(r.identical for r in result.rows)
    assert all(r.warmup_s >= 0 for r in result.rows) and "warmup_s" in result.rows[0].to_dict()
    from specdec_cli.cli.display import print_sweep

    print_sweep(result, "model")
    assert re.search(r"│\s+tie\s+│", capsys.readouterr().out)


def test_a_sweep_that_generates_nothing_reports_no_speedup():
    model = target("llama", "float32")
    first = plain(model, max_tokens=1)[0][0]  # made an end-of-sequence token: nothing is generated
    setup = setup_of(model, noisy_drafter("llama", "float32"), eos=[first])
    result = list(sweep(setup, PROMPT, [2], max_tokens=8, warmup=0, repeats=1))[-1]
    assert result.tokens == 0 and result.rows[0].speedup == 0.0


def test_a_sweep_runs_each_block_size_through_the_loop_generate_drives(monkeypatch):
    # One loop: every speculative run of a sweep is a request alone in Flights (the default setting
    # too), and each one's text is plain decoding's (the CPU's kernels are exact).
    from specdec_cli.loop.flights import Flights

    seen = []
    real = Flights.alone

    def alone(self, request, **kw):
        seen.append(self.opener.block_size)
        return real(self, request, **kw)

    monkeypatch.setattr(Flights, "alone", alone)
    setup = setup_of(target("llama", "float32"), noisy_drafter("llama", "float32"))
    result = list(sweep(setup, PROMPT, [2, 4], max_tokens=GEN, warmup=0, default_block=6,
                        prefill_seconds=0.05))[-1]
    assert sorted(seen) == [2, 2, 4, 4, 6, 6]  # a speed run and a timed run each
    assert [r.verdict for r in result.rows] == [IDENTICAL, IDENTICAL] and result.default.identical
    assert result.default.adaptive and result.default.block_size == 6 and result.tokens == GEN


# --- through the command line ----------------------------------------------------------

@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("honest")
    return {"llama": make_model_dir(root / "llama", "llama", seed=0),
            "draft": make_model_dir(root / "draft", "llama", seed=0, noise=0.05)}


def generate(dirs, *args):
    return CliRunner().invoke(app, ["generate", "--model", str(dirs["llama"]), "--draft-model", str(dirs["draft"]),
                                    "-m", "40", *args])


def test_cli_reports_warm_up_time(dirs):
    result = generate(dirs, "Hello", "--json", "--compare-ar")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["warmup_s"] >= 0 and report["compare"]["verdict"] == IDENTICAL
    text = generate(dirs, "Hello")
    assert re.search(r"^Warm-up: (none needed \(MLX's CPU backend|[\d.]+ s before timing, not in tokens-per-sec)",
                     text.stderr, re.M)


def test_cli_rounding_tie_exits_zero_with_both_numbers(dirs, monkeypatch):
    real = session_setup.load

    def load(name, dtype, **kw):
        loaded = real(name, dtype, **kw)
        if Path(name) != dirs["llama"]:
            return loaded
        many = real(name, dtype, **kw).model
        perturb(many, 1e-2, seed=7)
        return dataclasses.replace(loaded, model=TwoPathModel(loaded.model, many))

    monkeypatch.setattr(session_setup, "load", load)
    # --no-adaptive: the adaptive policy reads the clock, and so would change the blocks run to run.
    result = generate(dirs, "Hello", "--dtype", "bfloat16", "--compare-ar", "--json", "--no-adaptive")
    assert result.exit_code == 0, result.output
    cmp = json.loads(result.stdout)["compare"]
    assert cmp["verdict"] == TIE and cmp["identical"] is False
    assert 0 <= cmp["margin"] <= cmp["difference"] and cmp["difference"] > 0
    assert cmp["first_divergence"]["reproduced"] is True and cmp["first_divergence"]["replay_mismatch"] is None
    text = generate(dirs, "Hello", "--dtype", "bfloat16", "--compare-ar", "--no-adaptive")
    assert text.exit_code == 0
    line = next(ln for ln in text.stderr.splitlines() if ln.startswith("Compare:"))
    assert line.startswith("Compare: rounding tie at token") and "not a bug" in line


def test_cli_bug_is_diverged_and_exits_three(dirs, monkeypatch):
    broken_rollback(monkeypatch)
    result = generate(dirs, "Hello", "--compare-ar", "--json", "--no-adaptive")
    assert result.exit_code == 3, result.output
    cmp = json.loads(result.stdout)["compare"]
    assert cmp["verdict"] == DIVERGED and cmp["first_divergence"]["reproduced"] is False
    assert cmp["first_divergence"]["replay_mismatch"] is not None
    text = generate(dirs, "Hello", "--compare-ar", "--no-adaptive")
    assert text.exit_code == 3 and "Compare: DIVERGED at token" in text.stderr and "a bug" in text.stderr


def test_missing_or_doubled_mlx_backend_is_named(dirs, monkeypatch):
    import specdec_cli.model.backend as backend

    monkeypatch.setattr(backend.sys, "platform", "linux")
    monkeypatch.setattr(backend, "installed_backends", lambda: [])
    result = generate(dirs, "Hello")
    assert result.exit_code == 1 and "MLX has no backend installed" in result.stderr
    assert "[cuda]" in result.stderr and "pip install ." in result.stderr and "Traceback" not in result.output
    # The CUDA install (CPU build + GPU build): quiet while the GPU library is in place ...
    monkeypatch.setattr(backend, "installed_backends", lambda: ["mlx-cpu", "mlx-cuda-13"])
    monkeypatch.setattr(backend, "active_backend", lambda found: "mlx-cuda-13")
    result = generate(dirs, "Hello", "-m", "4")
    assert result.exit_code == 0 and "warning" not in result.stderr
    # ... and one line naming the fix when the CPU build was installed last.
    monkeypatch.setattr(backend, "active_backend", lambda found: "mlx-cpu")
    result = generate(dirs, "Hello", "-m", "4")
    assert result.exit_code == 0
    assert "warning: mlx-cuda-13 is installed but the CPU build" in result.stderr
    assert "pip install --force-reinstall --no-deps mlx-cuda-13" in result.stderr


def test_active_backend_is_read_from_the_library_in_place():
    import specdec_cli.model.backend as backend

    import sys

    if sys.platform != "linux":
        pytest.skip("MLX's backend is a separate distribution on Linux only")
    found = backend.installed_backends()
    assert found, "the test environment has no MLX backend distribution"
    # The library in place belongs to one of them, found from its install record.
    assert backend.active_backend(found) in found
    if found == ["mlx-cpu"]:
        assert backend.backend_problem() == (None, False)
