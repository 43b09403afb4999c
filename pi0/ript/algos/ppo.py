"""The PPO-clipped surrogate of RIPT-VLA's LOOP (RLOO advantages x clipped probability ratios), as a pure function."""

from __future__ import annotations

import torch


def clipped_surrogate(logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                      clip_low: float = 0.2, clip_high: float = 0.2) -> tuple[torch.Tensor, dict[str, float]]:
    """(N,) new / old log-probabilities and advantages -> (loss, stats).

    as in PPO (Schulman et al. 2017) and RIPT-VLA's LOOP: r = exp(logp_new - logp_old);
    loss = -mean(min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)). Stats: the clipped fraction and the mean ratio.
    """
    ratio = torch.exp(logp_new - logp_old.detach())
    adv = advantages.detach().to(ratio.dtype)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped).mean()
    with torch.no_grad():
        clip_frac = ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).float().mean().item()
    return loss, {"clip_frac": clip_frac, "ratio_mean": ratio.detach().mean().item()}
