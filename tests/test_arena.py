"""Tests of the built-in arena env (pi0/envs/arena/)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import pi0.envs  # noqa: F401 - registers arena-v0
from pi0.envs.arena import (
    BLOCK_H,
    GREEN,
    RED,
    BLUE,
    S,
    SIDE_X,
    TASKS,
    YELLOW,
    ArenaEnv,
    ArenaExpert,
    ArenaState,
    arena_step,
    check_success,
    make_layout,
    task_id_from_prompt,
)

IMAGE_KEYS = ArenaEnv.image_keys

RAW_KEYS = {
    "agentview_image": ((128, 128, 3), np.uint8),
    "robot0_eye_in_hand_image": ((128, 128, 3), np.uint8),
    "robot0_eef_pos": ((3,), np.float64),
    "robot0_eef_quat": ((4,), np.float64),
    "robot0_gripper_qpos": ((2,), np.float64),
}


def run_expert(env: ArenaEnv, expert: ArenaExpert, init_state_id: int) -> tuple[bool, int]:
    """Closed-loop expert episode; returns (success, length)."""
    env.reset(options={"init_state_id": init_state_id})
    while True:
        _, _, term, trunc, info = env.step(expert.act(env.state))
        if term or trunc:
            return bool(info["success"]), env.state.steps


def test_at_least_four_distinct_tasks():
    assert len(TASKS) >= 4
    assert len({t.prompt for t in TASKS}) == len(TASKS)
    for t in TASKS:
        assert task_id_from_prompt(t.prompt.upper()) == t.task_id
        assert ArenaEnv(task_id=t.task_id).prompt == t.prompt


def test_init_states_deterministic_and_distinct():
    for task in TASKS:
        a = ArenaEnv(task_id=task.task_id)
        b = ArenaEnv(task_id=task.task_id, init_state_id=7, seed=123)
        oa, _ = a.reset(options={"init_state_id": 7})
        ob, _ = b.reset()
        np.testing.assert_array_equal(oa["arena_state"], ob["arena_state"])
        for k in IMAGE_KEYS:
            np.testing.assert_array_equal(oa[k], ob[k])
        # reset back to the same init state after stepping reproduces it exactly
        a.step(np.ones(7))
        oa2, _ = a.reset(options={"init_state_id": 7})
        np.testing.assert_array_equal(oa["arena_state"], oa2["arena_state"])
        # the layouts of different init states differ
        vecs = {make_layout(task.task_id, k).to_vector().tobytes() for k in range(a.num_init_states)}
        assert len(vecs) == a.num_init_states
        assert a.num_init_states == 50
    with pytest.raises(ValueError):
        ArenaEnv(task_id=0).reset(options={"init_state_id": 50})
    with pytest.raises(ValueError):
        ArenaEnv(task_id=len(TASKS))


def test_initial_states_are_not_solved():
    for task in TASKS:
        for k in range(50):
            assert not check_success(make_layout(task.task_id, k))


@pytest.mark.parametrize("task_id", range(len(TASKS)))
def test_expert_succeeds_at_noise_zero(task_id):
    env = ArenaEnv(task_id=task_id, render_on_demand=True)
    expert = ArenaExpert(noise=0.0)
    results = [run_expert(env, expert, k) for k in range(0, 50, 5)]
    assert all(s for s, _ in results), results
    assert all(n < env.max_steps for _, n in results)


def test_expert_noise_changes_actions_and_mostly_still_succeeds():
    env = ArenaEnv(task_id=1, render_on_demand=True)
    env.reset(options={"init_state_id": 3})
    clean = ArenaExpert(noise=0.0).act(env.state)
    noisy = ArenaExpert(noise=0.3, seed=0).act(env.state)
    assert not np.allclose(clean[:3], noisy[:3])
    succ = [run_expert(env, ArenaExpert(noise=0.3, seed=k), k)[0] for k in range(10)]
    assert np.mean(succ) >= 0.8


def test_expert_chunk_reproduces_closed_loop():
    env = ArenaEnv(task_id=3, render_on_demand=True)
    env.reset(options={"init_state_id": 11})
    expert = ArenaExpert()
    chunk = expert.predict_chunk(env.get_state(), 12)
    sim = env.get_state()
    for a in chunk:
        np.testing.assert_array_equal(a, expert.act(sim))
        arena_step(sim, a)
    for a in chunk:
        env.step(a)
    np.testing.assert_array_equal(env.get_state().to_vector(), sim.to_vector())


def test_obs_keys_shapes_dtypes():
    env = gym.make("arena-v0", task_id=2)
    obs, info = env.reset(options={"init_state_id": 0})
    for k, (shape, dtype) in RAW_KEYS.items():
        assert obs[k].shape == shape and obs[k].dtype == dtype, k
    assert env.observation_space.contains(obs)
    assert env.action_space.shape == (7,)
    np.testing.assert_allclose(np.linalg.norm(obs["robot0_eef_quat"]), 1.0)
    np.testing.assert_allclose(obs["robot0_gripper_qpos"], [0.04, -0.04])
    obs, r, term, trunc, info = env.step(np.zeros(7, np.float32))
    assert set(RAW_KEYS) <= set(obs) and info["success"] is False and not term and not trunc
    assert {"success", "task", "task_id", "init_state_id", "policy_step", "rendered"} <= set(info)
    small = ArenaEnv(resolution=(64, 96))
    o, _ = small.reset()
    assert o["agentview_image"].shape == (64, 96, 3) and o["robot0_eye_in_hand_image"].shape == (64, 96, 3)
    with pytest.raises(ValueError):
        ArenaEnv(resolution=(32, 128))


def test_render_on_demand_convention():
    lazy = ArenaEnv(task_id=0, render_on_demand=True, render_every=1000)
    eager = ArenaEnv(task_id=0)
    ol, il = lazy.reset(options={"init_state_id": 4, "render": False})
    oe, _ = eager.reset(options={"init_state_id": 4})
    assert not any(k in ol for k in IMAGE_KEYS) and il["rendered"] is False
    rng = np.random.default_rng(0)
    for _ in range(7):
        a = rng.uniform(-1, 1, 7)
        ol, *_, il = lazy.step(a)
        oe, *_ = eager.step(a)
        assert not any(k in ol for k in IMAGE_KEYS) and il["rendered"] is False
    full = lazy.get_observation(render=True)
    for k in IMAGE_KEYS:  # bit-identical to the always-rendering env after the same actions
        np.testing.assert_array_equal(full[k], oe[k])
    again = lazy.get_observation()  # latest observation keeps the images of this state
    np.testing.assert_array_equal(again["agentview_image"], oe["agentview_image"])
    ol, *_, il = lazy.step(np.zeros(7), render=True)
    assert il["rendered"] and all(k in ol for k in IMAGE_KEYS)
    ol, *_ = lazy.step(np.zeros(7))
    assert "agentview_image" not in lazy.get_observation()  # stale images are never returned


def _place(state: ArenaState, block: int, x: float, y: float, z: float = 0.0) -> None:
    state.blocks[block] = [x, y, z]


def test_image_flip_convention():
    env = ArenaEnv(task_id=2)  # no fixture drawn for the stack task
    env.reset(options={"init_state_id": 0})
    st = env.get_state()
    # red block in the upper-left of the upright top-down view (x < 0, y > 0), the others far away
    _place(st, RED, -0.15, 0.15)
    _place(st, GREEN, 0.2, -0.2)
    _place(st, BLUE, 0.2, -0.1)
    _place(st, YELLOW, 0.1, -0.2)
    st.eef = [0.15, 0.15, 0.1]
    env.set_state(st)
    img = env.get_observation(render=True)["agentview_image"]
    red = (img[..., 0] > 200) & (img[..., 1] < 80) & (img[..., 2] < 80)
    rows, cols = np.nonzero(red)
    assert len(rows) > 20
    # stored upside down (vertically AND horizontally flipped): red appears bottom-right ...
    assert rows.mean() > 96 and cols.mean() > 96
    up = img[::-1, ::-1]  # ... and upright (the pi0 client's 180-degree rotation) top-left
    urows, ucols = np.nonzero((up[..., 0] > 200) & (up[..., 1] < 80) & (up[..., 2] < 80))
    assert urows.mean() < 32 and ucols.mean() < 32
    # wrist camera centred on the tip: put the tip over the red block -> red in the image centre
    st.eef = [-0.15, 0.15, 0.1]
    env.set_state(st)
    wrist = env.get_observation(render=True)["robot0_eye_in_hand_image"]
    centre = wrist[54:74, 54:74]
    assert ((centre[..., 0] > 200) & (centre[..., 1] < 80)).mean() > 0.5


def test_success_detection_exact_hand_placed():
    # push_to_target: inside the target radius (boundary included), on the table, not held
    st = make_layout(0, 0)
    fx, fy = st.layout.fixture
    r = TASKS[0].fixture_half
    _place(st, RED, fx + r, fy)
    assert check_success(st)
    _place(st, RED, fx + r + 1e-6, fy)
    assert not check_success(st)
    _place(st, RED, fx, fy, z=0.01)  # hovering over it does not count
    assert not check_success(st)
    # place_in_zone: needs the lifted flag and the block inside the zone
    st = make_layout(1, 0)
    fx, fy = st.layout.fixture
    _place(st, GREEN, fx, fy)
    assert not check_success(st)  # pushed in, never lifted
    st.lifted[GREEN] = True
    assert check_success(st)
    st.held = GREEN
    assert not check_success(st)
    # stack: blue resting exactly on red, centred within S/2
    st = make_layout(2, 0)
    _place(st, RED, 0.0, 0.0)
    _place(st, BLUE, 0.5 * S, 0.0, BLOCK_H)
    assert check_success(st)
    _place(st, BLUE, 0.5 * S + 1e-6, 0.0, BLOCK_H)
    assert not check_success(st)
    _place(st, BLUE, 0.0, 0.0, BLOCK_H + 0.01)
    assert not check_success(st)
    # two_in_zone: both blocks inside
    st = make_layout(3, 0)
    fx, fy = st.layout.fixture
    _place(st, RED, fx - 0.03, fy)
    assert not check_success(st)
    _place(st, GREEN, fx + 0.03, fy)
    assert check_success(st)
    # push_to_side: x <= SIDE_X
    st = make_layout(4, 0)
    _place(st, YELLOW, SIDE_X, 0.0)
    assert check_success(st)
    _place(st, YELLOW, SIDE_X + 1e-6, 0.0)
    assert not check_success(st)


def test_success_is_latched_and_terminates():
    env = ArenaEnv(task_id=4, render_on_demand=True)
    env.reset(options={"init_state_id": 0})
    st = env.get_state()
    _place(st, YELLOW, SIDE_X - 0.01, st.blocks[YELLOW][1])
    st.eef = [0.2, 0.2, 0.15]
    env.set_state(st)
    _, rew, term, trunc, info = env.step(np.zeros(7))
    assert rew == 1.0 and term and not trunc and info["success"]
    # move the block back out of the success region: success stays latched, reward is not repeated
    env.state.blocks[YELLOW][0] = 0.1
    _, rew, term, _, info = env.step(np.zeros(7))
    assert info["success"] and term and rew == 0.0 and not env.check_success()


def test_truncation_at_max_steps():
    env = ArenaEnv(task_id=0, max_steps=3, render_on_demand=True)
    env.reset()
    outs = [env.step(np.zeros(7))[2:4] for _ in range(3)]
    assert outs == [(False, False), (False, False), (False, True)]


def test_physics_push_grasp_lift_release():
    st = make_layout(2, 0)
    for i, (x, y) in enumerate([(0.0, 0.0), (0.2, 0.2), (-0.2, 0.2), (0.2, -0.2)]):
        _place(st, i, x, y)
    # push: tip low, left of the red block, moving right moves the block right by the overlap
    st.eef = [-(S + 0.012) - 0.01, 0.0, 0.01]
    for _ in range(3):
        arena_step(st, [1, 0, 0, 0, 0, 0, -1])
    assert st.blocks[RED][0] == pytest.approx(0.06 - 0.01, abs=1e-9)
    assert st.blocks[RED][1] == 0.0
    # cannot descend through a block top
    x = st.blocks[RED][0]
    st.eef = [x, 0.0, 0.1]
    for _ in range(10):
        arena_step(st, [0, 0, -1, 0, 0, 0, -1])
    assert st.eef[2] == pytest.approx(BLOCK_H)
    # grasp (two closing steps reach the finger width S), lift, release onto the table
    for _ in range(2):
        arena_step(st, [0, 0, 0, 0, 0, 0, 1])
    assert st.held == RED and st.finger == S
    for _ in range(4):
        arena_step(st, [0, 0, 1, 0, 0, 0, 1])
    assert st.blocks[RED][2] > 0.05 and st.lifted[RED]
    arena_step(st, [0, 0, 0, 0, 0, 0, -1])
    assert st.held == -1 and st.blocks[RED][2] == 0.0
    # walls keep blocks on the table
    _place(st, RED, 0.25 - S, 0.0)
    st.eef = [0.25 - 2 * S - 0.012 - 0.001, 0.0, 0.01]
    arena_step(st, [1, 0, 0, 0, 0, 0, -1])
    assert st.blocks[RED][0] == pytest.approx(0.25 - S)


def test_pi0_libero_transforms_apply_unchanged():
    from pi0.transforms import libero_client_obs as client

    env = ArenaEnv(task_id=1)
    obs, _ = env.reset(options={"init_state_id": 2})
    out = client(obs)
    assert out["image"].shape == (224, 224, 3) and out["wrist_image"].shape == (224, 224, 3)
    assert out["image"].dtype == np.uint8
    state = out["state"]
    assert state.shape == (8,)
    np.testing.assert_allclose(state[:3], obs["robot0_eef_pos"])
    np.testing.assert_allclose(np.abs(state[3:6]), [np.pi, 0.0, 0.0], atol=1e-9)  # gripper pointing down
    np.testing.assert_allclose(state[6:], obs["robot0_gripper_qpos"])


def test_aim_error_expert_acts_on_blocks_shifted_by_one_offset_per_episode():
    env = ArenaEnv(task_id=4, render_on_demand=True)
    env.reset(options={"init_state_id": 7})
    s = env.get_state()
    biased = ArenaExpert(aim_error=0.05, seed=3)
    dy = biased.aim_offset(s)
    assert 0.0 < abs(dy) <= 0.05
    assert ArenaExpert(aim_error=0.05, seed=3).aim_offset(s) == dy  # a pure function of (seed, task, init state)
    assert ArenaExpert(aim_error=0.05, seed=4).aim_offset(s) != dy
    shifted = s.copy()
    for b in shifted.blocks:
        b[1] += dy
    # the biased expert does exactly what the exact expert does where the blocks are where it believes them to be
    np.testing.assert_array_equal(biased.act(s), ArenaExpert().act(shifted))
    env.step(biased.act(s))
    assert biased.aim_offset(env.get_state()) == dy  # constant over the episode
    with pytest.raises(ValueError, match="aim_error"):
        ArenaExpert(aim_error=-0.01)


def test_aim_error_demos_are_mixed_quality_and_labelled_with_the_demonstrators_own_chunks():
    from pi0.rollout.policies import collect_expert_demos
    from pi0.rollout import RolloutRunner, RunnerConfig
    from pi0.envs import make_env_spec

    states = [(4, i) for i in range(24)]
    with RolloutRunner(make_env_spec("arena", resolution=32), None,
                       RunnerConfig(num_envs=8, replan_steps=5, use_subprocess=False)) as runner:
        exact = collect_expert_demos(runner, states, 10)
        mixed = collect_expert_demos(runner, states, 10, aim_error=0.06, seed=0)
    assert all(e.success for e, _ in exact)
    ok = [e.success for e, _ in mixed]
    assert 0 < sum(ok) < len(ok)  # some demos miss the block: a lateral error beyond ~2 cm never pushes it
    for e, chunks in mixed:
        for d, chunk in zip(e.decisions, chunks):
            np.testing.assert_allclose(d.actions[d.valid], chunk[: d.valid.sum()])  # labels = what was executed


def test_step_outcome_latches_success_and_renders_on_demand():
    from pi0.envs.conventions import step_outcome
    # (succeeded, latched, steps, max_steps, render, render_every, on_demand) -> (reward, latched, truncated, rendered)
    assert step_outcome(True, False, 3, 10, None, 5, True) == (1.0, True, False, False)  # first success: reward 1
    assert step_outcome(True, True, 5, 10, None, 5, True) == (0.0, True, False, True)  # latched: no second reward
    assert step_outcome(False, True, 10, 10, False, 5, True) == (0.0, True, False, False)  # success is not truncation
    assert step_outcome(False, False, 10, 10, True, 5, True) == (0.0, False, True, True)
    assert step_outcome(False, False, 2, 10, False, 5, False) == (0.0, False, False, True)  # always renders
