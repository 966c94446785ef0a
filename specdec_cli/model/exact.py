"""``--exact``: every target forward computes each row's numbers the same whatever goes with it (issue 58).

A GPU picks a matmul's kernel by its shape and an attention's by its query and
key lengths, and each rounds its own way: a row's logits then depend on how many
rows and positions share its forward (a batch, a verify, a one-token step) and
on the cache's length, so a near-tie can go either way. MLX offers no switch
for shape-invariant kernels (its PR #4279 was declined). Here the target's
forward is changed, per model instance, so that every reduction runs in one
shape and one order:

- every linear layer (and a tied embedding read as the LM head) runs its input
  :data:`ROWS` rows per call, the last call padded: one kernel shape, however
  many rows the forward has;
- attention runs each :data:`QUERIES` query rows as one matrix (padded) against
  the keys :data:`KEYS` at a time, :data:`MATRICES` matrices per call, left to right, folding each block of keys
  into a running maximum, sum and weighted values (an online softmax): the
  order of the reduction over the keys depends on the keys' positions alone,
  and a block of keys a row cannot see (padding past its length in a batch)
  adds exact zeros;
- recurrent layers compute every token with the one-token formula (prefill too),
  and sliding-window layers keep every key (the window applied by the mask), so
  a row's keys sit at their positions whatever holds them.

Only rounding changes: a default run and an exact one may differ at a near-tie
(the exact one computes in other shapes), but exact runs agree with each other
bit for bit whatever the batch, the drafter and the block size, and with plain
decoding in the same mode (``--compare-ar`` says ``identical``).

The hooks are per model instance: linear layers and embeddings get a class of
their own (:func:`install`), and the attention function of the model's modules
is wrapped so that it computes exactly only for caches an exact model made
(``cache.exact``); every other model in the process is untouched. The session
then probes the forward (:func:`specdec_cli.cache.batch_check.exact_problem`: rows
batched against alone, all positions against one at a time, and one row at every
place a call holds) and refuses, naming what differed, where it is not bit for bit.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError

#: Rows a linear layer computes per call.
ROWS = 16
#: Query rows an attention computes as one matrix.
QUERIES = 16
#: Keys folded into the running softmax per step.
KEYS = 256
#: Matrices an attention's batched matmul computes per call.
MATRICES = 16

_ATTRIBUTE = "_specdec_exact"


def is_exact(model: Any) -> bool:
    """Whether :func:`install` made ``model`` exact."""
    return bool(getattr(model, _ATTRIBUTE, False))


# --- linear layers: one call shape ----------------------------------------------------------------


def _in_rows(call, x: mx.array) -> mx.array:
    """``call`` over ``x``'s rows, :data:`ROWS` at a time (the last block padded with zeros, then dropped)."""
    lead, width = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, width)
    m = flat.shape[0]
    pad = (-m) % ROWS
    if pad:
        flat = mx.concatenate([flat, mx.zeros((pad, width), dtype=flat.dtype)])
    out = mx.concatenate([call(flat[i : i + ROWS]) for i in range(0, m + pad, ROWS)])[:m]
    return out.reshape(*lead, out.shape[-1])


class _ExactLinear:
    def __call__(self, x):
        return _in_rows(super().__call__, x)


class _ExactEmbedding:
    def as_linear(self, x):
        return _in_rows(super().as_linear, x)


_CLASSES: dict[type, type] = {}


def _exact_class(cls: type) -> type:
    if cls not in _CLASSES:
        mixin = _ExactEmbedding if issubclass(cls, (nn.Embedding, nn.QuantizedEmbedding)) else _ExactLinear
        _CLASSES[cls] = type(f"Exact{cls.__name__}", (mixin, cls), {})
    return _CLASSES[cls]


# --- attention: fixed shapes, a fixed-order reduction over the keys ------------------------------------


