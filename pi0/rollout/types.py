"""Data types of the rollout engine: the chunk-policy protocol, episode requests and records.

Nothing here imports torch; everything is numpy so records can cross process boundaries cheaply.
Env conventions (camera keys, wait action, ``upright``) live in :mod:`pi0.envs.conventions`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "ChunkPolicy",
    "DecisionPoint",
    "Episode",
    "EpisodeRequest",
    "PolicyOutput",
    "RunStats",
]


@dataclass
class PolicyOutput:
    """Output of one batched policy call.

    ``actions``: ``(n, H, action_dim)`` env-space action chunks, one per observation.
    ``extras``: per-sample arrays with leading dim ``n`` (model inputs, normalized actions, noise,
    log-probs, ...); the runner slices them per sample and stores them with the decision point.
    """

    actions: np.ndarray
    extras: dict[str, np.ndarray] = field(default_factory=dict)

    def validate(self, n: int) -> None:
        """Raise ValueError unless ``actions`` is ``(n, H, A)`` and every extra has leading dim ``n``."""
        a = self.actions
        if not isinstance(a, np.ndarray) or a.ndim != 3 or a.shape[0] != n or a.shape[1] < 1:
            raise ValueError(f"PolicyOutput.actions must be a ({n}, H>=1, action_dim) ndarray, got "
                             f"{getattr(a, 'shape', type(a))}")
        for key, value in self.extras.items():
            if not hasattr(value, "shape") or len(value) != n:
                raise ValueError(f"PolicyOutput.extras[{key!r}] must have leading dim {n}, got "
                                 f"{getattr(value, 'shape', type(value))}")


@runtime_checkable
class ChunkPolicy(Protocol):
    """A policy that maps a batch of raw env observations + prompts to action chunks."""

    def predict_chunks(self, obs: list[dict[str, np.ndarray]], prompts: list[str]) -> PolicyOutput:
        """Predict ``(n, H, action_dim)`` env-space chunks for ``n`` raw observation dicts."""
        ...


@dataclass
class EpisodeRequest:
    """One requested episode: ``(task_id, init_state_id)`` and its sample index ``k`` in the group.

    ``index`` is the position in the flattened request list (``group_index * group_size + k``);
    ``attempts`` counts how many times the episode was (re)started (> 1 after a worker crash).
    """

    index: int
    task_id: int
    init_state_id: int
    sample_index: int = 0
    group_index: int = 0
    attempts: int = 0

    @property
    def key(self) -> tuple[int, int, int]:
        """``(task_id, init_state_id, sample_index)``."""
        return (self.task_id, self.init_state_id, self.sample_index)


@dataclass
class DecisionPoint:
    """One policy decision inside an episode.

    ``obs``: the raw env observation dict given to the policy (with images).
    ``actions``: ``(replan_steps, action_dim)`` executed action chunk; rows past the end of the
    episode (or past a step cap) are zero padding, marked False in ``valid`` ``(replan_steps,)``.
    ``rewards``: ``(replan_steps,)`` per-step env rewards (0 on padding).
    ``extras``: this sample's slice of the policy extras.
    ``step``: env step index (0-based, settle steps excluded) at which the decision was taken.
    """

    step: int
    obs: dict[str, np.ndarray]
    actions: np.ndarray
    valid: np.ndarray
    rewards: np.ndarray
    extras: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def num_executed(self) -> int:
        """Number of actions of this chunk that were executed."""
        return int(self.valid.sum())


@dataclass
class Episode:
    """Record of one finished episode (see :class:`DecisionPoint` for the per-decision data).

    ``length`` is the number of env steps executed by the policy (settle/wait steps excluded);
    ``success`` is the env's latched ``info["success"]``; ``total_reward`` the sum of rewards.
    ``frames``: upright agentview frames (decision points, or every step with
    ``video_every_step``) when the runner records video, else None.
    ``attempts``: 1 for an uninterrupted episode, > 1 if it was re-run after a worker failure.
    """

    index: int
    task_id: int
    init_state_id: int
    sample_index: int
    group_index: int
    prompt: str
    success: bool
    length: int
    total_reward: float
    terminated: bool
    truncated: bool
    decisions: list[DecisionPoint]
    frames: list[np.ndarray] | None = None
    attempts: int = 1
    worker_index: int = -1
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[int, int, int]:
        """``(task_id, init_state_id, sample_index)``."""
        return (self.task_id, self.init_state_id, self.sample_index)

    @property
    def num_decisions(self) -> int:
        """Number of policy decisions in the episode."""
        return len(self.decisions)

    def stacked(self) -> dict[str, Any]:
        """Decision data stacked along a leading ``D`` (= num decisions) axis.

        Returns ``{"obs": {key: (D, ...)}, "actions": (D, R, A), "valid": (D, R), "rewards": (D, R),
        "steps": (D,), "extras": {key: (D, ...)}}``.
        """
        ds = self.decisions
        if not ds:
            return {"obs": {}, "actions": np.zeros((0, 0, 0)), "valid": np.zeros((0, 0), bool),
                    "rewards": np.zeros((0, 0)), "steps": np.zeros((0,), np.int64), "extras": {}}
        obs_keys = set(ds[0].obs).intersection(*(d.obs.keys() for d in ds[1:]))
        # "_"-keys are in-memory caches (collection's prefix kv, on the model's device), not data
        extra_keys = {k for k in set(ds[0].extras).intersection(*(d.extras.keys() for d in ds[1:]))
                      if not k.startswith("_")}
        return {
            "obs": {k: np.stack([np.asarray(d.obs[k]) for d in ds]) for k in sorted(obs_keys)},
            "actions": np.stack([d.actions for d in ds]),
            "valid": np.stack([d.valid for d in ds]),
            "rewards": np.stack([d.rewards for d in ds]),
            "steps": np.array([d.step for d in ds], dtype=np.int64),
            "extras": {k: np.stack([np.asarray(d.extras[k]) for d in ds]) for k in sorted(extra_keys)},
        }

    def executed_actions(self) -> np.ndarray:
        """All executed actions in order, ``(length, action_dim)``."""
        if not self.decisions:
            return np.zeros((0, 0))
        return np.concatenate([d.actions[d.valid] for d in self.decisions], axis=0)


@dataclass
class RunStats:
    """Counters of one runner call (``RolloutRunner.last_stats``)."""

    num_episodes: int = 0
    env_steps: int = 0
    policy_calls: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    worker_failures: int = 0
    respawn_failures: int = 0  # respawned workers that died / failed during start-up (then retried)
    abandoned: int = 0  # episodes dropped unfinished when ``RolloutRunner.run_until``'s stop condition held
    wall_time: float = 0.0
    policy_time: float = 0.0
    success_rate: float = 0.0
    mean_return: float = 0.0  # over episodes of total_reward
    std_return: float = 0.0  # population std (ddof=0)
    mean_length: float = 0.0

    def add_episodes(self, episodes: list[Episode]) -> None:
        """Fill the episode statistics (count, success rate, return mean/std, mean length) from ``episodes``."""
        self.num_episodes = len(episodes)
        if not episodes:
            return
        rets = np.array([e.total_reward for e in episodes], dtype=np.float64)
        self.success_rate = float(np.mean([e.success for e in episodes]))
        self.mean_return, self.std_return = float(rets.mean()), float(rets.std())
        self.mean_length = float(np.mean([e.length for e in episodes]))

    @property
    def steps_per_second(self) -> float:
        """Env steps per wall-clock second."""
        return self.env_steps / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def mean_batch_size(self) -> float:
        """Mean number of observations per policy call."""
        return float(np.mean(self.batch_sizes)) if self.batch_sizes else 0.0
