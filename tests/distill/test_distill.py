"""specdec distill: self-distilled MTP heads on tiny models.

Invariants: training lowers the loss; the training chain computes exactly
what drafting computes; a reduced draft vocabulary reads the right lm_head
rows; a trained head drafts, stays exact, is refused by another model, and
survives Ctrl-C.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from typer.testing import CliRunner

import specdec_cli.distill.train as train_module
from specdec_cli.cli.app import app
from specdec_cli.distill.data import prompt_ids, read_source, seed_prompts, teacher_states
from specdec_cli.distill.pipeline import DistillOptions, Finished, Stage, Training, distill, split
from specdec_cli.distill.train import TrainConfig, Trainer, chain_mask, frequent_tokens, head_config, windows
from specdec_cli.drafters.mtp import MTPDrafter
from specdec_cli.drafters.mtp_head import MTPHead, random_head
from specdec_cli.drafters.mtp_io import build_head, embedding_probe, load_head
from specdec_cli.errors import OptionError, UnsupportedModelError
from specdec_cli.model.files import read_config
from specdec_cli.loop.events import collect
from specdec_cli.loop.runner import run
from specdec_cli.session.synthetic import build_model, make_model_dir, TINY_CONFIGS
from specdec_cli.model.taps import target_parts

from helpers import PROMPT, target

SEEDS = [list(b"The quick brown fox jumps over the lazy dog. "), list(b"Once upon a time, in a small town, "),
         list(b"def add(a, b):\n    return a + b\n\n"), list(b"1, 2, 3, 4, 5, 6, 7, 8, ")]


@functools.cache
def corpus():
    """The tiny llama's own greedy text from four prompts, with its final states."""
    model = target("llama", "float32")
    seqs = []
    for p in SEEDS:
        _, out = collect(run(model, p, max_tokens=90))
        seqs.append(p + out)
    return seqs, list(teacher_states(model, seqs))


def make_trainer(depth=2, vocab=0, steps=40, seed=0) -> Trainer:
    model = target("llama", "float32")
    parts = target_parts(model)
    seqs, states = corpus()
    cfg = TrainConfig(steps=steps, batch_size=4, seq_len=24, lr=3e-3, seed=seed, depth=depth, eval_every=10)
    mx.random.seed(seed)
    head = MTPHead(head_config(parts, vocab))
    if vocab:
        head.draft_ids = frequent_tokens(seqs, vocab, parts.vocab_size)
    train = windows(seqs[:3], states[:3], cfg.seq_len + depth)
    held = windows(seqs[3:], states[3:], cfg.seq_len + depth)
    return Trainer(head, parts, train, held, cfg)


@functools.cache
def trained(vocab=0) -> Trainer:
    t = make_trainer(depth=2, vocab=vocab, steps=60)
    for _ in t.run():
        pass
    t.restore_best()
    return t


def test_training_lowers_the_loss_and_raises_agreement():
    t = make_trainer(depth=2, steps=40)
    tokens, states = t.tokens[:8], t.states[:8]
    before = t.loss(tokens, states).item()
    agree_before = t.evaluate()
    steps = list(t.run())
    after = t.loss(tokens, states).item()
    assert after < 0.7 * before, (before, after)
    assert steps[-1].step == 40 and steps[-1].agreement is not None
    assert t.best_agreement[0] > agree_before[0], (agree_before, t.best_agreement)


def test_the_training_chain_computes_what_drafting_computes():
    # Step s of the chain at position i must equal the head's s-th forward when it drafts
    # after committing x_0 .. x_{i+1}: pairs (h_j, x_{j+1}) up to i from the target, then its own outputs.
    t = make_trainer(depth=3)
    head, parts = random_head(t.head.config, seed=5), t.parts
    t.head = head
    tokens, states = t.tokens[:1], t.states[:1]
    chained = t._chain(tokens, states)
    embeds = parts.embed(tokens[0])
    for i in (0, 5, 17):
        cache = head.make_cache()
        out = head(embeds[None, 1:i + 2], states[:, :i + 1], cache)[:, -1:]
        for s in range(1, 4):
            if s > 1:
                out = head(embeds[None, i + s:i + s + 1], out, cache)
            assert mx.allclose(out[0, 0], chained[s - 1][0, i], atol=1e-4).item(), (i, s)


