"""Scripted state-based expert of every arena task (closed loop, or open-loop chunks through the physics)."""

from __future__ import annotations

import numpy as np

from pi0.envs.arena.world import (
    BLOCK_H,
    EPS,
    FINGER_OPEN,
    GRASP_XY,
    MAX_DELTA,
    R,
    S,
    SIDE_X,
    TASKS,
    ArenaState,
    arena_step,
    check_success,
    cheb,
    support_top,
)


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
    command is flipped. ``aim_error`` > 0 makes a suboptimal demonstrator: it sees every block shifted
    sideways by a per-episode offset (:meth:`aim_offset`) and acts on that belief, so it misses now and then.
    """

    def __init__(self, noise: float = 0.0, seed: int | None = None, gripper_flip_prob: float = 0.0,
                 aim_error: float = 0.0) -> None:
        """Create an expert; ``seed`` seeds the noise generator and the per-episode aim errors."""
        self.noise = float(noise)
        self.gripper_flip_prob = float(gripper_flip_prob)
        if aim_error < 0:
            raise ValueError(f"aim_error must be >= 0 (metres), got {aim_error}")
        self.aim_error = float(aim_error)
        self.seed = 0 if seed is None else int(seed)
        self.rng = np.random.default_rng(seed)

    def aim_offset(self, s: ArenaState) -> float:
        """This expert's lateral misperception (m) of every block's y in the episode of ``s``.

        Uniform in [-aim_error, aim_error], a pure function of (seed, task, init state): constant over the episode
        (a demonstrator who misjudges where the blocks are, consistently), so no memory is needed. 0 = exact.
        """
        if self.aim_error == 0.0:
            return 0.0
        rng = np.random.default_rng((self.seed, 7919, s.layout.task_id, s.layout.init_state_id))
        return float(rng.uniform(-self.aim_error, self.aim_error))

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
            release_z = support_top(s, goal[0], goal[1], i) + BLOCK_H + 0.004
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
        """Noise-free expert action ``(7,)`` for state ``s`` (as the expert perceives it: see :meth:`aim_offset`)."""
        task = TASKS[s.layout.task_id]
        fx, fy = s.layout.fixture
        solved = check_success(s)  # on the true state
        dy = self.aim_offset(s)
        if dy:
            s = s.copy()
            for b in s.blocks:
                b[1] += dy
        if solved:
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
                if s.held == i or cheb(s.blocks[i], (fx, fy)) > half - 0.01:
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
