"""Recent outputs every request's lookup drafts from: answers that recur across requests.

An agent asks again for a file it was shown; a second user asks what a first
asked. Prompt lookup only sees its own prompt and output; with a corpus it
also matches the server's recent outputs (as vLLM's suffix decoding does with
past responses). Drafts only: output is what the target decodes either way.
Building a request's drafter indexes the corpus once, about 2 us a token on
the project's 2-core x86 CPU (8,192 tokens: ~16 ms per request), so it is
bounded in tokens, the oldest outputs dropped first.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Sequence

# The corpus's default size in tokens (serve's --lookup-corpus).
DEFAULT_TOKENS = 8192
# Outputs shorter than this carry too little to copy from.
MIN_TOKENS = 8


class Corpus:
    """Bounded, thread-safe store of recent outputs (token id sequences).

    Args:
        max_tokens: Most tokens held (0: holds nothing).
    """

    def __init__(self, max_tokens: int = DEFAULT_TOKENS):
        if max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        self.max_tokens = max_tokens
        self._items: deque[tuple[int, ...]] = deque()
        self._tokens = 0
        self._lock = threading.Lock()

    def add(self, tokens: Sequence[int]) -> None:
        """Keep an output (its last ``max_tokens`` tokens); drop the oldest past the bound."""
        if len(tokens) < MIN_TOKENS or not self.max_tokens:
            return
        item = tuple(int(t) for t in tokens[-self.max_tokens:])
        with self._lock:
            self._items.append(item)
            self._tokens += len(item)
            while self._tokens > self.max_tokens:
                self._tokens -= len(self._items.popleft())

    def outputs(self) -> list[tuple[int, ...]]:
        """The outputs held, oldest first (a snapshot)."""
        with self._lock:
            return list(self._items)

    @property
    def tokens(self) -> int:
        return self._tokens
