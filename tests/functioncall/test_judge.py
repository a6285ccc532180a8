"""Code extraction and output comparison (no sandbox)."""

import pytest

from functioncall.code.judge import (
    extract_code,
    parse_input_output,
    result_matches,
    stdout_matches,
)


def test_extract_code_takes_the_last_closed_python_block():
    text = "```python\nprint(1)\n```\ntext\n```py\nprint(2)\n```\n```python\nprint(3)"
    assert extract_code(text) == "print(2)\n"  # the last block is not closed
    assert extract_code("```cpp\nint main(){}\n```") is None
    assert extract_code("no code") is None
    assert extract_code("```Python3\nx=1\n```") == "x=1\n"
    assert extract_code("```python\n\n```") is None


@pytest.mark.parametrize(
    "got, expected, ok",
    [
        ("3\n", "3\n", True),
        ("3", "3\n\n", True),
        ("1 2  \n3\n", "1 2\n3", True),
        ("1 2 3", "1\n2\n3", True),  # token-wise
        ("0.3333333", "0.33333333", True),
        ("0.33", "0.3333", False),
        ("4\n", "3\n", False),
        ("", "3", False),
        ("1\n2\n", ["1", "2"], True),
    ],
)
def test_stdout_matches(got, expected, ok):
    assert stdout_matches(got, expected) is ok


@pytest.mark.parametrize(
    "got, expected, ok",
    [
        ([0, 1], [[0, 1]], True),  # APPS wraps the expected value in a list
        ([0, 1], [0, 1], True),
        (3, [3], True),
        (0.1 + 0.2, 0.3, True),
        (True, 1, False),
        ({"a": [1]}, {"a": [1]}, True),
        ("x", "y", False),
    ],
)
def test_result_matches(got, expected, ok):
    assert result_matches(got, expected) is ok


def test_parse_input_output_errors_name_the_problem():
    with pytest.raises(ValueError, match="same length"):
        parse_input_output({"inputs": ["1"], "outputs": []})
    with pytest.raises(ValueError, match="no test cases"):
        parse_input_output('{"inputs": [], "outputs": []}')
    with pytest.raises(ValueError, match="not a Python identifier"):
        parse_input_output({"inputs": [[1]], "outputs": [1], "fn_name": "a b"})
    assert parse_input_output('{"inputs": ["1"], "outputs": ["1"]}')["inputs"] == ["1"]


# ------------------------------------------------------------ through the sandbox

import os  # noqa: E402

from functioncall.code import verify, verify_batch  # noqa: E402

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root to switch uid")
slow = pytest.mark.slow  # each case is a sandboxed subprocess

ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
TWO_SUM = (
    "```python\nclass Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
    "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
    "                return [seen[target - x], i]\n            seen[x] = i\n```"
)


@slow
@needs_root
def test_stdio_mode(mode):
    io = {"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]}
    assert verify(ADD, io, mode=mode) is True
    assert (
        verify(ADD, {"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "13\n"]}, mode=mode) is False
    )
    assert verify("no code here", io, mode=mode) is False


@slow
@needs_root
def test_call_mode_with_solution_class_and_json_string(mode):
    io = (
        '{"fn_name": "twoSum", "inputs": [[[2,7,11,15], 9], [[3,2,4], 6]], '
        '"outputs": [[[0,1]], [1,2]]}'
    )
    assert verify(TWO_SUM, io, mode=mode) is True
    bad = '{"fn_name": "twoSum", "inputs": [[[3,2,4], 6]], "outputs": [[0,2]]}'
    assert verify(TWO_SUM, bad, mode=mode) is False


@slow
@needs_root
def test_call_mode_prints_do_not_spoil_the_result(mode):
    code = "```python\ndef add(a, b):\n    print('debug output')\n    return (a + b, a - b)\n```"
    io = {"fn_name": "add", "inputs": ["1\n2"], "outputs": ["[3, -1]"]}
    assert verify(code, io, mode=mode) is True


@slow
@needs_root
def test_exception_fails_the_case(mode):
    code = "```python\nraise ValueError('boom')\n```"
    assert verify(code, {"inputs": [""], "outputs": [""]}, mode=mode) is False


@slow
@needs_root
def test_total_timeout_stops_remaining_cases():
    slow = "```python\nimport time\ntime.sleep(0.6)\nprint(1)\n```"
    io = {"inputs": [""] * 20, "outputs": ["1"] * 20}
    assert verify(slow, io, total_timeout=1.0) is False


@slow
@needs_root
def test_verify_batch_runs_concurrently_on_separate_uids():
    texts = [ADD, ADD.replace("a + b", "a - b"), ADD, TWO_SUM]
    ios = [{"inputs": ["2 3"], "outputs": ["5"]}] * 3 + [
        {"fn_name": "twoSum", "inputs": [[[1, 2], 3]], "outputs": [[0, 1]]}
    ]
    assert verify_batch(texts, ios, max_workers=3) == [True, False, True, True]
    with pytest.raises(ValueError, match="2 texts but 1"):
        verify_batch([ADD, ADD], [ios[0]])
