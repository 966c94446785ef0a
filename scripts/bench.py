#!/usr/bin/env python
"""Benchmark suite: specdec against plain decoding and mlx-lm, side by side in one run.

Every configuration decodes the same prompt token ids from caches prefilled
the same way; decode time is measured from the first generated token to the
last (prefill excluded) for every row, mlx-lm's included. Rows run
interleaved (plain, then each configuration, per repeat) and speedups are
medians of per-repeat ratios to that repeat's plain run.

Targets:
  real:<dir>            a model directory (e.g. ../shared/models/smollm2-135m-instruct-q4),
                        cast to --dtype; prompts from ten categories.
  synthetic:<family>    a random-weight model of realistic shape (qwen3_5 hybrid or its
                        pure-attention twin qwen3), for hybrid vs attention at equal acceptance.

Drafters:
  lookup                prompt lookup, longest match (the default: adaptive, block size 64)
  lookup:<B>            the same at a fixed block size B (drafts sized min(B-1, match))
  lookup+history        the default lookup with a history of earlier runs (--lookup-history): the
                        outputs of every other prompt of the run, and of a related earlier task
                        where RELATED names one (the agent prompt with another tool error)
  ngram:<B>             the simple n-gram lookup (last 4..2 tokens), adaptive up to block size B
  ngram:<B>f            the same at a fixed block size B
  oracle:<a>            the target's own greedy continuation, each token corrupted with
                        probability 1-a: acceptance a per token, zero drafting cost
  layers:<n>            the target cut to its first n layers (a real, cheap, weak draft model)
  self                  the target drafting for itself (acceptance 1, drafting costs a target step)
  mtp:<dir>             an MTP head sidecar (specdec distill writes them; mtp:bundled is the bundled
                        model's head), adaptive, and at the fixed --block-size
  lookup+mtp:<dir>      lookup where the text repeats, that head elsewhere (--drafter auto's choice)

For each speculative row the analytic bound is the speedup a loop with zero
overhead would reach with the same accept pattern, from separately measured
costs: c(T) = target forward of T tokens, d = one drafter step,
block time = k*d + c(k+1) + r(n+1) on a partial accept of a recurrent target,
r(t) = a re-forward of t tokens (caches only: its logits are never computed);
bound = sum(n+1) * c(1) / sum(block time). efficiency = achieved / bound. Both
sides of the achieved speedup carry their loop's per-token overhead, so
efficiency can exceed 100% when plain decoding's overhead per token is larger
than the speculative loop's per token.

On Linux CPUs the script re-runs itself once with the system OpenBLAS preloaded, as the CLI
does (it says which BLAS it runs on; SPECDEC_NO_REEXEC=1 turns that off).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

if __name__ == "__main__":
    # Before MLX loads (the dynamic loader reads LD_PRELOAD only at start-up): run again once with
    # the system OpenBLAS preloaded, as the CLI does (SPECDEC_NO_REEXEC=1 turns it off).
    from specdec_cli.model.blas import maybe_reexec

    maybe_reexec()

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx.utils import tree_flatten

from specdec_cli.core.adaptive import AdaptiveLength, FixedLength, HybridLength, MatchLength
from specdec_cli.cache.caches import ModelCache, cache_kinds
from specdec_cli.model import bundled
from specdec_cli.drafters import Draft, HybridDrafter, ModelDrafter, NgramDrafter, SuffixDrafter
from specdec_cli.drafters.mtp import MTPDrafter
from specdec_cli.drafters.mtp_io import load_head
from specdec_cli.model.files import read_config
from specdec_cli.loop.engine import MAX_CARRY
from specdec_cli.session.loading import load
from specdec_cli.session.measure import measure_plain
from specdec_cli.loop.events import collect
from specdec_cli.loop.runner import run
from specdec_cli.core.sampling import GREEDY, SamplingParams
from specdec_cli.session.synthetic import build_model
from specdec_cli.model.taps import Hidden, HiddenTap, target_parts

CATEGORIES = {
    "code_python": "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring and type hints.",
    "code_cpp": "Write a C++ function that reverses a singly linked list in place. Include the struct definition.",
    "explain_concept": "Explain what a hash table is and why lookups are fast on average.",
    "summarize": (
        "Summarize the following text in two sentences.\n\nThe city council met on Tuesday to discuss the new "
        "park. The park will have a playground, a small lake and walking paths. The council said the park "
        "will open next spring. Residents asked for more trees and benches, and the council agreed to add "
        "more trees and benches to the park."
    ),
    "qa_factual": "What is the capital of Japan, and what is its population roughly?",
    "translation": "Translate into French: 'The weather is nice today, so we are going to the beach.'",
    "creative_short": "Write a four-line poem about the sea.",
    "stepwise_math": "A shop sells pens at 3 dollars each. Tom buys 4 pens and pays with a 20 dollar bill. "
                     "How much change does he get? Think step by step.",
    "high_entropy": "List ten random, unrelated words.",
    "verbatim_copy": (
        "Copy the following paragraph exactly, word for word:\n\nThe old lighthouse stood at the edge of the "
        "cliff for more than two hundred years. Every night its keeper climbed the narrow stairs, lit the great "
        "lamp and watched the ships pass safely through the dark water below. When the keeper retired, the "
        "village decided to keep the light burning for the sailors who still needed it."
    ),
    "edit_type_hints": (
        "Rewrite this function with type hints:\n\n```python\ndef summarize_orders(orders, tax_rate):\n"
        "    total = 0\n    count = 0\n    for order in orders:\n        price = order[\"price\"]\n"
        "        quantity = order[\"quantity\"]\n        total += price * quantity\n        count += quantity\n"
        "    tax = total * tax_rate\n    return {\"total\": total, \"tax\": tax, \"count\": count}\n```"
    ),
    # The same request on another function, which this small model rewrites instead of annotating.
    "edit_rewritten": (
        "Rewrite this function with type hints. Keep everything else the same.\n\n```python\n"
        "def merge_counts(first, second, minimum):\n    result = {}\n    for key, value in first.items():\n"
        "        result[key] = value\n    for key, value in second.items():\n"
        "        result[key] = result.get(key, 0) + value\n"
        "    return {key: value for key, value in result.items() if value >= minimum}\n```"
    ),
    # A multi-turn agent loop: the model wrote a file, a tool reported an error, and it is asked to
    # write the whole file again with the fix.
    "agent_multiturn": [
        {"role": "system", "content": "You are a coding agent. Answer with the complete file in one code block."},
        {"role": "user", "content": "Write config.py that loads settings from a JSON file."},
        {"role": "assistant", "content": (
            "```python\nimport json\n\n\ndef load_settings(path):\n    with open(path) as f:\n"
            "        settings = json.load(f)\n    settings.setdefault(\"debug\", False)\n"
            "    settings.setdefault(\"port\", 8080)\n    return settings\n```")},
        {"role": "user", "content": (
            "Tool output: FileNotFoundError: settings.json. Print the whole file again, returning an empty "
            "dict when the file does not exist.")},
    ],
    "long_code_review": (
        "Review this code and suggest improvements:\n\n```python\ndef process(items):\n    result = []\n"
        "    for i in range(len(items)):\n        if items[i] != None:\n            result.append(items[i] * 2)\n"
        "    return result\n\ndef process2(items):\n    result = []\n    for i in range(len(items)):\n"
        "        if items[i] != None:\n            result.append(items[i] * 3)\n    return result\n```"
    ),
}

# An earlier run of a related task, for the lookup+history rows: the same agent
# conversation, where the tool had reported a different error.
RELATED = {
    "agent_multiturn": [
        *CATEGORIES["agent_multiturn"][:3],
        {"role": "user", "content": (
            "Tool output: JSONDecodeError: Expecting value: line 1 column 1. Print the whole file again, "
            "returning an empty dict when the file is not valid JSON.")},
    ],
}

# Realistic shapes (~0.25B parameters): a Qwen3.5-style hybrid (3 GatedDeltaNet
# layers per attention layer) and its pure-attention twin.
_SHAPE = {
    "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 8192, "tie_word_embeddings": True,
}
SYNTHETIC = {
    "qwen3_5": {"model_type": "qwen3_5", "text_config": {
        **_SHAPE, "model_type": "qwen3_5_text", "full_attention_interval": 4,
        "linear_num_value_heads": 16, "linear_num_key_heads": 8, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "rope_parameters": {"type": "default", "mrope_section": [11, 11, 10], "rope_theta": 1e6,
                            "partial_rotary_factor": 0.25}}},
    "qwen3": {**_SHAPE, "model_type": "qwen3", "rope_theta": 1e6},
}


# --- drafters only the benchmark needs ------------------------------------------

class OracleDrafter:
    taps = None

    """Proposes the target's own greedy continuation, each token corrupted with probability 1 - a.

    Greedy output is identical to plain decoding, so the reference continuation
    is known: a draft token is accepted exactly when it was left uncorrupted.
    """

    name = "oracle"

    def __init__(self, reference: list[int], prompt_len: int, acceptance: float, vocab: int, seed: int = 0):
        self.reference, self.prompt_len, self.a, self.vocab = reference, prompt_len, acceptance, vocab
        self.rng = random.Random(seed)
        self.consumed = 0
        self._proposed: list[int] = []

    def prefill(self, tokens, step_size: int = 0) -> None:
        self.consumed = len(tokens)

    def propose(self, last: int, k: int, params: SamplingParams = GREEDY) -> Draft:
        self.consumed += 1
        pos = self.consumed - self.prompt_len  # generated tokens so far
        out = []
        for tok in self.reference[pos:pos + k]:
            out.append(tok if self.rng.random() < self.a else (tok + 1) % self.vocab)
        self._proposed = out
        return Draft(mx.array(out, dtype=mx.uint32))

    def accept(self, n: int) -> None:
        self.consumed += n

    def cancel(self) -> None:
        self.consumed -= 1


def truncated(model, n_layers: int):
    """A copy of ``model`` keeping only its first ``n_layers`` decoder layers."""
    copy_model = copy.copy(model)
    inner = copy.copy(model.model)
    inner.layers = model.model.layers[:n_layers]
    copy_model.model = inner
    return copy_model


# --- timing primitives --------------------------------------------------------------

def forward_cost(model, prompt_ids: list[int], t: int, reps: int = 7, states_only: bool = False) -> float:
    """Best-case seconds of a forward of ``t`` tokens after the prompt (cache restored each time).

    The minimum, not the median: the bound is for a loop with zero overhead.
    ``states_only`` evaluates only the caches, as a re-forward does (its
    logits are never used, so MLX never computes the final norm and LM head).
    """
    cache = ModelCache(model)
    cache.prefill(prompt_ids[:-1])
    snap = cache.snapshot()
    ids = mx.array((prompt_ids[-1:] + list(range(1, t)))[:t], dtype=mx.uint32)
    times = []
    for _ in range(reps + 1):
        cache.restore(snap)
        start = time.perf_counter()
        logits = cache.feed(ids)
        mx.eval(cache.state_arrays() if states_only else logits)
        times.append(time.perf_counter() - start)
    return min(times[1:])


def mlx_lm_plain(model, prompt_ids: list[int], max_tokens: int, eos: set[int]) -> tuple[float, list[int]]:
    """mlx-lm's generate_step from a cache prefilled with all but the last prompt token."""
    cache = make_prompt_cache(model)
    model(mx.array(prompt_ids[:-1])[None], cache=cache)
    mx.eval([c.state for c in cache])
    out, start = [], time.perf_counter()
    for tok, _ in generate_step(mx.array(prompt_ids[-1:]), model, max_tokens=max_tokens, prompt_cache=cache):
        if tok in eos:
            break
        out.append(tok)
    return len(out) / (time.perf_counter() - start), out


