"""The drafter kinds: the one registration of what can draft, each kind one object.

A kind's record says what it is (its block sizes, what it reads, its adaptive
rule, whether ``--drafter`` offers it); its methods check the options it alone
understands and build its drafter, with the builder that lives beside the
drafter (loaded only then: this module imports no MLX, so the command line
reads it before any model loads). What ``--drafter auto`` picks and what a
``--draft-model`` folder turns a kind into are decided here too. A new drafter
is its module (the drafter and its ``build``) and one record in :data:`KINDS`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Optional

from ..defaults import NGRAM_MAX, NGRAM_MIN
from ..errors import OptionError

# What a --draft-model folder holds (``loaders``: how the session loads each).
DRAFT_MODEL, MTP_HEAD, DFLASH = "draft model", "MTP head", "DFlash drafter"


@dataclass(frozen=True)
class DrafterKind:
    """One drafter kind: what the options, the policy and the loaders need to know of it.

    Attributes:
        name: ``--drafter``'s word (or the name ``auto``'s pick is reported under).
        default_block: The block size when none is given (None: the drafter's own, known once loaded).
        max_block: The largest accepted (None: likewise).
        draft_model: Reads ``--draft-model`` (a draft model, an MTP head, a DFlash drafter).
        hidden_states: Reads the target's hidden states (pipeline parallelism keeps them on one rank).
        head: Drafts with an MTP head (the target's own, a sidecar, or the bundled one).
        p_min: Understands ``--draft-p-min`` (it has probabilities to stop on).
        policy: Its adaptive draft length: ``match-length`` (sized by the lookup match),
            ``hybrid`` (lookup, or the head where nothing matches) or ``acceptance``.
        choice: Offered by ``--drafter`` (the others are what ``auto`` or a checkpoint picks).
        loads: What it loads from ``--draft-model`` (:data:`DRAFT_MODEL`, :data:`MTP_HEAD`,
            :data:`DFLASH`), or None.
        options: The option fields only it understands (``ngram_max``, ``lookup_history``), as named on
            :class:`~specdec_cli.session.options.ModelOptions`.
        earlier: Drafts from earlier outputs too (``--lookup-history``, a server's recent answers).
        builder: ``module:function`` beside its drafter that builds one from
            :class:`~specdec_cli.drafters.base.Materials` (empty: it is resolved to another kind at load).
    """

    name: str
    default_block: Optional[int]
    max_block: Optional[int]
    draft_model: bool = False
    hidden_states: bool = False
    head: bool = False
    p_min: bool = False
    policy: str = "acceptance"
    choice: bool = True
    loads: Optional[str] = None
    options: tuple[str, ...] = ()
    earlier: bool = False
    builder: str = ""

    def build(self, materials: Any) -> Any:
        """A fresh drafter of this kind made from ``materials`` (:class:`~specdec_cli.drafters.base.Materials`)."""
        if not self.builder:
            raise ValueError(f"--drafter {self.name} is resolved to another kind before anything is built")
        module, function = self.builder.split(":")
        importlib.import_module(".groups", __package__)  # its class knows its batch group
        return getattr(importlib.import_module(module, __package__), function)(materials)

    @property
    def own_sizes(self) -> bool:
        """Its block sizes are its checkpoint's (a DFlash config's), known once loaded."""
        return self.max_block is None


# The one registry of drafter kinds. Lookup drafts cost nothing and are sized by their match, so
# its blocks may be long; a model drafter pays a forward per draft. "auto" is only checked against
# its largest; the kind it picks then applies its own. "lookup+mtp" (auto's pick when an MTP head
# is at hand): lookup's blocks, head drafts of at most 3. A DFlash drafter's sizes are its config's.
KINDS = {k.name: k for k in (
    DrafterKind("model", 4, 32, draft_model=True, p_min=True, loads=DRAFT_MODEL, builder=".model:build"),
    DrafterKind("lookup", 64, 64, policy="match-length", options=("lookup_history",), earlier=True,
                builder=".suffix:build"),
    DrafterKind("ngram", 4, 64, options=("ngram_max", "ngram_min"), builder=".lookup:build"),
    DrafterKind("mtp", 4, 32, draft_model=True, hidden_states=True, head=True, p_min=True, loads=MTP_HEAD,
                builder=".mtp:build"),
    DrafterKind("lookup+mtp", 64, 64, hidden_states=True, head=True, p_min=True, policy="hybrid", choice=False,
                loads=MTP_HEAD, builder=".hybrid:build"),
    DrafterKind("auto", 4, 64, draft_model=True, p_min=True),
    DrafterKind("dflash", None, None, draft_model=True, hidden_states=True, p_min=True, choice=False, loads=DFLASH,
                builder=".dflash:build"),
)}
AUTO = KINDS["auto"]
DRAFTER_KINDS = tuple(name for name, k in KINDS.items() if k.choice)
DEFAULT_BLOCK_SIZE = {name: k.default_block for name, k in KINDS.items() if not k.own_sizes}
MAX_BLOCK_SIZE = {name: k.max_block for name, k in KINDS.items() if not k.own_sizes}
MAX_ANY_BLOCK_SIZE = max(MAX_BLOCK_SIZE.values())
MAX_NGRAM = MAX_ANY_BLOCK_SIZE


def kind(name: str) -> DrafterKind:
    """The kind ``--drafter`` (or a resolution) names."""
    return KINDS[name]


def named(asked: Optional[str], draft_model: Optional[str]) -> str:
    """The kind the options name: ``--drafter``, else ``model`` with a draft model, else prompt ``lookup``.

    Raises:
        OptionError: A draft model missing, or given to a kind that reads none.
    """
    name = asked or ("model" if draft_model else "lookup")
    if KINDS[name].loads == DRAFT_MODEL and not draft_model:
        raise OptionError(f"--drafter {name} needs --draft-model REPO_OR_DIR")
    if draft_model and not KINDS[name].draft_model:
        raise OptionError(f"--draft-model is only used with --drafter {_names('draft_model')}, not --drafter {name}")
    return name


def check_options(name: str, given: dict) -> None:
    """Options that only one drafter kind understands, refused for another (``given``: the option fields set).

    Raises:
        OptionError: Naming the kind the option belongs to.
    """
    this = KINDS[name]
    for option in given:
        owners = [k for k in KINDS.values() if option in k.options]
        if owners and this not in owners:
            owner = owners[0]
            flags = "/".join("--" + o.replace("_", "-") for o in owner.options)
            verb = "applies" if len(owner.options) == 1 else "apply"
            if this is AUTO:
                raise OptionError(f"{flags} {verb} to --drafter {owner.name}: name it with --drafter {owner.name} "
                                  "instead of auto")
            raise OptionError(f"{flags} {verb} to --drafter {owner.name}, not --drafter {name}")
    if "draft_p_min" in given and not this.p_min:
        raise OptionError("--draft-p-min applies to a draft model or an MTP head: drop it or pass --draft-model")


def resolved(name: str, holds: Optional[str], *, asked: Optional[str], adaptive: bool) -> str:
    """The kind a run decodes with once ``--draft-model``'s folder is known to hold ``holds`` (None: none given).

    A DFlash checkpoint is read by the DFlash drafter, an MTP-only folder by the head (unless
    ``--drafter model`` was named, refused before loading); choosing lookup or the head per block
    is the adaptive policy's work, so without it (``--no-adaptive``, a sweep) the head drafts alone.
    """
    if KINDS[name].loads in (DRAFT_MODEL, DFLASH) and holds == DFLASH:
        name = _loading(DFLASH, head=False)
    elif KINDS[name].loads == DRAFT_MODEL and asked in (None, AUTO.name) and holds == MTP_HEAD:
        name = _loading(MTP_HEAD, head=True, policy="acceptance")
    if KINDS[name].policy == "hybrid" and not adaptive:
        name = _loading(MTP_HEAD, head=True, policy="acceptance")
    return name


def auto(holds: Optional[str], *, hidden: bool, own_head: bool, bundled_head: bool,
         head_beats_lookup: Optional[bool]) -> tuple[str, bool, str]:
    """What ``--drafter auto`` runs: the kind, whether it drafts with the head bundled for the target, and why.

    A drafter named with ``--draft-model`` comes first (a DFlash or MTP checkpoint, or a draft model),
    then the target's own MTP head, then a head bundled for the target where it measured faster than
    prompt lookup on this kind of device (``head_beats_lookup``; None: not measured there), then prompt
    lookup. Without ``hidden`` (a pipelined target) no drafter that reads hidden states is picked.
    """
    lookup = KINDS["lookup"].name
    hybrid = next(k.name for k in KINDS.values() if k.policy == "hybrid")
    if not hidden and holds in (None, MTP_HEAD):
        return lookup, False, ("pipeline parallelism keeps the target's hidden states on one rank, so no MTP head "
                               "drafts; prompt lookup does")
    if holds == DFLASH:
        return _loading(DFLASH, head=False), False, "the DFlash drafter --draft-model names"
    if holds == MTP_HEAD:
        return hybrid, False, "lookup where the text repeats, the MTP head --draft-model names elsewhere"
    if holds == DRAFT_MODEL:
        return _loading(DRAFT_MODEL, head=False), False, "the draft model --draft-model names"
    if own_head:
        return hybrid, False, "lookup where the text repeats, the model's own MTP head elsewhere"
    if bundled_head and head_beats_lookup:
        return hybrid, True, "lookup where the text repeats, the head distilled for the bundled model elsewhere"
    if bundled_head:
        measured = "is not measured against" if head_beats_lookup is None else "measured slower than"
        return lookup, False, (f"the head distilled for the bundled model {measured} prompt lookup on this device; "
                               f"--drafter {_loading(MTP_HEAD, head=True, policy='acceptance')} runs it")
    return lookup, False, "no drafter for this model"


def describe(name: str, *, head_source: Optional[str], target: str, draft_model: Optional[str],
             loaded_draft: bool) -> str:
    """How a run names its drafter: the kind, and the files it drafts from where they are not the target's."""
    this = KINDS[name]
    if this.head and head_source is not None and head_source != target:
        return f"{name} ({head_source})"
    if this.loads == DFLASH and draft_model:
        return f"{name} ({draft_model})"
    return f"{_loading(DRAFT_MODEL, head=False)} ({draft_model})" if loaded_draft else name


def _loading(what: str, head: bool, policy: Optional[str] = None) -> str:
    """The kind that loads ``what`` from ``--draft-model`` (the plain one, where several do)."""
    return next(k.name for k in KINDS.values()
                if k.loads == what and k.head == head and (policy is None or k.policy == policy))


def _names(field: str) -> str:
    """The ``--drafter`` choices whose record has ``field`` set, as "a, b or c"."""
    names = [name for name, k in KINDS.items() if k.choice and getattr(k, field)]
    return ", ".join(names[:-1]) + " or " + names[-1]


__all__ = ["AUTO", "DEFAULT_BLOCK_SIZE", "DFLASH", "DRAFTER_KINDS", "DRAFT_MODEL", "DrafterKind", "KINDS",
           "MAX_ANY_BLOCK_SIZE", "MAX_BLOCK_SIZE", "MAX_NGRAM", "MTP_HEAD", "NGRAM_MAX", "NGRAM_MIN", "auto", "check_options",
           "describe", "kind", "named", "resolved"]