def test_chained_hits_count_what_a_greedy_draft_chain_gets_accepted():
    # On the target's own greedy text, a block starting after position i accepts drafts 1..s
    # exactly when the head's greedy chain (fed its own picks) drafts the next s tokens.
    t = trained()
    seqs, states = corpus()
    seq, first = seqs[1], len(SEEDS[1]) - 1
    tokens, h = mx.array(seq, dtype=mx.uint32)[None], states[1][None]
    T = len(seq) - t.config.depth
    want = [0] * t.config.depth
    embeds = t.parts.embed(tokens[0])
    for i in range(first, T):
        cache = t.head.make_cache()
        out = t.head(embeds[None, 1:i + 2], h[:, :i + 1], cache)[:, -1:]
        for s in range(1, t.config.depth + 1):
            if s > 1:
                out = t.head(t.parts.embed(pick.reshape(1, 1)), out, cache)
            pick = mx.argmax(t.parts.logits(out)[0, -1]).astype(mx.uint32)
            if pick.item() != seq[i + s + 1]:
                break
            want[s - 1] += 1
    alone, got, n = t.hits(tokens, h, first=first)
    assert n == T - first and got == want, (got, want)
    assert want[0] > 0 and all(a >= b for a, b in zip(alone, got)) and got[1] <= got[0]


def test_chain_mask_sees_true_pairs_up_to_itself_then_its_own_chain():
    m = chain_mask(3, 2).tolist()
    assert m == [[True, False, False, True, False, False],
                 [True, True, False, False, True, False],
                 [True, True, True, False, False, True]]


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_sub_logits_are_the_columns_of_the_full_logits(quantized, tied):
    model = build_model({**TINY_CONFIGS["llama"], "tie_word_embeddings": tied}, seed=3)
    if quantized:
        nn.quantize(model, group_size=32, bits=8)
    parts = target_parts(model)
    ids = mx.array([3, 7, 100, 200, 255], dtype=mx.int32)
    h = mx.random.normal((2, 3, parts.hidden_size))
    assert mx.allclose(parts.sub_logits(ids)(h), parts.logits(h)[..., ids], atol=1e-5).item()


def test_frequent_tokens_ranks_by_count_then_id():
    ids = frequent_tokens([[5, 5, 5, 2, 2, 9, 9, 1]], 3, 16).tolist()
    assert ids == [2, 5, 9]  # 5 (3x), then 2 and 9 (2x each); 1 (once) is out
    assert frequent_tokens([[4]], 3, 16).tolist() == [0, 1, 4]  # too few distinct: lowest unseen ids


def test_windows_cover_each_sequence_and_skip_short_ones():
    seqs = [list(range(10)), list(range(3))]
    states = [mx.arange(10)[:, None].astype(mx.float32), mx.zeros((3, 1))]
    toks, rows = windows(seqs, states, 4)
    assert toks.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [6, 7, 8, 9]]
    assert rows[:, :, 0].tolist() == toks.tolist()


def test_split_keeps_sequences_apart():
    train, held = split(20, 0.1, seed=1)
    assert len(held) == 2 and not set(train) & set(held) and sorted(train + held) == list(range(20))


@pytest.mark.parametrize("vocab", [0, 96])
def test_a_trained_head_drafts_and_speculation_stays_exact(vocab):
    t = trained(vocab)
    model = target("llama", "float32")
    drafts = []

    class Recording(MTPDrafter):
        def propose(self, last, k, params=None):
            d = super().propose(last, k) if params is None else super().propose(last, k, params)
            drafts.append(d.tokens)
            return d

    prompt = list(b"Once upon a time, in a small town, ")
    _, plain = collect(run(model, prompt, max_tokens=60))
    stats, spec = collect(run(model, prompt, drafter=Recording(t.head, t.parts), num_draft_tokens=3,
                              max_tokens=60))
    assert spec == plain
    # An untrained head of the same shape drafts (almost) nothing the target accepts.
    untrained, _ = collect(run(model, prompt, drafter=MTPDrafter(random_head(t.head.config, seed=3), t.parts),
                               num_draft_tokens=3, max_tokens=60))
    assert stats.accepted >= untrained.accepted + 6, (stats.accepted, stats.drafted, untrained.accepted)
    if vocab:
        allowed = set(t.head.draft_ids.tolist())
        drafted = {x for d in drafts for x in mx.array(d).tolist()}
        assert drafted and drafted <= allowed


def test_reduced_vocabulary_q_is_a_distribution_over_the_draft_tokens():
    t = trained(96)
    drafter = MTPDrafter(t.head, t.parts)
    lp = nn.log_softmax(mx.random.normal((1, 96)), axis=-1)
    tokens, full = drafter._to_target(mx.array([0]), lp)
    assert tokens.tolist() == [t.head.draft_ids[0].item()]
    assert full.shape == (1, t.parts.vocab_size)
    assert abs(mx.exp(full).sum().item() - 1.0) < 1e-5
    inside = mx.zeros((t.parts.vocab_size,)).at[t.head.draft_ids].add(1).astype(mx.bool_)
    assert mx.all(mx.where(inside, True, mx.isinf(full[0]))).item()
    assert mx.array_equal(full[0][t.head.draft_ids], lp[0]).item()


