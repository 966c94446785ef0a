"""A prompt cache on disk: caches that outlive the server (issue 44).

The memory tier (:mod:`.prompt_cache`) keeps whole :class:`~.state.SavedCache`
objects; this tier keeps their contents in files under one folder per *key*
(a digest of what makes caches interchangeable: the model files, dtype,
``--kv-bits``, the tokenizer and template, the MLX version and :data:`FORMAT`),
so a different model, setting or release never reads another's files.

Token prefixes are cut into blocks of ``block`` tokens, named by a chain hash
(``h_0 = sha256(key)``, ``h_i = sha256(h_{i-1} || block i's tokens as int64)``),
and each *lane* (``t`` the target's caches, ``d`` the draft model's, ``h`` the
target's hidden rows; the last two tagged with a digest of what tells drafters
and taps apart, when the caller gives it) writes two kinds of file:

- ``<lane>-b-<h_i>.safetensors``: the rows of block i (positions ``(i-1)B .. iB``)
  of every layer cache that keeps every key (plain, quantized and chunked
  attention), or of the hidden states. Written once; a longer prompt that
  extends an earlier one writes only its new blocks.
- ``<lane>-s-<h_q>-<p>-<H(p)>.safetensors``: a state record at length ``p``
  (``q = p // B``, ``H(p) = sha256(h_q || tokens[qB:p] || p)``): the whole state
  of the layers that cannot trim back (recurrent state, a sliding window that
  drops keys) at ``p``, plus the rows ``qB .. p`` of the others.

A lane resumes at ``n`` when blocks ``1 .. n // B`` are there and either ``n`` is
a block boundary and the lane has no fixed-position layer, or a state record
for ``H(n)`` is there. Files are written atomically (a temporary file and
``os.replace``), checked on reading (a sha256 of the data in the header, the
key, the lane, the layout, and the chain hash and index its name stands for, so a
file renamed or planted under another prompt's name is refused): a damaged or
foreign file is removed with one warning and the load falls back to a shorter
length. Writing never raises: a read-only folder costs one warning, a full disk
shrinks the bound to what fits (said once). Each key's files are bounded by
bytes, least recently used first (a load touches the files it read), and the
folder may be shared by several processes: each counts its own key's files
against its own bound, and any of them removes keys no process has used for
:data:`ABANDONED_S`.

Key folders are private (0700, files 0600, whatever the umask: they hold
prompts and answers), and one another user owns or others may write is not
read.

This module is the store: the files, their names, eviction and the writer thread.
What a layer cache is as arrays is :mod:`specdec_cli.cache.layout`'s, the file
format (safetensors, checksummed) :mod:`specdec_cli.cache.codec`'s.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import queue
import re
import secrets
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..cache.caches import ModelCache
from ..cache.codec import Damaged, decode, encode, to_mx, to_numpy
from ..cache.layout import (check_fixed, fixed_position, fixed_state, leaves, position_rows, restore_fixed,
                            restore_rows, row_names, signature)
from ..model.taps import Hidden
from .private import NotPrivate, check_private_folder, create_private, make_private_folder
from .prompt_cache import Entry
from .state import SavedCache

log = logging.getLogger(__name__)

#: Version of the files' layout: part of every key, so a new layout never reads an old one's files.
FORMAT = 2

_SUFFIX = ".safetensors"
#: The lookup corpus of a key's recent answers (``session.corpus``), kept in its folder.
CORPUS_NAME = "lookup-corpus.json"
# What eviction may remove: a key's folder, and a lane's block or record in it (nothing else, ever).
_KEY = re.compile(r"[0-9a-f]{64}")
_OURS = re.compile(r"(t|d|h|d[0-9a-f]{16}|h[0-9a-f]{16})-(b-[0-9a-f]{64}|s-[0-9a-f]{64}-[0-9]+-[0-9a-f]{64})"
                   + re.escape(_SUFFIX))
_TMP = re.compile(r"\..+\.[0-9]+\.[0-9a-f]{8}\.tmp")
# A temporary file older than this was left by a writer that died: eviction removes it.
_STALE_TMP_S = 3600
#: A key folder none of whose files was used for this long (an old model, setting or release) is
#: removed by any store's eviction, whatever its own bound: nothing else would ever free it.
ABANDONED_S = 30 * 24 * 3600

def key_digest(parts: dict) -> str:
    """The hex digest naming the folder of caches made under ``parts``.

    Args:
        parts: What makes caches interchangeable (model files' fingerprint,
            dtype, kv_bits, tokenizer/template hash, MLX version, ...). Values
            are read through JSON (others by ``str``); :data:`FORMAT` is added.
    """
    text = json.dumps({**parts, "__format__": FORMAT}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _named(j: int, arrays: dict) -> dict:
    """A leaf's arrays named as its file stores them: its index first (``3.k0``)."""
    return {f"{j}.{name}": a for name, a in arrays.items()}


