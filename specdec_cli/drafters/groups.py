"""Which group drafts several rows of a batch in one forward, named on each drafter's class (``batch_group``).

The engine reads ``batch_group`` off a row's drafter; a group's module imports its drafter's, so the two are
wired here, and this module is loaded with any drafter (:mod:`specdec_cli.drafters` and
:meth:`DrafterKind.build <.kinds.DrafterKind.build>` import it).
"""

from .dflash import DFlashDrafter
from .dflash_batch import DFlashBatch
from .model import ModelDrafter
from .model_batch import DraftBatch
from .mtp import MTPDrafter
from .mtp_batch import MTPBatch

ModelDrafter.batch_group = DraftBatch
MTPDrafter.batch_group = MTPBatch
DFlashDrafter.batch_group = DFlashBatch