def test_head_trained_for_another_model_is_refused(tmp_path):
    from specdec_cli.distill.pipeline import write_head, make_result

    t = trained(96)
    head = t.head
    config = replace(head.config, target_probe=embedding_probe(t.parts))
    probed = MTPHead(config)
    probed.load_weights(tree_flatten(head.parameters()))
    opts = DistillOptions()
    write_head(tmp_path / "h", probed, make_result(t, "test", [[1]], [0], [], 1.0, 0.0, opts, 1))
    config_json = read_config(tmp_path / "h")
    # Its own target (and a quantized copy of it) load it.
    load_head(tmp_path / "h", config_json, "h", t.parts)
    quantized = build_model(TINY_CONFIGS["llama"], seed=0)
    nn.quantize(quantized, group_size=32, bits=4)
    load_head(tmp_path / "h", config_json, "h", target_parts(quantized))
    # Same shapes, other weights: another model.
    other = build_model(TINY_CONFIGS["llama"], seed=9)
    with pytest.raises(UnsupportedModelError, match="trained for another model"):
        load_head(tmp_path / "h", config_json, "h", target_parts(other))


def test_read_source_formats(tmp_path):
    (tmp_path / "a.txt").write_text("plain text here")
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"prompt": "Say hi"}) + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]})
        + "\n" + json.dumps({"text": "raw"}) + "\n")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    s = read_source(str(tmp_path))
    assert s.prompts == ["Say hi", [{"role": "user", "content": "Q?"}]]
    assert s.texts == ["plain text here", "raw"]
    assert "2 prompts" in s.description and "2 text(s)" in s.description
    default = read_source(None)
    assert len(default.prompts) == len(seed_prompts()) > 2000 and "seed prompts" in default.description
    # An agent's trace (content null beside tool_calls, a list of parts) is the template's to render, not refused.
    trace = [{"role": "user", "content": "weather?"},
             {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
                 "name": "weather", "arguments": "{}"}}]},
             {"role": "tool", "content": "sunny"}, {"role": "user", "content": [{"type": "text", "text": "thanks"}]}]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": trace}) + "\n")
    assert read_source(str(tmp_path / "c.jsonl")).prompts == [trace]


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("", "no text found"),
    ('{"prompt": 1}\n', 'none of "prompt"'),
    ("not json\n", "is not JSON"),
    # A message that is not an object crashed after the model loaded ("'str' object has no attribute 'get'").
    ('{"messages": ["hi"]}\n', '"messages" must be a list of'),
])
def test_read_source_refuses_bad_data(tmp_path, content, message):
    path = tmp_path / "d.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(OptionError, match=message):
        read_source(str(path))


def test_read_source_takes_a_bom_and_raw_line_separators_in_json_strings(tmp_path):
    # A BOM (Windows editors) made line 1 "not JSON"; splitlines() broke a line at a raw U+2028 / U+0085,
    # which json.dumps(..., ensure_ascii=False) writes inside strings.
    path = tmp_path / "d.jsonl"
    rows = [{"text": "a\u2028b"}, {"prompt": "c\x85d"}]
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode())
    s = read_source(str(path))
    assert s.texts == ["a\u2028b"] and s.prompts == ["c\x85d"]


def test_seed_prompts_stay_clear_of_the_benchmark_prompts():
    bench = ["hash table", "capital of Japan", "poem about the sea", "Fibonacci", "linked list", "pens at 3"]
    assert not [p for p in seed_prompts() for b in bench if b.lower() in p.lower()]


# The pipeline and the command


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("distill") / "llama", "llama", seed=0)


def _distill(*args):
    return CliRunner().invoke(app, ["distill", *map(str, args)])


def test_pipeline_answers_prompts_and_reuses_its_cache(tmp_path):
    model = target("llama", "float32")
    parts = target_parts(model)
    from specdec_cli.session.loading import load

    tok = load(str(make_model_dir(tmp_path / "m", "llama", seed=0))).tokenizer
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"Tell me about {w}."}) + "\n" for w in ("cats", "rain", "tea")))
    opts = DistillOptions(data=str(jsonl), tokens=600, answer_tokens=60, gen_batch=4, draft_vocab=0,
                          train=TrainConfig(steps=2, batch_size=2, seq_len=16, depth=2, eval_every=1))
    key = {"files": "the tiny llama", "dtype": "float32"}
    events = list(distill(model, tok, parts, tmp_path / "h", opts, model_id=key))
    kinds = [type(e).__name__ for e in events]
    assert "Generated" in kinds and "States" in kinds and isinstance(events[-1], Finished)
    assert (tmp_path / "h" / "config.json").is_file() and (tmp_path / "h" / "cache" / "corpus.json").is_file()
    again = list(distill(model, tok, parts, tmp_path / "h", opts, model_id=key))
    assert "reusing the corpus" in again[0].detail and "Generated" not in [type(e).__name__ for e in again]


