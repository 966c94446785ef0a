"""``specdec distill`` without the terminal: corpus -> target states -> training -> a sidecar.

:func:`distill` is a generator of typed events (:class:`Stage`,
:class:`~.data.Generated`, :class:`States`, :class:`~.train.Step`,
:class:`Finished`); the command renders them. The corpus and the target's
states are cached under ``OUT/cache`` so a second run (more steps, another
learning rate) skips straight to training.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from functools import partial
from typing import Callable, Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..defaults import DISTILL
from ..drafters.history import tokenizer_fingerprint
from ..drafters.mtp import MTPDrafter
from ..drafters.mtp_head import MTPHead
from ..drafters.mtp_io import embedding_probe, save_head
from ..errors import OptionError
from ..loop.events import collect
from ..loop.runner import run
from ..model.taps import TargetParts
from .data import Generated, answer_prompts, prompt_ids, read_source, teacher_states, text_ids
from .train import Step, TrainConfig, Trainer, frequent_tokens, head_config, windows

CACHE_DIR = "cache"


@dataclass(frozen=True)
class DistillOptions:
    """What to train on and how.

    Attributes:
        data: ``--data`` path, or None for the built-in seed prompts.
        tokens: Corpus size in tokens (prompts and answers).
        answer_tokens: Longest answer generated per prompt.
        gen_batch: Prompts answered per batched generation.
        temp: Sampling temperature of the generated answers (0: greedy).
        draft_vocab: Draft vocabulary size (0: the target's whole vocabulary).
        heldout: Share of sequences kept out of training, for evaluation.
        train: Optimizer options.
        time_limit: Seconds for the whole run, or None: generating answers stops after
            :data:`DATA_SHARE` of them (what was generated is kept, never cached), training at
            the limit (the best head so far is written).
    """

    data: Optional[str] = None
    tokens: int = DISTILL["data_tokens"]
    answer_tokens: int = 256
    gen_batch: int = 32
    temp: float = 0.7
    draft_vocab: int = DISTILL["draft_vocab"]
    heldout: float = 0.05
    train: TrainConfig = field(default_factory=TrainConfig)
    time_limit: Optional[float] = None


#: The share of ``--time-limit`` that generating answers may take; training gets the rest.
DATA_SHARE = 0.5


@dataclass(frozen=True)
class Stage:
    """A stage begins: ``name`` is data, states, train or measure; ``detail`` says what it does."""

    name: str
    detail: str


@dataclass(frozen=True)
class States:
    """Target states computed for ``done`` of ``total`` sequences."""

    done: int
    total: int


@dataclass
class Result:
    """What was trained, on what, and how well (written to the head's README and training.json)."""

    source: str
    corpus_tokens: int
    train_tokens: int
    heldout_tokens: int
    draft_vocab: int
    coverage: float  # share of held-out target greedy tokens inside the draft vocabulary
    steps_done: int
    train_seconds: float
    data_seconds: float
    agreement: Optional[tuple[float, ...]]
    options: dict
    head_bytes: int = 0
    acceptance: Optional[float] = None
    tokens_per_block: Optional[float] = None
    interrupted: bool = False
    time_limited: bool = False  # the time limit cut the data or the training short
    best_step: int = 0  # the step whose head was written (the best held-out agreement; 0: none evaluated)


@dataclass(frozen=True)
class Training:
    """Training begins: ``trainer`` holds the best head so far; ``record(steps_done, seconds, interrupted)``
    gives the run's :class:`Result` (a caller interrupted mid-training writes the best head with it)."""

    trainer: Trainer
    record: Callable[..., "Result"]


@dataclass(frozen=True)
class Finished:
    """The head is written to ``path``."""

    path: Path
    result: Result


def model_key(path: Optional[Path], dtype: str) -> Optional[dict]:
    """What identifies a target's weights for the corpus cache, without reading them.

    A hash of ``config.json`` and, for every weight file (``*.safetensors``
    and the index), its name, size, modification time and the name of the
    file it resolves to (in the Hub cache a symlink to a blob named by the
    content's hash), plus the dtype the weights run in. A fine-tune of the
    same base (same tokenizer) differs in all but the config. Cheap: a stat
    per file, no read of multi-GB weights.
    """
    if path is None:
        return None  # unknown: nothing is cached
    digest = hashlib.sha256()
    root = Path(path)
    config = root / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"no config")
    for f in sorted(list(root.glob("*.safetensors")) + list(root.glob("*.safetensors.index.json"))):
        real = f.resolve()
        st = real.stat()
        digest.update(f"\0{f.name}\0{real.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return {"files": digest.hexdigest(), "dtype": dtype}


def _corpus_key(opts: DistillOptions, fingerprint: str, data_digest: str, model: Optional[dict]) -> dict:
    # The data by its content (not its path), the model by its weights and config (see model_key).
    return {"data": data_digest, "tokens": opts.tokens, "answer_tokens": opts.answer_tokens, "temp": opts.temp,
            "gen_batch": opts.gen_batch, "seed": opts.train.seed, "tokenizer": fingerprint, "model": model,
            "version": 2}


def load_corpus(folder: Path, key: dict) -> Optional[tuple[list[list[int]], list[mx.array], str]]:
    """The corpus (token sequences, their target states, its description) saved in ``folder`` under ``key``.

    None when there is none, it was made under another key (another model,
    other data), or it is damaged.
    """
    meta_file, arrays = folder / "corpus.json", folder / "corpus.safetensors"
    if not (meta_file.is_file() and arrays.is_file()):
        return None
    try:
        meta = json.loads(meta_file.read_text())
        if meta.get("key") != key:
            return None
        data = mx.load(str(arrays))
        flat, lengths = data["tokens"].tolist(), meta["lengths"]
        seqs, states, at = [], [], 0
        for i, n in enumerate(lengths):
            seqs.append(flat[at:at + n])
            states.append(data[f"states_{i}"].astype(mx.float32))
            at += n
        return seqs, states, meta["source"]
    except (OSError, ValueError, KeyError, json.JSONDecodeError):
        return None  # a damaged cache is rebuilt


def save_corpus(folder: Path, key: dict, seqs: list[list[int]], states: list[mx.array], source: str) -> None:
    """Save a corpus and its target states (float16) in ``folder`` for :func:`load_corpus`."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {"tokens": mx.array([t for s in seqs for t in s], dtype=mx.int32)}
    arrays.update({f"states_{i}": h.astype(mx.float16) for i, h in enumerate(states)})
    mx.save_safetensors(str(folder / "corpus.safetensors"), arrays)
    (folder / "corpus.json").write_text(json.dumps({"key": key, "lengths": [len(s) for s in seqs], "source": source}))


def split(n: int, share: float, seed: int) -> tuple[list[int], list[int]]:
    """Sequence indices for training and held-out evaluation (at least one each when n >= 2)."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    k = min(n - 1, max(1, round(n * share))) if n >= 2 else 0
    return sorted(order[k:]), sorted(order[:k])


def distill(model: nn.Module, tokenizer, parts: TargetParts, out: Path, opts: DistillOptions,
            model_id: Optional[dict] = None) -> Iterator[object]:
    """Build the corpus, compute the target's states, train a head and write it to ``out``.

    Args:
        model: The frozen target.
        tokenizer: Its tokenizer.
        parts: The target's embedding and lm_head.
        out: The sidecar directory to write (created).
        opts: What to train on and how.
        model_id: What identifies the target's weights (see :func:`model_key`);
            None: unknown, so no corpus is cached or reused.

    Yields:
        Stage, Generated, States, Training, Step, then Finished.
    """
    c = opts.train
    width = c.seq_len + c.depth  # a training window's tokens
    fingerprint = tokenizer_fingerprint(tokenizer)
    source = read_source(opts.data, c.seed)
    key = _corpus_key(opts, fingerprint, source.digest, model_id)
    cache_dir = out / CACHE_DIR
    t0 = time.perf_counter()
    # An unknown model (no files to identify it by) never reuses a corpus.
    cached = load_corpus(cache_dir, key) if model_id is not None else None
    cut = False
    if cached is not None:
        seqs, states, description = cached
        yield Stage("data", f"reusing the corpus in {cache_dir} ({sum(map(len, seqs))} tokens: {description})")
    else:
        yield Stage("data", f"training text: {source.description}, up to {opts.tokens} tokens")
        seqs: list[list[int]] = []
        got, texts = text_ids(tokenizer, source.texts, opts.tokens, seqs)
        answered = 0
        if got < opts.tokens and source.prompts:
            deadline = t0 + DATA_SHARE * opts.time_limit if opts.time_limit is not None else None
            for event in answer_prompts(model, tokenizer, source.prompts, opts.tokens - got, opts.answer_tokens,
                                        opts.gen_batch, opts.temp, c.seed, seqs, deadline):
                answered, cut = event.answered, event.timed_out
                # Progress counts the whole corpus, texts included, against the whole goal.
                yield Generated(got + event.tokens, opts.tokens, answered, cut)
            if cut:
                yield Stage("data", f"time limit: answers stop at {sum(map(len, seqs))} tokens")
                if opts.answer_tokens >= width and not any(len(s) >= width for s in seqs):
                    raise _too_short_for_the_limit(width)  # now, not after the states
        # What was used, counted after the fact: the numbers every later line and file reports.
        description = source.used(texts, answered)
        yield Stage("states", f"the target's distributions at {sum(map(len, seqs))} positions ({description})")
        states = []
        for i, h in enumerate(teacher_states(model, seqs), 1):
            states.append(h)
            yield States(i, len(seqs))
        if model_id is not None and not cut:  # (a corpus cut short is not the one its key names)
            save_corpus(cache_dir, key, seqs, states, description)
    data_seconds = time.perf_counter() - t0

    train_ix, held_ix = split(len(seqs), opts.heldout, c.seed)
    train = windows([seqs[i] for i in train_ix], [states[i] for i in train_ix], width)
    heldout = windows([seqs[i] for i in held_ix], [states[i] for i in held_ix], width)
    if train[0].shape[0] == 0:
        if cut and opts.answer_tokens >= width:  # (longer answers could reach a window: more time helps)
            raise _too_short_for_the_limit(width)
        raise OptionError(f"the training text has no sequence of {width} tokens: give more text with --data, "
                          "or a smaller --seq-len")
    vocab = min(opts.draft_vocab, parts.vocab_size) if opts.draft_vocab else 0
    if vocab == parts.vocab_size:
        vocab = 0
    config = head_config(parts, vocab)
    config = replace(config, target_probe=embedding_probe(parts))
    mx.random.seed(c.seed)
    head = MTPHead(config)
    if vocab:
        head.draft_ids = frequent_tokens([seqs[i] for i in train_ix], vocab, parts.vocab_size)
    trainer = Trainer(head, parts, train, heldout, c)
    coverage = trainer.coverage()
    n_params = sum(v.size for k, v in tree_flatten(head.parameters()) if k != "draft_ids")
    yield Stage("train", f"{n_params / 1e6:.1f}M-parameter head, draft vocabulary "
                         f"{vocab or parts.vocab_size} ({coverage:.1%} of held-out target tokens), "
                         f"{train[0].shape[0]} windows of {c.seq_len}")
    record = partial(make_result, trainer, description, seqs, train_ix, held_ix, coverage, data_seconds, opts,
                     time_limited=cut)
    yield Training(trainer, record)
    seconds, done = 0.0, 0
    deadline = t0 + opts.time_limit if opts.time_limit is not None else None
    for step in trainer.run(deadline):
        seconds, done = step.seconds, step.step
        yield step
    trainer.restore_best()
    result = record(done, seconds, time_limited=cut or done < c.steps)  # (a step past the deadline ends early)
    yield Finished(write_head(out, trainer.head, result), result)


def make_result(trainer: Trainer, description: str, seqs, train_ix, held_ix, coverage: float,
                data_seconds: float, opts: DistillOptions, steps_done: int, seconds: float = 0.0,
                interrupted: bool = False, time_limited: bool = False) -> Result:
    """The record of a run (``steps_done`` may be short of the plan when interrupted)."""
    return Result(
        source=description, corpus_tokens=sum(map(len, seqs)),
        train_tokens=sum(len(seqs[i]) for i in train_ix), heldout_tokens=sum(len(seqs[i]) for i in held_ix),
        draft_vocab=trainer.head.config.draft_vocab_size or trainer.parts.vocab_size, coverage=coverage,
        steps_done=steps_done, train_seconds=seconds, data_seconds=data_seconds,
        agreement=trainer.best_agreement, options={**asdict(opts), "train": asdict(opts.train)},
        interrupted=interrupted, time_limited=time_limited, best_step=trainer.best_step,
    )


def measure_acceptance(model: nn.Module, tokenizer, parts: TargetParts, head: MTPHead, prompts: Sequence,
                       max_tokens: int = 48, block_size: int = 4) -> tuple[float, float]:
    """Acceptance (accepted / drafted) and tokens per block of the head drafting for the target, greedy.

    Tokens per block is :attr:`Stats.tokens_per_block`'s (committed tokens, a final EOS included,
    per target forward), pooled over the prompts.
    """
    drafted = accepted = tokens = blocks = 0
    eos = sorted(getattr(tokenizer, "eos_token_ids", ()) or ())
    for p in prompts:
        stats, _ = collect(run(model, prompt_ids(tokenizer, p), drafter=MTPDrafter(head, parts),
                               num_draft_tokens=block_size - 1, max_tokens=max_tokens, eos_ids=eos))
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        tokens, blocks = tokens + stats.committed, blocks + stats.blocks
    return (accepted / drafted if drafted else 0.0), (tokens / blocks if blocks else 0.0)


def write_head(out: Path, head: MTPHead, result: Result) -> Path:
    """Write the head (config.json, model.safetensors), README.md and training.json to ``out``.

    Files are written beside and then renamed over the old ones, so an
    interrupted write leaves the previous head loadable.
    """
    out.mkdir(parents=True, exist_ok=True)
    staging = out / ".writing"
    shutil.rmtree(staging, ignore_errors=True)
    save_head(staging, head)
    result.head_bytes = (staging / "model.safetensors").stat().st_size
    (staging / "training.json").write_text(json.dumps(asdict(result), indent=2))
    (staging / "README.md").write_text(readme(head, result))
    for name in ("model.safetensors", "config.json", "training.json", "README.md"):
        os.replace(staging / name, out / name)
    shutil.rmtree(staging, ignore_errors=True)
    return out


def readme(head: MTPHead, r: Result) -> str:
    """How the head was trained and what it measured, for the sidecar's README.md."""
    c = head.config
    t = r.options["train"]
    agree = ", ".join(f"{a:.1%}" for a in r.agreement) if r.agreement else "not measured"
    lines = [
        f"# MTP drafter head for {c.target or 'its target'} (specdec distill)",
        "",
        "A `specdec_mtp` sidecar: one attention + MLP layer reading the target's final hidden state and the",
        "embedding of the next token, drafting through the target's own lm_head. Use it with",
        "",
        "    specdec generate --model TARGET --draft-model THIS_DIR -p '...'",
        "",
        "## Training",
        f"- Data: {r.source}; {r.corpus_tokens} tokens ({r.train_tokens} trained on, {r.heldout_tokens} held out).",
        "- Labels: the target's own next-token distributions (self-distillation, soft cross-entropy), "
        f"chained {t['depth']} steps deep as drafting chains the head.",
        f"- {r.steps_done} steps of {t['batch_size']} windows x {t['seq_len']} positions, AdamW lr {t['lr']}, "
        f"seed {t['seed']}{_cut_short(r)}{_best(r)}.",
        f"- Draft vocabulary: {r.draft_vocab} of {c.vocab_size} tokens ({r.coverage:.1%} of held-out target "
        "tokens fall inside it).",
        f"- Time: {r.data_seconds:.0f} s for data and target states, {r.train_seconds:.0f} s training. "
        f"Head: {r.head_bytes / 2**20:.1f} MiB.",
        "",
        "## Measured",
        f"- Held-out top-1 agreement with the target's greedy token, per draft position: {agree}.",
    ]
    if r.acceptance is not None:
        lines.append(f"- Greedy speculative decoding on held-out prompts, block size 4: acceptance "
                     f"{r.acceptance:.1%}, {r.tokens_per_block:.2f} tokens per block.")
    return "\n".join(lines) + "\n"


def _cut_short(r: Result) -> str:
    if r.interrupted:
        return " (interrupted: the best head so far)"
    if r.time_limited:
        return f" (stopped by the time limit of {r.options['time_limit']:g} s: the best head so far)"
    return ""


def _best(r: Result) -> str:
    if 0 < r.best_step < r.steps_done:
        return f"; the head written is step {r.best_step}'s, the best on held-out text"
    return ""


def _too_short_for_the_limit(width: int) -> OptionError:
    return OptionError(f"the time limit stopped the answers before any sequence reached {width} tokens: give a longer "
                       "--time-limit, or a smaller --seq-len")
