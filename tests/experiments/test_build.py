"""Experiment builders: the DAG each option set compiles to, and early errors."""

import os
import shutil
import sys

import pytest
import torch
from tiny_models import make_tiny_hf_model

from realhf.api.cli_parser import parse_config
from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
from realhf.api.core.dfg import build_graph
from realhf.api.core.model_api import GroupSizeError, ModelInterface, RolloutContext
from realhf.api.core.registry import make_interface, register_interface
from realhf.experiments import building_blocks as blocks
from realhf.experiments.ppo_math import PPOMathConfig, build_ppo_math
from realhf.experiments.rw import RWConfig, build_rw
from realhf.experiments.sft import SFTConfig, build_sft


@pytest.fixture(scope="module")
def tiny_model():
    # The committed tiny model: building reads its config and tokenizer, never its weights'
    # values (a fresh one from examples/tiny/make_model.py cost a 9 s subprocess per worker).
    return blocks.TINY_MODEL


def _mfc_names(exp):
    return sorted(m.name for m in exp.workers["master_worker"][0].mfcs)


class Grouped(ModelInterface):
    """Told the run's group size and temperature; refuses batches of other groups."""

    def __init__(self, rollout: RolloutContext, scale: float = 1.0):
        self.rollout, self.scale = rollout, scale

    def train_step(self, model, data, mb_spec):
        self.rollout.check_groups(data, "tb_grouped")
        return {}


class OwnGroupSize(ModelInterface):
    """Takes the group size and temperature as options of its own (no ``rollout``)."""

    def __init__(self, group_size: int = 8, temperature: float = 1.0):
        self.group_size, self.temperature = group_size, temperature

    def train_step(self, model, data, mb_spec):
        return {}


register_interface("tb_grouped", Grouped)
register_interface("tb_own_group_size", OwnGroupSize)


def _worker_interface(exp, mfc: str):
    """The interface a model worker builds for ``mfc`` (as it does: from the abstraction)."""
    (m,) = [m for m in exp.workers["model_worker"][0].mfcs if m.name == mfc]
    return make_interface(m.interface_impl)


def test_default_ppo_is_grpo_without_critic_or_ref(tiny_model):
    exp = build_ppo_math(parse_config(PPOMathConfig, [f"actor.path={tiny_model}"]))
    assert _mfc_names(exp) == ["actor_gen", "actor_train", "rew_inf"]
    roles = [m.role for m in exp.workers["model_worker"][0].models]
    assert roles == ["actor"]


def test_full_ppo_graph(tiny_model):
    # Two minibatches make two optimizer steps per batch, so the proximal policy differs from
    # the train forward's and actor_inf must recompute it.
    cfg = parse_config(
        PPOMathConfig,
        [
            f"actor.path={tiny_model}",
            "ppo.kl_ctl=0.1",
            "ppo.disable_value=false",
            "ppo.use_decoupled_loss=true",
            "ppo.ppo_n_minibatches=2",
            "allocation_mode=d2p1m1",
        ],
    )
    exp = build_ppo_math(cfg)
    assert _mfc_names(exp) == [
        "actor_gen",
        "actor_inf",
        "actor_train",
        "critic_inf",
        "critic_train",
        "ref_inf",
        "rew_inf",
    ]
    assert len(exp.workers["model_worker"]) == 2
    g = build_graph(exp.workers["master_worker"][0].mfcs)
    assert g.dataset_keys == {"packed_prompts"} or set(g.dataset_keys) == {"packed_prompts"}
    train = next(m for m in exp.workers["master_worker"][0].mfcs if m.name == "actor_train")
    assert {"packed_ref_logprobs", "values", "proximal_logprobs", "rewards"} <= set(
        train.input_keys
    )


def test_decoupled_one_step_takes_proximal_from_train_forward(tiny_model):
    cfg = parse_config(
        PPOMathConfig,
        [
            f"actor.path={tiny_model}",
            "ppo.use_decoupled_loss=true",
            "ppo.ppo_n_minibatches=1",
            "ppo.recompute_logprob=false",
        ],
    )
    exp = build_ppo_math(cfg)
    assert "actor_inf" not in _mfc_names(exp)
    train = next(m for m in exp.workers["master_worker"][0].mfcs if m.name == "actor_train")
    assert "proximal_logprobs" not in train.input_keys


