"""bench/rl_improvement.py's bookkeeping: snapshot marks along an arm's budget, the curve's held-out subset and the
start's search for N."""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

import pytest

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


def test_goal_met_by_hand_and_only_within_the_goal_budget():
    from rl_table import goal_met

    # arena: RL >= 0.8 and >= best + 0.15, 3 paired SE above 0, in at most 20 minutes per arm
    assert goal_met("arena", 20, before=0.41, after=0.80, diff=0.15, diff_se=0.04)
    assert not goal_met("arena", 20, before=0.41, after=0.79, diff=0.30, diff_se=0.02)  # below 0.8
    assert not goal_met("arena", 20, before=0.41, after=0.90, diff=0.14, diff_se=0.02)  # lead under 0.15
    assert not goal_met("arena", 20, before=0.41, after=0.90, diff=0.20, diff_se=0.07)  # under 3 SE
    assert not goal_met("arena", 60, before=0.41, after=0.877, diff=0.398, diff_se=0.026)  # three times the budget
    # MetaWorld: RL >= start + 0.2 and >= best + 0.1, in at most 40 minutes per arm
    assert goal_met("metaworld", 40, before=0.3, after=0.5, diff=0.1, diff_se=0.05)
    assert not goal_met("metaworld", 40, before=0.3, after=0.49, diff=0.2, diff_se=0.01)
    assert not goal_met("metaworld", 40, before=0.3, after=0.6, diff=0.09, diff_se=0.01)
    assert not goal_met("metaworld", 60, before=0.3, after=0.6, diff=0.2, diff_se=0.01)


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


TINY = ["--task", "4", "--num_demos", "10", "--train_states", "20", "--val_start", "20", "--val_states", "4",
        "--eval_start", "30", "--eval_states", "4", "--sft_steps", "2", "--check_every", "1", "--patience", "1",
        "--smooth", "1", "--no-require_convergence", "--plateau_band", "--minutes", "0.03", "--num_groups", "1",
        "--group_size", "2", "--warmup_steps", "2"]


def _record_evaluated_states(bench, tmp_path, monkeypatch) -> list[tuple[int, int]]:
    """Cache the bench's starts under ``tmp_path``; the returned list collects every state the bench evaluates."""
    monkeypatch.setenv("PI0_CACHE", str(tmp_path / "cache"))
    seen: list[tuple[int, int]] = []
    real = bench.evaluate_episodes

    def spy(runner, policy, states, *args, **kwargs):
        seen.extend(states)
        return real(runner, policy, states, *args, **kwargs)

    monkeypatch.setattr(bench, "evaluate_episodes", spy)
    return seen


def test_tune_stage_scores_every_arm_on_validation_states_only(tmp_path, monkeypatch):
    """The split test: in the tune stage every arm (its grid point's settings applied) is scored on validation
    states, and no held-out state reaches any evaluation."""
    import numpy as np
    import rl_improvement as bench
    from pi0.utils.cli import parse_config

    seen = _record_evaluated_states(bench, tmp_path, monkeypatch)
    argv = TINY + ["--stage", "tune", "--out", str(tmp_path / "tune"), "--tune_rl", "lr=1e-4", "lr=3e-5",
                   "--tune_sft", "sft_arm_lr=1e-4", "sft_arm_lr=3e-4,sft_schedule=cosine",
                   "--tune_rft", "rft_lr=1e-4", "rft_steps_per_iteration=2", "--point", "1", "--tune_states", "6"]
    for arm in bench.ARMS:
        bench.run_arm(parse_config(bench.Config, argv + ["--arm", arm]))
    # the start's plateau checks use validation states 20-23; --tune_states 6 scores every arm on 20-25, short of
    # the held-out states 30-33
    assert seen and set(seen) == {(4, i) for i in range(20, 26)}
    with pytest.raises(SystemExit, match=r"max\(val_states, tune_states\) \(31\) <= eval_start \(30\)"):
        bench.splits(parse_config(bench.Config, argv[:-1] + ["11"]))
    recs = {arm: json.loads((tmp_path / "tune" / "p1" / arm / "arm.json").read_text()) for arm in bench.ARMS}
    assert recs["rl"]["settings"]["lr"] == 3e-5 and recs["sft"]["settings"]["sft_schedule"] == "cosine"
    assert recs["rft"]["settings"]["rft_steps_per_iteration"] == 2 and recs["rft"]["settings"]["rft_lr"] == 1e-3
    for rec in recs.values():
        assert rec["stage"] == "tune" and len(rec["curve"]) == 1 and rec["curve"][0]["states"] == 6
        assert np.mean(rec["curve"][-1]["outcomes"]["None"]) == rec["curve"][-1]["None"]


