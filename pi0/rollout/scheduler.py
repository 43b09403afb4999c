"""Which episode runs on which worker: requests (K rollouts per init state) and the two schedules.

``GreedyScheduler``: any free worker takes the next request, preferring one whose env already has the
request's task (when switching task means re-creating the env, as with LIBERO). ``GroupedScheduler``:
the workers form ``num_workers // K`` blocks of K; a block takes the next group only when all its
workers are free, so the K members of a group share their init state *and* their policy batches.
``TaskOrderScheduler``: a free worker takes a whole task and runs its episodes one after the other in
request order, as openpi's LIBERO eval does (one env per task, sequential episodes).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterator, Sequence

from pi0.rollout.types import EpisodeRequest

__all__ = ["GreedyScheduler", "GroupedScheduler", "Scheduler", "TaskOrderScheduler", "make_requests", "make_scheduler"]


def make_requests(init_states: Sequence[tuple[int, int]], group_size: int = 1) -> list[EpisodeRequest]:
    """Flatten ``init_states`` x ``group_size`` into requests (group-major: index = g * K + k)."""
    if group_size < 1:
        raise ValueError("group_size must be >= 1")
    return [EpisodeRequest(index=g * group_size + k, task_id=int(t), init_state_id=int(s), sample_index=k, group_index=g)
            for g, (t, s) in enumerate(init_states) for k in range(group_size)]


class GreedyScheduler:
    """Next request to any free worker; an interrupted episode goes back to the front of the queue."""

    restart_in_place = False  # a failed episode is re-queued (any worker may take it)

    def __init__(self, requests: Sequence[EpisodeRequest], num_workers: int, task_affinity: bool) -> None:
        """Queue ``requests`` in order; ``task_affinity`` looks ahead for a request matching a worker's task."""
        self.queue: deque[EpisodeRequest] = deque(requests)
        self.num_workers = num_workers
        self.task_affinity = task_affinity

    @property
    def pending(self) -> bool:
        """Whether requests are still waiting for a worker."""
        return bool(self.queue)

    def assignments(self, workers: Sequence[int], is_free: Callable[[int], bool],
                    worker_task: Sequence[int | None]) -> Iterator[tuple[int, EpisodeRequest]]:
        """Yield ``(worker, request)`` for the free ones among ``workers`` (lazily: a start may fail and re-queue)."""
        for w in workers:
            if is_free(w) and self.queue:
                yield w, self._take(worker_task[w])

    def _take(self, task: int | None) -> EpisodeRequest:
        """Pop the next request, preferring one of ``task`` among the next ``4 * num_workers``."""
        pick = 0
        if self.task_affinity and task is not None and self.queue[0].task_id != task:
            for j, r in enumerate(self.queue):
                if j >= 4 * self.num_workers:
                    break
                if r.task_id == task:
                    pick = j
                    break
        req = self.queue[pick]
        del self.queue[pick]
        return req

    def requeue(self, req: EpisodeRequest) -> None:
        """Put an interrupted episode back at the front."""
        self.queue.appendleft(req)


class GroupedScheduler:
    """Groups of K requests on blocks of K workers; an interrupted member restarts on its own worker."""

    restart_in_place = True  # keep the group on its block

    def __init__(self, requests: Sequence[EpisodeRequest], num_workers: int, group_size: int) -> None:
        """Collect the requests by ``group_index``; raise if a group does not fit a block."""
        if group_size > num_workers:
            raise ValueError(f"grouped schedule needs num_envs >= group_size ({num_workers} < {group_size})")
        by_group: dict[int, list[EpisodeRequest]] = {}
        for r in requests:
            by_group.setdefault(r.group_index, []).append(r)
        if any(len(g) > group_size for g in by_group.values()):
            raise ValueError("a group has more members than group_size")
        self.groups: deque[list[EpisodeRequest]] = deque(by_group.values())
        self.group_size = group_size
        self.num_blocks = num_workers // group_size

    @property
    def pending(self) -> bool:
        """Whether groups are still waiting for a block."""
        return bool(self.groups)

    def assignments(self, workers: Sequence[int], is_free: Callable[[int], bool],
                    worker_task: Sequence[int | None]) -> Iterator[tuple[int, EpisodeRequest]]:
        """Yield ``(worker, request)`` for the members of the next group on every fully free block of ``workers``."""
        k = self.group_size
        for b in sorted({w // k for w in workers}):
            members = range(b * k, (b + 1) * k)
            if b < self.num_blocks and self.groups and all(is_free(w) for w in members):
                yield from zip(members, self.groups.popleft())

    def requeue(self, req: EpisodeRequest) -> None:  # pragma: no cover - grouped restarts in place
        """Not used: an interrupted member restarts on its own worker."""
        raise RuntimeError("grouped schedule restarts interrupted episodes in place")


class TaskOrderScheduler:
    """Each task's requests run on one worker, in request order; a free worker with none left takes the next task."""

    restart_in_place = True  # an interrupted episode restarts on its own worker, keeping the task's order

    def __init__(self, requests: Sequence[EpisodeRequest]) -> None:
        """Split ``requests`` into per-task queues (tasks in order of first appearance)."""
        by_task: dict[int, deque[EpisodeRequest]] = {}
        for r in requests:
            by_task.setdefault(r.task_id, deque()).append(r)
        self.tasks: deque[deque[EpisodeRequest]] = deque(by_task.values())
        self.current: dict[int, deque[EpisodeRequest]] = {}  # worker -> the rest of its task

    @property
    def pending(self) -> bool:
        """Whether requests are still waiting for a worker."""
        return bool(self.tasks) or any(self.current.values())

    def assignments(self, workers: Sequence[int], is_free: Callable[[int], bool],
                    worker_task: Sequence[int | None]) -> Iterator[tuple[int, EpisodeRequest]]:
        """Yield ``(worker, request)``: the next episode of each free worker's task, or the first of a new task."""
        for w in workers:
            if not is_free(w):
                continue
            if not self.current.get(w) and self.tasks:
                self.current[w] = self.tasks.popleft()
            if self.current.get(w):
                yield w, self.current[w].popleft()

    def requeue(self, req: EpisodeRequest) -> None:  # pragma: no cover - restarts in place
        """Not used: an interrupted episode restarts on its own worker."""
        raise RuntimeError("task_order schedule restarts interrupted episodes in place")


Scheduler = GreedyScheduler | GroupedScheduler | TaskOrderScheduler


def make_scheduler(schedule: str, requests: Sequence[EpisodeRequest], num_workers: int, group_size: int,
                   task_affinity: bool) -> Scheduler:
    """The scheduler named by ``schedule`` ("greedy" | "grouped" | "task_order")."""
    if schedule == "grouped":
        return GroupedScheduler(requests, num_workers, group_size)
    if schedule == "task_order":
        return TaskOrderScheduler(requests)
    return GreedyScheduler(requests, num_workers, task_affinity)
