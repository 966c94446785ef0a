"""Errors the command line shows as one line, without a traceback, and the exit codes the commands return."""

# --compare-ar found a token plain decoding would not have given (README "Limits and errors").
EXIT_DIVERGED = 3
# Ctrl-C: 128 + SIGINT, as shells report it.
EXIT_INTERRUPTED = 130


class SpecdecError(Exception):
    """An expected failure: its message says what went wrong and how to fix it."""

    exit_code = 1
    # Under mlx.launch, raised alike on every rank (same options, same files:
    # the ranks agree on both first), so rank 0 alone says it.
    every_rank = False


class UnsupportedModelError(SpecdecError):
    """The model's caches cannot be rolled back exactly, or mlx-lm cannot load it."""

    every_rank = True


class ModelLoadError(SpecdecError):
    """A model or tokenizer could not be found, downloaded or read."""


class AdapterError(ModelLoadError):
    """``--adapter-path`` is not adapters mlx_lm.lora wrote for this model (the user's, never the model's)."""


class TokenizerMismatchError(SpecdecError):
    """Target and drafter do not share a tokenizer."""

    every_rank = True


class OptionError(SpecdecError):
    """A bad option or option combination."""

    exit_code = 2
    every_rank = True


class Cancelled(Exception):
    """A generation was cancelled from outside (a client went away); not an error to report."""


class Terminated(KeyboardInterrupt):
    """SIGTERM: Ctrl-C's path (the text so far, the summary, exit 130), where nothing goes on after it (a chat ends)."""
