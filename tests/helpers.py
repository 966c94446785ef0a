"""Shared builders for the tests: tiny random models and run helpers."""

from __future__ import annotations

import copy
import functools

import mlx.core as mx
import mlx.nn as nn

from specdec_cli.cache.caches import ModelCache, WindowKVCache
from specdec_cli.drafters import ModelDrafter
from specdec_cli.core.blocks import Block
from specdec_cli.loop.engine import speculative_generate_step
from specdec_cli.loop.plain import plain_generate_step
from specdec_cli.session.synthetic import TINY_CONFIGS, build_model, perturb

FAMILIES = ["llama", "qwen3", "gemma3_text", "qwen3_5", "nemotron_h"]
DTYPES = ["float32", "bfloat16"]
# Byte-level tokenizer: ids are bytes. Longer than gemma3's 8-token window.
PROMPT = list(b"The quick brown fox jumps over the lazy dog, twice: the quick brown fox.")
GEN = 40
# Relative weight noise that gives the drafter a mix of accepts and rejects.
NOISE = {"gemma3_text": 0.02}


def tied_qwen35(config: dict = TINY_CONFIGS["qwen3_5"]) -> dict:
    """A Qwen3.5-style ``config`` with tied embeddings: what a sharded target can be made of over 2 ranks (mlx-lm's
    qwen3_5 shard splits an untied lm_head by vocabulary, and the tiny 259 does not divide by 2)."""
    out = copy.deepcopy(config)
    out["text_config"]["tie_word_embeddings"] = True
    return out


def quantized(config: dict, dtype=mx.float32, group_size: int = 32, bits: int = 4):
    """``config``'s tiny model (seed 0) with its linear layers quantized, as ``mlx_lm.convert -q`` quantizes them."""
    model = build_model(config, seed=0, dtype=dtype)
    nn.quantize(model, group_size=group_size, bits=bits)
    return model


@functools.cache
def target(family: str, dtype: str):
    return build_model(TINY_CONFIGS[family], seed=0, dtype=getattr(mx, dtype))


@functools.cache
def noisy_drafter(family: str, dtype: str):
    model = build_model(TINY_CONFIGS[family], seed=0, dtype=getattr(mx, dtype))
    perturb(model, NOISE.get(family, 0.05), seed=1000)
    return model


class Interrupting:
    """Wraps a model and raises KeyboardInterrupt on its n-th forward."""

    def __init__(self, model, at_call: int):
        self._model, self._at, self._calls = model, at_call, 0

    def __call__(self, *args, **kwargs):
        self._calls += 1
        if self._calls == self._at:
            raise KeyboardInterrupt
        return self._model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def prefilled(model, prompt=PROMPT) -> ModelCache:
    cache = ModelCache(model)
    cache.prefill(prompt[:-1])
    return cache


def fed(model, ids: list[int], prompt_len: int = len(PROMPT) - 1) -> ModelCache:
    """A cache built directly: the prompt prefilled, then one token at a time."""
    cache = ModelCache(model)
    cache.prefill(ids[:prompt_len])
    for t in ids[prompt_len:]:
        cache.feed(mx.array([t], dtype=mx.uint32))
    mx.eval(cache.state_arrays())
    return cache


def tokens(blocks: list[Block]) -> list[int]:
    return [t for b in blocks for t in b.tokens]


def plain(model, max_tokens=GEN, prompt=PROMPT, eos_ids=()) -> tuple[list[int], ModelCache]:
    """Plain greedy output and the cache it leaves behind."""
    cache = prefilled(model, prompt)
    out = tokens(list(plain_generate_step(prompt[-1], cache, max_tokens=max_tokens, eos_ids=eos_ids)))
    return out, cache


def speculative(model, draft_model, k, max_tokens=GEN, prompt=PROMPT, eos_ids=(), timed=False,
                rollback="reforward"):
    """Speculative blocks plus the target cache and the drafter, after the run."""
    cache = prefilled(model, prompt)
    drafter = ModelDrafter(draft_model)
    drafter.prefill(prompt[:-1])
    blocks = list(
        speculative_generate_step(
            prompt[-1], cache, drafter, num_draft_tokens=k, max_tokens=max_tokens,
            eos_ids=eos_ids, timed=timed, rollback=rollback,
        )
    )
    return blocks, cache, drafter


def cache_arrays(cache: ModelCache) -> list[mx.array]:
    """The meaningful contents of every layer cache, in layer order.

    KV caches contribute keys/values up to their offset (the buffer past it
    is scratch; a sliding-window cache, from the first position the next
    forward attends to); recurrent caches contribute every array they hold.
    """
    out = []
    for c in cache._attention:
        out.append(mx.array(c.offset))
        if isinstance(c, WindowKVCache):
            if c.keys is not None:
                out += list(c.live(c.needed_from))
        elif c.keys is not None:
            out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    for c in cache._recurrent:
        out += [a for a in c.cache if a is not None]
    return out


