"""What an openpi ``TrainConfig`` fixes that a checkpoint's parameter tree cannot say (conversion presets).

A params tree gives the network's sizes, but not the action horizon, the token budget, the normalization, which
action dims are deltas, or the prompt format: those live in openpi's ``training/config.py`` (commit 15a9616).
``convert_pi0_to_hf_lerobot.py --openpi_config NAME`` takes them from here; explicit flags still win.

Facts (openpi ``training/config.py``, ``models/pi0_config.py``, ``models/pi0_fast.py``, ``transforms.py``):
- pi0 models default to ``action_horizon=50, max_token_len=48``; pi0-FAST to ``max_token_len=250``; pi0.5 to 200.
- ``use_quantile_norm = model_type != PI0``: pi0 normalizes by z-score, pi0-FAST and pi0.5 by q01/q99.
- LIBERO: ``pi0_libero`` / ``pi0_fast_libero`` set ``LeRobotLiberoDataConfig(extra_delta_transform=True)``, so the
  first 6 action dims are deltas (``make_bool_mask(6, -1)``); ``pi05_libero`` keeps the default (absolute), although
  its norm stats carry the same asset id. DROID configs are absolute.
- pi0-FAST writes the state into the prompt as 256 bins ("Task: ..., State: ...;\\n"); pi0.5 does so when
  ``discrete_state_input`` (default True; ``pi05_libero`` sets False).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pi0.errors import UserError


@dataclass(frozen=True)
class OpenpiConfig:
    """The settings of one openpi TrainConfig that conversion needs."""

    model_type: str  # "pi0" | "pi0fast" | "pi05"
    action_horizon: int
    max_token_len: int
    normalization: str  # "zscore" | "quantile"
    delta_action_dims: int  # leading action dims predicted as deltas to the state (AbsoluteActions on output)
    prompt_format: str  # "pi0" (text only) | "fast" (text + state bins + action tokens) | "pi05_state" (text + bins)
    action_dim: int | None = None  # model action_dim when the config sets it (pi0-FAST: the env's width)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


# as in openpi training/config.py (commit 15a9616): _CONFIGS entries of these names.
OPENPI_CONFIGS: dict[str, OpenpiConfig] = {
    "pi0_libero": OpenpiConfig("pi0", 50, 48, "zscore", 6, "pi0"),
    "pi0_fast_libero": OpenpiConfig("pi0fast", 10, 180, "quantile", 6, "fast", action_dim=7),
    "pi0_droid": OpenpiConfig("pi0", 10, 48, "zscore", 0, "pi0"),
    "pi0_fast_droid": OpenpiConfig("pi0fast", 10, 250, "quantile", 0, "fast", action_dim=8),
    "pi05_libero": OpenpiConfig("pi05", 10, 200, "quantile", 0, "pi0"),
    "pi05_droid": OpenpiConfig("pi05", 15, 200, "quantile", 0, "pi05_state"),
}


IMPLEMENTED = ("pi0", "pi0fast", "pi05")  # model types the converter handles


def get_openpi_config(name: str, model_type: str | None = None) -> OpenpiConfig:
    """The preset ``name``; ``model_type`` (from the params tree) must agree with it. UserError otherwise."""
    if name not in OPENPI_CONFIGS:
        raise UserError(f"unknown --openpi_config {name!r}; known openpi configs: {', '.join(OPENPI_CONFIGS)}")
    cfg = OPENPI_CONFIGS[name]
    if cfg.model_type not in IMPLEMENTED:
        ready = [n for t in IMPLEMENTED for n in names_for(t)]
        raise UserError(f"--openpi_config {name} is a {cfg.model_type} config, and {cfg.model_type} conversion is not "
                        f"implemented yet; implemented: {', '.join(ready)}")
    if model_type is not None and cfg.model_type != model_type:
        matching = names_for(model_type)
        raise UserError(f"--openpi_config {name} is a {cfg.model_type} config but the checkpoint holds a "
                        f"{model_type} parameter tree; choose one of {', '.join(matching)}")
    return cfg


def names_for(model_type: str) -> list[str]:
    """Preset names of one model type (for error messages)."""
    return [n for n, c in OPENPI_CONFIGS.items() if c.model_type == model_type]
