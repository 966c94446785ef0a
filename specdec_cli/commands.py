"""What the commands do, apart from option parsing: validate, load, run, report.

Options are validated before any model is loaded, so a bad combination fails
in milliseconds with a message that names the fix.
"""

from __future__ import annotations

import json
import logging
import sys
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx

from . import blas, bundled, doctor
from .adaptive import AdaptiveLength, FixedLength, HybridLength, MatchLength
from .caches import check_kv_quantization
from .compare import DIVERGED, compare_with_plain

# Block-size and n-gram limits live in a module without heavy imports: the CLI
# declares its option ranges with them before MLX is loaded.
from .defaults import (  # noqa: F401  (re-exported: the limits are commands' to check)
    DEFAULT_BLOCK_SIZE,
    DRAFTER_KINDS,
    MAX_ANY_BLOCK_SIZE,
    MAX_BLOCK_SIZE,
    MAX_NGRAM,
    NGRAM_MAX,
    NGRAM_MIN,
)
from .display import (
    NoText,
    comparison_lines,
    policy_lines,
    print_stderr,
    print_sweep,
    summary_lines,
    sweep_progress,
    text_view,
)
from .drafters import DFlashDrafter, Drafter, HybridDrafter, LookupHistory, ModelDrafter, NgramDrafter, SuffixDrafter
from .drafters.dflash import check_target
from .drafters.history import tokenizer_fingerprint
from .drafters.mtp import LoadedHead, MTPDrafter
from .errors import OptionError, SpecdecError
from .hooks import TargetParts, target_parts
from .limits import MemoryEstimate, context_length, device_memory, estimate_memory, gb
from .loading import Loaded, check_same_tokenizer, is_dflash, is_mtp_sidecar, load, load_dflash, load_mtp, resolve
from .measure import SweepResult, sweep
from .runner import Step, run
from .sampling import SamplingParams
from .stats import Stats

EXIT_DIVERGED = 3
EXIT_INTERRUPTED = 130
# Each prefill chunk is sized to about this long, so Ctrl-C and SIGTERM (seen
# between evaluations, never inside one) stop a prefill within ~2 s.
PREFILL_CHUNK_S = 0.5


class PromptTooLongError(SpecdecError):
    """The prompt alone does not fit in the model's context."""


class MemoryLimitError(SpecdecError):
    """The run's estimated peak memory exceeds what the device has."""


@dataclass
class ModelOptions:
    """What both commands need: the models, the drafter and the prompt."""

    model: Optional[str] = None  # None: the bundled default model
    prompt_arg: Optional[str] = None
    prompt: Optional[str] = None
    draft_model: Optional[str] = None
    drafter: Optional[str] = None
    system_prompt: Optional[str] = None
    ignore_chat_template: bool = False
    draft_p_min: Optional[float] = None
    ngram_max: Optional[int] = None
    ngram_min: Optional[int] = None
    lookup_history: Optional[str] = None
    dtype: Optional[str] = "auto"
    prefill_step_size: int = 2048
    rollback: str = "auto"
    rollback_memory_cap: Optional[float] = None  # MiB

    @property
    def rollback_memory_cap_bytes(self) -> Optional[int]:
        return None if self.rollback_memory_cap is None else int(self.rollback_memory_cap * 2**20)
    adapter_path: Optional[str] = None
    trust_remote_code: bool = False
    force_download: bool = False
    kv_bits: Optional[int] = None
    kv_group_size: int = 64
    chat_template_config: Optional[str] = None
    prefill_response: Optional[str] = None
    extra_eos_token: Optional[list[str]] = None
    memory_check: bool = True


@dataclass
class GenerateOptions(ModelOptions):
    """Everything ``specdec generate`` was asked to do."""

    block_size: Optional[int] = None
    num_draft_tokens: Optional[int] = None
    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    adaptive: bool = True
    compare_ar: bool = False
    json_output: bool = False
    live: bool = True
    verbose: bool = False


