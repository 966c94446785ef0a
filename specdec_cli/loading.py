"""Load models and tokenizers from the Hugging Face Hub or local directories.

A Hub id is downloaded with ``huggingface_hub.snapshot_download`` (with its
progress bar), then loaded from the local snapshot exactly like a directory
given on the command line. Every expected failure becomes a one-line
:class:`ModelLoadError` / :class:`UnsupportedModelError` naming the fix.
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

from .caches import make_cache
from .errors import ModelLoadError, TokenizerMismatchError, UnsupportedModelError

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


def resolve(name: str) -> Path:
    """Return a local directory for ``name``, downloading a Hub repo if needed.

    Raises:
        ModelLoadError: No such directory, repo not found, gated, or offline.
    """
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
        return Path(huggingface_hub.snapshot_download(name, allow_patterns=ALLOW_PATTERNS))
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
    except (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled, OSError) as e:
        # No network (or HF_HUB_OFFLINE=1) and no complete copy in the HF cache.
        raise ModelLoadError(
            f"cannot download {name}: the Hugging Face Hub is unreachable and it is not in the "
            f"local cache ({type(e).__name__}); connect, or pass a local model directory"
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


def load(name: str, dtype: Optional[str] = None, path: Optional[Path] = None) -> Loaded:
    """Load a model and its tokenizer, optionally cast to ``dtype``.

    Args:
        name: Hub repo id or local directory.
        dtype: ``float32``, ``bfloat16`` or ``float16``; quantized weights are
            dequantized first. ``auto``: see :func:`resolve_dtype`. None keeps
            the stored weights.
        path: Where ``name`` was already resolved to (no second download).

    Raises:
        ModelLoadError: Missing files or unreadable weights.
        UnsupportedModelError: mlx-lm cannot build the architecture, or the
            engine cannot roll its caches back exactly.
    """
    from mlx_lm.utils import load_model, load_tokenizer

    path = resolve(name) if path is None else path
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} has no config.json: pass a model directory in Hugging Face layout")
    if not list(path.glob("model*.safetensors")):
        raise ModelLoadError(
            f"{path} has no model*.safetensors weights: convert the model with `mlx_lm.convert`"
        )
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{config_file} is not valid JSON ({e})") from None
    try:
        model, config = load_model(path)
    except ValueError as e:
        if "not supported" in str(e):
            import mlx_lm

            raise UnsupportedModelError(
                f"mlx-lm {mlx_lm.__version__} cannot load architecture {model_type!r}: "
                "pick a model mlx-lm supports or upgrade mlx-lm"
            ) from None
        raise ModelLoadError(f"cannot load {name}: {e}") from None
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # tokenizer libraries raise many types
        raise ModelLoadError(f"cannot load the tokenizer of {name}: {e}") from None
    make_cache(model)  # capability check before anything runs
    dtype = resolve_dtype(dtype)
    if dtype is not None:
        cast(model, DTYPES[dtype])
    return Loaded(name, path, model, tokenizer, config, describe_dtype(model, config))


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
    from .drafters.dflash import load_dflash_model

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


def cast(model: nn.Module, dtype: mx.Dtype) -> None:
    """Dequantize ``model`` if needed and cast its floating weights to ``dtype``.

    Parameters the model marks as precision-sensitive (its ``cast_predicate``,
    e.g. recurrent ``A_log``) keep their dtype, as mlx-lm's converter does.
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
    mx.eval(model.parameters())


SAMPLE_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Zürich, 東京, naïve café — 3.14159 × 2 = 6.28318; emoji 🙂",
    "   leading spaces\ttabs\n\nand newlines   ",
]


def check_same_tokenizer(target: Any, draft: Any) -> None:
    """Refuse a drafter whose tokenizer differs from the target's.

    Compares the vocabularies, the special token ids and the encodings of a
    few sample texts. The embedding sizes may differ (padded vocabularies).

    Raises:
        TokenizerMismatchError: With what differs.
    """
    fix = "pick a drafter from the target's model family (same tokenizer)"
    tv, dv = target.get_vocab(), draft.get_vocab()
    if tv != dv:
        diff = len(set(tv.items()) ^ set(dv.items()))
        raise TokenizerMismatchError(
            f"the draft model's vocabulary differs from the target's ({len(dv)} vs {len(tv)} tokens, "
            f"{diff} entries differ): {fix}"
        )
    for attr in ("eos_token_ids", "bos_token_id"):
        a, b = getattr(target, attr, None), getattr(draft, attr, None)
        if a != b:
            raise TokenizerMismatchError(f"the draft model's {attr} is {b}, the target's is {a}: {fix}")
    for text in SAMPLE_TEXTS:
        if target.encode(text) != draft.encode(text):
            raise TokenizerMismatchError(f"the draft tokenizer encodes {text[:24]!r}... differently: {fix}")


def read_config(path: Path) -> dict:
    """A model directory's config.json."""
    file = path / "config.json"
    if not file.is_file():
        raise ModelLoadError(f"{path} has no config.json: pass a model directory in Hugging Face layout")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{file} is not valid JSON ({e})") from None


def is_mtp_sidecar(path: Optional[Path]) -> bool:
    """Whether the directory ``path`` is an MTP-only folder (mlx-vlm's or specdec's)."""
    from .drafters.mtp import is_sidecar

    return path is not None and (path / "config.json").is_file() and is_sidecar(read_config(path))


def load_mtp(name: Optional[str], path: Optional[Path], target: Loaded, dtype: Optional[str] = None):
    """Load the MTP head that drafts for ``target``, checked to fit it.

    Args:
        name: An MTP sidecar or a checkpoint carrying ``mtp.*`` tensors (repo
            id or directory); None reads the target's own files.
        path: Where ``name`` was resolved to.
        target: The loaded target.
        dtype: Cast the head as the target was cast.

    Returns:
        A :class:`~specdec_cli.drafters.mtp.LoadedHead`.

    Raises:
        UnsupportedModelError: No head, several MTP layers, or a head for another model.
    """
    from .drafters.mtp import load_head
    from .hooks import target_parts

    path = target.path if name is None else (path or resolve(name))
    config = read_config(path)
    parts = target_parts(target.model)
    loaded = load_head(path, config, name or target.name, parts)
    dtype = resolve_dtype(dtype)
    if dtype is not None:
        cast(loaded.head, DTYPES[dtype])
    return loaded
