"""The prompt cache's disk tier as users meet it: a restarted session, `generate` run twice, a restarted server.

The invariant: an answer resumed from disk equals a cache-less one (greedy token for token, seeded
sampling the same) on attention, sliding-window, GatedDeltaNet and Mamba2 models, after a restart,
with blocks evicted, with a damaged file in the folder.
"""

from __future__ import annotations

import json
import logging
import os

import httpx
import pytest
from typer.testing import CliRunner

from helpers import PROMPT, assert_alone_or_tie, assert_served, kernels_agree
from specdec_cli.cli.app import app
from specdec_cli.core.sampling import SamplingParams
from specdec_cli.loop.events import Prefilled, Step
from specdec_cli.session import ModelOptions, PromptCache, Request, Session, load_setup
from specdec_cli.session.disk_cache import DiskHit
from specdec_cli.session.disk_tier import default_dir
from specdec_cli.session.synthetic import TINY_CONFIGS, make_model_dir

FAMILIES = ["llama", "gemma3_text", "qwen3_5", "nemotron_h"]
# Past one 256-token block, so a restart reads block files and a state record.
LONG = PROMPT * 5
MORE = list(b" And once more, the quick brown fox jumps over the lazy dog.")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk-tier")
    out = {f: make_model_dir(root / f, f, seed=0) for f in FAMILIES}
    out["draft"] = make_model_dir(root / "draft", "llama", seed=0, noise=0.05)
    return out


@pytest.fixture(scope="module")
def setups(dirs):
    return {f: load_setup(ModelOptions(model=str(dirs[f]), dtype="float32"), "lookup") for f in FAMILIES}


def gen(session: Session, ids, n: int = 24, **kw) -> tuple[list[int], Prefilled, list]:
    tokens, prefilled, blocks = [], None, []
    for event in session.generate(Request(ids, n, **kw)):
        if isinstance(event, Prefilled):
            prefilled = event
        elif isinstance(event, Step):
            tokens += event.block.tokens
            blocks.append((event.block.drafted, event.block.accepted))
    return tokens, prefilled, blocks


def on_disk(setup, folder, gb: float = 1.0, block: int = 8, **kw) -> Session:
    session = Session(setup, block, **kw)
    assert session.use_disk(str(folder), gb) is None
    return session


def turn(setup, folder, ids, block: int = 8, adaptive: bool = True, **kw):
    """One process's life: open the tier, answer, write everything, close. A test that holds two runs' blocks
    to each other drafts a fixed length (``adaptive=False``): the adaptive policies time their blocks."""
    session = on_disk(setup, folder, block=block, adaptive=adaptive)
    try:
        return gen(session, ids, **kw)
    finally:
        session.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_restarted_session_resumes_from_disk_and_answers_as_a_cold_one(setups, family, tmp_path):
    setup = setups[family]
    first, pre, _ = turn(setup, tmp_path, LONG)
    assert pre.cached == 0 and os.listdir(tmp_path)
    second = LONG + first + MORE
    out, pre, _ = turn(setup, tmp_path, second)
    ref, cold, _ = gen(Session(setup, 8), second)
    assert cold.cached == 0
    assert_served(setup.target, out, second, 24, ref)  # (its prefix was computed in other shapes)
    # The first run left its prompt and every token but the last (all of them after an EOS): all from disk.
    assert pre.disk == pre.cached >= len(LONG) + len(first) - 1


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_seeded_sampling_from_disk_draws_what_a_cold_run_draws(setups, family, tmp_path):
    setup = setups[family]
    sampled = dict(sampling=SamplingParams(temp=0.9), seed=7)
    first, _, _ = turn(setup, tmp_path, LONG, **sampled)
    second = LONG + first + MORE
    out, pre, _ = turn(setup, tmp_path, second, **sampled)
    assert pre.disk > 0
    assert out == gen(Session(setup, 8), second, **sampled)[0]


