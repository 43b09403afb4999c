"""bench/rl_improvement.py's bookkeeping: snapshot marks along an arm's budget, the curve's held-out subset and the
start's search for N."""

from __future__ import annotations

import sys
import time

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
from rl_improvement import Config, Snapshots, curve_subset  # noqa: E402

from pi0.policies.presets import tiny_policy  # noqa: E402


def test_snapshots_at_marks_and_no_duplicate_final(tmp_path):
    policy = tiny_policy()
    snaps = Snapshots(tmp_path, seconds=10.0, n=2)  # marks at 5 s and 10 s

    def at(elapsed: float, final: bool = False) -> None:
        snaps.t0 = time.perf_counter() - elapsed
        snaps.maybe(policy, final=final)

    at(4.0)
    assert snaps.saved == []
    at(6.0)
    at(7.0)
    assert len(snaps.saved) == 1
    at(11.0)  # the budget's end: the last mark saves the final weights
    at(11.0, final=True)  # nothing trained since: no second copy of the same weights to evaluate
    assert [s["path"].rsplit("/", 1)[1] for s in snaps.saved] == ["snap00", "snap01"]
    at(12.0)  # trained on past the last mark (one more iteration): the end saves it
    at(12.5, final=True)
    assert len(snaps.saved) == 3 and (tmp_path / "snap02" / "model.safetensors").is_file()


def test_curve_subset_takes_the_first_states_of_each_task():
    cfg = Config(task=[1, 2], eval_start=10, eval_states=4, curve_states=2)
    held = [(t, i) for t in cfg.task for i in range(10, 14)]
    assert curve_subset(cfg, held) == [(1, 10), (1, 11), (2, 10), (2, 11)]
    assert curve_subset(Config(task=[1, 2], eval_start=10, eval_states=4), held) == held  # 0: all of them


def test_next_num_demos_moves_n_toward_the_plateau_band():
    from rl_improvement import next_num_demos

    band = [0.15, 0.5]
    assert next_num_demos(200, 0.65, band, 1500) == 150  # above: x 0.75 (seed 2's start: 0.65 -> 150 demos)
    assert next_num_demos(150, 0.10, band, 1500) == 200  # below: x 4/3
    assert next_num_demos(200, 0.42, band, 1500) is None and next_num_demos(200, 0.5, band, 1500) is None  # inside
    assert next_num_demos(1200, 0.0, band, 1500) == 1500  # capped by the training states
    assert next_num_demos(1500, 0.0, band, 1500) is None  # nothing left to add
    assert next_num_demos(10, 0.9, band, 1500) is None  # the floor
    assert next_num_demos(200, 0.65, [], 1500) is None  # no band: num_demos as given
    # a small N leaves the band's edge: 20 x 0.75 rounds back to 20, so it steps by 10 (MetaWorld's 20 at 0.72)
    assert next_num_demos(20, 0.72, band, 200) == 10 and next_num_demos(20, 0.05, band, 200) == 30
