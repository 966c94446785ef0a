"""Tensor parallelism over a rank count that does not divide the attention heads: whole KV-head groups per rank.

mlx-lm's ``shard()`` splits every projection into equal parts, so the bundled
SmolLM2-135M (9 query heads over 3 KV heads) shards over 3 ranks but not over 2,
the two Macs most people have. Here the attention of llama-style layers (q, k, v
and o projections; ``n_heads`` and ``n_kv_heads``) is split by KV heads,
unevenly: over 2 ranks, 2 KV heads (6 query heads) on rank 0 and 1 (3) on rank
1; the MLP splits evenly, as mlx-lm splits it. Each layer's collectives are the
ones an even split makes (one all-sum after attention, one after the MLP); rank 0
computes more of the attention.
"""

from __future__ import annotations

from typing import Optional

import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear

# Families whose decoder layers are llama's shape (mlx-lm reads mistral as llama; qwen2 adds q/k/v biases, qwen3
# per-head norms). Tested (tests/model/test_distributed.py): llama under mlx.launch, llama and qwen3 layer by layer.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


class _Alone:
    """A group of one, for mlx's ``from_linear``: it slices nothing, and the real group is set after."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def split(n: int, size: int) -> list[tuple[int, int]]:
    """``n`` items over ``size`` ranks: each rank's ``(start, count)``, the first ranks one more."""
    out, start = [], 0
    for r in range(size):
        count = n // size + (1 if r < n % size else 0)
        out.append((start, count))
        start += count
    return out


def _in_features(module: nn.Module) -> int:
    return module.weight.shape[1] * 32 // module.bits if isinstance(module, nn.QuantizedLinear) else module.weight.shape[1]


def problem(model: nn.Module, config: dict, size: int) -> Optional[str]:
    """Why this model cannot be split by KV heads over ``size`` ranks (None: it can)."""
    family = str(config.get("model_type", "unknown"))
    if family not in FAMILIES:
        return f"an uneven split is made for {', '.join(FAMILIES)}, not {family}"
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not all(
                hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "n_heads", "n_kv_heads")) \
                or not all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj")):
            return f"its {family} layers are not llama's shape (q/k/v/o projections and a gated MLP)"
        if attn.n_kv_heads < size:
            n = attn.n_kv_heads
            return f"{n} KV head{'' if n == 1 else 's'} cannot be shared out over {size} ranks (one at least each)"
        hidden = mlp.gate_proj.weight.shape[0]
        if hidden % size:
            return f"its MLP's {hidden} features do not divide by {size}"
        # A quantized layer's input columns are cut on whole quantization groups and whole packed words: o's
        # at KV-head groups, down's at an even share.
        cuts = ((attn.o_proj, _in_features(attn.o_proj) // attn.n_kv_heads, "attention output"),
                (mlp.down_proj, hidden // size, "MLP output"))
        for module, width, what in cuts:
            if isinstance(module, nn.QuantizedLinear) and (width % module.group_size or (width * module.bits) % 32):
                return (f"its {module.bits}-bit {what} cannot be cut every {width} features "
                        f"(groups of {module.group_size})")
    return None if layers else "it has no decoder layers to split"


def _cut(module: nn.Module, start: int, stop: int, axis: int) -> nn.Module:
    """``module`` (a linear or quantized linear) cut down, in place, to output features (``axis`` 0) or input
    features (1) ``start:stop``."""
    params = dict(module.parameters())
    if axis == 0:
        for name in params:
            params[name] = params[name][start:stop]
    else:
        quantized = isinstance(module, nn.QuantizedLinear)
        for name in ("weight", "scales", "biases"):
            if name not in params:
                continue
            if name == "weight" and quantized:
                per = 32 // module.bits  # features per packed word
                params[name] = params[name][:, start // per: stop // per]
            elif quantized:
                params[name] = params[name][:, start // module.group_size: stop // module.group_size]
            else:
                params[name] = params[name][:, start:stop]
    module.update(params, strict=False)
    return module


def _sharded(module: nn.Module, sharding: str, group) -> nn.Module:
    """A local slice as mlx's sharded layer of ``sharding`` over ``group`` (its sums are over the real ranks)."""
    layer = shard_linear(module, sharding, group=_Alone())
    layer.group = group
    return layer


def shard(model: nn.Module, group) -> None:
    """Split ``model``'s attention by KV heads over ``group``'s ranks, its MLP evenly (weights still unread).

    Call :func:`problem` first: this assumes the model fits.
    """
    size, rank = group.size(), group.rank()
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        rep = attn.n_heads // attn.n_kv_heads
        head = _in_features(attn.o_proj) // attn.n_heads
        start, count = split(attn.n_kv_heads, size)[rank]
        q = (start * rep * head, (start + count) * rep * head)
        kv = (start * head, (start + count) * head)
        attn.q_proj = _sharded(_cut(attn.q_proj, *q, axis=0), "all-to-sharded", group)
        attn.k_proj = _sharded(_cut(attn.k_proj, *kv, axis=0), "all-to-sharded", group)
        attn.v_proj = _sharded(_cut(attn.v_proj, *kv, axis=0), "all-to-sharded", group)
        attn.o_proj = _sharded(_cut(attn.o_proj, *q, axis=1), "sharded-to-all", group)
        attn.n_heads, attn.n_kv_heads = count * rep, count
        mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
        mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)


__all__ = ["FAMILIES", "problem", "shard", "split"]
