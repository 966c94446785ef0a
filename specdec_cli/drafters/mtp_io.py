"""MTP heads on disk: reading a target's own ``mtp.*`` tensors or a sidecar folder, and writing ours.

Loading (:func:`load_head`) reads the ``mtp.*`` tensors from a target's own
safetensors (mlx-lm's ``sanitize`` drops them) or an MTP sidecar. Qwen stores
the head's RMSNorm weights zero-centred; MLX's RMSNorm multiplies by the
weight, so they need ``w + 1``. Whether to shift is decided by the layout read,
never by the values: ``mtp.``-prefixed (Hugging Face) tensors are shifted,
converted sidecars (mlx-vlm's ``qwen3_5_mtp``, ours) are not.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import ModelLoadError, UnsupportedModelError
from ..model.files import DTYPES, Loaded, cast, read_config, resolve, resolve_dtype
from ..model.taps import TargetParts, target_parts
from .mtp_head import MTPConfig, MTPHead

# config.json model_type of MTP-only folders: mlx-vlm's converted sidecar, and ours.
SIDECAR_TYPES = ("qwen3_5_mtp", "specdec_mtp")
SPECDEC_TYPE = "specdec_mtp"
# Targets whose own checkpoint can carry an `mtp.*` head we know how to build.
QWEN_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


# mlx-lm shifts these norms of a Qwen3.5 / Qwen3-Next backbone (its `norm_keys`;
# not the GatedDeltaNet gated norm): the head's layer follows the same rule.
_LAYER_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight")
# The head's own norms, zero-centred in the same checkpoints.
_HEAD_NORMS = ("norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")
_EXPERT = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")


def _header(file: Path) -> tuple[list[str], dict]:
    """Tensor names and metadata of a safetensors file, from its header alone."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", None) or {}
    return list(header), meta


def mtp_tensor_files(path: Path) -> dict[Path, list[str]]:
    """The safetensors files under ``path`` holding ``mtp.*`` tensors, with those names."""
    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        listed = {path / f for k, f in weight_map.items() if k.startswith("mtp.")}
        # Files beside the model that the index does not list (an `mtp.safetensors`).
        files = sorted(listed | {f for f in files if f.name not in set(weight_map.values())})
    found = {}
    for file in files:
        names = [k for k in _header(file)[0] if k.startswith("mtp.")]
        if names:
            found[file] = names
    return found


