"""The architecture zoo's test, shared by tests/loop/test_zoo_1.py, test_zoo_2.py and test_zoo_3.py.

Every mlx-lm architecture either runs exactly or is refused before the first token: one tiny
random-weight model per architecture (tests/zoo_configs.py) goes through the checks of
tests/zoo_check.py. The zoo is one test per architecture, split over three files by name so that
pytest-xdist (``--dist loadfile``, a whole file on one worker) can run the parts side by side; each
part took 84-90 s of the 263 s the whole zoo took alone on the project's 2-core machine.

tests/conftest.py registers this module for pytest's assertion rewriting, so a failing check
reports as it would written in the test file.
"""

from __future__ import annotations

from zoo_check import check_one
from zoo_configs import ZOO, install_import_stubs

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

# Where parts 2 and 3 start, by lower-cased name: part 1 is a-gemma*, 2 glm-mellum, 3 mimo-z.
# Ranges, so that a new architecture lands in a part by itself.
BOUNDS = ("gl", "mi")


def part(number: int) -> list[str]:
    """The ZOO names of part ``number`` (1, 2 or 3), in the order of ``sorted(ZOO)``."""
    edges = ("", *BOUNDS, None)
    lo, hi = edges[number - 1], edges[number]
    return [name for name in sorted(ZOO)
            if lo <= name.lower() and (hi is None or name.lower() < hi)]


def check_architecture(name: str) -> None:
    """Architecture ``name`` is exact (every check of zoo_check.check_one) or refused as it must be."""
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