def test_torch_threads_default_shares_the_cores_and_can_be_set(tiny_model, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)

    def threads(*a):
        return [
            w.torch_num_threads
            for w in build_ppo_math(
                parse_config(PPOMathConfig, [f"actor.path={tiny_model}", *a])
            ).workers["model_worker"]
        ]

    assert threads() == [8]
    assert threads("allocation_mode=d2p1m1") == [4, 4]
    assert threads("allocation_mode=d2p1m1", "torch_threads=3") == [3, 3]


def test_sft_single_mfc(tiny_model):
    exp = build_sft(parse_config(SFTConfig, [f"model.path={tiny_model}"]))
    assert _mfc_names(exp) == ["trainDefault"]
    assert exp.workers["master_worker"][0].ft_spec.dataset_size == 4200


@pytest.mark.parametrize(
    "args, needle",
    [
        (["model.path=/no/such/dir"], "model directory '/no/such/dir' does not exist"),
        (["dataset.path=/no/such.jsonl"], "dataset file '/no/such.jsonl' does not exist"),
        (["allocation_mode=d1p1m3"], r"model 'default' .*m=3 does not divide n_q_heads=4"),
        (["allocation_mode=d1p9m1"], r"9 pipeline stages for 4 transformer layers"),
        (["allocation_mode=d64p1m1"], r"layout d64p1m1 needs d·p·m = 64 model worker"),
        (["allocation_mode=banana"], "allocation_mode"),
        (["allocation_mode=gen.d1p1m1+d1p1m1"], "has generation servers"),
    ],
)
def test_sft_setup_errors(tiny_model, args, needle):
    args = [a if "model.path" in a else a for a in args]
    if not any(a.startswith("model.path") for a in args):
        args = [f"model.path={tiny_model}"] + args
    with pytest.raises(blocks.ExperimentSetupError, match=needle):
        build_sft(parse_config(SFTConfig, args))


def test_malformed_dataset_row_named(tiny_model, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query_id": "a", "prompt": "x", "solutions": ["1"]}\n{"query_id": "b"}\n')
    with pytest.raises(blocks.ExperimentSetupError, match=r"bad.jsonl:2: missing field 'prompt'"):
        build_ppo_math(
            parse_config(PPOMathConfig, [f"actor.path={tiny_model}", f"dataset.path={bad}"])
        )


def test_trainer_layout_reaches_the_workers_and_the_master(tiny_model, monkeypatch):
    from realhf.api.core.allocation import ParallelismConfig
    from realhf.experiments.async_ppo_math import AsyncPPOMathConfig, build_async_ppo_math

    monkeypatch.setattr("os.cpu_count", lambda: 8)
    exp = build_sft(parse_config(SFTConfig, [f"model.path={tiny_model}", "allocation_mode=d2p1m2"]))
    layout = ParallelismConfig(2, 1, 2)
    workers, master = exp.workers["model_worker"], exp.workers["master_worker"][0]
    assert len(workers) == 4 and all(w.layout == layout for w in workers)
    assert master.layout == layout and master.n_model_workers == 4
    assert workers[0].torch_num_threads == 2  # the cores shared by d·p·m processes
    exp = build_async_ppo_math(
        parse_config(
            AsyncPPOMathConfig, [f"actor.path={tiny_model}", "allocation_mode=gen.d1p1m1+d1p1m2"]
        )
    )
    assert len(exp.workers["model_worker"]) == 2 and len(exp.workers["generation_server"]) == 1
    assert exp.workers["master_worker"][0].layout == ParallelismConfig(1, 1, 2)
    # A critic is checked like the actor (same body, value head).
    with pytest.raises(blocks.ExperimentSetupError, match=r"model 'actor' .*m=3 does not divide"):
        build_ppo_math(
            parse_config(
                PPOMathConfig,
                [f"actor.path={tiny_model}", "ppo.disable_value=false", "allocation_mode=d1p1m3"],
            )
        )


def test_each_process_gets_its_own_gpus_when_cuda_is_present(tiny_model, monkeypatch):
    """With CUDA the launchers give every model worker one device and every generation
    server m; the servers are launched first, so they take the first devices."""
    from realhf.api.core.system_api import Scheduling
    from realhf.experiments.async_ppo_math import AsyncPPOMathConfig, build_async_ppo_math

    def build(alloc):
        return build_async_ppo_math(
            parse_config(
                AsyncPPOMathConfig, [f"actor.path={tiny_model}", f"allocation_mode={alloc}"]
            )
        )

    assert build("gen.d1p1m1+d1p1m1").scheduling == {}  # no CUDA here: CPU processes
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 4)
    exp = build("gen.d2p1m1+d2p1m1")
    assert exp.scheduling_of("model_worker") == Scheduling(gpu=1)
    assert exp.scheduling_of("generation_server") == Scheduling(gpu=1)
    assert exp.ordered_types[0] == "generation_server"
    with pytest.raises(blocks.ExperimentSetupError, match=r"needs 5 CUDA devices \(1 for gen"):
        build("gen.d1p1m1+d2p1m2")


