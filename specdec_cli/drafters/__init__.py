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
from .dflash_batch import DFlashBatch
from .history import LookupHistory
from .hybrid import HybridDrafter
from .lookup import LookupDrafter, NgramDrafter
from .model import ModelDrafter
from .model_batch import DraftBatch
from .mtp import MTPDrafter
from .mtp_batch import MTPBatch
from .suffix import SuffixDrafter

# The group that drafts several rows of a batch in one forward, named by the drafter's class (the
# engine reads it there; the group modules import the drafters, so it is set here).
ModelDrafter.batch_group = DraftBatch
MTPDrafter.batch_group = MTPBatch
DFlashDrafter.batch_group = DFlashBatch

__all__ = ["DFlashDrafter", "Draft", "Drafter", "HybridDrafter", "LookupDrafter", "LookupHistory", "ModelDrafter", "NgramDrafter",
           "SuffixDrafter", "no_draft"]
