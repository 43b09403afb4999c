"""openpi-exact LIBERO evaluation: the task-order schedule, the eval's wiring, and parity with LIBERO's own env.

The simulator test replays openpi's examples/libero/main.py seeding by hand on LIBERO's ``OffScreenRenderEnv``
(np.random.seed(7), build the env, env.seed(7), then per episode k: reset, set_init_state(k), 10 wait steps) and
checks that our openpi-exact mode gives bit-identical first observations, twice: through the evaluation's runner
setup, and in a fresh env asked for episode 1 directly (it replays the missing reset).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("MUJOCO_GL", "egl")

from pi0.envs.conventions import CAMERA_KEYS, PROPRIO_KEYS, WAIT_ACTION  # noqa: E402
from pi0.evaluation.libero_eval import EvalConfig, runner_setup  # noqa: E402
from pi0.rollout.config import RunnerConfig  # noqa: E402
from pi0.rollout.scheduler import TaskOrderScheduler, make_requests, make_scheduler  # noqa: E402

SUITE, TASK, SEED = "libero_spatial", 0, 7  # task 0 has a cabinet and a stove placed from numpy's RNG at reset
FIXTURES = ("wooden_cabinet_1_main", "flat_stove_1_main")


# ------------------------------------------------------------------------------------------- cheap, no simulator
def test_task_order_scheduler_runs_each_task_in_order_on_one_worker():
    reqs = make_requests([(3, 0), (3, 1), (3, 2), (5, 0), (5, 1), (8, 0)])
    sched = make_scheduler("task_order", reqs, num_workers=2, group_size=1, task_affinity=True)
    assert isinstance(sched, TaskOrderScheduler)
    free = {0: True, 1: True}
    got = [(w, r.task_id, r.init_state_id) for w, r in sched.assignments([0, 1], free.get, [None, None])]
    assert got == [(0, 3, 0), (1, 5, 0)]
    free = {0: False, 1: True}  # worker 1 finishes first: the rest of ITS task, never task 3's next episode
    assert [(w, r.task_id, r.init_state_id) for w, r in sched.assignments([1], free.get, [3, 5])] == [(1, 5, 1)]
    assert [(w, r.task_id, r.init_state_id) for w, r in sched.assignments([1], free.get, [3, 5])] == [(1, 8, 0)]
    assert sched.pending  # task 3 still has two episodes on worker 0
    free = {0: True, 1: True}
    assert [(w, r.init_state_id) for w, r in sched.assignments([1], free.get, [3, 8])] == []  # worker 1 has no task
    assert [(w, r.task_id, r.init_state_id) for w, r in sched.assignments([0], free.get, [3, 8])] == [(0, 3, 1)]
    assert [(w, r.task_id, r.init_state_id) for w, r in sched.assignments([0], free.get, [3, 8])] == [(0, 3, 2)]
    assert not sched.pending


def test_bad_schedule_is_rejected_with_the_valid_ones_named():
    with pytest.raises(ValueError, match="task_order"):
        RunnerConfig(schedule="openpi")


def test_eval_wires_openpi_exact_mode_into_env_and_schedule():
    spec, run_cfg = runner_setup(EvalConfig(suite=SUITE, openpi_exact=True, seed=11, max_steps=3), first_task=2)
    assert spec.kwargs["openpi_exact"] is True and spec.kwargs["seed"] == 11 and spec.kwargs["task_id"] == 2
    assert spec.kwargs["max_steps"] == 3 and run_cfg.schedule == "task_order"
    spec, run_cfg = runner_setup(EvalConfig(suite=SUITE), first_task=0)
    assert "openpi_exact" not in spec.kwargs and run_cfg.schedule == "greedy"


# ------------------------------------------------------------------------------------------- real simulator
def _first_obs(raw: dict) -> dict[str, np.ndarray]:
    """The keys the policy sees, copied."""
    return {k: np.array(raw[k]) for k in (*PROPRIO_KEYS, *CAMERA_KEYS)}


def _fixture_poses(sim) -> np.ndarray:
    """(len(FIXTURES), 3) body positions of the task's fixtures."""
    return np.stack([np.array(sim.model.body_pos[sim.model.body_name2id(name)]) for name in FIXTURES])


def _openpi_reference(num_episodes: int) -> list[tuple[dict[str, np.ndarray], np.ndarray]]:
    """First decision-point obs and fixture poses of episodes 0.. of openpi's loop, on LIBERO's own env."""
    from libero.libero.envs import OffScreenRenderEnv

    from pi0.envs.libero_env import resolve_libero_task

    task = resolve_libero_task(SUITE, TASK)
    np.random.seed(SEED)
    env = OffScreenRenderEnv(bddl_file_name=task.bddl_file, camera_heights=256, camera_widths=256)
    env.seed(SEED)
    out = []
    try:
        for k in range(num_episodes):
            env.reset()
            obs = env.set_init_state(task.init_states[k])
            for _ in range(10):
                obs, _, _, _ = env.step(list(WAIT_ACTION))
            out.append((_first_obs(obs), _fixture_poses(env.sim)))
    finally:
        env.close()
    return out


def _assert_same(ours: dict[str, np.ndarray], ref: dict[str, np.ndarray], what: str) -> None:
    for key in ref:
        assert np.array_equal(ours[key], ref[key]), f"{what}: {key} differs from openpi's (max abs diff " \
            f"{np.abs(ours[key].astype(np.float64) - ref[key].astype(np.float64)).max():.3g})"


@pytest.mark.libero
@pytest.mark.slow
def test_openpi_exact_mode_matches_libero_own_env_under_openpi_seeding():
    import libero.libero  # noqa: F401  (`make test` installs it: a missing simulator fails, never skips)

    from pi0.envs.libero_env import LiberoEnv
    from pi0.rollout.policies import ZeroChunkPolicy
    from pi0.rollout.runner import RolloutRunner

    ref = _openpi_reference(2)
    # the fixtures really move between openpi's episodes, so matching them is not trivial
    assert np.abs(ref[0][1] - ref[1][1]).max() > 1e-3

    # run 1: the evaluation's own setup (openpi-exact env spec + task_order schedule), in-process, 1 step each
    cfg = EvalConfig(suite=SUITE, task_ids=[TASK], num_trials=2, num_envs=1, max_steps=1, num_videos=0,
                     use_subprocess=False, openpi_exact=True, seed=SEED)
    spec, run_cfg = runner_setup(cfg, TASK)
    np.random.seed(1234)  # the caller's RNG stream must not matter
    with RolloutRunner(spec, ZeroChunkPolicy(), run_cfg.replace(progress=False)) as runner:
        episodes = runner.run([(TASK, 0), (TASK, 1)])
    for k, ep in enumerate(episodes):
        assert ep.init_state_id == k and ep.info["openpi_skipped_resets"] == 0
        _assert_same(ep.decisions[0].obs, ref[k][0], f"run 1, episode {k}")

    # run 2: a fresh env asked for episode 1 first replays the reset of episode 0, then matches again
    np.random.seed(99)
    env = LiberoEnv(SUITE, TASK, seed=SEED, openpi_exact=True, render_on_demand=True)
    try:
        obs, info = env.reset(options={"init_state_id": 1})
        assert info["openpi_skipped_resets"] == 1
        _assert_same(obs, ref[1][0], "run 2, episode 1")
        assert np.array_equal(_fixture_poses(env.raw_env.sim), ref[1][1])
    finally:
        env.close()
