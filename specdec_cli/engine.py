"""The draft -> verify -> accept loop, and plain decoding with the same interface.

Both are generators that yield one :class:`Block` per target forward. They
never print or time display; the caller owns the caches (prefilled with all
but the last prompt token) and passes the last prompt token in.

Invariant between blocks, and after the generator ends for any reason: each
cache holds the prompt and every committed token except the last one, exactly
as plain decoding would leave it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import mlx.core as mx

from .adaptive import DraftPolicy, FixedLength
from .caches import ModelCache
from .drafters import Drafter
from .hooks import HiddenTap
from .sampling import GREEDY, SamplingParams, accept_greedy, accept_keyed, accept_sampled, choose, greedy, log_probs

if TYPE_CHECKING:
    from .distributed import Ranks


@dataclass(frozen=True)
class PhaseTimes:
    """Wall seconds of one block's phases, each closed by its own sync."""

    draft_s: float
    verify_s: float
    rollback_s: float


@dataclass(frozen=True)
class Block:
    """What one target forward produced.

    Attributes:
        tokens: Tokens committed and emitted by this block (an EOS is not emitted).
        drafted: Draft tokens the target verified.
        accepted: Drafts that matched the target (``accepted <= drafted``).
        rollback: ``none`` (full accept), ``trim`` (O(1) offset move),
            ``reforward`` (recurrent state restored and the kept tokens re-fed),
            ``carry`` (restored; the kept tokens lead the next verify),
            ``capture`` (the per-token state kept during the verify selected)
            or ``tape`` (the recurrence alone replayed over the kept tokens).
        syncs: Host syncs the block waited on.
        finish_reason: ``stop`` (EOS), ``length`` (max_tokens) or None.
        times: Phase timings, only when the generator was asked for them.
        verify_len: Rows of the target forward (carried tokens + last + drafts).
        carry: Carried tokens leading it; the row predicting this block's
            i-th token is ``carry + i``. Both let ``--compare-ar`` recompute a
            position exactly as the verify computed it.
    """

    tokens: tuple[int, ...]
    drafted: int
    accepted: int
    rollback: str
    syncs: int
    finish_reason: Optional[str] = None
    times: Optional[PhaseTimes] = None
    verify_len: int = 1
    carry: int = 0

    @property
    def block_size(self) -> int:
        """Tokens the target's forward verified (drafts + the bonus position)."""
        return self.drafted + 1


def _cut(committed: list[int], eos_ids: frozenset[int], room: int) -> tuple[int, Optional[str]]:
    """How many committed tokens to keep, and why generation stops (if it does)."""
    for i, tok in enumerate(committed[:room]):
        if tok in eos_ids:
            return i + 1, "stop"
    if len(committed) >= room:
        return room, "length"
    return len(committed), None


ROLLBACKS = ("reforward", "carry", "capture", "tape")
# Carried tokens beyond this are re-fed at once: the next verify would grow
# with every consecutive partial accept.
MAX_CARRY = 8
# How far the engine restores the target below the start offset of its latest
# forward: plain decoding's queued step (the speculative loop itself only cuts
# back to the snapshot taken right before its verify forward).
TARGET_REACH = 1


