"""A reward marked ``cpu_bound`` that never returns, for tests/data/test_rewards.py: importable by
name in RewardRunner's worker processes."""

from __future__ import annotations

import os
import time


def hang(sample, trajectory):
    """Write this process's id to ``sample.metadata["pid_file"]``, then sleep past any timeout."""
    with open(sample.metadata["pid_file"], "w") as fh:
        fh.write(str(os.getpid()))
    time.sleep(600)
    return 1.0


hang.cpu_bound = True