def first_stage(model, tok, out, opts, key) -> str:
    """The first line a distill run prints (says whether the corpus cache is reused); nothing trains."""
    events = distill(model, tok, target_parts(model), out, opts, model_id=key)
    try:
        return next(events).detail
    finally:
        events.close()


def test_the_corpus_cache_is_keyed_by_the_model_and_the_data_content(tmp_path):
    from specdec_cli.distill.pipeline import model_key
    from specdec_cli.session.loading import load

    base = make_model_dir(tmp_path / "base", "llama", seed=0)
    tuned = make_model_dir(tmp_path / "tuned", "llama", seed=0, noise=0.05)  # same tokenizer, other weights
    assert (base / "tokenizer.json").read_bytes() == (tuned / "tokenizer.json").read_bytes()
    model, tok = target("llama", "float32"), load(str(base)).tokenizer
    data = tmp_path / "data.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 30)
    opts = DistillOptions(data=str(data), tokens=600, draft_vocab=0,
                          train=TrainConfig(steps=1, batch_size=2, seq_len=16, depth=2, eval_every=1))
    out = tmp_path / "head"
    key = model_key(base, "float32")
    assert key == model_key(base, "float32") != model_key(tuned, "float32") != model_key(base, "bfloat16")
    list(distill(model, tok, target_parts(model), out, opts, model_id=key))
    assert "reusing the corpus" in first_stage(model, tok, out, opts, key)
    # Another model with the same tokenizer: its own states, never the base model's.
    assert "reusing" not in first_stage(model, tok, out, opts, model_key(tuned, "float32"))
    # The same path with other text in it: the new text.
    data.write_text("Once upon a time, in a small town, there lived a cat. " * 30)
    assert "reusing" not in first_stage(model, tok, out, opts, key)
    # The same text again, even in another file: reused.
    data.write_text("The quick brown fox jumps over the lazy dog. " * 30)
    assert "reusing the corpus" in first_stage(model, tok, out, opts, key)
    # An unknown model (no files to identify it by) never reuses a corpus.
    assert "reusing" not in first_stage(model, tok, out, opts, None)


@pytest.mark.parametrize("data", ["prompts", None])
def test_every_number_reported_is_the_number_used(tmp_path, data):
    from specdec_cli.distill.pipeline import Stage, States
    from specdec_cli.session.loading import load

    model, tok = target("llama", "float32"), load(str(make_model_dir(tmp_path / "m", "llama", seed=0))).tokenizer
    if data:
        data = tmp_path / "p.jsonl"
        words = ("cats", "rain", "tea", "maps", "boats", "snow", "bread", "owls")
        data.write_text("".join(json.dumps({"prompt": f"Tell me about {w}."}) + "\n" for w in words))
    # A small goal and a batch of 32 long answers: the old code generated all 32 and used them all.
    opts = DistillOptions(data=data and str(data), tokens=300, answer_tokens=60, gen_batch=32, draft_vocab=0,
                          train=TrainConfig(steps=1, batch_size=2, seq_len=16, depth=2, eval_every=1))
    events = list(distill(model, tok, target_parts(model), tmp_path / "h", opts,
                          model_id={"files": "x", "dtype": "float32"}))
    generated = [e for e in events if type(e).__name__ == "Generated"]
    states = [e for e in events if isinstance(e, States)]
    stage = next(e for e in events if isinstance(e, Stage) and e.name == "states")
    result = events[-1].result
    # At most the goal (the last answer cut to fit; a budget left smaller than a prompt stays unused).
    assert generated[-1].tokens == result.corpus_tokens and 200 < result.corpus_tokens <= 300 == generated[-1].goal
    assert f"at {result.corpus_tokens} positions" in stage.detail
    answers = states[-1].total  # one sequence per answered prompt
    assert generated[-1].answered == answers
    what = "built-in seed prompts" if data is None else "prompts"
    assert f"the model's answers to {answers} {what}" in result.source and result.source in stage.detail
    info = json.loads((tmp_path / "h" / "training.json").read_text())
    assert info["source"] == result.source and info["corpus_tokens"] == result.corpus_tokens
    assert f"{answers} {what}" in (tmp_path / "h" / "README.md").read_text()


