"""Option limits and defaults the CLI declares before MLX is imported (no heavy imports here).

The drafter kinds and their block sizes are :mod:`specdec_cli.drafters.kinds`' (light too)."""


# The n-gram drafter's default match lengths (--ngram-max, --ngram-min).
NGRAM_MAX, NGRAM_MIN = 4, 2
# --kv-group-size when --kv-bits is given without it (mlx-lm's default).
DEFAULT_KV_GROUP_SIZE = 64
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

__all__ = ["AUTO_ROWS", "DEFAULT_DECODE_CONCURRENCY", "DEFAULT_KV_GROUP_SIZE", "DISTILL", "KNEE_GAIN", "MAX_DISK_GB",
           "NGRAM_MAX", "NGRAM_MIN"]
