"""The engine layer every face shares: load once, then generate request after request.

``generate``, ``chat`` and ``serve`` build one :class:`Session` (models, drafter
kind, prompt cache) and hand it :class:`Request` objects; the session runs each
through the engine and keeps the caches between them. Nothing here prints
tokens or knows about terminals or HTTP.
"""

from .generate import PREFILL_CHUNK_S, Request, Session
from .options import (
    ModelOptions,
    check_block_size,
    check_drafter_options,
    check_force_download,
    check_model_options,
    make_policy,
    resolve_block_size,
    resolve_drafter,
    sampling_params,
)
from .prompt_cache import Entry, Hit, PromptCache
from .setup import MemoryLimitError, PromptTooLongError, Setup, choose_drafter, load_setup, load_target, blas_note
from .state import SavedCache

__all__ = [
    "PREFILL_CHUNK_S", "Entry", "Hit", "MemoryLimitError", "ModelOptions", "PromptCache", "PromptTooLongError",
    "Request", "SavedCache", "Session", "Setup", "check_block_size", "check_drafter_options", "check_force_download", "check_model_options",
    "choose_drafter", "load_setup", "load_target", "make_policy", "blas_note", "resolve_block_size", "resolve_drafter",
    "sampling_params",
]
