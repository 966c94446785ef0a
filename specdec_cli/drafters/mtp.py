"""MTP heads: a small model ``(h_t, x_{t+1}) -> logits`` that drafts for its target.

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
none load the same way, from a config.json + model.safetensors sidecar.

Loading (:func:`load_head`) reads the ``mtp.*`` tensors from a target's own
safetensors (mlx-lm's ``sanitize`` drops them) or an MTP sidecar. Qwen stores
the head's RMSNorm weights zero-centred; MLX's RMSNorm multiplies by the
weight, so they need ``w + 1``. Whether to shift is decided by the layout read,
never by the values: ``mtp.``-prefixed (Hugging Face) tensors are shifted,
converted sidecars (mlx-vlm's ``qwen3_5_mtp``, ours) are not.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache
from mlx_lm.models.switch_layers import SwitchGLU

from ..errors import ModelLoadError, UnsupportedModelError
from ..hooks import Hidden, TapSpec, TargetParts
from ..sampling import GREEDY, SamplingParams, draw, keyed_pick, log_probs, top_probability
from .base import Draft, as_tokens, no_draft
from .layers import MLP

# config.json model_type of MTP-only folders: mlx-vlm's converted sidecar, and ours.
SIDECAR_TYPES = ("qwen3_5_mtp", "specdec_mtp")
SPECDEC_TYPE = "specdec_mtp"
# Targets whose own checkpoint can carry an `mtp.*` head we know how to build.
QWEN_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


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
    borrows them from the target (:class:`~specdec_cli.hooks.TargetParts`).

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


class MTPDrafter:
    """Drafting with an MTP head that reads the target's final hidden states.

    The engine hands over the target's final-normed rows of every committed
    position (prompt at prefill, ``[last, d1 .. dn]`` after each verify: no
    second target forward). Each row ``h_t`` waits for its next token
    ``x_{t+1}``; pairs are fed at position t. The first forward of a block
    feeds every pair committed since the last block (with the target's true
    states); the chain after it feeds the head's own outputs and is trimmed
    off at ``accept`` (O(1)), so the head's cache only ever holds pairs built
    from the target's states, as it would after a prefill of the whole text.

    The draft chain stays lazy and is evaluated with the verify forward in one
    host sync, unless ``p_min`` asks for early stopping (one sync per draft).

    Args:
        head: The MTP head.
        parts: The target's embedding and lm_head.
        p_min: Stop drafting when the head's top-1 probability is below this.
    """

    name = "mtp"
    taps = TapSpec(final=True)
    # Pending pairs fed without drafting once this many wait (adaptive plain stretches).
    MAX_PENDING = 32

    def __init__(self, head: MTPHead, parts: TargetParts, p_min: float = 0.0):
        self.head, self.parts, self.p_min = head, parts, p_min
        # A head with a reduced draft vocabulary computes only those rows of the lm_head.
        self._ids = head.draft_ids if head.config.draft_vocab_size else None
        self._logits = parts.sub_logits(self._ids) if self._ids is not None else parts.logits
        self.cache = head.make_cache()
        self._rows: list[mx.array] = []  # target rows h_t still waiting for x_{t+1}
        self._tokens: list[mx.array] = []  # their next tokens, in order
        self._skip_next = False  # a one-token prompt: its token follows no row
        self._exact = 0  # cache offset after the pairs built from target states
        self._drafts: list[mx.array] = []
        self._saved: Optional[tuple] = None
        # While its row shares a batch: the MTPBatch that drafts for it (its cache is a row there).
        self.batch = None

    @property
    def offset(self) -> int:
        return self.cache[0].offset if self.batch is None else self.batch.offset(self)

    def _trim_to(self, offset: int) -> None:
        if self.batch is not None:
            self.batch.trim(self, offset)
            return
        for c in self.cache:
            c.trim(c.offset - offset)

    def _feed(self, rows: mx.array, tokens: mx.array) -> mx.array:
        return self.head(self.parts.embed(tokens)[None], rows[None], self.cache)[0]

    def prefill(self, tokens: Sequence[int], step_size: int = 2048, hidden: Optional[Hidden] = None) -> None:
        """Feed the prompt's pairs: ``h_t`` with token ``t + 1`` (all but the prompt's last token)."""
        rows = hidden.final if hidden is not None else None
        if rows is None and len(tokens):
            raise ValueError("the MTP drafter needs the target's final hidden states of the prompt")
        if rows is None or rows.shape[0] == 0:
            self._skip_next = True
            return
        if rows.shape[0] != len(tokens):
            raise ValueError(f"{rows.shape[0]} hidden rows for {len(tokens)} prompt tokens")
        ids = mx.array(list(tokens[1:]), dtype=mx.uint32)
        for start in range(0, ids.shape[0], step_size):
            stop = min(start + step_size, ids.shape[0])
            self._feed(rows[start:stop], ids[start:stop])
            mx.eval([c.state for c in self.cache])
        self._rows = [rows[-1:]]
        self._exact = self.offset

    def propose(self, last: int | mx.array, k: int, params: SamplingParams = GREEDY) -> Draft:
        """Draft up to ``k`` tokens after ``last``."""
        if self.batch is not None:
            raise RuntimeError("this drafter drafts in its batch (MTPBatch.propose)")
        if not self._begin(last, k):
            return no_draft()
        rows, tokens = self._pairs()
        out = self._feed(rows, tokens)[-1:]
        self._exact = self.offset
        logprobs, syncs = [], 0
        for i in range(k):
            if i:
                out = self._feed(out, self._drafts[-1])
            logits = self._logits(out)
            x, lp = self._pick(logits, params, i)
            if self.p_min > 0:
                top = top_probability(logits, lp)
                syncs += 1
                if top.item() < self.p_min:
                    break
            self._drafts.append(x)
            if lp is not None:
                logprobs.append(lp)
        if not self._drafts:
            return Draft(mx.array([], dtype=mx.uint32), None, syncs)
        return Draft(mx.concatenate(self._drafts), mx.concatenate(logprobs) if logprobs else None, syncs)

    def _begin(self, last: int | mx.array, k: int) -> bool:
        """A block's bookkeeping before its forwards; False: nothing to draft (``last`` waits with the rest)."""
        self._saved = (self.offset, list(self._rows), list(self._tokens), self._skip_next)
        self._drafts = []
        if self._skip_next:
            self._skip_next = False
        else:
            self._tokens.append(as_tokens(last))
        return k > 0 and bool(self._tokens)

    def _pairs(self) -> tuple[mx.array, mx.array]:
        """Every pair waiting to be fed (hidden rows, their next tokens), taken out of the queue."""
        rows, tokens = mx.concatenate(self._rows), mx.concatenate(self._tokens)
        if rows.shape[0] != tokens.shape[0]:
            raise RuntimeError(f"MTP bookkeeping: {rows.shape[0]} hidden rows for {tokens.shape[0]} tokens")
        self._rows, self._tokens = [], []
        return rows, tokens

    def _pick(self, logits: mx.array, params: SamplingParams, i: int) -> tuple[mx.array, Optional[mx.array]]:
        """Draft ``i``'s token (a target id) and its log q over the target's vocabulary (None when greedy)."""
        if params.keyed and self._ids is not None:
            # Keyed draws read the noise by target token id: draw over the target's vocabulary.
            lp = self._full(log_probs(logits, params))
            return keyed_pick(lp, params, offset=i), lp
        x, lp = draw(logits, params, offset=i)
        if self._ids is not None:
            x, lp = self._to_target(x, lp)
        return x, lp

    def _to_target(self, x: mx.array, lp: Optional[mx.array]) -> tuple[mx.array, Optional[mx.array]]:
        """Draft-vocabulary indices -> target token ids; log q over the target's vocabulary (-inf elsewhere)."""
        tokens = self._ids[x].astype(mx.uint32)
        return tokens, None if lp is None else self._full(lp)

    def _full(self, lp: mx.array) -> mx.array:
        """Log q over the draft vocabulary -> over the target's (-inf outside the draft vocabulary)."""
        full = mx.full((*lp.shape[:-1], self.parts.vocab_size), -mx.inf, dtype=lp.dtype)
        index = mx.broadcast_to(self._ids, lp.shape)
        return mx.put_along_axis(full, index, lp, axis=-1)

    def accept(self, n: int, hidden: Optional[Hidden] = None) -> None:
        """The first ``n`` drafts were committed; ``hidden`` holds the target rows of ``[last, d1 .. dn]``."""
        self._saved = None
        # Drop the chain built from the head's own outputs.
        self._trim_to(self._exact)
        if hidden is None or hidden.final is None:
            raise ValueError("the MTP drafter needs the target's final hidden states with every accept")
        self._rows.append(hidden.final)
        self._tokens += self._drafts[:n]
        self._drafts = []
        if len(self._tokens) >= self.MAX_PENDING and self.batch is None:
            # A long stretch without drafting: feed what is known, keep the last row waiting
            # (in a batch, the next block's first forward feeds it).
            rows = mx.concatenate(self._rows)
            self._feed(rows[:-1], mx.concatenate(self._tokens))
            self._rows, self._tokens = [rows[-1:]], []
            self._exact = self.offset
            mx.async_eval([c.state for c in self.cache])

    def follow(self, tokens: mx.array) -> None:
        """This block's drafts came from another drafter: ``accept`` commits them (after a ``propose(last, 0)``)."""
        self._drafts = [tokens[i:i + 1] for i in range(tokens.shape[0])]

    def drafted(self, n: int) -> list[int]:
        """The first ``n`` tokens of this block's draft (a host read; call after the verify)."""
        return mx.concatenate(self._drafts[:n]).tolist() if n and self._drafts else []

    def cancel(self) -> None:
        """Undo the last ``propose``."""
        if self._saved is not None:
            offset, self._rows, self._tokens, self._skip_next = self._saved
            self._trim_to(offset)
            self._exact = offset
            self._saved = None
        self._drafts = []


