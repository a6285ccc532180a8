"""Answer extraction and normalisation (pure string functions)."""

import pytest

from realhf.impl.reward.math_normalize import (
    choice_letter,
    extract_answer,
    extract_solution_answer,
    last_boxed,
    normalize_answer,
)


@pytest.mark.parametrize(
    "text, answer",
    [
        (r"so $\boxed{42}$.", "42"),
        (r"first \boxed{1}, then \boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),
        (r"\fbox{7}", "7"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"The answer is \boxed 5", "5"),
        (r"\boxed{\boxed{5}}", "5"),  # the innermost box is the last one
        ("The final answer is $\\frac{3}{8}$. I hope it is correct.", r"\frac{3}{8}"),
        ("So the answer is 3.5.", "3.5"),
        ("Thus the answer is (B).", "(B)"),
        ("the answer is 3 and the final answer is 4", "4"),
        ("所以答案是 7", "7"),
        ("Answer: 17", "17"),
        ("The answer is: $\\boxed{12}$", "12"),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    "text",
    [
        "After simplifying we obtain 12 as the total.",  # no last-number fallback
        r"The result is \boxed{\frac{1}{2",  # truncated box: not graded
        "",
    ],
)
def test_extract_answer_none(text):
    assert extract_answer(text) is None


def test_extract_answer_rejects_non_str():
    with pytest.raises(TypeError, match="generated text as str"):
        extract_answer(None)


def test_last_boxed_ignores_escaped_braces():
    assert last_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"


def test_solution_answer_prose_falls_back_to_last_number():
    assert extract_solution_answer("There are 4 red balls in the bag, so x is 4.") == "4"
    assert extract_solution_answer(r"\frac{1}{2}") == r"\frac{1}{2}"
    assert extract_solution_answer(r"\boxed{7}") == "7"
    assert extract_solution_answer(r"\text{Monday}") == r"\text{Monday}"


@pytest.mark.parametrize(
    "raw, text, percent",
    [
        (r"\left( 1, 2 \right)", "(1,2)", False),
        (r"\dfrac{1}{2}", r"\frac{1}{2}", False),
        (r"\frac12", r"\frac{1}{2}", False),
        (r"\sqrt2", r"\sqrt{2}", False),
        (r"50\%", "50", True),
        ("40 percent", "40", True),
        (r"30^\circ", "30", False),
        (r"45^{\circ}", "45", False),
        (r"5\text{ cm}^2", "5", False),
        ("12 dollars", "12", False),
        (r"\$12.50", "12.50", False),
        ("1,000,000", "1000000", False),
        (r"1{,}000", "1000", False),
        (".5", "0.5", False),
        ("(-.5,.5)", "(-0.5,0.5)", False),
        ("7.", "7", False),
        (r"2 \text{ and } 3", "2,3", False),
        (r"\text{Monday}", "Monday", False),
        (r"2\pi r", r"2\pi r", False),
        (r"x \le 3", r"x\leq3", False),
        (r"\varnothing", r"\emptyset", False),
        ("$5$", "5", False),
        ("5m", "5m", False),  # no space: may be 5·m, kept
    ],
)
def test_normalize_answer(raw, text, percent):
    n = normalize_answer(raw)
    assert (n.text, n.percent) == (text, percent)


@pytest.mark.parametrize(
    "answer, letter",
    [
        ("A", "A"),
        ("(B)", "B"),
        ("C)", "C"),
        (r"\text{(D)}", "D"),
        (r"\textbf{(E) } 7", "E"),
        ("B) 12", "B"),
        ("A. 5", "A"),
        ("a", None),
        ("12", None),
        ("AB", None),
        ("x", None),
    ],
)
def test_choice_letter(answer, letter):
    assert choice_letter(answer) == letter
