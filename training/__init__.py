"""Hydra entry points (main_sft.py, main_sync_ppo.py, main_async_ppo.py) and their YAML configs."""
