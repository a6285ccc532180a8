"""The memory estimate before launch: its terms, the refusal of a run that cannot fit with
the options that would, and what ``--dry-run`` shows."""

from __future__ import annotations

import os

import pytest

from realhf.api.cli_parser import parse_config
from realhf.apps import memory_plan, quickstart
from realhf.experiments.building_blocks import TINY_MODEL
from realhf.experiments.registry import get_quickstart_exp
from realhf.impl.model.nn.real_model import ReaLModel

GiB = memory_plan.GiB


def _build(name, *args):
    quickstart._load_experiments()  # registers the quickstart experiments
    qs = get_quickstart_exp(name)
    cfg = parse_config(qs.config_cls, list(args))
    return qs, cfg, qs.build(cfg)


def _worker(estimates, kind="model_worker"):
    return next(e for e in estimates if e.kind == kind)


def test_shape_counts_the_parameters_without_building_them():
    shape = memory_plan.Shape.of(TINY_MODEL)
    assert shape.n_params == ReaLModel.from_hf(TINY_MODEL).flat_params.numel()
    assert memory_plan.Shape.of(TINY_MODEL, is_critic=True).vocab == 1


@pytest.mark.parametrize(
    "args, per_param",
    [
        # fp32: weights 4, gradient 4, Adam 8 bytes per parameter
        ([], (4, 4, 8)),
        # bf16: weights 2, gradient 2 + fp32 sum 4 (less what the activations and logits
        # it replaces after the backward pass hold: None, checked below), master 4 + Adam 8
        (["model.dtype=bfloat16"], (2, None, 12)),
        # ZeRO-1 over two replicas halves the master weights and Adam moments
        (
            ["model.dtype=bfloat16", "model.optimizer.zero_stage=1", "allocation_mode=d2p1m1"],
            (2, 6, 6),
        ),
        # tensor parallelism divides everything over the shards
        (["allocation_mode=d1p1m2"], (2, 2, 4)),
    ],
)
def test_model_worker_terms_follow_dtype_zero_and_layout(args, per_param):
    _, cfg, exp = _build("sft", *args)
    n = memory_plan.Shape.of(TINY_MODEL).n_params
    terms = _worker(memory_plan.estimate(cfg, exp)).terms
    got = tuple(terms[t] for t in ("weights", "gradients", "optimizer"))
    if per_param[1] is None:
        transient = terms["activations"] + terms["logits"]
        per_param = (per_param[0], (2 * n + max(0, 4 * n - transient)) / n, per_param[2])
    assert got == tuple(int(n * b) for b in per_param)


def test_activations_shrink_with_checkpointing_and_token_budgets():
    def acts(*args):
        _, cfg, exp = _build("ppo-math", "train_batch_size=64", *args)
        return _worker(memory_plan.estimate(cfg, exp)).terms["activations"]

    full = acts()
    assert acts("actor.gradient_checkpointing=true") < full / 2
    assert acts("mb.max_tokens_per_mb=256") < full / 4
    # answers twice as long: (nearly) twice the tokens per step
    assert acts("ppo.gen.max_new_tokens=64") > 1.5 * acts("ppo.gen.max_new_tokens=32")


def test_generation_servers_and_other_processes_are_counted():
    _, cfg, exp = _build("async-ppo-math")
    est = memory_plan.estimate(cfg, exp)
    assert {e.kind for e in est} == set(exp.workers)
    server = _worker(est, "generation_server")
    # On a CPU the server keeps its linear weights packed for oneDNN too: twice the weights.
    assert server.terms["weights"] == memory_plan.Shape.of(TINY_MODEL).n_params * 4 * 2
    assert server.terms["kv cache"] > 0
    _, cfg, exp = _build("async-ppo-math", "gen_server.pack_weights=false")
    server = _worker(memory_plan.estimate(cfg, exp), "generation_server")
    assert server.terms["weights"] == memory_plan.Shape.of(TINY_MODEL).n_params * 4
    assert memory_plan.host_total(est) == sum(e.total * e.count for e in est) + (
        memory_plan.RUNTIME_OTHER
    )


def test_weight_files_in_shared_memory_are_counted_for_the_host():
    # /dev/shm is memory: the served version and the next one, in the trainer's dtype.
    _, cfg, exp = _build("async-ppo-math", "weight_sync=shm", "actor.dtype=bfloat16")
    est = memory_plan.estimate(cfg, exp)
    files = _worker(est, "shm weight files")
    assert files.total == 2 * memory_plan.Shape.of(TINY_MODEL).n_params * 2
    _, cfg, exp = _build("async-ppo-math")
    assert "shm weight files" not in {e.kind for e in memory_plan.estimate(cfg, exp)}
    # broadcast: the trainer's weight sender holds one copy
    _, cfg, exp = _build("async-ppo-math", "weight_sync=broadcast")
    copy = _worker(memory_plan.estimate(cfg, exp), "weight sender copy")
    assert copy.total == memory_plan.Shape.of(TINY_MODEL).n_params * 4


