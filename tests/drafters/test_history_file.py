"""``--lookup-history FILE``: only a regular file of ours is ever read back or rewritten.

Special files are made inside tmp_path only (a FIFO, a socket, a device node
made with mknod); nothing here touches a real device.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import tempfile
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdec_cli.cli.app import app
from specdec_cli.drafters.history import FORMAT, VERSION, HistoryFileError, LookupHistory, check_path
from specdec_cli.errors import OptionError
from specdec_cli.session.synthetic import make_model_dir


def ours(entries=((("tokA"), [1, 2, 3]),)) -> str:
    return json.dumps({"format": FORMAT, "version": VERSION,
                       "entries": [{"tokenizer": fp, "tokens": t} for fp, t in entries]}, separators=(",", ":"))


def in_thread(path, work, timeout=60.0):
    """``work()`` in a thread: (finished, result or exception). Blocking on the FIFO at ``path`` must not hang the test."""
    out = {}

    def run():
        try:
            out["result"] = work()
        except BaseException as e:  # noqa: BLE001  (handed back to the test)
            out["result"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive() and stat.S_ISFIFO(os.stat(path).st_mode):
        # Old behaviour: blocked opening the FIFO for reading. Release it (a writer that closes at once).
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(5)
        return False, None
    return True, out.get("result")


def test_a_fifo_is_refused_without_being_opened(tmp_path):
    fifo = tmp_path / "history.fifo"
    os.mkfifo(fifo)
    finished, result = in_thread(fifo, lambda: LookupHistory.load(fifo, "tokA"), timeout=20)
    assert finished, "loading a FIFO blocked (it was opened for reading)"
    assert isinstance(result, HistoryFileError) and isinstance(result, OptionError)
    assert "a FIFO" in str(result) and "\n" not in str(result)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_device_node_is_refused_and_left_a_device(tmp_path):
    node = tmp_path / "null-like"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # the null device's numbers, inside tmp_path
    except PermissionError:
        pytest.skip("mknod needs root")
    with pytest.raises(HistoryFileError, match="character device"):
        LookupHistory.load(node, "tokA")
    with pytest.raises(HistoryFileError, match="character device"):
        check_path(node)
    assert stat.S_ISCHR(os.stat(node).st_mode)


def test_a_device_is_refused_by_its_stat_alone(tmp_path, monkeypatch):
    # The same refusal without root: what stat reports decides, nothing is opened.
    path = tmp_path / "dev"
    path.write_text(ours())
    real_stat = os.stat

    def fake_stat(p, *a, **kw):
        st = real_stat(p, *a, **kw)
        if Path(p) == path:
            return os.stat_result((stat.S_IFCHR | 0o666,) + tuple(st)[1:])
        return st

    monkeypatch.setattr(os, "stat", fake_stat)
    monkeypatch.setattr(os, "open", lambda *a, **kw: pytest.fail("opened a device"))
    with pytest.raises(HistoryFileError, match="character device"):
        LookupHistory.load(path, "tokA")


def test_a_socket_and_a_directory_are_refused():
    with tempfile.TemporaryDirectory(dir="/tmp") as short:  # a socket path must be short
        sock_path = Path(short) / "s"
        s = socket.socket(socket.AF_UNIX)
        try:
            s.bind(str(sock_path))
            with pytest.raises(HistoryFileError, match="a socket"):
                LookupHistory.load(sock_path, "tokA")
            assert stat.S_ISSOCK(os.stat(sock_path).st_mode)
        finally:
            s.close()
        with pytest.raises(HistoryFileError, match="a directory"):
            LookupHistory.load(short, "tokA")


@pytest.mark.parametrize("content", [
    "my notes: buy milk\n",
    json.dumps({"format": "something else", "version": VERSION, "entries": []}),
    json.dumps([1, 2, 3]),
    "{ not json",
])
def test_a_file_that_is_not_a_history_is_refused_and_never_rewritten(tmp_path, content):
    notes = tmp_path / "notes.txt"
    notes.write_text(content)
    with pytest.raises(HistoryFileError, match="not a specdec lookup history"):
        LookupHistory.load(notes, "tokA")
    assert notes.read_text() == content


def test_another_format_version_is_refused(tmp_path):
    path = tmp_path / "h.json"
    content = json.dumps({"format": FORMAT, "version": VERSION + 1, "entries": []})
    path.write_text(content)
    with pytest.raises(HistoryFileError, match="another format version"):
        LookupHistory.load(path, "tokA")
    assert path.read_text() == content


@pytest.mark.parametrize("damaged", [
    ours()[:-7].encode(),                                          # cut short: not JSON
    ours().encode().replace(b"[1,2,3]", b'[1,"\xff\xfe",3]'),      # bytes that are not UTF-8
    ours().encode().replace(b"[1,2,3]", b'["x"]'),                 # a bad entry
])
def test_a_damaged_history_of_ours_is_set_aside_not_lost(tmp_path, damaged):
    path = tmp_path / "h.json"
    path.write_bytes(damaged)
    h = LookupHistory.load(path, "tokA")
    aside = tmp_path / "h.json.corrupt"
    assert h.outputs() == [] and "damaged" in h.warning and str(aside) in h.warning
    assert aside.read_bytes() == damaged and not path.exists()
    h.add([7, 8])
    h.save()
    assert LookupHistory.load(path, "tokA").outputs() == [[7, 8]]
    # A second damaged file does not replace the first one set aside.
    path.write_bytes(damaged)
    LookupHistory.load(path, "tokA")
    assert aside.read_bytes() == damaged and (tmp_path / "h.json.corrupt.1").read_bytes() == damaged


def test_an_empty_file_is_an_empty_history(tmp_path):
    path = tmp_path / "h.json"
    path.touch()
    h = LookupHistory.load(path, "tokA")
    assert h.outputs() == [] and h.warning is None


def test_writes_go_through_a_symlink_to_its_target(tmp_path):
    real = tmp_path / "real.json"
    real.write_text(ours())
    link = tmp_path / "link.json"
    link.symlink_to(real)
    h = LookupHistory.load(link, "tokA")
    assert h.outputs() == [[1, 2, 3]]
    h.add([4, 5])
    h.save()
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert LookupHistory.load(real, "tokA").outputs() == [[1, 2, 3], [4, 5]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json"]  # no temp file left


@pytest.mark.parametrize("mode", [0o644, 0o444, 0o640])
def test_the_file_keeps_its_mode(tmp_path, mode):
    path = tmp_path / "h.json"
    path.write_text(ours())
    path.chmod(mode)
    h = LookupHistory.load(path, "tokA")
    h.add([9])
    h.save()
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert LookupHistory.load(path, "tokA").outputs() == [[1, 2, 3], [9]]


def test_a_new_file_gets_the_usual_mode(tmp_path):
    mask = os.umask(0o022)
    try:
        h = LookupHistory.load(tmp_path / "new" / "h.json", "tokA")
        h.add([1])
        h.save()
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "new" / "h.json").stat().st_mode) == 0o644


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "h.json"
    path.write_text(ours())
    h = LookupHistory.load(path, "tokA")
    h.add([5])

    def broken(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(json, "dump", broken)
    with pytest.raises(OSError):
        h.save()
    assert path.read_text() == ours() and [p.name for p in tmp_path.iterdir()] == ["h.json"]


def test_save_refuses_what_the_path_became_since_loading(tmp_path):
    path = tmp_path / "h.json"
    h = LookupHistory.load(path, "tokA")
    h.add([1])
    os.mkfifo(path)  # a FIFO appeared where the new file was to go
    with pytest.raises(OSError, match="FIFO"):
        h.save()
    assert stat.S_ISFIFO(os.stat(path).st_mode)
    path.unlink()
    path.write_text("notes")
    with pytest.raises(OSError, match="no longer a lookup history"):
        h.save()
    assert path.read_text() == "notes"


# Through the command line: one line, exit 2, the file untouched.

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("history") / "llama", "llama", seed=0)


@pytest.mark.parametrize("what", ["notes", "fifo"])
def test_generate_refuses_the_path_in_one_line(tmp_path, tiny, what):
    path = tmp_path / "target"
    if what == "fifo":
        os.mkfifo(path)
    else:
        path.write_text("my notes\n")
    args = ["generate", "--model", str(tiny), "Hi", "-m", "4", "--no-live", "--lookup-history", str(path)]
    finished, result = in_thread(path, lambda: CliRunner().invoke(app, args))
    assert finished, "the run blocked on the FIFO"
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "--lookup-history" in lines[0] and "Traceback" not in result.stderr
    if what == "fifo":
        assert stat.S_ISFIFO(os.stat(path).st_mode)
    else:
        assert path.read_text() == "my notes\n"


@pytest.mark.parametrize("what", ["notes", "fifo", "directory"])
@pytest.mark.parametrize("command", ["generate", "sweep"])
def test_the_path_is_refused_before_any_model_loads(tmp_path, what, command):
    path = tmp_path / "target"
    if what == "fifo":
        os.mkfifo(path)
    elif what == "directory":
        path.mkdir()
    else:
        path.write_text("my notes\n")
    # A model that does not exist: had the history waited for the model, its absence would be the error (exit 1).
    args = [command, "--model", str(tmp_path / "no-such-model"), "Hi", "--lookup-history", str(path)]
    finished, result = in_thread(path, lambda: CliRunner().invoke(app, args))
    assert finished, "the run blocked on the FIFO"
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"error: --lookup-history {path}")
    assert "no-such-model" not in result.stderr


def test_check_path_refuses_a_file_that_is_not_a_history(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    with pytest.raises(HistoryFileError, match="not a specdec lookup history"):
        check_path(notes)
    for fine in (tmp_path / "new.json", tmp_path / "empty.json"):
        if fine.name == "empty.json":
            fine.write_text("")
        check_path(fine)  # a new path and an empty file are histories to start
    damaged = tmp_path / "damaged.json"
    damaged.write_text(ours()[:-5])
    check_path(damaged)  # ours, damaged: loading sets it aside with a warning
    assert notes.read_text() == "my notes\n"
