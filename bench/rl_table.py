r"""The table of RL bench runs (``bench/rl_improvement.py`` reports): one row per independent run, replays refused.

A run is a seed: two reports of the same env, task(s) and seed are the same run replayed (the bench is
deterministic up to where its wall-clock ends), so the table refuses them instead of counting them twice. It also
refuses a report whose settings were not chosen on validation states (no ``--tuned``), unless ``--allow_untuned``.
Each row gives RL − the stronger baseline with the standard error of the paired difference (same held-out states,
same per-episode noise); the last lines give the mean over runs with the standard error across runs, per env and
task (runs of different tasks are not averaged together). Where the report's checkpoint selection on validation
states (``--stage select``) lies beside it (``selected.json`` in the report's folder, or ``<stem>_selected.json``
beside ``<stem>.json``), the row also gives the selected policies' RL − best baseline, and the last lines its mean.
Reports of several tasks get a second table: held-out success per task (before, RL, SFT, RFT), from the per-episode
outcomes (the held-out states are listed task by task, ``eval_states`` each), so a task solved from the start, or one
no arm moves, shows instead of hiding in the mean.

    .venv/bin/python bench/rl_table.py runs/bench_rl/seed*/rl_improvement.json --out bench/results/rl_table.md
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pi0, not an installed one
from pi0.evaluation.paired import per_task  # noqa: E402


# issue 39's goals, each at its own budget per arm: the arena's RL >= 0.8 and >= the stronger baseline + 0.15 (3 paired
# SE above 0) in 20 minutes; MetaWorld's RL >= its start + 0.2 and >= the stronger baseline + 0.1 in 40 minutes
GOAL_MINUTES = {"arena": 20.0, "metaworld": 40.0}


def goal_met(env: str, minutes: float, before: float, after: float, diff: float, diff_se: float) -> bool:
    """Whether a report meets its env's goal; a run with more minutes per arm than the goal allows never does."""
    if minutes > GOAL_MINUTES[env]:
        return False
    if env == "metaworld":
        return after >= before + 0.2 and diff >= 0.1
    return after >= 0.8 and diff >= 0.15 and diff >= 3 * diff_se


def run_id(rep: dict) -> tuple:
    """What makes a run independent: (env, task ids, seed)."""
    c = rep["config"]
    return c["env"], tuple(c["task"]), c["seed"]


def check_runs(reports: dict[str, dict], allow_untuned: bool = False) -> None:
    """One-line errors for a replayed seed, an untuned run, a report without paired outcomes, or runs of two CPU
    models (``machine``, where recorded)."""
    seen: dict[tuple, str] = {}
    # a report's minutes are its machine's: one table, one machine (older reports record none)
    first: tuple[str, str] | None = None  # (CPU model, path) of the first report that recorded its machine
    for path, rep in reports.items():
        cpu = rep.get("machine", {}).get("cpu")
        if cpu and first and cpu != first[0]:
            raise SystemExit(f"error: {path} ran on {cpu!r} and {first[1]} on {first[0]!r}: the goal's minutes are "
                             f"one machine's, so a table holds one machine's runs")
        if cpu and first is None:
            first = (cpu, path)
        if "paired" not in rep:
            raise SystemExit(f"error: {path}: no paired outcomes (a report of an older bench); rerun it")
        if not rep.get("tuned") and not allow_untuned:
            raise SystemExit(f"error: {path}: its settings were not chosen on validation states (run with --tuned "
                             f"<tune.json>, or pass --allow_untuned)")
        rid = run_id(rep)
        if rid in seen:
            raise SystemExit(f"error: {path} replays {seen[rid]} (env {rid[0]}, task {list(rid[1])}, seed {rid[2]}): "
                             f"a replay of a seed is not a second run")
        seen[rid] = path


def selected_beside(path: str | Path) -> dict | None:
    """The ``--stage select`` record beside a report, if any."""
    path = Path(path)
    cand = (path.parent / "selected.json" if path.name == "rl_improvement.json"
            else path.with_name(f"{path.stem}_selected.json"))
    return json.loads(cand.read_text()) if cand.is_file() else None


def across(diffs: list[float], what: str) -> str:
    """The mean of per-run differences ± its SE across runs, in words."""
    n, mean = len(diffs), sum(diffs) / len(diffs)
    if n == 1:
        return f"1 independent run: {what} {mean:+.3f} (no spread across runs from one run)"
    spread = math.sqrt(sum((x - mean) ** 2 for x in diffs) / (n - 1) / n)
    return f"{n} independent runs: mean {what} {mean:+.3f} ± {spread:.3f} (SE across runs)"


