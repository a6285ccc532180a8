"""The launcher's console: live progress from the run's files, the final summary, and
refusing to run over an earlier run."""

import io
import json
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest
import quickstart_runs as qs

from realhf.api.cli_parser import parse_config
from realhf.apps import main as app_main
from realhf.apps.console import RunConsole, format_summary, read_records, summarize
from realhf.apps.quickstart import _load_experiments
from realhf.experiments.registry import get_quickstart_exp


def _write(run_dir, plan=None, records=()):
    os.makedirs(run_dir, exist_ok=True)
    if plan is not None:
        with open(os.path.join(run_dir, "progress.json"), "w") as f:
            json.dump(plan, f)
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def _step(step, **kw):
    return {"step": step, "n_items": 32, "time": 2.0, "rew/task_reward": -1.0 + step, **kw}


def test_plain_lines_show_steps_evals_and_the_last_step(tmp_path):
    out = io.StringIO()
    con = RunConsole("ppo-math", str(tmp_path), stream=out, tty=False, interval=3600)
    con.poll()  # nothing written yet: nothing shown
    assert out.getvalue() == ""
    _write(tmp_path, {"total_steps": 4, "start_step": 0}, [{"step": 0, "eval/greedy_acc": 0.25}])
    _write(tmp_path, records=[_step(1), _step(2)])
    con.poll()
    _write(tmp_path, records=[_step(3, **{"eval/greedy_acc": 0.5})])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "n_it')  # a line being written is not shown yet
    con.poll()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('ems": 32, "time": 1.0}\n')
    con.poll()
    lines = out.getvalue().splitlines()
    assert lines == [
        "ppo-math: before training | eval acc 25.0% @ step 0",
        "ppo-math: step 1/4 | 16.0 samples/s | reward 0 | eval acc 25.0% @ step 0 | ETA ?",
        # step 2: inside the interval, not shown; step 3 has an evaluation, step 4 is last
        "ppo-math: step 3/4 | 16.0 samples/s | reward 2 | eval acc 50.0% @ step 3 | ETA 0s",
        "ppo-math: step 4/4 | 32.0 samples/s | eval acc 50.0% @ step 3 | ETA 0s",
    ]


def test_a_resumed_attempt_shows_its_steps_again(tmp_path):
    out = io.StringIO()
    con = RunConsole("x", str(tmp_path), stream=out, tty=False, interval=0)
    _write(tmp_path, {"total_steps": 3, "start_step": 0}, [_step(1), _step(2)])
    con.poll()
    # The relaunch resumes from step 1: step 2 is trained (and written) again.
    _write(tmp_path, {"total_steps": 3, "start_step": 1}, [_step(2, **{"rew/task_reward": 7})])
    con.poll()
    steps = re.findall(r"step (\d)/3 \| .* reward (\S+)", out.getvalue())
    assert steps == [("1", "0"), ("2", "1"), ("2", "7")]


