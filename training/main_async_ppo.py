"""Hydra entry point for asynchronous PPO/GRPO: `python training/main_async_ppo.py [key=value ...]`.

Loads training/configs/async-ppo.yaml, applies hydra overrides, validates against
`realhf.experiments.async_ppo_math.AsyncPPOMathConfig` (unknown keys are errors) and runs it
locally: generation servers, the gserver manager, rollout workers and the trainer.
"""

import sys

import hydra

from realhf.apps.hydra_entry import run_from_hydra
from realhf.experiments.async_ppo_math import AsyncPPOMathConfig


@hydra.main(config_path="configs", config_name="async-ppo", version_base=None)
def main(cfg):
    sys.exit(run_from_hydra("async-ppo-math", AsyncPPOMathConfig, cfg))


if __name__ == "__main__":
    main()
