"""Token selection: greedy as mlx-lm picks it, and lossless speculative sampling.

Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023): a
draft token x drawn from the drafter's distribution q is kept with probability
min(1, p(x) / q(x)), p being the target's distribution at that position. At
the first rejection the token is drawn from norm(max(p - q, 0)) instead; if
every draft is kept, a bonus token is drawn from the target's next p. Each
emitted token is then distributed exactly as p: P(x) = min(p, q)(x) +
(1 - sum min(p, q)) * norm(max(p - q, 0))(x) = p(x). A deterministic drafter
(greedy drafting, prompt lookup) has q one-hot at x: x is kept with
probability p(x), and a rejection draws from p with x removed.

p and q go through the same transforms as mlx-lm's sampler: top-p, min-p and
top-k mask the temperature-1 log-probabilities, then the temperature scales.
They are written here with plain MLX ops rather than imported: mlx-lm compiles
its filters with ``mx.random.state`` as an input and output, so one that raises
while it is traced (a ``top_k`` at or above the vocabulary size) leaves the
global random state holding a placeholder, and every later unseeded draw in the
process fails. Nothing here is compiled, and a ``top_k`` at or above the
vocabulary keeps every token (no top-k), as OpenAI-style servers read it.

With a seed (``SamplingParams.seed``) draws are keyed by position instead:
the token at generated position i is ``argmax(log p_i + g_i)`` (Gumbel-max,
an exact draw from p_i), where the Gumbel noise g_i is a function of the seed,
i and the token id alone. A draft is kept iff it equals that token, so the
text is the same whatever the draft lengths (and equal to plain decoding's
with the same seed); sampling drafters draft ``argmax(log q_i + g_i)`` with
the same noise, which makes them agree as often as this coupling allows.
For a deterministic drafter this keeps a draft with probability p(x), as
rejection sampling does.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Optional

import mlx.core as mx


@dataclass(frozen=True)
class SamplingParams:
    """mlx-lm's sampling options; ``temp == 0`` is greedy.

    Attributes:
        seed: Key draws by (seed, position) (see the module docstring); None:
            draw from MLX's global random state.
        position: With a seed, the generated-token index of the first row drawn.
    """

    temp: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    position: int = 0

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    @property
    def keyed(self) -> bool:
        """Draws are keyed by position: sampling with a seed."""
        return self.seed is not None and not self.greedy

    def at(self, position: int) -> "SamplingParams":
        """The same options with draws starting at generated position ``position``."""
        return replace(self, position=position) if self.keyed else self


GREEDY = SamplingParams()


def greedy(logits: mx.array) -> mx.array:
    """Greedy tokens for each row of ``logits``, exactly as mlx-lm picks them.

    mlx-lm takes the argmax of the log-probabilities in the model's dtype; in
    bfloat16 the subtraction rounds near-equal logits into ties that a plain
    argmax of the logits would break differently.
    """
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.argmax(logprobs, axis=-1).astype(mx.uint32)


def log_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Normalised float32 log-probabilities of the distribution tokens are drawn from.

    Same masks, order and temperature as ``mlx_lm.sample_utils.make_sampler``.
    """
    x = logits.astype(mx.float32)
    x = x - mx.logsumexp(x, axis=-1, keepdims=True)
    if 0 < params.top_p < 1.0:
        x = top_p_filter(x, params.top_p)
    if params.min_p != 0.0:
        x = min_p_filter(x, params.min_p)
    if 0 < params.top_k < x.shape[-1]:
        x = top_k_filter(x, params.top_k)
    x = x * (1.0 / params.temp)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


# mlx-lm's filters (sample_utils.apply_top_p / apply_min_p / apply_top_k), the
# same arithmetic uncompiled: see the module docstring for why.

