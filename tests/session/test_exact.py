"""``--exact`` (issue 58): one text whatever the batch, the drafter and the block size, where kernels round by shape.

On the GPU-like backend (tests/gpu_like.py) a row's logits depend on how many rows and positions share its
forward and on the cache's length. Under ``--exact`` every request's text is the same whether it decodes
alone or with 1, 3 or 7 others, with any drafter and block size, on a dense, a sliding-window and a hybrid
family; without it the same runs part somewhere (so each assertion can fail).
"""

from __future__ import annotations

import functools

import pytest

from specdec_cli.core.request import Request
from specdec_cli.loop.events import Step
from specdec_cli.session import ModelOptions, PromptCache, Session, load_setup
from specdec_cli.session.batch import BatchEnd, run_batch
from specdec_cli.session.synthetic import make_model_dir

FAMILIES = ["llama", "gemma3_text", "qwen3_5"]
PROMPTS = [list(b"The quick brown fox jumps over the lazy dog, twice: the quick brown fox."),
           list(b"abc abc abc abc abc abc"), list(b"Hello there, how are you?"),
           list(b"one two three four five six; one two three"), list(b"Once upon a time"),
           list(b"a b a b a b a b a b"), list(b"The rain in Spain stays mainly"), list(b"x")]
N = 24


@functools.cache
def dirs(root: str, family: str) -> tuple:
    from pathlib import Path

    base = Path(root)
    return (make_model_dir(base / family, family, seed=0),
            make_model_dir(base / f"{family}-draft", family, seed=0, noise=0.05))


def setup_of(tmp_root, family: str, kind: str, exact: bool, dtype: str = "bfloat16"):
    target, draft = dirs(str(tmp_root), family)
    return load_setup(ModelOptions(model=str(target), draft_model=str(draft) if kind == "model" else None,
                                   dtype=dtype, exact=exact), kind)


def texts(setup, block: int, rows: int, prompt_cache: bool = False) -> list[list[int]]:
    """Every prompt's tokens, decoded ``rows`` at a time (1: each alone)."""
    session = Session(setup, block, prompt_cache=PromptCache() if prompt_cache else None)
    out = [[] for _ in PROMPTS]
    for ev in run_batch(session, [Request(p, N) for p in PROMPTS], max_rows=rows):
        if not isinstance(ev, BatchEnd) and isinstance(ev.event, Step):
            out[ev.index] += ev.event.block.tokens
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("exact")


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_texts_are_one_whatever_the_batch_drafter_and_block_size(root, family, gpu_like):
    runs = {}
    # Every drafter at both block sizes and 1 to 8 rows, not every product of them: one alone at a time is the
    # dearest run under --exact here, and the block size and the row count change a forward's shape apart.
    shapes = {"lookup": [(4, 1), (4, 2), (4, 4), (4, 8), (16, 2), (16, 8)],
              "model": [(4, 1), (4, 4), (16, 2), (16, 8)], "ngram": [(4, 8), (16, 1)]}
    # Without --exact, a few runs are enough to show the rounding (in each family every one of them parts from
    # the first when the backend rounds by shape).
    unexact = {("lookup", 4, 1), ("lookup", 4, 2), ("lookup", 4, 4), ("model", 4, 1)}
    for exact in (True, False):
        for kind, pairs in shapes.items():
            setup = setup_of(root, family, kind, exact)
            for block, rows in pairs:
                if not exact and (kind, block, rows) not in unexact:
                    continue
                runs[(exact, kind, block, rows)] = texts(setup, block, rows)
    exact_runs = {k: v for k, v in runs.items() if k[0]}
    reference = exact_runs[(True, "lookup", 4, 1)]
    for key, got in exact_runs.items():
        assert got == reference, key
    # Without --exact the same runs part somewhere: the rounding these assertions are about is there.
    assert any(got != runs[(False, "lookup", 4, 1)] for key, got in runs.items() if not key[0])


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """A qwen3_5 target with a fitted MTP head (trained on this CPU's own arithmetic, before the backend turns)."""
    from mtp_fixtures import fitted_head, hf_checkpoint

    return hf_checkpoint(tmp_path_factory.mktemp("exact-mtp") / "qwen3_5", "qwen3_5", fitted_head("qwen3_5"))


def test_exact_texts_are_one_with_an_mtp_head_a_dflash_drafter_and_the_prompt_cache(mtp_checkpoint, tmp_path,
                                                                                     gpu_like):
    from test_dflash import qwen_dflash_setup

    path = mtp_checkpoint
    mtp = load_setup(ModelOptions(model=str(path), dtype="float32", exact=True), "mtp")
    reference = texts(mtp, 4, 1)
    assert texts(mtp, 4, 8) == reference and texts(mtp, 4, 4, prompt_cache=True) == reference
    lookup = load_setup(ModelOptions(model=str(path), dtype="float32", exact=True), "lookup")
    assert texts(lookup, 16, 8, prompt_cache=True) == reference  # another drafter, the same text
    dflash = qwen_dflash_setup(tmp_path / "dflash")
    exact = load_setup(ModelOptions(model=dflash.options.model, draft_model=dflash.options.draft_model,
                                    dtype="float32", exact=True), "dflash")
    alone = texts(exact, 6, 1)
    assert texts(exact, 6, 8) == alone


def test_the_disk_prompt_cache_keys_on_the_mode(root):
    from specdec_cli.session.disk_tier import key_parts

    assert key_parts(setup_of(root, "llama", "lookup", True))[0]["exact"] is True
    assert key_parts(setup_of(root, "llama", "lookup", False))[0]["exact"] is False


def test_exact_refuses_what_it_cannot_make_exact(root):
    from specdec_cli.errors import OptionError
    from specdec_cli.session import check_model_options

    with pytest.raises(OptionError, match=r"--exact .* \(--kv-bits\)"):
        check_model_options(ModelOptions(model="x", exact=True, kv_bits=4))


def test_a_backend_that_rounds_a_row_by_its_place_in_a_matrix_is_refused(monkeypatch):
    # This CPU's OpenBLAS rounds rows 6-15 of a 16-row product with a 64-wide inner dimension apart from row 0:
    # --exact's attention, where one token sits at row 0 and a verify's tokens at rows 0-15. The probe's rows
    # (3 and 2 tokens) never reached row 6, so the bundled model passed it and its texts could part.
    import mlx.core as mx

    from specdec_cli.cache.batch_check import exact_problem
    from specdec_cli.cache.caches import ModelCache
    from specdec_cli.model import exact
    from specdec_cli.session.synthetic import TINY_CONFIGS, build_model

    model = build_model(TINY_CONFIGS["llama"], seed=0, dtype=mx.bfloat16)
    exact.install(model)
    assert exact_problem(model, lambda: ModelCache(model)) is None
    matmul = mx.matmul

    def by_place(a, b, *args, **kwargs):  # a few float32 ulps off in every row past the sixth (--exact's
        # attention computes in float32), as the BLAS was
        y = matmul(a, b, *args, **kwargs)
        return y * mx.where(mx.arange(y.shape[-2]) >= 6, 1 + 2.0**-20, 1.0)[:, None].astype(y.dtype)

    monkeypatch.setattr(mx, "matmul", by_place)
    problem = exact_problem(model, lambda: ModelCache(model))
    assert problem is not None and "(this backend rounds a row by its place in a matrix)" in problem
