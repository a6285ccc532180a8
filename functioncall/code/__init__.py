"""Sandboxed execution of generated code for code rewards.

``verify(generated_text, input_output) -> bool`` runs the last python block of a
generation against test cases (stdin/stdout or call-based) in a sandbox
(:mod:`functioncall.code.sandbox`) and is true only if every case passes.
"""

from functioncall.code.judge import extract_code, verify, verify_batch
from functioncall.code.sandbox import RunResult, SandboxLimits, run_python, sandbox_mode

__all__ = [
    "extract_code",
    "verify",
    "verify_batch",
    "RunResult",
    "SandboxLimits",
    "run_python",
    "sandbox_mode",
]
