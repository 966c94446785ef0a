"""The disk tier of the prompt cache (issue 44): files that resume caches bit for bit after a restart.

Each test saves caches prefilled directly, opens a fresh :class:`DiskStore` on the same
folder (a restart) and compares what it loads with a cache prefilled with exactly
that many tokens (the same chunks: the same bits), and the next token's logits.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from helpers import max_cache_diff, noisy_drafter, target
from server import python_path
from specdec_cli.cache.caches import ModelCache, make_cache
from specdec_cli.model.taps import Hidden
from specdec_cli.cache.codec import decode as _decode
from specdec_cli.session.disk_cache import FORMAT, DiskStore, Writer, key_digest
from specdec_cli.session.state import SavedCache
from specdec_cli.session.synthetic import TINY_CONFIGS, build_model

B = 16  # tokens per block: small, so short prompts cross several blocks
STEP = 16  # prefill chunks line up with the blocks
PARTS = {"model": "tiny", "dtype": "float32", "kv_bits": None}
TOKENS = [int(t) for t in np.random.default_rng(0).integers(0, 256, 120)]
OTHER = [int(t) for t in np.random.default_rng(1).integers(0, 256, 120)]
LOG = "specdec_cli.session.disk_cache"


def store(root, parts=PARTS, **kw) -> DiskStore:
    kw.setdefault("max_bytes", 1 << 30)
    return DiskStore(root, parts, block=B, **kw)


def prefill(model, tokens, stops=(), layers=None) -> tuple[ModelCache, SavedCache]:
    """Caches prefilled directly, and what a session keeps of them (checkpoints at ``stops``)."""
    cache = ModelCache(model, layers() if layers else None)
    cache.prefill(tokens, STEP, stops=stops)
    saved = SavedCache.of(cache)
    for mark in cache.marks:
        saved.add(mark)
    return cache, saved


def same(a: ModelCache, b: ModelCache) -> bool:
    """Bit-equal contents (``max_cache_diff`` == 0, quantized keys part by part)."""
    if not any(isinstance(c.keys, tuple) for c in a._attention):
        return max_cache_diff(a, b) == 0.0
    assert a.length == b.length
    for x, y in zip(a._attention, b._attention):
        assert x.offset == y.offset
        for p, q in zip((*x.keys, *x.values), (*y.keys, *y.values)):
            if not mx.array_equal(p[..., : x.offset, :], q[..., : x.offset, :]).item():
                return False
    return True


def assert_exact(loaded: ModelCache, model, tokens, chunks, layers=None) -> None:
    """``loaded`` equals a direct prefill of its length, and decodes the next token to the same logits."""
    n = loaded.length
    direct = ModelCache(model, layers() if layers else None)
    direct.prefill(tokens[:n], STEP, sizes=chunks)
    assert same(loaded, direct)
    nxt = mx.array([tokens[n]], dtype=mx.uint32)
    a, b = loaded.feed(nxt), direct.feed(nxt)
    assert mx.array_equal(a, b).item()
    assert same(loaded, direct)


def names(root, kind="") -> set[str]:
    return {n for d in root.iterdir() if d.is_dir() for n in os.listdir(d) if kind in n}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_resumes_at_a_block_boundary_and_at_the_saved_length(tmp_path, dtype):
    model = target("llama", dtype)
    cache, saved = prefill(model, TOKENS[:70])
    assert store(tmp_path).save(TOKENS, saved) > 0
    disk = store(tmp_path)  # a restart: nothing in memory
    hit = disk.load(TOKENS[:90], model)
    assert hit.cached == 70 and hit.target.length == 70 and hit.entry.tokens == tuple(TOKENS[:70])
    assert_exact(hit.target, model, TOKENS, cache.chunks)
    # A prompt that leaves the saved one at 53 resumes at the block boundary below.
    hit = disk.load(TOKENS[:53] + OTHER[:20], model)
    assert hit.cached == 48
    assert_exact(hit.target, model, TOKENS, cache.chunks)
    # The last token is always left to feed; at_most caps the length.
    assert disk.load(TOKENS[:70], model).cached == 64
    assert disk.load(TOKENS[:90], model, at_most=40).cached == 32
    assert disk.load(OTHER[:90], model) is None and disk.load(TOKENS[:10], model) is None
    assert (disk.hits, disk.misses) == (4, 2)
    # Past what memory holds only: 70 beats 64, nothing beats 70.
    assert disk.load(TOKENS[:90], model, more_than=64).cached == 70
    assert disk.load(TOKENS[:90], model, more_than=70) is None


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "gemma3_text"])
def test_fixed_position_layers_resume_only_at_state_records(tmp_path, family):
    model = target(family, "float32")
    cache, saved = prefill(model, TOKENS[:70], stops=[37])
    assert 37 in saved.checkpoints
    store(tmp_path).save(TOKENS, saved)
    disk = store(tmp_path)
    for prompt, n in ((TOKENS[:90], 70), (TOKENS[:60] + OTHER[:9], 37), (TOKENS[:40], 37)):
        hit = disk.load(prompt, model)
        assert hit.cached == n
        assert_exact(hit.target, model, TOKENS, cache.chunks)
    # Blocks alone do not resume recurrent state or a window that dropped keys.
    assert disk.load(TOKENS[:36] + OTHER[:9], model) is None


def test_a_quantized_kv_cache_round_trips(tmp_path):
    model = _kv_llama()
    layers = functools.partial(make_cache, model, kv_bits=4, kv_group_size=32)
    cache, saved = prefill(model, TOKENS[:70], layers=layers)
    store(tmp_path, {**PARTS, "kv_bits": 4}).save(TOKENS, saved)
    disk = store(tmp_path, {**PARTS, "kv_bits": 4})
    for prompt, n in ((TOKENS[:90], 70), (TOKENS[:50] + OTHER[:5], 48)):
        hit = disk.load(prompt, model, lambda: ModelCache(model, layers()))
        assert hit.cached == n and isinstance(hit.target.layers[0].keys, tuple)
        assert_exact(hit.target, model, TOKENS, cache.chunks, layers)
    # The same folder under the unquantized key: nothing.
    assert store(tmp_path).load(TOKENS[:90], model) is None


@functools.cache
def _kv_llama():
    return build_model({**TINY_CONFIGS["llama"], "head_dim": 32}, seed=0)


def test_an_extended_prompt_writes_only_its_new_blocks_and_records(tmp_path):
    model = target("qwen3_5", "float32")
    _, first = prefill(model, TOKENS[:40], stops=[20])
    disk = store(tmp_path)
    disk.save(TOKENS, first)
    before = {n: (tmp_path / disk.key / n).read_bytes() for n in names(tmp_path)}
    cache, second = prefill(model, TOKENS[:75], stops=[40])
    second.inherit(first, 40)  # what a session resumed at 40 does: the 20 checkpoint comes along
    written = disk.save(TOKENS, second)
    after = names(tmp_path)
    new = after - set(before)
    # Blocks 3 and 4 (positions 32..64) and one record at 75: the record at 40 and 20 were there.
    assert sorted(n[:4] for n in new) == ["t-b-", "t-b-", "t-s-"]
    assert written == disk.last_written == sum((tmp_path / disk.key / n).stat().st_size for n in new)
    assert disk.written == written + sum(len(b) for b in before.values())
    assert all((tmp_path / disk.key / n).read_bytes() == b for n, b in before.items())
    assert disk.save(TOKENS, second) == 0  # nothing new
    assert disk.files == len(after) and disk.nbytes == sum((tmp_path / disk.key / n).stat().st_size for n in after)
    hit = store(tmp_path).load(TOKENS[:100], model)
    assert hit.cached == 75
    assert_exact(hit.target, model, TOKENS, cache.chunks)


def test_a_different_key_never_sees_the_files(tmp_path):
    model = target("llama", "float32")
    _, saved = prefill(model, TOKENS[:70])
    store(tmp_path).save(TOKENS, saved)
    other = store(tmp_path, {**PARTS, "model": "another"})
    assert other.key != key_digest(PARTS) and other.load(TOKENS[:90], model) is None
    assert other.nbytes == 0 and other.files == 0
    assert key_digest({"a": 1, "b": 2}) == key_digest({"b": 2, "a": 1}) != key_digest({"a": 1, "b": 3})


def _foreign_record(tmp_path, model, name):
    """The same record's bytes made under another key (a file that is sound, but not this key's)."""
    _, saved = prefill(model, TOKENS[:70])
    other = store(tmp_path / "other", {**PARTS, "model": "x"})
    other.save(TOKENS, saved)
    (record,) = names(tmp_path / "other", "t-s-")
    return (tmp_path / "other" / other.key / record).read_bytes()


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "foreign", "block"])
def test_a_damaged_file_is_removed_with_one_warning_and_the_load_falls_back(tmp_path, caplog, damage):
    model = target("llama", "float32")
    cache, saved = prefill(model, TOKENS[:70])
    disk = store(tmp_path)
    disk.save(TOKENS, saved)
    (record,) = names(tmp_path, "t-s-")
    blocks = sorted(names(tmp_path, "t-b-"))
    victim = tmp_path / disk.key / record
    blob = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(blob[: len(blob) - 100])
    elif damage == "flip":
        victim.write_bytes(blob[:-5] + bytes([blob[-5] ^ 1]) + blob[-4:])
    elif damage == "garbage":
        victim.write_bytes(os.urandom(len(blob)))
    elif damage == "foreign":
        victim.write_bytes(_foreign_record(tmp_path, model, record))
    else:  # a block in the middle of the chain: the one for positions 32..48
        h2 = disk._chain(np.asarray(TOKENS, dtype=np.int64), 3)[3].hex()
        victim = tmp_path / disk.key / f"t-b-{h2}.safetensors"
        assert victim.name in blocks
        victim.write_bytes(victim.read_bytes()[:50])
    with caplog.at_level(logging.WARNING, logger=LOG):
        hit = store(tmp_path).load(TOKENS[:90], model)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and victim.name in warnings[0].getMessage()
    assert not victim.exists()
    assert hit.cached == (32 if damage == "block" else 64)
    assert_exact(hit.target, model, TOKENS, cache.chunks)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes through chmod")
def test_a_read_only_folder_costs_one_warning_and_raises_nothing(tmp_path, caplog):
    model = target("llama", "float32")
    _, saved = prefill(model, TOKENS[:70])
    root = tmp_path / "ro"
    root.mkdir()
    disk = store(root)
    disk.dir.mkdir()
    os.chmod(disk.dir, 0o500)
    try:
        with caplog.at_level(logging.WARNING, logger=LOG):
            assert disk.save(TOKENS, saved) == 0
            assert disk.save(OTHER, saved) == 0
        assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
        assert os.listdir(disk.dir) == []  # no temporary file left behind
        assert disk.load(TOKENS[:90], model) is None
    finally:
        os.chmod(disk.dir, 0o700)
    assert disk.save(TOKENS, saved) > 0  # writable again: it saves (and would warn again)


def test_a_failing_write_costs_one_warning_and_leaves_no_temporary_file(tmp_path, caplog, monkeypatch):
    model = target("llama", "float32")
    _, saved = prefill(model, TOKENS[:70])
    disk = store(tmp_path)

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert disk.save(TOKENS, saved) == 0
        assert disk.save(OTHER, saved) == 0
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    assert os.listdir(disk.dir) == []
    monkeypatch.undo()
    assert disk.save(TOKENS, saved) > 0 and disk.load(TOKENS[:90], model).cached == 70


def test_the_folder_is_bounded_by_bytes_least_recently_used_first(tmp_path):
    model = target("llama", "float32")
    prompts = [[k] + TOKENS[: 40 + k] for k in range(3)]
    saved = [prefill(model, p)[1] for p in prompts]
    probe = store(tmp_path / "probe")
    one = probe.save(prompts[2], saved[2])  # the largest of the three
    disk = store(tmp_path / "lru", max_bytes=2 * one + one // 2)
    for k in (0, 1):
        disk.save(prompts[k], saved[k])
        time.sleep(0.02)  # mtimes apart, on any clock granularity
    assert store(tmp_path / "lru").load(prompts[0] + [1], model).cached == len(prompts[0])  # 0 is used again
    time.sleep(0.02)
    disk.save(prompts[2], saved[2])
    assert disk.nbytes <= disk.max_bytes
    again = store(tmp_path / "lru")
    assert again.load(prompts[0] + [1], model).cached == len(prompts[0])
    assert again.load(prompts[2] + [1], model).cached == len(prompts[2])
    hit = again.load(prompts[1] + [1], model)
    assert hit is None or hit.cached < len(prompts[1])  # the least recently used lost its files
    # Opened again with a lower bound (a restart with a smaller --prompt-cache-disk-gb): within it at once.
    lower = store(tmp_path / "lru", max_bytes=one + one // 2)
    assert 0 < lower.nbytes <= lower.max_bytes


def test_eviction_removes_only_its_own_files_and_a_dead_writers_old_temporaries(tmp_path):
    model = target("llama", "float32")
    _, saved = prefill(model, TOKENS)
    root = tmp_path / "cache"
    disk = store(root, max_bytes=1)  # every file of ours is over the bound
    weights = root / "my-model" / "model.safetensors"  # a user's model kept in the same folder
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"weights" * 100)
    disk.dir.mkdir(parents=True)
    notes = disk.dir / "notes.safetensors"  # in a key's folder, but not named as a block or record
    notes.write_bytes(b"mine")
    old, fresh = disk.dir / ".x.safetensors.12.0a1b2c3d.tmp", disk.dir / ".y.safetensors.13.0a1b2c3e.tmp"
    for f in (old, fresh):
        f.write_bytes(b"partial")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    disk.save(TOKENS, saved)
    assert not list(root.rglob("t-*"))  # its own files went
    assert weights.exists() and notes.exists() and fresh.exists() and not old.exists()


def test_two_stores_saving_into_one_folder_at_once_leave_only_sound_files(tmp_path, caplog):
    model = target("qwen3_5", "float32")
    prompts = [TOKENS[:30 + 9 * k] for k in range(5)] + [OTHER[:30 + 9 * k] for k in range(5)]
    kept = [prefill(model, p, stops=[len(p) // 2]) for p in prompts]
    one = store(tmp_path / "probe").save(prompts[-1], kept[-1][1])
    # Two "processes": each its own store on the folder, copying on this thread (MLX's), writing
    # and evicting on its own, the same files in opposite orders, while a third reads every file.
    stores = [store(tmp_path / "shared", max_bytes=4 * one) for _ in range(2)]
    work = [[s.snapshot(p, saved) for p, (_, saved) in zip(prompts, kept)] for s in stores]
    errors, done = [], threading.Event()

    def writer(disk, pendings):
        try:
            for pending in pendings:
                disk.write(pending)
        except Exception as e:  # pragma: no cover - the assertion below says what
            errors.append(e)

    def reader():
        folder = stores[0].dir
        while not done.is_set():
            for name in os.listdir(folder) if folder.exists() else ():
                try:
                    blob = (folder / name).read_bytes()
                except FileNotFoundError:
                    continue  # evicted meanwhile
                if not name.startswith("."):
                    try:
                        _decode(blob)
                    except Exception as e:  # pragma: no cover
                        errors.append((name, e))

    with caplog.at_level(logging.WARNING, logger=LOG):
        threads = [threading.Thread(target=writer, args=(stores[0], work[0])),
                   threading.Thread(target=writer, args=(stores[1], work[1][::-1])),
                   threading.Thread(target=reader)]
        for t in threads:
            t.start()
        for t in threads[:2]:
            t.join()
        done.set()
        threads[2].join()
    assert not errors and not [r for r in caplog.records if r.levelno >= logging.WARNING]
    left = os.listdir(stores[0].dir)
    assert left and not [n for n in left if n.startswith(".")]  # no temporary file left
    disk = store(tmp_path / "shared", max_bytes=4 * one)
    assert disk.nbytes <= 4 * one
    loaded = 0
    for prompt, (cache, _) in zip(prompts, kept):
        hit = disk.load(prompt + [1], model)
        if hit is not None:
            loaded += 1
            assert_exact(hit.target, model, prompt + [1], cache.chunks)
    assert loaded and not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_files_are_safetensors_that_mx_load_reads_the_same(tmp_path):
    model = target("qwen3_5", "bfloat16")
    cache, saved = prefill(model, TOKENS[:40], stops=[20])
    hidden = Hidden((mx.random.normal((40, 8)).astype(mx.bfloat16),), mx.random.normal((40, 8)))
    disk = store(tmp_path)
    disk.save(TOKENS, saved, hidden=hidden)
    files = sorted(names(tmp_path))
    assert {n[:4] for n in files} == {"t-b-", "t-s-", "h-b-", "h-s-"}
    for name in files:
        path = tmp_path / disk.key / name
        mine, meta = _decode(path.read_bytes())
        theirs, their_meta = mx.load(str(path), return_metadata=True)
        assert meta == their_meta and meta["format"] == str(FORMAT) and meta["key"] == disk.key
        assert set(mine) == set(theirs) and mine
        for k, (arr, tag) in mine.items():
            a = theirs[k]
            assert (tag == "BF16") == (a.dtype == mx.bfloat16)
            bits = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
            assert np.array_equal(np.array(bits), arr) and list(a.shape) == list(arr.shape)
    tags = {tag for name in files for _, tag in _decode((tmp_path / disk.key / name).read_bytes())[0].values()}
    assert "BF16" in tags


def test_hidden_rows_round_trip_and_bound_the_length(tmp_path):
    model = target("llama", "float32")
    cache, saved = prefill(model, TOKENS[:70])
    rows = Hidden(tuple(mx.random.normal((70, 8), key=mx.random.key(i)) for i in range(2)),
                  mx.random.normal((70, 8), key=mx.random.key(9)).astype(mx.bfloat16))
    store(tmp_path).save(TOKENS, saved, hidden=rows)
    disk = store(tmp_path)
    for prompt, n in ((TOKENS[:90], 70), (TOKENS[:53] + OTHER[:5], 48)):
        hit = disk.load(prompt, model, need_hidden=True)
        assert hit.cached == n and hit.hidden.length == n
        want = rows.rows(0, n)
        assert all(mx.array_equal(a, b).item() and a.dtype == b.dtype
                   for a, b in zip((*hit.hidden.layers, hit.hidden.final), (*want.layers, want.final)))
        assert_exact(hit.target, model, TOKENS, cache.chunks)
    # Rows for fewer tokens than the caches: need_hidden resumes where both can.
    _, more = prefill(model, OTHER[:70])
    disk.save(OTHER, more, hidden=rows.rows(0, 50))
    assert disk.load(OTHER[:90], model, need_hidden=True).cached == 48
    assert disk.load(OTHER[:90], model).cached == 70 and disk.load(OTHER[:90], model).hidden is None


def test_the_draft_lane_resumes_its_own_caches_and_is_optional(tmp_path):
    model, draft_model = target("llama", "float32"), noisy_drafter("qwen3_5", "float32")
    cache, saved = prefill(model, TOKENS[:70])
    dcache, dsaved = prefill(draft_model, TOKENS[:67], stops=[30])  # the drafter lags behind
    store(tmp_path).save(TOKENS, saved, draft=dsaved)
    disk = store(tmp_path)
    hit = disk.load(TOKENS[:90], model, draft_model=draft_model)
    assert hit.cached == 70 and hit.draft.length == 67
    assert_exact(hit.draft, draft_model, TOKENS, dcache.chunks)
    assert hit.entry.draft is not None and hit.entry.draft.length == 67
    hit = disk.load(TOKENS[:50] + OTHER[:5], model, draft_model=draft_model)
    assert hit.cached == 48 and hit.draft.length == 30
    assert_exact(hit.draft, draft_model, TOKENS, dcache.chunks)
    # Saved without a drafter: the target's files serve a run with one (and the other way round).
    _, other = prefill(model, OTHER[:70])
    disk.save(OTHER, other)
    hit = disk.load(OTHER[:90], model, draft_model=draft_model)
    assert hit.cached == 70 and hit.draft is None
    # Another drafter (its own lane tag) shares the target's files, never the draft's.
    tagged = store(tmp_path, draft_parts={"draft": "one"})
    tagged.save(TOKENS, saved, draft=dsaved)
    hit = store(tmp_path, draft_parts={"draft": "one"}).load(TOKENS[:90], model, draft_model=draft_model)
    assert hit.draft.length == 67
    hit = store(tmp_path, draft_parts={"draft": "two"}).load(TOKENS[:90], model, draft_model=draft_model)
    assert hit.cached == 70 and hit.draft is None


def test_the_writer_saves_in_the_background(tmp_path):
    model = target("nemotron_h", "float32")
    cache, saved = prefill(model, TOKENS[:70], stops=[40])
    disk = store(tmp_path)
    writer = Writer(disk)
    pending = disk.snapshot(TOKENS, saved)
    assert pending.files and pending.nbytes > 0
    assert len(disk.snapshot(TOKENS, saved).files) == len(pending.files)  # not submitted: nothing is taken as done
    assert writer.submit(pending)
    # Once submitted, a second snapshot copies nothing (whether the writer got to it yet or not).
    assert disk.snapshot(TOKENS, saved).files == []
    assert writer.flush(timeout=30)
    hit = store(tmp_path).load(TOKENS[:90], model)
    assert hit.cached == 70
    assert_exact(hit.target, model, TOKENS, cache.chunks)
    writer.close(timeout=30)
    assert not writer.submit(disk.snapshot(OTHER, saved)) and writer.dropped == 1


# One process of the test below: its own store on the shared folder, saving and evicting.
_PROCESS = """
import sys
import numpy as np
from specdec_cli.cache.caches import ModelCache
from specdec_cli.session.disk_cache import DiskStore
from specdec_cli.session.state import SavedCache
from specdec_cli.session.synthetic import TINY_CONFIGS, build_model