def test_memory_is_read_before_disk_and_disk_when_it_holds_more(setups, tmp_path):
    setup = setups["qwen3_5"]
    first, _, _ = turn(setup, tmp_path, LONG)
    session = on_disk(setup, tmp_path, prompt_cache=PromptCache())
    second = LONG + first + MORE
    _, pre, _ = gen(session, second)
    assert pre.disk == pre.cached > 0  # memory was empty: the disk held the prefix
    _, pre, _ = gen(session, second)
    assert pre.cached == len(second) - 1 and pre.disk == 0  # now memory holds all of it
    session.disk.close()


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_burst_sharing_a_prefix_after_a_restart_reads_the_disk_once(setups, family, tmp_path):
    """Four requests sharing a prefix, opened together after a restart: the first reads the files, the others copy
    what it read from memory (each used to read the disk again); every answer is still its request's alone."""
    import asyncio

    from specdec_cli.serve.scheduler import Done, Failed, Job, Scheduler
    from specdec_cli.session.reply import Reply, TextStream

    setup = setups[family]
    turn(setup, tmp_path, LONG)
    session = on_disk(setup, tmp_path, prompt_cache=PromptCache())
    prompts = [LONG + list(f" question {i}?".encode()) for i in range(4)]
    scheduler = Scheduler(session, max_rows=4)
    loop = asyncio.new_event_loop()

    async def burst() -> list[Reply]:
        jobs = []
        for p in prompts:
            jobs.append(Job(lambda p=p: Reply(session, Request(p, 8), TextStream(setup.tokenizer, chat=False)), loop))
            scheduler.submit(jobs[-1])
        out = []
        for job in jobs:
            while not isinstance(item := await asyncio.wait_for(job.out.get(), 120), Done):
                if isinstance(item, Failed):
                    raise item.error
            out.append(item.reply)
        return out

    scheduler.start()
    try:
        replies = loop.run_until_complete(burst())
    finally:
        scheduler.stop()
        loop.close()
        session.shutdown()
    assert all(r.stats.cached_tokens > 256 for r in replies)  # every one resumed past the first block
    assert [r.stats.disk_tokens > 0 for r in replies].count(True) == 1
    for p, r in zip(prompts, replies):
        assert_served(setup.target, r.tokens, p, 8, gen(Session(setup, 8), p, n=8)[0])


