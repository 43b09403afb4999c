"""Policy loading: ``load_policy(dir)`` reads our directories (config.json's ``model_type`` picks the class) and, by
the files and key prefixes found, openpi's PyTorch format, RLinf's layout and LeRobot's pi0 / pi05
(``pi0.conversion.openpi_pytorch``).

pi0 directories written before ``model_type`` existed have none and load as pi0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from pi0.errors import UserError

MODEL_TYPES = ("pi0", "pi0fast")
FOREIGN_OPTIONS = ("norm_stats", "tokenizer", "openpi_config", "delta_action_dims")  # only for foreign layouts


def model_type_of(directory: str | Path) -> str:
    """'pi0' or 'pi0fast': from <directory>/config.json for our format (missing field = 'pi0'); every foreign
    layout (openpi-PyTorch, RLinf, LeRobot pi0/pi05) is 'pi0'; an unreadable directory gets a one-line UserError."""
    from pi0.conversion.foreign_files import detect, is_our_policy_dir

    path = Path(directory) / "config.json"
    if not is_our_policy_dir(directory):
        detect(directory)  # raises naming what it found and what it expected
        return "pi0"
    try:
        kind = json.loads(path.read_text()).get("model_type", "pi0")
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if kind not in MODEL_TYPES:
        raise ValueError(f"{path}: unknown model_type {kind!r}; known: {list(MODEL_TYPES)}")
    return kind


def load_policy(directory: str | Path, device: str = "cpu", **overrides: Any) -> nn.Module:
    """A ``PI0Policy`` or ``PI0FASTPolicy`` from a directory of any supported layout.

    Foreign layouts also take ``norm_stats`` (a norm_stats.json path), ``tokenizer`` (PaliGemma's sentencepiece
    model), ``openpi_config`` (a preset name) and ``delta_action_dims``; ``None`` values are ignored.
    """
    overrides = {k: v for k, v in overrides.items() if not (k in FOREIGN_OPTIONS and v is None)}
    if model_type_of(directory) == "pi0fast":
        from pi0.policies.pi0fast import PI0FASTPolicy

        if set(overrides) & set(FOREIGN_OPTIONS):
            raise UserError(f"{sorted(set(overrides) & set(FOREIGN_OPTIONS))} apply only to openpi-PyTorch / RLinf / "
                            f"LeRobot directories, not to our pi0-FAST directory {directory}")
        return PI0FASTPolicy.from_pretrained(directory, device=device, **overrides)
    from pi0.policies.pi0 import PI0Policy

    return PI0Policy.from_pretrained(directory, device=device, **overrides)


def check_checkpoint(directory: str | Path, what: str = "checkpoint", **options: Any) -> str:
    """Check that ``directory`` loads as a pi0 / pi0.5 policy, reading headers and small files only -> a one-line
    description; a UserError naming what is wrong otherwise. ``options``: the foreign-layout ones (FOREIGN_OPTIONS)."""
    from pi0.conversion.foreign_files import find_tokenizer, is_our_policy_dir
    from pi0.conversion.openpi_pytorch import plan_foreign
    from pi0.errors import require_path

    options = {k: v for k, v in options.items() if v not in (None, "")}
    require_path(directory, what, "give a policy directory: ours (convert_pi0_to_hf_lerobot.py), openpi-PyTorch, RLinf "
                 "or LeRobot", True)
    if is_our_policy_dir(directory):
        for f in ("model.safetensors", "config.json", "norm_stats.json", "tokenizer.model"):
            require_path(Path(directory) / f, f"{what}: {f}", "a policy directory holds model.safetensors, "
                         "config.json, norm_stats.json and tokenizer.model (convert_pi0_to_hf_lerobot.py writes them)")
        if options:
            raise UserError(f"{what}: {sorted(options)} apply only to openpi-PyTorch / RLinf / LeRobot directories")
        return f"{directory}: our policy directory"
    try:
        fp = plan_foreign(directory, options.get("norm_stats"), options.get("openpi_config"),
                          options.get("delta_action_dims"))
        find_tokenizer(Path(directory), options.get("tokenizer"))
    except UserError as e:
        raise UserError(f"{what}: {e}") from e
    return f"{directory}: {fp.ckpt.layout} layout, {fp.ckpt.model_type}"
