"""Tests of pi0.utils.video.write_video (round trip through imageio's ffmpeg)."""

from __future__ import annotations

import numpy as np
import pytest

from pi0.utils.video import write_video


def test_write_video_round_trip(tmp_path):
    imageio = pytest.importorskip("imageio.v2")
    frames = np.zeros((12, 32, 48, 3), dtype=np.uint8)
    for i in range(12):
        frames[i, :, : 4 * (i + 1)] = 255  # a white bar growing to the right
    path = write_video(tmp_path / "sub" / "clip.mp4", frames, fps=10)
    reader = imageio.get_reader(path)
    back = np.stack([frame for frame in reader])  # not list(reader): len() is inf for ffmpeg streams
    assert reader.get_meta_data()["fps"] == 10
    reader.close()
    assert back.shape == frames.shape
    assert np.abs(back.astype(int) - frames).mean() < 8  # lossy H.264, but the content is there


def test_write_video_rejects_bad_frames(tmp_path):
    with pytest.raises(ValueError):
        write_video(tmp_path / "a.mp4", [np.zeros((16, 16, 3), np.float32)])
    with pytest.raises(ValueError):
        write_video(tmp_path / "b.mp4", [np.zeros((16, 16, 3), np.uint8), np.zeros((32, 16, 3), np.uint8)])
    with pytest.raises(ValueError):
        write_video(tmp_path / "c.mp4", [])
    assert not (tmp_path / "c.mp4").exists()
