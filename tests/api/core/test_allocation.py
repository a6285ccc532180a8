"""allocation_mode parsing: layouts, decoupled generation, world sizes, errors, support check."""

import pytest

from realhf.api.core.allocation import (
    AllocationError,
    AllocationMode,
    ParallelismConfig,
    parse_allocation_mode,
    parse_parallelism,
)
from realhf.api.core.dfg import MFCDef


@pytest.mark.parametrize("s", ["d2p1m1", "p1m1d2", "m1d2p1", " d2p1m1 "])
def test_letters_in_any_order(s):
    assert parse_parallelism(s) == ParallelismConfig(data=2, pipe=1, tensor=1)


def test_trainer_only_mode():
    a = parse_allocation_mode("d4p2m3")
    assert a.train == ParallelismConfig(4, 2, 3) and a.gen is None and a.gen_backend is None
    assert not a.is_decoupled and a.n_gen_servers == 0
    assert (a.train_world_size, a.gen_world_size, a.world_size) == (24, 0, 24)
    assert str(a) == "d4p2m3" and parse_allocation_mode(str(a)) == a


@pytest.mark.parametrize("backend", ["gen", "sglang"])
def test_decoupled_mode(backend):
    a = parse_allocation_mode(f"{backend}.d4p1m2 + p2d2m1")
    assert a.gen_backend == backend and a.is_decoupled
    assert a.gen == ParallelismConfig(4, 1, 2) and a.train == ParallelismConfig(2, 2, 1)
    assert (a.n_gen_servers, a.gen_world_size, a.train_world_size, a.world_size) == (4, 8, 4, 12)
    assert str(a) == f"{backend}.d4p1m2+d2p2m1" and parse_allocation_mode(str(a)) == a


@pytest.mark.parametrize(
    "s, match",
    [
        ("", "non-empty string"),
        ("d2p1", r"missing \['m'\]"),
        ("d2p1m1d3", "'d' appears twice"),
        ("d2x1m1", "unknown letter 'x'"),
        ("d0p1m1", "degree d0 must be >= 1"),
        ("dp1m1", "not of the form dXpYmZ"),
        ("2d", "not of the form dXpYmZ"),
        ("tgi.d1p1m1+d1p1m1", "unknown generation backend 'tgi'"),
        ("d1p1m1+d1p1m1", "needs a backend prefix"),
        ("sglang.d1p1m1", r"needs a trainer layout after '\+'"),
        ("gen.d1p1m1+d1p1m1+d1p1m1", r"more than one '\+'"),
        ("gen.d1p2m1+d1p1m1", "do not use pipeline parallelism; use d1p1m1"),
        ("gen.d1p1m1+d1q1m1", "trainer layout 'd1q1m1': unknown letter 'q'"),
        ("actor_gen:d4p1m1,*:d4p1m1", "'\\*:d4p1m1' is not of the form 'mfc_name:dXpYmZ'"),
        ("actor_gen:d4p1m1,actor_train", "not of the form 'mfc_name:dXpYmZ'"),
        ("actor_gen:d4p1m1,actor_gen:d1p1m1", "MFC 'actor_gen' is listed twice"),
        ("actor_gen:d4p1m1,actor_train:d1p1", "layout of MFC 'actor_train' 'd1p1': missing"),
        ("heuristic", "not supported"),
    ],
)
def test_malformed_strings_name_the_bad_part_and_show_examples(s, match):
    with pytest.raises(AllocationError, match=match) as e:
        parse_allocation_mode(s)
    assert (
        "valid examples" in str(e.value)
        or "use d1p1m1" in str(e.value)
        or "non-empty" in str(e.value)
        or "listed twice" in str(e.value)
    )


def test_check_supported():
    parse_allocation_mode("d2p1m1").check_supported()
    parse_allocation_mode("gen.d2p1m1+d4p1m1").check_supported()
    # Any trainer layout: the builders check it against each model (check_layout).
    parse_allocation_mode("d1p2m1").check_supported()
    parse_allocation_mode("gen.d1p1m1+d2p2m2").check_supported()
    for s, part in [
        ("sglang.d1p1m2+d1p1m1", "generation layout d1p1m2"),
        ("gen.d1p1m2+d1p1m1", "generation layout d1p1m2"),
    ]:
        with pytest.raises(NotImplementedError, match=part) as e:
            parse_allocation_mode(s).check_supported()
        assert (
            "tensor/pipeline parallelism > 1 is not yet supported "
            "(coming with the parallelism milestone); use d<N>p1m1" in str(e.value)
        )


