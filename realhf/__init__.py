"""realhf: reinforcement learning for language models (PPO, GRPO, async PPO, SFT)."""

import os as _os

# Transparent huge pages for torch's large CPU tensors (>= 2 MB), before torch reads the
# variable (at its first allocation): glibc maps every allocation this large afresh, and on
# 4 KiB pages the page faults of a fresh [T, V] logits tensor or gradient cost several times
# the arithmetic on it (a 0.5B train step: 11.4 s -> 7.8 s).  THP_MEM_ALLOC_ENABLE=0 turns
# it off; processes a run starts inherit it.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# Give the package logger its handler first, so `logging.getLogger(__name__)` in any
# realhf module prints (formatted) from the first import on.
from realhf.base import logging as _logging  # noqa: F401
