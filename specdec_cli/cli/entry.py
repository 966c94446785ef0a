"""The ``specdec`` console script: Ctrl-C while the command line's modules load (a second or so: MLX, mlx-lm,
Typer) exits as Ctrl-C does later, quietly with 130, not with a traceback of an import."""

from __future__ import annotations

import sys

from ..errors import EXIT_INTERRUPTED


def main() -> None:
    try:
        from .app import main as run
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
    run()
