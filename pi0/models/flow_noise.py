"""Flow-Noise: pi0's Euler sampler with a learned Gaussian at every denoising step, so the whole chain has an exact
log-density (ReinFlow; pi-RL's "flow_noise"; facts: ``../shared/notes/rl_references.md``, section 3).

Step k of N (t_k = 1 - k/N, dt = 1/N) draws

    x_{k+1} ~ N(x_k - dt v(x_k, t_k),  std_k^2),   std_k = noise_head_std(head(suffix_out_k), min_std, max_std)

per action token and dim: the mean is the deterministic Euler step, and a small MLP on the action expert's output
tokens (not detached) sets the spread, bounded to [min_std, max_std]. The chain's log-density is the sum of the N
transitions; as in RLinf's ``joint_logprob`` the sum is divided by N + 1 (RLinf averages the N(0, I) prior with the N
transitions; the prior does not depend on the weights, so in a PPO ratio only the 1 / (N + 1) scale remains).
``PI0Model.sample_actions_flow_noise`` samples and records the chain; ``PI0Model.chain_log_prob`` recomputes it
under new weights. Evaluation keeps the deterministic sampler, which the head does not touch.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def noise_head_std(raw: torch.Tensor, min_std: float, max_std: float) -> torch.Tensor:
    """Unbounded head output (any shape) -> std in [min_std, max_std]: tanh(raw) mapped linearly onto
    [log min_std^2, log max_std^2], std = exp(logvar / 2) (raw = 0 gives the geometric mean sqrt(min_std max_std)).

    as in RLinf ExploreNoiseNet.post_process (``noise_logvar_range`` holds the std bounds)."""
    lo, hi = 2.0 * math.log(min_std), 2.0 * math.log(max_std)
    logvar = lo + (torch.tanh(raw) + 1.0) * (0.5 * (hi - lo))
    return torch.exp(0.5 * logvar)


class NoiseHead(nn.Module):
    """The learned noise: (B, H, W) action-token outputs of the expert -> (B, H, A) raw values for
    :func:`noise_head_std`. An MLP W -> 128 -> 64 -> A with tanh activations (as RLinf's 1024 -> 128 -> 64 -> 32);
    its output layer starts at zero, so every std starts at sqrt(min_std max_std)."""

    def __init__(self, width: int, action_dim: int):
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(width, 128), nn.Linear(128, 64), nn.Linear(64, action_dim)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(feats.to(self.fc1.weight.dtype)))))
        return self.out(h).float()
