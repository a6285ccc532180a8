"""``math_equal``: is a predicted math answer equal to the reference answer?

Library decision. LaTeX is parsed and compared symbolically by ``math-verify``
(HuggingFace; it wraps ``latex2sympy2_extended``, the maintained LaTeX→sympy
parser, and already compares sets, intervals, matrices, relations and
assignments correctly). We do not re-implement that on bare sympy. We keep our
own layer around it for what the library does not do, or does differently from
the reward we want:

* extraction (:mod:`math_normalize`): math-verify's own extraction falls back to
  any number in the text, which a policy can exploit;
* dataset normalisation: unit words, ``\\text{}`` units, thousands separators,
  mixed numbers (``2\\frac{1}{2}`` = 5/2), multiple-choice letters;
* numbers compared with a relative tolerance of 1e-4 (math-verify rounds to 6
  decimals, so ``1.5708`` ≠ π/2 there) and percentages: ``50\\%`` = ``0.5`` by
  trying ×100 and ÷100 — only when one side carried a percent sign, so that
  5 ≠ 500 (the original system tried ×100/÷100 on every number);
* integers compared exactly: 100001 ≠ 100000 even though they agree to 1e-5;
* tuples, intervals, sets and matrices split element-wise, so that every element
  gets the leniency above; a bare list ``1, 2`` is unordered like a set.

The order is: exact string → multiple choice → numbers → structure → math-verify
→ numeric value of closed forms. ``math_equal`` may call sympy and can be slow on
adversarial input; reward code calls it through :func:`realhf.impl.reward.math_reward.verify`,
which runs it in a process pool with a timeout.
"""

from __future__ import annotations

import math
import re
import threading
from fractions import Fraction
from typing import Optional, Tuple

from realhf.impl.reward.math_normalize import choice_letter, normalize_answer
from realhf.impl.reward.math_structure import (
    as_vector,
    match_unordered,
    parse_matrix,
    parse_sequence,
    split_top_level,
)

REL_TOL = 1e-4
# No reference answer in a math dataset is this long; longer predictions are
# compared as strings only, so that sympy never sees a wall of LaTeX.
MAX_SYMBOLIC_CHARS = 1000

Number = Fraction

# ----------------------------------------------------------------------- numbers

_PLAIN_NUM = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_SCI_NUM = re.compile(
    r"([-+]?(?:\d+(?:\.\d*)?|\.\d+))(?:[eE]([-+]?\d+)|(?:\\times|\\cdot|\*)10\^\{?([-+]?\d+)\}?)"
)


def _split_frac(s: str) -> Optional[Tuple[str, str, str]]:
    """``\\frac{a}{b}rest`` → (a, b, rest), brace-matched; None if ``s`` is not one."""
    if not s.startswith("\\frac{"):
        return None
    parts = []
    i = len("\\frac")
    for _ in range(2):
        if i >= len(s) or s[i] != "{":
            return None
        depth = 0
        for j in range(i, len(s)):
            depth += {"{": 1, "}": -1}.get(s[j], 0)
            if depth == 0:
                break
        else:
            return None
        parts.append(s[i + 1 : j])
        i = j + 1
    return parts[0], parts[1], s[i:]


def parse_number(s: str) -> Optional[Number]:
    """Exact value of a purely numeric answer, or None.

    Accepts integers, decimals, scientific notation (``1.5e3``, ``1.5\\times10^{3}``),
    ``a/b``, ``\\frac{a}{b}`` with numeric a and b, and mixed numbers
    (``2\\frac{1}{2}`` = 5/2, as in "2½ inches"). ``s`` is a normalised answer.
    """
    s = s.strip()
    if not s or len(s) > 200:
        return None
    try:
        if _PLAIN_NUM.fullmatch(s):
            return Fraction(s)
        m = _SCI_NUM.fullmatch(s)
        if m:
            exp = int(m.group(2) if m.group(2) is not None else m.group(3))
            if abs(exp) > 400:
                return None
            return Fraction(m.group(1)) * Fraction(10) ** exp
        if s.count("/") == 1 and "\\" not in s:
            a, b = s.split("/")
            na, nb = parse_number(a), parse_number(b)
            if na is not None and nb is not None and nb != 0:
                return na / nb
            return None
        sign = 1
        body = s
        if body[:1] in "-+":
            sign = -1 if body[0] == "-" else 1
            body = body[1:]
        whole = Fraction(0)
        m = re.match(r"(\d+)(?=\\frac\{)", body)
        if m:  # mixed number: only with plain digit numerator and denominator
            whole = Fraction(m.group(1))
            body = body[m.end() :]
        split = _split_frac(body)
        if split is None or split[2]:
            return None
        num, den = parse_number(split[0]), parse_number(split[1])
        if num is None or den is None or den == 0:
            return None
        if m and not (split[0].isdigit() and split[1].isdigit()):
            return None
        return sign * (whole + num / den)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def _is_integer_literal(s: str) -> bool:
    return re.fullmatch(r"[-+]?\d+", s.strip()) is not None


