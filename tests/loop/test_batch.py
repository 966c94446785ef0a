"""Several rows in one engine: each row's text is what its prompt gives alone, whatever shares the batch.

On this CPU with MLX's bundled BLAS a batched forward gives each row the bits
of that row's own forward (``kernels_agree``), so every comparison here is bit
for bit: tokens, and the caches a row leaves with against caches built
directly from its tokens. Rows differ in prompt length, drafter, draft length
and rollback; rows join mid-run, leave mid-run, and end on EOS and on their
token budget in the same block.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import (DTYPES, FAMILIES, assert_alone_or_tie, assert_cache_built_by, kernels_agree,
                     noisy_drafter, prefilled, rounding_of, target)

from specdec_cli.core.adaptive import FixedLength, MatchLength
from specdec_cli.cache.batch_cache import BatchCache
from specdec_cli.cache.batch_check import relative
from specdec_cli.cache.caches import ModelCache
from specdec_cli.drafters import ModelDrafter, NgramDrafter, SuffixDrafter
from specdec_cli.loop.engine import Engine, Row
from specdec_cli.loop.plain import plain_generate_step
from specdec_cli.core.sampling import SamplingParams

FAMILY_DTYPES = [(f, d) for f in FAMILIES for d in DTYPES]
# Prompts of different lengths; two repeat themselves, so lookup drafts get accepted.
PROMPTS = [
    list(b"The quick brown fox jumps over the lazy dog, twice: the quick brown fox."),
    list(b"abc abc abc abc abc"),
    list(b"Hello"),
    list(b"one two three four five six seven eight nine ten; one two three four"),
]
GEN = 24


def plain_tokens(model, prompt, max_tokens=GEN, eos=(), sampling=SamplingParams()) -> tuple[list[int], ModelCache]:
    cache = prefilled(model, prompt)
    out = [t for b in plain_generate_step(prompt[-1], cache, max_tokens=max_tokens, eos_ids=eos, sampling=sampling)
           for t in b.tokens]
    return out, cache


def drafter_for(kind: str, family: str, dtype: str, prompt):
    if kind == "model":
        d = ModelDrafter(noisy_drafter(family, dtype))
    elif kind == "ngram":
        d = NgramDrafter()
    else:
        d = SuffixDrafter()
    d.prefill(prompt[:-1])
    return d


def run_batch(model, rows: list[dict], join_at: dict[int, int] = (), leave_at: dict[int, int] = (), watch=None):
    """Decode rows together; ``join_at[i]``: row i joins after that many blocks; ``leave_at[i]``: it leaves then.

    Returns each row's tokens, and the caches each left with.
    """
    join_at, leave_at = dict(join_at), dict(leave_at)
    engine = Engine(model, rollback="capture")
    made, out, caches, step = {}, {}, {}, 0

    def admit(i):
        spec = rows[i]
        prompt = spec["prompt"]
        row = Row(prompt[-1], spec.get("drafter"), spec.get("policy", FixedLength(spec.get("k", 3))),
                  spec.get("sampling", SamplingParams()), frozenset(spec.get("eos", ())), spec.get("max", GEN), tag=i)
        made[i] = spec["row"] = engine.admit(row, prefilled(model, prompt))
        out[i] = []

    for i in range(len(rows)):
        if join_at.get(i, 0) == 0:
            admit(i)
    while engine.rows or len(made) < len(rows):
        for i in range(len(rows)):
            if i not in made and join_at.get(i, 0) <= step:
                admit(i)
        seen = watch() if watch else None
        for row, block in engine.step():
            out[row.tag] += block.tokens
        if watch:
            watch(len(engine.rows), seen)
        step += 1
        for row in list(engine.rows):
            if row.finish is not None or row.room <= 0 or leave_at.get(row.tag) == step:
                caches[row.tag] = engine.remove(row)
    return [out[i] for i in range(len(rows))], [caches[i] for i in range(len(rows))]


def _four_mixed_rows(family: str, dtype: str) -> None:
    """Rows of different lengths, drafters and draft lengths, one batch: each row's text is plain decoding's
    (or, where rows round apart, parts from it at a rounding tie), its caches those its tokens build."""
    model = target(family, dtype)
    kinds, ks = ["model", "lookup", "ngram", "model"], [3, 5, 2, 1]
    rows = [{"prompt": p, "drafter": drafter_for(kind, family, dtype, p), "k": k}
            for p, kind, k in zip(PROMPTS, kinds, ks)]
    got, caches = run_batch(model, rows)
    for p, out, cache in zip(PROMPTS, got, caches):
        ref, _ = plain_tokens(model, p)
        assert_alone_or_tie(model, dtype, out, ref, p)  # bit for bit where the kernels agree
        assert_cache_built_by(model, p, out, cache, dtype)


@pytest.mark.parametrize("family,dtype", FAMILY_DTYPES)
def test_each_row_equals_its_prompt_alone(family, dtype):
    _four_mixed_rows(family, dtype)


@pytest.mark.parametrize("family,dtype", FAMILY_DTYPES)
def test_each_row_equals_its_prompt_alone_or_ties_on_a_gpu_like_backend(family, dtype, gpu_like):
    """Where a batched row rounds otherwise than the row alone (the GPU-like backend), each row's text is
    plain decoding's, or parts from it at a rounding tie (the promise of docs/EXACTNESS.md)."""
    assert rounding_of(target(family, dtype)).ok and rounding_of(target(family, dtype)).batched > 0
    _four_mixed_rows(family, dtype)


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_join_and_leave_mid_run(family):
    dtype = "float32"
    model = target(family, dtype)
    rows = [{"prompt": p, "drafter": drafter_for("model", family, dtype, p), "k": k}
            for p, k in zip(PROMPTS, [4, 2, 3, 1])]
    # Row 2 joins after 3 blocks, row 3 after 5; row 1 is cancelled after 4 blocks.
    got, caches = run_batch(model, rows, join_at={2: 3, 3: 5}, leave_at={1: 4})
    for i, (p, out, cache) in enumerate(zip(PROMPTS, got, caches)):
        ref, _ = plain_tokens(model, p)
        if i == 1:  # cut short, each token still plain's
            assert 0 < len(out) < GEN
            ref = ref[: len(out)]
        assert_alone_or_tie(model, dtype, out, ref, p)
        assert_cache_built_by(model, p, out, cache, dtype)


