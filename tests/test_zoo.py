"""Every mlx-lm architecture either runs exactly or is refused before the first token.

One tiny random-weight model per architecture (tests/zoo_configs.py) goes
through the checks of tests/zoo_check.py: speculative == plain for K = 1, 3, 8;
plain == mlx-lm's stock decoding and == one forward over the whole sequence;
drafter proposals equal to the draft model's own greedy continuation; full
acceptance with a drafter identical to the target.
"""

from __future__ import annotations

import pkgutil

import mlx_lm.models
import pytest
from zoo_check import check_one
from zoo_configs import UNBUILDABLE, ZOO, install_import_stubs

# mlx_lm/models modules that are building blocks, not architectures.
HELPERS = {"activations", "base", "bitlinear_layers", "cache", "gated_delta", "mla", "pipeline",
           "rope_utils", "ssm", "switch_layers"}

# Refused up front, with the reason the message must name.
REFUSED = {
    "deepseek_v41": "LayerCache",   # a cache class of its own, not trimmable
    "phi3small": "block-sparse",    # multi-token forward not causal within a block in mlx-lm
}

# Stock mlx-lm decodes these inconsistently; ours matches one forward over the
# whole sequence (plain == full) instead.
STOCK_INCONSISTENT = {
    # Mask window 9 (plamo3.py: window_size + 1) but RotatingKVCache(max_size=8):
    # stock prefill attends 9 tokens, stock decode 8. Ours applies 9 everywhere.
    "plamo3",
}


def test_the_zoo_covers_every_mlx_lm_architecture():
    # Fails when mlx-lm adds (or renames) an architecture: add a tiny config.
    modules = {m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__)}
    missing = modules - set(ZOO) - set(UNBUILDABLE) - HELPERS
    assert not missing, f"no zoo config for {sorted(missing)}"
    assert not (set(ZOO) - modules), "zoo entries for modules mlx-lm no longer has"


@pytest.mark.parametrize("name", sorted(ZOO))
def test_architecture_is_exact_or_refused(name):
    install_import_stubs()
    r = check_one(name, max_tokens=30)
    if name in REFUSED:
        assert r["status"] == "refused", r
        assert REFUSED[name] in r["refused"]
        return
    assert r["status"] != "refused", r.get("refused")
    assert not r.get("errors"), r["errors"]
    assert all(v is True for v in r["spec_eq_plain"].values()), r["spec_eq_plain"]
    assert r["plain_eq_full"] is True
    assert all(v == 1.0 for v in r["self_acceptance"].values()), r["self_acceptance"]
    assert r["plain_eq_stock"] is (name not in STOCK_INCONSISTENT)
