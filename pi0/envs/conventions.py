"""The single home of the env conventions: camera keys, the wait action, ``upright``, the LIBERO suite table,
and the picklable env factory (:class:`EnvSpec`, :func:`make_env_spec`).

Envs declare their conventions as attributes (``image_keys``, ``wait_action``); the rollout engine reads them from
the env it hosts, never from the constants here. Nothing here imports torch or a simulator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pi0.errors import UserError
from pi0.transforms import rotate_180

__all__ = [
    "CAMERA_KEYS",
    "PROPRIO_KEYS",
    "WAIT_ACTION",
    "LiberoSuite",
    "LIBERO_SUITE_TABLE",
    "LIBERO_SUITES",
    "SUITE_MAX_STEPS",
    "LIBERO_GYM_IDS",
    "ARENA_GYM_ID",
    "EnvSpec",
    "check_libero_suite",
    "libero_env_spec",
    "make_env_spec",
    "upright",
]

# LIBERO's raw camera observation keys (as rendered, i.e. upside down); the arena uses the same keys.
CAMERA_KEYS: tuple[str, ...] = ("agentview_image", "robot0_eye_in_hand_image")
PROPRIO_KEYS: tuple[str, ...] = ("robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos")

# as in openpi examples/libero/main.py: the do-nothing action with the gripper open (-1), stepped while objects
# settle after a reset. A tuple so that it is immutable (usable as a dataclass default); the arena shares it.
WAIT_ACTION: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0)

# MuJoCo renders upside down; ``upright(img)`` turns an (H, W, C) / (B, H, W, C) camera image upright.
upright = rotate_180


class LiberoSuite(NamedTuple):
    """One row of the LIBERO suite table: gym id and openpi's policy-step budget (wait steps excluded)."""

    gym_id: str
    max_steps: int


# as in openpi examples/libero/main.py: per-suite max steps of the LIBERO evaluation.
LIBERO_SUITE_TABLE: dict[str, LiberoSuite] = {
    "libero_spatial": LiberoSuite("libero-spatial-v0", 220),
    "libero_object": LiberoSuite("libero-object-v0", 280),
    "libero_goal": LiberoSuite("libero-goal-v0", 300),
    "libero_10": LiberoSuite("libero-10-v0", 520),
    "libero_90": LiberoSuite("libero-90-v0", 400),
}
LIBERO_SUITES: tuple[str, ...] = tuple(LIBERO_SUITE_TABLE)
SUITE_MAX_STEPS: dict[str, int] = {name: s.max_steps for name, s in LIBERO_SUITE_TABLE.items()}
LIBERO_GYM_IDS: dict[str, str] = {name: s.gym_id for name, s in LIBERO_SUITE_TABLE.items()}
ARENA_GYM_ID = "arena-v0"
METAWORLD_GYM_ID = "metaworld-mt10-v0"


def check_libero_suite(suite: str) -> None:
    """Raise ValueError naming the valid suites unless ``suite`` is one of them."""
    if suite not in LIBERO_SUITE_TABLE:
        raise UserError(f"unknown LIBERO suite {suite!r}; valid suites: {', '.join(LIBERO_SUITES)}")


def step_outcome(succeeded: bool, latched: bool, steps: int, max_steps: int, render: bool | None,
                 render_every: int, render_on_demand: bool) -> tuple[float, bool, bool, bool]:
    """One control step's (reward, latched success = terminated, truncated, rendered), LiberoEnv's semantics:
    reward 1.0 on the step that first succeeds; success latches; truncated when ``max_steps`` steps are used up
    without success; images when ``render`` asks (default: every ``render_every`` steps), always when the env is not
    rendering on demand."""
    reward = 1.0 if succeeded and not latched else 0.0
    latched = latched or succeeded
    truncated = (not latched) and steps >= max_steps
    if render is None:
        render = steps % render_every == 0
    return reward, latched, truncated, bool(render) or not render_on_demand


@dataclass
class EnvSpec:
    """Picklable env factory: ``gym.make(id, **kwargs, **overrides)`` after importing ``register_module``.

    ``register_module`` is imported first so that the project's gym ids are registered in the
    worker (``pi0.envs`` registers ``arena-v0`` and ``libero-*-v0``).
    """

    id: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    register_module: str | None = "pi0.envs"

    def __call__(self, **overrides: Any) -> Any:
        """Create the env (``overrides`` win over ``kwargs``)."""
        import importlib

        import gymnasium as gym

        if self.register_module:
            importlib.import_module(self.register_module)
        return gym.make(self.id, **{**self.kwargs, **overrides})

    def replace(self, **kwargs: Any) -> "EnvSpec":
        """A copy with ``kwargs`` merged into the env kwargs."""
        return EnvSpec(self.id, {**self.kwargs, **kwargs}, self.register_module)


def libero_env_spec(suite: str = "libero_spatial", task_id: int = 0, render_on_demand: bool = True,
                    **kwargs: Any) -> EnvSpec:
    """EnvSpec of a LIBERO suite (render-on-demand); workers switch ``task_id`` per episode."""
    check_libero_suite(suite)
    return EnvSpec(LIBERO_GYM_IDS[suite], {"task_id": task_id, "render_on_demand": render_on_demand, **kwargs})


def make_env_spec(env: str = "libero", suite: str = "libero_spatial", task_id: int = 0, **kwargs: Any) -> EnvSpec:
    """EnvSpec for ``env="libero"`` (a suite), ``env="arena"`` (the fast built-in env) or ``env="metaworld"`` (MT10),
    render-on-demand. MetaWorld renders without shadows or multisampling (``fast_render``, about 7x cheaper frames)
    unless ``fast_render=False``: one default, so warm-start demos, RL rollouts and evaluation see the same images."""
    if env == "libero":
        return libero_env_spec(suite, task_id=task_id, **kwargs)
    if env == "arena":
        return EnvSpec(ARENA_GYM_ID, {"task_id": task_id, "render_on_demand": True, **kwargs})
    if env == "metaworld":
        return EnvSpec(METAWORLD_GYM_ID, {"task_id": task_id, "render_on_demand": True, "fast_render": True, **kwargs})
    raise UserError(f"unknown env {env!r}; choose 'libero', 'arena' or 'metaworld'")