def count_forwards(monkeypatch, model) -> list[int]:
    """Notes the row count of every forward of ``model`` through a one-row or a batch cache."""
    rows: list[int] = []
    solo, batch = ModelCache._forward, BatchCache.feed

    def solo_forward(self, tokens, mode):
        if self.model is model:
            rows.append(1)
        return solo(self, tokens, mode)

    def batch_feed(self, tokens, record=None):
        if self.model is model:
            rows.append(tokens.shape[0])
        return batch(self, tokens, record)

    monkeypatch.setattr(ModelCache, "_forward", solo_forward)
    monkeypatch.setattr(BatchCache, "feed", batch_feed)
    return rows


@pytest.mark.parametrize("family,dtype,p_min", [(f, d, 0.0) for f, d in FAMILY_DTYPES] +
                         [(f, "float32", 0.6) for f in FAMILIES])
def test_rows_sharing_a_draft_model_draft_in_one_forward_and_as_they_would_alone(family, dtype, p_min,
                                                                                    monkeypatch):
    """One draft model for four rows (one joins late): each draft step is one forward of every row, each
    row's text is plain decoding's, its drafts are the ones it makes alone (with ``--draft-p-min`` too:
    each row stops where it stops alone), and its drafter's cache, back on its own, is a directly built
    one."""
    model = target(family, dtype)
    draft = noisy_drafter(family, dtype)
    ks = [3, 5, 2, 1]

    def rows(p_min=p_min):
        out = []
        for p, k in zip(PROMPTS, ks):
            d = ModelDrafter(draft, p_min=p_min)
            d.prefill(p[:-1])
            out.append({"prompt": p, "drafter": d, "k": k})
        return out

    alone = [rows()[i] for i in range(len(PROMPTS))]
    for spec in alone:
        run_batch(model, [spec])
    forwards = count_forwards(monkeypatch, draft)
    together = rows()
    steps = []

    def watch(rows=None, seen=None):
        if rows is None:
            return len(forwards)
        steps.append((rows, forwards[seen:]))

    got, _ = run_batch(model, together, join_at={3: 2}, watch=watch)
    # While rows share the batch, each draft step is one forward of all of them.
    shared = [(n, forwards) for n, forwards in steps if n > 1]
    assert {n for n, _ in shared} >= {3, 4}
    assert all(f and set(f) == {n} and len(f) <= max(ks) for n, f in shared), shared
    for p, out, a, t in zip(PROMPTS, got, alone, together):
        assert_alone_or_tie(model, dtype, out, plain_tokens(model, p)[0], p)
        d = t["drafter"]
        assert d.batch is None and d.cache is not None
        assert_cache_built_by(draft, p, out, d.cache, dtype, drafter=True)
        if kernels_agree(dtype):
            # The batched draft forward gives each row the tokens its own forward gives: the same accepts.
            assert (t["row"].drafted, t["row"].accepted) == (a["row"].drafted, a["row"].accepted)
    if p_min:
        # p-min cut drafts short (or the comparison above could not tell it was applied).
        unlimited = rows(0.0)
        for spec in unlimited:
            run_batch(model, [spec])
        assert sum(t["row"].drafted for t in together) < sum(u["row"].drafted for u in unlimited)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("at", [2, 5])
