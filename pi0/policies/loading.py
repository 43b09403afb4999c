"""Policy loading by model type: ``load_policy(dir)`` reads config.json's ``model_type`` and builds the right class.

pi0 directories written before ``model_type`` existed have none and load as pi0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

MODEL_TYPES = ("pi0", "pi0fast")


def model_type_of(directory: str | Path) -> str:
    """'pi0' or 'pi0fast' from <directory>/config.json (missing field = 'pi0'); clear errors otherwise."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass a policy directory written by save_pretrained or "
                                f"convert_pi0_to_hf_lerobot.py")
    try:
        kind = json.loads(path.read_text()).get("model_type", "pi0")
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if kind not in MODEL_TYPES:
        raise ValueError(f"{path}: unknown model_type {kind!r}; known: {list(MODEL_TYPES)}")
    return kind


def load_policy(directory: str | Path, device: str = "cpu", **overrides: Any) -> nn.Module:
    """A ``PI0Policy`` or ``PI0FASTPolicy`` from its directory (dispatch on config.json's model_type)."""
    if model_type_of(directory) == "pi0fast":
        from pi0.policies.pi0fast import PI0FASTPolicy

        return PI0FASTPolicy.from_pretrained(directory, device=device, **overrides)
    from pi0.policies.pi0 import PI0Policy

    return PI0Policy.from_pretrained(directory, device=device, **overrides)
