"""The ``specdec`` console script: Ctrl-C while the command line's modules load (a second or so: MLX, mlx-lm,
Typer) exits as Ctrl-C does later, quietly with 130, not with a traceback of an import."""

from __future__ import annotations

import os
import sys

from ..errors import EXIT_INTERRUPTED


def _reopen_closed_streams() -> None:
    """Put /dev/null on a standard stream the caller closed (``<&-``, ``>&-``, some service managers).

    A closed fd 0 went to the next file opened, and MLX will not read weights from fd 0: the run failed with
    "cannot read the weights ... download again". A closed stdout left ``sys.stdout`` None: a traceback.
    """
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free fd: this one, as the lower ones are open
            if getattr(sys, name) is None:
                setattr(sys, name, open(fd, mode, closefd=False))


def main() -> None:
    _reopen_closed_streams()
    try:
        from .app import main as run
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
    run()


if __name__ == "__main__":  # `python -m specdec_cli.cli.entry ...` ran nothing and exited 0 without this
    main()
