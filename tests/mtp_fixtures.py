"""Tiny Qwen3.5 / Qwen3-Next targets with MTP heads, saved as the checkpoints ship them.

``hf_checkpoint`` writes a random target in the original Hugging Face layout
(``model.language_model.*`` / ``model.*`` names, PyTorch conv1d layout,
zero-centred RMSNorm weights, Qwen3-Next experts one by one) with an ``mtp.*``
head beside the backbone, exactly what mlx-lm's ``sanitize`` reads and then
drops the head from. ``fit_head`` trains a head for a few seconds on the
target's own greedy text so that drafts get accepted (random heads never are).
"""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from specdec_cli.cache.caches import ModelCache
from specdec_cli.drafters.mtp_head import MTPConfig, MTPHead, random_head
from specdec_cli.loop.events import collect
from specdec_cli.loop.runner import run
from specdec_cli.session.synthetic import EOS_ID, TINY_CONFIGS, VOCAB_SIZE, build_model, write_tokenizer
from specdec_cli.model.taps import HiddenTap, TapSpec, target_parts

from helpers import tied_qwen35

QWEN3_NEXT = {
    "model_type": "qwen3_next",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "tie_word_embeddings": False,
    "full_attention_interval": 2,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 1,
}
QWEN3_5 = copy.deepcopy(TINY_CONFIGS["qwen3_5"])
QWEN3_5["text_config"]["mtp_num_hidden_layers"] = 1
# Qwen3.5-MoE: the head's MLP is sparse, its experts fused (gate_up_proj) in HF files.
QWEN3_5_MOE = {"model_type": "qwen3_5_moe", "text_config": {
    **QWEN3_5["text_config"], "model_type": "qwen3_5_moe_text", "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "norm_topk_prob": True}}
# Tied embeddings: a head a target sharded over 2 ranks can draft through.
QWEN3_5_TIED = tied_qwen35(QWEN3_5)
CONFIGS = {"qwen3_5": QWEN3_5, "qwen3_next": QWEN3_NEXT, "qwen3_5_moe": QWEN3_5_MOE, "qwen3_5_tied": QWEN3_5_TIED}
FAMILY = {"qwen3_5": "qwen3_5", "qwen3_next": "qwen3_next", "qwen3_5_moe": "qwen3_5", "qwen3_5_tied": "qwen3_5"}
PROMPT = list(b"The quick brown fox jumps over the lazy dog, twice: the quick brown fox.")

# mlx-lm's norm_keys for these families: stored zero-centred in HF checkpoints.
_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
          ".q_norm.weight", ".k_norm.weight")
_HEAD_NORMS = ("norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def text_config(family: str) -> dict:
    c = CONFIGS[family]
    return c.get("text_config", c)


def head_config(family: str) -> MTPConfig:
    return MTPConfig.from_qwen(text_config(family), FAMILY[family])


@functools.cache
def target(family: str):
    return build_model(CONFIGS[family], seed=0)


def _experts_one_by_one(key: str, value: mx.array) -> dict:
    # switch_mlp.{proj}.weight [E, ...] -> experts.{e}.{proj}.weight (Qwen3-Next files)
    m = re.fullmatch(r"(.*)\.switch_mlp\.(gate_proj|up_proj|down_proj)\.weight", key)
    if not m:
        return {key: value}
    return {f"{m[1]}.experts.{e}.{m[2]}.weight": value[e] for e in range(value.shape[0])}


def backbone_hf(model, family: str) -> dict:
    """The backbone's MLX weights in the original checkpoint's layout."""
    out = {}
    for key, v in tree_flatten(model.parameters()):
        if "conv1d.weight" in key:
            v = v.moveaxis(2, 1)  # MLX [C, K, 1] -> PyTorch [C, 1, K]
        if v.ndim == 1 and key.endswith(_NORMS):
            v = v - 1.0
        if family == "qwen3_5":
            key = key.replace("language_model.model.", "model.language_model.").replace(
                "language_model.lm_head", "lm_head")
            out[key] = v
        else:
            out.update(_experts_one_by_one(key, v))
    return out


def head_hf(head: MTPHead, family: str) -> dict:
    """A head's weights as ``mtp.*`` tensors of the original checkpoint (norms zero-centred)."""
    out = {}
    for key, v in tree_flatten(head.parameters()):
        if v.ndim == 1 and (key in _HEAD_NORMS or key.endswith(_NORMS)):
            v = v - 1.0
        if family == "qwen3_next":
            items = _experts_one_by_one(key, v)
        elif ".switch_mlp." in key:
            items = {}  # fused below
        else:
            items = {key: v}
        out.update({f"mtp.{k}": x for k, x in items.items()})
    if family != "qwen3_next" and head.config.num_experts:
        for layer in range(len(head.layers)):
            sw = head.layers[layer].mlp.switch_mlp
            base = f"mtp.layers.{layer}.mlp.experts"
            out[f"{base}.gate_up_proj"] = mx.concatenate([sw.gate_proj.weight, sw.up_proj.weight], axis=-2)
            out[f"{base}.down_proj"] = sw.down_proj.weight
    return out


def hf_checkpoint(path: Path, family: str, head: MTPHead | None, mtp_file: bool = False) -> Path:
    """Save the target (and its head, unless None) in the original HF layout.

    Args:
        mtp_file: Put the head in a separate ``mtp.safetensors`` beside ``model.safetensors``.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = backbone_hf(target(family), family)
    mtp = head_hf(head, family) if head is not None else {}
    if mtp_file and mtp:
        mx.save_safetensors(str(path / "mtp.safetensors"), mtp, metadata={"format": "pt"})
    else:
        weights.update(mtp)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    config = copy.deepcopy(CONFIGS[family])
    config["eos_token_id"] = EOS_ID
    if head is None:
        text_config_of(config).pop("mtp_num_hidden_layers", None)
        config.pop("num_nextn_predict_layers", None)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path)
    return path


def text_config_of(config: dict) -> dict:
    return config.get("text_config", config)


def qwen3_5_mtp_sidecar(path: Path, family: str, head: MTPHead) -> Path:
    """The head as mlx-vlm's converted ``qwen3_5_mtp`` folder (no prefix, norms already shifted)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(head.parameters())),
                        metadata={"format": "mlx"})
    tc = copy.deepcopy(text_config(family))
    config = {"model_type": "qwen3_5_mtp", "text_config": tc, "block_size": 3,
              "tie_word_embeddings": tc.get("tie_word_embeddings", False)}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def target_rows(model, ids: list[int]) -> mx.array:
    """The target's final-normed states for ``ids`` (one forward, fresh caches)."""
    cache = ModelCache(model)
    with HiddenTap(model, TapSpec(final=True)) as tap:
        cache.feed(mx.array(ids, dtype=mx.uint32))
        return tap.take().final


@functools.cache
def fitted_head(family: str, steps: int = 150) -> MTPHead:
    """A head trained on the target's own greedy text (seconds): drafts get accepted."""
    model = target(family)
    parts = target_parts(model)
    _, out = collect(run(model, PROMPT, max_tokens=120))
    ids = PROMPT + out
    rows = target_rows(model, ids)
    head = random_head(head_config(family), seed=1)
    # Pair (h_t, x_{t+1}) predicts x_{t+2}.
    embeds = parts.embed(mx.array(ids[1:-1], dtype=mx.uint32))[None]
    hidden = rows[None, :-2]
    labels = mx.array(ids[2:], dtype=mx.uint32)

    def loss_fn(h):
        o = h(embeds, hidden, h.make_cache())
        return nn.losses.cross_entropy(parts.logits(o)[0], labels).mean()

    opt = optim.Adam(learning_rate=3e-3)
    grad = nn.value_and_grad(head, loss_fn)
    head.train()
    for _ in range(steps):
        _, g = grad(head)
        opt.update(head, g)
        mx.eval(head.parameters(), opt.state)
    head.eval()
    return head
