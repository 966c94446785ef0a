"""Folders and files only their owner can read or write: the disk prompt cache holds prompts and answers.

The modes are set whatever the umask (a umask only takes bits away, so a file is
created 0600 and then set to it), and a folder another user owns, or one others
may write, is not trusted: anyone who can write it can plant a cache.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

FOLDER_MODE = 0o700
FILE_MODE = 0o600


class NotPrivate(OSError):
    """A folder that others own or may write: what is in it cannot be trusted, nor kept private."""


def make_private_folder(path: Path) -> None:
    """Make ``path`` (and its missing parents) if needed, and leave it 0700 and ours.

    Raises:
        NotPrivate: It belongs to another user (it cannot be made private).
        OSError: It cannot be made.
    """
    path = Path(path)
    # Each missing folder made 0700, parents too (mkdir(parents=True) makes those with the umask's mode): a cache
    # root removed while a server runs comes back as private as it was made.
    for folder in [*reversed(path.parents), path]:
        if not folder.exists():
            folder.mkdir(mode=FOLDER_MODE, exist_ok=True)
    check_private_folder(path, tighten=True)


def check_private_folder(path: Path, tighten: bool = False) -> None:
    """Refuse a folder that is not ours or that others may write; with ``tighten``, make one others may
    only read 0700 (as an older release left it).

    A folder others could write is refused, never tightened: what they planted would stay in it.

    Raises:
        NotPrivate: Another user owns it, or others may write it.
        FileNotFoundError: It is not there.
    """
    st = os.stat(path, follow_symlinks=False)
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode):
        raise NotPrivate(f"{path} is not a folder")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise NotPrivate(f"{path} belongs to another user (uid {st.st_uid})")
    if mode & 0o022:
        raise NotPrivate(f"other users may write {path} (mode {mode:o})")
    if tighten and mode != FOLDER_MODE:
        os.chmod(path, FOLDER_MODE)


def create_private(path: Path) -> BinaryIO:
    """A new file at ``path`` (it must not exist) that only its owner reads, open for binary writing."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags, FILE_MODE)
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, FILE_MODE)  # a umask such as 0o277 would have left it 0400
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise
