"""Bad input of every kind (bytes, empty prompts, damaged files, fuzzed options, values out of range) gets
one clear line and a non-zero exit, never a traceback; and each command's help."""

from __future__ import annotations

import json
import random
import re

import pytest
from typer.testing import CliRunner

from cli_fixtures import CLASS_NAME, generate, models, one_line  # noqa: F401 (models: a fixture)
import specdec_cli.cli.commands as commands
import specdec_cli.session.generate as session_generate
import specdec_cli.model.files as files
from specdec_cli.cli.app import app


def test_stdin_that_is_not_utf8_is_replaced_with_one_warning(models):
    result = generate("--model", models["llama"], "-", "-m", "4", "--json", "--ignore-chat-template",
                      input=b"Hello \xff\xfe world")
    assert result.exit_code == 0, result.output
    assert one_line(result).startswith("warning: stdin is not valid UTF-8")
    report = json.loads(result.stdout)
    # Byte-level tokens: each U+FFFD is its three UTF-8 bytes.
    assert report["prompt_tokens"] == len("Hello ") + 2 * 3 + len(" world")
    assert report["generated_tokens"] > 0 or report["finish_reason"] == "eos"


def test_a_prompt_read_from_a_terminal_says_how_to_end_it(monkeypatch, capsys):
    # `generate -` typed at a terminal waited without a word; piped, it stays quiet.
    import io
    import sys

    from specdec_cli.model.prompts import read_prompt

    class Terminal(io.TextIOWrapper):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Terminal(io.BytesIO(b"Hello\n")))
    assert read_prompt("-", None) == "Hello\n"
    assert "end it with Ctrl-D" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Hello\n")))
    assert read_prompt("-", None) == "Hello\n" and capsys.readouterr().err == ""


@pytest.mark.parametrize("args, stdin, message", [
    (["-p", ""], None, "the prompt is empty"),
    (["   "], None, "the prompt is empty"),
    (["-"], "", "stdin was empty"),
    (["-"], " \n", "stdin was empty"),
])
def test_an_empty_prompt_is_a_usage_error(models, args, stdin, message):
    result = generate("--model", models["llama"], *args, input=stdin)
    assert result.exit_code == 2 and message in one_line(result)


def test_a_truncated_weight_file_names_the_file_and_the_fix(models, monkeypatch):
    result = generate("--model", models["truncated"], "Hi")
    assert result.exit_code == 1
    line = one_line(result)
    assert str(models["truncated"] / "model.safetensors") in line and "truncated" in line
    assert "download or convert" in line
    # From the Hub: the fix is --force-download, which reaches snapshot_download.
    calls = []

    def snapshot_download(repo_id, force_download=False, **kw):
        calls.append(force_download)
        return str(models["truncated"] if not force_download else models["llama"])

    monkeypatch.setattr(files.huggingface_hub, "snapshot_download", snapshot_download)
    result = generate("--model", "org/cut-download", "Hi", "-m", "2")
    assert result.exit_code == 1 and "run again with --force-download" in one_line(result)
    assert generate("--model", "org/cut-download", "Hi", "-m", "2", "--force-download").exit_code == 0
    assert calls == [False, True]


def test_an_unexpected_failure_says_something_useful_without_class_names(models, monkeypatch):
    def boom(*args, **kwargs):
        raise KeyError("layers.0")

    monkeypatch.setattr(session_generate.Flights, "alone", boom)
    result = generate("--model", models["llama"], "Hi", "-m", "2")
    assert result.exit_code == 1
    line = one_line(result)
    assert "something went wrong inside specdec" in line and "--debug" in line and "KeyError" not in line


# --- every option checked at the boundary ------------------------------------

