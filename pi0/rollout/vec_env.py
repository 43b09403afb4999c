"""Vector envs: the shared API, the env-factory check, and the in-process vector env.

Per-env async API: ``reset_async / chunk_async / step_async`` send a command to one env, ``recv(i)``
gets its reply, ``wait(indices)`` tells which replies are ready, so finished envs simply get no
commands (no dummy actions needed). ``chunk_async`` executes a whole action chunk next to the env
(one round trip per policy decision) and stops at termination/truncation; images are rendered only
where asked (``render="decision"``: after the last action if the episode continues). The commands
are executed by :class:`pi0.rollout.env_server.EnvServer`: in this process (:class:`SerialVecEnv`)
or in worker processes (:class:`pi0.rollout.subproc_vec_env.SubprocVecEnv`).
"""

from __future__ import annotations

import io
import os
import pickle
from collections import deque
from typing import Any, Mapping, Self, Sequence

import numpy as np

from pi0.rollout.env_server import EnvFactory, EnvOptions, EnvServer, run_command
from pi0.rollout.errors import EnvCreationError, RemoteEnvError

__all__ = ["SerialVecEnv", "VecEnvBase", "check_env_factory"]


class _FactoryChecker(pickle.Pickler):
    """Pickler that refuses torch objects and policies (the model must never enter a worker)."""

    def reducer_override(self, obj: Any) -> Any:
        """Raise for forbidden objects, else defer to normal pickling."""
        tp = type(obj)
        mod = getattr(tp, "__module__", "") or ""
        if mod == "torch" or mod.startswith("torch."):
            raise ValueError(f"env factory captures a torch object ({tp.__module__}.{tp.__qualname__}); "
                             "the policy/model must not be sent to env workers")
        if not isinstance(obj, type) and callable(getattr(obj, "predict_chunks", None)):
            raise ValueError(f"env factory captures a policy ({tp.__qualname__}); the policy must not be sent "
                             "to env workers")
        return NotImplemented


