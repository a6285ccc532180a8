"""Code-shape figures of the project: modules per folder, longest functions, comment
density, import cycles, lines over 100 columns (tests/test_layers.py holds the project to
MAX_MODULES_PER_FOLDER and MIN_COMMENTS_PER_100).

    python tools/code_metrics.py [--json]

Counts only the shipped packages (realhf/, areal/, functioncall/, evaluation/, training/).
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import tokenize
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("realhf", "areal", "functioncall", "evaluation", "training")


def _py_files():
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in sorted(files):
                if f.endswith(".py"):
                    yield os.path.relpath(os.path.join(dirpath, f), ROOT)


def _comment_lines(src: str) -> int:
    """Lines holding a `#` comment (docstrings are not comments)."""
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            lines.add(tok.start[0])
    return len(lines)


def _module_name(path: str) -> str:
    mod = path[:-3].replace(os.sep, ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def _imports(path: str, tree: ast.AST, modules: set) -> set:
    """Project modules imported by `path` (module level and inside functions alike)."""
    me = _module_name(path)
    pkg = me if path.endswith("__init__.py") else me.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for n in names:
            # the longest project module that prefixes the name
            while n and n not in modules:
                n = n.rpartition(".")[0]
            if n and n != me:
                out.add(n)
    return out


def import_graph() -> dict:
    """{module: set of project modules it imports}."""
    trees = {p: ast.parse(open(os.path.join(ROOT, p)).read()) for p in _py_files()}
    modules = {_module_name(p) for p in trees}
    return {_module_name(p): _imports(p, t, modules) for p, t in trees.items()}


def cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


#: most modules (``__init__.py`` included) one folder of the packages may hold
MAX_MODULES_PER_FOLDER = 12
#: least comment lines per 100 non-blank lines (comments say why where it is not obvious)
MIN_COMMENTS_PER_100 = 4.0


def modules_per_folder() -> dict:
    return dict(sorted(Counter(os.path.dirname(p) for p in _py_files()).items()))


def comments_per_100() -> float:
    code = comments = 0
    for path in _py_files():
        src = open(os.path.join(ROOT, path)).read()
        code += sum(1 for line in src.splitlines() if line.strip())
        comments += _comment_lines(src)
    return round(100 * comments / code, 2)


def metrics() -> dict:
    funcs, classes = [], []
    code = long_lines = 0
    for path in _py_files():
        src = open(os.path.join(ROOT, path)).read()
        code += sum(1 for line in src.splitlines() if line.strip())
        long_lines += sum(1 for line in src.splitlines() if len(line) > 100)
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                span = node.end_lineno - node.lineno + 1
                kind = classes if isinstance(node, ast.ClassDef) else funcs
                kind.append((span, f"{path}:{node.lineno} {node.name}"))
    funcs.sort(reverse=True)
    classes.sort(reverse=True)
    lengths = sorted(n for n, _ in funcs)
    return {
        "modules_per_folder": modules_per_folder(),
        "non_blank_lines": code,
        "comment_lines_per_100": comments_per_100(),
        "lines_over_100_cols": long_lines,
        "functions": len(funcs),
        "function_lines_median": lengths[len(lengths) // 2],
        "function_lines_p90": lengths[int(len(lengths) * 0.9)],
        "longest_functions": [f"{n} {where}" for n, where in funcs[:10]],
        "longest_classes": [f"{n} {where}" for n, where in classes[:10]],
        "import_cycles": cycles(import_graph()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="one JSON object instead of text")
    args = ap.parse_args()
    m = metrics()
    if args.json:
        print(json.dumps(m))
        return
    for k, v in m.items():
        if isinstance(v, dict):
            print(f"{k}:")
            for kk, vv in v.items():
                print(f"  {kk}: {vv}")
        elif isinstance(v, list):
            print(f"{k}: {len(v)}")
            for item in v:
                print(f"  {item}")
        else:
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
