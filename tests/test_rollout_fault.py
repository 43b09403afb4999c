"""Vector env + runner core: equivalence, batching, and crash recovery with real signals.

Workers are real ``spawn`` processes; faults are real SIGKILL / SIGSTOP signals.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import random
import resource
import signal
from pathlib import Path

import numpy as np
import psutil
import pytest

from conftest import assert_same_episodes
from pi0.envs.arena import ArenaEnv, ArenaExpert
from pi0.rollout import (
    ArenaExpertPolicy,
    EnvCreationError,
    EnvSpec,
    LatencyPolicy,
    RemoteEnvError,
    PolicyOutput,
    RandomChunkPolicy,
    RolloutError,
    RolloutRunner,
    RunnerConfig,
    RunnerHooks,
    StartupDeath,
    SubprocVecEnv,
    WorkerDied,
    WorkerTimeout,
    check_env_factory,
    make_env_with_retry,
)
from pi0.envs import CAMERA_KEYS as IMAGE_KEYS
from pi0.rollout.subproc_vec_env import exit_description, fault_summary

pytestmark = pytest.mark.timeout(120)

ARENA = EnvSpec("arena-v0", {"render_on_demand": True, "resolution": 64})
INITS = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (0, 6)]


# ------------------------------------------------------------------------ picklable factories
class FlakyFactory:
    """Fails the first ``failures`` creations (counted in a file, across processes)."""

    def __init__(self, path: str, failures: int) -> None:
        self.path, self.failures = path, failures

    def __call__(self, **overrides):
        with open(self.path, "a") as f:
            f.write("x")
        if os.path.getsize(self.path) <= self.failures:
            raise ConnectionError("simulated flaky env server")
        return ARENA(**overrides)


class CrashingFactory:
    """Arena factory whose next ``n`` env creations die by a real SIGKILL; ``n`` is read from a file (0 if absent).

    The main process writes the file when it wants the next (re)started workers to die during start-up.
    """

    def __init__(self, path: str, sig: int = signal.SIGKILL) -> None:
        self.path = path
        self.sig = sig

    def __call__(self, **overrides):
        try:
            n = int(Path(self.path).read_text() or 0)
        except FileNotFoundError:
            n = 0
        if n > 0:
            Path(self.path).write_text(str(n - 1))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a SIGABRT writes no core file
            os.kill(os.getpid(), self.sig)  # dies in the middle of the worker's start-up
        return ARENA(**overrides)


def make_arena_with(policy=None, **overrides):
    """A factory function that (wrongly) takes a policy."""
    return ARENA(**overrides)


# ------------------------------------------------------------------------------------ helpers
def is_reaped(pid: int) -> bool:
    """True if ``pid`` is no longer a (zombie) child of this process."""
    if pid in {c.pid for c in psutil.Process().children(recursive=True)}:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@functools.lru_cache(maxsize=None)
def reference_run(group_size: int = 2) -> tuple:
    """Crash-free in-process run of INITS x group_size with the deterministic expert."""
    with RolloutRunner(ARENA, ArenaExpertPolicy(horizon=8), RunnerConfig(num_envs=3, use_subprocess=False)) as r:
        return tuple(r.run(INITS, group_size=group_size))


def check_exactly_once(episodes, inits, group_size):
    keys = [e.key for e in episodes]
    expected = [(t, s, k) for t, s in inits for k in range(group_size)]
    assert keys == expected  # every requested episode, once, in request order
    assert [e.index for e in episodes] == list(range(len(expected)))


# ------------------------------------------------------------------------------ vec env tests
def test_vec_env_matches_in_process_env_and_workers_stay_light():
    with SubprocVecEnv(ARENA, 2, step_timeout=30) as vec:
        pids = vec.worker_pids()
        assert len(set(pids)) == 2 and os.getpid() not in pids
        expert = ArenaExpert()
        for i, (task, init) in enumerate([(1, 3), (2, 5)]):
            local = ArenaEnv(task_id=task, render_on_demand=True, resolution=64)
            lo, _ = local.reset(options={"init_state_id": init})
            rep = vec.reset(i, task_id=task, init_state_id=init)
            assert rep["prompt"] == local.prompt
            for k in IMAGE_KEYS:
                np.testing.assert_array_equal(rep["obs"][k], lo[k])
            chunk = expert.predict_chunk(local.get_state(), 6)
            for a in chunk:
                lo, *_ = local.step(a)
            rep = vec.chunk(i, chunk, render="decision")
            assert rep["n"] == 6 and rep["rewards"].shape == (6,)
            full = local.get_observation(render=True)
            assert set(rep["obs"]) == set(full)
            for k in full:
                np.testing.assert_array_equal(rep["obs"][k], full[k])
            rep = vec.chunk(i, expert.predict_chunk(local.get_state(), 3), render="none")
            assert not any(k in rep["obs"] for k in IMAGE_KEYS)  # no render off decision points
        info = vec.worker_info(0)
        assert info["torch_imported"] is False  # the model never enters a worker
        rss = vec.worker_rss()
        assert all(0 < r < 1 << 30 for r in rss)


def test_env_factory_check_rejects_policy_and_torch():
    import torch

    assert check_env_factory(ARENA) > 0
    with pytest.raises(ValueError, match="policy"):
        check_env_factory(functools.partial(make_arena_with, policy=ArenaExpertPolicy()))
    with pytest.raises(ValueError, match="torch"):
        check_env_factory(functools.partial(make_arena_with, policy=torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="torch"):
        check_env_factory(EnvSpec("arena-v0", {"weights": torch.zeros(3)}))
    with pytest.raises(ValueError, match="picklable"):
        check_env_factory(lambda **kw: ARENA(**kw))
    with pytest.raises(ValueError):
        SubprocVecEnv(functools.partial(make_arena_with, policy=ArenaExpertPolicy()), 1)


def test_eof_detection_of_killed_worker_and_respawn():
    with SubprocVecEnv(ARENA, 2, step_timeout=30) as vec:
        old = vec.worker_pids()[0]
        vec.reset(0, task_id=0, init_state_id=0)
        os.kill(old, signal.SIGKILL)
        with pytest.raises(WorkerDied) as err:  # EOF/broken pipe, not the 30 s timeout
            vec.chunk_async(0, np.zeros((5, 7)))
            vec.recv(0)
        assert err.value.index == 0 and err.value.pid == old
        assert not vec.is_alive(0)
        with pytest.raises(WorkerDied):
            vec.chunk_async(0, np.zeros((1, 7)))  # broken until respawned
        assert vec.reset(1, task_id=0, init_state_id=0)["obs"] is not None  # the other worker is fine
        vec.respawn(0)
        assert vec.worker_pids()[0] != old and is_reaped(old)
        a = vec.reset(0, task_id=3, init_state_id=2)
        b = vec.reset(1, task_id=3, init_state_id=2)
        np.testing.assert_array_equal(a["obs"]["arena_state"], b["obs"]["arena_state"])


def test_step_timeout_detects_hung_worker():
    with SubprocVecEnv(ARENA, 1, step_timeout=1.0) as vec:
        old = vec.worker_pids()[0]
        vec.reset(0, task_id=0, init_state_id=0)
        os.kill(old, signal.SIGSTOP)
        try:
            vec.chunk_async(0, np.zeros((5, 7)))
            with pytest.raises(WorkerTimeout) as err:
                vec.recv(0)
            assert err.value.pid == old
        finally:
            vec.respawn(0)  # SIGKILL works on a stopped process; it is reaped
        assert is_reaped(old) and vec.worker_pids()[0] != old
        with pytest.raises(RemoteEnvError, match="reset"):  # fresh env: an env error, not a crash
            vec.chunk(0, np.zeros((2, 7)))
        assert vec.is_alive(0)
        vec.reset(0, task_id=0, init_state_id=0)
        assert vec.chunk(0, np.zeros((2, 7)), render="none")["n"] == 2


def test_a_worker_that_aborts_mid_run_is_reported_with_its_signal_and_python_frame():
    """A native abort while serving (SIGABRT) fails its env with the signal and where the worker's Python was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, hard))  # the worker inherits it: its abort writes no core file
    try:
        vec = SubprocVecEnv(ARENA, 1, step_timeout=30)
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))
    with vec:
        old = vec.worker_pids()[0]
        vec.reset(0, task_id=0, init_state_id=0)
        vec.kill(0, signal.SIGABRT)
        with pytest.raises(WorkerDied, match=r"killed by SIGABRT\).*; Fatal Python error: Aborted at File "
                                             r"\".+\", line \d+ in \w+"):
            vec.chunk_async(0, np.zeros((5, 7)))
            vec.recv(0)
        vec.respawn(0)
        assert vec.worker_pids()[0] != old and vec.reset(0, task_id=0, init_state_id=0)["obs"] is not None


