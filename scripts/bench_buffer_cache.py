#!/usr/bin/env python
"""MLX's buffer cache over a long generation: mlx-lm's generate_step against specdec's loop, in one process.

A KV cache grows by reallocating; each smaller buffer it leaves goes to MLX's buffer cache and is never
asked for again. mlx-lm empties that cache every 256 tokens; specdec's loops do too (engine.CLEAR_EVERY).
This prints MLX's cached and active memory (MiB) every ``--every`` tokens of each loop (greedy, the default
lookup drafter for specdec, and specdec again with the cache never emptied, as before the change), then each
loop's peak; ``--json`` keeps the readings.

  python scripts/bench_buffer_cache.py [--model DIR] [--dtype float32] [--tokens 600] [--every 150]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__":
    from specdec_cli.model.blas import maybe_reexec

    maybe_reexec()  # the BLAS the CLI runs on, before MLX loads

import mlx.core as mx  # noqa: E402

PROMPT = "Write a long story about a dragon and a knight, with many chapters."


def _mib(n: int) -> float:
    return round(n / 2**20, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--every", type=int, default=150)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from mlx_lm.generate import generate_step

    import specdec_cli
    from specdec_cli.loop import engine
    from specdec_cli.loop.events import Step
    from specdec_cli.loop.runner import run
    from specdec_cli.model.bundled import NAME
    from specdec_cli.session import ModelOptions, load_setup

    model_dir = args.model or str(Path(specdec_cli.__file__).parent / "models" / NAME)
    setup = load_setup(ModelOptions(model=model_dir, dtype=args.dtype), "lookup")
    model, tok = setup.target.model, setup.target.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    readings: dict[str, list] = {"mlx_lm": [], "specdec": [], "specdec, never emptied": []}

    def read(loop: str, n: int) -> None:
        row = {"tokens": n, "cache_mib": _mib(mx.get_cache_memory()), "active_mib": _mib(mx.get_active_memory())}
        readings[loop].append(row)
        print(loop, row, flush=True)

    def fresh() -> None:
        mx.clear_cache()
        mx.reset_peak_memory()

    fresh()
    for n, _ in enumerate(generate_step(mx.array(ids), model, max_tokens=args.tokens), 1):
        if n % args.every == 0:
            read("mlx_lm", n)
    peaks = {"mlx_lm": _mib(mx.get_peak_memory())}
    every = engine.CLEAR_EVERY
    for loop, engine.CLEAR_EVERY in (("specdec", every), ("specdec, never emptied", 2**62)):
        fresh()
        n = mark = 0
        for event in run(model, ids, drafter=setup.make_drafter(), max_tokens=args.tokens):
            if isinstance(event, Step):
                n += len(event.block.tokens)
                if n // args.every > mark:
                    mark = n // args.every
                    read(loop, n)
        peaks[loop] = _mib(mx.get_peak_memory())
    engine.CLEAR_EVERY = every
    print("peak MiB", peaks)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model_dir, "dtype": args.dtype, "device": str(mx.default_device()),
                                               "readings": readings, "peak_mib": peaks}, indent=1) + "\n")


if __name__ == "__main__":
    main()
