#!/usr/bin/env python
"""A draft model in a batch: one forward per draft step for every row, against one forward per row and step.

Four prompts decoded together by the engine (``Engine``: one target forward per block for all rows), greedy,
a fixed draft length, the bundled SmolLM2-135M-Instruct as the target (float32 on a CPU, the system OpenBLAS
preloaded as ``specdec`` does). Two draft models, each loaded apart from the target:

- ``self``: the bundled model itself (every draft accepted: the draft model's cost at its largest);
- ``first-N``: its first N decoder layers (a cheap, often wrong drafter);
- ``mtp``: the bundled MTP head (through the session layer, as ``generate --prompts-file`` runs it);
- ``dflash``: a DFlash drafter shaped for the bundled model (``--dflash-layers`` layers, random weights:
  its drafts are almost never accepted, so this measures what drafting costs, every block drafting k),
  through the session layer too (``DFlashBatch``: one block forward of 4 rows, against one per row).

For each, side by side and alternately (``--repeats`` times after one untimed run of each): the rows'
drafters drafting together (``DraftBatch``: max(k) forwards of 4 rows per block) and each alone (sum(k)
forwards of one row), aggregate decode tok/s (prefill excluded), the medians' ratio, and whether every
row's text is the same both ways.

With ``--p-min P`` every drafter stops at its first draft below P (``--draft-p-min``): drafting alone,
each row reads its probabilities in a host sync per draft; together, one sync per step serves every row.

Usage: python scripts/bench_batch_draft.py [--repeats 3] [--k 4] [--p-min 0.5] [--dflash-layers 2] [--only dflash,mtp] [--out bench-results/batch-draft.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec_cli.model import blas  # noqa: E402

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "List five tips for learning a new language, with one sentence each.",
    "What are the main differences between a lake and a pond?",
]


def run(target, draft, prompts, k: int, max_tokens: int, together: bool,
        p_min: float = 0.0) -> tuple[float, list[list[int]], float]:
    """Decode ``prompts`` as one batch; returns aggregate decode tok/s, each row's tokens, and acceptance."""
    import mlx.core as mx

    from specdec_cli.core.adaptive import FixedLength
    from specdec_cli.cache.caches import ModelCache
    from specdec_cli.drafters import ModelDrafter
    from specdec_cli.drafters.model_batch import DraftBatch
    from specdec_cli.loop.engine import Engine, Row

    fits = DraftBatch.fits
    if not together:
        DraftBatch.fits = staticmethod(lambda drafter: False)
    try:
        engine = Engine(target, rollback="capture")
        rows, out = [], {}
        for i, ids in enumerate(prompts):
            cache = ModelCache(target)
            cache.prefill(ids[:-1])
            d = ModelDrafter(draft, p_min=p_min)
            d.prefill(ids[:-1])
            mx.eval(cache.state_arrays(), d.cache.state_arrays())
            rows.append(engine.admit(Row(ids[-1], d, FixedLength(k), max_tokens=max_tokens, tag=i), cache))
            out[i] = []
        t0 = time.perf_counter()
        while engine.rows:
            for r, b in engine.step():
                out[r.tag] += b.tokens
            for r in [r for r in engine.rows if r.finish is not None or r.room <= 0]:
                engine.remove(r)
        seconds = time.perf_counter() - t0
    finally:
        DraftBatch.fits = fits
    drafted = sum(r.drafted for r in rows)
    accepted = sum(r.accepted for r in rows)
    return sum(map(len, out.values())) / seconds, [out[i] for i in range(len(prompts))], accepted / max(drafted, 1)


