"""mlx_lm's options, as mlx_lm reads them: a quantized KV cache, adapters, extra EOS tokens, the chat
template's config, remote code."""

from __future__ import annotations

import json
import re
import shutil

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from cli_fixtures import KV_LLAMA, generate, models, one_line  # noqa: F401 (models: a fixture)
from specdec_cli.cache.caches import ModelCache, make_cache
from specdec_cli.session.loading import load
from specdec_cli.loop.events import collect
from specdec_cli.loop.runner import run
from specdec_cli.session.synthetic import EOS_ID, TINY_CONFIGS, build_model, perturb

def _cli_json(*args):
    result = generate(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)

@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_5"])
def test_quantized_kv_cache_speculation_equals_plain_decoding(family):
    cfg = {**TINY_CONFIGS[family], "head_dim": 32}
    if "text_config" in cfg:
        cfg["text_config"] = {**cfg["text_config"], "head_dim": 32}
    model = build_model(cfg, seed=0)
    draft = build_model(cfg, seed=0)
    perturb(draft, 0.05, seed=7)
    from specdec_cli.drafters import ModelDrafter

    prompt = list(b"The quick brown fox jumps over the lazy dog, twice: the quick brown fox.")
    kv = dict(kv_bits=4, kv_group_size=32)
    _, plain = collect(run(model, prompt, max_tokens=40, **kv))
    stats, spec = collect(run(model, prompt, drafter=ModelDrafter(draft), num_draft_tokens=3, max_tokens=40,
                              **kv))
    _, full = collect(run(model, prompt, max_tokens=40))
    assert spec == plain and stats.drafted > stats.accepted > 0  # rejections were rolled back
    assert full != plain or family == "qwen3_5"  # the cache really is quantized (few attention layers)


def test_a_trimmed_quantized_cache_equals_one_built_directly():
    model = build_model(KV_LLAMA, seed=0)
    ids = list(range(30, 70))
    trimmed = ModelCache(model, make_cache(model, kv_bits=4, kv_group_size=32))
    trimmed.prefill(ids[:30])
    snap = trimmed.snapshot()
    trimmed.feed(mx.array(ids[30:], dtype=mx.uint32))
    trimmed.rollback(snap, 4)
    direct = ModelCache(model, make_cache(model, kv_bits=4, kv_group_size=32))
    direct.prefill(ids[:30])
    direct.feed(mx.array(ids[30:34], dtype=mx.uint32))
    for a, b in zip(trimmed._attention, direct._attention):
        assert a.offset == b.offset == 34
        for x, y in zip(tree_flatten([a.keys, a.values]), tree_flatten([b.keys, b.values])):
            assert mx.array_equal(x[1][..., :34, :], y[1][..., :34, :])


def test_kv_bits_through_the_cli_is_exact_and_refused_by_name_where_it_cannot_run(models):
    report = _cli_json("--model", models["kv-llama"], "--draft-model", models["kv-llama-draft"], "Hi", "-m", "24",
                       "--kv-bits", "4", "--kv-group-size", "32", "--compare-ar")
    assert report["compare"]["identical"] and report["kv_bits"] == 4
    # Head dim 16 cannot be quantized in groups of 64: refused by family, before any output.
    result = generate("--model", models["llama"], "Hi", "--kv-bits", "4")
    assert result.exit_code == 1 and result.stdout == ""
    assert "llama cannot run with a quantized KV cache" in one_line(result)


def test_kv_bits_on_a_model_without_attention_layers_says_it_does_nothing(tmp_path):
    # A Mamba model keeps recurrent state only: nothing to quantize, and the run must not look quantized silently.
    from zoo_configs import ZOO
    from specdec_cli.session.synthetic import make_model_dir

    mamba = make_model_dir(tmp_path / "mamba", ZOO["mamba"], seed=0)
    report = _cli_json("--model", mamba, "Hi", "-m", "8", "--kv-bits", "4", "--compare-ar")
    assert report["compare"]["identical"]
    result = generate("--model", mamba, "Hi", "-m", "8", "--kv-bits", "4", "--no-live")
    assert result.exit_code == 0, result.output
    assert [x for x in result.stderr.splitlines() if "--kv-bits" in x] == [
        "note: --kv-bits 4 does nothing here: this model has no attention layers (its recurrent state is not a KV "
        "cache)"]
    # A hybrid's attention layers take it: no note.
    result = generate("--model", make_model_dir(tmp_path / "q", {**TINY_CONFIGS["qwen3_5"], "text_config": {
        **TINY_CONFIGS["qwen3_5"]["text_config"], "head_dim": 32}}, seed=0), "Hi", "-m", "4", "--kv-bits", "4",
        "--kv-group-size", "32", "--no-live")
    assert result.exit_code == 0 and "note: --kv-bits" not in result.stderr, result.output