def _cache_pairs(a: ModelCache, b: ModelCache):
    """The two caches' arrays side by side, in float32 (offsets must match, and are checked here)."""
    xs, ys = cache_arrays(a), cache_arrays(b)
    assert len(xs) == len(ys)
    assert a.length == b.length
    for x, y in zip(xs, ys):
        assert x.shape == y.shape, (x.shape, y.shape)
        if x.ndim == 0:
            assert x.item() == y.item(), "offsets differ"
            continue
        yield x.astype(mx.float32), y.astype(mx.float32)


def max_cache_diff(a: ModelCache, b: ModelCache) -> float:
    """Largest absolute difference between two caches (offsets must match)."""
    return max((mx.abs(x - y).max().item() for x, y in _cache_pairs(a, b)), default=0.0)


def cache_rel_diff(a: ModelCache, b: ModelCache) -> float:
    """Largest over the caches' arrays of their largest absolute difference over ``b``'s largest value."""
    return max((mx.abs(x - y).max().item() / max(mx.abs(y).max().item(), 1e-6) for x, y in _cache_pairs(a, b)),
               default=0.0)


class TwoPathModel:
    """A target whose multi-row forwards run slightly different weights.

    A stand-in, on a CPU whose kernels are exact, for a backend whose batched
    kernels round differently from its one-row ones: verify forwards (and
    prefill) use ``many_rows``, one-token decoding uses ``one_row``. Both share
    one architecture, so they share the caches.
    """

    def __init__(self, one_row, many_rows):
        self.one_row, self.many_rows = one_row, many_rows

    def __call__(self, inputs, cache=None):
        model = self.one_row if inputs.shape[1] == 1 else self.many_rows
        return model(inputs, cache=cache)

    def __getattr__(self, name):
        return getattr(self.one_row, name)


@functools.cache
def two_path(family: str = "llama", dtype: str = "float32", scale: float = 1e-3) -> TwoPathModel:
    many = build_model(TINY_CONFIGS[family], seed=0, dtype=getattr(mx, dtype))
    perturb(many, scale, seed=7)
    return TwoPathModel(target(family, dtype), many)


# --- does this backend's T-row arithmetic give one-row bits? -----------------------
# Exactness tests assert bit identity where it does (MLX's CPU backend with its
# bundled BLAS: float32 and bfloat16 both), and otherwise accept identical
# output or a proven rounding tie (GPUs: batched matmuls round differently).

def _rows_agree(f, x: mx.array) -> bool:
    """``f`` over all rows of ``x`` equals ``f`` row by row, bit for bit."""
    batched = f(x)
    one = mx.concatenate([f(x[i : i + 1]) for i in range(x.shape[0])])
    return mx.array_equal(batched, one).item()


def kernels_agree(dtype: str) -> bool:
    """Whether a T-row forward's kernels give the bits of T one-row ones, in ``dtype`` (never on the
    GPU-like backend, tests/gpu_like.py)."""
    import gpu_like

    return not gpu_like.active() and _backend_agrees(dtype)


@functools.cache
def _backend_agrees(dtype: str) -> bool:
    """Probes what a decoder layer runs at the tiny models' sizes and at a larger
    one: matmul, 4-bit quantized matmul, RMS norm and scaled-dot-product
    attention over a cache (T = 2..9)."""
    dt = getattr(mx, dtype)
    key = mx.random.key(19)
    for h, o in ((64, 256), (1024, 2048)):
        k1, k2, key = mx.random.split(key, 3)
        w = (mx.random.normal((o, h), key=k1) / h**0.5).astype(dt)
        wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
        norm_w = mx.ones((h,), dtype=dt)
        for t in (2, 3, 4, 5, 8, 9):
            x = mx.random.normal((t, h), key=mx.random.split(k2, 10)[t]).astype(dt)
            checks = [
                lambda r: r @ w.T,
                lambda r: mx.quantized_matmul(r, wq, scales, biases, transpose=True, group_size=64, bits=4),
                lambda r: mx.fast.rms_norm(r, norm_w, 1e-6),
            ]
            if not all(_rows_agree(f, x) for f in checks):
                return False
    # Attention: T new queries over a 40-token cache, causal, vs one query at a time.
    heads, d, past, t = 4, 64, 40, 6
    k1, k2, k3 = mx.random.split(key, 3)
    q = mx.random.normal((1, heads, t, d), key=k1).astype(dt)
    kv = [mx.random.normal((1, heads, past + t, d), key=kk).astype(dt) for kk in (k2, k3)]
    mask = mx.tril(mx.ones((t, past + t), dtype=mx.bool_), k=past)
    batched = mx.fast.scaled_dot_product_attention(q, *kv, scale=d**-0.5, mask=mask)
    for i in range(t):
        ks, vs = (a[:, :, : past + i + 1] for a in kv)
        one = mx.fast.scaled_dot_product_attention(q[:, :, i : i + 1], ks, vs, scale=d**-0.5)
        if not mx.array_equal(batched[:, :, i : i + 1], one).item():
            return False
    return True


def assert_exact(model, dtype: str, blocks: list[Block], ref: list[int], prompt=PROMPT, eos_ids=()) -> None:
    """Speculative output equals plain output: bit for bit where the kernels agree, else identical or a proven tie."""
    out = tokens(blocks)
    if kernels_agree(dtype):
        assert out == ref
        return
    from specdec_cli.loop.compare import TIE, explain

    d = explain(model, prompt, out, ref, blocks, eos_ids=eos_ids)
    assert d is None or d.verdict == TIE, d
    _ties_to_the_end(model, prompt, out, d, eos_ids)


def _ties_to_the_end(model, prompt, out: list[int], d, eos_ids=()) -> None:
    """After a proven tie, the rest of ``out`` is plain decoding of everything before it, again up to rounding
    ties (held to the backend's rounding): a wrong cache row or position that shows only past a tie still fails."""
    from specdec_cli.loop.compare import TIE, explain

    start = 0
    while d is not None:
        assert d.verdict == TIE, (start, d)
        start += d.index + 1
        if start >= len(out):
            return
        head = list(prompt) + list(out[:start])
        ref, _ = plain(model, max_tokens=len(out) - start, prompt=head, eos_ids=eos_ids)
        d = explain(model, head, out[start:], ref, (), eos_ids=eos_ids, rounding=rounding_of(model))


#: Where kernels round by shape, a cache built through other shapes may differ from the one its tokens build
#: directly by this share of each array's largest value; a cache one token or one row off differs by the values.
CACHE_ROUNDING = 2.0**-3


def assert_cache_built_by(model, prompt, out, cache, dtype: str, tol: float = 0.0, *, stopped: bool = False,
                          drafter: bool = False) -> None:
    """``cache`` is the one plain decoding leaves after ``prompt`` and ``out``: within ``tol`` where the kernels
    agree, else within :data:`CACHE_ROUNDING` (it was built in other shapes). Its length is the prompt's and every
    token but the last (all of them after an EOS: ``stopped``); a drafter's may lag (its caller says by how much)."""
    if not drafter:
        assert cache.length == len(prompt) + len(out) - (0 if stopped else 1), (cache.length, len(prompt), len(out))
    direct = fed(model, (list(prompt) + list(out))[: cache.length], prompt_len=len(prompt) - 1)
    if kernels_agree(dtype):
        assert max_cache_diff(cache, direct) <= tol
    else:
        assert cache_rel_diff(cache, direct) <= CACHE_ROUNDING


def assert_served(loaded, got: list[int], prompt, max_tokens: int, want: list[int]) -> None:
    """A served (or session's) answer is ``want``, its request's alone: bit for bit where the kernels agree, else
    plain decoding's text up to a rounding tie (``loaded``: the target as ``load_setup`` loaded it)."""
    if kernels_agree(loaded.dtype):
        assert got == want
        return
    eos = tuple(loaded.tokenizer.eos_token_ids)
    ref, _ = plain(loaded.model, max_tokens=max_tokens, prompt=list(prompt), eos_ids=eos)
    assert_alone_or_tie(loaded.model, loaded.dtype, got, ref, list(prompt), eos_ids=eos)


def rows_per_call(monkeypatch, owner, method: str) -> list[int]:
    """Notes how many rows each call of ``owner.method`` takes (its argument's length): a drafter group's
    ``propose`` (DraftBatch, MTPBatch, DFlashBatch), ``Flights.prefill_together``."""
    rows: list[int] = []
    real = getattr(owner, method)

    def noted(self, arg):
        rows.append(len(arg))
        return real(self, arg)

    monkeypatch.setattr(owner, method, noted)
    return rows


# --- a batched row against its prompt alone ---------------------------------------------------------

_ROUNDING: dict = {}


def rounding_of(model):
    """The backend's rounding for ``model`` as the batch check measures it (measured once per backend)."""
    import gpu_like
    from specdec_cli.cache.batch_check import measure_rounding

    key = (id(model), gpu_like.active())
    if key not in _ROUNDING:
        _ROUNDING[key] = (model, measure_rounding(model, lambda: ModelCache(model)))
    return _ROUNDING[key][1]


def assert_alone_or_tie(model, dtype: str, out: list[int], ref: list[int], prompt, trace=(), eos_ids=(),
                        **run_options):
    """A batched row's output is its prompt's alone (``ref``, plain decoding): bit for bit where the kernels
    agree, else identical or a rounding tie held to the backend's rounding (docs/EXACTNESS.md's promise)."""
    if kernels_agree(dtype):
        assert out == ref
        return
    from specdec_cli.loop.compare import TIE, explain

    d = explain(model, prompt, out, ref, trace, eos_ids=eos_ids, rounding=rounding_of(model), **run_options)
    assert d is None or d.verdict == TIE, d
    if not run_options:  # (plain decoding with a run's options, e.g. quantized caches or sampling, is the caller's)
        _ties_to_the_end(model, prompt, out, d, eos_ids)
