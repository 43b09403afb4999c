"""Thread / asyncio backends of the runner for I/O-bound envs (simulated network latency): the same Episode
records and RunStats as the serial backend, real overlap of env calls, the concurrency cap, failures named."""

from __future__ import annotations

import asyncio
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from pi0.rollout import PolicyOutput, RemoteEnvError, RolloutError, RolloutRunner, RunnerConfig, RunnerHooks

pytestmark = pytest.mark.timeout(60)

LATENCY = 0.01
NUM_ENVS = 4
EPISODES = 2
_INTERVALS: list[tuple[float, float]] = []  # (start, end) perf_counter of every env step, all envs
_LOCK = threading.Lock()


class LatencyEnv(gym.Env):
    """Task ``i`` lasts ``3 + i`` steps; obs t = step count; reward = action * (i + 1); each call waits LATENCY."""

    supports_task_switch = True

    def __init__(self, task_id: int = 0, latency: float = LATENCY, fail_task: int | None = None) -> None:
        self.task_id, self.latency, self.fail_task = task_id, latency, fail_task
        self.observation_space = spaces.Dict({"t": spaces.Box(0, 100, (1,), np.int64)})
        self.action_space = spaces.Box(0.0, 10.0, (1,))
        self.t = 0

    def _reset(self, options):
        self.task_id = int((options or {}).get("task_id", self.task_id))
        self.t = 0
        return {"t": np.array([self.t])}, {}

    def reset(self, *, seed=None, options=None):
        time.sleep(self.latency)  # a round trip to the "server"
        return self._reset(options)

    def _advance(self, action):
        self.t += 1
        if self.task_id == self.fail_task and self.t == 2:
            raise ConnectionError(f"task {self.task_id} lost its server")
        done = self.t >= 3 + self.task_id
        info = {"success": done and self.task_id % 2 == 0} if done else {}
        return {"t": np.array([self.t])}, float(action[0]) * (self.task_id + 1), done, False, info

    def step(self, action):
        s = time.perf_counter()
        time.sleep(self.latency)
        out = self._advance(action)
        with _LOCK:
            _INTERVALS.append((s, time.perf_counter()))
        return out


class AsyncLatencyEnv(LatencyEnv):
    """Same env with native coroutine methods (asyncio.sleep instead of blocking)."""

    async def areset(self, *, seed=None, options=None):
        await asyncio.sleep(self.latency)
        return self._reset(options)

    async def astep(self, action):
        s = time.perf_counter()
        await asyncio.sleep(self.latency)
        out = self._advance(action)
        with _LOCK:
            _INTERVALS.append((s, time.perf_counter()))
        return out


class AlternatingPolicy:
    """Deterministic chunks: action 1 on even steps, 2 on odd steps (from the observed step count)."""

    def __init__(self, horizon: int = 2) -> None:
        self.horizon = horizon

    def predict_chunks(self, obs, prompts):
        t = np.array([int(o["t"][0]) for o in obs])
        steps = t[:, None] + np.arange(self.horizon)[None]
        return PolicyOutput(actions=(1.0 + steps % 2)[:, :, None].astype(np.float64))


