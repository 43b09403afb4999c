"""Flow-SDE: pi0's Euler sampler made stochastic, so each denoising step is a Gaussian with an exact log-density.

As in Flow-GRPO's ``sde_step_with_logprob`` and RLinf's pi0 port (facts: ``../shared/notes/rl_references.md``): on
the time grid t = 1, 1 - d, ..., d (d = 1/N, the flow runs from noise at t=1 to actions at t=0), with the model's
velocity v at (x_t, t),

    x0_hat = x_t - t v,   x1_hat = x_t + (1 - t) v,   sigma_t = a sqrt(t / (1 - t))   (1 - t := d at t = 1)
    mean   = x_t - d v - sigma_t^2 d / (2 t) * x1_hat,   std = sigma_t sqrt(d)

so a = 0 gives the deterministic Euler step back. These are pure functions; ``PI0Model.sample_actions_sde`` runs
them on the model and records the chain, and the RL update recomputes a recorded step's log-density under new
weights (``step_log_prob``).
"""

from __future__ import annotations

import functools
import math

import torch

LOG_2PI = math.log(2 * math.pi)


def sde_times(num_steps: int) -> list[float]:
    """The N times at which the velocity is evaluated: 1, 1 - 1/N, ..., 1/N (float32 values, as the ODE sampler)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    return list(_sde_times(num_steps))


@functools.lru_cache(maxsize=64)
def _sde_times(num_steps: int) -> tuple[float, ...]:
    d = torch.tensor(1.0 / num_steps, dtype=torch.float32)
    return tuple(float(torch.tensor(1.0, dtype=torch.float32) - k * d) for k in range(num_steps))


def sde_coefficients(t: float | torch.Tensor, dt: float, noise_level: float, like: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Time t (a float, or (B,) per sample), dt = 1/N, noise level a -> (1 - t, sigma_t^2 dt / (2 t), std), each a
    scalar tensor (or (B,1,1)) in ``like``'s dtype and device (sigma in float64 first, as Flow-GRPO's).

    Split from :func:`sde_step_moments` so that a sampler can compute them before a CUDA graph runs the step.
    """
    if not torch.is_tensor(t):
        t = torch.tensor(float(t), dtype=torch.float64)
    t = t.to(torch.float64)
    one_minus_t = torch.where(t >= 1.0, torch.full_like(t, dt), 1.0 - t)  # at t = 1: 1 - t := dt (finite sigma)
    sigma = noise_level * torch.sqrt(t / one_minus_t)
    shape = (-1, 1, 1) if t.ndim else ()
    t_, sigma_ = t.reshape(shape).to(like), sigma.reshape(shape).to(like)
    return 1.0 - t_, sigma_ ** 2 * dt / (2.0 * t_), sigma_ * math.sqrt(dt)


def sde_mean(x_t: torch.Tensor, v: torch.Tensor, dt: float, one_minus_t: torch.Tensor, coef: torch.Tensor
             ) -> torch.Tensor:
    """x_t, v (B,H,A) and :func:`sde_coefficients` -> the step's mean x_t - dt v - coef (x_t + (1 - t) v)."""
    x1_hat = x_t + one_minus_t * v
    return x_t - dt * v - coef * x1_hat


def sde_step_moments(x_t: torch.Tensor, v: torch.Tensor, t: float | torch.Tensor, dt: float, noise_level: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """x_t, v (B,H,A), time t (a float, or (B,) per sample), step size dt = 1/N > 0, noise level a ->
    (mean (B,H,A), std: a scalar tensor, or (B,1,1) for per-sample t).

    as in Flow-GRPO sde_step_with_logprob / RLinf sample_mean_var_val (see the module docstring).
    """
    one_minus_t, coef, std = sde_coefficients(t, dt, noise_level, x_t)
    return sde_mean(x_t, v, dt, one_minus_t, coef), std


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Elementwise log N(x; mean, std^2) (same shape as x); a density, so it can exceed 0 for small std."""
    z = (x - mean) / std
    return -0.5 * z * z - torch.log(std) - 0.5 * LOG_2PI


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, H, A) values, (B, H, A) or broadcastable bool/float mask -> (B,) sum of the masked entries."""
    return (values * mask.to(values.dtype)).flatten(1).sum(-1)


def pick_sde_step(num_steps: int, sde_step: int | None, generator: torch.Generator | None = None) -> int:
    """The stochastic step of one Flow-SDE call: ``sde_step``, or (None) one drawn uniformly from 0..N-1 with
    ``generator`` (one randint call: eager and fast samplers draw alike); ValueError outside [0, N)."""
    if sde_step is None:
        sde_step = int(torch.randint(num_steps, (1,), generator=generator))
    if not 0 <= sde_step < num_steps:
        raise ValueError(f"sde_step must be in [0, {num_steps}), got {sde_step}")
    return int(sde_step)