GENERATE_OPTIONS = [
    "--model", "--draft-model", "--dtype", "--adapter-path", "--kv-bits", "--kv-group-size",
    "--prefill-step-size", "--prompt", "--system-prompt", "--chat-template-config", "--prefill-response",
    "--drafter", "--block-size", "--num-draft-tokens", "--draft-p-min", "--ngram-max", "--ngram-min",
    "--rollback", "--max-tokens", "--temp", "--top-p", "--top-k", "--min-p", "--seed", "--extra-eos-token",
    "--repetition-penalty", "--repetition-context-size", "--json-schema",
]
SWEEP_OPTIONS = [o for o in GENERATE_OPTIONS if o not in {
    "--num-draft-tokens", "--temp", "--top-p", "--top-k", "--min-p", "--seed", "--block-size",
    "--repetition-penalty", "--repetition-context-size", "--json-schema"}] + [
    "--block-sizes", "--repeats", "--warmup"]


def _fuzz_values(rng: random.Random) -> list[str]:
    noise = bytes(rng.randrange(1, 256) for _ in range(12)).decode("utf-8", "surrogateescape")
    return [noise, "", "-1", "0", "1e400", "nan", "-inf", str(10**30), str(-(10**30)), "2,0,x", "{", "-"]


@pytest.mark.parametrize("command, options", [("generate", GENERATE_OPTIONS), ("sweep", SWEEP_OPTIONS)])
def test_fuzzed_options_exit_1_or_2_in_at_most_3_lines(tmp_path, command, options):
    rng = random.Random(18)
    missing = str(tmp_path / "no-model")  # whatever passes the checks then fails to load: exit 1
    runner = CliRunner()
    for option in options:
        for value in _fuzz_values(rng):
            args = [command, "--model", missing, "Hi", option, value]
            if option == "--model":
                args = [command, "Hi", option, value]
            result = runner.invoke(app, args, input="")
            where = f"{command} {option} {value!r}: {result.stderr!r}"
            assert result.exit_code in (1, 2), where
            assert result.exception is None or isinstance(result.exception, SystemExit), where
            assert 1 <= len(result.stderr.strip().splitlines()) <= 3, where
            assert "Traceback" not in result.output and not CLASS_NAME.search(result.stderr), where
    # The prompt argument itself.
    for value in _fuzz_values(rng):
        result = runner.invoke(app, [command, "--model", missing, value], input="")
        assert result.exit_code in (1, 2) and len(result.stderr.strip().splitlines()) <= 3


@pytest.mark.parametrize("args, message", [
    (["--block-size", "200"], "range 1<=x<=64"),
    (["--num-draft-tokens", "-1"], "range 0<=x<=63"),
    (["--temp", "-0.5"], "range x>=0.0"),
    (["--top-p", "2"], "range 0.0<=x<=1.0"),
    (["--min-p", "-1"], "range 0.0<=x<=1.0"),
    (["--top-k", "-3"], "range 0<=x<="),
    (["--draft-p-min", "3"], "range 0.0<=x<=1.0"),
    (["--prefill-step-size", "0"], "range 1<=x<="),
    (["--kv-bits", "7"], "is not one of 2, 3, 4, 5, 6, 8"),
    (["--repetition-penalty", "-1"], "range x>=0.0"),
    (["--repetition-context-size", "0"], "range 1<=x<="),
    (["--temp", "nan"], "'--temp'"),
    (["--drafter", "ngram", "--ngram-min", "5", "--ngram-max", "3"], "--ngram-min (5) <= --ngram-max (3)"),
])
def test_each_bad_value_names_the_range(models, args, message):
    result = generate("--model", models["llama"], "Hi", *args)
    assert result.exit_code == 2 and message in one_line(result)


@pytest.mark.parametrize("command", ["generate", "serve", "chat"])
def test_a_disk_bound_past_any_disk_names_the_option_from_the_command_line_or_the_environment(models, command,
                                                                                              monkeypatch):
    # 1e300 GB is finite, but its byte count is not: it crashed start-up with "cannot convert float infinity".
    runner = CliRunner()
    for args, env in ((["--prompt-cache-disk-gb", "1e300"], {}), ([], {"SPECDEC_PROMPT_CACHE_DISK_GB": "1e300"})):
        result = runner.invoke(app, [command, "--model", str(models["llama"]), *args], input="Hi", env=env)
        assert result.exit_code == 2 and "--prompt-cache-disk-gb" in one_line(result), result.output
        assert "0.0<=x<=1048576" in one_line(result)