def speculative_generate_step(
    last: int,
    cache: ModelCache,
    drafter: Drafter,
    *,
    max_tokens: int,
    num_draft_tokens: Optional[int] = None,
    policy: Optional[DraftPolicy] = None,
    eos_ids: Sequence[int] = (),
    sampling: SamplingParams = GREEDY,
    rollback: str = "carry",
    timed: bool = False,
    tap: Optional[HiddenTap] = None,
    sync: Optional[Ranks] = None,
) -> Iterator[Block]:
    """Speculative decoding: greedy, or lossless sampling at temp > 0.

    Sampling is rejection sampling, or with a seed (``sampling.seed``) draws
    keyed by position (see :mod:`specdec_cli.sampling`): then the text does
    not depend on the draft lengths.

    Each block drafts up to k tokens, verifies ``[last, d1..dk]`` in one
    target forward, computes the accepted length on the device and reads it
    back in one host sync.

    Recurrent state cannot be trimmed. After a partial accept it is either
    restored to its snapshot and the accepted tokens fed again at once
    (``reforward``) or prepended to the next verify forward (``carry``: no
    extra forward, a longer one; at most ``MAX_CARRY`` tokens wait), or it is
    cut back exactly from what the verify forward recorded: the state after
    each token (``capture``) or the recurrence inputs, replayed without the
    layer's projections (``tape``). Attention layers always trim in O(1).

    Args:
        last: The last prompt token (not yet fed to either cache).
        cache: The target's prefilled caches.
        drafter: A prefilled drafter in step with ``cache``.
        max_tokens: Stop after this many emitted tokens.
        num_draft_tokens: Drafts per block (block size - 1), when no policy is given.
        policy: Chooses each block's draft length (see :mod:`specdec_cli.adaptive`).
        eos_ids: Token ids that end generation (not emitted).
        sampling: Greedy (default) or sampling options.
        rollback: Recurrent rollback strategy: ``reforward``, ``carry``,
            ``capture`` or ``tape`` (the last two need ``cache.can_record``).
        timed: Add a sync after each phase and report :class:`PhaseTimes`.
        tap: Records the target's hidden states for a drafter that reads
            them (``drafter.taps``); the committed rows of each verify go to
            ``drafter.accept``.
        sync: The ranks of a sharded target: each block's accepted length and
            next token are rank 0's, agreed in the block's one host sync
            together with a check that every rank verified the same tokens;
            a clocked policy reads rank 0's block time (one more small
            collective and sync per block).

    Yields:
        One :class:`Block` per target forward.
    """
    if policy is None:
        if num_draft_tokens is None or num_draft_tokens < 0:
            raise ValueError("give num_draft_tokens >= 0 or a policy")
        policy = FixedLength(num_draft_tokens)
    if rollback not in ROLLBACKS:
        raise ValueError(f"rollback must be one of {ROLLBACKS}")
    # Before the first token: every verify row count this run can use must compute as one-token decoding.
    cache.check_verify(max(verify_rows(getattr(policy, "k_max", getattr(policy, "k", 0)), cache.recurrent,
                                       rollback)))
    record = rollback if rollback in ("capture", "tape") and cache.recurrent else None
    if record and not cache.can_record:
        raise ValueError(f"--rollback {rollback} cannot run on this model ({cache.record_problem})")
    cache.ensure_reach(TARGET_REACH)
    eos = frozenset(eos_ids)
    emitted = 0
    # Committed tokens the target has not been fed yet (carry strategy).
    carry = mx.array([], dtype=mx.uint32)
    try:
        while emitted < max_tokens:
            room = max_tokens - emitted
            snap = None
            done = False
            try:
                t0 = time.perf_counter()
                # With a seed, draws are keyed by the generated position: row i of this block is token emitted + i.
                params = sampling.at(emitted)
                draft = drafter.propose(last, min(policy.next_k(), room - 1), params)
                k, syncs = draft.size, draft.syncs
                if timed:
                    mx.eval(draft.tokens)
                    syncs += 1
                t1 = time.perf_counter()
                snap = cache.snapshot()
                x = mx.concatenate([carry, mx.array([last], dtype=mx.uint32), draft.tokens])
                c = carry.shape[0]
                position = cache.length
                logits = cache.feed(x, record=record)[c:]
                hidden = tap.take() if tap is not None else None
                if sampling.greedy:
                    n_acc, nxt = accept_greedy(logits, draft.tokens)
                elif sampling.keyed:
                    n_acc, nxt = accept_keyed(logits, draft.tokens, params)
                else:
                    n_acc, nxt = accept_sampled(logits, draft.tokens, draft.logprobs, sampling)
                table = None if sync is None else sync.propose(
                    mx.stack([n_acc.astype(mx.int32), nxt.astype(mx.int32)]), x, position)
                mx.eval(n_acc, nxt, draft.tokens, *([] if table is None else [table]))
                syncs += 1
                t2 = time.perf_counter()
                if table is None:
                    n, last_token = n_acc.item(), nxt.item()
                else:
                    n, last_token = sync.settle(table)
                committed = draft.tokens.tolist()[:n] + [last_token]
                n_keep, finish = _cut(committed, eos, room)
                # The target keeps carry + [last, d1 .. d(n_keep-1)]; the new last is not fed.
                kept = x[: c + n_keep]
                new_carry = carry[:0]
                if n_keep == k + 1:
                    kind = "none"
                elif not cache.recurrent:
                    kind = "trim"
                    cache.rollback(snap, c + n_keep)
                elif record:
                    kind = record
                    cache.rollback_recorded(snap, c + n_keep)
                elif rollback == "carry" and kept.shape[0] <= MAX_CARRY and not finish:
                    kind, new_carry = "carry", kept
                    cache.restore(snap)
                else:
                    kind = "reforward"
                    if cache.rollback(snap, c + n_keep):
                        cache.feed(kept)
                if hidden is not None:
                    # Rows of [last, d1 .. d(n_keep-1)]; carried rows were handed over before.
                    hidden = hidden.rows(c, c + n_keep)
                    tap.clear()  # a re-forward's states repeat rows already taken
                    drafter.accept(n_keep - 1, hidden)
                else:
                    drafter.accept(n_keep - 1)
                if timed:
                    mx.eval(cache.state_arrays())
                    syncs += 1
                t3 = time.perf_counter()
                done = True
            finally:
                if not done:
                    # Interrupted mid-block: back to the state before it.
                    drafter.cancel()
                    if snap is not None:
                        cache.restore(snap)
                    if tap is not None:
                        tap.clear()
            # Only now: an interrupted block leaves the old carry to be fed.
            carry = new_carry
            last = committed[n_keep - 1]
            tokens = committed[:n_keep]
            if finish == "stop":
                tokens = tokens[:-1]
            emitted += len(tokens)
            seconds = t3 - t0
            if sync is not None and getattr(policy, "clocked", True):
                seconds = sync.clock(seconds)  # every rank's policy decides alike
                syncs += 1
            policy.observe(k, n, len(tokens), seconds)
            times = PhaseTimes(t1 - t0, t2 - t1, t3 - t2) if timed else None
            yield Block(tuple(tokens), k, n, kind, syncs, finish, times, c + 1 + k, c)
            if finish:
                return
    finally:
        if carry.shape[0]:
            # Whatever ends the run, the cache must hold every committed token
            # but the last, as plain decoding leaves it.
            cache.feed(carry)
        if tap is not None:
            tap.clear()


