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

from ..cache.caches import make_cache
from ..model.distributed import Ranks, shard
from ..errors import ModelLoadError, TokenizerMismatchError, UnsupportedModelError

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


def _fix(name: str) -> str:
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


def load(name: str, dtype: Optional[str] = None, *, adapter_path: Optional[str] = None,
         trust_remote_code: bool = False, force_download: bool = False,
         path: Optional[Path] = None, ranks: Optional[Ranks] = None) -> Loaded:
    """Load a model and its tokenizer, optionally cast to ``dtype``.

    Args:
        name: Hub repo id or local directory.
        dtype: ``float32``, ``bfloat16`` or ``float16``; quantized weights are
            dequantized first. ``auto``: see :func:`resolve_dtype`. None keeps
            the stored weights.
        adapter_path: LoRA (or DoRA / full) adapters trained with
            ``mlx_lm.lora``, applied with mlx-lm's own ``load_adapters``.
        trust_remote_code: Allow a model's own Python files (model and tokenizer).
        force_download: Download a Hub repo's files again.
        path: Where ``name`` was already resolved to (no second download).
        ranks: Shard the model over these ranks (see :mod:`specdec_cli.model.distributed`):
            built lazily, cast, then sharded by mlx-lm's own ``shard()`` or
            ``pipeline()`` before any weight is read, as ``sharded_load`` does.

    Raises:
        ModelLoadError: Missing files or unreadable weights.
        UnsupportedModelError: mlx-lm cannot build the architecture, the
            engine cannot roll its caches back exactly, or mlx-lm cannot shard
            it the asked way over these ranks.
    """
    from mlx_lm.utils import load_model, load_tokenizer

    path = resolve(name, force_download) if path is None else path
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} has no config.json: pass a model directory in Hugging Face layout")
    weights = sorted(path.glob("model*.safetensors"))
    if not weights:
        raise ModelLoadError(
            f"{path} has no model*.safetensors weights: convert the model with `mlx_lm.convert`"
        )
    for file in weights:
        why = check_safetensors(file)
        if why:
            raise ModelLoadError(f"the weight file {file} is broken: {why}; {_fix(name)}")
    try:
        model_config = json.loads(config_file.read_text())
        model_type = model_config.get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ModelLoadError(f"{config_file} is not a valid JSON config ({e}); {_fix(name)}") from None
    try:
        model, config = load_model(path, lazy=ranks is not None, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "not supported" in str(e):
            import mlx_lm

            raise UnsupportedModelError(
                f"mlx-lm {mlx_lm.__version__} cannot load architecture {model_type!r}: "
                "pick a model mlx-lm supports or upgrade mlx-lm"
            ) from None
        if "trust_remote_code" in str(e):
            raise ModelLoadError(
                f"{name} builds its architecture with its own Python file "
                f"({model_config.get('model_file')}): pass --trust-remote-code if you trust it"
            ) from None
        raise ModelLoadError(f"cannot load {name}: {e}") from None
    except Exception as e:  # unreadable tensors: MLX raises several types
        raise ModelLoadError(f"cannot read the weights of {name} ({e}); {_fix(name)}") from None
    if ranks is not None:
        model = _load_sharded(model, config, dtype, ranks, name)
    if adapter_path is not None:
        model = _load_adapters(model, adapter_path)
    try:
        extra = {"trust_remote_code": True} if trust_remote_code else None
        tokenizer = load_tokenizer(path, extra, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # tokenizer libraries raise many types
        raise ModelLoadError(f"cannot load the tokenizer of {name}: {e}") from None
    make_cache(model)  # capability check before anything runs
    dtype = resolve_dtype(dtype)
    if dtype is not None and ranks is None:
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
    from ..drafters.dflash import load_dflash_model

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


def _load_adapters(model: nn.Module, adapter_path: str) -> nn.Module:
    """mlx-lm's own adapter loading (``mlx_lm.lora``'s output directory)."""
    from mlx_lm.tuner.utils import load_adapters

    path = Path(adapter_path).expanduser()
    for need in ("adapter_config.json", "adapters.safetensors"):
        if not (path / need).is_file():
            raise ModelLoadError(
                f"--adapter-path {adapter_path} has no {need}: pass the directory mlx_lm.lora wrote"
            )
    try:
        model = load_adapters(model, str(path))
    except Exception as e:  # shapes or names that do not fit this model
        raise ModelLoadError(f"the adapters in {adapter_path} do not fit this model ({e})") from None
    model.eval()
    return model


def _load_sharded(model: nn.Module, config: dict, dtype: Optional[str], ranks: Ranks, name: str) -> nn.Module:
    """Cast a lazily built model, shard it (weights still unread), then read this rank's shard."""
    dtype = resolve_dtype(dtype)
    if dtype is not None:
        # Before sharding: mlx-lm dequantizes plain quantized layers, not sharded ones.
        cast(model, DTYPES[dtype], evaluate=False)
    shard(model, config, ranks)
    try:
        mx.eval(model.parameters())
    except Exception as e:  # unreadable tensors: MLX raises several types
        raise ModelLoadError(f"cannot read the weights of {name} ({e}); {_fix(name)}") from None
    return model


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
    from ..drafters.mtp_io import is_sidecar

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
        A :class:`~specdec_cli.drafters.mtp_io.LoadedHead`.

    Raises:
        UnsupportedModelError: No head, several MTP layers, or a head for another model.
    """
    from ..drafters.mtp_io import load_head
    from ..model.taps import target_parts

    path = target.path if name is None else (path or resolve(name))
    config = read_config(path)
    parts = target_parts(target.model)
    loaded = load_head(path, config, name or target.name, parts)
    dtype = resolve_dtype(dtype)
    if dtype is not None:
        cast(loaded.head, DTYPES[dtype])
    return loaded
