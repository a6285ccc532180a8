"""Layers import downward only (DESIGN.md):

    base <- api <- impl <- system <- experiments <- scheduler / apps

`base` imports no other realhf module. The test parses every module's imports
statically (no import side effects) and fails naming the offending file and line.
"""

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "realhf"

# Rank of each top-level subpackage; a module may import only from ranks <= its own.
RANK = {
    "base": 0,
    "api": 1,
    "impl": 2,
    "system": 3,
    "experiments": 4,
    "scheduler": 5,
    "apps": 5,
}
# scheduler and apps share a rank but must not import each other's internals
# upward; apps may use scheduler (the CLI launches through it), not the reverse.
EXTRA_FORBIDDEN = {"scheduler": {"apps"}}


def _layer_of(module: str):
    parts = module.split(".")
    if parts[0] != "realhf" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in RANK else None


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield node.lineno, mod
            for a in node.names:  # `from realhf import impl`
                if mod == "realhf":
                    yield node.lineno, f"realhf.{a.name}"


def test_layers_import_downward_only():
    violations = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        src_layer = rel.parts[0] if len(rel.parts) > 1 else None
        if src_layer not in RANK:
            continue
        for lineno, mod in _imports(path):
            dst_layer = _layer_of(mod)
            if dst_layer is None:
                continue
            if RANK[dst_layer] > RANK[src_layer] or dst_layer in EXTRA_FORBIDDEN.get(
                src_layer, ()
            ):
                violations.append(f"{path}:{lineno}: {src_layer} imports {mod}")
    assert not violations, "upward imports:\n" + "\n".join(violations)


def test_base_imports_no_realhf():
    bad = []
    for path in sorted((ROOT / "base").rglob("*.py")):
        for lineno, mod in _imports(path):
            if mod.startswith("realhf") and not mod.startswith("realhf.base"):
                bad.append(f"{path}:{lineno}: {mod}")
    assert not bad, "\n".join(bad)


def test_checker_catches_an_upward_import(tmp_path, monkeypatch):
    """The walker itself works: a fake base module importing realhf.system is seen."""
    fake_root = tmp_path / "realhf"
    (fake_root / "base").mkdir(parents=True)
    (fake_root / "base" / "bad.py").write_text("from realhf.system import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake_root)
    try:
        test_layers_import_downward_only()
    except AssertionError as e:
        assert "base imports realhf.system" in str(e)
    else:
        raise AssertionError("upward import was not detected")
