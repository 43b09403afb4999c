r"""Bench: RL iterations per minute on the RL bench's settings, today's path against the fast one, in one process.

Both paths run ``pi0.ript.trainer.RIPTTrainer`` (LOOP, 4 kept groups x 8 rollouts per iteration) from the same
converged start (``bench/rl_improvement.py``'s cached start for ``--env/--task/--seed/--num_demos``), one after the
other, each for ``--iterations`` timed iterations after ``--warmup`` untimed ones:

* ``baseline`` (today's path before this bench): eager ``PI0Model.sample_actions_sde``, sequential collection rounds
  (``algo.oversample=0``), the arena's 32 in-process envs / MetaWorld's ``--baseline_num_envs`` single-env workers;
* ``fast``: Flow-SDE through ``FastSampler`` (``algo.fast_sampling``), every group of an oversampled round in flight
  (``algo.oversample``; the first informative groups kept, the rest abandoned), MetaWorld's envs packed
  ``envs_per_worker`` to a process over ``--workers`` processes, and the ``--trainable`` update (``expert``: the
  frozen prefix runs once per window and iteration).

Reported per path: seconds per iteration (collection / update), episodes per minute (episodes of the groups the
iteration used), decisions per second (observations through the policy per second of collection), update windows
per second, groups rolled per iteration. The last line is
``env=<arena|metaworld> iter_s=<s> baseline_iter_s=<s> ratio=<r> episodes_per_min=<n>``.

    .venv/bin/python bench/rl_throughput.py --env arena --iterations 30
    .venv/bin/python bench/rl_throughput.py --env metaworld --task 1 2 5 --num_demos 20 --train_states 200 \
        --val_start 200 --val_states 20 --eval_start 250 --eval_states 70 --iterations 5
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rl_improvement: the RL bench whose settings we time
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pi0, not an installed one

import rl_improvement as rlb  # noqa: E402

from pi0.modeling_pi0 import PI0Policy  # noqa: E402
from pi0.ript.init_states import InitStateSampler  # noqa: E402
from pi0.ript.trainer import RIPTTrainer, RLConfig  # noqa: E402
from pi0.ript.update import OptimizerConfig  # noqa: E402
from pi0.rollout.types import PolicyOutput  # noqa: E402
from pi0.utils.cli import parse_config  # noqa: E402


@dataclass
class Config(rlb.Config):
    """The RL bench's options (``bench/rl_improvement.py``) plus the throughput run's own."""

    iterations: int = 20  # timed iterations per path
    warmup: int = 2  # untimed iterations per path first (caches, allocator, compile)
    paths: str = "baseline,fast"  # which paths to run, in this order
    baseline_num_envs: int = 0  # today's runner: 0 = arena num_groups x group_size in process, MetaWorld 2 workers
    json_out: str = ""  # write the results here as JSON too


class CountingPolicy:
    """Wraps a ChunkPolicy: counts its calls, the observations they carried and the seconds they took."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.calls = self.rows = 0
        self.seconds = 0.0

    def predict_chunks(self, obs: list[dict[str, np.ndarray]], prompts: list[str]) -> PolicyOutput:
        t0 = time.perf_counter()
        out = self.inner.predict_chunks(obs, prompts)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.rows += len(obs)
        return out


def rl_config(cfg: Config, fast: bool) -> RLConfig:
    """The RL arm's settings (as ``rl_improvement.run_arm``), on today's path or the fast one."""
    return RLConfig(objective=cfg.objective, trainable=cfg.trainable, noise_level=cfg.noise_level, clip=cfg.clip,
                    sde_step=cfg.sde_step, value_baseline=cfg.value_baseline, num_groups=cfg.num_groups,
                    group_size=cfg.group_size, eval_every=0, seed=cfg.seed,
                    oversample=cfg.oversample if fast else 0.0, fast_sampling=fast,
                    opt=OptimizerConfig(lr=cfg.lr, epochs=cfg.epochs, minibatch_size=cfg.minibatch_size,
                                        value_lr=cfg.value_lr))


def baseline_runner(cfg: Config, policy: PI0Policy):
    """Today's runner of the RL arm: the arena's num_groups x group_size envs; MetaWorld's single-env workers."""
    n = cfg.baseline_num_envs or (cfg.num_groups * cfg.group_size if cfg.env == "arena" else 2)
    return rlb.env_runner(cfg.env, n, policy.config.n_action_steps, num_init_states=rlb.num_init_states(cfg))


