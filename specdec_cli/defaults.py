"""Option limits and defaults the CLI declares before MLX is imported (no heavy imports here), and the
registry of drafter kinds."""

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DrafterKind:
    """One drafter kind: what the options, the policy and the loaders need to know of it.

    Attributes:
        name: ``--drafter``'s word (or the name ``auto``'s pick is reported under).
        default_block: The block size when none is given (None: the drafter's own, known once loaded).
        max_block: The largest accepted (None: likewise).
        draft_model: Reads ``--draft-model`` (a draft model, an MTP head, a DFlash drafter).
        hidden_states: Reads the target's hidden states (pipeline parallelism keeps them on one rank).
        head: Drafts with an MTP head (the target's own, a sidecar, or the bundled one).
        p_min: Understands ``--draft-p-min`` (it has probabilities to stop on).
        policy: Its adaptive draft length: ``match-length`` (sized by the lookup match),
            ``hybrid`` (lookup, or the head where nothing matches) or ``acceptance``.
        choice: Offered by ``--drafter`` (the others are what ``auto`` or a checkpoint picks).
    """

    name: str
    default_block: Optional[int]
    max_block: Optional[int]
    draft_model: bool = False
    hidden_states: bool = False
    head: bool = False
    p_min: bool = False
    policy: str = "acceptance"
    choice: bool = True


# The one registry of drafter kinds. Lookup drafts cost nothing and are sized by their match, so
# its blocks may be long; a model drafter pays a forward per draft. "auto" is only checked against
# its largest; the kind it picks then applies its own. "lookup+mtp" (auto's pick when an MTP head
# is at hand): lookup's blocks, head drafts of at most 3. A DFlash drafter's sizes are its config's.
DRAFTERS = {k.name: k for k in (
    DrafterKind("model", 4, 32, draft_model=True, p_min=True),
    DrafterKind("lookup", 64, 64, policy="match-length"),
    DrafterKind("ngram", 4, 64),
    DrafterKind("mtp", 4, 32, draft_model=True, hidden_states=True, head=True, p_min=True),
    DrafterKind("lookup+mtp", 64, 64, hidden_states=True, head=True, p_min=True, policy="hybrid", choice=False),
    DrafterKind("auto", 4, 64, draft_model=True, p_min=True),
    DrafterKind("dflash", None, None, draft_model=True, hidden_states=True, p_min=True, choice=False),
)}
DRAFTER_KINDS = tuple(name for name, k in DRAFTERS.items() if k.choice)
DEFAULT_BLOCK_SIZE = {name: k.default_block for name, k in DRAFTERS.items() if k.max_block is not None}
MAX_BLOCK_SIZE = {name: k.max_block for name, k in DRAFTERS.items() if k.max_block is not None}
HIDDEN_STATE_DRAFTERS = tuple(name for name, k in DRAFTERS.items() if k.hidden_states)
NGRAM_MAX, NGRAM_MIN = 4, 2
# --kv-group-size when --kv-bits is given without it (mlx-lm's default).
DEFAULT_KV_GROUP_SIZE = 64
# The CLI's range for --block-size (each drafter kind then has its own limit above).
MAX_ANY_BLOCK_SIZE = max(MAX_BLOCK_SIZE.values())
MAX_NGRAM = MAX_ANY_BLOCK_SIZE

# generate --prompts-file: rows decoded together when --decode-concurrency is not given (fewer prompts: all).
DEFAULT_DECODE_CONCURRENCY = 8
# serve's --decode-concurrency default (loop.batch_policy.knee): the row counts tried at start-up
# (mlx_lm.server decodes up to 32 together), and what doubling the rows must add to a one-token
# step's tokens per second.
AUTO_ROWS = (1, 2, 4, 8, 16, 32)
KNEE_GAIN = 0.1

# --prompt-cache-disk-gb's largest value (1 PiB: more than any disk; past about 1.7e299 GB the byte count
# is no longer a finite float).
MAX_DISK_GB = 1 << 20

# specdec distill's defaults (the CLI, the command's options and the trainer read them here).
DISTILL = {"data_tokens": 40_000, "steps": 400, "batch_size": 8, "seq_len": 128, "lr": 1e-3, "depth": 3,
           "draft_vocab": 8192, "seed": 0}

__all__ = ["AUTO_ROWS", "KNEE_GAIN", "DISTILL", "DEFAULT_BLOCK_SIZE", "DEFAULT_DECODE_CONCURRENCY", "DEFAULT_KV_GROUP_SIZE", "DRAFTERS",
           "DRAFTER_KINDS", "DrafterKind", "HIDDEN_STATE_DRAFTERS", "MAX_ANY_BLOCK_SIZE", "MAX_BLOCK_SIZE", "MAX_DISK_GB", "MAX_NGRAM",
           "NGRAM_MAX", "NGRAM_MIN"]
