"""The arena as a gymnasium env with LIBERO-compatible observations and render on demand."""

from __future__ import annotations

import math
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from pi0.envs.conventions import CAMERA_KEYS, WAIT_ACTION, step_outcome, upright
from pi0.envs.arena.render import ArenaRenderer
from pi0.envs.arena.world import (
    DEFAULT_NUM_INIT_STATES,
    FINGER_OPEN,
    TABLE_Z,
    TASKS,
    ArenaState,
    ArenaTask,
    arena_step,
    check_success,
    make_layout,
)


# ------------------------------------------------------------------------------------------ env
def _quat_down_yaw(yaw: float) -> np.ndarray:
    """xyzw quaternion of a gripper pointing down (180 deg about x) then yawed about world z."""
    h = 0.5 * yaw
    # q_yaw (about z) * q_down (about x by pi) = (cos h, 0, 0, sin h) * (0, 1, 0, 0) [wxyz]
    return np.array([math.cos(h), math.sin(h), 0.0, 0.0], dtype=np.float64)


class ArenaEnv(gym.Env):
    """Gymnasium env of the arena with LIBERO-compatible observations (see module docstring)."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 20}
    supports_task_switch = True  # reset(options={"task_id": t}) switches task without re-creation
    image_keys: tuple[str, ...] = CAMERA_KEYS  # LIBERO's camera keys (rendered on demand)
    wait_action: tuple[float, ...] = WAIT_ACTION  # LIBERO's do-nothing action (gripper open)

    def __init__(
        self,
        task_id: int = 0,
        seed: int | None = None,
        init_state_id: int = 0,
        max_steps: int | None = None,
        render_on_demand: bool = False,
        render_every: int = 5,
        resolution: int | tuple[int, int] = 128,
        num_init_states: int = DEFAULT_NUM_INIT_STATES,
        render_mode: str | None = None,
    ) -> None:
        """Create the env; ``resolution`` is an int or ``(H, W)`` (aspect ratio at most 2:1).

        The dynamics are deterministic: ``seed`` only seeds ``self.np_random`` (gym API parity).
        """
        super().__init__()
        h, w = (resolution, resolution) if isinstance(resolution, int) else (int(resolution[0]), int(resolution[1]))
        if min(h, w) < 16 or max(h, w) > 2 * min(h, w):
            raise ValueError(f"resolution must be square-ish and >= 16, got {resolution}")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if render_every < 1:
            raise ValueError(f"render_every must be >= 1, got {render_every}")
        self._check_task(task_id)
        self.task_id = int(task_id)
        self.num_init_states = int(num_init_states)
        self.init_state_id = self._check_init(init_state_id)
        self._max_steps_override = max_steps
        self.render_on_demand = bool(render_on_demand)
        self.render_every = int(render_every)
        self.render_mode = render_mode
        self.resolution = (h, w)
        self.image_shape = (h, w, 3)
        self._renderer = ArenaRenderer(h, w)
        self._seed = seed
        self._seeded = False
        self._state: ArenaState | None = None
        self._images: tuple[np.ndarray, np.ndarray] | None = None  # images of the current state
        self._success = False
        img = spaces.Box(0, 255, self.image_shape, np.uint8)
        self.observation_space = spaces.Dict({
            **{key: img for key in self.image_keys},
            "robot0_eef_pos": spaces.Box(-np.inf, np.inf, (3,), np.float64),
            "robot0_eef_quat": spaces.Box(-1.0, 1.0, (4,), np.float64),
            "robot0_gripper_qpos": spaces.Box(-FINGER_OPEN, FINGER_OPEN, (2,), np.float64),
            "arena_state": spaces.Box(-np.inf, np.inf, (ArenaState.VECTOR_DIM,), np.float64),
        })
        self.action_space = spaces.Box(-1.0, 1.0, (7,), np.float32)

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _check_task(task_id: int) -> None:
        """Raise for an unknown task id."""
        if not 0 <= int(task_id) < len(TASKS):
            raise ValueError(f"task_id must be in [0, {len(TASKS)}), got {task_id}")

    def _check_init(self, init_state_id: int) -> int:
        """Validate and return an init state id."""
        if not 0 <= int(init_state_id) < self.num_init_states:
            raise ValueError(f"init_state_id must be in [0, {self.num_init_states}), got {init_state_id}")
        return int(init_state_id)

    @property
    def task(self) -> ArenaTask:
        """The current :class:`ArenaTask`."""
        return TASKS[self.task_id]

    @property
    def prompt(self) -> str:
        """Language instruction of the current task."""
        return TASKS[self.task_id].prompt

    @property
    def task_description(self) -> str:
        """Alias of ``prompt`` (LiberoEnv parity)."""
        return self.prompt

    @property
    def policy_steps(self) -> int:
        """Steps taken in the current episode."""
        return self.state.steps

    @property
    def max_steps(self) -> int:
        """Episode step limit (constructor value or the task default)."""
        return self._max_steps_override if self._max_steps_override is not None else self.task.max_steps

    @property
    def state(self) -> ArenaState:
        """The live state (mutating it changes the env; prefer :meth:`set_state`)."""
        if self._state is None:
            raise RuntimeError("call reset() first")
        return self._state

    def get_state(self) -> ArenaState:
        """A copy of the current state."""
        return self.state.copy()

    def set_state(self, state: ArenaState) -> None:
        """Place the env in ``state`` like a reset (hand-placed states): the success latch is cleared
        and success is evaluated again on the next step."""
        self._check_task(state.layout.task_id)
        self.task_id = state.layout.task_id
        self._state = state.copy()
        self._images = None
        self._success = False

    def check_success(self) -> bool:
        """Success predicate evaluated on the current state (not latched)."""
        return check_success(self.state)

    # ---------------------------------------------------------------- gym API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict, dict]:
        """Reset to init state ``options["init_state_id"]`` (default: the current one).

        ``options["task_id"]`` switches the task; ``options["render"]`` (default True) asks for images
        in the returned observation when rendering on demand. Returns ``(obs, info)``.
        """
        if seed is None and not self._seeded:
            seed = self._seed
        if seed is not None or not self._seeded:
            super().reset(seed=seed)
            self._seeded = True
        options = options or {}
        if options.get("task_id") is not None:
            self._check_task(options["task_id"])
            self.task_id = int(options["task_id"])
        if options.get("init_state_id") is not None:
            self.init_state_id = self._check_init(options["init_state_id"])
        self._state = make_layout(self.task_id, self.init_state_id)
        self._images = None
        self._success = False
        rendered = bool(options.get("render", True)) or not self.render_on_demand
        return self.get_observation(render=rendered), self._info(rendered)

    def step(self, action: np.ndarray, render: bool | None = None) -> tuple[dict, float, bool, bool, dict]:
        """One control step for a ``(7,)`` action; ``render`` as in LiberoEnv (on-demand mode only).

        Reward is 1.0 on the step that first reaches success, else 0.0; ``terminated`` once the
        task succeeded (latched), ``truncated`` when ``max_steps`` steps are used up.
        """
        state = self.state
        action = np.asarray(action, dtype=np.float64).reshape(-1)
        if action.shape != (7,):
            raise ValueError(f"arena actions are (7,), got shape {action.shape}")
        arena_step(state, action)
        self._images = None
        reward, self._success, truncated, rendered = step_outcome(
            not self._success and check_success(state), self._success, state.steps, self.max_steps, render,
            self.render_every, self.render_on_demand)
        return self.get_observation(render=rendered), reward, self._success, truncated, self._info(rendered)

    def _info(self, rendered: bool) -> dict[str, Any]:
        """Small info dict (LiberoEnv keys): latched success, ids, step counter, rendered flag."""
        s = self.state
        return {"success": self._success, "task": self.prompt, "task_id": self.task_id,
                "init_state_id": s.layout.init_state_id, "policy_step": s.steps, "rendered": rendered}

    def get_observation(self, render: bool = False) -> dict[str, np.ndarray]:
        """Observation of the current state; with ``render=True`` images are rendered if needed.

        Without ``render``, images are included only if the current state was already rendered
        (LiberoEnv semantics: "latest observation").
        """
        s = self.state
        w = s.finger
        obs = {
            "robot0_eef_pos": np.array([s.eef[0], s.eef[1], s.eef[2] + TABLE_Z], dtype=np.float64),
            "robot0_eef_quat": _quat_down_yaw(s.yaw),
            "robot0_gripper_qpos": np.array([w, -w], dtype=np.float64),
            "arena_state": s.to_vector(),
        }
        if render and self._images is None:
            self._images = self._renderer.render(s)
            obs.update(zip(self.image_keys, self._images))
        elif self._images is not None:
            obs.update((key, img.copy()) for key, img in zip(self.image_keys, self._images))
        return obs

    def render(self) -> np.ndarray | None:
        """Upright ``(H, W, 3)`` agent view for ``render_mode="rgb_array"``."""
        if self.render_mode != "rgb_array":
            return None
        agent, _ = self._renderer.render(self.state)
        return upright(agent)