def test_cli_distills_a_head_that_generate_loads(tmp_path, tiny_dir):
    data = tmp_path / "data.txt"
    data.write_text(("The quick brown fox jumps over the lazy dog. " * 40 + "\n") * 3)
    out = tmp_path / "head"
    result = _distill("--model", tiny_dir, "--out", out, "--data", data, "--data-tokens", 3000, "--steps", 16,
                      "--seq-len", 32, "--batch-size", 4, "--draft-vocab", 64, "--depth", 2)
    assert result.exit_code == 0, result.stderr
    assert "held-out top-1 agreement" in result.stderr and "acceptance" in result.stderr
    readme = (out / "README.md").read_text()
    assert "3000 tokens" in readme and "Draft vocabulary: 64" in readme
    info = json.loads((out / "training.json").read_text())
    assert info["steps_done"] == 16 and info["acceptance"] is not None
    assert info["tokens_per_block"] >= 1  # every target forward commits a token, a final EOS included
    gen = CliRunner().invoke(app, ["generate", "--model", str(tiny_dir), "--draft-model", str(out),
                                   "-p", "The quick brown fox", "--ignore-chat-template", "-m", "30",
                                   "--no-live", "--compare-ar", "--json"])
    assert gen.exit_code == 0, gen.stderr
    report = json.loads(gen.stdout)
    assert report["drafter"] == "mtp" and report["compare"]["identical"] and report["accepted"] > 0


@pytest.mark.parametrize("args, message", [
    ([], "give --out DIR"),
    (["--out", "{model}"], "holds another model"),
    (["--out", "{file}"], "is a file"),
    (["--out", "{tmp}/h", "--data", "{tmp}/missing"], "no such file"),
    (["--out", "{tmp}/h", "--lr", "nan"], "Invalid value for '--lr'"),
    (["--out", "{tmp}/h", "--time-limit", "0"], "Invalid value for '--time-limit'"),
])
def test_cli_refuses_bad_options_in_one_line(tmp_path, tiny_dir, args, message):
    (tmp_path / "f").write_text("x")
    fill = {"model": tiny_dir, "file": tmp_path / "f", "tmp": tmp_path}
    result = _distill("--model", tiny_dir, *[a.format(**fill) for a in args])
    assert result.exit_code == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("files, message", [
    ({"README.md": "# my project", "training.json": "{}", "src.py": "x = 1"},
     "would overwrite README.md, training.json"),
    ({"notes.txt": "mine"}, "it holds notes.txt"),
    ({"cache/other.bin": "x"}, "would overwrite cache"),
])
def test_out_refuses_a_folder_of_other_files_before_loading(tmp_path, tiny_dir, monkeypatch, files, message):
    import specdec_cli.cli.distill_command as command

    monkeypatch.setattr(command, "load_target", lambda *a, **kw: pytest.fail("the model loaded"))
    out = tmp_path / "project"
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    result = _distill("--model", tiny_dir, "--out", out, "--steps", 2)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0] and "give a new or empty directory" in errors[0]
    assert {str(p.relative_to(out)): p.read_text() for p in out.rglob("*") if p.is_file()} == files


def test_out_accepts_new_empty_an_earlier_head_and_an_interrupted_run(tmp_path):
    from specdec_cli.cli.distill_command import check_out

    assert check_out(str(tmp_path / "new")) == tmp_path / "new"
    (tmp_path / "empty").mkdir()
    check_out(str(tmp_path / "empty"))
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"model_type": "specdec_mtp"}))
    (head / "notes.txt").write_text("kept")  # beside an earlier head: only the head's files are replaced
    check_out(str(head))
    cut = tmp_path / "cut"  # Ctrl-C before the first head: the corpus cache and the staging folder only
    (cut / "cache").mkdir(parents=True)
    (cut / "cache" / "corpus.json").write_text("{}")
    (cut / ".writing").mkdir()
    check_out(str(cut))


def test_out_where_no_head_can_be_written_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    import os

    from specdec_cli.cli.distill_command import check_out

    (tmp_path / "afile").write_text("")
    with pytest.raises(OptionError, match="afile is not a folder this user can write in"):
        check_out(str(tmp_path / "afile" / "sub" / "head"))
    locked = tmp_path / "locked"
    locked.mkdir()
    access = os.access
    # A folder this user may not write in (root may write anywhere, so the refusal is staged).
    monkeypatch.setattr(os, "access", lambda p, mode: access(p, mode) and Path(p) != locked)
    for out in (locked / "head", locked):
        with pytest.raises(OptionError, match="locked is not a folder this user can write in"):
            check_out(str(out))
    assert check_out(str(tmp_path / "free" / "head")) == tmp_path / "free" / "head"
    # A --data that is not there: before the model loads too (no model is named here that could load).
    result = _distill("--model", tmp_path / "no-model", "--out", tmp_path / "h", "--data", tmp_path / "nope.jsonl")
    assert result.exit_code == 2 and "--data" in result.stderr and "no such file" in result.stderr, result.output


