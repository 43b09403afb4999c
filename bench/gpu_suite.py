"""Every GPU check in one command, for a session lent a GPU (about 18 minutes: a lease runs a part, ``--steps``).

    python3 bench/gpu_suite.py --out runs/gpu_suite       # on the lent machine: CUDA, full-size bf16 figures
    .venv/bin/python bench/gpu_suite.py --dry-run         # CPU, tiny configs, each step small (CI runs this)

Each step runs in its own subprocess with a time budget, so one failure (or a missing package on the lent machine)
never stops the others; the suite writes ``<out>/gpu_suite.json`` and prints one table:

1. ``cuda_tests``: the CUDA-marked tests (``pytest -m cuda``: CUDA-graph and compile parity, float32 and bf16 on
   the GPU against openpi's fixtures). Dry run: the selection is collected, not run.
2. ``sampling_b1`` / ``sampling_b64`` / ``sampling_sde_b32`` / ``sampling_pi05_b1`` / ``sampling_b1_3cam``: full-size
   bf16 sampling, 10 steps (``bench/sampling.py``): pi0 at batch 1 (2 views), batch 64, Flow-SDE as RL collects at
   batch 32, pi0.5 at batch 1, pi0 with 3 views. Rows: eager KV-cached, and FastSampler under a CUDA graph of the
   whole call (and, at batch 1, of the Euler loop alone, the path before the whole-call graph), compiled and eager;
   ms per call, chunks per second and the roofline ratio (measured time over the time to read the weights once per
   call at the measured copy bandwidth).
3. ``train_memory``: ``bench/train_memory.py --device cuda --minibatch 8``: one full-size RL update step per
   trainable mode (expert, lora, all), checkpointing on: ``torch.cuda.max_memory_allocated``.
4. ``eval_1env`` / ``eval_Nenv``: evaluation throughput, tiny policy on the GPU, subprocess envs on the host
   cores (``scripts/6_batched_rollouts.py``): episodes per minute with N envs against 1. LIBERO when it is
   installed, else the arena (the row says which).
5. ``rl_iteration``: one RL iteration (collect, update, evaluate, checkpoint) with a tiny model on the GPU
   (``8_train_with_epochs.py``), LIBERO when installed, else the arena.
6. ``rl_throughput``: ``bench/rl_throughput.py``'s GPU row: RL iterations of full-size pi0 (random weights, bf16,
   ``trainable=expert``) on the arena at 224 px, 4 groups x 8 rollouts, today's path (eager Flow-SDE) against the
   fast one (FastSampler under a CUDA graph, the update on collection's prefix caches) and ``fast_encode`` (the
   fast one whose update encodes the frozen prefix again) in one process: seconds per iteration, collection / update,
   the ratio, ``reuse_update_ratio`` (fast_encode's update over fast's) and each path's peak memory over the models
   the process holds (``<path>_peak_extra_gib``: the prefix caches show in fast's).

The lent machine has its own Python with torch but no network: packages it lacks (omegaconf, gymnasium, ...) travel
as wheels and the test fixtures as ``.shared/`` (``PI0_SHARED``); ``bench/gpu_wheels.sh`` prepares both. A step
stopped by a missing optional package (``OPTIONAL``) reports ``missing: <name>``; any other error fails it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|deselected|error|errors)")


def run(cmd: list[str], timeout: float, log: Path) -> tuple[int, str, float]:
    """Run one command from the repo root -> (exit code, its output, seconds); 124 on timeout."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               PYTHONUNBUFFERED="1", MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"),
               PYOPENGL_PLATFORM=os.environ.get("PYOPENGL_PLATFORM", "egl"))
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc = 124
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        out += f"\n[timed out after {timeout:.0f} s]"
    seconds = time.perf_counter() - t0
    log.write_text(f"$ {' '.join(cmd)}\n{out}")
    return rc, out, seconds


# Packages the lent machine may lack (they cannot all travel): a step that stops on one of them reports
# "missing: <name>" instead of failing. Any other import error (one of ours, say) is a failure.
OPTIONAL = ("libero", "robosuite", "bddl", "mujoco", "omegaconf", "gymnasium", "websockets", "openpi_client",
            "imageio_ffmpeg", "orbax", "jax")