def test_a_worker_that_aborts_during_its_first_start_is_started_again(tmp_path: Path, caplog):
    """A worker process that dies in native code while building its env (SIGABRT, as a LIBERO worker once did in CI)
    is started again, up to make_attempts processes, and the error after the last one names the signal."""
    flag = tmp_path / "crash_next"
    flag.write_text("2")
    caplog.set_level(logging.WARNING, logger="pi0.rollout.subproc_vec_env")
    with SubprocVecEnv(CrashingFactory(str(flag), signal.SIGABRT), 1, make_attempts=3, make_backoff=0.01) as vec:
        assert vec.num_startup_restarts == 2 and vec.num_respawns == 0
        assert vec.reset(0, task_id=1, init_state_id=0)["prompt"]
    assert flag.read_text() == "0"
    assert sum("died during start-up (killed by SIGABRT); Fatal Python error: Aborted at File" in m
               and "test_rollout_fault.py" in m and "in __call__" in m for m in caplog.messages) == 2
    flag.write_text("3")
    before = {c.pid for c in psutil.Process().children()}
    with pytest.raises(StartupDeath, match=r"killed by SIGABRT\); Fatal Python error: Aborted at File .+; "
                                           r"3 processes in all died during start-up"):
        SubprocVecEnv(CrashingFactory(str(flag), signal.SIGABRT), 1, make_attempts=3, make_backoff=0.01)
    assert flag.read_text() == "0"
    assert {c.pid for c in psutil.Process().children()} <= before  # every dead worker was reaped
    with pytest.raises(EnvCreationError, match="flaky"):  # a Python error is retried in the worker, not here
        SubprocVecEnv(FlakyFactory(str(tmp_path / "f"), failures=5), 1, make_attempts=2, make_backoff=0.01)


