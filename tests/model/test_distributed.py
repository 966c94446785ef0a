"""A target sharded over ranks by MLX's own distributed engine (``mlx.launch``), and its failures.

The launched checks share one ``mlx.launch --backend ring -n 2`` (each rank
runs every command in one process: tests/distributed_driver.py); the rank
deaths spawn two ranks by hand, so that one can be killed or stopped.
Timeouts here are hang guards only.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import pytest

from specdec_cli.model import distributed
from specdec_cli.model.distributed import Ranks, RanksDisagree, ShardingRefused, Watchdog, check_heads, checksum
from specdec_cli.errors import OptionError
from specdec_cli.session import ModelOptions, check_distributed_options
from specdec_cli.session.synthetic import TINY_CONFIGS, make_model_dir

from helpers import quantized, tied_qwen35
from server import free_port, launch_bin, python_path

PROMPT = "The quick brown fox jumps over the lazy dog, twice: the quick brown fox."
HANG_GUARD_S = 900
DRIVER = Path(__file__).resolve().parents[1] / "distributed_driver.py"


# --- without launching ------------------------------------------------------------------------

class _Group:
    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _ranks(rank: int = 0, size: int = 2, mode: str = "tensor") -> Ranks:
    return Ranks(_Group(rank, size), mode, "ring", watchdog=Watchdog(rank, 60.0, 2))


def test_checksum_sees_order_and_content():
    a = checksum(mx.array([1, 2, 3], dtype=mx.uint32)).item()
    assert a != checksum(mx.array([2, 1, 3], dtype=mx.uint32)).item()
    assert a != checksum(mx.array([1, 2, 4], dtype=mx.uint32)).item()
    assert a == checksum(mx.array([1, 2, 3], dtype=mx.uint32)).item()


def test_settle_takes_rank_0s_decision_and_raises_on_other_inputs():
    ranks = _ranks()
    # Rows: decision (n, next), checksum, position, fed length.
    assert ranks.settle(mx.array([[2, 7, 11, 5, 3], [2, 7, 11, 5, 3]])) == [2, 7]
    assert ranks.overridden == 0
    assert ranks.settle(mx.array([[2, 7, 11, 5, 3], [1, 9, 11, 5, 3]])) == [2, 7]
    assert ranks.overridden == 1
    with pytest.raises(RanksDisagree, match="rank 1 fed the target other tokens"):
        ranks.settle(mx.array([[2, 7, 11, 5, 3], [2, 7, 12, 5, 3]]))
    with pytest.raises(RanksDisagree, match="at position 6"):
        ranks.settle(mx.array([[2, 7, 11, 5, 3], [2, 7, 11, 6, 3]]))


def test_settle_rows_takes_rank_0s_decision_per_row_and_names_the_row_fed_otherwise():
    ranks = _ranks()
    # Two rows of one block: (n, next, checksum, position, fed length) each, side by side per rank.
    same = [2, 7, 11, 5, 3, 0, 9, 4, 8, 1]
    assert ranks.settle_rows(mx.array([same, same]), 2) == [[2, 7], [0, 9]]
    assert ranks.settle_rows(mx.array([same, [2, 7, 11, 5, 3, 1, 3, 4, 8, 1]]), 2) == [[2, 7], [0, 9]]
    assert ranks.overridden == 1
    with pytest.raises(RanksDisagree, match="rank 1 fed the target other tokens than rank 0 in row 1"):
        ranks.settle_rows(mx.array([same, [2, 7, 11, 5, 3, 0, 9, 6, 8, 1]]), 2)


def _handshake_on_two_ranks(parts: list[dict], details: list[dict]) -> list[BaseException]:
    """Each rank's handshake in a thread of its own, gathers exchanged through memory: what each raised."""
    barrier, table, raised = threading.Barrier(2, timeout=30), [None, None], [None, None]

    def gather(rank: int, row: mx.array) -> mx.array:
        table[rank] = row.tolist()
        barrier.wait()
        both = mx.array([list(table[0]), list(table[1])], dtype=mx.int32)
        barrier.wait()  # both have read the table before either writes its next row
        return both

    def run(rank: int) -> None:
        ranks = _ranks(rank)
        ranks.gather = lambda row: gather(rank, row)
        try:
            ranks.handshake(parts[rank], details=details[rank])
        except BaseException as e:
            raised[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return raised


def test_a_handshake_names_the_options_that_differ():
    # A model at another path on one machine: "the options" alone left the user to diff two commands.
    ours = {"--model": "/a/llama", "--max-tokens": 8, "--temp": 0.0}
    theirs = {"--model": "/b/llama", "--max-tokens": 8, "--temp": 0.5}
    raised = _handshake_on_two_ranks(
        [{"options": sorted(o.items()), "versions": "1"} for o in (ours, theirs)],
        [{"options": o} for o in (ours, theirs)])
    for e in raised:
        assert isinstance(e, RanksDisagree)
        assert str(e).startswith("rank 1 and rank 0 disagree on the options (--model, --temp): every rank"), e
    # Other versions may hold other options (the item names differ): no second gather, whose rows would differ.
    raised = _handshake_on_two_ranks(
        [{"options": sorted(ours.items()), "versions": v} for v in ("1", "2")],
        [{"options": ours}, {"options": {**ours, "--new": 1}}])
    assert [str(e).split(":")[0] for e in raised] == ["rank 1 and rank 0 disagree on the versions"] * 2
    assert _handshake_on_two_ranks([{"options": 1}, {"options": 1}], [{"options": ours}] * 2) == [None, None]


def test_ranks_compare_samples_of_the_weights_not_only_their_shapes(tmp_path):
    from specdec_cli.model.fingerprint import model_fingerprint, ranks_fingerprint

    # Two fine-tunes of one model: the same config, tokenizer, headers and sizes, other weights.
    a, b = make_model_dir(tmp_path / "a", "llama"), make_model_dir(tmp_path / "b", "llama", noise=0.05)
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)  # another machine's copy: other modification times, the same bytes
    assert model_fingerprint(a) == model_fingerprint(b)
    assert ranks_fingerprint(a) != ranks_fingerprint(b)
    assert ranks_fingerprint(a) == ranks_fingerprint(copy)


