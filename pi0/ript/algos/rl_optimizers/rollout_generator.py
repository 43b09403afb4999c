"""``RolloutGenerator``: collect K-rollout groups from sampled init states, with RLOO advantages, dynamic
sampling (drop all-equal groups), the init-state history and a bound on collection attempts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from pi0.rollout import ChunkPolicy, Episode, RolloutRunner
from pi0.ript.algos.rloo import informative_groups, rloo_advantages
from pi0.ript.init_states import InitStateHistory, InitStateSampler
from pi0.ript.reward_function import BinarySuccessReward


@dataclass
class Group:
    """K episodes of one init state with their rewards (K,) and RLOO advantages (K,)."""

    state: tuple[int, int]
    episodes: list[Episode]
    rewards: np.ndarray
    advantages: np.ndarray


@dataclass
class Collection:
    """Result of one :meth:`RolloutGenerator.collect` call."""

    groups: list[Group]  # kept (informative) groups
    num_groups: int = 0  # groups rolled out
    num_skipped_states: int = 0  # states skipped by the history
    attempts: int = 0  # collection rounds used
    success_rate: float = 0.0  # over every rollout of this call
    rollout_time: float = 0.0
    exhausted: str = ""  # why collection stopped early ("" if it got enough groups)
    all_rewards: list[np.ndarray] = field(default_factory=list)

    @property
    def frac_kept(self) -> float:
        """Fraction of rolled-out groups kept by dynamic sampling."""
        return len(self.groups) / self.num_groups if self.num_groups else 0.0


class RolloutGenerator:
    """Collects ``num_groups`` groups of ``group_size`` rollouts per call (bounded by ``max_attempts`` rounds)."""

    def __init__(self, runner: RolloutRunner, policy: ChunkPolicy, sampler: InitStateSampler, group_size: int = 8,
                 dynamic_sampling: bool = True, history: InitStateHistory | None = None, max_attempts: int = 3,
                 reward: BinarySuccessReward | None = None):
        if group_size < 2:
            raise ValueError(f"RLOO needs group_size >= 2, got {group_size}")
        self.runner, self.policy, self.sampler = runner, policy, sampler
        self.group_size = group_size
        self.dynamic_sampling = dynamic_sampling
        self.history = history
        self.max_attempts = max(1, int(max_attempts))
        self.reward = reward or BinarySuccessReward()

    def _pick_states(self, n: int) -> tuple[list[tuple[int, int]], int]:
        """Up to ``n`` states not skipped by the history (one pass over the sampler at most) + skip count."""
        out, skipped = [], 0
        for _ in range(len(self.sampler)):
            if len(out) == n:
                break
            s = self.sampler.next()
            if self.history is not None and self.history.should_skip(s):
                skipped += 1
                continue
            out.append(s)
        return out, skipped

    def collect(self, num_groups: int) -> Collection:
        """Roll out groups until ``num_groups`` informative ones are kept or ``max_attempts`` rounds are used."""
        col = Collection(groups=[])
        t0 = time.perf_counter()
        successes = []
        while len(col.groups) < num_groups:
            if col.attempts >= self.max_attempts:
                col.exhausted = (f"stopped after {col.attempts} collection rounds with {len(col.groups)}/{num_groups} "
                                 "informative groups (every sampled state was solved or failed in all rollouts)")
                break
            col.attempts += 1
            states, skipped = self._pick_states(num_groups - len(col.groups))
            col.num_skipped_states += skipped
            if not states:
                col.exhausted = "every init state is solved (skipped by the history); nothing left to collect"
                break
            episodes = self.runner.run(states, group_size=self.group_size, policy=self.policy)
            rewards = self.reward.group_rewards(episodes, self.group_size)
            adv = rloo_advantages(rewards)
            keep = informative_groups(rewards) if self.dynamic_sampling else np.ones(len(states), bool)
            successes.extend(rewards.ravel().tolist())
            col.num_groups += len(states)
            for g, s in enumerate(states):
                if self.history is not None:
                    self.history.update(s, rewards[g])
                col.all_rewards.append(rewards[g])
                if keep[g]:
                    eps = episodes[g * self.group_size: (g + 1) * self.group_size]
                    col.groups.append(Group(s, eps, rewards[g], adv[g]))
        col.success_rate = float(np.mean(successes)) if successes else 0.0
        col.rollout_time = time.perf_counter() - t0
        return col