# ---------------------------------------------------------------------------
# Loading


# mlx-lm shifts these norms of a Qwen3.5 / Qwen3-Next backbone (its `norm_keys`;
# not the GatedDeltaNet gated norm): the head's layer follows the same rule.
_LAYER_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight")
# The head's own norms, zero-centred in the same checkpoints.
_HEAD_NORMS = ("norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")
_EXPERT = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")


def _header(file: Path) -> tuple[list[str], dict]:
    """Tensor names and metadata of a safetensors file, from its header alone."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", None) or {}
    return list(header), meta


def mtp_tensor_files(path: Path) -> dict[Path, list[str]]:
    """The safetensors files under ``path`` holding ``mtp.*`` tensors, with those names."""
    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        listed = {path / f for k, f in weight_map.items() if k.startswith("mtp.")}
        # Files beside the model that the index does not list (an `mtp.safetensors`).
        files = sorted(listed | {f for f in files if f.name not in set(weight_map.values())})
    found = {}
    for file in files:
        names = [k for k in _header(file)[0] if k.startswith("mtp.")]
        if names:
            found[file] = names
    return found


def hf_to_head(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Hugging Face ``mtp.*`` tensors -> the head's parameter names, norms shifted by +1.

    The shift is applied because of the layout (``mtp.``-prefixed tensors from
    the original checkpoint store RMSNorm weights zero-centred), whatever the
    values are. Fused experts (``experts.gate_up_proj``, gate first along axis
    -2) and per-expert tensors (Qwen3-Next) become ``switch_mlp`` stacks.
    """
    out: dict[str, mx.array] = {}
    experts: dict[tuple[str, str, str], dict[int, mx.array]] = {}
    for key, value in weights.items():
        if not key.startswith("mtp."):
            raise ModelLoadError(f"expected an mtp.* tensor, got {key}")
        key = key[len("mtp."):]
        if value.ndim == 1 and (key in _HEAD_NORMS or key.endswith(_LAYER_NORMS)):
            value = value + 1.0
        if m := _EXPERT.fullmatch(key):
            experts.setdefault((m[1], m[3], m[4]), {})[int(m[2])] = value
            continue
        if key.endswith(".experts.gate_up_proj"):
            base = key[: -len(".experts.gate_up_proj")]
            gate, up = mx.split(value, 2, axis=-2)
            out[f"{base}.switch_mlp.gate_proj.weight"] = gate
            out[f"{base}.switch_mlp.up_proj.weight"] = up
            continue
        if key.endswith(".experts.down_proj"):
            out[key[: -len(".experts.down_proj")] + ".switch_mlp.down_proj.weight"] = value
            continue
        out[key] = value
    for (base, proj, kind), per in experts.items():
        if sorted(per) != list(range(len(per))):
            raise ModelLoadError(f"MTP experts of {base} are not numbered 0..{len(per) - 1}")
        out[f"{base}.switch_mlp.{proj}.{kind}"] = mx.stack([per[e] for e in range(len(per))])
    return out


