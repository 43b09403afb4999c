"""Subprocess vector env: envs in ``spawn``-ed worker processes, talking the batched protocol over ``Pipe``s.

Design
------
* Each worker builds its env(s) from a picklable *env factory* (normally an
  :class:`pi0.envs.EnvSpec`, i.e. a gym id + kwargs, made with ``gym.make`` inside the worker).
  Factories are checked before anything is started (:func:`pi0.rollout.vec_env.check_env_factory`):
  one that captures torch objects or a policy is rejected, so the model never enters a worker (the
  workers do not even import torch; see ``worker_info``). The worker side is
  :mod:`pi0.rollout.env_server`; the pipe framing is :mod:`pi0.rollout.transport`.
* Failures are typed (:mod:`pi0.rollout.errors`): :class:`WorkerDied` (EOF / broken pipe / process
  gone), :class:`WorkerTimeout` (no reply within ``step_timeout``: a hung worker, e.g.
  SIGSTOPped), :class:`RemoteEnvError` (the env raised; traceback included),
  :class:`EnvCreationError` (:class:`StartupDeath`: the process died before its env was built). Each worker runs
  ``faulthandler`` into a file of its own, so a worker killed by a signal is reported with the signal's name and, for
  a native crash, the Python line it was on. After a process failure its envs are *broken* until
  :meth:`SubprocVecEnv.respawn` kills (SIGKILL), reaps and restarts the process. The caller (the
  runner) re-runs the interrupted episodes.
* Env creation is retried in the worker with exponential backoff (``make_attempts``,
  ``make_backoff``); a worker process that dies during its first start is started again, ``make_attempts``
  processes in all. Optionally the env is re-created every ``recreate_every`` episodes (resets).
* ``close()`` is idempotent and reaps every process (no zombies); it also runs at garbage
  collection / interpreter exit.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import shutil
import signal
import sys
import tempfile
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

from pi0.rollout.env_server import EnvFactory, EnvOptions, call_with_backoff, worker_main
from pi0.rollout.errors import EnvCreationError, RemoteEnvError, StartupDeath, WorkerDied, WorkerError, WorkerTimeout
from pi0.rollout.transport import recv_obj, send_obj
from pi0.rollout.vec_env import VecEnvBase, check_env_factory

__all__ = ["SubprocVecEnv", "exit_description", "fault_summary"]

log = logging.getLogger(__name__)


def exit_description(exitcode: int | None) -> str:
    """``-6`` -> ``"killed by SIGABRT"``, ``1`` -> ``"exit code 1"``, ``None`` -> ``"still running"``."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def fault_summary(dump: str) -> str:
    """The error and innermost Python frame of a ``faulthandler`` dump ("" if it holds none).

    ``'Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call first):\n  File "a.py", line 3 in f\n...'``
    -> ``'Fatal Python error: Aborted at File "a.py", line 3 in f'``.
    """
    lines = [ln.strip() for ln in dump.splitlines()]
    error = next((ln for ln in lines if ln.startswith("Fatal Python error")), "")
    frame = next((ln for ln in lines if ln.startswith('File "')), "")
    return f"{error} at {frame}" if error and frame else error or frame


