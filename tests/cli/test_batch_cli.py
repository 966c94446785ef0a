"""``specdec generate --prompts-file`` and ``specdec sweep --concurrency``, through Typer's CliRunner.

The invariant: a row's text is what ``specdec generate`` prints for that prompt
alone, whatever shares the batch. This process runs MLX's bundled BLAS, whose
batched kernels give each row the bits of its own forward, so the comparisons
here are exact (greedy and seeded sampling alike).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import rows_per_call
from typer.testing import CliRunner

from specdec_cli.cli.app import app
from specdec_cli.session.synthetic import make_model_dir

# Byte-level prompts of different lengths; two repeat themselves, so lookup drafts get accepted.
PROMPTS = [
    "The quick brown fox jumps over the lazy dog, twice: the quick brown fox.",
    "abc abc abc abc abc",
    "Hi",
]
GEN = "12"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": make_model_dir(root / "llama", "llama", seed=0),
        "llama-draft": make_model_dir(root / "llama-draft", "llama", seed=0, noise=0.05),
        "qwen3_5": make_model_dir(root / "qwen3_5", "qwen3_5", seed=0),
        "qwen3_5-draft": make_model_dir(root / "qwen3_5-draft", "qwen3_5", seed=0, noise=0.05),
    }


def generate(*args, input: str | None = None):
    return CliRunner().invoke(app, ["generate", *map(str, args)], input=input)


def alone(model_args: list, prompt: str, *extra) -> dict:
    result = generate(*model_args, "-p", prompt, "--json", *extra)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def write(tmp_path: Path, name: str, lines: list) -> Path:
    path = tmp_path / name
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


@pytest.mark.parametrize("target, draft", [("llama", None), ("qwen3_5", "qwen3_5-draft")])
def test_each_row_is_its_prompt_alone_and_compare_ar_proves_it(models, tmp_path, target, draft, monkeypatch):
    from specdec_cli.loop.flights import Flights

    together = rows_per_call(monkeypatch, Flights, "prefill_together")  # rows of each forward of several prompts
    model_args = ["--model", models[target], "-m", GEN] + (["--draft-model", models[draft]] if draft else [])
    # Blank lines are skipped; the rows keep the file's order.
    path = write(tmp_path, "prompts.txt", [PROMPTS[0], "", PROMPTS[1], "  ", PROMPTS[2]])
    result = generate(*model_args, "--prompts-file", path, "--json", "--compare-ar")
    assert result.exit_code == 0, result.output
    # The two short prompts share one prefill forward (the long one would be mostly padding beside them), in the
    # speculative batch and in the plain batch it is weighed against; a model with recurrent layers prefills each alone.
    assert together == ([2, 2] if target == "llama" else []), together
    report = json.loads(result.stdout)
    rows = report["rows"]
    assert [r["line"] for r in rows] == [1, 3, 5] and [r["prompt"] for r in rows] == PROMPTS
    for row, prompt in zip(rows, PROMPTS):
        one = alone(model_args, prompt)
        assert row["text"] == one["text"] and row["generated_tokens"] == one["generated_tokens"]
        assert row["prompt_tokens"] == one["prompt_tokens"] and row["finish_reason"] == one["finish_reason"]
        assert row["compare"]["verdict"] == "identical"
    summary = report["summary"]
    assert summary["compare"]["identical"] == 3 and summary["compare"]["diverged"] == 0
    assert summary["most_rows_together"] == summary["decode_concurrency"] == 3


MORE = PROMPTS + ["one two three four five six seven eight nine ten; one two three",
                  "Hello there, how are you today? Hello there, how"]


@pytest.mark.parametrize("target", ["llama", "qwen3_5"])
def test_on_a_gpu_like_backend_each_row_is_its_prompt_alone_or_a_proven_tie(models, tmp_path, target, gpu_like,
                                                                              monkeypatch):
    # The batch check passes (rows round apart by rounding alone), the rows decode together, and each row's
    # verdict against its prompt alone is identical or a rounding tie held to the measured rounding.
    path = write(tmp_path, "prompts.txt", MORE)
    args = ["--model", models[target], "-m", "24", "--prompts-file", path, "--json", "--compare-ar"]
    result = generate(*args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    verdicts = [r["compare"]["verdict"] for r in report["rows"]]
    assert set(verdicts) <= {"identical", "rounding tie"} and report["summary"]["most_rows_together"] == len(MORE)
    for row in report["rows"]:
        d = row["compare"]["first_divergence"]
        if d is not None:  # a tie: plain decoding's token leads by no more than rounding moves a logit
            assert d["rounding_bound"] > 0 and 0 <= row["compare"]["margin"] <= d["rounding_bound"]
    if target != "llama":
        return
    # A fault the start-up check cannot see (from three rows on, each row reads its neighbour's keys and values):
    # a row diverges, and the verdict says so and the exit code too.
    from specdec_cli.cache import batch_cache

    real = batch_cache.RowsKVCache.update_and_fetch

    def wrong(self, keys, values):
        k, v = real(self, keys, values)
        return (k, v) if k.shape[0] < 3 else (mx.roll(k, 1, axis=0), mx.roll(v, 1, axis=0))

    monkeypatch.setattr(batch_cache.RowsKVCache, "update_and_fetch", wrong)
    result = generate(*args)
    assert result.exit_code == 3, result.output
    report = json.loads(result.stdout)
    assert "diverged" in [r["compare"]["verdict"] for r in report["rows"]]
    text = generate(*args[:-2], "--compare-ar")
    assert "DIVERGED" in text.stderr and "past what this backend's rounding moves a logit by" in text.stderr


def test_jsonl_prompts_messages_and_per_line_max_tokens(models, tmp_path):
    model_args = ["--model", models["llama"], "--draft-model", models["llama-draft"], "-m", GEN]
    path = write(tmp_path, "prompts.jsonl", [
        {"prompt": PROMPTS[0]},
        {"messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 5},
        "",
        {"prompt": PROMPTS[2], "max_tokens": 20},
    ])
    result = generate(*model_args, "--prompts-file", path, "--json", "--system-prompt", "Be brief.")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    assert [r["line"] for r in rows] == [1, 2, 4]
    expected = [alone(model_args, PROMPTS[0], "--system-prompt", "Be brief."),
                alone(model_args, PROMPTS[1], "--system-prompt", "Be brief.", "-m", "5"),
                alone(model_args, PROMPTS[2], "--system-prompt", "Be brief.", "-m", "20")]
    for row, one in zip(rows, expected):
        assert row["text"] == one["text"] and row["prompt_tokens"] == one["prompt_tokens"]
        assert row["generated_tokens"] == one["generated_tokens"]
    assert rows[1]["generated_tokens"] <= 5


def test_fewer_rows_at_a_time_give_the_same_texts(models, tmp_path):
    model_args = ["--model", models["llama"], "-m", GEN]
    path = write(tmp_path, "prompts.txt", PROMPTS * 2)
    texts = {}
    for n in ("1", "2", "6"):
        result = generate(*model_args, "--prompts-file", path, "--json", "--decode-concurrency", n)
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        texts[n] = [r["text"] for r in report["rows"]]
        assert report["summary"]["most_rows_together"] == int(n)
    assert texts["1"] == texts["2"] == texts["6"]
    assert texts["1"][:3] == texts["1"][3:]


def test_seeded_sampling_gives_each_row_its_text_alone(models, tmp_path):
    model_args = ["--model", models["llama"], "--draft-model", models["llama-draft"], "-m", GEN,
                  "--temp", "0.9", "--top-p", "0.95"]
    path = write(tmp_path, "prompts.jsonl", [{"prompt": PROMPTS[0]}, {"prompt": PROMPTS[1], "seed": 7},
                                             {"prompt": PROMPTS[2]}])
    result = generate(*model_args, "--prompts-file", path, "--json", "--seed", "3", "--compare-ar")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    assert [r["seed"] for r in rows] == [3, 7, 3]
    for row, prompt in zip(rows, PROMPTS):
        assert row["text"] == alone(model_args, prompt, "--seed", str(row["seed"]))["text"]
        assert row["compare"]["verdict"] == "identical"
    # --compare-ar at --temp > 0 needs a seed for every row.
    unseeded = generate(*model_args, "--prompts-file", path, "--compare-ar")
    assert unseeded.exit_code == 2 and "line 1 has none" in unseeded.stderr


def test_text_output_is_each_row_under_its_heading_then_the_summary(models, tmp_path):
    path = write(tmp_path, "prompts.txt", PROMPTS)
    result = generate("--model", models["llama"], "-m", GEN, "--prompts-file", path, "--compare-ar")
    assert result.exit_code == 0, result.output
    headings = re.findall(r"^\[(\d)/3\] (.*)$", result.stdout, re.M)
    assert [h[0] for h in headings] == ["1", "2", "3"] and headings[2][1] == "Hi"
    err = result.stderr
    assert len(re.findall(r"^\[\d/3\] line \d: ", err, re.M)) == 3
    assert len(re.findall(r"^  Generation: \d+ tokens, [\d.]+ tokens-per-sec$", err, re.M)) == 3
    assert len(re.findall(r"^  Compare: identical \(\d+ tokens\)$", err, re.M)) == 3
    assert re.search(r"^Batch: 3 prompts, at most 3 decoding together", err, re.M)
    assert re.search(r"^Generation: \d+ tokens in all, [\d.]+ tokens-per-sec aggregate", err, re.M)
    assert re.search(r"^Latency: mean [\d.]+ s, worst [\d.]+ s", err, re.M)
    assert re.search(r"^Compare: 3 identical, 0 rounding ties, 0 diverged$", err, re.M)
    assert re.search(r"^Plain decoding, one prompt after another: \d+ tokens, [\d.]+ tokens-per-sec aggregate; "
                     r"the batch's aggregate is [\d.]+x that, batching's own gain included$", err, re.M)


def test_json_summary_numbers_follow_from_the_rows(models, tmp_path):
    result = generate("--model", models["llama"], "-m", GEN, "--json", "--prompts-file", "-",
                      input="\n".join(PROMPTS) + "\n")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # the whole of stdout is one object
    rows, summary = report["rows"], report["summary"]
    assert {"text", "line", "prompt", "seed", "generated_tokens", "decode_tps", "acceptance", "finish_reason",
            "latency_s"} <= set(rows[0])
    assert summary["rows"] == 3 and summary["compare"] is None and report["interrupted"] is False
    assert summary["generated_tokens"] == sum(r["generated_tokens"] for r in rows)
    assert summary["aggregate_tps"] == pytest.approx(summary["generated_tokens"] / summary["decode_s"])
    latencies = [r["latency_s"] for r in rows]
    assert summary["worst_latency_s"] == max(latencies)
    assert summary["mean_latency_s"] == pytest.approx(sum(latencies) / 3)
    assert summary["wall_s"] >= summary["decode_s"] + summary["prefill_s"] - 1e-6
    assert summary["worst_latency_s"] <= summary["wall_s"] + 1e-6


@pytest.mark.parametrize("lines, message", [
    ([], "holds no prompt"),
    (["", "   "], "holds no prompt"),
    ([{"prompt": "a"}, '{"prompt": "b",'], "line 2: not valid JSON"),
    ([{"prompt": "a"}, {"text": "b"}], "line 2: unknown field 'text'"),
    ([{"max_tokens": 3}], "line 1: give \"prompt\""),
    ([{"prompt": "a"}, "plain text"], "line 2: not valid JSON"),
    ([{"prompt": "a", "max_tokens": 0}], "line 1: \"max_tokens\" must be an integer >= 1"),
    ([{"prompt": ""}], "line 1: \"prompt\" must be a non-empty string"),
    ([{"messages": "hi"}], "line 1: \"messages\" must be a non-empty list"),
    ([{"prompt": "a"}, {"messages": [{"role": "robot", "content": "hi"}]}], "line 2: a message's role is 'robot'"),
])
def test_a_bad_file_is_one_line_naming_the_line(models, tmp_path, lines, message):
    path = write(tmp_path, "bad.jsonl", lines) if lines else tmp_path / "empty.txt"
    if not lines:
        path.write_text("")
    result = generate("--model", models["llama"], "--prompts-file", path)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and str(path) in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_bad_combinations_and_a_missing_file(models, tmp_path):
    path = write(tmp_path, "p.txt", PROMPTS)
    cases = [
        (["--prompts-file", tmp_path / "nope.txt"], "cannot read --prompts-file"),
        (["--prompts-file", path, "-p", "Hi"], "not both"),
        (["--prompts-file", path, "Hi"], "not both"),
        (["-p", "Hi", "--decode-concurrency", "2"], "add --prompts-file FILE"),
        (["--prompts-file", path, "--decode-concurrency", "0"], "--decode-concurrency"),
    ]
    for args, message in cases:
        result = generate("--model", models["llama"], *args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.stderr and result.stderr.count("\n") == 1
    # A messages line needs the chat template.
    jsonl = write(tmp_path, "m.jsonl", [{"messages": [{"role": "user", "content": "Hi"}]}])
    result = generate("--model", models["llama"], "--prompts-file", jsonl, "--ignore-chat-template")
    assert result.exit_code == 2 and "m.jsonl line 1: \"messages\" need the chat template" in result.stderr


def test_the_disk_tiers_options_say_they_do_nothing_where_no_disk_tier_runs(models, tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDEC_PROMPT_CACHE_DIR")
    monkeypatch.delenv("SPECDEC_PROMPT_CACHE_DISK_GB")
    folder = tmp_path / "prompt-cache"
    path = write(tmp_path, "p.txt", PROMPTS[:1])
    result = generate("--model", models["llama"], "--prompts-file", path, "-m", "4", "--prompt-cache-dir", folder,
                      "--prompt-cache-disk-gb", "1")
    assert result.exit_code == 0, result.output
    assert "note: --prompt-cache-dir and --prompt-cache-disk-gb do nothing with --prompts-file" in result.stderr
    result = generate("--model", models["llama"], "-p", "Hi", "-m", "4", "--compare-ar", "--prompt-cache-dir", folder)
    assert result.exit_code == 0 and "note: --prompt-cache-dir does nothing with --compare-ar" in result.stderr
    assert not folder.exists()
    # Set in the environment (once, for every run): nothing to say.
    monkeypatch.setenv("SPECDEC_PROMPT_CACHE_DIR", str(folder))
    result = generate("--model", models["llama"], "-p", "Hi", "-m", "4", "--compare-ar")
    assert result.exit_code == 0 and "prompt-cache" not in result.stderr


def test_ctrl_c_shows_what_each_row_had_and_exits_130(models, tmp_path, monkeypatch):
    from specdec_cli.loop.engine import Engine

    real = Engine.step
    calls = {"n": 0}

    def step(self):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(Engine, "step", step)
    path = write(tmp_path, "p.txt", PROMPTS + ["a fourth prompt, never started"])
    result = generate("--model", models["llama"], "-m", "40", "--prompts-file", path, "--decode-concurrency", "3",
                      "--json")
    assert result.exit_code == 130, result.output
    report = json.loads(result.stdout)
    assert report["interrupted"] is True
    rows = report["rows"]
    assert [r["finish_reason"] for r in rows] == ["interrupted"] * 4  # the fourth before it started
    # Five blocks ran for every row in flight; the block Ctrl-C stopped left nothing behind.
    assert all(r["blocks"] == 5 and r["text"] for r in rows[:3]) and rows[3]["generated_tokens"] == 0
    calls["n"] = 0
    text = generate("--model", models["llama"], "-m", "40", "--prompts-file", path, "--decode-concurrency", "3")
    assert text.exit_code == 130
    assert re.findall(r"^\[(\d)/4\]", text.stdout, re.M) == ["1", "2", "3"]
    assert "Interrupted (Ctrl-C or SIGTERM)" in text.stderr


def test_sweep_by_concurrency(models):
    args = ["sweep", "--model", models["llama"], "--drafter", "lookup", "a b a b a b a b", "--ignore-chat-template",
            "-m", "10", "--block-sizes", "2,4", "--concurrency", "1,2", "--warmup", "0"]
    result = CliRunner().invoke(app, [*map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["concurrency"] == [1, 2] and report["block_sizes"] == [2, 4]
    cells = {(c["block_size"], c["concurrency"]): c for c in report["cells"]}
    assert set(cells) == {(b, n) for b in (None, 2, 4) for n in (1, 2)}
    assert all(c["verdict"] == "identical" and c["aggregate_tps"] > 0 for c in cells.values())
    # Two copies of the prompt generate twice the tokens.
    assert cells[(2, 2)]["tokens"] == 2 * cells[(2, 1)]["tokens"]
    assert cells[(None, 1)]["speedup"] == 1.0 and report["best_block_size"]["2"] in (2, 4)
    # Plain decoding drafts nothing: no acceptance (null), not 0.0 (every draft rejected).
    assert cells[(None, 1)]["acceptance"] is None and cells[(None, 2)]["acceptance"] is None
    table = CliRunner().invoke(app, list(map(str, args)))
    assert table.exit_code == 0, table.output
    assert re.search(r"block\s+┃\s+x1\s+┃\s+x2\s+┃\s+same", table.stdout)
    assert re.search(r"│\s+plain\s+│\s+[\d.]+\s+│\s+[\d.]+\s+│\s+yes\s+│", table.stdout)
    bad = CliRunner().invoke(app, [*map(str, args[:-6]), "--concurrency", "1,x"])
    assert bad.exit_code == 2 and "--concurrency takes comma-separated integers" in bad.stderr
