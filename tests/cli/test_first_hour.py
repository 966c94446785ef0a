"""A new user's first hour: what the command line shows before, around and after a run.

Help at 80 columns, the line that says what is loading, the batch summary's
headline, chat's last newline and the sweep's row for generate's own default.
"""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from specdec_cli.cli.app import app
from specdec_cli.session.synthetic import make_model_dir


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"llama": make_model_dir(root / "llama", "llama", seed=0),
            "llama-draft": make_model_dir(root / "llama-draft", "llama", seed=0, noise=0.05)}


def test_no_arguments_print_the_help_once_and_exit_two():
    result = CliRunner().invoke(app, [])
    # Typer's own no_args_is_help exit: asking for nothing is a usage error.
    assert result.exit_code == 2
    assert result.stdout.count("Usage:") == 1 and "generate" in result.stdout
    assert result.stderr == ""


# --- help at 80 columns ----------------------------------------------------------------

COMMANDS = ["generate", "serve", "sweep", "chat", "distill", "doctor"]


def help_at(width: int, *args: str) -> list[str]:
    # Rich reads the width from COLUMNS, Typer's plain formatter from terminal_width.
    result = CliRunner().invoke(app, [*args, "-h"], env={"COLUMNS": str(width)}, terminal_width=width)
    assert result.exit_code == 0, result.output
    return result.stdout.splitlines()


def test_help_at_80_columns_cuts_no_option_name_and_splits_no_choice_list():
    from specdec_cli.cli.app import DrafterKind, DType, LogLevel, Rollback

    choices = {"--drafter": DrafterKind, "--rollback": Rollback, "--dtype": DType, "--log-level": LogLevel}
    for command in COMMANDS:
        lines = help_at(80, command)
        text = "\n".join(lines)
        assert all(len(line) <= 80 for line in lines), command
        assert "…" not in text, command  # Rich's mark for a cut cell
        for line in lines:
            # A metavar such as <model|lookup|ngr / am|mtp|auto> opened on one line and closed on the next.
            assert not re.search(r"<[^<>│]*(│|$)", line), (command, line)
            assert not re.search(r"(?<=[\s│])[\w|]*\|[\w|]*>", line), (command, line)
        for option, enum in choices.items():
            if re.search(rf"{option}\b", text):
                listed = ", ".join(m.value for m in enum)
                assert any(listed in line for line in lines), (command, option)


def test_generate_help_is_shorter_and_serve_help_starts_with_where_it_listens():
    # 294 lines at 80 columns before the options were shortened and grouped; 128 after.
    assert len(help_at(80, "generate")) <= 150
    top = "\n".join(help_at(80, "serve")[:40])
    for option in ("--host", "--port", "--api-key"):
        assert option in top, option


# --- what is loading ---------------------------------------------------------------------

# Rich's switch for "this stream is a terminal": the loading line is for a person watching one.
TERMINAL = {"TTY_COMPATIBLE": "1"}


def test_the_loading_line_names_the_bundled_model_and_the_drafter():
    from specdec_cli.cli.display import loading_line

    assert loading_line(None, None) == "Loading SmolLM2-135M-Instruct (bundled) ..."
    assert loading_line("org/big", "org/small") == "Loading org/big with drafter org/small ..."


@pytest.mark.parametrize("command", ["generate", "sweep", "batch", "chat"])
def test_each_command_says_what_loads_before_loading_it_on_a_terminal(models, tmp_path, command):
    model, draft = str(models["llama"]), str(models["llama-draft"])
    args = {
        "generate": ["generate", "Hi", "-m", "4", "--json"],
        "sweep": ["sweep", "Hi", "-m", "4", "--block-sizes", "2", "--warmup", "0", "--json"],
        "batch": ["generate", "--prompts-file", "-", "-m", "4", "--json"],
        "chat": ["chat", "-m", "4", "--no-live"],
    }[command] + ["--model", model, "--draft-model", draft]
    stdin = "Hi\nHello\n" if command == "batch" else ""
    result = CliRunner().invoke(app, args, input=stdin, env=TERMINAL)
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == f"Loading {model} with drafter {draft} ..."
    assert "Loading" not in result.stdout  # stdout stays the text, or the one JSON object
    # On a pipe nothing is added: there an error stays the only line on stderr.
    piped = CliRunner().invoke(app, args, input=stdin)
    assert piped.exit_code == 0 and "Loading" not in piped.stderr


# --- the batch summary's speedups ------------------------------------------------------------

def test_the_batch_summary_leads_with_the_same_batch_decoded_plainly(models, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("Hello there\nThe quick brown fox\nHi\n")
    args = ["generate", "--model", str(models["llama"]), "-m", "12", "--prompts-file", str(path), "--compare-ar"]
    result = CliRunner().invoke(app, [*args, "--no-live"])
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("Compare: 3 identical"))
    # First what a user weighs speculation against: the same prompts, batched the same way, without it;
    # then each row against its prompt alone (lowest first); last the aggregate over one prompt after
    # another, which says that batching's own gain is in it.
    assert re.fullmatch(r"Speedup over plain decoding of the same batch: [\d.]+x \([\d.]+ against [\d.]+ "
                        r"tokens-per-sec aggregate, at most 3 rows together both ways\)", lines[at + 1]), lines[at + 1]
    row = re.fullmatch(r"Speedup by row: ([\d.]+)x( to ([\d.]+)x)? \(a row's tokens-per-sec in the batch over plain "
                       r"decoding of its prompt alone\)", lines[at + 2])
    assert row and float(row.group(1)) <= float(row.group(3) or row.group(1)), lines[at + 2]
    assert lines[at + 3].startswith("Plain decoding, one prompt after another: ")
    assert lines[at + 3].endswith("batching's own gain included")
    summary = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)["summary"]["compare"]
    assert summary["batched_ar_generated_tokens"] == summary["ar_generated_tokens"]
    assert summary["batched_speedup"] > 0 and summary["batched_ar_aggregate_tps"] > 0


