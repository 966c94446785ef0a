"""Load what a session runs: the target, the drafter it asked for (or ``auto`` picks), and the limits.

A :class:`Setup` is loaded once and serves every generation of a process: one
``generate``, every turn of a ``chat``, every request of a ``serve``.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx

from .. import __version__
from ..model import blas, bundled
from ..model import distributed
from ..cache.batch_check import exact_problem
from ..cache.caches import ModelCache, cache_kinds, check_kv_quantization
from ..model import exact
from ..drafters import kinds
from ..drafters.kinds import DEFAULT_BLOCK_SIZE, DFLASH, DRAFT_MODEL, MTP_HEAD, NGRAM_MAX, NGRAM_MIN
from ..model.distributed import Ranks
from ..model.fingerprint import ranks_fingerprint
from ..drafters import Drafter, LookupHistory
from ..drafters.base import Materials
from ..drafters.dflash import check_target
from ..drafters.history import tokenizer_fingerprint
from ..drafters.mtp_io import LoadedHead
from ..errors import AdapterError, OptionError, SpecdecError, UnsupportedModelError
from ..cache.limits import (MemoryEstimate, MemoryModel, context_length, device_memory, gb, memory_model,
                            wire_working_set)
from ..core.numerics import Numerics
from ..core.shapes import first_compile_note
from ..drafters.dflash_io import is_dflash, load_dflash
from ..drafters.mtp_io import is_mtp_sidecar, load_mtp
from ..model.files import Loaded, resolve
from .loading import check_same_tokenizer, load
from ..model.prompts import longest_token_chars
from ..model.taps import TargetParts, target_parts
from .options import ModelOptions, check_block_size, hidden_states_refused


class PromptTooLongError(SpecdecError):
    """The prompt alone does not fit in the model's context."""

    every_rank = True


class MemoryLimitError(SpecdecError):
    """The run's estimated peak memory exceeds what the device has."""


