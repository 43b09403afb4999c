"""Subprocess vector env: one env per ``spawn``-ed worker process, talking over ``Pipe``s.

Design
------
* Each worker builds its env from a picklable *env factory* (normally an :class:`EnvSpec`, i.e.
  a gym id + kwargs, made with ``gym.make`` inside the worker). Factories are checked before
  anything is started: one that captures torch objects or a policy is rejected, so the model
  never enters a worker (the workers do not even import torch; see ``worker_info``).
* Per-env async API: ``reset_async / chunk_async / step_async / call_async`` send a command to
  one worker, ``recv(i)`` gets its reply, ``wait(indices)`` tells which replies are ready, so
  finished envs simply get no commands (no dummy actions needed).
* ``chunk_async`` executes a whole action chunk inside the worker (one round trip per policy
  decision) and stops at termination/truncation; images are rendered only where asked
  (``render="decision"``: after the last action if the episode continues).
* Failures are typed: :class:`WorkerDied` (EOF / broken pipe / process gone),
  :class:`WorkerTimeout` (no reply within ``step_timeout``: a hung worker, e.g. SIGSTOPped),
  :class:`RemoteEnvError` (the env raised; traceback included), :class:`EnvCreationError`.
  After any of them the worker is *broken* until :meth:`SubprocVecEnv.respawn` kills (SIGKILL),
  reaps and restarts it. The caller (the runner) re-runs the interrupted episode.
* Env creation is retried in the worker with exponential backoff (``make_attempts``,
  ``make_backoff``); optionally the env is re-created every ``recreate_every`` episodes (resets).
* ``close()`` is idempotent and reaps every process (no zombies); it also runs at garbage
  collection / interpreter exit.
* Opt-in ``envs_per_worker=M > 1``: one process hosts M envs (env ``i`` in process ``i // M``);
  the commands of one process are buffered and sent as ONE ``("batch", ...)`` message at the next
  ``recv``/``wait``, answered by ONE batched reply that is split into per-env reply queues. A
  process failure fails every env it hosts (see :class:`SubprocVecEnv`). For cheap envs, whose
  step costs less than a pipe round trip, this is what makes subprocesses pay off.

Render-on-demand convention (shared with ``LiberoEnv`` and ``ArenaEnv``): an env whose
``unwrapped.render_on_demand`` is True gets ``step(action, render=bool)`` and
``reset(options={"render": bool})``; a missing image is obtained with
``get_observation(render=True)``. Observations that were not asked to be rendered are sent back
without image keys, for any env, to keep the pipes light.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import struct
import sys
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Self, Sequence

import numpy as np

from pi0.rollout.types import IMAGE_KEYS, LIBERO_WAIT_ACTION, upright

__all__ = [
    "EnvCreationError",
    "EnvFactory",
    "EnvSpec",
    "RemoteEnvError",
    "SerialVecEnv",
    "SubprocVecEnv",
    "WorkerDied",
    "WorkerError",
    "WorkerTimeout",
    "call_with_backoff",
    "check_env_factory",
    "make_env_with_retry",
]

EnvFactory = Callable[..., Any]  # factory(**overrides) -> gymnasium.Env
RENDER_MODES = ("decision", "always", "none")


# ---------------------------------------------------------------------------------- transport
_OOB_MIN_BYTES = 16384  # numpy buffers at least this big travel out of band (images)


def send_obj(conn: mpc.Connection, obj: Any) -> None:
    """Send ``obj`` with pickle protocol 5, big numpy buffers (images) out of band: no pickling copies.

    Frame: one message ``[n: u32][n sizes: u64][pickle bytes]`` followed by ``n`` raw buffer messages.
    """
    raws: list[memoryview] = []

    def out_of_band(buf: pickle.PickleBuffer) -> bool:
        """Keep small buffers in the pickle stream (returns True), send big ones separately."""
        raw = buf.raw()
        if raw.nbytes < _OOB_MIN_BYTES:
            return True
        raws.append(raw)
        return False

    payload = pickle.dumps(obj, protocol=5, buffer_callback=out_of_band)
    head = struct.pack(f"<I{len(raws)}Q", len(raws), *(r.nbytes for r in raws))
    conn.send_bytes(head + payload)
    for r in raws:
        conn.send_bytes(r)


def recv_obj(conn: mpc.Connection) -> Any:
    """Receive an object sent by :func:`send_obj` (arrays come back writable)."""
    msg = conn.recv_bytes()
    (n,) = struct.unpack_from("<I", msg)
    sizes = struct.unpack_from(f"<{n}Q", msg, 4)
    buffers = []
    for size in sizes:
        buf = bytearray(size)
        if size:
            conn.recv_bytes_into(buf)
        else:
            conn.recv_bytes()
        buffers.append(buf)
    return pickle.loads(memoryview(msg)[4 + 8 * n:], buffers=buffers)


# ------------------------------------------------------------------------------------- errors
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


# -------------------------------------------------------------------------------- env factory
@dataclass
class EnvSpec:
    """Picklable env factory: ``gym.make(id, **kwargs, **overrides)`` after importing ``register_module``.

    ``register_module`` is imported first so that the project's gym ids are registered in the
    worker (``pi0.envs`` registers ``arena-v0`` and ``libero-*-v0``).
    """

    id: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    register_module: str | None = "pi0.envs"

    def __call__(self, **overrides: Any) -> Any:
        """Create the env (``overrides`` win over ``kwargs``)."""
        import importlib

        import gymnasium as gym

        if self.register_module:
            importlib.import_module(self.register_module)
        return gym.make(self.id, **{**self.kwargs, **overrides})

    def replace(self, **kwargs: Any) -> "EnvSpec":
        """A copy with ``kwargs`` merged into the env kwargs."""
        return EnvSpec(self.id, {**self.kwargs, **kwargs}, self.register_module)


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


# ---------------------------------------------------------------------------------- env server
_TRANSPARENT_WRAPPERS = ("OrderEnforcing", "PassiveEnvChecker")


class _EnvServer:
    """Executes vec-env commands on one env; used inside workers and by :class:`SerialVecEnv`."""

    def __init__(self, factory: EnvFactory, overrides: Mapping[str, Any] | None, make_attempts: int,
                 make_backoff: float, make_backoff_max: float, recreate_every: int | None) -> None:
        self.factory = factory
        self.overrides = dict(overrides or {})
        self.make_attempts = make_attempts
        self.make_backoff = make_backoff
        self.make_backoff_max = make_backoff_max
        self.recreate_every = recreate_every
        self.env: Any = None
        self.num_makes = 0
        self.episodes_since_make = 0
        self._make()

    # ------------------------------------------------------------------ env creation
    def _make(self) -> None:
        """(Re)create the env with the current overrides and inspect its capabilities."""
        self.close()
        self.env = make_env_with_retry(self.factory, self.overrides, self.make_attempts, self.make_backoff,
                                       self.make_backoff_max)
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
        try:
            self.step_takes_render = "render" in inspect.signature(self.base.step).parameters
        except (TypeError, ValueError):
            self.step_takes_render = False

    def describe(self) -> dict[str, Any]:
        """Small description of the env, sent back to the main process."""
        u = self.unwrapped
        return {"pid": os.getpid(), "task_id": getattr(u, "task_id", None), "prompt": getattr(u, "prompt", None),
                "num_init_states": getattr(u, "num_init_states", None), "render_on_demand": self.on_demand,
                "supports_task_switch": bool(getattr(u, "supports_task_switch", False)), "num_makes": self.num_makes}

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
        has = all(k in obs for k in IMAGE_KEYS)
        if render and not has:
            get = getattr(self.unwrapped, "get_observation", None)
            if get is None:
                raise RuntimeError("env returned no images and has no get_observation(render=True)")
            obs = get(render=True)
        elif not render and any(k in obs for k in IMAGE_KEYS):
            obs = {k: v for k, v in obs.items() if k not in IMAGE_KEYS}
        return obs

    def _step(self, action: np.ndarray, render: bool) -> tuple[dict, float, bool, bool, dict]:
        """One env step with images iff ``render``."""
        if self.on_demand and self.step_takes_render:
            obs, r, term, trunc, info = self.base.step(action, render=render)
        else:
            obs, r, term, trunc, info = self.base.step(action)
        return self._with_images(obs, render), float(r), bool(term), bool(trunc), info

    # ------------------------------------------------------------------ commands
    def reset(self, task_id: int | None = None, init_state_id: int | None = None, seed: int | None = None,
              render: bool = True, settle_steps: int = 0, settle_action: np.ndarray | None = None) -> dict[str, Any]:
        """Reset (switching task / re-creating the env if needed) and run ``settle_steps`` settle actions."""
        options: dict[str, Any] = {}
        remake = bool(self.recreate_every) and self.episodes_since_make >= int(self.recreate_every)
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
        obs, info = self.base.reset(seed=seed, options=options)
        self.episodes_since_make += 1
        if settle_steps:
            act = np.asarray(settle_action if settle_action is not None else LIBERO_WAIT_ACTION, np.float64)
            for k in range(settle_steps):
                obs, _, _, _, info = self._step(act, render and k == settle_steps - 1)
        u = self.unwrapped
        return {"obs": self._with_images(obs, render), "info": info, "prompt": getattr(u, "prompt", None),
                "task_id": getattr(u, "task_id", task_id), "num_makes": self.num_makes}

    def chunk(self, actions: np.ndarray, render: str = "decision", record_frames: bool = False) -> dict[str, Any]:
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
            obs, rewards[k], term, trunc, info = self._step(actions[k], want)
            if record_frames:
                frames.append(upright(obs["agentview_image"]))
            if term or trunc:
                break
        k += 1 if n else 0
        done = term or trunc
        final_render = (render == "always") or (render == "decision" and not done)
        if obs is not None:
            obs = self._with_images(obs, final_render)
        return {"obs": obs, "rewards": rewards[:k], "n": k, "terminated": term, "truncated": trunc, "info": info,
                "frames": frames if record_frames else None, "env_time": time.perf_counter() - t0}

    def get_observation(self, render: bool = True) -> dict:
        """Current observation (images iff ``render``)."""
        get = getattr(self.unwrapped, "get_observation")
        return self._with_images(get(render=render), render)

    def call(self, name: str, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Call ``env.unwrapped.<name>(*args, **kwargs)`` (or read the attribute if not callable)."""
        attr = getattr(self.unwrapped, name)
        return attr(*args, **(kwargs or {})) if callable(attr) else attr

    def info(self) -> dict[str, Any]:
        """Process facts: pid, RSS, and whether torch / the model code was imported here."""
        import psutil

        d = self.describe()
        d.update(rss=psutil.Process().memory_info().rss, torch_imported="torch" in sys.modules,
                 modules=len(sys.modules))
        return d

    def handle(self, cmd: str, payload: dict) -> Any:
        """Dispatch one command."""
        if cmd == "reset":
            return self.reset(**payload)
        if cmd == "chunk":
            return self.chunk(**payload)
        if cmd == "get_obs":
            return self.get_observation(**payload)
        if cmd == "call":
            return self.call(**payload)
        if cmd == "info":
            return self.info()
        if cmd == "remake":
            self._make()
            return self.describe()
        raise ValueError(f"unknown command {cmd!r}")


