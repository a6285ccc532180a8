"""File manifests: a directory matches the manifest written over it until a file changes."""

import os

from realhf.base.storage import manifest


def _tree(root, big=3 * manifest.SPAN):
    os.makedirs(root / "sub")
    (root / "a.json").write_text('{"x": 1}')
    (root / "sub" / "big.bin").write_bytes(os.urandom(big))
    return root


def test_an_untouched_directory_matches(tmp_path):
    root = _tree(tmp_path / "d")
    files = manifest.write_manifest(str(root))
    assert sorted(files) == ["a.json", "sub/big.bin"]
    assert files["sub/big.bin"]["size"] == 3 * manifest.SPAN
    assert manifest.check_manifest(str(root)) == []


def test_each_kind_of_damage_is_named(tmp_path):
    root = _tree(tmp_path / "d")
    manifest.write_manifest(str(root))
    os.truncate(root / "sub" / "big.bin", 100)
    (root / "a.json").write_text('{"x": 2}')  # same size, other content
    assert manifest.check_manifest(str(root)) == [
        "a.json does not match its checksum (its content changed)",
        f"sub/big.bin has 100 bytes, {3 * manifest.SPAN} were written (cut short or overwritten)",
    ]
    os.remove(root / "a.json")
    assert manifest.check_manifest(str(root))[0] == "a.json is missing"


def test_a_large_file_is_checked_at_both_ends(tmp_path):
    root = _tree(tmp_path / "d")
    manifest.write_manifest(str(root))
    path = root / "sub" / "big.bin"
    with open(path, "r+b") as f:  # the middle is not read: the size and both ends are
        f.seek(manifest.SPAN + 10)
        f.write(b"\0" * 10)
    assert manifest.check_manifest(str(root)) == []
    with open(path, "r+b") as f:
        f.seek(3 * manifest.SPAN - 5)
        f.write(b"\1" * 5)
    assert manifest.check_manifest(str(root)) == [
        "sub/big.bin does not match its checksum (its content changed)"
    ]


def test_a_damaged_manifest_is_a_problem_itself(tmp_path):
    root = _tree(tmp_path / "d", big=10)
    assert manifest.check_manifest(str(root)) == [f"{root}/manifest.json does not exist"]
    (root / "manifest.json").write_text("{garbage")
    assert "is not readable JSON" in manifest.check_manifest(str(root))[0]
