"""Thread / asyncio executors for I/O-bound envs (simulated network latency) and the stats collector."""

from __future__ import annotations

import asyncio
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from pi0.rollout.executors import (
    AsyncExecutor,
    ExecutorError,
    RolloutCollector,
    SerialExecutor,
    ThreadExecutor,
    compute_stats,
    max_concurrency,
)

pytestmark = pytest.mark.timeout(60)

LATENCY = 0.01
NUM_ENVS = 4
EPISODES = 2


class LatencyEnv(gym.Env):
    """Env ``i`` lasts ``3 + i`` steps; obs = step count; reward = action * (i + 1); each call waits LATENCY."""

    def __init__(self, env_id: int, latency: float = LATENCY, fail_at: int | None = None) -> None:
        self.env_id, self.latency, self.fail_at = env_id, latency, fail_at
        self.episode_len = 3 + env_id
        self.observation_space = spaces.Discrete(100)
        self.action_space = spaces.Box(0.0, 10.0, ())
        self.t = 0

    def reset(self, *, seed=None, options=None):
        time.sleep(self.latency)  # a round trip to the "server"
        self.t = 0
        return self.t, {}

    def _advance(self, action):
        self.t += 1
        if self.fail_at is not None and self.t == self.fail_at:
            raise ConnectionError(f"env {self.env_id} lost its server")
        done = self.t >= self.episode_len
        info = {"success": done and self.env_id % 2 == 0} if done else {}
        return self.t, float(action) * (self.env_id + 1), done, False, info

    def step(self, action):
        time.sleep(self.latency)
        return self._advance(action)


class AsyncLatencyEnv(LatencyEnv):
    """Same env with native coroutine methods (asyncio.sleep instead of blocking)."""

    async def areset(self, *, seed=None, options=None):
        await asyncio.sleep(self.latency)
        self.t = 0
        return self.t, {}

    async def astep(self, action):
        await asyncio.sleep(self.latency)
        return self._advance(action)


def policy(obs, env_index):
    """Deterministic: action 1 on even steps, 2 on odd steps."""
    return 1.0 + obs % 2


def env_fns(cls=LatencyEnv, **kw):
    return [lambda i=i: cls(i, **kw) for i in range(NUM_ENVS)]


# Hand-computed: env i runs L = 3 + i steps with actions 1, 2, 1, 2, ... so its return is
# (i + 1) * (sum of the first L terms of 1, 2, 1, 2, ...): L=3 -> 4, L=4 -> 6, L=5 -> 7, L=6 -> 9.
HAND_RETURNS = {0: 1 * 4, 1: 2 * 6, 2: 3 * 7, 3: 4 * 9}  # = 4, 12, 21, 36
HAND_LENGTHS = {0: 3, 1: 4, 2: 5, 3: 6}


def check_results(rollouts, stats):
    assert [(r.env_index, r.episode_index) for r in rollouts] == [(i, e) for i in range(NUM_ENVS) for e in range(EPISODES)]
    for r in rollouts:
        assert r.total_return == HAND_RETURNS[r.env_index] and r.length == HAND_LENGTHS[r.env_index]
        assert r.terminated and not r.truncated and r.success == (r.env_index % 2 == 0)
        assert r.actions == [1.0 + t % 2 for t in range(r.length)]
    assert stats.num_episodes == NUM_ENVS * EPISODES
    assert stats.mean_return == pytest.approx((4 + 12 + 21 + 36) / 4)  # 18.25
    rets = [4, 12, 21, 36]
    assert stats.std_return == pytest.approx(np.sqrt(sum((x - 18.25) ** 2 for x in rets) / 4))  # population std
    assert stats.mean_length == pytest.approx(4.5)
    assert stats.total_steps == EPISODES * (3 + 4 + 5 + 6)  # 36
    assert stats.success_rate == pytest.approx(0.5)
    assert set(stats.per_env) == set(range(NUM_ENVS))
    for i, es in stats.per_env.items():
        assert (es.num_episodes, es.mean_return, es.std_return, es.mean_length, es.total_steps) == \
               (EPISODES, HAND_RETURNS[i], 0.0, HAND_LENGTHS[i], EPISODES * HAND_LENGTHS[i])
        assert es.success_rate == (1.0 if i % 2 == 0 else 0.0)


def test_executors_agree_with_hand_computed_stats_and_overlap():
    walls = {}
    conc = {}
    runs = {
        "serial": (SerialExecutor(), env_fns()),
        "thread": (ThreadExecutor(), env_fns()),
        "async-native": (AsyncExecutor(), env_fns(AsyncLatencyEnv)),
        "async-to_thread": (AsyncExecutor(), env_fns()),
    }
    for name, (executor, fns) in runs.items():
        rollouts, stats = RolloutCollector(executor).collect(fns, policy, episodes_per_env=EPISODES)
        check_results(rollouts, stats)
        walls[name] = stats.wall_time
        conc[name] = max_concurrency(rollouts)
    # Steps of different envs overlap in time for the concurrent executors (from recorded intervals,
    # not from wall-clock speed), and never for the serial one.
    assert conc["serial"] == 1
    assert conc["thread"] >= 2 and conc["async-native"] >= 2 and conc["async-to_thread"] >= 2
    print("\nmax concurrent steps:", conc)
    print("speed-up vs serial:", {k: round(walls["serial"] / v, 2) for k, v in walls.items()})


def test_concurrency_caps_are_respected():
    rollouts = ThreadExecutor(max_workers=2).run(env_fns(), policy, EPISODES)
    assert 1 <= max_concurrency(rollouts) <= 2
    rollouts = AsyncExecutor(max_concurrency=2).run(env_fns(AsyncLatencyEnv), policy, EPISODES)
    assert 1 <= max_concurrency(rollouts) <= 2
    check_results(rollouts, compute_stats(rollouts))


def test_async_policy_and_step_cap():
    async def apolicy(obs, env_index):
        await asyncio.sleep(0)
        return policy(obs, env_index)

    rollouts = AsyncExecutor().run(env_fns(AsyncLatencyEnv), apolicy, episodes_per_env=1, max_steps=3)
    assert [r.length for r in rollouts] == [3, 3, 3, 3]
    assert [r.truncated for r in rollouts] == [False, True, True, True]  # env 0 ends at exactly 3 steps
    stats = compute_stats(rollouts)
    assert stats.total_steps == 12 and stats.mean_return == pytest.approx(4 * (1 + 2 + 3 + 4) / 4)


def test_max_concurrency_sweep_is_exact():
    from pi0.rollout.executors import Rollout

    def ro(i, times):
        return Rollout(i, 0, [0.0] * len(times), [None] * len(times), True, False, None, step_times=times)

    assert max_concurrency([ro(0, [(0, 1), (1, 2)]), ro(1, [(2, 3)])]) == 1  # touching is not overlapping
    assert max_concurrency([ro(0, [(0, 2)]), ro(1, [(1, 3)]), ro(2, [(1.5, 1.6)])]) == 3
    assert max_concurrency([]) == 0


@pytest.mark.parametrize("executor", [SerialExecutor(), ThreadExecutor(), AsyncExecutor()],
                         ids=["serial", "thread", "async"])
def test_env_failure_names_the_env(executor):
    fns = [lambda i=i: LatencyEnv(i, latency=0.001, fail_at=2 if i == 1 else None) for i in range(3)]
    with pytest.raises(ExecutorError) as err:
        executor.run(fns, policy, episodes_per_env=1)
    assert err.value.env_index == 1 and isinstance(err.value.__cause__, ConnectionError)
