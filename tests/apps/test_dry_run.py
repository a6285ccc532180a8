"""``quickstart EXP --dry-run``: the compiled graph, layouts, workers and config, and nothing
launched or written."""

import os
import re

import pytest
import quickstart_runs
import torch

from realhf.api.cli_parser import parse_config
from realhf.api.core.dfg import build_graph
from realhf.apps import quickstart
from realhf.experiments.registry import get_quickstart_exp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Read off the builders: {mfc: (model, type)}, the edges, {worker type: processes}.
EXPECTED = {
    "ppo-math": (
        {
            "actor_gen": ("actor", "generate"),
            "rew_inf": ("actor", "inference"),
            "actor_train": ("actor", "train_step"),
        },
        [("actor_gen", "rew_inf"), ("actor_gen", "actor_train"), ("rew_inf", "actor_train")],
        {"model_worker": 1, "master_worker": 1},
    ),
    "async-ppo-math": (
        {"actor_train": ("actor", "train_step")},  # generation runs on the servers
        [],
        {
            "generation_server": 1,
            "gserver_manager": 1,
            "model_worker": 1,
            "master_worker": 1,
            "rollout_worker": 1,
        },
    ),
    "sft": (
        {"trainDefault": ("default", "train_step")},
        [],
        {"model_worker": 1, "master_worker": 1},
    ),
    "null": (
        {"null_inf": ("default", "inference"), "null_train": ("default", "train_step")},
        [("null_inf", "null_train")],
        {"model_worker": 1, "master_worker": 1},
    ),
}


@pytest.fixture
def nothing_runs(tmp_path, monkeypatch, no_leftover_processes):
    """Run in an empty ``tmp_path``; fail if anything launches; check that nothing was
    written there and (``no_leftover_processes``) that no child process is left."""
    import realhf.apps.main
    import realhf.scheduler

    def refuse(*args, **kwargs):
        raise AssertionError("a dry run launched the experiment")

    monkeypatch.setattr(realhf.apps.main, "run", refuse)
    monkeypatch.setattr(realhf.apps.main, "launcher", refuse)
    monkeypatch.setattr(realhf.scheduler, "launcher", refuse)
    monkeypatch.chdir(tmp_path)
    yield tmp_path / "fileroot"
    assert list(tmp_path.iterdir()) == []
    no_leftover_processes(timeout=0)


def _dry_run(capsys, *args) -> str:
    code = quickstart.main([*args, "--dry-run"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_text_shows_graph_layouts_workers_and_config(name, nothing_runs, capsys):
    mfcs, edges, workers = EXPECTED[name]
    out = _dry_run(capsys, name, f"fileroot={nothing_runs}")
    assert f"dataflow graph: {len(mfcs)} MFC(s), {len(edges)} edge(s)" in out
    for p, c in edges:
        assert re.search(rf"^  {p} -> {c}\s+\(", out, re.M), (p, c)
    for mfc, (model, kind) in mfcs.items():
        assert re.search(rf"^  {mfc}\s+{model}\s+{kind}\s+d1p1m1\s+\w+\(", out, re.M), mfc
    cuda = torch.cuda.is_available()
    for t, n in workers.items():
        gpus = int(cuda and t in ("model_worker", "generation_server"))
        assert re.search(rf"^  {t}\s+{n}\s+{gpus}\s+\w", out, re.M), t
    n_procs = sum(workers.values()) + 1  # + the controller
    assert f"{n_procs} processes; run dir {nothing_runs}{os.sep}{name}{os.sep}run0" in out
    assert re.search(r"^allocation_mode: \S+$", out, re.M)
    assert f"fileroot: {nothing_runs}" in out


def test_full_ppo_graph_matches_the_built_experiment(nothing_runs, capsys):
    args = ["ppo.kl_ctl=0.1", "ppo.disable_value=false", f"fileroot={nothing_runs}"]
    qs = get_quickstart_exp("ppo-math")
    graph = build_graph(
        qs.build(parse_config(qs.config_cls, args)).workers["master_worker"][0].mfcs
    )
    out = _dry_run(capsys, "ppo-math", *args)
    assert {"ref_inf", "critic_inf", "critic_train"} <= set(graph.mfcs)
    for mfc in graph.mfcs:
        assert re.search(rf"^  {mfc}\s", out, re.M), mfc
    for p, c in graph.edges:
        assert re.search(rf"^  {p} -> {c}\s+\(", out, re.M), (p, c)


@pytest.mark.parametrize("name", ["ppo-math", "async-ppo-math"])
def test_mermaid_is_one_document_with_every_edge(name, nothing_runs, capsys):
    mfcs, edges, _ = EXPECTED[name]
    out = _dry_run(capsys, name, "--format", "mermaid", f"fileroot={nothing_runs}")
    lines = out.splitlines()
    assert lines[0] == "flowchart TD"
    # The graph, then the rest as comments: the whole output renders as it is.
    assert all(ln.startswith(("  ", "%%")) for ln in lines[1:]), out
    for mfc in mfcs:
        assert re.search(rf'^  {mfc}\["{mfc}<br/>', out, re.M), mfc
    for p, c in edges:
        assert re.search(rf"^  {p}\b.*--> {c}$", out, re.M), (p, c)
    assert re.search(r"^%% allocation_mode: \S+$", out, re.M)
    assert "%%   model_worker " in out


def test_bad_arguments_exit_2_and_say_why(nothing_runs, capsys):
    for args, message in (
        (["--dry-run", "bogus=1"], "unknown config key 'bogus'"),
        (["--dry-run", "--format", "dot"], "--format 'dot': use one of text, mermaid"),
        (["--dry-run", "--format"], "--format needs one of text, mermaid"),
        (["--format=mermaid"], "--format only applies to --dry-run"),
    ):
        assert quickstart.main(["sft", f"fileroot={nothing_runs}", *args]) == 2, args
        assert message in capsys.readouterr().err


def test_help_mentions_dry_run(capsys):
    for args in (["--help"], ["ppo-math", "--help"]):
        assert quickstart.main(args) == 0
        out = capsys.readouterr().out
        assert "--dry-run" in out and "--format" in out and "mermaid" in out


@pytest.mark.slow
def test_command_line_dry_run(tmp_path):
    fileroot = tmp_path / "fileroot"
    r = quickstart_runs.run(["ppo-math", "--dry-run", f"fileroot={fileroot}"], 120)
    assert r.returncode == 0, r.stderr
    assert "actor_gen -> rew_inf" in r.stdout and "rew_inf -> actor_train" in r.stdout
    assert not fileroot.exists()
