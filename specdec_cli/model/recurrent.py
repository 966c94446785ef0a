"""Recurrent mixers stepped one token at a time: exact verify forwards and their rollback.

A verify forward through a GatedDeltaNet, Mamba2 or Mamba layer must compute
what plain decoding computes, and capture / tape rollback needs the state
after every token of it, which mlx-lm never returns. So the model objects are
changed, once, when its caches are first built (:func:`recurrent_steps`): each
such mixer instance gets a one-off subclass, all or none of them, and a probe
on the model says whether the records can be trusted (``problem``) or
speculation must be refused (``refusal``) before the first token.
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


def _cache_leaves(caches: Sequence[Any]) -> list[Any]:
    # mlx-lm's CacheList nests the caches of one layer.
    out = []
    for c in caches:
        out.extend(_cache_leaves(c.caches) if hasattr(c, "caches") and isinstance(c.caches, (list, tuple)) else [c])
    return out


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
# What differs between mixer kinds is one MixerAdapter record each (_ADAPTERS).

STEP_MODES = ("off", "step", "capture", "tape")


@dataclass(frozen=True)
class MixerAdapter:
    """How specdec steps one kind of mlx-lm recurrent mixer one token at a time.

    A mixer either calls a free step function for a whole forward
    (``function``: its methods are rebound to see ``wrapper`` under that
    name), or steps itself token by token in a method (``method``: replaced by
    ``wrapper``). ``wrapper(hook, adapter, real)`` returns the replacement of
    ``real``, mlx-lm's own function or method.

    Attributes:
        kind: The mixer's class name: what records, messages and ``inexact`` call it.
        wrapper: Builds the replacement (see above).
        function: The global name the mixer's methods call the step function by.
        module: The mlx-lm module defining ``function`` (a same-named stranger is not hooked).
        method: The mixer's own one-token step method, for a mixer without a step function.
        per_token_args: The arguments of ``function`` that hold one row per token.
        synthetic: Arguments for ``function`` on a tiny state, for checking it
            when no forward could be hooked to borrow real ones.
        batched_when_exact: Verify forwards call mlx-lm's several-token
            ``function`` as long as :meth:`RecurrentSteps.check_rows` finds it
            equal to one-token calls (else always one token at a time).
    """

    kind: str
    wrapper: Callable[["RecurrentSteps", "MixerAdapter", Callable], Callable]
    function: Optional[str] = None
    module: Optional[str] = None
    method: Optional[str] = None
    per_token_args: tuple[str, ...] = ()
    synthetic: Optional[Callable[[], dict]] = None
    batched_when_exact: bool = False


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


def _bind(fn: Callable) -> Callable[..., dict]:
    sig = inspect.signature(fn)

    def bind(*args, **kwargs) -> dict:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    return bind


def _gdn_wrapper(hook: RecurrentSteps, adapter: MixerAdapter, real: Callable) -> Callable:
    bind = _bind(real)
    per_token = adapter.per_token_args

    def gated_delta_update(*args, **kwargs):
        record = hook._current
        if hook.mode == "off" or (record is None and not hook.per_token):
            # mlx-lm's several-token recurrence, checked equal to its one-token steps (check_rows).
            return real(*args, **kwargs)
        a = bind(*args, **kwargs)
        hook._keep_sample(adapter.function, a)
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


def _ssm_wrapper(hook: RecurrentSteps, adapter: MixerAdapter, real: Callable) -> Callable:
    bind = _bind(real)
    per_token = adapter.per_token_args

    def ssm_update(*args, **kwargs):
        record = hook._current
        if hook.mode == "off":
            return real(*args, **kwargs)
        a = bind(*args, **kwargs)
        steps = a["hidden_states"].shape[1]
        if steps == 1 and record is None:
            return real(*args, **kwargs)
        hook._keep_sample(adapter.function, a)
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


def _mamba1_step(hook: RecurrentSteps, adapter: MixerAdapter, real: Callable) -> Callable:
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


def _normals():
    """Draws for the synthetic arguments, the same on every call."""
    keys = iter(mx.random.split(mx.random.key(0), 8))
    return lambda *shape: mx.random.normal(shape, key=next(keys))


def _gdn_synthetic() -> dict:
    normal = _normals()
    q, key = normal(1, 4, 1, 32), normal(1, 4, 1, 32)
    return {"q": q / mx.linalg.norm(q, axis=-1, keepdims=True) / 32 ** 0.5,
            "k": key / mx.linalg.norm(key, axis=-1, keepdims=True), "v": normal(1, 4, 1, 32),
            "a": normal(1, 4, 1), "b": normal(1, 4, 1), "A_log": mx.zeros((1,)), "dt_bias": mx.zeros((1,)),
            "state": mx.zeros((1, 1, 32, 32))}


def _ssm_synthetic() -> dict:
    normal = _normals()
    return {"hidden_states": normal(1, 4, 2, 8), "A_log": mx.zeros((2,)), "B": normal(1, 4, 1, 16),
            "C": normal(1, 4, 1, 16), "D": mx.ones((2,)), "dt": normal(1, 4, 2), "dt_bias": mx.zeros((2,)),
            "state": mx.zeros((1, 2, 8, 16))}


# Every mixer kind specdec can step, in the order a method calling two step functions resolves them
# (the last wins). A new recurrent mixer is one more record here.
_ADAPTERS = (
    MixerAdapter("GatedDeltaNet", _gdn_wrapper, function="gated_delta_update", module="mlx_lm.models.gated_delta",
                 per_token_args=("q", "k", "v", "a", "b"), synthetic=_gdn_synthetic, batched_when_exact=True),
    MixerAdapter("Mamba2", _ssm_wrapper, function="ssm_update", module="mlx_lm.models.ssm",
                 per_token_args=("hidden_states", "B", "C", "dt"), synthetic=_ssm_synthetic),
    # mlx-lm's Mamba (v1) calls its ssm_step once per token already.
    MixerAdapter("Mamba", _mamba1_step, method="ssm_step"),
)
_COVERED = ", ".join(a.kind for a in _ADAPTERS)


@dataclass
class _StepFunction:
    """One recurrence function the model's mixers call, as :meth:`RecurrentSteps.check_rows` checks it."""

    layer: str  # the first layer seen calling it
    adapter: MixerAdapter
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


