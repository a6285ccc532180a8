"""examples/custom_algorithm: REINFORCE with a moving-average baseline, as a plugin.

The end-to-end test runs the README's command exactly as written (plus options that make
the run a few short steps) through the CLI, from the repository root.
"""

import importlib
import json
import pathlib
import shlex

import pytest
import quickstart_runs
import torch

from realhf.api.cli_args import OptimizerConfig
from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
from realhf.api.core.model_api import FinetuneSpec, Model

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_algorithm" / "reinforce_baseline.py"
MODULE = "examples.custom_algorithm.reinforce_baseline"
SHORT = [
    "train_batch_size=4",
    "ppo.group_size=2",
    "ppo.gen.max_new_tokens=8",
    "exp_ctrl.benchmark_steps=2",
    "eval=false",
    "exp_ctrl.eval_at_start=false",
]


def readme_command() -> list:
    """The command of the README's "Writing your own algorithm" section."""
    text = (ROOT / "README.md").read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("python -m realhf.apps.quickstart")]
    (line,) = [ln for ln in lines if f"--import {MODULE}" in ln]
    return shlex.split(line)


def test_the_example_is_short():
    assert len(EXAMPLE.read_text().splitlines()) <= 120


@pytest.fixture
def reinforce(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # as `python -m` from the repository root
    return importlib.import_module(MODULE)


def test_train_step_favours_the_rewarded_answer_and_keeps_its_baseline(tmp_path, reinforce):
    import transformers
    from tiny_models import make_tiny_hf_model

    from realhf.impl.model import ReaLModel
    from realhf.impl.model.backend import TrainEngine
    from realhf.impl.model.interface import toolkit as tk

    tok = transformers.AutoTokenizer.from_pretrained(ROOT / "realhf" / "assets" / "tiny")
    net = ReaLModel.from_hf(make_tiny_hf_model("qwen2", tmp_path / "m", vocab_size=len(tok)))
    engine = TrainEngine(net, OptimizerConfig(lr=1e-2, weight_decay=0.0), FinetuneSpec(1, 8, 4))
    model = Model("actor", engine, tok, device="cpu")
    prompt = tok("Compute 40+2.").input_ids
    answers = [tok("\\boxed{42}").input_ids, tok("\\boxed{24}").input_ids]
    ids = [t for a in answers for t in prompt + a]
    data = SequenceSample.from_default(
        ids=["q0"],
        seqlens=[[len(prompt) + len(a) for a in answers]],
        data={
            "packed_input_ids": torch.tensor(ids),
            "prompt_mask": torch.tensor(
                [i < len(prompt) for a in answers for i in range(len(prompt) + len(a))]
            ),
            "rewards": torch.tensor([5.0, -5.0]),
        },
    )

    def answer_logprob(i):
        lp = tk.sample_logprobs(model, data, MicroBatchSpec()).data["logprobs"]
        cu = data.cu_seqlens("packed_input_ids")
        mask = tk.answer_mask(data.data["prompt_mask"], cu)
        per_seq = torch.split(
            torch.where(mask, lp, 0.0), [n - 1 for n in data.flat_seqlens("packed_input_ids")]
        )
        return float(per_seq[i].sum())

    algo = reinforce.ReinforceBaseline(decay=0.5)
    before = answer_logprob(0) - answer_logprob(1)
    for _ in range(3):
        stats = algo.train_step(model, data, MicroBatchSpec())
    assert answer_logprob(0) - answer_logprob(1) > before + 1.0
    assert model.version.global_step == 3
    assert stats["reinforce/reward"] == 0.0 and stats["reinforce/baseline"] == 0.0
    assert stats["reinforce/grad_norm"] > 0
    restored = reinforce.ReinforceBaseline()
    restored.load_state_dict(algo.state_dict())
    assert restored.baseline == algo.baseline == 0.0
    with pytest.raises(ValueError, match="decay=1.5"):
        reinforce.ReinforceBaseline(decay=1.5)


@pytest.mark.slow
def test_the_readme_command_runs(tmp_path):
    cmd = readme_command()
    assert cmd[:3] == ["python", "-m", "realhf.apps.quickstart"]
    r = quickstart_runs.run([*cmd[3:], *SHORT, f"fileroot={tmp_path}", "trial_name=t"], 300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    run = tmp_path / "ppo-math" / "t"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert "actor_train/reinforce/baseline" in row
        assert torch.isfinite(torch.tensor(row["actor_train/reinforce/loss"]))
        assert not any(k.startswith("actor_train/ppo_actor/") for k in row)
    assert "train_interface: reinforce_baseline" in (run / "config.yaml").read_text()


@pytest.mark.slow
def test_async_ppo_math_trains_with_the_plugin(tmp_path):
    # Every process imports the plugin: generation servers, manager, rollout workers, trainer.
    args = ["async-ppo-math", "--import", MODULE, "actor.train_interface=reinforce_baseline"]
    r = quickstart_runs.run([*args, *SHORT, f"fileroot={tmp_path}", "trial_name=t"], 300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    rows = (tmp_path / "async-ppo-math" / "t" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in rows] == [1, 2]
    assert all("actor_train/reinforce/baseline" in json.loads(line) for line in rows)


def test_the_example_takes_the_runs_temperature_and_group_size(reinforce):
    from realhf.api.cli_parser import parse_config
    from realhf.api.core.model_api import RolloutContext
    from realhf.api.core.registry import make_interface
    from realhf.experiments.ppo_math import PPOMathConfig, ppo_mfcs

    args = ["actor.train_interface=reinforce_baseline", "ppo.gen.temperature=0.6"]
    cfg = parse_config(PPOMathConfig, args + ["ppo.group_size=3"])
    (train,) = [m for m in ppo_mfcs(cfg, MicroBatchSpec()) if m.name == "actor_train"]
    algo = make_interface(train.interface_impl)
    assert algo.rollout == RolloutContext(group_size=3, temperature=0.6)
    assert algo.temperature == 0.6