@dataclass
class SweepOptions(ModelOptions):
    """Everything ``specdec sweep`` was asked to do."""

    block_sizes: str = "2,3,4,6,8,12,16"
    max_tokens: int = 128
    repeats: int = 1
    warmup: int = 1
    json_output: bool = False


@dataclass
class Setup:
    """Loaded models, the drafter kind and the prompt ids."""

    options: ModelOptions
    kind: str
    target: Loaded
    draft: Optional[Loaded]
    prompt_ids: list[int]
    history: Optional[LookupHistory] = None
    mtp: Optional[LoadedHead] = None
    # The target's embedding and lm_head, for drafters that reuse them (dflash).
    parts: Optional[TargetParts] = None

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def eos_ids(self) -> list[int]:
        return sorted(self.tokenizer.eos_token_ids)

    @property
    def model_line(self) -> str:
        """Which model ran, in what dtype (``--dtype auto`` says so)."""
        auto = " (--dtype auto)" if self.options.dtype == "auto" else ""
        return f"Model: {self.target.name}, {self.target.dtype}{auto}"

    @property
    def drafter_name(self) -> str:
        if self.kind in ("mtp", "lookup+mtp") and self.mtp is not None and self.mtp.source != self.target.name:
            return f"{self.kind} ({self.mtp.source})"
        if self.kind == "dflash" and self.options.draft_model:
            return f"{self.kind} ({self.options.draft_model})"
        return f"model ({self.options.draft_model})" if self.draft else self.kind

    def block_size(self, requested: Optional[int], resolved: int) -> int:
        """The block size to run. A DFlash drafter brings its own default and limit (its trained
        block size), known only once it is loaded, as does the kind ``--drafter auto`` picks;
        ``requested`` is None when no option set one."""
        if self.options.drafter == "auto" and self.kind != "dflash":
            if requested is None:
                return DEFAULT_BLOCK_SIZE[self.kind]
            check_block_size(requested, self.kind)
            return requested
        if self.kind != "dflash":
            return resolved
        config = self.draft.model.config
        if requested is None:
            return config.default_block_size
        if requested > config.block_size:
            raise OptionError(
                f"the DFlash drafter fills blocks of at most {config.block_size} tokens: "
                f"give --block-size <= {config.block_size}"
            )
        return requested

    def make_drafter(self, policy=None) -> Drafter:
        """A fresh drafter for one run; a lookup drafter sizes its drafts with ``policy`` when it learns."""
        opts = self.options
        if self.kind == "lookup":
            size = policy.size if isinstance(policy, MatchLength) else None
            return SuffixDrafter(size, self.history.outputs() if self.history else (), self.eos_ids)
        if self.kind == "ngram":
            return NgramDrafter(opts.ngram_max or NGRAM_MAX, opts.ngram_min or NGRAM_MIN)
        if self.kind == "mtp":
            return MTPDrafter(self.mtp.head, self.mtp.parts, p_min=opts.draft_p_min or 0.0)
        if self.kind == "lookup+mtp":
            head = MTPDrafter(self.mtp.head, self.mtp.parts, p_min=opts.draft_p_min or 0.0)
            return HybridDrafter(SuffixDrafter(policy.size, stop_ids=self.eos_ids), head, policy)
        if self.kind == "dflash":
            return DFlashDrafter(self.draft.model, self.parts, p_min=opts.draft_p_min or 0.0)
        return ModelDrafter(self.draft.model, vocab_size=_vocab_size(self.target.config),
                            p_min=opts.draft_p_min or 0.0)


def check_model_options(opts: ModelOptions) -> str:
    """Validate the shared options without loading anything; returns the drafter kind."""
    kind = resolve_drafter(opts.drafter, opts.draft_model)
    check_drafter_options(kind, opts)
    return kind


