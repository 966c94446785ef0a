"""The batch check (issue 56): rows may share a batch when a batched row is within the backend's own rounding
of the row alone, and never when a mask, position or cache row is wrong, on this CPU and on the GPU-like
backend (tests/gpu_like.py).

On this CPU a batched row is bit for bit the row alone, so the check passes with nothing to spare and a
planted fault shows by factors of 10^5; on the GPU-like backend the rounding is a GPU's (0.5-3% of the
largest logit), the same check passes, and a planted fault still shows past it.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from helpers import DTYPES, FAMILIES, kernels_agree, quantized, target
from specdec_cli.cache import batch_cache
from specdec_cli.cache.batch_check import FACTOR, Rounding, batch_problem, check_batch, measure_rounding
from specdec_cli.cache.caches import ModelCache
from specdec_cli.session.synthetic import TINY_CONFIGS

CASES = [(f, d) for f in FAMILIES for d in (*DTYPES, "float16")]


def fresh(model):
    return lambda: ModelCache(model)


@pytest.mark.parametrize("family,dtype", CASES)
def test_a_correct_batch_passes_within_the_backends_own_rounding(family, dtype, backend):
    model = target(family, dtype)
    rounding = measure_rounding(model, fresh(model))
    assert rounding.ok and batch_problem(model, fresh(model)) is None
    assert rounding.dtype == dtype
    if kernels_agree(dtype):  # bit for bit (this CPU's own arithmetic): the check has nothing to allow for
        assert rounding.batched == 0.0 == rounding.yardstick
    elif backend == "gpu-like":  # a GPU's amounts: what the fixed 1e-2 tolerance refused on the H200
        assert 0 < rounding.batched <= rounding.tolerance == pytest.approx(FACTOR * rounding.yardstick)


def _peek_ahead(real):
    def make_mask(self, N, return_array=False, window_size=None):
        mask = real(self, N, return_array, window_size)
        return mask | mx.concatenate([mx.zeros_like(mask[..., :1]), mask[..., :-1]], axis=-1)  # one key too far
    return make_mask


def _rows_swapped(real):
    def update_and_fetch(self, keys, values):
        k, v = real(self, keys, values)
        # A copy, not a view with a negative stride: with that view, an H200 in bf16 and float16 refused for
        # an error in the forward (no rounding measured), not for the fault.
        return mx.concatenate([k[1:], k[:1]]), mx.concatenate([v[1:], v[:1]])
    return update_and_fetch


@pytest.mark.parametrize("fault", ["mask", "position", "row"])
@pytest.mark.parametrize("family,dtype", CASES)
def test_a_wrong_mask_position_or_row_is_refused(family, dtype, fault, backend, monkeypatch):
    model = target(family, dtype)
    cls = batch_cache.RowsKVCache
    if fault == "mask":
        monkeypatch.setattr(cls, "make_mask", _peek_ahead(cls.make_mask))
    elif fault == "position":  # RoPE one position on
        monkeypatch.setattr(cls, "offset", property(lambda self: mx.array([n + 1 for n in self.lengths], mx.int32)))
    else:  # each row reads the other's keys and values
        monkeypatch.setattr(cls, "update_and_fetch", _rows_swapped(cls.update_and_fetch))
    problem, rounding = check_batch(model, fresh(model))
    assert rounding is not None and not rounding.ok, (problem, rounding)
    assert "past rounding" in problem and f"{rounding.batched:.2g}" in problem


def test_the_bound_is_the_tolerance_of_the_largest_logit():
    r = Rounding("bfloat16", yardstick=0.01, batched=0.02, tolerance=0.04)
    assert r.ok and r.bound(mx.array([1.0, -5.0, 2.0])) == pytest.approx(0.2)
    assert not Rounding("float32", 0.0, 1e-3, 4.8e-7).ok


def test_a_forward_that_fails_on_rows_is_a_reason_not_a_crash(monkeypatch):
    model = target("llama", "float32")

    def broken(self, N, return_array=False, window_size=None):
        raise TypeError("offset must be an int")

    monkeypatch.setattr(batch_cache.RowsKVCache, "make_mask", broken)
    problem, rounding = check_batch(model, fresh(model))
    assert rounding is None and "fails on rows of different lengths (TypeError: offset must be an int)" in problem


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_where_a_few_rows_share_a_kernel_the_yardstick_still_sees_the_batchs_rounding(family, gpu_like):
    # An H200 in 4-bit: 1 to 3 rows gave the same bits (one vector kernel), a batch's 6 did not (0.018 of the
    # largest logit), and a yardstick of 1 against 3 rows read 0: the server refused to batch. The yardstick
    # also feeds a row more tokens at once than the batch holds rows (the batch's kernel class).
    model = quantized(TINY_CONFIGS[family], mx.float16)
    with gpu_like.small_shapes_shared():
        rounding = measure_rounding(model, fresh(model))
        assert rounding.batched > 0 and rounding.ok, rounding
        cls = batch_cache.RowsKVCache
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cls, "update_and_fetch", _rows_swapped(cls.update_and_fetch))
            problem, wrong = check_batch(model, fresh(model))
        assert wrong is not None and not wrong.ok and "past rounding" in problem, (problem, wrong)
