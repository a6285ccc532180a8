"""Dataflow graph: MFC validation, edge inference from keys, ordering, errors and exports."""

import pytest

from realhf.api.core.data_api import MicroBatchSpec
from realhf.api.core.dfg import DFGError, MFCDef, ModelInterfaceType, ModelName, build_graph
from realhf.api.core.registry import InterfaceAbstraction

TRAJ = ("packed_input_ids", "packed_logprobs", "prompt_mask", "seq_no_eos_mask")


def sync_ppo_mfcs(n=8):
    return [
        MFCDef(
            "actor_gen", "actor", "generate", "ppo_actor", n, ("packed_prompts", "task_ids"), TRAJ
        ),
        MFCDef(
            "ref_inf",
            "ref",
            "inference",
            "ppo_actor",
            n,
            ("packed_input_ids",),
            ("packed_ref_logprobs",),
            output_key_remap={"logprobs": "packed_ref_logprobs"},
        ),
        MFCDef(
            "rew_inf",
            "reward",
            "inference",
            "rw_math",
            n,
            ("packed_input_ids", "packed_prompts", "task_ids"),
            ("rewards",),
        ),
        MFCDef(
            "critic_inf",
            "critic",
            "inference",
            "ppo_critic",
            n,
            ("packed_input_ids", "seq_no_eos_mask"),
            ("values",),
        ),
        MFCDef(
            "actor_train",
            "actor",
            "train_step",
            InterfaceAbstraction("ppo_actor", {"eps_clip": 0.2}),
            n,
            TRAJ + ("packed_ref_logprobs", "rewards", "values", "task_ids"),
            (),
            log_return_value=True,
        ),
        MFCDef(
            "critic_train",
            "critic",
            "train_step",
            "ppo_critic",
            n,
            TRAJ + ("packed_ref_logprobs", "rewards", "values"),
            (),
        ),
    ]


def async_ppo_mfcs(n=8):
    return [
        MFCDef(
            "actor_inf",
            "actor",
            "inference",
            "ppo_actor",
            n,
            ("packed_input_ids",),
            ("proximal_logprobs",),
            output_key_remap={"logprobs": "proximal_logprobs"},
        ),
        MFCDef(
            "ref_inf",
            "ref",
            "inference",
            "ppo_actor",
            n,
            ("packed_input_ids",),
            ("packed_ref_logprobs",),
        ),
        MFCDef(
            "actor_train",
            "actor",
            "train_step",
            "ppo_actor",
            n,
            TRAJ
            + (
                "proximal_logprobs",
                "packed_ref_logprobs",
                "rewards",
                "version_start",
                "version_end",
            ),
            (),
        ),
    ]


def test_sync_ppo_graph_structure():
    g = build_graph(sync_ppo_mfcs())
    assert g.sources == ["actor_gen"]
    assert g.sinks == ["actor_train", "critic_train"]
    assert g.children("actor_gen") == [
        "ref_inf",
        "rew_inf",
        "critic_inf",
        "actor_train",
        "critic_train",
    ]
    assert g.parents("actor_train") == ["actor_gen", "ref_inf", "rew_inf", "critic_inf"]
    assert g.successors("actor_gen") == [
        "ref_inf",
        "rew_inf",
        "critic_inf",
        "actor_train",
        "critic_train",
    ]
    assert g.successors("ref_inf") == ["actor_train", "critic_train"]
    assert g.predecessors("critic_train") == ["actor_gen", "ref_inf", "rew_inf", "critic_inf"]
    assert g.levels() == [
        ["actor_gen"],
        ["ref_inf", "rew_inf", "critic_inf"],
        ["actor_train", "critic_train"],
    ]
    assert g.topological_order() == [
        "actor_gen",
        "ref_inf",
        "rew_inf",
        "critic_inf",
        "actor_train",
        "critic_train",
    ]
    assert g.dataset_keys == ("packed_prompts", "task_ids")
    assert g.producers["rewards"] == "rew_inf"
    assert g.consumers["values"] == ["actor_train", "critic_train"]
    assert g.edge_keys("actor_gen", "critic_inf") == ("packed_input_ids", "seq_no_eos_mask")
    assert g.edge_keys("ref_inf", "rew_inf") == ()
    assert g.is_source("actor_gen") and g.is_sink("critic_train") and not g.is_sink("ref_inf")
    assert g.model_names == [
        ModelName("actor"),
        ModelName("critic"),
        ModelName("ref"),
        ModelName("reward"),
    ]