def mlx_lm_speculative(model, draft, prompt_ids, max_tokens, eos, k) -> tuple[float, list[int], float]:
    """mlx-lm's speculative_generate_step (same prefill); returns tok/s, tokens, acceptance."""
    cache = make_prompt_cache(model)
    dcache = make_prompt_cache(draft)
    model(mx.array(prompt_ids[:-1])[None], cache=cache)
    draft(mx.array(prompt_ids[:-1])[None], cache=dcache)
    mx.eval([c.state for c in cache + dcache])
    out, from_draft, start = [], 0, time.perf_counter()
    for tok, _, drafted in speculative_generate_step(
        mx.array(prompt_ids[-1:]), model, draft, num_draft_tokens=k, max_tokens=max_tokens,
        prompt_cache=cache + dcache,
    ):
        if tok in eos:
            break
        out.append(tok)
        from_draft += int(drafted)
    seconds = time.perf_counter() - start
    # mlx-lm reports only which tokens came from the draft: accepted drafts.
    return len(out) / seconds, out, from_draft


# --- one target ------------------------------------------------------------------

@dataclass
class Config:
    """One row of the table: who decodes, and with which drafter."""

    label: str
    make_drafter: Optional[Callable] = None  # specdec rows: policy -> drafter
    make_policy: Optional[Callable] = None   # specdec rows: () -> draft-length policy (default by block size)
    mlx_lm_draft: object = None              # mlx-lm speculative rows
    draft_step_s: float = 0.0                # one drafter step, for the bound
    adaptive: bool = False                   # specdec's default draft-length policy
    rollback: str = "reforward"              # recurrent rollback strategy


