"""math_equal and its pieces, in-process (no pool)."""

from fractions import Fraction

import pytest

from realhf.impl.reward.math_grader import (
    math_equal,
    numbers_equal,
    parse_number,
    parse_sequence,
    quick_equal,
    split_top_level,
)


@pytest.mark.parametrize(
    "s, value",
    [
        ("42", Fraction(42)),
        ("-0.5", Fraction(-1, 2)),
        ("1.5e3", Fraction(1500)),
        (r"1.5\times10^{3}", Fraction(1500)),
        ("3/4", Fraction(3, 4)),
        (r"\frac{3}{4}", Fraction(3, 4)),
        (r"-\frac{1}{2}", Fraction(-1, 2)),
        (r"\frac{-1}{2}", Fraction(-1, 2)),
        (r"2\frac{1}{2}", Fraction(5, 2)),
        (r"\frac{0.5}{2}", Fraction(1, 4)),
        (r"\sqrt{2}", None),
        ("x", None),
        (r"\frac{1}{0}", None),
        ("1e99999", None),
        ("1" * 5000, None),  # longer than any answer: not parsed
    ],
)
def test_parse_number(s, value):
    assert parse_number(s) == value


def test_numbers_equal_tolerance_and_percent():
    assert numbers_equal(Fraction("0.33333"), Fraction(1, 3), percent=False, exact=False)
    assert not numbers_equal(Fraction("0.333"), Fraction(1, 3), percent=False, exact=False)
    # integers are exact: 100001 agrees with 100000 to 1e-5 but is a different answer
    assert not numbers_equal(Fraction(100001), Fraction(100000), percent=False, exact=True)
    assert numbers_equal(Fraction(50), Fraction(1, 2), percent=True, exact=False)
    assert not numbers_equal(Fraction(50), Fraction(1, 2), percent=False, exact=False)


def test_split_top_level_respects_nesting():
    assert split_top_level(r"\frac{1,2}{3},(4,5),\{6,7\},8") == [
        r"\frac{1,2}{3}",
        "(4,5)",
        r"\{6,7\}",
        "8",
    ]


@pytest.mark.parametrize(
    "s, kind",
    [
        (r"\{1,2\}", "set"),
        ("(1,2]", "seq"),
        ("[1,2,3]", "seq"),
        ("1,2", "bare"),
        ("(1)+(2)", None),
        ("5", None),
        ("(5)", None),
    ],
)
def test_parse_sequence_kind(s, kind):
    got = parse_sequence(s)
    assert (got[0] if got else None) == kind


def test_quick_equal_decides_without_sympy():
    assert quick_equal("0.5", r"\frac12") is True
    assert quick_equal("(B)", "B") is True
    assert quick_equal("12", "B") is False
    assert quick_equal("41", "42") is False
    assert quick_equal(r"\sqrt{2}", "1.4142") is None  # needs the symbolic stage


@pytest.mark.parametrize(
    "pred, gold, expected",
    [
        (r"3\sqrt{2}", r"\sqrt{18}", True),
        (r"\frac{\pi}{2}", "1.5708", True),
        (r"\pi", "3.14", False),
        (r"(-\infty,-1)\cup(1,\infty)", r"(1,\infty)\cup(-\infty,-1)", True),
        (r"(-\infty,-1)\cup(1,\infty)", r"(-\infty,-1)\cup(2,\infty)", False),
        (r"(-3,3)", r"(-3,\infty)", False),
        (r"-\infty", r"\infty", False),
        (r"\{1,2\}", "(1,2)", False),  # a set is not a tuple
        (r"\{2,1\}", "1,2", True),
        ("(2,1)", "(1,2)", False),
        (r"\begin{pmatrix}1\\2\end{pmatrix}", "(1,2)", True),
        (r"\begin{pmatrix}1&3\\2&4\end{pmatrix}", r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", False),
        ("2y=4x+2", "y=2x+1", True),
        ("y=2x", r"y=\frac{x}{2}", False),
        ("x=5", "5", True),
        (r"x \ge 3", r"[3,\infty)", True),
        ("x^2+2x+1", "(x+1)^2", True),
        (r"2\frac{1}{2}", "1", False),  # a mixed number, not 2·½
        (r"\$12.50", "12.5", True),
    ],
)
def test_math_equal(pred, gold, expected):
    assert math_equal(pred, gold) is expected


def test_math_equal_is_type_checked():
    with pytest.raises(TypeError, match="two str answers"):
        math_equal(5, "5")


def test_overlong_prediction_is_not_sent_to_sympy():
    long_expr = "+".join(["x"] * 600)
    assert quick_equal(long_expr, "600x") is False
