"""Parallel rollout engine: vector envs (subprocess, in-process, threads), the batched chunk-policy runner.

Modules: ``types`` (policy protocol, requests, Episode / RunStats records), ``config`` (RunnerConfig and
presets), ``scheduler`` (greedy / grouped), ``runner`` (the loop), ``vec_env`` / ``subproc_vec_env`` /
``thread_vec_env`` (backends), ``env_server`` (the worker side), ``transport`` (pipes), ``errors``.
Env conventions and :class:`~pi0.envs.EnvSpec` live in :mod:`pi0.envs`. Importing this package does not
import torch (workers stay light).
"""

from pi0.envs.conventions import EnvSpec
from pi0.rollout.config import RunnerConfig, libero_runner_config, ript_vla_runner_config
from pi0.rollout.env_server import EnvFactory, EnvOptions, call_with_backoff, make_env_with_retry
from pi0.rollout.errors import EnvCreationError, RemoteEnvError, StartupDeath, WorkerDied, WorkerError, WorkerTimeout
from pi0.rollout.policies import ArenaExpertPolicy, LatencyPolicy, RandomChunkPolicy, ZeroChunkPolicy
from pi0.rollout.runner import RolloutError, RolloutRunner, RunnerHooks, make_vec_env
from pi0.rollout.scheduler import GreedyScheduler, GroupedScheduler, make_requests
from pi0.rollout.subproc_vec_env import SubprocVecEnv
from pi0.rollout.thread_vec_env import AsyncioVecEnv, ThreadVecEnv
from pi0.rollout.types import ChunkPolicy, DecisionPoint, Episode, EpisodeRequest, PolicyOutput, RunStats
from pi0.rollout.vec_env import SerialVecEnv, VecEnvBase, check_env_factory

__all__ = [
    "ArenaExpertPolicy",
    "AsyncioVecEnv",
    "ChunkPolicy",
    "DecisionPoint",
    "EnvCreationError",
    "EnvFactory",
    "EnvOptions",
    "EnvSpec",
    "Episode",
    "EpisodeRequest",
    "GreedyScheduler",
    "GroupedScheduler",
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
    "StartupDeath",
    "SubprocVecEnv",
    "ThreadVecEnv",
    "VecEnvBase",
    "WorkerDied",
    "WorkerError",
    "WorkerTimeout",
    "ZeroChunkPolicy",
    "call_with_backoff",
    "check_env_factory",
    "libero_runner_config",
    "make_env_with_retry",
    "make_requests",
    "make_vec_env",
    "ript_vla_runner_config",
]
