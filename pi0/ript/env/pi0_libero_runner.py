"""LIBERO rollouts for RIPT: ``LIBEROEnvRunner`` (a thin configuration of the shared runner core) and
openpi's pi0_libero observation/action path (``construct_pi0_observation``, ``predict_libero_action_chunk``,
``Pi0ChunkPolicy``, defined in :mod:`pi0.libero_policy` and exposed here).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pi0.libero_policy import Pi0ChunkPolicy, construct_pi0_observation, predict_libero_action_chunk
from pi0.rollout.runner import RolloutRunner, RunnerConfig
from pi0.rollout.types import ChunkPolicy
from pi0.rollout.vec_env import EnvFactory, EnvSpec

__all__ = ["LIBEROEnvRunner", "LIBERO_GYM_IDS", "libero_env_spec", "make_env_spec", "Pi0ChunkPolicy",
           "construct_pi0_observation", "predict_libero_action_chunk"]

LIBERO_GYM_IDS: dict[str, str] = {
    "libero_spatial": "libero-spatial-v0",
    "libero_object": "libero-object-v0",
    "libero_goal": "libero-goal-v0",
    "libero_10": "libero-10-v0",
    "libero_90": "libero-90-v0",
}


def libero_env_spec(suite: str = "libero_spatial", task_id: int = 0, render_on_demand: bool = True,
                    **kwargs: Any) -> EnvSpec:
    """EnvSpec of a LIBERO suite (gym id from ``pi0.envs``); workers switch ``task_id`` per episode."""
    if suite not in LIBERO_GYM_IDS:
        raise ValueError(f"unknown LIBERO suite {suite!r}; valid: {', '.join(LIBERO_GYM_IDS)}")
    return EnvSpec(LIBERO_GYM_IDS[suite], {"task_id": task_id, "render_on_demand": render_on_demand, **kwargs})


class LIBEROEnvRunner(RolloutRunner):
    """LIBERO runner, greedy scheduling: any free worker takes the next ``(task, init_state, k)`` episode.

    Defaults follow openpi's LIBERO evaluation (replan every 5 actions; ``LiberoEnv`` itself runs
    the 10 settle steps and truncates at the suite's max steps). ``env_factory`` defaults to
    ``libero_env_spec("libero_spatial")``.
    """

    DEFAULTS: ClassVar[dict[str, Any]] = {"num_envs": 4, "replan_steps": 5, "schedule": "greedy", "group_size": 1,
                                          "settle_steps": 0, "step_timeout": 300.0}

    def __init__(self, env_factory: EnvFactory | None = None, policy: ChunkPolicy | None = None,
                 config: RunnerConfig | None = None, **overrides: Any) -> None:
        """Create the runner (no worker starts until the first run)."""
        super().__init__(env_factory or libero_env_spec(), policy, config, **overrides)


def make_env_spec(env: str = "libero", suite: str = "libero_spatial", task_id: int = 0, **kwargs: Any) -> EnvSpec:
    """EnvSpec for ``env="libero"`` (a suite) or ``env="arena"`` (the fast built-in env), render-on-demand."""
    if env == "libero":
        return libero_env_spec(suite, task_id=task_id, **kwargs)
    if env == "arena":
        return EnvSpec("arena-v0", {"task_id": task_id, "render_on_demand": True, **kwargs})
    raise ValueError(f"unknown env {env!r}; choose 'libero' or 'arena'")

