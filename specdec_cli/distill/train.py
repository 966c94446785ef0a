"""Self-distillation of an MTP head: the target's own distributions are the labels.

The head reads ``(h_t, x_{t+1})`` and is trained to give the target's
distribution at position t+1 (soft cross-entropy against the target's
lm_head on ``h_{t+1}``), over the draft vocabulary. Drafting chains the head
on its own outputs, so training does too ("training-time test", as EAGLE-3
does): step s feeds the head's previous output as the hidden state, at
position t+s-1, attending to the true pairs up to t and to its own chain,
exactly what the head's cache holds when it drafts token s of a block.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map

from ..defaults import DISTILL
from ..drafters.mtp_head import MTPConfig, MTPHead
from ..model.taps import TargetParts


@dataclass(frozen=True)
class TrainConfig:
    """Options of one distillation run.

    Attributes:
        steps: Optimizer steps.
        batch_size: Windows per step.
        seq_len: Positions per window (pairs the head sees in one window).
        lr: Peak learning rate (AdamW; linear warm-up, cosine decay).
        seed: Seeds the head's initialisation and the window order.
        depth: Chained drafting steps trained (1: only the first draft token).
        eval_every: Steps between held-out evaluations (the best head is kept).
        weight_decay: AdamW weight decay.
    """

    steps: int = DISTILL["steps"]
    batch_size: int = DISTILL["batch_size"]
    seq_len: int = DISTILL["seq_len"]
    lr: float = DISTILL["lr"]
    seed: int = DISTILL["seed"]
    depth: int = DISTILL["depth"]
    eval_every: int = 25
    weight_decay: float = 0.01


@dataclass(frozen=True)
class Step:
    """One optimizer step (or an evaluation) of the run, yielded by :meth:`Trainer.run`.

    Attributes:
        step: Steps done.
        steps: Steps planned.
        loss: Training loss of this step (KL from the target, nats per position, mean over depths).
        agreement: Held-out top-1 agreement with the target's greedy token, per
            chained depth, at the latest evaluation (None before the first).
        best: Whether this evaluation gave the best head so far.
        seconds: Training time so far.
    """

    step: int
    steps: int
    loss: float
    agreement: Optional[tuple[float, ...]]
    best: bool
    seconds: float


def head_config(parts: TargetParts, draft_vocab_size: int = 0, intermediate_size: Optional[int] = None) -> MTPConfig:
    """A plain attention + MLP head shaped like the target's own decoder layers.

    The target's ``args`` give heads, KV heads, head width, MLP width, norm
    epsilon and RoPE base; a family that names them otherwise gets the common
    defaults (64-wide heads, an MLP 8/3 as wide as the stream).
    """
    args = getattr(parts.model, "args", None)
    # Multimodal-style families (Qwen3.5) keep the text model's shape in a nested text_config.
    nested = getattr(args, "text_config", None)

    def arg(name: str, default=None):
        if isinstance(nested, dict) and nested.get(name) is not None:
            return nested[name]
        value = getattr(args, name, None)
        return default if value is None else value

    H = parts.hidden_size
    heads = int(arg("num_attention_heads", 0) or max(1, H // 64))
    if H % heads:
        heads = max(1, H // 64)
    kv = int(arg("num_key_value_heads", 0) or heads)
    if heads % kv:
        kv = heads
    head_dim = int(arg("head_dim", 0) or H // heads)
    mlp = intermediate_size or int(arg("intermediate_size", 0) or 0) or int(8 * H / 3)
    rope = arg("rope_parameters") or {}
    return MTPConfig(
        hidden_size=H, vocab_size=parts.vocab_size, num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=head_dim, intermediate_size=mlp, rms_norm_eps=float(arg("rms_norm_eps", 1e-6)),
        rope_theta=float(arg("rope_theta", None) or rope.get("rope_theta") or 10000.0),
        target=arg("model_type"), draft_vocab_size=draft_vocab_size,
    )


def frequent_tokens(sequences: Sequence[Sequence[int]], n: int, vocab: int) -> mx.array:
    """The ``n`` most frequent token ids of ``sequences`` (ties: lower id first), sorted, as int32.

    When the text holds fewer than ``n`` distinct tokens the rest are the lowest unseen ids.
    """
    counts = Counter(t for s in sequences for t in s if 0 <= t < vocab)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:n]
    seen = set(ranked)
    ranked += [t for t in range(vocab) if t not in seen][: n - len(ranked)]
    return mx.array(sorted(ranked), dtype=mx.int32)


class _Chain:
    """A stand-in for the head's KV cache in training: the keys of earlier chain steps, then this one's."""

    def __init__(self, prior: list[tuple[mx.array, mx.array]], offset: int):
        self.prior, self.offset, self.kv = prior, offset, None

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        self.kv = (k, v)
        if not self.prior:
            return k, v
        return (mx.concatenate([p[0] for p in self.prior] + [k], axis=2),
                mx.concatenate([p[1] for p in self.prior] + [v], axis=2))


def chain_mask(length: int, step: int) -> mx.array:
    """Boolean mask of chain step ``step`` (1-based): causal over the true pairs, then only itself in each step."""
    i = mx.arange(length)
    blocks = [i[None, :] <= i[:, None]] + [i[None, :] == i[:, None]] * (step - 1)
    return mx.concatenate(blocks, axis=1)


def windows(sequences: Sequence[Sequence[int]], states: Sequence[mx.array], width: int) -> tuple[mx.array, mx.array]:
    """Cut (tokens, states) into windows of ``width`` positions; the last window of each is end-aligned.

    Sequences shorter than ``width`` are dropped. Returns tokens ``[N, width]``
    and states ``[N, width, H]``.
    """
    toks, rows = [], []
    for seq, h in zip(sequences, states):
        if len(seq) < width:
            continue
        starts = list(range(0, len(seq) - width + 1, width))
        if starts[-1] + width < len(seq):
            starts.append(len(seq) - width)
        ids = mx.array(list(seq), dtype=mx.uint32)
        for s in starts:
            toks.append(ids[s:s + width])
            rows.append(h[s:s + width])
    if not toks:
        return mx.zeros((0, width), dtype=mx.uint32), mx.zeros((0, width, 0))
    return mx.stack(toks), mx.stack(rows)


class Trainer:
    """Trains ``head`` on windows of target text and the target's states at every position.

    Args:
        head: The head to train (its ``draft_ids`` set when it has a draft vocabulary).
        parts: The target's embedding and lm_head (frozen; never updated).
        train: Token windows ``[N, W]`` and their target states ``[N, W, H]``, W = seq_len + depth.
        heldout: The same for evaluation (never trained on).
        config: Options.
    """

    def __init__(self, head: MTPHead, parts: TargetParts, train: tuple[mx.array, mx.array],
                 heldout: tuple[mx.array, mx.array], config: TrainConfig):
        self.head, self.parts, self.config = head, parts, config
        self.tokens, self.states = train
        self.heldout = heldout
        ids = head.draft_ids if head.config.draft_vocab_size else None
        self.ids = ids
        self.sub = parts.sub_logits(ids) if ids is not None else parts.logits
        self.best_params: Optional[dict] = None
        self.best_agreement: Optional[tuple[float, ...]] = None
        self.best_step = 0  # the step whose head :meth:`restore_best` loads
        self._heldout_greedy = self._greedy(heldout[1]) if heldout[0].shape[0] else None

    def coverage(self) -> float:
        """Share of the held-out target greedy tokens inside the draft vocabulary (1.0 without one)."""
        if self._heldout_greedy is None or self.ids is None:
            return 1.0
        inside = mx.zeros((self.parts.vocab_size,), dtype=mx.bool_).at[self.ids].add(True)
        return float(inside[self._heldout_greedy].astype(mx.float32).mean().item())

    def _greedy(self, states: mx.array) -> mx.array:
        # The target's greedy token at every held-out position (over its full vocabulary).
        out = []
        for i in range(states.shape[0]):
            out.append(mx.argmax(self.parts.logits(states[i]), axis=-1).astype(mx.uint32))
            mx.eval(out[-1])
        return mx.stack(out)

    def _chain(self, tokens: mx.array, states: mx.array) -> list[mx.array]:
        """The head's output at each chained step ``[B, T, H]`` (step s drafts token s of a block)."""
        depth = self.config.depth
        T = tokens.shape[1] - depth
        embeds = mx.stop_gradient(self.parts.embed(tokens))
        hidden, prior, outs = states[:, :T], [], []
        for s in range(1, depth + 1):
            cache = _Chain(prior, s - 1)
            hidden = self.head(embeds[:, s:s + T], hidden, [cache], chain_mask(T, s))
            prior = prior + [cache.kv]
            outs.append(hidden)
        return outs

    def loss(self, tokens: mx.array, states: mx.array) -> mx.array:
        """KL(target || head) over the draft vocabulary, nats per position, averaged over chained steps.

        The gradient is the soft cross-entropy's; the teacher's entropy is
        subtracted so that 0 means the head says what the target says.
        """
        T = tokens.shape[1] - self.config.depth
        total = mx.array(0.0)
        for s, out in enumerate(self._chain(tokens, states), 1):
            logp = mx.stop_gradient(nn.log_softmax(self.sub(states[:, s:s + T]).astype(mx.float32), axis=-1))
            logq = nn.log_softmax(self.sub(out).astype(mx.float32), axis=-1)
            total = total + (mx.exp(logp) * (logp - logq)).sum(-1).mean()
        return total / self.config.depth

    def evaluate(self, batch: int = 16) -> tuple[float, ...]:
        """Held-out top-1 agreement with the target's greedy token, per chained step."""
        tokens, states = self.heldout
        hits, _, n = self.hits(tokens, states, self._heldout_greedy, batch=batch)
        return tuple(h / max(n, 1) for h in hits)

    def hits(self, tokens: mx.array, states: mx.array, greedy: Optional[mx.array] = None, first: int = 0,
             batch: int = 16) -> tuple[list[int], list[int], int]:
        """Where the head drafts the target's greedy token: per chained step, alone and in a row; positions counted.

        Position t counts when it drafts token ``t + s + 1`` with ``t >= first``
        (``first`` skips a shared prompt). ``greedy`` is the target's greedy
        token at every position, computed from ``states`` when not given.
        The second list counts step s only where steps 1..s all agree: on the
        target's own greedy text that is what a greedy draft chain gets accepted.
        """
        greedy = self._greedy(states) if greedy is None else greedy
        T = tokens.shape[1] - self.config.depth
        alone, chained = [0] * self.config.depth, [0] * self.config.depth
        for i in range(0, tokens.shape[0], batch):
            outs = self._chain(tokens[i:i + batch], states[i:i + batch])
            in_a_row = None
            for s, out in enumerate(outs, 1):
                pick = mx.argmax(self.sub(out), axis=-1)
                if self.ids is not None:
                    pick = self.ids[pick]
                hit = pick.astype(mx.uint32) == greedy[i:i + batch, s:s + T]
                in_a_row = hit if in_a_row is None else in_a_row & hit
                alone[s - 1] += int(hit[:, first:].sum().item())
                chained[s - 1] += int(in_a_row[:, first:].sum().item())
        return alone, chained, tokens.shape[0] * max(0, T - first)

    def run(self, deadline: Optional[float] = None) -> Iterator[Step]:
        """Train, yielding a :class:`Step` after every optimizer step; the best head is in :attr:`best_params`.

        Args:
            deadline: A ``time.perf_counter()`` time: the first step that ends past it is evaluated and is the last.
        """
        c = self.config
        mx.random.seed(c.seed)
        warmup = max(1, min(50, c.steps // 10))
        schedule = optim.join_schedules(
            [optim.linear_schedule(c.lr / 20, c.lr, warmup), optim.cosine_decay(c.lr, max(1, c.steps - warmup), c.lr / 20)],
            [warmup])
        opt = optim.AdamW(learning_rate=schedule, weight_decay=c.weight_decay)
        grad = nn.value_and_grad(self.head, lambda tokens, states: self.loss(tokens, states))
        n = self.tokens.shape[0]
        if n == 0:
            raise ValueError("no training windows")
        order: list[int] = []
        start = time.perf_counter()
        agreement = None
        for step in range(1, c.steps + 1):
            if len(order) < c.batch_size:
                order += mx.random.permutation(n).tolist()
            pick = mx.array(order[:c.batch_size])
            order = order[c.batch_size:]
            self.head.train()
            loss, grads = grad(self.tokens[pick], self.states[pick])
            opt.update(self.head, grads)
            mx.eval(self.head.parameters(), opt.state, loss)
            best = False
            late = deadline is not None and time.perf_counter() >= deadline
            if step % c.eval_every == 0 or step == c.steps or late:
                agreement = self.evaluate() if self._heldout_greedy is not None else None
                best = self._keep_if_best(agreement)
                if best:
                    self.best_step = step
            yield Step(step, c.steps, loss.item(), agreement, best, time.perf_counter() - start)
            if late:
                break
        self.head.eval()

    def _keep_if_best(self, agreement: Optional[tuple[float, ...]]) -> bool:
        # Expected drafted tokens accepted per block under these agreements (a greedy chain stops at a miss).
        def score(a):
            return sum(math.prod(a[:i + 1]) for i in range(len(a))) if a else 0.0

        # Ties go to the newer head (trained longer).
        if self.best_params is not None and agreement is not None and score(agreement) < score(self.best_agreement):
            return False
        self.best_params = tree_map(lambda x: mx.array(x), dict(tree_flatten(self.head.parameters())))
        self.best_agreement = agreement
        return True

    def restore_best(self) -> None:
        """Load the best head seen into :attr:`head`."""
        if self.best_params is not None:
            self.head.load_weights(list(self.best_params.items()))
        self.head.eval()
