"""The rollout runner: THE rollout loop used for LIBERO and the arena (and by the RL code).

Loop (one iteration = one "round")
----------------------------------
1. Free workers get the next requested episode: ``reset(task_id, init_state_id)`` (workers are
   reused; more episodes than workers is the normal case).
2. The runner waits for the reply of every busy worker (reset or action chunk).
3. Every live episode whose action queue is empty is at a *decision point*: the observations of
   ALL such envs are batched into ONE ``policy.predict_chunks`` call. Each env keeps its own
   queue: the first ``replan_steps`` actions of its predicted chunk.
4. Each env gets its queued actions: the whole chunk in one message (``remote_chunks=True``,
   default) or one action per round (``remote_chunks=False``, same results). Images are
   rendered only at decision points (render-on-demand envs). Finished episodes (success is
   latched by the env; ``terminated``/``truncated``/step cap) get no more steps and are left out
   of the batch; no dummy actions are needed because the vec env API works on subsets.

Groups and scheduling
---------------------
``run(init_states, group_size=K)`` requests K rollouts of every ``(task_id, init_state_id)``
(RLOO-style groups). A scheduler (:mod:`pi0.rollout.scheduler`) decides which free worker runs
which episode: ``schedule="greedy"`` gives the next episode to any free worker (preferring a
worker whose env already has the episode's task); ``schedule="grouped"`` splits the workers into
``num_envs // K`` blocks of K and runs the K members of a group together on one block, so they
share their init state *and* their policy batches.

Backends
--------
The envs run in worker processes (``use_subprocess=True``, default), or in this process: one after
the other (``in_process="serial"``), on a thread per env (``in_process="thread"``) or as coroutines on
an event loop (``in_process="asyncio"``); the last two are for I/O-bound envs such as envs behind a
network API. Every backend returns the same
:class:`~pi0.rollout.types.Episode` records and :class:`~pi0.rollout.types.RunStats`.

Crash recovery
--------------
If a worker dies (EOF/broken pipe, e.g. SIGKILL), hangs (no reply within ``step_timeout``, e.g.
SIGSTOP) or its env raises, the worker is killed/reaped and respawned and the interrupted
episode is discarded and re-run from its init state (``Episode.attempts`` > 1). Finished
episodes are kept. Every requested episode is returned exactly once, ordered by request index.
An episode failing ``max_episode_attempts`` times raises :class:`RolloutError`. A respawned worker
that dies (or cannot build its env) during start-up is respawned again, up to the vec env's
``make_attempts`` times with exponential backoff (``make_backoff``, doubling, capped at
``make_backoff_max``); only then does the run stop with a :class:`RolloutError`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from pi0.envs.conventions import EnvSpec, upright
from pi0.rollout.config import RunnerConfig
from pi0.rollout.env_server import EnvFactory, call_with_backoff
from pi0.rollout.errors import WorkerError
from pi0.rollout.scheduler import Scheduler, make_requests, make_scheduler
from pi0.rollout.subproc_vec_env import SubprocVecEnv
from pi0.rollout.thread_vec_env import AsyncioVecEnv, ThreadVecEnv
from pi0.rollout.types import ChunkPolicy, DecisionPoint, Episode, EpisodeRequest, PolicyOutput, RunStats
from pi0.rollout.vec_env import SerialVecEnv, VecEnvBase

__all__ = ["RolloutError", "RolloutRunner", "RunStats", "RunnerConfig", "RunnerHooks", "make_requests",
           "make_vec_env"]

log = logging.getLogger(__name__)


class RolloutError(RuntimeError):
    """An episode could not be completed (it failed ``max_episode_attempts`` times)."""


@dataclass
class RunnerHooks:
    """Optional callbacks (all run in the main process; used by tests for fault injection)."""

    on_chunk_sent: Callable[["RolloutRunner", int, EpisodeRequest, int], None] | None = None  # (runner, worker, req, step)
    on_episode_end: Callable[["RolloutRunner", Episode], None] | None = None
    on_worker_failure: Callable[["RolloutRunner", int, EpisodeRequest | None, BaseException], None] | None = None


def make_vec_env(env_factory: EnvFactory, c: RunnerConfig) -> VecEnvBase:
    """The vector env of ``c.backend`` ("subprocess" | "serial" | "thread" | "asyncio"), settings from ``c``."""
    opts = dict(make_attempts=c.make_attempts, make_backoff=c.make_backoff, make_backoff_max=c.make_backoff_max,
                recreate_every=c.recreate_every)
    if c.backend == "subprocess":
        return SubprocVecEnv(env_factory, c.num_envs, step_timeout=c.step_timeout, start_timeout=c.start_timeout,
                             envs_per_worker=c.envs_per_worker, **opts)
    if c.backend in ("thread", "asyncio"):
        cls = ThreadVecEnv if c.backend == "thread" else AsyncioVecEnv
        return cls(env_factory, c.num_envs, step_timeout=c.step_timeout, **opts)
    return SerialVecEnv(env_factory, c.num_envs, **opts)


def _is_rank0() -> bool:
    """True unless the usual launcher env vars name a non-zero rank."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0) == 0


