"""Shared fixtures: paths to ../shared, a converted tiny openpi checkpoint, a tiny random policy."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", "egl")

REPO = Path(__file__).resolve().parents[1]
# ../shared beside the repo; PI0_SHARED points elsewhere (the lent GPU machine gets a copy carried in the repo).
SHARED = Path(os.environ.get("PI0_SHARED", REPO.parent / "shared"))
GOLDEN = SHARED / "golden"
PI0_TINY = GOLDEN / "openpi_pi0_tiny"
LIBERO_TINY = GOLDEN / "openpi_libero_policy_tiny"
CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")

torch.set_num_threads(min(2, os.cpu_count() or 1))

# overrides that make a stage-7..11 training job tiny (arena, 2 states x 2 rollouts, 15 steps, no video)
TINY_TRAIN = ["task.warm_start_demos=2", "task.warm_start_steps=5", "env.runner.max_steps=15", "task.train_states=6",
              "task.eval_start=6", "task.eval_states=2", "algo.num_groups=2", "algo.group_size=2",
              "features.enable_smart_sampling=false", "algo.opt.minibatch_size=64", "logging.progress=false",
              "features.save_video=false"]


def torchrun(*args: str, timeout: int = 240) -> str:
    """``torchrun --nproc_per_node=2 <args>`` on a free port with this checkout's pi0 -> stdout (asserts exit 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}", *args]
    # PYTHONFAULTHANDLER: a rank that dies on a signal (a SIGSEGV once, in a full run) prints every thread's stack
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1"}
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r.stdout


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.fail(f"shared fixture {path} is missing (tests need ../shared beside the repo)")
    return path


need_fixture = _need  # for test modules: a missing shared fixture fails the test (CI has ../shared)


@pytest.fixture(scope="session")
def pi0_reference() -> dict[str, np.ndarray]:
    """openpi's reference outputs on the tiny model."""
    return dict(np.load(_need(PI0_TINY / "reference.npz")))


@pytest.fixture(scope="session")
def converted_tiny(tmp_path_factory) -> Path:
    """The shared openpi tiny checkpoint converted once per session (float32) by the real CLI.

    Run in a subprocess so JAX (multithreaded) never lives in the pytest process that later forks.
    """
    out = tmp_path_factory.mktemp("converted") / "pi0_tiny"
    cmd = [sys.executable, str(REPO / "convert_pi0_to_hf_lerobot.py"), "--checkpoint_dir",
           str(_need(PI0_TINY / "checkpoint" / "params")), "--output_path", str(out),
           "--tokenizer", str(_need(LIBERO_TINY / "tokenizer.model"))]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def model_inputs(ref: dict[str, np.ndarray]) -> dict[str, object]:
    """Reference arrays -> sample_actions / forward keyword arguments."""
    return dict(
        images=[torch.from_numpy(ref[f"image/{k}"]).permute(0, 3, 1, 2) for k in CAMERAS],
        img_masks=[torch.from_numpy(ref[f"image_mask/{k}"]) for k in CAMERAS],
        lang_tokens=torch.from_numpy(ref["tokenized_prompt"]).long(),
        lang_masks=torch.from_numpy(ref["tokenized_prompt_mask"]),
        state=torch.from_numpy(ref["state"]),
    )


def golden_env_obs(ref: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """Row ``i`` of a golden fixture's raw LIBERO observations (``raw/*``), keyed as the LIBERO env returns them."""
    return {"agentview_image": ref["raw/agentview_image"][i], "robot0_eye_in_hand_image": ref["raw/wrist_image"][i],
            "robot0_eef_pos": ref["raw/eef_pos"][i], "robot0_eef_quat": ref["raw/eef_quat"][i],
            "robot0_gripper_qpos": ref["raw/gripper_qpos"][i]}


def assert_same_episodes(a, b) -> None:
    """Episodes equal in everything the env and the deterministic policy determine."""
    assert [e.key for e in a] == [e.key for e in b]
    for x, y in zip(a, b):
        assert (x.index, x.success, x.length, x.total_reward, x.terminated, x.truncated, x.prompt) == \
               (y.index, y.success, y.length, y.total_reward, y.terminated, y.truncated, y.prompt), x.key
        assert len(x.decisions) == len(y.decisions)
        for dx, dy in zip(x.decisions, y.decisions):
            assert dx.step == dy.step
            np.testing.assert_array_equal(dx.actions, dy.actions)
            np.testing.assert_array_equal(dx.valid, dy.valid)
            np.testing.assert_array_equal(dx.rewards, dy.rewards)
            assert set(dx.obs) == set(dy.obs)
            for k in dx.obs:
                np.testing.assert_array_equal(dx.obs[k], dy.obs[k])
