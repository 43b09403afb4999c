"""LoRA adapters on pi0's Gemma (and optionally SigLIP) linear layers, our own small module.

``LoRALinear`` *is* an ``nn.Linear`` (same ``weight`` / ``bias`` parameters, so checkpoint keys and the HF/openpi key
map are unchanged) with two extra parameters: y = x W^T + b + (alpha / r) (x A^T) B^T, A (r, in), B (out, r).
B starts at zero (Hu et al. 2021), so at initialisation the model computes exactly what it did. Rank and alpha
default to openpi's ``gemma_2b_lora`` (r=16, alpha=16) for the VLM and ``gemma_300m_lora`` (r=32, alpha=32) for the
action expert, on the attention (q, k, v, o) and MLP (gate, up, down) projections. (openpi draws both LoRA factors
from N(0, 0.01); a zero B keeps the converted policy's outputs bit-identical instead.)

We do not use PEFT: it would wrap the modules (``base_layer.weight`` keys), which breaks the plain key map of our
checkpoints, and its merge/unload rewrites the module tree; a 40-line subclass does what pi0 needs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

GEMMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SIGLIP_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


class LoRALinear(nn.Linear):
    """``nn.Linear`` + a rank-``rank`` update scaled by ``alpha / rank`` (module docstring)."""

    @classmethod
    def from_linear(cls, lin: nn.Linear, rank: int, alpha: float) -> "LoRALinear":
        """A LoRA layer sharing ``lin``'s weight and bias tensors (no copy)."""
        w = lin.weight
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight, new.bias = lin.weight, lin.bias
        new.rank, new.alpha, new.scaling = int(rank), float(alpha), float(alpha) / int(rank)
        new.lora_A = nn.Parameter(torch.empty(rank, lin.in_features, device=w.device, dtype=w.dtype))
        new.lora_B = nn.Parameter(torch.zeros(lin.out_features, rank, device=w.device, dtype=w.dtype))
        with torch.no_grad():
            a = torch.empty(rank, lin.in_features, dtype=torch.float32, device=w.device)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            new.lora_A.copy_(a)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out)."""
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling

    def delta(self) -> torch.Tensor:
        """The merged update (out, in) in float32: (alpha / r) B A."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scaling


def _replace(module: nn.Module, names: tuple[str, ...], rank: int, alpha: float) -> int:
    n = 0
    for parent in list(module.modules()):
        for name in names:
            child = getattr(parent, name, None)
            if isinstance(child, nn.Linear) and not isinstance(child, LoRALinear):
                setattr(parent, name, LoRALinear.from_linear(child, rank, alpha))
                n += 1
    return n


def apply_lora(model: nn.Module, vlm: tuple[int, float] = (16, 16.0), expert: tuple[int, float] = (32, 32.0),
               vision: tuple[int, float] | None = None) -> int:
    """Put LoRA adapters on a ``PI0Model``'s Gemma layers ((rank, alpha) per part; ``vision`` also on SigLIP)
    -> the number of adapted layers. Idempotent."""
    pwe = model.paligemma_with_expert
    vlm_gemma, expert_gemma = pwe.experts
    n = _replace(vlm_gemma.layers, GEMMA_TARGETS, *vlm) + _replace(expert_gemma.layers, GEMMA_TARGETS, *expert)
    if vision is not None:
        n += _replace(pwe.paligemma.vision_tower, SIGLIP_TARGETS, *vision)
    model.lora_config = {"vlm": list(vlm), "expert": list(expert), "vision": list(vision) if vision else None}
    return n


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def is_lora_param(name: str) -> bool:
    return name.endswith(".lora_A") or name.endswith(".lora_B")


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every LoRA update merged into its base weight and the adapters dropped: a plain
    checkpoint (the model itself is not changed)."""
    state = {k: v for k, v in model.state_dict().items() if not is_lora_param(k)}
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            w = state[f"{name}.weight"]
            state[f"{name}.weight"] = (w.float() + m.delta().to(w.device)).to(w.dtype)
    return state


def save_adapters(model: nn.Module, directory: str | Path) -> Path:
    """Write the adapters alone (``adapter_model.safetensors`` + ``adapter_config.json``) into ``directory``: the LoRA
    factors and the other parameters that train beside them (pi0's small projections; PEFT's modules_to_save)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if not has_lora(model):
        raise ValueError("the model has no LoRA adapters (apply_lora / algo.trainable=lora)")
    trains = {k for k, p in model.named_parameters() if p.requires_grad}
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()
               if is_lora_param(k) or k in trains}
    save_file(tensors, str(directory / ADAPTER_FILE))
    (directory / ADAPTER_CONFIG).write_text(json.dumps(getattr(model, "lora_config", {}), indent=2))
    return directory


def load_adapters(model: nn.Module, directory: str | Path) -> nn.Module:
    """Apply the adapters saved by :func:`save_adapters` to a base ``PI0Model`` (clear error on a mismatch)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    for f in (ADAPTER_FILE, ADAPTER_CONFIG):
        if not (directory / f).is_file():
            raise FileNotFoundError(f"{directory / f} does not exist: give a directory written by save_adapters")
    lc = json.loads((directory / ADAPTER_CONFIG).read_text())
    apply_lora(model, tuple(lc["vlm"]), tuple(lc["expert"]), tuple(lc["vision"]) if lc.get("vision") else None)
    tensors = load_file(str(directory / ADAPTER_FILE))
    state = model.state_dict()
    lora = {k for k in state if is_lora_param(k)}
    missing, unexpected = lora - set(tensors), set(tensors) - set(state)
    if missing or unexpected:
        raise ValueError(f"{directory / ADAPTER_FILE}: adapter keys do not match the model (missing "
                         f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
    model.load_state_dict(tensors, strict=False)
    return model
