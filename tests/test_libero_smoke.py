"""LIBERO end to end through the shared runner core: tiny pi0, one subprocess env, a few decision points."""

import dataclasses
import json

import imageio.v3 as iio
import numpy as np
import pytest

from pi0.evaluation.libero_eval import EvalConfig, check_tasks, evaluate_libero
from pi0.policies.presets import tiny_policy

pytestmark = pytest.mark.libero


def test_unknown_task_id_fails_fast():
    with pytest.raises(ValueError, match=r"unknown task id\(s\) \[12\].*0\.\.9"):
        check_tasks("libero_spatial", [0, 12], 1)
    with pytest.raises(ValueError, match="unknown LIBERO suite|libero_nope"):
        check_tasks("libero_nope", None, 1)


def test_stage2_path_writes_results_video_and_debug(tmp_path):
    cfg = EvalConfig(suite="libero_spatial", task_ids=[0], num_trials=1, num_envs=1, max_steps=15, num_videos=1,
                     debug=True, out_dir=str(tmp_path))
    results = evaluate_libero(tiny_policy(), cfg)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["num_episodes"] == 1 and saved["per_task"]["0"]["episodes"] == 1
    ep = saved["episodes"][0]
    assert ep["length"] == 15 and ep["success"] is False  # a random tiny model does not solve the task
    assert results["policy_calls"] == 3  # 15 steps / replan every 5
    videos = list((tmp_path / "videos").glob("libero_spatial_task0_trial0_failure.mp4"))
    assert len(videos) == 1
    frames = iio.imread(videos[0])
    assert frames.shape[0] == 4 and frames.shape[-1] == 3  # reset frame + one per decision point
    assert frames.std() > 5  # a rendered scene, not a blank image
    z = np.load(tmp_path / "debug" / "task0_init0" / "decisions.npz")
    assert z["processed/image"].shape == (3, 224, 224, 3) and z["actions/executed"].shape == (3, 5, 7)


def test_resume_skips_finished_episodes(tmp_path):
    """An interrupted evaluation continues from episodes.jsonl instead of starting over."""
    cfg = EvalConfig(suite="libero_spatial", task_ids=[0], num_trials=2, num_envs=1, max_steps=5, num_videos=0,
                     out_dir=str(tmp_path), use_subprocess=False)
    # Pretend trial 0 finished before a crash (a record the simulator could never produce: length 3 of 5).
    (tmp_path / "episodes.jsonl").write_text(json.dumps({"task_id": 0, "trial": 0, "success": True, "length": 3,
                                                         "attempts": 1}) + "\n")
    results = evaluate_libero(tiny_policy(), dataclasses.replace(cfg, resume=True))
    assert results["num_resumed"] == 1 and results["num_episodes"] == 2
    assert [e["length"] for e in results["episodes"]] == [3, 5]  # trial 0 kept, trial 1 run now
    assert results["success_rate"] == 0.5 and results["policy_calls"] == 1
    lines = (tmp_path / "episodes.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["trial"] == 1
