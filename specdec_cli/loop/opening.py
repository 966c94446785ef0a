"""A request's way into the engine: its row built, its prompt prefilled a chunk at a time, its rollback chosen.

Every road into the engine opens rows here: a session's (``generate``, ``chat``,
``--prompts-file``, the server's scheduler, each request's plan and prompt-cache
hit handed in by :meth:`Session.open <specdec_cli.session.generate.Session.open>`)
and one sequence outside a session (:func:`~.runner.run`). The verify-width check
before any prefill, the drafter's prefill after the target's, the rollback choice
and the numerics it allows are made once, here, whoever asked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from ..cache.caches import ModelCache
from ..cache.rollback import RollbackChoice
from ..cache.rollback import choose as choose_rollback
from ..core.adaptive import FixedLength
from ..core.numerics import Numerics
from ..core.request import Request
from ..core.sampling import SamplingParams
from ..errors import OptionError
from ..model.taps import Hidden, HiddenTap
from .engine import Row, verify_rows
from .events import Prefilled


@dataclass
class RowPlan:
    """What one request decodes with, built in one place for every face (:meth:`Session.plan
    <specdec_cli.session.generate.Session.plan>`; :func:`~.runner.run` builds its own from its arguments).

    Attributes:
        policy: The draft-length policy (its summary is the run's); None when plain.
        steer: ``policy``, or it with the first block capped (``Request.first_draft``).
        drafter: A fresh drafter, or None (plain decoding).
        sampling: Greedy, or sampling keyed by position: a request without a seed gets a
            random one, so no global random state is read and a row's text never depends
            on what else the engine runs.
        processors: The request's logits processors, fresh.
        eos: Token ids that end it.
    """

    policy: object
    steer: object
    drafter: object
    sampling: SamplingParams
    processors: tuple
    eos: frozenset


@dataclass(frozen=True)
class OpenSettings:
    """What every request of a run (one generation, or a server's many) is opened with, resolved once.

    Attributes:
        numerics: The run's numerics (verify shapes, attention); a row may narrow them (:meth:`Numerics.for_rollback`).
        prefill_step_size: Most prompt tokens per prefill chunk.
        prefill_seconds: Size chunks to about this long (None: ``prefill_step_size`` each).
        prefill_chunks: Exact chunk sizes, an earlier prefill's (the same caches bit for bit).
        rollback: The recurrent rollback asked for (``auto``: measured, once per block size).
        rollback_memory_cap: Most extra bytes ``capture`` may hold per verify.
        quantized_kv: The target's KV cache is quantized (its rows cannot be prefilled together).
        agree: Under ``mlx.launch``, rank 0's value for every rank (the rollback choice).
        chunk: Under ``mlx.launch``, rank 0's size for each prefill chunk (``Ranks.prefill_chunk``).
        choices: The rollback chosen per block size, measured once for the run and reused.
    """

    numerics: Numerics = field(default_factory=Numerics)
    prefill_step_size: int = 2048
    prefill_seconds: Optional[float] = None
    prefill_chunks: Optional[Sequence[int]] = None
    rollback: str = "auto"
    rollback_memory_cap: Optional[int] = None
    quantized_kv: bool = False
    agree: Optional[Callable[[int], int]] = None
    chunk: Optional[Callable[[int], int]] = None
    choices: dict = field(default_factory=dict, compare=False)


class Opening:
    """One request on its way into an :class:`~specdec_cli.loop.engine.Engine` (alone or shared with others).

    :meth:`step` prefills the prompt a chunk at a time (each chunk sized to
    about ``settings.prefill_seconds``) and returns True once the drafter is
    prefilled too; then ``row`` and ``cache`` go to ``Engine.admit`` and
    ``prefilled`` says what the prefill did. Closing it before that leaves the
    caches holding the chunks fed.

    Args:
        request: What to generate.
        plan: Its row state (policy, drafter, sampling, processors, EOS ids).
        cache: The target's caches: a prompt-cache hit's (holding a prefix of the prompt) or fresh ones.
        settings: The run's settings.
        hit: The prompt-cache hit ``cache`` came from, kept for whoever keeps the caches afterwards.
        hidden: The target's hidden states of the positions ``cache`` holds (a drafter that reads them).
        disk: Of the tokens ``cache`` holds, those read from the prompt cache's disk tier.
        marks: Prompt lengths to checkpoint the target at during the prefill (each ends a chunk).
        tap: The hidden-state tap on the target, when the drafter reads hidden states.
        fetch_s: Seconds spent finding ``hit`` (a disk read comes before the first token: it counts).
        choice: The rollback strategy, already chosen (skips ``settings``'s measurement).

    Raises:
        OptionError: An empty prompt.
        UnsupportedModelError: Verify forwards cannot compute as one-token decoding does
            (checked before anything is prefilled).

    Attributes:
        row: The engine row (after the last step).
        cache: The target caches, the prompt but its last token in them.
        numerics: The row's numerics (the run's, narrowed for its rollback once chosen).
        prefilled: The :class:`~specdec_cli.loop.events.Prefilled` event of this request.
    """

    def __init__(self, request: Request, plan: RowPlan, cache: ModelCache, settings: OpenSettings, *,
                 hit: Any = None, hidden: Optional[Hidden] = None, disk: int = 0, marks: Sequence[int] = (),
                 tap: Optional[HiddenTap] = None, fetch_s: float = 0.0, choice: Optional[RollbackChoice] = None):
        self.request, self.plan, self.settings, self.tap = request, plan, settings, tap
        self.hit, self.hidden, self.disk, self._choice = hit, hidden, disk, choice
        self.ids = list(request.prompt_ids)
        if not self.ids:
            raise OptionError("the prompt is empty: give some text")
        self.cache = cache
        self.cached = cache.length
        if not 0 <= self.cached < len(self.ids):
            raise ValueError(f"the caches hold {self.cached} tokens of a {len(self.ids)}-token prompt")
        self.numerics = settings.numerics
        self.policy = plan.policy if plan.policy is not None else FixedLength(0)
        self.drafter = plan.drafter
        self.k_max = getattr(self.policy, "k_max", getattr(self.policy, "k", 0))
        taps = getattr(self.drafter, "taps", None)
        if taps is not None and self.cached and (hidden is None or hidden.length != self.cached):
            raise ValueError("a drafter that reads hidden states needs them for the cached prompt tokens")
        if self.drafter is not None:
            # Refused here, before the prefill, if verify forwards cannot compute as one-token decoding does.
            self.cache.check_verify(max(verify_rows(self.k_max, self.cache.recurrent, "carry", self.numerics)))
        self.row = Row(self.ids[-1], self.drafter, plan.steer or self.policy, plan.sampling, plan.eos,
                       request.max_tokens, tag=request, processors=plan.processors, logprobs=request.logprobs)
        self.parts: list = []
        self.prefilled: Optional[Prefilled] = None
        # Seconds spent prefilling this request (not the blocks of other rows run between its chunks).
        self._seconds = fetch_s
        stops = [m - self.cached for m in marks]
        tapped = tap if self.drafter is not None else None
        self._chunks = self.cache.prefill_chunks(
            self.rest, settings.prefill_step_size, tapped, self.parts, seconds=settings.prefill_seconds,
            sizes=settings.prefill_chunks, agree=settings.chunk, stops=stops)
        # Whether its prompt may be prefilled in one forward with other requests' (Flights.prefill_together):
        # nothing fed yet, no hidden states to hand a drafter, no checkpoints, layers that trim. Under ranks too:
        # which requests join is decided from token counts alone, alike on every rank.
        self.joinable = (tapped is None and not stops and not self.cache.recurrent
                         and not settings.quantized_kv and len(self.rest) > 0)

    @property
    def rest(self) -> list[int]:
        """The prompt tokens its prefill feeds: all but the last, after those the caches already held."""
        return self.ids[self.cached:-1]

    @property
    def ready(self) -> bool:
        return self.prefilled is not None

    def step(self) -> bool:
        """Prefill one more chunk; True once the row can be admitted (then nothing more to do).

        Raises:
            OptionError: ``--shapes bucketed`` on a recurrent target whose rollback records nothing.
        """
        if self.prefilled is not None:
            return True
        start = time.perf_counter()
        try:
            return self._step(start)
        finally:
            self._seconds += time.perf_counter() - start

    def fed_together(self, cache: Any, seconds: float) -> None:
        """Its prompt went into ``cache`` in one forward with other requests' (``seconds``: that forward's)."""
        self._chunks.close()
        self._chunks = iter(())
        cache.chunks = [len(self.rest)]
        self.cache, self.joinable = cache, False
        self._seconds += seconds

    def _step(self, start: float) -> bool:
        self.joinable = False  # a chunk of its own is fed now
        if next(self._chunks, None) is not None:
            return False
        cache, step_size = self.cache, self.settings.prefill_step_size
        step = min(step_size, max(cache.chunks, default=step_size))
        if self.drafter is not None:
            # The drafter is smaller than the target: the target's largest timed chunk bounds one of its chunks.
            if getattr(self.drafter, "taps", None) is not None:
                self.drafter.prefill(self.ids[:-1], step, Hidden.concat([self.hidden or Hidden(), *self.parts]))
            else:
                self.drafter.prefill(self.ids[:-1], step)
        # The prefill's time ends here: auto's rollback measurement below is reported apart (RollbackChoice.seconds).
        seconds = self._seconds + time.perf_counter() - start
        choice = None
        if self.drafter is not None:
            choice = self._rollback()
            strategy = self.row.rollback = "carry" if choice.strategy == "trim" else choice.strategy
            self.numerics = self.numerics.for_rollback(cache.recurrent, strategy, choice.reason)
        self.prefilled = Prefilled(len(self.ids), seconds, choice, tuple(cache.chunks), self.cached,
                                   tuple(cache.marks), self.numerics.shapes, disk=self.disk)
        return True

    def _rollback(self) -> RollbackChoice:
        """How the row rolls its recurrent layers back: as given, or as auto measured once per run and block size."""
        if self._choice is not None:
            return self._choice
        choices, size, s = self.settings.choices, self.k_max + 1, self.settings
        if size not in choices:
            choices[size] = choose_rollback(s.rollback, self.cache, size, s.rollback_memory_cap, agree=s.agree)
        return choices[size]

    def close(self) -> None:
        """Stop prefilling (the caches keep the chunks fed)."""
        self._chunks.close()


__all__ = ["OpenSettings", "Opening", "RowPlan"]