# --- chat ----------------------------------------------------------------------------------

def test_chat_ends_the_prompt_line_at_ctrl_d(models, monkeypatch):
    import specdec_cli.cli.chat as chat

    args = ["chat", "--model", str(models["llama"]), "--no-live", "-m", "4"]
    monkeypatch.setattr(chat, "_interactive", lambda: True)  # a person at a terminal: "> " is shown
    result = CliRunner().invoke(app, args, input="")  # Ctrl-D at the first prompt
    assert result.exit_code == 0, result.output
    assert result.stdout == "> \n"  # the shell's prompt then starts on a line of its own
    monkeypatch.setattr(chat, "_interactive", lambda: False)  # piped: no prompt, no line to end
    result = CliRunner().invoke(app, args, input="")
    assert result.exit_code == 0 and result.stdout == ""


def test_a_chat_answer_cut_short_says_what_cut_it(tmp_path):
    # It stopped at 98 tokens with no word of why, and the next turn was then refused for the context.
    from specdec_cli.session.synthetic import TINY_CONFIGS, make_model_dir

    model = make_model_dir(tmp_path / "llama128", {**TINY_CONFIGS["llama"], "max_position_embeddings": 128})
    args = ["chat", "--model", str(model), "--no-live", "--prompt-cache-disk-gb", "0"]
    result = CliRunner().invoke(app, [*args, "-m", "200"], input="hello there\n")
    assert result.exit_code == 0, result.output
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("[prompt")]
    assert line.endswith("; cut at the model's context (128 tokens): /reset starts over]"), line
    result = CliRunner().invoke(app, [*args, "-m", "5"], input="hello there\n")
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("[prompt")]
    assert "| 5 tokens," in line and line.endswith("; cut at --max-tokens 5]"), line


def test_chat_on_a_model_without_a_chat_template_points_to_generate_as_it_runs(models, tmp_path):
    # It said "use specdec generate with --ignore-chat-template": generate needs no option for such a model.
    import shutil

    folder = tmp_path / "plain"
    shutil.copytree(models["llama"], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(app, ["chat", "--model", str(folder), "--no-live", "--prompt-cache-disk-gb", "0"],
                                input="hi\n")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert "has no chat template" in result.stderr and "--ignore-chat-template" not in result.stderr
    assert "use specdec generate (it feeds the prompt as it stands), or a chat model" in result.stderr
    ran = CliRunner().invoke(app, ["generate", "--model", str(folder), "hi", "-m", "4", "--json"])
    assert ran.exit_code == 0 and json.loads(ran.stdout)["generated_tokens"] == 4, ran.output


def test_chat_commands_it_does_not_know_are_not_sent_to_the_model(models):
    result = CliRunner().invoke(app, ["chat", "--model", str(models["llama"]), "--no-live", "-m", "4",
                                      "--prompt-cache-disk-gb", "0"], input="/rset\n/help\n /rset\n")
    assert result.exit_code == 0, result.output
    err = result.stderr
    assert "unknown command /rset: /reset starts over, /quit leaves" in err
    assert err.count("/help shows this") == 2  # at the start, and asked for
    # With a space before it, it is a message: one answer.
    assert len([x for x in err.splitlines() if x.startswith("[prompt")]) == 1


# --- sweep measures generate's default ------------------------------------------------------

def test_sweep_measures_generates_default_as_a_row_of_its_own(models):
    model, draft = str(models["llama"]), str(models["llama-draft"])
    common = ["sweep", "Hi", "-m", "12", "--block-sizes", "2,3", "--warmup", "0", "--model", model]
    # A draft model's default block size is 4; prompt lookup's (no drafter named) 64.
    result = CliRunner().invoke(app, [*common, "--draft-model", draft])
    assert result.exit_code == 0, result.output
    row = re.search(r"^│\s+default \(adaptive, block 4\)\s+│.*│\s+(yes|tie)\s+│$", result.stdout, re.M)
    assert row, result.stdout
    assert "default: what generate runs without --block-size or --no-adaptive" in result.stdout
    assert "best block size: " in result.stderr  # still a fixed size to pass as --block-size
    report = json.loads(CliRunner().invoke(app, [*common, "--json"]).stdout)
    assert [r["block_size"] for r in report["rows"]] == [2, 3]  # the fixed sizes asked for, as before
    default = report["default"]
    assert default["label"] == "default (adaptive, block 64)"
    assert default["block_size"] == 64 and default["adaptive"] is True and default["identical"] is True
    assert default["speedup"] > 0 and report["best_block_size"] in (2, 3)


def test_a_chat_message_piped_with_windows_line_ends_is_sent_without_the_cr(models, monkeypatch):
    # A real process's stdin keeps the "\r" of "\r\n" (CliRunner's translates it), so input() is fed here.
    def piped(line):
        lines = iter([line])

        def read(prompt=""):
            try:
                return next(lines)
            except StopIteration:
                raise EOFError from None
        return read

    args = ["chat", "--model", str(models["llama"]), "--no-live", "-m", "2", "--prompt-cache-disk-gb", "0"]
    counts = []
    for line in ("hello there\r", "hello there"):
        monkeypatch.setattr("builtins.input", piped(line))
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        (stats,) = [x for x in result.stderr.splitlines() if x.startswith("[prompt")]
        counts.append(stats.split(" tokens")[0])
    assert counts[0] == counts[1]
