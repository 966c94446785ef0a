"""One request builder for every face: a prompt's ids fitted to the model's context and the device's memory.

``generate``, ``chat``, ``--prompts-file`` and the server each encode their own
input (a text, a conversation, a file's lines, an API body); from the ids on
they share this: the prompt refused where it fills the context, generation
capped at what the context leaves (or, for a request that sets no limit, at
what memory holds of it), the memory checked, and the :class:`Request` made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..cache.limits import MemoryEstimate
from ..core.request import Request
from .setup import MemoryLimitError, Setup

# What a request that sets no limit asks for before the context and the memory cut it.
NO_LIMIT = 2**62


@dataclass(frozen=True)
class Fitted:
    """A request fitted to the model.

    Attributes:
        request: The request, its ``max_tokens`` capped.
        context: The model's context length (None: unknown).
        estimate: The memory it needs (None: not checked here: a batch checks its rows together).
        capped: The context cut the tokens asked for.
    """

    request: Request
    context: Optional[int]
    estimate: Optional[MemoryEstimate]
    capped: bool


def fit_request(setup: Setup, ids: Sequence[int], max_tokens: Optional[int], *, memory: bool = True,
                **fields) -> Fitted:
    """The :class:`Request` for ``ids``, fitted to ``setup``'s model and device.

    Args:
        setup: The loaded models.
        ids: The prompt's token ids.
        max_tokens: Most tokens to generate; None: the rest of the context, as much of it as memory holds.
        memory: Check the device's memory for this request alone.
        **fields: The request's other fields (sampling, seed, boundaries, processors, ...).

    Raises:
        PromptTooLongError: The prompt alone fills the context.
        MemoryLimitError: The device cannot hold the prompt and the tokens asked for (``memory``).
    """
    unbounded = max_tokens is None
    most, context = setup.fit_context(len(ids), NO_LIMIT if unbounded else max_tokens)
    if unbounded and context is None:
        raise ValueError("no limit on the tokens and no context known: give max_tokens")
    estimate = None
    if memory:
        if unbounded:
            most = _memory_holds(setup, len(ids), most)
        estimate = setup.check_memory(len(ids) + most)
    return Fitted(Request(list(ids), most, **fields), context, estimate, not unbounded and most < max_tokens)


def _memory_holds(setup: Setup, prompt: int, most: int) -> int:
    """The most of ``most`` tokens that fit the device's memory after the prompt (at least 1)."""
    low, high = 1, most
    while low < high:  # the estimate grows with the tokens: bisect for the largest that fits
        mid = (low + high + 1) // 2
        try:
            setup.check_memory(prompt + mid)
            low = mid
        except MemoryLimitError:
            high = mid - 1
    return low


__all__ = ["Fitted", "fit_request"]
