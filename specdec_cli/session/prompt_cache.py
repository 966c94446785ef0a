"""Prompt caches kept across generations: the longest usable prefix is resumed, not prefilled again.

Each entry holds the token sequence its caches cover and the target's caches
(a :class:`~.state.SavedCache`), with, when the session has them, the draft
model's caches and the target's hidden states of those tokens (for drafters
that read them). A new prompt resumes from the entry that gives the most
tokens: attention layers trim to the shared prefix; recurrent layers resume
only where a state was kept (the end of an entry, or a snapshot taken at a
boundary on the way), so a hybrid model gets exact reuse too. Entries are
dropped least recently used first, past ``max_entries`` or ``max_bytes``
(by default a share of the machine's memory: :func:`default_max_bytes`), and
MLX is asked to give their memory back.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from ..cache.caches import ModelCache
from ..cache.limits import total_memory
from ..model.taps import Hidden
from .state import SavedCache


# The default byte bound: an eighth of the machine's memory, at most 8 GiB. The weights and the rows
# being decoded need the rest; 8 GiB keeps some thirty 5.4k-token prompts of the 135M model (~250 MB
# each), more than the 10 entries a handful of conversations resume from.
DEFAULT_SHARE = 8
DEFAULT_MAX_BYTES = 8 * 2**30


def default_max_bytes() -> int:
    """The prompt cache's byte bound when none is given: ``min(8 GiB, memory / 8)``."""
    total = total_memory()
    return DEFAULT_MAX_BYTES if not total else min(DEFAULT_MAX_BYTES, total // DEFAULT_SHARE)


@dataclass
class Entry:
    """Caches after ``tokens`` (the target's length; the draft model's may be shorter).

    Attributes:
        tokens: The tokens the target's caches hold.
        target: The target's caches.
        draft: The draft model's caches (they may lag a few tokens behind).
        hidden: The target's hidden states of ``tokens``, for drafters that read them.
        marks: Lengths worth resuming at (message boundaries, the prompt's end), for the disk tier.
        loaded: Read from disk by a request that resumed its own copy: kept for the requests that open
            while it runs, so it is resumed by copy, never handed over (that request's entry replaces it).
    """

    tokens: tuple[int, ...]
    target: SavedCache
    draft: Optional[SavedCache] = None
    hidden: Optional[Hidden] = None
    marks: tuple[int, ...] = ()
    loaded: bool = False

    @property
    def nbytes(self) -> int:
        hidden = 0
        if self.hidden is not None:
            hidden = sum(a.nbytes for a in (*self.hidden.layers, self.hidden.final) if a is not None)
        return self.target.nbytes + (self.draft.nbytes if self.draft else 0) + hidden

    def dominated_by(self, other: "Entry") -> bool:
        """Whether ``other`` can resume everywhere this entry can (it extends the same tokens)."""
        n = len(self.tokens)
        if len(other.tokens) < n or other.tokens[:n] != self.tokens:
            return False
        if (self.hidden is not None and other.hidden is None) or (self.draft is not None and other.draft is None):
            return False
        return all(other.target.can_resume(p) for p in (self.target.length, *self.target.checkpoints))

    def prefix(self, length: int, copy: bool = True) -> "Entry":
        """This entry cut to its first ``length`` tokens (``target.can_resume(length)`` must allow it).

        ``copy`` as :meth:`SavedCache.prefix`: False gives views, to count what a copy would take.
        """
        draft = None
        if self.draft is not None:
            n = self.draft.best(length)
            draft = self.draft.prefix(n, copy) if n > 0 else None
        hidden = None
        if self.hidden is not None:
            hidden = self.hidden.rows(0, length)
            if copy:
                hidden = Hidden(tuple(mx.array(h) for h in hidden.layers),
                                None if hidden.final is None else mx.array(hidden.final))
                mx.eval(list(hidden.layers) + ([hidden.final] if hidden.final is not None else []))
        return Entry(self.tokens[:length], self.target.prefix(length, copy), draft, hidden,
                     tuple(m for m in self.marks if m <= length))


@dataclass
class Hit:
    """What a prompt resumes from.

    Attributes:
        cached: Prompt tokens the target's caches hold.
        target: The target's caches, resumed (a live cache of its own).
        draft: The draft model's caches, resumed, when the entry had them.
        hidden: The target's hidden states of the ``cached`` tokens, when the entry had them.
        entry: The entry it came from.
    """

    cached: int
    target: ModelCache
    draft: Optional[ModelCache]
    hidden: Optional[Hidden]
    entry: Entry


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


class PromptCache:
    """An LRU of :class:`Entry`, bounded by count and bytes.

    Args:
        max_entries: Most entries kept (0 turns the cache off).
        max_bytes: Most bytes kept over all entries (None: :func:`default_max_bytes`).
    """

    def __init__(self, max_entries: int = 10, max_bytes: Optional[int] = None):
        self.max_entries = max_entries
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        # Each entry's bytes when it came (an entry is not written while kept), and their sum: read
        # by /health on the HTTP thread while the generation thread changes the entries.
        self._sizes: dict[int, int] = {}
        self._bytes = 0
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays the entries hold (as :attr:`Entry.nbytes` counts them)."""
        return self._bytes

    def clear(self) -> None:
        self._entries.clear()
        self._sizes.clear()
        self._bytes = 0
        mx.clear_cache()

    def _drop(self, key: int) -> Entry:
        entry = self._entries.pop(key)
        self._bytes -= self._sizes.pop(key)
        return entry

    def best(self, prompt: Sequence[int], need_hidden: bool = False) -> int:
        """How many tokens of ``prompt`` :meth:`fetch` would resume (0: none), changing nothing."""
        limit = len(prompt) - 1
        return max((entry.target.best(min(shared_prefix(entry.tokens, prompt), limit))
                    for entry in self._entries.values() if not (need_hidden and entry.hidden is None)), default=0)

    def fetch(self, prompt: Sequence[int], target_model, draft_model=None, need_hidden: bool = False) -> Optional[Hit]:
        """The entry that spares the most prefill of ``prompt``, resumed; None when none helps.

        At least the prompt's last token is always left to feed (the engine
        feeds it). The entry becomes the most recently used.
        """
        limit = len(prompt) - 1
        best = None
        for key, entry in self._entries.items():
            if need_hidden and entry.hidden is None:
                continue
            shared = min(shared_prefix(entry.tokens, prompt), limit)
            n = entry.target.best(shared)
            if n > 0 and (best is None or n >= best[0]):
                best = (n, shared, key)
        if best is None:
            return None
        n, shared, key = best
        entry = self._entries[key]
        self._entries.move_to_end(key)
        # An entry the prompt wholly extends will be superseded by this request's own:
        # its caches are handed over (no copy) instead of copied on the first write.
        move = shared == len(entry.tokens) and n == entry.target.length and not entry.loaded
        if move:
            self._drop(key)
        draft = None
        if entry.draft is not None and draft_model is not None:
            m = entry.draft.best(shared)
            if m > 0:
                draft = entry.draft.take(draft_model) if move and m == entry.draft.length \
                    else entry.draft.resume(draft_model, m)
        hidden = entry.hidden.rows(0, n) if entry.hidden is not None else None
        target = entry.target.take(target_model) if move else entry.target.resume(target_model, n)
        return Hit(n, target, draft, hidden, entry)

    def insert(self, entry: Entry) -> None:
        """Add ``entry`` as the most recent; drop the entries it makes redundant, then the oldest past the bounds."""
        if self.max_entries <= 0 or entry.target.length == 0:
            return
        size = entry.nbytes
        if size > self.max_bytes:
            # A conversation that outgrew the bound keeps the longest prefix that fits: its next turn
            # resumes there instead of prefilling everything again.
            entry = self._fit(entry)
            size = entry.nbytes if entry is not None else 0
        dropped = []
        if entry is not None:
            # Only an entry that is kept makes the ones it extends redundant.
            dropped = [k for k, e in self._entries.items() if e.dominated_by(entry)]
            for key in dropped:
                self._drop(key)
            self._entries[self._next] = entry
            self._sizes[self._next] = size
            self._bytes += size
            self._next += 1
        while self._entries and (len(self._entries) > self.max_entries or self._bytes > self.max_bytes):
            self._drop(next(iter(self._entries)))
            dropped.append(None)
        if dropped or entry is None:
            # MLX keeps freed buffers for its next allocations; what the cache let go goes back to the system.
            mx.clear_cache()

    def _fit(self, entry: Entry) -> Optional[Entry]:
        """The longest prefix of ``entry`` that fits in :attr:`max_bytes`, in buffers of its own (None: none fits)."""
        # The whole entry too: its live buffers' spare room may be what put it over, and a copy has none.
        lo, hi, best = 1, entry.target.length, 0
        while lo <= hi:  # bytes grow with the length kept: the last limit whose prefix fits
            mid = (lo + hi) // 2
            n = entry.target.best(mid)  # 0: nothing resumes up to mid, which takes no bytes
            if n == 0 or entry.prefix(n, copy=False).nbytes <= self.max_bytes:
                best, lo = max(best, n), mid + 1
            else:
                hi = mid - 1
        return entry.prefix(best) if best > 0 else None
