"""The arena behind a simulated network API: every reset / step waits ``latency_s`` like a round trip.

Stands in for I/O-bound envs (a remote simulator, an HTTP/RPC env server) to exercise and benchmark the
thread and asyncio rollout backends. ``reset`` / ``step`` block (``time.sleep``); ``areset`` / ``astep``
are native coroutines (``asyncio.sleep``) that the asyncio backend awaits.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from pi0.envs.arena.env import ArenaEnv

__all__ = ["RemoteArenaEnv"]


class RemoteArenaEnv(ArenaEnv):
    """:class:`ArenaEnv` whose every call costs ``latency_s`` seconds of waiting (not CPU)."""

    def __init__(self, *args: Any, latency_s: float = 0.01, **kwargs: Any) -> None:
        """``latency_s``: emulated round trip per reset / step (>= 0); other arguments as ArenaEnv."""
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s}")
        super().__init__(*args, **kwargs)
        self.latency_s = float(latency_s)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict, dict]:
        """Blocking reset: wait, then ArenaEnv.reset."""
        time.sleep(self.latency_s)
        return super().reset(seed=seed, options=options)

    def step(self, action: np.ndarray, render: bool | None = None) -> tuple[dict, float, bool, bool, dict]:
        """Blocking step: wait, then ArenaEnv.step."""
        time.sleep(self.latency_s)
        return super().step(action, render=render)

    async def areset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict, dict]:
        """Coroutine reset: await the round trip, then ArenaEnv.reset."""
        await asyncio.sleep(self.latency_s)
        return ArenaEnv.reset(self, seed=seed, options=options)

    async def astep(self, action: np.ndarray, render: bool | None = None) -> tuple[dict, float, bool, bool, dict]:
        """Coroutine step: await the round trip, then ArenaEnv.step."""
        await asyncio.sleep(self.latency_s)
        return ArenaEnv.step(self, action, render=render)
