"""What stages 7 and 8 share: the policy (a checkpoint or the cached tiny arena warm start), the runner
(arena in-process or LIBERO subprocess workers), init-state splits, TensorBoard and checkpoints."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pi0.modeling_pi0 import PI0Policy
from pi0.envs import make_env_spec
from pi0.rollout import RolloutRunner, libero_runner_config
from pi0.ript.algos.rl_optimizers.rl_optimizer_pi0_cfg import OptimizerConfig
from pi0.ript.warm_start import TinyArenaConfig, arena_runner, cached_warm_start

ENVS = ("arena", "libero")


def load_policy(env: str, checkpoint: str, task_ids: Sequence[int], warm_start_demos: int = 10,
                warm_start_steps: int = 300, device: str = "cpu") -> PI0Policy:
    """``checkpoint`` if given; else the tiny arena warm start (cached) or, for LIBERO, the tiny random pi0."""
    if env not in ENVS:
        raise ValueError(f"unknown env {env!r}; choose one of {ENVS}")
    if checkpoint:
        if not Path(checkpoint).is_dir():
            raise FileNotFoundError(f"checkpoint {checkpoint} does not exist (give a directory written by "
                                    "PI0Policy.save_pretrained or convert_pi0_to_hf_lerobot.py)")
        return PI0Policy.from_pretrained(checkpoint, device=device)
    if env == "libero":
        from pi0.presets import tiny_policy
        return tiny_policy().to(device)
    demos = [(t, i) for t in task_ids for i in range(warm_start_demos)]
    policy, _, _ = cached_warm_start(TinyArenaConfig(), demos, warm_start_steps, OptimizerConfig(lr=1e-3))
    return policy.to(device)


def make_runner(env: str, suite: str, task_ids: Sequence[int], policy: PI0Policy, num_envs: int,
                max_steps: int = 0) -> RolloutRunner:
    """Arena: in-process envs; LIBERO: subprocess workers (MUJOCO_GL=egl), replanning every n_action_steps."""
    replan = policy.config.n_action_steps
    if env == "arena":
        return arena_runner(num_envs, replan, max_steps=max_steps or None)
    os.environ.setdefault("MUJOCO_GL", "egl")
    return RolloutRunner(make_env_spec("libero", suite, task_ids[0]), None,
                         libero_runner_config(num_envs=num_envs, replan_steps=replan, max_steps=max_steps or None))


def split_states(task_ids: Sequence[int], train: int, eval_start: int, eval_count: int
                 ) -> tuple[dict[int, range], list[tuple[int, int]]]:
    """Training ids 0..train-1 per task and held-out eval pairs eval_start..eval_start+eval_count-1."""
    if eval_count and eval_start < train:
        raise ValueError(f"held-out init states start at {eval_start} < train_states {train}: they would overlap")
    return ({int(t): range(train) for t in task_ids},
            [(int(t), i) for t in task_ids for i in range(eval_start, eval_start + eval_count)])


def make_writer(out_dir: str | Path) -> Any:
    """TensorBoard writer under ``<out_dir>/tb`` (rank 0 only; None elsewhere)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter(str(Path(out_dir) / "tb"))
