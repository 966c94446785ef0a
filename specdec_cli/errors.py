"""Errors the command line shows as one line, without a traceback."""


class SpecdecError(Exception):
    """An expected failure: its message says what went wrong and how to fix it."""

    exit_code = 1


class UnsupportedModelError(SpecdecError):
    """The model's caches cannot be rolled back exactly, or mlx-lm cannot load it."""


class ModelLoadError(SpecdecError):
    """A model or tokenizer could not be found, downloaded or read."""


class TokenizerMismatchError(SpecdecError):
    """Target and drafter do not share a tokenizer."""


class OptionError(SpecdecError):
    """A bad option or option combination."""

    exit_code = 2


class Cancelled(Exception):
    """A generation was cancelled from outside (a client went away); not an error to report."""
