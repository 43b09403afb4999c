"""Typed failures of env workers (raised by the vector envs, handled by the runner)."""

from __future__ import annotations

__all__ = ["EnvCreationError", "RemoteEnvError", "StartupDeath", "WorkerDied", "WorkerError", "WorkerTimeout"]


class WorkerError(RuntimeError):
    """A worker failed; ``index`` is the env index, ``pid`` the worker's process id."""

    def __init__(self, message: str, index: int = -1, pid: int | None = None) -> None:
        super().__init__(message)
        self.index = index
        self.pid = pid


class WorkerDied(WorkerError):
    """The worker process is gone (EOF on its pipe, broken pipe, or it exited)."""


class WorkerTimeout(WorkerError):
    """The worker did not answer within the timeout (hung, stopped, or far too slow)."""


class RemoteEnvError(WorkerError):
    """The env raised inside the worker; ``remote_traceback`` holds the worker's traceback."""

    def __init__(self, message: str, index: int = -1, pid: int | None = None, remote_traceback: str = "") -> None:
        super().__init__(message, index, pid)
        self.remote_traceback = remote_traceback


class EnvCreationError(WorkerError):
    """The env could not be created, even after all retries."""


class StartupDeath(EnvCreationError):
    """The worker process died before it reported its env built (a signal, or an abort in native code)."""
