"""Option limits and defaults the CLI declares before MLX is imported (no heavy imports here)."""

DRAFTER_KINDS = ("model", "lookup", "ngram", "mtp", "auto")
# Per drafter kind: the block size when none is given, and the largest
# accepted. Lookup drafts cost nothing and are sized by their match, so its
# blocks may be long; a model drafter pays a forward per draft.
# "auto" is only checked against the largest; the kind it picks then applies its own.
# "lookup+mtp" (what auto picks when an MTP head is at hand): lookup's blocks, head drafts of at most 3.
DEFAULT_BLOCK_SIZE = {"model": 4, "lookup": 64, "ngram": 4, "mtp": 4, "lookup+mtp": 64, "auto": 4}
MAX_BLOCK_SIZE = {"model": 32, "lookup": 64, "ngram": 64, "mtp": 32, "lookup+mtp": 64, "auto": 64}
NGRAM_MAX, NGRAM_MIN = 4, 2
# --kv-group-size when --kv-bits is given without it (mlx-lm's default).
DEFAULT_KV_GROUP_SIZE = 64
# The CLI's range for --block-size (each drafter kind then has its own limit above).
MAX_ANY_BLOCK_SIZE = max(MAX_BLOCK_SIZE.values())
MAX_NGRAM = MAX_ANY_BLOCK_SIZE

# generate --prompts-file: rows decoded together when --decode-concurrency is not given (fewer prompts: all).
DEFAULT_DECODE_CONCURRENCY = 8

# specdec distill's defaults (the CLI, the command's options and the trainer read them here).
DISTILL = {"data_tokens": 40_000, "steps": 400, "batch_size": 8, "seq_len": 128, "lr": 1e-3, "depth": 3,
           "draft_vocab": 8192, "seed": 0}

__all__ = ["DISTILL", "DEFAULT_BLOCK_SIZE", "DEFAULT_DECODE_CONCURRENCY", "DEFAULT_KV_GROUP_SIZE", "DRAFTER_KINDS", "MAX_ANY_BLOCK_SIZE", "MAX_BLOCK_SIZE", "MAX_NGRAM",
           "NGRAM_MAX", "NGRAM_MIN"]
