"""Every hook into mlx-lm model internals lives here, and only here.

Drafters that read the target (DFlash block drafters, MTP heads) need its
hidden states from the verify forward the engine already runs: the residual
stream after chosen decoder layers, and the final-normed state the lm_head
reads. mlx-lm's models return only logits, so :class:`HiddenTap` wraps the
chosen layer *instances* (never their classes): each gets a one-off subclass
whose ``__call__`` records its output; closing the tap gives the instance its
class back. :func:`target_parts` finds the embedding and the lm_head.

Recurrent rollback (capture / tape) needs the state of a GatedDeltaNet,
Mamba2 or Mamba layer after every token of a verify forward, which mlx-lm
never returns: :class:`RecurrentSteps` gives each such mixer instance a
one-off subclass that runs mlx-lm's own recurrence one token at a time (the
formula plain decoding uses) and records the states or their inputs.

All are capability-checked when installed (the backbone, its layer list and
its final norm are found, and the tapped final state through the lm_head
reproduces the model's logits on a probe; the recorded per-token states
reproduce what mlx-lm stores, on a probe), so an mlx-lm release that moves
these internals fails before the first token (or falls back, saying why),
and ``tests/test_hooks.py`` / ``tests/test_rollback.py`` fail loudly for
every covered family.
"""

from __future__ import annotations

import inspect
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from .errors import UnsupportedModelError

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



def _cache_leaves(caches: Sequence[Any]) -> list[Any]:
    # mlx-lm's CacheList nests the caches of one layer.
    out = []
    for c in caches:
        out.extend(_cache_leaves(c.caches) if hasattr(c, "caches") and isinstance(c.caches, (list, tuple)) else [c])
    return out

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
    # mlx-lm's own caches: the probe needs no rollback (and hooks never import caches.py).
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


# --- Recurrent layers: one-token formula in the verify, per-step states, tapes -------
#
# mlx-lm computes a GatedDeltaNet / Mamba2 recurrence inside a free function
# (``gated_delta_update`` / ``ssm_update``) that returns only the final state,
# and Mamba (v1) in its ``ssm_step`` method. To keep the state after every
# token of a verify forward (capture), or its inputs (tape), each mixer
# *instance* gets a one-off subclass whose methods that call the function are
# the same code objects bound to a globals dict in which that one name is our
# recording wrapper. The wrapper calls mlx-lm's own function, one token at a
# time, with exactly the arguments one-token decoding passes: so the states
# (and the Mamba2 outputs, which mlx-lm otherwise computes with its chunked
# formula for several tokens) are bit-identical to plain decoding's, on the
# CPU (ops path) and on Metal (mlx-lm's kernels, one token per launch) alike.
# The conv state after token t is read from the conv1d module's input (one
# more per-instance tap). A probe at install checks all of it on the model.

_GDN, _MAMBA2, _MAMBA1 = "GatedDeltaNet", "Mamba2", "Mamba"
# The free functions the mixers call, by the global name they call them by.
_STEP_FUNCTIONS = {
    "gated_delta_update": ("mlx_lm.models.gated_delta", _GDN),
    "ssm_update": ("mlx_lm.models.ssm", _MAMBA2),
}
STEP_MODES = ("off", "step", "capture", "tape")
# The arguments of each step function that hold one row per token.
_PER_TOKEN = {"gated_delta_update": ("q", "k", "v", "a", "b"), "ssm_update": ("hidden_states", "B", "C", "dt")}


def _call_rows(fn: Callable, bound: dict, names: Sequence[str], lo: int, hi: int, state):
    """``fn`` on tokens ``lo:hi`` of a call's bound arguments (``names`` hold one row per token), from ``state``."""
    return fn(**{**bound, **{n: bound[n][:, lo:hi] for n in names}, "state": state})