def test_a_damaged_file_is_removed_with_one_warning_and_the_answer_stays_exact(setups, tmp_path, caplog):
    setup = setups["nemotron_h"]
    first, _, _ = turn(setup, tmp_path, LONG)
    second = LONG + first + MORE
    (key,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    records = sorted(key.glob("t-s-*"), key=lambda p: p.stat().st_size)
    damaged = records[-1]
    data = bytearray(damaged.read_bytes())
    data[-5] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        out, pre, _ = turn(setup, tmp_path, second)
    assert out == gen(Session(setup, 8), second)[0]
    assert sum(damaged.name in r.getMessage() for r in caplog.records) == 1
    assert pre.cached < len(LONG) + len(first) - 1  # it fell back to the record on the way (or to nothing)


def test_eviction_keeps_the_folder_under_its_bound_and_answers_stay_exact(setups, tmp_path):
    setup = setups["llama"]
    turn(setup, tmp_path / "probe", LONG)
    one = sum(f.stat().st_size for f in (tmp_path / "probe").rglob("*.safetensors"))
    tiny = 2.2 * one / (1 << 30)  # two prompts' worth: the third evicts
    tmp_path = tmp_path / "bounded"
    session = on_disk(setup, tmp_path, gb=tiny)
    prompts = [LONG, list(b"Another prompt entirely. ") * 14, list(b"A third one, not like the others. ") * 11]
    for ids in prompts:
        gen(session, ids)
    session.disk.close()
    total = sum(f.stat().st_size for f in tmp_path.rglob("*.safetensors"))
    assert 0 < total <= int(tiny * (1 << 30)) < session.disk.store.written  # files were evicted
    for ids in prompts:
        again = on_disk(setup, tmp_path, gb=tiny)
        assert gen(again, ids + MORE)[0] == gen(Session(setup, 8), ids + MORE)[0]
        again.disk.close()


def test_the_draft_models_caches_come_back_with_the_targets(dirs, tmp_path):
    setup = load_setup(ModelOptions(model=str(dirs["llama"]), draft_model=str(dirs["draft"]), dtype="float32"),
                       "model")
    first, _, _ = turn(setup, tmp_path, LONG, adaptive=False)
    second = LONG + first + MORE
    restarted = on_disk(setup, tmp_path, adaptive=False)
    hit = restarted._fetch(second)
    assert isinstance(hit, DiskHit) and hit.draft is not None and hit.draft.length > 0
    out, pre, blocks = gen(restarted, second)
    restarted.disk.close()
    warm = Session(setup, 8, adaptive=False, prompt_cache=PromptCache())
    gen(warm, LONG)
    ref, warm_pre, warm_blocks = gen(warm, second)
    # The drafter resumed from disk drafts exactly as the one kept in memory: the same blocks.
    assert out == ref and pre.disk == warm_pre.cached and blocks == warm_blocks


def test_kv_bits_resumes_its_own_files_exactly_and_never_the_others(tmp_path):
    wide = make_model_dir(tmp_path / "wide", {**TINY_CONFIGS["llama"], "head_dim": 32}, seed=0)  # groups of 32
    plain = load_setup(ModelOptions(model=str(wide), dtype="float32"), "lookup")
    quant = load_setup(ModelOptions(model=str(wide), dtype="float32", kv_bits=8, kv_group_size=32), "lookup")
    folder = tmp_path / "cache"
    first, _, _ = turn(plain, folder, LONG)
    second = LONG + first + MORE
    _, pre, _ = turn(quant, folder, second)
    assert pre.cached == 0
    out, pre, _ = turn(quant, folder, second)
    assert pre.disk > 0
    # Its prefix was computed in other shapes: bit for bit where the kernels agree, else up to a rounding tie.
    assert_alone_or_tie(quant.target.model, "float32", out, gen(Session(quant, 8), second)[0], second,
                        eos_ids=quant.eos_ids, kv_bits=8, kv_group_size=32)


def test_a_folder_that_cannot_be_made_is_a_warning_and_the_run_goes_on(setups, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    session = Session(setups["llama"], 8)
    warning = session.use_disk(str(blocker / "cache"), 1.0)
    # The user passed --prompt-cache-dir: the fix is another folder (or none), not the option itself.
    assert session.disk is None and "pass a folder you can write as --prompt-cache-dir" in warning
    assert "--prompt-cache-disk-gb 0" in warning
    assert gen(session, LONG)[0]
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # the default folder cannot be made
    warning = Session(setups["llama"], 8).use_disk(None, 1.0)
    assert "; pass --prompt-cache-dir" in warning and "you can write" not in warning


def test_a_disk_bound_past_any_disk_is_capped_with_one_warning(setups, tmp_path, caplog):
    session = Session(setups["llama"], 8)
    with caplog.at_level(logging.WARNING):
        assert session.use_disk(str(tmp_path), 1e300) is None
    assert session.disk.store.max_bytes == (1 << 20) << 30
    assert [r.getMessage() for r in caplog.records] == ["--prompt-cache-disk-gb 1e+300 is more than any disk: "
                                                         "using 1048576"]
    session.shutdown()


def test_the_disk_tier_keeps_prompts_and_answers_private_whatever_the_umask(setups, tmp_path):
    from specdec_cli.session.corpus import Corpus

    root = tmp_path / "new" / "cache"
    old = os.umask(0)  # the loosest: a plain mkdir() or open() would leave the answers readable to all
    try:
        session = Session(setups["llama"], 8, corpus=Corpus(256))
        assert session.use_disk(str(root), 1.0) is None
        gen(session, LONG, n=24)
        session.shutdown()
    finally:
        os.umask(old)
    assert root.stat().st_mode & 0o777 == 0o700
    (key,) = root.iterdir()
    files = list(key.iterdir())
    assert key.stat().st_mode & 0o777 == 0o700
    assert "lookup-corpus.json" in {f.name for f in files} and any(f.name.startswith("t-b-") for f in files)
    assert {f.stat().st_mode & 0o777 for f in files} == {0o600}


def test_the_default_folder_is_under_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_dir() == tmp_path / "specdec" / "prompt-cache"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert str(default_dir()).endswith(os.path.join(".cache", "specdec", "prompt-cache"))


def test_generate_twice_reads_the_first_runs_caches_and_prints_the_same_text(dirs, tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDEC_PROMPT_CACHE_DISK_GB")  # the default: on
    monkeypatch.setenv("SPECDEC_PROMPT_CACHE_DIR", str(tmp_path))
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    args = ["generate", "--model", str(dirs["llama"]), "--dtype", "float32", "--ignore-chat-template", "-p", prompt,
            "-m", "16", "--json"]
    runs = [CliRunner().invoke(app, args) for _ in range(2)]
    for r in runs:
        assert r.exit_code == 0, r.output
    first, second = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert first["text"] == second["text"]
    assert first["cached_tokens"] == 0 and second["disk_tokens"] == second["cached_tokens"] > 0
    off = CliRunner().invoke(app, args + ["--prompt-cache-disk-gb", "0"])
    assert json.loads(off.stdout.strip().splitlines()[-1])["cached_tokens"] == 0


def test_a_restarted_server_answers_the_next_turn_from_disk_as_a_cacheless_one(dirs, tmp_path):
    from server import Server

    ask = dict(model="default_model", max_tokens=16, temperature=0.0)
    model = ["--model", str(dirs["qwen3_5"]), "--dtype", "float32", "--decode-concurrency", "1"]
    disk = ["--prompt-cache-dir", str(tmp_path), "--prompt-cache-disk-gb", "1"]
    prompt = bytes(LONG).decode()

    def served(args, text, **kw):
        server = Server(*model, *args)
        try:
            server.health = httpx.get(f"{server.url}/health", timeout=10).json()
            return server.client().completions.create(prompt=text, **ask, **kw), server
        finally:
            server.stop()

    first, _ = served(disk, prompt, extra_body={"ignore_eos": True})  # 16 tokens: long enough for the corpus
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = prompt + first.choices[0].text + " And once more."
    agree = kernels_agree("float32")
    # A new process on the same folder. Where kernels do not agree (a GPU's own arithmetic), the server holds the
    # resumed answer to its request alone itself: identical, or apart at a rounding tie.
    again, server = served(disk, turn2, **({} if agree else {"extra_body": {"compare_alone": True}}))
    details = again.usage.prompt_tokens_details
    assert details.cached_tokens > 0 and details.model_extra["disk_tokens"] == details.cached_tokens
    assert "disk prompt cache" in server.log and "of them from disk" in server.log
    # The lookup corpus of recent answers came back with the caches.
    assert server.health["lookup_corpus_tokens"] == first.usage.completion_tokens == 16
    assert server.health["prompt_cache_disk_bytes"] > 0 and server.health["prompt_cache_dir"] == str(tmp_path)
    if agree:
        cold, _ = served(["--prompt-cache-size", "0", "--prompt-cache-disk-gb", "0"], turn2)
        assert again.choices[0].text == cold.choices[0].text
    else:
        assert again.model_extra["timings"]["compare"]["verdict"] in {"identical", "rounding tie"}


def test_an_mtp_head_resumes_from_the_hidden_states_on_disk_and_drafts_as_from_memory(tmp_path):
    from mtp_fixtures import fitted_head, hf_checkpoint

    path = hf_checkpoint(tmp_path / "mtp", "qwen3_5", fitted_head("qwen3_5"))
    setup = load_setup(ModelOptions(model=str(path), dtype="float32"), "mtp")
    folder = tmp_path / "cache"
    first, _, _ = turn(setup, folder, LONG, adaptive=False)
    second = LONG + first + MORE
    out, pre, blocks = turn(setup, folder, second, adaptive=False)
    warm = Session(setup, 8, adaptive=False, prompt_cache=PromptCache())
    gen(warm, LONG)
    ref, warm_pre, warm_blocks = gen(warm, second)
    assert pre.disk == warm_pre.cached > len(LONG)
    # The head read the restored hidden states: it drafts exactly as the one resumed from memory.
    assert out == ref and blocks == warm_blocks
    assert any(f.name.startswith("h") for f in folder.rglob("*.safetensors"))


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_prompt_that_branches_at_a_message_boundary_resumes_all_of_it(setups, family, tmp_path):
    setup = setups[family]
    cut = 300  # inside the second 256-token block
    turn(setup, tmp_path, LONG, boundaries=(cut,))
    branch = LONG[:cut] + MORE
    out, pre, _ = turn(setup, tmp_path, branch)
    assert pre.disk == pre.cached == cut
    assert out == gen(Session(setup, 8), branch)[0]


def test_the_lookup_corpus_round_trips_and_a_damaged_file_is_one_warning(tmp_path, caplog):
    from specdec_cli.session.corpus import Corpus

    kept = Corpus(64)
    kept.add(list(range(10, 30)))
    kept.add(list(range(40, 52)))
    kept.save(tmp_path / "c.json")
    again = Corpus(64)
    assert again.load(tmp_path / "c.json") == 32 and again.outputs() == kept.outputs()
    assert Corpus(16).load(tmp_path / "c.json") <= 16  # the bound holds whatever the file holds
    assert Corpus(64).load(tmp_path / "missing.json") == 0
    (tmp_path / "c.json").write_text('{"corpus": 1, "outputs": [[1, 2, "x"]]}')
    with caplog.at_level(logging.WARNING):
        assert Corpus(64).load(tmp_path / "c.json") == 0
    assert len(caplog.records) == 1 and "lookup corpus" in caplog.records[0].getMessage()


def test_the_lookup_corpus_on_a_read_only_file_system_is_one_warning(tmp_path, caplog, monkeypatch):
    import errno
    from pathlib import Path

    from specdec_cli.session import corpus as corpus_module

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    # Its folder exists (its key's), but nothing can be made in it, nor removed (a missing file included).
    monkeypatch.setattr(corpus_module, "create_private", read_only)
    monkeypatch.setattr(Path, "unlink", read_only)
    kept = corpus_module.Corpus(64)
    kept.add(list(range(10, 30)))
    with caplog.at_level(logging.WARNING):
        kept.save(tmp_path / "c.json")
    assert len(caplog.records) == 1 and "Read-only file system" in caplog.records[0].getMessage()


def test_weights_written_anew_change_the_key(dirs, tmp_path):
    from specdec_cli.session.disk_tier import key_parts

    setup = load_setup(ModelOptions(model=str(dirs["llama"]), dtype="float32"), "lookup")
    before = key_parts(setup)[0]
    weights = next(dirs["llama"].glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a fused LoRA, say: same size
    try:
        assert key_parts(setup)[0]["model"] != before["model"]
    finally:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert key_parts(setup)[0] == before


def test_a_dflash_drafter_resumes_from_the_hidden_states_on_disk(tmp_path):
    from test_dflash import qwen_dflash_setup

    setup = qwen_dflash_setup(tmp_path)
    folder = tmp_path / "cache"
    first, _, _ = turn(setup, folder, LONG, block=6, adaptive=False)
    second = LONG + first + MORE
    out, pre, blocks = turn(setup, folder, second, block=6, adaptive=False)
    warm = Session(setup, 6, adaptive=False, prompt_cache=PromptCache())
    gen(warm, LONG)
    ref, warm_pre, warm_blocks = gen(warm, second)
    assert pre.disk == warm_pre.cached > len(LONG)
    assert out == ref and blocks == warm_blocks


@pytest.mark.parametrize("tier", ["memory", "disk"])
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_5"])
def test_on_a_gpu_like_backend_a_resumed_prompt_answers_as_its_request_alone_or_a_tie(setups, family, tier,
                                                                                      tmp_path, gpu_like):
    # A prefix resumed from the prompt cache was computed in other shapes (its turn's prefill and blocks), so
    # where kernels round by shape its answer is held to the request's text alone within rounding.
    from specdec_cli.loop.compare import IDENTICAL, TIE
    from specdec_cli.session.alone import compare_alone
    from specdec_cli.session.reply import Reply, TextStream

    setup = setups[family]
    first, _, _ = turn(setup, tmp_path, LONG) if tier == "disk" else (None, None, None)
    session = on_disk(setup, tmp_path) if tier == "disk" else Session(setup, 8, prompt_cache=PromptCache())
    if tier == "memory":
        first, _, _ = gen(session, LONG)
    request = Request(LONG + first + MORE, 24)
    reply = Reply(session, request, TextStream(setup.tokenizer, chat=False))
    list(reply)
    assert reply.stats.cached_tokens > 0 and (tier == "memory" or reply.stats.disk_tokens > 0)
    verdict = compare_alone(session, request, reply.tokens, reply.stats, batched=False)
    assert verdict.verdict in (IDENTICAL, TIE), verdict.divergence
    if session.disk is not None:
        session.disk.close()