class _Slot:
    """The episode running on one worker: its action queue, its decisions, its record in the making."""

    __slots__ = ("request", "worker", "image_keys", "prompt", "obs", "t", "total_reward", "decisions", "frames",
                 "plan", "n_plan", "cursor", "in_flight", "needs_decision", "terminated", "truncated", "info")

    def __init__(self, request: EpisodeRequest, worker: int, image_keys: Sequence[str], record_video: bool) -> None:
        self.request = request
        self.worker = worker
        self.image_keys = tuple(image_keys)  # the env's own camera keys (first one: video)
        self.prompt = ""
        self.obs: dict[str, np.ndarray] | None = None
        self.t = 0
        self.total_reward = 0.0
        self.decisions: list[DecisionPoint] = []
        self.frames: list[np.ndarray] | None = [] if record_video else None
        self.plan: np.ndarray | None = None
        self.n_plan = 0
        self.cursor = 0
        self.in_flight = False
        self.needs_decision = False
        self.terminated = False
        self.truncated = False
        self.info: dict[str, Any] = {}

    def _add_frame(self, obs: dict[str, np.ndarray] | None) -> None:
        """Keep the upright first-camera image of ``obs`` as a video frame (if it has one)."""
        if self.frames is not None and obs is not None and self.image_keys and self.image_keys[0] in obs:
            self.frames.append(upright(obs[self.image_keys[0]]))

    def on_reset(self, reply: dict[str, Any]) -> None:
        """Apply a reset reply: the first observation, now at a decision point."""
        self.in_flight = False
        self.prompt = reply["prompt"] or ""
        self.obs = reply["obs"]
        self.info = dict(reply["info"] or {})
        self.needs_decision = True
        self._add_frame(self.obs)  # initial frame

    def on_chunk(self, reply: dict[str, Any], c: RunnerConfig) -> bool:
        """Apply a chunk reply (``k`` executed actions); True once the episode is over."""
        self.in_flight = False
        k = int(reply["n"])
        d = self.decisions[-1]
        d.valid[self.cursor:self.cursor + k] = True
        d.rewards[self.cursor:self.cursor + k] = reply["rewards"]
        self.cursor += k
        self.t += k
        self.total_reward += float(np.sum(reply["rewards"]))
        self.info = dict(reply["info"] or {})
        self.terminated, self.truncated = bool(reply["terminated"]), bool(reply["truncated"])
        capped = c.max_steps is not None and self.t >= c.max_steps
        done = self.terminated or self.truncated or capped
        if self.frames is not None:
            if c.video_every_step:
                self.frames.extend(reply["frames"] or [])
            elif done or self.cursor >= self.n_plan:
                self._add_frame(reply["obs"])
        if done:
            self.truncated = self.truncated or (capped and not self.terminated)
        elif self.cursor >= self.n_plan:
            self.obs = reply["obs"]
            self.needs_decision = True
        return done

    def plan_chunk(self, chunk: np.ndarray, extras: dict[str, np.ndarray], c: RunnerConfig) -> None:
        """Record a decision point and queue the first ``replan_steps`` actions of ``chunk`` ``(H, A)``."""
        r = c.replan_steps
        n_plan = min(r, chunk.shape[0])
        if c.max_steps is not None:
            n_plan = min(n_plan, c.max_steps - self.t)
        acts = np.zeros((r, chunk.shape[1]), dtype=chunk.dtype)
        acts[:n_plan] = chunk[:n_plan]
        assert self.obs is not None
        obs = self.obs if c.store_images else {k: v for k, v in self.obs.items() if k not in self.image_keys}
        self.decisions.append(DecisionPoint(step=self.t, obs=obs, actions=acts, valid=np.zeros(r, dtype=bool),
                                            rewards=np.zeros(r, dtype=np.float64), extras=extras))
        self.plan, self.n_plan, self.cursor = acts, n_plan, 0
        self.needs_decision = False
        self.obs = None

    def next_actions(self, c: RunnerConfig) -> tuple[np.ndarray, str]:
        """The queued action(s) to send ``(k, A)`` and the render mode of the reply."""
        assert self.plan is not None
        end = self.n_plan if c.remote_chunks else self.cursor + 1
        acts = self.plan[self.cursor:end]
        last = self.cursor + len(acts) >= self.n_plan
        if c.record_video and (last or not c.remote_chunks):
            return acts, "always"  # video: the final frame is needed even if the episode ends here
        return acts, ("decision" if last else "none")

    def to_episode(self) -> Episode:
        """The finished episode's record (padding actions zeroed)."""
        req = self.request
        for d in self.decisions:
            d.actions[~d.valid] = 0
        return Episode(index=req.index, task_id=req.task_id, init_state_id=req.init_state_id,
                       sample_index=req.sample_index, group_index=req.group_index, prompt=self.prompt,
                       success=bool(self.info.get("success", self.terminated)), length=self.t,
                       total_reward=self.total_reward, terminated=self.terminated, truncated=self.truncated,
                       decisions=self.decisions, frames=self.frames, attempts=req.attempts, worker_index=self.worker,
                       info=self.info)


