"""Build the rollout runner of the RL stages from its typed :class:`~pi0.rollout.config.RunnerConfig`."""

from __future__ import annotations

from pi0.rollout.config import RunnerConfig
from pi0.rollout.env_server import EnvFactory
from pi0.rollout.runner import RolloutRunner
from pi0.rollout.types import ChunkPolicy
from pi0.ript.env.pi0_libero_runner import LIBEROEnvRunner
from pi0.ript.env.pi0_libero_runner_ript_vla import PI0LiberoRunner

__all__ = ["make_runner"]


def make_runner(config: RunnerConfig, policy: ChunkPolicy | None = None,
                env_factory: EnvFactory | None = None) -> RolloutRunner:
    """``PI0LiberoRunner`` for ``schedule="grouped"`` (RIPT-VLA style), else ``LIBEROEnvRunner``; LIBERO
    spatial by default (``env_factory``: e.g. ``pi0.envs.make_env_spec("arena")``)."""
    if not isinstance(config, RunnerConfig):
        raise TypeError(f"make_runner takes a RunnerConfig (e.g. pi0.rollout.ript_vla_runner_config()), "
                        f"got {type(config).__name__}")
    cls = PI0LiberoRunner if config.schedule == "grouped" else LIBEROEnvRunner
    return cls(env_factory, policy, config)