def test_a_schema_that_cannot_be_decoded_is_refused_before_the_first_token(models, tmp_path):
    schema = tmp_path / "loop.json"
    schema.write_text('{"$ref": "#"}')
    result = generate("--model", models["llama"], "Hi", "--json-schema", schema)
    assert result.exit_code == 2 and "cannot be decoded: its grammar fails before the first token" in one_line(result)


def test_block_size_maximum_is_a_named_constant():
    assert commands.MAX_ANY_BLOCK_SIZE == max(commands.MAX_BLOCK_SIZE.values()) == 64
    result = CliRunner().invoke(app, ["sweep", "--model", "x", "Hi", "--block-sizes", "2,65"])
    assert result.exit_code == 2 and "--block-sizes is at most 64 with --drafter lookup" in result.stderr


# --- help ----------------------------------------------------------------------

@pytest.mark.parametrize("command", ["generate", "sweep"])
def test_help_has_panels_defaults_flags_and_an_example(command):
    result = CliRunner().invoke(app, [command, "-h"], env={"COLUMNS": "200"}, terminal_width=200)
    assert result.exit_code == 0
    text = re.sub(r"[│\s]+", " ", result.stdout)  # wrapped cells read as one line
    for panel in ("Model", "Prompt", "Drafting", "Sampling", "Output", "Diagnostics"):
        assert f"╭─ {panel} ─" in text, panel
    assert "<bool>" not in text
    assert re.search(r"--block-size[s]?\b.*\[default: (model 4, lookup 64[^\]]*|2,3,4,6,8,12,16)\]", text)
    assert "--ngram-max" in text and "[default: 4]" in text and "[default: 2]" in text
    assert "[default: auto]" in text and "[default: 0, never stop early]" in text
    assert "Example: specdec " + command in text
    if command == "generate":
        assert re.search(r"--live --no-live", text)
    assert CliRunner().invoke(app, ["-h"]).exit_code == 0


def test_a_sweep_too_short_to_draft_is_refused_before_the_model_loads(monkeypatch):
    # A block drafts at most the room left less one: at -m 1 nothing drafts, and a table of "speedups"
    # of plain steps would be noise read as a result.
    monkeypatch.setattr(commands, "load_setup", lambda *a, **k: pytest.fail("the model loaded"))
    result = CliRunner().invoke(app, ["sweep", "--model", "x", "Hi", "-m", "1"])
    assert result.exit_code == 2
    line = one_line(result)
    assert "--max-tokens 1 leaves no room for a draft" in line and "--max-tokens 2 or more" in line


def test_a_utf8_byte_order_mark_is_not_part_of_any_prompt(models, tmp_path):
    # Windows editors start UTF-8 files with a BOM: it hid a JSONL file's "{" (every line became a plain
    # prompt, the JSON text sent as is) and was prefilled as the first prompt's first tokens.
    from specdec_cli.model.prompts import read_prompts_file

    bom = b"\xef\xbb\xbf"
    jsonl, plain = tmp_path / "bom.jsonl", tmp_path / "bom.txt"
    jsonl.write_bytes(bom + b'{"prompt": "ab ab"}\n{"prompt": "cd"}\n')
    plain.write_bytes(bom + b"ab ab\ncd\n")
    assert [p.text for p in read_prompts_file(str(jsonl))] == ["ab ab", "cd"]
    assert [p.text for p in read_prompts_file(str(plain))] == ["ab ab", "cd"]
    runs = [generate("--model", models["llama"], "-", "-m", "2", "--json", "--ignore-chat-template", input=text)
            for text in (b"ab ab", bom + b"ab ab")]
    assert all(r.exit_code == 0 for r in runs), runs[1].output
    assert json.loads(runs[1].stdout)["prompt_tokens"] == json.loads(runs[0].stdout)["prompt_tokens"]
    schema = tmp_path / "schema.json"
    schema.write_bytes(bom + b'{"type": "object"}')
    result = generate("--model", models["llama"], "Hi", "-m", "2", "--json-schema", schema, "--json")
    assert result.exit_code == 0, result.output


