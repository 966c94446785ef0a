"""Earlier runs' outputs for prompt lookup (``--lookup-history FILE``).

A JSON file of generated token sequences, newest last, each tagged with a
fingerprint of the tokenizer that produced it (ids mean nothing under another
vocabulary). It is a cache: bounded in size (oldest outputs dropped first),
safe to delete, and a file that cannot be read is ignored with a warning and
replaced at the next save. It only feeds drafts, so it can never change what
is generated.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

FORMAT = "specdec-lookup-history"
VERSION = 1
# Tokens kept over all outputs (about 1 MB of JSON); indexing them costs
# well under a second when a run starts.
MAX_TOKENS = 32768


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the vocabulary: outputs are only reused under the same one."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


@dataclass
class LookupHistory:
    """The outputs of earlier runs, read from and written back to one file.

    Attributes:
        path: The file.
        fingerprint: The tokenizer's fingerprint (see :func:`tokenizer_fingerprint`).
        entries: ``(fingerprint, tokens)`` of every stored output, oldest first.
        warning: Why the file was ignored, if it was.
        max_tokens: Bound on the stored tokens.
    """

    path: Path
    fingerprint: str
    entries: list[tuple[str, list[int]]] = field(default_factory=list)
    warning: Optional[str] = None
    max_tokens: int = MAX_TOKENS

    @classmethod
    def load(cls, path: str | os.PathLike, fingerprint: str, max_tokens: int = MAX_TOKENS) -> "LookupHistory":
        """Read ``path``; a missing file is an empty history, an unreadable one is ignored with a warning."""
        history = cls(Path(path), fingerprint, max_tokens=max_tokens)
        try:
            raw = history.path.read_text()
        except FileNotFoundError:
            return history
        except OSError as e:
            history.warning = f"cannot read lookup history {history.path} ({e.strerror}): ignored"
            return history
        try:
            data = json.loads(raw)
            if data.get("format") != FORMAT or data.get("version") != VERSION:
                raise ValueError("not a lookup history file")
            entries = []
            for item in data["entries"]:
                tokens = item["tokens"]
                if not isinstance(item["tokenizer"], str) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
                ):
                    raise ValueError("bad entry")
                entries.append((item["tokenizer"], tokens))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            history.warning = f"lookup history {history.path} is corrupt ({e}): ignored, it will be rewritten"
            return history
        history.entries = entries
        history._trim()
        return history

    def outputs(self) -> list[list[int]]:
        """This tokenizer's stored outputs, oldest first."""
        return [tokens for fp, tokens in self.entries if fp == self.fingerprint]

    def add(self, tokens: list[int]) -> None:
        """Remember one output (a repeat moves to the newest place instead)."""
        if not tokens:
            return
        entry = (self.fingerprint, list(tokens)[-self.max_tokens:])
        self.entries = [e for e in self.entries if e != entry] + [entry]
        self._trim()

    def _trim(self) -> None:
        total = sum(len(t) for _, t in self.entries)
        while self.entries and total > self.max_tokens:
            total -= len(self.entries.pop(0)[1])

    def save(self) -> None:
        """Write the file atomically (a crash leaves the old one or the new one)."""
        data = {"format": FORMAT, "version": VERSION,
                "entries": [{"tokenizer": fp, "tokens": t} for fp, t in self.entries]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, separators=(",", ":"))
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
