"""Arena task definitions, state, init-state layouts and physics (pure Python floats, no rendering)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

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


def cheb(a: tuple[float, float] | list[float], b: tuple[float, float] | list[float]) -> float:
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
        if any(cheb(blocks[i], blocks[j]) < 0.075 for i in range(NUM_BLOCKS) for j in range(i)):
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
            if any(cheb(o, fixture) < half + S + 0.02 for o in others):
                continue
        elif task.kind in ("place_in_zone", "two_in_zone"):
            half = task.fixture_half
            fixture = tuple(float(v) for v in rng.uniform(-L + half + 0.01, L - half - 0.01, size=2))
            if any(cheb(b, fixture) < half + S + 0.015 for b in blocks):
                continue  # zone starts empty, so the task is never solved at reset
        elif task.kind == "stack":
            pass
        elif task.kind == "push_to_side":
            c = blocks[task.blocks[0]]
            c[0] = float(rng.uniform(0.0, hi))
            if any(cheb(c, b) < 0.075 for i, b in enumerate(blocks) if i != task.blocks[0]):
                continue
            if not _segment_clear((c[0], c[1]), (SIDE_X - 0.04, c[1]), others, 2 * S + R + 0.03):
                continue
        eef_xy = rng.uniform(-0.15, 0.15, size=2)
        if any(cheb(b, eef_xy) < S + R + 0.02 for b in blocks):
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


def support_top(state: ArenaState, x: float, y: float, exclude: int) -> float:
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
        if j != i and j != state.held and t <= b[2] + 1e-6 and cheb(o, b) < 2 * S:
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
              and abs(o[2] - (b[2] + BLOCK_H)) < 1e-6 and cheb(o, b) < 2 * S]
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
                floor = support_top(state, x, y, held) + BLOCK_H
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
                    if (cheb((x, y), b) <= GRASP_XY and top - 0.01 <= z <= top + 0.015 and top > best_top
                            and not any(j != i and abs(o[2] - top) < 1e-6 and cheb(o, b) < 2 * S
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
            b[2] = support_top(state, b[0], b[1], held)
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
        return held != i and state.lifted[i] and cheb(bl[i], (fx, fy)) <= task.fixture_half
    if task.kind == "stack":
        top, bottom = task.blocks
        t, b = bl[top], bl[bottom]
        return (held not in (top, bottom) and abs(t[2] - (b[2] + BLOCK_H)) < 1e-6
                and cheb(t, b) <= 0.5 * S)
    if task.kind == "two_in_zone":
        return all(held != i and cheb(bl[i], (fx, fy)) <= task.fixture_half for i in task.blocks)
    if task.kind == "push_to_side":
        i = task.blocks[0]
        return held != i and bl[i][2] < EPS and bl[i][0] <= SIDE_X
    raise ValueError(task.kind)
