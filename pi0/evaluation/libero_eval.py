"""LIBERO evaluation of any policy (pi0, pi0.5, pi0-FAST): success rates per task and suite, videos, debug sessions.

One ``RolloutRunner`` (the shared runner core, LIBERO preset) runs every (task, trial) episode over subprocess envs
with batched inference; ``trial`` k uses init state k of the task, as openpi's LIBERO eval does.

``openpi_exact=True`` reproduces openpi's ``examples/libero/main.py`` episode for episode: one env per task, hard
resets, ``np.random.seed(seed)`` and ``env.seed(seed)``, and the episodes of a task run in order on one worker
(``schedule="task_order"``), so the fixture poses LIBERO draws at each reset follow openpi's sequence.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pi0.evaluation.debug import write_debug_session
from pi0.envs.conventions import SUITE_MAX_STEPS, EnvSpec, libero_env_spec
from pi0.errors import UserError
from pi0.envs.libero_env import libero_task_info
from pi0.policies.libero import Pi0ChunkPolicy
from pi0.policies.pi0 import PI0Policy
from pi0.rollout.config import RunnerConfig, libero_runner_config
from pi0.rollout.runner import RolloutRunner, RunnerHooks
from pi0.rollout.types import Episode
from pi0.utils.video import write_video


@dataclass
class EvalConfig:
    """What to evaluate and how."""

    suite: str = "libero_spatial"
    task_ids: list[int] | None = None  # None = every task of the suite
    num_trials: int = 50  # episodes per task (init states 0..num_trials-1)
    num_envs: int = 2  # env worker processes (about 2 GB RAM each)
    replan_steps: int = 5
    max_steps: int | None = None  # None = the suite's openpi value
    num_videos: int = 1  # mp4s of the first M episodes per task
    video_fps: float = 4.0  # frames are taken at decision points (every replan_steps env steps)
    debug: bool = False  # write a debug session for the first episode of each task
    resume: bool = False  # skip episodes already recorded in <out_dir>/episodes.jsonl (after a crash)
    seed: int = 7  # flow-noise generator seed; with openpi_exact also LIBERO's (openpi's LIBERO eval uses 7)
    openpi_exact: bool = False  # openpi's env seeding and episode order (hard resets: +6-9 s per episode)
    out_dir: str = "outputs/eval"
    use_subprocess: bool = True
    extra_env_kwargs: dict[str, Any] = field(default_factory=dict)


def check_tasks(suite: str, task_ids: list[int] | None, num_trials: int) -> list[tuple[int, str, int]]:
    """Validate suite / task ids / trial count cheaply (no simulator) -> the selected task infos."""
    infos = libero_task_info(suite)  # raises on an unknown suite
    valid = {t: (t, lang, n) for t, lang, n in infos}
    ids = list(valid) if task_ids is None else list(task_ids)
    bad = [t for t in ids if t not in valid]
    if bad:
        raise UserError(f"unknown task id(s) {bad} for {suite}; valid task ids are 0..{len(infos) - 1}")
    short = [t for t in ids if valid[t][2] < num_trials]
    if short:
        raise UserError(f"num_trials={num_trials} exceeds the init states of task(s) {short} "
                         f"({[valid[t][2] for t in short]})")
    return [valid[t] for t in ids]


def runner_setup(cfg: EvalConfig, first_task: int) -> tuple[EnvSpec, RunnerConfig]:
    """The env spec and runner config of an evaluation (openpi-exact mode included), nothing started."""
    kwargs = dict(cfg.extra_env_kwargs)
    if cfg.openpi_exact:
        kwargs.update(openpi_exact=True, seed=cfg.seed)
    spec = libero_env_spec(cfg.suite, task_id=first_task, **kwargs)
    if cfg.max_steps is not None:
        spec = spec.replace(max_steps=cfg.max_steps)
    run_cfg = libero_runner_config(num_envs=cfg.num_envs, replan_steps=cfg.replan_steps,
                                   record_video=cfg.num_videos > 0, progress=True, use_subprocess=cfg.use_subprocess,
                                   schedule="task_order" if cfg.openpi_exact else "greedy")
    return spec, run_cfg


def _load_records(path: Path) -> dict[tuple[int, int], dict[str, Any]]:
    """Finished-episode records of an earlier (interrupted) run, keyed by (task_id, trial)."""
    records = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                records[(r["task_id"], r["trial"])] = r
    return records


def evaluate_libero(policy: PI0Policy, cfg: EvalConfig) -> dict[str, Any]:
    """Run the evaluation; writes results.json (+ videos, debug sessions) under ``cfg.out_dir``.

    Every finished episode is appended to ``episodes.jsonl`` as soon as it ends, so ``resume=True``
    continues an interrupted evaluation without re-running what was done.
    """
    tasks = check_tasks(cfg.suite, cfg.task_ids, cfg.num_trials)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "episodes.jsonl"
    records = _load_records(log_path) if cfg.resume else {}
    if not cfg.resume:
        log_path.write_text("")
    wanted = [(t, k) for t, _, _ in tasks for k in range(cfg.num_trials)]
    todo = [key for key in wanted if key not in records]
    keep_frames = {(t, k) for t, _, _ in tasks for k in range(cfg.num_videos)}
    keep_decisions = {(t, 0) for t, _, _ in tasks} if cfg.debug else set()

    def on_episode_end(_: RolloutRunner, ep: Episode) -> None:
        """Log the episode, write its video / debug session now, then drop its heavy arrays."""
        key = (ep.task_id, ep.init_state_id)
        records[key] = {"task_id": ep.task_id, "trial": ep.init_state_id, "success": bool(ep.success),
                        "length": ep.length, "attempts": ep.attempts}
        if cfg.openpi_exact:  # resets replayed to reach this trial (0 unless resumed / respawned mid-task)
            records[key]["openpi_skipped_resets"] = int(ep.info.get("openpi_skipped_resets", 0))
        with log_path.open("a") as f:
            f.write(json.dumps(records[key]) + "\n")
        if key in keep_frames and ep.frames:
            outcome = "success" if ep.success else "failure"
            write_video(out / "videos" / f"{cfg.suite}_task{ep.task_id}_trial{ep.init_state_id}_{outcome}.mp4",
                        ep.frames, fps=cfg.video_fps)
        if key in keep_decisions:
            write_debug_session(out / "debug" / f"task{ep.task_id}_init{ep.init_state_id}", ep,
                                {"suite": cfg.suite, "replan_steps": cfg.replan_steps, "seed": cfg.seed,
                                 "source": "2_test_pi0_on_libero"})
        ep.frames = None
        ep.decisions = []

    gen = torch.Generator().manual_seed(cfg.seed)
    spec, run_cfg = runner_setup(cfg, todo[0][0] if todo else tasks[0][0])
    runner = RolloutRunner(spec, Pi0ChunkPolicy(policy, gen), run_cfg, hooks=RunnerHooks(on_episode_end=on_episode_end))
    t0 = time.perf_counter()
    if todo:
        with runner:
            runner.run(todo)
    wall = time.perf_counter() - t0
    episodes = [records[key] for key in wanted]
    per_task = {}
    for t, lang, _ in tasks:
        eps = [e for e in episodes if e["task_id"] == t]
        per_task[str(t)] = {"language": lang, "episodes": len(eps), "successes": int(sum(e["success"] for e in eps)),
                            "success_rate": float(np.mean([e["success"] for e in eps])),
                            "mean_length": float(np.mean([e["length"] for e in eps]))}
    stats = runner.last_stats
    results = {
        "suite": cfg.suite, "success_rate": float(np.mean([e["success"] for e in episodes])),
        "num_episodes": len(episodes), "num_resumed": len(wanted) - len(todo), "per_task": per_task,
        "episodes": episodes, "max_steps": cfg.max_steps or SUITE_MAX_STEPS[cfg.suite], "wall_time_s": wall,
        "env_steps_per_s": stats.steps_per_second, "policy_calls": stats.policy_calls,
        "mean_batch_size": stats.mean_batch_size, "worker_failures": stats.worker_failures,
        "config": asdict(cfg),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return results
