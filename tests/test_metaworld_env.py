"""MetaWorld MT10 env: LIBERO conventions, deterministic init states, scripted-expert episodes in subprocess workers."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", "egl")

from pi0.envs import CAMERA_KEYS, make_env_spec  # noqa: E402
from pi0.envs.metaworld_env import MT10_TASKS  # noqa: E402
from pi0.rollout import RolloutRunner, RunnerConfig  # noqa: E402
from pi0.rollout.policies import collect_metaworld_demos  # noqa: E402
from pi0.transforms import libero_client_obs  # noqa: E402


def test_expert_episodes_of_two_tasks_succeed_in_subprocess_workers_with_images():
    spec = make_env_spec("metaworld", expert_chunks=True, expert_horizon=10, resolution=64)
    with RolloutRunner(spec, None, RunnerConfig(num_envs=2, replan_steps=5, use_subprocess=True)) as runner:
        demos = collect_metaworld_demos(runner, [(2, 0), (6, 1)], horizon=10)
    for (ep, chunks), tid in zip(demos, (2, 6)):
        assert ep.success and ep.task_id == tid and ep.prompt == MT10_TASKS[tid][1]
        assert chunks.shape == (len(ep.decisions), 10, 7) and np.all(chunks[..., 3:6] == 0)
        d = ep.decisions[1]
        for k in CAMERA_KEYS:  # rendered at decision points, a scene (not a blank image)
            assert d.obs[k].shape == (64, 64, 3) and d.obs[k].dtype == np.uint8 and d.obs[k].std() > 5
        np.testing.assert_array_equal(d.actions, chunks[1][: len(d.actions)])  # the expert chunk was executed
        client = libero_client_obs(d.obs, 32)
        assert client["state"].shape == (8,) and client["state"][6] == -client["state"][7]


def test_init_states_are_deterministic_and_bad_input_is_refused():
    env = make_env_spec("metaworld", task_id=1, resolution=32)().unwrapped
    try:
        a = env.reset(options={"init_state_id": 57, "render": False})[0]["metaworld_obs"]
        b = env.reset(options={"init_state_id": 3, "render": False})[0]["metaworld_obs"]
        c = env.reset(options={"init_state_id": 57, "render": False})[0]["metaworld_obs"]
        np.testing.assert_array_equal(a, c)  # the same (task, id): the same puck and goal
        assert np.abs(a - b).max() > 1e-3
        obs, r, term, trunc, info = env.step(np.array([0.5, 0, 0, 0.9, 0.9, 0.9, -1.0]), render=True)
        assert obs[CAMERA_KEYS[0]].shape == (32, 32, 3) and info["policy_step"] == 1 and not term
        with pytest.raises(ValueError, match="actions are LIBERO's"):
            env.step(np.zeros(4))
        with pytest.raises(ValueError, match="MT10 task ids are 0..9"):
            env.reset(options={"task_id": 12})
        with pytest.raises(ValueError, match="init_state_id"):
            env.reset(options={"init_state_id": 10**6})
    finally:
        env.close()


def test_fast_render_drops_shadows_and_multisampling_only_and_every_runner_uses_it():
    from pi0.ript.config import load_config
    from pi0.ript.utils.train_loop import build_runner
    from pi0.ript.warm_start import env_runner
    full = make_env_spec("metaworld", task_id=2, resolution=64, fast_render=False)().unwrapped
    fast = make_env_spec("metaworld", task_id=2, resolution=64)().unwrapped
    try:
        a = full.reset(options={"init_state_id": 3})[0]
        b = fast.reset(options={"init_state_id": 3})[0]
        scene = np.abs(a[CAMERA_KEYS[0]].astype(int) - b[CAMERA_KEYS[0]].astype(int))
        assert b[CAMERA_KEYS[0]].shape == (64, 64, 3) and b[CAMERA_KEYS[0]].std() > 5
        assert 0 < scene.mean() < 8 and scene.max() > 10  # the same scene, less the cast shadows
        assert full._renderer.renderer.model.vis.quality.offsamples == 4
        assert fast._renderer.renderer.model.vis.quality.offsamples == 0
        assert fast._env.model.vis.quality.offsamples == 4  # the renderer's copy is set, not the env's model
        np.testing.assert_array_equal(a["metaworld_obs"], b["metaworld_obs"])  # rendering does not touch physics
    finally:
        full.close()
        fast.close()
    with env_runner("metaworld", 1, 5, num_init_states=10) as runner:  # warm start and bench
        assert runner.env_factory.kwargs["fast_render"] is True
    with build_runner(load_config("metaworld_mt10", check_paths=False)) as runner:  # stages 7-11: the same images
        assert runner.env_factory.kwargs["fast_render"] is True



def test_envs_of_a_task_share_one_renderer_whose_frames_equal_a_private_renderers():
    """Two envs of one task and one of another, switching tasks: one renderer per task in the process, and every
    frame equals that of a private ``mujoco.Renderer`` of the env's own model (fast_render's settings, no culling)."""
    import mujoco

    from pi0.envs.metaworld_env import SCENE_CAMERA, WRIST_CAMERA, SceneRenderer

    def private(env) -> list[np.ndarray]:
        model = env._env.model
        model.vis.quality.offsamples = 0
        with mujoco.Renderer(model, 48, 48) as r:
            for flag in (mujoco.mjtRndFlag.mjRND_SHADOW, mujoco.mjtRndFlag.mjRND_REFLECTION):
                r.scene.flags[flag] = 0
            out = []
            for cam in (SCENE_CAMERA, WRIST_CAMERA):
                r.update_scene(env._env.data, camera=cam)
                out.append(r.render().copy())
        return out

    SceneRenderer.close_all()
    envs = [make_env_spec("metaworld", task_id=t, resolution=48)().unwrapped for t in (1, 1, 2)]
    rng = np.random.default_rng(0)
    try:
        for tasks, renderers in (((1, 1, 2), 2), ((2, 5, 1), 3)):  # the second round switches every env's task
            for i, (env, t) in enumerate(zip(envs, tasks)):
                env.reset(options={"task_id": t, "init_state_id": 5 * i + t})
            assert len(SceneRenderer._shared) == renderers
            assert (envs[0]._renderer is envs[1]._renderer) == (tasks[0] == tasks[1])
            for _ in range(2):
                for env in envs:
                    for _ in range(7):
                        obs = env.step(np.clip(rng.normal(0, 0.8, 7), -1, 1), render=True)[0]
                    for k, ref in zip(CAMERA_KEYS, private(env)):
                        np.testing.assert_array_equal(obs[k], ref)
    finally:
        for env in envs:
            env.close()
    assert len(SceneRenderer._shared) == 3  # tasks 1, 2 and 5: kept for the process's next envs
    SceneRenderer.close_all()
    assert not SceneRenderer._shared


RENDER_FRAMES = """
import os, sys
import numpy as np
from pi0.envs import CAMERA_KEYS, make_env_spec
env = make_env_spec("metaworld", task_id=2, resolution=64)().unwrapped
obs = [env.reset(options={"init_state_id": 3})[0]]
obs += [env.step(np.full(7, 0.3), render=True)[0] for _ in range(3)]
np.save(sys.argv[1], np.stack([o[k] for o in obs for k in CAMERA_KEYS]))
print(os.environ.get("LP_NUM_THREADS"))
"""


def test_renders_take_one_llvmpipe_thread_unless_told_and_match_more_threads(tmp_path):
    """The env asks Mesa's CPU rasterizer for one thread (cheaper for 64-px frames) without overriding the user's
    LP_NUM_THREADS, and the frames equal those of two threads bit for bit."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "LP_NUM_THREADS"}
    one = subprocess.run([sys.executable, "-c", RENDER_FRAMES, str(tmp_path / "one.npy")], env=env,
                         capture_output=True, text=True, timeout=300)
    two = subprocess.run([sys.executable, "-c", RENDER_FRAMES, str(tmp_path / "two.npy")],
                         env={**env, "LP_NUM_THREADS": "2"}, capture_output=True, text=True, timeout=300)
    assert one.returncode == two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    assert one.stdout.split()[-1] == "1" and two.stdout.split()[-1] == "2"
    a, b = np.load(tmp_path / "one.npy"), np.load(tmp_path / "two.npy")
    assert a.shape == (8, 64, 64, 3) and a.std() > 5
    np.testing.assert_array_equal(a, b)


