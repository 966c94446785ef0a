"""Earlier runs' outputs for prompt lookup (``--lookup-history FILE``).

A JSON file of generated token sequences, newest last, each tagged with a
fingerprint of the tokenizer that produced it (ids mean nothing under another
vocabulary). It is a cache: bounded in size (oldest outputs dropped first),
safe to delete. It only feeds drafts, so it can never change what is
generated.

The path the user gives is never trusted to be ours: only a regular file (or
a path that does not exist yet) is read and written; a FIFO, device, socket
or directory is refused without being opened, and so is a file that does not
carry this format's marker (a text file named by mistake). A damaged history
of ours is renamed ``NAME.corrupt`` with a warning and a new one started.
Writes go to a temporary file in the same folder, renamed over the target
(through a symlink, to its target), with the old file's mode kept.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..errors import OptionError

FORMAT = "specdec-lookup-history"
VERSION = 1
# Tokens kept over all outputs (about 1 MB of JSON); indexing them costs
# well under a second when a run starts.
MAX_TOKENS = 32768
# Our files stay near 1 MB; anything far larger is not one of them and is not read.
MAX_FILE_BYTES = 64 * 2**20
# The marker every file we write carries (json.dumps spells it this way).
MARKER = f'"format":"{FORMAT}"'.encode()


class HistoryFileError(OptionError):
    """``--lookup-history`` names something that is not ours to read or rewrite."""


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _has_marker(raw: bytes) -> bool:
    # Tolerates whitespace a hand edit or a pretty-printer adds around the colon.
    return MARKER in raw or (FORMAT.encode() in raw and b'"format"' in raw)


def _real(path: Path) -> Path:
    """Where writes go: a symlink's final target (the link itself stays a link)."""
    return Path(os.path.realpath(path))


def check_path(path: str | os.PathLike) -> None:
    """Refuse a ``--lookup-history`` path specdec may not read or rewrite, before any model loads.

    A directory, FIFO, device or socket is refused by its ``stat`` alone
    (never opened); a regular file is read, and one that is not empty must
    carry this format's marker. A damaged history of ours passes: loading
    sets it aside.

    Raises:
        HistoryFileError: Not a regular file or a new path, unreadable, or not a lookup history.
    """
    raw = _read(Path(path))
    if raw is not None and raw.strip() and not _has_marker(raw):
        raise _not_ours(path)


def _not_ours(path) -> HistoryFileError:
    return HistoryFileError(
        f"--lookup-history {path} is not a specdec lookup history (it has no \"format\": \"{FORMAT}\" "
        "marker), so specdec will not overwrite it: give a new file name")


def _not_regular(path, mode: int) -> HistoryFileError:
    return HistoryFileError(f"--lookup-history {path} is {_kind(mode)}, not a regular file: give a file path "
                            "(specdec only writes its own history files)")


def _unreadable(path, e: OSError) -> HistoryFileError:
    return HistoryFileError(f"--lookup-history {path}: cannot read it ({e.strerror}); give another file")


