"""safetensors I/O with early, explicit errors (missing files, corrupt files, key / shape mismatches)."""

from __future__ import annotations

import struct
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

POLICY_FILES = ("model.safetensors", "config.json", "norm_stats.json", "tokenizer.model")


def check_policy_dir(directory: Path) -> dict[str, Path]:
    """Check that a policy directory exists and holds every file -> {file name: path}."""
    if not directory.exists():
        raise FileNotFoundError(
            f"checkpoint directory {directory} does not exist. Convert an openpi checkpoint with "
            f"`python convert_pi0_to_hf_lerobot.py --checkpoint_dir <ckpt>/params --output_path {directory}` "
            f"or save one with PI0Policy.save_pretrained().")
    if not directory.is_dir():
        raise NotADirectoryError(f"{directory} is a file; expected a policy directory holding {list(POLICY_FILES)}")
    missing = [f for f in POLICY_FILES if not (directory / f).is_file()]
    if missing:
        hint = {
            "norm_stats.json": "copy openpi's <ckpt>/assets/<asset_id>/norm_stats.json there "
                               "(or re-run the converter with --norm_stats PATH)",
            "tokenizer.model": "copy PaliGemma's sentencepiece model there (or re-run the converter with --tokenizer)",
        }
        hints = "; ".join(hint[f] for f in missing if f in hint)
        raise FileNotFoundError(f"{directory} lacks {missing}" + (f": {hints}" if hints else ""))
    return {f: directory / f for f in POLICY_FILES}


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write tensors atomically (tmp file + rename), so a crash never leaves a truncated checkpoint."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Read a safetensors file; a truncated or corrupt file raises ValueError naming it."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise ValueError(f"{path} is not a safetensors file ({size} bytes): re-download or re-convert it")
    (header_len,) = struct.unpack("<Q", head)
    if header_len > size - 8:
        raise ValueError(f"{path} is truncated or corrupt (header says {header_len} bytes, file has {size}): "
                         f"re-convert or re-copy it")
    try:
        return load_file(str(path))
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path} is truncated or corrupt ({e}): re-convert or re-copy it") from e


def load_into(model: nn.Module, state: dict[str, torch.Tensor], source: object = "state dict") -> None:
    """Strictly copy ``state`` into ``model``: every key must exist on both sides with the same shape."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    bad_shape = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
                 for k in own if k in state and state[k].shape != own[k].shape]
    if missing or unexpected or bad_shape:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s), e.g. {missing[:5]}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} key(s), e.g. {unexpected[:5]}")
        if bad_shape:
            parts.append(f"shape mismatch in {len(bad_shape)} tensor(s), e.g. {bad_shape[:3]}")
        raise ValueError(f"{source} does not match the model config: " + "; ".join(parts) +
                         ". Check config.json against the weights (was the checkpoint converted for another variant?)")
    with torch.no_grad():
        for k, t in own.items():
            t.copy_(state[k].to(t.dtype))
