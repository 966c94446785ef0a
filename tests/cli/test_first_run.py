"""The first run on a fresh machine: the bundled model, --dtype auto, BLAS on Linux, doctor."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import zipfile
from importlib import resources
from pathlib import Path

import mlx.core as mx
import pytest
from typer.testing import CliRunner

import specdec_cli.cli.doctor as doctor
from specdec_cli.model import blas, bundled
from specdec_cli.model.blas import Probe, decide
from specdec_cli.cli.app import app
from specdec_cli.model.files import resolve_dtype
from specdec_cli.session.loading import load
from specdec_cli.session.synthetic import make_model_dir

ROOT = Path(__file__).resolve().parents[2]
MODEL_REL = f"specdec_cli/models/{bundled.NAME}"
# A summary repeats the prompt's words, so prompt lookup's drafts get accepted.
SUMMARY_PROMPT = (
    "Summarize in one sentence: The city council met on Tuesday to discuss the new park. The park will "
    "have a playground, a small lake and walking paths. Residents asked for more trees and benches."
)


def fresh_env(**extra: str) -> dict:
    """A child environment as on a fresh machine: no preload, no marker, no Hub."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.MARKER, blas.OPT_OUT)}
    env.update({"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **extra})
    return env


# --- the bundled model ---------------------------------------------------------

def test_bundled_model_is_package_data_found_through_importlib_resources():
    traversable = resources.files("specdec_cli") / "models" / bundled.NAME
    assert Path(str(traversable)) == bundled.model_dir()
    for name in ("config.json", "tokenizer.json", "model.safetensors", "LICENSE", "PROVENANCE.md"):
        assert (traversable / name).is_file(), name
    # Sizes and SHA-256 equal the recorded ones: FILES stays in step with the files.
    checks = bundled.check_files(full=True)
    assert [c.name for c in checks if not c.ok] == []
    assert all(c.sha256_ok for c in checks)
    assert bundled.require() == bundled.model_dir()


def test_bundled_model_is_tracked_by_git():
    # An ignored or untracked file would be missing from a clone, and so from `pip install .`.
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", MODEL_REL], cwd=ROOT, capture_output=True, text=True, check=True)
    tracked = {Path(p).name for p in out.stdout.split()}
    assert set(bundled.FILES) | {"PROVENANCE.md"} <= tracked
    head = f"specdec_cli/models/{bundled.HEAD_NAME}"
    out = subprocess.run(["git", "ls-files", head], cwd=ROOT, capture_output=True, text=True, check=True)
    assert {"config.json", "model.safetensors", "README.md"} <= {Path(p).name for p in out.stdout.split()}


def _pip(*args: str, cwd: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def _bundled_dir_in(site: Path) -> dict:
    code = ("import json; from specdec_cli.model import bundled; d = bundled.require(); "
            "print(json.dumps({'dir': str(d), 'ok': all(c.ok for c in bundled.check_files(d, full=True))}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=site, env=fresh_env(PYTHONPATH=str(site)),
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_the_wheel_carries_the_bundled_model(tmp_path):
    """The wheel holds the model as package data, and an install of it finds it through importlib.resources.

    `pip install .` from a clone goes through the same PEP 517 build (setuptools' build_wheel).
    """
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "specdec_cli", src / "specdec_cli", ignore=shutil.ignore_patterns("__pycache__"))

    _pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(src), cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("specdec_cli-*.whl")
    with zipfile.ZipFile(wheel) as z:
        sizes = {i.filename: i.file_size for i in z.infolist()}
    for name, (size, _) in bundled.FILES.items():
        assert sizes.get(f"{MODEL_REL}/{name}") == size, name
    assert f"{MODEL_REL}/PROVENANCE.md" in sizes
    assert f"specdec_cli/models/{bundled.HEAD_NAME}/model.safetensors" in sizes

    site = tmp_path / "site"
    _pip("install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel), cwd=tmp_path)
    assert _bundled_dir_in(site) == {"dir": str(site / MODEL_REL), "ok": True}


@pytest.fixture
def broken_bundle(tmp_path, monkeypatch):
    """A copy of the bundled model's small files, the weights to be damaged by each test."""
    d = tmp_path / bundled.NAME
    d.mkdir()
    for name in bundled.FILES:
        if name != "model.safetensors":
            shutil.copy(bundled.model_dir() / name, d / name)
    monkeypatch.setattr(bundled, "model_dir", lambda: d)
    return d


def _generate(*args: str):
    return CliRunner().invoke(app, ["generate", *args])


@pytest.mark.parametrize("damage", ["missing", "truncated", "garbage"])
def test_a_damaged_bundled_model_is_one_line_naming_the_reinstall(broken_bundle, damage):
    weights = broken_bundle / "model.safetensors"
    size = bundled.FILES["model.safetensors"][0]
    if damage == "truncated":
        with weights.open("wb") as f:
            f.truncate(size // 2)
    elif damage == "garbage":  # right size, unreadable header (sparse: costs no disk)
        with weights.open("wb") as f:
            f.write(b"\xff" * 64)
            f.truncate(size)
    result = _generate("-p", "Hi", "-m", "4")
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "bundled default model is damaged" in lines[0]
    assert "pip install --force-reinstall" in lines[0]
    assert "Traceback" not in result.output


def test_an_explicit_model_does_not_touch_the_bundled_one(broken_bundle, tmp_path):
    tiny = make_model_dir(tmp_path / "tiny", "llama", seed=0)
    result = _generate("--model", str(tiny), "Hello", "-m", "4", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model"] == str(tiny)


# --- --dtype auto ----------------------------------------------------------------

def test_dtype_auto_is_float32_on_the_cpu_and_the_checkpoints_own_on_a_gpu(monkeypatch):
    assert mx.default_device() == mx.cpu
    assert resolve_dtype("auto") == "float32"
    assert resolve_dtype("bfloat16") == "bfloat16" and resolve_dtype(None) is None
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    assert resolve_dtype("auto") is None
    assert resolve_dtype("float16") == "float16"  # explicit wins


def test_dtype_auto_keeps_a_quantized_checkpoint_quantized_on_a_gpu(monkeypatch):
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)  # only the dtype decision reads it
    loaded = load(str(bundled.model_dir()), "auto")
    assert loaded.dtype == "4-bit quantized"
    assert any(hasattr(m, "scales") for _, m in loaded.model.named_modules())


@pytest.mark.parametrize("flag, expected", [([], "float32"), (["--dtype", "bfloat16"], "bfloat16")])
def test_json_and_stats_say_which_model_and_dtype_ran(tmp_path, flag, expected):
    tiny = make_model_dir(tmp_path / "tiny", "llama", seed=0)  # stored in bfloat16
    result = _generate("--model", str(tiny), "Hello", "-m", "4", "--json", *flag)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["dtype"] == expected and report["model_path"] == str(tiny)
    result = _generate("--model", str(tiny), "Hello", "-m", "4", "--no-live", *flag)
    auto = " (--dtype auto)" if not flag else ""
    assert f"Model: {tiny}, {expected}{auto}\n" in result.stderr


# --- BLAS on Linux: the decision, with the probes mocked ----------------------

REF = "/venv/lib/python3.11/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0"
SYS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"


@pytest.mark.parametrize("probe, action", [
    (Probe("darwin", None, None), "none"),
    (Probe("darwin", REF, SYS), "none"),  # never on macOS, whatever the probes say
    (Probe("linux", None, SYS), "none"),  # an mlx without the bundled reference BLAS
    (Probe("linux", REF, SYS, ld_preload=SYS), "none"),
    (Probe("linux", REF, SYS, ld_preload="/opt/OpenBLAS/lib/libopenblas.so"), "none"),
    (Probe("linux", REF, SYS, reexeced=True), "none"),  # the marker: never twice
    (Probe("linux", REF, SYS, opted_out=True), "none"),
    (Probe("linux", REF, None), "hint"),
    (Probe("linux", REF, None, opted_out=True), "none"),
    (Probe("linux", REF, SYS), "reexec"),
])
def test_blas_decision(probe, action):
    assert decide(probe).action == action


def test_reexec_preloads_openblas_ahead_of_the_users_preload():
    d = decide(Probe("linux", REF, SYS, ld_preload="/usr/lib/libjemalloc.so.2"))
    assert d.action == "reexec" and d.ld_preload == f"{SYS}:/usr/lib/libjemalloc.so.2"
    assert decide(Probe("linux", REF, SYS)).ld_preload == SYS


def test_probe_reads_the_environment_and_the_mlx_install(monkeypatch):
    monkeypatch.setattr(blas, "find_system_openblas", lambda: SYS)
    p = blas.probe({"LD_PRELOAD": "x.so", blas.MARKER: "1", blas.OPT_OUT: "0"})
    assert (p.ld_preload, p.reexeced, p.opted_out) == ("x.so", True, False)
    if sys.platform.startswith("linux"):
        # This test environment's mlx is the Linux CPU wheel, which vendors the reference BLAS.
        assert p.bundled_blas and "libblas" in Path(p.bundled_blas).name and p.system_openblas == SYS


def test_find_system_openblas_takes_the_first_that_exists(tmp_path):
    present = tmp_path / "openblas-pthread" / "libblas.so.3"
    present.parent.mkdir()
    present.write_bytes(b"")
    found = blas.find_system_openblas((str(tmp_path / "nope.so"), str(tmp_path / "openblas-pthread/libblas.so.3")))
    assert found == str(present)
    assert blas.find_system_openblas((str(tmp_path / "nope.so"),)) is None


def test_maybe_reexec_execs_this_command_line_with_the_preload_and_the_marker(monkeypatch):
    calls = []

    def fake_execve(path, argv, env):
        calls.append((path, argv, env))
        raise OSError("mocked")

    monkeypatch.setattr(blas, "probe", lambda environ: Probe("linux", REF, SYS))
    monkeypatch.setattr(os, "execve", fake_execve)
    decision = blas.maybe_reexec({"HOME": "/root"})
    ((path, argv, env),) = calls
    assert path == sys.executable and argv == list(sys.orig_argv)
    assert env == {"HOME": "/root", "LD_PRELOAD": SYS, blas.MARKER: "1"}
    assert decision.action == "none" and "failed" in decision.reason  # a failed exec goes on as started


MAPS = (
    "7f01-7f02 r-xp 00000000 08:01 123 {p}\n"
    "7f03-7f04 rw-p 00000000 00:00 0 \n"
    "7ffd-7ffe rw-p 00000000 00:00 0 [stack]\n"
)
NUMPY_OPENBLAS = "/venv/lib/python3.11/site-packages/numpy.libs/libscipy_openblas64_-32a4b2a6.so"


def test_classify_names_the_blas_mlx_calls():
    mapped = blas.mapped_paths(MAPS.format(p=REF) + MAPS.format(p=NUMPY_OPENBLAS))
    assert mapped == sorted([REF, NUMPY_OPENBLAS, "[stack]"])
    # numpy's OpenBLAS is mapped but serves no cblas_sgemm: MLX is on its reference BLAS.
    ref = blas.classify(None, mapped)
    assert ref.reference and ref.path == REF
    preloaded = blas.classify(SYS, mapped)  # the global scope serves it: the preload wins
    assert preloaded.name == "OpenBLAS" and not preloaded.reference
    assert blas.classify(None, ["/usr/lib/libc.so.6"]).name == "unknown"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux dynamic loader")
def test_global_provider_finds_a_symbol_and_its_library():
    assert "libc" in Path(blas.global_provider("malloc")).name
    assert blas.global_provider("no_such_symbol_anywhere") is None


@pytest.mark.parametrize("system, expected", [(None, "apt-get install libopenblas0-pthread"),
                                              (SYS, f"LD_PRELOAD={SYS}")])
def test_note_names_the_fix_on_the_reference_blas(monkeypatch, system, expected):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(blas, "in_use", lambda: blas.InUse("reference", REF, reference=True))
    monkeypatch.setattr(blas, "find_system_openblas", lambda: system)
    line = blas.note(cpu_backend=True, environ={})
    assert line.startswith("note: ") and expected in line and "\n" not in line
    assert blas.note(cpu_backend=False, environ={}) is None  # a GPU run does not care
    assert blas.note(cpu_backend=True, environ={blas.OPT_OUT: "1"}) is None
    monkeypatch.setattr(blas, "in_use", lambda: blas.InUse("OpenBLAS", SYS))
    assert blas.note(cpu_backend=True, environ={}) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD re-exec is Linux only")
def test_the_cli_reexecutes_once_and_the_child_sees_the_preload(tmp_path):
    # A sitecustomize on the path logs every interpreter start: the parent, then one re-exec.
    log = tmp_path / "starts.log"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        f"    f.write(os.environ.get('LD_PRELOAD', '-') + ' ' + os.environ.get({blas.MARKER!r}, '-') + '\\n')\n"
    )
    env = fresh_env(PYTHONPATH=f"{hook}{os.pathsep}{ROOT}")
    run = [sys.executable, "-m", "specdec_cli", "doctor", "--json"]
    out = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    (line,) = out.stdout.splitlines()  # one report: the parent never got to print
    report = json.loads(line)
    starts = log.read_text().splitlines()
    system = blas.find_system_openblas()
    if blas.find_bundled_blas() is None:
        pytest.skip("this mlx has no bundled reference BLAS")
    if system is None:  # nothing to preload: no re-exec, and the fix is named
        assert starts == ["- -"]
        assert report["blas"]["in_use"].startswith("reference") and report["blas"]["ld_preload"] is None
        assert any("apt-get install libopenblas0-pthread" in n for n in report["notes"])
    else:
        assert starts == ["- -", f"{system} 1"]
        assert report["blas"]["in_use"] == "OpenBLAS" and report["blas"]["ld_preload"] == system
        assert report["blas"]["how"].startswith("preloaded by specdec")

    # Opting out: one start, MLX stays on the bundled BLAS.
    log.unlink()
    out = subprocess.run(run, cwd=ROOT, env={**env, blas.OPT_OUT: "1"}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert log.read_text().splitlines() == ["- -"]
    assert json.loads(out.stdout)["blas"]["in_use"].startswith("reference")


# --- doctor ------------------------------------------------------------------------

@pytest.fixture
def no_network(monkeypatch):
    calls = []

    def urlopen(request, timeout):
        calls.append((request.full_url, timeout))
        raise urllib.error.URLError("mocked: no network")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr(doctor.urllib.request, "urlopen", urlopen)
    return calls


def test_doctor_reports_everything_a_bug_report_needs(no_network):
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    for key in ("platform", "python", "mlx", "packages", "hub", "hub cache", "default model"):
        assert any(line.startswith(key + " ") for line in out.splitlines()), key
    assert f"mlx-lm {doctor._version('mlx-lm')}" in out and f"typer {doctor._version('typer')}" in out
    assert "unreachable (URLError: mocked: no network)" in out
    assert "intact (sizes and SHA-256 verified)" in out
    if sys.platform.startswith("linux"):
        assert any(line.startswith("blas ") for line in out.splitlines())
    assert no_network and no_network[0][1] == doctor.HUB_TIMEOUT_S


def test_doctor_json(no_network):
    result = CliRunner().invoke(app, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["mlx"]["version"] == mx.__version__ and report["mlx"]["backend"] == "CPU"
    assert report["mlx"]["dtype_auto"] == "float32"
    assert report["hub"]["reachable"] is False and report["hub"]["cache_dir"]
    assert report["default_model"]["intact"] and report["default_model"]["present"]
    assert {"mlx-lm", "typer", "huggingface-hub", "rich"} <= {k for k, v in report["packages"].items() if v}
    if sys.platform.startswith("linux"):
        assert report["blas"]["in_use"] == blas.in_use().name


def test_doctor_lists_every_mlx_backend_build_mlx_declares():
    """mlx's extras name its backend builds (mlx-cpu, mlx-cuda-12, mlx-cuda-13, mlx-metal): doctor reports each
    by that name, so a CUDA install's build is in the report (it asked for "mlx-cuda", which MLX 0.32 has not)."""
    import re
    from importlib import metadata

    declared = {re.split(r"[ ;=<>!~\[]", r, maxsplit=1)[0] for r in metadata.requires("mlx") or ()}
    builds = {name for name in declared if re.fullmatch(r"mlx-(cpu|metal|cuda(-\d+)?)", name)}
    assert builds and builds <= set(doctor.PACKAGES), (builds, doctor.PACKAGES)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MLX's backends are separate builds on Linux only")
def test_doctor_json_carries_the_backend_warning(no_network, monkeypatch):
    from specdec_cli.model import backend

    monkeypatch.setattr(backend, "installed_backends", lambda: ["mlx-cpu", "mlx-cuda-13"])
    monkeypatch.setattr(backend, "active_backend", lambda found: "mlx-cpu")
    result = CliRunner().invoke(app, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    notes = json.loads(result.stdout)["notes"]
    assert any("pip install --force-reinstall --no-deps mlx-cuda-13" in n for n in notes), notes
    plain = CliRunner().invoke(app, ["doctor"])  # said once, among its notes (not again as the start-up warning)
    assert plain.exit_code == 0 and plain.output.count("--no-deps mlx-cuda-13") == 1, plain.output


def test_doctor_reports_a_damaged_model_and_still_exits_zero(broken_bundle, no_network):
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0
    assert "DAMAGED: model.safetensors: missing" in result.stdout
    assert "pip install --force-reinstall" in result.stdout


def test_hub_reachable_counts_any_http_answer(monkeypatch):
    def answer_404(request, timeout):
        raise urllib.error.HTTPError(request.full_url, 404, "Not Found", {}, None)

    monkeypatch.setattr(doctor.urllib.request, "urlopen", answer_404)
    assert doctor.hub_reachable("https://hub.example") == (True, "HTTP 404")

    def time_out(request, timeout):
        raise TimeoutError("timed out")

    monkeypatch.setattr(doctor.urllib.request, "urlopen", time_out)
    assert doctor.hub_reachable("https://hub.example") == (False, "TimeoutError: timed out")


def test_doctor_skips_the_network_in_offline_mode(monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr(doctor, "hub_reachable", lambda *a: pytest.fail("network used in offline mode"))
    assert doctor.hub_info()["reachable"] is None


# --- the real model, end to end --------------------------------------------------

def test_first_run_the_bundled_model_speculates_exactly(tmp_path):
    """No --model, no --dtype, fresh offline Hub: float32, prompt lookup, identical to plain decoding."""
    env = fresh_env(HF_HOME=str(tmp_path / "hf"))
    run = [sys.executable, "-m", "specdec_cli", "generate", "-p", SUMMARY_PROMPT, "-m", "32", "--compare-ar",
           "--json"]
    out = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["model"] == bundled.DISPLAY_NAME and report["dtype"] == "float32"
    assert report["drafter"] == "lookup"
    assert report["compare"]["identical"] and report["compare"]["tokens"] == report["generated_tokens"] > 0
    assert report["drafted"] > 0 and report["accepted"] > 0
    assert report["text"].strip()


def test_the_bundled_head_drafts_for_the_bundled_model_exactly(tmp_path):
    """--drafter mtp on the bundled model runs its distilled head; auto says why it keeps to lookup."""
    assert bundled.head_dir() is not None, "the bundled model's distilled head is missing"
    env = fresh_env(HF_HOME=str(tmp_path / "hf"))
    run = [sys.executable, "-m", "specdec_cli", "generate", "--drafter", "mtp", "-p",
           "Write a four-line poem about the sea.", "-m", "32", "--compare-ar", "--json"]
    out = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["drafter"] == "mtp"
    assert report["compare"]["identical"] and report["drafted"] > 0 and report["accepted"] > 0
    run[run.index("mtp")] = "auto"
    out = subprocess.run(run[:-2] + ["-m", "4"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    want = "drafter: auto -> lookup+mtp" if bundled.head_beats_lookup() else "drafter: auto -> lookup (the head"
    assert want in out.stderr


# --- README's commands are the ones CI runs ---------------------------------------------

def _commands(text: str) -> list[str]:
    """Shell command lines, comments and blank lines dropped."""
    lines = (line.split(" #")[0].strip() for line in text.splitlines() if not line.lstrip().startswith("#"))
    return [line for line in lines if line]


def test_ci_runs_readme_install_and_test_commands():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Development"):]
    block = section[section.index("```bash") + len("```bash"):]
    # .ci/run names its virtualenv .venv-ci so that a developer's .venv is left alone.
    want = [c.replace(".venv", ".venv-ci") for c in _commands(block[:block.index("```")])]
    ci = _commands((ROOT / ".ci" / "run").read_text())
    assert want[-1].startswith("python -m pytest -q") and ci[-1] == want[-1]
    at = [ci.index(c) if c in ci else None for c in want]
    assert None not in at and at == sorted(at), (want, ci)
    # The first-run install uses a virtualenv too (PEP 668 refuses pip outside one on
    # Homebrew's and Debian's Python); no doc falls back to the bare system pip install.
    first = readme[readme.index("## Install and first run"):readme.index("## Serve it")]
    assert "python3 -m venv .venv && . .venv/bin/activate && pip install ." in first
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        assert "python3 -m pip install ." not in doc.read_text(), doc.name