def report_per_task(rep: dict) -> dict[int, dict[str, float]]:
    """Held-out success per task of one report: {task id: {"before", "rl", "sft", "rft"}} (the final snapshots)."""
    c = rep["config"]
    key = str(c["cfg_guidance"]) if c.get("objective") == "cfg" else "None"
    outcomes = {"before": rep["before_outcomes"],
                **{a: arm["curve"][-1]["outcomes"][key if a == "rl" else "None"] for a, arm in rep["arms"].items()}}
    try:
        return per_task(c["task"], c["eval_states"], outcomes)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def task_table(reports: dict[str, dict]) -> str:
    """Markdown: held-out success per task of every report with several tasks ("" if none)."""
    multi = sorted((rep for rep in reports.values() if len(rep["config"]["task"]) > 1), key=run_id)
    if not multi:
        return ""
    rows = ["| env | tasks | seed | task | before | RL | SFT | RFT |", "|---|---|---|---|---|---|---|---|"]
    for rep in multi:
        c = rep["config"]
        for t, r in report_per_task(rep).items():
            rows.append(f"| {c['env']} | {','.join(map(str, c['task']))} | {c['seed']} | {t} | {r['before']:.3f} | "
                        f"{r['rl']:.3f} | {r['sft']:.3f} | {r['rft']:.3f} |")
    return "\n".join(rows)


def table(reports: dict[str, dict], selected: dict[str, dict | None] | None = None) -> str:
    """Markdown: one row per run, then the mean paired difference over runs ± its SE across runs."""
    selected = selected or {}
    head = ("| env | task | seed | start N | start steps | plateau (val) | before | RL | SFT | RFT | RL − best baseline "
            "(paired ± SE) | selected on validation: RL, SFT, RFT, RL − best | RL iterations | minutes | "
            "load before → after | goal met |")
    rows = [head, "|" + "---|" * head.count(" | ") + "---|"]
    diffs: dict[tuple, list[float]] = {}  # per (env, task ids): runs of different tasks are not averaged together
    sel_diffs: dict[tuple, list[float]] = {}
    for path, rep in sorted(reports.items(), key=lambda kv: run_id(kv[1])):
        c, st, d = rep["config"], rep["start"], rep["paired"][f"rl-{rep['baseline']}"]
        group = run_id(rep)[:2]
        diffs.setdefault(group, []).append(d["mean"])
        sel = selected.get(path)
        if sel:
            a, sd = sel["arms"], sel["paired"][f"rl-{sel['baseline']}"]
            sel_diffs.setdefault(group, []).append(sd["mean"])
            sel_cell = (f"{a['rl']['held_out']:.3f}, {a['sft']['held_out']:.3f}, {a['rft']['held_out']:.3f}, "
                        f"{sd['mean']:+.3f} ± {sd['se']:.3f} ({sel['baseline'].upper()})")
        else:
            sel_cell = "-"
        met = goal_met(c["env"], c["minutes"], rep["before"], rep["after"], d["mean"], d["se"])  # not the stored flag
        shared = " (core each)" if c.get("arm_schedule") == "core_each" else ""  # else side by side
        rows.append(f"| {c['env']} | {','.join(map(str, c['task']))} | {c['seed']} | {st['demos']} | {st['steps']} | "
                    f"{st['plateau']:.3f} | {rep['before']:.3f} | {rep['after']:.3f} | {rep['sft']:.3f} | "
                    f"{rep['rft']:.3f} | {d['mean']:+.3f} ± {d['se']:.3f} ({rep['baseline'].upper()}) | "
                    f"{sel_cell} | {rep['rl_iterations']} | {rep['minutes']:.1f}{shared} | "
                    f"{rep['load_before'][0]:.1f} → {rep['load_after'][0]:.1f} | {'yes' if met else 'no'} |")
    rows.append("")
    for group, ds in diffs.items():
        where = f"{group[0]} task {','.join(map(str, group[1]))}: " if len(diffs) > 1 else ""
        rows.append(where + across(ds, "RL − best baseline"))
        if group in sel_diffs:
            rows.append(where + across(sel_diffs[group], "RL − best baseline of the policies selected on validation"))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> str:
    """Load, check and print the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", help="rl_improvement.json reports")
    p.add_argument("--allow_untuned", action="store_true", help="count reports run without --tuned")
    p.add_argument("--out", default="", help="also write the markdown table here")
    args = p.parse_args(argv)
    reports = {}
    for path in args.reports:
        if not Path(path).is_file():
            raise SystemExit(f"error: {path}: no such report")
        reports[path] = json.loads(Path(path).read_text())
    check_runs(reports, args.allow_untuned)
    text = table(reports, {path: selected_beside(path) for path in reports})
    tasks = task_table(reports)
    if tasks:
        text += "\n\nHeld-out success per task:\n\n" + tasks
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()
