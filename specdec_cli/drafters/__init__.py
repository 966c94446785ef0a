"""Drafters: who proposes the tokens the target verifies.

One module per drafter kind, all behind the :class:`Drafter` protocol of
:mod:`.base`. A drafter follows the committed sequence through three calls per
block: ``propose(last, k, params)`` returns up to ``k`` tokens expected after
``last``; ``accept(n)`` says the first ``n`` of them were committed (the
target's own token follows them); ``cancel()`` undoes a ``propose`` that never
got verified.
"""

from .base import Draft, Drafter, no_draft
from .dflash import DFlashDrafter
from .history import LookupHistory
from .hybrid import HybridDrafter
from .lookup import LookupDrafter, NgramDrafter
from .model import ModelDrafter
from .suffix import SuffixDrafter

__all__ = ["DFlashDrafter", "Draft", "Drafter", "HybridDrafter", "LookupDrafter", "LookupHistory", "ModelDrafter", "NgramDrafter",
           "SuffixDrafter", "no_draft"]