def test_start_stage_builds_the_start_and_nothing_else(tmp_path, monkeypatch):
    """``--stage start`` trains (or loads) the cached start (its checks on validation states) and evaluates nothing
    else: no held-out "before", no arm."""
    import rl_improvement as bench

    seen = _record_evaluated_states(bench, tmp_path, monkeypatch)

    def no_arms(*args, **kwargs):
        raise AssertionError("the start stage launched the arms")

    monkeypatch.setattr(bench, "run_arms", no_arms)
    rec = bench.main(TINY + ["--stage", "start", "--out", str(tmp_path / "start")])
    assert [c["steps"] for c in rec["curve"]] == [1, 2]  # --sft_steps 2, a check every step
    assert seen == []  # no "before" evaluation: no held-out state is built into anything
    assert list((tmp_path / "cache" / "ript_warm_start").iterdir())  # cached for the report that follows


def test_core_each_schedule_pins_every_arm_to_a_core_no_other_arm_uses_meanwhile(tmp_path, monkeypatch):
    """``--arm_schedule core_each``: a real report, its arms in real processes. Each arm trains pinned to one core,
    and two arms whose training overlapped in time held different cores (on 2 cores: RL and SFT at once, RFT after
    one of them); side by side, every arm holds every core."""
    import rl_improvement as bench

    monkeypatch.setenv("PI0_CACHE", str(tmp_path / "cache"))
    cores = sorted(os.sched_getaffinity(0))
    out = tmp_path / "report"
    bench.main(TINY + ["--arm_schedule", "core_each", "--out", str(out), "--snapshots", "1"])
    arms = {arm: json.loads((out / arm / "arm.json").read_text()) for arm in bench.ARMS}
    for arm, rec in arms.items():
        assert len(rec["cores"]) == 1 and rec["cores"][0] in cores, (arm, rec["cores"])
    for a, b in itertools.combinations(bench.ARMS, 2):
        (a0, a1), (b0, b1) = arms[a]["trained_between"], arms[b]["trained_between"]
        if a0 < b1 and b0 < a1:  # trained at the same time
            assert arms[a]["cores"] != arms[b]["cores"], (a, b)
    if len(cores) == 2:  # RFT waits for the first core RL or SFT gives back
        assert arms["rl"]["cores"] != arms["sft"]["cores"]
        assert arms["rft"]["trained_between"][0] >= min(arms["rl"]["trained_between"][1],
                                                         arms["sft"]["trained_between"][1])
    rep = json.loads((out / "rl_improvement.json").read_text())
    assert rep["config"]["arm_schedule"] == "core_each"
    with pytest.raises(SystemExit, match="--arm_schedule must be one of"):
        bench.splits(bench.parse_config(bench.Config, TINY + ["--arm_schedule", "one_at_a_time"]))


