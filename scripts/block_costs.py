#!/usr/bin/env python
"""Where a block's time goes, against a plain decoding step's, on this backend (issue 59).

On an H200 (bf16, open prompts) a speculative block cost 7.4-13 ms where plain decoding took 4.1-6.3 ms a
token, and most blocks drafted nothing. This splits each loop's time, in one process, warm, into:

- build: the host constructing the target's forward (the model's ``__call__``: lazy, nothing computed);
- queue: inside ``mx.async_eval`` (the host handing the graph to the device: on a GPU, launching its kernels);
- wait: inside ``mx.eval`` (waiting for the device, or, on a CPU, computing; a read like ``.item()`` waits
  outside it, in "other");
- draft: the drafter's ``propose`` (host lookups; a draft model's own forwards);
- other: the rest (the loop's own host work; a read like ``.item()`` waits for the device here too).

Loops: mlx-lm's ``generate_step`` (the peer), specdec's plain decoding, and specdec's blocks with prompt
lookup (the default drafter) and with a drafter that never drafts (every block an open prompt's worst case),
each with blocks without drafts pipelined and not (and pipelined with the block's pick sent to the device only
as the next forward's input, as before ``engine.PICK_FIRST``; and lookup pipelined ahead of blocks that may draft
too, as before the drafter was asked: ``engine.PIPELINE_ALWAYS``). Milliseconds per emitted token and per block;
the model's forwards and MLX's evals (``eval`` and ``async_eval``) per block.

  python scripts/block_costs.py [--dtype bfloat16] [--prompt open] [--tokens 256] [--repeats 3] [--json OUT]
                                [--loops lookup,lookup-pipelined,...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

if __name__ == "__main__":
    from specdec_cli.model.blas import maybe_reexec

    maybe_reexec()  # the BLAS the CLI runs on, before MLX loads

import mlx.core as mx  # noqa: E402

BUCKETS = ("build", "queue", "wait", "draft")


class Clock:
    """Seconds spent in each bucket while :meth:`on` is active (nested buckets count once, in the outer)."""

    def __init__(self):
        self.spent = dict.fromkeys(BUCKETS, 0.0)
        self.calls = dict.fromkeys(BUCKETS, 0)
        self._inside = False

    def timed(self, bucket: str, fn):
        def call(*args, **kwargs):
            if self._inside:
                return fn(*args, **kwargs)
            self._inside = True
            self.calls[bucket] += 1
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[bucket] += time.perf_counter() - t
                self._inside = False
        return call


@contextmanager
def patched(clock: Clock, model, drafter_classes):
    """The model's forward, MLX's evals and the drafters' proposals timed into ``clock``."""
    saved = [(mx, "eval", mx.eval), (mx, "async_eval", mx.async_eval), (type(model), "__call__", type(model).__call__)]
    saved += [(cls, "propose", cls.propose) for cls in drafter_classes]
    mx.eval, mx.async_eval = clock.timed("wait", mx.eval), clock.timed("queue", mx.async_eval)
    type(model).__call__ = clock.timed("build", type(model).__call__)
    for cls in drafter_classes:
        cls.propose = clock.timed("draft", cls.propose)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt", default="open", help="a prompt name of scripts/gpu_matrix.py")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--loops", default="", help="only these (comma-separated): peer, plain, none, none-pipelined, "
                    "none-pick-late, lookup, lookup-pipelined, lookup-pick-late, lookup-always")
    args = ap.parse_args()

    from gpu_matrix import PROMPTS
    from mlx_lm.generate import generate_step

    from specdec_cli.cache.caches import ModelCache
    from specdec_cli.core.numerics import Numerics
    import specdec_cli
    from specdec_cli.core.adaptive import MatchLength
    from specdec_cli.drafters import no_draft
    from specdec_cli.drafters.suffix import SuffixDrafter
    from specdec_cli.loop import engine
    from specdec_cli.loop.engine import speculative_generate_step
    from specdec_cli.loop.plain import plain_generate_step
    from specdec_cli.model.bundled import NAME
    from specdec_cli.session import ModelOptions, load_setup

    setup = load_setup(ModelOptions(model=args.model or str(Path(specdec_cli.__file__).parent / "models" / NAME), dtype=args.dtype), "lookup")
    model, tok = setup.target.model, setup.target.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[args.prompt]}], add_generation_prompt=True)
    n = args.tokens

    class Nothing:
        """Never drafts: every block is one forward of one token (an open prompt where lookup finds nothing)."""
        name, taps = "nothing", None

        def prefill(self, tokens, step_size=512, hidden=None):
            pass

        def propose(self, last, k, params=None):
            return no_draft()

        def accept(self, n, hidden=None):
            pass

        def cancel(self):
            pass

        def may_draft(self, k):
            return False

    def prefilled() -> ModelCache:
        cache = ModelCache(model)
        cache.prefill(ids[:-1])
        mx.eval(cache.state_arrays())
        return cache

    def peer():
        cache = prefilled()
        out = 0
        for _ in generate_step(mx.array(ids[-1:]), model, max_tokens=n, prompt_cache=cache.layers):
            out += 1
        return out, out

    def plain():
        out = 0
        for block in plain_generate_step(ids[-1], prefilled(), max_tokens=n):
            out += len(block.tokens)
        return out, out

    def blocks(drafter_cls, pipeline, pick_first=True, always=False):
        def run():
            engine.PICK_FIRST, engine.PIPELINE_ALWAYS = pick_first, always
            policy = MatchLength(k_max=64)  # the default drafter's: prompt lookup, sized by the match
            drafter = SuffixDrafter(policy.size) if drafter_cls is SuffixDrafter else drafter_cls()
            drafter.prefill(ids[:-1])
            out = count = 0
            for block in speculative_generate_step(ids[-1], prefilled(), drafter, policy=policy, max_tokens=n,
                                                   numerics=Numerics(pipeline=pipeline)):
                out += len(block.tokens)
                count += 1
            engine.PICK_FIRST, engine.PIPELINE_ALWAYS = True, False
            return out, count
        return run

    loops = {"mlx_lm generate_step": ("peer", peer), "specdec plain": ("plain", plain),
             "blocks, nothing drafted": ("none", blocks(Nothing, False)),
             "blocks, nothing drafted, pipelined": ("none-pipelined", blocks(Nothing, True)),
             "blocks, nothing drafted, pipelined, pick in the next forward":
                 ("none-pick-late", blocks(Nothing, True, pick_first=False)),
             "blocks, lookup": ("lookup", blocks(SuffixDrafter, False)),
             "blocks, lookup, pipelined": ("lookup-pipelined", blocks(SuffixDrafter, True)),
             "blocks, lookup, pipelined, pick in the next forward":
                 ("lookup-pick-late", blocks(SuffixDrafter, True, pick_first=False)),
             "blocks, lookup, pipelined ahead of drafts too": ("lookup-always", blocks(SuffixDrafter, True, always=True))}
    shorts = [short for short, _ in loops.values()]
    wanted = set(args.loops.split(",")) if args.loops else set(shorts)
    if wanted - set(shorts):
        sys.exit(f"unknown --loops {sorted(wanted - set(shorts))}: choose from {shorts}")
    loops = {name: run for name, (short, run) in loops.items() if short in wanted}
    rows = {name: [] for name in loops}
    for name, loop in loops.items():  # warm: every shape compiled, every kernel loaded
        loop()
    for r in range(args.repeats):
        for name, loop in (loops.items() if r % 2 == 0 else reversed(loops.items())):
            clock = Clock()
            with patched(clock, model, (Nothing, SuffixDrafter)):
                t = time.perf_counter()
                tokens, count = loop()
                total = time.perf_counter() - t
            rows[name].append({"total": total, "tokens": tokens, "blocks": count, **clock.spent,
                               "calls": dict(clock.calls)})
    print(f"{mx.default_device()}, {args.dtype}, prompt {args.prompt!r}, {n} tokens, median of {args.repeats}")
    print("| loop | ms/token | ms/block | build | queue | wait | draft | other (ms/block) | tokens/block | "
          "forwards, async_evals, evals /block |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for name, runs in rows.items():
        runs.sort(key=lambda x: x["total"])
        m = runs[len(runs) // 2]
        per = {k: 1e3 * m[k] / m["blocks"] for k in ("total", *BUCKETS)}
        per["other"] = per["total"] - sum(per[k] for k in BUCKETS)
        summary[name] = {**m, "per_block_ms": per}
        print(f"| {name} | {1e3 * m['total'] / m['tokens']:.2f} | {per['total']:.2f} | {per['build']:.2f} | "
              f"{per['queue']:.2f} | {per['wait']:.2f} | {per['draft']:.2f} | {per['other']:.2f} | "
              f"{m['tokens'] / m['blocks']:.2f} | {m['calls']['build'] / m['blocks']:.2f}, "
              f"{m['calls']['queue'] / m['blocks']:.2f}, {m['calls']['wait'] / m['blocks']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(mx.default_device()), "dtype": args.dtype,
                                               "prompt": args.prompt, "tokens": n, "loops": summary}, indent=1))


if __name__ == "__main__":
    main()
