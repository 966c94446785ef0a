"""Longest-match prompt lookup: proposals on hand-made sequences, the learned draft length, history across runs."""

from __future__ import annotations

import copy
import json
import random

import pytest
from helpers import GEN, PROMPT, plain, prefilled, target, tokens

from specdec_cli.core.adaptive import BLOCK_SIZES, MatchLength
from specdec_cli.drafters import LookupHistory, SuffixDrafter
from specdec_cli.drafters.history import FORMAT, VERSION
from specdec_cli.loop.engine import MAX_CARRY, speculative_generate_step


def everything(match: int, k: int) -> int:
    return k


def drafter_after(text: list[int], **kw) -> SuffixDrafter:
    d = SuffixDrafter(size=kw.pop("size", everything), **kw)
    d.prefill(text)
    return d


def propose(text: list[int], last: int, k: int, **kw) -> list[int]:
    return drafter_after(text, **kw).propose(last, k).tokens.tolist()


def brute_longest_match(text: list[int]) -> int:
    """Longest suffix of ``text`` that also ends somewhere before its end."""
    n, best = len(text), 0
    for length in range(1, n):
        suffix = text[n - length:]
        if any(text[e - length + 1: e + 1] == suffix for e in range(length - 1, n - 1)):
            best = length
    return best


# --- proposals on hand-made sequences -----------------------------------------------

def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    # "4 5 6" occurred once (then 20 21); "5 6" most recently continued with 30 31.
    text = [4, 5, 6, 20, 21, 9, 5, 6, 30, 31, 4, 5]
    d = drafter_after(text)
    assert d.propose(6, 2).tokens.tolist() == [20, 21]
    assert d.match == 3


def test_frequency_breaks_ties_between_equally_long_matches():
    # "7 8" is followed by 1 twice, by 2 once (the latest): the most frequent wins.
    text = [7, 8, 1, 0, 7, 8, 1, 0, 3, 7, 8, 2, 0, 5, 7]
    assert propose(text, 8, 1) == [1]
    # With equal counts the most recent continuation wins.
    assert propose([7, 8, 1, 0, 7, 8, 2, 0, 5, 7], 8, 1) == [2]
    # Each later token is chosen again by frequency under the longer context:
    # after "7 8 1", 0 followed twice and 9 once.
    text = [7, 8, 1, 0, 7, 8, 1, 0, 7, 8, 1, 9, 4, 7]
    assert propose(text, 8, 3) == [1, 0, 7]


def test_longest_match_equals_brute_force_on_random_texts():
    rng = random.Random(0)
    for _ in range(100):
        text = [rng.randrange(3) for _ in range(rng.randrange(2, 50))]
        d = drafter_after(text[:-1])
        d.propose(text[-1], 4)
        assert d.match == brute_longest_match(text), text


def test_drafts_stop_at_the_end_of_the_text_and_at_a_stop_token():
    assert propose(list(range(100, 160)), 7, 5) == []            # nothing repeats
    assert propose([1, 2, 3, 4, 5], 3, 9) == [4, 5, 3]            # runs into its own suffix
    assert propose([1, 2, 3, 4, 5, 6], 3, 9, stop_ids=[5]) == [4, 5]


def test_resynchronises_right_after_a_one_token_deviation():
    source = list(range(10, 40))
    d = drafter_after([1] + source + [2])           # the prompt quotes the source
    assert d.propose(source[0], 8).tokens.tolist() == source[1:9]
    # The target keeps 4 drafts, then says 99 where the source says source[5].
    d.accept(4)
    assert d.propose(99, 8).tokens.tolist() == source[6:14]  # at once, no extra block
    d.accept(8)
    # Back on the source: the longest match covers the tokens after the change.
    assert d.propose(source[14], 4).tokens.tolist() == source[15:19]
    assert d.match == 9


def test_after_an_insertion_the_source_is_found_again_within_two_tokens():
    source = list(range(10, 40))
    d = drafter_after([1] + source + [2])
    d.propose(source[0], 4)
    d.accept(2)                                      # text: ... s0 s1 s2, target says 77
    assert d.propose(77, 4).tokens.tolist() == source[4:8]  # guessed a substitution
    d.accept(0)                                      # no: the target inserts 78 as well
    d.propose(78, 4)
    d.accept(0)
    # Back to the source: one source token after the insertion is enough.
    assert d.propose(source[3], 4).tokens.tolist() == source[4:8]


