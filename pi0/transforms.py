"""Client-side observation transforms of the pi0 LIBERO pipeline (numpy, no torch).

These reproduce, step for step, what openpi's LIBERO example client does to a raw LIBERO observation before it
reaches the policy: both camera images are rotated by 180 degrees, resized with padding to 224x224 using PIL's
bilinear filter (which antialiases when shrinking), kept as uint8; the 8-D state is
``eef_pos (3) + axis-angle(eef_quat) (3) + gripper_qpos (2)`` with robosuite's quaternion convention (x, y, z, w).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from PIL import Image

__all__ = [
    "rotate_180",
    "resize_with_pad",
    "convert_to_uint8",
    "quat2axisangle",
    "libero_state",
    "libero_client_obs",
    "libero_client_batch",
    "CLIENT_IMAGE_SIZE",
]

CLIENT_IMAGE_SIZE = 224


def rotate_180(img: np.ndarray) -> np.ndarray:
    """Rotate (H, W, C) or (B, H, W, C) images by 180 degrees (flip rows and columns); returns a contiguous copy."""
    img = np.asarray(img)
    if img.ndim not in (3, 4):
        raise ValueError(f"rotate_180 expects (H, W, C) or (B, H, W, C), got shape {img.shape}")
    return np.ascontiguousarray(img[..., ::-1, ::-1, :])


def _padded_geometry(in_h: int, in_w: int, height: int, width: int) -> tuple[int, int, int, int]:
    """(resized_h, resized_w, pad_top, pad_left) of an (in_h, in_w) image fitted into (height, width)."""
    # Scale so that the larger relative side fits exactly; truncate (int) the other, as openpi does.
    ratio = max(in_w / width, in_h / height)
    resized_h = int(in_h / ratio)
    resized_w = int(in_w / ratio)
    # Floor of half the slack goes before the image (top/left); the remainder goes after it (bottom/right).
    pad_top = max(0, int((height - resized_h) / 2))
    pad_left = max(0, int((width - resized_w) / 2))
    return resized_h, resized_w, pad_top, pad_left


def _resize_into(img: np.ndarray, out: np.ndarray, resample: int) -> None:
    """Resize one (H, W, C) uint8 image with PIL into the zero canvas ``out`` (height, width, C), aspect kept."""
    height, width = out.shape[:2]
    in_h, in_w = img.shape[:2]
    resized_h, resized_w, pad_top, pad_left = _padded_geometry(in_h, in_w, height, width)
    pil = Image.fromarray(img[..., 0] if img.shape[-1] == 1 else img)
    resized = np.asarray(pil.resize((resized_w, resized_h), resample=resample))
    if resized.ndim == 2:
        resized = resized[..., None]
    # Same as pasting onto a zero canvas: anything beyond the canvas is cropped.
    h = min(resized_h, height - pad_top)
    w = min(resized_w, width - pad_left)
    out[pad_top : pad_top + h, pad_left : pad_left + w] = resized[:h, :w]


def resize_with_pad(
    images: np.ndarray, height: int, width: int, resample: int = Image.BILINEAR
) -> np.ndarray:
    """Aspect-preserving PIL resize of (..., H, W, C) uint8 images to (..., height, width, C), centred, zero padded.

    Semantics of openpi's client ``image_tools.resize_with_pad``: ``ratio = max(W / width, H / height)``, the image is
    resized to ``(int(H / ratio), int(W / ratio))`` with PIL (bilinear by default, antialiased when shrinking) and
    pasted on a zero canvas at ``(int((height - h) / 2), int((width - w) / 2))``, so an odd slack puts the extra
    pixel row/column at the bottom/right. Images that already have the target size are returned unchanged.
    """
    images = np.asarray(images)
    if images.ndim < 3:
        raise ValueError(f"resize_with_pad expects (..., H, W, C), got shape {images.shape}")
    if images.dtype != np.uint8:
        raise TypeError(f"resize_with_pad expects uint8 images (PIL), got {images.dtype}")
    if images.shape[-3:-1] == (height, width):
        return images
    lead = images.shape[:-3]
    flat = images.reshape(-1, *images.shape[-3:])
    out = np.zeros((len(flat), height, width, images.shape[-1]), dtype=images.dtype)
    for im, canvas in zip(flat, out):  # one PIL call per image, written into the batch's canvas
        _resize_into(im, canvas, resample)
    return out.reshape(*lead, height, width, images.shape[-1])


def convert_to_uint8(img: np.ndarray) -> np.ndarray:
    """Float images in [0, 1] -> uint8 via 255 * clip(x, 0, 1) truncated; other dtypes are returned unchanged."""
    img = np.asarray(img)
    if np.issubdtype(img.dtype, np.floating):
        return (255 * np.clip(img, 0.0, 1.0)).astype(np.uint8)
    return img


def quat2axisangle(quat_xyzw: np.ndarray) -> np.ndarray:
    """Unit quaternion (4,) in (x, y, z, w) order -> axis-angle (3,) float64, exactly as robosuite's transform_utils.

    w is clipped to [-1, 1]; ``den = sqrt(1 - w^2)``; if ``den`` is zero (robosuite tests ``math.isclose(den, 0.0)``,
    whose default tolerances make that an exact-zero test) the result is zeros, else ``xyz * 2 * acos(w) / den``.
    The input is not modified (robosuite clips its argument in place).
    """
    q = np.array(quat_xyzw, dtype=np.float64).reshape(-1)
    if q.shape != (4,):
        raise ValueError(f"quat2axisangle expects a (4,) quaternion, got shape {np.shape(quat_xyzw)}")
    w = min(max(float(q[3]), -1.0), 1.0)
    den = np.sqrt(1.0 - w * w)
    if math.isclose(den, 0.0):
        return np.zeros(3)
    return (q[:3] * 2.0 * math.acos(w)) / den


def libero_state(eef_pos: np.ndarray, eef_quat: np.ndarray, gripper_qpos: np.ndarray) -> np.ndarray:
    """LIBERO client state (8,) float64 = concat(eef_pos (3), quat2axisangle(eef_quat (4, xyzw)) (3), gripper_qpos (2))."""
    pos = np.asarray(eef_pos, dtype=np.float64).reshape(-1)
    grip = np.asarray(gripper_qpos, dtype=np.float64).reshape(-1)
    if pos.shape != (3,) or grip.shape != (2,):
        raise ValueError(f"expected eef_pos (3,) and gripper_qpos (2,), got {pos.shape} and {grip.shape}")
    return np.concatenate([pos, quat2axisangle(eef_quat), grip])


CLIENT_KEYS = ("agentview_image", "robot0_eye_in_hand_image", "robot0_eef_pos", "robot0_eef_quat",
               "robot0_gripper_qpos")


def libero_client_batch(obs_list: Sequence[Mapping[str, np.ndarray]], size: int = CLIENT_IMAGE_SIZE
                        ) -> dict[str, np.ndarray]:
    """B raw LIBERO obs -> dict(image=(B, size, size, 3) uint8, wrist_image=(B, size, size, 3) uint8, state=(B, 8)
    float64): :func:`libero_client_obs` of each, with the rotation and the uint8 conversion done once per batch."""
    for env_obs in obs_list:
        missing = [k for k in CLIENT_KEYS if k not in env_obs]
        if missing:
            raise KeyError(f"LIBERO observation lacks {missing} (images are absent when a step was not rendered)")

    def _img(key: str) -> np.ndarray:
        raw = [np.asarray(o[key]) for o in obs_list]
        if len({(x.shape, x.dtype) for x in raw}) > 1:  # mixed sizes: one image at a time
            return np.stack([_img_one(x, size) for x in raw])
        return _img_one(np.stack(raw), size)

    state = [libero_state(o["robot0_eef_pos"], o["robot0_eef_quat"], o["robot0_gripper_qpos"]) for o in obs_list]
    return {"image": _img("agentview_image"), "wrist_image": _img("robot0_eye_in_hand_image"),
            "state": np.stack(state) if state else np.zeros((0, 8))}


def _img_one(x: np.ndarray, size: int) -> np.ndarray:
    """(..., H, W, C) rendered images -> (..., size, size, C) uint8: rotate 180, resize_with_pad, uint8."""
    return convert_to_uint8(resize_with_pad(rotate_180(convert_to_uint8(x)), size, size))


def libero_client_obs(env_obs: Mapping[str, np.ndarray], size: int = CLIENT_IMAGE_SIZE) -> dict[str, np.ndarray]:
    """Raw LIBERO obs -> dict(image=(size, size, 3) uint8, wrist_image=(size, size, 3) uint8, state=(8,) float64).

    Reads ``agentview_image``, ``robot0_eye_in_hand_image`` (as rendered, i.e. upside down), ``robot0_eef_pos``,
    ``robot0_eef_quat`` and ``robot0_gripper_qpos``; applies rotate 180, resize_with_pad and uint8 conversion.
    """
    return {k: v[0] for k, v in libero_client_batch([env_obs], size).items()}