def run_path(cfg: Config, root: Path, path: str) -> dict[str, Any]:
    """``warmup`` + ``iterations`` RL iterations on ``path`` from the start at ``root`` -> its figures."""
    fast = path == "fast"
    policy = PI0Policy.from_pretrained(root)
    runner = rlb.make_runner(cfg, policy) if fast else baseline_runner(cfg, policy)
    _, _, train_states = rlb.splits(cfg)
    trainer = RIPTTrainer(policy, runner, InitStateSampler(train_states, seed=cfg.seed + 1), rl_config(cfg, fast))
    counting = CountingPolicy(trainer.rollouts.policy)
    trainer.rollouts.policy = counting
    rows: list[dict[str, float]] = []
    try:
        for i in range(cfg.warmup + cfg.iterations):
            calls0, rows0, pol0 = counting.calls, counting.rows, counting.seconds
            t0 = time.perf_counter()
            st = trainer.step()
            wall = time.perf_counter() - t0
            if i < cfg.warmup:
                continue
            rows.append({"wall": wall, "rollout": st["time/rollout_s"], "update": st["time/update_s"],
                         "episodes": st["rollout/groups"] * cfg.group_size, "groups": st["rollout/groups"],
                         "kept": float(len(trainer.last_collection.groups)), "windows": st["train/windows"],
                         "calls": float(counting.calls - calls0), "decisions": float(counting.rows - rows0),
                         "policy_s": counting.seconds - pol0, "success": st["rollout/success_rate"]})
            print(f"[{path}] iteration {i - cfg.warmup + 1}/{cfg.iterations}: {wall:.2f} s (collect "
                  f"{st['time/rollout_s']:.2f}, update {st['time/update_s']:.2f}), {int(st['rollout/groups'])} groups "
                  f"rolled, {len(trainer.last_collection.groups)} kept, {int(rows[-1]['calls'])} policy calls",
                  flush=True)
    finally:
        runner.close()
    s = {k: float(np.sum([r[k] for r in rows])) for k in rows[0]}
    n = len(rows)
    return {"path": path, "iterations": n, "iter_s": s["wall"] / n, "collect_s": s["rollout"] / n,
            "update_s": s["update"] / n, "episodes_per_min": 60 * s["episodes"] / s["wall"],
            "decisions_per_s": s["decisions"] / s["rollout"], "policy_calls_per_iter": s["calls"] / n,
            "policy_s_per_iter": s["policy_s"] / n, "windows_per_s": s["windows"] / s["update"],
            "groups_per_iter": s["groups"] / n, "kept_per_iter": s["kept"] / n,
            "rollout_success": s["success"] / n, "per_iteration": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the paths and print the table and the summary line."""
    cfg = parse_config(Config, list(sys.argv[1:] if argv is None else argv), __doc__)
    paths = [p for p in cfg.paths.split(",") if p]
    if not paths or any(p not in ("baseline", "fast") for p in paths):
        raise SystemExit(f"error: --paths takes baseline and/or fast (comma-separated), got {cfg.paths!r}")
    if cfg.iterations < 1 or cfg.warmup < 0:
        raise SystemExit("error: --iterations must be >= 1 and --warmup >= 0")
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    load0 = os.getloadavg()
    _, _, root, rec = rlb.start(cfg)
    print(f"start: {cfg.num_demos} demos, {rec['steps']} SFT steps, validation plateau {rec['plateau']:.3f} ({root})",
          flush=True)
    results = {p: run_path(cfg, root, p) for p in paths}
    cols = ("iter_s", "collect_s", "update_s", "episodes_per_min", "decisions_per_s", "windows_per_s",
            "policy_calls_per_iter", "groups_per_iter", "rollout_success")
    print("| path | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for p, r in results.items():
        print(f"| {p} | " + " | ".join(f"{r[c]:.2f}" for c in cols) + " |")
    load1 = os.getloadavg()
    print(f"load average before {load0[0]:.2f}, after {load1[0]:.2f} (1 min)")
    out = {"config": asdict(cfg), "start": {k: rec[k] for k in ("demos", "steps", "plateau")}, "results": results,
           "load_before": load0, "load_after": load1}
    if cfg.json_out:
        Path(cfg.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.json_out).write_text(json.dumps(out, indent=1))
    new = results.get("fast") or results[paths[-1]]
    base = results.get("baseline")
    base_s = base["iter_s"] if base else float("nan")
    print(f"env={cfg.env} iter_s={new['iter_s']:.3f} baseline_iter_s={base_s:.3f} ratio={base_s / new['iter_s']:.2f} "
          f"episodes_per_min={new['episodes_per_min']:.1f}")
    return out


if __name__ == "__main__":
    main()
