"""Drafters: who proposes the tokens the target verifies.

One module per drafter kind, all behind the :class:`Drafter` protocol of
:mod:`.base`, and :mod:`.kinds`, the one registration of the kinds. A drafter
follows the committed sequence through three calls per block:
``propose(last, k, params)`` returns up to ``k`` tokens expected after
``last``; ``accept(n)`` says the first ``n`` of them were committed (the
target's own token follows them); ``cancel()`` undoes a ``propose`` that never
got verified.

The names below load their module on first use, so that :mod:`.kinds` (read by
the command line before any model loads) imports no MLX.
"""

import importlib

_WHERE = {
    "Draft": ".base", "Drafter": ".base", "Materials": ".base", "no_draft": ".base",
    "DFlashDrafter": ".dflash", "HybridDrafter": ".hybrid", "LookupHistory": ".history",
    "LookupDrafter": ".lookup", "NgramDrafter": ".lookup", "ModelDrafter": ".model", "MTPDrafter": ".mtp",
    "SuffixDrafter": ".suffix",
}


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    importlib.import_module(".groups", __name__)  # every drafter class knows its batch group
    return getattr(importlib.import_module(where, __name__), name)


__all__ = sorted(_WHERE)