@dataclass
class Row:
    target: str
    category: str
    config: str
    generated: int
    drafted: Optional[int]
    accepted: int
    acceptance: Optional[float]
    decode_s: float
    decode_tps: float
    speedup: float
    bound: Optional[float]
    efficiency: Optional[float]
    identical: Optional[bool]
    note: str = ""
    drafting_blocks: Optional[int] = None  # blocks that drafted anything
    per_position: Optional[list] = None  # acceptance of the i-th draft of a block, given it was drafted

    @property
    def mean_accepted(self) -> Optional[float]:
        """Accepted drafts per block that drafted."""
        return self.accepted / self.drafting_blocks if self.drafting_blocks else None


def analytic_bound(blocks: list[tuple[int, int]], cost: Callable[[int], float], d: float,
                   reforward: Optional[Callable[[int], float]] = None, carry: bool = False) -> float:
    """Zero-overhead speedup for the measured (drafted, accepted) blocks; see the module docstring.

    ``reforward(t)``: cost of re-feeding t tokens (recurrent targets), None for attention-only.
    ``carry``: partial accepts lengthen the next verify instead (the engine's bookkeeping,
    MAX_CARRY included); the last block's carry is fed at the end.
    """
    tokens = sum(n + 1 for _, n in blocks)
    seconds, pending = 0.0, 0
    for i, (k, n) in enumerate(blocks):
        seconds += k * d + cost(pending + k + 1)
        partial = reforward is not None and n < k
        if partial and carry and pending + n + 1 <= MAX_CARRY and i + 1 < len(blocks):
            pending += n + 1
            continue
        if partial:
            seconds += reforward(pending + n + 1)
        pending = 0
    return tokens * cost(1) / seconds if seconds else 0.0


