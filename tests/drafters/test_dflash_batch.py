"""DFlash drafters drafting several rows in one forward (``DFlashBatch``).

Each row drafts what it drafts alone: rows of different context lengths, different
draft lengths (one drafting nothing), waiting target rows of different counts, for
bidirectional and causal-sliding drafters, block after block; ``cancel`` moves only
its own row; a row that leaves has the context it would have alone; ``--draft-p-min``
cuts each row as alone, in one host sync for the batch.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from test_dflash import ATTENTION, features, parts_of, rows

from specdec_cli.drafters.dflash import DFlashDrafter
from specdec_cli.drafters.dflash_batch import DFlashBatch
from specdec_cli.drafters.dflash_io import load_dflash
from specdec_cli.core.sampling import GREEDY
from specdec_cli.session.synthetic import TINY_CONFIGS, dflash_config, save_dflash_dir

PROMPTS = (13, 5, 9, 0)  # each row's prompt rows (the last: a one-token prompt, an empty context)
# Per block: each row's (target rows handed over with its accept, drafts asked for).
BLOCKS = [((0, 7), (0, 3), (0, 0), (0, 4)), ((3, 7), (1, 5), (0, 6), (1, 7)), ((1, 2), (4, 7), (2, 7), (3, 0)),
          ((2, 7), (1, 0), (1, 4), (2, 5))]


def drafter_model(tmp_path, attention: str, block_size: int = 8):
    cfg = dflash_config(TINY_CONFIGS["qwen3"], block_size=block_size, **ATTENTION[attention])
    return load_dflash(str(save_dflash_dir(tmp_path / attention, cfg, seed=2))).model


def pairs(model, p_min: float = 0.0):
    """Each prompt's row twice: a drafter that joins the batch and one that drafts alone, equally fed."""
    parts = parts_of("qwen3")
    layers = len(model.config.target_layer_ids)
    out = []
    for i, n in enumerate(PROMPTS):
        feats = features(64, layers * parts.hidden_size, seed=10 + i)
        twins = [DFlashDrafter(model, parts, p_min=p_min) for _ in range(2)]
        for d in twins:
            d.prefill(list(range(n)), 4, rows(feats, 0, n, layers))
        out.append((twins, feats, n))
    return out


@pytest.mark.parametrize("attention", list(ATTENTION))
def test_each_row_drafts_what_it_drafts_alone_block_after_block(attention, tmp_path):
    model = drafter_model(tmp_path, attention)
    layers = len(model.config.target_layer_ids)
    rowset = pairs(model)
    batch = DFlashBatch(model)
    for (twins, _, _) in rowset:
        batch.join(twins[0])
    pos = [n for _, _, n in rowset]
    for step, asks in enumerate(BLOCKS):
        for i, ((joined, alone), feats, _) in enumerate(rowset):
            m = asks[i][0]
            if m:
                for d in (joined, alone):
                    d.accept(m - 1, rows(feats, pos[i], pos[i] + m, layers))
                pos[i] += m
        lasts = [mx.array([20 + step + i], dtype=mx.uint32) for i in range(len(rowset))]
        got = batch.propose([(twins[0], last, k, GREEDY) for (twins, _, _), last, (_, k) in
                             zip(rowset, lasts, asks)])
        for i, ((joined, alone), _, _) in enumerate(rowset):
            want = alone.propose(int(lasts[i].item()), asks[i][1])
            assert got[i].tokens.tolist() == want.tokens.tolist(), (step, i)
            assert joined.context_length == alone.context_length, (step, i)
    # One row's propose undone: only its row moves back (its waiting rows pending again).
    (joined, alone), _, _ = rowset[2]
    others = [twins[0].context_length for twins, _, _ in rowset]
    joined.cancel()
    alone.cancel()
    assert joined.context_length == alone.context_length < others[2]
    assert [twins[0].context_length for twins, _, _ in rowset[:2]] == others[:2]
    # Rows that leave (one that drafted last, one that did not) draft alone from the context they have.
    for i in (2, 1):
        (joined, alone), _, _ = rowset[i]
        batch.leave(joined)
        assert joined.batch is None and joined not in batch.members
        assert joined.propose(7, 7).tokens.tolist() == alone.propose(7, 7).tokens.tolist()
        for a, b in zip(joined.cache, alone.cache):
            n = a.offset
            assert n == b.offset and mx.allclose(a.keys[..., :n, :], b.keys[..., :n, :], atol=1e-5).item()
    assert len(batch.members) == 2


def test_a_member_cannot_draft_on_its_own_and_the_batch_drafts_for_all(tmp_path):
    model = drafter_model(tmp_path, "bidirectional")
    (a, _), _, _ = pairs(model)[0]
    (b, _), _, _ = pairs(model)[1]
    batch = DFlashBatch(model)
    assert DFlashBatch.fits(a)
    batch.join(a)
    batch.join(b)
    assert not DFlashBatch.fits(a)
    with pytest.raises(RuntimeError, match="drafts in its batch"):
        a.propose(3, 4)
    with pytest.raises(ValueError, match="all its members"):
        batch.propose([(a, 3, 4, GREEDY)])


def test_p_min_cuts_each_row_as_alone_in_one_sync_for_the_batch(tmp_path):
    model = drafter_model(tmp_path, "causal-sliding")
    probe = pairs(model)
    # A threshold that some slots of some rows pass and others fail.
    tops = []
    for (_, alone), _, _ in probe:
        logits = alone.block_logits(3, 7)
        tops += mx.softmax(logits, axis=-1).max(-1).tolist()
    threshold = sorted(tops)[len(tops) // 2]
    rowset = pairs(model, p_min=threshold)
    batch = DFlashBatch(model)
    for (joined, _), _, _ in rowset:
        batch.join(joined)
    got = batch.propose([(joined, 3, 7, GREEDY) for (joined, _), _, _ in rowset])
    sizes = []
    for draft, ((_, alone), _, _) in zip(got, rowset):
        want = alone.propose(3, 7)
        assert draft.tokens.tolist() == want.tokens.tolist()
        sizes.append(draft.size)
    assert len(set(sizes)) > 1  # the cut differs between rows
    assert sum(d.syncs for d in got) == 1


def test_a_drafter_whose_rope_takes_one_offset_drafts_alone(tmp_path):
    # "dynamic" NTK scaling derives its base from the offset: rows of several lengths cannot share a call,
    # so the engine leaves each row's drafter to draft alone (DFlashBatch.problem says why).
    plain = drafter_model(tmp_path, "bidirectional")
    (d, _), _, _ = pairs(plain)[0]
    assert DFlashBatch.problem(d) is None
    cfg = dflash_config(TINY_CONFIGS["qwen3"], block_size=8, layers=2,
                        rope={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    dynamic = load_dflash(str(save_dflash_dir(tmp_path / "dynamic", cfg, seed=2))).model
    (d, _), _, _ = pairs(dynamic)[0]
    assert "DynamicNTKScalingRoPE" in DFlashBatch.problem(d)