def test_a_run_that_cannot_fit_is_refused_with_the_options_that_would():
    qs, cfg, exp = _build("ppo-math", "train_batch_size=64", "ppo.group_size=8")
    need = memory_plan.host_total(memory_plan.estimate(cfg, exp))
    memory_plan.check_fits("ppo-math", cfg, exp, qs.build, available=2 * need)  # fits
    with pytest.raises(memory_plan.MemoryPlanError) as e:
        memory_plan.check_fits("ppo-math", cfg, exp, qs.build, available=int(0.8 * need))
    msg = str(e.value)
    assert f"needs an estimated {need / GiB:.2f} GiB" in msg
    assert "memory estimate (GiB per process)" in msg
    # Each option is estimated by building the experiment with it.
    assert "bf16 weights:" in msg and "actor.dtype=bfloat16" in msg
    assert "gradient checkpointing:" in msg and "actor.gradient_checkpointing=true" in msg
    assert "ref.dtype" not in msg  # only the roles the run has (no ref model without KL)
    assert "fits  (" in msg  # at least one option would fit
    assert "mb.max_tokens_per_mb=" in msg
    # memory_check=false (or another launcher) skips the check
    off = memory_plan.with_overrides(cfg, {"memory_check": False})
    memory_plan.check_fits("ppo-math", off, exp, qs.build, available=1)


def test_quickstart_refuses_before_creating_anything(tmp_path, capsys, no_leftover_processes):
    from tiny_models import long_context_copy

    # 4096 answers of 64k tokens each cannot fit on any machine this runs on (the model is
    # told it has the positions, or the run is refused for its context first).
    args = [
        "ppo-math",
        f"actor.path={long_context_copy(tmp_path / 'm', 131072)}",
        f"fileroot={tmp_path}",
        "train_batch_size=512",
        "ppo.group_size=8",
        "ppo.gen.max_new_tokens=65536",
    ]
    code = quickstart.main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "needs an estimated" in err and "nothing was started" in err
    assert not os.path.exists(tmp_path / "ppo-math"), os.listdir(tmp_path)
    no_leftover_processes(timeout=30)


def test_dry_run_prints_the_estimate(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert quickstart.main(["sft", f"fileroot={tmp_path}", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "memory estimate (GiB per process):" in out
    assert "all processes:" in out and "available on this host" in out


def _need(name, *args):
    qs, cfg, exp = _build(name, *args)
    return memory_plan.host_total(memory_plan.estimate(cfg, exp))


def test_unset_memory_options_stay_off_when_the_run_fits():
    qs = get_quickstart_exp("ppo-math")
    cfg = parse_config(qs.config_cls, ["train_batch_size=64"])
    assert cfg.actor.gradient_checkpointing is None and cfg.mb.max_tokens_per_mb is None
    exp, notes = memory_plan.choose_unset(cfg, qs.build, available=100 * GiB)
    assert notes == []
    assert cfg.actor.gradient_checkpointing is False and cfg.mb.max_tokens_per_mb is None
    assert all(not s.gradient_checkpointing for s in exp.workers["model_worker"][0].models)


def test_a_token_budget_is_chosen_before_checkpointing_when_the_run_would_not_fit():
    quickstart._load_experiments()
    qs = get_quickstart_exp("ppo-math")
    full = _need("ppo-math", "train_batch_size=64")
    small = _need("ppo-math", "train_batch_size=64", "mb.max_tokens_per_mb=2048")
    cfg = parse_config(qs.config_cls, ["train_batch_size=64"])
    exp, notes = memory_plan.choose_unset(cfg, qs.build, available=(full + small) // 2)
    assert cfg.actor.gradient_checkpointing is False  # micro-batches were enough
    budget = cfg.mb.max_tokens_per_mb
    assert budget in memory_plan.TOKEN_BUDGETS and budget >= 2048
    assert notes == [notes[0]] and f"mb.max_tokens_per_mb={budget} chosen" in notes[0]
    train = next(m for m in exp.workers["model_worker"][0].mfcs if m.name == "actor_train")
    assert train.mb_spec.max_tokens_per_mb == budget


def test_checkpointing_is_turned_on_when_the_budget_was_given():
    quickstart._load_experiments()
    qs = get_quickstart_exp("ppo-math")
    args = ["train_batch_size=64", "mb.max_tokens_per_mb=8192"]
    off = _need("ppo-math", *args, "actor.gradient_checkpointing=false")
    on = _need("ppo-math", *args, "actor.gradient_checkpointing=true")
    assert on < off
    cfg = parse_config(qs.config_cls, args)
    exp, notes = memory_plan.choose_unset(cfg, qs.build, available=(on + off) // 2)
    assert cfg.actor.gradient_checkpointing is True and cfg.mb.max_tokens_per_mb == 8192
    assert len(notes) == 1 and "gradient checkpointing turned on for actor" in notes[0]
    assert "critic" not in notes[0]  # only the run's models
    # What a user set explicitly is never changed, even when the run does not fit.
    cfg = parse_config(qs.config_cls, [*args, "actor.gradient_checkpointing=false"])
    _, notes = memory_plan.choose_unset(cfg, qs.build, available=(on + off) // 2)
    assert notes == [] and cfg.actor.gradient_checkpointing is False


def test_a_prompt_shared_by_a_group_is_counted_once():
    # 4 prompts of 136 tokens, 4 answers of 128 each: 4 x (136 + 4 x 128) tokens computed
    load = memory_plan.Workload(seq_len=264, seqs=16, shared_prompt=136, group=4)
    assert load.computed_tokens == 4 * (136 + 4 * 128)
    assert memory_plan.Workload(seq_len=264, seqs=16).computed_tokens == 16 * 264