def load_setup(opts: ModelOptions, kind: str) -> Setup:
    """Read the prompt, load target (and draft model), check tokenizers, encode the prompt."""
    text = read_prompt(opts.prompt_arg, opts.prompt)
    target = load_target(opts)
    if opts.kv_bits is not None:
        check_kv_quantization(target.model, opts.kv_bits, opts.kv_group_size)
    draft = mtp = parts = None
    draft_path = resolve(opts.draft_model, opts.force_download) if opts.draft_model else None
    head_path = None
    if kind == "auto":
        kind, head_path, why = choose_drafter(target, draft_path)
        print_stderr([f"drafter: auto -> {kind} ({why})"])
    if kind == "model" and is_dflash(draft_path):
        # A DFlash checkpoint: no tokenizer of its own; it must fit the target's layers,
        # width and vocabulary.
        kind = "dflash"
        draft = load_dflash(opts.draft_model, opts.dtype, path=draft_path)
        parts = target_parts(target.model)
        check_target(draft.model.config, parts)
    if kind == "model" and opts.drafter in (None, "auto") and is_mtp_sidecar(draft_path):
        kind = "mtp"  # --draft-model names an MTP-only folder
    if kind == "lookup+mtp" and not getattr(opts, "adaptive", False):
        # Choosing per block is the adaptive policy's work: --no-adaptive (and sweep, which
        # measures fixed block sizes) drafts with the head alone.
        kind = "mtp"
    if kind == "mtp" and opts.draft_model is None and not has_own_head(target):
        head_path = bundled_head(target)  # the bundled model's head is its own
    if kind in ("mtp", "lookup+mtp") and head_path is not None:
        mtp = load_mtp(str(head_path), head_path, target, opts.dtype)
        mtp.source = "bundled head"
    elif kind in ("mtp", "lookup+mtp"):
        mtp = load_mtp(opts.draft_model, draft_path, target, opts.dtype)
    if kind == "model":
        draft = load(opts.draft_model, opts.dtype, path=draft_path, trust_remote_code=opts.trust_remote_code)
        check_same_tokenizer(target.tokenizer, draft.tokenizer)
    for token in opts.extra_eos_token or ():
        try:
            target.tokenizer.add_eos_token(token)
        except ValueError:
            raise OptionError(f"--extra-eos-token {token!r} is not a token of this tokenizer") from None
    template = json.loads(opts.chat_template_config) if opts.chat_template_config else {}
    prompt_ids = encode_prompt(target.tokenizer, text, _clean(opts.system_prompt, "--system-prompt"),
                               opts.ignore_chat_template, template,
                               _clean(opts.prefill_response, "--prefill-response"))
    line = blas.note(cpu_backend=mx.default_device() == mx.cpu)
    if line:
        print_stderr([line])
    history = None
    if opts.lookup_history is not None:
        history = LookupHistory.load(opts.lookup_history, tokenizer_fingerprint(target.tokenizer))
        if history.warning:
            print_stderr([f"warning: {history.warning}"])
    return Setup(opts, kind, target, draft, prompt_ids, history, mtp, parts)


def choose_drafter(target: Loaded, draft_path: Optional[Path]) -> tuple[str, Optional[Path], str]:
    """What ``--drafter auto`` runs: the drafter kind, a head to load, and why.

    A drafter named with ``--draft-model`` comes first (a DFlash or MTP
    checkpoint, or a draft model), then the target's own MTP head, then a
    head bundled for the target, then prompt lookup.
    """
    if draft_path is not None:
        if is_dflash(draft_path):
            return "dflash", None, "the DFlash drafter --draft-model names"
        if is_mtp_sidecar(draft_path):
            return "lookup+mtp", None, "lookup where the text repeats, the MTP head --draft-model names elsewhere"
        return "model", None, "the draft model --draft-model names"
    if has_own_head(target):
        return "lookup+mtp", None, "lookup where the text repeats, the model's own MTP head elsewhere"
    head = bundled_head(target)
    if head is not None and bundled.HEAD_BEATS_LOOKUP:
        return "lookup+mtp", head, "lookup where the text repeats, the head distilled for the bundled model elsewhere"
    if head is not None:
        return "lookup", None, ("the head distilled for the bundled model measured slower than prompt lookup; "
                                "--drafter mtp runs it")
    return "lookup", None, "no drafter for this model"


