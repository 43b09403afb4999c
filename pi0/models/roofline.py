"""What one sampling call must at least cost on a device: the bytes of weights it reads, and the device's measured
copy bandwidth (``bench/sampling.py``'s roofline: weight bytes / bandwidth is the floor of a memory-bound call)."""

from __future__ import annotations

import math
import time
from typing import Any

import torch


def weight_bytes_per_call(model: Any, num_steps: int, cameras: int) -> dict[str, int]:
    """Bytes of weights one FastSampler call reads (each pass reads its weights once from memory).

    SigLIP + projector once (``cameras`` > 0: all live cameras go in one batched pass); the VLM Gemma layers
    once (prefix); the action expert once with the prefix (state token) and once per Euler step; the embedding
    table is excluded (only B*L rows are read).
    """
    pwe = model.paligemma_with_expert
    nbytes = lambda mod: sum(p.numel() * p.element_size() for p in mod.parameters())  # noqa: E731
    vlm, expert = pwe.experts
    vision = nbytes(pwe.paligemma.vision_tower) + nbytes(pwe.paligemma.multi_modal_projector)
    gemma = nbytes(vlm.layers) + nbytes(vlm.norm)
    exp = nbytes(expert)
    heads = sum(nbytes(getattr(model, n))
                for n in ("action_in_proj", "action_time_mlp_in", "action_time_mlp_out", "action_out_proj")
                if hasattr(model, n))  # pi0.5: its time MLP runs once per Euler time, outside the loop
    state = 0 if model.cfg.pi05 else nbytes(model.state_proj)
    passes = num_steps if model.cfg.pi05 else num_steps + 1  # pi0: + the state token's pass with the prefix
    parts = {"siglip": vision * min(cameras, 1), "gemma_prefix": gemma, "expert": exp * passes,
             "heads": heads * num_steps + state}
    parts["total"] = sum(parts.values())
    return parts


def copy_bandwidth(device: str | torch.device, mbytes: int = 512, iters: int = 5) -> float:
    """Measured bytes/s of a large device-to-device copy (read + write counted), best of ``iters``."""
    n = mbytes * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = math.inf
    cuda = torch.device(device).type == "cuda"
    for _ in range(iters + 1):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * src.element_size() / best