def test_generation_servers_and_the_trainer_share_one_gpu_with_memory_caps(
    tiny_model, monkeypatch, tmp_path
):
    """share_gpus: on one GPU the server and the trainer both get it (the local launcher
    hands devices out round-robin, servers first), each with its cap on the device's
    memory; where sharing cannot work the build says why."""
    from realhf.api.core.system_api import Scheduling
    from realhf.experiments.async_ppo_math import AsyncPPOMathConfig, build_async_ppo_math
    from realhf.scheduler.local import LocalScheduler

    def build(*args):
        cfg = parse_config(AsyncPPOMathConfig, [f"actor.path={tiny_model}", *args])
        return build_async_ppo_math(cfg)

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    with pytest.raises(blocks.ExperimentSetupError, match="needs 2 CUDA devices.*share_gpus"):
        build()
    exp = build("share_gpus=0.3")
    env = "REALHF_CUDA_MEMORY_FRACTION"
    assert exp.scheduling_of("generation_server") == Scheduling(gpu=1, env={env: "0.300"})
    assert exp.scheduling_of("model_worker") == Scheduling(gpu=1, env={env: "0.650"})
    with pytest.raises(blocks.ExperimentSetupError, match=r"with share_gpus needs 2 CUDA"):
        build("share_gpus=0.3", "allocation_mode=gen.d2p1m1+d1p1m1")
    for args, needle in [
        (["share_gpus=0.95"], r"not a fraction in \(0, 0.9\)"),
        (["share_gpus=0.3", "allocation_mode=vllm.d1p1m1+d1p1m1"], "vllm backend sizes"),
        (["share_gpus=0.3", "mode=slurm"], "mode=slurm gives each process"),
    ]:
        with pytest.raises(blocks.ExperimentSetupError, match=needle):
            build(*args)
    # The local launcher, one device: the server first, then the trainer, both on it.
    sched = LocalScheduler(str(tmp_path), gpu_devices=["0"])
    sched.fork = False
    try:
        show = [sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"]
        jobs = sched.submit("generation_server", show, gpus_per_process=1)
        jobs += sched.submit("model_worker", show, gpus_per_process=1)
        assert [j.env["CUDA_VISIBLE_DEVICES"] for j in jobs] == ["0", "0"]
    finally:
        sched.stop_all()


def test_a_process_caps_its_gpu_memory_as_the_launcher_says(monkeypatch):
    from realhf.base import constants

    calls = []
    monkeypatch.delenv(constants.CUDA_MEMORY_FRACTION_ENV, raising=False)
    assert constants.apply_cuda_memory_fraction() is None  # not shared: no cap
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(
        "torch.cuda.set_per_process_memory_fraction", lambda f, d=None: calls.append((f, d))
    )
    monkeypatch.setenv(constants.CUDA_MEMORY_FRACTION_ENV, "0.650")
    assert constants.apply_cuda_memory_fraction("cuda:0") == 0.65
    assert calls == [(0.65, "cuda:0")]
    for bad in ("lots", "1.5", "0"):
        monkeypatch.setenv(constants.CUDA_MEMORY_FRACTION_ENV, bad)
        with pytest.raises(ValueError, match="REALHF_CUDA_MEMORY_FRACTION"):
            constants.apply_cuda_memory_fraction()


# ---- per-MFC layouts (parameter reallocation) ------------------------------------------


def test_per_mfc_allocation_reaches_the_workers_and_the_master(tiny_model):
    from realhf.api.core.allocation import ParallelismConfig as P

    exp = build_ppo_math(
        parse_config(
            PPOMathConfig,
            [
                f"actor.path={tiny_model}",
                "ppo.kl_ctl=0.1",
                "allocation_mode=actor_gen:d2p1m1,actor_train:d1p2m1,ref_inf:d1p1m1",
            ],
        )
    )
    workers, master = exp.workers["model_worker"], exp.workers["master_worker"][0]
    assert len(workers) == 2 and master.n_model_workers == 2
    places = master.placements
    assert places == workers[0].placements
    # rew_inf uses no weights: left out, it runs on the workers' base layout
    assert places.mfcs == {"actor_train": P(1, 2, 1), "ref_inf": P(1, 1, 1)}
    assert places.homes == {"actor": P(1, 2, 1), "ref": P(1, 1, 1)}
    assert places.weightless == {"rew_inf"}
    assert master.layout == P(2, 1, 1)
    assert places.describe(master.layout).startswith("actor_train:d1p2m1,ref_inf:d1p1m1")


@pytest.mark.parametrize(
    "alloc, needle",
    [
        ("actor_gen:d2p1m1", r"gives no layout to \['actor_train'\]"),
        ("actor_gen:d2p1m1,actor_train:d1p1m1,critic_inf:d1p1m1", r"lists \['critic_inf'\]"),
        ("actor_gen:d64p1m1,actor_train:d1p1m1", "the layouts need 64 model worker processes"),
        ("actor_gen:d1p1m3,actor_train:d1p1m1", r"m=3 does not divide n_q_heads=4"),
        ("actor_gen:d1p1m1,actor_train:d1p9m1", r"9 pipeline stages for 4 transformer layers"),
        ("actor_gen:d1p1m1,actor_train:d1p1", r"layout of MFC 'actor_train' 'd1p1': missing"),
    ],
)
def test_per_mfc_allocation_errors_before_launch(tiny_model, alloc, needle):
    with pytest.raises(blocks.ExperimentSetupError, match=needle):
        build_ppo_math(
            parse_config(PPOMathConfig, [f"actor.path={tiny_model}", f"allocation_mode={alloc}"])
        )


def test_offload_is_for_models_that_do_not_train(tiny_model):
    exp = build_ppo_math(
        parse_config(
            PPOMathConfig, [f"actor.path={tiny_model}", "ppo.kl_ctl=0.1", "ref.offload=true"]
        )
    )
    specs = {m.role: m for m in exp.workers["model_worker"][0].models}
    assert specs["ref"].offload and not specs["actor"].offload
    with pytest.raises(ValueError, match="role 'actor' is trainable"):
        build_ppo_math(
            parse_config(PPOMathConfig, [f"actor.path={tiny_model}", "actor.offload=true"])
        )


@pytest.mark.slow
def test_rw_trains_with_the_lm_regulariser_by_default_and_refuses_what_cannot_serve_it(
    tmp_path,
):
    def reward_spec(exp):
        (spec,) = exp.workers["model_worker"][0].models
        (mfc,) = exp.workers["master_worker"][0].mfcs
        return spec, mfc.interface_impl.args

    exp = build_rw(parse_config(RWConfig, []))
    spec, args = reward_spec(exp)
    assert spec.is_critic and spec.critic_lm_logits and args == {"lm_coef": 3.0}
    train = exp.workers["model_worker"][0].dataset.args["dataset_path"]
    assert train.endswith("pairs_rw_train.jsonl")
    spec, args = reward_spec(build_rw(parse_config(RWConfig, ["lm_coef=0"])))
    assert spec.is_critic and not spec.critic_lm_logits and args == {"lm_coef": 0.0}
    with pytest.raises(blocks.ExperimentSetupError, match="p1, or lm_coef=0"):
        build_rw(parse_config(RWConfig, ["allocation_mode=d1p2m1"]))
    # an untied model's critic has no LM head to regularise
    untied = make_tiny_hf_model("llama", tmp_path / "untied", vocab_size=268)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(blocks.task_model("tiny_arith"), f), untied)
    with pytest.raises(blocks.ExperimentSetupError, match="not tied.*lm_coef=0"):
        build_rw(parse_config(RWConfig, [f"model.path={untied}"]))
    build_rw(parse_config(RWConfig, [f"model.path={untied}", "lm_coef=0"]))