def missing_module(out: str) -> str | None:
    """The optional package whose ModuleNotFoundError stopped a step, if any."""
    m = re.search(r"ModuleNotFoundError: No module named '([^']+)'", out)
    return m.group(1) if m and m.group(1).split(".")[0] in OPTIONAL else None


def status_of(rc: int, out: str) -> str:
    """'ok', 'timeout', 'missing: <optional package>' or 'failed (rc N)'."""
    if rc == 0:
        return "ok"
    if rc == 124:
        return "timeout"
    mod = missing_module(out)
    return f"missing: {mod}" if mod else f"failed (rc {rc})"


def libero_installed() -> bool:
    """Whether the LIBERO simulator imports here (the lent machine usually lacks it: its assets are GBs)."""
    return importlib.util.find_spec("libero") is not None


# ---------------------------------------------------------------------------------------------------- steps
def step_cuda_tests(a: argparse.Namespace, out: Path) -> dict[str, Any]:
    """pytest -m cuda (dry run: collect only)."""
    # test modules that import an optional package the lent machine lacks (LIBERO, websockets) fail to collect
    # there: go on without them, and name them
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", "tests"]
    if a.dry_run:
        cmd.insert(4, "--collect-only")
    rc, text, sec = run(cmd, a.budget("cuda_tests"), out / "cuda_tests.log")
    counts = {k: int(n) for n, k in SUMMARY.findall(text)}
    collected = re.search(r"(\d+)/\d+ tests collected", text)
    absent = sorted(set(re.findall(r"ModuleNotFoundError: No module named '([^'.]+)", text)))
    # every error is a module that failed to collect ("ERROR tests/x.py", no "::test"), each for an optional package
    collection_errors = re.findall(r"^ERROR tests/\S+\.py\s*$", text, re.M)
    only_optional = bool(absent) and all(m in OPTIONAL for m in absent) \
        and counts.get("error", 0) + counts.get("errors", 0) == len(collection_errors)
    ok = rc == 0 or (rc == 5 and a.dry_run)  # 5: nothing selected (a CPU build skips nothing at collection)
    ok = ok or (rc == 1 and not counts.get("failed") and only_optional)
    res = {"status": "ok" if ok else status_of(rc, text), "seconds": sec, **counts}
    if absent:
        res["not_collected_for_lack_of"] = ",".join(absent)
    if collected:
        res["selected"] = int(collected.group(1))
    return res


def sampling_step(name: str, batch: int, cameras: int = 2, pi05: bool = False, sde: bool = False,
                  scopes: str = "call", compiled: bool = True) -> Callable[[argparse.Namespace, Path], dict[str, Any]]:
    """bench/sampling.py for one setting (pi0 or pi0.5, batch, live cameras, deterministic or Flow-SDE) -> ms and
    chunks per second per path, the best path and its roofline ratio.

    Rows: eager KV-cached, then FastSampler under a CUDA graph of each scope in ``scopes`` (``call``: the whole
    call, ``loop``: the Euler loop alone), compiled (SigLIP, prefix and step; the first call compiles) and eager."""

    def step(a: argparse.Namespace, out: Path) -> dict[str, Any]:
        js = out / f"{name}.json"
        if a.dry_run:
            args = ["--config", "tiny", "--device", "cpu", "--dtype", "float32", "--iters", "1", "--compile",
                    "--skip_compile"]
        else:
            args = ["--config", "full", "--device", "cuda", "--dtype", "bfloat16", "--iters", "10", "--compile",
                    "--graph_rows_only", "--scopes", scopes,
                    *(["--compile_prefix"] if compiled else ["--skip_compile"])]
        # dry run: at most 8 rows (the tiny model at batch 64 costs 30 s a step on 2 cores and checks nothing more)
        rows = min(batch, 8) if a.dry_run else batch
        cmd = [sys.executable, "bench/sampling.py", *args, "--attn", "sdpa", "--batch", str(rows), "--cameras",
               str(cameras), "--num_steps", "10", "--no_recompute", "--json", str(js), *(["--pi05"] if pi05 else []),
               *(["--sde"] if sde else [])]
        rc, text, sec = run(cmd, a.budget(name), out / f"{name}.log")
        res: dict[str, Any] = {"status": status_of(rc, text), "seconds": sec}
        if rc == 0 and js.is_file():
            figs = json.loads(js.read_text())
            res.update({f"{k} ms": round(v, 2) for k, v in figs["ms"].items()})
            best = figs["best"]
            res.update(best=best, chunks_per_s=round(figs["chunks_per_s"][best], 1),
                       roofline_ms=round(figs["roofline_ms"], 3),
                       best_over_roofline=round(figs["best_over_roofline"], 2))
            failed = {k: v for k, v in figs["notes"].items() if v.startswith("capture failed")}
            if failed:
                res["capture_failed"] = "; ".join(f"{k}: {v}"[:160] for k, v in failed.items())
        return res

    return step


