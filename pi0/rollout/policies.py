"""Cheap :class:`~pi0.rollout.types.ChunkPolicy` implementations (no model): random, arena expert, latency;
and the arena expert demonstrations collected through a runner."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pi0.rollout.types import ChunkPolicy, PolicyOutput

if TYPE_CHECKING:
    from pi0.rollout.runner import RolloutRunner
    from pi0.rollout.types import Episode

__all__ = ["ArenaExpertPolicy", "EnvExpertPolicy", "LatencyPolicy", "RandomChunkPolicy", "ZeroChunkPolicy",
           "collect_expert_demos", "collect_metaworld_demos"]


class RandomChunkPolicy:
    """Uniform random chunks ``(n, horizon, action_dim)`` in ``[low, high]``; extras hold the noise."""

    def __init__(self, horizon: int = 10, action_dim: int = 7, seed: int | None = None,
                 low: float = -1.0, high: float = 1.0) -> None:
        """Create the policy; ``seed`` seeds its generator."""
        self.horizon = int(horizon)
        self.action_dim = int(action_dim)
        self.low, self.high = float(low), float(high)
        self.rng = np.random.default_rng(seed)
        self.num_calls = 0

    def predict_chunks(self, obs: list[dict[str, np.ndarray]], prompts: list[str]) -> PolicyOutput:
        """Random ``(n, H, A)`` chunks; ``extras["noise"]`` is the same array (like a flow policy's noise)."""
        self.num_calls += 1
        a = self.rng.uniform(self.low, self.high, size=(len(obs), self.horizon, self.action_dim)).astype(np.float32)
        return PolicyOutput(actions=a, extras={"noise": a.copy()})


class ZeroChunkPolicy:
    """Do-nothing chunks (gripper open), useful for timing env stepping alone."""

    def __init__(self, horizon: int = 10, action_dim: int = 7) -> None:
        """Create the policy."""
        self.horizon, self.action_dim = int(horizon), int(action_dim)

    def predict_chunks(self, obs: list[dict[str, np.ndarray]], prompts: list[str]) -> PolicyOutput:
        """Zero ``(n, H, A)`` chunks with the gripper dim at -1 (open)."""
        a = np.zeros((len(obs), self.horizon, self.action_dim), np.float32)
        a[..., -1] = -1.0
        return PolicyOutput(actions=a)


class ArenaExpertPolicy:
    """The arena's scripted expert as a batched chunk policy (reads ``obs["arena_state"]``).

    Each chunk is the closed-loop expert rolled through the arena dynamics, so executing it open
    loop reproduces closed-loop behaviour. With ``noise == 0`` it is deterministic; with noise,
    the chunk is a function of the state and the generator's draws.
    """

    def __init__(self, horizon: int = 10, noise: float = 0.0, seed: int | None = None,
                 gripper_flip_prob: float = 0.0, aim_error: float = 0.0) -> None:
        """Create the policy; ``noise`` is the expert's action-noise std (action units), ``aim_error`` its
        per-episode lateral misperception bound in metres (``ArenaExpert.aim_offset``)."""
        from pi0.envs.arena import ArenaExpert

        self.horizon = int(horizon)
        self.expert = ArenaExpert(noise=noise, seed=seed, gripper_flip_prob=gripper_flip_prob, aim_error=aim_error)
        self.num_calls = 0
        self.batch_sizes: list[int] = []

    def predict_chunks(self, obs: list[dict[str, np.ndarray]], prompts: list[str]) -> PolicyOutput:
        """``(n, horizon, 7)`` expert chunks; extras: ``state`` (n, D) privileged state vectors."""
        from pi0.envs.arena import ArenaState

        self.num_calls += 1
        self.batch_sizes.append(len(obs))
        states = np.stack([np.asarray(o["arena_state"], np.float64) for o in obs]) if obs else np.zeros((0, 0))
        chunks = np.stack([self.expert.predict_chunk(ArenaState.from_vector(s), self.horizon) for s in states]) \
            if len(obs) else np.zeros((0, self.horizon, 7))
        return PolicyOutput(actions=chunks, extras={"state": states})  # float64: exactly what was simulated


def collect_expert_demos(runner: RolloutRunner, states: Sequence[tuple[int, int]], horizon: int,
                         noise: float = 0.0, seed: int = 0, aim_error: float = 0.0
                         ) -> list[tuple[Episode, np.ndarray]]:
    """Arena expert episodes on ``states`` + the noise-free expert chunks (D, H, 7) at every decision point.

    The demonstrations of pi0's warm start (``pi0.ript.warm_start``) and of pi0-FAST's arena SFT.

    ``noise > 0`` executes a noisy expert (action-noise std) but keeps the clean chunks as labels, so the demos
    visit off-path states with corrective labels (DART-style noise injection); 0 = the plain noise-free expert.
    ``aim_error > 0`` demonstrates with a suboptimal expert that misjudges the blocks' positions by a per-episode
    offset (``ArenaExpert.aim_offset``, drawn from ``seed``); its own chunks are the labels, failures included (mixed-
    quality demonstrations: each episode's ``success`` says which).
    """
    from pi0.envs.arena import ArenaExpert, ArenaState

    episodes = runner.run(list(states), group_size=1,
                          policy=ArenaExpertPolicy(horizon=horizon, noise=noise, aim_error=aim_error,
                                                   seed=seed if noise > 0 or aim_error > 0 else None))
    expert = ArenaExpert(aim_error=aim_error, seed=seed)
    return [(e, np.stack([expert.predict_chunk(ArenaState.from_vector(d.obs["arena_state"]), horizon)
                          for d in e.decisions])) for e in episodes]


class EnvExpertPolicy:
    """Executes the expert chunk the env computed for each observation (``obs["expert_chunk"]`` (H, 7); MetaWorld with
    ``expert_chunks=True``)."""

    def __init__(self, horizon: int) -> None:
        self.horizon = int(horizon)

    def predict_chunks(self, obs: list[dict[str, np.ndarray]], prompts: list[str]) -> PolicyOutput:
        """``(n, H, 7)`` expert chunks."""
        if obs and "expert_chunk" not in obs[0]:
            raise ValueError("observations carry no expert_chunk: create the env with expert_chunks=True")
        return PolicyOutput(actions=np.stack([o["expert_chunk"] for o in obs]) if obs
                            else np.zeros((0, self.horizon, 7)))


def collect_metaworld_demos(runner: RolloutRunner, states: Sequence[tuple[int, int]], horizon: int
                            ) -> list[tuple[Episode, np.ndarray]]:
    """MetaWorld scripted-expert episodes on ``states`` (a runner over ``make_env_spec("metaworld",
    expert_chunks=True, expert_horizon=horizon)``) + the expert chunks (D, H, 7) at every decision point."""
    episodes = runner.run(list(states), group_size=1, policy=EnvExpertPolicy(horizon))
    return [(e, np.stack([d.obs["expert_chunk"] for d in e.decisions])) for e in episodes]


class LatencyPolicy:
    """Wraps a policy and sleeps ``base_s + per_sample_s * n`` per call (emulated batched inference)."""

    def __init__(self, policy: ChunkPolicy, base_s: float = 0.0, per_sample_s: float = 0.0) -> None:
        """Create the wrapper."""
        self.policy = policy
        self.base_s, self.per_sample_s = float(base_s), float(per_sample_s)
        self.num_calls = 0
        self.total_sleep = 0.0

    def predict_chunks(self, obs: list[dict[str, np.ndarray]], prompts: list[str]) -> PolicyOutput:
        """Sleep, then delegate."""
        d = self.base_s + self.per_sample_s * len(obs)
        if d > 0:
            time.sleep(d)
        self.num_calls += 1
        self.total_sleep += d
        return self.policy.predict_chunks(obs, prompts)

    def __getattr__(self, name: str) -> Any:
        """Delegate unknown attributes to the wrapped policy.

        Only called when normal lookup fails. ``policy`` itself and dunder names are never delegated:
        before ``__init__`` ran (e.g. while unpickling or copying) ``self.policy`` does not exist yet,
        and looking it up through ``__getattr__`` would recurse forever.
        """
        if name == "policy" or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.policy, name)