def bundled_head(target: Loaded) -> Optional[Path]:
    """The distilled head shipped for ``target`` when it is the bundled model."""
    head = bundled.head_dir()
    return head if head is not None and bundled.is_bundled(target.path) else None


def has_own_head(target: Loaded) -> bool:
    """Whether the target's checkpoint carries ``mtp.*`` tensors of a family specdec builds heads for."""
    from .drafters.mtp import QWEN_FAMILIES, mtp_tensor_files

    return target.config.get("model_type") in QWEN_FAMILIES and bool(mtp_tensor_files(target.path))


def load_target(opts: ModelOptions) -> Loaded:
    """The target: ``--model``, or else the bundled default model (no network).

    Raises:
        BundledModelError: The bundled model is missing or damaged (a broken install).
    """
    kw = dict(adapter_path=opts.adapter_path, trust_remote_code=opts.trust_remote_code)
    if opts.model is not None:
        return load(opts.model, opts.dtype, force_download=opts.force_download, **kw)
    path = bundled.require()
    try:
        target = load(str(path), opts.dtype, **kw)
    except Exception as e:  # whatever a damaged file makes mlx-lm raise
        raise bundled.BundledModelError(bundled.broken_message(str(e))) from None
    target.name = bundled.DISPLAY_NAME
    return target


def fit_context(setup: Setup, max_tokens: int) -> tuple[int, Optional[int]]:
    """Refuse a prompt the model's context cannot hold; cap generation at the context.

    Returns:
        The most tokens to generate, and the context length (None: unknown).

    Raises:
        PromptTooLongError: The prompt alone fills the context.
    """
    found = context_length(setup.target.config)
    if found is None:
        return max_tokens, None
    limit, source = found
    n = len(setup.prompt_ids)
    if n >= limit:
        raise PromptTooLongError(
            f"the prompt is {n} tokens but the model's context is {limit} tokens ({source}): "
            "shorten the prompt"
        )
    return min(max_tokens, limit - n), limit


def check_memory(setup: Setup, tokens: int, chunk: int, opts: ModelOptions) -> MemoryEstimate:
    """Estimate the run's peak memory; refuse it when the device has less.

    Raises:
        MemoryLimitError: Naming both figures and ``--no-memory-check``.
    """
    # A draft model's caches grow with the context; other drafters' state is small.
    estimate = estimate_memory(setup.target.model, setup.target.config,
                               setup.draft.model if setup.draft else None, tokens, chunk,
                               opts.kv_bits, opts.kv_group_size, draft_cache=setup.kind == "model")
    have = device_memory()
    if opts.memory_check and have is not None and estimate.total > have[0]:
        raise MemoryLimitError(
            f"this run needs about {gb(estimate.total)} (weights {gb(estimate.weights)}, caches for "
            f"{tokens} tokens {gb(estimate.cache)}, prefill scratch {gb(estimate.scratch)}) but the "
            f"device has {gb(have[0])} ({have[1]}): lower --max-tokens or shorten the prompt, "
            "or pass --no-memory-check to try anyway"
        )
    return estimate


def resolve_block_size(block_size: Optional[int], num_draft_tokens: Optional[int], kind: str = "model") -> int:
    """``--block-size B`` or ``--num-draft-tokens K`` (B = K + 1), not both; the kind's default and limit."""
    if block_size is not None and num_draft_tokens is not None:
        raise OptionError("give --block-size or --num-draft-tokens (= block size - 1), not both")
    if num_draft_tokens is not None:
        block_size = num_draft_tokens + 1
    if block_size is None:
        return DEFAULT_BLOCK_SIZE[kind]
    check_block_size(block_size, kind, "--block-size" if num_draft_tokens is None else "--num-draft-tokens + 1")
    return block_size


