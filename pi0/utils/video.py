"""Video writing with imageio + its bundled ffmpeg (no downloads)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

__all__ = ["write_video"]


def write_video(path: str | Path, frames: Iterable[np.ndarray], fps: float = 20.0) -> Path:
    """Write frames, each (H, W, 3) uint8 (all the same shape), to an mp4 (H.264) file; returns the path.

    H and W should be multiples of 16 (ffmpeg's macro block), else imageio resizes up to the next multiple.
    """
    import imageio.v2 as imageio

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    shape = None
    with imageio.get_writer(path, fps=fps, codec="libx264", quality=8, macro_block_size=16) as writer:
        for frame in frames:
            frame = np.asarray(frame)
            if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[-1] != 3:
                raise ValueError(f"frames must be (H, W, 3) uint8, got {frame.shape} {frame.dtype}")
            if shape is None:
                shape = frame.shape
            elif frame.shape != shape:
                raise ValueError(f"all frames must have the same shape: {frame.shape} != {shape}")
            writer.append_data(np.ascontiguousarray(frame))
            count += 1
    if count == 0:
        path.unlink(missing_ok=True)
        raise ValueError("write_video got no frames")
    return path
