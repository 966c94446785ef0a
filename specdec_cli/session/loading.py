"""Load a target or a draft model and its tokenizer, from the Hugging Face Hub or a local directory.

Where the files are and what dtype runs come from :mod:`specdec_cli.model.files`;
here the model is built (mlx-lm's own loader), checked (its caches, its
weights' files), cast or sharded, given its adapters, and its tokenizer checked
against the target's. Every expected failure becomes a one-line
:class:`ModelLoadError` / :class:`UnsupportedModelError` naming the fix.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from ..cache.caches import make_cache
from ..errors import AdapterError, ModelLoadError, TokenizerMismatchError, UnsupportedModelError
from ..model.distributed import Ranks, shard
from ..model.files import DTYPES, Loaded, cast, check_safetensors, describe_dtype, refetch_hint, resolve, resolve_dtype


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
    missing = _missing_shards(path)
    if missing:
        # mlx-lm loads the shards there are and lists the parameters the others held, with no word of the fix.
        raise ModelLoadError(f"{path} lacks {', '.join(missing)}, named in its model.safetensors.index.json: "
                             f"{refetch_hint(name)}")
    for file in weights:
        why = check_safetensors(file)
        if why:
            raise ModelLoadError(f"the weight file {file} is broken: {why}; {refetch_hint(name)}")
    try:
        model_config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{config_file} is not a valid JSON config ({e}); {refetch_hint(name)}") from None
    if not isinstance(model_config, dict):
        raise ModelLoadError(f"{config_file} is not a JSON object, as a model's config is; {refetch_hint(name)}")
    model_type = model_config.get("model_type")
    if not isinstance(model_type, str) and "model_file" not in model_config:  # (a model_file builds its own)
        raise ModelLoadError(f"{config_file} names no model_type (the architecture mlx-lm builds); "
                             f"{refetch_hint(name)}")
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
        if _PARAMETERS.search(str(e)):
            raise ModelLoadError(f"cannot load {name}: its weights do not fit its config.json ({_first_names(e)}); "
                                 f"{refetch_hint(name)}") from None
        raise ModelLoadError(f"cannot load {name}: {e}") from None
    except Exception as e:  # unreadable tensors: MLX raises several types
        raise ModelLoadError(f"cannot read the weights of {name} ({e}); {refetch_hint(name)}") from None
    if ranks is not None:
        model = _load_sharded(model, config, dtype, ranks, name)
    if adapter_path is not None:
        model = _load_adapters(model, adapter_path)
    try:
        extra = {"trust_remote_code": True} if trust_remote_code else None
        tokenizer = load_tokenizer(path, extra, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # tokenizer libraries raise many types
        if not any(next(path.glob(pattern), None) for pattern in TOKENIZER_FILES):
            # transformers then says to install sentencepiece or tiktoken: the files are what is missing.
            raise ModelLoadError(f"{path} has no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, "
                                 f"...): {refetch_hint(name)}, or copy them from the original model") from None
        raise ModelLoadError(f"cannot load the tokenizer of {name}: {e}") from None
    make_cache(model)  # capability check before anything runs
    dtype = resolve_dtype(dtype)
    if dtype is not None and ranks is None:
        cast(model, DTYPES[dtype])
    return Loaded(name, path, model, tokenizer, config, describe_dtype(model, config))


def _missing_shards(path: Path) -> list[str]:
    """The weight files the index names that the folder lacks (a cut download or copy; [] without an index)."""
    try:
        weight_map = json.loads((path / "model.safetensors.index.json").read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError):  # no index, or one that is not an object: nothing to check
        return []
    if not isinstance(weight_map, dict):
        return []
    return sorted({f for f in weight_map.values() if isinstance(f, str) and not (path / f).is_file()})


# The files a Hugging Face tokenizer is read from (fast, sentencepiece, BPE, WordPiece, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "*.model", "vocab.json", "vocab.txt", "*.tiktoken",
                   "tokenizer_config.json")


def _load_adapters(model: nn.Module, adapter_path: str) -> nn.Module:
    """mlx-lm's own adapter loading (``mlx_lm.lora``'s output directory)."""
    from mlx_lm.tuner.utils import load_adapters

    path = Path(adapter_path).expanduser()
    for need in ("adapter_config.json", "adapters.safetensors"):
        if not (path / need).is_file():
            raise AdapterError(
                f"--adapter-path {adapter_path} has no {need}: pass the directory mlx_lm.lora wrote"
            )
    _check_adapter_config(path / "adapter_config.json", adapter_path)
    try:
        model = load_adapters(model, str(path))
    except Exception as e:  # shapes or names that do not fit this model
        raise AdapterError(f"the adapters in {adapter_path} do not fit this model ({_misfit(e)}): pass the "
                           "adapters mlx_lm.lora trained for this model") from None
    model.eval()
    return model


# MLX's strict load_weights: weights and the model the config builds disagree (names or shapes).
_PARAMETERS = re.compile(r"^(Missing \d+ parameters|Received \d+ parameters not in model|Expected shape)")


def _first_names(error: Exception) -> str:
    """MLX's reason with its list of parameter names (one a line, hundreds on a real model) cut to the first."""
    head, sep, names = str(error).partition(":")
    listed = [n.strip(" ,.") for n in names.split("\n") if n.strip(" ,.")] if "\n" in names else []
    if not listed:
        return " ".join(str(error).split())[:300]
    more = f", and {len(listed) - 1} more" if len(listed) > 1 else ""
    return f"{head}: {listed[0]}{more}"


def _misfit(error: Exception) -> str:
    """mlx_lm's reason, shortened: it lists every tensor that does not fit, a line each (hundreds on a real model)."""
    lines = [x.strip() for x in str(error).splitlines() if x.strip()]
    if len(lines) < 2:
        return " ".join(str(error).split())[:300]
    more = len(lines) - 2  # lines[0] heads the list ("Adapter at ... contains incompatible tensors:")
    return lines[1] + (f"; and {more} more tensor{'s' if more > 1 else ''}" if more else "")


def _check_adapter_config(file: Path, adapter_path: str) -> None:
    """mlx_lm's loader reads the config's fields as attributes: a damaged one read as "do not fit this model
    ('types.SimpleNamespace' object has no attribute 'num_layers')"."""
    fix = "pass the directory mlx_lm.lora wrote"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise AdapterError(f"--adapter-path {adapter_path}: cannot read adapter_config.json ({e}): {fix}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"--adapter-path {adapter_path}: adapter_config.json is not a JSON object: {fix}")
    kind = config.get("fine_tune_type", "lora")
    needs = () if kind == "full" else (("num_layers", int), ("lora_parameters", dict))
    wrong = [name for name, typ in needs if not isinstance(config.get(name), typ) or isinstance(config.get(name), bool)]
    if wrong:
        raise AdapterError(f"--adapter-path {adapter_path}: adapter_config.json lacks a valid "
                           f"{' and '.join(wrong)} (a {kind} adapter's config names them): {fix}")


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
        raise ModelLoadError(f"cannot read the weights of {name} ({e}); {refetch_hint(name)}") from None
    return model



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



