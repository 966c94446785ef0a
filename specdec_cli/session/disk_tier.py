"""The disk tier as a session uses it: where its folder is, what keys it, how big it may grow.

:mod:`.disk_cache` stores and loads; this module decides for a loaded
:class:`~.setup.Setup` what makes two processes' caches interchangeable (the
model's files, its dtype, ``--kv-bits``, the drafter, the MLX and mlx-lm
releases, the device and its kernels), opens the store with its background
writer, and answers the session's three questions: how much of a prompt is on
disk, load it, keep this entry.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Optional

import mlx.core as mx

from ..defaults import MAX_DISK_GB
from ..model.fingerprint import content_fingerprint
from .disk_cache import CORPUS_NAME, DiskHit, DiskStore, Writer
from .private import make_private_folder
from .prompt_cache import Entry
from .setup import Setup

log = logging.getLogger(__name__)

# The default bound: a quarter of the free space where the folder lives, at most this many GiB
# (LM Studio's MLX engine takes min(30 GiB, free / 4); a smaller cap because its users report 40 GB a session).
DEFAULT_CAP_GB = 20
FREE_SHARE = 4
# Seconds a one-shot command waits at its end for the disk writes of its run.
FLUSH_S = 60.0


def default_dir() -> Path:
    """``$XDG_CACHE_HOME/specdec/prompt-cache``, else ``~/.cache/specdec/prompt-cache``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "specdec" / "prompt-cache"


def default_max_bytes(folder: Path) -> int:
    """``min(20 GiB, free space / 4)`` on the file system that holds ``folder``."""
    where = folder
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        free = 0
    return min(DEFAULT_CAP_GB << 30, free // FREE_SHARE)


def _device() -> dict:
    """What makes the same model compute other bits here: the device, and on a CPU the BLAS."""
    out = {"device": str(mx.default_device()), "cudnn_sdpa": os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "")}
    if mx.default_device() == mx.cpu:
        from ..model import blas

        provider = blas.global_provider()
        out["blas"] = Path(provider).name if provider else ""
    return out


def key_parts(setup: Setup, taps=None) -> tuple[dict, Optional[dict], Optional[dict]]:
    """The target's key parts, and those telling draft models and hidden-state taps (a ``TapSpec``) apart."""
    import mlx_lm

    from .. import __version__

    opts = setup.options
    adapter = Path(opts.adapter_path).expanduser() if opts.adapter_path else None
    target = {"model": content_fingerprint(setup.target.path), "dtype": setup.target.dtype,
              "kv_bits": opts.kv_bits, "kv_group": opts.kv_group if opts.kv_bits else None,
              "adapter": content_fingerprint(adapter) if adapter is not None else None,
              "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "specdec": __version__, **_device(),
              "exact": bool(opts.exact)}  # an --exact run's caches are computed otherwise: never another's
    if setup.ranks is not None:
        # Each rank's caches hold its own shard: a folder of its own within the folder (the key's).
        target["shard"] = {"rank": setup.ranks.rank, "ranks": setup.ranks.size, "mode": setup.ranks.mode}
    draft = None
    if setup.draft is not None:
        draft = {"model": content_fingerprint(setup.draft.path), "dtype": setup.draft.dtype}
    hidden = None if taps is None else {"layers": list(taps.layers), "final": bool(taps.final)}
    return target, draft, hidden


class DiskTier:
    """The disk tier of one session: its store and background writer.

    Args:
        setup: The loaded models.
        folder: The root folder (each key gets a subfolder).
        max_bytes: Most bytes of files under ``folder``.
        taps: The hidden states the session's drafter reads (a ``TapSpec``), or None.
    """

    def __init__(self, setup: Setup, folder: Path, max_bytes: int, taps=None):
        target, draft, hidden = key_parts(setup, taps)
        self.folder = Path(folder)
        self.store = DiskStore(self.folder, target, max_bytes=max_bytes, draft_parts=draft, hidden_parts=hidden)
        self.writer = Writer(self.store)
        self._warned_size = False

    def load(self, ids, target_model, fresh, draft_model, need_hidden: bool, more_than: int = 0
             ) -> Optional[DiskHit]:
        """The longest prefix of ``ids`` the disk resumes past ``more_than`` tokens, as live caches (None: none)."""
        return self.store.load(ids, target_model, fresh, draft_model, need_hidden=need_hidden, more_than=more_than)

    def keep(self, entry: Entry) -> None:
        """Copy what the disk lacks of ``entry`` now (this thread) and write it in the background.

        Nothing is copied when the writer is full (the disk is slower than the answers), and nothing
        written when what is new would take over half the bound (it would evict everything, then the
        start of its own prefix).
        """
        if self.writer.full:
            self.writer.dropped += 1
            return
        pending = self.store.snapshot(entry.tokens, entry.target, entry.draft, entry.hidden, entry.marks)
        if pending.nbytes > self.store.max_bytes // 2:
            if not self._warned_size:
                log.warning("a prompt's caches (%.2f GB new) are over half the disk prompt cache's bound (%.2f GB): "
                            "not written; raise --prompt-cache-disk-gb", pending.nbytes / (1 << 30),
                            self.store.max_bytes / (1 << 30))
                self._warned_size = True
            return
        if pending.files:
            self.writer.submit(pending)

    @property
    def corpus_path(self) -> Path:
        """Where the lookup corpus of recent answers is kept for the next process of this key."""
        return self.store.dir / CORPUS_NAME

    def close(self, timeout: float = FLUSH_S) -> None:
        """Write what is queued (up to ``timeout`` s), then stop the writer."""
        self.writer.close(timeout)

    def line(self) -> str:
        """One line for the start-up banner and the log."""
        gib = 1 << 30
        return (f"disk prompt cache {self.folder} ({self.store.nbytes / gib:.2f} of "
                f"{self.store.max_bytes / gib:.1f} GB used)")


def open_disk_tier(setup: Setup, folder: Optional[str], gb: Optional[float], taps=None
                   ) -> tuple[Optional[DiskTier], Optional[str]]:
    """The disk tier ``--prompt-cache-dir`` / ``--prompt-cache-disk-gb`` ask for, or None, and a warning.

    Off when ``gb`` is 0, or when the folder cannot be made (a warning then; the run goes on without it).
    Under ranks each rank keys its own shard's files (a subfolder of its own, whether the ranks share the
    folder or each machine has its own).
    """
    if gb is not None and gb <= 0:
        return None, None
    path = Path(folder).expanduser() if folder else default_dir()
    try:
        if not path.is_dir():
            make_private_folder(path)  # a folder of the user's own keeps its mode: the key folders are private
    except OSError as e:
        fix = ("pass a folder you can write as --prompt-cache-dir" if folder else "pass --prompt-cache-dir")
        return None, (f"the disk prompt cache is off: cannot make {path} ({e.strerror or e}); {fix}, or "
                      "--prompt-cache-disk-gb 0 to go without it")
    if gb is not None and gb > MAX_DISK_GB:
        log.warning("--prompt-cache-disk-gb %g is more than any disk: using %d", gb, MAX_DISK_GB)
        gb = MAX_DISK_GB
    max_bytes = int(gb * (1 << 30)) if gb is not None else default_max_bytes(path)
    if max_bytes <= 0:
        return None, f"the disk prompt cache is off: no free space in {path}"
    try:
        return DiskTier(setup, path, max_bytes, taps), None
    except OSError as e:  # the model's files could not be read for the key: the run goes on without the tier
        return None, f"the disk prompt cache is off: {e}"