def _in_matrices(a: mx.array, b: mx.array, heads: mx.array, transpose: bool) -> mx.array:
    """``a[i] @ b[heads[i]]`` (``.T`` with ``transpose``) for ``a`` ``[N, m, k]``, :data:`MATRICES` matrices per
    call, each call's ``b`` gathered afresh: one shape and one memory layout per call whatever ``N`` (a GPU's
    batched GEMM splits its inner dimension by how many matrices it holds, and may pick its kernel by the
    operands' strides: an H200 rounded a row in a batch of 2 and 4 apart from itself alone when the count
    followed the batch). ``a`` and ``heads`` come padded to a multiple of :data:`MATRICES`."""
    out = []
    for i in range(0, a.shape[0], MATRICES):
        rhs = mx.take(b, heads[i : i + MATRICES], axis=0)
        out.append(mx.matmul(a[i : i + MATRICES], rhs.swapaxes(-1, -2) if transpose else rhs))
    return out[0] if len(out) == 1 else mx.concatenate(out)


def _padded(x: mx.array, n: int) -> mx.array:
    """``x`` with zero matrices after its own, ``n`` in all."""
    return x if x.shape[0] == n else mx.pad(x, [(0, n - x.shape[0]), (0, 0), (0, 0)])


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    """Scaled dot-product attention computed shape-invariantly (see the module docstring).

    Args:
        queries: ``[B, Hq, T, D]``.
        keys: ``[B, Hk, S, D]`` (``Hq`` a multiple of ``Hk``), the key for position ``j`` at column ``j``.
        values: ``[B, Hk, S, Dv]``.
        scale: Applied to the scores.
        mask: None, ``"causal"``, or a boolean or additive array broadcastable to ``[B, Hq, T, S]``.

    Returns:
        ``[B, Hq, T, Dv]`` in the queries' dtype.
    """
    B, Hq, T, D = queries.shape
    Hk, S = keys.shape[1], keys.shape[2]
    if B == 0 or T == 0:
        return mx.zeros((B, Hq, T, values.shape[-1]), dtype=queries.dtype)
    rep = Hq // Hk
    nq = -(-T // QUERIES)
    nk = -(-S // KEYS)
    # Visible keys per query: a boolean mask [B|1, Hq|1, T, S], and an additive one for float masks.
    add = None
    if mask is None:
        visible = mx.ones((1, 1, T, S), dtype=mx.bool_)
    elif isinstance(mask, str):
        visible = (mx.arange(S)[None] <= (S - T) + mx.arange(T)[:, None])[None, None]
    elif mask.dtype == mx.bool_:
        visible = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    else:
        add = mask.astype(mx.float32).reshape((1,) * (4 - mask.ndim) + mask.shape)
        visible = add > -mx.inf
    # Pad queries to whole matrices and keys to whole blocks (padding: invisible keys, queries dropped).
    q = mx.pad(queries, [(0, 0), (0, 0), (0, nq * QUERIES - T), (0, 0)])
    k = mx.pad(keys, [(0, 0), (0, 0), (0, nk * KEYS - S), (0, 0)])
    v = mx.pad(values, [(0, 0), (0, 0), (0, nk * KEYS - S), (0, 0)])
    visible = mx.pad(mx.broadcast_to(visible, (visible.shape[0], visible.shape[1], T, S)),
                     [(0, 0), (0, 0), (0, nq * QUERIES - T), (0, nk * KEYS - S)])
    if add is not None:
        add = mx.pad(mx.broadcast_to(add, (add.shape[0], add.shape[1], T, S)),
                     [(0, 0), (0, 0), (0, nq * QUERIES - T), (0, nk * KEYS - S)])
    # [B, Hk, rep, nq, QUERIES, D] against blocks [B, Hk, 1, 1, KEYS, D].
    q = q.reshape(B, Hk, rep, nq, QUERIES, D)

    def per_head(m: mx.array) -> mx.array:
        m = m.reshape(m.shape[0], m.shape[1], nq, QUERIES, -1)
        if m.shape[1] == Hq:
            return m.reshape(m.shape[0], Hk, rep, nq, QUERIES, -1)
        return m[:, :, None]  # one mask for every head

    visible, add = per_head(visible), None if add is None else per_head(add)
    top = mx.full((B, Hk, rep, nq, QUERIES, 1), -mx.inf, dtype=mx.float32)
    total = mx.zeros((B, Hk, rep, nq, QUERIES, 1), dtype=mx.float32)
    acc = mx.zeros((B, Hk, rep, nq, QUERIES, values.shape[-1]), dtype=mx.float32)
    # The matrices: one per (row, query head, query block), each against its KV head's keys, gathered per call
    # (never every head's copy at once: a long prefill would hold them all). Padding matrices read head 0.
    lead = (B, Hk, rep, nq)
    count = B * Hk * rep * nq
    padded = count + (-count) % MATRICES
    heads = mx.arange(padded) // (rep * nq)
    heads = mx.where(heads < B * Hk, heads, 0)
    qf = _padded(q.astype(mx.float32).reshape(count, QUERIES, D), padded)
    kf = k.astype(mx.float32).reshape(B * Hk, nk * KEYS, D)
    vf = v.astype(mx.float32).reshape(B * Hk, nk * KEYS, values.shape[-1])
    for b in range(nk):
        cols = slice(b * KEYS, (b + 1) * KEYS)
        scores = _in_matrices(qf, kf[:, cols], heads, True)[:count].reshape(*lead, QUERIES, KEYS) * scale
        if add is not None:
            scores = scores + add[..., cols]
        seen = visible[..., cols]
        scores = mx.where(seen, scores, -mx.inf)
        block_top = mx.max(scores, axis=-1, keepdims=True)
        new_top = mx.maximum(top, block_top)
        # A block (or a whole row so far) with nothing visible adds exact zeros (no -inf - -inf).
        safe = mx.where(new_top == -mx.inf, 0.0, new_top)
        weights = mx.where(seen, mx.exp(scores - safe), 0.0)
        carried = mx.where(top == -mx.inf, 0.0, mx.exp(top - safe))
        total = total * carried + mx.sum(weights, axis=-1, keepdims=True)
        w = _padded(weights.reshape(count, QUERIES, KEYS), padded)
        acc = acc * carried + _in_matrices(w, vf[:, cols], heads, False)[:count].reshape(acc.shape)
        top = new_top
    out = acc / mx.where(total == 0, 1.0, total)
    out = out.reshape(B, Hq, nq * QUERIES, values.shape[-1])[:, :, :T]
    return out.astype(queries.dtype)


def _wrap_attention(original):
    def scaled_dot_product_attention(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None, **kw):
        if getattr(cache, "exact", False):
            if sinks is not None or kw:
                raise UnsupportedModelError("--exact does not cover attention sinks: run without --exact")
            return attention(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks, **kw)

    scaled_dot_product_attention._specdec_original = original
    return scaled_dot_product_attention


def _wrap_modules(model: nn.Module) -> list[str]:
    """Wrap the attention function of every module the model's classes come from; returns those modules."""
    names = {type(m).__module__ for m in model.modules()} | {type(model).__module__}
    wrapped = []
    for name in sorted(names):
        module = sys.modules.get(name)
        fn = getattr(module, "scaled_dot_product_attention", None)
        if fn is None:
            continue
        if not hasattr(fn, "_specdec_original"):
            module.scaled_dot_product_attention = _wrap_attention(fn)
        wrapped.append(name)
    return wrapped


# --- installing ---------------------------------------------------------------------------------------


def install(model: nn.Module) -> None:
    """Make ``model``'s forward shape-invariant (see the module docstring); the caller probes it
    (:func:`specdec_cli.cache.batch_check.exact_problem`) before the first request.

    Raises:
        UnsupportedModelError: An attention this cannot reach.
    """
    if is_exact(model):
        return
    if not _wrap_modules(model):
        raise UnsupportedModelError(f"--exact cannot reach {type(model).__module__}'s attention: run without "
                                    "--exact")
    for m in model.modules():
        if type(m) in (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding):
            m.__class__ = _exact_class(type(m))
    setattr(model, _ATTRIBUTE, True)


__all__ = ["KEYS", "QUERIES", "ROWS", "attention", "install", "is_exact"]