def test_cancel_restores_the_automaton_exactly():
    rng = random.Random(1)
    for _ in range(50):
        text = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        d = drafter_after(text)
        before = (repr(d._next), list(d._link), list(d._len), list(d._count), list(d._recent), d._last, list(d.text))
        d.propose(rng.randrange(4), 6)
        d.accept(rng.randrange(4))       # cancel also undoes an accept after the propose
        d.cancel()
        after = (repr(d._next), list(d._link), list(d._len), list(d._count), list(d._recent), d._last, list(d.text))
        assert after == before
        # And it drafts as a fresh drafter would.
        last = rng.randrange(4)
        assert d.propose(last, 6).tokens.tolist() == propose(text, last, 6)


def test_occurrence_counts_are_exact_on_ordinary_text():
    rng = random.Random(2)
    text = [rng.randrange(5) for _ in range(300)]
    d = drafter_after(text)
    for length in (1, 2, 3):
        for start in range(0, 290, 37):
            pattern = text[start:start + length]
            state = 0
            for t in pattern:
                state = d._next[state][t]
            occurrences = sum(text[i:i + length] == pattern for i in range(len(text) - length + 1))
            assert d._count[state] == occurrences


# --- the learned draft length -------------------------------------------------------

def test_match_length_policy_drafts_long_for_long_matches_and_learns_from_acceptance():
    p = MatchLength(k_max=63, window=10_000)
    sizes = [p.size(m, 63) for m in (1, 2, 4, 8, 16, 32)]
    assert sizes == sorted(sizes) and sizes[-1] >= 32 and sizes[0] <= 2
    # Blocks whose drafts after 8-token matches are all rejected: it stops drafting there.
    for _ in range(20):
        n = p.size(8, 63)
        p.observe(n, 0, 1, 0.01)
    assert p.size(8, 63) == 0
    # Never more than allowed.
    assert p.size(40, 5) <= 5
    q = MatchLength(k_max=63)
    for _ in range(10):            # everything accepted at short matches: drafts grow
        n = q.size(2, 63)
        q.observe(n, n, n + 1, 0.01)
    assert q.size(2, 63) > MatchLength(k_max=63).size(2, 63)


def test_match_length_policy_verifies_only_cheap_block_sizes():
    # Verify costs are a sawtooth (16 rows cost what 8 do, 12 far more): the
    # policy ends a draft on a listed size, unless the caller allows no more.
    p = MatchLength(k_max=63, window=10_000)
    for _ in range(6):                 # a run that copies: long drafts pay
        n = p.size(20, 63)
        p.observe(n, n, n + 1, 0.01)
    for match in (1, 2, 3, 5, 8, 12, 20, 40):
        for k in (1, 5, 9, 14, 15, 20, 30, 46, 47, 63):
            n = p.size(match, k)
            assert n <= k and (n == 0 or n + 1 in BLOCK_SIZES or n == k), (match, k, n)
    assert p.size(40, 63) + 1 in (48, 64)
    assert p.size(40, 46) == 46        # the end of the output is near: one block, not two
    assert p.size(40, 20) == 15        # 21 rows would cost more than 16
    # Untimed sizes between listed ones: dearer halfway than either neighbour.
    assert p.cost(12) > max(p.cost(8), p.cost(16)) and p.cost(16) < p.cost(15) < p.cost(12)


def test_a_draft_its_source_cuts_short_is_sized_again():
    asked = []

    def size(match: int, k: int) -> int:
        asked.append(k)
        return 8 if k > 7 else 2

    # After "1 2 3" the text goes on for 7 tokens (to its own end) only.
    d = drafter_after([1, 2, 3, 4, 5, 6, 9, 1, 2], size=size)
    assert d.propose(3, 63).tokens.tolist() == [4, 5]
    assert asked == [63, 7]
    d.accept(2)
    assert d.text[-3:] == [3, 4, 5]


