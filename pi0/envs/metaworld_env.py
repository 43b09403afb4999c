"""MetaWorld (Farama's ``metaworld``, MuJoCo) as a gymnasium env with LIBERO's observation and action conventions.

Conventions (the same keys and spaces as :class:`pi0.envs.libero_env.LiberoEnv` and the arena, so the runner, the
policy I/O and the warm start need no MetaWorld-specific path):

- Tasks: ``MT10`` (``task_id`` 0..9, the MT10 benchmark's tasks), each with a short instruction naming its objects.
- Init states: ``init_state_id`` k is MetaWorld's own pre-sampled task variation k % 50 of ``MT1(task, seed=k // 50)``:
  deterministic per (task, id), so K rollouts start from the same state; ids ``0..num_init_states-1``.
- Cameras (``CAMERA_KEYS``): ``agentview_image`` = the fixed ``corner`` scene camera, ``robot0_eye_in_hand_image`` =
  ``gripperPOV``; rendered only when asked (``render_on_demand``), as LIBERO's workers do. ``fast_render=True`` turns
  off MuJoCo's shadow and reflection passes (under llvmpipe 88 -> 20 ms for both 64-px cameras) and its 4x
  multisampling (a further 24 -> 14 ms on another 2-core machine): the same geometry and colours, without cast shadows
  and with aliased edges (``RENDER_TAG``). Without those passes it also skips the geoms outside each camera's view
  (:mod:`pi0.envs.frustum_cull`: the same pixels; the wrist camera no longer draws the arm behind it). Every runner of
  the package uses it. A process keeps one renderer per task (:class:`SceneRenderer`) for all its envs of that task.
- Proprio: ``robot0_eef_pos`` = the hand position, ``robot0_eef_quat`` = a constant gripper-down quaternion (MetaWorld
  does not rotate the hand), ``robot0_gripper_qpos`` = (o, -o) with o MetaWorld's gripper opening (obs[3]), so the
  client's 8-D state is (hand xyz, constant axis-angle, o, -o).
- Actions: LIBERO's 7-D (dx, dy, dz, droll, dpitch, dyaw, gripper); MetaWorld uses (dx, dy, dz, gripper) = dims
  0, 1, 2 and 6 (the rotation dims are ignored, and a policy learns to leave them at 0).
- Success: MetaWorld's own ``info["success"]``, latched; ``max_steps`` per episode (default 200 of MetaWorld's 500).
- ``expert_chunks=True``: every observation also carries ``expert_chunk`` (H, 7), the task's scripted expert rolled
  ``expert_horizon`` steps ahead from the current simulator state (state saved and restored), for demonstrations (``pi0.rollout.policies.collect_metaworld_demos``).
"""

from __future__ import annotations

import atexit
import os
from functools import lru_cache
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from pi0.envs.conventions import CAMERA_KEYS, WAIT_ACTION, step_outcome
from pi0.envs.frustum_cull import FrustumCuller

# (MetaWorld env name, instruction): the MT10 benchmark's tasks
MT10_TASKS: tuple[tuple[str, str], ...] = (
    ("reach-v3", "reach the red goal with the gripper"),
    ("push-v3", "push the puck to the goal"),
    ("pick-place-v3", "pick up the puck and place it at the goal"),
    ("door-open-v3", "open the door"),
    ("drawer-open-v3", "open the drawer"),
    ("button-press-topdown-v3", "press the button from the top"),
    ("peg-insert-side-v3", "insert the peg into the hole from the side"),
    ("window-open-v3", "slide the window open"),
    ("window-close-v3", "slide the window closed"),
    ("drawer-close-v3", "close the drawer"),
)
VARIATIONS = 50  # pre-sampled variations per MT1 benchmark (one MetaWorld seed)
SCENE_CAMERA, WRIST_CAMERA = "corner", "gripperPOV"
# what fast_render draws, in the cache key of every MetaWorld warm start (a start trained on other images is another)
RENDER_TAG = "fast-render: no shadows, reflections or multisampling"
_DOWN_QUAT = np.array([1.0, 0.0, 0.0, 0.0])  # xyzw: 180 deg about x (gripper pointing down), as LIBERO's eef


@lru_cache(maxsize=64)
def _benchmark(name: str, seed: int) -> Any:
    """``metaworld.MT1(name, seed)`` (cached per worker: building one samples its 50 variations)."""
    import metaworld

    return metaworld.MT1(name, seed=seed)