def check_block_size(block_size: int, kind: str, option: str = "--block-size") -> None:
    """At most the drafter kind's maximum."""
    if block_size > MAX_BLOCK_SIZE[kind]:
        raise OptionError(f"{option} is at most {MAX_BLOCK_SIZE[kind]} with --drafter {kind} (got {block_size})")


def resolve_drafter(drafter: Optional[str], draft_model: Optional[str]) -> str:
    """The drafter kind: ``model`` with a draft model, otherwise prompt ``lookup`` (or ``ngram``).

    ``mtp`` reads the target's own MTP head, or the sidecar ``--draft-model`` names.
    """
    kind = drafter or ("model" if draft_model else "lookup")
    if kind == "model" and not draft_model:
        raise OptionError("--drafter model needs --draft-model REPO_OR_DIR")
    if kind not in ("model", "mtp", "auto") and draft_model:
        raise OptionError(f"--draft-model is only used with --drafter model, mtp or auto, not --drafter {kind}")
    return kind


def check_drafter_options(kind: str, opts: ModelOptions) -> None:
    """Options that only one drafter kind understands."""
    if kind == "auto" and (opts.ngram_max is not None or opts.ngram_min is not None
                           or opts.lookup_history is not None):
        raise OptionError("--ngram-*/--lookup-history apply to one lookup drafter: name it with --drafter "
                          "lookup or ngram instead of auto")
    if kind not in ("model", "mtp", "auto") and opts.draft_p_min is not None:
        raise OptionError("--draft-p-min applies to a draft model or an MTP head: drop it or pass --draft-model")
    if kind != "ngram" and (opts.ngram_max is not None or opts.ngram_min is not None):
        raise OptionError("--ngram-max/--ngram-min apply to --drafter ngram (the default lookup matches any length)")
    if kind != "lookup" and opts.lookup_history is not None:
        raise OptionError(f"--lookup-history applies to --drafter lookup, not --drafter {kind}")
    if opts.draft_p_min is not None and not 0 <= opts.draft_p_min <= 1:
        raise OptionError("--draft-p-min must be within [0, 1]")
    lo, hi = opts.ngram_min or NGRAM_MIN, opts.ngram_max or NGRAM_MAX
    if kind == "ngram" and not 1 <= lo <= hi:
        raise OptionError(f"need 1 <= --ngram-min ({lo}) <= --ngram-max ({hi})")


def warn(line: str) -> None:
    """One warning line on stderr."""
    sys.stderr.write(f"warning: {line}\n")
    sys.stderr.flush()


