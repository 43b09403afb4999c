"""Pipe transport of the subprocess vector env: pickle protocol 5 with big numpy buffers sent out of band."""

from __future__ import annotations

import multiprocessing.connection as mpc
import pickle
import struct
from typing import Any

__all__ = ["recv_obj", "send_obj"]

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
