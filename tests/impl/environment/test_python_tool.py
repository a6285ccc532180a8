"""math-python-tool: tool calls run in the code sandbox; answers are graded as before."""

import asyncio

import pytest

from realhf.impl.environment.math_code_single_step import MathCodeAction
from realhf.impl.environment.python_tool import (
    MathPythonToolEnv,
    PythonToolCall,
    extract_tool_call,
)


def _step(env, action):
    return asyncio.run(env.step(action))


def test_a_tool_call_prints_its_result_and_failures_say_why():
    env = MathPythonToolEnv(wall_timeout_s=2.0, max_output_chars=40)
    r = _step(env, PythonToolCall("print(66+26)"))
    assert r.obs == "<output>92</output>" and r.reward == 0.0 and not r.terminated
    err = _step(env, PythonToolCall("1/0"))
    assert err.obs == "<output>ZeroDivisionError: division by zero</output>"
    assert _step(env, PythonToolCall("while True: pass")).obs == "<output>timeout</output>"
    assert _step(env, PythonToolCall("print('x' * 50)")).obs == f"<output>{'x' * 40}...</output>"
    graded = _step(env, MathCodeAction("\\boxed{92}", solutions=("92",)))
    assert graded.reward == 1.0 and graded.terminated
    with pytest.raises(TypeError, match="expects a PythonToolCall or a MathCodeAction"):
        _step(env, "print(1)")


def test_a_tool_call_has_no_network():
    from functioncall.code.sandbox import sandbox_mode

    if sandbox_mode() != "bwrap":
        # rlimit mode (no bubblewrap, or no namespaces) has no network defence of its own:
        # functioncall/code/sandbox.py says so
        pytest.skip("the sandbox runs in rlimit mode here (bubblewrap missing or unusable)")
    env = MathPythonToolEnv(wall_timeout_s=2.0, max_output_chars=200)
    net = _step(env, PythonToolCall("import socket; socket.create_connection(('1.1.1.1', 80))"))
    assert "Error" in net.obs


def test_extract_tool_call_takes_the_last_block():
    assert extract_tool_call("a <python>print(1)</python> b <python> x=2 </python>") == "x=2"
    assert extract_tool_call("\\boxed{3}") is None
