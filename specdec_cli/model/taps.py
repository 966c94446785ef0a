"""Hidden-state taps: the target's internals that drafters read.

DFlash and MTP drafters need the target's hidden states from the verify
forward the engine runs anyway, but mlx-lm's models return only logits. So a
:class:`HiddenTap` changes the model objects for as long as it is open (a
one-off subclass per chosen layer instance, all or none of them), and
:func:`target_parts` checks on a probe forward that the embedding and lm_head
it found reproduce the model's logits, so an mlx-lm release that moves them
fails before the first token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..errors import UnsupportedModelError

# Where mlx-lm keeps the decoder stack, and what its final norm is called.
_BACKBONES = ("language_model.model", "model", "backbone", "model.language_model", "transformer")
_FINAL_NORMS = ("norm", "norm_f", "final_layernorm", "final_norm", "ln_f")


@dataclass(frozen=True)
class TapSpec:
    """Which hidden states a drafter reads from the target.

    Attributes:
        layers: Decoder layer ids whose output (the residual stream, no final
            norm; Hugging Face's ``hidden_states[id + 1]``) is recorded, in this order.
        final: Also record the final-normed state (the tensor the lm_head reads).
    """

    layers: tuple[int, ...] = ()
    final: bool = False


@dataclass(frozen=True)
class Hidden:
    """Hidden states of consecutive positions, each ``[T, H]``.

    Attributes:
        layers: One array per :attr:`TapSpec.layers` id, in that order.
        final: The final-normed state, when the spec asked for it.
    """

    layers: tuple[mx.array, ...] = ()
    final: Optional[mx.array] = None

    @property
    def length(self) -> int:
        first = self.layers[0] if self.layers else self.final
        return 0 if first is None else first.shape[0]

    def rows(self, start: int, stop: int) -> "Hidden":
        """Positions ``start:stop``."""
        return Hidden(
            tuple(h[start:stop] for h in self.layers),
            None if self.final is None else self.final[start:stop],
        )

    @staticmethod
    def concat(parts: Sequence["Hidden"]) -> "Hidden":
        """Join consecutive runs of positions."""
        parts = [p for p in parts if p.length]
        if not parts:
            return Hidden()
        if len(parts) == 1:
            return parts[0]
        layers = tuple(mx.concatenate(cols) for cols in zip(*(p.layers for p in parts)))
        final = None if parts[0].final is None else mx.concatenate([p.final for p in parts])
        return Hidden(layers, final)


def _get(obj: Any, dotted: str) -> Any:
    for name in dotted.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def _backbone(model: nn.Module) -> tuple[nn.Module, list, str, Any]:
    """(decoder stack module, its layer list, final norm attribute, the module holding lm_head)."""
    for dotted in _BACKBONES:
        stack = _get(model, dotted)
        if not isinstance(stack, nn.Module):
            continue
        layers = stack.get("layers") if isinstance(stack, dict) else None
        if not (isinstance(layers, list) and layers and all(isinstance(l, nn.Module) for l in layers)):
            continue
        norm = next((n for n in _FINAL_NORMS if isinstance(stack.get(n), nn.Module)), None)
        if norm is None:
            continue
        parent = _get(model, dotted.rsplit(".", 1)[0]) if "." in dotted else model
        return stack, layers, norm, parent
    raise UnsupportedModelError(
        f"specdec cannot find the decoder layers and final norm of {type(model).__module__}, so a "
        "drafter that reads the target's hidden states cannot run on it: use a draft model or --drafter lookup"
    )


def _tap(module: nn.Module, sink: Callable[[mx.array], None]) -> None:
    cls = type(module)

    def __call__(self, *args, **kwargs):
        out = cls.__call__(self, *args, **kwargs)
        sink(out)
        return out

    # A one-off subclass for this instance alone: the model's class is untouched.
    module.__class__ = type(f"Tapped{cls.__name__}", (cls,), {"__call__": __call__, "_specdec_base": cls})


def _tap_input(module: nn.Module, sink: Callable[[mx.array], None]) -> None:
    cls = type(module)

    def __call__(self, *args, **kwargs):
        sink(args[0] if args else next(iter(kwargs.values())))
        return cls.__call__(self, *args, **kwargs)

    module.__class__ = type(f"Probed{cls.__name__}", (cls,), {"__call__": __call__, "_specdec_base": cls})


def _untap(module: nn.Module) -> None:
    base = type(module).__dict__.get("_specdec_base")
    if base is not None:
        module.__class__ = base


@dataclass
class TargetParts:
    """The pieces of a target model that drafters reuse.

    Attributes:
        embed_tokens: The target's token embedding module (``as_linear`` for tied heads).
        hidden_size: Width of the residual stream.
        num_layers: Decoder layers.
        vocab_size: Rows of the lm_head.
    """

    model: nn.Module
    embed_tokens: nn.Module
    lm_head: Optional[nn.Module]
    hidden_size: int
    num_layers: int
    vocab_size: int
    softcap: Optional[float] = None
    embed_scale: Optional[float] = None

    # mlx-lm's gemma3_text rounds its embed scale through bfloat16 first.
    embed_scale_dtype: Optional[mx.Dtype] = None
    # The group whose ranks each hold a slice of the lm_head's rows (mlx-lm's
    # tensor-parallel shard of an untied head), or None: whole on this rank.
    head_group: Any = None

    def embed(self, tokens: mx.array) -> mx.array:
        """Token embeddings as the target's first layer sees them ``[T, H]``."""
        h = self.embed_tokens(tokens)
        if self.embed_scale is not None:
            scale = mx.array(self.embed_scale, dtype=self.embed_scale_dtype or h.dtype)
            h = h * scale.astype(h.dtype)
        return h

    def head(self, h: mx.array) -> mx.array:
        """The target's lm_head (or tied embedding) alone, without the final softcap."""
        if self.lm_head is None:
            return self.embed_tokens.as_linear(h)
        out = self.lm_head(h)
        if self.head_group is not None:
            from mlx_lm.models.base import gather_last_axis

            out = gather_last_axis(out, self.head_group)  # as the sharded model itself does
        return out

    def logits(self, h: mx.array) -> mx.array:
        """The target's lm_head (tied embedding, final softcap) on final-normed states."""
        return self._cap(self.head(h))

    def _cap(self, out: mx.array) -> mx.array:
        if self.softcap:
            out = mx.tanh(out / self.softcap) * self.softcap
        return out

    def sub_logits(self, ids: mx.array) -> Callable[[mx.array], mx.array]:
        """The target's logits of the tokens ``ids`` only: ``logits(h)[..., ids]`` at ``len(ids)/V`` the cost.

        The lm_head's rows (quantized ones with their scales and biases) are
        gathered once; a drafter with a reduced vocabulary calls the result.
        """
        module = self.lm_head if self.lm_head is not None else self.embed_tokens

        def whole(a: mx.array) -> mx.array:
            # A sharded head holds a slice of the rows: gather them all, in rank order, once.
            if self.head_group is None or self.lm_head is None:
                return a
            return mx.distributed.all_gather(a, group=self.head_group)

        rows = {k: whole(module[k])[ids] for k in ("weight", "scales", "biases", "bias") if k in module}
        mx.eval(rows)
        if "scales" in rows:
            if rows.get("bias") is not None:
                raise UnsupportedModelError("a quantized lm_head with a bias cannot be restricted to a draft vocabulary")
            quant = dict(group_size=module.group_size, bits=module.bits, mode=getattr(module, "mode", "affine"))

            def sub(h: mx.array) -> mx.array:
                return self._cap(mx.quantized_matmul(h, rows["weight"], rows["scales"], rows.get("biases"),
                                                     transpose=True, **quant))
        else:
            w, b = rows["weight"], rows.get("bias")

            def sub(h: mx.array) -> mx.array:
                out = h @ w.T
                return self._cap(out if b is None else out + b)
        return sub


def _args(model: nn.Module) -> Any:
    for dotted in ("args", "language_model.args", "model.args"):
        a = _get(model, dotted)
        if a is not None:
            return a
    return None


def target_parts(model: nn.Module) -> TargetParts:
    """Find the target's embedding and lm_head, checked on a probe forward.

    Raises:
        UnsupportedModelError: The internals are not where this mlx-lm release
            keeps them, or the lm_head found does not reproduce the logits.
    """
    stack, layers, _, parent = _backbone(model)
    embed = stack.get("embed_tokens") if isinstance(stack.get("embed_tokens"), nn.Module) else stack.get("embeddings")
    if not isinstance(embed, nn.Module):
        raise UnsupportedModelError(f"specdec cannot find the token embedding of {type(model).__module__}")
    lm_head = parent.get("lm_head") if isinstance(parent, dict) else None
    args = _args(model)
    softcap = getattr(args, "final_logit_softcapping", None)
    scale, scale_dtype = None, None
    family = type(stack).__module__.rsplit(".", 1)[-1]
    if family.startswith("gemma") or family == "recurrent_gemma":
        scale = float(getattr(args, "hidden_size", 0) or 0) ** 0.5
        scale_dtype = mx.bfloat16 if family == "gemma3_text" else None
    weight = embed.weight if hasattr(embed, "weight") else None
    parts = TargetParts(
        model=model,
        embed_tokens=embed,
        lm_head=lm_head if isinstance(lm_head, nn.Module) else None,
        hidden_size=int(getattr(args, "hidden_size", 0) or (weight.shape[-1] if weight is not None else 0)),
        num_layers=len(layers),
        # Some families keep it in a nested text config: the embedding's rows then.
        vocab_size=int(getattr(args, "vocab_size", 0) or (weight.shape[0] if weight is not None else 0)),
        softcap=float(softcap) if softcap else None,
        embed_scale=scale,
        embed_scale_dtype=scale_dtype,
        head_group=getattr(parent, "sharding_group", None) if isinstance(lm_head, nn.Module) else None,
    )
    _probe(model, parts, layers[0])
    return parts


def _probe(model: nn.Module, parts: TargetParts, first: nn.Module) -> None:
    # The final-normed state through the lm_head found must give the model's
    # logits, and our embedding must be exactly what the first layer receives.
    # mlx-lm's own caches: the probe needs no rollback (and taps never import caches.py).
    cache = make_prompt_cache(model)
    received: list = []
    ids = mx.array([1, 2], dtype=mx.uint32)
    _tap_input(first, received.append)
    try:
        with HiddenTap(model, TapSpec(final=True)) as tap:
            logits = model(ids[None], cache=cache)[0]
            hidden = tap.take()
    finally:
        _untap(first)
    if not received or received[0].shape[-2:] != (2, parts.hidden_size) or not mx.array_equal(
            parts.embed(ids), received[0][0]).item():
        raise UnsupportedModelError(
            f"{type(model).__module__}: the token embedding specdec found is not what the first decoder "
            "layer receives (this architecture transforms it first), so a drafter that embeds with the "
            "target's embedding cannot run on it; use a draft model or --drafter lookup"
        )
    ours = parts.logits(hidden.final[None])[0]
    if ours.shape != logits.shape or not mx.allclose(ours.astype(mx.float32), logits.astype(mx.float32),
                                                      rtol=1e-3, atol=1e-3).item():
        raise UnsupportedModelError(
            f"{type(model).__module__}: the lm_head specdec found does not reproduce the model's logits "
            "(this mlx-lm release computes them differently); use a draft model or --drafter lookup"
        )


@dataclass
class HiddenTap:
    """Record the target's hidden states during each forward.

    Installed per instance on the chosen decoder layers (and the final norm);
    :meth:`take` returns what the forwards since the last ``take`` recorded,
    as lazy arrays. Use as a context manager, or :meth:`close` it: the
    layers get their own classes back.

    Args:
        model: The target model.
        spec: Which states to record.
    """

    model: nn.Module
    spec: TapSpec
    _layers: dict = field(default_factory=dict, init=False)
    _final: list = field(default_factory=list, init=False)
    _modules: list = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        stack, layers, norm, _ = _backbone(self.model)
        for i in self.spec.layers:
            if not 0 <= i < len(layers):
                raise UnsupportedModelError(
                    f"the drafter reads target layer {i}, but the target has {len(layers)} layers"
                )
        try:
            for i in dict.fromkeys(self.spec.layers):
                self._layers[i] = []
                self._install(layers[i], self._layers[i].append)
            if self.spec.final:
                self._install(stack[norm], self._final.append)
        except BaseException:
            self.close()
            raise

    def _install(self, module: nn.Module, sink) -> None:
        if "_specdec_base" in type(module).__dict__:
            raise RuntimeError("a hidden-state tap is already installed on this model")
        _tap(module, sink)
        self._modules.append(module)

    def take(self) -> Hidden:
        """The states recorded since the last call, ``[T, H]`` each (batch row 0)."""

        def joined(chunks: list) -> mx.array:
            arrays = [c[0] for c in chunks]
            chunks.clear()
            return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays)

        layers = tuple(self._layers[i] for i in self.spec.layers)
        if any(not c for c in layers) or (self.spec.final and not self._final):
            self.clear()
            return Hidden()
        # A layer listed twice in the spec is recorded once; take its rows once.
        taken = {i: joined(self._layers[i]) for i in dict.fromkeys(self.spec.layers)}
        return Hidden(tuple(taken[i] for i in self.spec.layers),
                      joined(self._final) if self.spec.final else None)

    def take_rows(self, rows: int) -> list[Hidden]:
        """The states recorded since the last call, one :class:`Hidden` (``[T, H]`` each) per batch row."""
        layers = tuple(self._layers[i] for i in self.spec.layers)
        if any(not c for c in layers) or (self.spec.final and not self._final):
            self.clear()
            return [Hidden() for _ in range(rows)]
        taken = {i: mx.concatenate(self._layers[i], axis=1) if len(self._layers[i]) > 1 else self._layers[i][0]
                 for i in dict.fromkeys(self.spec.layers)}
        final = None
        if self.spec.final:
            final = mx.concatenate(self._final, axis=1) if len(self._final) > 1 else self._final[0]
        self.clear()
        return [Hidden(tuple(taken[i][b] for i in self.spec.layers), None if final is None else final[b])
                for b in range(rows)]

    def clear(self) -> None:
        """Forget what was recorded (a re-forward's states, say)."""
        for chunks in self._layers.values():
            chunks.clear()
        self._final.clear()

    def close(self) -> None:
        """Give every tapped layer its own class back."""
        for module in self._modules:
            _untap(module)
        self._modules.clear()
        self.clear()

    def __enter__(self) -> "HiddenTap":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