def top_p_filter(logprobs: mx.array, top_p: float) -> mx.array:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p``."""
    sorted_logprobs = mx.sort(logprobs, axis=-1)
    sorted_probs = mx.exp(sorted_logprobs.astype(mx.float32))
    mass_above = mx.cumsum(sorted_probs, axis=-1, reverse=True, inclusive=False)
    total_mass = mass_above[..., :1] + sorted_probs[..., :1]
    num_dropped = (mass_above >= top_p * total_mass).sum(axis=-1, keepdims=True)
    # A top_p whose share of the mass rounds to 0 in float32 (1e-46) would drop every token: the likeliest stays,
    # as it does in mlx-lm for any top_p that float32 holds.
    num_dropped = mx.minimum(num_dropped, logprobs.shape[-1] - 1)
    threshold = mx.take_along_axis(sorted_logprobs, num_dropped, axis=-1)
    return mx.where(logprobs < threshold, -float("inf"), logprobs)


def min_p_filter(logprobs: mx.array, min_p: float) -> mx.array:
    """Drop tokens less likely than ``min_p`` times the most likely one."""
    top = mx.max(logprobs, axis=-1, keepdims=True)
    return mx.where(logprobs < top + math.log(min_p), -float("inf"), logprobs)


def top_k_filter(logprobs: mx.array, top_k: int) -> mx.array:
    """Keep the ``top_k`` most likely tokens (``0 < top_k < vocabulary``)."""
    drop = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k:]
    return mx.put_along_axis(logprobs, drop, mx.array(-float("inf"), logprobs.dtype), axis=-1)


def sample(logprobs: mx.array) -> mx.array:
    """Draw one token per row from normalised log-probabilities."""
    return mx.random.categorical(logprobs).astype(mx.uint32)


_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35


def _mix32(x):
    """murmur3's 32-bit finaliser (a bijection with full avalanche), on Python ints or uint32 arrays."""
    if isinstance(x, int):
        x ^= x >> 16
        x = (x * _M1) & 0xFFFFFFFF
        x ^= x >> 13
        x = (x * _M2) & 0xFFFFFFFF
        return x ^ (x >> 16)
    x = x ^ (x >> 16)
    x = x * mx.array(_M1, dtype=mx.uint32)
    x = x ^ (x >> 13)
    x = x * mx.array(_M2, dtype=mx.uint32)
    return x ^ (x >> 16)


@functools.lru_cache(maxsize=4)
def _token_hashes(vocab: int) -> mx.array:
    # One hash per token id, the same for every position (computed once per vocabulary size).
    ids = _mix32(mx.arange(vocab, dtype=mx.uint32) * mx.array(0x9E3779B1, dtype=mx.uint32) + 1)
    mx.eval(ids)
    return ids