def test_an_interrupt_inside_a_batched_draft_leaves_every_row_as_it_was(family, at, monkeypatch):
    """Ctrl-C in a draft forward of several rows (the first step, or a later one): every row and drafter back
    to its state before the block; going on gives plain decoding's text and directly built drafter caches."""
    model, draft = target(family, "float32"), noisy_drafter(family, "float32")
    forwards = count_forwards(monkeypatch, draft)
    feed = BatchCache.feed
    fired = []

    def interrupted(self, tokens, record=None):
        if self.model is draft and len(forwards) == at and not fired:
            fired.append(True)
            raise KeyboardInterrupt
        return feed(self, tokens, record)

    monkeypatch.setattr(BatchCache, "feed", interrupted)
    engine = Engine(model, rollback="capture")
    rows, drafters = [], []
    for p, k in zip(PROMPTS[:3], [4, 2, 3]):
        d = ModelDrafter(draft)
        d.prefill(p[:-1])
        drafters.append(d)
        rows.append(engine.admit(Row(p[-1], d, FixedLength(k), max_tokens=GEN, tag=p), prefilled(model, p)))
    out = {id(r): [] for r in rows}
    forwards.clear()  # count from the first block
    while engine.rows:
        try:
            for r, b in engine.step():
                out[id(r)] += b.tokens
        except KeyboardInterrupt:
            continue  # the same block again
        for r in [r for r in engine.rows if r.finish is not None or r.room <= 0]:
            engine.remove(r)
    assert fired
    for r, d in zip(rows, drafters):
        p = r.tag
        assert_alone_or_tie(model, "float32", out[id(r)], plain_tokens(model, p)[0], p)
        assert_cache_built_by(draft, p, out[id(r)], d.cache, "float32", drafter=True)


def test_an_interrupt_in_one_draft_models_group_leaves_the_others_rows_as_they_were(monkeypatch):
    """Two draft models, two groups: Ctrl-C in the second group's forward, before the first's rows were
    verified, leaves every row (those whose group had not drafted yet too) as it was."""
    model = target("llama", "float32")
    first, second = noisy_drafter("llama", "float32"), noisy_drafter("qwen3", "float32")
    forwards = count_forwards(monkeypatch, second)
    feed = BatchCache.feed
    fired, armed = [], []  # armed once the rows are in (admitting probes the draft models)

    def interrupted(self, tokens, record=None):
        if self.model is second and armed and len(forwards) == 4 and not fired:
            fired.append(True)
            raise KeyboardInterrupt
        return feed(self, tokens, record)

    monkeypatch.setattr(BatchCache, "feed", interrupted)
    rows = [{"prompt": p, "drafter": ModelDrafter(m), "k": k}
            for p, m, k in zip(PROMPTS, [second, first, second, first], [3, 2, 4, 3])]
    for r in rows:
        r["drafter"].prefill(r["prompt"][:-1])
    engine = Engine(model, rollback="capture")
    live = [engine.admit(Row(r["prompt"][-1], r["drafter"], FixedLength(r["k"]), max_tokens=GEN, tag=i),
                         prefilled(model, r["prompt"])) for i, r in enumerate(rows)]
    forwards.clear()
    armed.append(True)
    out = {r.tag: [] for r in live}
    while engine.rows:
        try:
            for r, b in engine.step():
                out[r.tag] += b.tokens
        except KeyboardInterrupt:
            continue
        for r in [r for r in engine.rows if r.finish is not None or r.room <= 0]:
            engine.remove(r)
    assert fired
    for i, r in enumerate(rows):
        p, d = r["prompt"], r["drafter"]
        assert_alone_or_tie(model, "float32", out[i], plain_tokens(model, p)[0], p)
        assert_cache_built_by(d.cache.model, p, out[i], d.cache, "float32", drafter=True)


