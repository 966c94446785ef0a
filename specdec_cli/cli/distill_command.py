"""``specdec distill``: validate, load the target, run the pipeline with progress, write the head."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from mlx.utils import tree_flatten
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..session import ModelOptions, check_force_download, load_target, single_process
from ..defaults import DISTILL
from .display import Console, print_stderr
from ..distill.data import Generated, data_path
from ..distill.pipeline import (DistillOptions, Finished, Stage, States, Training, distill, measure_acceptance,
                               model_key, write_head)
from ..distill.train import Step, TrainConfig
from ..drafters.mtp_io import SPECDEC_TYPE
from ..errors import EXIT_INTERRUPTED, OptionError
from ..cache.limits import gb
from ..model.taps import target_parts

# Held-out prompts for the acceptance measured after training: in no seed prompt.
EVAL_PROMPTS = (
    "Explain how a refrigerator keeps food cold.",
    "Write a short story about a lost umbrella.",
    "What is the tallest mountain in Africa, and how high is it?",
)


@dataclass
class DistillCommandOptions:
    """Everything ``specdec distill`` was asked to do."""

    out: Optional[str] = None
    model: Optional[str] = None
    data: Optional[str] = None
    data_tokens: int = DISTILL["data_tokens"]
    steps: int = DISTILL["steps"]
    batch_size: int = DISTILL["batch_size"]
    seq_len: int = DISTILL["seq_len"]
    lr: float = DISTILL["lr"]
    seed: int = DISTILL["seed"]
    depth: int = DISTILL["depth"]
    draft_vocab: int = DISTILL["draft_vocab"]
    dtype: Optional[str] = "auto"
    trust_remote_code: bool = False
    force_download: bool = False
    measure: bool = True
    time_limit: Optional[float] = None


# What distill writes into --out (pipeline.write_head, its staging folder, the corpus cache).
WRITES = ("config.json", "model.safetensors", "training.json", "README.md", ".writing", "cache")
# What an interrupted earlier run may have left before its first head was written.
_CACHE_FILES = {"corpus.json", "corpus.safetensors"}


def _leftovers_of_ours(path: Path, names: list[str]) -> bool:
    """Only what an earlier distill into ``path`` leaves before its first head: the staging folder and the corpus cache."""
    for name in names:
        if name == ".writing":
            continue
        if name == "cache" and (path / name).is_dir() and set(p.name for p in (path / name).iterdir()) <= _CACHE_FILES:
            continue
        return False
    return True


def _read_only(folder: Path) -> bool:
    """A folder on a file system mounted read-only (``os.access`` says writable to root there)."""
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def check_out(out: Optional[str]) -> Path:
    """The output directory: new, empty, or an earlier head's (its files are replaced).

    Raises:
        OptionError: No ``--out``, a file, a folder holding another model, or
            a folder holding other files (named, with those it would overwrite).
    """
    if not out:
        raise OptionError("give --out DIR: the directory to write the head to")
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise OptionError(f"--out {out} is a file; give a directory")
    # Written when the head is, minutes later: a folder it cannot be written in is refused now.
    folder = path if path.exists() else next(p for p in path.absolute().parents if p.exists())
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK) or _read_only(folder):
        raise OptionError(f"--out {out} cannot be written: {folder} is not a folder this user can write in; give "
                          "another directory")
    if not path.exists():
        return path
    config = path / "config.json"
    if config.is_file():
        try:
            kind = json.loads(config.read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            kind = None
        if kind == SPECDEC_TYPE:
            return path  # an earlier head of ours: replaced
        raise OptionError(f"--out {out} holds another model (config.json model_type {kind!r}); "
                          "give a new directory")
    try:
        names = sorted(p.name for p in path.iterdir())
    except OSError as e:
        raise OptionError(f"--out {out}: cannot list it ({e.strerror}); give another directory") from None
    if not names or _leftovers_of_ours(path, names):
        return path
    clash = [n for n in names if n in WRITES]
    shown = ", ".join(clash[:6]) + (", ..." if len(clash) > 6 else "")
    others = ", ".join(names[:4]) + (f", ... ({len(names)} entries)" if len(names) > 4 else "")
    what = f"writing the head would overwrite {shown}" if clash else f"it holds {others}"
    raise OptionError(f"--out {out} is not empty and holds no earlier head (config.json of a specdec_mtp head): "
                      f"{what}; give a new or empty directory")


def memory_plan(hidden: int, layer_params: int, tokens: int, draft_vocab: int, cfg: TrainConfig) -> dict:
    """Bytes the training needs beside the target's weights (float32 throughout).

    States: one final hidden row per corpus token (float32 in memory). Head:
    weights, gradients and AdamW's two moments. Step: activations of one
    batch, dominated by the draft-vocabulary logits of every chained step.
    """
    positions = cfg.batch_size * cfg.seq_len
    return {
        "states": tokens * hidden * 4,
        "head": layer_params * 4 * 4,
        "step": positions * cfg.depth * (3 * draft_vocab + 24 * hidden) * 4,
    }


def _plan_line(plan: dict, target_bytes: int) -> str:
    total = target_bytes + sum(plan.values())
    return (f"memory: ~{gb(total)} (target {gb(target_bytes)}, its states {gb(plan['states'])}, "
            f"head + optimizer {gb(plan['head'])}, one step {gb(plan['step'])})")


class _View:
    """Progress on stderr: a bar on a terminal, a line per stage and evaluation otherwise."""

    def __init__(self):
        self.console = Console(stderr=True, highlight=False)
        self.live = self.console.is_terminal
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=self.console, transient=True, disable=not self.live)
        self.task = None
        self._shown = None
        self._quarters: dict = {}

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        self.bar.__exit__(*exc)

    def _quarter(self, what: str, done: int, total: int, unit: str) -> None:
        # Without a terminal (a log, CI) a line at each quarter of a long stage.
        quarter = 4 * done // max(total, 1)
        if not self.live and quarter > self._quarters.get(what, 0):
            self._quarters[what] = quarter
            self.console.print(f"  {what} {done}/{total} {unit}", markup=False)

    def show(self, event) -> None:
        if isinstance(event, Stage):
            self.bar.console.print(f"{event.name}: {event.detail}", markup=False)
            if self.task is not None:
                self.bar.remove_task(self.task)
            self.task = self.bar.add_task(event.name, total=None)
        elif isinstance(event, Generated):
            self.bar.update(self.task, total=event.goal, completed=min(event.tokens, event.goal),
                            description="generating")
            self._quarter("generated", min(event.tokens, event.goal), event.goal, "tokens")
        elif isinstance(event, States):
            self.bar.update(self.task, total=event.total, completed=event.done, description="target states")
            self._quarter("target states of", event.done, event.total, "sequences")
        elif isinstance(event, Step):
            agree = "/".join(f"{a:.0%}" for a in event.agreement) if event.agreement else "-"
            self.bar.update(self.task, total=event.steps, completed=event.step,
                            description=f"loss {event.loss:.3f} · held-out top-1 {agree}")
            if event.agreement is not None and event.agreement is not self._shown:
                self._shown = event.agreement  # a new evaluation: one line, on a terminal or not
                mark = " (best so far)" if event.best else ""
                self.bar.console.print(f"step {event.step}/{event.steps}: loss {event.loss:.3f}, held-out "
                                       f"top-1 agreement by draft position {agree}{mark}", markup=False)


def distill_command(opts: DistillCommandOptions) -> int:
    """Run ``specdec distill``; returns the exit code."""
    # Under mlx.launch every rank loaded the whole model and trained the same head into the same --out.
    single_process(opts, "distill")
    out = check_out(opts.out)
    if opts.data is not None:
        data_path(opts.data)  # a missing one said now, not once the model loaded
    if opts.seq_len < 8:
        raise OptionError("--seq-len is at least 8")
    if opts.force_download:
        check_force_download(opts.model)
    train = TrainConfig(steps=opts.steps, batch_size=opts.batch_size, seq_len=opts.seq_len, lr=opts.lr,
                        seed=opts.seed, depth=opts.depth, eval_every=max(1, min(25, opts.steps // 8)))
    dopts = DistillOptions(data=opts.data, tokens=opts.data_tokens, draft_vocab=opts.draft_vocab, train=train,
                           time_limit=opts.time_limit)
    target = load_target(ModelOptions(model=opts.model, dtype=opts.dtype, trust_remote_code=opts.trust_remote_code,
                                      force_download=opts.force_download))
    parts = target_parts(target.model)
    H = parts.hidden_size
    layer = 4 * H * H + 3 * H * (4 * H) + 2 * H * H  # attention, MLP (~4H wide), fc: an upper bound
    target_bytes = sum(v.nbytes for _, v in tree_flatten(target.model.parameters()))
    vocab = min(opts.draft_vocab or parts.vocab_size, parts.vocab_size)
    print_stderr([f"Model: {target.name}, {target.dtype}",
                  _plan_line(memory_plan(H, layer, opts.data_tokens, vocab, train), target_bytes)])
    training = None  # the Training event: the best head so far, and how to record the run
    steps_done, seconds = 0, 0.0
    finished = None
    try:
        with _View() as view:
            for event in distill(target.model, target.tokenizer, parts, out, dopts,
                                 model_id=model_key(target.path, target.dtype)):
                view.show(event)
                if isinstance(event, Training):
                    training = event
                elif isinstance(event, Step):
                    steps_done, seconds = event.step, event.seconds
                elif isinstance(event, Finished):
                    finished = event
    except KeyboardInterrupt:
        if training is None or training.trainer.best_params is None:
            print_stderr(["interrupted before the first evaluation: no head written"])
            return EXIT_INTERRUPTED
        training.trainer.restore_best()
        write_head(out, training.trainer.head, training.record(steps_done, seconds, interrupted=True))
        best = training.trainer.best_step
        which = f" (step {best}'s)" if 0 < best < steps_done else ""
        print_stderr([f"interrupted at step {steps_done}: the best head so far{which} is in {out}"])
        return EXIT_INTERRUPTED
    head, result = training.trainer.head, finished.result
    if opts.measure:
        print_stderr([f"measure: greedy speculative decoding with the head on {len(EVAL_PROMPTS)} held-out prompts"])
        result.acceptance, result.tokens_per_block = measure_acceptance(
            target.model, target.tokenizer, parts, head, EVAL_PROMPTS)
        write_head(out, head, result)
    agree = "/".join(f"{a:.1%}" for a in result.agreement) if result.agreement else "-"
    lines = [f"wrote {out} ({result.head_bytes / 2**20:.1f} MiB): held-out top-1 agreement by draft position "
             f"{agree}"]
    if result.time_limited:
        lines.append(f"the time limit cut the run short: {result.corpus_tokens} tokens of data, "
                     f"{result.steps_done} of {opts.steps} steps")
    if result.acceptance is not None:
        lines.append(f"acceptance {result.acceptance:.1%}, {result.tokens_per_block:.2f} tokens per block "
                     "(greedy, block size 4, held-out prompts)")
    model = f" --model {opts.model}" if opts.model else ""
    lines.append(f"use it: specdec generate{model} --draft-model {out} -p '...'")
    print_stderr(lines)
    return 0

