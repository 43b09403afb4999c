"""Benchmark: MetaWorld (MT10) env steps/s without rendering, rendering at decision points or every step, and the
throughput of 1 vs 2 subprocess workers through the rollout runner (a do-nothing policy, episodes of --steps), and
the gain of ``fast_render`` (no shadow/reflection passes; the runner lines use it with ``--fast_render``).

    MUJOCO_GL=egl PYOPENGL_PLATFORM=egl .venv/bin/python bench/metaworld_env.py --task_id 2 --steps 200

The ratios (decision-point / every-step rendering; 2 workers / 1 worker) come from the same process.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", "egl")

from pi0.envs import make_env_spec  # noqa: E402
from pi0.rollout import RolloutRunner, RunnerConfig, ZeroChunkPolicy  # noqa: E402


def time_steps(env, actions: np.ndarray, render_every: int | None) -> float:
    """Steps/s of one env over ``actions`` (N, 7) (``render_every``: None = never render)."""
    env.reset(options={"init_state_id": 0, "render": render_every is not None})
    t0 = time.perf_counter()
    for i, a in enumerate(actions):
        _, _, term, trunc, _ = env.step(a, render=render_every is not None and (i + 1) % render_every == 0)
        if term or trunc:
            env.reset(options={"init_state_id": 0, "render": False})
    return len(actions) / (time.perf_counter() - t0)


def runner_steps_per_s(task_id: int, workers: int, episodes: int, steps: int, resolution: int,
                       fast_render: bool = False) -> float:
    """Env steps/s of ``episodes`` do-nothing episodes through ``workers`` subprocess workers (images at decisions)."""
    spec = make_env_spec("metaworld", task_id=task_id, resolution=resolution, max_steps=steps, fast_render=fast_render)
    with RolloutRunner(spec, None, RunnerConfig(num_envs=workers, replan_steps=5)) as runner:
        runner.run([(task_id, 0)], group_size=workers, policy=ZeroChunkPolicy())  # warm-up: workers started
        t0 = time.perf_counter()
        eps = runner.run([(task_id, i) for i in range(episodes)], group_size=1, policy=ZeroChunkPolicy())
        return sum(e.length for e in eps) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task_id", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--resolution", type=int, default=224)
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--fast_render", action="store_true", help="the runner's workers render without shadows")
    args = p.parse_args()
    env = make_env_spec("metaworld", task_id=args.task_id, resolution=args.resolution, max_steps=args.steps,
                        fast_render=False)().unwrapped
    fast = make_env_spec("metaworld", task_id=args.task_id, resolution=args.resolution,
                         max_steps=args.steps)().unwrapped
    actions = np.clip(np.random.default_rng(0).normal(0, 0.5, (args.steps, 7)), -1, 1)
    try:
        time_steps(env, actions[:5], 1)  # warm-up (GL context)
        time_steps(fast, actions[:5], 1)
        physics = time_steps(env, actions, None)
        decision = time_steps(env, actions, 5)
        every = time_steps(env, actions, 1)
        fast_every = time_steps(fast, actions, 1)
    finally:
        env.close()
        fast.close()
    one = runner_steps_per_s(args.task_id, 1, args.episodes, args.steps, args.resolution, args.fast_render)
    two = runner_steps_per_s(args.task_id, 2, args.episodes, args.steps, args.resolution, args.fast_render)
    print(f"MetaWorld {env.task_name}, {args.resolution} px, 2 cameras; load average {os.getloadavg()}")
    print(f"no rendering:                  {physics:7.1f} steps/s")
    print(f"render every 5 steps:          {decision:7.1f} steps/s")
    print(f"render every step:             {every:7.1f} steps/s   (decision points {decision / every:.2f}x faster)")
    print(f"render every step, fast_render: {fast_every:6.1f} steps/s   ({fast_every / every:.2f}x)")
    print(f"runner ({'fast_render' if args.fast_render else 'full render'}), steps of do-nothing episodes:")
    print(f"runner, 1 subprocess worker:   {one:7.1f} steps/s")
    print(f"runner, 2 subprocess workers:  {two:7.1f} steps/s   ({two / one:.2f}x)")


if __name__ == "__main__":
    main()
