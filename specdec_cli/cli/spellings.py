"""mlx_lm's command-line spellings that specdec takes otherwise or not at all, and what to say instead.

A command line carried over from ``mlx_lm.generate`` must fail in one line naming the fix, never run on a
value Typer took as the prompt.
"""

from __future__ import annotations

import re
from typing import Optional


# mlx_lm's options that specdec does not take, and what to do instead (in words that hold for every command):
# a command line carried over from mlx_lm otherwise got "No such option" and a list of look-alike names.
MLX_LM_ONLY = {
    "--max-kv-size": "its rotating cache cannot be rolled back past a rejected draft; drop it (--kv-bits "
                     "shrinks the cache, and a run that would not fit is refused before it starts)",
    "--quantized-kv-start": "--kv-bits quantizes the KV cache from the first token; drop it",
    "--xtc-probability": "XTC sampling is not supported; drop it",
    "--xtc-threshold": "XTC sampling is not supported; drop it",
    "--min-tokens-to-keep": "drop it",
    "--prompt-cache-file": "drop it: the prompt cache is kept on disk by itself",
    "--use-default-chat-template": "drop it: the tokenizer's own chat template is applied",
    "--image": "images are not supported; drop it",
    "--quantize-activations": "drop it",
}


# A token as a vocabulary spells a special one (<|im_end|>, </s>, <end_of_turn>), or an id.
_TOKEN_LIKE = re.compile(r"<[^<>\s]+>|\d+")


def mlx_lm_spelling(args: list) -> Optional[str]:
    """The error for an mlx_lm spelling that would run wrongly here (None: none found).

    mlx_lm's ``--verbose False`` and ``--extra-eos-token A B`` leave a value that Typer takes as the
    PROMPT argument: generate answered the prompt "False" or "B" (or, with -p, said "give the prompt once").
    """
    if not args or args[0] not in ("generate", "sweep", "chat", "serve"):
        return None
    for i, arg in enumerate(args):
        if arg == "--":
            return None
        after = args[i + 1] if i + 1 < len(args) else None
        if args[0] == "generate" and arg == "--verbose" and after and after.lower() in ("true", "false", "t", "f"):
            return (f"--verbose takes no value here (mlx_lm's --verbose {after}): the statistics always go to "
                    "stderr, so 2>/dev/null leaves the text alone; --verbose alone also times each phase")
        value_at = i + 1 if arg == "--extra-eos-token" else i if arg.startswith("--extra-eos-token=") else None
        if value_at is not None and value_at + 1 < len(args) and _TOKEN_LIKE.fullmatch(args[value_at + 1]):
            first, second = args[value_at].removeprefix("--extra-eos-token="), args[value_at + 1]
            return (f"--extra-eos-token takes one token (mlx_lm's --extra-eos-token {first} {second}): repeat it, "
                    f"--extra-eos-token {first} --extra-eos-token {second}")
    return None
