"""``--compare-ar``: plain decoding on the same prompt ids, side by side, and a verdict.

Greedy, or sampled with a seed: seeded draws are keyed by (seed, position)
(see :mod:`specdec_cli.core.sampling`), so plain decoding with the same seed
samples the very text a lossless speculative run must produce.

When the outputs differ, the target's prediction at the first differing
position is computed again both ways: the one-token path plain decoding took
(prefill, then one token per forward), and the speculative path, replayed
from the run's record of blocks (each verify forward with its row count, the
rollback each block reports; the engine itself is not used). Verdicts:

- ``identical``: the same tokens;
- ``rounding tie``: each path reproduces its own run's token, so the two
  computations of the same numbers disagree about the two tokens by at least
  the margin between them: plain decoding would itself flip with the other
  kernel, not a bug. A row decoded in a batch cannot be replayed alone with
  its batch's kernels; where the backend rounds a batched row otherwise than
  the row alone (a GPU), its divergence is a rounding tie when plain decoding's
  own path reproduces its token and that token leads the row's by at most
  what the backend's rounding moves a logit by (:class:`~specdec_cli.cache.batch_check.Rounding`,
  measured by the batch check);
- ``diverged``: anything else (a path does not reproduce its run): a bug.

The quantities are the ones selection compares: log-probabilities in the
model's dtype (see :func:`specdec_cli.core.sampling.greedy`); with a seed, the
sampling distribution's log-probabilities plus the position's Gumbel noise,
whose argmax is the keyed draw (see :func:`specdec_cli.core.sampling.keyed_pick`).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..cache.batch_check import Rounding
from ..cache.caches import ModelCache, make_cache
from ..core.blocks import Block
from .events import collect
from .runner import run
from ..core.sampling import GREEDY, SamplingParams, greedy, keyed_pick, log_probs, position_noise
from ..core.stats import Stats

if TYPE_CHECKING:
    from ..model.distributed import Ranks

IDENTICAL, TIE, DIVERGED = "identical", "rounding tie", "diverged"
RECORDED = ("capture", "tape")


@dataclass(frozen=True)
class Recomputed:
    """The target's prediction at one position, computed both ways.

    Attributes:
        rows: Rows of the verify forward (T) the speculative run used there.
        row: Row within it that predicted the position.
        one_row: Scores from the one-token path (plain decoding's), float32: log-probabilities
            (plus the position's noise with a seed, see the module docstring).
        verify: Scores from the replayed speculative path, float32.
        logits: The one-token path's (processed) logits there, as the model computed them.
    """

    rows: int
    row: int
    one_row: mx.array
    verify: mx.array
    logits: Optional[mx.array] = None


@dataclass(frozen=True)
class Divergence:
    """Where speculative and plain output first differ, and why.

    Attributes:
        index: Position in the generated tokens.
        specdec_token: Token speculative decoding produced there (None: it ended).
        plain_token: Token plain decoding produced there (None: it ended).
        top2_margin: Target's top-1 minus top-2 log-probability there (one-token path).
        verdict: ``rounding tie`` or ``diverged``.
        margin: Plain's token minus the speculative one, in the one-token
            path's log-probabilities (the top-2 margin when the speculative
            token is the runner-up); None when a token is unknown.
        difference: How much the two paths disagree on that gap: the
            one-token path's gap minus the speculative path's, in absolute value.
        rows: Rows of the verify forward that produced the speculative token.
        row: Its row within that forward.
        verify_token: The token the recomputed verify path picks.
        reproduced: Each recomputed path picks its own run's token, and the
            replay found every speculative token where its forwards put it.
        mismatch: First position where the speculative run's own forwards,
            replayed, pick another token than it emitted (a bug), or None.
        bound: For a row decoded in a batch, what the backend's rounding may move a logit by
            there (a tie's margin is at most this); None otherwise.
    """

    index: int
    specdec_token: Optional[int]
    plain_token: Optional[int]
    top2_margin: Optional[float]
    verdict: str = DIVERGED
    margin: Optional[float] = None
    difference: Optional[float] = None
    rows: int = 1
    row: int = 0
    verify_token: Optional[int] = None
    reproduced: bool = False
    mismatch: Optional[int] = None
    bound: Optional[float] = None


@dataclass(frozen=True)
class Comparison:
    """The verdict and the plain run's own statistics."""

    identical: bool
    tokens: int
    divergence: Optional[Divergence]
    plain: Stats

    @property
    def verdict(self) -> str:
        """``identical``, ``rounding tie`` or ``diverged``."""
        return IDENTICAL if self.identical else self.divergence.verdict

    @property
    def ok(self) -> bool:
        """Identical, or different only by a proven rounding tie."""
        return self.verdict != DIVERGED


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first difference between two token lists (None if equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _logprobs(logits: mx.array) -> mx.array:
    # As greedy selection computes them: in the model's dtype.
    return (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(mx.float32)


def _score(logits: mx.array, sampling: SamplingParams, position: int) -> mx.array:
    """What selection compares for one row at generated ``position`` (float32); its argmax is the token."""
    if not sampling.keyed:
        return _logprobs(logits)
    lp = log_probs(logits[None], sampling)
    return (lp + position_noise(sampling.seed, position, 1, lp.shape[-1]))[0]


def _picks(logits: mx.array, sampling: SamplingParams, position: int) -> mx.array:
    """The tokens selection picks for rows at generated positions ``position`` onwards, as the engine picks them."""
    if not sampling.keyed:
        return greedy(logits)
    return keyed_pick(log_probs(logits, sampling), sampling.at(position))


def _ids(tokens: Sequence[int]) -> mx.array:
    return mx.array(list(tokens), dtype=mx.uint32)


@dataclass(frozen=True)
class Replay:
    """The speculative run's target forwards, computed again from its record.

    Attributes:
        rows: Rows of the verify forward that predicted the asked position.
        row: The row within it.
        logprobs: Scores there, as :class:`Recomputed` has them (float32).
        mismatch: First generated position whose token is not what the
            replayed forwards pick (None: every block checks out).
    """

    rows: int
    row: int
    logprobs: Optional[mx.array]
    mismatch: Optional[int]


def _fresh(model: nn.Module, prompt_ids: Sequence[int], prefill_step_size: int,
           prefill_chunks: Optional[Sequence[int]], kv_bits: Optional[int], kv_group_size: int,
           sync: Optional[Ranks] = None) -> ModelCache:
    # The runs' own cache kind and prefill chunks: the same sizes give the same bits.
    layers = make_cache(model, kv_bits=kv_bits, kv_group_size=kv_group_size) if kv_bits else None
    cache = ModelCache(model, layers)
    cache.prefill(prompt_ids[:-1], prefill_step_size, sizes=prefill_chunks or None,
                  agree=None if sync is None else sync.prefill_chunk)
    return cache


def _watch(sync: Optional[Ranks]) -> ExitStack:
    stack = ExitStack()
    if sync is not None:
        stack.enter_context(sync.watching())
    return stack


def replay(
    model: nn.Module,
    prompt_ids: Sequence[int],
    tokens: Sequence[int],
    trace: Sequence[Block],
    index: int,
    *,
    eos_ids: Sequence[int] = (),
    prefill_step_size: int = 2048,
    prefill_chunks: Optional[Sequence[int]] = None,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    sync: Optional[Ranks] = None,
    sampling: SamplingParams = GREEDY,
    processors: Optional[Callable[[], tuple]] = None,
) -> Replay:
    """Recompute every target forward of a speculative run (greedy, or seeded) and check its tokens.

    Each block's verify forward runs again with its row count (carried
    tokens, last, the drafts that were kept; the rows after them, which
    cannot change the kept ones, padded), then the rollback the block reports.
    Every kept token must be the pick of its row: the engine's
    bookkeeping is not used, so an engine that kept a wrong row or token is
    caught here, wherever rounding ties put the output.

    Args:
        model: The target.
        prompt_ids: Prompt token ids.
        tokens: The speculative run's output.
        trace: Its blocks, in order.
        index: The generated position whose prediction to return.
        eos_ids: Ids that ended the run.
        prefill_step_size: Prompt chunk size the run used.
        prefill_chunks: The run's prefill chunk sizes.
        kv_bits: The run's KV-cache quantization (None: none).
        kv_group_size: Its group size.
        sync: The ranks of a sharded target: the picks that steer the replay are rank 0's.
        sampling: Greedy, or sampling keyed by a seed (unseeded draws cannot be replayed).
        processors: Makes the run's logits processors afresh (applied to the
            replayed rows as the run applied them).
    """
    with _watch(sync):
        return _replay(model, prompt_ids, tokens, trace, index, eos_ids, prefill_step_size, prefill_chunks,
                       kv_bits, kv_group_size, sync, sampling, processors() if processors else ())


def _replay(model, prompt_ids, tokens, trace, index, eos_ids, prefill_step_size, prefill_chunks, kv_bits,
            kv_group_size, sync, sampling, procs=()) -> Replay:
    cache = _fresh(model, prompt_ids, prefill_step_size, prefill_chunks, kv_bits, kv_group_size, sync)
    eos = frozenset(eos_ids)
    # A run that cut recurrent layers back from recorded states fed every verify recorded.
    record = next((b.rollback for b in trace if b.rollback in RECORDED), None)
    carry: list[int] = []
    last = prompt_ids[-1]
    emitted = 0
    found: tuple[int, int, Optional[mx.array]] = (0, 0, None)
    for block in trace:
        keep = len(block.tokens) + (block.finish_reason == "stop")  # committed tokens kept
        k, c, a = block.drafted, len(carry), int(block.ahead)
        if block.carry != c or block.verify_len < c + 1 + k - a or keep > k + 1 or (a and c):
            return Replay(*found, emitted)  # the record does not add up
        x = carry + [last] + list(tokens[emitted : emitted + min(k, keep - 1)])
        x += [0] * (block.verify_len + a - len(x))
        # A block whose last came ahead: that row alone first (queued before the previous token was read), then
        # the drafts' forward; the rollback counts from after it.
        head = cache.feed(_ids(x[:1])) if a else None
        snap = cache.snapshot()
        position = cache.length
        logits = cache.feed(_ids(x[a:]), record=record) if block.verify_len else None
        logits = head if logits is None else logits if head is None else mx.concatenate([head, logits])
        rows = logits[c : c + keep]
        for proc in procs:
            rows = proc.apply(rows, x[c + 1 : c + keep])
        picks = _picks(rows, sampling, emitted)
        picks = picks.tolist() if sync is None else sync.settle(sync.propose(picks, _ids(x), position))
        if emitted <= index < emitted + keep:
            row = c + index - emitted
            # The forward that computed it: the one-row forward queued ahead, or the block's own.
            found = ((1, 0) if a and row == 0 else (block.verify_len, row - a)) + (
                _score(rows[index - emitted], sampling, index),)
        want = list(tokens[emitted : emitted + len(block.tokens)])
        if picks[: len(want)] != want or (block.finish_reason == "stop" and picks[-1] not in eos):
            bad = next((i for i, (p, w) in enumerate(zip(picks, want)) if p != w), len(want))
            return Replay(*found, emitted + bad)
        for proc in procs:
            proc.commit(picks[:keep])
        n = c + keep - a  # rows fed since snap the target keeps: carry, last (unless ahead), the kept drafts
        x = x[a:]
        carry = []
        if block.rollback == "trim":
            cache.rollback(snap, n)
        elif block.rollback == "carry":
            cache.restore(snap)
            carry = x[:n]
        elif block.rollback in RECORDED:
            cache.rollback_recorded(snap, n)
        elif block.rollback == "reforward":
            if cache.rollback(snap, n):
                cache.feed(_ids(x[:n]))
        elif n != len(x):
            return Replay(*found, emitted)
        mx.eval(cache.state_arrays())
        if block.finish_reason:
            break
        last = want[-1]
        emitted += len(block.tokens)
    return Replay(*found, None)


def one_token(
    model: nn.Module, prompt_ids: Sequence[int], tokens: Sequence[int], index: int, *, prefill_step_size: int = 2048,
    prefill_chunks: Optional[Sequence[int]] = None, kv_bits: Optional[int] = None, kv_group_size: int = 64,
    sync: Optional[Ranks] = None,
    sampling: SamplingParams = GREEDY,
    processors: Optional[Callable[[], tuple]] = None,
) -> mx.array:
    """Plain decoding's prediction of generated token ``index``, computed again (one token per forward)."""
    return _score(one_token_logits(model, prompt_ids, tokens, index, prefill_step_size=prefill_step_size,
                                   prefill_chunks=prefill_chunks, kv_bits=kv_bits, kv_group_size=kv_group_size,
                                   sync=sync, processors=processors), sampling, index)


def one_token_logits(
    model: nn.Module, prompt_ids: Sequence[int], tokens: Sequence[int], index: int, *, prefill_step_size: int = 2048,
    prefill_chunks: Optional[Sequence[int]] = None, kv_bits: Optional[int] = None, kv_group_size: int = 64,
    sync: Optional[Ranks] = None, processors: Optional[Callable[[], tuple]] = None,
) -> mx.array:
    """The (processed) logits plain decoding computes for generated token ``index`` (one token per forward)."""
    with _watch(sync):
        cache = _fresh(model, prompt_ids, prefill_step_size, prefill_chunks, kv_bits, kv_group_size, sync)
        for t in [prompt_ids[-1], *tokens[:index]]:
            logits = cache.feed(_ids([t]))[-1]
            mx.eval(logits, cache.state_arrays())
            if sync is not None:
                sync.tick()  # every forward waits on the other ranks: they are there
    procs = processors() if processors else ()
    for proc in procs:
        proc.commit(list(tokens[:index]))
        logits = proc.apply(logits[None], ())[0]
    return logits


def recompute(
    model: nn.Module,
    prompt_ids: Sequence[int],
    tokens: Sequence[int],
    trace: Sequence[Block],
    index: int,
    *,
    eos_ids: Sequence[int] = (),
    **run_options,
) -> tuple[Recomputed, Optional[int]]:
    """The prediction of generated token ``index`` by the one-token and the speculative path.

    ``run_options``: ``prefill_step_size``, ``prefill_chunks``, ``kv_bits``,
    ``kv_group_size`` and ``sampling`` as the runs used them.

    Returns:
        Both predictions, and the replay's first mismatching position (None
        when the speculative run's every token is what its forwards pick).
    """
    again = replay(model, prompt_ids, tokens, trace, index, eos_ids=eos_ids, **run_options)
    sampling = run_options.pop("sampling", GREEDY)
    logits = one_token_logits(model, prompt_ids, tokens, index, **run_options)
    one = _score(logits, sampling, index)
    verify = again.logprobs if again.logprobs is not None else mx.full(one.shape, float("nan"))
    return Recomputed(again.rows, again.row, one, verify, logits), again.mismatch


def explain(
    model: nn.Module,
    prompt_ids: Sequence[int],
    specdec_tokens: Sequence[int],
    plain_tokens: Sequence[int],
    trace: Sequence[Block],
    *,
    eos_ids: Sequence[int] = (),
    rounding: Optional[Rounding] = None,
    **run_options,
) -> Optional[Divergence]:
    """The first divergence between the two outputs and its verdict (None when identical).

    Args:
        model: The target.
        prompt_ids: Prompt token ids.
        specdec_tokens: Speculative output.
        plain_tokens: Plain decoding's output.
        trace: The speculative run's blocks, in order.
        eos_ids: Ids that ended the runs.
        rounding: The speculative run decoded (or prefilled) its row in a batch: the backend's rounding,
            which a tie the replay cannot prove (its forwards were the batch's) is held to.
        run_options: ``prefill_step_size``, ``prefill_chunks``, ``kv_bits``,
            ``kv_group_size`` and ``sampling`` as the runs used them.
    """
    index = first_divergence(specdec_tokens, plain_tokens)
    if index is None:
        return None
    at = lambda seq: seq[index] if index < len(seq) else None  # noqa: E731
    spec_tok, plain_tok = at(specdec_tokens), at(plain_tokens)
    rec, mismatch = recompute(model, prompt_ids, specdec_tokens, trace, index, eos_ids=eos_ids, **run_options)
    one, ver = rec.one_row, rec.verify
    top = mx.topk(one, 2)
    top2 = (top.max() - top.min()).item()
    one_pick, ver_pick = mx.argmax(one).item(), mx.argmax(ver).item()
    # A run that ended there picked an EOS.
    plain_pick = plain_tok if plain_tok is not None else (one_pick if one_pick in eos_ids else None)
    spec_pick = spec_tok if spec_tok is not None else (ver_pick if ver_pick in eos_ids else None)
    if spec_pick is None and rounding is not None and eos_ids:
        spec_pick = max(eos_ids, key=lambda e: one[e].item())  # the batched row ended: with its likeliest EOS
    reproduced = (plain_pick is not None and one_pick == plain_pick and spec_pick is not None
                  and ver_pick == spec_pick and mismatch is None)
    margin = difference = None
    if plain_pick is not None and spec_pick is not None:
        margin = (one[plain_pick] - one[spec_pick]).item()
        gap = (ver[plain_pick] - ver[spec_pick]).item()
        difference = abs(margin - gap) if gap == gap else None  # NaN: nothing recomputed
    tie = reproduced and difference is not None and 0 < difference and margin <= difference
    bound = None
    if rounding is not None and margin is not None and one_pick == plain_pick:
        # The batch's kernels are not replayed: plain decoding's token leads by no more than rounding moves a logit.
        sampling = run_options.get("sampling", GREEDY)
        bound = rounding.bound(rec.logits) / (sampling.temp if sampling.keyed else 1.0)  # scores are logits / temp
        tie = tie or margin <= bound
    sync = run_options.get("sync")
    if sync is not None:
        # Margins are each rank's own arithmetic: rank 0's verdict is every rank's (and its exit code).
        tie = bool(sync.share_one(int(tie)))
    return Divergence(index, spec_tok, plain_tok, top2, TIE if tie else DIVERGED, margin, difference,
                      rec.rows, rec.row, ver_pick, reproduced, mismatch, bound)


def compare_with_plain(
    model: nn.Module,
    prompt_ids: Sequence[int],
    specdec_tokens: Sequence[int],
    trace: Sequence[Block] = (),
    *,
    max_tokens: int,
    eos_ids: Sequence[int] = (),
    prefill_step_size: int = 2048,
    prefill_chunks: Optional[Sequence[int]] = None,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    sync: Optional[Ranks] = None,
    sampling: SamplingParams = GREEDY,
    processors: Optional[Callable[[], tuple]] = None,
    rounding: Optional[Rounding] = None,
) -> Comparison:
    """Run plain decoding with fresh caches, compare token by token, explain a difference.

    ``prefill_chunks`` (the speculative run's) makes both prefills identical;
    ``kv_bits`` gives plain decoding the same quantized KV cache. Plain
    decoding runs warm: its one shape was warmed before the speculative run
    timed anything. With ``sync`` (a sharded target) plain decoding runs
    sharded the same way, and the verdict is rank 0's on every rank.
    ``sampling``: greedy, or sampling with a seed (the speculative run's);
    unseeded draws differ from run to run and are refused.
    ``processors``: makes the speculative run's logits processors afresh;
    plain decoding runs with its own set, and a difference is explained with them.
    ``rounding``: the row was decoded in a batch (see :func:`explain`).
    """
    if not sampling.greedy and not sampling.keyed:
        raise ValueError("only greedy or seeded sampled runs can be compared with plain decoding")
    kv = dict(kv_bits=kv_bits, kv_group_size=kv_group_size)
    stats, plain = collect(run(model, prompt_ids, max_tokens=max_tokens, eos_ids=eos_ids, sampling=sampling,
                               prefill_step_size=prefill_step_size, prefill_chunks=prefill_chunks, sync=sync,
                               processors=processors() if processors else (), **kv))
    divergence = explain(model, prompt_ids, specdec_tokens, plain, trace, eos_ids=eos_ids, sampling=sampling,
                         prefill_step_size=prefill_step_size, prefill_chunks=prefill_chunks, sync=sync,
                         processors=processors, rounding=rounding, **kv)
    return Comparison(divergence is None, len(plain), divergence, stats)


def comparison_dict(cmp: "Comparison", stats: Stats, tokenizer) -> dict:
    """A comparison as ``--json`` reports it: the verdict, the first divergence (tokens as id and text), the speedup."""
    divergence = None
    if cmp.divergence is not None:
        d = cmp.divergence

        def token(t):
            return None if t is None else {"id": t, "text": tokenizer.decode([t])}

        divergence = {
            "index": d.index,
            "specdec_token": token(d.specdec_token),
            "plain_token": token(d.plain_token),
            "top2_margin": d.top2_margin,
            "verify_rows": d.rows,
            "verify_row": d.row,
            "verify_token": token(d.verify_token),
            "reproduced": d.reproduced,
            "replay_mismatch": d.mismatch,
            "rounding_bound": d.bound,
        }
    ar_tps = cmp.plain.decode_tps
    # null where the text line says "no speedup measurable": a side generated nothing or took no time.
    measurable = stats.generated and cmp.plain.generated and stats.decode_tps and ar_tps
    return {
        "identical": cmp.identical,
        "verdict": cmp.verdict,
        # Log-probability units, as greedy selection compares them.
        "margin": cmp.divergence.margin if cmp.divergence else None,
        "difference": cmp.divergence.difference if cmp.divergence else None,
        "tokens": cmp.tokens,
        "first_divergence": divergence,
        "ar_decode_tps": ar_tps,
        "speedup": stats.decode_tps / ar_tps if measurable else None,
    }
