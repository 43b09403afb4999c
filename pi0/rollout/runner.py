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
(RLOO-style groups). ``schedule="greedy"`` gives the next episode to any free worker (preferring a
worker whose env already has the episode's task); ``schedule="grouped"`` splits the workers into
``num_envs // K`` blocks of K and runs the K members of a group together on one block, so they
share their init state *and* their policy batches.

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
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence

import numpy as np

from pi0.rollout.types import (
    IMAGE_KEYS,
    LIBERO_WAIT_ACTION,
    ChunkPolicy,
    DecisionPoint,
    Episode,
    EpisodeRequest,
    PolicyOutput,
    upright,
)
from pi0.rollout.vec_env import EnvFactory, EnvSpec, SerialVecEnv, SubprocVecEnv, WorkerError, call_with_backoff

__all__ = ["RolloutError", "RolloutRunner", "RunStats", "RunnerConfig", "RunnerHooks", "make_requests"]

log = logging.getLogger(__name__)


class RolloutError(RuntimeError):
    """An episode could not be completed (it failed ``max_episode_attempts`` times)."""


@dataclass
class RunnerConfig:
    """Settings of :class:`RolloutRunner` (subclasses change the defaults, not the loop)."""

    num_envs: int = 4  # envs (one worker process each, or in-process envs with use_subprocess=False)
    envs_per_worker: int = 1  # >1: each worker process hosts this many envs, one batched message per round
    replan_steps: int = 5  # actions executed from each predicted chunk before replanning
    max_steps: int | None = None  # optional cap on policy steps per episode (the env truncates too)
    group_size: int = 1  # default K of run()
    schedule: str = "greedy"  # "greedy" | "grouped"
    settle_steps: int = 0  # extra do-nothing steps after reset (LiberoEnv already does its own wait steps)
    settle_action: tuple[float, ...] = LIBERO_WAIT_ACTION
    remote_chunks: bool = True  # execute whole chunks in the worker (1 round trip per decision)
    store_images: bool = True  # keep the image keys of decision-point observations (False: low-dim keys only)
    record_video: bool = False  # keep upright agentview frames (decision points + final frame)
    video_every_step: bool = False  # ... or of every step (renders every step)
    use_subprocess: bool = True  # False: in-process SerialVecEnv (debugging, baselines)
    step_timeout: float = 120.0  # seconds without a reply before a worker counts as hung
    start_timeout: float = 600.0  # seconds to build an env in a (re)started worker
    make_attempts: int = 3  # env creation / worker respawn attempts (exponential backoff)
    make_backoff: float = 0.5  # first backoff in seconds (doubles each attempt)
    recreate_every: int | None = None  # re-create each worker's env every N episodes
    max_episode_attempts: int = 3  # an episode may be started this many times before RolloutError
    progress: bool = False  # tqdm bar over episodes (rank 0 only)


@dataclass
class RunnerHooks:
    """Optional callbacks (all run in the main process; used by tests for fault injection)."""

    on_chunk_sent: Callable[["RolloutRunner", int, EpisodeRequest, int], None] | None = None  # (runner, worker, req, step)
    on_episode_end: Callable[["RolloutRunner", Episode], None] | None = None
    on_worker_failure: Callable[["RolloutRunner", int, EpisodeRequest | None, BaseException], None] | None = None


@dataclass
class RunStats:
    """Counters of the last :meth:`RolloutRunner.run` call."""

    num_episodes: int = 0
    env_steps: int = 0
    policy_calls: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    worker_failures: int = 0
    respawn_failures: int = 0  # respawned workers that died / failed during start-up (then retried)
    wall_time: float = 0.0
    policy_time: float = 0.0
    success_rate: float = 0.0

    @property
    def steps_per_second(self) -> float:
        """Env steps per wall-clock second."""
        return self.env_steps / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def mean_batch_size(self) -> float:
        """Mean number of observations per policy call."""
        return float(np.mean(self.batch_sizes)) if self.batch_sizes else 0.0


def make_requests(init_states: Sequence[tuple[int, int]], group_size: int = 1) -> list[EpisodeRequest]:
    """Flatten ``init_states`` x ``group_size`` into requests (group-major: index = g * K + k)."""
    if group_size < 1:
        raise ValueError("group_size must be >= 1")
    return [EpisodeRequest(index=g * group_size + k, task_id=int(t), init_state_id=int(s), sample_index=k, group_index=g)
            for g, (t, s) in enumerate(init_states) for k in range(group_size)]


def _is_rank0() -> bool:
    """True unless the usual launcher env vars name a non-zero rank."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0) == 0


class _Slot:
    """Book-keeping of the episode running on one worker."""

    __slots__ = ("request", "worker", "prompt", "obs", "t", "total_reward", "decisions", "frames", "plan",
                 "n_plan", "cursor", "in_flight", "needs_decision", "terminated", "truncated", "info")

    def __init__(self, request: EpisodeRequest, worker: int, record_video: bool) -> None:
        self.request = request
        self.worker = worker
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


class RolloutRunner:
    """Batched chunked-policy rollouts over a pool of env workers (see module docstring).

    ``env_factory``: an :class:`EnvSpec` (or any picklable ``factory(**overrides) -> env``); the
    worker passes ``task_id=...`` when an episode needs another task. ``policy``: a
    :class:`ChunkPolicy` living in this process only. Settings come from ``config`` (or the class
    ``DEFAULTS``) updated with keyword ``overrides``. Workers start lazily on first use and are
    reused across :meth:`run` calls until :meth:`close`.
    """

    DEFAULTS: ClassVar[dict[str, Any]] = {}

    def __init__(self, env_factory: EnvFactory, policy: ChunkPolicy | None = None,
                 config: RunnerConfig | None = None, *, hooks: RunnerHooks | None = None,
                 vec_env: SubprocVecEnv | SerialVecEnv | None = None, **overrides: Any) -> None:
        """Create the runner (cheap: no worker is started here)."""
        if isinstance(env_factory, str):
            env_factory = EnvSpec(env_factory)
        base = config if config is not None else RunnerConfig(**self.DEFAULTS)
        self.config = dataclasses.replace(base, **overrides)
        c = self.config
        if c.schedule not in ("greedy", "grouped"):
            raise ValueError(f"schedule must be 'greedy' or 'grouped', got {c.schedule!r}")
        if c.replan_steps < 1 or c.num_envs < 1 or c.envs_per_worker < 1:
            raise ValueError("replan_steps, num_envs and envs_per_worker must be >= 1")
        self.env_factory = env_factory
        self.policy = policy
        self.hooks = hooks or RunnerHooks()
        self._vec = vec_env
        self._owns_vec = vec_env is None
        self._worker_task: list[int | None] = []
        self._task_affinity = True
        self.last_stats = RunStats()

    # ------------------------------------------------------------------ workers
    @property
    def vec_env(self) -> SubprocVecEnv | SerialVecEnv:
        """The vector env (started on first access)."""
        if self._vec is None:
            c = self.config
            cls = SubprocVecEnv if c.use_subprocess else SerialVecEnv
            self._vec = cls(self.env_factory, c.num_envs, step_timeout=c.step_timeout, start_timeout=c.start_timeout,
                            make_attempts=c.make_attempts, make_backoff=c.make_backoff,
                            recreate_every=c.recreate_every, envs_per_worker=c.envs_per_worker)
        if not self._worker_task or len(self._worker_task) != self._vec.num_envs:
            self._worker_task = [self._ready_info(i).get("task_id") for i in range(self._vec.num_envs)]
            # Task affinity only pays off when switching task means re-creating the env (LIBERO).
            self._task_affinity = not all(self._ready_info(i).get("supports_task_switch", False)
                                          for i in range(self._vec.num_envs))
        return self._vec

    def _ready_info(self, index: int) -> dict[str, Any]:
        """What worker ``index`` reported when its env was built (empty if unknown)."""
        env_ready_info = getattr(self._vec, "env_ready_info", None)
        if env_ready_info is not None:
            return env_ready_info(index)
        workers = getattr(self._vec, "_workers", None)
        if workers and workers[index] is not None:
            return workers[index].ready_info
        servers = getattr(self._vec, "_servers", None)
        if servers and servers[index] is not None:
            return servers[index].describe()
        return {}

    def _respawn(self, worker: int, overrides: dict[str, Any] | None, stats: RunStats,
                 req: EpisodeRequest | None) -> None:
        """Respawn ``worker``, retrying with exponential backoff; RolloutError once the attempts are used up.

        Attempts and backoff come from the vec env (``make_attempts``, ``make_backoff``,
        ``make_backoff_max``), falling back to this runner's config for a vec env without them.
        """
        vec, c = self._vec, self.config
        attempts = max(1, int(getattr(vec, "make_attempts", c.make_attempts)))
        backoff = float(getattr(vec, "make_backoff", c.make_backoff))
        backoff_max = float(getattr(vec, "make_backoff_max", 30.0))
        tries = 0

        def attempt() -> None:
            nonlocal tries
            tries += 1
            try:
                vec.respawn(worker, overrides=overrides)
            except WorkerError as exc:
                stats.respawn_failures += 1
                log.warning("respawn %d/%d of env worker %d failed: %s", tries, attempts, worker, exc)
                raise

        try:
            call_with_backoff(attempt, attempts, backoff, backoff_max, retry_on=WorkerError)
        except WorkerError as exc:
            what = f" (its interrupted episode {req.key} cannot be re-run)" if req is not None else ""
            raise RolloutError(f"env worker {worker} could not be respawned after {attempts} attempts{what}; "
                               f"last error: {exc}") from exc

    def close(self) -> None:
        """Stop the workers (if this runner started them); idempotent."""
        if self._vec is not None and self._owns_vec:
            self._vec.close()
            self._vec = None

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

    def run_requests(self, requests: Sequence[EpisodeRequest], policy: ChunkPolicy | None = None,
                     group_size: int = 1) -> list[Episode]:
        """Run explicit requests (unique ``index`` each); returns episodes sorted by ``index``."""
        policy = policy or self.policy
        if policy is None:
            raise ValueError("no policy given")
        if len({r.index for r in requests}) != len(requests):
            raise ValueError("request indices must be unique")
        requests = [dataclasses.replace(r, attempts=0) for r in requests]  # the caller's objects stay as given
        c = self.config
        vec = self.vec_env
        n_env = vec.num_envs
        grouped = c.schedule == "grouped"
        if grouped and group_size > n_env:
            raise ValueError(f"grouped schedule needs num_envs >= group_size ({n_env} < {group_size})")
        blocks = n_env // group_size if grouped else n_env
        stats = RunStats()
        t_start = time.perf_counter()
        results: dict[int, Episode] = {}
        slots: list[_Slot | None] = [None] * n_env
        queue: deque[EpisodeRequest] = deque(requests)
        groups: deque[list[EpisodeRequest]] = deque()
        if grouped:
            by_group: dict[int, list[EpisodeRequest]] = {}
            for r in requests:
                by_group.setdefault(r.group_index, []).append(r)
            for g in by_group.values():
                if len(g) > group_size:
                    raise ValueError("a group has more members than group_size")
            groups = deque(by_group.values())
        bar = None
        if c.progress and _is_rank0():
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc="rollouts", unit="ep")

        last_error: dict[int, BaseException] = {}

        def start(worker: int, req: EpisodeRequest) -> None:
            """Begin (or restart) ``req`` on ``worker``."""
            req.attempts += 1
            if req.attempts > c.max_episode_attempts:
                raise RolloutError(f"episode {req.key} failed {c.max_episode_attempts} times; giving up; last "
                                   f"error: {last_error.get(req.index)!r}") from last_error.get(req.index)
            slot = _Slot(req, worker, c.record_video)
            slots[worker] = slot
            try:
                vec.reset_async(worker, task_id=req.task_id, init_state_id=req.init_state_id, render=True,
                                settle_steps=c.settle_steps, settle_action=np.asarray(c.settle_action, np.float64))
            except WorkerError as exc:
                fail(worker, exc)
                return
            slot.in_flight = True

        def fail(worker: int, exc: BaseException) -> None:
            """Respawn ``worker`` and re-run its interrupted episode from its init state."""
            stats.worker_failures += 1
            slot = slots[worker]
            req = slot.request if slot is not None else None
            slots[worker] = None
            if req is not None:
                last_error[req.index] = exc
            if self.hooks.on_worker_failure is not None:
                self.hooks.on_worker_failure(self, worker, req, exc)
            task = req.task_id if req is not None else self._worker_task[worker]
            overrides = {"task_id": task} if task is not None and self._worker_task[worker] is not None else None
            self._respawn(worker, overrides, stats, req)
            if overrides is not None:
                self._worker_task[worker] = task
            if req is None:
                return
            if grouped:
                start(worker, req)  # keep the group on its block
            else:
                queue.appendleft(req)

        def assign_greedy(worker: int) -> None:
            """Give ``worker`` the next request, preferring one whose task its env already has."""
            if not queue:
                return
            pick = 0
            wt = self._worker_task[worker]
            if self._task_affinity and wt is not None and queue[0].task_id != wt:
                for j, r in enumerate(queue):
                    if j >= 4 * n_env:
                        break
                    if r.task_id == wt:
                        pick = j
                        break
            req = queue[pick]
            del queue[pick]
            start(worker, req)

        def fill(worker: int | None = None) -> None:
            """Start episodes on free workers (all, or only ``worker`` / its block)."""
            if grouped:
                for b in range(blocks) if worker is None else [worker // group_size]:
                    members = range(b * group_size, (b + 1) * group_size)
                    if b < blocks and groups and all(slots[w] is None for w in members):
                        for w, req in zip(members, groups.popleft()):
                            start(w, req)
            else:
                for w in range(n_env) if worker is None else [worker]:
                    if slots[w] is None:
                        assign_greedy(w)

        def finish(slot: _Slot) -> None:
            """Turn a finished slot into an :class:`Episode`."""
            req = slot.request
            for d in slot.decisions:
                d.actions[~d.valid] = 0
            success = bool(slot.info.get("success", slot.terminated))
            ep = Episode(index=req.index, task_id=req.task_id, init_state_id=req.init_state_id,
                         sample_index=req.sample_index, group_index=req.group_index, prompt=slot.prompt,
                         success=success, length=slot.t, total_reward=slot.total_reward,
                         terminated=slot.terminated, truncated=slot.truncated, decisions=slot.decisions,
                         frames=slot.frames, attempts=req.attempts, worker_index=slot.worker, info=slot.info)
            if req.index in results:
                raise RuntimeError(f"episode {req.index} completed twice")  # invariant guard
            results[req.index] = ep
            slots[slot.worker] = None
            stats.env_steps += ep.length
            if bar is not None:
                bar.update(1)
            if self.hooks.on_episode_end is not None:
                self.hooks.on_episode_end(self, ep)
            fill(slot.worker)  # the next reset overlaps with this round's policy call

        def send_next(slot: _Slot) -> None:
            """Send the slot's queued action(s)."""
            w = slot.worker
            if c.remote_chunks:
                acts = slot.plan[slot.cursor:slot.n_plan]
            else:
                acts = slot.plan[slot.cursor:slot.cursor + 1]
            last = slot.cursor + len(acts) >= slot.n_plan
            if c.record_video and (last or not c.remote_chunks):
                render = "always"  # video: the final frame is needed even if the episode ends here
            else:
                render = "decision" if last else "none"
            try:
                vec.chunk_async(w, acts, render=render, record_frames=c.video_every_step)
            except WorkerError as exc:
                fail(w, exc)
                return
            slot.in_flight = True
            if self.hooks.on_chunk_sent is not None:
                self.hooks.on_chunk_sent(self, w, slot.request, slot.t)

        def on_reply(slot: _Slot, reply: dict[str, Any]) -> None:
            """Apply a reset or chunk reply to ``slot``."""
            slot.in_flight = False
            if "prompt" in reply:  # reset reply
                slot.prompt = reply["prompt"] or ""
                slot.obs = reply["obs"]
                slot.info = dict(reply["info"] or {})
                self._worker_task[slot.worker] = reply.get("task_id")
                slot.needs_decision = True
                if slot.frames is not None:  # initial frame
                    slot.frames.append(upright(slot.obs["agentview_image"]))
                return
            k = int(reply["n"])
            d = slot.decisions[-1]
            d.valid[slot.cursor:slot.cursor + k] = True
            d.rewards[slot.cursor:slot.cursor + k] = reply["rewards"]
            slot.cursor += k
            slot.t += k
            slot.total_reward += float(np.sum(reply["rewards"]))
            slot.info = dict(reply["info"] or {})
            slot.terminated, slot.truncated = bool(reply["terminated"]), bool(reply["truncated"])
            capped = c.max_steps is not None and slot.t >= c.max_steps
            done = slot.terminated or slot.truncated or capped
            if slot.frames is not None:
                if c.video_every_step:
                    slot.frames.extend(reply["frames"] or [])
                elif (done or slot.cursor >= slot.n_plan) and reply["obs"] is not None \
                        and IMAGE_KEYS[0] in reply["obs"]:
                    slot.frames.append(upright(reply["obs"][IMAGE_KEYS[0]]))
            if done:
                slot.truncated = slot.truncated or (capped and not slot.terminated)
                finish(slot)
            elif slot.cursor < slot.n_plan:
                send_next(slot)  # step mode: next queued action
            else:
                slot.obs = reply["obs"]
                slot.needs_decision = True

        try:
            while len(results) < len(requests):
                # 1. schedule free workers
                fill()
                busy = [w for w in range(n_env) if slots[w] is not None and slots[w].in_flight]
                if not busy and not any(s is not None and s.needs_decision for s in slots):
                    if len(results) < len(requests) and not queue and not groups:
                        raise RuntimeError("rollout scheduler stalled")  # invariant guard
                    continue
                # 2. barrier: one reply from every busy worker
                for w in busy:
                    slot = slots[w]
                    if slot is None or not slot.in_flight:
                        continue
                    try:
                        reply = vec.recv(w)
                    except WorkerError as exc:
                        fail(w, exc)
                        continue
                    on_reply(slot, reply)
                # 3. one batched policy call for every env at a decision point
                need = [s for s in slots if s is not None and s.needs_decision and not s.in_flight]
                if need:
                    t0 = time.perf_counter()
                    out = policy.predict_chunks([s.obs for s in need], [s.prompt for s in need])
                    stats.policy_time += time.perf_counter() - t0
                    if not isinstance(out, PolicyOutput):
                        raise TypeError(f"policy must return PolicyOutput, got {type(out).__name__}")
                    out.validate(len(need))
                    stats.policy_calls += 1
                    stats.batch_sizes.append(len(need))
                    r = c.replan_steps
                    for j, slot in enumerate(need):
                        chunk = np.asarray(out.actions[j])
                        n_plan = min(r, chunk.shape[0])
                        if c.max_steps is not None:
                            n_plan = min(n_plan, c.max_steps - slot.t)
                        acts = np.zeros((r, chunk.shape[1]), dtype=chunk.dtype)
                        acts[:n_plan] = chunk[:n_plan]
                        extras = {key: val[j] for key, val in out.extras.items()}
                        obs = slot.obs if c.store_images else {k: v for k, v in slot.obs.items() if k not in IMAGE_KEYS}
                        slot.decisions.append(DecisionPoint(step=slot.t, obs=obs, actions=acts,
                                                            valid=np.zeros(r, dtype=bool),
                                                            rewards=np.zeros(r, dtype=np.float64), extras=extras))
                        slot.plan, slot.n_plan, slot.cursor = acts, n_plan, 0
                        slot.needs_decision = False
                        slot.obs = None
                    # 4. send each env its queued actions
                    for slot in need:
                        if slots[slot.worker] is slot:
                            send_next(slot)
        except BaseException:
            # Leave the workers clean for the next run: no stale replies in the pipes.
            for w in range(n_env):
                try:
                    vec.drain(w, timeout=min(c.step_timeout, 30.0))
                except Exception:  # noqa: BLE001 - the original error matters more
                    pass
            raise
        finally:
            if bar is not None:
                bar.close()
        stats.num_episodes = len(results)
        stats.wall_time = time.perf_counter() - t_start
        episodes = [results[r.index] for r in sorted(requests, key=lambda r: r.index)]
        stats.success_rate = float(np.mean([e.success for e in episodes])) if episodes else 0.0
        self.last_stats = stats
        return episodes