@dataclass
class LoadedHead:
    """A head ready to draft, and where it came from."""

    head: MTPHead
    parts: TargetParts  # the target's embedding and lm_head it drafts through
    source: str  # what the user named (the target, or a sidecar / checkpoint)
    layout: str  # "hf" (mtp.* tensors, norms shifted on load) or "sidecar" (used as stored)


def _quantize(head: MTPHead, weights: dict, quantization: Optional[dict]) -> None:
    if not quantization:
        return

    def predicate(path: str, module: nn.Module):
        if f"{path}.scales" not in weights:
            return False
        spec = quantization.get(path, quantization.get(f"mtp.{path}"))
        if isinstance(spec, dict):
            return spec
        return hasattr(module, "to_quantized")

    nn.quantize(head, group_size=quantization.get("group_size", 64), bits=quantization.get("bits", 4),
                mode=quantization.get("mode", "affine"), class_predicate=predicate)


def build_head(config: MTPConfig, weights: dict[str, mx.array], quantization: Optional[dict] = None,
               what: str = "MTP head") -> MTPHead:
    """Instantiate a head and load ``weights`` (head parameter names) strictly."""
    head = MTPHead(config)
    _quantize(head, weights, quantization)
    want = dict(tree_flatten(head.parameters()))
    missing, extra = sorted(set(want) - set(weights)), sorted(set(weights) - set(want))
    if missing or extra:
        raise ModelLoadError(
            f"{what}: tensors do not match its config (missing {missing[:4]}, unexpected {extra[:4]})"
        )
    for name, value in weights.items():
        if want[name].shape != value.shape:
            raise ModelLoadError(f"{what}: {name} has shape {value.shape}, its config says {want[name].shape}")
    head.load_weights(list(weights.items()))
    head.eval()
    mx.eval(head.parameters())
    return head