@dataclass(frozen=True)
class Warmup:
    """What :func:`warm_up` ran.

    Attributes:
        target_rows: Row counts the target ran on throwaway tokens.
        drafter_rows: Row counts the drafter ran.
        free: Nothing was run: MLX's CPU backend compiles no kernels per shape.
    """

    target_rows: tuple[int, ...] = ()
    drafter_rows: tuple[int, ...] = ()
    free: bool = False


def verify_rows(max_draft: int, recurrent: bool, rollback: str = "carry") -> list[int]:
    """Every row count a verify forward can have: 1 .. k+1, plus carried tokens on recurrent targets."""
    # Without drafts every block is a full accept: nothing is ever carried.
    extra = MAX_CARRY if recurrent and rollback == "carry" and max_draft > 0 else 0
    return list(range(1, max_draft + 2 + extra))


def compiles_per_shape() -> bool:
    """Whether MLX's default device compiles kernels per shape (GPUs), unlike its CPU backend.

    Measured on the CPU (SmolLM2-135M, float32, OpenBLAS; a Qwen3.5-style
    hybrid): a row count's first forward in a process is as fast as its
    second (48 / 48 ms at 2 rows, 74 / 73 ms at 4), so a warm-up there would
    only add forwards.
    """
    return mx.default_device() != mx.cpu