def _regular(path: str | os.PathLike) -> Optional[os.stat_result]:
    """``stat`` of a regular file (None when nothing is there); anything else is refused."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None  # a new file (or a dangling link: its target is created)
    except OSError as e:
        raise _unreadable(path, e) from None
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, st.st_mode)
    return st


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
        warning: What happened to a damaged file (set aside), if anything.
        max_tokens: Bound on the stored tokens.
    """

    path: Path
    fingerprint: str
    entries: list[tuple[str, list[int]]] = field(default_factory=list)
    warning: Optional[str] = None
    max_tokens: int = MAX_TOKENS

    @classmethod
    def load(cls, path: str | os.PathLike, fingerprint: str, max_tokens: int = MAX_TOKENS) -> "LookupHistory":
        """Read ``path``: a missing or empty file is an empty history.

        A damaged history of ours (not JSON, not UTF-8, bad entries) is renamed
        ``NAME.corrupt`` (``.corrupt.1``, ... when taken) and a new one started,
        with ``warning`` saying so.

        Raises:
            HistoryFileError: The path is not a regular file (nothing is
                opened), cannot be read, is not a lookup history (no format
                marker: never rewritten) or is one of another format version.
        """
        history = cls(Path(path), fingerprint, max_tokens=max_tokens)
        raw = _read(history.path)
        if raw is None or not raw.strip():
            return history
        if not _has_marker(raw):
            raise _not_ours(path)
        try:
            data = json.loads(raw.decode("utf-8"))
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError("no format field")
            if data.get("version") != VERSION:
                raise HistoryFileError(
                    f"--lookup-history {path} is a lookup history of another format version "
                    f"({data.get('version')!r}, this specdec reads {VERSION}): give another file, or delete it")
            entries = []
            for item in data["entries"]:
                tokens = item["tokens"]
                if not isinstance(item["tokenizer"], str) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
                ):
                    raise ValueError("bad entry")
                entries.append((item["tokenizer"], tokens))
        except UnicodeDecodeError:
            history._set_aside("not UTF-8")
            return history
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            history._set_aside(str(e) or type(e).__name__)
            return history
        history.entries = entries
        history._trim()
        return history

    def _set_aside(self, why: str) -> None:
        """Rename a damaged history of ours out of the way (never lose it), and say so."""
        real = _real(self.path)
        for n in range(1000):
            aside = real.with_name(real.name + (".corrupt" if n == 0 else f".corrupt.{n}"))
            if not os.path.lexists(aside):
                break
        try:
            os.rename(real, aside)
        except OSError as e:
            raise HistoryFileError(f"--lookup-history {self.path} is damaged ({why}) and could not be set aside "
                                   f"({e.strerror}): move or delete it") from None
        self.warning = (f"lookup history {self.path} is damaged ({why}): moved to {aside}, "
                        "a new history is started")

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
        """Write the file atomically (a crash leaves the old one or the new one), keeping its mode.

        Through a symlink the target is written. The path is checked again
        first: what is there now must still be a regular file of ours.

        Raises:
            OSError: It cannot be written, or is no longer a regular file or a
                lookup history (then it is left as it is).
        """
        target = _real(self.path)
        try:
            st = os.stat(target)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, f"it is now {_kind(st.st_mode)}; left as it is")
            try:
                raw = _read(target)
            except HistoryFileError:
                raise OSError(errno.EINVAL, "it is no longer a file specdec may rewrite; left as it is") from None
            if raw and raw.strip() and not _has_marker(raw):
                raise OSError(errno.EEXIST, "it is no longer a lookup history; left as it is")
        data = {"format": FORMAT, "version": VERSION,
                "entries": [{"tokenizer": fp, "tokens": t} for fp, t in self.entries]}
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, separators=(",", ":"))
                f.flush()
                os.fsync(f.fileno())
            if st is not None:
                os.chmod(tmp, stat.S_IMODE(st.st_mode))
                if (st.st_uid, st.st_gid) != (os.getuid(), os.getgid()):
                    try:  # as root, the file stays its owner's
                        os.chown(tmp, st.st_uid, st.st_gid)
                    except OSError:
                        pass
            else:
                os.chmod(tmp, 0o666 & ~_umask())  # what any new file gets (mkstemp makes 0600)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _read(path: Path) -> Optional[bytes]:
    """The bytes of a regular file (None when missing), never opening anything else.

    ``stat`` first, so a FIFO or device is refused unopened; the open is
    non-blocking and checked again with ``fstat``, in case the path changed
    in between.
    """
    st = _regular(path)
    if st is None:
        return None
    if st.st_size > MAX_FILE_BYTES:
        raise HistoryFileError(f"--lookup-history {path} is {st.st_size / 2**20:.0f} MiB, far larger than a "
                               "lookup history: give a new file name")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise _unreadable(path, e) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
