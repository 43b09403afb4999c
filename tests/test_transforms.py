"""Tests of pi0.transforms: openpi's LIBERO client steps (hand-computed values and the openpi golden fixture)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image

from conftest import LIBERO_TINY, golden_env_obs
from pi0.transforms import (libero_client_batch, libero_client_obs, libero_state, quat2axisangle, resize_with_pad,
                            rotate_180)

GOLDEN = LIBERO_TINY / "reference.npz"

S = math.sqrt(0.5)


# ----------------------------------------------------------------------------------------------- quat2axisangle
@pytest.mark.parametrize(
    "quat, expected",
    [
        ((0.0, 0.0, 0.0, 1.0), (0.0, 0.0, 0.0)),  # identity
        ((S, 0.0, 0.0, S), (math.pi / 2, 0.0, 0.0)),  # +90 deg about x
        ((0.0, S, 0.0, S), (0.0, math.pi / 2, 0.0)),  # +90 deg about y
        ((0.0, 0.0, S, S), (0.0, 0.0, math.pi / 2)),  # +90 deg about z
        ((0.0, -S, 0.0, S), (0.0, -math.pi / 2, 0.0)),  # -90 deg about y
        ((0.0, 0.0, 1.0, 0.0), (0.0, 0.0, math.pi)),  # 180 deg about z: den = 1, acos(0) = pi/2
        ((1.0, 0.0, 0.0, 0.0), (math.pi, 0.0, 0.0)),  # 180 deg about x
        # w < 0 is NOT canonicalised: acos(-1/2) = 2pi/3 -> angle 4pi/3 about +z.
        ((0.0, 0.0, math.sqrt(3) / 2, -0.5), (0.0, 0.0, 4 * math.pi / 3)),
        ((0.0, 0.0, 0.0, 1.0 + 1e-9), (0.0, 0.0, 0.0)),  # w slightly > 1 is clipped to 1 -> zeros
        ((1e-6, 0.0, 0.0, 1.0 + 1e-9), (0.0, 0.0, 0.0)),  # clipped w = 1 gives zeros whatever xyz is
        ((0.0, 0.0, 0.0, -1.0 - 1e-9), (0.0, 0.0, 0.0)),  # w slightly < -1 -> clipped to -1 -> zeros
    ],
)
def test_quat2axisangle_known_values(quat, expected):
    out = quat2axisangle(np.array(quat))
    assert out.shape == (3,) and out.dtype == np.float64
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-12)


def test_quat2axisangle_generic_axis_and_no_mutation():
    axis = np.array([1.0, 2.0, 2.0]) / 3.0
    angle = 0.3
    q = np.concatenate([axis * math.sin(angle / 2), [math.cos(angle / 2)]])
    np.testing.assert_allclose(quat2axisangle(q), axis * angle, rtol=0, atol=1e-12)
    # Tiny but non-zero den still gives the small rotation (robosuite's zero test is exact, not a tolerance).
    small = np.array([math.sin(5e-5), 0.0, 0.0, math.cos(5e-5)])
    np.testing.assert_allclose(quat2axisangle(small), [1e-4, 0.0, 0.0], rtol=1e-6)
    q_in = np.array([0.0, 0.0, 0.0, 1.5])
    quat2axisangle(q_in)
    assert q_in[3] == 1.5  # input not clipped in place


def test_libero_state_layout():
    state = libero_state([1.0, 2.0, 3.0], [0.0, 0.0, 1.0, 0.0], [0.04, -0.04])
    assert state.shape == (8,) and state.dtype == np.float64
    np.testing.assert_allclose(state, [1.0, 2.0, 3.0, 0.0, 0.0, math.pi, 0.04, -0.04], rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------------- rotate_180
def test_rotate_180_hand_made():
    img = np.arange(6, dtype=np.uint8).reshape(2, 3, 1)  # [[0,1,2],[3,4,5]]
    out = rotate_180(img)
    np.testing.assert_array_equal(out[..., 0], [[5, 4, 3], [2, 1, 0]])
    rgb = np.stack([img[..., 0], img[..., 0] + 10, img[..., 0] + 20], axis=-1)
    out_rgb = rotate_180(rgb)
    np.testing.assert_array_equal(out_rgb[0, 0], [5, 15, 25])  # channels are not reversed
    batch = np.stack([rgb, rgb + 100])
    out_b = rotate_180(batch)
    assert out_b.shape == (2, 2, 3, 3)
    np.testing.assert_array_equal(out_b[1], out_rgb + 100)
    with pytest.raises(ValueError):
        rotate_180(np.zeros((4, 4)))


# ------------------------------------------------------------------------------------------------ resize_with_pad
def _const(h: int, w: int, value: int = 200) -> np.ndarray:
    return np.full((h, w, 3), value, dtype=np.uint8)


def test_resize_with_pad_tall_even_slack():
    # 100x50 -> 64x64: ratio 1.5625, resized (64, 32), pad_left = 16, pad_right = 16.
    out = resize_with_pad(_const(100, 50), 64, 64)
    assert out.shape == (64, 64, 3) and out.dtype == np.uint8
    assert (out[:, 16:48] == 200).all()
    assert (out[:, :16] == 0).all() and (out[:, 48:] == 0).all()


def test_resize_with_pad_tall_odd_slack_goes_right():
    # 100x49 -> 64x64: resized width int(49 / 1.5625) = int(31.36) = 31; pad_left = int(33 / 2) = 16, right = 17.
    out = resize_with_pad(_const(100, 49), 64, 64)
    assert (out[:, 16:47] == 200).all()
    assert (out[:, :16] == 0).all() and (out[:, 47:] == 0).all()


def test_resize_with_pad_wide_odd_slack_goes_bottom():
    # 30x90 -> 64x64: ratio 1.40625, resized (int(21.33) = 21, 64); pad_top = int(43 / 2) = 21, bottom = 22 rows.
    out = resize_with_pad(_const(30, 90, 77), 64, 64)
    assert (out[21:42] == 77).all()
    assert (out[:21] == 0).all() and (out[42:] == 0).all()


def test_resize_with_pad_content_is_pil_bilinear_and_batched():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, size=(100, 50, 3), dtype=np.uint8)
    out = resize_with_pad(img, 64, 64)
    expected = np.asarray(Image.fromarray(img).resize((32, 64), resample=Image.BILINEAR))
    np.testing.assert_array_equal(out[:, 16:48], expected)
    batch = np.stack([img, img[::-1]])
    out_b = resize_with_pad(batch, 64, 64)
    assert out_b.shape == (2, 64, 64, 3)
    np.testing.assert_array_equal(out_b[0], out)
    np.testing.assert_array_equal(out_b[1], resize_with_pad(img[::-1], 64, 64))
    # Already at the target size: returned unchanged.
    assert resize_with_pad(img, 100, 50) is img


def test_resize_with_pad_shrinking_antialiases():
    # A 1-px checkerboard shrunk 3x: a plain (non-antialiased) bilinear sample lands exactly on source pixels
    # (centre 3i + 1) and gives 0 / 255; PIL's bilinear filter widens its support when shrinking and averages.
    board = ((np.indices((48, 48)).sum(0) % 2) * 255).astype(np.uint8)
    img = np.repeat(board[..., None], 3, axis=-1)
    out = resize_with_pad(img, 16, 16)
    assert np.abs(out.astype(int) - 128).max() <= 2


# ------------------------------------------------------------------------------------------------- golden fixture
@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as data:  # a missing fixture fails (FileNotFoundError): tests need ../shared
        return {k: data[k] for k in data.files}


def test_client_obs_matches_openpi_golden(golden):
    n = golden["raw/agentview_image"].shape[0]
    assert n >= 2
    for i in range(n):
        out = libero_client_obs(golden_env_obs(golden, i))
        assert out["image"].shape == (224, 224, 3) and out["image"].dtype == np.uint8
        assert out["state"].shape == (8,) and out["state"].dtype == np.float64
        np.testing.assert_array_equal(out["image"], golden["client/image"][i])
        np.testing.assert_array_equal(out["wrist_image"], golden["client/wrist_image"][i])
        np.testing.assert_array_equal(out["state"], golden["client/state"][i])


def test_client_batch_matches_openpi_golden_whole_and_with_mixed_sizes(golden):
    """The policy's path (one batch per call, rotated and resized together) gives openpi's client arrays; a batch
    whose renders differ in size (here a float render of half the size) falls back to one image at a time."""
    n = golden["raw/agentview_image"].shape[0]
    out = libero_client_batch([golden_env_obs(golden, i) for i in range(n)])
    for k in ("image", "wrist_image", "state"):
        np.testing.assert_array_equal(out[k], golden[f"client/{k}"])
    small = golden_env_obs(golden, 0)
    small["agentview_image"] = small["agentview_image"][::2, ::2].astype(np.float32) / 255.0
    mixed = libero_client_batch([small, golden_env_obs(golden, 1)], 56)
    assert mixed["image"].shape == (2, 56, 56, 3) and mixed["image"].dtype == np.uint8
    ref = libero_client_obs(golden_env_obs(golden, 1), 56)
    np.testing.assert_array_equal(mixed["image"][1], ref["image"])
    np.testing.assert_array_equal(mixed["image"][0], libero_client_obs(small, 56)["image"])
    with pytest.raises(KeyError, match="robot0_eef_pos"):
        libero_client_batch([golden_env_obs(golden, 0), {k: v for k, v in small.items() if k != "robot0_eef_pos"}])


def test_client_obs_missing_image_key_is_explicit(golden):
    raw = {"robot0_eef_pos": golden["raw/eef_pos"][0], "robot0_eef_quat": golden["raw/eef_quat"][0],
           "robot0_gripper_qpos": golden["raw/gripper_qpos"][0]}
    with pytest.raises(KeyError, match="agentview_image"):
        libero_client_obs(raw)