# --- what a save copies ---------------------------------------------------------------------------


@dataclass
class _File:
    name: str
    tensors: dict  # name -> (numpy array, dtype tag)
    meta: dict


@dataclass
class Pending:
    """What one save writes: numpy copies of what was not on disk yet, made on the caller's thread.

    Attributes:
        files: The files to write.
        touch: Files already there (or scheduled) the new ones depend on: made recent when written.
        nbytes: Bytes of array data held.
    """

    files: list = field(default_factory=list)
    touch: list = field(default_factory=list)
    nbytes: int = 0


@dataclass
class DiskHit:
    """What a prompt resumes from the disk.

    Attributes:
        cached: Prompt tokens the target's caches hold.
        target: The target's caches (a live cache of its own).
        draft: The draft model's caches at the longest length up to ``cached``
            its lane resumes at (its ``length`` says which), or None.
        hidden: The target's hidden states of the ``cached`` tokens, when asked for.
        entry: The same as a memory-tier entry (its ``target`` a copy of the
            target's caches), for the session to keep or inherit checkpoints from.
    """

    cached: int
    target: ModelCache
    draft: Optional[ModelCache]
    hidden: Optional[Hidden]
    entry: Entry


class DiskStore:
    """Prompt caches in files under ``root``, bounded by bytes, shared by processes.

    Args:
        root: The folder (one subfolder per key is made inside it).
        parts: What makes caches interchangeable (see :func:`key_digest`).
        max_bytes: Most bytes of files under ``root`` (all keys); the least
            recently used go first.
        block: Tokens per block file.
        draft_parts: What tells draft models apart (their files' fingerprint,
            dtype, ...): it names the draft lane, so another drafter never
            reads these caches. None: one draft lane, ``d``.
        hidden_parts: What tells hidden rows apart (the tap's layer ids, final
            or not): it names the hidden lane likewise. None: ``h``.

    Attributes:
        key: The key's digest (the name of its subfolder, ``dir``).
        hits: Loads that resumed something.
        misses: Loads that found nothing (past their ``more_than``), or could not load it.
        written: Bytes written by this object's saves in all.
        last_written: Bytes written by its last save.
    """

    def __init__(self, root: Path, parts: dict, *, max_bytes: int, block: int = 256,
                 draft_parts: Optional[dict] = None, hidden_parts: Optional[dict] = None):
        if block < 1:
            raise ValueError("block must be >= 1")
        # Lane tags (file-name prefixes): the target's caches, the draft model's, the hidden rows.
        self._d = "d" if draft_parts is None else "d" + key_digest(draft_parts)[:16]
        self._h = "h" if hidden_parts is None else "h" + key_digest(hidden_parts)[:16]
        self.root = Path(root)
        self.key = key_digest(parts)
        self.dir = self.root / self.key
        self.max_bytes = max_bytes
        self.block = block
        self._h0 = hashlib.sha256(self.key.encode()).digest()
        self._lock = threading.Lock()
        self._names: set[str] = set()
        self._scheduled: set[str] = set()  # in a save submitted to a Writer, not written yet
        self._write_failed = False
        self._untrusted_warned = False
        self._shrunk_warned = False
        self.hits = 0
        self.misses = 0
        self.written = 0
        self.last_written = 0
        self._nbytes = 0
        self._files = 0
        self._refresh()
        self._measure()
        if self._nbytes > self.max_bytes:  # a lower bound than the last run's: kept from the start, not the first write
            self._evict()

    # -- reports --

    @property
    def nbytes(self) -> int:
        """Bytes of this key's files, as of the last save or eviction (or opening)."""
        return self._nbytes

    @property
    def files(self) -> int:
        """Number of this key's files, as of the last save or eviction (or opening)."""
        return self._files

    # -- the index of file names --

    def _refresh(self) -> set[str]:
        try:
            check_private_folder(self.dir, tighten=True)
            names = {n for n in os.listdir(self.dir) if n.endswith(_SUFFIX) and not n.startswith(".")}
        except NotPrivate as e:
            if not self._untrusted_warned:
                log.warning("disk prompt cache: not reading %s (%s): anyone who can write it can plant a cache",
                            self.dir, e)
                self._untrusted_warned = True
            names = set()
        except OSError:
            names = set()
        with self._lock:
            self._names = names
        return names

    def _measure(self) -> None:
        total = count = 0
        try:
            with os.scandir(self.dir) as it:
                for e in it:
                    if e.name.endswith(_SUFFIX) and not e.name.startswith("."):
                        try:
                            total += e.stat().st_size
                            count += 1
                        except OSError:
                            pass
        except OSError:
            pass
        self._nbytes, self._files = total, count

    # -- hashes and names --

    def _chain(self, toks: np.ndarray, blocks: int) -> list[bytes]:
        """``h_0 .. h_blocks`` for ``toks`` (int64)."""
        out = [self._h0]
        for i in range(1, blocks + 1):
            out.append(hashlib.sha256(out[-1] + toks[(i - 1) * self.block : i * self.block].tobytes()).digest())
        return out

    def _at(self, chain: list[bytes], toks: np.ndarray, p: int) -> str:
        """``H(p)``, hex."""
        q = p // self.block
        return hashlib.sha256(chain[q] + toks[q * self.block : p].tobytes() + p.to_bytes(8, "little")).hexdigest()

    @staticmethod
    def _block_name(lane: str, h: bytes) -> str:
        return f"{lane}-b-{h.hex()}{_SUFFIX}"

    def _record_name(self, lane: str, chain: list[bytes], toks: np.ndarray, p: int) -> str:
        return f"{lane}-s-{chain[p // self.block].hex()}-{p}-{self._at(chain, toks, p)}{_SUFFIX}"

    # -- save --

    def snapshot(self, tokens: Sequence[int], target: SavedCache, draft: Optional[SavedCache] = None,
                 hidden: Optional[Hidden] = None, marks: Sequence[int] = ()) -> Pending:
        """Copy what a save writes and the disk lacks, on the caller's thread (the live arrays may change next).

        Args:
            tokens: The tokens the target's caches hold (at least ``target.length``).
            target: The target's caches, with its checkpoints.
            draft: The draft model's caches (on the same tokens, maybe shorter).
            hidden: The target's hidden rows of ``tokens`` (from position 0).
            marks: More lengths worth resuming at (message boundaries, the prompt's end): an
                attention-only target gets a record there too (its rows since the block's start),
                so a prompt that branches there resumes all of it, not only up to the block before.

        Returns:
            The files to write (see :meth:`write`); empty when there is nothing new.
        """
        pending = Pending()
        try:
            length = target.length
            if not 0 < length <= len(tokens):
                return pending
            toks = np.asarray(list(tokens[:length]), dtype=np.int64)
            chain = self._chain(toks, length // self.block)
            names = self._refresh()
            with self._lock:
                names |= self._scheduled
            jobs: list[tuple[str, dict, dict]] = []  # (name, mx tensors, meta)
            self._lane_jobs("t", target, chain, toks, names, jobs, pending, marks)
            if draft is not None and 0 < draft.length <= length:
                self._lane_jobs(self._d, draft, chain, toks, names, jobs, pending)
            if hidden is not None and hidden.length:
                ends = {target.length, *target.checkpoints, *marks}
                if draft is not None:
                    ends |= {draft.length, *draft.checkpoints}
                self._hidden_jobs(hidden, min(hidden.length, length), ends, chain, toks, names, jobs, pending)
            mx.eval([a for _, tensors, _ in jobs for a in tensors.values()])
            for name, tensors, meta in jobs:
                arrays = {k: to_numpy(a) for k, a in tensors.items()}
                pending.nbytes += sum(a.nbytes for a, _ in arrays.values())
                pending.files.append(_File(name, arrays, meta))
        except Exception as e:  # a save is never worth failing the request it follows
            log.warning("disk prompt cache: could not copy caches for saving (%s: %s)", type(e).__name__, e)
            pending = Pending()
        return pending

    def _meta(self, lane: str, kind: str, sig: list, **more) -> dict:
        meta = {"format": str(FORMAT), "key": self.key, "lane": lane, "kind": kind, "block": str(self.block),
                "leaves": json.dumps(sig)}
        meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in more.items()})
        return meta

    def _lane_jobs(self, lane: str, saved: SavedCache, chain, toks, names, jobs, pending, marks=()) -> None:
        held = leaves(saved.layers)
        if not held:
            return  # taken by a live cache (SavedCache.take): nothing to copy
        sig = [signature(c) for c in held]
        if any(getattr(c, "start_position", 0) for c in held):
            return  # a chunked cache that dropped keys: its rows are not position-indexed
        trim = [j for j, c in enumerate(held) if not fixed_position(c)]
        fixed = [j for j, c in enumerate(held) if fixed_position(c)]
        B, L = self.block, saved.length
        if trim:
            for i in range(1, L // B + 1):
                name = self._block_name(lane, chain[i])
                if name in names:
                    pending.touch.append(name)
                    continue
                tensors = {}
                for j in trim:
                    tensors.update(_named(j, position_rows(held[j], (i - 1) * B, i * B)))
                jobs.append((name, tensors, self._meta(lane, "block", sig, index=i, chain=chain[i].hex())))
                names.add(name)
        ends = [L] + sorted((n for n in saved.checkpoints if 0 < n < L), reverse=True) if fixed \
            else sorted({p for p in (L, *marks) if 0 < p <= L and p % B}, reverse=True)
        for p in ends:
            name = self._record_name(lane, chain, toks, p)
            if name in names:
                pending.touch.append(name)
                continue
            q = p // B
            tensors, states = {}, {}
            for j in trim:
                if p > q * B:
                    tensors.update(_named(j, position_rows(held[j], q * B, p)))
            at = [held[j] for j in fixed] if p == L or not fixed else list(saved.checkpoints[p])
            for j, c in zip(fixed, at):
                arrays, state = fixed_state(c)
                tensors.update(_named(j, arrays))
                states[str(j)] = state
            jobs.append((name, tensors, self._meta(lane, "state", sig, length=p, states=states,
                                                   chain=self._at(chain, toks, p))))
            names.add(name)

    def _hidden_jobs(self, hidden: Hidden, rows: int, ends, chain, toks, names, jobs, pending) -> None:
        arrays = [*hidden.layers, *([] if hidden.final is None else [hidden.final])]
        sig = ["layer"] * len(hidden.layers) + (["final"] if hidden.final is not None else [])
        B = self.block

        def cut(lo: int, hi: int) -> dict:
            return {f"h{j}": a[lo:hi] for j, a in enumerate(arrays)}

        for i in range(1, rows // B + 1):
            name = self._block_name(self._h, chain[i])
            if name in names:
                pending.touch.append(name)
                continue
            jobs.append((name, cut((i - 1) * B, i * B),
                         self._meta(self._h, "block", sig, index=i, chain=chain[i].hex())))
            names.add(name)
        for p in sorted({p for p in ends if 0 < p <= rows and p % B}, reverse=True):
            name = self._record_name(self._h, chain, toks, p)
            if name in names:
                pending.touch.append(name)
                continue
            jobs.append((name, cut(p // B * B, p),
                         self._meta(self._h, "state", sig, length=p, states={}, chain=self._at(chain, toks, p))))
            names.add(name)

    def write(self, pending: Pending) -> int:
        """Write ``pending``'s files (any thread), then evict past the byte bound.

        Never raises: a failure to write costs one warning (until a write succeeds again).

        Returns:
            Bytes written.
        """
        total = 0
        tmp = None
        left = sum(a.nbytes for f in pending.files for a, _ in f.tensors.values())  # not written yet
        try:
            if pending.files:
                make_private_folder(self.dir)
            # Last block first: eviction takes the oldest files first, and a chain without its front is useless.
            for f in reversed(pending.files):
                path = self.dir / f.name
                size = sum(a.nbytes for a, _ in f.tensors.values())
                if path.exists():
                    left -= size
                    continue  # another process (or an earlier save) wrote it
                head, arrays = encode(f.tensors, f.meta)
                tmp = self.dir / f".{f.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
                with create_private(tmp) as out:
                    out.write(head)
                    for a in arrays:
                        out.write(memoryview(a).cast("B"))
                os.replace(tmp, path)
                tmp = None
                left -= size
                total += len(head) + sum(a.nbytes for a in arrays)
                with self._lock:
                    self._names.add(f.name)
            self._write_failed = False
        except OSError as e:
            if tmp is not None:
                try:
                    os.remove(tmp)
                except OSError:
                    pass
            if not (e.errno == errno.ENOSPC and self._shrink(left)):
                if not self._write_failed:
                    log.warning("disk prompt cache: cannot write under %s (%s); going on without saving",
                                self.dir, e)
                self._write_failed = True
        finally:
            with self._lock:
                self._scheduled -= {f.name for f in pending.files}
        self._touch(reversed(pending.touch))
        self.last_written = total
        self.written += total
        if total:
            self._evict()
        return total

    def save(self, tokens: Sequence[int], target: SavedCache, draft: Optional[SavedCache] = None,
             hidden: Optional[Hidden] = None) -> int:
        """:meth:`snapshot` and :meth:`write` in one call; returns bytes written."""
        return self.write(self.snapshot(tokens, target, draft, hidden))

    def _forget(self, names) -> None:
        """Remove files that are sound alone but cannot be used together."""
        for name in names:
            try:
                os.remove(self.dir / name)
            except OSError:
                pass
            with self._lock:
                self._names.discard(name)

    def _touch(self, names) -> None:
        for name in names:
            try:
                os.utime(self.dir / name)
            except OSError:
                pass  # evicted meanwhile: a later load misses there

    def _shrink(self, need: int) -> bool:
        """The disk is full: bound this key at what fits (its files and the free space, less the ``need``
        bytes a save could not write), said once, and evict down to it, so the next save finds room.

        Returns:
            Whether the bound shrank (not when the free space says the bound fits: a quota, say).
        """
        self._measure()
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            free = 0
        fits = max(0, self._nbytes + free - need)
        if fits >= self.max_bytes:
            return False
        if not self._shrunk_warned:
            log.warning("disk prompt cache: the disk under %s is full; its bound is now %.2f GB (what fits), "
                        "not %.2f GB", self.root, fits / (1 << 30), self.max_bytes / (1 << 30))
            self._shrunk_warned = True
        self.max_bytes = fits
        self._evict()
        return True

    def _evict(self) -> None:
        """Remove this key's least recently used files until they are under ``max_bytes``.

        Other keys' files count against their own servers' bounds, not this one's; a key none of whose
        files was used for :data:`ABANDONED_S` goes whole (nothing else would free it). Only this tier's
        own files are ever removed: in a key's folder (64 hex digits), named as a block or a record of
        a lane, or the lookup corpus; anything else a user keeps there (a model's weights) is left
        alone. Temporary files a crashed writer left an hour ago go too.
        """
        files, total = [], 0
        now = time.time()
        try:
            with os.scandir(self.root) as subs:
                for sub in subs:
                    if not (_KEY.fullmatch(sub.name) and sub.is_dir(follow_symlinks=False)):
                        continue
                    mine = sub.name == self.key
                    theirs, newest = [], 0.0
                    try:
                        with os.scandir(sub.path) as it:
                            for e in it:
                                try:
                                    if _OURS.fullmatch(e.name) or e.name == CORPUS_NAME:
                                        st = e.stat(follow_symlinks=False)
                                        if mine and e.name != CORPUS_NAME:
                                            files.append((st.st_mtime_ns, e.name, st.st_size, e.path))
                                            total += st.st_size
                                        elif not mine:
                                            theirs.append(e.path)
                                            newest = max(newest, st.st_mtime)
                                    elif _TMP.fullmatch(e.name) and \
                                            e.stat(follow_symlinks=False).st_mtime < now - _STALE_TMP_S:
                                        os.remove(e.path)
                                except OSError:
                                    continue
                    except OSError:
                        continue
                    if theirs and newest < now - ABANDONED_S:
                        self._abandon(sub.path, theirs)
        except OSError:
            return
        if total > self.max_bytes:
            files.sort()
            gone = set()
            for _, name, size, path in files:
                if total <= self.max_bytes:
                    break
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass  # another process evicted it
                except OSError:
                    continue
                total -= size
                gone.add(name)
            with self._lock:
                self._names -= gone
        self._measure()

    @staticmethod
    def _abandon(folder: str, paths: list[str]) -> None:
        """Remove an abandoned key's files (and the folder, once nothing else is in it)."""
        for path in paths:
            try:
                os.remove(path)
            except OSError:
                pass
        try:
            os.rmdir(folder)
        except OSError:
            pass  # a user's own file, a temporary being written, or another user's folder

    # -- load --

    def _read(self, name: str, lane: str, sig: Optional[list], kind: str, index: int = 0) -> tuple[dict, dict]:
        """A file's arrays and metadata; a damaged or foreign one is removed with a warning.

        The file must be what its name says: a block's chain hash and ``index``, a record's
        ``H(p)`` and length (a file copied under another prompt's name would load that prompt).

        Raises:
            FileNotFoundError: It vanished (another process evicted it): a miss, no warning.
            Damaged: It was removed.
        """
        path = self.dir / name
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            raise
        except OSError as e:
            return self._damaged(path, f"unreadable ({e})")
        try:
            arrays, meta = decode(blob)
            parts = name[: -len(_SUFFIX)].split("-")
            named = [("chain", parts[2]), ("index", str(index))] if kind == "block" else \
                [("chain", parts[4]), ("length", parts[3])]
            for field_, want in (("format", str(FORMAT)), ("key", self.key), ("lane", lane), ("kind", kind),
                                 ("block", str(self.block)), *named):
                if meta.get(field_) != want:
                    raise Damaged(f"its {field_} is {meta.get(field_)!r}, not {want!r}")
            if sig is not None and json.loads(meta["leaves"]) != sig:
                raise Damaged("made for another cache layout")
        except Damaged as e:
            return self._damaged(path, str(e))
        except (ValueError, KeyError) as e:
            return self._damaged(path, f"bad metadata ({e})")
        return arrays, meta

    def _damaged(self, path: Path, why: str):
        log.warning("disk prompt cache: ignoring and removing %s: %s", path.name, why)
        try:
            os.remove(path)
        except OSError:
            pass
        with self._lock:
            self._names.discard(path.name)
        raise Damaged(why)

    def _lengths(self, lane: str, names: set, chain: list[bytes], toks: np.ndarray, limit: int,
                 blocks: bool, fixed: bool) -> list[int]:
        """Every length up to ``limit`` the lane resumes at from what ``names`` holds, longest first."""
        B = self.block
        k = len(chain) - 1
        if blocks:
            k = 0
            while k + 1 < len(chain) and self._block_name(lane, chain[k + 1]) in names:
                k += 1
        out = set() if fixed else {i * B for i in range(1, k + 1)}
        prefixes = {}
        for name in names:
            if name.startswith(f"{lane}-s-"):
                parts = name[: -len(_SUFFIX)].split("-")
                if len(parts) == 5 and parts[3].isdigit():
                    prefixes.setdefault(parts[2], []).append((int(parts[3]), parts[4]))
        for i in range(k + 1):
            for p, at in prefixes.get(chain[i].hex(), ()):
                if 0 < p <= limit and p // B == i and at == self._at(chain, toks, p):
                    out.add(p)
        return sorted(out, reverse=True)

    def _fill(self, lane: str, cache: ModelCache, n: int, chain, toks) -> list[str]:
        """Fill the fresh ``cache`` with the lane's first ``n`` tokens; returns the files read."""
        own = leaves(cache.layers)
        sig = [signature(c) for c in own]
        trim = [j for j, c in enumerate(own) if not fixed_position(c)]
        fixed = [j for j, c in enumerate(own) if fixed_position(c)]
        B, q = self.block, n // self.block
        read = []
        blocks = []
        if trim:
            for i in range(1, q + 1):
                name = self._block_name(lane, chain[i])
                blocks.append(self._read(name, lane, sig, "block", i)[0])
                read.append(name)
        record = None
        if fixed or n % B:
            name = self._record_name(lane, chain, toks, n)
            arrays, meta = self._read(name, lane, sig, "state")
            record = (arrays, json.loads(meta["states"]))
            read.append(name)
        try:
            rows = {}
            for j in trim:
                pieces = blocks + ([record[0]] if record is not None and n % B else [])
                rows[j] = {}
                for part in row_names(own[j]):
                    taken = [p[f"{j}.{part}"] for p in pieces]
                    if any(a.shape[-2] != (B if k < len(blocks) else n % B) for k, (a, _) in enumerate(taken)):
                        raise ValueError(f"rows of {j}.{part} do not line up")
                    rows[j][part] = to_mx(np.concatenate([a for a, _ in taken], axis=-2), taken[0][1])
            states = {}
            for j in fixed:
                prefix = f"{j}."
                arrays = {k[len(prefix):]: to_mx(*v) for k, v in record[0].items() if k.startswith(prefix)}
                states[j] = (arrays, record[1][str(j)])
                check_fixed(own[j], *states[j], n)
        except (KeyError, ValueError, TypeError) as e:
            # Each file was sound, but they do not fit together (made by something else under this key).
            log.warning("disk prompt cache: %s files for %d tokens do not fit together (%s); removed them",
                        lane, n, e)
            self._forget(read)  # or every later request would try them again
            raise Damaged(str(e)) from None
        for j, parts in rows.items():
            restore_rows(own[j], parts, n)
        for j, (arrays, info) in states.items():
            restore_fixed(own[j], arrays, info, n)
        cache.length = n
        return read

    def _fill_hidden(self, n: int, chain, toks) -> tuple[Hidden, list[str]]:
        B, q = self.block, n // self.block
        names = [self._block_name(self._h, chain[i]) for i in range(1, q + 1)]
        if n % B:
            names.append(self._record_name(self._h, chain, toks, n))
        sig, pieces = None, []
        for i, name in enumerate(names):
            arrays, meta = self._read(name, self._h, sig, "block" if i < q else "state", i + 1)
            sig = json.loads(meta["leaves"])  # the first file's layout: the others must have it too
            pieces.append(arrays)
        try:
            cols = []
            for j in range(len(sig)):
                parts = [p[f"h{j}"] for p in pieces]
                cols.append(to_mx(np.concatenate([a for a, _ in parts], axis=0), parts[0][1]))
            if not cols or any(c.shape[0] != n for c in cols):
                raise ValueError("hidden rows do not add up")
        except (KeyError, ValueError, TypeError) as e:
            log.warning("disk prompt cache: hidden rows for %d tokens do not fit together (%s); removed them", n, e)
            self._forget(names)
            raise Damaged(str(e)) from None
        final = cols.pop() if sig[-1] == "final" else None
        return Hidden(tuple(cols), final), names

    def load(self, prompt: Sequence[int], target_model=None, fresh_target: Optional[Callable[[], ModelCache]] = None,
             draft_model=None, fresh_draft: Optional[Callable[[], ModelCache]] = None, need_hidden: bool = False,
             at_most: Optional[int] = None, more_than: int = 0) -> Optional[DiskHit]:
        """The longest prefix of ``prompt`` the files resume, as live caches; None when none.

        At least the prompt's last token is left to feed (as :meth:`PromptCache.fetch` does).

        Args:
            prompt: The prompt's token ids.
            target_model: The target (its caches are built by ``fresh_target``, or plainly).
            fresh_target: Empty target caches in the engine's layout (``Session.fresh_cache``).
            draft_model: The draft model, when the session has one.
            fresh_draft: Empty draft caches (default: ``ModelCache(draft_model)``).
            need_hidden: Resume only where the target's hidden rows come too.
            at_most: Resume at most this many tokens.
            more_than: Resume only more than this many (what the memory tier holds): past it
                nothing is read, so a lookup that memory wins costs file names and hashes alone.

        Returns:
            The caches, equal to those a prefill of the ``cached`` tokens builds.
        """
        try:
            hit = self._load(prompt, target_model, fresh_target, draft_model, fresh_draft, need_hidden, at_most,
                             more_than)
        except Exception as e:  # a cache that cannot load is a miss, never a failed request
            log.warning("disk prompt cache: load failed (%s: %s); prefilling instead", type(e).__name__, e)
            hit = None
        if hit is None:
            self.misses += 1
        else:
            self.hits += 1
        return hit

    def _resumable(self, names, chain, toks, limit: int, leaves: list, need_hidden: bool) -> list[int]:
        """The lengths the target's lane (and the hidden lane, when needed) resume at, longest first."""
        lengths = self._lengths("t", names, chain, toks, limit, any(not fixed_position(c) for c in leaves),
                                any(fixed_position(c) for c in leaves))
        if need_hidden:
            rows = set(self._lengths(self._h, names, chain, toks, limit, True, False))
            lengths = [n for n in lengths if n in rows]
        return lengths

    def _load(self, prompt, target_model, fresh_target, draft_model, fresh_draft, need_hidden, at_most, more_than):
        limit = len(prompt) - 1 if at_most is None else min(len(prompt) - 1, at_most)
        if limit <= 0:
            return None
        fresh_target = fresh_target or (lambda: ModelCache(target_model))
        if draft_model is not None and fresh_draft is None:
            fresh_draft = lambda: ModelCache(draft_model)  # noqa: E731
        toks = np.asarray(list(prompt[:limit]), dtype=np.int64)
        chain = self._chain(toks, limit // self.block)
        for _ in range(8):  # each failure removed a file: the next try finds less
            names = self._refresh()
            if not names:
                return None
            target = fresh_target()
            lengths = [n for n in self._resumable(names, chain, toks, limit, leaves(target.layers), need_hidden)
                       if n > more_than]
            if not lengths:
                return None
            n = lengths[0]
            try:
                read = self._fill("t", target, n, chain, toks)
                hidden = None
                if need_hidden:
                    hidden, more = self._fill_hidden(n, chain, toks)
                    read += more
            except (Damaged, FileNotFoundError):
                continue
            draft = None
            if fresh_draft is not None:
                draft, more = self._load_draft(fresh_draft, names, chain, toks, n)
                read += more
            self._touch(reversed(read))
            entry = Entry(tuple(int(t) for t in toks[:n]), SavedCache.of(target),
                          SavedCache.of(draft) if draft is not None else None, hidden)
            return DiskHit(n, target, draft, hidden, entry)
        return None

    def _load_draft(self, fresh_draft, names, chain, toks, n) -> tuple[Optional[ModelCache], list[str]]:
        probe = leaves(fresh_draft().layers)
        lengths = self._lengths(self._d, names, chain, toks, n, any(not fixed_position(c) for c in probe),
                                any(fixed_position(c) for c in probe))
        for m in lengths:
            cache = fresh_draft()
            try:
                return cache, self._fill(self._d, cache, m, chain, toks)
            except (Damaged, FileNotFoundError):
                continue
        return None, []


class Writer:
    """Writes a :class:`DiskStore`'s saves on one background thread, so generation does not wait for the disk.

    Args:
        store: The store whose :meth:`DiskStore.write` runs here.
        max_pending: Saves queued at most; past it a new one is dropped (its copies freed).
    """

    def __init__(self, store: DiskStore, max_pending: int = 4):
        self.store = store
        self.max_pending = max_pending
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue()
        self._busy = 0
        self._done = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="specdec-disk-cache", daemon=True)
        self._thread.start()

    @property
    def full(self) -> bool:
        """Whether a save submitted now would be dropped (closed, or ``max_pending`` queued)."""
        with self._done:
            return self._closed or self._busy >= self.max_pending

    def submit(self, pending: Pending) -> bool:
        """Queue ``pending`` for writing; False when it was dropped (closed, or too many queued)."""
        with self._done:
            if self._closed or self._busy >= self.max_pending:
                self.dropped += 1
                return False
            self._busy += 1
        with self.store._lock:
            # Later snapshots count these as written (a pending never submitted counts for nothing).
            self.store._scheduled |= {f.name for f in pending.files}
        self._queue.put(pending)
        return True

    def _run(self) -> None:
        while True:
            pending = self._queue.get()
            if pending is None:
                return
            try:
                self.store.write(pending)
            except Exception as e:  # write() warns for OSError; anything else must not kill the thread
                log.warning("disk prompt cache: a save failed (%s: %s)", type(e).__name__, e)
            finally:
                with self._done:
                    self._busy -= 1
                    self._done.notify_all()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued save is written; False on timeout."""
        with self._done:
            return self._done.wait_for(lambda: self._busy == 0, timeout)

    def close(self, timeout: Optional[float] = None) -> None:
        """Write what is queued (up to ``timeout``), then stop the thread."""
        with self._done:
            if self._closed:
                return
            self._closed = True
        self.flush(timeout)
        self._queue.put(None)
        self._thread.join(timeout)