def test_async_ppo_graph_reads_trajectories_from_the_dataset():
    g = build_graph(async_ppo_mfcs())
    assert g.levels() == [["actor_inf", "ref_inf"], ["actor_train"]]
    assert g.parents("actor_train") == ["actor_inf", "ref_inf"]
    assert set(g.dataset_keys) == set(TRAJ) | {"rewards", "version_start", "version_end"}
    assert g.edge_keys("actor_inf", "actor_train") == ("proximal_logprobs",)


def test_sft_graph_is_a_single_node():
    g = build_graph(
        [
            MFCDef(
                "trainDefault",
                "default",
                "train_step",
                "sft",
                64,
                ("packed_input_ids", "prompt_mask"),
            )
        ]
    )
    assert g.sources == g.sinks == ["trainDefault"]
    assert g.levels() == [["trainDefault"]] and g.dataset_keys == (
        "packed_input_ids",
        "prompt_mask",
    )
    assert g.successors("trainDefault") == [] and g.parents("trainDefault") == []


def test_mfc_normalises_strings_and_defaults():
    m = sync_ppo_mfcs()[1]
    assert m.model_name == ModelName("ref", 0) and m.role == "ref"
    assert m.interface_type is ModelInterfaceType.INFERENCE and not m.is_train
    assert m.interface_impl == InterfaceAbstraction("ppo_actor", {})
    assert isinstance(m.mb_spec, MicroBatchSpec) and m.mb_spec.n_mbs == 1
    m2 = MFCDef(
        "t",
        ModelName("actor", 1),
        ModelInterfaceType.TRAIN_STEP,
        "x",
        2,
        ["a"],
        mb_spec=MicroBatchSpec(n_mbs=2, max_tokens_per_mb=128),
    )
    assert m2.input_keys == ("a",) and m2.mb_spec.max_tokens_per_mb == 128 and m2.is_train


def test_model_name_is_frozen_ordered_and_rejects_at():
    assert sorted([ModelName("b", 0), ModelName("a", 1), ModelName("a", 0)]) == [
        ModelName("a", 0),
        ModelName("a", 1),
        ModelName("b", 0),
    ]
    assert str(ModelName("actor")) == "actor" and str(ModelName("actor", 2)) == "actor[2]"
    assert len({ModelName("a"), ModelName("a", 0)}) == 1
    with pytest.raises(AttributeError):
        ModelName("a").role = "b"
    with pytest.raises(DFGError, match="may not contain '@'"):
        ModelName("act@or")
    with pytest.raises(DFGError, match="replica_id"):
        ModelName("actor", -1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(interface_type="train"),
            r"'train' is not one of \['generate', 'inference', 'train_step'\]",
        ),
        (dict(n_seqs=0), "n_seqs must be an integer >= 1"),
        (
            dict(input_keys="packed_input_ids"),
            r"got the string 'packed_input_ids'; write \['packed_input_ids'\]",
        ),
        (dict(input_keys=("a", "a")), r"lists \['a'\] more than once"),
        (dict(output_keys=("a",)), r"reads and writes \['a'\]"),
        (dict(interface_type="inference", output_keys=()), "has no output_keys"),
        (
            dict(input_key_remap={"zzz": "y"}),
            r"renames buffer keys \['zzz'\] that are not in input_keys",
        ),
        (
            dict(output_keys=("b",), output_key_remap={"x": "c"}),
            r"\['c'\] that are not in output_keys",
        ),
        (dict(name="a@b"), "without '@'"),
        (dict(mb_spec=object()), "mb_spec.n_mbs must be an integer"),
        (dict(model_name=3), "model_name must be"),
    ],
)
def test_mfc_validation_errors(kwargs, match):
    base = dict(
        name="m",
        model_name="actor",
        interface_type="train_step",
        interface_impl="x",
        n_seqs=1,
        input_keys=("a",),
        output_keys=(),
    )
    base.update(kwargs)
    with pytest.raises(DFGError, match=match):
        MFCDef(**base)