@contextlib.contextmanager
def _main_module_hidden(factory: Any) -> Iterator[None]:
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


def _run_command(server: "_EnvServer", cmd: str, payload: Any) -> tuple[str, Any]:
    """Run one command on one env -> ("ok", result) or ("error", traceback) for the parent."""
    try:
        return "ok", server.handle(cmd, payload)
    except Exception:  # noqa: BLE001 - sent back to the parent
        return "error", traceback.format_exc()


def _close_all(servers: list["_EnvServer"]) -> None:
    """Close every env, ignoring errors (the worker is going away)."""
    for s in servers:
        with contextlib.suppress(Exception):
            s.close()


def _worker_main(conn: mpc.Connection, factory: EnvFactory, overrides: dict | list[dict], opts: dict) -> None:
    """Entry point of a worker process: build its env(s), then serve commands until close/EOF.

    ``overrides`` is one dict (one env; plain ``(cmd, payload)`` messages answered one by one) or a
    list of dicts (``envs_per_worker > 1``: one env per entry). Multi-env workers send ``("ready",
    [describe() per env])`` and serve coalesced ``("batch", [(local_env, cmd, payload), ...])``
    messages, executed in order and answered with ONE ``("batch", [(kind, result), ...])`` reply
    (``kind`` "ok" or "error" per command, so an env error fails only its own command).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process owns Ctrl-C and shuts us down
    many = isinstance(overrides, list)
    servers: list[_EnvServer] = []
    try:
        for o in overrides if many else [overrides]:
            servers.append(_EnvServer(factory, o, **opts))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        try:
            send_obj(conn, ("error", traceback.format_exc()))
        finally:
            _close_all(servers)
            conn.close()
        return
    try:
        send_obj(conn, ("ready", [s.describe() for s in servers] if many else servers[0].describe()))
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
            if not many:
                send_obj(conn, _run_command(servers[0], cmd, payload))
            elif cmd != "batch":
                send_obj(conn, ("error", f"unknown command {cmd!r} for a multi-env worker"))
            else:
                send_obj(conn, ("batch", [_run_command(servers[local], sub, sub_payload)
                                          for local, sub, sub_payload in payload]))
    except (BrokenPipeError, EOFError, OSError):
        pass
    finally:
        _close_all(servers)
        conn.close()


# ---------------------------------------------------------------------------------- vec envs
class _VecEnvBase:
    """Command helpers shared by the subprocess and the in-process vector envs."""

    num_envs: int
    _opts: dict[str, Any]
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

    # Env-creation retry settings (also used by the runner to retry a failed respawn).
    @property
    def make_attempts(self) -> int:
        """Env creation attempts per (re)start."""
        return int(self._opts["make_attempts"])

    @property
    def make_backoff(self) -> float:
        """First retry delay in seconds (doubles each attempt)."""
        return float(self._opts["make_backoff"])

    @property
    def make_backoff_max(self) -> float:
        """Cap on the retry delay in seconds."""
        return float(self._opts["make_backoff_max"])

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

    def get_observation_async(self, index: int, render: bool = True) -> None:
        """Ask env ``index`` for its current observation."""
        self._send(index, "get_obs", {"render": render})

    def call_async(self, index: int, name: str, *args: Any, **kwargs: Any) -> None:
        """Ask env ``index`` to call ``unwrapped.<name>(*args, **kwargs)``."""
        self._send(index, "call", {"name": name, "args": args, "kwargs": kwargs})

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

    def call(self, index: int, name: str, *args: Any, **kwargs: Any) -> Any:
        """Synchronous :meth:`call_async` + :meth:`recv`."""
        self.call_async(index, name, *args, **kwargs)
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


@dataclass
class _Worker:
    """Main-process handle of one worker process."""

    index: int
    process: Any
    conn: mpc.Connection
    pending: int = 0
    broken: bool = False
    ready_info: dict[str, Any] = field(default_factory=dict)

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


def _shutdown(workers: list[_Worker | None], timeout: float = 5.0) -> None:
    """Stop and reap every worker in ``workers`` (used by close() and the GC finalizer)."""
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


class SubprocVecEnv(_VecEnvBase):
    """``num_envs`` envs, each in its own ``spawn``-ed (daemon) worker process (see module docstring).

    Drive it from one thread. Create it from a non-daemonic process (daemons cannot have children),
    and under ``if __name__ == "__main__":`` in scripts (spawn re-imports the main module).

    ``envs_per_worker=M > 1`` (opt-in) hosts M envs per process (env ``i`` lives in process
    ``i // M``; ``num_envs`` and all indices stay per env) and coalesces messages: ``*_async(i)``
    only buffers the command; ``recv``/``wait`` first flush the buffers, ONE ``("batch", ...)``
    message per process (its envs' commands in order), and demultiplex the ONE batched reply into
    per-env reply queues, so ``recv(j)`` for another env of the same process needs no round trip.
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
        self._opts = {"make_attempts": int(make_attempts), "make_backoff": float(make_backoff),
                      "make_backoff_max": float(make_backoff_max), "recreate_every": recreate_every}
        self._ctx = mp.get_context(context)
        self._overrides = [dict(o) for o in worker_overrides] if worker_overrides else [{} for _ in range(num_envs)]
        if len(self._overrides) != num_envs:
            raise ValueError("worker_overrides must have one entry per env")
        self.envs_per_worker = int(envs_per_worker)
        self._multi = self.envs_per_worker > 1
        self.num_workers = -(-self.num_envs // self.envs_per_worker)  # processes
        # per process: its env indices, buffered commands, env lists of the batches in flight
        self._proc_envs = [list(range(p * self.envs_per_worker, min(self.num_envs, (p + 1) * self.envs_per_worker)))
                           for p in range(self.num_workers)]
        self._outbox: list[list[tuple[int, str, dict]]] = [[] for _ in range(self.num_workers)]
        self._inflight: list[deque[list[int]]] = [deque() for _ in range(self.num_workers)]
        # per env (multi-env workers): received replies, pending count, failure to raise until reset/respawn
        self._replies: list[deque[tuple[str, Any]]] = [deque() for _ in range(self.num_envs)]
        self._npending = [0] * self.num_envs
        self._dead: list[WorkerError | None] = [None] * self.num_envs
        self._env_info: list[dict[str, Any]] = [{} for _ in range(self.num_envs)]
        self.num_messages_sent = 0  # command messages written to the pipes (a batch counts once)
        self.num_replies_received = 0  # reply messages read from the pipes (a batched reply counts once)
        self._workers: list[_Worker | None] = [None] * self.num_workers
        self.num_respawns = 0
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)
        try:
            for p in range(self.num_workers):
                self._workers[p] = self._start(p)
            for p in range(self.num_workers):
                self._await_ready(p)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ process management
    def _start(self, index: int) -> _Worker:
        """Start worker process ``index`` (does not wait for its env(s))."""
        parent, child = self._ctx.Pipe(duplex=True)
        overrides: dict | list[dict] = self._overrides[index] if not self._multi else \
            [self._overrides[j] for j in self._proc_envs[index]]
        proc = self._ctx.Process(target=_worker_main, args=(child, self.env_factory, overrides, self._opts),
                                 name=f"pi0-env-worker-{index}", daemon=True)
        with _main_module_hidden(self.env_factory):
            proc.start()
        child.close()  # essential: otherwise the worker's death never shows up as EOF here
        return _Worker(index, proc, parent)

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
            raise EnvCreationError(f"env worker {index} died during start-up (exit code "
                                   f"{w.process.exitcode})", index, w.pid) from exc
        except EnvCreationError:
            w.broken = True
            raise
        if kind != "ready":
            w.broken = True
            raise EnvCreationError(f"env worker {index} could not create its env:\n{payload}", index, w.pid)
        if self._multi:
            for j, info in zip(self._proc_envs[index], payload):
                self._env_info[j] = info
            w.ready_info = payload[0]
        else:
            w.ready_info = payload

    def env_ready_info(self, index: int) -> dict[str, Any]:
        """What env ``index`` reported when it was (last) built (empty if unknown)."""
        if self._multi:
            return self._env_info[index]
        w = self._workers[index]
        return w.ready_info if w is not None else {}

    def respawn(self, index: int, overrides: Mapping[str, Any] | None = None) -> None:
        """Kill (SIGKILL), reap and restart worker ``index`` (env kwargs updated with ``overrides``).

        Waits until the new env is built; raises EnvCreationError if it cannot be.
        """
        self._check_open()
        if overrides:
            self._overrides[index].update(overrides)
        if self._multi:
            self._respawn_multi(index)
            return
        old = self._workers[index]
        if old is not None:
            old.broken = True
            _reap(old, graceful=False, timeout=5.0)
        self._workers[index] = self._start(index)
        self.num_respawns += 1
        self._await_ready(index)

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
        """Send one command to worker ``index`` (multi-env workers: buffer it until the next flush)."""
        w = self._worker(index)
        if self._multi:
            self._buffer(index, w, cmd, payload)
            return
        if w.broken:
            raise WorkerDied(f"env worker {index} is broken; respawn it first", index, w.pid)
        try:
            send_obj(w.conn, (cmd, payload))
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as exc:
            w.broken = True
            raise WorkerDied(f"env worker {index} (pid {w.pid}) is gone: {exc!r}", index, w.pid) from exc
        w.pending += 1
        self.num_messages_sent += 1

    def recv(self, index: int, timeout: float | None = None) -> Any:
        """Reply to the oldest pending command of worker ``index`` (``timeout`` default: ``step_timeout``)."""
        if self._multi:
            return self._recv_multi(index, timeout)
        w = self._worker(index)
        if w.pending <= 0:
            raise RuntimeError(f"no pending command for env worker {index}")
        timeout = self.step_timeout if timeout is None else timeout
        try:
            ready = w.conn.poll(timeout)
        except (EOFError, OSError) as exc:
            w.broken = True
            raise WorkerDied(f"env worker {index} (pid {w.pid}) is gone: {exc!r}", index, w.pid) from exc
        if not ready:
            w.broken = True
            raise WorkerTimeout(f"env worker {index} (pid {w.pid}) gave no reply within {timeout}s", index, w.pid)
        try:
            kind, payload = recv_obj(w.conn)
        except (EOFError, OSError, ConnectionResetError) as exc:
            w.broken = True
            raise WorkerDied(f"env worker {index} (pid {w.pid}) died (exit code {w.process.exitcode})",
                             index, w.pid) from exc
        w.pending -= 1
        self.num_replies_received += 1
        if kind == "error":
            raise RemoteEnvError(f"env worker {index} raised:\n{payload}", index, w.pid, payload)
        return payload

    def wait(self, indices: Sequence[int], timeout: float | None = None) -> list[int]:
        """Indices among ``indices`` whose worker has a reply (or EOF) ready, waiting up to ``timeout``.

        Multi-env workers: flushes the buffered commands first; an env counts as ready when its
        reply was received already, its process failed, or a batched reply of its process arrived
        (read and demultiplexed here; it may hold only other envs' replies).
        """
        if self._multi:
            return self._wait_multi(indices, timeout)
        conns = {self._worker(i).conn: i for i in indices}
        return sorted(conns[c] for c in mpc.wait(list(conns), timeout))

    def pending(self, index: int) -> int:
        """Number of commands sent to worker ``index`` whose replies were not received yet."""
        if self._multi:
            self._check_open()
            return self._npending[index]
        return self._worker(index).pending

    # ------------------------------------------------------------------ multi-env workers (coalescing)
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
        for j in self._proc_envs[p]:
            kind = cls if self._npending[j] > 0 else WorkerDied
            if self._dead[j] is None or self._npending[j] > 0:
                self._dead[j] = kind(f"env {j}: worker process {p} (pid {pid}, exit code {code}) {what}", j, pid)
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

    def _recv_multi(self, index: int, timeout: float | None) -> Any:
        """:meth:`recv` for multi-env workers: flush, then take the env's reply (reading batches as needed)."""
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

    def _wait_multi(self, indices: Sequence[int], timeout: float | None) -> list[int]:
        """:meth:`wait` for multi-env workers."""
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

    def _respawn_multi(self, index: int) -> None:
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
        _shutdown(self._workers, timeout)
        self._finalizer.detach()



class SerialVecEnv(_VecEnvBase):
    """In-process vector env with the same API (no subprocesses): baseline, debugging, tests."""

    def __init__(self, env_factory: EnvFactory, num_envs: int, *, make_attempts: int = 3, make_backoff: float = 0.5,
                 make_backoff_max: float = 30.0, recreate_every: int | None = None,
                 worker_overrides: Sequence[Mapping[str, Any]] | None = None, **_: Any) -> None:
        """Build ``num_envs`` envs in this process (extra keyword arguments are ignored)."""
        self.env_factory = env_factory
        self.num_envs = int(num_envs)
        self._opts = {"make_attempts": make_attempts, "make_backoff": make_backoff,
                      "make_backoff_max": make_backoff_max, "recreate_every": recreate_every}
        self._overrides = [dict(o) for o in worker_overrides] if worker_overrides else [{} for _ in range(num_envs)]
        self._servers: list[_EnvServer | None] = [None] * self.num_envs
        self._replies: list[deque] = [deque() for _ in range(self.num_envs)]
        self.num_respawns = 0
        self._closed = False
        for i in range(self.num_envs):
            self._servers[i] = self._build(i)

    def _build(self, index: int) -> _EnvServer:
        """Create env server ``index``."""
        try:
            return _EnvServer(self.env_factory, self._overrides[index], **self._opts)
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
        try:
            self._replies[index].append(("ok", server.handle(cmd, payload)))
        except Exception:  # noqa: BLE001 - surfaced by recv like a worker error
            self._replies[index].append(("error", traceback.format_exc()))

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