def max_concurrency(intervals: list[tuple[float, float]]) -> int:
    """Largest number of intervals in progress at the same instant (sweep; an end at t sorts before a start at t)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda ev: (ev[0], ev[1]))
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def run_backend(backend: str, env_cls=LatencyEnv, num_envs: int = NUM_ENVS, **cfg):
    """Run EPISODES episodes of each task 0..3 on ``backend``; returns (episodes, stats, max concurrent steps)."""
    _INTERVALS.clear()
    config = RunnerConfig(num_envs=num_envs, replan_steps=2, use_subprocess=False, in_process=backend, **cfg)
    with RolloutRunner(lambda **kw: env_cls(**kw), AlternatingPolicy(), config) as r:
        eps = r.run([(i, 0) for i in range(NUM_ENVS)], group_size=EPISODES)
        return eps, r.last_stats, max_concurrency(list(_INTERVALS))


# Hand-computed: task i runs L = 3 + i steps with actions 1, 2, 1, 2, ... so its return is
# (i + 1) * (sum of the first L terms of 1, 2, 1, 2, ...): L=3 -> 4, L=4 -> 6, L=5 -> 7, L=6 -> 9.
HAND_RETURNS = {0: 1 * 4, 1: 2 * 6, 2: 3 * 7, 3: 4 * 9}  # = 4, 12, 21, 36
HAND_LENGTHS = {0: 3, 1: 4, 2: 5, 3: 6}


def check_results(eps, stats):
    assert [(e.task_id, e.sample_index) for e in eps] == [(i, k) for i in range(NUM_ENVS) for k in range(EPISODES)]
    for e in eps:
        assert e.total_reward == HAND_RETURNS[e.task_id] and e.length == HAND_LENGTHS[e.task_id]
        assert e.terminated and not e.truncated and e.success == (e.task_id % 2 == 0)
        assert e.executed_actions()[:, 0].tolist() == [1.0 + t % 2 for t in range(e.length)]
    assert stats.num_episodes == NUM_ENVS * EPISODES
    assert stats.mean_return == pytest.approx((4 + 12 + 21 + 36) / 4)  # 18.25
    rets = [4, 12, 21, 36]
    assert stats.std_return == pytest.approx(np.sqrt(sum((x - 18.25) ** 2 for x in rets) / 4))  # population std
    assert stats.mean_length == pytest.approx(4.5)
    assert stats.env_steps == EPISODES * (3 + 4 + 5 + 6)  # 36
    assert stats.success_rate == pytest.approx(0.5)


def test_backends_agree_with_hand_computed_stats_and_overlap():
    walls, conc = {}, {}
    runs = {"serial": ("serial", LatencyEnv), "thread": ("thread", LatencyEnv),
            "asyncio-native": ("asyncio", AsyncLatencyEnv), "asyncio-to_thread": ("asyncio", LatencyEnv)}
    for name, (backend, env_cls) in runs.items():
        eps, stats, conc[name] = run_backend(backend, env_cls)
        check_results(eps, stats)
        walls[name] = stats.wall_time
    # Steps of different envs overlap in time for the concurrent backends (from recorded intervals,
    # not from wall-clock speed), and never for the serial one.
    assert conc["serial"] == 1
    assert conc["thread"] >= 2 and conc["asyncio-native"] >= 2 and conc["asyncio-to_thread"] >= 2
    print("\nmax concurrent steps:", conc)
    print("speed-up vs serial:", {k: round(walls["serial"] / v, 2) for k, v in walls.items()})


def test_concurrency_is_capped_by_num_envs():
    for backend, env_cls in (("thread", LatencyEnv), ("asyncio", AsyncLatencyEnv)):
        eps, stats, conc = run_backend(backend, env_cls, num_envs=2)
        assert 1 <= conc <= 2
        check_results(eps, stats)


def test_step_cap():
    eps, stats, _ = run_backend("asyncio", AsyncLatencyEnv, max_steps=3)
    assert [e.length for e in eps] == [3] * 8
    assert [e.truncated for e in eps][::2] == [False, True, True, True]  # task 0 ends at exactly 3 steps
    assert stats.env_steps == 24 and stats.mean_return == pytest.approx(4 * (1 + 2 + 3 + 4) / 4)


def test_max_concurrency_sweep_is_exact():
    assert max_concurrency([(0, 1), (1, 2), (2, 3)]) == 1  # touching is not overlapping
    assert max_concurrency([(0, 2), (1, 3), (1.5, 1.6)]) == 3
    assert max_concurrency([]) == 0


@pytest.mark.parametrize("backend", ["serial", "thread", "asyncio"])
def test_env_failure_names_the_env(backend):
    failures = []
    hooks = RunnerHooks(on_worker_failure=lambda r, w, req, exc: failures.append((w, req.task_id, exc)))
    config = RunnerConfig(num_envs=3, use_subprocess=False, in_process=backend, max_episode_attempts=1)
    with RolloutRunner(lambda **kw: LatencyEnv(latency=0.001, fail_task=1, **kw), AlternatingPolicy(), config,
                       hooks=hooks) as r:
        with pytest.raises(RolloutError) as err:
            r.run([(0, 0), (1, 0), (2, 0)])
    (worker, task, exc), = failures
    assert task == 1 and isinstance(exc, RemoteEnvError) and exc.index == worker
    assert "ConnectionError" in exc.remote_traceback and err.value.__cause__ is exc
