"""Serve a pi0 / pi0-FAST policy to openpi's own clients over openpi's websocket protocol (a drop-in for openpi's policy server).

Wire protocol (facts from openpi-client 0.1.2 and openpi's ``serving/websocket_policy_server.py``):

- frames are msgpack with openpi's numpy extension (``openpi_client.msgpack_numpy``): an array travels as a map
  ``{b"__ndarray__": True, b"data": raw bytes, b"dtype": dtype.str, b"shape": shape}``, a numpy scalar as
  ``{b"__npgeneric__": True, b"data": item, b"dtype": dtype.str}``; websocket compression off. openpi's server
  takes frames of any size; ours caps a frame (``max_frame_bytes``, 32 MiB by default: a 3-camera 224-px
  observation is about 0.5 MiB), so one client cannot exhaust the server's memory; a larger frame is refused by the
  websocket layer with close code 1009 (message too big) before it is read, and an array whose declared dtype and
  shape disagree with its byte count gets the error frame and close 1011;
- on connect the server sends one binary frame with its metadata dict, then answers each binary observation frame
  with one binary frame ``{"actions": (H, 7), "policy_timing": {...}, "server_timing": {"infer_ms", ...}}``;
- on an error the server sends the traceback as a *text* frame (the client raises it as ``RuntimeError``) and closes
  the connection with code 1011 (internal error); other connections keep being served;
- ``GET /healthz`` answers HTTP 200 ``OK``.

Observations use openpi's LIBERO keys (``observation/image``, ``observation/wrist_image``: (H, W, 3) or (3, H, W)
uint8 as openpi's client sends them after rotate + resize_with_pad; ``observation/state``: (8,) eef pos + axis-angle +
gripper; ``prompt``: str). They go through the same model-side path as ``pi0.policies.libero`` (resize_with_pad to the
model size, a no-op for openpi's 224 px client images; the camera layout and masks of the policy's model type), so
the server's actions equal ``predict_libero_action_chunk`` on the same raw observation (and noise, for pi0). Any
policy directory serves: pi0 or pi0-FAST (``pi0.policies.load_policy`` dispatches on config.json's model_type).
Requests that are waiting while the model runs are batched into the next call (``max_batch``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http
import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch
import websockets
import websockets.asyncio.server as ws_server
from websockets.frames import CloseCode

from pi0.policies.libero import libero_policy_observation, model_type_of_policy
from pi0.policies.io import Observation
from pi0.transforms import resize_with_pad

logger = logging.getLogger(__name__)

IMAGE_KEY, WRIST_KEY, STATE_KEY, PROMPT_KEY = ("observation/image", "observation/wrist_image", "observation/state",
                                               "prompt")
LIBERO_KEYS: tuple[str, ...] = (IMAGE_KEY, WRIST_KEY, STATE_KEY, PROMPT_KEY)
ERROR_CLOSE_REASON = "Internal server error. Traceback included in previous frame."
DEFAULT_MAX_FRAME_BYTES = 32 << 20  # 32 MiB; a 3-camera 224-px uint8 observation is about 0.5 MiB
SAFE_DTYPE_KINDS = "biufcSU"  # plain numbers, bools and fixed-width strings; never object, void or datetime
NoiseFn = Callable[[Mapping[str, Any]], "np.ndarray | None"]


# ------------------------------------------------------------------------------------------ msgpack-numpy codec
def _encode(obj: Any) -> Any:
    """msgpack ``default`` hook: numpy arrays / scalars -> openpi's msgpack_numpy maps."""
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in "VOc":
        raise TypeError(f"cannot send numpy dtype {obj.dtype} (object, void and complex are not supported)")
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": np.ascontiguousarray(obj).tobytes(), b"dtype": obj.dtype.str,
                b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot msgpack an object of type {type(obj).__name__}")


def _safe_dtype(spec: Any) -> np.dtype:
    """A declared dtype string -> np.dtype, refusing anything but plain numbers, bools and fixed-width strings."""
    try:
        dtype = np.dtype(spec.decode() if isinstance(spec, bytes) else spec)
    except (TypeError, ValueError) as e:
        raise ValueError(f"array frame declares an unknown dtype {spec!r}") from e
    if dtype.kind not in SAFE_DTYPE_KINDS or dtype.itemsize == 0:
        raise ValueError(f"array frame declares dtype {dtype} (kind {dtype.kind!r}); only numeric, bool and "
                         f"fixed-width string arrays are accepted")
    return dtype


