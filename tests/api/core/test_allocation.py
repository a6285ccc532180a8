"""allocation_mode parsing: layouts, decoupled generation, world sizes, errors, support check."""

import pytest

from realhf.api.core.allocation import (
    AllocationError,
    AllocationMode,
    ParallelismConfig,
    parse_allocation_mode,
    parse_parallelism,
)


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
        ("vllm.d1p1m1+d1p1m1", "unknown generation backend 'vllm'"),
        ("d1p1m1+d1p1m1", "needs a backend prefix"),
        ("sglang.d1p1m1", r"needs a trainer layout after '\+'"),
        ("gen.d1p1m1+d1p1m1+d1p1m1", r"more than one '\+'"),
        ("gen.d1p2m1+d1p1m1", "do not use pipeline parallelism; use d1p1m1"),
        ("gen.d1p1m1+d1q1m1", "trainer layout 'd1q1m1': unknown letter 'q'"),
        ("actor_gen:d4p1m1,*:d4p1m1", "per-MFC allocations"),
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