def test_ctrl_c_during_training_leaves_a_loadable_head(tmp_path, tiny_dir, monkeypatch):
    real = train_module.Trainer.run

    def interrupted(self, deadline=None):
        for step in real(self, deadline):
            yield step
            if step.step == 5:
                raise KeyboardInterrupt

    monkeypatch.setattr(train_module.Trainer, "run", interrupted)
    data = tmp_path / "data.txt"
    data.write_text("one two three four five six seven eight nine ten. " * 80)
    out = tmp_path / "head"
    result = _distill("--model", tiny_dir, "--out", out, "--data", data, "--data-tokens", 2000, "--steps", 40,
                      "--seq-len", 32, "--batch-size", 2, "--draft-vocab", 0)
    assert result.exit_code == 130
    assert "interrupted at step 5" in result.stderr
    assert "interrupted" in (out / "README.md").read_text()
    best = json.loads((out / "training.json").read_text())["best_step"]  # the step whose head was written
    assert 0 < best <= 5 and (best == 5) == ("the head written is step" not in (out / "README.md").read_text())
    model = target("llama", "float32")
    loaded = load_head(out, read_config(out), "head", target_parts(model))
    assert isinstance(loaded.head, MTPHead)


class Clock:
    """``time.perf_counter`` for a test: it moves only when told, so a time limit falls at a chosen point."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    @classmethod
    def install(cls, monkeypatch) -> "Clock":
        import time

        clock = cls()
        monkeypatch.setattr(time, "perf_counter", clock)
        return clock


def ticking_batches(monkeypatch, clock: Clock, seconds_per_step: float) -> None:
    """Each step of a batched generation (mlx-lm's BatchGenerator) moves ``clock`` on."""
    from mlx_lm.generate import BatchGenerator

    step = BatchGenerator.next_generated

    def ticking(self):
        clock.now += seconds_per_step
        return step(self)

    monkeypatch.setattr(BatchGenerator, "next_generated", ticking)


def clocked(monkeypatch, seconds_per_step: float, seconds_per_batch: float = 0.0) -> Clock:
    """A clock that moves by these amounts after each training step and each batch of generated answers."""
    import specdec_cli.distill.pipeline as pipeline_module

    clock = Clock.install(monkeypatch)
    run, answer = train_module.Trainer.run, pipeline_module.answer_prompts

    def timed_run(self, deadline=None):
        for step in run(self, deadline):
            clock.now += seconds_per_step
            yield step

    def timed_answers(*args, **kw):
        for event in answer(*args, **kw):
            if not event.timed_out:  # (the last event of a run the deadline stopped generated nothing)
                clock.now += seconds_per_batch
            yield event

    monkeypatch.setattr(train_module.Trainer, "run", timed_run)
    monkeypatch.setattr(pipeline_module, "answer_prompts", timed_answers)
    return clock


def test_a_time_limit_cuts_the_answers_at_half_and_training_at_the_limit(tmp_path, monkeypatch):
    from specdec_cli.session.loading import load

    clocked(monkeypatch, seconds_per_step=10, seconds_per_batch=30)
    model, tok = target("llama", "float32"), load(str(make_model_dir(tmp_path / "m", "llama", seed=0))).tokenizer
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Tell me about {w}."}) + "\n" for w in ("cats", "rain", "tea")))
    opts = DistillOptions(data=str(data), tokens=2000, answer_tokens=30, gen_batch=2, draft_vocab=0, time_limit=100,
                          train=TrainConfig(steps=40, batch_size=2, seq_len=16, depth=2, eval_every=25))
    out = tmp_path / "h"
    events = list(distill(model, tok, target_parts(model), out, opts, model_id={"files": "x", "dtype": "float32"}))
    result = events[-1].result
    # Two batches of answers (60 s >= half of 100 s), then steps until the clock passes 100 s: the fifth, which is
    # evaluated although it is no evaluation step, so a head is written.
    generated = [e for e in events if type(e).__name__ == "Generated"]
    assert [e.timed_out for e in generated] == [False, False, True]  # the third batch never starts
    assert result.corpus_tokens == generated[-1].tokens == generated[-2].tokens < 2000
    cut = [e for e in events if isinstance(e, Stage) and e.detail.startswith("time limit")]
    assert cut and cut[0].detail == f"time limit: answers stop at {result.corpus_tokens} tokens"
    assert not (out / "cache" / "corpus.json").exists()  # a corpus cut short is never reused as the whole one
    assert result.steps_done == 5 and result.time_limited and result.agreement is not None
    assert json.loads((out / "training.json").read_text())["time_limited"] is True
    assert "5 steps" in (out / "README.md").read_text() and "time limit of 100 s" in (out / "README.md").read_text()
    assert isinstance(load_head(out, read_config(out), "head", target_parts(model)).head, MTPHead)


@pytest.mark.parametrize("answer_tokens, fix", [
    (80, "the time limit stopped the answers before any sequence reached 66 tokens: give a longer --time-limit"),
    (5, "the training text has no sequence of 66 tokens: give more text with --data, or a smaller --seq-len"),
])
def test_answers_too_short_to_train_on_name_the_fix_that_helps(tmp_path, monkeypatch, answer_tokens, fix):
    # Cut by the deadline mid-answer: more time helps only where a whole answer (prompt + answer_tokens) would
    # reach a window.
    from specdec_cli.session.loading import load

    ticking_batches(monkeypatch, Clock.install(monkeypatch), seconds_per_step=5)
    model, tok = target("llama", "float32"), load(str(make_model_dir(tmp_path / "m", "llama", seed=0))).tokenizer
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "Tell me about cats."}) + "\n")  # 38 tokens
    opts = DistillOptions(data=str(data), tokens=2000, answer_tokens=answer_tokens, gen_batch=2, draft_vocab=0,
                          time_limit=100, train=TrainConfig(steps=4, batch_size=2, seq_len=64, depth=2))
    seen = []
    with pytest.raises(OptionError, match=fix):
        for event in distill(model, tok, target_parts(model), tmp_path / "h", opts):
            seen.append(event)
    # Cut by the time limit: said at once, before the target's states are computed for nothing.
    assert any(isinstance(e, Stage) and e.name == "states" for e in seen) == (answer_tokens < 66)


