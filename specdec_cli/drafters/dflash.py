"""DFlash block drafters: a whole block of drafts in one forward, read off the target's hidden states.

A DFlash drafter (z-lab's ``DFlashDraftModel``) is a few Qwen3-style layers
with no embedding and no lm_head of their own. Its context is the target's
residual stream after chosen decoder layers (``target_layer_ids``), joined
and projected (``hidden_norm(fc(concat))``); every layer attends from the
query block ``[last, mask x (k)]`` (embedded with the *target's* embedding)
to K/V built from ``[context ; block]``. The target's lm_head on the normed
outputs at the k mask slots gives the k drafts, in one forward.

Only committed positions ever enter the drafter's context cache (the engine
hands over the target's rows of ``[last, d1 .. dn]`` after each verify), and
the block's own K/V are used for one call only, so the drafter never rolls
back: ``cancel`` drops the context rows its last ``propose`` added.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from ..errors import ModelLoadError, UnsupportedModelError
from ..core.sampling import GREEDY, SamplingParams, draw, top_probability
from ..model.taps import Hidden, TapSpec, TargetParts
from .base import Draft, Materials, no_draft
from .layers import MLP

ARCHITECTURE = "DFlashDraftModel"
_LAYER_TYPES = ("full_attention", "sliding_attention")
# Weights some drafters carry that z-lab's DFlash does not use; refused by name
# rather than silently ignored.
_EXTRAS = {
    "embed_tokens": "its own token embedding (DFlash embeds the block with the target's)",
    "lm_head": "its own lm_head (DFlash drafts through the target's)",
    "d2t": "a reduced draft vocabulary (d2t map)",
    "t2d": "a reduced draft vocabulary (t2d map)",
    "mask_embedding": "a learned mask embedding",
    "mask_embed": "a learned mask embedding",
    "candidate_selector": "a DFlash2 candidate selector",
}


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The layer ids z-lab's training code uses when a config names none."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers))


@dataclass(frozen=True)
class DFlashConfig:
    """A ``DFlashDraftModel`` config, read from either published schema.

    Older checkpoints keep ``block_size``, ``rope_theta``/``rope_scaling``,
    ``layer_types`` and ``sliding_window`` at the root and ``mask_token_id``/
    ``target_layer_ids`` in ``dflash_config``; newer ones move ``block_size``
    into ``dflash_config`` and RoPE into ``rope_parameters``.
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position_embeddings: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: Optional[int]
    vocab_size: Optional[int]
    layer_types: tuple[str, ...]
    sliding_window: Optional[int]
    causal: Optional[bool]
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None
    # The block size to run by default when smaller than the trained one.
    runtime_block_size: Optional[int] = None

    @classmethod
    def from_dict(cls, cfg: dict) -> "DFlashConfig":
        """Parse and check a config.json dict.

        Raises:
            UnsupportedModelError: Not a DFlashDraftModel (DFlash2 is named),
                a missing mask token id, or options this drafter does not implement.
        """
        archs = cfg.get("architectures") or []
        if "DFlash2DraftModel" in archs:
            raise UnsupportedModelError(
                "this is a DFlash2DraftModel checkpoint (grouped convolutions and a candidate selector), "
                "which specdec does not implement yet: use a DFlashDraftModel drafter"
            )
        if ARCHITECTURE not in archs:
            raise UnsupportedModelError(f"not a {ARCHITECTURE} checkpoint (architectures: {archs})")
        d = cfg.get("dflash_config") or {}

        def pick(name, default=None):
            return d[name] if d.get(name) is not None else cfg.get(name, default)

        for name in ("conv_kernel_size", "selector_rank", "selector_top_k"):
            if pick(name):
                raise UnsupportedModelError(f"the drafter's config sets {name} (a DFlash2 feature), which specdec does not implement")
        for name, what in (("draft_window_size", "a windowed drafter context"), ("attention_sink_bias", "attention sinks")):
            if pick(name):
                raise UnsupportedModelError(f"the drafter's config sets {name} ({what}), which specdec does not implement")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise UnsupportedModelError("the DFlash drafter uses biases in its projections, which specdec does not implement")
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModelError("the DFlash drafter uses partial rotary embeddings, which specdec does not implement")
        if cfg.get("quantization") or cfg.get("quantization_config"):
            raise UnsupportedModelError("quantized DFlash drafters are not supported: use the unquantized checkpoint")
        mask = pick("mask_token_id")
        if mask is None:
            raise UnsupportedModelError(
                "the DFlash config names no mask_token_id (dflash_config.mask_token_id): specdec will not guess one"
            )
        try:
            layers = int(cfg["num_hidden_layers"])
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
            theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
            layer_types = tuple(cfg.get("layer_types") or ("full_attention",) * layers)
            ntl = pick("num_target_layers")
            ids = pick("target_layer_ids")
            if ids is None:
                if ntl is None:
                    raise UnsupportedModelError("the DFlash config names neither target_layer_ids nor num_target_layers")
                ids = default_target_layer_ids(int(ntl), layers)
            causal = pick("causal")
            if causal is None:
                causal = cfg.get("is_causal")
            softcap = pick("final_logit_softcapping")
            config = cls(
                hidden_size=hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                rope_scaling=rope,
                max_position_embeddings=int(cfg.get("max_position_embeddings") or 32768),
                block_size=int(pick("block_size", 16)),
                mask_token_id=int(mask),
                target_layer_ids=tuple(int(i) for i in ids),
                num_target_layers=None if ntl is None else int(ntl),
                vocab_size=None if cfg.get("vocab_size") is None else int(cfg["vocab_size"]),
                layer_types=layer_types,
                sliding_window=None if cfg.get("sliding_window") is None else int(cfg["sliding_window"]),
                causal=None if causal is None else bool(causal),
                input_embedding_scale=float(pick("input_embedding_scale", 1.0)),
                output_multiplier=float(pick("output_multiplier", 1.0)),
                final_logit_softcapping=float(softcap) if softcap else None,
                runtime_block_size=None if pick("runtime_block_size") is None else int(pick("runtime_block_size")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise UnsupportedModelError(f"the DFlash config is incomplete or malformed ({type(e).__name__}: {e})") from None
        if len(layer_types) != layers:
            raise UnsupportedModelError(f"the DFlash config lists {len(layer_types)} layer_types for {layers} layers")
        unknown = set(layer_types) - set(_LAYER_TYPES)
        if unknown:
            raise UnsupportedModelError(f"the DFlash config has layer types specdec does not know: {sorted(unknown)}")
        if "sliding_attention" in layer_types and not config.sliding_window:
            raise UnsupportedModelError("the DFlash config has sliding_attention layers but no sliding_window")
        if config.block_size < 2 or not config.target_layer_ids:
            raise UnsupportedModelError("the DFlash config needs block_size >= 2 and at least one target layer")
        return config

    @property
    def default_block_size(self) -> int:
        """The block size to run unless asked otherwise (``runtime_block_size`` may lower it)."""
        return min(self.block_size, max(2, self.runtime_block_size or self.block_size))

    def is_causal(self, layer: int) -> bool:
        """Attention within the block: the config's choice, else causal for sliding layers only."""
        if self.causal is not None:
            return self.causal
        return self.layer_types[layer] == "sliding_attention"

    def window(self, layer: int) -> Optional[int]:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


def check_target(config: DFlashConfig, parts: TargetParts) -> None:
    """Refuse a drafter trained for a different target, naming what differs.

    Raises:
        UnsupportedModelError: Layer count, hidden size, vocabulary or layer ids do not match.
    """
    fix = "use the DFlash drafter published for this target model"
    if config.num_target_layers is not None and config.num_target_layers != parts.num_layers:
        raise UnsupportedModelError(
            f"the DFlash drafter was trained on a {config.num_target_layers}-layer target, this target has "
            f"{parts.num_layers} layers: {fix}"
        )
    if config.hidden_size != parts.hidden_size:
        raise UnsupportedModelError(
            f"the DFlash drafter's hidden size is {config.hidden_size}, the target's is {parts.hidden_size}: {fix}"
        )
    if config.vocab_size is not None and parts.vocab_size and config.vocab_size != parts.vocab_size:
        raise UnsupportedModelError(
            f"the DFlash drafter's vocabulary has {config.vocab_size} tokens, the target's {parts.vocab_size}: {fix}"
        )
    bad = [i for i in config.target_layer_ids if not 0 <= i < parts.num_layers]
    if bad:
        raise UnsupportedModelError(
            f"the DFlash drafter reads target layers {bad}, but the target has {parts.num_layers} layers: {fix}"
        )
    if parts.vocab_size and not 0 <= config.mask_token_id < parts.vocab_size:
        raise UnsupportedModelError(
            f"the DFlash mask token id {config.mask_token_id} is outside the target's vocabulary ({parts.vocab_size})"
        )


class _Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.causal, self.window = cfg.is_causal(layer), cfg.window(layer)
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def kv(self, x: mx.array, rope: nn.Module, offset: int) -> tuple[mx.array, mx.array]:
        """Keys (k-normed, rotated from ``offset``) and values of ``x`` [1, T, H]."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, T, self.kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, T, self.kv_heads, -1).transpose(0, 2, 1, 3)
        return rope(k, offset=offset), v

    def _mask(self, ctx: int, L: int) -> Optional[mx.array]:
        if not self.causal and self.window is None:
            return None  # every key visible
        return self.rows_mask([ctx], [L], L)[0, 0]

    def rows_mask(self, lengths: Sequence[int], sizes: Sequence[int], L: int) -> mx.array:
        """``[B, 1, L, S]`` for rows of their own context ``lengths`` whose blocks hold ``sizes[b]`` of the
        ``L`` positions: what row ``b`` sees alone, the padding after its block hidden from it."""
        n = mx.array(list(lengths), dtype=mx.int32)[:, None, None]
        size = mx.array(list(sizes), dtype=mx.int32)[:, None, None]
        t = mx.arange(L, dtype=mx.int32)[None, :, None]
        q = n + t
        k = mx.arange(max(lengths) + L, dtype=mx.int32)[None, None]
        visible = k < n + size
        if self.causal:
            visible = visible & (k <= q)
        if self.window is not None:
            visible = visible & (q - k < self.window)
            if not self.causal:
                visible = visible & (k - q < self.window)
        # A padding query sees the first column: never a row of nothing to attend to (its output is dropped).
        return (visible | ((t >= size) & (k == 0)))[:, None]

    def __call__(self, x: mx.array, rope: nn.Module, cache: Any, mask: Optional[mx.array] = None) -> mx.array:
        # Alone: a KVCache, the mask built here. Rows of a batch: a RowsKVCache (offsets per row), their mask given.
        B, L, _ = x.shape
        ctx = cache.offset
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.heads, -1)).transpose(0, 2, 1, 3)
        q = rope(q, offset=ctx)
        # The block's K/V go after the context in the cache's buffer (no copy of the
        # context); the model trims them off once every layer has run.
        k, v = cache.update_and_fetch(*self.kv(x, rope, ctx))
        if mask is None:
            mask = self._mask(ctx, L)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class _Layer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer: int):
        super().__init__()
        self.self_attn = _Attention(cfg, layer)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x: mx.array, rope: nn.Module, cache: Any, mask: Optional[mx.array] = None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), rope, cache, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashModel(nn.Module):
    """The drafter's own weights: context projection and draft layers.

    Parameter names are the publisher's (``fc``, ``hidden_norm``, ``norm``,
    ``layers.{i}.self_attn.*``, ``layers.{i}.mlp.*``).
    """

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.layers = [_Layer(config, i) for i in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.rope = initialize_rope(config.head_dim, config.rope_theta, False, config.rope_scaling,
                                    config.max_position_embeddings)

    def make_cache(self) -> list[KVCache]:
        """One context K/V cache per layer (every key kept; windows apply in the mask)."""
        return [KVCache() for _ in self.layers]

    def add_context(self, hidden: Hidden, cache: list[KVCache]) -> None:
        """Project the target's rows ``hidden`` (consecutive positions) into every layer's context K/V."""
        self._add(mx.concatenate(list(hidden.layers), axis=-1)[None], cache)

    def _add(self, feats: mx.array, cache: list) -> None:
        ctx = self.hidden_norm(self.fc(feats.astype(self.fc.weight.dtype)))
        for layer, c in zip(self.layers, cache):
            k, v = layer.self_attn.kv(ctx, self.rope, c.offset)
            c.update_and_fetch(k, v)

    def add_context_rows(self, feats: mx.array, widths: Sequence[int], cache: list) -> None:
        """Rows of a batch: row ``b``'s first ``widths[b]`` of ``feats`` ``[B, W, layers x H]`` (the target's
        rows, joined) join its context in every layer's ``RowsKVCache``; what padding computed is dropped."""
        before = list(cache[0].lengths)
        self._add(feats, cache)
        for c in cache:
            c.set_lengths([n + w for n, w in zip(before, widths)])

    def rows(self, block: mx.array, sizes: Sequence[int], cache: list) -> mx.array:
        """Normed outputs ``[B, L, H]`` of rows' embedded blocks ``[B, L, H]`` (row ``b``'s first ``sizes[b]``
        positions its own, the rest padding) after each row's context in every layer's ``RowsKVCache``."""
        lengths = list(cache[0].lengths)
        L = block.shape[1]
        h = block.astype(self.fc.weight.dtype)
        try:
            for layer, c in zip(self.layers, cache):
                h = layer(h, self.rope, c, layer.self_attn.rows_mask(lengths, sizes, L))
        finally:
            for c in cache:
                c.set_lengths(lengths)  # the blocks' K/V serve this call only, as alone
        return self.norm(h)

    def __call__(self, block: mx.array, cache: list[KVCache]) -> mx.array:
        """Normed outputs [L, H] of the embedded block [L, H] after the cached context."""
        context = cache[0].offset
        h = block[None].astype(self.fc.weight.dtype)
        try:
            for layer, c in zip(self.layers, cache):
                h = layer(h, self.rope, c)
        finally:
            # The block's own K/V serve this call only: the context is what stays.
            for c in cache:
                c.trim(c.offset - context)
        return self.norm(h)[0]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Strip a ``model.`` prefix and refuse weights this drafter would not use.

        Raises:
            UnsupportedModelError: Extra weights (named with what they are).
            ModelLoadError: Missing weights.
        """
        out = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in weights.items()}
        expected = {k for k, _ in _flatten(self.parameters())}
        extra = sorted(set(out) - expected)
        if extra:
            known = [why for name, why in _EXTRAS.items() if any(k.split(".")[0] == name for k in extra)]
            what = "; ".join(dict.fromkeys(known)) if known else "weights it does not expect"
            raise UnsupportedModelError(
                f"the DFlash checkpoint carries {what} ({', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''}), "
                "which specdec does not use: refusing rather than ignoring them"
            )
        missing = sorted(expected - set(out))
        if missing:
            raise ModelLoadError(f"the DFlash checkpoint lacks weights: {', '.join(missing[:4])}")
        return out


def _flatten(params: Any, prefix: str = "") -> list[tuple[str, mx.array]]:
    from mlx.utils import tree_flatten

    return tree_flatten(params, prefix)


class DFlashDrafter:
    """Drafts up to block size - 1 tokens in one forward of a DFlash drafter.

    Greedy at temperature 0; at temperature > 0 each slot's token is drawn
    from the drafter's distribution q after the same transforms as the
    target's, and q goes to the engine's rejection sampling (lossless).

    The drafts stay lazy: the engine evaluates them with its verify forward
    in one host sync. ``p_min`` drops the slots from the first one whose top
    probability is below it; the cut is computed on the device and read back
    in one extra sync (the verify's length must be known to build it).

    Args:
        model: The loaded drafter.
        parts: The target's embedding and lm_head (:func:`~specdec_cli.model.taps.target_parts`).
        p_min: Keep drafts while the drafter's top-1 probability is at least this.
    """

    name = "dflash"

    def __init__(self, model: DFlashModel, parts: TargetParts, p_min: float = 0.0):
        check_target(model.config, parts)
        self.model, self.parts, self.p_min = model, parts, p_min
        self.config = model.config
        self.taps = TapSpec(layers=self.config.target_layer_ids)
        self.cache = model.make_cache()
        # Committed rows not yet projected into the context cache.
        self._pending: list[Hidden] = []
        self._undo: Optional[tuple[int, list[Hidden]]] = None
        # While its row shares a batch: the DFlashBatch that drafts for it (its cache is a row there).
        self.batch = None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def context_length(self) -> int:
        """Positions in the context cache."""
        return self.cache[0].offset if self.batch is None else self.batch.offset(self)

    def prefill(self, tokens: Sequence[int], step_size: int = 2048, hidden: Optional[Hidden] = None) -> None:
        """Project the prompt's rows (all prompt tokens but the last) into the context cache."""
        if hidden is None or hidden.length != len(tokens):
            raise ValueError("the DFlash drafter needs the target's hidden states of every prompt token but the last")
        for start in range(0, hidden.length, max(step_size, 1)):
            self.model.add_context(hidden.rows(start, start + step_size), self.cache)
            mx.eval([a for c in self.cache for a in (c.keys, c.values)])

    def _flush(self) -> None:
        rows = Hidden.concat(self._pending)
        self._pending = []
        if rows.length:
            self.model.add_context(rows, self.cache)

    def block_logits(self, last: int, k: int) -> mx.array:
        """The drafter's logits for ``k`` slots after ``last`` (lazy, [k, V]); adds pending context."""
        self._flush()
        ids = mx.array([int(last)] + [self.config.mask_token_id] * k, dtype=mx.uint32)
        emb = self.embed(ids)
        return self.logits(self.model(emb, self.cache)[1:])

    def embed(self, ids: mx.array) -> mx.array:
        """The target's embedding of a block's ids, scaled as the drafter reads it."""
        emb = self.parts.embed(ids)
        if self.config.input_embedding_scale != 1.0:
            emb = emb * self.config.input_embedding_scale
        return emb

    def logits(self, h: mx.array) -> mx.array:
        """The drafts' logits from the drafter's normed outputs at their slots, through the target's lm_head."""
        logits = self.parts.head(h)
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping or self.parts.softcap
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits

    def propose(self, last: int, k: int, params: SamplingParams = GREEDY) -> Draft:
        """Draft up to ``k`` (at most block size - 1) tokens after ``last``."""
        if self.batch is not None:
            raise RuntimeError("this drafter drafts in its batch (DFlashBatch.propose)")
        self._undo = (self.context_length, list(self._pending))
        k = min(k, self.config.block_size - 1)
        if k <= 0:
            return no_draft()
        logits = self.block_logits(last, k)
        tokens, lp = draw(logits, params)
        if self.p_min <= 0:
            return Draft(tokens, lp)
        top = top_probability(logits, lp)
        m = mx.cumprod((top >= self.p_min).astype(mx.int32)).sum().item()
        if m == 0:
            return Draft(mx.array([], dtype=mx.uint32), None, 1)
        return Draft(tokens[:m], None if lp is None else lp[:m], 1)

    def accept(self, n: int, hidden: Optional[Hidden] = None) -> None:
        """The target's rows of ``[last, d1 .. dn]`` join the context (projected with the next block)."""
        if hidden is None or hidden.length != n + 1:
            raise ValueError("the DFlash drafter needs the target's rows of every committed position")
        self._pending.append(hidden)

    def cancel(self) -> None:
        """Undo the last ``propose`` (and an ``accept`` after it): back to the context before it."""
        if self._undo is None:
            return
        length, pending = self._undo
        if self.batch is not None:
            self.batch.trim(self, length)
        else:
            for c in self.cache:
                c.trim(c.offset - length)
        self._pending = pending
        self._undo = None


def load_dflash_model(config: dict, weights: dict[str, mx.array]) -> DFlashModel:
    """Build a drafter from a config.json dict and its safetensors weights.

    Raises:
        UnsupportedModelError: Not a DFlashDraftModel, or unsupported options/extras.
        ModelLoadError: Missing or misshapen weights.
    """
    if any(k.endswith(".scales") for k in weights):
        raise UnsupportedModelError("quantized DFlash drafters are not supported: use the unquantized checkpoint")
    model = DFlashModel(DFlashConfig.from_dict(config))
    weights = model.sanitize(weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"the DFlash weights do not fit its config: {e}") from None
    mx.eval(model.parameters())
    return model


def build(m: Materials) -> DFlashDrafter:
    """A DFlash drafter (the ``dflash`` kind): its model and the target's parts it reuses."""
    return DFlashDrafter(m.draft_model, m.parts, p_min=m.p_min)


__all__ = [
    "ARCHITECTURE",
    "DFlashConfig",
    "DFlashDrafter",
    "DFlashModel",
    "check_target",
    "default_target_layer_ids",
    "load_dflash_model",
]
