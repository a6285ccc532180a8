"""Values given on a hydra command line reach the experiment config unchanged.

The entry point used to flatten hydra's parsed config into ``key=value`` strings and
parse them again as YAML, which corrupted strings that look like numbers, booleans,
comments or mappings, and split list items on their commas.
"""

import dataclasses
import os
import runpy
import sys
from typing import List

import pytest
from hydra import compose, initialize_config_dir

from realhf.apps import main as app_main
from realhf.apps.hydra_entry import config_from_hydra

TRAINING = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "training"
)

#: (hydra override, field, expected value); each was corrupted by the re-parse
TRICKY = [
    ("trial_name='010'", "trial_name", "010"),  # was the octal int 8
    ("trial_name='run #2'", "trial_name", "run #2"),  # was "run" (YAML comment)
    ("trial_name=yes", "trial_name", "yes"),  # was True
    ("trial_name='a: b'", "trial_name", "a: b"),  # was a YAML mapping error
]


@pytest.mark.parametrize("script", ["main_sft.py", "main_sync_ppo.py", "main_async_ppo.py"])
@pytest.mark.parametrize("override, field, expected", TRICKY)
def test_value_reaches_the_config_through_the_entry_script(
    script, override, field, expected, monkeypatch, tmp_path
):
    seen = {}

    def fake_run(name, cfg, **kwargs):
        seen["cfg"] = cfg
        return 0

    monkeypatch.setattr(app_main, "run", fake_run)
    argv = [script, override, f"hydra.run.dir={tmp_path}", "hydra.output_subdir=null"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exc:
        # as `python training/<script> ...` would: hydra finds configs/ beside a __main__ file
        runpy.run_path(os.path.join(TRAINING, script), run_name="__main__")
    assert exc.value.code == 0
    assert getattr(seen["cfg"], field) == expected


@dataclasses.dataclass
class _WithList:
    names: List[str] = dataclasses.field(default_factory=list)


def test_list_items_keep_their_commas(tmp_path):
    (tmp_path / "c.yaml").write_text("names: []\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        cfg = compose(config_name="c", overrides=["names=['x,y',z]"])
    assert config_from_hydra(_WithList, cfg).names == ["x,y", "z"]  # was ['x', 'y', 'z']