folder, bound, order = sys.argv[1], int(sys.argv[2]), sys.argv[3]
model = build_model(TINY_CONFIGS["qwen3_5"], seed=0)
disk = DiskStore(folder, {PARTS!r}, max_bytes=bound, block={B})
prompts = {PROMPTS!r}
for p in (prompts if order == "forward" else prompts[::-1]):
    cache = ModelCache(model)
    cache.prefill(p, {STEP}, stops=[len(p) // 2])
    saved = SavedCache.of(cache)
    for mark in cache.marks:
        saved.add(mark)
    disk.save(p, saved)
print("saved", disk.written)
"""


def test_two_processes_saving_into_one_folder_leave_only_files_that_load_exactly(tmp_path):
    import subprocess
    import sys

    prompts = [TOKENS[:30 + 9 * k] for k in range(5)] + [OTHER[:30 + 9 * k] for k in range(5)]
    model = build_model(TINY_CONFIGS["qwen3_5"], seed=0)
    kept = [prefill(model, p, stops=[len(p) // 2]) for p in prompts]
    one = store(tmp_path / "probe").save(prompts[-1], kept[-1][1])
    code = _PROCESS.format(PARTS=PARTS, B=B, STEP=STEP, PROMPTS=prompts)
    env = {**os.environ, "PYTHONPATH": python_path()}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "shared"), str(4 * one), order],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for order in ("forward", "backward")]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "saved" in out, err
        assert "warning" not in err.lower(), err  # no file either one read or wrote was damaged
    disk = store(tmp_path / "shared")
    assert 0 < disk.nbytes <= 4 * one and not list(disk.dir.glob(".*"))  # bounded, no temporaries left
    hits = 0
    for p in prompts:
        hit = disk.load(p + [1], model)
        if hit is None:
            continue
        hits += 1
        # What eviction left resumes exactly: the caches of the save that wrote that state, prefilled directly.
        n = hit.cached
        (q,) = {tuple(q) for q in prompts if list(q[:n]) == list(p[:n]) and n in (len(q), len(q) // 2)}
        direct, _ = prefill(model, list(q[:n]), stops=[len(q) // 2] if n == len(q) else [])
        assert max_cache_diff(hit.target, direct) == 0
    assert hits


# --- issue 55: the folder is private, a file is what its name says, each key has its own bound ----------


def modes(folder: Path) -> set[int]:
    return {p.stat().st_mode & 0o777 for p in folder.iterdir()}


def test_the_key_folder_and_its_files_are_private_whatever_the_umask(tmp_path):
    model = target("llama", "float32")
    _, saved = prefill(model, TOKENS[:70])
    old = os.umask(0)  # the loosest umask: a plain open() or mkdir() would leave 0666 / 0777
    try:
        disk = store(tmp_path / "cache")
        assert disk.save(TOKENS, saved) > 0
    finally:
        os.umask(old)
    assert disk.dir.stat().st_mode & 0o777 == 0o700
    assert len(list(disk.dir.iterdir())) > 2 and modes(disk.dir) == {0o600}
    # The folders it made above its key's too (a cache root removed while a server ran comes back private).
    made = [p for p in disk.dir.parents if p.is_relative_to(tmp_path / "cache")]
    assert made and {p.stat().st_mode & 0o777 for p in made} == {0o700}


def test_a_key_folder_an_older_release_left_readable_is_made_private(tmp_path):
    model = target("llama", "float32")
    _, saved = prefill(model, TOKENS[:70])
    disk = store(tmp_path)
    disk.dir.mkdir(mode=0o755)
    os.chmod(disk.dir, 0o755)
    disk.save(TOKENS, saved)
    assert disk.dir.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("how", ["another user's", "writable by others"])
def test_a_key_folder_others_could_have_written_is_never_read(tmp_path, caplog, how):
    if how == "another user's" and os.geteuid() != 0:
        pytest.skip("only root can give a folder to another user")
    model = target("llama", "float32")
    _, saved = prefill(model, TOKENS[:70])
    disk = store(tmp_path)
    disk.save(TOKENS, saved)
    assert store(tmp_path).load(TOKENS[:90], model).cached == 70  # sound as it is
    if how == "another user's":
        os.chown(disk.dir, 54321, 54321)
    else:
        os.chmod(disk.dir, 0o777)
    with caplog.at_level(logging.WARNING, logger=LOG):
        again = store(tmp_path)
        assert again.load(TOKENS[:90], model) is None
        assert again.save(OTHER, saved) == 0  # nor written into, and not made private under someone's feet
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings and "plant" in warnings[0] and len([w for w in warnings if "plant" in w]) == 1


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_name("swap")
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)


@pytest.mark.parametrize("kind", ["block", "record"])
def test_a_file_under_another_prompts_name_is_refused_and_the_load_is_exact(tmp_path, caplog, kind):
    # Two prompts' files at the same position, swapped (or copied in by anyone who can write the folder):
    # each is sound, so only its own chain hash and index tell that it is not what its name says.
    model = target("qwen3_5" if kind == "record" else "llama", "float32")
    (_, a), (_, b) = prefill(model, TOKENS[:70]), prefill(model, OTHER[:70])
    disk = store(tmp_path)
    disk.save(TOKENS[:70], a)
    disk.save(OTHER[:70], b)
    chains = [disk._chain(np.asarray(t[:70], dtype=np.int64), 4) for t in (TOKENS, OTHER)]
    if kind == "block":
        x, y = (disk.dir / disk._block_name("t", c[1]) for c in chains)
    else:
        x, y = (disk.dir / disk._record_name("t", c, np.asarray(t[:70], dtype=np.int64), 70)
                for c, t in zip(chains, (TOKENS, OTHER)))
    assert x.exists() and y.exists()
    _swap(x, y)
    with caplog.at_level(logging.WARNING, logger=LOG):
        hit = store(tmp_path).load(TOKENS[:90], model)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and x.name in warnings[0] and "chain" in warnings[0]
    # Refused and removed: a block was the chain's first, and a recurrent state resumes only at a
    # record, so either way the prompt is prefilled instead of resuming the other prompt's state.
    assert not x.exists() and hit is None
    assert store(tmp_path).load(OTHER[:90], model) is None and not y.exists()  # the other file likewise


def test_a_full_disk_shrinks_the_bound_to_what_fits_once_and_frees_room(tmp_path, caplog, monkeypatch):
    import shutil

    from specdec_cli.session import disk_cache

    model = target("llama", "float32")
    _, big = prefill(model, TOKENS[:120])
    _, small = prefill(model, OTHER[:40])
    disk = store(tmp_path)
    held = disk.save(TOKENS, big)
    real = os.replace

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    monkeypatch.setattr(disk_cache.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 40, 1 << 40, 0))
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert disk.save(OTHER, small) == 0
        assert disk.save(OTHER, small) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "full" in warnings[0] and "bound is now" in warnings[0]
    assert 0 < disk.max_bytes < held and disk.nbytes <= disk.max_bytes  # evicted below what it held
    monkeypatch.setattr(os, "replace", real)
    assert disk.save(OTHER, small) > 0 and disk.nbytes <= disk.max_bytes
    assert store(tmp_path).load(OTHER[:60], model).cached == 40


def test_each_key_counts_against_its_own_bound_and_abandoned_keys_go(tmp_path):
    model = target("llama", "float32")
    _, saved = prefill(model, TOKENS[:70])
    probe = store(tmp_path / "probe").save(TOKENS, saved)
    big = store(tmp_path / "shared", {**PARTS, "model": "big"})
    big.save(TOKENS, saved)
    theirs = sorted(os.listdir(big.dir))
    old = store(tmp_path / "shared", {**PARTS, "model": "old"})
    old.save(TOKENS, saved)
    month = time.time() - 31 * 24 * 3600
    for f in old.dir.iterdir():
        os.utime(f, (month, month))
    small = store(tmp_path / "shared", max_bytes=probe // 2)
    small.save(OTHER, saved)
    assert sorted(os.listdir(big.dir)) == theirs  # another server's bound, not this one's
    assert small.nbytes <= probe // 2
    assert not old.dir.exists()  # nobody used it for a month: removed whole
