"""What a drafter group whose members' caches are attention layers shares: their rows, joined and given back.

An MTP head's and a DFlash drafter's caches are one ``KVCache`` per attention
layer. In a batch they become rows of a
:class:`~specdec_cli.cache.batch_cache.RowsKVCache` per layer (each row at its
own length), so moving one member's row back is setting its length (O(1)).
:class:`~.mtp_batch.MTPBatch` and :class:`~.dflash_batch.DFlashBatch` draft
on these rows, each in its own way.
"""

from __future__ import annotations

from typing import Any, Optional

from ..cache.batch_cache import RowsKVCache


class RowsGroup:
    """Members (drafters with a ``cache`` list of layer caches and a ``batch`` slot) and their cache rows.

    Args:
        model: The model its members share (the engine keys the group by it).
    """

    def __init__(self, model: Any):
        self.model = model
        self.members: list = []
        self.cache: Optional[list[RowsKVCache]] = None

    @staticmethod
    def problem(drafter: Any) -> Optional[str]:
        """None: the drafter is this project's own module, written for per-row positions and masks."""
        return None

    def join(self, drafter: Any) -> None:
        """Move ``drafter``'s caches in as the last row (its state is unchanged)."""
        if self.cache is None:
            self.cache = [RowsKVCache() for _ in drafter.cache]
        for rows, own in zip(self.cache, drafter.cache):
            rows.add(own)
        drafter.cache, drafter.batch = None, self
        self.members.append(drafter)

    def leave(self, drafter: Any) -> None:
        """Give ``drafter`` its row back as caches of its own (between blocks)."""
        b = self.members.index(drafter)
        drafter.cache, drafter.batch = [rows.row(b) for rows in self.cache], None
        self.members.pop(b)
        if self.members:
            for rows in self.cache:
                rows.keep_rows([i for i in range(len(self.members) + 1) if i != b])
        else:
            self.cache = None

    def offset(self, drafter: Any) -> int:
        """Positions in ``drafter``'s row."""
        return self.cache[0].lengths[self.members.index(drafter)]

    def trim(self, drafter: Any, offset: int) -> None:
        """``drafter``'s row back to ``offset`` positions."""
        b = self.members.index(drafter)
        for rows in self.cache:
            lengths = list(rows.lengths)
            lengths[b] = offset
            rows.set_lengths(lengths)
