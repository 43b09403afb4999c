"""The worker (env server) side of the vector envs: env creation with retries, the command set, the worker loop.

Render-on-demand convention (shared with ``LiberoEnv`` and ``ArenaEnv``): an env whose
``unwrapped.render_on_demand`` is True gets ``step(action, render=bool)`` and
``reset(options={"render": bool})``; a missing image is obtained with
``get_observation(render=True)``. Which observation keys are images is the env's own
``unwrapped.image_keys`` (none declared: nothing is rendered on demand or stripped); observations
that were not asked to be rendered are sent back without them, to keep the pipes light. Settle
steps after a reset use the env's ``unwrapped.wait_action`` unless the caller gives an action.

Commands: ``reset``, ``chunk`` (a whole action chunk in one round trip) and ``info`` (process facts),
written once as generators of env calls and driven synchronously (workers, serial and thread backends)
or with asyncio (envs with native ``areset`` / ``astep`` coroutines, e.g. behind a network API).
Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import inspect
import multiprocessing.connection as mpc
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Generator, Mapping

import numpy as np

from pi0.envs.conventions import upright
from pi0.rollout.errors import EnvCreationError
from pi0.rollout.transport import recv_obj, send_obj

__all__ = ["EnvFactory", "EnvOptions", "EnvServer", "RENDER_MODES", "arun_command", "call_with_backoff",
           "make_env_with_retry", "run_command", "worker_main"]

EnvFactory = Callable[..., Any]  # factory(**overrides) -> gymnasium.Env
EnvCalls = Generator[tuple[str, tuple, dict], Any, Any]  # a command: yields (env method, args, kwargs), gets results
RENDER_MODES = ("decision", "always", "none")


@dataclass(frozen=True)
class EnvOptions:
    """How env servers build their env: creation attempts with exponential backoff, periodic re-creation."""

    make_attempts: int = 3  # env creation attempts per (re)start
    make_backoff: float = 0.5  # first retry delay in seconds (doubles each attempt)
    make_backoff_max: float = 30.0  # cap on the retry delay
    recreate_every: int | None = None  # re-create the env every N episodes (resets)

    def __post_init__(self) -> None:
        """Reject impossible settings."""
        if self.make_attempts < 1:
            raise ValueError(f"make_attempts must be >= 1, got {self.make_attempts}")


def call_with_backoff(fn: Callable[[], Any], attempts: int, backoff: float = 0.5, backoff_max: float = 30.0,
                      retry_on: type[BaseException] | tuple[type[BaseException], ...] = Exception,
                      sleep: Callable[[float], None] = time.sleep) -> Any:
    """Call ``fn()`` up to ``attempts`` times, sleeping ``backoff * 2**k`` (capped at ``backoff_max``) between tries.

    Only ``retry_on`` exceptions are retried; the last one is re-raised once the attempts are used up.
    """
    if attempts < 1:
        raise ValueError("attempts must be >= 1")
    for k in range(attempts):
        try:
            return fn()
        except retry_on:
            if k + 1 >= attempts:
                raise
            sleep(min(backoff * (2 ** k), backoff_max))
    raise AssertionError("unreachable")  # pragma: no cover


def make_env_with_retry(factory: EnvFactory, overrides: Mapping[str, Any] | None = None, attempts: int = 3,
                        backoff: float = 0.5, backoff_max: float = 30.0,
                        sleep: Callable[[float], None] = time.sleep) -> Any:
    """Call ``factory(**overrides)`` up to ``attempts`` times, sleeping ``backoff * 2**k`` (capped) between tries."""
    if attempts < 1:
        raise ValueError("attempts must be >= 1")
    kwargs = dict(overrides or {})
    try:
        return call_with_backoff(lambda: factory(**kwargs), attempts, backoff, backoff_max, sleep=sleep)
    except Exception as exc:  # noqa: BLE001 - every creation failure becomes an EnvCreationError
        raise EnvCreationError(f"env creation failed after {attempts} attempts: {exc!r}") from exc


_TRANSPARENT_WRAPPERS = ("OrderEnforcing", "PassiveEnvChecker")


class EnvServer:
    """Executes vec-env commands on one env; used inside workers and by the in-process vector envs."""

    def __init__(self, factory: EnvFactory, overrides: Mapping[str, Any] | None, options: EnvOptions) -> None:
        """Build the env (retrying as ``options`` say)."""
        self.factory = factory
        self.overrides = dict(overrides or {})
        self.options = options
        self.env: Any = None
        self.num_makes = 0
        self.episodes_since_make = 0
        self._make()

    # ------------------------------------------------------------------ env creation
    def _make(self) -> None:
        """(Re)create the env with the current overrides and inspect its capabilities."""
        self.close()
        o = self.options
        self.env = make_env_with_retry(self.factory, self.overrides, o.make_attempts, o.make_backoff,
                                       o.make_backoff_max)
        self.num_makes += 1
        self.episodes_since_make = 0
        env, direct = self.env, True
        while hasattr(env, "env") and env is not getattr(env, "unwrapped", env):
            if type(env).__name__ not in _TRANSPARENT_WRAPPERS:
                direct = False
            env = env.env
        self.unwrapped = getattr(self.env, "unwrapped", self.env)
        # Call the unwrapped env directly when only gym's bookkeeping wrappers sit on top, so the
        # LIBERO-style ``step(action, render=...)`` keyword reaches it.
        self.base = self.unwrapped if direct else self.env
        self.on_demand = bool(getattr(self.unwrapped, "render_on_demand", False))
        # The env's own conventions: which observation keys are images, what its do-nothing action is.
        self.image_keys: tuple[str, ...] = tuple(getattr(self.unwrapped, "image_keys", ()))
        self.wait_action: tuple[float, ...] | None = getattr(self.unwrapped, "wait_action", None)
        try:
            self.step_takes_render = "render" in inspect.signature(self.base.step).parameters
        except (TypeError, ValueError):
            self.step_takes_render = False

    def describe(self) -> dict[str, Any]:
        """Small description of the env, sent back to the main process."""
        u = self.unwrapped
        return {"pid": os.getpid(), "task_id": getattr(u, "task_id", None), "prompt": getattr(u, "prompt", None),
                "num_init_states": getattr(u, "num_init_states", None), "render_on_demand": self.on_demand,
                "supports_task_switch": bool(getattr(u, "supports_task_switch", False)),
                # a switch that rebuilds the simulator inside the env (MetaWorld: ~1 s against ~40 ms) is not cheap
                "cheap_task_switch": bool(getattr(u, "cheap_task_switch", getattr(u, "supports_task_switch", False))),
                "num_makes": self.num_makes,
                "image_keys": self.image_keys}

    def close(self) -> None:
        """Close the env (idempotent)."""
        if self.env is not None:
            try:
                self.env.close()
            finally:
                self.env = None

    # ------------------------------------------------------------------ primitives
    def _with_images(self, obs: dict, render: bool) -> dict:
        """Ensure images are present iff ``render`` (renders on demand, strips otherwise)."""
        keys = self.image_keys
        has = all(k in obs for k in keys)
        if render and not has:
            get = getattr(self.unwrapped, "get_observation", None)
            if get is None:
                raise RuntimeError("env returned no images and has no get_observation(render=True)")
            obs = get(render=True)
        elif not render and any(k in obs for k in keys):
            obs = {k: v for k, v in obs.items() if k not in keys}
        return obs

    def _step(self, action: np.ndarray, render: bool) -> EnvCalls:
        """One env step with images iff ``render`` -> (obs, reward, terminated, truncated, info)."""
        kwargs = {"render": render} if self.on_demand and self.step_takes_render else {}
        obs, r, term, trunc, info = yield "step", (action,), kwargs
        return self._with_images(obs, render), float(r), bool(term), bool(trunc), info

    # ------------------------------------------------------------------ commands
    # Commands are generators that yield the env calls they need, ``(name, args, kwargs)`` with name
    # "reset" or "step", and receive the results: ``handle`` makes the calls directly, ``ahandle``
    # awaits an env's native ``areset`` / ``astep`` coroutines (or runs the call in a thread).
    def _reset(self, task_id: int | None = None, init_state_id: int | None = None, seed: int | None = None,
               render: bool = True, settle_steps: int = 0, settle_action: np.ndarray | None = None) -> EnvCalls:
        """Reset (switching task / re-creating the env if needed) and run ``settle_steps`` settle actions."""
        options: dict[str, Any] = {}
        every = self.options.recreate_every
        remake = bool(every) and self.episodes_since_make >= int(every)
        # Single-task envs (no ``task_id`` attribute) ignore task ids.
        if task_id is not None and hasattr(self.unwrapped, "task_id") and self.unwrapped.task_id != task_id:
            if getattr(self.unwrapped, "supports_task_switch", False):
                options["task_id"] = task_id
            else:
                remake = True
            self.overrides["task_id"] = task_id
        if remake:
            self._make()
            options.pop("task_id", None)
        if init_state_id is not None:
            options["init_state_id"] = init_state_id
        if self.on_demand:
            options["render"] = bool(render) and settle_steps == 0
        obs, info = yield "reset", (), {"seed": seed, "options": options}
        self.episodes_since_make += 1
        if settle_steps:
            if settle_action is None:
                settle_action = self.wait_action
            if settle_action is None:
                raise ValueError("settle_steps > 0 needs a settle_action: this env declares no wait_action")
            act = np.asarray(settle_action, np.float64)
            for k in range(settle_steps):
                obs, _, _, _, info = yield from self._step(act, render and k == settle_steps - 1)
        u = self.unwrapped
        return {"obs": self._with_images(obs, render), "info": info, "prompt": getattr(u, "prompt", None),
                "task_id": getattr(u, "task_id", task_id), "num_makes": self.num_makes}

    def _chunk(self, actions: np.ndarray, render: str = "decision", record_frames: bool = False) -> EnvCalls:
        """Execute up to ``len(actions)`` steps, stopping at termination/truncation.

        ``render``: "decision" renders the final obs only if the episode continues, "always"
        renders it in any case, "none" never. ``record_frames`` renders every step and returns
        upright agentview frames. Returns obs (final), rewards ``(k,)``, n (= k executed),
        terminated, truncated, info and frames.
        """
        if render not in RENDER_MODES:
            raise ValueError(f"render must be one of {RENDER_MODES}, got {render!r}")
        actions = np.asarray(actions)
        n = len(actions)
        rewards = np.zeros(n, dtype=np.float64)
        frames: list[np.ndarray] = []
        obs, info, term, trunc, k = None, {}, False, False, 0
        t0 = time.perf_counter()
        for k in range(n):
            want = record_frames or (render != "none" and k == n - 1)
            obs, rewards[k], term, trunc, info = yield from self._step(actions[k], want)
            if record_frames:
                frames.append(upright(obs[self.image_keys[0]]))
            if term or trunc:
                break
        k += 1 if n else 0
        done = term or trunc
        final_render = (render == "always") or (render == "decision" and not done)
        if obs is not None:
            obs = self._with_images(obs, final_render)
        return {"obs": obs, "rewards": rewards[:k], "n": k, "terminated": term, "truncated": trunc, "info": info,
                "frames": frames if record_frames else None, "env_time": time.perf_counter() - t0}

    def info(self) -> dict[str, Any]:
        """Process facts: pid, RSS, and whether torch / the model code was imported here."""
        import psutil

        d = self.describe()
        d.update(rss=psutil.Process().memory_info().rss, torch_imported="torch" in sys.modules,
                 modules=len(sys.modules))
        return d

    def _command(self, cmd: str, payload: dict) -> EnvCalls:
        """Dispatch one command ("reset", "chunk" or "info")."""
        if cmd == "reset":
            return (yield from self._reset(**payload))
        if cmd == "chunk":
            return (yield from self._chunk(**payload))
        if cmd == "info":
            return self.info()
        raise ValueError(f"unknown command {cmd!r}")

    def handle(self, cmd: str, payload: dict) -> Any:
        """Run one command, calling the env directly."""
        calls, result = self._command(cmd, payload), None
        try:
            while True:
                name, args, kwargs = calls.send(result)
                result = getattr(self.base, name)(*args, **kwargs)
        except StopIteration as done:
            return done.value

    async def ahandle(self, cmd: str, payload: dict) -> Any:
        """Run one command, awaiting the env's ``areset`` / ``astep`` coroutines if it has them, else in a thread."""
        calls, result = self._command(cmd, payload), None
        try:
            while True:
                name, args, kwargs = calls.send(result)
                native = getattr(self.unwrapped, f"a{name}", None)
                if inspect.iscoroutinefunction(native):
                    result = await native(*args, **kwargs)
                else:
                    result = await asyncio.to_thread(getattr(self.base, name), *args, **kwargs)
        except StopIteration as done:
            return done.value


