"""A DFlash block drafter's files: is a directory one, and load it (config.json + safetensors, no tokenizer).

Read through :mod:`specdec_cli.model.files` as any model's files are; the
architecture itself is :mod:`.dflash`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx

from ..errors import ModelLoadError
from ..model.files import DTYPES, Loaded, cast, describe_dtype, resolve, resolve_dtype
from .dflash import load_dflash_model


def is_dflash(path: Optional[Path]) -> bool:
    """True when ``path`` holds a DFlash block drafter (any DFlash architecture, DFlash2 included)."""
    if path is None:
        return False
    try:
        archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, json.JSONDecodeError):
        return False
    return any(str(a).startswith("DFlash") for a in archs)


def load_dflash(name: str, dtype: Optional[str] = None, path: Optional[Path] = None) -> Loaded:
    """Load a DFlash drafter checkpoint (config.json + safetensors; no tokenizer of its own).

    ``dtype`` and ``path`` as for :func:`load` (``auto`` included).

    Raises:
        ModelLoadError: Missing or unreadable files, missing weights.
        UnsupportedModelError: DFlash2, a missing mask token id, or extras it would not use.
    """
    path = resolve(name) if path is None else path
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path / 'config.json'} ({e})") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no .safetensors weights for the DFlash drafter")
    weights: dict[str, mx.array] = {}
    try:
        for f in files:
            weights.update(mx.load(str(f)))
    except Exception as e:  # mlx raises plain runtime errors on bad files
        raise ModelLoadError(f"cannot read the DFlash weights in {path} ({e})") from None
    model = load_dflash_model(config, weights)
    dtype = resolve_dtype(dtype)
    if dtype is not None:
        cast(model, DTYPES[dtype])
    return Loaded(name, path, model, None, config, describe_dtype(model, config))