def make_configs(model, ids, reference, drafters, vocab, eos=(), history=()) -> list[Config]:
    configs = []
    stop = sorted(eos)
    for spec in drafters:
        if spec == "lookup":
            # The CLI's default: adaptive by match length, blocks up to 64.
            configs.append(Config("specdec lookup B<=64", lambda policy: SuffixDrafter(policy.size, stop_ids=stop),
                                  make_policy=lambda: MatchLength(k_max=63)))
        elif spec == "lookup+history":
            configs.append(Config("specdec lookup +history",
                                  lambda policy: SuffixDrafter(policy.size, history, stop_ids=stop),
                                  make_policy=lambda: MatchLength(k_max=63)))
        elif spec.startswith("lookup:"):
            b = int(spec.split(":")[1])
            configs.append(Config(f"specdec lookup B={b} fixed", lambda policy: SuffixDrafter(stop_ids=stop),
                                  make_policy=lambda b=b: FixedLength(b - 1)))
        elif spec.startswith("ngram:"):
            arg = spec.split(":")[1]
            b, fixed = int(arg.rstrip("f")), arg.endswith("f")
            configs.append(Config(
                f"specdec ngram B={b}{' fixed' if fixed else ''}", lambda policy: NgramDrafter(4, 2),
                make_policy=(lambda b=b: FixedLength(b - 1)) if fixed else (lambda b=b: AdaptiveLength(k_max=b - 1))))
        elif spec.startswith("oracle:"):
            a = float(spec.split(":")[1])
            configs.append(Config(f"specdec oracle a={a:g}",
                                  lambda policy, a=a: OracleDrafter(reference, len(ids), a, vocab, seed=1)))
        elif spec.startswith("layers:") or spec == "self":
            small = model if spec == "self" else truncated(model, int(spec.split(":")[1]))
            what = "self-draft" if spec == "self" else f"{spec.split(':')[1]}-layer draft"
            step = forward_cost(small, ids, 1)
            configs.append(Config(f"specdec {what}", lambda policy, small=small: ModelDrafter(small),
                                  draft_step_s=step))
            configs.append(Config(f"specdec {what} adaptive", lambda policy, small=small: ModelDrafter(small),
                                  draft_step_s=step, adaptive=True))
            configs.append(Config(f"mlx-lm {what}", mlx_lm_draft=small))
        elif spec.startswith("mtp:") or spec.startswith("lookup+mtp:"):
            # An MTP head sidecar (specdec distill's, or "bundled": the bundled model's head),
            # alone (adaptive, and at the fixed --block-size) or with lookup (what --drafter auto runs).
            kind, where = spec.split(":", 1)
            path = bundled.head_dir() if where == "bundled" else Path(where)
            parts = target_parts(model)
            head = load_head(path, read_config(path), str(path), parts).head
            step = head_step_cost(head, parts, model, ids)
            label = f"specdec {kind} {'bundled' if where == 'bundled' else Path(where).name}"
            if kind == "lookup+mtp":
                configs.append(Config(label, lambda policy, head=head, parts=parts: HybridDrafter(
                    SuffixDrafter(policy.size, stop_ids=stop), MTPDrafter(head, parts), policy),
                    make_policy=lambda: HybridLength(k_max=63)))  # its bound counts head steps as free
                continue
            configs.append(Config(label, lambda policy, head=head, parts=parts: MTPDrafter(head, parts),
                                  draft_step_s=step, adaptive=True))
            configs.append(Config(f"{label} fixed", lambda policy, head=head, parts=parts: MTPDrafter(head, parts),
                                  draft_step_s=step))
        else:
            raise SystemExit(f"unknown drafter {spec!r}")
    return configs


