"""bench/make_run_tune.py: both arms get the same number of grid points, scored on tuning states that no held-out,
training or start-validation state is among, and each arm's choice is its best final score on them."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO, TINY_TRAIN
from pi0.ript.config import load_config

sys.path.insert(0, str(REPO / "bench"))
import make_run_tune as tune  # noqa: E402


def test_tiny_grid_scores_both_arms_on_tuning_states_only(tmp_path, capsys):
    over = TINY_TRAIN + [f"logging.out_dir={tmp_path}", "algo.iterations=2", "algo.eval_every=2", "baseline.sft=true"]
    rec = tune.main(["--preset", "debug_train_pi0", "--rl", "algo.opt.lr=1e-4", "algo.opt.lr=1e-3,lr_schedule=cosine",
                     "--sft", "baseline.sft_lr=1e-4", "baseline.sft_lr=1e-3", "--tune_states", "3", *over])
    # held-out states are 6..7 (TINY_TRAIN): tuning takes the next 3, and every job was scored there
    assert rec["tune_range"] == [8, 11] and rec["held_out_range"] == [6, 8]
    for j, job in enumerate(rec["jobs"]):
        used = load_config(str(tmp_path / f"make_run_tune_p{j}" / "config.yaml"), check_paths=False)
        assert (used.task.eval_start, used.task.eval_states) == (8, 3)
        assert not used.features.save_video
    p1 = load_config(str(tmp_path / "make_run_tune_p1" / "config.yaml"), check_paths=False)
    assert (p1.algo.opt.lr, p1.lr_schedule, p1.baseline.sft_lr) == (1e-3, "cosine", 1e-3)
    for arm in ("rl", "sft"):
        pts = rec["points"][arm]
        assert [p["episodes"] for p in pts] == [3, 3]
        s = json.loads((tmp_path / "make_run_tune_p0" / "summary.json").read_text())
        assert pts[0]["val"] == s[arm] and pts[0]["before"] == s["before"]
        assert rec["best"][arm] == pts[tune.choose(pts)]["entry"]
    assert json.loads((tmp_path / "make_run_tune.json").read_text())["best"] == rec["best"]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"best rl={rec['best']['rl']} sft={rec['best']['sft']}"


def test_choose_takes_the_first_best():
    assert tune.choose([{"val": 0.3}, {"val": 0.5}, {"val": 0.5}, {"val": 0.1}]) == 1


@pytest.mark.parametrize("args, words", [
    (["--rl", "algo.opt.lr=1e-4", "--sft", "baseline.sft_lr=1e-4", "baseline.sft_lr=1e-3"], "same number of points"),
    (["--rl", "baseline.sft_lr=1e-4", "--sft", "baseline.sft_lr=1e-3"], "is not the rl arm's to tune"),
    (["--rl", "algo.seed=3", "--sft", "baseline.sft_lr=1e-3"], "algo.seed is not the rl arm's"),
    (["--rl", "algo.opt.lr=1e-4", "--sft", "algo.opt.lr=1e-3"], "is not the sft arm's to tune"),
    (["--rl", "algo.opt.lr", "--sft", "baseline.sft_lr=1e-3"], "is not key=value"),
    (["--rl", "algo.opt.lr=-1", "--sft", "baseline.sft_lr=1e-3"], "grid point 0 .*algo.opt.lr"),
    (["--tune_start", "7"], "overlap the held-out states 6..7"),  # the split: held-out states never tune anything
    (["--tune_start", "4"], "overlap the training / start-validation states 0..5"),
    (["--tune_states", "0"], "--tune_states must be >= 1"),
    (["bogus.key=1"], "bogus"),
])
def test_bad_grids_fail_before_any_job(args, words, tmp_path):
    over = TINY_TRAIN + [f"logging.out_dir={tmp_path}", "baseline.sft=true"]
    with pytest.raises(SystemExit, match=words):
        tune.main(["--preset", "debug_train_pi0", *args, "--", *over])
    assert not list(tmp_path.iterdir())  # no job ran, no cache was built


def test_start_validation_states_are_not_tuning_states(tmp_path):
    cfg = load_config("debug_train_pi0", TINY_TRAIN + ["task.warm_start_patience=2", "task.warm_start_val_states=3",
                                                       "task.eval_start=9"])
    # training 0..5, the start's validation 6..8, held-out 9..10: tuning starts at 11 by default, never below 9
    assert tune.tuning_range(cfg, None, 4) == (11, 15)
    with pytest.raises(SystemExit, match="overlap the training / start-validation states 0..8"):
        tune.tuning_range(cfg, 8, 1)