def run_session(session, prompts, max_tokens: int, together: bool) -> tuple[float, list[list[int]], float]:
    """The same through the session layer (``generate --prompts-file``'s path): an MTP head, a DFlash drafter."""
    from specdec_cli.loop import engine
    from specdec_cli.loop.events import Step
    from specdec_cli.session import Request
    from specdec_cli.session.batch import BatchEnd, run_batch

    if not together:
        engine.GROUP_DRAFTS = False
    try:
        out = {i: [] for i in range(len(prompts))}
        drafted = accepted = 0
        for ev in run_batch(session, [Request(p, max_tokens) for p in prompts], max_rows=len(prompts), planner=False):
            if isinstance(ev, BatchEnd):
                seconds = ev.decode_s
            elif isinstance(ev.event, Step):
                out[ev.index] += ev.event.block.tokens
                drafted += ev.event.block.drafted
                accepted += ev.event.block.accepted
    finally:
        engine.GROUP_DRAFTS = True
    return sum(map(len, out.values())) / seconds, [out[i] for i in range(len(prompts))], accepted / max(drafted, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--layers", type=int, default=8, help="decoder layers of the first-N draft model")
    parser.add_argument("--p-min", type=float, default=0.0, help="--draft-p-min of every drafter")
    parser.add_argument("--dflash-layers", type=int, default=2, help="layers of the random DFlash drafter")
    parser.add_argument("--only", default=None, help="comma-separated drafters to run (default: all)")
    parser.add_argument("--out", default="bench-results/batch-draft.json")
    args = parser.parse_args()
    blas.maybe_reexec()  # the system OpenBLAS, as specdec itself does

    from specdec_cli.model import bundled
    from specdec_cli.model.files import resolve_dtype
    from specdec_cli.session.loading import load as load_files

    def load(path):
        return load_files(path, resolve_dtype("auto"))

    target = load(str(bundled.model_dir()))
    tok = target.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS]
    cut = load(str(bundled.model_dir())).model
    cut.model.layers = cut.model.layers[: args.layers]
    drafts = {"self": load(str(bundled.model_dir())).model, f"first-{args.layers}": cut}

    from specdec_cli.session import ModelOptions, Session, load_setup

    import tempfile

    from specdec_cli.model.files import read_config
    from specdec_cli.session.synthetic import dflash_config, save_dflash_dir

    wanted = set(args.only.split(",")) if args.only else {"self", f"first-{args.layers}", "mtp", "dflash"}
    scratch = tempfile.TemporaryDirectory()
    sessions = {}
    if "mtp" in wanted:
        sessions["mtp"] = Session(load_setup(ModelOptions(dtype="auto", draft_p_min=args.p_min or None), "mtp"),
                                  args.k + 1, adaptive=False)
    if "dflash" in wanted:
        tcfg = read_config(bundled.model_dir())
        heads, kv_heads = tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
        dcfg = dflash_config(tcfg, layers=args.dflash_layers, block_size=args.k + 1, heads=(heads, kv_heads),
                             head_dim=tcfg["hidden_size"] // heads, intermediate_size=tcfg["intermediate_size"])
        dflash_dir = save_dflash_dir(Path(scratch.name) / "dflash", dcfg, seed=0)
        sessions["dflash"] = Session(load_setup(ModelOptions(dtype="auto", draft_model=str(dflash_dir),
                                                             draft_p_min=args.p_min or None), "dflash"),
                                     args.k + 1, adaptive=False)

    def case(draft):
        if draft in sessions:
            return lambda together: run_session(sessions[draft], prompts, args.max_tokens, together)
        return lambda together: run(target.model, draft, prompts, args.k, args.max_tokens, together, args.p_min)

    drafts.update({name: name for name in sessions})
    drafts = {name: d for name, d in drafts.items() if name in wanted}
    results = {}
    for name, draft in drafts.items():
        runs = {"together": [], "alone": []}
        texts = {}
        for rep in range(args.repeats + 1):
            for mode in ("together", "alone"):
                tps, tokens, acc = case(draft)(mode == "together")
                texts[mode], results_acc = tokens, acc
                if rep:
                    runs[mode].append(tps)
        together, alone = statistics.median(runs["together"]), statistics.median(runs["alone"])
        results[name] = {"together_tok_s": round(together, 2), "alone_tok_s": round(alone, 2),
                         "ratio": round(together / alone, 3), "runs": runs, "acceptance": round(results_acc, 3),
                         "texts_equal": texts["together"] == texts["alone"]}
        print(f"{name:>9}: drafting together {together:6.1f} tok/s, alone {alone:6.1f} tok/s -> "
              f"{together / alone:.2f}x (acceptance {results_acc:.0%}, texts equal: {results[name]['texts_equal']})")
    meta = {"machine": platform.platform(), "processor": platform.processor() or platform.machine(),
            "blas": os.environ.get("LD_PRELOAD") or "bundled reference BLAS", "rows": len(PROMPTS), "k": args.k, "p_min": args.p_min,
            "max_tokens": args.max_tokens, "repeats": args.repeats, "model": "bundled SmolLM2-135M-Instruct"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
