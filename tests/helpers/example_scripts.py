"""The example scripts (not a package) and the jsonl files they write, for tests."""

from __future__ import annotations

import importlib.util
import json
import pathlib
from types import ModuleType
from typing import List

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_script(relpath: str, name: str) -> ModuleType:
    """The module of the script at ``relpath`` (from the repository root), as ``name``."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def read_jsonl(path) -> List[dict]:
    """The rows of a jsonl file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]