def test_double_producer_names_key_and_both_mfcs():
    mfcs = sync_ppo_mfcs() + [
        MFCDef("rew2", "reward", "inference", "x", 8, ("packed_input_ids",), ("rewards",))
    ]
    with pytest.raises(DFGError, match="key 'rewards' is produced by both 'rew_inf' and 'rew2'"):
        build_graph(mfcs)


def test_cycle_is_reported_with_its_keys():
    mfcs = [
        MFCDef("src", "a", "inference", "x", 1, ("data",), ("k0",)),
        MFCDef("p", "a", "inference", "x", 1, ("k0", "k2"), ("k1",)),
        MFCDef("q", "b", "inference", "x", 1, ("k1",), ("k2",)),
    ]
    with pytest.raises(
        DFGError, match=r"cycle: (p -\[k1\]-> q; q -\[k2\]-> p|q -\[k2\]-> p; p -\[k1\]-> q)"
    ):
        build_graph(mfcs)


def test_duplicate_names_replica_ids_and_empty_graph():
    m = sync_ppo_mfcs()
    with pytest.raises(DFGError, match="two MFCs are named 'ref_inf'"):
        build_graph(m + [m[1]])
    with pytest.raises(DFGError, match=r"role 'actor' uses replica ids \[0, 2\]"):
        build_graph(m + [MFCDef("x", ModelName("actor", 2), "inference", "x", 1, ("a",), ("zz",))])
    with pytest.raises(DFGError, match="at least one MFC"):
        build_graph([])
    with pytest.raises(DFGError, match="no MFC named 'nope'"):
        build_graph(m).parents("nope")


def test_exports_mention_every_node_and_edge():
    g = build_graph(sync_ppo_mfcs())
    text = g.to_text()
    assert "level 1:" in text and "ref_inf: ref inference [ppo_actor] n_seqs=8" in text
    assert "after  rew_inf (rewards)" in text and text.startswith(
        "dataset keys: packed_prompts, task_ids"
    )
    dot = g.to_dot()
    assert dot.startswith("digraph dfg {") and dot.rstrip().endswith("}")
    assert '"actor_gen" -> "critic_inf" [label="packed_input_ids, seq_no_eos_mask"];' in dot
    assert '"dataset" -> "actor_gen" [label="packed_prompts, task_ids"];' in dot
    assert (
        dot.count(" -> ") == len(g.edges) + 3
    )  # dataset -> actor_gen, rew_inf, actor_train (task_ids)
    mer = g.to_mermaid()
    assert mer.startswith("flowchart TD") and 'rew_inf -- "rewards" --> actor_train' in mer
    assert sum(" --> " in line for line in mer.splitlines()) == len(g.edges) + 3


def test_dynamic_sampling_fill_phase_is_the_dropper_and_its_predecessors():
    mfcs = sync_ppo_mfcs()
    assert build_graph(mfcs).dropper is None and build_graph(mfcs).fill_phase == []
    mfcs[2].drops_items = True  # rew_inf
    g = build_graph(mfcs)
    assert g.dropper == "rew_inf"
    # ref_inf and critic_inf also follow actor_gen but run only on the kept items
    assert g.fill_phase == ["actor_gen", "rew_inf"]


def test_only_one_inference_mfc_may_drop_items():
    with pytest.raises(DFGError, match="train_step call cannot drop items"):
        MFCDef("t", "actor", "train_step", "x", 4, ("a",), drops_items=True)
    mfcs = sync_ppo_mfcs()
    mfcs[1].drops_items = mfcs[2].drops_items = True
    with pytest.raises(DFGError, match=r"\['ref_inf', 'rew_inf'\] all drop items"):
        build_graph(mfcs)
