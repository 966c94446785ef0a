"""The drafter kinds (drafters/kinds.py): one registration each, its builder beside its drafter, its options its own."""

from __future__ import annotations

from specdec_cli.core.adaptive import MatchLength
import subprocess
import sys

import pytest

from specdec_cli.drafters import Materials, ModelDrafter, NgramDrafter, SuffixDrafter, kinds
from specdec_cli.drafters.kinds import AUTO, DFLASH, DRAFT_MODEL, KINDS, MTP_HEAD
from specdec_cli.errors import OptionError
from specdec_cli.session.synthetic import TINY_CONFIGS, build_model


def build(name, materials):
    return KINDS[name].build(materials)


def test_every_kind_but_auto_builds_its_drafter_from_beside_it():
    # "auto" is not built: loading resolves it to one of the others.
    for k in KINDS.values():
        if k is AUTO:
            with pytest.raises(ValueError, match="resolved to another kind"):
                k.build(Materials())
        else:
            module, function = k.builder.split(":")
            assert module.startswith(".") and function == "build"


def test_the_registry_is_read_without_mlx():
    # The command line declares --drafter's choices and the block-size limits before any model loads.
    code = "import sys, specdec_cli.drafters.kinds as k; print(k.DRAFTER_KINDS, 'mlx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("False") and "'lookup'" in out


def test_an_option_only_one_kind_understands_is_refused_for_the_others():
    kinds.check_options("ngram", {"ngram_max": 5})
    kinds.check_options("lookup", {"lookup_history": "h.json"})
    with pytest.raises(OptionError, match="--ngram-max/--ngram-min apply to --drafter ngram, not --drafter lookup"):
        kinds.check_options("lookup", {"ngram_max": 5})
    with pytest.raises(OptionError, match="--lookup-history applies to --drafter lookup: name it with --drafter "
                                          "lookup instead of auto"):
        kinds.check_options("auto", {"lookup_history": "h.json"})
    with pytest.raises(OptionError, match="--draft-p-min applies to a draft model or an MTP head"):
        kinds.check_options("ngram", {"draft_p_min": 0.5})


def test_a_draft_model_folder_turns_the_kind_it_was_named_with_into_the_one_that_reads_it():
    assert kinds.resolved("model", DFLASH, asked=None, adaptive=True) == "dflash"
    assert kinds.resolved("model", MTP_HEAD, asked=None, adaptive=True) == "mtp"
    assert kinds.resolved("model", DRAFT_MODEL, asked="model", adaptive=True) == "model"
    assert kinds.resolved("lookup+mtp", None, asked=None, adaptive=False) == "mtp"  # choosing per block is adaptive
    assert kinds.resolved("lookup+mtp", None, asked=None, adaptive=True) == "lookup+mtp"
    assert kinds.auto(None, hidden=True, own_head=False, bundled_head=True, head_beats_lookup=False)[0] == "lookup"
    assert kinds.auto(DRAFT_MODEL, hidden=True, own_head=True, bundled_head=False, head_beats_lookup=True)[0] == "model"
    assert kinds.auto(MTP_HEAD, hidden=False, own_head=False, bundled_head=False, head_beats_lookup=True)[0] == "lookup"


@pytest.mark.parametrize("apart", [False, True])
def test_auto_drafts_with_the_bundled_head_only_where_it_measured_faster_than_lookup(monkeypatch, apart):
    # The choice is per kind of device (a verify is dear on a CPU, cheap on a GPU): one measured slower keeps
    # lookup, one not measured keeps lookup and says so, one measured faster drafts with the head too.
    from specdec_cli.model import bundled

    monkeypatch.setattr(bundled, "apart", lambda: apart)
    where = "apart" if apart else "host"
    for verdict, kind, says in ((False, "lookup", "measured slower than prompt lookup on this device"),
                                (None, "lookup", "is not measured against prompt lookup on this device"),
                                (True, "lookup+mtp", "the head distilled for the bundled model elsewhere")):
        monkeypatch.setitem(bundled.HEAD_BEATS_LOOKUP, where, verdict)
        monkeypatch.setitem(bundled.HEAD_BEATS_LOOKUP, "host" if apart else "apart", not verdict)
        assert bundled.head_beats_lookup() is verdict
        name, use_bundled, why = kinds.auto(None, hidden=True, own_head=False, bundled_head=True,
                                            head_beats_lookup=bundled.head_beats_lookup())
        assert (name, use_bundled) == (kind, verdict is True) and says in why


def test_a_lookup_drafter_drafts_from_earlier_outputs_and_stops_at_eos():
    earlier = [[5, 6, 7, 8, 9, 2, 11]]
    for eos, draft in (((2,), (9, 2)), ((), (9, 2, 11))):
        drafter = build("lookup", Materials(eos_ids=eos, earlier=earlier))
        assert isinstance(drafter, SuffixDrafter)
        drafter.prefill([1, 5, 6, 7])
        # After "5 6 7 8", what followed in the earlier output: up to its EOS when 2 is one.
        assert drafter.propose(8, 8).host == draft


def test_each_builder_applies_its_options():
    policy = MatchLength(64)
    assert build("lookup", Materials(policy=policy)).size == policy.size
    ngram = build("ngram", Materials(ngram=(6, 3)))
    assert isinstance(ngram, NgramDrafter) and (ngram.max_ngram, ngram.min_ngram) == (6, 3)
    model = build_model(TINY_CONFIGS["llama"], seed=0)
    drafted = build("model", Materials(draft_model=model, vocab_size=200, p_min=0.4))
    assert isinstance(drafted, ModelDrafter) and (drafted.vocab_size, drafted.p_min) == (200, 0.4)