def test_a_draft_model_that_cannot_draft_rows_together_drafts_each_alone(monkeypatch):
    from specdec_cli.drafters.model_batch import DraftBatch

    monkeypatch.setattr(DraftBatch, "problem", staticmethod(lambda drafter: "its forward fails on rows"))
    model, draft = target("llama", "float32"), noisy_drafter("llama", "float32")
    forwards = count_forwards(monkeypatch, draft)
    rows = []
    for p, k in zip(PROMPTS, [3, 2]):
        d = ModelDrafter(draft)
        d.prefill(p[:-1])
        rows.append({"prompt": p, "drafter": d, "k": k})
    forwards.clear()
    got, _ = run_batch(model, rows)
    assert set(forwards) == {1}
    assert got == [plain_tokens(model, r["prompt"])[0] for r in rows]


def test_a_recurrent_draft_model_with_no_state_yet_and_a_row_drafting_nothing():
    """One-token prompts: the draft model's recurrent states are not made yet when the rows first draft."""
    model, draft = target("qwen3_5", "float32"), noisy_drafter("qwen3_5", "float32")
    prompts = [[5], [7], [9]]
    rows = [{"prompt": p, "drafter": ModelDrafter(draft), "k": k} for p, k in zip(prompts, [2, 0, 3])]
    got, _ = run_batch(model, rows)
    assert got == [plain_tokens(model, p)[0] for p in prompts]


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_end_on_eos_and_on_their_budget_in_the_same_block(family):
    dtype = "float32"
    model = target(family, dtype)
    full = [plain_tokens(model, p)[0] for p in PROMPTS[:2]]
    # Row 0 stops at the first occurrence of its 10th token; row 1 after 10 tokens: both in early blocks.
    eos = full[0][9]
    rows = [{"prompt": PROMPTS[0], "drafter": ModelDrafter(model), "k": 4, "eos": [eos]},
            {"prompt": PROMPTS[1], "drafter": ModelDrafter(model), "k": 4, "max": 10}]
    for r, p in zip(rows, PROMPTS):
        r["drafter"].prefill(p[:-1])
    got, caches = run_batch(model, rows)
    assert got[0] == plain_tokens(model, PROMPTS[0], eos=[eos])[0] and eos not in got[0]
    assert got[1] == full[1][:10]
    # The drafter equal to the target accepts everything: both rows end inside one multi-token block.
    assert len(got[0]) < 10 and len(got[1]) == 10
    assert_cache_built_by(model, PROMPTS[1], got[1], caches[1], dtype)
    ended = got[0] + [eos]
    assert_cache_built_by(model, PROMPTS[0], ended, caches[0], dtype)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_seeded_sampling_of_a_row_does_not_depend_on_the_batch(family):
    model = target(family, "float32")
    sampling = SamplingParams(temp=0.9, top_p=0.95, seed=1234)
    ref, _ = plain_tokens(model, PROMPTS[0], sampling=sampling)
    alone, _ = run_batch(model, [{"prompt": PROMPTS[0], "drafter": drafter_for("model", family, "float32",
                                                                                 PROMPTS[0]), "sampling": sampling}])
    others = [{"prompt": p, "drafter": drafter_for("lookup", family, "float32", p),
               "sampling": SamplingParams(temp=0.7, seed=s)} for p, s in zip(PROMPTS[1:], (1, 2, 3))]
    together, _ = run_batch(model, [{"prompt": PROMPTS[0], "drafter": drafter_for("model", family, "float32",
                                                                                    PROMPTS[0]),
                                     "sampling": sampling}] + others)
    assert alone[0] == together[0] == ref


