"""Bucketed verify shapes (issue 42): padding never changes a token, and a run meets few shapes.

On the CPU nothing compiles per shape, so these tests force ``bucketed`` (and the
warm-up) to exercise the same Python path a GPU takes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest
from helpers import DTYPES, FAMILIES, PROMPT, fed, kernels_agree, max_cache_diff, noisy_drafter, prefilled, target
from typer.testing import CliRunner

from specdec_cli.loop import plain as plain_module
from specdec_cli.core import shapes
from specdec_cli.core.adaptive import FixedLength
from specdec_cli.core.numerics import Numerics
from specdec_cli.cli.app import app
from specdec_cli.loop.compare import replay
from specdec_cli.drafters import ModelDrafter, SuffixDrafter
from specdec_cli.loop.engine import Engine, Row, speculative_generate_step, verify_rows
from specdec_cli.errors import OptionError
from specdec_cli.loop.plain import warm_up
from specdec_cli.loop.events import Prefilled
from specdec_cli.loop.events import collect
from specdec_cli.loop.runner import run
from specdec_cli.core.sampling import SamplingParams

FAMILY_DTYPES = [(f, d) for f in FAMILIES for d in DTYPES]
RECURRENT = ("qwen3_5", "nemotron_h")
BUCKETED = Numerics.resolve("bucketed")
GEN = 32


def test_buckets_are_powers_of_two():
    assert [shapes.bucket(w) for w in (1, 2, 3, 5, 8, 9, 63, 64, 65)] == [1, 2, 4, 8, 8, 16, 64, 64, 128]
    assert shapes.widths(64, "bucketed") == [1, 2, 4, 8, 16, 32, 64]
    assert shapes.widths(6, "bucketed") == [1, 2, 4, 8]
    assert shapes.widths(4, "exact") == [1, 2, 3, 4]
    assert shapes.fed(5, "bucketed") == 8 and shapes.fed(5, "exact") == 5


def test_auto_buckets_only_where_the_device_compiles_per_shape():
    assert Numerics.resolve("auto", compiles=True).shapes == "bucketed"
    assert Numerics.resolve("auto", compiles=False).shapes == "exact"
    assert Numerics.resolve("exact", compiles=True).shapes == "exact"
    assert Numerics.resolve("bucketed", compiles=False).shapes == "bucketed"
    assert Numerics.resolve("auto").shapes == "exact"  # this CPU
    assert Numerics.resolve("auto").requested == "auto"
    with pytest.raises(ValueError):
        Numerics.resolve("round")


def test_bucketed_narrows_to_exact_for_a_recurrence_that_records_nothing_unless_asked_for():
    auto = Numerics.resolve("auto", compiles=True)
    assert auto.for_rollback(True, "carry").shapes == "exact"
    assert auto.for_rollback(True, "capture") is auto and auto.for_rollback(False, "carry") is auto
    with pytest.raises(OptionError, match="--rollback capture or tape"):
        Numerics.resolve("bucketed").for_rollback(True, "reforward", "measured")


def test_the_default_block_size_verifies_with_at_most_seven_widths():
    # lookup's default block size is 64: 63 drafts
    assert verify_rows(63, recurrent=False, numerics=BUCKETED) == [1, 2, 4, 8, 16, 32, 64]
    assert verify_rows(63, recurrent=True, rollback="capture", numerics=BUCKETED) == [1, 2, 4, 8, 16, 32, 64]
    assert len(verify_rows(63, recurrent=False)) == 64
    assert verify_rows(0, recurrent=False, numerics=BUCKETED) == [1]


def speculate(model, family, dtype, mode, k=5, sampling=SamplingParams(), rollback="capture"):
    cache = prefilled(model)
    drafter = ModelDrafter(noisy_drafter(family, dtype))
    drafter.prefill(PROMPT[:-1])
    blocks = list(speculative_generate_step(PROMPT[-1], cache, drafter, num_draft_tokens=k, max_tokens=GEN,
                                            sampling=sampling, rollback=rollback,
                                            numerics=Numerics.resolve(mode)))
    return [t for b in blocks for t in b.tokens], blocks, cache


@pytest.mark.parametrize("family,dtype", FAMILY_DTYPES)
def test_bucketed_output_and_caches_equal_exact(family, dtype):
    """k = 5: every verify of 6 rows runs as 8; the two padding rows change no token and leave no trace."""
    model = target(family, dtype)
    exact, _, _ = speculate(model, family, dtype, "exact")
    out, blocks, cache = speculate(model, family, dtype, "bucketed")
    assert out == exact
    assert {b.verify_len for b in blocks} <= {1, 2, 4, 8}
    assert any(b.verify_len > b.drafted + 1 for b in blocks)  # padding was fed
    direct = fed(model, PROMPT + out[:-1])
    assert max_cache_diff(cache, direct) <= (1e-5 if dtype == "float32" else 0.0 if kernels_agree(dtype) else 2**-4)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_bucketed_seeded_sampling_draws_the_same_text(family):
    model = target(family, "float32")
    sampling = SamplingParams(temp=0.8, seed=7)
    exact, _, _ = speculate(model, family, "float32", "exact", sampling=sampling)
    out, _, _ = speculate(model, family, "float32", "bucketed", sampling=sampling)
    assert out == exact


@pytest.mark.parametrize("family", RECURRENT)
def test_a_recurrent_row_that_records_nothing_is_not_padded(family):
    """carry restores the recurrence instead of cutting it: padding would run through it, so none is fed."""
    model = target(family, "float32")
    exact, _, _ = speculate(model, family, "float32", "exact", rollback="carry")
    out, blocks, _ = speculate(model, family, "float32", "bucketed", rollback="carry")
    assert out == exact
    assert all(b.verify_len == b.carry + b.drafted + 1 for b in blocks)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_5", "nemotron_h"])
def test_a_bucketed_batch_gives_each_row_its_text_alone(family):
    model = target(family, "float32")
    prompts = [PROMPT, list(b"abc abc abc abc abc"), list(b"Hello"), list(b"one two three; one two three")]
    widths = []
    outs = {}
    for mode in ("exact", "bucketed"):
        engine = Engine(model, rollback="capture", numerics=Numerics.resolve(mode))
        for i, p in enumerate(prompts):
            d = SuffixDrafter() if i % 2 else ModelDrafter(noisy_drafter(family, "float32"))
            d.prefill(p[:-1])
            engine.admit(Row(p[-1], d, FixedLength(2 + i), tag=i, max_tokens=GEN), prefilled(model, p))
        got = {i: [] for i in range(len(prompts))}
        while engine.rows:
            for row, block in engine.step():
                got[row.tag] += block.tokens
                if mode == "bucketed":
                    widths.append(block.verify_len)
            for row in [r for r in engine.rows if r.finish is not None or r.room <= 0]:
                engine.remove(row)
        outs[mode] = got
    assert outs["bucketed"] == outs["exact"]
    assert set(widths) <= {1, 2, 4, 8}


def test_the_warm_up_runs_the_buckets_alone():
    model = target("llama", "float32")
    cache = prefilled(model)
    before = cache.length
    done = warm_up(cache, max_draft=63, force=True, numerics=BUCKETED)
    assert set(done.target_rows) <= {1, 2, 4, 8, 16, 32, 64} and len(done.target_rows) <= 7
    assert cache.length == before


def test_a_padded_run_replays_block_for_block():
    """--compare-ar recomputes each verify with the rows it ran (padding included) and finds every token."""
    model = target("qwen3_5", "float32")
    out, blocks, _ = speculate(model, "qwen3_5", "float32", "bucketed")
    assert replay(model, PROMPT, out, blocks, index=len(out) - 1).mismatch is None


def test_bucketed_on_a_recurrent_model_without_a_recording_rollback_is_refused_before_the_first_token():
    model = target("qwen3_5", "float32")
    drafter = ModelDrafter(noisy_drafter("qwen3_5", "float32"))
    with pytest.raises(OptionError, match="--rollback capture or tape"):
        collect(run(model, PROMPT, drafter=drafter, num_draft_tokens=3, max_tokens=8, rollback="carry",
                    numerics=BUCKETED))


def test_auto_keeps_exact_shapes_where_padding_could_not_be_cut_back(monkeypatch):
    monkeypatch.setattr(shapes, "compiles_per_shape", lambda: True)
    model = target("qwen3_5", "float32")
    for rollback, mode in (("carry", "exact"), ("capture", "bucketed")):
        drafter = ModelDrafter(noisy_drafter("qwen3_5", "float32"))
        events = list(run(model, PROMPT, drafter=drafter, num_draft_tokens=3, max_tokens=8, rollback=rollback,
                          numerics=Numerics.resolve("auto"), warmup=False))
        assert next(e for e in events if isinstance(e, Prefilled)).shapes == mode


def test_lookup_fills_the_padding_with_more_of_its_match():
    text = list(range(100, 140))
    d = SuffixDrafter(size=lambda match, k: min(k, 4))
    d.prefill(text + text[:5])
    assert d.propose(text[5], 63).size == 4
    d.cancel()
    d.fill = lambda n: shapes.bucket(n + 1) - 1
    assert d.propose(text[5], 63).size == 7  # 4 drafts + 1 run as 8 rows: 7 drafts
    d.cancel()
    assert d.propose(text[5], 6).size == 6  # never past the k the engine allows


def test_generate_reports_its_verify_shapes_on_a_long_copy():
    """The issue's check, as a user runs it (its own process, OpenBLAS preloaded): a long copy with
    --shapes bucketed is identical to plain decoding and runs at most 8 verify widths."""
    text = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a tin can of oil "
            "and a cloth. He polished the great lens until it gleamed, trimmed the wick, and lit the lamp.")
    run = [sys.executable, "-m", "specdec_cli", "generate", f"Copy this exactly: {text}", "-m", "48",
           "--shapes", "bucketed", "--compare-ar", "--json"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["shapes"] == "bucketed" and report["compare"]["verdict"] == "identical"
    widths = {int(k.split("x")[1]) for k in report["verify_shapes"]}
    assert 0 < len(widths) <= 8 and all(w & (w - 1) == 0 for w in widths) and max(widths) > 1
    assert sum(report["verify_shapes"].values()) == report["blocks"]
    assert report["warmup_shapes"] == 0  # MLX's CPU backend compiles nothing per shape: no warm-up runs


def test_the_json_reports_a_warm_up_of_the_buckets_alone(monkeypatch, tmp_path):
    """Where the warm-up runs (a GPU; forced here), it runs at most one shape per bucket: 7 at block size 64."""
    from specdec_cli.session.synthetic import make_model_dir

    monkeypatch.setattr(plain_module, "compiles_per_shape", lambda: True)
    model = make_model_dir(tmp_path / "llama", "llama", seed=0)
    result = CliRunner().invoke(app, ["generate", "abc abc abc abc abc abc", "--model", str(model), "-m", "24",
                                      "--shapes", "bucketed", "--ignore-chat-template", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["block_size"] == 64 and 0 < report["warmup_shapes"] <= 7


def test_the_first_compile_note_speaks_only_on_cuda_before_its_kernels_are_cached(tmp_path):
    assert "132 s" in shapes.first_compile_note("4-bit quantized", cuda=True, cache=tmp_path)
    plain = shapes.first_compile_note("bfloat16", cuda=True, cache=tmp_path)
    assert "30 s" in plain and "quantized" not in plain
    assert shapes.first_compile_note("4-bit quantized", cuda=False, cache=tmp_path) is None
    (tmp_path / "gather_bfloat16_uint32_1.ptx").write_text("")
    assert shapes.first_compile_note("bfloat16", cuda=True, cache=tmp_path) is None
    # As the H200's cache stood when a 4-bit run stalled: the small tiles compiled, not the 32- and 64-row ones.
    (tmp_path / "qmm_sm80_tn_float16_m16_b4_g32_affine.ptx").write_text("")
    assert "132 s" in shapes.first_compile_note("4-bit quantized", cuda=True, cache=tmp_path)
    for rows in (32, 64):
        (tmp_path / f"qmm_sm80_tn_float16_m{rows}_b4_g32_affine.ptx").write_text("")
    assert shapes.first_compile_note("4-bit quantized", cuda=True, cache=tmp_path) is None
    assert shapes.first_compile_note("4-bit quantized") is None  # this CPU


def test_cudnn_attention_is_off_by_default_on_cuda_only_unless_the_user_chose():
    from specdec_cli.model.backend import CUDNN_SDPA, decode_attention_default

    env = {}
    assert decode_attention_default(env, backend="cuda") and env == {CUDNN_SDPA: "0"}
    env = {CUDNN_SDPA: "1"}
    assert not decode_attention_default(env, backend="cuda12") and env == {CUDNN_SDPA: "1"}
    env = {}
    assert not decode_attention_default(env, backend="cpu") and env == {}
    assert not decode_attention_default({})  # this machine: the CPU build