def test_select_stage_picks_each_snapshot_on_validation_states_only(tmp_path, monkeypatch):
    """Checkpoint selection: every snapshot of every arm is scored on validation states only, each arm keeps its
    best (ties: the earliest), and only that one meets the held-out states (the final one's report outcomes reused)."""
    from dataclasses import asdict

    import numpy as np
    import torch

    import rl_improvement as bench
    from pi0.utils.cli import parse_config

    monkeypatch.setenv("PI0_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "report"
    cfg = parse_config(bench.Config, TINY + ["--out", str(out)])
    policy, _, _, _ = bench.start(cfg)
    final = [1, 0, 1, 1]  # what the report stored for each arm's final snapshot
    arms = {}
    for arm in bench.ARMS:
        for j in range(2):
            with torch.no_grad():
                for p in policy.model.parameters():
                    p.add_(0.01 * torch.randn_like(p))
            policy.save_pretrained(out / arm / f"snap{j:02d}")
        arms[arm] = {"curve": [{"minutes": 0.1, "None": 0.0, "states": 4},
                               {"minutes": 0.2, "None": 0.75, "states": 4, "outcomes": {"None": final}}]}
    out.joinpath("rl_improvement.json").write_text(json.dumps({"config": asdict(cfg), "before": 0.0, "arms": arms}))
    calls: list[list[tuple[int, int]]] = []
    scores = iter([0.5, 0.25, 0.0, 0.0, 0.25, 0.75])  # rl: snapshot 0; sft: a tie, the earliest; rft: snapshot 1
    real = bench.evaluate_episodes

    def spy(runner, pol, states, *args, **kwargs):
        calls.append(list(states))
        got = real(runner, pol, states, *args, **kwargs)
        if set(states) <= {(4, i) for i in range(20, 24)}:  # a validation score: the one this test dictates
            return (np.arange(4) < 4 * next(scores)).astype(float)
        return got

    monkeypatch.setattr(bench, "evaluate_episodes", spy)
    rec = bench.main(["--stage", "select", "--out", str(out)])
    val, held = [(4, i) for i in range(20, 24)], [(4, i) for i in range(30, 34)]
    assert calls == [val, val, held, val, val, held, val, val]  # rl and sft chose an earlier snapshot, rft the final
    assert [rec["arms"][a]["chosen"] for a in bench.ARMS] == [0, 0, 1]
    assert rec["arms"]["rft"]["outcomes"] == final and rec["arms"]["rft"]["held_out"] == 0.75
    assert json.loads((out / "selected.json").read_text())["arms"]["rl"]["val_success"] == [0.5, 0.25]


def test_tuned_settings_are_checked_before_any_work(tmp_path):
    """One-line errors: a grid entry naming another arm's setting, grids of unequal effort, a tune.json chosen on
    states that overlap the held-out states; a valid one is applied to its own arm only."""
    import rl_improvement as bench
    from pi0.utils.cli import parse_config

    def cfg(*extra):
        return parse_config(bench.Config, TINY + list(extra))

    with pytest.raises(SystemExit, match="not key=value with a key of the sft arm"):
        bench.splits(cfg("--tune_sft", "lr=1e-4", "--tune_rl", "lr=1e-4", "--tune_rft", "rft_lr=1e-4"))
    with pytest.raises(SystemExit, match="same number"):
        bench.splits(cfg("--tune_rl", "lr=1e-4"))
    with pytest.raises(SystemExit, match="is not a float"):
        bench.parse_entry("lr=fast", "rl")
    with pytest.raises(SystemExit, match="sde_step must be -1 .drawn., -2 .every step. or a denoising step 0..4"):
        bench.parse_entry("sde_step=9", "rl")  # the bench's policy takes 5 Euler steps
    with pytest.raises(SystemExit, match="sde_step must be -1"):
        bench.parse_entry("sde_step=-3", "rl")
    assert bench.parse_entry("sde_step=4", "rl") == {"sde_step": 4}
    assert bench.parse_entry("sde_step=-2", "rl") == {"sde_step": -2}  # the whole chain (flow_sde.EVERY_STEP)
    # a boolean setting parses true / false (Python's bool("false") would be True)
    assert bench.parse_entry("episode_mean=true", "rl") == {"episode_mean": True}
    assert bench.parse_entry("episode_mean=false", "rl") == {"episode_mean": False}
    assert bench.parse_entry("lr=1e-4,demo_coef=1", "rl") == {"lr": 1e-4, "demo_coef": 1.0}
    with pytest.raises(SystemExit, match="demo_coef must be >= 0"):
        bench.parse_entry("demo_coef=-1", "rl")
    with pytest.raises(SystemExit, match="--demo_coef must be >= 0"):
        bench.splits(cfg("--demo_coef", "-0.5"))
    with pytest.raises(SystemExit, match="'yes' is not a bool"):
        bench.parse_entry("episode_mean=yes", "rl")
    with pytest.raises(SystemExit, match="cps cannot make every step stochastic"):
        bench.splits(cfg("--sde_step", "-2", "--sde_kind", "cps", "--noise_level", "0.5"))
    assert bench.parse_entry("trainable=expert,lr=3e-5", "rl") == {"trainable": "expert", "lr": 3e-5}
    with pytest.raises(SystemExit, match="trainable must be one of"):
        bench.parse_entry("trainable=vlm", "rl")
    with pytest.raises(SystemExit, match="--sde_step must be"):
        bench.splits(cfg("--sde_step", "5"))
    with pytest.raises(SystemExit, match="sde kind must be one of"):
        bench.splits(cfg("--sde_kind", "ddim"))
    with pytest.raises(SystemExit, match="--tune_rl entry 'sde_kind=cps,sde_step=4': cps cannot make the last"):
        bench.splits(cfg("--tune_rl", "sde_kind=cps,sde_step=4", "--tune_sft", "sft_arm_lr=1e-4",
                         "--tune_rft", "rft_lr=1e-4"))
    assert bench.rl_config(cfg("--sde_kind", "cps", "--noise_level", "0.5")).sde_kind == "cps"
    tuned = tmp_path / "tune.json"
    rec = {"env": "arena", "task": [4], "val_range": [28, 32],
           "best": {"rl": "lr=3e-5", "sft": "sft_arm_lr=3e-4,sft_schedule=cosine", "rft": "rft_lr=1e-4"}}
    tuned.write_text(json.dumps(rec))
    with pytest.raises(SystemExit, match="overlap this run's held-out states 30..33"):
        bench.splits(cfg("--tuned", str(tuned)))
    with pytest.raises(SystemExit, match="no such file"):
        bench.splits(cfg("--tuned", str(tmp_path / "none.json")))
    rec["val_range"] = [20, 24]
    tuned.write_text(json.dumps(rec))
    c = cfg("--tuned", str(tuned))
    assert bench.arm_config(c, "rl").lr == 3e-5 and bench.arm_config(c, "rl").sft_arm_lr == c.sft_arm_lr
    assert bench.arm_config(c, "sft").sft_schedule == "cosine" and bench.arm_config(c, "sft").lr == c.lr


def _report(seed: int, rl: list[int], sft: list[int], tuned: bool = True) -> dict:
    """A report with the fields the table reads (per-episode outcomes given, their summaries computed)."""
    import numpy as np

    from pi0.evaluation.paired import paired_difference

    d = dict(zip(("mean", "se"), paired_difference(rl, sft)))
    return {"config": {"env": "arena", "task": [4], "seed": seed, "minutes": 20.0},
            "tuned": {"rl": "lr=1e-5"} if tuned else "",
            "start": {"demos": 200, "steps": 5500, "plateau": 0.39}, "before": 0.3, "after": float(np.mean(rl)),
            "sft": float(np.mean(sft)), "rft": 0.0, "paired": {"rl-sft": d}, "baseline": "sft",
            "rl_iterations": 400, "minutes": 20.0, "load_before": [2.0], "load_after": [3.0], "goal_met": False}


def test_rl_table_refuses_a_replayed_seed_and_untuned_runs(tmp_path):
    from rl_table import main as table_main

    paths = []
    for name, rep in (("a", _report(0, [1, 1, 0, 1], [1, 0, 0, 1])), ("b", _report(1, [1, 1, 1, 1], [0, 1, 1, 0])),
                      ("c", _report(0, [0, 1, 0, 1], [0, 0, 0, 1])), ("d", _report(2, [1, 0], [0, 0], tuned=False))):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(rep))
    with pytest.raises(SystemExit, match="c.json replays .*a.json .*seed 0"):
        table_main([str(p) for p in paths[:3]])
    with pytest.raises(SystemExit, match="not chosen on validation"):
        table_main([str(paths[0]), str(paths[3])])
    text = table_main([str(paths[0]), str(paths[1]), "--out", str(tmp_path / "t.md")])
    # seed 0: d = 0 1 0 0 -> +0.250 ± 0.250; seed 1: d = 1 0 0 1 -> +0.500 ± 0.289; across runs 0.375 ± 0.125
    assert "+0.250 ± 0.250 (SFT)" in text and "+0.500 ± 0.289 (SFT)" in text
    assert "2 independent runs: mean RL − best baseline +0.375 ± 0.125" in text
    assert "1 independent run: RL − best baseline +0.250" in table_main([str(paths[0])])
    assert (tmp_path / "t.md").read_text().strip() == text.strip()
    # a checkpoint selection beside a report adds its column and its own mean across runs
    sel = {"arms": {"rl": {"held_out": 0.75}, "sft": {"held_out": 0.5}, "rft": {"held_out": 0.25}},
           "paired": {"rl-sft": {"mean": 0.25, "se": 0.125}}, "baseline": "sft"}
    (tmp_path / "a_selected.json").write_text(json.dumps(sel))
    text = table_main([str(paths[0]), str(paths[1])])
    assert "| 0.750, 0.500, 0.250, +0.250 ± 0.125 (SFT) |" in text and text.count("| - |") == 1
    assert "1 independent run: RL − best baseline of the policies selected on validation +0.250" in text
    # runs of another task get their own mean: seed 0 of task 1 is not a replay of seed 0 of task 4
    other = _report(0, [0, 0, 1, 1], [1, 0, 1, 1])
    other["config"]["task"] = [1]
    (tmp_path / "e.json").write_text(json.dumps(other))
    text = table_main([str(paths[0]), str(paths[1]), str(tmp_path / "e.json")])
    assert "arena task 4: 2 independent runs: mean RL − best baseline +0.375 ± 0.125" in text
    assert "arena task 1: 1 independent run: RL − best baseline -0.250" in text
    # a table is one machine's runs: two recorded CPU models are refused, a report without one (older) is not
    for name, seed, cpu in (("h", 5, "CPU A"), ("i", 6, "CPU B"), ("j", 7, "CPU A")):
        rep = _report(seed, [1, 0], [0, 0])
        rep["machine"] = {"cpu": cpu, "cores": 2}
        (tmp_path / f"{name}.json").write_text(json.dumps(rep))
    with pytest.raises(SystemExit, match="i.json ran on 'CPU B' and .*h.json on 'CPU A'"):
        table_main([str(tmp_path / n) for n in ("h.json", "i.json")])
    assert table_main([str(tmp_path / n) for n in ("h.json", "j.json", "a.json")]).count("| arena") == 3
    # the goal column judges each report by its env's goal at its budget: seed 1 (RL 1.0, +0.5 ± 0.289) is under 3 SE
    strong = _report(3, [1] * 40, [0] * 40)  # RL 1.0, +1.000 ± 0.000: met in 20 minutes per arm, not in 60
    (tmp_path / "f.json").write_text(json.dumps(strong))
    strong["config"].update(seed=4, minutes=60.0)
    (tmp_path / "g.json").write_text(json.dumps(strong))
    rows = [r for r in table_main([str(tmp_path / "f.json"), str(tmp_path / "g.json")]).splitlines()
            if r.startswith("| arena")]
    assert [r.rsplit("|", 2)[1].strip() for r in rows] == ["yes", "no"]
    # the minutes say how the arms shared the machine: side by side unless each had a core of its own
    strong["config"].update(seed=5, minutes=20.0, arm_schedule="core_each")
    (tmp_path / "h.json").write_text(json.dumps(strong))
    rows = [r for r in table_main([str(tmp_path / "f.json"), str(tmp_path / "h.json")]).splitlines()
            if r.startswith("| arena")]
    assert ["(core each)" in r for r in rows] == [False, True]


