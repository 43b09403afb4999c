"""Thread and asyncio backends: in-process envs whose commands run concurrently.

For I/O-bound envs (a remote simulator, an env behind an HTTP/RPC API) threads give the
concurrency of worker processes without their cost: while one env waits on its server, the others
step. :class:`ThreadVecEnv` runs each env's commands on its own thread; :class:`AsyncioVecEnv` runs
them as coroutines on one event loop, awaiting an env's native ``areset`` / ``astep`` (plain envs
are stepped with ``asyncio.to_thread``). The runner uses them with ``RunnerConfig(use_subprocess=False,
in_process="thread" | "asyncio")`` and gets the same :class:`~pi0.rollout.types.Episode` records as
with every other backend. CPU-bound simulators want
:class:`~pi0.rollout.subproc_vec_env.SubprocVecEnv` instead (the GIL).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from typing import Any, Mapping, Sequence

from pi0.rollout.env_server import EnvFactory, arun_command, run_command
from pi0.rollout.errors import RemoteEnvError, WorkerDied, WorkerTimeout
from pi0.rollout.vec_env import SerialVecEnv

__all__ = ["AsyncioVecEnv", "ThreadVecEnv"]


class ThreadVecEnv(SerialVecEnv):
    """:class:`SerialVecEnv` whose envs are built and driven in their own thread each (commands of one env in order).

    ``step_timeout`` bounds ``recv``: an env that does not answer in time raises
    :class:`WorkerTimeout` and is broken until :meth:`respawn` (its hung thread is abandoned).
    """

    def __init__(self, env_factory: EnvFactory, num_envs: int, *, step_timeout: float = 120.0, **kwargs: Any) -> None:
        """Build ``num_envs`` envs in parallel, one thread each."""
        self.step_timeout = float(step_timeout)
        self._pools = [self._new_pool(i) for i in range(int(num_envs))]
        self._futures: list[deque[Future]] = [deque() for _ in range(int(num_envs))]
        self._broken = [False] * int(num_envs)
        super().__init__(env_factory, num_envs, **kwargs)

    @staticmethod
    def _new_pool(index: int) -> ThreadPoolExecutor:
        """The one thread of env ``index``."""
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pi0-env-{index}")

    def _build_all(self) -> None:
        """Build every env in its own thread (env creation may wait on I/O too)."""
        builds = [pool.submit(self._build, i) for i, pool in enumerate(self._pools)]
        try:
            for i, fut in enumerate(builds):
                self._servers[i] = fut.result()
        except BaseException:
            self.close()
            raise

    def _send(self, index: int, cmd: str, payload: dict) -> None:
        """Queue the command on the env's thread."""
        if self._closed:
            raise RuntimeError("ThreadVecEnv is closed")
        if self._broken[index]:
            raise WorkerDied(f"env {index} timed out earlier; respawn it first", index, os.getpid())
        self._futures[index].append(self._submit(index, cmd, payload))

    def _submit(self, index: int, cmd: str, payload: dict) -> Future:
        """Run the command on env ``index``'s thread; its future holds ``(kind, result)``."""
        server = self._servers[index]
        assert server is not None
        return self._pools[index].submit(run_command, server, cmd, payload)

    def recv(self, index: int, timeout: float | None = None) -> Any:
        """Reply to the oldest pending command of env ``index`` (``timeout`` default: ``step_timeout``)."""
        if not self._futures[index]:
            raise RuntimeError(f"no pending command for env {index}")
        timeout = self.step_timeout if timeout is None else timeout
        try:
            kind, payload = self._futures[index][0].result(timeout)
        except FutureTimeout:
            self._broken[index] = True
            raise WorkerTimeout(f"env {index} gave no reply within {timeout}s", index, os.getpid()) from None
        self._futures[index].popleft()
        if kind == "error":
            raise RemoteEnvError(f"env {index} raised:\n{payload}", index, os.getpid(), payload)
        return payload

    def wait(self, indices: Sequence[int], timeout: float | None = None) -> list[int]:
        """Indices among ``indices`` whose oldest command finished, waiting up to ``timeout``."""
        heads = {self._futures[i][0]: i for i in indices if self._futures[i]}
        if not heads:
            return []
        done, _ = wait_futures(list(heads), timeout, return_when=FIRST_COMPLETED)
        return sorted(heads[f] for f in done)

    def pending(self, index: int) -> int:
        """Number of commands of env ``index`` whose replies were not received yet."""
        return len(self._futures[index])

    def drain(self, index: int, timeout: float | None = None) -> None:
        """Discard pending replies of env ``index``; respawn it if it does not answer."""
        try:
            while self._futures[index]:
                try:
                    self.recv(index, timeout)
                except RemoteEnvError:
                    pass
        except WorkerTimeout:
            self.respawn(index)

    def respawn(self, index: int, overrides: Mapping[str, Any] | None = None) -> None:
        """Re-create env ``index`` on a fresh thread (a hung thread is abandoned, its env closed when it returns)."""
        if overrides:
            self._overrides[index].update(overrides)
        old, pool = self._servers[index], self._pools[index]
        if old is not None:
            pool.submit(old.close)  # runs after whatever the old thread is still doing
        pool.shutdown(wait=False, cancel_futures=True)
        self._futures[index].clear()
        self._broken[index] = False
        self._pools[index] = self._new_pool(index)
        self._servers[index] = self._pools[index].submit(self._build, index).result()
        self.num_respawns += 1

    def close(self, timeout: float = 5.0) -> None:
        """Close every env on its own thread and stop the threads (idempotent; hung threads are not waited for)."""
        if self._closed:
            return
        self._closed = True
        for i, pool in enumerate(self._pools):
            server = self._servers[i]
            if server is not None:
                pool.submit(server.close)
            pool.shutdown(wait=not self._broken[i], cancel_futures=False)


class AsyncioVecEnv(ThreadVecEnv):
    """:class:`ThreadVecEnv` whose commands are coroutines on one event loop (a daemon thread of this process).

    Envs are built on their threads; commands of one env run in order (a lock per env), commands of
    different envs interleave at every ``await``.
    """

    def __init__(self, env_factory: EnvFactory, num_envs: int, **kwargs: Any) -> None:
        """Start the event loop, then build the envs."""
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="pi0-env-asyncio", daemon=True)
        self._loop_thread.start()
        self._locks = [asyncio.Lock() for _ in range(int(num_envs))]
        try:
            super().__init__(env_factory, num_envs, **kwargs)
        except BaseException:
            self._stop_loop()
            raise

    def _submit(self, index: int, cmd: str, payload: dict) -> Future:
        """Schedule the command on the event loop; its future holds ``(kind, result)``."""
        server = self._servers[index]
        assert server is not None

        async def run() -> tuple[str, Any]:
            async with self._locks[index]:
                return await arun_command(server, cmd, payload)

        return asyncio.run_coroutine_threadsafe(run(), self._loop)

    def respawn(self, index: int, overrides: Mapping[str, Any] | None = None) -> None:
        """Cancel env ``index``'s pending coroutines, then re-create it (see :meth:`ThreadVecEnv.respawn`)."""
        for fut in self._futures[index]:
            fut.cancel()
        self._locks[index] = asyncio.Lock()
        super().respawn(index, overrides)

    def _stop_loop(self) -> None:
        """Stop the event loop and its thread."""
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(5.0)

    def close(self, timeout: float = 5.0) -> None:
        """Close the envs, then stop the event loop (idempotent)."""
        if self._closed:
            return
        super().close(timeout)
        self._stop_loop()