class RolloutRunner:
    """Batched chunked-policy rollouts over a pool of env workers (see module docstring).

    ``env_factory``: an :class:`~pi0.envs.EnvSpec` (or any picklable ``factory(**overrides) -> env``);
    the worker passes ``task_id=...`` when an episode needs another task. ``policy``: a
    :class:`ChunkPolicy` living in this process only. ``config``: a :class:`RunnerConfig` (or a preset
    such as :func:`pi0.rollout.config.libero_runner_config`). Workers start lazily on first use and are
    reused across :meth:`run` calls until :meth:`close`.
    """

    def __init__(self, env_factory: EnvFactory | str, policy: ChunkPolicy | None = None,
                 config: RunnerConfig | None = None, *, hooks: RunnerHooks | None = None,
                 vec_env: VecEnvBase | None = None) -> None:
        """Create the runner (cheap: no worker is started here)."""
        if isinstance(env_factory, str):
            env_factory = EnvSpec(env_factory)
        if config is not None and not isinstance(config, RunnerConfig):
            raise TypeError(f"config must be a RunnerConfig, got {type(config).__name__}")
        self.config = config if config is not None else RunnerConfig()
        self.env_factory = env_factory
        self.policy = policy
        self.hooks = hooks or RunnerHooks()
        self._vec = vec_env
        self._owns_vec = vec_env is None
        self.worker_task: list[int | None] = []  # the task each worker's env has now
        self.last_stats = RunStats()

    # ------------------------------------------------------------------ workers
    @property
    def vec_env(self) -> VecEnvBase:
        """The vector env (started on first access)."""
        if self._vec is None:
            self._vec = make_vec_env(self.env_factory, self.config)
        if len(self.worker_task) != self._vec.num_envs:
            self.worker_task = [self._vec.env_ready_info(i).get("task_id") for i in range(self._vec.num_envs)]
        return self._vec

    @property
    def task_affinity(self) -> bool:
        """Whether to prefer a worker whose env has the episode's task: only when a switch is costly (it re-creates
        the env, or the env rebuilds its simulator: ``cheap_task_switch`` False)."""
        vec = self.vec_env
        return not all(vec.env_ready_info(i).get("cheap_task_switch", False) for i in range(vec.num_envs))

    def respawn(self, worker: int, overrides: dict[str, Any] | None, stats: RunStats,
                req: EpisodeRequest | None) -> None:
        """Respawn ``worker`` with exponential backoff (the vec env's ``env_options``); RolloutError when used up."""
        vec = self.vec_env
        o = vec.env_options
        tries = 0

        def attempt() -> None:
            nonlocal tries
            tries += 1
            try:
                vec.respawn(worker, overrides=overrides)
            except WorkerError as exc:
                stats.respawn_failures += 1
                log.warning("respawn %d/%d of env worker %d failed: %s", tries, o.make_attempts, worker, exc)
                raise

        try:
            call_with_backoff(attempt, o.make_attempts, o.make_backoff, o.make_backoff_max, retry_on=WorkerError)
        except WorkerError as exc:
            what = f" (its interrupted episode {req.key} cannot be re-run)" if req is not None else ""
            raise RolloutError(f"env worker {worker} could not be respawned after {o.make_attempts} attempts{what}; "
                               f"last error: {exc}") from exc
        if overrides is not None and "task_id" in overrides:
            self.worker_task[worker] = overrides["task_id"]

    def close(self) -> None:
        """Stop the workers (if this runner started them); idempotent."""
        if self._vec is not None and self._owns_vec:
            self._vec.close()
            self._vec = None
            self.worker_task = []  # a new vec env reports its own tasks

    def __enter__(self) -> "RolloutRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ public API
    def run(self, init_states: Sequence[tuple[int, int]], group_size: int | None = None,
            policy: ChunkPolicy | None = None) -> list[Episode]:
        """Run ``group_size`` episodes of every ``(task_id, init_state_id)``; returns them in request order."""
        k = int(group_size or self.config.group_size)
        return self.run_requests(make_requests(init_states, k), policy=policy, group_size=k)

    def run_until(self, init_states: Sequence[tuple[int, int]], group_size: int,
                  stop: Callable[[dict[int, Episode]], bool], policy: ChunkPolicy | None = None
                  ) -> dict[int, Episode]:
        """``run`` that ends as soon as ``stop(finished)`` is True (checked after each finished episode): the
        episodes still running are abandoned (their workers drained) and the rest are never started.

        -> {request index (``group * group_size + sample``): finished episode}; an abandoned request is absent.
        """
        k = int(group_size)
        return self._run(make_requests(init_states, k), policy, k, stop)

    def run_requests(self, requests: Sequence[EpisodeRequest], policy: ChunkPolicy | None = None,
                     group_size: int = 1) -> list[Episode]:
        """Run explicit requests (unique ``index`` each); returns episodes sorted by ``index``."""
        episodes = self._run(requests, policy, group_size, None)
        return [episodes[r.index] for r in sorted(requests, key=lambda r: r.index)]

    def _run(self, requests: Sequence[EpisodeRequest], policy: ChunkPolicy | None, group_size: int,
             stop: Callable[[dict[int, Episode]], bool] | None) -> dict[int, Episode]:
        """One run of ``requests`` (until ``stop``, if given) -> {request index: episode}."""
        policy = policy or self.policy
        if policy is None:
            raise ValueError("no policy given")
        if len({r.index for r in requests}) != len(requests):
            raise ValueError("request indices must be unique")
        requests = [dataclasses.replace(r, attempts=0) for r in requests]  # the caller's objects stay as given
        vec = self.vec_env
        scheduler = make_scheduler(self.config.schedule, requests, vec.num_envs, group_size, self.task_affinity)
        run = _Run(self, vec, policy, scheduler, len(requests), stop)
        episodes = run.loop()
        self.last_stats = run.stats
        return episodes