def test_fault_summary_keeps_the_error_and_the_innermost_frame():
    dump = ('Fatal Python error: Aborted\n\nCurrent thread 0x00007f3a (most recent call first):\n'
            '  File "/x/egl.py", line 12 in init\n  File "/x/env.py", line 40 in __init__\n\n'
            'Extension modules: numpy.core._multiarray_umath (total: 1)\n')
    assert fault_summary(dump) == 'Fatal Python error: Aborted at File "/x/egl.py", line 12 in init'
    assert fault_summary("") == ""
    assert fault_summary("Fatal Python error: Segmentation fault\n") == "Fatal Python error: Segmentation fault"


def test_exit_description_names_the_signal():
    assert exit_description(-6) == "killed by SIGABRT" and exit_description(-9) == "killed by SIGKILL"
    assert exit_description(1) == "exit code 1" and exit_description(None) == "still running"
    assert exit_description(-200) == "killed by signal 200"


def test_env_creation_retry_with_backoff(tmp_path: Path):
    attempts = tmp_path / "attempts"
    with SubprocVecEnv(FlakyFactory(str(attempts), failures=2), 1, make_attempts=3, make_backoff=0.01) as vec:
        assert attempts.stat().st_size == 3
        assert vec.reset(0, task_id=1, init_state_id=0)["prompt"]
    attempts.unlink()
    before = {c.pid for c in psutil.Process().children()}
    with pytest.raises(EnvCreationError, match="flaky"):
        SubprocVecEnv(FlakyFactory(str(attempts), failures=5), 1, make_attempts=2, make_backoff=0.01)
    assert attempts.stat().st_size == 2
    assert {c.pid for c in psutil.Process().children()} <= before  # nothing left behind
    delays: list[float] = []
    with pytest.raises(EnvCreationError):
        make_env_with_retry(FlakyFactory(str(tmp_path / "b"), 9), attempts=5, backoff=0.5, backoff_max=3.0,
                            sleep=delays.append)
    assert delays == [0.5, 1.0, 2.0, 3.0]