def _decode(obj: dict) -> Any:
    """msgpack ``object_hook``: openpi's msgpack_numpy maps -> numpy arrays / scalars, checked before building.

    An array's declared dtype and shape must account for its bytes exactly (a frame cannot make the server
    allocate more than it sent, or read past its buffer); violations raise ValueError naming the numbers.
    """
    if b"__ndarray__" in obj:
        data, dtype, shape = obj.get(b"data"), _safe_dtype(obj.get(b"dtype")), obj.get(b"shape")
        if not isinstance(data, bytes):
            raise ValueError(f"array frame data must be bytes, got {type(data).__name__}")
        if not isinstance(shape, (list, tuple)) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise ValueError(f"array frame shape must be a list of non-negative ints, got {shape!r}")
        expected = int(np.prod(shape, dtype=object)) * dtype.itemsize
        if expected != len(data):
            raise ValueError(f"array frame declares {dtype} {tuple(shape)} = {expected} bytes but carries "
                             f"{len(data)} bytes")
        return np.ndarray(buffer=data, dtype=dtype, shape=tuple(shape))
    if b"__npgeneric__" in obj:
        return _safe_dtype(obj.get(b"dtype")).type(obj[b"data"])
    return obj


def packb(obj: Any) -> bytes:
    """Python / numpy tree -> one msgpack-numpy frame (openpi-client's encoding)."""
    return msgpack.packb(obj, default=_encode)


def unpackb(data: bytes) -> Any:
    """One msgpack-numpy frame -> Python / numpy tree."""
    return msgpack.unpackb(data, object_hook=_decode)


# ------------------------------------------------------------------------------------------------ observations
def _image(obs: Mapping[str, Any], key: str, size: int) -> np.ndarray:
    """One openpi client image, (H,W,3) or (3,H,W) uint8 -> (size, size, 3) uint8 (resize_with_pad if needed)."""
    img = obs[key]
    if not isinstance(img, np.ndarray):
        raise ValueError(f"'{key}' must be a numpy uint8 image array, got {type(img).__name__}")
    if img.dtype != np.uint8:
        raise ValueError(f"'{key}' must be uint8, got {img.dtype} (convert with openpi_client.image_tools."
                         "convert_to_uint8 before sending)")
    if img.ndim == 3 and img.shape[0] == 3 and img.shape[-1] != 3:  # as in openpi LiberoInputs: CHW -> HWC
        img = img.transpose(1, 2, 0)
    if img.ndim != 3 or img.shape[-1] != 3 or min(img.shape[:2]) < 1:
        raise ValueError(f"'{key}' must be an RGB image (H, W, 3), got shape {img.shape}")
    # as in openpi pi0_libero input transforms: ResizeImages(224, 224) = resize_with_pad
    return np.ascontiguousarray(resize_with_pad(img, size, size))


def parse_libero_request(obs: Any, image_size: int, state_dim: int) -> dict[str, Any]:
    """openpi LIBERO request dict -> {"image","wrist_image": (S,S,3) uint8, "state": (state_dim,) f64, "prompt": str}.

    Raises ValueError naming the offending key and what was expected; runs before any model work.
    """
    if not isinstance(obs, Mapping):
        raise ValueError(f"an observation must be a msgpack map with keys {list(LIBERO_KEYS)}, "
                         f"got {type(obs).__name__}")
    missing = [k for k in LIBERO_KEYS if k not in obs]
    if missing:
        raise ValueError(f"observation lacks key(s) {missing}; openpi's LIBERO client sends {list(LIBERO_KEYS)} "
                         f"(got {sorted(map(str, obs))})")
    prompt = obs[PROMPT_KEY]
    if isinstance(prompt, np.ndarray) and prompt.ndim == 0 and prompt.dtype.kind in "US":
        prompt = str(prompt)
    if not isinstance(prompt, str):
        raise ValueError(f"'{PROMPT_KEY}' must be a string, got {type(prompt).__name__}")
    state = obs[STATE_KEY]
    if not isinstance(state, np.ndarray) or state.dtype.kind not in "fiu":
        kind = state.dtype if isinstance(state, np.ndarray) else type(state).__name__
        raise ValueError(f"'{STATE_KEY}' must be a numeric numpy array, got {kind}")
    if state.shape != (state_dim,):
        raise ValueError(f"'{STATE_KEY}' must have shape ({state_dim},) (eef pos 3 + axis-angle 3 + gripper 2), "
                         f"got {state.shape}")
    return {"image": _image(obs, IMAGE_KEY, image_size), "wrist_image": _image(obs, WRIST_KEY, image_size),
            "state": state.astype(np.float64), "prompt": prompt}


