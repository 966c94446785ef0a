"""The draft -> verify -> accept loop over rows (:class:`Engine`), and one sequence as a generator.

:func:`speculative_generate_step` yields one :class:`~specdec_cli.core.blocks.Block`
per target forward, as plain decoding (:mod:`specdec_cli.loop.plain`) does. Neither
prints or times display; the caller owns the caches (prefilled with all but
the last prompt token) and passes the last prompt token in.

Invariant after the generator ends for any reason, and whenever a row joins
or leaves the engine: each cache holds the prompt and every committed token
except the last one, exactly as plain decoding would leave it. Between blocks
a single row's cache may lag (tokens carried) or lead (its last token fed by a
forward queued ahead); ``close`` and ``remove`` feed the one and undo the other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import mlx.core as mx

from ..core.adaptive import DraftPolicy, FixedLength
from ..cache.batch_cache import BatchCache
from ..core.blocks import Block, PhaseTimes, cut_committed
from ..cache.caches import ModelCache
from ..drafters import Draft, Drafter, no_draft
from ..errors import UnsupportedModelError
from ..core.processors import logprob_arrays, logprob_entries
from ..core.numerics import Numerics
from ..core.shapes import bucket
from ..core.sampling import GREEDY, SamplingParams, accept_greedy, accept_keyed, accept_sampled, greedy, kept
from ..model.taps import Hidden, HiddenTap

if TYPE_CHECKING:
    from ..model.distributed import Ranks


ROLLBACKS = ("reforward", "carry", "capture", "tape")
# Carried tokens beyond this are re-fed at once: the next verify would grow
# with every consecutive partial accept.
MAX_CARRY = 8
# Drafters whose class names a batch group (``batch_group``) draft several rows in one forward
# while their rows share a batch; False makes every row draft alone (benchmarks compare the two).
GROUP_DRAFTS = True
# How far the engine restores the target below the start offset of its latest
# forward: plain decoding's queued step (the speculative loop itself only cuts
# back to the snapshot taken right before its verify forward).
TARGET_REACH = 1
# A single row's block that drafted nothing, before a block that will draft nothing either, queues the next forward
# (its token fed) before reading that token back, as plain decoding does. None: as the run's numerics say
# (Numerics.pipeline: on GPUs); True or False: always or never (benchmarks compare the two in one process).
PIPELINE: Optional[bool] = None
# A drafter's or policy's word that the next block drafts nothing is asked before a block queues ahead (the queued
# forward is then the one the next block would run unpipelined); True queues ahead of any block that drafted nothing,
# the next block's drafts then verified in a forward of their own (benchmarks compare the two).
PIPELINE_ALWAYS = False
# MLX's buffer cache is emptied once this many tokens were committed (in a batch: each block's most in one row,
# summed), as mlx-lm's generate_step does every 256: a KV cache grows by reallocating, and each smaller buffer it
# leaves is never asked for again, so without it the cache held every earlier size of every layer's keys and values.
CLEAR_EVERY = 256
# A pipelined block sends its own pick to the device before queuing the next forward (scripts/block_costs.py turns
# it off to measure what it saves).
PICK_FIRST = True


@dataclass(eq=False)
class Row:
    """One sequence the engine decodes: its own drafter, draft policy, sampling, stops and budget.

    Nothing one row sets reaches another: a batch is rows, each with its own state.

    Attributes:
        last: The last committed token (not yet fed to the target).
        drafter: A prefilled drafter in step with the row's caches, or None (plain decoding).
        policy: Chooses each block's draft length.
        sampling: Greedy, or sampling options (with a seed, draws keyed by position).
        eos: Token ids that end the row (not emitted).
        max_tokens: Most tokens to emit.
        emitted: Tokens emitted so far.
        carry: Committed tokens the target has not been fed yet (solo rows under ``carry``).
        finish: Why the row ended (``stop`` or ``length``), once it has.
        tag: Whatever the caller uses to know the row (a request).
        rollback: Its recurrent rollback while it decodes alone (None: the engine's).
        drafted: Drafts verified so far.
        accepted: Drafts accepted so far.
        blocks: Blocks (target forwards) it was in.
        processors: The row's logits processors (see :mod:`specdec_cli.core.processors`),
            the row's own state: drafts are cut to what they allow, each verify
            row's logits go through them in order, and they see every commit.
        logprobs: None: off; 0: each emitted token's log-probability; n: also
            the n most likely tokens at its position (``Block.logprobs``).
    """

    last: int
    drafter: Optional[Drafter]
    policy: DraftPolicy
    sampling: SamplingParams = GREEDY
    eos: frozenset = frozenset()
    max_tokens: int = 256
    emitted: int = 0
    carry: mx.array = field(default_factory=lambda: mx.array([], dtype=mx.uint32))
    finish: Optional[str] = None
    tag: Any = None
    rollback: Optional[str] = None
    drafted: int = 0
    accepted: int = 0
    blocks: int = 0
    processors: tuple = ()
    logprobs: Optional[int] = None

    @property
    def room(self) -> int:
        return self.max_tokens - self.emitted


@dataclass
class _Pending:
    """One row's part of a block between its draft and its commit."""

    row: Row
    draft: Draft
    params: SamplingParams
    x: mx.array  # carry + [last] + drafts
    c: int  # carried tokens leading x
    fed: int = 0  # rows of the forward it was in (x plus padding: a batch's widest row, a bucket)
    n_acc: Any = None
    nxt: Any = None
    hidden: Optional[Hidden] = None
    host: Optional[list] = None  # the drafts as ints, for processors that read them
    lp: Optional[tuple] = None  # lazy log-probabilities (processors.logprob_arrays)
    ahead: int = 0  # 1: ``last`` was fed by the forward queued ahead (its row's logits are that forward's)
    queued: Optional["_Ahead"] = None  # the forward this block queued ahead (its token fed), if it did

    @property
    def k(self) -> int:
        return self.draft.size


@dataclass
class _Ahead:
    """A single row's forward queued before its token was read back: that token (the row's ``last``) fed alone."""

    logits: mx.array  # [1, 1, V]: the row predicting the token after ``last``, lazy
    snap: Any  # the caches before it: restoring it undoes the forward


class Engine:
    """The draft -> verify -> accept loop over rows: one target forward per block for all of them.

    A single row (``generate``, ``--compare-ar``, ``sweep``, under ``mlx.launch``)
    runs on its own :class:`~specdec_cli.cache.caches.ModelCache` with every
    recurrent rollback strategy. Several rows share a
    :class:`~specdec_cli.cache.batch_cache.BatchCache`: their drafts are padded to the
    longest, verified in one forward, and each row accepts and rolls back at
    its own depth (recurrent layers by ``capture``; a model that cannot record
    its recurrent states decodes a batch plainly). Rows join (:meth:`admit`)
    and leave (:meth:`remove`) at any block boundary; a batch of one is a
    single row's cache again.

    Args:
        model: The target model.
        rollback: A single row's recurrent rollback: ``reforward``, ``carry``,
            ``capture`` or ``tape``.
        timed: Add a sync after each phase and report :class:`PhaseTimes`.
        tap: Records the target's hidden states for drafters that read them.
        sync: The ranks of a sharded target: every block's decisions agreed with them.
        planner: Weighs each row's expected tokens against what its drafts
            add to a batch's forward (see :mod:`specdec_cli.loop.batch_policy`).
        numerics: The run's numerics (:mod:`specdec_cli.core.numerics`): under ``bucketed`` shapes
            verify widths are rounded up to a power of two; the padding rows' outputs are ignored
            and their cache entries dropped like a rejected draft's (on recurrent layers only where
            the forward records: capture, tape); with ``pipeline``, a single row's blocks that draft nothing
            before blocks that will not either queue the next forward before their token is read (see ``PIPELINE``).
    """

    def __init__(self, model: Any, *, rollback: str = "carry", timed: bool = False,
                 tap: Optional[HiddenTap] = None, sync: Optional[Ranks] = None, planner: Any = None,
                 numerics: Numerics = Numerics()):
        if rollback not in ROLLBACKS:
            raise ValueError(f"rollback must be one of {ROLLBACKS}")
        if numerics.shapes not in ("exact", "bucketed"):
            raise ValueError("shapes must be exact or bucketed (resolve auto first)")
        self.numerics = numerics
        self.model = model
        self.rollback = rollback
        self.timed = timed
        self.tap = tap
        self.sync = sync
        self.planner = planner
        self.rows: list[Row] = []
        self._solo: Optional[ModelCache] = None
        self._batch: Optional[BatchCache] = None
        # Drafters drafting for several rows at once, one group per draft model or head (while rows share a batch).
        self._drafting: dict[int, Any] = {}
        # Whether each draft model or head can draft rows together (probed once).
        self._draft_ok: dict[int, bool] = {}
        # A single row's next forward, queued by a block that drafted nothing (see PIPELINE).
        self._ahead: Optional[_Ahead] = None
        self._since_clear = 0  # tokens committed since MLX's buffer cache was last emptied (CLEAR_EVERY)

    # -- rows in and out -------------------------------------------------------------------------

    def admit(self, row: Row, cache: ModelCache) -> Row:
        """Add a row whose target caches (``cache``) hold its prompt and committed tokens but the last.

        Raises:
            UnsupportedModelError: Verify forwards cannot compute as one-token decoding does.
            ValueError: Capture/tape on a model that cannot record.
        """
        if row.rollback is not None and row.rollback not in ROLLBACKS:
            raise ValueError(f"rollback must be one of {ROLLBACKS}")
        k_max = getattr(row.policy, "k_max", getattr(row.policy, "k", 0))
        strategy = row.rollback or self.rollback
        # Before the row's first token: every verify row count it can use computes as one-token decoding.
        cache.check_verify(max(verify_rows(k_max, cache.recurrent, strategy, self.numerics)))
        if self._record_for(row, cache) and not cache.can_record:
            raise ValueError(f"--rollback {strategy} cannot run on this model ({cache.record_problem})")
        drafter = _inner(row.drafter)
        if hasattr(drafter, "fill"):
            # A verify padded to its bucket has room for more drafts: a drafter that has them free fills it.
            padded = self._pads(cache, self._record_for(row, cache))
            drafter.fill = (lambda n: bucket(n + 1) - 1) if padded else None
        cache.ensure_reach(TARGET_REACH)
        if not self.rows:
            self._solo = cache
        else:
            if self._solo is not None:
                self._drop_ahead(self._solo)
                self._flush(self.rows[0], self._solo)
                self._batch, self._solo = BatchCache(self.model, self._solo), None
                self._draft_together(self.rows[0])
            self._flush(row, cache)
            self._batch.add(cache)
            self._draft_together(row)
        self.rows.append(row)
        return row

    def _draft_together(self, row: Row) -> None:
        """Put the row's drafter in its group, where one can draft it; otherwise it drafts alone, as before."""
        drafter = _inner(row.drafter)
        kind = getattr(drafter, "batch_group", None)
        if not GROUP_DRAFTS or kind is None or not kind.fits(drafter):
            return
        key = kind.key(drafter)
        if id(key) not in self._draft_ok:
            self._draft_ok[id(key)] = kind.problem(drafter) is None
        if not self._draft_ok[id(key)]:
            return
        group = self._drafting.setdefault(id(key), kind(key))
        try:
            group.join(drafter)  # raises before it changes anything
        except (UnsupportedModelError, ValueError):
            self._draft_ok[id(key)] = False
            if not group.members:
                del self._drafting[id(key)]

    def _draft_alone(self, row: Row) -> None:
        drafter = _inner(row.drafter)
        group = _group(drafter)
        if group is not None:
            group.leave(drafter)
            if not group.members:
                del self._drafting[id(group.model)]

    def remove(self, row: Row) -> ModelCache:
        """Take a row out; returns its target caches as a single row's (the engine's invariant holds)."""
        b = self.rows.index(row)
        if self._solo is not None:
            cache, self._solo = self._solo, None
            self._drop_ahead(cache)
            self._flush(row, cache)
        else:
            cache = self._batch.row(b)
            self._batch.keep_rows([i for i in range(len(self.rows)) if i != b])
            self._draft_alone(row)
            if len(self.rows) == 2:
                self._solo, self._batch = self._batch.row(0), None
                self._draft_alone(self.rows[1 - b])
        self.rows.pop(b)
        return cache

    def prepare(self) -> None:
        """Whatever a batch needs measured before its first block (the planner's forward costs).

        :meth:`step` does it itself; a caller that times blocks calls it first, so the measurement
        (seconds) is in no block's time.
        """
        if self.planner is not None and len(self.rows) > 1:
            self.planner.prepare()

    def close(self) -> None:
        """Leave every row's caches as plain decoding would (carried tokens fed)."""
        if self._solo is not None and self.rows:
            self._drop_ahead(self._solo)
            self._flush(self.rows[0], self._solo)
        if self.tap is not None:
            self.tap.clear()

    def _drop_ahead(self, cache) -> None:
        """Undo the forward queued ahead, if any: the row's last token is not fed again."""
        if self._ahead is not None:
            cache.restore(self._ahead.snap)
            self._ahead = None

    def _pipelines(self, p: _Pending, width: int) -> bool:
        """Whether this block may queue the row's next forward before reading its token (see PIPELINE).

        A single row whose block drafted nothing and fed no padding (so there is nothing to cut back), with room
        for a token after this one; not under a sharded target (its steps agree on tokens in their own
        collective), a tap (its rows go to a drafter), phase timing, or a processor that reads tokens on the host.
        The block then queues ahead only if its next block will draft nothing either (:func:`_quiet`).
        """
        r = p.row
        on = self.numerics.pipeline if PIPELINE is None else PIPELINE
        return (on and p.k == 0 and r.room > 1 and width == p.x.shape[0] - p.ahead and len(self.rows) == 1
                and self.sync is None and self.tap is None and not self.timed
                and all(getattr(proc, "lazy", False) for proc in r.processors))

    @staticmethod
    def _flush(row: Row, cache: ModelCache) -> None:
        if row.carry.shape[0]:
            cache.feed(row.carry)
            row.carry = row.carry[:0]

    def _pads(self, cache, record: Optional[str]) -> bool:
        """Whether verifies run padded to their bucket: padding rows run through recurrent layers too,
        so only a forward that records (capture, tape) cuts them back exactly."""
        return self.numerics.bucketed and (not cache.recurrent or record is not None)

    def _record_for(self, row: Row, cache) -> Optional[str]:
        """What a single row's verify records for its rollback (None: nothing)."""
        strategy = row.rollback or self.rollback
        return strategy if strategy in ("capture", "tape") and cache.recurrent else None

    def _record(self, cache, rows: list[Row]) -> Optional[str]:
        """What a verify of ``rows`` records: a batch captures (when the model can), a single row as its
        rollback says."""
        if len(rows) > 1:
            return "capture" if cache.recurrent and cache.can_record else None
        return self._record_for(rows[0], cache)

    # -- one block for every row -------------------------------------------------------------------

    def step(self) -> list[tuple[Row, Block]]:
        """One target forward for all rows; returns each row's :class:`Block`.

        A row that ended (EOS or its max tokens: ``row.finish``) must be
        :meth:`remove`-d before the next step.
        """
        live = self.rows
        if not live:
            return []
        if any(r.finish is not None or r.room <= 0 for r in live):
            raise ValueError("remove the rows that ended before the next step")
        batch = len(live) > 1
        if batch:
            self.prepare()  # never inside a timed block
        # One protocol for one row and many (cache.caches.RowCache): a ModelCache, or a BatchCache of the rows.
        cache = self._batch if self._batch is not None else self._solo
        record = self._record(cache, live)
        # Rows sharing a batch roll recurrent layers back by what the forward recorded; without it they decode
        # plainly (a single row may carry or feed again instead).
        speculate = not (batch and cache.recurrent and record is None)
        pending: list[_Pending] = []
        snap = None
        done = False
        extra_syncs = 0
        # The forward an earlier block queued ahead: this block's first row (consumed, or put back if interrupted).
        ahead, self._ahead = self._ahead, None
        try:
            t0 = time.perf_counter()
            asks: dict[int, list] = {}
            for r in live:
                # With a seed, draws are keyed by the generated position: row i of this block is token emitted + i.
                params = r.sampling.at(r.emitted)
                k = min(r.policy.next_k(), r.room - 1) if speculate and r.drafter is not None else 0
                group = _group(_inner(r.drafter))
                if group is not None:
                    asks.setdefault(id(group), [group]).append((_inner(r.drafter), r.last, k, params))
                    draft = None  # drafted below, with the other rows of its draft model or head
                else:
                    draft = r.drafter.propose(r.last, k, params) if r.drafter is not None else no_draft()
                pending.append(_Pending(r, draft, params, mx.array([], dtype=mx.uint32), r.carry.shape[0],
                                        ahead=int(ahead is not None)))
            for group, *group_asks in asks.values():
                drafts = iter(group.propose(group_asks))
                for p in pending:
                    if p.draft is None and _group(_inner(p.row.drafter)) is group:
                        p.draft = next(drafts)
            for p in pending:
                if p.row.processors:
                    extra_syncs += _allowed(p)
            if batch and self.planner is not None:
                self.planner.trim(pending)
            syncs = sum(p.draft.syncs for p in pending) + extra_syncs
            if self.timed:
                mx.eval([p.draft.tokens for p in pending])
                syncs += 1
            t1 = time.perf_counter()
            snap = cache.snapshot()
            if self.tap is not None:
                self.tap.clear()  # only the verify's own rows (measuring, warming or prefilling forwards record too)
            for p in pending:
                p.x = mx.concatenate([p.row.carry, mx.array([p.row.last], dtype=mx.uint32), p.draft.tokens])
            # Rows to feed: a row queued ahead (a single row's) was fed already, and nothing when it drafted nothing.
            widest = max(p.x.shape[0] - p.ahead for p in pending)
            width = self.numerics.fed(widest) if widest and speculate and self._pads(cache, record) else widest
            for p in pending:
                p.fed = width
            logits = None
            if width:
                logits = cache.feed_rows(mx.stack([_padded(p.x[p.ahead:], width) for p in pending]), record=record)
            if ahead is not None:
                logits = ahead.logits if logits is None else mx.concatenate([ahead.logits, logits], axis=1)
            hidden = self.tap.take_rows(len(pending)) if self.tap is not None else None
            # Greedy picks of every row in one pass over the vocabulary (a row's own picks are the same).
            picks = greedy(logits) if any(_plain_greedy(p) for p in pending) else None
            for b, p in enumerate(pending):
                p.hidden = None if hidden is None else hidden[b]
                if _plain_greedy(p):
                    p.n_acc, p.nxt = kept(picks[b, p.c : p.c + 1 + p.k], p.draft.tokens)
                else:
                    self._accept(p, _processed(p, logits[b, p.c : p.c + 1 + p.k]))
            if self._pipelines(pending[0], width):
                p = pending[0]
                if PICK_FIRST:
                    # This block's pick goes to the device on its own first, as plain decoding's is queued with its
                    # step (scheduled only as the next forward's input, reading it could wait on that whole
                    # forward); and before the drafter is asked, so the device is not idle while it answers.
                    mx.async_eval(p.n_acc, p.nxt)
                if _quiet(p.row):
                    # Queued before the read below, as plain decoding queues its next step: the device computes the
                    # token after this block's while the host reads this one and asks the drafter for the next one.
                    p.queued = _Ahead(None, cache.snapshot())
                    p.queued.logits = cache.feed_rows(p.nxt.reshape(1, 1).astype(mx.uint32))
                    mx.async_eval(p.queued.logits)
            # A sharded target: every row's decision and what it fed, from every rank, in the block's one sync.
            table = None if self.sync is None else self.sync.propose_rows(
                [(mx.stack([p.n_acc.astype(mx.int32), p.nxt.astype(mx.int32)]), p.x, p.row.emitted)
                 for p in pending])
            mx.eval([(p.n_acc, p.nxt, p.draft.tokens) for p in pending], [] if table is None else [table],
                    [[a for a in p.lp if a is not None] for p in pending if p.lp is not None])
            syncs += 1
            t2 = time.perf_counter()
            out = self._commit(pending, table, cache, snap, record)
            if self.timed:
                mx.eval(cache.state_arrays())
                syncs += 1
            t3 = time.perf_counter()
            done = True
        finally:
            if not done:
                # Interrupted mid-block: every row back to its state before it (a forward queued ahead of it too).
                self._ahead = ahead
                for p in pending:
                    # A row whose group had not drafted yet has nothing to undo (its last snapshot is stale).
                    if p.row.drafter is not None and p.draft is not None:
                        p.row.drafter.cancel()
                if snap is not None:
                    cache.restore(snap)
                if self.tap is not None:
                    self.tap.clear()
        seconds = t3 - t0
        if self.sync is not None and (batch or getattr(live[0].policy, "clocked", True)):
            seconds = self.sync.clock(seconds)  # every rank's policies and planner decide alike
            syncs += 1
        times = PhaseTimes(t1 - t0, t2 - t1, t3 - t2) if self.timed else None
        blocks = []
        for p, (committed, n_keep, carry, n, kind, finish) in zip(pending, out):
            # Only now: an interrupted block leaves each row as it was.
            r = p.row
            n = min(n, n_keep)  # drafts the target agreed with past an EOS or the token limit were not kept
            r.carry, r.last, r.finish = carry, committed[n_keep - 1], finish
            tokens = committed[:n_keep - 1] if finish == "stop" else committed[:n_keep]
            r.emitted += len(tokens)
            r.drafted += p.k
            r.accepted += n
            r.blocks += 1
            for proc in r.processors:
                proc.commit(committed[:n_keep])
            r.policy.observe(p.k, n, len(tokens), seconds)
            lps = logprob_entries(p.lp, len(tokens)) if p.lp is not None else None
            blocks.append((p.row, Block(tuple(tokens), p.k, n, kind, syncs, finish, times, p.fed, p.c, lps,
                                        bool(p.ahead))))
            if p.queued is not None:
                self._ahead = p.queued  # a row that ended leaves by remove() or close(): they undo it
        if batch and self.planner is not None:
            self.planner.observe([(p.row, b.drafted, b.accepted) for p, (_, b) in zip(pending, blocks)],
                                 pending[0].fed, seconds)
        self._since_clear += max(len(b.tokens) for _, b in blocks)
        if self._since_clear >= CLEAR_EVERY:
            self._since_clear = 0
            mx.clear_cache()  # after the block's clock: the next block's allocations are its own
        return blocks

    @staticmethod
    def _accept(p: _Pending, logits: mx.array) -> None:
        """The row's accepted count and next token, lazily (one host sync for all rows)."""
        if p.params.greedy:
            p.n_acc, p.nxt = accept_greedy(logits, p.draft.tokens)
        elif p.params.keyed:
            p.n_acc, p.nxt = accept_keyed(logits, p.draft.tokens, p.params)
        else:
            p.n_acc, p.nxt = accept_sampled(logits, p.draft.tokens, p.draft.logprobs, p.params)
        if p.row.logprobs is not None:
            # Row i emits draft i while i < n, then the target's own token: the same rows plain decoding scores.
            drafts = mx.concatenate([p.draft.tokens, mx.zeros((1,), dtype=mx.uint32)])
            emitted = mx.where(mx.arange(p.k + 1) < p.n_acc, drafts, p.nxt.astype(mx.uint32))
            p.lp = logprob_arrays(logits, emitted, p.row.logprobs)

    def _commit(self, pending: list[_Pending], table: Optional[mx.array], cache, snap,
                record: Optional[str]) -> list[tuple]:
        """Each row's committed tokens, kept count, new carry, accepted count, rollback kind and finish.

        The caches and drafters follow; the rows themselves are updated by the caller once the block is done.
        """
        decided, keep = [], []
        settled = None if table is None else self.sync.settle_rows(table, len(pending))
        for b, p in enumerate(pending):
            r = p.row
            if settled is None:
                n, last_token = p.n_acc.item(), p.nxt.item()
            else:
                n, last_token = settled[b]
            committed = p.draft.tokens.tolist()[:n] + [last_token]
            n_keep, finish = cut_committed(committed, r.eos, r.room)
            # The target keeps carry + [last, d1 .. d(n_keep-1)] (last fed already when queued ahead); the new
            # last is not fed.
            keep.append(p.c + n_keep - p.ahead)
            decided.append((committed, n_keep, n, finish))
        if pending[0].queued is not None:
            # It drafted nothing and fed no padding: every row it fed stays, and the forward queued after them too.
            kinds = [("none", pending[0].row.carry[:0])]
        else:
            kinds = self._settle(cache, snap, pending, keep, record, decided[0][3])
        out = []
        for p, (committed, n_keep, n, finish), (kind, carry) in zip(pending, decided, kinds):
            self._hand_over(p, n_keep)
            out.append((committed, n_keep, carry, n, kind, finish))
        return out

    def _settle(self, cache, snap, pending: list[_Pending], keep: list[int], record: Optional[str],
                finish: Optional[str]) -> list[tuple[str, mx.array]]:
        """Each row keeps its first ``keep[b]`` tokens fed since ``snap``; returns its rollback kind and carry.

        One protocol for one row and many: attention trims and a recorded forward gives each row its own
        recurrent state (``cache.settle``). Only a single row whose recurrent layers recorded nothing has
        the two other strategies: carry its kept tokens into the next verify, or feed them again.
        """
        width = pending[0].fed
        none = pending[0].row.carry[:0]
        if not cache.recurrent or record is not None or all(k == width for k in keep):
            cache.settle(snap, keep)
            return [("none" if k == width else "trim" if not cache.recurrent else record, none) for k in keep]
        p, (n,) = pending[0], keep
        kept = p.x[p.ahead:][:n]
        if (p.row.rollback or self.rollback) == "carry" and n <= MAX_CARRY and not finish:
            cache.restore(snap)
            return [("carry", kept)]
        if cache.rollback(snap, n):
            cache.feed(kept)
        return [("reforward", none)]

    def _hand_over(self, p: _Pending, n_keep: int) -> None:
        drafter = p.row.drafter
        if drafter is None:
            return
        if p.hidden is not None:
            # Rows of [last, d1 .. d(n_keep-1)]; carried rows were handed over before.
            hidden = p.hidden.rows(p.c, p.c + n_keep)
            if self.tap is not None:
                self.tap.clear()  # a re-forward's states repeat rows already taken
            drafter.accept(n_keep - 1, hidden)
        else:
            drafter.accept(n_keep - 1)


def _padded(x: mx.array, width: int) -> mx.array:
    """``x`` with throwaway tokens after it up to ``width`` rows (a bucket, a batch's widest row)."""
    return x if x.shape[0] == width else mx.pad(x, (0, width - x.shape[0]))


def _quiet(row: Row) -> bool:
    """Whether the row's next block surely drafts nothing: its policy stays off, or its drafter finds nothing after
    any token (a drafter that cannot tell may draft). Only then is its next forward queued ahead: the one-token
    forward its next block would run anyway, never a forward of its own before a verify (``PIPELINE_ALWAYS``)."""
    if row.drafter is None or PIPELINE_ALWAYS:
        return True
    drafts_next = getattr(row.policy, "drafts_next", None)
    if drafts_next is not None and not drafts_next():
        return True
    may_draft = getattr(_inner(row.drafter), "may_draft", None)
    return may_draft is not None and not may_draft(row.room - 2)


def _inner(drafter: Any) -> Any:
    """The drafter behind a pass-through wrapper (one that names it ``wrapped``)."""
    return getattr(drafter, "wrapped", drafter)


def _group(drafter: Any) -> Any:
    """The group drafting for ``drafter``'s row, or None when it drafts alone."""
    kind, group = getattr(drafter, "batch_group", None), getattr(drafter, "batch", None)
    return group if kind is not None and isinstance(group, kind) else None


def _allowed(p: _Pending) -> int:
    """Cut a row's draft to what its processors could ever accept; returns the host syncs that took.

    A processor that is not ``lazy`` reads the drafts as ints (a draft model's
    are read back: one sync). A cut draft of a sampling drafter keeps its log q
    at the cut position: a draft there would have been refused, so rejection
    sampling draws from the residual of that row, as it would have without the cut.
    """
    draft, procs = p.draft, p.row.processors
    if not draft.size:
        return 0
    syncs = 0
    if all(getattr(proc, "lazy", False) for proc in procs):
        arg = draft.tokens
    else:
        if draft.host is None:
            syncs = 1
        p.host = arg = list(draft.host) if draft.host is not None else draft.tokens.tolist()
    m = min(proc.allowed(arg) for proc in procs)
    if m < draft.size:
        lp = None if draft.logprobs is None else draft.logprobs[: m + 1]
        p.draft = Draft(draft.tokens[:m], lp, draft.syncs, None if draft.host is None else draft.host[:m])
        if p.host is not None:
            p.host = p.host[:m]
    return syncs


def _plain_greedy(p: _Pending) -> bool:
    """A greedy row with nothing else to compute from its logits."""
    return p.params.greedy and not p.row.processors and p.row.logprobs is None


def _processed(p: _Pending, logits: mx.array) -> mx.array:
    """The verify rows ``[last, d1 .. dk]`` through the row's processors, in order (lazy)."""
    if not p.row.processors:
        return logits
    drafts = p.host[: p.k] if p.host is not None else p.draft.tokens
    for proc in p.row.processors:
        logits = proc.apply(logits, drafts)
    return logits


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
    processors: tuple = (),
    logprobs: Optional[int] = None,
    numerics: Numerics = Numerics(),
) -> Iterator[Block]:
    """Speculative decoding of one sequence: greedy, or lossless sampling at temp > 0.

    The :class:`Engine` with one row. Sampling is rejection sampling, or with
    a seed (``sampling.seed``) draws keyed by position (see
    :mod:`specdec_cli.core.sampling`): then the text does not depend on the draft
    lengths.

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
        policy: Chooses each block's draft length (see :mod:`specdec_cli.core.adaptive`).
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
        processors: Logits processors (see :mod:`specdec_cli.core.processors`),
            fresh for this run: built with the prompt, they follow its commits.
        logprobs: None, or how many alternatives each emitted token's
            log-probability comes with (``Block.logprobs``).
        numerics: The run's numerics (see :class:`Engine`).

    Yields:
        One :class:`Block` per target forward.
    """
    if policy is None:
        if num_draft_tokens is None or num_draft_tokens < 0:
            raise ValueError("give num_draft_tokens >= 0 or a policy")
        policy = FixedLength(num_draft_tokens)
    engine = Engine(cache.model, rollback=rollback, timed=timed, tap=tap, sync=sync, numerics=numerics)
    row = engine.admit(Row(last, drafter, policy, sampling, frozenset(eos_ids), max_tokens,
                           processors=tuple(processors), logprobs=logprobs), cache)
    try:
        while row.finish is None and row.room > 0:
            ((_, block),) = engine.step()
            yield block
    finally:
        # Whatever ends the run, the cache must hold every committed token but the last, as plain decoding leaves it.
        engine.close()


def verify_rows(max_draft: int, recurrent: bool, rollback: str = "carry",
                numerics: Numerics = Numerics()) -> list[int]:
    """Every row count a verify forward can have: 1 .. k+1, plus carried tokens on recurrent targets;
    under ``bucketed`` shapes, the powers of two up to the one that holds them."""
    # Without drafts every block is a full accept: nothing is ever carried.
    extra = MAX_CARRY if recurrent and rollback == "carry" and max_draft > 0 else 0
    return numerics.widths(max_draft + 1 + extra)
