"""The README's "Where things are" map names files that exist, and enough of them to be a map.

A renamed or moved module must take the map along: a reader who follows it to a file that is
not there is worse off than one who reads the tree.
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _map_rows():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Where things are", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]


def test_every_file_the_map_names_exists():
    rows = _map_rows()[1:]  # the header row names no file
    assert len(rows) >= 12, f"the map has only {len(rows)} entries"
    missing = []
    for row in rows:
        _, target = row.strip("|").rsplit("|", 1)
        paths = re.findall(r"`([^`]+)`", target)
        assert paths, f"a map row names no file: {row}"
        missing += [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"the README's map names files that do not exist: {missing}"


def test_the_map_comes_before_the_usage():
    text = (ROOT / "README.md").read_text()
    assert text.index("## Where things are") < text.index("## Usage")
