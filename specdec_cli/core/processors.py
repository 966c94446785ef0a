"""Logits processors that stay lossless under speculation: penalties, logit bias, a grammar.

A processor changes the target's distribution at each position from what came
before it, so it must see, at every verify row, exactly the context plain
decoding would have there: the committed tokens plus the drafts before that
row. The engine (:mod:`specdec_cli.loop.engine`) calls, per block and per row of
the batch:

- ``allowed(drafts)``: how many leading drafts could ever be accepted (a
  grammar cuts the drafts that leave it before the verify: they can never be
  accepted); it never changes the processor's state;
- ``apply(logits, drafts)``: the verify rows ``[last, d1 .. dk]``, row i's
  context being the committed tokens plus ``drafts[:i]``; returns the
  processed logits (lazy);
- ``commit(tokens)``: the tokens the block committed (the target's own last
  one included), in order.

Greedy output is then plain decoding's with the same processors token for
token, and sampled output has the same distribution. Every processor is a
request's own state: built per request by :func:`make_processors`, never kept.

A processor whose ``lazy`` attribute is true needs no draft on the host:
``allowed`` reads only ``len(drafts)`` and ``apply`` takes them as a uint32
``mx.array`` that may still be lazy (a draft model's), so the engine adds no
host sync for it. Otherwise the engine hands it a list of ints.

The penalties and the bias are mlx-lm's (``mlx_lm.sample_utils``: the same
arithmetic on the same elements, in the logits' dtype, over the same context
windows, applied in mlx-lm's order: bias, repetition, presence, frequency),
computed for all rows of a verify at once. The grammar is llguidance's
(:class:`Grammar`): its token mask at each row comes from the grammar state
after the drafts before it, and its state advances only over committed tokens.
"""

from __future__ import annotations

import json
import math
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

import mlx.core as mx
import numpy as np

from ..errors import OptionError

# mlx-lm's default context of each penalty (make_logits_processors).
DEFAULT_CONTEXT = 20
# OpenAI's most alternatives per position; mlx_lm.server allows 10.
MAX_TOP_LOGPROBS = 20


class LogitsProcessor(Protocol):
    """A request's logits processor (see the module docstring)."""

    def allowed(self, drafts: Sequence[int]) -> int: ...

    def apply(self, logits: mx.array, drafts: Sequence[int]) -> mx.array: ...

    def commit(self, tokens: Sequence[int]) -> None: ...


class ConstraintError(OptionError):
    """A grammar, JSON schema or tool constraint that cannot be built (its message says why).

    ``tool``: the index, among a forced call's tools, of the one whose ``parameters`` are at fault (else None).
    """

    def __init__(self, message: str, tool: Optional[int] = None):
        super().__init__(message)
        self.tool = tool


# --- penalties and bias -----------------------------------------------------------------------------


def _as_tokens(drafts, n: int) -> mx.array:
    """The first ``n`` drafts as a uint32 array (lazy ones stay lazy)."""
    if isinstance(drafts, mx.array):
        return drafts[:n].astype(mx.uint32)
    return mx.array(list(drafts)[:n], dtype=mx.uint32)