@pytest.mark.parametrize("exp_name", ["ppo-math", "async-ppo-math"])
def test_a_custom_interface_receives_the_runs_group_size_and_temperature(tiny_model, exp_name):
    from realhf.experiments.async_ppo_math import AsyncPPOMathConfig, build_async_ppo_math

    cls, build = {
        "ppo-math": (PPOMathConfig, build_ppo_math),
        "async-ppo-math": (AsyncPPOMathConfig, build_async_ppo_math),
    }[exp_name]
    args = [f"actor.path={tiny_model}", "actor.train_interface=tb_grouped"]
    args += ["actor.train_interface_args.scale=2.0", "ppo.group_size=4", "ppo.gen.temperature=0.7"]
    exp = build(parse_config(cls, args))
    algo = _worker_interface(exp, "actor_train")
    assert isinstance(algo, Grouped) and algo.scale == 2.0
    assert algo.rollout == RolloutContext(group_size=4, temperature=0.7)
    # A batch whose prompts hold another number of answers is refused, naming the counts.
    data = SequenceSample.from_default(
        ids=["p0", "p1"], seqlens=[[3] * 4, [3] * 3], data={"packed_input_ids": torch.arange(21)}
    )
    with pytest.raises(
        GroupSizeError, match=r"tb_grouped expects group_size=4 .* item 'p1' holds 3 sequences"
    ):
        algo.train_step(None, data, MicroBatchSpec())


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["actor.train_interface_args.group_size=2"],
            r"actor.train_interface='tb_own_group_size' \(actor.train_interface_args.group_size\) "
            r"assumes group_size=2, but this run's group_size is 8; remove "
            r"actor.train_interface_args.group_size or set ppo.group_size to 2",
        ),
        (
            ["ppo.gen.temperature=0.7"],
            r"\(its default temperature\) assumes temperature=1.0, but this run's temperature "
            r"is 0.7; pass actor.train_interface_args.temperature=0.7 or set "
            r"ppo.gen.temperature \(or ppo.temperature\) to 1.0, or declare a `rollout` parameter",
        ),
    ],
)
def test_an_interface_assuming_another_group_size_is_refused_at_build(tiny_model, args, needle):
    base = [f"actor.path={tiny_model}", "actor.train_interface=tb_own_group_size"]
    cfg = parse_config(PPOMathConfig, base + ["ppo.group_size=8", *args])
    with pytest.raises(ValueError, match=needle):
        build_ppo_math(cfg)
    # The same values given again are accepted; the interface then gets no `rollout`.
    agreed = [
        "actor.train_interface_args.group_size=8",
        "actor.train_interface_args.temperature=1.0",
    ]
    exp = build_ppo_math(parse_config(PPOMathConfig, base + ["ppo.group_size=8", *agreed]))
    assert vars(_worker_interface(exp, "actor_train")) == {"group_size": 8, "temperature": 1.0}


