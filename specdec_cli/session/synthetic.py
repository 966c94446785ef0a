"""Random-weight mlx-lm models saved in the Hugging Face layout.

Tests and benchmarks build tiny (or realistically shaped) models of any
mlx-lm architecture from a config dict, so every cache family is covered
offline. A saved directory holds ``config.json``, ``model.safetensors`` and a
small byte-level tokenizer, and loads through the same path as a Hub model.
"""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..model.files import cast
from ..model.prompts import byte_level_chars

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# 256 byte tokens, then the special tokens.
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
EOS_ID = 256 + SPECIAL_TOKENS.index("<|im_end|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Tiny shapes, one per covered cache family. Sliding windows are shorter than
# the sequences the tests generate, so the window mask is exercised.
_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        **_COMMON,
        "model_type": "llama",
        "num_hidden_layers": 2,
        "rope_theta": 10000.0,
    },
    "qwen3": {
        **_COMMON,
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "head_dim": 16,
        "rope_theta": 10000.0,
    },
    "gemma3_text": {
        **_COMMON,
        "model_type": "gemma3_text",
        "num_hidden_layers": 4,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 8,
        "sliding_window_pattern": 2,
        "rope_theta": 10000.0,
        "rope_local_base_freq": 10000.0,
    },
    "qwen3_5": {
        "model_type": "qwen3_5",
        "text_config": {
            **_COMMON,
            "model_type": "qwen3_5_text",
            "num_hidden_layers": 4,
            "head_dim": 16,
            "full_attention_interval": 2,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "rope_parameters": {
                "type": "default",
                "mrope_section": [2, 1, 1],
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        },
    },
    "nemotron_h": {
        "model_type": "nemotron_h",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "max_position_embeddings": 4096,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 2,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "hybrid_override_pattern": "M*M-",
        "num_hidden_layers": 4,
        "tie_word_embeddings": False,
    },
}


