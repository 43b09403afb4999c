"""Episode rewards for RIPT: the binary task-success reward."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pi0.rollout import Episode


class BinarySuccessReward:
    """Episode -> 1.0 if the env reported success (latched ``info["success"]``), else 0.0."""

    def __call__(self, episode: Episode) -> float:
        """Reward of one episode."""
        return 1.0 if episode.success else 0.0

    def group_rewards(self, episodes: Sequence[Episode], group_size: int) -> np.ndarray:
        """Episodes in request order (group-major) -> rewards (G, K)."""
        if group_size < 1 or len(episodes) % group_size:
            raise ValueError(f"{len(episodes)} episodes do not split into groups of {group_size}")
        return np.array([self(e) for e in episodes], dtype=np.float64).reshape(-1, group_size)
