"""setup.py declares what the code imports, and imports what it declares."""

import ast
import importlib.metadata
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("realhf", "functioncall", "evaluation", "training")
#: imports of a submodule that need a distribution of another name
SUBMODULE_DISTS = {"torch.utils.tensorboard": "tensorboard"}
#: not pip-installable here (GPU-only), imported behind availability checks
OPTIONAL = {"sglang", "vllm", "flash_attn"}


def _setup_lists():
    """install_requires and extras_require of setup.py, read without running it."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            kw = {k.arg: k.value for k in node.keywords}
            return ast.literal_eval(kw["install_requires"]), ast.literal_eval(kw["extras_require"])
    raise AssertionError("no setup(...) call in setup.py")


def _dist_name(req: str) -> str:
    for sep in "<>=!~[; ":
        req = req.split(sep)[0]
    return req.strip().lower().replace("_", "-")


def _imported_top_modules() -> set:
    """Top-level module names imported anywhere in the shipped packages (any depth)."""
    found = set()
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                tree = ast.parse(open(os.path.join(dirpath, f)).read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        names = [a.name for a in node.names]
                    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                        names = [node.module]
                    else:
                        continue
                    for name in names:
                        found.add(name.split(".")[0])
                        found.update(
                            SUBMODULE_DISTS[s] for s in SUBMODULE_DISTS if name.startswith(s)
                        )
    return found


def _third_party(modules: set) -> dict:
    """{distribution name: module} for the imported modules that are not stdlib or ours."""
    dists = importlib.metadata.packages_distributions()
    out = {}
    for m in modules:
        if m in sys.stdlib_module_names or m in PACKAGES or m.startswith("_"):
            continue
        for d in dists.get(m, [m]):
            out[d.lower().replace("_", "-")] = m
    return out


def test_every_runtime_dependency_is_imported():
    install, _ = _setup_lists()
    imported = _third_party(_imported_top_modules())
    unused = sorted(_dist_name(r) for r in install if _dist_name(r) not in imported)
    assert not unused, f"declared in install_requires but never imported: {unused}"


def test_every_imported_package_is_declared():
    install, extras = _setup_lists()
    declared = {_dist_name(r) for r in install} | {
        _dist_name(r) for rs in extras.values() for r in rs
    }
    imported = _third_party(_imported_top_modules())
    missing = sorted(
        f"{d} (module {m})" for d, m in imported.items() if d not in declared and m not in OPTIONAL
    )
    assert not missing, f"imported but not declared in setup.py: {missing}"


def test_test_only_packages_are_not_runtime_requirements():
    install, extras = _setup_lists()
    runtime = {_dist_name(r) for r in install}
    assert "requests" not in runtime and "requests" in {_dist_name(r) for r in extras["test"]}


@pytest.mark.parametrize("pkg", PACKAGES)
def test_shipped_packages_are_real_packages(pkg):
    # find_packages only picks up folders with an __init__.py; a missing one drops the
    # folder from an installed wheel without any error
    assert os.path.isfile(os.path.join(ROOT, pkg, "__init__.py"))
