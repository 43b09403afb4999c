"""bench/gpu_suite.py --dry-run: every step of the GPU suite runs small on the CPU, so the script never rots."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.slow
@pytest.mark.libero
def test_gpu_suite_dry_run(tmp_path):
    r = subprocess.run([sys.executable, "bench/gpu_suite.py", "--dry-run", "--out", str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_suite.json").read_text())
    steps = res["steps"]
    assert set(steps) == {"cuda_tests", "sampling_b1", "sampling_b64", "sampling_sde_b32", "sampling_pi05_b1",
                          "sampling_b1_3cam", "train_memory", "eval_1env", "eval_Nenv", "rl_iteration",
                          "rl_throughput"}
    assert steps["cuda_tests"]["selected"] >= 9  # the CUDA-marked tests are found (and not run on a CPU)
    for name in ("sampling_b1", "sampling_b64", "sampling_sde_b32", "sampling_pi05_b1", "sampling_b1_3cam"):
        assert steps[name]["status"] == "ok" and steps[name]["best_over_roofline"] > 1
        assert steps[name]["chunks_per_s"] > 0
    assert steps["eval_1env"]["episodes"] == steps["eval_Nenv"]["episodes"] == 2
    assert steps["rl_iteration"]["status"] == "ok" and "success" in steps["rl_iteration"]
    rt = steps["rl_throughput"]  # one timed iteration per path, all read back from the log
    assert rt["status"] == "ok"
    assert rt["baseline_iterations"] == rt["fast_iterations"] == rt["fast_encode_iterations"] == 1
    assert rt["ratio"] == pytest.approx(rt["baseline_iter_s"] / rt["fast_iter_s"], abs=0.02)
    assert rt["reuse_update_ratio"] == pytest.approx(rt["fast_encode_update_s"] / rt["fast_update_s"], abs=0.02)
    assert 0 < rt["fast_collect_s"] <= rt["fast_iter_s"] + 0.01
    assert "eval throughput: 2 envs / 1 env" in r.stdout  # the table
