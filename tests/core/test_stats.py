"""Every number has one definition."""

from specdec_cli.core.blocks import Block, PhaseTimes
from specdec_cli.core.stats import Stats


def test_definitions():
    s = Stats(prompt_tokens=8, prefill_s=2.0)
    s.add(Block((1, 2, 3, 4), 3, 3, "none", 1), 0.5)   # full accept: 3 drafts + bonus
    s.add(Block((5,), 3, 0, "reforward", 1), 0.25)     # first draft rejected
    s.add(Block((6,), 0, 0, "none", 1, "length"), 0.25)  # a final block with no drafts
    assert s.generated == 6 and s.blocks == 3
    assert s.acceptance == 3 / 6
    assert s.mean_accepted_per_block == 3 / 2   # blocks that drafted
    assert s.tokens_per_block == 6 / 3
    assert s.decode_tps == 6 / 1.0 and s.prompt_tps == 8 / 2.0
    assert s.acceptance_by_position == [0.5, 0.5, 0.5]
    assert dict(s.histogram) == {3: 1, 0: 1}
    assert s.phase_ms is None and s.to_dict()["rollback_s"] is None
    assert s.finish_reason == "length"


def test_phase_times_average_over_timed_blocks():
    s = Stats()
    s.add(Block((1,), 2, 0, "trim", 3, None, PhaseTimes(0.002, 0.004, 0.001)), 0.007)
    s.add(Block((2, 3), 2, 1, "trim", 3, None, PhaseTimes(0.004, 0.006, 0.003)), 0.013)
    assert s.phase_ms == {"draft_ms": 3.0, "verify_ms": 5.0, "rollback_ms": 2.0}
    assert s.to_dict()["rollback_s"] == 0.004
    assert s.acceptance_by_position == [0.5, 0.0]


def test_tokens_per_block_counts_the_final_eos_and_is_never_below_one():
    # Nothing accepted, then a block that commits only the EOS: 36 tokens over 37 forwards
    # would read 0.97 if the EOS were not counted; it is committed by its forward.
    s = Stats()
    for tok in range(36):
        s.add(Block((tok,), 3, 0, "trim", 1), 0.01)
    s.add(Block((), 3, 0, "trim", 1, "stop"), 0.01)
    assert (s.generated, s.blocks, s.finish_reason) == (36, 37, "eos")
    assert s.committed == 37 and s.tokens_per_block == 1.0
    # A run that is only the EOS-only block: one forward, one committed token.
    only = Stats()
    only.add(Block((), 0, 0, "none", 1, "stop"), 0.01)
    assert only.generated == 0 and only.tokens_per_block == 1.0
    # An EOS cut mid-block counts the EOS beside the tokens before it.
    cut = Stats()
    cut.add(Block((1, 2, 3), 3, 3, "none", 1), 0.01)
    cut.add(Block((4,), 3, 2, "trim", 1, "stop"), 0.01)   # accepted [4, EOS], the rest dropped
    assert cut.tokens_per_block == (4 + 1) / 2
    # Plain decoding (nothing drafted) ending at max_tokens or on an EOS: exactly 1.
    for finish in ("length", "stop"):
        plain = Stats()
        plain.add(Block((1,), 0, 0, "none", 1), 0.01)
        plain.add(Block((2,) if finish == "length" else (), 0, 0, "none", 1, finish), 0.01)
        assert plain.tokens_per_block == 1.0, finish
    assert Stats().tokens_per_block == 0.0   # no block ran: no rate