def hf_to_head(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Hugging Face ``mtp.*`` tensors -> the head's parameter names, norms shifted by +1.

    The shift is applied because of the layout (``mtp.``-prefixed tensors from
    the original checkpoint store RMSNorm weights zero-centred), whatever the
    values are. Fused experts (``experts.gate_up_proj``, gate first along axis
    -2) and per-expert tensors (Qwen3-Next) become ``switch_mlp`` stacks.
    """
    out: dict[str, mx.array] = {}
    experts: dict[tuple[str, str, str], dict[int, mx.array]] = {}
    for key, value in weights.items():
        if not key.startswith("mtp."):
            raise ModelLoadError(f"expected an mtp.* tensor, got {key}")
        key = key[len("mtp."):]
        if value.ndim == 1 and (key in _HEAD_NORMS or key.endswith(_LAYER_NORMS)):
            value = value + 1.0
        if m := _EXPERT.fullmatch(key):
            experts.setdefault((m[1], m[3], m[4]), {})[int(m[2])] = value
            continue
        if key.endswith(".experts.gate_up_proj"):
            base = key[: -len(".experts.gate_up_proj")]
            gate, up = mx.split(value, 2, axis=-2)
            out[f"{base}.switch_mlp.gate_proj.weight"] = gate
            out[f"{base}.switch_mlp.up_proj.weight"] = up
            continue
        if key.endswith(".experts.down_proj"):
            out[key[: -len(".experts.down_proj")] + ".switch_mlp.down_proj.weight"] = value
            continue
        out[key] = value
    for (base, proj, kind), per in experts.items():
        if sorted(per) != list(range(len(per))):
            raise ModelLoadError(f"MTP experts of {base} are not numbered 0..{len(per) - 1}")
        out[f"{base}.switch_mlp.{proj}.{kind}"] = mx.stack([per[e] for e in range(len(per))])
    return out


@dataclass
class LoadedHead:
    """A head ready to draft, and where it came from."""

    head: MTPHead
    parts: TargetParts  # the target's embedding and lm_head it drafts through
    source: str  # what the user named (the target, or a sidecar / checkpoint)
    layout: str  # "hf" (mtp.* tensors, norms shifted on load) or "sidecar" (used as stored)


def _quantize(head: MTPHead, weights: dict, quantization: Optional[dict]) -> None:
    if not quantization:
        return

    def predicate(path: str, module: nn.Module):
        if f"{path}.scales" not in weights:
            return False
        spec = quantization.get(path, quantization.get(f"mtp.{path}"))
        if isinstance(spec, dict):
            return spec
        return hasattr(module, "to_quantized")

    nn.quantize(head, group_size=quantization.get("group_size", 64), bits=quantization.get("bits", 4),
                mode=quantization.get("mode", "affine"), class_predicate=predicate)


def build_head(config: MTPConfig, weights: dict[str, mx.array], quantization: Optional[dict] = None,
               what: str = "MTP head") -> MTPHead:
    """Instantiate a head and load ``weights`` (head parameter names) strictly."""
    head = MTPHead(config)
    _quantize(head, weights, quantization)
    want = dict(tree_flatten(head.parameters()))
    missing, extra = sorted(set(want) - set(weights)), sorted(set(weights) - set(want))
    if missing or extra:
        raise ModelLoadError(
            f"{what}: tensors do not match its config (missing {missing[:4]}, unexpected {extra[:4]})"
        )
    for name, value in weights.items():
        if want[name].shape != value.shape:
            raise ModelLoadError(f"{what}: {name} has shape {value.shape}, its config says {want[name].shape}")
    head.load_weights(list(weights.items()))
    head.eval()
    mx.eval(head.parameters())
    return head


def _depth(config: dict) -> Optional[int]:
    tc = config.get("text_config") or config
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        if key in tc:
            return int(tc[key] or 0)
        if key in config:
            return int(config[key] or 0)
    return None


def _refuse_deep(n: int, where: str) -> None:
    if n > 1:
        raise UnsupportedModelError(
            f"{where} has {n} MTP layers; specdec runs heads with one layer (the published implementations "
            "disagree on how several chain): use --drafter lookup or a draft model"
        )


def read_hf_head(path: Path, config: dict, name: str) -> tuple[MTPConfig, dict, Optional[dict]]:
    """The ``mtp.*`` head stored in a Qwen checkpoint directory (its own files or an ``mtp.safetensors``)."""
    model_type = config.get("model_type")
    files = mtp_tensor_files(path)
    if not files:
        depth = _depth(config)
        why = f" although its config declares {depth} MTP layer(s)" if depth else ""
        raise UnsupportedModelError(
            f"{name} has no MTP head: no mtp.* tensors in its safetensors{why} (mlx-lm conversions drop "
            "them); pass --draft-model with the original Hugging Face checkpoint or an MTP sidecar, "
            "or use --drafter lookup"
        )
    if model_type not in QWEN_FAMILIES:
        raise UnsupportedModelError(
            f"{name} ({model_type}) carries mtp.* tensors, but specdec builds checkpoint MTP heads only for "
            f"{', '.join(QWEN_FAMILIES)}; convert the head to a specdec_mtp sidecar"
        )
    names = [k for ks in files.values() for k in ks]
    layers = {int(m[1]) for k in names if (m := re.match(r"mtp\.layers\.(\d+)\.", k))}
    _refuse_deep(max(len(layers), _depth(config) or 0), name)
    raw: dict[str, mx.array] = {}
    for file, keys in files.items():
        loaded = mx.load(str(file))
        raw.update({k: loaded[k] for k in keys})
    family = "qwen3_next" if model_type == "qwen3_next" else "qwen3_5"
    head_config = MTPConfig.from_qwen(config.get("text_config") or config, family)
    # Quantized mtp.* tensors (added to an MLX conversion) follow the target's quantization.
    quant = config.get("quantization") if any(k.endswith(".scales") for k in raw) else None
    return head_config, hf_to_head(raw), quant


def read_sidecar(path: Path, config: dict) -> tuple[MTPConfig, dict, Optional[dict]]:
    """A converted MTP-only folder: mlx-vlm's ``qwen3_5_mtp`` or ours (``specdec_mtp``); used as stored."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    weights: dict[str, mx.array] = {}
    for file in files:
        weights.update(mx.load(str(file)))
    if config["model_type"] == SPECDEC_TYPE:
        head_config = MTPConfig.from_dict(config)
    else:
        tc = config.get("text_config") or {}
        _refuse_deep(_depth(config) or 1, str(path))
        head_config = MTPConfig.from_qwen(tc, "qwen3_5")
    return head_config, weights, config.get("quantization")


def load_head(path: Path, config: dict, name: str, target_parts: TargetParts) -> LoadedHead:
    """Load an MTP head from a model directory or sidecar and check it fits the target.

    Args:
        path: A Qwen checkpoint carrying ``mtp.*`` tensors, or an MTP sidecar folder.
        config: That directory's config.json.
        name: What the user passed (for messages).
        target_parts: The target's embedding / lm_head (for the fit checks).

    Raises:
        UnsupportedModelError: No head there, several MTP layers, or a head made for another model.
        ModelLoadError: Unreadable or inconsistent tensors.
    """
    if config.get("model_type") in SIDECAR_TYPES:
        head_config, weights, quant = read_sidecar(path, config)
        layout = "sidecar"
    else:
        head_config, weights, quant = read_hf_head(path, config, name)
        layout = "hf"
    if head_config.num_experts and not any(".mlp.switch_mlp." in k for k in weights):
        # A dense MTP layer in an MoE model (its mlp_only_layers): the tensors say which.
        head_config = replace(head_config, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
                              shared_expert_intermediate_size=0, norm_topk_prob=False)
    check_fits(head_config, target_parts, name)
    head = build_head(head_config, weights, quant, what=f"the MTP head of {name}")
    if head_config.draft_vocab_size:
        ids = head.draft_ids
        if ids.min().item() < 0 or ids.max().item() >= target_parts.vocab_size:
            raise ModelLoadError(f"the MTP head of {name}: its draft vocabulary names tokens outside the target's")
    return LoadedHead(head, target_parts, name, layout)


# Embedding probe: rows of these token ids (clipped to the vocabulary), first dims.
PROBE_TOKENS = (100, 1000, 5000, 20000)
PROBE_DIMS = 16


def embedding_probe(parts: TargetParts) -> list[float]:
    """A few numbers of the target's token embedding, stored with a distilled head."""
    ids = mx.array([min(t, parts.vocab_size - 1) for t in PROBE_TOKENS], dtype=mx.uint32)
    rows = parts.embed(ids)[:, :PROBE_DIMS].astype(mx.float32)
    return [round(float(x), 5) for x in rows.reshape(-1).tolist()]


def check_fits(config: MTPConfig, parts: TargetParts, name: str) -> None:
    """Refuse a head made for another model (hidden size, vocabulary, embedding probe)."""
    if config.hidden_size != parts.hidden_size:
        raise UnsupportedModelError(
            f"the MTP head in {name} reads hidden states of width {config.hidden_size}, the target's are "
            f"{parts.hidden_size}: it belongs to another model; pass the target's own head"
        )
    if parts.vocab_size and config.vocab_size != parts.vocab_size:
        raise UnsupportedModelError(
            f"the MTP head in {name} was made for a vocabulary of {config.vocab_size} tokens, the target has "
            f"{parts.vocab_size}: it belongs to another model; pass the target's own head"
        )
    if config.target_probe:
        want = mx.array(config.target_probe, dtype=mx.float32)
        have = mx.array(embedding_probe(parts), dtype=mx.float32)
        # Quantizing the target (4-bit, 8-bit) moves the probe by a few percent; another model's is unrelated.
        if want.shape != have.shape or (mx.linalg.norm(want - have) > 0.2 * mx.linalg.norm(want)).item():
            raise UnsupportedModelError(
                f"the MTP head in {name} was trained for another model (its target's token embedding "
                "differs from this one's): train one for this model with specdec distill"
            )


def save_head(path: Path, head: MTPHead) -> Path:
    """Write ``head`` as a ``specdec_mtp`` sidecar (config.json + model.safetensors, MLX convention)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(head.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps({"model_type": SPECDEC_TYPE, **head.config.to_dict()}, indent=2))
    return path


def is_sidecar(config: dict) -> bool:
    """Whether a config.json describes an MTP-only folder."""
    return config.get("model_type") in SIDECAR_TYPES


def is_mtp_sidecar(path: Optional[Path]) -> bool:
    """Whether the directory ``path`` is an MTP-only folder (mlx-vlm's or specdec's)."""
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
    path = target.path if name is None else (path or resolve(name))
    config = read_config(path)
    parts = target_parts(target.model)
    loaded = load_head(path, config, name or target.name, parts)
    dtype = resolve_dtype(dtype)
    if dtype is not None:
        cast(loaded.head, DTYPES[dtype])
    return loaded
