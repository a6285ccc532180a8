"""Structure of compound math answers: top-level splitting, sets, tuples,
intervals and matrices (pure string work, used by :mod:`math_grader`)."""

from __future__ import annotations

import re
from typing import Callable, List, Optional, Tuple


def split_top_level(s: str, sep: str = ",") -> List[str]:
    """Split ``s`` at ``sep`` where it is not nested inside brackets or braces."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        if s.startswith("\\{", i) or s.startswith("\\}", i):
            depth += 1 if s[i + 1] == "{" else -1
            i += 2
            continue
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and s.startswith(sep, i):
            parts.append(s[start:i])
            start = i + len(sep)
            i = start
            continue
        i += 1
    parts.append(s[start:])
    return parts


def _enclosed(s: str) -> bool:
    """True if the bracket opening ``s`` closes at its very end (``(1,2)`` yes, ``(1)+(2)`` no)."""
    depth = 0
    i = 0
    while i < len(s):
        if s.startswith("\\{", i) or s.startswith("\\}", i):
            depth += 1 if s[i + 1] == "{" else -1
            i += 2
        else:
            depth += 1 if s[i] in "([{" else -1 if s[i] in ")]}" else 0
            i += 1
        if depth == 0 and i < len(s):
            return False
    return depth == 0


def _enclosed_mixed(s: str) -> bool:
    """Like :func:`_enclosed` but treats ( and [ alike, for intervals such as ``(1,2]``."""
    t = s.replace("\\{", "{").replace("\\}", "}")
    t = re.sub(r"[\[]", "(", re.sub(r"[\]]", ")", t))
    return _enclosed(t)


def parse_sequence(s: str) -> Optional[Tuple[str, str, List[str]]]:
    """Split a set / tuple / interval / bare list into (kind, brackets, items).

    kind is ``"set"`` (``\\{...\\}``), ``"seq"`` (``(..)``, ``[..]``, ``(..]``...),
    or ``"bare"`` (``1,2`` with no brackets). Returns None for a scalar.
    """
    if s.startswith("\\{") and s.endswith("\\}") and _enclosed(s):
        return "set", "{}", split_top_level(s[2:-2])
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _enclosed_mixed(s):
        items = split_top_level(s[1:-1])
        if len(items) >= 2:
            return "seq", s[0] + s[-1], items
        return None  # "(x)" is a parenthesised scalar, not a 1-tuple
    items = split_top_level(s)
    if len(items) >= 2:
        return "bare", "", items
    return None


_MATRIX = re.compile(r"^\\begin\{([pbvBV]?matrix|array)\}(?:\{[^}]*\})?(.*)\\end\{\1\}$", re.DOTALL)


def parse_matrix(s: str) -> Optional[Tuple[bool, List[List[str]]]]:
    """(is_vector_tuple, cells) of a ``pmatrix``/``bmatrix``/... or of a tuple (a vector).

    None when ``s`` is neither.
    """
    m = _MATRIX.match(s)
    if m:
        rows = [r for r in re.split(r"\\\\", m.group(2)) if r.strip()]
        return False, [[c.strip() for c in r.split("&")] for r in rows]
    seq = parse_sequence(s)
    if seq is not None and seq[0] != "set":
        return True, [[item] for item in seq[2]]
    return None


def as_vector(cells: List[List[str]]) -> Optional[List[str]]:
    """The entries of a one-row or one-column matrix, else None."""
    if len(cells) == 1:
        return cells[0]
    if all(len(r) == 1 for r in cells):
        return [r[0] for r in cells]
    return None


def match_unordered(preds: List[str], golds: List[str], eq: Callable[[str, str], bool]) -> bool:
    """A perfect matching between the two lists under ``eq`` (small lists: DFS)."""
    if len(preds) != len(golds):
        return False
    # Backtracking, not greedy: one prediction may equal several golds (0.5 and 1/2), and
    # a greedy pairing could take the gold another prediction needs.
    used = [False] * len(golds)
    cache = {}

    def same(i, j):
        if (i, j) not in cache:
            cache[(i, j)] = eq(preds[i], golds[j])
        return cache[(i, j)]

    def assign(i):
        if i == len(preds):
            return True
        for j in range(len(golds)):
            if not used[j] and same(i, j):
                used[j] = True
                if assign(i + 1):
                    return True
                used[j] = False
        return False

    return assign(0)
