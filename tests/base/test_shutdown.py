"""hard_exit / run_and_exit keep a normal exit's codes, messages, atexit callbacks and output."""

import subprocess
import sys
import textwrap

import pytest

PRELUDE = """
import atexit, sys
from realhf.base import shutdown
atexit.register(lambda: print("atexit ran", flush=True))
sys.stdout.write("unflushed-no-newline")
"""


def _run(body: str):
    code = PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "body, rc, err",
    [
        ("shutdown.run_and_exit(lambda: 3)", 3, ""),
        ("shutdown.run_and_exit(lambda: None)", 0, ""),
        (
            "def m(): raise SystemExit('bad option --x')\nshutdown.run_and_exit(m)",
            1,
            "bad option --x",
        ),
        ("def m(): raise SystemExit(4)\nshutdown.run_and_exit(m)", 4, ""),
        ("def m(): raise ValueError('boom')\nshutdown.run_and_exit(m)", 1, "ValueError: boom"),
        ("def m(): raise KeyboardInterrupt\nshutdown.run_and_exit(m)", 130, ""),
        ("shutdown.hard_exit(7)", 7, ""),
    ],
)
def test_exit_codes_messages_and_callbacks(body, rc, err):
    r = _run(body)
    assert r.returncode == rc, r.stderr
    assert r.stdout.startswith("unflushed-no-newline") and "atexit ran" in r.stdout
    assert err in r.stderr
