"""Arena rendering: a cheap numpy renderer drawing in the flipped (MuJoCo-like) camera frame."""

from __future__ import annotations

import numpy as np

from pi0.envs.arena.world import (
    BLOCK_RGB,
    BORDER_RGB,
    EPS,
    FINGER_OPEN,
    L,
    NUM_BLOCKS,
    R,
    S,
    TABLE_RGB,
    TASKS,
    ArenaLayout,
    ArenaState,
)


# ----------------------------------------------------------------------------------- rendering
class ArenaRenderer:
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