def test_recreate_every_n_episodes():
    with RolloutRunner(ARENA, ArenaExpertPolicy(), RunnerConfig(num_envs=1, recreate_every=2)) as r:
        eps = r.run([(4, k) for k in range(5)])
        assert all(e.success for e in eps)
        assert r.vec_env.worker_info(0)["num_makes"] == 3  # episodes 1-2, 3-4, 5


def test_close_is_idempotent_and_leaves_no_zombies():
    vec = SubprocVecEnv(ARENA, 2)
    pids = vec.worker_pids()
    vec.close()
    vec.close()
    assert vec.closed and all(is_reaped(p) for p in pids)
    with pytest.raises(RuntimeError):
        vec.reset(0)
    r = RolloutRunner(ARENA, ArenaExpertPolicy(), RunnerConfig(num_envs=2))
    r.run([(0, 0)])
    pids = r.vec_env.worker_pids()
    r.close()
    r.close()
    assert all(is_reaped(p) for p in pids)


# ------------------------------------------------------------------------------- runner tests
def test_runner_subprocess_equals_serial_and_step_mode():
    ref = list(reference_run())
    assert all(e.success for e in ref)
    with RolloutRunner(ARENA, ArenaExpertPolicy(horizon=8), RunnerConfig(num_envs=3)) as r:
        sub = r.run(INITS, group_size=2)
        assert r.last_stats.env_steps == sum(e.length for e in sub)
    assert_same_episodes(sub, ref)
    run_cfg = RunnerConfig(num_envs=2, remote_chunks=False, use_subprocess=False)
    with RolloutRunner(ARENA, ArenaExpertPolicy(horizon=8), run_cfg) as r:
        step_mode = r.run(INITS, group_size=2)
    assert_same_episodes(step_mode, ref)


class RecordingPolicy:
    """Expert that records each batch's size and the step counters of its observations."""

    def __init__(self) -> None:
        self.inner = ArenaExpertPolicy(horizon=8)
        self.calls: list[list[tuple[int, int, int]]] = []

    def predict_chunks(self, obs, prompts) -> PolicyOutput:
        assert all(all(k in o for k in IMAGE_KEYS) for o in obs)  # rendered at decision points
        # (task, init_state, steps) of each observation, from the privileged state vector
        self.calls.append([(int(o["arena_state"][0]), int(o["arena_state"][1]), int(o["arena_state"][-1]))
                           for o in obs])
        return self.inner.predict_chunks(obs, prompts)


