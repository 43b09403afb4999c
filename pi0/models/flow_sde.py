"""Flow-SDE: pi0's Euler sampler made stochastic, so each denoising step is a Gaussian with an exact log-density.

As in Flow-GRPO's ``sde_step_with_logprob`` and RLinf's pi0 port (facts: ``../shared/notes/rl_references.md``): on
the time grid t = 1, 1 - d, ..., d (d = 1/N, the flow runs from noise at t=1 to actions at t=0), with the model's
velocity v at (x_t, t),

    x0_hat = x_t - t v,   x1_hat = x_t + (1 - t) v,   sigma_t = a sqrt(t / (1 - t))   (1 - t := d at t = 1)
    mean   = x_t - d v - sigma_t^2 d / (2 t) * x1_hat,   std = sigma_t sqrt(d)

so a = 0 gives the deterministic Euler step back. At t = 1 this step keeps (1 - a^2 / 2) of x_t and adds noise of
std a (for any N): at a = 1 the chain leaves the marginals the model was trained on (x_t ~ (1 - t) x0 + t x1).
``kind="cps"`` is Coefficients-Preserving Sampling instead (Flow-CPS, Wang & Yu 2025, arXiv 2509.05952; DDIM's eta
for flow matching): with s = t - d the next time and eta = a in (0, 1],

    mean = (1 - s) x0_hat + s cos(eta pi / 2) x1_hat  =  x_t - d v - s (1 - cos(eta pi / 2)) x1_hat,
    std  = s sin(eta pi / 2)

so the step keeps x_{t-d}'s coefficients on x0 and on the noise (cos^2 + sin^2 = 1); eta = 0 is the Euler step
again, and the last step (s = 0) cannot be stochastic. Both kinds share the mean's form x_t - d v - coef x1_hat, so
the samplers and the update differ only in (coef, std). These are pure functions; ``PI0Model.sample_actions_sde``
runs them on the model and records the chain, and the RL update recomputes a recorded step's log-density under new
weights (``step_log_prob``).

Which steps are stochastic: one step k (fixed, or drawn per call: RLinf's hybrid ODE/SDE sampler), or, with
``sde_step = EVERY_STEP``, all N of them (flow_sde only), as Flow-GRPO samples; the chain's log-density is then the sum
of the N steps' (``PI0Model.chain_log_prob``), so a PPO ratio on it sees every step that moves the executed actions,
where a one-step ratio sees only step k's share (``bench/rl_drift.py`` measures that share).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

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


SDE_KINDS = ("flow_sde", "cps")
DRAWN = -1  # a config's ``sde_step`` value: one step drawn uniformly per sampler call (the samplers' None)
EVERY_STEP = -2  # ``sde_step`` value: every denoising step stochastic, one log-density for the whole chain


def sampler_step(setting: int) -> int | None:
    """A config's ``sde_step`` (DRAWN, EVERY_STEP or a step k) -> the samplers' argument (None for DRAWN)."""
    return None if setting == DRAWN else int(setting)


def sde_steps(num_steps: int, sde_step: int) -> range:
    """The stochastic steps of a chain whose ``sde_step`` is k (range(k, k + 1)) or EVERY_STEP (range(num_steps))."""
    return range(num_steps) if sde_step == EVERY_STEP else range(sde_step, sde_step + 1)


def stochastic_steps(num_steps: int, kind: str) -> int:
    """How many of the N denoising steps (the first ones) ``kind`` can make stochastic: N for flow_sde, N - 1 for cps
    (its last step's next time is 0, so its std would be 0); ValueError for an unknown kind."""
    if kind not in SDE_KINDS:
        raise ValueError(f"sde kind must be one of {SDE_KINDS}, got {kind!r}")
    return num_steps - 1 if kind == "cps" else num_steps


def check_sde(kind: str, noise_level: float, sde_step: int | None, num_steps: int) -> None:
    """ValueError (one line) for a stochastic step these settings cannot make: an unknown ``kind``, a noise level
    <= 0 (or > 1 for cps, where it is eta), or a step ``kind`` cannot make stochastic (cps: not the last, so not
    EVERY_STEP either)."""
    steps = stochastic_steps(num_steps, kind)
    if not noise_level > 0 or (kind == "cps" and noise_level > 1):
        raise ValueError(f"noise level must be in {'(0, 1]' if kind == 'cps' else '> 0'} for {kind}, "
                         f"got {noise_level}")
    if sde_step is None or 0 <= sde_step < steps or (sde_step == EVERY_STEP and kind == "flow_sde"):
        return
    if sde_step == EVERY_STEP:
        raise ValueError(f"cps cannot make every step stochastic (sde_step {EVERY_STEP}): its last step's std is 0")
    if kind == "cps" and sde_step == num_steps - 1:
        raise ValueError(f"cps cannot make the last denoising step ({num_steps - 1}) stochastic: its next time is 0, "
                         f"so its std is 0; got sde_step {sde_step}")
    raise ValueError(f"sde_step must be in [0, {steps}) for {kind} with {num_steps} steps, got {sde_step}")


def sde_coefficients(t: float | torch.Tensor, dt: float, noise_level: float, like: torch.Tensor,
                     kind: str = "flow_sde") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Time t (a float, or (B,) per sample), dt = 1/N, noise level a (cps: eta), ``kind`` -> (1 - t, coef, std),
    each a scalar tensor (or (B,1,1)) in ``like``'s dtype and device, for :func:`sde_mean`'s
    x_t - dt v - coef x1_hat. flow_sde: coef = sigma_t^2 dt / (2 t), std = sigma_t sqrt(dt) (sigma in float64
    first, as Flow-GRPO's); cps: coef = s (1 - cos(eta pi / 2)), std = s sin(eta pi / 2), s = t - dt.

    Split from :func:`sde_step_moments` so that a sampler can compute them before a CUDA graph runs the step.
    """
    if not torch.is_tensor(t):
        t = torch.tensor(float(t), dtype=torch.float64)
    t = t.to(torch.float64)
    shape = (-1, 1, 1) if t.ndim else ()
    if kind == "cps":  # as in Flow-CPS (arXiv 2509.05952): DDIM's stochastic step on the flow's coefficients
        s = (t - dt).clamp_min(0.0)
        half_pi_eta = noise_level * math.pi / 2
        coef, std = s * (1.0 - math.cos(half_pi_eta)), s * math.sin(half_pi_eta)
        return (1.0 - t).reshape(shape).to(like), coef.reshape(shape).to(like), std.reshape(shape).to(like)
    stochastic_steps(1, kind)  # an unknown kind: ValueError
    one_minus_t = torch.where(t >= 1.0, torch.full_like(t, dt), 1.0 - t)  # at t = 1: 1 - t := dt (finite sigma)
    sigma = noise_level * torch.sqrt(t / one_minus_t)
    t_, sigma_ = t.reshape(shape).to(like), sigma.reshape(shape).to(like)
    return 1.0 - t_, sigma_ ** 2 * dt / (2.0 * t_), sigma_ * math.sqrt(dt)


def sde_mean(x_t: torch.Tensor, v: torch.Tensor, dt: float, one_minus_t: torch.Tensor, coef: torch.Tensor
             ) -> torch.Tensor:
    """x_t, v (B,H,A) and :func:`sde_coefficients` -> the step's mean x_t - dt v - coef (x_t + (1 - t) v)."""
    x1_hat = x_t + one_minus_t * v
    return x_t - dt * v - coef * x1_hat


def sde_step_moments(x_t: torch.Tensor, v: torch.Tensor, t: float | torch.Tensor, dt: float, noise_level: float,
                     kind: str = "flow_sde") -> tuple[torch.Tensor, torch.Tensor]:
    """x_t, v (B,H,A), time t (a float, or (B,) per sample), step size dt = 1/N > 0, noise level a, ``kind`` ->
    (mean (B,H,A), std: a scalar tensor, or (B,1,1) for per-sample t).

    as in Flow-GRPO sde_step_with_logprob / RLinf sample_mean_var_val, or Flow-CPS (see the module docstring).
    """
    one_minus_t, coef, std = sde_coefficients(t, dt, noise_level, x_t, kind)
    return sde_mean(x_t, v, dt, one_minus_t, coef), std


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Elementwise log N(x; mean, std^2) (same shape as x); a density, so it can exceed 0 for small std."""
    z = (x - mean) / std
    return -0.5 * z * z - torch.log(std) - 0.5 * LOG_2PI


def sde_integrate(velocity: Callable[[int, torch.Tensor], torch.Tensor], x: torch.Tensor, num_steps: int,
                  sde_step: int, coefs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                  eps: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The Flow-SDE chain from x (B,H,A) at t = 1: ``velocity(k, x_k)`` the model's v at step k's time (``sde_times``),
    Euler steps x - dt v except the stochastic ones (``sde_steps``: step ``sde_step``, or all with EVERY_STEP), each a
    draw from N(mean, std^2) with ``coefs`` = :func:`sde_coefficients` of its time (with EVERY_STEP: of all N times,
    each (N,1,1), indexed per step) and ``eps()`` its (B,H,A) N(0,1) noise, called once per stochastic step in step
    order -> (chain (B,N+1,H,A): x at t = 1, 1 - dt, ..., 0, log_prob (B,H,A): the stochastic steps'
    log N(chain[:, k+1]; mean_k, std_k^2) summed, the chain's log-density given chain[:, 0]).

    The one loop of both samplers (``PI0Model.sample_actions_sde``, ``FastSampler.sample_actions_sde``); as in
    RLinf's hybrid ODE/SDE sampler, one stochastic step per call shared by the batch, or (EVERY_STEP) as in
    Flow-GRPO, every step stochastic so that the ratio sees every step that moves the actions.
    """
    if not (0 <= sde_step < num_steps or sde_step == EVERY_STEP):  # before any velocity is computed
        raise ValueError(f"sde_step must be in [0, {num_steps}) or EVERY_STEP ({EVERY_STEP}), got {sde_step}")
    dt = 1.0 / num_steps
    stochastic = sde_steps(num_steps, sde_step)
    chain, log_prob = [x], None
    for k in range(num_steps):
        v = velocity(k, x)
        if k in stochastic:
            one_minus_t, coef, std = coefs if sde_step != EVERY_STEP else (c[k] for c in coefs)
            mean = sde_mean(x, v, dt, one_minus_t, coef)
            x = mean + std * eps()
            lp = gaussian_log_prob(x, mean, std)
            log_prob = lp if log_prob is None else log_prob + lp
        else:
            x = x - dt * v  # the deterministic Euler step (t decreasing)
        chain.append(x)
    return torch.stack(chain, 1), log_prob


def chain_coefficients(num_steps: int, sde_step: int, noise_level: float, like: torch.Tensor, kind: str = "flow_sde"
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``coefs`` of :func:`sde_integrate`: :func:`sde_coefficients` of step ``sde_step``'s time (scalars), or with
    EVERY_STEP of all N times (each (N,1,1))."""
    times = sde_times(num_steps)
    t = times[sde_step] if sde_step != EVERY_STEP else torch.tensor(times, dtype=torch.float64)
    return sde_coefficients(t, 1.0 / num_steps, noise_level, like, kind)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, H, A) values, (B, H, A) or broadcastable bool/float mask -> (B,) sum of the masked entries."""
    return (values * mask.to(values.dtype)).flatten(1).sum(-1)


def pick_sde_step(num_steps: int, sde_step: int | None, generator: torch.Generator | None = None,
                  kind: str = "flow_sde") -> int:
    """The stochastic step of one Flow-SDE call: ``sde_step`` (EVERY_STEP for flow_sde), or (None) one drawn
    uniformly from the steps ``kind`` can make stochastic (flow_sde: 0..N-1, cps: 0..N-2) with ``generator`` (one
    randint call: eager and fast samplers draw alike); ValueError outside that range."""
    steps = stochastic_steps(num_steps, kind)
    if sde_step == EVERY_STEP:
        check_sde(kind, 1.0, sde_step, num_steps)
        return EVERY_STEP
    if sde_step is None:
        sde_step = int(torch.randint(steps, (1,), generator=generator))
    if not 0 <= sde_step < steps:
        raise ValueError(f"sde_step must be in [0, {steps}) for {kind} with {num_steps} steps, got {sde_step}")
    return int(sde_step)
