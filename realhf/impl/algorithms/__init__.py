"""Algorithms as small pure functions over packed tensors (PPO / GRPO losses, GAE, KL rewards,
advantage normalisation); interfaces in ``impl/model/interface`` wire them together."""
