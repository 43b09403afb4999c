"""The machine a measurement ran on, for reports whose budgets are wall-clock (a minute is one machine's minute)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``), else what ``platform`` says, else ``"unknown"``."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine() -> dict[str, object]:
    """{"cpu": model name, "cores": logical cores} of this process's machine."""
    return {"cpu": cpu_model(), "cores": os.cpu_count()}