def _one_at_a_time(fn: Callable, bound: dict, names: Sequence[str], m: int, state, keep: Optional[list] = None):
    """The first ``m`` tokens fed one per call, as plain decoding feeds them: outputs joined, and the last state.

    ``keep`` collects the state after each token.
    """
    ys = []
    for t in range(m):
        y, state = _call_rows(fn, bound, names, t, t + 1, state)
        ys.append(y)
        if keep is not None:
            keep.append(state)
    return mx.concatenate(ys, axis=1), state


@dataclass
class _StepFunction:
    """One recurrence function the model's mixers call, as :meth:`RecurrentSteps.check_rows` checks it."""

    layer: str  # the first layer seen calling it
    kind: str
    real: Callable  # mlx-lm's own function
    wrapper: Optional[Callable] = None  # ours, while the hooks are installed
    sample: Optional[dict] = None  # the bound arguments of a call seen in a forward


@dataclass
class StepRecord:
    """What one recurrent layer recorded during one forward.

    Attributes:
        kind: ``GatedDeltaNet``, ``Mamba2`` or ``Mamba``.
        steps: Tokens the recurrence consumed.
        conv_input: The conv1d input ``[B, n_keep + steps, C]`` (old conv state, then the new rows).
        n_keep: Rows of conv state the layer keeps (kernel size - 1).
        states: Capture: the recurrent state after each token.
        replay: Tape: recomputes the state after the first m tokens from the recorded inputs.
        tape: Tape: the recorded recurrence inputs (for their size).
    """

    kind: str
    n_keep: int
    steps: int = 0
    conv_input: Optional[mx.array] = None
    conv_calls: int = 0
    states: list = field(default_factory=list)
    replay: Optional[Callable[[int], mx.array]] = None
    tape: list = field(default_factory=list)
    problem: Optional[str] = None

    def conv_state(self, m: int) -> mx.array:
        """The conv state after the first ``m`` tokens (as the layer would store it)."""
        return self.conv_input[:, m : m + self.n_keep]

    def state(self, m: int) -> mx.array:
        """The recurrent state after the first ``m`` tokens (1 <= m <= steps)."""
        return self.states[m - 1] if self.states else self.replay(m)

    def tape_bytes(self) -> int:
        flat = [a for t in self.tape for a in (t if isinstance(t, tuple) else (t,))]
        return sum({id(a): a.nbytes for a in flat if isinstance(a, mx.array)}.values())


