"""Logits processors under speculation: penalties, logit bias, a grammar and log-probabilities stay lossless.

Each processor sees, at every verify row, the context plain decoding sees at
that position (the committed tokens and the drafts before the row), so:
greedy speculative output equals plain decoding with the same processors
token for token, with the same log-probabilities (on this CPU a T-row forward
gives the bits of T one-row forwards, see tests/helpers.py: kernels_agree);
a seeded sampled text is plain decoding's; unseeded sampled tokens follow the
processed distribution (chi-square, with tests/core/test_sampling.py's machinery);
and plain decoding with our penalties is mlx-lm's own ``generate_step`` with
``make_logits_processors``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import DTYPES, FAMILIES, PROMPT, kernels_agree, noisy_drafter, prefilled, target, tokens
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from test_sampling import POSITIONS, VOCAB, chi_square, models

from specdec_cli.core.adaptive import FixedLength, MatchLength
from specdec_cli.cache.caches import ModelCache
from specdec_cli.drafters import ModelDrafter, NgramDrafter, SuffixDrafter
from specdec_cli.loop.engine import Engine, Row, speculative_generate_step
from specdec_cli.loop.plain import plain_generate_step
from specdec_cli.core.processors import Constraint, Grammar, Penalties, grammar_text, make_processors
from specdec_cli.core.sampling import SamplingParams, log_probs
from specdec_cli.session import Request
from specdec_cli.session.synthetic import EOS_ID, write_tokenizer

GEN = 40
# Draws per chi-square check. Not test_sampling's 1,000: the residual-row check below scores chi2 ~104
# against 30.4 on 1,500 draws but only ~65 on 1,000 (a miss would then be ~0.4% likely on another seed).
SAMPLES = 1500
PENALTIES = dict(repetition_penalty=1.3, repetition_context_size=12, presence_penalty=0.4, presence_context_size=30,
                 frequency_penalty=0.25, frequency_context_size=20, logit_bias={101: 1.5, 32: -2.0, 116: 0.75})
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "bb", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "ok", "tags"], "additionalProperties": False}
# A prompt that holds JSON of the schema: prompt lookup then drafts tokens the grammar allows.
JSON_PROMPT = list(b'Answer as JSON: {"name": "ann", "age": 7, "ok": true, "tags": ["a", "c"]} or {"name": "b')


@functools.cache
def tokenizer():
    """mlx-lm's wrapper of the tiny models' byte-level tokenizer (256 bytes + chat specials)."""
    from mlx_lm.tokenizer_utils import load

    import tempfile

    path = Path(tempfile.mkdtemp()) / "tok"
    write_tokenizer(path)
    return load(path)


@functools.cache
def schema_grammar() -> str:
    return grammar_text(Constraint.json_schema(SCHEMA), tokenizer())


def valid(obj) -> bool:
    """``obj`` is valid against SCHEMA (the keywords it uses)."""
    if not isinstance(obj, dict) or set(obj) != {"name", "age", "ok", "tags"}:
        return False
    return (isinstance(obj["name"], str) and len(obj["name"]) <= 6
            and isinstance(obj["age"], int) and not isinstance(obj["age"], bool) and 0 <= obj["age"] <= 120
            and isinstance(obj["ok"], bool) and isinstance(obj["tags"], list) and len(obj["tags"]) <= 3
            and all(t in ("a", "bb", "c") for t in obj["tags"]))


def make(kind: str, prompt=PROMPT) -> tuple:
    if kind == "penalties":
        return (Penalties(prompt, **PENALTIES),)
    if kind == "grammar":
        return (Grammar(tokenizer(), schema_grammar()),)
    return (Penalties(prompt, **PENALTIES), Grammar(tokenizer(), schema_grammar()))


def drafter_for(kind: str, family: str, dtype: str, prompt):
    if kind == "model":
        d = ModelDrafter(noisy_drafter(family, dtype))
    elif kind == "lookup":
        d = SuffixDrafter()
    else:
        d = NgramDrafter(max_ngram=3, min_ngram=1)
    d.prefill(prompt[:-1])
    return d


def run_plain(model, procs, prompt=PROMPT, sampling=SamplingParams(), max_tokens=GEN, logprobs=3):
    cache = prefilled(model, prompt)
    return list(plain_generate_step(prompt[-1], cache, max_tokens=max_tokens, eos_ids=[EOS_ID], sampling=sampling,
                                    processors=procs, logprobs=logprobs))


def run_spec(model, drafter, procs, prompt=PROMPT, sampling=SamplingParams(), max_tokens=GEN, k=4, logprobs=3,
             rollback="reforward", policy=None):
    cache = prefilled(model, prompt)
    return list(speculative_generate_step(prompt[-1], cache, drafter, num_draft_tokens=k, policy=policy,
                                          max_tokens=max_tokens, eos_ids=[EOS_ID], sampling=sampling,
                                          processors=procs, logprobs=logprobs, rollback=rollback))


def logprobs_of(blocks) -> list:
    return [e for b in blocks for e in (b.logprobs or ())]


# --- the arithmetic is mlx-lm's -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("history", [5, 60], ids=["short-context", "long-context"])
def test_each_verify_row_is_processed_as_mlx_lm_processes_that_position(dtype, history):
    rng = np.random.default_rng(history)
    vocab, k = 300, 6
    prompt = rng.integers(0, 40, history).tolist()  # small ids: repeats in every window
    drafts = rng.integers(0, 40, k).tolist()
    logits = mx.array(rng.normal(0, 3, (k + 1, vocab)), dtype=getattr(mx, dtype))
    committed = [7, 7, 3]
    ours = Penalties(prompt, **PENALTIES)
    ours.commit(committed)
    got = ours.apply(logits, mx.array(drafts, dtype=mx.uint32))
    theirs = make_logits_processors(**PENALTIES)
    for i in range(k + 1):
        context = mx.array(prompt + committed + drafts[:i])
        row = logits[i : i + 1]
        for proc in theirs:
            row = proc(context, row)
        assert mx.array_equal(got[i : i + 1], row).item(), f"row {i}"
        assert got.dtype == row.dtype


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_decoding_with_penalties_is_mlx_lms_generate_step(family, dtype):
    model = target(family, dtype)
    theirs = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=GEN,
                                               logits_processors=make_logits_processors(**PENALTIES))]
    ours = tokens(run_plain(model, make("penalties"), logprobs=None))
    assert ours == theirs[: len(ours)]
    assert len(ours) == GEN or theirs[len(ours)] == EOS_ID  # ours stops at the end-of-sequence token
    unpenalised = tokens(run_plain(model, (), logprobs=None))
    assert ours != unpenalised  # the penalties change the text


# --- greedy: speculative == plain, token for token, with the same log-probabilities -------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("drafter", ["model", "lookup", "ngram"])
@pytest.mark.parametrize("kind", ["penalties", "grammar"])
def test_speculative_equals_plain_with_the_same_processor(family, dtype, drafter, kind):
    model = target(family, dtype)
    prompt = JSON_PROMPT if kind == "grammar" else PROMPT
    max_tokens = 80 if kind == "grammar" else GEN
    plain = run_plain(model, make(kind, prompt), prompt, max_tokens=max_tokens)
    blocks = run_spec(model, drafter_for(drafter, family, dtype, prompt), make(kind, prompt), prompt,
                      max_tokens=max_tokens, k=5)
    if not kernels_agree(dtype):
        # Batched kernels round differently here (a GPU, OpenBLAS): identical, or a proven rounding tie.
        from specdec_cli.loop.compare import TIE, explain

        d = explain(model, prompt, tokens(blocks), tokens(plain), blocks, eos_ids=[EOS_ID],
                    processors=lambda: make(kind, prompt))
        assert d is None or d.verdict == TIE, d
        return
    assert tokens(blocks) == tokens(plain)
    assert logprobs_of(blocks) == logprobs_of(plain)  # the same numbers, bit for bit
    assert len(logprobs_of(blocks)) == len(tokens(blocks))
    if drafter == "model":
        assert sum(b.accepted for b in blocks) > 0
    if kind == "grammar":
        text = bytes(tokens(plain)).decode("utf-8")
        assert plain[-1].finish_reason == "stop" and valid(json.loads(text)), text


def test_a_grammar_cuts_drafts_that_leave_it_before_the_verify():
    model = target("llama", "float32")
    blocks = run_spec(model, drafter_for("model", "llama", "float32", JSON_PROMPT), make("grammar"), JSON_PROMPT,
                      max_tokens=80, k=6, policy=FixedLength(6))
    # The drafter drafts without the grammar: blocks verify fewer drafts than it proposed, and never refused ones.
    assert any(b.drafted < 6 for b in blocks[:-1])
    assert tokens(blocks) == tokens(run_plain(model, make("grammar"), JSON_PROMPT, max_tokens=80))


def test_penalties_and_a_grammar_together_and_every_rollback():
    model = target("qwen3_5", "bfloat16")
    plain = tokens(run_plain(model, make("both"), JSON_PROMPT, max_tokens=80))
    for rollback in ("reforward", "carry", "capture", "tape"):
        blocks = run_spec(model, drafter_for("model", "qwen3_5", "bfloat16", JSON_PROMPT), make("both"),
                          JSON_PROMPT, max_tokens=80, rollback=rollback)
        assert tokens(blocks) == plain, rollback


def test_a_lookup_drafters_adaptive_policy_with_a_grammar():
    model = target("gemma3_text", "float32")
    policy = MatchLength(k_max=15)
    plain = tokens(run_plain(model, make("grammar"), JSON_PROMPT, max_tokens=80))
    drafter = SuffixDrafter(size=policy.size)
    drafter.prefill(JSON_PROMPT[:-1])
    blocks = run_spec(model, drafter, make("grammar"), JSON_PROMPT, max_tokens=80, policy=policy)
    assert tokens(blocks) == plain


def test_no_processors_runs_as_before():
    model = target("llama", "float32")
    blocks = run_spec(model, drafter_for("model", "llama", "float32", PROMPT), (), logprobs=None)
    assert all(b.logprobs is None and b.syncs == 1 for b in blocks)
    plain = run_plain(model, (), logprobs=None)
    assert all(b.logprobs is None for b in plain) and tokens(blocks) == tokens(plain)


def test_penalties_add_no_host_sync_and_a_grammar_one_for_a_model_drafter():
    model = target("llama", "float32")
    pen = run_spec(model, drafter_for("model", "llama", "float32", PROMPT), make("penalties"))
    assert all(b.syncs == 1 for b in pen)
    # A grammar reads a draft model's (lazy) drafts back: one more sync per block that drafted.
    gram = run_spec(model, drafter_for("model", "llama", "float32", JSON_PROMPT), make("grammar"), JSON_PROMPT,
                    max_tokens=80)
    assert {b.syncs for b in gram} <= {1, 2} and any(b.syncs == 2 for b in gram)
    look = drafter_for("lookup", "llama", "float32", JSON_PROMPT)
    assert all(b.syncs == 1 for b in run_spec(model, look, make("grammar"), JSON_PROMPT, max_tokens=80))


# --- several rows in one engine ----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_batch_of_rows_each_with_its_own_processors(family):
    model = target(family, "float32")
    specs = [("penalties", PROMPT), ("grammar", JSON_PROMPT), ("none", PROMPT[:-10])]
    engine = Engine(model, rollback="capture")
    rows = []
    for kind, prompt in specs:
        procs = () if kind == "none" else make(kind, prompt)
        drafter = drafter_for("model", family, "float32", prompt)
        row = Row(prompt[-1], drafter, FixedLength(3), eos=frozenset([EOS_ID]), max_tokens=60, processors=procs,
                  logprobs=2 if kind != "none" else None)
        rows.append(engine.admit(row, prefilled(model, prompt)))
    out = {id(r): [] for r in rows}
    lps = {id(r): [] for r in rows}
    while engine.rows:
        for row, block in engine.step():
            out[id(row)] += block.tokens
            lps[id(row)] += block.logprobs or []
        for row in [r for r in engine.rows if r.finish is not None or r.room <= 0]:
            engine.remove(row)
    for (kind, prompt), row in zip(specs, rows):
        procs = () if kind == "none" else make(kind, prompt)
        plain = run_plain(model, procs, prompt, max_tokens=60, logprobs=2 if kind != "none" else None)
        assert out[id(row)] == tokens(plain), kind
        assert lps[id(row)] == logprobs_of(plain), kind


# --- sampling --------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("drafter", ["model", "lookup"])
@pytest.mark.parametrize("kind", ["penalties", "grammar"])
def test_a_seeded_sampled_text_is_plain_decodings_with_the_same_processor(family, drafter, kind):
    model = target(family, "float32")
    prompt = JSON_PROMPT if kind == "grammar" else PROMPT
    sampling = SamplingParams(temp=0.9, top_k=40, seed=5)
    plain = tokens(run_plain(model, make(kind, prompt), prompt, sampling=sampling, max_tokens=80))
    spec = tokens(run_spec(model, drafter_for(drafter, family, "float32", prompt), make(kind, prompt), prompt,
                           sampling=sampling, max_tokens=80))
    assert spec == plain


def test_fifty_seeded_samples_under_a_json_schema_each_parse_and_validate():
    model = target("llama", "float32")
    seen = set()
    for seed in range(50):
        sampling = SamplingParams(temp=1.0, seed=seed)
        drafter = drafter_for("model" if seed % 2 else "lookup", "llama", "float32", JSON_PROMPT)
        blocks = run_spec(model, drafter, make("grammar"), JSON_PROMPT, sampling=sampling, max_tokens=160,
                          logprobs=None)
        text = bytes(tokens(blocks)).decode("utf-8")
        assert blocks[-1].finish_reason == "stop", text
        obj = json.loads(text)
        assert valid(obj), text
        seen.add(text)
    assert len(seen) > 40  # the samples differ


# The chi-square check of tests/core/test_sampling.py, with processors: its 16-token model and prompt.
SMALL_PENALTIES = dict(repetition_penalty=1.6, repetition_context_size=4, presence_penalty=0.7, frequency_penalty=0.4,
                       logit_bias={5: 1.0, 9: -1.0})


class Parity:
    """A toy grammar over the 16-token vocabulary: tokens alternate odd and even, 0 never follows 2 tokens.

    It reads drafts on the host (not ``lazy``) and refuses some, so drafts are cut before the verify.
    """

    lazy = False

    def __init__(self, prompt):
        self.last = prompt[-1]

    @staticmethod
    def _ok(prev: int, t: int) -> bool:
        return (t % 2) != (prev % 2)

    def allowed(self, drafts) -> int:
        prev, n = self.last, 0
        for t in drafts:
            if not self._ok(prev, int(t)):
                break
            prev, n = int(t), n + 1
        return n

    def apply(self, logits, drafts):
        prev, masks = self.last, []
        for i in range(logits.shape[0]):
            if i:
                prev = int(drafts[i - 1])
            masks.append([self._ok(prev, t) for t in range(logits.shape[-1])])
        return mx.where(mx.array(masks), logits, -float("inf"))

    def commit(self, tokens) -> None:
        if tokens:
            self.last = int(tokens[-1])


class UniformDrafter:
    """A sampling drafter whose q is uniform over the vocabulary: half its drafts break Parity, and are cut."""

    name, taps = "uniform", None

    def prefill(self, tokens, step_size=0, hidden=None):
        pass

    def propose(self, last, k, params):
        if k == 0:
            return engine_draft(mx.array([], dtype=mx.uint32))
        tokens = mx.random.randint(0, VOCAB, (k,)).astype(mx.uint32)
        return engine_draft(tokens, mx.full((k, VOCAB), -float(np.log(VOCAB))))

    def accept(self, n, hidden=None):
        pass

    def cancel(self):
        pass


def engine_draft(tokens, logprobs=None):
    from specdec_cli.drafters import Draft

    return Draft(tokens, logprobs)


def small_processors(kind: str, prompt):
    if kind == "penalties":
        return (Penalties(prompt, **SMALL_PENALTIES),)
    return (Parity(prompt),)


@functools.cache
def exact_processed_marginals(kind: str) -> list[list[float]]:
    """P(token at position i = v), the processors applied at each position, by enumerating prefixes."""
    from test_sampling import PROMPT as SMALL_PROMPT

    model, _ = models()
    cache = ModelCache(model)
    cache.prefill(SMALL_PROMPT[:-1])
    snap = cache.snapshot()
    params = SamplingParams(temp=1.0)

    def dist(prefix: list[int]) -> list[float]:
        cache.restore(snap)
        logits = cache.feed(mx.array([SMALL_PROMPT[-1], *prefix], dtype=mx.uint32))[-1:]
        for proc in small_processors(kind, SMALL_PROMPT):
            proc.commit(prefix)
            logits = proc.apply(logits, ())
        return mx.exp(log_probs(logits, params))[0].tolist()

    marg = [[0.0] * VOCAB for _ in range(POSITIONS)]
    p1 = dist([])
    for a in range(VOCAB):
        marg[0][a] = p1[a]
        if p1[a] == 0:
            continue
        p2 = dist([a])
        for b in range(VOCAB):
            w = p1[a] * p2[b]
            marg[1][b] += w
            if w == 0:
                continue
            p3 = dist([a, b])
            for c in range(VOCAB):
                marg[2][c] += w * p3[c]
    return marg


def draw_processed(kind: str, drafter: str, samples: int = SAMPLES, seed: int = 0):
    from test_sampling import PROMPT as SMALL_PROMPT

    target_model, draft_model = models()
    cache = ModelCache(target_model)
    cache.prefill(SMALL_PROMPT[:-1])
    snap = cache.snapshot()
    dcache = ModelCache(draft_model)
    dcache.prefill(SMALL_PROMPT[:-1])
    dsnap = dcache.snapshot()
    mx.random.seed(seed)
    counts = [[0] * VOCAB for _ in range(POSITIONS)]
    drafted = accepted = 0
    params = SamplingParams(temp=1.0)
    for _ in range(samples):
        cache.restore(snap)
        procs = small_processors(kind, SMALL_PROMPT)
        if drafter == "plain":
            blocks = plain_generate_step(SMALL_PROMPT[-1], cache, max_tokens=POSITIONS, sampling=params,
                                         processors=procs)
        else:
            if drafter == "model":
                dcache.restore(dsnap)
                d = ModelDrafter(draft_model, cache=dcache)
            elif drafter == "uniform":
                d = UniformDrafter()
            else:
                d = NgramDrafter(max_ngram=3, min_ngram=1)
                d.prefill(SMALL_PROMPT[:-1])
            blocks = speculative_generate_step(SMALL_PROMPT[-1], cache, d, num_draft_tokens=3, max_tokens=POSITIONS,
                                               sampling=params, processors=procs)
        out = []
        for b in blocks:
            out += b.tokens
            drafted, accepted = drafted + b.drafted, accepted + b.accepted
        for i, tok in enumerate(out):
            counts[i][tok] += 1
    return counts, (accepted, drafted)


@pytest.mark.parametrize("drafter", ["plain", "model", "ngram", "uniform"])
@pytest.mark.parametrize("kind", ["penalties", "parity"])
def test_sampled_tokens_follow_the_processed_distribution(kind, drafter):
    counts, (accepted, drafted) = draw_processed(kind, drafter)
    if drafter == "model":
        # Both branches ran: accepts, and rejections (parity: most refused drafts are cut before the verify).
        assert accepted >= 50 and drafted - accepted >= (50 if kind == "penalties" else 5), (accepted, drafted)
    exact = exact_processed_marginals(kind)
    for pos in range(POSITIONS):
        stat, critical = chi_square(counts[pos], exact[pos])
        assert stat < critical, f"position {pos + 1}: chi2 {stat:.1f} >= {critical:.1f}"


def test_without_the_residual_row_a_cut_sampled_draft_is_lossy(monkeypatch):
    # A cut draft of a sampling drafter must draw the next token from the residual of the cut
    # position's q (as the uncut draft's certain rejection would), not from p: the check sees the difference.
    import specdec_cli.loop.engine as engine

    real = engine._allowed

    def drop_the_row(p):
        syncs = real(p)
        if p.draft.logprobs is not None and p.draft.logprobs.shape[0] > p.draft.size:
            p.draft = engine.Draft(p.draft.tokens, p.draft.logprobs[: p.draft.size], p.draft.syncs)
        return syncs

    monkeypatch.setattr(engine, "_allowed", drop_the_row)
    counts, _ = draw_processed("parity", "uniform")
    exact = exact_processed_marginals("parity")
    worst = max(chi_square(counts[p], exact[p])[0] / chi_square(counts[p], exact[p])[1] for p in range(POSITIONS))
    assert worst > 1, worst


# --- the factory ---------------------------------------------------------------------------------


def test_make_processors_reads_a_request_and_makes_fresh_state_each_time():
    assert make_processors(Request(PROMPT), tokenizer(), PROMPT) == ()
    req = Request(PROMPT, repetition_penalty=1.2, logit_bias=((5, 1.0),), constraint=Constraint("json_object"))
    a, b = make_processors(req, tokenizer(), PROMPT), make_processors(req, tokenizer(), PROMPT)
    assert [type(p).__name__ for p in a] == ["Penalties", "Grammar"]
    assert all(x is not y for x, y in zip(a, b))
    a[1].commit(list(b"{"))
    assert b[1].allowed(list(b"}")) == 0 and a[1].allowed(list(b"}")) == 1  # b's grammar never saw the "{"
    # mlx-lm's "off" values make no processor.
    assert make_processors(Request(PROMPT, repetition_penalty=1.0, presence_penalty=0.0), tokenizer(), PROMPT) == ()


# --- generate's options ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from specdec_cli.session.synthetic import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("gen") / "llama", "llama", seed=0)


def cli(*args):
    from typer.testing import CliRunner

    from specdec_cli.cli.app import app

    return CliRunner().invoke(app, ["generate", *map(str, args)])


def test_generate_with_a_repetition_penalty_is_plain_decodings_with_it(model_dir):
    base = ["--model", model_dir, "--json", "--compare-ar", "-m", 40, "-p", "the quick brown fox, the quick brown fox"]
    out = cli(*base, "--repetition-penalty", 1.3, "--repetition-context-size", 8)
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert report["compare"]["identical"] and report["processors"]["repetition_penalty"] == 1.3
    plain = json.loads(cli(*base).stdout)
    assert plain["text"] != report["text"]


def test_generate_with_a_json_schema_answers_valid_json(model_dir, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    out = cli("--model", model_dir, "--json", "--compare-ar", "-m", 150, "--json-schema", schema, "-p", "JSON please")
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert report["compare"]["identical"] and report["finish_reason"] == "eos"
    assert valid(json.loads(report["text"])), report["text"]


@pytest.mark.parametrize("args,says", [
    (["--repetition-context-size", "0"], "--repetition-context-size"),
    (["--repetition-penalty", "-1"], "--repetition-penalty"),
    (["--json-schema", "/nonexistent/schema.json"], "cannot read --json-schema"),
    (["--json-schema", "LIST"], "not a JSON schema"),
    (["--json-schema", "LOOKAROUND"], "cannot be compiled"),
])
def test_bad_processor_options_are_one_line_errors(model_dir, tmp_path, args, says):
    files = {"LIST": "[1, 2]", "LOOKAROUND": json.dumps({"type": "string", "pattern": "(?<=a)b"})}
    for i, a in enumerate(args):
        if a in files:
            path = tmp_path / f"{a}.json"
            path.write_text(files[a])
            args[i] = str(path)
    out = cli("--model", model_dir, "-p", "hi", *args)
    assert out.exit_code in (1, 2) and says in out.output and "Traceback" not in out.output, out.output
