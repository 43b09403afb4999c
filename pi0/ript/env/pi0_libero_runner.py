"""Seed import path of the greedy LIBERO runner: ``LIBEROEnvRunner`` is the shared runner with the
:func:`~pi0.rollout.config.libero_runner_config` preset. The env specs (:mod:`pi0.envs`) and openpi's
pi0_libero policy path (:mod:`pi0.policies.libero`) are re-exported here for the seed's imports.
"""

from __future__ import annotations

from typing import Any

from pi0.envs.conventions import LIBERO_GYM_IDS, EnvSpec, libero_env_spec, make_env_spec
from pi0.policies.libero import Pi0ChunkPolicy, construct_libero_observation, predict_libero_action_chunk
from pi0.rollout.config import RunnerConfig, libero_runner_config
from pi0.rollout.env_server import EnvFactory
from pi0.rollout.runner import RolloutRunner
from pi0.rollout.types import ChunkPolicy

__all__ = ["LIBEROEnvRunner", "LIBERO_GYM_IDS", "EnvSpec", "libero_env_spec", "make_env_spec", "Pi0ChunkPolicy",
           "construct_libero_observation", "predict_libero_action_chunk"]


class LIBEROEnvRunner(RolloutRunner):
    """``RolloutRunner(env_factory or libero_env_spec(), policy, config or libero_runner_config(**changes))``."""

    def __init__(self, env_factory: EnvFactory | None = None, policy: ChunkPolicy | None = None,
                 config: RunnerConfig | None = None, **changes: Any) -> None:
        """Seed signature: keyword ``changes`` are RunnerConfig fields (or ``hooks`` / ``vec_env``)."""
        extra = {k: changes.pop(k) for k in ("hooks", "vec_env") if k in changes}
        cfg = config.replace(**changes) if config is not None else libero_runner_config(**changes)
        super().__init__(env_factory or libero_env_spec(), policy, cfg, **extra)
