"""RIPT's group statistics as pure functions: RLOO advantages, optimality labels, dynamic-sampling mask."""

from __future__ import annotations

import numpy as np


def rloo_advantages(rewards: np.ndarray) -> np.ndarray:
    """Rewards (G, K) -> leave-one-out advantages (G, K): A_k = R_k - (sum_j R_j - R_k) / (K - 1).

    as in RIPT-VLA (Tan et al. 2025) / RLOO: the baseline of sample k is the mean reward of the others.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2 or r.shape[1] < 2:
        raise ValueError(f"rewards must be (G, K) with K >= 2, got shape {r.shape}")
    k = r.shape[1]
    return r - (r.sum(axis=1, keepdims=True) - r) / (k - 1)


def optimality_labels(advantages: np.ndarray, eps: float = 1e-9) -> np.ndarray:
    """Advantages (...) -> bool labels (...): positive iff A > 0 (an all-equal group has none)."""
    return np.asarray(advantages) > eps


def informative_groups(rewards: np.ndarray) -> np.ndarray:
    """Rewards (G, K) -> keep mask (G,): False for groups whose K rewards are all equal (dynamic sampling)."""
    r = np.asarray(rewards)
    return r.max(axis=1) != r.min(axis=1)