@dataclass
class Setup:
    """Loaded models and the drafter kind, ready to make a fresh drafter per generation."""

    options: ModelOptions
    kind: str
    target: Loaded
    draft: Optional[Loaded]
    history: Optional[LookupHistory] = None
    mtp: Optional[LoadedHead] = None
    # The target's embedding and lm_head, for drafters that reuse them (dflash).
    parts: Optional[TargetParts] = None
    # Lines for the user about what loading decided (auto's pick, a history set aside): the face prints them.
    notes: list[str] = field(default_factory=list)
    # The ranks the target is sharded over (None: one process holds it whole).
    ranks: Optional[Ranks] = None
    # The files the drafter was read from (for the ranks' handshake).
    drafter_path: Optional[Path] = None

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @functools.cached_property
    def numerics(self) -> Numerics:
        """The run's numerics (``--shapes`` and the device's attention kernels), resolved once for every request."""
        return Numerics.resolve(self.options.shapes, exact=self.options.exact)

    @property
    def eos_ids(self) -> list[int]:
        return sorted(self.tokenizer.eos_token_ids)

    @property
    def template_kwargs(self) -> dict:
        """``--chat-template-config`` as a dict (checked to be a JSON object by the CLI)."""
        text = self.options.chat_template_config
        return json.loads(text) if text else {}

    @property
    def model_line(self) -> str:
        """Which model ran, in what dtype (``--dtype auto`` says so)."""
        auto = " (--dtype auto)" if self.options.dtype == "auto" else ""
        return f"Model: {self.target.name}, {self.target.dtype}{auto}"

    @property
    def drafter_name(self) -> str:
        return kinds.describe(self.kind, head_source=self.mtp.source if self.mtp is not None else None,
                              target=self.target.name, draft_model=self.options.draft_model,
                              loaded_draft=self.draft is not None and kinds.kind(self.kind).loads == DRAFT_MODEL)

    def run_block_size(self, resolved: int) -> int:
        """The block size a face runs: ``resolved`` from the options when they named one, else the drafter's."""
        return self.block_size(resolved if self.options.asked_block_size else None, resolved)

    def block_size(self, requested: Optional[int], resolved: int, option: str = "--block-size") -> int:
        """The block size to run. A DFlash drafter brings its own default and limit (its trained
        block size), known only once it is loaded, as does the kind ``--drafter auto`` picks;
        ``requested`` is None when no option set one, ``option`` names the one that did."""
        own = kinds.kind(self.kind).own_sizes  # the drafter's own sizes (a DFlash config's)
        if self.options.drafter == kinds.AUTO.name and not own:
            if requested is None:
                return DEFAULT_BLOCK_SIZE[self.kind]
            check_block_size(requested, self.kind, option)
            return requested
        if not own:
            return resolved
        config = self.draft.model.config
        if requested is None:
            return config.default_block_size
        if requested > config.block_size:
            raise OptionError(
                f"the DFlash drafter fills blocks of at most {config.block_size} tokens: "
                f"give {option} <= {config.block_size}"
            )
        return requested

    def make_drafter(self, policy=None, draft_cache=None, recent: Sequence[Sequence[int]] = ()) -> Drafter:
        """A fresh drafter for one generation.

        Args:
            policy: A lookup drafter sizes its drafts with it when it learns.
            draft_cache: A draft model's caches to resume from (a prompt cache
                hit); the drafter then only feeds the prompt tokens they lack.
            recent: Earlier outputs a lookup drafter also drafts from (a server's corpus).
        """
        opts = self.options
        earlier = [*(self.history.outputs() if self.history else ()), *recent]
        return kinds.kind(self.kind).build(Materials(
            policy=policy, eos_ids=self.eos_ids, earlier=earlier, p_min=opts.draft_p_min or 0.0,
            ngram=(opts.ngram_max or NGRAM_MAX, opts.ngram_min or NGRAM_MIN),
            draft_model=self.draft.model if self.draft is not None else None, draft_cache=draft_cache,
            vocab_size=_vocab_size(self.target.config), head=self.mtp, parts=self.parts))

    def check_ranks(self, prompt_ids: list[int]) -> None:
        """Every rank loaded the same files and encoded the same prompt (no-op in one process).

        Raises:
            RanksDisagree: Naming what differs, on every rank alike.
        """
        if self.ranks is None:
            return
        drafter = ranks_fingerprint(self.drafter_path) if self.drafter_path is not None else self.kind
        self.ranks.handshake({"model": ranks_fingerprint(self.target.path), "drafter": drafter,
                              "prompt": list(prompt_ids)})

    def context(self) -> Optional[tuple[int, str]]:
        """The model's context length and where it was read (None: unknown)."""
        return context_length(self.target.config)

    @functools.cached_property
    def longest_token(self) -> Optional[int]:
        """The most characters one token stands for (see :func:`~specdec_cli.model.prompts.longest_token_chars`)."""
        return longest_token_chars(self.tokenizer)

    def check_prompt_chars(self, chars: int) -> None:
        """Refuse, before tokenizing it, a text too long for the context whatever its tokens.

        Raises:
            PromptTooLongError: ``chars`` characters cannot encode to fewer tokens than the context holds.
        """
        found, longest = self.context(), self.longest_token
        if found is None or longest is None:
            return
        limit, source = found
        least = -(-chars // longest)
        if least >= limit:
            raise PromptTooLongError(
                f"the prompt is {chars} characters, so at least {least} tokens (no token of this model is longer "
                f"than {longest} characters), but the model's context is {limit} tokens ({source}): shorten the prompt"
            )

    def fit_context(self, prompt_tokens: int, max_tokens: int) -> tuple[int, Optional[int]]:
        """Refuse a prompt the model's context cannot hold; cap generation at the context.

        Returns:
            The most tokens to generate, and the context length (None: unknown).

        Raises:
            PromptTooLongError: The prompt alone fills the context.
        """
        found = self.context()
        if found is None:
            return max_tokens, None
        limit, source = found
        if prompt_tokens >= limit:
            raise PromptTooLongError(
                f"the prompt is {prompt_tokens} tokens but the model's context is {limit} tokens ({source}): "
                "shorten the prompt"
            )
        return min(max_tokens, limit - prompt_tokens), limit

    def start_lines(self) -> list[str]:
        """What loading decided (``notes``), then the BLAS note: the lines a face shows before it runs."""
        return [line for line in (*self.notes, blas_note()) if line]

    @functools.cached_property
    def memory(self) -> MemoryModel:
        """The models' weights and cache growth, measured once (a one-token forward of each)."""
        opts = self.options
        # A draft model's caches grow with the context; other drafters' state is small.
        return memory_model(self.target.model, self.target.config, self.draft.model if self.draft else None,
                            opts.kv_bits, opts.kv_group, draft_cache=kinds.kind(self.kind).loads == DRAFT_MODEL)

    def check_memory(self, tokens: int) -> MemoryEstimate:
        """Estimate a generation's peak memory over ``tokens`` of context; refuse it when the device has less.

        Raises:
            MemoryLimitError: Naming both figures and ``--no-memory-check``.
        """
        opts = self.options
        estimate = self.memory.estimate(tokens, opts.prefill_step_size)
        have = device_memory()
        if opts.memory_check and have is not None and estimate.total > have[0]:
            raise MemoryLimitError(
                f"this run needs about {gb(estimate.total)} (weights {gb(estimate.weights)}, caches for "
                f"{tokens} tokens {gb(estimate.cache)}, prefill scratch {gb(estimate.scratch)}) but the "
                f"device has {gb(have[0])} ({have[1]}): lower --max-tokens or shorten the prompt, "
                "or pass --no-memory-check to try anyway"
            )
        return estimate


def join_ranks(opts: ModelOptions) -> Optional[Ranks]:
    """This process's ranks under ``mlx.launch`` (None alone), after every rank agreed on the options.

    Only rank 0 should show anything (the face mutes the others' display).

    Raises:
        RanksDisagree: The ranks were started with different options or versions.
    """
    # distill's options have no --pipeline (single_process refuses it under ranks all the same).
    ranks = distributed.join(getattr(opts, "pipeline", False))
    if ranks is None:
        return None
    import mlx_lm

    # Options named by flag, so that a refusal says which differ (a model at another path on one machine).
    flags = {f"--{k.replace('_', '-')}": v for k, v in vars(opts).items()}
    parts = {"options": sorted(vars(opts).items()), "versions": (__version__, mx.__version__, mlx_lm.__version__)}
    # A file every rank reads for itself: the same path may hold another file (or none) on another machine,
    # which rank 1 found only mid-run (the grammar refused rank 0's token) or said nothing of (unreadable).
    if getattr(opts, "json_schema", None) is not None:
        parts["--json-schema file"] = _file_digest(opts.json_schema)
    ranks.handshake(parts, details={"options": flags})
    return ranks


def _file_digest(path: str) -> str:
    """What a rank holds at ``path``: its contents' hash, or why it cannot read it (said later, alike on every rank)."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except (OSError, ValueError) as e:
        return f"unreadable ({getattr(e, 'strerror', None) or e})"


def single_process(opts: ModelOptions, face: str) -> None:
    """Refuse to start ``specdec FACE`` under ``mlx.launch``: it holds the whole model in one process.

    Raises:
        OptionError: Raised alike on every rank, so rank 0 alone says it.
    """
    if join_ranks(opts) is not None:
        raise OptionError(f"specdec {face} runs in one process: under mlx.launch, run specdec generate, sweep or "
                          f"serve (a {face} sharded over several machines is not built yet); start specdec {face} "
                          "without mlx.launch")


def load_setup(opts: ModelOptions, kind: str, ranks: Optional[Ranks] = None) -> Setup:
    """Load the target (and draft model or head), check tokenizers and stop tokens, open the history.

    With ``ranks`` the target is sharded over them; the drafter is whole on every rank.
    """
    pipelined = ranks is not None and ranks.mode == "pipeline"
    # The drafter's files first: what they are can refuse the run before the target loads.
    draft_path = resolve(opts.draft_model, opts.force_download) if opts.draft_model else None
    holds = folder_holds(draft_path)
    if pipelined and (holds == DFLASH or (opts.drafter is None and holds == MTP_HEAD)):
        raise hidden_states_refused("a DFlash drafter" if holds == DFLASH else "an MTP head")
    if opts.drafter is not None and kinds.kind(opts.drafter).loads == DRAFT_MODEL and holds == MTP_HEAD:
        # mlx-lm cannot build a head on its own; say which drafter reads it, before the target loads.
        head = next(k.name for k in kinds.KINDS.values() if k.loads == MTP_HEAD and k.choice)
        raise OptionError(f"--draft-model {opts.draft_model} is an MTP head, not a draft model: pass --drafter {head} "
                          "(or leave --drafter out: a head is detected)")
    if opts.drafter is not None and kinds.kind(opts.drafter).loads == MTP_HEAD and holds == DFLASH:
        # It would be searched for mtp.* tensors and refused for having none, naming everything but what it is.
        raise OptionError(f"--draft-model {opts.draft_model} is a DFlash drafter, not an MTP head: drop --drafter "
                          f"{opts.drafter} (a DFlash drafter is detected)")
    target = load_target(opts, ranks)
    if opts.kv_bits is not None:
        check_kv_quantization(target.model, opts.kv_bits, opts.kv_group)
    draft = mtp = parts = None
    head_path = None
    notes = [line for line in (rollback_note(opts, target), kv_bits_note(opts, target),
                               first_compile_note(target.dtype)) if line]
    if opts.exact:
        make_exact(target.model)
        notes.append("exact: every forward computes each row the same whatever shares it (--exact: "
                     "docs/EXACTNESS.md)")
    own_head = has_own_head(target)
    if kind == kinds.AUTO.name:
        bundled_head_path = bundled_head(target)
        kind, use_bundled, why = kinds.auto(holds, hidden=not pipelined, own_head=own_head,
                                            bundled_head=bundled_head_path is not None,
                                            head_beats_lookup=bundled.head_beats_lookup())
        head_path = bundled_head_path if use_bundled else None
        notes.append(f"drafter: auto -> {kind} ({why})")
    kind = kinds.resolved(kind, holds, asked=opts.drafter, adaptive=getattr(opts, "adaptive", False))
    chosen = kinds.kind(kind)
    if opts.draft_p_min is not None and not chosen.p_min:
        # Named, such a drafter is refused before loading; auto's pick is known only now.
        notes.append(f"note: --draft-p-min does nothing here: --drafter auto chose {kind}, which has no "
                     "probabilities to stop on")
    if chosen.loads == DFLASH:
        # A DFlash checkpoint: no tokenizer of its own; it must fit the target's layers, width and vocabulary.
        draft = load_dflash(opts.draft_model, opts.dtype, path=draft_path)
        parts = target_parts(target.model)
        check_target(draft.model.config, parts)
    if chosen.head and opts.draft_model is None and not own_head and head_path is None:
        head_path = bundled_head(target)  # the bundled model's head is its own
    if chosen.head and head_path is not None:
        mtp = load_mtp(str(head_path), head_path, target, opts.dtype)
        mtp.source = "bundled head"
    elif chosen.head:
        mtp = load_mtp(opts.draft_model, draft_path, target, opts.dtype)
    if chosen.loads == DRAFT_MODEL:
        draft = load(opts.draft_model, opts.dtype, path=draft_path, trust_remote_code=opts.trust_remote_code)
        check_same_tokenizer(target.tokenizer, draft.tokenizer)
    ids, eos_notes = extra_eos_ids(target.tokenizer, opts.extra_eos_token or ())
    for token_id in ids:
        target.tokenizer.add_eos_token(str(token_id))
    notes += eos_notes
    history = None
    if opts.lookup_history is not None:
        history = LookupHistory.load(opts.lookup_history, tokenizer_fingerprint(target.tokenizer))
        if history.warning:
            notes.append(f"warning: {history.warning}")
        if ranks is not None:
            # Rank 0's file drafts on every rank (another machine's copy may differ); only rank 0 writes it.
            history.entries = [(history.fingerprint, t) for t in ranks.share_lists(history.outputs())]
    used = head_path or (draft_path if chosen.draft_model or chosen.head else None)
    if chosen.head and used is None:
        used = target.path  # the target's own head
    return Setup(opts, kind, target, draft, history, mtp, parts, notes=notes, ranks=ranks, drafter_path=used)


def make_exact(model) -> None:
    """``--exact``: the target's forward made shape-invariant, and probed before the first request.

    Raises:
        UnsupportedModelError: Where it is not bit for bit the same in every shape here, naming what differed.
    """
    exact.install(model)
    problem = exact_problem(model, lambda: ModelCache(model))
    if problem is not None:
        raise UnsupportedModelError(f"--exact cannot make this model's forward the same in every shape here "
                                    f"({problem}): run without --exact")


def folder_holds(draft_path: Optional[Path]) -> Optional[str]:
    """What a ``--draft-model`` folder holds: a DFlash drafter, an MTP head alone, or a draft model (None: none)."""
    if draft_path is None:
        return None
    if is_dflash(draft_path):
        return DFLASH
    if is_mtp_sidecar(draft_path):
        return MTP_HEAD
    return DRAFT_MODEL


def rollback_note(opts: ModelOptions, target: Loaded) -> Optional[str]:
    """A line saying that ``--rollback``/``--rollback-memory-cap`` do nothing on a target without
    recurrent layers (None: they apply, or were not given)."""
    given = [name for name, value in (("--rollback " + opts.rollback, opts.rollback != "auto"),
                                       ("--rollback-memory-cap", opts.rollback_memory_cap is not None)) if value]
    if not given or cache_kinds(target.model)["recurrent"]:
        return None
    return (f"note: {' and '.join(given)} {'does' if len(given) == 1 else 'do'} nothing here: this model has no "
            "recurrent layers (every layer rolls back by trimming its cache)")


def kv_bits_note(opts: ModelOptions, target: Loaded) -> Optional[str]:
    """A line saying that ``--kv-bits`` does nothing on a target without attention layers (None: it applies)."""
    if opts.kv_bits is None or cache_kinds(target.model)["attention"]:
        return None
    return (f"note: --kv-bits {opts.kv_bits} does nothing here: this model has no attention layers (its recurrent "
            "state is not a KV cache)")


def extra_eos_ids(tokenizer, tokens) -> tuple[list[int], list[str]]:
    """The ids ``--extra-eos-token`` names, and a note for each token whose leading-space twin is not among them.

    As mlx-lm reads each one: an integer is an id, anything else a token as
    the vocabulary spells it (``<|im_end|>``, ``ĠBlue``). Unlike mlx-lm, which
    maps an unknown token to the unknown-token id, whatever is not one of
    this tokenizer's tokens is refused, naming what the text encodes to.

    Raises:
        OptionError: Not a token, or an id outside the vocabulary.
    """
    vocab = tokenizer.get_vocab()
    ids, twins = [], {}
    for token in tokens:
        token_id, twin = _eos_token_id(tokenizer, vocab, token)
        ids.append(token_id)
        if twin is not None:
            twins[token] = twin
    # "Blue" is not the token a space before it makes ("ĠBlue"), which is what follows "2." in a text.
    notes = [f"note: --extra-eos-token {token!r} stops at that token only; after a space the text is the token "
             f"{_spelling(tokenizer, twin)}: pass it too to stop there"
             for token, twin in twins.items() if twin not in ids]
    return ids, notes


def _eos_token_id(tokenizer, vocab: dict, token: str) -> tuple[int, Optional[int]]:
    """One ``--extra-eos-token``'s id, and its leading-space twin (None: it has none)."""
    try:
        token_id = int(token)
    except ValueError:
        token_id = None
    if token_id is not None:
        if token_id not in set(vocab.values()):
            raise OptionError(f"--extra-eos-token {token}: no token has this id (this tokenizer's ids run from 0 "
                              f"to {max(vocab.values())}): give a token id in that range, or the token itself")
        return token_id, None
    if not token:
        like = f" (like {_spelling(tokenizer, min(tokenizer.eos_token_ids))})" if tokenizer.eos_token_ids else ""
        raise OptionError(f"--extra-eos-token is empty: give a token of this tokenizer{like} or its id")
    if token not in vocab:
        raise OptionError(f"--extra-eos-token {token!r} is not a token of this tokenizer: {_closest(tokenizer, token)}")
    spaced = _encode(tokenizer, " " + token)
    twin = len(spaced) == 1 and not token[0].isspace() and spaced[0] != vocab[token]
    return vocab[token], spaced[0] if twin else None


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _spelling(tokenizer, token_id: int) -> str:
    """A token as ``--extra-eos-token`` takes it: its vocabulary spelling and its id."""
    return f"{tokenizer.convert_ids_to_tokens(token_id)!r} (id {token_id})"


def _closest(tokenizer, text: str) -> str:
    """What ``text`` is as tokens, as typed and after a space, for a refusal to name."""
    forms = {}
    for shown in (text, " " + text):
        ids = _encode(tokenizer, shown)
        if len(ids) == 1 and ids[0] not in forms.values():
            forms[shown] = ids[0]
    if forms:
        named = " and ".join(f"{shown!r} is the token {_spelling(tokenizer, i)}" for shown, i in forms.items())
        return f"as text, {named}: pass a token as the vocabulary spells it, or its id"
    pieces = ", ".join(repr(tokenizer.convert_ids_to_tokens(i)) for i in _encode(tokenizer, text)[:8])
    return (f"as text it is several tokens ({pieces}), and a stop token is one: pass one as the vocabulary "
            "spells it, or its id")


def blas_note() -> Optional[str]:
    """A line for the user when MLX's CPU backend runs on a slow BLAS (None: it does not)."""
    return blas.note(cpu_backend=mx.default_device() == mx.cpu)


def choose_drafter(target: Loaded, draft_path: Optional[Path], hidden: bool = True) -> tuple[str, Optional[Path], str]:
    """What ``--drafter auto`` runs for ``target`` (see :func:`specdec_cli.drafters.kinds.auto`): the drafter
    kind, a head to load, and why."""
    head = bundled_head(target)
    name, use_bundled, why = kinds.auto(folder_holds(draft_path), hidden=hidden, own_head=has_own_head(target),
                                        bundled_head=head is not None, head_beats_lookup=bundled.head_beats_lookup())
    return name, head if use_bundled else None, why


def bundled_head(target: Loaded) -> Optional[Path]:
    """The distilled head shipped for ``target`` when it is the bundled model."""
    head = bundled.head_dir()
    return head if head is not None and bundled.is_bundled(target.path) else None


def has_own_head(target: Loaded) -> bool:
    """Whether the target's checkpoint carries ``mtp.*`` tensors of a family specdec builds heads for."""
    from ..drafters.mtp_io import QWEN_FAMILIES, mtp_tensor_files

    return target.config.get("model_type") in QWEN_FAMILIES and bool(mtp_tensor_files(target.path))


def load_target(opts: ModelOptions, ranks: Optional[Ranks] = None) -> Loaded:
    """The target: ``--model``, or else the bundled default model (no network); sharded over ``ranks``.

    On Apple silicon MLX's recommended working set is wired once it is loaded, as mlx-lm does.

    Raises:
        BundledModelError: The bundled model is missing or damaged (a broken install).
    """
    kw = dict(adapter_path=opts.adapter_path, trust_remote_code=opts.trust_remote_code, ranks=ranks)
    if opts.model is not None:
        target = load(opts.model, opts.dtype, force_download=opts.force_download, **kw)
    else:
        target = _load_bundled(opts, kw)
    wire_working_set()
    return target


def _load_bundled(opts: ModelOptions, kw: dict) -> Loaded:
    path = bundled.require()
    try:
        target = load(str(path), opts.dtype, **kw)
    except SpecdecError as e:
        if isinstance(e, (distributed.ShardingRefused, AdapterError)):
            raise  # the bundled model is fine: it cannot be sharded this way, or the adapters are not for it
        raise bundled.BundledModelError(bundled.broken_message(str(e))) from None
    except Exception as e:  # whatever a damaged file makes mlx-lm raise
        if distributed.is_peer_error(e):
            raise  # another rank stopped: not the file's fault
        raise bundled.BundledModelError(bundled.broken_message(str(e))) from None
    target.name = bundled.DISPLAY_NAME
    return target


def _vocab_size(config: dict) -> Optional[int]:
    return config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
