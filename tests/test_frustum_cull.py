"""View-frustum culling (pi0.envs.frustum_cull): the plane tests by hand, and MetaWorld frames equal bit for bit."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", "egl")

from pi0.envs.frustum_cull import box_corners, outside_frustum  # noqa: E402

# a camera at the origin looking along +x with z up: image x (forward x up) is -y; a 90-degree frustum (half-extent
# 1 at near 1) from depth 1 to 10
CAM = dict(pos=np.zeros(3), forward=np.array([1.0, 0, 0]), up=np.array([0, 0, 1.0]), center=0.0, halfwidth=1.0,
           bottom=-1.0, top=1.0, near=1.0, far=10.0)


def boxes(*centres, half=0.5):
    """Axis-aligned cubes of half-size ``half`` at ``centres`` -> (G, 8, 3) corners."""
    return box_corners(np.array([[*c, half, half, half] for c in centres], float))


def test_box_corners_span_the_box():
    c = box_corners(np.array([[1.0, 2.0, 3.0, 0.1, 0.2, 0.3]]))
    assert c.shape == (1, 8, 3)
    np.testing.assert_allclose(c[0].min(0), [0.9, 1.8, 2.7])
    np.testing.assert_allclose(c[0].max(0), [1.1, 2.2, 3.3])
    assert len({tuple(p) for p in c[0]}) == 8


@pytest.mark.parametrize("centre, out", [
    ((5, 0, 0), False),  # straight ahead
    ((-5, 0, 0), True),  # behind the eye
    ((0.3, 0, 0), True),  # before the near plane (its far face is at depth 0.8)
    ((20, 0, 0), True),  # beyond the far plane
    ((5, 10, 0), True),  # left (+y is -image x), wholly outside the plane y = x
    ((5, -10, 0), True),  # right
    ((5, 0, 10), True),  # above
    ((5, 0, -10), True),  # below
    ((5, 5.2, 0), False),  # straddles the left plane (its near corner at y = 4.7 < x = 5.5)
    ((9.9, 0, 0), False),  # straddles the far plane
    ((5, 8, 8), True),  # outside two planes at once
])
def test_outside_frustum_by_hand(centre, out):
    assert outside_frustum(boxes(centre), **CAM).tolist() == [out]


def test_margin_keeps_boxes_just_outside_and_an_off_axis_frustum_shifts_its_planes():
    # the left plane is y = x (image x = -y); this cube's corners all have y - x >= d, i.e. lie d / sqrt(2) outside it
    d = 0.0005
    just = boxes((5.0, 6.0 + d, 0.0))
    assert (just[0][:, 1] - just[0][:, 0]).min() == pytest.approx(d)
    assert outside_frustum(just, **CAM).tolist() == [False]  # within the 1 mm margin: kept
    assert outside_frustum(just, **{**CAM, "margin": 0.0}).tolist() == [True]
    # center 1: image x in [0, 2] at near 1, so the planes are y = 0 and y = -2x
    shifted = {**CAM, "center": 1.0}
    assert outside_frustum(boxes((5, 2, 0), (5, -5, 0), (5, -12, 0)), **shifted).tolist() == [True, False, True]


def test_metaworld_frames_are_the_same_with_culling_and_the_wrist_camera_skips_the_arm():
    """Along the scripted experts' motions of two tasks, both cameras' frames with culling equal those without it bit
    for bit, and the wrist camera culls the arm links behind it (so the test would see a culler that culls nothing).
    The window-close expert brings the wrist camera within centimetres of the window frame: a culler that took the
    frustum from one of the scene's two eye cameras (3.4 cm to the side) instead of their average changed 5 of
    these frames."""
    import mujoco

    from pi0.envs import make_env_spec
    from pi0.envs.metaworld_env import SCENE_CAMERA, WRIST_CAMERA, expert_policy

    for task in (2, 8):
        env = make_env_spec("metaworld", task_id=task, resolution=64)().unwrapped
        try:
            env.reset(options={"init_state_id": 0})  # renders: the env now holds its task's shared renderer
            shared, m, d = env._renderer, env._env.model, env._env.data
            culler, r = shared.culler, shared.renderer
            assert culler is not None  # fast_render, every runner's default
            links = {g for g in range(m.ngeom) if m.geom_type[g] == mujoco.mjtGeom.mjGEOM_MESH and
                     (mujoco.mj_id2name(m, mujoco.mjtObj.mjOBJ_BODY, m.geom_bodyid[g]) or "").startswith("right_l")}
            assert len(links) >= 7  # the arm's link meshes
            expert = expert_policy(env.task_name)
            for step in range(123):
                a = np.clip(expert.get_action(env._raw), -1, 1)
                env.step(np.array([a[0], a[1], a[2], 0, 0, 0, a[3]]), render=False)
                if step % 3:
                    continue
                for cam in (SCENE_CAMERA, WRIST_CAMERA):
                    r.update_scene(d, camera=cam)
                    full = r.render().copy()
                    np.testing.assert_array_equal(shared.render(m, d, cam), full)  # updates, culls, renders
                    skipped = {r.scene.geoms[i].objid for i in range(r.scene.ngeom)
                               if r.scene.geoms[i].type == mujoco.mjtGeom.mjGEOM_NONE}
                    culled = culler.culled(d, r.scene, 64, 64)  # (G,) bool, once per frame
                    assert all(culled[g] for g in skipped)
                    if cam == WRIST_CAMERA:
                        assert len(links & skipped) >= 5
        finally:
            env.close()


def test_stereo_and_orthographic_views_cull_nothing():
    """Only a mono perspective view is this module's frustum; the wrist camera culls the arm in mono."""
    import mujoco

    from pi0.envs import make_env_spec
    from pi0.envs.metaworld_env import WRIST_CAMERA

    env = make_env_spec("metaworld", task_id=2, resolution=48)().unwrapped
    try:
        env.reset(options={"init_state_id": 0})
        shared, d = env._renderer, env._env.data
        scene = shared.renderer.scene
        mujoco.mjv_updateScene(env._env.model, d, shared.option, None, shared.cameras[WRIST_CAMERA],
                               mujoco.mjtCatBit.mjCAT_ALL, scene)
        assert shared.culler.culled(d, scene, 48, 48).sum() >= 5
        scene.stereo = mujoco.mjtStereo.mjSTEREO_SIDEBYSIDE
        assert not shared.culler.culled(d, scene, 48, 48).any()
        scene.stereo = mujoco.mjtStereo.mjSTEREO_NONE
        scene.camera[0].orthographic = scene.camera[1].orthographic = 1
        assert not shared.culler.culled(d, scene, 48, 48).any()
    finally:
        env.close()
