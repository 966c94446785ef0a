"""The options every face shares (models, drafter, rollback), checked without loading anything.

A bad combination fails here in milliseconds, before a model is loaded, with a
message that names the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from ..core.adaptive import AdaptiveLength, FixedLength, HybridLength, MatchLength
from ..defaults import DEFAULT_KV_GROUP_SIZE
from ..drafters import kinds
from ..drafters.kinds import DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE, NGRAM_MAX, NGRAM_MIN
from ..drafters.history import check_path
from ..errors import OptionError
from ..model.files import is_local
from ..core.sampling import SamplingParams


@dataclass
class ModelOptions:
    """What every command that runs a model needs: the models, the drafter and the prompt."""

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
    shapes: str = "auto"  # verify widths: auto, exact, bucketed (specdec_cli.core.shapes)
    exact: bool = False  # every forward shape-invariant (specdec_cli.model.exact)
    adapter_path: Optional[str] = None
    trust_remote_code: bool = False
    force_download: bool = False
    kv_bits: Optional[int] = None
    kv_group_size: Optional[int] = None  # None: not given (64 with --kv-bits, mlx-lm's default)
    chat_template_config: Optional[str] = None
    prefill_response: Optional[str] = None
    extra_eos_token: Optional[list[str]] = None
    memory_check: bool = True
    pipeline: bool = False  # under mlx.launch: pipeline parallel instead of tensor parallel

    @property
    def kv_group(self) -> int:
        """The KV quantization group size a run uses."""
        return DEFAULT_KV_GROUP_SIZE if self.kv_group_size is None else self.kv_group_size

    @property
    def rollback_memory_cap_bytes(self) -> Optional[int]:
        return None if self.rollback_memory_cap is None else int(self.rollback_memory_cap * 2**20)


@dataclass
class RunOptions(ModelOptions):
    """What a face that generates adds to the model options: block size, draft-length policy, sampling."""

    block_size: Optional[int] = None
    num_draft_tokens: Optional[int] = None
    adaptive: bool = True
    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: Optional[float] = None
    repetition_context_size: int = 20
    json_schema: Optional[str] = None  # a file holding a JSON schema
    prompt_cache_dir: Optional[str] = None  # the disk tier's folder (None: disk_tier.default_dir())
    prompt_cache_disk_gb: Optional[float] = None  # its bound (None: disk_tier.default_max_bytes; 0: off)

    @property
    def asked_block_size(self) -> bool:
        """Whether ``--block-size`` or ``--num-draft-tokens`` was given (else the drafter's default runs)."""
        return self.block_size is not None or self.num_draft_tokens is not None


def check_model_options(opts: ModelOptions) -> str:
    """Validate the shared options without loading anything; returns the drafter kind."""
    kind = resolve_drafter(opts.drafter, opts.draft_model)
    check_drafter_options(kind, opts)
    if opts.kv_group_size is not None and opts.kv_bits is None:
        raise OptionError("--kv-group-size is the group size of --kv-bits: add --kv-bits N, or drop it")
    if opts.force_download:
        check_force_download(opts.model, opts.draft_model)
    if opts.exact and opts.kv_bits is not None:
        raise OptionError("--exact computes attention over the keys as computed; a quantized KV cache (--kv-bits) "
                          "reads them through its own kernels: drop one of them")
    return kind


def hidden_states_refused(what: str) -> OptionError:
    """The refusal of a drafter that reads the target's hidden states under pipeline parallelism."""
    return OptionError(f"{what} reads the target's hidden states, which pipeline parallelism keeps on one rank: "
                       "drop --pipeline (tensor parallel), or draft with --drafter lookup or a draft model")


def check_distributed_options(opts: ModelOptions, kind: str, sharded: bool) -> None:
    """What a target sharded over ranks cannot do, refused before anything is loaded.

    Args:
        opts: The options.
        kind: The drafter kind asked for.
        sharded: The process runs as one of several ranks (``mlx.launch``).
    """
    if not sharded:
        return
    if opts.adapter_path is not None:
        raise OptionError("--adapter-path cannot be used with a sharded target (mlx-lm shards the plain "
                          "layers that LoRA wraps): fuse the adapters first with mlx_lm.fuse")
    if opts.exact:
        raise OptionError("--exact is not built for a target sharded under mlx.launch yet (its sharded layers "
                          "reduce over ranks in their own order): run it in one process, or without --exact")
    if opts.pipeline and kinds.kind(kind).hidden_states:
        raise hidden_states_refused(f"--drafter {kind}")
    if "-" in (opts.prompt, opts.prompt_arg):
        raise OptionError("under mlx.launch stdin never ends (mlx.launch keeps the ranks' stdin open): pass the "
                          "prompt as an argument, e.g. -p \"$(cat prompt.txt)\"")


def check_force_download(model: Optional[str], draft_model: Optional[str] = None) -> None:
    """Refuse ``--force-download`` when no model it names is a Hub repo (``model`` None: the bundled one)."""
    names = [model] + ([draft_model] if draft_model is not None else [])
    local = ["the bundled model" if name is None else name for name in names if name is None or is_local(name)]
    if len(local) == len(names):
        where = "is a local folder" if len(local) == 1 else "are local folders"
        raise OptionError(f"--force-download downloads Hub repos again; {' and '.join(local)} {where}: "
                          "drop --force-download")


def resolve_block_size(block_size: Optional[int], num_draft_tokens: Optional[int], kind: str) -> int:
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


def parse_int_list(text: str, option: str, example: str, noun: str, short: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``: distinct integers >= 1, in the order given, or an error naming ``option``.

    Args:
        text: What the option was given.
        option: Its name, for the errors.
        example: A valid value, for the errors.
        noun: What one item is ("level"), and ``short`` its short form for "lists a ... twice".
    """
    try:
        items = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise OptionError(f"{option} takes comma-separated integers, like {example} (got {text!r})") from None
    if not items or min(items) < 1:
        raise OptionError(f"{option} needs at least one {noun}, each >= 1")
    if len(set(items)) != len(items):
        raise OptionError(f"{option} lists a {short} twice ({text})")
    return items


def resolve_drafter(drafter: Optional[str], draft_model: Optional[str]) -> str:
    """The drafter kind the options name (:func:`specdec_cli.drafters.kinds.named`)."""
    return kinds.named(drafter, draft_model)


def check_drafter_options(kind: str, opts: ModelOptions) -> None:
    """Options that only one drafter kind understands (:func:`specdec_cli.drafters.kinds.check_options`), and
    their ranges."""
    given = {name: value for name in ("ngram_max", "ngram_min", "lookup_history", "draft_p_min")
             if (value := getattr(opts, name)) is not None}
    kinds.check_options(kind, given)
    if opts.draft_p_min is not None and not 0 <= opts.draft_p_min <= 1:
        raise OptionError("--draft-p-min must be within [0, 1]")
    lo, hi = opts.ngram_min or NGRAM_MIN, opts.ngram_max or NGRAM_MAX
    if "ngram_min" in kinds.kind(kind).options and not 1 <= lo <= hi:
        raise OptionError(f"need 1 <= --ngram-min ({lo}) <= --ngram-max ({hi})")
    if opts.lookup_history is not None:
        check_path(opts.lookup_history)  # a device, FIFO or someone else's file fails before any model loads


def sampling_params(temp: float, top_p: float, top_k: int, min_p: float, compare_ar: bool = False,
                    seed: Optional[int] = None) -> SamplingParams:
    """Checked sampling options: mlx-lm's meanings; filters need --temp > 0, and --compare-ar
    at --temp > 0 a seed (its draws keyed by position, which plain decoding can repeat)."""
    if temp < 0:
        raise OptionError("--temp must be >= 0")
    if not 0 <= top_p <= 1:
        raise OptionError("--top-p must be within [0, 1] (0 disables it)")
    if not 0 <= min_p <= 1:
        raise OptionError("--min-p must be within [0, 1] (0 disables it)")
    if top_k < 0:
        raise OptionError("--top-k must be >= 0 (0 disables it)")
    params = SamplingParams(temp, top_p, top_k, min_p)
    if params.greedy:
        # --top-p 1 filters nothing (mlx-lm's default, written out by scripts made for it): no error for it.
        filters = [n for n, v in (("--top-p", 0 < top_p < 1), ("--top-k", top_k), ("--min-p", min_p)) if v]
        if filters:
            one = len(filters) == 1
            raise OptionError(f"{', '.join(filters)} only appl{'ies' if one else 'y'} when sampling: set --temp > 0 "
                              f"or drop {'it' if one else 'them'}")
    elif compare_ar and seed is None:
        raise OptionError("--compare-ar at --temp > 0 needs --seed: unseeded draws differ from run to run, seeded "
                          "ones are plain decoding's with the same seed (or use --temp 0)")
    return params


def processor_fields(opts: RunOptions) -> dict:
    """The :class:`~specdec_cli.session.Request` fields of ``--repetition-penalty``,
    ``--repetition-context-size`` and ``--json-schema``, checked before anything is loaded.

    Raises:
        OptionError: A bad value, or a schema file that cannot be read or is not JSON.
    """
    from ..core.processors import Constraint

    fields: dict = {}
    penalty = opts.repetition_penalty
    if penalty is not None:
        if not penalty >= 0:
            raise OptionError("--repetition-penalty must be >= 0 (mlx-lm's: 1 and 0 change nothing; 1.1-1.3 are "
                              "usual)")
        fields["repetition_penalty"] = penalty
    if opts.repetition_context_size < 1:
        raise OptionError("--repetition-context-size must be >= 1 (mlx-lm's default is 20)")
    fields["repetition_context_size"] = opts.repetition_context_size
    if opts.json_schema is not None:
        path = opts.json_schema
        try:
            with open(path, encoding="utf-8-sig") as f:  # -sig: a byte-order mark (Windows editors) is no JSON
                text = f.read()
        except OSError as e:
            raise OptionError(f"cannot read --json-schema {path} ({e.strerror}): give a file holding a JSON "
                              "schema") from None
        except UnicodeDecodeError:
            raise OptionError(f"--json-schema {path} is not UTF-8 text: give a file holding a JSON schema") from None
        except ValueError:  # a name the file system cannot take (a lone surrogate, a NUL)
            raise OptionError(f"cannot read --json-schema {path!r}: give the path of a file holding a JSON "
                              "schema") from None
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise OptionError(f"--json-schema {path} is not valid JSON ({e}): fix the file") from None
        if not isinstance(schema, (dict, bool)):
            raise OptionError(f"--json-schema {path} holds a {type(schema).__name__}, not a JSON schema (an "
                              "object): fix the file")
        fields["constraint"] = Constraint.json_schema(schema)
    return fields


def make_policy(adaptive: bool, block_size: int, kind: str):
    """Adaptive draft length up to block size - 1 (the kind's rule: see ``DrafterKind.policy``), or a fixed one."""
    if adaptive and block_size > 1:
        rule = {"match-length": MatchLength, "hybrid": HybridLength}.get(kinds.kind(kind).policy, AdaptiveLength)
        return rule(k_max=block_size - 1)
    return FixedLength(block_size - 1)
