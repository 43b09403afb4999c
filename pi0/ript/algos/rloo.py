"""RIPT's group statistics as pure functions: RLOO advantages (and their per-decision value-baselined form),
optimality labels, dynamic-sampling mask."""

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


def value_baselined_advantages(advantage: float, values: np.ndarray) -> np.ndarray:
    """An episode's RLOO advantage A and its decisions' values V (T,) -> per-decision advantages (T,):
    A_t = A - (V_t - V_0).

    The baseline of decision t is RLOO's (the other rollouts' mean reward from the same init state) moved by how much
    the value head thinks the episode's own earlier decisions changed the odds (V_t - V_0): with gamma = lambda = 1,
    A_t = R - b_t, and b_t depends only on s_t, s_0 and the other rollouts, so the policy gradient stays unbiased
    (the advantage estimate of PPO / GAE(lambda = 1), centred by RLOO; a constant V gives RLOO's A back).
    """
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1 or len(v) == 0:
        raise ValueError(f"values must be (T,) with T >= 1, got shape {v.shape}")
    return float(advantage) - (v - v[0])


def episode_mean_advantages(advantages: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Episodes' advantages A (E,) and window counts n (E,) -> each window's advantage (E,): A * mean(n) / n.

    With one window per decision, a per-window mean loss weights an episode by its length, and a failed episode runs
    to the step limit (2-3x the windows of a success on the arena), so the windows' advantages sum below 0 even where
    the episodes' sum to 0 (RLOO): the update pushes down the likelihood of everything it saw. Dividing by the length
    makes each episode count once, as GRPO (Shao et al. 2024) averages a sequence's token losses within the sequence;
    mean(n) keeps the overall scale. The windows' advantages then sum as the episodes' do (0 per RLOO group).
    """
    a, n = np.asarray(advantages, dtype=np.float64), np.asarray(lengths, dtype=np.float64)
    if a.shape != n.shape or a.ndim != 1:
        raise ValueError(f"advantages and lengths must be (E,) alike, got {a.shape} and {n.shape}")
    if (n <= 0).any():
        raise ValueError("every episode needs at least one window")
    return a * n.mean() / n if len(n) else a


def optimality_labels(advantages: np.ndarray, eps: float = 1e-9) -> np.ndarray:
    """Advantages (...) -> bool labels (...): positive iff A > 0 (an all-equal group has none)."""
    return np.asarray(advantages) > eps


def informative_groups(rewards: np.ndarray) -> np.ndarray:
    """Rewards (G, K) -> keep mask (G,): False for groups whose K rewards are all equal (dynamic sampling)."""
    r = np.asarray(rewards)
    return r.max(axis=1) != r.min(axis=1)
