"""A model's files: where they are (the Hugging Face Hub or a directory), what they hold, what dtype runs.

A Hub id is downloaded with ``huggingface_hub.snapshot_download`` (with its
progress bar), then read from the local snapshot exactly like a directory
given on the command line. Every expected failure becomes a one-line
:class:`~specdec_cli.errors.ModelLoadError` naming the fix. The session loads
targets and draft models from here; each drafter's own loader (DFlash, MTP
heads) reads its files through the same functions.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import huggingface_hub
import mlx.core as mx
import mlx.nn as nn
from huggingface_hub import errors as hub_errors
from mlx.utils import tree_flatten, tree_map_with_path

from ..errors import ModelLoadError, OptionError

# Files mlx-lm needs from a repo (its own download patterns).
ALLOW_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "mtp.safetensors",  # an MTP head kept beside a converted model
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


@dataclass
class Loaded:
    """A model ready for the engine.

    Attributes:
        name: What the user passed (repo id or path).
        path: The local directory it was loaded from.
        model: The mlx-lm model (caches already checked for exact rollback).
        tokenizer: mlx-lm's ``TokenizerWrapper``.
        config: The model's config.json as loaded.
        dtype: What the weights run in after loading: ``float32``, ``bfloat16``,
            ``float16``, or e.g. ``4-bit quantized`` when kept quantized.
    """

    name: str
    path: Path
    model: nn.Module
    tokenizer: Any
    config: dict
    dtype: str = ""


def is_local(name: str) -> bool:
    """True when ``name`` is a path that exists (otherwise it is read as a Hub repo id)."""
    return Path(name).expanduser().exists()


def resolve(name: str, force_download: bool = False) -> Path:
    """Return a local directory for ``name``, downloading a Hub repo if needed.

    Args:
        name: Hub repo id or local directory.
        force_download: Download the Hub repo's files again, even when cached
            (a broken or truncated download).

    Raises:
        ModelLoadError: No such directory, repo not found, gated, or offline.
    """
    if not name.strip():  # Path("") is the working directory: never what an empty --model meant
        raise OptionError("the model name is empty: pass a model directory or a Hub repo id")
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"{name} is a file; pass the model's directory or a Hub repo id")
        return path
    if not _REPO_ID.match(name):
        raise ModelLoadError(
            f"no directory {name} and it is not a Hub repo id (like mlx-community/Qwen3-0.6B-bf16): "
            "check the path"
        )
    try:
        return Path(huggingface_hub.snapshot_download(name, allow_patterns=ALLOW_PATTERNS,
                                                      force_download=force_download))
    except hub_errors.GatedRepoError:
        raise ModelLoadError(
            f"{name} is gated: accept its terms on huggingface.co, then run `hf auth login` "
            "(or set HF_TOKEN)"
        ) from None
    except hub_errors.RepositoryNotFoundError:
        raise ModelLoadError(
            f"{name} was not found on the Hugging Face Hub (or is private): check the repo id, "
            "log in with `hf auth login` for a private repo, or pass a local directory"
        ) from None
    except hub_errors.RevisionNotFoundError:
        raise ModelLoadError(f"{name}: revision not found on the Hub; check the repo id") from None
    except (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled, OSError):
        # No network (or HF_HUB_OFFLINE=1) and no complete copy in the HF cache.
        if huggingface_hub.constants.HF_HUB_OFFLINE:  # "unreachable ... connect" named the wrong fix
            raise ModelLoadError(
                f"cannot download {name}: offline mode is on (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE is set) and "
                "it is not in the local cache; unset it to download, or pass a local model directory"
            ) from None
        raise ModelLoadError(
            f"cannot download {name}: the Hugging Face Hub is unreachable and it is not in the "
            "local cache; connect, or pass a local model directory"
        ) from None


def resolve_dtype(dtype: Optional[str]) -> Optional[str]:
    """``auto``: float32 on MLX's CPU backend, the checkpoint's own dtype on a GPU.

    On the CPU, quantized and half-precision matmuls are many times slower than
    float32 ones (they do not go through BLAS); on Metal or CUDA, quantized
    weights are what makes a model fast and small. Any other value is returned as is.
    """
    if dtype != "auto":
        return dtype
    return "float32" if mx.default_device() == mx.cpu else None


def describe_dtype(model: nn.Module, config: dict) -> str:
    """What the weights run in: ``float32``, or e.g. ``4-bit quantized`` when still quantized."""
    if any(hasattr(m, "scales") for _, m in model.named_modules()):
        bits = (config.get("quantization") or {}).get("bits")
        return f"{bits}-bit quantized" if bits else "quantized"
    counts: dict[str, int] = {}
    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            key = str(value.dtype).removeprefix("mlx.core.")
            counts[key] = counts.get(key, 0) + value.size
    return max(counts, key=counts.get) if counts else "unknown"


def refetch_hint(name: str) -> str:
    """How to replace broken files: download again, or rebuild the directory."""
    if is_local(name):
        return f"download or convert {name} again"
    return "run again with --force-download to fetch it anew"


def check_safetensors(file: Path) -> Optional[str]:
    """Why ``file`` is not a complete safetensors file (None when it looks whole).

    Reads only the header: its length, its JSON, and the end of the last
    tensor it lists, against the file's size (what a cut download breaks).
    """
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"it is {size} bytes, too short for a safetensors file"
        n = int.from_bytes(head, "little")
        if n > size - 8:
            return f"it is truncated ({size} bytes, its header alone needs {n + 8})"
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            return "its header is not valid safetensors JSON"
    if not isinstance(header, dict):
        return "its header is not valid safetensors JSON"
    ends = [v["data_offsets"][1] for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict) and len(v.get("data_offsets") or ()) == 2]
    need = 8 + n + max(ends, default=0)
    if need > size:
        return f"it is truncated ({size} bytes of {need})"
    return None


def cast(model: nn.Module, dtype: mx.Dtype, evaluate: bool = True) -> None:
    """Dequantize ``model`` if needed and cast its floating weights to ``dtype``.

    Parameters the model marks as precision-sensitive (its ``cast_predicate``,
    e.g. recurrent ``A_log``) keep their dtype, as mlx-lm's converter does.
    With ``evaluate`` False the weights stay lazy (a model about to be sharded).
    """
    from mlx_lm.utils import dequantize_model

    if any(hasattr(m, "scales") for _, m in model.named_modules()):
        dequantize_model(model)
    predicate = getattr(model, "cast_predicate", None) or (lambda _: True)

    def convert(path: str, value: mx.array) -> mx.array:
        if mx.issubdtype(value.dtype, mx.floating) and predicate(path):
            return value.astype(dtype)
        return value

    model.update(tree_map_with_path(convert, model.parameters()))
    if evaluate:
        mx.eval(model.parameters())


def read_config(path: Path) -> dict:
    """A model directory's config.json."""
    file = path / "config.json"
    if not file.is_file():
        raise ModelLoadError(f"{path} has no config.json: pass a model directory in Hugging Face layout")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{file} is not valid JSON ({e})") from None