def test_answers_stop_mid_batch_at_the_deadline_keeping_what_was_generated(tmp_path, monkeypatch):
    # A batch of long answers on a slow machine must not run past a time limit: generation stops at the step the
    # deadline passes, and what each row has is the start of the answer it would have given.
    from specdec_cli.distill.data import answer_prompts
    from specdec_cli.session.loading import load

    model, tok = target("llama", "float32"), load(str(make_model_dir(tmp_path / "m", "llama", seed=0))).tokenizer
    prompts = ["Tell me about cats.", "Why does it rain?", "How is tea made?"]
    full: list[list[int]] = []
    list(answer_prompts(model, tok, prompts, 10_000, 40, 3, 0.7, 0, full))
    clock = Clock.install(monkeypatch)
    ticking_batches(monkeypatch, clock, seconds_per_step=1)
    cut: list[list[int]] = []
    events = list(answer_prompts(model, tok, prompts, 10_000, 40, 3, 0.7, 0, cut, deadline=clock.now + 10.5))
    assert len(events) == 1 and events[0].tokens == sum(map(len, cut)) and len(cut) == 3 and events[0].timed_out
    for got, whole, prompt in zip(cut, full, prompts):
        assert got == whole[:len(got)] and len(got) < len(whole)
        assert 0 < len(got) - len(prompt_ids(tok, prompt)) <= 11


def test_cli_time_limit_writes_the_best_head_and_says_what_it_cut(tmp_path, tiny_dir, monkeypatch):
    clocked(monkeypatch, seconds_per_step=1)
    data = tmp_path / "data.txt"
    data.write_text("one two three four five six seven eight nine ten. " * 80)
    out = tmp_path / "head"
    result = _distill("--model", tiny_dir, "--out", out, "--data", data, "--data-tokens", 2000, "--steps", 40,
                      "--seq-len", 32, "--batch-size", 2, "--draft-vocab", 0, "--time-limit", "12.5", "--no-measure")
    assert result.exit_code == 0, result.stderr
    assert "the time limit cut the run short: 2000 tokens of data, 14 of 40 steps" in result.stderr
    info = json.loads((out / "training.json").read_text())
    assert info["steps_done"] == 14 and info["time_limited"] and info["options"]["time_limit"] == 12.5
    # Without a limit nothing is cut, and the record says so.
    again = _distill("--model", tiny_dir, "--out", out, "--data", data, "--data-tokens", 2000, "--steps", 3,
                     "--seq-len", 32, "--batch-size", 2, "--draft-vocab", 0, "--no-measure")
    assert again.exit_code == 0 and "time limit" not in again.stderr
    assert not json.loads((out / "training.json").read_text())["time_limited"]