def _bytes_read() -> int:
    """Bytes this process has read through read() calls so far (Linux)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_polls_read_only_what_was_appended(tmp_path):
    """A run of N steps polled after each one reads the file about once in all, not N/2
    times over (the whole file every half second); a line being written waits for its end."""
    out = io.StringIO()
    con = RunConsole("x", str(tmp_path), stream=out, tty=False, interval=0)
    _write(tmp_path, {"total_steps": 300, "start_step": 0})
    lines = [json.dumps(_step(step)) + "\n" for step in range(1, 301)]
    before = _bytes_read()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        for line in lines:  # written as the master does, one step at a time
            f.write(line)
            f.flush()
            con.poll()
    read = _bytes_read() - before
    size = os.path.getsize(tmp_path / "metrics.jsonl")
    # Each byte once, plus progress.json at every poll (reading it all: ~150x the file).
    assert read < 3 * size, (read, size)
    assert len(re.findall(r"step \d+/300", out.getvalue())) == 300
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 301, "n_items"')  # not complete: not read as a record
    con.poll()
    assert "step 301" not in out.getvalue()


def test_a_rewritten_or_truncated_metrics_file_is_read_anew(tmp_path):
    out = io.StringIO()
    con = RunConsole("x", str(tmp_path), stream=out, tty=False, interval=0)
    _write(tmp_path, {"total_steps": 9, "start_step": 0}, [_step(s) for s in range(1, 6)])
    con.poll()
    # A resumed run rewrites the file atomically (another inode) with the steps it kept...
    with open(tmp_path / "new.jsonl", "w") as f:
        f.write(json.dumps(_step(1)) + "\n" + json.dumps(_step(2)) + "\n")
    os.replace(tmp_path / "new.jsonl", tmp_path / "metrics.jsonl")
    _write(tmp_path, records=[_step(3, **{"rew/task_reward": 7})])
    con.poll()
    # ...and a file cut shorter in place is read from its start too.
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps(_step(3, **{"rew/task_reward": 8})) + "\n")
    con.poll()
    steps = re.findall(r"step (\d)/9 \| .* reward (\S+)", out.getvalue())
    assert steps == [("1", "0"), ("2", "1"), ("3", "2"), ("4", "3"), ("5", "4"),
                     ("3", "7"), ("3", "8")]  # fmt: skip


def test_the_terminal_view_is_a_progress_bar_with_evaluations_above_it(tmp_path):
    out = io.StringIO()
    with RunConsole("ppo-math", str(tmp_path), stream=out, tty=True, poll_s=0.05):
        _write(tmp_path, {"total_steps": 2, "start_step": 0}, [_step(1)])
        _write(tmp_path, records=[_step(2, **{"eval/greedy_acc": 0.75})])
        time.sleep(0.5)
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", out.getvalue())
    assert "2/2" in text and "━" in text  # the bar, complete
    assert "step 2/2 | 16.0 samples/s | reward 1 | eval acc 75.0% @ step 2" in text


def test_summary_of_an_async_run(tmp_path):
    recs = [{"step": 0, "eval/greedy_acc": 0.3}]
    for s in (1, 2, 3):
        recs.append(
            _step(s, **{"rollout/staleness_mean": s / 4, "rollout/staleness_max": min(s, 2)})
        )
    recs[-1]["eval/greedy_acc"] = 0.45
    _write(tmp_path, {"total_steps": 3, "start_step": 0}, recs)
    ck = tmp_path / "checkpoints" / "actor"
    for step in (2, 3):
        (ck / f"epoch1epochstep{step}globalstep{step}").mkdir(parents=True)
        (ck / f"epoch1epochstep{step}globalstep{step}" / "config.json").write_text("{}")
    (tmp_path / "checkpoints" / "recover" / "step2").mkdir(parents=True)  # not an HF dir
    _load_experiments()
    cfg = parse_config(get_quickstart_exp("async-ppo-math").config_cls, [])
    s = summarize("async-ppo-math", str(tmp_path), 60.0, cfg)
    assert s["trained_samples"] == 96 and s["samples_per_s"] == 16.0
    assert s["accuracy"] == {
        "key": "eval/greedy_acc",
        "start": 0.3,
        "start_step": 0,
        "final": 0.45,
        "final_step": 3,
    }
    assert s["staleness"] == {"mean": 0.5, "max": 2}
    assert s["checkpoint"] == str(ck / "epoch1epochstep3globalstep3")
    assert s["evaluate"].startswith("python -m evaluation.eval_and_aggregate --model_path ")
    assert "--data_names tiny_arith" in s["evaluate"] and "--max_gen_tokens 16" in s["evaluate"]
    text = format_summary(s)
    assert "eval/greedy_acc  30.0% (step 0) -> 45.0% (step 3), +15.0 points" in text
    assert "staleness        mean 0.50, max 2" in text


def test_warnings_logged_during_the_run_are_the_summary_s_incidents(tmp_path):
    from realhf.base import logging

    log = logging.getLogger("jobs")
    with RunConsole("x", str(tmp_path), stream=io.StringIO(), tty=False) as con:
        log.info("started")  # not an incident
        log.warning("generation_server/0 killed by SIGKILL: restarting it (1/3)\ndetails")
        log.error("rollout_worker/0: LOST")
    log.warning("after the run: not collected")
    assert con.incidents == [
        "jobs: generation_server/0 killed by SIGKILL: restarting it (1/3)",
        "jobs: rollout_worker/0: LOST",
    ]
    s = summarize("x", str(tmp_path), 1.0, incidents=con.incidents)
    text = format_summary(s)
    assert "incidents        2 warnings/errors while it ran:" in text
    assert "    ! jobs: rollout_worker/0: LOST" in text
    many = format_summary(summarize("x", str(tmp_path), 1.0, incidents=["w"] * 20))
    assert many.count("    ! w") == 8 and "all 20 in summary.json" in many


def test_summary_without_evaluations_shows_the_loss(tmp_path):
    _write(tmp_path, None, [{"step": s, "train/sft/loss": 3.0 / s} for s in (1, 2, 3)])
    s = summarize("sft", str(tmp_path), 5.0)
    assert s["trend"] == {"key": "train/sft/loss", "first": 3.0, "last": 1.0}
    assert s["checkpoint"] is None and "accuracy" not in s
    assert "train/sft/loss: 3 (first step) -> 1 (last)" in format_summary(s)


# ---- an earlier run in the same trial directory ---------------------------------------


def _cfg(tmp_path, *args):
    _load_experiments()
    qs_ = get_quickstart_exp("ppo-math")
    return parse_config(qs_.config_cls, [f"fileroot={tmp_path}", "trial_name=t", *args])


@pytest.fixture
def launches(monkeypatch):
    """Launches recorded instead of run."""
    calls = []
    monkeypatch.setattr(app_main, "launcher", lambda mode: lambda *a, **k: calls.append(k))
    return calls


def test_an_earlier_run_is_refused_naming_the_directory_and_the_choices(tmp_path, capsys, launches):
    run_dir = tmp_path / "ppo-math" / "t"
    _write(run_dir, None, [_step(1)])
    assert app_main.run("ppo-math", _cfg(tmp_path)) == 2
    err = capsys.readouterr().err
    assert f"{run_dir} already holds a run (metrics.jsonl)" in err
    assert "trial_name=NEW" in err and "overwrite=true" in err and not launches
    assert read_records(run_dir / "metrics.jsonl") == [_step(1)]  # untouched
    # With a recover checkpoint, recover_mode=auto resumes it.
    (run_dir / "checkpoints" / "recover" / "step1").mkdir(parents=True)
    assert app_main.run("ppo-math", _cfg(tmp_path)) == 2
    assert "recover_mode=auto to resume it" in capsys.readouterr().err
    assert app_main.run("ppo-math", _cfg(tmp_path, "recover_mode=auto")) == 0
    assert len(launches) == 1 and (run_dir / "metrics.jsonl").exists()


def test_overwrite_replaces_the_earlier_run(tmp_path, launches):
    run_dir = tmp_path / "ppo-math" / "t"
    _write(run_dir, {"total_steps": 1, "start_step": 0}, [_step(1)])
    assert app_main.run("ppo-math", _cfg(tmp_path, "overwrite=true")) == 0
    assert len(launches) == 1 and not (run_dir / "metrics.jsonl").exists()
    assert (run_dir / "config.yaml").exists() and (run_dir / "summary.json").exists()


# ---- the real thing: the no-argument ppo-math, short, in a pipe and in a terminal ------

ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]")
# Small steps: these tests are about what the console shows, not what the run learns.
SHORT = [
    "exp_ctrl.benchmark_steps=3",
    "exp_ctrl.eval_freq_steps=3",
    "train_batch_size=4",
    "ppo.group_size=2",
    "ppo.gen.max_new_tokens=4",
    "dataset.eval_max_new_tokens=4",
]


def _check_summary(out: str, run_dir) -> None:
    recs = read_records(os.path.join(run_dir, "metrics.jsonl"))
    evals = [r for r in recs if "eval/greedy_acc" in r]
    assert [r["step"] for r in evals] == [0, 3]
    start, final = evals[0]["eval/greedy_acc"], evals[-1]["eval/greedy_acc"]
    assert f"eval/greedy_acc  {start:.1%} (step 0) -> {final:.1%} (step 3)" in out, out
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    assert s["status"] == "finished" and s["steps"] == 3
    assert (s["accuracy"]["start"], s["accuracy"]["final"]) == (start, final)
    assert f"checkpoint       {s['checkpoint']}" in out and os.path.isdir(s["checkpoint"])


@pytest.mark.slow
def test_progress_appears_while_a_piped_run_goes_and_the_summary_matches_metrics(
    tmp_path, no_leftover_processes
):
    run = qs.start("ppo-math", SHORT, tmp_path)
    seen_running = []
    with qs.killed_on_error(run):
        lines = []
        for line in run.stdout:
            lines.append(line)
            if re.match(r"ppo-math: step \d/3 \|", line):
                seen_running.append(run.poll() is None)
        out = "".join(lines) + qs.finish(run, timeout=300)
    assert "ppo-math: before training | eval acc" in out
    assert seen_running and seen_running[0], out  # the first step line came mid-run
    assert "ppo-math: step 3/3 |" in out
    _check_summary(out, tmp_path / "ppo-math" / "t")


@pytest.mark.slow
def test_a_terminal_gets_a_live_bar_and_the_summary(tmp_path, no_leftover_processes):
    primary, secondary = pty.openpty()
    cmd = [sys.executable, "-m", "realhf.apps.quickstart", "ppo-math", *SHORT]
    cmd += [f"fileroot={tmp_path}", "trial_name=t"]
    run = subprocess.Popen(cmd, stdout=secondary, stderr=secondary, cwd=qs.ROOT)
    os.close(secondary)
    chunks, bar_while_running = [], False
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([primary], [], [], 1.0)
            if not ready:
                continue
            try:
                data = os.read(primary, 65536)
            except OSError:  # EIO: the child side closed
                break
            if not data:
                break
            chunks.append(data)
            text = ANSI.sub("", b"".join(chunks).decode(errors="replace"))
            if re.search(r"━+\s*[123]/3", text) and run.poll() is None:
                bar_while_running = True
        assert run.wait(timeout=60) == 0
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        os.close(primary)
    out = ANSI.sub("", b"".join(chunks).decode(errors="replace")).replace("\r", "\n")
    assert bar_while_running, out[-3000:]
    _check_summary(out, tmp_path / "ppo-math" / "t")
