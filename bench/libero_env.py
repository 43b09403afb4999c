"""Benchmark: LIBERO env steps/s when rendering both cameras at every step vs only at decision points.

Decision points are every ``--replan_steps`` policy steps (openpi executes 5 actions of each 50-action chunk), which
is when a chunked policy needs images. Both figures come from one env in one run; physics is identical in both modes.

    MUJOCO_GL=egl .venv/bin/python bench/libero_env.py --suite libero_spatial --task_id 0 --steps 100
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pi0.envs.libero_env import LiberoEnv


def time_steps(env: LiberoEnv, actions: np.ndarray, on_demand: bool, replan_steps: int, render: bool = True) -> float:
    """Steps/s over ``actions`` (N, 7) from a fresh reset; resets (untimed) if an episode ends."""
    env.render_on_demand = on_demand
    env.render_every = replan_steps if render else len(actions) + 1
    env.reset(options={"init_state_id": 0})
    elapsed = 0.0
    for action in actions:
        t0 = time.perf_counter()
        _, _, terminated, truncated, _ = env.step(action)
        elapsed += time.perf_counter() - t0
        if terminated or truncated:
            env.reset(options={"init_state_id": 0})
    return len(actions) / elapsed


def main() -> None:
    """Parse flags, run the three timings, print steps/s and the speed-up."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", default="libero_spatial")
    parser.add_argument("--task_id", type=int, default=0)
    parser.add_argument("--steps", type=int, default=100, help="timed steps per mode")
    parser.add_argument("--replan_steps", type=int, default=5, help="render every this many steps (decision points)")
    parser.add_argument("--resolution", type=int, default=256)
    args = parser.parse_args()

    t0 = time.perf_counter()
    env = LiberoEnv(args.suite, args.task_id, resolution=args.resolution, render_on_demand=True)
    print(f"env created in {time.perf_counter() - t0:.1f} s: {args.suite} task {args.task_id}: {env.prompt!r}")
    rng = np.random.default_rng(0)
    actions = np.clip(rng.normal(0.0, 0.5, size=(args.steps, 7)), -1.0, 1.0)
    try:
        time_steps(env, actions[:3], on_demand=False, replan_steps=1)  # warm-up (numba / GL caches)
        every = time_steps(env, actions, on_demand=False, replan_steps=1)
        decision = time_steps(env, actions, on_demand=True, replan_steps=args.replan_steps)
        physics = time_steps(env, actions, on_demand=True, replan_steps=1, render=False)
    finally:
        env.close()
    print(f"render every step:                 {every:6.2f} steps/s")
    print(f"render every {args.replan_steps} steps (decision pts): {decision:6.2f} steps/s")
    print(f"never render (physics only):       {physics:6.2f} steps/s")
    print(f"speed-up decision-point / every-step: {decision / every:.2f}x")


if __name__ == "__main__":
    main()
