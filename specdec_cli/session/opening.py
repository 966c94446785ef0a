"""A request's way into the engine: its prompt-cache hit, its row built, its prompt prefilled a chunk at a time.

Every face opens requests here (``generate`` and ``chat`` one at a time, the
batch command and the server's scheduler several): one row builder
(:meth:`Session.plan <specdec_cli.session.generate.Session.plan>`), one
prefill, one rollback choice, so a request's tokens never depend on which
face asked.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from ..cache.rollback import choose as choose_rollback
from ..core.adaptive import FixedLength
from ..core.shapes import resolve as resolve_shapes
from ..errors import OptionError
from ..loop.engine import Row, verify_rows
from ..loop.runner import Prefilled
from ..model.taps import Hidden, HiddenTap
from .disk_cache import DiskHit
from .request import Request


class Opening:
    """One request on its way into an :class:`~specdec_cli.loop.engine.Engine` (alone or shared with others).

    :meth:`step` prefills the prompt a chunk at a time (each chunk sized to
    about ``Session.prefill_seconds``) and returns True once the drafter is
    prefilled too; then ``row`` and ``cache`` go to ``Engine.admit`` and
    ``prefilled`` says what the prefill did. Closing it before that leaves the
    caches holding the chunks fed (see :meth:`Session.close`).

    Args:
        session: The loaded :class:`~.generate.Session` (this module sits below it: no import).
        request: What to generate.
        tap: The hidden-state tap on the target, when the drafter reads hidden states.
        policy: The draft-length policy (default: a fresh one of the session's kind).

    Raises:
        UnsupportedModelError: Verify forwards cannot compute as one-token decoding does
            (checked before anything is prefilled).

    Attributes:
        row: The engine row (after the last step).
        cache: The target caches, the prompt but its last token in them.
        prefilled: The :class:`~specdec_cli.loop.runner.Prefilled` event of this request.
    """

    def __init__(self, session: Any, request: Request, tap: Optional[HiddenTap], policy: Any = None):
        setup = session.setup
        self.session, self.request, self.tap = session, request, tap
        self.ids = list(request.prompt_ids)
        if not self.ids:
            raise OptionError("the prompt is empty: give some text")
        ranks = setup.ranks
        # Under mlx.launch every rank must run the same chunk sizes and rollback: rank 0's.
        self._agree = None if ranks is None else ranks.share_one
        self.shapes = resolve_shapes(setup.options.shapes)
        start = time.perf_counter()
        self.hit = session._fetch(self.ids)
        fetch_s = time.perf_counter() - start
        self.cache = self.hit.target if self.hit else session.fresh_cache()
        self.cached = self.cache.length
        plan = session.plan(request, self.hit, policy)
        self.policy = plan.policy if plan.policy is not None else FixedLength(0)
        self.drafter = plan.drafter
        self.k_max = getattr(self.policy, "k_max", getattr(self.policy, "k", 0))
        if self.drafter is not None:
            # Refused here, before the prefill, if verify forwards cannot compute as one-token decoding does.
            self.cache.check_verify(max(verify_rows(self.k_max, self.cache.recurrent, "carry", self.shapes)))
        self.row = Row(self.ids[-1], self.drafter, plan.steer or self.policy, plan.sampling, plan.eos,
                       request.max_tokens, tag=request, processors=plan.processors, logprobs=request.logprobs)
        self.parts: list = []
        self.prefilled: Optional[Prefilled] = None
        # Seconds spent prefilling this request (not the blocks of other rows run between its chunks).
        self._seconds = fetch_s  # resuming from a prompt cache tier counts (a disk read comes before the first token)
        stops = [m - self.cached for m in session._marks(self.cache, request, len(self.ids))]
        tapped = tap if self.drafter is not None else None
        self._chunks = self.cache.prefill_chunks(
            self.rest, setup.options.prefill_step_size, tapped, self.parts, seconds=session.prefill_seconds,
            sizes=session.prefill_chunks, agree=self._agree, stops=stops)
        # Whether its prompt may be prefilled in one forward with other requests' (Flights.prefill_together):
        # nothing fed yet, no hidden states to hand a drafter, no checkpoints, no ranks, layers that trim.
        self.joinable = (tapped is None and not stops and self._agree is None and not self.cache.recurrent
                         and setup.options.kv_bits is None and len(self.rest) > 0)

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
        setup, cache = self.session.setup, self.cache
        step = min(setup.options.prefill_step_size, max(cache.chunks, default=setup.options.prefill_step_size))
        if self.drafter is not None:
            # The drafter is smaller than the target: the target's largest timed chunk bounds one of its chunks.
            if getattr(self.drafter, "taps", None) is not None:
                prefix = self.hit.hidden if self.hit else None
                self.drafter.prefill(self.ids[:-1], step, Hidden.concat([prefix or Hidden(), *self.parts]))
            else:
                self.drafter.prefill(self.ids[:-1], step)
        # The prefill's time ends here: auto's rollback measurement below is reported apart (RollbackChoice.seconds).
        seconds = self._seconds + time.perf_counter() - start
        choice = None
        if self.drafter is not None:
            choice = self._rollback()
            strategy = self.row.rollback = "carry" if choice.strategy == "trim" else choice.strategy
            if self.shapes == "bucketed" and cache.recurrent and strategy not in ("capture", "tape"):
                if setup.options.shapes == "bucketed":
                    raise OptionError(f"--shapes bucketed on this recurrent model needs --rollback capture or "
                                      f"tape (it would {strategy}: {choice.reason}); or use --shapes exact")
                self.shapes = "exact"  # auto: padding rows cannot be cut out of a recurrence that records nothing
        self.prefilled = Prefilled(len(self.ids), seconds, choice,
                                   tuple(cache.chunks), self.cached, tuple(cache.marks), self.shapes,
                                   disk=self.cached if isinstance(self.hit, DiskHit) else 0)
        return True

    def _rollback(self):
        """How the row rolls its recurrent layers back: as auto measured, once per session and block size."""
        choices, size = self.session._choices, self.k_max + 1
        if size not in choices:
            opts = self.session.setup.options
            choices[size] = choose_rollback(opts.rollback, self.cache, size, opts.rollback_memory_cap_bytes,
                                            agree=self._agree)
        return choices[size]

    def close(self) -> None:
        """Stop prefilling (the caches keep the chunks fed)."""
        self._chunks.close()


__all__ = ["Opening"]