def test_rl_table_splits_a_multi_task_report_by_task(tmp_path):
    """Held-out success per task, from the per-episode outcomes listed task by task (hand-checked)."""
    from rl_table import main as table_main, report_per_task

    rep = _report(0, [1, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1])
    rep["config"].update(env="metaworld", task=[1, 5], eval_states=3)
    rep["before_outcomes"] = [0, 0, 1, 1, 1, 1]
    rep["arms"] = {"rl": {"curve": [{"outcomes": {"None": [1, 0, 0, 0, 1, 1]}}]},
                   "sft": {"curve": [{"outcomes": {"None": [0, 0, 0, 1, 1, 1]}}]},
                   "rft": {"curve": [{"outcomes": {"None": [1, 1, 0, 1, 1, 0]}}]}}
    got = report_per_task(rep)
    assert list(got) == [1, 5]
    assert got[1] == pytest.approx({"before": 1 / 3, "rl": 1 / 3, "sft": 0.0, "rft": 2 / 3})
    assert got[5] == pytest.approx({"before": 1.0, "rl": 2 / 3, "sft": 1.0, "rft": 2 / 3})
    (tmp_path / "mw.json").write_text(json.dumps(rep))
    text = table_main([str(tmp_path / "mw.json")])
    assert "| metaworld | 1,5 | 0 | 5 | 1.000 | 0.667 | 1.000 | 0.667 |" in text
    rep["config"]["eval_states"] = 2  # outcomes that do not split into tasks x eval_states: refused
    with pytest.raises(SystemExit, match="error: before has 6 outcomes, not 2 tasks x 2"):
        report_per_task(rep)
    one = tmp_path / "one.json"  # a one-task report: no per-task table
    one.write_text(json.dumps(_report(3, [1, 0], [0, 0])))
    assert "per task" not in table_main([str(one)])