def test_runner_batches_active_envs_only_and_records_decisions():
    inits = [(4, 0), (1, 1), (2, 2), (3, 3)]  # four episodes of different lengths
    pol = RecordingPolicy()
    run_cfg = RunnerConfig(num_envs=4, replan_steps=5, record_video=True, use_subprocess=False)
    with RolloutRunner(ARENA, pol, run_cfg) as r:
        eps = r.run(inits)
    lengths = [e.length for e in eps]
    assert len(set(lengths)) > 1 and all(e.success for e in eps)
    # round j batches exactly the episodes still running at step 5 j, and no finished one
    expected = [sorted((t, s, 5 * j) for (t, s), n in zip(inits, lengths) if n > 5 * j)
                for j in range(-(-max(lengths) // 5))]
    assert [sorted(c) for c in pol.calls] == expected
    assert r.last_stats.batch_sizes == [len(c) for c in expected]
    for e in eps:
        d = len(e.decisions)
        assert d == -(-e.length // 5)
        assert [x.step for x in e.decisions] == [5 * j for j in range(d)]
        st = e.stacked()
        assert st["actions"].shape == (d, 5, 7) and st["valid"].shape == (d, 5)
        assert st["valid"].sum() == e.length
        assert st["valid"][:-1].all()
        assert not st["actions"][-1][~st["valid"][-1]].any()  # zero padding after the end
        assert st["extras"]["state"].shape[0] == d and st["obs"]["agentview_image"].shape == (d, 64, 64, 3)
        assert e.executed_actions().shape == (e.length, 7)
        assert e.total_reward == 1.0 and e.terminated and not e.truncated
        assert len(e.frames) == d + 1 and e.frames[0].shape == (64, 64, 3)
        np.testing.assert_array_equal(e.frames[0], e.decisions[0].obs["agentview_image"][::-1, ::-1])


def test_runner_step_cap_and_truncation():
    run_cfg = RunnerConfig(num_envs=2, replan_steps=5, max_steps=11, use_subprocess=False, store_images=False)
    with RolloutRunner(ARENA, RandomChunkPolicy(horizon=4, seed=0), run_cfg) as r:
        eps = r.run([(0, 0), (1, 0), (2, 0)])
    for e in eps:
        assert all(not any(k in d.obs for k in IMAGE_KEYS) and "robot0_eef_pos" in d.obs for d in e.decisions)
        if not e.success:
            assert e.length == 11 and e.truncated
            assert [d.num_executed for d in e.decisions] == [4, 4, 3]  # H=4 < replan_steps=5
            assert "noise" in e.decisions[0].extras


def test_grouped_runner_keeps_groups_together():
    from pi0.rollout import libero_runner_config, ript_vla_runner_config
    from pi0.ript.env.pi0_libero_runner import LIBEROEnvRunner
    from pi0.ript.env.pi0_libero_runner_ript_vla import PI0LiberoRunner

    cfg = ript_vla_runner_config(num_groups=2, group_size=2, use_subprocess=False)
    r = PI0LiberoRunner(EnvSpec("arena-v0", {"resolution": 64}), ArenaExpertPolicy(horizon=8), cfg)
    assert isinstance(r, PI0LiberoRunner) and r.config.schedule == "grouped" and r.num_groups == 2
    assert r.config.num_envs == 4 and r.config.group_size == 2
    with r:
        eps = r.run(INITS)
    check_exactly_once(eps, INITS, 2)
    for e in eps:  # member k of a group runs on worker (block * K + k)
        assert e.worker_index % 2 == e.sample_index
    for g in range(len(INITS)):
        a, b = eps[2 * g], eps[2 * g + 1]
        assert a.worker_index // 2 == b.worker_index // 2 and a.length == b.length
    assert_same_episodes(eps, list(reference_run()))
    r2 = LIBEROEnvRunner(EnvSpec("arena-v0", {"resolution": 64}), None, libero_runner_config(use_subprocess=False))
    assert type(r2) is LIBEROEnvRunner and r2.config.schedule == "greedy"
    # thin configurations: no loop code of their own
    assert PI0LiberoRunner.run is RolloutRunner.run and LIBEROEnvRunner.run_requests is RolloutRunner.run_requests
    assert LIBEROEnvRunner().env_factory.id == "libero-spatial-v0"  # lazy: nothing is started


# ------------------------------------------------------------------------- crash recovery
def test_sigkill_mid_episode_reruns_interrupted_episodes():
    kill_at = {(0, 2), (1, 5), (2, 9)}  # (worker, n-th chunk sent to that worker)
    sent = [0, 0, 0]
    killed: list[int] = []
    interrupted: list[tuple[int, int, int]] = []

    def on_chunk_sent(runner, worker, req, step):
        sent[worker] += 1
        if (worker, sent[worker]) in kill_at:  # the worker is mid-episode (it just got a chunk)
            pid = runner.vec_env.worker_pids()[worker]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            interrupted.append(req.key)

    failures = []
    hooks = RunnerHooks(on_chunk_sent=on_chunk_sent,
                        on_worker_failure=lambda r, w, req, exc: failures.append((w, req.key if req else None, exc)))
    run_cfg = RunnerConfig(num_envs=3, step_timeout=30, max_episode_attempts=5)
    with RolloutRunner(ARENA, ArenaExpertPolicy(horizon=8), run_cfg, hooks=hooks) as r:
        eps = r.run(INITS, group_size=2)
        assert r.vec_env.num_respawns == 3 and r.last_stats.worker_failures == 3
        assert not set(killed) & set(r.vec_env.worker_pids())
    assert len(killed) == 3 and all(isinstance(f[2], WorkerDied) for f in failures)
    assert all(is_reaped(p) for p in killed)
    check_exactly_once(eps, INITS, 2)
    assert sum(e.attempts - 1 for e in eps) == 3  # each kill interrupted exactly one episode, re-run
    # (a kill can land after the worker already answered the chunk that ended its episode: then that
    # episode is complete and kept, and the worker's next episode is the interrupted one)
    assert_same_episodes(eps, list(reference_run()))  # re-runs are exact (deterministic expert)


def test_sigkills_at_seeded_random_points_of_a_long_run():
    """Three real SIGKILLs of randomly chosen workers at seeded random points of a 40-episode run.

    The kills are injected from the ``on_chunk_sent`` hook (after the n-th chunk of the run), so they
    always happen, whatever the machine's speed; the victim is any live worker: one that just got a
    chunk, one in the middle of a reset, or one that already answered.
    """
    inits = [(t, s) for s in range(4) for t in range(5)]
    rng = random.Random(0)
    kill_at = set(rng.sample(range(3, 100), 3))  # n-th chunk sent in the whole run
    sent = [0]
    kills: list[int] = []

    def on_chunk_sent(runner, worker, req, step):
        sent[0] += 1
        if sent[0] in kill_at:
            pid = rng.choice([p for p in runner.vec_env.worker_pids() if p not in kills])
            os.kill(pid, signal.SIGKILL)
            kills.append(pid)

    run_cfg = RunnerConfig(num_envs=3, step_timeout=30, max_episode_attempts=5)
    with RolloutRunner(ARENA, ArenaExpertPolicy(horizon=8), run_cfg,
                       hooks=RunnerHooks(on_chunk_sent=on_chunk_sent)) as r:
        eps = r.run(inits, group_size=2)
        failures = r.last_stats.worker_failures
        assert r.vec_env.num_respawns == failures
    print(f"\nkills at chunks {sorted(kill_at)} of {sent[0]}: {len(kills)}, detected failures: {failures}")
    assert sent[0] > max(kill_at) and len(kills) == 3  # every planned kill happened mid-run
    assert failures == len(kills)  # each killed worker is used again, found dead and respawned
    assert all(is_reaped(p) for p in kills)
    check_exactly_once(eps, inits, 2)
    run_cfg = RunnerConfig(num_envs=3, use_subprocess=False)
    with RolloutRunner(ARENA, ArenaExpertPolicy(horizon=8), run_cfg) as ref_runner:
        ref = ref_runner.run(inits, group_size=2)
    assert_same_episodes(eps, ref)


def test_worker_dying_while_being_respawned_is_respawned_again(tmp_path: Path, caplog):
    flag = tmp_path / "crash_next"  # the next N env creations die during start-up
    sent = [0]
    killed: list[int] = []
    failures = []

    def on_chunk_sent(runner, worker, req, step):
        sent[0] += 1
        if sent[0] == 4:
            killed.append(runner.vec_env.worker_pids()[worker])
            os.kill(killed[-1], signal.SIGKILL)

    def on_worker_failure(runner, worker, req, exc):
        failures.append(exc)
        flag.write_text("2")  # the replacement worker dies during start-up, and the one after it too

    hooks = RunnerHooks(on_chunk_sent=on_chunk_sent, on_worker_failure=on_worker_failure)
    caplog.set_level(logging.WARNING, logger="pi0.rollout.runner")
    run_cfg = RunnerConfig(num_envs=3, step_timeout=30, make_attempts=3, make_backoff=0.01, max_episode_attempts=5)
    with RolloutRunner(CrashingFactory(str(flag)), ArenaExpertPolicy(horizon=8), run_cfg, hooks=hooks) as r:
        eps = r.run(INITS, group_size=2)
        pids = r.vec_env.worker_pids()
        assert r.vec_env.num_respawns == 3  # two replacements died during start-up, the third came up
        assert r.last_stats.worker_failures == 1 and r.last_stats.respawn_failures == 2
        assert all(r.vec_env.is_alive(i) for i in range(3))
    assert flag.read_text() == "0"
    assert len(failures) == 1 and isinstance(failures[0], WorkerDied)
    assert sum("died during start-up" in m for m in caplog.messages) == 2
    assert is_reaped(killed[0]) and killed[0] not in pids
    check_exactly_once(eps, INITS, 2)
    assert sum(e.attempts - 1 for e in eps) == 1
    assert_same_episodes(eps, list(reference_run()))


def test_respawn_gives_up_with_rollout_error_after_make_attempts(tmp_path: Path):
    flag = tmp_path / "crash_next"

    def on_chunk_sent(runner, worker, req, step):
        if not flag.exists():
            flag.write_text("3")  # more start-up deaths than make_attempts=2 allows
            os.kill(runner.vec_env.worker_pids()[worker], signal.SIGKILL)

    run_cfg = RunnerConfig(num_envs=2, step_timeout=30, make_attempts=2, make_backoff=0.01)
    with RolloutRunner(CrashingFactory(str(flag)), ArenaExpertPolicy(horizon=8), run_cfg,
                       hooks=RunnerHooks(on_chunk_sent=on_chunk_sent)) as r:
        with pytest.raises(RolloutError, match="could not be respawned after 2 attempts") as err:
            r.run(INITS)
        assert isinstance(err.value.__cause__, EnvCreationError)
        assert "died during start-up" in str(err.value)
        # the failed run's clean-up tried the broken worker once more (the third start-up death) ...
        assert flag.read_text() == "0"
        # ... and the runner is still usable: the broken worker is respawned on first use
        eps = r.run([(4, 0), (2, 1), (1, 2)])
        assert r.last_stats.worker_failures == 1
    check_exactly_once(eps, [(4, 0), (2, 1), (1, 2)], 1)
    assert all(e.success for e in eps)


def test_latency_policy_pickles_and_delegates():
    pol = LatencyPolicy(ArenaExpertPolicy(horizon=4), base_s=0.0)
    assert pol.horizon == 4  # delegated to the wrapped policy
    clone = pickle.loads(pickle.dumps(pol))  # unpickling looks attributes up before __init__ state exists
    assert clone.horizon == 4 and clone.base_s == 0.0
    bare = LatencyPolicy.__new__(LatencyPolicy)  # no ``policy`` attribute yet: no infinite recursion
    with pytest.raises(AttributeError, match="policy"):
        bare.horizon
    with pytest.raises(AttributeError):
        bare.__deepcopy__


def test_sigstop_hang_is_detected_by_step_timeout_and_recovered():
    state = {"n": 0, "pid": None}

    def on_chunk_sent(runner, worker, req, step):
        state["n"] += 1
        if state["n"] == 5:
            state["pid"] = runner.vec_env.worker_pids()[worker]
            os.kill(state["pid"], signal.SIGSTOP)

    failures = []
    hooks = RunnerHooks(on_chunk_sent=on_chunk_sent,
                        on_worker_failure=lambda r, w, req, exc: failures.append(exc))
    run_cfg = RunnerConfig(num_envs=2, step_timeout=1.5)
    with RolloutRunner(ARENA, ArenaExpertPolicy(horizon=8), run_cfg, hooks=hooks) as r:
        eps = r.run(INITS, group_size=2)
    assert len(failures) == 1 and isinstance(failures[0], WorkerTimeout)
    assert is_reaped(state["pid"])
    check_exactly_once(eps, INITS, 2)
    assert sum(e.attempts - 1 for e in eps) == 1
    assert_same_episodes(eps, list(reference_run()))


def test_env_exception_is_retried_then_gives_up():
    class ExplodingPolicy:
        """Sends NaN-shaped garbage: a wrong action shape makes the env raise inside the worker."""

        def predict_chunks(self, obs, prompts):
            return PolicyOutput(actions=np.zeros((len(obs), 5, 3)))

    from pi0.rollout import RolloutError

    failures = []
    hooks = RunnerHooks(on_worker_failure=lambda r, w, req, exc: failures.append(exc))
    run_cfg = RunnerConfig(num_envs=1, max_episode_attempts=2, use_subprocess=False)
    with RolloutRunner(ARENA, ExplodingPolicy(), run_cfg, hooks=hooks) as r:
        with pytest.raises(RolloutError):
            r.run([(0, 0)])
        assert len(failures) == 2 and all(isinstance(f, RemoteEnvError) for f in failures)
        assert "arena actions are (7,)" in failures[0].remote_traceback
        # the runner is still usable afterwards
        ok = r.run([(4, 0)], policy=ArenaExpertPolicy())
        assert ok[0].success


def test_video_frames_every_step_and_step_mode():
    for kwargs, expect in [({"video_every_step": True}, "steps"), ({"remote_chunks": False}, "decisions")]:
        run_cfg = RunnerConfig(num_envs=2, record_video=True, use_subprocess=False, **kwargs)
        with RolloutRunner(ARENA, ArenaExpertPolicy(horizon=8), run_cfg) as r:
            eps = r.run([(4, 0), (2, 1)])
        for e in eps:
            n = e.length + 1 if expect == "steps" else len(e.decisions) + 1
            assert len(e.frames) == n  # initial frame + one per step / per decision + final
            assert all(f.shape == (64, 64, 3) and f.dtype == np.uint8 for f in e.frames)


@pytest.mark.libero
@pytest.mark.slow
def test_libero_runner_on_the_real_simulator():
    import libero.libero  # noqa: F401  (`make test` installs LIBERO: a missing simulator fails, never skips)
    from pi0.ript.env.pi0_libero_runner import LIBEROEnvRunner, libero_env_spec

    spec = libero_env_spec("libero_spatial", task_id=0, resolution=64)
    pol = RandomChunkPolicy(horizon=6, seed=0, low=-0.2, high=0.2)
    with LIBEROEnvRunner(spec, pol, num_envs=1, max_steps=7, start_timeout=300) as r:
        eps = r.run([(0, 0), (0, 3)])
        info = r.vec_env.worker_info(0)
    assert info["torch_imported"] is False and info["render_on_demand"] is True and info["num_makes"] == 1
    for e in eps:
        assert e.length == 7 and e.truncated and not e.success
        assert [d.num_executed for d in e.decisions] == [5, 2]
        for d in e.decisions:  # images only at decision points, as LIBERO renders them (upside down)
            assert d.obs["agentview_image"].shape == (64, 64, 3)
            assert d.obs["robot0_eef_pos"].shape == (3,)
    assert eps[0].prompt and eps[0].prompt == eps[1].prompt  # the task's language instruction