def test_one_token_matches_draft_nothing_but_teach_the_policy():
    # A one-token match guesses right ~1 time in 6 over the benchmark's
    # prompts: never worth a verify. Whether its next token came is still
    # told to the policy, for free: text that repeats nothing lowers the
    # estimates before a longer match wastes a block.
    p = MatchLength(k_max=63)
    assert p.size(1, 63) == 0 and p.size(2, 63) > 0
    before = p.acceptance()
    d = SuffixDrafter(p.size)
    d.prefill([5, 6, 7, 8])
    last = 5
    for t in (9, 10, 11, 12):          # after "5" came 6; now other tokens come
        assert d.propose(last, 63).size == 0 and d.match == 1
        d.accept(0)
        last = t
        d.propose(last, 63)            # reports the guess for the previous match
        d.accept(0)
        last = 5
    assert p._misses[0] == 4 and p._hits[0] == 0
    assert all(a < b for a, b in zip(p.acceptance()[1:4], before[1:4]))
    # A cancelled block reports nothing; a guess that comes true counts as a hit.
    d.propose(5, 63)
    d.cancel()
    d.propose(5, 63)
    assert p._hits[0] == 0 and p._misses[0] == 4
    guess = d._guess[1]
    d.accept(0)
    d.propose(guess, 63)
    assert p._hits[0] == 1 and p._misses[0] == 4


@pytest.mark.parametrize("seed", range(6))
def test_when_lookup_says_its_next_block_drafts_nothing_no_token_makes_it_draft(seed):
    # The engine queues a block's next forward ahead only on this word: after every block that drafted nothing,
    # if the drafter (with its policy) says it could not draft next, then whichever token comes, the policy as
    # the engine observes it and the drafter's next propose draft nothing. Texts repeat in stretches; the clock
    # is random, so the policy also switches itself off and back on.
    rng = random.Random(seed)
    alphabet = list(range(12))
    text = [rng.choice(alphabet) for _ in range(30)]
    while len(text) < 400:
        text += text[rng.randrange(len(text) - 8):][:rng.randrange(2, 12)] if rng.random() < 0.5 else \
            [rng.choice(alphabet) for _ in range(rng.randrange(1, 6))]
    policy = MatchLength(k_max=8, warmup=0, window=4, probe=2, cooldown=3)
    drafter = SuffixDrafter(policy.size)
    drafter.prefill(text[:20])
    at, said = 20, {True: 0, False: 0}
    while at < len(text) - 10:
        draft = drafter.propose(text[at], policy.next_k()).tokens.tolist()
        n = next((i for i, t in enumerate(draft) if t != text[at + 1 + i]), len(draft))
        seconds = rng.uniform(0.5, 2.0) * (1 + 0.2 * len(draft))
        if not draft:
            before = copy.deepcopy((vars(policy), drafter.text, drafter._last, drafter._guess))
            quiet = not policy.drafts_next() or not drafter.may_draft(8)
            assert (vars(policy), drafter.text, drafter._last, drafter._guess) == before  # asking changes nothing
            said[quiet] += 1
            if quiet:
                for token in alphabet:
                    d, p = copy.deepcopy((drafter, policy))
                    d.accept(0)
                    p.observe(0, 0, 1, seconds)
                    assert not d.propose(token, p.next_k()).size, (at, token)
        drafter.accept(n)
        policy.observe(len(draft), n, n + 1, seconds)
        at += n + 1
    assert said[True] > 10 and said[False] > 10


def test_blocks_without_drafts_are_timed_as_plain_steps():
    p = MatchLength(k_max=15, window=4, warmup=0)
    for _ in range(10):
        p.size(1, 15)
        p.observe(0, 0, 1, 0.05)   # nothing to match: no draft
    assert p.mode == "speculate" and p.switched_off == 0 and len(p._plain) == 10
    # Drafting blocks far slower than those plain steps switch speculation off.
    for _ in range(4):
        p.observe(3, 1, 2, 1.0)
    assert p.mode == "off" and p.switched_off == 1