def test_a_batch_of_one_is_a_single_rows_cache():
    """One row runs on its own ModelCache (every rollback strategy); the batch cache appears with a second."""
    model = target("qwen3_5", "float32")
    engine = Engine(model, rollback="carry")
    a = engine.admit(Row(PROMPTS[0][-1], drafter_for("lookup", "qwen3_5", "float32", PROMPTS[0]),
                         MatchLength(k_max=7), max_tokens=GEN), prefilled(model, PROMPTS[0]))
    assert engine._batch is None and isinstance(engine._solo, ModelCache)
    engine.step()
    b = engine.admit(Row(PROMPTS[1][-1], drafter_for("lookup", "qwen3_5", "float32", PROMPTS[1]),
                         MatchLength(k_max=7), max_tokens=GEN), prefilled(model, PROMPTS[1]))
    assert isinstance(engine._batch, BatchCache) and engine._batch.rows == 2 and not a.carry.shape[0]
    engine.step()
    engine.remove(b)
    assert engine._batch is None and isinstance(engine._solo, ModelCache)
    out = []
    while a.finish is None and a.room > 0:
        out += engine.step()[0][1].tokens
    engine.remove(a)


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_merged_and_taken_out_equal_their_own_caches(family):
    """BatchCache round trip: rows of different lengths (one empty) in, a padded verify, each kept at its own count."""
    model = target(family, "float32")
    prompts = [PROMPTS[0], PROMPTS[2], [PROMPTS[3][0]]]  # the last row has nothing prefilled
    conts = [[7, 8, 9, 10], [3, 4], [11, 12, 13, 14, 15, 16]]
    keeps = [2, 2, 6]
    batch = BatchCache(model, prefilled(model, prompts[0]))
    for p in prompts[1:]:
        batch.add(prefilled(model, p))
    width = max(map(len, conts))
    x = mx.array([[p[-1]] + c[:-1] + [0] * (width - len(c)) for p, c in zip(prompts, conts)], dtype=mx.uint32)
    snap = batch.snapshot()
    logits = batch.feed(x, record="capture" if batch.recurrent else None)
    for b, (p, c) in enumerate(zip(prompts, conts)):
        alone = prefilled(model, p)
        want = alone.feed(mx.array([p[-1]] + c[:-1], dtype=mx.uint32))
        if kernels_agree("float32"):
            assert mx.array_equal(logits[b, : len(c)], want).item()
        else:  # the batch's shapes round otherwise: within the backend's measured rounding
            assert relative(logits[b, : len(c)], want) <= rounding_of(model).tolerance
    batch.settle(snap, keeps)
    for b, (p, c, k) in enumerate(zip(prompts, conts, keeps)):
        assert_cache_built_by(model, p, c[:k], batch.row(b), "float32")


# --- the batch's draft width (specdec_cli/loop/batch_policy.py) ---------------------------------------------

from specdec_cli.loop.batch_policy import BatchPlanner, CostTable, knee  # noqa: E402
from specdec_cli.drafters import Draft  # noqa: E402


class _Policy:
    def __init__(self, rate):
        self.rate = rate

    def expected(self, k):
        return sum(self.rate ** i for i in range(k + 1))


class _Pending:
    def __init__(self, k, rate):
        self.row = Row(0, None, _Policy(rate))
        self.draft = Draft(mx.arange(k, dtype=mx.uint32), None, 0, tuple(range(k)))


# A CPU-like curve: 4 rows x 8 positions cost 2.1x 4 rows x 1 (ANCHORS.md's measured table, in ms).
COSTS = {(1, 1): 58, (1, 2): 67, (1, 4): 90, (1, 8): 92, (1, 16): 114,
         (4, 1): 83, (4, 2): 89, (4, 4): 116, (4, 8): 176, (4, 16): 285}


def test_the_cost_table_interpolates_between_and_beyond_what_it_measured():
    table = CostTable(COSTS)
    assert table.cost(4, 8) == 176
    assert table.cost(2, 1) == pytest.approx(58 + (83 - 58) / 3)  # between row counts
    assert table.cost(4, 6) == pytest.approx((116 + 176) / 2)  # between widths
    assert table.cost(4, 32) == pytest.approx(285 + (285 - 176) * 2)  # beyond the widest: linear
    assert table.cost(8, 1) > table.cost(4, 1)
    table.learn(4, 8, 276)
    assert 176 < table.cost(4, 8) < 276  # a block's time moves its cell
    guess = table.cost(4, 32)
    table.learn(4, 32, guess * 3)
    assert table.cost(4, 32) == guess * 3  # an estimate is replaced by what a block of that shape took


def _pending_graph(arrays) -> bool:
    """Whether any of ``arrays`` is still unevaluated (its graph has an edge)."""
    import io

    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    return "->" in dot.getvalue()