def expert_policy(name: str) -> Any:
    """MetaWorld's scripted expert of task ``name`` (``metaworld.policies.ENV_POLICY_MAP``)."""
    from metaworld.policies import ENV_POLICY_MAP

    return ENV_POLICY_MAP[name]()


class MetaWorldEnv(gym.Env):
    """MT10 tasks with LIBERO-compatible observations and actions (module docstring)."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 20}
    supports_task_switch = True
    # a switch rebuilds the MuJoCo sim (about 125 ms with both 64-px renders, a same-task reset about 25 ms; it also
    # built a renderer, about 1 s, before renderers were shared): the runner prefers a worker whose env already has
    # the episode's task
    cheap_task_switch = False
    image_keys: tuple[str, ...] = CAMERA_KEYS
    wait_action: tuple[float, ...] = WAIT_ACTION

    def __init__(self, task_id: int = 0, init_state_id: int = 0, max_steps: int = 200, render_on_demand: bool = False,
                 render_every: int = 5, resolution: int = 128, num_init_states: int = 1000, seed: int | None = None,
                 expert_chunks: bool = False, expert_horizon: int = 10, render_mode: str | None = None,
                 fast_render: bool = False) -> None:
        super().__init__()
        if max_steps < 1 or render_every < 1 or resolution < 16:
            raise ValueError(f"max_steps, render_every must be >= 1 and resolution >= 16; got {max_steps}, "
                             f"{render_every}, {resolution}")
        self.num_init_states = int(num_init_states)
        self.task_id = self._check_task(task_id)
        self.init_state_id = self._check_init(init_state_id)
        self.max_steps, self.render_on_demand, self.render_every = int(max_steps), bool(render_on_demand), render_every
        self.resolution, self.render_mode, self.fast_render = int(resolution), render_mode, bool(fast_render)
        self.expert_chunks, self.expert_horizon = bool(expert_chunks), int(expert_horizon)
        self._seed = seed
        self._env: Any = None  # the MetaWorld env of the current task (re-created on a task switch)
        self._env_task = -1
        self._renderer: SceneRenderer | None = None  # shared by this process's envs of the task (SceneRenderer)
        self._raw: np.ndarray | None = None  # MetaWorld's 39-D observation
        self._images: tuple[np.ndarray, ...] | None = None
        self._steps, self._success = 0, False
        img = spaces.Box(0, 255, (self.resolution, self.resolution, 3), np.uint8)
        self.observation_space = spaces.Dict({
            **{k: img for k in self.image_keys},
            "robot0_eef_pos": spaces.Box(-np.inf, np.inf, (3,), np.float64),
            "robot0_eef_quat": spaces.Box(-1.0, 1.0, (4,), np.float64),
            "robot0_gripper_qpos": spaces.Box(-np.inf, np.inf, (2,), np.float64),
            "metaworld_obs": spaces.Box(-np.inf, np.inf, (39,), np.float64)})
        self.action_space = spaces.Box(-1.0, 1.0, (7,), np.float32)

    # ---------------------------------------------------------------- checks and properties
    @staticmethod
    def _check_task(task_id: int) -> int:
        if not 0 <= int(task_id) < len(MT10_TASKS):
            raise ValueError(f"unknown MetaWorld task id {task_id}: MT10 task ids are 0..{len(MT10_TASKS) - 1} "
                             f"({', '.join(n for n, _ in MT10_TASKS)})")
        return int(task_id)

    def _check_init(self, init_state_id: int) -> int:
        if not 0 <= int(init_state_id) < self.num_init_states:
            raise ValueError(f"init_state_id must be in [0, {self.num_init_states}), got {init_state_id}")
        return int(init_state_id)

    @property
    def task_name(self) -> str:
        return MT10_TASKS[self.task_id][0]

    @property
    def prompt(self) -> str:
        """Language instruction of the current task."""
        return MT10_TASKS[self.task_id][1]

    task_description = prompt

    @property
    def policy_steps(self) -> int:
        return self._steps

    # ---------------------------------------------------------------- gym API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict, dict]:
        """Reset to init state ``options["init_state_id"]`` of task ``options["task_id"]`` (defaults: the current
        ones); ``options["render"]`` (default True) asks for images when rendering on demand."""
        super().reset(seed=seed if seed is not None else self._seed)
        options = options or {}
        if options.get("task_id") is not None:
            self.task_id = self._check_task(options["task_id"])
        if options.get("init_state_id") is not None:
            self.init_state_id = self._check_init(options["init_state_id"])
        if self._env_task != self.task_id:
            self._close_sim()
            bench = _benchmark(self.task_name, 0)
            self._env = bench.train_classes[self.task_name]()
            self._env.max_path_length = 10**6  # this wrapper truncates at max_steps
            self._env_task = self.task_id
        bench = _benchmark(self.task_name, self.init_state_id // VARIATIONS)
        self._env.set_task(bench.train_tasks[self.init_state_id % VARIATIONS])
        self._raw, _ = self._env.reset(seed=0)
        self._steps, self._success, self._images = 0, False, None
        rendered = bool(options.get("render", True)) or not self.render_on_demand
        return self.get_observation(render=rendered), self._info(rendered)

    def step(self, action: np.ndarray, render: bool | None = None) -> tuple[dict, float, bool, bool, dict]:
        """One control step for a LIBERO ``(7,)`` action (dims 0-2 and 6 reach MetaWorld)."""
        if self._raw is None:
            raise RuntimeError("call reset() first")
        a = np.asarray(action, np.float64).reshape(-1)
        if a.shape != (7,):
            raise ValueError(f"MetaWorld actions are LIBERO's (7,), got shape {a.shape}")
        self._raw, _, _, _, info = self._env.step(np.clip(a[[0, 1, 2, 6]], -1.0, 1.0).astype(np.float32))
        self._steps += 1
        self._images = None
        reward, self._success, truncated, rendered = step_outcome(
            bool(info["success"]), self._success, self._steps, self.max_steps, render, self.render_every,
            self.render_on_demand)
        return self.get_observation(render=rendered), reward, self._success, truncated, self._info(rendered)

    def _info(self, rendered: bool) -> dict[str, Any]:
        return {"success": self._success, "task": self.prompt, "task_id": self.task_id,
                "init_state_id": self.init_state_id, "policy_step": self._steps, "rendered": rendered}

    # ---------------------------------------------------------------- observations
    def _render(self) -> tuple[np.ndarray, np.ndarray]:
        """(scene, wrist) images (R, R, 3) uint8 of the current simulator state."""
        if self._renderer is None:
            self._renderer = SceneRenderer.shared(self._env.model, self.task_name, self.resolution, self.fast_render)
        return (self._renderer.render(self._env.model, self._env.data, SCENE_CAMERA),
                self._renderer.render(self._env.model, self._env.data, WRIST_CAMERA))

    def get_observation(self, render: bool = False) -> dict[str, np.ndarray]:
        """The current observation (images only if ``render`` or already rendered at this state)."""
        raw = np.asarray(self._raw, np.float64)
        o = float(raw[3])
        obs = {"robot0_eef_pos": raw[0:3].copy(), "robot0_eef_quat": _DOWN_QUAT.copy(),
               "robot0_gripper_qpos": np.array([o, -o]), "metaworld_obs": raw.copy()}
        if render and self._images is None:
            self._images = self._render()
        if self._images is not None:
            obs.update((k, img.copy()) for k, img in zip(self.image_keys, self._images))
        if self.expert_chunks:
            obs["expert_chunk"] = self.expert_chunk(self.expert_horizon)
        return obs

    def expert_chunk(self, horizon: int) -> np.ndarray:
        """The scripted expert's next ``horizon`` actions (H, 7) from the current state (closed loop in a saved /
        restored copy of the simulator, so executing the chunk open loop reproduces the expert)."""
        import copy

        import mujoco

        env = self._env
        spec = mujoco.mjtState.mjSTATE_INTEGRATION  # everything the integrator reads (incl. warm start, mocap)
        saved = np.empty(mujoco.mj_stateSize(env.model, spec))
        mujoco.mj_getState(env.model, env.data, saved, spec)
        attrs = {k: copy.deepcopy(getattr(env, k)) for k in ("_prev_obs", "_last_stable_obs", "curr_path_length")
                 if hasattr(env, k)}
        raw, pol, out = self._raw, expert_policy(self.task_name), []
        for _ in range(horizon):
            a = np.clip(pol.get_action(raw), -1.0, 1.0)
            out.append([a[0], a[1], a[2], 0.0, 0.0, 0.0, a[3]])
            raw, *_ = env.step(a.astype(np.float32))
        mujoco.mj_setState(env.model, env.data, saved, spec)
        mujoco.mj_forward(env.model, env.data)
        for k, v in attrs.items():
            setattr(env, k, v)
        return np.asarray(out, np.float64)

    def render(self) -> np.ndarray | None:
        if self.render_mode != "rgb_array" or self._env is None:
            return None
        return self._render()[0]

    def _close_sim(self) -> None:
        self._renderer = None  # the shared renderer stays for the process's other envs of the task
        if self._env is not None:
            self._env.close()
            self._env = None

    def close(self) -> None:
        self._close_sim()


class SceneRenderer:
    """The offscreen renderer of one task's scene, shared by every env of that task in this process.

    A ``mujoco.Renderer`` owns a GL context and uploads the model's meshes and textures into it: about 0.3 s and
    70-170 MB under llvmpipe. An env switching tasks would pay that at every switch (py-spy: 13% of a worker's time
    in the RL bench), and 32 envs in one process hold 32 of them (5 GB). The envs of one task share one MJCF, so
    the meshes and textures are the same: one renderer per (task, size, quality) serves them all, each frame built
    from the env's own model and data (``mjv_updateScene``), as ``mujoco.Renderer.update_scene`` would from its
    own. Not thread-safe: a process renders from one thread (the env servers and the in-process runner do).
    """

    _shared: dict[tuple[str, int, bool], SceneRenderer] = {}
    _at_exit = False  # close_all is registered with atexit

    def __init__(self, model: Any, resolution: int, fast_render: bool) -> None:
        import copy

        import mujoco

        self._mj = mujoco
        model = copy.copy(model)  # the renderer's own copy: its context outlives any env's model
        if fast_render:  # read by the renderer's context, so set before it is made (module docstring)
            model.vis.quality.offsamples = 0  # one sample per pixel
            model.vis.quality.shadowsize = 0  # no shadow map: the shadow pass is off (saves 64 MB per context)
        # llvmpipe (Mesa's CPU rasterizer) splits each frame over a thread per core; for frames this small the
        # hand-offs cost more than they save (the images are the same). Read when this process first renders.
        os.environ.setdefault("LP_NUM_THREADS", "1")
        self.resolution = int(resolution)
        self.renderer = mujoco.Renderer(model, self.resolution, self.resolution)
        self.option = mujoco.MjvOption()
        self.culler: FrustumCuller | None = None
        if fast_render:  # skip the extra shadow-map and mirror passes (module docstring)
            for flag in (mujoco.mjtRndFlag.mjRND_SHADOW, mujoco.mjtRndFlag.mjRND_REFLECTION):
                self.renderer.scene.flags[flag] = 0
            # without those passes a geom outside the view adds nothing to the image: skip its vertices
            self.culler = FrustumCuller(model)
        self.cameras: dict[str, Any] = {}
        for name in (SCENE_CAMERA, WRIST_CAMERA):
            cam = mujoco.MjvCamera()
            cam.type, cam.fixedcamid = mujoco.mjtCamera.mjCAMERA_FIXED, mujoco.mj_name2id(
                model, mujoco.mjtObj.mjOBJ_CAMERA, name)
            self.cameras[name] = cam

    @classmethod
    def shared(cls, model: Any, task: str, resolution: int, fast_render: bool) -> SceneRenderer:
        """This process's renderer of ``task`` at ``resolution`` (made from ``model`` on first use)."""
        key = (task, int(resolution), bool(fast_render))
        if key not in cls._shared:
            if not cls._at_exit:  # free the GL contexts before the interpreter tears down the GL bindings
                atexit.register(cls.close_all)
                cls._at_exit = True
            cls._shared[key] = cls(model, resolution, fast_render)
        return cls._shared[key]

    @classmethod
    def close_all(cls) -> None:
        """Free every shared renderer of this process (the next render makes a new one)."""
        for r in cls._shared.values():
            r.renderer.close()
        cls._shared.clear()

    def render(self, model: Any, data: Any, camera: str) -> np.ndarray:
        """(R, R, 3) uint8: ``camera``'s view of the env's ``model`` / ``data``."""
        mj, scene = self._mj, self.renderer.scene
        mj.mjv_updateScene(model, data, self.option, None, self.cameras[camera], mj.mjtCatBit.mjCAT_ALL, scene)
        if self.culler is not None:
            self.culler.cull_scene(data, scene, self.resolution, self.resolution)
        return self.renderer.render().copy()


__all__ = ["MT10_TASKS", "MetaWorldEnv", "SceneRenderer", "expert_policy"]
