"""Paired comparison of two policies evaluated on the same episodes (same init states, same per-episode noise).

The bench reports RL − baseline as the mean of per-episode differences ``d_i = a_i − b_i``; its standard error is
``std(d, ddof=1) / sqrt(n)``, far smaller than the unpaired ``sqrt(se_a² + se_b²)`` when the two policies succeed and
fail on mostly the same states. A multi-task evaluation lists its episodes task by task; :func:`per_task` splits it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def rate_se(p: float, n: int) -> float:
    """Binomial standard error sqrt(p (1 − p) / n) of a success rate over ``n`` episodes."""
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n else 0.0


def paired_difference(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Per-episode outcomes ``a``, ``b`` ``(n,)`` of two policies on the same episodes -> (mean of a − b, its
    standard error std(a − b, ddof=1) / sqrt(n))."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired outcomes need equal 1-D shapes, got {a.shape} and {b.shape}")
    d = a - b
    n = len(d)
    if n < 2:
        raise ValueError(f"a paired standard error needs at least 2 episodes, got {n}")
    return float(d.mean()), float(d.std(ddof=1) / math.sqrt(n))


def per_task(tasks: Sequence[int], n: int, outcomes: dict[str, Sequence[float]]) -> dict[int, dict[str, float]]:
    """Success per task: per-episode ``outcomes`` ``{name: (len(tasks) * n,)}`` listed task by task, ``n`` episodes
    each -> ``{task id: {name: rate}}``. A task solved (or failed) throughout hides in the mean; this shows it."""
    for name, o in outcomes.items():
        if len(o) != n * len(tasks):
            raise ValueError(f"{name} has {len(o)} outcomes, not {len(tasks)} tasks x {n}")
    return {t: {name: float(np.mean(np.asarray(o[j * n:(j + 1) * n], np.float64))) for name, o in outcomes.items()}
            for j, t in enumerate(tasks)}
