"""Does our simulator stack move LIBERO's objects as openpi's does? Compares interpreters (venvs) on identical inputs.

A probe (this file with ``--probe``, needing only numpy + LIBERO, never torch or pi0) runs under each interpreter
and records, for every init state of the requested tasks, object and end-effector positions at the first policy
decision (after openpi's 10 wait steps), and for a few init states per suite the positions after 50/150/300 steps of
an identical replayed action sequence plus LIBERO's success flags. The driver runs the probes (at most ``--workers``
subprocesses at a time), caches one JSON per (interpreter, suite, task), and compares every interpreter against the
reference one (openpi's stack).

Env creation and seeding follow openpi's examples/libero/main.py: ``OffScreenRenderEnv(bddl_file_name=...,
camera_heights=256, camera_widths=256)``, ``np.random.seed(7)`` + ``env.seed(7)``, reset, ``set_init_state``, 10 steps
of ``[0]*6 + [-1]``. Differences, all identical across interpreters: camera observations are off (rendering never
touches the physics, ~140 ms per camera per step), resets are soft (0.35 s instead of 3-13 s; robosuite's
``sim.reset`` gives fresh data, the gripper's smoothed command is zeroed as a fresh model has it), and the seed is
re-applied before every reset so each init state sees the same fixture poses in every interpreter.

    make openpi-venv && make sim-venv MUJOCO=3.17.0        # .venv-openpi (mujoco 3.2.3), .venv-mujoco-3.17.0
    MUJOCO_GL=egl nice -n 10 .venv/bin/python bench/sim_stack_divergence.py \\
        --ref openpi=.venv-openpi/bin/python --cmp ours=.venv/bin/python --cmp mujoco317=.venv-mujoco-3.17.0/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10")
NUM_WAIT_STEPS = 10  # as in openpi examples/libero/main.py
SEED = 7  # as in openpi examples/libero/main.py (Args.seed)
WAIT_ACTION = [0.0] * 6 + [-1.0]  # openpi's LIBERO_DUMMY_ACTION
REPLAY_CHECKPOINTS = (50, 150, 300)
TOL_M = 0.01


# ----------------------------------------------------------------------------------------------------- probe side
def replay_actions(num_steps: int, seed: int) -> np.ndarray:
    """(num_steps, 7) smooth pseudo-random actions in [-1, 1], gripper toggling; same on every numpy (legacy RNG)."""
    rng = np.random.RandomState(seed)
    walk = np.cumsum(rng.uniform(-0.3, 0.3, size=(num_steps, 6)), axis=0)
    arm = np.clip(np.sin(walk), -1.0, 1.0)
    gripper = np.where((np.arange(num_steps) // 40) % 2 == 0, -1.0, 1.0)[:, None]
    return np.concatenate([arm, gripper], axis=1)


def _positions(env) -> dict[str, list[float]]:
    inner = env.env
    out = {name: inner.sim.data.body_xpos[inner.obj_body_id[name]].tolist() for name in inner.objects_dict}
    out["_eef"] = np.asarray(inner.robots[0].controller.ee_pos).tolist()
    return out


def _fresh_episode(env, init_state: np.ndarray) -> None:
    np.random.seed(SEED)
    env.seed(SEED)
    env.reset()
    for robot in env.env.robots:  # a fresh (hard-reset) model starts the gripper's smoothed command at zero
        if getattr(robot, "gripper", None) is not None and hasattr(robot.gripper, "current_action"):
            robot.gripper.current_action = np.zeros(robot.gripper.dof)
    env.set_init_state(init_state)
    for _ in range(NUM_WAIT_STEPS):
        env.step(WAIT_ACTION)


def probe(suite_name: str, task_id: int, replay_init_ids: list[int], replay_steps: int) -> dict:
    """Positions at the first decision for every init state of one task, and replays; only numpy + LIBERO."""
    import mujoco
    from libero.libero import benchmark, get_libero_path
    from libero.libero.envs import OffScreenRenderEnv

    suite = benchmark.get_benchmark_dict()[suite_name]()
    task = suite.get_task(task_id)
    bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
    init_states = suite.get_task_init_states(task_id)
    env = OffScreenRenderEnv(bddl_file_name=bddl, camera_heights=256, camera_widths=256, use_camera_obs=False,
                             hard_reset=False)
    result = {"mujoco": mujoco.__version__, "numpy": np.__version__, "first_decision": [], "replay": {}}
    try:
        for init_id in range(len(init_states)):
            _fresh_episode(env, init_states[init_id])
            result["first_decision"].append(_positions(env))
        actions = replay_actions(replay_steps, seed=task_id)
        for init_id in replay_init_ids:
            _fresh_episode(env, init_states[init_id])
            snaps, success = {}, []
            for t, action in enumerate(actions, start=1):
                _, _, done, _ = env.step(action.tolist())
                success.append(bool(done or env.check_success()))
                if t in REPLAY_CHECKPOINTS:
                    snaps[str(t)] = _positions(env)
            result["replay"][str(init_id)] = {"positions": snaps, "success": success}
    finally:
        env.close()
    return result


# ---------------------------------------------------------------------------------------------------- driver side
def _max_object_distance(a: dict, b: dict) -> tuple[float, str]:
    """Largest object displacement (m) between two position dicts, and which object."""
    best = (0.0, "")
    for name in a:
        if name != "_eef":
            d = float(np.linalg.norm(np.subtract(a[name], b[name])))
            best = max(best, (d, name))
    return best


def _run_probe(python: str, suite: str, task_id: int, out: Path, args: argparse.Namespace) -> Path:
    if out.exists():
        return out
    cmd = [python, os.path.abspath(__file__), "--probe", "--suite", suite, "--task_id", str(task_id),
           "--replay_steps", str(args.replay_steps), "--probe_out", str(out)]
    if task_id in args.replay_tasks:
        cmd += ["--replay_init_ids", *map(str, args.replay_init_ids)]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "MUJOCO_GL":
                                                                    os.environ.get("MUJOCO_GL", "egl")})
    if proc.returncode != 0:
        raise RuntimeError(f"probe {python} {suite} task {task_id} failed:\n{proc.stderr[-3000:]}")
    print(f"  {python}: {suite} task {task_id} in {time.time() - t0:.0f} s", flush=True)
    return out


def _cm(d_m: float) -> str:
    """A distance in metres as centimetres; exact zeros say so (bit-identical positions)."""
    return "0" if d_m == 0 else f"{d_m * 100:.3g} cm"


def report(results: dict[str, dict[tuple[str, int], dict]], ref: str) -> str:
    """Markdown summary: per suite, init states with any object > 1 cm apart from the reference, worst case, replays."""
    lines = []
    for name, per_task in results.items():
        if name == ref:
            continue
        ref_res = results[ref]
        tasks = sorted(k for k in per_task if k in ref_res)
        info = per_task[tasks[0]] if tasks else {}
        lines.append(f"\n### {name} (mujoco {info.get('mujoco')}, numpy {info.get('numpy')}) vs {ref} "
                     f"(mujoco {ref_res[tasks[0]]['mujoco'] if tasks else '?'})\n")
        steps = " | ".join(f"{t} steps" for t in REPLAY_CHECKPOINTS)
        lines.append("| suite | tasks | init states | any object > 1 cm apart (per task) | worst object (task/init) "
                     "| worst eef |")
        lines.append("|---|---|---|---|---|---|")
        for suite in SUITES:
            keys = [k for k in tasks if k[0] == suite]
            n, bad, worst, worst_eef, bad_tasks = 0, 0, (0.0, "-"), 0.0, {}
            for key in keys:
                for i, (a, b) in enumerate(zip(per_task[key]["first_decision"], ref_res[key]["first_decision"])):
                    d, obj = _max_object_distance(a, b)
                    n += 1
                    bad += d > TOL_M
                    if d > TOL_M:
                        bad_tasks[key[1]] = bad_tasks.get(key[1], 0) + 1
                    if d > worst[0]:
                        worst = (d, f"{obj} ({key[1]}/{i})")
                    worst_eef = max(worst_eef, float(np.linalg.norm(np.subtract(a["_eef"], b["_eef"]))))
            if keys:
                where = ", ".join(f"t{t}: {c}" for t, c in sorted(bad_tasks.items())) or "-"
                lines.append(f"| {suite} | {len(keys)} | {n} | {bad} ({where}) | {_cm(worst[0])} {worst[1]} | "
                             f"{_cm(worst_eef)} |")
        lines.append("\nReplays per suite (max over replayed init states; object / eef distance after N steps):\n")
        lines.append(f"| suite | replays | {steps} | success flags differ |")
        lines.append("|---|---|" + "---|" * (len(REPLAY_CHECKPOINTS) + 1))
        for suite in SUITES:
            pairs = [(rep, ref_res[key]["replay"][i]) for key in tasks if key[0] == suite
                     for i, rep in per_task[key]["replay"].items() if i in ref_res[key]["replay"]]
            if not pairs:
                continue
            cells = []
            for t in map(str, REPLAY_CHECKPOINTS):
                d = max(_max_object_distance(a["positions"][t], b["positions"][t])[0] for a, b in pairs)
                e = max(float(np.linalg.norm(np.subtract(a["positions"][t]["_eef"], b["positions"][t]["_eef"])))
                        for a, b in pairs)
                cells.append(f"{_cm(d)} / {_cm(e)}")
            differ = sum(a["success"] != b["success"] for a, b in pairs)
            lines.append(f"| {suite} | {len(pairs)} | " + " | ".join(cells) + f" | {differ} of {len(pairs)} |")
        lines.append("\nReplayed identical actions (max object distance / eef distance after N steps, "
                     "0 = bit-identical; any success):\n")
        lines.append(f"| suite/task/init | {steps} | success differs |")
        lines.append("|---|" + "---|" * (len(REPLAY_CHECKPOINTS) + 1))
        for key in tasks:
            for init_id, rep in sorted(per_task[key]["replay"].items()):
                other = ref_res[key]["replay"].get(init_id)
                if other is None:
                    continue
                cells = []
                for t in map(str, REPLAY_CHECKPOINTS):
                    if t in rep["positions"] and t in other["positions"]:
                        d, _ = _max_object_distance(rep["positions"][t], other["positions"][t])
                        e = np.linalg.norm(np.subtract(rep["positions"][t]["_eef"], other["positions"][t]["_eef"]))
                        cells.append(f"{_cm(d)} / {_cm(float(e))}")
                    else:
                        cells.append("-")
                differs = "yes" if rep["success"] != other["success"] else "no"
                flags = f"{name} {any(rep['success'])}, {ref} {any(other['success'])}"
                lines.append(f"| {key[0]}/{key[1]}/{init_id} | " + " | ".join(cells) + f" | {differs} ({flags}) |")
    return "\n".join(lines)


def _named_python(spec: str) -> tuple[str, str]:
    name, sep, python = spec.partition("=")
    if not sep or not name or not python:
        raise SystemExit(f"expected NAME=PATH_TO_PYTHON, got {spec!r}")
    if not os.access(python, os.X_OK):
        raise SystemExit(f"{python!r} is not an executable interpreter: build it first (make openpi-venv, "
                         f"make sim-venv MUJOCO=3.17.0)")
    return name, python


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ref", default="openpi=.venv-openpi/bin/python", help="NAME=PYTHON of the reference stack")
    p.add_argument("--cmp", action="append", default=None, help="NAME=PYTHON to compare (repeatable)")
    p.add_argument("--suites", nargs="+", default=list(SUITES), choices=SUITES)
    p.add_argument("--task_ids", nargs="+", type=int, default=list(range(10)))
    p.add_argument("--replay_tasks", nargs="+", type=int, default=[0, 5], help="tasks per suite with replays")
    p.add_argument("--replay_init_ids", nargs="+", type=int, default=[0, 1])
    p.add_argument("--replay_steps", type=int, default=max(REPLAY_CHECKPOINTS))
    p.add_argument("--workers", type=int, default=2, help="probe subprocesses at a time (2 CPU cores: at most 2)")
    p.add_argument("--out_dir", default="runs/sim_stack_divergence")
    p.add_argument("--report_only", action="store_true", help="summarise the cached probes, run nothing")
    # probe mode (runs under the interpreter being measured)
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--suite", help=argparse.SUPPRESS)
    p.add_argument("--task_id", type=int, help=argparse.SUPPRESS)
    p.add_argument("--probe_out", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.probe:
        res = probe(args.suite, args.task_id, args.replay_init_ids if "--replay_init_ids" in sys.argv else [],
                    args.replay_steps)
        tmp = Path(args.probe_out + ".tmp")
        tmp.write_text(json.dumps(res))
        tmp.replace(args.probe_out)
        return

    pythons = dict([_named_python(args.ref)] + [_named_python(s) for s in (args.cmp or ["ours=.venv/bin/python"])])
    ref = _named_python(args.ref)[0]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Task-major order so that a partial run has complete (all-interpreter) comparisons for the tasks it covered.
    jobs = [(name, py, suite, t) for t in args.task_ids for suite in args.suites for name, py in pythons.items()]
    if not args.report_only:
        with ThreadPoolExecutor(max_workers=max(1, min(args.workers, 2))) as pool:
            futures = [pool.submit(_run_probe, py, suite, t, out_dir / f"{name}__{suite}__{t}.json", args)
                       for name, py, suite, t in jobs]
            for f in futures:
                f.result()
    results: dict[str, dict[tuple[str, int], dict]] = {name: {} for name in pythons}
    for name, _, suite, t in jobs:
        path = out_dir / f"{name}__{suite}__{t}.json"
        if path.exists():
            results[name][(suite, t)] = json.loads(path.read_text())
    text = report(results, ref)
    (out_dir / "report.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
