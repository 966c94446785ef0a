"""The cache layout, its capability check and the snapshot protocol."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import PROMPT, max_cache_diff, prefilled, target
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    CacheList,
    ConcatenateKVCache,
    KVCache,
    RotatingKVCache,
)

from specdec_cli.cache.caches import ModelCache, WindowKVCache, cache_kinds, make_cache
from specdec_cli.errors import UnsupportedModelError


class _FakeModel:
    """Only ``make_cache`` matters for the layout."""

    def __init__(self, caches):
        self._caches = caches
        self.layers = caches

    def make_cache(self):
        return self._caches


def test_sliding_layers_become_plain_kv_caches():
    layout = make_cache(target("gemma3_text", "float32"))
    assert [type(c) for c in layout] == [WindowKVCache, KVCache, WindowKVCache, KVCache]
    assert all(c.is_trimmable() for c in layout)
    assert layout[0].window == 8


def test_cache_kinds_count_hybrid_layers():
    assert cache_kinds(target("qwen3_5", "float32")) == {"attention": 2, "recurrent": 2}
    assert cache_kinds(target("llama", "float32")) == {"attention": 2, "recurrent": 0}


def test_nested_cache_lists_are_converted():
    layout = make_cache(_FakeModel([CacheList(RotatingKVCache(max_size=4), ArraysCache(2))]))
    assert isinstance(layout[0].caches[0], WindowKVCache)
    assert isinstance(layout[0].caches[1], ArraysCache)


def test_chunked_cache_keeps_every_key():
    # Stock ChunkedKVCache drops keys before each forward; a drafter rolling
    # back across forwards would lose keys its chunk still needs.
    from mlx_lm.models.cache import ChunkedKVCache

    from specdec_cli.cache.caches import ChunkKVCache

    cache = make_cache(_FakeModel([ChunkedKVCache(4)]))[0]
    assert type(cache) is ChunkKVCache and cache.chunk_size == 4
    k = mx.zeros((1, 1, 10, 2))
    cache.update_and_fetch(k, k)
    cache.maybe_trim_front()
    assert cache.start_position == 0 and cache.offset == 10
    assert cache.trim(7) == 7 and cache.offset == 3


def test_concatenate_cache_becomes_kv_cache():
    # Its trim moves the offset but keeps the tail in keys_and_values().
    assert type(make_cache(_FakeModel([ConcatenateKVCache()]))[0]) is KVCache


@pytest.mark.parametrize(
    "cache, name",
    [
        (BatchKVCache([0]), "BatchKVCache"),
        (RotatingKVCache(max_size=8, keep=4), "keep=4"),
        (CacheList(KVCache(), BatchKVCache([0])), "BatchKVCache"),
    ],
)
def test_caches_that_cannot_roll_back_are_refused_by_name(cache, name):
    with pytest.raises(UnsupportedModelError, match=name):
        make_cache(_FakeModel([KVCache(), cache]))


def test_kv_cache_subclass_from_a_model_file_is_refused():
    class Custom(KVCache):
        pass

    with pytest.raises(UnsupportedModelError, match="Custom"):
        make_cache(_FakeModel([Custom()]))


@pytest.mark.parametrize("window", [3, 8])
def test_window_cache_masks_like_rotating_cache(window):
    # A model that builds its mask without window_size relies on
    # RotatingKVCache's default; WindowKVCache must give the same attention.
    key = mx.random.key(0)
    rot, win = RotatingKVCache(max_size=window), WindowKVCache(window)
    chunks = [5, 1, 1, 4, 1, 1, 1, 7, 1]
    for i, n in enumerate(chunks):
        q, k, v = (mx.random.normal((1, 2, n, 8), key=mx.random.split(key, 30)[3 * i + j]) for j in range(3))
        outs = []
        for cache in (rot, win):
            mask = cache.make_mask(n)
            keys, values = cache.update_and_fetch(k, v)
            outs.append(scaled_dot_product_attention(q, keys, values, cache, scale=0.35, mask=mask))
        assert mx.allclose(outs[0], outs[1], atol=1e-6).item(), f"chunk {i}"


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_5", "nemotron_h"])
def test_restore_returns_to_the_snapshot(family):
    model = target(family, "float32")
    cache = prefilled(model)
    reference = prefilled(model)
    snap = cache.snapshot()
    mx.eval(cache.feed(mx.array([7, 8, 9], dtype=mx.uint32)))
    assert cache.length == reference.length + 3
    cache.restore(snap)
    assert max_cache_diff(cache, reference) == 0.0
    # And the restored cache continues like the untouched one.
    a = cache.feed(mx.array([PROMPT[-1]], dtype=mx.uint32))
    b = reference.feed(mx.array([PROMPT[-1]], dtype=mx.uint32))
    assert mx.array_equal(a, b).item()


def test_rollback_refuses_keeping_more_than_was_fed():
    cache = prefilled(target("llama", "float32"))
    snap = cache.snapshot()
    cache.feed(mx.array([1, 2], dtype=mx.uint32))
    with pytest.raises(ValueError):
        cache.rollback(snap, 3)


def test_attention_rollback_is_a_trim_and_recurrent_rollback_asks_for_replay():
    for family, replay in (("llama", False), ("qwen3_5", True)):
        cache = prefilled(target(family, "float32"))
        snap = cache.snapshot()
        cache.feed(mx.array([1, 2, 3, 4], dtype=mx.uint32))
        assert cache.rollback(snap, 2) is replay
        assert cache.length == snap.length + (0 if replay else 2)
        # Keeping everything is always free.
        snap = cache.snapshot()
        cache.feed(mx.array([5], dtype=mx.uint32))
        assert cache.rollback(snap, 1) is False


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_5", "nemotron_h"])
def test_one_row_and_many_share_one_cache_protocol(family):
    """ModelCache and BatchCache are both a RowCache; settling one row keeps what feeding it directly builds."""
    from helpers import PROMPT, fed, max_cache_diff, prefilled, target

    from specdec_cli.cache.batch_cache import BatchCache
    from specdec_cli.cache.caches import RowCache

    model = target(family, "float32")
    one = prefilled(model)
    assert isinstance(one, RowCache) and isinstance(BatchCache(model, prefilled(model)), RowCache)
    tokens = [5, 6, 7, 8, 9]
    snap = one.snapshot()
    record = "capture" if one.recurrent else None
    one.feed(mx.array(tokens, dtype=mx.uint32), record=record)
    one.settle(snap, [2])
    assert one.length == len(PROMPT) - 1 + 2
    assert max_cache_diff(one, fed(model, PROMPT[:-1] + tokens[:2])) <= 1e-5
    if one.recurrent:  # a recurrent forward that recorded nothing cannot be cut back: it says so
        snap = one.snapshot()
        one.feed(mx.array(tokens, dtype=mx.uint32))
        with pytest.raises(RuntimeError):
            one.settle(snap, [1])


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_rows_prefilled_together_hold_what_each_prefill_alone_leaves(family):
    # Requests that arrive together are prefilled in one forward (the server's bursts): each row's caches
    # must be its own prefill's, bit for bit, whatever the other rows' lengths (one row resumes a prefix,
    # as a prompt cache hit does; gemma3_text's sliding layers see their window of a longer prompt).
    from specdec_cli.cache.batch_cache import prefill_rows

    model = target(family, "float32")
    held = ModelCache(model)
    held.prefill(PROMPT[:5])
    feeds = [PROMPT[:-1], PROMPT[:7], PROMPT[5:25]]
    rows = prefill_rows(model, [ModelCache(model), ModelCache(model), held], feeds)
    for row, chunks in zip(rows, [[PROMPT[:-1]], [PROMPT[:7]], [PROMPT[:5], PROMPT[5:25]]]):
        direct = ModelCache(model)
        for chunk in chunks:
            direct.prefill(chunk)
        assert row.length == direct.length and max_cache_diff(row, direct) == 0.0
        # and the next forward computes alike from either
        x = mx.array([PROMPT[-1]], dtype=mx.uint32)
        assert mx.array_equal(row.feed(x), direct.feed(x)).item()


def test_rows_with_recurrent_layers_are_not_prefilled_together():
    from specdec_cli.cache.batch_cache import prefill_rows

    model = target("qwen3_5", "float32")
    with pytest.raises(ValueError, match="one at a time"):
        prefill_rows(model, [ModelCache(model), ModelCache(model)], [PROMPT[:4], PROMPT[:6]])
