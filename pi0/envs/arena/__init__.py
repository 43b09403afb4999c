"""Arena: a fast, deterministic, language-conditioned 2-D tabletop manipulation task.

The arena is a small stand-in for LIBERO that is cheap enough to run thousands of steps per
second per core *including* rendering, while keeping LIBERO's observation/action conventions so
that the exact same pi0 LIBERO transforms apply to it.

World model (table frame, metres)
---------------------------------
* The table is the square ``[-L, L]^2`` (``L = 0.25``); ``x`` points right and ``y`` points away
  from the camera (up in the upright top-down image). Heights ``z`` are measured from the table top.
* Four axis-aligned cubic blocks (red, green, blue, yellow) with half size ``S = 0.02``.
* The end effector is a vertical gripper whose tip is a disc of radius ``R = 0.012`` at height ``z``.
  While its tip is below the top of a block at the same place, it pushes that block (disc/square
  contact, resolved in sub-steps so nothing tunnels). It cannot move down through a block top.
* The gripper closes when ``action[6] > 0`` and opens otherwise (LIBERO: -1 open, +1 close). The
  per-finger opening moves by ``0.01`` per step between ``0`` and ``0.04``. When it reaches ``S``
  while the tip sits on the central part of a block top, that block is grasped (the fingers stop at
  ``S``); the held block hangs under the tip and moves with it. Opening releases it: it drops onto
  the highest block under it, or onto the table.
* Actions are LIBERO-like ``Box(-1, 1, (7,))``: dims 0..2 are position deltas scaled by
  ``MAX_DELTA = 0.02`` m per step, dims 3..5 rotation deltas (only a yaw is integrated, it changes
  ``robot0_eef_quat`` and nothing else), dim 6 the gripper.

Observations (LIBERO raw keys and conventions)
----------------------------------------------
``agentview_image`` / ``robot0_eye_in_hand_image``: ``(H, W, 3) uint8`` stored upside down exactly
like MuJoCo renders, i.e. flipped vertically AND horizontally; ``pi0.transforms.rotate_180(img)`` is upright.
``robot0_eef_pos (3,) float64`` (world frame, table top at ``TABLE_Z``), ``robot0_eef_quat (4,)``
xyzw float64 (gripper pointing down, i.e. 180 deg about x, composed with the yaw),
``robot0_gripper_qpos (2,) float64`` = ``[w, -w]`` like the Panda fingers, plus ``arena_state``,
a privileged flat ``float64`` state vector (see :class:`ArenaState`) used by the scripted expert.

Render on demand (same convention as :class:`pi0.envs.libero_env.LiberoEnv`)
-----------------------------------------------------------------------------
With ``render_on_demand=True`` the images are only rendered when asked for: ``step(action,
render=True)`` (``render=None``: every ``render_every``-th step), ``reset(options={"render": ...})``
(default True) or ``get_observation(render=True)``. Observations of steps that were not rendered
do NOT contain the two image keys (absent, never stale) and ``info["rendered"]`` is False. The
rollout workers ask for images only at policy decision points. With ``render_on_demand=False``
(default) every observation carries fresh images. Rendering is a pure function of the state, so a
rendered observation is bit-identical to the always-rendering env's after the same actions.

Files
-----
``world.py`` tasks, state, init-state layouts and physics; ``render.py`` the numpy renderer; ``env.py``
the gymnasium env; ``expert.py`` the scripted expert.

Init states
-----------
Each task has ``num_init_states`` deterministic layouts; ``init_state_id`` selects one. Layout
``k`` of task ``t`` is a pure function of ``(t, k)`` (like LIBERO's fixed init-state files), so any
number of rollouts can start from the same init state.
"""

from pi0.envs.arena.env import ArenaEnv
from pi0.envs.arena.expert import ArenaExpert
from pi0.envs.arena.render import ArenaRenderer
from pi0.envs.arena.world import (
    BLOCK_H,
    BLOCK_NAMES,
    BLUE,
    GREEN,
    NUM_BLOCKS,
    RED,
    SIDE_X,
    TASKS,
    YELLOW,
    ArenaLayout,
    ArenaState,
    ArenaTask,
    L,
    S,
    arena_step,
    check_success,
    make_layout,
    task_id_from_prompt,
)

__all__ = [
    "ArenaEnv",
    "ArenaExpert",
    "ArenaLayout",
    "ArenaRenderer",
    "ArenaState",
    "ArenaTask",
    "BLOCK_H",
    "BLOCK_NAMES",
    "BLUE",
    "GREEN",
    "L",
    "NUM_BLOCKS",
    "RED",
    "S",
    "SIDE_X",
    "TASKS",
    "YELLOW",
    "arena_step",
    "check_success",
    "make_layout",
    "task_id_from_prompt",
]
