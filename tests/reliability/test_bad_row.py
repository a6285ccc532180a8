"""A dataset row that loads but cannot be graded mid-run: skipped and named, never a hang.

Before: in ppo-math a row with ``"solutions": [42]`` failed the run with a bare TypeError
from the verifier (no row named) as soon as an answer had a readable final answer, and
``recover_mode=auto`` relaunched into the same failure; in async-ppo-math it failed the
rollout worker the same way; a row whose solutions hold no readable answer (``\\boxed{}``)
was graded wrong forever, silently.  Now (both paths) the row is skipped with a warning
naming it, counted, and the run fails naming the rows only once more than
``dataset.max_bad_row_fraction`` of the rows used were bad.
"""

from __future__ import annotations

import json

import pytest
import quickstart_runs as qs
from file_faults import inject

from realhf.experiments.building_blocks import TINY_MODEL, TINY_TRAIN


def _dataset(tmp_path, how="unparsable", n=4, bad_row=1):
    """The first ``n`` rows of the embedded data, row ``bad_row`` made ungradable."""
    with open(TINY_TRAIN) as f:
        rows = [next(f) for _ in range(n)]
    src = tmp_path / "src.jsonl"
    src.write_text("".join(rows))
    return inject("bad_row", src, how=how, row=bad_row, out=tmp_path / f"{how}.jsonl")


@pytest.mark.parametrize("how", ["unparsable", "not_string", "no_solutions"])
def test_the_bad_row_loads_and_fails_only_when_graded(tmp_path, how):
    import transformers

    from realhf.impl.dataset.math_dataset import MathPromptDataset
    from realhf.impl.reward.math_reward import UngradableRow, reference_answers

    fault = _dataset(tmp_path, how)
    tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL)
    if how == "no_solutions":  # the loader refuses this one up front (the better outcome)
        with pytest.raises(Exception, match=f"{fault.row_id}.*non-empty 'solutions'"):
            MathPromptDataset(fault.path, tok)
        return
    items = {s.ids[0]: s for s in MathPromptDataset(fault.path, tok).items}
    with pytest.raises(UngradableRow):
        reference_answers(items[fault.row_id].metadata["solutions"][0])


COMMON = [
    "train_batch_size=2",
    "ppo.group_size=2",
    "ppo.gen.max_new_tokens=4",
    "exp_ctrl.benchmark_steps=2",
    "exp_ctrl.save_freq_epochs=null",
    "eval=false",
]


def _metrics(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_ppo_math_skips_the_row_names_it_and_counts_it(tmp_path, no_leftover_processes):
    fault = _dataset(tmp_path)  # 4 rows, 2 steps of 2: the bad row is used in step 1 or 2
    out = qs.finish(
        qs.start("ppo-math", COMMON + [f"dataset.path={fault.path}"], tmp_path), timeout=300
    )
    run_dir = tmp_path / "ppo-math" / "t"
    log = (run_dir / "logs" / "model_worker_0.log").read_text()
    assert f"skipping dataset row {fault.row_id!r}" in log, out[-3000:]
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert sum(r["rew_inf/math_reward/bad_rows"] for r in rows) == 1
    assert sum(r["actor_train/ppo/n_unscored_seqs"] for r in rows) == 2  # its group of 2


@pytest.mark.slow
def test_async_ppo_math_skips_the_row_and_names_it(tmp_path, no_leftover_processes):
    fault = _dataset(tmp_path)
    qs.finish(
        qs.start("async-ppo-math", COMMON + [f"dataset.path={fault.path}"], tmp_path),
        timeout=300,
    )
    run_dir = tmp_path / "async-ppo-math" / "t"
    log = (run_dir / "logs" / "rollout_worker_0.log").read_text()
    assert f"skipping dataset row {fault.row_id!r}" in log
    assert [r["step"] for r in _metrics(run_dir)] == [1, 2]