def test_the_cost_table_times_each_cell_three_times_but_a_slow_forward_once(monkeypatch):
    from specdec_cli.loop import batch_policy

    model = target("llama", "float32")
    feeds = []
    for cls in (ModelCache, BatchCache):
        def counted(self, x, *a, _feed=cls.feed, **k):
            # Timed forwards start from evaluated caches: a batch built row by row was a lazy chain of
            # concatenations that every timed forward evaluated again (32 rows read 17 tokens/s, not 167).
            assert not _pending_graph(self.state_arrays()), "a timed forward would evaluate the cache's making"
            feeds.append(tuple(x.shape))
            return _feed(self, x, *a, **k)
        monkeypatch.setattr(cls, "feed", counted)
    fresh = lambda: ModelCache(model)  # noqa: E731
    table = CostTable.measure(model, fresh, (1, 2), (1, 2), context=8, budget=float("inf"))
    assert set(table.cells) == {(1, 1), (1, 2), (2, 1), (2, 2)}
    runs = 3 + (mx.default_device() != mx.cpu)  # a GPU's first run of a shape compiles kernels: not timed
    assert sorted(feeds) == sorted([(1,)] * runs + [(2,)] * runs + [(2, 1)] * runs + [(2, 2)] * runs)
    # Every forward slower than the threshold: one timing per cell, and of each row count one wider forward only
    # (SECOND_WIDTH): a cost by width is a line through two measured points.
    feeds.clear()
    monkeypatch.setattr(batch_policy, "_SLOW_FORWARD_S", 0.0)
    table = CostTable.measure(model, fresh, (1, 2), (1, 2, 4, 8, 16), context=8, budget=float("inf"))
    assert set(table.cells) == {(1, 1), (1, 8), (2, 1), (2, 8)}
    assert sorted(feeds) == sorted([(1,), (8,), (2, 1), (2, 8)] * (runs - 2))


def test_the_decode_concurrency_default_stops_where_doubling_the_rows_stops_paying():
    # A GPU-like curve (a step costs the same up to 32 rows): all 32, as mlx_lm.server.
    assert knee({1: 10, 2: 10, 4: 10, 8: 10, 16: 10, 32: 10}) == 32
    # Compute-bound from the start: each row costs as much as the first; one row at a time.
    assert knee({1: 10, 2: 20, 4: 40, 8: 80}) == 1
    # A CPU-like curve: cheap up to 4 rows, then nearly linear; 8 rows add 5%, under the 10% asked.
    assert knee({1: 58, 2: 65, 4: 83, 8: 158, 16: 316}) == 4
    assert knee({1: 58, 2: 65, 4: 83, 8: 158}, gain=0.01) == 8
    # Noise only adds time: a count that measured worse (a busy moment at 2 rows) does not end the
    # search, and a larger count that measured well is taken (4 rows: 3.3x one row's tokens/s).
    assert knee({1: 10, 2: 25, 4: 12}) == 4
    # The gain asked is per doubling: 16 rows must beat 4 by 21% (10% twice), not by 10%.
    assert knee({1: 58, 2: 65, 4: 83, 8: 158, 16: 300}) == 4
    assert knee({1: 58, 2: 65, 4: 83, 8: 158, 16: 272}) == 16
    # The start-up line of a loaded test machine that once chose 1 (tokens/s 314, 251, 502, ...).
    rates = {1: 314, 2: 251, 4: 502, 8: 928, 16: 1448, 32: 2893}
    assert knee({b: b / r for b, r in rates.items()}) == 32


def test_the_planner_drafts_nothing_when_nothing_is_accepted_and_wide_when_all_is():
    planner = BatchPlanner(lambda: CostTable(COSTS))
    cold = [_Pending(8, 0.0) for _ in range(4)]
    assert planner.trim(cold) == 1 and all(p.draft.size == 0 for p in cold)
    hot = [_Pending(8, 0.95) for _ in range(4)]
    assert planner.trim(hot) == 9 and all(p.draft.size == 8 for p in hot)
    # Half the rows copy: where wider forwards cost little (a GPU's flatter curve), a wider block is worth
    # the share of their progress it gives them, until it costs the others more.
    flat = BatchPlanner(lambda: CostTable({(b, w): b * (60 + 2 * w) for b in (1, 4) for w in (1, 2, 4, 8, 16, 32)}))
    half = [_Pending(30, 0.9) for _ in range(2)] + [_Pending(0, 0.0) for _ in range(2)]
    width = flat.trim(half)
    assert 1 < width < 31 and half[0].draft.size == width - 1 and half[0].draft.host == tuple(range(width - 1))
    # One row that copies, three that draft nothing: the three would wait for every wider block.
    one = [_Pending(16, 0.8)] + [_Pending(0, 0.0) for _ in range(3)]
    assert planner.trim(one) == 1 and one[0].draft.size == 0


