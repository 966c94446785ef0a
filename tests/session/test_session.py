"""The session layer: prompt caches across requests (hybrids and sliding windows too) and replies as text."""

from __future__ import annotations

import mlx.core as mx
import pytest

from helpers import PROMPT, cache_arrays, max_cache_diff
from mtp_fixtures import fitted_head, hf_checkpoint
from server import TOOL_ANSWER, tools_tokenizer
from specdec_cli.cache.caches import ModelCache
from specdec_cli.errors import Cancelled
from specdec_cli.loop.events import Prefilled, Step
from specdec_cli.session import ModelOptions, PromptCache, Request, SavedCache, Session, load_setup
from specdec_cli.session.reply import Piece, Reply, TextStream
from specdec_cli.session.synthetic import make_model_dir

FAMILIES = ["llama", "qwen3_5", "gemma3_text", "nemotron_h"]
MORE = list(b" And once more, the quick brown fox jumps over the lazy dog.")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("session")
    out = {f: make_model_dir(root / f, f, seed=0) for f in FAMILIES}
    out["llama-draft"] = make_model_dir(root / "llama-draft", "llama", seed=0, noise=0.05)
    return out


@pytest.fixture(scope="module")
def setups(dirs):
    return {f: load_setup(ModelOptions(model=str(dirs[f]), dtype="float32"), "lookup") for f in FAMILIES}


def gen(session: Session, ids, n: int = 40, **kw) -> tuple[list[int], Prefilled]:
    tokens, prefilled = [], None
    for event in session.generate(Request(ids, n, **kw)):
        if isinstance(event, Prefilled):
            prefilled = event
        elif isinstance(event, Step):
            tokens += event.block.tokens
            gen.finish = event.block.finish_reason
    return tokens, prefilled


def held(prompt, tokens) -> int:
    """What the caches hold after a run: the prompt and every token but the last (an EOS is the last)."""
    return len(prompt) + len(tokens) - (0 if gen.finish == "stop" else 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_later_turn_resumes_everything_the_last_one_left_and_generates_what_a_cold_session_does(setups, family):
    setup = setups[family]
    warm, cold = Session(setup, 16, prompt_cache=PromptCache()), Session(setup, 16)
    first, _ = gen(warm, PROMPT)
    kept = held(PROMPT, first)
    second = PROMPT + first + MORE
    out, pre = gen(warm, second)
    ref, cold_pre = gen(cold, second)
    assert out == ref and cold_pre.cached == 0
    assert pre.cached == kept
    again, pre = gen(warm, second)
    assert again == ref and pre.cached == len(second) - 1  # the same prompt again: only its last token is fed


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "gemma3_text"])
def test_recurrent_and_window_layers_resume_at_a_checkpoint_a_request_named(setups, family):
    setup = setups[family]
    warm, cold = Session(setup, 16, prompt_cache=PromptCache()), Session(setup, 16)
    cut = 30
    gen(warm, PROMPT, boundaries=(cut,))
    branch = PROMPT[:cut] + MORE
    out, pre = gen(warm, branch)
    assert out == gen(cold, branch)[0]
    assert pre.cached == cut
    # Without that checkpoint only an attention-only model could have trimmed back to it.
    plain = Session(setup, 16, prompt_cache=PromptCache())
    gen(plain, PROMPT)
    assert gen(plain, branch)[1].cached == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_three_turns_then_a_branch_back_to_where_the_first_ended(setups, family):
    setup = setups[family]
    warm, cold = Session(setup, 16, prompt_cache=PromptCache()), Session(setup, 16)
    first, _ = gen(warm, PROMPT)
    kept = held(PROMPT, first)
    second = PROMPT + first + MORE
    answer, _ = gen(warm, second)  # takes turn one's caches over (no copy)
    third = second + answer + MORE
    out, pre = gen(warm, third)
    assert out == gen(cold, third)[0] and pre.cached == held(second, answer)
    # Where turn one ended is still a checkpoint, two hand-overs later.
    branch = (PROMPT + first)[:kept] + list(b" but then something else happened.")
    out, pre = gen(warm, branch)
    assert pre.cached == kept and out == gen(cold, branch)[0]


