"""Seed import path of the RIPT-VLA style runner: ``PI0LiberoRunner`` is the shared runner with the
:func:`~pi0.rollout.config.ript_vla_runner_config` preset (env groups sharing an init state)."""

from __future__ import annotations

from typing import Any

from pi0.envs.conventions import libero_env_spec
from pi0.rollout.config import RunnerConfig, ript_vla_runner_config
from pi0.rollout.env_server import EnvFactory
from pi0.rollout.runner import RolloutRunner
from pi0.rollout.types import ChunkPolicy

__all__ = ["PI0LiberoRunner"]


class PI0LiberoRunner(RolloutRunner):
    """``RolloutRunner`` with ``num_groups x group_size`` envs: the K rollouts of one init state run together.

    ``schedule="grouped"``: the workers form ``num_envs // group_size`` blocks; each block runs the K
    members of one ``(task, init_state)`` group at the same time (same init state, same policy
    batches), which is what RLOO advantage estimation over a group wants.
    """

    def __init__(self, env_factory: EnvFactory | None = None, policy: ChunkPolicy | None = None,
                 config: RunnerConfig | None = None, *, num_groups: int | None = None, **changes: Any) -> None:
        """Seed signature: ``num_groups`` (if given) sets ``num_envs = num_groups * group_size``."""
        extra = {k: changes.pop(k) for k in ("hooks", "vec_env") if k in changes}
        if config is not None:
            if num_groups is not None:
                changes["num_envs"] = int(num_groups) * int(changes.get("group_size", config.group_size))
            cfg = config.replace(**changes)
        else:
            cfg = ript_vla_runner_config(num_groups, **changes)
        super().__init__(env_factory or libero_env_spec(), policy, cfg, **extra)

    @property
    def num_groups(self) -> int:
        """Number of env groups (blocks of ``group_size`` workers)."""
        return self.config.num_envs // self.config.group_size