def test_a_row_count_at_a_threshold_does_not_flip_the_width_every_block():
    # 4 rows are best served 4 wide, 5 rows 3 wide, by less than the margin: a request joining and leaving
    # each block would change the verify's shape each block (on a GPU, a new shape to compile each time).
    costs = {(b, w): b * 10 + w * (6 if b == 4 else 10) for b in (4, 5) for w in (1, 2, 4, 8, 16)}

    def width(planner, rows):
        return planner.trim([_Pending(8, 0.6) for _ in range(rows)])

    assert [width(BatchPlanner(lambda: CostTable(costs)), n) for n in (4, 5)] == [4, 3]  # each alone
    planner = BatchPlanner(lambda: CostTable(costs))
    assert [width(planner, n) for n in (4, 5, 4, 5, 4, 5)] == [4] * 6
    # A width past the margin still moves: nothing to draft makes it 1.
    assert planner.trim([_Pending(8, 0.0) for _ in range(4)]) == 1


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_rows_equal_their_prompts_alone_with_the_planner_cutting_drafts(family):
    model = target(family, "float32")
    # Wider forwards cost a little more (a GPU's flat curve): the width follows the drafts block by block.
    table = CostTable({(b, w): b * (1.0 + 0.05 * w) for b in (1, 2, 4) for w in (1, 2, 4, 8, 16)})
    planner = BatchPlanner(lambda: table)
    cuts = []
    trim = planner.trim

    def spy(pending):
        before = [p.draft.size for p in pending]
        width = trim(pending)
        cuts.append(sum(b > p.draft.size for b, p in zip(before, pending)))
        return width

    planner.trim = spy
    engine = Engine(model, rollback="capture", planner=planner)
    rows = []
    for p in PROMPTS:
        policy = MatchLength(k_max=15)
        drafter = SuffixDrafter(policy.size)
        drafter.prefill(p[:-1])
        rows.append(engine.admit(Row(p[-1], drafter, policy, max_tokens=GEN, tag=p), prefilled(model, p)))
    out = {id(r): [] for r in rows}
    widths = set()
    while engine.rows:
        for row, block in engine.step():
            out[id(row)] += block.tokens
            widths.add(block.verify_len)
        for row in [r for r in engine.rows if r.finish is not None or r.room <= 0]:
            engine.remove(row)
    for r in rows:
        assert_alone_or_tie(model, "float32", out[id(r)], plain_tokens(model, r.tag)[0], r.tag)
    assert len(widths) > 1 and sum(cuts) > 0  # drafts were cut, and the width changed from block to block


# --- drafters that read the target's hidden states, in a batch ------------------------------------------

def _mtp_run(model, head, parts, specs, monkeypatch=None, interrupt_at=None, p_min=0.0):
    """Rows with MTP drafters of one head (``specs``: prompt, k, joins after n blocks); returns rows, drafters,
    each row's tokens and the row counts of every head forward in blocks where rows shared the batch."""
    from specdec_cli.drafters.mtp import MTPDrafter
    from specdec_cli.model.taps import Hidden, HiddenTap

    drafters = [MTPDrafter(head, parts, p_min=p_min) for _ in specs]
    shapes, shared, fired = [], [], []
    if monkeypatch is not None:
        call = type(head).__call__

        def counted(self, embeds, hidden, cache, mask=None):
            if self is head:
                batched = sum(1 for n in shapes if n > 1)
                if embeds.shape[0] > 1 and batched == interrupt_at and not fired:
                    fired.append(True)
                    raise KeyboardInterrupt
                shapes.append(embeds.shape[0])
            return call(self, embeds, hidden, cache, mask)

        monkeypatch.setattr(type(head), "__call__", counted)
    with HiddenTap(model, drafters[0].taps) as tap:
        engine = Engine(model, rollback="capture", tap=tap)
        rows, out, step = {}, {}, 0
        while engine.rows or len(rows) < len(specs):
            for i, (p, k, join) in enumerate(specs):
                if i not in rows and join <= step:
                    cache = ModelCache(model)
                    drafters[i].prefill(p[:-1], 16, Hidden.concat(cache.prefill(p[:-1], 16, tap)))
                    rows[i] = engine.admit(Row(p[-1], drafters[i], FixedLength(k), max_tokens=GEN, tag=i), cache)
                    out[i] = []
            seen = len(shapes)
            try:
                blocks = engine.step()
            except KeyboardInterrupt:
                continue  # the same block again
            if len(engine.rows) > 1:
                shared.append((len(engine.rows), shapes[seen:]))
            for row, block in blocks:
                out[row.tag] += block.tokens
            for row in [r for r in engine.rows if r.finish is not None or r.room <= 0]:
                engine.remove(row)
            step += 1
    return [rows[i] for i in range(len(specs))], drafters, [out[i] for i in range(len(specs))], shared, fired