def test_an_attention_model_trims_to_any_shared_prefix(setups):
    warm = Session(setups["llama"], 16, prompt_cache=PromptCache())
    gen(warm, PROMPT)
    out, pre = gen(warm, PROMPT[:23] + MORE)
    assert pre.cached == 23 and out == gen(Session(setups["llama"], 16), PROMPT[:23] + MORE)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_resumed_cache_is_the_saved_one_bit_for_bit_and_never_written_through(setups, family):
    model = setups[family].target.model
    cache = ModelCache(model)
    cache.prefill(PROMPT[:-1], 16, stops=[20])
    saved = SavedCache.of(cache)
    for mark in cache.marks:
        saved.add(mark)
    before = [mx.array(a) for a in cache_arrays(cache)]
    lengths = [saved.length, 20]
    for n in lengths:
        resumed = saved.resume(model, n)
        direct = ModelCache(model)
        direct.prefill(PROMPT[:n], 16, sizes=cache.chunks)  # the same chunks: the same bits
        assert max_cache_diff(resumed, direct) == 0.0
        # Writing on the resumed copy leaves the saved state (and the live cache) as they were.
        resumed.feed(mx.array(MORE, dtype=mx.uint32))
        mx.eval(resumed.state_arrays())
    again = saved.resume(model, saved.length)
    assert max_cache_diff(again, cache) == 0.0
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, cache_arrays(cache)))


def test_a_saved_cache_refuses_lengths_it_cannot_resume_exactly(setups):
    model = setups["qwen3_5"].target.model
    cache = ModelCache(model)
    cache.prefill(PROMPT[:-1], 16)
    saved = SavedCache.of(cache)
    assert not saved.can_resume(10) and saved.best(40) == 0 and saved.best(len(PROMPT)) == saved.length
    with pytest.raises(ValueError):
        saved.resume(model, 10)


