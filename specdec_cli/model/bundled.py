"""The default model shipped inside the package: SmolLM2-135M-Instruct.

It is package data (``specdec_cli/models/<name>/``), found through
``importlib.resources`` so it works from a clone, an editable install and a
wheel, with no network. A broken install (a file missing, truncated or
altered) is a one-line error naming the reinstall command.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Optional

from ..core.numerics import apart
from ..errors import ModelLoadError

NAME = "smollm2-135m-instruct"
DISPLAY_NAME = "SmolLM2-135M-Instruct (bundled)"
# The MTP drafter head distilled for it (specdec distill), a specdec_mtp sidecar.
HEAD_NAME = "smollm2-135m-instruct-mtp"
# Whether --drafter auto drafts with that head (lookup+mtp) rather than lookup alone, by where the model runs: on
# the host (a CPU, where a verify of several positions costs more than a step) or apart from it (a GPU, where it
# costs about one). The host's is measured (bench-results/distill-head.json, 14 prompt categories, side by side:
# lookup 1.30x, lookup+mtp 1.27x, the head alone 0.95x over plain decoding), so auto keeps to lookup there. None:
# not measured there yet (a GPU: docs/GPU-CHECK.md's headcheck), so auto keeps to lookup and says so.
HEAD_BEATS_LOOKUP: dict[str, Optional[bool]] = {"host": False, "apart": None}
# specdec-cli installs from a clone or a wheel, not from PyPI by name.
REINSTALL = "python3 -m pip install --force-reinstall --no-deps ."

# size in bytes, SHA-256 of every file the model directory ships.
FILES: dict[str, tuple[int, str]] = {
    "config.json": (792, "2b8620fc8b04d5ea4d8b4694f9e71832862be33863c7b8354ff9bc568165510e"),
    "tokenizer.json": (3522761, "75b3182b3a5a2af0f60d57fa1002a42242c0abc4d1954d1bdda925dbb5c7601e"),
    "tokenizer_config.json": (662, "3416fb8f7b3f0a4a269077c743bd9321b80b22d7c60c3324fd73663cb496352d"),
    "model.safetensors": (98351102, "2b9586cee934b8ee5102ef27a06210111626a9f62bdcaaa55b5b1d6532a29932"),
    "LICENSE": (11357, "c71d239df91726fc519c6eb72d318ec65820627232b2f796219e87dcf35d0ab4"),
}


def head_beats_lookup() -> Optional[bool]:
    """Whether the bundled head beat prompt lookup where MLX's default device is (None: not measured there)."""
    return HEAD_BEATS_LOOKUP["apart" if apart() else "host"]


class BundledModelError(ModelLoadError):
    """The bundled model is missing or damaged: the install is broken."""


@dataclass
class FileCheck:
    """One bundled file: present, right size, and (when hashed) right content."""

    name: str
    present: bool
    size_ok: bool
    sha256_ok: bool | None = None  # None: not hashed

    @property
    def ok(self) -> bool:
        return self.present and self.size_ok and self.sha256_ok is not False


def model_dir() -> Path:
    """The bundled model's directory (it may be missing on a broken install)."""
    # The package is a regular directory on disk (setuptools never zips it), so the
    # Traversable is a real path mlx-lm can open.
    return Path(str(resources.files("specdec_cli") / "models" / NAME))


def head_dir() -> Path | None:
    """The bundled model's distilled drafter head, if this install has one."""
    path = Path(str(resources.files("specdec_cli") / "models" / HEAD_NAME))
    return path if (path / "config.json").is_file() and (path / "model.safetensors").is_file() else None


def is_bundled(path: Path) -> bool:
    """Whether ``path`` is the bundled model's directory."""
    try:
        return path.resolve() == model_dir().resolve()
    except OSError:
        return False


def check_files(directory: Path | None = None, *, full: bool = False) -> list[FileCheck]:
    """Check every bundled file's presence and size; with ``full``, its SHA-256 too."""
    directory = model_dir() if directory is None else directory
    checks = []
    for name, (size, digest) in FILES.items():
        path = directory / name
        present = path.is_file()
        size_ok = present and path.stat().st_size == size
        sha_ok = None
        if full and size_ok:
            sha_ok = _sha256(path) == digest
        checks.append(FileCheck(name, present, size_ok, sha_ok))
    return checks


def require(directory: Path | None = None) -> Path:
    """The bundled model's directory, after the cheap checks (presence and sizes).

    Raises:
        BundledModelError: A file is missing or has the wrong size.
    """
    directory = model_dir() if directory is None else directory
    bad = [c for c in check_files(directory) if not c.ok]
    if bad:
        what = ", ".join(f"{c.name} {'missing' if not c.present else 'has the wrong size'}" for c in bad)
        raise BundledModelError(broken_message(f"{what} in {directory}"))
    return directory


def broken_message(detail: str) -> str:
    """The one-line error for a damaged bundled model."""
    return (f"the bundled default model is damaged ({detail}): reinstall specdec-cli with `{REINSTALL}` "
            "in its clone (or the wheel's path instead of .), or pass --model")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
