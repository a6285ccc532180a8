"""Layers import downward only (README, "Layout and layers"):

    base <- api <- impl <- system <- experiments <- scheduler / apps
    inside system:  transport <- worker <- rollout <- dag

`base` imports no other realhf module, and no import cycle exists among the project's
modules (module-level and function-level imports alike). The tests parse every
module's imports statically (no import side effects) and fail naming the offending
file and line, or the modules of the cycle.
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
# Rank of each sub-package of system/, checked the same way among system modules.
SYSTEM_RANK = {"transport": 0, "worker": 1, "rollout": 2, "dag": 3}
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
            if RANK[dst_layer] > RANK[src_layer] or dst_layer in EXTRA_FORBIDDEN.get(src_layer, ()):
                violations.append(f"{path}:{lineno}: {src_layer} imports {mod}")
    assert not violations, "upward imports:\n" + "\n".join(violations)


def _system_part(parts):
    """The system sub-package of a module path (tuple of names below realhf), or None."""
    if len(parts) > 2 and parts[0] == "system" and parts[1] in SYSTEM_RANK:
        return parts[1]
    return None


def test_system_subpackages_import_downward_only():
    violations = []
    for path in sorted((ROOT / "system").rglob("*.py")):
        src = _system_part(path.relative_to(ROOT).parts)
        if src is None:
            continue
        for lineno, mod in _imports(path):
            parts = mod.split(".")
            if parts[0] != "realhf":
                continue
            dst = _system_part(tuple(parts[1:]) + ("",))
            if dst is not None and SYSTEM_RANK[dst] > SYSTEM_RANK[src]:
                violations.append(f"{path}:{lineno}: system/{src} imports {mod}")
    assert not violations, "upward imports inside system/:\n" + "\n".join(violations)


def test_system_modules_all_live_in_a_subpackage():
    # a module dropped straight into system/ would escape the sub-package order
    loose = [p.name for p in (ROOT / "system").glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"put these into one of {sorted(SYSTEM_RANK)}: {loose}"


def _code_metrics():
    tools = ROOT.parent / "tools"
    if str(tools) not in sys.path:
        sys.path.insert(0, str(tools))
    import code_metrics

    return code_metrics


def test_no_import_cycles():
    cm = _code_metrics()
    found = cm.cycles(cm.import_graph())
    assert not found, "import cycles (function-level imports count too):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_no_folder_holds_more_modules_than_a_reader_scans():
    cm = _code_metrics()
    crowded = {d: n for d, n in cm.modules_per_folder().items() if n > cm.MAX_MODULES_PER_FOLDER}
    assert not crowded, (
        f"folders over {cm.MAX_MODULES_PER_FOLDER} modules (split them by concept): {crowded}"
    )


def test_comments_say_why_often_enough():
    cm = _code_metrics()
    assert cm.comments_per_100() >= cm.MIN_COMMENTS_PER_100


def test_cycle_finder_sees_a_function_level_cycle():
    cm = _code_metrics()
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cm.cycles(graph) == [["a", "b", "c"]]
    src = "def f():\n    from realhf.system.x import y\n"
    import ast

    assert cm._imports("realhf/system/z.py", ast.parse(src), {"realhf.system.x"}) == {
        "realhf.system.x"
    }


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


AREAL = ROOT.parent / "areal"


def _imported_modules(path: pathlib.Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and not node.level:
            yield node.lineno, node.module or ""


def test_areal_sits_above_realhf_and_realhf_never_imports_it():
    # areal/ (the light API) may use any realhf layer; nothing in realhf may import areal,
    # and areal imports no realhf entry points (apps, scheduler): it is launched by torchrun.
    up = [
        f"{p}:{n}: {m}"
        for p in sorted(ROOT.rglob("*.py"))
        for n, m in _imported_modules(p)
        if m == "areal" or m.startswith("areal.")
    ]
    assert not up, "realhf imports areal:\n" + "\n".join(up)
    assert sorted(AREAL.rglob("*.py")), "areal/ is missing"
    side = [
        f"{p}:{n}: {m}"
        for p in sorted(AREAL.rglob("*.py"))
        for n, m in _imported_modules(p)
        if _layer_of(m) in ("apps", "scheduler")
    ]
    assert not side, "areal imports realhf's launch layers:\n" + "\n".join(side)