def _rebind(fn: Callable, name: str, replacement: Callable) -> Callable:
    # The same code object, looking `name` up in a copy of its module's
    # globals where it is our wrapper: nothing shared is modified.
    glb = dict(fn.__globals__)
    glb[name] = replacement
    out = types.FunctionType(fn.__code__, glb, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__qualname__ = fn.__qualname__
    return out


def _calls(cls: type) -> dict[str, tuple[Callable, str]]:
    """Methods of ``cls`` (and its bases) that call one of the step functions: name -> (fn, global)."""
    found = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("mlx_lm.models."):
            continue
        for name, fn in vars(klass).items():
            if not isinstance(fn, types.FunctionType):
                continue
            for gname, (module, _) in _STEP_FUNCTIONS.items():
                if gname in fn.__code__.co_names and getattr(fn.__globals__.get(gname), "__module__", None) == module:
                    found[name] = (fn, gname)
    return found


def _mixer_kind(module: nn.Module) -> tuple[Optional[str], dict]:
    cls = type(module)
    if "_specdec_steps_base" in vars(cls) or not cls.__module__.startswith("mlx_lm.models."):
        return None, {}
    calls = _calls(cls)
    kinds = {_STEP_FUNCTIONS[g][1] for _, g in calls.values()}
    if len(kinds) == 1:
        return kinds.pop(), calls
    if not calls and isinstance(getattr(cls, "ssm_step", None), types.FunctionType):
        return _MAMBA1, {}
    return None, {}


class RecurrentSteps:
    """Per-instance hooks on a model's recurrent mixers (GatedDeltaNet, Mamba2, Mamba).

    ``mode`` says what the next forward does: ``off`` (mlx-lm unchanged:
    prefill), ``step`` (several tokens computed with the one-token formula, as
    plain decoding computes them), ``capture`` (also keep every per-token
    state) or ``tape`` (keep the recurrence inputs, replayed on demand).
    Installed once per model by :func:`recurrent_steps`; a probe checks on the
    model itself that the records reproduce what mlx-lm stores.

    Two things are checked apart. The records (capture/tape): when they do
    not reproduce mlx-lm's states, ``problem`` says why, the hooks stay and
    verify forwards still take the one-token path (rollback by carry). The
    recurrence itself (:meth:`check_rows`, at every verify row count a run
    uses): where mlx-lm's several-token call differs from its one-token calls,
    several tokens are computed one at a time (``per_token``); where that
    cannot be done (no hook), speculation is refused (``refusal``).

    Attributes:
        kinds: The kind of each recurrent layer cache (in layer order), None where no hook covers it.
        problem: Why capture/tape cannot run on this model, or None.
        bytes_per_step: Extra bytes one verified token costs with ``capture`` / ``tape``.
        per_token: A GatedDeltaNet's several-token call differs from its
            one-token calls: verify forwards call it one token at a time.
        stepping: The hooks are in place, so ``step`` computes verify forwards
            with the one-token formula (False: mlx-lm's own forward runs).
        inexact: Where mlx-lm's several-token recurrence was found to differ
            from its one-token one: ``{kind: (rows, what differed)}``.
        refusal: Why speculation must not run on this model (from
            ``refused_from`` verify rows on), or None.
    """

    def __init__(self, model: nn.Module):
        self.mode = "off"
        self.kinds: list[Optional[str]] = []
        self.problem: Optional[str] = None
        self.bytes_per_step = {"capture": 0, "tape": 0}
        self.per_token = False
        self.inexact: dict[str, tuple[int, str]] = {}
        self.refusal: Optional[str] = None
        self.refused_from: Optional[int] = None
        self._current: Optional[StepRecord] = None
        self._records: dict[int, StepRecord] = {}
        self._installed: list[nn.Module] = []
        self._arch = type(model).__module__.rsplit(".", 1)[-1]
        self._functions: dict[str, _StepFunction] = {}
        self._checked = 1
        try:
            for name, module in model.named_modules():
                kind, calls = _mixer_kind(module)
                if kind is None:
                    continue
                for fn, gname in calls.values():
                    self._functions.setdefault(gname, _StepFunction(name, kind, fn.__globals__[gname]))
                self._install(module, kind, calls)
            self._probe(model)
        except _RecordingOnly as e:
            # The verify forwards still compute with the one-token formula; only capture/tape are off.
            self.problem = str(e)
        except _Unsupported as e:
            self.close()
            self.problem = str(e)

    @property
    def covered(self) -> bool:
        """Every recurrent layer can capture and tape."""
        return self.problem is None

    # -- installation ------------------------------------------------------------------

    def _install(self, mixer: nn.Module, kind: str, calls: dict) -> None:
        cls = type(mixer)
        conv = getattr(mixer, "conv1d", None)
        n_keep = getattr(mixer, "conv_kernel_size", None)
        if not isinstance(conv, nn.Conv1d) or not isinstance(n_keep, int):
            raise _Unsupported(f"its {cls.__name__} has no conv1d/conv_kernel_size where specdec reads the conv state")
        try:
            sig = inspect.signature(cls.__call__)
        except (TypeError, ValueError):
            sig = None
        if sig is None or "cache" not in sig.parameters:
            raise _Unsupported(f"its {cls.__name__} takes no `cache` argument")
        hook = self
        ns: dict[str, Any] = {"_specdec_steps_base": cls}
        for name, (fn, gname) in calls.items():
            wrapper = _WRAPPERS[gname](hook, fn.__globals__[gname])
            ns[name] = _rebind(fn, gname, wrapper)
            entry = self._functions.get(gname)
            if entry is not None and entry.wrapper is None:
                entry.wrapper = wrapper
        if kind == _MAMBA1:
            ns["ssm_step"] = _mamba1_step(hook, cls.ssm_step)
        base_call = ns.get("__call__", cls.__call__)

        def __call__(self, *args, **kwargs):
            if hook.mode not in ("capture", "tape"):
                return base_call(self, *args, **kwargs)
            cache = sig.bind(self, *args, **kwargs).arguments.get("cache")
            if cache is None:
                return base_call(self, *args, **kwargs)
            record = StepRecord(kind, n_keep - 1)
            hook._current = record
            try:
                out = base_call(self, *args, **kwargs)
            finally:
                hook._current = None
            hook._records[id(cache)] = record
            return out

        ns["__call__"] = __call__
        mixer.__class__ = type(f"Stepped{cls.__name__}", (cls,), ns)
        self._installed.append(mixer)
        conv_cls = type(conv)

        def conv_call(self, x, *args, **kwargs):
            record = hook._current
            if record is not None:
                record.conv_input = x
                record.conv_calls += 1
            return conv_cls.__call__(self, x, *args, **kwargs)

        conv.__class__ = type(f"Stepped{conv_cls.__name__}", (conv_cls,),
                              {"__call__": conv_call, "_specdec_steps_base": conv_cls})
        self._installed.append(conv)

    def close(self) -> None:
        """Give every hooked instance its own class back."""
        for module in self._installed:
            base = vars(type(module)).get("_specdec_steps_base")
            if base is not None:
                module.__class__ = base
        self._installed.clear()
        for entry in self._functions.values():
            entry.wrapper = None

    @property
    def stepping(self) -> bool:
        """The hooks are in place: ``step`` forwards use the one-token formula."""
        return bool(self._installed)

    # -- one forward -------------------------------------------------------------------

    @contextmanager
    def forward(self, mode: str):
        """Run the forwards inside the block in ``mode``; clears earlier records."""
        if mode not in STEP_MODES:
            raise ValueError(f"mode must be one of {STEP_MODES}")
        self._records.clear()
        previous, self.mode = self.mode, mode if self._installed else "off"
        try:
            yield self
        finally:
            self.mode = previous
            self._current = None

    def take(self, caches: Sequence[Any]) -> list[Optional[StepRecord]]:
        """The records of the last forward, one per recurrent layer cache (None where missing)."""
        out = [self._records.get(id(c)) for c in caches]
        self._records.clear()
        return out

    # -- the recurrence at every verify row count ------------------------------------------

    def _keep_sample(self, gname: str, bound: dict) -> None:
        entry = self._functions.get(gname)
        if entry is not None and entry.sample is None:
            entry.sample = dict(bound)

    def check_rows(self, rows: int) -> Optional[str]:
        """Check the recurrence for every verify forward of 2 .. ``rows`` tokens; the refusal that applies.

        For each step function the model's mixers call, mlx-lm's several-token
        call is compared bit for bit (outputs and final state) with the same
        tokens fed one at a time, as plain decoding feeds them, at every row
        count: on the layer's own shapes and a probe forward's own inputs,
        repeated to ``rows`` tokens (on a tiny synthetic state when the hooks
        could not be installed). A GatedDeltaNet that differs is then computed
        one token at a time in verify forwards (``per_token``); Mamba2 always
        is. The path verify forwards take is then checked the same way. Where
        that path is mlx-lm's own several-token forward (no hooks) and it
        differs, speculation is refused. Results are kept: a later call only
        checks the row counts not checked yet.

        Returns:
            Why speculation must not run with verify forwards of up to
            ``rows`` tokens, or None.
        """
        if rows > self._checked:
            for gname, entry in self._functions.items():
                self._check_function(gname, entry, rows)
            self._checked = rows
        return self.refusal if self.refused_from is not None and self.refused_from <= rows else None

    def _check_function(self, gname: str, entry: _StepFunction, rows: int) -> None:
        layer, kind, real, wrapper = entry.layer, entry.kind, entry.real, entry.wrapper
        names = _PER_TOKEN[gname]
        args = _repeat_rows(entry.sample if entry.sample is not None else _synthetic(gname), names, rows)

        def call(fn, lo: int, hi: int, state):
            return _call_rows(fn, args, names, lo, hi, state)

        ref_states: list = []
        ref_y, _ = _one_at_a_time(real, args, names, rows, args["state"], ref_states)

        def differs(y, final, m: int) -> Optional[str]:
            want_y, want_s = ref_y[:, :m], ref_states[m - 1]
            if mx.array_equal(y, want_y).item() and mx.array_equal(final, want_s).item():
                return None
            dy = mx.abs(y.astype(mx.float32) - want_y.astype(mx.float32)).max().item()
            ds = mx.abs(final.astype(mx.float32) - want_s.astype(mx.float32)).max().item()
            return f"the output by up to {dy:.3g} and the state by up to {ds:.3g}"

        # mlx-lm's several-token call, where verify forwards would use it: a GatedDeltaNet not yet
        # computed one token at a time, or any layer when the hooks are off (mlx-lm's own forward).
        if not self.stepping or (kind == _GDN and not self.per_token):
            for m in range(max(2, self._checked + 1), rows + 1):
                what = differs(*call(real, 0, m, args["state"]), m)
                if what is not None:
                    self.inexact.setdefault(kind, (m, what))
                    if self.stepping:
                        self.per_token = True  # verify forwards now call it one token at a time
                    else:
                        self._refuse(layer, kind, m, what)
                    break
        if self.stepping and wrapper is not None:
            # The path verify forwards take, as the hook computes it (one token at a time), at the longest
            # row count: its per-token outputs and last state cover every shorter one.
            with self.forward("step"):
                what = differs(*call(wrapper, 0, rows, args["state"]), rows)
            if what is not None:
                self._refuse(layer, kind, rows, what + " (specdec's one-token path)")

    def _refuse(self, layer: str, kind: str, rows: int, what: str) -> None:
        if self.refused_from is not None and self.refused_from <= rows:
            return
        self.refused_from = rows
        self.refusal = (
            f"speculative decoding cannot run exactly on this {self._arch} model: its {kind} layer {layer} "
            f"computed for {rows} tokens at once differs from {rows} one-token steps ({what}), and specdec cannot "
            "verify it one token at a time here" + (f" ({self.problem})" if self.problem else "")
            + ": run plain decoding with --block-size 1 (one token per forward), or mlx_lm.generate")

    # -- the capability check ----------------------------------------------------------

    def _probe(self, model: nn.Module) -> None:
        layers = make_prompt_cache(model)
        leaves = [c for c in _cache_leaves(layers) if type(c).__name__ == "ArraysCache"]
        if not leaves:
            return
        if not self._installed:
            raise _Unsupported(f"{self._arch}'s recurrent layers are none of {_GDN}, {_MAMBA2}, {_MAMBA1} "
                               "(the mixers specdec can hook)")
        attention = [c for c in _cache_leaves(layers) if hasattr(c, "trim") and c not in leaves]

        def forward(mode: str, ids: list[int]) -> list:
            with self.forward(mode):
                mx.eval(model(mx.array([ids], dtype=mx.uint32), cache=layers))
                return self.take(leaves)

        def state() -> list:
            return [list(c.cache) for c in leaves]

        def back(saved, n) -> None:
            for c, arrays in zip(leaves, saved):
                c.cache = list(arrays)
            for c in attention:
                c.trim(n)

        try:
            forward("off", [1, 2])
            start = state()
            captured = forward("capture", [3, 4, 5])
            after = state()
            # The recurrence itself, before tape relies on it (a run checks its own row counts later).
            self.check_rows(3)
            back(start, 3)
            taped = forward("tape", [3, 4, 5])
            back(start, 3)
            forward("off", [3])
            one = state()
        except Exception as e:  # the model's own failure, or a layer the hooks misread
            raise _Unsupported(f"the probe forward of {self._arch} failed ({type(e).__name__}: {e})") from e
        self.kinds = [r.kind if r is not None else None for r in captured]
        missing = [i for i, r in enumerate(captured) if r is None]
        if missing:
            raise _Unsupported(f"{len(missing)} of {self._arch}'s {len(leaves)} recurrent layers use a mixer "
                               f"specdec cannot hook (covered: {_GDN}, {_MAMBA2}, {_MAMBA1})")
        for cap, tape, final, first in zip(captured, taped, after, one):
            name = f"{self._arch} {cap.kind}"
            for r in (cap, tape):
                if r.steps != 3:
                    # The wrapper did not see the recurrence: verify forwards would not take the one-token path.
                    raise _Unsupported(f"{name}: the recurrence was not seen once per token of a forward")
            for r in (cap, tape):
                if r.problem:
                    raise _RecordingOnly(f"{name}: {r.problem}")
                if r.conv_calls != 1 or r.conv_input is None or r.conv_input.shape[1] != r.n_keep + 3:
                    raise _RecordingOnly(f"{name}: the conv input was not seen once per forward")
            exact = (
                len(cap.states) == 3
                and mx.array_equal(cap.conv_state(3), final[0]).item()
                and mx.array_equal(cap.state(3), final[1]).item()
                and mx.array_equal(tape.state(3), final[1]).item()
                and mx.array_equal(tape.state(2), cap.state(2)).item()
            )
            # After one token: the stock one-token forward (a different row
            # count in the projections, so close rather than equal in float32).
            close = all(
                mx.allclose(a.astype(mx.float32), b.astype(mx.float32), rtol=1e-2, atol=1e-3).item()
                for a, b in ((cap.conv_state(1), first[0]), (cap.state(1), first[1]))
            )
            if not (exact and close):
                raise _RecordingOnly(f"{name}: the recorded per-token states do not reproduce what mlx-lm stores "
                                     "(this mlx-lm release changed the layer)")
            self.bytes_per_step["capture"] += cap.states[0].nbytes
            self.bytes_per_step["tape"] += tape.tape_bytes() // 3


class _Unsupported(Exception):
    pass


class _RecordingOnly(_Unsupported):
    """Capture/tape records are wrong; the one-token verify path itself is sound."""


def _repeat_rows(bound: dict, names: Sequence[str], rows: int) -> dict:
    """``bound`` with its per-token arguments cycled (along the token axis) to ``rows`` tokens."""
    have = bound[names[0]].shape[1]
    idx = mx.array([t % have for t in range(rows)], dtype=mx.int32)
    return {**bound, **{n: mx.take(bound[n], idx, axis=1) for n in names}}


def _synthetic(gname: str) -> dict:
    """Arguments for a step function on a tiny state, for when no forward could be hooked to borrow them."""
    k = iter(mx.random.split(mx.random.key(0), 8))

    def normal(*shape):
        return mx.random.normal(shape, key=next(k))

    if gname == "gated_delta_update":
        q, key = normal(1, 4, 1, 32), normal(1, 4, 1, 32)
        return {"q": q / mx.linalg.norm(q, axis=-1, keepdims=True) / 32 ** 0.5,
                "k": key / mx.linalg.norm(key, axis=-1, keepdims=True), "v": normal(1, 4, 1, 32),
                "a": normal(1, 4, 1), "b": normal(1, 4, 1), "A_log": mx.zeros((1,)), "dt_bias": mx.zeros((1,)),
                "state": mx.zeros((1, 1, 32, 32))}
    return {"hidden_states": normal(1, 4, 2, 8), "A_log": mx.zeros((2,)), "B": normal(1, 4, 1, 16),
            "C": normal(1, 4, 1, 16), "D": mx.ones((2,)), "dt": normal(1, 4, 2), "dt_bias": mx.zeros((2,)),
            "state": mx.zeros((1, 2, 8, 16))}


def _bind(fn: Callable) -> Callable[..., dict]:
    sig = inspect.signature(fn)

    def bind(*args, **kwargs) -> dict:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    return bind


def _gdn_wrapper(hook: RecurrentSteps, real: Callable) -> Callable:
    bind = _bind(real)
    per_token = _PER_TOKEN["gated_delta_update"]

    def gated_delta_update(*args, **kwargs):
        record = hook._current
        if hook.mode == "off" or (record is None and not hook.per_token):
            # mlx-lm's several-token recurrence, checked equal to its one-token steps (check_rows).
            return real(*args, **kwargs)
        a = bind(*args, **kwargs)
        hook._keep_sample("gated_delta_update", a)
        if a.get("mask") is not None and record is not None:
            record.problem = "a padding mask reached the recurrence"
        start, steps = a["state"], a["q"].shape[1]
        if record is not None:
            record.steps = steps

        def run(lo: int, hi: int, state):
            return _call_rows(real, a, per_token, lo, hi, state)

        def one_at_a_time(m: int, keep: Optional[list] = None):
            return _one_at_a_time(real, a, per_token, m, start, keep)

        if hook.mode == "capture" and record is not None:
            return one_at_a_time(steps, record.states)
        if record is not None:  # tape
            record.tape = [a[n] for n in per_token]
            record.replay = (lambda m: one_at_a_time(m)[1]) if hook.per_token else (lambda m: run(0, m, start)[1])
        return one_at_a_time(steps) if hook.per_token else real(*args, **kwargs)

    return gated_delta_update


def _ssm_wrapper(hook: RecurrentSteps, real: Callable) -> Callable:
    bind = _bind(real)
    per_token = _PER_TOKEN["ssm_update"]

    def ssm_update(*args, **kwargs):
        record = hook._current
        if hook.mode == "off":
            return real(*args, **kwargs)
        a = bind(*args, **kwargs)
        steps = a["hidden_states"].shape[1]
        if steps == 1 and record is None:
            return real(*args, **kwargs)
        hook._keep_sample("ssm_update", a)
        if a.get("mask") is not None or a.get("lengths") is not None:
            if record is not None:
                record.problem = "a padding mask reached the recurrence"
            return real(*args, **kwargs)

        # Exactly the calls one-token decoding makes (mlx-lm's one-token formula or kernel).
        start = a["state"]
        keep = record.states if record is not None and hook.mode == "capture" else None
        out = _one_at_a_time(real, a, per_token, steps, start, keep)
        if record is not None:
            record.steps = steps
            if hook.mode == "tape":
                record.tape = [a[n] for n in per_token]
                record.replay = lambda m: _one_at_a_time(real, a, per_token, m, start)[1]
        return out

    return ssm_update


def _mamba1_step(hook: RecurrentSteps, real: Callable) -> Callable:
    # mlx-lm's Mamba calls ssm_step once per token; its step includes the
    # small x_proj/dt_proj projections, so a tape replays those too.
    def ssm_step(self, x, A, state=None):
        y, new = real(self, x, A, state)
        record = hook._current
        if record is not None:
            if x.ndim != 2:
                record.problem = "ssm_step got several tokens at once"
            if hook.mode == "capture":
                record.states.append(new)
            else:
                if record.steps == 0:
                    start = state
                    tape = record.tape

                    def replay(m: int):
                        s = start
                        for xt, At in tape[:m]:
                            s = real(self, xt, At, s)[1]
                        return s

                    record.replay = replay
                record.tape.append((x, A))
            record.steps += 1
        return y, new

    return ssm_step


_WRAPPERS = {"gated_delta_update": _gdn_wrapper, "ssm_update": _ssm_wrapper}


def recurrent_steps(model: Any) -> Optional[RecurrentSteps]:
    """The :class:`RecurrentSteps` of ``model``, installed (and probed) on first use.

    A wrapper that forwards attribute lookups to a model gets that model's hooks
    when they are installed; anything else that is not an ``nn.Module`` gets None.
    """
    steps = getattr(model, "_specdec_steps", None)
    if steps is None and isinstance(model, nn.Module):
        steps = RecurrentSteps(model)
        model._specdec_steps = steps  # a plain attribute: not a parameter or child module
    return steps