def numbers_equal(pred: Number, gold: Number, *, percent: bool, exact: bool) -> bool:
    """``pred`` equals ``gold`` within REL_TOL (exactly when ``exact``), also ×100/÷100 if
    ``percent``."""
    candidates = [gold] + ([gold / 100, gold * 100] if percent else [])
    for c in candidates:
        if pred == c:
            return True
        both_integral = pred.denominator == 1 and c.denominator == 1
        if exact and both_integral:
            continue
        if abs(pred - c) <= Fraction(REL_TOL) * max(abs(pred), abs(c)):
            return True
    return False


# ----------------------------------------------------------------------- symbolic


#: set in the verifier pool's workers (math_reward._warm_worker): the pool's per-item timeout
#: bounds every call there, and math-verify's own alarm stays off
_CALLER_TIMES_OUT = False


def rely_on_caller_timeout() -> None:
    """Turn math-verify's own 5 s alarm off in this process: its caller bounds each call.

    The alarm is wall-clock time, and math-verify answers "not equal" when it fires.  On a
    loaded machine (a CI run's 2 cores shared by a dozen processes) a comparison that
    takes 0.2 s can wait 5 s for the CPU, and a correct answer was graded wrong
    (``2n+1`` against ``1+2n``, once in ~5 full suite runs).  The pool's timeout (15 s by
    default) kills a worker that overruns it and says so in the log."""
    global _CALLER_TIMES_OUT
    _CALLER_TIMES_OUT = True


def _math_verify_timeouts() -> Optional[int]:
    # math-verify times out with SIGALRM, which only the main thread may use; in
    # other threads its timeout is disabled and our pool's timeout is the guard.
    if _CALLER_TIMES_OUT:
        return None
    return 5 if threading.current_thread() is threading.main_thread() else None


def _mv_parse(s: str):
    from math_verify import LatexExtractionConfig, parse

    return parse(
        "$" + s + "$",
        extraction_config=[LatexExtractionConfig()],
        parsing_timeout=_math_verify_timeouts(),
    )


def symbolic_equal(pred: str, gold: str, *, percent: bool) -> bool:
    """math-verify's symbolic comparison, then the numeric value of closed forms within REL_TOL."""
    from math_verify import verify as mv_verify

    gold_parsed, pred_parsed = _mv_parse(gold), _mv_parse(pred)
    if not gold_parsed or not pred_parsed:
        return False
    # allow_set_relation_comp: "x \\ge 3" answers "[3, \\infty)" in either direction
    # (the library allows it only when the prediction is the set).
    if mv_verify(
        gold_parsed,
        pred_parsed,
        allow_set_relation_comp=True,
        timeout_seconds=_math_verify_timeouts(),
    ):
        return True
    a, b = pred_parsed[0], gold_parsed[0]
    try:
        if not (getattr(a, "is_number", False) and getattr(b, "is_number", False)):
            return False
        av, bv = complex(a.evalf(30)), complex(b.evalf(30))
    except (TypeError, ValueError, AttributeError, OverflowError):
        return False
    finite = lambda z: math.isfinite(z.real) and math.isfinite(z.imag)  # noqa: E731
    if not (finite(av) and finite(bv)):
        return False  # inf - inf <= tol * inf would hold; infinities were compared above
    candidates = [bv] + ([bv / 100, bv * 100] if percent else [])
    return any(abs(av - c) <= REL_TOL * max(abs(av), abs(c)) for c in candidates)


# -------------------------------------------------------------------------- entry

_ASSIGNMENT = re.compile(r"^([a-zA-Z](?:_\{?\w+\}?)?|\\[a-zA-Z]+)=(?!=)(.+)$")


def _strip_assignment(s: str) -> str:
    """``x=5`` → ``5`` (a short variable on the left of the only ``=``)."""
    m = _ASSIGNMENT.match(s)
    if m and "=" not in m.group(2) and not m.group(1).startswith(("\\leq", "\\geq")):
        return m.group(2)
    return s


def quick_equal(pred: str, gold: str) -> Optional[bool]:
    """Decide without sympy when possible: True/False, or None if symbolic work is needed.

    ``pred`` and ``gold`` are extracted (not yet normalised) answers.
    """
    gold_letter = choice_letter(gold)
    if gold_letter is not None:
        return choice_letter(pred) == gold_letter
    p, g = normalize_answer(pred), normalize_answer(gold)
    pt, gt = _strip_assignment(p.text), _strip_assignment(g.text)
    if not pt or not gt:
        return False
    if pt == gt or (pt.isalpha() and len(pt) > 1 and pt.lower() == gt.lower()):
        return True
    pn, gn = parse_number(pt), parse_number(gt)
    if pn is not None and gn is not None:
        exact = _is_integer_literal(pt) and _is_integer_literal(gt)
        return numbers_equal(pn, gn, percent=p.percent or g.percent, exact=exact)
    if len(pt) > MAX_SYMBOLIC_CHARS:
        return False
    return None