def model_classes(config: dict[str, Any]) -> tuple[type, type]:
    """Return mlx-lm's ``(Model, ModelArgs)`` classes for a config's model_type."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    return module.Model, module.ModelArgs


def build_model(config: dict[str, Any], seed: int = 0, dtype: mx.Dtype = mx.float32) -> nn.Module:
    """Instantiate an mlx-lm model with random weights.

    Args:
        config: A config.json-style dict with ``model_type``.
        seed: Seed for MLX's random initialisers.
        dtype: Floating dtype of the weights (the model's cast predicate applies).

    Returns:
        The model, evaluated and in eval mode.
    """
    model_cls, args_cls = model_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(copy.deepcopy(config)))
    cast(model, dtype)
    model.eval()
    mx.eval(model.parameters())
    return model


def perturb(model: nn.Module, scale: float, seed: int = 1) -> None:
    """Add relative Gaussian noise to every floating parameter, in place.

    A target plus small noise makes a drafter that agrees with the target
    most of the time, so partial accepts happen on random-weight models.
    """
    key = mx.random.key(seed)
    leaves = tree_flatten(model.parameters())
    noisy = []
    for i, (path, value) in enumerate(leaves):
        if not mx.issubdtype(value.dtype, mx.floating):
            noisy.append((path, value))
            continue
        noise = mx.random.normal(value.shape, key=mx.random.split(key, len(leaves))[i])
        std = mx.sqrt(mx.mean(value.astype(mx.float32) ** 2)) + 1e-6
        noisy.append((path, (value + scale * std * noise).astype(value.dtype)))
    model.update(tree_unflatten(noisy))
    mx.eval(model.parameters())


def write_tokenizer(path: Path) -> None:
    """Write a byte-level BPE tokenizer (256 bytes + chat specials) to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    # Map byte values to the GPT-2 byte-level unicode alphabet in byte order.
    byte_chars = byte_level_chars()
    assert set(byte_chars.values()) == set(alphabet)
    vocab = {byte_chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def save_model_dir(path: Path, model: nn.Module, config: dict[str, Any], tokenizer: bool = True) -> Path:
    """Save weights, config.json and (optionally) the test tokenizer in Hub layout."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    cfg = copy.deepcopy(config)
    cfg.setdefault("eos_token_id", EOS_ID)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    if tokenizer:
        write_tokenizer(path)
    return path


def make_model_dir(
    path: Path,
    family: str | dict[str, Any],
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    noise: float = 0.0,
) -> Path:
    """Build a random model (optionally perturbed) and save it to ``path``.

    Args:
        path: Destination directory.
        family: A key of ``TINY_CONFIGS`` or a full config dict.
        seed: Weight seed; the same seed gives the same weights.
        dtype: Weight dtype.
        noise: Relative noise added after building (0 = exact copy of ``seed``'s model).
    """
    config = TINY_CONFIGS[family] if isinstance(family, str) else family
    model = build_model(config, seed=seed, dtype=dtype)
    if noise:
        perturb(model, noise, seed=seed + 1000)
    return save_model_dir(path, model, config)


def dflash_config(
    target_config: dict[str, Any],
    *,
    schema: str = "new",
    layers: int = 1,
    block_size: int = 8,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    causal: bool | None = None,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    rope: dict[str, Any] | None = None,
    heads: tuple[int, int] = (4, 2),
    head_dim: int = 16,
    intermediate_size: int | None = None,
) -> dict[str, Any]:
    """A ``DFlashDraftModel`` config.json for ``target_config``, in either published schema.

    ``schema="old"``: root ``block_size``/``rope_theta``/``rope_scaling``, ``dflash_config``
    holding only ``mask_token_id`` and ``target_layer_ids``. ``schema="new"``: ``block_size``
    in ``dflash_config``, RoPE in ``rope_parameters``.
    """
    text = target_config.get("text_config", target_config)
    n_target = text["num_hidden_layers"]
    ids = target_layer_ids if target_layer_ids is not None else sorted({0, n_target - 1})
    rope = rope or {"rope_type": "default", "rope_theta": 10000.0}
    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": text["hidden_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": heads[0],
        "num_key_value_heads": heads[1],
        "head_dim": head_dim,
        "intermediate_size": intermediate_size or 2 * text["hidden_size"],
        "vocab_size": text["vocab_size"],
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "num_target_layers": n_target,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "layer_types": layer_types or ["full_attention"] * layers,
        "sliding_window": sliding_window,
    }
    dflash = {"mask_token_id": text["vocab_size"] - 1 if mask_token_id is None else mask_token_id,
              "target_layer_ids": list(ids)}
    if schema == "old":
        cfg["block_size"] = block_size
        cfg["rope_theta"] = rope["rope_theta"]
        cfg["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    else:
        dflash["block_size"] = block_size
        cfg["rope_parameters"] = rope
    if causal is not None:
        dflash["causal"] = causal
    cfg["dflash_config"] = dflash
    return cfg


def save_dflash_dir(path: Path, config: dict[str, Any], seed: int = 0, prefix: str = "model.",
                    dtype: mx.Dtype = mx.float32) -> Path:
    """Random DFlash drafter weights in the publisher's layout (config.json + model.safetensors).

    Every parameter is random (norm weights around 1), so a fidelity check
    exercises each of them.
    """
    from ..drafters.dflash import DFlashConfig, DFlashModel

    model = DFlashModel(DFlashConfig.from_dict(config))
    key = mx.random.key(seed)
    leaves = tree_flatten(model.parameters())
    keys = mx.random.split(key, len(leaves))
    weights = {}
    for (name, value), k in zip(leaves, keys):
        noise = mx.random.normal(value.shape, key=k)
        if value.ndim == 1:  # norms
            w = 1.0 + 0.3 * noise
        else:
            w = noise * (value.shape[-1] ** -0.5)
        weights[prefix + name] = w.astype(dtype)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
