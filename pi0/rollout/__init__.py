"""Parallel rollout engine: subprocess vector envs, the batched chunk-policy runner, executors.

Importing this package does not import torch (workers stay light).
"""

from pi0.rollout.executors import (
    AsyncExecutor,
    EnvStats,
    ExecutorError,
    Rollout,
    RolloutCollector,
    RolloutStats,
    SerialExecutor,
    ThreadExecutor,
    compute_stats,
    max_concurrency,
)
from pi0.rollout.policies import ArenaExpertPolicy, LatencyPolicy, RandomChunkPolicy, ZeroChunkPolicy
from pi0.rollout.runner import RolloutError, RolloutRunner, RunnerConfig, RunnerHooks, RunStats, make_requests
from pi0.rollout.types import IMAGE_KEYS, ChunkPolicy, DecisionPoint, Episode, EpisodeRequest, PolicyOutput, upright
from pi0.rollout.vec_env import (
    EnvCreationError,
    EnvFactory,
    EnvSpec,
    RemoteEnvError,
    SerialVecEnv,
    SubprocVecEnv,
    WorkerDied,
    WorkerError,
    WorkerTimeout,
    check_env_factory,
    make_env_with_retry,
)

__all__ = [
    "ArenaExpertPolicy",
    "AsyncExecutor",
    "EnvStats",
    "ExecutorError",
    "Rollout",
    "RolloutCollector",
    "RolloutStats",
    "SerialExecutor",
    "ThreadExecutor",
    "compute_stats",
    "max_concurrency",
    "ChunkPolicy",
    "DecisionPoint",
    "EnvCreationError",
    "EnvFactory",
    "EnvSpec",
    "Episode",
    "EpisodeRequest",
    "IMAGE_KEYS",
    "LatencyPolicy",
    "PolicyOutput",
    "RandomChunkPolicy",
    "RemoteEnvError",
    "RolloutError",
    "RolloutRunner",
    "RunStats",
    "RunnerConfig",
    "RunnerHooks",
    "SerialVecEnv",
    "SubprocVecEnv",
    "WorkerDied",
    "WorkerError",
    "WorkerTimeout",
    "ZeroChunkPolicy",
    "check_env_factory",
    "make_env_with_retry",
    "make_requests",
    "upright",
]
