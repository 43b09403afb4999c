"""The one rollout-runner configuration (:class:`RunnerConfig`) and its presets (plain functions).

The training config of the RL stages nests a ``RunnerConfig``; a preset is a function returning one,
so a preset and a hand-written config are the same kind of value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["IN_PROCESS", "SCHEDULES", "RunnerConfig", "libero_runner_config", "ript_vla_runner_config"]

SCHEDULES = ("greedy", "grouped", "task_order")
IN_PROCESS = ("serial", "thread", "asyncio")


@dataclass
class RunnerConfig:
    """Settings of :class:`pi0.rollout.runner.RolloutRunner`; every default is here, in the fields."""

    num_envs: int = 4  # envs (one worker process each, or in-process envs)
    envs_per_worker: int = 1  # >1: each worker process hosts this many envs, one batched message per round
    replan_steps: int = 5  # actions executed from each predicted chunk before replanning
    max_steps: int | None = None  # optional cap on policy steps per episode (the env truncates too)
    group_size: int = 1  # default K of run()
    schedule: str = "greedy"  # "greedy" | "grouped" | "task_order" (a task's episodes in order on one worker)
    settle_steps: int = 0  # extra do-nothing steps after reset (LiberoEnv already does its own wait steps)
    settle_action: tuple[float, ...] | None = None  # None: the env's declared ``wait_action``
    remote_chunks: bool = True  # execute whole chunks next to the env (1 round trip per decision)
    store_images: bool = True  # keep the image keys of decision-point observations (False: low-dim keys only)
    record_video: bool = False  # keep upright frames of the env's first camera (decision points + final frame)
    video_every_step: bool = False  # ... or of every step (renders every step)
    use_subprocess: bool = True  # False: in-process envs, stepped as ``in_process`` says
    in_process: str = "serial"  # in-process backend: "serial" | "thread" | "asyncio" (the last two: I/O-bound envs)
    step_timeout: float = 120.0  # seconds without a reply before a worker counts as hung
    start_timeout: float = 600.0  # seconds to build an env in a (re)started worker
    make_attempts: int = 3  # env creation / worker respawn / first-start attempts (exponential backoff)
    make_backoff: float = 0.5  # first backoff in seconds (doubles each attempt)
    make_backoff_max: float = 30.0  # cap on the backoff
    recreate_every: int | None = None  # re-create each worker's env every N episodes
    max_episode_attempts: int = 3  # an episode may be started this many times before RolloutError
    progress: bool = False  # tqdm bar over episodes (rank 0 only)
    # two cohorts of env processes: while one cohort's envs step, the policy decides for the other's (pays where env
    # steps are slow and cores are spare: MetaWorld / LIBERO beside a GPU policy); each policy batch is half as large
    overlap: bool = False

    def __post_init__(self) -> None:
        """Reject bad values with the field named (before any worker starts)."""
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.in_process not in IN_PROCESS:
            raise ValueError(f"in_process must be one of {IN_PROCESS}, got {self.in_process!r}")
        if self.replan_steps < 1 or self.num_envs < 1 or self.envs_per_worker < 1 or self.group_size < 1:
            raise ValueError("replan_steps, num_envs, envs_per_worker and group_size must be >= 1")
        if self.max_episode_attempts < 1 or self.make_attempts < 1:
            raise ValueError("max_episode_attempts and make_attempts must be >= 1")
        if self.settle_action is not None:
            self.settle_action = tuple(float(a) for a in self.settle_action)

    @property
    def backend(self) -> str:
        """Which vector env runs the envs: "subprocess", "serial", "thread" or "asyncio"."""
        return "subprocess" if self.use_subprocess else self.in_process

    def replace(self, **changes: Any) -> "RunnerConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def libero_runner_config(**changes: Any) -> RunnerConfig:
    """Greedy LIBERO preset (the seed's ``LIBEROEnvRunner``): 4 envs, replan every 5 actions as openpi's
    LIBERO eval, 300 s step timeout (a LIBERO chunk with renders is slow); ``changes`` override fields."""
    return RunnerConfig(**{"num_envs": 4, "replan_steps": 5, "schedule": "greedy", "group_size": 1,
                           "settle_steps": 0, "step_timeout": 300.0, **changes})


def ript_vla_runner_config(num_groups: int | None = None, **changes: Any) -> RunnerConfig:
    """RIPT-VLA preset (the seed's ``PI0LiberoRunner``): grouped schedule, ``num_groups x group_size`` envs
    (default 2 x 4); ``num_groups`` (if given) sets ``num_envs = num_groups * group_size``."""
    fields = {"num_envs": 8, "group_size": 4, "replan_steps": 5, "schedule": "grouped", "settle_steps": 0,
              "step_timeout": 300.0, **changes}
    if num_groups is not None:
        fields["num_envs"] = int(num_groups) * int(fields["group_size"])
    return RunnerConfig(**fields)
