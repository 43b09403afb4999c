"""Benchmark the warm start's SFT step: one process (1 or 2 threads) against data-parallel ranks (one thread each).

    python bench/parallel_start.py                      # make run's start: 64 windows a step; 1 process vs 2 ranks
    python bench/parallel_start.py --minibatch 32 --procs 2 --steps 40

What ``task.warm_start_procs`` changes (``pi0.ript.warm_start.sft_to_plateau_parallel``): the same global minibatch,
split among gloo ranks that average their gradients (``PolicyUpdate``). Every path trains the tiny arena policy on
the same scripted-expert windows in this session, one path after the other; prints ms per optimizer step and the
ratio against the best single-process path. The last line is ``procs=<P> ms_per_step=<x> baseline_ms=<y>
ratio=<r>``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from pi0.ript.objectives import FlowMatchingObjective
from pi0.ript.update import OptimizerConfig, PolicyUpdate
from pi0.ript.utils.dist_utils import DistInfo, spawn_gloo
from pi0.ript.warm_start import (TinyArenaConfig, arena_expert_demos, demo_norm_stats, demo_windows, sft,
                                 tiny_arena_policy)


def setup(states: int):
    """The tiny arena policy of make run's start and its demo windows (scripted expert, arena task 4)."""
    cfg = TinyArenaConfig()
    torch.manual_seed(0)
    demos = arena_expert_demos([(4, i) for i in range(states)], cfg.action_horizon, cfg.n_action_steps)
    policy = tiny_arena_policy(cfg, demo_norm_stats(demos))
    return policy, demo_windows(policy, demos)


def time_steps(update: PolicyUpdate, windows: list, steps: int, reps: int) -> float:
    """Median over ``reps`` of the ms per optimizer step of ``steps`` steps (after 3 warm-up steps)."""
    policy = update.objective.policy
    sft(policy, windows, update.config, steps=3, update=update)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sft(policy, windows, update.config, steps=steps, update=update)
        out.append((time.perf_counter() - t0) / steps * 1000)
    return statistics.median(out)


def _rank(info: DistInfo, args: argparse.Namespace) -> float:
    """One rank: its shard of the windows and of the minibatch -> ms per step."""
    policy, windows = setup(args.states)
    upd = PolicyUpdate(FlowMatchingObjective(policy), OptimizerConfig(minibatch_size=args.minibatch // info.world_size),
                       seed=info.rank, info=info)
    return time_steps(upd, windows[info.rank::info.world_size], args.steps, args.reps)


def parallel_ms(args: argparse.Namespace) -> float:
    """ms per step of ``args.procs`` spawned gloo ranks (rank 0's median)."""
    return spawn_gloo(_rank, args.procs, args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minibatch", type=int, default=64, help="global windows per optimizer step")
    ap.add_argument("--procs", type=int, default=2, help="data-parallel ranks (one thread each)")
    ap.add_argument("--states", type=int, default=60, help="scripted-expert demos (arena task 4)")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per repetition")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if args.minibatch % args.procs:
        raise SystemExit(f"error: --minibatch {args.minibatch} does not divide among --procs {args.procs}")
    policy, windows = setup(args.states)
    rows = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        upd = PolicyUpdate(FlowMatchingObjective(copy.deepcopy(policy)), OptimizerConfig(minibatch_size=args.minibatch))
        rows[f"1 process, {threads} thread(s)"] = time_steps(upd, windows, args.steps, args.reps)
    rows[f"{args.procs} ranks x {args.minibatch // args.procs} windows, 1 thread each"] = par = parallel_ms(args)
    base = min(v for k, v in rows.items() if k.startswith("1 process"))
    print(f"| path ({args.minibatch} windows a step, {os.cpu_count()} cores) | ms per step | vs best 1-process |")
    print("|---|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.1f} | {base / v:.2f}x |")
    print(f"procs={args.procs} ms_per_step={par:.1f} baseline_ms={base:.1f} ratio={base / par:.2f}")


if __name__ == "__main__":
    main()