def test_the_prompt_cache_is_bounded_by_entries_and_bytes(setups):
    setup = setups["llama"]
    session = Session(setup, 16, prompt_cache=PromptCache(max_entries=2))
    for i in range(4):
        gen(session, [65 + i] + PROMPT, n=4)
    assert len(session.prompt_cache) == 2
    one = session.prompt_cache.nbytes // 2
    tight = Session(setup, 16, prompt_cache=PromptCache(max_entries=10, max_bytes=one + one // 2))
    for i in range(3):
        gen(tight, [65 + i] + PROMPT, n=4)
    assert len(tight.prompt_cache) == 1 and tight.prompt_cache.nbytes <= one + one // 2
    off = Session(setup, 16, prompt_cache=PromptCache(max_entries=0))
    gen(off, PROMPT, n=4)
    assert len(off.prompt_cache) == 0 and gen(off, PROMPT, n=4)[1].cached == 0


def test_an_entry_a_longer_one_extends_is_dropped(setups):
    session = Session(setups["llama"], 16, prompt_cache=PromptCache())
    first, _ = gen(session, PROMPT)
    gen(session, PROMPT + first + MORE)
    assert len(session.prompt_cache) == 1  # the second turn's entry serves everything the first did


def test_an_entry_over_the_bound_keeps_its_longest_prefix_that_fits(setups):
    setup = setups["llama"]
    short, long = Session(setup, 16, prompt_cache=PromptCache()), Session(setup, 16, prompt_cache=PromptCache())
    first, _ = gen(short, PROMPT)
    gen(long, PROMPT + first + MORE * 8, n=8)
    (a,), (b,) = short.prompt_cache._entries.values(), long.prompt_cache._entries.values()
    assert a.dominated_by(b) and a.nbytes < b.nbytes
    bound = (a.nbytes + b.nbytes) // 2
    cache = PromptCache(max_entries=10, max_bytes=bound)
    cache.insert(a)
    cache.insert(b)
    (kept,) = cache._entries.values()  # b's prefix, which extends a: a is redundant
    assert len(a.tokens) < len(kept.tokens) < len(b.tokens) and kept.tokens == b.tokens[: len(kept.tokens)]
    assert cache.nbytes == kept.nbytes <= bound
    # The longest: one token more would not fit (each leaf is cut to its length, no spare room).
    assert b.prefix(len(kept.tokens) + 1, copy=False).nbytes > bound
    assert all(leaf.keys.shape[2] == len(kept.tokens) for leaf in kept.target.layers)
    # Its caches are b's, cut: equal to caches built directly for those tokens.
    model = setup.target.model
    direct = ModelCache(model)
    direct.prefill(list(kept.tokens), 16)
    assert max_cache_diff(kept.target.resume(model, kept.target.length), direct) == 0.0
    # Over the bound by its buffers' spare room alone: kept whole, copied without it.
    compact = b.prefix(len(b.tokens), copy=False).nbytes
    assert compact < b.nbytes
    cache.max_bytes = compact
    cache.insert(b)
    (whole,) = cache._entries.values()
    assert whole is not b and whole.tokens == b.tokens and cache.nbytes == compact
    cache.max_bytes = b.nbytes
    cache.insert(b)  # as it is, now that it fits; the copy is redundant
    assert list(cache._entries.values()) == [b] and cache.nbytes == b.nbytes
    cache.max_bytes = 1
    cache.insert(b)  # not one token fits: nothing is kept, and the cache empties past its bound
    assert len(cache) == 0 and cache.nbytes == 0


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_conversation_past_the_bound_resumes_its_next_turn_from_what_fit(setups, family):
    """Before, a next turn whose entry outgrew the bound left nothing cached: every later turn prefilled all."""
    setup = setups[family]
    probe = Session(setup, 16, prompt_cache=PromptCache())
    first, _ = gen(probe, PROMPT, boundaries=(len(PROMPT) - 1,))
    whole = next(iter(probe.prompt_cache._entries.values())).nbytes
    # Room for the first turn's entry, not for the next turns'.
    warm = Session(setup, 16, prompt_cache=PromptCache(max_bytes=whole))
    cold = Session(setup, 16)
    first, _ = gen(warm, PROMPT, boundaries=(len(PROMPT) - 1,))
    ended = held(PROMPT, first)
    second = PROMPT + first + MORE * 4
    answer, pre = gen(warm, second, boundaries=(len(PROMPT) + len(first) - 1,))
    assert pre.cached > 0 and answer == gen(cold, second)[0]
    (entry,) = warm.prompt_cache._entries.values()
    assert 0 < entry.target.length < held(second, answer) and warm.prompt_cache.nbytes <= whole
    third = second + answer + MORE
    out, pre = gen(warm, third)
    assert pre.cached == entry.target.length and out == gen(cold, third)[0]
    if family == "qwen3_5":  # a recurrent state resumes only at a checkpoint: a boundary, a prompt's or a turn's end
        assert pre.cached in (len(PROMPT) - 1, len(PROMPT) + len(first) - 1, len(second) - 1, ended)


def test_a_draft_model_resumes_its_own_caches(dirs):
    setup = load_setup(ModelOptions(model=str(dirs["llama"]), draft_model=str(dirs["llama-draft"]),
                                    dtype="float32"), "model")
    warm, cold = Session(setup, 4, prompt_cache=PromptCache()), Session(setup, 4)
    first, _ = gen(warm, PROMPT)
    second = PROMPT + first + MORE
    entry = next(iter(warm.prompt_cache._entries.values()))
    assert entry.draft is not None and entry.draft.length > len(PROMPT)
    out, pre = gen(warm, second)
    assert out == gen(cold, second)[0] and pre.cached > len(PROMPT)


def test_a_drafter_reading_hidden_states_gets_them_for_the_cached_tokens(tmp_path):
    path = hf_checkpoint(tmp_path / "mtp", "qwen3_5", fitted_head("qwen3_5"))
    setup = load_setup(ModelOptions(model=str(path), dtype="float32"), "mtp")
    warm, cold = Session(setup, 4, prompt_cache=PromptCache()), Session(setup, 4)
    first, _ = gen(warm, PROMPT)
    kept = held(PROMPT, first)
    entry = next(iter(warm.prompt_cache._entries.values()))
    assert entry.hidden is not None and entry.hidden.length == entry.target.length == kept
    second = PROMPT + first + MORE
    out, pre = gen(warm, second)
    ref, _ = gen(cold, second)
    assert out == ref and pre.cached == kept


def test_a_cancelled_prefill_keeps_what_it_fed_and_the_next_request_resumes_it(setups):
    setup = setups["qwen3_5"]
    setup.options.prefill_step_size = 32  # before the session: it reads its options once
    session = Session(setup, 16, prompt_cache=PromptCache(), prefill_seconds=None)
    calls = []

    def cancelled() -> bool:
        calls.append(1)
        return len(calls) >= 2  # after the second chunk

    long = PROMPT * 4
    try:
        with pytest.raises(Cancelled):
            for _ in session.generate(Request(long, 8), cancelled=cancelled):
                pass
        entry = next(iter(session.prompt_cache._entries.values()))
        assert entry.target.length == 64 and tuple(long[:64]) == entry.tokens
        out, pre = gen(session, long, n=8)
    finally:
        setup.options.prefill_step_size = 2048
    assert pre.cached == 64 and out == gen(Session(setup, 16), long, n=8)[0]


# --- replies as text ------------------------------------------------------------------

def _stream_text(tokenizer, text: str, stop, chat=False) -> tuple[str, bool]:
    stream = TextStream(tokenizer, stop, chat=chat)
    out = ""
    for t in tokenizer.encode(text):
        out += stream.add([t]).content
        if stream.stopped:
            break
    return out + stream.finish().content, stream.stopped


def test_stop_strings_are_cut_never_emitted_even_across_tokens(setups):
    tok = setups["llama"].tokenizer
    assert _stream_text(tok, "one two three four", ["three"]) == ("one two ", True)
    assert _stream_text(tok, "one two three four", ["thr", "two"]) == ("one ", True)
    assert _stream_text(tok, "one two thirty", ["three"]) == ("one two thirty", False)  # held back, then freed
    # Held-back text is never shown early: each piece is safe.
    stream, shown = TextStream(tok, ["STOP"]), []
    for t in tok.encode("abc STO and STOP"):
        shown.append(stream.add([t]).content)
    assert "".join(shown) == "abc STO and " and stream.stopped
    assert all("STO" not in "".join(shown[: i + 1]) or i >= 7 for i in range(len(shown)))


def test_a_reply_ends_at_a_stop_string_with_finish_reason_stop(setups):
    setup = setups["llama"]
    session = Session(setup, 16)
    full = Reply(session, Request(PROMPT, 40), TextStream(setup.tokenizer))
    text = "".join(p.content for p in full)
    stop = text[10:14]
    cut = Reply(session, Request(PROMPT, 40), TextStream(setup.tokenizer, [stop]))
    assert "".join(p.content for p in cut) == text[: text.index(stop)]
    assert cut.finish_reason == "stop" and full.finish_reason == "length"
    assert cut.stats.generated < full.stats.generated


def test_a_cancel_asked_stops_the_reply_after_a_block_that_made_no_text(setups):
    # Chat's first Ctrl-C: it was seen only after a block that made text, so blocks whose text was held back
    # (a stop string's start, half a character) ran on to the token limit.
    class Silent(TextStream):
        def add(self, tokens):
            super().add(tokens)
            return Piece()

    setup = setups["llama"]
    reply = Reply(Session(setup, 4), Request(PROMPT, 40), Silent(setup.tokenizer),
                  cancelled=lambda: reply.stats.blocks > 0)  # asked once the first block is in
    list(reply)
    assert 0 < reply.stats.generated <= 4  # the first block, at most its block size


def _decoded(tokenizer, tokens) -> str:
    detok = tokenizer.detokenizer
    for t in tokens:
        detok.add_token(t)
    detok.finalize()
    return detok.text


@pytest.mark.parametrize("block_size", [1, None], ids=["plain", "speculative"])
def test_a_stop_string_ends_the_answer_at_the_token_that_completed_it(setups, block_size):
    """Usage and log-probabilities count the tokens up to the one that completed the stop string, as plain
    decoding meets it, whatever the block that committed it held after it."""
    setup = setups["llama"]
    tok = setup.tokenizer
    session = Session(setup, 16)
    prompt = list(b"Tell me about the fox and the dog.")
    full = Reply(session, Request(prompt, 60), TextStream(tok))
    text = "".join(p.content for p in full)
    # Stops of five characters of the answer (their first match; never a partial byte's): some reach into a repeat,
    # which lookup drafts, so the block that completes them runs past.
    stops = [text[i : i + 5] for i in range(8, len(text) - 5)
             if text.index(text[i : i + 5]) == i and "\ufffd" not in text[i : i + 5]][:8]
    past = 0
    for stop in stops:
        n = next(n for n in range(len(full.tokens) + 1) if stop in _decoded(tok, full.tokens[:n]))
        cut = Reply(session, Request(prompt, 60, block_size=block_size, logprobs=0), TextStream(tok, [stop]))
        pieces = list(cut)
        assert "".join(p.content for p in pieces) == text[: text.index(stop)]
        assert cut.tokens == full.tokens[:n] and cut.stats.generated == n
        assert sum(len(p.logprobs or []) for p in pieces) == n
        assert cut.committed[:n] == cut.tokens
        past += len(cut.committed) > n  # the block that completed it committed more: not the answer's
    assert len(stops) >= 3 and (past > 0) == (block_size is None)


def test_an_answer_a_stop_string_cut_is_replayed_over_its_own_blocks_only():
    from specdec_cli.core.blocks import Block
    from specdec_cli.session.alone import _answer_blocks

    def block(tokens, finish=None):
        return Block(tuple(tokens), len(tokens), len(tokens) - 1, "trim", 1, finish)

    trace = [block([1, 2, 3]), block([4, 5, 6], "stop")]
    assert [(b.tokens, b.finish_reason) for b in _answer_blocks(trace, 5)] == [((1, 2, 3), None), ((4, 5), None)]
    # Completed at the last token before an EOS: the EOS is not the answer's.
    assert [(b.tokens, b.finish_reason) for b in _answer_blocks(trace, 6)] == [((1, 2, 3), None), ((4, 5, 6), None)]
    # Completed in the first block, seen only with the next (the detokenizer's lag): the next is not replayed.
    assert [b.tokens for b in _answer_blocks(trace, 3)] == [(1, 2, 3)]
    assert [b.tokens for b in _answer_blocks(trace, 2)] == [(1, 2)]


def test_the_first_stop_string_completed_ends_the_text_whatever_the_tokens_given_at_once(setups):
    tok = setups["llama"].tokenizer
    ids = tok.encode("one two three four")
    # "wo" is completed first, though "two three" starts earlier: plain decoding stops at "wo".
    assert _stream_text(tok, "one two three four", ["two three", "wo"]) == ("one t", True)
    stream = TextStream(tok, ["two three", "wo"])
    assert stream.add(ids).content + stream.finish().content == "one t"
    assert stream.through == next(n for n in range(len(ids) + 1) if "wo" in _decoded(tok, ids[:n]))


def test_a_text_completion_keeps_the_leading_space_its_first_token_writes():
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from specdec_cli.model import bundled

    tok = load_tokenizer(bundled.model_dir())  # a real byte-level BPE tokenizer, whose detokenizer drops it
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    answer = tok.encode("The capital of France is Paris. And London", add_special_tokens=False)[len(prompt):]
    for step in (1, len(answer)):
        for lead, stops, want, through in ((False, (), "Paris. And London", None),
                                           (True, (), " Paris. And London", None),
                                           (True, [" Paris"], "", 1), (True, ["."], " Paris", 2),
                                           (True, ["And"], " Paris. ", 3)):
            stream, text = TextStream(tok, stops, chat=False, lead=lead), ""
            for i in range(0, len(answer), step):
                text += stream.add(answer[i : i + step]).content
            text += stream.finish().content
            assert (text, stream.through) == (want, through), (step, lead, stops)
    # However many spaces it starts with (code's indentation), and none where the model wrote none.
    for written in ("    return 1", "  two", " one", "none", "\n  x"):
        ids = tok.encode(written, add_special_tokens=False)
        for step, stops in ((1, ["never"]), (len(ids), ["never"]), (len(ids), ())):
            stream, text = TextStream(tok, stops, chat=False, lead=True), ""
            for i in range(0, len(ids), step):
                text += stream.add(ids[i : i + step]).content
            assert text + stream.finish().content == written, (written, step)


def test_tool_calls_are_split_out_and_parsed_whatever_the_pieces(tmp_path):
    tok = tools_tokenizer(tmp_path / "tok")
    text = "Let me check. " + TOOL_ANSWER + " Done."
    for step in (1, 3, 1000):  # tokens per piece: markers split over pieces, or all at once
        stream, pieces = TextStream(tok, tools=None), []
        ids = tok.encode(text, add_special_tokens=False)
        for i in range(0, len(ids), step):
            pieces.append(stream.add(ids[i : i + step]))
        pieces.append(stream.finish())
        content = "".join(p.content for p in pieces)
        calls = [c for p in pieces for c in p.tool_calls]
        assert content == "Let me check.  Done." and stream.made_tool_calls
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
            [("get_weather", '{"city": "Paris"}')]


def test_a_tool_call_that_does_not_parse_is_returned_as_text(tmp_path):
    tok = tools_tokenizer(tmp_path / "tok")
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'
    stream = TextStream(tok)
    piece = stream.add(tok.encode(broken, add_special_tokens=False))
    rest = stream.finish()
    assert (piece.content + rest.content) == broken and not stream.made_tool_calls


def test_one_row_builder_every_face_samples_alike(setups, monkeypatch):
    """Issue 41's divergence: an unseeded sampled request is keyed by a fresh seed on the terminal's
    path as on the batch and server path, so both give the text that seed gives."""
    import random

    from specdec_cli.loop.engine import Engine
    from specdec_cli.core.sampling import SamplingParams

    setup = setups["llama"]
    session = Session(setup, 8)
    sampling = SamplingParams(temp=0.9)
    monkeypatch.setattr(random, "getrandbits", lambda bits: 1234)
    alone, _ = gen(session, PROMPT, 24, sampling=sampling)
    seeded, _ = gen(session, PROMPT, 24, sampling=sampling, seed=1234)
    assert alone == seeded
    plan = session.plan(Request(PROMPT, 24, sampling=sampling))
    assert plan.sampling.seed == 1234 and plan.sampling.keyed
    opening = session.open(Request(PROMPT, 24, sampling=sampling))
    while not opening.step():
        pass
    engine = Engine(session.model)
    engine.admit(opening.row, opening.cache)
    rows: list[int] = []
    while engine.rows:
        for row, block in engine.step():
            rows += block.tokens
        for row in [r for r in engine.rows if r.finish is not None or r.room <= 0]:
            engine.remove(row)
    assert rows == seeded


def test_the_corpus_is_bounded_in_tokens_oldest_out_first():
    from specdec_cli.session import Corpus

    corpus = Corpus(20)
    corpus.add(list(range(5)))  # too short to copy from
    assert corpus.outputs() == []
    corpus.add(list(range(10)))
    corpus.add(list(range(100, 108)))
    assert corpus.outputs() == [tuple(range(10)), tuple(range(100, 108))] and corpus.tokens == 18
    corpus.add(list(range(100, 112)))  # 30 tokens: the oldest goes
    assert corpus.outputs() == [tuple(range(100, 108)), tuple(range(100, 112))] and corpus.tokens == 20
    corpus.add(list(range(200, 230)))  # longer than the bound: its last 20 tokens, alone
    assert corpus.outputs() == [tuple(range(210, 230))] and corpus.tokens == 20
    assert Corpus(0).outputs() == [] and (Corpus(0).add(list(range(50))) is None)
    with pytest.raises(ValueError):
        Corpus(-1)


def test_an_answer_that_recurs_is_drafted_from_the_corpus_and_decoded_exactly(setups):
    """The second request meets the first's answer in the corpus: far more of it is accepted, same text."""
    from specdec_cli.session import Corpus
    from specdec_cli.session.batch import BatchEnd, run_batch

    setup = setups["llama"]
    ask = list(b"Tell me about foxes.")

    def accepted(session, twice):
        texts, total = [], 0
        for _ in range(twice):
            out = []
            for event in session.generate(Request(ask, 40)):
                if isinstance(event, Step):
                    out += event.block.tokens
                    total += event.block.accepted if len(texts) else 0
            texts.append(out)
        return texts, total

    plain_texts, without = accepted(Session(setup, 16), 2)
    corpus = Corpus()
    texts, with_corpus = accepted(Session(setup, 16, corpus=corpus), 2)
    assert texts == plain_texts and texts[0] == texts[1]
    assert with_corpus >= 30 > without + 10
    # The batch and server path (an Opening, then Session.close) feeds and reads the same corpus.
    batch = Session(setup, 16, corpus=Corpus())
    rows = {}
    for event in run_batch(batch, [Request(ask, 40)], max_rows=1):
        if not isinstance(event, BatchEnd) and isinstance(event.event, Step):
            rows.setdefault(event.index, []).append(event.event.block)
    assert batch.corpus.outputs() == [tuple(texts[0])]
    again = [b for b in run_batch(batch, [Request(ask, 40)], max_rows=1)
             if not isinstance(b, BatchEnd) and isinstance(b.event, Step)]
    assert [t for b in again for t in b.event.block.tokens] == texts[0]
    assert sum(b.event.block.accepted for b in again) >= 30


def test_the_prefill_time_leaves_out_the_rollback_measurement(setups, monkeypatch):
    """``Prefilled.seconds`` is the prompt's time (fetch, chunks, the drafter's prefill); auto's rollback
    measurement after it is reported apart (``RollbackChoice.seconds``), for every face alike."""
    import specdec_cli.loop.opening as opening

    clock = {"skew": 0.0}
    real_clock, real_choose = opening.time.perf_counter, opening.choose_rollback

    def measured(*args, **kwargs):
        clock["skew"] += 1000.0  # the measurement "takes" 1000 s on the module's clock
        return real_choose(*args, **kwargs)

    monkeypatch.setattr(opening.time, "perf_counter", lambda: real_clock() + clock["skew"])
    monkeypatch.setattr(opening, "choose_rollback", measured)
    _, prefilled = gen(Session(setups["qwen3_5"], 4), PROMPT, 4)
    assert clock["skew"] == 1000.0 and prefilled.rollback is not None  # measured once, for this run
    assert prefilled.seconds < 1000.0
