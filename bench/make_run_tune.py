r"""Both arms of ``make run`` tuned alike, on validation states only: RL's and continued SFT's settings for the start
the preset trains.

Grid point j is one stage-11 job (``11_train_ript_vla_style.py``: the preset's cached start, then RL and continued
SFT side by side for the same wall-clock) run with RL entry j and SFT entry j, so every arm gets the same number of
points and the same budget. The job scores both arms on *tuning* init states: a range after the preset's held-out
states (by default the next 300), disjoint from its training states, the start's validation states and the held-out
states, which no tuning job builds. Each arm's choice is its entry with the best final success on those states (ties:
the earlier entry). The JSON keeps every point's curve, the paired difference to the start, and each job's log.

    .venv/bin/python bench/make_run_tune.py                                   # the default grid (about 45 min on Intel)
    .venv/bin/python bench/make_run_tune.py --rl algo.opt.lr=1e-5 algo.opt.lr=1e-4 \
        --sft baseline.sft_lr=1e-4 baseline.sft_lr=1e-3 -- task.warm_start_seed=1 algo.seed=1

An entry is comma-separated ``key=value`` overrides of the preset: RL entries set ``algo.*`` (not its seed, budget or
scoring), ``lr_schedule`` or ``warmup_iterations``; SFT entries set ``baseline.*`` (not ``baseline.sft``). The last
line is ``best rl=<entry> sft=<entry>``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's pi0, not an installed one

from pi0.errors import UserError  # noqa: E402
from pi0.evaluation.paired import rate_se  # noqa: E402
from pi0.ript.config.schema import TrainConfig, load_config  # noqa: E402

STAGE = REPO / "11_train_ript_vla_style.py"
# the thirty-seventh session's grid (bench/results/make_run/session37_tune200_s0.json); each entry names its schedule,
# so that it does not inherit the preset's
RL_GRID = ["algo.opt.lr=3e-5,lr_schedule=constant", "algo.opt.lr=1e-4,lr_schedule=constant",
           "algo.opt.lr=1e-5,lr_schedule=constant", "algo.opt.lr=1e-4,lr_schedule=cosine"]
SFT_GRID = ["baseline.sft_lr=1e-3,baseline.sft_schedule=constant",
            "baseline.sft_lr=3e-4,baseline.sft_schedule=constant",
            "baseline.sft_lr=1e-4,baseline.sft_schedule=constant",
            "baseline.sft_lr=3e-4,baseline.sft_schedule=cosine"]
FIXED = ("algo.seed", "algo.iterations", "algo.eval_every", "algo.eval_repeats", "baseline.sft")  # not tunable


def entry_overrides(arm: str, entry: str) -> list[str]:
    """``"k=v,k2=v2"`` -> ``["k=v", "k2=v2"]``, each key one the arm may set (SystemExit naming the entry)."""
    out = [kv.strip() for kv in entry.split(",") if kv.strip()]
    for kv in out:
        key = kv.split("=", 1)[0]
        if "=" not in kv:
            raise SystemExit(f"error: --{arm} entry {entry!r}: {kv!r} is not key=value")
        ok = (key.startswith("algo.") or key in ("lr_schedule", "warmup_iterations")) if arm == "rl" \
            else key.startswith("baseline.")
        if not ok or key in FIXED:
            allowed = ("algo.* (not its seed, iterations or evaluation), lr_schedule, warmup_iterations"
                       if arm == "rl" else "baseline.* (not baseline.sft)")
            raise SystemExit(f"error: --{arm} entry {entry!r}: {key} is not the {arm} arm's to tune; "
                             f"allowed: {allowed}")
    if not out:
        raise SystemExit(f"error: --{arm} entry {entry!r} sets nothing")
    return out


def tuning_range(cfg: TrainConfig, start: int | None, n: int) -> tuple[int, int]:
    """The tuning states [a, b) of each task: after the held-out ones unless ``start`` is given; SystemExit if they
    would touch the training, start-validation or held-out states."""
    t = cfg.task
    seen = t.train_states + (t.warm_start_val_states if t.warm_start_patience > 0 else 0)
    held = (t.eval_start, t.eval_start + t.eval_states)
    a = held[1] if start is None else start
    b = a + n
    if n < 1:
        raise SystemExit("error: --tune_states must be >= 1")
    if a < seen:
        raise SystemExit(f"error: tuning states {a}..{b - 1} overlap the training / start-validation states "
                         f"0..{seen - 1}; start them at {seen} or later")
    if a < held[1] and held[0] < b:
        raise SystemExit(f"error: tuning states {a}..{b - 1} overlap the held-out states {held[0]}..{held[1] - 1}")
    return a, b


def job_overrides(cfg: TrainConfig, rng: tuple[int, int], name: str) -> list[str]:
    """What makes a preset job a tuning job: scored on the tuning states, no videos, its own run directory."""
    return [f"task.eval_start={rng[0]}", f"task.eval_states={rng[1] - rng[0]}",
            f"env.num_init_states={max(cfg.env.num_init_states, rng[1])}", "features.save_video=false",
            f"logging.run_name={name}"]


def choose(points: list[dict]) -> int:
    """Index of the best final success (the first of equals)."""
    return int(np.argmax([p["val"] for p in points]))


def main(argv: list[str] | None = None) -> dict:
    """Run the grid, one job per point pair; write the JSON; print each arm's table and choice."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="stage11_ript_vla")
    ap.add_argument("--rl", nargs="+", default=RL_GRID, help="RL entries (k=v[,k=v])")
    ap.add_argument("--sft", nargs="+", default=SFT_GRID, help="continued-SFT entries, as many as --rl")
    ap.add_argument("--tune_start", type=int, default=None, help="first tuning state (default: after held-out)")
    ap.add_argument("--tune_states", type=int, default=300)
    ap.add_argument("--name", default="make_run_tune", help="run directories <out_dir>/<name>_p<j>")
    ap.add_argument("--json_out", default="", help="default <out_dir>/<name>.json")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the preset (the seed, for instance)")
    args = ap.parse_args(argv)
    if len(args.rl) != len(args.sft):
        raise SystemExit(f"error: {len(args.rl)} RL entries against {len(args.sft)} SFT entries: give each arm the "
                         "same number of points (equal tuning effort)")
    try:
        cfg = load_config(args.preset, list(args.overrides))
    except UserError as e:
        raise SystemExit(f"error: {e}")
    if not cfg.baseline.sft:
        raise SystemExit("error: the preset does not run continued SFT beside RL (baseline.sft=false)")
    rng = tuning_range(cfg, args.tune_start, args.tune_states)
    jobs = []
    for j, (rl, sft) in enumerate(zip(args.rl, args.sft)):  # every job's config is checked before any runs
        over = list(args.overrides) + entry_overrides("rl", rl) + entry_overrides("sft", sft) \
            + job_overrides(cfg, rng, f"{args.name}_p{j}")
        try:
            jc = load_config(args.preset, over)
        except UserError as e:
            raise SystemExit(f"error: grid point {j} ({rl} | {sft}): {e}")
        jobs.append({"rl": rl, "sft": sft, "overrides": over, "run_dir": str(jc.run_dir)})
    out = Path(args.json_out) if args.json_out else Path(cfg.logging.out_dir) / f"{args.name}.json"
    rec = {"preset": args.preset, "overrides": list(args.overrides), "tune_range": list(rng),
           "held_out_range": [cfg.task.eval_start, cfg.task.eval_start + cfg.task.eval_states], "jobs": jobs,
           "points": {"rl": [], "sft": []}, "load_before": os.getloadavg()[0]}
    for j, job in enumerate(jobs):
        print(f"[tune] point {j}: RL {job['rl']} | SFT {job['sft']}", flush=True)
        run = Path(job["run_dir"])
        run.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(run / "job.log", "w") as log:
            rc = subprocess.call([sys.executable, str(STAGE), "--config_path", args.preset, *job["overrides"]],
                                 stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd())
        if rc != 0:
            raise SystemExit(f"error: grid point {j} exited with code {rc}; see {run / 'job.log'}")
        s = json.loads((run / "summary.json").read_text())
        job["minutes"] = (time.perf_counter() - t0) / 60
        n = s["held_out_episodes"]
        for arm, entry in (("rl", job["rl"]), ("sft", job["sft"])):
            pt = {"entry": entry, "val": s[arm], "val_se": rate_se(s[arm], n), "episodes": n, "before": s["before"],
                  "minus_before": s.get(f"{arm}_minus_before"), "curve": s[f"{arm}_curve"],
                  "train_minutes": s["train_minutes"]}
            if arm == "rl":
                pt["iterations"] = s["rl_iterations"]
            else:
                pt["sft_steps"] = s["sft_steps"]
            rec["points"][arm].append(pt)
        print(f"[tune] point {j}: before {s['before']:.3f}, RL {s['rl']:.3f}, SFT {s['sft']:.3f} on {n} tuning "
              f"episodes, {job['minutes']:.1f} min", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rec, indent=1))  # after every point: a partial grid is not lost
    rec["best"] = {arm: rec["points"][arm][choose(rec["points"][arm])]["entry"] for arm in ("rl", "sft")}
    rec["load_after"] = os.getloadavg()[0]
    out.write_text(json.dumps(rec, indent=1))
    for arm in ("rl", "sft"):
        print(f"\n{arm}: final success on tuning states {rng[0]}..{rng[1] - 1}")
        for p in rec["points"][arm]:
            mark = " <- chosen" if p["entry"] == rec["best"][arm] else ""
            curve = " ".join(f"{c['eval_success_rate']:.2f}" for c in p["curve"])
            print(f"  {p['entry']:<50} {p['val']:.3f} +- {p['val_se']:.3f}  (curve {curve}){mark}")
    print(f"wrote {out}")
    print(f"best rl={rec['best']['rl']} sft={rec['best']['sft']}")
    return rec


if __name__ == "__main__":
    main()
