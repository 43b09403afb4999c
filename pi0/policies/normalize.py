"""openpi's ``norm_stats.json``: loading, saving, z-score and quantile (un)normalization."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

EPS = 1e-6  # as in openpi transforms.py Normalize / Unnormalize
MODES = ("zscore", "quantile")


@dataclass
class Stats:
    """Per-dimension statistics of one feature (D,)."""

    mean: np.ndarray
    std: np.ndarray
    q01: np.ndarray | None = None
    q99: np.ndarray | None = None

    @property
    def dim(self) -> int:
        """Feature width D."""
        return int(self.mean.shape[0])

    def to_json(self) -> dict[str, list[float]]:
        """openpi's per-feature dict."""
        out = {"mean": self.mean.tolist(), "std": self.std.tolist()}
        if self.q01 is not None and self.q99 is not None:
            out.update(q01=self.q01.tolist(), q99=self.q99.tolist())
        return out


NormStats = dict[str, Stats]  # keys: "state", "actions"


def load_norm_stats(path: str | Path) -> NormStats:
    """Read openpi's ``{"norm_stats": {"state": {...}, "actions": {...}}}`` with clear errors."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"norm stats not found at {path}. A pi0 checkpoint needs norm_stats.json (openpi keeps it in "
            f"<ckpt>/assets/<asset_id>/norm_stats.json); pass its path explicitly or copy it next to the weights."
        )
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    raw = raw.get("norm_stats", raw)
    stats: NormStats = {}
    for key in ("state", "actions"):
        if key not in raw:
            raise ValueError(f"{path} has no '{key}' entry (found {sorted(raw)}); expected openpi's format")
        entry = raw[key]
        missing = [f for f in ("mean", "std") if f not in entry]
        if missing:
            raise ValueError(f"{path}: '{key}' lacks {missing}")
        arr = {k: np.asarray(entry[k], dtype=np.float64) for k in ("mean", "std", "q01", "q99") if k in entry}
        stats[key] = Stats(arr["mean"], arr["std"], arr.get("q01"), arr.get("q99"))
    return stats


def save_norm_stats(stats: NormStats, path: str | Path) -> None:
    """Write ``stats`` in openpi's format."""
    Path(path).write_text(json.dumps({"norm_stats": {k: v.to_json() for k, v in stats.items()}}, indent=2))


def _pad(x: np.ndarray, dim: int, value: float) -> np.ndarray:
    """Pad a (D,) vector with ``value`` up to ``dim`` entries."""
    return np.concatenate([x, np.full(dim - x.shape[0], value)]) if dim > x.shape[0] else x[:dim]


def _scale_shift(stats: Stats, mode: str, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """z-score (scale, shift) with x_norm = (x - shift) / scale, padded to ``dim`` (scale 1, shift 0).

    as in openpi transforms.py _normalize: (x - mean) / (std + eps); quantile mode is computed in ``normalize``.
    """
    if mode == "zscore":
        return _pad(stats.std + EPS, dim, 1.0), _pad(stats.mean, dim, 0.0)
    raise ValueError(f"normalization mode must be one of {MODES}, got {mode!r}")


def _quantiles(stats: Stats, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(q01, q99) sliced to the first min(D_x, D_stats) dims as float64 tensors on x's device, and that width."""
    if stats.q01 is None or stats.q99 is None:
        raise ValueError("quantile normalization needs q01/q99 in norm_stats.json")
    d = min(x.shape[-1], stats.q01.shape[0])
    as_t = lambda a: torch.as_tensor(a[:d], dtype=torch.float64, device=x.device)  # noqa: E731
    return as_t(stats.q01), as_t(stats.q99), d


def normalize(x: torch.Tensor, stats: Stats, mode: str = "zscore") -> torch.Tensor:
    """(..., D) raw -> normalized, computed in float64 on the first D dims (extra dims untouched)."""
    xd = x.to(torch.float64)
    if mode == "quantile":
        # as in openpi transforms.py _normalize_quantile, operation for operation (bit-identical in float64).
        q01, q99, d = _quantiles(stats, xd)
        out = xd.clone()
        out[..., :d] = (xd[..., :d] - q01) / (q99 - q01 + EPS) * 2.0 - 1.0
        return out
    scale, shift = _scale_shift(stats, mode, x.shape[-1])
    return (xd - torch.as_tensor(shift, device=x.device)) / torch.as_tensor(scale, device=x.device)


def unnormalize(x: torch.Tensor, stats: Stats, mode: str = "zscore") -> torch.Tensor:
    """(..., D) normalized -> raw in float64; dims past the stats' width pass through unchanged."""
    xd = x.to(torch.float64)
    if mode == "quantile":
        # as in openpi transforms.py _unnormalize_quantile: (x + 1) / 2 * (q99 - q01 + eps) + q01, with numpy's
        # promotion: (x + 1.0) / 2.0 stays in x's dtype (float32 for a model output), the rest is float64.
        q01, q99, d = _quantiles(stats, xd)
        xs = x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)
        out = xd.clone()
        out[..., :d] = ((xs[..., :d] + 1.0) / 2.0).to(torch.float64) * (q99 - q01 + EPS) + q01
        return out
    scale, shift = _scale_shift(stats, mode, x.shape[-1])
    return xd * torch.as_tensor(scale, device=x.device) + torch.as_tensor(shift, device=x.device)


def discretize_state(state: np.ndarray, bins: int = 256) -> np.ndarray:
    """(..., S) normalized state -> int bins in [-1, 255], as in openpi tokenizer.py (pi0-FAST and pi0.5 prompts):
    digitize(state, linspace(-1, 1, bins + 1)[:-1]) - 1."""
    return np.digitize(state, bins=np.linspace(-1, 1, bins + 1)[:-1]) - 1
