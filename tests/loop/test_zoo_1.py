"""Every mlx-lm architecture either runs exactly or is refused before the first token (part 1 of 3).

One tiny random-weight model per architecture (tests/zoo_configs.py) goes
through the checks of tests/zoo_check.py: speculative == plain for K = 1, 3, 8;
plain == mlx-lm's stock decoding and == one forward over the whole sequence;
drafter proposals equal to the draft model's own greedy continuation; full
acceptance with a drafter identical to the target.

The architectures are split over test_zoo_1.py, test_zoo_2.py and test_zoo_3.py by name
(tests/zoo_parts.py, which holds the test's assertions); this part is a-gemma*, with the check
that the zoo covers every mlx-lm architecture.
"""

from __future__ import annotations

import pkgutil

import mlx_lm.models
import pytest
from zoo_configs import UNBUILDABLE, ZOO
from zoo_parts import HELPERS, check_architecture, part


def test_the_zoo_covers_every_mlx_lm_architecture():
    # Fails when mlx-lm adds (or renames) an architecture: add a tiny config.
    modules = {m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__)}
    missing = modules - set(ZOO) - set(UNBUILDABLE) - HELPERS
    assert not missing, f"no zoo config for {sorted(missing)}"
    assert not (set(ZOO) - modules), "zoo entries for modules mlx-lm no longer has"


@pytest.mark.parametrize("name", part(1))
def test_architecture_is_exact_or_refused(name):
    check_architecture(name)