def warm_up(
    cache: ModelCache,
    drafter: Optional[Drafter] = None,
    *,
    max_draft: int = 0,
    sampling: SamplingParams = GREEDY,
    rollback: str = "carry",
    tap: Optional[HiddenTap] = None,
    force: bool = False,
) -> Warmup:
    """Run every shape the coming generation can use once, leaving all state as it was.

    A shape's first run in a process compiles its kernels (on GPUs); doing it
    here keeps that out of tok/s, the adaptive policy's measurements and
    ``--compare-ar``'s ratio. Target and drafter caches are restored exactly;
    no random numbers are drawn. On MLX's CPU backend nothing is run (see
    :func:`compiles_per_shape`) unless ``force``.

    Args:
        cache: The target's prefilled caches.
        drafter: A prefilled drafter (warms its own shapes through ``warm_up``
            when it has one), or None for plain decoding.
        max_draft: Most drafts per block (0 for plain decoding).
        sampling: The token selection that follows each forward.
        rollback: Recurrent rollback strategy (carry lengthens verifies).
        tap: The target's hidden-state tap; cleared after.
        force: Run the shapes on any backend (tests).
    """
    if not (force or compiles_per_shape()):
        return Warmup(free=True)
    head = greedy if sampling.greedy else (lambda logits: log_probs(logits, sampling))
    try:
        rows = cache.warm(verify_rows(max_draft, cache.recurrent, rollback), head)
    finally:
        if tap is not None:
            tap.clear()
    drafted: tuple[int, ...] = ()
    hook = getattr(drafter, "warm_up", None)
    if hook is not None and max_draft > 0:
        drafted = tuple(hook(max_draft, sampling) or ())
    return Warmup(rows, drafted)


def plain_generate_step(
    last: int,
    cache: ModelCache,
    *,
    max_tokens: int,
    eos_ids: Sequence[int] = (),
    sampling: SamplingParams = GREEDY,
    sync: Optional[Ranks] = None,
) -> Iterator[Block]:
    """Plain decoding, one token per :class:`Block`: the exactness oracle and the baseline.

    The next step is queued before the current token is yielded (as mlx-lm's
    ``generate_step`` does) so the host overlaps the device; the queued step
    is undone when generation ends early.

    Args:
        last: The last prompt token (not yet fed).
        cache: The target's prefilled caches.
        max_tokens: Stop after this many emitted tokens.
        eos_ids: Token ids that end generation (not emitted).
        sampling: Greedy (default) or sampling options.
        sync: The ranks of a sharded target: each token is rank 0's, agreed
            in a small collective inside the queued step (no extra sync).
    """
    eos = frozenset(eos_ids)

    def step(token: mx.array, position: int) -> tuple[mx.array, Optional[mx.array]]:
        fed_at = cache.length
        y = choose(cache.feed(token)[-1:], sampling.at(position))
        if sync is None:
            return y, None
        table = sync.propose(y, token, fed_at)
        # The token every rank feeds next is rank 0's, still lazy.
        return table[0, :1].astype(mx.uint32), table

    def read(y: mx.array, table: Optional[mx.array]) -> int:
        return y.item() if table is None else sync.settle(table)[0]

    # The state that matches what has been emitted: every committed token but
    # the last one fed. Restored on exit, which drops a queued step.
    safe = cache.snapshot()
    try:
        y, table = step(mx.array([last], dtype=mx.uint32), 0)
        mx.async_eval(y, *([] if table is None else [table]))
        for i in range(max_tokens):
            snap = cache.snapshot()
            if i + 1 < max_tokens:
                nxt, nxt_table = step(y, i + 1)
                mx.async_eval(nxt, *([] if nxt_table is None else [nxt_table]))
            tok = read(y, table)
            safe = snap
            if tok in eos:
                yield Block((), 0, 0, "none", 1, "stop")
                return
            if i + 1 == max_tokens:
                yield Block((tok,), 0, 0, "none", 1, "length")
                return
            yield Block((tok,), 0, 0, "none", 1)
            y, table = nxt, nxt_table
    finally:
        cache.restore(safe)