@contextlib.contextmanager
def main_module_hidden(factory: Any) -> Iterator[None]:
    """Keep spawned workers from re-importing the launching script (and torch / the model with it).

    spawn re-runs ``__main__``'s imports in every child (it finds the script by ``__file__`` or
    ``__spec__``); hiding both while the child starts makes workers import only what the env needs.
    Skipped when the factory itself lives in ``__main__`` (the child must import it from there).
    """
    main = sys.modules.get("__main__")
    if main is None or getattr(type(factory), "__module__", None) == "__main__" or \
            getattr(factory, "__module__", None) == "__main__":
        yield
        return
    saved = {k: main.__dict__.pop(k) for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__spec__ = None  # spawn reads this attribute; None means "no importable main"
    try:
        yield
    finally:
        main.__dict__.update(saved)


@dataclass
class _Worker:
    """Main-process handle of one worker process."""

    index: int
    process: Any
    conn: mpc.Connection
    broken: bool = False

    @property
    def pid(self) -> int | None:
        """The worker's process id."""
        return self.process.pid


def _reap(worker: _Worker, graceful: bool, timeout: float) -> None:
    """Stop one worker: polite close if ``graceful``, then SIGKILL if needed; always join (no zombie)."""
    proc = worker.process
    if graceful and proc.is_alive() and not worker.broken:
        try:
            send_obj(worker.conn, ("close", None))
            if worker.conn.poll(timeout):
                recv_obj(worker.conn)
        except (OSError, EOFError, BrokenPipeError):
            pass
        proc.join(timeout)
    if proc.is_alive():
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.join(timeout=max(timeout, 5.0))
    try:
        worker.conn.close()
    except OSError:
        pass
    try:
        proc.close()
    except ValueError:
        pass  # still running (should not happen after SIGKILL + join)


def _shutdown(workers: list[_Worker | None], timeout: float = 5.0, fault_dir: str | None = None) -> None:
    """Stop and reap every worker in ``workers`` (used by close() and the GC finalizer); remove ``fault_dir``."""
    for w in workers:  # ask everyone first so they exit in parallel
        if w is not None and not w.broken and w.process.is_alive():
            try:
                send_obj(w.conn, ("close", None))
            except (OSError, BrokenPipeError):
                w.broken = True
    for i, w in enumerate(workers):
        if w is not None:
            w.broken = True  # close already sent
            try:
                if w.conn.poll(0 if not w.process.is_alive() else timeout):
                    recv_obj(w.conn)
            except (OSError, EOFError):
                pass
            _reap(w, graceful=False, timeout=timeout)
            workers[i] = None
    if fault_dir:
        shutil.rmtree(fault_dir, ignore_errors=True)


class SubprocVecEnv(VecEnvBase):
    """``num_envs`` envs, each in its own ``spawn``-ed (daemon) worker process (see module docstring).

    Drive it from one thread. Create it from a non-daemonic process (daemons cannot have children),
    and under ``if __name__ == "__main__":`` in scripts (spawn re-imports the main module).

    One batched protocol: each process hosts ``envs_per_worker=M`` envs (env ``i`` lives in process
    ``i // M``; ``num_envs`` and all indices stay per env; M=1 is a batch of one). The commands of a
    process are buffered and sent as ONE ``("batch", ...)`` message (its envs' commands in order),
    answered by ONE batched reply that is demultiplexed into per-env reply queues, so ``recv(j)``
    for another env of the same process needs no round trip. With M > 1 the buffer is flushed at the
    next ``recv``/``wait`` (coalescing); with M = 1 there is nothing to coalesce and the batch of one
    is sent at once (a reset overlaps with the caller's work, e.g. the runner's policy call).
    ``step_timeout`` then bounds the wait for a whole batch. Cheap envs (the arena) need this:
    one pipe round trip costs more than their step. Crash semantics: when a process dies or hangs,
    every env it hosts fails: each env with pending commands raises the WorkerError subclass on
    ``recv``; the others raise :class:`WorkerDied` on their next command or ``recv`` until they are
    reset (``reset_async`` clears it) or respawned. ``respawn(i)`` restarts the process of ``i``
    (its other envs lose their state, as above); ``respawn(j)`` for such an env of an already
    restarted, healthy process does not restart it again (it only clears the flag and records
    ``overrides`` for later restarts; the next ``reset`` applies ``task_id``).
    """

    def __init__(
        self,
        env_factory: EnvFactory,
        num_envs: int,
        *,
        step_timeout: float = 120.0,
        start_timeout: float = 600.0,
        make_attempts: int = 3,
        make_backoff: float = 0.5,
        make_backoff_max: float = 30.0,
        recreate_every: int | None = None,
        context: str = "spawn",
        worker_overrides: Sequence[Mapping[str, Any]] | None = None,
        envs_per_worker: int = 1,
    ) -> None:
        """Start the workers in parallel and wait until every env is built."""
        if num_envs < 1:
            raise ValueError("num_envs must be >= 1")
        if int(envs_per_worker) < 1:
            raise ValueError("envs_per_worker must be >= 1")
        check_env_factory(env_factory)
        self.env_factory = env_factory
        self.num_envs = int(num_envs)
        self.step_timeout = float(step_timeout)
        self.start_timeout = float(start_timeout)
        self.env_options = EnvOptions(int(make_attempts), float(make_backoff), float(make_backoff_max), recreate_every)
        self._ctx = mp.get_context(context)
        self._overrides = [dict(o) for o in worker_overrides] if worker_overrides else [{} for _ in range(num_envs)]
        if len(self._overrides) != num_envs:
            raise ValueError("worker_overrides must have one entry per env")
        self.envs_per_worker = int(envs_per_worker)
        self.num_workers = -(-self.num_envs // self.envs_per_worker)  # processes
        # per process: its env indices, buffered commands, env lists of the batches in flight
        self._proc_envs = [list(range(p * self.envs_per_worker, min(self.num_envs, (p + 1) * self.envs_per_worker)))
                           for p in range(self.num_workers)]
        self._outbox: list[list[tuple[int, str, dict]]] = [[] for _ in range(self.num_workers)]
        self._inflight: list[deque[list[int]]] = [deque() for _ in range(self.num_workers)]
        # per env: received replies, pending count, failure to raise until reset/respawn
        self._replies: list[deque[tuple[str, Any]]] = [deque() for _ in range(self.num_envs)]
        self._npending = [0] * self.num_envs
        self._dead: list[WorkerError | None] = [None] * self.num_envs
        self._env_info: list[dict[str, Any]] = [{} for _ in range(self.num_envs)]
        self.num_messages_sent = 0  # command messages written to the pipes (a batch counts once)
        self.num_replies_received = 0  # reply messages read from the pipes (a batched reply counts once)
        self._workers: list[_Worker | None] = [None] * self.num_workers
        self.num_respawns = 0
        self.num_startup_restarts = 0  # workers started again because their first process died during start-up
        self._closed = False
        # one fault-handler file per worker: a native crash's Python stack goes into the start-up error
        self._fault_dir = tempfile.mkdtemp(prefix="pi0-env-faults-")
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, fault_dir=self._fault_dir)
        try:
            for p in range(self.num_workers):
                self._workers[p] = self._start(p)
            for p in range(self.num_workers):
                self._await_first_start(p)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ process management
    def _start(self, index: int) -> _Worker:
        """Start worker process ``index`` (does not wait for its env(s))."""
        parent, child = self._ctx.Pipe(duplex=True)
        overrides = [self._overrides[j] for j in self._proc_envs[index]]
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._fault_log(index))  # a dump of the process this one replaces is not this one's
        proc = self._ctx.Process(target=worker_main, args=(child, self.env_factory, overrides, self.env_options,
                                                           self._fault_log(index)),
                                 name=f"pi0-env-worker-{index}", daemon=True)
        with main_module_hidden(self.env_factory):
            proc.start()
        child.close()  # essential: otherwise the worker's death never shows up as EOF here
        return _Worker(index, proc, parent)

    def _fault_log(self, index: int) -> str:
        """Path of worker ``index``'s fault-handler file."""
        return os.path.join(self._fault_dir, f"worker{index}.txt")

    def _fault_of(self, index: int) -> str:
        """``"; <error> at <frame>"`` from worker ``index``'s fault-handler file, or "" if it wrote none."""
        try:
            with open(self._fault_log(index)) as f:
                summary = fault_summary(f.read())
        except OSError:
            return ""
        return f"; {summary}" if summary else ""

    def _await_first_start(self, index: int) -> None:
        """Wait for worker ``index``; a process that dies during start-up is started again, ``make_attempts`` in all.

        A Python error while building the env is already retried inside the worker; this covers a process that dies
        outright (an abort in native rendering code, the OOM killer) before its env is built.
        """
        o = self.env_options
        tries = 0

        def attempt() -> None:
            nonlocal tries
            tries += 1
            if tries > 1:  # the previous process died: reap it and start another in its place
                _reap(self._workers[index], graceful=False, timeout=5.0)
                self._workers[index] = self._start(index)
                self.num_startup_restarts += 1
            try:
                self._await_ready(index)
            except StartupDeath as exc:
                if tries < o.make_attempts:
                    log.warning("%s; starting it again (%d/%d)", exc, tries + 1, o.make_attempts)
                raise

        try:
            call_with_backoff(attempt, o.make_attempts, o.make_backoff, o.make_backoff_max, retry_on=StartupDeath)
        except StartupDeath as exc:
            raise StartupDeath(f"{exc}; {o.make_attempts} processes in all died during start-up "
                               f"(make_attempts={o.make_attempts})", exc.index, exc.pid) from exc

    def _await_ready(self, index: int) -> None:
        """Wait for worker ``index``'s ready message (env built) or raise EnvCreationError."""
        w = self._workers[index]
        assert w is not None
        try:
            if not w.conn.poll(self.start_timeout):
                raise EnvCreationError(f"env worker {index} did not start within {self.start_timeout}s", index, w.pid)
            kind, payload = recv_obj(w.conn)
        except (EOFError, OSError) as exc:
            w.broken = True
            w.process.join(1.0)  # EOF: it is exiting; reap it so that its exit code can be reported
            raise StartupDeath(f"env worker {index} died during start-up ({exit_description(w.process.exitcode)})"
                               f"{self._fault_of(index)}", index, w.pid) from exc
        except EnvCreationError:
            w.broken = True
            raise
        if kind != "ready":
            w.broken = True
            raise EnvCreationError(f"env worker {index} could not create its env:\n{payload}", index, w.pid)
        for j, info in zip(self._proc_envs[index], payload):
            self._env_info[j] = info

    def env_ready_info(self, index: int) -> dict[str, Any]:
        """What env ``index`` reported when it was (last) built (empty if unknown)."""
        return self._env_info[index]

    def respawn(self, index: int, overrides: Mapping[str, Any] | None = None) -> None:
        """Kill (SIGKILL), reap and restart worker ``index`` (env kwargs updated with ``overrides``).

        Waits until the new env is built; raises EnvCreationError if it cannot be.
        """
        self._check_open()
        if overrides:
            self._overrides[index].update(overrides)
        self._restart_process_of(index)

    def drain(self, index: int, timeout: float | None = None) -> None:
        """Discard pending replies of worker ``index``; respawn it if it is broken or does not answer."""
        w = self._workers[index // self.envs_per_worker]
        try:
            if w is None or w.broken or self._dead[index] is not None:
                raise WorkerDied("broken", index)
            while self.pending(index) > 0:
                try:
                    self.recv(index, timeout)
                except RemoteEnvError:
                    pass
        except WorkerError:
            self.respawn(index)

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to worker ``index`` (for fault injection)."""
        w = self._worker(index)
        os.kill(w.pid, sig)

    # ------------------------------------------------------------------ messaging
    def _worker(self, index: int) -> _Worker:
        """Live handle of the worker process hosting env ``index``."""
        self._check_open()
        w = self._workers[index // self.envs_per_worker]
        if w is None:
            raise WorkerDied(f"env worker {index} is not running", index)
        return w

    def _check_open(self) -> None:
        """Raise if the vec env was closed."""
        if self._closed:
            raise RuntimeError("SubprocVecEnv is closed")

    def _send(self, index: int, cmd: str, payload: dict) -> None:
        """Buffer one command for env ``index``; sent at once for one-env processes, else at the next flush."""
        w = self._worker(index)
        self._buffer(index, w, cmd, payload)
        if self.envs_per_worker == 1:
            self._flush()
            if self._dead[index] is not None:  # the send itself failed: the worker is gone
                self._raise_dead(index)

    def recv(self, index: int, timeout: float | None = None) -> Any:
        """Reply to the oldest pending command of env ``index`` (``timeout`` default: ``step_timeout``).

        Flushes the buffered commands first, then reads batched replies of the env's process until
        one for ``index`` arrived.
        """
        self._check_open()
        p = index // self.envs_per_worker
        timeout = self.step_timeout if timeout is None else timeout
        self._flush()
        while not self._replies[index]:
            if self._dead[index] is not None:
                self._raise_dead(index)
            if self._npending[index] <= 0:
                raise RuntimeError(f"no pending command for env {index}")
            self._read_batch(p, timeout)
        kind, payload = self._replies[index].popleft()
        self._npending[index] -= 1
        if kind == "error":
            w = self._workers[p]
            raise RemoteEnvError(f"env {index} (worker process {p}) raised:\n{payload}", index,
                                 w.pid if w is not None else None, payload)
        return payload

    def wait(self, indices: Sequence[int], timeout: float | None = None) -> list[int]:
        """Indices among ``indices`` whose reply is ready, waiting up to ``timeout``.

        Flushes the buffered commands first; an env counts as ready when its reply was received
        already, its process failed, or a batched reply of its process arrived (read and
        demultiplexed here; it may hold only other envs' replies).
        """
        self._check_open()
        self._flush()

        def ready() -> list[int]:
            return sorted(i for i in indices if self._replies[i] or self._dead[i] is not None)

        if ready():
            return ready()
        procs = {i // self.envs_per_worker for i in indices if self._npending[i] > 0}
        conns = {self._workers[p].conn: p for p in procs if self._workers[p] is not None}
        for c in mpc.wait(list(conns), timeout):
            self._read_batch(conns[c], 0.0)
        return ready()

    def pending(self, index: int) -> int:
        """Number of commands sent to (or buffered for) env ``index`` whose replies were not received yet."""
        self._check_open()
        return self._npending[index]

    # ------------------------------------------------------------------ batching
    def _buffer(self, index: int, w: _Worker, cmd: str, payload: dict) -> None:
        """Queue a command for env ``index`` until the next flush (raise if its env state was lost)."""
        dead = self._dead[index]
        if dead is not None:
            if cmd == "reset" and not w.broken and self._npending[index] == 0:
                self._dead[index] = None  # a reset starts from scratch: the lost state does not matter
            else:
                raise WorkerDied(f"env {index}: its worker process {index // self.envs_per_worker} failed or was "
                                 f"restarted ({dead}); reset or respawn it first", index, w.pid)
        if w.broken:
            raise WorkerDied(f"env worker process {index // self.envs_per_worker} of env {index} is broken; "
                             "respawn it first", index, w.pid)
        self._outbox[index // self.envs_per_worker].append((index, cmd, payload))
        self._npending[index] += 1

    def _flush(self) -> None:
        """Send every process its buffered commands as ONE batch message."""
        m = self.envs_per_worker
        for p, box in enumerate(self._outbox):
            if not box:
                continue
            self._outbox[p] = []
            w = self._workers[p]
            if w is None or w.broken:  # cannot happen: a failure clears the buffers
                self._fail_process(p, WorkerDied, "is broken")
                continue
            try:
                send_obj(w.conn, ("batch", [(j % m, cmd, payload) for j, cmd, payload in box]))
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as exc:
                self._inflight[p].append([j for j, _, _ in box])
                self._fail_process(p, WorkerDied, f"is gone: {exc!r}")
                continue
            self.num_messages_sent += 1
            self._inflight[p].append([j for j, _, _ in box])

    def _fail_process(self, p: int, cls: type[WorkerError], what: str) -> None:
        """Mark process ``p`` broken: every env it hosts fails (``cls`` for envs with pending commands)."""
        w = self._workers[p]
        pid = w.pid if w is not None else None
        if w is not None:
            w.broken = True
            if cls is WorkerDied:
                w.process.join(0.2)  # EOF: it is exiting; reap it so that its exit code can be reported
        code = w.process.exitcode if w is not None else None
        fault = self._fault_of(p) if code is not None else ""
        for j in self._proc_envs[p]:
            kind = cls if self._npending[j] > 0 else WorkerDied
            if self._dead[j] is None or self._npending[j] > 0:
                self._dead[j] = kind(f"env {j}: worker process {p} (pid {pid}, {exit_description(code)}) {what}{fault}",
                                     j, pid)
            self._replies[j].clear()
            self._npending[j] = 0
        self._outbox[p] = []
        self._inflight[p].clear()

    def _raise_dead(self, index: int) -> None:
        """Raise (a fresh copy of) the failure recorded for env ``index``."""
        dead = self._dead[index]
        assert dead is not None
        raise type(dead)(str(dead), dead.index, dead.pid)

    def _read_batch(self, p: int, timeout: float) -> None:
        """Wait up to ``timeout`` for the next batched reply of process ``p`` and demultiplex it."""
        w = self._workers[p]
        assert w is not None
        if not self._inflight[p]:
            raise RuntimeError(f"no batch in flight for env worker process {p}")
        try:
            ready = w.conn.poll(timeout)
        except (EOFError, OSError) as exc:
            self._fail_process(p, WorkerDied, f"is gone: {exc!r}")
            return
        if not ready:
            self._fail_process(p, WorkerTimeout, f"gave no reply within {timeout}s")
            return
        try:
            kind, payload = recv_obj(w.conn)
        except (EOFError, OSError, ConnectionResetError):
            self._fail_process(p, WorkerDied, "died")
            return
        self.num_replies_received += 1
        envs = self._inflight[p].popleft()
        if kind != "batch":  # the worker could not even read the batch: every command failed
            payload = [("error", str(payload))] * len(envs)
        for j, reply in zip(envs, payload):
            self._replies[j].append(reply)

    def _restart_process_of(self, index: int) -> None:
        """Restart the process hosting env ``index``, unless it was already restarted after ``index`` failed."""
        p = index // self.envs_per_worker
        old = self._workers[p]
        if self._dead[index] is not None and old is not None and not old.broken and old.process.is_alive():
            self._dead[index] = None  # fresh process (restarted for another of its envs): nothing to do
            return
        pid = old.pid if old is not None else None
        if old is not None:
            old.broken = True
            _reap(old, graceful=False, timeout=5.0)
        for j in self._proc_envs[p]:  # the other envs lose their state (and any pending reply)
            if j != index and (self._dead[j] is None or self._npending[j] > 0):
                cls = WorkerDied if self._npending[j] == 0 or self._dead[j] is None else type(self._dead[j])
                self._dead[j] = cls(f"env {j}: worker process {p} (pid {pid}) was restarted", j, pid)
            self._replies[j].clear()
            self._npending[j] = 0
        self._dead[index] = None
        self._outbox[p] = []
        self._inflight[p].clear()
        self._workers[p] = self._start(p)
        self.num_respawns += 1
        self._await_ready(p)

    # ------------------------------------------------------------------ introspection
    def worker_pids(self) -> list[int | None]:
        """Process id of the worker of each env (one entry per env; repeated for multi-env workers)."""
        m = self.envs_per_worker
        return [w.pid if w is not None else None for w in (self._workers[i // m] for i in range(self.num_envs))]

    def worker_rss(self, per_process: bool = False) -> list[int]:
        """Resident set size in bytes of the worker of each env (0 if not running).

        One entry per env index; with ``envs_per_worker > 1`` the envs of one process share (and
        repeat) its RSS. ``per_process=True``: one entry per worker process instead.
        """
        import psutil

        out = []
        for w in self._workers:
            try:
                out.append(psutil.Process(w.pid).memory_info().rss if w is not None else 0)
            except psutil.Error:
                out.append(0)
        if per_process:
            return out
        return [out[i // self.envs_per_worker] for i in range(self.num_envs)]

    def is_alive(self, index: int) -> bool:
        """Whether the process of env ``index`` is running and neither it nor the env is marked broken."""
        w = self._workers[index // self.envs_per_worker]
        return w is not None and not w.broken and w.process.is_alive() and self._dead[index] is None

    # ------------------------------------------------------------------ shutdown
    def close(self, timeout: float = 5.0) -> None:
        """Stop and reap all workers; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        _shutdown(self._workers, timeout, fault_dir=self._fault_dir)
        self._finalizer.detach()