def _head_keys(drafter):
    c = drafter.cache[0]
    return c.keys[..., : c.offset, :], c.values[..., : c.offset, :]


@pytest.mark.parametrize("p_min", [0.0, 0.5])
def test_mtp_heads_of_one_head_draft_every_row_in_one_forward(monkeypatch, p_min):
    """Rows with MTP drafters of one head (different draft lengths, one drafting nothing, one joining late):
    each head forward carries every row, each row reads its own rows of the batched verify's hidden states,
    its text is plain decoding's, and its drafts and head cache are the ones it gets alone (with
    ``--draft-p-min`` too: each row stops where it stops alone)."""
    from mtp_fixtures import fitted_head
    from mtp_fixtures import target as mtp_target

    from specdec_cli.drafters.mtp import MTPDrafter
    from specdec_cli.model.taps import target_parts

    # A row that drafts nothing feeds its waiting pairs after 4 blocks (the batch's first forward does it).
    monkeypatch.setattr(MTPDrafter, "MAX_PENDING", 4)
    model = mtp_target("qwen3_5")
    parts, head = target_parts(model), fitted_head("qwen3_5")
    specs = [(PROMPTS[0], 3, 0), (PROMPTS[1], 5, 0), (PROMPTS[2], 0, 0), (PROMPTS[3], 2, 2)]
    rows, drafters, got, shared, _ = _mtp_run(model, head, parts, specs, monkeypatch, p_min=p_min)
    assert sum(r.accepted for r in rows) > 0
    assert {n for n, _ in shared} >= {3, 4}
    assert all(f and set(f) == {n} and len(f) <= 5 for n, f in shared), shared
    for (p, k, _), r, d, out in zip(specs, rows, drafters, got):
        assert_alone_or_tie(model, "float32", out, plain_tokens(model, p)[0], p)
        assert d.batch is None and d.cache is not None
        [alone], [own], _, _, _ = _mtp_run(model, head, parts, [(p, k, 0)], p_min=p_min)
        if kernels_agree("float32"):
            assert (r.drafted, r.accepted) == (alone.drafted, alone.accepted)
            for x, y in zip(_head_keys(d), _head_keys(own)):
                assert x.shape == y.shape and mx.array_equal(x, y).item()
    if p_min:
        # p-min cut drafts short (or the comparison above could not tell it was applied).
        unlimited, *_ = _mtp_run(model, head, parts, specs)
        assert sum(r.drafted for r in rows) < sum(r.drafted for r in unlimited)


def test_an_interrupt_inside_a_batched_mtp_draft_leaves_every_row_as_it_was(monkeypatch):
    from mtp_fixtures import fitted_head
    from mtp_fixtures import target as mtp_target

    from specdec_cli.model.taps import target_parts

    model = mtp_target("qwen3_5")
    parts, head = target_parts(model), fitted_head("qwen3_5")
    specs = [(PROMPTS[0], 3, 0), (PROMPTS[1], 4, 0), (PROMPTS[3], 2, 0)]
    rows, _, got, _, fired = _mtp_run(model, head, parts, specs, monkeypatch, interrupt_at=5)
    assert fired
    for (p, _, _), out in zip(specs, got):
        assert_alone_or_tie(model, "float32", out, plain_tokens(model, p)[0], p)


def test_a_row_count_measured_narrow_only_grows_as_its_neighbours_do():
    # The budget ran out after 4 rows x 1: wider 4-row forwards scale as 1 row's do from width 1.
    table = CostTable({(1, 1): 60, (1, 8): 90, (1, 16): 120, (4, 1): 80})
    assert table.cost(4, 8) == pytest.approx(80 * 90 / 60)
    assert table.cost(4, 16) == pytest.approx(80 * 120 / 60)
    alone = CostTable({(4, 1): 80})
    assert alone.cost(4, 8) == 80 * 8  # nothing to scale by: priced as separate forwards


def test_noise_never_makes_a_wider_or_fuller_forward_look_cheaper():
    table = CostTable({(1, 1): 60, (1, 2): 55, (4, 1): 83, (4, 2): 75})
    assert table.cost(1, 2) == 60 and table.cost(4, 1) == 83 and table.cost(4, 2) == 83
    table.learn(4, 1, 200)
    assert table.cost(4, 2) >= table.cost(4, 1)
