"""One engine for every face: a :class:`Session` holds the models, the drafter kind and the prompt cache.

``generate`` runs one :class:`Request` through :func:`~specdec_cli.runner.run`
and yields its events (``Prefilled``, ``Warmed``, one ``Step`` per block,
``Finished``). Closing the generator cancels the generation at the next
block; whatever ended it, the caches are left as the engine's invariant
says and kept in the prompt cache for the next request.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

from ..adaptive import FirstBlock
from ..caches import ModelCache, _leaves, fixed_position, make_cache
from ..errors import Cancelled
from ..hooks import Hidden
from ..processors import Constraint, make_processors
from ..rollback import RollbackChoice
from ..runner import Finished, Prefilled, Step, Warmed, run
from ..sampling import GREEDY, SamplingParams
from .options import HIDDEN_STATE_DRAFTERS, make_policy
from .prompt_cache import Entry, PromptCache
from .setup import Setup
from .state import SavedCache

# Each prefill chunk is sized to about this long, so a cancel, Ctrl-C or
# SIGTERM (seen between evaluations, never inside one) stops a prefill within ~2 s.
PREFILL_CHUNK_S = 0.5

Event = Union[Prefilled, Warmed, Step, Finished]


@dataclass(frozen=True)
class Request:
    """One generation.

    Attributes:
        prompt_ids: The prompt's token ids.
        max_tokens: Most tokens to generate (already capped at the context).
        sampling: Greedy or sampling options.
        seed: Seed of the random draws (None: as they come).
        block_size: Most tokens verified per target forward (None: the session's).
        boundaries: Prompt lengths worth a resumable snapshot (chat segment ends).
        timed: Time each block's phases (adds host syncs).
        ignore_eos: Generate past end-of-sequence tokens (to ``max_tokens``).
        first_draft: Most drafts in the first block (None: the policy's):
            a streamed reply's first token comes sooner after a short verify.
        logit_bias, repetition_penalty, repetition_context_size, presence_penalty,
            presence_context_size, frequency_penalty, frequency_context_size:
            mlx-lm's logits processors (``make_logits_processors``; None or 0: off).
        constraint: The output must be JSON (of a schema) or tool calls (a grammar).
        logprobs: None: off; n >= 0: each token's log-probability and its n best alternatives.
    """

    prompt_ids: Sequence[int]
    max_tokens: int = 256
    sampling: SamplingParams = GREEDY
    seed: Optional[int] = None
    block_size: Optional[int] = None
    boundaries: tuple[int, ...] = ()
    timed: bool = False
    ignore_eos: bool = False
    first_draft: Optional[int] = None
    logit_bias: Optional[tuple[tuple[int, float], ...]] = None
    repetition_penalty: Optional[float] = None
    repetition_context_size: int = 20
    presence_penalty: Optional[float] = None
    presence_context_size: int = 20
    frequency_penalty: Optional[float] = None
    frequency_context_size: int = 20
    constraint: Optional[Constraint] = None
    logprobs: Optional[int] = None


class _HiddenLog:
    """A drafter that reads the target's hidden states, passed through; the rows it is handed are kept."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.parts: list[Hidden] = []

    def __getattr__(self, name):
        return getattr(self.drafter, name)

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
        plain: Decode without a drafter (a baseline).
    """

    def __init__(self, setup: Setup, block_size: int, *, adaptive: bool = True,
                 prompt_cache: Optional[PromptCache] = None, prefill_seconds: Optional[float] = PREFILL_CHUNK_S,
                 plain: bool = False):
        self.setup = setup
        self.block_size = block_size
        self.adaptive = adaptive
        self.prompt_cache = prompt_cache
        self.prefill_seconds = prefill_seconds
        self.plain = plain
        # auto's measured rollback choice, per block size: measured once per session.
        self._choices: dict[int, RollbackChoice] = {}

    @property
    def model(self):
        return self.setup.target.model

    def fresh_cache(self) -> ModelCache:
        """Empty target caches in the engine's layout (``--kv-bits`` applied)."""
        opts = self.setup.options
        layers = make_cache(self.model, kv_bits=opts.kv_bits, kv_group_size=opts.kv_group) \
            if opts.kv_bits else None
        return ModelCache(self.model, layers)

    def generate(self, request: Request, *, policy=None,
                 cancelled: Optional[Callable[[], bool]] = None) -> Iterator[Event]:
        """Run ``request``; yields the runner's events.

        Args:
            request: What to generate.
            policy: The draft-length policy (default: a fresh one of the
                session's kind); pass one to read its summary afterwards.
            cancelled: Asked between prefill chunks (a long prompt is
                cancellable too); True raises :class:`~specdec_cli.errors.Cancelled`.
        """
        setup, opts = self.setup, self.setup.options
        ids = list(request.prompt_ids)
        # The request's own processors, fresh for this run (before any cache is taken): nothing it sets outlives it.
        processors = make_processors(request, setup.tokenizer, ids)
        block = min(request.block_size or self.block_size, self.block_size)
        ranks = setup.ranks
        seed = request.seed
        if ranks is not None and seed is None and not request.sampling.greedy:
            # Sampling must draw alike on every rank: rank 0 picks the seed (draws are then keyed by position).
            seed = ranks.share_one(random.randrange(1 << 31))
        drafter = None
        if not self.plain:
            policy = policy if policy is not None else make_policy(self.adaptive, block, setup.kind)
        hit = None
        if self.prompt_cache is not None:
            taps = not self.plain and setup.kind in HIDDEN_STATE_DRAFTERS
            hit = self.prompt_cache.fetch(ids, self.model, setup.draft.model if setup.draft else None,
                                          need_hidden=taps)
        cache = hit.target if hit else self.fresh_cache()
        if not self.plain:
            drafter = setup.make_drafter(policy, hit.draft if hit else None)
            if self.prompt_cache is not None and getattr(drafter, "taps", None) is not None:
                drafter = _HiddenLog(drafter)
            if request.first_draft is not None:
                policy = FirstBlock(policy, request.first_draft)
        emitted: list[int] = []
        # Whether the caches hold whole tokens: after the prefill (the engine keeps its
        # invariant from then on), or when a cancel stopped the prefill between chunks.
        consistent = False
        events = run(
            self.model, ids, drafter=drafter, policy=policy, max_tokens=request.max_tokens,
            eos_ids=() if request.ignore_eos else setup.eos_ids, sampling=request.sampling, rollback=opts.rollback,
            rollback_memory_cap=opts.rollback_memory_cap_bytes, prefill_step_size=opts.prefill_step_size,
            prefill_seconds=self.prefill_seconds, kv_bits=opts.kv_bits, kv_group_size=opts.kv_group,
            timed=request.timed, seed=seed, cache=cache, hidden_prefix=hit.hidden if hit else None,
            marks=self._marks(cache, request, len(ids)), choice=self._choices.get(block), cancelled=cancelled,
            sync=ranks, processors=processors, logprobs=request.logprobs,
        )
        try:
            for event in events:
                if isinstance(event, Prefilled):
                    consistent = True
                    if event.rollback is not None:
                        self._choices.setdefault(block, event.rollback)
                elif isinstance(event, Step):
                    emitted += event.block.tokens
                yield event
        except Cancelled:
            consistent = True
            raise
        finally:
            # The engine's own exit first: the caches then hold every committed token but the last.
            events.close()
            if self.prompt_cache is not None and consistent:
                self._keep(ids + emitted, cache, drafter, hit)

    def _marks(self, cache: ModelCache, request: Request, n: int) -> tuple[int, ...]:
        """Where to checkpoint the prompt: only layers that cannot trim back need it (each mark ends a chunk)."""
        if self.prompt_cache is None or not any(fixed_position(c) for c in _leaves(cache.layers)):
            return ()
        return (*request.boundaries, n - 1)

    def _keep(self, tokens: list[int], cache: ModelCache, drafter, hit) -> None:
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
        self.prompt_cache.insert(Entry(tuple(tokens[: cache.length]), saved, draft, hidden))