def test_typed_configs_validate():
    with pytest.raises(AllocationError, match="ParallelismConfig.tensor must be an integer >= 1"):
        ParallelismConfig(1, 1, 0)
    with pytest.raises(AllocationError, match="given together"):
        AllocationMode(train=ParallelismConfig(), gen=ParallelismConfig())


# ---- per-MFC layouts ------------------------------------------------------------------


def test_per_mfc_layouts_parse_and_span_the_widest():
    a = parse_allocation_mode("actor_gen:d4m1p1, actor_train:d1m2p2,ref_inf:d2m1p2")
    assert a.is_per_mfc and not a.is_decoupled
    assert a.mfc_layouts == {
        "actor_gen": ParallelismConfig(4, 1, 1),
        "actor_train": ParallelismConfig(1, 2, 2),
        "ref_inf": ParallelismConfig(2, 2, 1),
    }
    # The workers: as many as the widest layout, each a data shard.
    assert a.train == ParallelismConfig(data=4) and a.train_world_size == 4
    assert a.layout_of("ref_inf") == ParallelismConfig(2, 2, 1)
    assert a.layout_of("rew_inf") == a.train  # unlisted
    assert parse_allocation_mode(str(a)) == a
    d = parse_allocation_mode("gen.d2p1m1+actor_train:d1p2m1,actor_inf:d2p1m1")
    assert d.is_decoupled and d.is_per_mfc and d.n_gen_servers == 2
    assert d.train == ParallelismConfig(data=2) and d.world_size == 4
    assert str(d) == "gen.d2p1m1+actor_train:d1p2m1,actor_inf:d2p1m1"


def _mfc(name, role, kind, iface="ppo_actor"):
    out = () if kind == "train_step" else (f"{name}_out",)
    return MFCDef(
        name=name,
        model_name=role,
        interface_type=kind,
        interface_impl=iface,
        n_seqs=1,
        output_keys=out,
    )


GRAPH = [
    _mfc("actor_gen", "actor", "generate"),
    _mfc("rew_inf", "actor", "inference", "math_reward"),
    _mfc("ref_inf", "ref", "inference"),
    _mfc("actor_train", "actor", "train_step"),
]


def test_home_layouts_follow_training_and_weightless_mfcs_may_be_left_out():
    import realhf.impl.model.interface  # noqa: F401  (registers math_reward: uses no weights)

    a = parse_allocation_mode("actor_gen:d2p1m1,actor_train:d1p2m1,ref_inf:d1p1m1")
    homes = a.home_layouts(GRAPH)
    assert homes == {"actor": ParallelismConfig(1, 2, 1), "ref": ParallelismConfig(1, 1, 1)}
    # One global layout: every role lives there.
    g = parse_allocation_mode("d1p1m2")
    assert g.home_layouts(GRAPH) == {"actor": g.train, "ref": g.train}


@pytest.mark.parametrize(
    "s, match",
    [
        ("actor_gen:d2p1m1,actor_train:d1p2m1", r"gives no layout to \['ref_inf'\]"),
        (
            "actor_gen:d2p1m1,actor_train:d1p2m1,ref_inf:d1p1m1,critic_train:d1p1m1",
            r"lists \['critic_train'\], which this experiment does not run",
        ),
    ],
)
def test_per_mfc_layouts_are_checked_against_the_graph(s, match):
    import realhf.impl.model.interface  # noqa: F401

    with pytest.raises(AllocationError, match=match):
        parse_allocation_mode(s).home_layouts(GRAPH)


def test_a_model_trains_on_one_layout():
    graph = GRAPH + [_mfc("actor_train2", "actor", "train_step")]
    a = parse_allocation_mode(
        "actor_gen:d2p1m1,actor_train:d1p2m1,ref_inf:d1p1m1,actor_train2:d2p1m1"
    )
    with pytest.raises(AllocationError, match="both train model 'actor' but on different"):
        a.home_layouts(graph)
