"""Executors for I/O-bound envs (remote / networked simulators) and a collector with statistics.

The subprocess vector env is the right tool for CPU-bound simulators. When an env mostly *waits*
(an HTTP/RPC env server, a remote simulator), threads or asyncio give the same concurrency without
processes. Three interchangeable executors run ``episodes_per_env`` episodes on each env:

* :class:`SerialExecutor` - one env after the other (baseline).
* :class:`ThreadExecutor` - one thread per env (``max_workers`` caps the pool); each env is built,
  stepped and closed in its own thread.
* :class:`AsyncExecutor` - one asyncio task per env; an env with coroutine methods
  ``areset(seed=..., options=...)`` / ``astep(action)`` is awaited directly, a plain gym env is
  run with ``asyncio.to_thread``. The policy may be a plain function or a coroutine function.

A policy here is ``policy(obs, env_index) -> action`` (per-env, cheap). Every step's start/end
``time.perf_counter()`` timestamps are recorded, so concurrency can be checked deterministically
(:func:`max_concurrency`). :class:`RolloutCollector` runs an executor and returns rollouts plus
:class:`RolloutStats` (mean/std return, mean length, total steps, success rate, per-env breakdown).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Sequence

import numpy as np

__all__ = [
    "AsyncExecutor",
    "EnvStats",
    "ExecutorError",
    "Rollout",
    "RolloutCollector",
    "RolloutStats",
    "SerialExecutor",
    "ThreadExecutor",
    "compute_stats",
    "max_concurrency",
]

PolicyFn = Callable[[Any, int], Any]  # (obs, env_index) -> action (or an awaitable for AsyncExecutor)
EnvFn = Callable[[], Any]  # builds one env


class ExecutorError(RuntimeError):
    """An env or the policy raised inside an executor; ``env_index`` says which env."""

    def __init__(self, message: str, env_index: int) -> None:
        super().__init__(message)
        self.env_index = env_index


@dataclass
class Rollout:
    """One episode: per-step rewards, actions and ``(start, end)`` perf_counter times of each step."""

    env_index: int
    episode_index: int
    rewards: list[float]
    actions: list[Any]
    terminated: bool
    truncated: bool
    success: bool | None
    step_times: list[tuple[float, float]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def length(self) -> int:
        """Number of env steps."""
        return len(self.rewards)

    @property
    def total_return(self) -> float:
        """Undiscounted sum of rewards."""
        return float(sum(self.rewards))


@dataclass
class EnvStats:
    """Statistics of the episodes of one env."""

    num_episodes: int
    mean_return: float
    std_return: float
    mean_length: float
    total_steps: int
    success_rate: float | None


@dataclass
class RolloutStats(EnvStats):
    """Statistics over all rollouts (std is the population std, ddof=0) plus a per-env breakdown."""

    wall_time: float
    per_env: dict[int, EnvStats]

    @property
    def steps_per_second(self) -> float:
        """Env steps per wall-clock second of the collection."""
        return self.total_steps / self.wall_time if self.wall_time > 0 else 0.0


def _summary(rollouts: Sequence[Rollout]) -> tuple[int, float, float, float, int, float | None]:
    """(n, mean return, std return, mean length, total steps, success rate) of ``rollouts``."""
    if not rollouts:
        return 0, 0.0, 0.0, 0.0, 0, None
    rets = np.array([r.total_return for r in rollouts], dtype=np.float64)
    lens = np.array([r.length for r in rollouts], dtype=np.float64)
    succ = [r.success for r in rollouts if r.success is not None]
    rate = float(np.mean(succ)) if succ else None
    return len(rollouts), float(rets.mean()), float(rets.std()), float(lens.mean()), int(lens.sum()), rate


def compute_stats(rollouts: Sequence[Rollout], wall_time: float = 0.0) -> RolloutStats:
    """Aggregate statistics and the per-env breakdown of ``rollouts``."""
    per_env: dict[int, EnvStats] = {}
    for idx in sorted({r.env_index for r in rollouts}):
        per_env[idx] = EnvStats(*_summary([r for r in rollouts if r.env_index == idx]))
    n, mr, sr, ml, ts, rate = _summary(rollouts)
    return RolloutStats(n, mr, sr, ml, ts, rate, wall_time, per_env)


def max_concurrency(rollouts: Sequence[Rollout]) -> int:
    """Largest number of env steps in progress at the same instant (sweep over recorded step intervals)."""
    events: list[tuple[float, int]] = []
    for r in rollouts:
        for s, e in r.step_times:
            events.append((s, 1))
            events.append((e, -1))
    events.sort(key=lambda ev: (ev[0], ev[1]))  # an end at time t sorts before a start at t
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def _seed_for(seed: int | None, env_index: int, episode: int) -> int | None:
    """Per-episode reset seed derived from a base seed (None stays None)."""
    return None if seed is None else int(seed) + 100_003 * env_index + episode


class _EpisodeLoop:
    """The episode loop of one env, written once and shared by every executor.

    The loop is a generator of *requests* that the executor fulfils in its own way (blocking
    calls, threads or awaits) and passes back with :meth:`reply`:
    ``("reset", seed)`` -> ``(obs, info)``; ``("act", obs)`` -> action; ``("step", action)`` ->
    ``(obs, reward, terminated, truncated, info)``. ``request`` is None once all episodes are done
    (or ``stop`` was set: the loop ends before its next policy call). Finished episodes are in ``out``.
    """

    def __init__(self, env_index: int, episodes: int, max_steps: int | None, seed: int | None,
                 stop: threading.Event | None = None) -> None:
        """Start the loop; ``request`` is its first request."""
        self.out: list[Rollout] = []
        self.request: tuple[str, Any] | None = None
        self._gen = self._episodes(env_index, episodes, max_steps, seed, stop)
        self.reply(None)

    def reply(self, value: Any) -> None:
        """Hand the result of ``request`` back to the loop; it moves on to its next request."""
        try:
            self.request = self._gen.send(value)
        except StopIteration:
            self.request = None

    def _episodes(self, env_index: int, episodes: int, max_steps: int | None, seed: int | None,
                  stop: threading.Event | None) -> Generator[tuple[str, Any], Any, None]:
        """Run ``episodes`` episodes (each capped at ``max_steps`` steps), recording every step."""
        for ep in range(episodes):
            obs, info = yield "reset", _seed_for(seed, env_index, ep)
            ro = Rollout(env_index, ep, [], [], False, False, None)
            while max_steps is None or ro.length < max_steps:
                if stop is not None and stop.is_set():
                    return
                action = yield "act", obs
                s = time.perf_counter()
                obs, r, term, trunc, info = yield "step", action
                ro.step_times.append((s, time.perf_counter()))
                ro.rewards.append(float(r))
                ro.actions.append(action)
                if term or trunc:
                    ro.terminated, ro.truncated = bool(term), bool(trunc)
                    break
            else:
                ro.truncated = True
            ro.info = dict(info or {})
            ro.success = ro.info.get("success")
            self.out.append(ro)


def _run_env_sync(env_fn: EnvFn, env_index: int, policy: PolicyFn, episodes: int, max_steps: int | None,
                  seed: int | None, stop: threading.Event | None = None) -> list[Rollout]:
    """Build one env, run ``episodes`` episodes with blocking calls, close it."""
    env = env_fn()

    def fulfil(kind: str, arg: Any) -> Any:
        """Blocking reset / policy / step."""
        if kind == "reset":
            return env.reset(seed=arg)
        if kind == "act":
            return policy(arg, env_index)
        return env.step(arg)

    loop = _EpisodeLoop(env_index, episodes, max_steps, seed, stop)
    try:
        while loop.request is not None:
            loop.reply(fulfil(*loop.request))
    finally:
        close = getattr(env, "close", None)
        if close is not None:
            close()
    return loop.out


def _sorted(rollouts: list[Rollout]) -> list[Rollout]:
    """Rollouts ordered by (env index, episode index)."""
    return sorted(rollouts, key=lambda r: (r.env_index, r.episode_index))


class SerialExecutor:
    """Runs the envs one after another in the calling thread."""

    def run(self, env_fns: Sequence[EnvFn], policy: PolicyFn, episodes_per_env: int = 1,
            max_steps: int | None = None, seed: int | None = None) -> list[Rollout]:
        """Rollouts of every env, ordered by (env index, episode index)."""
        out: list[Rollout] = []
        for i, fn in enumerate(env_fns):
            try:
                out.extend(_run_env_sync(fn, i, policy, episodes_per_env, max_steps, seed))
            except Exception as exc:  # noqa: BLE001 - re-raised with the env index
                raise ExecutorError(f"env {i} failed: {exc!r}", i) from exc
        return _sorted(out)


class ThreadExecutor:
    """One thread per env (at most ``max_workers`` at a time); for envs that block on I/O."""

    def __init__(self, max_workers: int | None = None) -> None:
        """``max_workers``: thread pool size (default: one thread per env)."""
        self.max_workers = max_workers

    def run(self, env_fns: Sequence[EnvFn], policy: PolicyFn, episodes_per_env: int = 1,
            max_steps: int | None = None, seed: int | None = None) -> list[Rollout]:
        """Rollouts of every env, ordered by (env index, episode index); the first failure is re-raised."""
        stop = threading.Event()
        out: list[Rollout] = []
        with ThreadPoolExecutor(max_workers=self.max_workers or max(1, len(env_fns)),
                                thread_name_prefix="rollout-env") as pool:
            futures = [pool.submit(_run_env_sync, fn, i, policy, episodes_per_env, max_steps, seed, stop)
                       for i, fn in enumerate(env_fns)]
            error: ExecutorError | None = None
            for i, fut in enumerate(futures):
                try:
                    out.extend(fut.result())
                except Exception as exc:  # noqa: BLE001
                    stop.set()  # the other envs stop at their next step
                    if error is None:
                        error = ExecutorError(f"env {i} failed: {exc!r}", i)
                        error.__cause__ = exc
        if error is not None:
            raise error
        return _sorted(out)


async def _maybe_await(value: Any) -> Any:
    """Await ``value`` if it is awaitable."""
    return await value if inspect.isawaitable(value) else value


class AsyncExecutor:
    """One asyncio task per env (at most ``max_concurrency`` stepping at once)."""

    def __init__(self, max_concurrency: int | None = None) -> None:
        """``max_concurrency``: cap on simultaneously running envs (default: no cap)."""
        self.max_concurrency = max_concurrency

    async def _run_env(self, env_fn: EnvFn, env_index: int, policy: PolicyFn, episodes: int,
                       max_steps: int | None, seed: int | None, sem: asyncio.Semaphore | None) -> list[Rollout]:
        """Run one env's episodes; awaits ``areset``/``astep`` if the env has them, else uses threads."""
        async def body() -> list[Rollout]:
            """Build the env, run its episodes, close it."""
            env = await _maybe_await(env_fn())
            native = inspect.iscoroutinefunction(getattr(env, "astep", None))

            async def fulfil(kind: str, arg: Any) -> Any:
                """Awaited reset / policy / step (native coroutines, else a thread)."""
                if kind == "reset":
                    return await (env.areset(seed=arg) if native else asyncio.to_thread(env.reset, seed=arg))
                if kind == "act":
                    return await _maybe_await(policy(arg, env_index))
                return await (env.astep(arg) if native else asyncio.to_thread(env.step, arg))

            loop = _EpisodeLoop(env_index, episodes, max_steps, seed)
            try:
                while loop.request is not None:
                    loop.reply(await fulfil(*loop.request))
            finally:
                aclose = getattr(env, "aclose", None)
                if inspect.iscoroutinefunction(aclose):
                    await aclose()
                elif getattr(env, "close", None) is not None:
                    env.close()
            return loop.out

        try:
            if sem is None:
                return await body()
            async with sem:
                return await body()
        except Exception as exc:  # noqa: BLE001 - re-raised with the env index
            raise ExecutorError(f"env {env_index} failed: {exc!r}", env_index) from exc

    async def arun(self, env_fns: Sequence[EnvFn], policy: PolicyFn, episodes_per_env: int = 1,
                   max_steps: int | None = None, seed: int | None = None) -> list[Rollout]:
        """Coroutine version of :meth:`run` (use inside a running event loop)."""
        sem = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else None
        results = await asyncio.gather(*(self._run_env(fn, i, policy, episodes_per_env, max_steps, seed, sem)
                                         for i, fn in enumerate(env_fns)))
        return _sorted([r for rs in results for r in rs])

    def run(self, env_fns: Sequence[EnvFn], policy: PolicyFn, episodes_per_env: int = 1,
            max_steps: int | None = None, seed: int | None = None) -> list[Rollout]:
        """Rollouts of every env, ordered by (env index, episode index) (starts its own event loop)."""
        return asyncio.run(self.arun(env_fns, policy, episodes_per_env, max_steps, seed))


class RolloutCollector:
    """Runs an executor and returns ``(rollouts, stats)``."""

    def __init__(self, executor: SerialExecutor | ThreadExecutor | AsyncExecutor | None = None) -> None:
        """``executor`` defaults to a :class:`ThreadExecutor`."""
        self.executor = executor or ThreadExecutor()

    def collect(self, env_fns: Sequence[EnvFn], policy: PolicyFn, episodes_per_env: int = 1,
                max_steps: int | None = None, seed: int | None = None) -> tuple[list[Rollout], RolloutStats]:
        """Run all episodes and compute their statistics (``wall_time`` covers the whole collection)."""
        t0 = time.perf_counter()
        rollouts = self.executor.run(env_fns, policy, episodes_per_env, max_steps, seed)
        return rollouts, compute_stats(rollouts, time.perf_counter() - t0)