def position_noise(seed: int, first: int, rows: int, vocab: int) -> mx.array:
    """Gumbel noise ``[rows, vocab]``; row r belongs to generated position ``first + r``.

    Each value is a function of (seed, position, token id) alone (a counter
    hash, not a random stream), so a draft model with a padded vocabulary,
    a drafter that draws one row at a time and the target's verify all see
    the same noise for the same token at the same position. 24 bits of
    uniform per value, as a float32 uniform has.
    """
    seed_key = _mix32((seed & 0xFFFFFFFF) ^ 0x9E3779B9) ^ _mix32((seed >> 32) & 0xFFFFFFFF)
    keys = [_mix32(seed_key ^ _mix32((first + r) & 0xFFFFFFFF) ^ ((first + r) >> 32)) for r in range(rows)]
    bits = _mix32(mx.array(keys, dtype=mx.uint32)[:, None] ^ _token_hashes(vocab)[None, :])
    u = ((bits >> 8).astype(mx.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1), never 0 or 1
    return -mx.log(-mx.log(u))


def keyed_pick(logprobs: mx.array, params: SamplingParams, offset: int = 0) -> mx.array:
    """Gumbel-max draws for rows at positions ``params.position + offset + r``: each exactly from its row's p."""
    rows, vocab = logprobs.shape
    noise = position_noise(params.seed, params.position + offset, rows, vocab)
    return mx.argmax(logprobs + noise, axis=-1).astype(mx.uint32)


def draw(logits: mx.array, params: SamplingParams, offset: int = 0) -> tuple[mx.array, Optional[mx.array]]:
    """A drafter's tokens for each row, and its log q (None when greedy: q is one-hot).

    ``offset``: with a seed, the rows are the drafts at ``params.position + offset`` onwards.
    """
    if params.greedy:
        return greedy(logits), None
    lp = log_probs(logits, params)
    return (keyed_pick(lp, params, offset) if params.keyed else sample(lp)), lp


def top_probability(logits: mx.array, logprobs: Optional[mx.array]) -> mx.array:
    """Each row's top-1 probability (for p-min), from ``draw``'s log q when it has one."""
    if logprobs is None:
        return mx.softmax(logits.astype(mx.float32), axis=-1).max(-1)
    return mx.exp(logprobs.max(-1))


def choose(logits: mx.array, params: SamplingParams) -> mx.array:
    """Next tokens from raw logits: greedy or sampled (keyed by ``params.position`` with a seed)."""
    return draw(logits, params)[0]


def accept_keyed(logits: mx.array, drafts: mx.array, params: SamplingParams) -> tuple[mx.array, mx.array]:
    """Position-keyed sampling: drafts are kept while they equal the target's keyed draws.

    Row i of ``logits`` is the target's distribution at generated position
    ``params.position + i``; its token is :func:`keyed_pick` of it, whatever
    was drafted. Returns lazy scalars: accepted count n, and the token after
    the kept prefix.
    """
    return kept(choose(logits, params), drafts)


def accept_greedy(logits: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """Accepted length (leading drafts equal to the target's greedy tokens) and the next token.

    Args:
        logits: Target logits for ``[last, d1..dk]``, shape [k+1, V].
        drafts: The k draft tokens.

    Returns:
        Lazy scalars: accepted count n, and the target's token after the kept prefix.
    """
    return kept(greedy(logits), drafts)


def kept(picks: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """Drafts kept while they equal the target's picks: their count n, and the pick after them (lazy)."""
    k = drafts.shape[0]
    n = mx.cumprod((drafts == picks[:k]).astype(mx.int32)).sum() if k else mx.array(0)
    return n, picks[n]


def accept_sampled(
    logits: mx.array,
    drafts: mx.array,
    draft_logprobs: Optional[mx.array],
    params: SamplingParams,
) -> tuple[mx.array, mx.array]:
    """Speculative rejection sampling on the device (see the module docstring).

    Args:
        logits: Target logits for ``[last, d1..dk]``, shape [k+1, V].
        drafts: The k draft tokens.
        draft_logprobs: The drafter's log q for each draft position, [k, V'];
            None for a deterministic drafter (q one-hot at the draft). With
            k + 1 rows, the last is the drafter's q at the position after the
            drafts, whose own draft was cut before the verify because it could
            never be accepted (p is 0 there): the token after k accepts is then
            drawn from that row's residual, as the uncut draft's rejection would.
        params: Sampling options, applied to p (and already applied to q).

    Returns:
        Lazy scalars: accepted count n, and the token emitted after the kept prefix.
    """
    p = mx.exp(log_probs(logits, params))
    k, vocab = drafts.shape[0], p.shape[-1]
    cut = draft_logprobs is not None and draft_logprobs.shape[0] > k
    if k == 0 and not cut:
        return mx.array(0), sample(mx.log(p[0]))
    if draft_logprobs is None:
        q = (mx.arange(vocab)[None, :] == drafts[:, None]).astype(mx.float32)
    else:
        q = mx.exp(_fit(draft_logprobs, vocab))
    if cut:
        q, q_after = q[:k], q[k:k + 1]
    else:
        # Row k of q is zero: after k accepts the residual is p itself (the bonus).
        q_after = mx.zeros((1, vocab), dtype=q.dtype)
    if k:
        idx = drafts[:, None].astype(mx.int32)
        p_x = mx.take_along_axis(p[:k], idx, axis=-1)[:, 0]
        q_x = mx.take_along_axis(q, idx, axis=-1)[:, 0]
        u = mx.random.uniform(shape=(k,))
        # u < p/q, written without a division (q(x) > 0 since x was drawn from q).
        keep = (u * q_x < p_x).astype(mx.int32)
        n = mx.cumprod(keep).sum()
    else:
        n = mx.array(0)
    q = mx.concatenate([q, q_after])
    p_n, q_n = p[n], q[n]
    residual = mx.maximum(p_n - q_n, 0.0)
    # p == q leaves nothing to resample from; that branch has probability 0.
    residual = mx.where(residual.sum() > 0, residual, p_n)
    return n, sample(mx.log(residual))


def _fit(logprobs: mx.array, vocab: int) -> mx.array:
    """Trim or pad (with -inf) a drafter's log q to the target's vocabulary size."""
    have = logprobs.shape[-1]
    if have > vocab:
        return logprobs[..., :vocab]
    if have < vocab:
        pad = mx.full((*logprobs.shape[:-1], vocab - have), -mx.inf, dtype=logprobs.dtype)
        return mx.concatenate([logprobs, pad], axis=-1)
    return logprobs