def test_generation_servers_reserve_the_kv_the_run_can_ask_for(tmp_path):
    """Empty gen_server.max_running_requests / context_length size a server's KV slots by
    the run (answers in flight; longest prompt + answers + feedback), not by the model's
    32k-position limit; set values are kept."""

    from tiny_models import long_context_copy

    from realhf.experiments.async_ppo_math import (
        FEEDBACK_TOKENS,
        AsyncPPOMathConfig,
        build_async_ppo_math,
    )

    model = long_context_copy(tmp_path / "m")  # a real model's 32k positions

    def server(*args):
        exp = build_async_ppo_math(parse_config(AsyncPPOMathConfig, [f"actor.path={model}", *args]))
        return exp.workers["generation_server"][0]

    s = server("train_batch_size=4", "ppo.group_size=4", "ppo.gen.max_new_tokens=64")
    assert s.max_running_requests == 16
    assert s.context_length == 1024 + 64  # dataset.max_prompt_len + max_new_tokens
    s = server(
        "train_batch_size=4",
        "ppo.group_size=4",
        "max_concurrent_rollouts=8",
        "max_turns=3",
        "dataset.max_prompt_len=100",
    )
    assert s.max_running_requests == 32
    assert s.context_length == 100 + 3 * 16 + 2 * FEEDBACK_TOKENS
    s = server("train_batch_size=64", "ppo.group_size=8", "dataset.max_prompt_len=40000")
    assert s.max_running_requests == 256 and s.context_length == 32768  # the caps
    s = server("gen_server.max_running_requests=3", "gen_server.context_length=77")
    assert (s.max_running_requests, s.context_length) == (3, 77)


