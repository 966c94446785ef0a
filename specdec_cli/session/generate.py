"""One engine for every face: a :class:`Session` holds the models, the drafter kind and the prompt cache.

``generate`` runs one :class:`Request` as the only row of the loop every face
drives (:class:`~.flights.Flights`) and yields its events (``Prefilled``,
``Warmed``, one ``Step`` per block, ``Finished``). Closing the generator
cancels the generation at the next block; whatever ended it, the caches are
left as the engine's invariant says and kept in the prompt cache for the next
request. :meth:`Session.plan` builds every request's row state, whichever face
asked.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace
from typing import Callable, Iterator, Optional, Sequence

from ..cache.batch_check import Rounding
from ..cache.caches import ModelCache, leaves, fixed_position, make_cache
from ..core.adaptive import FirstBlock
from ..core.processors import make_processors
from ..drafters import kinds
from ..model.taps import Hidden
from .corpus import Corpus
from .disk_cache import DiskHit
from .disk_tier import DiskTier, open_disk_tier
from ..loop.flights import Event, Flights
from ..loop.opening import Opening, OpenSettings, RowPlan
from .options import make_policy
from .prompt_cache import Entry, PromptCache
from ..core.request import Request
from .setup import Setup
from .state import SavedCache

# Each prefill chunk is sized to about this long, so a cancel, Ctrl-C or
# SIGTERM (seen between evaluations, never inside one) stops a prefill within ~2 s.
PREFILL_CHUNK_S = 0.5


class _HiddenLog:
    """A drafter that reads the target's hidden states, passed through; the rows it is handed are kept."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.parts: list[Hidden] = []

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    @property
    def wrapped(self):
        return self.drafter

    def prefill(self, tokens, step_size, hidden=None):
        self.parts.append(hidden if hidden is not None else Hidden())
        self.drafter.prefill(tokens, step_size, hidden)

    def accept(self, n, hidden=None):
        if hidden is not None:
            self.parts.append(hidden)
        self.drafter.accept(n, hidden)

    def rows(self) -> Hidden:
        return Hidden.concat(self.parts)


