"""realhf.base.storage.atomic_file: whole-file replacement that readers never see torn."""

import json
import multiprocessing as mp
import os
import stat
import time

import pytest

from realhf.base.storage import atomic_file
from realhf.base.storage.atomic_file import write_atomic, write_json_atomic

PAYLOAD_SIZE = 256 * 1024
N_WRITERS = 4
WRITES_EACH = 200


def _payload(writer: int) -> bytes:
    # A writer-specific pattern that differs from every other writer's in each
    # 4 KiB page, so a mix of two writers' pages can never look valid.
    return bytes([(writer * 37 + 11) % 256]) * PAYLOAD_SIZE


def test_write_str_bytes_and_overwrite(tmp_path):
    path = str(tmp_path / "f.txt")
    write_atomic(path, "héllo")
    with open(path, "rb") as f:
        assert f.read() == "héllo".encode()
    write_atomic(path, b"\x00\x01bytes", fsync=False)
    with open(path, "rb") as f:
        assert f.read() == b"\x00\x01bytes"
    write_atomic(path, "")
    assert os.path.getsize(path) == 0
    assert os.listdir(tmp_path) == ["f.txt"]


def test_write_json(tmp_path):
    path = str(tmp_path / "s.json")
    write_json_atomic(path, {"a": [1, 2]}, indent=2)
    with open(path) as f:
        text = f.read()
    assert json.loads(text) == {"a": [1, 2]} and "\n" in text
    write_json_atomic(path, {"b": 1})
    with open(path) as f:
        assert json.load(f) == {"b": 1}


def test_mode_follows_umask_like_open(tmp_path):
    old = os.umask(0o022)
    try:
        write_atomic(str(tmp_path / "f"), "x")
        with open(tmp_path / "g", "w") as f:
            f.write("x")
    finally:
        os.umask(old)
    modes = [stat.S_IMODE(os.stat(tmp_path / name).st_mode) for name in ("f", "g")]
    assert modes == [0o644, 0o644]


def test_rejects_non_bytes_and_unserializable(tmp_path):
    with pytest.raises(TypeError, match="must be str or bytes"):
        write_atomic(str(tmp_path / "f"), {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(str(tmp_path / "f"), {"a": object()})
    assert os.listdir(tmp_path) == []


def test_failed_write_keeps_old_content_and_removes_temp(tmp_path, monkeypatch):
    path = str(tmp_path / "f")
    write_atomic(path, "old")

    def boom(fd):
        raise OSError(5, "simulated I/O error")

    monkeypatch.setattr(atomic_file.os, "fsync", boom)
    with pytest.raises(OSError, match="simulated"):
        write_atomic(path, "new")
    monkeypatch.undo()
    with open(path) as f:
        assert f.read() == "old"
    assert os.listdir(tmp_path) == ["f"]


def test_failed_replace_removes_temp(tmp_path):
    # The target is a non-empty directory, so the final rename fails.
    target = tmp_path / "d"
    target.mkdir()
    (target / "x").write_text("x")
    with pytest.raises(OSError):
        write_atomic(str(target), "data")
    assert sorted(os.listdir(tmp_path)) == ["d"]


def test_missing_directory_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no"):
        write_atomic(str(tmp_path / "no" / "f"), "x")


def _writer(path: str, writer: int, start) -> None:
    data = _payload(writer)
    start.wait()
    for _ in range(WRITES_EACH):
        # fsync off: it would only slow the test; atomicity does not depend on it.
        atomic_file.write_atomic(path, data, fsync=False)


@pytest.mark.slow
def test_concurrent_writers_never_torn_or_mixed(tmp_path):
    """Every read, taken while writers race, is exactly one writer's full payload."""
    path = str(tmp_path / "shared.bin")
    valid = {_payload(w) for w in range(N_WRITERS)}
    assert len(valid) == N_WRITERS
    write_atomic(path, _payload(0))

    ctx = mp.get_context("fork")
    start = ctx.Barrier(N_WRITERS + 1)
    procs = [ctx.Process(target=_writer, args=(path, w, start)) for w in range(N_WRITERS)]
    for p in procs:
        p.start()
    start.wait(timeout=30)
    reads, bad = 0, []
    deadline = time.monotonic() + 30
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        with open(path, "rb") as f:
            got = f.read()
        reads += 1
        if got not in valid:
            bad.append((len(got), sorted(set(got))[:8]))
    for p in procs:
        p.join(timeout=30)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not bad, f"{len(bad)} of {reads} reads were torn/mixed/empty, e.g. {bad[:3]}"
    assert all(p.exitcode == 0 for p in procs), f"writer exit codes {[p.exitcode for p in procs]}"
    assert reads > 10, "the reader hardly overlapped the writers; the test proved nothing"
    with open(path, "rb") as f:
        assert f.read() in valid
    assert os.listdir(tmp_path) == ["shared.bin"], "temp files were left behind"