def _decode(data: bytes, where: str) -> str:
    """UTF-8 text from any bytes: what is not UTF-8 becomes U+FFFD, with one warning."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        warn(f"{where} is not valid UTF-8: the bytes that are not became U+FFFD")
        return data.decode("utf-8", "replace")


def _clean(text: Optional[str], where: str) -> Optional[str]:
    """Text from the command line as UTF-8 (argv bytes that were not arrive as surrogates)."""
    if text is None:
        return None
    try:
        data = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        data = text.encode("utf-8", "replace")
    return _decode(data, where)


def _stdin_bytes() -> bytes:
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is not None:
        return buffer.read()
    return sys.stdin.read().encode("utf-8", "surrogateescape")


def read_prompt(prompt_arg: Optional[str], prompt: Optional[str]) -> str:
    """The prompt text from the argument or ``-p``; ``-`` reads stdin.

    Any bytes are accepted: what is not UTF-8 is replaced (one warning line).

    Raises:
        OptionError: No prompt, two prompts, or an empty one.
    """
    if prompt_arg is not None and prompt is not None:
        raise OptionError("give the prompt once: as PROMPT or with --prompt/-p, not both")
    text = prompt if prompt is not None else prompt_arg
    if text is None:
        raise OptionError("no prompt: pass PROMPT, --prompt TEXT, or - to read stdin")
    if text == "-":
        text = _decode(_stdin_bytes(), "stdin")
        if not text.strip():
            raise OptionError("stdin was empty: pipe a prompt in, or pass it as PROMPT or --prompt TEXT")
        return text
    text = _clean(text, "the prompt")
    if not text.strip():
        raise OptionError("the prompt is empty: give some text (PROMPT, --prompt TEXT, or - for stdin)")
    # As mlx-lm does: escaped newlines and tabs typed on a command line.
    return text.replace("\\n", "\n").replace("\\t", "\t")


@contextmanager
def _no_length_warning():
    # transformers warns when a text is longer than the tokenizer's
    # model_max_length; the context check says it better, in one line.
    logger = logging.getLogger("transformers.tokenization_utils_base")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def encode_prompt(tokenizer, text: str, system_prompt: Optional[str], ignore_chat_template: bool,
                  template_kwargs: Optional[dict] = None, prefill_response: Optional[str] = None) -> list[int]:
    """Token ids of the prompt, through the chat template when there is one (as mlx-lm's generate)."""
    use_template = tokenizer.has_chat_template and not ignore_chat_template
    if not use_template:
        why = "--ignore-chat-template is set" if ignore_chat_template else "the tokenizer has no chat template"
        for name, value in (("--system-prompt", system_prompt), ("--prefill-response", prefill_response),
                            ("--chat-template-config", template_kwargs or None)):
            if value is not None:
                raise OptionError(f"{name} needs the chat template, but {why}: drop {name}")
        with _no_length_warning():
            return tokenizer.encode(text)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    messages.append({"role": "user", "content": text})
    prefill = prefill_response is not None
    if prefill:
        messages.append({"role": "assistant", "content": prefill_response})
    try:
        templated = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=not prefill, continue_final_message=prefill,
            **(template_kwargs or {}),
        )
    except Exception as e:  # jinja and tokenizer libraries raise many types
        raise OptionError(f"the chat template failed on this prompt and its options ({e})") from None
    with _no_length_warning():
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


def make_policy(adaptive: bool, block_size: int, kind: str = "model"):
    """Adaptive draft length up to block size - 1 (learned by match length for lookup), or a fixed one."""
    if adaptive and block_size > 1:
        if kind == "lookup+mtp":
            return HybridLength(k_max=block_size - 1)
        return MatchLength(k_max=block_size - 1) if kind == "lookup" else AdaptiveLength(k_max=block_size - 1)
    return FixedLength(block_size - 1)


