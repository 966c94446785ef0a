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

import json
import logging
import os
import secrets
import threading
from collections import deque
from pathlib import Path
from typing import Sequence

from .private import NotPrivate, check_private_folder, create_private, make_private_folder

log = logging.getLogger(__name__)

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

    def replace(self, outputs: Sequence[Sequence[int]]) -> None:
        """Hold ``outputs`` (oldest first, within the bound) instead of what it held."""
        with self._lock:
            self._items.clear()
            self._tokens = 0
        for output in outputs:
            self.add(output)

    def outputs(self) -> list[tuple[int, ...]]:
        """The outputs held, oldest first (a snapshot)."""
        with self._lock:
            return list(self._items)

    @property
    def tokens(self) -> int:
        return self._tokens

    def save(self, path: Path) -> None:
        """Write the outputs to ``path`` (its folder made, a temporary file, then a rename); a failure is one warning.

        The folder and the file are private (0700 / 0600): the ids decode to the answers' text.
        """
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            make_private_folder(path.parent)
            with create_private(tmp) as out:
                out.write(json.dumps({"corpus": 1, "outputs": [list(o) for o in self.outputs()]}).encode())
            os.replace(tmp, path)
        except OSError as e:
            log.warning("could not keep the lookup corpus in %s (%s)", path, e.strerror or e)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:  # a read-only file system says so even of a file that is not there
                pass

    def load(self, path: Path) -> int:
        """Take the outputs a :meth:`save` left in ``path`` (oldest first, within the bound); returns
        the tokens taken. A missing file is nothing; an unreadable one is one warning, and nothing is
        taken from it. The folder's key says whose tokenizer the ids are (and drafts are only ever
        proposals: a wrong one is rejected by the target)."""
        path = Path(path)
        try:
            check_private_folder(path.parent)
            data = json.loads(path.read_text())
            outputs = data["outputs"]
            if data.get("corpus") != 1 or not all(
                    isinstance(o, list) and all(type(t) is int and 0 <= t < 1 << 31 for t in o) for o in outputs):
                raise ValueError("not a lookup corpus of this tokenizer")
        except FileNotFoundError:
            return 0
        except NotPrivate as e:
            log.warning("ignored the lookup corpus in %s (%s)", path, e)
            return 0
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignored the lookup corpus in %s (%s)", path, e)
            return 0
        for output in outputs:
            self.add(output)
        return self._tokens