def check_env_factory(factory: EnvFactory, max_bytes: int = 1 << 20) -> int:
    """Check that ``factory`` pickles, holds no torch object / policy and is small; returns its size in bytes."""
    if not callable(factory):
        raise TypeError(f"env factory must be callable, got {type(factory).__name__}")
    buf = io.BytesIO()
    try:
        _FactoryChecker(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(factory)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - report what failed to pickle
        raise ValueError(f"env factory is not picklable (use EnvSpec or a module-level function): {exc}") from exc
    size = buf.tell()
    if size > max_bytes:
        raise ValueError(f"env factory pickles to {size} bytes (> {max_bytes}); it probably captures large state")
    return size


class VecEnvBase:
    """The vector-env API shared by the subprocess and the in-process vector envs (commands, sync helpers)."""

    num_envs: int
    env_options: EnvOptions
    _closed: bool

    def close(self) -> None:  # implemented by subclasses
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def reset_async(self, index: int, *, task_id: int | None = None, init_state_id: int | None = None,
                    seed: int | None = None, render: bool = True, settle_steps: int = 0,
                    settle_action: np.ndarray | None = None) -> None:
        """Ask env ``index`` to reset (optionally to another task / init state); reply via ``recv``."""
        self._send(index, "reset", {"task_id": task_id, "init_state_id": init_state_id, "seed": seed,
                                    "render": render, "settle_steps": settle_steps, "settle_action": settle_action})

    def chunk_async(self, index: int, actions: np.ndarray, render: str = "decision",
                    record_frames: bool = False) -> None:
        """Ask env ``index`` to execute an ``(n, action_dim)`` chunk (see ``_EnvServer.chunk``)."""
        self._send(index, "chunk", {"actions": np.asarray(actions), "render": render, "record_frames": record_frames})

    def step_async(self, index: int, action: np.ndarray, render: bool = True) -> None:
        """Ask env ``index`` for one ``(action_dim,)`` step (a chunk of one; final obs rendered iff ``render``)."""
        self.chunk_async(index, np.asarray(action)[None], render="always" if render else "none")

    # synchronous conveniences
    def reset(self, index: int, **kwargs: Any) -> dict[str, Any]:
        """Synchronous :meth:`reset_async` + :meth:`recv`."""
        self.reset_async(index, **kwargs)
        return self.recv(index)

    def chunk(self, index: int, actions: np.ndarray, render: str = "decision", record_frames: bool = False) -> dict:
        """Synchronous :meth:`chunk_async` + :meth:`recv`."""
        self.chunk_async(index, actions, render, record_frames)
        return self.recv(index)

    def step(self, index: int, action: np.ndarray, render: bool = True) -> dict[str, Any]:
        """Synchronous single step; returns the chunk reply (``n == 1``)."""
        self.step_async(index, action, render)
        return self.recv(index)

    def worker_info(self, index: int) -> dict[str, Any]:
        """Pid, RSS and imported-module facts of worker ``index``."""
        self._send(index, "info", {})
        return self.recv(index)

    def _send(self, index: int, cmd: str, payload: dict) -> None:  # pragma: no cover - abstract
        """Send one command to env ``index``."""
        raise NotImplementedError

    def recv(self, index: int, timeout: float | None = None) -> Any:  # pragma: no cover - abstract
        """Reply to the oldest pending command of env ``index``."""
        raise NotImplementedError

    def env_ready_info(self, index: int) -> dict[str, Any]:  # pragma: no cover - abstract
        """What env ``index`` reported when it was (last) built: ``EnvServer.describe()``."""
        raise NotImplementedError


class SerialVecEnv(VecEnvBase):
    """In-process vector env with the same API (no subprocesses): baseline, debugging, tests."""

    def __init__(self, env_factory: EnvFactory, num_envs: int, *, make_attempts: int = 3, make_backoff: float = 0.5,
                 make_backoff_max: float = 30.0, recreate_every: int | None = None,
                 worker_overrides: Sequence[Mapping[str, Any]] | None = None, **_: Any) -> None:
        """Build ``num_envs`` envs in this process (extra keyword arguments are ignored)."""
        self.env_factory = env_factory
        self.num_envs = int(num_envs)
        self.env_options = EnvOptions(int(make_attempts), float(make_backoff), float(make_backoff_max), recreate_every)
        self._overrides = [dict(o) for o in worker_overrides] if worker_overrides else [{} for _ in range(num_envs)]
        self._servers: list[EnvServer | None] = [None] * self.num_envs
        self._replies: list[deque] = [deque() for _ in range(self.num_envs)]
        self.num_respawns = 0
        self._closed = False
        self._build_all()

    def _build_all(self) -> None:
        """Build every env (one after the other)."""
        for i in range(self.num_envs):
            self._servers[i] = self._build(i)

    def _build(self, index: int) -> EnvServer:
        """Create env server ``index``."""
        try:
            return EnvServer(self.env_factory, self._overrides[index], self.env_options)
        except EnvCreationError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise EnvCreationError(f"env {index} could not be created: {exc!r}", index, os.getpid()) from exc

    def _send(self, index: int, cmd: str, payload: dict) -> None:
        """Run the command now and queue its reply."""
        if self._closed:
            raise RuntimeError("SerialVecEnv is closed")
        server = self._servers[index]
        assert server is not None
        self._replies[index].append(run_command(server, cmd, payload))  # errors surface in recv, as from a worker

    def env_ready_info(self, index: int) -> dict[str, Any]:
        """``describe()`` of env ``index`` (empty if it is not built)."""
        server = self._servers[index]
        return server.describe() if server is not None else {}

    def recv(self, index: int, timeout: float | None = None) -> Any:
        """Queued reply of env ``index``."""
        if not self._replies[index]:
            raise RuntimeError(f"no pending command for env {index}")
        kind, payload = self._replies[index].popleft()
        if kind == "error":
            raise RemoteEnvError(f"env {index} raised:\n{payload}", index, os.getpid(), payload)
        return payload

    def wait(self, indices: Sequence[int], timeout: float | None = None) -> list[int]:
        """Indices with a queued reply."""
        return sorted(i for i in indices if self._replies[i])

    def pending(self, index: int) -> int:
        """Number of queued replies of env ``index``."""
        return len(self._replies[index])

    def drain(self, index: int, timeout: float | None = None) -> None:
        """Discard queued replies of env ``index``."""
        self._replies[index].clear()

    def respawn(self, index: int, overrides: Mapping[str, Any] | None = None) -> None:
        """Re-create env ``index`` (env kwargs updated with ``overrides``)."""
        if overrides:
            self._overrides[index].update(overrides)
        old = self._servers[index]
        if old is not None:
            old.close()
        self._replies[index].clear()
        self._servers[index] = self._build(index)
        self.num_respawns += 1

    def worker_pids(self) -> list[int]:
        """This process's id for every env."""
        return [os.getpid()] * self.num_envs

    def worker_rss(self) -> list[int]:
        """RSS of this process for every env (they share it)."""
        import psutil

        return [psutil.Process().memory_info().rss] * self.num_envs

    def is_alive(self, index: int) -> bool:
        """True while not closed."""
        return not self._closed

    def close(self, timeout: float = 5.0) -> None:
        """Close all envs (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for s in self._servers:
            if s is not None:
                s.close()