def generate_command(opts: GenerateOptions) -> int:
    """Run ``specdec generate``; returns the exit code."""
    kind = check_model_options(opts)
    block_size = resolve_block_size(opts.block_size, opts.num_draft_tokens, kind)
    sampling = sampling_params(opts)
    if opts.seed is not None:
        mx.random.seed(opts.seed)
    setup = load_setup(opts, kind)
    asked = None if opts.block_size is None and opts.num_draft_tokens is None else block_size
    kind, block_size = setup.kind, setup.block_size(asked, block_size)
    target, tokenizer, prompt_ids = setup.target, setup.tokenizer, setup.prompt_ids
    drafter_name = setup.drafter_name
    max_tokens, context = fit_context(setup, opts.max_tokens)
    estimate = check_memory(setup, len(prompt_ids) + max_tokens, opts.prefill_step_size, opts)
    kv = dict(kv_bits=opts.kv_bits, kv_group_size=opts.kv_group_size)

    stats = Stats(prompt_tokens=len(prompt_ids))
    tokens: list[int] = []
    detok = tokenizer.detokenizer
    detok.reset()
    interrupted = False
    policy = make_policy(opts.adaptive, block_size, kind)
    view = NoText()
    try:
        if opts.verbose:
            print_stderr([f"Prefill: {len(prompt_ids)} prompt tokens, context {context or 'unknown'}; memory "
                          f"estimate {gb(estimate.total)} (weights {gb(estimate.weights)}, caches "
                          f"{gb(estimate.cache)}, prefill scratch {gb(estimate.scratch)})"])
        mx.reset_peak_memory()
        view = text_view(opts.live, drafter_name, opts.json_output)
        events = run(
            target.model, prompt_ids, drafter=setup.make_drafter(policy), policy=policy,
            max_tokens=max_tokens, eos_ids=setup.eos_ids, sampling=sampling, rollback=opts.rollback,
            rollback_memory_cap=opts.rollback_memory_cap_bytes,
            prefill_step_size=opts.prefill_step_size, prefill_seconds=PREFILL_CHUNK_S, timed=opts.verbose, **kv,
            seed=opts.seed,
        )
        # closing(): whatever stops the loop, the run's own cleanup happens now.
        with closing(events):
            for event in events:
                if not isinstance(event, Step):
                    stats.note(event)
                    continue
                # The commit point: whatever ends the run, `tokens` is what was generated.
                tokens += event.block.tokens
                stats.add(event.block, event.seconds)
                for tok in event.block.tokens:
                    detok.add_token(tok)
                view.write(detok.last_segment)
                view.update(stats)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        # A Ctrl-C between the lines above: show and count exactly the committed tokens.
        for tok in tokens[len(detok.tokens):]:
            detok.add_token(tok)
        stats.generated = len(tokens)
        detok.finalize()
        view.write(detok.last_segment)
        view.close()
    peak_gb = mx.get_peak_memory() / 1e9
    if setup.history is not None:
        setup.history.add(tokens)
        try:
            setup.history.save()
        except OSError as e:
            print_stderr([f"warning: could not save the lookup history {setup.history.path} ({e.strerror})"])
    finish = finish_reason(stats, interrupted, max_tokens < opts.max_tokens)
    if finish == "context":
        print_stderr([f"Stopped at the model's context: {context} tokens (prompt {len(prompt_ids)} + "
                      f"{stats.generated} generated; --max-tokens asked for {opts.max_tokens})"])

    comparison = None
    compare_interrupted = False
    if opts.compare_ar and not interrupted:
        try:
            comparison = compare_with_plain(
                target.model, prompt_ids, tokens, stats.trace, max_tokens=max_tokens, eos_ids=setup.eos_ids,
                prefill_step_size=opts.prefill_step_size, prefill_chunks=stats.prefill_chunks, **kv,
            )
        except KeyboardInterrupt:
            compare_interrupted = True

    if opts.json_output:
        report = {
            "text": detok.text,
            "model": target.name,
            "model_path": str(target.path),
            "dtype": target.dtype,
            "draft_model": opts.draft_model,
            "drafter": setup.kind,
            "block_size": block_size,
            "rollback": stats.rollback_choice["strategy"] if stats.rollback_choice else None,
            "sampling": {"temp": sampling.temp, "top_p": sampling.top_p, "top_k": sampling.top_k,
                         "min_p": sampling.min_p, "seed": opts.seed},
            "adaptive": policy.summary(),
            "peak_memory_gb": peak_gb,
            "memory_estimate_gb": estimate.total / 1e9,
            "context_length": context,
            "kv_bits": opts.kv_bits,
            **stats.to_dict(),
            "finish_reason": finish,
            "interrupted": interrupted or compare_interrupted,
        }
        if comparison is not None:
            report["compare"] = _comparison_dict(comparison, stats, tokenizer)
        elif compare_interrupted:
            report["compare"] = None
        sys.stdout.write(json.dumps(report) + "\n")
        sys.stdout.flush()
    else:
        lines = [setup.model_line] + summary_lines(stats, drafter=drafter_name, block_size=block_size,
                                                   peak_gb=peak_gb, verbose=opts.verbose)
        lines += policy_lines(policy.summary())
        lines.append(f"Finish reason: {finish}" + (" (Ctrl-C or SIGTERM)" if interrupted else ""))
        if comparison is not None:
            lines += comparison_lines(comparison, stats, lambda t: tokenizer.decode([t]))
        if compare_interrupted:
            lines.append("Compare: interrupted (Ctrl-C or SIGTERM) during the plain run")
        print_stderr(lines)

    if interrupted or compare_interrupted:
        return EXIT_INTERRUPTED
    if comparison is not None and not comparison.ok:
        return EXIT_DIVERGED
    return 0


