"""Code reward: does the generated program pass every test case?

    from functioncall.code import verify
    verify(generated_text, {"inputs": ["1 2\\n"], "outputs": ["3\\n"]})            # stdin/stdout
    verify(generated_text, {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]})  # call-based

The last fenced python block of the generation is the program. Each test case is
one sandboxed run (:mod:`functioncall.code.sandbox`): in stdin/stdout mode the
case input is the program's stdin and its stdout must match the expected output;
in call-based mode (``fn_name`` given) the function — top-level, or a method of
``class Solution`` — is called with the case's arguments and its return value
must equal the expected one. The reward is true only if every case passes; the
first failing case ends the check.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import os
import re
import time
from typing import Any, List, Optional, Union

from functioncall.code.sandbox import RunResult, SandboxLimits, run_python, sandbox_mode

logger = logging.getLogger(__name__)

DEFAULT_CASE_TIMEOUT = 6.0
DEFAULT_TOTAL_TIMEOUT = 200.0
_FLOAT_TOL = 1e-6
_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runner.py")
_FENCE = re.compile(r"```[ \t]*(python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(text: str) -> Optional[str]:
    """The last closed ```python (or ```py / ```python3) block of ``text``, or None."""
    # Closed blocks only: an answer cut off by max_new_tokens must not run as
    # half a program.  The last block, because models tend to draft first and
    # give their final program at the end.
    blocks = [b for _, b in _FENCE.findall(text) if b.strip()]
    return blocks[-1] if blocks else None


def parse_input_output(input_output: Union[str, dict]) -> dict:
    """The test cases as a dict with equal-length ``inputs`` and ``outputs`` lists."""
    io = json.loads(input_output) if isinstance(input_output, str) else input_output
    if not isinstance(io, dict):
        raise ValueError(f"input_output must be a dict or its JSON, got {type(io).__name__}")
    inputs, outputs = io.get("inputs"), io.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        n_in = len(inputs) if isinstance(inputs, list) else "-"
        n_out = len(outputs) if isinstance(outputs, list) else "-"
        raise ValueError(
            "input_output needs lists 'inputs' and 'outputs' of the same length; got "
            f"inputs={type(inputs).__name__}[{n_in}], "
            f"outputs={type(outputs).__name__}[{n_out}]"
        )
    if not inputs:
        raise ValueError("input_output has no test cases; a program cannot be judged on none")
    fn_name = io.get("fn_name")
    if fn_name is not None and (not isinstance(fn_name, str) or not fn_name.isidentifier()):
        raise ValueError(f"input_output fn_name={fn_name!r} is not a Python identifier")
    return io


# ------------------------------------------------------------------- comparison


def _tokens_equal(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return math.isclose(x, y, rel_tol=_FLOAT_TOL, abs_tol=_FLOAT_TOL)


def stdout_matches(got: str, expected: Any) -> bool:
    """Judge stdout: equal lines after stripping each, else equal whitespace-separated
    tokens (numbers within 1e-6)."""
    if isinstance(expected, list):
        expected = "\n".join(map(str, expected))
    expected = str(expected)
    got_lines = [line.strip() for line in got.strip().splitlines()]
    exp_lines = [line.strip() for line in expected.strip().splitlines()]
    if got_lines == exp_lines:
        return True
    # Datasets disagree on line layout (one answer per line or all on one), so
    # a token-wise match is accepted too.
    got_tok, exp_tok = got.split(), expected.split()
    return len(got_tok) == len(exp_tok) and all(map(_tokens_equal, got_tok, exp_tok))


def _values_equal(a: Any, b: Any) -> bool:
    # bool first: it is an int subclass, and True must not pass for 1.
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=_FLOAT_TOL, abs_tol=_FLOAT_TOL)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_values_equal, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    return a == b


def result_matches(got: Any, expected: Any) -> bool:
    """Judge a return value; datasets often wrap the expected value in a one-item list."""
    if _values_equal(got, expected):
        return True
    return isinstance(expected, list) and len(expected) == 1 and _values_equal(got, expected[0])


def _call_args(case_input: Any) -> list:
    """Arguments of a call-based case: a JSON list, or a string of one JSON value per line."""
    if isinstance(case_input, str):
        return [json.loads(line) for line in case_input.splitlines() if line.strip()]
    if isinstance(case_input, list):
        return case_input
    return [case_input]


def _expected_value(case_output: Any) -> Any:
    if isinstance(case_output, str):
        try:
            return json.loads(case_output)
        except ValueError:
            return case_output
    return case_output


# ------------------------------------------------------------------------ verify


def run_case(
    code: str,
    case_input: Any,
    fn_name: Optional[str],
    limits: SandboxLimits,
    mode: Optional[str] = None,
) -> RunResult:
    """One sandboxed run of ``code`` on one test case."""
    mode = mode or sandbox_mode()
    with open(_RUNNER, encoding="utf-8") as f:
        files = {"runner.py": f.read(), "program.py": code}
    args = ["{code}/runner.py", "{code}"]
    if fn_name is None:
        args.append("stdio")
        stdin = case_input if not isinstance(case_input, list) else "\n".join(map(str, case_input))
        stdin = str(stdin).encode("utf-8")
    else:
        args += ["call", fn_name]
        files["args.json"] = json.dumps(_call_args(case_input))
        stdin = b""
    # Refuse socket(2) by seccomp in both modes: the only network defence in rlimit
    # mode, and a second one behind bwrap's empty network namespace.
    args.append("--block-sockets")
    return run_python(args, files, stdin, limits, mode=mode)


def verify(
    generated_text: str,
    input_output: Union[str, dict],
    *,
    case_timeout: float = DEFAULT_CASE_TIMEOUT,
    total_timeout: float = DEFAULT_TOTAL_TIMEOUT,
    limits: Optional[SandboxLimits] = None,
    mode: Optional[str] = None,
) -> bool:
    """True iff the last python block of ``generated_text`` passes every test case.

    Args:
        generated_text: the model's output; its last fenced python block is run.
        input_output: ``{"inputs": [...], "outputs": [...], "fn_name"?: str}`` or its JSON.
        case_timeout: wall-clock seconds per test case (ignored if ``limits`` is given).
        total_timeout: seconds for all cases together; cases left when it runs out fail.
        limits: full sandbox limits, overriding ``case_timeout``.
        mode: sandbox mode (``"bwrap"`` or ``"rlimit"``); default: the detected one.
    """
    io = parse_input_output(input_output)
    code = extract_code(generated_text)
    if code is None:
        return False
    limits = limits or SandboxLimits(wall_timeout_s=case_timeout)
    fn_name = io.get("fn_name")
    deadline = time.monotonic() + total_timeout
    for i, (case_in, case_out) in enumerate(zip(io["inputs"], io["outputs"])):
        if time.monotonic() > deadline:
            logger.info("code verify: total timeout %.0fs reached at case %d", total_timeout, i)
            return False
        res = run_case(code, case_in, fn_name, limits, mode=mode)
        if not _passed(res, case_out, fn_name):
            logger.debug(
                "code verify: case %d failed (rc=%s, timed_out=%s): %s",
                i,
                res.returncode,
                res.timed_out,
                res.stderr[-300:],
            )
            return False
    return True


def _passed(res: RunResult, case_out: Any, fn_name: Optional[str]) -> bool:
    if not res.ok:
        return False
    if fn_name is None:
        return stdout_matches(res.stdout, case_out)
    try:
        got = json.loads(res.stdout)
    except ValueError:
        return False
    return result_matches(got, _expected_value(case_out))


def verify_batch(
    generated_texts: List[str],
    input_outputs: List[Union[str, dict]],
    max_workers: Optional[int] = None,
    **kwargs,
) -> List[bool]:
    """:func:`verify` for each (text, test cases) pair, ``max_workers`` at a time.

    Each concurrent run holds its own sandbox uid, so runs do not share a process limit.
    """
    if len(generated_texts) != len(input_outputs):
        raise ValueError(
            f"verify_batch: {len(generated_texts)} texts but {len(input_outputs)} input_outputs"
        )
    workers = max_workers or min(4, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="code-verify") as ex:
        return list(
            ex.map(
                lambda pair: verify(pair[0], pair[1], **kwargs), zip(generated_texts, input_outputs)
            )
        )