def test_a_model_folder_without_tokenizer_files_says_so(models, tmp_path):
    # transformers' own message asked to install sentencepiece or tiktoken: the files were what was missing.
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((models["llama"] / name).read_bytes())
    result = generate("--model", folder, "Hi", "-m", "2")
    assert result.exit_code == 1
    line = one_line(result)
    assert f"{folder} has no tokenizer files" in line and "sentencepiece" not in line
    assert f"download or convert {folder} again" in line


def test_a_prompts_file_breaks_lines_at_newlines_only(tmp_path):
    # JSON strings may hold U+2028 or U+0085 raw (json.dumps(..., ensure_ascii=False) writes them so):
    # str.splitlines() broke such a valid JSONL line in two and refused it; a form feed split a prompt.
    from specdec_cli.model.prompts import read_prompts_file

    jsonl = tmp_path / "raw.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\n" for p in ("a\u2028b", "c\x85d")),
                     encoding="utf-8")
    assert [p.text for p in read_prompts_file(str(jsonl))] == ["a\u2028b", "c\x85d"]
    plain = tmp_path / "plain.txt"
    plain.write_bytes(b"page one\x0cpage two\r\n\r\nnext\rlast\n")
    assert [(p.line, p.text) for p in read_prompts_file(str(plain))] == [(1, "page one\x0cpage two"), (3, "next"),
                                                                       (4, "last")]


def test_a_weight_shard_missing_from_the_folder_is_named_with_the_fix(models, tmp_path):
    # mlx-lm loaded the shards there were and listed the parameters the missing one held, with no fix.
    import shutil

    import mlx.core as mx

    folder = tmp_path / "sharded"
    shutil.copytree(models["llama"], folder)
    weights = mx.load(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    mx.save_safetensors(str(folder / "model-00001-of-00002.safetensors"),
                        {k: weights[k] for k in shards["model-00001-of-00002.safetensors"]})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
    result = generate("--model", folder, "Hi", "-m", "2")
    assert result.exit_code == 1
    line = one_line(result)
    assert f"{folder} lacks model-00002-of-00002.safetensors, named in its model.safetensors.index.json" in line
    assert f"download or convert {folder} again" in line


@pytest.mark.parametrize("args, fix", [
    (["chat", "hello"], "chat takes no prompt (type the messages, or pipe them in"),
    (["chat", "--system-prompt", "Be", "brief"], "an option's value of several words goes in quotes"),
    (["generate", "Write", "a", "poem"], "a prompt or an option's value of several words goes in quotes"),
    (["sweep", "--block-sizes", "2", "4", "8", "hi"], "written with commas (--block-sizes 2,4,8)"),
])
def test_extra_arguments_name_what_was_meant(args, fix):
    # "Got unexpected extra argument(s) (hello)" alone: `chat "hello"` as other chat tools take it, and an
    # unquoted prompt.
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    line = one_line(result)
    assert line.startswith("error: Got unexpected extra argument") and fix in line


def test_a_messages_line_is_headed_by_its_last_user_message(tmp_path):
    # The heading showed the last message whatever its role: an earlier assistant turn's text read as the prompt.
    from specdec_cli.model.prompts import read_prompts_file

    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Say hi"},
                                             {"role": "assistant", "content": "Hello"}]}) + "\n")
    assert read_prompts_file(str(path))[0].label == "Say hi"
