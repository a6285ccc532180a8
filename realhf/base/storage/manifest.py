"""File manifests: what a directory held when it was written, to check it before use.

    write_manifest(d)          # d/manifest.json: size and CRC-32 of every file under d
    check_manifest(d)          # [] when d still matches it, else one line per problem

A manifest catches what goes wrong with a directory of files between writing and reading:
a file cut short by a crash or a full disk (size), a file missing, and content overwritten
by garbage (CRC-32).  Files up to ``2 * SPAN`` bytes are checksummed whole; larger ones
(weights, optimizer states) over their first and last ``SPAN`` bytes, where the headers of
safetensors and the zip directory of ``torch.save`` live: a full checksum would read every
byte of a multi-GB checkpoint again at every commit and every resume, while truncation, the
usual damage, is caught by the size alone.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Dict, List

from realhf.base.storage.atomic_file import write_json_atomic

__all__ = ["MANIFEST", "SPAN", "write_manifest", "check_manifest", "ManifestError"]

MANIFEST = "manifest.json"
#: bytes checksummed at each end of a large file
SPAN = 1 << 20
_FORMAT = 1


class ManifestError(ValueError):
    """A manifest that cannot be read (missing, not JSON, unknown format)."""


def _crc32(path: str, size: int) -> str:
    crc = 0
    with open(path, "rb") as f:
        if size <= 2 * SPAN:
            while chunk := f.read(SPAN):
                crc = zlib.crc32(chunk, crc)
        else:
            crc = zlib.crc32(f.read(SPAN), crc)
            f.seek(size - SPAN)
            crc = zlib.crc32(f.read(SPAN), crc)
    return f"{crc:08x}"


def _files(root: str) -> List[str]:
    out = []
    for d, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), root)
            if rel != MANIFEST:
                out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def write_manifest(root: str) -> Dict[str, dict]:
    """Write ``root/manifest.json`` listing every file under ``root``; returns the entries."""
    files = {}
    for rel in _files(root):
        path = os.path.join(root, rel)
        size = os.path.getsize(path)
        files[rel] = {"size": size, "crc32": _crc32(path, size)}
    write_json_atomic(os.path.join(root, MANIFEST), {"format": _FORMAT, "files": files}, indent=1)
    return files


def read_manifest(root: str) -> Dict[str, dict]:
    """The entries of ``root/manifest.json``; ManifestError when it is unreadable."""
    path = os.path.join(root, MANIFEST)
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ManifestError(f"{path} does not exist") from None
    except (OSError, ValueError) as e:
        raise ManifestError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise ManifestError(f"{path} has an unknown format")
    files = data.get("files")
    if not isinstance(files, dict):
        raise ManifestError(f"{path} lists no files")
    return files


def check_manifest(root: str, max_problems: int = 5) -> List[str]:
    """What differs between ``root`` and its manifest, one line each ([] when nothing).

    Reports at most ``max_problems`` files; a damaged manifest is itself a problem.
    """
    try:
        files = read_manifest(root)
    except ManifestError as e:
        return [str(e)]
    problems = []
    for rel, want in files.items():
        path = os.path.join(root, rel)
        try:
            size = os.path.getsize(path)
        except OSError:
            problems.append(f"{rel} is missing")
        else:
            if size != want.get("size"):
                problems.append(
                    f"{rel} has {size} bytes, {want.get('size')} were written "
                    "(cut short or overwritten)"
                )
            elif _crc32(path, size) != want.get("crc32"):
                problems.append(f"{rel} does not match its checksum (its content changed)")
        if len(problems) >= max_problems:
            problems.append("(further files not checked)")
            break
    return problems