def head_step_cost(head, parts, model, ids, reps: int = 5) -> float:
    """Seconds per chained draft step of an MTP head (drafting 5 tokens minus drafting 1, over 4)."""
    cache = ModelCache(model)
    with HiddenTap(model, MTPDrafter.taps) as tap:
        rows = Hidden.concat(cache.prefill(ids[:-1], 2048, tap))
    drafter = MTPDrafter(head, parts)
    drafter.prefill(ids[:-1], 2048, rows)

    def timed(k: int) -> float:
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            mx.eval(drafter.propose(ids[-1], k).tokens)
            best = min(best, time.perf_counter() - t)
            drafter.cancel()
        return best

    timed(5)
    return max(0.0, (timed(5) - timed(1)) / 4)


def bench_prompt(name, category, model, ids, drafters, *, block_size, max_tokens, repeats, eos, vocab,
                 log, rollbacks=("reforward",), history=()) -> list[Row]:
    recurrent = cache_kinds(model)["recurrent"] > 0
    k = block_size - 1
    costs: dict[tuple[int, bool], float] = {}

    def cost(t: int, states_only: bool = False) -> float:
        if (t, states_only) not in costs:
            # The one-token step is the unit of every bound: time it most carefully.
            costs[t, states_only] = forward_cost(model, ids, t, reps=7 if t == 1 else 3, states_only=states_only)
        return costs[t, states_only]

    reforward = (lambda t: cost(t, True)) if recurrent else None

    _, reference = measure_plain(model, ids, max_tokens=max_tokens, eos_ids=eos)
    configs = make_configs(model, ids, reference, drafters, vocab, eos, history)
    if recurrent and "carry" in rollbacks:
        carried = [replace(c, label=f"{c.label} carry", rollback="carry") for c in configs
                   if c.make_drafter is not None and not c.adaptive and c.make_policy is None]
        configs = ([c for c in configs if "reforward" in rollbacks or c.make_drafter is None] + carried)
    runs: dict[str, list] = {c.label: [] for c in configs}
    plain = []
    for _ in range(repeats):
        plain.append(mlx_lm_plain(model, ids, max_tokens, eos))
        for c in configs:
            if c.mlx_lm_draft is not None:
                runs[c.label].append(
                    None if recurrent else mlx_lm_speculative(model, c.mlx_lm_draft, ids, max_tokens, eos, k)
                )
            else:
                if c.make_policy is not None:
                    policy = c.make_policy()
                else:
                    policy = AdaptiveLength(k_max=k) if c.adaptive else FixedLength(k)
                stats, out = collect(run(model, ids, drafter=c.make_drafter(policy), policy=policy,
                                         max_tokens=max_tokens, eos_ids=eos, rollback=c.rollback))
                runs[c.label].append((stats.decode_tps, out, stats))
    log(f"  {name} / {category}: done")
    plain_tps = [p[0] for p in plain]
    ptps = statistics.median(plain_tps)
    rows = [Row(name, category, "mlx-lm plain", len(plain[0][1]), None, 0, None, len(plain[0][1]) / ptps, ptps,
                1.0, None, None, plain[0][1] == reference, note="baseline; 'same' = equals specdec's plain")]
    for c in configs:
        rs = runs[c.label]
        if rs[0] is None:
            rows.append(Row(name, category, c.label, 0, None, 0, None, 0.0, 0.0, 0.0, None, None, None,
                            note="mlx-lm refuses: needs a trimmable cache (recurrent layers)"))
            continue
        tps = statistics.median(r[0] for r in rs)
        speedup = statistics.median(r[0] / p for r, p in zip(rs, plain_tps))
        out, extra = rs[0][1], rs[0][2]
        if c.mlx_lm_draft is not None:
            rows.append(Row(name, category, c.label, len(out), None, extra, None, len(out) / tps, tps, speedup,
                            None, None, out == reference, note="mlx-lm reports accepted drafts only"))
            continue
        bound = analytic_bound(extra.block_log, cost, c.draft_step_s, reforward, carry=c.rollback == "carry")
        rows.append(Row(name, category, c.label, extra.generated, extra.drafted, extra.accepted,
                        extra.acceptance, extra.generated / tps, tps, speedup, bound,
                        speedup / bound if bound else None, out == reference,
                        drafting_blocks=extra.drafting_blocks,
                        per_position=[round(a / d, 3) for a, d in zip(extra.position_accepted,
                                                                       extra.position_drafted) if d]))
    return rows