def test_weight_sync_reaches_the_trainer_and_the_manager_and_shm_is_refused_where_it_cannot_work():
    from realhf.experiments.async_ppo_math import AsyncPPOMathConfig, build_async_ppo_math

    def build(*args):
        return build_async_ppo_math(parse_config(AsyncPPOMathConfig, list(args)))

    exp = build("weight_sync=shm")
    manager = exp.workers["gserver_manager"][0]
    assert manager.weight_sync == "shm" and manager.keep_weight_versions == 1
    actor = next(m for m in exp.workers["model_worker"][0].models if m.role == "actor")
    assert actor.publish_weights and actor.weight_sync == "shm"
    assert build().workers["gserver_manager"][0].weight_sync == "disk"
    with pytest.raises(ValueError, match="weight_sync='nvlink': use one of disk, shm"):
        build("weight_sync=nvlink")
    # vLLM's worker maps them too (realhf.system.rollout.vllm_worker_ext), but not adapters
    vllm = build("weight_sync=shm", "allocation_mode=vllm.d1p1m1+d1p1m1")
    assert vllm.workers["gserver_manager"][0].weight_sync == "shm"
    for mode in ("shm", "broadcast"):
        with pytest.raises(blocks.ExperimentSetupError, match="vLLM loads LoRA adapters from"):
            build(f"weight_sync={mode}", "allocation_mode=vllm.d1p1m1+d1p1m1", "actor.lora.rank=4")
    with pytest.raises(blocks.ExperimentSetupError, match="the sglang backend cannot map"):
        build("weight_sync=shm", "allocation_mode=sglang.d1p1m1+d1p1m1")
    with pytest.raises(blocks.ExperimentSetupError, match="mode=slurm may place servers"):
        build("weight_sync=shm", "mode=slurm")
    # broadcast works across hosts, with the built-in engine and vLLM
    exp = build("weight_sync=broadcast", "mode=slurm")
    assert exp.workers["gserver_manager"][0].weight_sync == "broadcast"
    actor = next(m for m in exp.workers["model_worker"][0].models if m.role == "actor")
    assert actor.publish_weights and actor.weight_sync == "broadcast"
    exp = build("weight_sync=broadcast", "allocation_mode=vllm.d1p1m1+d1p1m1")
    assert exp.workers["gserver_manager"][0].weight_sync == "broadcast"
    with pytest.raises(blocks.ExperimentSetupError, match="the sglang backend does not"):
        build("weight_sync=broadcast", "allocation_mode=sglang.d1p1m1+d1p1m1")


def test_a_lora_actors_reference_is_its_base_and_bad_lora_options_are_refused(tiny_model):
    base = [f"actor.path={tiny_model}", "ppo.kl_ctl=0.1", "actor.lora.rank=8"]
    exp = build_ppo_math(parse_config(PPOMathConfig, base))
    specs = {m.role: m for m in exp.workers["model_worker"][0].models}
    assert specs["actor"].has_lora and specs["actor"].lora.rank == 8
    assert specs["ref"].adapters_of == "actor" and not specs["ref"].has_lora
    # A critic trains adapters (and its value head) too.
    exp = build_ppo_math(
        parse_config(PPOMathConfig, base + ["ppo.disable_value=false", "critic.lora.rank=4"])
    )
    specs = {m.role: m for m in exp.workers["model_worker"][0].models}
    assert specs["critic"].has_lora and specs["critic"].is_critic
    # A ref with weights of its own is a model of its own.
    own = build_ppo_math(parse_config(PPOMathConfig, base + [f"ref.path={tiny_model}"]))
    assert {m.role: m for m in own.workers["model_worker"][0].models}["ref"].adapters_of is None
    bad = [
        (["ref.lora.rank=4"], "role 'ref' does not train.*set ref.lora.rank=0"),
        (["actor.lora.rank=-2"], r"lora.rank=-2: use a positive integer"),
        (["actor.lora.target_modules=[q_proj,qkv]"], r"unknown \['qkv'\]"),
        (["actor.lora.dropout=1.5"], r"lora.dropout=1.5"),
        (
            ["allocation_mode=actor_gen:d2p1m1,actor_train:d1p1m1,ref_inf:d1p1m1,rew_inf:d1p1m1"],
            "reallocation does not carry adapters yet",
        ),
    ]
    for args, needle in bad:
        with pytest.raises(ValueError, match=needle):
            build_ppo_math(parse_config(PPOMathConfig, base + args))


