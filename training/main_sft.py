"""Hydra entry point for SFT: `python training/main_sft.py [key=value ...]`.

Loads training/configs/sft.yaml, applies hydra overrides, validates against
`realhf.experiments.sft.SFTConfig` (unknown keys are errors) and runs it locally.
"""

import sys

import hydra

from realhf.apps.hydra_entry import run_from_hydra
from realhf.experiments.sft import SFTConfig


@hydra.main(config_path="configs", config_name="sft", version_base=None)
def main(cfg):
    sys.exit(run_from_hydra("sft", SFTConfig, cfg))


if __name__ == "__main__":
    main()