class _Run:
    """One :meth:`RolloutRunner.run_requests` call: the slots, the scheduler and the four-step loop."""

    def __init__(self, runner: RolloutRunner, vec: VecEnvBase, policy: ChunkPolicy, scheduler: Scheduler,
                 num_requests: int, stop: Callable[[dict[int, Episode]], bool] | None = None) -> None:
        self.runner, self.vec, self.policy, self.scheduler = runner, vec, policy, scheduler
        self.stop = stop
        self.stopped = False  # ``stop`` said the finished episodes are enough
        self.c = runner.config
        self.hooks = runner.hooks
        self.num_requests = num_requests
        self.slots: list[_Slot | None] = [None] * vec.num_envs
        self.results: dict[int, Episode] = {}
        self.last_error: dict[int, BaseException] = {}
        self.stats = RunStats()
        self.per_process = int(getattr(vec, "envs_per_worker", 1))  # env i lives in process i // per_process
        self.bar = None
        if self.c.progress and _is_rank0():
            from tqdm import tqdm

            self.bar = tqdm(total=num_requests, desc="rollouts", unit="ep")

    # ------------------------------------------------------------------ the loop
    def loop(self) -> dict[int, Episode]:
        """Rounds of: schedule, receive, decide (one batched policy call), send; until every episode is done."""
        t_start = time.perf_counter()
        cohorts = self.cohorts()
        try:
            while len(self.results) < self.num_requests and not self.stopped:
                active = False
                for cohort in cohorts:  # one cohort without overlap; with it, one steps while the other decides
                    self.fill(cohort)  # 1. free workers get the next requested episodes
                    busy = [w for w in cohort if self.slots[w] is not None and self.slots[w].in_flight]
                    if not busy and not any(self.slots[w] is not None and self.slots[w].needs_decision
                                            for w in cohort):
                        continue
                    active = True
                    self.receive(busy)  # 2. one reply from every busy worker (of the cohort)
                    need = [self.slots[w] for w in cohort if self.slots[w] is not None
                            and self.slots[w].needs_decision and not self.slots[w].in_flight]
                    if need:
                        self.decide(need)  # 3. one batched policy call for every env at a decision point
                        for slot in need:  # 4. each env gets its queued actions
                            if self.slots[slot.worker] is slot:
                                self.send_next(slot)
                    if self.stopped:
                        break
                if not active and not self.scheduler.pending:
                    raise RuntimeError("rollout scheduler stalled")  # invariant guard
            if self.stopped:
                self.abandon()
        except BaseException:
            self.drain_all()
            raise
        finally:
            if self.bar is not None:
                self.bar.close()
        self.stats.wall_time = time.perf_counter() - t_start
        self.stats.add_episodes(list(self.results.values()))
        return self.results

    def cohorts(self) -> list[list[int]]:
        """The workers in cohorts: one (all) by default; with ``overlap``, two halves (by env process when there are
        several), so that one half's envs step in their processes while the policy decides for the other's."""
        n = len(self.slots)
        if not self.c.overlap or n < 2:
            return [list(range(n))]
        per = self.per_process
        side = (lambda w: (w // per) % 2) if -(-n // per) >= 2 else (lambda w: w % 2)  # noqa: E731
        return [[w for w in range(n) if side(w) == c] for c in (0, 1)]

    def fill(self, workers: Sequence[int] | None = None) -> None:
        """Start episodes on free workers (all, or only ``workers`` / their blocks).

        With several envs in each of several processes, the free envs are offered one process after the other
        (env 0 of each process, then env 1, ...), so consecutive requests, the K rollouts of a group, spread over the
        processes: a group's episodes tend to last alike (they share their init state), and a process holding whole
        long groups would keep the others waiting at every round."""
        workers = range(len(self.slots)) if workers is None else workers
        per = self.per_process
        if per > 1 and len(self.slots) > per:  # (the grouped schedule takes blocks of consecutive envs anyway)
            workers = sorted(workers, key=lambda w: (w % per, w // per))
        for w, req in self.scheduler.assignments(workers, lambda i: self.slots[i] is None, self.runner.worker_task):
            self.start(w, req)

    def receive(self, busy: list[int]) -> None:
        """Wait for the reply of every worker in ``busy`` and apply it to its slot."""
        for w in busy:
            slot = self.slots[w]
            if slot is None or not slot.in_flight:
                continue
            try:
                reply = self.vec.recv(w)
            except WorkerError as exc:
                self.fail(w, exc)
                continue
            if "prompt" in reply:  # reset reply
                slot.on_reset(reply)
                self.runner.worker_task[w] = reply.get("task_id")
            elif slot.on_chunk(reply, self.c):
                self.finish(slot)
            elif slot.cursor < slot.n_plan:
                self.send_next(slot)  # step mode: next queued action

    def decide(self, need: list[_Slot]) -> None:
        """ONE ``policy.predict_chunks`` call for the observations of every slot in ``need``."""
        t0 = time.perf_counter()
        obs, prompts = [s.obs for s in need], [s.prompt for s in need]
        if getattr(self.policy, "keyed", False):  # the policy draws each row's noise from the episode's own key
            keys = [(*s.request.key, len(s.decisions)) for s in need]
            out = self.policy.predict_chunks(obs, prompts, keys=keys)
        else:
            out = self.policy.predict_chunks(obs, prompts)
        self.stats.policy_time += time.perf_counter() - t0
        if not isinstance(out, PolicyOutput):
            raise TypeError(f"policy must return PolicyOutput, got {type(out).__name__}")
        out.validate(len(need))
        self.stats.policy_calls += 1
        self.stats.batch_sizes.append(len(need))
        for j, slot in enumerate(need):
            slot.plan_chunk(np.asarray(out.actions[j]), {key: val[j] for key, val in out.extras.items()}, self.c)

    # ------------------------------------------------------------------ slot transitions
    def start(self, worker: int, req: EpisodeRequest) -> None:
        """Begin (or restart) ``req`` on ``worker``."""
        c = self.c
        req.attempts += 1
        if req.attempts > c.max_episode_attempts:
            err = self.last_error.get(req.index)
            raise RolloutError(f"episode {req.key} failed {c.max_episode_attempts} times; giving up; last "
                               f"error: {err!r}") from err
        keys = self.vec.env_ready_info(worker).get("image_keys", ())
        slot = self.slots[worker] = _Slot(req, worker, keys, c.record_video)
        settle = None if c.settle_action is None else np.asarray(c.settle_action, np.float64)
        try:
            self.vec.reset_async(worker, task_id=req.task_id, init_state_id=req.init_state_id, render=True,
                                 settle_steps=c.settle_steps, settle_action=settle)
        except WorkerError as exc:
            self.fail(worker, exc)
            return
        slot.in_flight = True

    def send_next(self, slot: _Slot) -> None:
        """Send the slot's queued action(s)."""
        acts, render = slot.next_actions(self.c)
        try:
            self.vec.chunk_async(slot.worker, acts, render=render, record_frames=self.c.video_every_step)
        except WorkerError as exc:
            self.fail(slot.worker, exc)
            return
        slot.in_flight = True
        if self.hooks.on_chunk_sent is not None:
            self.hooks.on_chunk_sent(self.runner, slot.worker, slot.request, slot.t)

    def finish(self, slot: _Slot) -> None:
        """Record the finished episode and give its worker the next one."""
        ep = slot.to_episode()
        if ep.index in self.results:
            raise RuntimeError(f"episode {ep.index} completed twice")  # invariant guard
        self.results[ep.index] = ep
        self.slots[slot.worker] = None
        self.stats.env_steps += ep.length
        if self.bar is not None:
            self.bar.update(1)
        if self.hooks.on_episode_end is not None:
            self.hooks.on_episode_end(self.runner, ep)
        if self.stop is not None and self.stop(self.results):
            self.stopped = True
            return
        self.fill([slot.worker])  # the next reset overlaps with this round's policy call

    def abandon(self) -> None:
        """After ``stop``: drop the episodes still running (their replies drained, so the workers are clean)."""
        for w, slot in enumerate(self.slots):
            if slot is None:
                continue
            if slot.in_flight:
                try:
                    self.vec.drain(w, timeout=self.c.step_timeout)
                except WorkerError as exc:
                    self.runner.respawn(w, None, self.stats, None)
                    log.warning("env worker %d failed while its abandoned episode was drained: %s", w, exc)
            self.slots[w] = None
            self.stats.abandoned += 1

    def fail(self, worker: int, exc: BaseException) -> None:
        """Respawn ``worker`` and re-run its interrupted episode from its init state."""
        self.stats.worker_failures += 1
        slot = self.slots[worker]
        req = slot.request if slot is not None else None
        self.slots[worker] = None
        if req is not None:
            self.last_error[req.index] = exc
        if self.hooks.on_worker_failure is not None:
            self.hooks.on_worker_failure(self.runner, worker, req, exc)
        known = self.runner.worker_task[worker]
        task = req.task_id if req is not None else known
        self.runner.respawn(worker, {"task_id": task} if task is not None and known is not None else None,
                            self.stats, req)
        if req is None:
            return
        if self.scheduler.restart_in_place:
            self.start(worker, req)
        else:
            self.scheduler.requeue(req)

    def drain_all(self) -> None:
        """After an error: leave the workers clean for the next run (no stale replies in the pipes)."""
        for w in range(len(self.slots)):
            try:
                self.vec.drain(w, timeout=min(self.c.step_timeout, 30.0))
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
