"""The drafter kinds' two tables (defaults.DRAFTERS: what a kind is; drafters.registry: how it is built) agree."""

from __future__ import annotations

from specdec_cli.core.adaptive import MatchLength
from specdec_cli.defaults import DRAFTERS
from specdec_cli.drafters import ModelDrafter, NgramDrafter, SuffixDrafter
from specdec_cli.drafters.registry import BUILDERS, Materials, build
from specdec_cli.session.synthetic import TINY_CONFIGS, build_model


def test_every_kind_has_a_builder_and_every_builder_a_kind():
    # "auto" is not built: loading resolves it to one of the others.
    assert set(BUILDERS) == set(DRAFTERS) - {"auto"}


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