def test_adapters_are_loaded_the_mlx_lm_way(models, tmp_path):
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load as mlx_lm_load

    model = load(str(models["llama"])).model
    model.freeze()
    params = {"rank": 4, "scale": 20.0, "dropout": 0.0}
    linear_to_lora_layers(model, 2, params)
    mx.random.seed(3)
    adapters = {k: mx.random.normal(v.shape) * 0.1 for k, v in tree_flatten(model.parameters())
                if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b")}
    mx.save_safetensors(str(tmp_path / "adapters.safetensors"), adapters)
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": params}))

    base = _cli_json("--model", models["llama"], "Hi", "-m", "16", "--ignore-chat-template")
    tuned = _cli_json("--model", models["llama"], "Hi", "-m", "16", "--ignore-chat-template",
                      "--adapter-path", tmp_path, "--compare-ar")
    assert tuned["compare"]["identical"] and tuned["text"] != base["text"]
    # The same adapters through mlx-lm's own loader give the same greedy text.
    ref_model, ref_tok = mlx_lm_load(str(models["llama"]), adapter_path=str(tmp_path))
    _, tokens = collect(run(ref_model, ref_tok.encode("Hi"), max_tokens=16, eos_ids=[EOS_ID]))
    assert ref_tok.decode(tokens) == tuned["text"]
    result = generate("--model", models["llama"], "Hi", "--adapter-path", tmp_path / "none")
    assert result.exit_code == 1 and "has no adapter_config.json" in one_line(result)
    # On the bundled model too: the user's adapters, never a damaged install to reinstall.
    result = generate("Hi", "--adapter-path", tmp_path / "none")
    assert result.exit_code == 1 and "has no adapter_config.json" in one_line(result)
    assert "reinstall" not in one_line(result) and "damaged" not in one_line(result)
    result = generate("Hi", "--adapter-path", tmp_path)  # adapters of another model's shapes
    assert result.exit_code == 1 and "do not fit this model" in one_line(result) and "reinstall" not in one_line(result)
    # mlx_lm lists each of the 28 tensors: the line names the first, counts the rest and says what to pass.
    line = one_line(result)
    assert len(line) < 400 and re.search(r"\(model\.layers\.\S+: .*; and 27 more tensors\)", line), line
    assert line.endswith("pass the adapters mlx_lm.lora trained for this model")
    # A damaged config names the file and the field, not mlx_lm's attribute lookup.
    for config, said in (("{", "cannot read adapter_config.json"), ("[]", "is not a JSON object"),
                         ('{"fine_tune_type": "lora", "lora_parameters": {}}', "lacks a valid num_layers")):
        (tmp_path / "adapter_config.json").write_text(config)
        result = generate("--model", models["llama"], "Hi", "--adapter-path", tmp_path)
        assert result.exit_code == 1 and said in one_line(result) and "SimpleNamespace" not in result.output, config


def test_extra_eos_token_stops_generation(models):
    loaded = load(str(models["llama"]))
    ids = loaded.tokenizer.encode("Hi")
    _, tokens = collect(run(loaded.model, ids, max_tokens=24, eos_ids=[EOS_ID]))
    # A position whose token appears there first: the run must stop right before it.
    stop = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    report = _cli_json("--model", models["llama"], "Hi", "-m", "24", "--ignore-chat-template",
                       "--extra-eos-token", str(tokens[stop]), "--extra-eos-token", "<|endoftext|>")
    assert report["finish_reason"] == "eos" and report["generated_tokens"] == stop
    result = generate("--model", models["llama"], "Hi", "--extra-eos-token", "<no-such-token>")
    assert result.exit_code == 2 and "is not a token of this tokenizer" in one_line(result)


@pytest.mark.parametrize("token, message", [
    ("blue sky", "as text it is several tokens ('b', 'l', 'u', 'e', 'Ġ', 's', 'k', 'y'), and a stop token is one"),
    ("notatoken_xyz", "is not a token of this tokenizer: as text it is several tokens"),
    ("", "--extra-eos-token is empty: give a token of this tokenizer (like '<|im_end|>' (id 258)) or its id"),
    ("999999", "--extra-eos-token 999999: no token has this id (this tokenizer's ids run from 0 to"),
    ("-1", "--extra-eos-token -1: no token has this id"),
])
def test_extra_eos_token_refuses_what_is_not_a_token(models, token, message):
    # mlx-lm maps an unknown token to the unknown-token id (<|endoftext|> here) and takes any integer.
    result = generate("--model", models["llama"], "Hi", "-m", "4", "--extra-eos-token", token)
    assert result.exit_code == 2, result.output
    assert message in one_line(result) and result.stdout == ""


def test_extra_eos_token_names_the_leading_space_form(tmp_path):
    # The bundled model's BPE: "Blue" and "ĠBlue" (" Blue", what follows "2." in a list) are two tokens.
    # A tiny model with its tokenizer (loaded three times: the bundled weights cost seconds each).
    from agents import hello_model_dir

    model = hello_model_dir(tmp_path / "m", "qwen3_5")
    result = generate("--model", model, "Hi", "-m", "1", "--extra-eos-token", " Blue")
    assert result.exit_code == 2
    assert "as text, ' Blue' is the token 'ĠBlue' (id 10062): pass a token as the vocabulary spells it" in \
        one_line(result)
    result = generate("--model", model, "Hi", "-m", "1", "--extra-eos-token", "Blue", "--json")
    assert result.exit_code == 0, result.output
    assert ("note: --extra-eos-token 'Blue' stops at that token only; after a space the text is the token "
            "'ĠBlue' (id 10062): pass it too to stop there") in result.stderr.splitlines()
    result = generate("--model", model, "Hi", "-m", "1", "--extra-eos-token", "Blue",
                      "--extra-eos-token", "10062", "--json")
    assert result.exit_code == 0 and "--extra-eos-token" not in result.stderr


def test_a_run_of_no_tokens_has_no_speedup_in_json(models):
    loaded = load(str(models["llama"]))
    _, tokens = collect(run(loaded.model, loaded.tokenizer.encode("Hi"), max_tokens=1, eos_ids=[EOS_ID]))
    report = _cli_json("--model", models["llama"], "Hi", "-m", "8", "--ignore-chat-template", "--compare-ar",
                       "--extra-eos-token", str(tokens[0]))
    assert report["generated_tokens"] == 0 and report["compare"]["identical"]
    assert report["compare"]["speedup"] is None  # the text line says "no speedup measurable"
    # Whichever side generated nothing (a divergence can leave one side empty), or took no time: null, not 0.0.
    from specdec_cli.loop.compare import Comparison, comparison_dict
    from specdec_cli.core.stats import Stats

    some = Stats(generated=5, decode_s=0.5)
    for specdec, plain in ((Stats(generated=0, decode_s=0.5), some), (some, Stats(generated=0, decode_s=0.5)),
                           (Stats(generated=5, decode_s=0.0), some)):
        cmp = Comparison(identical=True, tokens=plain.generated, divergence=None, plain=plain)
        assert comparison_dict(cmp, specdec, loaded.tokenizer)["speedup"] is None
    assert comparison_dict(Comparison(True, 5, None, some), some, loaded.tokenizer)["speedup"] == 1.0


def test_chat_template_config_and_prefill_response(models, tmp_path):
    custom = tmp_path / "templated"
    shutil.copytree(models["llama"], custom)
    cfg_file = custom / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = (
        "{% if mood is defined %}{{ mood }}{% endif %}"
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    cfg_file.write_text(json.dumps(cfg))
    plain = _cli_json("--model", custom, "Hi", "-m", "2")
    moody = _cli_json("--model", custom, "Hi", "-m", "2", "--chat-template-config", '{"mood": "CALM"}')
    assert moody["prompt_tokens"] == plain["prompt_tokens"] + len("CALM")
    prefilled = _cli_json("--model", custom, "Hi", "-m", "2", "--prefill-response", "Sure:")
    # [user]Hi[assistant]Sure: (continued, no generation prompt after it)
    assert prefilled["prompt_tokens"] == len("[user]Hi[assistant]Sure:")
    result = generate("--model", custom, "Hi", "--prefill-response", "x", "--ignore-chat-template")
    assert result.exit_code == 2 and "--prefill-response needs the chat template" in one_line(result)


def test_trust_remote_code(models, tmp_path):
    custom = tmp_path / "remote"
    shutil.copytree(models["llama"], custom)
    (custom / "my_model.py").write_text("from mlx_lm.models.llama import Model, ModelArgs  # noqa: F401\n")
    cfg = json.loads((custom / "config.json").read_text())
    cfg["model_file"] = "my_model.py"
    (custom / "config.json").write_text(json.dumps(cfg))
    result = generate("--model", custom, "Hi", "-m", "2")
    assert result.exit_code == 1 and "pass --trust-remote-code" in one_line(result)
    assert generate("--model", custom, "Hi", "-m", "2", "--trust-remote-code").exit_code == 0


@pytest.mark.parametrize("args", [["--verbose", "False"], ["-p", "Hi", "--verbose", "false"], ["Hi", "--verbose", "T"]])
def test_mlx_lm_verbose_with_a_value_is_refused_not_taken_as_the_prompt(models, args, monkeypatch):
    # mlx_lm's --verbose takes a boolean; here it is a flag, so "False" became the prompt (or clashed with -p).
    import specdec_cli.cli.commands as commands

    monkeypatch.setattr(commands, "load_setup", lambda *a, **k: pytest.fail("the model loaded"))
    result = generate("--model", models["llama"], *args)
    assert result.exit_code == 2
    assert "--verbose takes no value here (mlx_lm's --verbose" in one_line(result)


@pytest.mark.parametrize("args, fix", [(["--max-kv-size", "512"], "drop it (--kv-bits shrinks the cache"),
                                       (["--xtc-probability=0.1"], "XTC sampling is not supported"),
                                       (["--quantized-kv-start", "100"], "--kv-bits quantizes the KV cache from")])
def test_mlx_lm_options_specdec_lacks_are_named_with_what_to_do(models, args, fix):
    # A command line carried over from mlx_lm.generate got "No such option" and look-alike names.
    result = generate("--model", models["llama"], "Hi", *args)
    assert result.exit_code == 2
    line = one_line(result)
    assert f"{args[0].split('=')[0]} is mlx_lm's, not taken here" in line and fix in line
    assert "No such option: --nonsense" in one_line(generate("--model", models["llama"], "Hi", "--nonsense", "1"))


@pytest.mark.parametrize("args", [["--extra-eos-token", "<|im_end|>", "</s>"],
                                  ["--extra-eos-token=2", "3", "-p", "Hi"]])
def test_mlx_lm_extra_eos_tokens_in_one_option_are_refused_not_taken_as_the_prompt(models, args, monkeypatch):
    # mlx_lm takes --extra-eos-token A B; here the option takes one, so B became the prompt (or clashed with -p).
    import specdec_cli.cli.commands as commands

    monkeypatch.setattr(commands, "load_setup", lambda *a, **k: pytest.fail("the model loaded"))
    result = generate("--model", models["llama"], *args)
    assert result.exit_code == 2
    assert "--extra-eos-token takes one token (mlx_lm's --extra-eos-token" in one_line(result)
    # chat and serve take the option too: refused alike (chat's B was "an extra argument", a prompt it takes not).
    from typer.testing import CliRunner

    from specdec_cli.cli.app import app

    result = CliRunner().invoke(app, ["chat", "--model", str(models["llama"]), "--extra-eos-token", "<|im_end|>",
                                      "</s>"])
    assert result.exit_code == 2 and "repeat it, --extra-eos-token <|im_end|> --extra-eos-token </s>" in \
        one_line(result)


def test_a_prompt_after_an_extra_eos_token_is_still_a_prompt(models):
    result = generate("--model", models["llama"], "--extra-eos-token", "<|im_end|>", "Write a haiku", "-m", "2",
                      "--json")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("command,key", [("generate", "tokenize"), ("chat", "tokenize"), ("generate", "max_length")])
def test_a_template_config_setting_what_specdec_passes_is_refused_by_name(models, command, key):
    # The template failed with "got multiple values for keyword argument 'tokenize'": Python, and no fix.
    # max_length and the like were ignored where the server refused them: one list (model/prompts.py) now.
    from typer.testing import CliRunner

    from specdec_cli.cli.app import app

    prompt = ["Hi"] if command == "generate" else []
    result = CliRunner().invoke(app, [command, "--model", str(models["llama"]), "-m", "2", "--chat-template-config",
                                      f'{{"{key}": 1, "enable_thinking": false}}', *prompt])
    assert result.exit_code == 2
    assert f"'{key}' is the template renderer's own argument, not a template variable: drop it" in one_line(result)


def test_mlx_lm_default_top_p_of_1_is_no_error_when_greedy(models):
    # mlx_lm's default --top-p is 1.0 (no filter): written out at --temp 0 it was refused as a filter.
    runs = [_cli_json("--model", models["llama"], "Hi", "-m", "4", *extra) for extra in ([], ["--top-p", "1.0"])]
    assert runs[0]["text"] == runs[1]["text"]