def _calls(cls: type) -> dict[str, tuple[Callable, MixerAdapter]]:
    """Methods of ``cls`` (and its bases) that call one of the step functions: name -> (fn, its adapter)."""
    found = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("mlx_lm.models."):
            continue
        for name, fn in vars(klass).items():
            if not isinstance(fn, types.FunctionType):
                continue
            for adapter in _ADAPTERS:
                gname = adapter.function
                if gname is not None and gname in fn.__code__.co_names and getattr(
                        fn.__globals__.get(gname), "__module__", None) == adapter.module:
                    found[name] = (fn, adapter)
    return found


def _mixer_kind(module: nn.Module) -> tuple[Optional[MixerAdapter], dict]:
    cls = type(module)
    if "_specdec_steps_base" in vars(cls) or not cls.__module__.startswith("mlx_lm.models."):
        return None, {}
    calls = _calls(cls)
    adapters = {a.kind: a for _, a in calls.values()}
    if len(adapters) == 1:
        return adapters.popitem()[1], calls
    if not calls:
        for adapter in _ADAPTERS:
            if adapter.method is not None and isinstance(getattr(cls, adapter.method, None), types.FunctionType):
                return adapter, {}
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
                adapter, calls = _mixer_kind(module)
                if adapter is None:
                    continue
                for fn, a in calls.values():
                    self._functions.setdefault(a.function, _StepFunction(name, a, fn.__globals__[a.function]))
                self._install(module, adapter, calls)
            self._probe(model)
        except _RecordingOnly as e:
            # The verify forwards still compute with the one-token formula; only capture/tape are off.
            self.problem = str(e)
        except _Unsupported as e:
            self.close()
            self.problem = str(e)
        except BaseException:
            # Anything else (a bug, an interrupt) propagates, but leaves no mixer half-installed.
            self.close()
            raise

    @property
    def covered(self) -> bool:
        """Every recurrent layer can capture and tape."""
        return self.problem is None

    # -- installation ------------------------------------------------------------------

    def _install(self, mixer: nn.Module, adapter: MixerAdapter, calls: dict) -> None:
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
        for name, (fn, a) in calls.items():
            wrapper = a.wrapper(hook, a, fn.__globals__[a.function])
            ns[name] = _rebind(fn, a.function, wrapper)
            entry = self._functions.get(a.function)
            if entry is not None and entry.wrapper is None:
                entry.wrapper = wrapper
        if adapter.method is not None:
            ns[adapter.method] = adapter.wrapper(hook, adapter, getattr(cls, adapter.method))
        base_call = ns.get("__call__", cls.__call__)

        def __call__(self, *args, **kwargs):
            if hook.mode not in ("capture", "tape"):
                return base_call(self, *args, **kwargs)
            cache = sig.bind(self, *args, **kwargs).arguments.get("cache")
            if cache is None:
                return base_call(self, *args, **kwargs)
            record = StepRecord(adapter.kind, n_keep - 1)
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
            for entry in self._functions.values():
                self._check_function(entry, rows)
            self._checked = rows
        return self.refusal if self.refused_from is not None and self.refused_from <= rows else None

    def _check_function(self, entry: _StepFunction, rows: int) -> None:
        layer, adapter, real, wrapper = entry.layer, entry.adapter, entry.real, entry.wrapper
        kind, names = adapter.kind, adapter.per_token_args
        args = _repeat_rows(entry.sample if entry.sample is not None else adapter.synthetic(), names, rows)

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
        if not self.stepping or (adapter.batched_when_exact and not self.per_token):
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
            raise _Unsupported(f"{self._arch}'s recurrent layers are none of {_COVERED} "
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
                               f"specdec cannot hook (covered: {_COVERED})")
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
            # After one token: the stock one-token forward (a different row count in the projections, so
            # close rather than equal: within what rounding moves the largest value, a GPU's bfloat16
            # rounding included; a state one token off differs by the values themselves).
            close = all(_within(a, b, _STATE_ROUNDING)
                        for a, b in ((cap.conv_state(1), first[0]), (cap.state(1), first[1])))
            if not (exact and close):
                raise _RecordingOnly(f"{name}: the recorded per-token states do not reproduce what mlx-lm stores "
                                     "(this mlx-lm release changed the layer)")
            self.bytes_per_step["capture"] += cap.states[0].nbytes
            self.bytes_per_step["tape"] += tape.tape_bytes() // 3


# How far a state computed by other kernels may be from another's, as a share of its largest value
# (the test suite's GPU-like backend moved them by up to 1%).
_STATE_ROUNDING = 2.0**-4


def _within(a: mx.array, b: mx.array, share: float) -> bool:
    """``a`` differs from ``b`` by at most ``share`` of ``b``'s largest value (and 1e-3)."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return mx.abs(a - b).max().item() <= share * mx.abs(b).max().item() + 1e-3


class _Unsupported(Exception):
    pass


class _RecordingOnly(_Unsupported):
    """Capture/tape records are wrong; the one-token verify path itself is sound."""


def _repeat_rows(bound: dict, names: Sequence[str], rows: int) -> dict:
    """``bound`` with its per-token arguments cycled (along the token axis) to ``rows`` tokens."""
    have = bound[names[0]].shape[1]
    idx = mx.array([t % have for t in range(rows)], dtype=mx.int32)
    return {**bound, **{n: mx.take(bound[n], idx, axis=1) for n in names}}


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