def test_stage9_trains_on_metaworld_from_a_scripted_expert_warm_start(tmp_path):
    """The MetaWorld preset through the stage scripts' job: demos from MetaWorld's scripted experts (no arena-only
    path), SFT warm start, one LOOP iteration in subprocess workers, held-out evaluation."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "9_train_with_config.py", "--config_path", "metaworld_mt10", "task.task_ids=[2]",
                        "task.warm_start_demos=1", "task.warm_start_steps=4", "task.warm_start_patience=0",
                        "task.train_states=2", "task.eval_start=2", "task.eval_states=1", "algo.iterations=1",
                        "algo.num_groups=1", "algo.group_size=2", "algo.eval_every=1", "env.runner.num_envs=2",
                        "env.runner.max_steps=10", "env.num_init_states=4", "features.save_video=false",
                        "features.enable_smart_sampling=false", "logging.progress=false", "logging.plot=false",
                        f"logging.out_dir={tmp_path}"], cwd=repo, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "iter 1: success 0.00 (2 rollouts)" in r.stdout
    rec = json.loads(next((tmp_path / "cache" / "ript_warm_start").glob("*/warm_start.json")).read_text())
    assert rec["env"] == "metaworld" and rec["demos"] == 1
    assert (tmp_path / "metaworld_mt10" / "final" / "model.safetensors").is_file()
