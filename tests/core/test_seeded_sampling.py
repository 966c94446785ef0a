"""``--seed`` at temperature > 0: one seed, one text, whatever the draft lengths and the drafter.

With a seed every draw is keyed by its position (Gumbel-max with noise that
is a function of the seed, the position and the token id), so the text of a
seeded run is plain decoding's seeded text, token for token: draft lengths
chosen from measured time (adaptive, auto rollback) can no longer change it.
The distribution checks are in test_sampling.py.
"""

from __future__ import annotations

import json
import random

import pytest
from helpers import PROMPT, noisy_drafter, target
from typer.testing import CliRunner

from specdec_cli.core.adaptive import AdaptiveLength, FixedLength, MatchLength
from specdec_cli.cli.app import app
from specdec_cli.drafters import ModelDrafter, SuffixDrafter
from specdec_cli.loop.events import collect
from specdec_cli.loop.runner import run
from specdec_cli.core.sampling import SamplingParams
from specdec_cli.session.synthetic import make_model_dir

SAMPLED = SamplingParams(temp=0.9, top_k=40)
TOKENS = 48


class Jittery:
    """Draft lengths from a random sequence, as a policy that sizes drafts by measured time would give."""

    def __init__(self, seed: int, k_max: int = 6):
        self.rng, self.k_max = random.Random(seed), k_max

    def next_k(self) -> int:
        return self.rng.randint(0, self.k_max)

    def observe(self, drafted, accepted, emitted, seconds) -> None:
        pass


def text(model, drafter=None, policy=None, seed=11, rollback="carry"):
    stats, out = collect(run(model, PROMPT, drafter=drafter, policy=policy, max_tokens=TOKENS, sampling=SAMPLED,
                             seed=seed, rollback=rollback))
    return out, stats


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_one_seed_gives_one_text_under_any_draft_lengths(family):
    model, draft = target(family, "float32"), noisy_drafter(family, "float32")
    plain, _ = text(model)
    assert text(model, seed=12)[0] != plain  # the seed decides the text
    for policy in (FixedLength(2), FixedLength(5), AdaptiveLength(k_max=6), Jittery(0), Jittery(1)):
        out, stats = text(model, ModelDrafter(draft), policy)
        assert out == plain, policy
        assert stats.accepted > 0, policy  # the drafter samples with the same noise: its drafts are taken
    # Prompt lookup (a deterministic drafter) and its own policy: the same text again.
    out, _ = text(model, SuffixDrafter(size=MatchLength(k_max=15).size), MatchLength(k_max=15))
    assert out == plain


def test_every_rollback_keeps_the_seeded_text():
    model, draft = target("qwen3_5", "float32"), noisy_drafter("qwen3_5", "float32")
    plain, _ = text(model, seed=5)
    for rollback in ("carry", "reforward", "capture", "tape"):
        assert text(model, ModelDrafter(draft), Jittery(3), seed=5, rollback=rollback)[0] == plain, rollback


def test_an_mtp_head_with_a_draft_vocabulary_keeps_the_seeded_text():
    # The head drafts over 8 of 16 tokens: its keyed draws read the noise by target token id.
    from test_sampling import PROMPT as SPROMPT, models

    from specdec_cli.drafters.mtp import MTPDrafter
    from specdec_cli.drafters.mtp_head import MTPConfig, random_head
    from specdec_cli.model.taps import target_parts

    model, _ = models()
    parts = target_parts(model)
    head = random_head(MTPConfig(hidden_size=32, vocab_size=16, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=8, intermediate_size=64, draft_vocab_size=8), seed=2)
    accepted = 0
    for seed in range(12):
        _, plain = collect(run(model, SPROMPT, max_tokens=12, sampling=SamplingParams(temp=1.0), seed=seed))
        stats, out = collect(run(model, SPROMPT, drafter=MTPDrafter(head, parts), policy=Jittery(seed, 3),
                                 max_tokens=12, sampling=SamplingParams(temp=1.0), seed=seed))
        assert out == plain, seed
        accepted += stats.accepted
    assert accepted > 0