def step_train_memory(a: argparse.Namespace, out: Path) -> dict[str, Any]:
    """bench/train_memory.py per trainable mode, when the bench exists."""
    if not (REPO / "bench" / "train_memory.py").is_file():
        return {"status": "absent: bench/train_memory.py is not built yet"}
    # dry run: one mode of the tiny model at minibatch 1 (the ci config's bf16 step takes ~100 s on an AVX2-only CPU)
    args = (["--config", "tiny", "--device", "cpu", "--modes", "expert", "--minibatch", "1", "--checkpointing", "on",
             "--threads", "1"]
            if a.dry_run else ["--device", "cuda", "--minibatch", "8", "--checkpointing", "on"]) + ["--random_init"]
    args += ["--work", str(out / "train_memory_work")]
    rc, text, sec = run([sys.executable, "bench/train_memory.py", *args], a.budget("train_memory"),
                        out / "train_memory.log")
    last = next((ln for ln in reversed(text.splitlines()) if re.match(r"(expert|lora|all)=", ln)), "")
    return {"status": status_of(rc, text), "seconds": sec, "peaks": last if rc == 0 else ""}


def eval_step(name: str, envs_of: Callable[[argparse.Namespace], int]
              ) -> Callable[[argparse.Namespace, Path], dict[str, Any]]:
    """Stage 6 with the tiny policy on the device and N subprocess envs -> episodes per minute."""

    def step(a: argparse.Namespace, out: Path) -> dict[str, Any]:
        n = envs_of(a)
        env = "libero" if libero_installed() else "arena"
        episodes = 2 if a.dry_run else 16
        steps = 10 if a.dry_run else 100
        group = min(2, n)  # K rollouts per init state share a batched policy call (needs n >= K)
        cmd = [sys.executable, "scripts/6_batched_rollouts.py", "--env", env, "--task_ids", "0", "--init_states",
               str(episodes // group), "--group_size", str(group), "--num_envs", str(n), "--max_steps", str(steps),
               "--device", a.device]
        rc, text, sec = run(cmd, a.budget(name), out / f"{name}.log")
        res: dict[str, Any] = {"status": status_of(rc, text), "seconds": sec, "env": env, "num_envs": n}
        m = re.search(r"(\d+) episodes, .*?([\d.]+) env steps/s, policy time ([\d.]+)s of ([\d.]+)s", text)
        if rc == 0 and m:
            eps, sps, pol, wall = int(m.group(1)), float(m.group(2)), float(m.group(3)), float(m.group(4))
            res.update(episodes=eps, episodes_per_min=round(eps / wall * 60, 1), env_steps_per_s=sps,
                       policy_s=pol, rollout_s=wall)
        return res

    return step


def step_rl_iteration(a: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One RL iteration of stage 8 with a tiny model on the device."""
    env = "libero" if libero_installed() else "arena"
    task = ["task.env=libero", "task.suite=libero_spatial", "task.task_ids=[0]"] if env == "libero" else \
        ["task.env=arena", "task.task_ids=[0]"]
    cmd = [sys.executable, "8_train_with_epochs.py", *task, "features.enable_parallel_envs=true",
           "env.runner.num_envs=2", f"env.runner.max_steps={10 if a.dry_run else 60}", "algo.iterations=1",
           "algo.num_groups=1", "algo.group_size=2", "algo.max_collect_attempts=1", "task.eval_states=1",
           "features.save_video=false", f"device={a.device}", f"logging.out_dir={out / 'rl'}"]
    rc, text, sec = run(cmd, a.budget("rl_iteration"), out / "rl_iteration.log")
    res: dict[str, Any] = {"status": status_of(rc, text), "seconds": sec, "env": env}
    m = re.search(r"iter 1: success ([\d.]+)", text)
    if m:
        res["success"] = float(m.group(1))
    if rc == 0 and "iter 1:" not in text:
        res["status"] = "failed (no iteration logged)"
    return res


ITERATION = re.compile(r"\[(\w+)\] iteration \d+/\d+: ([\d.]+) s \(collect ([\d.]+), update ([\d.]+)\)")


def step_rl_throughput(a: argparse.Namespace, out: Path) -> dict[str, Any]:
    """bench/rl_throughput.py's GPU row (dry run: the tiny model, one small iteration per path) -> each path's mean
    seconds per iteration, collection and update, read from its per-iteration lines (so a step that runs out of its
    budget still reports the iterations it finished) and the ratio."""
    size = (["--random_init", "tiny", "--num_groups", "1", "--group_size", "2", "--max_steps", "10", "--resolution",
             "56", "--minibatch_size", "4", "--iterations", "1", "--warmup", "0"] if a.dry_run else
            ["--random_init", "full", "--iterations", "3", "--warmup", "1"])
    cmd = [sys.executable, "bench/rl_throughput.py", "--env", "arena", "--trainable", "expert", "--device", a.device,
           "--paths", "baseline,fast_encode,fast", "--json_out", str(out / "rl_throughput.json"), *size]
    rc, text, sec = run(cmd, a.budget("rl_throughput"), out / "rl_throughput.log")
    res: dict[str, Any] = {"status": status_of(rc, text), "seconds": sec}
    # the timed iterations only: the warm-up ones print nothing
    per: dict[str, list[tuple[float, ...]]] = {}
    for m in ITERATION.finditer(text):
        per.setdefault(m.group(1), []).append(tuple(float(m.group(i)) for i in (2, 3, 4)))
    for path, rows in per.items():
        mean = [sum(c) / len(rows) for c in zip(*rows)]
        res.update({f"{path}_iter_s": round(mean[0], 2), f"{path}_collect_s": round(mean[1], 2),
                    f"{path}_update_s": round(mean[2], 2), f"{path}_iterations": len(rows)})
    table = out / "rl_throughput.json"
    if table.is_file():  # CUDA: each path's peak memory over the models held (the prefix caches of reuse among it)
        for path, r in json.loads(table.read_text())["results"].items():
            if "peak_extra_gib" in r:
                res[f"{path}_peak_extra_gib"] = round(r["peak_extra_gib"], 2)
    if "baseline_iter_s" in res and "fast_iter_s" in res:
        res["ratio"] = round(res["baseline_iter_s"] / res["fast_iter_s"], 2)
    if "fast_encode_update_s" in res and "fast_update_s" in res:  # algo.reuse_prefix: collection's prefix caches
        res["reuse_update_ratio"] = round(res["fast_encode_update_s"] / res["fast_update_s"], 2)
    if rc == 0 and "fast_iter_s" not in res:
        res["status"] = "failed (no iteration logged)"
    return res


STEPS: dict[str, Callable[[argparse.Namespace, Path], dict[str, Any]]] = {
    "cuda_tests": step_cuda_tests,
    # issue 40's goals: pi0 batch 1 with 2 and 3 views, pi0.5 batch 1, batch 64; issue 38's Flow-SDE at batch 32
    "sampling_b1": sampling_step("sampling_b1", 1, scopes="call,loop"),
    "sampling_b64": sampling_step("sampling_b64", 64),
    "sampling_sde_b32": sampling_step("sampling_sde_b32", 32, sde=True),
    "sampling_pi05_b1": sampling_step("sampling_pi05_b1", 1, pi05=True),
    "sampling_b1_3cam": sampling_step("sampling_b1_3cam", 1, cameras=3),
    "train_memory": step_train_memory,
    "eval_1env": eval_step("eval_1env", lambda a: 1),
    "eval_Nenv": eval_step("eval_Nenv", lambda a: a.num_envs),
    "rl_iteration": step_rl_iteration,
    "rl_throughput": step_rl_throughput,  # issue 38's GPU row
}
# seconds each step may take (the sampling steps compile the full model: about a minute each, and batch 64's first
# compile ran past 95 s on an H200 on 2026-11-28, where Flow-SDE at batch 32 took 113 s; rl_throughput's two paths
# took 128 s there, and it runs three since); the whole list sums to 1,260 s, over the lent machine's 10-minute
# command limit: a lease runs the steps it needs with --steps (the order above is the priority), --budget overrides
BUDGETS = {"cuda_tests": 150, "sampling_b1": 130, "sampling_b64": 150, "sampling_sde_b32": 120, "sampling_pi05_b1": 90,
           "sampling_b1_3cam": 80, "train_memory": 100, "eval_1env": 60, "eval_Nenv": 40, "rl_iteration": 40,
           "rl_throughput": 300}


DRY_RUN_BUDGET = 300.0  # seconds per step of --dry-run (tiny configs take 2-20 s idle, several times that under load)


def table(results: dict[str, dict[str, Any]]) -> str:
    """One row per step: status, seconds and its figures."""
    rows = [f"{'step':<18}{'status':<34}{'s':>7}  figures"]
    for name, r in results.items():
        figs = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("status", "seconds"))
        sec = f"{r['seconds']:.0f}" if "seconds" in r else "-"
        rows.append(f"{name:<18}{r['status'][:33]:<34}{sec:>7}  {figs}")
    e1, en = results.get("eval_1env", {}), results.get("eval_Nenv", {})
    if e1.get("episodes_per_min") and en.get("episodes_per_min"):
        rows.append(f"eval throughput: {en['num_envs']} envs / 1 env = "
                    f"{en['episodes_per_min'] / e1['episodes_per_min']:.2f}x episodes per minute ({en['env']})")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Run the steps, write the JSON, print the table; exit 1 if a step failed (a missing package is no failure)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny configs, every step small (CI)")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_suite")
    p.add_argument("--steps", nargs="+", default=list(STEPS), choices=list(STEPS))
    p.add_argument("--num_envs", type=int, default=8, help="envs of the eval_Nenv step (dry run: 2)")
    p.add_argument("--budget", nargs="+", default=[], metavar="STEP=SECONDS", help="override a step's time budget")
    a = p.parse_args(argv)
    # the dry run checks that each step still runs, not how fast: a loaded CPU machine gets a generous budget per step
    budgets = {k: DRY_RUN_BUDGET for k in BUDGETS} if a.dry_run else dict(BUDGETS)
    for item in a.budget:
        name, _, sec = item.partition("=")
        if name not in BUDGETS or not sec.replace(".", "", 1).isdigit():
            p.error(f"--budget takes STEP=SECONDS with STEP one of {sorted(BUDGETS)}, got {item!r}")
        budgets[name] = float(sec)
    a.device = "cpu" if a.dry_run else "cuda"
    if a.dry_run:
        a.num_envs = min(a.num_envs, 2)
    a.budget = lambda name: budgets[name]
    a.out.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {"dry_run": a.dry_run, "python": sys.version.split()[0], "libero": libero_installed()}
    try:
        import torch

        info.update(torch=torch.__version__, cuda=torch.cuda.is_available(),
                    gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    except ImportError:
        info["torch"] = None
    if not a.dry_run and not info.get("cuda"):
        print("no CUDA device here: run with --dry-run on a CPU machine", file=sys.stderr)
        return 2
    print(f"gpu suite: {info}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for name in a.steps:
        print(f"-- {name}", flush=True)
        results[name] = STEPS[name](a, a.out)
        print(f"   {results[name]}", flush=True)
        if results[name]["status"] != "ok" and (a.out / f"{name}.log").is_file():
            tail = (a.out / f"{name}.log").read_text().strip().splitlines()[-12:]
            print("   | " + "\n   | ".join(tail), flush=True)  # the cause, in the output the lent machine returns
    (a.out / "gpu_suite.json").write_text(json.dumps({"info": info, "steps": results}, indent=2))
    print(table(results))
    failed = [n for n, r in results.items() if not (r["status"] == "ok" or r["status"].startswith(("missing",
                                                                                                     "absent")))]
    print(f"wrote {a.out / 'gpu_suite.json'}; failed steps: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
