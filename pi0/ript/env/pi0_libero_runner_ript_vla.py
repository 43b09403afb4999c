"""RIPT-VLA style LIBERO runner: env groups sharing an init state (thin configuration of the core runner)."""

from __future__ import annotations

from typing import Any, ClassVar

from pi0.rollout.runner import RolloutRunner, RunnerConfig
from pi0.rollout.types import ChunkPolicy
from pi0.rollout.vec_env import EnvFactory
from pi0.ript.env.pi0_libero_runner import libero_env_spec

__all__ = ["PI0LiberoRunner"]


class PI0LiberoRunner(RolloutRunner):
    """LIBERO runner with ``num_groups x group_size`` envs: the K rollouts of one init state run together.

    ``schedule="grouped"``: the workers form ``num_envs // group_size`` blocks; each block runs
    the K members of one ``(task, init_state)`` group at the same time (same init state, same
    policy batches), which is what RLOO advantage estimation over a group wants. Same loop, crash
    recovery and records as :class:`~pi0.rollout.runner.RolloutRunner`.
    """

    DEFAULTS: ClassVar[dict[str, Any]] = {"num_envs": 8, "group_size": 4, "replan_steps": 5, "schedule": "grouped",
                                          "settle_steps": 0, "step_timeout": 300.0}

    def __init__(self, env_factory: EnvFactory | None = None, policy: ChunkPolicy | None = None,
                 config: RunnerConfig | None = None, *, num_groups: int | None = None, **overrides: Any) -> None:
        """Create the runner; ``num_groups`` (if given) sets ``num_envs = num_groups * group_size``."""
        if num_groups is not None:
            k = int(overrides.get("group_size", (config.group_size if config else self.DEFAULTS["group_size"])))
            overrides["num_envs"] = int(num_groups) * k
        super().__init__(env_factory or libero_env_spec(), policy, config, **overrides)

    @property
    def num_groups(self) -> int:
        """Number of env groups (blocks of ``group_size`` workers)."""
        return self.config.num_envs // self.config.group_size
