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


def test_servers_are_measured_in_rounds_that_turn_their_order(monkeypatch):
    """Every round runs each point once on every server, the servers' order turning by one
    per round, and each point counts the median of its runs: a slow stretch of the VM falls
    on all servers alike."""
    from benchmark import vs_vllm

    class Stub:
        def __init__(self, name):
            self.name = name

        def wait_healthy(self):
            return 0.0

        def model_name(self):
            return f"model-{self.name}"

    calls = []
    speed = {"a": [10.0, 30.0, 20.0], "b": [5.0, 7.0, 6.0]}

    def run_point(server, model, prompts, concurrency, new_tokens):
        assert model == f"model-{server.name}"
        calls.append((server.name, f"{concurrency}x{new_tokens}"))
        if (concurrency, new_tokens) == (8, 4):
            return 1.0  # the warm-up
        runs = [c for c in calls if c == calls[-1]]
        return speed[server.name][len(runs) - 1] * (2 if concurrency == 64 else 1)

    monkeypatch.setattr(vs_vllm, "run_point", run_point)
    out = vs_vllm.measure([Stub("a"), Stub("b")], [], [(16, 64), (64, 64)], repeats=3)
    assert calls[:2] == [("a", "8x4"), ("b", "8x4")]
    assert calls[2:] == [
        ("a", "16x64"), ("b", "16x64"), ("a", "64x64"), ("b", "64x64"),  # round 1
        ("b", "16x64"), ("a", "16x64"), ("b", "64x64"), ("a", "64x64"),  # round 2
        ("a", "16x64"), ("b", "16x64"), ("a", "64x64"), ("b", "64x64"),  # round 3
    ]  # fmt: skip
    assert out == [{"16x64": 20.0, "64x64": 40.0}, {"16x64": 6.0, "64x64": 12.0}]