# --- speculative == plain with long drafts --------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_5"])
def test_long_lookup_drafts_keep_output_identical(family):
    model = target(family, "float32")
    n = 64
    ref, _ = plain(model, max_tokens=n)
    # An earlier "run" said the same with two tokens changed: drafts from it
    # are accepted for long stretches (past gemma3's window of 8 and the
    # carry limit) and rejected at the changes (and where the random model's
    # own repeats suggest something else).
    earlier = list(ref)
    for i in (12, 40):
        earlier[i] = (earlier[i] + 1) % 256
    for k in (31, 63):
        cache = prefilled(model)
        drafter = SuffixDrafter(size=everything, history=[earlier])
        drafter.prefill(PROMPT[:-1])
        blocks = list(speculative_generate_step(PROMPT[-1], cache, drafter, num_draft_tokens=k, max_tokens=n))
        assert tokens(blocks) == ref, (family, k)
        assert max(b.accepted for b in blocks) > MAX_CARRY + 8, [(b.drafted, b.accepted) for b in blocks]
        assert any(0 < b.accepted < b.drafted for b in blocks)
    # The default: the policy sizes drafts by their match.
    cache = prefilled(model)
    policy = MatchLength(k_max=63)
    drafter = SuffixDrafter(size=policy.size, history=[earlier])
    drafter.prefill(PROMPT[:-1])
    blocks = list(speculative_generate_step(PROMPT[-1], cache, drafter, policy=policy, max_tokens=n))
    assert tokens(blocks) == ref
    assert sum(b.accepted for b in blocks) > n // 2


# --- history across runs ------------------------------------------------------------------

def test_history_drafts_from_earlier_outputs(tmp_path):
    earlier = list(range(200, 230))
    d = SuffixDrafter(size=everything, history=[earlier, [5, 6, 7]])
    d.prefill([1, 2, 3])
    assert d.propose(200, 5).tokens.tolist() == earlier[1:6]
    # A match never runs from one earlier output into the next.
    d2 = SuffixDrafter(size=everything, history=[[9, 8], [7, 6]])
    d2.prefill([1])
    assert d2.propose(8, 5).tokens.tolist() == []


def test_history_file_round_trip_is_bounded_and_per_tokenizer(tmp_path):
    path = tmp_path / "sub" / "history.json"
    h = LookupHistory.load(path, "tokA", max_tokens=10)
    assert h.outputs() == [] and h.warning is None        # missing file: empty
    h.add([1, 2, 3, 4])
    h.add([5, 6, 7, 8])
    h.add([1, 2, 3, 4])                                   # a repeat moves to the newest place
    h.save()
    h = LookupHistory.load(path, "tokA", max_tokens=10)
    assert h.outputs() == [[5, 6, 7, 8], [1, 2, 3, 4]]
    h.add([9, 10, 11, 12])                                # over 10 tokens: the oldest goes
    h.save()
    assert LookupHistory.load(path, "tokA", max_tokens=10).outputs() == [[1, 2, 3, 4], [9, 10, 11, 12]]
    assert LookupHistory.load(path, "tokB", max_tokens=10).outputs() == []  # another vocabulary
    h.add(list(range(30)))                                # longer than the bound: its tail is kept
    assert h.outputs() == [list(range(20, 30))]


@pytest.mark.parametrize("content", [
    json.dumps({"format": FORMAT, "version": VERSION, "entries": [{"tokenizer": "tokA", "tokens": ["x"]}]}),
    json.dumps({"format": FORMAT, "version": VERSION, "entries": [{"tokens": [1]}]}),
    json.dumps({"format": FORMAT, "version": VERSION, "entries": []})[:-3],
])
def test_a_damaged_history_file_is_set_aside_with_a_warning(tmp_path, content):
    # (Files that are not a history at all are refused: tests/drafters/test_history_file.py.)
    path = tmp_path / "history.json"
    path.write_text(content)
    h = LookupHistory.load(path, "tokA")
    assert h.outputs() == [] and "damaged" in h.warning
    assert (tmp_path / "history.json.corrupt").read_text() == content
    h.add([1, 2])
    h.save()
    again = LookupHistory.load(path, "tokA")
    assert again.warning is None and again.outputs() == [[1, 2]]
