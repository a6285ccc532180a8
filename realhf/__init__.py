"""realhf: reinforcement learning for language models (PPO, GRPO, async PPO, SFT)."""

# Give the package logger its handler first, so `logging.getLogger(__name__)` in any
# realhf module prints (formatted) from the first import on.
from realhf.base import logging as _logging  # noqa: F401
