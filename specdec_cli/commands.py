"""What the commands do, apart from option parsing: validate, load, run, report.

Options are validated before any model is loaded, so a bad combination fails
in milliseconds with a message that names the fix.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from .compare import compare_with_plain
from .adaptive import AdaptiveLength, FixedLength
from .display import comparison_lines, policy_lines, print_stderr, summary_lines, text_view
from .drafters import Drafter, LookupDrafter, ModelDrafter
from .errors import OptionError
from .loading import Loaded, check_same_tokenizer, load
from .runner import Prefilled, run
from .sampling import SamplingParams
from .stats import Stats

DEFAULT_BLOCK_SIZE = 4
LOOKUP_MAX, LOOKUP_MIN = 4, 2


@dataclass
class GenerateOptions:
    """Everything ``specdec generate`` was asked to do."""

    model: str
    prompt_arg: Optional[str] = None
    prompt: Optional[str] = None
    draft_model: Optional[str] = None
    drafter: Optional[str] = None
    block_size: Optional[int] = None
    num_draft_tokens: Optional[int] = None
    system_prompt: Optional[str] = None
    ignore_chat_template: bool = False
    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    draft_p_min: Optional[float] = None
    ngram_max: Optional[int] = None
    ngram_min: Optional[int] = None
    adaptive: bool = True
    dtype: Optional[str] = None
    prefill_step_size: int = 2048
    compare_ar: bool = False
    json_output: bool = False
    live: bool = True
    verbose: bool = False


def resolve_block_size(block_size: Optional[int], num_draft_tokens: Optional[int]) -> int:
    """``--block-size B`` or ``--num-draft-tokens K`` (B = K + 1), not both."""
    if block_size is not None and num_draft_tokens is not None:
        raise OptionError("give --block-size or --num-draft-tokens (= block size - 1), not both")
    if num_draft_tokens is not None:
        return num_draft_tokens + 1
    return DEFAULT_BLOCK_SIZE if block_size is None else block_size


def resolve_drafter(drafter: Optional[str], draft_model: Optional[str]) -> str:
    """The drafter kind: ``model`` with a draft model, otherwise prompt ``lookup``."""
    kind = drafter or ("model" if draft_model else "lookup")
    if kind == "model" and not draft_model:
        raise OptionError("--drafter model needs --draft-model REPO_OR_DIR")
    if kind != "model" and draft_model:
        raise OptionError(f"--draft-model is only used with --drafter model, not --drafter {kind}")
    return kind


def check_drafter_options(kind: str, opts: "GenerateOptions") -> None:
    """Options that only one drafter kind understands."""
    if kind != "model" and opts.draft_p_min is not None:
        raise OptionError("--draft-p-min applies to a draft model: drop it or pass --draft-model")
    if kind != "lookup" and (opts.ngram_max is not None or opts.ngram_min is not None):
        raise OptionError("--ngram-max/--ngram-min apply to --drafter lookup")
    if opts.draft_p_min is not None and not 0 <= opts.draft_p_min <= 1:
        raise OptionError("--draft-p-min must be within [0, 1]")
    lo, hi = opts.ngram_min or LOOKUP_MIN, opts.ngram_max or LOOKUP_MAX
    if kind == "lookup" and not 1 <= lo <= hi:
        raise OptionError(f"need 1 <= --ngram-min ({lo}) <= --ngram-max ({hi})")


def read_prompt(prompt_arg: Optional[str], prompt: Optional[str]) -> str:
    """The prompt text from the argument or ``-p``; ``-`` reads stdin."""
    if prompt_arg is not None and prompt is not None:
        raise OptionError("give the prompt once: as PROMPT or with --prompt/-p, not both")
    text = prompt if prompt is not None else prompt_arg
    if text is None:
        raise OptionError("no prompt: pass PROMPT, --prompt TEXT, or - to read stdin")
    if text == "-":
        return sys.stdin.read()
    # As mlx-lm does: escaped newlines and tabs typed on a command line.
    return text.replace("\\n", "\n").replace("\\t", "\t")


def encode_prompt(tokenizer, text: str, system_prompt: Optional[str], ignore_chat_template: bool) -> list[int]:
    """Token ids of the prompt, through the chat template when there is one."""
    use_template = tokenizer.has_chat_template and not ignore_chat_template
    if system_prompt is not None and not use_template:
        why = "--ignore-chat-template is set" if ignore_chat_template else "the tokenizer has no chat template"
        raise OptionError(f"--system-prompt needs the chat template, but {why}: drop --system-prompt")
    if not use_template:
        return tokenizer.encode(text)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    messages.append({"role": "user", "content": text})
    templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(templated, add_special_tokens=False)


def _vocab_size(config: dict) -> Optional[int]:
    return config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")


def sampling_params(opts: "GenerateOptions") -> SamplingParams:
    """Checked sampling options: mlx-lm's meanings; filters need --temp > 0."""
    if opts.temp < 0:
        raise OptionError("--temp must be >= 0")
    if not 0 <= opts.top_p <= 1:
        raise OptionError("--top-p must be within [0, 1] (0 disables it)")
    if not 0 <= opts.min_p <= 1:
        raise OptionError("--min-p must be within [0, 1] (0 disables it)")
    if opts.top_k < 0:
        raise OptionError("--top-k must be >= 0 (0 disables it)")
    params = SamplingParams(opts.temp, opts.top_p, opts.top_k, opts.min_p)
    if params.greedy:
        filters = [n for n, v in (("--top-p", opts.top_p), ("--top-k", opts.top_k), ("--min-p", opts.min_p)) if v]
        if filters:
            raise OptionError(f"{', '.join(filters)} only apply when sampling: set --temp > 0 or drop them")
    elif opts.compare_ar:
        raise OptionError("--compare-ar proves greedy output identical: use --temp 0")
    return params


