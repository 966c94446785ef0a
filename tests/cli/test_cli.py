"""The command line, through Typer's CliRunner, on tiny models saved to disk."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import errors as hub_errors
from typer.testing import CliRunner

import specdec_cli.model.files as files
import specdec_cli.loop.runner as runner_module
from specdec_cli.cli.app import app
from specdec_cli.drafters import ModelDrafter
from specdec_cli.session.synthetic import TINY_CONFIGS, make_model_dir

ANSI = re.compile(r"\x1b\[")
JSON_FIELDS = {
    "text", "prompt_tokens", "generated_tokens", "prefill_s", "decode_s", "decode_tps", "blocks",
    "block_size", "drafted", "accepted", "acceptance", "mean_accepted_per_block", "drafter",
    "rollback", "rollback_s", "rollback_choice", "cache_bytes",
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    out = {
        "llama": make_model_dir(root / "llama", "llama", seed=0),
        "llama-draft": make_model_dir(root / "llama-draft", "llama", seed=0, noise=0.05),
        "qwen3_5": make_model_dir(root / "qwen3_5", "qwen3_5", seed=0),
        "qwen3_5-draft": make_model_dir(root / "qwen3_5-draft", "qwen3_5", seed=0, noise=0.05),
        "padded-draft": make_model_dir(
            root / "padded-draft", {**TINY_CONFIGS["llama"], "vocab_size": 320}, seed=3
        ),
    }
    # Same shapes, different vocabulary: two byte tokens swap ids.
    other = make_model_dir(root / "other-tokenizer", "llama", seed=0, noise=0.05)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    out["other-tokenizer"] = other
    unknown = root / "unknown-arch"
    shutil.copytree(out["llama"], unknown)
    cfg = json.loads((unknown / "config.json").read_text())
    cfg["model_type"] = "no_such_architecture"
    (unknown / "config.json").write_text(json.dumps(cfg))
    out["unknown-arch"] = unknown
    no_weights = root / "no-weights"
    shutil.copytree(out["llama"], no_weights)
    (no_weights / "model.safetensors").unlink()
    out["no-weights"] = no_weights
    no_config = root / "no-config"
    shutil.copytree(out["llama"], no_config)
    (no_config / "config.json").unlink()
    out["no-config"] = no_config
    return out


def invoke(*args: str, input: str | None = None):
    return CliRunner().invoke(app, ["generate", *map(str, args)], input=input)


def base(models, target="llama", draft="llama-draft"):
    return ["--model", models[target], "--draft-model", models[draft], "-m", "24"]


def test_generate_streams_text_to_stdout_and_stats_to_stderr(models):
    result = invoke(*base(models), "Hello there")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()
    assert not ANSI.search(result.stdout) and not ANSI.search(result.stderr)
    assert re.search(r"^Prompt: \d+ tokens, [\d.]+ tokens-per-sec$", result.stderr, re.M)
    assert re.search(r"^Generation: 24 tokens, [\d.]+ tokens-per-sec$", result.stderr, re.M)
    assert re.search(r"^Peak memory: [\d.]+ GB$", result.stderr, re.M)
    assert "acceptance:" in result.stderr and "(accepted / drafted)" in result.stderr
    assert "Accepted per block (histogram):" in result.stderr
    assert "Prompt:" not in result.stdout


def test_json_is_one_object_with_the_documented_fields(models):
    result = invoke(*base(models, "qwen3_5", "qwen3_5-draft"), "-p", "Hi", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # the whole of stdout is one object
    assert JSON_FIELDS <= set(report)
    assert report["block_size"] == 4
    # Random weights may emit EOS early; otherwise the limit stops it.
    assert report["finish_reason"] in ("eos", "length")
    assert report["generated_tokens"] == 24 or report["finish_reason"] == "eos"
    # auto, the default: capture or tape for a GatedDeltaNet hybrid, measured at start.
    assert report["drafter"] == "model" and report["rollback"] in ("capture", "tape")
    choice = report["rollback_choice"]
    assert choice["requested"] == "auto" and choice["strategy"] == report["rollback"]
    assert "measured" in choice["reason"] and choice["capture_bytes"] > choice["tape_bytes"] > 0
    assert set(report["cache_bytes"]) == {"target", "drafter"} and min(report["cache_bytes"].values()) > 0
    assert report["acceptance"] == pytest.approx(report["accepted"] / report["drafted"])
    assert report["rollback_s"] is None  # only measured with --verbose
    assert "Prompt:" not in result.stderr


def test_rollback_strategy_option(models):
    for strategy in ("reforward", "carry", "capture", "tape"):
        result = invoke(*base(models, "qwen3_5", "qwen3_5-draft"), "Hi", "--json", "--compare-ar",
                        "--rollback", strategy, "--no-adaptive")
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert report["rollback"] == strategy and report["compare"]["identical"]
        assert strategy in report["rollbacks"]
    # An attention-only target trims whatever the option says.
    report = json.loads(invoke(*base(models), "Hi", "--json", "--rollback", "reforward").stdout)
    assert report["rollback"] == "trim"
    result = invoke(*base(models), "Hi", "--rollback", "magic")
    assert result.exit_code == 2


def test_rollback_memory_cap_falls_back_to_tape_and_says_so(models):
    result = invoke(*base(models, "qwen3_5", "qwen3_5-draft"), "Hi", "--rollback", "capture",
                    "--rollback-memory-cap", "0.001", "--no-live")
    assert result.exit_code == 0, result.output
    assert re.search(r"^Rollback strategy: tape \(capture: capture would hold .* over the .* cap: tape instead\)",
                     result.stderr, re.M), result.stderr
    assert re.search(r"^Cache: target [\d.]+ MiB, drafter [\d.]+ MiB$", result.stderr, re.M)


def test_verbose_times_the_phases(models):
    result = invoke(*base(models), "Hi", "--json", "--verbose")
    report = json.loads(result.stdout)
    assert report["rollback_s"] >= 0 and report["syncs_per_block"] == 3
    assert set(report["phase_ms"]) == {"draft_ms", "verify_ms", "rollback_ms"}


@pytest.mark.parametrize("target,draft", [("llama", "llama-draft"), ("qwen3_5", "qwen3_5-draft"),
                                          ("llama", "padded-draft")])
def test_compare_ar_identical_exits_zero(models, target, draft):
    result = invoke(*base(models, target, draft), "Compare me", "--compare-ar", "--json")
    assert result.exit_code == 0, result.output
    compare = json.loads(result.stdout)["compare"]
    assert compare["identical"] is True and compare["first_divergence"] is None
    assert compare["ar_decode_tps"] > 0 and compare["speedup"] > 0
    text = invoke(*base(models, target, draft), "Compare me", "--compare-ar")
    assert "Compare: identical (24 tokens)" in text.stderr
    assert re.search(r"speedup [\d.]+x", text.stderr)


@pytest.mark.parametrize("target,draft", [("llama", "llama-draft"), ("qwen3_5", "qwen3_5-draft")])
def test_compare_ar_on_a_gpu_like_backend_is_identical_or_a_proven_tie(models, target, draft, gpu_like):
    # Verify forwards round otherwise than one-token steps there: a near-tie may flip, and --compare-ar proves
    # it a tie by replaying the run's own verify shapes (never "diverged", never a non-zero exit).
    for prompt in ("Compare me", "The quick brown fox jumps over the lazy dog", "abc abc abc abc"):
        result = invoke(*base(models, target, draft), prompt, "--compare-ar", "--json")
        assert result.exit_code == 0, result.output
        compare = json.loads(result.stdout)["compare"]
        assert compare["verdict"] in ("identical", "rounding tie"), compare
        if compare["verdict"] == "rounding tie":
            assert compare["first_divergence"]["reproduced"] and compare["margin"] <= compare["difference"]


@pytest.mark.parametrize("target", ["llama", "qwen3_5"])
def test_where_the_device_computes_apart_blocks_without_drafts_are_pipelined_and_identical(models, target,
                                                                                          monkeypatch):
    # A GPU's numerics (Numerics.pipeline): generate's blocks that draft nothing queue the next forward first.
    monkeypatch.setattr("specdec_cli.core.numerics.apart", lambda: True)
    for prompt in ("Compare me", "abc abc abc abc abc abc"):
        result = invoke("--model", models[target], prompt, "-m", "24", "--compare-ar", "--json")
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert report["compare"]["identical"] is True, report["compare"]
        assert report["pipelined_blocks"] > 0


def test_compare_ar_under_exact_is_identical_where_the_default_ties(models, gpu_like):
    # The same runs as above: without --exact some part from plain decoding at a rounding tie; with it the
    # verify forwards and plain decoding compute each row the same, and every one is identical.
    verdicts = {False: [], True: []}
    for exact in (False, True):
        for target, draft in (("llama", "llama-draft"), ("qwen3_5", "qwen3_5-draft")):
            for prompt in ("Compare me", "The quick brown fox jumps over the lazy dog", "Hello there"):
                result = invoke(*base(models, target, draft), prompt, "--compare-ar", "--json",
                                *(["--exact"] if exact else []))
                assert result.exit_code == 0, result.output
                verdicts[exact].append(json.loads(result.stdout)["compare"]["verdict"])
    assert set(verdicts[True]) == {"identical"} and "rounding tie" in verdicts[False], verdicts


def test_compare_ar_divergence_exits_three_and_says_where(models, monkeypatch):
    # Corrupt the plain run's 6th token: the comparison must find it.
    real = runner_module.plain_generate_step

    def corrupted(*args, **kwargs):
        for i, block in enumerate(real(*args, **kwargs)):
            if i == 5:
                block = type(block)((block.tokens[0] ^ 1,), 0, 0, "none", 1, block.finish_reason)
            yield block

    monkeypatch.setattr(runner_module, "plain_generate_step", corrupted)
    result = invoke(*base(models), "Hello", "--compare-ar", "--json")
    assert result.exit_code == 3
    div = json.loads(result.stdout)["compare"]["first_divergence"]
    assert div["index"] == 5
    assert div["specdec_token"]["id"] == div["plain_token"]["id"] ^ 1
    assert div["top2_margin"] >= 0
    text = invoke(*base(models), "Hello", "--compare-ar")
    assert text.exit_code == 3
    assert "DIVERGED at token 5" in text.stderr and "top-2 logit margin" in text.stderr


def test_prompt_from_stdin_and_option_forms(models):
    a = invoke(*base(models), "-", "--json", "--ignore-chat-template", input="Once upon a time")
    b = invoke(*base(models), "--prompt", "Once upon a time", "--json", "--ignore-chat-template")
    ra, rb = json.loads(a.stdout), json.loads(b.stdout)
    assert ra["text"] == rb["text"] and ra["prompt_tokens"] == rb["prompt_tokens"] == 16


def test_chat_template_and_system_prompt_change_the_prompt(models):
    plain = json.loads(invoke(*base(models), "Hi", "--json", "--ignore-chat-template").stdout)
    chat = json.loads(invoke(*base(models), "Hi", "--json").stdout)
    system = json.loads(invoke(*base(models), "Hi", "--json", "--system-prompt", "Be brief.").stdout)
    assert plain["prompt_tokens"] == 2
    assert chat["prompt_tokens"] > plain["prompt_tokens"]
    assert system["prompt_tokens"] > chat["prompt_tokens"]


def test_num_draft_tokens_is_block_size_minus_one(models):
    report = json.loads(invoke(*base(models), "Hi", "--json", "--num-draft-tokens", "2").stdout)
    assert report["block_size"] == 3
    assert max(int(k) for k in report["accepted_histogram"]) <= 2


def test_dtype_cast_runs(models):
    result = invoke(*base(models, "qwen3_5", "qwen3_5-draft"), "Hi", "--dtype", "bfloat16",
                    "--compare-ar", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["compare"]["identical"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["Hi", "--block-size", "3", "--num-draft-tokens", "2"], "not both"),
        ([], "no prompt"),
        (["Hi", "-p", "Hi"], "give the prompt once"),
        (["Hi", "--temp", "-1"], "Invalid value for '--temp': Input should be greater than or equal to 0 (range x>=0.0)"),
        (["Hi", "--top-p", "0.9"], "--top-p only applies when sampling: set --temp > 0 or drop it"),
        (["Hi", "--top-k", "5", "--min-p", "0.1"], "--top-k, --min-p only apply when sampling"),
        (["Hi", "--temp", "0.7", "--top-p", "1.5"], "'--top-p': Input should be less than or equal to 1 (range 0.0<=x<=1.0)"),
        (["Hi", "--temp", "0.7", "--compare-ar"], "--compare-ar at --temp > 0 needs --seed"),
        (["Hi", "--ngram-max", "3"], "--ngram-max/--ngram-min apply to --drafter ngram"),
        (["Hi", "--lookup-history", "h.json"], "--lookup-history applies to --drafter lookup"),
        (["Hi", "--block-size", "33"], "--block-size is at most 32 with --drafter model"),
        (["Hi", "--draft-p-min", "1.5"], "'--draft-p-min': Input should be less than or equal to 1 (range 0.0<=x<=1.0)"),
        (["Hi", "--system-prompt", "x", "--ignore-chat-template"], "--system-prompt needs the chat template"),
    ],
)
def test_bad_options_exit_two_with_one_line(models, extra, message):
    result = invoke(*base(models), *extra)
    assert result.exit_code == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_drafter_model_without_draft_model(models):
    result = invoke("--model", models["llama"], "--drafter", "model", "Hi")
    assert result.exit_code == 2 and "--drafter model needs --draft-model" in result.stderr
    result = invoke("--model", models["llama"], "--drafter", "lookup", "--draft-model", models["llama"], "Hi")
    assert result.exit_code == 2 and "--draft-model is only used with --drafter model" in result.stderr
    result = invoke("--model", models["llama"], "Hi", "--draft-p-min", "0.5")
    assert result.exit_code == 2 and "--draft-p-min applies to a draft model" in result.stderr
    result = invoke("--model", models["llama"], "Hi", "--drafter", "ngram", "--ngram-min", "5", "--ngram-max", "3")
    assert result.exit_code == 2 and "--ngram-min (5) <= --ngram-max (3)" in result.stderr
    result = invoke("--model", models["llama"], "Hi", "--ngram-max", "3")
    assert result.exit_code == 2 and "apply to --drafter ngram" in result.stderr
    result = invoke("--model", models["llama"], "Hi", "--block-size", "65")
    assert result.exit_code == 2 and "'--block-size': Input should be less than or equal to 64" in result.stderr
    result = invoke("--model", models["llama"], "Hi", "--num-draft-tokens", "64")
    assert result.exit_code == 2 and "range 0<=x<=63" in result.stderr


def test_prompt_lookup_is_the_default_drafter_and_exact(models):
    text = "the cat sat on the mat. the cat sat on the mat. the cat"
    result = invoke("--model", models["llama"], text, "--ignore-chat-template", "-m", "24",
                    "--json", "--compare-ar")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["drafter"] == "lookup" and report["draft_model"] is None
    assert report["drafted"] > 0 and report["compare"]["identical"]
    # Long blocks by default, sized by the match and learned by match length.
    assert report["block_size"] == 64 and report["adaptive"]["length_rule"] == "match-length"
    # The simple n-gram lookup stays available for comparison.
    result = invoke("--model", models["llama"], text, "--ignore-chat-template", "-m", "24", "--json",
                    "--compare-ar", "--drafter", "ngram", "--ngram-min", "1", "--block-size", "64")
    assert result.exit_code == 0, result.output
    ngram = json.loads(result.stdout)
    assert ngram["drafter"] == "ngram" and ngram["drafted"] > 0 and ngram["compare"]["identical"]
    assert ngram["text"] == report["text"]


def test_lookup_history_drafts_from_earlier_runs(models, tmp_path):
    history = tmp_path / "history.json"
    args = ["--model", models["llama"], "Tell me something.", "-m", "32", "--json", "--compare-ar",
            "--lookup-history", history]
    first = invoke(*args)
    assert first.exit_code == 0, first.output
    saved = json.loads(history.read_text())
    assert len(saved["entries"]) == 1
    # The same task again: the model says what it said before, and the drafts know it.
    second = invoke(*args)
    assert second.exit_code == 0, second.output
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert b["text"] == a["text"] and b["compare"]["identical"]
    assert b["accepted"] >= 16 and b["accepted"] > a["accepted"]
    assert len(json.loads(history.read_text())["entries"]) == 1  # the same output is kept once
    # A damaged history: a warning, the same output, the file set aside and a new one written.
    damaged = history.read_text()[:-5]
    history.write_text(damaged)
    third = invoke(*args)
    assert third.exit_code == 0, third.output
    assert "warning: lookup history" in third.stderr and "damaged" in third.stderr
    assert json.loads(third.stdout)["text"] == a["text"]
    assert len(json.loads(history.read_text())["entries"]) == 1
    assert (tmp_path / "history.json.corrupt").read_text() == damaged


def test_adaptive_by_default_fixed_on_request(models):
    adaptive = invoke(*base(models), "Hi", "--json", "-m", "40", "--block-size", "7")
    report = json.loads(adaptive.stdout)
    assert report["adaptive"]["policy"] == "adaptive" and report["adaptive"]["k_max"] == 6
    assert len(report["adaptive"]["draft_lengths"]) > 1
    fixed = json.loads(invoke(*base(models), "Hi", "--json", "-m", "40", "--block-size", "7",
                              "--no-adaptive").stdout)
    assert fixed["adaptive"] == {"policy": "fixed", "k": 6}
    assert fixed["text"] == report["text"]
    lines = invoke(*base(models), "Hi", "-m", "40").stderr
    assert "Adaptive: draft lengths (length:blocks)" in lines


def test_sampling_is_reproducible_with_a_seed(models):
    def run(seed, *extra):
        r = invoke(*base(models), "Hi", "--json", "--temp", "0.9", "--top-p", "0.95", "--seed", str(seed), *extra)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    a, b, c = run(1), run(1), run(2)
    assert a["text"] == b["text"] and a["text"] != c["text"]
    assert a["sampling"] == {"temp": 0.9, "top_p": 0.95, "top_k": 0, "min_p": 0.0, "seed": 1}
    assert run(3, "--drafter", "model", "--top-k", "20", "--min-p", "0.05")["generated_tokens"] > 0


def test_draft_p_min_reaches_the_drafter(models):
    none = json.loads(invoke(*base(models), "Hi", "--json", "--no-adaptive", "--draft-p-min", "1").stdout)
    assert none["drafted"] == 0


@pytest.mark.parametrize(
    "model_key, message",
    [
        ("no-config", "has no config.json"),
        ("no-weights", "has no model*.safetensors"),
        ("unknown-arch", "cannot load architecture 'no_such_architecture'"),
    ],
)
def test_broken_model_directories_exit_one(models, model_key, message):
    result = invoke("--model", models[model_key], "--draft-model", models["llama-draft"], "Hi")
    assert result.exit_code == 1
    assert message in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_config_that_is_not_a_models_is_named_never_the_weights(models, tmp_path):
    for name, config, message in (("list", "[1, 2]", "is not a JSON object"),
                                  ("no-type", json.dumps({"hidden_size": 8}), "names no model_type")):
        folder = tmp_path / name
        shutil.copytree(models["llama"], folder)
        (folder / "config.json").write_text(config)
        result = invoke("--model", folder, "Hi")
        assert result.exit_code == 1 and message in result.stderr and "weights" not in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    result = invoke("--model", "", "Hi")
    assert result.exit_code == 2 and "the model name is empty" in result.stderr


def test_weights_that_do_not_fit_the_config_are_one_short_line_naming_the_fix(models, tmp_path):
    # MLX lists every parameter it missed, a line each (hundreds on a real model), and names no fix.
    for layers, said in ((6, "(Missing 36 parameters: model.layers.2.input_layernorm.weight, and 35 more)"),
                         (1, "(Received 9 parameters not in model: model.layers.1.input_layernorm.weight, and 8 "
                             "more)")):
        folder = tmp_path / f"layers-{layers}"
        shutil.copytree(models["llama"], folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
        result = invoke("--model", folder, "Hi")
        assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert f"cannot load {folder}: its weights do not fit its config.json {said}; download or convert " \
               f"{folder} again" in result.stderr, result.stderr


def test_missing_path_and_tokenizer_mismatch(models, tmp_path):
    result = invoke("--model", tmp_path / "nope" / "model", "--draft-model", models["llama"], "Hi")
    assert result.exit_code == 1 and "no directory" in result.stderr
    result = invoke(*base(models, "llama", "other-tokenizer"), "Hi")
    assert result.exit_code == 1
    assert "vocabulary differs" in result.stderr and "same tokenizer" in result.stderr


def test_refused_cache_exits_one_before_generating(models, monkeypatch):
    from mlx_lm.models.cache import KVCache

    import specdec_cli.cache.caches as caches

    class OddKVCache(KVCache):  # a model file's own cache: its trim contract is unknown
        pass

    monkeypatch.setattr(caches, "make_prompt_cache", lambda model: [OddKVCache()])
    result = invoke(*base(models), "Hi")
    assert result.exit_code == 1
    assert "OddKVCache" in result.stderr and "cannot roll back" in result.stderr
    assert result.stdout == ""


def _hub_error(cls, message):
    # Hub errors want an HTTP response; only the type and text matter here.
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    return err


@pytest.fixture
def hub(models, monkeypatch):
    """Mock only the network call: known repo ids map to local snapshots."""
    calls = []

    def snapshot_download(repo_id, allow_patterns=None, **kwargs):
        calls.append(repo_id)
        known = {"test-org/tiny-llama": models["llama"], "test-org/tiny-llama-draft": models["llama-draft"]}
        if repo_id in known:
            return str(known[repo_id])
        if repo_id == "test-org/gated":
            raise _hub_error(hub_errors.GatedRepoError, "gated")
        if repo_id == "test-org/offline":
            raise hub_errors.LocalEntryNotFoundError("ConnectError: Name or service not known")
        raise _hub_error(hub_errors.RepositoryNotFoundError, "404")

    monkeypatch.setattr(files.huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_hub_repo_ids_download_then_load(models, hub):
    result = invoke("--model", "test-org/tiny-llama", "--draft-model", "test-org/tiny-llama-draft",
                    "Hi", "-m", "8", "--json", "--compare-ar")
    assert result.exit_code == 0, result.output
    # The drafter first: what it is (an MTP head given as a draft model, a missing repo) fails before the
    # target, the larger download, is fetched.
    assert hub == ["test-org/tiny-llama-draft", "test-org/tiny-llama"]
    assert json.loads(result.stdout)["compare"]["identical"]


@pytest.mark.parametrize(
    "repo, message",
    [
        ("test-org/missing", "not found on the Hugging Face Hub"),
        ("test-org/gated", "is gated"),
        ("test-org/offline", "Hub is unreachable"),
    ],
)
def test_hub_failures_exit_one_with_the_fix(models, hub, repo, message):
    result = invoke("--model", repo, "--draft-model", models["llama"], "Hi")
    assert result.exit_code == 1
    assert message in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1


def test_offline_mode_is_named_as_the_cause_not_the_network(models, hub, monkeypatch):
    # With HF_HUB_OFFLINE set, "the Hub is unreachable ... connect" sent the user to a network that was fine.
    monkeypatch.setattr(files.huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    result = invoke("--model", "test-org/offline", "--draft-model", models["llama"], "Hi")
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1
    assert "offline mode is on (HF_HUB_OFFLINE" in result.stderr and "unset it" in result.stderr
    assert "unreachable" not in result.stderr


def test_a_multi_line_error_is_printed_on_one_line(models, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("Missing parameters:\n  model.layers.0.weight\n  model.layers.1.weight")

    monkeypatch.setattr("mlx_lm.utils.load_model", broken)
    result = invoke(*base(models), "Hi")
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and "Missing parameters: model.layers.0.weight" in result.stderr


def test_debug_shows_the_traceback(models):
    result = invoke("--model", models["no-config"], "--draft-model", models["llama"], "Hi", "--debug")
    assert result.exit_code != 0
    assert result.exception is not None and "config.json" in str(result.exception)


def test_ctrl_c_prints_stats_so_far_and_exits_130(models, monkeypatch):
    real = ModelDrafter.propose
    calls = {"n": 0}

    def propose(self, last, k, params):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(self, last, k, params)

    monkeypatch.setattr(ModelDrafter, "propose", propose)
    result = invoke(*base(models), "Hi", "-m", "40")
    assert result.exit_code == 130
    assert re.search(r"^Generation: \d+ tokens", result.stderr, re.M)
    assert result.stdout.strip()


@pytest.mark.parametrize("module", ["specdec_cli", "specdec_cli.cli.entry"])
def test_python_dash_m_entry_point(module):
    # The console script's own module too: run with -m it imported main, ran nothing and exited 0.
    out = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("specdec ")


# --- specdec sweep -------------------------------------------------------------

def sweep(*args: str):
    return CliRunner().invoke(app, ["sweep", *map(str, args)])


def test_sweep_json_has_a_row_per_block_size(models):
    result = sweep(*base(models, "qwen3_5", "qwen3_5-draft"), "Hi", "--block-sizes", "1,2,5", "--json",
                   "--repeats", "2", "--warmup", "0")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ar_decode_tps"] > 0 and report["best_block_size"] in (1, 2, 5)
    rows = report["rows"]
    assert [r["block_size"] for r in rows] == [1, 2, 5]
    fields = {"block_size", "decode_tps", "speedup", "acceptance", "mean_accepted_per_block",
              "draft_ms", "verify_ms", "rollback_ms", "syncs_per_block", "identical"}
    assert all(fields <= set(r) for r in rows)
    assert all(r["identical"] for r in rows)
    # Block size 1 drafts nothing: no acceptance (null, as generate --json says it), not 0.0 (all rejected).
    assert rows[0]["acceptance"] is None and rows[0]["mean_accepted_per_block"] is None
    assert rows[2]["acceptance"] is not None and rows[2]["verify_ms"] > 0
    # The hybrid target re-forwards on partial accepts: rollback time is measured.
    assert rows[2]["rollback_ms"] > 0 and rows[2]["syncs_per_block"] == 1.0


def test_sweep_table_marks_the_best_block_size(models):
    result = sweep(*base(models), "Hi", "--block-sizes", "2,3", "--warmup", "0")
    assert result.exit_code == 0, result.output
    assert "specdec sweep" in result.stdout and "speedup" in result.stdout
    assert re.search(r"^│\s+[23]\*", result.stdout, re.M)
    assert "best block size:" in result.stderr


def test_sweep_with_prompt_lookup(models):
    result = sweep("--model", models["llama"], "--drafter", "lookup", "a b a b a b a b", "--ignore-chat-template",
                   "--block-sizes", "3,64", "--json", "--warmup", "0")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["drafter"] == "lookup"
    result = sweep("--model", models["llama"], "--drafter", "ngram", "a b a b", "--block-sizes", "65", "--warmup", "0")
    assert result.exit_code == 2 and "--block-sizes is at most 64 with --drafter ngram" in result.stderr


@pytest.mark.parametrize("sizes, message", [("2,x", "comma-separated integers"), ("0,2", "each >= 1"),
                                            ("2,2", "lists a size twice")])
def test_sweep_bad_block_sizes(models, sizes, message):
    result = sweep(*base(models), "Hi", "--block-sizes", sizes)
    assert result.exit_code == 2 and message in result.stderr


def test_sweep_flags_a_run_that_is_not_identical(models, monkeypatch):
    from specdec_cli.loop.flights import Flights

    real = Flights.alone  # the loop a sweep's speculative runs go through (plain decoding does not)

    only_default = False  # then only generate's default setting (the adaptive row) goes wrong

    def corrupt(self, request, **kw):
        for event in real(self, request, **kw):
            if hasattr(event, "block") and event.block.tokens and (self.opener.adaptive or not only_default):
                b = event.block
                event = type(event)(type(b)((b.tokens[0] ^ 1, *b.tokens[1:]), *list(b.__dict__.values())[1:]),
                                    event.seconds)
            yield event

    monkeypatch.setattr(Flights, "alone", corrupt)
    result = sweep(*base(models), "Hi", "--block-sizes", "2", "--warmup", "0", "--json")
    assert result.exit_code == 3
    row = json.loads(result.stdout)["rows"][0]
    assert row["identical"] is False and row["verdict"] == "diverged"
    assert "diverged from plain decoding" in result.stderr
    table = sweep(*base(models), "Hi", "--block-sizes", "2", "--warmup", "0")
    assert table.exit_code == 3 and re.search(r"│\s+NO\s+│", table.stdout)
    only_default = True
    result = sweep(*base(models), "Hi", "--block-sizes", "2", "--warmup", "0", "--json")
    out = json.loads(result.stdout)
    assert result.exit_code == 3 and out["rows"][0]["identical"] and out["default"]["verdict"] == "diverged"


# --- options that did nothing, silently (issue 28) ---------------------------------

def test_kv_group_size_without_kv_bits_is_refused_before_loading(tmp_path):
    # A model that does not exist: had the check waited for loading, that would be the error (exit 1).
    result = invoke("--model", tmp_path / "no-model", "Hi", "--kv-group-size", "32")
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and "--kv-group-size is the group size of --kv-bits" in result.stderr


def test_force_download_is_refused_when_every_model_is_local(models, tmp_path, monkeypatch):
    result = invoke("--model", models["llama"], "Hi", "--force-download")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert f"{models['llama']} is a local folder: drop --force-download" in result.stderr
    result = invoke("Hi", "--force-download")  # the bundled model is local too
    assert result.exit_code == 2 and "the bundled model is a local folder" in result.stderr
    result = CliRunner().invoke(app, ["distill", "--out", str(tmp_path / "head"), "--model", str(models["llama"]),
                                      "--force-download"])
    assert result.exit_code == 2 and "is a local folder: drop --force-download" in result.stderr
    assert not (tmp_path / "head").exists()
    # A Hub repo among them: it is downloaded again, the local draft model as it is.
    calls = []

    def download(repo_id, **kw):
        calls.append(kw.get("force_download"))
        return str(models["llama"])

    monkeypatch.setattr(files.huggingface_hub, "snapshot_download", download)
    result = invoke("--model", "org/tiny", "--draft-model", models["llama-draft"], "Hi", "-m", "4", "--force-download")
    assert result.exit_code == 0, result.output
    assert calls == [True]


def test_rollback_options_on_a_model_without_recurrent_layers_say_they_do_nothing(models):
    result = invoke(*base(models), "Hi", "--rollback", "capture", "--no-live")
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: --rollback")]
    assert notes == ["note: --rollback capture does nothing here: this model has no recurrent layers (every layer "
                     "rolls back by trimming its cache)"]
    result = invoke(*base(models), "Hi", "--rollback", "tape", "--rollback-memory-cap", "1", "--json")
    assert result.exit_code == 0, result.output
    assert "note: --rollback tape and --rollback-memory-cap do nothing here" in result.stderr
    assert json.loads(result.stdout)["rollback"] == "trim"
    # A hybrid's recurrent layers use them: no note.
    result = invoke(*base(models, "qwen3_5", "qwen3_5-draft"), "Hi", "--rollback", "capture", "--json")
    assert result.exit_code == 0 and "note: --rollback" not in result.stderr


def test_auto_with_a_lookup_history_names_the_lookup_drafter(models, tmp_path):
    result = invoke("--model", models["llama"], "Hi", "--drafter", "auto", "--lookup-history", tmp_path / "h.json")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "name it with --drafter lookup instead of auto" in result.stderr and "ngram" not in result.stderr
    result = invoke("--model", models["llama"], "Hi", "--drafter", "auto", "--ngram-max", "3")
    assert result.exit_code == 2 and "name it with --drafter ngram instead of auto" in result.stderr


def test_draft_p_min_with_auto_says_it_does_nothing_when_auto_picks_lookup(models):
    # Named, lookup is refused with --draft-p-min before loading; auto's pick is known only once loaded.
    result = invoke("--model", models["llama"], "Hi", "-m", "4", "--drafter", "auto", "--draft-p-min", "0.5", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["drafter"] == "lookup"
    assert ("note: --draft-p-min does nothing here: --drafter auto chose lookup, which has no probabilities to stop "
            "on") in result.stderr.splitlines()
    # Auto's draft model stops on it: no note.
    result = invoke(*base(models), "Hi", "--drafter", "auto", "--draft-p-min", "0.5", "--json")
    assert result.exit_code == 0 and "note: --draft-p-min" not in result.stderr, result.output


def test_help_gives_auto_the_block_size_of_the_drafter_it_picks(models):
    result = CliRunner().invoke(app, ["generate", "-h"], env={"COLUMNS": "200"}, terminal_width=200)
    text = re.sub(r"[│\s]+", " ", result.stdout)
    default = re.search(r"--block-size\b.*?\[default: ([^\]]*)\]", text).group(1)
    assert "auto 4" not in default and "auto: that of the drafter it picks" in default
    # With no drafter at hand auto picks lookup, whose blocks are 64 long: what the help now says.
    result = invoke("--model", models["llama"], "Hi", "-m", "4", "--drafter", "auto", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["drafter"] == "lookup" and report["block_size"] == 64


def test_a_sweep_says_which_block_sizes_its_max_tokens_cannot_hold(models):
    # At -m 4 a block drafts at most 3: sizes 8 and 16 timed the blocks of size 4 under their own labels,
    # and noise could name one of them the best block size.
    def run(sizes):
        return sweep("--model", models["llama"], "Hi", "-m", "4", "--block-sizes", sizes, "--warmup", "0", "--json")

    result = run("2,8,16")
    assert result.exit_code == 0, result.output
    assert "block sizes 8,16 measure as 4; raise --max-tokens to measure them" in result.stderr
    assert "measure as" not in run("2,4").stderr


def test_sweep_reads_the_lookup_history_and_leaves_it_as_it_was(models, tmp_path):
    history = tmp_path / "history.json"
    sweep = ["sweep", "--model", str(models["llama"]), "Hi", "-m", "8", "--block-sizes", "2,4", "--warmup", "0",
             "--json", "--lookup-history", str(history)]
    # Not there yet (a mistyped path): the sweep, which never writes it, says it drafts from the prompt alone.
    result = CliRunner().invoke(app, sweep)
    assert result.exit_code == 0, result.output
    assert f"note: --lookup-history {history} holds no output of this model's tokenizer" in result.stderr
    assert not history.exists()
    assert invoke("--model", models["llama"], "Hi", "-m", "8", "--lookup-history", history).exit_code == 0
    before = history.read_bytes()
    result = CliRunner().invoke(app, sweep)
    assert result.exit_code == 0, result.output
    assert "note: --lookup-history" not in result.stderr
    assert history.read_bytes() == before
    # ... as its help says (generate's says it adds the run's output).
    helps = {}
    for command in ("generate", "sweep"):
        out = CliRunner().invoke(app, [command, "-h"], env={"COLUMNS": "200"}, terminal_width=200).stdout
        helps[command] = re.sub(r"[│\s]+", " ", out)
    assert "read only: a sweep does not add its own output" in helps["sweep"]
    assert "and add this one" not in helps["sweep"] and "and add this one" in helps["generate"]
