"""benchmark/vs_vllm.py's own plumbing (the comparison itself is a benchmark, not a test)."""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmark.vs_vllm import Server, fastest  # noqa: E402


def test_a_failed_point_reports_the_servers_state_and_the_log_lines_that_say_why(tmp_path):
    """A peer whose engine died mid-point: the report says it exited, with its code, and
    shows the lines of its log that name the error or the signal, not just the client's
    "Server disconnected"."""
    script = (
        "import sys\n"
        "for i in range(40): print('INFO: request', i)\n"
        "print('(EngineCore) INFO: trigger received signal=SIGTERM')\n"
        "print('INFO: shutting down')\n"
        "print('ERROR: EngineDeadError: EngineCore encountered an issue')\n"
        "sys.exit(3)\n"
    )
    log = str(tmp_path / "server.log")
    server = Server("a peer", [sys.executable, "-c", script, "--port", "1"], dict(os.environ), log)
    server.proc.wait(30)
    why = server.why_it_failed()
    assert why.startswith("a peer exited (3); from its log " + log)
    assert "signal=SIGTERM" in why and "EngineDeadError" in why
    assert "request 39" not in why and "shutting down" not in why  # only what names a failure


def test_a_server_with_nothing_alarming_in_its_log_shows_its_last_lines(tmp_path):
    log = str(tmp_path / "server.log")
    script = "import time\nprint('INFO: ready', flush=True)\ntime.sleep(60)\n"
    server = Server("ours", [sys.executable, "-c", script, "--port", "1"], dict(os.environ), log)
    try:
        deadline = time.monotonic() + 30
        while "ready" not in open(log).read():
            assert server.proc.poll() is None, "the stand-in server exited"
            assert time.monotonic() < deadline, "the stand-in server printed nothing in 30 s"
            time.sleep(0.05)
        why = server.why_it_failed()
        assert why.startswith("ours is still running;") and why.endswith("INFO: ready")
    finally:
        server.stop()


def test_each_point_counts_vllms_faster_mode_and_names_it():
    by_mode = {
        "eager": {"256x16": 4033.0, "64x128": 5074.0},
        "compiled": {"256x16": 4084.0, "64x128": 4100.0},
    }
    tps, mode = fastest(by_mode)
    assert tps == {"256x16": 4084.0, "64x128": 5074.0}
    assert mode == {"256x16": "compiled", "64x128": "eager"}
    assert fastest({"eager": {"16x64": 95.0}}) == ({"16x64": 95.0}, {"16x64": "eager"})
    assert fastest({}) == ({}, {})


def test_prompts_are_the_datas_or_cut_from_successive_ones_at_the_length_asked():
    from benchmark.vs_vllm import make_prompts

    data = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    assert make_prompts(data, 2) == [[1, 2, 3], [4, 5]]
    long = make_prompts(data, 3, prompt_len=7)
    assert long == [[1, 2, 3, 4, 5, 6, 7], [4, 5, 6, 7, 8, 9, 1], [6, 7, 8, 9, 1, 2, 3]]
    assert len({tuple(p) for p in long}) == 3  # distinct