def make_drafter(kind: str, opts: "GenerateOptions", target: Loaded, draft: Optional[Loaded]) -> Drafter:
    """A fresh drafter of ``kind`` for ``target``."""
    if kind == "lookup":
        return LookupDrafter(opts.ngram_max or LOOKUP_MAX, opts.ngram_min or LOOKUP_MIN)
    return ModelDrafter(draft.model, vocab_size=_vocab_size(target.config), p_min=opts.draft_p_min or 0.0)


def make_policy(adaptive: bool, block_size: int):
    """Adaptive draft length up to block size - 1, or a fixed one."""
    if adaptive and block_size > 1:
        return AdaptiveLength(k_max=block_size - 1)
    return FixedLength(block_size - 1)


def generate_command(opts: GenerateOptions) -> int:
    """Run ``specdec generate``; returns the exit code."""
    block_size = resolve_block_size(opts.block_size, opts.num_draft_tokens)
    kind = resolve_drafter(opts.drafter, opts.draft_model)
    check_drafter_options(kind, opts)
    sampling = sampling_params(opts)
    text = read_prompt(opts.prompt_arg, opts.prompt)
    if opts.seed is not None:
        mx.random.seed(opts.seed)

    target = load(opts.model, opts.dtype)
    draft = None
    if kind == "model":
        draft = load(opts.draft_model, opts.dtype)
        check_same_tokenizer(target.tokenizer, draft.tokenizer)
    tokenizer = target.tokenizer
    prompt_ids = encode_prompt(tokenizer, text, opts.system_prompt, opts.ignore_chat_template)
    drafter_name = f"{kind} ({opts.draft_model})" if draft else kind

    stats = Stats()
    tokens: list[int] = []
    detok = tokenizer.detokenizer
    detok.reset()
    view = text_view(opts.live, drafter_name, opts.json_output)
    interrupted = False
    policy = make_policy(opts.adaptive, block_size)
    mx.reset_peak_memory()
    try:
        events = run(
            target.model, prompt_ids, drafter=make_drafter(kind, opts, target, draft), policy=policy,
            max_tokens=opts.max_tokens, eos_ids=sorted(tokenizer.eos_token_ids), sampling=sampling,
            prefill_step_size=opts.prefill_step_size, timed=opts.verbose,
        )
        for event in events:
            if isinstance(event, Prefilled):
                stats.prompt_tokens, stats.prefill_s = event.prompt_tokens, event.seconds
                continue
            stats.add(event.block, event.seconds)
            for tok in event.block.tokens:
                detok.add_token(tok)
            tokens += event.block.tokens
            view.write(detok.last_segment)
            view.update(stats)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        detok.finalize()
        view.write(detok.last_segment)
        view.close()
    peak_gb = mx.get_peak_memory() / 1e9

    comparison = None
    if opts.compare_ar and not interrupted:
        comparison = compare_with_plain(
            target.model, prompt_ids, tokens, max_tokens=opts.max_tokens,
            eos_ids=sorted(tokenizer.eos_token_ids), prefill_step_size=opts.prefill_step_size,
        )

    if opts.json_output:
        report = {
            "text": detok.text,
            "model": opts.model,
            "draft_model": opts.draft_model,
            "drafter": kind,
            "block_size": block_size,
            "rollback": "reforward" if _recurrent(target) else "trim",
            "sampling": {"temp": sampling.temp, "top_p": sampling.top_p, "top_k": sampling.top_k,
                         "min_p": sampling.min_p, "seed": opts.seed},
            "adaptive": policy.summary(),
            "peak_memory_gb": peak_gb,
            "interrupted": interrupted,
            **stats.to_dict(),
        }
        if comparison is not None:
            report["compare"] = _comparison_dict(comparison, stats, tokenizer)
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        lines = summary_lines(stats, drafter=drafter_name, block_size=block_size, peak_gb=peak_gb,
                              verbose=opts.verbose) + policy_lines(policy.summary())
        if comparison is not None:
            lines += comparison_lines(comparison, stats, lambda t: tokenizer.decode([t]))
        print_stderr(lines)

    if interrupted:
        return 130
    if comparison is not None and not comparison.identical:
        return 3
    return 0


def _recurrent(loaded: Loaded) -> bool:
    from .caches import cache_kinds

    return cache_kinds(loaded.model)["recurrent"] > 0


def _comparison_dict(cmp, stats: Stats, tokenizer) -> dict:
    divergence = None
    if cmp.divergence is not None:
        d = cmp.divergence

        def token(t):
            return None if t is None else {"id": t, "text": tokenizer.decode([t])}

        divergence = {
            "index": d.index,
            "specdec_token": token(d.specdec_token),
            "plain_token": token(d.plain_token),
            "top2_margin": d.top2_margin,
        }
    ar_tps = cmp.plain.decode_tps
    return {
        "identical": cmp.identical,
        "tokens": cmp.tokens,
        "first_divergence": divergence,
        "ar_decode_tps": ar_tps,
        "speedup": stats.decode_tps / ar_tps if ar_tps else None,
    }