def batch_observation(requests: list[dict[str, Any]], policy: Any) -> Observation:
    """n parsed requests -> the policy's observation (as ``pi0.policies.libero.construct_libero_observation``)."""
    client = {k: np.stack([r[k] for r in requests]) for k in ("image", "wrist_image", "state")}
    return libero_policy_observation(client, [r["prompt"] for r in requests], policy.config.image_keys,
                                     model_type_of_policy(policy))


# ------------------------------------------------------------------------------------------------------ policy
class LiberoServingPolicy:
    """A policy (pi0 or pi0-FAST) answering batches of parsed openpi LIBERO requests with (H, 7) float64 chunks."""

    def __init__(self, policy: Any, noise_fn: NoiseFn | None = None, name: str = "pi0"):
        self.policy = policy.eval()
        self.model_type = model_type_of_policy(policy)
        if noise_fn is not None and self.model_type != "pi0":
            raise ValueError(f"a noise hook fixes a flow policy's noise; a {self.model_type} policy has none")
        self.noise_fn = noise_fn  # raw request -> (H, 32) flow noise or None (random); tests fix the noise with it
        self.name = name

    @property
    def metadata(self) -> dict[str, Any]:
        """Sent to every client on connect."""
        cfg = self.policy.config
        return {"policy": self.name, "model_type": self.model_type, "pi05": bool(getattr(cfg.model, "pi05", False)),
                "action_horizon": cfg.model.action_horizon,
                "action_dim": self.policy.action_dim,
                "state_dim": self.policy.state_dim, "image_size": cfg.model.vision.image_size,
                "observation_keys": list(LIBERO_KEYS)}

    def parse(self, obs: Any) -> dict[str, Any]:
        """Validate one raw request (see ``parse_libero_request``)."""
        parsed = parse_libero_request(obs, self.policy.config.model.vision.image_size, self.policy.state_dim)
        shape = (self.policy.config.model.action_horizon, self.policy.config.model.action_dim)
        noise = self.noise_fn(obs) if self.noise_fn is not None else None
        if noise is not None and tuple(np.shape(noise)) != shape:
            raise ValueError(f"noise hook returned shape {np.shape(noise)}, expected {shape}")
        parsed["noise"] = noise
        return parsed

    def infer_batch(self, requests: list[dict[str, Any]]) -> list[np.ndarray]:
        """n parsed requests -> n action chunks (H, action_dim) float64, one batched model call."""
        noise = None
        if any(r["noise"] is not None for r in requests):
            cfg = self.policy.config.model
            noise = torch.stack([torch.as_tensor(r["noise"], dtype=torch.float32) if r["noise"] is not None
                                 else torch.randn(cfg.action_horizon, cfg.action_dim) for r in requests])
        out = self.policy.predict_action_chunk_with_info(batch_observation(requests, self.policy), noise)
        return list(out["actions_f64"].cpu().numpy())


# ------------------------------------------------------------------------------------------------------ server
@dataclass
class _Pending:
    request: dict[str, Any]
    future: asyncio.Future
    batch_size: int = field(default=0)