def aggregate(rows: list[Row]) -> list[Row]:
    """Per target and config over all categories: totals, and total-time speedup."""
    out = []
    for target in dict.fromkeys(r.target for r in rows):
        mine = [r for r in rows if r.target == target]
        if len({r.category for r in mine}) < 2:
            continue
        base = [r for r in mine if r.config == "mlx-lm plain"]
        base_tps = sum(r.generated for r in base) / sum(r.decode_s for r in base)
        for config in dict.fromkeys(r.config for r in mine):
            rs = [r for r in mine if r.config == config and r.decode_s > 0]
            if not rs:
                continue
            gen, secs = sum(r.generated for r in rs), sum(r.decode_s for r in rs)
            drafted = sum(r.drafted or 0 for r in rs)
            accepted = sum(r.accepted for r in rs)
            acceptance = accepted / drafted if drafted else None
            bounds = [r.bound for r in rs if r.bound]
            tps = gen / secs
            blocks = sum(r.drafting_blocks or 0 for r in rs)
            out.append(Row(target, "ALL", config, gen, drafted if rs[0].drafted is not None else None, accepted,
                           acceptance, secs, tps, tps / base_tps,
                           statistics.median(bounds) if bounds else None,
                           (tps / base_tps) / statistics.median(bounds) if bounds else None,
                           all(r.identical for r in rs if r.identical is not None),
                           drafting_blocks=blocks))
    return out


# --- provenance ------------------------------------------------------------------------

def blas_in_use() -> str:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown (not Linux)"
    if "openblas" in maps.lower():
        return "OpenBLAS (preloaded)"
    if sys.platform == "linux":
        return "MLX's bundled reference BLAS (slow batched float32; preload OpenBLAS)"
    return "Accelerate"


