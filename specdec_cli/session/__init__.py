"""The engine layer every face shares: load once, then generate request after request.

``generate``, ``chat`` and ``serve`` build one :class:`Session` (models, drafter
kind, prompt cache) and hand it :class:`Request` objects; the session runs each
through the engine and keeps the caches between them. Nothing here prints
tokens or knows about terminals or HTTP.
"""

from .corpus import Corpus
from .generate import PREFILL_CHUNK_S, Request, Session
from .options import (
    ModelOptions,
    RunOptions,
    check_block_size,
    check_distributed_options,
    check_drafter_options,
    check_force_download,
    check_model_options,
    make_policy,
    parse_int_list,
    processor_fields,
    resolve_block_size,
    resolve_drafter,
    sampling_params,
)
from .prompt_cache import Entry, Hit, PromptCache
from .setup import (
    MemoryLimitError,
    PromptTooLongError,
    Setup,
    blas_note,
    choose_drafter,
    join_ranks,
    load_setup,
    load_target,
    single_process,
)
from .state import SavedCache

__all__ = [
    "Corpus",
    "PREFILL_CHUNK_S", "Entry", "Hit", "MemoryLimitError", "ModelOptions", "PromptCache", "PromptTooLongError", "RunOptions",
    "Request", "SavedCache", "Session", "Setup", "blas_note", "check_block_size", "check_distributed_options",
    "check_drafter_options", "check_force_download", "check_model_options", "choose_drafter", "join_ranks",
    "load_setup", "load_target", "make_policy", "parse_int_list", "processor_fields", "resolve_block_size", "resolve_drafter", "sampling_params",
    "single_process",
]
