"""Every mlx-lm architecture either runs exactly or is refused before the first token (part 3 of 3).

The architectures are split over test_zoo_1.py, test_zoo_2.py and test_zoo_3.py by name
(tests/zoo_parts.py, which holds the test's assertions); this part is mimo-z. See test_zoo_1.py.
"""

from __future__ import annotations

import pytest
from zoo_parts import check_architecture, part


@pytest.mark.parametrize("name", part(3))
def test_architecture_is_exact_or_refused(name):
    check_architecture(name)