def run_command(server: "EnvServer", cmd: str, payload: Any) -> tuple[str, Any]:
    """Run one command on one env -> ("ok", result) or ("error", traceback) for the parent."""
    try:
        return "ok", server.handle(cmd, payload)
    except Exception:  # noqa: BLE001 - sent back to the parent
        return "error", traceback.format_exc()


async def arun_command(server: "EnvServer", cmd: str, payload: Any) -> tuple[str, Any]:
    """:func:`run_command` for the asyncio backend."""
    try:
        return "ok", await server.ahandle(cmd, payload)
    except Exception:  # noqa: BLE001 - surfaced by recv like a worker error
        return "error", traceback.format_exc()


def _close_all(servers: list["EnvServer"]) -> None:
    """Close every env, ignoring errors (the worker is going away)."""
    for s in servers:
        with contextlib.suppress(Exception):
            s.close()


_FAULT_FILE: Any = None  # the worker's fault-handler file, open for the process's lifetime


def worker_main(conn: mpc.Connection, factory: EnvFactory, overrides: list[dict], options: EnvOptions,
                fault_log: str | None = None) -> None:
    """Entry point of a worker process: build its envs (one per ``overrides`` entry), serve batches until close/EOF.

    Protocol: the worker sends ``("ready", [describe() per env])`` (or ``("error", traceback)``), then
    answers every ``("batch", [(local_env, cmd, payload), ...])`` message, executed in order, with ONE
    ``("batch", [(kind, result), ...])`` reply (``kind`` "ok" or "error" per command, so an env error
    fails only its own command). ``("close", None)`` closes the envs and ends the worker.
    """
    global _FAULT_FILE
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process owns Ctrl-C and shuts us down
    if fault_log:  # a native crash (SIGABRT, SIGSEGV) leaves the Python stack here for the parent's error message
        _FAULT_FILE = open(fault_log, "w")  # noqa: SIM115 - must stay open until the process ends
        faulthandler.enable(file=_FAULT_FILE)
    servers: list[EnvServer] = []
    try:
        for o in overrides:
            servers.append(EnvServer(factory, o, options))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        try:
            send_obj(conn, ("error", traceback.format_exc()))
        finally:
            _close_all(servers)
            conn.close()
        return
    try:
        send_obj(conn, ("ready", [s.describe() for s in servers]))
        while True:
            try:
                cmd, payload = recv_obj(conn)
            except (EOFError, OSError):
                break
            if cmd == "close":
                for s in servers:
                    s.close()
                send_obj(conn, ("ok", None))
                break
            if cmd != "batch":
                send_obj(conn, ("error", f"unknown message {cmd!r}; env workers take 'batch' and 'close'"))
                continue
            send_obj(conn, ("batch", [run_command(servers[local], sub, sub_payload)
                                      for local, sub, sub_payload in payload]))
    except (BrokenPipeError, EOFError, OSError):
        pass
    finally:
        _close_all(servers)
        conn.close()
