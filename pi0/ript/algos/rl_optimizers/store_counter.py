"""A global integer counter on a ``torch.distributed`` key-value store (multi-node runs).

``StoreGlobalCounter(store, key)`` has the same interface as
:class:`~pi0.ript.algos.rl_optimizers.file_counter.FileGlobalCounter`: ``update(n)`` is one atomic
``store.add`` (returns the new value), ``get()`` is ``add(key, 0)``, and ``reset(value)`` is an
atomic compare-and-swap loop (``compare_set``), so it is linearizable with concurrent updates.
``store`` is any ``torch.distributed.Store`` (``TCPStore``, ``FileStore``, a process group's store).
:meth:`StoreGlobalCounter.connect` builds a ``TCPStore`` client; such counters pickle to their
address and reconnect lazily in the receiving process. torch is imported lazily.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

__all__ = ["StoreGlobalCounter"]


class StoreGlobalCounter:
    """Integer counter under ``prefix + key`` in a torch.distributed store."""

    def __init__(self, store: Any, key: str = "global_counter", prefix: str = "pi0/counter/") -> None:
        """Wrap an existing store (not picklable unless created with :meth:`connect`)."""
        self._store = store
        self.key = f"{prefix}{key}"
        self._addr: tuple[str, int, float] | None = None

    @classmethod
    def connect(cls, host: str, port: int, key: str = "global_counter", timeout: float = 60.0,
                prefix: str = "pi0/counter/") -> "StoreGlobalCounter":
        """Counter on a ``TCPStore`` client connected to ``host:port`` (the server must exist)."""
        self = cls(None, key, prefix="")
        self.key = f"{prefix}{key}"
        self._addr = (host, int(port), float(timeout))
        return self

    @property
    def store(self) -> Any:
        """The underlying store (connects lazily for :meth:`connect` counters)."""
        if self._store is None:
            if self._addr is None:
                raise RuntimeError("counter has no store")
            import torch.distributed as dist

            host, port, timeout = self._addr
            self._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
        return self._store

    def update(self, n: int = 1) -> int:
        """Add ``n`` atomically and return the new value."""
        return int(self.store.add(self.key, int(n)))

    def get(self) -> int:
        """Current value (0 if never set)."""
        return int(self.store.add(self.key, 0))

    def reset(self, value: int = 0) -> None:
        """Atomically set the value (compare-and-swap retried until no update slips in between)."""
        desired = str(int(value))
        while True:
            current = str(self.get())
            got = self.store.compare_set(self.key, current, desired)
            if (got.decode() if isinstance(got, bytes) else str(got)) == desired:
                return

    def cleanup(self) -> None:
        """Delete the key from the store (idempotent)."""
        try:
            self.store.delete_key(self.key)
        except RuntimeError:
            pass

    def close(self) -> None:
        """Drop the store connection of a :meth:`connect` counter (nothing else changes)."""
        if self._addr is not None:
            self._store = None

    def __enter__(self) -> "StoreGlobalCounter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()

    def __getstate__(self) -> dict[str, Any]:
        if self._addr is None:
            raise TypeError("a StoreGlobalCounter wrapping a live store cannot be pickled; "
                            "use StoreGlobalCounter.connect(host, port, key)")
        return {"key": self.key, "addr": self._addr}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._store = None
        self.key = state["key"]
        self._addr = tuple(state["addr"])

    def __repr__(self) -> str:
        return f"StoreGlobalCounter(key={self.key!r})"