def _equal(p: str, g: str, percent: bool, depth: int) -> bool:
    """Compare two normalised answers (recursing into elements)."""
    p_full, g_full = p, g
    p, g = _strip_assignment(p), _strip_assignment(g)
    if not p or not g:
        return False
    if p == g:
        return True
    pn, gn = parse_number(p), parse_number(g)
    if pn is not None and gn is not None:
        exact = _is_integer_literal(p) and _is_integer_literal(g)
        return numbers_equal(pn, gn, percent=percent, exact=exact)
    if depth < 4:
        structural = _structural_equal(p, g, percent, depth)
        if structural is not None:
            return structural
    if len(p_full) > MAX_SYMBOLIC_CHARS or len(g_full) > MAX_SYMBOLIC_CHARS:
        return False
    if symbolic_equal(p, g, percent=percent):
        return True
    # "2y=4x+2" against "y=2x+1": stripping the left side of one made them differ.
    if (p, g) != (p_full, g_full):
        return symbolic_equal(p_full, g_full, percent=percent)
    return False


def _structural_equal(p: str, g: str, percent: bool, depth: int) -> Optional[bool]:
    """Element-wise comparison of unions, matrices, sets, tuples and intervals.

    Returns None when the two answers do not both have such a structure (e.g. an
    interval against an inequality): the symbolic stage decides those. When both
    do, the verdict is final: a set is not a tuple, whatever sympy makes of them.
    """
    eq = lambda a, b: _equal(a, b, percent, depth + 1)  # noqa: E731
    if "\\cup" in p or "\\cup" in g:
        ps, gs = split_top_level(p, "\\cup"), split_top_level(g, "\\cup")
        if len(ps) > 1 and len(gs) > 1:
            return match_unordered(ps, gs, eq)
        if len(ps) > 1 or len(gs) > 1:
            return None  # a union against another form ("x \\neq 1"): symbolic
    if "\\begin{" in p or "\\begin{" in g:
        pm, gm = parse_matrix(p), parse_matrix(g)
        if pm is None or gm is None:
            return None
        (p_tuple, pcells), (g_tuple, gcells) = pm, gm
        if p_tuple or g_tuple:  # a tuple matches a row or a column vector
            pv, gv = as_vector(pcells), as_vector(gcells)
            if pv is None or gv is None or len(pv) != len(gv):
                return False
            return all(eq(a, b) for a, b in zip(pv, gv))
        if [len(r) for r in pcells] != [len(r) for r in gcells]:
            return False
        return all(eq(a, b) for ra, rb in zip(pcells, gcells) for a, b in zip(ra, rb))
    ps, gs = parse_sequence(p), parse_sequence(g)
    if ps is None and gs is None:
        return None
    if ps is None or gs is None:
        # a one-element set against a scalar: "\{5\}" = "5"
        one = ps or gs
        other = g if ps else p
        if one[0] == "set" and len(one[2]) == 1 and eq(one[2][0], other):
            return True
        return None
    (pk, pb, pitems), (gk, gb, gitems) = ps, gs
    if len(pitems) != len(gitems):
        return False
    if "set" in (pk, gk) or (pk == "bare" and gk == "bare"):
        if {pk, gk} == {"set", "seq"}:
            return False  # a set is not a tuple
        return match_unordered(pitems, gitems, eq)
    if pk == "seq" and gk == "seq" and pb != gb:
        return False  # (1,2) is not [1,2]
    return all(eq(a, b) for a, b in zip(pitems, gitems))


def math_equal(pred: str, gold: str) -> bool:
    """True if the answer ``pred`` is mathematically equal to the reference ``gold``.

    Both are answers (already extracted, e.g. by ``extract_answer``), not whole
    generations. See the module docstring for the order of checks. May call
    sympy; use ``math_reward.verify`` for untrusted input (it has a timeout).
    """
    if not isinstance(pred, str) or not isinstance(gold, str):
        raise TypeError(
            f"math_equal expects two str answers, got pred={type(pred).__name__}, "
            f"gold={type(gold).__name__}"
        )
    quick = quick_equal(pred, gold)
    if quick is not None:
        return quick
    p, g = normalize_answer(pred), normalize_answer(gold)
    return _equal(p.text, g.text, p.percent or g.percent, depth=0)
