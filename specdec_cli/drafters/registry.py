"""How each drafter kind is built for one generation: one builder per kind of ``defaults.DRAFTERS``.

``defaults.DRAFTERS`` (the base layer, read before MLX is imported) says what a kind is: its block
sizes, what it reads, its adaptive rule. This module says how one is made from what the session
loaded (:class:`Materials`). A new drafter is its module, its record there and its builder here;
``tests/drafters/test_registry.py`` checks that the two tables name the same kinds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from ..core.adaptive import MatchLength
from ..defaults import NGRAM_MAX, NGRAM_MIN
from .base import Drafter
from .dflash import DFlashDrafter
from .hybrid import HybridDrafter
from .lookup import NgramDrafter
from .model import ModelDrafter
from .mtp import MTPDrafter
from .suffix import SuffixDrafter


@dataclass(frozen=True)
class Materials:
    """What a generation's drafter is made from (each kind reads its own part).

    Attributes:
        policy: The row's draft-length policy (a lookup drafter sizes its drafts with ``MatchLength``'s).
        eos_ids: Stop ids (lookup drafts stop at one).
        earlier: Earlier outputs lookup also drafts from (``--lookup-history``, a server's recent answers).
        p_min: ``--draft-p-min`` (0: off).
        ngram: ``(--ngram-max, --ngram-min)``.
        draft_model: A draft model or a DFlash drafter's model.
        draft_cache: A draft model's caches to resume from (a prompt cache hit).
        vocab_size: The target's vocabulary (a draft model's larger one is cut to it).
        head: An MTP head as loaded (``mtp_io.LoadedHead``: the head and the target's parts it reads).
        parts: The target's embedding and output head (DFlash reuses them).
    """

    policy: Any = None
    eos_ids: Sequence[int] = ()
    earlier: Sequence[Sequence[int]] = field(default_factory=list)
    p_min: float = 0.0
    ngram: tuple[int, int] = (NGRAM_MAX, NGRAM_MIN)
    draft_model: Any = None
    draft_cache: Any = None
    vocab_size: Optional[int] = None
    head: Any = None
    parts: Any = None


def _lookup(m: Materials) -> Drafter:
    size = m.policy.size if isinstance(m.policy, MatchLength) else None
    return SuffixDrafter(size, m.earlier, m.eos_ids)


def _head(m: Materials) -> MTPDrafter:
    return MTPDrafter(m.head.head, m.head.parts, p_min=m.p_min)


def _lookup_and_head(m: Materials) -> Drafter:
    # Lookup where the text repeats, the head elsewhere; the adaptive policy chooses per block.
    return HybridDrafter(SuffixDrafter(m.policy.size, stop_ids=m.eos_ids), _head(m), m.policy)


BUILDERS: dict[str, Callable[[Materials], Drafter]] = {
    "lookup": _lookup,
    "ngram": lambda m: NgramDrafter(*m.ngram),
    "mtp": _head,
    "lookup+mtp": _lookup_and_head,
    "dflash": lambda m: DFlashDrafter(m.draft_model, m.parts, p_min=m.p_min),
    "model": lambda m: ModelDrafter(m.draft_model, m.draft_cache, vocab_size=m.vocab_size, p_min=m.p_min),
}


def build(kind: str, materials: Materials) -> Drafter:
    """A fresh drafter of ``kind`` (a kind ``auto`` resolved to) made from ``materials``."""
    return BUILDERS[kind](materials)
