"""A global integer counter shared by processes on one machine (or a shared POSIX filesystem).

``FileGlobalCounter(path)`` keeps the value as text in ``path`` and serialises access with
``fcntl.flock`` on ``path + ".lock"``: ``update``/``reset`` take the lock exclusively, ``get`` takes
it shared. The value is a fixed-width decimal record rewritten in place with a single ``pwrite``
(no truncate, no rename: a process killed mid-update cannot leave a torn value, and it is ~10x
faster than write-to-temp + rename on ext4). ``durable=True`` adds an ``fsync`` per write. A
``threading.Lock`` additionally serialises threads of one process (``flock`` does not exclude
threads sharing one open file). Instances pickle to their path, so they can be handed to spawned
processes.

Cleanup: ``with FileGlobalCounter(path) as c: ...`` removes the value file, the lock file and the
directories the counter had to create when the block exits; :meth:`cleanup` does the same
explicitly (idempotent). It takes the exclusive lock first, so it never removes the files in the
middle of another process's update. Only call it when no other process will use the counter any
more (e.g. rank 0 after a barrier): a process that touches the counter after the removal
re-creates the files (and locks a different inode than a process still holding the old one).
:meth:`close` only closes this handle's file descriptors (also done when the handle is garbage
collected); the counter itself stays.
"""

from __future__ import annotations

import fcntl
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

__all__ = ["FileGlobalCounter"]

_WIDTH = 24  # characters of the value record (any int64, with sign)


class FileGlobalCounter:
    """Process-safe integer counter stored in a file, guarded by ``flock`` on ``<path>.lock``."""

    def __init__(self, path: str | os.PathLike[str], durable: bool = False) -> None:
        """Open (creating if needed) the counter at ``path``; ``durable`` fsyncs every write."""
        self.path = Path(path)
        self.lock_path = Path(f"{self.path}.lock")
        self.durable = bool(durable)
        self._tlock = threading.Lock()
        self._fds: tuple[int, int] | None = None  # (lock fd, data fd)
        self._fd_pid: int | None = None
        # Directories created here (deepest first), removed again by cleanup() if they are empty.
        self._created_dirs: list[Path] = []
        missing = self.path.parent
        while not missing.exists():
            self._created_dirs.append(missing)
            missing = missing.parent
        self.path.parent.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ locking
    def _open(self) -> tuple[int, int]:
        """(lock fd, data fd), (re)opened after a fork or a close."""
        if self._fds is None or self._fd_pid != os.getpid():
            lock = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            data = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            self._fds, self._fd_pid = (lock, data), os.getpid()
        return self._fds

    @contextmanager
    def _locked(self, exclusive: bool) -> Iterator[int]:
        """Hold the thread lock and the file lock (exclusive or shared); yields the data fd."""
        with self._tlock:
            lock, data = self._open()
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield data
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    @staticmethod
    def _read(fd: int) -> int:
        """Current value (0 for an empty file); caller holds the lock."""
        text = os.pread(fd, _WIDTH + 1, 0).strip()
        return int(text) if text else 0

    def _write(self, fd: int, value: int) -> None:
        """Overwrite the fixed-width record in one pwrite; caller holds the exclusive lock."""
        os.pwrite(fd, f"{int(value):>{_WIDTH}d}\n".encode(), 0)
        if self.durable:
            os.fsync(fd)

    # ------------------------------------------------------------------ API
    def update(self, n: int = 1) -> int:
        """Add ``n`` atomically and return the new value."""
        with self._locked(exclusive=True) as fd:
            value = self._read(fd) + int(n)
            self._write(fd, value)
            return value

    def get(self) -> int:
        """Current value (shared lock: never sees a half-done update)."""
        with self._locked(exclusive=False) as fd:
            return self._read(fd)

    def reset(self, value: int = 0) -> None:
        """Set the value atomically (under the exclusive lock)."""
        with self._locked(exclusive=True) as fd:
            self._write(fd, value)

    def close(self) -> None:
        """Close this instance's file descriptors (the counter itself stays)."""
        with self._tlock:
            if self._fds is not None and self._fd_pid == os.getpid():
                for fd in self._fds:
                    os.close(fd)
            self._fds = None
            self._fd_pid = None

    def cleanup(self) -> None:
        """Remove the value file, the lock file and the (now empty) directories this handle created; idempotent.

        The files are removed while holding the exclusive lock, so an update running in another
        process completes first. Call it only once no other process will use the counter again.
        """
        self.close()
        with self._tlock:
            try:
                lock = os.open(self.lock_path, os.O_RDWR)  # no O_CREAT: never re-create what is being removed
            except FileNotFoundError:
                lock = None
            try:
                if lock is not None:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                for p in (self.path, self.lock_path):
                    try:
                        p.unlink()
                    except FileNotFoundError:
                        pass
            finally:
                if lock is not None:
                    os.close(lock)  # releases the flock
            for d in self._created_dirs:  # deepest first
                try:
                    d.rmdir()
                except FileNotFoundError:
                    continue
                except OSError:  # not empty (other files / counters): neither are its parents
                    break

    def __del__(self) -> None:
        # Do not leak this handle's descriptors when it is dropped without close(). No lock here: nothing
        # else can use an unreachable handle (and a thread lock copied by fork() may be held forever).
        fds, pid = getattr(self, "_fds", None), getattr(self, "_fd_pid", None)
        if fds is not None and pid == os.getpid():
            self._fds = None
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def __enter__(self) -> "FileGlobalCounter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path), "durable": self.durable}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["durable"])

    def __repr__(self) -> str:
        return f"FileGlobalCounter({str(self.path)!r})"
