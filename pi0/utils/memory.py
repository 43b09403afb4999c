"""Process memory measurement for the memory benches: this process's /proc counters, and a child process run under
an RSS watchdog."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


def vm_status(field: str) -> int:
    """Bytes of a /proc/self/status field of this process (VmRSS, VmHWM = peak RSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


@dataclass
class WatchedRun:
    """What :func:`run_watched` saw: exit code, stdout, the largest RSS it polled, whether it killed the child."""

    returncode: int
    stdout: str
    polled_rss: int
    killed: bool
    seconds: float


def run_watched(cmd: list[str], limit_bytes: float | None, env: dict | None = None, poll_s: float = 0.05) -> WatchedRun:
    """Run ``cmd``, polling its RSS; kill it once above ``limit_bytes`` (None: never)."""
    import psutil

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    ps, polled, t0 = psutil.Process(proc.pid), 0, time.perf_counter()
    killed = False
    while proc.poll() is None:
        try:
            polled = max(polled, ps.memory_info().rss)
        except psutil.Error:
            pass
        if limit_bytes is not None and polled > limit_bytes:
            proc.kill()
            killed = True
            break
        time.sleep(poll_s)
    out = proc.stdout.read()
    proc.wait()
    return WatchedRun(proc.returncode, out, polled, killed, round(time.perf_counter() - t0, 1))