def finish_reason(stats: Stats, interrupted: bool, capped: bool) -> Optional[str]:
    """``eos``, ``length``, ``context`` (the model's context ended it) or ``interrupted``."""
    if interrupted:
        return "interrupted"
    if stats.finish_reason == "length" and capped:
        return "context"
    return stats.finish_reason


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
            "verify_rows": d.rows,
            "verify_row": d.row,
            "verify_token": token(d.verify_token),
            "reproduced": d.reproduced,
            "replay_mismatch": d.mismatch,
        }
    ar_tps = cmp.plain.decode_tps
    return {
        "identical": cmp.identical,
        "verdict": cmp.verdict,
        # Log-probability units, as greedy selection compares them.
        "margin": cmp.divergence.margin if cmp.divergence else None,
        "difference": cmp.divergence.difference if cmp.divergence else None,
        "tokens": cmp.tokens,
        "first_divergence": divergence,
        "ar_decode_tps": ar_tps,
        "speedup": stats.decode_tps / ar_tps if ar_tps else None,
    }


def parse_block_sizes(text: str) -> list[int]:
    """``"2,3,4"`` -> ``[2, 3, 4]``: distinct block sizes >= 1, in the order given (limits: check_block_size)."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise OptionError(f"--block-sizes takes comma-separated integers, like 2,4,8 (got {text!r})") from None
    if not sizes or min(sizes) < 1:
        raise OptionError("--block-sizes needs at least one block size, each >= 1")
    if len(set(sizes)) != len(sizes):
        raise OptionError(f"--block-sizes lists a size twice ({text})")
    return sizes


def sweep_command(opts: SweepOptions) -> int:
    """Run ``specdec sweep``; returns the exit code."""
    sizes = parse_block_sizes(opts.block_sizes)
    if opts.repeats < 1 or opts.warmup < 0:
        raise OptionError("--repeats must be >= 1 and --warmup >= 0")
    kind = check_model_options(opts)
    for size in sizes:
        check_block_size(size, kind, "--block-sizes")
    setup = load_setup(opts, kind)
    for size in sizes:
        setup.block_size(size, size)
    max_tokens, _ = fit_context(setup, opts.max_tokens)
    check_memory(setup, len(setup.prompt_ids) + max_tokens, opts.prefill_step_size, opts)
    events = sweep(
        setup.target.model, setup.prompt_ids, setup.make_drafter, sizes, max_tokens=max_tokens,
        eos_ids=setup.eos_ids, repeats=opts.repeats, warmup=opts.warmup, rollback=opts.rollback,
        rollback_memory_cap=opts.rollback_memory_cap_bytes,
        prefill_step_size=opts.prefill_step_size, prefill_seconds=PREFILL_CHUNK_S,
        kv_bits=opts.kv_bits, kv_group_size=opts.kv_group_size,
    )
    result = None
    with sweep_progress() as advance, closing(events):
        for event in events:
            if isinstance(event, SweepResult):
                result = event
            else:
                advance(event)
    if opts.json_output:
        sys.stdout.write(json.dumps({"model": setup.target.name, "model_path": str(setup.target.path),
                                     "dtype": setup.target.dtype, "drafter": setup.drafter_name,
                                     **result.to_dict()}) + "\n")
    else:
        print_stderr([setup.model_line])
        print_sweep(result, setup.drafter_name)
    if any(row.verdict == DIVERGED for row in result.rows):
        print_stderr(["error: a speculative run diverged from plain decoding (see the 'same' column)"])
        return EXIT_DIVERGED
    return 0


@dataclass
class DoctorOptions:
    """What ``specdec doctor`` was asked to do."""

    json_output: bool = False


def doctor_command(opts: DoctorOptions) -> int:
    """Run ``specdec doctor``: the report on stdout; always exits 0."""
    report = doctor.collect()
    if opts.json_output:
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        sys.stdout.write("\n".join(doctor.lines(report)) + "\n")
    return 0
