"""Debug sessions and the compare tool find a planted difference at the right stage and decision."""

import copy
import subprocess
import sys

import numpy as np
import pytest

from conftest import LIBERO_TINY, REPO, golden_env_obs
from pi0.evaluation.debug import compare_sessions, write_debug_session
from pi0.policies.libero import Pi0ChunkPolicy
from pi0.policies.presets import tiny_policy
from pi0.rollout.types import DecisionPoint, Episode


def _episode(obs_list, chunk_policy, prompt):
    out = chunk_policy.predict_chunks(obs_list, [prompt] * len(obs_list))
    decisions = [DecisionPoint(step=5 * i, obs=o, actions=out.actions[i, :5], valid=np.ones(5, bool),
                               rewards=np.zeros(5), extras={k: v[i] for k, v in out.extras.items()})
                 for i, o in enumerate(obs_list)]
    return Episode(index=0, task_id=0, init_state_id=0, sample_index=0, group_index=0, prompt=prompt, success=False,
                   length=15, total_reward=0.0, terminated=False, truncated=True, decisions=decisions)


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    ref = np.load(LIBERO_TINY / "reference.npz")
    obs = [golden_env_obs(ref, i % 2) for i in range(3)]
    policy = tiny_policy(seed=0)
    import torch
    ep_a = _episode(obs, Pi0ChunkPolicy(policy, torch.Generator().manual_seed(0)), "put the bowl on the plate")
    obs_b = copy.deepcopy(obs)
    obs_b[1]["robot0_eef_pos"] = obs_b[1]["robot0_eef_pos"] + np.array([0.0, 0.0, 0.01])  # planted: 1 cm in z
    ep_b = _episode(obs_b, Pi0ChunkPolicy(policy, torch.Generator().manual_seed(0)), "put the bowl on the plate")
    # Same observations, other flow noise: everything up to the processed obs agrees, model inputs do not.
    ep_c = _episode(obs, Pi0ChunkPolicy(policy, torch.Generator().manual_seed(1)), "put the bowl on the plate")
    root = tmp_path_factory.mktemp("debug")
    info = {"suite": "libero_spatial"}
    return (write_debug_session(root / "a", ep_a, info), write_debug_session(root / "a2", ep_a, info),
            write_debug_session(root / "b", ep_b, info), write_debug_session(root / "c", ep_c, info))


def test_session_contents(sessions):
    a = sessions[0]
    assert (a / "env_info.json").is_file() and (a / "raw_obs_stats.json").is_file()
    assert (a / "images" / "000_raw_agentview_image.png").is_file()
    assert (a / "images" / "000_processed_image.png").is_file()
    z = np.load(a / "decisions.npz")
    assert z["processed/image"].shape == (3, 224, 224, 3) and z["model_output/actions"].shape == (3, 50, 32)


def test_identical_sessions_agree(sessions):
    first, rows = compare_sessions(sessions[0], sessions[1])
    assert first is None and len(rows) > 8


def test_planted_difference_found(sessions):
    first, _ = compare_sessions(sessions[0], sessions[2])
    assert first is not None
    assert (first.stage, first.key, first.first_decision) == ("raw", "raw/robot0_eef_pos", 1)
    assert abs(first.max_abs_diff - 0.01) < 1e-9


def test_planted_difference_at_model_input(sessions):
    first, rows = compare_sessions(sessions[0], sessions[3])
    assert (first.stage, first.key, first.first_decision) == ("model_input", "model_input/noise", 0)
    assert all(r.first_decision is None for r in rows if r.stage in ("raw", "processed"))
    assert any(r.key == "model_output/actions" and r.first_decision == 0 for r in rows)


def test_cli_exit_codes(sessions):
    script = REPO / "scripts" / "compare_debug_sessions.py"
    same = subprocess.run([sys.executable, str(script), str(sessions[0]), str(sessions[1])], capture_output=True, text=True)
    assert same.returncode == 0 and "no divergence" in same.stdout
    diff = subprocess.run([sys.executable, str(script), str(sessions[0]), str(sessions[2])], capture_output=True, text=True)
    assert diff.returncode == 1 and "FIRST DIVERGENCE: stage 'raw', key 'raw/robot0_eef_pos', decision 1" in diff.stdout