def provenance(dtype: str) -> dict:
    def cmd(*args):
        try:
            return subprocess.run(args, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    cpu = ""
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "git_commit": cmd("git", "rev-parse", "HEAD"),
        "git_dirty": bool(cmd("git", "status", "--porcelain", "--untracked-files=no")),
        "device": str(mx.default_device()),
        "cpu": cpu or platform.processor(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "blas": blas_in_use(),
        "dtype": dtype,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", action="append", required=True, help="real:<dir> or synthetic:<family>")
    ap.add_argument("--drafters", default="lookup,oracle:0.7,layers:10,self")
    ap.add_argument("--categories", default="all", help="comma-separated, or 'all' (real targets)")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--rollback", default="reforward",
                    help="recurrent targets: comma-separated strategies to measure (reforward,carry)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--out", default="bench-results/bench.json")
    args = ap.parse_args()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    prov = provenance(args.dtype)
    log(f"BLAS: {prov['blas']}; device {prov['device']}; mlx {prov['mlx']}, mlx-lm {prov['mlx_lm']}")
    drafters = [d for d in args.drafters.split(",") if d]
    rows: list[Row] = []
    for target in args.target:
        kind, _, what = target.partition(":")
        if kind == "real":
            loaded = load(what, args.dtype)
            model, tok = loaded.model, loaded.tokenizer
            cats = CATEGORIES if args.categories == "all" else {c: CATEGORIES[c] for c in args.categories.split(",")}
            def encode(text):
                messages = text if isinstance(text, list) else [{"role": "user", "content": text}]
                return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                                  add_special_tokens=False)

            prompts = {c: encode(text) for c, text in cats.items()}
            eos, vocab = set(tok.eos_token_ids), loaded.config.get("vocab_size", 0)
            name = Path(what).name
        else:
            config = SYNTHETIC[what]
            model = build_model(config, seed=0, dtype=getattr(mx, args.dtype))
            rng = random.Random(0)
            vocab = _SHAPE["vocab_size"]
            prompts = {"random": [rng.randrange(vocab) for _ in range(128)]}
            eos, name = set(), f"synthetic {what}"
        params = sum(p.size for _, p in tree_flatten(model.parameters()))
        log(f"{name}: {params / 1e6:.0f}M parameters, layer caches {cache_kinds(model)}")
        outputs = {}
        if "lookup+history" in drafters:
            # What earlier runs said: every prompt's own output, and related tasks'.
            related = {c: encode(RELATED[c]) for c in prompts if kind == "real" and c in RELATED}
            for c, ids in [*prompts.items(), *((f"{c} (related)", ids) for c, ids in related.items())]:
                outputs[c] = measure_plain(model, ids, max_tokens=args.max_tokens, eos_ids=eos)[1]
        for category, ids in prompts.items():
            history = [out for c, out in outputs.items() if c != category]
            rows += bench_prompt(name, category, model, ids, drafters, block_size=args.block_size,
                                 max_tokens=args.max_tokens, repeats=args.repeats, eos=eos, vocab=vocab, log=log,
                                 rollbacks=tuple(args.rollback.split(",")), history=history)
    rows += aggregate(rows)
    report = {"provenance": prov, "settings": vars(args),
              "rows": [{**r.__dict__, "mean_accepted": r.mean_accepted} for r in rows]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print_table(rows)
    log(f"wrote {args.out}")


def print_table(rows: list[Row]) -> None:
    head = (f"{'target':24} {'category':17} {'config':26} {'gen':>4} {'drafted':>7} {'acc':>5} {'accept':>7} "
            f"{'acc/blk':>7} {'tok/s':>7} {'speedup':>7} {'bound':>6} {'eff':>5} same")
    print(head)
    for r in rows:
        acc = f"{100 * r.acceptance:.0f}%" if r.acceptance is not None else "-"
        bound = f"{r.bound:.2f}" if r.bound else "-"
        eff = f"{100 * r.efficiency:.0f}%" if r.efficiency else "-"
        same = "-" if r.identical is None else ("yes" if r.identical else "NO")
        drafted = "-" if r.drafted is None else r.drafted
        per_block = f"{r.mean_accepted:.2f}" if r.mean_accepted is not None else "-"
        print(f"{r.target[:24]:24} {r.category:17} {r.config:26} {r.generated:>4} {drafted:>7} {r.accepted:>5} "
              f"{acc:>7} {per_block:>7} {r.decode_tps:>7.2f} {r.speedup:>6.2f}x {bound:>6} {eff:>5} {same} {r.note}")


if __name__ == "__main__":
    main()