class Penalties:
    """mlx-lm's logit bias and repetition, presence and frequency penalties, over every verify row at once.

    Each penalty reads the last ``context`` tokens of the row's context: the
    prompt and everything committed, then the drafts before the row (mlx-lm's
    processors read the prompt too). A penalty of None or 0 is off, as in
    ``make_logits_processors``; a repetition penalty of 1 changes no bit and is
    skipped too.

    Args:
        prompt_ids: The prompt's token ids (not empty).
        logit_bias: Token id -> value added to its logit.
        repetition_penalty: mlx-lm's multiplicative penalty (> 0): a repeated
            token's logit is divided by it when positive, multiplied when negative.
        presence_penalty: Subtracted once from a token present in its context.
        frequency_penalty: Subtracted once per occurrence in its context.
        *_context_size: Tokens each penalty looks back over (>= 1).
    """

    lazy = True

    def __init__(self, prompt_ids: Sequence[int], *, logit_bias: Optional[dict] = None,
                 repetition_penalty: Optional[float] = None, repetition_context_size: int = DEFAULT_CONTEXT,
                 presence_penalty: Optional[float] = None, presence_context_size: int = DEFAULT_CONTEXT,
                 frequency_penalty: Optional[float] = None, frequency_context_size: int = DEFAULT_CONTEXT):
        if not prompt_ids:
            raise ValueError("penalties read the prompt: it cannot be empty")
        self._bias = None
        if logit_bias:
            # As mlx-lm builds them: int ids, float32 values.
            self._bias = (mx.array(list(logit_bias.keys())), mx.array(list(logit_bias.values())))
        self._penalties: list[tuple[str, float, int]] = []
        for kind, value, context in (("repetition", repetition_penalty, repetition_context_size),
                                     ("presence", presence_penalty, presence_context_size),
                                     ("frequency", frequency_penalty, frequency_context_size)):
            if value is None or value == 0 or (kind == "repetition" and value == 1):
                continue
            if context < 1:
                raise ValueError(f"the {kind} penalty's context size must be >= 1")
            if kind == "repetition" and value < 0:
                raise ValueError("the repetition penalty must be > 0")
            self._penalties.append((kind, float(value), int(context)))
        self._keep = max((c for _, _, c in self._penalties), default=1)
        self._history = [int(t) for t in prompt_ids[-self._keep:]]
        self._total = len(prompt_ids)

    def __bool__(self) -> bool:
        return self._bias is not None or bool(self._penalties)

    def allowed(self, drafts: Sequence[int]) -> int:
        return len(drafts)

    def commit(self, tokens: Sequence[int]) -> None:
        self._history = (self._history + [int(t) for t in tokens])[-self._keep:]
        self._total += len(tokens)

    def apply(self, logits: mx.array, drafts: Sequence[int]) -> mx.array:
        rows = logits.shape[0]
        if self._bias is not None:
            indices, values = self._bias
            logits = logits.at[:, indices].add(values)
        if not self._penalties:
            return logits
        # The history's tail, then the drafts: row i's context ends at position len(history) + i.
        seq = mx.concatenate([mx.array(self._history, dtype=mx.uint32), _as_tokens(drafts, rows - 1)])
        for kind, value, context in self._penalties:
            window, real = self._windows(rows, context)
            ids = seq[mx.array(window)]  # [rows, context] token ids
            if kind == "frequency":
                # mlx-lm: logits.at[:, tokens].subtract(penalty); a padding column subtracts 0.
                amount = mx.array(np.where(real, value, 0.0)).astype(logits.dtype)
                logits = logits.at[mx.arange(rows)[:, None], ids].subtract(amount)
                continue
            # Padding columns repeat a token of the window: the same value is written twice.
            picked = mx.take_along_axis(logits, ids, axis=-1)
            if kind == "repetition":
                picked = mx.where(picked < 0, picked * value, picked / value)
            else:
                picked = picked - value
            logits = mx.put_along_axis(logits, ids, picked, axis=-1)
        return logits

    def _windows(self, rows: int, context: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions in ``history tail + drafts`` of each row's last ``context`` tokens, and which are real."""
        kept = len(self._history)
        pos = np.empty((rows, context), dtype=np.int64)
        real = np.zeros((rows, context), dtype=bool)
        for i in range(rows):
            width = min(context, self._total + i)  # mlx-lm: tokens[-context_size:]
            start = kept + i - width
            pos[i, :width] = np.arange(start, start + width)
            pos[i, width:] = start
            real[i, :width] = True
        return pos, real


# --- grammar ------------------------------------------------------------------------------------


# llguidance's LLTokenizer for a tokenizer, built once (~0.3 s for a 49k vocabulary): derived from
# the tokenizer alone, so no request's setting is kept in it.
_LL_TOKENIZERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()

# JSON as the grammar writes it: on one line, with ", " and ": " between items (as Python's
# json.dumps writes it). Free whitespace would let a model pad every gap (a weak or random one
# does, until max_tokens); a schema may still ask for it with llguidance's own "x-guidance" key,
# e.g. {"x-guidance": {"whitespace_flexible": true}, ...}.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    try:
        import llguidance
        import llguidance.hf  # noqa: F401
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise ConstraintError(f"structured output needs the llguidance package ({e}): pip install llguidance") \
            from None
    return llguidance


def _eos_ids(tokenizer) -> list[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids:
        return sorted(int(i) for i in ids)
    return [int(tokenizer.eos_token_id)]


def ll_tokenizer(tokenizer):
    """llguidance's tokenizer for an mlx-lm tokenizer wrapper (cached per tokenizer)."""
    llg = _llguidance()
    try:
        return _LL_TOKENIZERS[tokenizer]
    except (KeyError, TypeError):
        pass
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        built = llg.hf.from_tokenizer(hf, eos_token=_eos_ids(tokenizer))
    except ValueError as e:
        raise ConstraintError(f"structured output needs a fast (Rust) tokenizer: {e}") from None
    try:
        _LL_TOKENIZERS[tokenizer] = built
    except TypeError:
        pass
    return built


@dataclass(frozen=True)
class Constraint:
    """What a request's output must be: JSON (any object, or a schema), or tool calls.

    Attributes:
        kind: ``json_object``, ``json_schema`` or ``tool_call``.
        schema: ``json_schema``: the JSON schema, as JSON text.
        tools: ``tool_call``: the function tools a call may name, as JSON text of
            a list of ``{"name", "parameters"}``.
        parallel: ``tool_call``: one call or more (``parallel_tool_calls``).
    """

    kind: str
    schema: Optional[str] = None
    tools: Optional[str] = None
    parallel: bool = True

    @staticmethod
    def json_schema(schema: Any) -> "Constraint":
        return Constraint("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @staticmethod
    def tool_call(tools: Sequence[dict], parallel: bool = True) -> "Constraint":
        """Calls of ``tools`` (each ``{"name", "parameters"}`` or OpenAI's ``{"type": "function", "function": ...}``)."""
        flat = []
        for t in tools:
            fn = t.get("function", t)
            flat.append({"name": fn["name"], "parameters": fn.get("parameters") or {"type": "object"}})
        return Constraint("tool_call", tools=json.dumps(flat), parallel=parallel)


# llguidance takes a schema's range bounds as signed 64-bit integers (a bound past 2**63 - 1 is capped there: a wrong
# grammar) and its other numbers (a const, an enum) as 64-bit floats: an integer beyond those would be matched as
# another value, or fail (one near -2**63 crashes the process).
_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
BOUND_RANGE = (-(2**63), 2**63 - 1)
EXACT_RANGE = (-(2**53), 2**53)


def _unreadable_number(value: Any, path: str = "") -> Optional[str]:
    """Where in a JSON schema a number lies beyond what llguidance reads exactly (with the number), or None."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        if isinstance(item, float) and not math.isfinite(item):
            return f"{where} ({item})"
        if isinstance(item, int) and not isinstance(item, bool):
            low, high = BOUND_RANGE if key in _BOUNDS else EXACT_RANGE
            if not low <= item <= high:
                return f"{where} ({item})"
        found = _unreadable_number(item, where)
        if found:
            return found
    return None


def _check_numbers(schema: Any, what: str, path: str = "") -> None:
    where = _unreadable_number(schema, path)
    if where:
        raise ConstraintError(f"{what} holds a number the grammar cannot match exactly at {where}: keep minimum and "
                              "maximum within signed 64-bit integers, other integers within +-2^53, and every number finite")


def grammar_text(constraint: Constraint, tokenizer) -> str:
    """The llguidance grammar of a constraint for this tokenizer.

    Raises:
        ConstraintError: A tool call on a model whose calls are not JSON, or a schema that is not JSON.
    """
    llg = _llguidance()
    if constraint.kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if constraint.kind == "json_schema":
        try:
            schema = json.loads(constraint.schema or "")
        except ValueError:
            raise ConstraintError("the JSON schema is not valid JSON") from None
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError("a JSON schema is an object (or true / false)")
        if schema is False:
            raise ConstraintError("the schema false matches no value: give a schema an answer can meet")
        _check_numbers(schema, "the schema")
        # true is any JSON value: the empty schema (llguidance takes only an object to apply its options to).
        return llg.LLMatcher.grammar_from_json_schema({} if schema is True else schema, defaults=JSON_OPTIONS)
    if constraint.kind == "tool_call":
        return _tool_grammar(constraint, tokenizer)
    raise ConstraintError(f"unknown constraint {constraint.kind!r}")


def tool_call_format(tokenizer) -> Optional[str]:
    """Why this tokenizer's tool calls cannot be forced by a grammar, or None when they can.

    A grammar is built for mlx-lm's ``json_tools`` format (Qwen, Hermes and
    others): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.
    """
    parser = getattr(tokenizer, "tool_parser", None)
    if parser is None or not getattr(tokenizer, "has_tool_calling", False):
        return "this model's chat template has no tool-call format"
    module = getattr(parser, "__module__", "") or ""
    if module.rsplit(".", 1)[-1] != "json_tools":
        return (f"this model writes tool calls in the {module.rsplit('.', 1)[-1]!r} format; forcing a call is "
                "built for JSON calls (<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>)")
    return None


def _literal(text: str, tokenizer, lltok) -> str:
    """A Lark term for ``text``: the special token it is, or the string."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1 and lltok.is_special_token(ids[0]):
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def _rebase_refs(schema: Any, base: str) -> Any:
    """``schema`` with every local ``$ref`` ("#", "#/...") made relative to ``base`` instead of its own root."""
    if isinstance(schema, list):
        return [_rebase_refs(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas") \
                and isinstance(value, dict):
            out[key] = {name: _rebase_refs(sub, base) for name, sub in value.items()}  # names, then schemas
        elif key in ("const", "enum", "default", "examples"):
            out[key] = value  # values, not schemas: a "$ref" in them is data
        else:
            out[key] = _rebase_refs(value, base)
    return out


def _tool_grammar(constraint: Constraint, tokenizer) -> str:
    why = tool_call_format(tokenizer)
    if why:
        raise ConstraintError(why)
    tools = json.loads(constraint.tools or "[]")
    if not tools:
        raise ConstraintError("forcing a tool call needs tools")
    for i, t in enumerate(tools):
        if not isinstance(t["parameters"], (dict, bool)):
            raise ConstraintError(f"tool {t['name']!r}: parameters must be a JSON schema object", tool=i)
        try:
            _check_numbers(t["parameters"], f"tool {t['name']!r}", "parameters")
        except ConstraintError as e:
            raise ConstraintError(str(e), tool=i) from None
    # Each tool's parameters sit inside the call's schema: their local references ("#/$defs/X", what pydantic
    # writes for nested models) would point into the call's root, where nothing is: rebased to where they are.
    where = ["#/properties/arguments"] if len(tools) == 1 else \
        [f"#/anyOf/{i}/properties/arguments" for i in range(len(tools))]
    calls = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                               "arguments": _rebase_refs(t["parameters"], base)},
              "required": ["name", "arguments"], "additionalProperties": False} for t, base in zip(tools, where)]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    # As json_tools templates write them: {"name": ..., "arguments": ...} with ", " and ": ".
    schema = {**schema, "x-guidance": JSON_OPTIONS}
    lltok = ll_tokenizer(tokenizer)
    start = _literal(tokenizer.tool_call_start, tokenizer, lltok)
    end = _literal(tokenizer.tool_call_end, tokenizer, lltok)
    more = ' ("\\n" call)*' if constraint.parallel else ""
    return (f"start: call{more}\n"
            f"call: {start} \"\\n\" body \"\\n\" {end}\n"
            f"body: %json {json.dumps(schema)}\n")


class Grammar:
    """A llguidance grammar over a request's output: only tokens that keep it valid are allowed.

    Each verify row's mask is the grammar's after the committed tokens and
    the drafts before that row (the matcher advances over the drafts, then
    rolls back); end-of-sequence tokens are allowed exactly where the grammar
    is complete. Drafts the grammar refuses are cut by ``allowed`` before the
    verify. The state advances only in ``commit``.

    Args:
        tokenizer: mlx-lm's tokenizer wrapper.
        grammar: A llguidance grammar (see :func:`grammar_text`).
    """

    lazy = False

    def __init__(self, tokenizer, grammar: str):
        llg = _llguidance()
        self.lltok = ll_tokenizer(tokenizer)
        self.eos = frozenset(_eos_ids(tokenizer))
        self.matcher = llg.LLMatcher(self.lltok, grammar, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(f"it cannot be compiled to a grammar ({_short(self.matcher.get_error())})")
        self.words = (self.lltok.vocab_size + 31) // 32
        self._done = False  # an end-of-sequence token was committed

    def allowed(self, drafts: Sequence[int]) -> int:
        drafts = [int(t) for t in drafts]
        if self._done:
            return 0
        n = self.matcher.validate_tokens(drafts) if drafts else 0
        if n < len(drafts) and drafts[n] in self.eos:
            # An end-of-sequence draft is kept where the grammar is complete after the drafts before it.
            ok = self.matcher.consume_tokens(drafts[:n]) if n else True
            accepting = ok and self.matcher.is_accepting()
            if n:
                self.matcher.rollback(n)
            n += int(accepting)
        return n

    def apply(self, logits: mx.array, drafts: Sequence[int]) -> mx.array:
        rows, vocab = logits.shape
        drafts = [int(t) for t in drafts][: rows - 1]
        masks = np.zeros((rows, self.words), dtype=np.int32)
        fed = 0
        try:
            for i in range(rows):
                if i and not self._done:
                    token = drafts[i - 1]
                    if token in self.eos:
                        masks[i] = masks[i - 1]  # nothing follows an end of sequence: any row will do
                        continue
                    if not self.matcher.consume_token(token):
                        raise RuntimeError(f"a draft the grammar refused was verified: {self.matcher.get_error()}")
                    fed += 1
                self._mask_into(masks, i)
        finally:
            if fed:
                self.matcher.rollback(fed)
        allowed = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little").astype(bool)
        if allowed.shape[1] >= vocab:
            allowed = allowed[:, :vocab]
        else:  # ids past the tokenizer's vocabulary (a padded embedding) are never allowed
            allowed = np.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])))
        return mx.where(mx.array(allowed), logits, -float("inf"))

    def _mask_into(self, masks: np.ndarray, i: int) -> None:
        row = masks[i]
        if self._done:
            row[:] = -1  # the output ended: no row after it is ever used
            return
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self.matcher.is_error():
            raise RuntimeError(f"the grammar failed: {self.matcher.get_error()}")
        accepting = self.matcher.is_accepting()
        bits = row.view(np.uint32)
        for t in self.eos:
            if t < 32 * self.words:
                word, bit = divmod(t, 32)
                if accepting:
                    bits[word] |= np.uint32(1 << bit)
                else:
                    bits[word] &= ~np.uint32(1 << bit)

    def commit(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            t = int(t)
            if self._done:
                return
            if t in self.eos:
                self._done = True
                return
            if not self.matcher.consume_token(t):
                raise RuntimeError(f"the grammar refused a committed token: {self.matcher.get_error()}")

    @property
    def accepting(self) -> bool:
        """The output so far is complete under the grammar."""
        return self._done or self.matcher.is_accepting()


def _short(error: str) -> str:
    return " ".join(str(error).split())[:500]


# --- one factory for every face ----------------------------------------------------------------


def make_processors(request: Any, tokenizer, prompt_ids: Sequence[int]) -> tuple:
    """The logits processors a request asks for (a fresh, request-owned state each call).

    Reads the request's ``logit_bias``, ``repetition_penalty`` /
    ``repetition_context_size``, ``presence_penalty`` / ``presence_context_size``,
    ``frequency_penalty`` / ``frequency_context_size`` and ``constraint``
    (a :class:`Constraint`) where it has them; returns ``()`` when it asks for none.

    Raises:
        ConstraintError: The constraint cannot be built (an unsupported schema, a tool format).
        ValueError: A penalty out of range.
    """
    get = lambda name, default=None: getattr(request, name, default)  # noqa: E731
    out: list = []
    bias = get("logit_bias")
    penalties = Penalties(
        prompt_ids, logit_bias=dict(bias) if bias else None,
        repetition_penalty=get("repetition_penalty"),
        repetition_context_size=get("repetition_context_size", DEFAULT_CONTEXT) or DEFAULT_CONTEXT,
        presence_penalty=get("presence_penalty"),
        presence_context_size=get("presence_context_size", DEFAULT_CONTEXT) or DEFAULT_CONTEXT,
        frequency_penalty=get("frequency_penalty"),
        frequency_context_size=get("frequency_context_size", DEFAULT_CONTEXT) or DEFAULT_CONTEXT,
    )
    if penalties:
        out.append(penalties)
    constraint = get("constraint")
    if constraint is not None:
        out.append(Grammar(tokenizer, grammar_text(constraint, tokenizer)))
    return tuple(out)


def check_constraint(constraint: Optional[Constraint], tokenizer) -> None:
    """Build the constraint's grammar once, so a request that cannot run fails before it is queued.

    Raises:
        ConstraintError: Naming what is wrong (for a forced call, which tool's ``parameters`` when they are).
    """
    if constraint is None:
        return
    try:
        _build(constraint, tokenizer)
    except ConstraintError as e:
        if constraint.kind != "tool_call" or e.tool is not None or tool_call_format(tokenizer) is not None:
            raise
        # The call's grammar holds every tool's parameters: name the tool whose schema fails on its own (its
        # reason alone, not the whole call grammar llguidance quotes).
        for i, t in enumerate(json.loads(constraint.tools or "[]")):
            try:
                _build(Constraint.json_schema(t["parameters"]), tokenizer)
            except ConstraintError as alone:
                raise ConstraintError(f"the parameters of tool {t['name']!r}: {alone}", tool=i) from None
        raise


def _build(constraint: Constraint, tokenizer) -> None:
    grammar = Grammar(tokenizer, grammar_text(constraint, tokenizer))
    # Some schemas compile, then fail at the first token ({"$ref": "#"}: NoExtensionBias): ask for it now.
    try:
        grammar._mask_into(np.zeros((1, grammar.words), dtype=np.int32), 0)
    except RuntimeError:
        first = (str(grammar.matcher.get_error()).strip().splitlines() or ["no reason given"])[0]
        raise ConstraintError(f"it cannot be decoded: its grammar fails before the first token "
                              f"({_short(first)})") from None


# --- log-probabilities -----------------------------------------------------------------------------


def logprob_arrays(logits: mx.array, tokens: mx.array, top: int) -> tuple:
    """Lazy log-probabilities of ``tokens`` (one per row) and, with ``top``, each row's best ``top``.

    As mlx-lm computes them: the (processed) logits minus their logsumexp, in
    the logits' dtype. Returns ``(chosen [R], ids [R, top] or None, values [R, top] or None)``.
    """
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, tokens.astype(mx.int32)[:, None], axis=-1)[:, 0]
    if not top:
        return chosen, None, None
    top = min(top, lp.shape[-1])
    ids = mx.argpartition(-lp, kth=top - 1, axis=-1)[:, :top]
    values = mx.take_along_axis(lp, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return chosen, mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)


def logprob_entries(arrays: tuple, rows: int) -> tuple:
    """The first ``rows`` rows of :func:`logprob_arrays`' (evaluated) output as
    ``((logprob, ((token, logprob), ...)), ...)``; alternatives a processor ruled out are left out."""
    chosen, ids, values = arrays
    lps = chosen[:rows].astype(mx.float32).tolist()
    if ids is None:
        return tuple((lp, ()) for lp in lps)
    tops = zip(ids[:rows].tolist(), values[:rows].astype(mx.float32).tolist())
    # Tokens a processor ruled out (-inf: a grammar's mask) are no alternatives.
    return tuple((lp, tuple((t, x) for t, x in zip(i, v) if x != -math.inf)) for lp, (i, v) in zip(lps, tops))