def test_heads_must_divide_by_the_ranks():
    smollm2 = {"model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3}
    with pytest.raises(ShardingRefused, match=r"2 ranks do not divide .*num_attention_heads 9.*use 3 ranks"):
        check_heads(smollm2, 2)
    check_heads(smollm2, 3)
    check_heads(TINY_CONFIGS["qwen3_5"], 2)
    with pytest.raises(ShardingRefused, match="linear_num_value_heads 4"):
        check_heads(TINY_CONFIGS["qwen3_5"], 3)


def _uneven_config(family: str = "llama") -> dict:
    """3 KV heads (6 query heads of 32): 2 ranks do not divide them; whole KV heads go 2 and 1."""
    return {**TINY_CONFIGS[family], "hidden_size": 192, "num_attention_heads": 6, "num_key_value_heads": 3,
            "head_dim": 32}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("bits", [None, 4])
def test_an_uneven_split_by_kv_heads_sums_to_the_whole_layer(bits, family):
    # The bundled model (9 query heads over 3 KV heads) on 2 ranks: rank 0 keeps 2 KV heads, rank 1 one. Each
    # rank's attention and MLP, before their all-sums, add up to the unsharded layer's (4-bit: cut at heads).
    from specdec_cli.model import uneven
    from specdec_cli.session.synthetic import build_model

    def model():
        return quantized(_uneven_config(family), bits=bits) if bits else build_model(_uneven_config(family))

    whole = model()
    assert uneven.problem(whole, _uneven_config(family), 2) is None
    x = mx.random.normal((1, 5, 192), key=mx.random.key(3))
    want = [whole.model.layers[0].self_attn(x, mask="causal", cache=None), whole.model.layers[0].mlp(x)]
    alone = mx.distributed.init()  # this process alone: each sharded layer's all-sum leaves its part as it is
    got = [mx.zeros_like(w) for w in want]
    for rank, (heads, kv) in enumerate([(4, 2), (2, 1)]):
        m = model()
        uneven.shard(m, _Group(rank, 2))
        for module in m.modules():
            if hasattr(module, "group"):
                module.group = alone
        attn = m.model.layers[0].self_attn
        assert (attn.n_heads, attn.n_kv_heads) == (heads, kv)
        got = [got[0] + attn(x, mask="causal", cache=None), got[1] + m.model.layers[0].mlp(x)]
    for g, w in zip(got, want):
        assert mx.abs(g - w).max().item() <= 1e-5 * max(1.0, mx.abs(w).max().item())


def test_what_cannot_be_split_unevenly_is_named():
    from specdec_cli.model import uneven
    from specdec_cli.session.synthetic import build_model

    one_kv = {**TINY_CONFIGS["llama"], "hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1}
    assert "1 KV head cannot be shared out over 2 ranks" in uneven.problem(build_model(one_kv), one_kv, 2)
    assert "not qwen3_5" in uneven.problem(build_model(TINY_CONFIGS["qwen3_5"]), TINY_CONFIGS["qwen3_5"], 2)
    assert uneven.split(3, 2) == [(0, 2), (2, 1)] and uneven.split(8, 3) == [(0, 3), (3, 3), (6, 2)]
    # A 4-bit MLP whose even share (96 features) is not whole groups of 64.
    wide = {**_uneven_config(), "intermediate_size": 192}
    m = quantized(wide, group_size=64)
    assert "4-bit MLP output cannot be cut every 96 features (groups of 64)" in uneven.problem(m, wide, 2)


def test_a_family_that_cannot_pipeline_is_refused_naming_those_that_can(tmp_path):
    from mlx_lm.utils import load_model

    model, config = load_model(make_model_dir(tmp_path / "llama", "llama"), lazy=True)
    with pytest.raises(ShardingRefused, match=r"cannot pipeline llama .*qwen3_5.*drop --pipeline"):
        distributed.shard(model, config, _ranks(mode="pipeline"))


def test_what_a_sharded_target_cannot_do_is_refused_before_loading():
    with pytest.raises(OptionError, match="--adapter-path"):
        check_distributed_options(ModelOptions(adapter_path="a"), "lookup", True)
    with pytest.raises(OptionError, match="--drafter mtp reads the target's hidden states"):
        check_distributed_options(ModelOptions(pipeline=True), "mtp", True)
    with pytest.raises(OptionError, match="stdin never ends"):
        check_distributed_options(ModelOptions(prompt="-"), "lookup", True)
    check_distributed_options(ModelOptions(prompt="-", adapter_path="a"), "mtp", False)


def test_backend_read_from_what_mlx_launch_exports():
    assert distributed.backend_name({"MLX_HOSTFILE": "/tmp/h"}) == "ring"
    assert distributed.backend_name({"MLX_IBV_DEVICES": "/tmp/d", "MLX_JACCL_COORDINATOR": "a:1"}) == "jaccl"
    assert distributed.backend_name({"NCCL_HOST_IP": "10.0.0.1"}) == "nccl"
    assert distributed.backend_name({}) == "unknown"


def test_ranks_sharing_this_machine_get_its_cores_for_blas(tmp_path):
    from specdec_cli.model import blas

    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"], ["127.0.0.1:5002"]]))
    env = {"MLX_HOSTFILE": str(hosts)}
    assert blas.local_ranks(env) == 3
    assert blas.rank_threads(env) == max(1, (os.cpu_count() or 1) // 3)
    assert blas.rank_threads({**env, "OPENBLAS_NUM_THREADS": "4"}) is None  # the user's choice stays
    hosts.write_text(json.dumps([["10.0.0.1:5000"], ["10.0.0.2:5000"]]))
    assert blas.rank_threads(env) is None  # one rank per machine
    assert blas.rank_threads({}) is None


def test_ring_noise_is_recognised_and_nothing_else():
    noise = distributed._NOISE
    for line in (b"[ring] Socket 5 was closed by the peer", b"[ring] Sending to socket 4 failed with errno 32",
                 b"[ring] Receiving from socket 7 failed with errno 104",
                 b"[ring] Too many send/recv errors. Failing pending tasks..."):
        assert noise.match(line)
    for line in (b"error: rank 0 lost its connection", b"[ring] Rank cannot be larger than the size of the group"):
        assert not noise.match(line)


def test_a_backends_lost_peer_becomes_one_line_and_other_errors_pass(monkeypatch):
    monkeypatch.setattr(distributed, "_CURRENT", _ranks(rank=1))
    with pytest.raises(distributed.PeerLost, match=r"^rank 1 lost its connection to the other ranks \(\[ring\] "
                                                    r"Socket 5 was closed by the peer\): another rank stopped"):
        with distributed.peer_errors():
            raise RuntimeError("[ring] Socket 5 was closed by the peer")
    with pytest.raises(RuntimeError, match="^shapes do not match$"):
        with distributed.peer_errors():
            raise RuntimeError("shapes do not match")
    monkeypatch.setattr(distributed, "_CURRENT", None)  # one process: no peers to lose
    assert not distributed.is_peer_error(RuntimeError("[ring] Socket 5 was closed by the peer"))


def test_pipeline_alone_is_refused(monkeypatch):
    monkeypatch.setattr(distributed, "_WORLD", _Group(0, 1))
    with pytest.raises(OptionError, match="start them with mlx.launch"):
        distributed.join(pipeline=True)
    assert distributed.join() is None


def test_the_watchdog_ends_a_process_whose_peers_stopped_answering():
    code = ("from specdec_cli.model.distributed import Watchdog\nimport time\n"
            "w = Watchdog(1, 0.5, 2)\nwith w.armed():\n    time.sleep(600)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "error: rank 1: no answer from the other ranks for 0.5 s (one of them stopped or lost its network): "
        "giving up"]


# A prefill chunk allowed ~4 s (its expected time, CHUNK_MARGIN x tokens x rate) outlasts the 0.5 s deadline;
# once an agreement ends it, the deadline alone holds again.
LONG_CHUNK = """
import sys, time
from specdec_cli.model.distributed import Watchdog
w = Watchdog(1, 0.5, 2)
with w.armed():
    w.rate = 0.01
    w.chunk(100)
    time.sleep(1.5)
    w.tick()
    print("survived", w.rate, flush=True)
    time.sleep(600)
"""


def test_a_long_prefill_chunk_is_allowed_for_and_a_stop_after_it_is_not():
    done = subprocess.run([sys.executable, "-c", LONG_CHUNK], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 1
    word, rate = done.stdout.split()
    assert word == "survived" and float(rate) >= 0.015  # the chunk's own seconds per token, timed at the tick
    assert done.stderr.strip().splitlines() == [
        "error: rank 1: no answer from the other ranks for 0.5 s (one of them stopped or lost its network): "
        "giving up"]


def test_a_processs_first_chunk_is_short_then_rank_0s_sizes_are_allowed_for(monkeypatch):
    ranks = _ranks(rank=0)
    shared = []
    monkeypatch.setattr(ranks, "share", lambda values: shared.append(list(values)) or list(values))
    assert ranks.prefill_chunk(2048) == distributed.FIRST_CHUNK  # no rate yet: measured on a short chunk
    assert ranks.watchdog.rate is None and ranks.watchdog.waited() == 0.0
    with ranks.watching():
        ranks.watchdog.tick()  # the next agreement times the chunk
        assert ranks.watchdog.rate > 0
        assert ranks.prefill_chunk(2048) == 2048
        extra = ranks.watchdog._extra
        assert extra == pytest.approx(distributed.CHUNK_MARGIN * 2048 * ranks.watchdog.rate)
        # /health's stall counts only the time beyond that allowance.
        assert ranks.watchdog.waited() == 0.0
        ranks.watchdog.tick()
        assert ranks.watchdog._extra == 0.0
    assert shared == [[distributed.FIRST_CHUNK], [2048]]
    # Another rank takes rank 0's size, whatever its own.
    other = _ranks(rank=1)
    monkeypatch.setattr(other, "share", lambda values: [distributed.FIRST_CHUNK])
    assert other.prefill_chunk(2048) == distributed.FIRST_CHUNK


def test_a_capped_first_chunk_does_not_cap_the_rest():
    from specdec_cli.cache.caches import ModelCache
    from specdec_cli.session.synthetic import build_model

    model = build_model(TINY_CONFIGS["llama"], seed=0)
    asked = []

    def agree(size):
        asked.append(size)
        return min(size, 5) if len(asked) == 1 else size

    cache = ModelCache(model)
    cache.prefill(list(range(40)), 16, agree=agree)
    assert cache.chunks == [5, 16, 16, 3] and asked == [16, 16, 16, 3]


# --- under mlx.launch: one launch, many commands -------------------------------------------------

def _models(tmp: Path) -> tuple[Path, Path, Path, Path]:
    """A dense target and its draft model, a hybrid one and its (one with partial accepts)."""
    return (make_model_dir(tmp / "llama", "llama"), make_model_dir(tmp / "llama-draft", "llama", noise=0.05),
            make_model_dir(tmp / "qwen35", tied_qwen35()),
            make_model_dir(tmp / "qwen35-draft", tied_qwen35(), noise=0.3))


def _llama3() -> dict:
    return {**TINY_CONFIGS["llama"], "hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1}


def _quantized_dir(path: Path, config: dict) -> Path:
    """``config``'s model in 4-bit (groups of 32), saved as mlx-lm saves a quantized model."""
    from specdec_cli.session.synthetic import save_model_dir

    return save_model_dir(path, quantized(config), {**config, "quantization": {"group_size": 32, "bits": 4}})


def _gen(model, *extra, m: int = 24) -> list[str]:
    return ["generate", "--model", str(model), "-p", PROMPT, "-m", str(m), "--ignore-chat-template", *extra]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every launched run's results, per rank: {name: {"code", "stdout", "stderr", "committed"}}."""
    tmp = tmp_path_factory.mktemp("distributed")
    llama, llama_draft, qwen, qwen_draft = _models(tmp)
    llama3 = make_model_dir(tmp / "llama3", _llama3())
    uneven = make_model_dir(tmp / "uneven", _uneven_config())
    uneven4 = _quantized_dir(tmp / "uneven4", _uneven_config())
    hybrid = ["--draft-model", str(qwen_draft), "--compare-ar", "--json"]
    sampled = _gen(llama, "--draft-model", str(llama_draft), "--temp", "0.8", "--seed", "7", "--json")
    schema = tmp / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "integer", "maximum": 99},
                                                                   "b": {"type": "boolean"}},
                                  "required": ["a", "b"], "additionalProperties": False}))
    runs = [
        ("tp_llama_lookup", _gen(llama, "--compare-ar", "--json")),
        # 3 KV heads over 2 ranks (the bundled model's case): split by whole KV heads, 2 and 1.
        ("tp_uneven_lookup", _gen(uneven, "--compare-ar", "--json")),
        ("tp_uneven_4bit_draft", _gen(uneven4, "--draft-model", str(uneven4), "--compare-ar", "--json")),
        ("tp_llama_draft", _gen(llama, "--draft-model", str(llama_draft), "--compare-ar", "--json")),
        ("tp_qwen35_capture", _gen(qwen, *hybrid, "--rollback", "capture")),
        ("tp_qwen35_tape", _gen(qwen, *hybrid, "--rollback", "tape")),
        ("tp_qwen35_carry", _gen(qwen, *hybrid, "--rollback", "carry")),
        ("pp_qwen35_lookup", _gen(qwen, "--pipeline", "--compare-ar", "--json")),
        ("pp_qwen35_draft", _gen(qwen, "--pipeline", *hybrid)),
        # Logits processors on every rank alike: a penalty, and a grammar that cuts drafts.
        ("tp_llama_penalty", _gen(llama, "--draft-model", str(llama_draft), "--repetition-penalty", "1.3",
                                  "--compare-ar", "--json")),
        ("tp_qwen35_schema", _gen(qwen, *hybrid, "--json-schema", str(schema), m=40)),
        ("sampled_1", sampled),
        ("sampled_2", sampled),
        ("text", _gen(llama, "--no-live", m=12)),
        ("sweep", ["sweep", "--model", str(llama), "-p", PROMPT, "-m", "8", "--ignore-chat-template",
                   "--drafter", "ngram", "--block-sizes", "2,4", "--warmup", "0", "--json"]),
        ("refuse_pipeline_llama", _gen(llama, "--pipeline")),
        ("refuse_heads", _gen(llama3)),
        ("refuse_pipeline_mtp", _gen(qwen, "--pipeline", "--drafter", "mtp")),
        ("refuse_stdin", ["generate", "--model", str(llama), "-p", "-"]),
        ("refuse_serve_exact", ["serve", "--model", str(llama), "--port", "0", "--exact"]),
        ("refuse_chat", ["chat", "--model", str(llama)]),
        # Small enough to finish should it run: it trained the whole head on every rank, into one --out.
        ("refuse_distill", ["distill", "--model", str(llama), "--out", str(tmp / "head"), "--data", str(schema),
                            "--steps", "1", "--batch-size", "2", "--seq-len", "8", "--no-measure"]),
    ]
    spec = {"out": str(tmp), "runs": [{"name": n, "args": a} for n, a in runs]}
    spec["runs"].append({"name": "disagree", "args": _gen(llama, m=5), "rank_args": {"1": _gen(llama, m=6)}})
    # One relative --json-schema path, another file (or none) per rank: as two machines may hold. Last:
    # unchecked, rank 1 failed mid-run (its grammar refused rank 0's token) and the ranks lost each other.
    other = json.dumps({"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]})
    for rank, text in ((0, schema.read_text()), (1, other)):
        (tmp / f"rank{rank}-files").mkdir()
        (tmp / f"rank{rank}-files" / "schema.json").write_text(text)
    (tmp / "no-files").mkdir()
    for name, rank_1 in (("schema_differs", "rank1-files"), ("schema_missing_on_rank_1", "no-files")):
        spec["runs"].append({"name": name, "args": _gen(llama, "--json-schema", "schema.json", m=8),
                             "rank_cwd": {"0": str(tmp / "rank0-files"), "1": str(tmp / rank_1)}})
    # One relative --model path, another fine-tune of the model on rank 1 (its headers and sizes the same).
    shutil.copytree(llama, tmp / "rank0-files" / "model")
    shutil.copytree(llama_draft, tmp / "rank1-files" / "model")
    spec["runs"].append({"name": "weights_differ", "args": _gen("model", m=8),
                         "rank_cwd": {"0": str(tmp / "rank0-files"), "1": str(tmp / "rank1-files")}})
    return _launch(tmp, spec, {**os.environ, "SPECDEC_NO_REEXEC": "1"})


def _launch(tmp: Path, spec: dict, env: dict) -> dict:
    """Runs ``spec``'s commands under ``mlx.launch --backend ring -n 2``: each rank's results by run name."""
    (tmp / "spec.json").write_text(json.dumps(spec))
    done = subprocess.run(
        [launch_bin(), "--backend", "ring", "-n", "2", "--starting-port", str(free_port()), "--",
         sys.executable, str(DRIVER), str(tmp / "spec.json")],
        capture_output=True, text=True, timeout=HANG_GUARD_S, env=env, cwd=tmp,
    )
    out = {}
    for rank in (0, 1):
        file = tmp / f"rank{rank}.json"
        assert file.exists(), f"rank {rank} wrote no results:\n{done.stdout}\n{done.stderr}"
        out[rank] = {r["name"]: r for r in json.loads(file.read_text())}
    return out


COMPARED = ["tp_llama_lookup", "tp_uneven_lookup", "tp_uneven_4bit_draft", "tp_llama_draft", "tp_qwen35_capture", "tp_qwen35_tape", "tp_qwen35_carry",
            "pp_qwen35_lookup", "pp_qwen35_draft", "tp_llama_penalty", "tp_qwen35_schema"]


def _report(run: dict) -> dict:
    lines = run["stdout"].splitlines()
    assert len(lines) == 1, run["stdout"] + run["stderr"]
    return json.loads(lines[0])


@pytest.mark.parametrize("name", COMPARED)
def test_sharded_speculation_equals_sharded_plain_decoding(launched, name):
    run = launched[0][name]
    assert run["code"] == 0, run["stderr"]
    report = _report(run)
    assert report["compare"]["verdict"] == "identical"
    assert report["generated_tokens"] > 0
    mode = "pipeline" if name.startswith("pp_") else "tensor"
    assert report["distributed"] == {"ranks": 2, "mode": mode, "backend": "ring", "overridden_decisions": 0}
    # Every rank committed the same tokens, in both runs (speculative, then plain).
    assert launched[1][name]["committed"] == run["committed"]
    assert len(run["committed"]) == 2 and run["committed"][0] == run["committed"][1]


@pytest.fixture(scope="module")
def launched_gpu_like(tmp_path_factory):
    """Sharded runs on the GPU-like backend (tests/gpu_like.py), every rank: rank 0's results by name."""
    import gpu_like

    tmp = tmp_path_factory.mktemp("distributed-gpu-like")
    llama, llama_draft, qwen, qwen_draft = _models(tmp)
    runs = [("tp_llama_draft", _gen(llama, "--draft-model", str(llama_draft), "--compare-ar", "--json")),
            ("tp_qwen35_capture", _gen(qwen, "--draft-model", str(qwen_draft), "--rollback", "capture",
                                       "--compare-ar", "--json")),
            ("pp_qwen35_draft", _gen(qwen, "--pipeline", "--draft-model", str(qwen_draft), "--compare-ar",
                                     "--json"))]
    spec = {"out": str(tmp), "runs": [{"name": n, "args": a} for n, a in runs]}
    env = {**gpu_like.environment(), "SPECDEC_NO_REEXEC": "1", "PYTHONPATH": python_path(gpu_like.SITE)}
    return _launch(tmp, spec, env)


@pytest.mark.parametrize("name", ["tp_llama_draft", "tp_qwen35_capture", "pp_qwen35_draft"])
def test_on_a_gpu_like_backend_sharded_speculation_is_plain_decoding_or_a_proven_tie(launched_gpu_like, name):
    run = launched_gpu_like[0][name]
    assert run["code"] == 0, run["stderr"]
    assert _report(run)["compare"]["verdict"] in ("identical", "rounding tie")
    assert launched_gpu_like[1][name]["committed"] == run["committed"]  # every rank committed the same


@pytest.mark.parametrize("name,strategy", [("tp_qwen35_capture", "capture"), ("tp_qwen35_tape", "tape"),
                                           ("tp_qwen35_carry", "carry")])
def test_the_hybrids_recurrent_state_is_cut_back_on_each_ranks_shard(launched, name, strategy):
    report = _report(launched[0][name])
    assert report["rollback"] == strategy
    assert report["rollbacks"].get(strategy, 0) > 0, report["rollbacks"]  # partial accepts happened


def test_a_sharded_schema_run_answers_valid_json(launched):
    report = _report(launched[0]["tp_qwen35_schema"])
    assert report["finish_reason"] == "eos"
    answer = json.loads(report["text"])
    assert set(answer) == {"a", "b"} and isinstance(answer["b"], bool), answer


def test_every_rank_but_rank_0_writes_nothing(launched):
    for name, run in launched[1].items():
        assert (run["stdout"], run["stderr"]) == ("", ""), name
        assert run["code"] == launched[0][name]["code"], name


def test_sampling_with_a_seed_is_the_same_on_every_rank_and_again(launched):
    first, second = (launched[0][n] for n in ("sampled_1", "sampled_2"))
    assert first["code"] == second["code"] == 0, first["stderr"]
    assert _report(first)["text"] == _report(second)["text"]
    assert first["committed"] == second["committed"] == launched[1]["sampled_1"]["committed"]
    assert first["committed"][0]


def test_text_once_on_stdout_and_the_summary_names_the_ranks(launched):
    run = launched[0]["text"]
    assert run["code"] == 0, run["stderr"]
    assert run["stdout"].endswith("\n") and run["stdout"].strip()
    assert "Distributed: 2 ranks, tensor parallel, MLX ring backend" in run["stderr"]


def test_sweep_runs_sharded(launched):
    run = launched[0]["sweep"]
    assert run["code"] == 0, run["stderr"]
    report = _report(run)
    assert report["distributed"]["ranks"] == 2
    assert [r["verdict"] for r in report["rows"]] == ["identical", "identical"]
    assert launched[1]["sweep"]["committed"] == run["committed"]


@pytest.mark.parametrize("name,code,words", [
    ("refuse_pipeline_llama", 1, "mlx-lm cannot pipeline llama (its model has no PipelineMixin); families that can:"),
    ("refuse_heads", 1, "2 ranks do not divide this model's heads (num_attention_heads 3, num_key_value_heads 1)"),
    ("refuse_heads", 1, "nor can they be split unevenly: 1 KV head cannot be shared out over 2 ranks"),
    ("refuse_pipeline_mtp", 2, "--drafter mtp reads the target's hidden states, which pipeline parallelism keeps"),
    ("refuse_stdin", 2, "under mlx.launch stdin never ends"),
    ("refuse_serve_exact", 2, "--exact is not built for a target sharded under mlx.launch yet"),
    ("refuse_chat", 2, "specdec chat runs in one process: under mlx.launch, run specdec generate, sweep or serve"),
    ("refuse_distill", 2, "specdec distill runs in one process: under mlx.launch, run specdec generate, sweep or serve"),
    ("disagree", 1, "rank 1 and rank 0 disagree on the options (--max-tokens): every rank must run the same command"),
    ("schema_differs", 1, "rank 1 and rank 0 disagree on the --json-schema file: every rank must run the same"),
    ("schema_missing_on_rank_1", 1, "rank 1 and rank 0 disagree on the --json-schema file: every rank must run"),
    ("weights_differ", 1, "rank 1 and rank 0 disagree on the model: every rank must run the same command on the"),
])
def test_refusals_are_one_line_from_rank_0(launched, name, code, words):
    run = launched[0][name]
    assert run["code"] == code
    lines = run["stderr"].splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], run["stderr"]
    assert run["stdout"] == ""


# --- a refusal under the real launcher ---------------------------------------------------------

# specdec's console entry point, with rank 0 slow to write its error line (a loaded or slower
# machine): rank 1 reaches the same refusal and would exit first.
SLOW_RANK_0 = """
import os, sys, time
from specdec_cli.cli import app as cli
if os.environ.get("MLX_RANK") == "0":
    write = cli._err
    cli._err = lambda line: (time.sleep(3), write(line))
sys.argv[0] = "specdec"
cli.main()
"""


def test_rank_0s_refusal_and_exit_code_survive_another_rank_ending_first(tmp_path):
    # mlx.launch ends every rank once one exits non-zero: the others must outlast rank 0.
    model = make_model_dir(tmp_path / "llama", "llama")
    (tmp_path / "slow_rank_0.py").write_text(SLOW_RANK_0)
    # This checkout's specdec_cli on every rank.
    env = {**os.environ, "SPECDEC_NO_REEXEC": "1", "PYTHONPATH": python_path()}
    done = subprocess.run(
        [launch_bin(), "--backend", "ring", "-n", "2", "--starting-port", str(free_port()), "--",
         sys.executable, "slow_rank_0.py", "chat", "--model", str(model)],
        capture_output=True, text=True, timeout=HANG_GUARD_S, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert errors == ["error: specdec chat runs in one process: under mlx.launch, run specdec generate, sweep or "
                      "serve (a chat sharded over several machines is not built yet); start specdec chat without "
                      "mlx.launch"], done.stderr
    # The launcher's own line for rank 0 carries the refusal's exit code (not 130 or -15: ended early).
    assert "Node with rank 0 exited with code 2" in done.stderr, done.stderr


def test_a_usage_error_under_the_launcher_is_rank_0s_one_line_and_exit_code(tmp_path):
    # The ranks parse before they join: each wrote the line, and rank 1, first out, had the launcher
    # end rank 0 (slow here) before it wrote its own, with -15 for its code.
    (tmp_path / "slow_rank_0.py").write_text(SLOW_RANK_0)
    env = {**os.environ, "SPECDEC_NO_REEXEC": "1", "PYTHONPATH": python_path()}
    done = subprocess.run(
        [launch_bin(), "--backend", "ring", "-n", "2", "--starting-port", str(free_port()), "--",
         sys.executable, "slow_rank_0.py", "generate", "-p", "hi", "--temp", "-1"],
        capture_output=True, text=True, timeout=HANG_GUARD_S, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert errors == ["error: Invalid value for '--temp': Input should be greater than or equal to 0 (range x>=0.0); "
                      "see 'specdec generate -h'"], done.stderr
    assert "Node with rank 0 exited with code 2" in done.stderr, done.stderr


# --- a rank that dies or hangs mid-run -----------------------------------------------------------

def _pair(tmp: Path, args: list[str], env: dict) -> list[subprocess.Popen]:
    hosts = tmp / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    base = {**os.environ, "SPECDEC_NO_REEXEC": "1", "MLX_HOSTFILE": str(hosts), **env}
    return [subprocess.Popen([sys.executable, "-m", "specdec_cli", *args], env={**base, "MLX_RANK": str(rank)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp) for rank in (0, 1)]


def _when_rank_0_writes(procs: list[subprocess.Popen], sig: int) -> tuple[int, str]:
    """Send ``sig`` to rank 1 once rank 0 has streamed some text; rank 0's exit code and stderr."""
    first, _, _ = select.select([procs[0].stdout], [], [], HANG_GUARD_S)
    if first:
        procs[0].stdout.read(1)
    procs[1].send_signal(sig)
    try:
        _, err = procs[0].communicate(timeout=HANG_GUARD_S)
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    return procs[0].returncode, err.decode()


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rank-death")
    model = make_model_dir(tmp / "llama", "llama")
    # Long enough to be mid-run when rank 1 goes (the text streams from the first blocks).
    args = _gen(model, "--drafter", "ngram", "--no-live", m=3000)
    return tmp, args


def test_a_killed_rank_ends_the_others_with_one_line(long_run):
    tmp, args = long_run
    code, err = _when_rank_0_writes(_pair(tmp, args, {}), signal.SIGKILL)
    assert code == 1, err
    lines = err.splitlines()
    # Either end is one line and exit 1. The ring usually reports the closed socket; once, on a
    # loaded CI machine, it waited instead and rank 0's watchdog ended it at the default 20 s.
    assert len(lines) == 1 and ("lost its connection to the other ranks" in lines[0]
                                or "no answer from the other ranks for 20 s" in lines[0]), err


def test_a_rank_that_stops_answering_ends_the_others_by_the_deadline(long_run):
    tmp, args = long_run
    code, err = _when_rank_0_writes(_pair(tmp, args, {distributed.DEADLINE_ENV: "2"}), signal.SIGSTOP)
    assert code == 1, err
    assert err.splitlines() == ["error: rank 0: no answer from the other ranks for 2 s (one of them stopped or "
                                "lost its network): giving up"], err
