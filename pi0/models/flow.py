"""Flow-matching math of pi0 as pure functions: time embedding, time sampling, targets, Euler sampling."""

from __future__ import annotations

import math
from typing import Callable

import torch


def posemb_sincos(t: torch.Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0) -> torch.Tensor:
    """(B,) times -> (B, dim) sine-cosine embedding.

    as in openpi pi0.py posemb_sincos: fraction = linspace(0, 1, dim/2);
    period = min * (max/min)**fraction; emb = [sin(2*pi*t/period), cos(2*pi*t/period)].
    """
    if dim % 2:
        raise ValueError(f"time embedding dim must be even, got {dim}")
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float32, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    scale = 1.0 / period * 2 * math.pi  # same operation order as openpi
    x = t.to(torch.float32)[:, None] * scale[None, :]
    return torch.cat([torch.sin(x), torch.cos(x)], dim=-1)


def sample_time(batch_size: int, generator: torch.Generator | None = None, device: torch.device | None = None
                ) -> torch.Tensor:
    """(B,) flow times t ~ Beta(1.5, 1) * 0.999 + 0.001 (as in openpi pi0.py compute_loss); t=1 is noise."""
    # Beta(a, 1) has CDF x**a, so inverse-CDF sampling is u**(1/a); this keeps `generator` usable.
    u = torch.rand(batch_size, generator=generator, device=device, dtype=torch.float32)
    return u ** (1.0 / 1.5) * 0.999 + 0.001


def flow_matching_pair(actions: torch.Tensor, noise: torch.Tensor, time: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """actions, noise (B, H, A), time (B,) -> (x_t, u_t): x_t = t*noise + (1-t)*actions, u_t = noise - actions."""
    t = time[:, None, None].to(actions.dtype)
    return t * noise + (1 - t) * actions, noise - actions


def euler_integrate(velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], noise: torch.Tensor,
                    num_steps: int) -> torch.Tensor:
    """Integrate dx/dt = v(x, t) from t=1 (x = noise (B,H,A)) down to t=0 with ``num_steps`` Euler steps.

    as in openpi pi0.py sample_actions: dt = -1/num_steps, loop while t >= -dt/2, with t kept in float32
    (so t takes exactly openpi's values 1.0, 0.9, ... 0.1 for 10 steps). ``velocity`` gets x and a (B,) t.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    dt = -1.0 / num_steps
    x = noise
    t = torch.tensor(1.0, dtype=torch.float32)
    while t >= -dt / 2:
        v = velocity(x, t.expand(x.shape[0]).to(x.device))
        x = x + dt * v
        t = t + dt
    return x


def cfg_combine(v_uncond: torch.Tensor, v_cond: torch.Tensor, w: float) -> torch.Tensor:
    """Guided velocity (B,H,A): v_u + w * (v_c - v_u) (as in CFGRL / classifier-free guidance)."""
    return v_uncond + w * (v_cond - v_uncond)
