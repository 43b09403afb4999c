"""bench/start_cooldown.py on a tiny preset: its row of the preset's cooldown is the start the RL job uses (the bench
checks the weights), the paired gains are computed from the episodes it ran, and bad counts fail first."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO, TINY_TRAIN

sys.path.insert(0, str(REPO / "bench"))
from start_cooldown import main  # noqa: E402


def test_the_preset_row_is_the_jobs_cooled_start(tmp_path, capsys):
    over = TINY_TRAIN + [f"logging.out_dir={tmp_path}", "task.warm_start_patience=1", "task.warm_start_every=2",
                         "task.warm_start_val_states=2", "task.eval_start=8", "task.warm_start_steps=20",
                         "task.warm_start_cooldown=3",
                         "task.warm_start_patience_from_success=false"]  # the tiny start never succeeds: stop at 0
    out = tmp_path / "rows.json"
    rows = main(["--preset", "debug_train_pi0", "--cooldown", "0", "3", "--sft_steps", "2", "--repeats", "2",
                 "--json_out", str(out), *over])
    printed = capsys.readouterr().out
    assert "cooldown 3: the same weights as the start debug_train_pi0 uses" in printed
    assert printed.strip().splitlines()[-1].startswith("cooldown=3 val=")
    assert [r["cooldown"] for r in rows] == [0, 3] and all(r["episodes"] == 4 for r in rows)  # 2 states x 2
    for r in rows:
        assert r["sft_gain"] == pytest.approx(r["after_sft"] - r["val"])
    assert json.loads(out.read_text())["rows"] == rows
    # the job's cache holds the plateau's start and its cooled copy (trained once, by the bench's check)
    cache = sorted(p.name for p in (tmp_path / "cache" / "ript_warm_start").iterdir())
    assert len(cache) == 2 and cache[1] == cache[0] + "-cool3"
    rec = json.loads((tmp_path / "cache" / "ript_warm_start" / cache[1] / "warm_start.json").read_text())
    assert rec["cooldown"] == 3 and rec["base"] == cache[0]


@pytest.mark.parametrize("args", [["--cooldown=-1"], ["--repeats", "0"], ["bogus.key=1"]])
def test_bad_arguments_fail_before_training(args, tmp_path):
    with pytest.raises(SystemExit, match="error"):
        main(args + [f"logging.out_dir={tmp_path}"])
    assert not (tmp_path / "cache").exists()
