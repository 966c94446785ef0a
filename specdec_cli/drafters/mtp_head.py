"""An MTP head's architecture: a small model ``(h_t, x_{t+1}) -> o_t`` whose logits come from the target.

A multi-token-prediction head (Qwen3.5/3.6, Qwen3-Next; DeepSeek-V3 style)
reads the target's final-normed hidden state ``h_t`` (the tensor its lm_head
reads) and the embedding of the next token ``x_{t+1}``:

    e = pre_fc_norm_embedding(embed(x_{t+1}));  h = pre_fc_norm_hidden(h_t)
    o = norm(layer(fc(concat([e, h]))))         # one attention + MLP layer
    logits = lm_head(o)                         # the target's own lm_head

The pair sits at RoPE position t; the head's attention layer keeps its own KV
cache over those positions (an attention cache: it trims in O(1)). For a
draft of depth > 1 the head's own normed output ``o`` becomes the next ``h``
and the same layer is reused, as mlx-vlm's ``qwen3_5_mtp`` drafter does.

The head is a standalone model with its own :class:`MTPConfig` (a plain
attention + MLP layer of any width fits: the Qwen gate, q/k norms, partial
RoPE and sparse-MoE MLP are options), so heads trained for models that ship
none load the same way (:mod:`specdec_cli.drafters.mtp_io`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache
from mlx_lm.models.switch_layers import SwitchGLU

from ..errors import ModelLoadError, UnsupportedModelError
from .layers import MLP


@dataclass(frozen=True)
class MTPConfig:
    """Shape of an MTP head: one decoder layer between two norms and an fc.

    Attributes:
        hidden_size: Width of the target's residual stream (and the head's).
        vocab_size: The target's vocabulary (the head uses the target's embedding and lm_head).
        num_attention_heads: Query heads.
        num_key_value_heads: Key/value heads (grouped-query attention).
        head_dim: Width of one attention head.
        intermediate_size: Dense MLP width (SwiGLU).
        rms_norm_eps: Epsilon of every RMSNorm.
        rope_theta: RoPE base.
        partial_rotary_factor: Share of ``head_dim`` rotated (1.0: all of it).
        attention_gate: The query projection also emits a per-head sigmoid
            output gate (Qwen3.5 / Qwen3-Next gated attention).
        qk_norm: RMSNorm on queries and keys per head.
        attention_bias: Biases on the q/k/v/o projections.
        num_experts: 0 for a dense MLP; otherwise a sparse-MoE MLP (routed
            SwiGLU experts plus a sigmoid-gated shared expert, Qwen3-Next style).
        num_experts_per_tok: Experts each token is routed to.
        moe_intermediate_size: Width of one routed expert.
        shared_expert_intermediate_size: Width of the shared expert.
        norm_topk_prob: Renormalise the chosen experts' router probabilities.
        num_layers: Decoder layers (only 1 is supported).
        target: The model type the head was made for (informational).
        draft_vocab_size: 0 drafts over the whole vocabulary; N > 0 over the N
            target tokens the head stores in ``draft_ids`` (the lm_head then
            costs N/V as much; the target still verifies every token).
        target_probe: A few numbers of the target's token embedding
            (:func:`embedding_probe`), stored by heads trained for a model
            that has no MTP head of its own: a target whose embedding differs
            is another model, even with the same shapes.
    """

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    attention_gate: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    num_layers: int = 1
    target: Optional[str] = None
    draft_vocab_size: int = 0
    target_probe: Optional[list] = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MTPConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names - {"model_type", "quantization", "quantization_config"})
        if unknown:
            raise ModelLoadError(f"unknown MTP head config keys {unknown}: is this a specdec_mtp sidecar?")
        try:
            return cls(**{k: v for k, v in d.items() if k in names})
        except TypeError as e:
            raise ModelLoadError(f"MTP head config: {e}") from None

    @classmethod
    def from_qwen(cls, tc: dict, family: str) -> "MTPConfig":
        """The head of a Qwen3.5/3.6 (``text_config``) or Qwen3-Next (top-level) config.

        Defaults and RoPE fields are read as mlx-lm reads that family's
        backbone (Qwen3.5: ``rope_parameters``; Qwen3-Next: top-level keys).
        """
        heads = tc["num_attention_heads"]
        head_dim = tc.get("head_dim") or tc["hidden_size"] // heads
        if family == "qwen3_next":
            theta, partial = tc.get("rope_theta", 10000.0), tc.get("partial_rotary_factor", 1.0)
            scaling = tc.get("rope_scaling")
            norm_topk = tc.get("norm_topk_prob", False)
        else:
            rope = tc.get("rope_parameters") or {"rope_theta": 100000.0, "partial_rotary_factor": 0.25}
            theta, partial = rope.get("rope_theta", 100000.0), rope.get("partial_rotary_factor", 0.25)
            scaling = rope
            norm_topk = tc.get("norm_topk_prob", True)
        kind = (scaling or {}).get("type", (scaling or {}).get("rope_type", "default"))
        if kind not in ("default", None):
            raise UnsupportedModelError(f"the MTP head uses RoPE scaling {kind!r}, which specdec does not build")
        experts = int(tc.get("num_experts", 0) or 0)
        return cls(
            hidden_size=tc["hidden_size"],
            vocab_size=tc["vocab_size"],
            num_attention_heads=heads,
            num_key_value_heads=tc.get("num_key_value_heads", heads),
            head_dim=head_dim,
            intermediate_size=tc.get("intermediate_size", 0),
            rms_norm_eps=tc.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            partial_rotary_factor=float(partial),
            attention_gate=True,
            qk_norm=True,
            attention_bias=tc.get("attention_bias", False),
            num_experts=experts,
            num_experts_per_tok=tc.get("num_experts_per_tok", 0) if experts else 0,
            moe_intermediate_size=tc.get("moe_intermediate_size", 0) if experts else 0,
            shared_expert_intermediate_size=tc.get("shared_expert_intermediate_size", 0) if experts else 0,
            norm_topk_prob=bool(norm_topk) if experts else False,
            num_layers=1,
            target=tc.get("model_type"),
        )


class Attention(nn.Module):
    """Causal self-attention, optionally gated, with q/k norms and partial RoPE."""

    def __init__(self, c: MTPConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.gated = c.attention_gate
        width = self.n_heads * self.head_dim
        self.q_proj = nn.Linear(c.hidden_size, width * (2 if self.gated else 1), bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(width, c.hidden_size, bias=c.attention_bias)
        if c.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=c.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=c.rms_norm_eps)
        self.rope = nn.RoPE(int(self.head_dim * c.partial_rotary_factor), traditional=False, base=c.rope_theta)

    def __call__(self, x: mx.array, cache: KVCache, mask: Optional[mx.array] = None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x)
        if self.gated:
            # Each head's slice is [query | gate], as Qwen stores it.
            q, gate = mx.split(q.reshape(B, L, self.n_heads, 2 * self.head_dim), 2, axis=-1)
            gate = gate.reshape(B, L, -1)
        else:
            q = q.reshape(B, L, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(B, L, self.n_kv, self.head_dim)
        v = self.v_proj(x).reshape(B, L, self.n_kv, self.head_dim).transpose(0, 2, 1, 3)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        # "causal" aligns the queries to the end of the keys: the cached prefix is visible.
        if mask is None and L > 1:
            mask = "causal"
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5, mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        if self.gated:
            out = out * mx.sigmoid(gate)
        return self.o_proj(out)


class SparseMoE(nn.Module):
    """Routed SwiGLU experts plus a sigmoid-gated shared expert (Qwen3-Next / Qwen3.5-MoE).

    The routed experts are mlx-lm's ``SwitchGLU`` layer (a public building
    block with a quantized form), not a hook into a model.
    """

    def __init__(self, c: MTPConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = c.num_experts_per_tok, c.norm_topk_prob
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(c.hidden_size, c.moe_intermediate_size, c.num_experts)
        self.shared_expert = MLP(c.hidden_size, c.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        probs = mx.softmax(self.gate(x), axis=-1, precise=True)
        k = self.top_k
        inds = mx.stop_gradient(mx.argpartition(probs, kth=-k, axis=-1)[..., -k:])
        scores = mx.take_along_axis(probs, inds, axis=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        y = (self.switch_mlp(x, inds) * scores[..., None]).sum(axis=-2)
        return y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class DecoderLayer(nn.Module):
    def __init__(self, c: MTPConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = SparseMoE(c) if c.num_experts else MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCache, mask: Optional[mx.array] = None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class MTPHead(nn.Module):
    """The head as a model: ``(embeddings of x_{t+1}, h_t) -> normed output o_t``.

    The target's embedding and lm_head are not part of it: :class:`MTPDrafter`
    borrows them from the target (:class:`~specdec_cli.model.taps.TargetParts`).

    Args:
        config: The head's shape.
    """

    def __init__(self, config: MTPConfig):
        super().__init__()
        if config.num_layers != 1:
            raise UnsupportedModelError(
                f"this MTP head has {config.num_layers} layers; specdec runs heads with one layer "
                "(the published implementations disagree on how several chain)"
            )
        self.config = config
        H = config.hidden_size
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = [DecoderLayer(config)]
        self.norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        if config.draft_vocab_size:
            # The target token ids the head drafts among (stored with the weights, never trained).
            self.draft_ids = mx.zeros((config.draft_vocab_size,), dtype=mx.int32)
            self.freeze(keys=["draft_ids"], recurse=False)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: list, mask: Optional[mx.array] = None) -> mx.array:
        """Pairs at positions ``cache[0].offset ..``; inputs and output ``[B, T, H]``.

        ``mask`` (boolean, queries x keys) replaces the causal mask; training
        uses it to attend from chained positions to the true ones.
        """
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1))
        for layer, c in zip(self.layers, cache):
            x = layer(x, c, mask)
        return self.norm(x)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]


def random_head(config: MTPConfig, seed: int = 0, dtype: mx.Dtype = mx.float32, norm_noise: float = 0.1) -> MTPHead:
    """A random-weight head (tests, benchmarks); norms are 1 + noise so a lost +1 shows."""
    mx.random.seed(seed)
    head = MTPHead(config)
    params = []
    for k, v in tree_flatten(head.parameters()):
        if k == "draft_ids":
            # Every other token of the vocabulary: drafts outside it show.
            params.append((k, mx.arange(config.draft_vocab_size, dtype=mx.int32) * 2 % config.vocab_size))
            continue
        if k.endswith("norm.weight") or k.endswith("layernorm.weight"):
            v = v + norm_noise * mx.random.normal(v.shape)
        params.append((k, v.astype(dtype)))
    head.load_weights(params)
    head.eval()
    mx.eval(head.parameters())
    return head
