"""Answer extraction and normalisation for the math verifier.

Everything here is cheap, pure string work (no sympy), so the caller can run it
in-process before deciding whether an answer needs the heavy, pooled checks of
:mod:`realhf.impl.reward.math_grader`.

Two entry points:

* :func:`extract_answer` finds the final answer in a model generation: the last
  brace-balanced ``\\boxed{...}`` / ``\\fbox{...}``, else the text after the last
  "final answer is" / "the answer is" / "答案是". There is deliberately no
  "last number in the text" fallback for generations: rewarding whatever number
  came last would teach a policy to spray numbers.
* :func:`normalize_answer` rewrites an answer into a canonical string
  (spaces, ``\\left``/``\\right``, ``\\dfrac``, units, degrees, percent, ...) and
  records whether a percent sign was removed.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

_BOX_COMMANDS = ("\\boxed", "\\fbox")

# "final answer is" must be tried before "the answer is": a text that contains
# both should report the span after the more specific phrase.
_ANSWER_PHRASES = re.compile(
    r"(?:final answer is|the answer is|answer:|答案是|答案为)", re.IGNORECASE
)


def _match_brace(text: str, open_idx: int) -> Optional[int]:
    """Index of the ``}`` that closes the ``{`` at ``open_idx``, or None."""
    depth = 0
    i = open_idx
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            i += 2  # an escaped brace (\{ or \}) does not nest
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` or ``\\fbox{...}`` in ``text``.

    Returns None when there is none, or when the last one is not closed (a
    truncated generation: we refuse to grade a half-written answer rather than
    fall back to an earlier, possibly intermediate, box).
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    i = start + len(cmd)
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "{":
        end = _match_brace(text, i)
        return None if end is None else text[i + 1 : end].strip()
    # "\boxed 5" (no braces): the argument is the next token.
    m = re.match(r"\s*([^\s$]+)", text[i:])
    return m.group(1) if m and i > start + len(cmd) else None


def _cut_phrase_answer(rest: str) -> Optional[str]:
    """The answer span right after an "answer is" phrase."""
    rest = rest.lstrip(" :：\t")
    for open_d, close_d in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if rest.startswith(open_d):
            end = rest.find(close_d, len(open_d))
            if end > 0:
                return rest[len(open_d) : end].strip()
    rest = rest.split("\n", 1)[0]
    # A sentence ends at a period followed by a space or the end; a period between
    # digits ("3.5") does not end it.
    m = re.search(r"\.(?=\s|$)|。", rest)
    if m:
        rest = rest[: m.start()]
    rest = rest.strip().rstrip(".").strip()
    return rest or None


def extract_answer(text: str) -> Optional[str]:
    """The final answer of a generation, or None if it states none.

    Order: the last brace-balanced ``\\boxed{}``/``\\fbox{}``; else the span after
    the last "final answer is" / "the answer is" / "答案是" (inside ``$...$`` if
    it starts with a math delimiter, else up to the end of the sentence).
    """
    if not isinstance(text, str):
        raise TypeError(
            f"extract_answer expects the generated text as str, got {type(text).__name__}"
        )
    if any(cmd in text for cmd in _BOX_COMMANDS):
        return last_boxed(text)
    matches = list(_ANSWER_PHRASES.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    ans = _cut_phrase_answer(text[last.end() :])
    if ans is not None and any(cmd in ans for cmd in _BOX_COMMANDS):
        ans = last_boxed(ans)
    return ans


_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def extract_solution_answer(solution: str) -> Optional[str]:
    """The reference answer of a dataset solution.

    Solutions get one fallback that generations do not: when the solution is
    prose without a box or an answer phrase, its last number is taken. A short
    solution (a bare answer such as ``42`` or ``\\frac{1}{2}``) is used whole.
    """
    ans = extract_answer(solution)
    if ans is not None:
        return ans
    words = re.findall(r"(?<![\\a-zA-Z])[a-zA-Z]{3,}", re.sub(r"\\text\{[^}]*\}", "", solution))
    if len(words) < 3:
        stripped = solution.strip()
        return stripped or None
    numbers = _NUMBER_RE.findall(solution)
    return numbers[-1] if numbers else None


# --------------------------------------------------------------------------- normalise

# Words that name a unit when they follow a number ("5 cm", "12 dollars"). Only
# removed after a number and a space, or from inside \text{}: "5m" stays as it
# is, because it may equally be 5·m.
_UNIT_WORDS = (
    "units?|square|sq|cubic|cu|"
    "mm|cm|km|m|meters?|metres?|centimeters?|centimetres?|millimeters?|kilometers?|"
    "inch|inches|in|feet|foot|ft|yards?|yd|miles?|mi|"
    "mph|kph|km/h|m/s|ft/s|"
    "g|kg|mg|grams?|kilograms?|pounds?|lbs?|lb|ounces?|oz|tons?|"
    "l|ml|liters?|litres?|milliliters?|gallons?|gal|quarts?|pints?|cups?|"
    "s|sec|secs|seconds?|minutes?|mins?|min|hours?|hrs?|hr|h|days?|weeks?|months?|years?|"
    "dollars?|cents?|euros?|yuan|"
    "degrees?|deg|radians?|rad|"
    "people|persons?|students?|ways|times|items|pieces|points?|marbles|balls|"
    "apples|books|cookies|pages|boxes"
)
_UNIT_TAIL = re.compile(
    r"(?<=[\d}).])\s+(?:(?:" + _UNIT_WORDS + r")(?:\^\{?\d\}?)?\s*)+$", re.IGNORECASE
)
_TEXT_UNIT_TAIL = re.compile(
    r"(?<=\S)\s*\\(?:text|mbox|mathrm|textrm)\{\s*(?:" + _UNIT_WORDS + r")"
    r"(?:\s+(?:" + _UNIT_WORDS + r"))*\s*\}(?:\^\{?\d\}?)?\s*$",
    re.IGNORECASE,
)
_TEXT_WRAPPERS = re.compile(
    r"\\(?:text|textbf|textit|mbox|mathrm|mathbf|mathit|boldsymbol|bf|rm|mathsf)\s*\{"
)
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


@dataclasses.dataclass(frozen=True)
class NormalizedAnswer:
    """A canonical answer string and whether a percent sign was stripped from it."""

    text: str
    percent: bool


def _unwrap_command(s: str, pattern: re.Pattern) -> str:
    """Replace ``\\cmd{X}`` by ``X`` for every command matched by ``pattern``."""
    while True:
        m = pattern.search(s)
        if not m:
            return s
        open_idx = m.end() - 1
        end = _match_brace(s, open_idx)
        if end is None:
            return s[: m.start()] + s[open_idx + 1 :]
        s = s[: m.start()] + s[open_idx + 1 : end] + s[end + 1 :]


def _fix_frac_and_sqrt(s: str) -> str:
    """``\\frac12`` → ``\\frac{1}{2}``, ``\\frac1{x}`` → ``\\frac{1}{x}``,
    ``\\sqrt2`` → ``\\sqrt{2}``."""
    s = re.sub(r"\\sqrt\s*([0-9a-zA-Z])", r"\\sqrt{\1}", s)
    s = re.sub(r"\\frac\s*([0-9a-zA-Z])\s*([0-9a-zA-Z])", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\s*([0-9a-zA-Z])\s*\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\s*(\{[^{}]*\})\s*([0-9a-zA-Z])", r"\\frac\1{\2}", s)
    return s


def _remove_spaces(s: str) -> str:
    """Drop whitespace, except one space between a command and a letter (``\\pi r``)."""

    def repl(m: re.Match) -> str:
        before = s[max(0, m.start() - 32) : m.start()]
        after = s[m.end() : m.end() + 1]
        if after.isalpha() and re.search(r"\\[a-zA-Z]+$", before):
            return " "
        return ""

    return re.sub(r"\s+", repl, s)


def normalize_answer(answer: str) -> NormalizedAnswer:
    """Canonical form of an answer string (see the module docstring).

    The rewrites are the ones real math datasets need: math delimiters, spacing
    commands, ``\\left``/``\\right``, ``\\dfrac``/``\\tfrac``, degree signs, percent
    (recorded in ``percent``), dollar signs, trailing unit words and ``\\text{}``
    units, text wrappers, "and"/"or" lists, thousands separators, ``.5`` → ``0.5``
    and a trailing period.
    """
    s = str(answer).strip()
    s = s.replace("\n", " ").replace("\t", " ").replace("\r", " ")
    s = s.replace("\\$", "")  # a dollar sign, before "$" delimiters go
    for delim in ("$$", "$", "\\(", "\\)", "\\[", "\\]"):
        s = s.replace(delim, " " if delim != "$" else "")
    s = re.sub(r"\\(?:displaystyle|textstyle|quad|qquad)(?![a-zA-Z])|\\[!,;:]", " ", s)
    s = s.replace("~", " ").replace("{,}", ",")
    s = re.sub(r"\\left\s*\.|\\right\s*\.", "", s)
    s = re.sub(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big)(?![a-zA-Z])", "", s)
    s = re.sub(r"\\[dtc]frac(?![a-zA-Z])", r"\\frac", s)
    # Degrees: "90^\circ", "90^{\circ}", "90°", "90\degree".
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree(?![a-zA-Z])", "", s)
    percent = bool(re.search(r"\\?%|\\text\{\s*percent\s*\}|\bpercent\b", s))
    s = re.sub(r"\\?%|\\text\{\s*percent\s*\}|\bpercent\b", "", s)
    s = _TEXT_UNIT_TAIL.sub("", s.strip())
    s = _unwrap_command(s, _TEXT_WRAPPERS)
    s = _UNIT_TAIL.sub("", s.strip())
    s = re.sub(r"\s+(?:and|or)\s+", ",", s)
    s = re.sub(r"\\(?:le|leqslant)(?![a-zA-Z])", r"\\leq", s)
    s = re.sub(r"\\(?:ge|geqslant)(?![a-zA-Z])", r"\\geq", s)
    s = re.sub(r"\\(?:ne)(?![a-zA-Z])", r"\\neq", s)
    s = re.sub(r"\binfinity\b|\binf\b", r"\\infty", s)
    s = re.sub(r"\\varnothing(?![a-zA-Z])|\\\{\s*\\\}", r"\\emptyset", s)
    s = _fix_frac_and_sqrt(s)
    s = _remove_spaces(s)
    s = s.rstrip("\\").strip()
    while s.endswith(".") and not s.endswith(".."):
        s = s[:-1]
    if s.startswith("+") and not s.startswith("+-"):
        s = s[1:]
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    # ".5" → "0.5" (also after a sign or an opening bracket: "(-.5,.5)").
    s = re.sub(r"(^|[^\d])\.(\d)", r"\g<1>0.\2", s)
    return NormalizedAnswer(text=s, percent=percent)


def choice_letter(answer: str) -> Optional[str]:
    """The multiple-choice letter an answer names (``A``, ``(B)``, ``C)``, ``\\text{(D)}``), or
    None.

    Only capital letters A–J count: a lower-case ``a`` is as likely a variable.
    A letter followed by the option's text ("(B) 12", "B: 12") also counts.
    """
    s = _unwrap_command(answer.strip().strip("$").strip(), _TEXT_WRAPPERS).strip()
    m = re.fullmatch(r"\(?([A-J])\)?(?:\s*[.:)]\s*.*|\.)?", s, re.DOTALL)
    if m:
        return m.group(1)
    m = re.fullmatch(r"\(([A-J])\)\s+.*", s, re.DOTALL)
    return m.group(1) if m else None