class Session:
    """The models, the drafter kind and the caches kept between generations.

    Args:
        setup: The loaded models and drafter kind.
        block_size: Most tokens verified per target forward (drafts + 1).
        adaptive: Size drafts by acceptance (the policy ``generate`` uses).
        prompt_cache: Keep caches across requests (None: every prompt prefilled from scratch).
        prefill_seconds: Size prefill chunks to about this long (None: ``prefill_step_size`` each).
        prefill_chunks: Exact prefill chunk sizes, an earlier prefill's (the same caches bit for bit,
            so that runs compared with each other start alike); they override ``prefill_seconds``.
        plain: Decode without a drafter (a baseline).
        corpus: Recent outputs every request's lookup also drafts from; each
            request's output joins it (None: none).
        disk: The prompt cache's disk tier (None: none): a prompt resumes from
            whichever tier holds more of it; what a request leaves is written
            there too, after its answer (:meth:`save_to_disk`).
    """

    def __init__(self, setup: Setup, block_size: int, *, adaptive: bool = True,
                 prompt_cache: Optional[PromptCache] = None, prefill_seconds: Optional[float] = PREFILL_CHUNK_S,
                 plain: bool = False, corpus: Optional[Corpus] = None, disk: Optional[DiskTier] = None,
                 prefill_chunks: Optional[Sequence[int]] = None):
        self.setup = setup
        self.block_size = block_size
        self.adaptive = adaptive
        self.prompt_cache = prompt_cache
        self.prefill_seconds = prefill_seconds
        self.prefill_chunks = prefill_chunks
        self.plain = plain
        self.corpus = corpus
        self.disk = disk
        # Entries kept since the last save_to_disk: copied to the disk once their answer is out.
        self._unsaved: list[Entry] = []
        opts = setup.options
        if setup.ranks is not None:
            # Sharded, every forward pays its collectives whatever its size: chunks sized by time would shrink
            # to the smallest and pay them once per 32 tokens. Chunks are --prefill-step-size, as mlx-lm's.
            prefill_seconds = None
        # What every request opens with (auto's rollback choice among them: measured once per block size).
        self.settings = OpenSettings(
            numerics=setup.numerics, prefill_step_size=opts.prefill_step_size, prefill_seconds=prefill_seconds,
            prefill_chunks=prefill_chunks, rollback=opts.rollback, rollback_memory_cap=opts.rollback_memory_cap_bytes,
            quantized_kv=opts.kv_bits is not None, agree=None if setup.ranks is None else setup.ranks.share_one,
            chunk=None if setup.ranks is None else setup.ranks.prefill_chunk)
        # The backend's rounding, as the batch check measured it (None until rows were checked for a batch):
        # what a batched row's verdict against its request alone holds a rounding tie to.
        self.rounding: Optional[Rounding] = None

    @property
    def model(self):
        return self.setup.target.model

    @property
    def ranks(self):
        """The ranks of a sharded target (None: one process)."""
        return self.setup.ranks

    @property
    def numerics(self):
        """The run's numerics (:class:`~specdec_cli.core.numerics.Numerics`), resolved once at load."""
        return self.setup.numerics

    def fresh_cache(self) -> ModelCache:
        """Empty target caches in the engine's layout (``--kv-bits`` applied)."""
        opts = self.setup.options
        layers = make_cache(self.model, kv_bits=opts.kv_bits, kv_group_size=opts.kv_group) \
            if opts.kv_bits else None
        return ModelCache(self.model, layers)

    def plan(self, request: Request, hit=None, policy=None) -> RowPlan:
        """The one builder of a request's row state: policy, drafter, sampling, processors, stops.

        Args:
            request: What to generate.
            hit: The prompt cache's hit for it (its draft model's caches resume), or None.
            policy: A draft-length policy to use (default: a fresh one of the session's kind).
        """
        setup = self.setup
        ids = list(request.prompt_ids)
        drafter = steer = None
        if not self.plain:
            block = min(request.block_size or self.block_size, self.block_size)
            policy = policy if policy is not None else make_policy(self.adaptive, block, setup.kind)
            drafter = setup.make_drafter(policy, hit.draft if hit else None,
                                         self.corpus.outputs() if self.corpus is not None else ())
            if self._keeps and getattr(drafter, "taps", None) is not None:
                drafter = _HiddenLog(drafter)
            steer = policy if request.first_draft is None else FirstBlock(policy, request.first_draft)
        sampling = request.sampling
        if not sampling.greedy:
            seed = request.seed
            if seed is None:
                # Under mlx.launch every rank must draw alike: rank 0 picks the seed.
                seed = random.getrandbits(63) if setup.ranks is None else setup.ranks.share_one(
                    random.randrange(1 << 31))
            sampling = replace(sampling, seed=seed)
        return RowPlan(policy, steer, drafter, sampling, make_processors(request, setup.tokenizer, ids),
                       frozenset(() if request.ignore_eos else setup.eos_ids))

    def generate(self, request: Request, *, policy=None,
                 cancelled: Optional[Callable[[], bool]] = None) -> Iterator[Event]:
        """Run ``request`` as the only row of a fresh loop (:meth:`Flights.alone <.flights.Flights.alone>`).

        Yields ``Prefilled``, ``Warmed``, one ``Step`` per block, then ``Finished``.

        Args:
            request: What to generate.
            policy: The draft-length policy (default: a fresh one of the
                session's kind); pass one to read its summary afterwards.
            cancelled: Asked between prefill chunks (a long prompt is
                cancellable too); True raises :class:`~specdec_cli.errors.Cancelled`.
        """
        flights = Flights(self, timed=request.timed)
        try:
            yield from flights.alone(request, policy=policy, cancelled=cancelled)
        finally:
            try:
                flights.close()  # the tap comes off the model
            finally:
                self.save_to_disk()

    def tap_spec(self):
        """The target hidden states this session's drafter reads (a ``TapSpec``), or None."""
        if self.plain or not kinds.kind(self.setup.kind).hidden_states:
            return None
        return self.setup.make_drafter(make_policy(self.adaptive, self.block_size, self.setup.kind)).taps

    def open(self, request: Request, tap=None, policy=None) -> Opening:
        """``request``'s way into the engine: its prompt-cache hit, its row plan, its prefill ready to run.

        Args:
            request: What to generate.
            tap: The hidden-state tap on the target, when the drafter reads hidden states.
            policy: The draft-length policy (default: a fresh one of the session's kind).
        """
        ids = list(request.prompt_ids)
        start = time.perf_counter()
        hit = self._fetch(ids) if ids else None
        fetch_s = time.perf_counter() - start
        cache = hit.target if hit else self.fresh_cache()
        return Opening(request, self.plan(request, hit, policy), cache, self.settings, hit=hit,
                       hidden=hit.hidden if hit else None, disk=hit.cached if isinstance(hit, DiskHit) else 0,
                       marks=self._marks(cache, request, len(ids)), tap=tap, fetch_s=fetch_s)

    def keep(self, opening: Opening, cache: Optional[ModelCache], emitted: Sequence[int]) -> None:
        """A row left the engine (or its prefill stopped): keep its caches in the prompt cache.

        Args:
            opening: The row's :class:`Opening`.
            cache: Its target caches as the engine returned them (None: there are none to keep).
            emitted: The tokens it generated.
        """
        if self._keeps and cache is not None:
            self._keep(list(opening.ids) + list(emitted), cache, opening.drafter, opening.hit,
                       (*opening.request.boundaries, len(opening.ids) - 1))
        if self.corpus is not None:
            self.corpus.add(emitted)

    def use_disk(self, folder: Optional[str], gb: Optional[float]) -> Optional[str]:
        """Open the disk tier ``--prompt-cache-dir`` / ``--prompt-cache-disk-gb`` ask for; returns a warning
        for the user when it stays off though it was not turned off (None otherwise)."""
        self.disk, warning = open_disk_tier(self.setup, folder, gb, self.tap_spec())
        if self.ranks is not None:
            # Each rank opens a folder of its own machine. Where one could not (a path only some machines have,
            # a full disk), the tier is off on all: ranks that looked up different tiers would part ways.
            opened = self.ranks.flags(self.disk is not None)
            if any(opened) and not all(opened):
                if self.disk is not None:
                    self.disk.close()
                    self.disk = None
                lost = ", ".join(str(rank) for rank, on in enumerate(opened) if not on)
                warning = (f"the disk prompt cache is off on every rank: rank {lost} could not open its folder "
                           f"(check --prompt-cache-dir on that machine; its reason is in its own log)")
        if self.disk is not None and self.corpus is not None:
            self.corpus.load(self.disk.corpus_path)  # recent answers outlive the process too
        if self.ranks is not None and self.corpus is not None:
            self.corpus.replace(self.ranks.share_lists(self.corpus.outputs()))  # every rank drafts from rank 0's
        return warning

    def shutdown(self) -> None:
        """Write what the disk tier still has queued, and the lookup corpus beside it (a face's last step)."""
        if self.disk is None:
            return
        self.disk.close()
        if self.corpus is not None and self.corpus.tokens:
            self.corpus.save(self.disk.corpus_path)

    def save_to_disk(self) -> None:
        """Copy what the disk lacks of the entries kept since the last call, and write it in the background.

        Called once a request's answer is out (the copy is on this thread: the caches may change next).
        """
        entries, self._unsaved = self._unsaved, []
        if self.disk is not None:
            for entry in entries:
                self.disk.keep(entry)

    @property
    def _keeps(self) -> bool:
        """Whether what a request leaves in its caches is kept (in memory, on disk or both)."""
        return self.prompt_cache is not None or self.disk is not None

    def _fetch(self, ids: list[int]):
        """The longest usable prefix of ``ids`` in either tier (None: a miss, or no prompt cache).

        The disk's files are read only when it holds more of the prompt than memory does.
        """
        setup = self.setup
        taps = not self.plain and kinds.kind(setup.kind).hidden_states
        draft = setup.draft.model if setup.draft else None
        if self.disk is not None:
            held = self.prompt_cache.best(ids, taps) if self.prompt_cache is not None else 0
            hit = self.disk.load(ids, self.model, self.fresh_cache, draft, taps, more_than=held)
            if self.ranks is not None and not self.ranks.same(hit.cached if hit is not None else 0):
                hit = None  # a prefix one rank's disk lost (its own bound, its own files): used on no rank
            if hit is not None:
                if self.prompt_cache is not None:
                    # Requests that open while this one runs (a burst sharing a prefix after a restart) copy
                    # it from memory instead of each reading the files again; this request's entry replaces it.
                    hit.entry.loaded = True
                    self.prompt_cache.insert(hit.entry)
                return hit
        if self.prompt_cache is None:
            return None
        if self.ranks is not None and not self.ranks.same(self.prompt_cache.best(ids, taps)):
            # Each rank's cache holds its own shard and evicts by its own bytes: a prefix one rank lost is
            # prefilled again on every rank, so that all feed the same tokens.
            return None
        return self.prompt_cache.fetch(ids, self.model, draft, need_hidden=taps)

    def _marks(self, cache: ModelCache, request: Request, n: int) -> tuple[int, ...]:
        """Where to checkpoint the prompt: only layers that cannot trim back need it (each mark ends a chunk)."""
        if not self._keeps or not any(fixed_position(c) for c in leaves(cache.layers)):
            return ()
        return (*request.boundaries, n - 1)

    def _keep(self, tokens: list[int], cache: ModelCache, drafter, hit, marks: tuple[int, ...] = ()) -> None:
        """Save what the caches hold now as a prompt cache entry."""
        if not 0 < cache.length <= len(tokens):
            return  # never keep caches whose tokens are not known
        saved = SavedCache.of(cache, own=True)  # the live caches end here
        for checkpoint in cache.marks:
            saved.add(checkpoint)
        if hit is not None:
            # The state it resumed from is a boundary too (a later turn may branch there).
            saved.inherit(hit.entry.target, hit.cached)
        draft = None
        held = getattr(drafter, "cache", None)
        if isinstance(held, ModelCache) and 0 < held.length <= cache.length:
            draft = SavedCache.of(held, own=True)
        hidden = None
        if isinstance(drafter, _HiddenLog):
            rows = drafter.rows()
            # Rows that do not line up with the caches (a cancelled prefill) are not kept.
            hidden = rows if rows.length == cache.length else None
        entry = Entry(tuple(tokens[: cache.length]), saved, draft, hidden, marks)
        if self.disk is not None:
            self._unsaved.append(entry)
        if self.prompt_cache is not None:
            self.prompt_cache.insert(entry)
