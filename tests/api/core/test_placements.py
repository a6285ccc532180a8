"""Placements: which layout each MFC runs on and where each model lives (per-MFC
allocations), and the checks MasterWorkerConfig makes with them."""

import pytest

from realhf.api.cli_args import ExperimentControlConfig
from realhf.api.core.allocation import ParallelismConfig as P
from realhf.api.core.dfg import MFCDef
from realhf.api.core.model_api import FinetuneSpec
from realhf.api.core.worker_api import MasterWorkerConfig, Placements

BASE = P(data=4)
MFCS = [
    MFCDef("gen", "actor", "generate", "null", 4, output_keys=("x",)),
    MFCDef("rew", "actor", "inference", "null", 4, input_keys=("x",), output_keys=("r",)),
    MFCDef("train", "actor", "train_step", "null", 4, input_keys=("x", "r")),
]


def test_lookup_defaults_to_the_base_layout():
    pl = Placements(mfcs={"gen": P(4, 1, 1), "train": P(1, 2, 2)}, homes={"actor": P(1, 2, 2)})
    assert pl.of_mfc("gen", BASE) == P(4, 1, 1) and pl.of_mfc("rew", BASE) == BASE
    assert pl.home("actor", BASE) == P(1, 2, 2) and pl.home("ref", BASE) == BASE
    assert [pl.on_replica(m, BASE) for m in MFCS] == [True, True, False]
    # an MFC that reads no weights never needs a replica
    pl = Placements(mfcs=pl.mfcs, homes=pl.homes, weightless={"rew"})
    assert [pl.on_replica(m, BASE) for m in MFCS] == [True, False, False]
    # base first, then sorted: the order every worker creates process groups in
    assert [str(x) for x in pl.layouts(BASE)] == ["d4p1m1", "d1p2m2"]
    assert pl.per_mfc and pl.data_layout(BASE) == P()  # one data shard on worker 0
    assert not Placements().per_mfc and Placements().data_layout(BASE) == BASE
    assert Placements().describe(BASE) == "d4p1m1"


def _master(placements, n=4):
    return MasterWorkerConfig(
        seed=1,
        mfcs=MFCS,
        exp_ctrl=ExperimentControlConfig(),
        n_model_workers=n,
        train_batch_size=4,
        ft_spec=FinetuneSpec(1, 8, 4),
        placements=placements,
    )


@pytest.mark.parametrize(
    "pl, needle",
    [
        (Placements(mfcs={"gen": P(8, 1, 1)}), "needs 8 model workers; there are 4"),
        (Placements(mfcs={"nope": P()}), "mfcs names 'nope'"),
        (Placements(homes={"critic": P()}), "homes names 'critic'"),
        (
            Placements(mfcs={"train": P(2, 1, 1)}, homes={"actor": P(1, 2, 1)}),
            "a model trains where its optimizer state lives",
        ),
    ],
)
def test_master_config_rejects_placements_that_cannot_run(pl, needle):
    with pytest.raises(ValueError, match=needle):
        _master(pl)


def test_master_config_accepts_a_replica_layout():
    cfg = _master(Placements(mfcs={"gen": P(2, 1, 1)}, homes={"actor": BASE}))
    assert cfg.placements.on_replica(MFCS[0], cfg.layout)
