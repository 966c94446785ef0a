#!/usr/bin/env python
"""How a distilled MTP head's acceptance on unseen prompts grows with its training data, and what it must reach.

On the bundled SmolLM2-135M (float32, OpenBLAS), one corpus is built as
``specdec distill`` builds it (the model's answers to the built-in seed
prompts, at ``--temp``); heads are trained on its first N tokens for every N
of ``--sizes`` (same steps, same held-out split for keeping the best head),
and each is scored on prompts far from the seeds (the benchmark's explain,
QA and creative prompts and a few more):

- chained agreement: on the target's own greedy answer, the share of
  positions where the head's greedy chain drafts the next s tokens right;
  on greedy text that is exactly what speculative decoding accepts;
- the speedup those rates allow at K = 1..3 drafts per block, from costs
  measured in the same run: c(T) a target forward of T tokens with the
  hidden-state tap, d one chained head step (block = c(K+1) + K d);
- the per-token acceptance a (independent accepts) that 1.3x needs at each K.

    python scripts/distill_curve.py --sizes 15000,30000,60000 --out bench-results/distill-curve.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    from specdec_cli.model.blas import maybe_reexec

    maybe_reexec()

import mlx.core as mx

from specdec_cli.model import bundled
from specdec_cli.distill.data import answer_prompts, prompt_ids, seed_prompts, teacher_states
from specdec_cli.distill.pipeline import DistillOptions, load_corpus, make_result, save_corpus, split, write_head
from specdec_cli.distill.train import Trainer, TrainConfig, frequent_tokens, head_config, windows
from specdec_cli.cli.distill_command import EVAL_PROMPTS
from specdec_cli.drafters.history import tokenizer_fingerprint
from specdec_cli.drafters.mtp_head import MTPHead
from specdec_cli.drafters.mtp_io import load_head
from specdec_cli.model.files import read_config
from specdec_cli.session.loading import load
from specdec_cli.loop.events import collect
from specdec_cli.loop.runner import run
from specdec_cli.model.taps import target_parts

import bench  # noqa: E402  (this script's folder is first on sys.path)


UNSEEN = [bench.CATEGORIES[c] for c in ("explain_concept", "qa_factual", "creative_short")] + list(EVAL_PROMPTS) + [
    "Describe how a bicycle gear system works.",
    "Why do cats purr? Give a short answer.",
    "Write a haiku about autumn leaves.",
    "What causes the northern lights?",
]


def unseen_set(model, tokenizer, max_tokens: int):
    """Greedy answers to the unseen prompts: (tokens [1, L], states [1, L, H], prompt length) each."""
    eos = sorted(getattr(tokenizer, "eos_token_ids", ()) or ())
    out = []
    for p in UNSEEN:
        ids = prompt_ids(tokenizer, p)
        _, answer = collect(run(model, ids, max_tokens=max_tokens, eos_ids=eos))
        seq = ids + answer
        h = next(teacher_states(model, [seq]))
        out.append((mx.array(seq, dtype=mx.uint32)[None], h[None], len(ids)))
    return out


def corpus(model, tokenizer, tokens: int, temp: float, seed: int, folder: Path):
    key = {"curve": 1, "tokens": tokens, "temp": temp, "seed": seed, "tokenizer": tokenizer_fingerprint(tokenizer)}
    cached = load_corpus(folder, key)
    if cached is not None:
        timing = folder / "seconds.json"  # the build's time, kept beside the cache
        return cached[0], cached[1], json.loads(timing.read_text())["seconds"] if timing.is_file() else 0.0
    t = time.perf_counter()
    seqs: list[list[int]] = []
    for g in answer_prompts(model, tokenizer, seed_prompts(seed), tokens, 256, 32, temp, seed, seqs):
        print(f"  generated {g.tokens}/{g.goal} tokens ({time.perf_counter() - t:.0f} s)", file=sys.stderr)
    gen_s = time.perf_counter() - t
    states = list(teacher_states(model, seqs))
    total_s = time.perf_counter() - t
    save_corpus(folder, key, seqs, states, f"answers at temp {temp}")
    (folder / "seconds.json").write_text(json.dumps({"seconds": total_s}))
    print(f"  corpus: {sum(map(len, seqs))} tokens, {gen_s:.0f} s generating, {total_s - gen_s:.0f} s of states",
          file=sys.stderr)
    return seqs, states, total_s


def score(trainer: Trainer, unseen) -> tuple[list[float], list[float], int]:
    """Chained and per-step agreement of the trainer's head on the unseen answers, and positions counted."""
    depth = trainer.config.depth
    chain, marginal, n = [0] * depth, [0] * depth, 0
    for tokens, h, plen in unseen:
        # From the position that drafts the answer's second token: the target gives the first.
        alone, in_a_row, count = trainer.hits(tokens, h, first=plen - 1)
        chain = [a + b for a, b in zip(chain, in_a_row)]
        marginal = [a + b for a, b in zip(marginal, alone)]
        n += count
    return [x / n for x in chain], [x / n for x in marginal], n


