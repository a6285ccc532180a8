"""Hydra entry point for synchronous PPO/GRPO: `python training/main_sync_ppo.py [key=value ...]`.

Loads training/configs/sync-ppo.yaml, applies hydra overrides, validates against
`realhf.experiments.ppo_math.PPOMathConfig` (unknown keys are errors) and runs it locally.
"""

import sys

import hydra

from realhf.apps.hydra_entry import run_from_hydra
from realhf.experiments.ppo_math import PPOMathConfig


@hydra.main(config_path="configs", config_name="sync-ppo", version_base=None)
def main(cfg):
    sys.exit(run_from_hydra("ppo-math", PPOMathConfig, cfg))


if __name__ == "__main__":
    main()
