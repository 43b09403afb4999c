"""Continued SFT beside RL (``baseline.sft``, what ``make run`` plots): a real subprocess trains from the same warm
start between RL's evaluations, its snapshots are scored on RL's held-out episodes, and summary.json pairs them."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY_TRAIN
from pi0.errors import UserError
from pi0.ript.config import load_config


def _weights(path):
    from safetensors.torch import load_file
    return load_file(str(path / "model.safetensors"))


def test_sft_baseline_beside_rl_writes_paired_summary_and_plot(tmp_path):
    from pi0.ript.utils.train_loop import train

    cfg = load_config("debug_train_pi0", TINY_TRAIN + [f"logging.out_dir={tmp_path}", "algo.iterations=3",
                                                       "algo.eval_every=2", "baseline.sft=true",
                                                       "baseline.sft_lr=1e-3", "baseline.warmup_steps=0",
                                                       "lr_schedule=cosine", "baseline.sft_schedule=cosine"])
    curve = train(cfg)
    # both arms' lr follows a half cosine over RL's 3 iterations: 1, 0.75, 0.25 in iterations 1-3 (cos(pi/3) = 0.5)
    lr = cfg.algo.opt.lr
    assert [c["lr"] for c in curve[1:]] == pytest.approx([lr, 0.75 * lr, 0.25 * lr])
    run = tmp_path / "debug_train_pi0"
    s = json.loads((run / "summary.json").read_text())
    # marks at RL's evaluations: iteration 2 and the last one (3); SFT scored at each, on the same 2 episodes
    assert [p["iteration"] for p in s["sft_curve"]] == [2.0, 3.0] == [p["iteration"] for p in s["rl_curve"]]
    assert s["held_out_episodes"] == 2 and s["rl_iterations"] == 3
    assert s["rl_curve"][-1]["eval_success_rate"] == s["rl"] == curve[-1]["eval_success_rate"]
    assert s["before"] == curve[0]["eval_success_rate"]
    assert 0 < s["sft_curve"][0]["minutes"] < s["sft_curve"][1]["minutes"] <= s["train_minutes"] + 1e-9
    assert s["rl_minus_sft"]["mean"] == pytest.approx(s["rl"] - s["sft"])
    # paired against the start's own episodes (the curve's iteration 0)
    assert s["rl_minus_before"]["mean"] == pytest.approx(s["rl"] - s["before"])
    assert s["sft_minus_before"]["mean"] == pytest.approx(s["sft"] - s["before"])
    assert s["rl_minus_before"]["se"] >= 0 and s["sft_minus_before"]["se"] >= 0
    assert s["minutes"] >= s["train_minutes"] and s["machine"]["cpu"] and s["machine"]["cores"] >= 1
    # the SFT process trained between the marks (and from the same start as RL)
    log = json.loads((run / "sft_baseline" / "log.json").read_text())
    assert 0 < log["snapshots"][0]["steps"] < log["snapshots"][1]["steps"] == log["steps"]
    # SFT's schedule read RL's progress: 2 of 3 iterations done at the first mark, all 3 at the last
    assert [m["lr_scale"] for m in log["snapshots"]] == pytest.approx([0.25, 0.0], abs=1e-12)
    start = _weights(next((tmp_path / "cache" / "ript_warm_start").iterdir()))
    snap = _weights(run / "sft_baseline" / "snap_1")
    assert start.keys() == snap.keys()
    assert any(not torch.equal(start[k], snap[k]) for k in start)
    assert (run / "success.png").is_file() and (run / "sft_curve.json").is_file()


@pytest.mark.parametrize("override, words", [
    (["baseline.sft=true", "task.env=libero"], r"baseline\.sft=true \(continued SFT\) trains on the tiny warm start's "
                                               r"demos, and task\.env=libero has none"),
    (["baseline.sft_lr=0"], "baseline.sft_lr=0"),
    (["baseline.sft_schedule=linear"], "baseline.sft_schedule='linear' is out of range; allowed: one of"),
    (["lr_schedule=step"], "lr_schedule='step' is out of range"),
    (["baseline.sft=true", "algo.eval_every=0"], "set algo.eval_every >= 1"),
])
def test_sft_baseline_config_errors(override, words):
    with pytest.raises(UserError, match=words):
        load_config("debug_train_pi0", override, check_paths=True)


def test_lr_scale_at_by_hand():
    from pi0.ript.update import lr_scale_at

    assert [lr_scale_at("constant", f) for f in (0.0, 0.5, 1.0)] == [1.0, 1.0, 1.0]
    # 0.5 (1 + cos(pi f)): f = 0 -> 1, 1/3 -> 0.75, 1/2 -> 0.5, 2/3 -> 0.25, 1 -> 0; clamped outside [0, 1]
    assert [lr_scale_at("cosine", f) for f in (0.0, 1 / 3, 0.5, 2 / 3, 1.0, 2.0, -1.0)] == pytest.approx(
        [1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 1.0], abs=1e-12)
    with pytest.raises(ValueError, match="unknown lr schedule 'linear'"):
        lr_scale_at("linear", 0.5)


def test_rl_lr_scale_warmup_times_cosine():
    from pi0.ript.utils.train_loop import rl_lr_scale

    cfg = load_config("debug_train_pi0", ["algo.iterations=4", "warmup_iterations=2", "lr_schedule=cosine"])
    # iteration i of 4: warm-up min(1, (i+1)/2) x 0.5 (1 + cos(pi i / 4)); cos(pi/4) = 0.7071, cos(3 pi/4) = -0.7071
    assert [rl_lr_scale(cfg, i) for i in range(4)] == pytest.approx(
        [0.5, 0.5 * (1 + 0.70710678), 0.5, 0.5 * (1 - 0.70710678)])
    const = load_config("debug_train_pi0", ["algo.iterations=4"])
    assert [rl_lr_scale(const, i) for i in range(4)] == [1.0] * 4