def test_sde_gap_scores_each_policy_deterministically_paired_and_under_flow_sde(tmp_path):
    """bench/sde_gap.py: the deterministic rows are the bench's own evaluation (same keyed noise, so paired across
    policies), each Flow-SDE row has one outcome per state and repeat, and bad input stops in one line."""
    import sde_gap
    from pi0.modeling_pi0 import PI0Policy
    from pi0.ript.warm_start import (TinyArenaConfig, arena_expert_demos, demo_norm_stats, env_runner,
                                     evaluate_episodes, tiny_arena_policy)

    cfg = TinyArenaConfig()
    stats = demo_norm_stats(arena_expert_demos([(4, 0), (4, 1)], cfg.action_horizon, cfg.n_action_steps))
    dirs = []
    for seed in (0, 1):
        d = tmp_path / f"p{seed}"
        tiny_arena_policy(TinyArenaConfig(seed=seed), stats).save_pretrained(d)
        dirs.append(d)
    argv = ["--env", "arena", "--task", "4", "--states", "0", "3", "--repeats", "2", "--num_envs", "4",
            "--policy", f"a={dirs[0]}", f"b={dirs[1]}", "--sde", "1.0:0", "0.5:4", "0.5:0:cps", "--json_out",
            str(tmp_path / "gap.json")]
    rec = sde_gap.main(argv)
    assert list(rec["outcomes"]) == ["det", "sde 1.0:0", "sde 0.5:4", "cps 0.5:0"]
    assert all(len(o) == 6 for per in rec["outcomes"].values() for o in per.values())
    with env_runner("arena", 4, cfg.n_action_steps, num_init_states=3) as runner:
        want = evaluate_episodes(runner, PI0Policy.from_pretrained(dirs[1]), [(4, 0), (4, 1), (4, 2)], 2, seed=100)
    assert rec["outcomes"]["det"]["b"] == want.astype(int).tolist()
    diff = rec["rates"]["det"]["b"]["success"] - rec["rates"]["det"]["a"]["success"]
    assert rec["det_paired"]["b-a"]["mean"] == pytest.approx(diff)
    base = ["--env", "arena", "--task", "4", "--states", "0", "3"]
    with pytest.raises(SystemExit, match="NOISE_LEVEL:STEP"):
        sde_gap.main(base + ["--policy", f"a={dirs[0]}", "--sde", "1.0"])
    with pytest.raises(SystemExit, match="noise level must be in"):
        sde_gap.main(base + ["--policy", f"a={dirs[0]}", "--sde", "1.5:0:cps"])
    with pytest.raises(SystemExit, match="cps 1.0:4: cps cannot make the last denoising step"):
        sde_gap.main(base + ["--policy", f"a={dirs[0]}", "--sde", "1.0:4:cps"])
    with pytest.raises(SystemExit, match="no model.safetensors"):
        sde_gap.main(base + ["--policy", f"a={tmp_path}"])


def test_cpu_model_reads_the_model_name_and_falls_back(tmp_path):
    from pi0.utils.machine import cpu_model, machine

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Processor\n\n"
                    "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Processor\n")
    assert cpu_model(info) == "Intel(R) Xeon(R) Processor"
    assert cpu_model(tmp_path / "missing") not in ("", "Intel(R) Xeon(R) Processor")  # platform's answer instead
    m = machine()
    assert set(m) == {"cpu", "cores"} and m["cpu"] and m["cores"] >= 1
