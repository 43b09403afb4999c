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

Init states
-----------
Each task has ``num_init_states`` deterministic layouts; ``init_state_id`` selects one. Layout
``k`` of task ``t`` is a pure function of ``(t, k)`` (like LIBERO's fixed init-state files), so any
number of rollouts can start from the same init state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from pi0.transforms import rotate_180

__all__ = [
    "ArenaEnv",
    "ArenaExpert",
    "ArenaLayout",
    "ArenaState",
    "ArenaTask",
    "TASKS",
    "arena_step",
    "check_success",
    "make_layout",
    "task_id_from_prompt",
]

# ----------------------------------------------------------------------------------- constants
L = 0.25  # table half extent (m)
S = 0.02  # block half size (m)
BLOCK_H = 2 * S  # block height (m)
R = 0.012  # gripper tip radius (m)
Z_MAX = 0.2  # highest tip position above the table (m)
MAX_DELTA = 0.02  # metres per step for |action| = 1 (per axis)
MAX_YAW = 0.1  # radians per step for |action[5]| = 1
FINGER_OPEN = 0.04  # per-finger opening (m), like the Panda finger joints
FINGER_SPEED = 0.01  # per step
SUBSTEP = 0.005  # max tip displacement per physics sub-step (m) < R, so nothing tunnels
TABLE_Z = 0.9  # height of the table top in the reported world frame (LIBERO-like)
LIFT_Z = 0.05  # a held block whose bottom is above this counts as lifted
GRASP_XY = 0.75 * S  # the tip must be this close (inf-norm) to a block centre to grasp it
EPS = 1e-9

BLOCK_NAMES = ("red", "green", "blue", "yellow")
RED, GREEN, BLUE, YELLOW = range(4)
NUM_BLOCKS = len(BLOCK_NAMES)
BLOCK_RGB = np.array([[215, 40, 40], [40, 170, 60], [40, 80, 220], [235, 200, 30]], np.uint8)
TABLE_RGB = np.array([196, 164, 122], np.uint8)
BORDER_RGB = np.array([60, 50, 40], np.uint8)

IMAGE_KEYS = ("agentview_image", "robot0_eye_in_hand_image")
DEFAULT_NUM_INIT_STATES = 50


# --------------------------------------------------------------------------------------- tasks
@dataclass(frozen=True)
class ArenaTask:
    """One language-conditioned task: ``kind`` selects the success predicate and the expert."""

    task_id: int
    kind: str  # "push_to_target" | "place_in_zone" | "stack" | "two_in_zone" | "push_to_side"
    prompt: str
    blocks: tuple[int, ...]  # the block(s) the task is about
    fixture_rgb: tuple[int, int, int] | None  # colour of the target / zone drawn on the table
    fixture_half: float  # target radius or zone half size (m)
    max_steps: int  # default episode limit (2-4x the noise-free expert length)


TASKS: tuple[ArenaTask, ...] = (
    ArenaTask(0, "push_to_target", "push the red block onto the blue target", (RED,),
              (130, 170, 255), 0.035, 120),
    ArenaTask(1, "place_in_zone", "pick up the green block and place it in the yellow zone",
              (GREEN,), (250, 232, 150), 0.06, 100),
    ArenaTask(2, "stack", "stack the blue block on top of the red block", (BLUE, RED), None, 0.0, 100),
    ArenaTask(3, "two_in_zone", "put the red block and the green block in the gray zone",
              (RED, GREEN), (150, 150, 150), 0.07, 220),
    ArenaTask(4, "push_to_side", "push the yellow block to the left side of the table", (YELLOW,),
              None, 0.0, 80),
)
SIDE_X = -0.1  # push_to_side succeeds once the block centre is at x <= SIDE_X


def task_id_from_prompt(prompt: str) -> int:
    """Map a task prompt (exact text, case/space-insensitive) back to its task id."""
    key = " ".join(prompt.lower().split())
    for task in TASKS:
        if task.prompt == key:
            return task.task_id
    raise KeyError(f"unknown arena prompt: {prompt!r}")


# --------------------------------------------------------------------------------------- state
@dataclass(frozen=True)
class ArenaLayout:
    """Static part of an init state: which task and where its fixture (target/zone) is."""

    task_id: int
    init_state_id: int
    fixture: tuple[float, float]  # (x, y) of the target / zone centre (unused by some tasks)


@dataclass
class ArenaState:
    """Full dynamic state of the arena (plain Python floats for fast stepping)."""

    eef: list[float]  # [x, y, z] tip position in the table frame
    yaw: float
    finger: float  # per-finger opening (m)
    held: int  # index of the held block, -1 if none
    blocks: list[list[float]]  # NUM_BLOCKS x [x, y, bottom_z]
    lifted: list[bool]  # latched: block was held with its bottom above LIFT_Z
    layout: ArenaLayout
    steps: int = 0

    VECTOR_DIM = 1 + 1 + 3 + 1 + 1 + 1 + 3 * NUM_BLOCKS + NUM_BLOCKS + 2 + 1

    def copy(self) -> "ArenaState":
        """Deep copy (the layout is immutable and shared)."""
        return ArenaState(list(self.eef), self.yaw, self.finger, self.held,
                          [list(b) for b in self.blocks], list(self.lifted), self.layout, self.steps)

    def to_vector(self) -> np.ndarray:
        """Flatten to a float64 vector ``(VECTOR_DIM,)``: task, init id, eef, yaw, finger, held,
        blocks (x, y, bottom), lifted flags, fixture xy, steps."""
        lay = self.layout
        vals = [lay.task_id, lay.init_state_id, *self.eef, self.yaw, self.finger, self.held]
        for b in self.blocks:
            vals.extend(b)
        vals.extend(float(f) for f in self.lifted)
        vals.extend(lay.fixture)
        vals.append(self.steps)
        return np.asarray(vals, dtype=np.float64)

    @classmethod
    def from_vector(cls, vec: np.ndarray) -> "ArenaState":
        """Inverse of :meth:`to_vector` for a ``(VECTOR_DIM,)`` vector."""
        v = [float(x) for x in np.asarray(vec, dtype=np.float64).reshape(-1)]
        if len(v) != cls.VECTOR_DIM:
            raise ValueError(f"arena state vector must have {cls.VECTOR_DIM} entries, got {len(v)}")
        layout = ArenaLayout(int(v[0]), int(v[1]), (v[-3], v[-2]))
        eef, yaw, finger, held = v[2:5], v[5], v[6], int(v[7])
        o = 8
        blocks = [v[o + 3 * i: o + 3 * i + 3] for i in range(NUM_BLOCKS)]
        o += 3 * NUM_BLOCKS
        lifted = [x > 0.5 for x in v[o: o + NUM_BLOCKS]]
        return cls(list(eef), yaw, finger, held, blocks, lifted, layout, int(v[-1]))


# ------------------------------------------------------------------------------------- layouts
_LAYOUT_SEED = 20240611
_MARGIN = 0.05  # blocks and fixtures keep this far from the table edge


def _cheb(a: tuple[float, float] | list[float], b: tuple[float, float] | list[float]) -> float:
    """Chebyshev (inf-norm) distance between two 2-D points."""
    return max(abs(a[0] - b[0]), abs(a[1] - b[1]))


def _segment_clear(p: tuple[float, float], q: tuple[float, float], obstacles: list, clearance: float) -> bool:
    """True if no obstacle centre is within ``clearance`` (inf-norm) of the axis-aligned segment p-q."""
    lo = (min(p[0], q[0]) - clearance, min(p[1], q[1]) - clearance)
    hi = (max(p[0], q[0]) + clearance, max(p[1], q[1]) + clearance)
    return not any(lo[0] < o[0] < hi[0] and lo[1] < o[1] < hi[1] for o in obstacles)


def make_layout(task_id: int, init_state_id: int) -> ArenaState:
    """Deterministic initial state ``init_state_id`` of task ``task_id`` (rejection sampling)."""
    task = TASKS[task_id]
    rng = np.random.default_rng((_LAYOUT_SEED, task_id, init_state_id))
    lo, hi = -L + _MARGIN, L - _MARGIN
    for _ in range(10_000):
        blocks = [[float(x), float(y), 0.0] for x, y in rng.uniform(lo, hi, size=(NUM_BLOCKS, 2))]
        if any(_cheb(blocks[i], blocks[j]) < 0.075 for i in range(NUM_BLOCKS) for j in range(i)):
            continue
        fixture = (0.0, 0.0)
        others = [b for i, b in enumerate(blocks) if i not in task.blocks]
        if task.kind == "push_to_target":
            half = task.fixture_half
            fixture = tuple(float(v) for v in rng.uniform(lo + 0.01, hi - 0.01, size=2))
            c = blocks[task.blocks[0]]
            if math.hypot(c[0] - fixture[0], c[1] - fixture[1]) < 0.09:
                continue
            corner = (fixture[0], c[1])
            if not (_segment_clear((c[0], c[1]), corner, others, 2 * S + R + 0.03)
                    and _segment_clear(corner, fixture, others, 2 * S + R + 0.03)):
                continue
            if any(_cheb(o, fixture) < half + S + 0.02 for o in others):
                continue
        elif task.kind in ("place_in_zone", "two_in_zone"):
            half = task.fixture_half
            fixture = tuple(float(v) for v in rng.uniform(-L + half + 0.01, L - half - 0.01, size=2))
            if any(_cheb(b, fixture) < half + S + 0.015 for b in blocks):
                continue  # zone starts empty, so the task is never solved at reset
        elif task.kind == "stack":
            pass
        elif task.kind == "push_to_side":
            c = blocks[task.blocks[0]]
            c[0] = float(rng.uniform(0.0, hi))
            if any(_cheb(c, b) < 0.075 for i, b in enumerate(blocks) if i != task.blocks[0]):
                continue
            if not _segment_clear((c[0], c[1]), (SIDE_X - 0.04, c[1]), others, 2 * S + R + 0.03):
                continue
        eef_xy = rng.uniform(-0.15, 0.15, size=2)
        if any(_cheb(b, eef_xy) < S + R + 0.02 for b in blocks):
            continue
        state = ArenaState(
            eef=[float(eef_xy[0]), float(eef_xy[1]), 0.1], yaw=0.0, finger=FINGER_OPEN, held=-1,
            blocks=blocks, lifted=[False] * NUM_BLOCKS,
            layout=ArenaLayout(task_id, init_state_id, (float(fixture[0]), float(fixture[1]))),
        )
        if not check_success(state):
            return state
    raise RuntimeError(f"could not sample a layout for task {task_id}, init state {init_state_id}")


# ------------------------------------------------------------------------------------- physics
def _overlap_disc(px: float, py: float, b: list[float]) -> tuple[float, float, float]:
    """Closest-point offset (dx, dy) from block ``b``'s footprint to the tip and its length."""
    qx = min(max(px, b[0] - S), b[0] + S)
    qy = min(max(py, b[1] - S), b[1] + S)
    dx, dy = px - qx, py - qy
    return dx, dy, math.hypot(dx, dy)


def _support_top(state: ArenaState, x: float, y: float, exclude: int) -> float:
    """Height of the highest resting-block top overlapping a block footprint at (x, y), else 0."""
    top = 0.0
    for i, b in enumerate(state.blocks):
        if i != exclude and i != state.held and abs(b[0] - x) < 2 * S and abs(b[1] - y) < 2 * S:
            top = max(top, b[2] + BLOCK_H)
    return top


def _support_below(state: ArenaState, i: int) -> float:
    """Top of the highest resting block under block ``i`` (its footprint overlaps), else 0."""
    b = state.blocks[i]
    top = 0.0
    for j, o in enumerate(state.blocks):
        t = o[2] + BLOCK_H
        if j != i and j != state.held and t <= b[2] + 1e-6 and _cheb(o, b) < 2 * S:
            top = max(top, t)
    return top


def _clamp_block(b: list[float]) -> tuple[float, float]:
    """Keep a block on the table; returns the displacement the walls applied."""
    x = min(max(b[0], -L + S), L - S)
    y = min(max(b[1], -L + S), L - S)
    d = (x - b[0], y - b[1])
    b[0], b[1] = x, y
    return d


def _move_block(state: ArenaState, i: int, dx: float, dy: float) -> None:
    """Translate block ``i`` (and anything stacked on it), then keep it on the table."""
    b = state.blocks[i]
    riders = [j for j, o in enumerate(state.blocks) if j != i and j != state.held
              and abs(o[2] - (b[2] + BLOCK_H)) < 1e-6 and _cheb(o, b) < 2 * S]
    b[0] += dx
    b[1] += dy
    wx, wy = _clamp_block(b)
    for j in riders:
        state.blocks[j][0] += dx + wx
        state.blocks[j][1] += dy + wy
        _clamp_block(state.blocks[j])
    if b[2] > EPS:  # pushed off its support: it falls
        b[2] = _support_below(state, i)


def _separate_blocks(state: ArenaState, i: int) -> None:
    """Push resting blocks at block ``i``'s level out of it along the axis of least penetration."""
    b = state.blocks[i]
    for j, o in enumerate(state.blocks):
        if j == i or j == state.held or abs(o[2] - b[2]) > 1e-6:
            continue
        ox, oy = 2 * S - abs(o[0] - b[0]), 2 * S - abs(o[1] - b[1])
        if ox <= 0 or oy <= 0:
            continue
        if ox < oy:
            d = ox if o[0] >= b[0] else -ox
            _move_block(state, j, d, 0.0)
            rest = 2 * S - abs(o[0] - b[0])  # what the wall did not let j move
            if rest > 1e-12:
                _move_block(state, i, -rest if o[0] >= b[0] else rest, 0.0)
        else:
            d = oy if o[1] >= b[1] else -oy
            _move_block(state, j, 0.0, d)
            rest = 2 * S - abs(o[1] - b[1])
            if rest > 1e-12:
                _move_block(state, i, 0.0, -rest if o[1] >= b[1] else rest)


def arena_step(state: ArenaState, action: np.ndarray | list[float]) -> None:
    """Advance ``state`` in place by one control step for a ``(7,)`` action in [-1, 1]."""
    a = [min(max(float(v), -1.0), 1.0) for v in action[:7]]
    blocks, held = state.blocks, state.held
    dx, dy, dz = a[0] * MAX_DELTA, a[1] * MAX_DELTA, a[2] * MAX_DELTA
    state.yaw = (state.yaw + a[5] * MAX_YAW + math.pi) % (2 * math.pi) - math.pi
    n = max(1, math.ceil(max(abs(dx), abs(dy), abs(dz)) / SUBSTEP - 1e-9))
    sx, sy, sz = dx / n, dy / n, dz / n
    x, y, z = state.eef
    for _ in range(n):
        # Vertical motion: the tip (or the held block) cannot go down through a block top.
        nz = min(max(z + sz, 0.0), Z_MAX)
        if sz < 0:
            if held >= 0:
                floor = _support_top(state, x, y, held) + BLOCK_H
                if z >= floor - EPS:
                    nz = max(nz, floor)
            else:
                for i, b in enumerate(blocks):
                    top = b[2] + BLOCK_H
                    if z >= top - EPS and nz < top and _overlap_disc(x, y, b)[2] < R:
                        nz = top
        z = nz
        # Horizontal motion with disc/square contact against resting blocks at the tip's height.
        x = min(max(x + sx, -L), L)
        y = min(max(y + sy, -L), L)
        if held < 0:
            for i, b in enumerate(blocks):
                if not (b[2] - EPS <= z < b[2] + BLOCK_H - EPS):
                    continue
                ddx, ddy, dist = _overlap_disc(x, y, b)
                if dist >= R:
                    continue
                if dist > 1e-12:
                    pen = R - dist
                    _move_block(state, i, -ddx / dist * pen, -ddy / dist * pen)
                else:  # tip centre inside the footprint (only from a bad start): shortest way out
                    _move_block(state, i, *(-sx, -sy) if (sx or sy) else (0.0, 0.0))
                _separate_blocks(state, i)
                ddx, ddy, dist = _overlap_disc(x, y, b)
                if 1e-12 < dist < R:  # the block is stuck (wall): the tip stops at the contact
                    x += ddx / dist * (R - dist)
                    y += ddy / dist * (R - dist)
        else:
            hb = blocks[held]
            hb[0], hb[1], hb[2] = x, y, z - BLOCK_H
    state.eef = [x, y, z]
    # Gripper.
    close = a[6] > 0.0
    if close:
        if held < 0:
            state.finger = max(0.0, state.finger - FINGER_SPEED)
            if state.finger <= S + EPS:
                best, best_top = -1, -1.0
                for i, b in enumerate(blocks):
                    top = b[2] + BLOCK_H
                    if (_cheb((x, y), b) <= GRASP_XY and top - 0.01 <= z <= top + 0.015 and top > best_top
                            and not any(j != i and abs(o[2] - top) < 1e-6 and _cheb(o, b) < 2 * S
                                        for j, o in enumerate(blocks))):
                        best, best_top = i, top
                if best >= 0:
                    state.held = held = best
                    state.finger = S
                    blocks[best][0], blocks[best][1] = x, y
    else:
        if held >= 0:
            b = blocks[held]
            state.held = -1
            b[2] = _support_top(state, b[0], b[1], held)
            held = -1
        state.finger = min(FINGER_OPEN, state.finger + FINGER_SPEED)
    if held >= 0 and blocks[held][2] > LIFT_Z:
        state.lifted[held] = True
    state.steps += 1


def check_success(state: ArenaState) -> bool:
    """Exact success predicate of the state's task (see :data:`TASKS`)."""
    task = TASKS[state.layout.task_id]
    bl, held = state.blocks, state.held
    fx, fy = state.layout.fixture
    if task.kind == "push_to_target":
        b = bl[task.blocks[0]]
        return held != task.blocks[0] and b[2] < EPS and math.hypot(b[0] - fx, b[1] - fy) <= task.fixture_half
    if task.kind == "place_in_zone":
        i = task.blocks[0]
        return held != i and state.lifted[i] and _cheb(bl[i], (fx, fy)) <= task.fixture_half
    if task.kind == "stack":
        top, bottom = task.blocks
        t, b = bl[top], bl[bottom]
        return (held not in (top, bottom) and abs(t[2] - (b[2] + BLOCK_H)) < 1e-6
                and _cheb(t, b) <= 0.5 * S)
    if task.kind == "two_in_zone":
        return all(held != i and _cheb(bl[i], (fx, fy)) <= task.fixture_half for i in task.blocks)
    if task.kind == "push_to_side":
        i = task.blocks[0]
        return held != i and bl[i][2] < EPS and bl[i][0] <= SIDE_X
    raise ValueError(task.kind)


# ----------------------------------------------------------------------------------- rendering
class _Renderer:
    """Cheap numpy renderer drawing directly in the flipped (MuJoCo-like) image frame."""

    def __init__(self, height: int, width: int) -> None:
        self.h, self.w = height, width
        self._bg_cache: dict[tuple[int, int], np.ndarray] = {}
        self._stamps: dict[int, tuple[np.ndarray, int]] = {}
        self._wrist_r = np.arange(height, dtype=np.float64) - (height - 1) / 2
        self._wrist_c = np.arange(width, dtype=np.float64) - (width - 1) / 2

    # flipped frame: row grows with +y, column grows with -x (upright = rotate_180(img))
    def row(self, y: float) -> float:
        """Continuous flipped-frame row of world ``y``."""
        return (y + L) / (2 * L) * self.h

    def col(self, x: float) -> float:
        """Continuous flipped-frame column of world ``x``."""
        return (L - x) / (2 * L) * self.w

    def _rect(self, img: np.ndarray, x: float, y: float, hx: float, hy: float, rgb: np.ndarray) -> None:
        """Fill the world rectangle centred at (x, y) with half sizes (hx, hy)."""
        r0, r1 = int(round(self.row(y - hy))), int(round(self.row(y + hy)))
        c0, c1 = int(round(self.col(x + hx))), int(round(self.col(x - hx)))
        img[max(r0, 0):max(r1, 0), max(c0, 0):max(c1, 0)] = rgb

    def _stamp(self, radius: int) -> tuple[np.ndarray, int]:
        """Boolean disc mask of pixel radius ``radius``."""
        if radius not in self._stamps:
            g = np.arange(-radius, radius + 1)
            self._stamps[radius] = ((g[:, None] ** 2 + g[None, :] ** 2) <= radius * radius + radius, radius)
        return self._stamps[radius]

    def _disc(self, img: np.ndarray, r: float, c: float, radius: int, rgb: np.ndarray) -> None:
        """Draw a filled disc centred at continuous pixel (r, c)."""
        mask, rad = self._stamp(radius)
        ri, ci = int(r), int(c)
        r0, c0 = ri - rad, ci - rad
        r1, c1 = r0 + mask.shape[0], c0 + mask.shape[1]
        mr0, mc0 = max(0, -r0), max(0, -c0)
        mr1 = mask.shape[0] - max(0, r1 - img.shape[0])
        mc1 = mask.shape[1] - max(0, c1 - img.shape[1])
        if mr1 <= mr0 or mc1 <= mc0:
            return
        region = img[r0 + mr0: r0 + mr1, c0 + mc0: c0 + mc1]
        region[mask[mr0:mr1, mc0:mc1]] = rgb

    def background(self, layout: ArenaLayout) -> np.ndarray:
        """Table + task fixture image ``(H, W, 3) uint8`` for a layout (cached)."""
        key = (layout.task_id, layout.init_state_id)
        bg = self._bg_cache.get(key)
        if bg is None:
            if len(self._bg_cache) > 256:
                self._bg_cache.clear()
            task = TASKS[layout.task_id]
            bg = np.empty((self.h, self.w, 3), np.uint8)
            bg[:] = TABLE_RGB
            # faint grid lines every 5 cm give the wrist camera some texture
            for v in np.arange(-L, L + 1e-9, 0.05):
                r, c = int(self.row(v)), int(self.col(v))
                bg[min(max(r, 0), self.h - 1), :] = TABLE_RGB - 14
                bg[:, min(max(c, 0), self.w - 1)] = TABLE_RGB - 14
            if task.fixture_rgb is not None:
                rgb = np.array(task.fixture_rgb, np.uint8)
                fx, fy = layout.fixture
                if task.kind == "push_to_target":
                    rr = (np.arange(self.h) + 0.5)[:, None]
                    cc = (np.arange(self.w) + 0.5)[None, :]
                    scale = self.h / (2 * L)
                    d2 = ((rr - self.row(fy)) ** 2 + ((cc - self.col(fx)) * self.h / self.w) ** 2)
                    bg[d2 <= (task.fixture_half * scale) ** 2] = rgb
                else:
                    self._rect(bg, fx, fy, task.fixture_half, task.fixture_half, rgb)
            self._bg_cache[key] = bg
        return bg

    def render(self, state: ArenaState) -> tuple[np.ndarray, np.ndarray]:
        """Render (agentview, wrist) images, both ``(H, W, 3) uint8`` in the flipped frame."""
        img = self.background(state.layout).copy()
        order = sorted(range(NUM_BLOCKS), key=lambda i: (i == state.held, state.blocks[i][2]))
        for i in order:
            bx, by, bz = state.blocks[i]
            grow = 1.0 + 2.5 * bz  # higher blocks look bigger (perspective cue)
            if bz > EPS:
                self._rect(img, bx, by, S * grow + 0.002, S * grow + 0.002, BORDER_RGB)
            self._rect(img, bx, by, S * grow, S * grow, BLOCK_RGB[i])
        # Wrist camera: zoomed crop around the tip (before the tip itself is drawn), field of
        # view grows with height.
        x, y, z = state.eef
        half_view = 0.08 + 0.5 * z  # metres visible either side of the tip
        scale = half_view / L  # agentview pixels per wrist pixel
        rows = np.floor(self.row(y) + self._wrist_r * scale).astype(np.intp)
        cols = np.floor(self.col(x) + self._wrist_c * scale).astype(np.intp)
        vr, vc = (rows >= 0) & (rows < self.h), (cols >= 0) & (cols < self.w)
        wrist = img.take(np.clip(rows, 0, self.h - 1), axis=0).take(np.clip(cols, 0, self.w - 1), axis=1)
        if not vr.all():
            wrist[~vr] = BORDER_RGB
        if not vc.all():
            wrist[:, ~vc] = BORDER_RGB
        # fingers: two dark bars whose gap follows the finger opening
        gap = (state.finger + 0.004) / (2 * half_view) * self.w
        fw = max(2, self.w // 32)
        r0, r1 = int(self.h * 0.38), int(self.h * 0.62)
        cmid = self.w / 2
        for c in (cmid - gap - fw, cmid + gap):
            c0 = int(round(c))
            wrist[r0:r1, max(c0, 0):max(c0 + fw, 0)] = (45, 45, 50)
        # Tip in the scene view: disc growing with height, inner colour shows the gripper state.
        rad = max(2, int(round((R + 0.05 * z) / (2 * L) * self.h)) + 1)
        r, c = self.row(y), self.col(x)
        self._disc(img, r, c, rad, np.array((50, 50, 55), np.uint8))
        inner = (235, 235, 235) if state.finger > FINGER_OPEN - EPS else (15, 15, 15)
        self._disc(img, r, c, max(1, rad - 2), np.array(inner, np.uint8))
        return img, wrist


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
        self._renderer = _Renderer(h, w)
        self._seed = seed
        self._seeded = False
        self._state: ArenaState | None = None
        self._images: tuple[np.ndarray, np.ndarray] | None = None  # images of the current state
        self._success = False
        img = spaces.Box(0, 255, self.image_shape, np.uint8)
        self.observation_space = spaces.Dict({
            "agentview_image": img,
            "robot0_eye_in_hand_image": img,
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
        reward = 0.0
        if not self._success and check_success(state):
            self._success = True
            reward = 1.0
        terminated = self._success
        truncated = (not terminated) and state.steps >= self.max_steps
        if render is None:
            render = state.steps % self.render_every == 0
        rendered = bool(render) or not self.render_on_demand
        return self.get_observation(render=rendered), reward, terminated, truncated, self._info(rendered)

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
            obs["agentview_image"], obs["robot0_eye_in_hand_image"] = self._images
        elif self._images is not None:
            obs["agentview_image"] = self._images[0].copy()
            obs["robot0_eye_in_hand_image"] = self._images[1].copy()
        return obs

    def render(self) -> np.ndarray | None:
        """Upright ``(H, W, 3)`` agent view for ``render_mode="rgb_array"``."""
        if self.render_mode != "rgb_array":
            return None
        agent, _ = self._renderer.render(self.state)
        return rotate_180(agent)


# --------------------------------------------------------------------------------------- expert
CLEAR_Z = 0.095  # travel height: a held block (bottom = z - BLOCK_H) clears a single block
PUSH_Z = 0.012  # tip height while pushing (below a block top)


def _toward(cur: float, goal: float) -> float:
    """Action component moving ``cur`` to ``goal`` as fast as possible (in [-1, 1])."""
    return min(max((goal - cur) / MAX_DELTA, -1.0), 1.0)


class ArenaExpert:
    """Scripted state-based expert for every arena task, with Gaussian action noise.

    ``act(state)`` is a memoryless closed-loop controller. ``predict_chunk(state, horizon)``
    rolls the controller forward through the (deterministic) arena dynamics, so executing the
    chunk open loop reproduces closed-loop behaviour exactly. Noise (std ``noise`` in action
    units) is added to the position dims and, with probability ``gripper_flip_prob``, the gripper
    command is flipped.
    """

    def __init__(self, noise: float = 0.0, seed: int | None = None, gripper_flip_prob: float = 0.0) -> None:
        """Create an expert; ``seed`` seeds the noise generator."""
        self.noise = float(noise)
        self.gripper_flip_prob = float(gripper_flip_prob)
        self.rng = np.random.default_rng(seed)

    # ------------------------------------------------------------- primitives
    @staticmethod
    def _pick_place(s: ArenaState, i: int, goal: tuple[float, float]) -> list[float]:
        """Action that picks block ``i`` and releases it centred over ``goal``.

        Phases are chosen from the state alone (memoryless), and x/y are corrected while moving
        vertically, so moderate action noise only slows the expert down.
        """
        x, y, z = s.eef
        b = s.blocks[i]
        a = [0.0] * 7
        if s.held == i:
            a[6] = 1.0
            err = max(abs(goal[0] - x), abs(goal[1] - y))
            release_z = _support_top(s, goal[0], goal[1], i) + BLOCK_H + 0.004
            if err > 0.008:
                a[2] = _toward(z, CLEAR_Z + 0.01)
                if z >= CLEAR_Z - 0.01 or err < 0.02:
                    a[0], a[1] = _toward(x, goal[0]), _toward(y, goal[1])
            else:
                a[0], a[1] = _toward(x, goal[0]), _toward(y, goal[1])
                if z > release_z + 0.003:
                    a[2] = _toward(z, release_z)
                elif err <= 0.005:
                    a[6] = -1.0
            return a
        a[6] = -1.0
        if s.held >= 0:  # holding the wrong block: let it go and move up
            a[2] = 1.0
            return a
        top = b[2] + BLOCK_H
        err = max(abs(b[0] - x), abs(b[1] - y))
        if err > 0.015:
            travel = max(top, _obstacle_top(s, i)) + 0.01
            a[2] = _toward(z, max(travel + 0.005, min(z, CLEAR_Z)))
            if z >= travel:
                a[0], a[1] = _toward(x, b[0]), _toward(y, b[1])
            return a
        a[0], a[1] = _toward(x, b[0]), _toward(y, b[1])
        if z > top + 0.004:
            a[2] = _toward(z, top)
        elif s.finger <= EPS:
            a[2] = 0.5  # failed grasp with a fully closed gripper: open and retry
        elif err <= 0.8 * GRASP_XY or s.finger < FINGER_OPEN - EPS:
            a[6] = 1.0
        return a

    @staticmethod
    def _push(s: ArenaState, i: int, goal: tuple[float, float], axes: tuple[int, ...] = (0, 1)) -> list[float]:
        """Action pushing block ``i`` to ``goal`` in axis-aligned legs (x first, then y)."""
        x, y, z = s.eef
        p = (x, y)
        c = s.blocks[i]
        a = [0.0] * 7
        a[6] = -1.0
        axis = None
        for k in axes:
            if abs(goal[k] - c[k]) > 0.006:
                axis = k
                break
        if axis is None:
            a[2] = _toward(z, CLEAR_Z)
            return a
        o = 1 - axis
        sgn = 1.0 if goal[axis] > c[axis] else -1.0
        behind = sgn * (c[axis] - p[axis])  # > 0: tip is behind the block w.r.t. the push
        reach = S + R
        top = c[2] + BLOCK_H
        in_pose = abs(p[o] - c[o]) <= 0.5 * S and reach - 0.002 <= behind <= reach + 0.02 and z < top - 0.012
        if in_pose:
            err = abs(goal[axis] - c[axis])
            step = sgn * min(MAX_DELTA, err + (behind - reach))
            mv = [0.0, 0.0]
            mv[axis] = step / MAX_DELTA
            mv[o] = _toward(p[o], c[o])
            a[0], a[1] = mv
            a[2] = _toward(z, PUSH_Z)
            return a
        contact = [c[0], c[1]]
        contact[axis] = c[axis] - sgn * (reach + 0.012)
        err = max(abs(contact[0] - x), abs(contact[1] - y))
        if err > 0.008:
            travel = _obstacle_top(s, -1) + 0.01
            a[2] = _toward(z, travel + 0.005)
            if z >= travel:
                a[0], a[1] = _toward(x, contact[0]), _toward(y, contact[1])
        else:
            a[0], a[1] = _toward(x, contact[0]), _toward(y, contact[1])
            a[2] = _toward(z, PUSH_Z)
        return a

    # --------------------------------------------------------------- control
    def clean_action(self, s: ArenaState) -> np.ndarray:
        """Noise-free expert action ``(7,)`` for state ``s``."""
        task = TASKS[s.layout.task_id]
        fx, fy = s.layout.fixture
        if check_success(s):
            a = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, -1.0]
        elif task.kind == "push_to_target":
            a = self._push(s, task.blocks[0], (fx, fy))
        elif task.kind == "place_in_zone":
            a = self._pick_place(s, task.blocks[0], (fx, fy))
        elif task.kind == "stack":
            top, bottom = task.blocks
            a = self._pick_place(s, top, (s.blocks[bottom][0], s.blocks[bottom][1]))
        elif task.kind == "two_in_zone":
            half = task.fixture_half
            spots = ((fx - 0.035, fy), (fx + 0.035, fy))
            a = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, -1.0]
            for i, spot in zip(task.blocks, spots):
                if s.held == i or _cheb(s.blocks[i], (fx, fy)) > half - 0.01:
                    a = self._pick_place(s, i, spot)
                    break
        elif task.kind == "push_to_side":
            i = task.blocks[0]
            a = self._push(s, i, (SIDE_X - 0.03, s.blocks[i][1]), axes=(0,))
        else:
            raise ValueError(task.kind)
        return np.asarray(a, dtype=np.float64)

    def act(self, s: ArenaState) -> np.ndarray:
        """Expert action ``(7,)`` with this expert's noise applied (clipped to [-1, 1])."""
        a = self.clean_action(s)
        if self.noise > 0:
            a[:3] += self.rng.normal(0.0, self.noise, size=3)
        if self.gripper_flip_prob > 0 and self.rng.random() < self.gripper_flip_prob:
            a[6] = -a[6]
        return np.clip(a, -1.0, 1.0)

    def predict_chunk(self, s: ArenaState, horizon: int) -> np.ndarray:
        """Open-loop chunk ``(horizon, 7)`` obtained by simulating the closed-loop expert."""
        sim = s.copy()
        out = np.empty((horizon, 7), dtype=np.float64)
        for t in range(horizon):
            out[t] = self.act(sim)
            arena_step(sim, out[t])
        return out


def _obstacle_top(s: ArenaState, exclude: int) -> float:
    """Highest block top in the arena other than ``exclude`` (travel clearance)."""
    return max((b[2] + BLOCK_H for j, b in enumerate(s.blocks) if j != exclude), default=0.0)
