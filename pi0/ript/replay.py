"""``WindowReplay``: a FIFO of past rollout windows that each RL update samples from (``RLConfig.replay_windows``).

With a frozen behaviour policy (``RLConfig.behavior="frozen"``) every window collected since the last refresh is a
sample of the same fixed reference, so the targets of both CFG branches do not go stale while they wait in the
buffer: the update can draw its minibatches from many init states instead of the B states of this iteration. With
``behavior="current"`` the older windows come from older policies (off-policy, as a replay buffer in DQN or the
successes of self-imitation learning).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from pi0.ript.algos.rl_optimizers.pi0_cfg_interface import Window


class WindowReplay:
    """The last ``capacity`` windows added; :meth:`sample` draws uniformly without replacement (if it can)."""

    def __init__(self, capacity: int, seed: int = 0):
        if capacity < 1:
            raise ValueError(f"replay capacity must be >= 1 window, got {capacity}")
        self.capacity = int(capacity)
        self.items: deque[Window] = deque(maxlen=self.capacity)
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return len(self.items)

    def add(self, windows: Sequence[Window]) -> None:
        """Append ``windows``; the oldest ones fall out past the capacity."""
        self.items.extend(windows)

    def clear(self) -> None:
        """Drop every window (the behaviour policy changed)."""
        self.items.clear()

    def sample(self, n: int) -> list[Window]:
        """``n`` windows drawn uniformly (without replacement while ``n`` <= the buffer's size)."""
        if not self.items or n <= 0:
            return []
        idx = self.rng.choice(len(self.items), n, replace=n > len(self.items))
        return [self.items[i] for i in idx]

    def state_dict(self) -> dict[str, Any]:
        """The windows and the sampling RNG (for resumable checkpoints)."""
        return {"capacity": self.capacity, "items": list(self.items), "rng": self.rng.bit_generator.state}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""
        self.items = deque(st["items"], maxlen=self.capacity)
        self.rng.bit_generator.state = st["rng"]
