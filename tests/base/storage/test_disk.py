"""A full disk is recognised whichever writer hits it (a real small file system or limit)."""

import errno
import os

import pytest
import torch
from file_faults import small_filesystem
from safetensors.torch import save_file

from realhf.base.storage.disk import free_bytes, no_space_reason

SIZE = 1 << 20


@pytest.fixture
def small_dir(tmp_path):
    with small_filesystem(tmp_path / "small", SIZE):
        yield tmp_path / "small"


def _raised(fn):
    try:
        fn()
    except Exception as e:
        return e
    raise AssertionError("the write did not fail")


def _write_file(path):
    with open(path, "wb") as f:
        f.write(b"x" * 2 * SIZE)


def _torch_save(path):
    with open(path, "wb") as f:  # through a file object: torch keeps the OSError as context
        torch.save({"x": torch.zeros(SIZE // 2)}, f)


def test_every_writer_reports_a_full_disk_recognisably(small_dir):
    for name, write in (
        ("plain", _write_file),
        ("torch", _torch_save),
        ("safetensors", lambda p: save_file({"x": torch.zeros(SIZE // 2)}, p)),
    ):
        e = _raised(lambda: write(str(small_dir / name)))
        assert no_space_reason(e) in (
            "no space left on device",
            "file too large (a file-size limit, e.g. ulimit -f)",
        ), (name, repr(e))


def test_other_errors_are_not_mistaken_for_a_full_disk(tmp_path):
    assert no_space_reason(FileNotFoundError(errno.ENOENT, "no such file")) is None
    assert no_space_reason(RuntimeError("unexpected pos 576 vs 534")) is None
    assert no_space_reason(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))) == (
        "disk quota exceeded"
    )
    assert free_bytes(str(tmp_path / "not" / "yet")) == free_bytes(str(tmp_path))
