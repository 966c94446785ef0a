"""What the CLI tests of bad input, limits, interrupts and mlx_lm's options share: tiny model folders, the
CLI invoked in-process, and the one-line error every failure must be."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdec_cli.cli.app import app
from specdec_cli.session.synthetic import TINY_CONFIGS, make_model_dir

REPO = Path(__file__).resolve().parents[2]
# A Python exception class name in a message ("ValueError", "KeyError: ...").
CLASS_NAME = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception|Interrupt)\b")
# head_dim 32: a multiple of --kv-group-size 32.
KV_LLAMA = {**TINY_CONFIGS["llama"], "head_dim": 32}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli-models")
    out = {
        "llama": make_model_dir(root / "llama", "llama", seed=0),
        "small-context": make_model_dir(root / "small-context",
                                        {**TINY_CONFIGS["llama"], "max_position_embeddings": 64}, seed=0),
        "kv-llama": make_model_dir(root / "kv-llama", KV_LLAMA, seed=0),
        "kv-llama-draft": make_model_dir(root / "kv-llama-draft", KV_LLAMA, seed=0, noise=0.05),
    }
    broken = root / "truncated"
    shutil.copytree(out["llama"], broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    out["truncated"] = broken
    return out


def generate(*args, input=None):
    return CliRunner().invoke(app, ["generate", *map(str, args)], input=input)


def one_line(result) -> str:
    # The BLAS note (first-run issue) is advice that precedes any run on a plain CPU wheel.
    lines = [x for x in result.stderr.strip().splitlines() if not x.startswith("note: MLX's CPU backend")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output and not CLASS_NAME.search(result.stderr), result.stderr
    return lines[0]