def _depth(config: dict) -> Optional[int]:
    tc = config.get("text_config") or config
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        if key in tc:
            return int(tc[key] or 0)
        if key in config:
            return int(config[key] or 0)
    return None


def _refuse_deep(n: int, where: str) -> None:
    if n > 1:
        raise UnsupportedModelError(
            f"{where} has {n} MTP layers; specdec runs heads with one layer (the published implementations "
            "disagree on how several chain): use --drafter lookup or a draft model"
        )


def read_hf_head(path: Path, config: dict, name: str) -> tuple[MTPConfig, dict, Optional[dict]]:
    """The ``mtp.*`` head stored in a Qwen checkpoint directory (its own files or an ``mtp.safetensors``)."""
    model_type = config.get("model_type")
    files = mtp_tensor_files(path)
    if not files:
        depth = _depth(config)
        why = f" although its config declares {depth} MTP layer(s)" if depth else ""
        raise UnsupportedModelError(
            f"{name} has no MTP head: no mtp.* tensors in its safetensors{why} (mlx-lm conversions drop "
            "them); pass --draft-model with the original Hugging Face checkpoint or an MTP sidecar, "
            "or use --drafter lookup"
        )
    if model_type not in QWEN_FAMILIES:
        raise UnsupportedModelError(
            f"{name} ({model_type}) carries mtp.* tensors, but specdec builds checkpoint MTP heads only for "
            f"{', '.join(QWEN_FAMILIES)}; convert the head to a specdec_mtp sidecar"
        )
    names = [k for ks in files.values() for k in ks]
    layers = {int(m[1]) for k in names if (m := re.match(r"mtp\.layers\.(\d+)\.", k))}
    _refuse_deep(max(len(layers), _depth(config) or 0), name)
    raw: dict[str, mx.array] = {}
    for file, keys in files.items():
        loaded = mx.load(str(file))
        raw.update({k: loaded[k] for k in keys})
    family = "qwen3_next" if model_type == "qwen3_next" else "qwen3_5"
    head_config = MTPConfig.from_qwen(config.get("text_config") or config, family)
    # Quantized mtp.* tensors (added to an MLX conversion) follow the target's quantization.
    quant = config.get("quantization") if any(k.endswith(".scales") for k in raw) else None
    return head_config, hf_to_head(raw), quant