def speedup(chain: list[float], K: int, c: dict[int, float], d: float) -> float:
    """Tokens per block over block cost, in plain steps: (1 + sum of chain[:K]) c(1) / (c(K+1) + K d)."""
    return (1 + sum(chain[:K])) * c[1] / (c[K + 1] + K * d)


def needed(K: int, c: dict[int, float], d: float, goal: float) -> float:
    """The per-token acceptance a (independent accepts) at which K drafts per block reach ``goal``."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        a = (lo + hi) / 2
        if speedup([a ** i for i in range(1, K + 1)], K, c, d) < goal:
            lo = a
        else:
            hi = a
    return hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="15000,30000,60000", help="training-corpus sizes in tokens")
    ap.add_argument("--temp", type=float, default=0.7, help="sampling temperature of the corpus answers")
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--answer-tokens", type=int, default=96, help="greedy answer length of the unseen prompts")
    ap.add_argument("--cache", default="/tmp/distill-curve-cache", help="where the corpus and its states are kept")
    ap.add_argument("--save-heads", default=None, help="also write each head as a sidecar under this folder")
    ap.add_argument("--also", action="append", default=[], help="also score this head sidecar ('bundled': the "
                    "bundled model's) on the unseen prompts")
    ap.add_argument("--rounds", type=int, default=9, help="rounds of cost measurement")
    ap.add_argument("--out", default="bench-results/distill-curve.json")
    args = ap.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(",") if s)  # none: only score the --also heads
    if not sizes and not args.also:
        raise SystemExit("nothing to measure: give --sizes, or --also HEAD_DIR")

    prov = bench.provenance("float32")
    target = load(str(bundled.model_dir()), "float32")
    model, tokenizer = target.model, target.tokenizer
    parts = target_parts(model)
    print(f"unseen prompts: greedy answers to {len(UNSEEN)}", file=sys.stderr)
    unseen = unseen_set(model, tokenizer, args.answer_tokens)
    config = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
                         eval_every=25)
    width = config.seq_len + config.depth
    seqs, states, data_s = [], [], 0.0
    if sizes:
        print(f"corpus: {max(sizes)} tokens at temp {args.temp}", file=sys.stderr)
        seqs, states, data_s = corpus(model, tokenizer, max(sizes), args.temp, args.seed, Path(args.cache))
    train_ix, held_ix = split(len(seqs), 0.05, args.seed)
    heldout = windows([seqs[i] for i in held_ix], [states[i] for i in held_ix], width)
    rows = []
    for size in sizes:
        use, total = [], 0
        for i in train_ix:  # the seed prompts are shuffled, so a prefix is a spread of topics
            if total >= size:
                break
            use.append(i)
            total += len(seqs[i])
        train = windows([seqs[i] for i in use], [states[i] for i in use], width)
        mx.random.seed(args.seed)
        head = MTPHead(head_config(parts, args.draft_vocab))
        head.draft_ids = frequent_tokens([seqs[i] for i in use], args.draft_vocab, parts.vocab_size)
        trainer = Trainer(head, parts, train, heldout, config)
        t = time.perf_counter()
        for step in trainer.run():
            if step.agreement is not None and step.step % 50 == 0:
                print(f"  {size} tokens, step {step.step}: loss {step.loss:.3f}, held-out "
                      f"{'/'.join(f'{a:.3f}' for a in step.agreement)}", file=sys.stderr)
        train_s = time.perf_counter() - t
        trainer.restore_best()
        chain, marginal, n = score(trainer, unseen)
        row = {"train_tokens": total, "windows": int(train[0].shape[0]), "steps": args.steps,
               "train_seconds": round(train_s, 1), "heldout_agreement": list(trainer.best_agreement or ()),
               "unseen_chain": chain, "unseen_marginal": marginal, "unseen_positions": n}
        rows.append(row)
        print(f"{total} tokens: unseen chained agreement {'/'.join(f'{x:.3f}' for x in chain)}, "
              f"held-out {'/'.join(f'{a:.3f}' for a in row['heldout_agreement'])} ({train_s:.0f} s)",
              file=sys.stderr)
        if args.save_heads:
            # A complete sidecar (README, training.json), as specdec distill writes it.
            opts = DistillOptions(tokens=size, temp=args.temp, draft_vocab=args.draft_vocab, train=config)
            result = make_result(trainer, f"the model's answers to built-in seed prompts (temp {args.temp})", seqs,
                                 use, held_ix, trainer.coverage(), data_s * total / sum(map(len, seqs)), opts,
                                 args.steps, train_s)
            write_head(Path(args.save_heads) / f"head-{total}", trainer.head, result)

    for where in args.also:
        path = bundled.head_dir() if where == "bundled" else Path(where)
        head = load_head(path, read_config(path), str(path), parts).head
        trainer = Trainer(head, parts, heldout, heldout, config)
        chain, marginal, n = score(trainer, unseen)
        info = json.loads((path / "training.json").read_text()) if (path / "training.json").is_file() else {}
        rows.append({"head": str(where), "train_tokens": info.get("train_tokens"), "steps": info.get("steps_done"),
                     "unseen_chain": chain, "unseen_marginal": marginal, "unseen_positions": n})

    ids = prompt_ids(tokenizer, UNSEEN[0])
    # Ratios to a plain step timed right beside each cost, median over rounds: robust to a shared machine's load.
    ratios: dict[int, list[float]] = {t: [] for t in (2, 3, 4)}
    heads, plain = [], []
    for _ in range(args.rounds):
        for t in ratios:
            one = bench.forward_cost(model, ids, 1, reps=3)
            ratios[t].append(bench.forward_cost(model, ids, t, reps=3) / one)
            plain.append(one)
        heads.append(bench.head_step_cost(trainer.head, parts, model, ids, reps=3) / one)
    c = {1: 1.0, **{t: statistics.median(r) for t, r in ratios.items()}}
    d = statistics.median(heads)
    costs = {"plain_step_s": statistics.median(plain), "forward_over_step": c, "head_step_over_step": d,
             "rounds": args.rounds}
    for row in rows:
        row["speedup_at_K"] = {K: round(speedup(row["unseen_chain"], K, c, d), 3) for K in (1, 2, 3)}
    need = {K: round(needed(K, c, d, 1.3), 3) for K in (1, 2, 3)}
    report = {"provenance": prov, "settings": vars(args), "data_seconds": round(data_s, 1), "costs": costs,
              "acceptance_needed_for_1.3x": need, "unseen_prompts": UNSEEN, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"costs (plain steps): forward T=2..4 {', '.join(f'{c[t]:.2f}' for t in (2, 3, 4))}; "
          f"head step {d:.3f}", file=sys.stderr)
    print(f"1.3x needs per-token acceptance {', '.join(f'K={K}: {a:.2f}' for K, a in need.items())}", file=sys.stderr)
    for row in rows:
        shown = "/".join(f"{x:.3f}" for x in row["unseen_chain"])
        print(f"{row.get('head', 'trained')}, {row['train_tokens']} tokens: unseen chained {shown}"
              f" -> speedup at K=1..3 {', '.join(f'{v:.2f}x' for v in row['speedup_at_K'].values())}",
              file=sys.stderr)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