def test_a_lora_async_run_gives_its_servers_the_adapters_shape_and_sglang_is_refused():
    from realhf.experiments.async_ppo_math import AsyncPPOMathConfig, build_async_ppo_math

    def build(*args):
        return build_async_ppo_math(parse_config(AsyncPPOMathConfig, list(args)))

    for alloc, backend in (("gen.d1p1m1+d1p1m1", "builtin"), ("vllm.d1p1m1+d1p1m1", "vllm")):
        exp = build("actor.lora.rank=16", f"allocation_mode={alloc}")
        (server,) = exp.workers["generation_server"]
        assert server.lora.rank == 16 and server.backend == backend
    assert build().workers["generation_server"][0].lora is None
    with pytest.raises(blocks.ExperimentSetupError, match="SGLang backend takes no adapter"):
        build("actor.lora.rank=16", "allocation_mode=sglang.d1p1m1+d1p1m1")


def test_a_dataset_with_images_gives_every_model_mfc_the_image_keys():
    from realhf.api.core.data_api import IMAGE_KEYS
    from realhf.experiments.async_ppo_math import AsyncPPOMathConfig, build_async_ppo_math

    exp = build_ppo_math(parse_config(PPOMathConfig, ["task=tiny_visual", "ppo.kl_ctl=0.1"]))
    mfcs = exp.workers["master_worker"][0].mfcs
    assert {m.name for m in mfcs} == {"actor_gen", "rew_inf", "ref_inf", "actor_train"}
    for mfc in mfcs:
        reads_model = mfc.name != "rew_inf"  # (the verifier reads only the answers' text)
        assert (set(IMAGE_KEYS) <= set(mfc.input_keys)) == reads_model, mfc.name
    with pytest.raises(blocks.ExperimentSetupError, match="has images.*vllm backend"):
        build_async_ppo_math(
            parse_config(
                AsyncPPOMathConfig, ["task=tiny_visual", "allocation_mode=vllm.d1p1m1+d1p1m1"]
            )
        )


@pytest.mark.parametrize("exp", ["ppo-math", "async-ppo-math"])
def test_a_prompt_and_answer_past_the_models_positions_are_refused_before_launch(exp):
    """The embedded model has 256 positions: answers of 512 tokens cannot fit after any
    prompt, and the run used to start and fail at its first request (HTTP 400)."""
    from realhf.experiments.async_ppo_math import AsyncPPOMathConfig, build_async_ppo_math
    from realhf.experiments.ppo_math import PPOMathConfig, build_ppo_math

    cls, build = {
        "ppo-math": (PPOMathConfig, build_ppo_math),
        "async-ppo-math": (AsyncPPOMathConfig, build_async_ppo_math),
    }[exp]
    with pytest.raises(blocks.ExperimentSetupError) as e:
        build(parse_config(cls, ["ppo.gen.max_new_tokens=512"]))
    msg = str(e.value)
    assert "train.jsonl: its longest prompt has 8 tokens" in msg, msg
    assert "would reach 520 tokens, past the 256 positions of the model at" in msg
    assert "set ppo.gen.max_new_tokens=248" in msg and "dataset.max_prompt_len" not in msg
    # the greedy eval's budget too; a prompt limit is offered where it can help
    with pytest.raises(blocks.ExperimentSetupError) as e:
        build(parse_config(cls, ["dataset.eval_max_new_tokens=250"]))
    msg = str(e.value)
    assert "eval.jsonl" in msg and "set dataset.eval_max_new_tokens=" in msg, msg
    assert "set dataset.max_prompt_len=6 to drop the longer prompts" in msg
    build(parse_config(cls, ["ppo.gen.max_new_tokens=240"]))  # 8 + 240 fits