class PolicyServer:
    """openpi-protocol websocket server over a ``LiberoServingPolicy``; one inference thread, batched requests."""

    def __init__(self, policy: LiberoServingPolicy, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_frame_bytes < 1024:
            raise ValueError(f"max_frame_bytes must be >= 1024, got {max_frame_bytes}")
        self.policy, self.host, self.port, self.max_batch = policy, host, port, max_batch
        self.max_frame_bytes = max_frame_bytes
        self._queue: asyncio.Queue[_Pending] | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pi0-infer")

    @staticmethod
    def _health(connection: ws_server.ServerConnection, request: ws_server.Request) -> ws_server.Response | None:
        """``GET /healthz`` -> 200 OK; anything else continues the websocket handshake."""
        if request.path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "OK\n")
        return None

    async def _batcher(self) -> None:
        """Take every request waiting (up to max_batch) and run them as one model call in the inference thread."""
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            batch = [p for p in batch if not p.future.cancelled()]
            if not batch:
                continue
            try:
                results = await loop.run_in_executor(self._executor, self.policy.infer_batch,
                                                     [p.request for p in batch])
            except Exception as exc:  # every request of a failed batch gets the traceback
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            for p, actions in zip(batch, results):
                p.batch_size = len(batch)
                if not p.future.done():
                    p.future.set_result(actions)

    async def _infer(self, obs: Any) -> tuple[np.ndarray, int]:
        """One raw request -> (actions, size of the batch it ran in)."""
        assert self._queue is not None
        pending = _Pending(self.policy.parse(obs), asyncio.get_running_loop().create_future())
        await self._queue.put(pending)
        return await pending.future, pending.batch_size

    async def _handler(self, ws: ws_server.ServerConnection) -> None:
        """One client: metadata, then request/response until it closes; traceback frame + close 1011 on an error."""
        logger.info("connection from %s opened", ws.remote_address)
        await ws.send(packb(self.policy.metadata))
        prev_total_ms = None
        while True:
            try:
                message = await ws.recv()
                start = time.monotonic()
                if isinstance(message, str):
                    raise ValueError("expected a binary msgpack frame, got a text frame")
                actions, batch_size = await self._infer(unpackb(message))
                infer_ms = (time.monotonic() - start) * 1000
                timing = {"infer_ms": infer_ms, "batch_size": batch_size}
                if prev_total_ms is not None:
                    timing["prev_total_ms"] = prev_total_ms
                await ws.send(packb({"actions": actions, "policy_timing": {"infer_ms": infer_ms},
                                     "server_timing": timing}))
                prev_total_ms = (time.monotonic() - start) * 1000
            except websockets.ConnectionClosed:
                logger.info("connection from %s closed", ws.remote_address)
                return
            except Exception:
                logger.exception("inference error for %s", ws.remote_address)
                with contextlib.suppress(websockets.ConnectionClosed):
                    await ws.send(traceback.format_exc())
                    await ws.close(code=CloseCode.INTERNAL_ERROR, reason=ERROR_CLOSE_REASON)
                return

    async def serve(self, started: Callable[[int], None] | None = None,
                    stop: asyncio.Event | None = None) -> None:
        """Serve until ``stop`` is set (forever without one); ``started(port)`` is called once listening."""
        self._queue = asyncio.Queue()
        batcher = asyncio.create_task(self._batcher())
        try:
            async with ws_server.serve(self._handler, self.host, self.port, compression=None,
                                       max_size=self.max_frame_bytes,
                                       process_request=self._health) as server:
                port = server.sockets[0].getsockname()[1] if server.sockets else self.port
                logger.info("serving on ws://%s:%d (healthz: http://%s:%d/healthz)", self.host, port, self.host, port)
                if started is not None:
                    started(port)
                await (stop.wait() if stop is not None else server.serve_forever())
        finally:
            batcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await batcher

    def serve_forever(self) -> None:
        """Blocking: serve until interrupted."""
        asyncio.run(self.serve())

    @contextlib.contextmanager
    def running(self, timeout_s: float = 60.0) -> Iterator[int]:
        """Serve from a background thread (tests, notebooks); yields the bound port and stops on exit."""
        ready = threading.Event()
        state: dict[str, Any] = {}

        def _run() -> None:
            async def main() -> None:
                state["loop"], state["stop"] = asyncio.get_running_loop(), asyncio.Event()
                await self.serve(started=lambda port: (state.update(port=port), ready.set()), stop=state["stop"])
            try:
                asyncio.run(main())
            except BaseException as exc:  # surfaced to the caller below
                state["error"] = exc
                ready.set()

        thread = threading.Thread(target=_run, name="pi0-policy-server", daemon=True)
        thread.start()
        if not ready.wait(timeout_s) or "error" in state:
            raise RuntimeError(f"policy server did not start on {self.host}:{self.port}: {state.get('error')!r}")
        try:
            yield state["port"]
        finally:
            state["loop"].call_soon_threadsafe(state["stop"].set)
            thread.join(timeout_s)