def read_sidecar(path: Path, config: dict) -> tuple[MTPConfig, dict, Optional[dict]]:
    """A converted MTP-only folder: mlx-vlm's ``qwen3_5_mtp`` or ours (``specdec_mtp``); used as stored."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    weights: dict[str, mx.array] = {}
    for file in files:
        weights.update(mx.load(str(file)))
    if config["model_type"] == SPECDEC_TYPE:
        head_config = MTPConfig.from_dict(config)
    else:
        tc = config.get("text_config") or {}
        _refuse_deep(_depth(config) or 1, str(path))
        head_config = MTPConfig.from_qwen(tc, "qwen3_5")
    return head_config, weights, config.get("quantization")


def load_head(path: Path, config: dict, name: str, target_parts: TargetParts) -> LoadedHead:
    """Load an MTP head from a model directory or sidecar and check it fits the target.

    Args:
        path: A Qwen checkpoint carrying ``mtp.*`` tensors, or an MTP sidecar folder.
        config: That directory's config.json.
        name: What the user passed (for messages).
        target_parts: The target's embedding / lm_head (for the fit checks).

    Raises:
        UnsupportedModelError: No head there, several MTP layers, or a head made for another model.
        ModelLoadError: Unreadable or inconsistent tensors.
    """
    if config.get("model_type") in SIDECAR_TYPES:
        head_config, weights, quant = read_sidecar(path, config)
        layout = "sidecar"
    else:
        head_config, weights, quant = read_hf_head(path, config, name)
        layout = "hf"
    if head_config.num_experts and not any(".mlp.switch_mlp." in k for k in weights):
        # A dense MTP layer in an MoE model (its mlp_only_layers): the tensors say which.
        head_config = replace(head_config, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
                              shared_expert_intermediate_size=0, norm_topk_prob=False)
    check_fits(head_config, target_parts, name)
    head = build_head(head_config, weights, quant, what=f"the MTP head of {name}")
    if head_config.draft_vocab_size:
        ids = head.draft_ids
        if ids.min().item() < 0 or ids.max().item() >= target_parts.vocab_size:
            raise ModelLoadError(f"the MTP head of {name}: its draft vocabulary names tokens outside the target's")
    return LoadedHead(head, target_parts, name, layout)


# Embedding probe: rows of these token ids (clipped to the vocabulary), first dims.
PROBE_TOKENS = (100, 1000, 5000, 20000)
PROBE_DIMS = 16


def embedding_probe(parts: TargetParts) -> list[float]:
    """A few numbers of the target's token embedding, stored with a distilled head."""
    ids = mx.array([min(t, parts.vocab_size - 1) for t in PROBE_TOKENS], dtype=mx.uint32)
    rows = parts.embed(ids)[:, :PROBE_DIMS].astype(mx.float32)
    return [round(float(x), 5) for x in rows.reshape(-1).tolist()]


def check_fits(config: MTPConfig, parts: TargetParts, name: str) -> None:
    """Refuse a head made for another model (hidden size, vocabulary, embedding probe)."""
    if config.hidden_size != parts.hidden_size:
        raise UnsupportedModelError(
            f"the MTP head in {name} reads hidden states of width {config.hidden_size}, the target's are "
            f"{parts.hidden_size}: it belongs to another model; pass the target's own head"
        )
    if parts.vocab_size and config.vocab_size != parts.vocab_size:
        raise UnsupportedModelError(
            f"the MTP head in {name} was made for a vocabulary of {config.vocab_size} tokens, the target has "
            f"{parts.vocab_size}: it belongs to another model; pass the target's own head"
        )
    if config.target_probe:
        want = mx.array(config.target_probe, dtype=mx.float32)
        have = mx.array(embedding_probe(parts), dtype=mx.float32)
        # Quantizing the target (4-bit, 8-bit) moves the probe by a few percent; another model's is unrelated.
        if want.shape != have.shape or (mx.linalg.norm(want - have) > 0.2 * mx.linalg.norm(want)).item():
            raise UnsupportedModelError(
                f"the MTP head in {name} was trained for another model (its target's token embedding "
                "differs from this one's): train one for this model with specdec distill"
            )


def save_head(path: Path, head: MTPHead) -> Path:
    """Write ``head`` as a ``specdec_mtp`` sidecar (config.json + model.safetensors, MLX convention)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(head.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps({"model_type": SPECDEC_TYPE, **head.config.to_dict()}, indent=2))
    return path


def is_sidecar(config: dict) -> bool:
    """Whether a config.json describes an MTP-only folder."""
    return config.get("model_type") in SIDECAR_TYPES


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

