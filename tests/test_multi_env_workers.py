"""Multi-env workers (``envs_per_worker > 1``): coalesced messages, exact results, crash semantics.

Workers are real ``spawn`` processes; faults are real SIGKILL signals injected from the runner's
``on_chunk_sent`` hook.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from conftest import assert_same_episodes
from pi0.rollout import (
    ArenaExpertPolicy,
    EnvSpec,
    RolloutRunner,
    RunnerConfig,
    RunnerHooks,
    SubprocVecEnv,
    WorkerDied,
    WorkerError,
    WorkerTimeout,
)

pytestmark = pytest.mark.timeout(120)

ARENA = EnvSpec("arena-v0", {"render_on_demand": True, "resolution": 64})
INITS = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (0, 6), (1, 7), (2, 8)]


def reference(group_size: int = 1) -> list:
    with RolloutRunner(ARENA, ArenaExpertPolicy(horizon=8), RunnerConfig(num_envs=4, use_subprocess=False)) as r:
        return r.run(INITS, group_size=group_size)


def test_multi_env_workers_equal_serial_run_and_coalesce_messages():
    run_cfg = RunnerConfig(num_envs=4, envs_per_worker=2, step_timeout=30)
    with RolloutRunner(ARENA, ArenaExpertPolicy(horizon=8), run_cfg) as r:
        vec = r.vec_env
        assert vec.num_envs == 4 and vec.num_workers == 2
        pids = vec.worker_pids()
        assert pids[0] == pids[1] != pids[2] == pids[3]
        assert len(vec.worker_rss()) == 4 and len(vec.worker_rss(per_process=True)) == 2
        eps = r.run(INITS, group_size=2)
        assert vec.num_respawns == 0 and r.last_stats.worker_failures == 0
        # the first two groups start together, each over both processes (envs are offered process by process)
        for g in (0, 1):
            assert sorted(e.worker_index // 2 for e in eps if e.group_index == g) == [0, 1]
        # (c) raw API: one message and one reply per process per round, whatever the number of envs
        for i in range(4):
            vec.reset_async(i, task_id=i, init_state_id=i)
        sent, got = vec.num_messages_sent, vec.num_replies_received
        assert vec.pending(0) == 1 and vec.num_messages_sent == sent  # buffered, not sent yet
        resets = [vec.recv(i) for i in range(4)]
        assert vec.num_messages_sent == sent + 2 and vec.num_replies_received == got + 2
        for rnd in range(3):
            for i in range(4):
                vec.chunk_async(i, np.zeros((3, 7)), render="none")
            reps = [vec.recv(i) for i in range(4)]
            assert all(rep["n"] == 3 for rep in reps)
            assert vec.num_messages_sent == sent + 2 * (rnd + 2) and vec.num_replies_received == got + 2 * (rnd + 2)
        assert [rep["task_id"] for rep in resets] == [0, 1, 2, 3]  # task switch per env inside one process
        # out-of-order recv within a process: the stored reply, no extra round trip
        vec.chunk_async(0, np.zeros((1, 7)), render="none")
        vec.chunk_async(1, np.zeros((2, 7)), render="none")
        assert vec.recv(1)["n"] == 2 and vec.recv(0)["n"] == 1
        assert vec.wait([0, 1, 2, 3], timeout=0) == []
        assert vec.worker_info(3)["torch_imported"] is False
    assert_same_episodes(eps, reference(2))
    assert {e.worker_index for e in eps} == {0, 1, 2, 3}


def test_sigkill_of_a_multi_env_process_fails_and_reruns_all_its_envs():
    sent = [0]
    current: dict[int, tuple] = {}  # env -> key of the episode it runs (last chunk sent)
    victims: list[tuple] = []
    killed: list[int] = []
    failures = []

    def on_chunk_sent(runner, worker, req, step):
        sent[0] += 1
        current[worker] = req.key
        if worker == 0 and step > 0 and not killed:  # env 0's 2nd chunk: envs 0 and 1 (process 0) mid-episode
            victims.extend([current[0], current[1]])
            killed.append(runner.vec_env.worker_pids()[0])
            os.kill(killed[0], signal.SIGKILL)

    hooks = RunnerHooks(on_chunk_sent=on_chunk_sent,
                        on_worker_failure=lambda r, w, req, exc: failures.append((w, req.key if req else None, exc)))
    run_cfg = RunnerConfig(num_envs=4, envs_per_worker=2, step_timeout=30, max_episode_attempts=3)
    with RolloutRunner(ARENA, ArenaExpertPolicy(horizon=8), run_cfg, hooks=hooks) as r:
        eps = r.run(INITS)
        vec = r.vec_env
        assert vec.num_respawns == 1  # the process of envs 0 and 1 was restarted ONCE
        assert killed[0] not in vec.worker_pids() and all(vec.is_alive(i) for i in range(4))
    assert len(killed) == 1
    assert sorted(w for w, _, _ in failures) == [0, 1] and all(isinstance(f[2], WorkerDied) for f in failures)
    assert {k for _, k, _ in failures} == set(victims)
    assert [e.key for e in eps] == [(t, s, 0) for t, s in INITS]  # every episode once, in request order
    by_key = {e.key: e for e in eps}
    assert len(set(victims)) == 2 and all(by_key[k].attempts == 2 for k in victims)  # both envs' episodes re-run
    assert sum(e.attempts - 1 for e in eps) == 2
    assert_same_episodes(eps, reference())


def test_env_of_a_failed_process_that_was_not_in_flight_must_be_reset():
    with SubprocVecEnv(ARENA, 4, envs_per_worker=2, step_timeout=30) as vec:
        for i in range(4):
            vec.reset_async(i, task_id=1, init_state_id=0)
        for i in range(4):
            vec.recv(i)
        old = vec.worker_pids()[2]
        os.kill(old, signal.SIGKILL)
        vec.chunk_async(2, np.zeros((2, 7)), render="none")  # env 3 (same process) is idle, "waiting for the policy"
        with pytest.raises(WorkerDied):
            vec.recv(2)
        with pytest.raises(WorkerError):
            vec.chunk_async(3, np.zeros((2, 7)))
        with pytest.raises(WorkerError):
            vec.recv(3)
        assert vec.reset(0, task_id=2, init_state_id=1)["obs"] is not None  # process 0 is unaffected
        vec.respawn(2, overrides={"task_id": 3})
        assert vec.num_respawns == 1 and vec.worker_pids()[2] == vec.worker_pids()[3] != old
        assert not vec.is_alive(3)
        with pytest.raises(WorkerDied):  # fresh process, but env 3's episode state is gone
            vec.chunk_async(3, np.zeros((2, 7)))
        vec.respawn(3, overrides={"task_id": 4})  # already restarted: no second restart
        assert vec.num_respawns == 1 and vec.is_alive(3)
        a = vec.reset(2, task_id=3, init_state_id=2)
        b = vec.reset(3, task_id=3, init_state_id=2)
        np.testing.assert_array_equal(a["obs"]["arena_state"], b["obs"]["arena_state"])
        # a reset alone also clears the flag (no respawn needed for an env that starts a new episode)
        os.kill(vec.worker_pids()[0], signal.SIGKILL)
        with pytest.raises(WorkerDied):
            vec.chunk(0, np.zeros((1, 7)))
        vec.respawn(0)
        assert vec.num_respawns == 2 and vec.reset(1, task_id=0, init_state_id=0)["task_id"] == 0
        assert vec.chunk(1, np.zeros((1, 7)), render="none")["n"] == 1


def test_hung_multi_env_process_times_out_all_in_flight_envs_once():
    with SubprocVecEnv(ARENA, 4, envs_per_worker=2, step_timeout=1.0) as vec:
        for i in range(4):
            vec.reset_async(i, task_id=0, init_state_id=i)
        for i in range(4):
            vec.recv(i)
        old = vec.worker_pids()[2]
        os.kill(old, signal.SIGSTOP)
        try:
            for i in range(4):
                vec.chunk_async(i, np.zeros((2, 7)), render="none")
            assert vec.recv(0)["n"] == 2 and vec.recv(1)["n"] == 2
            t0 = time.perf_counter()
            with pytest.raises(WorkerTimeout):
                vec.recv(2)
            with pytest.raises(WorkerTimeout):  # same process: fails at once, no second timeout
                vec.recv(3)
            assert time.perf_counter() - t0 < 3.0
        finally:
            vec.respawn(3)  # SIGKILL works on a stopped process
        vec.respawn(2)  # already restarted for env 3: no-op
        assert vec.num_respawns == 1 and vec.worker_pids()[2] != old
        assert all(vec.is_alive(i) for i in range(4))
        assert [vec.reset(i, task_id=1, init_state_id=0)["task_id"] for i in range(4)] == [1, 1, 1, 1]