def test_ship_head_casts_the_weights_to_float16_and_refuses_another_models_head(tmp_path, tiny_dir, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("ship_head", Path(__file__).parents[2] / "scripts" / "ship_head.py")
    ship_head = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ship_head)
    data = tmp_path / "data.txt"
    data.write_text("one two three four five six seven eight nine ten. " * 80)
    head = tmp_path / "head"
    assert _distill("--model", tiny_dir, "--out", head, "--data", data, "--data-tokens", 1000, "--steps", 2,
                    "--seq-len", 32, "--batch-size", 2, "--draft-vocab", 64, "--no-measure").exit_code == 0
    dest = tmp_path / "shipped"
    assert ship_head.main([str(head), "--model", str(tiny_dir), "--dest", str(dest)]) == 0
    trained, shipped = mx.load(str(head / "model.safetensors")), mx.load(str(dest / "model.safetensors"))
    assert trained.keys() == shipped.keys() and shipped["draft_ids"].dtype == trained["draft_ids"].dtype
    for name, w in trained.items():
        want = w.astype(mx.float16) if mx.issubdtype(w.dtype, mx.floating) else w
        assert shipped[name].dtype == want.dtype and mx.array_equal(shipped[name], want).item(), name
    assert {p.name for p in dest.iterdir()} == {"model.safetensors", "config.json", "README.md", "training.json"}
    readme = (dest / "README.md").read_text()
    assert readme.startswith((head / "README.md").read_text().rstrip("\n")) and "stored in float16" in readme
    assert isinstance(load_head(dest, read_config(dest), "head", target_parts(target("llama", "float32"))).head,
                      MTPHead)
    capsys.readouterr()
    other = make_model_dir(tmp_path / "other", "llama", seed=1)
    assert ship_head.main([str(head), "--model", str(other), "--dest", str(tmp_path / "no")]) == 1
    assert ship_head.main([str(data.parent / "missing"), "--model", str(tiny_dir), "--dest", str(tmp_path / "no")]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 2 and all(e.startswith("error: ") for e in errors) and "distill" in errors[0]
    assert "give the folder distill --out wrote" in errors[1] and not (tmp_path / "no").exists()


# --drafter auto


def _generate(*args):
    return CliRunner().invoke(app, ["generate", "-p", "The quick brown fox", "--ignore-chat-template", "-m", "20",
                                    "--no-live", "--json", *map(str, args)])


def test_drafter_auto_says_what_it_picked(tmp_path, tiny_dir):
    t = trained(0)
    from specdec_cli.drafters.mtp_io import save_head

    head = save_head(tmp_path / "head", t.head)
    draft = make_model_dir(tmp_path / "draft", "llama", seed=0, noise=0.05)
    for extra, kind, why in [([], "lookup", "no drafter for this model"),
                             (["--draft-model", head], "lookup+mtp", "lookup where the text repeats, the MTP head"),
                             (["--draft-model", draft], "model", "the draft model --draft-model names")]:
        result = _generate("--model", tiny_dir, "--drafter", "auto", *extra)
        assert result.exit_code == 0, result.stderr
        assert f"drafter: auto -> {kind} ({why}" in result.stderr
        assert json.loads(result.stdout)["drafter"] == kind


def test_drafter_auto_refuses_options_of_one_lookup_drafter(tiny_dir):
    result = _generate("--model", tiny_dir, "--drafter", "auto", "--ngram-max", "3")
    assert result.exit_code == 2 and "instead of auto" in result.stderr


def test_text_ids_cut_long_texts_and_stop_at_the_goal():
    from specdec_cli.distill.data import text_ids

    class Bytes:
        def encode(self, text):
            return list(text.encode())

    out: list = []
    assert text_ids(Bytes(), ["a" * 10, "b" * 10, "c" * 10], 25, out, piece=4) == (25, 3)
    assert [len(x) for x in out] == [4, 4, 2, 4, 4, 2, 4, 1]


def test_drafter_auto_with_a_head_drafts_with_lookup_and_the_head(tmp_path, tiny_dir):
    t = trained(96)
    from specdec_cli.drafters.mtp_io import save_head

    head = save_head(tmp_path / "head", t.head)
    prompt = "Copy: the quick brown fox jumps over the lazy dog. Again: the quick brown fox jumps"
    result = CliRunner().invoke(app, ["generate", "--model", str(tiny_dir), "--drafter", "auto", "--draft-model",
                                      str(head), "-p", prompt, "--ignore-chat-template", "-m", "40", "--no-live",
                                      "--compare-ar", "--verbose"])
    assert result.exit_code == 0, result.stderr
    assert "drafter: auto -> lookup+mtp" in result.stderr and "Compare: identical" in result.stderr
    assert "blocks drafted by the head" in result.stderr
    # Without the adaptive policy nothing chooses per block: the head drafts alone.
    result = _generate("--model", tiny_dir, "--drafter", "auto", "--draft-model", head, "--no-adaptive")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["drafter"] == "mtp"


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "qwen3_5", "nemotron_h"])
def test_a_head_trains_and_drafts_exactly_for_every_family(family):
    # Hybrids (Qwen3.5, Nemotron-H) and sliding-window models included; Qwen3.5 keeps its shape in text_config.
    model = build_model(TINY_CONFIGS[family], seed=0)
    parts = target_parts(model)
    seqs = [list(range(5, 70)), list(range(100, 170))]
    states = list(teacher_states(model, seqs))
    config = head_config(parts)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    t = Trainer(MTPHead(config), parts, windows(seqs, states, 18), windows(seqs[:1], states[:1], 18),
                TrainConfig(steps=3, batch_size=2, seq_len=16, depth=2, eval_every=1))
    assert len(list(t.run())) == 3
    prompt = list(range(5, 30))
    _, plain = collect(run(model, prompt, max_tokens=20))
    _, spec = collect(run(model, prompt, drafter=MTPDrafter(t.head, parts), num_draft_tokens=3, max_tokens=20))
    assert spec == plain
