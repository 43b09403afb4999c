"""Env-steps/s of the rollout engine: serial in-process loop vs 1..N subprocess workers.

Workload: chunked control like the real policy loop: a decision (and, with render-on-demand, a
render of both cameras) every ``--chunk`` steps, random actions, reset on episode end. No model.

Modes (``--mode``):
* ``raw``: the vector env directly: every worker gets a whole chunk per round trip.
* ``runner``: the real engine path: ``RolloutRunner`` episodes with ONE batched policy call per
  round (``RandomChunkPolicy``; ``--infer_ms`` / ``--infer_ms_per_sample`` emulate inference time).
* ``both`` (default): raw and runner.
* ``io``: an I/O-bound env (``arena-remote-v0``: the arena behind a simulated network API, ``--latency_ms``
  per reset/step) through ``RolloutRunner`` on every backend: in-process serial (the baseline), thread,
  asyncio (native ``astep`` coroutines) and subprocess workers, ``--workers``' largest count of envs each.

``--envs_per_worker M`` (default 1) hosts M envs in each worker process (``SubprocVecEnv``'s
coalesced mode: one batched message + one batched reply per process per round) in both modes;
``--workers`` then counts processes, the vector env has ``workers * M`` envs, ``--steps`` is per
env (raw) and ``--episodes_per_worker`` is per env (runner).

Also reported: serial steps/s with a render on EVERY step (the "incl. rendering" number), speed-up
ratios vs the serial loop, RSS of each worker and of this process.

Examples::

    .venv/bin/python bench/parallel_rollouts.py                       # arena, workers 1,2,4
    .venv/bin/python bench/parallel_rollouts.py --env libero --workers 1,2 --steps 300
    .venv/bin/python bench/parallel_rollouts.py --mode raw --workers 1,2 --envs_per_worker 8
    .venv/bin/python bench/parallel_rollouts.py --mode io --workers 8 --latency_ms 5
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np
import psutil

from pi0.rollout import EnvSpec, LatencyPolicy, RandomChunkPolicy, RolloutRunner, RunnerConfig, SubprocVecEnv

MB = 1 << 20


def env_spec(args: argparse.Namespace) -> EnvSpec:
    """EnvSpec of the benchmarked env."""
    if args.env == "arena":
        return EnvSpec("arena-v0", {"task_id": args.task_id, "render_on_demand": True, "resolution": args.resolution})
    return EnvSpec("libero-spatial-v0", {"task_id": args.task_id, "render_on_demand": True,
                                         "resolution": args.resolution})


def random_chunk(rng: np.random.Generator, n: int, scale: float) -> np.ndarray:
    """``(n, 7)`` random actions: small position/rotation deltas, random gripper."""
    a = rng.uniform(-scale, scale, size=(n, 7))
    a[:, 6] = np.sign(rng.uniform(-1, 1, size=n))
    return a


def bench_serial(spec: EnvSpec, steps: int, chunk: int, scale: float, render_every_step: bool) -> float:
    """Steps/s of one in-process env (render at decision points, or every step)."""
    env = spec.replace(render_on_demand=not render_every_step)()
    try:
        base = env.unwrapped
        rng = np.random.default_rng(0)
        base.reset(options={"init_state_id": 0})
        done_steps, episodes = 0, 0
        t0 = time.perf_counter()
        while done_steps < steps:
            for k, a in enumerate(random_chunk(rng, chunk, scale)):
                _, _, term, trunc, _ = base.step(a, render=k == chunk - 1) if not render_every_step else base.step(a)
                done_steps += 1
                if term or trunc:
                    episodes += 1
                    base.reset(options={"init_state_id": episodes % base.num_init_states})
                    break
        dt = time.perf_counter() - t0
    finally:
        env.close()
    return done_steps / dt


def bench_raw(spec: EnvSpec, workers: int, steps_per_worker: int, chunk: int, scale: float,
              timeout: float, envs_per_worker: int = 1) -> dict[str, Any]:
    """Steps/s of ``workers`` subprocess workers (``envs_per_worker`` envs each) driven chunk-by-chunk.

    One round = one chunk (or, after an episode end, one reset) per active env; with one env per
    worker that is one round trip per chunk, with more the commands of one worker are coalesced.
    """
    rng = np.random.default_rng(0)
    n_env = workers * envs_per_worker
    t_start = time.perf_counter()
    with SubprocVecEnv(spec, n_env, step_timeout=timeout, envs_per_worker=envs_per_worker) as vec:
        startup = time.perf_counter() - t_start
        for i in range(n_env):
            vec.reset_async(i, init_state_id=i % 50)
        for i in range(n_env):
            vec.recv(i)
        counts = [0] * n_env
        episodes = [0] * n_env
        needs_reset = [False] * n_env
        env_time = 0.0
        msgs0 = vec.num_messages_sent
        t0 = time.perf_counter()
        active = list(range(n_env))
        rounds = 0
        while active:
            rounds += 1
            for i in active:
                if needs_reset[i]:
                    vec.reset_async(i, init_state_id=(i + n_env * episodes[i]) % 50)
                else:
                    vec.chunk_async(i, random_chunk(rng, chunk, scale), render="decision")
            nxt = []
            for i in active:
                rep = vec.recv(i)
                if needs_reset[i]:
                    needs_reset[i] = False
                else:
                    counts[i] += rep["n"]
                    env_time += rep["env_time"]
                    if rep["terminated"] or rep["truncated"]:
                        episodes[i] += 1
                        needs_reset[i] = True
                if counts[i] < steps_per_worker:
                    nxt.append(i)
            active = nxt
        dt = time.perf_counter() - t0
        rss = vec.worker_rss(per_process=True)
        msgs = vec.num_messages_sent - msgs0
    return {"steps_per_s": sum(counts) / dt, "startup_s": startup, "rss": rss, "env_busy": env_time / (dt * workers),
            "msgs_per_round": msgs / max(1, rounds)}


def bench_runner(spec: EnvSpec, workers: int, episodes: int, chunk: int, args: argparse.Namespace,
                 subprocess: bool = True) -> dict[str, Any]:
    """Steps/s of the real engine path (RolloutRunner + one batched policy call per round)."""
    policy = LatencyPolicy(RandomChunkPolicy(horizon=chunk, seed=0, low=-args.scale, high=args.scale),
                           base_s=args.infer_ms / 1e3, per_sample_s=args.infer_ms_per_sample / 1e3)
    inits = [(args.task_id, k % 50) for k in range(episodes)]
    m = args.envs_per_worker if subprocess else 1
    run_cfg = RunnerConfig(num_envs=workers * m, envs_per_worker=m, replan_steps=chunk, use_subprocess=subprocess,
                           step_timeout=args.timeout, max_steps=args.max_steps)
    with RolloutRunner(spec, policy, run_cfg) as runner:
        _ = runner.vec_env  # start the workers outside the timed region
        t0 = time.perf_counter()
        eps = runner.run(inits)
        dt = time.perf_counter() - t0
        rss = runner.vec_env.worker_rss(per_process=True) if subprocess else []
        st = runner.last_stats
    return {"steps_per_s": sum(e.length for e in eps) / dt, "rss": rss, "batch": st.mean_batch_size,
            "policy_s": st.policy_time, "wall_s": dt}


def bench_io(num_envs: int, args: argparse.Namespace) -> None:
    """Runner steps/s on the simulated remote arena, per backend, with speed-ups vs the serial backend."""
    spec = EnvSpec("arena-remote-v0", {"task_id": args.task_id, "render_on_demand": True,
                                       "resolution": args.resolution, "latency_s": args.latency_ms / 1e3})
    backends = {"serial": RunnerConfig(use_subprocess=False, in_process="serial"),
                "thread": RunnerConfig(use_subprocess=False, in_process="thread"),
                "asyncio": RunnerConfig(use_subprocess=False, in_process="asyncio"),
                "subprocess": RunnerConfig(use_subprocess=True)}
    inits = [(args.task_id, k % 50) for k in range(args.episodes_per_worker * num_envs)]
    policy = RandomChunkPolicy(horizon=args.chunk, seed=0, low=-args.scale, high=args.scale)
    print(f"\nI/O-bound env ({args.latency_ms} ms per call), RolloutRunner, {num_envs} envs, {len(inits)} episodes:")
    print(f"{'backend':>10} {'steps/s':>10} {'speed-up':>9} {'wall s':>8}")
    base = None
    for name, cfg in backends.items():
        cfg = cfg.replace(num_envs=num_envs, replan_steps=args.chunk, max_steps=args.max_steps,
                          step_timeout=args.timeout)
        with RolloutRunner(spec, policy, cfg) as runner:
            _ = runner.vec_env  # start the envs outside the timed region
            t0 = time.perf_counter()
            eps = runner.run(inits)
            dt = time.perf_counter() - t0
        rate = sum(e.length for e in eps) / dt
        base = base or rate
        print(f"{name:>10} {rate:>10.0f} {rate / base:>8.2f}x {dt:>8.2f}")


def main() -> None:
    """Parse arguments, run the benchmarks, print a table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", choices=("arena", "libero"), default="arena")
    p.add_argument("--workers", default="1,2,4", help="comma-separated worker counts")
    p.add_argument("--steps", type=int, default=6000, help="env steps per worker (raw mode) and for serial")
    p.add_argument("--chunk", type=int, default=5, help="actions per decision (replan_steps)")
    p.add_argument("--resolution", type=int, default=128)
    p.add_argument("--task_id", type=int, default=0)
    p.add_argument("--scale", type=float, default=1.0, help="random action magnitude")
    p.add_argument("--mode", choices=("raw", "runner", "both", "io"), default="both")
    p.add_argument("--latency_ms", type=float, default=5.0, help="io mode: emulated round trip per env call")
    p.add_argument("--episodes_per_worker", type=int, default=20, help="runner mode")
    p.add_argument("--max_steps", type=int, default=None, help="runner mode step cap per episode")
    p.add_argument("--infer_ms", type=float, default=0.0, help="emulated inference time per policy call")
    p.add_argument("--infer_ms_per_sample", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--envs_per_worker", type=int, default=1,
                   help="envs hosted by each worker process (coalesced messages); raw and runner modes")
    args = p.parse_args()
    if args.env == "libero" and args.scale == 1.0:
        args.scale = 0.3
    spec = env_spec(args)
    workers = [int(w) for w in args.workers.split(",")]
    me = psutil.Process()
    m = args.envs_per_worker
    if args.mode == "io":
        bench_io(max(workers), args)
        return
    print(f"env={spec.id} kwargs={spec.kwargs} chunk={args.chunk} envs_per_worker={m} cpus={os.cpu_count()} "
          f"affinity={len(me.cpu_affinity()) if hasattr(me, 'cpu_affinity') else '?'}")

    serial_every = bench_serial(spec, args.steps, args.chunk, args.scale, render_every_step=True)
    serial = bench_serial(spec, args.steps, args.chunk, args.scale, render_every_step=False)
    print(f"serial in-process, render every step     : {serial_every:10.0f} steps/s")
    print(f"serial in-process, render at decisions   : {serial:10.0f} steps/s   (baseline for speed-ups)")

    if args.mode in ("raw", "both"):
        print(f"\nraw vector env (one round trip per chunk{'' if m == 1 else f' per {m} envs'}):")
        print(f"{'workers':>8} {'envs':>5} {'steps/s':>10} {'speed-up':>9} {'env busy':>9} {'startup s':>10} "
              f"{'msgs/round':>10} {'worker RSS MB':>22}")
        for n in workers:
            r = bench_raw(spec, n, args.steps, args.chunk, args.scale, args.timeout, m)
            rss = ", ".join(f"{x / MB:.0f}" for x in r["rss"])
            print(f"{n:>8} {n * m:>5} {r['steps_per_s']:>10.0f} {r['steps_per_s'] / serial:>8.2f}x "
                  f"{r['env_busy']:>8.0%} {r['startup_s']:>10.2f} {r['msgs_per_round']:>10.2f} {rss:>22}")

    if args.mode in ("runner", "both"):
        print(f"\nRolloutRunner (batched policy calls; infer {args.infer_ms} ms + {args.infer_ms_per_sample} ms/sample):")
        print(f"{'workers':>8} {'envs':>5} {'steps/s':>10} {'speed-up':>9} {'mean batch':>11} {'policy s':>9} "
              f"{'worker RSS MB':>22}")
        r = bench_runner(spec, 1, args.episodes_per_worker, args.chunk, args, subprocess=False)
        print(f"{'serial':>8} {1:>5} {r['steps_per_s']:>10.0f} {r['steps_per_s'] / serial:>8.2f}x {r['batch']:>11.1f} "
              f"{r['policy_s']:>9.2f} {'(in-process)':>22}")
        for n in workers:
            r = bench_runner(spec, n, args.episodes_per_worker * n * m, args.chunk, args)
            rss = ", ".join(f"{x / MB:.0f}" for x in r["rss"])
            print(f"{n:>8} {n * m:>5} {r['steps_per_s']:>10.0f} {r['steps_per_s'] / serial:>8.2f}x "
                  f"{r['batch']:>11.1f} {r['policy_s']:>9.2f} {rss:>22}")
    print(f"\nmain process RSS: {me.memory_info().rss / MB:.0f} MB")


if __name__ == "__main__":
    main()