def test_without_a_seed_sampling_is_unkeyed():
    # No seed: today's rejection sampling from MLX's global random state.
    import mlx.core as mx

    model, draft = target("llama", "float32"), noisy_drafter("llama", "float32")
    mx.random.seed(3)
    a = collect(run(model, PROMPT, drafter=ModelDrafter(draft), num_draft_tokens=3, max_tokens=16,
                    sampling=SAMPLED))[1]
    mx.random.seed(3)
    b = collect(run(model, PROMPT, drafter=ModelDrafter(draft), num_draft_tokens=3, max_tokens=16,
                    sampling=SAMPLED))[1]
    assert a == b


def test_generate_with_a_seed_prints_one_text_for_any_block_size_or_drafter(tmp_path):
    llama = make_model_dir(tmp_path / "llama", "llama", seed=0)
    draft = make_model_dir(tmp_path / "draft", "llama", seed=0, noise=0.05)
    base = ["generate", "--model", str(llama), "-p", "Tell me a story.", "-m", "32", "--temp", "0.8",
            "--seed", "5", "--json", "--no-live"]
    texts = set()
    for extra in (["--draft-model", str(draft), "--block-size", "2"],
                  ["--draft-model", str(draft), "--block-size", "6", "--no-adaptive"],
                  ["--draft-model", str(draft)],
                  ["--drafter", "lookup"]):
        result = CliRunner().invoke(app, base + extra)
        assert result.exit_code == 0, result.output
        texts.add(json.loads(result.stdout)["text"])
    assert len(texts) == 1


def test_a_dflash_block_drafter_keeps_the_seeded_text(tmp_path):
    from test_dflash import parts_of, tiny

    from specdec_cli.drafters.dflash import DFlashDrafter
    from specdec_cli.drafters.dflash_io import load_dflash
    from specdec_cli.session.synthetic import TINY_CONFIGS, dflash_config, save_dflash_dir

    cfg = dflash_config(TINY_CONFIGS["qwen3"], schema="old", layers=1, block_size=9)
    model = load_dflash(str(save_dflash_dir(tmp_path / "d", cfg, seed=5))).model
    plain, _ = text(tiny("qwen3"), seed=4)
    for policy in (FixedLength(3), FixedLength(8), Jittery(2, 8)):
        out, stats = text(tiny("qwen3"), DFlashDrafter(model, parts_of("qwen3")), policy, seed=4)
        assert out == plain and stats.drafted > 0, policy


# --compare-ar at temperature > 0: with a seed, plain decoding samples the same text, so it can be proven.

@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("seeded-compare")
    return {"llama": make_model_dir(root / "llama", "llama", seed=0),
            "draft": make_model_dir(root / "draft", "llama", seed=0, noise=0.05)}


def _seeded(dirs, *extra):
    return CliRunner().invoke(app, ["generate", "--model", str(dirs["llama"]), "-p", "Tell me a story.", "-m", "32",
                                    "--temp", "0.8", "--top-k", "40", "--compare-ar", "--no-live", *extra])


@pytest.mark.parametrize("drafter", [["--draft-model", "draft"], ["--drafter", "lookup"]])
def test_compare_ar_proves_a_seeded_sampled_run_identical(llama_dirs, drafter):
    drafter = [str(llama_dirs.get(a, a)) for a in drafter]
    result = _seeded(llama_dirs, *drafter, "--seed", "5", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["compare"]["verdict"] == "identical" and report["compare"]["tokens"] == report["generated_tokens"]
    text = _seeded(llama_dirs, *drafter, "--seed", "5")
    assert text.exit_code == 0 and f"Compare: identical ({report['generated_tokens']} tokens)" in text.stderr
    # Without a seed the draws differ from run to run: nothing to prove, refused before loading.
    result = _seeded(llama_dirs, *drafter)
    assert result.exit_code == 2 and "--compare-ar at --temp > 0 needs --seed" in result.stderr


def test_compare_ar_finds_a_seeded_run_that_left_plain_decoding(llama_dirs, monkeypatch):
    from test_compare import broken_rollback

    broken_rollback(monkeypatch)  # the rollback keeps a rejected row: the text leaves plain decoding's
    result = _seeded(llama_dirs, "--draft-model", str(llama_dirs["draft"]), "--seed", "5", "--json",
                     "--no-adaptive")
    assert result.exit_code == 3, result.output
    cmp = json.loads(result.stdout)["compare"]
    # The replay, picking each row's keyed draw, finds the token the run's own forwards did not pick.
    assert cmp["verdict"] == "diverged" and cmp["first_divergence"]["replay_mismatch"] is not None
